//! Every kernel the cuda backend launches is bracketed by a pair of timing
//! events; one thread per device watches the pairs and, as each kernel
//! ends, reports its execution time (`cuEventElapsedTime`, the device's
//! own clock) to the session's meter and charges it to the kernel's group
//! in the device's [`Turns`]. So metering counts device time, not the time
//! a launch took to queue, and compute shares are charged what the GPU
//! really spent.
//!
//! The watcher polls: `cuEventQuery` on the oldest unfinished kernel of
//! each stream (a stream's kernels end in order), every [`MIN_NAP`] while
//! kernels end or a sharing kernel waits for its turn, backing off to
//! [`MAX_NAP`] while nothing does. It never blocks on an event, so a kernel
//! that never ends holds up no one's teardown. A session takes its entries
//! back before it destroys the contexts their events live in ([`DeviceWatch::purge`]).

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use tracing::{debug, warn};

use super::driver::cu;
use super::share::{Turns, Who, MAX_WAIT};
use super::Raw;
use crate::backend::KernelTimer;
use rgpu_cuda_types::CuError;

/// The watcher's shortest and longest sleep between two looks.
pub const MIN_NAP: Duration = Duration::from_micros(20);
pub const MAX_NAP: Duration = Duration::from_millis(1);

/// Kernels one session may have launched and not yet seen end; past it a
/// launch waits, as a driver's full launch queue makes it.
pub const MAX_IN_FLIGHT: usize = 1024;

/// A kernel's start and end events.
pub type Pair = [Raw<sys::CUevent>; 2];

/// A session's spare timing events on one device, for its next launches.
pub type Spare = Arc<Mutex<Vec<Pair>>>;

/// One launched kernel, not yet seen to end.
pub struct Entry {
    /// The session that launched it.
    pub owner: u64,
    /// Its sharing group, when its session is gated ([`DeviceWatch::take_turn`]).
    pub who: Option<Who>,
    pub ctx: Raw<sys::CUcontext>,
    pub stream: Raw<sys::CUstream>,
    pub events: Pair,
    pub timer: Option<KernelTimer>,
    /// Where its events go back when it has ended.
    pub spare: Spare,
    /// Its session's count of kernels in flight.
    pub in_flight: Arc<AtomicUsize>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One device's kernels in flight and its sharing groups' turns.
pub struct DeviceWatch {
    device: u32,
    turns: Mutex<Turns>,
    /// A kernel of a sharing group ended or started: waiters look again.
    turned: Condvar,
    pending: Mutex<Vec<Entry>>,
    /// `pending` is no longer empty.
    queued: Condvar,
    /// Kernels ended: sessions at [`MAX_IN_FLIGHT`] look again.
    finished: Condvar,
    /// Held by the watcher while entries it took out of `pending` are in
    /// its hands: a session purging its own takes it first.
    poll: Mutex<()>,
    started: Once,
}

impl DeviceWatch {
    pub fn new(device: u32) -> Arc<Self> {
        Arc::new(DeviceWatch {
            device,
            turns: Mutex::new(Turns::default()),
            turned: Condvar::new(),
            pending: Mutex::new(Vec::new()),
            queued: Condvar::new(),
            finished: Condvar::new(),
            poll: Mutex::new(()),
            started: Once::new(),
        })
    }

    pub fn join(&self, who: Who, weight: u16) {
        lock(&self.turns).join(who, weight);
    }

    pub fn leave(&self, who: Who) {
        lock(&self.turns).leave(who);
        self.turned.notify_all();
    }

    /// Waits for `who`'s turn to launch a kernel (at most [`MAX_WAIT`]);
    /// the caller then launches it and hands it to [`Self::push`], or
    /// gives the turn back with [`Self::release_turn`].
    pub fn take_turn(&self, who: Who) {
        let mut t = lock(&self.turns);
        let asked = Instant::now();
        t.wait(who, asked);
        loop {
            let now = Instant::now();
            if t.may_start(who, now) {
                break;
            }
            let waited = now.saturating_duration_since(asked);
            if waited >= MAX_WAIT {
                debug!(device = self.device, ?who, "no turn after {MAX_WAIT:?}: launching anyway");
                break;
            }
            // Groups turn idle by the clock alone: look again now and then.
            let nap = (MAX_WAIT - waited).min(Duration::from_millis(10));
            t = self.turned.wait_timeout(t, nap).map_or_else(|p| p.into_inner().0, |r| r.0);
        }
        t.start(who);
        drop(t);
        self.turned.notify_all();
    }

    /// The turn taken for a kernel that was not launched, or whose end
    /// cannot be watched, goes back uncharged.
    pub fn release_turn(&self, who: Who) {
        lock(&self.turns).end(who, Duration::ZERO, Instant::now());
        self.turned.notify_all();
    }

    /// Waits until the session counting `in_flight` is below [`MAX_IN_FLIGHT`].
    pub fn wait_room(&self, in_flight: &AtomicUsize) {
        let mut p = lock(&self.pending);
        while in_flight.load(Ordering::Acquire) >= MAX_IN_FLIGHT {
            p = self.finished.wait_timeout(p, Duration::from_millis(10)).map_or_else(|e| e.into_inner().0, |r| r.0);
        }
    }

    /// Watches a launched kernel until it ends.
    pub fn push(self: &Arc<Self>, e: Entry) {
        self.started.call_once(|| {
            let weak = Arc::downgrade(self);
            let spawned = std::thread::Builder::new()
                .name(format!("rgpu-watch-{}", self.device))
                .spawn(move || watch(weak));
            if let Err(err) = spawned {
                warn!(device = self.device, "cannot start the kernel watcher: {err}");
            }
        });
        e.in_flight.fetch_add(1, Ordering::AcqRel);
        lock(&self.pending).push(e);
        self.queued.notify_one();
    }

    /// Takes session `owner`'s entries out of the watch (those of context
    /// `ctx` only, if given), each charged what it ran if it has ended (the
    /// caller synchronised the context first) and nothing if it has not.
    /// After it, no thread holds an event or a context of theirs.
    pub fn purge(&self, owner: u64, ctx: Option<Raw<sys::CUcontext>>) {
        let _held = lock(&self.poll);
        let mine: Vec<Entry> = {
            let mut p = lock(&self.pending);
            let (mine, rest) = std::mem::take(&mut *p)
                .into_iter()
                .partition(|e| e.owner == owner && ctx.is_none_or(|c| c.0 == e.ctx.0));
            *p = rest;
            mine
        };
        let mut current = None;
        for e in mine {
            let took = match ended(&e, &mut current) {
                Ok(Some(t)) => Some(t),
                _ => None,
            };
            self.finish(e, took);
        }
    }

    /// One look at every kernel in flight; how many had ended.
    fn pass(&self) -> usize {
        let _held = lock(&self.poll);
        let taken = std::mem::take(&mut *lock(&self.pending));
        if taken.is_empty() {
            return 0;
        }
        let mut blocked: HashSet<(usize, usize)> = HashSet::new();
        let mut keep = Vec::with_capacity(taken.len());
        let mut done = Vec::new();
        let mut current = None;
        for e in taken {
            let stream = (e.ctx.0 as usize, e.stream.0 as usize);
            if blocked.contains(&stream) {
                keep.push(e);
                continue;
            }
            match ended(&e, &mut current) {
                Ok(Some(t)) => done.push((e, Some(t))),
                Ok(None) => {
                    blocked.insert(stream);
                    keep.push(e);
                }
                // A context broken by a faulting kernel: its kernels are over,
                // their time unknown.
                Err(err) => {
                    debug!(device = self.device, "kernel end unknown: {err}");
                    done.push((e, None));
                }
            }
        }
        {
            let mut p = lock(&self.pending);
            // Pushed while this pass ran: after the ones kept, in launch order.
            keep.append(&mut p);
            *p = keep;
        }
        let n = done.len();
        for (e, took) in done {
            self.finish(e, took);
        }
        if n > 0 {
            self.finished.notify_all();
        }
        n
    }

    fn finish(&self, e: Entry, took: Option<Duration>) {
        let t = took.unwrap_or_default();
        if let Some(who) = e.who {
            lock(&self.turns).end(who, t, Instant::now());
            self.turned.notify_all();
        }
        if let Some(timer) = &e.timer {
            timer(self.device, t);
        }
        if took.is_some() {
            lock(&e.spare).push(e.events);
        } else {
            for ev in e.events {
                let _ = cu!(sys::cuEventDestroy_v2(ev.0));
            }
        }
        e.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    fn contended(&self) -> bool {
        lock(&self.turns).anyone_waiting()
    }
}

/// The kernel's execution time if it has ended, None if not yet.
fn ended(e: &Entry, current: &mut Option<usize>) -> Result<Option<Duration>, CuError> {
    if *current != Some(e.ctx.0 as usize) {
        cu!(sys::cuCtxSetCurrent(e.ctx.0))?;
        *current = Some(e.ctx.0 as usize);
    }
    match cu!(sys::cuEventQuery(e.events[1].0)) {
        Ok(()) => {}
        Err(err) if err == CuError::NOT_READY => return Ok(None),
        Err(err) => return Err(err),
    }
    let mut ms = 0f32;
    cu!(sys::cuEventElapsedTime(&mut ms, e.events[0].0, e.events[1].0))?;
    Ok(Some(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3)))
}

/// The watcher's loop; it ends with the backend.
fn watch(weak: Weak<DeviceWatch>) {
    let mut nap = MIN_NAP;
    loop {
        let Some(w) = weak.upgrade() else { return };
        {
            let p = lock(&w.pending);
            if p.is_empty() {
                // Timed, so that a backend dropped meanwhile is noticed.
                let _ = w.queued.wait_timeout(p, Duration::from_millis(100));
                nap = MIN_NAP;
                continue;
            }
        }
        let ended = w.pass();
        nap = if ended > 0 || w.contended() { MIN_NAP } else { (nap * 2).min(MAX_NAP) };
        drop(w);
        std::thread::sleep(nap);
    }
}
