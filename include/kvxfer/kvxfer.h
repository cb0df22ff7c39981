/* kvxfer.h: the native engine's public API, the one header kvxfer/_core.pxd mirrors.
 *
 * The native engine is the only code that calls libfabric. Its objects:
 *   kx_rail      one RDM endpoint with its fabric, domain, CQ, AV and progress thread (one
 *                per NIC); the rails of one engine share a hub (lock, condition variables,
 *                imm counter table, arms, callback queue, control-message queue)
 *   kx_transfer  the messages of one write call on one rail: planned, posted, completed
 *   kx_counter   an expectation of `count` arrivals of one imm (immediate data value)
 *   kx_msg       a received control message
 *   kx_arm       a decoder leg's ANNOUNCE, armed natively when it arrives (src/announce.c)
 *   kx_direct    the sender's own mapping of a shm peer's memfd region (direct writes)
 * A region is a libfabric `struct fid_mr`; a peer is an `fi_addr_t` in a rail's AV.
 *
 * Conventions: functions returning int return 0 or a negative libfabric errno (-FI_E*);
 * `call`/`errcall` outputs name the libfabric call that failed. No function takes or makes
 * a Python object; all may be called without the GIL. Functions marked "blocks" wait at
 * most their slice or deadline. Implementation: the C files in src/, private declarations in
 * src/internal.h. */
#ifndef KVXFER_KVXFER_H
#define KVXFER_KVXFER_H

#include <stddef.h>
#include <stdint.h>

#include "kvxfer/compat.h"

#define KX_MAX_IOV 16          /* upper bound on iovecs per message kvxfer ever builds */
#define KX_MSG_MAX 65536       /* largest control message */

typedef struct kx_rail kx_rail;
typedef struct kx_transfer kx_transfer;
typedef struct kx_counter kx_counter;
typedef struct kx_msg kx_msg;
typedef struct kx_arm kx_arm;
typedef struct kx_watcher kx_watcher;
typedef struct kx_watch kx_watch;
typedef struct kx_direct kx_direct;

/* What a rail's provider allows; kvxfer obeys it (strings live as long as the rail). */
typedef struct kx_rail_info {
    const char *provider;
    const char *fabric;
    const char *domain;
    uint64_t mr_mode;
    uint64_t caps;
    size_t iov_limit;      /* min(iov_limit, rma_iov_limit, KX_MAX_IOV) */
    size_t max_msg_size;
    size_t inject_size;
    size_t cq_data_size;
    int need_ctx;          /* the provider asked for FI_CONTEXT / FI_CONTEXT2 */
    int has_wait;          /* the CQ has a wait object (the progress thread sleeps in it) */
    int addr_is_str;       /* endpoint names are NUL-terminated strings (FI_ADDR_STR) */
} kx_rail_info;

typedef struct kx_rail_stats {
    uint64_t writes_posted;
    uint64_t direct_writes;  /* messages whose bytes were copied through a direct mapping */
    uint64_t direct_revoked; /* direct messages whose copy a permit refused (the target closed the region) */
    uint64_t bell_rings;   /* shm: posts that woke a sleeping peer through its doorbell */
    uint64_t bell_wakes;   /* shm: sleeps of this rail's progress thread that a peer's ring ended */
    uint64_t dead_answered; /* shm: operations to peers whose process exited that kvxfer answered for them (unblock.c) */
    uint64_t errors;       /* error completions not tied to a transfer */
    int64_t outstanding;   /* operations posted and not completed */
    uint64_t drives;       /* waits in which the waiter read the CQ itself (KVXFER_DRIVE_US, a small transfer on shm) */
    uint64_t drives_got;   /* ... and saw what it waited for before its window passed */
    uint64_t naps;         /* pauses of the progress thread that napped: its core was contended */
    uint64_t armed;        /* ANNOUNCEs armed natively (the engine's, all rails: src/announce.c) */
} kx_rail_stats;

typedef struct kx_transfer_state {
    int64_t planned;       /* messages the walk contains (= immediates the target sees) */
    int64_t posted;        /* messages handed to the provider so far */
    int64_t completed;     /* completions read (success or error) */
    int posting_done;      /* nothing more will be posted */
    int done;              /* posting done and every posted message completed */
    int error;             /* first positive errno, 0 if none */
    int linked;            /* still on the in-flight list (the provider may own its contexts) */
} kx_transfer_state;

typedef struct kx_counter_state {
    uint32_t imm;
    uint64_t count;
    uint64_t arrived;      /* arrivals credited */
    int64_t done_ns;       /* CLOCK_MONOTONIC ns when the expectation was met: by the thread that
                            * credited the last arrival, or by kx_expect if they were banked
                            * already; 0 if not done, or ended otherwise (error != 0) */
    int done;
    int error;             /* 0; EIDRM: discarded; FI_ECANCELED: the engine closed first */
} kx_counter_state;

/* ---- rails: life cycle (src/rail.c) ------------------------------------------------ */

/* Open a rail on provider `prov` (NULL: libfabric's first choice), bound to `node` when
 * given, on the domain (NIC) `domain` when given. `join`: another rail of the same engine,
 * whose hub this one shares (NULL: a new hub). */
int kx_rail_open(const char *prov, const char *node, const char *domain, int hmem, int spin,
                 kx_rail *join, kx_rail **out, char *errcall, size_t errcall_len);
/* Before kx_rail_start: the progress thread puts itself at SCHED_FIFO `priority` when it
 * starts (0: normal scheduling, the default). -FI_EINVAL: outside sched_get_priority_min/max
 * of SCHED_FIFO, a spin-mode rail (it never sleeps: under FIFO it would keep every lower
 * thread off its core), or the thread already started. (src/progress.c) */
int kx_rail_set_progress_rt(kx_rail *r, int priority);
/* The outcome once started: the priority the thread runs at (0: normal), and in *err the
 * errno pthread_setschedparam refused with (EPERM without CAP_SYS_NICE or a high enough
 * RLIMIT_RTPRIO), 0 when granted or not asked. */
int kx_rail_progress_rt(const kx_rail *r, int *err);
/* Start the progress thread, pinned to `cpus` when ncpus > 0 (with a progress priority
 * set, it returns once the thread has tried it: kx_rail_progress_rt then tells). */
int kx_rail_start(kx_rail *r, const int *cpus, int ncpus);
/* Closing, in this order (each idempotent):
 *   drain           cancel queued writes; let posted ones complete (blocks, timeout_ns)
 *   quiesce         refuse new calls, wait for callers inside, join the progress thread
 *   close_endpoint  close ep, receive MR, AV, CQ; fail pending transfers and (last rail
 *                   of the hub) counters with FI_ECANCELED
 *   (the caller closes its registrations here: a domain with registrations will not close)
 *   close_domain    close domain and fabric
 *   free            free the struct (late releases of transfers/counters stay safe until then)
 * A progress thread that cannot be joined is leaked with everything it may touch. */
/* 1 once quiet: nothing of ours pending to live peers, no incoming traffic for quiet_ns */
int kx_rail_drain(kx_rail *r, int64_t timeout_ns, int64_t quiet_ns);
void kx_rail_park(kx_rail *r);          /* never close the endpoint (see rail.c) */
int kx_rail_parked(const kx_rail *r);
int kx_rail_took_traffic(const kx_rail *r);
void kx_rail_quiesce(kx_rail *r);
void kx_rail_close_endpoint(kx_rail *r);
void kx_rail_close_domain(kx_rail *r);
void kx_rail_free(kx_rail *r);
int kx_rail_leaked(const kx_rail *r);

void kx_rail_get_info(const kx_rail *r, kx_rail_info *out);
void kx_rail_get_stats(const kx_rail *r, kx_rail_stats *out);
int kx_rail_thread_id(const kx_rail *r);   /* the progress thread's kernel tid, 0 before it runs */

/* ---- peers and addresses (src/rail.c) ---------------------------------------------- */

int kx_getname(kx_rail *r, void *buf, size_t *len);
/* *out: the peer's AV index; *gen: the generation of that slot (a post names both, so a
 * post meant for a removed peer never reaches the next one libfabric puts in its slot) */
int kx_av_insert(kx_rail *r, const void *addr, size_t len, fi_addr_t *out, uint32_t *gen);
/* liveness (src/peers.c): how long a peer may leave operations outstanding with none
 * completing before it is dead (0: never); FI_DELIVERY_COMPLETE on writes; 0 while `peer`
 * may be posted to, else the errno posts to it fail with */
void kx_set_peer_timeout(kx_rail *r, int64_t ns);
void kx_set_delivery_complete(kx_rail *r, int on);
int kx_peer_state(kx_rail *r, fi_addr_t peer);
/* Remove `addr`: later posts to it fail with ENOTCONN, and it waits (up to wait_ns) for
 * posts already inside a provider call to return before fi_av_remove (AV_TABLE reuses the
 * slot); -FI_EBUSY when one is still inside at the deadline (the slot is kept, unused).
 * `gen` (from kx_av_insert; 0: unchecked): a slot removed already, or holding another peer
 * since, is left alone (0). */
int kx_av_remove(kx_rail *r, fi_addr_t addr, uint32_t gen, int64_t wait_ns);

/* ---- regions (src/mr.c) ------------------------------------------------------------ */

/* What peers may do to a registered region (kx_mr_reg's `remote`, a mask; 0: nothing). */
#define KX_REMOTE_WRITE 1
#define KX_REMOTE_READ 2

/* Register [buf, buf+len) for RMA (`remote`: KX_REMOTE_WRITE and/or KX_REMOTE_READ, what
 * peers may do to it; the provider enforces it, except shm, whose CMA copy checks no key or
 * access flag: there the boundary is the OS user). Keys are random 64-bit
 * values where the provider does not choose them. raw/rawlen/raw_base: the raw key
 * (FI_MR_RAW providers; rawlen 0 otherwise), raw must hold 64 bytes. */
int kx_mr_reg(kx_rail *r, void *buf, size_t len, int iface, int device, int dmabuf_fd, int remote,
              struct fid_mr **mr, uint64_t *key, void **desc, uint8_t *raw, size_t *rawlen,
              uint64_t *raw_base, const char **call);
int kx_mr_close(struct fid_mr *mr);
/* A peer's raw key becomes a 64-bit key usable in RMA calls; unmapped at close. */
int kx_map_raw(kx_rail *r, uint64_t base, uint8_t *raw, size_t rawlen, uint64_t *key);
int kx_unmap_key(kx_rail *r, uint64_t key);

/* ---- direct writes (src/direct.c) ------------------------------------------------- */

/* Map bytes [offset, offset+len) of the memfd at `path` (a shm peer's /proc/<pid>/fd/<n>)
 * MAP_SHARED, once it is checked to be the file (dev, ino), to hold the range and to be
 * sealed against shrinking; a negative errno otherwise (the caller writes over RMA then).
 * *out holds the caller's reference; transfers (while posting) and armed watch entries take
 * their own. */
int kx_direct_open(const char *path, uint64_t dev, uint64_t ino, uint64_t offset, uint64_t len, kx_direct **out);
char *kx_direct_base(const kx_direct *d);   /* where the region's first byte is mapped here */
void kx_direct_unref(kx_direct *d);          /* the last reference unmaps */
/* Attach the target's permit (once, before any transfer uses d), and check the target's own
 * record of what it registered: `path` is the target's permit table (the memfd at
 * /proc/<pid>/fd/<n> of the data's process, checked as above), whose header must name
 * `owner` (the descriptor's owner digest, the peer written to), whose word `slot` must carry
 * `gen` unrevoked, and whose record for it must cover the data's file and range. Every later
 * copy through d takes a writer on that word only while it carries `gen` and is not revoked;
 * a refused copy fails its transfer (EACCES) and its imm is never posted. Without a permit
 * copies are unchecked: the engine never writes directly without one. A negative errno where
 * a check fails (the caller writes over RMA then). */
#define KX_OWNER_BYTES 8
int kx_direct_permit(kx_direct *d, const char *path, uint64_t dev, uint64_t ino, uint32_t slot, uint32_t gen,
                    const uint8_t owner[KX_OWNER_BYTES]);

/* The target's permit table: `slots` 64-bit words [generation: 32 | revoked: 1 | writers: 31],
 * each slot's record (the memfd and range of the region holding it) and a header naming its
 * owner (the engine's owner digest), in a sealed memfd mapped here (*fd stays open for peers
 * to open through /proc; *words is the first word). */
int kx_permit_table_open(size_t slots, const uint8_t owner[KX_OWNER_BYTES], int *fd, uint64_t **words);
void kx_permit_table_close(int fd, uint64_t *words, size_t slots);
/* a free slot for a new region, the bytes [offset, offset + len) of the memfd (dev, ino):
 * records them, clears revoked, returns the generation its descriptor names */
uint32_t kx_permit_issue(uint64_t *words, size_t slots, size_t slot, uint64_t dev, uint64_t ino, uint64_t offset,
                        uint64_t len);
/* set revoked (no copy starts from now on), wait up to wait_ns for the copies in progress to
 * end; returns the writers still inside (0: none) */
uint32_t kx_permit_revoke(uint64_t *word, int64_t wait_ns);
/* after deregistration: bump the generation (the slot may serve another region); -EBUSY
 * where a writer never left (the slot must not be reused) */
int kx_permit_retire(uint64_t *word);

/* ---- writes (src/post.c, src/transfer.c) ------------------------------------------- */

/* The message rule: how many messages (one fi_writemsg, one remote CQ entry each) the
 * triples become (see src/post.c). */
int64_t kx_count_messages(const uint64_t *src_off, const uint64_t *dst_off, const uint64_t *length,
                          size_t n, size_t iov, uint64_t max_write, uint64_t pack_min);
/* Post the triples' messages to `peer` (copies the triples; posts up to a budget itself,
 * queues the rest for the progress thread; never waits for the wire). `direct`: NULL, or
 * the peer region's mapping here: each message is then a memcpy into it and a 0-byte write
 * carrying the imm (none without imm); the transfer holds a reference until posting ends. *out
 * holds two references: the caller's (kx_transfer_release) and the in-flight one. */
int kx_write(kx_rail *r, fi_addr_t peer, uint32_t gen, char *src_base, void *desc, uint64_t dst_base, uint64_t key,
             kx_direct *direct, const uint64_t *src_off, const uint64_t *dst_off, const uint64_t *length, size_t n,
             int has_imm, uint32_t imm, size_t iov, uint64_t max_write, uint64_t pack_min,
             kx_transfer **out);
/* A caller's burst of kx_write calls (write_groups: one per region pair): the progress
 * thread stays out of the posters' way until the last burst ends (it waits on a futex, not in
 * 20 us naps), then reads what completed meanwhile. Nests with kx_write's own bracket. */
void kx_posting_begin(kx_rail *r);
void kx_posting_end(kx_rail *r);
void kx_transfer_get_state(const kx_transfer *x, kx_transfer_state *out);
/* Blocks up to slice_ns; 1 once the transfer is done, else 0. */
int kx_transfer_wait(kx_rail *r, kx_transfer *x, int64_t slice_ns);
/* Post nothing more of x; what was posted still completes. */
void kx_transfer_cancel(kx_rail *r, kx_transfer *x);
void kx_transfer_release(kx_rail *r, kx_transfer *x);
/* Cancel every unfinished transfer to `peer` (of generation `gen`; 0: any) on this rail;
 * returns how many. */
int kx_peer_cancel(kx_rail *r, fi_addr_t peer, uint32_t gen);
/* Blocks up to slice_ns until no transfer to `peer` is in flight on this rail; returns how
 * many still are, *posting how many of those may still post. */
int kx_peer_wait(kx_rail *r, fi_addr_t peer, uint32_t gen, int64_t slice_ns, int *posting);

/* ---- reads (src/read.c) ------------------------------------------------------------ */

/* Read the triples (local offset, remote offset, length) from the peer's region at
 * `remote_base` (key `key`, `remote_len` bytes) into the local region at `local_base` (its
 * registration's `desc`, `local_len` bytes): the message rule's rules 1 and 2 (no immediate, no
 * rule 3), each message one fi_readmsg of at most `iov` pieces and `max_read` bytes, completing
 * on this rail's CQ (the target sees nothing). -FI_EINVAL, with nothing posted, when a triple
 * leaves either region or the limits are not the provider's. Copies the triples; posts up to a
 * budget itself and queues the rest for the progress thread, like kx_write; *out holds two
 * references (kx_transfer_release, kx_transfer_wait, kx_transfer_get_state apply). The peer's
 * region must be registered with KX_REMOTE_READ. */
int kx_read(kx_rail *r, fi_addr_t peer, uint32_t gen, char *local_base, void *desc, uint64_t local_len,
            uint64_t remote_base, uint64_t key, uint64_t remote_len, const uint64_t *local_off,
            const uint64_t *remote_off, const uint64_t *length, size_t n, size_t iov, uint64_t max_read,
            kx_transfer **out);

/* ---- counters (src/counters.c; the table is the hub's, shared by its rails) -------- */

/* Expect `count` arrivals of imm; banked arrivals are credited first. -FI_EBUSY when imm
 * already has an unfinished expectation. *out holds the caller's reference. */
int kx_expect(kx_rail *r, uint32_t imm, uint64_t count, int want_callback, kx_counter **out);
void kx_counter_get_state(const kx_counter *c, kx_counter_state *out);
int kx_counter_wait(kx_rail *r, kx_counter *c, int64_t slice_ns);   /* blocks; 1 once done */
/* A counter made without a callback (an arm's) wants one now: 0 if it is queued for the
 * dispatcher once met, 1 if it was met already (nothing is queued). */
int kx_counter_set_callback(kx_rail *r, kx_counter *c);
/* The owner drops its counter: an unfinished expectation is withdrawn, its arrivals banked again. */
void kx_counter_drop(kx_rail *r, kx_counter *c);
/* Drop one reference without withdrawing (the dispatcher's, from kx_next_done). */
void kx_counter_release(kx_rail *r, kx_counter *c);
uint64_t kx_banked(kx_rail *r, uint32_t imm);
/* Retire imm (see src/counters.c for the rule); returns the arrivals dropped. */
uint64_t kx_discard(kx_rail *r, uint32_t imm, kx_counter **withdrawn);
/* For the dispatcher: blocks up to slice_ns; 1 with the next finished counter that wants a
 * callback (a reference to release), 0 on timeout, -1 once the engine is closing. */
int kx_next_done(kx_rail *r, int64_t slice_ns, kx_counter **out);
void kx_dispatch_stop(kx_rail *r);

/* ---- control messages (src/msg.c) -------------------------------------------------- */

/* Post one message of at most KX_MSG_MAX bytes; -FI_EAGAIN when the queue stayed full for
 * 50 ms (the caller retries). */
int kx_send(kx_rail *r, fi_addr_t peer, uint32_t gen, const char *data, size_t len);
/* kx_send's one try: -FI_EAGAIN at once when the queue is full (a caller that must not wait
 * hands the message to a thread that may). */
int kx_send_try(kx_rail *r, fi_addr_t peer, uint32_t gen, const char *data, size_t len);
/* Blocks up to slice_ns; 1 with the next received message (kx_msg_free it), else 0. */
int kx_recv_wait(kx_rail *r, int64_t slice_ns, kx_msg **out);
size_t kx_msg_len(const kx_msg *m);
const char *kx_msg_data(const kx_msg *m);
void kx_msg_free(kx_msg *m);

/* ---- the decoder's ANNOUNCE, armed natively (src/announce.c: the rule, the format) ---- */

enum { KX_ARM_OPEN = 0, KX_ARM_ARMED = 1, KX_ARM_CLOSED = 2 };
/* The messenger's secret (at most 256 bytes; 0: ANNOUNCEs carry no tag). Before any arm. */
int kx_arm_key(kx_rail *r, const uint8_t *key, size_t len);
/* Register a leg: its imm (one open arm per imm: -FI_EBUSY), the ANNOUNCE's sender and
 * receiver uids, the seq it must exceed and its count's bounds. -FI_ECANCELED once closed. */
int kx_arm_open(kx_rail *r, uint32_t imm, uint64_t src, uint64_t dst, uint64_t floor, uint64_t least,
                uint64_t most, kx_arm **out);
/* Blocks up to slice_ns; 1 once closed, or armed and its counter met (or ended, or the arm
 * closed meanwhile: kx_arm_close wakes it). While a
 * caller waits, an ANNOUNCE arms it even before its writes have all landed, and is queued
 * quiet (kx_recv_wait returns it with the next loud one, or at its slice's end). */
int kx_arm_wait(kx_rail *r, kx_arm *a, int64_t slice_ns);
/* End the arm: nothing arms it any more. 1 if an ANNOUNCE of seq <= max_seq had armed it:
 * *count, *seq, and *counter (its expectation, met or not, with no callback: the caller's
 * reference now); once. A later ANNOUNCE's arming is reverted (the expectation withdrawn, its
 * arrivals banked again): 0. */
int kx_arm_close(kx_rail *r, kx_arm *a, uint64_t max_seq, uint64_t *count, uint64_t *seq, kx_counter **counter);
void kx_arm_free(kx_rail *r, kx_arm *a);     /* closes it, reverting what nobody took; frees */
int kx_arm_state(const kx_arm *a);
int kx_arm_waiters(const kx_arm *a);         /* callers in kx_arm_wait now, and holds */
/* A caller that will wait on the arm next (a Receive's later legs, while it waits on the
 * first) counts as waiting meanwhile: +1, then -1 once it no longer will. */
void kx_arm_hold(kx_arm *a, int delta);
/* The arm's check of one message, alone: its count, or -1 if the arm would not take it. */
int64_t kx_announce_count(const char *data, size_t len, const uint8_t *key, size_t keylen, uint32_t imm,
                          uint64_t src, uint64_t dst, uint64_t floor, uint64_t least, uint64_t most);

/* ---- the revoke exchange (src/revoke.c): a target closing a region tells its peers ----- */

enum { KX_CTL_HELLO = 1, KX_CTL_REVOKE = 2, KX_CTL_ACK = 3, KX_CTL_BYE = 4 };
/* Post a HELLO or BYE (data: our address) or a REVOKE (token u64, nkeys u32, namelen u32, keys,
 * our endpoint name) with `token` (nonzero, below 2^62): its completion is reported by
 * kx_ctl_take as token | 2^63 (| 2^62 on error); -FI_EAGAIN as kx_send. */
int kx_ctl_send(kx_rail *r, fi_addr_t peer, uint32_t gen, int type, uint64_t token, const char *data, size_t len);
/* Waits up to slice_ns for answered tokens (ACKs received, our sends completed); takes up
 * to max of them into tokens, *n of them. */
int kx_ctl_take(kx_rail *r, int64_t slice_ns, uint64_t *tokens, size_t max, size_t *n);
/* The next HELLO or BYE received (its kind's byte, then the peer's address; kx_msg_free
 * it): 1, else 0 at once. A BYE: that engine is closing, announce nothing more to it. */
int kx_ctl_hello(kx_rail *r, kx_msg **out);
/* Keys of peers' regions revoked so far (writes to them fail with EACCES, posting nothing). */
uint64_t kx_revoked_count(kx_rail *r);
/* Handle whatever the CQ holds now (waits out the thread reading it, up to wait_ns). */
void kx_rail_flush(kx_rail *r, int64_t wait_ns);

/* ---- the layer watcher (src/watcher.c) ------------------------------------------- */

/* A native thread (kvxfer-watch) that polls a 64-bit counter word and, when it reaches an
 * armed entry's threshold, posts the entry's prepared writes with kx_write (same message
 * rule: kx_watch_planned == what the target counts). Sleeps on a condition variable when
 * nothing is armed; polls every poll_ns (timer slack 1 us) while armed; kx_watcher_bump
 * wakes it at once. */
enum { KX_WATCH_ARMED = 0, KX_WATCH_POSTING = 1, KX_WATCH_POSTED = 2, KX_WATCH_DISARMED = 3,
       KX_WATCH_FAILED = 4 };

typedef struct kx_watch_state {
    int state;             /* KX_WATCH_* */
    int error;             /* KX_WATCH_FAILED: kx_write's errno (positive) */
    uint64_t threshold;
    int64_t planned;       /* messages the entry posts */
    int64_t fired_ns;      /* CLOCK_MONOTONIC time of its post, 0 before */
    kx_transfer *transfer; /* KX_WATCH_POSTED: the transfer (owned by the entry) */
} kx_watch_state;

typedef struct kx_watcher_stats {
    size_t armed;
    uint64_t fired;        /* entries posted (or failed) */
    uint64_t wakeups;      /* the thread's wake-ups (polls included) */
    int tid;               /* the thread's kernel id */
    int rt;                /* its SCHED_FIFO priority, 0: normal scheduling */
} kx_watcher_stats;

/* `word`: the counter (NULL: the watcher allocates one, 64-byte aligned, zeroed).
 * rt_priority > 0 asks for SCHED_FIFO at that priority (ignored where not permitted). */
int kx_watcher_open(uint64_t *word, int64_t poll_ns, const int *cpus, int ncpus, int rt_priority,
                    kx_watcher **out);
uint64_t *kx_watcher_word(kx_watcher *w);
uint64_t kx_watcher_value(const kx_watcher *w);
/* Atomically add n and wake the thread; returns the new value. */
uint64_t kx_watcher_bump(kx_watcher *w, uint64_t n);
/* Raise the word to at least `to` (an abandoned pass); returns the value after. */
uint64_t kx_watcher_advance(kx_watcher *w, uint64_t to);
/* What arming checks on its own copy of the caller's arrays (another thread may change them
 * meanwhile), before anything is armed: every offset, length and threshold (base + the given
 * one) below 2**62, each triple's source range within src_size and destination range within
 * dst_size, no sum of lengths past 2**64, and starts from 0 to n (the triples' number), not
 * decreasing. A failed check returns -ERANGE. */
typedef struct kx_watch_bounds {
    uint64_t base;         /* added to every threshold */
    uint64_t src_size, dst_size;
    size_t n;              /* triples in the arrays (kx_watch_arm: its n) */
} kx_watch_bounds;

/* Arm the triples' writes for when the word reaches `threshold` (copies the triples). The
 * rail, source registration and peer must outlive the entry. *out: the owner's reference. */
int kx_watch_arm(kx_watcher *w, uint64_t threshold, uint64_t tag, kx_rail *r, fi_addr_t peer, uint32_t gen,
                 char *src_base, void *desc, uint64_t dst_base, uint64_t key, kx_direct *direct,
                 const uint64_t *src_off, const uint64_t *dst_off, const uint64_t *length, size_t n,
                 const kx_watch_bounds *b, int has_imm, uint32_t imm, size_t iov, uint64_t max_write,
                 uint64_t pack_min, kx_watch **out);
/* kx_watch_arm for ng groups at once: group g is triples [starts[g], starts[g+1]) armed at
 * b->base + thresholds[g]; out[g] its entry. All or nothing (nothing armed on an error), one
 * lock; the thread is woken (once) only for an entry due now or, polling, a list that was empty. */
int kx_watch_arm_groups(kx_watcher *w, size_t ng, const uint64_t *thresholds, const int64_t *starts, uint64_t tag,
                        kx_rail *r, fi_addr_t peer, uint32_t gen, char *src_base, void *desc, uint64_t dst_base,
                        uint64_t key, kx_direct *direct, const uint64_t *src_off, const uint64_t *dst_off,
                        const uint64_t *length, const kx_watch_bounds *b, int has_imm, uint32_t imm, size_t iov,
                        uint64_t max_write, uint64_t pack_min, kx_watch **out);
int64_t kx_watch_planned(const kx_watch *e);
/* The sum of the entry's lengths. */
uint64_t kx_watch_bytes(const kx_watch *e);
void kx_watch_get_state(kx_watcher *w, const kx_watch *e, kx_watch_state *out);
/* 1 if the entry was still armed and now never posts; 0 if it was posted (waits for a post
 * in progress to return, so the answer is exact). */
int kx_watch_disarm(kx_watcher *w, kx_watch *e);
/* kx_watch_disarm of n entries at once (one lock, one walk of the armed list); disarmed[i]
 * is its answer for es[i]; returns how many were disarmed. */
size_t kx_watch_disarm_many(kx_watcher *w, kx_watch *const *es, size_t n, int *disarmed);
/* Disarm every armed entry with this tag; returns how many. */
size_t kx_watcher_disarm_tag(kx_watcher *w, uint64_t tag);
/* Blocks up to slice_ns; 1 once the entry is no longer armed (posted, failed or disarmed),
 * 0 on timeout, -1 if the watcher stopped with it armed (it never posts). */
int kx_watch_wait(kx_watcher *w, kx_watch *e, int64_t slice_ns);
/* The owner drops the entry (disarming it if armed). */
void kx_watch_free(kx_watcher *w, kx_watch *e);
/* Bump -> post latencies (ns) of CPU bumps since the last call: to the first kx_write call
 * and to its return; returns how many (at most max, 8192 kept). */
size_t kx_watcher_latencies(kx_watcher *w, int64_t *call_ns, int64_t *post_ns, size_t max);
void kx_watcher_get_stats(kx_watcher *w, kx_watcher_stats *out);
/* Stop and join the thread (blocks up to timeout_ns; -FI_ETIMEDOUT: leaked, never freed). */
int kx_watcher_close(kx_watcher *w, int64_t timeout_ns);
void kx_watcher_free(kx_watcher *w);
/* Keep the rail's progress thread polling (delta +1) or release a hold (-1): data is
 * expected soon, e.g. a streamed request's layers (src/watcher.c). */
void kx_rail_hold_awake(kx_rail *r, int delta);

/* ---- libfabric versions (src/rail.c) ----------------------------------------------- */

uint32_t kx_runtime_version(void);
uint32_t kx_build_version(void);
int kx_have_dmabuf(void);

#endif
