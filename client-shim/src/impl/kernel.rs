//! Kernels (cuKernel*): a library's function, valid on every device; it resolves to the
//! CUfunction of the library's module on the device in use (`objects::library`).

use std::ffi::c_char;

use crate::cuda::types::*;
use crate::objects::library::{self as libraries, function_on};
use crate::objects::{context, module};
use crate::runtime;

fn function(kernel: CUkernel, dev: CUdevice) -> CuResult<std::sync::Arc<module::Function>> {
    module::function(function_on(kernel as usize as u64, dev)? as usize as CUfunction)
}

pub(crate) unsafe fn get_function(out: &mut CUfunction, kernel: CUkernel) -> CuResult<()> {
    let dev = context::current_device()?;
    *out = function_on(kernel as usize as u64, dev)? as usize as CUfunction;
    Ok(())
}

pub(crate) unsafe fn get_attribute(pi: &mut i32, attrib: CUfunction_attribute, kernel: CUkernel, dev: CUdevice) -> CuResult<()> {
    *pi = function(kernel, dev)?.attribute(attrib)?;
    Ok(())
}

pub(crate) unsafe fn set_attribute(attrib: CUfunction_attribute, val: i32, kernel: CUkernel, dev: CUdevice) -> CuResult<()> {
    let optin = || runtime::get()?.device(dev)?.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
    function(kernel, dev)?.set_attribute(attrib, val, optin)
}

pub(crate) unsafe fn set_cache_config(kernel: CUkernel, config: CUfunc_cache, dev: CUdevice) -> CuResult<()> {
    let config = super::function::checked_cache_config(config)?;
    function(kernel, dev)?.cache_config.store(config, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

pub(crate) unsafe fn get_name(name: &mut *const c_char, kernel: CUkernel) -> CuResult<()> {
    // The kernel object lives until its library is unloaded; the name with it.
    *name = libraries::kernel(kernel)?.name.as_ptr();
    Ok(())
}

pub(crate) unsafe fn get_library(out: &mut CUlibrary, kernel: CUkernel) -> CuResult<()> {
    *out = libraries::kernel(kernel)?.library as usize as CUlibrary;
    Ok(())
}

pub(crate) unsafe fn get_param_info(kernel: CUkernel, index: usize, offset: Option<&mut usize>, size: Option<&mut usize>) -> CuResult<()> {
    let f = function(kernel, context::current_device()?)?;
    f.param_info(index, offset, size)
}
