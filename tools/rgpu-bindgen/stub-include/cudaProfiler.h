/* rgpu-bindgen stand-in for NVIDIA's <cudaProfiler.h>, which the pip wheels
 * used to generate rgpu's files do not ship (it comes in a separate wheel).
 * The declarations restate the signatures of cudaProfilerTypedefs.h
 * (PFN_cuProfilerInitialize_v4000, PFN_cuProfilerStart_v4000,
 * PFN_cuProfilerStop_v4000); cudart 12.9 and 13.5 still look all three up. */
#ifndef RGPU_STUB_CUDAPROFILER_H
#define RGPU_STUB_CUDAPROFILER_H
#include <cuda.h>
#ifdef __cplusplus
extern "C" {
#endif
/** Profiler output modes (removed from cudaProfiler.h in CUDA 12.0). */
typedef enum CUoutput_mode_enum {
    CU_OUT_KEY_VALUE_PAIR = 0x00, /**< Output mode Key-Value pair format. */
    CU_OUT_CSV            = 0x01  /**< Output mode Comma separated values format. */
} CUoutput_mode;
CUresult CUDAAPI cuProfilerInitialize(const char *configFile, const char *outputFile, CUoutput_mode outputMode);
CUresult CUDAAPI cuProfilerStart(void);
CUresult CUDAAPI cuProfilerStop(void);
#ifdef __cplusplus
}
#endif
#endif
