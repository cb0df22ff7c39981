/* busy_core.c: what a thread's pause and wake-up cost beside a busy loop on its core.
 *
 * Why src/progress.c sleeps instead of yielding on a contended core, and why the watcher asks
 * for a short scheduler slice (src/sched.c; issue 28 item 3). A thread pinned to CPU 0 beside a
 * busy loop pinned there too measures:
 *   - sched_yield(): how long until it runs again (the busy loop's slice);
 *   - a 20 us nanosleep;
 *   - a wake-up through a pipe written from CPU 1, at the kernel's slice and at the watcher's
 *     (kx_sched_short_slice, src/sched.c: 100 us unless KVXFER_SLICE_US says otherwise;
 *     Linux >= 6.12's EEVDF).
 * With "quiet" as the first argument there is no busy loop.
 *
 *     cc -O2 -pthread -Iinclude -Isrc -o /tmp/busy_core bench/busy_core.c src/sched.c \
 *         && /tmp/busy_core && /tmp/busy_core quiet
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define N_WAKES 2000

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void pin(int cpu)
{
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    pthread_setaffinity_np(pthread_self(), sizeof(s), &s);
}

static void *busy(void *arg)
{
    (void)arg;
    pin(0);
    for (;;)
        __asm__ volatile("" ::: "memory");
    return NULL;
}

static int cmp64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

static void report(const char *what, int64_t *v, int n)
{
    int64_t sum = 0;
    for (int i = 0; i < n; i++)
        sum += v[i];
    qsort(v, n, sizeof(*v), cmp64);
    printf("%-30s mean %8.1f us  p50 %8.1f  p99 %8.1f  max %8.1f\n", what, sum / 1e3 / n, v[n / 2] / 1e3,
           v[n * 99 / 100] / 1e3, v[n - 1] / 1e3);
}

static int pipe_fd[2];
static int wakee_short;
static int64_t samples[N_WAKES];

static void *wakee(void *arg)
{
    (void)arg;
    pin(0);
    int err = wakee_short ? kx_sched_short_slice() : 0;
    if (err)
        fprintf(stderr, "kx_sched_short_slice: %s\n", strerror(-err));
    for (int i = 0; i < N_WAKES; i++) {
        int64_t t;
        if (read(pipe_fd[0], &t, sizeof(t)) != sizeof(t))
            exit(1);
        samples[i] = now_ns() - t;
    }
    return NULL;
}

static void wakeups(int short_slice)
{
    pthread_t w;
    wakee_short = short_slice;
    pthread_create(&w, NULL, wakee, NULL);
    usleep(10000);
    for (int i = 0; i < N_WAKES; i++) {
        usleep(500 + (i % 7) * 100);
        int64_t t = now_ns();
        if (write(pipe_fd[1], &t, sizeof(t)) != sizeof(t))
            exit(1);
    }
    pthread_join(w, NULL);
    report(short_slice ? "pipe wake-up, watcher's slice" : "pipe wake-up, kernel slice", samples, N_WAKES);
}

int main(int argc, char **argv)
{
    int quiet = argc > 1 && strcmp(argv[1], "quiet") == 0;
    pthread_t b;
    if (!quiet) {
        pthread_create(&b, NULL, busy, NULL);
        usleep(10000);
    }
    printf("%s\n", quiet ? "CPU 0 quiet" : "CPU 0 held by a busy loop");
    pin(0);
    static int64_t v[N_WAKES];
    for (int i = 0; i < N_WAKES; i++) {
        int64_t t = now_ns();
        sched_yield();
        v[i] = now_ns() - t;
    }
    report("sched_yield", v, N_WAKES);
    for (int i = 0; i < 200; i++) {
        int64_t t = now_ns();
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
        v[i] = now_ns() - t;
    }
    report("20 us nanosleep", v, 200);
    pin(1);
    if (pipe(pipe_fd) != 0)
        return 1;
    wakeups(0);
    wakeups(1);
    wakeups(0);
    wakeups(1);
    return 0;
}
