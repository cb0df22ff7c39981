/* counters.c: the hub (what the rails of one engine share) and its imm counter table.
 *
 * Rule: every remote CQ entry carrying immediate data `imm` is one arrival for `imm`.
 * Arrivals with no expectation are banked in the table; kx_expect(imm, n) first consumes
 * banked arrivals and completes as soon as n have been credited. The surplus stays banked
 * for the next expectation of the same imm, so a finished imm can be expected again and
 * nothing that arrives early is lost. One expectation per imm may be active at a time.
 * An entry with no banked arrivals and no expectation is deleted, so the table stays as
 * small as the number of imm values in flight. */
#include "internal.h"

static size_t kx_hash(uint32_t imm)
{
    uint64_t h = (uint64_t)imm * 0x9E3779B97F4A7C15ULL;
    return (size_t)(h >> 32);
}

kx_hub *kx_hub_new(void)
{
    kx_hub *h = calloc(1, sizeof(*h));
    if (!h)
        return NULL;
    h->table.cap = 256;
    h->table.slots = calloc(h->table.cap, sizeof(kx_imm_entry));
    if (!h->table.slots) {
        free(h);
        return NULL;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&h->cond, &ca);
    pthread_cond_init(&h->msg_cond, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&h->lock, NULL);
    h->refs = 1;
    return h;
}

void kx_hub_unref(kx_hub *h)
{
    pthread_mutex_lock(&h->lock);
    int last = --h->refs == 0;
    pthread_mutex_unlock(&h->lock);
    if (!last)
        return;
    kx_ctl_free_locked(h);
    pthread_mutex_destroy(&h->lock);
    pthread_cond_destroy(&h->cond);
    pthread_cond_destroy(&h->msg_cond);
    free(h->table.slots);
    free(h);
}

int kx_hub_wait_flag(kx_hub *h, const int *flag, int64_t slice_ns)
{
    struct timespec ts;
    kx_deadline(&ts, slice_ns);
    pthread_mutex_lock(&h->lock);
    while (!*flag) {
        if (pthread_cond_timedwait(&h->cond, &h->lock, &ts) == ETIMEDOUT)
            break;
    }
    int d = *flag;
    pthread_mutex_unlock(&h->lock);
    return d;
}

/* ---- the table ----------------------------------------------------------------------- */

kx_imm_entry *kx_imm_table_find(kx_imm_table *t, uint32_t imm)
{
    size_t mask = t->cap - 1, i = kx_hash(imm) & mask;
    while (t->slots[i].used) {
        if (t->slots[i].imm == imm)
            return &t->slots[i];
        i = (i + 1) & mask;
    }
    return NULL;
}

static int kx_imm_table_grow(kx_imm_table *t)
{
    kx_imm_entry *old = t->slots;
    size_t oldcap = t->cap;
    kx_imm_entry *slots = calloc(oldcap * 2, sizeof(kx_imm_entry));
    if (!slots)
        return -FI_ENOMEM;
    t->slots = slots;
    t->cap = oldcap * 2;
    for (size_t j = 0; j < oldcap; j++) {
        if (!old[j].used)
            continue;
        size_t mask = t->cap - 1, i = kx_hash(old[j].imm) & mask;
        while (t->slots[i].used)
            i = (i + 1) & mask;
        t->slots[i] = old[j];
    }
    free(old);
    return 0;
}

kx_imm_entry *kx_imm_table_get(kx_imm_table *t, uint32_t imm)
{
    kx_imm_entry *c = kx_imm_table_find(t, imm);
    if (c)
        return c;
    if ((t->len + 1) * 2 > t->cap && kx_imm_table_grow(t))
        return NULL;
    size_t mask = t->cap - 1, i = kx_hash(imm) & mask;
    while (t->slots[i].used)
        i = (i + 1) & mask;
    t->slots[i].used = 1;
    t->slots[i].imm = imm;
    t->slots[i].banked = 0;
    t->slots[i].active = NULL;
    t->len++;
    return &t->slots[i];
}

/* backward-shift deletion keeps linear probing correct without tombstones */
void kx_imm_table_del(kx_imm_table *t, kx_imm_entry *c)
{
    size_t mask = t->cap - 1, i = (size_t)(c - t->slots), j = i;
    t->slots[i].used = 0;
    t->len--;
    for (;;) {
        j = (j + 1) & mask;
        if (!t->slots[j].used)
            return;
        size_t k = kx_hash(t->slots[j].imm) & mask;
        /* move slot j back to i unless its home k lies cyclically in (i, j] */
        if ((i <= j) ? (i < k && k <= j) : (i < k || k <= j))
            continue;
        t->slots[i] = t->slots[j];
        t->slots[j].used = 0;
        i = j;
    }
}

/* ---- expectations ------------------------------------------------------------------- */

void kx_counter_release_locked(kx_counter *c)
{
    if (--c->refs == 0)
        free(c);
}

static void kx_counter_finish_locked(kx_hub *h, kx_counter *c)
{
    __atomic_store_n(&c->done_ns, kx_now_ns(), __ATOMIC_RELAXED);
    __atomic_store_n(&c->done, 1, __ATOMIC_RELEASE);   /* done_ns is read after done */
    c->arrived = c->count;
    if (c->want_callback) {
        c->refs++;  /* the dispatcher queue holds it until popped */
        c->next_done = NULL;
        if (h->done_tail)
            h->done_tail->next_done = c;
        else
            h->done_head = c;
        h->done_tail = c;
    }
    pthread_cond_broadcast(&h->cond);
}

int kx_hub_arrival_locked(kx_hub *h, uint32_t imm)
{
    kx_imm_entry *s = kx_imm_table_get(&h->table, imm);
    h->stat_imm++;
    if (!s) {
        h->stat_lost++;
        return -FI_ENOMEM;
    }
    kx_counter *c = s->active;
    if (!c) {
        s->banked++;
        return 0;
    }
    c->arrived++;
    if (c->arrived >= c->count) {
        s->active = NULL;
        kx_counter_finish_locked(h, c);
        kx_counter_release_locked(c);   /* the table's reference */
        if (s->banked == 0)
            kx_imm_table_del(&h->table, s);
    }
    return 0;
}

/* Under the lock: `c` (imm, count, want_callback set; refs 1, the owner's) becomes imm's
 * expectation, credited from the banked arrivals first. -FI_EBUSY when imm already has one,
 * -FI_ENOMEM when the table cannot grow; c is then not referenced by the hub. */
int kx_hub_expect_locked(kx_hub *h, kx_counter *c)
{
    kx_imm_entry *s = kx_imm_table_get(&h->table, c->imm);
    if (!s)
        return -FI_ENOMEM;
    if (s->active)
        return -FI_EBUSY;
    uint64_t take = s->banked < c->count ? s->banked : c->count;
    s->banked -= take;
    c->arrived = take;
    if (c->arrived >= c->count) {
        kx_counter_finish_locked(h, c);
        if (s->banked == 0)
            kx_imm_table_del(&h->table, s);
    } else {
        c->refs++;  /* the table entry's reference */
        s->active = c;
    }
    return 0;
}

int kx_hub_expect(kx_hub *h, uint32_t imm, uint64_t count, int want_callback, kx_counter **out)
{
    kx_counter *c = calloc(1, sizeof(*c));
    if (!c)
        return -FI_ENOMEM;
    c->imm = imm;
    c->count = count;
    c->want_callback = want_callback;
    c->refs = 1;  /* the owner */
    pthread_mutex_lock(&h->lock);
    int ret = kx_hub_expect_locked(h, c);
    pthread_mutex_unlock(&h->lock);
    if (ret) {
        free(c);
        return ret;
    }
    *out = c;
    return 0;
}

/* Under the lock: the owner drops its counter; an unfinished expectation is withdrawn and the
 * arrivals it had been credited are banked again, so nothing is lost. With `rebank`, a met
 * one's arrivals are banked again too (an arm's arming undone, announce.c). */
void kx_hub_counter_drop_locked(kx_hub *h, kx_counter *c, int rebank)
{
    if (!c->done) {
        kx_imm_entry *s = kx_imm_table_find(&h->table, c->imm);
        if (s && s->active == c) {
            s->active = NULL;
            s->banked += c->arrived;
            kx_counter_release_locked(c);
            if (s->banked == 0)
                kx_imm_table_del(&h->table, s);
        }
    } else if (rebank && !c->error) {
        kx_imm_entry *s = kx_imm_table_get(&h->table, c->imm);
        if (s)
            s->banked += c->count;
        else
            h->stat_lost += c->count;
    }
    kx_counter_release_locked(c);
}

void kx_hub_counter_drop(kx_hub *h, kx_counter *c)
{
    pthread_mutex_lock(&h->lock);
    kx_hub_counter_drop_locked(h, c, 0);
    pthread_mutex_unlock(&h->lock);
}

uint64_t kx_hub_banked_locked(kx_hub *h, uint32_t imm)
{
    kx_imm_entry *s = kx_imm_table_find(&h->table, imm);
    return s ? s->banked : 0;
}

uint64_t kx_hub_banked(kx_hub *h, uint32_t imm)
{
    pthread_mutex_lock(&h->lock);
    uint64_t n = kx_hub_banked_locked(h, imm);
    pthread_mutex_unlock(&h->lock);
    return n;
}

/* Retire `imm`: its unfinished expectation (if any) is withdrawn and ends with error EIDRM
 * (no callback runs; *withdrawn names it so the owner can forget it, else NULL), its
 * banked arrivals are dropped, and the entry is deleted. Returns the arrivals dropped:
 * banked ones plus those credited to the withdrawn expectation.
 *
 * Rule (the engine's guarantee): only arrivals read from the CQ before this call are
 * retired. An arrival of `imm` read afterwards is banked as new and credits a later
 * expectation. So a caller retires an imm only once every write that can carry it has
 * arrived (it knows the sender's final posted count P: discard, and if d < P were dropped,
 * expect the remaining P - d, wait, and discard again), or never reuses the imm. */
uint64_t kx_hub_discard(kx_hub *h, uint32_t imm, kx_counter **withdrawn)
{
    uint64_t dropped = 0;
    *withdrawn = NULL;
    pthread_mutex_lock(&h->lock);
    kx_imm_entry *s = kx_imm_table_find(&h->table, imm);
    if (s) {
        dropped = s->banked;
        kx_counter *c = s->active;
        if (c) {
            s->active = NULL;
            dropped += c->arrived;
            c->error = EIDRM;
            c->done = 1;
            *withdrawn = c;
            pthread_cond_broadcast(&h->cond);
            kx_counter_release_locked(c);   /* the table's reference; the owner holds one */
        }
        kx_imm_table_del(&h->table, s);
    }
    pthread_mutex_unlock(&h->lock);
    return dropped;
}

/* closing: every unfinished expectation ends with `err`; `release`: the table lets go of
 * them (the hub is being cleared), else they stay referenced (a leaked thread may still
 * credit them) */
void kx_hub_fail_counters_locked(kx_hub *h, int err, int release)
{
    for (size_t i = 0; i < h->table.cap; i++) {
        kx_imm_entry *s = &h->table.slots[i];
        if (!s->used || !s->active)
            continue;
        kx_counter *c = s->active;
        c->error = err;
        c->done = 1;
        if (release) {
            s->active = NULL;
            kx_counter_release_locked(c);
        }
    }
    pthread_cond_broadcast(&h->cond);
}

/* closing: drop queued control messages and the dispatcher's queue, stop the dispatcher */
void kx_hub_clear_queues_locked(kx_hub *h)
{
    while (h->msg_head) {
        kx_msg *m = h->msg_head;
        h->msg_head = m->next;
        free(m);
    }
    h->msg_tail = NULL;
    h->nmsgs = 0;
    h->nloud = 0;
    while (h->done_head) {
        kx_counter *c = h->done_head;
        h->done_head = c->next_done;
        kx_counter_release_locked(c);
    }
    h->done_tail = NULL;
    h->dispatch_stop = 1;
    pthread_cond_broadcast(&h->cond);
    pthread_cond_broadcast(&h->msg_cond);
}

/* ---- the public face, per rail ------------------------------------------------------- */

int kx_expect(kx_rail *r, uint32_t imm, uint64_t count, int want_callback, kx_counter **out)
{
    return kx_hub_expect(r->hub, imm, count, want_callback, out);
}

void kx_counter_get_state(const kx_counter *c, kx_counter_state *out)
{
    out->imm = c->imm;
    out->count = c->count;
    out->done = __atomic_load_n(&c->done, __ATOMIC_ACQUIRE);
    out->arrived = __atomic_load_n(&c->arrived, __ATOMIC_RELAXED);
    out->error = __atomic_load_n(&c->error, __ATOMIC_RELAXED);
    /* met by its arrivals only: after the engine closed first (FI_ECANCELED), a leaked
     * progress thread may still credit, and stamp, a counter that already ended */
    out->done_ns = out->done && !out->error ? __atomic_load_n(&c->done_ns, __ATOMIC_RELAXED) : 0;
}

int kx_counter_set_callback(kx_rail *r, kx_counter *c)
{
    pthread_mutex_lock(&r->hub->lock);
    int done = c->done;
    if (!done)
        c->want_callback = 1;      /* kx_counter_finish_locked queues it for the dispatcher */
    pthread_mutex_unlock(&r->hub->lock);
    return done;
}

int kx_counter_wait(kx_rail *r, kx_counter *c, int64_t slice_ns)
{
    return kx_wait_flag(r, &c->done, slice_ns);
}

void kx_counter_drop(kx_rail *r, kx_counter *c)
{
    kx_hub_counter_drop(r->hub, c);
}

void kx_counter_release(kx_rail *r, kx_counter *c)
{
    pthread_mutex_lock(&r->hub->lock);
    kx_counter_release_locked(c);
    pthread_mutex_unlock(&r->hub->lock);
}

uint64_t kx_banked(kx_rail *r, uint32_t imm)
{
    return kx_hub_banked(r->hub, imm);
}

uint64_t kx_discard(kx_rail *r, uint32_t imm, kx_counter **withdrawn)
{
    return kx_hub_discard(r->hub, imm, withdrawn);
}

int kx_next_done(kx_rail *r, int64_t slice_ns, kx_counter **out)
{
    kx_hub *h = r->hub;
    struct timespec ts;
    kx_deadline(&ts, slice_ns);
    pthread_mutex_lock(&h->lock);
    while (!h->done_head && !h->dispatch_stop) {
        if (pthread_cond_timedwait(&h->cond, &h->lock, &ts) == ETIMEDOUT)
            break;
    }
    kx_counter *c = h->done_head;
    int ret = 0;
    if (c) {
        h->done_head = c->next_done;
        if (!h->done_head)
            h->done_tail = NULL;
        ret = 1;
    } else if (h->dispatch_stop) {
        ret = -1;
    }
    pthread_mutex_unlock(&h->lock);
    *out = c;
    return ret;
}

void kx_dispatch_stop(kx_rail *r)
{
    pthread_mutex_lock(&r->hub->lock);
    r->hub->dispatch_stop = 1;
    pthread_cond_broadcast(&r->hub->cond);
    pthread_mutex_unlock(&r->hub->lock);
}
