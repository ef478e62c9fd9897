// cudaLaunchKernelEx with launch attributes: those that only tune scheduling
// (priority, programmatic stream serialisation, a 1x1x1 cluster, a
// non-cooperative grid) launch and compute the right result; so does a
// cooperative grid (rt_cooperative.cu tests grid synchronisation); a cluster
// bigger than one block, which rgpu does not offer, fails clearly instead of
// running as an ordinary grid.
#include <cuda_runtime.h>
#include "check.h"

__global__ void scale(float *x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}

int main() {
    test_begin("rt_launch_ex");
    const int n = 4096;
    float *d = nullptr;
    CHECK(cudaMalloc(&d, n * sizeof(float)));
    float h[n];
    for (int i = 0; i < n; i++) h[i] = (float)i;
    CHECK(cudaMemcpy(d, h, sizeof h, cudaMemcpyHostToDevice));

    cudaLaunchAttribute attrs[4];
    attrs[0].id = cudaLaunchAttributePriority;
    attrs[0].val.priority = -1;
    attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[1].val.programmaticStreamSerializationAllowed = 1;
    attrs[2].id = cudaLaunchAttributeClusterDimension;
    attrs[2].val.clusterDim.x = attrs[2].val.clusterDim.y = attrs[2].val.clusterDim.z = 1;
    attrs[3].id = cudaLaunchAttributeCooperative;
    attrs[3].val.cooperative = 0;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(n / 256);
    cfg.blockDim = dim3(256);
    cfg.attrs = attrs;
    cfg.numAttrs = 4;
    CHECK(cudaLaunchKernelEx(&cfg, scale, d, 2.0f, n));
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) EXPECT(h[i] == 2.0f * i, "x[%d] = %f after scale by 2", i, h[i]);
    ok("cudaLaunchKernelEx with priority, programmatic serialisation, 1x1x1 cluster, non-cooperative: right result");

    attrs[0].id = cudaLaunchAttributeCooperative;
    attrs[0].val.cooperative = 1;
    cfg.numAttrs = 1;
    CHECK(cudaLaunchKernelEx(&cfg, scale, d, 3.0f, n));
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) EXPECT(h[i] == 6.0f * i, "x[%d] = %f after a cooperative scale by 3", i, h[i]);
    ok("cudaLaunchKernelEx with cudaLaunchAttributeCooperative: right result");

    attrs[0].id = cudaLaunchAttributeClusterDimension;
    attrs[0].val.clusterDim.x = 2;
    attrs[0].val.clusterDim.y = attrs[0].val.clusterDim.z = 1;
    cudaError_t e = cudaLaunchKernelEx(&cfg, scale, d, 5.0f, n);
    EXPECT(e != cudaSuccess, "a launch with 2-block clusters was accepted, but rgpu does not offer clusters");
    (void)cudaGetLastError();  // the launch error is not sticky: clear it
    CHECK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) EXPECT(h[i] == 6.0f * i, "x[%d] = %f: the refused launch ran", i, h[i]);
    ok("a launch with 2-block clusters fails clearly (%s) and does not run", cudaGetErrorName(e));
    CHECK(cudaFree(d));
    return test_end();
}
