//! The sim's asynchronous device: one session's stream work (kernels, event
//! records, stream waits) runs here, off the session thread, so queries
//! answer at once and kernels of different streams run at the same time.
//!
//! Work is a list of items in enqueue order, each with the items it must
//! wait for, fixed when it is enqueued by CUDA's ordering rules: the
//! previous item of its stream; on the legacy default stream, the last item
//! of every blocking stream of the device; on a blocking stream, the last
//! item of the device's default stream (non-blocking streams wait for
//! neither); a stream wait, the item that records the event. A few worker
//! threads take the first ready item in order. Everything else the session
//! does (copies, frees, unloads, device synchronisation) first waits until
//! the list is empty ([`Executor::wait_idle`]), which is what CUDA's
//! implicit synchronisation allows and keeps memory a kernel may still
//! touch from being freed or reused under it. An event or a created
//! stream is synchronised by waiting for its one item
//! ([`Executor::wait_for`]) and no more: a program that keeps kernels
//! queued behind the event it waits on (a ring of events, a copy stream
//! beside a compute stream) must get it back while they run, as on a GPU.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rgpu_cuda_types::{CuError, CuResult};
use tracing::error;

/// Items queued at most; the session thread waits past it (a GPU's launch
/// queue is as deep).
pub const MAX_PENDING: usize = 1024;

/// Worker threads of one session: kernels of this many streams run at once.
pub const WORKERS: usize = 4;

/// A stream as the executor orders it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lane {
    /// A device's legacy default stream.
    Default(u32),
    /// A created stream: its token, device and whether it is blocking (it
    /// synchronises with the legacy default stream).
    Created { token: u64, device: u32, blocking: bool },
}

impl Lane {
    pub fn device(&self) -> u32 {
        match *self {
            Lane::Default(d) => d,
            Lane::Created { device, .. } => device,
        }
    }
}

/// What an item does when its turn comes.
pub enum Work {
    /// A kernel launch; printf output goes to the vector.
    Kernel(Box<dyn FnOnce(&mut Vec<u8>) -> CuResult + Send>),
    /// An event record: the time the stream reached it.
    Record(Arc<Mutex<Option<Instant>>>),
    /// Nothing but its dependencies (a stream wait).
    Wait,
    /// A stream wait on another session's item (an interprocess event
    /// recorded there): done once that item is, or that session is gone.
    Remote(ItemWatch, u64),
}

/// A look at one executor's items from outside it (another session's
/// stream waiting on an interprocess event this one records). It does not
/// keep the executor alive: the items of an executor that is gone are done.
#[derive(Clone)]
pub struct ItemWatch(Weak<Inner>);

impl ItemWatch {
    /// Whether item `id` is still queued or running there.
    pub fn pending(&self, id: u64) -> bool {
        self.0.upgrade().is_some_and(|i| i.lock().live.contains(&id))
    }

    /// Whether this watches `x`.
    pub fn watches(&self, x: &Executor) -> bool {
        std::ptr::eq(self.0.as_ptr(), Arc::as_ptr(&x.inner))
    }
}

/// How often a wait on another executor's item looks again.
const REMOTE_POLL: Duration = Duration::from_micros(200);

struct Item {
    id: u64,
    deps: Vec<u64>,
    work: Option<Work>,
    enqueued: Instant,
}

#[derive(Default)]
struct State {
    next_id: u64,
    /// Queued items, in enqueue order; a running one has no work left.
    items: Vec<Item>,
    /// Ids of the queued and running items.
    live: HashSet<u64>,
    /// The last item enqueued on each stream (maybe done).
    last: HashMap<Lane, u64>,
    /// Items a queued event record waits for, and when each one ended
    /// (once it has): a record is stamped when its stream reached it, the
    /// moment the last of them ended (or it was queued), not when a host
    /// thread got round to it, which on a loaded host is milliseconds later
    /// and would count in `cuEventElapsedTime` as device time.
    /// Each with the number of queued records waiting for it.
    ends: HashMap<u64, (Option<Instant>, usize)>,
    /// The first error of the work done since it was last taken.
    error: Option<CuError>,
    output: Vec<u8>,
    shutdown: bool,
}

struct Inner {
    state: Mutex<State>,
    changed: Condvar,
    cancel: Arc<AtomicBool>,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn stopped(&self, s: &State) -> bool {
        s.shutdown || self.cancel.load(Ordering::Relaxed)
    }

    /// Drops the items not started yet (the session ended); running ones
    /// stay listed until they return, so nobody frees memory under them.
    fn drop_queued(&self, s: &mut State) {
        s.ends.clear();
        let State { items, live, .. } = s;
        items.retain(|it| {
            let queued = it.work.is_some();
            if queued {
                live.remove(&it.id);
            }
            !queued
        });
        self.changed.notify_all();
    }

    /// Waits for a change, waking now and then to see a cancel raised
    /// from outside (the connection's watcher does not notify).
    fn wait<'a>(&self, g: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed.wait_timeout(g, Duration::from_millis(20)).map_or_else(|p| p.into_inner().0, |r| r.0)
    }
}

/// One session's device executor; dropping it stops its work and joins it.
pub struct Executor {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
}

impl Executor {
    /// `cancel`: the session's ended flag; once raised, queued work is
    /// dropped and running kernels stop (they poll the same flag).
    pub fn new(cancel: Arc<AtomicBool>) -> Executor {
        Executor {
            inner: Arc::new(Inner { state: Mutex::new(State::default()), changed: Condvar::new(), cancel }),
            threads: Vec::new(),
        }
    }

    fn start_workers(&mut self) {
        while self.threads.len() < WORKERS {
            let inner = self.inner.clone();
            let spawned = std::thread::Builder::new().name("rgpu-sim-exec".into()).spawn(move || work(&inner));
            match spawned {
                Ok(t) => self.threads.push(t),
                Err(e) => {
                    // Fewer workers only means less overlap; none is handled at enqueue.
                    error!("cannot start a sim executor thread: {e}");
                    break;
                }
            }
        }
    }

    /// Queues `work` on `lane` behind `extra` (an event's record) and what
    /// CUDA orders it after; returns its id. Waits while the queue is full.
    pub fn enqueue(&mut self, lane: Lane, extra: Option<u64>, work: Work) -> CuResult<u64> {
        self.start_workers();
        if self.threads.is_empty() {
            return Err(CuError::OUT_OF_MEMORY);
        }
        let inner = self.inner.clone();
        let mut s = inner.lock();
        while s.items.len() >= MAX_PENDING && !inner.stopped(&s) {
            s = inner.wait(s);
        }
        if inner.stopped(&s) {
            return Err(CuError::LAUNCH_FAILED);
        }
        let mut deps: Vec<u64> = Vec::new();
        let live = |id: &u64| s.live.contains(id);
        deps.extend(s.last.get(&lane).filter(|id| live(id)));
        match lane {
            Lane::Default(d) => deps.extend(
                s.last
                    .iter()
                    .filter(|(l, id)| matches!(l, Lane::Created { device, blocking: true, .. } if *device == d) && live(id))
                    .map(|(_, id)| *id),
            ),
            Lane::Created { blocking: true, .. } => {
                deps.extend(s.last.get(&Lane::Default(lane.device())).filter(|id| live(id)))
            }
            Lane::Created { .. } => {}
        }
        deps.extend(extra.filter(|id| live(id)));
        if matches!(work, Work::Record(_)) {
            for d in &deps {
                s.ends.entry(*d).or_insert((None, 0)).1 += 1;
            }
        }
        s.next_id += 1;
        let id = s.next_id;
        s.items.push(Item { id, deps, work: Some(work), enqueued: Instant::now() });
        s.live.insert(id);
        s.last.insert(lane, id);
        inner.changed.notify_all();
        Ok(id)
    }

    /// A watch on this executor's items, for other sessions.
    pub fn watch(&self) -> ItemWatch {
        ItemWatch(Arc::downgrade(&self.inner))
    }

    /// Waits until `watch`'s item `id` is done, this session ended, or
    /// `timeout` passed: whether it is done.
    pub fn wait_remote(&self, watch: &ItemWatch, id: u64, timeout: Duration) -> bool {
        let until = Instant::now() + timeout;
        while watch.pending(id) {
            if self.inner.cancel.load(Ordering::Relaxed) || Instant::now() >= until {
                return false;
            }
            std::thread::sleep(REMOTE_POLL);
        }
        true
    }

    /// Whether item `id` is still queued or running.
    pub fn pending(&self, id: u64) -> bool {
        self.inner.lock().live.contains(&id)
    }

    /// Whether `lane` has work queued or running.
    pub fn lane_busy(&self, lane: Lane) -> bool {
        let s = self.inner.lock();
        s.last.get(&lane).is_some_and(|id| s.live.contains(id))
    }

    /// Forgets a destroyed stream (its work goes on; nothing can order after it).
    pub fn forget(&mut self, lane: Lane) {
        self.inner.lock().last.remove(&lane);
    }

    /// Waits until every queued item is done; once the session ended, until
    /// the running ones returned (they stop soon: they poll the same flag)
    /// and the rest are dropped.
    pub fn wait_idle(&self) {
        self.wait_while(|s| !s.live.is_empty(), None);
    }

    /// Waits until item `id` is done, and with it everything it was
    /// ordered after; once the session ended, until it is dropped or has
    /// returned.
    pub fn wait_for(&self, id: u64) {
        self.wait_while(|s| s.live.contains(&id), None);
    }

    /// The last item queued on `lane`, while it is queued or running.
    pub fn last_live(&self, lane: Lane) -> Option<u64> {
        let s = self.inner.lock();
        s.last.get(&lane).copied().filter(|id| s.live.contains(id))
    }

    /// As [`Executor::wait_idle`], for at most `timeout`: whether it is idle.
    pub fn wait_idle_for(&self, timeout: Duration) -> bool {
        self.wait_while(|s| !s.live.is_empty(), Some(Instant::now() + timeout))
    }

    /// Waits while `busy` holds, or until `until`: whether it stopped
    /// holding. Once the session ended, queued work is dropped so that
    /// only running items (which poll the same flag) are waited for.
    fn wait_while(&self, busy: impl Fn(&State) -> bool, until: Option<Instant>) -> bool {
        let mut s = self.inner.lock();
        while busy(&s) {
            if self.inner.stopped(&s) {
                self.inner.drop_queued(&mut s);
                if !busy(&s) {
                    break;
                }
            }
            if until.is_some_and(|t| Instant::now() >= t) {
                return false;
            }
            s = self.inner.wait(s);
        }
        true
    }

    /// The first error of the work done since the last call.
    pub fn take_error(&self) -> Option<CuError> {
        self.inner.lock().error.take()
    }

    /// Device printf output of the kernels done since the last call.
    pub fn take_output(&self) -> Vec<u8> {
        std::mem::take(&mut self.inner.lock().output)
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        self.inner.cancel.store(true, Ordering::Relaxed);
        self.inner.lock().shutdown = true;
        self.inner.changed.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn work(inner: &Inner) {
    let mut s = inner.lock();
    loop {
        if inner.stopped(&s) {
            // The session ended: what is queued never runs.
            inner.drop_queued(&mut s);
            if s.shutdown {
                return;
            }
        }
        let ready = s.items.iter().position(|it| it.work.is_some() && it.deps.iter().all(|d| !s.live.contains(d)));
        let Some(i) = ready else {
            // Every change that can make an item ready (an enqueue, a
            // completion, the shutdown) notifies, so an idle worker sleeps
            // untimed.
            s = inner.changed.wait(s).unwrap_or_else(|p| p.into_inner());
            continue;
        };
        let (id, job) = {
            let it = &mut s.items[i];
            (it.id, it.work.take())
        };
        let (result, out, ended) = match job {
            Some(Work::Kernel(k)) => {
                drop(s);
                let mut out = Vec::new();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| k(&mut out))).unwrap_or_else(|_| {
                    error!("a sim kernel panicked; the launch fails");
                    Err(CuError::LAUNCH_FAILED)
                });
                let ended = Instant::now();
                s = inner.lock();
                (r, out, ended)
            }
            // Records and waits take no time: they are done here, under the
            // lock, so the item after them starts with no hand-over between.
            Some(Work::Record(stamp)) => {
                let reached = reached(&mut s, i);
                *stamp.lock().unwrap_or_else(|p| p.into_inner()) = Some(reached);
                // A record queued behind this one is stamped the same.
                (Ok(()), Vec::new(), reached)
            }
            Some(Work::Remote(watch, remote)) => {
                // Off the lock: the other session's item may take long.
                drop(s);
                while watch.pending(remote) && !inner.cancel.load(Ordering::Relaxed) && !inner.lock().shutdown {
                    std::thread::sleep(REMOTE_POLL);
                }
                s = inner.lock();
                (Ok(()), Vec::new(), Instant::now())
            }
            Some(Work::Wait) | None => (Ok(()), Vec::new(), Instant::now()),
        };
        if let Some((e, _)) = s.ends.get_mut(&id) {
            *e = Some(ended);
        }
        s.output.extend_from_slice(&out);
        if let Err(e) = result {
            s.error.get_or_insert(e);
        }
        s.items.retain(|it| it.id != id);
        s.live.remove(&id);
        inner.changed.notify_all();
    }
}

/// When the stream reached record item `i`: when the last item it waited
/// for ended, or when it was queued if that was later.
fn reached(s: &mut State, i: usize) -> Instant {
    let it = &s.items[i];
    let (deps, enqueued) = (it.deps.clone(), it.enqueued);
    let mut last_end = None;
    for d in &deps {
        if let Some((end, waiting)) = s.ends.get_mut(d) {
            last_end = last_end.max(*end);
            *waiting -= 1;
            if *waiting == 0 {
                s.ends.remove(d);
            }
        }
    }
    last_end.map_or(enqueued, |t| t.max(enqueued))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    fn sleeper(ms: u64, log: Arc<Mutex<Vec<(u32, Instant, Instant)>>>, tag: u32) -> Work {
        Work::Kernel(Box::new(move |_| {
            let t = Instant::now();
            std::thread::sleep(Duration::from_millis(ms));
            log.lock().unwrap().push((tag, t, Instant::now()));
            Ok(())
        }))
    }

    fn blocking(token: u64) -> Lane {
        Lane::Created { token, device: 0, blocking: true }
    }

    #[test]
    fn streams_overlap_and_each_keeps_its_order() {
        let mut x = Executor::new(Arc::new(AtomicBool::new(false)));
        let log = Arc::new(Mutex::new(Vec::new()));
        let nb = |t| Lane::Created { token: t, device: 0, blocking: false };
        x.enqueue(nb(1), None, sleeper(100, log.clone(), 1)).unwrap();
        x.enqueue(nb(1), None, sleeper(10, log.clone(), 2)).unwrap();
        x.enqueue(nb(2), None, sleeper(100, log.clone(), 3)).unwrap();
        x.wait_idle();
        let l = log.lock().unwrap();
        let get = |t| *l.iter().find(|e| e.0 == t).unwrap();
        assert!(get(2).1 >= get(1).2, "stream order");
        assert!(get(3).1 < get(1).2 && get(1).1 < get(3).2, "two streams' kernels overlap");
    }

    #[test]
    fn the_legacy_default_stream_orders_blocking_streams_only() {
        let mut x = Executor::new(Arc::new(AtomicBool::new(false)));
        let log = Arc::new(Mutex::new(Vec::new()));
        let nonblocking = Lane::Created { token: 9, device: 0, blocking: false };
        x.enqueue(blocking(1), None, sleeper(80, log.clone(), 1)).unwrap();
        x.enqueue(nonblocking, None, sleeper(400, log.clone(), 2)).unwrap();
        x.enqueue(Lane::Default(0), None, sleeper(10, log.clone(), 3)).unwrap();
        x.enqueue(blocking(1), None, sleeper(10, log.clone(), 4)).unwrap();
        x.wait_idle();
        let l = log.lock().unwrap();
        let get = |t| *l.iter().find(|e| e.0 == t).unwrap();
        assert!(get(3).1 >= get(1).2, "default waits for the blocking stream");
        assert!(get(3).1 < get(2).2, "but not for the non-blocking one");
        assert!(get(4).1 >= get(3).2, "the blocking stream waits for the default one");
    }

    #[test]
    fn records_queries_waits_and_errors() {
        let mut x = Executor::new(Arc::new(AtomicBool::new(false)));
        let log = Arc::new(Mutex::new(Vec::new()));
        x.enqueue(blocking(1), None, sleeper(100, log.clone(), 1)).unwrap();
        let stamp = Arc::new(Mutex::new(None));
        let rec = x.enqueue(blocking(1), None, Work::Record(stamp.clone())).unwrap();
        assert!(x.pending(rec) && x.lane_busy(blocking(1)), "answered at once while pending");
        let other = Lane::Created { token: 2, device: 0, blocking: false };
        x.enqueue(other, Some(rec), Work::Wait).unwrap();
        x.enqueue(other, None, Work::Kernel(Box::new(|out| {
            out.extend_from_slice(b"hi");
            Err(CuError::ILLEGAL_ADDRESS)
        })))
        .unwrap();
        x.wait_idle();
        assert!(!x.pending(rec));
        assert!(stamp.lock().unwrap().is_some());
        assert_eq!(x.take_error(), Some(CuError::ILLEGAL_ADDRESS));
        assert_eq!(x.take_error(), None);
        assert_eq!(x.take_output(), b"hi");
    }

    /// An event or a stream synchronised while more work runs behind it,
    /// or beside it on another stream, returns once its own work is done.
    #[test]
    fn waiting_for_an_item_waits_for_what_it_follows_and_nothing_after() {
        let mut x = Executor::new(Arc::new(AtomicBool::new(false)));
        let log = Arc::new(Mutex::new(Vec::new()));
        let done = |log: &Arc<Mutex<Vec<(u32, Instant, Instant)>>>| -> Vec<u32> {
            let mut v: Vec<u32> = log.lock().unwrap().iter().map(|e| e.0).collect();
            v.sort();
            v
        };
        x.enqueue(blocking(1), None, sleeper(50, log.clone(), 1)).unwrap();
        let rec = x.enqueue(blocking(1), None, Work::Record(Arc::new(Mutex::new(None)))).unwrap();
        x.enqueue(blocking(1), None, sleeper(400, log.clone(), 2)).unwrap();
        x.wait_for(rec);
        assert!(!x.pending(rec));
        assert_eq!(done(&log), [1], "the record waits for the kernel before it, not the one after");
        x.wait_idle();

        let nb = |t| Lane::Created { token: t, device: 0, blocking: false };
        x.enqueue(nb(3), None, sleeper(400, log.clone(), 3)).unwrap();
        x.enqueue(nb(4), None, sleeper(20, log.clone(), 4)).unwrap();
        x.enqueue(nb(4), None, sleeper(20, log.clone(), 5)).unwrap();
        let last = x.last_live(nb(4)).expect("stream 4 is busy");
        x.wait_for(last);
        assert_eq!(done(&log), [1, 2, 4, 5], "stream 4 is done and stream 3 still runs");
        x.wait_idle();
        assert_eq!(x.last_live(nb(4)), None);
    }

    #[test]
    fn a_stream_waits_for_another_executors_item_and_not_for_a_gone_one() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut a = Executor::new(Arc::new(AtomicBool::new(false)));
        let mut b = Executor::new(Arc::new(AtomicBool::new(false)));
        let lane = Lane::Created { token: 1, device: 0, blocking: false };
        a.enqueue(lane, None, sleeper(150, log.clone(), 1)).unwrap();
        let rec = a.enqueue(lane, None, Work::Record(Arc::new(Mutex::new(None)))).unwrap();
        let w = a.watch();
        assert!(w.watches(&a) && !w.watches(&b));
        assert!(w.pending(rec));
        b.enqueue(lane, None, Work::Remote(w.clone(), rec)).unwrap();
        b.enqueue(lane, None, sleeper(1, log.clone(), 2)).unwrap();
        assert!(!b.wait_remote(&w, rec, Duration::from_millis(10)), "not done yet");
        b.wait_idle();
        {
            let l = log.lock().unwrap();
            let get = |t| *l.iter().find(|e: &&(u32, Instant, Instant)| e.0 == t).unwrap();
            assert!(get(2).1 >= get(1).2, "b's stream went on only once a's record was reached");
        }
        assert!(!w.pending(rec) && b.wait_remote(&w, rec, Duration::ZERO));
        // An executor that is gone holds no one up.
        a.enqueue(lane, None, sleeper(200, log.clone(), 3)).unwrap();
        let rec = a.enqueue(lane, None, Work::Record(Arc::new(Mutex::new(None)))).unwrap();
        let t = Instant::now();
        drop(a);
        assert!(!w.pending(rec));
        b.enqueue(lane, None, Work::Remote(w, rec)).unwrap();
        b.wait_idle();
        assert!(t.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_cancel_drops_queued_work() {
        let cancel = Arc::new(AtomicBool::new(false));
        let mut x = Executor::new(cancel.clone());
        let ran = Arc::new(AtomicU32::new(0));
        let running = Arc::new(AtomicU32::new(0));
        for i in 0..100 {
            let (r, on) = (ran.clone(), running.clone());
            let lane = Lane::Created { token: i % 4, device: 0, blocking: false };
            x.enqueue(lane, None, Work::Kernel(Box::new(move |_| {
                on.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(20));
                r.fetch_add(1, Ordering::Relaxed);
                on.fetch_sub(1, Ordering::SeqCst);
                Ok(())
            })))
            .unwrap();
        }
        std::thread::sleep(Duration::from_millis(50));
        cancel.store(true, Ordering::Relaxed);
        let t = Instant::now();
        x.wait_idle();
        // Idle means no kernel still touches the session's memory.
        assert_eq!(running.load(Ordering::SeqCst), 0);
        drop(x);
        assert!(t.elapsed() < Duration::from_millis(200));
        assert!(ran.load(Ordering::Relaxed) < 30, "queued kernels ran after the cancel");
    }
}
