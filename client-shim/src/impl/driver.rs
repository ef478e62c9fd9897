//! Driver-level entry points: initialisation, versions, error strings, and
//! the two lookups NVIDIA's runtime uses to find everything else
//! (cuGetProcAddress and cuGetExportTable).

use std::ffi::{c_char, c_int, c_void};

use crate::cuda::types::*;
use crate::runtime;

pub(crate) unsafe fn init(flags: u32) -> CuResult<()> {
    if flags != 0 {
        return Err(CuError::INVALID_VALUE);
    }
    runtime::init().map(|_| ())
}

pub(crate) unsafe fn driver_get_version(version: &mut c_int) -> CuResult<()> {
    *version = runtime::DRIVER_VERSION;
    Ok(())
}

pub(crate) unsafe fn get_error_string(error: CUresult, out: *mut *const c_char) -> CuResult<()> {
    describe(error, out, |i| i.description.as_ptr())
}

pub(crate) unsafe fn get_error_name(error: CUresult, out: &mut *const c_char) -> CuResult<()> {
    describe(error, out, |i| i.name.as_ptr())
}

/// Writes a static string about `error`, or null and INVALID_VALUE for a
/// value cuda.h does not name, as the real driver does.
unsafe fn describe(error: CUresult, out: *mut *const c_char, pick: fn(&CuResultInfo) -> *const c_char) -> CuResult<()> {
    match cu_result_info(error.0) {
        Some(i) => {
            *out = pick(i);
            Ok(())
        }
        None => {
            *out = std::ptr::null();
            Err(CuError::INVALID_VALUE)
        }
    }
}

pub(crate) unsafe fn get_export_table(table: *mut *const c_void, id: *const CUuuid) -> CuResult<()> {
    crate::dark_api::get_export_table(table, id)
}

/// `cuGetProcAddress` (CUDA 11.3 signature).
pub(crate) unsafe fn get_proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: cuuint64_t,
) -> CuResult<()> {
    crate::proc_address::get_proc_address(symbol, pfn, cuda_version, flags)
}

/// `cuGetProcAddress_v2` (CUDA 12.0+).
pub(crate) unsafe fn get_proc_address_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: cuuint64_t,
    status: *mut CUdriverProcAddressQueryResult,
) -> CuResult<()> {
    crate::proc_address::get_proc_address_v2(symbol, pfn, cuda_version, flags, status)
}

/// This thread's capture mode decides which calls a capture forbids (`objects::capture`).
pub(crate) unsafe fn thread_exchange_stream_capture_mode(mode: &mut CUstreamCaptureMode) -> CuResult<()> {
    type M = CUstreamCaptureMode;
    if ![M::CU_STREAM_CAPTURE_MODE_GLOBAL, M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, M::CU_STREAM_CAPTURE_MODE_RELAXED].contains(mode) {
        return Err(CuError::INVALID_VALUE);
    }
    *mode = crate::objects::capture::exchange_mode(*mode)?;
    Ok(())
}

pub(crate) unsafe fn user_object_create(out: &mut CUuserObject, ptr: *mut c_void, destroy: CUhostFn, initial: u32, flags: u32) -> CuResult<()> {
    // The one flag says the destructor need not be waited for; it never is waited for here.
    if flags & !CUuserObject_flags::CU_USER_OBJECT_NO_DESTRUCTOR_SYNC.0 != 0 {
        return Err(CuError::INVALID_VALUE);
    }
    let f = destroy.ok_or(CuError::INVALID_VALUE)?;
    let h = crate::objects::user_object::create(ptr as usize, f as usize, initial)?;
    *out = h as usize as CUuserObject;
    Ok(())
}

pub(crate) unsafe fn user_object_retain(o: CUuserObject, n: u32) -> CuResult<()> {
    crate::objects::user_object::retain(o as usize as u64, n)
}

pub(crate) unsafe fn user_object_release(o: CUuserObject, n: u32) -> CuResult<()> {
    crate::objects::user_object::release(o as usize as u64, n)
}

/// rgpu's warnings reach the program's log callbacks too (`objects::logs`).
pub(crate) unsafe fn logs_register_callback(
    callback: CUlogsCallback,
    user_data: *mut c_void,
    handle: Option<&mut CUlogsCallbackHandle>,
) -> CuResult<()> {
    let h = crate::objects::objects().logs.register(callback, user_data)?;
    if let Some(out) = handle {
        *out = h;
    }
    Ok(())
}

pub(crate) unsafe fn logs_unregister_callback(handle: CUlogsCallbackHandle) -> CuResult<()> {
    crate::objects::objects().logs.unregister(handle)
}
