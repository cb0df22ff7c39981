/* A short scheduler slice for the watcher thread (kx_sched_short_slice).
 *
 * Linux's EEVDF scheduler (6.6+; a per-task slice from 6.12) gives each normal thread a
 * deadline one slice after it becomes eligible. A thread that asks for a short slice has an
 * early deadline, so when it wakes it preempts a busy thread of its core at once instead of
 * waiting for the end of that thread's slice; its share of the CPU does not change. Beside a
 * busy loop on its core, a pipe wake-up's worst case fell from 3.5-4.0 ms to 18-30 us
 * (bench/busy_core.c), and beside a CPU hog the streaming bench's bump -> post p99 from a
 * median of about 2.8 ms to one of about 0.65 ms over 8 runs (docs/benchmarks.md, issue 28
 * item 3). Only the watcher asks for it: it wakes, posts for microseconds and sleeps
 * again. The progress threads do not: with it, a bulk transfer beside a busy loop on tcp ran
 * 3x slower (chopped into 100 us runs); nor do the messenger's Python threads (a thread cut
 * short while it holds the GIL stalls the others; the tails it gave were no better). A kernel
 * without per-task slices accepts the call and ignores it; a refusal changes nothing; a
 * SCHED_FIFO thread is left alone.
 *
 * KVXFER_SLICE_US: the slice in microseconds (default 100; 0 leaves the kernel's own).
 */
#include "internal.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#define KX_SLICE_US_DEFAULT 100L

int kx_sched_short_slice(void)
{
    long us = KX_SLICE_US_DEFAULT;
    const char *env = getenv("KVXFER_SLICE_US");
    if (env && *env)
        us = strtol(env, NULL, 10);
    if (us <= 0 || sched_getscheduler(0) != SCHED_OTHER)
        return 0;
#ifdef SYS_sched_setattr
    struct {                       /* struct sched_attr, SCHED_ATTR_SIZE_VER0 */
        uint32_t size, policy;
        uint64_t flags;
        int32_t nice;
        uint32_t priority;
        uint64_t runtime, deadline, period;
    } attr = {.size = 48, .policy = SCHED_OTHER, .nice = getpriority(PRIO_PROCESS, 0),
              .runtime = (uint64_t)us * 1000};
    if (syscall(SYS_sched_setattr, 0, &attr, 0) != 0)
        return -errno;
    return 0;
#else
    return -ENOSYS;
#endif
}
