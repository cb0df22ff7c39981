/* check.h: the smallest test harness: CHECK(cond) records a failure with its line and goes
 * on; main returns the failure count. */
#ifndef KVXFER_TEST_CHECK_H
#define KVXFER_TEST_CHECK_H

#include <stdio.h>

static int kx_test_failures;
static int kx_test_checks;

#define CHECK(cond)                                                                  \
    do {                                                                             \
        kx_test_checks++;                                                            \
        if (!(cond)) {                                                               \
            kx_test_failures++;                                                      \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                            \
    } while (0)

#define CHECK_EQ(a, b)                                                                     \
    do {                                                                                   \
        long long _a = (long long)(a), _b = (long long)(b);                                \
        kx_test_checks++;                                                                  \
        if (_a != _b) {                                                                    \
            kx_test_failures++;                                                            \
            fprintf(stderr, "%s:%d: CHECK_EQ failed: %s == %lld, %s == %lld\n", __FILE__, \
                    __LINE__, #a, _a, #b, _b);                                             \
        }                                                                                  \
    } while (0)

static int kx_test_report(const char *name)
{
    printf("%s: %d checks, %d failed\n", name, kx_test_checks, kx_test_failures);
    return kx_test_failures ? 1 : 0;
}

#endif
