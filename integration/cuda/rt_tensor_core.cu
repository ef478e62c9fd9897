// Tensor cores through the WMMA API (mma.h): a 64x64x64 half -> float GEMM, one warp per
// 16x16 tile, with element-wise access to the accumulator fragment, and a 32x8x16 bf16
// product, each checked against a host reference.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <mma.h>
#include "check.h"

using namespace nvcuda;

// C = alpha * A * B + beta * C; A row-major, B column-major, C row-major, all n x n.
__global__ void gemm(const half *a, const half *b, float *c, int n, float alpha, float beta) {
    int tm = blockIdx.y * (blockDim.y) + threadIdx.y, tn = blockIdx.x;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc, fc;
    wmma::fill_fragment(acc, 0.0f);
    for (int k = 0; k < n; k += 16) {
        wmma::load_matrix_sync(fa, a + tm * 16 * n + k, n);
        wmma::load_matrix_sync(fb, b + tn * 16 * n + k, n);
        wmma::mma_sync(acc, fa, fb, acc);
    }
    float *ct = c + tm * 16 * n + tn * 16;
    wmma::load_matrix_sync(fc, ct, n, wmma::mem_row_major);
    for (int i = 0; i < fc.num_elements; i++) fc.x[i] = alpha * acc.x[i] + beta * fc.x[i];
    wmma::store_matrix_sync(ct, fc, n, wmma::mem_row_major);
}

// D (32x8, column-major) = A (32x16 bf16, row-major) * B (16x8 bf16, row-major).
__global__ void bf16_tile(const __nv_bfloat16 *a, const __nv_bfloat16 *b, float *d) {
    wmma::fragment<wmma::matrix_a, 32, 8, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 32, 8, 16, __nv_bfloat16, wmma::row_major> fb;
    wmma::fragment<wmma::accumulator, 32, 8, 16, float> acc;
    wmma::fill_fragment(acc, 1.0f);
    wmma::load_matrix_sync(fa, a, 16);
    wmma::load_matrix_sync(fb, b, 8);
    wmma::mma_sync(acc, fa, fb, acc);
    wmma::store_matrix_sync(d, acc, 32, wmma::mem_col_major);
}

static float val(int i) { return (float)((i * 37 + 11) % 17) / 8.0f - 1.0f; }

int main() {
    test_begin("rt_tensor_core");
    const int n = 64;
    half *ha = (half *)malloc(n * n * sizeof(half)), *hb = (half *)malloc(n * n * sizeof(half));
    float *hc = (float *)malloc(n * n * sizeof(float)), *ref = (float *)malloc(n * n * sizeof(float));
    float *fa = (float *)malloc(n * n * sizeof(float)), *fb = (float *)malloc(n * n * sizeof(float));
    for (int i = 0; i < n * n; i++) {
        fa[i] = val(i);
        fb[i] = val(i + 5);
        hc[i] = (float)(i % 7) - 3.0f;
    }
    // B column-major: element (k, j) at j * n + k.
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            ha[i * n + j] = __float2half(fa[i * n + j]);
            hb[j * n + i] = __float2half(fb[i * n + j]);
        }
    const float alpha = 2.0f, beta = 0.5f;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double s = 0;
            for (int k = 0; k < n; k++) s += (double)fa[i * n + k] * fb[k * n + j];
            ref[i * n + j] = (float)(alpha * s + beta * hc[i * n + j]);
        }
    half *da, *db;
    float *dc;
    CHECK(cudaMalloc(&da, n * n * sizeof(half)));
    CHECK(cudaMalloc(&db, n * n * sizeof(half)));
    CHECK(cudaMalloc(&dc, n * n * sizeof(float)));
    CHECK(cudaMemcpy(da, ha, n * n * sizeof(half), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(db, hb, n * n * sizeof(half), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dc, hc, n * n * sizeof(float), cudaMemcpyHostToDevice));
    // Two warps a block (threadIdx.y picks the row of tiles).
    gemm<<<dim3(n / 16, n / 32), dim3(32, 2)>>>(da, db, dc, n, alpha, beta);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(hc, dc, n * n * sizeof(float), cudaMemcpyDeviceToHost));
    // The products are multiples of 1/64 and every partial sum is exact in f32.
    for (int i = 0; i < n * n; i++) EXPECT(hc[i] == ref[i], "C[%d][%d] = %g, want %g", i / n, i % n, hc[i], ref[i]);
    ok("WMMA 64x64x64 half -> float GEMM with alpha/beta through fragment.x[i] matches the host");

    __nv_bfloat16 ba[32 * 16], bb[16 * 8];
    for (int i = 0; i < 32 * 16; i++) ba[i] = __float2bfloat16(val(i + 1));
    for (int i = 0; i < 16 * 8; i++) bb[i] = __float2bfloat16(val(i + 9));
    __nv_bfloat16 *dba, *dbb;
    float *dd, hd[32 * 8];
    CHECK(cudaMalloc(&dba, sizeof ba));
    CHECK(cudaMalloc(&dbb, sizeof bb));
    CHECK(cudaMalloc(&dd, sizeof hd));
    CHECK(cudaMemcpy(dba, ba, sizeof ba, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dbb, bb, sizeof bb, cudaMemcpyHostToDevice));
    bf16_tile<<<1, 32>>>(dba, dbb, dd);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(hd, dd, sizeof hd, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 32; i++)
        for (int j = 0; j < 8; j++) {
            double s = 1.0;
            for (int k = 0; k < 16; k++) s += (double)val(i * 16 + k + 1) * val(k * 8 + j + 9);
            EXPECT(hd[j * 32 + i] == (float)s, "bf16 D[%d][%d] = %g, want %g", i, j, hd[j * 32 + i], s);
        }
    ok("WMMA 32x8x16 bf16 tile, column-major store, matches the host");
    CHECK(cudaFree(da));
    CHECK(cudaFree(db));
    CHECK(cudaFree(dc));
    CHECK(cudaFree(dba));
    CHECK(cudaFree(dbb));
    CHECK(cudaFree(dd));
    return test_end();
}
