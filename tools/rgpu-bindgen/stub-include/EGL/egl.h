/* rgpu-bindgen stand-in for <EGL/egl.h>: only the types cudaEGL.h uses, with the
 * ABI of the Khronos header (khronos_int32_t = int32_t, handles are void*). */
#ifndef RGPU_STUB_EGL_H
#define RGPU_STUB_EGL_H
#include <stdint.h>
typedef int32_t EGLint;
#endif
