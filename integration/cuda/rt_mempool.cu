// The stream-ordered allocator: cudaMallocAsync / cudaFreeAsync on a stream,
// the device's default and current pools, a pool of one's own, and the pool
// attributes programs read (used memory and its high-water mark, the release
// threshold).
#include <cuda_runtime.h>
#include "check.h"

static unsigned long long used(cudaMemPool_t p, cudaMemPoolAttr a) {
    unsigned long long v = ~0ull;
    CHECK(cudaMemPoolGetAttribute(p, a, &v));
    return v;
}

int main() {
    test_begin("rt_mempool");
    int supported = 0;
    CHECK(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, 0));
    EXPECT(supported == 1, "cudaDevAttrMemoryPoolsSupported = %d", supported);
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    cudaMemPool_t def = nullptr, cur = nullptr;
    CHECK(cudaDeviceGetDefaultMemPool(&def, 0));
    CHECK(cudaDeviceGetMemPool(&cur, 0));
    EXPECT(def != nullptr && def == cur, "default pool %p, current pool %p", (void *)def, (void *)cur);
    const unsigned long long base = used(def, cudaMemPoolAttrUsedMemCurrent);

    const size_t n = 4u << 20;
    unsigned *d = nullptr, *h = nullptr;
    CHECK(cudaMallocHost(&h, n));
    CHECK(cudaMallocAsync((void **)&d, n, s));
    EXPECT(used(def, cudaMemPoolAttrUsedMemCurrent) >= base + n, "used memory did not grow by the allocation");
    CHECK(cudaMemsetAsync(d, 0x3c, n, s));
    CHECK(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, s));
    CHECK(cudaFreeAsync(d, s));
    CHECK(cudaStreamSynchronize(s));
    for (size_t i = 0; i < n / 4; i += 1021) EXPECT(h[i] == 0x3c3c3c3cu, "word %zu is %#x", i, h[i]);
    EXPECT(used(def, cudaMemPoolAttrUsedMemCurrent) == base, "used memory not given back after cudaFreeAsync");
    EXPECT(used(def, cudaMemPoolAttrUsedMemHigh) >= base + n, "high-water mark below the allocation");
    ok("cudaMallocAsync / memset / copy / cudaFreeAsync in stream order; used memory tracked");

    unsigned long long threshold = 64ull << 20, back = 0;
    CHECK(cudaMemPoolSetAttribute(def, cudaMemPoolAttrReleaseThreshold, &threshold));
    CHECK(cudaMemPoolGetAttribute(def, cudaMemPoolAttrReleaseThreshold, &back));
    EXPECT(back == threshold, "release threshold %llu after setting %llu", back, threshold);
    unsigned long long zero = 0;
    CHECK(cudaMemPoolSetAttribute(def, cudaMemPoolAttrUsedMemHigh, &zero));
    EXPECT(used(def, cudaMemPoolAttrUsedMemHigh) == used(def, cudaMemPoolAttrUsedMemCurrent), "high-water mark not reset");
    CHECK(cudaMemPoolTrimTo(def, 0));
    ok("pool attributes: release threshold, high-water reset, trim");

    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = 0;
    cudaMemPool_t mine = nullptr;
    CHECK(cudaMemPoolCreate(&mine, &props));
    CHECK(cudaDeviceSetMemPool(0, mine));
    CHECK(cudaDeviceGetMemPool(&cur, 0));
    EXPECT(cur == mine, "cudaDeviceSetMemPool did not take");
    CHECK(cudaMallocAsync((void **)&d, 1000, s));
    EXPECT(used(mine, cudaMemPoolAttrUsedMemCurrent) >= 1000, "allocation not from the current pool");
    CHECK(cudaFreeAsync(d, s));
    CHECK(cudaMallocFromPoolAsync((void **)&d, 2000, def, s));
    CHECK(cudaFreeAsync(d, s));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaDeviceSetMemPool(0, def));
    CHECK(cudaMemPoolDestroy(mine));
    EXPECT(cudaMemPoolDestroy(def) != cudaSuccess, "the default pool was destroyed");
    ok("a pool of one's own: create, set current, allocate from it and from another, destroy");

    CHECK(cudaFreeHost(h));
    CHECK(cudaStreamDestroy(s));
    return test_end();
}
