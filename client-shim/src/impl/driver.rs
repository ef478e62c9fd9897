//! Driver-level entry points (`cuInit`, `cuGetProcAddress`, ...).

use crate::cuda::types::{cuuint64_t, CUdriverProcAddressQueryResult, CuResult};
use std::ffi::{c_char, c_int, c_void};

/// `cuGetProcAddress` (CUDA 11.3 signature).
pub(crate) unsafe fn get_proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: cuuint64_t,
) -> CuResult<()> {
    unsafe { crate::proc_address::get_proc_address(symbol, pfn, cuda_version, flags) }
}

/// `cuGetProcAddress_v2` (CUDA 12.0+).
pub(crate) unsafe fn get_proc_address_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: cuuint64_t,
    status: *mut CUdriverProcAddressQueryResult,
) -> CuResult<()> {
    unsafe { crate::proc_address::get_proc_address_v2(symbol, pfn, cuda_version, flags, status) }
}
