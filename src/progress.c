/* progress.c: reading the CQ, and the progress thread that does it.
 *
 * Both providers kvxfer is tested on progress data manually: nothing lands at a target, and
 * no send finishes, unless someone reads the CQ. kx_poll() is that someone. One thread at a
 * time reads (the poll_owner flag, taken with a try-lock), so completions are handled in CQ
 * order and control messages stay in order.
 *
 * Who reads: the progress thread owns the CQ while nobody waits. A thread that waits for a
 * transfer, a counter or a message can drive progress itself for a short window (spin_ns:
 * KVXFER_DRIVE_US microseconds, off by default, see kx_drive_ns_from_env; a transfer's waiter
 * on shm drives for KX_TX_DRIVE_SHM_NS by default, tx_spin_ns; only while the rail
 * has operations out or had traffic in the last 10 ms, so a thread idling in recv() never
 * spins): it reads the CQ in its own loop, so the completion it waits for costs no thread
 * hand-off (poster -> progress thread -> condition variable -> waiter). Meanwhile the
 * progress thread parks on a futex; the waiter wakes it when it stops driving, whether it
 * got what it waited for or its window ran out and it now blocks on the condition variable
 * as before. The progress thread sleeps on the CQ's fd without holding poll_owner (tcp),
 * so a driver never waits for it to be scheduled.
 *
 * Blocking mode (the default, for 2-core machines): while tx operations are outstanding, or
 * for a short window after the last completion, the thread polls with sched_yield between
 * empty reads (sleeps briefly where a yield took a millisecond, the core being contended, and
 * naps at SCHED_FIFO: kx_progress_pause); otherwise it blocks: poll() on the CQ's wait fd
 * after fi_trywait where the provider has one (tcp), fi_cq_sread where it has a wait object
 * but no fd, else (shm) a futex wait on the rail's doorbell (bell.c) with an exponential
 * back-off capped at 10 ms, or a condition-variable wait capped at 1 ms where it has no
 * doorbell. Posting threads signal it so a new transfer never waits out a back-off. Spin mode
 * never blocks.
 *
 * SCHED_FIFO (kx_rail_set_progress_rt, Engine(progress_rt_priority=)): the thread puts itself
 * at that priority when it starts. On a loaded machine a normal thread waits about a millisecond
 * in the run queue at each wake-up, and tcp needs a wake-up on each side per message
 * (docs/benchmarks.md, issue 28 item 3). Under FIFO sched_yield() yields only to FIFO threads
 * of the same priority, so the polls between empty reads above nap KX_RT_NAP_NS instead: the
 * thread still answers within tens of microseconds, and lower threads on its core still run.
 * Spin mode never sleeps, so it is refused at FIFO. */
#include "internal.h"

#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#define KX_SPIN_WINDOW_NS   200000LL     /* keep polling 200 us after activity */
#define KX_STALL_NS         200000000LL  /* outstanding but silent this long: back off */
#define KX_MAX_BACKOFF_NS   1000000LL
#define KX_MAX_BACKOFF_BELL_NS 10000000LL /* shm with a doorbell: kvxfer writers ring it, so the
                                               * back-off only serves writers without one */
#define KX_RECENT_NS        10000000LL   /* ... if the rail was busy this recently (or has ops out) */
#define KX_PARK_NS          1000000LL    /* a parked progress thread looks again after this */
#define KX_RT_NAP_NS        20000L       /* at SCHED_FIFO, or on a contended core: the pause between empty polls */
#define KX_YIELD_LONG_NS    1000000LL    /* a yield that took longer: another thread ran its slice, the core is contended */
#define KX_CONTENDED_NS     100000000LL  /* ... nap instead of yielding for this long, then yield again */

/* KVXFER_DRIVE_US: microseconds a waiter drives progress before it blocks; unset: the
 * defaults below, 0: never. On the 2-core machine it was measured on (docs/benchmarks.md,
 * issue 13) driving lowered the best round trips but not the median, on tcp it raised the
 * median: two processes whose waiters spin take the CPU from each other. Opt in where cores
 * are free, e.g. KVXFER_DRIVE_US=200. KVXFER_DRIVE_TX_US sets the transfers' window alone
 * (it wins over KVXFER_DRIVE_US for them). Returns -1 when unset (or not a number). */
static int64_t kx_drive_ns_from_env(const char *name)
{
    const char *v = getenv(name);
    if (!v || !*v)
        return -1;
    char *end;
    long long us = strtoll(v, &end, 10);
    if (*end || us < 0)
        return -1;
    return us > 1000000 ? 1000000000LL : us * 1000LL;
}

/* The default for the waiter of a small transfer (at most KX_TX_DRIVE_MAX_BYTES, internal.h)
 * on shm, where such a write completes within a few
 * microseconds of its post (a direct write at once; an RMA write once the target's progress
 * thread answered): reading the CQ for this long saves the two thread hand-offs (progress
 * thread -> condition variable -> waiter) that cost 10-30 us here, and costs at most this
 * much CPU when the completion is later (docs/benchmarks.md, issue 28 item 4). Not on tcp,
 * where the completion waits for the target's acknowledgement through the kernel (tens of
 * microseconds) and a driving sender measured slower; not for counters and messages, whose
 * waits are long and whose drive made round trips slower (same section). */
#define KX_TX_DRIVE_SHM_NS 50000LL

static void kx_drive_windows(kx_rail *r)
{
    int64_t env = kx_drive_ns_from_env("KVXFER_DRIVE_US");
    int64_t tx = kx_drive_ns_from_env("KVXFER_DRIVE_TX_US");     /* the transfers' window alone */
    __atomic_store_n(&r->spin_ns, env >= 0 ? env : 0, __ATOMIC_RELAXED);
    __atomic_store_n(&r->tx_spin_ns, tx >= 0 ? tx : env >= 0 ? env : (r->shm && !r->spin ? KX_TX_DRIVE_SHM_NS : 0),
                     __ATOMIC_RELAXED);
}

int kx_rail_set_progress_rt(kx_rail *r, int priority)
{
    if (priority == 0) {
        r->rt_priority = 0;
        return 0;
    }
    int lo = sched_get_priority_min(SCHED_FIFO), hi = sched_get_priority_max(SCHED_FIFO);
    if (r->thread_started || r->spin || lo < 0 || hi < 0 || priority < lo || priority > hi)
        return -FI_EINVAL;
    r->rt_priority = priority;
    return 0;
}

int kx_rail_progress_rt(const kx_rail *r, int *err)
{
    if (err)
        *err = __atomic_load_n(&r->rt_errno, __ATOMIC_ACQUIRE);
    return __atomic_load_n(&r->rt, __ATOMIC_ACQUIRE);
}

/* the progress thread, first thing: SCHED_FIFO on itself if asked; then tell kx_rail_start */
static void kx_progress_rt_self(kx_rail *r)
{
    int err = 0, granted = 0;
    if (r->rt_priority > 0) {
        struct sched_param sp = {.sched_priority = r->rt_priority};
        err = pthread_setschedparam(pthread_self(), SCHED_FIFO, &sp);
        int policy;
        if (!err && pthread_getschedparam(pthread_self(), &policy, &sp) == 0 && policy == SCHED_FIFO)
            granted = sp.sched_priority;
    }
    __atomic_store_n(&r->rt, granted, __ATOMIC_RELEASE);
    __atomic_store_n(&r->rt_errno, err, __ATOMIC_RELEASE);
    __atomic_store_n(&r->rt_done, 1, __ATOMIC_RELEASE);
    syscall(SYS_futex, &r->rt_done, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

void kx_progress_rt_await(kx_rail *r)
{
    if (r->rt_priority <= 0)
        return;
    int64_t until = kx_now_ns() + 5000000000LL;   /* a thread not scheduled in 5 s: report it later */
    while (!__atomic_load_n(&r->rt_done, __ATOMIC_ACQUIRE) && kx_now_ns() < until) {
        struct timespec ts = {0, 10000000};
        syscall(SYS_futex, &r->rt_done, FUTEX_WAIT_PRIVATE, 0, &ts, NULL, 0);
    }
}

/* Sleep on the CQ's wait fd for up to `ms` without holding poll_owner, so a waiter that starts
 * to drive never waits for this thread to be scheduled again; fi_trywait says whether sleeping
 * is safe (nothing is left to read) */
static void kx_sleep_on_fd(kx_rail *r, int wait_fd, int ms)
{
    struct fid *cqfid = &r->cq->fid;
    if (fi_trywait(r->fabric, &cqfid, 1) == FI_SUCCESS) {
        struct pollfd pfd = {.fd = wait_fd, .events = POLLIN};
        poll(&pfd, 1, ms);
    }
}

/* block mode's pause between empty polls: sched_yield, or a short nap where a yield would
 * not come back soon. At SCHED_FIFO always a nap (a FIFO thread's yield lets no normal thread
 * run). At normal scheduling a yield to a busy thread of the same core lasts that thread's
 * slice (1.4 ms on average, up to 4 ms, measured beside a busy loop on this 2-core VM's
 * kernel; 0.4 us when nothing else runs), and the thread reads nothing meanwhile: on tcp, which
 * needs both progress threads turn by turn per message, that was item 3's backlog. So a
 * yield that took over KX_YIELD_LONG_NS, twice in a row (one may be a stray preemption),
 * marks the core contended; the pauses then sleep (a sleeper's wake-up preempts the busy
 * thread), on the CQ's fd for up to 1 ms where the provider has one (tcp: a socket's data
 * wakes it; whether its send room does was not checked), else for KX_RT_NAP_NS, and yield
 * once more only after KX_CONTENDED_NS, to see whether the core is free again (stats: naps;
 * figures: docs/benchmarks.md, issue 28 item 3, bench/busy_core.c). */
static void kx_progress_pause(kx_rail *r, int wait_fd)
{
    if (r->rt > 0) {
        struct timespec ts = {0, KX_RT_NAP_NS};
        nanosleep(&ts, NULL);
        return;
    }
    int64_t t0 = kx_now_ns();
    if (t0 < r->probe_ns) {
        __atomic_add_fetch(&r->stat_naps, 1, __ATOMIC_RELAXED);
        if (wait_fd >= 0) {
            /* tcp: sleep on the CQ's fd, which a socket's data wakes (a 20 us nap
             * between polls halved a 16 KiB x 4096 write on a quiet machine: the socket
             * drains faster than that) */
            kx_sleep_on_fd(r, wait_fd, 1);
            return;
        }
        struct timespec ts = {0, KX_RT_NAP_NS};
        nanosleep(&ts, NULL);
        return;
    }
    sched_yield();
    int64_t t1 = kx_now_ns();
    if (t1 - t0 > KX_YIELD_LONG_NS) {
        if (++r->long_yields >= 2) {
            r->probe_ns = t1 + KX_CONTENDED_NS;
            r->long_yields = 0;
        }
    } else {
        r->long_yields = 0;
    }
}

static int kx_poll_try(kx_rail *r)
{
    return __atomic_exchange_n(&r->poll_owner, 1, __ATOMIC_ACQUIRE) == 0;
}

static void kx_poll_done(kx_rail *r)
{
    __atomic_store_n(&r->poll_owner, 0, __ATOMIC_RELEASE);
}

static void kx_futex(int *word, int op, int val, const struct timespec *ts)
{
    syscall(SYS_futex, word, op, val, ts, NULL, 0);
}

int kx_post_recv(kx_rail *r, kx_rxbuf *b)
{
    return (int)fi_recv(r->ep, b->data, KX_MSG_MAX, r->rx_desc, FI_ADDR_UNSPEC, &b->op.fi);
}

static void kx_complete_recv_locked(kx_rail *r, kx_rxbuf *b, size_t len, int err)
{
    kx_hub *h = r->hub;
    r->took_msgs = 1;
    if (!err) {
        kx_msg *m = malloc(sizeof(kx_msg) + len);
        if (m) {
            m->next = NULL;
            m->len = len;
            memcpy(m->data, b->data, len);
            /* an ANNOUNCE a leg waits for: armed here, before the messenger thread reads it */
            m->quiet = kx_arm_try_locked(h, m->data, len) == 2;
            if (h->msg_tail)
                h->msg_tail->next = m;
            else
                h->msg_head = m;
            h->msg_tail = m;
            h->nmsgs++;
            if (!m->quiet) {
                h->nloud++;
                pthread_cond_broadcast(&h->msg_cond);     /* only kx_recv_wait waits for messages */
            }
        }
    } else {
        r->stat_rx_err++;
    }
    b->repost = 1;     /* reposted by kx_repost once the lock is released */
}

static void kx_complete_locked(kx_rail *r, void *context, uint64_t flags, uint64_t data, size_t len, int err)
{
    if (kx_ctl_is(flags, data) && context && !err && ((kx_op *)context)->kind == KX_OP_RECV) {
        /* the revoke exchange's (revoke.c): handled here, never queued for recv() */
        kx_rxbuf *b = (kx_rxbuf *)((kx_op *)context)->owner;
        r->took_msgs = 1;
        kx_ctl_arrival_locked(r, (uint32_t)data, b->data, len);
        b->repost = 1;
        return;
    }
    if ((flags & FI_REMOTE_CQ_DATA) && !err) {
        if (kx_hub_arrival_locked(r->hub, (uint32_t)data))
            r->stat_rx_err++;
        if (!context || !(flags & FI_RECV))
            return;
    }
    kx_op *op = (kx_op *)context;
    if (!op) {
        if (err)
            r->stat_rx_err++;
        return;
    }
    switch (op->kind) {
    case KX_OP_WRITE:
    case KX_OP_READ: {     /* a read completes here, on the reader's CQ, like a write */
        kx_transfer *x = (kx_transfer *)op->owner;
        int current = kx_peer_is(r, x->peer, x->gen);   /* not a removed peer's leftover */
        if (x->written_off > 0) {
            x->written_off--;            /* already taken off the rail's and the peer's counts */
        } else {
            __atomic_sub_fetch(&r->outstanding, 1, __ATOMIC_RELAXED);
            if (current)
                kx_peer_count(r, x->peer, -1);
        }
        __atomic_store_n(&x->last_ns, kx_now_ns(), __ATOMIC_RELEASE);
        x->completed++;
        if (err && !x->error)
            x->error = err;
        if (err && kx_is_peer_errno(err) && current)
            kx_peer_kill_locked(r, x->peer, err);
        kx_transfer_check_done_locked(r, x);
        break;
    }
    case KX_OP_SEND: {
        kx_sendbuf *s = (kx_sendbuf *)op->owner;
        int current = kx_peer_is(r, s->peer, s->gen);
        __atomic_sub_fetch(&r->outstanding, 1, __ATOMIC_RELAXED);
        if (current)
            kx_peer_count(r, s->peer, -1);
        if (s->token) {
            /* the revoke exchange's: its error says only that the peer is gone (the engine
             * stops waiting for it); a HELLO to a peer not yet listening kills nothing */
            kx_ctl_sent_locked(r, s, err);
        } else {
            if (err && kx_is_peer_errno(err) && current)
                kx_peer_kill_locked(r, s->peer, err);
            if (err)
                r->stat_rx_err++;
        }
        if (s->mr)
            fi_close(&s->mr->fid);
        free(s);
        break;
    }
    case KX_OP_RECV:
        kx_complete_recv_locked(r, (kx_rxbuf *)op->owner, len, err);
        break;
    }
}

/* repost the receive buffers whose messages were taken (never under the hub lock) */
static void kx_repost(kx_rail *r)
{
    for (int i = 0; i < KX_RX_BUFS; i++) {
        kx_rxbuf *b = &r->rx[i];
        if (!b->repost || r->stop)
            continue;
        int ret, tries = 0;
        do {
            ret = kx_post_recv(r, b);
        } while (ret == -FI_EAGAIN && ++tries < 1000);
        if (ret == 0) {
            b->repost = 0;
        } else if (ret != -FI_EAGAIN) {
            b->repost = 0;     /* lost: count it rather than retry forever */
            r->stat_rx_err++;
        }
    }
}

static void kx_handle_batch(kx_rail *r, struct fi_cq_data_entry *ent, ssize_t n)
{
    int rx = 0;
    pthread_mutex_lock(&r->hub->lock);
    for (ssize_t i = 0; i < n; i++) {
        kx_complete_locked(r, ent[i].op_context, ent[i].flags, ent[i].data, ent[i].len, 0);
        rx |= (ent[i].flags & FI_RECV) && (!(ent[i].flags & FI_REMOTE_CQ_DATA) || kx_ctl_is(ent[i].flags, ent[i].data));
    }
    pthread_mutex_unlock(&r->hub->lock);
    if (rx)
        kx_repost(r);
    r->last_activity_ns = kx_now_ns();
}

/* read up to one batch from the CQ; returns the number of entries handled, or <0 */
static int kx_poll(kx_rail *r)
{
    struct fi_cq_data_entry ent[KX_CQ_BATCH];
    ssize_t n = fi_cq_read(r->cq, ent, KX_CQ_BATCH);
    if (n > 0) {
        kx_handle_batch(r, ent, n);
        return (int)n;
    }
    if (n == -FI_EAGAIN)
        return 0;
    if (n == -FI_EAVAIL) {
        struct fi_cq_err_entry err;
        memset(&err, 0, sizeof(err));
        ssize_t got = fi_cq_readerr(r->cq, &err, 0);
        if (got == 1 || got == sizeof(err)) {
            pthread_mutex_lock(&r->hub->lock);
            kx_complete_locked(r, err.op_context, err.flags, err.data, err.len, err.err ? err.err : FI_EIO);
            pthread_mutex_unlock(&r->hub->lock);
            kx_repost(r);
            r->last_activity_ns = kx_now_ns();
            return 1;
        }
        return 0;
    }
    return (int)n;
}

static int kx_poll(kx_rail *r);

/* one reader's turn: read a batch, post what is queued; the caller holds poll_owner */
static int kx_progress_once(kx_rail *r)
{
    int n = kx_unblock_step(r);   /* first: this turn's read reports what it answered (unblock.c) */
    n += kx_poll(r);
    /* after a refused post, retry only once something completed or 100 us passed: a peer
     * that stopped answering is then probed (kx_peer_enter) before, not during, the
     * provider's own locking */
    if ((r->q_head && (n > 0 || kx_now_ns() - r->eagain_ns > 100000)) ||
        __atomic_load_n(&r->cancel_pending, __ATOMIC_ACQUIRE))
        n += kx_pump_queue(r);
    n += kx_ctl_post_acks(r);     /* after the pump: the writes it posted go out ahead of the ACK */
    n += kx_forget_step(r);       /* closed same-process shm engines we still map (forget.c) */
    return n;
}

void kx_rail_flush(kx_rail *r, int64_t wait_ns)
{
    if (!kx_enter(r))
        return;
    int64_t end = kx_now_ns() + wait_ns;
    for (int step = 0;; step++) {
        if (kx_poll_try(r)) {     /* whoever read before us has handled what it read */
            /* a few rounds even when one reads nothing: tcp reads a socket's bytes into the
             * CQ during the read, so what arrived may show only in the next one */
            for (int i = 0; i < 16 && (kx_progress_once(r) > 0 || i < 4); i++)
                ;
            kx_poll_done(r);
            break;
        }
        if (kx_now_ns() >= end || r->stop)
            break;
        kx_pause(step, 100000);
    }
    kx_leave(r);
}

/* A waiter drives progress until *flag is set (or `ready` says so), its window passes or the
 * rail stops; returns 1 when what it waited for happened. See the file comment. */
static int kx_drive(kx_rail *r, const int *flag, void *const *ptr, int64_t window_ns)
{
    if (window_ns <= 0 || !kx_enter(r))
        return 0;
    __atomic_add_fetch(&r->drivers, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&r->sleeping, __ATOMIC_SEQ_CST) && r->has_wait)
        fi_cq_signal(r->cq);      /* out of fi_cq_sread, which holds poll_owner */
    int64_t end = kx_now_ns() + window_ns;
    int got = 0;
    for (;;) {
        if (flag ? __atomic_load_n(flag, __ATOMIC_ACQUIRE) : __atomic_load_n(ptr, __ATOMIC_ACQUIRE) != NULL) {
            got = 1;
            break;
        }
        if (__atomic_load_n(&r->stop, __ATOMIC_ACQUIRE))
            break;
        int n = 0;
        if (kx_poll_try(r)) {
            n = kx_progress_once(r);
            kx_poll_done(r);
        }
        if (n > 0)
            continue;
        int64_t t0 = kx_now_ns();
        if (t0 >= end)
            break;
        sched_yield();        /* 2 cores: let the peer (or our own progress thread) run */
        if (kx_now_ns() - t0 > KX_YIELD_LONG_NS)
            break;            /* a contended core (kx_progress_pause): block, let the progress thread read */
    }
    __atomic_store_n(&r->drive_got, got, __ATOMIC_RELAXED);
    __atomic_add_fetch(&r->stat_drives, 1, __ATOMIC_RELAXED);
    if (got)
        __atomic_add_fetch(&r->stat_drives_got, 1, __ATOMIC_RELAXED);
    __atomic_sub_fetch(&r->drivers, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&r->yielded, __ATOMIC_SEQ_CST)) {
        __atomic_store_n(&r->yielded, 0, __ATOMIC_SEQ_CST);
        kx_futex(&r->yielded, FUTEX_WAKE_PRIVATE, 1, NULL);
    }
    kx_leave(r);
    return got;
}

/* How long a waiter drives: spin_ns while the rail has operations out or saw traffic in the
 * last KX_RECENT_NS; 0 on an idle rail (a thread parked in recv() for minutes must not spin
 * at the start of every 50 ms slice), where the progress thread handles the next arrival. */
static int64_t kx_drive_window(kx_rail *r, const int64_t *spin_ns, int64_t slice_ns)
{
    int64_t window = __atomic_load_n(spin_ns, __ATOMIC_RELAXED);
    if (window <= 0)
        return 0;
    if (__atomic_load_n(&r->outstanding, __ATOMIC_RELAXED) == 0 &&
        kx_now_ns() - __atomic_load_n(&r->last_activity_ns, __ATOMIC_RELAXED) > KX_RECENT_NS)
        return 0;
    return window < slice_ns ? window : slice_ns;
}

static int kx_wait_flag_driving(kx_rail *r, const int *flag, const int64_t *spin_ns, int64_t slice_ns)
{
    if (__atomic_load_n(flag, __ATOMIC_ACQUIRE))
        return 1;
    int64_t window = kx_drive_window(r, spin_ns, slice_ns);
    int64_t t0 = window > 0 ? kx_now_ns() : 0;
    if (kx_drive(r, flag, NULL, window))
        return 1;
    int64_t left = slice_ns - (window > 0 ? kx_now_ns() - t0 : 0);
    if (left <= 0)
        return __atomic_load_n(flag, __ATOMIC_ACQUIRE);
    int got = kx_hub_wait_flag(r->hub, flag, left);
    if (!got && kx_enter(r)) {   /* a silent slice: free a progress thread stuck on a dead shm peer */
        kx_peers_unstick(r);
        kx_leave(r);
    }
    return got;
}

int kx_wait_flag(kx_rail *r, const int *flag, int64_t slice_ns)
{
    return kx_wait_flag_driving(r, flag, &r->spin_ns, slice_ns);
}

int kx_wait_transfer_flag(kx_rail *r, const int *flag, int64_t slice_ns)
{
    return kx_wait_flag_driving(r, flag, &r->tx_spin_ns, slice_ns);
}

int64_t kx_drive_for_message(kx_rail *r, void *const *head, int64_t slice_ns)
{
    int64_t window = kx_drive_window(r, &r->spin_ns, slice_ns);
    if (window <= 0 || __atomic_load_n(head, __ATOMIC_ACQUIRE))
        return slice_ns;
    int64_t t0 = kx_now_ns();
    kx_drive(r, NULL, head, window);
    int64_t left = slice_ns - (kx_now_ns() - t0);
    return left > 0 ? left : 0;
}

/* while waiters drive, stay off the CQ: park until the last one leaves (or a bound passes) */
static void kx_park(kx_rail *r)
{
    __atomic_store_n(&r->yielded, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&r->drivers, __ATOMIC_SEQ_CST) > 0 && !r->stop) {
        struct timespec ts = {0, KX_PARK_NS};
        kx_futex(&r->yielded, FUTEX_WAIT_PRIVATE, 1, &ts);
    }
    __atomic_store_n(&r->yielded, 0, __ATOMIC_SEQ_CST);
}

/* the bell's last look before sleeping: anything to do now? (bell.c) */
static int kx_look_again(kx_rail *r)
{
    int n = 0;
    if (kx_poll_try(r)) {
        n = kx_progress_once(r);
        kx_poll_done(r);
    }
    return n + (r->q_head != NULL) + __atomic_load_n(&r->drivers, __ATOMIC_SEQ_CST)
           + __atomic_load_n(&r->awake, __ATOMIC_SEQ_CST);
}

void *kx_progress_main(void *arg)
{
    kx_rail *r = (kx_rail *)arg;
    int64_t backoff = 1000;
    r->tid = (pid_t)syscall(SYS_gettid);
    if (r->pin)
        pthread_setaffinity_np(pthread_self(), sizeof(cpu_set_t), &r->cpus);
    kx_progress_rt_self(r);
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);   /* 1 us: a 20 us nap is one, not 70 */
    kx_drive_windows(r);
    int wait_fd = -1;      /* the CQ's wait fd, where the provider exposes it (tcp) */
    if (r->has_wait && fi_control(&r->cq->fid, FI_GETWAIT, &wait_fd) != 0)
        wait_fd = -1;
    while (!r->stop) {
        if (__atomic_load_n(&r->posting, __ATOMIC_ACQUIRE) > 0 && !r->spin) {
            /* the posting thread progresses for itself; stay out of its way until it is done */
            kx_posting_wait(r);
            continue;
        }
        if (__atomic_load_n(&r->drivers, __ATOMIC_SEQ_CST) > 0) {
            kx_park(r);
            /* the waiter got what it waited for and read what there was; the next waiter
             * drives again. No spin window then: spinning here only takes the CPU from the
             * peer on 2 cores. (A waiter whose window ran out is blocking now: spin for it.) */
            if (__atomic_load_n(&r->drive_got, __ATOMIC_RELAXED))
                r->last_activity_ns = kx_now_ns() - KX_SPIN_WINDOW_NS;
            backoff = 1000;
            continue;
        }
        int n = 0;
        if (kx_poll_try(r)) {
            n = kx_progress_once(r);
            kx_poll_done(r);
        }
        n += kx_peers_scan(r);
        if (n != 0 || r->spin) {
            backoff = 1000;
            continue;
        }
        int64_t now = kx_now_ns();
        int64_t quiet = now - r->last_activity_ns;
        int64_t outstanding = __atomic_load_n(&r->outstanding, __ATOMIC_RELAXED) + (r->q_head != NULL)
                              + __atomic_load_n(&r->awake, __ATOMIC_RELAXED);
        if (quiet < KX_SPIN_WINDOW_NS || (outstanding > 0 && quiet < KX_STALL_NS)) {
            kx_progress_pause(r, wait_fd);
            continue;
        }
        /* idle: block. Announce it first, then look again, so a post (or a driver) that
         * raced with us either sees `sleeping` (and signals) or is seen here. The bell's
         * sequence is read before the announcement: a poke in between then ends the wait. */
        uint32_t bell_seq = r->bell ? kx_bell_seq(r->bell) : 0;
        __atomic_store_n(&r->sleeping, 1, __ATOMIC_SEQ_CST);
        outstanding = __atomic_load_n(&r->outstanding, __ATOMIC_SEQ_CST) + (r->q_head != NULL)
                      + __atomic_load_n(&r->awake, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&r->drivers, __ATOMIC_SEQ_CST) > 0) {
            __atomic_store_n(&r->sleeping, 0, __ATOMIC_SEQ_CST);
            continue;
        }
        if (r->has_wait && outstanding == 0 && wait_fd >= 0) {
            kx_sleep_on_fd(r, wait_fd, 50);
            __atomic_store_n(&r->sleeping, 0, __ATOMIC_SEQ_CST);
            continue;
        }
        if (r->has_wait && outstanding == 0 && kx_poll_try(r)) {
            struct fi_cq_data_entry ent[KX_CQ_BATCH];
            ssize_t got = fi_cq_sread(r->cq, ent, KX_CQ_BATCH, NULL, 50);
            __atomic_store_n(&r->sleeping, 0, __ATOMIC_SEQ_CST);
            if (got > 0)
                kx_handle_batch(r, ent, got);
            kx_poll_done(r);
            continue;
        }
        if (outstanding > 0 && quiet < KX_STALL_NS) {
            __atomic_store_n(&r->sleeping, 0, __ATOMIC_SEQ_CST);
            continue;
        }
        if (r->bell) {
            /* shm: sleep on our doorbell, which writers of other processes ring (bell.c);
             * this process's posters poke it through kx_wake */
            kx_bell_sleep(r, bell_seq, backoff, kx_look_again);
            __atomic_store_n(&r->sleeping, 0, __ATOMIC_RELEASE);
            backoff = backoff * 2 > KX_MAX_BACKOFF_BELL_NS ? KX_MAX_BACKOFF_BELL_NS : backoff * 2;
            continue;
        }
        struct timespec ts;
        kx_deadline(&ts, backoff);
        pthread_mutex_lock(&r->hub->lock);
        if (!r->stop && !r->q_head)        /* re-checked under the lock posters signal under */
            pthread_cond_timedwait(&r->hub->cond, &r->hub->lock, &ts);
        pthread_mutex_unlock(&r->hub->lock);
        __atomic_store_n(&r->sleeping, 0, __ATOMIC_RELEASE);
        backoff = backoff * 2 > KX_MAX_BACKOFF_NS ? KX_MAX_BACKOFF_NS : backoff * 2;
    }
    return NULL;
}
