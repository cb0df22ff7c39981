/* The imm counter table (src/counters.c), on a hub alone (no libfabric): banking, expecting,
 * surplus, withdrawing, discarding, the callback queue, and backward-shift deletion under
 * many imms checked against a reference model. */
#include "internal.h"
#include "check.h"

static void arrive(kx_hub *h, uint32_t imm, int times)
{
    pthread_mutex_lock(&h->lock);
    for (int i = 0; i < times; i++)
        CHECK_EQ(kx_hub_arrival_locked(h, imm), 0);
    pthread_mutex_unlock(&h->lock);
}

/* every used slot is reachable from its home slot without crossing an empty one */
static int table_is_consistent(kx_hub *h)
{
    kx_imm_table *t = &h->table;
    size_t used = 0;
    for (size_t i = 0; i < t->cap; i++) {
        if (!t->slots[i].used)
            continue;
        used++;
        if (kx_imm_table_find(t, t->slots[i].imm) != &t->slots[i])
            return 0;
    }
    return used == t->len;
}

static void test_bank_and_expect(void)
{
    kx_hub *h = kx_hub_new();
    kx_counter *c = NULL;
    arrive(h, 5, 3);                                   /* early arrivals are banked */
    CHECK_EQ(kx_hub_banked(h, 5), 3);
    CHECK_EQ(h->table.len, 1);
    CHECK_EQ(kx_hub_expect(h, 5, 2, 0, &c), 0);        /* satisfied at once from the bank */
    CHECK(c->done && c->arrived == 2 && c->error == 0);
    CHECK_EQ(kx_hub_banked(h, 5), 1);                  /* the surplus stays banked */
    kx_hub_counter_drop(h, c);
    CHECK_EQ(kx_hub_expect(h, 5, 2, 0, &c), 0);        /* a finished imm can be expected again */
    CHECK(!c->done && c->arrived == 1);
    CHECK_EQ(kx_hub_banked(h, 5), 0);
    kx_counter *again = NULL;
    CHECK_EQ(kx_hub_expect(h, 5, 1, 0, &again), -FI_EBUSY);   /* one expectation per imm */
    CHECK(again == NULL);
    arrive(h, 5, 1);
    CHECK(c->done && c->arrived == 2);
    CHECK_EQ(h->table.len, 0);                         /* nothing banked, nothing expected: deleted */
    arrive(h, 5, 2);                                   /* after completion: banked for the next */
    CHECK_EQ(kx_hub_banked(h, 5), 2);
    kx_hub_counter_drop(h, c);
    CHECK_EQ(kx_hub_banked(h, 5), 2);                  /* dropping a finished counter changes nothing */
    kx_hub_unref(h);
}

static void test_withdraw(void)
{
    kx_hub *h = kx_hub_new();
    kx_counter *c = NULL;
    CHECK_EQ(kx_hub_expect(h, 9, 5, 0, &c), 0);
    arrive(h, 9, 2);
    CHECK_EQ(c->arrived, 2);
    CHECK_EQ(kx_hub_banked(h, 9), 0);
    kx_hub_counter_drop(h, c);                         /* withdrawn: its arrivals go back to the bank */
    CHECK_EQ(kx_hub_banked(h, 9), 2);
    CHECK_EQ(kx_hub_expect(h, 9, 2, 0, &c), 0);
    CHECK(c->done);
    kx_hub_counter_drop(h, c);
    CHECK_EQ(h->table.len, 0);
    CHECK_EQ(kx_hub_expect(h, 11, 3, 0, &c), 0);       /* withdrawn with nothing credited: deleted */
    kx_hub_counter_drop(h, c);
    CHECK_EQ(h->table.len, 0);
    kx_hub_unref(h);
}

static void test_discard(void)
{
    kx_hub *h = kx_hub_new();
    kx_counter *c = NULL, *withdrawn = (kx_counter *)1;
    CHECK_EQ(kx_hub_discard(h, 77, &withdrawn), 0);    /* unknown imm: nothing to drop */
    CHECK(withdrawn == NULL);
    arrive(h, 10, 4);
    CHECK_EQ(kx_hub_discard(h, 10, &withdrawn), 4);    /* banked arrivals dropped */
    CHECK(withdrawn == NULL);
    CHECK_EQ(kx_hub_banked(h, 10), 0);
    CHECK_EQ(h->table.len, 0);

    CHECK_EQ(kx_hub_expect(h, 12, 5, 1, &c), 0);
    arrive(h, 12, 2);
    CHECK_EQ(kx_hub_discard(h, 12, &withdrawn), 2);    /* credited arrivals count as dropped */
    CHECK(withdrawn == c);
    CHECK(c->done && c->error == EIDRM && c->arrived == 2);
    CHECK(h->done_head == NULL);                       /* no callback for a discarded counter */
    CHECK_EQ(h->table.len, 0);
    arrive(h, 12, 1);                                  /* a later arrival is new: banked */
    CHECK_EQ(kx_hub_banked(h, 12), 1);
    CHECK_EQ(c->arrived, 2);
    kx_hub_counter_drop(h, c);                         /* the owner lets go: freed, bank intact */
    CHECK_EQ(kx_hub_banked(h, 12), 1);
    CHECK_EQ(kx_hub_discard(h, 12, &withdrawn), 1);
    kx_hub_unref(h);
}

static void test_callback_queue(void)
{
    kx_hub *h = kx_hub_new();
    kx_counter *a = NULL, *b = NULL, *c = NULL;
    CHECK_EQ(kx_hub_expect(h, 1, 1, 1, &a), 0);
    CHECK_EQ(kx_hub_expect(h, 2, 1, 0, &b), 0);
    CHECK_EQ(kx_hub_expect(h, 3, 2, 1, &c), 0);
    arrive(h, 3, 1);
    arrive(h, 2, 1);
    arrive(h, 1, 1);
    arrive(h, 3, 1);
    /* finished counters that asked for a callback queue in completion order; b did not ask */
    CHECK(h->done_head == a && a->next_done == c && h->done_tail == c);
    CHECK_EQ(a->refs, 2);                              /* owner + queue */
    pthread_mutex_lock(&h->lock);
    kx_hub_clear_queues_locked(h);                     /* closing releases the queue's references */
    pthread_mutex_unlock(&h->lock);
    CHECK(h->done_head == NULL && h->dispatch_stop);
    CHECK_EQ(a->refs, 1);
    kx_hub_counter_drop(h, a);
    kx_hub_counter_drop(h, b);
    kx_hub_counter_drop(h, c);
    kx_hub_unref(h);
}

static void test_closing_fails_expectations(void)
{
    kx_hub *h = kx_hub_new();
    kx_counter *c = NULL;
    CHECK_EQ(kx_hub_expect(h, 4, 3, 0, &c), 0);
    pthread_mutex_lock(&h->lock);
    kx_hub_fail_counters_locked(h, FI_ECANCELED, 1);
    pthread_mutex_unlock(&h->lock);
    CHECK(c->done && c->error == FI_ECANCELED && c->refs == 1);
    kx_hub_counter_drop(h, c);
    kx_hub_unref(h);
}

/* many imms, random arrivals, expectations, withdrawals and discards, against a model */
#define NIMM 3000
static void test_many_imms(void)
{
    kx_hub *h = kx_hub_new();
    static uint32_t imm[NIMM];
    static uint64_t banked[NIMM];
    static kx_counter *active[NIMM];
    uint64_t state = 0x243F6A8885A308D3ULL;
#define RAND() (state ^= state << 13, state ^= state >> 7, state ^= state << 17, state)
    for (int i = 0; i < NIMM; i++)
        imm[i] = (uint32_t)(RAND() >> 11) & 0x3FFFF;   /* small range: clustered hashes */
    for (int i = 0; i < NIMM; i++)                     /* distinct values */
        for (int j = 0; j < i; j++)
            if (imm[j] == imm[i]) {
                imm[i] = (imm[i] + 1) & 0x3FFFF;
                j = -1;
            }
    size_t max_len = 0;
    for (int step = 0; step < 200000; step++) {
        int i = (int)(RAND() % NIMM);
        unsigned op = (unsigned)(RAND() % 10);
        if (op < 5) {                                  /* an arrival */
            arrive(h, imm[i], 1);
            if (active[i]) {
                if (active[i]->done) {
                    kx_hub_counter_drop(h, active[i]);
                    active[i] = NULL;
                }
            } else {
                banked[i]++;
            }
        } else if (op < 7 && !active[i]) {             /* an expectation */
            uint64_t n = 1 + RAND() % 4;
            kx_counter *c = NULL;
            CHECK_EQ(kx_hub_expect(h, imm[i], n, 0, &c), 0);
            uint64_t take = banked[i] < n ? banked[i] : n;
            banked[i] -= take;
            CHECK_EQ(c->arrived, take);
            if (c->done)
                kx_hub_counter_drop(h, c);
            else
                active[i] = c;
        } else if (op < 8 && active[i]) {              /* a withdrawal */
            banked[i] += active[i]->arrived;
            kx_hub_counter_drop(h, active[i]);
            active[i] = NULL;
        } else if (op < 9) {                           /* a discard */
            kx_counter *w = NULL;
            uint64_t want = banked[i] + (active[i] ? active[i]->arrived : 0);
            CHECK_EQ(kx_hub_discard(h, imm[i], &w), want);
            CHECK(w == active[i]);
            if (w) {
                kx_hub_counter_drop(h, w);
                active[i] = NULL;
            }
            banked[i] = 0;
        }
        if (h->table.len > max_len)
            max_len = h->table.len;
        if (step % 20000 == 0)
            CHECK(table_is_consistent(h));
    }
    size_t live = 0;
    for (int i = 0; i < NIMM; i++) {
        CHECK_EQ(kx_hub_banked(h, imm[i]), banked[i]);
        live += banked[i] > 0 || active[i] != NULL;
    }
    CHECK_EQ(h->table.len, live);                      /* empty entries were all deleted */
    CHECK(table_is_consistent(h));
    CHECK(max_len * 2 <= h->table.cap);                /* the table grew to stay half empty */
    for (int i = 0; i < NIMM; i++) {                   /* drain everything: the table empties */
        kx_counter *w = NULL;
        kx_hub_discard(h, imm[i], &w);
        if (w)
            kx_hub_counter_drop(h, w);
        if (i % 500 == 0)
            CHECK(table_is_consistent(h));
    }
    CHECK_EQ(h->table.len, 0);
    kx_hub_unref(h);
}

int main(void)
{
    test_bank_and_expect();
    test_withdraw();
    test_discard();
    test_callback_queue();
    test_closing_fails_expectations();
    test_many_imms();
    return kx_test_report("counter table");
}
