// Shared helpers for the rgpu integration test programs.
//
// Every program prints one "ok: <what>" line per passed check and ends with
// "PASS <program>" and exit status 0. The first failed check prints
// "FAIL <program>: <what> ..." on stderr and exits with status 1, so the
// harness output names the check that broke.
#pragma once
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

static const char *g_prog = "program";

static inline void test_begin(const char *name) {
    g_prog = name;
    setvbuf(stdout, nullptr, _IOLBF, 0);
    printf("BEGIN %s\n", name);
    fflush(stdout);
}

__attribute__((format(printf, 1, 2))) static inline void ok(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("ok: ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    fflush(stdout);
}

__attribute__((format(printf, 1, 2))) static inline void note(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("note: ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    fflush(stdout);
}

[[noreturn]] __attribute__((format(printf, 1, 2))) static inline void fail(const char *fmt, ...) {
    fflush(stdout);
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "FAIL %s: ", g_prog);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    fflush(stderr);
    printf("FAILED %s\n", g_prog);
    fflush(stdout);
    exit(1);
}

static inline int test_end() {
    printf("PASS %s\n", g_prog);
    fflush(stdout);
    return 0;
}

[[noreturn]] __attribute__((format(printf, 4, 5))) static inline void fail_expect(const char *file, int line, const char *cond,
                                                                                  const char *fmt, ...) {
    fflush(stdout);
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "FAIL %s: %s:%d: expected %s; ", g_prog, file, line, cond);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    fflush(stderr);
    printf("FAILED %s\n", g_prog);
    fflush(stdout);
    exit(1);
}

// Checks an arbitrary condition; the rest is a printf format and its
// arguments describing what was found.
#define EXPECT(cond, ...)                                                      \
    do {                                                                       \
        if (!(cond)) fail_expect(__FILE__, __LINE__, #cond, __VA_ARGS__);      \
    } while (0)

// Deterministic byte pattern: pattern_byte(seed, i).
static inline unsigned char pattern_byte(uint32_t seed, size_t i) {
    uint64_t x = (uint64_t)seed * 0x9E3779B97F4A7C15ull + i * 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 32;
    return (unsigned char)x;
}

static inline void fill_pattern(void *p, size_t n, uint32_t seed) {
    unsigned char *b = (unsigned char *)p;
    for (size_t i = 0; i < n; i++) b[i] = pattern_byte(seed, i);
}

// Returns the index of the first byte that differs from the pattern, or -1.
static inline long long check_pattern(const void *p, size_t n, uint32_t seed) {
    const unsigned char *b = (const unsigned char *)p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != pattern_byte(seed, i)) return (long long)i;
    return -1;
}

static inline long long check_bytes(const void *p, size_t n, unsigned char v) {
    const unsigned char *b = (const unsigned char *)p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != v) return (long long)i;
    return -1;
}

// Integer option "--name value" from argv, or dflt.
static inline long long arg_ll(int argc, char **argv, const char *name, long long dflt) {
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0) return strtoll(argv[i + 1], nullptr, 0);
    return dflt;
}

static inline bool arg_flag(int argc, char **argv, const char *name) {
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], name) == 0) return true;
    return false;
}

#ifdef __CUDA_RUNTIME_H__
// Runtime API: the call must return cudaSuccess.
#define CHECK(call)                                                            \
    do {                                                                       \
        cudaError_t e_ = (call);                                               \
        if (e_ != cudaSuccess)                                                 \
            fail("%s:%d: %s returned %d (%s: %s)", __FILE__, __LINE__, #call,  \
                 (int)e_, cudaGetErrorName(e_), cudaGetErrorString(e_));       \
    } while (0)

// Runtime API: the call must return exactly `want`.
#define CHECK_ERR(call, want)                                                  \
    do {                                                                       \
        cudaError_t e_ = (call);                                               \
        if (e_ != (want))                                                      \
            fail("%s:%d: %s returned %d (%s), expected %d (%s)", __FILE__,     \
                 __LINE__, #call, (int)e_, cudaGetErrorName(e_), (int)(want),  \
                 cudaGetErrorName(want));                                      \
    } while (0)
#endif

#ifdef __cuda_cuda_h__
static inline const char *cu_err_name(CUresult r) {
    const char *s = nullptr;
    if (cuGetErrorName(r, &s) != CUDA_SUCCESS || !s) return "?";
    return s;
}

// Driver API: the call must return CUDA_SUCCESS.
#define CU_CHECK(call)                                                         \
    do {                                                                       \
        CUresult r_ = (call);                                                  \
        if (r_ != CUDA_SUCCESS)                                                \
            fail("%s:%d: %s returned %d (%s)", __FILE__, __LINE__, #call,      \
                 (int)r_, cu_err_name(r_));                                    \
    } while (0)

// Driver API: the call must return exactly `want`.
#define CU_CHECK_ERR(call, want)                                               \
    do {                                                                       \
        CUresult r_ = (call);                                                  \
        if (r_ != (want))                                                      \
            fail("%s:%d: %s returned %d (%s), expected %d (%s)", __FILE__,     \
                 __LINE__, #call, (int)r_, cu_err_name(r_), (int)(want),       \
                 cu_err_name(want));                                           \
    } while (0)
#endif
