/* rail.c: a rail's life cycle (open, start, the closing steps), its facts and its AV. */
#include "internal.h"

#include <stdio.h>
#include <unistd.h>

static void kx_rail_init_rx(kx_rail *r, char *slab)
{
    for (int i = 0; i < KX_RX_BUFS; i++) {
        r->rx[i].op.kind = KX_OP_RECV;
        r->rx[i].op.owner = &r->rx[i];
        r->rx[i].data = slab + (size_t)i * KX_MSG_MAX;
    }
}

static struct fi_info *kx_hints(const char *prov, const char *domain, int hmem)
{
    struct fi_info *hints = fi_allocinfo();
    if (!hints)
        return NULL;
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
    return hints;
}

static void kx_rail_take_limits(kx_rail *r)
{
    struct fi_info *fi = r->info;
    r->mr_mode = fi->domain_attr->mr_mode;
    r->caps = fi->caps;
    r->need_ctx = (fi->mode & (FI_CONTEXT | FI_CONTEXT2)) != 0;
    size_t iovl = fi->tx_attr->iov_limit, rl = fi->tx_attr->rma_iov_limit;
    r->iov_limit = iovl < rl ? iovl : rl;
    if (r->iov_limit > KX_MAX_IOV)
        r->iov_limit = KX_MAX_IOV;
    if (r->iov_limit < 1)
        r->iov_limit = 1;
    r->max_msg_size = fi->ep_attr->max_msg_size;
    r->inject_size = fi->tx_attr->inject_size;
    r->cq_data_size = fi->domain_attr->cq_data_size;
}

/* fabric, domain, CQ, AV, endpoint; on failure *call names the libfabric call */
static int kx_rail_open_fids(kx_rail *r, int spin, const char **call)
{
    struct fi_info *fi = r->info;
    int ret;
    if ((ret = fi_fabric(fi->fabric_attr, &r->fabric, NULL))) {
        *call = "fi_fabric";
        return ret;
    }
    if ((ret = fi_domain(r->fabric, fi, &r->domain, NULL))) {
        *call = "fi_domain";
        return ret;
    }
    struct fi_cq_attr cqa;
    memset(&cqa, 0, sizeof(cqa));
    cqa.format = FI_CQ_FORMAT_DATA;
    cqa.size = fi->tx_attr->size + fi->rx_attr->size;
    cqa.wait_obj = spin ? FI_WAIT_NONE : FI_WAIT_FD;   /* a real sleep; WAIT_UNSPEC may pick a yield loop (shm) */
    ret = fi_cq_open(r->domain, &cqa, &r->cq, NULL);
    if (ret && cqa.wait_obj != FI_WAIT_NONE) {
        cqa.wait_obj = FI_WAIT_NONE;
        ret = fi_cq_open(r->domain, &cqa, &r->cq, NULL);
    }
    if (ret) {
        *call = "fi_cq_open";
        return ret;
    }
    r->has_wait = cqa.wait_obj != FI_WAIT_NONE;
    struct fi_av_attr ava;
    memset(&ava, 0, sizeof(ava));
    ava.type = FI_AV_TABLE;
    if ((ret = fi_av_open(r->domain, &ava, &r->av, NULL))) {
        *call = "fi_av_open";
        return ret;
    }
    if ((ret = fi_endpoint(r->domain, fi, &r->ep, NULL))) {
        *call = "fi_endpoint";
        return ret;
    }
    if ((ret = fi_ep_bind(r->ep, &r->cq->fid, FI_TRANSMIT | FI_RECV))) {
        *call = "fi_ep_bind(cq)";
        return ret;
    }
    if ((ret = fi_ep_bind(r->ep, &r->av->fid, 0))) {
        *call = "fi_ep_bind(av)";
        return ret;
    }
    if (strcmp(fi->fabric_attr->prov_name, "shm") == 0)
        kx_shm_clear_stale(r);     /* a dead process's region under our name (names.c) */
    if ((ret = fi_enable(r->ep))) {
        *call = "fi_enable";
        return ret;
    }
    return 0;
}

/* one slab for the posted receive buffers, registered where the provider wants FI_MR_LOCAL */
static int kx_rail_post_receives(kx_rail *r, const char **call)
{
    char *slab = malloc((size_t)KX_RX_BUFS * KX_MSG_MAX);
    if (!slab) {
        *call = "malloc";
        return -FI_ENOMEM;
    }
    kx_rail_init_rx(r, slab);
    int ret;
    if (r->mr_mode & FI_MR_LOCAL) {
        uint64_t key, base;
        uint8_t raw[64];
        size_t rawlen;
        ret = kx_mr_register(r, slab, (size_t)KX_RX_BUFS * KX_MSG_MAX, FI_HMEM_SYSTEM, 0, -1, 0, &r->rx_mr, &key,
                             &r->rx_desc, raw, &rawlen, &base, call);
        if (ret)
            return ret;
    }
    for (int i = 0; i < KX_RX_BUFS; i++) {
        if ((ret = kx_post_recv(r, &r->rx[i]))) {
            *call = "fi_recv";
            return ret;
        }
    }
    return 0;
}

int kx_rail_open(const char *prov, const char *node, const char *domain, int hmem, int spin,
                 kx_rail *join, kx_rail **out, char *errcall, size_t errcall_len)
{
    kx_rail *r = calloc(1, sizeof(*r));
    if (!r)
        return -FI_ENOMEM;
    if (join) {
        r->hub = join->hub;
        pthread_mutex_lock(&r->hub->lock);
        r->hub->refs++;
        pthread_mutex_unlock(&r->hub->lock);
    } else if (!(r->hub = kx_hub_new())) {
        free(r);
        return -FI_ENOMEM;
    }
    pthread_mutex_lock(&r->hub->lock);
    r->hub->open++;
    pthread_mutex_unlock(&r->hub->lock);
    r->spin = spin;
    r->last_activity_ns = kx_now_ns();
    pthread_mutex_init(&r->av_lock, NULL);

    const char *call = "fi_allocinfo";
    int ret = -FI_ENOMEM;
    struct fi_info *hints = kx_hints(prov, domain, hmem);
    if (hints) {
        call = "fi_getinfo";
        ret = fi_getinfo(KX_FI_API_VERSION, node, NULL, node ? FI_SOURCE : 0, hints, &r->info);
        fi_freeinfo(hints);
    }
    if (!ret) {
        kx_rail_take_limits(r);
        ret = kx_rail_open_fids(r, spin, &call);
    }
    if (!ret) {
        r->peer_timeout_ns = 10000000000LL;     /* kx_set_peer_timeout changes it */
        r->pdir = calloc(KX_PEER_CHUNKS, sizeof(*r->pdir));
        call = "kx_local_publish";
        ret = r->pdir ? kx_local_publish(r) : -FI_ENOMEM;
    }
    if (!ret)
        ret = kx_rail_post_receives(r, &call);
    if (ret) {
        snprintf(errcall, errcall_len, "%s", call);
        kx_rail_free(r);
        return ret;
    }
    r->shm = r->info && strcmp(r->info->fabric_attr->prov_name, "shm") == 0;
    kx_unblock_open(r);     /* shm: answers for peers that exited (unblock.c); none is fine */
    kx_bell_create(r);      /* shm: writers wake our progress thread (bell.c); none is fine */
    *out = r;
    return 0;
}

int kx_rail_start(kx_rail *r, const int *cpus, int ncpus)
{
    CPU_ZERO(&r->cpus);
    for (int i = 0; i < ncpus; i++)
        CPU_SET(cpus[i], &r->cpus);
    r->pin = ncpus > 0;
    int ret = pthread_create(&r->thread, NULL, kx_progress_main, r);
    if (ret)
        return -ret;
    pthread_setname_np(r->thread, "kvxfer-progress");
    r->thread_started = 1;
    kx_progress_rt_await(r);     /* progress_rt_priority: its outcome is known when start returns */
    return 0;
}

/* Cancel what is still queued and give the operations already posted up to `timeout_ns` to
 * complete, with the progress thread still running. A peer then never sees an endpoint
 * vanish under commands it is processing (shm crashed in libfabric 1.17 when a peer closed
 * with writes in flight). A dead peer only costs the deadline. */
int kx_rail_drain(kx_rail *r, int64_t timeout_ns, int64_t quiet_ns)
{
    if (r->quiesced || !r->thread_started)
        return 1;
    pthread_mutex_lock(&r->hub->lock);
    for (kx_transfer *x = r->q_head; x; x = x->qnext)
        __atomic_store_n(&x->cancel, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&r->hub->lock);
    kx_wake(r);
    int64_t until = kx_now_ns() + timeout_ns;
    while (kx_now_ns() < until) {
        /* done when nothing of ours is pending (to live peers) and incoming traffic has been
         * quiet for quiet_ns (rxm in 1.17 crashed closing an endpoint a peer had just written to) */
        if (kx_outstanding_live(r) <= 0 && r->q_head == NULL &&
            kx_now_ns() - r->last_activity_ns > quiet_ns)
            return 1;
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
    return 0;
}

/* No thread uses the endpoint afterwards: set stop, wait (5 s at most) for callers inside
 * native calls to leave, then join the progress thread (5 s deadline). */
void kx_rail_quiesce(kx_rail *r)
{
    if (r->quiesced)
        return;
    r->quiesced = 1;
    kx_local_retire(r);      /* rails of this process stop posting to us first */
    kx_bell_remove(r);       /* and no new writer finds our bell */
    __atomic_store_n(&r->stop, 1, __ATOMIC_SEQ_CST);
    int64_t until = kx_now_ns() + 5000000000LL;
    for (;;) {      /* a late kx_enter may bump busy briefly and back off: not a leak */
        if (__atomic_load_n(&r->busy, __ATOMIC_SEQ_CST) == 0)
            break;
        if (kx_now_ns() >= until) {
            r->leaked = 1;
            break;
        }
        sched_yield();
    }
    if (!r->thread_started) {
        if (!r->leaked)
            kx_local_release(r);
        return;
    }
    if (r->has_wait && r->cq)
        fi_cq_signal(r->cq);
    kx_bell_poke(r->bell);
    pthread_mutex_lock(&r->hub->lock);
    pthread_cond_broadcast(&r->hub->cond);
    pthread_cond_broadcast(&r->hub->msg_cond);     /* a reader of messages sees stop */
    pthread_mutex_unlock(&r->hub->lock);
    /* join within 5 s; a thread spinning in shm on the lock of a peer that died holding it is
     * freed by releasing that lock (shmlock.c, kx_peers_unstick) */
    int joined = 0;
    for (int step = 0; step < 100 && !joined; step++) {
        struct timespec ts;
        kx_deadline_on(CLOCK_REALTIME, &ts, 50000000LL);
        joined = pthread_timedjoin_np(r->thread, NULL, &ts) == 0;
        if (!joined && step >= 1)
            kx_peers_unstick(r);
    }
    if (!joined) {
        pthread_detach(r->thread);
        r->leaked = 1;   /* stuck in the provider: leak everything it may touch */
    }
    r->thread_started = 0;
    if (!r->leaked)
        kx_local_release(r);     /* it reads no other engine's region any more */
}

/* a thread may still be inside libfabric: close nothing, free nothing, but let no waiter
 * hang: pending transfers and counters fail now */
static void kx_rail_abandon(kx_rail *r)
{
    kx_hub *h = r->hub;
    if (r->parked)
        kx_peers_free(r);
    pthread_mutex_lock(&h->lock);
    for (kx_transfer *x = r->inflight; x; x = x->next) {
        if (!x->error)
            x->error = FI_ECANCELED;
        x->done = 1;
    }
    if (--h->open == 0) {
        kx_hub_fail_counters_locked(h, FI_ECANCELED, 0);
        kx_arm_clear_locked(h);
    }
    h->dispatch_stop = 1;
    pthread_cond_broadcast(&h->cond);
    pthread_cond_broadcast(&h->msg_cond);
    pthread_mutex_unlock(&h->lock);
}

/* The endpoint's fids and what the provider may still write into (the receive slab). */
static void kx_rail_close_fids(kx_rail *r)
{
    if (r->ep) { fi_close(&r->ep->fid); r->ep = NULL; }
    kx_peers_free(r);
    if (r->rx_mr) { fi_close(&r->rx_mr->fid); r->rx_mr = NULL; }
    if (r->av) { fi_close(&r->av->fid); r->av = NULL; }
    if (r->cq) { fi_close(&r->cq->fid); r->cq = NULL; }
    if (r->rx[0].data) { free(r->rx[0].data); r->rx[0].data = NULL; }
}

/* Pending transfers and counters fail; the hub's shared state goes with its last rail. */
static void kx_rail_settle(kx_rail *r)
{
    kx_hub *h = r->hub;
    pthread_mutex_lock(&h->lock);
    r->q_head = r->q_tail = NULL;
    while (r->inflight) {
        kx_transfer *x = r->inflight;
        if (!x->error)
            x->error = FI_ECANCELED;
        x->posting_done = 1;
        x->completed = x->posted;
        kx_transfer_check_done_locked(r, x);
    }
    if (--h->open == 0) {            /* the last rail: the shared state goes too */
        kx_hub_fail_counters_locked(h, FI_ECANCELED, 1);
        kx_arm_clear_locked(h);
        kx_hub_clear_queues_locked(h);
    }
    pthread_cond_broadcast(&h->cond);
    pthread_cond_broadcast(&h->msg_cond);
    pthread_mutex_unlock(&h->lock);
}

static void kx_rail_close_domain_fids(kx_rail *r)
{
    if (r->domain) { fi_close(&r->domain->fid); r->domain = NULL; }
    if (r->fabric) { fi_close(&r->fabric->fid); r->fabric = NULL; }
    if (r->info) { fi_freeinfo(r->info); r->info = NULL; }
}

/* shm endpoints of one process reach each other's regions through a pointer: libfabric 1.17
 * crashed (SIGSEGV in fi_cq_read, 8 of 20 runs of the `cancel_first_same` scenario) when an
 * engine closed while another engine of the process, linked to it, still progressed. So a
 * closing shm rail whose region another unquiesced rail of the process may read (local.c,
 * kx_local_link) is quiesced and settled at once but keeps its fids; the rail that drops the
 * last such hold (by quiescing or by removing it from its AV) closes them. Cross-process
 * peers map regions of their own and are never deferred. */
void kx_rail_finish_deferred(kx_rail *r)
{
    kx_rail_close_fids(r);
    /* the rail stays deferred until its domain is closed too, so an owner closing or
     * freeing it meanwhile leaves both to us (no double fi_close, no free under our feet) */
    if (!kx_local_deferred_done(r))
        return;
    kx_rail_close_domain_fids(r);
    if (kx_local_deferred_end(r)) {
        kx_bell_free(r);
        kx_unblock_close(r);
        kx_hub_unref(r->hub);
        free(r);
    }
}

void kx_rail_close_endpoint(kx_rail *r)
{
    if (r->endpoint_closed)
        return;
    kx_rail_quiesce(r);
    r->endpoint_closed = 1;
    if (r->leaked || r->parked) {
        kx_rail_abandon(r);
        return;
    }
    int deferred = kx_local_defer(r);
    if (deferred) {
        kx_rail_settle(r);
        /* its holders were asked to drop it (forget.c): their progress does so within a
         * pass or two, and the last one closes its fids; wait for that, bounded */
        if (deferred == 2)
            kx_local_deferred_wait(r, KX_FORGET_WAIT_NS);
        return;
    }
    kx_rail_close_fids(r);
    /* domain and fabric stay open until kx_rail_close_domain: registrations go first,
     * after the endpoint (rxm's endpoint close still touches the descriptors of what it
     * cancels), and a domain with registrations refuses to close */
    kx_rail_settle(r);
}

void kx_rail_close_domain(kx_rail *r)
{
    kx_rail_close_endpoint(r);
    if (r->leaked || r->parked || kx_local_still_deferred(r, 0))
        return;
    kx_rail_close_domain_fids(r);
}

void kx_rail_free(kx_rail *r)
{
    kx_rail_close_domain(r);
    if (r->leaked || r->parked || kx_local_still_deferred(r, 1))
        return;
    if (r->pdir)      /* a rail that failed to open before its endpoint existed */
        kx_peers_free(r);
    kx_bell_free(r);
    kx_unblock_close(r);
    kx_ctl_rail_free(r);
    kx_hub_unref(r->hub);
    free(r);
}

int kx_rail_leaked(const kx_rail *r) { return r->leaked; }

void kx_rail_get_info(const kx_rail *r, kx_rail_info *out)
{
    out->provider = r->info->fabric_attr->prov_name;
    out->fabric = r->info->fabric_attr->name;
    out->domain = r->info->domain_attr->name;
    out->mr_mode = r->mr_mode;
    out->caps = r->caps;
    out->iov_limit = r->iov_limit;
    out->max_msg_size = r->max_msg_size;
    out->inject_size = r->inject_size;
    out->cq_data_size = r->cq_data_size;
    out->need_ctx = r->need_ctx;
    out->has_wait = r->has_wait;
    out->addr_is_str = r->info->addr_format == FI_ADDR_STR;
}

void kx_rail_get_stats(const kx_rail *r, kx_rail_stats *out)
{
    out->writes_posted = __atomic_load_n(&r->stat_writes, __ATOMIC_RELAXED);
    out->direct_writes = __atomic_load_n(&r->stat_direct, __ATOMIC_RELAXED);
    out->direct_revoked = __atomic_load_n(&r->stat_direct_revoked, __ATOMIC_RELAXED);
    out->bell_rings = __atomic_load_n(&r->stat_bell_rings, __ATOMIC_RELAXED);
    out->bell_wakes = __atomic_load_n(&r->stat_bell_wakes, __ATOMIC_RELAXED);
    out->dead_answered = kx_unblock_answered(r);
    out->errors = __atomic_load_n(&r->stat_rx_err, __ATOMIC_RELAXED);
    out->outstanding = __atomic_load_n(&r->outstanding, __ATOMIC_RELAXED);
    out->drives = __atomic_load_n(&r->stat_drives, __ATOMIC_RELAXED);
    out->drives_got = __atomic_load_n(&r->stat_drives_got, __ATOMIC_RELAXED);
    out->naps = __atomic_load_n(&r->stat_naps, __ATOMIC_RELAXED);
    out->armed = __atomic_load_n(&r->hub->stat_armed, __ATOMIC_RELAXED);
}

int kx_rail_thread_id(const kx_rail *r) { return (int)r->tid; }

int kx_getname(kx_rail *r, void *buf, size_t *len)
{
    if (!kx_enter(r))
        return -FI_ECANCELED;
    int ret = fi_getname(&r->ep->fid, buf, len);
    kx_leave(r);
    return ret;
}

/* a shm name of this process: its engine's open cell, entered (busy: its owner does not close
 * its endpoint before kx_local_exit), or NULL for an engine that closed. shm 1.17 crashes
 * (SIGSEGV inside fi_av_insert) inserting the name of a closed endpoint of its own process */
static kx_local *kx_local_enter(const void *addr, size_t len)
{
    kx_local *c = kx_local_find(addr, len);
    if (!c)
        return NULL;
    __atomic_add_fetch(&c->busy, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&c->closed, __ATOMIC_SEQ_CST)) {
        __atomic_sub_fetch(&c->busy, 1, __ATOMIC_SEQ_CST);
        kx_local_unref(c);
        return NULL;
    }
    return c;
}

static void kx_local_exit(kx_local *c)
{
    if (!c)
        return;
    __atomic_sub_fetch(&c->busy, 1, __ATOMIC_SEQ_CST);
    kx_local_unref(c);
}

/* insert a peer's endpoint name, checked first (names.c: kx_addr_check), and track it; a shm
 * name of an engine of this process that closed is refused (-FI_ECONNREFUSED) */
int kx_av_insert(kx_rail *r, const void *addr, size_t len, fi_addr_t *out, uint32_t *gen)
{
    int ret = kx_addr_check(r, addr, len);
    if (ret)
        return ret;
    if (!kx_enter(r))
        return -FI_ECANCELED;
    kx_local *self = NULL;
    if (kx_shm_pid(r->info->fabric_attr->prov_name, addr, len) == getpid()) {
        self = kx_local_enter(addr, len);
        if (!self) {
            kx_leave(r);
            return -FI_ECONNREFUSED;
        }
    }
    pthread_mutex_lock(&r->av_lock);
    int n = fi_av_insert(r->av, addr, 1, out, 0, NULL);
    ret = n == 1 ? 0 : (n < 0 ? n : -FI_EINVAL);
    if (!ret)
        ret = kx_peer_add(r, *out, addr, len);
    pthread_mutex_unlock(&r->av_lock);
    kx_local_exit(self);
    *gen = ret ? 0 : kx_peer_gen(r, *out);
    kx_leave(r);
    return ret;
}

void kx_set_peer_timeout(kx_rail *r, int64_t ns) { r->peer_timeout_ns = ns; }
void kx_set_delivery_complete(kx_rail *r, int on) { r->delivery_complete = on; }
int kx_peer_state(kx_rail *r, fi_addr_t peer) { return kx_peer_gone(r, peer); }

/* Leave the endpoint open when the rail closes: its fids are never closed, nothing progresses
 * it again (both providers progress manually, so no data is placed any more), its memory and
 * sockets stay until the process exits. kvxfer's defence against libfabric 1.17's rxm
 * crashing inside fi_close of an endpoint peers were writing to (docs/reliability.md). */
void kx_rail_park(kx_rail *r) { r->parked = 1; }
int kx_rail_parked(const kx_rail *r) { return r->parked; }
int kx_rail_took_traffic(const kx_rail *r) { return r->hub->stat_imm > 0 || r->took_msgs; }

/* `gen` (0: unchecked): the slot's generation the caller inserted; a slot removed since (by
 * forget.c, when its same-process peer closed) or reused by another peer is left alone: 0 */
int kx_av_remove(kx_rail *r, fi_addr_t addr, uint32_t gen, int64_t wait_ns)
{
    if (!kx_enter(r))
        return -FI_ECANCELED;
    pthread_mutex_lock(&r->av_lock);
    kx_peer *p = kx_peer_get(r, addr);
    int ret = 0;
    if (p && (p->removed || (gen && __atomic_load_n(&p->gen, __ATOMIC_SEQ_CST) != gen)))
        goto out;
    ret = kx_peer_retire(r, addr, wait_ns);
    if (ret)
        goto out;
    /* shm 1.17 leaves the slot's peer id and name_sent in our region: the next peer put in
     * the slot would get commands naming the old one's id (forget.c, (5)) */
    int slot = r->shm ? kx_forget_slot_of(r, addr) : -1;
    ret = kx_unblock_settle(r, addr, wait_ns);     /* shm's completion of an answered slot reads the peer's region */
    if (ret)
        goto out;
    ret = fi_av_remove(r->av, &addr, 1, 0);
    if (!ret) {
        kx_forget_slot_clear(r, slot);
        kx_peer_forget(r, addr);
    }
out:
    pthread_mutex_unlock(&r->av_lock);
    kx_leave(r);
    return ret;
}

uint32_t kx_runtime_version(void) { return fi_version(); }
uint32_t kx_build_version(void) { return KX_FI_BUILD_VERSION; }
int kx_have_dmabuf(void) { return KX_HAVE_DMABUF; }

/* Incoming data is expected soon (a streamed request): the progress thread keeps polling
 * (sched_yield between empty reads) while holds are taken, as if its own operations were
 * outstanding, instead of sleeping in its back-off; it still backs off after 200 ms of
 * silence. Costs a core while held; lowers the landing latency of each layer. */
void kx_rail_hold_awake(kx_rail *r, int delta)
{
    __atomic_add_fetch(&r->awake, delta, __ATOMIC_SEQ_CST);
    if (delta > 0)
        kx_wake(r);
}
