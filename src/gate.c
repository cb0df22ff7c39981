/* gate.c: the rail's gate, the bottom primitives every other unit uses: callers in and out
 * of the endpoint (kx_enter/kx_leave, which closing waits out), posting bursts the progress
 * thread waits behind (kx_posting_begin/end/wait), and waking a sleeping progress thread
 * (kx_wake). It calls nothing of kvxfer's but the doorbell's poke (bell.c). */
#include "internal.h"

#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Every native call that uses the endpoint or domain from a caller's thread is bracketed by
 * kx_enter/kx_leave; closing sets stop and then waits for busy == 0 before closing fids.
 * (seq_cst on both sides: a caller either sees stop, or closing sees it busy.) */
int kx_enter(kx_rail *r)
{
    __atomic_add_fetch(&r->busy, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&r->stop, __ATOMIC_SEQ_CST)) {
        __atomic_sub_fetch(&r->busy, 1, __ATOMIC_SEQ_CST);
        return 0;
    }
    return 1;
}

void kx_leave(kx_rail *r)
{
    __atomic_sub_fetch(&r->busy, 1, __ATOMIC_SEQ_CST);
}

void kx_posting_begin(kx_rail *r)
{
    __atomic_add_fetch(&r->posting, 1, __ATOMIC_SEQ_CST);
}

/* the last poster out wakes a progress thread waiting in kx_posting_wait (Dekker: posting
 * then posting_wait here, posting_wait then posting there, seq_cst on both sides) */
void kx_posting_end(kx_rail *r)
{
    if (__atomic_sub_fetch(&r->posting, 1, __ATOMIC_SEQ_CST) == 0 &&
        __atomic_load_n(&r->posting_wait, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &r->posting, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* the progress thread, while callers post: sleep until the last of them is done (1 ms at
 * most: stop and a waiter that starts to drive are seen within that). It used to nap 20 us
 * at a time, a dozen timer wake-ups per small request on the messenger's prefill side. */
void kx_posting_wait(kx_rail *r)
{
    __atomic_store_n(&r->posting_wait, 1, __ATOMIC_SEQ_CST);
    int v = __atomic_load_n(&r->posting, __ATOMIC_SEQ_CST);
    if (v > 0 && !r->stop) {
        struct timespec ts = {0, 1000000};
        syscall(SYS_futex, &r->posting, FUTEX_WAIT_PRIVATE, v, &ts, NULL, 0);
    }
    __atomic_store_n(&r->posting_wait, 0, __ATOMIC_SEQ_CST);
}

/* a post (or a cancel) happened: wake a sleeping progress thread */
void kx_wake(kx_rail *r)
{
    if (__atomic_load_n(&r->sleeping, __ATOMIC_SEQ_CST)) {
        if (r->has_wait && kx_enter(r)) {      /* never signal a CQ that closing may close */
            fi_cq_signal(r->cq);
            kx_leave(r);
        }
        kx_bell_poke(r->bell);
        pthread_mutex_lock(&r->hub->lock);
        pthread_cond_broadcast(&r->hub->cond);
        pthread_mutex_unlock(&r->hub->lock);
    }
}
