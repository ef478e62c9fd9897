//! Device memory and events shared between sessions: CUDA IPC
//! (`cuIpcGetMemHandle` or `cuIpcGetEventHandle` in one process,
//! `cuIpcOpenMemHandle` or `cuIpcOpenEventHandle` in another process of the
//! same client host, each with its own session on this server).
//!
//! [`Exports`] is the server's table of exported allocations; each session's
//! [`IpcScope`] is its part in it: what it exported and what it opened. Three
//! rules keep tenants apart and memory safe:
//!
//! - an export is opened only by a session of the same lease (on a server with
//!   no broker, where anyone may open a session, by any session), and only by
//!   one that presents the export's 128-bit secret: export ids are sequential,
//!   secrets are not. An unknown id, a wrong secret and another lease's export
//!   all answer the same `CUDA_ERROR_INVALID_VALUE`, so none can be told apart;
//! - the backend's [`SharedMemory`] keeps the device memory alive while any
//!   session holds it: an exporter that frees its allocation, or ends, while
//!   another process still has it open never lets the allocator hand those
//!   bytes to someone else under that process (CUDA calls this case undefined;
//!   here the importer keeps working memory until it closes it);
//! - the exported bytes stay charged to the lease that allocated them until
//!   the last holder lets go.
//!
//! An exported event is held the same way ([`SharedEvent`]): the backend's
//! record of it, which each session holding it records into and reads.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rgpu_cuda_types::{CuError, CuResult};

/// A backend's hold on exported device memory; the last clone dropped frees it.
pub type SharedMemory = Arc<dyn Any + Send + Sync>;

/// A backend's shared record of an interprocess event.
pub type SharedEvent = Arc<dyn Any + Send + Sync>;

/// What an export holds: memory, or an event (whose `ptr` is the exporting
/// session's event handle and `size` its flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Memory,
    Event,
}

/// What an export's handle names.
pub struct Export {
    kind: Kind,
    /// The exporting session's lease; None on a server without leases.
    lease: Option<u64>,
    /// The exporting session ([`IpcScope::session`]).
    session: u64,
    secret: [u8; 16],
    pub device: u32,
    /// The allocation's start and the size the client asked for.
    pub ptr: u64,
    pub size: u64,
    pub memory: SharedMemory,
}

/// Every live export of this server, by id.
#[derive(Default)]
pub struct Exports {
    table: Mutex<HashMap<u64, Export>>,
    next_id: AtomicU64,
    next_session: AtomicU64,
}

impl Exports {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Export>> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How many exports are live (for tests and metrics).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One session's exports and opened handles.
pub struct IpcScope {
    exports: Arc<Exports>,
    lease: Option<u64>,
    session: u64,
    /// This session's exports by allocation start: (id, secret).
    exported: HashMap<u64, (u64, [u8; 16])>,
    /// Allocations this session opened, by start: how many opens are not closed yet
    /// (CUDA counts a context's opens of one handle and unmaps at the last close).
    opened: HashMap<u64, u32>,
    /// This session's exported events by event handle: (id, secret).
    exported_events: HashMap<u64, (u64, [u8; 16])>,
    /// Event handles this session opened from others' exports.
    opened_events: std::collections::HashSet<u64>,
}

impl IpcScope {
    /// A session's part in `exports`, for a session of `lease` (None: no lease).
    pub fn new(exports: Arc<Exports>, lease: Option<u64>) -> Self {
        let session = exports.next_session.fetch_add(1, Ordering::Relaxed);
        IpcScope {
            exports,
            lease,
            session,
            exported: HashMap::new(),
            opened: HashMap::new(),
            exported_events: HashMap::new(),
            opened_events: Default::default(),
        }
    }

    /// Whether the session takes part in IPC at all (a snapshot cannot carry it).
    pub fn is_active(&self) -> bool {
        !self.exported.is_empty() || !self.opened.is_empty() || !self.exported_events.is_empty() || !self.opened_events.is_empty()
    }

    /// The handle of this session's allocation at `ptr` if it was exported already
    /// (CUDA gives the same handle each time it is asked).
    pub fn exported(&self, ptr: u64) -> Option<(u64, [u8; 16])> {
        self.exported.get(&ptr).copied()
    }

    /// Publishes the session's allocation `[ptr, ptr + size)` of `device`, held by `memory`.
    pub fn export(&mut self, device: u32, ptr: u64, size: u64, memory: SharedMemory) -> CuResult<(u64, [u8; 16])> {
        let mut secret = [0u8; 16];
        getrandom::fill(&mut secret).map_err(|_| CuError::OPERATING_SYSTEM)?;
        let id = self.exports.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let e = Export { kind: Kind::Memory, lease: self.lease, session: self.session, secret, device, ptr, size, memory };
        self.exports.lock().insert(id, e);
        self.exported.insert(ptr, (id, secret));
        Ok((id, secret))
    }

    /// Publishes the session's event `handle` of `device` (created with
    /// `flags`), whose record `shared` holds; the same handle if it was
    /// exported already.
    pub fn export_event(&mut self, device: u32, handle: u64, flags: u32, shared: SharedEvent) -> CuResult<(u64, [u8; 16])> {
        if let Some(&h) = self.exported_events.get(&handle) {
            return Ok(h);
        }
        let mut secret = [0u8; 16];
        getrandom::fill(&mut secret).map_err(|_| CuError::OPERATING_SYSTEM)?;
        let id = self.exports.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let e = Export {
            kind: Kind::Event,
            lease: self.lease,
            session: self.session,
            secret,
            device,
            ptr: handle,
            size: flags as u64,
            memory: shared,
        };
        self.exports.lock().insert(id, e);
        self.exported_events.insert(handle, (id, secret));
        Ok((id, secret))
    }

    /// The event export `id`, as [`Self::find`] finds memory: `(device, flags, shared)`.
    pub fn find_event(&self, id: u64, secret: &[u8]) -> CuResult<(u32, u32, SharedEvent)> {
        let (device, _, flags, shared) = self.check(id, secret, Kind::Event)?;
        Ok((device, flags as u32, shared))
    }

    /// Counts an event handle opened from an export.
    pub fn opened_event(&mut self, handle: u64) {
        self.opened_events.insert(handle);
    }

    /// The session destroyed event `handle`: its export, if any, is
    /// withdrawn (those who opened it keep theirs).
    pub fn event_gone(&mut self, handle: u64) {
        self.opened_events.remove(&handle);
        if let Some((id, _)) = self.exported_events.remove(&handle) {
            self.exports.lock().remove(&id);
        }
    }

    /// Takes the export of the allocation at `ptr` off the table (it is being freed): no
    /// one can open it from now on; those who did keep it.
    pub fn withdraw(&mut self, ptr: u64) {
        if let Some((id, _)) = self.exported.remove(&ptr) {
            self.exports.lock().remove(&id);
        }
    }

    /// The export `id` if `secret` is its secret and this session may open it:
    /// `(device, ptr, size, memory)`. Opening one's own export is refused as
    /// CUDA refuses it in the exporting process.
    pub fn find(&self, id: u64, secret: &[u8]) -> CuResult<(u32, u64, u64, SharedMemory)> {
        self.check(id, secret, Kind::Memory)
    }

    fn check(&self, id: u64, secret: &[u8], kind: Kind) -> CuResult<(u32, u64, u64, SharedMemory)> {
        let table = self.exports.lock();
        let e = table.get(&id).ok_or(CuError::INVALID_VALUE)?;
        if !same_secret(&e.secret, secret) || e.lease != self.lease || e.kind != kind {
            return Err(CuError::INVALID_VALUE);
        }
        if e.session == self.session {
            return Err(CuError::INVALID_CONTEXT);
        }
        Ok((e.device, e.ptr, e.size, e.memory.clone()))
    }

    /// How many opens of the allocation at `ptr` are not closed yet.
    pub fn opens(&self, ptr: u64) -> u32 {
        self.opened.get(&ptr).copied().unwrap_or(0)
    }

    /// Counts one more open of `ptr`.
    pub fn opened(&mut self, ptr: u64) -> CuResult {
        let n = self.opened.entry(ptr).or_insert(0);
        *n = n.checked_add(1).ok_or(CuError::INVALID_VALUE)?;
        Ok(())
    }

    /// Counts one close of `ptr`; true when it was the last (unmap it now).
    pub fn closed(&mut self, ptr: u64) -> CuResult<bool> {
        let n = self.opened.get_mut(&ptr).ok_or(CuError::INVALID_VALUE)?;
        *n -= 1;
        if *n == 0 {
            self.opened.remove(&ptr);
            return Ok(true);
        }
        Ok(false)
    }
}

impl Default for IpcScope {
    /// A session alone in a table of its own (tests, and sessions made outside a server).
    fn default() -> Self {
        IpcScope::new(Arc::new(Exports::default()), None)
    }
}

impl Drop for IpcScope {
    /// A session that ends withdraws its exports (what others opened stays theirs).
    fn drop(&mut self) {
        let ids: Vec<u64> = self.exported.values().chain(self.exported_events.values()).map(|&(id, _)| id).collect();
        let mut table = self.exports.lock();
        for id in ids {
            table.remove(&id);
        }
    }
}

/// Compares secrets in time that does not depend on where they differ.
fn same_secret(want: &[u8; 16], got: &[u8]) -> bool {
    got.len() == want.len() && want.iter().zip(got).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory() -> SharedMemory {
        Arc::new(7u32)
    }

    #[test]
    fn only_the_same_lease_with_the_secret_opens_an_export() {
        let table = Arc::new(Exports::default());
        let mut a = IpcScope::new(table.clone(), Some(1));
        let b = IpcScope::new(table.clone(), Some(1));
        let other = IpcScope::new(table.clone(), Some(2));
        let anon = IpcScope::new(table.clone(), None);
        let (id, secret) = a.export(0, 0x1000, 64, memory()).unwrap();
        assert_eq!(a.exported(0x1000), Some((id, secret)));
        let (dev, ptr, size, _) = b.find(id, &secret).unwrap();
        assert_eq!((dev, ptr, size), (0, 0x1000, 64));
        let mut wrong = secret;
        wrong[15] ^= 1;
        assert_eq!(b.find(id, &wrong).err(), Some(CuError::INVALID_VALUE), "a wrong secret");
        assert_eq!(b.find(id, &secret[..8]).err(), Some(CuError::INVALID_VALUE), "a short secret");
        assert_eq!(b.find(id + 1, &secret).err(), Some(CuError::INVALID_VALUE), "an unknown id");
        assert_eq!(other.find(id, &secret).err(), Some(CuError::INVALID_VALUE), "another lease");
        assert_eq!(anon.find(id, &secret).err(), Some(CuError::INVALID_VALUE), "no lease");
        assert_eq!(a.find(id, &secret).err(), Some(CuError::INVALID_CONTEXT), "the exporter itself");
        a.withdraw(0x1000);
        assert_eq!(b.find(id, &secret).err(), Some(CuError::INVALID_VALUE), "withdrawn");
        assert!(table.is_empty());
    }

    #[test]
    fn an_ended_session_withdraws_its_exports_and_each_export_is_new() {
        let table = Arc::new(Exports::default());
        let mut a = IpcScope::new(table.clone(), None);
        let (id1, s1) = a.export(0, 0x1000, 64, memory()).unwrap();
        a.withdraw(0x1000);
        let (id2, s2) = a.export(0, 0x1000, 64, memory()).unwrap();
        assert_ne!(id1, id2, "memory allocated again at the same address gets a new handle");
        assert_ne!(s1, s2);
        drop(a);
        assert!(table.is_empty());
    }

    #[test]
    fn opens_are_counted_until_the_last_close() {
        let mut b = IpcScope::default();
        assert_eq!(b.closed(0x1000), Err(CuError::INVALID_VALUE), "never opened");
        b.opened(0x1000).unwrap();
        b.opened(0x1000).unwrap();
        assert!(b.is_active());
        assert_eq!(b.closed(0x1000), Ok(false));
        assert_eq!(b.closed(0x1000), Ok(true));
        assert!(!b.is_active());
        assert_eq!(b.closed(0x1000), Err(CuError::INVALID_VALUE));
    }
}
