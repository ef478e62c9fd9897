// Error paths with the codes a real driver gives, and the program goes on
// working after each one.
#include <cassert>
#include <cuda_runtime.h>
#include "check.h"

__global__ void assert_positive(const int *v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) assert(v[i] > 0);
}

__global__ void square(int *v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) v[i] = v[i] * v[i];
}

// After an expected error: cudaGetLastError reports it once, then the device
// still works (allocate, copy both ways, free).
static void still_works(const char *after, cudaError_t expected_last) {
    cudaError_t last = cudaGetLastError();
    EXPECT(last == expected_last, "after %s cudaGetLastError gave %d (%s), expected %d", after, (int)last,
           cudaGetErrorName(last), (int)expected_last);
    CHECK(cudaGetLastError());
    int *d = nullptr;
    int h[64], back[64];
    for (int i = 0; i < 64; i++) h[i] = i * i;
    CHECK(cudaMalloc((void **)&d, sizeof h));
    CHECK(cudaMemcpy(d, h, sizeof h, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(back, d, sizeof back, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 64; i++) EXPECT(back[i] == h[i], "after %s: copy wrong at %d", after, i);
    CHECK(cudaFree(d));
    ok("device still works after %s", after);
}

int main() {
    test_begin("rt_errors");
    CHECK(cudaFree(0));

    // cudaFree of a pointer that was never allocated.
    CHECK_ERR(cudaFree((void *)0x12345600), cudaErrorInvalidValue);
    ok("cudaFree(never allocated) -> cudaErrorInvalidValue");
    still_works("cudaFree(never allocated)", cudaErrorInvalidValue);

    // Double free.
    void *p = nullptr;
    CHECK(cudaMalloc(&p, 4096));
    CHECK(cudaFree(p));
    CHECK_ERR(cudaFree(p), cudaErrorInvalidValue);
    ok("double cudaFree -> cudaErrorInvalidValue");
    still_works("double free", cudaErrorInvalidValue);

    // cudaFree of an interior pointer.
    CHECK(cudaMalloc(&p, 4096));
    CHECK_ERR(cudaFree((char *)p + 16), cudaErrorInvalidValue);
    cudaGetLastError();
    CHECK(cudaFree(p));
    ok("cudaFree(interior pointer) -> cudaErrorInvalidValue, the allocation stays valid");

    // Copies past the end of an allocation, in each direction.
    char *d = nullptr, *d2 = nullptr;
    CHECK(cudaMalloc((void **)&d, 1024));
    CHECK(cudaMalloc((void **)&d2, 1024));
    static char big[1 << 20];
    CHECK_ERR(cudaMemcpy(d, big, 2048, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
    still_works("H2D past the end", cudaErrorInvalidValue);
    CHECK_ERR(cudaMemcpy(big, d + 512, 1024, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
    still_works("D2H past the end", cudaErrorInvalidValue);
    CHECK_ERR(cudaMemcpy(d2, d, 1 << 20, cudaMemcpyDeviceToDevice), cudaErrorInvalidValue);
    still_works("D2D past the end", cudaErrorInvalidValue);
    ok("cudaMemcpy past the end of an allocation -> cudaErrorInvalidValue (H2D, D2H, D2D)");

    // A copy to freed memory.
    CHECK(cudaFree(d2));
    CHECK_ERR(cudaMemcpy(d2, big, 16, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
    still_works("H2D into freed memory", cudaErrorInvalidValue);

    // The allocation that is still live kept its contents through all that.
    memset(big, 0x42, 1024);
    CHECK(cudaMemcpy(d, big, 1024, cudaMemcpyHostToDevice));
    memset(big, 0, 1024);
    CHECK(cudaMemcpy(big, d, 1024, cudaMemcpyDeviceToHost));
    EXPECT(check_bytes(big, 1024, 0x42) < 0, "live allocation corrupted");
    CHECK(cudaFree(d));
    ok("a live allocation is intact after the failed copies");

    // More than the device has.
    size_t free_b = 0, total = 0;
    CHECK(cudaMemGetInfo(&free_b, &total));
    void *huge = nullptr;
    CHECK_ERR(cudaMalloc(&huge, total + (1ull << 30)), cudaErrorMemoryAllocation);
    ok("cudaMalloc(total + 1 GiB = %zu) -> cudaErrorMemoryAllocation", (size_t)(total + (1ull << 30)));
    still_works("cudaMalloc too large", cudaErrorMemoryAllocation);
    CHECK_ERR(cudaMalloc(&huge, (size_t)-1 / 2), cudaErrorMemoryAllocation);
    still_works("cudaMalloc(SIZE_MAX / 2)", cudaErrorMemoryAllocation);
    size_t free_after = 0;
    CHECK(cudaMemGetInfo(&free_after, &total));
    EXPECT(free_after >= free_b - free_b / 100, "free memory %zu after failed allocations, %zu before", free_after, free_b);
    ok("failed allocations leak nothing");

    // Cache preferences outside the enum are refused, not kept and read back.
    CHECK(cudaDeviceSetCacheConfig(cudaFuncCachePreferShared));
    CHECK_ERR(cudaDeviceSetCacheConfig((cudaFuncCache)17), cudaErrorInvalidValue);
    cudaFuncCache cache = cudaFuncCachePreferNone;
    CHECK(cudaDeviceGetCacheConfig(&cache));
    EXPECT(cache == cudaFuncCachePreferShared, "the device's cache preference reads back as %d", (int)cache);
    CHECK_ERR(cudaFuncSetCacheConfig(square, (cudaFuncCache)4), cudaErrorInvalidValue);
    CHECK(cudaFuncSetCacheConfig(square, cudaFuncCachePreferL1));
    CHECK(cudaDeviceSetCacheConfig(cudaFuncCachePreferNone));
    ok("cache preferences outside the enum -> cudaErrorInvalidValue; a valid one reads back");

    // Shared memory banks are four bytes and fixed, as on every GPU since
    // Maxwell: a known size is accepted and changes nothing, another refused.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    cudaSharedMemConfig banks = cudaSharedMemBankSizeDefault;
    CHECK(cudaDeviceGetSharedMemConfig(&banks));
    EXPECT(banks == cudaSharedMemBankSizeFourByte, "shared memory banks read as %d", (int)banks);
    CHECK(cudaDeviceSetSharedMemConfig(cudaSharedMemBankSizeEightByte));
    CHECK(cudaDeviceGetSharedMemConfig(&banks));
    EXPECT(banks == cudaSharedMemBankSizeFourByte, "after asking for eight-byte banks they read as %d", (int)banks);
    CHECK_ERR(cudaDeviceSetSharedMemConfig((cudaSharedMemConfig)7), cudaErrorInvalidValue);
    CHECK(cudaFuncSetSharedMemConfig(square, cudaSharedMemBankSizeEightByte));
    CHECK_ERR(cudaFuncSetSharedMemConfig(square, (cudaSharedMemConfig)9), cudaErrorInvalidValue);
#pragma GCC diagnostic pop
    CHECK(cudaCtxResetPersistingL2Cache());
    ok("shared memory bank sizes: four bytes, a known size accepted without effect, another refused; persisting L2 reset");

    // Invalid device ordinal.
    CHECK_ERR(cudaSetDevice(1000), cudaErrorInvalidDevice);
    still_works("cudaSetDevice(1000)", cudaErrorInvalidDevice);

    // A destroyed stream is not a valid handle any more... but using one is
    // undefined behaviour, so only check NULL-handle argument errors.
    CHECK_ERR(cudaStreamCreate(nullptr), cudaErrorInvalidValue);
    still_works("cudaStreamCreate(NULL)", cudaErrorInvalidValue);
    CHECK_ERR(cudaMalloc(nullptr, 16), cudaErrorInvalidValue);
    still_works("cudaMalloc(NULL, 16)", cudaErrorInvalidValue);

    // A failed device assert leaves the context unusable until it is
    // destroyed (CUDA_ERROR_ASSERT: "the context cannot be used anymore, and
    // must be destroyed"); after cudaDeviceReset a fresh one computes.
    int hv[64];
    for (int i = 0; i < 64; i++) hv[i] = i + 1;
    hv[17] = 0;
    int *dv = nullptr;
    CHECK(cudaMalloc((void **)&dv, sizeof hv));
    CHECK(cudaMemcpy(dv, hv, sizeof hv, cudaMemcpyHostToDevice));
    // A stream and an instantiated graph the reset has to destroy with the context.
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    square<<<2, 32, 0, s>>>(dv, 64);
    CHECK(cudaStreamEndCapture(s, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaStreamSynchronize(s));
    int sq[64];
    CHECK(cudaMemcpy(sq, dv, sizeof sq, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 64; i++) EXPECT(sq[i] == hv[i] * hv[i], "graph's square wrong at %d: %d", i, sq[i]);
    CHECK(cudaMemcpy(dv, hv, sizeof hv, cudaMemcpyHostToDevice));
    assert_positive<<<2, 32>>>(dv, 64);
    CHECK_ERR(cudaDeviceSynchronize(), cudaErrorAssert);
    void *after = nullptr;
    CHECK_ERR(cudaMalloc(&after, 16), cudaErrorAssert);
    ok("a failed device assert -> cudaErrorAssert at the next synchronisation, and for later calls");
    CHECK(cudaDeviceReset());
    cudaGetLastError();
    CHECK(cudaGraphDestroy(graph));
    for (int i = 0; i < 64; i++) hv[i] = i - 20;
    CHECK(cudaMalloc((void **)&dv, sizeof hv));
    CHECK(cudaMemcpy(dv, hv, sizeof hv, cudaMemcpyHostToDevice));
    square<<<2, 32>>>(dv, 64);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    int back[64];
    CHECK(cudaMemcpy(back, dv, sizeof back, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 64; i++) EXPECT(back[i] == (i - 20) * (i - 20), "after the reset: square wrong at %d: %d", i, back[i]);
    CHECK(cudaFree(dv));
    ok("after cudaDeviceReset a fresh context computes");

    CHECK(cudaDeviceSynchronize());
    return test_end();
}
