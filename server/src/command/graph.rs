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
    let mut ops = Vec::with_capacity(list.len() as usize);
    for op in list.iter() {
        use graph_op::Which as W;
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
        s.check_device(self.device)?;
        let wire = self.ops?;
        let device = self.device;
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
        if bulk.remaining() != params_len {
            return Err(CuError::INVALID_VALUE.into());
        }
        let params = bulk.read_to_vec()?;
        let staging = if dtoh_len > 0 { Some(s.backend.mem_alloc(device, dtoh_len)?) } else { None };
        let exec = GraphExec { device, ops, params, htod_len, dtoh_len, staging };
        // Sending an exec again under its handle replaces it (cuGraphExecUpdate and the node
        // parameter setters): work already queued with the old one has run, in order.
        if let Some(old) = s.graph_execs.insert(self.handle, exec) {
            release(s, old);
        }
        Ok(())
    }
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
                let m = s.module(*module)?;
                if m.device != device {
                    return Err(CuError::INVALID_HANDLE.into());
                }
                let token = m.token;
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
