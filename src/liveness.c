/* liveness.c: what kvxfer knows about each peer, so that it never posts into a path that
 * libfabric 1.17 cannot survive, and a dead peer becomes an error in bounded time.
 *
 * Per rail, a table indexed by fi_addr_t (FI_AV_TABLE hands out small indices) holds:
 *   dead      0, or the errno every later post to the peer fails with at once;
 *   local     the peer is an engine of this process: its kx_local cell (see below);
 *   pidfd     shm: a pidfd of the peer's process (its pid is in its endpoint name), which
 *             becomes readable when the process exits (also while it is a zombie);
 *   out/last  operations posted to it and not completed, and when the last one completed
 *             (or the first was posted): the stall clock.
 * A peer is declared dead (and every unfinished transfer to it fails) when
 *   - it is an engine of this process that closed           -> EPIPE
 *   - its process exited (shm pidfd)                         -> ECONNRESET
 *   - the provider reported a connection error for it        -> that errno
 *   - operations to it were outstanding and none completed for `peer_timeout_ns` (every
 *     provider; the only signal shm has for a peer that stopped answering, and the one for
 *     a write the target refused without telling, shm's 64 KiB path) -> ETIMEDOUT
 * Why it must never post to such a peer (libfabric 1.17, observed):
 *   - shm, same process: the closed engine's region is freed; fi_writemsg to it dereferences
 *     it (SIGSEGV in pthread_spin_lock);
 *   - shm, peer SIGKILLed while it held its region's spin lock (it does so while it
 *     progresses): every later fi_writemsg to it spins forever.
 * A transfer failed this way is `done` for its waiters at once, but stays on the in-flight
 * list (the provider may still own its contexts) until its operations complete or the
 * endpoint closes; its source registration counts as busy until then.
 *
 * kx_local: one cell per open engine endpoint of this process, in a process-wide list keyed by
 * endpoint name. A rail posting to a local peer brackets the post with the cell's `busy`
 * count after checking `closed`; the owner's teardown sets `closed` and waits for `busy` to
 * drain before it closes its endpoint, so a post never reaches a closed endpoint. */

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <netinet/in.h>

#include <sys/syscall.h>
#include <unistd.h>

#include "internal.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif


static pthread_mutex_t kx_locals_lock = PTHREAD_MUTEX_INITIALIZER;
static kx_local *kx_locals;

static void kx_local_unref_locked(kx_local *c)
{
    if (--c->refs == 0) {
        for (kx_local **p = &kx_locals; *p; p = &(*p)->next) {
            if (*p == c) {
                *p = c->next;
                break;
            }
        }
        free(c->held);
        free(c);
    }
}

static void kx_local_unref(kx_local *c)
{
    pthread_mutex_lock(&kx_locals_lock);
    kx_local_unref_locked(c);
    pthread_mutex_unlock(&kx_locals_lock);
}

/* Same-process shm peers (the deferral rule of rail.c). shm 1.17 keeps a same-process peer's
 * region by pointer: once X posts to Y, X's progress may read Y's region and Y's (which
 * mapped X on X's first command) may read X's. So an endpoint's region must outlive the
 * progress of every engine of this process that holds it. A rail's cell `held` lists the
 * cells its progress may read; each holds a reference and counts in the cell's `mapped_by`.
 * Links are made on connect, dropped when the holder removes the peer from its AV (only its
 * own side) and when the holder's progress thread has been joined (all of them). A closing
 * shm rail whose cell is still mapped by someone is deferred (kx_local_defer); the thread
 * that drops `mapped_by` to 0 closes its fids (kx_rail_finish_deferred). Under the lock. */
static int kx_hold_locked(kx_local *holder, kx_local *c)
{
    if (holder->nheld == holder->capheld) {
        int cap = holder->capheld ? 2 * holder->capheld : 4;
        kx_local **h = realloc(holder->held, (size_t)cap * sizeof(*h));
        if (!h)
            return -FI_ENOMEM;
        holder->held = h;
        holder->capheld = cap;
    }
    holder->held[holder->nheld++] = c;
    c->refs++;
    c->mapped_by++;
    return 0;
}

/* drop one hold of c; returns c's rail when that ends its deferral (the caller finishes it) */
static kx_rail *kx_unhold_locked(kx_local *c)
{
    kx_rail *finish = NULL;
    if (--c->mapped_by == 0 && c->deferred) {
        finish = c->deferred;
        c->deferred = NULL;
        finish->deferred = 2;
    }
    kx_local_unref_locked(c);
    return finish;
}

static void kx_local_link(kx_rail *x, kx_local *y)
{
    kx_local *xc = x->self_local;
    if (!x->shm || !xc || xc == y)
        return;
    pthread_mutex_lock(&kx_locals_lock);
    if (kx_hold_locked(xc, y) == 0 && kx_hold_locked(y, xc) != 0) {
        /* out of memory for the back link: keep X's region for good rather than risk it */
        xc->refs++;
        xc->mapped_by++;
    }
    pthread_mutex_unlock(&kx_locals_lock);
}

static void kx_local_unlink(kx_rail *x, kx_local *y)
{
    kx_local *xc = x->self_local;
    kx_rail *finish = NULL;
    if (!xc)
        return;
    pthread_mutex_lock(&kx_locals_lock);
    for (int i = 0; i < xc->nheld; i++) {
        if (xc->held[i] == y) {
            xc->held[i] = xc->held[--xc->nheld];
            finish = kx_unhold_locked(y);
            break;
        }
    }
    pthread_mutex_unlock(&kx_locals_lock);
    if (finish)
        kx_rail_finish_deferred(finish);
}

/* r's progress thread has been joined: it reads no other region any more */
void kx_local_release(kx_rail *r)
{
    kx_local *c = r->self_local;
    if (!c)
        return;
    for (;;) {
        kx_rail *finish = NULL;
        pthread_mutex_lock(&kx_locals_lock);
        while (c->nheld > 0 && !finish)
            finish = kx_unhold_locked(c->held[--c->nheld]);
        pthread_mutex_unlock(&kx_locals_lock);
        if (!finish)
            return;
        kx_rail_finish_deferred(finish);
    }
}

/* a closing shm rail: 1 if another engine's progress may still read its region (it is now
 * deferred), else 0 (close it now) */
int kx_local_defer(kx_rail *r)
{
    kx_local *c = r->self_local;
    if (!r->shm || !c)
        return 0;
    pthread_mutex_lock(&kx_locals_lock);
    int d = c->mapped_by > 0;
    if (d) {
        r->deferred = 1;
        c->deferred = r;
    }
    pthread_mutex_unlock(&kx_locals_lock);
    return d;
}

/* 1 while r is deferred or being closed by another thread (and notes what its owner asked
 * for: the domain's close, its freeing); 0 once its fids are closed */
int kx_local_still_deferred(kx_rail *r, int freeing)
{
    pthread_mutex_lock(&kx_locals_lock);
    int d = r->deferred;
    if (d) {
        r->domain_requested = 1;
        if (freeing)
            r->free_requested = 1;
    }
    pthread_mutex_unlock(&kx_locals_lock);
    return d;
}

/* the closing thread of a deferred rail, after kx_rail_close_fids: 1 if its owner asked for
 * the domain's close, which the caller now does while the rail stays deferred ("being
 * closed": the owner's own close and free wait for kx_local_deferred_end); 0: the rail is
 * no longer deferred and its owner closes the domain */
int kx_local_deferred_done(kx_rail *r)
{
    pthread_mutex_lock(&kx_locals_lock);
    int out = r->free_requested || r->domain_requested;
    if (!out)
        r->deferred = 0;
    pthread_mutex_unlock(&kx_locals_lock);
    return out;
}

/* ... and after closing the domain: the rail is no longer deferred; 1 if its owner asked
 * for its freeing meanwhile (the caller frees it: the owner never touches it again) */
int kx_local_deferred_end(kx_rail *r)
{
    pthread_mutex_lock(&kx_locals_lock);
    int f = r->free_requested;
    r->deferred = 0;
    pthread_mutex_unlock(&kx_locals_lock);
    return f;
}

/* publish this rail's endpoint name (after fi_enable) */
int kx_local_publish(kx_rail *r)
{
    kx_local *c = calloc(1, sizeof(*c));
    if (!c)
        return -FI_ENOMEM;
    size_t n = sizeof(c->name);
    if (fi_getname(&r->ep->fid, c->name, &n) || n > sizeof(c->name)) {
        free(c);
        return 0;          /* unnamed: nothing can connect to it by name anyway */
    }
    c->len = n;
    c->refs = 1;
    pthread_mutex_lock(&kx_locals_lock);
    c->next = kx_locals;
    kx_locals = c;
    pthread_mutex_unlock(&kx_locals_lock);
    r->self_local = c;
    return 0;
}

/* the first step of teardown: refuse new posts from other engines of this process to us,
 * and wait (bounded) for those under way */
void kx_local_retire(kx_rail *r)
{
    kx_local *c = r->self_local;
    if (!c)
        return;
    __atomic_store_n(&c->closed, 1, __ATOMIC_SEQ_CST);
    int64_t until = kx_now_ns() + 1000000000LL;
    while (__atomic_load_n(&c->busy, __ATOMIC_SEQ_CST) && kx_now_ns() < until)
        sched_yield();
}

static int kx_pidfd_exited(int fd);

static kx_local *kx_local_find(const void *name, size_t len)
{
    kx_local *found = NULL;
    pthread_mutex_lock(&kx_locals_lock);
    for (kx_local *c = kx_locals; c; c = c->next) {
        if (c->len == len && !memcmp(c->name, name, len) && !__atomic_load_n(&c->closed, __ATOMIC_SEQ_CST)) {
            c->refs++;
            found = c;
            break;
        }
    }
    pthread_mutex_unlock(&kx_locals_lock);
    return found;
}

/* shm names its endpoints "fi_shm://<pid>:..." when kvxfer lets it choose (it always does) */
static pid_t kx_shm_pid(const char *prov, const void *name, size_t len)
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

/* the entry of `fa`, NULL if untracked. Lock-free: chunks are published once and never move. */
static kx_peer *kx_peer_get(kx_rail *r, fi_addr_t fa)
{
    if (!r->pdir || fa >= (fi_addr_t)KX_PEER_CHUNK * KX_PEER_CHUNKS)
        return NULL;
    kx_peer *c = __atomic_load_n(&r->pdir[fa / KX_PEER_CHUNK], __ATOMIC_ACQUIRE);
    if (!c)
        return NULL;
    kx_peer *p = &c[fa % KX_PEER_CHUNK];
    return __atomic_load_n(&p->used, __ATOMIC_ACQUIRE) ? p : NULL;
}

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
#define KX_SMR_VERSION 4
#define KX_SMR_PID_OFF 4
#define KX_SMR_LOCK_OFF 24
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

static void kx_shm_lock_map(kx_peer *p, const void *name, size_t len, pid_t pid)
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

static void kx_shm_lock_unmap(void *map)
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
static int kx_shm_lock_wait(kx_rail *r, kx_peer *p)
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

/* the table entry of a peer just inserted at `fa` (by the caller, nothing posts to it yet) */
int kx_peer_add(kx_rail *r, fi_addr_t fa, const void *name, size_t len)
{
    if (!r->pdir || fa >= (fi_addr_t)KX_PEER_CHUNK * KX_PEER_CHUNKS)
        return 0;           /* not a small table index: untracked (never with FI_AV_TABLE) */
    kx_local *local = kx_local_find(name, len);
    pid_t owner = kx_shm_pid(r->info->fabric_attr->prov_name, name, len);
    pid_t pid = local ? 0 : owner;
    kx_bell *bell = owner > 0 ? kx_bell_open(name, len, owner) : NULL;   /* shm: its doorbell */
    int fd = -1, dead = 0;
    if (pid > 0 && pid != getpid()) {
        fd = (int)syscall(SYS_pidfd_open, pid, 0);
        if (fd < 0 && errno == ESRCH)
            dead = ECONNRESET;
    }
    pthread_mutex_lock(&r->hub->lock);
    kx_peer **slot = &r->pdir[fa / KX_PEER_CHUNK];
    if (!*slot) {
        kx_peer *c = calloc(KX_PEER_CHUNK, sizeof(kx_peer));
        if (!c) {
            pthread_mutex_unlock(&r->hub->lock);
            if (local)
                kx_local_unref(local);
            if (fd >= 0)
                close(fd);
            kx_bell_close(bell);
            return -FI_ENOMEM;
        }
        __atomic_store_n(slot, c, __ATOMIC_RELEASE);
    }
    kx_peer *p = &(*slot)[fa % KX_PEER_CHUNK];
    kx_local *old = p->used ? p->local : NULL;
    int oldfd = p->used ? p->pidfd : -1;
    void *oldmap = p->used ? p->map : NULL;
    kx_bell *oldbell = p->used ? p->bell : NULL;
    /* the new generation first, `dead` last: a poster that reads this insert's `dead`
     * reads its generation too (kx_peer_enter checks the generation after `dead`), so a
     * post meant for the slot's old peer is refused however the two interleave */
    uint32_t gen = p->gen + 1;
    __atomic_store_n(&p->gen, gen ? gen : 1, __ATOMIC_SEQ_CST);
    p->bell = bell;
    p->pidfd = fd;
    p->pid = fd >= 0 ? pid : 0;
    p->lockw = NULL;
    p->map = NULL;
    if (fd >= 0)
        kx_shm_lock_map(p, name, len, pid);
    p->local = local;
    p->out = 0;
    p->refused_ns = 0;
    p->alive_ns = 0;
    p->last_ns = kx_now_ns();
    __atomic_store_n(&p->dead, dead, __ATOMIC_SEQ_CST);
    __atomic_store_n(&p->used, 1, __ATOMIC_RELEASE);
    if ((size_t)fa + 1 > r->peer_hi)
        r->peer_hi = (size_t)fa + 1;
    pthread_mutex_unlock(&r->hub->lock);
    if (old)
        kx_local_unref(old);
    if (oldfd >= 0)
        close(oldfd);
    kx_shm_lock_unmap(oldmap);
    kx_bell_close(oldbell);
    if (local)
        kx_local_link(r, local);
    return 0;
}

/* forget a removed peer (fi_av_remove; kx_av_remove saw no post inside a provider call to
 * it): the slot stays a tombstone, dead with ENOTCONN, until libfabric reuses it for the next
 * peer inserted (kx_peer_add bumps its generation) */
void kx_peer_forget(kx_rail *r, fi_addr_t fa)
{
    pthread_mutex_lock(&r->hub->lock);
    kx_peer *p = kx_peer_get(r, fa);
    kx_local *c = NULL;
    int fd = -1;
    void *map = NULL;
    kx_bell *bell = NULL;
    if (p) {
        c = p->local;
        fd = p->pidfd;
        map = p->map;
        bell = p->bell;
        p->bell = NULL;
        p->local = NULL;
        p->pidfd = -1;
        __atomic_store_n(&p->dead, ENOTCONN, __ATOMIC_SEQ_CST);
        p->out = 0;
        p->refused_ns = 0;
        p->lockw = NULL;
        p->map = NULL;
    }
    pthread_mutex_unlock(&r->hub->lock);
    if (c) {
        kx_local_unlink(r, c);
        kx_local_unref(c);
    }
    if (fd >= 0)
        close(fd);
    kx_shm_lock_unmap(map);
    kx_bell_close(bell);
}

static int kx_pidfd_exited(int fd)
{
    struct pollfd pfd = {fd, POLLIN, 0};
    return poll(&pfd, 1, 0) > 0;
}


/* whether a shm peer's process has exited, for a poster: its pidfd, polled at most every
 * KX_ALIVE_NS (a peer that dies in between is a post into its region, as one that dies just
 * after the poll always was: the lock wait, the peer scan and the stall deadline catch it) */
static int kx_peer_exited(kx_peer *p)
{
    int64_t now = kx_now_ns();
    if (now - __atomic_load_n(&p->alive_ns, __ATOMIC_RELAXED) < KX_ALIVE_NS)
        return 0;
    if (kx_pidfd_exited(p->pidfd))
        return 1;
    __atomic_store_n(&p->alive_ns, now, __ATOMIC_RELAXED);
    return 0;
}

/* Declare `fa` dead with `err`: later posts fail at once, unfinished transfers to it fail
 * now (their waiters wake), queued ones are swept. Under the hub lock. */
void kx_peer_kill_locked(kx_rail *r, fi_addr_t fa, int err)
{
    kx_peer *p = kx_peer_get(r, fa);
    if (!p || p->dead)
        return;
    __atomic_store_n(&p->dead, err, __ATOMIC_SEQ_CST);     /* kx_peer_enter's Dekker partner */
    for (kx_transfer *x = r->inflight; x; x = x->next)
        if (x->peer == fa)
            kx_transfer_fail_locked(r, x, err);
    __atomic_store_n(&r->cancel_pending, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&r->hub->cond);
}

/* 0 if `fa` may be posted to now, else the errno to fail with. Cheap for tcp (one load),
 * one poll(2) for shm peers in other processes. Call without the hub lock. */
int kx_peer_gone(kx_rail *r, fi_addr_t fa)
{
    kx_peer *p = kx_peer_get(r, fa);
    if (!p)
        return 0;
    int d = __atomic_load_n(&p->dead, __ATOMIC_SEQ_CST);
    if (d)
        return d;
    if (p->local && __atomic_load_n(&p->local->closed, __ATOMIC_SEQ_CST))
        d = EPIPE;
    else if (p->pidfd >= 0 && kx_peer_exited(p))
        d = ECONNRESET;
    else
        d = kx_shm_lock_wait(r, p);
    if (d) {
        pthread_mutex_lock(&r->hub->lock);
        kx_peer_kill_locked(r, fa, d);
        pthread_mutex_unlock(&r->hub->lock);
    }
    return d;
}

/* Bracket one post to `fa` as the caller named it (`gen`: the slot's generation then; 0:
 * unchecked): 0 and entered (call kx_peer_leave after the post), or the errno the post must
 * fail with (nothing entered). While entered, kx_av_remove waits (p->busy), so no provider
 * call ever reaches a removed address; a slot reused since the caller named it (another
 * generation) answers ENOTCONN, so a post never reaches the peer that took its place. Keeps a
 * local peer's endpoint open meanwhile. (Dekker with kx_av_remove: busy++ then read dead,
 * against dead = ENOTCONN then read busy, seq_cst on both sides.) */
int kx_peer_enter(kx_rail *r, fi_addr_t fa, uint32_t gen)
{
    kx_peer *p = kx_peer_get(r, fa);
    if (p)
        __atomic_add_fetch(&p->busy, 1, __ATOMIC_SEQ_CST);
    int d = kx_peer_gone(r, fa);
    /* after `dead` was read: an insert that reused the slot stored its generation before
     * clearing `dead` (kx_peer_add), so a stale caller is refused here */
    if (!d && p && gen && __atomic_load_n(&p->gen, __ATOMIC_SEQ_CST) != gen)
        d = ENOTCONN;
    if (!d && p && p->local) {
        __atomic_add_fetch(&p->local->busy, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&p->local->closed, __ATOMIC_SEQ_CST)) {
            __atomic_sub_fetch(&p->local->busy, 1, __ATOMIC_SEQ_CST);
            d = kx_peer_gone(r, fa);
        }
    }
    if (d && p)
        __atomic_sub_fetch(&p->busy, 1, __ATOMIC_SEQ_CST);
    return d;
}

void kx_peer_leave(kx_rail *r, fi_addr_t fa)
{
    kx_peer *p = kx_peer_get(r, fa);
    if (!p)
        return;
    if (p->local)
        __atomic_sub_fetch(&p->local->busy, 1, __ATOMIC_SEQ_CST);
    __atomic_sub_fetch(&p->busy, 1, __ATOMIC_SEQ_CST);
}

/* whether `fa`'s slot still holds the peer of generation `gen` (0: unchecked): a removed
 * peer's late completions must not count for, or kill, the next peer in its slot */
int kx_peer_is(kx_rail *r, fi_addr_t fa, uint32_t gen)
{
    return !gen || kx_peer_gen(r, fa) == gen;
}

/* the generation of `fa`'s slot (0: not a peer of this rail) */
uint32_t kx_peer_gen(kx_rail *r, fi_addr_t fa)
{
    kx_peer *p = kx_peer_get(r, fa);
    return p ? __atomic_load_n(&p->gen, __ATOMIC_SEQ_CST) : 0;
}

/* kx_av_remove's first half: ENOTCONN from now on, then wait (up to wait_ns) for posts still
 * inside a provider call to `fa` to leave. 0, or -FI_EBUSY at the deadline. */
int kx_peer_retire(kx_rail *r, fi_addr_t fa, int64_t wait_ns)
{
    kx_peer *p = kx_peer_get(r, fa);
    if (!p)
        return 0;
    pthread_mutex_lock(&r->hub->lock);
    kx_peer_kill_locked(r, fa, ENOTCONN);
    pthread_mutex_unlock(&r->hub->lock);
    int64_t end = kx_now_ns() + wait_ns;
    for (int k = 0; __atomic_load_n(&p->busy, __ATOMIC_SEQ_CST) > 0; k++) {
        if (kx_now_ns() >= end)
            return -FI_EBUSY;
        if (__atomic_load_n(&r->stop, __ATOMIC_SEQ_CST))
            return -FI_ECANCELED;       /* the rail is closing: its quiesce waits for us */
        if (k % 200 == 199)
            kx_peers_unstick(r);        /* a post spinning on a dead shm peer's lock (~every 10 ms) */
        struct timespec ts = {0, 50000};
        nanosleep(&ts, NULL);
    }
    return 0;
}

/* an operation to `fa` was posted (1) or completed (-1); any thread */
void kx_peer_count(kx_rail *r, fi_addr_t fa, int delta)
{
    kx_peer *p = kx_peer_get(r, fa);
    if (!p)
        return;
    if (delta < 0 || __atomic_load_n(&p->out, __ATOMIC_ACQUIRE) == 0)
        __atomic_store_n(&p->last_ns, kx_now_ns(), __ATOMIC_RELEASE);
    if (__atomic_add_fetch(&p->out, delta, __ATOMIC_ACQ_REL) < 0)
        __atomic_store_n(&p->out, 0, __ATOMIC_RELEASE);
}

/* undo the count of a post the provider refused (the stall clock keeps running); `again`:
 * it was -FI_EAGAIN, which starts the refusal clock (rxm answers a peer it cannot connect
 * to with -FI_EAGAIN for ever) */
void kx_peer_uncount(kx_rail *r, fi_addr_t fa, int again)
{
    kx_peer *p = kx_peer_get(r, fa);
    if (!p)
        return;
    if (__atomic_sub_fetch(&p->out, 1, __ATOMIC_ACQ_REL) < 0)
        __atomic_store_n(&p->out, 0, __ATOMIC_RELEASE);
    if (again && __atomic_load_n(&p->refused_ns, __ATOMIC_ACQUIRE) == 0)
        __atomic_store_n(&p->refused_ns, kx_now_ns(), __ATOMIC_RELEASE);
}

/* a post to `fa` was accepted: the refusal clock stops */
void kx_peer_accepted(kx_rail *r, fi_addr_t fa)
{
    kx_peer *p = kx_peer_get(r, fa);
    if (p && __atomic_load_n(&p->refused_ns, __ATOMIC_RELAXED))
        __atomic_store_n(&p->refused_ns, 0, __ATOMIC_RELEASE);
    if (p && p->bell && kx_bell_ring(p->bell))      /* it sleeps: wake it to read our post */
        __atomic_add_fetch(&r->stat_bell_rings, 1, __ATOMIC_RELAXED);
}

int kx_is_peer_errno(int err)
{
    switch (err) {
    case ECONNREFUSED: case ECONNRESET: case ECONNABORTED: case EPIPE: case ENOTCONN:
    case EHOSTUNREACH: case EHOSTDOWN: case ENETUNREACH: case ENETDOWN: case ETIMEDOUT:
        return 1;
    default:
        return 0;
    }
}

/* The progress thread's look at its peers (every KX_PEER_SCAN_NS): stalled or exited peers
 * die. Returns how many it declared dead. */
int kx_peers_scan(kx_rail *r)
{
    int64_t now = kx_now_ns();
    if (now - r->last_scan_ns < KX_PEER_SCAN_NS)
        return 0;
    r->last_scan_ns = now;
    int killed = 0;
    pthread_mutex_lock(&r->hub->lock);
    /* a transfer whose own operations stay outstanding with none completing (a write the
     * target refused without answering: shm's CMA path) fails alone; its operations are
     * written off the peer's count, so a peer that answers everything else lives on */
    for (kx_transfer *x = r->inflight; r->peer_timeout_ns > 0 && x; x = x->next) {
        /* what the provider took (not `posted`, which counts a post in progress that may
         * still be refused and taken back) */
        int64_t open = __atomic_load_n(&x->accepted, __ATOMIC_ACQUIRE) - x->completed - x->written_off;
        if (!x->done && open > 0 && now - __atomic_load_n(&x->last_ns, __ATOMIC_ACQUIRE) > r->peer_timeout_ns) {
            kx_transfer_fail_locked(r, x, ETIMEDOUT);
            x->written_off += open;
            /* off the rail's count too: shm never completes a refused CMA write, and one
             * left there would keep the progress thread from sleeping on the CQ fd and
             * every later close() draining to its deadline */
            __atomic_sub_fetch(&r->outstanding, open, __ATOMIC_RELAXED);
            if (kx_peer_is(r, x->peer, x->gen))     /* not a removed peer's leftover */
                for (int64_t k = 0; k < open; k++)
                    kx_peer_uncount(r, x->peer, 0);
            killed++;
        }
    }
    for (size_t i = 0; r->pdir && i < r->peer_hi; i++) {
        kx_peer *c = r->pdir[i / KX_PEER_CHUNK];
        if (!c) {
            i += KX_PEER_CHUNK - 1 - i % KX_PEER_CHUNK;
            continue;
        }
        kx_peer *p = &c[i % KX_PEER_CHUNK];
        if (!p->used || p->dead)
            continue;
        int d = 0;
        if (p->local && __atomic_load_n(&p->local->closed, __ATOMIC_SEQ_CST))
            d = EPIPE;
        else if (__atomic_load_n(&p->out, __ATOMIC_ACQUIRE) > 0 && p->pidfd >= 0 && kx_pidfd_exited(p->pidfd))
            d = ECONNRESET;
        else if (__atomic_load_n(&p->out, __ATOMIC_ACQUIRE) > 0 && r->peer_timeout_ns > 0 &&
                 now - __atomic_load_n(&p->last_ns, __ATOMIC_ACQUIRE) > r->peer_timeout_ns)
            d = ETIMEDOUT;
        else if (r->peer_timeout_ns > 0 && __atomic_load_n(&p->refused_ns, __ATOMIC_ACQUIRE) &&
                 now - __atomic_load_n(&p->refused_ns, __ATOMIC_ACQUIRE) > r->peer_timeout_ns)
            d = ETIMEDOUT;
        if (d) {
            kx_peer_kill_locked(r, (fi_addr_t)i, d);
            killed++;
        }
    }
    pthread_mutex_unlock(&r->hub->lock);
    return killed;
}

/* operations outstanding to peers not known dead (what a drain may still wait for) */
int64_t kx_outstanding_live(kx_rail *r)
{
    int64_t n = __atomic_load_n(&r->outstanding, __ATOMIC_SEQ_CST);
    if (n <= 0)
        return 0;
    pthread_mutex_lock(&r->hub->lock);
    for (size_t i = 0; r->pdir && i < r->peer_hi; i++) {
        kx_peer *c = r->pdir[i / KX_PEER_CHUNK];
        if (!c) {
            i += KX_PEER_CHUNK - 1 - i % KX_PEER_CHUNK;
            continue;
        }
        kx_peer *p = &c[i % KX_PEER_CHUNK];
        if (p->used && p->dead)
            n -= __atomic_load_n(&p->out, __ATOMIC_ACQUIRE);
    }
    pthread_mutex_unlock(&r->hub->lock);
    return n;
}

/* teardown: drop every peer entry (after the endpoint is closed) */
void kx_peers_free(kx_rail *r)
{
    for (size_t k = 0; r->pdir && k < KX_PEER_CHUNKS; k++) {
        kx_peer *c = r->pdir[k];
        if (!c)
            continue;
        for (size_t i = 0; i < KX_PEER_CHUNK; i++) {
            if (c[i].used && c[i].local)
                kx_local_unref(c[i].local);
            if (c[i].used && c[i].pidfd >= 0)
                close(c[i].pidfd);
            if (c[i].used) {
                kx_shm_lock_unmap(c[i].map);
                kx_bell_close(c[i].bell);
            }
        }
        free(c);
    }
    free(r->pdir);
    r->pdir = NULL;
    if (r->self_local) {
        kx_local_unref(r->self_local);
        r->self_local = NULL;
    }
}


