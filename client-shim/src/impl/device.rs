//! Device queries, answered from the inventory each server sent at cuInit:
//! no round trip.

use std::ffi::{c_char, CStr};

use crate::cuda::types::*;
use crate::runtime;

pub(crate) unsafe fn get(device: &mut CUdevice, ordinal: i32) -> CuResult<()> {
    runtime::get()?.device(ordinal)?;
    *device = ordinal;
    Ok(())
}

pub(crate) unsafe fn get_count(count: &mut i32) -> CuResult<()> {
    *count = runtime::get()?.devices.len() as i32;
    Ok(())
}

pub(crate) unsafe fn get_name(name: *mut c_char, len: i32, dev: CUdevice) -> CuResult<()> {
    if name.is_null() || len <= 0 {
        return Err(CuError::INVALID_VALUE);
    }
    let d = runtime::get()?.device(dev)?;
    let bytes = d.remote.name.as_bytes();
    let n = bytes.len().min(len as usize - 1);
    std::ptr::copy_nonoverlapping(bytes.as_ptr() as *const c_char, name, n);
    *name.add(n) = 0;
    Ok(())
}

pub(crate) unsafe fn total_mem_v2(bytes: &mut usize, dev: CUdevice) -> CuResult<()> {
    *bytes = runtime::get()?.device(dev)?.remote.total_mem as usize;
    Ok(())
}

pub(crate) unsafe fn total_mem(bytes: &mut u32, dev: CUdevice) -> CuResult<()> {
    let total = runtime::get()?.device(dev)?.remote.total_mem;
    *bytes = total.min(u32::MAX as u64) as u32;
    Ok(())
}

pub(crate) unsafe fn get_attribute(pi: &mut i32, attrib: CUdevice_attribute, dev: CUdevice) -> CuResult<()> {
    *pi = runtime::get()?.device(dev)?.attribute(attrib)?;
    Ok(())
}

pub(crate) unsafe fn compute_capability(major: &mut i32, minor: &mut i32, dev: CUdevice) -> CuResult<()> {
    let d = runtime::get()?.device(dev)?;
    *major = d.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    *minor = d.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    Ok(())
}

pub(crate) unsafe fn get_uuid(uuid: &mut CUuuid, dev: CUdevice) -> CuResult<()> {
    let d = runtime::get()?.device(dev)?;
    for (dst, src) in uuid.bytes.iter_mut().zip(d.remote.uuid) {
        *dst = src as c_char;
    }
    Ok(())
}

fn pci_bus_id(dev: CUdevice) -> CuResult<String> {
    let (domain, bus, device) = runtime::get()?.device(dev)?.remote.pci;
    Ok(format!("{domain:08x}:{bus:02x}:{device:02x}.0"))
}

pub(crate) unsafe fn get_pci_bus_id(out: *mut c_char, len: i32, dev: CUdevice) -> CuResult<()> {
    if out.is_null() || len <= 0 {
        return Err(CuError::INVALID_VALUE);
    }
    let id = pci_bus_id(dev)?;
    let n = id.len().min(len as usize - 1);
    std::ptr::copy_nonoverlapping(id.as_ptr() as *const c_char, out, n);
    *out.add(n) = 0;
    Ok(())
}

pub(crate) unsafe fn get_by_pci_bus_id(dev: &mut CUdevice, id: *const c_char) -> CuResult<()> {
    if id.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    let want = rgpu_control_client::parse_pci_bus_id(CStr::from_ptr(id).to_str().map_err(|_| CuError::INVALID_VALUE)?)
        .ok_or(CuError::INVALID_VALUE)?;
    let rt = runtime::get()?;
    let found = rt.devices.iter().position(|d| d.remote.pci == want).ok_or(CuError::INVALID_DEVICE)?;
    *dev = found as CUdevice;
    Ok(())
}

pub(crate) unsafe fn can_access_peer(can: &mut i32, dev: CUdevice, peer: CUdevice) -> CuResult<()> {
    let rt = runtime::get()?;
    rt.device(dev)?;
    rt.device(peer)?;
    // Peer access would need device memory mapped across servers; copies
    // between devices still work (staged through the client).
    *can = 0;
    Ok(())
}

pub(crate) unsafe fn get_p2p_attribute(value: &mut i32, _attrib: CUdevice_P2PAttribute, src: CUdevice, dst: CUdevice) -> CuResult<()> {
    let rt = runtime::get()?;
    rt.device(src)?;
    rt.device(dst)?;
    if src == dst {
        return Err(CuError::INVALID_DEVICE);
    }
    *value = 0;
    Ok(())
}

// ---- memory pools (objects::pool) -------------------------------------------------------

pub(crate) unsafe fn get_default_mem_pool(pool: &mut CUmemoryPool, dev: CUdevice) -> CuResult<()> {
    runtime::get()?.device(dev)?;
    *pool = crate::objects::objects().device_pools.default_pool(dev) as usize as CUmemoryPool;
    Ok(())
}

pub(crate) unsafe fn get_mem_pool(pool: &mut CUmemoryPool, dev: CUdevice) -> CuResult<()> {
    runtime::get()?.device(dev)?;
    *pool = crate::objects::objects().device_pools.current(dev) as usize as CUmemoryPool;
    Ok(())
}

pub(crate) unsafe fn set_mem_pool(dev: CUdevice, pool: CUmemoryPool) -> CuResult<()> {
    runtime::get()?.device(dev)?;
    let (h, p) = crate::objects::pool::get(pool)?;
    if p.device != dev {
        return Err(CuError::INVALID_DEVICE);
    }
    crate::objects::objects().device_pools.set_current(dev, h);
    Ok(())
}
