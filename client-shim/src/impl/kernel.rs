//! Kernels (CUkernel): a library's function, valid on every device; it
//! resolves to the CUfunction of the library's module on the device in use.

use std::ffi::{c_char, CString};
use std::sync::{Arc, LazyLock};

use crate::cuda::types::*;
use crate::handles::{tag, Table};

use super::{context, function, library, module};

pub struct Kernel {
    pub library: u64,
    pub name: CString,
}

pub static KERNELS: LazyLock<Table<Kernel>> = LazyLock::new(|| Table::new(tag::KERNEL));

pub fn mint(library: u64, name: &str) -> u64 {
    KERNELS.insert(Kernel { library, name: CString::new(name).unwrap_or_default() }).0
}

pub fn forget_library(lib: u64) {
    for h in KERNELS.select(|k| k.library == lib) {
        KERNELS.remove(h);
    }
}

pub fn is_kernel(h: u64) -> bool {
    KERNELS.get(h).is_some()
}

/// The function a kernel handle stands for on `dev`.
pub fn function_on(h: u64, dev: CUdevice) -> CuResult<u64> {
    let k = KERNELS.get(h).ok_or(CuError::INVALID_HANDLE)?;
    let lib = library::LIBRARIES.get(k.library).ok_or(CuError::INVALID_HANDLE)?;
    let m = module::MODULES.get(library::module_on(&lib, dev)?).ok_or(CuError::INVALID_HANDLE)?;
    let name = k.name.to_str().map_err(|_| CuError::NOT_FOUND)?;
    m.by_name.get(name).copied().ok_or(CuError::NOT_FOUND)
}

/// Resolves a CUfunction argument that may also be a CUkernel (cudart
/// launches kernels through cuLaunchKernel with the CUkernel cast).
pub fn resolve_function(f: u64) -> CuResult<Arc<module::Function>> {
    if let Some(func) = module::FUNCTIONS.get(f) {
        return Ok(func);
    }
    if is_kernel(f) {
        let dev = context::current_device()?;
        return module::FUNCTIONS.get(function_on(f, dev)?).ok_or(CuError::INVALID_HANDLE);
    }
    Err(CuError::INVALID_HANDLE)
}

pub(crate) unsafe fn get_function(out: *mut CUfunction, kernel: CUkernel) -> CuResult<()> {
    let out = out.as_mut().ok_or(CuError::INVALID_VALUE)?;
    let dev = context::current_device()?;
    *out = function_on(kernel as usize as u64, dev)? as usize as CUfunction;
    Ok(())
}

pub(crate) unsafe fn get_attribute(pi: *mut i32, attrib: CUfunction_attribute, kernel: CUkernel, dev: CUdevice) -> CuResult<()> {
    let f = function_on(kernel as usize as u64, dev)?;
    function::get_attribute(pi, attrib, f as usize as CUfunction)
}

pub(crate) unsafe fn set_attribute(attrib: CUfunction_attribute, val: i32, kernel: CUkernel, dev: CUdevice) -> CuResult<()> {
    let f = function_on(kernel as usize as u64, dev)?;
    function::set_attribute(f as usize as CUfunction, attrib, val)
}

pub(crate) unsafe fn set_cache_config(kernel: CUkernel, config: CUfunc_cache, dev: CUdevice) -> CuResult<()> {
    let f = function_on(kernel as usize as u64, dev)?;
    function::set_cache_config(f as usize as CUfunction, config)
}

pub(crate) unsafe fn get_name(name: *mut *const c_char, kernel: CUkernel) -> CuResult<()> {
    let name = name.as_mut().ok_or(CuError::INVALID_VALUE)?;
    let k = KERNELS.get(kernel as usize as u64).ok_or(CuError::INVALID_HANDLE)?;
    // The kernel object lives until its library is unloaded; the name with it.
    *name = k.name.as_ptr();
    Ok(())
}

pub(crate) unsafe fn get_library(out: *mut CUlibrary, kernel: CUkernel) -> CuResult<()> {
    let out = out.as_mut().ok_or(CuError::INVALID_VALUE)?;
    let k = KERNELS.get(kernel as usize as u64).ok_or(CuError::INVALID_HANDLE)?;
    *out = k.library as usize as CUlibrary;
    Ok(())
}

pub(crate) unsafe fn get_param_info(kernel: CUkernel, index: usize, offset: *mut usize, size: *mut usize) -> CuResult<()> {
    let dev = context::current_device()?;
    let f = function_on(kernel as usize as u64, dev)?;
    function::get_param_info(f as usize as CUfunction, index, offset, size)
}
