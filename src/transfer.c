/* transfer.c: a transfer's life cycle. A kx_transfer is referenced by its owner and, until
 * it is done, by the rail's in-flight list; it is done once posting has ended and every
 * posted message has completed. Cancelling stops posting; a rail's peer can be cancelled
 * as a whole. Everything *_locked runs under the hub's lock. */
#include "internal.h"

void kx_transfer_release_locked(kx_transfer *x)
{
    if (--x->refs == 0) {
        kx_direct_unref(x->direct);
        free(x->ops);
        free(x->owned);
        free(x);
    }
}

void kx_transfer_link_locked(kx_rail *r, kx_transfer *x)
{
    x->linked = 1;
    x->prev = NULL;
    x->next = r->inflight;
    if (r->inflight)
        r->inflight->prev = x;
    r->inflight = x;
}

static void kx_transfer_unlink_locked(kx_rail *r, kx_transfer *x)
{
    if (x->prev)
        x->prev->next = x->next;
    else
        r->inflight = x->next;
    if (x->next)
        x->next->prev = x->prev;
    x->prev = x->next = NULL;
}

void kx_transfer_check_done_locked(kx_rail *r, kx_transfer *x)
{
    if (x->linked && x->posting_done && x->completed >= x->posted) {
        __atomic_store_n(&x->done, 1, __ATOMIC_RELEASE);
        x->linked = 0;
        pthread_cond_broadcast(&r->hub->cond);
        kx_transfer_unlink_locked(r, x);
        kx_transfer_release_locked(x);  /* the in-flight reference */
    }
}

/* Fail a transfer now (its peer is dead, or it stalled): post nothing more, wake its
 * waiters. It stays linked until its posted operations complete or the endpoint closes. */
void kx_transfer_fail_locked(kx_rail *r, kx_transfer *x, int err)
{
    if (!x->error)
        x->error = err;
    __atomic_store_n(&x->cancel, 1, __ATOMIC_RELEASE);
    if (!x->done) {
        __atomic_store_n(&x->done, 1, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&r->hub->cond);
    }
}

void kx_transfer_finish_posting_locked(kx_rail *r, kx_transfer *x)
{
    x->posting_done = 1;
    /* nothing copies through the direct mapping any more: let it go now rather than when
     * the owner frees the transfer (a done transfer can sit in a rail's pending list for a
     * while, and the mapping keeps the peer's pages). Rarely the last reference, which
     * unmaps: when the RemoteRegion went first. */
    kx_direct_unref(x->direct);
    x->direct = NULL;
    kx_transfer_check_done_locked(r, x);
}

void kx_transfer_get_state(const kx_transfer *x, kx_transfer_state *out)
{
    out->done = __atomic_load_n(&x->done, __ATOMIC_ACQUIRE);
    out->planned = x->planned;
    out->posted = __atomic_load_n(&x->posted, __ATOMIC_ACQUIRE);
    out->completed = __atomic_load_n(&x->completed, __ATOMIC_RELAXED);
    out->posting_done = __atomic_load_n(&x->posting_done, __ATOMIC_RELAXED);
    out->error = __atomic_load_n(&x->error, __ATOMIC_RELAXED);
    out->linked = __atomic_load_n(&x->linked, __ATOMIC_RELAXED);
}

int kx_transfer_wait(kx_rail *r, kx_transfer *x, int64_t slice_ns)
{
    if (x->nbytes <= KX_TX_DRIVE_MAX_BYTES)
        return kx_wait_transfer_flag(r, &x->done, slice_ns);
    return kx_wait_flag(r, &x->done, slice_ns);
}

/* Safe at any time: only the thread pumping the transfer acts on the flag (and dequeues it). */
void kx_transfer_cancel(kx_rail *r, kx_transfer *x)
{
    __atomic_store_n(&x->cancel, 1, __ATOMIC_RELEASE);
    __atomic_store_n(&r->cancel_pending, 1, __ATOMIC_RELEASE);
    kx_wake(r);
}

void kx_transfer_release(kx_rail *r, kx_transfer *x)
{
    pthread_mutex_lock(&r->hub->lock);
    kx_transfer_release_locked(x);
    pthread_mutex_unlock(&r->hub->lock);
}

/* Queued transfers and those being posted by another thread right now are all linked in
 * the in-flight list (before their first post), so every one to `peer` is found. */
int kx_peer_cancel(kx_rail *r, fi_addr_t peer, uint32_t gen)
{
    int n = 0;
    pthread_mutex_lock(&r->hub->lock);
    for (kx_transfer *x = r->inflight; x; x = x->next) {
        if (x->peer == peer && (!gen || x->gen == gen) && !x->done) {
            __atomic_store_n(&x->cancel, 1, __ATOMIC_RELEASE);
            n++;
        }
    }
    __atomic_store_n(&r->cancel_pending, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&r->hub->lock);
    kx_wake(r);
    return n;
}

int kx_peer_wait(kx_rail *r, fi_addr_t peer, uint32_t gen, int64_t slice_ns, int *posting)
{
    struct timespec ts;
    int n, p, expired = 0;
    kx_deadline(&ts, slice_ns);
    pthread_mutex_lock(&r->hub->lock);
    for (;;) {
        n = p = 0;
        for (kx_transfer *x = r->inflight; x; x = x->next) {
            if (x->peer == peer && (!gen || x->gen == gen)) {     /* not a removed peer's leftovers */
                n++;
                p += !x->posting_done;
            }
        }
        if (n == 0 || expired)
            break;
        expired = pthread_cond_timedwait(&r->hub->cond, &r->hub->lock, &ts) == ETIMEDOUT;
    }
    pthread_mutex_unlock(&r->hub->lock);
    *posting = p;
    return n;
}
