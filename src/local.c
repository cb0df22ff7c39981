/* local.c: same-process engines: one kx_local cell per open engine endpoint of this process,
 * in a process-wide list keyed by endpoint name. A rail posting to a local peer brackets the
 * post with the cell's `busy` count after checking `closed`; the owner's teardown sets
 * `closed` and waits for `busy` to drain before it closes its endpoint, so a post never
 * reaches a closed endpoint. The cells also carry shm's deferral rule (below): an endpoint's
 * region outlives the progress of every engine of this process that may read it. */

#include "internal.h"

static pthread_mutex_t kx_locals_lock = PTHREAD_MUTEX_INITIALIZER;
static kx_local *kx_locals;

static void kx_local_unref_locked(kx_local *c)
{
    if (--c->refs == 0) {
        for (kx_local **p = &kx_locals; *p; p = &(*p)->next) {
            if (*p == c) {
                *p = c->next;
                break;
            }
        }
        free(c->held);
        free(c);
    }
}

void kx_local_unref(kx_local *c)
{
    pthread_mutex_lock(&kx_locals_lock);
    kx_local_unref_locked(c);
    pthread_mutex_unlock(&kx_locals_lock);
}

/* Same-process shm peers (the deferral rule of rail.c). shm 1.17 keeps a same-process peer's
 * region by pointer: once X posts to Y, X's progress may read Y's region and Y's (which
 * mapped X on X's first command) may read X's. So an endpoint's region must outlive the
 * progress of every engine of this process that holds it. A rail's cell `held` lists the
 * cells its progress may read; each holds a reference and counts in the cell's `mapped_by`.
 * Links are made on connect, dropped when the holder removes the peer from its AV (only its
 * own side) and when the holder's progress thread has been joined (all of them). A closing
 * shm rail whose cell is still mapped by someone is deferred (kx_local_defer); the thread
 * that drops `mapped_by` to 0 closes its fids (kx_rail_finish_deferred). Under the lock. */
static int kx_hold_locked(kx_local *holder, kx_local *c)
{
    if (holder->nheld == holder->capheld) {
        int cap = holder->capheld ? 2 * holder->capheld : 4;
        kx_local **h = realloc(holder->held, (size_t)cap * sizeof(*h));
        if (!h)
            return -FI_ENOMEM;
        holder->held = h;
        holder->capheld = cap;
    }
    holder->held[holder->nheld++] = c;
    c->refs++;
    c->mapped_by++;
    return 0;
}

/* drop one hold of c; returns c's rail when that ends its deferral (the caller finishes it) */
static kx_rail *kx_unhold_locked(kx_local *c)
{
    kx_rail *finish = NULL;
    if (--c->mapped_by == 0 && c->deferred) {
        finish = c->deferred;
        c->deferred = NULL;
        finish->deferred = 2;
    }
    kx_local_unref_locked(c);
    return finish;
}

void kx_local_link(kx_rail *x, kx_local *y)
{
    kx_local *xc = x->self_local;
    if (!x->shm || !xc || xc == y)
        return;
    pthread_mutex_lock(&kx_locals_lock);
    if (kx_hold_locked(xc, y) == 0 && kx_hold_locked(y, xc) != 0) {
        /* out of memory for the back link: keep X's region for good rather than risk it */
        xc->refs++;
        xc->mapped_by++;
    }
    pthread_mutex_unlock(&kx_locals_lock);
}

void kx_local_unlink(kx_rail *x, kx_local *y)
{
    kx_local *xc = x->self_local;
    kx_rail *finish = NULL;
    if (!xc)
        return;
    pthread_mutex_lock(&kx_locals_lock);
    for (int i = 0; i < xc->nheld; i++) {
        if (xc->held[i] == y) {
            xc->held[i] = xc->held[--xc->nheld];
            finish = kx_unhold_locked(y);
            break;
        }
    }
    pthread_mutex_unlock(&kx_locals_lock);
    if (finish)
        kx_rail_finish_deferred(finish);
}

/* r's progress thread has been joined: it reads no other region any more */
void kx_local_release(kx_rail *r)
{
    kx_local *c = r->self_local;
    if (!c)
        return;
    for (;;) {
        kx_rail *finish = NULL;
        pthread_mutex_lock(&kx_locals_lock);
        while (c->nheld > 0 && !finish)
            finish = kx_unhold_locked(c->held[--c->nheld]);
        pthread_mutex_unlock(&kx_locals_lock);
        if (!finish)
            return;
        kx_rail_finish_deferred(finish);
    }
}

/* a closing shm rail: 1 if another engine's progress may still read its region (it is now
 * deferred), else 0 (close it now) */
int kx_local_defer(kx_rail *r)
{
    kx_local *c = r->self_local;
    if (!r->shm || !c)
        return 0;
    pthread_mutex_lock(&kx_locals_lock);
    int d = c->mapped_by > 0;
    if (d) {
        r->deferred = 1;
        c->deferred = r;
    }
    pthread_mutex_unlock(&kx_locals_lock);
    return d;
}

/* 1 while r is deferred or being closed by another thread (and notes what its owner asked
 * for: the domain's close, its freeing); 0 once its fids are closed */
int kx_local_still_deferred(kx_rail *r, int freeing)
{
    pthread_mutex_lock(&kx_locals_lock);
    int d = r->deferred;
    if (d) {
        r->domain_requested = 1;
        if (freeing)
            r->free_requested = 1;
    }
    pthread_mutex_unlock(&kx_locals_lock);
    return d;
}

/* the closing thread of a deferred rail, after kx_rail_close_fids: 1 if its owner asked for
 * the domain's close, which the caller now does while the rail stays deferred ("being
 * closed": the owner's own close and free wait for kx_local_deferred_end); 0: the rail is
 * no longer deferred and its owner closes the domain */
int kx_local_deferred_done(kx_rail *r)
{
    pthread_mutex_lock(&kx_locals_lock);
    int out = r->free_requested || r->domain_requested;
    if (!out)
        r->deferred = 0;
    pthread_mutex_unlock(&kx_locals_lock);
    return out;
}

/* ... and after closing the domain: the rail is no longer deferred; 1 if its owner asked
 * for its freeing meanwhile (the caller frees it: the owner never touches it again) */
int kx_local_deferred_end(kx_rail *r)
{
    pthread_mutex_lock(&kx_locals_lock);
    int f = r->free_requested;
    r->deferred = 0;
    pthread_mutex_unlock(&kx_locals_lock);
    return f;
}

/* publish this rail's endpoint name (after fi_enable) */
int kx_local_publish(kx_rail *r)
{
    kx_local *c = calloc(1, sizeof(*c));
    if (!c)
        return -FI_ENOMEM;
    size_t n = sizeof(c->name);
    if (fi_getname(&r->ep->fid, c->name, &n) || n > sizeof(c->name)) {
        free(c);
        return 0;          /* unnamed: nothing can connect to it by name anyway */
    }
    c->len = n;
    c->refs = 1;
    pthread_mutex_lock(&kx_locals_lock);
    c->next = kx_locals;
    kx_locals = c;
    pthread_mutex_unlock(&kx_locals_lock);
    r->self_local = c;
    return 0;
}

/* the first step of teardown: refuse new posts from other engines of this process to us,
 * and wait (bounded) for those under way */
void kx_local_retire(kx_rail *r)
{
    kx_local *c = r->self_local;
    if (!c)
        return;
    __atomic_store_n(&c->closed, 1, __ATOMIC_SEQ_CST);
    int64_t until = kx_now_ns() + 1000000000LL;
    while (__atomic_load_n(&c->busy, __ATOMIC_SEQ_CST) && kx_now_ns() < until)
        sched_yield();
}

kx_local *kx_local_find(const void *name, size_t len)
{
    kx_local *found = NULL;
    pthread_mutex_lock(&kx_locals_lock);
    for (kx_local *c = kx_locals; c; c = c->next) {
        if (c->len == len && !memcmp(c->name, name, len) && !__atomic_load_n(&c->closed, __ATOMIC_SEQ_CST)) {
            c->refs++;
            found = c;
            break;
        }
    }
    pthread_mutex_unlock(&kx_locals_lock);
    return found;
}
