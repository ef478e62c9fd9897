// The device runs asynchronously: the asyncAPI pattern (launch, record an
// event, poll cudaEventQuery while counting host iterations) counts host
// iterations, the result is right afterwards, and kernels of two
// non-blocking streams run at the same time (each waits to see the other's
// flag, which only two kernels running together can), and a stream waiting
// on another's event is ordered after it.
#include <cuda_runtime.h>
#include <chrono>
#include "check.h"

__global__ void count_to(unsigned *out, unsigned n) {
    unsigned i = 0;
    for (; i < n; i++) {
        // volatile: the loop must run, not fold to its result.
        asm volatile("");
    }
    if (threadIdx.x == 0) out[blockIdx.x] = i + threadIdx.x;
}

// Sets *mine, then waits (at most n turns) to see *theirs set: both end with
// 2 only if the two kernels ran at the same time.
__global__ void meet(volatile unsigned *mine, volatile unsigned *theirs, unsigned n) {
    *mine = 1;
    for (unsigned i = 0; i < n; i++) {
        if (*theirs != 0) {
            *mine = 2;
            return;
        }
    }
}

static double seconds_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

int main() {
    test_begin("rt_async_device");
    unsigned *d = nullptr;
    CHECK(cudaMalloc(&d, 4 * sizeof(unsigned)));
    const unsigned n = 200000;

    // asyncAPI: work on the device while the host counts.
    cudaEvent_t done;
    CHECK(cudaEventCreate(&done));
    auto t = std::chrono::steady_clock::now();
    count_to<<<1, 128>>>(d, n);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(done, 0));
    unsigned long long iterations = 0;
    cudaError_t q;
    while ((q = cudaEventQuery(done)) == cudaErrorNotReady) iterations++;
    CHECK(q);
    double single = seconds_since(t);
    unsigned h = 0;
    CHECK(cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost));
    EXPECT(h == n, "kernel result %u, expected %u", h, n);
    EXPECT(iterations > 0, "the host counted no iteration while the kernel ran (%.3f s)", single);
    ok("asyncAPI pattern: %llu host iterations while the kernel ran (%.3f s)", iterations, single);

    // Two non-blocking streams: their kernels run at the same time.
    cudaStream_t a, b;
    CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
    CHECK(cudaMemset(d, 0, 4 * sizeof(unsigned)));
    meet<<<1, 1, 0, a>>>(d, d + 1, 20000000);
    meet<<<1, 1, 0, b>>>(d + 1, d, 20000000);
    CHECK(cudaDeviceSynchronize());
    unsigned hb[2] = {0, 0};
    CHECK(cudaMemcpy(hb, d, sizeof hb, cudaMemcpyDeviceToHost));
    EXPECT(hb[0] == 2 && hb[1] == 2, "the streams' kernels did not run together (flags %u %u)", hb[0], hb[1]);
    ok("kernels of two non-blocking streams run at the same time");
    count_to<<<1, 128, 0, a>>>(d + 1, n);
    EXPECT(cudaStreamQuery(a) == cudaErrorNotReady, "cudaStreamQuery did not answer cudaErrorNotReady while the stream's kernel ran");
    CHECK(cudaStreamSynchronize(a));
    CHECK(cudaStreamQuery(a));
    ok("cudaStreamQuery answers cudaErrorNotReady while the stream's kernel runs, cudaSuccess after");

    // A stream waiting on another's event runs after it.
    cudaEvent_t ea;
    CHECK(cudaEventCreateWithFlags(&ea, cudaEventDisableTiming));
    CHECK(cudaMemset(d, 0, 4 * sizeof(unsigned)));
    count_to<<<1, 128, 0, a>>>(d + 3, n);
    CHECK(cudaEventRecord(ea, a));
    CHECK(cudaStreamWaitEvent(b, ea, 0));
    cudaMemcpyAsync(&h, d + 3, sizeof h, cudaMemcpyDeviceToHost, b);
    CHECK(cudaStreamSynchronize(b));
    EXPECT(h == n, "a copy ordered after the other stream's event read %u, expected %u", h, n);
    ok("cudaStreamWaitEvent orders a stream after another's event");

    // Synchronising an event waits for the work before its record, not for
    // the kernel queued after it (a ring of events keeps the device fed
    // that way); synchronising a stream does not wait for another stream.
    const unsigned long_n = 50 * n;
    cudaEvent_t first, second;
    CHECK(cudaEventCreate(&first));
    CHECK(cudaEventCreate(&second));
    count_to<<<1, 128, 0, a>>>(d, n);
    CHECK(cudaEventRecord(first, a));
    count_to<<<1, 128, 0, a>>>(d + 1, long_n);
    CHECK(cudaEventRecord(second, a));
    CHECK(cudaEventSynchronize(first));
    EXPECT(cudaEventQuery(second) == cudaErrorNotReady,
           "cudaEventSynchronize waited for the kernel queued after the event");
    CHECK(cudaMemcpyAsync(&h, d, sizeof h, cudaMemcpyDeviceToHost, b));
    CHECK(cudaStreamSynchronize(b));
    EXPECT(h == n, "the kernel before the event wrote %u, expected %u", h, n);
    CHECK(cudaEventSynchronize(second));
    count_to<<<1, 128, 0, a>>>(d + 1, long_n);
    count_to<<<1, 128, 0, b>>>(d + 2, n);
    CHECK(cudaStreamSynchronize(b));
    EXPECT(cudaStreamQuery(a) == cudaErrorNotReady, "cudaStreamSynchronize waited for another stream");
    CHECK(cudaDeviceSynchronize());
    unsigned h3[3] = {0, 0, 0};
    CHECK(cudaMemcpy(h3, d, sizeof h3, cudaMemcpyDeviceToHost));
    EXPECT(h3[1] == long_n && h3[2] == n, "the kernels wrote %u and %u, expected %u and %u", h3[1], h3[2], long_n, n);
    ok("cudaEventSynchronize and cudaStreamSynchronize return while later work and other streams still run");
    return test_end();
}
