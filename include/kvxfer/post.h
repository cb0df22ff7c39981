/* post.h: turning (src offset, dst offset, length) triples into RMA writes.
 *
 * The message rule (also in kvxfer/wire.py:count_writes, which a receiver uses to know how
 * many immediates to expect; the two must agree):
 *   1. adjacent triples that are contiguous on both sides merge into one segment;
 *   2. segments are packed, in order, into messages of at most `iov` pieces and at most
 *      `max_write` bytes; a segment that does not fit is split at the message boundary.
 * Each message is one fi_writemsg with `iov` local and `iov` remote pieces of equal
 * lengths, so one message gives exactly one remote CQ entry (one immediate). */
#ifndef KVXFER_POST_H
#define KVXFER_POST_H

#include "kvxfer/core.h"
#include "kvxfer/progress.h"

typedef void (*kx_emit_fn)(void *arg, int npieces, const uint64_t *so, const uint64_t *dof, const uint64_t *ln);

/* walk the message rule; calls emit once per message (emit may be NULL: count only) */
static int64_t kx_walk(const uint64_t *so, const uint64_t *dof, const uint64_t *ln, size_t n,
                       size_t iov, uint64_t max_write, kx_emit_fn emit, void *arg)
{
    uint64_t ps[KX_MAX_IOV], pd[KX_MAX_IOV], pl[KX_MAX_IOV];
    int np = 0;
    uint64_t bytes = 0;
    int64_t msgs = 0;
    size_t i = 0;
    if (iov < 1)
        iov = 1;
    if (iov > KX_MAX_IOV)
        iov = KX_MAX_IOV;
    while (i < n) {
        uint64_t s = so[i], d = dof[i], l = ln[i];
        i++;
        while (i < n && so[i] == s + l && dof[i] == d + l) {   /* rule 1 */
            l += ln[i];
            i++;
        }
        while (l > 0) {                                          /* rule 2 */
            if ((size_t)np == iov || bytes == max_write) {
                if (emit)
                    emit(arg, np, ps, pd, pl);
                msgs++;
                np = 0;
                bytes = 0;
            }
            uint64_t take = max_write - bytes < l ? max_write - bytes : l;
            ps[np] = s;
            pd[np] = d;
            pl[np] = take;
            np++;
            bytes += take;
            s += take;
            d += take;
            l -= take;
        }
    }
    if (np > 0) {
        if (emit)
            emit(arg, np, ps, pd, pl);
        msgs++;
    }
    return msgs;
}

typedef struct kx_poster {
    kx_engine *e;
    kx_xfer *x;
    fi_addr_t peer;
    char *src_base;
    void *desc;
    uint64_t dst_base;
    uint64_t key;
    uint64_t flags;
    uint32_t imm;
    int64_t index;
} kx_poster;

static void kx_emit_post(void *arg, int np, const uint64_t *so, const uint64_t *dof, const uint64_t *ln)
{
    kx_poster *p = (kx_poster *)arg;
    kx_engine *e = p->e;
    kx_xfer *x = p->x;
    if (x->error)
        return;    /* a post failed: post nothing more */
    struct iovec iov[KX_MAX_IOV];
    void *desc[KX_MAX_IOV];
    struct fi_rma_iov rma[KX_MAX_IOV];
    for (int k = 0; k < np; k++) {
        iov[k].iov_base = p->src_base + so[k];
        iov[k].iov_len = ln[k];
        desc[k] = p->desc;
        rma[k].addr = p->dst_base + dof[k];
        rma[k].len = ln[k];
        rma[k].key = p->key;
    }
    kx_op *op = x->ops ? &x->ops[p->index] : &x->shared_op;
    struct fi_msg_rma msg = {
        .msg_iov = iov, .desc = desc, .iov_count = (size_t)np, .addr = p->peer,
        .rma_iov = rma, .rma_iov_count = (size_t)np, .context = &op->fi, .data = p->imm,
    };
    __atomic_add_fetch(&e->outstanding, 1, __ATOMIC_RELAXED);
    x->posted++;
    ssize_t ret;
    for (;;) {
        ret = fi_writemsg(e->ep, &msg, p->flags);
        if (ret != -FI_EAGAIN)
            break;
        if (kx_poll(e) == 0)
            sched_yield();
        if (e->stop) {
            ret = -FI_ECANCELED;
            break;
        }
    }
    if (ret) {
        __atomic_sub_fetch(&e->outstanding, 1, __ATOMIC_RELAXED);
        x->posted--;
        pthread_mutex_lock(&e->lock);
        if (!x->error)
            x->error = (int)-ret;
        e->last_error = (int)-ret;
        snprintf(e->last_error_call, sizeof(e->last_error_call), "fi_writemsg");
        pthread_mutex_unlock(&e->lock);
        return;
    }
    p->index++;
    e->stat_writes++;
}


/* Allocate a transfer for the triples and post every message. Runs without the GIL.
 * Returns the transfer (never NULL unless out of memory); its planned count is the number
 * of messages (= immediates the target sees); posting errors land in x->error. */
static kx_xfer *kx_write(kx_engine *e, fi_addr_t peer, char *src_base, void *desc,
                         uint64_t dst_base, uint64_t key,
                         const uint64_t *so, const uint64_t *dof, const uint64_t *ln, size_t n,
                         int has_imm, uint32_t imm, size_t iov, uint64_t max_write)
{
    kx_xfer *x = calloc(1, sizeof(*x));
    if (!x)
        return NULL;
    x->planned = kx_walk(so, dof, ln, n, iov, max_write, NULL, NULL);
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
    pthread_mutex_lock(&e->lock);
    kx_xfer_link_locked(e, x);
    pthread_mutex_unlock(&e->lock);

    kx_poster p = {
        .e = e, .x = x, .peer = peer, .src_base = src_base, .desc = desc, .dst_base = dst_base,
        .key = key, .flags = FI_COMPLETION | (has_imm ? FI_REMOTE_CQ_DATA : 0), .imm = imm, .index = 0,
    };
    __atomic_add_fetch(&e->posting, 1, __ATOMIC_ACQ_REL);
    kx_walk(so, dof, ln, n, iov, max_write, kx_emit_post, &p);
    __atomic_sub_fetch(&e->posting, 1, __ATOMIC_ACQ_REL);

    pthread_mutex_lock(&e->lock);
    x->posting_done = 1;
    kx_xfer_check_done_locked(e, x);
    pthread_mutex_unlock(&e->lock);
    kx_wake(e);
    return x;
}

#endif
