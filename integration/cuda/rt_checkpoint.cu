// Runs rounds of work on a stream (a kernel that reads a module global, a
// kernel that moves the global on, two events around them) over device
// memory the program keeps, and checks every round against a host model;
// a large buffer written once is checked at the end. The harness
// checkpoints the session after a "round" line, stops the server, starts a
// new one at the same address and restores the session there: the program
// must see no error and every result must be right. With --graph 1 each
// round's two kernels and the copy back run as one instantiated CUDA graph
// (made by stream capture, once), which must come along. With --vmm 1 the
// large buffer is two physical allocations mapped end to end in one reserved
// range through the driver's virtual memory management (as PyTorch's
// expandable segments make them), the second released while mapped; its
// bytes must come along at the same addresses.
// Exit 0: all rounds right. Exit 1: a CUDA call failed or a result was wrong.
#include <cuda_runtime.h>
#include <math.h>
#include <unistd.h>
#include <vector>
#include "check.h"
// After check.h: its driver-API helpers would need libcuda linked, and this
// program reaches the driver only through cudart's entry points.
#include <cuda.h>

#define DRV(call)                                                              \
    do {                                                                       \
        CUresult r_ = (call);                                                  \
        if (r_ != CUDA_SUCCESS) fail("%s:%d: %s returned %d", __FILE__, __LINE__, #call, (int)r_); \
    } while (0)

template <class F> static F driver(const char *name) {
    void *f = nullptr;
    cudaDriverEntryPointQueryResult q;
    CHECK(cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || !f) fail("no driver entry point %s", name);
    return (F)f;
}

__device__ unsigned counter = 7;

__global__ void step(unsigned *a, int n, unsigned k) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] = a[i] * 3u + k + counter;
}

__global__ void tick() {
    if (blockIdx.x == 0 && threadIdx.x == 0) counter += 1;
}

int main(int argc, char **argv) {
    test_begin("rt_checkpoint");
    const int rounds = (int)arg_ll(argc, argv, "--rounds", 6);
    const long long wait_ms = arg_ll(argc, argv, "--wait-ms", 0);
    const size_t big = (size_t)arg_ll(argc, argv, "--mib", 16) << 20;
    const bool graph = arg_ll(argc, argv, "--graph", 0) != 0;
    const bool vmm = arg_ll(argc, argv, "--vmm", 0) != 0;
    const int n = 1 << 16;
    std::vector<unsigned> model(n), back(n);
    std::vector<unsigned char> h(big);
    for (int i = 0; i < n; i++) model[i] = (unsigned)i;
    unsigned count = 7;
    unsigned *a = nullptr;
    unsigned char *d = nullptr;
    CHECK(cudaMalloc(&a, n * sizeof(unsigned)));
    // --vmm: two halves of 2 MiB granules, mapped end to end.
    const size_t granule = 2 << 20;
    const size_t half = (big / 2 + granule - 1) / granule * granule;
    CUdeviceptr va = 0;
    CUmemGenericAllocationHandle held = 0;
    if (vmm) {
        auto reserve = driver<CUresult (*)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long)>("cuMemAddressReserve");
        auto create = driver<CUresult (*)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long)>("cuMemCreate");
        auto map = driver<CUresult (*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long)>("cuMemMap");
        auto access = driver<CUresult (*)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t)>("cuMemSetAccess");
        auto release = driver<CUresult (*)(CUmemGenericAllocationHandle)>("cuMemRelease");
        CUmemAllocationProp prop = {};
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = 0;
        DRV(reserve(&va, 2 * half, 0, 0, 0));
        CUmemGenericAllocationHandle h[2];
        for (int i = 0; i < 2; i++) {
            DRV(create(&h[i], half, &prop, 0));
            DRV(map(va + i * half, half, 0, h[i], 0));
        }
        CUmemAccessDesc rw = {};
        rw.location = prop.location;
        rw.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        DRV(access(va, 2 * half, &rw, 1));
        DRV(release(h[1])); // lives on while mapped
        held = h[0];
        d = (unsigned char *)va;
    } else {
        CHECK(cudaMalloc(&d, big));
    }
    fill_pattern(h.data(), big, 41);
    CHECK(cudaMemcpy(d, h.data(), big, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(a, model.data(), n * sizeof(unsigned), cudaMemcpyHostToDevice));
    int lo = 0, hi = 0;
    CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, hi));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    // The graph's copy back lands in pinned memory (a captured copy may not
    // touch pageable memory); its kernels take k = 1 every round.
    unsigned *pinned = nullptr;
    cudaGraphExec_t x = nullptr;
    if (graph) {
        CHECK(cudaMallocHost(&pinned, n * sizeof(unsigned)));
        CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        step<<<(n + 255) / 256, 256, 0, s>>>(a, n, 1u);
        tick<<<1, 1, 0, s>>>();
        CHECK(cudaMemcpyAsync(pinned, a, n * sizeof(unsigned), cudaMemcpyDeviceToHost, s));
        cudaGraph_t g = nullptr;
        CHECK(cudaStreamEndCapture(s, &g));
        CHECK(cudaGraphInstantiate(&x, g, 0));
        CHECK(cudaGraphDestroy(g));
    }
    for (int r = 0; r < rounds; r++) {
        const unsigned k = graph ? 1u : (unsigned)r + 1;
        CHECK(cudaEventRecord(e0, s));
        if (graph) {
            CHECK(cudaGraphLaunch(x, s));
        } else {
            step<<<(n + 255) / 256, 256, 0, s>>>(a, n, k);
            tick<<<1, 1, 0, s>>>();
        }
        CHECK(cudaEventRecord(e1, s));
        CHECK(cudaGetLastError());
        CHECK(cudaStreamSynchronize(s));
        for (int i = 0; i < n; i++) model[i] = model[i] * 3u + k + count;
        count += 1;
        if (graph) {
            for (int i = 0; i < n; i++) back[i] = pinned[i];
        } else {
            CHECK(cudaMemcpy(back.data(), a, n * sizeof(unsigned), cudaMemcpyDeviceToHost));
        }
        for (int i = 0; i < n; i++) EXPECT(back[i] == model[i], "round %d: a[%d] = %u, want %u", r, i, back[i], model[i]);
        unsigned got = 0;
        CHECK(cudaMemcpyFromSymbol(&got, counter, sizeof got));
        EXPECT(got == count, "round %d: the global is %u, want %u", r, got, count);
        float ms = -1;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        EXPECT(ms >= 0, "round %d: elapsed %f ms", r, ms);
        ok("round %d: %d elements and the global right", r, n);
        printf("round %d\n", r);
        fflush(stdout);
        if (wait_ms > 0) usleep((useconds_t)(wait_ms * 1000));
        // A session moved during the wait keeps its events' times.
        float again = -1;
        CHECK(cudaEventElapsedTime(&again, e0, e1));
        EXPECT(fabsf(again - ms) <= 0.01f + ms * 1e-3f, "round %d: %f ms between the events, %f ms after the pause", r, ms, again);
    }
    std::vector<unsigned char> hb(big);
    CHECK(cudaMemcpy(hb.data(), d, big, cudaMemcpyDeviceToHost));
    long long bad = check_pattern(hb.data(), big, 41);
    EXPECT(bad < 0, "byte %lld of the %zu-byte buffer is wrong", bad, big);
    ok("the %zu-byte buffer written before is intact", big);
    if (graph) {
        CHECK(cudaGraphExecDestroy(x));
        CHECK(cudaFreeHost(pinned));
    }
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFree(a));
    if (vmm) {
        DRV(driver<CUresult (*)(CUdeviceptr, size_t)>("cuMemUnmap")(va, 2 * half));
        DRV(driver<CUresult (*)(CUmemGenericAllocationHandle)>("cuMemRelease")(held));
        DRV(driver<CUresult (*)(CUdeviceptr, size_t)>("cuMemAddressFree")(va, 2 * half));
    } else {
        CHECK(cudaFree(d));
    }
    return test_end();
}
