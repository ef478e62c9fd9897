// cudaMalloc / cudaFree / cudaMemGetInfo / cudaPointerGetAttributes.
#include <cuda_runtime.h>
#include <vector>
#include "check.h"

int main() {
    test_begin("rt_memory");
    size_t free0 = 0, total = 0;
    CHECK(cudaMemGetInfo(&free0, &total));
    cudaDeviceProp p;
    CHECK(cudaGetDeviceProperties(&p, 0));
    EXPECT(total == p.totalGlobalMem, "cudaMemGetInfo total %zu vs totalGlobalMem %zu", total, p.totalGlobalMem);
    EXPECT(free0 > 0 && free0 <= total, "free %zu total %zu", free0, total);
    ok("cudaMemGetInfo free %zu total %zu", free0, total);

    const size_t big = 256ull << 20;
    void *d = nullptr;
    CHECK(cudaMalloc(&d, big));
    EXPECT(d != nullptr, "cudaMalloc returned NULL");
    size_t free1 = 0;
    CHECK(cudaMemGetInfo(&free1, &total));
    EXPECT(free1 + big <= free0, "free before %zu, after 256 MiB alloc %zu", free0, free1);
    ok("256 MiB cudaMalloc lowers free memory (%zu -> %zu)", free0, free1);

    cudaPointerAttributes a;
    memset(&a, 0, sizeof a);
    CHECK(cudaPointerGetAttributes(&a, (char *)d + 12345));
    EXPECT(a.type == cudaMemoryTypeDevice, "pointer type %d", (int)a.type);
    EXPECT(a.device == 0, "pointer device %d", a.device);
    ok("cudaPointerGetAttributes: device memory on device 0");

    CHECK(cudaFree(d));
    size_t free2 = 0;
    CHECK(cudaMemGetInfo(&free2, &total));
    EXPECT(free2 >= free0 - (free0 / 100), "free after cudaFree %zu, before alloc %zu", free2, free0);
    ok("cudaFree gives the memory back (%zu)", free2);

    // Many small allocations: distinct, non-overlapping, all freeable.
    std::vector<char *> ptrs;
    for (int i = 0; i < 500; i++) {
        char *q = nullptr;
        size_t sz = 1 + (size_t)i * 37;
        CHECK(cudaMalloc((void **)&q, sz));
        EXPECT(q != nullptr, "allocation %d NULL", i);
        EXPECT(((uintptr_t)q % 256) == 0, "allocation %d at %p is not 256-byte aligned", i, (void *)q);
        ptrs.push_back(q);
    }
    for (size_t i = 0; i < ptrs.size(); i++)
        for (size_t j = i + 1; j < ptrs.size(); j++) {
            size_t si = 1 + i * 37, sj = 1 + j * 37;
            bool overlap = ptrs[i] < ptrs[j] + sj && ptrs[j] < ptrs[i] + si;
            EXPECT(!overlap, "allocations %zu and %zu overlap", i, j);
        }
    ok("500 small allocations are 256-byte aligned and disjoint");
    for (char *q : ptrs) CHECK(cudaFree(q));
    ok("500 small allocations freed");

    // Allocate, free, allocate again repeatedly: no leak on the server.
    for (int i = 0; i < 20; i++) {
        CHECK(cudaMalloc(&d, 64ull << 20));
        CHECK(cudaFree(d));
    }
    size_t free3 = 0;
    CHECK(cudaMemGetInfo(&free3, &total));
    EXPECT(free3 >= free0 - (free0 / 100), "free after 20 alloc/free rounds %zu, at start %zu", free3, free0);
    ok("20 rounds of 64 MiB alloc/free leave free memory unchanged");

    CHECK(cudaFree(nullptr));
    ok("cudaFree(NULL) succeeds");

    void *pitched = nullptr;
    size_t pitch = 0;
    CHECK(cudaMallocPitch(&pitched, &pitch, 1000, 10));
    EXPECT(pitch >= 1000, "pitch %zu", pitch);
    CHECK(cudaFree(pitched));
    ok("cudaMallocPitch(1000 x 10) pitch %zu", pitch);
    return test_end();
}
