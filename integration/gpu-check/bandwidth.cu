// gpu-check: host<->device copy bandwidth, pinned and pageable host memory,
// 4 KiB .. MAX (default 256 MiB), each size x4. Prints one line per cell:
//   bw <h2d|d2h> <pinned|pageable> <bytes> <MiB/s>
// then checks the bytes of a round trip and prints PASS bandwidth.
// Usage: bandwidth [MAX_BYTES]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

#define CK(x)                                                                        \
    do {                                                                             \
        cudaError_t e_ = (x);                                                        \
        if (e_ != cudaSuccess) {                                                     \
            fprintf(stderr, "FAIL %s: %s\n", #x, cudaGetErrorString(e_));            \
            return 1;                                                                \
        }                                                                            \
    } while (0)

static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char **argv) {
    size_t max = argc > 1 ? strtoull(argv[1], nullptr, 0) : (256u << 20);
    if (max < 4096) max = 4096;
    void *dev = nullptr, *pinned = nullptr;
    CK(cudaMalloc(&dev, max));
    CK(cudaMallocHost(&pinned, max));
    char *pageable = (char *)malloc(max);
    if (!pageable) { fprintf(stderr, "FAIL malloc\n"); return 1; }
    memset(pageable, 1, max);
    memset(pinned, 2, max);
    for (size_t size = 4096; size <= max; size *= 4) {
        // About 64 MiB per cell, at least 3 copies, at most 200.
        size_t reps = (64u << 20) / size;
        reps = reps < 3 ? 3 : (reps > 200 ? 200 : reps);
        for (int m = 0; m < 2; m++) {
            char *host = m == 0 ? (char *)pinned : pageable;
            for (int d = 0; d < 2; d++) {
                auto kind = d == 0 ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
                void *dst = d == 0 ? dev : (void *)host;
                const void *src = d == 0 ? (const void *)host : dev;
                CK(cudaMemcpy(dst, src, size, kind));  // warm-up
                CK(cudaDeviceSynchronize());
                double t0 = now();
                for (size_t r = 0; r < reps; r++) CK(cudaMemcpy(dst, src, size, kind));
                CK(cudaDeviceSynchronize());
                double secs = now() - t0;
                printf("bw %s %s %zu %.1f\n", d == 0 ? "h2d" : "d2h", m == 0 ? "pinned" : "pageable", size,
                       (double)size * reps / secs / (1 << 20));
                fflush(stdout);
            }
        }
    }
    // A round trip keeps every byte.
    for (size_t i = 0; i < max; i++) pageable[i] = (char)(i * 7 + 3);
    CK(cudaMemcpy(dev, pageable, max, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(pinned, dev, max, cudaMemcpyDeviceToHost));
    if (memcmp(pinned, pageable, max) != 0) { fprintf(stderr, "FAIL round trip bytes differ\n"); return 1; }
    CK(cudaFree(dev));
    CK(cudaFreeHost(pinned));
    free(pageable);
    printf("PASS bandwidth\n");
    return 0;
}
