/* names.c: endpoint names: the pid in a shm endpoint's name, its files in /dev/shm, and the
 * check of a peer's name before libfabric's address vector sees it. */

#include <fcntl.h>
#include <stdio.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <unistd.h>

#include "internal.h"

/* shm names its endpoints "fi_shm://<pid>:..." when kvxfer lets it choose (it always does) */
pid_t kx_shm_pid(const char *prov, const void *name, size_t len)
{
    if (!prov || strcmp(prov, "shm") != 0 || len < 10 || memcmp(name, "fi_shm://", 9) != 0)
        return 0;
    const char *s = (const char *)name + 9;
    long pid = 0;
    size_t i = 9;
    while (i < len && *s >= '0' && *s <= '9' && pid < 0x7fffffff) {
        pid = pid * 10 + (*s - '0');
        s++;
        i++;
    }
    return (i < len && *s == ':') ? (pid_t)pid : 0;
}

/* "/dev/shm/<name><suffix>" for a shm endpoint name "fi_shm://<name>" (shm's region is the
 * file with no suffix, kvxfer's doorbell the one with ".kxbell"): 0, or -1 if not one */
int kx_shm_path(const void *name, size_t len, const char *suffix, char *path, size_t size)
{
    if (len < 10 || memcmp(name, "fi_shm://", 9) != 0)
        return -1;
    const char *n = (const char *)name + 9;
    size_t nl = strnlen(n, len - 9);
    if (nl == 0 || nl > 200 || memchr(n, '/', nl))
        return -1;
    snprintf(path, size, "/dev/shm/%.*s%s", (int)nl, n, suffix);
    return 0;
}

/* This process's own shm region, the file of endpoint `name`, opened read-write for a unit
 * that reads its layout (forget.c, unblock.c): the fd, or -1 when `prov` is not shm, the
 * region is not this process's, the environment variable `knob` is "0", or it cannot open */
int kx_shm_open_own(const char *prov, const void *name, size_t len, const char *knob)
{
    const char *k = knob ? getenv(knob) : NULL;
    if (!prov || strcmp(prov, "shm") != 0 || kx_shm_pid(prov, name, len) != getpid() || (k && strcmp(k, "0") == 0))
        return -1;
    char path[300];
    if (kx_shm_path(name, len, "", path, sizeof(path)))
        return -1;
    return open(path, O_RDWR | O_CLOEXEC);
}

/* The endpoint's name, NUL-terminated in `name` (of `size` bytes), its length in *len: 0, or
 * -1 if it has none or it does not fit (shm names are short strings) */
int kx_ep_name(kx_rail *r, char *name, size_t size, size_t *len)
{
    *len = size - 1;
    if (fi_getname(&r->ep->fid, name, len) || *len >= size)
        return -1;
    name[*len] = '\0';
    return 0;
}

/* Before fi_enable of a shm endpoint: shm names its region /dev/shm/<pid>:<n>:<m> and refuses
 * to enable (EBUSY) when the file exists. A file with our own pid that no open engine of
 * this process owns was left by a dead process that had our pid (a crash or a SIGKILL leaves
 * its region, and pids come round again): remove it, and its doorbell. */
void kx_shm_clear_stale(kx_rail *r)
{
    char name[256];
    size_t len;
    if (kx_ep_name(r, name, sizeof(name), &len))
        return;
    if (kx_shm_pid(r->info->fabric_attr->prov_name, name, len) != getpid())
        return;
    kx_local *mine = kx_local_find(name, len);
    if (mine) {                  /* ours and open: not stale (shm numbers endpoints, so never) */
        kx_local_unref(mine);
        return;
    }
    char path[300];
    if (kx_shm_path(name, len, "", path, sizeof(path)) == 0 && unlink(path) == 0 &&
        kx_shm_path(name, len, ".kxbell", path, sizeof(path)) == 0)
        unlink(path);
}

/* Reject an endpoint name the provider would choke on before fi_av_insert sees it:
 * libfabric 1.17's IP address vector fails an insert whose sockaddr family it does not
 * know and then refuses every later insert (tcp: one bad address disabled connect() for
 * good). Returns 0 or -FI_EINVAL. */
int kx_addr_check(kx_rail *r, const void *addr, size_t len)
{
    uint32_t fmt = r->info->addr_format;
    if (fmt == FI_ADDR_STR) {
        const char *s = addr;
        return (len > 0 && len <= 256 && s[len - 1] == '\0' && memchr(s, '\0', len) == s + len - 1) ? 0 : -FI_EINVAL;
    }
    if (fmt == FI_SOCKADDR_IN || fmt == FI_SOCKADDR_IN6 || fmt == FI_SOCKADDR) {
        if (len < sizeof(sa_family_t))
            return -FI_EINVAL;
        sa_family_t fam;
        memcpy(&fam, addr, sizeof(fam));
        if (fam == AF_INET && len == sizeof(struct sockaddr_in) && fmt != FI_SOCKADDR_IN6) {
            struct sockaddr_in sin;
            memcpy(&sin, addr, sizeof(sin));
            return (sin.sin_port && sin.sin_addr.s_addr != htonl(INADDR_ANY)) ? 0 : -FI_EINVAL;
        }
        if (fam == AF_INET6 && len == sizeof(struct sockaddr_in6) && fmt != FI_SOCKADDR_IN) {
            struct sockaddr_in6 sin6;
            memcpy(&sin6, addr, sizeof(sin6));
            return sin6.sin6_port ? 0 : -FI_EINVAL;
        }
        return -FI_EINVAL;
    }
    return 0;      /* other formats: the caller already checked the length */
}
