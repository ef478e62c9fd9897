// Module globals: __device__ / __constant__ variables read with
// cudaMemcpyFromSymbol, written with cudaMemcpyToSymbol, and reached through
// cudaGetSymbolAddress + cudaMemcpy. The module is loaded on the server; no
// kernel runs.
#include <cuda_runtime.h>
#include "check.h"

#define V1(i) ((i) * 7 + 3)
#define V4(i) V1(i), V1(i + 1), V1(i + 2), V1(i + 3)
#define V16(i) V4(i), V4(i + 4), V4(i + 8), V4(i + 12)
#define V64(i) V16(i), V16(i + 16), V16(i + 32), V16(i + 48)
#define V256(i) V64(i), V64(i + 64), V64(i + 128), V64(i + 192)

__device__ int table[256] = {V256(0)};
__device__ int zeros[1000];
__device__ double dval = -2.5;
__constant__ float coef[8] = {1, 2, 3, 4, 5, 6, 7, 8};
struct Pair { int a; double b; };
__device__ Pair pair = {3, 6.5};

// A kernel that uses the globals keeps them in the module.
__global__ void touch(int *out) {
    out[0] = table[threadIdx.x] + zeros[threadIdx.x] + (int)dval + (int)coef[threadIdx.x % 8] + pair.a;
}

int main() {
    test_begin("rt_globals");
    int h[256];
    memset(h, 0, sizeof h);
    CHECK(cudaMemcpyFromSymbol(h, table, sizeof h));
    for (int i = 0; i < 256; i++) EXPECT(h[i] == V1(i), "table[%d] = %d, expected %d", i, h[i], V1(i));
    ok("cudaMemcpyFromSymbol reads the initialised __device__ int table[256]");

    size_t sz = 0;
    CHECK(cudaGetSymbolSize(&sz, table));
    EXPECT(sz == sizeof(int) * 256, "cudaGetSymbolSize(table) = %zu", sz);
    ok("cudaGetSymbolSize(table) = %zu", sz);

    int part[10];
    CHECK(cudaMemcpyFromSymbol(part, table, sizeof part, 100 * sizeof(int)));
    for (int i = 0; i < 10; i++) EXPECT(part[i] == V1(100 + i), "table[%d] via offset = %d", 100 + i, part[i]);
    ok("cudaMemcpyFromSymbol with an offset");

    int w[256];
    for (int i = 0; i < 256; i++) w[i] = -i * 11;
    CHECK(cudaMemcpyToSymbol(table, w, sizeof w));
    CHECK(cudaMemcpyFromSymbol(h, table, sizeof h));
    for (int i = 0; i < 256; i++) EXPECT(h[i] == -i * 11, "after cudaMemcpyToSymbol table[%d] = %d", i, h[i]);
    ok("cudaMemcpyToSymbol writes the whole table");

    int five[5] = {9, 8, 7, 6, 5};
    CHECK(cudaMemcpyToSymbol(table, five, sizeof five, 200 * sizeof(int)));
    CHECK(cudaMemcpyFromSymbol(h, table, sizeof h));
    for (int i = 0; i < 256; i++) {
        int want = (i >= 200 && i < 205) ? five[i - 200] : -i * 11;
        EXPECT(h[i] == want, "after offset cudaMemcpyToSymbol table[%d] = %d, expected %d", i, h[i], want);
    }
    ok("cudaMemcpyToSymbol with an offset touches only its range");

    int *addr = nullptr;
    CHECK(cudaGetSymbolAddress((void **)&addr, table));
    EXPECT(addr != nullptr, "cudaGetSymbolAddress gave NULL");
    int one = 0;
    CHECK(cudaMemcpy(&one, addr + 201, sizeof one, cudaMemcpyDeviceToHost));
    EXPECT(one == 8, "table[201] through the symbol address = %d", one);
    int neg = -777;
    CHECK(cudaMemcpy(addr + 3, &neg, sizeof neg, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpyFromSymbol(&one, table, sizeof one, 3 * sizeof(int)));
    EXPECT(one == -777, "cudaMemcpy to the symbol address not seen by cudaMemcpyFromSymbol: %d", one);
    ok("cudaGetSymbolAddress + cudaMemcpy both ways");

    cudaPointerAttributes pa;
    memset(&pa, 0, sizeof pa);
    CHECK(cudaPointerGetAttributes(&pa, addr));
    EXPECT(pa.type == cudaMemoryTypeDevice, "symbol address has pointer type %d", (int)pa.type);
    ok("the symbol address is device memory");

    // D2D between a global and an allocation.
    int *buf = nullptr;
    CHECK(cudaMalloc((void **)&buf, sizeof(int) * 256));
    CHECK(cudaMemcpy(buf, addr, sizeof(int) * 256, cudaMemcpyDeviceToDevice));
    CHECK(cudaMemcpyToSymbol(table, buf, sizeof(int) * 16, 0, cudaMemcpyDeviceToDevice));
    CHECK(cudaMemcpy(h, buf, sizeof(int) * 256, cudaMemcpyDeviceToHost));
    EXPECT(h[3] == -777 && h[201] == 8 && h[255] == -255 * 11, "D2D from the symbol: %d %d %d", h[3], h[201], h[255]);
    CHECK(cudaFree(buf));
    ok("D2D copies between a global and cudaMalloc memory");

    int z[1000];
    memset(z, 0x55, sizeof z);
    CHECK(cudaMemcpyFromSymbol(z, zeros, sizeof z));
    for (int i = 0; i < 1000; i++) EXPECT(z[i] == 0, "uninitialised global zeros[%d] = %d", i, z[i]);
    ok("uninitialised __device__ array reads as zero");

    double dv = 0;
    CHECK(cudaMemcpyFromSymbol(&dv, dval, sizeof dv));
    EXPECT(dv == -2.5, "dval = %f", dv);
    float c[8];
    CHECK(cudaMemcpyFromSymbol(c, coef, sizeof c));
    for (int i = 0; i < 8; i++) EXPECT(c[i] == (float)(i + 1), "coef[%d] = %f", i, c[i]);
    float c2[8] = {10, 20, 30, 40, 50, 60, 70, 80};
    CHECK(cudaMemcpyToSymbol(coef, c2, sizeof c2));
    CHECK(cudaMemcpyFromSymbol(c, coef, sizeof c));
    for (int i = 0; i < 8; i++) EXPECT(c[i] == c2[i], "coef[%d] after write = %f", i, c[i]);
    Pair pr = {0, 0};
    CHECK(cudaMemcpyFromSymbol(&pr, pair, sizeof pr));
    EXPECT(pr.a == 3 && pr.b == 6.5, "pair = {%d, %f}", pr.a, pr.b);
    ok("double, __constant__ float[8] (read and write), struct globals");

    // Async symbol copies on a stream.
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    int aw[4] = {41, 42, 43, 44}, ar[4] = {0, 0, 0, 0};
    CHECK(cudaMemcpyToSymbolAsync(table, aw, sizeof aw, 0, cudaMemcpyHostToDevice, s));
    CHECK(cudaMemcpyFromSymbolAsync(ar, table, sizeof ar, 0, cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    for (int i = 0; i < 4; i++) EXPECT(ar[i] == aw[i], "async symbol copy [%d] = %d", i, ar[i]);
    CHECK(cudaStreamDestroy(s));
    ok("cudaMemcpyToSymbolAsync / cudaMemcpyFromSymbolAsync");

    // Past the end of a symbol.
    CHECK_ERR(cudaMemcpyToSymbol(table, w, sizeof w, 4), cudaErrorInvalidValue);
    cudaGetLastError();
    ok("cudaMemcpyToSymbol past the end of the symbol -> cudaErrorInvalidValue");
    return test_end();
}
