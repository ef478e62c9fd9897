//! Managed memory (cuMemAllocManaged, cuMemPrefetchAsync, cuMemAdvise): one address for host
//! and device, kept coherent as `objects::managed` describes.
//!
//! The device side is a VMM map (the server's `memAddressReserve`, `memCreate`, `memMap`,
//! `memSetAccess`), so the server reserves the address; the host side is an anonymous mapping
//! at that same address in this process. Only the first server's devices offer it (a device
//! pointer of any other server carries its server tag in bits 48..55, which no host address
//! can); there the allocation fails with CUDA_ERROR_NOT_SUPPORTED, as MANAGED_MEMORY says.

use std::ffi::c_void;

use crate::client::connection::Sink;
use crate::client::ClientError;
use crate::cuda::types::*;
use crate::objects::managed::{self, Managed, Owner};
use crate::objects::memory::Alloc;
use crate::objects::{context, objects, stream};
use crate::runtime::{self, cu_err, Runtime};

const GRANULARITY: u64 = 2 << 20;
/// `CU_DEVICE_CPU`.
const CU_DEVICE_CPU: CUdevice = -1;
const ATTACH_GLOBAL: u32 = 0x1;
const ATTACH_HOST: u32 = 0x2;

fn call(rt: &Runtime, dev: CUdevice, build: impl FnOnce(rgpu_protocol::data_capnp::request::Builder<'_>)) -> CuResult<()> {
    rt.conn(dev)?.call(build, &[], Sink::None, |_| Ok(())).map_err(cu_err)
}

fn reserve(rt: &Runtime, dev: CUdevice, size: u64, hint: u64) -> CuResult<u64> {
    rt.conn(dev)?
        .call(
            |r| {
                let mut m = r.init_mem_address_reserve();
                m.set_size(size);
                m.set_alignment(0);
                m.set_addr(hint);
            },
            &[],
            Sink::None,
            |reply| match reply.which() {
                Ok(rgpu_protocol::data_capnp::reply::MemAlloc(p)) => Ok(p),
                _ => Err(ClientError::Cuda(CuError::UNKNOWN.code())),
            },
        )
        .map_err(cu_err)
}

fn address_free(rt: &Runtime, dev: CUdevice, ptr: u64, size: u64) {
    let _ = call(rt, dev, |b| {
        let mut m = b.init_mem_address_free();
        m.set_ptr(ptr);
        m.set_size(size);
    });
}

pub(crate) unsafe fn alloc_managed(dptr: &mut CUdeviceptr, bytesize: usize, flags: u32) -> CuResult<()> {
    let rt = runtime::get()?;
    if bytesize == 0 || !(flags == ATTACH_GLOBAL || flags == ATTACH_HOST) {
        return Err(CuError::INVALID_VALUE);
    }
    let (_, c) = context::current()?;
    let dev = c.device;
    let d = rt.device(dev)?;
    if d.server != 0 || d.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY)? == 0 {
        return Err(CuError::NOT_SUPPORTED);
    }
    let remote_dev = d.remote.ordinal;
    let size = bytesize as u64;
    let mapped = size.checked_next_multiple_of(GRANULARITY).ok_or(CuError::OUT_OF_MEMORY)?;
    // The server picks the address; a few tries if this process has something there.
    let mut hint = 0;
    let mut va = 0;
    for _ in 0..8 {
        let v = reserve(rt, dev, mapped, hint)?;
        if managed::map_host(v, mapped) {
            va = v;
            break;
        }
        address_free(rt, dev, v, mapped);
        hint = v.checked_add(mapped + (1u64 << 40)).ok_or(CuError::OUT_OF_MEMORY)?;
    }
    if va == 0 {
        tracing::warn!("cuMemAllocManaged: no address free on both this host and the server");
        return Err(CuError::OUT_OF_MEMORY);
    }
    let undo_host = || {
        // SAFETY: the mapping made above, not handed out.
        unsafe { libc::munmap(va as usize as *mut libc::c_void, mapped as usize) };
    };
    let handle = objects().vmm.handles.mint();
    let made = call(rt, dev, |r| {
        let mut m = r.init_mem_create();
        m.set_handle(handle);
        m.set_device(remote_dev);
        m.set_size(mapped);
    });
    if let Err(e) = made {
        undo_host();
        address_free(rt, dev, va, mapped);
        return Err(e);
    }
    let mapped_ok = call(rt, dev, |b| {
        let mut m = b.init_mem_map();
        m.set_ptr(va);
        m.set_size(mapped);
        m.set_offset(0);
        m.set_handle(handle);
    })
    .and_then(|()| {
        call(rt, dev, |b| {
            let mut m = b.init_mem_set_access();
            m.set_ptr(va);
            m.set_size(mapped);
            m.set_device(remote_dev);
            m.set_flags(3);
        })
    });
    if let Err(e) = mapped_ok {
        let _ = release_device(rt, dev, va, mapped, handle);
        undo_host();
        return Err(e);
    }
    managed::insert(va, Managed { device: dev, size, mapped, handle, flags, owner: Owner::Host, advice: managed::AdviceMap::new(size), module_global: false, attached: None });
    objects().memory.record(va, Alloc { size, device: dev, ctx: 0, pool: 0, mapped: false, ipc: 0 });
    *dptr = va;
    Ok(())
}

/// Unmaps, releases and frees the device side (the server ignores what was not made).
fn release_device(rt: &Runtime, dev: CUdevice, va: u64, mapped: u64, handle: u64) -> CuResult<()> {
    let r1 = call(rt, dev, |b| {
        let mut m = b.init_mem_unmap();
        m.set_ptr(va);
        m.set_size(mapped);
    });
    let r2 = call(rt, dev, |b| b.init_mem_release().set_handle(handle));
    address_free(rt, dev, va, mapped);
    r1.and(r2)
}

/// cuMemFree of a managed allocation (called from `memory::free_v2`). CUDA's cuMemFree of
/// managed memory waits for the device; the server does it in order.
pub(crate) fn free(ptr: u64) -> CuResult<bool> {
    if managed::is_global(ptr) {
        // A module's variable is freed with its module.
        return Err(CuError::INVALID_VALUE);
    }
    let Some(a) = managed::remove(ptr) else { return Ok(false) };
    let rt = runtime::get()?;
    objects().memory.allocs.lock().unwrap_or_else(|e| e.into_inner()).remove(&ptr);
    let r = release_device(rt, a.device, ptr, a.mapped, a.handle);
    // SAFETY: the host mapping of this allocation, now out of every table.
    unsafe { libc::munmap(ptr as usize as *mut libc::c_void, a.mapped as usize) };
    r.map(|()| true)
}

/// The managed allocation holding all of `[ptr, ptr + count)`.
fn managed_range(ptr: u64, count: usize) -> CuResult<CUdevice> {
    let (s, size, dev, _) = objects().managed.find(ptr).ok_or(CuError::INVALID_VALUE)?;
    let end = ptr.checked_add(count as u64).ok_or(CuError::INVALID_VALUE)?;
    if count == 0 || end > s + size {
        return Err(CuError::INVALID_VALUE);
    }
    Ok(dev)
}

/// A prefetch to the host is accepted (the bytes are the host's at the next synchronisation,
/// which is when the host may read them); to a device it is refused as CUDA refuses it on a
/// device without concurrent managed access.
fn prefetch_to(ptr: u64, count: usize, to_host: bool, device: CUdevice, s: CUstream) -> CuResult<()> {
    let rt = runtime::get()?;
    managed_range(ptr, count)?;
    stream::device_of(s)?;
    if to_host {
        managed::with_advice(ptr, count as u64, |m, off| m.update(off, count as u64, |a| a.last_prefetch = Some(managed::CPU)))?;
        return Ok(());
    }
    rt.device(device).map_err(|_| CuError::INVALID_DEVICE)?;
    Err(CuError::INVALID_DEVICE)
}

pub(crate) unsafe fn prefetch_async(ptr: CUdeviceptr, count: usize, dst: CUdevice, s: CUstream) -> CuResult<()> {
    prefetch_to(ptr, count, dst == CU_DEVICE_CPU, dst, s)
}

pub(crate) unsafe fn prefetch_async_v2(ptr: CUdeviceptr, count: usize, location: CUmemLocation, flags: u32, s: CUstream) -> CuResult<()> {
    if flags != 0 {
        return Err(CuError::INVALID_VALUE);
    }
    // SAFETY: the union's id is the device ordinal or host NUMA id, both plain ints.
    let id = location.__bindgen_anon_1.id;
    match location.type_ {
        CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST
        | CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA
        | CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT => prefetch_to(ptr, count, true, 0, s),
        CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE => prefetch_to(ptr, count, false, id, s),
        _ => Err(CuError::INVALID_VALUE),
    }
}

/// Advice is a hint CUDA lets a driver ignore; this one has nothing to tune (every
/// allocation lives on its device and moves whole at synchronisations). It is kept, per
/// page, for cuMemRangeGetAttribute. `device` None is the host.
fn check_advice(ptr: u64, count: usize, advice: CUmem_advise, device: Option<CUdevice>) -> CuResult<()> {
    let rt = runtime::get()?;
    managed_range(ptr, count)?;
    if !(1..=6).contains(&advice.0) {
        return Err(CuError::INVALID_VALUE);
    }
    if let Some(d) = device {
        rt.device(d).map_err(|_| CuError::INVALID_DEVICE)?;
        if d >= 63 {
            return Err(CuError::INVALID_DEVICE);
        }
    }
    let loc = device.unwrap_or(managed::CPU);
    let bit = if loc == managed::CPU { 1u64 << 63 } else { 1u64 << loc };
    let n = count as u64;
    managed::with_advice(ptr, n, |m, off| match advice.0 {
        1 => m.update(off, n, |a| a.read_mostly = true),
        2 => m.update(off, n, |a| a.read_mostly = false),
        3 => m.update(off, n, |a| a.preferred = Some(loc)),
        4 => m.update(off, n, |a| a.preferred = None),
        5 => m.update(off, n, |a| a.accessed_by |= bit),
        _ => m.update(off, n, |a| a.accessed_by &= !bit),
    })
}

/// One range attribute into `data` (`size` bytes).
unsafe fn range_attribute(data: *mut c_void, size: usize, attribute: CUmem_range_attribute, ptr: u64, count: usize) -> CuResult<()> {
    if data.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    let stretches = managed::with_advice(ptr, count as u64, |m, off| m.over(off, count as u64))?;
    // One location for the whole range, or CU_DEVICE_INVALID.
    let same = |f: fn(&managed::Advice) -> Option<i32>| -> i32 {
        let first = stretches.first().and_then(f);
        match first {
            Some(l) if stretches.iter().all(|a| f(a) == Some(l)) => l,
            _ => managed::INVALID,
        }
    };
    let one = |v: i32| -> CuResult<()> {
        if size != 4 {
            return Err(CuError::INVALID_VALUE);
        }
        *(data as *mut i32) = v;
        Ok(())
    };
    match attribute.0 {
        1 => one(i32::from(stretches.iter().all(|a| a.read_mostly))),
        2 => one(same(|a| a.preferred)),
        4 => one(same(|a| a.last_prefetch)),
        3 => {
            if size == 0 || size % 4 != 0 {
                return Err(CuError::INVALID_VALUE);
            }
            let all = stretches.iter().fold(u64::MAX, |m, a| m & a.accessed_by);
            let out = std::slice::from_raw_parts_mut(data as *mut i32, size / 4);
            let mut devices = (0..63).filter(|d| all & (1u64 << d) != 0).chain((all & (1u64 << 63) != 0).then_some(managed::CPU));
            for slot in out.iter_mut() {
                *slot = devices.next().unwrap_or(managed::INVALID);
            }
            Ok(())
        }
        // The location type/id forms (CUDA 12.2) are not answered yet.
        _ => Err(CuError::NOT_SUPPORTED),
    }
}

pub(crate) unsafe fn range_get_attribute(
    data: *mut c_void,
    size: usize,
    attribute: CUmem_range_attribute,
    ptr: CUdeviceptr,
    count: usize,
) -> CuResult<()> {
    runtime::get()?;
    range_attribute(data, size, attribute, ptr, count)
}

pub(crate) unsafe fn range_get_attributes(
    data: *mut *mut c_void,
    sizes: *mut usize,
    attributes: *mut CUmem_range_attribute,
    n: usize,
    ptr: CUdeviceptr,
    count: usize,
) -> CuResult<()> {
    runtime::get()?;
    if data.is_null() || sizes.is_null() || attributes.is_null() || n == 0 || n > 64 {
        return Err(CuError::INVALID_VALUE);
    }
    for i in 0..n {
        range_attribute(*data.add(i), *sizes.add(i), *attributes.add(i), ptr, count)?;
    }
    Ok(())
}

pub(crate) unsafe fn advise(ptr: CUdeviceptr, count: usize, advice: CUmem_advise, device: CUdevice) -> CuResult<()> {
    check_advice(ptr, count, advice, (device != CU_DEVICE_CPU).then_some(device))
}

pub(crate) unsafe fn advise_v2(ptr: CUdeviceptr, count: usize, advice: CUmem_advise, location: CUmemLocation) -> CuResult<()> {
    // SAFETY: as in prefetch_async_v2.
    let id = location.__bindgen_anon_1.id;
    let device = match location.type_ {
        CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE => Some(id),
        CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST
        | CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA
        | CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT => None,
        _ => return Err(CuError::INVALID_VALUE),
    };
    check_advice(ptr, count, advice, device)
}
