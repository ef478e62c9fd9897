// Two devices (from two servers, or two devices of one server): select each,
// allocate and copy on each, check they are distinct.
// Options: --require-peer  fail (instead of skipping) when cudaMemcpyPeer fails.
#include <cuda_runtime.h>
#include <vector>
#include "check.h"

int main(int argc, char **argv) {
    test_begin("rt_two_devices");
    bool require_peer = arg_flag(argc, argv, "--require-peer");
    int n = 0;
    CHECK(cudaGetDeviceCount(&n));
    EXPECT(n == 2, "cudaGetDeviceCount = %d, expected 2", n);
    ok("two devices");

    cudaDeviceProp p0, p1;
    CHECK(cudaGetDeviceProperties(&p0, 0));
    CHECK(cudaGetDeviceProperties(&p1, 1));
    EXPECT(memcmp(p0.uuid.bytes, p1.uuid.bytes, 16) != 0, "devices 0 and 1 have the same UUID");
    ok("devices have different UUIDs ('%s', '%s')", p0.name, p1.name);
    // The harness gives the devices different memory sizes to check their order.
    ok("device 0 totalGlobalMem %zu", p0.totalGlobalMem);
    ok("device 1 totalGlobalMem %zu", p1.totalGlobalMem);

    const size_t sz = (4u << 20) + 3;
    std::vector<unsigned char> h(sz), back(sz);
    unsigned char *d[2] = {nullptr, nullptr};
    for (int dev = 0; dev < 2; dev++) {
        CHECK(cudaSetDevice(dev));
        int cur = -1;
        CHECK(cudaGetDevice(&cur));
        EXPECT(cur == dev, "cudaGetDevice = %d after cudaSetDevice(%d)", cur, dev);
        CHECK(cudaMalloc((void **)&d[dev], sz));
        fill_pattern(h.data(), sz, 10 + dev);
        CHECK(cudaMemcpy(d[dev], h.data(), sz, cudaMemcpyHostToDevice));
        cudaPointerAttributes a;
        memset(&a, 0, sizeof a);
        CHECK(cudaPointerGetAttributes(&a, d[dev]));
        EXPECT(a.type == cudaMemoryTypeDevice && a.device == dev, "allocation on device %d: type %d device %d",
               dev, (int)a.type, a.device);
        ok("device %d: cudaSetDevice, cudaMalloc, H2D, pointer attributes", dev);
    }
    // Read both back, each with its own device current, then each with the
    // other device current (UVA lets cudaMemcpyDefault find the owner).
    for (int dev = 0; dev < 2; dev++) {
        CHECK(cudaSetDevice(dev));
        CHECK(cudaMemcpy(back.data(), d[dev], sz, cudaMemcpyDeviceToHost));
        long long bad = check_pattern(back.data(), sz, 10 + dev);
        EXPECT(bad < 0, "device %d data wrong at byte %lld", dev, bad);
    }
    ok("each device holds its own data");

    // Streams and D2D on each device.
    for (int dev = 0; dev < 2; dev++) {
        CHECK(cudaSetDevice(dev));
        cudaStream_t s;
        CHECK(cudaStreamCreate(&s));
        unsigned char *tmp = nullptr;
        CHECK(cudaMalloc((void **)&tmp, sz));
        CHECK(cudaMemcpyAsync(tmp, d[dev], sz, cudaMemcpyDeviceToDevice, s));
        CHECK(cudaMemcpyAsync(back.data(), tmp, sz, cudaMemcpyDeviceToHost, s));
        CHECK(cudaStreamSynchronize(s));
        EXPECT(check_pattern(back.data(), sz, 10 + dev) < 0, "device %d: D2D on a stream wrong", dev);
        CHECK(cudaFree(tmp));
        CHECK(cudaStreamDestroy(s));
        CHECK(cudaDeviceSynchronize());
    }
    ok("streams and D2D copies on each device");

    size_t f0 = 0, f1 = 0, t = 0;
    CHECK(cudaSetDevice(0));
    CHECK(cudaMemGetInfo(&f0, &t));
    CHECK(cudaSetDevice(1));
    void *extra = nullptr;
    CHECK(cudaMalloc(&extra, 128u << 20));
    CHECK(cudaSetDevice(0));
    size_t f0b = 0;
    CHECK(cudaMemGetInfo(&f0b, &t));
    EXPECT(f0b == f0, "allocating on device 1 changed device 0's free memory (%zu -> %zu)", f0, f0b);
    CHECK(cudaSetDevice(1));
    CHECK(cudaMemGetInfo(&f1, &t));
    CHECK(cudaFree(extra));
    ok("memory accounting is per device");

    int can01 = -1;
    CHECK(cudaDeviceCanAccessPeer(&can01, 0, 1));
    note("cudaDeviceCanAccessPeer(0, 1) = %d", can01);
    if (can01 == 0) {
        // The answers a driver gives two devices without peer access.
        CHECK(cudaSetDevice(0));
        CHECK_ERR(cudaDeviceEnablePeerAccess(1, 0), cudaErrorPeerAccessUnsupported);
        CHECK_ERR(cudaDeviceDisablePeerAccess(1), cudaErrorPeerAccessNotEnabled);
        (void)cudaGetLastError();
        ok("peer access: cudaErrorPeerAccessUnsupported, and never enabled");
    }
    CHECK(cudaSetDevice(1));
    cudaError_t e = cudaMemcpyPeer(d[1], 1, d[0], 0, sz);
    if (e == cudaSuccess) {
        CHECK(cudaMemcpy(back.data(), d[1], sz, cudaMemcpyDeviceToHost));
        long long bad = check_pattern(back.data(), sz, 10);
        EXPECT(bad < 0, "cudaMemcpyPeer 0 -> 1 succeeded but byte %lld is wrong", bad);
        ok("cudaMemcpyPeer device 0 -> device 1");
    } else {
        EXPECT(!require_peer, "cudaMemcpyPeer gave %d (%s)", (int)e, cudaGetErrorName(e));
        cudaGetLastError();
        printf("SKIP cudaMemcpyPeer: %d (%s)\n", (int)e, cudaGetErrorName(e));
    }

    // A 3-D box from device 0 to device 1 (across servers where each device is its own).
    if (e == cudaSuccess) {
        const size_t rows = 6, slices = 3;
        cudaPitchedPtr v[2];
        for (int dev = 0; dev < 2; dev++) {
            CHECK(cudaSetDevice(dev));
            CHECK(cudaMalloc3D(&v[dev], make_cudaExtent(48, rows, slices)));
        }
        std::vector<unsigned char> h0(v[0].pitch * rows * slices), h1(v[1].pitch * rows * slices);
        fill_pattern(h0.data(), h0.size(), 77);
        CHECK(cudaSetDevice(0));
        CHECK(cudaMemcpy(v[0].ptr, h0.data(), h0.size(), cudaMemcpyHostToDevice));
        CHECK(cudaSetDevice(1));
        CHECK(cudaMemset(v[1].ptr, 0, h1.size()));
        cudaMemcpy3DPeerParms pp = {};
        pp.srcPtr = v[0];
        pp.srcDevice = 0;
        pp.srcPos = make_cudaPos(5, 1, 0);
        pp.dstPtr = v[1];
        pp.dstDevice = 1;
        pp.dstPos = make_cudaPos(0, 0, 1);
        pp.extent = make_cudaExtent(40, 5, 2);
        CHECK(cudaMemcpy3DPeer(&pp));
        CHECK(cudaMemcpy(h1.data(), v[1].ptr, h1.size(), cudaMemcpyDeviceToHost));
        for (size_t z = 0; z < slices; z++)
            for (size_t y = 0; y < rows; y++)
                for (size_t x = 0; x < v[1].pitch; x++) {
                    bool in = z >= 1 && y < 5 && x < 40;
                    unsigned char want = in ? h0[((z - 1) * rows + y + 1) * v[0].pitch + x + 5] : 0;
                    unsigned char got = h1[(z * rows + y) * v[1].pitch + x];
                    EXPECT(got == want, "cudaMemcpy3DPeer: (%zu, %zu, %zu) is 0x%02x, expected 0x%02x", x, y, z, got, want);
                }
        for (int dev = 0; dev < 2; dev++) {
            CHECK(cudaSetDevice(dev));
            CHECK(cudaFree(v[dev].ptr));
        }
        ok("cudaMemcpy3DPeer device 0 -> device 1: a 40 x 5 x 2 box at offsets");
    }

    for (int dev = 0; dev < 2; dev++) {
        CHECK(cudaSetDevice(dev));
        CHECK(cudaFree(d[dev]));
    }
    return test_end();
}
