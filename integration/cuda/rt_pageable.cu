// Asynchronous device-to-host copies into pageable memory return only once
// the bytes are there, on every stream (created, legacy default, per-thread
// default), as CUDA documents and programs rely on (numba reads the buffer
// right after the call, or frees it). Into pinned memory the copy stays
// asynchronous and lands by the next synchronisation. Host-to-device copies
// from pageable memory leave the source free to reuse at return.
// Regression: rgpu once wrote pageable destinations at the next
// synchronising call: the program read stale bytes, and a buffer freed in
// between was written after its free.
#include <cuda_runtime.h>
#include <cstdlib>
#include <vector>
#include "check.h"

int main() {
    test_begin("rt_pageable");
    const size_t n = (1u << 20) + 13;
    char *d = nullptr;
    CHECK(cudaMalloc((void **)&d, n));
    std::vector<unsigned char> src(n);
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    const cudaStream_t streams[] = {s, 0, cudaStreamPerThread};
    const char *names[] = {"a created stream", "the legacy default stream", "the per-thread default stream"};
    uint32_t seed = 7;
    for (int k = 0; k < 3; k++) {
        fill_pattern(src.data(), n, seed);
        CHECK(cudaMemcpy(d, src.data(), n, cudaMemcpyHostToDevice));
        unsigned char *h = (unsigned char *)malloc(n);
        memset(h, 0, n);
        CHECK(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, streams[k]));
        // No synchronisation: the bytes must be there already.
        long long bad = check_pattern(h, n, seed);
        EXPECT(bad < 0, "pageable async copy on %s: byte %lld wrong at return", names[k], bad);
        free(h);
        seed++;
        ok("async device->host copy into pageable memory complete at return, on %s", names[k]);
    }

    // A pageable buffer freed right after its copy is never written again:
    // a buffer that takes its place keeps its bytes across a sync.
    for (int round = 0; round < 4; round++) {
        unsigned char *h = (unsigned char *)malloc(n);
        CHECK(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, s));
        free(h);
        unsigned char *other = (unsigned char *)malloc(n);
        memset(other, 0xA5, n);
        CHECK(cudaStreamSynchronize(s));
        CHECK(cudaDeviceSynchronize());
        EXPECT(check_bytes(other, n, 0xA5) < 0, "memory freed after an async copy was written after its free");
        free(other);
    }
    ok("a pageable buffer freed after its async copy is not written later");

    // Host-to-device from pageable memory: the source may be reused at once.
    fill_pattern(src.data(), n, seed);
    CHECK(cudaMemcpyAsync(d, src.data(), n, cudaMemcpyHostToDevice, s));
    memset(src.data(), 0, n);
    std::vector<unsigned char> back(n);
    CHECK(cudaMemcpy(back.data(), d, n, cudaMemcpyDeviceToHost));
    long long bad = check_pattern(back.data(), n, seed);
    EXPECT(bad < 0, "async host->device copy from pageable memory: byte %lld wrong after the source was reused", bad);
    ok("async host->device copy from pageable memory took the source at return");
    seed++;

    // Pinned destinations: asynchronous, complete by the stream's sync.
    unsigned char *pinned = nullptr;
    CHECK(cudaMallocHost((void **)&pinned, n));
    fill_pattern(src.data(), n, seed);
    CHECK(cudaMemcpy(d, src.data(), n, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpyAsync(pinned, d, n, cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    bad = check_pattern(pinned, n, seed);
    EXPECT(bad < 0, "pinned async copy: byte %lld wrong after the stream's sync", bad);
    ok("async device->host copy into pinned memory complete by the stream's sync");
    CHECK(cudaFreeHost(pinned));
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFree(d));
    return test_end();
}
