//! What every exported entry point runs (see `rgpu_shim_macros::cuda_entry_points!`).
//!
//! No Rust panic may unwind into a C caller, and an unimplemented function must answer honestly:
//! `call` turns a panic into `CUDA_ERROR_UNKNOWN` (plus an error log), and `unsupported` returns
//! `CUDA_ERROR_NOT_SUPPORTED` after logging the name once.
//!
//! [`FromCuda`] is how the raw C arguments become the typed parameters an implementation
//! declares, once, at the boundary: implementations never check an out-pointer for null.

use crate::cuda::types::{cu_result, CUresult, CuError, CuResult};
use std::fmt::Debug;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};

/// A conversion from a raw C argument (`Raw`) to what an implementation takes.
pub(crate) trait FromCuda<Raw>: Sized {
    /// # Safety
    /// A pointer argument must be valid for the call, as the driver API requires of callers.
    unsafe fn from_cuda(raw: Raw) -> CuResult<Self>;
}

/// Any argument as it came.
impl<T: Copy> FromCuda<T> for T {
    unsafe fn from_cuda(raw: T) -> CuResult<T> {
        Ok(raw)
    }
}

/// A required out-pointer: null is `CUDA_ERROR_INVALID_VALUE`, as every driver function
/// answers for a missing result pointer. The reference lives for the call only.
impl<'a, T> FromCuda<*mut T> for &'a mut T {
    unsafe fn from_cuda(raw: *mut T) -> CuResult<&'a mut T> {
        raw.as_mut().ok_or(CuError::INVALID_VALUE)
    }
}

/// An optional out-pointer (the driver writes it only when given).
impl<'a, T> FromCuda<*mut T> for Option<&'a mut T> {
    unsafe fn from_cuda(raw: *mut T) -> CuResult<Option<&'a mut T>> {
        Ok(raw.as_mut())
    }
}

/// A required input structure passed by pointer.
impl<'a, T> FromCuda<*const T> for &'a T {
    unsafe fn from_cuda(raw: *const T) -> CuResult<&'a T> {
        raw.as_ref().ok_or(CuError::INVALID_VALUE)
    }
}

/// Runs an implemented entry point: traces the call with its arguments and result (at
/// `RGPU_LOG=trace`; when that level is off, the check is one load and the arguments are never
/// formatted), and catches any panic.
pub(crate) fn call(name: &'static str, args: &[&dyn Debug], f: impl FnOnce() -> CuResult<()>) -> CUresult {
    // Tracing runs inside the guard too: at process exit (cudart releases
    // its contexts from __cxa_finalize) thread-locals may already be gone,
    // and touching them panics.
    match catch_unwind(AssertUnwindSafe(|| {
        if !tracing::enabled!(target: "rgpu::cuda", tracing::Level::TRACE) {
            return f();
        }
        let span = tracing::trace_span!(target: "rgpu::cuda", "call", function = name);
        let _entered = span.enter();
        let result = f();
        tracing::trace!(target: "rgpu::cuda", "{name}({}) -> {}", Args(args), Outcome(&result));
        result
    })) {
        Ok(result) => cu_result(result),
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("(non-string panic payload)");
            // The logging machinery may be what panicked (its thread-locals
            // are gone at exit): then say it on plain stderr.
            let logged = catch_unwind(AssertUnwindSafe(|| {
                tracing::error!(target: "rgpu::cuda", "{name} panicked: {msg}; returning CUDA_ERROR_UNKNOWN")
            }));
            if logged.is_err() {
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "rgpu: {name} panicked: {msg}; returning CUDA_ERROR_UNKNOWN");
            }
            CuError::UNKNOWN.into()
        }
    }
}

struct Args<'a>(&'a [&'a dyn Debug]);

impl std::fmt::Display for Args<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, a) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{a:?}")?;
        }
        Ok(())
    }
}

struct Outcome<'a>(&'a CuResult<()>);

impl std::fmt::Display for Outcome<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Ok(()) => f.write_str("CUDA_SUCCESS"),
            Err(e) => write!(f, "{e:?}"),
        }
    }
}

/// Runs an entry point rgpu does not implement: logs `name` the first time (`logged` is that
/// entry point's own flag, so this takes no lock) and returns `CUDA_ERROR_NOT_SUPPORTED`.
pub(crate) fn unsupported(name: &'static str, logged: &AtomicBool) -> CUresult {
    if !logged.swap(true, Ordering::Relaxed) {
        tracing::warn!(target: "rgpu::cuda", "{name} is not supported by rgpu; returning CUDA_ERROR_NOT_SUPPORTED");
        let _ = catch_unwind(|| {
            crate::objects::objects().logs.deliver(
                crate::cuda::types::CUlogLevel::CU_LOG_LEVEL_WARNING,
                &format!("rgpu: {name} is not supported; it returns CUDA_ERROR_NOT_SUPPORTED"),
            )
        });
    }
    CuError::NOT_SUPPORTED.into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log_capture::captured;
    use std::sync::Mutex;

    #[test]
    fn a_panic_becomes_unknown() {
        let (r, log) = captured(|| call("cuTestPanic", &[], || panic!("boom")));
        assert_eq!(r, CUresult::CUDA_ERROR_UNKNOWN);
        assert!(log.contains("cuTestPanic panicked: boom"), "{log}");
    }

    #[test]
    fn results_pass_through() {
        assert_eq!(call("cuTestOk", &[], || Ok(())), CUresult::CUDA_SUCCESS);
        assert_eq!(call("cuTestErr", &[], || Err(CuError::INVALID_VALUE)), CUresult::CUDA_ERROR_INVALID_VALUE);
    }

    /// At trace level a call is logged with its arguments and its result.
    #[test]
    fn trace_shows_arguments_and_result() {
        let (r, log) = captured(|| call("cuTestArgs", &[&7i32, &0x1000usize, &CUresult::CUDA_SUCCESS], || Err(CuError::NOT_READY)));
        assert_eq!(r, CUresult::CUDA_ERROR_NOT_READY);
        assert!(log.contains("cuTestArgs(7, 4096, cudaError_enum(0)) -> CUDA_ERROR_NOT_READY"), "{log}");
    }

    /// The conversions the entry points apply: a null required pointer is refused before the
    /// implementation runs, an optional one becomes `None`.
    #[test]
    fn from_cuda_checks_pointers() {
        let mut x = 5u32;
        unsafe {
            let r: &mut u32 = FromCuda::from_cuda(&mut x as *mut u32).unwrap();
            *r = 6;
            assert_eq!(x, 6);
            assert_eq!(<&mut u32 as FromCuda<*mut u32>>::from_cuda(std::ptr::null_mut()).err(), Some(CuError::INVALID_VALUE));
            assert!(<Option<&mut u32> as FromCuda<*mut u32>>::from_cuda(std::ptr::null_mut()).unwrap().is_none());
            assert_eq!(<&u32 as FromCuda<*const u32>>::from_cuda(std::ptr::null()).err(), Some(CuError::INVALID_VALUE));
            assert_eq!(<i32 as FromCuda<i32>>::from_cuda(-3), Ok(-3));
        }
    }

    /// An unimplemented export returns 801 and warns once, however often it is called.
    #[test]
    fn unimplemented_export_returns_not_supported_and_logs_once() {
        type CtxDetach = unsafe extern "C" fn(crate::cuda::types::CUcontext) -> CUresult;
        let addr = crate::symbol_address("cuCtxDetach").expect("cuCtxDetach is exported");
        // SAFETY: the address is the generated `cuCtxDetach` entry point, which has this type.
        let f: CtxDetach = unsafe { std::mem::transmute(addr) };
        let (results, log) = captured(|| {
            // SAFETY: the stub reads no arguments.
            (0..3).map(|_| unsafe { f(std::ptr::null_mut()) }).collect::<Vec<_>>()
        });
        assert!(results.iter().all(|r| r.0 == 801), "{results:?}");
        assert_eq!(log.matches("cuCtxDetach is not supported").count(), 1, "{log}");
    }

    /// A log callback the program registered hears of an unsupported function, once; after
    /// unregistering, nothing.
    #[test]
    fn log_callbacks_hear_of_unsupported_functions() {
        use crate::cuda::types::{CUlogLevel, CUlogsCallbackHandle};
        use std::ffi::{c_char, c_void};
        static HEARD: Mutex<Vec<(u32, String)>> = Mutex::new(Vec::new());
        unsafe extern "C" fn cb(_data: *mut c_void, level: CUlogLevel, msg: *mut c_char, len: usize) {
            let text = String::from_utf8_lossy(std::slice::from_raw_parts(msg as *const u8, len)).into_owned();
            HEARD.lock().unwrap().push((level.0, text));
        }
        type Register = unsafe extern "C" fn(crate::cuda::types::CUlogsCallback, *mut c_void, *mut CUlogsCallbackHandle) -> CUresult;
        type Unregister = unsafe extern "C" fn(CUlogsCallbackHandle) -> CUresult;
        type Probe = unsafe extern "C" fn(*mut c_void) -> CUresult;
        // SAFETY: the generated entry points with these signatures.
        let (register, unregister, probe): (Register, Unregister, Probe) = unsafe {
            (
                std::mem::transmute(crate::symbol_address("cuLogsRegisterCallback").unwrap()),
                std::mem::transmute(crate::symbol_address("cuLogsUnregisterCallback").unwrap()),
                std::mem::transmute(crate::symbol_address("cuDeviceGetLuid").unwrap()),
            )
        };
        let mut h: CUlogsCallbackHandle = std::ptr::null_mut();
        unsafe {
            assert_eq!(register(Some(cb), std::ptr::null_mut(), &mut h), CUresult::CUDA_SUCCESS);
            assert_eq!(probe(std::ptr::null_mut()).0, 801);
            assert_eq!(probe(std::ptr::null_mut()).0, 801);
            assert_eq!(unregister(h), CUresult::CUDA_SUCCESS);
            assert_eq!(unregister(h), CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        // Other tests may call other unsupported functions meanwhile: count only this one's.
        let heard: Vec<(u32, String)> =
            HEARD.lock().unwrap().iter().filter(|(_, m)| m.contains("cuDeviceGetLuid")).cloned().collect();
        assert_eq!(heard.len(), 1, "{heard:?}");
        assert_eq!(heard[0].0, CUlogLevel::CU_LOG_LEVEL_WARNING.0);
        assert!(heard[0].1.contains("cuDeviceGetLuid is not supported"), "{heard:?}");
    }
}
