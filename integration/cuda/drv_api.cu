// The driver API directly (linked with -lcuda against the rgpu shim):
// init, devices, contexts, memory, copies, memsets, streams, events, host
// memory, pointer attributes.
#include <cuda.h>
#include <vector>
#include "check.h"

int main() {
    test_begin("drv_api");
    CU_CHECK(cuInit(0));
    int ver = 0;
    CU_CHECK(cuDriverGetVersion(&ver));
    EXPECT(ver >= 12000, "cuDriverGetVersion = %d", ver);
    ok("cuInit, cuDriverGetVersion = %d", ver);

    int count = 0;
    CU_CHECK(cuDeviceGetCount(&count));
    EXPECT(count >= 1, "cuDeviceGetCount = %d", count);
    CUdevice dev;
    CU_CHECK(cuDeviceGet(&dev, 0));
    CU_CHECK_ERR(cuDeviceGet(&dev, count), CUDA_ERROR_INVALID_DEVICE);
    CU_CHECK(cuDeviceGet(&dev, 0));
    char name[256] = {0};
    CU_CHECK(cuDeviceGetName(name, sizeof name, dev));
    EXPECT(strstr(name, "rgpu sim") != nullptr, "device name '%s'", name);
    size_t total = 0;
    CU_CHECK(cuDeviceTotalMem(&total, dev));
    EXPECT(total > 0, "cuDeviceTotalMem = 0");
    int major = -1, minor = -1, sms = 0, warp = 0, uva = 0;
    CU_CHECK(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
    CU_CHECK(cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));
    CU_CHECK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
    CU_CHECK(cuDeviceGetAttribute(&warp, CU_DEVICE_ATTRIBUTE_WARP_SIZE, dev));
    CU_CHECK(cuDeviceGetAttribute(&uva, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, dev));
    EXPECT(major == 9 && minor == 0, "compute capability %d.%d", major, minor);
    EXPECT(sms > 0 && warp == 32 && uva == 1, "SMs %d warp %d UVA %d", sms, warp, uva);
    CUuuid uuid;
    memset(&uuid, 0, sizeof uuid);
    CU_CHECK(cuDeviceGetUuid(&uuid, dev));
    bool zero = true;
    for (int i = 0; i < 16; i++) zero = zero && uuid.bytes[i] == 0;
    EXPECT(!zero, "cuDeviceGetUuid gave zeros");
    ok("cuDeviceGet/GetCount/GetName('%s')/TotalMem(%zu)/GetAttribute(cc %d.%d, %d SMs)/GetUuid",
       name, total, major, minor, sms);

    // Primary context.
    CUcontext primary = nullptr, cur = nullptr;
    CU_CHECK(cuDevicePrimaryCtxRetain(&primary, dev));
    EXPECT(primary != nullptr, "primary context NULL");
    CU_CHECK(cuCtxSetCurrent(primary));
    CU_CHECK(cuCtxGetCurrent(&cur));
    EXPECT(cur == primary, "cuCtxGetCurrent != primary");
    CUdevice cdev = -1;
    CU_CHECK(cuCtxGetDevice(&cdev));
    EXPECT(cdev == dev, "cuCtxGetDevice = %d", cdev);
    unsigned pflags = 0;
    int active = 0;
    CU_CHECK(cuDevicePrimaryCtxGetState(dev, &pflags, &active));
    EXPECT(active == 1, "primary context not active after retain");
    CU_CHECK(cuCtxSynchronize());
    ok("primary context: retain, set/get current, get device, state, synchronize");

    // A separate context, pushed and popped.
    CUcontext own = nullptr;
    CU_CHECK(cuCtxCreate(&own, nullptr, 0, dev));
    CU_CHECK(cuCtxGetCurrent(&cur));
    EXPECT(cur == own, "cuCtxCreate did not make the new context current");
    CUdeviceptr in_own = 0;
    CU_CHECK(cuMemAlloc(&in_own, 4096));
    CU_CHECK(cuMemsetD8(in_own, 0x5C, 4096));
    unsigned char chk[4096];
    CU_CHECK(cuMemcpyDtoH(chk, in_own, sizeof chk));
    EXPECT(check_bytes(chk, sizeof chk, 0x5C) < 0, "memset/copy in an own context wrong");
    CU_CHECK(cuMemFree(in_own));
    CUcontext popped = nullptr;
    CU_CHECK(cuCtxPopCurrent(&popped));
    EXPECT(popped == own, "cuCtxPopCurrent gave another context");
    CU_CHECK(cuCtxPushCurrent(own));
    CU_CHECK(cuCtxPopCurrent(&popped));
    CU_CHECK(cuCtxDestroy(own));
    CU_CHECK(cuCtxSetCurrent(primary));
    ok("cuCtxCreate, allocate/memset/copy in it, pop/push, cuCtxDestroy");

    // Memory.
    size_t free0 = 0, tot = 0;
    CU_CHECK(cuMemGetInfo(&free0, &tot));
    EXPECT(tot == total, "cuMemGetInfo total %zu vs cuDeviceTotalMem %zu", tot, total);
    const size_t n = (8u << 20) + 5;
    CUdeviceptr a = 0, b = 0;
    CU_CHECK(cuMemAlloc(&a, n));
    CU_CHECK(cuMemAlloc(&b, n));
    size_t free1 = 0;
    CU_CHECK(cuMemGetInfo(&free1, &tot));
    EXPECT(free1 + 2 * n <= free0, "free %zu -> %zu after 2 x %zu", free0, free1, n);
    CUdeviceptr base = 0;
    size_t range = 0;
    CU_CHECK(cuMemGetAddressRange(&base, &range, a + 1000));
    EXPECT(base == a && range >= n, "cuMemGetAddressRange base %llx range %zu", (unsigned long long)base, range);
    ok("cuMemAlloc, cuMemGetInfo, cuMemGetAddressRange");

    std::vector<unsigned char> h(n), back(n);
    fill_pattern(h.data(), n, 77);
    CU_CHECK(cuMemcpyHtoD(a, h.data(), n));
    CU_CHECK(cuMemcpyDtoD(b, a, n));
    CU_CHECK(cuMemcpyDtoH(back.data(), b, n));
    EXPECT(check_pattern(back.data(), n, 77) < 0, "cuMemcpyHtoD/DtoD/DtoH wrong");
    CU_CHECK(cuMemcpyHtoD(a + 3, h.data() + 1, 1001));
    CU_CHECK(cuMemcpyDtoH(back.data() + 1, a + 3, 1001));
    EXPECT(memcmp(back.data() + 1, h.data() + 1, 1001) == 0, "unaligned HtoD/DtoH wrong");
    fill_pattern(h.data(), n, 78);
    CU_CHECK(cuMemcpy(a, (CUdeviceptr)h.data(), n));
    CU_CHECK(cuMemcpy((CUdeviceptr)back.data(), a, n));
    EXPECT(check_pattern(back.data(), n, 78) < 0, "cuMemcpy (unified) round trip wrong");
    ok("cuMemcpyHtoD/DtoD/DtoH, unaligned, and cuMemcpy (unified addressing)");

    // Memsets of every width, checked as bytes.
    CU_CHECK(cuMemsetD8(a, 0xA5, n));
    CU_CHECK(cuMemcpyDtoH(back.data(), a, n));
    EXPECT(check_bytes(back.data(), n, 0xA5) < 0, "cuMemsetD8 wrong");
    CU_CHECK(cuMemsetD16(a, 0xBEEF, 1000));
    CU_CHECK(cuMemcpyDtoH(back.data(), a, 2004));
    for (int i = 0; i < 1000; i++) {
        unsigned short v;
        memcpy(&v, back.data() + 2 * i, 2);
        EXPECT(v == 0xBEEF, "cuMemsetD16 element %d = 0x%x", i, v);
    }
    EXPECT(back[2000] == 0xA5 && back[2003] == 0xA5, "cuMemsetD16 wrote past its range");
    CU_CHECK(cuMemsetD32(b + 4, 0xDEADBEEF, 333));
    CU_CHECK(cuMemcpyDtoH(back.data(), b, 4 + 333 * 4 + 4));
    for (int i = 0; i < 333; i++) {
        unsigned v;
        memcpy(&v, back.data() + 4 + 4 * i, 4);
        EXPECT(v == 0xDEADBEEF, "cuMemsetD32 element %d = 0x%x", i, v);
    }
    ok("cuMemsetD8, cuMemsetD16 (0xBEEF x 1000), cuMemsetD32 (0xDEADBEEF x 333) and their bounds");

    CU_CHECK_ERR(cuMemsetD16(a + 1, 0x1234, 4), CUDA_ERROR_INVALID_VALUE);
    CU_CHECK_ERR(cuMemsetD32(a + 2, 0x1234, 4), CUDA_ERROR_INVALID_VALUE);
    ok("misaligned cuMemsetD16/D32 -> CUDA_ERROR_INVALID_VALUE");

    // Streams and async operations.
    CUstream s;
    CU_CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CU_CHECK(cuStreamQuery(s));
    CUdeviceptr dp = 0;
    CU_CHECK(cuMemAlloc(&dp, n));
    unsigned char *pinned = nullptr, *pinned2 = nullptr;
    CU_CHECK(cuMemHostAlloc((void **)&pinned, n, CU_MEMHOSTALLOC_PORTABLE));
    CU_CHECK(cuMemAllocHost((void **)&pinned2, n));
    fill_pattern(pinned, n, 79);
    memset(pinned2, 0, n);
    CU_CHECK(cuMemsetD32Async(dp, 0, n / 4, s));
    CU_CHECK(cuMemcpyHtoDAsync(a, pinned, n, s));
    CU_CHECK(cuMemcpyDtoDAsync(dp, a, n, s));
    CU_CHECK(cuMemsetD8Async(a, 0, n, s));
    CU_CHECK(cuMemcpyDtoHAsync(pinned2, dp, n, s));
    CU_CHECK(cuStreamSynchronize(s));
    EXPECT(check_pattern(pinned2, n, 79) < 0, "async HtoD -> DtoD -> DtoH chain wrong");
    CU_CHECK(cuMemsetD16Async(dp, 0x0102, 8, s));
    CU_CHECK(cuMemcpyDtoHAsync(pinned2, dp, 16, s));
    CU_CHECK(cuStreamSynchronize(s));
    for (int i = 0; i < 16; i++) EXPECT(pinned2[i] == (i % 2 ? 0x01 : 0x02), "cuMemsetD16Async byte %d = 0x%x", i, pinned2[i]);
    CU_CHECK(cuStreamQuery(s));
    ok("stream: cuMemcpy{HtoD,DtoD,DtoH}Async, cuMemsetD{8,16,32}Async in order, with cuMemHostAlloc/cuMemAllocHost buffers");

    // Pointer attributes.
    CUcontext pctx = nullptr;
    CU_CHECK(cuPointerGetAttribute(&pctx, CU_POINTER_ATTRIBUTE_CONTEXT, a));
    EXPECT(pctx == primary, "CU_POINTER_ATTRIBUTE_CONTEXT is not the primary context");
    unsigned mtype = 0;
    CU_CHECK(cuPointerGetAttribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, a + 17));
    EXPECT(mtype == CU_MEMORYTYPE_DEVICE, "device pointer memory type %u", mtype);
    CU_CHECK(cuPointerGetAttribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)pinned));
    EXPECT(mtype == CU_MEMORYTYPE_HOST, "pinned pointer memory type %u", mtype);
    int ordinal = -1;
    CU_CHECK(cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, a));
    EXPECT(ordinal == 0, "device ordinal %d", ordinal);
    CUdeviceptr dptr = 0;
    CU_CHECK(cuPointerGetAttribute(&dptr, CU_POINTER_ATTRIBUTE_DEVICE_POINTER, a + 5));
    EXPECT(dptr == a + 5, "CU_POINTER_ATTRIBUTE_DEVICE_POINTER %llx", (unsigned long long)dptr);
    int dummy = 0;
    CU_CHECK_ERR(cuPointerGetAttribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)&dummy),
                 CUDA_ERROR_INVALID_VALUE);
    ok("cuPointerGetAttribute: context, memory type (device/host), ordinal, device pointer; unknown pointer -> INVALID_VALUE");

    // Events.
    CUevent e0, e1;
    CU_CHECK(cuEventCreate(&e0, CU_EVENT_DEFAULT));
    CU_CHECK(cuEventCreate(&e1, CU_EVENT_DEFAULT));
    CU_CHECK(cuEventRecord(e0, s));
    CU_CHECK(cuMemcpyHtoDAsync(a, pinned, n, s));
    CU_CHECK(cuEventRecord(e1, s));
    CU_CHECK(cuEventSynchronize(e1));
    CU_CHECK(cuEventQuery(e1));
    float ms = -1;
    CU_CHECK(cuEventElapsedTime(&ms, e0, e1));
    EXPECT(ms >= 0.0f && ms < 60000.0f, "cuEventElapsedTime %f", ms);
    CUstream s2;
    CU_CHECK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    CU_CHECK(cuEventRecord(e0, s));
    CU_CHECK(cuStreamWaitEvent(s2, e0, 0));
    CU_CHECK(cuStreamSynchronize(s2));
    CU_CHECK(cuStreamDestroy(s2));
    CU_CHECK(cuEventDestroy(e0));
    CU_CHECK(cuEventDestroy(e1));
    ok("events: record, synchronize, query, elapsed %.3f ms, cuStreamWaitEvent", ms);

    // Errors.
    CU_CHECK_ERR(cuMemFree((CUdeviceptr)0x12345600), CUDA_ERROR_INVALID_VALUE);
    CU_CHECK_ERR(cuMemcpyHtoD(a, h.data(), n + 1), CUDA_ERROR_INVALID_VALUE);
    CUdeviceptr huge = 0;
    CU_CHECK_ERR(cuMemAlloc(&huge, total + (1ull << 30)), CUDA_ERROR_OUT_OF_MEMORY);
    ok("cuMemFree(unknown) / copy past the end -> INVALID_VALUE, oversize cuMemAlloc -> OUT_OF_MEMORY");

    // Stream capture is not offered: no stream is capturing, and the
    // attributes of features rgpu lacks say so, consistently with the calls.
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_ACTIVE;
    CU_CHECK(cuStreamIsCapturing(s, &cs));
    EXPECT(cs == CU_STREAM_CAPTURE_STATUS_NONE, "cuStreamIsCapturing(stream) = %d", (int)cs);
    cs = CU_STREAM_CAPTURE_STATUS_ACTIVE;
    CU_CHECK(cuStreamIsCapturing(0, &cs));
    EXPECT(cs == CU_STREAM_CAPTURE_STATUS_NONE, "cuStreamIsCapturing(default stream) = %d", (int)cs);
    CU_CHECK_ERR(cuStreamIsCapturing((CUstream)0x5700000000000999ull, &cs), CUDA_ERROR_INVALID_HANDLE);
    cuuint64_t cid = 7;
    cs = CU_STREAM_CAPTURE_STATUS_ACTIVE;
    CU_CHECK(cuStreamGetCaptureInfo(s, &cs, &cid, nullptr, nullptr, nullptr, nullptr));
    EXPECT(cs == CU_STREAM_CAPTURE_STATUS_NONE, "cuStreamGetCaptureInfo status %d", (int)cs);
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    CU_CHECK(cuThreadExchangeStreamCaptureMode(&mode));
    EXPECT(mode == CU_STREAM_CAPTURE_MODE_GLOBAL, "the first capture mode was %d, not GLOBAL", (int)mode);
    CU_CHECK(cuThreadExchangeStreamCaptureMode(&mode));
    EXPECT(mode == CU_STREAM_CAPTURE_MODE_RELAXED, "the capture mode set was not returned: %d", (int)mode);
    ok("cuStreamIsCapturing / cuStreamGetCaptureInfo: not capturing; cuThreadExchangeStreamCaptureMode exchanges");
    CUgreenCtx green = (CUgreenCtx)0x1;
    CU_CHECK(cuStreamGetGreenCtx(s, &green));
    EXPECT(green == nullptr, "a plain stream reports a green context");
    ok("cuStreamGetGreenCtx: a plain stream has none");
    int managed = -1, coop = -1, pools = -1;
    CU_CHECK(cuDeviceGetAttribute(&managed, CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, dev));
    CU_CHECK(cuDeviceGetAttribute(&coop, CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH, dev));
    CU_CHECK(cuDeviceGetAttribute(&pools, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, dev));
    CUdeviceptr um = 0;
    CUresult ur = cuMemAllocManaged(&um, 4096, CU_MEM_ATTACH_GLOBAL);
    EXPECT((managed != 0) == (ur == CUDA_SUCCESS), "MANAGED_MEMORY attribute %d but cuMemAllocManaged -> %d", managed, (int)ur);
    EXPECT(coop == 1, "COOPERATIVE_LAUNCH %d, but cuLaunchCooperativeKernel is there (rt_cooperative)", coop);
    EXPECT(pools == 1, "MEMORY_POOLS_SUPPORTED %d, but the stream-ordered allocator is there", pools);
    if (ur == CUDA_SUCCESS) CU_CHECK(cuMemFree(um));
    ok("attributes of managed memory, cooperative launch and memory pools match what the calls do");
    CUdeviceptr pa = 0;
    CU_CHECK(cuMemAllocAsync(&pa, 1 << 20, s));
    CU_CHECK(cuMemsetD32Async(pa, 0x12345678u, (1 << 20) / 4, s));
    unsigned word = 0;
    CU_CHECK(cuMemcpyDtoHAsync(&word, pa + 4096, 4, s));
    EXPECT(word == 0x12345678u, "stream-ordered allocation read back %#x", word);
    CU_CHECK(cuMemFreeAsync(pa, s));
    CU_CHECK(cuStreamSynchronize(s));
    ok("cuMemAllocAsync / cuMemFreeAsync in stream order");

    CU_CHECK(cuStreamDestroy(s));
    CU_CHECK(cuMemFreeHost(pinned));
    CU_CHECK(cuMemFreeHost(pinned2));
    CU_CHECK(cuMemFree(a));
    CU_CHECK(cuMemFree(b));
    CU_CHECK(cuMemFree(dp));
    size_t free2 = 0;
    CU_CHECK(cuMemGetInfo(&free2, &tot));
    EXPECT(free2 >= free0, "free memory %zu after freeing everything, %zu before", free2, free0);
    CU_CHECK(cuDevicePrimaryCtxRelease(dev));
    ok("cleanup: cuStreamDestroy, cuMemFreeHost, cuMemFree, cuDevicePrimaryCtxRelease");
    return test_end();
}
