/* announce.c: the decoder's ANNOUNCE armed natively: the thread that reads a control message
 * checks whether it is the ANNOUNCE a registered leg waits for and arms the leg's
 * expectation itself, so a caller waiting on the leg wakes from the engine (at the last
 * write's arrival) without the messenger thread (issue 28 item 2).
 *
 * The messenger registers an arm per leg before its REQUEST goes (kx_arm_open: the leg's
 * imm, the peer's uid, its own uid, the seq floor, the count bounds). An arm takes a
 * message only if every field agrees with the messenger's own checks of an ANNOUNCE
 * (kvxfer/messenger/_codec.py, control message version 3, type 4):
 *
 *     b"KC" | u8 3 | u8 4 | u64 src | u64 dst | u64 seq | u32 imm | u64 count | [32-byte tag]
 *
 * little-endian, exactly 40 bytes (72 with the tag); src and dst the arm's; seq above its
 * floor (the messenger's last accepted seq of that peer when it opened the arm: every older
 * ANNOUNCE of the imm is at or below it, so a replay is refused); least <= count <= most;
 * with a key (kx_arm_key: the messenger's secret) the tag is HMAC-SHA256 over the 40 bytes
 * before it. Then only if the imm's banked arrivals cover the count (the expectation is met at
 * once, stamped now), or a caller waits on the arm (kx_arm_wait goes on to wait for the
 * counter, and whoever takes the arm with kx_arm_close completes it or asks for its callback,
 * kx_counter_set_callback): so no armed expectation is left that nobody completes. Anything
 * else leaves the arm open and the message to the messenger thread, which handles it as
 * before. The message is queued either way, in order: the messenger
 * thread still accepts its seq; it adopts the armed count (kx_arm_close) if no caller did.
 * A message armed for a caller in kx_arm_wait is queued quiet: it wakes no reader (the
 * reader takes it with the next loud one, or when its slice ends).
 *
 * An arm is one-shot: armed, it leaves the hub's buckets. kx_arm_close ends it (the
 * messenger closes it before any other transition of its leg: abort, fence, failure), and
 * hands over the counter once, or reverts it (an arming by an ANNOUNCE newer than the message
 * the messenger is handling, or a dead peer's: its arrivals banked again). The engine closing
 * settles every open arm. */
#include "internal.h"

#include <endian.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#define KX_ANN_BYTES 40
#define KX_TAG_BYTES 32
#define KX_ARM_LOOK_NS 10000000LL      /* kx_arm_wait looks at its arm's state this often */

static uint64_t kx_le64(const char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return le64toh(v);
}

static uint32_t kx_le32(const char *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return le32toh(v);
}

int64_t kx_announce_count(const char *data, size_t len, const uint8_t *key, size_t keylen, uint32_t imm,
                          uint64_t src, uint64_t dst, uint64_t floor, uint64_t least, uint64_t most)
{
    if (len != KX_ANN_BYTES + (keylen ? KX_TAG_BYTES : 0))
        return -1;
    if (data[0] != 'K' || data[1] != 'C' || (uint8_t)data[2] != 3 || (uint8_t)data[3] != 4)
        return -1;
    if (kx_le64(data + 4) != src || kx_le64(data + 12) != dst || kx_le64(data + 20) <= floor)
        return -1;
    if (kx_le32(data + 28) != imm)
        return -1;
    uint64_t count = kx_le64(data + 32);
    if (count < least || count > most || count > (uint64_t)INT64_MAX)
        return -1;
    if (keylen) {
        unsigned char tag[EVP_MAX_MD_SIZE];
        unsigned int n = 0;
        if (!HMAC(EVP_sha256(), key, (int)keylen, (const unsigned char *)data, KX_ANN_BYTES, tag, &n)
            || n != KX_TAG_BYTES || CRYPTO_memcmp(tag, data + KX_ANN_BYTES, KX_TAG_BYTES) != 0)
            return -1;
    }
    return (int64_t)count;
}

static size_t kx_arm_bucket(uint32_t imm) { return (size_t)(((uint64_t)imm * 0x9E3779B97F4A7C15ULL) >> 58); }

static void kx_arm_unlink_locked(kx_hub *h, kx_arm *a)
{
    for (kx_arm **p = &h->arms[kx_arm_bucket(a->imm)]; *p; p = &(*p)->next) {
        if (*p == a) {
            *p = a->next;
            a->next = NULL;
            h->narms--;
            return;
        }
    }
}

static kx_arm *kx_arm_find_locked(kx_hub *h, uint32_t imm)
{
    kx_arm *a = h->arms[kx_arm_bucket(imm)];
    while (a && a->imm != imm)
        a = a->next;
    return a;
}

int kx_arm_try_locked(kx_hub *h, const char *data, size_t len)
{
    if (!h->narms || len < 32 || data[3] != 4)
        return 0;
    uint32_t imm = kx_le32(data + 28);
    kx_arm *a = kx_arm_find_locked(h, imm);
    if (!a)
        return 0;
    int64_t count = kx_announce_count(data, len, h->arm_key, h->arm_keylen, imm, a->src, a->dst, a->floor,
                                      a->least, a->most);
    int waited = __atomic_load_n(&a->waiters, __ATOMIC_ACQUIRE) > 0;
    if (count < 0 || (!waited && kx_hub_banked_locked(h, imm) < (uint64_t)count))
        return 0;                      /* the messenger thread's: it checks (and counts) again */
    kx_counter *c = calloc(1, sizeof(*c));
    if (!c)
        return 0;
    c->imm = imm;
    c->count = (uint64_t)count;
    c->refs = 1;                       /* the arm's, handed over by kx_arm_close */
    if (kx_hub_expect_locked(h, c)) {  /* an expectation of the imm exists: not ours to arm */
        free(c);
        return 0;
    }
    kx_arm_unlink_locked(h, a);
    a->state = KX_ARM_ARMED;
    a->count = (uint64_t)count;
    a->seq = kx_le64(data + 20);
    a->counter = c;
    __atomic_store_n(&a->settled, 1, __ATOMIC_RELEASE);
    h->stat_armed++;
    /* met now: wake its waiter; not yet: its last arrival's broadcast does (kx_arm_wait looks
     * on to the counter), so the waiter does not wake twice and take a core from the
     * progress thread meanwhile */
    if (c->done)
        pthread_cond_broadcast(&h->cond);
    return waited ? 2 : 1;
}

void kx_arm_clear_locked(kx_hub *h)
{
    for (size_t i = 0; i < sizeof(h->arms) / sizeof(h->arms[0]); i++) {
        while (h->arms[i]) {
            kx_arm *a = h->arms[i];
            h->arms[i] = a->next;
            a->next = NULL;
            a->state = KX_ARM_CLOSED;
            __atomic_store_n(&a->settled, 1, __ATOMIC_RELEASE);
        }
    }
    h->narms = 0;
    pthread_cond_broadcast(&h->cond);
}

/* ---- the hub's arms (the public face, per rail, below) ---------------------------------- */

int kx_hub_arm_key(kx_hub *h, const uint8_t *key, size_t len)
{
    if (len > KX_ARM_KEY_MAX)
        return -FI_EINVAL;
    pthread_mutex_lock(&h->lock);
    if (len)
        memcpy(h->arm_key, key, len);
    h->arm_keylen = len;
    pthread_mutex_unlock(&h->lock);
    return 0;
}

int kx_hub_arm_open(kx_hub *h, uint32_t imm, uint64_t src, uint64_t dst, uint64_t floor, uint64_t least,
                    uint64_t most, kx_arm **out)
{
    if (least > most)
        return -FI_EINVAL;
    kx_arm *a = calloc(1, sizeof(*a));
    if (!a)
        return -FI_ENOMEM;
    a->imm = imm;
    a->src = src;
    a->dst = dst;
    a->floor = floor;
    a->least = least;
    a->most = most;
    pthread_mutex_lock(&h->lock);
    int ret = h->open == 0 ? -FI_ECANCELED : kx_arm_find_locked(h, imm) ? -FI_EBUSY : 0;
    if (!ret) {
        size_t k = kx_arm_bucket(imm);
        a->next = h->arms[k];
        h->arms[k] = a;
        h->narms++;
    }
    pthread_mutex_unlock(&h->lock);
    if (ret) {
        free(a);
        return ret;
    }
    *out = a;
    return 0;
}

int kx_arm_wait(kx_rail *r, kx_arm *a, int64_t slice_ns)
{
    int64_t t0 = kx_now_ns();
    __atomic_add_fetch(&a->waiters, 1, __ATOMIC_SEQ_CST);
    int got = kx_wait_flag(r, &a->settled, slice_ns);
    if (got) {
        /* armed: on to its counter's last arrival (held meanwhile), in short waits so that a
         * close of the arm (a transition of the leg, which then owns the counter) is seen */
        kx_hub *h = r->hub;
        pthread_mutex_lock(&h->lock);
        kx_counter *c = a->state == KX_ARM_ARMED ? a->counter : NULL;
        if (c)
            c->refs++;
        pthread_mutex_unlock(&h->lock);
        if (c) {
            for (;;) {
                got = __atomic_load_n(&c->done, __ATOMIC_ACQUIRE) || kx_arm_state(a) != KX_ARM_ARMED;
                int64_t left = slice_ns - (kx_now_ns() - t0);
                if (got || left <= 0)
                    break;
                kx_wait_flag(r, &c->done, left < KX_ARM_LOOK_NS ? left : KX_ARM_LOOK_NS);
            }
            kx_counter_release(r, c);
        }
    }
    __atomic_sub_fetch(&a->waiters, 1, __ATOMIC_SEQ_CST);
    return got;
}

/* Close the arm; hand over what an ANNOUNCE of seq <= max_seq armed, and revert a later one
 * (the messenger is still handling an earlier message: it reads that ANNOUNCE itself later):
 * its expectation withdrawn and every arrival it was credited banked again, as if never armed. */
int kx_hub_arm_close(kx_hub *h, kx_arm *a, uint64_t max_seq, uint64_t *count, uint64_t *seq, kx_counter **counter)
{
    pthread_mutex_lock(&h->lock);
    kx_counter *c = a->state == KX_ARM_ARMED ? a->counter : NULL;
    if (a->state == KX_ARM_OPEN)
        kx_arm_unlink_locked(h, a);
    a->counter = NULL;
    int taken = c && a->seq <= max_seq;
    if (taken) {
        *count = a->count;
        *seq = a->seq;
        *counter = c;                  /* the caller's reference now */
    } else if (c) {
        kx_hub_counter_drop_locked(h, c, 1);   /* pending or met: its arrivals banked again */
    }
    a->state = KX_ARM_CLOSED;
    __atomic_store_n(&a->settled, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&h->cond);
    pthread_mutex_unlock(&h->lock);
    return taken;
}

void kx_hub_arm_free(kx_hub *h, kx_arm *a)
{
    uint64_t count, seq;
    kx_counter *c = NULL;
    kx_hub_arm_close(h, a, 0, &count, &seq, &c);   /* reverts what it armed: nothing is taken */
    free(a);
}

int kx_arm_key(kx_rail *r, const uint8_t *key, size_t len) { return kx_hub_arm_key(r->hub, key, len); }

int kx_arm_open(kx_rail *r, uint32_t imm, uint64_t src, uint64_t dst, uint64_t floor, uint64_t least,
                uint64_t most, kx_arm **out)
{
    return kx_hub_arm_open(r->hub, imm, src, dst, floor, least, most, out);
}

int kx_arm_close(kx_rail *r, kx_arm *a, uint64_t max_seq, uint64_t *count, uint64_t *seq, kx_counter **counter)
{
    return kx_hub_arm_close(r->hub, a, max_seq, count, seq, counter);
}

void kx_arm_free(kx_rail *r, kx_arm *a) { kx_hub_arm_free(r->hub, a); }

int kx_arm_state(const kx_arm *a) { return __atomic_load_n(&a->state, __ATOMIC_ACQUIRE); }

int kx_arm_waiters(const kx_arm *a) { return __atomic_load_n(&a->waiters, __ATOMIC_ACQUIRE); }

void kx_arm_hold(kx_arm *a, int delta) { __atomic_add_fetch(&a->waiters, delta, __ATOMIC_SEQ_CST); }
