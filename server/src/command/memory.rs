//! Memory commands: `memAlloc`, `memFree`, `memGetInfo`, `memcpyHtoD`,
//! `memcpyDtoH`, `memcpyDtoD` and `memset` (the driver functions that send
//! each are listed in the table in `mod.rs`).

use rgpu_protocol::data_capnp::{device, mem_alloc, mem_free, memcpy_dto_d, memcpy_dto_h, memcpy_hto_d, memset, reply};

use super::{Bulk, BulkHandler, DeviceBytes, EncodeReply, Fail, Handler};
use crate::backend::MemsetOp;
use crate::state::{Alloc, Owner, SessionState};
use rgpu_cuda_types::CuError;

#[derive(Debug)]
pub struct MemAlloc {
    pub device: u32,
    pub size: u64,
}

impl MemAlloc {
    pub fn decode(r: mem_alloc::Reader<'_>) -> Self {
        MemAlloc { device: r.get_device(), size: r.get_size() }
    }
}

impl Handler for MemAlloc {
    type Reply = MemAllocReply;
    fn apply(self, s: &mut SessionState) -> Result<MemAllocReply, Fail> {
        s.check_device(self.device)?;
        if self.size == 0 {
            return Err(CuError::INVALID_VALUE.into());
        }
        let ptr = s.backend.mem_alloc(self.device, self.size)?;
        s.allocs.insert(ptr, Alloc { device: self.device, size: self.size, owner: Owner::Client });
        s.meter.alloc(self.device, self.size);
        Ok(MemAllocReply { ptr })
    }
}

#[derive(Debug)]
pub struct MemFree {
    pub ptr: u64,
}

impl MemFree {
    pub fn decode(r: mem_free::Reader<'_>) -> Self {
        MemFree { ptr: r.get_ptr() }
    }
}

impl Handler for MemFree {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        // Only the exact start of one of this session's own allocations:
        // not an interior pointer, not a module's global, not another
        // session's memory, not twice.
        match s.allocs.get(&self.ptr) {
            Some(a) if a.owner == Owner::Client => {}
            _ => return Err(CuError::INVALID_VALUE.into()),
        }
        // Those who opened it keep it; no one opens it from now on.
        s.ipc.withdraw(self.ptr);
        s.backend.mem_free(self.ptr)?;
        if let Some(a) = s.allocs.remove(&self.ptr) {
            s.meter.free(a.device, a.size);
        }
        Ok(())
    }
}

#[derive(Debug)]
pub struct MemGetInfo {
    pub device: u32,
}

impl MemGetInfo {
    pub fn decode(r: device::Reader<'_>) -> Self {
        MemGetInfo { device: r.get_device() }
    }
}

impl Handler for MemGetInfo {
    type Reply = MemGetInfoReply;
    fn apply(self, s: &mut SessionState) -> Result<MemGetInfoReply, Fail> {
        s.check_device(self.device)?;
        let (free, total) = s.backend.mem_get_info(self.device)?;
        Ok(MemGetInfoReply { free, total })
    }
}

/// The bytes to write are the request's bulk.
#[derive(Debug)]
pub struct MemcpyHtoD {
    pub dst: u64,
    pub stream: u64,
}

impl MemcpyHtoD {
    pub fn decode(r: memcpy_hto_d::Reader<'_>) -> Self {
        MemcpyHtoD { dst: r.get_dst(), stream: r.get_stream() }
    }
}

impl BulkHandler for MemcpyHtoD {
    type Reply = ();
    fn apply(self, s: &mut SessionState, bulk: &mut Bulk<'_>) -> Result<(), Fail> {
        let len = bulk.remaining();
        if len == 0 {
            return Ok(());
        }
        // Checked before a byte is read; on failure the caller skips the bulk.
        let device = s.check_range(self.dst, len)?;
        let stream = s.stream(self.stream, device)?;
        s.backend.memcpy_htod(stream, self.dst, len, &mut |buf| bulk.read_exact(buf))?;
        Ok(())
    }
}

/// The bytes read travel as the reply's bulk.
#[derive(Debug)]
pub struct MemcpyDtoH {
    pub src: u64,
    pub size: u64,
    pub stream: u64,
}

impl MemcpyDtoH {
    pub fn decode(r: memcpy_dto_h::Reader<'_>) -> Self {
        MemcpyDtoH { src: r.get_src(), size: r.get_size(), stream: r.get_stream() }
    }
}

impl Handler for MemcpyDtoH {
    /// None for an empty copy; the session reads the bytes from the backend
    /// while it sends the reply, so they never wait in a buffer here.
    type Reply = Option<DeviceBytes>;
    fn apply(self, s: &mut SessionState) -> Result<Option<DeviceBytes>, Fail> {
        if self.size == 0 {
            return Ok(None);
        }
        if self.size > rgpu_protocol::frame::MAX_BULK_LEN {
            return Err(CuError::INVALID_VALUE.into());
        }
        let device = s.check_range(self.src, self.size)?;
        let stream = s.stream(self.stream, device)?;
        Ok(Some(DeviceBytes { src: self.src, len: self.size, stream }))
    }
}

#[derive(Debug)]
pub struct MemcpyDtoD {
    pub dst: u64,
    pub src: u64,
    pub size: u64,
    pub stream: u64,
}

impl MemcpyDtoD {
    pub fn decode(r: memcpy_dto_d::Reader<'_>) -> Self {
        MemcpyDtoD { dst: r.get_dst(), src: r.get_src(), size: r.get_size(), stream: r.get_stream() }
    }
}

impl Handler for MemcpyDtoD {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        if self.size == 0 {
            return Ok(());
        }
        s.check_range(self.src, self.size)?;
        let device = s.check_range(self.dst, self.size)?;
        let stream = s.stream(self.stream, device)?;
        s.backend.memcpy_dtod(stream, self.dst, self.src, self.size)?;
        Ok(())
    }
}

#[derive(Debug)]
pub struct Memset {
    pub op: MemsetOp,
    pub stream: u64,
}

impl Memset {
    pub fn decode(r: memset::Reader<'_>) -> Self {
        let pitch = r.get_pitch();
        Memset {
            op: MemsetOp {
                dst: r.get_dst(),
                value: r.get_value(),
                element_size: r.get_element_size(),
                count: r.get_count(),
                pitch,
                // 1-D when pitch is 0, whatever `rows` says.
                rows: if pitch == 0 { 1 } else { r.get_rows() },
            },
            stream: r.get_stream(),
        }
    }
}

impl Handler for Memset {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        let span = self.op.span().ok_or(CuError::INVALID_VALUE)?;
        if span == 0 {
            return Ok(());
        }
        let device = s.check_range(self.op.dst, span)?;
        let stream = s.stream(self.stream, device)?;
        s.backend.memset(stream, &self.op)?;
        Ok(())
    }
}

/// The new allocation's device pointer.
#[derive(Debug)]
pub struct MemAllocReply {
    pub ptr: u64,
}

impl EncodeReply for MemAllocReply {
    fn encode(&self, mut r: reply::Builder<'_>) {
        r.set_mem_alloc(self.ptr);
    }
}

/// Free and total bytes, as the session may see them (a lease's share).
#[derive(Debug)]
pub struct MemGetInfoReply {
    pub free: u64,
    pub total: u64,
}

impl EncodeReply for MemGetInfoReply {
    fn encode(&self, r: reply::Builder<'_>) {
        let mut m = r.init_mem_get_info();
        m.set_free(self.free);
        m.set_total(self.total);
    }
}
