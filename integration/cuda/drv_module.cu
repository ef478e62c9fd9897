// Modules through the driver API: cuModuleLoadData with a fatbin built by
// `nvcc -fatbin` and with PTX text (both embedded by the harness in the
// generated header drv_module_images.h), cuModuleGetFunction,
// cuModuleGetGlobal, cuFuncGetAttribute, and cuLaunchKernel reporting
// CUDA_ERROR_NOT_SUPPORTED while the server cannot run kernels.
// Option: --expect-supported   the launch must succeed and compute.
#include <cuda.h>
#include "check.h"
#include "drv_module_images.h" // module_fatbin[], module_fatbin_len, module_ptx[]
#include "drv_link_inputs.h"   // drv_link_main_ptx, drv_link_lib_ptx (relocatable PTX)

static void check_module(CUmodule m, const char *what, bool launch_supported) {
    CUfunction fill = nullptr, bounded = nullptr, missing = nullptr;
    CU_CHECK(cuModuleGetFunction(&fill, m, "fill"));
    CU_CHECK(cuModuleGetFunction(&bounded, m, "bounded"));
    EXPECT(fill && bounded && fill != bounded, "function handles");
    CU_CHECK_ERR(cuModuleGetFunction(&missing, m, "no_such_kernel"), CUDA_ERROR_NOT_FOUND);
    ok("%s: cuModuleGetFunction(fill, bounded); unknown name -> CUDA_ERROR_NOT_FOUND", what);

    int v = -1;
    CU_CHECK(cuFuncGetAttribute(&v, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, bounded));
    EXPECT(v >= 1 && v <= 64, "bounded (launch bounds 64) MAX_THREADS_PER_BLOCK = %d", v);
    CU_CHECK(cuFuncGetAttribute(&v, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, bounded));
    EXPECT(v == 512 * 4, "bounded SHARED_SIZE_BYTES = %d", v);
    CU_CHECK(cuFuncGetAttribute(&v, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fill));
    EXPECT(v == 0, "fill SHARED_SIZE_BYTES = %d", v);
    CU_CHECK(cuFuncGetAttribute(&v, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, fill));
    EXPECT(v >= 1 && v <= 1024, "fill MAX_THREADS_PER_BLOCK = %d", v);
    int regs = -1, ptxv = -1, binv = -1;
    CU_CHECK(cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, fill));
    CU_CHECK(cuFuncGetAttribute(&ptxv, CU_FUNC_ATTRIBUTE_PTX_VERSION, fill));
    CU_CHECK(cuFuncGetAttribute(&binv, CU_FUNC_ATTRIBUTE_BINARY_VERSION, fill));
    note("%s: fill NUM_REGS %d PTX_VERSION %d BINARY_VERSION %d", what, regs, ptxv, binv);
    ok("%s: cuFuncGetAttribute (max threads, shared size, regs, versions)", what);

    CUdeviceptr g = 0;
    size_t gsz = 0;
    CU_CHECK(cuModuleGetGlobal(&g, &gsz, m, "table"));
    EXPECT(g != 0 && gsz == 256 * sizeof(int), "table at %llx size %zu", (unsigned long long)g, gsz);
    int t[256];
    memset(t, 0x7F, sizeof t);
    CU_CHECK(cuMemcpyDtoH(t, g, sizeof t));
    for (int i = 0; i < 256; i++) EXPECT(t[i] == 0, "fresh table[%d] = %d", i, t[i]);
    for (int i = 0; i < 256; i++) t[i] = 1000 + i;
    CU_CHECK(cuMemcpyHtoD(g, t, sizeof t));
    memset(t, 0, sizeof t);
    CU_CHECK(cuMemcpyDtoH(t, g, sizeof t));
    for (int i = 0; i < 256; i++) EXPECT(t[i] == 1000 + i, "table[%d] = %d after write", i, t[i]);

    CUdeviceptr c = 0;
    size_t csz = 0;
    CU_CHECK(cuModuleGetGlobal(&c, &csz, m, "counter"));
    unsigned long long cv = 0;
    EXPECT(csz == 8, "counter size %zu", csz);
    CU_CHECK(cuMemcpyDtoH(&cv, c, 8));
    EXPECT(cv == 0x1122334455667788ull, "counter = %llx", cv);
    CUdeviceptr k = 0;
    size_t ksz = 0;
    CU_CHECK(cuModuleGetGlobal(&k, &ksz, m, "coef"));
    float coef[4] = {0, 0, 0, 0};
    CU_CHECK(cuMemcpyDtoH(coef, k, sizeof coef));
    EXPECT(ksz == 16 && coef[0] == 0.5f && coef[3] == 3.5f, "coef size %zu [%f %f]", ksz, coef[0], coef[3]);
    CUdeviceptr only_addr = 0;
    CU_CHECK(cuModuleGetGlobal(&only_addr, nullptr, m, "table"));
    EXPECT(only_addr == g, "cuModuleGetGlobal with NULL size gave another address");
    CUdeviceptr nope = 0;
    size_t nsz = 0;
    CU_CHECK_ERR(cuModuleGetGlobal(&nope, &nsz, m, "no_such_global"), CUDA_ERROR_NOT_FOUND);
    ok("%s: cuModuleGetGlobal (zeroed int[256] written and read back, u64 and __constant__ initialisers); unknown -> NOT_FOUND", what);

    // Launch.
    const int n = 300;
    CUdeviceptr out = 0;
    CU_CHECK(cuMemAlloc(&out, n * sizeof(int)));
    CU_CHECK(cuMemsetD32(out, 0, n));
    int value = 5, count = n;
    void *params[] = {&out, &value, &count};
    CUresult r = cuLaunchKernel(fill, 2, 1, 1, 256, 1, 1, 0, nullptr, params, nullptr);
    if (launch_supported) {
        EXPECT(r == CUDA_SUCCESS, "cuLaunchKernel gave %d (%s)", (int)r, cu_err_name(r));
        CU_CHECK(cuCtxSynchronize());
        int res[n];
        CU_CHECK(cuMemcpyDtoH(res, out, sizeof res));
        const float cf[4] = {0.5f, 1.5f, 2.5f, 3.5f};
        for (int i = 0; i < n; i++)
            EXPECT(res[i] == 5 + 1000 + (i % 256) + (int)cf[i % 4], "fill result [%d] = %d", i, res[i]);
        ok("%s: cuLaunchKernel ran fill", what);
    } else {
        EXPECT(r == CUDA_ERROR_NOT_SUPPORTED, "cuLaunchKernel gave %d (%s), expected CUDA_ERROR_NOT_SUPPORTED", (int)r,
               cu_err_name(r));
        CU_CHECK(cuCtxSynchronize());
        int res[n];
        CU_CHECK(cuMemcpyDtoH(res, out, sizeof res));
        EXPECT(check_bytes(res, sizeof res, 0) < 0, "memory changed by an unsupported launch");
        ok("%s: cuLaunchKernel -> CUDA_ERROR_NOT_SUPPORTED; context still usable", what);
    }
    CU_CHECK(cuMemFree(out));
}

int main(int argc, char **argv) {
    test_begin("drv_module");
    bool supported = arg_flag(argc, argv, "--expect-supported");
    CU_CHECK(cuInit(0));
    CUdevice dev;
    CU_CHECK(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CU_CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CU_CHECK(cuCtxSetCurrent(ctx));

    EXPECT(module_fatbin_len > 16, "embedded fatbin is empty");
    unsigned magic = 0;
    memcpy(&magic, module_fatbin, 4);
    EXPECT(magic == 0xBA55ED50u, "embedded fatbin magic %08x", magic);

    CUmodule m1 = nullptr;
    CU_CHECK(cuModuleLoadData(&m1, module_fatbin));
    ok("cuModuleLoadData(fatbin of %u bytes)", (unsigned)module_fatbin_len);
    check_module(m1, "fatbin", supported);

    // A second load of the same image is an independent module.
    CUmodule m2 = nullptr;
    CU_CHECK(cuModuleLoadData(&m2, module_fatbin));
    EXPECT(m2 != m1, "second load returned the same handle");
    CUdeviceptr g1 = 0, g2 = 0;
    CU_CHECK(cuModuleGetGlobal(&g1, nullptr, m1, "table"));
    CU_CHECK(cuModuleGetGlobal(&g2, nullptr, m2, "table"));
    EXPECT(g1 != g2, "two loads share the global's storage");
    int first = -1;
    CU_CHECK(cuMemcpyDtoH(&first, g2, sizeof first));
    EXPECT(first == 0, "the second module's table[0] = %d (sees the first module's write?)", first);
    CU_CHECK(cuModuleUnload(m2));
    ok("a second load has its own globals; cuModuleUnload");

    CUmodule mp = nullptr;
    CU_CHECK(cuModuleLoadData(&mp, module_ptx));
    ok("cuModuleLoadData(PTX text)");
    check_module(mp, "ptx", supported);
    CU_CHECK(cuModuleUnload(mp));

    // The JIT linker: one PTX input (given by length, without its NUL) links to an image that
    // loads and runs like the PTX itself; several inputs are refused, not half-linked.
    CUlinkState link = nullptr;
    char info[64] = "x", err[64] = "x";
    CUjit_option lopts[] = {CU_JIT_INFO_LOG_BUFFER, CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES, CU_JIT_ERROR_LOG_BUFFER,
                            CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
    void *lvals[] = {info, (void *)sizeof info, err, (void *)sizeof err};
    CU_CHECK(cuLinkCreate(4, lopts, lvals, &link));
    CU_CHECK(cuLinkAddData(link, CU_JIT_INPUT_PTX, (void *)module_ptx, strlen((const char *)module_ptx), "kernels.ptx",
                           0, nullptr, nullptr));
    void *linked = nullptr;
    size_t linked_size = 0;
    CU_CHECK(cuLinkComplete(link, &linked, &linked_size));
    EXPECT(linked != nullptr && linked_size > 0, "cuLinkComplete gave no image");
    CUmodule ml = nullptr;
    CU_CHECK(cuModuleLoadData(&ml, linked));
    check_module(ml, "linked PTX", supported);
    CU_CHECK(cuModuleUnload(ml));
    CU_CHECK(cuLinkDestroy(link));
    EXPECT(info[0] == 0 && err[0] == 0, "the JIT logs were not written");
    ok("cuLinkCreate/AddData/Complete/Destroy: one PTX image links and runs like the PTX");

    // Two relocatable PTX modules: the kernel calls scale() and reads offset from the other;
    // each has its own static helper() (v + 1 and v * 3), which must not be confused.
    auto link_two = [&](const char *a, const char *b, CUmodule *m) -> CUresult {
        CUlinkState l = nullptr;
        CU_CHECK(cuLinkCreate(0, nullptr, nullptr, &l));
        CU_CHECK(cuLinkAddData(l, CU_JIT_INPUT_PTX, (void *)a, strlen(a), "a.ptx", 0, nullptr, nullptr));
        if (b) CU_CHECK(cuLinkAddData(l, CU_JIT_INPUT_PTX, (void *)b, strlen(b), "b.ptx", 0, nullptr, nullptr));
        void *img = nullptr;
        size_t img_size = 0;
        CUresult r = cuLinkComplete(l, &img, &img_size);
        if (r == CUDA_SUCCESS) r = cuModuleLoadData(m, img);
        CU_CHECK(cuLinkDestroy(l));
        return r;
    };
    CUmodule two = nullptr;
    CU_CHECK(link_two(drv_link_main_ptx, drv_link_lib_ptx, &two));
    CUfunction lf = nullptr;
    CU_CHECK(cuModuleGetFunction(&lf, two, "linked_fill"));
    if (supported) {
        const int n = 300;
        CUdeviceptr out = 0;
        CU_CHECK(cuMemAlloc(&out, n * sizeof(int)));
        int nn = n;
        void *args[] = {&out, &nn};
        CU_CHECK(cuLaunchKernel(lf, 3, 1, 1, 128, 1, 1, 0, nullptr, args, nullptr));
        int host[n];
        CU_CHECK(cuMemcpyDtoH(host, out, sizeof host));
        for (int i = 0; i < n; i++) EXPECT(host[i] == i * 3 + 1 + 1000, "linked_fill[%d] = %d", i, host[i]);
        CU_CHECK(cuMemFree(out));
    }
    CU_CHECK(cuModuleUnload(two));
    // Unresolved references and a definition given twice fail, as a linker fails.
    CUmodule bad_link = nullptr;
    CUresult lr = link_two(drv_link_main_ptx, nullptr, &bad_link);
    EXPECT(lr != CUDA_SUCCESS, "an unresolved reference linked");
    lr = link_two(drv_link_lib_ptx, drv_link_lib_ptx, &bad_link);
    EXPECT(lr != CUDA_SUCCESS, "a definition given twice linked");
    ok("cuLink* of two relocatable PTX modules: externs resolved, local names kept apart; undefined and duplicate symbols refused");

    static const unsigned char garbage[64] = {1, 2, 3, 4, 5, 6, 7, 8};
    CUmodule bad = nullptr;
    CUresult r = cuModuleLoadData(&bad, garbage);
    EXPECT(r != CUDA_SUCCESS, "cuModuleLoadData(garbage) succeeded");
    ok("cuModuleLoadData(garbage) fails: %d (%s)", (int)r, cu_err_name(r));

    CU_CHECK(cuModuleUnload(m1));
    CU_CHECK(cuDevicePrimaryCtxRelease(dev));
    return test_end();
}
