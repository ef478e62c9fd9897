// Pinned host memory: cudaMallocHost, cudaHostAlloc, cudaFreeHost, and async
// copies from and to it.
#include <cuda_runtime.h>
#include "check.h"

int main() {
    test_begin("rt_pinned");
    const size_t n = 16u << 20;
    unsigned char *p1 = nullptr, *p2 = nullptr, *p3 = nullptr;
    CHECK(cudaMallocHost((void **)&p1, n));
    EXPECT(p1 != nullptr, "cudaMallocHost gave NULL");
    CHECK(cudaHostAlloc((void **)&p2, n, cudaHostAllocDefault));
    CHECK(cudaHostAlloc((void **)&p3, n, cudaHostAllocPortable));
    ok("cudaMallocHost, cudaHostAlloc(Default), cudaHostAlloc(Portable)");

    // The memory is ordinary host memory to the program.
    memset(p1, 0xAB, n);
    memset(p2, 0xCD, n);
    EXPECT(check_bytes(p1, n, 0xAB) < 0, "pinned memory not writable");
    ok("pinned memory is readable and writable from the host");

    cudaPointerAttributes a;
    memset(&a, 0, sizeof a);
    CHECK(cudaPointerGetAttributes(&a, p1 + 100));
    EXPECT(a.type == cudaMemoryTypeHost, "cudaPointerGetAttributes type %d", (int)a.type);
    ok("cudaPointerGetAttributes says host memory");
    unsigned flags = 99;
    CHECK(cudaHostGetFlags(&flags, p3));
    EXPECT((flags & cudaHostAllocPortable) != 0, "cudaHostGetFlags %u lacks Portable", flags);
    ok("cudaHostGetFlags = 0x%x", flags);

    void *d = nullptr;
    CHECK(cudaMalloc(&d, n));
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    const size_t sizes[] = {1, 4097, 1u << 20, n};
    uint32_t seed = 50;
    for (size_t m : sizes) {
        fill_pattern(p1, m, seed);
        memset(p2, 0, m);
        CHECK(cudaMemcpyAsync(d, p1, m, cudaMemcpyHostToDevice, s));
        CHECK(cudaMemcpyAsync(p2, d, m, cudaMemcpyDeviceToHost, s));
        CHECK(cudaStreamSynchronize(s));
        long long bad = check_pattern(p2, m, seed);
        EXPECT(bad < 0, "async pinned round trip of %zu bytes: byte %lld wrong", m, bad);
        seed++;
    }
    ok("async H2D from and D2H to pinned memory, 1 B .. 16 MiB");

    // cudaMemcpyDefault between pinned and device memory.
    fill_pattern(p3, 999, seed);
    CHECK(cudaMemcpy((char *)d + 1, p3, 999, cudaMemcpyDefault));
    memset(p1, 0, 999);
    CHECK(cudaMemcpy(p1, (char *)d + 1, 999, cudaMemcpyDefault));
    EXPECT(check_pattern(p1, 999, seed) < 0, "cudaMemcpyDefault with pinned memory wrong");
    ok("cudaMemcpyDefault between pinned and device memory");

    // Pinned to pinned through the runtime.
    fill_pattern(p1, 4096, seed + 1);
    CHECK(cudaMemcpy(p2, p1, 4096, cudaMemcpyHostToHost));
    EXPECT(check_pattern(p2, 4096, seed + 1) < 0, "cudaMemcpyHostToHost wrong");
    ok("cudaMemcpyHostToHost between pinned buffers");

    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFree(d));
    CHECK(cudaFreeHost(p1));
    CHECK(cudaFreeHost(p2));
    CHECK(cudaFreeHost(p3));
    ok("cudaFreeHost x3");

    // Allocate and free pinned memory repeatedly.
    for (int i = 0; i < 50; i++) {
        void *q = nullptr;
        CHECK(cudaMallocHost(&q, 1 << 20));
        CHECK(cudaFreeHost(q));
    }
    ok("50 rounds of cudaMallocHost/cudaFreeHost");
    return test_end();
}
