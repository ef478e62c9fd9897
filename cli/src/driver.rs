#![allow(non_snake_case)]
//! The driver API as `demo` and `bench` call it: rgpu's shim loaded with
//! libloading, exactly the library a CUDA program would get.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};

pub use rgpu_cuda_types::CUresult as CuResult;
use rgpu_cuda_types::{CUdevice_attribute, CuError};
type Ctx = *mut c_void;
type Stream = *mut c_void;
type Event = *mut c_void;
type Module = *mut c_void;
type Function = *mut c_void;

macro_rules! driver_fns {
    ($($name:ident: fn($($arg:ty),*);)*) => {
        #[allow(non_snake_case)]
        pub struct Driver {
            _lib: libloading::Library,
            $(pub $name: unsafe extern "C" fn($($arg),*) -> CuResult,)*
        }

        impl Driver {
            pub fn load(path: &Path) -> Result<Driver> {
                // SAFETY: loading our own shim, whose initialisers only set up state.
                let lib = unsafe { libloading::Library::new(path) }
                    .with_context(|| format!("cannot load {}", path.display()))?;
                $(let $name = unsafe {
                    *lib.get::<unsafe extern "C" fn($($arg),*) -> CuResult>(concat!(stringify!($name), "\0").as_bytes())
                        .with_context(|| format!("{} lacks {}", path.display(), stringify!($name)))?
                };)*
                Ok(Driver { _lib: lib, $($name,)* })
            }
        }
    };
}

driver_fns! {
    cuInit: fn(c_uint);
    cuDeviceGetCount: fn(*mut c_int);
    cuDeviceGetName: fn(*mut c_char, c_int, c_int);
    cuDeviceTotalMem_v2: fn(*mut usize, c_int);
    cuDeviceGetAttribute: fn(*mut c_int, CUdevice_attribute, c_int);
    cuDevicePrimaryCtxRetain: fn(*mut Ctx, c_int);
    cuCtxSetCurrent: fn(Ctx);
    cuCtxSynchronize: fn();
    cuMemAlloc_v2: fn(*mut u64, usize);
    cuMemFree_v2: fn(u64);
    cuMemcpyHtoD_v2: fn(u64, *const c_void, usize);
    cuMemcpyDtoH_v2: fn(*mut c_void, u64, usize);
    cuMemcpyDtoD_v2: fn(u64, u64, usize);
    cuMemsetD32_v2: fn(u64, c_uint, usize);
    cuMemsetD32Async: fn(u64, c_uint, usize, Stream);
    cuMemHostAlloc: fn(*mut *mut c_void, usize, c_uint);
    cuMemFreeHost: fn(*mut c_void);
    cuMemcpyHtoDAsync_v2: fn(u64, *const c_void, usize, Stream);
    cuMemcpyDtoHAsync_v2: fn(*mut c_void, u64, usize, Stream);
    cuStreamSynchronize: fn(Stream);
    cuStreamCreate: fn(*mut Stream, c_uint);
    cuStreamQuery: fn(Stream);
    cuStreamDestroy_v2: fn(Stream);
    cuEventCreate: fn(*mut Event, c_uint);
    cuEventRecord: fn(Event, Stream);
    cuEventSynchronize: fn(Event);
    cuEventElapsedTime: fn(*mut f32, Event, Event);
    cuModuleLoadData: fn(*mut Module, *const c_void);
    cuModuleGetFunction: fn(*mut Function, Module, *const c_char);
    cuLaunchKernel: fn(Function, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, Stream, *mut *mut c_void, *mut *mut c_void);
}

impl Driver {
    /// Turns a CUresult into an error naming the call and the CUDA error.
    pub fn check(&self, what: &str, r: CuResult) -> Result<()> {
        r.into_result().map_err(|e| anyhow!("{what} failed: {} ({})", error_name(e), e.code()))
    }


    /// cuInit and the primary context of device `dev`, made current.
    pub fn open_device(&self, dev: c_int) -> Result<()> {
        unsafe {
            self.check("cuInit", (self.cuInit)(0))?;
            let mut n = 0;
            self.check("cuDeviceGetCount", (self.cuDeviceGetCount)(&mut n))?;
            if dev >= n {
                bail!("device {dev} requested, the servers export {n}");
            }
            let mut ctx = std::ptr::null_mut();
            self.check("cuDevicePrimaryCtxRetain", (self.cuDevicePrimaryCtxRetain)(&mut ctx, dev))?;
            self.check("cuCtxSetCurrent", (self.cuCtxSetCurrent)(ctx))
        }
    }

    pub fn device_name(&self, dev: c_int) -> String {
        let mut buf = [0 as c_char; 256];
        unsafe { (self.cuDeviceGetName)(buf.as_mut_ptr(), 256, dev) };
        unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
    }
}

/// The `CUDA_ERROR_*` name of a failure (the same table the shim answers `cuGetErrorName` from).
pub fn error_name(e: CuError) -> &'static str {
    if e.is_known() {
        e.name()
    } else {
        "unknown error"
    }
}

/// PTX of two kernels: `empty` (does nothing, for launch-rate measurements)
/// and `add_one` (x[i] += 1.0f over n floats).
pub const DEMO_PTX: &str = "\
.version 7.0
.target sm_50
.address_size 64

.visible .entry empty()
{
\tret;
}

.visible .entry add_one(
\t.param .u64 add_one_param_0,
\t.param .u32 add_one_param_1
)
{
\t.reg .pred \t%p<2>;
\t.reg .f32 \t%f<3>;
\t.reg .b32 \t%r<6>;
\t.reg .b64 \t%rd<5>;

\tld.param.u64 \t%rd1, [add_one_param_0];
\tld.param.u32 \t%r2, [add_one_param_1];
\tmov.u32 \t%r3, %ctaid.x;
\tmov.u32 \t%r4, %ntid.x;
\tmov.u32 \t%r5, %tid.x;
\tmad.lo.s32 \t%r1, %r3, %r4, %r5;
\tsetp.ge.s32 \t%p1, %r1, %r2;
\t@%p1 bra \tDONE;
\tcvta.to.global.u64 \t%rd2, %rd1;
\tmul.wide.s32 \t%rd3, %r1, 4;
\tadd.s64 \t%rd4, %rd2, %rd3;
\tld.global.f32 \t%f1, [%rd4];
\tadd.f32 \t%f2, %f1, 0f3F800000;
\tst.global.f32 \t[%rd4], %f2;
DONE:
\tret;
}
\0";
