// Kernel of integration/cuda/rt_cooperative.cu, for the interpreter's tests:
// nvcc -arch=compute_90 -ptx nvcc13_cooperative.cu -o nvcc13_cooperative.ptx
#include <cooperative_groups.h>

namespace cg = cooperative_groups;

// Phase 1: block b sums its grid-strided slice of `in` into partial[b].
// grid.sync(). Phase 2: every block adds up all the partials (so each one
// reads every other block's phase-1 result) and block b writes its total to
// totals[b]. grid.sync(). Phase 3: thread 0 of each block checks that every
// block's total agrees and counts disagreements into *bad.
__global__ void reduce(const unsigned *in, unsigned *partial, unsigned *totals, unsigned *bad, int n) {
    cg::grid_group grid = cg::this_grid();
    __shared__ unsigned s[256];
    unsigned sum = 0;
    for (unsigned long long i = grid.thread_rank(); i < (unsigned long long)n; i += grid.size()) sum += in[i];
    s[threadIdx.x] = sum;
    __syncthreads();
    for (unsigned k = blockDim.x / 2; k > 0; k /= 2) {
        if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = s[0];
    grid.sync();
    if (threadIdx.x == 0) {
        unsigned t = 0;
        for (unsigned b = 0; b < gridDim.x; b++) t += partial[b];
        totals[blockIdx.x] = t;
    }
    grid.sync();
    if (threadIdx.x == 0) {
        unsigned mine = totals[blockIdx.x];
        for (unsigned b = 0; b < gridDim.x; b++)
            if (totals[b] != mine) atomicAdd(bad, 1u);
    }
}
