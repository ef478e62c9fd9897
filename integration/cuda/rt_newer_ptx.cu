// A module built as CuPy builds its CUB kernels: SASS for sm_90 and PTX only
// for compute_120. A driver never runs PTX newer than the device: on a 12.0
// device the kernel runs from that PTX (and says so in its attributes); on a
// 9.0 device only the sm_90 SASS could run, which the sim cannot execute, so
// the launch must fail, and fail again at the next synchronisation (a
// library that drops launch errors must not read unwritten memory as a
// result). Regression: the sim ran the compute_120 PTX on a 9.0 device and
// reported PTX version 90, so CUB's host code tuned for sm_90 and sums came
// out short.
//
// --expect-runs: the device is 12.0; --expect-refused: it is 9.0.
#include <cuda_runtime.h>
#include "check.h"

__global__ void add_one(int *x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1;
}

int main(int argc, char **argv) {
    test_begin("rt_newer_ptx");
    bool runs = argc > 1 && strcmp(argv[1], "--expect-runs") == 0;
    bool refused = argc > 1 && strcmp(argv[1], "--expect-refused") == 0;
    EXPECT(runs != refused, "pass --expect-runs or --expect-refused");
    const int n = 1000;
    int *d = nullptr;
    CHECK(cudaMalloc(&d, n * sizeof(int)));
    CHECK(cudaMemset(d, 0, n * sizeof(int)));
    if (runs) {
        cudaFuncAttributes a;
        CHECK(cudaFuncGetAttributes(&a, add_one));
        EXPECT(a.ptxVersion == 120 && a.binaryVersion == 120, "ptxVersion %d, binaryVersion %d, expected 120 and 120",
               a.ptxVersion, a.binaryVersion);
        ok("the kernel runs from its compute_120 PTX: ptxVersion %d, binaryVersion %d", a.ptxVersion, a.binaryVersion);
        add_one<<<(n + 255) / 256, 256>>>(d, n);
        CHECK(cudaGetLastError());
        CHECK(cudaDeviceSynchronize());
        int h[n];
        CHECK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
        for (int i = 0; i < n; i++) EXPECT(h[i] == 1, "x[%d] = %d after add_one", i, h[i]);
        ok("add_one ran on every element");
    } else {
        add_one<<<(n + 255) / 256, 256>>>(d, n);
        cudaError_t launch = cudaGetLastError();
        EXPECT(launch != cudaSuccess, "a kernel with only newer PTX and unrunnable SASS was launched");
        ok("the launch fails at once: %s", cudaGetErrorName(launch));
        cudaError_t sync = cudaDeviceSynchronize();
        EXPECT(sync != cudaSuccess, "the failed launch did not surface at the next synchronisation");
        ok("and again at the next synchronisation: %s", cudaGetErrorName(sync));
        // Nothing was written, and the device works on.
        int h[n];
        CHECK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
        for (int i = 0; i < n; i++) EXPECT(h[i] == 0, "x[%d] = %d, but the kernel never ran", i, h[i]);
        ok("the device memory is untouched and the device still answers");
    }
    CHECK(cudaFree(d));
    return test_end();
}
