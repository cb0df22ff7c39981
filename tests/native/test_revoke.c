/* The revoke exchange's receiving side (src/revoke.c), on a hub and a bare rail (no
 * libfabric): REVOKE payloads, well-formed and hostile, the revoked set against a reference
 * model as it grows, and the per-transfer epoch check a post makes. */
#include "internal.h"
#include "check.h"

static size_t revoke_payload(char *buf, uint64_t token, const uint64_t *keys, uint32_t nkeys, const char *name)
{
    uint32_t namelen = (uint32_t)strlen(name);
    memcpy(buf, &token, 8);
    memcpy(buf + 8, &nkeys, 4);
    memcpy(buf + 12, &namelen, 4);
    memcpy(buf + 16, keys, 8 * (size_t)nkeys);
    memcpy(buf + 16 + 8 * (size_t)nkeys, name, namelen);
    return 16 + 8 * (size_t)nkeys + namelen;
}

static void arrive(kx_rail *r, const char *data, size_t len)
{
    pthread_mutex_lock(&r->hub->lock);
    kx_ctl_arrival_locked(r, KX_CTL_REVOKE, data, len);
    pthread_mutex_unlock(&r->hub->lock);
}

/* whether a transfer to `key` would be refused now (a fresh transfer: epoch 0) */
static int refused(kx_rail *r, uint64_t key)
{
    kx_transfer x;
    memset(&x, 0, sizeof(x));
    x.key = key;
    return kx_revoked_check(r, &x) == FI_EACCES;
}

static void test_payloads(kx_rail *r)
{
    char buf[4096];
    uint64_t keys[3] = {0x1111, 0x2222, 0};
    size_t len = revoke_payload(buf, 7, keys, 3, "target");
    CHECK(!refused(r, 0x1111));
    arrive(r, buf, len);
    CHECK(refused(r, 0x1111) && refused(r, 0x2222));
    CHECK(!refused(r, 0x3333));
    CHECK(!refused(r, 0));                       /* key 0 is never a revoked key */
    CHECK_EQ(r->hub->revoked_len, 2);
    CHECK(r->ack_head == NULL);                  /* no peer of that name: no ACK */
    /* hostile lengths: nothing revoked, nothing read out of bounds */
    uint64_t k4 = 0x4444;
    len = revoke_payload(buf, 8, &k4, 1, "t");
    arrive(r, buf, len - 1);                     /* short by one */
    arrive(r, buf, 15);                          /* shorter than the header */
    uint32_t huge = 0x20000000;                  /* nkeys * 8 wraps 32 bits */
    memcpy(buf + 8, &huge, 4);
    arrive(r, buf, len);
    CHECK(!refused(r, 0x4444));
    CHECK_EQ(r->hub->revoked_len, 2);
    /* an epoch already seen is not looked up again: the hot path */
    kx_transfer x;
    memset(&x, 0, sizeof(x));
    x.key = 0x5555;
    CHECK_EQ(kx_revoked_check(r, &x), 0);
    CHECK_EQ(x.revoke_epoch, r->hub->revoke_epoch);
    uint64_t k5 = 0x5555;
    len = revoke_payload(buf, 9, &k5, 1, "target");
    arrive(r, buf, len);                         /* revoked after the transfer looked */
    CHECK_EQ(kx_revoked_check(r, &x), FI_EACCES);
}

static void test_growth(kx_rail *r)
{
    /* thousands of keys in batches, against a reference: the set rehashes as it grows */
    static uint64_t ref[5000];
    char *buf = malloc(16 + 8 * 100 + 8);
    uint64_t s = 88172645463325252ULL;
    size_t n = 0;
    for (int batch = 0; batch < 50; batch++) {
        uint64_t keys[100];
        for (int i = 0; i < 100; i++) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            keys[i] = s | 1;
            ref[n++] = keys[i];
        }
        arrive(r, buf, revoke_payload(buf, 100 + batch, keys, 100, "target"));
    }
    int missing = 0, extra = 0;
    for (size_t i = 0; i < n; i++)
        missing += !refused(r, ref[i]);
    for (int i = 0; i < 1000; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        extra += refused(r, s & ~1ULL);          /* even keys were never revoked */
    }
    CHECK_EQ(missing, 0);
    CHECK_EQ(extra, 0);
    CHECK(r->hub->revoked_len >= n);
    CHECK(2 * r->hub->revoked_len <= r->hub->revoked_cap);
    free(buf);
}

int main(void)
{
    kx_rail *r = calloc(1, sizeof(*r));
    r->hub = kx_hub_new();
    test_payloads(r);
    test_growth(r);
    kx_ctl_rail_free(r);
    kx_hub_unref(r->hub);
    free(r);
    return kx_test_report("revoke");
}
