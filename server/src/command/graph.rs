//! Graph commands: `graphExecCreate`, `graphExecDestroy` and `graphLaunch` (the driver
//! functions that send each are listed in the table in `mod.rs`).
//!
//! The client builds and orders graphs itself; what reaches the server is an instantiated
//! graph's operations, once, and then one small `graphLaunch` per launch, whose bulk is the
//! launch's host-to-device bytes (host memory is read when the graph runs) and whose reply,
//! when the graph copies to the host, carries those bytes. Every operation is checked at
//! instantiation and again at each launch against the session's objects, and runs through the
//! same backend call as the request of its kind ([`crate::backend::graph`]).

use rgpu_protocol::data_capnp::{graph_exec_create, graph_launch, graph_op, handle};
use rgpu_protocol::frame::MAX_BULK_LEN;

use super::launch::LaunchKernel;
use super::memory::Memset;
use super::{Bulk, BulkHandler, DeviceBytes, Fail, Handler};
use crate::backend::graph::{GraphExec, GraphOp};
use crate::state::SessionState;
use rgpu_cuda_types::CuError;

/// Operations per instantiated graph (segment); CUDA graphs of real programs have thousands.
pub const MAX_OPS: u32 = 1 << 20;
/// All kernel parameter buffers of one graph together.
const MAX_PARAMS_TOTAL: u64 = 1 << 30;
/// One kernel's parameter buffer (as `launchKernel`).
const MAX_PARAMS_LEN: u64 = 1 << 20;

/// What an op says on the wire, before it is checked.
#[derive(Debug)]
pub enum WireOp {
    Kernel(LaunchKernel),
    HtoD { dst: u64, size: u64 },
    DtoH { src: u64, size: u64 },
    DtoD { dst: u64, src: u64, size: u64 },
    Memset(Memset),
    EventRecord(u64),
    EventWait(u64),
}

#[derive(Debug)]
pub struct GraphExecCreate {
    pub handle: u64,
    pub device: u32,
    /// `Err` for a list that cannot be read or is too long: refused in `apply`.
    pub ops: Result<Vec<WireOp>, CuError>,
}

impl GraphExecCreate {
    pub fn decode(r: graph_exec_create::Reader<'_>) -> Self {
        GraphExecCreate { handle: r.get_handle(), device: r.get_device(), ops: decode_ops(r) }
    }
}

fn decode_ops(r: graph_exec_create::Reader<'_>) -> Result<Vec<WireOp>, CuError> {
    let bad = |_| CuError::INVALID_VALUE;
    let list = r.get_ops().map_err(bad)?;
    if list.len() > MAX_OPS {
        return Err(CuError::INVALID_VALUE);
    }
    // Not the announced length: a list of empty elements costs the sender
    // nothing (48 bytes announced 2^20 ops), each decoded op costs us ~100.
    let mut ops = Vec::with_capacity((list.len() as usize).min(1024));
    for op in list.iter() {
        use graph_op::Which as W;
        // An op the shim sends always has its operand struct (a null one is
        // an empty list element, which holds no op at all).
        let set = op.has_kernel() || op.has_memcpy_hto_d() || op.has_memcpy_dto_h() || op.has_memcpy_dto_d() || op.has_memset();
        let needs_struct = !matches!(op.which(), Ok(W::EventRecord(_) | W::EventWait(_)));
        if needs_struct && !set {
            return Err(CuError::INVALID_VALUE);
        }
        ops.push(match op.which().map_err(|_| CuError::INVALID_VALUE)? {
            W::Kernel(k) => WireOp::Kernel(LaunchKernel::decode(k.map_err(bad)?)),
            W::MemcpyHtoD(c) => {
                let c = c.map_err(bad)?;
                WireOp::HtoD { dst: c.get_dst(), size: c.get_size() }
            }
            W::MemcpyDtoH(c) => {
                let c = c.map_err(bad)?;
                WireOp::DtoH { src: c.get_src(), size: c.get_size() }
            }
            W::MemcpyDtoD(c) => {
                let c = c.map_err(bad)?;
                WireOp::DtoD { dst: c.get_dst(), src: c.get_src(), size: c.get_size() }
            }
            W::Memset(m) => WireOp::Memset(Memset::decode(m.map_err(bad)?)),
            // Handles are never 0. A list element too short to hold one (a
            // 2-byte element is the union's tag alone) reads as 0: refused,
            // or a few bytes would announce an op each.
            W::EventRecord(0) | W::EventWait(0) => return Err(CuError::INVALID_VALUE),
            W::EventRecord(e) => WireOp::EventRecord(e),
            W::EventWait(e) => WireOp::EventWait(e),
        });
    }
    Ok(ops)
}

impl BulkHandler for GraphExecCreate {
    type Reply = ();
    fn apply(self, s: &mut SessionState, bulk: &mut Bulk<'_>) -> Result<(), Fail> {
        if self.handle == 0 {
            return Err(CuError::INVALID_VALUE.into());
        }
        let checked = check(s, self.device, self.ops?)?;
        if bulk.remaining() != checked.params_len {
            return Err(CuError::INVALID_VALUE.into());
        }
        let params = bulk.read_to_vec()?;
        install(s, self.handle, checked, params, None)
    }
}

/// A graph's operations, checked against the session as at instantiation.
pub struct Checked {
    device: u32,
    ops: Vec<GraphOp>,
    /// Bytes of kernel parameters the ops take, in their order.
    pub params_len: u64,
    htod_len: u64,
    dtoh_len: u64,
}

/// Checks `wire` (an instantiation's operations, on `device`) against the
/// session's objects. A snapshot's graph is checked by this same function
/// when it is rebuilt.
pub fn check(s: &SessionState, device: u32, wire: Vec<WireOp>) -> Result<Checked, Fail> {
    s.check_device(device)?;
    if wire.len() > MAX_OPS as usize {
        return Err(CuError::INVALID_VALUE.into());
    }
    let mut ops = Vec::with_capacity(wire.len());
    let (mut params_len, mut htod_len, mut dtoh_len) = (0u64, 0u64, 0u64);
    let add = |total: &mut u64, n: u64, max: u64| -> Result<(), CuError> {
        *total = total.checked_add(n).filter(|&t| t <= max).ok_or(CuError::INVALID_VALUE)?;
        Ok(())
    };
    for op in wire {
        let op = match op {
            WireOp::Kernel(k) => {
                let m = s.module(k.module)?;
                if m.device != device {
                    return Err(CuError::INVALID_HANDLE.into());
                }
                let want = *m.param_lens.get(k.function as usize).ok_or(CuError::INVALID_HANDLE)?;
                if want > MAX_PARAMS_LEN || k.dims.grid.contains(&0) || k.dims.block.contains(&0) {
                    return Err(CuError::INVALID_VALUE.into());
                }
                let start = params_len as usize;
                add(&mut params_len, want, MAX_PARAMS_TOTAL)?;
                GraphOp::Kernel { module: k.module, function: k.function, dims: k.dims, params: start..params_len as usize }
            }
            WireOp::HtoD { dst, size } => {
                check_on(s, dst, size, device)?;
                add(&mut htod_len, size, MAX_BULK_LEN)?;
                GraphOp::HtoD { dst, size }
            }
            WireOp::DtoH { src, size } => {
                check_on(s, src, size, device)?;
                add(&mut dtoh_len, size, MAX_BULK_LEN)?;
                GraphOp::DtoH { src, size }
            }
            WireOp::DtoD { dst, src, size } => {
                check_on(s, dst, size, device)?;
                s.check_range(src, size)?;
                GraphOp::DtoD { dst, src, size }
            }
            WireOp::Memset(m) => {
                let span = m.op.span().ok_or(CuError::INVALID_VALUE)?;
                check_on(s, m.op.dst, span, device)?;
                GraphOp::Memset(m.op)
            }
            WireOp::EventRecord(e) | WireOp::EventWait(e) if s.event(e)?.device != device => {
                return Err(CuError::INVALID_HANDLE.into());
            }
            WireOp::EventRecord(e) => GraphOp::EventRecord(e),
            WireOp::EventWait(e) => GraphOp::EventWait(e),
        };
        ops.push(op);
    }
    Ok(Checked { device, ops, params_len, htod_len, dtoh_len })
}

/// Installs a checked graph as exec `handle` with its kernels' `params`
/// (exactly `params_len` bytes), its staging memory new, or at `staging_at`
/// (a rebuilt graph's, where kept replies may read it).
pub fn install(s: &mut SessionState, handle: u64, c: Checked, params: Vec<u8>, staging_at: Option<u64>) -> Result<(), Fail> {
    if params.len() as u64 != c.params_len {
        return Err(CuError::INVALID_VALUE.into());
    }
    let Checked { device, ops, htod_len, dtoh_len, .. } = c;
    let staging = match (dtoh_len, staging_at) {
        (0, None) => None,
        (0, Some(_)) => return Err(CuError::INVALID_VALUE.into()),
        (n, None) => Some(s.backend.mem_alloc(device, n)?),
        (n, Some(at)) => {
            s.backend.mem_alloc_at(device, at, n)?;
            Some(at)
        }
    };
    let exec = GraphExec { device, ops, params, htod_len, dtoh_len, staging };
    // Sending an exec again under its handle replaces it (cuGraphExecUpdate and the node
    // parameter setters): work already queued with the old one has run, in order.
    if let Some(old) = s.graph_execs.insert(handle, exec) {
        release(s, old);
    }
    Ok(())
}

/// An exec's operations as its instantiation sent them (the inverse of [`check`]).
pub fn wire_ops(exec: &GraphExec) -> Vec<WireOp> {
    exec.ops
        .iter()
        .map(|op| match op {
            GraphOp::Kernel { module, function, dims, .. } => {
                WireOp::Kernel(LaunchKernel { module: *module, function: *function, dims: *dims, stream: 0 })
            }
            GraphOp::HtoD { dst, size } => WireOp::HtoD { dst: *dst, size: *size },
            GraphOp::DtoH { src, size } => WireOp::DtoH { src: *src, size: *size },
            GraphOp::DtoD { dst, src, size } => WireOp::DtoD { dst: *dst, src: *src, size: *size },
            GraphOp::Memset(m) => WireOp::Memset(Memset { op: *m, stream: 0 }),
            GraphOp::EventRecord(e) => WireOp::EventRecord(*e),
            GraphOp::EventWait(e) => WireOp::EventWait(*e),
        })
        .collect()
}

/// `[ptr, ptr + len)` lies in one of the session's allocations on `device`.
fn check_on(s: &SessionState, ptr: u64, len: u64, device: u32) -> Result<(), CuError> {
    if len == 0 {
        return Ok(());
    }
    if s.check_range(ptr, len)? != device {
        return Err(CuError::INVALID_VALUE);
    }
    Ok(())
}

fn release(s: &mut SessionState, exec: GraphExec) {
    if let Some(p) = exec.staging {
        if let Err(e) = s.backend.mem_free(p) {
            tracing::warn!("freeing a graph's staging memory failed: {e}");
        }
    }
}

#[derive(Debug)]
pub struct GraphExecDestroy {
    pub handle: u64,
}

impl GraphExecDestroy {
    pub fn decode(r: handle::Reader<'_>) -> Self {
        GraphExecDestroy { handle: r.get_handle() }
    }
}

impl Handler for GraphExecDestroy {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        let exec = s.graph_execs.remove(&self.handle).ok_or(CuError::INVALID_HANDLE)?;
        release(s, exec);
        Ok(())
    }
}

#[derive(Debug)]
pub struct GraphLaunch {
    pub exec: u64,
    pub stream: u64,
}

impl GraphLaunch {
    pub fn decode(r: graph_launch::Reader<'_>) -> Self {
        GraphLaunch { exec: r.get_exec(), stream: r.get_stream() }
    }
}

impl BulkHandler for GraphLaunch {
    /// The device-to-host bytes, when the graph has any.
    type Reply = Option<DeviceBytes>;
    fn apply(self, s: &mut SessionState, bulk: &mut Bulk<'_>) -> Result<Option<DeviceBytes>, Fail> {
        // Taken out for the replay (which needs the session too) and put back whatever happens.
        let exec = s.graph_execs.remove(&self.exec).ok_or(CuError::INVALID_HANDLE)?;
        let r = replay(s, &exec, self.stream, bulk);
        let reply = match (&r, exec.staging) {
            (Ok(stream), Some(src)) => Some(DeviceBytes { src, len: exec.dtoh_len, stream: *stream }),
            _ => None,
        };
        s.graph_execs.insert(self.exec, exec);
        r.map(|_| reply)
    }
}

/// Runs the exec's operations in order on `stream`; the first failure stops it (the rest of
/// the bulk is skipped by the caller) and is the launch's error.
fn replay(s: &mut SessionState, exec: &GraphExec, stream: u64, bulk: &mut Bulk<'_>) -> Result<crate::backend::StreamRef, Fail> {
    let device = exec.device;
    if stream != 0 && s.streams.get(&stream).is_some_and(|st| st.device != device) {
        return Err(CuError::INVALID_HANDLE.into());
    }
    let stream = s.stream(stream, device)?;
    if bulk.remaining() != exec.htod_len {
        return Err(CuError::INVALID_VALUE.into());
    }
    let mut staged = 0u64;
    for op in &exec.ops {
        match op {
            GraphOp::Kernel { module, function, dims, params } => {
                let (token, on) = s.check_launch(*module, *function, dims, params.len() as u64)?;
                if on != device {
                    return Err(CuError::INVALID_HANDLE.into());
                }
                s.backend.launch_kernel(token, *function, dims, stream, &exec.params[params.clone()])?;
            }
            GraphOp::HtoD { dst, size } => {
                if *size > 0 {
                    check_on(s, *dst, *size, device)?;
                    s.backend.memcpy_htod(stream, *dst, *size, &mut |buf| bulk.read_exact(buf))?;
                }
            }
            GraphOp::DtoH { src, size } => {
                if *size > 0 {
                    check_on(s, *src, *size, device)?;
                    let staging = exec.staging.ok_or(CuError::UNKNOWN)?;
                    s.backend.memcpy_dtod(stream, staging + staged, *src, *size)?;
                    staged += size;
                }
            }
            GraphOp::DtoD { dst, src, size } => {
                if *size > 0 {
                    check_on(s, *dst, *size, device)?;
                    s.check_range(*src, *size)?;
                    s.backend.memcpy_dtod(stream, *dst, *src, *size)?;
                }
            }
            GraphOp::Memset(m) => {
                let span = m.span().ok_or(CuError::INVALID_VALUE)?;
                if span > 0 {
                    check_on(s, m.dst, span, device)?;
                    s.backend.memset(stream, m)?;
                }
            }
            GraphOp::EventRecord(e) => {
                let ev = s.event(*e)?;
                s.backend.event_record(ev.token, stream)?;
            }
            GraphOp::EventWait(e) => {
                let ev = s.event(*e)?;
                s.backend.stream_wait_event(stream, ev.token, 0)?;
            }
        }
    }
    Ok(stream)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::io;
    use std::time::Duration;

    use super::*;
    use crate::backend::sim::{SimBackend, SimConfig};
    use crate::backend::{Backend, MemsetOp};
    use crate::command::memory::MemAlloc;
    use rgpu_transport::Transport;

    /// Bulk bytes waiting on an in-memory connection.
    pub(crate) struct Wire(pub Vec<u8>, pub usize);

    impl Transport for Wire {
        fn send(&mut self, _bufs: &[&[u8]]) -> io::Result<()> {
            Ok(())
        }
        fn recv_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
            let rest = &self.0[self.1..];
            if rest.len() < buf.len() {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            buf.copy_from_slice(&rest[..buf.len()]);
            self.1 += buf.len();
            Ok(())
        }
        fn peer(&self) -> &str {
            "test"
        }
        fn shutdown(&self) {}
    }

    /// Found in the `frame` fuzz target's corpus (its peak memory): a 48-byte request whose ops are
    /// a list of 2^20 empty elements (a `List(Void)` read as structs) was
    /// decoded into 2^20 kernel launches, about 100 MiB, before `apply`
    /// refused the first.
    #[test]
    fn a_list_of_empty_ops_is_refused_not_decoded() {
        use capnp::message::ReaderOptions;
        use rgpu_protocol::data_capnp::request;
        let which = crate::command::Command::NAMES.iter().position(|&n| n == "graphExecCreate").unwrap() as u64;
        let words: [u64; 6] = [
            5 << 32,                      // segment table: one segment of 5 words
            0x0001_0001 << 32,            // root: Request, 1 data word, 1 pointer
            which,                        // its union discriminant
            0x0001_0000 << 32,            // GraphExecCreate: no data, 1 pointer
            ((1u64 << 20) << 35) | 1,     // ops: a list of 2^20 void elements
            0,
        ];
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let mut opts = ReaderOptions::new();
        opts.traversal_limit_in_words(Some(4 << 20)).nesting_limit(16);
        let msg = capnp::serialize::read_message_from_flat_slice(&mut &bytes[..], opts).unwrap();
        let req = msg.get_root::<request::Reader<'_>>().unwrap();
        match crate::command::Command::decode(req).unwrap() {
            crate::command::Command::GraphExecCreate(g) => {
                assert!(matches!(g.ops, Err(CuError::INVALID_VALUE)), "decoded {:?} ops", g.ops.map(|o| o.len()))
            }
            other => panic!("decoded as {}", other.name()),
        }
    }

    fn session() -> SessionState {
        let cfg = SimConfig { devices: 1, memory: 16 << 20, compute_capability: (9, 0), seed: None, kernel_time_limit: Duration::from_secs(30), compiled_tier: true };
        let sim = SimBackend::new(&cfg).expect("sim backend");
        SessionState::new(sim.open_session(None).expect("session"), 1)
    }

    fn alloc(s: &mut SessionState, size: u64) -> u64 {
        MemAlloc { device: 0, size }.apply(s).expect("alloc").ptr
    }

    fn create(s: &mut SessionState, handle: u64, ops: Vec<WireOp>) -> Result<(), Fail> {
        let mut scratch = vec![];
        let mut w = Wire(vec![], 0);
        GraphExecCreate { handle, device: 0, ops: Ok(ops) }.apply(s, &mut Bulk::new(&mut w, 0, &mut scratch))
    }

    fn launch(s: &mut SessionState, exec: u64, bulk: &[u8]) -> Result<Option<DeviceBytes>, Fail> {
        let mut scratch = vec![];
        let mut w = Wire(bulk.to_vec(), 0);
        GraphLaunch { exec, stream: 0 }.apply(s, &mut Bulk::new(&mut w, bulk.len() as u64, &mut scratch))
    }

    fn read(s: &mut SessionState, src: u64, len: u64) -> Vec<u8> {
        let mut out = vec![];
        let stream = s.stream(0, 0).unwrap();
        s.backend
            .memcpy_dtoh(stream, src, len, &mut |c| {
                out.extend_from_slice(c);
                Ok(())
            })
            .unwrap();
        out
    }

    #[test]
    fn a_launch_replays_the_ops_in_order_with_its_own_bytes() {
        let mut s = session();
        let (a, b) = (alloc(&mut s, 64), alloc(&mut s, 64));
        let memset = |dst, value| {
            WireOp::Memset(Memset { op: MemsetOp { dst, value, element_size: 1, count: 64, pitch: 0, rows: 1 }, stream: 0 })
        };
        // b = 0x11; a[0..16] = bulk; b[0..16] = a[0..16]; back = b; a = 0x22
        let ops = vec![
            memset(b, 0x11),
            WireOp::HtoD { dst: a, size: 16 },
            WireOp::DtoD { dst: b, src: a, size: 16 },
            WireOp::DtoH { src: b, size: 64 },
            memset(a, 0x22),
        ];
        create(&mut s, 7, ops).unwrap();
        for k in 1..=2u8 {
            let bytes = [k; 16];
            let back = launch(&mut s, 7, &bytes).unwrap().expect("the reply carries the device-to-host bytes");
            assert_eq!(back.len, 64);
            let got = read(&mut s, back.src, back.len);
            let mut want = vec![k; 16];
            want.extend_from_slice(&[0x11; 48]);
            assert_eq!(got, want, "launch {k}: the staged bytes are b as the copy saw it");
            assert_eq!(read(&mut s, a, 64), vec![0x22; 64], "the op after the copy ran");
        }
    }

    #[test]
    fn launches_are_checked_against_the_exec_and_the_session() {
        let mut s = session();
        let a = alloc(&mut s, 64);
        create(&mut s, 1, vec![WireOp::HtoD { dst: a, size: 16 }]).unwrap();
        assert!(matches!(launch(&mut s, 1, &[0; 15]), Err(Fail::Cuda(CuError::INVALID_VALUE))), "bulk shorter than the copies");
        assert!(matches!(launch(&mut s, 2, &[]), Err(Fail::Cuda(CuError::INVALID_HANDLE))), "no such exec");
        // Out of the allocation, or memory that is not the session's, is refused at creation.
        assert!(create(&mut s, 3, vec![WireOp::HtoD { dst: a + 60, size: 16 }]).is_err());
        assert!(create(&mut s, 3, vec![WireOp::DtoH { src: 0x1000, size: 1 }]).is_err());
        assert!(create(&mut s, 3, vec![WireOp::EventRecord(99)]).is_err(), "an unknown event");
        // Memory freed after instantiation fails the launch rather than being touched.
        crate::command::memory::MemFree { ptr: a }.apply(&mut s).unwrap();
        assert!(matches!(launch(&mut s, 1, &[0; 16]), Err(Fail::Cuda(CuError::INVALID_VALUE))));
        GraphExecDestroy { handle: 1 }.apply(&mut s).unwrap();
        assert!(GraphExecDestroy { handle: 1 }.apply(&mut s).is_err(), "destroyed twice");
    }
}
