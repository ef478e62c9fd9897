//! Writing a session: quiesce it, then its records in the order the reader
//! rebuilds them (modules before allocations, so a global's contents
//! overwrite its initial value; streams before the replies that name them).

use std::io::{self, Write};
use std::time::{Duration, Instant};

use super::format::{self, Enc, Tag};
use super::precopy::{self, Precopied};
use super::{SessionMeta, SnapshotError};
use crate::backend::{StreamRef, TransferError};
use crate::session::window::ReplyWindow;
use crate::state::{Owner, SessionState};

/// What [`capture`] wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Captured {
    /// Bytes written, header to end.
    pub bytes: u64,
    /// Of which device memory contents.
    pub memory_bytes: u64,
    pub records: u64,
    /// How long the session's queued work took to finish first.
    pub quiesced_in: Duration,
    /// Device memory bytes actually written: less than `memory_bytes` where
    /// a pre-copy had sent the rest.
    pub memory_sent: u64,
}

/// Counts what goes through.
struct Counting<'a> {
    w: &'a mut dyn Write,
    n: u64,
}

impl Write for Counting<'_> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        let n = self.w.write(b)?;
        self.n += n as u64;
        Ok(n)
    }
    fn write_all(&mut self, b: &[u8]) -> io::Result<()> {
        self.w.write_all(b)?;
        self.n += b.len() as u64;
        Ok(())
    }
    fn flush(&mut self) -> io::Result<()> {
        self.w.flush()
    }
}

/// Why the session cannot be written to a snapshot, if it cannot: checked
/// before a capture writes anything, and before a migration copies a byte.
pub fn check_capturable(state: &mut SessionState) -> Result<(), SnapshotError> {
    if !state.backend.relocatable() {
        return Err(SnapshotError::Unsupported);
    }
    // A graph is rebuilt by instantiating it again; one that names objects
    // destroyed since its instantiation could not be, and the snapshot
    // would never restore.
    let stale = state.graph_execs.values().any(|g| crate::command::graph::check(state, g.device, crate::command::graph::wire_ops(g)).is_err());
    if stale {
        return Err(SnapshotError::NotCapturable(
            "it holds an instantiated graph naming memory, a module or an event destroyed since (destroy or update the graph first)",
        ));
    }
    if state.ipc.is_active() {
        // The memory is another process's too: moving it would split what they share.
        return Err(SnapshotError::NotCapturable("it shares memory with another process (CUDA IPC)"));
    }
    Ok(())
}

/// Waits (at most `quiesce`) for the session's queued work, then writes it
/// to `out`. The caller holds the session still: no request of it runs
/// meanwhile (the session thread itself calls this, between requests).
/// Nothing is written when the session cannot be captured.
pub fn capture(
    state: &mut SessionState,
    meta: &SessionMeta,
    window: &ReplyWindow,
    quiesce: Duration,
    out: &mut dyn Write,
    precopied: Option<&Precopied>,
) -> Result<Captured, SnapshotError> {
    check_capturable(state)?;
    let started = Instant::now();
    state.backend.quiesce(quiesce).map_err(|_| SnapshotError::Busy(quiesce))?;
    let quiesced_in = started.elapsed();
    let mut w = Counting { w: out, n: 0 };
    let mut records = 0u64;
    let mut memory_bytes = 0u64;
    let mut memory_sent = 0u64;
    // Version 1 where it suffices, so that servers without graphs in their
    // format still read what needs none.
    let version = if state.graph_execs.is_empty() && state.vmm.is_empty() { 1 } else { format::GRAPHS_SINCE };
    format::write_header(&mut w, version)?;

    let (kept, lost) = window.export();
    let mut e = Enc::default();
    e.u64(meta.id).bytes(&meta.key).bytes(meta.client_name.as_bytes());
    e.u64(meta.executed).u32(meta.deferred.map_or(0, |c| c.code())).u32(state.sticky.map_or(0, |c| c.code()));
    e.u32(state.device_count);
    match &state.allowed {
        Some(a) => {
            e.u8(1).u32(a.len() as u32);
            for &d in a {
                e.u32(d);
            }
        }
        None => {
            e.u8(0);
        }
    }
    e.u32(state.backend.module_arch(0));
    for d in 0..state.device_count as usize {
        e.u64(state.device_memory.get(d).copied().unwrap_or(0));
    }
    match &meta.admission {
        Some(a) => {
            e.u8(1).u64(a.lease).u64(a.generation).opt_u64(a.memory_limit).u64(a.deadline_ms);
            e.u32(a.devices.len() as u32);
            for &d in &a.devices {
                e.u32(d);
            }
            e.opt_u64(a.pkey.map(u64::from)).u32(a.compute_milli as u32);
        }
        None => {
            e.u8(0);
        }
    }
    e.u64(lost);
    format::write_record(&mut w, Tag::Session, &e, 0)?;
    records += 1;

    let mut modules: Vec<(&u64, &crate::state::Module)> = state.modules.iter().collect();
    modules.sort_by_key(|(h, _)| **h);
    for (&handle, m) in modules {
        let mut e = Enc::default();
        e.u64(handle).u32(m.device).u32(m.globals.len() as u32);
        for p in &m.globals {
            let size = state.allocs.get(p).map_or(0, |a| a.size);
            e.u64(*p).u64(size);
        }
        format::write_record(&mut w, Tag::Module, &e, m.source.len() as u64)?;
        w.write_all(&m.source)?;
        records += 1;
    }

    let allocs: Vec<(u64, crate::state::Alloc)> = state.allocs.iter().map(|(&p, a)| (p, *a)).collect();
    let sent_of = |ptr: u64, a: &crate::state::Alloc| {
        precopied.and_then(|p| p.get(&ptr)).filter(|s| a.owner == Owner::Client && s.device == a.device && s.size == a.size)
    };
    // What changed since the pre-copy, digested on all cores where the
    // backend can be read from other threads.
    let targets: Vec<(u64, &precopy::Sent)> = allocs.iter().filter_map(|(p, a)| sent_of(*p, a).map(|s| (*p, s))).collect();
    let digest_started = Instant::now();
    let dirty = match state.backend.memory_peek() {
        Some(peek) if !targets.is_empty() => Some(precopy::dirty_all(&*peek, &targets)),
        _ => None,
    };
    if !targets.is_empty() {
        let bytes: u64 = targets.iter().map(|(_, s)| s.size).sum();
        tracing::info!(bytes, ms = digest_started.elapsed().as_secs_f64() * 1e3, "pre-copied memory digested again");
    }
    for (ptr, a) in allocs {
        if let Some(sent) = sent_of(ptr, &a) {
            let runs = match dirty.as_ref().and_then(|d| d.get(&ptr)) {
                Some(r) => r.clone(),
                None => precopy::dirty_runs(state, ptr, sent)?,
            };
            let bulk: u64 = runs.iter().map(|r| r.1).sum();
            let mut e = Enc::default();
            e.u64(ptr).u32(a.device).u64(a.size).u32(runs.len() as u32);
            for &(o, l) in &runs {
                e.u64(o).u64(l);
            }
            format::write_record(&mut w, Tag::AllocDelta, &e, bulk)?;
            for (o, l) in runs {
                copy_out(state, a.device, ptr + o, l, &mut w)?;
            }
            memory_bytes += a.size;
            memory_sent += bulk;
            records += 1;
            continue;
        }
        let mut e = Enc::default();
        e.u64(ptr).u32(a.device).u64(a.size);
        match a.owner {
            Owner::Client => e.u8(0),
            Owner::Module(h) => e.u8(1).u64(h),
            Owner::Imported => return Err(SnapshotError::NotCapturable("it shares memory with another process (CUDA IPC)")),
        };
        format::write_record(&mut w, Tag::Alloc, &e, a.size)?;
        copy_out(state, a.device, ptr, a.size, &mut w)?;
        memory_bytes += a.size;
        memory_sent += a.size;
        records += 1;
    }

    let (vmm_records, vmm_bytes) = super::vmm::write(state, &mut w)?;
    records += vmm_records;
    memory_bytes += vmm_bytes;
    memory_sent += vmm_bytes;

    let mut streams: Vec<_> = state.streams.iter().map(|(&h, s)| (h, *s)).collect();
    streams.sort_by_key(|(h, _)| *h);
    for (handle, s) in streams {
        let mut e = Enc::default();
        e.u64(handle).u32(s.device).u32(s.flags).i32(s.priority);
        format::write_record(&mut w, Tag::Stream, &e, 0)?;
        records += 1;
    }

    let mut events: Vec<_> = state.events.iter().map(|(&h, ev)| (h, *ev)).collect();
    events.sort_by_key(|(h, _)| *h);
    for (handle, ev) in events {
        let ago = state
            .backend
            .event_recorded_ago(ev.token)
            .map_err(|c| SnapshotError::Device(c, "reading an event's record"))?;
        let mut e = Enc::default();
        e.u64(handle).u32(ev.device).u32(ev.flags).opt_u64(ago.map(|d| d.as_nanos().min(u64::MAX as u128) as u64));
        format::write_record(&mut w, Tag::Event, &e, 0)?;
        records += 1;
    }

    let mut graphs: Vec<u64> = state.graph_execs.keys().copied().collect();
    graphs.sort_unstable();
    for handle in graphs {
        super::graph::write(state, handle, &mut w)?;
        records += 1;
    }

    for k in kept {
        let mut e = Enc::default();
        e.u64(k.seq);
        match k.device {
            Some(d) => {
                let (handle, device) = match d.stream {
                    StreamRef::Default { device } => (0, device),
                    StreamRef::Created(t) => match state.streams.iter().find(|(_, s)| s.token == t) {
                        Some((&h, s)) => (h, s.device),
                        // Destroyed since: the read is ordered after nothing left.
                        None => (0, state.check_range(d.src, d.len).unwrap_or(0)),
                    },
                };
                e.u8(1).u64(d.src).u64(d.len).u64(handle).u32(device);
            }
            None => {
                e.u8(0);
            }
        }
        format::write_record(&mut w, Tag::Reply, &e, k.frame.len() as u64)?;
        w.write_all(&k.frame)?;
        records += 1;
    }

    let mut e = Enc::default();
    records += 1;
    e.u64(records).u64(memory_bytes);
    format::write_record(&mut w, Tag::End, &e, 0)?;
    w.flush()?;
    Ok(Captured { bytes: w.n, memory_bytes, records, quiesced_in, memory_sent })
}

/// Streams `[ptr, ptr + len)` from device memory to `w`, never whole in a buffer.
pub(super) fn copy_out(state: &mut SessionState, device: u32, ptr: u64, len: u64, w: &mut dyn Write) -> Result<(), SnapshotError> {
    if len == 0 {
        return Ok(());
    }
    let mut sent = 0u64;
    let r = state.backend.memcpy_dtoh(StreamRef::Default { device }, ptr, len, &mut |chunk| {
        w.write_all(chunk)?;
        sent += chunk.len() as u64;
        Ok(())
    });
    match r {
        Ok(()) if sent == len => Ok(()),
        Ok(()) => Err(SnapshotError::Io(io::Error::other("device produced fewer bytes than asked"))),
        Err(TransferError::Io(e)) => Err(SnapshotError::Io(e)),
        Err(TransferError::Device(e)) => Err(SnapshotError::Device(e, "reading device memory")),
    }
}
