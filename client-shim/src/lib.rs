//! rgpu's `libcuda.so.1`: the CUDA driver API, forwarded to remote rgpu servers.
//!
//! Every function declared in cuda.h is exported (see `cuda_entry_points!` below and
//! `rgpu_shim_macros`); those not listed in `implemented` return `CUDA_ERROR_NOT_SUPPORTED`.

mod cuda;
mod entry;
mod proc_address;
pub mod r#impl;

// The only place a driver function becomes supported. Keep the list sorted (byte order).
rgpu_shim_macros::cuda_entry_points! {
    implemented: [
        cuGetProcAddress,
        cuGetProcAddress_v2,
    ],
}
