/* The layer watcher (src/watcher.c) without a rail: entries whose threshold is never reached
 * stay armed; disarm (one, by tag) and free in every order; bump/advance are monotonic; the
 * thread sleeps when nothing is armed; close joins it with entries still armed; the cache of
 * where each threshold's run ends never keeps an entry that left the list; arming refuses
 * what is outside its bounds (kx_watch_bounds) with nothing armed. Under ASan and UBSan, so
 * every path frees exactly once and no freed entry is read. */
#include "internal.h"
#include "check.h"

#include <unistd.h>

static kx_watch *arm(kx_watcher *w, uint64_t threshold, uint64_t tag)
{
    uint64_t so[3] = {0, 4096, 8192}, dof[3] = {0, 4096, 8192}, ln[3] = {4096, 4096, 100};
    kx_watch *e = NULL;
    kx_watch_bounds b = {0, 1 << 20, 1 << 20, 3};
    CHECK_EQ(kx_watch_arm(w, threshold, tag, NULL, 0, 0, NULL, NULL, 0, 0, NULL, so, dof, ln, 3, &b, 1, 7, 4, 1 << 20,
                          65, &e), 0);
    return e;
}

static void test_arm_disarm_free(void)
{
    kx_watcher *w = NULL;
    CHECK_EQ(kx_watcher_open(NULL, 10000, NULL, 0, 0, &w), 0);
    CHECK_EQ(kx_watcher_value(w), 0);
    kx_watch *a = arm(w, 1000, 1), *b = arm(w, 500, 2), *c = arm(w, 1000, 2), *d = arm(w, 2000, 3);
    /* three contiguous pieces of 4096, 4096, 100 bytes, iov 4: one message */
    CHECK_EQ(kx_watch_planned(a), 1);
    kx_watch_state s;
    kx_watch_get_state(w, b, &s);
    CHECK_EQ(s.state, KX_WATCH_ARMED);
    CHECK_EQ(s.threshold, 500);
    CHECK(s.transfer == NULL);
    kx_watcher_stats st;
    kx_watcher_get_stats(w, &st);
    CHECK_EQ(st.armed, 4);
    CHECK_EQ(kx_watcher_bump(w, 3), 3);
    CHECK_EQ(kx_watcher_advance(w, 2), 3);          /* never goes back */
    CHECK_EQ(kx_watcher_advance(w, 10), 10);
    CHECK_EQ(kx_watcher_disarm_tag(w, 2), 2);       /* b and c */
    kx_watch_get_state(w, c, &s);
    CHECK_EQ(s.state, KX_WATCH_DISARMED);
    CHECK_EQ(kx_watch_wait(w, c, 1000), 1);         /* no longer armed */
    CHECK_EQ(kx_watch_wait(w, a, 1000000), 0);      /* still armed: times out */
    CHECK_EQ(kx_watch_disarm(w, a), 1);
    CHECK_EQ(kx_watch_disarm(w, a), 0);             /* once */
    kx_watcher_get_stats(w, &st);
    CHECK_EQ(st.armed, 1);
    CHECK_EQ(st.fired, 0);
    kx_watch_free(w, a);
    kx_watch_free(w, b);
    kx_watch_free(w, c);
    /* d stays armed through close; freed after */
    CHECK_EQ(kx_watcher_close(w, 1000000000LL), 0);
    kx_watch_free(w, d);
    kx_watcher_free(w);
}

static void test_idle_sleeps(void)
{
    kx_watcher *w = NULL;
    uint64_t word = 5;
    CHECK_EQ(kx_watcher_open(&word, 10000, NULL, 0, 0, &w), 0);
    CHECK(kx_watcher_word(w) == &word);
    struct timespec ts = {0, 100000000};
    nanosleep(&ts, NULL);
    kx_watcher_stats st;
    kx_watcher_get_stats(w, &st);
    CHECK(st.wakeups < 5);                          /* blocked, not polling */
    CHECK(st.tid > 0);
    kx_watch *e = arm(w, 1 << 30, 9);               /* armed: it polls */
    nanosleep(&ts, NULL);
    kx_watcher_get_stats(w, &st);
    CHECK(st.wakeups > 5);
    int64_t call[4], post[4];
    CHECK_EQ(kx_watcher_latencies(w, call, post, 4), 0);
    kx_watch_free(w, e);                            /* owners free entries before the watcher */
    kx_watcher_free(w);
}

/* thresholds that share run_end's slot (t % 256), armed in batches, with entries freed,
 * disarmed one by one and by tag between the batches: an arm after each reads the slot,
 * which must never hold an entry already freed (ASan would see the read) */
static void test_run_ends_forget_entries_that_leave(void)
{
    kx_watcher *w = NULL;
    CHECK_EQ(kx_watcher_open(NULL, 0, NULL, 0, 0, &w), 0);
    uint64_t th[4] = {1, 257, 513, 2};
    kx_watch *e[6][4];
    for (int b = 0; b < 6; b++) {
        for (int g = 0; g < 4; g++)
            e[b][g] = arm(w, th[g] + ((uint64_t)1 << 20), (uint64_t)b);
        if (b == 1)
            kx_watch_free(w, e[1][3]);              /* armed, the slot's run end: unlinked and freed */
        if (b == 2)
            CHECK_EQ(kx_watch_disarm(w, e[2][1]), 1);
        if (b == 3)
            CHECK_EQ(kx_watcher_disarm_tag(w, 3), 4);
    }
    kx_watcher_stats st;
    kx_watcher_get_stats(w, &st);
    CHECK_EQ(st.armed, 6 * 4 - 1 - 1 - 4);
    kx_watch *late = arm(w, 2 + ((uint64_t)1 << 20), 9);     /* after e[5][3], read from the slot */
    kx_watch_state s;
    kx_watch_get_state(w, late, &s);
    CHECK_EQ(s.state, KX_WATCH_ARMED);
    CHECK_EQ(kx_watcher_close(w, 1000000000LL), 0);
    for (int b = 0; b < 6; b++)
        for (int g = 0; g < 4; g++)
            if (!(b == 1 && g == 3))
                kx_watch_free(w, e[b][g]);
    kx_watch_free(w, late);
    kx_watcher_free(w);
}

/* kx_watch_disarm_many: the armed ones of a set disarmed in one walk, each answer exact (an
 * entry named twice or already disarmed says 0), the others untouched */
static void test_disarm_many(void)
{
    kx_watcher *w = NULL;
    CHECK_EQ(kx_watcher_open(NULL, 0, NULL, 0, 0, &w), 0);
    kx_watch *e[8];
    for (int i = 0; i < 8; i++)
        e[i] = arm(w, 100 + (uint64_t)(i % 3), 1);
    CHECK_EQ(kx_watch_disarm(w, e[5]), 1);
    kx_watch *set[5] = {e[0], e[2], e[5], e[2], e[7]};
    int gone[5] = {-1, -1, -1, -1, -1};
    CHECK_EQ(kx_watch_disarm_many(w, set, 5, gone), 3);
    CHECK_EQ(gone[0], 1);
    CHECK_EQ(gone[1], 1);
    CHECK_EQ(gone[2], 0);                           /* disarmed before */
    CHECK_EQ(gone[3], 0);                           /* named twice: once */
    CHECK_EQ(gone[4], 1);
    kx_watcher_stats st;
    kx_watcher_get_stats(w, &st);
    CHECK_EQ(st.armed, 4);                          /* 1, 3, 4, 6 */
    kx_watch_state s;
    for (int i = 0; i < 8; i++) {
        kx_watch_get_state(w, e[i], &s);
        CHECK_EQ(s.state, (i == 0 || i == 2 || i == 5 || i == 7) ? KX_WATCH_DISARMED : KX_WATCH_ARMED);
    }
    CHECK_EQ(kx_watch_disarm_many(w, set, 0, gone), 0);
    kx_watch *again = arm(w, 102, 1);               /* after e[4] (e[7], its run's end, left) */
    CHECK_EQ(kx_watcher_disarm_tag(w, 1), 5);
    for (int i = 0; i < 8; i++)
        kx_watch_free(w, e[i]);
    kx_watch_free(w, again);
    kx_watcher_free(w);
}

/* groups at base + thresholds; any triple, start or threshold outside its bounds refuses
 * the whole batch (-ERANGE) and arms nothing */
static void test_bounds(void)
{
    kx_watcher *w = NULL;
    CHECK_EQ(kx_watcher_open(NULL, 0, NULL, 0, 0, &w), 0);
    uint64_t so[4] = {0, 64, 128, 192}, dof[4] = {0, 64, 128, 192}, ln[4] = {64, 64, 64, 64};
    uint64_t th[2] = {1, 2};
    int64_t st[3] = {0, 2, 4};
    kx_watch *out[2] = {NULL, NULL};
    kx_watch_bounds b = {10, 256, 256, 4};
#define ARM(bb, starts) kx_watch_arm_groups(w, 2, th, starts, 1, NULL, 0, 0, NULL, NULL, 0, 0, NULL, so, dof, ln, \
                                            &(bb), 0, 0, 4, 1 << 20, 65, out)
    CHECK_EQ(ARM(b, st), 0);
    kx_watch_state s;
    kx_watch_get_state(w, out[1], &s);
    CHECK_EQ(s.threshold, 12);
    CHECK_EQ(kx_watch_bytes(out[0]), 128);
    for (int g = 0; g < 2; g++) {
        CHECK_EQ(kx_watch_disarm(w, out[g]), 1);
        kx_watch_free(w, out[g]);
    }
    kx_watch_bounds small = {10, 255, 256, 4}, small_dst = {10, 256, 200, 4}, high = {(1ULL << 62) - 2, 256, 256, 4},
                    fewer = {10, 256, 256, 3};
    int64_t down[3] = {0, 3, 2}, late[3] = {1, 2, 4}, short_[3] = {0, 2, 3};
    CHECK_EQ(ARM(small, st), -ERANGE);        /* the last source range ends at 256 */
    CHECK_EQ(ARM(small_dst, st), -ERANGE);
    CHECK_EQ(ARM(high, st), -ERANGE);         /* base + 2 reaches 2**62 */
    CHECK_EQ(ARM(fewer, st), -ERANGE);        /* starts end past the triples */
    CHECK_EQ(ARM(b, down), -ERANGE);
    CHECK_EQ(ARM(b, late), -ERANGE);
    CHECK_EQ(ARM(b, short_), -ERANGE);        /* a triple left out */
    ln[3] = 1ULL << 62;
    CHECK_EQ(ARM(b, st), -ERANGE);
    ln[3] = 64;
#undef ARM
    kx_watcher_stats ws;
    kx_watcher_get_stats(w, &ws);
    CHECK_EQ(ws.armed, 0);
    CHECK_EQ(kx_watcher_close(w, 1000000000LL), 0);
    kx_watcher_free(w);
}

/* an arming wakes the thread only when it must: not for an entry above the counter (without
 * polling the thread sleeps until a bump), but polling, for the first entry of an empty list */
static void test_wakes_only_when_due(void)
{
    kx_watcher *w = NULL;
    kx_watcher_stats st;
    CHECK_EQ(kx_watcher_open(NULL, 0, NULL, 0, 0, &w), 0);
    usleep(20000);
    kx_watcher_get_stats(w, &st);
    uint64_t before = st.wakeups;
    kx_watch *a = arm(w, 1000, 1), *b = arm(w, 2000, 1);
    usleep(20000);
    kx_watcher_get_stats(w, &st);
    CHECK_EQ(st.wakeups, before);               /* nothing due: no wake-up */
    kx_watcher_bump(w, 1);                      /* a bump wakes it (nothing due still) */
    usleep(20000);
    kx_watcher_get_stats(w, &st);
    CHECK(st.wakeups > before);
    kx_watch *all[2] = {a, b};
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(kx_watch_disarm(w, all[i]), 1);
        kx_watch_free(w, all[i]);
    }
    CHECK_EQ(kx_watcher_close(w, 1000000000LL), 0);
    kx_watcher_free(w);

    /* polling every 10 ms: the first arming of an empty list starts the polls */
    CHECK_EQ(kx_watcher_open(NULL, 10000000, NULL, 0, 0, &w), 0);
    usleep(20000);
    kx_watcher_get_stats(w, &st);
    before = st.wakeups;
    a = arm(w, 1000, 1);
    usleep(55000);
    kx_watcher_get_stats(w, &st);
    CHECK(st.wakeups >= before + 3);            /* woken, then polling */
    CHECK_EQ(kx_watch_disarm(w, a), 1);
    kx_watch_free(w, a);
    CHECK_EQ(kx_watcher_close(w, 1000000000LL), 0);
    kx_watcher_free(w);
}

int main(void)
{
    test_bounds();
    test_wakes_only_when_due();
    test_arm_disarm_free();
    test_run_ends_forget_entries_that_leave();
    test_disarm_many();
    test_idle_sleeps();
    return kx_test_report("test_watcher");
}
