//! Reading a snapshot back: [`open`] reads its header and session record
//! (who it is, its lease, the devices it needs), so the caller can check
//! the server fits and build an empty session under the same lease; then
//! [`Opened::rebuild`] fills that session from the rest, in order.

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::time::Duration;

use rgpu_cuda_types::CuError;
use rgpu_protocol::SESSION_KEY_LEN;

use super::format::{self, Dec, Head, Tag, MAX_RECORDS};
use super::{SessionMeta, SnapshotError, MAX_CLIENT_NAME, MAX_DEVICES, MAX_GLOBALS};
use crate::backend::{DeviceInfo, StreamRef, TransferError};
use crate::command::DeviceBytes;
use crate::lease::Admission;
use crate::session::window::{self, Kept, ReplyWindow};
use crate::state::{Alloc, Event, Owner, SessionState, Stream};

/// A snapshot whose session record has been read.
pub struct Opened<'a> {
    pub meta: SessionMeta,
    pub device_count: u32,
    /// The ordinals the session may use (its lease's), None: all.
    pub allowed: Option<Vec<u32>>,
    pub sticky: Option<CuError>,
    /// The architecture its modules were loaded for.
    pub arch: u32,
    /// Each device's memory size on the server it was taken on.
    pub device_memory: Vec<u64>,
    lost: u64,
    r: &'a mut dyn Read,
    records: u64,
    /// Ranges a live migration's pre-copy placed (ptr -> device, size):
    /// each is claimed by a delta record.
    staged: Option<HashMap<u64, (u32, u64)>>,
    /// The snapshot's format version: graph records from version 2 on.
    version: u32,
}

/// What [`Opened::rebuild`] did.
pub struct Rebuilt {
    /// The reply window, for the client's resume.
    pub window: ReplyWindow,
    pub memory_bytes: u64,
    pub records: u64,
}

fn devices(d: &mut Dec<'_>) -> Result<Vec<u32>, SnapshotError> {
    let n = d.u32()?;
    if n > MAX_DEVICES {
        return Err(SnapshotError::TooLarge { what: "device list", len: n as u64, max: MAX_DEVICES as u64 });
    }
    (0..n).map(|_| d.u32()).collect()
}

/// Reads the header and the session record of a snapshot.
pub fn open(r: &mut dyn Read) -> Result<Opened<'_>, SnapshotError> {
    let version = format::read_header(r)?;
    let Head { tag, meta, bulk_len } = format::read_record(r)?;
    if tag != Tag::Session || bulk_len != 0 {
        return Err(SnapshotError::Malformed("the first record is not the session's".into()));
    }
    let mut d = Dec::new(&meta, "session");
    let id = d.u64()?;
    let key: [u8; SESSION_KEY_LEN] = d
        .bytes(SESSION_KEY_LEN)?
        .try_into()
        .map_err(|_| SnapshotError::Malformed("session key of the wrong length".into()))?;
    let client_name = String::from_utf8_lossy(d.bytes(MAX_CLIENT_NAME)?).into_owned();
    let executed = d.u64()?;
    let deferred = CuError::from_code(d.u32()?);
    let sticky = CuError::from_code(d.u32()?);
    let device_count = d.u32()?;
    if device_count == 0 || device_count > MAX_DEVICES {
        return Err(SnapshotError::Malformed(format!("{device_count} devices")));
    }
    let allowed = match d.u8()? {
        0 => None,
        1 => Some(devices(&mut d)?),
        b => return Err(SnapshotError::Malformed(format!("allowed-devices tag {b}"))),
    };
    let arch = d.u32()?;
    let device_memory = (0..device_count).map(|_| d.u64()).collect::<Result<Vec<_>, _>>()?;
    let admission = match d.u8()? {
        0 => None,
        1 => {
            let lease = d.u64()?;
            let generation = d.u64()?;
            let memory_limit = d.opt_u64()?;
            let deadline_ms = d.u64()?;
            let devices = devices(&mut d)?;
            let pkey = match d.opt_u64()? {
                None => None,
                Some(k) => Some(u16::try_from(k).map_err(|_| SnapshotError::Malformed("P_Key out of range".into()))?),
            };
            let compute_milli =
                u16::try_from(d.u32()?).map_err(|_| SnapshotError::Malformed("compute share out of range".into()))?;
            Some(Admission { lease, generation, memory_limit, deadline_ms, devices, pkey, compute_milli })
        }
        b => return Err(SnapshotError::Malformed(format!("lease tag {b}"))),
    };
    let lost = d.u64()?;
    d.finish()?;
    if id == 0 {
        return Err(SnapshotError::Malformed("session id 0".into()));
    }
    if let Some(a) = &allowed {
        if a.iter().any(|&o| o >= device_count) {
            return Err(SnapshotError::Malformed("an allowed device past the device count".into()));
        }
    }
    Ok(Opened {
        meta: SessionMeta { id, key, client_name, executed, deferred, admission },
        device_count,
        allowed,
        sticky,
        arch,
        device_memory,
        lost,
        r,
        records: 1,
        staged: None,
        version,
    })
}

impl Opened<'_> {
    /// The rebuild adopts these pre-copied ranges (already placed, and
    /// filled, in the session the rebuild is given) through delta records.
    pub fn with_staged(mut self, ranges: HashMap<u64, (u32, u64)>) -> Self {
        self.staged = Some(ranges);
        self
    }

    /// Whether this server can hold the session: as many devices, each at
    /// least as large (the addresses are the old ones), the same
    /// architecture (its modules' code was chosen for it).
    pub fn check_fits(&self, devices: &[DeviceInfo], arch: u32) -> Result<(), SnapshotError> {
        if devices.len() != self.device_count as usize {
            return Err(SnapshotError::Incompatible(format!(
                "the snapshot was taken on {} devices, this server has {}",
                self.device_count,
                devices.len()
            )));
        }
        for (d, &need) in devices.iter().zip(&self.device_memory) {
            if d.total_mem < need {
                return Err(SnapshotError::Incompatible(format!(
                    "device {} has {} bytes; the snapshot's had {need}",
                    d.ordinal, d.total_mem
                )));
            }
        }
        if arch != self.arch {
            return Err(SnapshotError::Incompatible(format!(
                "the snapshot's modules were loaded for compute capability {}.{}, this server's devices are {}.{}",
                self.arch / 10,
                self.arch % 10,
                arch / 10,
                arch % 10
            )));
        }
        Ok(())
    }

    fn next(&mut self) -> Result<Head, SnapshotError> {
        if self.records >= MAX_RECORDS {
            return Err(SnapshotError::TooLarge { what: "record count", len: self.records, max: MAX_RECORDS });
        }
        self.records += 1;
        format::read_record(self.r)
    }

    /// Fills `state` (empty, made for this session's lease on this server)
    /// from the rest of the snapshot. On error, `state` holds part of the
    /// session: drop it.
    pub fn rebuild(mut self, state: &mut SessionState) -> Result<Rebuilt, SnapshotError> {
        if state.device_count != self.device_count {
            return Err(SnapshotError::Incompatible("device count".into()));
        }
        state.allowed = self.allowed.clone();
        state.sticky = self.sticky;
        if !state.backend.relocatable() {
            return Err(SnapshotError::Unsupported);
        }
        let mut memory_bytes = 0u64;
        let mut kept: Vec<Kept> = Vec::new();
        let mut kept_bytes = 0u64;
        let mut globals_seen: HashSet<u64> = HashSet::new();
        let mut stage = Tag::Module;
        let mut vmm = super::vmm::Rebuild::default();
        loop {
            let h = self.next()?;
            // Records come in stage order; one out of order is refused, so a
            // reply never names a stream not yet rebuilt.
            if h.tag != Tag::End && h.tag.stage() < stage.stage() {
                return Err(SnapshotError::Malformed(format!("a {:?} record after {:?} records", h.tag, stage)));
            }
            // Past the maps: allocations released before are released again.
            if stage.stage() <= Tag::Map.stage() && h.tag.stage() > Tag::Map.stage() {
                vmm.finish(state)?;
            }
            if h.tag != Tag::End {
                stage = h.tag;
            }
            match h.tag {
                Tag::Session => return Err(SnapshotError::Malformed("a second session record".into())),
                Tag::Module => self.module(state, &h)?,
                Tag::Alloc => memory_bytes += self.alloc(state, &h, &mut globals_seen)?,
                Tag::AllocDelta => memory_bytes += self.alloc_delta(state, &h)?,
                Tag::Stream => {
                    no_bulk(&h)?;
                    let mut d = Dec::new(&h.meta, "stream");
                    let (handle, device, flags, priority) = (d.u64()?, d.u32()?, d.u32()?, d.i32()?);
                    d.finish()?;
                    if handle == 0 || state.streams.contains_key(&handle) {
                        return Err(SnapshotError::Malformed(format!("stream handle {handle:#x} is 0 or repeated")));
                    }
                    state.check_device(device).map_err(|e| SnapshotError::Device(e, "placing a stream"))?;
                    let token = state
                        .backend
                        .stream_create(device, flags, priority)
                        .map_err(|e| SnapshotError::Device(e, "creating a stream"))?;
                    state.streams.insert(handle, Stream { token, device, flags, priority });
                }
                Tag::Event => {
                    no_bulk(&h)?;
                    let mut d = Dec::new(&h.meta, "event");
                    let (handle, device, flags, ago) = (d.u64()?, d.u32()?, d.u32()?, d.opt_u64()?);
                    d.finish()?;
                    if handle == 0 || state.events.contains_key(&handle) {
                        return Err(SnapshotError::Malformed(format!("event handle {handle:#x} is 0 or repeated")));
                    }
                    state.check_device(device).map_err(|e| SnapshotError::Device(e, "placing an event"))?;
                    let token = state
                        .backend
                        .event_restore(device, flags, ago.map(Duration::from_nanos))
                        .map_err(|e| SnapshotError::Device(e, "creating an event"))?;
                    state.events.insert(handle, Event { token, device, flags });
                }
                Tag::Graph | Tag::Physical | Tag::Reservation | Tag::Map if self.version < format::GRAPHS_SINCE => {
                    return Err(SnapshotError::Malformed(format!("a {:?} record in a version {} snapshot", h.tag, self.version)));
                }
                Tag::Physical => memory_bytes += vmm.physical(state, &h, &mut *self.r)?,
                Tag::Reservation => vmm.reservation(state, &h)?,
                Tag::Map => vmm.map(state, &h)?,
                Tag::Graph => super::graph::read(state, &h, &mut *self.r)?,
                Tag::Reply => {
                    let mut d = Dec::new(&h.meta, "reply");
                    let seq = d.u64()?;
                    let device = match d.u8()? {
                        0 => None,
                        1 => {
                            let (src, len, stream, device) = (d.u64()?, d.u64()?, d.u64()?, d.u32()?);
                            // A graph launch's reply reads its staging memory.
                            if let Err(e) = state.check_range(src, len) {
                                if !super::graph::in_staging(state, src, len) {
                                    return Err(SnapshotError::Device(e, "checking a kept read"));
                                }
                            }
                            state.check_device(device).map_err(|e| SnapshotError::Device(e, "checking a kept read"))?;
                            let stream: StreamRef = state
                                .stream(stream, device)
                                .map_err(|e| SnapshotError::Device(e, "checking a kept read's stream"))?;
                            Some(DeviceBytes { src, len, stream })
                        }
                        b => return Err(SnapshotError::Malformed(format!("reply device tag {b}"))),
                    };
                    d.finish()?;
                    if kept.last().is_some_and(|k| k.seq >= seq) || seq > self.meta.executed {
                        return Err(SnapshotError::Malformed("kept replies out of order or past the last executed".into()));
                    }
                    let room = window::MAX_BYTES as u64 - kept_bytes.min(window::MAX_BYTES as u64);
                    let frame = format::read_bulk(self.r, h.bulk_len, room, "kept reply")?;
                    kept_bytes += frame.len() as u64;
                    if kept.len() >= window::MAX_REPLIES {
                        return Err(SnapshotError::TooLarge {
                            what: "kept replies",
                            len: kept.len() as u64 + 1,
                            max: window::MAX_REPLIES as u64,
                        });
                    }
                    kept.push(Kept { seq, frame, device });
                }
                Tag::End => {
                    no_bulk(&h)?;
                    let mut d = Dec::new(&h.meta, "end");
                    let (records, memory) = (d.u64()?, d.u64()?);
                    d.finish()?;
                    if records != self.records || memory != memory_bytes {
                        return Err(SnapshotError::Malformed(format!(
                            "the end record counts {records} records and {memory} bytes of memory; read {} and {memory_bytes}",
                            self.records
                        )));
                    }
                    if self.staged.as_ref().is_some_and(|s| !s.is_empty()) {
                        return Err(SnapshotError::Malformed("pre-copied ranges no allocation claimed".into()));
                    }
                    // Every module global must have come with its contents.
                    let globals = state.allocs.iter().filter(|(_, a)| matches!(a.owner, Owner::Module(_))).count();
                    if globals != globals_seen.len() {
                        return Err(SnapshotError::Malformed("a module global without its contents".into()));
                    }
                    return Ok(Rebuilt { window: ReplyWindow::import(kept, self.lost), memory_bytes, records: self.records });
                }
            }
        }
    }

    fn module(&mut self, state: &mut SessionState, h: &Head) -> Result<(), SnapshotError> {
        let mut d = Dec::new(&h.meta, "module");
        let (handle, device, n) = (d.u64()?, d.u32()?, d.u32()?);
        if n > MAX_GLOBALS {
            return Err(SnapshotError::TooLarge { what: "module globals", len: n as u64, max: MAX_GLOBALS as u64 });
        }
        let mut place = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let (p, _size) = (d.u64()?, d.u64()?);
            place.push(p);
        }
        d.finish()?;
        if handle == 0 || state.modules.contains_key(&handle) {
            return Err(SnapshotError::Malformed(format!("module handle {handle:#x} is 0 or repeated")));
        }
        state.check_device(device).map_err(|e| SnapshotError::Device(e, "placing a module"))?;
        let limit = state.input.max_module_image;
        if h.bulk_len > limit {
            return Err(SnapshotError::TooLarge { what: "module image", len: h.bulk_len, max: limit });
        }
        let held = state.input.modules.charge(h.bulk_len).ok_or(SnapshotError::Device(
            CuError::OUT_OF_MEMORY,
            "loading a module (the lease's module quota is full)",
        ))?;
        let image = format::read_bulk(self.r, h.bulk_len, limit, "module image")?;
        crate::command::module::install(state, handle, device, image, held, Some(&place))
            .map_err(|f| match f {
                crate::command::Fail::Cuda(e) => SnapshotError::Device(e, "loading a module"),
                crate::command::Fail::Io(e) => SnapshotError::Io(e),
            })?;
        Ok(())
    }

    /// Rebuilds one allocation and fills it; returns its size.
    fn alloc(&mut self, state: &mut SessionState, h: &Head, globals_seen: &mut HashSet<u64>) -> Result<u64, SnapshotError> {
        let mut d = Dec::new(&h.meta, "allocation");
        let (ptr, device, size) = (d.u64()?, d.u32()?, d.u64()?);
        let owner = match d.u8()? {
            0 => Owner::Client,
            1 => Owner::Module(d.u64()?),
            b => return Err(SnapshotError::Malformed(format!("allocation owner tag {b}"))),
        };
        d.finish()?;
        if h.bulk_len != size {
            return Err(SnapshotError::Malformed(format!("an allocation of {size} bytes carries {} bytes", h.bulk_len)));
        }
        if self.staged.as_ref().is_some_and(|s| s.contains_key(&ptr)) {
            return Err(SnapshotError::Malformed(format!("pre-copied allocation {ptr:#x} sent whole")));
        }
        state.check_device(device).map_err(|e| SnapshotError::Device(e, "placing an allocation"))?;
        let total = state.device_memory.get(device as usize).copied().unwrap_or(0);
        if size > total {
            return Err(SnapshotError::TooLarge { what: "allocation", len: size, max: total });
        }
        match owner {
            Owner::Client => {
                if size == 0 {
                    return Err(SnapshotError::Malformed("an empty client allocation".into()));
                }
                state
                    .backend
                    .mem_alloc_at(device, ptr, size)
                    .map_err(|e| SnapshotError::Device(e, "placing an allocation at its address"))?;
                state.allocs.insert(ptr, Alloc { device, size, owner });
            }
            Owner::Imported => return Err(SnapshotError::Malformed("an allocation of another session".into())),
            Owner::Module(m) => {
                // Placed by its module's load: the record must match it exactly.
                let ok = state.allocs.get(&ptr).is_some_and(|a| a.owner == owner && a.size == size && a.device == device);
                if !ok || !globals_seen.insert(ptr) {
                    return Err(SnapshotError::Malformed(format!("allocation {ptr:#x} is no global of module {m:#x}")));
                }
            }
        }
        if size > 0 {
            let r = &mut *self.r;
            let filled = state.backend.memcpy_htod(StreamRef::Default { device }, ptr, size, &mut |buf| r.read_exact(buf));
            match filled {
                Ok(()) => {}
                Err(TransferError::Io(e)) => return Err(SnapshotError::read(e)),
                Err(TransferError::Device(e)) => return Err(SnapshotError::Device(e, "writing device memory")),
            }
        }
        Ok(size)
    }
}

impl Opened<'_> {
    /// Adopts a pre-copied allocation and writes the runs changed since;
    /// returns its size.
    fn alloc_delta(&mut self, state: &mut SessionState, h: &Head) -> Result<u64, SnapshotError> {
        let mut d = Dec::new(&h.meta, "delta allocation");
        let (ptr, device, size, n) = (d.u64()?, d.u32()?, d.u64()?, d.u32()? as usize);
        if n > super::precopy::MAX_RUNS {
            return Err(SnapshotError::TooLarge { what: "delta runs", len: n as u64, max: super::precopy::MAX_RUNS as u64 });
        }
        let mut runs = Vec::with_capacity(n);
        let (mut end, mut bulk) = (0u64, 0u64);
        for _ in 0..n {
            let (o, l) = (d.u64()?, d.u64()?);
            // In order, apart, inside the allocation.
            if l == 0 || o < end || o.checked_add(l).is_none_or(|e| e > size) {
                return Err(SnapshotError::Malformed(format!("delta run {o:#x}+{l:#x} of allocation {ptr:#x}")));
            }
            end = o + l;
            bulk += l;
            runs.push((o, l));
        }
        d.finish()?;
        if bulk != h.bulk_len {
            return Err(SnapshotError::Malformed(format!("delta runs of {bulk} bytes carry {} bytes", h.bulk_len)));
        }
        let Some(staged) = self.staged.as_mut() else {
            return Err(SnapshotError::Malformed("a delta allocation outside a migration".into()));
        };
        if staged.remove(&ptr) != Some((device, size)) {
            return Err(SnapshotError::Malformed(format!("delta allocation {ptr:#x} was not pre-copied as such")));
        }
        state.allocs.insert(ptr, Alloc { device, size, owner: Owner::Client });
        for (o, l) in runs {
            let r = &mut *self.r;
            let filled = state.backend.memcpy_htod(StreamRef::Default { device }, ptr + o, l, &mut |buf| r.read_exact(buf));
            match filled {
                Ok(()) => {}
                Err(TransferError::Io(e)) => return Err(SnapshotError::read(e)),
                Err(TransferError::Device(e)) => return Err(SnapshotError::Device(e, "writing device memory")),
            }
        }
        Ok(size)
    }
}

pub(super) fn no_bulk(h: &Head) -> Result<(), SnapshotError> {
    if h.bulk_len == 0 {
        Ok(())
    } else {
        Err(SnapshotError::Malformed(format!("a {:?} record with bulk", h.tag)))
    }
}
