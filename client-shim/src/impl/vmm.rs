//! Virtual memory management (cuMemCreate, cuMemAddressReserve, cuMemMap, cuMemSetAccess, ...),
//! as PyTorch's expandable segments use it: reserve a large range once, create physical chunks
//! and map them end to end as the segment grows.
//!
//! A reservation is made on the server of the current context's device (device 0 without
//! one); its maps must be of memory on that server (else CUDA_ERROR_NOT_SUPPORTED). Every call
//! waits for the server, which checks it again (`rgpu-server`'s `vmm.rs`), so a mistake gets
//! CUDA's immediate error. Exporting allocations (shareable handles), compressible memory,
//! host locations and the managed allocation type are refused with CUDA_ERROR_NOT_SUPPORTED,
//! as the device attributes say.

use std::ffi::c_void;
use std::sync::Arc;

use crate::client::connection::Sink;
use crate::client::ClientError;
use crate::cuda::types::*;
use crate::objects::memory::Alloc;
use crate::objects::vmm::{Mapping, Physical, Reservation};
use crate::objects::{context, objects};
use crate::runtime::{self, cu_err, Runtime};

/// The granularity of sizes, addresses and offsets, minimum and recommended: what NVIDIA GPUs
/// report for device memory (and what the server enforces).
pub const GRANULARITY: u64 = 2 << 20;

/// `CU_MEM_CREATE_USAGE_TILE_POOL` and any other usage bit: not offered.
fn check_prop(rt: &Runtime, prop: &CUmemAllocationProp) -> CuResult<CUdevice> {
    if prop.type_ != CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED {
        if prop.type_ == CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_INVALID {
            return Err(CuError::INVALID_VALUE);
        }
        return Err(CuError::NOT_SUPPORTED);
    }
    if prop.location.type_ != CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE {
        if prop.location.type_ == CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID {
            return Err(CuError::INVALID_VALUE);
        }
        // Host and NUMA locations: HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED reads 0.
        return Err(CuError::NOT_SUPPORTED);
    }
    // SAFETY: for a device location the union holds the device ordinal.
    let dev = unsafe { prop.location.__bindgen_anon_1.id };
    rt.device(dev).map_err(|_| CuError::INVALID_DEVICE)?;
    Ok(dev)
}

pub(crate) unsafe fn get_allocation_granularity(
    granularity: &mut usize,
    prop: &CUmemAllocationProp,
    option: CUmemAllocationGranularity_flags,
) -> CuResult<()> {
    let rt = runtime::get()?;
    check_prop(rt, prop)?;
    if option != CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM
        && option != CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    {
        return Err(CuError::INVALID_VALUE);
    }
    *granularity = GRANULARITY as usize;
    Ok(())
}

/// A call that answers nothing but its result.
fn call(rt: &Runtime, dev: CUdevice, build: impl FnOnce(rgpu_protocol::data_capnp::request::Builder<'_>)) -> CuResult<()> {
    rt.conn(dev)?.call(build, &[], Sink::None, |_| Ok(())).map_err(cu_err)
}

/// A release (unmap, release, address free): `Ok(Some(e))` when the server did it and an
/// older asynchronous error `e` came with the reply, for the caller to return once its own
/// tables have let go of what the server released.
fn release_call(
    rt: &Runtime,
    dev: CUdevice,
    build: impl FnOnce(rgpu_protocol::data_capnp::request::Builder<'_>),
) -> CuResult<Option<CuError>> {
    let code = rt.conn(dev)?.call_releasing(build).map_err(cu_err)?;
    Ok(CuError::from_code(code))
}

/// The first of two results that failed.
fn first_error(a: CuResult<()>, b: Option<CuError>) -> CuResult<()> {
    a.and(b.map_or(Ok(()), Err))
}

pub(crate) unsafe fn create(
    handle: &mut CUmemGenericAllocationHandle,
    size: usize,
    prop: &CUmemAllocationProp,
    flags: u64,
) -> CuResult<()> {
    let rt = runtime::get()?;
    if flags != 0 {
        return Err(CuError::INVALID_VALUE);
    }
    let dev = check_prop(rt, prop)?;
    // An allocation may ask to be exportable as a POSIX fd (PyTorch's expandable segments
    // always do, for IPC they may never use); exporting it is what rgpu cannot do
    // (cuMemExportToShareableHandle: CUDA_ERROR_NOT_SUPPORTED, HANDLE_TYPE_*_SUPPORTED 0).
    // Fabric and Win32 handles are refused here, which PyTorch takes as "not supported".
    let posix = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    if prop.requestedHandleTypes != CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE && prop.requestedHandleTypes != posix {
        return Err(CuError::NOT_SUPPORTED);
    }
    let f = prop.allocFlags;
    if f.compressionType != 0 || f.gpuDirectRDMACapable != 0 || f.usage != 0 {
        return Err(CuError::NOT_SUPPORTED);
    }
    let size = size as u64;
    if size == 0 || size % GRANULARITY != 0 {
        return Err(CuError::INVALID_VALUE);
    }
    let o = objects();
    let h = o.vmm.handles.mint();
    let remote_dev = rt.device(dev)?.remote.ordinal;
    call(rt, dev, |r| {
        let mut m = r.init_mem_create();
        m.set_handle(h);
        m.set_device(remote_dev);
        m.set_size(size);
    })?;
    o.vmm.handles.insert_arc(h, Arc::new(Physical { device: dev, size, prop: *prop, refs: std::sync::Mutex::new((1, 0)) }));
    *handle = h;
    Ok(())
}

/// Sends the server's release once `p` has neither references nor maps.
fn collect(rt: &Runtime, h: u64, p: &Physical) -> CuResult<()> {
    if *p.refs() != (0, 0) {
        return Ok(());
    }
    first_error(Ok(()), release_call(rt, p.device, |r| r.init_mem_release().set_handle(h))?)
}

pub(crate) unsafe fn release(handle: CUmemGenericAllocationHandle) -> CuResult<()> {
    let rt = runtime::get()?;
    let o = objects();
    let p = o.vmm.handles.get(handle).ok_or(CuError::INVALID_VALUE)?;
    let last = {
        let mut r = p.refs();
        r.0 = r.0.saturating_sub(1);
        r.0 == 0
    };
    if last {
        o.vmm.handles.remove(handle);
        collect(rt, handle, &p)?;
    }
    Ok(())
}

pub(crate) unsafe fn retain_allocation_handle(handle: &mut CUmemGenericAllocationHandle, addr: *mut c_void) -> CuResult<()> {
    runtime::get()?;
    let o = objects();
    let (h, phys) = {
        let ranges = o.vmm.ranges();
        let (_, m) = ranges.mapping_of(addr as u64).ok_or(CuError::INVALID_VALUE)?;
        (m.handle, m.phys.clone())
    };
    let first = {
        let mut r = phys.refs();
        r.0 += 1;
        r.0 == 1
    };
    if first {
        // Released by every reference but still mapped: the same allocation, under its handle.
        o.vmm.handles.insert_arc(h, phys);
    }
    *handle = h;
    Ok(())
}

pub(crate) unsafe fn get_allocation_properties_from_handle(
    prop: &mut CUmemAllocationProp,
    handle: CUmemGenericAllocationHandle,
) -> CuResult<()> {
    runtime::get()?;
    let p = objects().vmm.handles.get(handle).ok_or(CuError::INVALID_VALUE)?;
    *prop = p.prop;
    Ok(())
}

pub(crate) unsafe fn address_reserve(ptr: &mut CUdeviceptr, size: usize, alignment: usize, addr: CUdeviceptr, flags: u64) -> CuResult<()> {
    let rt = runtime::get()?;
    if flags != 0 {
        return Err(CuError::INVALID_VALUE);
    }
    let size = size as u64;
    if size == 0 || size % GRANULARITY != 0 || (alignment != 0 && !alignment.is_power_of_two()) {
        return Err(CuError::INVALID_VALUE);
    }
    let dev = context::current().map(|(_, c)| c.device).unwrap_or(0);
    rt.device(dev)?;
    let hint = if addr != 0 && rt.to_client(dev, Runtime::to_remote(addr)) == addr { Runtime::to_remote(addr) } else { 0 };
    let remote = rt
        .conn(dev)?
        .call(
            |r| {
                let mut m = r.init_mem_address_reserve();
                m.set_size(size);
                m.set_alignment(alignment as u64);
                m.set_addr(hint);
            },
            &[],
            Sink::None,
            |reply| match reply.which() {
                Ok(rgpu_protocol::data_capnp::reply::MemAlloc(p)) => Ok(p),
                _ => Err(ClientError::Cuda(CuError::UNKNOWN.code())),
            },
        )
        .map_err(cu_err)?;
    let va = rt.to_client(dev, remote);
    objects().vmm.ranges().reservations.insert(va, Reservation { size, device: dev });
    *ptr = va;
    Ok(())
}

pub(crate) unsafe fn address_free(ptr: CUdeviceptr, size: usize) -> CuResult<()> {
    let rt = runtime::get()?;
    let o = objects();
    let r = {
        let ranges = o.vmm.ranges();
        let r = *ranges.reservations.get(&ptr).filter(|r| r.size == size as u64).ok_or(CuError::INVALID_VALUE)?;
        if ranges.mappings.range(ptr..ptr + r.size).next().is_some() {
            return Err(CuError::INVALID_VALUE);
        }
        r
    };
    let late = release_call(rt, r.device, |b| {
        let mut m = b.init_mem_address_free();
        m.set_ptr(Runtime::to_remote(ptr));
        m.set_size(r.size);
    })?;
    o.vmm.ranges().reservations.remove(&ptr);
    first_error(Ok(()), late)
}

pub(crate) unsafe fn map(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: u64) -> CuResult<()> {
    let rt = runtime::get()?;
    if flags != 0 {
        return Err(CuError::INVALID_VALUE);
    }
    let o = objects();
    let phys = o.vmm.handles.get(handle).ok_or(CuError::INVALID_VALUE)?;
    let (size, offset) = (size as u64, offset as u64);
    let end = ptr.checked_add(size).ok_or(CuError::INVALID_VALUE)?;
    if size == 0 || offset.checked_add(size).is_none_or(|e| e > phys.size) {
        return Err(CuError::INVALID_VALUE);
    }
    {
        let ranges = o.vmm.ranges();
        let (rs, r) = ranges.reservation_of(ptr).ok_or(CuError::INVALID_VALUE)?;
        if end > rs + r.size {
            return Err(CuError::INVALID_VALUE);
        }
        if rt.device(r.device)?.server != rt.device(phys.device)?.server {
            // The range and the memory are on different servers: one address cannot be both.
            return Err(CuError::NOT_SUPPORTED);
        }
    }
    call(rt, phys.device, |b| {
        let mut m = b.init_mem_map();
        m.set_ptr(Runtime::to_remote(ptr));
        m.set_size(size);
        m.set_offset(offset);
        m.set_handle(handle);
    })?;
    phys.refs().1 += 1;
    o.vmm.ranges().mappings.insert(ptr, Mapping { size, handle, phys: phys.clone(), access: Default::default() });
    o.memory.record(ptr, Alloc { size, device: phys.device, ctx: 0, pool: 0, mapped: true, ipc: 0 });
    Ok(())
}

pub(crate) unsafe fn unmap(ptr: CUdeviceptr, size: usize) -> CuResult<()> {
    let rt = runtime::get()?;
    let o = objects();
    let maps: Vec<(u64, Mapping)> = {
        let ranges = o.vmm.ranges();
        let starts = ranges.tiling(ptr, size as u64).ok_or(CuError::INVALID_VALUE)?;
        starts.into_iter().filter_map(|s| ranges.mappings.get(&s).map(|m| (s, m.clone()))).collect()
    };
    let dev = maps.first().map(|(_, m)| m.phys.device).ok_or(CuError::INVALID_VALUE)?;
    let late = release_call(rt, dev, |b| {
        let mut m = b.init_mem_unmap();
        m.set_ptr(Runtime::to_remote(ptr));
        m.set_size(size as u64);
    })?;
    let mut collected = Ok(());
    for (s, m) in maps {
        o.vmm.ranges().mappings.remove(&s);
        o.memory.allocs.lock().unwrap_or_else(|e| e.into_inner()).remove(&s);
        {
            let mut r = m.phys.refs();
            r.1 = r.1.saturating_sub(1);
        }
        collected = collected.and(collect(rt, m.handle, &m.phys));
    }
    first_error(late.map_or(Ok(()), Err), collected.err())
}

pub(crate) unsafe fn set_access(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize) -> CuResult<()> {
    let rt = runtime::get()?;
    if desc.is_null() || count == 0 || count > rt.devices.len() * 2 {
        return Err(CuError::INVALID_VALUE);
    }
    let descs = std::slice::from_raw_parts(desc, count);
    let o = objects();
    let (starts, server) = {
        let ranges = o.vmm.ranges();
        let starts = ranges.tiling(ptr, size as u64).ok_or(CuError::INVALID_VALUE)?;
        let first = ranges.mappings.get(&starts[0]).ok_or(CuError::INVALID_VALUE)?;
        (starts, rt.device(first.phys.device)?.server)
    };
    for d in descs {
        if d.location.type_ != CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE {
            return Err(CuError::INVALID_VALUE);
        }
        // SAFETY: for a device location the union holds the device ordinal.
        let dev = d.location.__bindgen_anon_1.id;
        let info = rt.device(dev).map_err(|_| CuError::INVALID_DEVICE)?;
        if info.server != server {
            // Another server's device cannot reach this memory.
            return Err(CuError::NOT_SUPPORTED);
        }
        let flags = d.flags.0;
        if !matches!(flags, 0 | 1 | 3) {
            return Err(CuError::INVALID_VALUE);
        }
        let remote_dev = info.remote.ordinal;
        call(rt, dev, |b| {
            let mut m = b.init_mem_set_access();
            m.set_ptr(Runtime::to_remote(ptr));
            m.set_size(size as u64);
            m.set_device(remote_dev);
            m.set_flags(flags);
        })?;
        let mut ranges = o.vmm.ranges();
        for s in &starts {
            if let Some(m) = ranges.mappings.get_mut(s) {
                if flags == 0 {
                    m.access.remove(&dev);
                } else {
                    m.access.insert(dev, flags as u64);
                }
            }
        }
    }
    Ok(())
}

pub(crate) unsafe fn get_access(flags: &mut u64, location: &CUmemLocation, ptr: CUdeviceptr) -> CuResult<()> {
    runtime::get()?;
    if location.type_ != CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE {
        return Err(CuError::INVALID_VALUE);
    }
    // SAFETY: for a device location the union holds the device ordinal.
    let dev = location.__bindgen_anon_1.id;
    let ranges = objects().vmm.ranges();
    let (_, m) = ranges.mapping_of(ptr).ok_or(CuError::INVALID_VALUE)?;
    *flags = m.access.get(&dev).copied().unwrap_or(0);
    Ok(())
}
