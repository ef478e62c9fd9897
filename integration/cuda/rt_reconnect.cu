// Runs rounds of a large copy each way, a batch of asynchronous work
// (kernel launches with asynchronous copies from a pageable buffer the
// program rewrites right after each call), and asynchronous 1 MiB copies
// from page-locked buffers (which the shim sends without waiting and, after
// a cut, sends again from those buffers), checking every result. The
// harness cuts the connection (a proxy between the shim and the server)
// after the "copying", "launching" and "pinned" lines; the program must see
// no error and every result must be right. Exit 0: all rounds right.
// Exit 1: a CUDA call failed or a result was wrong.
#include <cuda_runtime.h>
#include <algorithm>
#include <vector>
#include "check.h"

__global__ void add(int *a, int n, int k) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] += k;
}

int main(int argc, char **argv) {
    test_begin("rt_reconnect");
    int rounds = (int)arg_ll(argc, argv, "--rounds", 3);
    const size_t big = (size_t)arg_ll(argc, argv, "--copy-mib", 64) << 20;
    const int n = 4096, launches = 300, every = 10;
    std::vector<unsigned char> h(big), back(big);
    std::vector<int> hv(n), piece(n);
    unsigned char *d = nullptr;
    int *a = nullptr, *b = nullptr;
    CHECK(cudaMalloc(&d, big));
    CHECK(cudaMalloc(&a, n * sizeof(int)));
    CHECK(cudaMalloc(&b, (size_t)(launches / every) * n * sizeof(int)));
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    const int pieces = 16;
    const size_t mib = 1 << 20;
    unsigned char *pinned[pieces];
    for (int i = 0; i < pieces; i++) CHECK(cudaMallocHost((void **)&pinned[i], mib));
    unsigned char *dp = nullptr;
    CHECK(cudaMalloc(&dp, pieces * mib));
    for (int r = 0; r < rounds; r++) {
        fill_pattern(h.data(), big, 100 + r);
        printf("copying %d\n", r);
        fflush(stdout);
        CHECK(cudaMemcpy(d, h.data(), big, cudaMemcpyHostToDevice));
        memset(back.data(), 0, big);
        CHECK(cudaMemcpy(back.data(), d, big, cudaMemcpyDeviceToHost));
        long long bad = check_pattern(back.data(), big, 100 + r);
        EXPECT(bad < 0, "round %d: byte %lld of the %zu-byte copy is wrong", r, bad, big);
        ok("round %d: %zu bytes there and back", r, big);

        CHECK(cudaMemsetAsync(a, 0, n * sizeof(int), s));
        printf("launching %d\n", r);
        fflush(stdout);
        long long want = 0;
        for (int i = 0; i < launches; i++) {
            int k = i % 7 + 1;
            add<<<(n + 255) / 256, 256, 0, s>>>(a, n, k);
            want += k;
            if (i % every == 0) {
                for (int j = 0; j < n; j++) piece[j] = r * 1000000 + i * 1000 + j % 1000;
                CHECK(cudaMemcpyAsync(b + (size_t)(i / every) * n, piece.data(), n * sizeof(int), cudaMemcpyHostToDevice, s));
                // Pageable memory: the program may reuse it once the call returned.
                std::fill(piece.begin(), piece.end(), -1);
            }
        }
        CHECK(cudaGetLastError());
        CHECK(cudaStreamSynchronize(s));
        CHECK(cudaMemcpy(hv.data(), a, n * sizeof(int), cudaMemcpyDeviceToHost));
        for (int j = 0; j < n; j++) EXPECT(hv[j] == want, "round %d: a[%d] = %d, want %lld (a launch lost or run twice)", r, j, hv[j], want);
        for (int i = 0; i < launches; i += every) {
            CHECK(cudaMemcpy(piece.data(), b + (size_t)(i / every) * n, n * sizeof(int), cudaMemcpyDeviceToHost));
            for (int j = 0; j < n; j++)
                EXPECT(piece[j] == r * 1000000 + i * 1000 + j % 1000, "round %d: copy %d element %d = %d", r, i / every, j, piece[j]);
        }
        ok("round %d: %d launches and %d asynchronous copies", r, launches, launches / every);

        for (int i = 0; i < pieces; i++) fill_pattern(pinned[i], mib, 1000 * r + i);
        printf("pinned %d\n", r);
        fflush(stdout);
        for (int i = 0; i < pieces; i++) CHECK(cudaMemcpyAsync(dp + i * mib, pinned[i], mib, cudaMemcpyHostToDevice, s));
        CHECK(cudaStreamSynchronize(s));
        // Completed: the program may change the page-locked buffers now.
        for (int i = 0; i < pieces; i++) memset(pinned[i], 0, mib);
        for (int i = 0; i < pieces; i++) {
            CHECK(cudaMemcpy(back.data(), dp + i * mib, mib, cudaMemcpyDeviceToHost));
            long long bad = check_pattern(back.data(), mib, 1000 * r + i);
            EXPECT(bad < 0, "round %d: byte %lld of page-locked piece %d is wrong", r, bad, i);
        }
        ok("round %d: %d asynchronous copies of 1 MiB from page-locked memory", r, pieces);
    }
    for (int i = 0; i < pieces; i++) CHECK(cudaFreeHost(pinned[i]));
    CHECK(cudaFree(dp));
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFree(d));
    CHECK(cudaFree(a));
    CHECK(cudaFree(b));
    return test_end();
}
