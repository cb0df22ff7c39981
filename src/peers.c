/* peers.c: the peer table, what kvxfer knows about each peer, so that it never posts into a path that
 * libfabric 1.17 cannot survive, and a dead peer becomes an error in bounded time.
 *
 * Per rail, a table indexed by fi_addr_t (FI_AV_TABLE hands out small indices) holds:
 *   dead      0, or the errno every later post to the peer fails with at once;
 *   local     the peer is an engine of this process: its kx_local cell (see below);
 *   pidfd     shm: a pidfd of the peer's process (its pid is in its endpoint name), which
 *             becomes readable when the process exits (also while it is a zombie);
 *   out/last  operations posted to it and not completed, and when the last one completed
 *             (or the first was posted): the stall clock.
 * A peer is declared dead (and every unfinished transfer to it fails) when
 *   - it is an engine of this process that closed           -> EPIPE
 *   - its process exited (shm pidfd)                         -> ECONNRESET
 *   - the provider reported a connection error for it        -> that errno
 *   - operations to it were outstanding and none completed for `peer_timeout_ns` (every
 *     provider; the only signal shm has for a peer that stopped answering, and the one for
 *     a write the target refused without telling, shm's 64 KiB path) -> ETIMEDOUT
 * Why it must never post to such a peer (libfabric 1.17, observed):
 *   - shm, same process: the closed engine's region is freed; fi_writemsg to it dereferences
 *     it (SIGSEGV in pthread_spin_lock);
 *   - shm, peer SIGKILLed while it held its region's spin lock (it does so while it
 *     progresses): every later fi_writemsg to it spins forever.
 * A transfer failed this way is `done` for its waiters at once, but stays on the in-flight
 * list (the provider may still own its contexts) until its operations complete or the
 * endpoint closes; its source registration counts as busy until then.
 * Same-process peers are local.c's cells, shm endpoint names names.c's, a shm peer's region
 * lock shmlock.c's. */

#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "internal.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

/* the entry of `fa`, NULL if untracked. Lock-free: chunks are published once and never move. */
kx_peer *kx_peer_get(kx_rail *r, fi_addr_t fa)
{
    if (!r->pdir || fa >= (fi_addr_t)KX_PEER_CHUNK * KX_PEER_CHUNKS)
        return NULL;
    kx_peer *c = __atomic_load_n(&r->pdir[fa / KX_PEER_CHUNK], __ATOMIC_ACQUIRE);
    if (!c)
        return NULL;
    kx_peer *p = &c[fa % KX_PEER_CHUNK];
    return __atomic_load_n(&p->used, __ATOMIC_ACQUIRE) ? p : NULL;
}

/* the table entry of a peer just inserted at `fa` (by the caller, nothing posts to it yet) */
int kx_peer_add(kx_rail *r, fi_addr_t fa, const void *name, size_t len)
{
    if (!r->pdir || fa >= (fi_addr_t)KX_PEER_CHUNK * KX_PEER_CHUNKS)
        return 0;           /* not a small table index: untracked (never with FI_AV_TABLE) */
    kx_local *local = kx_local_find(name, len);
    pid_t owner = kx_shm_pid(r->info->fabric_attr->prov_name, name, len);
    pid_t pid = local ? 0 : owner;
    kx_bell *bell = owner > 0 ? kx_bell_open(name, len, owner) : NULL;   /* shm: its doorbell */
    int fd = -1, dead = 0;
    if (pid > 0 && pid != getpid()) {
        fd = (int)syscall(SYS_pidfd_open, pid, 0);
        if (fd < 0 && errno == ESRCH)
            dead = ECONNRESET;
    }
    pthread_mutex_lock(&r->hub->lock);
    kx_peer **slot = &r->pdir[fa / KX_PEER_CHUNK];
    if (!*slot) {
        kx_peer *c = calloc(KX_PEER_CHUNK, sizeof(kx_peer));
        if (!c) {
            pthread_mutex_unlock(&r->hub->lock);
            if (local)
                kx_local_unref(local);
            if (fd >= 0)
                close(fd);
            kx_bell_close(bell);
            return -FI_ENOMEM;
        }
        __atomic_store_n(slot, c, __ATOMIC_RELEASE);
    }
    kx_peer *p = &(*slot)[fa % KX_PEER_CHUNK];
    kx_local *old = p->used ? p->local : NULL;
    int oldfd = p->used ? p->pidfd : -1;
    void *oldmap = p->used ? p->map : NULL;
    kx_bell *oldbell = p->used ? p->bell : NULL;
    /* the new generation first, `dead` last: a poster that reads this insert's `dead`
     * reads its generation too (kx_peer_enter checks the generation after `dead`), so a
     * post meant for the slot's old peer is refused however the two interleave */
    uint32_t gen = p->gen + 1;
    __atomic_store_n(&p->gen, gen ? gen : 1, __ATOMIC_SEQ_CST);
    p->bell = bell;
    p->pidfd = fd;
    p->pid = fd >= 0 ? pid : 0;
    p->lockw = NULL;
    p->map = NULL;
    if (fd >= 0)
        kx_shm_lock_map(p, name, len, pid);
    p->local = local;
    p->out = 0;
    p->refused_ns = 0;
    p->alive_ns = 0;
    p->removed = 0;
    p->answered = 0;
    p->last_ns = kx_now_ns();
    p->name_hash = kx_name_hash(name, len);
    __atomic_store_n(&p->dead, dead, __ATOMIC_SEQ_CST);
    __atomic_store_n(&p->used, 1, __ATOMIC_RELEASE);
    if ((size_t)fa + 1 > r->peer_hi)
        r->peer_hi = (size_t)fa + 1;
    pthread_mutex_unlock(&r->hub->lock);
    if (old)
        kx_local_unref(old);
    if (oldfd >= 0)
        close(oldfd);
    kx_shm_lock_unmap(oldmap);
    kx_bell_close(oldbell);
    if (local)
        kx_local_link(r, local);
    return 0;
}

/* forget a removed peer (fi_av_remove; kx_av_remove saw no post inside a provider call to
 * it): the slot stays a tombstone, dead with ENOTCONN, until libfabric reuses it for the next
 * peer inserted (kx_peer_add bumps its generation). Returns its local cell, if any, with the
 * entry's reference (the caller unlinks and unrefs it: kx_peer_forget, forget.c). */
kx_local *kx_peer_forget_entry(kx_rail *r, fi_addr_t fa)
{
    pthread_mutex_lock(&r->hub->lock);
    kx_peer *p = kx_peer_get(r, fa);
    kx_local *c = NULL;
    int fd = -1;
    void *map = NULL;
    kx_bell *bell = NULL;
    if (p) {
        c = p->local;
        fd = p->pidfd;
        map = p->map;
        bell = p->bell;
        p->bell = NULL;
        p->local = NULL;
        p->pidfd = -1;
        __atomic_store_n(&p->dead, ENOTCONN, __ATOMIC_SEQ_CST);
        p->removed = 1;
        p->out = 0;
        p->refused_ns = 0;
        p->lockw = NULL;
        p->map = NULL;
    }
    pthread_mutex_unlock(&r->hub->lock);
    if (fd >= 0)
        close(fd);
    kx_shm_lock_unmap(map);
    kx_bell_close(bell);
    return c;
}

void kx_peer_forget(kx_rail *r, fi_addr_t fa)
{
    kx_local *c = kx_peer_forget_entry(r, fa);
    if (c) {
        kx_local_unlink(r, c);
        kx_local_unref(c);
    }
}

int kx_pidfd_exited(int fd)
{
    struct pollfd pfd = {fd, POLLIN, 0};
    return poll(&pfd, 1, 0) > 0;
}


/* whether a shm peer's process has exited, for a poster: its pidfd, polled at most every
 * KX_ALIVE_NS (a peer that dies in between is a post into its region, as one that dies just
 * after the poll always was: the lock wait, the peer scan and the stall deadline catch it) */
static int kx_peer_exited(kx_peer *p)
{
    int64_t now = kx_now_ns();
    if (now - __atomic_load_n(&p->alive_ns, __ATOMIC_RELAXED) < KX_ALIVE_NS)
        return 0;
    if (kx_pidfd_exited(p->pidfd))
        return 1;
    __atomic_store_n(&p->alive_ns, now, __ATOMIC_RELAXED);
    return 0;
}

/* Declare `fa` dead with `err`: later posts fail at once, unfinished transfers to it fail
 * now (their waiters wake), queued ones are swept. Under the hub lock. */
void kx_peer_kill_locked(kx_rail *r, fi_addr_t fa, int err)
{
    kx_peer *p = kx_peer_get(r, fa);
    if (!p || p->dead)
        return;
    __atomic_store_n(&p->dead, err, __ATOMIC_SEQ_CST);     /* kx_peer_enter's Dekker partner */
    for (kx_transfer *x = r->inflight; x; x = x->next)
        if (x->peer == fa)
            kx_transfer_fail_locked(r, x, err);
    __atomic_store_n(&r->cancel_pending, 1, __ATOMIC_RELEASE);
    if (p->pidfd >= 0)
        kx_unblock_note(r);     /* shm: once its process exited, its unanswered operations are answered (unblock.c) */
    pthread_cond_broadcast(&r->hub->cond);
}

/* 0 if `fa` may be posted to now, else the errno to fail with. Cheap for tcp (one load),
 * one poll(2) for shm peers in other processes. Call without the hub lock. */
int kx_peer_gone(kx_rail *r, fi_addr_t fa)
{
    kx_peer *p = kx_peer_get(r, fa);
    if (!p)
        return 0;
    int d = __atomic_load_n(&p->dead, __ATOMIC_SEQ_CST);
    if (d)
        return d;
    if (p->local && __atomic_load_n(&p->local->closed, __ATOMIC_SEQ_CST))
        d = EPIPE;
    else if (p->pidfd >= 0 && kx_peer_exited(p))
        d = ECONNRESET;
    else
        d = kx_shm_lock_wait(r, p);
    if (d) {
        pthread_mutex_lock(&r->hub->lock);
        kx_peer_kill_locked(r, fa, d);
        pthread_mutex_unlock(&r->hub->lock);
    }
    return d;
}

/* Bracket one post to `fa` as the caller named it (`gen`: the slot's generation then; 0:
 * unchecked): 0 and entered (call kx_peer_leave after the post), or the errno the post must
 * fail with (nothing entered). While entered, kx_av_remove waits (p->busy), so no provider
 * call ever reaches a removed address; a slot reused since the caller named it (another
 * generation) answers ENOTCONN, so a post never reaches the peer that took its place. Keeps a
 * local peer's endpoint open meanwhile. (Dekker with kx_av_remove: busy++ then read dead,
 * against dead = ENOTCONN then read busy, seq_cst on both sides.) */
int kx_peer_enter(kx_rail *r, fi_addr_t fa, uint32_t gen)
{
    kx_peer *p = kx_peer_get(r, fa);
    if (p)
        __atomic_add_fetch(&p->busy, 1, __ATOMIC_SEQ_CST);
    int d = kx_peer_gone(r, fa);
    /* after `dead` was read: an insert that reused the slot stored its generation before
     * clearing `dead` (kx_peer_add), so a stale caller is refused here */
    if (!d && p && gen && __atomic_load_n(&p->gen, __ATOMIC_SEQ_CST) != gen)
        d = ENOTCONN;
    if (!d && p && p->local) {
        __atomic_add_fetch(&p->local->busy, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&p->local->closed, __ATOMIC_SEQ_CST)) {
            __atomic_sub_fetch(&p->local->busy, 1, __ATOMIC_SEQ_CST);
            d = kx_peer_gone(r, fa);
        }
    }
    if (d && p)
        __atomic_sub_fetch(&p->busy, 1, __ATOMIC_SEQ_CST);
    return d;
}

void kx_peer_leave(kx_rail *r, fi_addr_t fa)
{
    kx_peer *p = kx_peer_get(r, fa);
    if (!p)
        return;
    if (p->local)
        __atomic_sub_fetch(&p->local->busy, 1, __ATOMIC_SEQ_CST);
    __atomic_sub_fetch(&p->busy, 1, __ATOMIC_SEQ_CST);
}

/* whether `fa`'s slot still holds the peer of generation `gen` (0: unchecked): a removed
 * peer's late completions must not count for, or kill, the next peer in its slot */
int kx_peer_is(kx_rail *r, fi_addr_t fa, uint32_t gen)
{
    return !gen || kx_peer_gen(r, fa) == gen;
}

/* the generation of `fa`'s slot (0: not a peer of this rail) */
uint32_t kx_peer_gen(kx_rail *r, fi_addr_t fa)
{
    kx_peer *p = kx_peer_get(r, fa);
    return p ? __atomic_load_n(&p->gen, __ATOMIC_SEQ_CST) : 0;
}

/* kx_av_remove's first half: ENOTCONN from now on, then wait (up to wait_ns) for posts still
 * inside a provider call to `fa` to leave. 0, or -FI_EBUSY at the deadline. */
int kx_peer_retire(kx_rail *r, fi_addr_t fa, int64_t wait_ns)
{
    kx_peer *p = kx_peer_get(r, fa);
    if (!p)
        return 0;
    pthread_mutex_lock(&r->hub->lock);
    kx_peer_kill_locked(r, fa, ENOTCONN);
    pthread_mutex_unlock(&r->hub->lock);
    int64_t end = kx_now_ns() + wait_ns;
    for (int k = 0; __atomic_load_n(&p->busy, __ATOMIC_SEQ_CST) > 0; k++) {
        if (kx_now_ns() >= end)
            return -FI_EBUSY;
        if (__atomic_load_n(&r->stop, __ATOMIC_SEQ_CST))
            return -FI_ECANCELED;       /* the rail is closing: its quiesce waits for us */
        if (k % 200 == 199)
            kx_peers_unstick(r);        /* a post spinning on a dead shm peer's lock (~every 10 ms) */
        struct timespec ts = {0, 50000};
        nanosleep(&ts, NULL);
    }
    return 0;
}

/* an operation to `fa` was posted (1) or completed (-1); any thread */
void kx_peer_count(kx_rail *r, fi_addr_t fa, int delta)
{
    kx_peer *p = kx_peer_get(r, fa);
    if (!p)
        return;
    if (delta < 0 || __atomic_load_n(&p->out, __ATOMIC_ACQUIRE) == 0)
        __atomic_store_n(&p->last_ns, kx_now_ns(), __ATOMIC_RELEASE);
    if (__atomic_add_fetch(&p->out, delta, __ATOMIC_ACQ_REL) < 0)
        __atomic_store_n(&p->out, 0, __ATOMIC_RELEASE);
}

/* undo the count of a post the provider refused (the stall clock keeps running); `again`:
 * it was -FI_EAGAIN, which starts the refusal clock (rxm answers a peer it cannot connect
 * to with -FI_EAGAIN for ever) */
void kx_peer_uncount(kx_rail *r, fi_addr_t fa, int again)
{
    kx_peer *p = kx_peer_get(r, fa);
    if (!p)
        return;
    if (__atomic_sub_fetch(&p->out, 1, __ATOMIC_ACQ_REL) < 0)
        __atomic_store_n(&p->out, 0, __ATOMIC_RELEASE);
    if (again && __atomic_load_n(&p->refused_ns, __ATOMIC_ACQUIRE) == 0)
        __atomic_store_n(&p->refused_ns, kx_now_ns(), __ATOMIC_RELEASE);
}

/* a post to `fa` was accepted: the refusal clock stops */
void kx_peer_accepted(kx_rail *r, fi_addr_t fa)
{
    kx_peer *p = kx_peer_get(r, fa);
    if (p && __atomic_load_n(&p->refused_ns, __ATOMIC_RELAXED))
        __atomic_store_n(&p->refused_ns, 0, __ATOMIC_RELEASE);
    if (p && p->bell && kx_bell_ring(p->bell))      /* it sleeps: wake it to read our post */
        __atomic_add_fetch(&r->stat_bell_rings, 1, __ATOMIC_RELAXED);
}

int kx_is_peer_errno(int err)
{
    switch (err) {
    case ECONNREFUSED: case ECONNRESET: case ECONNABORTED: case EPIPE: case ENOTCONN:
    case EHOSTUNREACH: case EHOSTDOWN: case ENETUNREACH: case ENETDOWN: case ETIMEDOUT:
        return 1;
    default:
        return 0;
    }
}

/* The progress thread's look at its peers (every KX_PEER_SCAN_NS): stalled or exited peers
 * die. Returns how many it declared dead. */
int kx_peers_scan(kx_rail *r)
{
    int64_t now = kx_now_ns();
    if (now - r->last_scan_ns < KX_PEER_SCAN_NS)
        return 0;
    r->last_scan_ns = now;
    int killed = 0;
    pthread_mutex_lock(&r->hub->lock);
    /* a transfer whose own operations stay outstanding with none completing (a write the
     * target refused without answering: shm's CMA path) fails alone; its operations are
     * written off the peer's count, so a peer that answers everything else lives on */
    for (kx_transfer *x = r->inflight; r->peer_timeout_ns > 0 && x; x = x->next) {
        /* what the provider took (not `posted`, which counts a post in progress that may
         * still be refused and taken back) */
        int64_t open = __atomic_load_n(&x->accepted, __ATOMIC_ACQUIRE) - x->completed - x->written_off;
        if (!x->done && open > 0 && now - __atomic_load_n(&x->last_ns, __ATOMIC_ACQUIRE) > r->peer_timeout_ns) {
            kx_transfer_fail_locked(r, x, ETIMEDOUT);
            x->written_off += open;
            __atomic_store_n(&r->wrote_off, 1, __ATOMIC_RELEASE);
            /* off the rail's count too: shm never completes a refused CMA write, and one
             * left there would keep the progress thread from sleeping on the CQ fd and
             * every later close() draining to its deadline */
            __atomic_sub_fetch(&r->outstanding, open, __ATOMIC_RELAXED);
            if (kx_peer_is(r, x->peer, x->gen))     /* not a removed peer's leftover */
                for (int64_t k = 0; k < open; k++)
                    kx_peer_uncount(r, x->peer, 0);
            killed++;
        }
    }
    for (size_t i = 0; r->pdir && i < r->peer_hi; i++) {
        kx_peer *c = r->pdir[i / KX_PEER_CHUNK];
        if (!c) {
            i += KX_PEER_CHUNK - 1 - i % KX_PEER_CHUNK;
            continue;
        }
        kx_peer *p = &c[i % KX_PEER_CHUNK];
        if (!p->used || p->dead)
            continue;
        int d = 0;
        if (p->local && __atomic_load_n(&p->local->closed, __ATOMIC_SEQ_CST))
            d = EPIPE;
        else if (__atomic_load_n(&p->out, __ATOMIC_ACQUIRE) > 0 && p->pidfd >= 0 && kx_pidfd_exited(p->pidfd))
            d = ECONNRESET;
        else if (__atomic_load_n(&p->out, __ATOMIC_ACQUIRE) > 0 && r->peer_timeout_ns > 0 &&
                 now - __atomic_load_n(&p->last_ns, __ATOMIC_ACQUIRE) > r->peer_timeout_ns)
            d = ETIMEDOUT;
        else if (r->peer_timeout_ns > 0 && __atomic_load_n(&p->refused_ns, __ATOMIC_ACQUIRE) &&
                 now - __atomic_load_n(&p->refused_ns, __ATOMIC_ACQUIRE) > r->peer_timeout_ns)
            d = ETIMEDOUT;
        if (d) {
            kx_peer_kill_locked(r, (fi_addr_t)i, d);
            killed++;
        }
    }
    pthread_mutex_unlock(&r->hub->lock);
    return killed;
}

/* operations outstanding to peers not known dead (what a drain may still wait for) */
int64_t kx_outstanding_live(kx_rail *r)
{
    int64_t n = __atomic_load_n(&r->outstanding, __ATOMIC_SEQ_CST);
    if (n <= 0)
        return 0;
    pthread_mutex_lock(&r->hub->lock);
    for (size_t i = 0; r->pdir && i < r->peer_hi; i++) {
        kx_peer *c = r->pdir[i / KX_PEER_CHUNK];
        if (!c) {
            i += KX_PEER_CHUNK - 1 - i % KX_PEER_CHUNK;
            continue;
        }
        kx_peer *p = &c[i % KX_PEER_CHUNK];
        if (p->used && p->dead)
            n -= __atomic_load_n(&p->out, __ATOMIC_ACQUIRE);
    }
    pthread_mutex_unlock(&r->hub->lock);
    return n;
}

/* teardown: drop every peer entry (after the endpoint is closed) */
void kx_peers_free(kx_rail *r)
{
    for (size_t k = 0; r->pdir && k < KX_PEER_CHUNKS; k++) {
        kx_peer *c = r->pdir[k];
        if (!c)
            continue;
        for (size_t i = 0; i < KX_PEER_CHUNK; i++) {
            if (c[i].used && c[i].local)
                kx_local_unref(c[i].local);
            if (c[i].used && c[i].pidfd >= 0)
                close(c[i].pidfd);
            if (c[i].used) {
                kx_shm_lock_unmap(c[i].map);
                kx_bell_close(c[i].bell);
            }
        }
        free(c);
    }
    free(r->pdir);
    r->pdir = NULL;
    if (r->self_local) {
        kx_local_unref(r->self_local);
        r->self_local = NULL;
    }
}
