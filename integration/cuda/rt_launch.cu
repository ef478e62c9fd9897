// A <<<>>> launch while the server cannot run kernels yet: the launch must
// report cudaErrorNotSupported (801) through cudaGetLastError, and the
// program must be able to go on using the device.
// With --expect-supported the launch must work and compute the right result.
#include <cuda_runtime.h>
#include "check.h"

__global__ void add_one(int *x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1;
}

int main(int argc, char **argv) {
    test_begin("rt_launch");
    bool supported = arg_flag(argc, argv, "--expect-supported");
    const int n = 1000;
    int h[n];
    for (int i = 0; i < n; i++) h[i] = i;
    int *d = nullptr;
    CHECK(cudaMalloc((void **)&d, sizeof h));
    CHECK(cudaMemcpy(d, h, sizeof h, cudaMemcpyHostToDevice));

    add_one<<<(n + 255) / 256, 256>>>(d, n);
    cudaError_t e = cudaGetLastError();
    if (supported) {
        EXPECT(e == cudaSuccess, "launch gave %d (%s)", (int)e, cudaGetErrorString(e));
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
        for (int i = 0; i < n; i++) EXPECT(h[i] == i + 1, "h[%d] = %d after the kernel", i, h[i]);
        ok("<<<>>> launch ran and computed the right result");
    } else {
        EXPECT(e == cudaErrorNotSupported, "cudaGetLastError after <<<>>> gave %d (%s: %s), expected 801 cudaErrorNotSupported",
               (int)e, cudaGetErrorName(e), cudaGetErrorString(e));
        ok("<<<>>> launch -> cudaGetLastError = %d (%s)", (int)e, cudaGetErrorString(e));
        CHECK(cudaGetLastError());
        ok("the error is not sticky: cudaGetLastError is cudaSuccess again");

        void *args[] = {&d, (void *)&n};
        cudaError_t e2 = cudaLaunchKernel((const void *)add_one, dim3(4), dim3(256), args, 0, 0);
        EXPECT(e2 == cudaErrorNotSupported, "cudaLaunchKernel gave %d (%s)", (int)e2, cudaGetErrorName(e2));
        cudaGetLastError();
        ok("cudaLaunchKernel -> cudaErrorNotSupported");

        CHECK(cudaDeviceSynchronize());
        int back[n];
        CHECK(cudaMemcpy(back, d, sizeof back, cudaMemcpyDeviceToHost));
        for (int i = 0; i < n; i++) EXPECT(back[i] == i, "memory changed by a failed launch: [%d] = %d", i, back[i]);
        ok("device still usable after the failed launch; memory unchanged");
    }
    CHECK(cudaFree(d));
    return test_end();
}
