/* LD_PRELOAD shim for tests/fabric/test_disconnect.py: fi_freeinfo sleeps KX_SLOW_FREEINFO_MS
 * first (it only widens a race window), prints its thread and pointer to stderr, then calls
 * libfabric's own. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

struct fi_info;

void fi_freeinfo(struct fi_info *info)
{
    static void (*real)(struct fi_info *);
    if (!real) {
        /* libfabric is loaded by the extension, not in the global scope (so not RTLD_NEXT) */
        void *lib = dlopen("libfabric.so.1", RTLD_NOW | RTLD_NOLOAD);
        real = lib ? (void (*)(struct fi_info *))dlsym(lib, "fi_freeinfo") : NULL;
        if (!real)
            abort();
    }
    const char *ms = getenv("KX_SLOW_FREEINFO_MS");
    fprintf(stderr, "[shim] tid %ld fi_freeinfo %p\n", (long)syscall(SYS_gettid), (void *)info);
    if (ms) {
        struct timespec ts = {0, atol(ms) * 1000000L};
        nanosleep(&ts, NULL);
    }
    real(info);
}
