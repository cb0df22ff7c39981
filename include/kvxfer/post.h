/* post.h: turning (src offset, dst offset, length) triples into RMA writes.
 *
 * The message rule (also in kvxfer/wire.py:count_writes, which a receiver uses to know how
 * many immediates to expect; the two must agree):
 *   1. adjacent triples that are contiguous on both sides merge into one segment;
 *   2. segments are packed, in order, into messages of at most `iov` pieces and at most
 *      `max_write` bytes; a segment that does not fit is split at the message boundary;
 *   3. a piece shorter than `pack_min` bytes travels alone in its message (shm, for one,
 *      moves small messages through its inject path faster than a packed CMA copy).
 * Each message is one fi_writemsg with `iov` local and `iov` remote pieces of equal
 * lengths, so one message gives exactly one remote CQ entry (one immediate).
 *
 * Posting never blocks on the transport: the calling thread posts until the provider says
 * -FI_EAGAIN, then queues the rest of the transfer for the progress thread, which posts
 * it as completions free queue space. So a call costs its CPU time, not the wire's. */
#ifndef KVXFER_POST_H
#define KVXFER_POST_H

#include "kvxfer/core.h"
#include "kvxfer/progress.h"

/* Bytes the calling thread posts itself before handing the rest to the progress thread.
 * Some providers copy inside the post call (shm's CMA path), so an unbounded direct post
 * would make the caller pay for the whole transfer. */
#ifndef KX_DIRECT_BUDGET
#define KX_DIRECT_BUDGET (256 * 1024)
#endif

/* Build the next message of the walk into x->ps/pd/pl; 0 when the walk is over. */
static int kx_next_msg(kx_xfer *x)
{
    int np = 0;
    uint64_t bytes = 0;
    while ((size_t)np < x->iov && bytes < x->max_write) {
        if (x->l == 0) {
            if (x->i >= x->n)
                break;
            size_t i = x->i;
            uint64_t s = x->so[i], d = x->dof[i], l = x->ln[i];
            i++;
            while (i < x->n && x->so[i] == s + l && x->dof[i] == d + l) {   /* rule 1 */
                l += x->ln[i];
                i++;
            }
            x->i = i;
            x->s = s;
            x->d = d;
            x->l = l;
            if (l == 0)
                continue;
        }
        if (x->l < x->pack_min) {                                           /* rule 3 */
            if (np > 0)
                break;
            x->ps[0] = x->s;
            x->pd[0] = x->d;
            x->pl[0] = x->l;
            np = 1;
            x->s += x->l;
            x->d += x->l;
            x->l = 0;
            break;
        }
        uint64_t take = x->max_write - bytes < x->l ? x->max_write - bytes : x->l;   /* rule 2 */
        x->ps[np] = x->s;
        x->pd[np] = x->d;
        x->pl[np] = take;
        np++;
        bytes += take;
        x->s += take;
        x->d += take;
        x->l -= take;
    }
    x->np = np;
    return np > 0;
}

static void kx_walk_init(kx_xfer *x, const uint64_t *so, const uint64_t *dof, const uint64_t *ln, size_t n,
                         size_t iov, uint64_t max_write, uint64_t pack_min)
{
    x->pack_min = pack_min;
    x->so = so;
    x->dof = dof;
    x->ln = ln;
    x->n = n;
    x->i = 0;
    x->l = 0;
    x->iov = iov < 1 ? 1 : (iov > KX_MAX_IOV ? KX_MAX_IOV : iov);
    x->max_write = max_write ? max_write : 1;
}

/* count the messages of a walk without posting */
static int64_t kx_walk(const uint64_t *so, const uint64_t *dof, const uint64_t *ln, size_t n,
                       size_t iov, uint64_t max_write, uint64_t pack_min)
{
    kx_xfer w;
    memset(&w, 0, sizeof(w));
    kx_walk_init(&w, so, dof, ln, n, iov, max_write, pack_min);
    int64_t msgs = 0;
    while (kx_next_msg(&w))
        msgs++;
    return msgs;
}

/* Post messages of x until its walk ends (returns 1), the provider is full or `budget`
 * bytes have been posted (0), or a post fails (returns 1 with x->error set: nothing more is
 * posted). */
static int kx_pump(kx_engine *e, kx_xfer *x, int64_t budget)
{
    struct iovec iov[KX_MAX_IOV];
    void *desc[KX_MAX_IOV];
    struct fi_rma_iov rma[KX_MAX_IOV];
    for (;;) {
        if (x->error)
            return 1;
        if (__atomic_load_n(&x->cancel, __ATOMIC_ACQUIRE)) {
            pthread_mutex_lock(&e->hub->lock);
            if (!x->error)
                x->error = FI_ECANCELED;
            pthread_mutex_unlock(&e->hub->lock);
            return 1;
        }
        if (!x->have_msg) {
            if (!kx_next_msg(x))
                return 1;
            if (x->posted >= x->planned) {
                /* the walk yields more than it counted: the offset arrays changed under us.
                 * Engine copies them, so this is a bug; refuse rather than overrun x->ops. */
                pthread_mutex_lock(&e->hub->lock);
                if (!x->error)
                    x->error = FI_EINVAL;
                pthread_mutex_unlock(&e->hub->lock);
                return 1;
            }
            x->have_msg = 1;
        }
        if (budget <= 0)
            return 0;
        int np = x->np;
        for (int k = 0; k < np; k++) {
            iov[k].iov_base = x->src_base + x->ps[k];
            iov[k].iov_len = x->pl[k];
            desc[k] = x->desc;
            rma[k].addr = x->dst_base + x->pd[k];
            rma[k].len = x->pl[k];
            rma[k].key = x->key;
        }
        kx_op *op = x->ops ? &x->ops[x->posted] : &x->shared_op;
        struct fi_msg_rma msg = {
            .msg_iov = iov, .desc = desc, .iov_count = (size_t)np, .addr = x->peer,
            .rma_iov = rma, .rma_iov_count = (size_t)np, .context = &op->fi, .data = x->imm,
        };
        /* never post to a peer known closed, exited or stalled (liveness.h says why) */
        int gone = kx_peer_enter(e, x->peer);
        if (gone) {
            pthread_mutex_lock(&e->hub->lock);
            if (!x->error)
                x->error = gone;
            pthread_mutex_unlock(&e->hub->lock);
            return 1;
        }
        /* count it first: the completion may be read by another thread before we return */
        __atomic_add_fetch(&e->outstanding, 1, __ATOMIC_RELAXED);
        if (__atomic_load_n(&x->posted, __ATOMIC_ACQUIRE) == __atomic_load_n(&x->completed, __ATOMIC_ACQUIRE))
            __atomic_store_n(&x->last_ns, kx_now_ns(), __ATOMIC_RELEASE);   /* its clock starts */
        __atomic_add_fetch(&x->posted, 1, __ATOMIC_RELEASE);
        kx_peer_count(e, x->peer, 1);
        ssize_t ret = fi_writemsg(e->ep, &msg, x->flags);
        kx_peer_leave(e, x->peer);
        if (ret == 0) {
            kx_peer_accepted(e, x->peer);
            x->have_msg = 0;
            for (int k = 0; k < np; k++)
                budget -= (int64_t)x->pl[k];
            __atomic_add_fetch(&e->stat_writes, 1, __ATOMIC_RELAXED);
            continue;
        }
        __atomic_sub_fetch(&e->outstanding, 1, __ATOMIC_RELAXED);
        __atomic_sub_fetch(&x->posted, 1, __ATOMIC_RELEASE);
        kx_peer_uncount(e, x->peer, ret == -FI_EAGAIN);
        if (ret == -FI_EAGAIN) {
            e->eagain_ns = kx_now_ns();
            return 0;
        }
        pthread_mutex_lock(&e->hub->lock);
        if (!x->error)
            x->error = (int)-ret;
        pthread_mutex_unlock(&e->hub->lock);
        return 1;
    }
}

static void kx_finish_posting_locked(kx_engine *e, kx_xfer *x)
{
    x->posting_done = 1;
    kx_xfer_check_done_locked(e, x);
}

/* The progress thread's share of posting: drive the queue head until the provider is full.
 * Returns the number of transfers whose posting finished (activity, for the idle logic). */
/* Finish every cancelled transfer in the queue, wherever it sits: a cancelled transfer
 * behind a head that the provider keeps refusing (a dead peer) must still end. Only the
 * progress thread touches queued transfers, so it may unlink them. */
static int kx_sweep_cancelled(kx_engine *e)
{
    int finished = 0;
    pthread_mutex_lock(&e->hub->lock);
    e->cancel_pending = 0;
    kx_xfer *prev = NULL, *x = e->q_head;
    while (x) {
        kx_xfer *next = x->qnext;
        if (__atomic_load_n(&x->cancel, __ATOMIC_ACQUIRE) && !x->have_msg) {
            if (prev)
                prev->qnext = next;
            else
                e->q_head = next;
            if (e->q_tail == x)
                e->q_tail = prev;
            x->qnext = NULL;
            if (!x->error)
                x->error = FI_ECANCELED;
            kx_finish_posting_locked(e, x);
            finished++;
        } else {
            prev = x;
        }
        x = next;
    }
    pthread_mutex_unlock(&e->hub->lock);
    return finished;
}

static int kx_pump_queue(kx_engine *e)
{
    int finished = 0;
    if (__atomic_load_n(&e->cancel_pending, __ATOMIC_ACQUIRE))
        finished += kx_sweep_cancelled(e);
    for (;;) {
        pthread_mutex_lock(&e->hub->lock);
        kx_xfer *x = e->q_head;
        pthread_mutex_unlock(&e->hub->lock);
        if (!x)
            return finished;
        int64_t before = x->posted;
        int over = kx_pump(e, x, INT64_MAX);
        if (!over)
            return finished + (x->posted != before);
        pthread_mutex_lock(&e->hub->lock);
        e->q_head = x->qnext;
        if (!e->q_head)
            e->q_tail = NULL;
        x->qnext = NULL;
        kx_finish_posting_locked(e, x);
        pthread_mutex_unlock(&e->hub->lock);
        finished++;
    }
}

/* Allocate a transfer for the triples and post what the provider takes now; the rest is
 * queued for the progress thread. Runs without the GIL; never blocks on the wire. Returns
 * NULL only when out of memory. x->planned is the number of messages (= immediates). */
/* Ask a transfer to post nothing more; what is already posted still completes. Safe at any
 * time: only the thread pumping the transfer acts on the flag (and dequeues it). */
static void kx_xfer_cancel(kx_engine *e, kx_xfer *x)
{
    __atomic_store_n(&x->cancel, 1, __ATOMIC_RELEASE);
    __atomic_store_n(&e->cancel_pending, 1, __ATOMIC_RELEASE);
    kx_wake(e);
}

/* Cancel every unfinished transfer to `peer` on this rail (queued, or being posted by
 * another thread right now: each is linked in the in-flight list before its first post).
 * Returns how many were cancelled. */
static int kx_peer_cancel(kx_engine *e, fi_addr_t peer)
{
    int n = 0;
    pthread_mutex_lock(&e->hub->lock);
    for (kx_xfer *x = e->inflight; x; x = x->next) {
        if (x->peer == peer && !x->done) {
            __atomic_store_n(&x->cancel, 1, __ATOMIC_RELEASE);
            n++;
        }
    }
    __atomic_store_n(&e->cancel_pending, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&e->hub->lock);
    kx_wake(e);
    return n;
}

/* Wait up to `slice_ns` until no transfer to `peer` is in flight on this rail. Returns the
 * transfers to it still in flight; *posting: how many of those may still post. */
static int kx_peer_wait(kx_engine *e, fi_addr_t peer, int64_t slice_ns, int *posting)
{
    struct timespec ts;
    int n, p;
    kx_deadline(&ts, slice_ns);
    pthread_mutex_lock(&e->hub->lock);
    for (;;) {
        n = p = 0;
        for (kx_xfer *x = e->inflight; x; x = x->next) {
            if (x->peer == peer) {
                n++;
                p += !x->posting_done;
            }
        }
        if (n == 0 || pthread_cond_timedwait(&e->hub->cond, &e->hub->lock, &ts) == ETIMEDOUT)
            break;
    }
    pthread_mutex_unlock(&e->hub->lock);
    *posting = p;
    return n;
}

static kx_xfer *kx_write(kx_engine *e, fi_addr_t peer, char *src_base, void *desc,
                         uint64_t dst_base, uint64_t key,
                         const uint64_t *so, const uint64_t *dof, const uint64_t *ln, size_t n,
                         int has_imm, uint32_t imm, size_t iov, uint64_t max_write, uint64_t pack_min)
{
    kx_xfer *x = calloc(1, sizeof(*x));
    if (!x)
        return NULL;
    x->planned = kx_walk(so, dof, ln, n, iov, max_write, pack_min);
    if (e->need_ctx && x->planned > 0) {
        x->ops = calloc((size_t)x->planned, sizeof(kx_op));
        if (!x->ops) {
            free(x);
            return NULL;
        }
        for (int64_t k = 0; k < x->planned; k++) {
            x->ops[k].kind = KX_OP_WRITE;
            x->ops[k].owner = x;
        }
    }
    x->shared_op.kind = KX_OP_WRITE;
    x->shared_op.owner = x;
    x->refs = 2;  /* Python owner + in-flight */
    if (n) {
        /* a private copy: the progress thread walks it after the caller has returned, and
         * nothing the caller does afterwards (reuse, free, an exception) may change it */
        x->owned = malloc(3 * n * sizeof(uint64_t));
        if (!x->owned) {
            free(x->ops);
            free(x);
            return NULL;
        }
        memcpy(x->owned, so, n * sizeof(uint64_t));
        memcpy(x->owned + n, dof, n * sizeof(uint64_t));
        memcpy(x->owned + 2 * n, ln, n * sizeof(uint64_t));
        so = x->owned;
        dof = x->owned + n;
        ln = x->owned + 2 * n;
    }
    kx_walk_init(x, so, dof, ln, n, iov, max_write, pack_min);
    x->peer = peer;
    x->src_base = src_base;
    x->desc = desc;
    x->dst_base = dst_base;
    x->key = key;
    x->flags = FI_COMPLETION | (has_imm ? FI_REMOTE_CQ_DATA : 0) | (e->delivery_complete ? FI_DELIVERY_COMPLETE : 0);
    x->imm = imm;

    pthread_mutex_lock(&e->hub->lock);
    kx_xfer_link_locked(e, x);
    int queued = e->q_head != NULL;   /* keep order behind transfers already queued */
    pthread_mutex_unlock(&e->hub->lock);

    int over = 0;
    if (!queued && kx_enter(e)) {
        __atomic_add_fetch(&e->posting, 1, __ATOMIC_SEQ_CST);
        over = kx_pump(e, x, KX_DIRECT_BUDGET);
        __atomic_sub_fetch(&e->posting, 1, __ATOMIC_SEQ_CST);
        kx_leave(e);
    }
    pthread_mutex_lock(&e->hub->lock);
    if (over || e->stop) {
        if (e->stop && !over && !x->error)
            x->error = FI_ECANCELED;
        kx_finish_posting_locked(e, x);
    } else {
        if (e->q_tail)
            e->q_tail->qnext = x;
        else
            e->q_head = x;
        e->q_tail = x;
    }
    pthread_mutex_unlock(&e->hub->lock);
    kx_wake(e);
    return x;
}

#endif
