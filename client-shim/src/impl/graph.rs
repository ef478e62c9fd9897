//! CUDA graphs (cuGraph*): built and ordered in the shim (`objects::graph`), instantiated as
//! an operation list the server keeps, launched with one message per step
//! (`objects::graph_exec`).

use std::ffi::{c_char, c_void};
use std::sync::Arc;

use crate::cuda::types::*;
use crate::objects::capture;
use crate::objects::graph::{self as graphs, node_list, Body, Copy, KernelNode, MemsetNode, Node};
use crate::r#impl::memory::Copy3;
use crate::objects::graph_exec::{self as execs, Exec};
use crate::objects::kernel_args::{check_dims, pack};
use crate::objects::library::resolve_function;
use crate::objects::module::check_launchable;
use crate::objects::{context, event, objects, stream, user_object};
use crate::runtime::{self, Runtime};

/// Only default edges (full completion) are offered: others change when a node may start.
unsafe fn default_edges(e: *const CUgraphEdgeData, n: usize) -> CuResult<()> {
    if e.is_null() || n == 0 {
        return Ok(());
    }
    if std::slice::from_raw_parts(e, n).iter().any(|d| *d != CUgraphEdgeData::default()) {
        tracing::warn!("graph edges other than default ones are not supported by rgpu");
        return Err(CuError::NOT_SUPPORTED);
    }
    Ok(())
}

/// Writes `items` into the program's array `out` of capacity `*n` (null: only the count),
/// nulls past the end, and the count into `*n`, as the cuGraphGet* calls do.
unsafe fn answer<T: std::marker::Copy>(items: &[T], out: *mut T, n: *mut usize, null: T) -> CuResult<()> {
    let n = n.as_mut().ok_or(CuError::INVALID_VALUE)?;
    if !out.is_null() {
        let cap = *n;
        for i in 0..cap {
            *out.add(i) = items.get(i).copied().unwrap_or(null);
        }
        *n = items.len().min(cap);
    } else {
        *n = items.len();
    }
    Ok(())
}

fn node_handle(h: u64) -> CUgraphNode {
    h as usize as CUgraphNode
}

/// Adds `node` to graph `g` after `deps`, writing the new node's handle.
unsafe fn add(ph: &mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, n: usize, node: CuResult<Node>) -> CuResult<()> {
    let (gh, graph) = graphs::get(g)?;
    let deps = node_list(deps, n)?;
    let h = graphs::add(gh, &graph, node?, &deps)?;
    *ph = node_handle(h);
    Ok(())
}

pub(crate) unsafe fn create(ph: &mut CUgraph, flags: u32) -> CuResult<()> {
    runtime::get()?;
    if flags != 0 {
        return Err(CuError::INVALID_VALUE);
    }
    *ph = graphs::create(Body::default()) as usize as CUgraph;
    Ok(())
}

pub(crate) unsafe fn destroy(g: CUgraph) -> CuResult<()> {
    graphs::destroy(g as usize as u64)
}

pub(crate) unsafe fn clone(ph: &mut CUgraph, g: CUgraph) -> CuResult<()> {
    let (_, graph) = graphs::get(g)?;
    let (body, pairs) = graph.body().clone_with(graphs::mint_node);
    *ph = graphs::create_clone(body, pairs) as usize as CUgraph;
    Ok(())
}

pub(crate) unsafe fn node_find_in_clone(ph: &mut CUgraphNode, original: CUgraphNode, cloned: CUgraph) -> CuResult<()> {
    let (_, clone) = graphs::get(cloned)?;
    let h = clone.copy_of(original as usize as u64).ok_or(CuError::INVALID_VALUE)?;
    *ph = node_handle(h);
    Ok(())
}

// ---- nodes of each kind ----------------------------------------------------------------------

/// A kernel node from the program's parameters; the arguments are packed (copied) now.
unsafe fn kernel_node(
    func: CUfunction,
    kern: CUkernel,
    grid: [u32; 3],
    block: [u32; 3],
    shared: u32,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CuResult<Node> {
    let rt = runtime::get()?;
    let f = if func.is_null() { kern as CUfunction } else { func };
    let function = resolve_function(f)?;
    check_dims(rt, &function, grid, block, shared)?;
    check_launchable(&function)?;
    let mut buf = vec![0u8; function.param_bytes()];
    pack(&function, params, extra, &mut buf)?;
    Ok(Node::Kernel(KernelNode { func: f as usize as u64, function, grid, block, shared, params: buf }))
}

unsafe fn kernel_node_v2(p: *const CUDA_KERNEL_NODE_PARAMS) -> CuResult<Node> {
    let p = p.as_ref().ok_or(CuError::INVALID_VALUE)?;
    let (grid, block) = ([p.gridDimX, p.gridDimY, p.gridDimZ], [p.blockDimX, p.blockDimY, p.blockDimZ]);
    kernel_node(p.func, p.kern, grid, block, p.sharedMemBytes, p.kernelParams, p.extra)
}

unsafe fn kernel_node_v1(p: *const CUDA_KERNEL_NODE_PARAMS_v1) -> CuResult<Node> {
    let p = p.as_ref().ok_or(CuError::INVALID_VALUE)?;
    let (grid, block) = ([p.gridDimX, p.gridDimY, p.gridDimZ], [p.blockDimX, p.blockDimY, p.blockDimZ]);
    kernel_node(p.func, std::ptr::null_mut(), grid, block, p.sharedMemBytes, p.kernelParams, p.extra)
}

/// A memcpy node: 1-D, 2-D or 3-D between linear memory, checked as the pitched copies are
/// (`impl::memory`) before it joins the graph.
unsafe fn memcpy_node(p: *const CUDA_MEMCPY3D) -> CuResult<Node> {
    let p = p.as_ref().ok_or(CuError::INVALID_VALUE)?;
    // CUDA makes no empty memcpy nodes.
    if p.WidthInBytes == 0 || p.Height == 0 || p.Depth == 0 {
        return Err(CuError::INVALID_VALUE);
    }
    Copy3::from_3d(p)?.ok_or(CuError::INVALID_VALUE)?.node()
}

unsafe fn memset_node(p: *const CUDA_MEMSET_NODE_PARAMS) -> CuResult<Node> {
    let p = p.as_ref().ok_or(CuError::INVALID_VALUE)?;
    let elem = match p.elementSize {
        1 | 2 | 4 => p.elementSize as u8,
        _ => return Err(CuError::INVALID_VALUE),
    };
    if p.width == 0 || p.height == 0 || !p.dst.is_multiple_of(elem as u64) {
        return Err(CuError::INVALID_VALUE);
    }
    let row = p.width.checked_mul(elem as usize).ok_or(CuError::INVALID_VALUE)?;
    let span = if p.height == 1 {
        row
    } else if p.pitch < row {
        return Err(CuError::INVALID_VALUE);
    } else {
        p.pitch.checked_mul(p.height - 1).and_then(|x| x.checked_add(row)).ok_or(CuError::INVALID_VALUE)?
    };
    let device = objects().memory.check_range(p.dst, span as u64)?;
    let op = MemsetNode { dst: p.dst, value: p.value, elem, width: p.width, pitch: p.pitch, height: p.height };
    Ok(Node::Memset { op, device })
}

unsafe fn host_node(p: *const CUDA_HOST_NODE_PARAMS) -> CuResult<Node> {
    let p = p.as_ref().ok_or(CuError::INVALID_VALUE)?;
    let f = p.fn_.ok_or(CuError::INVALID_VALUE)?;
    Ok(Node::Host { f: f as usize, data: p.userData as usize })
}

fn event_node(e: CUevent, wait: bool) -> CuResult<Node> {
    let (event, ev) = event::get(e)?;
    let device = ev.device;
    Ok(if wait { Node::EventWait { event, device } } else { Node::EventRecord { event, device } })
}

pub(crate) unsafe fn add_kernel_node(ph: &mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, n: usize, p: *const CUDA_KERNEL_NODE_PARAMS_v1) -> CuResult<()> {
    add(ph, g, deps, n, kernel_node_v1(p))
}

pub(crate) unsafe fn add_kernel_node_v2(ph: &mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, n: usize, p: *const CUDA_KERNEL_NODE_PARAMS) -> CuResult<()> {
    add(ph, g, deps, n, kernel_node_v2(p))
}

pub(crate) unsafe fn add_memcpy_node(ph: &mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, n: usize, p: *const CUDA_MEMCPY3D, _ctx: CUcontext) -> CuResult<()> {
    add(ph, g, deps, n, memcpy_node(p))
}

pub(crate) unsafe fn add_memset_node(ph: &mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, n: usize, p: *const CUDA_MEMSET_NODE_PARAMS, _ctx: CUcontext) -> CuResult<()> {
    add(ph, g, deps, n, memset_node(p))
}

pub(crate) unsafe fn add_host_node(ph: &mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, n: usize, p: *const CUDA_HOST_NODE_PARAMS) -> CuResult<()> {
    add(ph, g, deps, n, host_node(p))
}

pub(crate) unsafe fn add_event_record_node(ph: &mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, n: usize, e: CUevent) -> CuResult<()> {
    add(ph, g, deps, n, event_node(e, false))
}

pub(crate) unsafe fn add_event_wait_node(ph: &mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, n: usize, e: CUevent) -> CuResult<()> {
    add(ph, g, deps, n, event_node(e, true))
}

pub(crate) unsafe fn add_empty_node(ph: &mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, n: usize) -> CuResult<()> {
    add(ph, g, deps, n, Ok(Node::Empty))
}

pub(crate) unsafe fn add_child_graph_node(ph: &mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, n: usize, child: CUgraph) -> CuResult<()> {
    add(ph, g, deps, n, child_node(g, child))
}

/// A child graph node of `parent`: CUDA copies the child graph into the node.
fn child_node(parent: CUgraph, child: CUgraph) -> CuResult<Node> {
    let (ch, c) = graphs::get(child)?;
    if ch == parent as usize as u64 {
        return Err(CuError::INVALID_VALUE);
    }
    let (body, _) = c.body().clone_with(graphs::mint_node);
    Ok(Node::Child(body))
}

// ---- queries ---------------------------------------------------------------------------------

pub(crate) unsafe fn get_nodes(g: CUgraph, nodes: *mut CUgraphNode, n: *mut usize) -> CuResult<()> {
    let (_, graph) = graphs::get(g)?;
    let all: Vec<CUgraphNode> = graph.body().nodes.keys().map(|&h| node_handle(h)).collect();
    answer(&all, nodes, n, std::ptr::null_mut())
}

pub(crate) unsafe fn get_root_nodes(g: CUgraph, nodes: *mut CUgraphNode, n: *mut usize) -> CuResult<()> {
    let (_, graph) = graphs::get(g)?;
    let roots: Vec<CUgraphNode> = graph.body().roots().into_iter().map(node_handle).collect();
    answer(&roots, nodes, n, std::ptr::null_mut())
}

pub(crate) unsafe fn get_edges(g: CUgraph, from: *mut CUgraphNode, to: *mut CUgraphNode, n: *mut usize) -> CuResult<()> {
    get_edges_v2(g, from, to, std::ptr::null_mut(), n)
}

pub(crate) unsafe fn get_edges_v2(g: CUgraph, from: *mut CUgraphNode, to: *mut CUgraphNode, data: *mut CUgraphEdgeData, n: *mut usize) -> CuResult<()> {
    let (_, graph) = graphs::get(g)?;
    if from.is_null() != to.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    let edges = graph.body().edges();
    let cap = n.as_ref().copied().ok_or(CuError::INVALID_VALUE)?;
    let froms: Vec<CUgraphNode> = edges.iter().map(|e| node_handle(e.0)).collect();
    let tos: Vec<CUgraphNode> = edges.iter().map(|e| node_handle(e.1)).collect();
    answer(&froms, from, n, std::ptr::null_mut())?;
    if !to.is_null() {
        *n = cap;
        answer(&tos, to, n, std::ptr::null_mut())?;
    }
    if !data.is_null() && !from.is_null() {
        for i in 0..cap {
            *data.add(i) = CUgraphEdgeData::default();
        }
    }
    Ok(())
}

pub(crate) unsafe fn node_get_type(node: CUgraphNode, ty: &mut CUgraphNodeType) -> CuResult<()> {
    let (h, _, graph) = graphs::of_node(node)?;
    *ty = graph.body().nodes.get(&h).ok_or(CuError::INVALID_HANDLE)?.node.kind();
    Ok(())
}

pub(crate) unsafe fn node_get_dependencies(node: CUgraphNode, deps: *mut CUgraphNode, n: *mut usize) -> CuResult<()> {
    node_get_dependencies_v2(node, deps, std::ptr::null_mut(), n)
}

pub(crate) unsafe fn node_get_dependencies_v2(node: CUgraphNode, deps: *mut CUgraphNode, data: *mut CUgraphEdgeData, n: *mut usize) -> CuResult<()> {
    let (h, _, graph) = graphs::of_node(node)?;
    let list: Vec<CUgraphNode> = graph.body().nodes.get(&h).ok_or(CuError::INVALID_HANDLE)?.deps.iter().map(|&d| node_handle(d)).collect();
    edge_data(data, &list, n)?;
    answer(&list, deps, n, std::ptr::null_mut())
}

pub(crate) unsafe fn node_get_dependent_nodes(node: CUgraphNode, out: *mut CUgraphNode, n: *mut usize) -> CuResult<()> {
    node_get_dependent_nodes_v2(node, out, std::ptr::null_mut(), n)
}

pub(crate) unsafe fn node_get_dependent_nodes_v2(node: CUgraphNode, out: *mut CUgraphNode, data: *mut CUgraphEdgeData, n: *mut usize) -> CuResult<()> {
    let (h, _, graph) = graphs::of_node(node)?;
    let list: Vec<CUgraphNode> = graph.body().dependents(h).into_iter().map(node_handle).collect();
    edge_data(data, &list, n)?;
    answer(&list, out, n, std::ptr::null_mut())
}

/// Default edge data for the first entries of a program's `data` array (if it gave one).
unsafe fn edge_data(data: *mut CUgraphEdgeData, list: &[CUgraphNode], n: *mut usize) -> CuResult<()> {
    if data.is_null() {
        return Ok(());
    }
    let cap = n.as_ref().copied().ok_or(CuError::INVALID_VALUE)?;
    for i in 0..cap.min(list.len()) {
        *data.add(i) = CUgraphEdgeData::default();
    }
    Ok(())
}

pub(crate) unsafe fn add_dependencies(g: CUgraph, from: *const CUgraphNode, to: *const CUgraphNode, n: usize) -> CuResult<()> {
    add_dependencies_v2(g, from, to, std::ptr::null(), n)
}

pub(crate) unsafe fn add_dependencies_v2(g: CUgraph, from: *const CUgraphNode, to: *const CUgraphNode, data: *const CUgraphEdgeData, n: usize) -> CuResult<()> {
    edit_edges(g, from, to, data, n, |body, f, t| body.add_edge(f, t))
}

/// Applies `edit` to each (from, to) pair, all or nothing: the edges change on a copy first.
unsafe fn edit_edges(
    g: CUgraph,
    from: *const CUgraphNode,
    to: *const CUgraphNode,
    data: *const CUgraphEdgeData,
    n: usize,
    edit: impl Fn(&mut Body, u64, u64) -> CuResult<()>,
) -> CuResult<()> {
    let (_, graph) = graphs::get(g)?;
    default_edges(data, n)?;
    let (from, to) = (node_list(from, n)?, node_list(to, n)?);
    let mut body = graph.body();
    let mut copy = body.clone();
    for (f, t) in from.iter().zip(&to) {
        edit(&mut copy, *f, *t)?;
    }
    *body = copy;
    Ok(())
}

pub(crate) unsafe fn remove_dependencies(g: CUgraph, from: *const CUgraphNode, to: *const CUgraphNode, n: usize) -> CuResult<()> {
    remove_dependencies_v2(g, from, to, std::ptr::null(), n)
}

pub(crate) unsafe fn remove_dependencies_v2(g: CUgraph, from: *const CUgraphNode, to: *const CUgraphNode, data: *const CUgraphEdgeData, n: usize) -> CuResult<()> {
    edit_edges(g, from, to, data, n, |body, f, t| body.remove_edge(f, t))
}

pub(crate) unsafe fn destroy_node(node: CUgraphNode) -> CuResult<()> {
    let (h, _, graph) = graphs::of_node(node)?;
    graph.body().remove(h)?;
    objects().graph_nodes.remove(h);
    Ok(())
}

// ---- node parameters -------------------------------------------------------------------------

/// Runs `f` on node `node`'s entry in its graph.
unsafe fn with_node<R>(node: CUgraphNode, f: impl FnOnce(&mut Node) -> CuResult<R>) -> CuResult<R> {
    let (h, _, graph) = graphs::of_node(node)?;
    let mut body = graph.body();
    let e = body.nodes.get_mut(&h).ok_or(CuError::INVALID_HANDLE)?;
    f(&mut e.node)
}

/// Replaces a node by one of the same kind.
unsafe fn set_node(node: CUgraphNode, new: CuResult<Node>) -> CuResult<()> {
    let new = new?;
    with_node(node, |n| {
        if n.kind() != new.kind() {
            return Err(CuError::INVALID_VALUE);
        }
        *n = new;
        Ok(())
    })
}

/// Per-thread pointers into a kernel node's parameter copy, for cuGraphKernelNodeGetParams
/// (CUDA hands out its own copy, valid until the node changes).
fn param_pointers(k: &KernelNode) -> *mut *mut c_void {
    thread_local! {
        static PTRS: std::cell::RefCell<Vec<Vec<*mut c_void>>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let base = k.params.as_ptr() as *mut u8;
    let ptrs: Vec<*mut c_void> = k.function.params.iter().map(|&(off, _)| unsafe { base.add(off as usize) } as *mut c_void).collect();
    PTRS.with(|p| {
        let mut p = p.borrow_mut();
        // A few calls' arrays stay valid, so two nodes' parameters can be read side by side.
        if p.len() >= 16 {
            p.remove(0);
        }
        p.push(ptrs);
        p.last_mut().map_or(std::ptr::null_mut(), |v| v.as_mut_ptr())
    })
}

pub(crate) unsafe fn kernel_node_get_params_v2(node: CUgraphNode, out: &mut CUDA_KERNEL_NODE_PARAMS) -> CuResult<()> {
    with_node(node, |n| {
        let Node::Kernel(k) = n else { return Err(CuError::INVALID_VALUE) };
        // A node made from a CUkernel (cudart 12 and 13 launch those) answers it as `kern`,
        // with no `func`, as the driver does; cudart maps it back to the host function.
        let is_kernel = objects().kernels.get(k.func).is_some();
        let handle = k.func as usize;
        *out = CUDA_KERNEL_NODE_PARAMS {
            func: if is_kernel { std::ptr::null_mut() } else { handle as CUfunction },
            gridDimX: k.grid[0],
            gridDimY: k.grid[1],
            gridDimZ: k.grid[2],
            blockDimX: k.block[0],
            blockDimY: k.block[1],
            blockDimZ: k.block[2],
            sharedMemBytes: k.shared,
            kernelParams: param_pointers(k),
            extra: std::ptr::null_mut(),
            kern: if is_kernel { handle as CUkernel } else { std::ptr::null_mut() },
            ctx: std::ptr::null_mut(),
        };
        Ok(())
    })
}

pub(crate) unsafe fn kernel_node_get_params(node: CUgraphNode, out: &mut CUDA_KERNEL_NODE_PARAMS_v1) -> CuResult<()> {
    let mut v2 = CUDA_KERNEL_NODE_PARAMS::default();
    kernel_node_get_params_v2(node, &mut v2)?;
    *out = CUDA_KERNEL_NODE_PARAMS_v1 {
        func: v2.func,
        gridDimX: v2.gridDimX,
        gridDimY: v2.gridDimY,
        gridDimZ: v2.gridDimZ,
        blockDimX: v2.blockDimX,
        blockDimY: v2.blockDimY,
        blockDimZ: v2.blockDimZ,
        sharedMemBytes: v2.sharedMemBytes,
        kernelParams: v2.kernelParams,
        extra: std::ptr::null_mut(),
    };
    Ok(())
}

pub(crate) unsafe fn kernel_node_set_params_v2(node: CUgraphNode, p: *const CUDA_KERNEL_NODE_PARAMS) -> CuResult<()> {
    set_node(node, kernel_node_v2(p))
}

pub(crate) unsafe fn kernel_node_set_params(node: CUgraphNode, p: *const CUDA_KERNEL_NODE_PARAMS_v1) -> CuResult<()> {
    set_node(node, kernel_node_v1(p))
}

pub(crate) unsafe fn memcpy_node_get_params(node: CUgraphNode, out: &mut CUDA_MEMCPY3D) -> CuResult<()> {
    type M = CUmemorytype;
    with_node(node, |n| {
        let Node::Memcpy { copy, size, rows, .. } = *n else { return Err(CuError::INVALID_VALUE) };
        let mut p = CUDA_MEMCPY3D {
            WidthInBytes: size,
            Height: rows.height,
            Depth: rows.depth,
            srcPitch: rows.src_pitch,
            srcHeight: rows.src_rows,
            dstPitch: rows.dst_pitch,
            dstHeight: rows.dst_rows,
            ..Default::default()
        };
        match copy {
            Copy::HtoD { dst, src } => {
                (p.srcMemoryType, p.srcHost, p.dstMemoryType, p.dstDevice) = (M::CU_MEMORYTYPE_HOST, src as *const c_void, M::CU_MEMORYTYPE_DEVICE, dst)
            }
            Copy::DtoH { dst, src } => {
                (p.srcMemoryType, p.srcDevice, p.dstMemoryType, p.dstHost) = (M::CU_MEMORYTYPE_DEVICE, src, M::CU_MEMORYTYPE_HOST, dst as *mut c_void)
            }
            Copy::DtoD { dst, src } => {
                (p.srcMemoryType, p.srcDevice, p.dstMemoryType, p.dstDevice) = (M::CU_MEMORYTYPE_DEVICE, src, M::CU_MEMORYTYPE_DEVICE, dst)
            }
        }
        *out = p;
        Ok(())
    })
}

pub(crate) unsafe fn memcpy_node_set_params(node: CUgraphNode, p: *const CUDA_MEMCPY3D) -> CuResult<()> {
    set_node(node, memcpy_node(p))
}

pub(crate) unsafe fn memset_node_get_params(node: CUgraphNode, out: &mut CUDA_MEMSET_NODE_PARAMS) -> CuResult<()> {
    with_node(node, |n| {
        let Node::Memset { op, .. } = *n else { return Err(CuError::INVALID_VALUE) };
        *out = CUDA_MEMSET_NODE_PARAMS {
            dst: op.dst,
            pitch: op.pitch,
            value: op.value,
            elementSize: op.elem as u32,
            width: op.width,
            height: op.height,
        };
        Ok(())
    })
}

pub(crate) unsafe fn memset_node_set_params(node: CUgraphNode, p: *const CUDA_MEMSET_NODE_PARAMS) -> CuResult<()> {
    set_node(node, memset_node(p))
}

pub(crate) unsafe fn host_node_get_params(node: CUgraphNode, out: &mut CUDA_HOST_NODE_PARAMS) -> CuResult<()> {
    with_node(node, |n| {
        let Node::Host { f, data } = *n else { return Err(CuError::INVALID_VALUE) };
        // SAFETY: `f` came from a CUhostFn.
        out.fn_ = Some(std::mem::transmute::<usize, unsafe extern "C" fn(*mut c_void)>(f));
        out.userData = data as *mut c_void;
        Ok(())
    })
}

pub(crate) unsafe fn host_node_set_params(node: CUgraphNode, p: *const CUDA_HOST_NODE_PARAMS) -> CuResult<()> {
    set_node(node, host_node(p))
}

pub(crate) unsafe fn event_record_node_get_event(node: CUgraphNode, out: &mut CUevent) -> CuResult<()> {
    with_node(node, |n| match *n {
        Node::EventRecord { event, .. } => {
            *out = event as usize as CUevent;
            Ok(())
        }
        _ => Err(CuError::INVALID_VALUE),
    })
}

pub(crate) unsafe fn event_wait_node_get_event(node: CUgraphNode, out: &mut CUevent) -> CuResult<()> {
    with_node(node, |n| match *n {
        Node::EventWait { event, .. } => {
            *out = event as usize as CUevent;
            Ok(())
        }
        _ => Err(CuError::INVALID_VALUE),
    })
}

pub(crate) unsafe fn event_record_node_set_event(node: CUgraphNode, e: CUevent) -> CuResult<()> {
    set_node(node, event_node(e, false))
}

pub(crate) unsafe fn event_wait_node_set_event(node: CUgraphNode, e: CUevent) -> CuResult<()> {
    set_node(node, event_node(e, true))
}

// ---- the generic node API (cuGraphAddNode, cuGraphNode{Get,Set}Params) ----------------------

/// The node `p` describes, for graph `parent` (None: a node's new parameters, where a child
/// graph cannot change). Kinds rgpu does not run are CUDA_ERROR_NOT_SUPPORTED.
unsafe fn generic_node(p: *const CUgraphNodeParams, parent: Option<CUgraph>) -> CuResult<Node> {
    type T = CUgraphNodeType;
    let p = p.as_ref().ok_or(CuError::INVALID_VALUE)?;
    if p.reserved0 != [0; 3] || p.reserved2 != 0 {
        return Err(CuError::INVALID_VALUE);
    }
    let u = &p.__bindgen_anon_1;
    match p.type_ {
        T::CU_GRAPH_NODE_TYPE_EMPTY => Ok(Node::Empty),
        T::CU_GRAPH_NODE_TYPE_KERNEL => {
            let k = &u.kernel;
            let (grid, block) = ([k.gridDimX, k.gridDimY, k.gridDimZ], [k.blockDimX, k.blockDimY, k.blockDimZ]);
            kernel_node(k.func, k.kern, grid, block, k.sharedMemBytes, k.kernelParams, k.extra)
        }
        T::CU_GRAPH_NODE_TYPE_MEMCPY => {
            let m = &u.memcpy;
            if m.flags != 0 || m.reserved != 0 {
                return Err(CuError::INVALID_VALUE);
            }
            memcpy_node(&m.copyParams)
        }
        T::CU_GRAPH_NODE_TYPE_MEMSET => {
            let m = &u.memset;
            let v1 = CUDA_MEMSET_NODE_PARAMS { dst: m.dst, pitch: m.pitch, value: m.value, elementSize: m.elementSize, width: m.width, height: m.height };
            memset_node(&v1)
        }
        T::CU_GRAPH_NODE_TYPE_HOST => {
            let h = &u.host;
            let v1 = CUDA_HOST_NODE_PARAMS { fn_: h.fn_, userData: h.userData };
            host_node(&v1)
        }
        T::CU_GRAPH_NODE_TYPE_EVENT_RECORD => event_node(u.eventRecord.event, false),
        T::CU_GRAPH_NODE_TYPE_WAIT_EVENT => event_node(u.eventWait.event, true),
        T::CU_GRAPH_NODE_TYPE_GRAPH => {
            let Some(parent) = parent else {
                tracing::warn!("changing a child graph node's graph is not supported by rgpu");
                return Err(CuError::NOT_SUPPORTED);
            };
            if u.graph.ownership != CUgraphChildGraphNodeOwnership::CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE {
                tracing::warn!("child graph nodes that take their graph over (ownership {}) are not supported by rgpu", u.graph.ownership.0);
                return Err(CuError::NOT_SUPPORTED);
            }
            child_node(parent, u.graph.graph)
        }
        // Kinds CUDA has that rgpu does not run; any other number is no kind at all.
        t @ (T::CU_GRAPH_NODE_TYPE_EXT_SEMAS_SIGNAL
        | T::CU_GRAPH_NODE_TYPE_EXT_SEMAS_WAIT
        | T::CU_GRAPH_NODE_TYPE_MEM_ALLOC
        | T::CU_GRAPH_NODE_TYPE_MEM_FREE
        | T::CU_GRAPH_NODE_TYPE_BATCH_MEM_OP
        | T::CU_GRAPH_NODE_TYPE_CONDITIONAL
        | T::CU_GRAPH_NODE_TYPE_MEMCPY_BATCH
        | T::CU_GRAPH_NODE_TYPE_EXTERNAL_ENGINE
        | T::CU_GRAPH_NODE_TYPE_FABRIC_CPY_BATCH) => {
            tracing::warn!("graph nodes of type {} are not supported by rgpu through cuGraphAddNode", t.0);
            Err(CuError::NOT_SUPPORTED)
        }
        _ => Err(CuError::INVALID_VALUE),
    }
}

pub(crate) unsafe fn add_node(ph: &mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, n: usize, p: *mut CUgraphNodeParams) -> CuResult<()> {
    add(ph, g, deps, n, generic_node(p, Some(g)))
}

pub(crate) unsafe fn add_node_v2(
    ph: &mut CUgraphNode,
    g: CUgraph,
    deps: *const CUgraphNode,
    data: *const CUgraphEdgeData,
    n: usize,
    p: *mut CUgraphNodeParams,
) -> CuResult<()> {
    default_edges(data, n)?;
    add_node(ph, g, deps, n, p)
}

/// CUDA 13.4's cuGraphAddNode: the same parameters (it takes node kinds 13.4 added, which
/// rgpu does not run).
pub(crate) unsafe fn add_node_v3(
    ph: &mut CUgraphNode,
    g: CUgraph,
    deps: *const CUgraphNode,
    data: *const CUgraphEdgeData,
    n: usize,
    p: *mut CUgraphNodeParams,
) -> CuResult<()> {
    add_node_v2(ph, g, deps, data, n, p)
}

pub(crate) unsafe fn node_set_params(node: CUgraphNode, p: *mut CUgraphNodeParams) -> CuResult<()> {
    set_node(node, generic_node(p, None))
}

pub(crate) unsafe fn node_set_params_v2(node: CUgraphNode, p: *mut CUgraphNodeParams) -> CuResult<()> {
    node_set_params(node, p)
}

pub(crate) unsafe fn exec_node_set_params(e: CUgraphExec, node: CUgraphNode, p: *mut CUgraphNodeParams) -> CuResult<()> {
    exec_set(e, node, generic_node(p, None))
}

pub(crate) unsafe fn node_get_params(node: CUgraphNode, out: &mut CUgraphNodeParams) -> CuResult<()> {
    type T = CUgraphNodeType;
    let mut p: CUgraphNodeParams = std::mem::zeroed();
    p.type_ = with_node(node, |n| Ok(n.kind()))?;
    let u = &mut p.__bindgen_anon_1;
    match p.type_ {
        T::CU_GRAPH_NODE_TYPE_EMPTY => {}
        T::CU_GRAPH_NODE_TYPE_KERNEL => {
            let mut k = CUDA_KERNEL_NODE_PARAMS::default();
            kernel_node_get_params_v2(node, &mut k)?;
            u.kernel = CUDA_KERNEL_NODE_PARAMS_v3 {
                func: k.func,
                gridDimX: k.gridDimX,
                gridDimY: k.gridDimY,
                gridDimZ: k.gridDimZ,
                blockDimX: k.blockDimX,
                blockDimY: k.blockDimY,
                blockDimZ: k.blockDimZ,
                sharedMemBytes: k.sharedMemBytes,
                kernelParams: k.kernelParams,
                extra: k.extra,
                kern: k.kern,
                ctx: k.ctx,
            };
        }
        T::CU_GRAPH_NODE_TYPE_MEMCPY => memcpy_node_get_params(node, &mut u.memcpy.copyParams)?,
        T::CU_GRAPH_NODE_TYPE_MEMSET => {
            let mut m = CUDA_MEMSET_NODE_PARAMS::default();
            memset_node_get_params(node, &mut m)?;
            u.memset.dst = m.dst;
            u.memset.pitch = m.pitch;
            u.memset.value = m.value;
            u.memset.elementSize = m.elementSize;
            u.memset.width = m.width;
            u.memset.height = m.height;
        }
        T::CU_GRAPH_NODE_TYPE_HOST => {
            let mut h: CUDA_HOST_NODE_PARAMS = std::mem::zeroed();
            host_node_get_params(node, &mut h)?;
            u.host.fn_ = h.fn_;
            u.host.userData = h.userData;
        }
        T::CU_GRAPH_NODE_TYPE_EVENT_RECORD => event_record_node_get_event(node, &mut u.eventRecord.event)?,
        T::CU_GRAPH_NODE_TYPE_WAIT_EVENT => event_wait_node_get_event(node, &mut u.eventWait.event)?,
        t => {
            // A child graph's or graph memory's parameters are handles rgpu does not keep.
            tracing::warn!("cuGraphNodeGetParams on a node of type {} is not supported by rgpu", t.0);
            return Err(CuError::NOT_SUPPORTED);
        }
    }
    *out = p;
    Ok(())
}

/// A DOT description of the graph (nodes by kind, edges), for looking at; `flags` choose
/// CUDA's extra detail, which is left out.
pub(crate) unsafe fn debug_dot_print(g: CUgraph, path: *const c_char, _flags: u32) -> CuResult<()> {
    let (gh, graph) = graphs::get(g)?;
    if path.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    let path = std::ffi::CStr::from_ptr(path).to_str().map_err(|_| CuError::INVALID_VALUE)?;
    let text = {
        let body = graph.body();
        let mut t = format!("digraph graph_{gh:#x} {{\n");
        for (h, e) in &body.nodes {
            t.push_str(&format!("  n{h:x} [label=\"{}\"];\n", dot_label(&e.node)));
        }
        for (from, to) in body.edges() {
            t.push_str(&format!("  n{from:x} -> n{to:x};\n"));
        }
        t.push_str("}\n");
        t
    };
    std::fs::write(path, text).map_err(|e| {
        tracing::debug!("cuGraphDebugDotPrint: {path}: {e}");
        CuError::OPERATING_SYSTEM
    })
}

fn dot_label(n: &Node) -> String {
    match n {
        Node::Empty => "empty".into(),
        Node::Kernel(k) => format!("kernel {}", k.function.name.to_string_lossy()),
        Node::Memcpy { copy, size, rows, .. } => {
            let way = match copy {
                Copy::HtoD { .. } => "HtoD",
                Copy::DtoH { .. } => "DtoH",
                Copy::DtoD { .. } => "DtoD",
            };
            match (rows.height, rows.depth) {
                (1, 1) => format!("memcpy {way} {size} B"),
                (h, 1) => format!("memcpy {way} {h} rows of {size} B"),
                (h, d) => format!("memcpy {way} {d} slices of {h} rows of {size} B"),
            }
        }
        Node::Memset { op, .. } => format!("memset {}x{} of {} B", op.width, op.height, op.elem),
        Node::Host { .. } => "host".into(),
        Node::EventRecord { .. } => "event record".into(),
        Node::EventWait { .. } => "event wait".into(),
        Node::Child(b) => format!("child graph ({} nodes)", b.nodes.len()),
        Node::MemAlloc { mem } => format!("mem alloc {} B", mem.size),
        Node::MemFree { .. } => "mem free".into(),
    }
}

/// The graph takes `n` references to `o`: new ones, or with CU_GRAPH_USER_OBJECT_MOVE the
/// caller's own.
pub(crate) unsafe fn retain_user_object(g: CUgraph, o: CUuserObject, n: u32, flags: u32) -> CuResult<()> {
    let (_, graph) = graphs::get(g)?;
    let h = o as usize as u64;
    let mv = CUuserObjectRetain_flags::CU_GRAPH_USER_OBJECT_MOVE.0;
    if flags & !mv != 0 || n == 0 || objects().user_objects.get(h).is_none() {
        return Err(if objects().user_objects.get(h).is_none() { CuError::INVALID_HANDLE } else { CuError::INVALID_VALUE });
    }
    if flags & mv == 0 {
        user_object::retain(h, n)?;
    }
    graph.body().held.push(user_object::Held { handle: h, count: n });
    Ok(())
}

/// The graph gives back `n` of the references it owns to `o`.
pub(crate) unsafe fn release_user_object(g: CUgraph, o: CUuserObject, n: u32) -> CuResult<()> {
    let (_, graph) = graphs::get(g)?;
    let h = o as usize as u64;
    let mut body = graph.body();
    let owned: u64 = body.held.iter().filter(|x| x.handle == h).map(|x| x.count as u64).sum();
    if n == 0 || (n as u64) > owned {
        return Err(CuError::INVALID_VALUE);
    }
    // Take the graph's entries for `o` and put back what it keeps; the dropped ones release.
    let mine: Vec<user_object::Held> = body.held.extract_if(.., |x| x.handle == h).collect();
    let keep = (owned - n as u64) as u32;
    let mut back = vec![];
    if keep > 0 {
        user_object::retain(h, keep)?;
        back.push(user_object::Held { handle: h, count: keep });
    }
    body.held.extend(back);
    drop(body);
    drop(mine);
    Ok(())
}

// ---- instantiation and launch ----------------------------------------------------------------

/// Flags rgpu honours: freeing graph memory on launch (it makes none) and uploading (the
/// graph is on its server from instantiation on); priorities order nothing in rgpu's
/// in-order sessions. A graph launched from the device is not offered.
fn check_flags(flags: u64) -> CuResult<()> {
    type F = CUgraphInstantiate_flags;
    let known = F::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH.0 as u64
        | F::CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD.0 as u64
        | F::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY.0 as u64;
    if flags & F::CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH.0 as u64 != 0 {
        tracing::warn!("graphs launched from the device are not supported by rgpu");
        return Err(CuError::NOT_SUPPORTED);
    }
    if flags & !known != 0 {
        return Err(CuError::INVALID_VALUE);
    }
    Ok(())
}

/// Instantiates graph `g`; on failure, the node at fault (if one is) is the second value.
fn instantiate_graph(g: CUgraph, flags: u64) -> Result<u64, (CuError, u64)> {
    let rt = runtime::get().map_err(|e| (e, 0))?;
    check_flags(flags).map_err(|e| (e, 0))?;
    let (_, graph) = graphs::get(g).map_err(|e| (e, 0))?;
    let body = graph.body().clone();
    let (ctx, current) = context::current().map_err(|e| (e, 0))?;
    let exec = Exec::instantiate(rt, body, flags, ctx, current.device)?;
    let (h, _) = objects().graph_execs.insert(exec);
    Ok(h)
}

pub(crate) unsafe fn instantiate_v2(ph: &mut CUgraphExec, g: CUgraph, err_node: *mut CUgraphNode, log: *mut c_char, size: usize) -> CuResult<()> {
    if !log.is_null() && size > 0 {
        *log = 0;
    }
    match instantiate_graph(g, 0) {
        Ok(h) => {
            *ph = h as usize as CUgraphExec;
            Ok(())
        }
        Err((e, node)) => {
            if let Some(out) = err_node.as_mut() {
                *out = node_handle(node);
            }
            Err(e)
        }
    }
}

pub(crate) unsafe fn instantiate(ph: &mut CUgraphExec, g: CUgraph, err_node: *mut CUgraphNode, log: *mut c_char, size: usize) -> CuResult<()> {
    instantiate_v2(ph, g, err_node, log, size)
}

pub(crate) unsafe fn instantiate_with_flags(ph: &mut CUgraphExec, g: CUgraph, flags: u64) -> CuResult<()> {
    let h = instantiate_graph(g, flags).map_err(|(e, _)| e)?;
    *ph = h as usize as CUgraphExec;
    Ok(())
}

pub(crate) unsafe fn instantiate_with_params(ph: &mut CUgraphExec, g: CUgraph, p: &mut CUDA_GRAPH_INSTANTIATE_PARAMS) -> CuResult<()> {
    type R = CUgraphInstantiateResult;
    if p.flags & CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD.0 as u64 != 0 {
        stream::device_of(p.hUploadStream)?;
    }
    match instantiate_graph(g, p.flags) {
        Ok(h) => {
            p.result_out = R::CUDA_GRAPH_INSTANTIATE_SUCCESS;
            p.hErrNode_out = std::ptr::null_mut();
            *ph = h as usize as CUgraphExec;
            Ok(())
        }
        Err((e, node)) => {
            p.result_out = if node != 0 && e == CuError::INVALID_VALUE {
                R::CUDA_GRAPH_INSTANTIATE_INVALID_STRUCTURE
            } else {
                R::CUDA_GRAPH_INSTANTIATE_ERROR
            };
            p.hErrNode_out = node_handle(node);
            Err(e)
        }
    }
}

pub(crate) unsafe fn exec_get_flags(e: CUgraphExec, flags: &mut cuuint64_t) -> CuResult<()> {
    *flags = execs::get(e)?.1.flags;
    Ok(())
}

pub(crate) unsafe fn launch(e: CUgraphExec, s: CUstream) -> CuResult<()> {
    let rt = runtime::get()?;
    let (_, exec) = execs::get(e)?;
    let (sh, dev) = stream::device_of(s)?;
    if dev != exec.device {
        return Err(CuError::INVALID_VALUE);
    }
    // Launched into a capturing stream, the graph becomes a child graph node, as in CUDA.
    if capture::record(sh, || Ok(Node::Child(exec.as_run().clone_with(graphs::mint_node).0)))? {
        return Ok(());
    }
    // Managed memory the host wrote reaches the device before any of the graph's work runs.
    crate::objects::managed::to_device(rt, sh)?;
    exec.launch(rt, s, sh)
}

pub(crate) unsafe fn upload(e: CUgraphExec, s: CUstream) -> CuResult<()> {
    // Its server has had the graph since instantiation.
    execs::get(e)?;
    stream::device_of(s).map(|_| ())
}

pub(crate) unsafe fn exec_destroy(e: CUgraphExec) -> CuResult<()> {
    let rt = runtime::get()?;
    let h = e as usize as u64;
    let exec = objects().graph_execs.remove(h).ok_or(CuError::INVALID_HANDLE)?;
    exec.release(rt);
    Ok(())
}

/// cuGraphExecUpdate: `g` must have the exec's shape; its nodes' parameters replace the
/// exec's.
fn update(rt: &Runtime, exec: &Arc<Exec>, g: CUgraph) -> Result<(), (CUgraphExecUpdateResult, u64, CuError)> {
    type R = CUgraphExecUpdateResult;
    let fail = |e: CuError| (R::CU_GRAPH_EXEC_UPDATE_ERROR, 0, e);
    let (_, graph) = graphs::get(g).map_err(fail)?;
    let new = graph.body().clone();
    let mut body = exec.body();
    let pairs = body.pair_with(&new).map_err(|r| (r, 0, CuError::GRAPH_EXEC_UPDATE_FAILURE))?;
    for (mine, theirs) in pairs {
        let node = new.nodes[&theirs].node.clone();
        if let Some(e) = body.nodes.get_mut(&mine) {
            e.node = node;
        }
    }
    exec.rebuild(rt, body).map_err(|(e, n)| {
        let r = if e == CuError::INVALID_VALUE { R::CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED } else { R::CU_GRAPH_EXEC_UPDATE_ERROR };
        (r, n, CuError::GRAPH_EXEC_UPDATE_FAILURE)
    })
}

pub(crate) unsafe fn exec_update(e: CUgraphExec, g: CUgraph, err_node: *mut CUgraphNode, result: *mut CUgraphExecUpdateResult) -> CuResult<()> {
    let rt = runtime::get()?;
    let (_, exec) = execs::get(e)?;
    let r = update(rt, &exec, g);
    if let Some(out) = result.as_mut() {
        *out = match &r {
            Ok(()) => CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_SUCCESS,
            Err((res, _, _)) => *res,
        };
    }
    if let Some(out) = err_node.as_mut() {
        *out = node_handle(r.as_ref().err().map_or(0, |x| x.1));
    }
    r.map_err(|(_, _, e)| e)
}

pub(crate) unsafe fn exec_update_v2(e: CUgraphExec, g: CUgraph, info: *mut CUgraphExecUpdateResultInfo) -> CuResult<()> {
    let mut result = CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_SUCCESS;
    let mut node: CUgraphNode = std::ptr::null_mut();
    let r = exec_update(e, g, &mut node, &mut result);
    if let Some(i) = info.as_mut() {
        i.result = result;
        i.errorNode = node;
        i.errorFromNode = std::ptr::null_mut();
    }
    r
}

unsafe fn exec_set(e: CUgraphExec, node: CUgraphNode, new: CuResult<Node>) -> CuResult<()> {
    let rt = runtime::get()?;
    let (_, exec) = execs::get(e)?;
    exec.set_node(rt, node as usize as u64, new?)
}

pub(crate) unsafe fn exec_kernel_node_set_params_v2(e: CUgraphExec, node: CUgraphNode, p: *const CUDA_KERNEL_NODE_PARAMS) -> CuResult<()> {
    exec_set(e, node, kernel_node_v2(p))
}

pub(crate) unsafe fn exec_kernel_node_set_params(e: CUgraphExec, node: CUgraphNode, p: *const CUDA_KERNEL_NODE_PARAMS_v1) -> CuResult<()> {
    exec_set(e, node, kernel_node_v1(p))
}

pub(crate) unsafe fn exec_memcpy_node_set_params(e: CUgraphExec, node: CUgraphNode, p: *const CUDA_MEMCPY3D, _ctx: CUcontext) -> CuResult<()> {
    exec_set(e, node, memcpy_node(p))
}

pub(crate) unsafe fn exec_memset_node_set_params(e: CUgraphExec, node: CUgraphNode, p: *const CUDA_MEMSET_NODE_PARAMS, _ctx: CUcontext) -> CuResult<()> {
    exec_set(e, node, memset_node(p))
}

pub(crate) unsafe fn exec_host_node_set_params(e: CUgraphExec, node: CUgraphNode, p: *const CUDA_HOST_NODE_PARAMS) -> CuResult<()> {
    exec_set(e, node, host_node(p))
}

pub(crate) unsafe fn exec_event_record_node_set_event(e: CUgraphExec, node: CUgraphNode, ev: CUevent) -> CuResult<()> {
    exec_set(e, node, event_node(ev, false))
}

pub(crate) unsafe fn exec_event_wait_node_set_event(e: CUgraphExec, node: CUgraphNode, ev: CUevent) -> CuResult<()> {
    exec_set(e, node, event_node(ev, true))
}

pub(crate) unsafe fn node_set_enabled(e: CUgraphExec, node: CUgraphNode, on: u32) -> CuResult<()> {
    let rt = runtime::get()?;
    let (_, exec) = execs::get(e)?;
    exec.set_enabled(rt, node as usize as u64, on != 0)
}

pub(crate) unsafe fn node_get_enabled(e: CUgraphExec, node: CUgraphNode, on: &mut u32) -> CuResult<()> {
    let (_, exec) = execs::get(e)?;
    *on = exec.enabled(node as usize as u64)? as u32;
    Ok(())
}
