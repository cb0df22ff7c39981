/* fifo_nap.c: what a poll loop's pause costs at SCHED_FIFO: sched_yield against a 20 us nanosleep.
 *
 * Why src/progress.c naps KX_RT_NAP_NS at SCHED_FIFO instead of sched_yield (issue 28): a FIFO
 * thread's yield lets no normal thread run, so a yield loop takes its whole core; a 20 us nap
 * leaves most of it. Runs each pause for 0.5 s and prints iterations, CPU time and us per pause,
 * at normal scheduling, or at SCHED_FIFO 5 with an argument (needs CAP_SYS_NICE).
 *
 *     cc -O2 -o /tmp/fifo_nap bench/fifo_nap.c && /tmp/fifo_nap && /tmp/fifo_nap fifo
 */
#include <sched.h>
#include <stdio.h>
#include <time.h>

static double now(clockid_t c)
{
    struct timespec t;
    clock_gettime(c, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    (void)argv;
    int fifo = argc > 1;
    struct sched_param sp = {.sched_priority = 5};
    if (fifo && sched_setscheduler(0, SCHED_FIFO, &sp) != 0) {
        perror("sched_setscheduler(SCHED_FIFO)");
        return 1;
    }
    for (int nap = 0; nap < 2; nap++) {
        double w0 = now(CLOCK_MONOTONIC), c0 = now(CLOCK_THREAD_CPUTIME_ID);
        long n = 0;
        while (now(CLOCK_MONOTONIC) - w0 < 0.5) {
            if (nap) {
                struct timespec ts = {0, 20000};
                nanosleep(&ts, NULL);
            } else {
                sched_yield();
            }
            n++;
        }
        double w = now(CLOCK_MONOTONIC) - w0, c = now(CLOCK_THREAD_CPUTIME_ID) - c0;
        printf("%s %s: %ld pauses in %.3f s, cpu %.3f s (%.0f%%), %.1f us per pause\n", fifo ? "fifo" : "normal",
               nap ? "nap 20us" : "sched_yield", n, w, c, 100 * c / w, 1e6 * w / n);
    }
    return 0;
}
