// cudaMemset and cudaMemsetAsync: values, partial and unaligned ranges.
#include <cuda_runtime.h>
#include <vector>
#include "check.h"

int main() {
    test_begin("rt_memset");
    const size_t n = (4u << 20) + 13;
    std::vector<unsigned char> h(n);
    unsigned char *d = nullptr;
    CHECK(cudaMalloc((void **)&d, n));

    const int vals[] = {0, 0xFF, 0x5A, 1, 0x1234 /* only the low byte counts */};
    for (int v : vals) {
        CHECK(cudaMemset(d, v, n));
        CHECK(cudaMemcpy(h.data(), d, n, cudaMemcpyDeviceToHost));
        long long bad = check_bytes(h.data(), n, (unsigned char)v);
        EXPECT(bad < 0, "cudaMemset(0x%x) over %zu bytes: byte %lld is 0x%02x", v, n, bad,
               bad >= 0 ? h[bad] : 0);
        ok("cudaMemset value 0x%x over %zu bytes", v, n);
    }

    // Partial, unaligned ranges keep their neighbours.
    CHECK(cudaMemset(d, 0x11, 8192));
    CHECK(cudaMemset(d + 3, 0x22, 1));
    CHECK(cudaMemset(d + 7, 0x33, 5));
    CHECK(cudaMemset(d + 101, 0x44, 4000));
    CHECK(cudaMemcpy(h.data(), d, 8192, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < 8192; i++) {
        unsigned char want = 0x11;
        if (i == 3) want = 0x22;
        else if (i >= 7 && i < 12) want = 0x33;
        else if (i >= 101 && i < 4101) want = 0x44;
        EXPECT(h[i] == want, "byte %zu is 0x%02x, expected 0x%02x", i, h[i], want);
    }
    ok("partial unaligned cudaMemset ranges leave neighbours alone");

    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    CHECK(cudaMemsetAsync(d, 0x77, n, s));
    CHECK(cudaMemsetAsync(d + 1000, 0x88, 1000, s));
    CHECK(cudaMemcpyAsync(h.data(), d, n, cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    for (size_t i = 0; i < n; i++) {
        unsigned char want = (i >= 1000 && i < 2000) ? 0x88 : 0x77;
        EXPECT(h[i] == want, "after cudaMemsetAsync byte %zu is 0x%02x, expected 0x%02x", i, h[i], want);
    }
    ok("cudaMemsetAsync on a stream is ordered with the copy after it");
    CHECK(cudaStreamDestroy(s));

    // 2D memset on a pitched allocation.
    void *p2 = nullptr;
    size_t pitch = 0;
    CHECK(cudaMallocPitch(&p2, &pitch, 100, 8));
    CHECK(cudaMemset(p2, 0, pitch * 8));
    CHECK(cudaMemset2D(p2, pitch, 0x3C, 50, 8));
    std::vector<unsigned char> row(pitch * 8);
    CHECK(cudaMemcpy(row.data(), p2, pitch * 8, cudaMemcpyDeviceToHost));
    for (size_t r = 0; r < 8; r++)
        for (size_t c = 0; c < 100; c++) {
            unsigned char want = c < 50 ? 0x3C : 0;
            EXPECT(row[r * pitch + c] == want, "2D memset row %zu col %zu is 0x%02x", r, c, row[r * pitch + c]);
        }
    CHECK(cudaFree(p2));
    ok("cudaMemset2D on a pitched allocation (pitch %zu)", pitch);

    CHECK(cudaFree(d));
    return test_end();
}
