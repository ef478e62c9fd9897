//! Virtual memory management objects in a snapshot (format version 2):
//! physical allocations with their whole contents (mapped or not: a later
//! map sees them), reservations at their addresses, and maps with their
//! access, so every pointer the program holds into mapped memory (PyTorch's
//! expandable segments, `cuMemMap` by hand) names the same bytes after the
//! rebuild. Each is rebuilt through the same checks as the client's request
//! ([`crate::vmm::Vmm`]); a reservation must land exactly where it was.
//!
//! Records, in this order: `Physical` (meta `handle u64, device u32, size
//! u64, released u8`; bulk: the contents), `Reservation` (`start u64, size
//! u64`), `Map` (`ptr u64, size u64, handle u64, offset u64, access u32`).
//! A released allocation is released again once its maps are rebuilt.

use std::io::{Read, Write};

use super::format::{self, Dec, Enc, Head, Tag};
use super::rebuild::no_bulk;
use super::SnapshotError;
use crate::backend::TransferError;
use crate::state::SessionState;
use crate::vmm::ACCESS_NONE;

fn device_error(e: rgpu_cuda_types::CuError, doing: &'static str) -> SnapshotError {
    SnapshotError::Device(e, doing)
}

/// Writes every VMM record of the session; returns (records, bytes of contents).
pub fn write(state: &mut SessionState, w: &mut dyn Write) -> Result<(u64, u64), SnapshotError> {
    let image = state.vmm.image();
    let (mut records, mut bytes) = (0u64, 0u64);
    for p in &image.physical {
        let mut e = Enc::default();
        e.u64(p.handle).u32(p.device).u64(p.size).u8(p.released as u8);
        format::write_record(w, Tag::Physical, &e, p.size)?;
        let token = state.vmm.token(p.handle).ok_or(SnapshotError::Malformed(format!("no physical allocation {:#x}", p.handle)))?;
        let mut sent = 0u64;
        let read = state.backend.mem_physical_read(token, &mut |chunk| {
            w.write_all(chunk)?;
            sent += chunk.len() as u64;
            Ok(())
        });
        match read {
            Ok(()) if sent == p.size => {}
            Ok(()) => return Err(SnapshotError::Io(std::io::Error::other("a physical allocation gave fewer bytes than its size"))),
            Err(TransferError::Io(e)) => return Err(SnapshotError::Io(e)),
            Err(TransferError::Device(e)) => return Err(device_error(e, "reading a physical allocation")),
        }
        records += 1;
        bytes += p.size;
    }
    for &(start, size) in &image.reservations {
        let mut e = Enc::default();
        e.u64(start).u64(size);
        format::write_record(w, Tag::Reservation, &e, 0)?;
        records += 1;
    }
    for m in &image.mappings {
        let mut e = Enc::default();
        e.u64(m.ptr).u64(m.size).u64(m.handle).u64(m.offset).u32(m.access);
        format::write_record(w, Tag::Map, &e, 0)?;
        records += 1;
    }
    Ok((records, bytes))
}

/// Rebuilds the session's VMM objects record by record.
#[derive(Default)]
pub struct Rebuild {
    /// Allocations the snapshot says were released: released again once
    /// their maps are rebuilt (a map needs an allocation not yet released).
    to_release: Vec<u64>,
}

impl Rebuild {
    /// A `Physical` record; returns its size (device memory carried).
    pub fn physical(&mut self, state: &mut SessionState, h: &Head, r: &mut dyn Read) -> Result<u64, SnapshotError> {
        let mut d = Dec::new(&h.meta, "physical allocation");
        let (handle, device, size, released) = (d.u64()?, d.u32()?, d.u64()?, d.u8()?);
        d.finish()?;
        let released = match released {
            0 => false,
            1 => true,
            b => return Err(SnapshotError::Malformed(format!("physical allocation released flag {b}"))),
        };
        if h.bulk_len != size {
            return Err(SnapshotError::Malformed(format!("a physical allocation of {size} bytes carries {} bytes", h.bulk_len)));
        }
        state.check_device(device).map_err(|e| device_error(e, "placing a physical allocation"))?;
        let total = state.device_memory.get(device as usize).copied().unwrap_or(0);
        if size > total {
            return Err(SnapshotError::TooLarge { what: "physical allocation", len: size, max: total });
        }
        // Handle, size and granularity checked as cuMemCreate's.
        state.vmm.create(state.backend.as_mut(), handle, device, size).map_err(|e| device_error(e, "creating a physical allocation"))?;
        let token = state.vmm.token(handle).ok_or(SnapshotError::Malformed("a physical allocation not created".into()))?;
        let filled = state.backend.mem_physical_write(token, &mut |buf| r.read_exact(buf));
        match filled {
            Ok(()) => {}
            Err(TransferError::Io(e)) => return Err(SnapshotError::read(e)),
            Err(TransferError::Device(e)) => return Err(device_error(e, "writing a physical allocation")),
        }
        if released {
            self.to_release.push(handle);
        }
        Ok(size)
    }

    /// A `Reservation` record: the range must be had exactly.
    pub fn reservation(&mut self, state: &mut SessionState, h: &Head) -> Result<(), SnapshotError> {
        no_bulk(h)?;
        let mut d = Dec::new(&h.meta, "reservation");
        let (start, size) = (d.u64()?, d.u64()?);
        d.finish()?;
        state.vmm.reserve_at(state.backend.as_mut(), start, size).map_err(|e| device_error(e, "reserving an address range where it was"))
    }

    /// A `Map` record, and its access.
    pub fn map(&mut self, state: &mut SessionState, h: &Head) -> Result<(), SnapshotError> {
        no_bulk(h)?;
        let mut d = Dec::new(&h.meta, "map");
        let (ptr, size, handle, offset, access) = (d.u64()?, d.u64()?, d.u64()?, d.u64()?, d.u32()?);
        d.finish()?;
        state.vmm.map(state.backend.as_mut(), ptr, size, offset, handle).map_err(|e| device_error(e, "mapping memory where it was"))?;
        if access == ACCESS_NONE {
            return Ok(());
        }
        // The access of the allocation's own device, as captured.
        let device = state.vmm.device_of(handle).ok_or(SnapshotError::Malformed(format!("no physical allocation {handle:#x}")))?;
        state
            .vmm
            .set_access(state.backend.as_mut(), ptr, size, device, access)
            .map_err(|e| device_error(e, "giving a map its access"))
    }

    /// Once the maps are rebuilt: the allocations released before are released again.
    pub fn finish(&mut self, state: &mut SessionState) -> Result<(), SnapshotError> {
        for handle in self.to_release.drain(..) {
            state.vmm.release(state.backend.as_mut(), handle).map_err(|e| device_error(e, "releasing a physical allocation"))?;
        }
        Ok(())
    }
}
