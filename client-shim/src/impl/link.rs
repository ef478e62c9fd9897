//! The JIT linker (cuLink*), over `objects::link`: one image in, the same image out; several
//! in, a link bundle out, which the server links when it is loaded.

use std::ffi::{c_char, c_void, CStr};

use crate::cuda::types::*;
use crate::objects::device_runtime;
use crate::objects::link::LinkState;
use crate::objects::module::image_bytes;
use crate::objects::objects;
use crate::runtime;

/// Answers the JIT options a caller may pass: the log buffers get empty logs (compilation
/// happens on the server, whose messages go to its log), the rest are hints.
unsafe fn answer_options(n: u32, options: *mut CUjit_option, values: *mut *mut c_void) -> CuResult<()> {
    if n == 0 {
        return Ok(());
    }
    if options.is_null() || values.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    type J = CUjit_option;
    for i in 0..n as usize {
        let (opt, val) = (*options.add(i), values.add(i));
        match opt {
            J::CU_JIT_INFO_LOG_BUFFER | J::CU_JIT_ERROR_LOG_BUFFER => {
                let buf = *val as *mut c_char;
                if !buf.is_null() {
                    *buf = 0;
                }
            }
            // Sizes are passed by value in the pointer slot; the driver writes back the bytes
            // it used.
            J::CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES | J::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES => *val = std::ptr::null_mut(),
            J::CU_JIT_WALL_TIME => *(val as *mut f32) = 0.0,
            _ => {}
        }
    }
    Ok(())
}

fn state(s: CUlinkState) -> CuResult<std::sync::Arc<LinkState>> {
    objects().links.get(s as usize as u64).ok_or(CuError::INVALID_HANDLE)
}

pub(crate) unsafe fn create_v2(n: u32, options: *mut CUjit_option, values: *mut *mut c_void, out: &mut CUlinkState) -> CuResult<()> {
    runtime::get()?;
    answer_options(n, options, values)?;
    let (h, _) = objects().links.insert(LinkState::default());
    *out = h as usize as CUlinkState;
    Ok(())
}

/// Takes one input image as cuModuleLoadData would take it.
fn add(s: &LinkState, ty: CUjitInputType, bytes: Vec<u8>, name: &str) -> CuResult<()> {
    type T = CUjitInputType;
    let (ty, bytes) = match ty {
        // NVIDIA's device runtime is SASS only: rgpu links its own PTX for what of it
        // programs use (objects::device_runtime).
        T::CU_JIT_INPUT_LIBRARY if device_runtime::is_cudadevrt(&bytes) => {
            tracing::debug!("cuLinkAddData: {name:?} is the device runtime: linking rgpu's cooperative-groups PTX in its place");
            (T::CU_JIT_INPUT_PTX, device_runtime::COOPERATIVE_GROUPS_PTX.as_bytes().to_vec())
        }
        _ => (ty, bytes),
    };
    match ty {
        T::CU_JIT_INPUT_PTX | T::CU_JIT_INPUT_CUBIN | T::CU_JIT_INPUT_FATBINARY => {}
        _ => {
            tracing::warn!("cuLinkAddData: input {name:?} of type {} (object, library, NVVM IR) is not supported by rgpu", ty.0);
            return Err(CuError::NOT_SUPPORTED);
        }
    }
    s.inputs.lock().unwrap_or_else(|e| e.into_inner()).push((ty.0 as u32, bytes));
    Ok(())
}

#[allow(clippy::too_many_arguments)] // the driver API's signature
pub(crate) unsafe fn add_data_v2(
    s: CUlinkState,
    ty: CUjitInputType,
    data: *mut c_void,
    size: usize,
    name: *const c_char,
    n: u32,
    options: *mut CUjit_option,
    values: *mut *mut c_void,
) -> CuResult<()> {
    let st = state(s)?;
    answer_options(n, options, values)?;
    if data.is_null() || size == 0 {
        return Err(CuError::INVALID_VALUE);
    }
    let mut bytes = std::slice::from_raw_parts(data as *const u8, size).to_vec();
    if ty == CUjitInputType::CU_JIT_INPUT_PTX && bytes.last() != Some(&0) {
        // PTX comes with its length, not always a terminator; images are read up to the NUL.
        bytes.push(0);
    }
    let name = if name.is_null() { "" } else { CStr::from_ptr(name).to_str().unwrap_or("") };
    add(&st, ty, bytes, name)
}

pub(crate) unsafe fn add_file_v2(
    s: CUlinkState,
    ty: CUjitInputType,
    path: *const c_char,
    n: u32,
    options: *mut CUjit_option,
    values: *mut *mut c_void,
) -> CuResult<()> {
    let st = state(s)?;
    answer_options(n, options, values)?;
    if path.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    let path = CStr::from_ptr(path).to_str().map_err(|_| CuError::INVALID_VALUE)?;
    let mut bytes = std::fs::read(path).map_err(|_| CuError::FILE_NOT_FOUND)?;
    if ty == CUjitInputType::CU_JIT_INPUT_PTX {
        bytes.push(0);
    }
    add(&st, ty, bytes, path)
}

pub(crate) unsafe fn complete(s: CUlinkState, cubin: &mut *mut c_void, size: Option<&mut usize>) -> CuResult<()> {
    let st = state(s)?;
    let mut inputs = st.inputs.lock().unwrap_or_else(|e| e.into_inner());
    if inputs.is_empty() {
        return Err(CuError::INVALID_VALUE);
    }
    // An image must be whole: its headers may not claim more bytes than were added. Zero
    // padding keeps the header reads inside the buffer and leaves PTX (read to its NUL) as it is.
    for (_, image) in inputs.iter_mut() {
        if image.len() < 64 {
            image.resize(64, 0);
        }
        if image_bytes(image.as_ptr() as *const c_void)?.len() > image.len() {
            return Err(CuError::INVALID_IMAGE);
        }
    }
    // One cubin or fatbin is already linked; PTX goes through the server's linker even alone,
    // which refuses references nothing defines, as a driver's linker does.
    let single_ptx = inputs.len() == 1 && inputs[0].0 == CUjitInputType::CU_JIT_INPUT_PTX.0 as u32;
    let image = if inputs.len() == 1 && !single_ptx {
        inputs.remove(0).1
    } else {
        if inputs.len() > rgpu_protocol::bundle::MAX_INPUTS {
            return Err(CuError::INVALID_VALUE);
        }
        let parts: Vec<rgpu_protocol::bundle::Input<'_>> =
            inputs.iter().map(|(kind, bytes)| rgpu_protocol::bundle::Input { kind: *kind, bytes }).collect();
        rgpu_protocol::bundle::encode(&parts)
    };
    let mut out = st.output.lock().unwrap_or_else(|e| e.into_inner());
    let image = out.insert(image);
    *cubin = image.as_mut_ptr() as *mut c_void;
    if let Some(n) = size {
        *n = image.len();
    }
    Ok(())
}

pub(crate) unsafe fn destroy(s: CUlinkState) -> CuResult<()> {
    objects().links.remove(s as usize as u64).map(|_| ()).ok_or(CuError::INVALID_HANDLE)
}
