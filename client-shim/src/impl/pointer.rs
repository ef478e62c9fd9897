//! Pointer attributes, from the shim's own tables of device allocations and
//! page-locked host memory.

use std::ffi::c_void;

use crate::cuda::types::*;
use crate::objects::{context, objects};

type P = CUpointer_attribute;

/// What is known of a pointer.
enum Kind {
    Device { start: u64, size: u64, device: i32, ctx: u64, managed: bool },
    Host { start: usize, size: usize },
    Unknown,
}

fn classify(ptr: u64) -> CuResult<Kind> {
    crate::runtime::get()?;
    let o = objects();
    if let Some((start, a)) = o.memory.find_alloc(ptr) {
        let ctx = if a.ctx != 0 { a.ctx } else { o.primaries.handle(a.device)? };
        let managed = o.managed.find(start).is_some();
        return Ok(Kind::Device { start, size: a.size, device: a.device, ctx, managed });
    }
    if let Some((start, h)) = o.memory.find_host(ptr as usize) {
        return Ok(Kind::Host { start, size: h.size });
    }
    Ok(Kind::Unknown)
}

/// Writes one attribute; `Ok(false)` when it does not apply to this pointer.
unsafe fn write(attr: CUpointer_attribute, data: *mut c_void, ptr: u64, kind: &Kind) -> CuResult<bool> {
    if data.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    match (attr, kind) {
        (P::CU_POINTER_ATTRIBUTE_CONTEXT, Kind::Device { ctx, .. }) => *(data as *mut CUcontext) = context::from_handle(*ctx),
        (P::CU_POINTER_ATTRIBUTE_CONTEXT, Kind::Host { .. }) => {
            *(data as *mut CUcontext) = context::from_handle(context::current()?.0)
        }
        (P::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, Kind::Device { .. }) => *(data as *mut u32) = CUmemorytype::CU_MEMORYTYPE_DEVICE.0,
        (P::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, Kind::Host { .. }) => *(data as *mut u32) = CUmemorytype::CU_MEMORYTYPE_HOST.0,
        (P::CU_POINTER_ATTRIBUTE_DEVICE_POINTER, Kind::Device { .. }) => *(data as *mut CUdeviceptr) = ptr,
        (P::CU_POINTER_ATTRIBUTE_HOST_POINTER, Kind::Host { .. } | Kind::Device { managed: true, .. }) => {
            *(data as *mut *mut c_void) = ptr as usize as *mut c_void
        }
        // cudart reads this "boolean" as a 32-bit value (seen: garbage in the
        // upper bytes made it report managed memory).
        (P::CU_POINTER_ATTRIBUTE_IS_MANAGED, Kind::Device { managed, .. }) => *(data as *mut u32) = u32::from(*managed),
        (P::CU_POINTER_ATTRIBUTE_IS_MANAGED, Kind::Host { .. }) => *(data as *mut u32) = 0,
        (P::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, Kind::Device { device, .. }) => *(data as *mut i32) = *device,
        (P::CU_POINTER_ATTRIBUTE_BUFFER_ID, Kind::Device { start, .. }) => *(data as *mut u64) = *start,
        (P::CU_POINTER_ATTRIBUTE_BUFFER_ID, Kind::Host { start, .. }) => *(data as *mut u64) = *start as u64,
        (P::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, Kind::Device { start, .. }) => *(data as *mut CUdeviceptr) = *start,
        (P::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, Kind::Host { start, .. }) => *(data as *mut CUdeviceptr) = *start as u64,
        (P::CU_POINTER_ATTRIBUTE_RANGE_SIZE, Kind::Device { size, .. }) => *(data as *mut usize) = *size as usize,
        (P::CU_POINTER_ATTRIBUTE_RANGE_SIZE, Kind::Host { size, .. }) => *(data as *mut usize) = *size,
        (P::CU_POINTER_ATTRIBUTE_MAPPED, Kind::Device { .. }) => *(data as *mut u8) = 1,
        (P::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, Kind::Device { .. }) => *(data as *mut u8) = 1,
        (P::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, Kind::Device { .. }) => *(data as *mut u8) = 0,
        (P::CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE, Kind::Device { .. }) => *(data as *mut u8) = 0,
        (P::CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, Kind::Device { .. }) => *(data as *mut u64) = 0,
        _ => return Ok(false),
    }
    Ok(true)
}

pub(crate) unsafe fn get_attribute(data: *mut c_void, attr: CUpointer_attribute, ptr: CUdeviceptr) -> CuResult<()> {
    let kind = classify(ptr)?;
    if write(attr, data, ptr, &kind)? {
        Ok(())
    } else {
        Err(CuError::INVALID_VALUE)
    }
}

pub(crate) unsafe fn get_attributes(n: u32, attrs: *mut CUpointer_attribute, data: *mut *mut c_void, ptr: CUdeviceptr) -> CuResult<()> {
    if n == 0 || attrs.is_null() || data.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    let kind = classify(ptr)?;
    for i in 0..n as usize {
        let (attr, out) = (*attrs.add(i), *data.add(i));
        if out.is_null() {
            continue;
        }
        // Unlike cuPointerGetAttribute, unknown pointers and attributes that
        // do not apply get zero values, not an error.
        if !write(attr, out, ptr, &kind)? {
            zero(attr, out);
        }
    }
    Ok(())
}

unsafe fn zero(attr: CUpointer_attribute, out: *mut c_void) {
    match attr {
        P::CU_POINTER_ATTRIBUTE_CONTEXT | P::CU_POINTER_ATTRIBUTE_HOST_POINTER | P::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE => {
            *(out as *mut *mut c_void) = std::ptr::null_mut()
        }
        P::CU_POINTER_ATTRIBUTE_DEVICE_POINTER
        | P::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR
        | P::CU_POINTER_ATTRIBUTE_BUFFER_ID
        | P::CU_POINTER_ATTRIBUTE_RANGE_SIZE
        | P::CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES => *(out as *mut u64) = 0,
        P::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL => *(out as *mut i32) = -2,
        P::CU_POINTER_ATTRIBUTE_MEMORY_TYPE | P::CU_POINTER_ATTRIBUTE_IS_MANAGED => *(out as *mut u32) = 0,
        _ => *(out as *mut u8) = 0,
    }
}
