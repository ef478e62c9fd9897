/* rgpu-bindgen stand-in for <vdpau/vdpau.h>: only the types cudaVDPAU.h uses,
 * with the ABI of libvdpau's header (handles are uint32_t, VdpStatus is an
 * int-sized enum). */
#ifndef RGPU_STUB_VDPAU_H
#define RGPU_STUB_VDPAU_H
#include <stdint.h>
typedef uint32_t VdpDevice;
typedef uint32_t VdpVideoSurface;
typedef uint32_t VdpOutputSurface;
typedef uint32_t VdpFuncId;
typedef int VdpStatus;
typedef VdpStatus VdpGetProcAddress(VdpDevice device, VdpFuncId function_id, void **function_pointer);
#endif
