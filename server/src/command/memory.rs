//! Memory commands: cuMemAlloc, cuMemFree, cuMemGetInfo, cuMemcpy{HtoD,DtoH,DtoD}
//! and cuMemsetD{8,16,32}[2D].

use rgpu_protocol::data_capnp::{device, mem_alloc, mem_free, memcpy_dto_d, memcpy_dto_h, memcpy_hto_d, memset};

use super::{Bulk, Fail, ReplyBody};
use crate::backend::Memset;
use rgpu_cuda_types::CuError;
use crate::session::state::{Alloc, Owner, SessionState};

#[derive(Debug)]
pub struct MemAlloc {
    pub device: u32,
    pub size: u64,
}

impl MemAlloc {
    pub fn decode(r: mem_alloc::Reader<'_>) -> Self {
        MemAlloc { device: r.get_device(), size: r.get_size() }
    }

    pub fn apply(self, s: &mut SessionState) -> Result<ReplyBody, Fail> {
        s.check_device(self.device)?;
        if self.size == 0 {
            return Err(CuError::INVALID_VALUE.into());
        }
        let ptr = s.backend.mem_alloc(self.device, self.size)?;
        s.allocs.insert(ptr, Alloc { device: self.device, size: self.size, owner: Owner::Client });
        Ok(ReplyBody::MemAlloc(ptr))
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

    pub fn apply(self, s: &mut SessionState) -> Result<ReplyBody, Fail> {
        // Only the exact start of one of this session's own allocations:
        // not an interior pointer, not a module's global, not another
        // session's memory, not twice.
        match s.allocs.get(&self.ptr) {
            Some(a) if a.owner == Owner::Client => {}
            _ => return Err(CuError::INVALID_VALUE.into()),
        }
        s.backend.mem_free(self.ptr)?;
        s.allocs.remove(&self.ptr);
        Ok(ReplyBody::None)
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

    pub fn apply(self, s: &mut SessionState) -> Result<ReplyBody, Fail> {
        s.check_device(self.device)?;
        let (free, total) = s.backend.mem_get_info(self.device)?;
        Ok(ReplyBody::MemGetInfo { free, total })
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

    pub fn apply(self, s: &mut SessionState, bulk: &mut Bulk<'_>) -> Result<ReplyBody, Fail> {
        let len = bulk.remaining();
        if len == 0 {
            return Ok(ReplyBody::None);
        }
        // Checked before a byte is read; on failure the caller skips the bulk.
        let device = s.check_range(self.dst, len)?;
        let stream = s.stream(self.stream, device)?;
        s.backend.write(stream, self.dst, len, &mut |buf| bulk.read_exact(buf))?;
        Ok(ReplyBody::None)
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

    pub fn apply(self, s: &mut SessionState) -> Result<ReplyBody, Fail> {
        if self.size == 0 {
            return Ok(ReplyBody::None);
        }
        if self.size > rgpu_protocol::frame::MAX_BULK_LEN {
            return Err(CuError::INVALID_VALUE.into());
        }
        let device = s.check_range(self.src, self.size)?;
        let stream = s.stream(self.stream, device)?;
        Ok(ReplyBody::DeviceBytes { src: self.src, len: self.size, stream })
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

    pub fn apply(self, s: &mut SessionState) -> Result<ReplyBody, Fail> {
        if self.size == 0 {
            return Ok(ReplyBody::None);
        }
        s.check_range(self.src, self.size)?;
        let device = s.check_range(self.dst, self.size)?;
        let stream = s.stream(self.stream, device)?;
        s.backend.copy(stream, self.dst, self.src, self.size)?;
        Ok(ReplyBody::None)
    }
}

#[derive(Debug)]
pub struct MemsetCmd {
    pub op: Memset,
    pub stream: u64,
}

impl MemsetCmd {
    pub fn decode(r: memset::Reader<'_>) -> Self {
        let pitch = r.get_pitch();
        MemsetCmd {
            op: Memset {
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

    pub fn apply(self, s: &mut SessionState) -> Result<ReplyBody, Fail> {
        let span = self.op.span().ok_or(CuError::INVALID_VALUE)?;
        if span == 0 {
            return Ok(ReplyBody::None);
        }
        let device = s.check_range(self.op.dst, span)?;
        let stream = s.stream(self.stream, device)?;
        s.backend.memset(stream, &self.op)?;
        Ok(ReplyBody::None)
    }
}
