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
 * unmaps it. The peer's pages stay valid for as long as we map them (they belong to the
 * file), so a late copy can never fault; whether it may still land is the permit's question.
 *
 * The permit (kvxfer/engine.py, wire.Permit): a copy into the mapping bypasses the target's
 * registration, so nothing else would stop it once the target deregisters the region and
 * reuses its memory (a messenger restarted on the same KV buffer). Each region that offers
 * a host share owns one 64-bit word of its engine's permit table, a small sealed memfd the
 * target holds open: [generation: 32 | revoked: 1 | writers: 31]. The descriptor names the
 * table, the slot and the generation; the sender maps the table's page of that slot with the
 * same checks as the data (kx_direct_permit). Around every copy the sender takes a writer
 * only if the generation is its own and revoked is clear (one CAS), and drops it after (one
 * atomic sub); a refused copy fails its transfer (EACCES, post.c) and its message's 0-byte
 * write is never posted, so its imm never counts (the RMA path fails on the target's key
 * check the same way; docs/reliability.md). MemoryRegion.close() deregisters, sets
 * revoked, waits for the writers to leave (bounded: a writer killed mid-copy never leaves),
 * then bumps the generation before the slot serves another region, so no copy lands after
 * the close returns, in this region or in the slot's next one.
 *
 * What is checked before mapping, so a stale or hostile host share maps nothing: the path
 * is stat'ed (not opened) first and must be a regular file named "/memfd:..." with the
 * share's (dev, inode); after opening, fstat must agree (the fd may have been reused in
 * between), the file must hold the range, and it must be sealed against shrinking: a
 * memfd shrunk under our mapping would raise SIGBUS in our memcpy (kvxfer's host KVBuffer
 * seals its memfd; kvxfer/buffers/host.py). Hugetlb memfds are mapped at their page size
 * (st_blksize).
 *
 * The descriptor is the target's word, and a lying target (or a forged descriptor) could
 * aim the copies anywhere the share can name: past the registered range in the same memfd,
 * into another engine's region, or into the sender's own memory (its own memfd, its own
 * permit slot). So nothing of the share is believed that the target's engine did not record
 * itself (kx_direct_permit): the permit table's header names the engine that owns it, which
 * must be the descriptor's owner (the engine checks that the peer it writes to is that
 * owner); the slot's record, written by that engine when it registered the region, must
 * cover the share's memfd and range; the slot must carry the share's generation, unrevoked.
 * And a peer in another process names only its own files: a memfd or table that this
 * process maps itself (other than through our mappings of peers' files) is refused
 * (kx_mapped_here). What this cannot stop: a same-user
 * process can open any of our fds and write our memory itself (docs/architecture.md). */
#include "internal.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef F_ADD_SEALS
#define F_ADD_SEALS 1033
#endif
#ifndef F_GET_SEALS
#define F_GET_SEALS 1034
#endif
#ifndef F_SEAL_SEAL
#define F_SEAL_SEAL 0x0001
#endif
#ifndef F_SEAL_SHRINK
#define F_SEAL_SHRINK 0x0002
#endif
#ifndef F_SEAL_GROW
#define F_SEAL_GROW 0x0004
#endif
#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif
#ifndef MFD_ALLOW_SEALING
#define MFD_ALLOW_SEALING 0x0002U
#endif

/* a permit word: [generation: 32 | revoked: 1 | writers: 31] */
#define KX_PERMIT_REVOKED  (1ULL << 31)
#define KX_PERMIT_WRITERS  (KX_PERMIT_REVOKED - 1)
#define KX_PERMIT_GEN(w)   ((uint32_t)((w) >> 32))

struct kx_direct {
    int refs;              /* atomic */
    void *map;             /* the mapping, aligned to the file's page size */
    size_t maplen;
    char *base;            /* where byte `offset` of the file (the region's first byte) lies */
    void *permit_map;       /* the page of the target's permit table that holds our slot, or NULL */
    size_t permit_maplen;
    uint64_t *permit;       /* our slot's word (NULL: no permit, copies are unchecked) */
    uint32_t permit_gen;    /* the region's generation: copies only while the word carries it */
    pid_t pid;             /* the target's process, and the file and range mapped: what the */
    uint64_t dev, ino;     /* target's permit record must cover (kx_direct_permit) */
    uint64_t offset, len;
    uint64_t permit_dev, permit_ino;   /* the permit table's file (0, 0 until attached) */
    struct kx_direct *next;          /* kx_directs: every mapping of this process */
};

/* Every kx_direct of this process (under kx_directs_lock): the peers' files we map for
 * direct writes, which kx_mapped_here does not count as our own memory. */
static pthread_mutex_t kx_directs_lock = PTHREAD_MUTEX_INITIALIZER;
static kx_direct *kx_directs;

/* The permit table (kx_permit_table_open) is a sealed memfd of three parts: `slots` words,
 * then one record per slot (what the region holding the slot's current generation is: its
 * memfd and the range registered for remote writes, written by the target's engine before it
 * hands the generation out), then a header naming the table's owner (the owner digest of the
 * engine's address, wire.owner_digest). A sender believes a descriptor's host share only
 * where the table of the descriptor's owner records it. */
#define KX_PERMIT_MAGIC 0x31454345465f584bULL    /* "KX_FENCE1" read as little-endian bytes */
struct kx_permit_record {
    uint64_t dev, ino, offset, len;
};
struct kx_permit_header {
    uint64_t magic;
    uint64_t slots;
    uint8_t owner[KX_OWNER_BYTES];
    uint64_t reserved;
};

static int kx_direct_same_file(const struct stat *st, uint64_t dev, uint64_t ino)
{
    return S_ISREG(st->st_mode) && (uint64_t)st->st_dev == dev && (uint64_t)st->st_ino == ino;
}

/* The pid a "/proc/<pid>/fd/<n>" path names ("self": ours), or 0 for any other path. */
static pid_t kx_path_pid(const char *path)
{
    if (strncmp(path, "/proc/", 6) != 0)
        return 0;
    const char *s = path + 6;
    if (strncmp(s, "self/", 5) == 0)
        return getpid();
    long pid = 0;
    while (*s >= '0' && *s <= '9' && pid < 0x7fffffff)
        pid = pid * 10 + (*s++ - '0');
    return *s == '/' ? (pid_t)pid : 0;
}

/* Whether this process maps the file (dev, ino) anywhere (/proc/self/maps; -errno where it
 * cannot be read): a peer in another process names only its own memory, so a file we map is
 * ours (a source region, our own permit table), and a share naming it is refused. */
static int kx_mapped_here(uint64_t dev, uint64_t ino)
{
    int peers = 0;
    pthread_mutex_lock(&kx_directs_lock);
    for (kx_direct *d = kx_directs; d && !peers; d = d->next)
        peers = (d->dev == dev && d->ino == ino) || (d->permit_dev == dev && d->permit_ino == ino);
    pthread_mutex_unlock(&kx_directs_lock);
    if (peers)
        return 0;      /* a file of a peer that passed these checks before (an older region of it) */
    FILE *f = fopen("/proc/self/maps", "re");
    if (!f)
        return -errno;
    char line[512];
    int found = 0;
    while (!found && fgets(line, sizeof(line), f)) {
        unsigned int major, minor;
        unsigned long long inode;
        if (sscanf(line, "%*s %*s %*s %x:%x %llu", &major, &minor, &inode) == 3)
            found = inode == ino && (uint64_t)makedev(major, minor) == dev;
        while (!strchr(line, '\n') && fgets(line, sizeof(line), f))
            ;     /* the rest of a long line (a long path) */
    }
    fclose(f);
    return found;
}

/* Open the memfd at `path` after the checks above; *fd and *st on success. */
static int kx_open_memfd(const char *path, uint64_t dev, uint64_t ino, int *fd_out, struct stat *st)
{
    char name[64];
    /* stat before open: opening a device or FIFO that a bad share names could act on it */
    if (stat(path, st))
        return -errno;
    if (!kx_direct_same_file(st, dev, ino))
        return -ENODATA;
    ssize_t n = readlink(path, name, sizeof(name) - 1);
    if (n < 0)
        return -errno;
    name[n] = 0;
    if (strncmp(name, "/memfd:", 7) != 0)
        return -ENODATA;
    /* the path names a peer's fd: never a file of our own process unless the peer is an
     * engine of ours (same pid), whose table records what it registered (kx_direct_permit) */
    pid_t pid = kx_path_pid(path);
    if (pid <= 0)
        return -EINVAL;
    if (pid != getpid()) {
        int here = kx_mapped_here(dev, ino);
        if (here)
            return here < 0 ? here : -EPERM;
    }
    int fd = open(path, O_RDWR | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0)
        return -errno;
    int ret = 0;
    int seals = fcntl(fd, F_GET_SEALS);
    if (fstat(fd, st))
        ret = -errno;
    else if (!kx_direct_same_file(st, dev, ino))
        ret = -ENODATA;
    else if (seals < 0 || !(seals & F_SEAL_SHRINK))
        ret = -EPERM;
    if (ret) {
        close(fd);
        return ret;
    }
    *fd_out = fd;
    return 0;
}

/* Map bytes [offset, offset + len) of the open memfd `fd` (its stat `st`) MAP_SHARED:
 * (map_out, maplen_out): the whole mapping; at: where byte `offset` lies. */
static int kx_map_range(int fd, const struct stat *st, uint64_t offset, uint64_t len,
                        void **map_out, size_t *maplen_out, char **at)
{
    /* both as off_t, and their sum too (INT64_MAX - len alone wraps for len > INT64_MAX,
     * and offset + len wrapped past the size check below) */
    if (len == 0 || len > (uint64_t)INT64_MAX || offset > (uint64_t)INT64_MAX - len)
        return -EINVAL;
    if ((uint64_t)st->st_size < offset + len)
        return -ERANGE;
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t align = (uint64_t)st->st_blksize;   /* hugetlbfs: the huge page size */
    if (align < page || (align & (align - 1)))
        align = page;
    uint64_t lo = offset & ~(align - 1);
    uint64_t hi = (offset + len + align - 1) & ~(align - 1);
    void *map = mmap(NULL, (size_t)(hi - lo), PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)lo);
    if (map == MAP_FAILED)
        return -errno;
    *map_out = map;
    *maplen_out = (size_t)(hi - lo);
    *at = (char *)map + (offset - lo);
    return 0;
}

int kx_direct_open(const char *path, uint64_t dev, uint64_t ino, uint64_t offset, uint64_t len, kx_direct **out)
{
    *out = NULL;
    kx_direct *d = calloc(1, sizeof(*d));
    if (!d)
        return -FI_ENOMEM;
    int fd;
    struct stat st;
    int ret = kx_open_memfd(path, dev, ino, &fd, &st);
    if (!ret) {
        ret = kx_map_range(fd, &st, offset, len, &d->map, &d->maplen, &d->base);
        close(fd);                 /* the mapping keeps the file */
    }
    if (ret) {
        free(d);
        return ret;
    }
    d->pid = kx_path_pid(path);
    d->dev = dev;
    d->ino = ino;
    d->offset = offset;
    d->len = len;
    d->refs = 1;
    pthread_mutex_lock(&kx_directs_lock);
    d->next = kx_directs;
    kx_directs = d;
    pthread_mutex_unlock(&kx_directs_lock);
    *out = d;
    return 0;
}

/* the permit table's layout (kx_permit_table_open): words, records, header, in that order */
static uint64_t kx_permit_table_bytes(uint64_t slots)
{
    return slots * (sizeof(uint64_t) + sizeof(struct kx_permit_record)) + sizeof(struct kx_permit_header);
}

static int kx_pread_all(int fd, void *buf, size_t len, uint64_t at)
{
    ssize_t n = pread(fd, buf, len, (off_t)at);
    return n == (ssize_t)len ? 0 : (n < 0 ? -errno : -ERANGE);
}

int kx_direct_permit(kx_direct *d, const char *path, uint64_t dev, uint64_t ino, uint32_t slot, uint32_t gen,
                    const uint8_t owner[KX_OWNER_BYTES])
{
    if (d->permit)
        return -EBUSY;     /* set once, before any transfer can see d */
    /* the table must be the same process's as the data: the record below is its word */
    if (kx_path_pid(path) != d->pid)
        return -EINVAL;
    int fd;
    struct stat st;
    int ret = kx_open_memfd(path, dev, ino, &fd, &st);
    if (ret)
        return ret;
    /* the header (the table's last bytes): the engine that owns the table, which must be
     * the descriptor's owner (the peer every write through d goes to, engine.py checks):
     * a table of another engine (the sender's own, a third one's) records regions that this
     * peer may not name */
    struct kx_permit_header h;
    struct kx_permit_record rec;
    uint64_t size = (uint64_t)st.st_size;
    ret = size < sizeof(h) ? -ERANGE : kx_pread_all(fd, &h, sizeof(h), size - sizeof(h));
    if (!ret && (h.magic != KX_PERMIT_MAGIC || h.slots == 0 || h.slots > ((uint64_t)1 << 28) ||
                 kx_permit_table_bytes(h.slots) != size || slot >= h.slots))
        ret = -ENODATA;
    if (!ret && memcmp(h.owner, owner, KX_OWNER_BYTES) != 0)
        ret = -EACCES;
    void *map = NULL;
    size_t maplen = 0;
    char *at = NULL;
    if (!ret)
        ret = kx_map_range(fd, &st, (uint64_t)slot * sizeof(uint64_t), sizeof(uint64_t), &map, &maplen, &at);
    if (!ret) {
        /* the record of what the target registered under this slot's generation: read
         * between two loads of the word that both carry it, unrevoked (kx_permit_issue writes
         * the record before it clears revoked) */
        uint64_t *w = (uint64_t *)at;     /* 8-aligned: a page-aligned mapping, an offset of 8 * slot */
        uint64_t v = __atomic_load_n(w, __ATOMIC_ACQUIRE);
        if (KX_PERMIT_GEN(v) != gen || (v & KX_PERMIT_REVOKED))
            ret = -ESTALE;
        if (!ret)
            ret = kx_pread_all(fd, &rec, sizeof(rec), h.slots * sizeof(uint64_t) + (uint64_t)slot * sizeof(rec));
        if (!ret && __atomic_load_n(w, __ATOMIC_ACQUIRE) >> 32 != v >> 32)
            ret = -ESTALE;
        if (!ret && (__atomic_load_n(w, __ATOMIC_ACQUIRE) & KX_PERMIT_REVOKED))
            ret = -ESTALE;
        /* the data must lie inside what the target registered for remote writes */
        if (!ret && (rec.dev != d->dev || rec.ino != d->ino || d->offset < rec.offset ||
                     rec.len > (uint64_t)INT64_MAX || rec.offset > (uint64_t)INT64_MAX - rec.len ||
                     d->offset + d->len > rec.offset + rec.len))
            ret = -EACCES;
        if (ret)
            munmap(map, maplen);
    }
    close(fd);
    if (ret)
        return ret;
    pthread_mutex_lock(&kx_directs_lock);
    d->permit_dev = dev;
    d->permit_ino = ino;
    pthread_mutex_unlock(&kx_directs_lock);
    d->permit_map = map;
    d->permit_maplen = maplen;
    d->permit = (uint64_t *)at;
    d->permit_gen = gen;
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
        pthread_mutex_lock(&kx_directs_lock);
        for (kx_direct **p = &kx_directs; *p; p = &(*p)->next)
            if (*p == d) {
                *p = d->next;
                break;
            }
        pthread_mutex_unlock(&kx_directs_lock);
        munmap(d->map, d->maplen);
        if (d->permit_map)
            munmap(d->permit_map, d->permit_maplen);
        free(d);
    }
}

/* Take a writer on the permit word if it still carries `gen` and is not revoked (1), else 0. */
static int kx_permit_enter(uint64_t *w, uint32_t gen)
{
    uint64_t v = __atomic_load_n(w, __ATOMIC_SEQ_CST);
    for (;;) {
        if (KX_PERMIT_GEN(v) != gen || (v & KX_PERMIT_REVOKED) || (v & KX_PERMIT_WRITERS) == KX_PERMIT_WRITERS)
            return 0;
        if (__atomic_compare_exchange_n(w, &v, v + 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            return 1;
    }
}

static void kx_permit_leave(uint64_t *w)
{
    __atomic_sub_fetch(w, 1, __ATOMIC_SEQ_CST);
}

/* Copy up to `limit` more bytes of x's built message into the peer's memory, from where the
 * last call stopped (x->copied): a message may be larger than a caller's budget or a progress
 * round. Returns the bytes copied; sets *revoked (and copies nothing) when the target's permit
 * refuses: the region was deregistered (or the target revoked it under us). The caller fails
 * the transfer then, and posts nothing more of it. */
uint64_t kx_direct_copy(kx_transfer *x, uint64_t limit, int *revoked)
{
    uint64_t skip = x->copied, done = 0;
    uint64_t *permit = x->direct->permit;
    *revoked = 0;
    if (permit && !kx_permit_enter(permit, x->direct->permit_gen)) {
        *revoked = 1;
        return 0;
    }
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
    if (permit)
        kx_permit_leave(permit);     /* seq_cst: the copy is ordered before the target sees 0 writers */
    x->copied += done;
    return done;
}

/* ---- the target's side: its permit table ----------------------------------------------- */

int kx_permit_table_open(size_t slots, const uint8_t owner[KX_OWNER_BYTES], int *fd_out, uint64_t **words_out)
{
    *fd_out = -1;
    *words_out = NULL;
    if (slots == 0 || slots > ((size_t)1 << 28))
        return -EINVAL;
    size_t len = (size_t)kx_permit_table_bytes(slots);
    int fd = (int)syscall(SYS_memfd_create, "kvxfer-fence", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return -errno;
    int ret = 0;
    if (ftruncate(fd, (off_t)len) || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL))
        ret = -errno;
    void *map = MAP_FAILED;
    if (!ret) {
        map = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (map == MAP_FAILED)
            ret = -errno;
    }
    if (ret) {
        close(fd);
        return ret;
    }
    /* every slot starts revoked (generation 0, no writers): one never handed out takes no
     * copy, whatever a descriptor names (its record is empty too) */
    for (size_t k = 0; k < slots; k++)
        ((uint64_t *)map)[k] = KX_PERMIT_REVOKED;
    struct kx_permit_header h = {.magic = KX_PERMIT_MAGIC, .slots = slots};
    memcpy(h.owner, owner, KX_OWNER_BYTES);
    memcpy((char *)map + len - sizeof(h), &h, sizeof(h));
    *fd_out = fd;
    *words_out = map;
    return 0;
}

void kx_permit_table_close(int fd, uint64_t *words, size_t slots)
{
    if (words)
        munmap(words, (size_t)kx_permit_table_bytes(slots));
    if (fd >= 0)
        close(fd);
}

uint32_t kx_permit_issue(uint64_t *words, size_t slots, size_t slot, uint64_t dev, uint64_t ino, uint64_t offset,
                        uint64_t len)
{
    /* a free slot is revoked with no writers (fresh ones too); nobody holds its generation yet,
     * so its record may change: write it, then let copies in (release: a sender that sees
     * the slot unrevoked sees the record) */
    uint64_t *w = &words[slot];
    struct kx_permit_record rec = {dev, ino, offset, len};
    memcpy((char *)(words + slots) + slot * sizeof(rec), &rec, sizeof(rec));
    uint64_t v = __atomic_load_n(w, __ATOMIC_SEQ_CST);
    __atomic_store_n(w, v & ~(KX_PERMIT_REVOKED | KX_PERMIT_WRITERS), __ATOMIC_SEQ_CST);
    return KX_PERMIT_GEN(v);
}

uint32_t kx_permit_revoke(uint64_t *w, int64_t wait_ns)
{
    uint64_t v = __atomic_or_fetch(w, KX_PERMIT_REVOKED, __ATOMIC_SEQ_CST);
    if (!(v & KX_PERMIT_WRITERS))
        return 0;
    /* a writer is inside one copy (at most a progress round, 1 MiB): yield, then nap */
    int64_t deadline = kx_now_ns() + wait_ns;
    for (int step = 0;; step++) {
        v = __atomic_load_n(w, __ATOMIC_SEQ_CST);
        if (!(v & KX_PERMIT_WRITERS) || kx_now_ns() >= deadline)
            return (uint32_t)(v & KX_PERMIT_WRITERS);
        kx_pause(step, 50000);
    }
}

int kx_permit_retire(uint64_t *w)
{
    uint64_t v = __atomic_load_n(w, __ATOMIC_SEQ_CST);
    for (;;) {
        if (!(v & KX_PERMIT_REVOKED) || (v & KX_PERMIT_WRITERS))
            return -EBUSY;    /* a writer never left (killed mid-copy): the slot is never reused */
        uint64_t next = ((uint64_t)(KX_PERMIT_GEN(v) + 1u) << 32) | KX_PERMIT_REVOKED;
        if (__atomic_compare_exchange_n(w, &v, next, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            return 0;
    }
}
