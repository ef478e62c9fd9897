// Streams: create/query/synchronize/destroy, ordering on one stream, and
// ordering across two streams through cudaStreamWaitEvent.
#include <cuda_runtime.h>
#include "check.h"

int main() {
    test_begin("rt_stream");
    const size_t n = 8u << 20;
    unsigned char *h_in = nullptr, *h_out = nullptr;
    CHECK(cudaMallocHost((void **)&h_in, n));
    CHECK(cudaMallocHost((void **)&h_out, n));
    unsigned char *a = nullptr, *b = nullptr, *c = nullptr;
    CHECK(cudaMalloc((void **)&a, n));
    CHECK(cudaMalloc((void **)&b, n));
    CHECK(cudaMalloc((void **)&c, n));

    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    CHECK(cudaStreamQuery(s));
    CHECK(cudaStreamSynchronize(s));
    ok("new stream: cudaStreamQuery == cudaSuccess, synchronize");

    // One stream: H2D, D2D, D2H issued back to back must run in order.
    for (uint32_t round = 0; round < 5; round++) {
        fill_pattern(h_in, n, 100 + round);
        memset(h_out, 0, n);
        CHECK(cudaMemcpyAsync(a, h_in, n, cudaMemcpyHostToDevice, s));
        CHECK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, s));
        CHECK(cudaMemsetAsync(a, 0, n, s)); // must not affect b
        CHECK(cudaMemcpyAsync(h_out, b, n, cudaMemcpyDeviceToHost, s));
        CHECK(cudaStreamSynchronize(s));
        long long bad = check_pattern(h_out, n, 100 + round);
        EXPECT(bad < 0, "round %u: H2D -> D2D -> D2H on one stream: byte %lld wrong", round, bad);
    }
    CHECK(cudaStreamQuery(s));
    ok("async H2D then D2D then D2H on one stream gives the right data (5 rounds)");

    // Two streams: s1 fills a, records ev; s2 waits for ev, copies a -> c -> host.
    cudaStream_t s1, s2;
    CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    cudaEvent_t ev;
    CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    for (uint32_t round = 0; round < 5; round++) {
        fill_pattern(h_in, n, 200 + round);
        memset(h_out, 0, n);
        CHECK(cudaMemsetAsync(c, 0, n, s2));
        CHECK(cudaMemcpyAsync(a, h_in, n, cudaMemcpyHostToDevice, s1));
        CHECK(cudaEventRecord(ev, s1));
        CHECK(cudaStreamWaitEvent(s2, ev, 0));
        CHECK(cudaMemcpyAsync(c, a, n, cudaMemcpyDeviceToDevice, s2));
        CHECK(cudaMemcpyAsync(h_out, c, n, cudaMemcpyDeviceToHost, s2));
        CHECK(cudaStreamSynchronize(s2));
        long long bad = check_pattern(h_out, n, 200 + round);
        EXPECT(bad < 0, "round %u: two streams joined by cudaStreamWaitEvent: byte %lld wrong", round, bad);
    }
    ok("two streams ordered by cudaEventRecord + cudaStreamWaitEvent");

    int prio_lo = 0, prio_hi = 0;
    CHECK(cudaDeviceGetStreamPriorityRange(&prio_lo, &prio_hi));
    cudaStream_t sp;
    CHECK(cudaStreamCreateWithPriority(&sp, cudaStreamDefault, prio_hi));
    int prio = 12345;
    CHECK(cudaStreamGetPriority(sp, &prio));
    EXPECT(prio == prio_hi, "stream priority %d, asked for %d", prio, prio_hi);
    unsigned flags = 99;
    CHECK(cudaStreamGetFlags(s1, &flags));
    EXPECT(flags == cudaStreamNonBlocking, "stream flags %u", flags);
    CHECK(cudaStreamDestroy(sp));
    ok("stream priority range [%d, %d], priority and flags read back", prio_lo, prio_hi);

    // Legacy default stream and per-thread stream.
    fill_pattern(h_in, 4096, 300);
    CHECK(cudaMemcpyAsync(a, h_in, 4096, cudaMemcpyHostToDevice, cudaStreamLegacy));
    CHECK(cudaMemcpyAsync(h_out, a, 4096, cudaMemcpyDeviceToHost, cudaStreamPerThread));
    CHECK(cudaStreamSynchronize(cudaStreamPerThread));
    CHECK(cudaStreamSynchronize(cudaStreamLegacy));
    EXPECT(check_pattern(h_out, 4096, 300) < 0, "legacy stream then per-thread stream: data wrong");
    ok("cudaStreamLegacy then cudaStreamPerThread");

    // Many streams created and destroyed.
    cudaStream_t many[64];
    for (auto &x : many) CHECK(cudaStreamCreate(&x));
    for (auto &x : many) CHECK(cudaStreamSynchronize(x));
    for (auto &x : many) CHECK(cudaStreamDestroy(x));
    ok("64 streams created, synchronized, destroyed");

    CHECK(cudaEventDestroy(ev));
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaStreamDestroy(s1));
    CHECK(cudaStreamDestroy(s2));
    CHECK(cudaFree(a));
    CHECK(cudaFree(b));
    CHECK(cudaFree(c));
    CHECK(cudaFreeHost(h_in));
    CHECK(cudaFreeHost(h_out));
    CHECK(cudaDeviceSynchronize());
    return test_end();
}
