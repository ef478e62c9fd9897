// Built with `--default-stream per-thread`: cudart then calls the driver's
// per-thread entry points (cuMemcpy*_ptds, cuMemset*_ptsz, cuLaunchKernel_ptsz,
// cuStream*_ptsz, ...) wherever the program names stream 0. Each is exercised
// and its result checked, from two host threads at once, each on its own
// default stream.
#include <cuda_runtime.h>
#include <thread>
#include <vector>
#include "check.h"

__global__ void scale(int *p, int k, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] *= k;
}

static void CUDART_CB bump(void *p) { ++*(int *)p; }

static const int N = 1 << 14;

// The whole round of per-thread calls; `seed` keeps the two threads' data apart.
static void round_trip(uint32_t seed, const char *who) {
    std::vector<int> in(N), out(N);
    for (int i = 0; i < N; i++) in[i] = (int)(seed * 1000 + i);
    int *d = nullptr;
    CHECK(cudaMalloc((void **)&d, N * sizeof(int)));
    CHECK(cudaMemcpy(d, in.data(), N * sizeof(int), cudaMemcpyHostToDevice));  // cuMemcpyHtoD_v2_ptds
    scale<<<(N + 255) / 256, 256>>>(d, 3, N);                                 // cuLaunchKernel_ptsz
    CHECK(cudaGetLastError());
    int calls = 0;
    CHECK(cudaLaunchHostFunc(0, bump, &calls));  // cuLaunchHostFunc_ptsz
    CHECK(cudaMemcpyAsync(out.data(), d, N * sizeof(int), cudaMemcpyDeviceToHost, 0));
    CHECK(cudaStreamSynchronize(0));  // cuStreamSynchronize_ptsz
    for (int i = 0; i < N; i++) EXPECT(out[i] == in[i] * 3, "%s: element %d is %d, expected %d", who, i, out[i], in[i] * 3);
    EXPECT(calls == 1, "%s: the host function ran %d times", who, calls);

    // Memsets, 1-D and 2-D, synchronous and on stream 0.
    CHECK(cudaMemset(d, 0x11, N * sizeof(int)));                      // cuMemsetD8_v2_ptds
    CHECK(cudaMemsetAsync(d, 0x22, 64 * sizeof(int), 0));             // cuMemsetD8Async_ptsz
    CHECK(cudaMemset2D(d + 128, 64 * sizeof(int), 0x33, 16, 4));      // cuMemsetD2D8_v2_ptds
    CHECK(cudaMemset2DAsync(d + 1024, 64 * sizeof(int), 0x44, 8, 2, 0));  // cuMemsetD2D8Async_ptsz
    CHECK(cudaMemcpy(out.data(), d, N * sizeof(int), cudaMemcpyDeviceToHost));
    std::vector<unsigned char> want(N * sizeof(int), 0x11);
    for (size_t i = 0; i < 64 * sizeof(int); i++) want[i] = 0x22;
    for (size_t r = 0; r < 4; r++)
        for (size_t c = 0; c < 16; c++) want[128 * sizeof(int) + r * 64 * sizeof(int) + c] = 0x33;
    for (size_t r = 0; r < 2; r++)
        for (size_t c = 0; c < 8; c++) want[1024 * sizeof(int) + r * 64 * sizeof(int) + c] = 0x44;
    const unsigned char *b = (const unsigned char *)out.data();
    for (size_t i = 0; i < want.size(); i++)
        EXPECT(b[i] == want[i], "%s: memset byte %zu is 0x%02x, expected 0x%02x", who, i, b[i], want[i]);

    // A peer copy (to the same device) and a 2-D copy, synchronous and on stream 0.
    int *e = nullptr;
    CHECK(cudaMalloc((void **)&e, N * sizeof(int)));
    CHECK(cudaMemcpy(d, in.data(), N * sizeof(int), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpyPeer(e, 0, d, 0, N * sizeof(int)));  // cuMemcpyPeer_ptds
    CHECK(cudaMemcpy(out.data(), e, N * sizeof(int), cudaMemcpyDeviceToHost));
    EXPECT(out == in, "%s: cudaMemcpyPeer copied other data", who);
    CHECK(cudaMemset(e, 0, N * sizeof(int)));
    CHECK(cudaMemcpyPeerAsync(e, 0, d, 0, N * sizeof(int), 0));  // cuMemcpyPeerAsync_ptsz
    CHECK(cudaMemcpy2DAsync(out.data(), 8, e, 8, 8, N / 2, cudaMemcpyDeviceToHost, 0));
    CHECK(cudaStreamSynchronize(0));
    EXPECT(out == in, "%s: cudaMemcpyPeerAsync then cudaMemcpy2DAsync copied other data", who);

    // Stream 0's own properties.
    unsigned long long id = 0;
    CHECK(cudaStreamGetId(0, &id));  // cuStreamGetId_ptsz
    int device = -1;
    CHECK(cudaStreamGetDevice(0, &device));  // cuStreamGetDevice_ptsz
    EXPECT(device == 0, "%s: stream 0 is on device %d", who, device);
    unsigned flags = 99;
    CHECK(cudaStreamGetFlags(0, &flags));
    int prio = 99;
    CHECK(cudaStreamGetPriority(0, &prio));
    CHECK(cudaStreamQuery(0));

    cudaEvent_t ev;
    CHECK(cudaEventCreate(&ev));
    CHECK(cudaEventRecord(ev, 0));  // cuEventRecord_ptsz
    CHECK(cudaEventSynchronize(ev));
    CHECK(cudaEventDestroy(ev));
    void *a = nullptr;
    CHECK(cudaMallocAsync(&a, 4096, 0));  // cuMemAllocAsync_ptsz
    CHECK(cudaMemsetAsync(a, 7, 4096, 0));
    CHECK(cudaFreeAsync(a, 0));  // cuMemFreeAsync_ptsz
    CHECK(cudaStreamSynchronize(0));
    CHECK(cudaFree(d));
    CHECK(cudaFree(e));
}

int main() {
    test_begin("rt_per_thread");
    round_trip(1, "main thread");
    ok("copies, kernels, host functions, memsets (1-D and 2-D), peer copies and stream queries on the per-thread stream");
    std::thread t1(round_trip, 2u, "thread one"), t2(round_trip, 3u, "thread two");
    t1.join();
    t2.join();
    ok("the same from two threads at once, each on its own default stream");
    return test_end();
}
