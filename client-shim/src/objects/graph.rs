//! CUDA graphs, as the shim keeps them: nodes with their operations and dependencies, built by
//! the cuGraphAdd* calls or by stream capture (`objects::capture`), and put in the order they
//! run by [`Body::order`] when instantiated (`objects::graph_exec`).
//!
//! A graph lives only here: the server sees an instantiated graph's operations, never the
//! graph. Node handles are minted in increasing order, so a body's `BTreeMap` iterates its
//! nodes in creation order, and the topological order prefers it: a captured sequence replays
//! in the order it was captured.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

use rgpu_cuda_types::*;

use super::graph_mem::GraphMem;
use super::module::Function;
use super::objects;

/// Nodes of one graph (child graphs included, counted once each): CUDA graphs of real
/// programs have thousands; the bound keeps every walk over a hostile graph bounded.
pub const MAX_NODES: usize = 1 << 20;
/// Child graphs inside child graphs, at most (every walk over a graph recurses into them).
pub const MAX_DEPTH: usize = 16;

#[derive(Clone)]
pub struct KernelNode {
    /// What the program passed as `func` (a CUfunction or a CUkernel), answered back by
    /// cuGraphKernelNodeGetParams.
    pub func: u64,
    pub function: Arc<Function>,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared: u32,
    /// The packed parameters, copied when the node was made: the program may reuse its
    /// buffers at once, as CUDA allows.
    pub params: Vec<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Copy {
    /// `src` is host memory, read when the graph runs.
    HtoD { dst: u64, src: usize },
    /// `dst` is host memory, written when the graph runs.
    DtoH { dst: usize, src: u64 },
    DtoD { dst: u64, src: u64 },
}

/// Pieces one memcpy node may run as: more (a pitched copy of very many short rows) is
/// refused when the node is made, so no plan of a hostile shape grows without bound.
pub const MAX_RUNS: usize = 1 << 16;

/// Where a memcpy node's rows lie (CUDA's pitched copies): `height` rows of the node's `size`
/// bytes a slice, `depth` slices; each side's pitch (bytes from row to row) and rows from one
/// slice to the next. Offsets are from the node's first byte on each side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rows {
    pub height: usize,
    pub depth: usize,
    pub src_pitch: usize,
    pub src_rows: usize,
    pub dst_pitch: usize,
    pub dst_rows: usize,
}

impl Rows {
    /// One row: a 1-D copy.
    pub const ONE: Rows = Rows { height: 1, depth: 1, src_pitch: 0, src_rows: 0, dst_pitch: 0, dst_rows: 0 };

    /// Whether each slice's rows follow each other on both sides.
    fn rows_meet(&self, width: usize) -> bool {
        self.height == 1 || self.src_pitch == width && self.dst_pitch == width
    }

    /// Whether, besides, each slice follows the one before on both sides.
    fn slices_meet(&self, width: usize) -> bool {
        let span = |pitch: usize| (self.height - 1) * pitch + width;
        self.rows_meet(width)
            && (self.depth == 1 || self.src_rows * self.src_pitch == span(self.src_pitch) && self.dst_rows * self.dst_pitch == span(self.dst_pitch))
    }

    /// How many pieces [`Rows::runs`] gives.
    pub fn run_count(&self, width: usize) -> usize {
        if self.slices_meet(width) {
            1
        } else if self.rows_meet(width) {
            self.depth
        } else {
            self.height.saturating_mul(self.depth)
        }
    }

    /// The copy as contiguous pieces, (source offset, destination offset, bytes): rows, or
    /// slices or the whole where they follow each other on both sides. The shape was checked
    /// against both sides' memory when the node was made, so no offset overflows.
    pub fn runs(&self, width: usize) -> Vec<(usize, usize, usize)> {
        let at = |pitch: usize, rows: usize, y: usize, z: usize| (z * rows + y) * pitch;
        if self.slices_meet(width) {
            return vec![(0, 0, width * self.height * self.depth)];
        }
        if self.rows_meet(width) {
            return (0..self.depth).map(|z| (at(self.src_pitch, self.src_rows, 0, z), at(self.dst_pitch, self.dst_rows, 0, z), width * self.height)).collect();
        }
        let mut v = Vec::with_capacity(self.run_count(width));
        for z in 0..self.depth {
            for y in 0..self.height {
                v.push((at(self.src_pitch, self.src_rows, y, z), at(self.dst_pitch, self.dst_rows, y, z), width));
            }
        }
        v
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemsetNode {
    pub dst: u64,
    pub value: u32,
    /// 1, 2 or 4.
    pub elem: u8,
    pub width: usize,
    /// Bytes between rows; 0 for one row.
    pub pitch: usize,
    pub height: usize,
}

#[derive(Clone)]
pub enum Node {
    Empty,
    Kernel(KernelNode),
    /// `size` bytes a row; `rows` says how many rows and where ([`Rows::ONE`]: a 1-D copy).
    Memcpy { copy: Copy, size: usize, rows: Rows, device: CUdevice },
    Memset { op: MemsetNode, device: CUdevice },
    /// A host function and its argument (kept as addresses: they are only called).
    Host { f: usize, data: usize },
    EventRecord { event: u64, device: CUdevice },
    EventWait { event: u64, device: CUdevice },
    /// A copy of the child graph, made when the node was added (as CUDA copies it).
    Child(Body),
    /// Graph memory (`objects::graph_mem`): allocated when captured, so these do nothing
    /// when the graph runs.
    MemAlloc { mem: Arc<GraphMem> },
    MemFree { ptr: u64, device: CUdevice },
}

impl Node {
    pub fn kind(&self) -> CUgraphNodeType {
        type T = CUgraphNodeType;
        match self {
            Node::Empty => T::CU_GRAPH_NODE_TYPE_EMPTY,
            Node::Kernel(_) => T::CU_GRAPH_NODE_TYPE_KERNEL,
            Node::Memcpy { .. } => T::CU_GRAPH_NODE_TYPE_MEMCPY,
            Node::Memset { .. } => T::CU_GRAPH_NODE_TYPE_MEMSET,
            Node::Host { .. } => T::CU_GRAPH_NODE_TYPE_HOST,
            Node::EventRecord { .. } => T::CU_GRAPH_NODE_TYPE_EVENT_RECORD,
            Node::EventWait { .. } => T::CU_GRAPH_NODE_TYPE_WAIT_EVENT,
            Node::Child(_) => T::CU_GRAPH_NODE_TYPE_GRAPH,
            Node::MemAlloc { .. } => T::CU_GRAPH_NODE_TYPE_MEM_ALLOC,
            Node::MemFree { .. } => T::CU_GRAPH_NODE_TYPE_MEM_FREE,
        }
    }

    /// The device the node's work runs on; None for nodes that run nowhere or on the host.
    pub fn device(&self) -> Option<CUdevice> {
        match self {
            Node::Kernel(k) => Some(k.function.device),
            Node::Memcpy { device, .. }
            | Node::Memset { device, .. }
            | Node::EventRecord { device, .. }
            | Node::EventWait { device, .. }
            | Node::MemFree { device, .. } => Some(*device),
            Node::MemAlloc { mem } => Some(mem.device),
            Node::Empty | Node::Host { .. } | Node::Child(_) => None,
        }
    }

    /// Nodes this one counts for against [`MAX_NODES`].
    fn weight(&self) -> usize {
        match self {
            Node::Child(b) => 1 + b.weight,
            _ => 1,
        }
    }
}

#[derive(Clone)]
pub struct Entry {
    pub node: Node,
    /// The nodes this one depends on, each once, in the order they were added.
    pub deps: Vec<u64>,
}

/// A graph's nodes by handle (creation order) and the edges into each.
#[derive(Clone, Default)]
pub struct Body {
    pub nodes: BTreeMap<u64, Entry>,
    /// Nodes counted against [`MAX_NODES`], child graphs' included.
    weight: usize,
    /// Levels of child graphs inside (0: none), at most [`MAX_DEPTH`].
    depth: usize,
    /// User object references the graph owns (a clone or an exec owns as many again).
    pub held: Vec<super::user_object::Held>,
}

impl Body {
    /// Adds `node` after `deps` (each a node of this body, none twice); `h` is its new handle.
    pub fn add(&mut self, h: u64, node: Node, deps: &[u64]) -> CuResult<()> {
        let mut seen = BTreeSet::new();
        for d in deps {
            if !self.nodes.contains_key(d) || !seen.insert(*d) {
                return Err(CuError::INVALID_VALUE);
            }
        }
        let weight = self.weight.checked_add(node.weight()).filter(|&w| w <= MAX_NODES).ok_or(CuError::OUT_OF_MEMORY)?;
        let depth = match &node {
            Node::Child(b) if b.depth + 1 > MAX_DEPTH => {
                tracing::warn!("child graphs nested more than {MAX_DEPTH} deep are not supported by rgpu");
                return Err(CuError::NOT_SUPPORTED);
            }
            Node::Child(b) => self.depth.max(b.depth + 1),
            _ => self.depth,
        };
        self.nodes.insert(h, Entry { node, deps: deps.to_vec() });
        self.weight = weight;
        self.depth = depth;
        Ok(())
    }

    /// Adds the edge `from` → `to`. An edge already there is CUDA_ERROR_INVALID_VALUE, as in
    /// CUDA; a cycle is not checked here (CUDA does not either) but refused at instantiation.
    pub fn add_edge(&mut self, from: u64, to: u64) -> CuResult<()> {
        if from == to || !self.nodes.contains_key(&from) {
            return Err(CuError::INVALID_VALUE);
        }
        let e = self.nodes.get_mut(&to).ok_or(CuError::INVALID_VALUE)?;
        if e.deps.contains(&from) {
            return Err(CuError::INVALID_VALUE);
        }
        e.deps.push(from);
        Ok(())
    }

    pub fn remove_edge(&mut self, from: u64, to: u64) -> CuResult<()> {
        let e = self.nodes.get_mut(&to).ok_or(CuError::INVALID_VALUE)?;
        let i = e.deps.iter().position(|&d| d == from).ok_or(CuError::INVALID_VALUE)?;
        e.deps.remove(i);
        Ok(())
    }

    /// Removes node `h` and every edge that touches it.
    pub fn remove(&mut self, h: u64) -> CuResult<()> {
        let e = self.nodes.remove(&h).ok_or(CuError::INVALID_VALUE)?;
        self.weight -= e.node.weight();
        for e in self.nodes.values_mut() {
            e.deps.retain(|&d| d != h);
        }
        Ok(())
    }

    /// Nodes that depend on `h`, in creation order.
    pub fn dependents(&self, h: u64) -> Vec<u64> {
        self.nodes.iter().filter(|(_, e)| e.deps.contains(&h)).map(|(&k, _)| k).collect()
    }

    /// Nodes with no dependencies, in creation order.
    pub fn roots(&self) -> Vec<u64> {
        self.nodes.iter().filter(|(_, e)| e.deps.is_empty()).map(|(&k, _)| k).collect()
    }

    /// Every edge as (from, to), by destination in creation order.
    pub fn edges(&self) -> Vec<(u64, u64)> {
        self.nodes.iter().flat_map(|(&to, e)| e.deps.iter().map(move |&from| (from, to))).collect()
    }

    /// The nodes in an order that respects every edge, preferring creation order (Kahn's
    /// algorithm over the earliest-created ready node). A cycle is
    /// CUDA_ERROR_INVALID_VALUE, with a node on it.
    pub fn order(&self) -> Result<Vec<u64>, (CuError, u64)> {
        let mut missing: BTreeMap<u64, usize> = self.nodes.iter().map(|(&h, e)| (h, e.deps.len())).collect();
        let mut dependents: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for (&to, e) in &self.nodes {
            for &from in &e.deps {
                dependents.entry(from).or_default().push(to);
            }
        }
        let mut ready: BTreeSet<u64> = missing.iter().filter(|(_, &n)| n == 0).map(|(&h, _)| h).collect();
        let mut out = Vec::with_capacity(self.nodes.len());
        while let Some(h) = ready.pop_first() {
            out.push(h);
            for d in dependents.get(&h).map(Vec::as_slice).unwrap_or(&[]) {
                let n = missing.get_mut(d).expect("an edge's node is in the body");
                *n -= 1;
                if *n == 0 {
                    ready.insert(*d);
                }
            }
        }
        if out.len() != self.nodes.len() {
            let on_cycle = missing.iter().find(|(_, &n)| n > 0).map_or(0, |(&h, _)| h);
            return Err((CuError::INVALID_VALUE, on_cycle));
        }
        Ok(out)
    }

    /// A copy with fresh node handles from `mint`, in the same creation order; returns the copy
    /// and (old, new) handle pairs.
    pub fn clone_with(&self, mut mint: impl FnMut() -> u64) -> (Body, Vec<(u64, u64)>) {
        let map: BTreeMap<u64, u64> = self.nodes.keys().map(|&h| (h, mint())).collect();
        let nodes = self
            .nodes
            .iter()
            .map(|(h, e)| (map[h], Entry { node: e.node.clone(), deps: e.deps.iter().map(|d| map[d]).collect() }))
            .collect();
        (Body { nodes, weight: self.weight, depth: self.depth, held: self.held.clone() }, map.into_iter().collect())
    }

    /// Whether `other` has the same shape (node kinds and edges, paired in creation order),
    /// as cuGraphExecUpdate requires; returns the pairs.
    pub fn pair_with(&self, other: &Body) -> Result<Vec<(u64, u64)>, CUgraphExecUpdateResult> {
        type R = CUgraphExecUpdateResult;
        if self.nodes.len() != other.nodes.len() {
            return Err(R::CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED);
        }
        let pairs: Vec<(u64, u64)> = self.nodes.keys().copied().zip(other.nodes.keys().copied()).collect();
        let to_mine: BTreeMap<u64, u64> = pairs.iter().map(|&(m, o)| (o, m)).collect();
        for &(m, o) in &pairs {
            let (a, b) = (&self.nodes[&m], &other.nodes[&o]);
            if a.node.kind() != b.node.kind() {
                return Err(R::CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED);
            }
            let mut da: Vec<u64> = a.deps.clone();
            let mut db: Vec<u64> = b.deps.iter().map(|d| to_mine[d]).collect();
            da.sort_unstable();
            db.sort_unstable();
            if da != db {
                return Err(R::CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED);
            }
            if let (Node::Kernel(x), Node::Kernel(y)) = (&a.node, &b.node) {
                if x.function.device != y.function.device {
                    return Err(R::CU_GRAPH_EXEC_UPDATE_ERROR_UNSUPPORTED_FUNCTION_CHANGE);
                }
            }
            if matches!(a.node, Node::MemAlloc { .. } | Node::MemFree { .. }) {
                // Graph memory belongs to the exec it was instantiated with.
                return Err(R::CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED);
            }
            if matches!((&a.node, &b.node), (Node::Child(_), Node::Child(_))) {
                // A child graph's own shape would have to be compared too.
                return Err(R::CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED);
            }
        }
        Ok(pairs)
    }
}

pub struct Graph {
    body: Mutex<Body>,
    /// For a clone (cuGraphClone), each node of the original at the time, to its copy here
    /// (node handles are never reused, so the original's handles say which graph it was).
    copies: BTreeMap<u64, u64>,
}

impl Graph {
    pub fn new(body: Body) -> Self {
        Graph { body: Mutex::new(body), copies: BTreeMap::new() }
    }

    /// The node of this clone copied from `original`, if it still has it.
    pub fn copy_of(&self, original: u64) -> Option<u64> {
        let h = *self.copies.get(&original)?;
        self.body().nodes.contains_key(&h).then_some(h)
    }

    pub fn body(&self) -> MutexGuard<'_, Body> {
        self.body.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A graph handle the program passed.
pub fn get(g: CUgraph) -> CuResult<(u64, Arc<Graph>)> {
    let h = g as usize as u64;
    Ok((h, objects().graphs.get(h).ok_or(CuError::INVALID_HANDLE)?))
}

/// The graph a node handle belongs to.
pub fn of_node(n: CUgraphNode) -> CuResult<(u64, u64, Arc<Graph>)> {
    let h = n as usize as u64;
    let g = *objects().graph_nodes.get(h).ok_or(CuError::INVALID_HANDLE)?;
    let graph = objects().graphs.get(g).ok_or(CuError::INVALID_HANDLE)?;
    Ok((h, g, graph))
}

/// Adds `node` to graph `g` after `deps`, returning its handle.
pub fn add(g: u64, graph: &Graph, node: Node, deps: &[u64]) -> CuResult<u64> {
    let h = objects().graph_nodes.mint();
    graph.body().add(h, node, deps)?;
    objects().graph_nodes.insert_with_handle(h, g);
    Ok(h)
}

/// A new graph holding `body`, its nodes registered as its own.
pub fn create(body: Body) -> u64 {
    insert(Graph::new(body))
}

/// A new graph holding `body`, a clone whose nodes were copied as `pairs` (original, copy) say.
pub fn create_clone(body: Body, pairs: Vec<(u64, u64)>) -> u64 {
    insert(Graph { body: Mutex::new(body), copies: pairs.into_iter().collect() })
}

fn insert(graph: Graph) -> u64 {
    let nodes: Vec<u64> = graph.body().nodes.keys().copied().collect();
    let (g, _) = objects().graphs.insert(graph);
    for n in nodes {
        objects().graph_nodes.insert_with_handle(n, g);
    }
    g
}

/// Forgets graph `g` and its nodes' handles.
pub fn destroy(g: u64) -> CuResult<()> {
    let graph = objects().graphs.remove(g).ok_or(CuError::INVALID_HANDLE)?;
    for n in graph.body().nodes.keys() {
        objects().graph_nodes.remove(*n);
    }
    Ok(())
}

/// A program's array of `n` node handles.
///
/// # Safety
/// `p` is null or points to `n` handles.
pub unsafe fn node_list(p: *const CUgraphNode, n: usize) -> CuResult<Vec<u64>> {
    if n == 0 {
        return Ok(vec![]);
    }
    if p.is_null() || n > MAX_NODES {
        return Err(CuError::INVALID_VALUE);
    }
    Ok(std::slice::from_raw_parts(p, n).iter().map(|&x| x as usize as u64).collect())
}

/// Handles for nodes that are never handed out (those inside child graphs' copies).
pub fn mint_node() -> u64 {
    objects().graph_nodes.mint()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(edges: &[(u64, u64)], n: u64) -> Body {
        let mut b = Body::default();
        for h in 1..=n {
            b.add(h, Node::Empty, &[]).unwrap();
        }
        for &(f, t) in edges {
            b.add_edge(f, t).unwrap();
        }
        b
    }

    /// Every byte a shape copies, as (source offset, destination offset), row by row.
    fn bytes_of(r: &Rows, width: usize) -> Vec<(usize, usize)> {
        let mut v = vec![];
        for z in 0..r.depth {
            for y in 0..r.height {
                for x in 0..width {
                    v.push(((z * r.src_rows + y) * r.src_pitch + x, (z * r.dst_rows + y) * r.dst_pitch + x));
                }
            }
        }
        v
    }

    #[test]
    fn memcpy_rows_run_as_contiguous_pieces_that_copy_every_byte_once() {
        let rows = |height, depth, src_pitch, src_rows, dst_pitch, dst_rows| Rows { height, depth, src_pitch, src_rows, dst_pitch, dst_rows };
        // (shape, width, pieces expected)
        let cases = [
            (Rows::ONE, 100, 1),
            (rows(8, 1, 16, 0, 16, 0), 16, 1),  // rows back to back on both sides
            (rows(8, 1, 32, 0, 16, 0), 16, 8),  // source pitched
            (rows(8, 1, 16, 0, 48, 0), 16, 8),  // destination pitched
            (rows(4, 3, 16, 4, 16, 4), 16, 1),  // a dense volume
            (rows(4, 3, 16, 6, 16, 4), 16, 3),  // slices apart on the source
            (rows(4, 3, 24, 4, 16, 4), 16, 12), // rows apart on the source
            (rows(1, 5, 8, 1, 8, 1), 8, 1),     // one-row slices back to back
            (rows(1, 5, 8, 2, 8, 1), 8, 5),     // one-row slices apart on the source
        ];
        for (r, width, pieces) in cases {
            let runs = r.runs(width);
            assert_eq!(runs.len(), pieces, "{r:?}");
            assert_eq!(r.run_count(width), pieces, "{r:?}");
            let mut got = vec![];
            for (s, d, n) in runs {
                got.extend((0..n).map(|i| (s + i, d + i)));
            }
            assert_eq!(got, bytes_of(&r, width), "{r:?} copies other bytes than its rows");
        }
        // Counted without listing: a hostile shape's count is known before anything is built.
        assert_eq!(rows(usize::MAX, 2, 2, usize::MAX, 1, usize::MAX).run_count(1), usize::MAX);
    }

    #[test]
    fn order_respects_edges_and_prefers_creation_order() {
        // 1 → 3, 2 → 3, 4 → 1: 4 must come before 1 although it was made later.
        let b = body(&[(1, 3), (2, 3), (4, 1)], 4);
        assert_eq!(b.order().unwrap(), vec![2, 4, 1, 3]);
        // A chain made in order keeps it.
        let c = body(&[(1, 2), (2, 3)], 3);
        assert_eq!(c.order().unwrap(), vec![1, 2, 3]);
    }

    #[test]
    fn cycles_are_refused_with_invalid_value() {
        let b = body(&[(1, 2), (2, 3), (3, 1)], 4);
        let (e, node) = b.order().unwrap_err();
        assert_eq!(e, CuError::INVALID_VALUE);
        assert!((1..=3).contains(&node), "the error node {node} is on the cycle");
    }

    #[test]
    fn edges_are_checked() {
        let mut b = body(&[(1, 2)], 3);
        assert_eq!(b.add_edge(1, 2), Err(CuError::INVALID_VALUE), "an edge twice");
        assert_eq!(b.add_edge(1, 9), Err(CuError::INVALID_VALUE), "to a node not in the graph");
        assert_eq!(b.add_edge(2, 2), Err(CuError::INVALID_VALUE), "a self edge");
        assert_eq!(b.add(4, Node::Empty, &[1, 1]), Err(CuError::INVALID_VALUE), "a dependency twice");
        assert_eq!(b.remove_edge(2, 1), Err(CuError::INVALID_VALUE), "an edge that is not there");
        b.remove_edge(1, 2).unwrap();
        assert!(b.edges().is_empty());
        b.add_edge(3, 1).unwrap();
        b.add_edge(1, 2).unwrap();
        assert_eq!(b.roots(), vec![3]);
        assert_eq!(b.dependents(1), vec![2]);
        b.remove(1).unwrap();
        assert!(b.edges().is_empty(), "removing a node removes its edges");
        assert_eq!(b.roots(), vec![2, 3]);
    }

    #[test]
    fn child_graphs_nest_only_so_deep() {
        let mut b = Body::default();
        for level in 1..=MAX_DEPTH {
            let mut outer = Body::default();
            outer.add(1, Node::Child(b), &[]).unwrap();
            b = outer;
            assert_eq!(b.depth, level);
        }
        let mut top = Body::default();
        assert_eq!(top.add(1, Node::Child(b), &[]), Err(CuError::NOT_SUPPORTED));
    }

    #[test]
    fn clone_keeps_shape_with_new_handles() {
        let b = body(&[(1, 3), (2, 3)], 3);
        let mut next = 100;
        let (c, map) = b.clone_with(|| {
            next += 1;
            next
        });
        assert_eq!(map, vec![(1, 101), (2, 102), (3, 103)]);
        assert_eq!(c.edges(), vec![(101, 103), (102, 103)]);
        assert_eq!(c.order().unwrap(), vec![101, 102, 103]);
        assert!(b.pair_with(&c).is_ok(), "a clone has the same shape");
        let d = body(&[(1, 3)], 3);
        assert_eq!(b.pair_with(&d).unwrap_err(), CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED);
        let mut e = body(&[], 2);
        e.add(3, Node::Host { f: 1, data: 0 }, &[1, 2]).unwrap();
        assert_eq!(b.pair_with(&e).unwrap_err(), CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED);
    }
}
