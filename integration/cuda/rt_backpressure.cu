// An asynchronous device-to-host copy larger than the socket buffers, then
// many small asynchronous calls before any synchronisation: the server is
// busy writing the copy's bytes while the program keeps sending. Neither side
// may stall on full socket buffers (regression: the shim once did not read
// while it sent, and both ends waited until the connection timed out).
#include <cuda_runtime.h>
#include "check.h"

int main() {
    test_begin("rt_backpressure");
    const size_t n = 128u << 20;
    unsigned *d = nullptr, *h = nullptr;
    CHECK(cudaMalloc(&d, n));
    CHECK(cudaMallocHost(&h, n));
    CHECK(cudaMemset(d, 0x5a, n));
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    CHECK(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, s));
    // About 20 MB of requests behind the copy, none of them synchronising.
    for (int i = 0; i < 200000; i++) CHECK(cudaMemsetAsync(d, 0x11, 64, s));
    CHECK(cudaStreamSynchronize(s));
    for (size_t i = 0; i < n / 4; i += 4097)
        EXPECT(h[i] == 0x5a5a5a5au, "host word %zu is %#x after the async copy", i, h[i]);
    ok("128 MiB async device->host copy followed by 200000 async memsets completed");
    unsigned first = 0;
    CHECK(cudaMemcpy(&first, d, 4, cudaMemcpyDeviceToHost));
    EXPECT(first == 0x11111111u, "memsets after the copy did not land: %#x", first);
    ok("the memsets after the copy landed in order");
    CHECK(cudaFreeHost(h));
    CHECK(cudaFree(d));
    CHECK(cudaStreamDestroy(s));
    return test_end();
}
