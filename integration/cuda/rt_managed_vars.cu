// `__managed__` variables: one address for host code and kernels, the module's
// initial values seen by the host before any launch, kernel writes seen after a
// synchronisation, host writes seen by the next kernel; through the symbol API,
// as a pointer argument, under cudaMemset and cudaPointerGetAttributes; and not
// freed by cudaFree.
#include <cuda_runtime.h>
#include "check.h"

struct Stats {
    long long sum;
    int count;
    float scale;
};

__managed__ int counter = 5;
__managed__ float table[300];  // spans more than one page with its neighbours
__managed__ Stats stats = {0, 0, 1.5f};
__device__ int plain = 3;

__global__ void bump(int n) {
    atomicAdd(&counter, n);
}

__global__ void fill(float base) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < 300) table[i] = base + i * stats.scale + plain;
}

__global__ void total() {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < 300) {
        atomicAdd((unsigned long long *)&stats.sum, (unsigned long long)(long long)table[i]);
        atomicAdd(&stats.count, 1);
    }
}

__global__ void through_pointer(int *p, int v) {
    *p = v;
}

int main() {
    test_begin("rt_managed_vars");
    EXPECT(counter == 5, "before any launch the host reads counter as %d, expected the module's 5", counter);
    EXPECT(stats.scale == 1.5f && stats.sum == 0, "before any launch stats reads scale %f sum %lld", stats.scale, stats.sum);
    for (int i = 0; i < 300; i++) EXPECT(table[i] == 0.0f, "table[%d] starts as %f", i, table[i]);
    ok("the host reads the module's initial values");

    counter = 100;
    bump<<<4, 64>>>(2);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    EXPECT(counter == 100 + 4 * 64 * 2, "after the kernel counter is %d, expected %d", counter, 100 + 512);
    ok("a host write reaches the kernel; the kernel's atomics reach the host after cudaDeviceSynchronize");

    stats.scale = 2.0f;
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    fill<<<2, 256, 0, s>>>(10.0f);
    total<<<2, 256, 0, s>>>();
    CHECK(cudaStreamSynchronize(s));
    long long want = 0;
    for (int i = 0; i < 300; i++) {
        float v = 10.0f + i * 2.0f + 3;
        EXPECT(table[i] == v, "table[%d] is %f, expected %f", i, table[i], v);
        want += (long long)v;
    }
    EXPECT(stats.sum == want && stats.count == 300, "stats: sum %lld count %d, expected %lld and 300", stats.sum, stats.count, want);
    ok("kernels on a stream fill and total the table; the host reads both after cudaStreamSynchronize");

    // The host's address of a managed variable is its device address.
    through_pointer<<<1, 1>>>(&counter, -7);
    CHECK(cudaDeviceSynchronize());
    EXPECT(counter == -7, "a kernel writing through &counter left %d", counter);
    cudaPointerAttributes a;
    CHECK(cudaPointerGetAttributes(&a, &counter));
    EXPECT(a.type == cudaMemoryTypeManaged, "&counter has memory type %d, expected managed", (int)a.type);
    ok("&counter passed to a kernel is the variable; cudaPointerGetAttributes says managed");

    // The symbol API and memsets reach the same storage.
    int v = 41;
    CHECK(cudaMemcpyToSymbol(counter, &v, sizeof v));
    EXPECT(counter == 41, "after cudaMemcpyToSymbol the host reads %d", counter);
    counter = 42;
    int back = 0;
    CHECK(cudaMemcpyFromSymbol(&back, counter, sizeof back));
    EXPECT(back == 42, "cudaMemcpyFromSymbol read %d after the host wrote 42", back);
    CHECK(cudaMemset(table, 0, sizeof table));
    CHECK(cudaDeviceSynchronize());
    for (int i = 0; i < 300; i++) EXPECT(table[i] == 0.0f, "after cudaMemset table[%d] is %f", i, table[i]);
    ok("cudaMemcpyToSymbol, cudaMemcpyFromSymbol and cudaMemset on managed variables");

    CHECK_ERR(cudaFree(&counter), cudaErrorInvalidValue);
    counter = 9;
    bump<<<1, 1>>>(1);
    CHECK(cudaDeviceSynchronize());
    EXPECT(counter == 10, "after a refused cudaFree counter is %d", counter);
    ok("cudaFree of a managed variable is refused and changes nothing");

    CHECK(cudaStreamDestroy(s));
    return test_end();
}
