/* watcher.c: the layer watcher. A dedicated native thread polls a 64-bit counter word that a
 * model bumps once per layer (plain host memory on a CPU model; pinned host memory mapped
 * into the GPU for CUDA) and, when the word reaches an armed entry's threshold, posts that
 * entry's prepared writes through kx_write: the same walker and message rule as every other
 * write, so kx_count_messages of the entry's triples is exactly what the target sees.
 *
 * Entries (kx_watch) are kept sorted by threshold (stable: equal thresholds post in arming
 * order, so a context armed after a pass's last layer goes after it). An entry is shared by
 * its owner and the armed list (refs); its transfer's caller reference is the entry's.
 *
 * The thread never busy-spins: with nothing armed it sleeps on its own condition variable
 * (wake); with entries armed it waits on it with a short timeout (poll_ns, timer slack lowered
 * to 1 us so a 10 us wait is one), and kx_watcher_bump (a CPU model) signals it at once. With
 * poll_ns 0 it never polls: armed or not it sleeps until a bump, an advance, an arm of an
 * entry due now or the close signals wake (a counter only this process's CPU changes,
 * through kx_watcher_bump and kx_watcher_advance; a word a kernel or another process writes
 * needs the poll). wake is the
 * thread's alone (the waiters on entries sleep on cond), so no signal meant for it can wake
 * a waiter instead. Disarming an
 * entry that the thread is posting right now waits until that post returned, so the caller
 * learns exactly which entries were posted (the messenger's abort fence needs that). */
#include "internal.h"

#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#define KX_LAT_SAMPLES 8192
#define KX_RUN_SLOTS 256       /* run_end's slots: threshold mod 256 */


struct kx_watch {
    struct kx_watch *next;     /* the armed list */
    int refs;                  /* owner + armed list (under the watcher's lock) */
    int state;
    int error;                 /* kx_write's failure, a positive errno */
    uint64_t threshold;
    uint64_t tag;
    int64_t planned;
    int64_t fired_ns;
    kx_rail *rail;
    kx_transfer *x;            /* set once posted; its caller reference is ours */
    fi_addr_t peer;
    uint32_t gen;            /* the peer slot's generation at arm time (kx_peer_enter) */
    char *src_base;
    void *desc;
    uint64_t dst_base, key;
    kx_direct *direct;         /* one reference, or NULL (RMA) */
    uint64_t *triples;         /* 3 n words: src, dst, length */
    size_t n;
    uint64_t bytes;            /* the lengths' sum */
    int has_imm;
    uint32_t imm;
    int leaving;               /* kx_watch_disarm_many: unlink it on this walk (under the lock) */
    size_t iov;
    uint64_t max_write, pack_min;
};

struct kx_watcher {
    pthread_mutex_t lock;
    pthread_cond_t cond;       /* waiters on entries and on the thread's exit */
    pthread_cond_t wake;       /* the thread alone sleeps here */
    pthread_t thread;
    int started, stop, leaked, exited;
    pid_t tid;
    volatile uint64_t *word;
    uint64_t *own_word;
    int64_t poll_ns;           /* 0: never polls (woken by bump, advance, a due arm, close) */
    cpu_set_t cpus;
    int pin;
    kx_watch *armed;           /* sorted by threshold */
    size_t narmed;
    /* a cache of where each threshold's run ends: slot t % 256 is NULL or the entry last
     * armed at a threshold t of that slot, still on the list (its run's end: later arms of t
     * go after it); cleared when that entry leaves the list. A request arms each layer's
     * threshold once per region pair, so without it each batch walked the whole list */
    kx_watch *run_end[KX_RUN_SLOTS];
    uint64_t seen;             /* last value acted on */
    int64_t bump_ns;           /* time of the last CPU bump not yet followed by a post */
    int64_t lat_call[KX_LAT_SAMPLES], lat_post[KX_LAT_SAMPLES];
    size_t nlat;
    uint64_t fired, wakeups;
    int rt;                    /* SCHED_FIFO priority it runs at, 0 if none */
    int rt_wanted;             /* ... the priority asked for (set before the thread starts) */
};

/* under the lock: e leaves the armed list (run_end must not point at it) */
static void leave_run_locked(kx_watcher *w, const kx_watch *e)
{
    if (w->run_end[e->threshold % KX_RUN_SLOTS] == e)
        w->run_end[e->threshold % KX_RUN_SLOTS] = NULL;
}

static void watch_release_locked(kx_watcher *w, kx_watch *e, int *free_it)
{
    (void)w;
    *free_it = --e->refs == 0;
}

static void watch_destroy(kx_watch *e)
{
    if (e->x)
        kx_transfer_release(e->rail, e->x);
    kx_direct_unref(e->direct);
    free(e->triples);
    free(e);
}

static void post_batch(kx_watcher *w, kx_watch *batch)
{
    int64_t bump_ns = 0;
    pthread_mutex_lock(&w->lock);
    bump_ns = w->bump_ns;
    w->bump_ns = 0;
    pthread_mutex_unlock(&w->lock);
    int first = 1;
    for (kx_watch *e = batch; e; e = e->next) {
        int64_t t0 = kx_now_ns();
        kx_transfer *x = NULL;
        int ret = kx_write(e->rail, e->peer, e->gen, e->src_base, e->desc, e->dst_base, e->key, e->direct, e->triples,
                           e->triples + e->n, e->triples + 2 * e->n, e->n, e->has_imm, e->imm, e->iov,
                           e->max_write, e->pack_min, &x);
        kx_direct_unref(e->direct);    /* the entry posts no more; the transfer holds its own */
        e->direct = NULL;
        int64_t t1 = kx_now_ns();
        pthread_mutex_lock(&w->lock);
        if (first && bump_ns && w->nlat < KX_LAT_SAMPLES) {
            w->lat_call[w->nlat] = t0 - bump_ns;
            w->lat_post[w->nlat] = t1 - bump_ns;
            w->nlat++;
        }
        first = 0;
        e->fired_ns = t0;
        if (ret) {
            e->state = KX_WATCH_FAILED;
            e->error = -ret;
        } else {
            e->x = x;
            e->state = KX_WATCH_POSTED;
        }
        w->fired++;
        pthread_mutex_unlock(&w->lock);
    }
}

static void *watcher_main(void *arg)
{
    kx_watcher *w = arg;
    w->tid = (pid_t)syscall(SYS_gettid);
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);   /* 1 us: a 10 us wait really is one */
    if (w->rt_wanted <= 0)
        kx_sched_short_slice();   /* a bump wakes it past a busy thread of its core */
    pthread_mutex_lock(&w->lock);
    while (!w->stop) {
        if (!w->armed) {
            pthread_cond_wait(&w->wake, &w->lock);
            w->wakeups++;
            continue;
        }
        /* read under the lock: an advance adds before it takes the lock to signal (a bump adds
         * under it), so either this read sees its value or the signal comes after this thread
         * waits (none is lost) */
        uint64_t v = __atomic_load_n(w->word, __ATOMIC_ACQUIRE);
        if (w->armed->threshold > v) {
            if (w->poll_ns) {
                struct timespec ts;
                kx_deadline(&ts, w->poll_ns);
                pthread_cond_timedwait(&w->wake, &w->lock, &ts);
            } else {
                pthread_cond_wait(&w->wake, &w->lock);
            }
            w->wakeups++;
            continue;
        }
        /* take every due entry, in order; they stay referenced by the list's reference */
        kx_watch *head = w->armed, *tail = w->armed;
        head->state = KX_WATCH_POSTING;
        leave_run_locked(w, head);
        w->narmed--;
        while (tail->next && tail->next->threshold <= v) {
            tail = tail->next;
            tail->state = KX_WATCH_POSTING;
            leave_run_locked(w, tail);
            w->narmed--;
        }
        w->armed = tail->next;
        tail->next = NULL;
        w->seen = v;
        pthread_mutex_unlock(&w->lock);
        post_batch(w, head);
        pthread_mutex_lock(&w->lock);
        kx_watch *dead = NULL;
        for (kx_watch *e = head, *nx; e; e = nx) {
            nx = e->next;
            int f;
            watch_release_locked(w, e, &f);
            if (f) {
                e->next = dead;
                dead = e;
            } else {
                e->next = NULL;
            }
        }
        pthread_cond_broadcast(&w->cond);
        pthread_mutex_unlock(&w->lock);
        for (kx_watch *e = dead, *nx; e; e = nx) {
            nx = e->next;
            watch_destroy(e);
        }
        pthread_mutex_lock(&w->lock);
    }
    w->exited = 1;
    pthread_cond_broadcast(&w->cond);
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

int kx_watcher_open(uint64_t *word, int64_t poll_ns, const int *cpus, int ncpus, int rt_priority, kx_watcher **out)
{
    kx_watcher *w = calloc(1, sizeof(*w));
    if (!w)
        return -FI_ENOMEM;
    if (!word) {
        if (posix_memalign((void **)&w->own_word, 64, 64)) {
            free(w);
            return -FI_ENOMEM;
        }
        memset(w->own_word, 0, 64);
        word = w->own_word;
    }
    w->word = word;
    w->poll_ns = poll_ns >= 0 ? poll_ns : 10000;
    pthread_mutex_init(&w->lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&w->cond, &ca);
    pthread_cond_init(&w->wake, &ca);
    pthread_condattr_destroy(&ca);
    CPU_ZERO(&w->cpus);
    for (int i = 0; i < ncpus; i++) {
        if (cpus[i] >= 0 && cpus[i] < CPU_SETSIZE)
            CPU_SET(cpus[i], &w->cpus);
    }
    w->pin = ncpus > 0;
    w->rt_wanted = rt_priority;
    int ret = pthread_create(&w->thread, NULL, watcher_main, w);
    if (ret) {
        pthread_cond_destroy(&w->cond);
        pthread_cond_destroy(&w->wake);
        pthread_mutex_destroy(&w->lock);
        free(w->own_word);
        free(w);
        return -ret;
    }
    w->started = 1;
    pthread_setname_np(w->thread, "kvxfer-watch");
    if (w->pin)
        pthread_setaffinity_np(w->thread, sizeof(w->cpus), &w->cpus);
    if (rt_priority > 0) {
        /* SCHED_FIFO: the thread sleeps between polls, so it costs no more CPU, but a bump
         * is acted on without waiting for a busy core's time slice */
        struct sched_param sp = {.sched_priority = rt_priority};
        w->rt = pthread_setschedparam(w->thread, SCHED_FIFO, &sp) == 0 ? rt_priority : 0;
    }
    *out = w;
    return 0;
}

uint64_t *kx_watcher_word(kx_watcher *w)
{
    return (uint64_t *)w->word;
}

uint64_t kx_watcher_value(const kx_watcher *w)
{
    return __atomic_load_n(w->word, __ATOMIC_ACQUIRE);
}

uint64_t kx_watcher_bump(kx_watcher *w, uint64_t n)
{
    int64_t now = kx_now_ns();
    /* add under the lock: the thread reads the word under it too, so it cannot take the entry
     * this bump made due before bump_ns is set (that lost the bump's latency sample) */
    pthread_mutex_lock(&w->lock);
    uint64_t v = __atomic_add_fetch(w->word, n, __ATOMIC_ACQ_REL);
    if (w->armed && w->armed->threshold <= v && !w->bump_ns)
        w->bump_ns = now;
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->lock);
    return v;
}

uint64_t kx_watcher_advance(kx_watcher *w, uint64_t to)
{
    uint64_t v = __atomic_load_n(w->word, __ATOMIC_ACQUIRE);
    while (v < to && !__atomic_compare_exchange_n(w->word, &v, to, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        ;
    pthread_mutex_lock(&w->lock);
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->lock);
    return v < to ? to : v;
}

/* an offset, a length or a threshold the Python checks would refuse (each below 2**62) */
#define KX_WATCH_LIMIT (1ULL << 62)

/* one entry, not yet on the list: 0, -FI_ENOMEM, or -ERANGE where a triple of its copy is
 * outside its bounds (src_size, dst_size, each value below KX_WATCH_LIMIT) */
static int watch_new(uint64_t threshold, uint64_t tag, kx_rail *r, fi_addr_t peer, uint32_t gen,
                     char *src_base, void *desc, uint64_t dst_base, uint64_t key, kx_direct *direct,
                     const uint64_t *src_off, const uint64_t *dst_off, const uint64_t *length, size_t n,
                     const kx_watch_bounds *b, int has_imm, uint32_t imm, size_t iov, uint64_t max_write,
                     uint64_t pack_min, kx_watch **out)
{
    kx_watch *e = calloc(1, sizeof(*e));
    if (!e)
        return -FI_ENOMEM;
    if (n) {
        e->triples = malloc(3 * n * sizeof(uint64_t));
        if (!e->triples) {
            free(e);
            return -FI_ENOMEM;
        }
        memcpy(e->triples, src_off, n * sizeof(uint64_t));
        memcpy(e->triples + n, dst_off, n * sizeof(uint64_t));
        memcpy(e->triples + 2 * n, length, n * sizeof(uint64_t));
    }
    /* checked on the copy: another thread may change the caller's arrays meanwhile */
    const uint64_t *so = e->triples, *dof = e->triples + n, *ln = e->triples + 2 * n;
    uint64_t bytes = 0;
    for (size_t i = 0; i < n; i++) {
        if (so[i] >= KX_WATCH_LIMIT || dof[i] >= KX_WATCH_LIMIT || ln[i] >= KX_WATCH_LIMIT
            || so[i] + ln[i] > b->src_size || dof[i] + ln[i] > b->dst_size || bytes + ln[i] < bytes) {
            free(e->triples);
            free(e);
            return -ERANGE;
        }
        bytes += ln[i];
    }
    e->n = n;
    e->bytes = bytes;
    e->planned = kx_count_messages(so, dof, ln, n, iov, max_write, pack_min);
    e->threshold = threshold;
    e->tag = tag;
    e->rail = r;
    e->peer = peer;
    e->gen = gen;
    e->src_base = src_base;
    e->desc = desc;
    e->dst_base = dst_base;
    e->key = key;
    kx_direct_ref(direct);
    e->direct = direct;
    e->has_imm = has_imm;
    e->imm = imm;
    e->iov = iov;
    e->max_write = max_write;
    e->pack_min = pack_min;
    e->refs = 2;
    e->state = KX_WATCH_ARMED;
    *out = e;
    return 0;
}

static void watch_free_new(kx_watch *e)
{
    kx_direct_unref(e->direct);
    free(e->triples);
    free(e);
}

int kx_watch_arm_groups(kx_watcher *w, size_t ng, const uint64_t *thresholds, const int64_t *starts, uint64_t tag,
                        kx_rail *r, fi_addr_t peer, uint32_t gen, char *src_base, void *desc, uint64_t dst_base,
                        uint64_t key, kx_direct *direct, const uint64_t *src_off, const uint64_t *dst_off,
                        const uint64_t *length, const kx_watch_bounds *b, int has_imm, uint32_t imm, size_t iov,
                        uint64_t max_write, uint64_t pack_min, kx_watch **out)
{
    /* what kx_write would refuse when the entry fires: refused now, so the entry's count is real */
    if (!kx_limits_ok(r, iov, max_write, pack_min))
        return -FI_EINVAL;
    if (b->base >= KX_WATCH_LIMIT)
        return -ERANGE;
    /* each start and threshold read once, so a caller's array changed meanwhile cannot make
     * a group's bounds disagree with what was checked */
    int64_t a = starts[0], total_n = (int64_t)b->n;
    if (a != 0)
        return -ERANGE;
    uint64_t total = 0;
    int ret = 0;
    size_t g;
    for (g = 0; g < ng; g++) {
        int64_t e_ = starts[g + 1];
        uint64_t th = thresholds[g];
        if (e_ < a || e_ > total_n || th >= KX_WATCH_LIMIT - b->base) {
            ret = -ERANGE;
            break;
        }
        ret = watch_new(b->base + th, tag, r, peer, gen, src_base, desc, dst_base, key, direct, src_off + a,
                        dst_off + a, length + a, (size_t)(e_ - a), b, has_imm, imm, iov, max_write, pack_min,
                        &out[g]);
        if (ret)
            break;
        if (total + out[g]->bytes < total) {
            watch_free_new(out[g]);
            ret = -ERANGE;
            break;
        }
        total += out[g]->bytes;
        a = e_;
    }
    if (!ret && a != total_n)
        ret = -ERANGE;
    if (ret) {
        while (g--)
            watch_free_new(out[g]);
        return ret;
    }
    pthread_mutex_lock(&w->lock);
    if (w->stop) {
        pthread_mutex_unlock(&w->lock);
        for (size_t g = 0; g < ng; g++)
            watch_free_new(out[g]);
        return -FI_ECANCELED;
    }
    /* after every entry of a lower or equal threshold (arming order within a threshold):
     * right after its run's end where run_end knows it, else a walk that goes on from the
     * last insertion while thresholds do not go down (a rank pair's layers) */
    int was_empty = w->armed == NULL;
    kx_watch **p = &w->armed;
    for (size_t g = 0; g < ng; g++) {
        kx_watch *e = out[g];
        kx_watch *end = w->run_end[e->threshold % KX_RUN_SLOTS];
        if (end && end->threshold == e->threshold) {
            p = &end->next;
        } else {
            if (g && e->threshold < out[g - 1]->threshold)
                p = &w->armed;
            while (*p && (*p)->threshold <= e->threshold)
                p = &(*p)->next;
        }
        e->next = *p;
        *p = e;
        p = &e->next;
        w->run_end[e->threshold % KX_RUN_SLOTS] = e;
        w->narmed++;
    }
    /* the thread needs waking only for an entry due now, or to start polling (it waits
     * without a deadline while nothing is armed): waking it for anything else would cost
     * the armer a wake-up, and often its core, per call (a bump or an advance signals anyway) */
    if (ng && (w->armed->threshold <= __atomic_load_n(w->word, __ATOMIC_ACQUIRE) || (w->poll_ns && was_empty)))
        pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->lock);
    return 0;
}

int kx_watch_arm(kx_watcher *w, uint64_t threshold, uint64_t tag, kx_rail *r, fi_addr_t peer, uint32_t gen,
                 char *src_base, void *desc, uint64_t dst_base, uint64_t key, kx_direct *direct,
                 const uint64_t *src_off, const uint64_t *dst_off, const uint64_t *length, size_t n,
                 const kx_watch_bounds *b, int has_imm, uint32_t imm, size_t iov, uint64_t max_write,
                 uint64_t pack_min, kx_watch **out)
{
    int64_t starts[2] = {0, (int64_t)n};
    kx_watch_bounds one = *b;
    one.n = n;
    return kx_watch_arm_groups(w, 1, &threshold, starts, tag, r, peer, gen, src_base, desc, dst_base, key, direct,
                               src_off, dst_off, length, &one, has_imm, imm, iov, max_write, pack_min, out);
}

int64_t kx_watch_planned(const kx_watch *e)
{
    return e->planned;
}

uint64_t kx_watch_bytes(const kx_watch *e)
{
    return e->bytes;
}

void kx_watch_get_state(kx_watcher *w, const kx_watch *e, kx_watch_state *out)
{
    pthread_mutex_lock(&w->lock);
    out->state = e->state;
    out->error = e->error;
    out->threshold = e->threshold;
    out->planned = e->planned;
    out->fired_ns = e->fired_ns;
    out->transfer = e->state == KX_WATCH_POSTED ? e->x : NULL;
    pthread_mutex_unlock(&w->lock);
}

/* under the lock: unlink an armed entry (the list's reference goes to the caller) */
static int unlink_locked(kx_watcher *w, kx_watch *e)
{
    for (kx_watch **p = &w->armed; *p; p = &(*p)->next) {
        if (*p == e) {
            *p = e->next;
            e->next = NULL;
            leave_run_locked(w, e);
            w->narmed--;
            return 1;
        }
    }
    return 0;
}

int kx_watch_disarm(kx_watcher *w, kx_watch *e)
{
    int freed = 0, disarmed = 0;
    pthread_mutex_lock(&w->lock);
    while (e->state == KX_WATCH_POSTING)
        pthread_cond_wait(&w->cond, &w->lock);
    if (e->state == KX_WATCH_ARMED && unlink_locked(w, e)) {
        e->state = KX_WATCH_DISARMED;
        disarmed = 1;
        watch_release_locked(w, e, &freed);
        pthread_cond_broadcast(&w->cond);
    }
    pthread_mutex_unlock(&w->lock);
    (void)freed;              /* the owner still holds its reference */
    return disarmed;
}

size_t kx_watch_disarm_many(kx_watcher *w, kx_watch *const *es, size_t n, int *disarmed)
{
    size_t marked = 0, done = 0;
    pthread_mutex_lock(&w->lock);
    /* until none of the set is posting (the thread may take more while we wait) */
    for (size_t i = 0; i < n;) {
        if (es[i]->state == KX_WATCH_POSTING) {
            pthread_cond_wait(&w->cond, &w->lock);
            i = 0;
        } else {
            i++;
        }
    }
    /* and none can start while we hold the lock */
    for (size_t i = 0; i < n; i++) {
        disarmed[i] = es[i]->state == KX_WATCH_ARMED && !es[i]->leaving;
        if (disarmed[i]) {
            es[i]->leaving = 1;
            marked++;
        }
    }
    for (kx_watch **p = &w->armed; *p && done < marked;) {
        kx_watch *e = *p;
        if (!e->leaving) {
            p = &e->next;
            continue;
        }
        *p = e->next;
        e->next = NULL;
        e->leaving = 0;
        leave_run_locked(w, e);
        w->narmed--;
        e->state = KX_WATCH_DISARMED;
        int f;
        watch_release_locked(w, e, &f);   /* the list's reference; the owner still holds its own */
        (void)f;
        done++;
    }
    for (size_t i = 0; i < n && done < marked; i++) {
        if (es[i]->leaving) {             /* armed but not on the list: never the case; say so */
            es[i]->leaving = 0;
            disarmed[i] = 0;
            marked--;
        }
    }
    if (marked)
        pthread_cond_broadcast(&w->cond);
    pthread_mutex_unlock(&w->lock);
    return done;
}

size_t kx_watcher_disarm_tag(kx_watcher *w, uint64_t tag)
{
    size_t n = 0;
    pthread_mutex_lock(&w->lock);
    kx_watch **p = &w->armed;
    kx_watch *dead = NULL;
    while (*p) {
        kx_watch *e = *p;
        if (e->tag == tag) {
            *p = e->next;
            leave_run_locked(w, e);
            w->narmed--;
            e->state = KX_WATCH_DISARMED;
            int f;
            watch_release_locked(w, e, &f);
            if (f) {
                e->next = dead;
                dead = e;
            } else {
                e->next = NULL;
            }
            n++;
        } else {
            p = &e->next;
        }
    }
    pthread_cond_broadcast(&w->cond);
    pthread_mutex_unlock(&w->lock);
    for (kx_watch *e = dead, *nx; e; e = nx) {
        nx = e->next;
        watch_destroy(e);
    }
    return n;
}

int kx_watch_wait(kx_watcher *w, kx_watch *e, int64_t slice_ns)
{
    struct timespec ts;
    kx_deadline(&ts, slice_ns);
    pthread_mutex_lock(&w->lock);
    while ((e->state == KX_WATCH_ARMED || e->state == KX_WATCH_POSTING) && !w->exited) {
        if (pthread_cond_timedwait(&w->cond, &w->lock, &ts) == ETIMEDOUT)
            break;
    }
    int fired = e->state != KX_WATCH_ARMED && e->state != KX_WATCH_POSTING;
    if (!fired && w->exited)
        fired = -1;            /* the thread is gone: it never will */
    pthread_mutex_unlock(&w->lock);
    return fired;
}

void kx_watch_free(kx_watcher *w, kx_watch *e)
{
    int f1 = 0, f2 = 0;
    pthread_mutex_lock(&w->lock);
    while (e->state == KX_WATCH_POSTING)
        pthread_cond_wait(&w->cond, &w->lock);
    if (e->state == KX_WATCH_ARMED && unlink_locked(w, e)) {
        e->state = KX_WATCH_DISARMED;
        watch_release_locked(w, e, &f1);
    }
    watch_release_locked(w, e, &f2);
    pthread_mutex_unlock(&w->lock);
    if (f1 || f2)
        watch_destroy(e);
}

size_t kx_watcher_latencies(kx_watcher *w, int64_t *call_ns, int64_t *post_ns, size_t max)
{
    pthread_mutex_lock(&w->lock);
    size_t n = w->nlat < max ? w->nlat : max;
    memcpy(call_ns, w->lat_call, n * sizeof(int64_t));
    memcpy(post_ns, w->lat_post, n * sizeof(int64_t));
    w->nlat = 0;
    pthread_mutex_unlock(&w->lock);
    return n;
}

void kx_watcher_get_stats(kx_watcher *w, kx_watcher_stats *out)
{
    pthread_mutex_lock(&w->lock);
    out->armed = w->narmed;
    out->fired = w->fired;
    out->wakeups = w->wakeups;
    out->tid = w->tid;
    out->rt = w->rt;
    pthread_mutex_unlock(&w->lock);
}

int kx_watcher_close(kx_watcher *w, int64_t timeout_ns)
{
    pthread_mutex_lock(&w->lock);
    if (!w->started || w->exited) {
        w->stop = 1;
        pthread_mutex_unlock(&w->lock);
        if (w->started && !w->leaked) {
            pthread_join(w->thread, NULL);
            w->started = 0;
        }
        return 0;
    }
    w->stop = 1;
    pthread_cond_signal(&w->wake);
    struct timespec ts;
    kx_deadline(&ts, timeout_ns);
    while (!w->exited) {
        if (pthread_cond_timedwait(&w->cond, &w->lock, &ts) == ETIMEDOUT)
            break;
    }
    int exited = w->exited;
    pthread_mutex_unlock(&w->lock);
    if (!exited) {
        w->leaked = 1;       /* stuck inside a post: never free what it uses */
        return -FI_ETIMEDOUT;
    }
    pthread_join(w->thread, NULL);
    w->started = 0;
    return 0;
}

void kx_watcher_free(kx_watcher *w)
{
    if (!w || w->leaked)
        return;
    kx_watcher_close(w, 5000000000LL);
    if (w->leaked)
        return;
    /* entries still armed belong to their owners too: drop the list's references */
    pthread_mutex_lock(&w->lock);
    kx_watch *dead = NULL;
    while (w->armed) {
        kx_watch *e = w->armed;
        w->armed = e->next;
        leave_run_locked(w, e);
        e->state = KX_WATCH_DISARMED;
        int f;
        watch_release_locked(w, e, &f);
        if (f) {
            e->next = dead;
            dead = e;
        } else {
            e->next = NULL;
        }
    }
    pthread_mutex_unlock(&w->lock);
    for (kx_watch *e = dead, *nx; e; e = nx) {
        nx = e->next;
        watch_destroy(e);
    }
    /* the owner frees its entries with kx_watch_free before the watcher (Cython keeps a
     * reference from each entry to its watcher) */
    pthread_cond_destroy(&w->cond);
    pthread_cond_destroy(&w->wake);
    pthread_mutex_destroy(&w->lock);
    free(w->own_word);
    free(w);
}
