// cudaMemcpy in every direction, sizes 1 B .. 64 MiB, unaligned offsets,
// cudaMemcpyDefault, and cudaMemcpyAsync on a stream with pageable memory.
#include <cuda_runtime.h>
#include <vector>
#include "check.h"

static const size_t SIZES[] = {1, 2, 3, 7, 64, 255, 4096, 65537, (1u << 20) + 7, 16u << 20, 64u << 20};

int main() {
    test_begin("rt_copy");
    const size_t maxn = 64u << 20;
    const size_t slack = 64; // room for unaligned offsets
    std::vector<unsigned char> src(maxn + slack), dst(maxn + slack);
    char *d1 = nullptr, *d2 = nullptr;
    CHECK(cudaMalloc((void **)&d1, maxn + slack));
    CHECK(cudaMalloc((void **)&d2, maxn + slack));

    uint32_t seed = 1;
    for (size_t n : SIZES) {
        // H2D, D2D, D2H
        fill_pattern(src.data(), n, seed);
        memset(dst.data(), 0, n);
        CHECK(cudaMemcpy(d1, src.data(), n, cudaMemcpyHostToDevice));
        CHECK(cudaMemcpy(d2, d1, n, cudaMemcpyDeviceToDevice));
        CHECK(cudaMemcpy(dst.data(), d2, n, cudaMemcpyDeviceToHost));
        long long bad = check_pattern(dst.data(), n, seed);
        EXPECT(bad < 0, "H2D/D2D/D2H of %zu bytes: byte %lld wrong", n, bad);
        seed++;

        // Same with cudaMemcpyDefault (UVA decides the direction).
        fill_pattern(src.data(), n, seed);
        memset(dst.data(), 0, n);
        CHECK(cudaMemcpy(d1, src.data(), n, cudaMemcpyDefault));
        CHECK(cudaMemcpy(d2, d1, n, cudaMemcpyDefault));
        CHECK(cudaMemcpy(dst.data(), d2, n, cudaMemcpyDefault));
        bad = check_pattern(dst.data(), n, seed);
        EXPECT(bad < 0, "cudaMemcpyDefault round trip of %zu bytes: byte %lld wrong", n, bad);
        seed++;
        ok("%zu bytes: H2D, D2D, D2H and cudaMemcpyDefault round trips", n);
    }

    // Unaligned offsets on both sides, and a copy into the middle of a buffer
    // must leave the bytes around it alone.
    const size_t offs[] = {1, 3, 5, 13, 33};
    for (size_t ho : offs)
        for (size_t dofs : offs) {
            size_t n = 1000 + ho * 7 + dofs;
            CHECK(cudaMemset(d1, 0xEE, 4096));
            fill_pattern(src.data() + ho, n, seed);
            CHECK(cudaMemcpy(d1 + dofs, src.data() + ho, n, cudaMemcpyHostToDevice));
            CHECK(cudaMemcpy(d2 + (dofs ^ 1), d1 + dofs, n, cudaMemcpyDeviceToDevice));
            memset(dst.data(), 0, 4096);
            CHECK(cudaMemcpy(dst.data() + ho, d2 + (dofs ^ 1), n, cudaMemcpyDeviceToHost));
            long long bad = check_pattern(dst.data() + ho, n, seed);
            EXPECT(bad < 0, "host offset %zu, device offset %zu, %zu bytes: byte %lld wrong", ho, dofs, n, bad);
            CHECK(cudaMemcpy(dst.data(), d1, 4096, cudaMemcpyDeviceToHost));
            EXPECT(check_bytes(dst.data(), dofs, 0xEE) < 0, "bytes before device offset %zu clobbered", dofs);
            EXPECT(check_bytes(dst.data() + dofs + n, 4096 - dofs - n, 0xEE) < 0,
                   "bytes after a %zu-byte copy at device offset %zu clobbered", n, dofs);
            seed++;
        }
    ok("unaligned host/device offsets, neighbouring bytes untouched");

    // Async copies on a stream, pageable host memory.
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    for (size_t n : SIZES) {
        fill_pattern(src.data(), n, seed);
        memset(dst.data(), 0, n);
        CHECK(cudaMemcpyAsync(d1 + 1, src.data(), n, cudaMemcpyHostToDevice, s));
        CHECK(cudaMemcpyAsync(d2, d1 + 1, n, cudaMemcpyDeviceToDevice, s));
        CHECK(cudaMemcpyAsync(dst.data(), d2, n, cudaMemcpyDeviceToHost, s));
        CHECK(cudaStreamSynchronize(s));
        long long bad = check_pattern(dst.data(), n, seed);
        EXPECT(bad < 0, "async round trip of %zu bytes: byte %lld wrong", n, bad);
        seed++;
    }
    ok("cudaMemcpyAsync H2D/D2D/D2H on a stream, all sizes");
    // Async on the legacy default stream.
    fill_pattern(src.data(), 12345, seed);
    CHECK(cudaMemcpyAsync(d1, src.data(), 12345, cudaMemcpyHostToDevice, 0));
    CHECK(cudaMemcpyAsync(dst.data(), d1, 12345, cudaMemcpyDeviceToHost, 0));
    CHECK(cudaDeviceSynchronize());
    EXPECT(check_pattern(dst.data(), 12345, seed) < 0, "async copy on stream 0 wrong");
    ok("cudaMemcpyAsync on the default stream + cudaDeviceSynchronize");
    CHECK(cudaStreamDestroy(s));

    // Zero-byte copies are no-ops that succeed.
    CHECK(cudaMemcpy(d1, src.data(), 0, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dst.data(), d1, 0, cudaMemcpyDeviceToHost));
    ok("zero-byte copies succeed");

    CHECK(cudaFree(d1));
    CHECK(cudaFree(d2));
    return test_end();
}
