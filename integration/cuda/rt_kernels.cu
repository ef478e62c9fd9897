// Real kernels on the sim's PTX interpreter, each checked against a CPU
// reference: vector add, SAXPY over several streams with events, tiled
// matrix multiply (shared memory, __syncthreads), reduction with warp
// shuffles and atomics, shared-memory histogram, prefix scan, warp vote and
// ballot, templates and device functions, symbols (__constant__ and
// __device__ with cudaMemcpyToSymbol/FromSymbol), dynamic shared memory,
// printf, clock64, and an out-of-bounds write reported as
// cudaErrorIllegalAddress at the next synchronisation (last: it ends the
// context on a real GPU).
#include <cuda_runtime.h>
#include <cmath>
#include <vector>
#include "check.h"

__global__ void vec_add(const float *a, const float *b, float *c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}

__global__ void saxpy(float a, const float *x, float *y, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = a * x[i] + y[i];
}

#define TILE 16
__global__ void matmul(const float *A, const float *B, float *C, int n) {
    __shared__ float As[TILE][TILE], Bs[TILE][TILE];
    int row = blockIdx.y * TILE + threadIdx.y, col = blockIdx.x * TILE + threadIdx.x;
    float acc = 0;
    for (int t = 0; t < (n + TILE - 1) / TILE; t++) {
        int ac = t * TILE + threadIdx.x, br = t * TILE + threadIdx.y;
        As[threadIdx.y][threadIdx.x] = (row < n && ac < n) ? A[row * n + ac] : 0.f;
        Bs[threadIdx.y][threadIdx.x] = (br < n && col < n) ? B[br * n + col] : 0.f;
        __syncthreads();
        for (int k = 0; k < TILE; k++) acc += As[threadIdx.y][k] * Bs[k][threadIdx.x];
        __syncthreads();
    }
    if (row < n && col < n) C[row * n + col] = acc;
}

__global__ void reduce_sum(const int *in, unsigned long long *out, int n) {
    __shared__ int warp_sums[32];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int v = i < n ? in[i] : 0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffff, v, o);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = threadIdx.x < blockDim.x / 32 ? warp_sums[threadIdx.x] : 0;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
        if (threadIdx.x == 0) atomicAdd(out, (unsigned long long)v);
    }
}

__global__ void histogram(const unsigned char *data, int n, unsigned *bins) {
    __shared__ unsigned local[64];
    for (int b = threadIdx.x; b < 64; b += blockDim.x) local[b] = 0;
    __syncthreads();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) atomicAdd(&local[data[i] % 64], 1u);
    __syncthreads();
    for (int b = threadIdx.x; b < 64; b += blockDim.x) atomicAdd(&bins[b], local[b]);
}

// Inclusive scan of one block of 512 (Hillis-Steele, double-buffered).
__global__ void scan512(const int *in, int *out) {
    __shared__ int buf[2][512];
    int t = threadIdx.x, cur = 0;
    buf[0][t] = in[t];
    __syncthreads();
    for (int off = 1; off < 512; off <<= 1) {
        buf[1 - cur][t] = buf[cur][t] + (t >= off ? buf[cur][t - off] : 0);
        cur = 1 - cur;
        __syncthreads();
    }
    out[t] = buf[cur][t];
}

__global__ void votes(const int *in, unsigned *ballots, int *flags) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    int v = in[t];
    unsigned b = __ballot_sync(0xffffffff, v > 0);
    int all = __all_sync(0xffffffff, v > -100);
    int any = __any_sync(0xffffffff, v > 1000);
    if ((threadIdx.x & 31) == 0) {
        ballots[t / 32] = b;
        flags[t / 32] = all * 2 + any;
    }
}

template <typename T> __device__ __noinline__ T cube(T x) { return x * x * x; }
template <typename T> __global__ void apply_cube(T *x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = cube(x[i]) + (T)1;
}

__constant__ float c_scale[4];
__device__ int d_offset;
__device__ int d_result[8];
__global__ void use_symbols() {
    int t = threadIdx.x;
    if (t < 8) d_result[t] = (int)(c_scale[t % 4] * 10) + d_offset;
}

__global__ void reverse_dyn(int *x, int n) {
    extern __shared__ int s[];
    int t = threadIdx.x;
    s[t] = x[t];
    __syncthreads();
    x[t] = s[n - 1 - t];
}

__global__ void say_hello(int tag) {
    if (threadIdx.x < 2) printf("hello from thread %d of block %d, tag %d, pi %.3f\n", threadIdx.x, blockIdx.x, tag, 3.14159);
}

__global__ void timed(long long *out) {
    long long t0 = clock64();
    float a = 1.0f;
    for (int i = 0; i < 1000; i++) a = a * 1.0001f + 0.5f;
    long long t1 = clock64();
    out[0] = t1 - t0;
    out[1] = (long long)a;
}

__global__ void write_far(int *x) { x[threadIdx.x + (64 << 20)] = 1; }

int main() {
    test_begin("rt_kernels");
    const int n = 10000;

    // Vector add.
    {
        std::vector<float> a(n), b(n), c(n);
        for (int i = 0; i < n; i++) a[i] = i * 0.5f, b[i] = 1000.0f - i;
        float *da, *db, *dc;
        CHECK(cudaMalloc(&da, n * 4));
        CHECK(cudaMalloc(&db, n * 4));
        CHECK(cudaMalloc(&dc, n * 4));
        CHECK(cudaMemcpy(da, a.data(), n * 4, cudaMemcpyHostToDevice));
        CHECK(cudaMemcpy(db, b.data(), n * 4, cudaMemcpyHostToDevice));
        vec_add<<<(n + 255) / 256, 256>>>(da, db, dc, n);
        CHECK(cudaGetLastError());
        CHECK(cudaMemcpy(c.data(), dc, n * 4, cudaMemcpyDeviceToHost));
        for (int i = 0; i < n; i++) EXPECT(c[i] == a[i] + b[i], "vec_add[%d] = %f", i, c[i]);
        ok("vector add of %d floats", n);
        CHECK(cudaFree(da));
        CHECK(cudaFree(db));
        CHECK(cudaFree(dc));
    }

    // SAXPY on four streams, joined by events.
    {
        const int ns = 4, chunk = 4096;
        std::vector<float> x(ns * chunk), y(ns * chunk), r(ns * chunk);
        for (int i = 0; i < ns * chunk; i++) x[i] = (float)(i % 97), y[i] = (float)(i % 13);
        float *dx, *dy;
        CHECK(cudaMalloc(&dx, x.size() * 4));
        CHECK(cudaMalloc(&dy, y.size() * 4));
        cudaStream_t s[ns];
        cudaEvent_t done[ns];
        for (int k = 0; k < ns; k++) {
            CHECK(cudaStreamCreateWithFlags(&s[k], cudaStreamNonBlocking));
            CHECK(cudaEventCreate(&done[k]));
            CHECK(cudaMemcpyAsync(dx + k * chunk, x.data() + k * chunk, chunk * 4, cudaMemcpyHostToDevice, s[k]));
            CHECK(cudaMemcpyAsync(dy + k * chunk, y.data() + k * chunk, chunk * 4, cudaMemcpyHostToDevice, s[k]));
            saxpy<<<8, 128, 0, s[k]>>>(2.0f + k, dx + k * chunk, dy + k * chunk, chunk);
            CHECK(cudaGetLastError());
            CHECK(cudaEventRecord(done[k], s[k]));
        }
        for (int k = 0; k < ns; k++) CHECK(cudaStreamWaitEvent(s[0], done[k], 0));
        CHECK(cudaMemcpyAsync(r.data(), dy, r.size() * 4, cudaMemcpyDeviceToHost, s[0]));
        CHECK(cudaStreamSynchronize(s[0]));
        for (int i = 0; i < ns * chunk; i++) {
            float want = (2.0f + i / chunk) * x[i] + y[i];
            EXPECT(r[i] == want, "saxpy[%d] = %f, want %f", i, r[i], want);
        }
        for (int k = 0; k < ns; k++) {
            CHECK(cudaEventDestroy(done[k]));
            CHECK(cudaStreamDestroy(s[k]));
        }
        CHECK(cudaFree(dx));
        CHECK(cudaFree(dy));
        ok("SAXPY on %d streams joined by events", ns);
    }

    // Tiled matrix multiply.
    {
        const int m = 70;
        std::vector<float> A(m * m), B(m * m), C(m * m);
        for (int i = 0; i < m * m; i++) A[i] = (float)((i * 7) % 11) - 5, B[i] = (float)((i * 3) % 5) - 2;
        float *dA, *dB, *dC;
        CHECK(cudaMalloc(&dA, m * m * 4));
        CHECK(cudaMalloc(&dB, m * m * 4));
        CHECK(cudaMalloc(&dC, m * m * 4));
        CHECK(cudaMemcpy(dA, A.data(), m * m * 4, cudaMemcpyHostToDevice));
        CHECK(cudaMemcpy(dB, B.data(), m * m * 4, cudaMemcpyHostToDevice));
        dim3 blk(TILE, TILE), grd((m + TILE - 1) / TILE, (m + TILE - 1) / TILE);
        matmul<<<grd, blk>>>(dA, dB, dC, m);
        CHECK(cudaGetLastError());
        CHECK(cudaMemcpy(C.data(), dC, m * m * 4, cudaMemcpyDeviceToHost));
        for (int i = 0; i < m; i++)
            for (int j = 0; j < m; j++) {
                float acc = 0;
                for (int k = 0; k < m; k++) acc += A[i * m + k] * B[k * m + j];
                EXPECT(C[i * m + j] == acc, "C[%d][%d] = %f, want %f", i, j, C[i * m + j], acc);
            }
        ok("tiled %dx%d matrix multiply with shared memory and __syncthreads", m, m);
        CHECK(cudaFree(dA));
        CHECK(cudaFree(dB));
        CHECK(cudaFree(dC));
    }

    // Reduction (warp shuffles, shared memory, one atomic per block).
    {
        std::vector<int> v(n);
        long long want = 0;
        for (int i = 0; i < n; i++) v[i] = (i * 37) % 1001 - 300, want += v[i];
        int *dv;
        unsigned long long *dsum, sum = 0;
        CHECK(cudaMalloc(&dv, n * 4));
        CHECK(cudaMalloc(&dsum, 8));
        CHECK(cudaMemcpy(dv, v.data(), n * 4, cudaMemcpyHostToDevice));
        CHECK(cudaMemset(dsum, 0, 8));
        reduce_sum<<<(n + 255) / 256, 256>>>(dv, dsum, n);
        CHECK(cudaMemcpy(&sum, dsum, 8, cudaMemcpyDeviceToHost));
        EXPECT((long long)sum == want, "sum %lld, want %lld", (long long)sum, want);
        ok("reduction with warp shuffles and atomics: %lld", want);
        CHECK(cudaFree(dv));
        CHECK(cudaFree(dsum));
    }

    // Histogram with shared-memory atomics.
    {
        std::vector<unsigned char> d(n);
        unsigned want[64] = {0}, got[64];
        for (int i = 0; i < n; i++) d[i] = (unsigned char)((i * 131) ^ (i >> 3)), want[d[i] % 64]++;
        unsigned char *dd;
        unsigned *db;
        CHECK(cudaMalloc(&dd, n));
        CHECK(cudaMalloc(&db, sizeof got));
        CHECK(cudaMemcpy(dd, d.data(), n, cudaMemcpyHostToDevice));
        CHECK(cudaMemset(db, 0, sizeof got));
        histogram<<<6, 128>>>(dd, n, db);
        CHECK(cudaMemcpy(got, db, sizeof got, cudaMemcpyDeviceToHost));
        for (int b = 0; b < 64; b++) EXPECT(got[b] == want[b], "bin %d: %u, want %u", b, got[b], want[b]);
        ok("histogram with shared-memory atomics");
        CHECK(cudaFree(dd));
        CHECK(cudaFree(db));
    }

    // Prefix scan.
    {
        int in[512], out[512];
        for (int i = 0; i < 512; i++) in[i] = (i % 7) - 2;
        int *di, *dout;
        CHECK(cudaMalloc(&di, sizeof in));
        CHECK(cudaMalloc(&dout, sizeof out));
        CHECK(cudaMemcpy(di, in, sizeof in, cudaMemcpyHostToDevice));
        scan512<<<1, 512>>>(di, dout);
        CHECK(cudaMemcpy(out, dout, sizeof out, cudaMemcpyDeviceToHost));
        int acc = 0;
        for (int i = 0; i < 512; i++) {
            acc += in[i];
            EXPECT(out[i] == acc, "scan[%d] = %d, want %d", i, out[i], acc);
        }
        ok("inclusive prefix scan of 512");
        CHECK(cudaFree(di));
        CHECK(cudaFree(dout));
    }

    // Warp vote and ballot.
    {
        int in[128];
        for (int i = 0; i < 128; i++) in[i] = (i % 3 == 0) ? 5 : -5;
        in[100] = 5000;
        int *di, *df, flags[4];
        unsigned *dbal, bal[4];
        CHECK(cudaMalloc(&di, sizeof in));
        CHECK(cudaMalloc(&df, sizeof flags));
        CHECK(cudaMalloc(&dbal, sizeof bal));
        CHECK(cudaMemcpy(di, in, sizeof in, cudaMemcpyHostToDevice));
        votes<<<2, 64>>>(di, dbal, df);
        CHECK(cudaMemcpy(bal, dbal, sizeof bal, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(flags, df, sizeof flags, cudaMemcpyDeviceToHost));
        for (int w = 0; w < 4; w++) {
            unsigned want = 0;
            int any = 0;
            for (int l = 0; l < 32; l++) {
                want |= (unsigned)(in[w * 32 + l] > 0) << l;
                any |= in[w * 32 + l] > 1000;
            }
            EXPECT(bal[w] == want, "ballot of warp %d: %08x, want %08x", w, bal[w], want);
            EXPECT(flags[w] == 2 + any, "all/any of warp %d: %d", w, flags[w]);
        }
        ok("__ballot_sync, __all_sync, __any_sync");
        CHECK(cudaFree(di));
        CHECK(cudaFree(df));
        CHECK(cudaFree(dbal));
    }

    // Templates and (non-inlined) device functions.
    {
        int xi[100];
        double xd[100];
        for (int i = 0; i < 100; i++) xi[i] = i - 50, xd[i] = i * 0.25;
        int *dxi;
        double *dxd;
        CHECK(cudaMalloc(&dxi, sizeof xi));
        CHECK(cudaMalloc(&dxd, sizeof xd));
        CHECK(cudaMemcpy(dxi, xi, sizeof xi, cudaMemcpyHostToDevice));
        CHECK(cudaMemcpy(dxd, xd, sizeof xd, cudaMemcpyHostToDevice));
        apply_cube<int><<<1, 128>>>(dxi, 100);
        apply_cube<double><<<1, 128>>>(dxd, 100);
        int ri[100];
        double rd[100];
        CHECK(cudaMemcpy(ri, dxi, sizeof ri, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(rd, dxd, sizeof rd, cudaMemcpyDeviceToHost));
        for (int i = 0; i < 100; i++) {
            EXPECT(ri[i] == xi[i] * xi[i] * xi[i] + 1, "cube<int>[%d] = %d", i, ri[i]);
            EXPECT(rd[i] == xd[i] * xd[i] * xd[i] + 1.0, "cube<double>[%d] = %f", i, rd[i]);
        }
        ok("template kernels calling a __noinline__ template device function (int, double)");
        CHECK(cudaFree(dxi));
        CHECK(cudaFree(dxd));
    }

    // Symbols.
    {
        float scale[4] = {0.5f, 1.0f, 1.5f, 2.0f};
        int off = 7, res[8];
        CHECK(cudaMemcpyToSymbol(c_scale, scale, sizeof scale));
        CHECK(cudaMemcpyToSymbol(d_offset, &off, sizeof off));
        use_symbols<<<1, 32>>>();
        CHECK(cudaGetLastError());
        CHECK(cudaMemcpyFromSymbol(res, d_result, sizeof res));
        for (int t = 0; t < 8; t++) EXPECT(res[t] == (int)(scale[t % 4] * 10) + off, "d_result[%d] = %d", t, res[t]);
        ok("__constant__ and __device__ symbols written with cudaMemcpyToSymbol, read by a kernel, result read with cudaMemcpyFromSymbol");
    }

    // Dynamic shared memory.
    {
        const int m = 300;
        int x[m], *dx;
        for (int i = 0; i < m; i++) x[i] = i * 3;
        CHECK(cudaMalloc(&dx, sizeof x));
        CHECK(cudaMemcpy(dx, x, sizeof x, cudaMemcpyHostToDevice));
        reverse_dyn<<<1, m, m * sizeof(int)>>>(dx, m);
        CHECK(cudaMemcpy(x, dx, sizeof x, cudaMemcpyDeviceToHost));
        for (int i = 0; i < m; i++) EXPECT(x[i] == (m - 1 - i) * 3, "reverse[%d] = %d", i, x[i]);
        ok("dynamic shared memory (%zu bytes)", m * sizeof(int));
        CHECK(cudaFree(dx));
    }

    // printf from a kernel: its lines appear before the next ok line.
    {
        say_hello<<<2, 32>>>(42);
        CHECK(cudaDeviceSynchronize());
        ok("kernel printf flushed at the synchronisation");
    }

    // clock64.
    {
        long long *dt, t[2];
        CHECK(cudaMalloc(&dt, sizeof t));
        timed<<<1, 1>>>(dt);
        CHECK(cudaMemcpy(t, dt, sizeof t, cudaMemcpyDeviceToHost));
        EXPECT(t[0] > 0, "clock64 difference %lld", t[0]);
        ok("clock64() advances (%lld ticks over a 1000-iteration loop)", t[0]);
        CHECK(cudaFree(dt));
    }

    // Out-of-bounds write: cudaErrorIllegalAddress at the next synchronisation.
    {
        int *dx;
        CHECK(cudaMalloc(&dx, 1024));
        write_far<<<1, 32>>>(dx);
        CHECK(cudaGetLastError());
        cudaError_t e = cudaDeviceSynchronize();
        EXPECT(e == cudaErrorIllegalAddress, "cudaDeviceSynchronize after an out-of-bounds write gave %d (%s)", (int)e, cudaGetErrorName(e));
        ok("out-of-bounds write -> cudaErrorIllegalAddress at the next synchronisation");
    }
    return test_end();
}
