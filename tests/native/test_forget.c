/* test_forget.c: forget.c under ASan/UBSan with real shm rails. One long-lived rail L; 300
 * short rails S in turn (more than shm's 256 map slots), each connected to L one way or both,
 * a message each way that was connected, then freed: S's region file is gone once its free
 * returns (L's progress dropped it from its map), L's own file stays, and the next S, which
 * shm puts in the freed slot, gets L's messages (the slot was reset). */

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "internal.h"

static int exists(const char *name, size_t len)
{
    char path[300];
    struct stat st;
    return kx_shm_path(name, len, "", path, sizeof(path)) == 0 && stat(path, &st) == 0;
}

static kx_rail *open_rail(void)
{
    kx_rail *r = NULL;
    char call[64];
    if (kx_rail_open("shm", NULL, NULL, 0, 0, NULL, &r, call, sizeof(call)) != 0)
        return NULL;
    if (kx_rail_start(r, NULL, 0) != 0) {
        kx_rail_free(r);
        return NULL;
    }
    return r;
}

/* one message from a to b (b inserted in a's AV as fa, gen), received by b */
static int message(kx_rail *a, fi_addr_t fa, uint32_t gen, kx_rail *b, int i)
{
    char out[32], ok = 0;
    snprintf(out, sizeof(out), "cycle %d", i);
    int ret;
    for (int t = 0; (ret = kx_send(a, fa, gen, out, strlen(out) + 1)) == -FI_EAGAIN && t < 100; t++)
        ;
    if (ret)
        return 0;
    for (int t = 0; t < 100 && !ok; t++) {
        kx_msg *m = NULL;
        if (kx_recv_wait(b, 50000000LL, &m) == 1) {
            ok = kx_msg_len(m) == strlen(out) + 1 && !memcmp(kx_msg_data(m), out, kx_msg_len(m));
            kx_msg_free(m);
        }
    }
    return ok;
}

int main(void)
{
    kx_rail *l = open_rail();
    if (!l) {
        printf("test_forget: no shm provider, skipped\n");
        return 0;
    }
    char lname[256], sname[256];
    size_t llen = sizeof(lname);
    CHECK_EQ(kx_getname(l, lname, &llen), 0);
    int gone = 0, delivered = 0, cycles = 300;
    for (int i = 0; i < cycles; i++) {
        kx_rail *s = open_rail();
        CHECK(s != NULL);
        if (!s)
            break;
        size_t slen = sizeof(sname);
        CHECK_EQ(kx_getname(s, sname, &slen), 0);
        fi_addr_t to_l = 0, to_s = 0;
        uint32_t gl = 0, gs = 0;
        int ok = 1;
        if (i % 3 != 1) {          /* S -> L (0, 2) */
            CHECK_EQ(kx_av_insert(s, lname, llen, &to_l, &gl), 0);
            ok &= message(s, to_l, gl, l, i);
        }
        if (i % 3 != 0) {          /* L -> S (1, 2): L's first command goes to the reused slot */
            CHECK_EQ(kx_av_insert(l, sname, slen, &to_s, &gs), 0);
            ok &= message(l, to_s, gs, s, i);
        }
        delivered += ok;
        kx_rail_drain(s, 500000000LL, 20000000LL);
        kx_rail_free(s);
        gone += !exists(sname, slen);
    }
    CHECK_EQ(delivered, cycles);
    CHECK_EQ(gone, cycles);
    CHECK(exists(lname, llen));
    kx_rail_drain(l, 500000000LL, 20000000LL);
    kx_rail_free(l);
    CHECK(!exists(lname, llen));
    return kx_test_report("test_forget");
}
