//! What every exported entry point runs (see `rgpu_shim_macros::cuda_entry_points!`).
//!
//! No Rust panic may unwind into a C caller, and an unimplemented function must answer honestly:
//! `call` turns a panic into `CUDA_ERROR_UNKNOWN` (plus an error log), and `unsupported` returns
//! `CUDA_ERROR_NOT_SUPPORTED` after logging the name once.

use crate::cuda::types::{cu_result, CUresult, CuError, CuResult};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};

/// Runs an implemented entry point: traces the call, catches any panic.
pub(crate) fn call(name: &'static str, f: impl FnOnce() -> CuResult<()>) -> CUresult {
    // Tracing runs inside the guard too: at process exit (cudart releases
    // its contexts from __cxa_finalize) thread-locals may already be gone,
    // and touching them panics.
    match catch_unwind(AssertUnwindSafe(|| {
        tracing::trace!(target: "rgpu::cuda", "{name}");
        let result = f();
        if let Err(e) = &result {
            tracing::trace!(target: "rgpu::cuda", "{name} -> {e:?}");
        }
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

/// Runs an entry point rgpu does not implement: logs `name` the first time (`logged` is that
/// entry point's own flag, so this takes no lock) and returns `CUDA_ERROR_NOT_SUPPORTED`.
pub(crate) fn unsupported(name: &'static str, logged: &AtomicBool) -> CUresult {
    if !logged.swap(true, Ordering::Relaxed) {
        tracing::warn!(target: "rgpu::cuda", "{name} is not supported by rgpu; returning CUDA_ERROR_NOT_SUPPORTED");
    }
    CuError::NOT_SUPPORTED.into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    /// A `tracing` writer that appends to a shared buffer.
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);
    impl Write for Buffer {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn captured<R>(f: impl FnOnce() -> R) -> (R, String) {
        let buf = Buffer::default();
        let writer = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .finish();
        let r = tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        (r, text)
    }

    #[test]
    fn a_panic_becomes_unknown() {
        let (r, log) = captured(|| call("cuTestPanic", || panic!("boom")));
        assert_eq!(r, CUresult::CUDA_ERROR_UNKNOWN);
        assert!(log.contains("cuTestPanic panicked: boom"), "{log}");
    }

    #[test]
    fn results_pass_through() {
        assert_eq!(call("cuTestOk", || Ok(())), CUresult::CUDA_SUCCESS);
        assert_eq!(call("cuTestErr", || Err(CuError::INVALID_VALUE)), CUresult::CUDA_ERROR_INVALID_VALUE);
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
}
