//! Instantiated graphs (CUgraphExec): a graph's nodes in a topological order, split into steps
//! that run one after the other on the launch stream.
//!
//! A device step is sent to the server once (`graphExecCreate`, under a handle minted here)
//! and replayed by one `graphLaunch` message per launch, which returns at once. Its bulk is the
//! step's host-to-device bytes, read from the program's memory at launch (CUDA reads them when
//! the graph runs; the work before in the stream cannot change host memory, and a host node
//! that could ends the step). A step that copies device to host waits for its reply, which
//! carries those bytes, and writes them into the program's buffers, so no copy can be read
//! before it has landed: the same rule as `cuMemcpyDtoHAsync` into pageable memory.
//!
//! A host node is a step of its own: the shim synchronises the stream and calls the function,
//! as `cuLaunchHostFunc` does, so the work after it is sent only once it has returned. A
//! host-to-device copy whose source a device-to-host copy of the same step writes also starts
//! a new step, so it reads the bytes that copy brought back.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use rgpu_cuda_types::*;

use super::graph::{Body, Copy, KernelNode, MemsetNode, Node, MAX_DEPTH};
use super::graph_mem::GraphMem;
use super::objects;
use crate::client::connection::Sink;
use crate::runtime::{cu_err, Runtime};

/// Operations per device step (one `graphExecCreate` message must fit in a frame).
const MAX_STEP_OPS: usize = 1 << 16;
/// Bytes a step's launch carries each way.
const MAX_STEP_BYTES: usize = 1 << 30;

#[derive(Clone)]
pub enum Op {
    Kernel(KernelNode),
    HtoD { dst: u64, src: usize, size: usize },
    DtoH { dst: usize, src: u64, size: usize },
    DtoD { dst: u64, src: u64, size: usize },
    Memset(MemsetNode),
    EventRecord(u64),
    EventWait(u64),
}

#[derive(Clone, Default)]
pub struct Segment {
    pub ops: Vec<Op>,
    pub htod_len: usize,
    pub dtoh_len: usize,
}

#[derive(Clone)]
pub enum Step {
    Device(Segment),
    Host { f: usize, data: usize },
}

/// The steps `body` runs as, and the one device its work runs on (None: no device work).
/// Errors name the node at fault where there is one (0 otherwise).
pub fn plan(body: &Body) -> Result<(Vec<Step>, Option<CUdevice>), (CuError, u64)> {
    let mut p = Planner { steps: vec![], cur: Segment::default(), device: None };
    p.walk(body, 0)?;
    p.close();
    Ok((p.steps, p.device))
}

struct Planner {
    steps: Vec<Step>,
    cur: Segment,
    device: Option<CUdevice>,
}

impl Planner {
    fn close(&mut self) {
        if !self.cur.ops.is_empty() {
            self.steps.push(Step::Device(std::mem::take(&mut self.cur)));
        }
    }

    fn walk(&mut self, body: &Body, depth: usize) -> Result<(), (CuError, u64)> {
        if depth > MAX_DEPTH {
            return Err((CuError::NOT_SUPPORTED, 0));
        }
        for h in body.order()? {
            let node = &body.nodes[&h].node;
            if let Some(d) = node.device() {
                match self.device {
                    None => self.device = Some(d),
                    // One instantiated graph runs on one device here.
                    Some(x) if x != d => return Err((CuError::NOT_SUPPORTED, h)),
                    Some(_) => {}
                }
            }
            let op = match node {
                Node::Empty | Node::MemAlloc { .. } | Node::MemFree { .. } => continue,
                Node::Child(b) => {
                    self.walk(b, depth + 1)?;
                    continue;
                }
                Node::Host { f, data } => {
                    self.close();
                    self.steps.push(Step::Host { f: *f, data: *data });
                    continue;
                }
                Node::Kernel(k) => Op::Kernel(k.clone()),
                Node::Memcpy { copy, size, rows, .. } => {
                    // A pitched copy runs as its contiguous pieces, in order.
                    for (so, d, n) in rows.runs(*size) {
                        let op = match *copy {
                            Copy::HtoD { dst, src } => Op::HtoD { dst: dst + d as u64, src: src + so, size: n },
                            Copy::DtoH { dst, src } => Op::DtoH { dst: dst + d, src: src + so as u64, size: n },
                            Copy::DtoD { dst, src } => Op::DtoD { dst: dst + d as u64, src: src + so as u64, size: n },
                        };
                        self.push(op).map_err(|e| (e, h))?;
                    }
                    continue;
                }
                Node::Memset { op, .. } => Op::Memset(*op),
                Node::EventRecord { event, .. } => Op::EventRecord(*event),
                Node::EventWait { event, .. } => Op::EventWait(*event),
            };
            self.push(op).map_err(|e| (e, h))?;
        }
        Ok(())
    }

    fn push(&mut self, op: Op) -> CuResult<()> {
        let (htod, dtoh) = match op {
            Op::HtoD { size, .. } => (size, 0),
            Op::DtoH { size, .. } => (0, size),
            _ => (0, 0),
        };
        if htod > MAX_STEP_BYTES || dtoh > MAX_STEP_BYTES {
            return Err(CuError::NOT_SUPPORTED);
        }
        let reads_staged = match op {
            Op::HtoD { src, size, .. } => self.cur.ops.iter().any(|o| match *o {
                Op::DtoH { dst, size: n, .. } => src < dst + n && dst < src + size,
                _ => false,
            }),
            _ => false,
        };
        if reads_staged
            || self.cur.ops.len() >= MAX_STEP_OPS
            || self.cur.htod_len + htod > MAX_STEP_BYTES
            || self.cur.dtoh_len + dtoh > MAX_STEP_BYTES
        {
            self.close();
        }
        self.cur.htod_len += htod;
        self.cur.dtoh_len += dtoh;
        self.cur.ops.push(op);
        Ok(())
    }
}

pub struct Exec {
    pub device: CUdevice,
    /// The context it was instantiated in: destroying or resetting that context destroys it.
    pub ctx: u64,
    pub flags: u64,
    state: Mutex<State>,
    /// The graph memory it holds, and of that what a launch leaves to the program.
    mems: Vec<Arc<GraphMem>>,
    kept: Vec<Arc<GraphMem>>,
}

/// The graph memory `body` allocates and the addresses it frees, child graphs included.
fn memory_of(body: &Body, mems: &mut Vec<Arc<GraphMem>>, freed: &mut Vec<u64>) {
    for e in body.nodes.values() {
        match &e.node {
            Node::MemAlloc { mem } => mems.push(mem.clone()),
            Node::MemFree { ptr, .. } => freed.push(*ptr),
            Node::Child(b) => memory_of(b, mems, freed),
            _ => {}
        }
    }
}

struct State {
    /// The graph as instantiated (node handles as in the graph it came from, so the
    /// cuGraphExec*NodeSetParams calls find their nodes).
    body: Body,
    /// Each step, with the server's handle for a device step.
    steps: Arc<Vec<(Step, u64)>>,
    /// Why the exec can no longer launch: a replacement of its steps failed part-way, so the
    /// server's steps and these may differ (a launch would pair old host buffers with new
    /// operations).
    broken: Option<CuError>,
    /// Nodes of `body` switched off by cuGraphNodeSetEnabled: planned as empty nodes, their
    /// parameters kept for when they are switched on again.
    disabled: BTreeSet<u64>,
}

/// `body` as it runs with `disabled` nodes switched off.
fn with_disabled(body: &Body, disabled: &BTreeSet<u64>) -> Body {
    let mut b = body.clone();
    for h in disabled {
        if let Some(e) = b.nodes.get_mut(h) {
            e.node = Node::Empty;
        }
    }
    b
}

impl Exec {
    /// Instantiates `body` (a copy of the graph's) on the server of its device, or of `dflt`
    /// for a graph with no device work.
    pub fn instantiate(rt: &Runtime, body: Body, flags: u64, ctx: u64, dflt: CUdevice) -> Result<Exec, (CuError, u64)> {
        let (steps, device) = plan(&body)?;
        let device = device.unwrap_or(dflt);
        let (mut mems, mut freed) = (vec![], vec![]);
        memory_of(&body, &mut mems, &mut freed);
        for (i, m) in mems.iter().enumerate() {
            if let Err(e) = m.attach() {
                mems[..i].iter().for_each(|m| m.detach());
                return Err((e, 0));
            }
        }
        let steps = match send_steps(rt, device, steps, &[]) {
            Ok(s) => s,
            Err(e) => {
                mems.iter().for_each(|m| m.detach());
                return Err((e, 0));
            }
        };
        let kept = mems.iter().filter(|m| !freed.contains(&m.ptr)).cloned().collect();
        let state = Mutex::new(State { body, steps: Arc::new(steps), broken: None, disabled: BTreeSet::new() });
        Ok(Exec { device, ctx, flags, state, mems, kept })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A copy of the graph as instantiated, with its nodes' changes.
    pub fn body(&self) -> Body {
        self.state().body.clone()
    }

    /// The graph as a launch runs it, switched-off nodes empty (to capture a launch into
    /// another graph).
    pub fn as_run(&self) -> Body {
        let st = self.state();
        with_disabled(&st.body, &st.disabled)
    }

    /// Replaces the exec's graph by `body`, which has its shape; the server's steps are
    /// replaced in stream order (launches already queued run as they were).
    pub fn rebuild(&self, rt: &Runtime, body: Body) -> Result<(), (CuError, u64)> {
        let mut st = self.state();
        let disabled = st.disabled.clone();
        self.replace(rt, &mut st, body, disabled)
    }

    fn replace(&self, rt: &Runtime, st: &mut State, body: Body, disabled: BTreeSet<u64>) -> Result<(), (CuError, u64)> {
        let (steps, device) = plan(&with_disabled(&body, &disabled))?;
        if device.is_some_and(|d| d != self.device) {
            return Err((CuError::INVALID_VALUE, 0));
        }
        let old: Vec<u64> = st.steps.iter().filter(|(s, _)| matches!(s, Step::Device(_))).map(|(_, h)| *h).collect();
        let steps = match send_steps(rt, self.device, steps, &old) {
            Ok(s) => s,
            Err(e) => {
                st.broken = Some(e);
                return Err((e, 0));
            }
        };
        let used = steps.iter().filter(|(s, _)| matches!(s, Step::Device(_))).count();
        for h in old.iter().skip(used) {
            destroy_step(rt, self.device, *h);
        }
        st.body = body;
        st.disabled = disabled;
        st.steps = Arc::new(steps);
        Ok(())
    }

    /// Replaces node `h` of the instantiated graph by `node` (of the same kind).
    pub fn set_node(&self, rt: &Runtime, h: u64, node: Node) -> CuResult<()> {
        let mut st = self.state();
        let mut body = st.body.clone();
        let e = body.nodes.get_mut(&h).ok_or(CuError::INVALID_VALUE)?;
        if e.node.kind() != node.kind() {
            return Err(CuError::INVALID_VALUE);
        }
        e.node = node;
        let disabled = st.disabled.clone();
        self.replace(rt, &mut st, body, disabled).map_err(|(e, _)| e)
    }

    /// Whether node `h` runs (cuGraphNodeGetEnabled).
    pub fn enabled(&self, h: u64) -> CuResult<bool> {
        let st = self.state();
        switchable(&st.body, h)?;
        Ok(!st.disabled.contains(&h))
    }

    /// Switches node `h` off or on again (cuGraphNodeSetEnabled): a switched-off node runs
    /// as an empty one.
    pub fn set_enabled(&self, rt: &Runtime, h: u64, on: bool) -> CuResult<()> {
        let mut st = self.state();
        switchable(&st.body, h)?;
        let mut disabled = st.disabled.clone();
        let changed = if on { disabled.remove(&h) } else { disabled.insert(h) };
        if !changed {
            return Ok(());
        }
        let body = st.body.clone();
        self.replace(rt, &mut st, body, disabled).map_err(|(e, _)| e)
    }

    /// Runs the exec on `stream` (its server handle; `s` as the program passed it).
    pub fn launch(&self, rt: &Runtime, s: CUstream, stream: u64) -> CuResult<()> {
        let steps = {
            let st = self.state();
            if let Some(e) = st.broken {
                return Err(e);
            }
            st.steps.clone()
        };
        if self.kept.iter().any(|m| m.is_outstanding()) {
            // CUDA's rule: what the last launch allocated must be freed first.
            return Err(CuError::INVALID_VALUE);
        }
        let conn = rt.conn(self.device)?;
        for (step, h) in steps.iter() {
            match step {
                Step::Device(seg) => {
                    let mut bulk = Vec::with_capacity(seg.htod_len);
                    for op in &seg.ops {
                        if let Op::HtoD { src, size, .. } = *op {
                            // SAFETY: CUDA requires a memcpy node's host memory to be valid
                            // whenever the graph runs.
                            bulk.extend_from_slice(unsafe { std::slice::from_raw_parts(src as *const u8, size) });
                        }
                    }
                    let build = |r: rgpu_protocol::data_capnp::request::Builder<'_>| {
                        let mut m = r.init_graph_launch();
                        m.set_exec(*h);
                        m.set_stream(stream);
                    };
                    if seg.dtoh_len == 0 {
                        conn.post(build, &bulk).map_err(cu_err)?;
                        continue;
                    }
                    let mut back = vec![0u8; seg.dtoh_len];
                    conn.call(build, &bulk, Sink::Host(&mut back), |_| Ok(())).map_err(cu_err)?;
                    let mut at = 0;
                    for op in &seg.ops {
                        if let Op::DtoH { dst, size, .. } = *op {
                            // SAFETY: as above, for the destination.
                            unsafe { std::ptr::copy_nonoverlapping(back.as_ptr().add(at), dst as *mut u8, size) };
                            at += size;
                        }
                    }
                }
                Step::Host { f, data } => {
                    // As cuLaunchHostFunc: not run after an error in the work before it.
                    super::stream::synchronize(s)?;
                    // SAFETY: `f` is the CUhostFn the program gave for this node.
                    let f: unsafe extern "C" fn(*mut std::ffi::c_void) = unsafe { std::mem::transmute(*f) };
                    unsafe { f(*data as *mut std::ffi::c_void) };
                }
            }
        }
        self.kept.iter().for_each(|m| m.hand_out());
        Ok(())
    }

    /// Tells the server the exec's steps are gone and lets go of its graph memory.
    pub fn release(&self, rt: &Runtime) {
        self.mems.iter().for_each(|m| m.detach());
        for (s, h) in self.state().steps.iter() {
            if matches!(s, Step::Device(_)) {
                destroy_step(rt, self.device, *h);
            }
        }
    }
}

/// CUDA switches only kernel, memcpy and memset nodes on and off.
fn switchable(body: &Body, h: u64) -> CuResult<()> {
    match body.nodes.get(&h).map(|e| &e.node) {
        Some(Node::Kernel(_) | Node::Memcpy { .. } | Node::Memset { .. }) => Ok(()),
        _ => Err(CuError::INVALID_VALUE),
    }
}

fn destroy_step(rt: &Runtime, device: CUdevice, h: u64) {
    if let Ok(conn) = rt.conn(device) {
        if let Err(e) = conn.post(|r| r.init_graph_exec_destroy().set_handle(h), &[]) {
            tracing::debug!("graph exec destroy: {e}");
        }
    }
}

/// Sends each device step, under the handles in `reuse` first, then new ones; waits for the
/// server's answer so an instantiation error is the call's own.
fn send_steps(rt: &Runtime, device: CUdevice, steps: Vec<Step>, reuse: &[u64]) -> CuResult<Vec<(Step, u64)>> {
    let remote_dev = rt.device(device)?.remote.ordinal;
    let conn = rt.conn(device)?;
    let reuse_all = reuse;
    let mut reuse = reuse.iter().copied();
    let mut out = Vec::with_capacity(steps.len());
    for step in steps {
        let Step::Device(seg) = &step else {
            out.push((step, 0));
            continue;
        };
        let h = reuse.next().unwrap_or_else(|| objects().graph_execs.mint());
        let mut params = Vec::new();
        for op in &seg.ops {
            if let Op::Kernel(k) = op {
                params.extend_from_slice(&k.params);
            }
        }
        conn.call(
            |r| {
                let mut m = r.init_graph_exec_create();
                m.set_handle(h);
                m.set_device(remote_dev);
                let mut ops = m.init_ops(seg.ops.len() as u32);
                for (i, op) in seg.ops.iter().enumerate() {
                    encode(ops.reborrow().get(i as u32), op);
                }
            },
            &params,
            Sink::None,
            |_| Ok(()),
        )
        .map_err(|e| {
            // Steps sent under new handles before the failure are not kept.
            for (s, h) in &out {
                if matches!(s, Step::Device(_)) && !reuse_all.contains(h) {
                    destroy_step(rt, device, *h);
                }
            }
            cu_err(e)
        })?;
        out.push((step, h));
    }
    Ok(out)
}

fn encode(o: rgpu_protocol::data_capnp::graph_op::Builder<'_>, op: &Op) {
    let copy = |mut c: rgpu_protocol::data_capnp::graph_copy::Builder<'_>, dst: u64, src: u64, size: usize| {
        c.set_dst(dst);
        c.set_src(src);
        c.set_size(size as u64);
    };
    let mut o = o;
    match op {
        Op::Kernel(k) => {
            let mut l = o.init_kernel();
            l.set_module(k.function.module);
            l.set_function(k.function.index);
            l.set_grid_x(k.grid[0]);
            l.set_grid_y(k.grid[1]);
            l.set_grid_z(k.grid[2]);
            l.set_block_x(k.block[0]);
            l.set_block_y(k.block[1]);
            l.set_block_z(k.block[2]);
            l.set_shared_mem_bytes(k.shared);
        }
        Op::HtoD { dst, size, .. } => copy(o.init_memcpy_hto_d(), Runtime::to_remote(*dst), 0, *size),
        Op::DtoH { src, size, .. } => copy(o.init_memcpy_dto_h(), 0, Runtime::to_remote(*src), *size),
        Op::DtoD { dst, src, size } => copy(o.init_memcpy_dto_d(), Runtime::to_remote(*dst), Runtime::to_remote(*src), *size),
        Op::Memset(m) => {
            let mut w = o.init_memset();
            w.set_dst(Runtime::to_remote(m.dst));
            w.set_value(m.value);
            w.set_element_size(m.elem);
            w.set_count(m.width as u64);
            w.set_pitch(if m.height > 1 { m.pitch as u64 } else { 0 });
            w.set_rows(m.height as u64);
        }
        Op::EventRecord(e) => o.set_event_record(*e),
        Op::EventWait(e) => o.set_event_wait(*e),
    }
}

/// An exec handle the program passed.
pub fn get(e: CUgraphExec) -> CuResult<(u64, Arc<Exec>)> {
    let h = e as usize as u64;
    Ok((h, objects().graph_execs.get(h).ok_or(CuError::INVALID_HANDLE)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::objects::graph::Rows;

    fn copy(b: &mut Body, h: u64, copy: Copy, size: usize, deps: &[u64]) {
        b.add(h, Node::Memcpy { copy, size, rows: Rows::ONE, device: 0 }, deps).unwrap();
    }

    fn shape(steps: &[Step]) -> Vec<String> {
        steps
            .iter()
            .map(|s| match s {
                Step::Host { data, .. } => format!("host{data}"),
                Step::Device(seg) => format!("dev{}", seg.ops.len()),
            })
            .collect()
    }

    #[test]
    fn host_nodes_split_the_device_work_in_order() {
        let mut b = Body::default();
        copy(&mut b, 1, Copy::DtoD { dst: 0x10, src: 0x20 }, 8, &[]);
        b.add(2, Node::Host { f: 1, data: 7 }, &[1]).unwrap();
        copy(&mut b, 3, Copy::DtoD { dst: 0x10, src: 0x20 }, 8, &[2]);
        copy(&mut b, 4, Copy::DtoD { dst: 0x10, src: 0x20 }, 8, &[3]);
        b.add(5, Node::Empty, &[4]).unwrap();
        let (steps, dev) = plan(&b).unwrap();
        assert_eq!(shape(&steps), ["dev1", "host7", "dev2"]);
        assert_eq!(dev, Some(0));
    }

    #[test]
    fn a_copy_reading_what_an_earlier_copy_brought_back_starts_a_step() {
        let mut b = Body::default();
        copy(&mut b, 1, Copy::DtoH { dst: 0x1000, src: 0x20 }, 64, &[]);
        // Reads [0x1020, 0x1030): inside what node 1 writes.
        copy(&mut b, 2, Copy::HtoD { dst: 0x40, src: 0x1020 }, 16, &[1]);
        // Reads memory no copy of its step writes: stays.
        copy(&mut b, 3, Copy::HtoD { dst: 0x40, src: 0x2000 }, 16, &[2]);
        let (steps, _) = plan(&b).unwrap();
        assert_eq!(shape(&steps), ["dev1", "dev2"]);
        let Step::Device(second) = &steps[1] else { panic!("a device step") };
        assert_eq!((second.htod_len, second.dtoh_len), (32, 0));
    }

    #[test]
    fn child_graphs_are_inlined_and_several_devices_refused() {
        let mut child = Body::default();
        copy(&mut child, 10, Copy::DtoD { dst: 1, src: 2 }, 4, &[]);
        copy(&mut child, 11, Copy::DtoD { dst: 1, src: 2 }, 4, &[10]);
        let mut b = Body::default();
        copy(&mut b, 1, Copy::DtoD { dst: 1, src: 2 }, 4, &[]);
        b.add(2, Node::Child(child), &[1]).unwrap();
        let (steps, _) = plan(&b).unwrap();
        assert_eq!(shape(&steps), ["dev3"]);
        b.add(3, Node::Memcpy { copy: Copy::DtoD { dst: 1, src: 2 }, size: 4, rows: Rows::ONE, device: 1 }, &[2]).unwrap();
        assert_eq!(plan(&b).err(), Some((CuError::NOT_SUPPORTED, 3)));
    }
}
