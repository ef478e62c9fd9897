// gpu-check: kernel launch rate and synchronisation latency.
// Prints:
//   launch_rate <launches/s>    (N back-to-back empty launches, one sync)
//   sync_us <microseconds>      (cudaStreamSynchronize on an idle stream)
// then checks that N launches of an increment kernel all ran: PASS launch_rate.
// Usage: launch_rate [N]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CK(x)                                                                        \
    do {                                                                             \
        cudaError_t e_ = (x);                                                        \
        if (e_ != cudaSuccess) {                                                     \
            fprintf(stderr, "FAIL %s: %s\n", #x, cudaGetErrorString(e_));            \
            return 1;                                                                \
        }                                                                            \
    } while (0)

__global__ void empty_kernel() {}
__global__ void increment(int *p) { p[threadIdx.x] += 1; }

static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 20000;
    if (n < 100) n = 100;
    for (int i = 0; i < 100; i++) empty_kernel<<<1, 1>>>();
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    double t0 = now();
    for (int i = 0; i < n; i++) empty_kernel<<<1, 1>>>();
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    printf("launch_rate %.0f\n", n / (now() - t0));
    const int syncs = 1000;
    t0 = now();
    for (int i = 0; i < syncs; i++) CK(cudaStreamSynchronize(0));
    printf("sync_us %.2f\n", (now() - t0) / syncs * 1e6);
    int *d = nullptr;
    CK(cudaMalloc(&d, 32 * sizeof(int)));
    CK(cudaMemset(d, 0, 32 * sizeof(int)));
    for (int i = 0; i < 1000; i++) increment<<<1, 32>>>(d);
    CK(cudaGetLastError());
    int h[32];
    CK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 32; i++) {
        if (h[i] != 1000) { fprintf(stderr, "FAIL element %d is %d, expected 1000\n", i, h[i]); return 1; }
    }
    CK(cudaFree(d));
    printf("PASS launch_rate\n");
    return 0;
}
