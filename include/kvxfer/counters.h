/* counters.h: immediate-data counters.
 *
 * Rule: every remote CQ entry carrying immediate data `imm` is one arrival for `imm`.
 * Arrivals with no expectation are banked in the table; kx_expect(imm, n) first consumes
 * banked arrivals, and completes as soon as n have been credited. The surplus stays banked
 * for the next expectation of the same imm, so a finished imm can be expected again and
 * nothing that arrives early is lost. One expectation per imm may be active at a time.
 * An entry with no banked arrivals and no expectation is deleted, so the table stays as
 * small as the number of imm values in flight. All functions run under e->hub->lock. */
#ifndef KVXFER_COUNTERS_H
#define KVXFER_COUNTERS_H

#include "kvxfer/core.h"

static inline size_t kx_hash(uint32_t imm)
{
    uint64_t h = (uint64_t)imm * 0x9E3779B97F4A7C15ULL;
    return (size_t)(h >> 32);
}

static int kx_ctable_init(kx_ctable *t)
{
    t->cap = 256;
    t->len = 0;
    t->slots = calloc(t->cap, sizeof(kx_centry));
    return t->slots ? 0 : -FI_ENOMEM;
}

static kx_centry *kx_ctable_find(kx_ctable *t, uint32_t imm)
{
    size_t mask = t->cap - 1, i = kx_hash(imm) & mask;
    while (t->slots[i].used) {
        if (t->slots[i].imm == imm)
            return &t->slots[i];
        i = (i + 1) & mask;
    }
    return NULL;
}

static int kx_ctable_grow(kx_ctable *t)
{
    kx_centry *old = t->slots;
    size_t oldcap = t->cap;
    kx_centry *slots = calloc(oldcap * 2, sizeof(kx_centry));
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

static kx_centry *kx_ctable_get(kx_ctable *t, uint32_t imm)
{
    kx_centry *c = kx_ctable_find(t, imm);
    if (c)
        return c;
    if ((t->len + 1) * 2 > t->cap && kx_ctable_grow(t))
        return NULL;
    size_t mask = t->cap - 1, i = kx_hash(imm) & mask;
    while (t->slots[i].used)
        i = (i + 1) & mask;
    t->slots[i].used = 1;
    t->slots[i].imm = imm;
    t->slots[i].arrived = 0;
    t->slots[i].active = NULL;
    t->len++;
    return &t->slots[i];
}

/* backward-shift deletion keeps linear probing correct without tombstones */
static void kx_ctable_del(kx_ctable *t, kx_centry *c)
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

static void kx_counter_release_locked(kx_counter *c)
{
    if (--c->refs == 0)
        free(c);
}

static void kx_counter_finish_locked(kx_engine *e, kx_counter *c)
{
    c->done = 1;
    c->arrived = c->count;
    if (c->want_callback) {
        c->refs++;  /* the dispatcher queue holds it until popped */
        c->next_done = NULL;
        if (e->hub->done_tail)
            e->hub->done_tail->next_done = c;
        else
            e->hub->done_head = c;
        e->hub->done_tail = c;
    }
    pthread_cond_broadcast(&e->hub->cond);
}

/* an arrival from the CQ */
static void kx_arrival_locked(kx_engine *e, uint32_t imm)
{
    kx_centry *s = kx_ctable_get(&e->hub->table, imm);
    e->hub->stat_imm++;
    if (!s) {            /* out of memory: cannot bank it; count it as an error */
        e->stat_rx_err++;
        return;
    }
    kx_counter *c = s->active;
    if (c) {
        c->arrived++;
        if (c->arrived >= c->count) {
            s->active = NULL;
            kx_counter_finish_locked(e, c);
            kx_counter_release_locked(c);   /* the table's reference */
            if (s->arrived == 0)
                kx_ctable_del(&e->hub->table, s);
        }
    } else {
        s->arrived++;
    }
}

/* returns 0 and the counter, or -FI_EBUSY when imm already has an active expectation */
static int kx_expect(kx_engine *e, uint32_t imm, uint64_t count, int want_callback, kx_counter **out)
{
    kx_counter *c = calloc(1, sizeof(*c));
    if (!c)
        return -FI_ENOMEM;
    c->imm = imm;
    c->count = count;
    c->want_callback = want_callback;
    c->refs = 1;  /* Python owner */
    pthread_mutex_lock(&e->hub->lock);
    kx_centry *s = kx_ctable_get(&e->hub->table, imm);
    if (!s) {
        pthread_mutex_unlock(&e->hub->lock);
        free(c);
        return -FI_ENOMEM;
    }
    if (s->active) {
        pthread_mutex_unlock(&e->hub->lock);
        free(c);
        return -FI_EBUSY;
    }
    uint64_t take = s->arrived < count ? s->arrived : count;
    s->arrived -= take;
    c->arrived = take;
    if (c->arrived >= count) {
        kx_counter_finish_locked(e, c);
        if (s->arrived == 0)
            kx_ctable_del(&e->hub->table, s);
    } else {
        c->refs++;  /* the table entry's reference */
        s->active = c;
    }
    *out = c;
    pthread_mutex_unlock(&e->hub->lock);
    return 0;
}

/* the Python owner drops its counter; an unfinished expectation is withdrawn and the
 * arrivals it had been credited are banked again, so nothing is lost */
static void kx_counter_drop(kx_engine *e, kx_counter *c)
{
    pthread_mutex_lock(&e->hub->lock);
    if (!c->done) {
        kx_centry *s = kx_ctable_find(&e->hub->table, c->imm);
        if (s && s->active == c) {
            s->active = NULL;
            s->arrived += c->arrived;
            kx_counter_release_locked(c);
            if (s->arrived == 0)
                kx_ctable_del(&e->hub->table, s);
        }
    }
    kx_counter_release_locked(c);
    pthread_mutex_unlock(&e->hub->lock);
}

/* Retire `imm`: its unfinished expectation (if any) is withdrawn and ends with error
 * EIDRM (no callback runs; *withdrawn names it so the face can forget it, else NULL),
 * its banked arrivals are dropped, and the entry is deleted. Returns the arrivals dropped:
 * banked ones plus those credited to the withdrawn expectation.
 *
 * Rule (the engine's guarantee): only arrivals read from the CQ before this call are
 * retired. An arrival of `imm` read afterwards is banked as new and credits a later
 * expectation. So a caller retires an imm only once every write that can carry it has
 * arrived (it knows the sender's posted count: discard, and if fewer than that were
 * dropped, expect the rest, wait, and discard again), or never reuses the imm. */
static uint64_t kx_discard(kx_engine *e, uint32_t imm, kx_counter **withdrawn)
{
    uint64_t dropped = 0;
    *withdrawn = NULL;
    pthread_mutex_lock(&e->hub->lock);
    kx_centry *s = kx_ctable_find(&e->hub->table, imm);
    if (s) {
        dropped = s->arrived;
        kx_counter *c = s->active;
        if (c) {
            s->active = NULL;
            dropped += c->arrived;
            c->error = EIDRM;
            c->done = 1;
            *withdrawn = c;
            pthread_cond_broadcast(&e->hub->cond);
            kx_counter_release_locked(c);   /* the table's reference; the owner holds one */
        }
        kx_ctable_del(&e->hub->table, s);
    }
    pthread_mutex_unlock(&e->hub->lock);
    return dropped;
}

static uint64_t kx_banked(kx_engine *e, uint32_t imm)
{
    pthread_mutex_lock(&e->hub->lock);
    kx_centry *s = kx_ctable_find(&e->hub->table, imm);
    uint64_t n = s ? s->arrived : 0;
    pthread_mutex_unlock(&e->hub->lock);
    return n;
}

#endif
