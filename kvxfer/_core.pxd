# The only C declarations in kvxfer: include/kvxfer/kvxfer.h (the native engine's public
# API, which alone talks to libfabric), in header order, plus the few libfabric names the
# handles need. Everything is declared nogil: no native function touches Python.
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t

cdef extern from "rdma/fabric.h" nogil:
    ctypedef uint64_t fi_addr_t
    const char *fi_strerror(int errnum)
    uint64_t FI_MR_LOCAL, FI_MR_VIRT_ADDR, FI_MR_ALLOCATED, FI_MR_PROV_KEY, FI_MR_ENDPOINT, FI_MR_RAW
    uint64_t FI_RMA_EVENT, FI_HMEM
    int FI_EAGAIN
    int FI_EINVAL
    int FI_EBUSY
    int FI_ECANCELED

cdef extern from "rdma/fi_domain.h" nogil:
    struct fid_mr:
        pass
    enum fi_hmem_iface:
        FI_HMEM_SYSTEM
        FI_HMEM_CUDA

cdef extern from "kvxfer/kvxfer.h" nogil:
    int KX_MAX_IOV
    int KX_MSG_MAX

    ctypedef struct kx_rail:
        pass
    ctypedef struct kx_transfer:
        pass
    ctypedef struct kx_counter:
        pass
    ctypedef struct kx_msg:
        pass
    ctypedef struct kx_watcher:
        pass
    ctypedef struct kx_watch:
        pass
    ctypedef struct kx_direct:
        pass

    ctypedef struct kx_rail_info:
        const char *provider
        const char *fabric
        const char *domain
        uint64_t mr_mode
        uint64_t caps
        size_t iov_limit
        size_t max_msg_size
        size_t inject_size
        size_t cq_data_size
        int need_ctx
        int has_wait
        int addr_is_str

    ctypedef struct kx_rail_stats:
        uint64_t writes_posted
        uint64_t direct_writes
        uint64_t direct_revoked
        uint64_t bell_rings
        uint64_t bell_wakes
        uint64_t dead_answered
        uint64_t errors
        int64_t outstanding
        uint64_t drives
        uint64_t drives_got
        uint64_t naps
        uint64_t armed

    ctypedef struct kx_transfer_state:
        int64_t planned
        int64_t posted
        int64_t completed
        int posting_done
        int done
        int error
        int linked

    ctypedef struct kx_counter_state:
        uint32_t imm
        uint64_t count
        uint64_t arrived
        int64_t done_ns
        int done
        int error

    # rails: life cycle
    int kx_rail_open(const char *prov, const char *node, const char *domain, int hmem, int spin,
                     kx_rail *join, kx_rail **out, char *errcall, size_t errcall_len)
    int kx_rail_start(kx_rail *r, const int *cpus, int ncpus)
    int kx_rail_drain(kx_rail *r, int64_t timeout_ns, int64_t quiet_ns)
    void kx_rail_park(kx_rail *r)
    int kx_rail_parked(const kx_rail *r)
    int kx_rail_took_traffic(const kx_rail *r)
    void kx_rail_quiesce(kx_rail *r)
    void kx_rail_close_endpoint(kx_rail *r)
    void kx_rail_close_domain(kx_rail *r)
    void kx_rail_free(kx_rail *r)
    int kx_rail_leaked(const kx_rail *r)
    void kx_rail_get_info(const kx_rail *r, kx_rail_info *out)
    void kx_rail_get_stats(const kx_rail *r, kx_rail_stats *out)
    int kx_rail_thread_id(const kx_rail *r)
    int kx_rail_set_progress_rt(kx_rail *r, int priority)
    int kx_rail_progress_rt(const kx_rail *r, int *err)

    # peers and addresses
    int kx_getname(kx_rail *r, void *buf, size_t *len)
    int kx_av_insert(kx_rail *r, const void *addr, size_t len, fi_addr_t *out, uint32_t *gen)
    void kx_set_peer_timeout(kx_rail *r, int64_t ns)
    void kx_set_delivery_complete(kx_rail *r, int on)
    int kx_peer_state(kx_rail *r, fi_addr_t peer)
    int kx_av_remove(kx_rail *r, fi_addr_t addr, uint32_t gen, int64_t wait_ns)

    # regions
    int KX_REMOTE_WRITE, KX_REMOTE_READ
    int kx_mr_reg(kx_rail *r, void *buf, size_t len, int iface, int device, int dmabuf_fd, int remote,
                  fid_mr **mr, uint64_t *key, void **desc, uint8_t *raw, size_t *rawlen,
                  uint64_t *raw_base, const char **call)
    int kx_mr_close(fid_mr *mr)
    int kx_map_raw(kx_rail *r, uint64_t base, uint8_t *raw, size_t rawlen, uint64_t *key)
    int kx_unmap_key(kx_rail *r, uint64_t key)

    # direct writes
    int kx_direct_open(const char *path, uint64_t dev, uint64_t ino, uint64_t offset, uint64_t len,
                       kx_direct **out)
    char *kx_direct_base(const kx_direct *d)
    void kx_direct_unref(kx_direct *d)
    enum: KX_OWNER_BYTES
    int kx_direct_permit(kx_direct *d, const char *path, uint64_t dev, uint64_t ino, uint32_t slot, uint32_t gen,
                        const uint8_t *owner)
    int kx_permit_table_open(size_t slots, const uint8_t *owner, int *fd, uint64_t **words)
    void kx_permit_table_close(int fd, uint64_t *words, size_t slots)
    uint32_t kx_permit_issue(uint64_t *words, size_t slots, size_t slot, uint64_t dev, uint64_t ino, uint64_t offset,
                            uint64_t len)
    uint32_t kx_permit_revoke(uint64_t *word, int64_t wait_ns)
    int kx_permit_retire(uint64_t *word)

    # writes
    int64_t kx_count_messages(const uint64_t *src_off, const uint64_t *dst_off, const uint64_t *length,
                              size_t n, size_t iov, uint64_t max_write, uint64_t pack_min)
    int kx_write(kx_rail *r, fi_addr_t peer, uint32_t gen, char *src_base, void *desc, uint64_t dst_base, uint64_t key,
                 kx_direct *direct, const uint64_t *src_off, const uint64_t *dst_off, const uint64_t *length, size_t n,
                 int has_imm, uint32_t imm, size_t iov, uint64_t max_write, uint64_t pack_min,
                 kx_transfer **out)
    void kx_posting_begin(kx_rail *r) nogil
    void kx_posting_end(kx_rail *r) nogil
    void kx_transfer_get_state(const kx_transfer *x, kx_transfer_state *out)
    int kx_transfer_wait(kx_rail *r, kx_transfer *x, int64_t slice_ns)
    void kx_transfer_cancel(kx_rail *r, kx_transfer *x)
    void kx_transfer_release(kx_rail *r, kx_transfer *x)
    int kx_peer_cancel(kx_rail *r, fi_addr_t peer, uint32_t gen)
    int kx_peer_wait(kx_rail *r, fi_addr_t peer, uint32_t gen, int64_t slice_ns, int *posting)

    # reads
    int kx_read(kx_rail *r, fi_addr_t peer, uint32_t gen, char *local_base, void *desc, uint64_t local_len,
                uint64_t remote_base, uint64_t key, uint64_t remote_len, const uint64_t *local_off,
                const uint64_t *remote_off, const uint64_t *length, size_t n, size_t iov, uint64_t max_read,
                kx_transfer **out)

    # counters
    int kx_expect(kx_rail *r, uint32_t imm, uint64_t count, int want_callback, kx_counter **out)
    void kx_counter_get_state(const kx_counter *c, kx_counter_state *out)
    int kx_counter_wait(kx_rail *r, kx_counter *c, int64_t slice_ns)
    int kx_counter_set_callback(kx_rail *r, kx_counter *c)
    void kx_counter_drop(kx_rail *r, kx_counter *c)
    void kx_counter_release(kx_rail *r, kx_counter *c)
    uint64_t kx_banked(kx_rail *r, uint32_t imm)
    uint64_t kx_discard(kx_rail *r, uint32_t imm, kx_counter **withdrawn)
    int kx_next_done(kx_rail *r, int64_t slice_ns, kx_counter **out)
    void kx_dispatch_stop(kx_rail *r)

    # the decoder's ANNOUNCE, armed natively
    ctypedef struct kx_arm:
        pass
    int KX_ARM_OPEN, KX_ARM_ARMED, KX_ARM_CLOSED
    int kx_arm_key(kx_rail *r, const uint8_t *key, size_t len)
    int kx_arm_open(kx_rail *r, uint32_t imm, uint64_t src, uint64_t dst, uint64_t floor, uint64_t least,
                    uint64_t most, kx_arm **out)
    int kx_arm_wait(kx_rail *r, kx_arm *a, int64_t slice_ns)
    int kx_arm_close(kx_rail *r, kx_arm *a, uint64_t max_seq, uint64_t *count, uint64_t *seq, kx_counter **counter)
    void kx_arm_free(kx_rail *r, kx_arm *a)
    int kx_arm_state(const kx_arm *a)
    int kx_arm_waiters(const kx_arm *a)
    void kx_arm_hold(kx_arm *a, int delta)
    int64_t kx_announce_count(const char *data, size_t len, const uint8_t *key, size_t keylen, uint32_t imm,
                              uint64_t src, uint64_t dst, uint64_t floor, uint64_t least, uint64_t most)

    # control messages
    int kx_send(kx_rail *r, fi_addr_t peer, uint32_t gen, const char *data, size_t len)
    int kx_send_try(kx_rail *r, fi_addr_t peer, uint32_t gen, const char *data, size_t len)
    int kx_recv_wait(kx_rail *r, int64_t slice_ns, kx_msg **out)
    size_t kx_msg_len(const kx_msg *m)
    const char *kx_msg_data(const kx_msg *m)
    void kx_msg_free(kx_msg *m)

    # the revoke exchange
    int KX_CTL_HELLO, KX_CTL_REVOKE, KX_CTL_BYE
    int kx_ctl_send(kx_rail *r, fi_addr_t peer, uint32_t gen, int type, uint64_t token, const char *data, size_t len)
    int kx_ctl_take(kx_rail *r, int64_t slice_ns, uint64_t *tokens, size_t max, size_t *n)
    int kx_ctl_hello(kx_rail *r, kx_msg **out)
    uint64_t kx_revoked_count(kx_rail *r)
    void kx_rail_flush(kx_rail *r, int64_t wait_ns)

    # the layer watcher
    int KX_WATCH_ARMED, KX_WATCH_POSTING, KX_WATCH_POSTED, KX_WATCH_DISARMED, KX_WATCH_FAILED
    ctypedef struct kx_watch_state:
        int state
        int error
        uint64_t threshold
        int64_t planned
        int64_t fired_ns
        kx_transfer *transfer
    ctypedef struct kx_watcher_stats:
        size_t armed
        uint64_t fired
        uint64_t wakeups
        int tid
        int rt
    int kx_watcher_open(uint64_t *word, int64_t poll_ns, const int *cpus, int ncpus, int rt_priority,
                        kx_watcher **out)
    uint64_t *kx_watcher_word(kx_watcher *w)
    uint64_t kx_watcher_value(const kx_watcher *w)
    uint64_t kx_watcher_bump(kx_watcher *w, uint64_t n)
    uint64_t kx_watcher_advance(kx_watcher *w, uint64_t to)
    ctypedef struct kx_watch_bounds:
        uint64_t base
        uint64_t src_size
        uint64_t dst_size
        size_t n
    int kx_watch_arm(kx_watcher *w, uint64_t threshold, uint64_t tag, kx_rail *r, fi_addr_t peer, uint32_t gen,
                     char *src_base,
                     void *desc, uint64_t dst_base, uint64_t key, kx_direct *direct, const uint64_t *src_off,
                     const uint64_t *dst_off, const uint64_t *length, size_t n, const kx_watch_bounds *b,
                     int has_imm, uint32_t imm, size_t iov, uint64_t max_write, uint64_t pack_min, kx_watch **out)
    int kx_watch_arm_groups(kx_watcher *w, size_t ng, const uint64_t *thresholds, const int64_t *starts,
                            uint64_t tag, kx_rail *r, fi_addr_t peer, uint32_t gen, char *src_base, void *desc,
                            uint64_t dst_base, uint64_t key, kx_direct *direct, const uint64_t *src_off,
                            const uint64_t *dst_off, const uint64_t *length, const kx_watch_bounds *b, int has_imm,
                            uint32_t imm, size_t iov, uint64_t max_write, uint64_t pack_min, kx_watch **out)
    int64_t kx_watch_planned(const kx_watch *e)
    uint64_t kx_watch_bytes(const kx_watch *e)
    void kx_watch_get_state(kx_watcher *w, const kx_watch *e, kx_watch_state *out)
    int kx_watch_disarm(kx_watcher *w, kx_watch *e)
    size_t kx_watch_disarm_many(kx_watcher *w, kx_watch **es, size_t n, int *disarmed)
    size_t kx_watcher_disarm_tag(kx_watcher *w, uint64_t tag)
    int kx_watch_wait(kx_watcher *w, kx_watch *e, int64_t slice_ns)
    void kx_watch_free(kx_watcher *w, kx_watch *e)
    size_t kx_watcher_latencies(kx_watcher *w, int64_t *call_ns, int64_t *post_ns, size_t max)
    void kx_watcher_get_stats(kx_watcher *w, kx_watcher_stats *out)
    int kx_watcher_close(kx_watcher *w, int64_t timeout_ns)
    void kx_watcher_free(kx_watcher *w)
    void kx_rail_hold_awake(kx_rail *r, int delta)

    # libfabric versions
    uint32_t kx_runtime_version()
    uint32_t kx_build_version()
    int kx_have_dmabuf()
