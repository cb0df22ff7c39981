# The only C declarations in kvxfer: the native engine in include/kvxfer/engine.h (which
# alone talks to libfabric), plus the few libfabric names the handles need, in header order.
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t

cdef extern from "rdma/fabric.h" nogil:
    ctypedef uint64_t fi_addr_t
    const char *fi_strerror(int errnum)
    uint64_t FI_MR_LOCAL, FI_MR_VIRT_ADDR, FI_MR_ALLOCATED, FI_MR_PROV_KEY, FI_MR_ENDPOINT, FI_MR_RAW
    uint64_t FI_RMA_EVENT, FI_HMEM
    int FI_MAJOR_VERSION, FI_MINOR_VERSION
    int FI_EAGAIN
    int FI_EINVAL

cdef extern from "rdma/fi_domain.h" nogil:
    struct fid_mr:
        pass
    enum fi_hmem_iface:
        FI_HMEM_SYSTEM
        FI_HMEM_CUDA

cdef extern from "kvxfer/engine.h" nogil:
    ctypedef struct kx_xfer:
        int64_t planned
        int64_t posted
        int64_t completed
        int posting_done
        int done
        int linked
        int error
    ctypedef struct kx_counter:
        uint32_t imm
        uint64_t count
        uint64_t arrived
        int done
        int error
    ctypedef struct kx_msg:
        size_t len
        char *data
    ctypedef struct kx_engine:
        int parked
        uint64_t mr_mode
        uint64_t caps
        size_t iov_limit
        size_t max_msg_size
        size_t inject_size
        size_t cq_data_size
        int need_ctx
        int has_wait
        int64_t outstanding
        uint64_t stat_rx_err
        uint64_t stat_writes

    int KX_MSG_MAX
    int KX_MAX_IOV

    int kx_engine_open(const char *prov, const char *node, const char *domain, int hmem, int spin,
                       kx_engine *join, kx_engine **out, char *errcall, size_t errcall_len)
    int kx_thread_tid(kx_engine *e)
    int kx_leaked(kx_engine *e)
    int kx_engine_start(kx_engine *e, const int *cpus, int ncpus)
    void kx_engine_park(kx_engine *e)
    int kx_engine_took_traffic(kx_engine *e)
    int kx_engine_drain(kx_engine *e, int64_t timeout_ns, int64_t quiet_ns)
    void kx_engine_quiesce(kx_engine *e)
    void kx_engine_teardown(kx_engine *e)
    void kx_engine_close_domain(kx_engine *e)
    void kx_engine_free(kx_engine *e)

    int kx_mr_reg_user(kx_engine *e, void *buf, size_t len, int iface, int device, int dmabuf_fd, int remote,
                       fid_mr **mr, uint64_t *key, void **desc, uint8_t *raw, size_t *rawlen,
                       uint64_t *raw_base, const char **call)
    int kx_mr_close(fid_mr *mr)
    int kx_getname(kx_engine *e, void *buf, size_t *len)
    int kx_av_insert(kx_engine *e, const void *addr, size_t len, fi_addr_t *out)
    void kx_set_peer_timeout(kx_engine *e, int64_t ns)
    void kx_set_delivery_complete(kx_engine *e, int on)
    int kx_peer_state(kx_engine *e, fi_addr_t peer)
    int kx_map_raw(kx_engine *e, uint64_t base, uint8_t *raw, size_t rawlen, uint64_t *key)
    int kx_unmap_key(kx_engine *e, uint64_t key)

    int64_t kx_walk(const uint64_t *so, const uint64_t *dof, const uint64_t *ln, size_t n,
                    size_t iov, uint64_t max_write, uint64_t pack_min)
    kx_xfer *kx_write(kx_engine *e, fi_addr_t peer, char *src_base, void *desc,
                      uint64_t dst_base, uint64_t key,
                      const uint64_t *so, const uint64_t *dof, const uint64_t *ln, size_t n,
                      int has_imm, uint32_t imm, size_t iov, uint64_t max_write, uint64_t pack_min)
    int kx_wait_done(kx_engine *e, const int *done, int64_t slice_ns)
    void kx_xfer_drop(kx_engine *e, kx_xfer *x)
    void kx_xfer_cancel(kx_engine *e, kx_xfer *x)
    int kx_peer_cancel(kx_engine *e, fi_addr_t peer)
    int kx_peer_wait(kx_engine *e, fi_addr_t peer, int64_t slice_ns, int *posting)
    int kx_av_remove(kx_engine *e, fi_addr_t addr)

    int kx_expect(kx_engine *e, uint32_t imm, uint64_t count, int want_callback, kx_counter **out)
    void kx_counter_drop(kx_engine *e, kx_counter *c)
    void kx_counter_unref(kx_engine *e, kx_counter *c)
    uint64_t kx_banked(kx_engine *e, uint32_t imm)
    uint64_t kx_discard(kx_engine *e, uint32_t imm, kx_counter **withdrawn)
    int kx_next_done(kx_engine *e, int64_t slice_ns, kx_counter **out)
    void kx_dispatch_stop(kx_engine *e)

    int kx_send(kx_engine *e, fi_addr_t peer, const char *data, size_t len)
    int kx_recv_wait(kx_engine *e, int64_t slice_ns, kx_msg **out)

    const char *kx_prov_name(kx_engine *e)
    int kx_addr_is_str(kx_engine *e)
    const char *kx_fabric_name(kx_engine *e)
    const char *kx_domain_name(kx_engine *e)
    uint32_t kx_runtime_version()
    uint32_t kx_build_version()
    int kx_have_dmabuf()
