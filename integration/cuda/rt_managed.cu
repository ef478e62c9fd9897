// Managed memory (cudaMallocManaged) under the coherence rule of a device without concurrent
// managed access (the host leaves managed memory alone while the device may be running):
// host writes read by a kernel; kernel writes read by the host after cudaDeviceSynchronize,
// cudaStreamSynchronize, cudaEventSynchronize and a synchronous cudaMemcpy; host writes after
// a synchronous copy of other memory; copies and memsets to and from managed memory; pointer
// attributes; prefetch and advice; attach flags.
#include <cuda_runtime.h>
#include "check.h"

__global__ void twice(unsigned *p, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] *= 2;
}

__global__ void iota(unsigned *p, unsigned base, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = base + i;
}

static void check_iota(const unsigned *p, unsigned base, unsigned n, const char *what) {
    for (unsigned i = 0; i < n; i++) EXPECT(p[i] == base + i, "%s: p[%u] = %u, want %u", what, i, p[i], base + i);
}

int main() {
    test_begin("rt_managed");
    int managed = -1, concurrent = -1, pageable = -1;
    CHECK(cudaDeviceGetAttribute(&managed, cudaDevAttrManagedMemory, 0));
    CHECK(cudaDeviceGetAttribute(&concurrent, cudaDevAttrConcurrentManagedAccess, 0));
    CHECK(cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, 0));
    EXPECT(managed == 1 && concurrent == 0 && pageable == 0, "managed %d concurrent %d pageable %d", managed, concurrent,
           pageable);
    ok("cudaDevAttrManagedMemory 1, ConcurrentManagedAccess 0, PageableMemoryAccess 0");

    // 3 MiB: more than one 2 MiB granule.
    const unsigned n = (3u << 20) / 4;
    unsigned *p = nullptr;
    CHECK(cudaMallocManaged(&p, n * 4));
    for (unsigned i = 0; i < n; i++) EXPECT(p[i] == 0, "fresh managed memory p[%u] = %u", i, p[i]);
    for (unsigned i = 0; i < n; i++) p[i] = i;
    twice<<<(n + 255) / 256, 256>>>(p, n);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    for (unsigned i = 0; i < n; i++) EXPECT(p[i] == 2 * i, "after twice p[%u] = %u", i, p[i]);
    ok("host writes, kernel reads and writes, host reads after cudaDeviceSynchronize (3 MiB)");

    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    iota<<<(n + 255) / 256, 256, 0, s>>>(p, 7, n);
    CHECK(cudaStreamSynchronize(s));
    check_iota(p, 7, n, "cudaStreamSynchronize");
    cudaEvent_t e;
    CHECK(cudaEventCreate(&e));
    iota<<<(n + 255) / 256, 256, 0, s>>>(p, 11, n);
    CHECK(cudaEventRecord(e, s));
    CHECK(cudaEventSynchronize(e));
    check_iota(p, 11, n, "cudaEventSynchronize");
    ok("kernel writes read by the host after cudaStreamSynchronize and cudaEventSynchronize");

    // A synchronous copy of other memory also ends the device's use of managed memory.
    unsigned *d = nullptr;
    CHECK(cudaMalloc(&d, n * 4));
    unsigned word = 0;
    iota<<<(n + 255) / 256, 256>>>(p, 100, n);
    CHECK(cudaMemcpy(&word, d, 4, cudaMemcpyDeviceToHost));
    check_iota(p, 100, n, "after a synchronous copy");
    // The host writes after that copy, then a kernel reads it.
    for (unsigned i = 0; i < n; i++) p[i] = 3;
    CHECK(cudaMemcpy(d, &word, 4, cudaMemcpyHostToDevice));
    for (unsigned i = 0; i < n; i++) p[i] = 5;
    twice<<<(n + 255) / 256, 256>>>(p, n);
    CHECK(cudaDeviceSynchronize());
    for (unsigned i = 0; i < n; i++) EXPECT(p[i] == 10, "host write after a synchronous copy, p[%u] = %u", i, p[i]);
    ok("kernel writes seen after a synchronous cudaMemcpy; host writes after one reach the next kernel");

    // Copies and memsets with managed memory on either side.
    unsigned *h = (unsigned *)malloc(n * 4);
    for (unsigned i = 0; i < n; i++) h[i] = 1000 + i;
    CHECK(cudaMemcpy(p, h, n * 4, cudaMemcpyHostToDevice));
    check_iota(p, 1000, n, "cudaMemcpy host -> managed");
    CHECK(cudaMemcpy(d, p, n * 4, cudaMemcpyDefault));
    memset(h, 0, n * 4);
    CHECK(cudaMemcpy(h, d, n * 4, cudaMemcpyDeviceToHost));
    check_iota(h, 1000, n, "cudaMemcpy managed -> device -> host");
    iota<<<(n + 255) / 256, 256>>>(d, 2000, n);
    CHECK(cudaMemcpy(p, d, n * 4, cudaMemcpyDeviceToDevice));
    check_iota(p, 2000, n, "cudaMemcpy device -> managed");
    iota<<<(n + 255) / 256, 256>>>(p, 3000, n);
    memset(h, 0, n * 4);
    CHECK(cudaMemcpy(h, p, n * 4, cudaMemcpyDeviceToHost));
    check_iota(h, 3000, n, "cudaMemcpy managed (kernel-written) -> host");
    CHECK(cudaMemcpyAsync(p, h, 64, cudaMemcpyHostToDevice, s));
    CHECK(cudaMemsetAsync(p + 64, 0xAB, 64, s));
    CHECK(cudaStreamSynchronize(s));
    check_iota(p, 3000, 16, "cudaMemcpyAsync host -> managed");
    const unsigned char *b = (const unsigned char *)(p + 64);
    EXPECT(check_bytes(b, 64, 0xAB) < 0, "cudaMemsetAsync on managed memory");
    EXPECT(p[80] == 3000 + 80, "past the memset p[80] = %u", p[80]);
    ok("cudaMemcpy host/device/default to and from managed memory, cudaMemcpyAsync and cudaMemsetAsync");

    cudaPointerAttributes pa;
    CHECK(cudaPointerGetAttributes(&pa, p + 10));
    EXPECT(pa.type == cudaMemoryTypeManaged && pa.device == 0, "type %d device %d", (int)pa.type, pa.device);
    EXPECT(pa.devicePointer == (void *)(p + 10) && pa.hostPointer == (void *)(p + 10), "pointers %p %p",
           pa.devicePointer, pa.hostPointer);
    CHECK(cudaPointerGetAttributes(&pa, d));
    EXPECT(pa.type == cudaMemoryTypeDevice, "cudaMalloc memory type %d", (int)pa.type);
    ok("cudaPointerGetAttributes: cudaMemoryTypeManaged (IS_MANAGED), one address for host and device");

#if CUDART_VERSION >= 13000
    cudaMemLocation cpu = {};
    cpu.type = cudaMemLocationTypeHost;
    cudaMemLocation gpu = {};
    gpu.type = cudaMemLocationTypeDevice;
    gpu.id = 0;
    CHECK(cudaMemPrefetchAsync(p, n * 4, cpu, 0, s));
    CHECK_ERR(cudaMemPrefetchAsync(p, n * 4, gpu, 0, s), cudaErrorInvalidDevice);
    CHECK(cudaMemAdvise(p, n * 4, cudaMemAdviseSetReadMostly, gpu));
    CHECK(cudaMemAdvise(p, n * 4, cudaMemAdviseSetPreferredLocation, cpu));
#else
    CHECK(cudaMemPrefetchAsync(p, n * 4, cudaCpuDeviceId, s));
    CHECK_ERR(cudaMemPrefetchAsync(p, n * 4, 0, s), cudaErrorInvalidDevice);
    CHECK(cudaMemAdvise(p, n * 4, cudaMemAdviseSetReadMostly, 0));
    CHECK(cudaMemAdvise(p, n * 4, cudaMemAdviseSetPreferredLocation, cudaCpuDeviceId));
#endif
    cudaGetLastError();
    CHECK(cudaStreamSynchronize(s));
    check_iota(p, 3000, 16, "after prefetch and advice");
    int rm = -5, pl = -5, lp = -5;
    CHECK(cudaMemRangeGetAttribute(&rm, 4, cudaMemRangeAttributeReadMostly, p, n * 4));
    CHECK(cudaMemRangeGetAttribute(&pl, 4, cudaMemRangeAttributePreferredLocation, p, n * 4));
    CHECK(cudaMemRangeGetAttribute(&lp, 4, cudaMemRangeAttributeLastPrefetchLocation, p, n * 4));
    EXPECT(rm == 1 && pl == cudaCpuDeviceId && lp == cudaCpuDeviceId, "read mostly %d preferred %d last prefetch %d", rm, pl, lp);
#if CUDART_VERSION >= 13000
    CHECK(cudaMemAdvise(p, 4096, cudaMemAdviseUnsetReadMostly, gpu));
#else
    CHECK(cudaMemAdvise(p, 4096, cudaMemAdviseUnsetReadMostly, 0));
#endif
    CHECK(cudaMemRangeGetAttribute(&rm, 4, cudaMemRangeAttributeReadMostly, p, n * 4));
    EXPECT(rm == 0, "read mostly over a range with one page unset: %d", rm);
    CHECK(cudaMemRangeGetAttribute(&rm, 4, cudaMemRangeAttributeReadMostly, p + 4096, 4096));
    EXPECT(rm == 1, "read mostly past the unset page: %d", rm);
    CHECK_ERR(cudaMemRangeGetAttribute(&rm, 4, cudaMemRangeAttributeReadMostly, d, 64), cudaErrorInvalidValue);
    cudaGetLastError();
    ok("prefetch to the host accepted, to a device without concurrent access refused; advice kept per page and read back by cudaMemRangeGetAttribute");

    unsigned *q = nullptr;
    CHECK_ERR(cudaMallocManaged(&q, 64, 4 /* cudaMemAttachSingle */), cudaErrorInvalidValue);
    cudaGetLastError();
    CHECK(cudaMallocManaged(&q, 1000 * 4, cudaMemAttachHost));
    for (unsigned i = 0; i < 1000; i++) q[i] = i;
    twice<<<4, 256>>>(q, 1000);
    CHECK(cudaDeviceSynchronize());
    for (unsigned i = 0; i < 1000; i++) EXPECT(q[i] == 2 * i, "attach-host q[%u] = %u", i, q[i]);
    CHECK(cudaFree(q));
    CHECK(cudaFree(p));
    CHECK(cudaFree(d));
    free(h);
    CHECK(cudaEventDestroy(e));
    CHECK(cudaStreamDestroy(s));
    ok("cudaMemAttachHost allocations, an invalid flag refused, cudaFree");
    return test_end();
}
