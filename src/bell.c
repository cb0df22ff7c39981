/* bell.c: a doorbell for a shm rail's progress thread, rung by the processes that write to it.
 *
 * shm in libfabric 1.17 has no wait object: nothing wakes a progress thread when a peer
 * enqueues a command, so an idle thread sleeps in a back-off and, without a bell, the first
 * write after a quiet spell waits for it (up to 1 ms: the imm of a direct write, a control
 * message, or a layer's last write). The bell is a futex word in a 4 KiB file of
 * its own next to shm's region, /dev/shm/<shm name>.kxbell (0600, created at open, removed
 * at close; a killed process leaves it, as shm leaves its region). A sleeping progress
 * thread announces itself in `sleeping` and waits on `seq`; a kvxfer sender that mapped the
 * peer's bell (kx_peer_add) rings it after each post it made while the peer slept.
 *
 * No wake-up is lost (the Dekker pattern, seq_cst on both sides):
 *   sleeper: seq0 = seq; sleeping = 1; read the CQ once more; futex_wait(seq, seq0)
 *   ringer:  post (the command is in the peer's queue); fence; if sleeping: swap it to 0,
 *            seq++, futex_wake
 * Either the ringer sees `sleeping` or the sleeper's last CQ read sees the command. The
 * back-off stays as the futex's timeout; since kvxfer writers ring, it may grow to 10 ms
 * (progress.c, KX_MAX_BACKOFF_BELL_NS), which cuts an idle engine's cost, and a writer
 * without a bell's ring (a plain libfabric peer, an older kvxfer) waits for it.
 * KVXFER_SHM_BELL=0 makes an engine without one (the 1 ms back-off). */
#include "internal.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define KX_BELL_MAGIC 0x6c6c6562u      /* "bell" */
#define KX_BELL_BYTES 4096

void kx_bell_create(kx_rail *r)
{
    char name[256], path[300];
    size_t len;
    r->bell = NULL;
    const char *off = getenv("KVXFER_SHM_BELL");     /* "0": no bell, the back-off alone */
    if (off && strcmp(off, "0") == 0)
        return;
    if (!r->shm || kx_ep_name(r, name, sizeof(name), &len))
        return;
    if (kx_shm_path(name, len, ".kxbell", path, sizeof(path)))
        return;
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0 && errno == EEXIST) {      /* left by a killed process whose pid we now have */
        unlink(path);
        fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    }
    if (fd < 0)
        return;
    void *m = MAP_FAILED;
    if (ftruncate(fd, KX_BELL_BYTES) == 0)
        m = mmap(NULL, KX_BELL_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        unlink(path);
        return;
    }
    kx_bell *b = m;
    b->pid = (int32_t)getpid();
    __atomic_store_n(&b->magic, KX_BELL_MAGIC, __ATOMIC_RELEASE);
    r->bell_path = strdup(path);
    if (!r->bell_path) {
        unlink(path);
        munmap(m, KX_BELL_BYTES);
        return;
    }
    r->bell = b;
}

/* no new writer finds it; those that mapped it keep harmless pages */
void kx_bell_remove(kx_rail *r)
{
    if (r->bell_path) {
        unlink(r->bell_path);
        free(r->bell_path);
        r->bell_path = NULL;
    }
}

void kx_bell_free(kx_rail *r)
{
    kx_bell_remove(r);
    if (r->bell) {
        munmap(r->bell, KX_BELL_BYTES);
        r->bell = NULL;
    }
}

/* A writer's mapping of the bell of the shm endpoint `name` (of process `pid`), or NULL: no
 * bell, someone else's file, or not a bell. Only files of our own user are mapped. */
kx_bell *kx_bell_open(const void *name, size_t len, pid_t pid)
{
    char path[300];
    if (pid <= 0 || kx_shm_path(name, len, ".kxbell", path, sizeof(path)))
        return NULL;
    int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0)
        return NULL;
    struct stat st;
    void *m = MAP_FAILED;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() && st.st_size == KX_BELL_BYTES)
        m = mmap(NULL, KX_BELL_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return NULL;
    kx_bell *b = m;
    if (__atomic_load_n(&b->magic, __ATOMIC_ACQUIRE) != KX_BELL_MAGIC || b->pid != (int32_t)pid) {
        munmap(m, KX_BELL_BYTES);
        return NULL;
    }
    return b;
}

void kx_bell_close(kx_bell *b)
{
    if (b)
        munmap(b, KX_BELL_BYTES);
}

static void kx_bell_wake(kx_bell *b)
{
    __atomic_add_fetch(&b->seq, 1, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, &b->seq, FUTEX_WAKE, 1, NULL, NULL, 0);
}

/* after a post to the bell's owner: wake its progress thread if it sleeps; 1 if it did */
int kx_bell_ring(kx_bell *b)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (!__atomic_load_n(&b->sleeping, __ATOMIC_RELAXED) ||
        !__atomic_exchange_n(&b->sleeping, 0, __ATOMIC_SEQ_CST))
        return 0;
    kx_bell_wake(b);
    return 1;
}

/* the owner's own wake (a local post, a cancel, closing): whether or not it sleeps yet */
void kx_bell_poke(kx_bell *b)
{
    if (b)
        kx_bell_wake(b);
}

/* the bell's sequence now: read by the progress thread before it announces `sleeping`, so
 * a poke from this process in between (kx_wake) makes the futex wait return at once */
uint32_t kx_bell_seq(const kx_bell *b)
{
    return __atomic_load_n(&b->seq, __ATOMIC_SEQ_CST);
}

/* The progress thread sleeps up to `ns` unless a ring (or a poke after `seq` was read)
 * comes first; `look` reads the CQ once more after `sleeping` is visible (returns what it
 * handled): nonzero means don't sleep. */
void kx_bell_sleep(kx_rail *r, uint32_t seq, int64_t ns, int (*look)(kx_rail *))
{
    kx_bell *b = r->bell;
    __atomic_store_n(&b->sleeping, 1, __ATOMIC_SEQ_CST);
    if (look(r) == 0 && !__atomic_load_n(&r->stop, __ATOMIC_SEQ_CST)) {
        struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
        syscall(SYS_futex, &b->seq, FUTEX_WAIT, seq, &ts, NULL, 0);
    }
    if (__atomic_exchange_n(&b->sleeping, 0, __ATOMIC_SEQ_CST) == 0)
        __atomic_add_fetch(&r->stat_bell_wakes, 1, __ATOMIC_RELAXED);   /* a ring took it */
}
