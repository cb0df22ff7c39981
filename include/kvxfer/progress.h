/* progress.h: reading the CQ and the progress thread.
 *
 * Both providers kvxfer is tested on progress data manually: nothing lands at a target, and
 * no send finishes, unless someone reads the CQ. kx_poll() is that someone, and only the
 * progress thread calls it, so completions are handled in CQ order.
 *
 * Blocking mode (the default, for 2-core machines): while tx operations are outstanding, or
 * for a short window after the last completion, the thread polls with sched_yield between
 * empty reads; otherwise it blocks (fi_cq_sread on the CQ's wait object where the provider
 * has one, else a condition-variable wait with an exponential back-off capped at 1 ms).
 * Posting threads signal it so a new transfer never waits out a back-off. Spin mode never
 * blocks. */
#ifndef KVXFER_PROGRESS_H
#define KVXFER_PROGRESS_H

#include "kvxfer/core.h"
#include "kvxfer/counters.h"
#include "kvxfer/liveness.h"

#define KX_SPIN_WINDOW_NS   200000LL     /* keep polling 200 us after activity */
#define KX_STALL_NS         200000000LL  /* outstanding but silent this long: back off */
#define KX_MAX_BACKOFF_NS   1000000LL

static void kx_xfer_release_locked(kx_xfer *x)
{
    if (--x->refs == 0) {
        free(x->ops);
        free(x->owned);
        free(x);
    }
}

/* Every native call that uses the endpoint or domain from a Python thread is bracketed by
 * kx_enter/kx_leave; teardown sets stop and then waits for busy == 0 before closing fids.
 * (seq_cst on both sides: a caller either sees stop, or teardown sees it busy.) */
static int kx_enter(kx_engine *e)
{
    __atomic_add_fetch(&e->busy, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&e->stop, __ATOMIC_SEQ_CST)) {
        __atomic_sub_fetch(&e->busy, 1, __ATOMIC_SEQ_CST);
        return 0;
    }
    return 1;
}

static void kx_leave(kx_engine *e)
{
    __atomic_sub_fetch(&e->busy, 1, __ATOMIC_SEQ_CST);
}

static void kx_xfer_link_locked(kx_engine *e, kx_xfer *x)
{
    x->linked = 1;
    x->prev = NULL;
    x->next = e->inflight;
    if (e->inflight)
        e->inflight->prev = x;
    e->inflight = x;
}

static void kx_xfer_unlink_locked(kx_engine *e, kx_xfer *x)
{
    if (x->prev)
        x->prev->next = x->next;
    else
        e->inflight = x->next;
    if (x->next)
        x->next->prev = x->prev;
    x->prev = x->next = NULL;
}

static void kx_xfer_check_done_locked(kx_engine *e, kx_xfer *x)
{
    if (x->linked && x->posting_done && x->completed >= x->posted) {
        x->done = 1;
        x->linked = 0;
        pthread_cond_broadcast(&e->hub->cond);
        kx_xfer_unlink_locked(e, x);
        kx_xfer_release_locked(x);  /* the in-flight reference */
    }
}

/* Fail a transfer now (its peer is dead): post nothing more, wake its waiters. It stays
 * linked until its posted operations complete or the endpoint closes. */
static void kx_xfer_fail_locked(kx_engine *e, kx_xfer *x, int err)
{
    if (!x->error)
        x->error = err;
    __atomic_store_n(&x->cancel, 1, __ATOMIC_RELEASE);
    if (!x->done) {
        x->done = 1;
        pthread_cond_broadcast(&e->hub->cond);
    }
}

static int kx_post_recv(kx_engine *e, kx_rxbuf *b)
{
    return (int)fi_recv(e->ep, b->data, KX_MSG_MAX, e->rx_desc, FI_ADDR_UNSPEC, &b->op.fi);
}

static void kx_complete_locked(kx_engine *e, void *context, uint64_t flags, uint64_t data,
                               size_t len, int err)
{
    if ((flags & FI_REMOTE_CQ_DATA) && !err) {
        kx_arrival_locked(e, (uint32_t)data);
        if (!context || !(flags & FI_RECV))
            return;
    }
    kx_op *op = (kx_op *)context;
    if (!op) {
        if (err)
            e->stat_rx_err++;
        return;
    }
    switch (op->kind) {
    case KX_OP_WRITE: {
        kx_xfer *x = (kx_xfer *)op->owner;
        __atomic_sub_fetch(&e->outstanding, 1, __ATOMIC_RELAXED);
        if (x->written_off > 0)
            x->written_off--;            /* already taken off the peer's count */
        else
            kx_peer_count(e, x->peer, -1);
        __atomic_store_n(&x->last_ns, kx_now_ns(), __ATOMIC_RELEASE);
        x->completed++;
        if (err && !x->error)
            x->error = err;
        if (err && kx_is_peer_errno(err))
            kx_peer_kill_locked(e, x->peer, err);
        kx_xfer_check_done_locked(e, x);
        break;
    }
    case KX_OP_SEND: {
        kx_sendbuf *s = (kx_sendbuf *)op->owner;
        __atomic_sub_fetch(&e->outstanding, 1, __ATOMIC_RELAXED);
        kx_peer_count(e, s->peer, -1);
        if (err && kx_is_peer_errno(err))
            kx_peer_kill_locked(e, s->peer, err);
        if (err)
            e->stat_rx_err++;
        if (s->mr)
            fi_close(&s->mr->fid);
        free(s);
        break;
    }
    case KX_OP_RECV: {
        kx_rxbuf *b = (kx_rxbuf *)op->owner;
        e->took_msgs = 1;
        if (!err) {
            kx_msg *m = malloc(sizeof(kx_msg) + len);
            if (m) {
                m->next = NULL;
                m->len = len;
                memcpy(m->data, b->data, len);
                if (e->hub->msg_tail)
                    e->hub->msg_tail->next = m;
                else
                    e->hub->msg_head = m;
                e->hub->msg_tail = m;
                e->hub->nmsgs++;
                pthread_cond_broadcast(&e->hub->cond);
            }
        } else {
            e->stat_rx_err++;
        }
        b->repost = 1;     /* reposted by kx_poll once the lock is released */
        break;
    }
    }
}

/* repost the receive buffers whose messages were taken (never under the hub lock) */
static void kx_repost(kx_engine *e)
{
    for (int i = 0; i < KX_RX_BUFS; i++) {
        kx_rxbuf *b = &e->rx[i];
        if (!b->repost || e->stop)
            continue;
        int ret, tries = 0;
        do {
            ret = kx_post_recv(e, b);
        } while (ret == -FI_EAGAIN && ++tries < 1000);
        if (ret == 0) {
            b->repost = 0;
        } else if (ret != -FI_EAGAIN) {
            b->repost = 0;     /* lost: count it rather than retry forever */
            e->stat_rx_err++;
        }
    }
}

static void kx_handle_batch(kx_engine *e, struct fi_cq_data_entry *ent, ssize_t n)
{
    int rx = 0;
    pthread_mutex_lock(&e->hub->lock);
    for (ssize_t i = 0; i < n; i++) {
        kx_complete_locked(e, ent[i].op_context, ent[i].flags, ent[i].data, ent[i].len, 0);
        rx |= (ent[i].flags & FI_RECV) && !(ent[i].flags & FI_REMOTE_CQ_DATA);
    }
    pthread_mutex_unlock(&e->hub->lock);
    if (rx)
        kx_repost(e);
    e->last_activity_ns = kx_now_ns();
}

/* read up to one batch from the CQ; returns the number of entries handled, or <0.
 * Only the progress thread calls it: completions are then handled in CQ order. */
static int kx_poll(kx_engine *e)
{
    struct fi_cq_data_entry ent[KX_CQ_BATCH];
    ssize_t n = fi_cq_read(e->cq, ent, KX_CQ_BATCH);
    if (n > 0) {
        kx_handle_batch(e, ent, n);
        return (int)n;
    }
    if (n == -FI_EAGAIN)
        return 0;
    if (n == -FI_EAVAIL) {
        struct fi_cq_err_entry err;
        memset(&err, 0, sizeof(err));
        ssize_t r = fi_cq_readerr(e->cq, &err, 0);
        if (r == 1 || r == sizeof(err)) {
            pthread_mutex_lock(&e->hub->lock);
            kx_complete_locked(e, err.op_context, err.flags, err.data, err.len, err.err ? err.err : FI_EIO);
            pthread_mutex_unlock(&e->hub->lock);
            kx_repost(e);
            e->last_activity_ns = kx_now_ns();
            return 1;
        }
        return 0;
    }
    return (int)n;
}

static void kx_wake(kx_engine *e)
{
    if (__atomic_load_n(&e->sleeping, __ATOMIC_SEQ_CST)) {
        if (e->has_wait && kx_enter(e)) {      /* never signal a CQ that teardown may close */
            fi_cq_signal(e->cq);
            kx_leave(e);
        }
        pthread_mutex_lock(&e->hub->lock);
        pthread_cond_broadcast(&e->hub->cond);
        pthread_mutex_unlock(&e->hub->lock);
    }
}

static int kx_pump_queue(kx_engine *e);

static void *kx_progress_main(void *arg)
{
    kx_engine *e = (kx_engine *)arg;
    int64_t backoff = 1000;
    e->tid = (pid_t)syscall(SYS_gettid);
    if (e->pin)
        pthread_setaffinity_np(pthread_self(), sizeof(cpu_set_t), &e->cpus);
    while (!e->stop) {
        if (__atomic_load_n(&e->posting, __ATOMIC_ACQUIRE) > 0 && !e->spin) {
            /* the posting thread progresses for itself; stay out of its way */
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
            continue;
        }
        int n = kx_poll(e);
        /* after a refused post, retry only once something completed or 100 us passed: a
         * peer that stopped answering is then probed (kx_peer_enter) before, not during, the
         * provider's own locking */
        if (e->q_head && (n > 0 || kx_now_ns() - e->eagain_ns > 100000))
            n += kx_pump_queue(e);
        n += kx_peers_scan(e);
        if (n != 0 || e->spin) {
            backoff = 1000;
            continue;
        }
        int64_t now = kx_now_ns();
        int64_t quiet = now - e->last_activity_ns;
        int64_t outstanding = __atomic_load_n(&e->outstanding, __ATOMIC_RELAXED) + (e->q_head != NULL);
        if (quiet < KX_SPIN_WINDOW_NS || (outstanding > 0 && quiet < KX_STALL_NS)) {
            sched_yield();
            continue;
        }
        /* idle: block. Announce it first, then look again, so a post that raced with us
         * either sees `sleeping` (and signals) or is seen here (no lost wake-up). */
        __atomic_store_n(&e->sleeping, 1, __ATOMIC_SEQ_CST);
        outstanding = __atomic_load_n(&e->outstanding, __ATOMIC_SEQ_CST) + (e->q_head != NULL);
        if (e->has_wait && outstanding == 0) {
            struct fi_cq_data_entry ent[KX_CQ_BATCH];
            ssize_t r = fi_cq_sread(e->cq, ent, KX_CQ_BATCH, NULL, 50);
            __atomic_store_n(&e->sleeping, 0, __ATOMIC_SEQ_CST);
            if (r > 0)
                kx_handle_batch(e, ent, r);
            continue;
        }
        if (outstanding > 0 && quiet < KX_STALL_NS) {
            __atomic_store_n(&e->sleeping, 0, __ATOMIC_SEQ_CST);
            continue;
        }
        struct timespec ts;
        kx_deadline(&ts, backoff);
        pthread_mutex_lock(&e->hub->lock);
        if (!e->stop && !e->q_head)        /* re-checked under the lock posters signal under */
            pthread_cond_timedwait(&e->hub->cond, &e->hub->lock, &ts);
        pthread_mutex_unlock(&e->hub->lock);
        __atomic_store_n(&e->sleeping, 0, __ATOMIC_RELEASE);
        backoff = backoff * 2 > KX_MAX_BACKOFF_NS ? KX_MAX_BACKOFF_NS : backoff * 2;
    }
    return NULL;
}

#endif
