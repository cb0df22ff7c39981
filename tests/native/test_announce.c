/* The decoder's native ANNOUNCE arm (src/announce.c), on a hub alone (no libfabric): the
 * check of one message field by field, with and without a key; an arm takes only a message
 * whose writes have all landed, once; closing hands its met counter over once; the engine
 * closing settles open arms. (The format against the messenger's own codec, and the arm on
 * real providers: tests/fabric/test_announce_arm.py.) */
#include <endian.h>

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "internal.h"
#include "check.h"

static const uint8_t KEY[] = "a shared secret of the cluster!";

/* an ANNOUNCE as the messenger encodes it: 40 bytes, and its tag with `key` */
static size_t announce(char *out, uint64_t src, uint64_t dst, uint64_t seq, uint32_t imm, uint64_t count,
                       const uint8_t *key, size_t keylen)
{
    uint64_t v;
    uint32_t w;
    out[0] = 'K';
    out[1] = 'C';
    out[2] = 3;
    out[3] = 4;
    v = htole64(src); memcpy(out + 4, &v, 8);
    v = htole64(dst); memcpy(out + 12, &v, 8);
    v = htole64(seq); memcpy(out + 20, &v, 8);
    w = htole32(imm); memcpy(out + 28, &w, 4);
    v = htole64(count); memcpy(out + 32, &v, 8);
    if (!keylen)
        return 40;
    unsigned int n = 0;
    HMAC(EVP_sha256(), key, (int)keylen, (const unsigned char *)out, 40, (unsigned char *)out + 40, &n);
    CHECK_EQ(n, 32);
    return 72;
}

static void test_the_check(void)
{
    char m[80];
    for (int keyed = 0; keyed < 2; keyed++) {
        const uint8_t *key = keyed ? KEY : NULL;
        size_t kl = keyed ? sizeof(KEY) - 1 : 0;
        size_t n = announce(m, 11, 22, 9, 7, 5, key, kl);
        CHECK_EQ(kx_announce_count(m, n, key, kl, 7, 11, 22, 8, 2, 5), 5);
        CHECK_EQ(kx_announce_count(m, n, key, kl, 7, 11, 22, 9, 2, 5), -1);     /* seq not above the floor */
        CHECK_EQ(kx_announce_count(m, n, key, kl, 8, 11, 22, 8, 2, 5), -1);     /* another imm */
        CHECK_EQ(kx_announce_count(m, n, key, kl, 7, 12, 22, 8, 2, 5), -1);     /* another sender */
        CHECK_EQ(kx_announce_count(m, n, key, kl, 7, 11, 23, 8, 2, 5), -1);     /* another receiver */
        CHECK_EQ(kx_announce_count(m, n, key, kl, 7, 11, 22, 8, 6, 9), -1);     /* below least */
        CHECK_EQ(kx_announce_count(m, n, key, kl, 7, 11, 22, 8, 1, 4), -1);     /* above most */
        CHECK_EQ(kx_announce_count(m, n - 1, key, kl, 7, 11, 22, 8, 2, 5), -1); /* cut short */
        for (size_t i = 0; i < n; i++) {                  /* any byte changed: refused */
            m[i] ^= 0x40;
            int64_t got = kx_announce_count(m, n, key, kl, 7, 11, 22, 8, 0, UINT64_MAX >> 1);
            /* without a tag a higher seq, or another count, still parses */
            CHECK(got == -1 || (!keyed && ((i >= 20 && i < 28 && got == 5) || i >= 32)));
            m[i] ^= 0x40;
        }
    }
    size_t n = announce(m, 11, 22, 9, 7, 5, NULL, 0);
    CHECK_EQ(kx_announce_count(m, n, KEY, sizeof(KEY) - 1, 7, 11, 22, 8, 2, 5), -1);  /* no tag, keyed */
    n = announce(m, 11, 22, 9, 7, 5, (const uint8_t *)"another secret!!", 16);
    CHECK_EQ(kx_announce_count(m, n, KEY, sizeof(KEY) - 1, 7, 11, 22, 8, 2, 5), -1);  /* wrong key */
    m[3] = 6;                                                                             /* an ABORTED */
    CHECK_EQ(kx_announce_count(m, 40, NULL, 0, 7, 11, 22, 8, 2, 5), -1);
}

static void arrive(kx_hub *h, uint32_t imm, int times)
{
    pthread_mutex_lock(&h->lock);
    for (int i = 0; i < times; i++)
        CHECK_EQ(kx_hub_arrival_locked(h, imm), 0);
    pthread_mutex_unlock(&h->lock);
}

static int try_arm(kx_hub *h, const char *m, size_t n)
{
    pthread_mutex_lock(&h->lock);
    int got = kx_arm_try_locked(h, m, n);
    pthread_mutex_unlock(&h->lock);
    return got;
}

static void test_arming(void)
{
    kx_hub *h = kx_hub_new();
    h->open = 1;
    CHECK_EQ(kx_hub_arm_key(h, KEY, sizeof(KEY) - 1), 0);
    kx_arm *a = NULL, *b = NULL;
    CHECK_EQ(kx_hub_arm_open(h, 7, 11, 22, 8, 2, 10, &a), 0);
    CHECK_EQ(kx_hub_arm_open(h, 7, 11, 22, 8, 2, 10, &b), -FI_EBUSY);   /* one open arm per imm */
    CHECK_EQ(kx_hub_arm_open(h, 8, 11, 22, 8, 3, 2, &b), -FI_EINVAL);   /* least > most */
    char m[80];
    size_t n = announce(m, 11, 22, 9, 7, 3, KEY, sizeof(KEY) - 1);
    arrive(h, 7, 2);
    CHECK_EQ(try_arm(h, m, n), 0);                  /* 2 of 3 landed: left to the messenger thread */
    CHECK_EQ(a->state, KX_ARM_OPEN);
    CHECK_EQ(kx_hub_banked(h, 7), 2);               /* nothing consumed */
    arrive(h, 7, 2);                                /* 4 banked: 3 counted, 1 stays */
    __atomic_store_n(&a->waiters, 1, __ATOMIC_SEQ_CST);
    CHECK_EQ(try_arm(h, m, n), 2);                  /* armed, for a waiting caller: quiet */
    __atomic_store_n(&a->waiters, 0, __ATOMIC_SEQ_CST);
    CHECK_EQ(a->state, KX_ARM_ARMED);
    CHECK(a->settled);
    CHECK_EQ(kx_hub_banked(h, 7), 1);
    CHECK_EQ(h->stat_armed, 1);
    CHECK_EQ(h->narms, 0);
    CHECK_EQ(try_arm(h, m, n), 0);                  /* one-shot: a replay arms nothing */
    uint64_t count = 0, seq = 0;
    kx_counter *c = NULL;
    CHECK_EQ(kx_hub_arm_close(h, a, UINT64_MAX, &count, &seq, &c), 1);
    CHECK(c != NULL && c->done && c->count == 3 && count == 3 && seq == 9 && c->done_ns > 0);
    kx_counter *again = NULL;
    CHECK_EQ(kx_hub_arm_close(h, a, UINT64_MAX, &count, &seq, &again), 0);   /* handed over once */
    CHECK(again == NULL);
    kx_hub_counter_drop(h, c);
    kx_hub_arm_free(h, a);

    /* an expectation of the imm already exists (the messenger's fence): not armed */
    CHECK_EQ(kx_hub_arm_open(h, 9, 11, 22, 8, 1, 10, &a), 0);
    arrive(h, 9, 1);
    CHECK_EQ(kx_hub_expect(h, 9, 5, 0, &c), 0);
    n = announce(m, 11, 22, 10, 9, 1, KEY, sizeof(KEY) - 1);
    CHECK_EQ(try_arm(h, m, n), 0);
    CHECK_EQ(a->state, KX_ARM_OPEN);
    kx_hub_counter_drop(h, c);
    CHECK_EQ(kx_hub_arm_close(h, a, UINT64_MAX, &count, &seq, &again), 0);   /* closed open: nothing to hand */
    CHECK_EQ(try_arm(h, m, n), 0);                                /* closed: never arms */
    kx_hub_arm_free(h, a);

    /* the engine closing settles open arms; an armed one not taken is dropped by free */
    CHECK_EQ(kx_hub_arm_open(h, 12, 11, 22, 0, 1, 10, &a), 0);
    CHECK_EQ(kx_hub_arm_open(h, 13, 11, 22, 0, 1, 10, &b), 0);
    arrive(h, 13, 1);
    n = announce(m, 11, 22, 1, 13, 1, KEY, sizeof(KEY) - 1);
    CHECK_EQ(try_arm(h, m, n), 1);
    pthread_mutex_lock(&h->lock);
    kx_arm_clear_locked(h);
    pthread_mutex_unlock(&h->lock);
    CHECK(a->settled && a->state == KX_ARM_CLOSED && h->narms == 0);
    CHECK_EQ(b->state, KX_ARM_ARMED);
    kx_hub_arm_free(h, a);
    kx_hub_arm_free(h, b);                          /* its arming reverted (ASan: no leak) */
    CHECK_EQ(kx_hub_banked(h, 13), 1);              /* the write it had counted is banked again */
    h->open = 0;
    kx_hub_unref(h);
}

/* a caller waits: armed before its writes landed; closing it for an older message reverts it */
static void test_waited_and_reverted(void)
{
    kx_hub *h = kx_hub_new();
    h->open = 1;
    static const uint8_t longkey[100] = {1, 2, 3};  /* longer than SHA-256's block */
    CHECK_EQ(kx_hub_arm_key(h, longkey, sizeof(longkey)), 0);
    CHECK_EQ(h->arm_keylen, sizeof(longkey));
    CHECK_EQ(h->nloud, 0);
    kx_arm *a = NULL;
    CHECK_EQ(kx_hub_arm_open(h, 40, 11, 22, 5, 1, 10, &a), 0);
    char m[80];
    size_t n = announce(m, 11, 22, 7, 40, 3, longkey, sizeof(longkey));
    arrive(h, 40, 1);
    __atomic_store_n(&a->waiters, 1, __ATOMIC_SEQ_CST);
    CHECK_EQ(try_arm(h, m, n), 2);                  /* 1 of 3 landed, but a caller waits */
    __atomic_store_n(&a->waiters, 0, __ATOMIC_SEQ_CST);
    CHECK(a->state == KX_ARM_ARMED && !a->counter->done && a->counter->arrived == 1);
    CHECK_EQ(kx_hub_banked(h, 40), 0);
    arrive(h, 40, 1);                               /* credited to the armed expectation */
    CHECK_EQ(a->counter->arrived, 2);
    uint64_t count = 0, seq = 0;
    kx_counter *c = NULL;
    CHECK_EQ(kx_hub_arm_close(h, a, 6, &count, &seq, &c), 0);    /* handling seq 6: it came later */
    CHECK(c == NULL && a->state == KX_ARM_CLOSED);
    CHECK_EQ(kx_hub_banked(h, 40), 2);              /* withdrawn: both arrivals banked again */
    CHECK_EQ(kx_hub_expect(h, 40, 3, 0, &c), 0);    /* the messenger's own expectation now */
    CHECK(!c->done && c->arrived == 2);
    arrive(h, 40, 1);
    CHECK(c->done);
    kx_hub_counter_drop(h, c);
    kx_hub_arm_free(h, a);

    /* met, then reverted: its arrivals banked again */
    CHECK_EQ(kx_hub_arm_open(h, 41, 11, 22, 5, 1, 10, &a), 0);
    arrive(h, 41, 2);
    n = announce(m, 11, 22, 8, 41, 2, longkey, sizeof(longkey));
    CHECK_EQ(try_arm(h, m, n), 1);
    CHECK_EQ(kx_hub_banked(h, 41), 0);
    CHECK_EQ(kx_hub_arm_close(h, a, 0, &count, &seq, &c), 0);
    CHECK_EQ(kx_hub_banked(h, 41), 2);
    kx_hub_arm_free(h, a);
    n = announce(m, 11, 22, 9, 41, 2, KEY, sizeof(KEY) - 1);     /* another key's tag */
    CHECK_EQ(kx_announce_count(m, n, longkey, sizeof(longkey), 41, 11, 22, 8, 1, 10), -1);
    h->open = 0;
    kx_hub_unref(h);
}

int main(void)
{
    test_the_check();
    test_arming();
    test_waited_and_reverted();
    return kx_test_report("announce arm");
}
