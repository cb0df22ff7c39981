/* local.c: same-process engines: one kx_local cell per open engine endpoint of this process,
 * in a process-wide list keyed by endpoint name. A rail posting to a local peer brackets the
 * post with the cell's `busy` count after checking `closed`; the owner's teardown sets
 * `closed` and waits for `busy` to drain before it closes its endpoint, so a post never
 * reaches a closed endpoint. The cells also carry shm's deferral rule (below): an endpoint's
 * region outlives the progress of every engine of this process that may read it. */

#include <sys/mman.h>

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
        if (c->cmdq_map)
            munmap(c->cmdq_map, 4096);
        if (c->peer_map)
            munmap(c->peer_map, c->peer_map_len);
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
 * that drops `mapped_by` to 0 closes its fids (kx_rail_finish_deferred). Under the lock.
 * A closing rail that drained cleanly asks each holder to drop it (kx_local_defer, want = 1):
 * the holder's progress removes it from its own address vector once it has read its command
 * queue past every command the closed one wrote (forget.c), then drops its holds. */
static int kx_hold_locked(kx_local *holder, kx_local *c)
{
    if (holder->nheld == holder->capheld) {
        int cap = holder->capheld ? 2 * holder->capheld : 4;
        kx_hold *h = realloc(holder->held, (size_t)cap * sizeof(*h));
        if (!h)
            return -FI_ENOMEM;
        holder->held = h;
        holder->capheld = cap;
    }
    holder->held[holder->nheld++] = (kx_hold){.c = c};
    c->refs++;
    c->mapped_by++;
    return 0;
}

/* remove holder->held[i] (the caller drops the hold itself: kx_unhold_locked) */
static kx_local *kx_hold_take_locked(kx_local *holder, int i)
{
    kx_local *c = holder->held[i].c;
    if (holder->held[i].want)
        __atomic_sub_fetch(&holder->forgets, 1, __ATOMIC_SEQ_CST);
    holder->held[i] = holder->held[--holder->nheld];
    return c;
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
        if (xc->held[i].c == y) {
            finish = kx_unhold_locked(kx_hold_take_locked(xc, i));
            break;
        }
    }
    pthread_mutex_unlock(&kx_locals_lock);
    if (finish)
        kx_rail_finish_deferred(finish);
}

/* every hold x has of y (forget.c, once x's provider no longer maps y) */
void kx_local_unlink_all(kx_rail *x, kx_local *y)
{
    kx_local *xc = x->self_local;
    kx_rail *finish = NULL;
    if (!xc)
        return;
    pthread_mutex_lock(&kx_locals_lock);
    for (int i = xc->nheld - 1; i >= 0; i--) {
        if (xc->held[i].c == y) {
            kx_rail *f = kx_unhold_locked(kx_hold_take_locked(xc, i));
            if (f)
                finish = f;
        }
    }
    pthread_mutex_unlock(&kx_locals_lock);
    if (finish)
        kx_rail_finish_deferred(finish);
}

/* The holds of r due to be forgotten: closed cells whose rail asked (want 1) and whose last
 * command r's progress has read (its queue's read count past the mark). Each is marked 2 and
 * returned with a reference (the caller drops it: kx_local_unref); at most `max`. */
int kx_local_forget_due(kx_rail *r, kx_local **out, int max)
{
    kx_local *self = r->self_local;
    int n = 0;
    if (!self || !self->cmdq)
        return 0;
    uint64_t read = __atomic_load_n(&self->cmdq[0], __ATOMIC_ACQUIRE);
    pthread_mutex_lock(&kx_locals_lock);
    for (int i = 0; i < self->nheld && n < max; i++) {
        kx_hold *h = &self->held[i];
        int dup = 0;
        for (int k = 0; k < n; k++)
            dup |= out[k] == h->c;
        if (h->want != 1 || dup || (int64_t)(read - h->mark) < 0)
            continue;
        h->want = 2;
        h->c->refs++;
        out[n++] = h->c;
    }
    pthread_mutex_unlock(&kx_locals_lock);
    return n;
}

/* forget.c could not drop c now (a post under way, the AV busy): try again on a later pass */
void kx_local_forget_later(kx_rail *r, kx_local *c)
{
    kx_local *self = r->self_local;
    if (!self)
        return;
    pthread_mutex_lock(&kx_locals_lock);
    for (int i = 0; i < self->nheld; i++)
        if (self->held[i].c == c && self->held[i].want == 2)
            self->held[i].want = 1;
    pthread_mutex_unlock(&kx_locals_lock);
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
            finish = kx_unhold_locked(kx_hold_take_locked(c, c->nheld - 1));
        pthread_mutex_unlock(&kx_locals_lock);
        if (!finish)
            return;
        kx_rail_finish_deferred(finish);
    }
}

/* a closing shm rail (quiesced: it posts nothing more): 0 if no other engine's progress may
 * read its region (close it now); else it is deferred, and 2 if every holder was asked to
 * forget it (each one that can read its own command queue, forget.c: the rail had nothing
 * outstanding, so nothing of it is pending there but what that queue still holds), 1 if not */
int kx_local_defer(kx_rail *r)
{
    kx_local *c = r->self_local;
    if (!r->shm || !c)
        return 0;
    int clean = __atomic_load_n(&r->outstanding, __ATOMIC_SEQ_CST) == 0 &&
                !__atomic_load_n(&r->wrote_off, __ATOMIC_ACQUIRE);
    pthread_mutex_lock(&kx_locals_lock);
    int d = c->mapped_by > 0;
    if (d) {
        r->deferred = 1;
        c->deferred = r;
        int asked = 0, all = 1;
        for (kx_local *h = kx_locals; h; h = h->next) {
            for (int i = 0; i < h->nheld; i++) {
                if (h->held[i].c != c)
                    continue;
                if (!clean || !h->cmdq) {
                    all = 0;
                    continue;
                }
                if (h->held[i].want == 0) {
                    h->held[i].mark = __atomic_load_n(&h->cmdq[1], __ATOMIC_ACQUIRE);
                    h->held[i].want = 1;
                    __atomic_add_fetch(&h->forgets, 1, __ATOMIC_SEQ_CST);
                }
                asked++;
            }
        }
        /* holds without an entry (kx_local_link out of memory) are kept for good */
        if (all && asked == c->mapped_by)
            d = 2;
    }
    pthread_mutex_unlock(&kx_locals_lock);
    return d;
}

/* the owner of a rail deferred with d == 2: wait (bounded) until its holders have dropped it
 * and its fids are closed; 1 if so, 0 if it is still deferred at the deadline (the last holder
 * then finishes it later, as before) */
int kx_local_deferred_wait(kx_rail *r, int64_t wait_ns)
{
    int64_t until = kx_now_ns() + wait_ns;
    for (int step = 0;; step++) {
        pthread_mutex_lock(&kx_locals_lock);
        int d = r->deferred;
        pthread_mutex_unlock(&kx_locals_lock);
        if (!d)
            return 1;
        if (kx_now_ns() >= until)
            return 0;
        kx_pause(step, 200000);
    }
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
    kx_forget_map_cmdq(c, r->info->fabric_attr->prov_name);
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
