// Copies in a loop until an error appears. The harness kills the server
// after the "looping" line; the program must then see an error (not hang)
// and exit non-zero. Exit 2: error seen (the expected outcome).
// Exit 3: no error within --max-seconds (default 120). Exit 4: wrong data
// without an error.
#include <cuda_runtime.h>
#include <ctime>
#include <vector>
#include "check.h"

int main(int argc, char **argv) {
    test_begin("rt_killed");
    long long max_s = arg_ll(argc, argv, "--max-seconds", 120);
    const size_t n = 1u << 20;
    std::vector<unsigned char> h(n), back(n);
    fill_pattern(h.data(), n, 5);
    void *d = nullptr;
    CHECK(cudaMalloc(&d, n));
    CHECK(cudaMemcpy(d, h.data(), n, cudaMemcpyHostToDevice));
    ok("connected, first copy done");
    printf("looping\n");
    fflush(stdout);

    time_t start = time(nullptr);
    for (long long it = 0;; it++) {
        cudaError_t e = cudaMemcpy(d, h.data(), n, cudaMemcpyHostToDevice);
        if (e == cudaSuccess) e = cudaMemcpy(back.data(), d, n, cudaMemcpyDeviceToHost);
        if (e != cudaSuccess) {
            printf("error after %lld iterations: %d %s: %s\n", it, (int)e, cudaGetErrorName(e), cudaGetErrorString(e));
            fflush(stdout);
            // Later calls must fail promptly too, not hang.
            cudaError_t e2 = cudaMemcpy(back.data(), d, n, cudaMemcpyDeviceToHost);
            printf("next call: %d %s\n", (int)e2, cudaGetErrorName(e2));
            fflush(stdout);
            return 2;
        }
        if (memcmp(h.data(), back.data(), n) != 0) {
            printf("wrong data without an error at iteration %lld\n", it);
            return 4;
        }
        if (time(nullptr) - start > max_s) {
            printf("no error within %lld s\n", max_s);
            return 3;
        }
    }
}
