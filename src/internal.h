/* internal.h: the native engine's private structs and the declarations its translation
 * units share. Not installed, not mirrored in Cython: the public API is kvxfer/kvxfer.h.
 *
 * Ownership: a rail owns fabric/domain/av/cq/ep, its progress thread, its posted receive
 * buffers, its in-flight list and its posting queue. The rails of one engine share a hub
 * (kx_hub, "the hub": the engine's shared state) holding the lock, the condition variable
 * every waiter sleeps on, the imm counter table, the callback queue and the control-message
 * queue. A kx_transfer is shared by its owner (Python) and its in-flight operations
 * (refcount); a kx_counter likewise by its owner and the table entry that will complete it.
 *
 * Threads: posting threads (Python callers, GIL released) post until the provider says
 * -FI_EAGAIN and queue the rest; the progress thread reads the CQ and posts what is queued
 * (or, with KVXFER_DRIVE_US, a waiting thread does while it drives: one reader at a time,
 * under poll_owner; see progress.c). Neither ever touches a Python object. Shared bookkeeping is under the hub's lock;
 * state changes that a waiter cares about broadcast the hub's condition variable. */
#ifndef KVXFER_INTERNAL_H
#define KVXFER_INTERNAL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>

#include "kvxfer/kvxfer.h"

#define KX_RX_BUFS 32          /* posted receive buffers for control messages */
#define KX_CQ_BATCH 64         /* CQ entries read at once */

enum { KX_OP_WRITE = 1, KX_OP_SEND = 2, KX_OP_RECV = 3, KX_OP_READ = 4 };

/* Every context handed to libfabric starts with this header; the fi_context2 scratch space
 * comes first because providers in FI_CONTEXT(2) mode own it until the completion is read. */
typedef struct kx_op {
    struct fi_context2 fi;
    int kind;
    void *owner;           /* kx_transfer*, kx_sendbuf* or kx_rxbuf* */
} kx_op;

struct kx_transfer {
    kx_op shared_op;       /* used for every write when the provider needs no per-op context */
    kx_op *ops;            /* per-op contexts when it does */
    int64_t planned;       /* messages the walk contains */
    uint64_t nbytes;       /* bytes of all its triples (a small one's waiter drives, progress.c) */
    int64_t posted;        /* messages posted so far (atomic) */
    int64_t completed;     /* completions read (success or error) */
    int posting_done;      /* nothing more will be posted */
    int done;              /* waiters may stop: all completed, or failed early (dead peer) */
    int linked;            /* on the in-flight list: the provider may still own its contexts */
    int64_t last_ns;       /* its last post or completion: the per-transfer stall clock */
    int64_t written_off;   /* operations given up on (stalled): their late completions are not the peer's */
    int64_t accepted;      /* messages the provider took (posted counts them from just before the call) */
    int error;             /* first positive errno seen, 0 if none */
    int refs;              /* owner + in-flight */
    struct kx_transfer *prev, *next;   /* the rail's in-flight list */
    struct kx_transfer *qnext;         /* the rail's posting queue */

    /* posting state: a resumable walk (kx_walk) over a private copy of the caller's triples */
    const uint64_t *src_off, *dst_off, *length;
    uint64_t *owned;               /* that copy (3 n words), freed with the transfer */
    size_t n, next_triple;
    uint64_t seg_src, seg_dst, seg_len;   /* the rest of the segment being cut into pieces */
    size_t iov;
    uint64_t max_write, pack_min;
    fi_addr_t peer;
    uint32_t gen;                  /* the peer slot's generation when the caller named it */
    char *src_base;
    void *desc;
    uint64_t dst_base, key, flags;
    uint32_t imm;
    uint64_t revoke_epoch;         /* the hub's revoke_epoch its key was last checked at (revoke.c) */
    kx_direct *direct;             /* direct write (direct.c): the peer region's mapping here, one reference until posting ends */
    char *direct_base;             /* ... its first byte */
    uint64_t copied;               /* direct: bytes of the built message in place (all: its 0-byte write is due) */
    /* how the progress thread posts it: NULL for a write (post.c's pump), read.c's pump for a
     * read (pieces go peer -> here by fi_readmsg); set by the unit that made it */
    int (*pump)(struct kx_rail *r, struct kx_transfer *x, int64_t budget);
    int have_msg;                  /* a built message is waiting for queue space */
    int cancel;                    /* set by kx_transfer_cancel: post nothing more */
    int npieces;                   /* the built message: its pieces */
    uint64_t piece_src[KX_MAX_IOV], piece_dst[KX_MAX_IOV], piece_len[KX_MAX_IOV];
};

struct kx_counter {
    uint32_t imm;
    uint64_t count;
    uint64_t arrived;      /* arrivals credited to this expectation */
    int64_t done_ns;       /* CLOCK_MONOTONIC when it was met (kx_counter_finish_locked) */
    int done;
    int error;
    int want_callback;
    int refs;              /* owner + table entry / callback queue */
    struct kx_counter *next_done;
};

/* one imm's entry in the counter table */
typedef struct kx_imm_entry {
    uint32_t imm;
    int used;
    uint64_t banked;       /* arrivals not yet consumed by an expectation */
    kx_counter *active;    /* the expectation waiting on this imm, if any */
} kx_imm_entry;

/* open addressing, linear probing, backward-shift deletion */
typedef struct kx_imm_table {
    kx_imm_entry *slots;
    size_t cap;            /* power of two */
    size_t len;
} kx_imm_table;

struct kx_msg {
    struct kx_msg *next;
    size_t len;
    int quiet;             /* an ANNOUNCE armed for a waiting caller (announce.c): wakes no reader */
    char data[];
};

#define KX_ARM_KEY_MAX 256     /* the longest secret an arm checks tags with (kx_arm_key) */

/* one registered leg of the messenger's decoder (announce.c) */
struct kx_arm {
    struct kx_arm *next;   /* in its hub bucket, while open */
    uint32_t imm;
    uint64_t src, dst;     /* the ANNOUNCE's sender (the peer's uid) and receiver (ours) */
    uint64_t floor;        /* its seq must be above this */
    uint64_t least, most;  /* the count it may announce */
    int settled;           /* the flag kx_arm_wait waits on first: armed or closed */
    int state;             /* KX_ARM_OPEN, KX_ARM_ARMED, KX_ARM_CLOSED */
    int waiters;           /* callers in kx_arm_wait, and holds (kx_arm_hold; atomic) */
    uint64_t count, seq;   /* armed: what the ANNOUNCE said */
    kx_counter *counter;   /* armed: its expectation (met, or pending with no callback); the
                            * arm holds its owner's reference until kx_arm_close */
};

typedef struct kx_rxbuf {
    kx_op op;
    char *data;
    int repost;            /* its message was taken; post it again */
} kx_rxbuf;

typedef struct kx_sendbuf {
    kx_op op;
    fi_addr_t peer;
    uint32_t gen;          /* the peer slot's generation (kx_peer_enter; completions) */
    struct fid_mr *mr;     /* registered only where the provider wants FI_MR_LOCAL */
    uint64_t token;        /* a control message of the revoke exchange (revoke.c): its completion is
                            * reported as token | KX_CTL_SENT (0: a user message) */
    size_t len;
    char data[];
} kx_sendbuf;

typedef struct kx_hub {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int refs;              /* rails holding it */
    int open;              /* rails whose endpoint is not yet closed */
    kx_imm_table table;
    kx_counter *done_head, *done_tail;   /* counters with callbacks, for the dispatcher */
    int dispatch_stop;
    kx_msg *msg_head, *msg_tail;
    size_t nmsgs;
    /* the revoke exchange (revoke.c) */
    uint64_t *revoked;     /* keys of peers' regions their owners closed: open addressing, 0 = empty */
    size_t revoked_cap, revoked_len;
    uint64_t revoke_epoch; /* bumped by every revocation (atomic): a transfer then checks its key again */
    kx_msg *hello_head, *hello_tail;   /* HELLOs received (peers' addresses), for the engine */
    uint64_t *acks;        /* tokens answered (ACKs in, our own control sends completed) */
    size_t acks_len, acks_cap;
    struct kx_arm *arms[64];   /* open arms by imm (announce.c), chained */
    size_t narms;
    uint8_t arm_key[KX_ARM_KEY_MAX];   /* the messenger's secret: ANNOUNCEs carry an HMAC-SHA256 tag (arm_keylen > 0) */
    size_t arm_keylen;
    size_t nloud;          /* queued messages that are not quiet: what wakes kx_recv_wait */
    pthread_cond_t msg_cond;   /* kx_recv_wait's own: a loud message queued, or closing (no
                                * other completion wakes a messenger thread) */
    uint64_t stat_armed;   /* ANNOUNCEs armed natively */
    uint64_t stat_imm;     /* immediates received */
    uint64_t stat_lost;    /* arrivals that could not be banked (out of memory) */
} kx_hub;

struct kx_rail {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_ep *ep;

    uint64_t mr_mode;
    uint64_t caps;
    size_t iov_limit;
    size_t max_msg_size;
    size_t inject_size;
    size_t cq_data_size;
    int need_ctx;
    int has_wait;

    kx_hub *hub;

    /* progress */
    pthread_t thread;
    int thread_started;
    volatile int stop;
    int spin;              /* busy-poll instead of blocking */
    int posting;           /* callers inside their own posting burst (post.c, KX_CALLER_BUDGET, kx_posting_begin): the progress thread waits on this word */
    int posting_wait;      /* the progress thread waits on `posting` (a futex): the last poster out wakes it */
    int busy;              /* threads inside any native call on the endpoint: teardown waits */
    int leaked;            /* the progress thread could not be joined: never free what it uses */
    int64_t outstanding;   /* tx operations posted and not completed (atomic) */
    int64_t last_activity_ns;
    cpu_set_t cpus;
    int pin;
    int sleeping;          /* the progress thread is blocked; posts must wake it */
    int awake;             /* holds (kx_rail_hold_awake): poll as if operations were outstanding */
    int poll_owner;        /* 1 while a thread reads the CQ (kx_poll + queue): one reader at a time */
    int drivers;           /* waiting threads driving progress themselves: the progress thread parks */
    int yielded;           /* futex word: the progress thread yields the CQ to driving waiters (drivers > 0) */
    int drive_got;         /* the last driver got what it waited for (else it now blocks) */
    int64_t spin_ns;       /* how long a waiter drives before it blocks (0: never drives) */
    int64_t tx_spin_ns;    /* ... a waiter for a small transfer (shm: KX_TX_DRIVE_SHM_NS by default, progress.c) */
    int endpoint_closed;
    int quiesced;
    pid_t tid;             /* the progress thread's kernel id, for tests of pinning */
    int rt_priority;       /* SCHED_FIFO priority the progress thread asks for at its start (0: normal; progress.c) */
    int rt;                /* the priority it runs at (0: normal scheduling) */
    int rt_errno;          /* pthread_setschedparam's refusal (EPERM: no CAP_SYS_NICE / RLIMIT_RTPRIO), 0 if none */
    int rt_done;           /* futex word: the thread has tried (kx_rail_start waits for it) */

    kx_transfer *inflight;        /* transfers not yet done */
    kx_transfer *q_head, *q_tail; /* transfers with messages still to post (progress thread posts) */
    int cancel_pending;           /* a queued transfer was cancelled: sweep the queue */

    /* peers (peers.c): a fixed directory of lazily allocated chunks, indexed by fi_addr */
    struct kx_peer **pdir;
    size_t peer_hi;            /* one past the highest fi_addr ever tracked */
    int64_t peer_timeout_ns;   /* outstanding to a peer and silent this long: it is dead (0: never) */
    int delivery_complete;     /* writes complete only once placed at the target (refusals surface) */
    int64_t last_scan_ns;
    int64_t eagain_ns;         /* the progress thread's last post refused with -FI_EAGAIN */
    struct kx_local *self_local;   /* this endpoint, as other rails of this process see it */
    struct kx_unblock *unblock;    /* shm: our own response queue, answered for dead peers (unblock.c); NULL: none */
    pthread_mutex_t av_lock;   /* one AV change at a time: kx_av_insert, kx_av_remove, forget.c */
    int parked;                /* the endpoint is left open, unprogressed, never closed (kx_rail_park) */
    int took_msgs;             /* a control message arrived (someone connected to us) */
    int shm;                   /* a shm rail: same-process peers share regions (rail.c, deferral) */
    int deferred;              /* shm: closing, its fids wait until no open engine maps it (1), being closed (2) */
    int wrote_off;             /* an operation was given up on (kx_peers_scan): a peer may still hold it */
    int domain_requested;      /* deferred: kx_rail_close_domain was called */
    int free_requested;        /* deferred: kx_rail_free was called; the final step frees it */

    struct kx_ctl_ack *ack_head;   /* ACKs the progress thread still has to post (revoke.c) */

    kx_rxbuf rx[KX_RX_BUFS];
    struct fid_mr *rx_mr;  /* the receive slab's registration (FI_MR_LOCAL providers) */
    void *rx_desc;

    uint64_t stat_rx_err;  /* error completions not tied to a transfer */
    uint64_t stat_writes;  /* messages posted */
    uint64_t stat_direct;  /* messages copied through a direct mapping (direct.c) */
    uint64_t stat_direct_revoked;  /* direct messages whose copy the target's permit refused (direct.c) */
    uint64_t stat_bell_rings;  /* posts of ours that woke a sleeping peer through its bell */
    uint64_t stat_bell_wakes;  /* sleeps of our progress thread that a peer's ring ended */
    uint64_t stat_drives;      /* waits that drove progress themselves (progress.c, kx_drive) */
    uint64_t stat_drives_got;  /* ... and got what they waited for within their window */
    uint64_t stat_naps;        /* pauses the progress thread napped, the core being contended (progress.c) */
    int long_yields;           /* progress thread's own: long yields in a row */
    int64_t probe_ns;          /* progress thread's own: two yields in a row took a slice (the core is
                                * contended), so it sleeps instead of yielding until this time, then yields again */

    struct kx_bell *bell;  /* shm: our doorbell (bell.c), NULL without one */
    char *bell_path;
};

static inline int64_t kx_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Ask for a short scheduler slice for the calling thread (sched.c): 0, or -errno */
int kx_sched_short_slice(void);

/* One step of a bounded wait on another thread or process (a peer's lock, a permit's
 * writers): a live holder lets go within microseconds, so yield the first 64 times, then nap
 * `nap_ns` (one that never lets go must not cost a core). */
static inline void kx_pause(int step, long nap_ns)
{
    if (step < 64) {
        sched_yield();
    } else {
        struct timespec ts = {0, nap_ns};
        nanosleep(&ts, NULL);
    }
}

/* `ns` from now on `clock`: CLOCK_MONOTONIC for the hub's condition variables (kx_deadline),
 * CLOCK_REALTIME for the calls that know no other (pthread_timedjoin_np) */
static inline void kx_deadline_on(clockid_t clock, struct timespec *ts, int64_t ns)
{
    clock_gettime(clock, ts);
    ts->tv_sec += ns / 1000000000LL;
    ts->tv_nsec += ns % 1000000000LL;
    if (ts->tv_nsec >= 1000000000L) { ts->tv_sec++; ts->tv_nsec -= 1000000000L; }
}

static inline void kx_deadline(struct timespec *ts, int64_t ns)
{
    kx_deadline_on(CLOCK_MONOTONIC, ts, ns);
}

/* wait on the hub's condition until *flag is set or the slice passes; returns *flag */
int kx_hub_wait_flag(kx_hub *h, const int *flag, int64_t slice_ns);

/* ---- counters.c: the hub and its imm table (everything *_locked runs under hub->lock) -- */
kx_hub *kx_hub_new(void);
void kx_hub_unref(kx_hub *h);                   /* frees it with the last rail */
kx_imm_entry *kx_imm_table_find(kx_imm_table *t, uint32_t imm);
kx_imm_entry *kx_imm_table_get(kx_imm_table *t, uint32_t imm);    /* NULL: out of memory */
void kx_imm_table_del(kx_imm_table *t, kx_imm_entry *c);
int kx_hub_arrival_locked(kx_hub *h, uint32_t imm);     /* -FI_ENOMEM: not banked */
int kx_hub_expect(kx_hub *h, uint32_t imm, uint64_t count, int want_callback, kx_counter **out);
int kx_hub_expect_locked(kx_hub *h, kx_counter *c);   /* c: calloc'ed with imm, count, want_callback */
uint64_t kx_hub_banked_locked(kx_hub *h, uint32_t imm);
/* announce.c: under the hub lock, for a control message just received: 1 if it was an
 * ANNOUNCE an open arm took (its count met from banked arrivals), 2 if an arm took it with a
 * caller waiting (met or not: the message is queued quiet), else 0 */
int kx_arm_try_locked(kx_hub *h, const char *data, size_t len);
void kx_arm_clear_locked(kx_hub *h);
int kx_hub_arm_key(kx_hub *h, const uint8_t *key, size_t len);
int kx_hub_arm_open(kx_hub *h, uint32_t imm, uint64_t src, uint64_t dst, uint64_t floor, uint64_t least,
                    uint64_t most, kx_arm **out);
int kx_hub_arm_close(kx_hub *h, kx_arm *a, uint64_t max_seq, uint64_t *count, uint64_t *seq, kx_counter **counter);
void kx_hub_arm_free(kx_hub *h, kx_arm *a);
void kx_hub_counter_drop(kx_hub *h, kx_counter *c);
void kx_hub_counter_drop_locked(kx_hub *h, kx_counter *c, int rebank);
void kx_counter_release_locked(kx_counter *c);
uint64_t kx_hub_banked(kx_hub *h, uint32_t imm);
uint64_t kx_hub_discard(kx_hub *h, uint32_t imm, kx_counter **withdrawn);
void kx_hub_fail_counters_locked(kx_hub *h, int err, int release);
void kx_hub_clear_queues_locked(kx_hub *h);

/* ---- gate.c: the bottom primitives (kx_posting_begin/end: kvxfer.h) ------------------ */
int kx_enter(kx_rail *r);     /* 0: the rail is closing, do not touch the endpoint */
void kx_leave(kx_rail *r);
void kx_posting_wait(kx_rail *r);   /* the progress thread: until the callers' bursts end (1 ms at most) */
void kx_wake(kx_rail *r);

/* ---- progress.c ------------------------------------------------------------------- */
void kx_progress_rt_await(kx_rail *r);   /* kx_rail_start: until the thread tried SCHED_FIFO */
/* kx_hub_wait_flag, but the waiter first drives progress on r for up to r->spin_ns */
int kx_wait_flag(kx_rail *r, const int *flag, int64_t slice_ns);
/* kx_wait_flag for a small transfer's done flag: the waiter drives for up to r->tx_spin_ns */
#define KX_TX_DRIVE_MAX_BYTES 65536u
int kx_wait_transfer_flag(kx_rail *r, const int *flag, int64_t slice_ns);
/* the waiter drives progress until *head is non-NULL or its window passes; returns the
 * part of slice_ns left for a blocking wait */
int64_t kx_drive_for_message(kx_rail *r, void *const *head, int64_t slice_ns);
int kx_post_recv(kx_rail *r, kx_rxbuf *b);
void *kx_progress_main(void *arg);

/* ---- transfer.c: life cycle (*_locked under hub->lock) ------------------------------ */
void kx_transfer_release_locked(kx_transfer *x);
void kx_transfer_link_locked(kx_rail *r, kx_transfer *x);
void kx_transfer_check_done_locked(kx_rail *r, kx_transfer *x);
void kx_transfer_finish_posting_locked(kx_rail *r, kx_transfer *x);

/* ---- post.c ----------------------------------------------------------------------- */
void kx_walk_init(kx_transfer *x, const uint64_t *src_off, const uint64_t *dst_off, const uint64_t *length,
                  size_t n, size_t iov, uint64_t max_write, uint64_t pack_min);
int kx_walk_next(kx_transfer *x);    /* build the next message into x->piece_*; 0 at the end */
int kx_pump_queue(kx_rail *r);
void kx_transfer_submit(kx_rail *r, kx_transfer *x, int64_t budget);   /* link, post up to budget, queue the rest */
/* a transfer over a private copy of the triples, its walk ready; `kind`: KX_OP_WRITE or KX_OP_READ */
kx_transfer *kx_transfer_new(const uint64_t *src_off, const uint64_t *dst_off, const uint64_t *length,
                             size_t n, size_t iov, uint64_t max_write, uint64_t pack_min, int need_ctx, int kind);
void kx_transfer_fail(kx_rail *r, kx_transfer *x, int err);   /* first error wins; posts nothing more */


/* ---- revoke.c: the revoke exchange (control messages carrying KX_CTL_TAG as their data) -- */
#define KX_CTL_TAG  0x4b584354ULL        /* "KXCT": the upper half of a control message's data */
#define KX_CTL_SENT (1ULL << 63)         /* in the acks: our own control send with this token completed */
#define KX_CTL_FAILED (1ULL << 62)       /* ... with an error (the peer is gone: wait for no ACK from it) */
int kx_send_op(kx_rail *r, fi_addr_t peer, uint32_t gen, const char *data, size_t len, uint64_t ctl,
               uint64_t token, int64_t wait_ns);      /* msg.c */
int kx_ctl_is(uint64_t flags, uint64_t data);
void kx_ctl_arrival_locked(kx_rail *r, uint32_t type, const char *data, size_t len);
void kx_ctl_sent_locked(kx_rail *r, kx_sendbuf *s, int err);
int kx_ctl_post_acks(kx_rail *r);       /* the poll owner: post the ACKs due; returns how many */
int kx_revoked_check(kx_rail *r, kx_transfer *x);   /* before each post: FI_EACCES if x's key was revoked */
void kx_ctl_free_locked(kx_hub *h);
void kx_ctl_rail_free(kx_rail *r);
uint64_t kx_name_hash(const void *name, size_t len);

/* ---- the peers: peers.c (the table), local.c (same-process cells), names.c, shmlock.c -- */
#define KX_FORGET_WAIT_NS 1000000000LL   /* a closing shm rail waits this long for its holders to drop it */
#define KX_PEER_SCAN_NS 10000000LL   /* the progress thread looks at its peers every 10 ms */
#define KX_ALIVE_NS 500000LL         /* a poster trusts a shm peer's pidfd's "running" this long: one
                                      * poll(2) per message was a third of a small request's syscalls */
#define KX_PEER_CHUNK   256          /* peer entries are allocated 256 at a time ... */
#define KX_PEER_CHUNKS  4096         /* ... under a fixed directory: 1 Mi peers per rail */
/* one hold of a same-process shm cell by a rail (local.c); a closed cell's holds are dropped
 * by the holder's progress (forget.c) once `want` is 1 and its command queue was read past
 * `mark` */
typedef struct kx_hold {
    struct kx_local *c;
    uint64_t mark;        /* the holder's command-queue write count when c's rail quiesced */
    int want;             /* 0: held; 1: c's rail closed, forget it; 2: being forgotten */
} kx_hold;

typedef struct kx_local {
    struct kx_local *next;
    int refs;             /* the owning rail + every peer entry naming it (under kx_locals_lock) */
    int closed;           /* atomic: the owner is tearing down */
    int busy;             /* atomic: posts to it under way */
    /* shm (rail.c, deferral): engines of this process whose progress may read this
     * endpoint's region, and those this endpoint's progress may read (under kx_locals_lock) */
    int mapped_by;        /* unquiesced rails holding this cell in their `held` */
    kx_hold *held;
    int nheld, capheld;
    int forgets;          /* atomic: holds in `held` with want != 0 (the progress looks: forget.c) */
    const volatile uint64_t *cmdq;   /* shm: {read, write} counts of this endpoint's own command
                                      * queue, through our own mapping (forget.c); NULL: unknown */
    void *cmdq_map;
    unsigned char *peer_data;   /* shm: this endpoint's own table of its peers (forget.c), writable */
    void *peer_map;
    size_t peer_map_len;
    struct kx_rail *deferred;   /* its rail, closing, waits for mapped_by == 0 */
    size_t len;
    uint8_t name[256];
} kx_local;

typedef struct kx_peer {
    int used;             /* once inserted: a removed peer's slot stays used, dead = ENOTCONN */
    int dead;             /* errno, 0 while alive */
    uint32_t gen;         /* bumped at every insert into the slot; never 0 once used */
    int busy;             /* posts inside a provider call to it (kx_peer_enter .. kx_peer_leave) */
    int pidfd;            /* -1: none */
    kx_local *local;
    int64_t out;          /* operations outstanding to it */
    int64_t last_ns;
    int64_t refused_ns;   /* since when every post to it was refused (-FI_EAGAIN), 0: not */
    int64_t alive_ns;     /* when its pidfd last said "running" to a poster (kx_peer_gone; KX_ALIVE_NS) */
    pid_t pid;            /* shm, another process: its pid (0: none) */
    uint64_t name_hash;   /* its endpoint name's hash: whom a REVOKE's ACK goes to (revoke.c) */
    volatile int *lockw;  /* shm, another process: its region's spin lock (NULL: unknown layout; written only by kx_peers_unstick) */
    void *map;            /* the page lockw lies in (our own mapping of it) */
    struct kx_bell *bell; /* shm: the peer's doorbell, rung after each post (bell.c); NULL: none */
    int removed;          /* its address was removed (kx_peer_forget): a tombstone until reused */
    int answered;         /* shm: 0, or its exited process's unanswered operations were looked at (1) and answered (2) (unblock.c) */
} kx_peer;

/* local.c: same-process engines (kx_local cells, shm's deferral rule) */
int kx_local_publish(kx_rail *r);
void kx_local_retire(kx_rail *r);
kx_local *kx_local_find(const void *name, size_t len);    /* a reference, or NULL */
void kx_local_unref(kx_local *c);
void kx_local_link(kx_rail *x, kx_local *y);
void kx_local_unlink(kx_rail *x, kx_local *y);
void kx_local_release(kx_rail *r);
int kx_local_defer(kx_rail *r);
int kx_local_still_deferred(kx_rail *r, int freeing);
int kx_local_deferred_done(kx_rail *r);
int kx_local_deferred_end(kx_rail *r);
int kx_local_deferred_wait(kx_rail *r, int64_t wait_ns);
int kx_local_forget_due(kx_rail *r, kx_local **out, int max);
void kx_local_forget_later(kx_rail *r, kx_local *c);
void kx_local_unlink_all(kx_rail *x, kx_local *y);
void kx_rail_finish_deferred(kx_rail *r);      /* rail.c */

/* forget.c: a closed same-process shm engine leaves the maps of those that hold it */
void kx_forget_map_cmdq(kx_local *c, const char *prov);

/* unblock.c: a dead shm peer's unanswered operations, answered for it in our response queue */
void kx_unblock_open(kx_rail *r);
void kx_unblock_close(kx_rail *r);
void kx_unblock_note(kx_rail *r);
int kx_unblock_step(kx_rail *r);
int kx_unblock_settle(kx_rail *r, fi_addr_t fa, int64_t wait_ns);
uint64_t kx_unblock_answered(const kx_rail *r);
int kx_forget_step(kx_rail *r);
int kx_forget_slot_of(kx_rail *r, fi_addr_t fa);
void kx_forget_slot_clear(kx_rail *r, int slot);

/* names.c: endpoint names, shm's files */
pid_t kx_shm_pid(const char *prov, const void *name, size_t len);     /* 0: not a shm name */
void kx_shm_clear_stale(kx_rail *r);
int kx_shm_path(const void *name, size_t len, const char *suffix, char *path, size_t size);
int kx_shm_open_own(const char *prov, const void *name, size_t len, const char *knob);
int kx_ep_name(kx_rail *r, char *name, size_t size, size_t *len);   /* NUL-terminated; -1: none */
int kx_addr_check(kx_rail *r, const void *addr, size_t len);

/* shmlock.c: a shm peer's region lock */
void kx_shm_lock_map(kx_peer *p, const void *name, size_t len, pid_t pid);
void kx_shm_lock_unmap(void *map);
int kx_shm_lock_wait(kx_rail *r, kx_peer *p);
int kx_peers_unstick(kx_rail *r);

/* peers.c: the peer table */
kx_peer *kx_peer_get(kx_rail *r, fi_addr_t fa);    /* NULL: untracked; lock-free */
int kx_pidfd_exited(int fd);
int kx_peer_add(kx_rail *r, fi_addr_t fa, const void *name, size_t len);
void kx_peer_forget(kx_rail *r, fi_addr_t fa);
kx_local *kx_peer_forget_entry(kx_rail *r, fi_addr_t fa);
void kx_peer_kill_locked(kx_rail *r, fi_addr_t fa, int err);
int kx_peer_gone(kx_rail *r, fi_addr_t fa);
int kx_peer_enter(kx_rail *r, fi_addr_t fa, uint32_t gen);
uint32_t kx_peer_gen(kx_rail *r, fi_addr_t fa);
int kx_peer_is(kx_rail *r, fi_addr_t fa, uint32_t gen);
int kx_peer_retire(kx_rail *r, fi_addr_t fa, int64_t wait_ns);
void kx_peer_leave(kx_rail *r, fi_addr_t fa);
void kx_peer_count(kx_rail *r, fi_addr_t fa, int delta);
void kx_peer_uncount(kx_rail *r, fi_addr_t fa, int again);
void kx_peer_accepted(kx_rail *r, fi_addr_t fa);
int kx_is_peer_errno(int err);
int kx_peers_scan(kx_rail *r);
int64_t kx_outstanding_live(kx_rail *r);
void kx_peers_free(kx_rail *r);
int kx_limits_ok(const kx_rail *r, size_t iov, uint64_t max_write, uint64_t pack_min);   /* post.c */
void kx_transfer_fail_locked(kx_rail *r, kx_transfer *x, int err);

/* ---- bell.c ---------------------------------------------------------------------- */
typedef struct kx_bell {
    uint32_t magic;        /* KX_BELL_MAGIC once the owner set it up */
    int32_t pid;           /* the owner's process */
    uint32_t seq;          /* the futex word: every wake bumps it */
    uint32_t sleeping;     /* the owner's progress thread is (about to be) waiting on seq */
} kx_bell;

void kx_bell_create(kx_rail *r);
void kx_bell_remove(kx_rail *r);
void kx_bell_free(kx_rail *r);
kx_bell *kx_bell_open(const void *name, size_t len, pid_t pid);
void kx_bell_close(kx_bell *b);
int kx_bell_ring(kx_bell *b);
void kx_bell_poke(kx_bell *b);
uint32_t kx_bell_seq(const struct kx_bell *b);
void kx_bell_sleep(kx_rail *r, uint32_t seq, int64_t ns, int (*look)(kx_rail *));

/* ---- direct.c -------------------------------------------------------------------- */
void kx_direct_ref(kx_direct *d);    /* NULL: nothing */
/* more of the built message into x->direct; *revoked: the target's permit refused (nothing copied) */
uint64_t kx_direct_copy(kx_transfer *x, uint64_t limit, int *revoked);

/* ---- mr.c ------------------------------------------------------------------------- */
/* registration by a caller already inside a kx_enter bracket (or opening the rail) */
int kx_mr_register(kx_rail *r, void *buf, size_t len, int iface, int device, int dmabuf_fd, int remote,
                   struct fid_mr **mr, uint64_t *key, void **desc, uint8_t *raw, size_t *rawlen,
                   uint64_t *raw_base, const char **call);

#endif
