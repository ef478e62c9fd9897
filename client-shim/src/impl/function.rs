//! Function attributes and parameter layouts, all answered from what the
//! server said when it loaded the module.

use std::ffi::c_char;
use std::sync::atomic::Ordering;

use crate::cuda::types::*;

use super::{device, kernel, module};

type A = CUfunction_attribute;

pub(crate) unsafe fn get_attribute(pi: *mut i32, attrib: CUfunction_attribute, f: CUfunction) -> CuResult<()> {
    let pi = pi.as_mut().ok_or(CuError::INVALID_VALUE)?;
    let f = kernel::resolve_function(f as usize as u64)?;
    *pi = match attrib {
        A::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK => f.max_threads_per_block,
        A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES => f.shared_size_bytes,
        A::CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES => f.const_size_bytes,
        A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES => f.local_size_bytes,
        A::CU_FUNC_ATTRIBUTE_NUM_REGS => f.num_regs,
        A::CU_FUNC_ATTRIBUTE_PTX_VERSION => f.ptx_version,
        A::CU_FUNC_ATTRIBUTE_BINARY_VERSION => f.binary_version,
        A::CU_FUNC_ATTRIBUTE_CACHE_MODE_CA => 0,
        A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES => f.max_dynamic_shared.load(Ordering::Relaxed),
        A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT => f.carveout.load(Ordering::Relaxed),
        A::CU_FUNC_ATTRIBUTE_CLUSTER_SIZE_MUST_BE_SET => 0,
        A::CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH
        | A::CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT
        | A::CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH => 0,
        A::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED => 0,
        A::CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE => 0,
        _ => return Err(CuError::INVALID_VALUE),
    };
    Ok(())
}

pub(crate) unsafe fn set_attribute(f: CUfunction, attrib: CUfunction_attribute, value: i32) -> CuResult<()> {
    let f = kernel::resolve_function(f as usize as u64)?;
    match attrib {
        A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES => {
            let optin = device::attribute(
                f.device,
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN.0,
            )?;
            if value < 0 || value + f.shared_size_bytes > optin {
                return Err(CuError::INVALID_VALUE);
            }
            f.max_dynamic_shared.store(value, Ordering::Relaxed);
        }
        A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT => {
            if !(-1..=100).contains(&value) {
                return Err(CuError::INVALID_VALUE);
            }
            f.carveout.store(value, Ordering::Relaxed);
        }
        _ => return Err(CuError::INVALID_VALUE),
    }
    Ok(())
}

pub(crate) unsafe fn set_cache_config(f: CUfunction, config: CUfunc_cache) -> CuResult<()> {
    let f = kernel::resolve_function(f as usize as u64)?;
    f.cache_config.store(config.0 as i32, Ordering::Relaxed);
    Ok(())
}

pub(crate) unsafe fn get_param_info(f: CUfunction, index: usize, offset: *mut usize, size: *mut usize) -> CuResult<()> {
    let f = kernel::resolve_function(f as usize as u64)?;
    let &(o, s) = f.params.get(index).ok_or(CuError::INVALID_VALUE)?;
    if let Some(p) = offset.as_mut() {
        *p = o as usize;
    }
    if let Some(p) = size.as_mut() {
        *p = s as usize;
    }
    Ok(())
}

pub(crate) unsafe fn get_param_count(f: CUfunction, count: *mut usize) -> CuResult<()> {
    let count = count.as_mut().ok_or(CuError::INVALID_VALUE)?;
    *count = kernel::resolve_function(f as usize as u64)?.params.len();
    Ok(())
}

pub(crate) unsafe fn get_name(name: *mut *const c_char, f: CUfunction) -> CuResult<()> {
    let name = name.as_mut().ok_or(CuError::INVALID_VALUE)?;
    let f = module::FUNCTIONS.get(f as usize as u64).ok_or(CuError::INVALID_HANDLE)?;
    *name = f.name.as_ptr();
    Ok(())
}

pub(crate) unsafe fn get_module(out: *mut CUmodule, f: CUfunction) -> CuResult<()> {
    let out = out.as_mut().ok_or(CuError::INVALID_VALUE)?;
    let f = module::FUNCTIONS.get(f as usize as u64).ok_or(CuError::INVALID_HANDLE)?;
    *out = f.module as usize as CUmodule;
    Ok(())
}

pub(crate) unsafe fn is_loaded(state: *mut CUfunctionLoadingState, f: CUfunction) -> CuResult<()> {
    let state = state.as_mut().ok_or(CuError::INVALID_VALUE)?;
    kernel::resolve_function(f as usize as u64)?;
    *state = CUfunctionLoadingState::CU_FUNCTION_LOADING_STATE_LOADED;
    Ok(())
}

pub(crate) unsafe fn load(f: CUfunction) -> CuResult<()> {
    kernel::resolve_function(f as usize as u64).map(|_| ())
}
