//! Pre-copy for live migration: a session's client allocations sent while
//! it runs, so that holding it still costs only what it wrote since.
//!
//! The sender reads each allocation chunk by chunk through the backend's
//! [`MemoryPeek`] while the program's kernels may be writing it, and keeps a
//! 128-bit digest (XXH3-128) of exactly the bytes it sent. Once the session
//! is held still, [`dirty_runs`] digests the allocation again and the
//! snapshot carries only the chunks whose digest changed (an
//! [`super::format::Tag::AllocDelta`] record). No write tracking is needed,
//! so any writer (interpreter, copies, memsets) is covered; a chunk torn
//! by a concurrent write digests differently and is sent again. The cost
//! moved into the pause is one read of the pre-copied memory.
//!
//! The receiver ([`receive`]) places each range at its address in the
//! backend session the rebuild will use ([`Staged`]), so the rebuild only
//! applies the runs.
//!
//! Stream, inside the migration's chunks: for a leased session first
//! `2, lease u64, limit u64` (`u64::MAX`: no memory limit), so that the
//! target charges the staged ranges to that lease's memory budget from the
//! first byte; then items `1, ptr u64, device u32, size u64, size bytes`,
//! ended by `0`; then, once the session is held still, the ranges that are
//! no longer what was sent (freed, or reallocated at another size): `u32 n,
//! n x ptr u64`; then the snapshot, whose lease must be the one announced.

use std::collections::HashMap;
use std::io::{self, Read, Write};

use super::SnapshotError;
use crate::backend::{BackendSession, MemoryPeek, StreamRef, TransferError};
use crate::state::{Owner, SessionState};

/// Digest granularity: what a write anywhere in it costs to send again.
pub const CHUNK: u64 = 256 << 10;
/// Below this much client memory a pre-copy is not worth its extra visit.
pub const MIN_BYTES: u64 = 8 << 20;
/// Most ranges one pre-copy may stage.
pub const MAX_RANGES: usize = 1 << 20;
/// Most runs one delta record lists (its metadata stays under the format's bound).
pub const MAX_RUNS: usize = 1 << 15;

/// What the pre-copy sent of one allocation.
pub struct Sent {
    pub device: u32,
    pub size: u64,
    /// One per chunk; None: not read (the allocation went away meanwhile),
    /// so it is sent again whatever it holds.
    pub digests: Vec<Option<u128>>,
}

/// Pre-copied allocations by address.
pub type Precopied = HashMap<u64, Sent>;

/// Whose memory a pre-copy stages: a broker lease and its memory limit
/// (None: whole GPUs), as the session's admission says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Whose {
    pub lease: u64,
    pub memory_limit: Option<u64>,
}

const NO_LIMIT: u64 = u64::MAX;

fn digest(b: &[u8]) -> u128 {
    twox_hash::XxHash3_128::oneshot(b)
}

/// A session's client allocations, as a pre-copy takes them: (ptr, device, size).
pub fn client_allocs(state: &SessionState) -> Vec<(u64, u32, u64)> {
    let mut v: Vec<(u64, u32, u64)> =
        state.allocs.iter().filter(|(_, a)| a.owner == Owner::Client && a.size > 0).map(|(&p, a)| (p, a.device, a.size)).collect();
    v.sort_by_key(|&(p, _, _)| p);
    v
}

/// Sends `allocs` through `peek` to `w` while their session runs, as
/// `whose` memory; returns what was sent. The end marker is written too.
/// Reading and digesting run on one thread, writing on the caller's, so the
/// copy goes at the rate of the slower of the two rather than of both added.
pub fn send(peek: &dyn MemoryPeek, allocs: &[(u64, u32, u64)], whose: Option<Whose>, w: &mut dyn Write) -> io::Result<Precopied> {
    if let Some(l) = whose {
        let mut b = [0u8; 17];
        b[0] = 2;
        b[1..9].copy_from_slice(&l.lease.to_le_bytes());
        b[9..].copy_from_slice(&l.memory_limit.unwrap_or(NO_LIMIT).to_le_bytes());
        w.write_all(&b)?;
    }
    // Buffers in flight between the reader and the writer, and back.
    const DEPTH: usize = 4;
    let (full_tx, full_rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(DEPTH);
    let (empty_tx, empty_rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(DEPTH + 1);
    for _ in 0..DEPTH {
        let _ = empty_tx.send(Vec::with_capacity(CHUNK as usize + 32));
    }
    std::thread::scope(|sc| {
        let reader = sc.spawn(move || {
            let mut sent = Precopied::new();
            for &(ptr, device, size) in allocs.iter().take(MAX_RANGES) {
                let mut digests = Vec::with_capacity(size.div_ceil(CHUNK) as usize);
                let mut at = 0u64;
                while at < size {
                    // The writer stopped (its socket failed): stop too.
                    let Ok(mut b) = empty_rx.recv() else { return sent };
                    b.clear();
                    if at == 0 {
                        b.push(1);
                        b.extend_from_slice(&ptr.to_le_bytes());
                        b.extend_from_slice(&device.to_le_bytes());
                        b.extend_from_slice(&size.to_le_bytes());
                    }
                    let n = CHUNK.min(size - at) as usize;
                    let start = b.len();
                    b.resize(start + n, 0);
                    let part = &mut b[start..];
                    if peek.peek(device, ptr, size, ptr + at, part) {
                        digests.push(Some(digest(part)));
                    } else {
                        part.fill(0);
                        digests.push(None);
                    }
                    if full_tx.send(b).is_err() {
                        return sent;
                    }
                    at += n as u64;
                }
                sent.insert(ptr, Sent { device, size, digests });
            }
            sent
        });
        let mut written: io::Result<()> = Ok(());
        for b in full_rx.iter() {
            if written.is_ok() {
                written = w.write_all(&b);
            }
            if written.is_err() {
                // Dropping the receivers ends the reader at its next buffer.
                break;
            }
            let _ = empty_tx.send(b);
        }
        drop(empty_tx);
        drop(full_rx);
        let sent = reader.join().map_err(|_| io::Error::other("the pre-copy reader panicked"))?;
        written?;
        w.write_all(&[0])?;
        Ok(sent)
    })
}

/// The pre-copied ranges `state` no longer holds as they were sent (freed,
/// or another allocation at the address): the receiver drops them.
pub fn stale(sent: &Precopied, state: &SessionState) -> Vec<u64> {
    let mut v: Vec<u64> = sent
        .iter()
        .filter(|(p, s)| !state.allocs.get(p).is_some_and(|a| a.owner == Owner::Client && a.device == s.device && a.size == s.size))
        .map(|(&p, _)| p)
        .collect();
    v.sort_unstable();
    v
}

/// Writes the stale list.
pub fn send_stale(stale: &[u64], w: &mut dyn Write) -> io::Result<()> {
    w.write_all(&(stale.len() as u32).to_le_bytes())?;
    for p in stale {
        w.write_all(&p.to_le_bytes())?;
    }
    Ok(())
}

/// The chunk runs `(offset, len)` of a held-still allocation whose digest
/// differs from what was sent, adjacent chunks merged.
pub fn dirty_runs(state: &mut SessionState, ptr: u64, sent: &Sent) -> Result<Vec<(u64, u64)>, SnapshotError> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let mut buf = Vec::with_capacity(CHUNK as usize);
    for (i, d) in sent.digests.iter().enumerate() {
        let at = i as u64 * CHUNK;
        let n = CHUNK.min(sent.size - at);
        let same = match d {
            None => false,
            Some(d) => {
                buf.clear();
                let r = state.backend.memcpy_dtoh(StreamRef::Default { device: sent.device }, ptr + at, n, &mut |c| {
                    buf.extend_from_slice(c);
                    Ok(())
                });
                match r {
                    Ok(()) => {}
                    Err(TransferError::Io(e)) => return Err(SnapshotError::Io(e)),
                    Err(TransferError::Device(e)) => return Err(SnapshotError::Device(e, "reading device memory")),
                }
                buf.len() as u64 == n && digest(&buf) == *d
            }
        };
        if same {
            continue;
        }
        match runs.last_mut() {
            Some((o, l)) if *o + *l == at => *l += n,
            _ => runs.push((at, n)),
        }
    }
    Ok(capped(runs))
}

/// Too scattered to list: one run from the first dirty byte to the last
/// dirty one (more bytes, never fewer).
fn capped(runs: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    if runs.len() <= MAX_RUNS {
        return runs;
    }
    let (first, last) = (runs[0].0, runs[runs.len() - 1]);
    vec![(first, last.0 + last.1 - first)]
}

/// As [`dirty_runs`] for every allocation in `targets` at once, the chunks
/// digested on all cores through `peek` (the session is held still, so
/// nothing writes them): the pause pays one read of the pre-copied memory,
/// divided by the cores.
pub fn dirty_all(peek: &dyn MemoryPeek, targets: &[(u64, &Sent)]) -> HashMap<u64, Vec<(u64, u64)>> {
    let items: Vec<(usize, usize)> =
        targets.iter().enumerate().flat_map(|(a, (_, s))| (0..s.digests.len()).map(move |c| (a, c))).collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 8);
    let per = items.len().div_ceil(threads).max(1);
    let same: Vec<bool> = std::thread::scope(|sc| {
        let parts: Vec<_> = items
            .chunks(per)
            .map(|part| {
                sc.spawn(move || {
                    part.iter()
                        .map(|&(a, c)| {
                            let (ptr, s) = targets[a];
                            let at = c as u64 * CHUNK;
                            let n = CHUNK.min(s.size - at);
                            s.digests[c].is_some_and(|d| {
                                let mut same = false;
                                peek.with_held(s.device, ptr + at, n, &mut |b| same = digest(b) == d) && same
                            })
                        })
                        .collect::<Vec<bool>>()
                })
            })
            .collect();
        // A thread that panicked counts its chunks as changed (sent again).
        parts.into_iter().zip(items.chunks(per)).flat_map(|(h, part)| h.join().unwrap_or_else(|_| vec![false; part.len()])).collect()
    });
    let mut out: HashMap<u64, Vec<(u64, u64)>> = targets.iter().map(|(p, _)| (*p, Vec::new())).collect();
    for (&(a, c), same) in items.iter().zip(same) {
        if same {
            continue;
        }
        let (ptr, s) = targets[a];
        let at = c as u64 * CHUNK;
        let n = CHUNK.min(s.size - at);
        let runs = out.entry(ptr).or_default();
        match runs.last_mut() {
            Some((o, l)) if *o + *l == at => *l += n,
            _ => runs.push((at, n)),
        }
    }
    out.into_iter().map(|(p, r)| (p, capped(r))).collect()
}

/// A backend session holding the pre-copied ranges at their addresses,
/// for the rebuild to adopt.
pub struct Staged {
    pub backend: Box<dyn BackendSession>,
    /// ptr -> (device, size)
    pub ranges: HashMap<u64, (u32, u64)>,
    /// The lease the stream announced, whose budget `backend` charges.
    pub whose: Option<Whose>,
}

impl Staged {
    /// The staged ranges were charged to the lease the pre-copy announced:
    /// the snapshot must be of that lease (`admission`), or they would
    /// count against another lease's budget, or none.
    pub fn check_lease(&self, admission: Option<&crate::lease::Admission>) -> Result<(), SnapshotError> {
        let snapshot = admission.map(|a| Whose { lease: a.lease, memory_limit: a.memory_limit });
        if self.whose == snapshot {
            return Ok(());
        }
        Err(SnapshotError::Malformed(format!(
            "the pre-copy staged memory for lease {:?}, the snapshot is of lease {:?}",
            self.whose.map(|w| w.lease),
            snapshot.map(|w| w.lease)
        )))
    }
}

fn read_u<const N: usize>(r: &mut dyn Read) -> Result<[u8; N], SnapshotError> {
    let mut b = [0u8; N];
    r.read_exact(&mut b).map_err(SnapshotError::read)?;
    Ok(b)
}

/// Reads the pre-copied ranges from `r` into a session `open` gives for the
/// lease the stream announces (called at the first range only: an empty
/// pre-copy opens nothing), each device at most `device_memory[d]` bytes in
/// all; then the stale list, whose ranges are freed. None: nothing was
/// pre-copied.
pub fn receive(
    r: &mut dyn Read,
    device_memory: &[u64],
    open: &mut dyn FnMut(Option<Whose>) -> Result<Box<dyn BackendSession>, SnapshotError>,
) -> Result<Option<Staged>, SnapshotError> {
    let mut staged: Option<Staged> = None;
    let mut used = vec![0u64; device_memory.len()];
    let mut whose: Option<Whose> = None;
    let mut first = true;
    loop {
        match read_u::<1>(r)?[0] {
            0 => break,
            1 => {}
            // Only before any range: a range already staged was charged to
            // no lease or another one.
            2 if first => {
                let lease = u64::from_le_bytes(read_u::<8>(r)?);
                let limit = u64::from_le_bytes(read_u::<8>(r)?);
                whose = Some(Whose { lease, memory_limit: (limit != NO_LIMIT).then_some(limit) });
                first = false;
                continue;
            }
            b => return Err(SnapshotError::Malformed(format!("pre-copy item tag {b}"))),
        }
        first = false;
        let ptr = u64::from_le_bytes(read_u::<8>(r)?);
        let device = u32::from_le_bytes(read_u::<4>(r)?);
        let size = u64::from_le_bytes(read_u::<8>(r)?);
        let total = *device_memory.get(device as usize).ok_or(SnapshotError::Device(rgpu_cuda_types::CuError::INVALID_DEVICE, "staging a pre-copied range"))?;
        used[device as usize] = used[device as usize].saturating_add(size);
        if size == 0 || used[device as usize] > total {
            return Err(SnapshotError::TooLarge { what: "pre-copied memory", len: used[device as usize], max: total });
        }
        if staged.is_none() {
            staged = Some(Staged { backend: open(whose)?, ranges: HashMap::new(), whose });
        }
        let s = staged.as_mut().ok_or(SnapshotError::Malformed("no staging session".into()))?;
        if s.ranges.len() >= MAX_RANGES || s.ranges.contains_key(&ptr) {
            return Err(SnapshotError::Malformed(format!("pre-copied range {ptr:#x} repeated, or too many ranges")));
        }
        s.backend.mem_alloc_at(device, ptr, size).map_err(|e| SnapshotError::Device(e, "staging a pre-copied range"))?;
        s.ranges.insert(ptr, (device, size));
        let filled = s.backend.memcpy_htod(StreamRef::Default { device }, ptr, size, &mut |buf| r.read_exact(buf));
        match filled {
            Ok(()) => {}
            Err(TransferError::Io(e)) => return Err(SnapshotError::read(e)),
            Err(TransferError::Device(e)) => return Err(SnapshotError::Device(e, "writing a pre-copied range")),
        }
    }
    let n = u32::from_le_bytes(read_u::<4>(r)?) as usize;
    if n > staged.as_ref().map_or(0, |s| s.ranges.len()) {
        return Err(SnapshotError::Malformed(format!("{n} stale ranges, more than were pre-copied")));
    }
    for _ in 0..n {
        let ptr = u64::from_le_bytes(read_u::<8>(r)?);
        let s = staged.as_mut().ok_or(SnapshotError::Malformed("a stale range without a pre-copy".into()))?;
        if s.ranges.remove(&ptr).is_none() {
            return Err(SnapshotError::Malformed(format!("stale range {ptr:#x} was not pre-copied")));
        }
        s.backend.mem_free(ptr).map_err(|e| SnapshotError::Device(e, "dropping a stale pre-copied range"))?;
    }
    Ok(staged)
}
