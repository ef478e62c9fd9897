//! Instantiated graphs in a snapshot (format version 2): each is written
//! as its instantiation request was (its operations and its kernels'
//! parameters), with its staging memory's address and contents, and
//! rebuilt by instantiating it again through the same checks a client's
//! request passes ([`crate::command::graph::check`]), its staging placed
//! where it was, since a kept reply of a launch may read it after a resume.
//!
//! Record: meta `handle u64, device u32, ops u32, ops_bytes u64,
//! params u64, staging (u8 0/1, address u64, length u64)`; bulk: the ops
//! (`ops_bytes`), the parameters, then the staging contents.

use std::io::{Read, Write};

use super::format::{self, Dec, Enc, Head, Tag};
use super::SnapshotError;
use crate::backend::graph::GraphExec;
use crate::backend::{LaunchDims, MemsetOp};
use crate::command::graph::{self as commands, WireOp, MAX_OPS};
use crate::command::launch::LaunchKernel;
use crate::command::memory::Memset;
use crate::command::Fail;
use crate::state::SessionState;

/// The longest op encoding (a kernel's).
const MAX_OP_BYTES: u64 = 1 + 8 + 4 + 12 + 12 + 4 + 1;
/// The most kernel parameter bytes one graph may carry (as at instantiation).
const MAX_PARAMS: u64 = 1 << 30;

/// Writes exec `handle`'s record.
pub fn write(state: &mut SessionState, handle: u64, w: &mut dyn Write) -> Result<(), SnapshotError> {
    let exec = state.graph_execs.get(&handle).ok_or(SnapshotError::Malformed(format!("no graph {handle:#x}")))?;
    let ops = encode_ops(exec);
    let mut e = Enc::default();
    e.u64(handle).u32(exec.device).u32(exec.ops.len() as u32).u64(ops.0.len() as u64).u64(exec.params.len() as u64);
    let staged = match exec.staging {
        Some(at) => {
            e.u8(1).u64(at).u64(exec.dtoh_len);
            exec.dtoh_len
        }
        None => {
            e.u8(0);
            0
        }
    };
    format::write_record(w, Tag::Graph, &e, ops.0.len() as u64 + exec.params.len() as u64 + staged)?;
    w.write_all(&ops.0)?;
    w.write_all(&exec.params)?;
    let (device, staging) = (exec.device, exec.staging);
    if let Some(at) = staging {
        super::capture::copy_out(state, device, at, staged, w)?;
    }
    Ok(())
}

fn encode_ops(exec: &GraphExec) -> Enc {
    let mut e = Enc::default();
    for op in commands::wire_ops(exec) {
        match op {
            WireOp::Kernel(k) => {
                e.u8(1).u64(k.module).u32(k.function);
                for v in k.dims.grid.iter().chain(&k.dims.block) {
                    e.u32(*v);
                }
                e.u32(k.dims.shared_mem_bytes).u8(k.dims.cooperative as u8);
            }
            WireOp::HtoD { dst, size } => {
                e.u8(2).u64(dst).u64(size);
            }
            WireOp::DtoH { src, size } => {
                e.u8(3).u64(src).u64(size);
            }
            WireOp::DtoD { dst, src, size } => {
                e.u8(4).u64(dst).u64(src).u64(size);
            }
            WireOp::Memset(m) => {
                let o = m.op;
                e.u8(5).u64(o.dst).u32(o.value).u8(o.element_size).u64(o.count).u64(o.pitch).u64(o.rows);
            }
            WireOp::EventRecord(ev) => {
                e.u8(6).u64(ev);
            }
            WireOp::EventWait(ev) => {
                e.u8(7).u64(ev);
            }
        }
    }
    e
}

fn decode_ops(b: &[u8], n: u32) -> Result<Vec<WireOp>, SnapshotError> {
    let mut d = Dec::new(b, "graph");
    let mut ops = Vec::with_capacity(n as usize);
    for _ in 0..n {
        ops.push(match d.u8()? {
            1 => {
                let (module, function) = (d.u64()?, d.u32()?);
                let grid = [d.u32()?, d.u32()?, d.u32()?];
                let block = [d.u32()?, d.u32()?, d.u32()?];
                let shared_mem_bytes = d.u32()?;
                let cooperative = match d.u8()? {
                    0 => false,
                    1 => true,
                    b => return Err(SnapshotError::Malformed(format!("graph kernel cooperative flag {b}"))),
                };
                let dims = LaunchDims { grid, block, shared_mem_bytes, cooperative };
                WireOp::Kernel(LaunchKernel { module, function, dims, stream: 0 })
            }
            2 => WireOp::HtoD { dst: d.u64()?, size: d.u64()? },
            3 => WireOp::DtoH { src: d.u64()?, size: d.u64()? },
            4 => WireOp::DtoD { dst: d.u64()?, src: d.u64()?, size: d.u64()? },
            5 => {
                let (dst, value, element_size) = (d.u64()?, d.u32()?, d.u8()?);
                let (count, pitch, rows) = (d.u64()?, d.u64()?, d.u64()?);
                WireOp::Memset(Memset { op: MemsetOp { dst, value, element_size, count, pitch, rows }, stream: 0 })
            }
            6 => WireOp::EventRecord(d.u64()?),
            7 => WireOp::EventWait(d.u64()?),
            k => return Err(SnapshotError::Malformed(format!("graph op kind {k}"))),
        });
    }
    d.finish()?;
    Ok(ops)
}

fn device_error(f: Fail, doing: &'static str) -> SnapshotError {
    match f {
        Fail::Cuda(e) => SnapshotError::Device(e, doing),
        Fail::Io(e) => SnapshotError::Io(e),
    }
}

/// Rebuilds one graph from its record `h` (its bulk next in `r`).
pub fn read(state: &mut SessionState, h: &Head, r: &mut dyn Read) -> Result<(), SnapshotError> {
    let mut d = Dec::new(&h.meta, "graph");
    let (handle, device, n, ops_bytes, params_len) = (d.u64()?, d.u32()?, d.u32()?, d.u64()?, d.u64()?);
    let staging = match d.u8()? {
        0 => None,
        1 => Some((d.u64()?, d.u64()?)),
        b => return Err(SnapshotError::Malformed(format!("graph staging tag {b}"))),
    };
    d.finish()?;
    if handle == 0 || state.graph_execs.contains_key(&handle) {
        return Err(SnapshotError::Malformed(format!("graph handle {handle:#x} is 0 or repeated")));
    }
    if n > MAX_OPS {
        return Err(SnapshotError::TooLarge { what: "graph operations", len: n as u64, max: MAX_OPS as u64 });
    }
    if params_len > MAX_PARAMS {
        return Err(SnapshotError::TooLarge { what: "graph kernel parameters", len: params_len, max: MAX_PARAMS });
    }
    let staged = staging.map_or(0, |(_, len)| len);
    if staged > rgpu_protocol::frame::MAX_BULK_LEN {
        return Err(SnapshotError::TooLarge { what: "graph staging", len: staged, max: rgpu_protocol::frame::MAX_BULK_LEN });
    }
    let bulk = ops_bytes.checked_add(params_len).and_then(|b| b.checked_add(staged));
    if bulk != Some(h.bulk_len) {
        return Err(SnapshotError::Malformed(format!("a graph record's parts do not add up to its {} bytes", h.bulk_len)));
    }
    let ops = format::read_bulk(r, ops_bytes, n as u64 * MAX_OP_BYTES, "graph operations")?;
    let ops = decode_ops(&ops, n)?;
    // Every handle, address and size checked as at instantiation.
    let checked = commands::check(state, device, ops).map_err(|f| device_error(f, "checking a graph"))?;
    if checked.params_len != params_len {
        return Err(SnapshotError::Malformed(format!("a graph's kernels take {} parameter bytes, it carries {params_len}", checked.params_len)));
    }
    let params = format::read_bulk(r, params_len, MAX_PARAMS, "graph kernel parameters")?;
    commands::install(state, handle, checked, params, staging.map(|(at, _)| at))
        .map_err(|f| device_error(f, "placing a graph's staging memory"))?;
    let exec = state.graph_execs.get(&handle).ok_or(SnapshotError::Malformed("a graph not installed".into()))?;
    if exec.staging.map(|at| (at, exec.dtoh_len)) != staging {
        // Its copies to the host need other staging than the record says.
        return Err(SnapshotError::Malformed(format!("graph {handle:#x}'s staging does not match its copies")));
    }
    if let Some((at, len)) = staging {
        let filled = state.backend.memcpy_htod(crate::backend::StreamRef::Default { device }, at, len, &mut |buf| r.read_exact(buf));
        match filled {
            Ok(()) => {}
            Err(crate::backend::TransferError::Io(e)) => return Err(SnapshotError::read(e)),
            Err(crate::backend::TransferError::Device(e)) => return Err(SnapshotError::Device(e, "writing a graph's staging memory")),
        }
    }
    Ok(())
}

/// Whether `[src, src + len)` lies in a graph's staging memory (a kept
/// reply of a launch reads there).
pub fn in_staging(state: &SessionState, src: u64, len: u64) -> bool {
    state.graph_execs.values().any(|g| {
        g.staging.is_some_and(|at| src >= at && src.checked_add(len).is_some_and(|end| end <= at + g.dtoh_len))
    })
}
