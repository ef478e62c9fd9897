//! Stream capture: while a stream captures, the work queued on it becomes nodes of a graph
//! (`objects::graph`) instead of running.
//!
//! A capture sequence starts on one stream (its origin) and spreads to others through events:
//! an event recorded on a capturing stream holds the capture's current nodes, and a stream
//! that waits for it joins the capture with those nodes as its dependencies (fork); the origin
//! waiting for an event of a forked stream takes that stream's nodes back (join). Every stream
//! of a capture has its own set of nodes the next one depends on. Ending the capture on the
//! origin checks that every forked stream was joined back (else
//! CUDA_ERROR_STREAM_CAPTURE_UNJOINED) and hands the graph over.
//!
//! Calls that are not safe during capture (synchronous copies and memsets, allocation and
//! free, synchronising the device) are refused by the capture modes' rules
//! ([`check_unsafe_call`]) with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and the capture that
//! forbade them is invalidated: its later work fails with
//! CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, and so does cuStreamEndCapture, as in CUDA.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::thread::ThreadId;

use rgpu_cuda_types::*;

use super::graph::{self, Node};

type Mode = CUstreamCaptureMode;

pub struct Capture {
    pub id: u64,
    pub origin: u64,
    pub mode: Mode,
    pub thread: ThreadId,
    /// The graph being built (a graph of the table from the start, so the program can add
    /// nodes to it itself: cuStreamGetCaptureInfo_v2 hands it out).
    pub graph: u64,
    pub device: CUdevice,
    /// Whether the capture made its graph (else it captures into the program's, which a failed
    /// capture leaves alone: cuStreamBeginCaptureToGraph).
    pub owns_graph: bool,
}

#[derive(Default)]
struct Captures {
    /// Each capturing stream: its capture and the nodes its next work depends on.
    streams: HashMap<u64, StreamState>,
    /// Events recorded during a capture: the capture and the nodes they stand for.
    events: HashMap<u64, (u64, Vec<u64>)>,
    /// Captures in progress by id, with whether they were invalidated.
    live: HashMap<u64, (Arc<Capture>, bool)>,
}

struct StreamState {
    capture: u64,
    deps: Vec<u64>,
    /// What cuStreamGetCaptureInfo_v2/v3 last handed out (valid until the next call on the
    /// stream or the end of the capture, as in CUDA).
    shown: Box<[CUgraphNode]>,
    shown_edges: Box<[CUgraphEdgeData]>,
}

// The node handles are opaque numbers, never dereferenced here.
unsafe impl Send for StreamState {}

static CAPTURES: LazyLock<Mutex<Captures>> = LazyLock::new(Mutex::default);
/// Captures in progress: the fast path of every stream operation reads only this.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn lock() -> MutexGuard<'static, Captures> {
    CAPTURES.lock().unwrap_or_else(|e| e.into_inner())
}

fn any() -> bool {
    ACTIVE.load(Ordering::Acquire) != 0
}

/// Starts capturing on stream `s` (a created stream), on `device`.
pub fn begin(s: u64, device: CUdevice, mode: Mode) -> CuResult<()> {
    begin_into(s, device, mode, None, vec![])
}

/// Starts capturing on `s`, into graph `into` (the program's, its first captured work after
/// `deps`, nodes of that graph) or into a new graph.
pub fn begin_into(s: u64, device: CUdevice, mode: Mode, into: Option<u64>, deps: Vec<u64>) -> CuResult<()> {
    if ![Mode::CU_STREAM_CAPTURE_MODE_GLOBAL, Mode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, Mode::CU_STREAM_CAPTURE_MODE_RELAXED]
        .contains(&mode)
    {
        return Err(CuError::INVALID_VALUE);
    }
    let mut c = lock();
    if c.streams.contains_key(&s) {
        return Err(CuError::ILLEGAL_STATE);
    }
    if let Some(g) = into {
        for d in &deps {
            if super::objects().graph_nodes.get(*d).map(|x| *x) != Some(g) {
                return Err(CuError::INVALID_VALUE);
            }
        }
    }
    let g = into.unwrap_or_else(|| graph::create(graph::Body::default()));
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let thread = std::thread::current().id();
    let cap = Arc::new(Capture { id, origin: s, mode, thread, graph: g, device, owns_graph: into.is_none() });
    c.live.insert(id, (cap, false));
    c.streams.insert(s, StreamState::new(id, deps));
    ACTIVE.fetch_add(1, Ordering::AcqRel);
    Ok(())
}

impl StreamState {
    fn new(capture: u64, deps: Vec<u64>) -> Self {
        StreamState { capture, deps, shown: Box::new([]), shown_edges: Box::new([]) }
    }
}

/// Ends the capture that began on `s`, returning its graph.
pub fn end(s: u64) -> CuResult<u64> {
    let mut c = lock();
    let st = c.streams.get(&s).ok_or(CuError::ILLEGAL_STATE)?;
    let (cap, invalidated) = c.live.get(&st.capture).cloned().ok_or(CuError::ILLEGAL_STATE)?;
    if cap.origin != s {
        return Err(CuError::STREAM_CAPTURE_UNMATCHED);
    }
    if cap.mode != Mode::CU_STREAM_CAPTURE_MODE_RELAXED && cap.thread != std::thread::current().id() {
        return Err(CuError::STREAM_CAPTURE_WRONG_THREAD);
    }
    let joined = invalidated || unjoined(&c, &cap).is_none();
    let members: Vec<u64> = c.streams.iter().filter(|(_, v)| v.capture == cap.id).map(|(&k, _)| k).collect();
    for m in members {
        c.streams.remove(&m);
    }
    c.events.retain(|_, (id, _)| *id != cap.id);
    c.live.remove(&cap.id);
    ACTIVE.fetch_sub(1, Ordering::AcqRel);
    drop(c);
    if invalidated || !joined {
        if cap.owns_graph {
            let _ = graph::destroy(cap.graph);
        }
        return Err(if invalidated { CuError::STREAM_CAPTURE_INVALIDATED } else { CuError::STREAM_CAPTURE_UNJOINED });
    }
    Ok(cap.graph)
}

/// A stream of `cap` whose last work the origin has not waited for, if any: every node a
/// forked stream would depend on next must be the origin's, or an ancestor of one.
fn unjoined(c: &Captures, cap: &Capture) -> Option<u64> {
    let origin = c.streams.get(&cap.origin)?;
    let graph = super::objects().graphs.get(cap.graph)?;
    let body = graph.body();
    let mut seen: std::collections::HashSet<u64> = std::collections::HashSet::new();
    let mut stack: Vec<u64> = origin.deps.clone();
    while let Some(h) = stack.pop() {
        if seen.insert(h) {
            if let Some(e) = body.nodes.get(&h) {
                stack.extend_from_slice(&e.deps);
            }
        }
    }
    c.streams
        .iter()
        .filter(|(&k, v)| v.capture == cap.id && k != cap.origin)
        .find(|(_, v)| v.deps.iter().any(|d| !seen.contains(d)))
        .map(|(&k, _)| k)
}

/// Stream `s` is being destroyed: it leaves its capture; a capture that began on it ends
/// there, its graph discarded (it can no longer be ended), so it forbids nothing any more.
pub fn forget_stream(s: u64) {
    if !any() || s == 0 {
        return;
    }
    let mut c = lock();
    let Some(st) = c.streams.remove(&s) else { return };
    let Some((cap, _)) = c.live.get(&st.capture).cloned() else { return };
    if cap.origin != s {
        return;
    }
    c.streams.retain(|_, v| v.capture != cap.id);
    c.events.retain(|_, (id, _)| *id != cap.id);
    c.live.remove(&cap.id);
    ACTIVE.fetch_sub(1, Ordering::AcqRel);
    drop(c);
    tracing::debug!("stream capture {} ended: its stream was destroyed", cap.id);
    if cap.owns_graph {
        let _ = graph::destroy(cap.graph);
    }
}

/// Marks capture `id` invalidated.
fn invalidate(c: &mut Captures, id: u64) {
    if let Some(e) = c.live.get_mut(&id) {
        if !e.1 {
            tracing::debug!("stream capture {id} invalidated");
        }
        e.1 = true;
    }
}

/// If stream `s` captures, adds the node `make` gives after the stream's current nodes and
/// returns true; false if it does not capture (the caller then runs the work). A capture
/// already invalidated answers CUDA_ERROR_STREAM_CAPTURE_INVALIDATED.
pub fn record(s: u64, make: impl FnOnce() -> CuResult<Node>) -> CuResult<bool> {
    if !any() || s == 0 {
        return Ok(false);
    }
    let mut c = lock();
    let Some(st) = c.streams.get(&s) else { return Ok(false) };
    let id = st.capture;
    let (cap, invalidated) = c.live.get(&id).cloned().ok_or(CuError::ILLEGAL_STATE)?;
    if invalidated {
        return Err(CuError::STREAM_CAPTURE_INVALIDATED);
    }
    let node = match make() {
        Ok(n) => n,
        Err(e) => {
            // As in CUDA, work that cannot be captured ends the capture's hopes.
            invalidate(&mut c, id);
            return Err(e);
        }
    };
    let g = super::objects().graphs.get(cap.graph).ok_or(CuError::STREAM_CAPTURE_INVALIDATED)?;
    let deps = c.streams[&s].deps.clone();
    let h = graph::add(cap.graph, &g, node, &deps)?;
    if let Some(st) = c.streams.get_mut(&s) {
        st.deps = vec![h];
    }
    Ok(true)
}

/// Refuses work that cannot be captured on `s` if it captures: CUDA_ERROR_NOT_SUPPORTED (or
/// what `e` says), and the capture is invalidated.
pub fn refuse(s: u64, e: CuError, what: &str) -> CuResult<()> {
    if !any() || s == 0 {
        return Ok(());
    }
    let mut c = lock();
    let Some(id) = c.streams.get(&s).map(|st| st.capture) else { return Ok(()) };
    if e == CuError::NOT_SUPPORTED {
        tracing::warn!("{what} during stream capture is not supported by rgpu");
    } else {
        tracing::debug!("{what} is not permitted during stream capture");
    }
    invalidate(&mut c, id);
    Err(e)
}

/// An event recorded on `s`: if `s` captures, the event now stands for its current nodes
/// (or, with `external`, becomes an event-record node) and true is returned. Recorded outside
/// a capture, it no longer stands for one.
pub fn record_event(s: u64, event: u64, device: CUdevice, external: bool) -> CuResult<bool> {
    if !any() {
        return Ok(false);
    }
    if external {
        return record(s, || Ok(Node::EventRecord { event, device }));
    }
    let mut c = lock();
    let Some(st) = c.streams.get(&s) else {
        c.events.remove(&event);
        return Ok(false);
    };
    let (id, deps) = (st.capture, st.deps.clone());
    if c.live.get(&id).is_some_and(|(_, inv)| *inv) {
        return Err(CuError::STREAM_CAPTURE_INVALIDATED);
    }
    c.events.insert(event, (id, deps));
    Ok(true)
}

/// Stream `s` (on `device`) waits for `event`: joins the event's capture if the event was
/// recorded in one, and returns true when the wait was taken care of here.
pub fn wait_event(s: u64, device: CUdevice, event: u64, ev_device: CUdevice, external: bool) -> CuResult<bool> {
    if !any() {
        return Ok(false);
    }
    if external && record(s, || Ok(Node::EventWait { event, device: ev_device }))? {
        return Ok(true);
    }
    let mut c = lock();
    let from = c.events.get(&event).cloned();
    let mine = c.streams.get(&s).map(|st| st.capture);
    match (from, mine) {
        (None, None) => Ok(false),
        // Waiting for work outside the capture would cross its boundary.
        (None, Some(id)) => {
            invalidate(&mut c, id);
            Err(CuError::STREAM_CAPTURE_ISOLATION)
        }
        (Some((id, deps)), None) => {
            if s == 0 {
                // The legacy stream would depend on the capture.
                invalidate(&mut c, id);
                return Err(CuError::STREAM_CAPTURE_IMPLICIT);
            }
            let cap_device = c.live.get(&id).map(|(cap, _)| cap.device);
            if cap_device != Some(device) {
                return Err(CuError::NOT_SUPPORTED);
            }
            c.streams.insert(s, StreamState::new(id, deps));
            Ok(true)
        }
        (Some((id, deps)), Some(mine)) if id == mine => {
            let st = c.streams.get_mut(&s).expect("the stream captures");
            for d in deps {
                if !st.deps.contains(&d) {
                    st.deps.push(d);
                }
            }
            Ok(true)
        }
        (Some((id, _)), Some(mine)) => {
            invalidate(&mut c, id);
            invalidate(&mut c, mine);
            Err(CuError::STREAM_CAPTURE_MERGE)
        }
    }
}

/// What cuStreamGetCaptureInfo says about `s`.
pub struct Info {
    pub status: CUstreamCaptureStatus,
    pub id: u64,
    pub graph: u64,
    pub deps: *const CUgraphNode,
    pub edges: *const CUgraphEdgeData,
    pub count: usize,
}

pub fn info(s: u64) -> Info {
    let none = Info {
        status: CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE,
        id: 0,
        graph: 0,
        deps: std::ptr::null(),
        edges: std::ptr::null(),
        count: 0,
    };
    if !any() || s == 0 {
        return none;
    }
    let mut c = lock();
    let Some(id) = c.streams.get(&s).map(|st| st.capture) else { return none };
    let (graph, invalidated) = match c.live.get(&id) {
        Some((cap, inv)) => (cap.graph, *inv),
        None => return none,
    };
    let st = c.streams.get_mut(&s).expect("the stream captures");
    st.shown = st.deps.iter().map(|&d| d as usize as CUgraphNode).collect();
    st.shown_edges = st.deps.iter().map(|_| CUgraphEdgeData::default()).collect();
    Info {
        status: if invalidated {
            CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED
        } else {
            CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE
        },
        id,
        graph,
        deps: if st.shown.is_empty() { std::ptr::null() } else { st.shown.as_ptr() },
        edges: if st.shown.is_empty() { std::ptr::null() } else { st.shown_edges.as_ptr() },
        count: st.shown.len(),
    }
}

/// cuStreamUpdateCaptureDependencies: `nodes` (of the capture's graph) are added to, or with
/// `set` replace, the nodes `s`'s next work depends on.
pub fn update_dependencies(s: u64, nodes: &[u64], set: bool) -> CuResult<()> {
    let mut c = lock();
    let id = c.streams.get(&s).map(|st| st.capture).ok_or(CuError::ILLEGAL_STATE)?;
    let (cap, invalidated) = c.live.get(&id).cloned().ok_or(CuError::ILLEGAL_STATE)?;
    if invalidated {
        return Err(CuError::STREAM_CAPTURE_INVALIDATED);
    }
    for &n in nodes {
        if super::objects().graph_nodes.get(n).map(|g| *g) != Some(cap.graph) {
            return Err(CuError::INVALID_VALUE);
        }
    }
    let st = c.streams.get_mut(&s).expect("the stream captures");
    if set {
        st.deps.clear();
    }
    for &n in nodes {
        if !st.deps.contains(&n) {
            st.deps.push(n);
        }
    }
    Ok(())
}

/// cuEventSynchronize and cuEventQuery: not of an event recorded in a capture in progress
/// (CUDA_ERROR_CAPTURED_EVENT), and, as potentially unsafe calls, as the modes allow.
pub fn check_event_wait(event: u64) -> CuResult<()> {
    if !any() {
        return Ok(());
    }
    if lock().events.contains_key(&event) {
        return Err(CuError::CAPTURED_EVENT);
    }
    check_unsafe_call()
}

/// cuStreamSynchronize and cuStreamQuery on a capturing stream: never allowed, and the
/// capture is invalidated.
pub fn refuse_sync(s: u64) -> CuResult<()> {
    refuse(s, CuError::STREAM_CAPTURE_UNSUPPORTED, "synchronising a capturing stream")
}

thread_local! {
    /// This thread's capture interaction mode (cuThreadExchangeStreamCaptureMode).
    static THREAD_MODE: std::cell::Cell<Mode> = const { std::cell::Cell::new(Mode::CU_STREAM_CAPTURE_MODE_GLOBAL) };
}

/// Sets this thread's capture mode, returning the one it replaces.
pub fn exchange_mode(mode: Mode) -> CuResult<Mode> {
    THREAD_MODE.try_with(|m| m.replace(mode)).map_err(|_| CuError::DEINITIALIZED)
}

/// A potentially unsafe call (one that synchronises implicitly, or allocates or frees) on this
/// thread: refused with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED where the modes forbid it, as
/// CUDA does. In this thread's mode GLOBAL, a capture of this thread not begun RELAXED or a
/// GLOBAL capture of any thread forbids it; in THREAD_LOCAL only the former; RELAXED never.
/// The captures that forbade it are invalidated.
pub fn check_unsafe_call() -> CuResult<()> {
    if !any() {
        return Ok(());
    }
    let mode = THREAD_MODE.try_with(|m| m.get()).unwrap_or(Mode::CU_STREAM_CAPTURE_MODE_GLOBAL);
    if mode == Mode::CU_STREAM_CAPTURE_MODE_RELAXED {
        return Ok(());
    }
    let me = std::thread::current().id();
    let mut c = lock();
    let forbidding: Vec<u64> = c
        .live
        .values()
        .filter(|(cap, _)| {
            (cap.thread == me && cap.mode != Mode::CU_STREAM_CAPTURE_MODE_RELAXED)
                || (mode == Mode::CU_STREAM_CAPTURE_MODE_GLOBAL && cap.mode == Mode::CU_STREAM_CAPTURE_MODE_GLOBAL)
        })
        .map(|(cap, _)| cap.id)
        .collect();
    if forbidding.is_empty() {
        return Ok(());
    }
    for id in forbidding {
        invalidate(&mut c, id);
    }
    Err(CuError::STREAM_CAPTURE_UNSUPPORTED)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn empty() -> CuResult<Node> {
        Ok(Node::Empty)
    }

    fn edges(g: u64) -> Vec<(u64, u64)> {
        super::super::objects().graphs.get(g).unwrap().body().edges()
    }

    // One test, so that no other capture of this process runs while the modes are checked.
    #[test]
    fn capture_forks_joins_and_enforces_the_modes() {
        type M = CUstreamCaptureMode;
        let (a, b) = (0xA001, 0xA002);
        // Fork onto b, work on both, join back: the graph has the diamond.
        begin(a, 0, M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
        assert_eq!(begin(a, 0, M::CU_STREAM_CAPTURE_MODE_GLOBAL), Err(CuError::ILLEGAL_STATE));
        assert!(record(a, empty).unwrap());
        assert!(!record(b, empty).unwrap(), "b does not capture yet");
        assert!(record_event(a, 0xE1, 0, false).unwrap());
        assert!(wait_event(b, 0, 0xE1, 0, false).unwrap());
        assert_eq!(info(b).id, info(a).id, "b joined a's capture");
        assert!(record(b, empty).unwrap());
        assert!(record(a, empty).unwrap());
        assert!(record_event(b, 0xE2, 0, false).unwrap());
        assert!(wait_event(a, 0, 0xE2, 0, false).unwrap());
        assert_eq!(info(a).count, 2, "after the join a depends on both branches");
        assert!(record(a, empty).unwrap());
        assert_eq!(end(b), Err(CuError::STREAM_CAPTURE_UNMATCHED), "only the origin ends a capture");
        std::thread::spawn(move || assert_eq!(end(a), Err(CuError::STREAM_CAPTURE_WRONG_THREAD))).join().unwrap();
        let g = end(a).unwrap();
        let e = edges(g);
        assert_eq!(e.len(), 4, "n1->n2 (fork), n1->n3, n2->n4, n3->n4: {e:?}");
        assert_eq!(info(b).status, CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE);

        // A fork left unjoined fails the end, and every stream leaves the capture.
        begin(a, 0, M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
        record_event(a, 0xE1, 0, false).unwrap();
        wait_event(b, 0, 0xE1, 0, false).unwrap();
        record(b, empty).unwrap();
        assert_eq!(end(a), Err(CuError::STREAM_CAPTURE_UNJOINED));
        assert_eq!(info(b).status, CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE);

        // The modes: a thread-local capture forbids unsafe calls on its own thread only.
        begin(a, 0, M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
        std::thread::spawn(|| assert_eq!(check_unsafe_call(), Ok(()), "another thread, a thread-local capture"))
            .join()
            .unwrap();
        assert_eq!(check_unsafe_call(), Err(CuError::STREAM_CAPTURE_UNSUPPORTED));
        assert_eq!(info(a).status, CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED);
        assert_eq!(record(a, empty), Err(CuError::STREAM_CAPTURE_INVALIDATED));
        assert_eq!(end(a), Err(CuError::STREAM_CAPTURE_INVALIDATED));

        // A global capture forbids them on other threads in mode global, not in thread-local
        // or relaxed; and a relaxed capture forbids nothing.
        begin(a, 0, M::CU_STREAM_CAPTURE_MODE_GLOBAL).unwrap();
        std::thread::spawn(|| {
            exchange_mode(M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
            assert_eq!(check_unsafe_call(), Ok(()), "a thread-local thread ignores other threads' captures");
            exchange_mode(M::CU_STREAM_CAPTURE_MODE_RELAXED).unwrap();
            assert_eq!(check_unsafe_call(), Ok(()));
            exchange_mode(M::CU_STREAM_CAPTURE_MODE_GLOBAL).unwrap();
            assert_eq!(check_unsafe_call(), Err(CuError::STREAM_CAPTURE_UNSUPPORTED));
        })
        .join()
        .unwrap();
        assert_eq!(end(a), Err(CuError::STREAM_CAPTURE_INVALIDATED), "the other thread's call invalidated it");
        begin(a, 0, M::CU_STREAM_CAPTURE_MODE_RELAXED).unwrap();
        assert_eq!(check_unsafe_call(), Ok(()));
        std::thread::spawn(move || assert!(end(a).is_ok(), "a relaxed capture may end on another thread")).join().unwrap();

        // A destroyed origin ends its capture: nothing is forbidden afterwards.
        begin(a, 0, M::CU_STREAM_CAPTURE_MODE_GLOBAL).unwrap();
        forget_stream(a);
        assert_eq!(check_unsafe_call(), Ok(()));
        assert!(!any());
    }
}
