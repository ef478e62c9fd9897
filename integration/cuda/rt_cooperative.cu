// Cooperative launch and grid-wide synchronisation (cooperative_groups'
// grid.sync()): a two-phase reduction whose second phase reads what every
// block wrote in the first, run as large a grid as can be co-resident; the
// same grid through cudaLaunchKernelEx with the cooperative attribute; a
// grid larger than the device can hold at once is refused with
// cudaErrorCooperativeLaunchTooLarge and does not run.
#include <cuda_runtime.h>
#if CUDART_VERSION >= 13000
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
#endif
#include "check.h"

// The grid barrier. The cudart-12 build puts CUDA 12.9's headers before nvcc 13's, and its
// cooperative_groups.h does not compile against nvcc 13's libcu++; it gets the same barrier
// written out as cooperative groups compiles it: the workspace address the driver passes in
// %envreg1:%envreg2 (0 outside a cooperative launch: trap), one arrival per block on the word
// at offset 4, the first block adding 0x80000000 - (blocks - 1) so the top bit flips when
// all have arrived.
__device__ void grid_sync() {
#if CUDART_VERSION >= 13000
    cg::this_grid().sync();
#else
    unsigned hi, lo;
    asm volatile("mov.u32 %0, %%envreg1;" : "=r"(hi));
    asm volatile("mov.u32 %0, %%envreg2;" : "=r"(lo));
    unsigned long long ws = ((unsigned long long)hi << 32) | lo;
    if (ws == 0) __trap();
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
        unsigned *word = (unsigned *)(ws + 4);
        unsigned blocks = gridDim.x * gridDim.y * gridDim.z;
        bool first = blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0;
        unsigned add = first ? 0x80000001u - blocks : 1u, old, now;
        asm volatile("atom.add.release.gpu.u32 %0, [%1], %2;" : "=r"(old) : "l"(word), "r"(add) : "memory");
        do {
            asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(now) : "l"(word) : "memory");
        } while (((old ^ now) & 0x80000000u) == 0);
    }
    __syncthreads();
#endif
}

// Phase 1: block b sums its grid-strided slice of `in` into partial[b].
// grid.sync(). Phase 2: every block adds up all the partials (so each one
// reads every other block's phase-1 result) and block b writes its total to
// totals[b]. grid.sync(). Phase 3: thread 0 of each block checks that every
// block's total agrees and counts disagreements into *bad. (1-D grids and blocks.)
__global__ void reduce(const unsigned *in, unsigned *partial, unsigned *totals, unsigned *bad, int n) {
    __shared__ unsigned s[256];
    unsigned sum = 0;
    const unsigned long long size = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < (unsigned long long)n; i += size) sum += in[i];
    s[threadIdx.x] = sum;
    __syncthreads();
    for (unsigned k = blockDim.x / 2; k > 0; k /= 2) {
        if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = s[0];
    grid_sync();
    if (threadIdx.x == 0) {
        unsigned t = 0;
        for (unsigned b = 0; b < gridDim.x; b++) t += partial[b];
        totals[blockIdx.x] = t;
    }
    grid_sync();
    if (threadIdx.x == 0) {
        unsigned mine = totals[blockIdx.x];
        for (unsigned b = 0; b < gridDim.x; b++)
            if (totals[b] != mine) atomicAdd(bad, 1u);
    }
}

int main() {
    test_begin("rt_cooperative");
    int dev = 0, coop = 0, sms = 0;
    CHECK(cudaGetDevice(&dev));
    CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    EXPECT(coop == 1, "cudaDevAttrCooperativeLaunch is %d", coop);
    int per_sm = 0;
    const int threads = 256;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, reduce, threads, 0));
    EXPECT(per_sm > 0, "occupancy %d blocks per SM", per_sm);
    const int max_blocks = per_sm * sms;
    ok("cooperative launch supported; %d SMs x %d blocks of %d threads co-resident", sms, per_sm, threads);

    const int n = 1 << 20;
    unsigned *in, *partial, *totals, *bad;
    CHECK(cudaMalloc(&in, n * sizeof(unsigned)));
    CHECK(cudaMalloc(&partial, (max_blocks + 1) * sizeof(unsigned)));
    CHECK(cudaMalloc(&totals, (max_blocks + 1) * sizeof(unsigned)));
    CHECK(cudaMalloc(&bad, sizeof(unsigned)));
    unsigned *h = (unsigned *)malloc(n * sizeof(unsigned));
    unsigned long long want = 0;
    for (int i = 0; i < n; i++) {
        h[i] = (unsigned)(i % 1000) + 1;
        want += h[i];
    }
    CHECK(cudaMemcpy(in, h, n * sizeof(unsigned), cudaMemcpyHostToDevice));

    // Small grids and the largest that fits; the sim runs every block's interpreter in turns.
    int grids[] = {2, 37, max_blocks};
    for (int g : grids) {
        int nn = n;
        void *args[] = {&in, &partial, &totals, &bad, &nn};
        CHECK(cudaMemset(totals, 0xff, (max_blocks + 1) * sizeof(unsigned)));
        CHECK(cudaMemset(bad, 0, sizeof(unsigned)));
        CHECK(cudaLaunchCooperativeKernel((void *)reduce, dim3(g), dim3(threads), args, 0, 0));
        CHECK(cudaDeviceSynchronize());
        unsigned *t = (unsigned *)malloc(g * sizeof(unsigned));
        unsigned nbad = 1;
        CHECK(cudaMemcpy(t, totals, g * sizeof(unsigned), cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(&nbad, bad, sizeof nbad, cudaMemcpyDeviceToHost));
        for (int b = 0; b < g; b++) EXPECT(t[b] == (unsigned)want, "grid %d: block %d total %u, want %llu", g, b, t[b], want);
        EXPECT(nbad == 0, "grid %d: %u blocks saw totals that disagree after grid.sync()", g, nbad);
        free(t);
        ok("cudaLaunchCooperativeKernel, %d blocks: two grid.sync() phases give the sum %llu in every block", g, want);
    }

    // The same through cudaLaunchKernelEx and the cooperative attribute.
    {
        cudaLaunchAttribute a;
        a.id = cudaLaunchAttributeCooperative;
        a.val.cooperative = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(max_blocks);
        cfg.blockDim = dim3(threads);
        cfg.attrs = &a;
        cfg.numAttrs = 1;
        CHECK(cudaMemset(totals, 0, (max_blocks + 1) * sizeof(unsigned)));
        CHECK(cudaMemset(bad, 0, sizeof(unsigned)));
        CHECK(cudaLaunchKernelEx(&cfg, reduce, (const unsigned *)in, partial, totals, bad, n));
        CHECK(cudaDeviceSynchronize());
        unsigned t0 = 0, tl = 0, nbad = 1;
        CHECK(cudaMemcpy(&t0, totals, sizeof t0, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(&tl, totals + max_blocks - 1, sizeof tl, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(&nbad, bad, sizeof nbad, cudaMemcpyDeviceToHost));
        EXPECT(t0 == (unsigned)want && tl == (unsigned)want && nbad == 0, "cudaLaunchKernelEx: totals %u, %u, %u disagreements", t0, tl, nbad);
        ok("cudaLaunchKernelEx with cudaLaunchAttributeCooperative, %d blocks: right sum", max_blocks);
    }

    // One block more than can be resident: refused at the launch, nothing runs.
    {
        int nn = n;
        void *args[] = {&in, &partial, &totals, &bad, &nn};
        CHECK(cudaMemset(totals, 0, (max_blocks + 1) * sizeof(unsigned)));
        cudaError_t e = cudaLaunchCooperativeKernel((void *)reduce, dim3(max_blocks + 1), dim3(threads), args, 0, 0);
        EXPECT(e == cudaErrorCooperativeLaunchTooLarge, "a grid of %d blocks (limit %d): %s", max_blocks + 1, max_blocks, cudaGetErrorName(e));
        (void)cudaGetLastError();
        CHECK(cudaDeviceSynchronize());
        unsigned t0 = 1;
        CHECK(cudaMemcpy(&t0, totals, sizeof t0, cudaMemcpyDeviceToHost));
        EXPECT(t0 == 0, "the refused launch ran (totals[0] = %u)", t0);
        ok("a grid of %d blocks is refused with %s and does not run", max_blocks + 1, cudaGetErrorName(e));
    }

    // grid.sync() in an ordinary launch traps, as on a GPU: the launch fails, never hangs.
    {
        CHECK(cudaMemset(totals, 0, sizeof(unsigned)));
        reduce<<<4, threads>>>(in, partial, totals, bad, n);
        cudaError_t e = cudaDeviceSynchronize();
        EXPECT(e != cudaSuccess, "grid.sync() in a launch that is not cooperative returned success");
        ok("grid.sync() outside a cooperative launch fails (%s)", cudaGetErrorName(e));
    }
    free(h);
    return test_end();
}
