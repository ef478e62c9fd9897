// Device enumeration and properties through the runtime API.
// Options: --expect-devices N   (exact device count; default: at least 1)
//          --expect-mem BYTES   (exact totalGlobalMem of every device; default: > 0)
#include <cuda_runtime.h>
#include "check.h"

int main(int argc, char **argv) {
    test_begin("rt_device");
    long long want_devices = arg_ll(argc, argv, "--expect-devices", -1);
    long long want_mem = arg_ll(argc, argv, "--expect-mem", -1);

    int rt = 0, drv = 0;
    CHECK(cudaRuntimeGetVersion(&rt));
    CHECK(cudaDriverGetVersion(&drv));
    EXPECT(drv >= rt, "driver version %d, runtime version %d", drv, rt);
    ok("driver version %d >= runtime version %d", drv, rt);

    int n = -1;
    CHECK(cudaGetDeviceCount(&n));
    if (want_devices >= 0)
        EXPECT(n == want_devices, "cudaGetDeviceCount gave %d, expected %lld", n, want_devices);
    else
        EXPECT(n >= 1, "cudaGetDeviceCount gave %d", n);
    ok("cudaGetDeviceCount = %d", n);

    for (int d = 0; d < n; d++) {
        cudaDeviceProp p;
        memset(&p, 0, sizeof p);
        CHECK(cudaGetDeviceProperties(&p, d));
        EXPECT(strstr(p.name, "rgpu sim") != nullptr, "device %d name is '%s'", d, p.name);
        ok("device %d name '%s'", d, p.name);
        EXPECT(p.major == 9 && p.minor == 0, "device %d cc %d.%d", d, p.major, p.minor);
        ok("device %d compute capability %d.%d", d, p.major, p.minor);
        if (want_mem >= 0)
            EXPECT((long long)p.totalGlobalMem == want_mem, "device %d totalGlobalMem %zu, expected %lld",
                   d, p.totalGlobalMem, want_mem);
        else
            EXPECT(p.totalGlobalMem > 0, "device %d totalGlobalMem 0", d);
        ok("device %d totalGlobalMem %zu", d, p.totalGlobalMem);
        EXPECT(p.warpSize == 32, "warpSize %d", p.warpSize);
        EXPECT(p.multiProcessorCount > 0, "multiProcessorCount %d", p.multiProcessorCount);
        EXPECT(p.maxThreadsPerBlock >= 64 && p.maxThreadsPerBlock <= 1024, "maxThreadsPerBlock %d", p.maxThreadsPerBlock);
        EXPECT(p.sharedMemPerBlock > 0, "sharedMemPerBlock %zu", p.sharedMemPerBlock);
        EXPECT(p.unifiedAddressing == 1, "unifiedAddressing %d (cudart needs UVA for cudaMemcpyDefault)", p.unifiedAddressing);
        ok("device %d warpSize 32, %d SMs, %d threads/block, %zu B shared/block, UVA",
           d, p.multiProcessorCount, p.maxThreadsPerBlock, p.sharedMemPerBlock);

        int v = -1;
        CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, d));
        EXPECT(v == p.major, "attribute major %d vs props %d", v, p.major);
        CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMinor, d));
        EXPECT(v == p.minor, "attribute minor %d vs props %d", v, p.minor);
        CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, d));
        EXPECT(v == p.multiProcessorCount, "attribute SM count %d vs props %d", v, p.multiProcessorCount);
        CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrWarpSize, d));
        EXPECT(v == 32, "attribute warp size %d", v);
        CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxThreadsPerBlock, d));
        EXPECT(v == p.maxThreadsPerBlock, "attribute max threads %d vs props %d", v, p.maxThreadsPerBlock);
        ok("device %d cudaDeviceGetAttribute agrees with cudaGetDeviceProperties", d);

        bool zero = true;
        char hex[33];
        for (int i = 0; i < 16; i++) {
            unsigned char b = (unsigned char)p.uuid.bytes[i];
            if (b) zero = false;
            snprintf(hex + 2 * i, 3, "%02x", b);
        }
        EXPECT(!zero, "device %d uuid is all zero", d);
        // The harness compares these lines across two runs.
        printf("uuid %d %s\n", d, hex);
        ok("device %d uuid non-zero", d);

        char bus[64] = {0};
        CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, d));
        EXPECT(strlen(bus) > 0, "empty PCI bus id");
        ok("device %d PCI bus id %s", d, bus);
    }

    cudaDeviceProp p;
    CHECK_ERR(cudaGetDeviceProperties(&p, n), cudaErrorInvalidDevice);
    CHECK_ERR(cudaGetLastError(), cudaErrorInvalidDevice);
    ok("cudaGetDeviceProperties(%d) -> cudaErrorInvalidDevice", n);
    CHECK_ERR(cudaSetDevice(n), cudaErrorInvalidDevice);
    cudaGetLastError();
    ok("cudaSetDevice(%d) -> cudaErrorInvalidDevice", n);

    CHECK(cudaSetDevice(0));
    int cur = -1;
    CHECK(cudaGetDevice(&cur));
    EXPECT(cur == 0, "cudaGetDevice gave %d", cur);
    CHECK(cudaFree(0)); // creates the primary context
    CHECK(cudaDeviceSynchronize());
    ok("context created on device 0, cudaDeviceSynchronize");
    return test_end();
}
