/* shmlock.c: reading a shm peer's region lock, so a post never spins for good on the lock of
 * a peer that died holding it. */

#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"
#include "smr117.h"

/* shm's region lock. shm 1.17 takes a peer's region spin lock inside fi_writemsg and fi_send
 * to queue a command, and a process holds its own while it progresses: a peer SIGKILLed
 * holding it leaves every later post spinning in pthread_spin_lock for good (2 of 10
 * `sigkill` iterations leaked such a thread). The pidfd says so only once the dying process
 * has finished exiting, milliseconds later. So kvxfer maps the first page of a peer's region
 * read-only itself and, when the lock is held at the moment of a post, waits outside libfabric
 * (not spinning) until it is free, the peer is seen dying or dead, or `peer_timeout` passes.
 * A thread already inside shm's spin when the peer dies (the peer took the lock between our
 * check and shm's, and was killed holding it: 2 of 1,000 `sigkill` iterations) can only be
 * freed by releasing the dead peer's lock for it: kx_peers_unstick does that for peers whose
 * process has exited (their region is garbage to everyone from then on), from every waiter
 * whose 50 ms slice passed without news and from close(), so waits end with PeerError and
 * close() joins the thread.
 * The layout is libfabric's, not ours: it is used only when the page matches what 1.17 writes
 * (struct smr_region: version 4 at byte 0, the owner's pid at 4, the lock at 24, holding the
 * unlocked or locked value of this libc's pthread spin lock); anything else turns it off. */
#define KX_PF_EXITING 0x4

static int kx_spin_value(int locked)
{
    pthread_spinlock_t l;
    pthread_spin_init(&l, PTHREAD_PROCESS_SHARED);
    if (locked)
        pthread_spin_lock(&l);
    int v;
    memcpy(&v, (void *)&l, sizeof(v));
    if (locked)
        pthread_spin_unlock(&l);
    pthread_spin_destroy(&l);
    return v;
}

static int kx_spin_free = -1, kx_spin_held = -1;

/* a lock word that is not free. glibc's x86-64 spin lock is free at 1, taken at 0, and each
 * waiter's failed attempt decrements it further (a lock with waiters reads -1, -2, ...) */
static int kx_lock_held(int v)
{
    if (kx_spin_free > kx_spin_held)
        return v <= kx_spin_held;
    return v != kx_spin_free;
}

void kx_shm_lock_map(kx_peer *p, const void *name, size_t len, pid_t pid)
{
    p->lockw = NULL;
    p->map = NULL;
    char path[300];
    if (kx_shm_path(name, len, "", path, sizeof(path)))
        return;
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return;
    void *m = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return;
    if (kx_spin_free == -1) {
        kx_spin_free = kx_spin_value(0);
        kx_spin_held = kx_spin_value(1);
    }
    const unsigned char *b = m;
    int rpid, lock;
    memcpy(&rpid, b + KX_SMR_PID_OFF, sizeof(rpid));
    memcpy(&lock, b + KX_SMR_LOCK_OFF, sizeof(lock));
    if (b[0] != KX_SMR_VERSION || rpid != pid || kx_spin_free == kx_spin_held ||
        (lock != kx_spin_free && !kx_lock_held(lock))) {
        munmap(m, 4096);
        return;
    }
    p->map = m;
    p->lockw = (volatile int *)(b + KX_SMR_LOCK_OFF);
}

void kx_shm_lock_unmap(void *map)
{
    if (map)
        munmap(map, 4096);
}

/* the process is exiting (PF_EXITING), a zombie, or gone */
static int kx_pid_dying(pid_t pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 1;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return 1;
    buf[n] = '\0';
    char *s = strrchr(buf, ')');
    if (!s)
        return 0;
    char state;
    unsigned long flags = 0;
    if (sscanf(s + 1, " %c %*d %*d %*d %*d %*d %lu", &state, &flags) < 2)
        return 0;
    return state == 'Z' || state == 'X' || state == 'x' || (flags & KX_PF_EXITING);
}

/* 0 once the peer's region lock is free (or unknown), else the errno to fail the post with */
int kx_shm_lock_wait(kx_rail *r, kx_peer *p)
{
    const volatile int *w = p->lockw;
    if (!w || !kx_lock_held(*w))
        return 0;
    int64_t start = kx_now_ns();
    for (int step = 0;; step++) {
        if (!kx_lock_held(*w))
            return 0;
        if (step >= 64) {          /* a live holder keeps it for microseconds: past that, look */
            if ((p->pidfd >= 0 && kx_pidfd_exited(p->pidfd)) || kx_pid_dying(p->pid))
                return ECONNRESET;
            if (r->peer_timeout_ns > 0 && kx_now_ns() - start > r->peer_timeout_ns)
                return ETIMEDOUT;
        }
        kx_pause(step, 20000);
    }
}

/* Release the region lock of every cross-process shm peer whose process has exited and left
 * it held (a progress thread of ours may be spinning on it inside libfabric). Returns how
 * many it released. Only for teardown: a thread that entered the dead peer's critical
 * section then finishes it against a region nobody reads any more. */
int kx_peers_unstick(kx_rail *r)
{
    int n = 0;
    size_t hi = __atomic_load_n(&r->peer_hi, __ATOMIC_ACQUIRE);
    for (size_t fa = 0; fa < hi; fa++) {
        kx_peer *p = kx_peer_get(r, (fi_addr_t)fa);
        if (!p || !p->lockw || p->pidfd < 0)
            continue;
        if (kx_lock_held(*p->lockw) && kx_pidfd_exited(p->pidfd)) {
            __atomic_store_n(p->lockw, kx_spin_free, __ATOMIC_SEQ_CST);
            n++;
        }
    }
    return n;
}
