// Copies a recognisable payload to the device and back (the TLS test looks
// for it on the wire: it must not be there when the planes are under TLS).
#include <cuda_runtime.h>
#include <cstring>
#include <vector>
#include "check.h"

int main() {
    test_begin("rt_tls_canary");
    const char tag[] = "rgpu-tls-canary:";
    const size_t n = 1u << 20;
    std::vector<char> src(n), dst(n, 0);
    for (size_t i = 0; i < n; i++) src[i] = tag[i % (sizeof tag - 1)];
    char *d = nullptr;
    CHECK(cudaMalloc((void **)&d, n));
    CHECK(cudaMemcpy(d, src.data(), n, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dst.data(), d, n, cudaMemcpyDeviceToHost));
    EXPECT(memcmp(src.data(), dst.data(), n) == 0, "the payload came back changed");
    ok("1 MiB payload to the device and back");
    CHECK(cudaFree(d));
    return test_end();
}
