//! Function attributes and parameter layouts (cuFunc*), all answered from what the server said
//! when it loaded the module. A CUkernel cast to a CUfunction is accepted, as cudart passes one.

use std::ffi::c_char;
use std::sync::atomic::Ordering;

use crate::cuda::types::*;
use crate::objects::library::resolve_function;
use crate::objects::module;
use crate::runtime;

pub(crate) unsafe fn get_attribute(pi: &mut i32, attrib: CUfunction_attribute, f: CUfunction) -> CuResult<()> {
    *pi = resolve_function(f)?.attribute(attrib)?;
    Ok(())
}

pub(crate) unsafe fn set_attribute(f: CUfunction, attrib: CUfunction_attribute, value: i32) -> CuResult<()> {
    let f = resolve_function(f)?;
    let optin = || runtime::get()?.device(f.device)?.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
    f.set_attribute(attrib, value, optin)
}

pub(crate) unsafe fn set_cache_config(f: CUfunction, config: CUfunc_cache) -> CuResult<()> {
    let config = checked_cache_config(config)?;
    resolve_function(f)?.cache_config.store(config, Ordering::Relaxed);
    Ok(())
}

/// cuFuncSetSharedMemConfig: as `cuCtxSetSharedMemConfig`, a known bank size changes
/// nothing (banks are four bytes and fixed).
pub(crate) unsafe fn set_shared_mem_config(f: CUfunction, config: CUsharedconfig) -> CuResult<()> {
    resolve_function(f)?;
    checked_shared_mem_config(config).map(|_| ())
}

/// A bank size the driver knows (default, four or eight bytes).
pub(crate) fn checked_shared_mem_config(config: CUsharedconfig) -> CuResult<CUsharedconfig> {
    match config.0 {
        0..=2 => Ok(config),
        _ => Err(CuError::INVALID_VALUE),
    }
}

/// A cache preference the driver knows (`CU_FUNC_CACHE_PREFER_NONE` to `_PREFER_EQUAL`):
/// any other is `CUDA_ERROR_INVALID_VALUE`, not a value kept and read back.
pub(crate) fn checked_cache_config(config: CUfunc_cache) -> CuResult<i32> {
    match config.0 {
        c @ 0..=3 => Ok(c as i32),
        _ => Err(CuError::INVALID_VALUE),
    }
}

pub(crate) unsafe fn get_param_info(f: CUfunction, index: usize, offset: Option<&mut usize>, size: Option<&mut usize>) -> CuResult<()> {
    resolve_function(f)?.param_info(index, offset, size)
}

pub(crate) unsafe fn get_param_count(f: CUfunction, count: &mut usize) -> CuResult<()> {
    *count = resolve_function(f)?.params.len();
    Ok(())
}

pub(crate) unsafe fn get_name(name: &mut *const c_char, f: CUfunction) -> CuResult<()> {
    *name = module::function(f)?.name.as_ptr();
    Ok(())
}

pub(crate) unsafe fn get_module(out: &mut CUmodule, f: CUfunction) -> CuResult<()> {
    *out = module::function(f)?.module as usize as CUmodule;
    Ok(())
}

pub(crate) unsafe fn is_loaded(state: &mut CUfunctionLoadingState, f: CUfunction) -> CuResult<()> {
    resolve_function(f)?;
    *state = CUfunctionLoadingState::CU_FUNCTION_LOADING_STATE_LOADED;
    Ok(())
}

pub(crate) unsafe fn load(f: CUfunction) -> CuResult<()> {
    resolve_function(f).map(|_| ())
}
