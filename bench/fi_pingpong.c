/* fi_pingpong.c: the floor kvxfer is measured against. Plain libfabric, one thread per
 * process (per rail with -R), no kvxfer layer: what the provider itself costs on this machine.
 *
 *   fi_pingpong [-p PROV] [-n ITERS] [-w WARMUP] [-s BYTES] [-j] [-y|-b] [-D] [-C I:T]   round trips
 *   fi_pingpong -m pages [-p PROV] [-P PAGE] [-N PAGES] [-I IOV] [-R RAILS] [-n ITERS] [-y|-b] [-D] [-C I:T]
 *   fi_pingpong -m cma [-P PAGE] [-N PAGES] [-I IOV] [-n ITERS]                  paged CMA copies
 *   fi_pingpong -m sock [-P PAGE] [-N PAGES] [-I IOV] [-R RAILS] [-n ITERS]      the same bytes by TCP
 *
 * The process forks; parent (initiator) and child (target) each open fabric, domain, CQ,
 * AV and an RDM endpoint on PROV (tcp: bound to 127.0.0.1; shm: its own name), register one
 * buffer and swap (address, base, key) over a socketpair. Nothing else crosses the socket.
 *
 * Round trips: the initiator fi_writedata()s BYTES with immediate data i, the target reads
 * its CQ until that immediate arrives and writes the same bytes back with i; the initiator's
 * CQ delivering i ends round trip i. Both busy-poll fi_cq_read (the fastest the provider can
 * go; libfabric's fabtests poll the same way). -j: fi_inject_writedata where BYTES fits the
 * provider's inject_size. -D: FI_DELIVERY_COMPLETE on every write (round trips) or on each
 * iteration's last message (pages), the completion kvxfer asks of tcp;ofi_rxm by default, so
 * the floor pays the same target acknowledgements.
 *
 * Paged writes: PAGES pages of PAGE bytes go to a random permutation of as many destination
 * pages, IOV pages per fi_writemsg (capped at the provider's iov limits), every message
 * carrying the immediate; the target counts the messages' CQ entries and answers with one
 * 8-byte write; that answer ends the iteration. Same timing definition as kvxfer-bench bw's
 * "acked" column. The target checks nothing (this is a probe of the provider, not of data).
 * -R RAILS: as many endpoints per process (kvxfer's rails), each with its own CQ, connection
 * and thread, rail k taking pages [N*k/R, N*(k+1)/R) as kvxfer stripes them; an iteration
 * ends when every rail's answer is in.
 *
 * Waiting: by default both sides poll purely; -y: sched_yield() after an empty CQ read; -b:
 * sleep in poll() on the CQ's wait fd (tcp) after fi_trywait, as kvxfer's idle progress
 * threads do. -C I:T pins the initiator process to the CPUs of list I and the target process
 * to those of T (comma-separated, e.g. -C 0:1; kvxfer-bench --pin passes its two halves).
 *
 * CMA (-m cma, no libfabric at all): the same scattered pages copied by the initiator with
 * process_vm_writev() straight into the target's buffer, IOV destination pages per call (up
 * to IOV_MAX = 1024; the source pages are one contiguous local iovec). What a shm path
 * without libfabric's per-message command round trip and 4-iovec cap could reach: the
 * target spends no CPU. Time = the copies (a notification would add one small message).
 *
 * TCP (-m sock, no libfabric at all): the same number of bytes, contiguous, over RAILS plain
 * loopback TCP connections (TCP_NODELAY, as libfabric sets) with one blocking thread per
 * connection on each side, in send()
 * calls of IOV pages (by default, or with -I 0, the whole share in one call). What the kernel carries from process to
 * process by TCP here: the ceiling of any TCP provider, whatever it does with the pages.
 *
 * Output: one JSON object on stdout (microseconds for round trips, GB/s for pages). */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <poll.h>
#include <sched.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#define CHECK(call)                                                                        \
    do {                                                                                   \
        int _r = (int)(call);                                                              \
        if (_r) {                                                                          \
            fprintf(stderr, "fi_pingpong: %s: %s (%d)\n", #call, fi_strerror(-_r), _r);   \
            exit(2);                                                                       \
        }                                                                                  \
    } while (0)

typedef struct ep_s {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_cq *cq;
    int cq_fd;                /* -b: the CQ's wait fd, -1 where none */
    struct fid_av *av;
    struct fid_ep *ep;
    struct fid_mr *mr;
    void *desc;
    char *buf;
    size_t len;
    fi_addr_t peer;
    uint64_t rbase, rkey;     /* the peer's buffer */
    size_t iov_limit, inject_size;
    struct fi_context2 ctx[65536];
    unsigned ctxi;
    uint64_t ring[128];       /* arrivals read but not yet consumed */
    uint64_t ring_head, ring_tail;
} ep_t;

/* -y: sched_yield() after an empty CQ read (on a machine with more runnable threads than
 * cores, two pure spinners can starve each other's peer) */
static int yield_when_idle;
/* -b: after an empty CQ read, sleep in poll() on the CQ's wait fd (after fi_trywait) where
 * the provider has one (tcp): a thread that waits for its socket sleeps in the kernel, as
 * kvxfer's progress threads do when idle */
static int block_when_idle;

static uint64_t dc_flag;       /* -D: FI_DELIVERY_COMPLETE, as kvxfer's writes on tcp;ofi_rxm */

typedef struct {
    char name[256];
    size_t namelen;
    uint64_t base, key;
} card_t;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *next_ctx(ep_t *e)
{
    return &e->ctx[e->ctxi++ % 65536];
}

static void open_ep(ep_t *e, const char *prov, size_t len)
{
    struct fi_info *hints = fi_allocinfo();
    hints->caps = FI_MSG | FI_RMA;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->fabric_attr->prov_name = strdup(prov);
    const char *node = strcmp(prov, "shm") == 0 ? NULL : "127.0.0.1";
    CHECK(fi_getinfo(FI_VERSION(1, 9), node, NULL, node ? FI_SOURCE : 0, hints, &e->info));
    fi_freeinfo(hints);
    struct fi_info *fi = e->info;
    size_t a = fi->tx_attr->iov_limit, b = fi->tx_attr->rma_iov_limit;
    e->iov_limit = a < b ? a : b;
    e->inject_size = fi->tx_attr->inject_size;
    CHECK(fi_fabric(fi->fabric_attr, &e->fabric, NULL));
    CHECK(fi_domain(e->fabric, fi, &e->domain, NULL));
    struct fi_cq_attr cqa = {.format = FI_CQ_FORMAT_DATA, .size = fi->tx_attr->size + fi->rx_attr->size,
                             .wait_obj = block_when_idle ? FI_WAIT_FD : FI_WAIT_NONE};
    e->cq_fd = -1;
    if (fi_cq_open(e->domain, &cqa, &e->cq, NULL)) {   /* no fd wait object (shm): poll, yielding */
        cqa.wait_obj = FI_WAIT_NONE;
        CHECK(fi_cq_open(e->domain, &cqa, &e->cq, NULL));
    } else if (block_when_idle && fi_control(&e->cq->fid, FI_GETWAIT, &e->cq_fd)) {
        e->cq_fd = -1;
    }
    struct fi_av_attr ava = {.type = FI_AV_TABLE};
    CHECK(fi_av_open(e->domain, &ava, &e->av, NULL));
    CHECK(fi_endpoint(e->domain, fi, &e->ep, NULL));
    CHECK(fi_ep_bind(e->ep, &e->cq->fid, FI_TRANSMIT | FI_RECV));
    CHECK(fi_ep_bind(e->ep, &e->av->fid, 0));
    CHECK(fi_enable(e->ep));
    e->len = len;
    e->buf = aligned_alloc(4096, (len + 4095) / 4096 * 4096);
    memset(e->buf, 0, len);
    CHECK(fi_mr_reg(e->domain, e->buf, len, FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE, 0,
                    0x5eed, 0, &e->mr, NULL));
    if (fi->domain_attr->mr_mode & FI_MR_ENDPOINT) {
        CHECK(fi_mr_bind(e->mr, &e->ep->fid, 0));
        CHECK(fi_mr_enable(e->mr));
    }
    e->desc = fi_mr_desc(e->mr);
}

/* close everything open_ep opened: shm removes its region file (/dev/shm/<pid>:...) only
 * when the endpoint is closed, and a process that exits without closing leaves it behind */
static void close_ep(ep_t *e)
{
    fi_close(&e->ep->fid);
    fi_close(&e->mr->fid);
    fi_close(&e->av->fid);
    fi_close(&e->cq->fid);
    fi_close(&e->domain->fid);
    fi_close(&e->fabric->fid);
    fi_freeinfo(e->info);
    free(e->buf);
    free(e);
}

static void swap_cards(ep_t *e, int sock)
{
    card_t mine, theirs;
    memset(&mine, 0, sizeof(mine));
    mine.namelen = sizeof(mine.name);
    CHECK(fi_getname(&e->ep->fid, mine.name, &mine.namelen));
    mine.base = (e->info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)e->buf : 0;
    mine.key = fi_mr_key(e->mr);
    if (write(sock, &mine, sizeof(mine)) != sizeof(mine) || read(sock, &theirs, sizeof(theirs)) != sizeof(theirs)) {
        perror("fi_pingpong: socketpair");
        exit(2);
    }
    if (fi_av_insert(e->av, theirs.name, 1, &e->peer, 0, NULL) != 1) {
        fprintf(stderr, "fi_pingpong: fi_av_insert failed\n");
        exit(2);
    }
    e->rbase = theirs.base;
    e->rkey = theirs.key;
}

static void idle(ep_t *e)
{
    if (e->cq_fd >= 0) {
        struct fid *f = &e->cq->fid;
        if (fi_trywait(e->fabric, &f, 1) == 0) {
            struct pollfd p = {.fd = e->cq_fd, .events = POLLIN};
            poll(&p, 1, 1);
        }
        return;
    }
    if (yield_when_idle || block_when_idle)
        sched_yield();
}

/* read the CQ until an entry with remote CQ data arrives; returns its data. Arrivals read in
 * the same batch wait in a small ring for the next call. */
static uint64_t wait_imm(ep_t *e, int64_t *tx_done)
{
    struct fi_cq_data_entry ent[64];
    while (e->ring_head == e->ring_tail) {
        ssize_t n = fi_cq_read(e->cq, ent, 64);
        if (n == -FI_EAGAIN) {
            idle(e);
            continue;
        }
        if (n < 0) {
            struct fi_cq_err_entry err = {0};
            fi_cq_readerr(e->cq, &err, 0);
            fprintf(stderr, "fi_pingpong: completion error %s\n", fi_strerror(err.err));
            exit(2);
        }
        for (ssize_t i = 0; i < n; i++) {
            if (ent[i].flags & FI_REMOTE_CQ_DATA)
                e->ring[e->ring_tail++ % 128] = ent[i].data;
            else if (tx_done)
                (*tx_done)++;
        }
    }
    return e->ring[e->ring_head++ % 128];
}

/* one CQ read while the provider is full: arrivals go to the ring, transmit completions
 * are counted, and an empty read waits as -y / -b say */
static void reap(ep_t *e, int64_t *tx_done)
{
    struct fi_cq_data_entry ent[64];
    ssize_t n = fi_cq_read(e->cq, ent, 64);
    if (n == -FI_EAGAIN)
        idle(e);
    for (ssize_t i = 0; i < n; i++) {
        if (ent[i].flags & FI_REMOTE_CQ_DATA)
            e->ring[e->ring_tail++ % 128] = ent[i].data;
        else
            (*tx_done)++;
    }
}

/* post, reading the CQ while the provider is full (a full queue is not an error) */
static void post_write(ep_t *e, const void *src, size_t len, uint64_t raddr, uint64_t imm, int inject,
                       int64_t *tx_done)
{
    for (;;) {
        ssize_t r;
        if (inject) {
            r = fi_inject_writedata(e->ep, src, len, imm, e->peer, raddr, e->rkey);
        } else if (dc_flag) {
            struct iovec v = {(void *)src, len};
            void *d = e->desc;
            struct fi_rma_iov ri = {raddr, len, e->rkey};
            struct fi_msg_rma msg = {.msg_iov = &v, .desc = &d, .iov_count = 1, .addr = e->peer,
                                     .rma_iov = &ri, .rma_iov_count = 1, .context = next_ctx(e), .data = imm};
            r = fi_writemsg(e->ep, &msg, FI_COMPLETION | FI_REMOTE_CQ_DATA | dc_flag);
        } else {
            r = fi_writedata(e->ep, (void *)src, len, e->desc, imm, e->peer, raddr, e->rkey, next_ctx(e));
        }
        if (r == 0)
            return;
        if (r != -FI_EAGAIN)
            CHECK(r);
        reap(e, tx_done);
    }
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int run_lat(const char *prov, int sock, int initiator, long iters, long warmup, size_t size, int inject)
{
    ep_t *e = calloc(1, sizeof(*e));
    open_ep(e, prov, size < 8 ? 8 : size);
    swap_cards(e, sock);
    inject = inject && size <= e->inject_size;
    long total = iters + warmup;
    double *rtt = initiator ? malloc(sizeof(double) * (size_t)iters) : NULL;
    int64_t tx = 0;
    for (long i = 0; i < total; i++) {
        if (initiator) {
            double t0 = now_s();
            post_write(e, e->buf, size, e->rbase, (uint64_t)i, inject, &tx);
            uint64_t got = wait_imm(e, &tx);
            double t1 = now_s();
            if (got != (uint64_t)i) {
                fprintf(stderr, "fi_pingpong: echo %" PRIu64 " for %ld\n", got, i);
                return 2;
            }
            if (i >= warmup)
                rtt[i - warmup] = t1 - t0;
        } else {
            uint64_t got = wait_imm(e, &tx);
            post_write(e, e->buf, size, e->rbase, got, inject, &tx);
        }
    }
    if (!initiator) {
        /* let the last echo's completion arrive before closing under it */
        char c;
        if (read(sock, &c, 1) != 1) { /* the initiator is gone; fine */ }
        close_ep(e);
        return 0;
    }
    double sum = 0;
    for (long i = 0; i < iters; i++)
        sum += rtt[i];
    qsort(rtt, (size_t)iters, sizeof(double), cmp_d);
    printf("{\"mode\": \"lat\", \"provider\": \"%s\", \"size\": %zu, \"inject\": %d, \"delivery_complete\": %d, "
           "\"iterations\": %ld, \"p50_us\": %.3f, \"p99_us\": %.3f, \"min_us\": %.3f, \"mean_us\": %.3f}\n",
           e->info->fabric_attr->prov_name, size, inject, dc_flag != 0, iters, rtt[iters / 2] * 1e6,
           rtt[(long)(iters * 0.99)] * 1e6, rtt[0] * 1e6, sum / (double)iters * 1e6);
    char c = 0;
    if (write(sock, &c, 1) != 1) { /* the target is gone; fine */ }
    close_ep(e);
    return 0;
}

static uint64_t rng_state = 88172645463325252ULL;
static uint64_t xs(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* a uniform index in [0, i] from a rail's own xorshift state (each rail shuffles its pages
 * with its own seed) */
static size_t xs_r(uint64_t *state, size_t i)
{
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return (size_t)(*state % (i + 1));
}

/* one rail of a paged run: its endpoint, its share of the pages, and its own thread */
typedef struct {
    ep_t *e;
    int initiator;
    long iters, warmup;
    size_t page, pages, iov, msgs;
    size_t *perm;
    uint64_t rng;              /* the rail's shuffle state */
    pthread_barrier_t *bar;    /* initiator: every rail starts and ends an iteration together */
    double *t;                 /* initiator, rail 0: the iterations' times */
} rail_t;

static void *run_rail(void *arg)
{
    rail_t *rl = arg;
    ep_t *e = rl->e;
    size_t page = rl->page, pages = rl->pages, iov = rl->iov, msgs = rl->msgs;
    long total = rl->iters + rl->warmup;
    int64_t tx = 0;
    char *flag = e->buf + page * pages;
    double t0 = 0;
    for (long it = 0; it < total; it++) {
        if (rl->initiator) {
            for (size_t i = 0; i < pages; i++)
                rl->perm[i] = i;
            for (size_t i = pages - 1; i > 0; i--) {
                size_t j = xs_r(&rl->rng, i), s = rl->perm[i];
                rl->perm[i] = rl->perm[j];
                rl->perm[j] = s;
            }
            pthread_barrier_wait(rl->bar);
            if (rl->t)
                t0 = now_s();
            int64_t tx0 = tx;
            for (size_t m = 0; m < msgs; m++) {
                struct iovec v[16];
                void *d[16];
                struct fi_rma_iov r[16];
                size_t np = 0;
                for (size_t k = m * iov; k < pages && np < iov; k++, np++) {
                    v[np].iov_base = e->buf + k * page;
                    v[np].iov_len = page;
                    d[np] = e->desc;
                    r[np].addr = e->rbase + rl->perm[k] * page;
                    r[np].len = page;
                    r[np].key = e->rkey;
                }
                struct fi_msg_rma msg = {.msg_iov = v, .desc = d, .iov_count = np, .addr = e->peer,
                                         .rma_iov = r, .rma_iov_count = np, .context = next_ctx(e),
                                         .data = (uint64_t)it};
                for (;;) {
                    ssize_t ret = fi_writemsg(e->ep, &msg, FI_COMPLETION | FI_REMOTE_CQ_DATA |
                                                          (m + 1 == msgs ? dc_flag : 0));
                    if (ret == 0)
                        break;
                    if (ret != -FI_EAGAIN)
                        CHECK(ret);
                    reap(e, &tx);
                }
            }
            wait_imm(e, &tx);   /* the target's answer ends this rail's iteration */
            pthread_barrier_wait(rl->bar);
            if (rl->t && it >= rl->warmup)
                rl->t[it - rl->warmup] = now_s() - t0;
            while (tx - tx0 < (int64_t)msgs) {   /* reap the rest of our completions, untimed */
                struct fi_cq_data_entry ent[64];
                ssize_t n = fi_cq_read(e->cq, ent, 64);
                for (ssize_t i = 0; i < n; i++)
                    tx += !(ent[i].flags & FI_REMOTE_CQ_DATA);
            }
        } else {
            int64_t got = 0;
            while (got < (int64_t)msgs) {
                wait_imm(e, &tx);
                got++;
            }
            post_write(e, flag, 8, e->rbase + page * pages, (uint64_t)it, 0, &tx);
        }
    }
    return NULL;
}

/* -R RAILS: as many endpoints per process, each with its own thread, CQ and connection, rail
 * k taking pages [pages*k/RAILS, pages*(k+1)/RAILS) as kvxfer stripes them
 * (wire.stripe_bounds); one rail is the plain one-thread floor */
static int run_pages(const char *prov, int sock, int initiator, long iters, long warmup, size_t page,
                     size_t pages, size_t iov, size_t rails)
{
    if (rails < 1)
        rails = 1;
    if (rails > pages)
        rails = pages;
    rail_t *rl = calloc(rails, sizeof(*rl));
    pthread_t *th = calloc(rails, sizeof(*th));
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, (unsigned)rails);
    double *t = initiator ? malloc(sizeof(double) * (size_t)iters) : NULL;
    size_t used_iov = iov;
    for (size_t k = 0; k < rails; k++) {
        size_t n = pages * (k + 1) / rails - pages * k / rails;
        ep_t *e = calloc(1, sizeof(*e));
        open_ep(e, prov, page * n + 8);
        swap_cards(e, sock);
        size_t v = iov > e->iov_limit ? e->iov_limit : iov;
        if (v > 16)
            v = 16;                /* the message arrays below */
        if (v < 1)
            v = 1;
        used_iov = v;
        rl[k] = (rail_t){.e = e, .initiator = initiator, .iters = iters, .warmup = warmup, .page = page,
                         .pages = n, .iov = v, .msgs = (n + v - 1) / v, .perm = malloc(sizeof(size_t) * n),
                         .rng = 88172645463325252ULL + 0x9e3779b97f4a7c15ULL * k, .bar = &bar,
                         .t = k == 0 ? t : NULL};
    }
    for (size_t k = 0; k < rails; k++)
        if (pthread_create(&th[k], NULL, run_rail, &rl[k])) {
            perror("fi_pingpong: pthread_create");
            exit(2);
        }
    size_t msgs = 0;
    for (size_t k = 0; k < rails; k++) {
        pthread_join(th[k], NULL);
        msgs += rl[k].msgs;
    }
    if (!initiator) {
        char c;
        if (read(sock, &c, 1) != 1) { /* fine */ }
        for (size_t k = 0; k < rails; k++)
            close_ep(rl[k].e);
        return 0;
    }
    qsort(t, (size_t)iters, sizeof(double), cmp_d);
    double p50 = t[iters / 2];
    printf("{\"mode\": \"pages\", \"provider\": \"%s\", \"page_bytes\": %zu, \"pages\": %zu, \"iov\": %zu, "
           "\"rails\": %zu, \"delivery_complete\": %d, \"messages\": %zu, \"iterations\": %ld, \"p50_s\": %.6f, "
           "\"gbps\": %.3f}\n",
           rl[0].e->info->fabric_attr->prov_name, page, pages, used_iov, rails, dc_flag != 0, msgs, iters, p50,
           (double)(page * pages) / p50 / 1e9);
    char c = 0;
    if (write(sock, &c, 1) != 1) { /* fine */ }
    for (size_t k = 0; k < rails; k++)
        close_ep(rl[k].e);
    return 0;
}

static int run_cma(int sock, int initiator, long iters, long warmup, size_t page, size_t pages, size_t iov)
{
    struct { pid_t pid; uint64_t addr; } card;
    size_t len = page * pages;
    char *buf = aligned_alloc(4096, (len + 4095) / 4096 * 4096);
    memset(buf, initiator ? 0x5a : 0, len);
    if (!initiator) {
        card.pid = getpid();
        card.addr = (uint64_t)(uintptr_t)buf;
        char c;
        if (write(sock, &card, sizeof(card)) != sizeof(card) || read(sock, &c, 1) != 1) { /* gone */ }
        return 0;
    }
    if (read(sock, &card, sizeof(card)) != sizeof(card)) {
        perror("fi_pingpong: socketpair");
        return 2;
    }
    if (iov > 1024)
        iov = 1024;
    if (iov < 1)
        iov = 1;
    size_t *perm = malloc(sizeof(size_t) * pages);
    struct iovec *remote = malloc(sizeof(struct iovec) * iov);
    double *t = malloc(sizeof(double) * (size_t)iters);
    for (long it = 0; it < iters + warmup; it++) {
        for (size_t i = 0; i < pages; i++)
            perm[i] = i;
        for (size_t i = pages - 1; i > 0; i--) {
            size_t j = xs() % (i + 1), x = perm[i];
            perm[i] = perm[j];
            perm[j] = x;
        }
        double t0 = now_s();
        for (size_t k = 0; k < pages; k += iov) {
            size_t np = pages - k < iov ? pages - k : iov;
            struct iovec local = {buf + k * page, np * page};
            for (size_t m = 0; m < np; m++) {
                remote[m].iov_base = (void *)(uintptr_t)(card.addr + perm[k + m] * page);
                remote[m].iov_len = page;
            }
            ssize_t got = process_vm_writev(card.pid, &local, 1, remote, np, 0);
            if (got != (ssize_t)(np * page)) {
                perror("fi_pingpong: process_vm_writev");
                return 2;
            }
        }
        double t1 = now_s();
        if (it >= warmup)
            t[it - warmup] = t1 - t0;
    }
    qsort(t, (size_t)iters, sizeof(double), cmp_d);
    double p50 = t[iters / 2];
    printf("{\"mode\": \"cma\", \"page_bytes\": %zu, \"pages\": %zu, \"iov\": %zu, \"calls\": %zu, "
           "\"iterations\": %ld, \"p50_s\": %.6f, \"gbps\": %.3f}\n",
           page, pages, iov, (pages + iov - 1) / iov, iters, p50, (double)len / p50 / 1e9);
    char c = 0;
    if (write(sock, &c, 1) != 1) { /* fine */ }
    return 0;
}

/* -m sock: one connection's share of the bytes per thread, each iteration ended by a 1-byte
 * answer per connection (see the top of the file) */
typedef struct {
    int fd, initiator;
    long iters, warmup;
    char *buf;
    size_t len, chunk;
    pthread_barrier_t *bar;
    double *t;
} sock_rail_t;

static void xfer_all(int fd, char *p, size_t len, int sending)
{
    while (len) {
        ssize_t n = sending ? send(fd, p, len, MSG_NOSIGNAL) : recv(fd, p, len, 0);
        if (n <= 0) {
            if (n < 0 && errno == EINTR)
                continue;
            perror(sending ? "fi_pingpong: send" : "fi_pingpong: recv");
            exit(2);
        }
        p += n;
        len -= (size_t)n;
    }
}

static void *run_sock_rail(void *arg)
{
    sock_rail_t *s = arg;
    char ack = 0;
    double t0 = 0;
    for (long it = 0; it < s->iters + s->warmup; it++) {
        if (s->initiator) {
            pthread_barrier_wait(s->bar);
            if (s->t)
                t0 = now_s();
            for (size_t o = 0; o < s->len; o += s->chunk)
                xfer_all(s->fd, s->buf + o, s->len - o < s->chunk ? s->len - o : s->chunk, 1);
            xfer_all(s->fd, &ack, 1, 0);
            pthread_barrier_wait(s->bar);
            if (s->t && it >= s->warmup)
                s->t[it - s->warmup] = now_s() - t0;
        } else {
            for (size_t o = 0; o < s->len; o += s->chunk)
                xfer_all(s->fd, s->buf + o, s->len - o < s->chunk ? s->len - o : s->chunk, 0);
            xfer_all(s->fd, &ack, 1, 1);
        }
    }
    return NULL;
}

/* TCP_NODELAY, as libfabric's tcp provider sets it: without it a send() smaller than a segment
 * waits for the peer's delayed ACK (Nagle), tens of milliseconds */
static void nodelay(int fd)
{
    int one = 1;
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one))) {
        perror("fi_pingpong: TCP_NODELAY");
        exit(2);
    }
}

static int run_sock(int sock, int initiator, long iters, long warmup, size_t page, size_t pages, size_t iov,
                    size_t rails)
{
    if (rails < 1)
        rails = 1;
    if (rails > pages)
        rails = pages;
    size_t len = page * pages;
    char *buf = aligned_alloc(4096, (len + 4095) / 4096 * 4096);
    memset(buf, initiator ? 0x5a : 0, len);
    int *fds = calloc(rails, sizeof(int));
    if (!initiator) {
        int lfd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        socklen_t al = sizeof(a);
        if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, sizeof(a)) || listen(lfd, (int)rails) ||
            getsockname(lfd, (struct sockaddr *)&a, &al) || write(sock, &a.sin_port, 2) != 2) {
            perror("fi_pingpong: listen");
            exit(2);
        }
        for (size_t k = 0; k < rails; k++) {
            if ((fds[k] = accept(lfd, NULL, NULL)) < 0) {
                perror("fi_pingpong: accept");
                exit(2);
            }
            nodelay(fds[k]);
        }
        close(lfd);
    } else {
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        if (read(sock, &a.sin_port, 2) != 2) {
            perror("fi_pingpong: socketpair");
            return 2;
        }
        for (size_t k = 0; k < rails; k++) {
            fds[k] = socket(AF_INET, SOCK_STREAM, 0);
            if (fds[k] < 0 || connect(fds[k], (struct sockaddr *)&a, sizeof(a))) {
                perror("fi_pingpong: connect");
                exit(2);           /* the target, waiting in accept(), dies with us (PDEATHSIG) */
            }
            nodelay(fds[k]);
        }
    }
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, (unsigned)rails);
    double *t = initiator ? malloc(sizeof(double) * (size_t)iters) : NULL;
    sock_rail_t *sr = calloc(rails, sizeof(*sr));
    pthread_t *th = calloc(rails, sizeof(*th));
    for (size_t k = 0; k < rails; k++) {
        size_t lo = pages * k / rails * page, hi = pages * (k + 1) / rails * page;
        sr[k] = (sock_rail_t){.fd = fds[k], .initiator = initiator, .iters = iters, .warmup = warmup,
                              .buf = buf + lo, .len = hi - lo, .chunk = iov ? iov * page : hi - lo,
                              .bar = &bar, .t = k == 0 ? t : NULL};
        if (pthread_create(&th[k], NULL, run_sock_rail, &sr[k])) {
            perror("fi_pingpong: pthread_create");
            exit(2);
        }
    }
    for (size_t k = 0; k < rails; k++)
        pthread_join(th[k], NULL);
    if (!initiator)
        return 0;
    qsort(t, (size_t)iters, sizeof(double), cmp_d);
    double p50 = t[iters / 2];
    printf("{\"mode\": \"sock\", \"bytes\": %zu, \"chunk\": %zu, \"rails\": %zu, \"iterations\": %ld, "
           "\"p50_s\": %.6f, \"gbps\": %.3f}\n", len, iov ? iov * page : 0, rails, iters, p50,
           (double)len / p50 / 1e9);
    return 0;
}

/* -C I:T: the CPU list of one side (I for the initiator, T for the target), comma-separated */
static int parse_cpus(const char *spec, int initiator, cpu_set_t *set)
{
    const char *colon = strchr(spec, ':');
    if (!colon) {
        fprintf(stderr, "fi_pingpong: -C wants INITIATOR_CPUS:TARGET_CPUS, e.g. 0:1\n");
        return 2;
    }
    const char *p = initiator ? spec : colon + 1, *end = initiator ? colon : spec + strlen(spec);
    CPU_ZERO(set);
    while (p < end) {
        char *q;
        long c = strtol(p, &q, 10);
        if (q == p || q > end || c < 0 || c >= CPU_SETSIZE || (q != end && *q != ',')) {
            fprintf(stderr, "fi_pingpong: bad CPU list in -C %s\n", spec);
            return 2;
        }
        CPU_SET((int)c, set);
        p = q == end ? q : q + 1;
    }
    if (CPU_COUNT(set) == 0) {
        fprintf(stderr, "fi_pingpong: empty CPU list in -C %s\n", spec);
        return 2;
    }
    return 0;
}

int main(int argc, char **argv)
{
    const char *prov = "tcp;ofi_rxm", *mode = "lat";
    long iters = 10000, warmup = 500;
    size_t size = 8, page = 16384, pages = 4096, iov = 16, rails = 1, sock_iov = 0;
    int inject = 0, opt, iters_set = 0, warmup_set = 0;
    const char *pin = NULL;
    while ((opt = getopt(argc, argv, "p:n:w:s:jybC:Dm:P:N:I:R:")) != -1) {
        switch (opt) {
        case 'p': prov = optarg; break;
        case 'n': iters = atol(optarg); iters_set = 1; break;
        case 'w': warmup = atol(optarg); warmup_set = 1; break;
        case 's': size = strtoull(optarg, NULL, 0); break;
        case 'j': inject = 1; break;
        case 'y': yield_when_idle = 1; break;
        case 'b': block_when_idle = 1; break;
        case 'C': pin = optarg; break;
        case 'D': dc_flag = FI_DELIVERY_COMPLETE; break;
        case 'm': mode = optarg; break;
        case 'P': page = strtoull(optarg, NULL, 0); break;
        case 'N': pages = strtoull(optarg, NULL, 0); break;
        case 'I': iov = strtoull(optarg, NULL, 0); sock_iov = iov; break;
        case 'R': rails = strtoull(optarg, NULL, 0); break;
        default:
            fprintf(stderr, "usage: %s [-m lat|pages|cma|sock] [-p PROV] [-n ITERS] [-w WARMUP] [-s BYTES] [-j] "
                            "[-y|-b] [-D] [-C I:T] [-P PAGE] [-N PAGES] [-I IOV] [-R RAILS]\n", argv[0]);
            return 2;
        }
    }
    int cma_mode = strcmp(mode, "cma") == 0, sock_mode = strcmp(mode, "sock") == 0;
    int pages_mode = strcmp(mode, "pages") == 0 || cma_mode || sock_mode;
    if (pages_mode && !iters_set)
        iters = 20;
    if (pages_mode && !warmup_set)
        warmup = 2;
    if (iters < 1 || (pages_mode && (pages < 1 || page < 1))) {
        fprintf(stderr, "fi_pingpong: bad arguments\n");
        return 2;
    }
    cpu_set_t cpus[2];   /* -C: [0] the target's, [1] the initiator's; checked before the fork */
    if (pin && (parse_cpus(pin, 0, &cpus[0]) || parse_cpus(pin, 1, &cpus[1])))
        return 2;
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) {
        perror("socketpair");
        return 2;
    }
    fflush(stdout);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        return 2;
    }
    int initiator = pid > 0;
    if (!initiator && (prctl(PR_SET_PDEATHSIG, SIGKILL) || getppid() != parent))
        _exit(2);                  /* never outlive the initiator (a killed or failed run) */
    if (pin && sched_setaffinity(0, sizeof(cpu_set_t), &cpus[initiator])) {
        perror("fi_pingpong: -C");
        if (!initiator)
            _exit(2);
        return 2;          /* the target dies with us (PDEATHSIG) */
    }
    close(sv[initiator ? 1 : 0]);
    int sock = sv[initiator ? 0 : 1];
    int rc = sock_mode    ? run_sock(sock, initiator, iters, warmup, page, pages, sock_iov, rails)
             : cma_mode   ? run_cma(sock, initiator, iters, warmup, page, pages, iov)
             : pages_mode ? run_pages(prov, sock, initiator, iters, warmup, page, pages, iov, rails)
                          : run_lat(prov, sock, initiator, iters, warmup, size, inject);
    if (!initiator)
        _exit(rc);
    int st = 0;
    waitpid(pid, &st, 0);
    if (rc == 0 && !(WIFEXITED(st) && WEXITSTATUS(st) == 0))
        rc = 3;
    return rc;
}
