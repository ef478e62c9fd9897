//! IPC commands: `ipcExport`, `ipcOpen` and `ipcClose` (cuIpcGetMemHandle,
//! cuIpcOpenMemHandle, cuIpcCloseMemHandle), `ipcEventExport` and
//! `ipcEventOpen` (cuIpcGetEventHandle, cuIpcOpenEventHandle). The rules of
//! who may open what are [`crate::ipc`]'s; here each request is checked
//! against the session's own objects first.

use rgpu_protocol::data_capnp::{handle, ipc_event_open, ipc_open, mem_free, reply};
use tracing::warn;

use super::{EncodeReply, Fail, Handler};
use crate::state::{Alloc, Event, Owner, SessionState};
use rgpu_cuda_types::CuError;

/// Exports the client allocation holding `ptr` (any address inside it, as the
/// driver takes it: the handle names the whole allocation).
#[derive(Debug)]
pub struct IpcExport {
    pub ptr: u64,
}

impl IpcExport {
    pub fn decode(r: mem_free::Reader<'_>) -> Self {
        IpcExport { ptr: r.get_ptr() }
    }
}

impl Handler for IpcExport {
    type Reply = IpcHandleReply;
    fn apply(self, s: &mut SessionState) -> Result<IpcHandleReply, Fail> {
        let (&start, a) = s.allocs.range(..=self.ptr).next_back().ok_or(CuError::INVALID_VALUE)?;
        // Memory from cuMemAlloc only: not a module's global, not memory this
        // session opened from another (CUDA exports neither).
        if self.ptr - start >= a.size.max(1) || a.owner != Owner::Client {
            return Err(CuError::INVALID_VALUE.into());
        }
        let (device, size) = (a.device, a.size);
        if let Some((id, secret)) = s.ipc.exported(start) {
            return Ok(IpcHandleReply { id, secret });
        }
        let memory = s.backend.ipc_export(start).inspect_err(|e| {
            if *e == CuError::NOT_SUPPORTED {
                warn_once_unsupported();
            }
        })?;
        let (id, secret) = s.ipc.export(device, start, size, memory)?;
        Ok(IpcHandleReply { id, secret })
    }
}

fn warn_once_unsupported() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| warn!("cuIpcGetMemHandle refused: this backend cannot share a session's memory with another session"));
}

#[derive(Debug)]
pub struct IpcHandleReply {
    pub id: u64,
    pub secret: [u8; 16],
}

impl EncodeReply for IpcHandleReply {
    fn encode(&self, r: reply::Builder<'_>) {
        let mut h = r.init_ipc_handle();
        h.set_id(self.id);
        h.set_secret(&self.secret);
    }
}

/// Opens another session's export in this one.
#[derive(Debug)]
pub struct IpcOpen {
    pub id: u64,
    pub secret: Vec<u8>,
}

impl IpcOpen {
    pub fn decode(r: ipc_open::Reader<'_>) -> Self {
        // A missing or malformed secret decodes as empty, which matches no export.
        let secret = r.get_secret().map(|s| s.to_vec()).unwrap_or_default();
        IpcOpen { id: r.get_id(), secret }
    }
}

impl Handler for IpcOpen {
    type Reply = IpcOpenedReply;
    fn apply(self, s: &mut SessionState) -> Result<IpcOpenedReply, Fail> {
        let (device, ptr, size, memory) = s.ipc.find(self.id, &self.secret)?;
        s.check_device(device)?;
        if s.ipc.opens(ptr) > 0 {
            // Opened before in this session: the same pointer, one more open to close.
            s.ipc.opened(ptr)?;
            return Ok(IpcOpenedReply { ptr, size });
        }
        if s.allocs.contains_key(&ptr) {
            return Err(CuError::INVALID_VALUE.into());
        }
        let at = s.backend.ipc_import(&memory)?;
        if let Err(e) = s.ipc.opened(at) {
            let _ = s.backend.ipc_close(at);
            return Err(e.into());
        }
        s.allocs.insert(at, Alloc { device, size, owner: Owner::Imported });
        Ok(IpcOpenedReply { ptr: at, size })
    }
}

#[derive(Debug)]
pub struct IpcOpenedReply {
    pub ptr: u64,
    pub size: u64,
}

impl EncodeReply for IpcOpenedReply {
    fn encode(&self, r: reply::Builder<'_>) {
        let mut m = r.init_ipc_opened();
        m.set_ptr(self.ptr);
        m.set_size(self.size);
    }
}

/// Closes one open of the allocation at `ptr`; the last close unmaps it.
#[derive(Debug)]
pub struct IpcClose {
    pub ptr: u64,
}

impl IpcClose {
    pub fn decode(r: mem_free::Reader<'_>) -> Self {
        IpcClose { ptr: r.get_ptr() }
    }
}

impl Handler for IpcClose {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        if !s.ipc.closed(self.ptr)? {
            return Ok(());
        }
        s.allocs.remove(&self.ptr);
        s.backend.ipc_close(self.ptr)?;
        Ok(())
    }
}

/// `CU_EVENT_INTERPROCESS`, and `CU_EVENT_DISABLE_TIMING`, which CUDA
/// requires beside it.
const INTERPROCESS: u32 = 0x4;
const DISABLE_TIMING: u32 = 0x2;

/// Exports the session's event `handle`, created interprocess.
#[derive(Debug)]
pub struct IpcEventExport {
    pub handle: u64,
}

impl IpcEventExport {
    pub fn decode(r: handle::Reader<'_>) -> Self {
        IpcEventExport { handle: r.get_handle() }
    }
}

impl Handler for IpcEventExport {
    type Reply = IpcHandleReply;
    fn apply(self, s: &mut SessionState) -> Result<IpcHandleReply, Fail> {
        let ev = s.event(self.handle)?;
        // CUDA exports only events made for it (cuEventCreate refuses
        // INTERPROCESS without DISABLE_TIMING).
        if ev.flags & INTERPROCESS == 0 {
            return Err(CuError::INVALID_VALUE.into());
        }
        let shared = s.backend.ipc_export_event(ev.token).inspect_err(|e| {
            if *e == CuError::NOT_SUPPORTED {
                static ONCE: std::sync::Once = std::sync::Once::new();
                ONCE.call_once(|| warn!("cuIpcGetEventHandle refused: this backend cannot share an event with another session"));
            }
        })?;
        let (id, secret) = s.ipc.export_event(ev.device, self.handle, ev.flags, shared)?;
        Ok(IpcHandleReply { id, secret })
    }
}

/// Opens another session's exported event as this session's event `handle`.
#[derive(Debug)]
pub struct IpcEventOpen {
    pub handle: u64,
    pub id: u64,
    pub secret: Vec<u8>,
}

impl IpcEventOpen {
    pub fn decode(r: ipc_event_open::Reader<'_>) -> Self {
        let secret = r.get_secret().map(|s| s.to_vec()).unwrap_or_default();
        IpcEventOpen { handle: r.get_handle(), id: r.get_id(), secret }
    }
}

impl Handler for IpcEventOpen {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        if self.handle == 0 || s.events.contains_key(&self.handle) {
            return Err(CuError::INVALID_VALUE.into());
        }
        let (device, _, shared) = s.ipc.find_event(self.id, &self.secret)?;
        s.check_device(device)?;
        let token = s.backend.ipc_import_event(device, &shared)?;
        s.events.insert(self.handle, Event { token, device, flags: INTERPROCESS | DISABLE_TIMING });
        s.ipc.opened_event(self.handle);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::backend::sim::{SimBackend, SimConfig};
    use crate::backend::{Backend, MemoryBudget, StreamRef};
    use crate::command::memory::{MemAlloc, MemFree};
    use crate::ipc::Exports;

    const MIB: u64 = 1 << 20;

    fn sim() -> SimBackend {
        SimBackend::new(&SimConfig {
            devices: 1,
            memory: 16 * MIB,
            compute_capability: (9, 0),
            seed: None,
            kernel_time_limit: Duration::from_secs(30),
            compiled_tier: true,
        })
        .expect("sim backend")
    }

    fn session(sim: &SimBackend, exports: &Arc<Exports>, lease: Option<u64>, budget: Option<&Arc<MemoryBudget>>) -> SessionState {
        SessionState::new(sim.open_session(budget.cloned()).unwrap(), 1).with_ipc(exports.clone(), lease)
    }

    fn cuda<T: std::fmt::Debug>(r: Result<T, Fail>) -> CuError {
        match r {
            Err(Fail::Cuda(e)) => e,
            other => panic!("expected a CUDA error, got {other:?}"),
        }
    }

    fn alloc(s: &mut SessionState, size: u64) -> u64 {
        MemAlloc { device: 0, size }.apply(s).unwrap().ptr
    }

    fn write(s: &mut SessionState, ptr: u64, bytes: &[u8]) {
        s.check_range(ptr, bytes.len() as u64).unwrap();
        let mut at = 0;
        s.backend
            .memcpy_htod(StreamRef::Default { device: 0 }, ptr, bytes.len() as u64, &mut |buf| {
                buf.copy_from_slice(&bytes[at..at + buf.len()]);
                at += buf.len();
                Ok(())
            })
            .unwrap();
    }

    fn read(s: &mut SessionState, ptr: u64, len: u64) -> Vec<u8> {
        s.check_range(ptr, len).unwrap();
        let mut out = Vec::new();
        s.backend
            .memcpy_dtoh(StreamRef::Default { device: 0 }, ptr, len, &mut |b| {
                out.extend_from_slice(b);
                Ok(())
            })
            .unwrap();
        out
    }

    fn open(s: &mut SessionState, h: &IpcHandleReply) -> Result<IpcOpenedReply, Fail> {
        IpcOpen { id: h.id, secret: h.secret.to_vec() }.apply(s)
    }

    #[test]
    fn a_session_of_the_same_lease_opens_the_allocation_and_shares_its_bytes() {
        let (sim, exports) = (sim(), Arc::new(Exports::default()));
        let budget = Arc::new(MemoryBudget::new(8 * MIB));
        let mut a = session(&sim, &exports, Some(1), Some(&budget));
        let mut b = session(&sim, &exports, Some(1), Some(&budget));
        let mut other = session(&sim, &exports, Some(2), None);
        let p = alloc(&mut a, 4096);
        write(&mut a, p, &[0xab; 4096]);
        let h = IpcExport { ptr: p + 100 }.apply(&mut a).unwrap();
        let again = IpcExport { ptr: p }.apply(&mut a).unwrap();
        assert_eq!((h.id, h.secret), (again.id, again.secret), "one handle per allocation, from any address in it");

        let o = open(&mut b, &h).unwrap();
        assert_eq!((o.ptr, o.size), (p, 4096), "the whole allocation");
        assert_eq!(read(&mut b, p, 4096), vec![0xab; 4096]);
        write(&mut b, p + 1000, &[0x11; 8]);
        assert_eq!(read(&mut a, p + 1000, 9), [0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0xab], "the exporter sees the opener's writes");
        assert_eq!(b.check_range(p, 4097), Err(CuError::INVALID_VALUE), "no further than the allocation");
        assert_eq!(cuda(MemFree { ptr: p }.apply(&mut b)), CuError::INVALID_VALUE, "opened memory is closed, not freed");
        assert_eq!(cuda(IpcExport { ptr: p }.apply(&mut b)), CuError::INVALID_VALUE, "opened memory is not exported again");
        assert_eq!(budget.used(), 4096, "charged once, to the lease that allocated it");

        assert_eq!(cuda(open(&mut other, &h)), CuError::INVALID_VALUE, "another lease's session");
        assert_eq!(other.check_range(p, 1), Err(CuError::INVALID_VALUE));
        assert_eq!(cuda(open(&mut a, &h)), CuError::INVALID_CONTEXT, "the exporting session itself");
        let forged = IpcOpen { id: h.id, secret: vec![0; 16] };
        assert_eq!(cuda(forged.apply(&mut b)), CuError::INVALID_VALUE, "a guessed secret");
        assert_eq!(cuda(IpcClose { ptr: p }.apply(&mut other)), CuError::INVALID_VALUE, "closing what it never opened");
    }

    #[test]
    fn freed_or_ended_exporters_leave_the_memory_to_those_who_opened_it() {
        let (sim, exports) = (sim(), Arc::new(Exports::default()));
        let budget = Arc::new(MemoryBudget::new(8 * MIB));
        let mut a = session(&sim, &exports, Some(1), Some(&budget));
        let mut b = session(&sim, &exports, Some(1), Some(&budget));
        let mut late = session(&sim, &exports, Some(1), Some(&budget));
        let free0 = sim.devices()[0].total_mem;
        let p = alloc(&mut a, MIB);
        write(&mut a, p, &vec![7; MIB as usize]);
        let h = IpcExport { ptr: p }.apply(&mut a).unwrap();
        open(&mut b, &h).unwrap();
        assert_eq!(open(&mut b, &h).unwrap().ptr, p, "opened twice: the same pointer");

        MemFree { ptr: p }.apply(&mut a).unwrap();
        assert_eq!(cuda(open(&mut late, &h)), CuError::INVALID_VALUE, "a freed allocation's handle opens nothing more");
        let q = alloc(&mut a, MIB);
        assert_ne!(q, p, "the bytes b holds are not handed out again");
        write(&mut a, q, &vec![9; MIB as usize]);
        assert_eq!(read(&mut b, p, MIB), vec![7; MIB as usize], "b's memory is intact");
        assert_eq!(budget.used(), 2 * MIB, "still charged to the lease while b holds it");

        IpcClose { ptr: p }.apply(&mut b).unwrap();
        assert_eq!(read(&mut b, p, 16), vec![7; 16], "one open is left");
        drop(a);
        assert_eq!(read(&mut b, p, 16), vec![7; 16], "the exporter's end does not take it either");
        IpcClose { ptr: p }.apply(&mut b).unwrap();
        assert_eq!(b.check_range(p, 1), Err(CuError::INVALID_VALUE), "the last close unmaps it");
        assert_eq!(cuda(IpcClose { ptr: p }.apply(&mut b)), CuError::INVALID_VALUE);
        assert_eq!(budget.used(), 0, "every byte is given back");
        let mut probe = session(&sim, &exports, None, None);
        assert_eq!(probe.backend.mem_get_info(0).unwrap().0, free0, "and to the device");
        assert!(exports.is_empty());
    }

    #[test]
    fn a_session_that_ends_with_memory_open_lets_it_go() {
        let (sim, exports) = (sim(), Arc::new(Exports::default()));
        let total = sim.devices()[0].total_mem;
        let mut a = session(&sim, &exports, None, None);
        let mut b = session(&sim, &exports, None, None);
        let p = alloc(&mut a, MIB);
        let h = IpcExport { ptr: p }.apply(&mut a).unwrap();
        open(&mut b, &h).unwrap();
        assert!(b.ipc.is_active() && !b.holds_nothing());
        drop(b);
        MemFree { ptr: p }.apply(&mut a).unwrap();
        assert_eq!(a.backend.mem_get_info(0).unwrap().0, total);
    }

    /// Events: only interprocess ones are exported; the same lease's other
    /// session opens one under its own handle and both see each other's
    /// records; kinds, leases and the exporter itself are told apart as
    /// for memory; a destroyed export opens nothing more.
    #[test]
    fn an_interprocess_event_is_shared_by_the_sessions_of_one_lease() {
        use crate::command::event::{EventCreate, EventDestroy, EventQuery, EventRecord, EventSynchronize};
        let (sim, exports) = (sim(), Arc::new(Exports::default()));
        let mut a = session(&sim, &exports, Some(1), None);
        let mut b = session(&sim, &exports, Some(1), None);
        let mut other = session(&sim, &exports, Some(2), None);
        EventCreate { handle: 0x10, device: 0, flags: DISABLE_TIMING }.apply(&mut a).unwrap();
        assert_eq!(cuda(IpcEventExport { handle: 0x10 }.apply(&mut a)), CuError::INVALID_VALUE, "not an interprocess event");
        assert_eq!(cuda(IpcEventExport { handle: 0x99 }.apply(&mut a)), CuError::INVALID_HANDLE, "no such event");
        EventCreate { handle: 0x11, device: 0, flags: INTERPROCESS | DISABLE_TIMING }.apply(&mut a).unwrap();
        let h = IpcEventExport { handle: 0x11 }.apply(&mut a).unwrap();
        let again = IpcEventExport { handle: 0x11 }.apply(&mut a).unwrap();
        assert_eq!((h.id, h.secret), (again.id, again.secret), "one handle per event");
        assert!(a.ipc.is_active(), "a session with an exported event takes part in IPC (no snapshot)");

        let opener = |handle, h: &IpcHandleReply| IpcEventOpen { handle, id: h.id, secret: h.secret.to_vec() };
        assert_eq!(cuda(opener(0x21, &h).apply(&mut other)), CuError::INVALID_VALUE, "another lease");
        assert_eq!(cuda(opener(0x21, &h).apply(&mut a)), CuError::INVALID_CONTEXT, "the exporter itself");
        let forged = IpcEventOpen { handle: 0x21, id: h.id, secret: vec![0; 16] };
        assert_eq!(cuda(forged.apply(&mut b)), CuError::INVALID_VALUE, "a guessed secret");
        assert_eq!(cuda(open(&mut b, &h)), CuError::INVALID_VALUE, "an event's handle opens no memory");
        let p = alloc(&mut a, 4096);
        let m = IpcExport { ptr: p }.apply(&mut a).unwrap();
        assert_eq!(cuda(opener(0x21, &m).apply(&mut b)), CuError::INVALID_VALUE, "a memory handle opens no event");
        assert_eq!(cuda(opener(0, &h).apply(&mut b)), CuError::INVALID_VALUE, "handle 0");
        opener(0x21, &h).apply(&mut b).unwrap();
        assert_eq!(cuda(opener(0x21, &h).apply(&mut b)), CuError::INVALID_VALUE, "a handle in use");

        // A record in either session is the event's last record in both.
        EventRecord { event: 0x21, stream: 0 }.apply(&mut b).unwrap();
        EventSynchronize { handle: 0x11 }.apply(&mut a).unwrap();
        EventQuery { handle: 0x11 }.apply(&mut a).unwrap();
        EventRecord { event: 0x11, stream: 0 }.apply(&mut a).unwrap();
        EventSynchronize { handle: 0x21 }.apply(&mut b).unwrap();
        EventQuery { handle: 0x21 }.apply(&mut b).unwrap();

        EventDestroy { handle: 0x11 }.apply(&mut a).unwrap();
        let mut c = session(&sim, &exports, Some(1), None);
        assert_eq!(cuda(opener(0x31, &h).apply(&mut c)), CuError::INVALID_VALUE, "a destroyed event's export is withdrawn");
        EventRecord { event: 0x21, stream: 0 }.apply(&mut b).unwrap();
        EventSynchronize { handle: 0x21 }.apply(&mut b).expect("the opener's event outlives the exporter's");
        EventDestroy { handle: 0x21 }.apply(&mut b).unwrap();
        assert!(!b.ipc.is_active());
    }
}
