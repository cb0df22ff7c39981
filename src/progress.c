/* progress.c: reading the CQ, and the progress thread that does it.
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
#include "internal.h"

#include <sys/syscall.h>
#include <unistd.h>

#define KX_SPIN_WINDOW_NS   200000LL     /* keep polling 200 us after activity */
#define KX_STALL_NS         200000000LL  /* outstanding but silent this long: back off */
#define KX_MAX_BACKOFF_NS   1000000LL

/* Every native call that uses the endpoint or domain from a caller's thread is bracketed by
 * kx_enter/kx_leave; closing sets stop and then waits for busy == 0 before closing fids.
 * (seq_cst on both sides: a caller either sees stop, or closing sees it busy.) */
int kx_enter(kx_rail *r)
{
    __atomic_add_fetch(&r->busy, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&r->stop, __ATOMIC_SEQ_CST)) {
        __atomic_sub_fetch(&r->busy, 1, __ATOMIC_SEQ_CST);
        return 0;
    }
    return 1;
}

void kx_leave(kx_rail *r)
{
    __atomic_sub_fetch(&r->busy, 1, __ATOMIC_SEQ_CST);
}

/* a post (or a cancel) happened: wake a sleeping progress thread */
void kx_wake(kx_rail *r)
{
    if (__atomic_load_n(&r->sleeping, __ATOMIC_SEQ_CST)) {
        if (r->has_wait && kx_enter(r)) {      /* never signal a CQ that closing may close */
            fi_cq_signal(r->cq);
            kx_leave(r);
        }
        pthread_mutex_lock(&r->hub->lock);
        pthread_cond_broadcast(&r->hub->cond);
        pthread_mutex_unlock(&r->hub->lock);
    }
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
            if (h->msg_tail)
                h->msg_tail->next = m;
            else
                h->msg_head = m;
            h->msg_tail = m;
            h->nmsgs++;
            pthread_cond_broadcast(&h->cond);
        }
    } else {
        r->stat_rx_err++;
    }
    b->repost = 1;     /* reposted by kx_repost once the lock is released */
}

static void kx_complete_locked(kx_rail *r, void *context, uint64_t flags, uint64_t data, size_t len, int err)
{
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
    case KX_OP_WRITE: {
        kx_transfer *x = (kx_transfer *)op->owner;
        __atomic_sub_fetch(&r->outstanding, 1, __ATOMIC_RELAXED);
        if (x->written_off > 0)
            x->written_off--;            /* already taken off the peer's count */
        else
            kx_peer_count(r, x->peer, -1);
        __atomic_store_n(&x->last_ns, kx_now_ns(), __ATOMIC_RELEASE);
        x->completed++;
        if (err && !x->error)
            x->error = err;
        if (err && kx_is_peer_errno(err))
            kx_peer_kill_locked(r, x->peer, err);
        kx_transfer_check_done_locked(r, x);
        break;
    }
    case KX_OP_SEND: {
        kx_sendbuf *s = (kx_sendbuf *)op->owner;
        __atomic_sub_fetch(&r->outstanding, 1, __ATOMIC_RELAXED);
        kx_peer_count(r, s->peer, -1);
        if (err && kx_is_peer_errno(err))
            kx_peer_kill_locked(r, s->peer, err);
        if (err)
            r->stat_rx_err++;
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
        rx |= (ent[i].flags & FI_RECV) && !(ent[i].flags & FI_REMOTE_CQ_DATA);
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

void *kx_progress_main(void *arg)
{
    kx_rail *r = (kx_rail *)arg;
    int64_t backoff = 1000;
    r->tid = (pid_t)syscall(SYS_gettid);
    if (r->pin)
        pthread_setaffinity_np(pthread_self(), sizeof(cpu_set_t), &r->cpus);
    while (!r->stop) {
        if (__atomic_load_n(&r->posting, __ATOMIC_ACQUIRE) > 0 && !r->spin) {
            /* the posting thread progresses for itself; stay out of its way */
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
            continue;
        }
        int n = kx_poll(r);
        /* after a refused post, retry only once something completed or 100 us passed: a
         * peer that stopped answering is then probed (kx_peer_enter) before, not during, the
         * provider's own locking */
        if ((r->q_head && (n > 0 || kx_now_ns() - r->eagain_ns > 100000)) ||
            __atomic_load_n(&r->cancel_pending, __ATOMIC_ACQUIRE))
            n += kx_pump_queue(r);
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
            sched_yield();
            continue;
        }
        /* idle: block. Announce it first, then look again, so a post that raced with us
         * either sees `sleeping` (and signals) or is seen here (no lost wake-up). */
        __atomic_store_n(&r->sleeping, 1, __ATOMIC_SEQ_CST);
        outstanding = __atomic_load_n(&r->outstanding, __ATOMIC_SEQ_CST) + (r->q_head != NULL)
                      + __atomic_load_n(&r->awake, __ATOMIC_SEQ_CST);
        if (r->has_wait && outstanding == 0) {
            struct fi_cq_data_entry ent[KX_CQ_BATCH];
            ssize_t got = fi_cq_sread(r->cq, ent, KX_CQ_BATCH, NULL, 50);
            __atomic_store_n(&r->sleeping, 0, __ATOMIC_SEQ_CST);
            if (got > 0)
                kx_handle_batch(r, ent, got);
            continue;
        }
        if (outstanding > 0 && quiet < KX_STALL_NS) {
            __atomic_store_n(&r->sleeping, 0, __ATOMIC_SEQ_CST);
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
