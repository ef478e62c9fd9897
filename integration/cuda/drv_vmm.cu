// Virtual memory management through the driver API, as PyTorch's expandable segments use it:
// granularity, cuMemAddressReserve, cuMemCreate (charged to device memory), two allocations
// mapped end to end in one reserved range, cuMemSetAccess/cuMemGetAccess, copies, memsets and
// kernels across the boundary between them, pointer queries on mapped ranges, one allocation
// mapped twice (aliases), cuMemRetainAllocationHandle and the release/unmap order, the errors
// (overlapping maps, unaligned offsets and sizes, part of a map, over-budget creation,
// shareable handles rgpu does not offer), and last a kernel touching a mapped range the
// device was given no access to, which faults as on a GPU.
#include <cuda.h>
#include <vector>
#include "check.h"
#include "drv_vmm_images.h" // module_fatbin[], module_fatbin_len, module_ptx

static CUfunction g_iota, g_add;

static void launch(CUfunction f, CUdeviceptr p, unsigned v, unsigned n) {
    void *params[] = {&p, &v, &n};
    CU_CHECK(cuLaunchKernel(f, (n + 255) / 256, 1, 1, 256, 1, 1, 0, nullptr, params, nullptr));
    CU_CHECK(cuCtxSynchronize());
}

int main() {
    test_begin("drv_vmm");
    CU_CHECK(cuInit(0));
    CUdevice dev;
    CU_CHECK(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CU_CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CU_CHECK(cuCtxSetCurrent(ctx));
    CUmodule mod;
    CU_CHECK(cuModuleLoadData(&mod, module_fatbin));
    CU_CHECK(cuModuleGetFunction(&g_iota, mod, "iota"));
    CU_CHECK(cuModuleGetFunction(&g_add, mod, "add"));

    int vmm = -1, posix = -1;
    CU_CHECK(cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev));
    CU_CHECK(cuDeviceGetAttribute(&posix, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev));
    EXPECT(vmm == 1, "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = %d", vmm);
    ok("VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 1 (POSIX fd handles: %d)", posix);

    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    size_t gmin = 0, grec = 0;
    CU_CHECK(cuMemGetAllocationGranularity(&gmin, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CU_CHECK(cuMemGetAllocationGranularity(&grec, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    EXPECT(gmin == (2u << 20) && grec == (2u << 20), "granularity min %zu recommended %zu", gmin, grec);
    const size_t G = gmin;
    ok("cuMemGetAllocationGranularity: minimum and recommended 2 MiB");

    // Reserve, create two chunks, map them end to end.
    size_t free0 = 0, total = 0, free1 = 0;
    CU_CHECK(cuMemGetInfo(&free0, &total));
    CUdeviceptr va = 0;
    CU_CHECK(cuMemAddressReserve(&va, 8 * G, 0, 0, 0));
    EXPECT(va != 0 && va % G == 0, "reserved at %llx", (unsigned long long)va);
    CUmemGenericAllocationHandle h1 = 0, h2 = 0;
    CU_CHECK(cuMemCreate(&h1, G, &prop, 0));
    CU_CHECK(cuMemCreate(&h2, G, &prop, 0));
    EXPECT(h1 != 0 && h2 != 0 && h1 != h2, "handles %llx %llx", (unsigned long long)h1, (unsigned long long)h2);
    CU_CHECK(cuMemGetInfo(&free1, &total));
    EXPECT(free0 - free1 >= 2 * G, "free %zu -> %zu after creating 2 x 2 MiB", free0, free1);
    ok("cuMemAddressReserve(8 x 2 MiB) at %llx; cuMemCreate x2 takes %zu bytes of device memory",
       (unsigned long long)va, free0 - free1);

    CU_CHECK(cuMemMap(va, G, 0, h1, 0));
    CU_CHECK(cuMemMap(va + G, G, 0, h2, 0));
    unsigned long long flags = 99;
    CUmemLocation loc;
    memset(&loc, 0, sizeof loc);
    loc.type = CU_MEM_LOCATION_TYPE_DEVICE;
    loc.id = dev;
    CU_CHECK(cuMemGetAccess(&flags, &loc, va));
    EXPECT(flags == CU_MEM_ACCESS_FLAGS_PROT_NONE, "access before cuMemSetAccess = %llu", flags);
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location = loc;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU_CHECK(cuMemSetAccess(va, 2 * G, &acc, 1));
    CU_CHECK(cuMemGetAccess(&flags, &loc, va + G + 4096));
    EXPECT(flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "access after cuMemSetAccess = %llu", flags);
    ok("cuMemMap x2 end to end; cuMemGetAccess none, then read-write after one cuMemSetAccess over both");

    // Pointer queries answer per map.
    CUdeviceptr base = 0;
    size_t size = 0;
    CU_CHECK(cuMemGetAddressRange(&base, &size, va + G + 10));
    EXPECT(base == va + G && size == G, "address range %llx + %zu", (unsigned long long)base, size);
    int ordinal = -1;
    unsigned mtype = 0;
    CU_CHECK(cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, va + 5));
    CU_CHECK(cuPointerGetAttribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, va + 5));
    EXPECT(ordinal == dev && mtype == CU_MEMORYTYPE_DEVICE, "ordinal %d type %u", ordinal, mtype);
    ok("cuMemGetAddressRange and cuPointerGetAttribute on mapped memory");

    // Copies and memsets across the boundary.
    const size_t W = 64 << 10;
    CUdeviceptr window = va + G - W / 2;
    std::vector<unsigned char> host(W), back(W);
    fill_pattern(host.data(), W, 7);
    CU_CHECK(cuMemcpyHtoD(window, host.data(), W));
    CU_CHECK(cuMemcpyDtoH(back.data(), window, W));
    long long bad = check_pattern(back.data(), W, 7);
    EXPECT(bad < 0, "byte %lld differs after a copy across the boundary", bad);
    CU_CHECK(cuMemsetD32(window + 4, 0xA5A5A5A5u, W / 4 - 2));
    CU_CHECK(cuMemcpyDtoH(back.data(), window, W));
    EXPECT(check_bytes(back.data() + 4, W - 8, 0xA5) < 0, "memset across the boundary");
    EXPECT(check_pattern(back.data(), 4, 7) < 0, "memset wrote before its start");
    ok("cuMemcpyHtoD/DtoH and cuMemsetD32 over 64 KiB straddling the two allocations");

    // A kernel writing across the boundary, checked through a device-to-device copy too.
    const unsigned n = W / 4;
    launch(g_iota, window, 1000, n);
    std::vector<unsigned> words(n);
    CU_CHECK(cuMemcpyDtoH(words.data(), window, W));
    for (unsigned i = 0; i < n; i++) EXPECT(words[i] == 1000 + i, "word %u = %u after iota", i, words[i]);
    CUdeviceptr plain = 0;
    CU_CHECK(cuMemAlloc(&plain, W));
    CU_CHECK(cuMemcpyDtoD(plain, window, W));
    launch(g_add, window, 5, n);
    CU_CHECK(cuMemcpyDtoD(window, plain, W / 2)); // undoes the add in the first half
    CU_CHECK(cuMemcpyDtoH(words.data(), window, W));
    for (unsigned i = 0; i < n; i++)
        EXPECT(words[i] == 1000 + i + (i < n / 2 ? 0 : 5), "word %u = %u after add and copy back", i, words[i]);
    ok("kernels write and read across the boundary; cuMemcpyDtoD between mapped and ordinary memory");

    // h2 mapped a second time: an alias.
    CUdeviceptr va2 = 0;
    CU_CHECK(cuMemAddressReserve(&va2, 2 * G, 0, 0, 0));
    CU_CHECK(cuMemMap(va2, G, 0, h2, 0));
    CU_CHECK(cuMemSetAccess(va2, G, &acc, 1));
    unsigned w0 = 0;
    CU_CHECK(cuMemcpyDtoH(&w0, va2, 4));
    EXPECT(w0 == 1000 + n / 2 + 5, "first word of h2 through the alias = %u", w0);
    CU_CHECK(cuMemsetD8(va2 + 100, 0x5A, 16));
    unsigned char b16[16];
    CU_CHECK(cuMemcpyDtoH(b16, va + G + 100, 16));
    EXPECT(check_bytes(b16, 16, 0x5A) < 0, "memset through the alias not seen through the first map");
    launch(g_add, va + G, 1, 1);
    CU_CHECK(cuMemcpyDtoH(&w0, va2, 4));
    EXPECT(w0 == 1000 + n / 2 + 6, "kernel write through one map read through the alias = %u", w0);
    ok("one allocation mapped twice: writes through either map are seen through the other");

    // Errors.
    CU_CHECK_ERR(cuMemMap(va, G, 0, h2, 0), CUDA_ERROR_INVALID_VALUE);
    CU_CHECK_ERR(cuMemMap(va + 2 * G, G, 4096, h2, 0), CUDA_ERROR_INVALID_VALUE);
    CU_CHECK_ERR(cuMemMap(va + 2 * G, 2 * G, 0, h2, 0), CUDA_ERROR_INVALID_VALUE);
    CUmemGenericAllocationHandle hx = 0;
    CU_CHECK_ERR(cuMemCreate(&hx, G + 4096, &prop, 0), CUDA_ERROR_INVALID_VALUE);
    size_t huge = (total / G + 1) * G;
    CU_CHECK_ERR(cuMemCreate(&hx, huge, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
    // Asking for POSIX fd export (PyTorch always does) gives an allocation; exporting it
    // works where the device says it does, and is refused where it says not.
    CUmemAllocationProp shared = prop;
    shared.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CU_CHECK(cuMemCreate(&hx, G, &shared, 0));
    CUmemAllocationProp sp;
    memset(&sp, 0, sizeof sp);
    CU_CHECK(cuMemGetAllocationPropertiesFromHandle(&sp, hx));
    EXPECT(sp.requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, "handle types %d", (int)sp.requestedHandleTypes);
    int fd = -1;
    if (posix == 0) {
        CU_CHECK_ERR(cuMemExportToShareableHandle(&fd, hx, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), CUDA_ERROR_NOT_SUPPORTED);
    } else {
        CU_CHECK(cuMemExportToShareableHandle(&fd, hx, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
        EXPECT(fd >= 0, "exported fd %d", fd);
    }
    CU_CHECK(cuMemRelease(hx));
    int fabric = -1;
    CU_CHECK(cuDeviceGetAttribute(&fabric, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, dev));
    if (fabric == 0) {
        shared.requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
        EXPECT(cuMemCreate(&hx, G, &shared, 0) != CUDA_SUCCESS, "a fabric-exportable allocation without fabric support");
    }
    CU_CHECK_ERR(cuMemAddressFree(va2, G), CUDA_ERROR_INVALID_VALUE);
    ok("errors: overlapping map, unaligned offset, map past the allocation, unaligned size, "
       "more than the device has (%zu bytes) -> OUT_OF_MEMORY, address free of the wrong size; "
       "POSIX fd export asked for: allocated, export %s", huge, posix ? "works" : "refused (NOT_SUPPORTED)");

    // Release while mapped: the memory stays until it is unmapped too.
    size_t free2 = 0, free3 = 0;
    CU_CHECK(cuMemRelease(h1));
    CU_CHECK(cuMemcpyDtoH(&w0, window, 4));
    EXPECT(w0 == 1000, "a released but mapped allocation keeps its bytes (%u)", w0);
    CUmemGenericAllocationHandle again = 0;
    CU_CHECK(cuMemRetainAllocationHandle(&again, (void *)(uintptr_t)(va + 12345)));
    EXPECT(again == h1, "retained handle %llx, created %llx", (unsigned long long)again, (unsigned long long)h1);
    CUmemAllocationProp got;
    memset(&got, 0xff, sizeof got);
    CU_CHECK(cuMemGetAllocationPropertiesFromHandle(&got, again));
    EXPECT(got.type == CU_MEM_ALLOCATION_TYPE_PINNED && got.location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
               got.location.id == dev && got.requestedHandleTypes == CU_MEM_HANDLE_TYPE_NONE,
           "properties type %d location %d/%d handles %d", (int)got.type, (int)got.location.type, got.location.id,
           (int)got.requestedHandleTypes);
    CU_CHECK(cuMemRelease(again));
    CU_CHECK(cuMemGetInfo(&free2, &total));
    CU_CHECK_ERR(cuMemUnmap(va, G / 2), CUDA_ERROR_INVALID_VALUE);
    CU_CHECK(cuMemUnmap(va, G));
    CU_CHECK(cuMemGetInfo(&free3, &total));
    EXPECT(free3 >= free2 + G, "free %zu -> %zu after the last unmap of a released allocation", free2, free3);
    ok("cuMemRelease while mapped keeps the bytes; cuMemRetainAllocationHandle gives the handle back with its "
       "properties; the memory returns at the last unmap; part of a map cannot be unmapped");

    // h2 is mapped twice: released, unmapped once, still readable through the other map.
    CU_CHECK(cuMemRelease(h2));
    CU_CHECK(cuMemUnmap(va + G, G));
    CU_CHECK(cuMemcpyDtoH(&w0, va2 + 4, 4));
    EXPECT(w0 == 1000 + n / 2 + 1 + 5, "second word of h2 through the remaining map = %u", w0);
    CU_CHECK(cuMemUnmap(va2, G));
    CU_CHECK(cuMemAddressFree(va2, 2 * G));
    CU_CHECK(cuMemAddressFree(va, 8 * G));
    CU_CHECK(cuMemFree(plain));
    ok("unmap and release in either order; cuMemAddressFree");

    // Last (a fault ends a context's usefulness on a GPU): a kernel on mapped memory the
    // device has no access to.
    CUdeviceptr vb = 0;
    CUmemGenericAllocationHandle hb = 0;
    CU_CHECK(cuMemAddressReserve(&vb, G, 0, 0, 0));
    CU_CHECK(cuMemCreate(&hb, G, &prop, 0));
    CU_CHECK(cuMemMap(vb, G, 0, hb, 0));
    unsigned v = 1, one = 1;
    void *params[] = {&vb, &v, &one};
    CU_CHECK(cuLaunchKernel(g_iota, 1, 1, 1, 32, 1, 1, 0, nullptr, params, nullptr));
    CU_CHECK_ERR(cuCtxSynchronize(), CUDA_ERROR_ILLEGAL_ADDRESS);
    ok("a kernel touching a mapped range without cuMemSetAccess faults: CUDA_ERROR_ILLEGAL_ADDRESS");
    return test_end();
}
