/* post.c: turning (src offset, dst offset, length) triples into RMA writes.
 *
 * The message rule (also in kvxfer/wire.py:count_writes, which a receiver uses to know how
 * many immediates to expect; the two must agree):
 *   1. coalesce: adjacent triples contiguous on both sides merge into one segment;
 *   2. pack: segments go, in order, into messages of at most `iov` pieces and at most
 *      `max_write` bytes; a segment that does not fit is split at the message boundary;
 *   3. alone: a piece shorter than `pack_min` bytes travels alone in its message (shm, for
 *      one, moves small messages through its inject path faster than a packed CMA copy).
 *      The caller chooses `pack_min` per destination region: 0 (rule 3 off) for a region
 *      whose descriptor carries a host share, on the direct path and on the RMA fallback
 *      alike, so the count never depends on the path (kvxfer/engine.py, Engine._pack_min).
 * Each message is one fi_writemsg with `iov` local and `iov` remote pieces of equal
 * lengths, so one message gives exactly one remote CQ entry (one immediate). A direct write
 * (direct.c: the sender maps a shm peer's memfd region itself) walks the same messages: it
 * memcpys each one's pieces and posts a 0-byte write with the immediate in its place (no
 * post at all without one), so the count is the same on both paths.
 *
 * Posting never blocks on the transport: the calling thread posts until the provider says
 * -FI_EAGAIN (or a byte budget is spent), then queues the rest of the transfer for the
 * progress thread, which posts it as completions free queue space. So a call costs its
 * CPU time, not the wire's. */
#include "internal.h"

/* Bytes the calling thread posts itself before handing the rest to the progress thread.
 * Some providers copy inside the post call (shm's CMA path), so an unbounded post by the caller
 * would make the caller pay for the whole transfer. */
#ifndef KX_CALLER_BUDGET
#define KX_CALLER_BUDGET (256 * 1024)
#endif

/* Bytes of direct writes the progress thread copies before it reads its CQ again (about
 * 0.1 ms of memcpy): a long transfer must not keep completions, arrivals and the peers'
 * liveness clocks waiting (an RMA post costs no copy here, so RMA needs no such round). */
#ifndef KX_DIRECT_ROUND
#define KX_DIRECT_ROUND (1024 * 1024)
#endif

int kx_walk_next(kx_transfer *x)
{
    int np = 0;
    uint64_t bytes = 0;
    while ((size_t)np < x->iov && bytes < x->max_write) {
        if (x->seg_len == 0) {
            if (x->next_triple >= x->n)
                break;
            size_t i = x->next_triple;
            uint64_t s = x->src_off[i], d = x->dst_off[i], l = x->length[i];
            i++;
            while (i < x->n && x->src_off[i] == s + l && x->dst_off[i] == d + l) {   /* rule 1 */
                l += x->length[i];
                i++;
            }
            x->next_triple = i;
            x->seg_src = s;
            x->seg_dst = d;
            x->seg_len = l;
            if (l == 0)
                continue;
        }
        if (x->seg_len < x->pack_min) {                                   /* rule 3 */
            if (np > 0)
                break;
            x->piece_src[0] = x->seg_src;
            x->piece_dst[0] = x->seg_dst;
            x->piece_len[0] = x->seg_len;
            np = 1;
            x->seg_src += x->seg_len;
            x->seg_dst += x->seg_len;
            x->seg_len = 0;
            break;
        }
        uint64_t room = x->max_write - bytes;                             /* rule 2 */
        uint64_t take = room < x->seg_len ? room : x->seg_len;
        x->piece_src[np] = x->seg_src;
        x->piece_dst[np] = x->seg_dst;
        x->piece_len[np] = take;
        np++;
        bytes += take;
        x->seg_src += take;
        x->seg_dst += take;
        x->seg_len -= take;
    }
    x->npieces = np;
    return np > 0;
}

void kx_walk_init(kx_transfer *x, const uint64_t *src_off, const uint64_t *dst_off, const uint64_t *length,
                  size_t n, size_t iov, uint64_t max_write, uint64_t pack_min)
{
    x->pack_min = pack_min;
    x->src_off = src_off;
    x->dst_off = dst_off;
    x->length = length;
    x->n = n;
    x->next_triple = 0;
    x->seg_len = 0;
    x->iov = iov < 1 ? 1 : (iov > KX_MAX_IOV ? KX_MAX_IOV : iov);
    x->max_write = max_write ? max_write : 1;
}

int64_t kx_count_messages(const uint64_t *src_off, const uint64_t *dst_off, const uint64_t *length,
                          size_t n, size_t iov, uint64_t max_write, uint64_t pack_min)
{
    kx_transfer w;
    memset(&w, 0, sizeof(w));
    kx_walk_init(&w, src_off, dst_off, length, n, iov, max_write, pack_min);
    int64_t msgs = 0;
    while (kx_walk_next(&w))
        msgs++;
    return msgs;
}

void kx_transfer_fail(kx_rail *r, kx_transfer *x, int err)
{
    pthread_mutex_lock(&r->hub->lock);
    if (!x->error)
        x->error = err;
    pthread_mutex_unlock(&r->hub->lock);
}

/* Post messages of x until its walk ends (returns 1), the provider is full or `budget`
 * bytes have been posted (0), or a post fails or x is cancelled (1, with x->error set:
 * nothing more is posted). */
static int kx_pump(kx_rail *r, kx_transfer *x, int64_t budget)
{
    struct iovec iov[KX_MAX_IOV];
    void *desc[KX_MAX_IOV];
    struct fi_rma_iov rma[KX_MAX_IOV];
    for (;;) {
        if (x->error)
            return 1;
        if (__atomic_load_n(&x->cancel, __ATOMIC_ACQUIRE)) {
            kx_transfer_fail(r, x, FI_ECANCELED);
            return 1;
        }
        if (!x->have_msg) {
            if (!kx_walk_next(x))
                return 1;
            if (x->posted >= x->planned) {
                /* the walk yields more than it counted: the triples changed under us. The
                 * transfer owns a copy, so this is a bug; refuse rather than overrun x->ops. */
                kx_transfer_fail(r, x, FI_EINVAL);
                return 1;
            }
            x->have_msg = 1;
        }
        if (budget <= 0)
            return 0;
        /* the target closed the region (its REVOKE, revoke.c): post nothing more to it, as it
         * would refuse it in a way neither provider reports (docs/reliability.md) */
        int refused = kx_revoked_check(r, x);
        if (refused) {
            kx_transfer_fail(r, x, refused);
            return 1;
        }
        int np = x->npieces;
        int64_t bytes = 0;
        for (int k = 0; k < np; k++)
            bytes += (int64_t)x->piece_len[k];
        /* never post to a peer known closed, exited or stalled (peers.c says why) */
        int gone = kx_peer_enter(r, x->peer, x->gen);
        if (gone) {
            kx_transfer_fail(r, x, gone);
            return 1;
        }
        if (x->direct) {
            /* a direct write (direct.c): the bytes go by memcpy into our mapping of the
             * peer's region, once (within the budget: a large message over several calls),
             * and the message itself is a 0-byte write carrying the imm, so the target
             * counts exactly what it counts otherwise */
            if (x->copied < (uint64_t)bytes) {
                int revoked;
                budget -= (int64_t)kx_direct_copy(x, (uint64_t)budget, &revoked);
                if (revoked) {
                    /* the target deregistered the region, or revoked it under a live key
                     * (its permit, direct.c): this message's bytes are not all in place, so
                     * its imm must never count. Fail the transfer and post nothing more of
                     * it, as the RMA path fails on the target's key check */
                    __atomic_add_fetch(&r->stat_direct_revoked, 1, __ATOMIC_RELAXED);
                    kx_peer_leave(r, x->peer);
                    kx_transfer_fail(r, x, FI_EACCES);
                    return 1;
                } else if (x->copied < (uint64_t)bytes) {
                    kx_peer_leave(r, x->peer);
                    return 0;
                } else {
                    /* the whole message is in place: order the copy (non-temporal stores
                     * included) before the write that tells the peer */
                    __atomic_thread_fence(__ATOMIC_SEQ_CST);
                    __atomic_add_fetch(&r->stat_direct, 1, __ATOMIC_RELAXED);
                }
            }
            if (!(x->flags & FI_REMOTE_CQ_DATA)) {
                /* nothing to tell the target: the message is complete once copied (posted
                 * and completed move together, so no stall check sees it outstanding) */
                kx_peer_leave(r, x->peer);
                pthread_mutex_lock(&r->hub->lock);
                __atomic_add_fetch(&x->posted, 1, __ATOMIC_RELEASE);
                __atomic_add_fetch(&x->accepted, 1, __ATOMIC_RELEASE);
                __atomic_add_fetch(&x->completed, 1, __ATOMIC_RELAXED);
                pthread_mutex_unlock(&r->hub->lock);
                x->have_msg = 0;
                x->copied = 0;
                continue;
            }
            np = 1;
            iov[0].iov_base = x->src_base;
            iov[0].iov_len = 0;
            desc[0] = x->desc;
            rma[0].addr = x->dst_base;
            rma[0].len = 0;
            rma[0].key = x->key;
        } else {
            for (int k = 0; k < np; k++) {
                iov[k].iov_base = x->src_base + x->piece_src[k];
                iov[k].iov_len = x->piece_len[k];
                desc[k] = x->desc;
                rma[k].addr = x->dst_base + x->piece_dst[k];
                rma[k].len = x->piece_len[k];
                rma[k].key = x->key;
            }
        }
        kx_op *op = x->ops ? &x->ops[x->posted] : &x->shared_op;
        struct fi_msg_rma msg = {
            .msg_iov = iov, .desc = desc, .iov_count = (size_t)np, .addr = x->peer,
            .rma_iov = rma, .rma_iov_count = (size_t)np, .context = &op->fi, .data = x->imm,
        };
        /* count it first: the completion may be read by another thread before we return */
        __atomic_add_fetch(&r->outstanding, 1, __ATOMIC_RELAXED);
        if (__atomic_load_n(&x->posted, __ATOMIC_ACQUIRE) == __atomic_load_n(&x->completed, __ATOMIC_ACQUIRE))
            __atomic_store_n(&x->last_ns, kx_now_ns(), __ATOMIC_RELEASE);   /* its stall clock starts */
        int64_t index = __atomic_fetch_add(&x->posted, 1, __ATOMIC_RELEASE);
        kx_peer_count(r, x->peer, 1);
        /* delivery-complete only on the transfer's last message: the messages of a transfer
         * go in order over one connection, so the target has processed every earlier one
         * when it acknowledges the last, and a refused one drops the connection, failing
         * the last (docs/reliability.md, finding 6); the others complete on transmit */
        uint64_t flags = x->flags;
        if (index + 1 < x->planned)
            flags &= ~(uint64_t)FI_DELIVERY_COMPLETE;
        ssize_t ret = fi_writemsg(r->ep, &msg, flags);
        /* the peer's entry (its bell, its counts) only while entered: kx_av_remove waits
         * for that before it retires the entry */
        if (ret == 0) {
            __atomic_add_fetch(&x->accepted, 1, __ATOMIC_RELEASE);
            kx_peer_accepted(r, x->peer);
        } else
            kx_peer_uncount(r, x->peer, ret == -FI_EAGAIN);
        kx_peer_leave(r, x->peer);
        if (ret == 0) {
            x->have_msg = 0;
            if (x->direct)
                x->copied = 0;          /* its bytes were counted against the budget as copied */
            else
                budget -= bytes;
            __atomic_add_fetch(&r->stat_writes, 1, __ATOMIC_RELAXED);
            continue;
        }
        __atomic_sub_fetch(&r->outstanding, 1, __ATOMIC_RELAXED);
        __atomic_sub_fetch(&x->posted, 1, __ATOMIC_RELEASE);
        if (ret == -FI_EAGAIN) {
            r->eagain_ns = kx_now_ns();
            return 0;
        }
        kx_transfer_fail(r, x, (int)-ret);
        return 1;
    }
}

/* Finish every cancelled transfer in the queue, wherever it sits: a cancelled transfer
 * behind a head that the provider keeps refusing (a dead peer) must still end. Only the
 * progress thread touches queued transfers, so it may unlink them. */
static int kx_sweep_cancelled(kx_rail *r)
{
    int finished = 0;
    pthread_mutex_lock(&r->hub->lock);
    r->cancel_pending = 0;
    kx_transfer *prev = NULL, *x = r->q_head;
    while (x) {
        kx_transfer *next = x->qnext;
        if (__atomic_load_n(&x->cancel, __ATOMIC_ACQUIRE) && !x->have_msg) {
            if (prev)
                prev->qnext = next;
            else
                r->q_head = next;
            if (r->q_tail == x)
                r->q_tail = prev;
            x->qnext = NULL;
            if (!x->error)
                x->error = FI_ECANCELED;
            kx_transfer_finish_posting_locked(r, x);
            finished++;
        } else {
            prev = x;
        }
        x = next;
    }
    pthread_mutex_unlock(&r->hub->lock);
    return finished;
}

/* Start a transfer the caller built: link it to the rail, post up to `budget` bytes of it
 * from the caller's thread (unless transfers are already queued, whose order it keeps), and
 * queue the rest for the progress thread, which posts it with the transfer's own pump (a
 * write's kx_pump, a read's kx_pump_read). One submit for writes and reads. */
void kx_transfer_submit(kx_rail *r, kx_transfer *x, int64_t budget)
{
    pthread_mutex_lock(&r->hub->lock);
    kx_transfer_link_locked(r, x);
    int queued = r->q_head != NULL;   /* keep order behind transfers already queued */
    pthread_mutex_unlock(&r->hub->lock);

    int walk_ended = 0;
    if (!queued && kx_enter(r)) {
        kx_posting_begin(r);
        walk_ended = x->pump ? x->pump(r, x, budget) : kx_pump(r, x, budget);
        kx_posting_end(r);
        kx_leave(r);
    }
    pthread_mutex_lock(&r->hub->lock);
    if (walk_ended || r->stop) {
        if (r->stop && !walk_ended && !x->error)
            x->error = FI_ECANCELED;
        kx_transfer_finish_posting_locked(r, x);
    } else {
        if (r->q_tail)
            r->q_tail->qnext = x;
        else
            r->q_head = x;
        r->q_tail = x;
    }
    pthread_mutex_unlock(&r->hub->lock);
    kx_wake(r);
}

/* The progress thread's share of posting: drive the queue head until the provider is full.
 * Returns the number of transfers whose posting finished (activity, for the idle logic). */
int kx_pump_queue(kx_rail *r)
{
    int finished = 0;
    if (__atomic_load_n(&r->cancel_pending, __ATOMIC_ACQUIRE))
        finished += kx_sweep_cancelled(r);
    for (;;) {
        pthread_mutex_lock(&r->hub->lock);
        kx_transfer *x = r->q_head;
        pthread_mutex_unlock(&r->hub->lock);
        if (!x)
            return finished;
        int64_t before = x->posted;
        int walk_ended = x->pump ? x->pump(r, x, INT64_MAX)     /* a read (read.c) */
                                 : kx_pump(r, x, x->direct ? KX_DIRECT_ROUND : INT64_MAX);
        if (!walk_ended)
            return finished + (x->posted != before);
        pthread_mutex_lock(&r->hub->lock);
        r->q_head = x->qnext;
        if (!r->q_head)
            r->q_tail = NULL;
        x->qnext = NULL;
        kx_transfer_finish_posting_locked(r, x);
        pthread_mutex_unlock(&r->hub->lock);
        finished++;
    }
}

kx_transfer *kx_transfer_new(const uint64_t *src_off, const uint64_t *dst_off, const uint64_t *length,
                             size_t n, size_t iov, uint64_t max_write, uint64_t pack_min, int need_ctx, int kind)
{
    kx_transfer *x = calloc(1, sizeof(*x));
    if (!x)
        return NULL;
    x->planned = kx_count_messages(src_off, dst_off, length, n, iov, max_write, pack_min);
    for (size_t i = 0; i < n; i++)
        x->nbytes += length[i];
    if (need_ctx && x->planned > 0) {
        x->ops = calloc((size_t)x->planned, sizeof(kx_op));
        if (!x->ops) {
            free(x);
            return NULL;
        }
        for (int64_t k = 0; k < x->planned; k++) {
            x->ops[k].kind = kind;
            x->ops[k].owner = x;
        }
    }
    x->shared_op.kind = kind;
    x->shared_op.owner = x;
    x->refs = 2;  /* owner + in-flight */
    if (n) {
        /* a private copy: the progress thread walks it after the caller has returned, and
         * nothing the caller does afterwards (reuse, free, an exception) may change it */
        x->owned = malloc(3 * n * sizeof(uint64_t));
        if (!x->owned) {
            free(x->ops);
            free(x);
            return NULL;
        }
        memcpy(x->owned, src_off, n * sizeof(uint64_t));
        memcpy(x->owned + n, dst_off, n * sizeof(uint64_t));
        memcpy(x->owned + 2 * n, length, n * sizeof(uint64_t));
        src_off = x->owned;
        dst_off = x->owned + n;
        length = x->owned + 2 * n;
    }
    kx_walk_init(x, src_off, dst_off, length, n, iov, max_write, pack_min);
    return x;
}

/* Whether messages of at most `iov` pieces and `max_write` bytes, with pieces shorter than
 * `pack_min` alone, are legal on `r` (NULL: no rail yet, KX_MAX_IOV only). libfabric 1.17's
 * release builds check these only by assert: a message past them corrupts memory. The engine
 * computes them from rail 0 (every rail is the same provider); each rail refuses what its
 * own provider would not take, at kx_write and, for the watcher, when an entry is armed. */
int kx_limits_ok(const kx_rail *r, size_t iov, uint64_t max_write, uint64_t pack_min)
{
    size_t iov_max = r ? r->iov_limit : KX_MAX_IOV;
    return iov >= 1 && iov <= iov_max && max_write >= 1 && (!r || max_write <= r->max_msg_size) &&
           pack_min <= max_write;
}

int kx_write(kx_rail *r, fi_addr_t peer, uint32_t gen, char *src_base, void *desc, uint64_t dst_base, uint64_t key,
             kx_direct *direct, const uint64_t *src_off, const uint64_t *dst_off, const uint64_t *length, size_t n,
             int has_imm, uint32_t imm, size_t iov, uint64_t max_write, uint64_t pack_min,
             kx_transfer **out)
{
    if (!kx_limits_ok(r, iov, max_write, pack_min))
        return -FI_EINVAL;
    kx_transfer *x = kx_transfer_new(src_off, dst_off, length, n, iov, max_write, pack_min, r->need_ctx,
                                     KX_OP_WRITE);
    if (!x)
        return -FI_ENOMEM;
    x->peer = peer;
    x->gen = gen;
    x->src_base = src_base;
    x->desc = desc;
    x->dst_base = dst_base;
    x->key = key;
    if (direct) {
        kx_direct_ref(direct);
        x->direct = direct;
        x->direct_base = kx_direct_base(direct);
    }
    x->flags = FI_COMPLETION | (has_imm ? FI_REMOTE_CQ_DATA : 0) | (r->delivery_complete ? FI_DELIVERY_COMPLETE : 0);
    x->imm = imm;

    kx_transfer_submit(r, x, KX_CALLER_BUDGET);
    *out = x;
    return 0;
}
