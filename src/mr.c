/* mr.c: memory registration and remote keys. */
#include "internal.h"

#include <sys/random.h>

/* Requested keys are random: where the provider does not choose keys (tcp, shm), a key is
 * all a peer needs to write into a region, so a peer given one region must not be able to
 * guess the key of another. */
static uint64_t kx_random_key(kx_rail *r)
{
    uint64_t k = 0;
    if (getrandom(&k, sizeof(k), 0) != (ssize_t)sizeof(k)) {
        pthread_mutex_lock(&r->hub->lock);
        k = (r->next_key++) * 0x9E3779B97F4A7C15ULL ^ (uint64_t)kx_now_ns();
        pthread_mutex_unlock(&r->hub->lock);
    }
    return k ? k : 1;
}

int kx_mr_register(kx_rail *r, void *buf, size_t len, int iface, int device, int dmabuf_fd, int remote,
                   struct fid_mr **mr, uint64_t *key, void **desc, uint8_t *raw, size_t *rawlen,
                   uint64_t *raw_base, const char **call)
{
    struct iovec iov = {buf, len};
    struct fi_mr_attr attr;
    memset(&attr, 0, sizeof(attr));
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    /* what peers may do to it: write (KX_REMOTE_WRITE), read (KX_REMOTE_READ), both, neither */
    attr.access = FI_READ | FI_WRITE | FI_SEND | FI_RECV | ((remote & KX_REMOTE_WRITE) ? FI_REMOTE_WRITE : 0) |
                  ((remote & KX_REMOTE_READ) ? FI_REMOTE_READ : 0);
    attr.requested_key = (r->mr_mode & FI_MR_PROV_KEY) ? 0 : kx_random_key(r);
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
    int ret = fi_mr_regattr(r->domain, &attr, flags, mr);
    if (ret)
        return ret;
    if (r->mr_mode & FI_MR_ENDPOINT) {
        *call = "fi_mr_bind";
        ret = fi_mr_bind(*mr, &r->ep->fid, 0);
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
    *raw_base = 0;
    if (r->mr_mode & FI_MR_RAW) {
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

int kx_mr_reg(kx_rail *r, void *buf, size_t len, int iface, int device, int dmabuf_fd, int remote,
              struct fid_mr **mr, uint64_t *key, void **desc, uint8_t *raw, size_t *rawlen,
              uint64_t *raw_base, const char **call)
{
    if (!kx_enter(r)) {          /* refused once the rail is closing */
        *call = "fi_mr_regattr";
        return -FI_ECANCELED;
    }
    int ret = kx_mr_register(r, buf, len, iface, device, dmabuf_fd, remote, mr, key, desc, raw, rawlen,
                             raw_base, call);
    kx_leave(r);
    return ret;
}

int kx_mr_close(struct fid_mr *mr)
{
    return fi_close(&mr->fid);
}

int kx_map_raw(kx_rail *r, uint64_t base, uint8_t *raw, size_t rawlen, uint64_t *key)
{
    if (!kx_enter(r))
        return -FI_ECANCELED;
    int ret = fi_mr_map_raw(r->domain, base, raw, rawlen, key, 0);
    kx_leave(r);
    return ret;
}

int kx_unmap_key(kx_rail *r, uint64_t key)
{
    return fi_mr_unmap_key(r->domain, key);
}
