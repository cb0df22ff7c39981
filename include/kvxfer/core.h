/* core.h: the native engine. One RDM endpoint per engine, one CQ, one progress thread.
 *
 * Ownership: the engine owns fabric/domain/av/cq/ep, the progress thread, the immediate
 * counter table, the posted receive buffers and the message queue. A kx_xfer is shared by
 * its Python owner and the in-flight operations (refcount); a kx_counter likewise by its
 * Python owner and the table entry that will complete it.
 *
 * Threads: posting threads (Python callers, GIL released) post until the provider says
 * -FI_EAGAIN and queue the rest; the progress thread alone reads the CQ and posts what is
 * queued. Neither ever touches a Python object. Shared bookkeeping is under the hub's lock;
 * state changes that a waiter cares about broadcast the hub's condition variable. */
#ifndef KVXFER_CORE_H
#define KVXFER_CORE_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <sys/random.h>

#include "kvxfer/compat.h"

#define KX_MAX_IOV 16          /* upper bound on iovecs per message we ever build */
#define KX_RX_BUFS 32          /* posted receive buffers for control messages */
#define KX_MSG_MAX 65536       /* largest control message */
#define KX_CQ_BATCH 64

enum { KX_OP_WRITE = 1, KX_OP_SEND = 2, KX_OP_RECV = 3 };

typedef struct kx_engine kx_engine;

/* Every context handed to libfabric starts with this header; the fi_context2 scratch space
 * comes first because providers in FI_CONTEXT(2) mode own it until the completion is read. */
typedef struct kx_op {
    struct fi_context2 fi;
    int kind;
    void *owner;           /* kx_xfer*, kx_sendbuf* or kx_rxbuf* */
} kx_op;

typedef struct kx_xfer {
    kx_op shared_op;       /* used for every write when the provider needs no per-op context */
    kx_op *ops;            /* per-op contexts when it does */
    int64_t planned;       /* messages the plan contains */
    int64_t posted;        /* messages posted so far */
    int64_t completed;     /* completions read (success or error) */
    int posting_done;      /* the posting call has returned */
    int done;              /* waiters may stop: all completed, or failed early (dead peer) */
    int linked;            /* on the in-flight list: the provider may still own its contexts */
    int64_t last_ns;       /* its last post or completion: the per-transfer stall clock */
    int64_t written_off;   /* operations given up on (stalled): their late completions are not the peer's */
    int error;             /* first positive errno seen, 0 if none */
    int refs;              /* Python owner + in-flight */
    struct kx_xfer *prev, *next;   /* the engine's in-flight list */
    struct kx_xfer *qnext;         /* the engine's posting queue */

    /* posting state: a resumable walk over a private copy of the caller's triples */
    const uint64_t *so, *dof, *ln;
    uint64_t *owned;               /* that copy (3 n words), freed with the transfer */
    size_t n, i;                   /* triples, next triple */
    uint64_t s, d, l;              /* the segment being cut into pieces */
    size_t iov;
    uint64_t max_write, pack_min;
    fi_addr_t peer;
    char *src_base;
    void *desc;
    uint64_t dst_base, key, flags;
    uint32_t imm;
    int have_msg;                  /* a built message is waiting for queue space */
    int cancel;                    /* set by kx_xfer_cancel: post nothing more */
    int np;
    uint64_t ps[KX_MAX_IOV], pd[KX_MAX_IOV], pl[KX_MAX_IOV];
} kx_xfer;

typedef struct kx_counter {
    uint32_t imm;
    uint64_t count;
    uint64_t arrived;      /* arrivals credited to this expectation */
    int done;
    int error;
    int want_callback;
    int refs;              /* Python owner + table entry / callback queue */
    struct kx_counter *next_done;
} kx_counter;

typedef struct kx_centry {
    uint32_t imm;
    int used;
    uint64_t arrived;      /* arrivals not yet consumed by an expectation */
    kx_counter *active;    /* the expectation waiting on this imm, if any */
} kx_centry;

typedef struct kx_ctable {
    kx_centry *slots;
    size_t cap;            /* power of two */
    size_t len;
} kx_ctable;

typedef struct kx_rxbuf {
    kx_op op;
    char *data;
    int repost;            /* its message was taken; post it again */
} kx_rxbuf;

typedef struct kx_msg {
    struct kx_msg *next;
    size_t len;
    char data[];
} kx_msg;

typedef struct kx_sendbuf {
    kx_op op;
    fi_addr_t peer;
    struct fid_mr *mr;     /* registered only where the provider wants FI_MR_LOCAL */
    size_t len;
    char data[];
} kx_sendbuf;

/* What the rails (one endpoint per NIC) of one engine share: the lock, the condition every
 * waiter sleeps on, the immediate-counter table (so counts are exact however writes were
 * striped over rails), the callback queue and the control-message queue. */
typedef struct kx_hub {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int refs;              /* rails holding it */
    int open;              /* rails not yet torn down */
    kx_ctable table;
    kx_counter *done_head, *done_tail;   /* counters with callbacks, for the dispatcher */
    int dispatch_stop;
    kx_msg *msg_head, *msg_tail;
    size_t nmsgs;
    uint64_t stat_imm;     /* immediates received */
} kx_hub;

struct kx_engine {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_ep *ep;

    uint64_t mr_mode;
    uint64_t caps;
    size_t iov_limit;      /* min(iov_limit, rma_iov_limit, KX_MAX_IOV) */
    size_t max_msg_size;
    size_t inject_size;
    size_t cq_data_size;
    int need_ctx;          /* provider asked for FI_CONTEXT / FI_CONTEXT2 */
    int has_wait;          /* the CQ has a wait object usable with fi_cq_sread */
    uint64_t next_key;

    kx_hub *hub;           /* shared with the engine's other rails */

    /* progress */
    pthread_t thread;
    int thread_started;
    volatile int stop;
    int spin;              /* busy-poll instead of blocking */
    int posting;           /* threads inside a direct posting burst: the progress thread yields */
    int busy;              /* threads inside any native call on the endpoint: teardown waits */
    int leaked;            /* the progress thread could not be joined: never free what it uses */
    int parked;            /* the endpoint is left open, unprogressed, never closed (see kx_engine_park) */
    int64_t outstanding;   /* tx operations posted and not completed (atomic) */
    int64_t last_activity_ns;
    cpu_set_t cpus;
    int pin;
    int sleeping;          /* progress thread is blocked; posts must wake it */
    int torn_down;
    int quiesced;
    pthread_mutex_t reg_lock;  /* serialises registrations (reg_local_only) */
    int reg_local_only;        /* the registration under way grants no remote access */
    pid_t tid;             /* the progress thread's kernel id, for tests of pinning */

    kx_xfer *inflight;     /* transfers with operations outstanding */
    kx_xfer *q_head, *q_tail;   /* transfers with messages still to post (progress thread posts) */
    int cancel_pending;         /* a queued transfer was cancelled: the progress thread sweeps the queue */

    /* peers (liveness.h): a fixed directory of lazily allocated chunks, indexed by fi_addr */
    struct kx_peer **pdir;
    size_t peer_hi;            /* one past the highest fi_addr ever tracked */
    int64_t peer_timeout_ns;   /* outstanding to a peer and silent this long: it is dead (0: never) */
    int delivery_complete;     /* writes complete only once placed at the target (refusals surface) */
    int64_t last_scan_ns;
    int64_t eagain_ns;         /* the progress thread's last post refused with -FI_EAGAIN */
    struct kx_local *self_local;   /* this endpoint, as other engines of this process see it */

    kx_rxbuf rx[KX_RX_BUFS];
    struct fid_mr *rx_mr;  /* the receive slab's registration (FI_MR_LOCAL providers) */
    void *rx_desc;

    int took_msgs;         /* a control message arrived (someone connected to us) */
    uint64_t stat_rx_err;  /* error completions not tied to a transfer */
    uint64_t stat_writes;  /* messages posted */
};

static inline int64_t kx_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void kx_deadline(struct timespec *ts, int64_t ns)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += ns / 1000000000LL;
    ts->tv_nsec += ns % 1000000000LL;
    if (ts->tv_nsec >= 1000000000L) { ts->tv_sec++; ts->tv_nsec -= 1000000000L; }
}

#endif
