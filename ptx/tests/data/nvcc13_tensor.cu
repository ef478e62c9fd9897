// Kernels for ptx/tests/nvcc_tensor.rs. Regenerate the PTX with
//   nvcc -ptx -arch=sm_90 -std=c++17 -O1 -o nvcc13_tensor.ptx nvcc13_tensor.cu
#include <mma.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <cuda/barrier>
using namespace nvcuda;

// C = 2 * (A * B), n x n, A row-major, B column-major, one warp per 16x16 tile of C.
extern "C" __global__ void wmma_gemm(const half* a, const half* b, float* c, int n) {
  int tm = blockIdx.y, tn = blockIdx.x;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
  wmma::fill_fragment(fc, 0.0f);
  for (int k = 0; k < n; k += 16) {
    wmma::load_matrix_sync(fa, a + tm * 16 * n + k, n);
    wmma::load_matrix_sync(fb, b + tn * 16 * n + k, n);
    wmma::mma_sync(fc, fa, fb, fc);
  }
  for (int i = 0; i < fc.num_elements; i++) fc.x[i] *= 2.0f;
  wmma::store_matrix_sync(c + tm * 16 * n + tn * 16, fc, n, wmma::mem_row_major);
}

// D (16x8, f32, row-major) = A (16x16 half, row-major) * B (16x8 half, row-major), through
// shared memory, ldmatrix and mma.sync as CUTLASS-style code does it.
extern "C" __global__ void mma_ldmatrix(const half* a, const half* b, float* d) {
  __shared__ __align__(16) half sa[16 * 16];
  __shared__ __align__(16) half sb[16 * 8];
  int l = threadIdx.x;
  for (int i = l; i < 256; i += 32) sa[i] = a[i];
  for (int i = l; i < 128; i += 32) sb[i] = b[i];
  __syncwarp();
  unsigned ra[4], rb[2];
  // x4: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
  const half* pa = &sa[(l % 16) * 16 + (l / 16) * 8];
  unsigned sa_addr = (unsigned)__cvta_generic_to_shared(pa);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(ra[0]), "=r"(ra[1]), "=r"(ra[2]), "=r"(ra[3]) : "r"(sa_addr));
  // B is K x N row-major: .trans gives the column fragments; lanes 0-15 address rows k = 0..15.
  const half* pb = &sb[(l % 16) * 8];
  unsigned sb_addr = (unsigned)__cvta_generic_to_shared(pb);
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
               : "=r"(rb[0]), "=r"(rb[1]) : "r"(sb_addr));
  float c[4] = {0, 0, 0, 0};
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(ra[0]), "r"(ra[1]), "r"(ra[2]), "r"(ra[3]), "r"(rb[0]), "r"(rb[1]));
  int g = l / 4, t = l % 4;
  d[g * 8 + 2 * t] = c[0];
  d[g * 8 + 2 * t + 1] = c[1];
  d[(g + 8) * 8 + 2 * t] = c[2];
  d[(g + 8) * 8 + 2 * t + 1] = c[3];
}

// out[i] = in[blockDim - 1 - i] of the block's slice, staged through __pipeline_memcpy_async.
extern "C" __global__ void pipeline_reverse(const int4* in, int4* out) {
  __shared__ int4 s[256];
  const int4* src = in + blockIdx.x * blockDim.x;
  __pipeline_memcpy_async(&s[threadIdx.x], &src[threadIdx.x], sizeof(int4));
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = s[blockDim.x - 1 - threadIdx.x];
}

// cuda::memcpy_async into shared memory completed through a cuda::barrier (an mbarrier), then
// a second phase of the same barrier.
extern "C" __global__ void barrier_copy(const int* in, int* out) {
  __shared__ int s[256];
  __shared__ cuda::barrier<cuda::thread_scope_block> bar;
  if (threadIdx.x == 0) init(&bar, blockDim.x);
  __syncthreads();
  cuda::memcpy_async(&s[threadIdx.x], &in[threadIdx.x], sizeof(int), bar);
  bar.arrive_and_wait();
  int v = s[(threadIdx.x + 32) % blockDim.x];
  bar.arrive_and_wait();
  s[threadIdx.x] = v + 1;
  bar.arrive_and_wait();
  out[threadIdx.x] = s[blockDim.x - 1 - threadIdx.x];
}
