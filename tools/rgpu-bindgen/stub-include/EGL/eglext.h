/* rgpu-bindgen stand-in for <EGL/eglext.h>: see egl.h beside it. */
#ifndef RGPU_STUB_EGLEXT_H
#define RGPU_STUB_EGLEXT_H
#include "egl.h"
typedef void *EGLImageKHR;
typedef void *EGLStreamKHR;
typedef void *EGLSyncKHR;
#endif
