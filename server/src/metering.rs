//! What each session uses, counted as it serves: kernels and their time,
//! bytes each way on its data connection, device memory now and at its
//! high-water mark. The session's thread counts into its [`SessionMeter`]
//! with relaxed atomics (one owner writes; readers want a recent value, not
//! a consistent cut); the server-wide Prometheus counters
//! ([`crate::metrics::ServerMetrics`]) are fed at the same points, and the
//! scrape and the broker agent read the live meters through [`Meters`].
//!
//! Kernel time is each kernel's execution time as the backend reports it
//! when the kernel ends ([`crate::backend::BackendSession::time_kernels`]:
//! the sim's executor, from its worker threads; the cuda backend's
//! per-device watcher, from the kernel's timing events). Where a backend
//! cannot ([`crate::backend::Backend::kernel_times_known`] false), kernels
//! are counted as they are launched and their time is reported as unknown,
//! never as the time a launch took to queue.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;

use crate::metrics::ServerMetrics;

/// One session's counters.
pub struct SessionMeter {
    /// The lease the session was admitted by, if any.
    pub lease: Option<u64>,
    /// Whether kernel times are execution times (see the module doc).
    pub timed: bool,
    server: Arc<ServerMetrics>,
    kernels: AtomicU64,
    kernel_ns: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    /// Bytes of client allocations now, by device ordinal.
    memory: Vec<AtomicU64>,
    memory_peak: AtomicU64,
    /// This session's transport's server-wide byte counters (in, out), once known.
    wire: OnceLock<(Counter, Counter)>,
}

/// A copy of a meter's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub kernels: u64,
    /// Sum of kernel times, ns; None where the backend cannot time them.
    pub kernel_ns: Option<u64>,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub memory: u64,
    pub memory_peak: u64,
}

impl Usage {
    /// Nothing used yet; `timed`: by a backend whose kernel times are known.
    pub fn zero(timed: bool) -> Usage {
        Usage { kernel_ns: timed.then_some(0), ..Usage::default() }
    }

    /// Adds `o` (another session of the same lease): sums, except the
    /// memory peak, which is the larger one. The lease's true peak lies
    /// between this and the sum of peaks; this is the lower bound.
    pub fn add(&mut self, o: &Usage) {
        self.kernels += o.kernels;
        self.kernel_ns = match (self.kernel_ns, o.kernel_ns) {
            (Some(a), Some(b)) => Some(a + b),
            _ => None,
        };
        self.bytes_in += o.bytes_in;
        self.bytes_out += o.bytes_out;
        self.memory += o.memory;
        self.memory_peak = self.memory_peak.max(o.memory_peak).max(self.memory);
    }
}

impl SessionMeter {
    pub fn new(server: Arc<ServerMetrics>, devices: usize, lease: Option<u64>, timed: bool) -> Self {
        SessionMeter {
            lease,
            timed,
            server,
            kernels: AtomicU64::new(0),
            kernel_ns: AtomicU64::new(0),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            memory: (0..devices).map(|_| AtomicU64::new(0)).collect(),
            memory_peak: AtomicU64::new(0),
            wire: OnceLock::new(),
        }
    }

    /// A meter that feeds a metric set of its own (tests, and sessions
    /// built without a service).
    pub fn detached(devices: usize) -> Self {
        SessionMeter::new(Arc::new(ServerMetrics::new(&[])), devices, None, false)
    }

    /// Names the session's data transport ("tcp", "rdma").
    pub fn set_transport(&self, kind: &'static str) {
        let _ = self.wire.set(self.server.wire(kind));
    }

    pub fn received(&self, n: u64) {
        self.bytes_in.fetch_add(n, Relaxed);
        if let Some((i, _)) = self.wire.get() {
            i.inc_by(n);
        }
    }

    pub fn sent(&self, n: u64) {
        self.bytes_out.fetch_add(n, Relaxed);
        if let Some((_, o)) = self.wire.get() {
            o.inc_by(n);
        }
    }

    /// One request served: its message name, time and result code.
    pub fn request(&self, call: &'static str, took: Duration, code: u32) {
        self.server.request(call, took, code);
    }

    /// A kernel launched on `device`, whose launch call took `took`.
    pub fn kernel(&self, device: u32, took: Duration) {
        self.kernels.fetch_add(1, Relaxed);
        let busy = self.timed.then_some(took);
        if let Some(t) = busy {
            self.kernel_ns.fetch_add(t.as_nanos().min(u64::MAX as u128) as u64, Relaxed);
        }
        self.server.kernel(device, busy);
    }

    /// `size` bytes allocated on `device`.
    pub fn alloc(&self, device: u32, size: u64) {
        if let Some(m) = self.memory.get(device as usize) {
            m.fetch_add(size, Relaxed);
        }
        self.memory_peak.fetch_max(self.memory_now(), Relaxed);
    }

    /// `size` bytes freed on `device`.
    pub fn free(&self, device: u32, size: u64) {
        if let Some(m) = self.memory.get(device as usize) {
            // Saturating: a free is only counted for an allocation counted.
            let _ = m.fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(size)));
        }
    }

    fn memory_now(&self) -> u64 {
        self.memory.iter().map(|m| m.load(Relaxed)).sum()
    }

    /// Bytes allocated now on `device`.
    pub fn memory_on(&self, device: u32) -> u64 {
        self.memory.get(device as usize).map_or(0, |m| m.load(Relaxed))
    }

    pub fn usage(&self) -> Usage {
        Usage {
            kernels: self.kernels.load(Relaxed),
            kernel_ns: self.timed.then(|| self.kernel_ns.load(Relaxed)),
            bytes_in: self.bytes_in.load(Relaxed),
            bytes_out: self.bytes_out.load(Relaxed),
            memory: self.memory_now(),
            memory_peak: self.memory_peak.load(Relaxed),
        }
    }
}

/// Bytes/s each way between two readings of the server's byte totals
/// ([`Meters::total`], which only grow): the traffic heartbeats report.
#[derive(Debug, Default)]
pub struct LinkRate {
    last: Option<(Instant, u64, u64)>,
}

impl LinkRate {
    /// The rate since the last reading; None on the first (or when no time
    /// passed).
    pub fn sample(&mut self, now: Instant, bytes_in: u64, bytes_out: u64) -> Option<(u64, u64)> {
        let (then, i, o) = self.last.replace((now, bytes_in, bytes_out))?;
        let dt = now.checked_duration_since(then)?.as_secs_f64();
        if dt <= 0.0 {
            return None;
        }
        let per_s = |now: u64, then: u64| (now.saturating_sub(then) as f64 / dt) as u64;
        Some((per_s(bytes_in, i), per_s(bytes_out, o)))
    }
}

/// The live sessions' meters, and what ended sessions of each lease used,
/// so that a lease's totals survive its sessions.
#[derive(Default)]
pub struct Meters {
    inner: Mutex<MetersInner>,
}

#[derive(Default)]
struct MetersInner {
    live: HashMap<u64, Arc<SessionMeter>>,
    /// Lease -> what its ended sessions used (their memory now is 0).
    ended: HashMap<u64, Usage>,
    /// What every ended session used, leased or not.
    all_ended: Option<Usage>,
}

impl Meters {
    fn lock(&self) -> std::sync::MutexGuard<'_, MetersInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn insert(&self, session: u64, meter: Arc<SessionMeter>) {
        self.lock().live.insert(session, meter);
    }

    /// The session ended: its lease keeps what it used.
    pub fn remove(&self, session: u64) {
        let mut inner = self.lock();
        if let Some(m) = inner.live.remove(&session) {
            let mut u = m.usage();
            u.memory = 0;
            if let Some(lease) = m.lease {
                inner.ended.entry(lease).or_insert_with(|| Usage::zero(m.timed)).add(&u);
            }
            inner.all_ended.get_or_insert_with(|| Usage::zero(m.timed)).add(&u);
        }
    }

    /// What live session `session` used so far.
    pub fn of(&self, session: u64) -> Option<Usage> {
        self.lock().live.get(&session).map(|m| m.usage())
    }

    /// Every live meter.
    pub fn live(&self) -> Vec<Arc<SessionMeter>> {
        self.lock().live.values().cloned().collect()
    }

    /// Every live meter with its session's id.
    pub fn live_by_session(&self) -> Vec<(u64, Arc<SessionMeter>)> {
        self.lock().live.iter().map(|(&id, m)| (id, m.clone())).collect()
    }

    /// Each lease's use on this server so far, ended sessions included.
    pub fn by_lease(&self) -> HashMap<u64, Usage> {
        let inner = self.lock();
        let mut out = inner.ended.clone();
        for m in inner.live.values() {
            if let Some(l) = m.lease {
                out.entry(l).or_insert_with(|| Usage::zero(m.timed)).add(&m.usage());
            }
        }
        out
    }

    /// What all sessions used since the server started; `timed`: whether
    /// this server's backend times kernels.
    pub fn total(&self, timed: bool) -> Usage {
        let inner = self.lock();
        let mut out = inner.all_ended.unwrap_or_else(|| Usage::zero(timed));
        for m in inner.live.values() {
            out.add(&m.usage());
        }
        out
    }

    /// Forgets the ended sessions' totals of leases not in `live` (the
    /// broker has the last report of them).
    pub fn retain_leases(&self, live: impl Fn(u64) -> bool) {
        self.lock().ended.retain(|l, _| live(*l));
    }

    /// Client allocations on `device` now, all sessions.
    pub fn memory_on(&self, device: u32) -> u64 {
        self.lock().live.values().map(|m| m.memory_on(device)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_rate_is_bytes_per_second_between_readings() {
        let mut r = LinkRate::default();
        let t = Instant::now();
        assert_eq!(r.sample(t, 1000, 0), None, "no interval yet");
        assert_eq!(r.sample(t + Duration::from_millis(500), 6000, 250), Some((10_000, 500)));
        assert_eq!(r.sample(t + Duration::from_millis(1500), 6000, 250), Some((0, 0)), "idle");
        assert_eq!(r.sample(t + Duration::from_millis(1500), 9000, 250), None, "no time passed");
    }

    #[test]
    fn a_lease_keeps_what_its_ended_sessions_used() {
        let server = Arc::new(ServerMetrics::new(&[]));
        let meters = Meters::default();
        let a = Arc::new(SessionMeter::new(server.clone(), 2, Some(7), true));
        let b = Arc::new(SessionMeter::new(server.clone(), 2, Some(7), true));
        meters.insert(1, a.clone());
        meters.insert(2, b.clone());
        a.alloc(0, 100);
        a.alloc(1, 50);
        a.free(0, 100);
        a.kernel(0, Duration::from_millis(3));
        a.received(10);
        b.kernel(1, Duration::from_millis(2));
        b.alloc(1, 30);
        b.sent(5);
        assert_eq!(meters.memory_on(1), 80);
        meters.remove(1);
        assert_eq!(meters.memory_on(1), 30);
        let u = meters.by_lease()[&7];
        assert_eq!((u.kernels, u.kernel_ns, u.bytes_in, u.bytes_out), (2, Some(5_000_000), 10, 5));
        assert_eq!((u.memory, u.memory_peak), (30, 150));
        let t = meters.total(true);
        assert_eq!((t.kernels, t.bytes_in, t.memory), (2, 10, 30));
        meters.retain_leases(|_| false);
        assert_eq!(meters.by_lease()[&7].kernels, 1, "the live session still counts");
        meters.remove(2);
        assert_eq!(meters.total(true).kernels, 2, "the server's total keeps ended sessions");
    }

    #[test]
    fn untimed_backends_report_no_kernel_time() {
        let m = SessionMeter::detached(1);
        m.kernel(0, Duration::from_secs(1));
        assert_eq!((m.usage().kernels, m.usage().kernel_ns), (1, None));
        // A free of more than counted cannot wrap.
        m.free(0, 5);
        m.free(9, 5);
        assert_eq!(m.usage().memory, 0);
    }
}
