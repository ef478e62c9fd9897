// Host functions and stream callbacks run in stream order: after the work
// queued before them (an asynchronous copy into pinned memory has landed
// when they run) and before the work queued after them; a callback gets the
// stream's status. cudaProfilerStart/Stop answer success with no profiler.
#include <cuda_runtime.h>
#include "check.h"

// cuda_profiler_api.h is not in the PyPI wheels; cudart exports these.
extern "C" cudaError_t cudaProfilerStart(void);
extern "C" cudaError_t cudaProfilerStop(void);

struct Seen {
    const unsigned *pinned;
    unsigned value;
    int calls;
    cudaError_t status;
};

static void CUDART_CB host_fn(void *p) {
    Seen *s = (Seen *)p;
    s->value = s->pinned[0];
    s->calls++;
}

static void CUDART_CB callback(cudaStream_t, cudaError_t status, void *p) {
    Seen *s = (Seen *)p;
    s->value = s->pinned[0];
    s->status = status;
    s->calls++;
}

int main() {
    test_begin("rt_host_func");
    const size_t n = 1 << 20;
    unsigned *d = nullptr, *pinned = nullptr;
    CHECK(cudaMalloc(&d, n));
    CHECK(cudaMallocHost(&pinned, n));
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    const cudaStream_t streams[] = {s, 0};
    for (int k = 0; k < 2; k++) {
        Seen seen = {pinned, 0, 0, cudaErrorUnknown};
        memset(pinned, 0, n);
        CHECK(cudaMemsetAsync(d, 0x07 + k, n, streams[k]));
        CHECK(cudaMemcpyAsync(pinned, d, n, cudaMemcpyDeviceToHost, streams[k]));
        CHECK(cudaLaunchHostFunc(streams[k], host_fn, &seen));
        // Queued after the host function: it must not have run before it.
        CHECK(cudaMemsetAsync(d, 0x55, n, streams[k]));
        CHECK(cudaMemcpyAsync(pinned, d, n, cudaMemcpyDeviceToHost, streams[k]));
        CHECK(cudaStreamSynchronize(streams[k]));
        unsigned want = 0x01010101u * (0x07 + k);
        EXPECT(seen.calls == 1, "host function ran %d times", seen.calls);
        EXPECT(seen.value == want, "host function saw %#x, expected %#x (the copy before it)", seen.value, want);
        EXPECT(pinned[0] == 0x55555555u, "work after the host function saw %#x", pinned[0]);
        ok("cudaLaunchHostFunc on stream %d runs after the work before it and before the work after it", k);

        seen = {pinned, 0, 0, cudaErrorUnknown};
        CHECK(cudaMemsetAsync(d, 0x21, n, streams[k]));
        CHECK(cudaMemcpyAsync(pinned, d, n, cudaMemcpyDeviceToHost, streams[k]));
        CHECK(cudaStreamAddCallback(streams[k], callback, &seen, 0));
        CHECK(cudaStreamSynchronize(streams[k]));
        EXPECT(seen.calls == 1 && seen.status == cudaSuccess, "callback ran %d times, status %d", seen.calls,
               (int)seen.status);
        EXPECT(seen.value == 0x21212121u, "callback saw %#x", seen.value);
        ok("cudaStreamAddCallback on stream %d runs in order with cudaSuccess", k);
    }
    CHECK(cudaProfilerStart());
    CHECK(cudaProfilerStop());
    ok("cudaProfilerStart/Stop");
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFreeHost(pinned));
    CHECK(cudaFree(d));
    return test_end();
}
