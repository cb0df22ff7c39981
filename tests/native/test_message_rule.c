/* The message rule (src/post.c): coalesce, pack, alone, against hand-computed cases. Each
 * case lists the triples, the engine parameters and the messages expected, piece by piece. */
#include "internal.h"
#include "check.h"

typedef struct { uint64_t src, dst, len; } piece;

/* walk the triples and compare every message with `want` (messages separated by a piece
 * of length 0); returns the number of messages */
static int64_t walk_and_compare(const uint64_t (*t)[3], size_t n, size_t iov, uint64_t max_write,
                                uint64_t pack_min, const piece *want, size_t nwant)
{
    uint64_t so[64], dof[64], ln[64];
    for (size_t i = 0; i < n; i++) {
        so[i] = t[i][0];
        dof[i] = t[i][1];
        ln[i] = t[i][2];
    }
    kx_transfer w;
    memset(&w, 0, sizeof(w));
    kx_walk_init(&w, so, dof, ln, n, iov, max_write, pack_min);
    size_t k = 0;
    int64_t msgs = 0;
    while (kx_walk_next(&w)) {
        for (int p = 0; p < w.npieces; p++, k++) {
            CHECK(k < nwant);
            if (k >= nwant)
                return -1;
            CHECK_EQ(w.piece_src[p], want[k].src);
            CHECK_EQ(w.piece_dst[p], want[k].dst);
            CHECK_EQ(w.piece_len[p], want[k].len);
        }
        CHECK(k < nwant && want[k].len == 0);   /* the message ends where the case says */
        k++;
        msgs++;
    }
    CHECK_EQ(k, nwant);
    CHECK_EQ(kx_count_messages(so, dof, ln, n, iov, max_write, pack_min), msgs);
    return msgs;
}

#define END {0, 0, 0}
#define CASE(triples, iov, mw, pm, ...)                                                     \
    do {                                                                                    \
        const piece want[] = {__VA_ARGS__};                                                 \
        walk_and_compare(triples, sizeof(triples) / sizeof(triples[0]), iov, mw, pm, want, \
                         sizeof(want) / sizeof(want[0]));                                   \
    } while (0)

int main(void)
{
    const uint64_t G = 1ULL << 30;

    /* nothing to write: no message */
    CHECK_EQ(kx_count_messages(NULL, NULL, NULL, 0, 4, G, 0), 0);

    /* coalesce: contiguous on both sides -> one segment, one piece */
    const uint64_t contiguous[][3] = {{0, 0, 100}, {100, 100, 100}, {200, 200, 100}};
    CASE(contiguous, 4, G, 0, {0, 0, 300}, END);

    /* contiguous at the source only: two segments, packed into one message */
    const uint64_t src_only[][3] = {{0, 0, 100}, {100, 500, 100}};
    CASE(src_only, 4, G, 0, {0, 0, 100}, {100, 500, 100}, END);

    /* pack: five separate segments, two pieces per message -> 3 messages */
    const uint64_t five[][3] = {{0, 0, 100}, {200, 200, 100}, {400, 400, 100}, {600, 600, 100}, {800, 800, 100}};
    CASE(five, 2, G, 0, {0, 0, 100}, {200, 200, 100}, END, {400, 400, 100}, {600, 600, 100}, END,
         {800, 800, 100}, END);

    /* pack: one 1000-byte segment, max_write 250 -> split at message boundaries */
    const uint64_t big[][3] = {{0, 4096, 1000}};
    CASE(big, 4, 250, 0, {0, 4096, 250}, END, {250, 4346, 250}, END, {500, 4596, 250}, END,
         {750, 4846, 250}, END);

    /* pack: a segment that does not fit is split where the message is full */
    const uint64_t three[][3] = {{0, 0, 100}, {1000, 1000, 100}, {2000, 2000, 100}};
    CASE(three, 4, 250, 0, {0, 0, 100}, {1000, 1000, 100}, {2000, 2000, 50}, END, {2050, 2050, 50}, END);

    /* alone: pieces shorter than pack_min travel one per message */
    const uint64_t small[][3] = {{0, 0, 64}, {100, 100, 100}, {300, 300, 100}, {500, 500, 64}, {600, 600, 100}};
    CASE(small, 4, G, 65, {0, 0, 64}, END, {100, 100, 100}, {300, 300, 100}, END, {500, 500, 64}, END,
         {600, 600, 100}, END);

    /* exactly pack_min bytes is not "shorter": such pieces pack */
    const uint64_t boundary[][3] = {{0, 0, 65}, {100, 100, 65}, {200, 200, 64}};
    CASE(boundary, 4, G, 65, {0, 0, 65}, {100, 100, 65}, END, {200, 200, 64}, END);

    /* alone applies to the coalesced segment, not to each triple */
    const uint64_t small_runs[][3] = {{0, 0, 40}, {40, 40, 40}, {1000, 1000, 40}};
    CASE(small_runs, 4, G, 65, {0, 0, 80}, END, {1000, 1000, 40}, END);

    /* the rest of a split segment may be short: it then goes alone */
    const uint64_t tail[][3] = {{0, 0, 260}, {1000, 1000, 100}};
    CASE(tail, 4, 250, 65, {0, 0, 250}, END, {250, 250, 10}, END, {1000, 1000, 100}, END);

    /* zero-length triples: skipped, and they do not break coalescing */
    const uint64_t zeros[][3] = {{0, 0, 0}, {10, 10, 5}, {15, 15, 0}, {15, 15, 5}};
    CASE(zeros, 4, G, 0, {10, 10, 10}, END);
    const uint64_t zero_len[2] = {0, 0}, zero_off[2] = {0, 7};
    CHECK_EQ(kx_count_messages(zero_off, zero_off, zero_len, 2, 4, G, 0), 0);

    /* parameters are clamped: iov 0 -> 1, iov 100 -> KX_MAX_IOV, max_write 0 -> 1 byte */
    const uint64_t two[][3] = {{0, 0, 10}, {100, 100, 10}};
    CASE(two, 0, G, 0, {0, 0, 10}, END, {100, 100, 10}, END);
    uint64_t so[40], dof[40], ln[40];
    for (int i = 0; i < 40; i++) {
        so[i] = dof[i] = (uint64_t)i * 100;
        ln[i] = 10;
    }
    CHECK_EQ(kx_count_messages(so, dof, ln, 40, 100, G, 0), 3);   /* 16 + 16 + 8 */
    const uint64_t three_bytes[][3] = {{0, 0, 3}};
    CASE(three_bytes, 4, 0, 0, {0, 0, 1}, END, {1, 1, 1}, END, {2, 2, 1}, END);

    return kx_test_report("message rule");
}
