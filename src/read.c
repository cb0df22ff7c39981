/* read.c: one-sided reads, fi_readmsg of (local offset, remote offset, length) triples from a
 * peer's registered region into a local one.
 *
 * The mirror of post.c's writes, for the pull road (the decoder reads the prefiller's pages
 * once they are complete, so it alone knows when they are): the same walk cuts the triples
 * into messages by the message rule's rules 1 and 2 (adjacent triples contiguous on both
 * sides merge; at most `iov` pieces and `max_read` bytes a message), each message one
 * fi_readmsg with equal local and remote pieces. Rule 3 and immediates do not apply: a read
 * carries no CQ data, the target's CQ sees nothing, and completion is the reader's own CQ
 * entry per message (progress.c completes KX_OP_READ like a write; its transfer is done when
 * every posted message completed, with the first error kept). A transfer is one kind: a
 * kx_transfer whose `pump` is kx_pump_read, which the progress thread calls instead of kx_pump
 * (post.c knows no read: this unit sits above it).
 *
 * Before anything is posted, every triple is checked against both regions (`local_len`,
 * `remote_len`; overflow included) and the limits against the rail's provider: a read that
 * leaves a region is refused whole with -FI_EINVAL. The provider enforces the target's
 * registration (its key, and FI_REMOTE_READ: kx_mr_reg's KX_REMOTE_READ), except shm, whose
 * CMA copy checks neither: there the boundary is the OS user (docs/reliability.md).
 *
 * Posting never blocks on the transport, as for writes: the calling thread posts up to a
 * byte budget or until the provider says -FI_EAGAIN, then queues the rest behind the rail's
 * other transfers for the progress thread (kx_pump_queue calls the transfer's `pump`). Reads always
 * go over RMA: a shm peer's memfd mapping (direct.c) is for writes only. */
#include "internal.h"

/* Bytes the calling thread reads itself before handing the rest to the progress thread (as
 * post.c's KX_CALLER_BUDGET: shm's CMA copy happens inside the post call). */
#ifndef KX_READ_CALLER_BUDGET
#define KX_READ_CALLER_BUDGET (256 * 1024)
#endif

/* 1 when every triple lies inside both regions (each sum checked without overflow). */
static int kx_read_bounds_ok(const uint64_t *local_off, const uint64_t *remote_off, const uint64_t *length,
                             size_t n, uint64_t local_len, uint64_t remote_len)
{
    for (size_t i = 0; i < n; i++) {
        uint64_t l = length[i];
        if (l > local_len || local_off[i] > local_len - l || l > remote_len || remote_off[i] > remote_len - l)
            return 0;
    }
    return 1;
}

/* Post messages of the read x until its walk ends (returns 1), the provider is full or
 * `budget` bytes have been posted (0), or a post fails or x is cancelled (1, with x->error
 * set: nothing more is posted). kx_pump's accounting, without the direct path. */
static int kx_pump_read(kx_rail *r, kx_transfer *x, int64_t budget)
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
            if (x->posted >= x->planned) {      /* the walk yields more than it counted: a bug */
                kx_transfer_fail(r, x, FI_EINVAL);
                return 1;
            }
            x->have_msg = 1;
        }
        if (budget <= 0)
            return 0;
        /* the target closed the region (its REVOKE, revoke.c): read nothing more of it (shm
         * would copy the closed region's still-mapped memory, checking no key) */
        int refused = kx_revoked_check(r, x);
        if (refused) {
            kx_transfer_fail(r, x, refused);
            return 1;
        }
        int np = x->npieces;
        int64_t bytes = 0;
        for (int k = 0; k < np; k++) {
            bytes += (int64_t)x->piece_len[k];
            iov[k].iov_base = x->src_base + x->piece_src[k];    /* src_*: the local side */
            iov[k].iov_len = x->piece_len[k];
            desc[k] = x->desc;
            rma[k].addr = x->dst_base + x->piece_dst[k];        /* dst_*: the peer's region */
            rma[k].len = x->piece_len[k];
            rma[k].key = x->key;
        }
        int gone = kx_peer_enter(r, x->peer, x->gen);           /* liveness.c */
        if (gone) {
            kx_transfer_fail(r, x, gone);
            return 1;
        }
        kx_op *op = x->ops ? &x->ops[x->posted] : &x->shared_op;
        struct fi_msg_rma msg = {
            .msg_iov = iov, .desc = desc, .iov_count = (size_t)np, .addr = x->peer,
            .rma_iov = rma, .rma_iov_count = (size_t)np, .context = &op->fi, .data = 0,
        };
        /* count it first: the completion may be read by another thread before we return */
        __atomic_add_fetch(&r->outstanding, 1, __ATOMIC_RELAXED);
        if (__atomic_load_n(&x->posted, __ATOMIC_ACQUIRE) == __atomic_load_n(&x->completed, __ATOMIC_ACQUIRE))
            __atomic_store_n(&x->last_ns, kx_now_ns(), __ATOMIC_RELEASE);   /* its stall clock starts */
        __atomic_fetch_add(&x->posted, 1, __ATOMIC_RELEASE);
        kx_peer_count(r, x->peer, 1);
        ssize_t ret = fi_readmsg(r->ep, &msg, x->flags);
        if (ret == 0) {
            __atomic_add_fetch(&x->accepted, 1, __ATOMIC_RELEASE);
            kx_peer_accepted(r, x->peer);
        } else
            kx_peer_uncount(r, x->peer, ret == -FI_EAGAIN);
        kx_peer_leave(r, x->peer);
        if (ret == 0) {
            x->have_msg = 0;
            budget -= bytes;
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

int kx_read(kx_rail *r, fi_addr_t peer, uint32_t gen, char *local_base, void *desc, uint64_t local_len,
            uint64_t remote_base, uint64_t key, uint64_t remote_len, const uint64_t *local_off,
            const uint64_t *remote_off, const uint64_t *length, size_t n, size_t iov, uint64_t max_read,
            kx_transfer **out)
{
    if (!kx_limits_ok(r, iov, max_read, 0))
        return -FI_EINVAL;
    if (n && (!local_off || !remote_off || !length))
        return -FI_EINVAL;
    if (!kx_read_bounds_ok(local_off, remote_off, length, n, local_len, remote_len))
        return -FI_EINVAL;
    kx_transfer *x = kx_transfer_new(local_off, remote_off, length, n, iov, max_read, 0, r->need_ctx, KX_OP_READ);
    if (!x)
        return -FI_ENOMEM;
    x->peer = peer;
    x->gen = gen;
    x->src_base = local_base;
    x->desc = desc;
    x->dst_base = remote_base;
    x->key = key;
    x->flags = FI_COMPLETION;
    x->pump = kx_pump_read;       /* the progress thread posts what the caller leaves */

    kx_transfer_submit(r, x, KX_READ_CALLER_BUDGET);
    *out = x;
    return 0;
}
