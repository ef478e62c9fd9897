// Keeps the device busy with equal kernels for a window of wall time and
// counts how many ended in it: the compute-share tests run two of these on
// two leases of one GPU and compare the counts.
//   --from-ms T   unix time (ms) to start at (default: now)
//   --until-ms T  unix time (ms) to stop at (default: 3 s after the start)
//   --phase-ms T  also count the kernels launched from unix time T on
//                 ("ok: kernels from phase N")
//   --iters N     loop length of each thread (default 9000: about a
//                 millisecond a block on the sim)
//   --depth N     kernels kept in flight (default 1: each waited for before
//                 the next); a kernel counts when it is seen to have ended
// Prints "ok: kernels N" and checks every kernel's result.
#include <cuda_runtime.h>
#include <chrono>
#include <thread>
#include "check.h"

__global__ void busy(unsigned *out, unsigned iters) {
    unsigned x = blockIdx.x * blockDim.x + threadIdx.x;
    for (unsigned i = 0; i < iters; i++) x = x * 1664525u + 1013904223u;
    out[blockIdx.x * blockDim.x + threadIdx.x] = x;
}

static long long now_ms() {
    using namespace std::chrono;
    return duration_cast<milliseconds>(system_clock::now().time_since_epoch()).count();
}

int main(int argc, char **argv) {
    test_begin("rt_busy");
    const unsigned blocks = 64, threads = 64, n = blocks * threads;
    unsigned iters = (unsigned)arg_ll(argc, argv, "--iters", 9000);
    unsigned *d = nullptr;
    CHECK(cudaMalloc(&d, n * sizeof(unsigned)));
    // The host's own answer for thread 5, to check the device's.
    unsigned want = 5;
    for (unsigned i = 0; i < iters; i++) want = want * 1664525u + 1013904223u;
    busy<<<blocks, threads>>>(d, iters);
    CHECK(cudaDeviceSynchronize());
    unsigned got = 0;
    CHECK(cudaMemcpy(&got, d + 5, sizeof got, cudaMemcpyDeviceToHost));
    EXPECT(got == want, "thread 5 computed %u, the host %u", got, want);
    ok("warm-up kernel computed the right values");

    long long from = arg_ll(argc, argv, "--from-ms", now_ms());
    long long until = arg_ll(argc, argv, "--until-ms", from + 3000);
    long long late = now_ms() - from;
    if (late > 0) note("started %lld ms late", late);
    while (now_ms() < from) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    long long phase = arg_ll(argc, argv, "--phase-ms", until);
    int depth = (int)arg_ll(argc, argv, "--depth", 1);
    if (depth < 1 || depth > 64) depth = 1;
    // A ring of events, one per kernel in flight, with whether each
    // kernel was launched in the phase.
    cudaEvent_t ends[64];
    bool phased[64];
    for (int i = 0; i < depth; i++) CHECK(cudaEventCreate(&ends[i]));
    long long kernels = 0, in_phase = 0, launched = 0;
    while (now_ms() < until) {
        int slot = (int)(launched % depth);
        if (launched >= depth) {
            // The oldest kernel in flight holds this slot: count it when it ends.
            CHECK(cudaEventSynchronize(ends[slot]));
            kernels++;
            in_phase += phased[slot];
            if (now_ms() >= until) break;
        }
        phased[slot] = now_ms() >= phase;
        busy<<<blocks, threads>>>(d, iters);
        CHECK(cudaEventRecord(ends[slot], 0));
        launched++;
    }
    // The kernels still in flight ended after the window: not counted.
    CHECK(cudaDeviceSynchronize());
    for (int i = 0; i < depth; i++) CHECK(cudaEventDestroy(ends[i]));
    got = 0;
    CHECK(cudaMemcpy(&got, d + 5, sizeof got, cudaMemcpyDeviceToHost));
    EXPECT(got == want, "after %lld kernels thread 5 holds %u, not %u", kernels, got, want);
    ok("kernels %lld", kernels);
    if (phase < until) ok("kernels from phase %lld", in_phase);
    return test_end();
}
