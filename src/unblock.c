/* unblock.c: the answers a shm peer whose process exited will never write, written for it in
 * our own response queue, so that its operations fail and those of live peers queued behind
 * them are reported (docs/reliability.md, finding 24).
 *
 * Why (libfabric 1.17, prov/shm): every operation that is not inline or inject (an RMA write
 * with imm above 4 KiB, a read, a large send) takes the next slot of the sender's own response
 * queue, one FIFO per endpoint, marked FI_EBUSY (smr_format_pend_resp), and the target writes
 * the slot's status once it has handled the command. The sender's progress reads the queue in
 * order and stops at the first slot still FI_EBUSY (smr_progress_resp). A peer killed with
 * commands of ours unanswered leaves their slots FI_EBUSY for good: every later operation of
 * this endpoint, to any peer, answered or not, is never reported, and the stall rule fails them
 * all at `peer_timeout` (and, the head never moving, every later one after).
 *
 * What kvxfer does: once the peer's process has exited (its pidfd; never for a peer that only
 * went silent, which could still answer into a slot reused meanwhile), and no post to it is
 * inside a provider call (p->busy; it is dead, so none can start), the progress thread writes
 * -FI_ECONNRESET into each slot between the queue's read and write counts that (1) is not
 * final yet (FI_EBUSY, or a SAR under way: SAR_FREE, SAR_READY), (2) is a CMA (iov), inject or
 * SAR operation, a SAR one turned into a CMA one first, so that its completion touches nothing
 * of the peer's but its lock and counters (mmap and device-IPC ones are left alone: the stall
 * rule still ends them), and (3) whose pending entry names as its context one of our own
 * transfers to that peer (compared by address with the in-flight list, under the hub lock:
 * nothing is read through a context). It does so under our region's spin lock, as
 * smr_progress_resp holds it, with the AV lock (tried: no remove runs meanwhile), releases
 * dead peers' spin locks first (kx_peers_unstick; shm's completion takes the peer's lock),
 * then sets the region's signal so the next progress reads the queue: the operations fail with
 * ECONNRESET, their transfers end, and the live peers' completions behind them are reported.
 *
 * The remove: shm's completion of a slot reads the peer's region through the AV's map, which
 * fi_av_remove unmaps. So kx_av_remove first waits (bounded) until the progress has read past
 * every slot answered here, and otherwise withdraws the answers of that peer (FI_EBUSY again:
 * the head blocks as before, never a read of unmapped memory).
 *
 * The layout is libfabric 1.17's (smr117.h), read in our own region, mapped here whole: the
 * response queue right after the command queue, the inject pool right after it, the peer table
 * inside the region; a response's msg_id points at the pending entry in our heap (struct
 * smr_tx_entry: the 256-byte command, op_src a uint16 at 20, then the peer's id, then our
 * context at 264). Used only when all of that checks out; otherwise nothing is answered and
 * the finding stands as before. KVXFER_SHM_UNBLOCK=0 turns it off (tests). */

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"
#include "smr117.h"

#define KX_PEND_OP_SRC 20          /* struct smr_tx_entry: cmd.msg.hdr.op_src */
#define KX_PEND_PEER 256           /* ... peer_id, after the command */
#define KX_PEND_CONTEXT 264        /* ... context */
#define KX_SRC_INJECT 1            /* smr_src_inject */
#define KX_SRC_IOV 2               /* smr_src_iov */
#define KX_SRC_SAR 4               /* smr_src_sar */
#define KX_EBUSY FI_EBUSY          /* not answered yet */
#define KX_SAR_FREE 1025           /* SMR_STATUS_SAR_FREE, SMR_STATUS_SAR_READY: a SAR under way */
#define KX_SAR_READY 1026
#define KX_ANSWER ((uint64_t)(-(int64_t)FI_ECONNRESET))
#define KX_RECHECK_NS 10000000LL   /* a dead peer not exited yet, or a post still inside: again in 10 ms */
#define KX_ANSWERED_NONE 1         /* kx_peer.answered: looked at, nothing of its was waiting */
#define KX_ANSWERED_SOME 2         /* ... its slots answered (a remove settles them first) */
#define KX_SETTLE_NS 200000000LL   /* the remove waits at most this long for the progress to read them */

typedef struct kx_unblock {
    unsigned char *map;            /* our region, read-write (untouched pages cost nothing) */
    size_t len;
    volatile uint64_t *q;          /* the response queue: size, mask, read count, write count, slots */
    unsigned char *peers;          /* our peer table (smr_peer_data[256]) */
    int pending;                   /* a dead shm peer may still need answers */
    int64_t next_ns;               /* not before (rechecks) */
    uint64_t until;                /* the write count after our last answers: read past it, none is left */
    uint64_t answered;             /* operations answered for exited peers (stats) */
} kx_unblock;

/* 1 if our region `m` of `len` bytes has 1.17's layout where unblock.c reads it (above) */
static int kx_unblock_layout_ok(const unsigned char *m, size_t len)
{
    int pid;
    memcpy(&pid, m + KX_SMR_PID_OFF, sizeof(pid));
    uint64_t total = kx_smr_u64(m, KX_SMR_TOTAL_OFF), cmdq = kx_smr_u64(m, KX_SMR_CMDQ_OFF);
    uint64_t resp = kx_smr_u64(m, KX_SMR_RESPQ_OFF), inject = kx_smr_u64(m, KX_SMR_INJECT_OFF);
    uint64_t peers = kx_smr_u64(m, KX_SMR_PEERS_OFF);
    if (m[0] != KX_SMR_VERSION || pid != getpid() || total != len || cmdq < KX_SMR_INJECT_OFF + 8 || cmdq % 16 ||
        cmdq + 32 > 4096 || peers <= inject || peers % 8 || peers + (uint64_t)KX_SMR_MAX_PEERS * KX_SMR_PEER_SIZE > total)
        return 0;
    uint64_t n = kx_smr_u64(m, cmdq);
    if (!kx_smr_pow2(n) || kx_smr_u64(m, cmdq + 8) != n - 1 || resp != cmdq + 32 + KX_SMR_CMD_SIZE * n ||
        resp % 8 || inject < resp + 32 || inject > total)
        return 0;
    uint64_t rn = kx_smr_u64(m, resp), rd = kx_smr_u64(m, resp + 16), wr = kx_smr_u64(m, resp + 24);
    return kx_smr_pow2(rn) && kx_smr_u64(m, resp + 8) == rn - 1 && wr - rd <= rn &&
           inject == resp + 32 + KX_SMR_RESP_SIZE * rn;
}

/* map our own region (after kx_local_publish named it); none on a layout we do not know */
void kx_unblock_open(kx_rail *r)
{
    kx_local *self = r->self_local;
    int fd = self ? kx_shm_open_own(r->info->fabric_attr->prov_name, self->name, self->len, "KVXFER_SHM_UNBLOCK") : -1;
    if (fd < 0)
        return;
    struct stat st;
    size_t len = fstat(fd, &st) == 0 && st.st_size >= 4096 ? (size_t)st.st_size : 0;
    unsigned char *m = len ? mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    close(fd);
    if (m == MAP_FAILED)
        return;
    kx_unblock *u = kx_unblock_layout_ok(m, len) ? calloc(1, sizeof(*u)) : NULL;
    if (!u) {
        munmap(m, len);
        return;
    }
    uint64_t resp = kx_smr_u64(m, KX_SMR_RESPQ_OFF), peers = kx_smr_u64(m, KX_SMR_PEERS_OFF);
    u->map = m;
    u->len = len;
    u->q = (volatile uint64_t *)(m + resp);
    u->peers = m + peers;
    r->unblock = u;
}

void kx_unblock_close(kx_rail *r)
{
    kx_unblock *u = r->unblock;
    if (!u)
        return;
    r->unblock = NULL;
    munmap(u->map, u->len);
    free(u);
}

/* a shm peer was declared dead (kx_peer_kill_locked): the next turns look at it */
void kx_unblock_note(kx_rail *r)
{
    if (r->unblock)
        __atomic_store_n(&r->unblock->pending, 1, __ATOMIC_RELEASE);
}

uint64_t kx_unblock_answered(const kx_rail *r)
{
    return r->unblock ? __atomic_load_n(&r->unblock->answered, __ATOMIC_RELAXED) : 0;
}

/* `ctx` is the context of an operation of a transfer of ours to `fa` (under the hub lock) */
static int kx_unblock_ours(kx_rail *r, fi_addr_t fa, uint32_t gen, uintptr_t ctx)
{
    for (kx_transfer *x = r->inflight; x; x = x->next) {
        if (x->peer != fa || (x->gen && x->gen != gen))
            continue;
        if (ctx == (uintptr_t)&x->shared_op)
            return 1;
        if (x->ops && ctx >= (uintptr_t)x->ops && ctx < (uintptr_t)(x->ops + x->planned) &&
            (ctx - (uintptr_t)x->ops) % sizeof(kx_op) == 0)
            return 1;
    }
    return 0;
}

static volatile uint64_t *kx_unblock_slot(kx_unblock *u, uint64_t i)
{
    return u->q + 4 + 2 * (i & u->q[1]);
}

/* the pending entry of slot `s` if it is an operation of ours to `fa`, else NULL */
static unsigned char *kx_unblock_pending_of(kx_rail *r, volatile uint64_t *s, fi_addr_t fa, uint32_t gen)
{
    uint64_t msg_id = s[0];
    if (!msg_id || msg_id % 8)
        return NULL;
    unsigned char *pend = (unsigned char *)(uintptr_t)msg_id;
    uintptr_t ctx;
    memcpy(&ctx, pend + KX_PEND_CONTEXT, sizeof(ctx));
    return kx_unblock_ours(r, fa, gen, ctx) ? pend : NULL;
}

/* Answer `fa`'s unanswered slots (under the hub lock and our region's lock): FI_EBUSY, or a
 * SAR under way (SAR_FREE, SAR_READY). A SAR one becomes a CMA one first (op_src), whose
 * completion reads nothing of the peer's buffers, and our table's SAR mark for the peer goes,
 * as shm's completion of a SAR would clear it (else every later post to that slot id waits).
 * Returns how many it answered. */
static int kx_unblock_answer(kx_rail *r, kx_unblock *u, fi_addr_t fa, uint32_t gen)
{
    int n = 0;
    for (uint64_t i = u->q[2], end = u->q[3]; i != end; i++) {
        volatile uint64_t *s = kx_unblock_slot(u, i);
        uint64_t st = s[1];
        if (st != KX_EBUSY && st != KX_SAR_FREE && st != KX_SAR_READY)
            continue;
        unsigned char *pend = kx_unblock_pending_of(r, s, fa, gen);
        if (!pend)
            continue;
        uint16_t src;
        int64_t id;
        memcpy(&src, pend + KX_PEND_OP_SRC, sizeof(src));
        memcpy(&id, pend + KX_PEND_PEER, sizeof(id));
        if (src == KX_SRC_SAR) {
            if (id < 0 || id >= KX_SMR_MAX_PEERS)
                continue;
            uint16_t iov = KX_SRC_IOV;
            uint32_t zero = 0;
            memcpy(pend + KX_PEND_OP_SRC, &iov, sizeof(iov));
            memcpy(u->peers + (size_t)id * KX_SMR_PEER_SIZE + KX_SMR_PEER_SAR, &zero, sizeof(zero));
        } else if (src != KX_SRC_IOV && src != KX_SRC_INJECT) {
            continue;      /* mmap, ipc: left to the stall rule */
        }
        s[1] = KX_ANSWER;
        n++;
    }
    return n;
}

/* Withdraw `fa`'s answers not read yet (same locks): FI_EBUSY again, never processed */
static int kx_unblock_withdraw(kx_rail *r, kx_unblock *u, fi_addr_t fa, uint32_t gen)
{
    int n = 0;
    for (uint64_t i = u->q[2], end = u->q[3]; i != end; i++) {
        volatile uint64_t *s = kx_unblock_slot(u, i);
        if (s[1] == KX_ANSWER && kx_unblock_pending_of(r, s, fa, gen)) {
            s[1] = KX_EBUSY;
            n++;
        }
    }
    return n;
}

/* From a turn on the CQ (kx_progress_once, poll_owner held): answer for the peers whose process
 * exited. Returns how many operations it answered. */
int kx_unblock_step(kx_rail *r)
{
    kx_unblock *u = r->unblock;
    if (!u || !__atomic_load_n(&u->pending, __ATOMIC_ACQUIRE))
        return 0;
    int64_t now = kx_now_ns();
    if (now < u->next_ns || pthread_mutex_trylock(&r->av_lock))
        return 0;          /* a caller inserts or removes: next turn */
    __atomic_store_n(&u->pending, 0, __ATOMIC_RELEASE);
    int again = 0, answered = 0, unstuck = 0;
    pthread_spinlock_t *lock = (pthread_spinlock_t *)(u->map + KX_SMR_LOCK_OFF);
    for (size_t i = 0; i < __atomic_load_n(&r->peer_hi, __ATOMIC_ACQUIRE); i++) {
        fi_addr_t fa = (fi_addr_t)i;
        kx_peer *p = kx_peer_get(r, fa);
        if (!p || !p->dead || p->removed || p->answered || p->pidfd < 0 || p->local)
            continue;
        if (!kx_pidfd_exited(p->pidfd) || __atomic_load_n(&p->busy, __ATOMIC_SEQ_CST) > 0) {
            again = 1;     /* dying, or a post still inside shm: later */
            continue;
        }
        if (!unstuck++)
            kx_peers_unstick(r);      /* shm's completion takes the dead peer's lock (once a step: it sees every peer) */
        if (pthread_spin_trylock(lock)) {
            again = 1;     /* our progress holds it (or a peer posting to us): later */
            continue;
        }
        pthread_mutex_lock(&r->hub->lock);
        int n = kx_unblock_answer(r, u, fa, p->gen);
        if (n)
            u->until = u->q[3];
        pthread_mutex_unlock(&r->hub->lock);
        pthread_spin_unlock(lock);
        p->answered = n ? KX_ANSWERED_SOME : KX_ANSWERED_NONE;
        answered += n;
    }
    if (answered) {
        __atomic_add_fetch(&u->answered, (uint64_t)answered, __ATOMIC_RELAXED);
        __atomic_store_n((int *)(u->map + KX_SMR_SIGNAL_OFF), 1, __ATOMIC_SEQ_CST);   /* read the queue */
    }
    if (again) {
        u->next_ns = now + KX_RECHECK_NS;
        __atomic_store_n(&u->pending, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&r->av_lock);
    return answered;
}

/* kx_av_remove, with the AV lock, before fi_av_remove: 0 once the progress has read past
 * every answer given here or those for `fa` are withdrawn (see above); -FI_EBUSY if neither
 * could be done (our region's lock held throughout: a peer died holding it, finding 27) */
int kx_unblock_settle(kx_rail *r, fi_addr_t fa, int64_t wait_ns)
{
    kx_unblock *u = r->unblock;
    kx_peer *p = kx_peer_get(r, fa);
    if (!u || !p || p->answered != KX_ANSWERED_SOME)
        return 0;          /* nothing of fa's in the queue is ours to withdraw */
    int64_t end = kx_now_ns() + (wait_ns < KX_SETTLE_NS ? wait_ns : KX_SETTLE_NS);
    while ((int64_t)(u->q[2] - u->until) < 0 && kx_now_ns() < end) {
        __atomic_store_n((int *)(u->map + KX_SMR_SIGNAL_OFF), 1, __ATOMIC_SEQ_CST);
        kx_wake(r);
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    if ((int64_t)(u->q[2] - u->until) >= 0)
        return 0;
    pthread_spinlock_t *lock = (pthread_spinlock_t *)(u->map + KX_SMR_LOCK_OFF);
    for (int k = 0; pthread_spin_trylock(lock); k++) {
        if (k >= 1000)
            return -FI_EBUSY;
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    pthread_mutex_lock(&r->hub->lock);
    int n = kx_unblock_withdraw(r, u, fa, p->gen);
    pthread_mutex_unlock(&r->hub->lock);
    pthread_spin_unlock(lock);
    __atomic_sub_fetch(&u->answered, (uint64_t)n, __ATOMIC_RELAXED);
    return 0;
}
