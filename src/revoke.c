/* revoke.c: the revoke exchange, so that no write a target would refuse is ever posted.
 *
 * On libfabric 1.17 neither provider tells a sender about a write the target refused (a
 * closed region) in a way it can act on: shm reports it done, or lands it in deregistered
 * memory, or stalls until peer_timeout; tcp;ofi_rxm drops the connection and fails the
 * honest writes behind it (docs/reliability.md). So a target announces a region's close to
 * its peers before it deregisters, and every sender refuses writes to a revoked key itself:
 *
 *   HELLO  (peer -> target, at connect): the peer's address; the target keeps it for the
 *          engine, which connects back to it when it first closes a region.
 *   REVOKE (target -> each peer that said HELLO, at MemoryRegion.close): a token, the
 *          region's keys and the target's endpoint name. The peer adds the keys to its hub's
 *          revoked set (every later post to one of them fails its transfer with EACCES, before
 *          anything is posted: kx_revoked_check) and answers ...
 *   BYE    (peer -> target, at Engine.close): the peer's address; the target announces
 *          nothing more to it (it would wait for an ACK that never comes).
 *   ACK    (peer -> target): the token, posted once no caller of the peer is inside a posting
 *          burst that checked its key before the revocation, so every write the peer posted
 *          to the region travels ahead of the ACK on the same endpoint and is placed before
 *          the target reads the ACK; then the target deregisters.
 *
 * Control messages are sends whose remote CQ data carries KX_CTL_TAG in its upper half (an
 * imm is 32 bits, so no write's data can look like one); they never reach the user's recv()
 * queue. Keys are kvxfer's random 64-bit keys (FI_MR_PROV_KEY off on both providers), so a
 * key alone names a registration. Everything *_locked runs under the hub's lock. */
#include "internal.h"

typedef struct kx_ctl_ack {
    struct kx_ctl_ack *next;
    fi_addr_t peer;
    uint32_t gen;
    uint64_t token;
} kx_ctl_ack;

uint64_t kx_name_hash(const void *name, size_t len)
{
    const uint8_t *p = (const uint8_t *)name;
    uint64_t h = 1469598103934665603ULL;     /* FNV-1a */
    for (size_t i = 0; i < len; i++) {
        h ^= p[i];
        h *= 1099511628211ULL;
    }
    return h;
}

int kx_ctl_is(uint64_t flags, uint64_t data)
{
    return (flags & FI_RECV) && (flags & FI_REMOTE_CQ_DATA) && (data >> 32) == KX_CTL_TAG;
}

/* ---- the revoked set: open addressing over the keys, 0 = empty ------------------------ */
static size_t kx_slot_of(uint64_t key, size_t cap)
{
    return (size_t)((key * 0x9e3779b97f4a7c15ULL) >> 17) & (cap - 1);
}

static int kx_revoked_has_locked(const kx_hub *h, uint64_t key)
{
    if (!h->revoked_len || !key)
        return 0;
    for (size_t i = kx_slot_of(key, h->revoked_cap);; i = (i + 1) & (h->revoked_cap - 1)) {
        if (h->revoked[i] == key)
            return 1;
        if (h->revoked[i] == 0)
            return 0;
    }
}

static void kx_revoked_put(uint64_t *slots, size_t cap, uint64_t key)
{
    size_t i = kx_slot_of(key, cap);
    while (slots[i] && slots[i] != key)
        i = (i + 1) & (cap - 1);
    slots[i] = key;
}

static int kx_revoked_add_locked(kx_hub *h, uint64_t key)
{
    if (!key || kx_revoked_has_locked(h, key))
        return 0;
    if (2 * (h->revoked_len + 1) > h->revoked_cap) {
        size_t cap = h->revoked_cap ? 2 * h->revoked_cap : 64;
        uint64_t *slots = calloc(cap, sizeof(uint64_t));
        if (!slots)
            return -FI_ENOMEM;
        for (size_t i = 0; i < h->revoked_cap; i++)
            if (h->revoked[i])
                kx_revoked_put(slots, cap, h->revoked[i]);
        free(h->revoked);
        h->revoked = slots;
        h->revoked_cap = cap;
    }
    kx_revoked_put(h->revoked, h->revoked_cap, key);
    h->revoked_len++;
    return 0;
}

int kx_revoked_check(kx_rail *r, kx_transfer *x)
{
    kx_hub *h = r->hub;
    uint64_t epoch = __atomic_load_n(&h->revoke_epoch, __ATOMIC_SEQ_CST);
    if (epoch == x->revoke_epoch)
        return 0;          /* the hot path: nothing was revoked since this transfer last looked */
    pthread_mutex_lock(&h->lock);
    int hit = kx_revoked_has_locked(h, x->key);
    pthread_mutex_unlock(&h->lock);
    x->revoke_epoch = epoch;
    return hit ? FI_EACCES : 0;
}

/* ---- arrivals ------------------------------------------------------------------------- */
static void kx_acks_push_locked(kx_hub *h, uint64_t token)
{
    if (h->acks_len == h->acks_cap) {
        size_t cap = h->acks_cap ? 2 * h->acks_cap : 16;
        uint64_t *a = realloc(h->acks, cap * sizeof(uint64_t));
        if (!a)
            return;        /* the waiter's bound ends its wait */
        h->acks = a;
        h->acks_cap = cap;
    }
    h->acks[h->acks_len++] = token;
    pthread_cond_broadcast(&h->cond);
}

/* the live peer of r whose endpoint name hashes to `hash`: where an ACK goes */
static int kx_peer_by_name_locked(kx_rail *r, uint64_t hash, fi_addr_t *fa, uint32_t *gen)
{
    for (size_t c = 0; r->pdir && c * KX_PEER_CHUNK < r->peer_hi; c++) {
        kx_peer *chunk = r->pdir[c];
        if (!chunk)
            continue;
        for (size_t i = 0; i < KX_PEER_CHUNK && c * KX_PEER_CHUNK + i < r->peer_hi; i++) {
            kx_peer *p = &chunk[i];
            if (p->used && !p->dead && p->name_hash == hash) {
                *fa = (fi_addr_t)(c * KX_PEER_CHUNK + i);
                *gen = p->gen;
                return 1;
            }
        }
    }
    return 0;
}

void kx_ctl_arrival_locked(kx_rail *r, uint32_t type, const char *data, size_t len)
{
    kx_hub *h = r->hub;
    if (type == KX_CTL_HELLO || type == KX_CTL_BYE) {
        kx_msg *m = malloc(sizeof(kx_msg) + len + 1);
        if (!m)
            return;
        m->next = NULL;
        m->len = len + 1;
        m->data[0] = (char)type;
        memcpy(m->data + 1, data, len);
        if (h->hello_tail)
            h->hello_tail->next = m;
        else
            h->hello_head = m;
        h->hello_tail = m;
    } else if (type == KX_CTL_REVOKE) {
        uint64_t token;
        uint32_t nkeys, namelen;
        if (len < 16)
            return;
        memcpy(&token, data, 8);
        memcpy(&nkeys, data + 8, 4);
        memcpy(&namelen, data + 12, 4);
        if ((uint64_t)nkeys * 8 + namelen + 16 != len)
            return;           /* malformed: nothing revoked, no ACK (the target's wait is bounded) */
        for (uint32_t k = 0; k < nkeys; k++) {
            uint64_t key;
            memcpy(&key, data + 16 + 8 * (size_t)k, 8);
            if (kx_revoked_add_locked(h, key))
                return;       /* out of memory: no ACK, rather than one that lies */
        }
        __atomic_add_fetch(&h->revoke_epoch, 1, __ATOMIC_SEQ_CST);
        fi_addr_t fa;
        uint32_t gen;
        if (!kx_peer_by_name_locked(r, kx_name_hash(data + 16 + 8 * (size_t)nkeys, namelen), &fa, &gen))
            return;           /* we never connected to it, so we never wrote to it */
        kx_ctl_ack *a = malloc(sizeof(*a));
        if (!a)
            return;
        a->peer = fa;
        a->gen = gen;
        a->token = token;
        a->next = r->ack_head;
        r->ack_head = a;
    } else if (type == KX_CTL_ACK && len == 8) {
        uint64_t token;
        memcpy(&token, data, 8);
        kx_acks_push_locked(h, token & ~(KX_CTL_SENT | KX_CTL_FAILED));
    }
}

void kx_ctl_sent_locked(kx_rail *r, kx_sendbuf *s, int err)
{
    kx_acks_push_locked(r->hub, s->token | KX_CTL_SENT | (err ? KX_CTL_FAILED : 0));
}

int kx_ctl_post_acks(kx_rail *r)
{
    if (!__atomic_load_n(&r->ack_head, __ATOMIC_ACQUIRE))
        return 0;
    /* a caller inside a posting burst may have checked its key before the revocation: its
     * write must go out ahead of the ACK (the burst ends within microseconds) */
    if (__atomic_load_n(&r->posting, __ATOMIC_SEQ_CST) > 0)
        return 1;
    pthread_mutex_lock(&r->hub->lock);
    kx_ctl_ack *a = r->ack_head;
    r->ack_head = NULL;
    pthread_mutex_unlock(&r->hub->lock);
    int left = 0;
    while (a) {
        kx_ctl_ack *next = a->next;
        int ret = kx_send_op(r, a->peer, a->gen, (const char *)&a->token, 8, (KX_CTL_TAG << 32) | KX_CTL_ACK, 0, 0);
        if (ret == -FI_EAGAIN && !r->stop) {
            pthread_mutex_lock(&r->hub->lock);
            a->next = r->ack_head;
            r->ack_head = a;
            pthread_mutex_unlock(&r->hub->lock);
            left++;
        } else {
            free(a);          /* posted, or the peer is gone: its target stops waiting for it */
        }
        a = next;
    }
    return left;
}

/* ---- the engine's face ------------------------------------------------------------------ */
int kx_ctl_send(kx_rail *r, fi_addr_t peer, uint32_t gen, int type, uint64_t token, const char *data, size_t len)
{
    if (type != KX_CTL_HELLO && type != KX_CTL_REVOKE && type != KX_CTL_BYE)
        return -FI_EINVAL;
    if (!token || (token & (KX_CTL_SENT | KX_CTL_FAILED)))
        return -FI_EINVAL;
    return kx_send_op(r, peer, gen, data, len, (KX_CTL_TAG << 32) | (uint64_t)type, token, 50000000LL);
}

int kx_ctl_take(kx_rail *r, int64_t slice_ns, uint64_t *tokens, size_t max, size_t *n)
{
    kx_hub *h = r->hub;
    struct timespec ts;
    kx_deadline(&ts, slice_ns);
    pthread_mutex_lock(&h->lock);
    while (!h->acks_len && !r->stop && slice_ns > 0) {
        if (pthread_cond_timedwait(&h->cond, &h->lock, &ts) == ETIMEDOUT)
            break;
    }
    size_t k = h->acks_len < max ? h->acks_len : max;
    memcpy(tokens, h->acks + (h->acks_len - k), k * sizeof(uint64_t));
    h->acks_len -= k;
    pthread_mutex_unlock(&h->lock);
    *n = k;
    return 0;
}

int kx_ctl_hello(kx_rail *r, kx_msg **out)
{
    kx_hub *h = r->hub;
    pthread_mutex_lock(&h->lock);
    kx_msg *m = h->hello_head;
    if (m) {
        h->hello_head = m->next;
        if (!h->hello_head)
            h->hello_tail = NULL;
    }
    pthread_mutex_unlock(&h->lock);
    *out = m;
    return m != NULL;
}

uint64_t kx_revoked_count(kx_rail *r)
{
    pthread_mutex_lock(&r->hub->lock);
    uint64_t n = r->hub->revoked_len;
    pthread_mutex_unlock(&r->hub->lock);
    return n;
}

void kx_ctl_free_locked(kx_hub *h)
{
    free(h->revoked);
    h->revoked = NULL;
    h->revoked_cap = h->revoked_len = 0;
    while (h->hello_head) {
        kx_msg *m = h->hello_head;
        h->hello_head = m->next;
        free(m);
    }
    h->hello_tail = NULL;
    free(h->acks);
    h->acks = NULL;
    h->acks_len = h->acks_cap = 0;
}

void kx_ctl_rail_free(kx_rail *r)
{
    while (r->ack_head) {
        kx_ctl_ack *a = r->ack_head;
        r->ack_head = a->next;
        free(a);
    }
}
