/* engine.h: opening and closing an engine, memory registration, addresses, control
 * messages and the waits the Python face blocks in (always without the GIL). */
#ifndef KVXFER_ENGINE_H
#define KVXFER_ENGINE_H

#include "kvxfer/core.h"
#include "kvxfer/counters.h"
#include "kvxfer/progress.h"
#include "kvxfer/post.h"

#define KX_CHECK(call, name)                                                        \
    do {                                                                            \
        int _r = (int)(call);                                                       \
        if (_r) {                                                                   \
            snprintf(errcall, errcall_len, "%s", name);                             \
            kx_engine_free(e);                                                   \
            return _r;                                                              \
        }                                                                           \
    } while (0)

static void kx_engine_teardown(kx_engine *e);
static void kx_engine_free(kx_engine *e);

static int kx_mr_reg(kx_engine *e, void *buf, size_t len, int iface, int device, int dmabuf_fd,
                     struct fid_mr **mr, uint64_t *key, void **desc, uint8_t *raw, size_t *rawlen,
                     const char **call);

static char *kx_rx_slab(kx_engine *e) { return e->rx[0].data; }

static kx_hub *kx_hub_new(void)
{
    kx_hub *h = calloc(1, sizeof(*h));
    if (!h)
        return NULL;
    if (kx_ctable_init(&h->table)) {
        free(h);
        return NULL;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&h->cond, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&h->lock, NULL);
    return h;
}

/* Open fabric, domain, CQ, AV and one RDM endpoint on `prov` (NULL: libfabric's first
 * choice), bound to `node` when given, on the domain (NIC) named `domain` when given.
 * `join` is another rail of the same engine whose hub this one shares (NULL: a new hub).
 * On failure returns -errno and names the call. */
static int kx_engine_open(const char *prov, const char *node, const char *domain, int hmem, int spin,
                          kx_engine *join, kx_engine **out, char *errcall, size_t errcall_len)
{
    kx_engine *e = calloc(1, sizeof(*e));
    if (!e)
        return -FI_ENOMEM;
    if (join) {
        e->hub = join->hub;
    } else if (!(e->hub = kx_hub_new())) {
        free(e);
        return -FI_ENOMEM;
    }
    pthread_mutex_init(&e->reg_lock, NULL);
    pthread_mutex_lock(&e->hub->lock);
    e->hub->refs++;
    e->hub->open++;
    pthread_mutex_unlock(&e->hub->lock);
    e->spin = spin;
    e->next_key = 1;
    e->last_activity_ns = kx_now_ns();

    struct fi_info *hints = fi_allocinfo();
    if (!hints) {
        kx_engine_free(e);
        return -FI_ENOMEM;
    }
    hints->caps = FI_MSG | FI_RMA | (hmem ? FI_HMEM : 0);
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY |
                                  FI_MR_ENDPOINT | FI_MR_RAW | (hmem ? FI_MR_HMEM : 0);
    hints->domain_attr->threading = FI_THREAD_SAFE;
    if (prov)
        hints->fabric_attr->prov_name = strdup(prov);
    if (domain)
        hints->domain_attr->name = strdup(domain);
    int ret = fi_getinfo(KX_FI_API_VERSION, node, NULL, node ? FI_SOURCE : 0, hints, &e->info);
    fi_freeinfo(hints);
    if (ret) {
        snprintf(errcall, errcall_len, "fi_getinfo");
        kx_engine_free(e);
        return ret;
    }
    struct fi_info *fi = e->info;
    e->mr_mode = fi->domain_attr->mr_mode;
    e->caps = fi->caps;
    e->need_ctx = (fi->mode & (FI_CONTEXT | FI_CONTEXT2)) != 0;
    size_t iovl = fi->tx_attr->iov_limit, rl = fi->tx_attr->rma_iov_limit;
    e->iov_limit = iovl < rl ? iovl : rl;
    if (e->iov_limit > KX_MAX_IOV)
        e->iov_limit = KX_MAX_IOV;
    if (e->iov_limit < 1)
        e->iov_limit = 1;
    e->max_msg_size = fi->ep_attr->max_msg_size;
    e->inject_size = fi->tx_attr->inject_size;
    e->cq_data_size = fi->domain_attr->cq_data_size;

    KX_CHECK(fi_fabric(fi->fabric_attr, &e->fabric, NULL), "fi_fabric");
    KX_CHECK(fi_domain(e->fabric, fi, &e->domain, NULL), "fi_domain");

    struct fi_cq_attr cqa;
    memset(&cqa, 0, sizeof(cqa));
    cqa.format = FI_CQ_FORMAT_DATA;
    cqa.size = fi->tx_attr->size + fi->rx_attr->size;
    cqa.wait_obj = spin ? FI_WAIT_NONE : FI_WAIT_FD;   /* a real sleep; WAIT_UNSPEC may pick a yield loop (shm) */
    ret = fi_cq_open(e->domain, &cqa, &e->cq, NULL);
    if (ret && cqa.wait_obj != FI_WAIT_NONE) {
        cqa.wait_obj = FI_WAIT_NONE;
        ret = fi_cq_open(e->domain, &cqa, &e->cq, NULL);
    }
    KX_CHECK(ret, "fi_cq_open");
    e->has_wait = cqa.wait_obj != FI_WAIT_NONE;

    struct fi_av_attr ava;
    memset(&ava, 0, sizeof(ava));
    ava.type = FI_AV_TABLE;
    KX_CHECK(fi_av_open(e->domain, &ava, &e->av, NULL), "fi_av_open");
    KX_CHECK(fi_endpoint(e->domain, fi, &e->ep, NULL), "fi_endpoint");
    KX_CHECK(fi_ep_bind(e->ep, &e->cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
    KX_CHECK(fi_ep_bind(e->ep, &e->av->fid, 0), "fi_ep_bind(av)");
    KX_CHECK(fi_enable(e->ep), "fi_enable");
    e->peer_timeout_ns = 10000000000LL;     /* kx_set_peer_timeout changes it */
    if (!(e->pdir = calloc(KX_PEER_CHUNKS, sizeof(*e->pdir)))) {
        kx_engine_free(e);
        return -FI_ENOMEM;
    }
    KX_CHECK(kx_local_publish(e), "kx_local_publish");

    /* one slab for the posted receive buffers */
    char *slab = malloc((size_t)KX_RX_BUFS * KX_MSG_MAX);
    if (!slab) {
        kx_engine_free(e);
        return -FI_ENOMEM;
    }
    for (int i = 0; i < KX_RX_BUFS; i++) {
        e->rx[i].op.kind = KX_OP_RECV;
        e->rx[i].op.owner = &e->rx[i];
        e->rx[i].data = slab + (size_t)i * KX_MSG_MAX;
    }
    if (e->mr_mode & FI_MR_LOCAL) {   /* message buffers must be registered too */
        uint64_t key;
        uint8_t raw[64];
        size_t rawlen;
        const char *call;
        e->reg_local_only = 1;            /* the slab is ours: no remote access */
        int r = kx_mr_reg(e, slab, (size_t)KX_RX_BUFS * KX_MSG_MAX, FI_HMEM_SYSTEM, 0, -1, &e->rx_mr, &key,
                          &e->rx_desc, raw, &rawlen, &call);
        e->reg_local_only = 0;
        KX_CHECK(r, call);
    }
    for (int i = 0; i < KX_RX_BUFS; i++)
        KX_CHECK(kx_post_recv(e, &e->rx[i]), "fi_recv");
    *out = e;
    return 0;
}

static int kx_engine_start(kx_engine *e, const int *cpus, int ncpus)
{
    CPU_ZERO(&e->cpus);
    for (int i = 0; i < ncpus; i++)
        CPU_SET(cpus[i], &e->cpus);
    e->pin = ncpus > 0;
    int ret = pthread_create(&e->thread, NULL, kx_progress_main, e);
    if (ret)
        return -ret;
    pthread_setname_np(e->thread, "kvxfer-progress");
    e->thread_started = 1;
    return 0;
}

/* Stop the thread (with a deadline) and close every fid, children first. Idempotent.
 * Transfers and counters still pending fail with ECANCELED; the struct itself lives on
 * until kx_engine_free so late releases from Python stay safe. */
/* Before closing: cancel what is still queued and give the operations already posted up to
 * `timeout_ns` to complete, with the progress thread still running. A peer then never sees
 * an endpoint vanish under commands it is processing (shm crashed in libfabric 1.17 when a
 * peer closed with writes in flight). A dead peer only costs the deadline. */
/* returns 1 once quiet (nothing of ours pending, no incoming traffic for quiet_ns), 0 if
 * the deadline came first */
static int kx_engine_drain(kx_engine *e, int64_t timeout_ns, int64_t quiet_ns)
{
    if (e->quiesced || !e->thread_started)
        return 1;
    pthread_mutex_lock(&e->hub->lock);
    for (kx_xfer *x = e->q_head; x; x = x->qnext)
        __atomic_store_n(&x->cancel, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&e->hub->lock);
    kx_wake(e);
    int64_t until = kx_now_ns() + timeout_ns;
    while (kx_now_ns() < until) {
        /* done when nothing of ours is pending and incoming traffic has been quiet for 20 ms
         * (rxm in 1.17 crashed closing an endpoint that still had a peer's data in flight) */
        if (kx_outstanding_live(e) <= 0 && e->q_head == NULL &&
            kx_now_ns() - e->last_activity_ns > quiet_ns)
            return 1;
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
    return 0;
}

/* Leave the endpoint open when the engine closes: its fids are never closed, nothing progresses
 * it again (both providers progress manually, so no data is placed any more), its memory and
 * sockets stay until the process exits. The one defence kvxfer has against libfabric 1.17's
 * rxm crashing inside fi_close of an endpoint that peers were writing to: rxm_close_conn
 * flushes the message CQ and handles an entry with a NULL op_context (a partly received RMA
 * write cancelled by tcp's endpoint close) as a receive, SIGSEGV in rxm_handle_comp. */
static void kx_engine_park(kx_engine *e)
{
    e->parked = 1;
}

static int kx_engine_took_traffic(kx_engine *e)
{
    return e->hub->stat_imm > 0 || e->took_msgs;
}

/* First half of closing: no thread uses the endpoint afterwards. Sets stop, waits (5 s at
 * most) for Python threads inside native calls to leave, then joins the progress thread.
 * Idempotent. Registrations may be closed after this and before the teardown. */
static void kx_engine_quiesce(kx_engine *e)
{
    if (e->quiesced)
        return;
    e->quiesced = 1;
    kx_local_retire(e);      /* engines of this process stop posting to us first */
    __atomic_store_n(&e->stop, 1, __ATOMIC_SEQ_CST);
    int64_t until = kx_now_ns() + 5000000000LL;
    for (;;) {      /* a late kx_enter may bump busy briefly and back off: not a leak */
        if (__atomic_load_n(&e->busy, __ATOMIC_SEQ_CST) == 0)
            break;
        if (kx_now_ns() >= until) {
            e->leaked = 1;
            break;
        }
        sched_yield();
    }
    if (e->thread_started) {
        if (e->has_wait && e->cq)
            fi_cq_signal(e->cq);
        pthread_mutex_lock(&e->hub->lock);
        pthread_cond_broadcast(&e->hub->cond);
        pthread_mutex_unlock(&e->hub->lock);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 5;
        if (pthread_timedjoin_np(e->thread, NULL, &ts) != 0) {
            pthread_detach(e->thread);
            e->leaked = 1;   /* stuck in the provider: leak everything it may touch */
        }
        e->thread_started = 0;
    }
}

static void kx_engine_teardown(kx_engine *e)
{
    if (e->torn_down)
        return;
    kx_engine_quiesce(e);
    e->torn_down = 1;
    if (e->leaked || e->parked) {
        /* leaked: a thread may still be inside libfabric; parked: the endpoint stays open.
         * Close nothing of libfabric's, but let no waiter hang: pending transfers and
         * counters fail now */
        if (e->parked)
            kx_peers_free(e);
        pthread_mutex_lock(&e->hub->lock);
        for (kx_xfer *x = e->inflight; x; x = x->next) {
            if (!x->error)
                x->error = FI_ECANCELED;
            x->done = 1;
        }
        if (--e->hub->open == 0) {
            for (size_t i = 0; i < e->hub->table.cap; i++) {
                kx_centry *s = &e->hub->table.slots[i];
                if (s->used && s->active) {
                    s->active->error = FI_ECANCELED;
                    s->active->done = 1;
                }
            }
        }
        e->hub->dispatch_stop = 1;
        pthread_cond_broadcast(&e->hub->cond);
        pthread_mutex_unlock(&e->hub->lock);
        return;
    }
    if (e->ep) { fi_close(&e->ep->fid); e->ep = NULL; }
    kx_peers_free(e);
    if (e->rx_mr) { fi_close(&e->rx_mr->fid); e->rx_mr = NULL; }
    if (e->av) { fi_close(&e->av->fid); e->av = NULL; }
    if (e->cq) { fi_close(&e->cq->fid); e->cq = NULL; }
    /* domain and fabric stay open until kx_engine_close_domain: registrations go first,
     * after the endpoint (rxm's endpoint close still touches the descriptors of what it
     * cancels), and a domain with registrations refuses to close */
    if (e->rx[0].data) { free(kx_rx_slab(e)); e->rx[0].data = NULL; }
    pthread_mutex_lock(&e->hub->lock);
    e->q_head = e->q_tail = NULL;
    while (e->inflight) {
        kx_xfer *x = e->inflight;
        if (!x->error)
            x->error = FI_ECANCELED;
        x->posting_done = 1;
        x->completed = x->posted;
        kx_xfer_check_done_locked(e, x);
    }
    if (--e->hub->open > 0) {           /* the other rails still use the shared state */
        pthread_cond_broadcast(&e->hub->cond);
        pthread_mutex_unlock(&e->hub->lock);
        return;
    }
    for (size_t i = 0; i < e->hub->table.cap; i++) {
        kx_centry *s = &e->hub->table.slots[i];
        if (s->used && s->active) {
            kx_counter *c = s->active;
            s->active = NULL;
            c->error = FI_ECANCELED;
            c->done = 1;
            kx_counter_release_locked(c);
        }
    }
    while (e->hub->msg_head) {
        kx_msg *m = e->hub->msg_head;
        e->hub->msg_head = m->next;
        free(m);
    }
    e->hub->msg_tail = NULL;
    e->hub->nmsgs = 0;
    while (e->hub->done_head) {
        kx_counter *c = e->hub->done_head;
        e->hub->done_head = c->next_done;
        kx_counter_release_locked(c);
    }
    e->hub->done_tail = NULL;
    e->hub->dispatch_stop = 1;
    pthread_cond_broadcast(&e->hub->cond);
    pthread_mutex_unlock(&e->hub->lock);
}

/* Last step of closing, once every registration on the domain is closed. Idempotent. */
static void kx_engine_close_domain(kx_engine *e)
{
    kx_engine_teardown(e);
    if (e->leaked || e->parked)
        return;
    if (e->domain) { fi_close(&e->domain->fid); e->domain = NULL; }
    if (e->fabric) { fi_close(&e->fabric->fid); e->fabric = NULL; }
    if (e->info) { fi_freeinfo(e->info); e->info = NULL; }
}

static void kx_engine_free(kx_engine *e)
{
    kx_engine_close_domain(e);
    if (e->leaked || e->parked)
        return;
    kx_hub *h = e->hub;
    pthread_mutex_lock(&h->lock);
    int last = --h->refs == 0;
    pthread_mutex_unlock(&h->lock);
    if (last) {
        pthread_mutex_destroy(&h->lock);
        pthread_cond_destroy(&h->cond);
        free(h->table.slots);
        free(h);
    }
    pthread_mutex_destroy(&e->reg_lock);
    free(e);
}

/* ---- memory registration ---------------------------------------------------------- */

/* Requested keys are random: where the provider does not choose keys (tcp, shm), a key is
 * all a peer needs to write into a region, so a peer given one region must not be able to
 * guess the key of another. */
static uint64_t kx_random_key(kx_engine *e)
{
    uint64_t k = 0;
    if (getrandom(&k, sizeof(k), 0) != (ssize_t)sizeof(k)) {
        pthread_mutex_lock(&e->hub->lock);
        k = (e->next_key++) * 0x9E3779B97F4A7C15ULL ^ (uint64_t)kx_now_ns();
        pthread_mutex_unlock(&e->hub->lock);
    }
    return k ? k : 1;
}

static int kx_mr_reg_entered(kx_engine *e, void *buf, size_t len, int iface, int device, int dmabuf_fd,
                             struct fid_mr **mr, uint64_t *key, void **desc, uint8_t *raw, size_t *rawlen,
                             uint64_t *raw_base, const char **call);

static int kx_mr_reg(kx_engine *e, void *buf, size_t len, int iface, int device, int dmabuf_fd,
                     struct fid_mr **mr, uint64_t *key, void **desc, uint8_t *raw, size_t *rawlen,
                     const char **call)
{
    uint64_t base;
    return kx_mr_reg_entered(e, buf, len, iface, device, dmabuf_fd, mr, key, desc, raw, rawlen, &base, call);
}

/* registration from Python: refused once the engine is closing */
static int kx_mr_reg_user(kx_engine *e, void *buf, size_t len, int iface, int device, int dmabuf_fd, int remote,
                          struct fid_mr **mr, uint64_t *key, void **desc, uint8_t *raw, size_t *rawlen,
                          uint64_t *raw_base, const char **call)
{
    if (!kx_enter(e)) {
        *call = "fi_mr_regattr";
        return -FI_ECANCELED;
    }
    pthread_mutex_lock(&e->reg_lock);
    e->reg_local_only = !remote;
    int ret = kx_mr_reg_entered(e, buf, len, iface, device, dmabuf_fd, mr, key, desc, raw, rawlen, raw_base, call);
    e->reg_local_only = 0;
    pthread_mutex_unlock(&e->reg_lock);
    kx_leave(e);
    return ret;
}

static int kx_mr_reg_entered(kx_engine *e, void *buf, size_t len, int iface, int device, int dmabuf_fd,
                             struct fid_mr **mr, uint64_t *key, void **desc, uint8_t *raw, size_t *rawlen,
                             uint64_t *raw_base, const char **call)
{
    struct iovec iov = {buf, len};
    struct fi_mr_attr attr;
    memset(&attr, 0, sizeof(attr));
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = FI_READ | FI_WRITE | FI_SEND | FI_RECV | (e->reg_local_only ? 0 : FI_REMOTE_READ | FI_REMOTE_WRITE);
    attr.requested_key = (e->mr_mode & FI_MR_PROV_KEY) ? 0 : kx_random_key(e);
    attr.iface = (enum fi_hmem_iface)iface;
    if (iface == FI_HMEM_CUDA)
        attr.device.cuda = device;
    uint64_t flags = 0;
#if KX_HAVE_DMABUF
    struct fi_mr_dmabuf dmabuf;
    if (dmabuf_fd >= 0) {
        memset(&dmabuf, 0, sizeof(dmabuf));
        dmabuf.fd = dmabuf_fd;
        dmabuf.offset = 0;
        dmabuf.len = len;
        dmabuf.base_addr = buf;
        attr.dmabuf = &dmabuf;
        flags |= FI_MR_DMABUF;
    }
#else
    if (dmabuf_fd >= 0) {
        *call = "fi_mr_regattr(FI_MR_DMABUF)";
        return -FI_ENOSYS;
    }
#endif
    *call = "fi_mr_regattr";
    int ret = fi_mr_regattr(e->domain, &attr, flags, mr);
    if (ret)
        return ret;
    if (e->mr_mode & FI_MR_ENDPOINT) {
        *call = "fi_mr_bind";
        ret = fi_mr_bind(*mr, &e->ep->fid, 0);
        if (!ret) {
            *call = "fi_mr_enable";
            ret = fi_mr_enable(*mr);
        }
        if (ret) {
            fi_close(&(*mr)->fid);
            *mr = NULL;
            return ret;
        }
    }
    *key = fi_mr_key(*mr);
    *desc = fi_mr_desc(*mr);
    *rawlen = 0;
    if (e->mr_mode & FI_MR_RAW) {
        uint64_t base = 0;
        size_t n = 64;
        *call = "fi_mr_raw_attr";
        ret = fi_mr_raw_attr(*mr, &base, raw, &n, 0);
        if (ret) {
            fi_close(&(*mr)->fid);
            *mr = NULL;
            return ret;
        }
        *rawlen = n;
        *raw_base = base;
    }
    return 0;
}

/* ---- control messages ------------------------------------------------------------- */

static int kx_send(kx_engine *e, fi_addr_t peer, const char *data, size_t len)
{
    kx_sendbuf *s = malloc(sizeof(kx_sendbuf) + (len ? len : 1));
    if (!s)
        return -FI_ENOMEM;
    memset(&s->op, 0, sizeof(s->op));
    s->op.kind = KX_OP_SEND;
    s->op.owner = s;
    s->peer = peer;
    s->mr = NULL;
    s->len = len;
    memcpy(s->data, data, len);
    void *desc = NULL;
    if (!kx_enter(e)) {                  /* one bracket: registration, post and cleanup */
        free(s);
        return -FI_ECANCELED;
    }
    if (e->mr_mode & FI_MR_LOCAL) {
        uint64_t key, base;
        uint8_t raw[64];
        size_t rawlen;
        const char *call;
        pthread_mutex_lock(&e->reg_lock);
        e->reg_local_only = 1;
        int r = kx_mr_reg_entered(e, s->data, len ? len : 1, FI_HMEM_SYSTEM, 0, -1, &s->mr, &key, &desc, raw,
                                  &rawlen, &base, &call);
        e->reg_local_only = 0;
        pthread_mutex_unlock(&e->reg_lock);
        if (r) {
            kx_leave(e);
            free(s);
            return r;
        }
    }
    __atomic_add_fetch(&e->outstanding, 1, __ATOMIC_SEQ_CST);
    ssize_t ret;
    /* queue full: let the progress thread drain it, for 50 ms at most; the caller retries */
    int64_t until = kx_now_ns() + 50000000LL;
    kx_peer_count(e, peer, 1);
    for (;;) {
        int gone = kx_peer_enter(e, peer);     /* never to a closed, exited or stalled peer */
        if (gone) {
            ret = -gone;
            break;
        }
        ret = fi_send(e->ep, s->data, len, desc, peer, &s->op.fi);
        kx_peer_leave(e, peer);
        if (ret == 0)
            kx_peer_accepted(e, peer);
        if (ret != -FI_EAGAIN || e->stop || kx_now_ns() > until)
            break;
        kx_wake(e);
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
    if (ret) {
        __atomic_sub_fetch(&e->outstanding, 1, __ATOMIC_RELAXED);
        kx_peer_uncount(e, peer, ret == -FI_EAGAIN);
        if (s->mr)
            fi_close(&s->mr->fid);
        free(s);
    }
    kx_leave(e);
    if (ret)
        return (int)ret;
    kx_wake(e);
    return 0;
}

/* ---- waits (all without the GIL; slice_ns bounds each so Python can check signals) -- */

/* 1: a message was taken (copied into *out, caller frees), 0: none within the slice */
static int kx_recv_wait(kx_engine *e, int64_t slice_ns, kx_msg **out)
{
    struct timespec ts;
    kx_deadline(&ts, slice_ns);
    pthread_mutex_lock(&e->hub->lock);
    while (!e->hub->msg_head && !e->stop) {
        if (pthread_cond_timedwait(&e->hub->cond, &e->hub->lock, &ts) == ETIMEDOUT)
            break;
    }
    kx_msg *m = e->hub->msg_head;
    if (m) {
        e->hub->msg_head = m->next;
        if (!e->hub->msg_head)
            e->hub->msg_tail = NULL;
        e->hub->nmsgs--;
    }
    pthread_mutex_unlock(&e->hub->lock);
    *out = m;
    return m != NULL;
}

/* wait for a `done` flag (a transfer's or a counter's) set under the hub lock */
static int kx_wait_done(kx_engine *e, const int *done, int64_t slice_ns)
{
    struct timespec ts;
    kx_deadline(&ts, slice_ns);
    pthread_mutex_lock(&e->hub->lock);
    while (!*done) {
        if (pthread_cond_timedwait(&e->hub->cond, &e->hub->lock, &ts) == ETIMEDOUT)
            break;
    }
    int d = *done;
    pthread_mutex_unlock(&e->hub->lock);
    return d;
}

/* the callback dispatcher: pops the next finished counter that wants a callback;
 * returns 1 with *out set, 0 on slice timeout, -1 once the engine is closing */
static int kx_next_done(kx_engine *e, int64_t slice_ns, kx_counter **out)
{
    struct timespec ts;
    kx_deadline(&ts, slice_ns);
    pthread_mutex_lock(&e->hub->lock);
    while (!e->hub->done_head && !e->hub->dispatch_stop) {
        if (pthread_cond_timedwait(&e->hub->cond, &e->hub->lock, &ts) == ETIMEDOUT)
            break;
    }
    kx_counter *c = e->hub->done_head;
    int ret = 0;
    if (c) {
        e->hub->done_head = c->next_done;
        if (!e->hub->done_head)
            e->hub->done_tail = NULL;
        ret = 1;
    } else if (e->hub->dispatch_stop) {
        ret = -1;
    }
    pthread_mutex_unlock(&e->hub->lock);
    *out = c;
    return ret;
}

static void kx_counter_unref(kx_engine *e, kx_counter *c)
{
    pthread_mutex_lock(&e->hub->lock);
    kx_counter_release_locked(c);
    pthread_mutex_unlock(&e->hub->lock);
}

static void kx_xfer_drop(kx_engine *e, kx_xfer *x)
{
    pthread_mutex_lock(&e->hub->lock);
    kx_xfer_release_locked(x);
    pthread_mutex_unlock(&e->hub->lock);
}

static void kx_dispatch_stop(kx_engine *e)
{
    pthread_mutex_lock(&e->hub->lock);
    e->hub->dispatch_stop = 1;
    pthread_cond_broadcast(&e->hub->cond);
    pthread_mutex_unlock(&e->hub->lock);
}

/* ---- addresses and remote keys ---------------------------------------------------- */

static int kx_getname(kx_engine *e, void *buf, size_t *len)
{
    return fi_getname(&e->ep->fid, buf, len);
}

/* insert a peer's endpoint name, checked first (liveness.h: kx_addr_check), and track it */
static int kx_av_insert(kx_engine *e, const void *addr, size_t len, fi_addr_t *out)
{
    int ret = kx_addr_check(e, addr, len);
    if (ret)
        return ret;
    if (!kx_enter(e))
        return -FI_ECANCELED;
    int n = fi_av_insert(e->av, addr, 1, out, 0, NULL);
    ret = n == 1 ? 0 : (n < 0 ? n : -FI_EINVAL);
    if (!ret)
        ret = kx_peer_add(e, *out, addr, len);
    kx_leave(e);
    return ret;
}

/* writes complete once the target placed them (FI_DELIVERY_COMPLETE): a write the target
 * refuses then fails at the sender instead of completing (tcp: the target drops the
 * connection, the write ends with ECANCELED); costs a round trip per write's completion */
static void kx_set_delivery_complete(kx_engine *e, int on)
{
    e->delivery_complete = on;
}

/* how long a peer may leave operations outstanding without completing any (0: forever) */
static void kx_set_peer_timeout(kx_engine *e, int64_t ns)
{
    e->peer_timeout_ns = ns;
}

/* 0, or the errno posts to `peer` fail with now (closed, exited or stalled) */
static int kx_peer_state(kx_engine *e, fi_addr_t peer)
{
    return kx_peer_gone(e, peer);
}

/* forget a peer's address; the caller has made sure nothing to it is still posting
 * (an AV_TABLE index is reused by a later insert) */
static int kx_av_remove(kx_engine *e, fi_addr_t addr)
{
    if (!kx_enter(e))
        return -FI_ECANCELED;
    int ret = fi_av_remove(e->av, &addr, 1, 0);
    if (!ret)
        kx_peer_forget(e, addr);
    kx_leave(e);
    return ret;
}

/* a peer's raw key (FI_MR_RAW providers) becomes a 64-bit key usable in RMA calls */
static int kx_map_raw(kx_engine *e, uint64_t base, uint8_t *raw, size_t rawlen, uint64_t *key)
{
    return fi_mr_map_raw(e->domain, base, raw, rawlen, key, 0);
}

static int kx_unmap_key(kx_engine *e, uint64_t key)
{
    return fi_mr_unmap_key(e->domain, key);
}

static int kx_mr_close(struct fid_mr *mr)
{
    return fi_close(&mr->fid);
}

static const char *kx_prov_name(kx_engine *e) { return e->info->fabric_attr->prov_name; }
static int kx_addr_is_str(kx_engine *e) { return e->info->addr_format == FI_ADDR_STR; }
static const char *kx_fabric_name(kx_engine *e) { return e->info->fabric_attr->name; }
static const char *kx_domain_name(kx_engine *e) { return e->info->domain_attr->name; }
static pid_t kx_thread_tid(kx_engine *e) { return e->tid; }
static int kx_leaked(kx_engine *e) { return e->leaked; }
static uint32_t kx_runtime_version(void) { return fi_version(); }
static uint32_t kx_build_version(void) { return KX_FI_BUILD_VERSION; }
static int kx_have_dmabuf(void) { return KX_HAVE_DMABUF; }

#endif
