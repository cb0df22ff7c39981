/* direct.c: the sender's own mapping of a shm peer's memory, for direct writes.
 *
 * On shm every write is a copy between two processes of one host, and libfabric 1.17 makes
 * it a CMA copy (process_vm_readv by the target's progress thread, one per message of at
 * most 4 pieces), which costs the kernel a pin and a map of every destination page. When the
 * target's region is a memfd mapping, its descriptor carries a host share (kvxfer/wire.py):
 * the sender opens that memfd through /proc/<pid>/fd/<fd>, maps the region's range
 * MAP_SHARED itself, and a write becomes a memcpy into the mapping followed, per message of
 * the message rule, by a 0-byte write carrying the imm (post.c). Nothing changes for the
 * target: it counts one arrival per message, as before.
 *
 * A kx_direct is that mapping, shared by its owner (the remote region, in Python) and every
 * transfer and watch entry that may still copy through it (refs); the last reference
 * unmaps it. The peer's memory stays valid for as long as we map it, whatever the peer does
 * (the pages belong to the file), so a late copy never lands in memory that was reused.
 *
 * What is checked before mapping, so a stale or hostile host share maps nothing: the path
 * is stat'ed (not opened) first and must be a regular file named "/memfd:..." with the
 * share's (dev, inode); after opening, fstat must agree (the fd may have been reused in
 * between), the file must hold the range, and it must be sealed against shrinking: a
 * memfd shrunk under our mapping would raise SIGBUS in our memcpy (kvxfer's host KVBuffer
 * seals its memfd; kvxfer/buffers/host.py). Hugetlb memfds are mapped at their page size
 * (st_blksize). */
#include "internal.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef F_GET_SEALS
#define F_GET_SEALS 1034
#endif
#ifndef F_SEAL_SHRINK
#define F_SEAL_SHRINK 0x0002
#endif

struct kx_direct {
    int refs;              /* atomic */
    void *map;             /* the mapping, aligned to the file's page size */
    size_t maplen;
    char *base;            /* where byte `offset` of the file (the region's first byte) lies */
};

static int kx_direct_same_file(const struct stat *st, uint64_t dev, uint64_t ino)
{
    return S_ISREG(st->st_mode) && (uint64_t)st->st_dev == dev && (uint64_t)st->st_ino == ino;
}

int kx_direct_open(const char *path, uint64_t dev, uint64_t ino, uint64_t offset, uint64_t len, kx_direct **out)
{
    struct stat st;
    char name[64];
    *out = NULL;
    if (len == 0 || offset > INT64_MAX - len)
        return -EINVAL;
    /* stat before open: opening a device or FIFO that a bad share names could act on it */
    if (stat(path, &st))
        return -errno;
    if (!kx_direct_same_file(&st, dev, ino))
        return -ENODATA;
    ssize_t n = readlink(path, name, sizeof(name) - 1);
    if (n < 0)
        return -errno;
    name[n] = 0;
    if (strncmp(name, "/memfd:", 7) != 0)
        return -ENODATA;
    int fd = open(path, O_RDWR | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0)
        return -errno;
    int ret = 0;
    int seals = fcntl(fd, F_GET_SEALS);
    if (fstat(fd, &st))
        ret = -errno;
    else if (!kx_direct_same_file(&st, dev, ino))
        ret = -ENODATA;
    else if ((uint64_t)st.st_size < offset + len)
        ret = -ERANGE;
    else if (seals < 0 || !(seals & F_SEAL_SHRINK))
        ret = -EPERM;
    if (ret) {
        close(fd);
        return ret;
    }
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t align = (uint64_t)st.st_blksize;   /* hugetlbfs: the huge page size */
    if (align < page || (align & (align - 1)))
        align = page;
    uint64_t lo = offset & ~(align - 1);
    uint64_t hi = (offset + len + align - 1) & ~(align - 1);
    kx_direct *d = calloc(1, sizeof(*d));
    if (!d) {
        close(fd);
        return -FI_ENOMEM;
    }
    void *map = mmap(NULL, (size_t)(hi - lo), PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)lo);
    ret = map == MAP_FAILED ? -errno : 0;
    close(fd);                 /* the mapping keeps the file */
    if (ret) {
        free(d);
        return ret;
    }
    d->refs = 1;
    d->map = map;
    d->maplen = (size_t)(hi - lo);
    d->base = (char *)map + (offset - lo);
    *out = d;
    return 0;
}

char *kx_direct_base(const kx_direct *d)
{
    return d->base;
}

void kx_direct_ref(kx_direct *d)
{
    if (d)
        __atomic_add_fetch(&d->refs, 1, __ATOMIC_RELAXED);
}

void kx_direct_unref(kx_direct *d)
{
    if (d && __atomic_sub_fetch(&d->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        munmap(d->map, d->maplen);
        free(d);
    }
}

/* Copy up to `limit` more bytes of x's built message into the peer's memory, from where the
 * last call stopped (x->copied): a message may be larger than a caller's budget or a progress
 * round. Returns the bytes copied. */
uint64_t kx_direct_copy(kx_transfer *x, uint64_t limit)
{
    uint64_t skip = x->copied, done = 0;
    for (int k = 0; k < x->npieces && done < limit; k++) {
        uint64_t len = x->piece_len[k];
        if (skip >= len) {
            skip -= len;
            continue;
        }
        uint64_t n = len - skip;
        if (n > limit - done)
            n = limit - done;
        memcpy(x->direct_base + x->piece_dst[k] + skip, x->src_base + x->piece_src[k] + skip, n);
        done += n;
        skip = 0;
    }
    x->copied += done;
    return done;
}
