// Events: record, synchronize, query, elapsed time, flags and error cases.
#include <cuda_runtime.h>
#include <vector>
#include "check.h"

int main() {
    test_begin("rt_event");
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    CHECK(cudaEventQuery(start)); // never recorded: cudaSuccess
    ok("cudaEventQuery on a never-recorded event returns cudaSuccess");

    const size_t n = 64u << 20;
    std::vector<unsigned char> h(n);
    fill_pattern(h.data(), n, 7);
    void *d = nullptr;
    CHECK(cudaMalloc(&d, n));
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));

    CHECK(cudaEventRecord(start, s));
    CHECK(cudaMemcpyAsync(d, h.data(), n, cudaMemcpyHostToDevice, s));
    CHECK(cudaMemcpyAsync(h.data(), d, n, cudaMemcpyDeviceToHost, s));
    CHECK(cudaEventRecord(stop, s));
    CHECK(cudaEventSynchronize(stop));
    CHECK(cudaEventQuery(stop));
    CHECK(cudaEventQuery(start));
    ok("record / synchronize / query");
    EXPECT(check_pattern(h.data(), n, 7) < 0, "data wrong after the timed copies");

    float ms = -1;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    EXPECT(ms >= 0.0f && ms < 60000.0f, "elapsed time %f ms", ms);
    ok("cudaEventElapsedTime over 2 x 64 MiB copies: %.3f ms", ms);
    float back = 1;
    CHECK(cudaEventElapsedTime(&back, start, start));
    EXPECT(back == 0.0f || (back > -0.01f && back < 0.01f), "elapsed(start, start) = %f", back);
    ok("cudaEventElapsedTime(start, start) = %f", back);

    // Events on the default stream, timed around cudaDeviceSynchronize.
    CHECK(cudaEventRecord(start));
    CHECK(cudaMemset(d, 0, n));
    CHECK(cudaEventRecord(stop));
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    EXPECT(ms >= 0.0f && ms < 60000.0f, "elapsed time on stream 0: %f ms", ms);
    ok("events on the default stream: %.3f ms", ms);

    // A timing-disabled event cannot be timed.
    cudaEvent_t nt;
    CHECK(cudaEventCreateWithFlags(&nt, cudaEventDisableTiming));
    CHECK(cudaEventRecord(nt, s));
    CHECK(cudaEventSynchronize(nt));
    CHECK_ERR(cudaEventElapsedTime(&ms, start, nt), cudaErrorInvalidResourceHandle);
    cudaGetLastError();
    ok("cudaEventElapsedTime with a cudaEventDisableTiming event -> cudaErrorInvalidResourceHandle");

    // An event that was never recorded cannot be timed either.
    cudaEvent_t fresh;
    CHECK(cudaEventCreate(&fresh));
    CHECK_ERR(cudaEventElapsedTime(&ms, fresh, stop), cudaErrorInvalidResourceHandle);
    cudaGetLastError();
    ok("cudaEventElapsedTime with a never-recorded event -> cudaErrorInvalidResourceHandle");

    // Blocking-sync events behave the same from the program's view.
    cudaEvent_t bs;
    CHECK(cudaEventCreateWithFlags(&bs, cudaEventBlockingSync));
    CHECK(cudaMemcpyAsync(d, h.data(), 1 << 20, cudaMemcpyHostToDevice, s));
    CHECK(cudaEventRecord(bs, s));
    CHECK(cudaEventSynchronize(bs));
    CHECK(cudaEventQuery(bs));
    ok("cudaEventBlockingSync event");

    // Re-recording an event many times.
    for (int i = 0; i < 100; i++) {
        CHECK(cudaEventRecord(start, s));
        CHECK(cudaEventRecord(stop, s));
    }
    CHECK(cudaEventSynchronize(stop));
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    EXPECT(ms >= 0.0f && ms < 60000.0f, "elapsed after re-recording: %f", ms);
    ok("events re-recorded 100 times");

    CHECK(cudaEventDestroy(bs));
    CHECK(cudaEventDestroy(fresh));
    CHECK(cudaEventDestroy(nt));
    CHECK(cudaEventDestroy(start));
    CHECK(cudaEventDestroy(stop));
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFree(d));
    return test_end();
}
