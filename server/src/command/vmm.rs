//! Virtual memory management commands: `memCreate`, `memRelease`, `memAddressReserve`,
//! `memAddressFree`, `memMap`, `memUnmap` and `memSetAccess` (cuMemCreate, cuMemMap, ...).
//! Each is checked against the session's VMM objects in [`crate::vmm`], which calls the
//! backend.

use rgpu_protocol::data_capnp::{handle, mem_address_reserve, mem_create, mem_map, mem_range, mem_set_access};

use super::memory::MemAllocReply;
use super::{Fail, Handler};
use crate::state::SessionState;

#[derive(Debug)]
pub struct MemCreate {
    pub handle: u64,
    pub device: u32,
    pub size: u64,
}

impl MemCreate {
    pub fn decode(r: mem_create::Reader<'_>) -> Self {
        MemCreate { handle: r.get_handle(), device: r.get_device(), size: r.get_size() }
    }
}

impl Handler for MemCreate {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        s.check_device(self.device)?;
        s.vmm.create(&mut *s.backend, self.handle, self.device, self.size)?;
        Ok(())
    }
}

#[derive(Debug)]
pub struct MemRelease {
    pub handle: u64,
}

impl MemRelease {
    pub fn decode(r: handle::Reader<'_>) -> Self {
        MemRelease { handle: r.get_handle() }
    }
}

impl Handler for MemRelease {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        s.vmm.release(&mut *s.backend, self.handle)?;
        Ok(())
    }
}

#[derive(Debug)]
pub struct MemAddressReserve {
    pub size: u64,
    pub alignment: u64,
    pub addr: u64,
}

impl MemAddressReserve {
    pub fn decode(r: mem_address_reserve::Reader<'_>) -> Self {
        MemAddressReserve { size: r.get_size(), alignment: r.get_alignment(), addr: r.get_addr() }
    }
}

impl Handler for MemAddressReserve {
    /// The reserved range's start, as a device pointer.
    type Reply = MemAllocReply;
    fn apply(self, s: &mut SessionState) -> Result<MemAllocReply, Fail> {
        let ptr = s.vmm.reserve(&mut *s.backend, self.size, self.alignment, self.addr)?;
        Ok(MemAllocReply { ptr })
    }
}

#[derive(Debug)]
pub struct MemAddressFree {
    pub ptr: u64,
    pub size: u64,
}

impl MemAddressFree {
    pub fn decode(r: mem_range::Reader<'_>) -> Self {
        MemAddressFree { ptr: r.get_ptr(), size: r.get_size() }
    }
}

impl Handler for MemAddressFree {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        s.vmm.address_free(&mut *s.backend, self.ptr, self.size)?;
        Ok(())
    }
}

#[derive(Debug)]
pub struct MemMap {
    pub ptr: u64,
    pub size: u64,
    pub offset: u64,
    pub handle: u64,
}

impl MemMap {
    pub fn decode(r: mem_map::Reader<'_>) -> Self {
        MemMap { ptr: r.get_ptr(), size: r.get_size(), offset: r.get_offset(), handle: r.get_handle() }
    }
}

impl Handler for MemMap {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        s.vmm.map(&mut *s.backend, self.ptr, self.size, self.offset, self.handle)?;
        Ok(())
    }
}

#[derive(Debug)]
pub struct MemUnmap {
    pub ptr: u64,
    pub size: u64,
}

impl MemUnmap {
    pub fn decode(r: mem_range::Reader<'_>) -> Self {
        MemUnmap { ptr: r.get_ptr(), size: r.get_size() }
    }
}

impl Handler for MemUnmap {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        s.vmm.unmap(&mut *s.backend, self.ptr, self.size)?;
        Ok(())
    }
}

#[derive(Debug)]
pub struct MemSetAccess {
    pub ptr: u64,
    pub size: u64,
    pub device: u32,
    pub flags: u32,
}

impl MemSetAccess {
    pub fn decode(r: mem_set_access::Reader<'_>) -> Self {
        MemSetAccess { ptr: r.get_ptr(), size: r.get_size(), device: r.get_device(), flags: r.get_flags() }
    }
}

impl Handler for MemSetAccess {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        s.check_device(self.device)?;
        s.vmm.set_access(&mut *s.backend, self.ptr, self.size, self.device, self.flags)?;
        Ok(())
    }
}
