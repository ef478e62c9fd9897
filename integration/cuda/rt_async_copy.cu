// Asynchronous copies into shared memory: __pipeline_memcpy_async with commit and wait (what
// CUTLASS's multistage loops use, cp.async), cuda::memcpy_async completed through a
// cuda::barrier in shared memory (an mbarrier), and a producer warp handing tiles to consumer
// warps through mbarrier phases written in inline PTX, each checked on the host.
#include <cuda_runtime.h>
#include <cuda_pipeline.h>
#if CUDART_VERSION >= 13000
#include <cuda/barrier>
#endif
#include "check.h"

// Double-buffered sum: stage k+1 is in flight while stage k is summed.
__global__ void pipelined_sum(const int4 *in, int stages, long long *out) {
    __shared__ int4 buf[2][128];
    long long s = 0;
    __pipeline_memcpy_async(&buf[0][threadIdx.x], &in[threadIdx.x], sizeof(int4));
    __pipeline_commit();
    for (int k = 0; k < stages; k++) {
        if (k + 1 < stages)
            __pipeline_memcpy_async(&buf[(k + 1) & 1][threadIdx.x], &in[(k + 1) * 128 + threadIdx.x], sizeof(int4));
        __pipeline_commit();
        __pipeline_wait_prior(1);
        __syncthreads();
        int4 v = buf[k & 1][127 - threadIdx.x];
        s += (long long)v.x + v.y + v.z + v.w;
        __syncthreads();
    }
    out[threadIdx.x] = s;
}

#if CUDART_VERSION >= 13000
__global__ void barrier_copy(const int *in, int *out) {
    __shared__ int s[256];
    __shared__ cuda::barrier<cuda::thread_scope_block> bar;
    if (threadIdx.x == 0) init(&bar, blockDim.x);
    __syncthreads();
    cuda::memcpy_async(&s[threadIdx.x], &in[threadIdx.x], sizeof(int), bar);
    bar.arrive_and_wait();
    out[threadIdx.x] = s[blockDim.x - 1 - threadIdx.x] * 2;
}
static const char *barrier_kind = "cuda::memcpy_async completed by a cuda::barrier";
#else
// CUDA 12.9's headers and nvcc 13's libcu++ do not mix: the same with the PTX it compiles to,
// the copy's completion counted as each thread's arrival (.noinc).
__global__ void barrier_copy(const int *in, int *out) {
    __shared__ int s[256];
    __shared__ __align__(8) unsigned long long bar;
    unsigned b = (unsigned)__cvta_generic_to_shared(&bar);
    if (threadIdx.x == 0) asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(b), "r"(blockDim.x));
    __syncthreads();
    __pipeline_memcpy_async(&s[threadIdx.x], &in[threadIdx.x], sizeof(int));
    asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(b) : "memory");
    unsigned done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(b) : "memory");
    out[threadIdx.x] = s[blockDim.x - 1 - threadIdx.x] * 2;
}
static const char *barrier_kind = "cp.async completed through an mbarrier (cp.async.mbarrier.arrive.noinc)";
#endif

// Warp 0 produces 4 tiles of 32 ints into one shared slot; warps 1..3 consume each through a
// "full" barrier (1 arrival) and hand the slot back through an "empty" one (96 arrivals).
__global__ void producer_consumer(const int *in, int *out) {
    __shared__ int slot[32];
    __shared__ __align__(8) unsigned long long full, empty;
    unsigned f = (unsigned)__cvta_generic_to_shared(&full), e = (unsigned)__cvta_generic_to_shared(&empty);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(f));
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 96;" ::"r"(e));
    }
    __syncthreads();
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int t = 0; t < 4; t++) {
        unsigned parity = t & 1;
        if (warp == 0) {
            if (t > 0) {
                unsigned done = 0;
                while (!done)
                    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                                 : "=r"(done) : "r"(e), "r"(parity ^ 1) : "memory");
            }
            slot[lane] = in[t * 32 + lane];
            __syncwarp();
            if (lane == 0) asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(f) : "memory");
        } else {
            unsigned done = 0;
            while (!done)
                asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                             : "=r"(done) : "r"(f), "r"(parity) : "memory");
            out[t * 96 + (warp - 1) * 32 + lane] = slot[(lane + warp) % 32];
            asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(e) : "memory");
        }
    }
}

int main() {
    test_begin("rt_async_copy");
    const int stages = 6;
    int *hin = (int *)malloc(stages * 128 * 16);
    for (int i = 0; i < stages * 128 * 4; i++) hin[i] = i * 3 - 500;
    int4 *din;
    long long *dsum, hsum[128];
    CHECK(cudaMalloc(&din, stages * 128 * 16));
    CHECK(cudaMalloc(&dsum, sizeof hsum));
    CHECK(cudaMemcpy(din, hin, stages * 128 * 16, cudaMemcpyHostToDevice));
    pipelined_sum<<<1, 128>>>(din, stages, dsum);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(hsum, dsum, sizeof hsum, cudaMemcpyDeviceToHost));
    for (int t = 0; t < 128; t++) {
        long long want = 0;
        for (int k = 0; k < stages; k++)
            for (int c = 0; c < 4; c++) want += hin[(k * 128 + 127 - t) * 4 + c];
        EXPECT(hsum[t] == want, "thread %d summed %lld, want %lld", t, hsum[t], want);
    }
    ok("__pipeline_memcpy_async double buffering over %d stages", stages);

    int *dbin, *dbout, hb[256], ho[256];
    for (int i = 0; i < 256; i++) hb[i] = i * 7 + 1;
    CHECK(cudaMalloc(&dbin, sizeof hb));
    CHECK(cudaMalloc(&dbout, sizeof ho));
    CHECK(cudaMemcpy(dbin, hb, sizeof hb, cudaMemcpyHostToDevice));
    barrier_copy<<<1, 256>>>(dbin, dbout);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(ho, dbout, sizeof ho, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 256; i++) EXPECT(ho[i] == hb[255 - i] * 2, "out[%d] = %d, want %d", i, ho[i], hb[255 - i] * 2);
    ok("%s across 8 warps", barrier_kind);

    int *dpin, *dpout, hp[128], hq[4 * 96];
    for (int i = 0; i < 128; i++) hp[i] = i * i;
    CHECK(cudaMalloc(&dpin, sizeof hp));
    CHECK(cudaMalloc(&dpout, sizeof hq));
    CHECK(cudaMemcpy(dpin, hp, sizeof hp, cudaMemcpyHostToDevice));
    producer_consumer<<<1, 128>>>(dpin, dpout);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(hq, dpout, sizeof hq, cudaMemcpyDeviceToHost));
    for (int t = 0; t < 4; t++)
        for (int w = 1; w < 4; w++)
            for (int l = 0; l < 32; l++) {
                int got = hq[t * 96 + (w - 1) * 32 + l], want = hp[t * 32 + (l + w) % 32];
                EXPECT(got == want, "tile %d warp %d lane %d: %d, want %d", t, w, l, got, want);
            }
    ok("a producer warp and three consumer warps through mbarrier phases (try_wait.parity)");
    CHECK(cudaFree(din));
    CHECK(cudaFree(dsum));
    CHECK(cudaFree(dbin));
    CHECK(cudaFree(dbout));
    CHECK(cudaFree(dpin));
    CHECK(cudaFree(dpout));
    return test_end();
}
