//! Device telemetry: what `deviceStatus` reports of each device's activity
//! and sensors ([`crate::backend::Backend::telemetry`]), and [`BusyMeter`],
//! which measures utilization as NVML defines it (the share of the last
//! sample period during which the device was busy).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// NVML's sample period for utilization is between 1/6 s and 1 s depending
/// on the product; the longer one gives steadier readings.
pub const SAMPLE_PERIOD: Duration = Duration::from_secs(1);

/// One reading and where it came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reading {
    /// The backend has no such reading, or the GPU does not support it.
    #[default]
    NotReported,
    /// Observed now (NVML on a real GPU, or the sim timing its own work).
    Measured(u32),
    /// A constant standing in for a sensor the device does not have (the sim's).
    Simulated(u32),
}

/// One device's activity and sensors now (whole device, all tenants).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceTelemetry {
    /// Percent of the last sample period during which a kernel ran.
    pub gpu_utilization: Reading,
    /// Percent of the last sample period during which device memory was read or written.
    pub memory_utilization: Reading,
    /// Degrees Celsius, the GPU die.
    pub temperature: Reading,
    /// Milliwatts the board draws.
    pub power_usage: Reading,
    /// Milliwatts, the enforced power limit.
    pub power_limit: Reading,
}

/// The meter keeps busy time per slice of this length: its memory stays
/// bounded however many kernels run, and its error is at most one slice
/// (1% of the period), where the oldest slice straddles the period's start.
const SLICE: Duration = Duration::from_millis(10);

/// Measures the share of time during which one or more units of work (a
/// device's kernels) were running: every piece of work holds a [`Busy`]
/// while it runs; overlapping pieces count once.
#[derive(Debug)]
pub struct BusyMeter {
    /// Slice 0 starts here.
    epoch: Instant,
    state: Mutex<BusyState>,
}

#[derive(Debug, Default)]
struct BusyState {
    /// Pieces of work running now.
    running: u32,
    /// When `running` last went from 0 to 1.
    since: Option<Instant>,
    /// Busy time of the past spans, per slice (its number since `epoch`),
    /// oldest first; only slices with busy time, and none older than the
    /// sample period.
    slices: VecDeque<(u64, Duration)>,
}

/// Held while a piece of work runs; dropping it ends the work (also when
/// the work panics).
#[derive(Debug)]
pub struct Busy(Arc<BusyMeter>);

impl BusyMeter {
    pub fn new() -> Arc<BusyMeter> {
        Arc::new(BusyMeter::starting(Instant::now()))
    }

    fn starting(epoch: Instant) -> BusyMeter {
        BusyMeter { epoch, state: Mutex::new(BusyState::default()) }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, BusyState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn slice_of(&self, t: Instant) -> u64 {
        (t.saturating_duration_since(self.epoch).as_nanos() / SLICE.as_nanos()) as u64
    }

    fn slice_start(&self, n: u64) -> Instant {
        self.epoch + Duration::from_nanos(SLICE.as_nanos() as u64 * n)
    }

    /// A piece of work starts now.
    pub fn enter(self: &Arc<Self>) -> Busy {
        self.enter_at(Instant::now());
        Busy(self.clone())
    }

    fn enter_at(&self, now: Instant) {
        let mut s = self.state();
        if s.running == 0 {
            s.since = Some(now);
        }
        s.running += 1;
    }

    fn leave_at(&self, now: Instant) {
        let mut s = self.state();
        s.running = s.running.saturating_sub(1);
        if s.running > 0 {
            return;
        }
        let Some(start) = s.since.take() else { return };
        // What lies before the period ending now will never be read.
        let start = start.max(now.checked_sub(SAMPLE_PERIOD + SLICE).unwrap_or(start));
        let mut n = self.slice_of(start);
        loop {
            let (a, b) = (self.slice_start(n), self.slice_start(n + 1));
            let busy = now.min(b).saturating_duration_since(start.max(a));
            if !busy.is_zero() {
                match s.slices.back_mut() {
                    Some((last, d)) if *last == n => *d += busy,
                    _ => s.slices.push_back((n, busy)),
                }
            }
            if b >= now {
                break;
            }
            n += 1;
        }
        self.prune(&mut s, now);
    }

    /// Drops the slices that ended before the sample period ending `now`.
    fn prune(&self, s: &mut BusyState, now: Instant) {
        let Some(from) = now.checked_sub(SAMPLE_PERIOD) else { return };
        let first = self.slice_of(from);
        while s.slices.front().is_some_and(|&(n, _)| n < first) {
            s.slices.pop_front();
        }
    }

    /// Percent (0 to 100) of the sample period ending now during which
    /// work ran.
    pub fn percent(&self) -> u32 {
        self.percent_at(Instant::now())
    }

    fn percent_at(&self, now: Instant) -> u32 {
        let mut s = self.state();
        self.prune(&mut s, now);
        // A meter younger than the period: the device was idle before.
        let from = now.checked_sub(SAMPLE_PERIOD).unwrap_or(self.epoch).max(self.epoch);
        let mut busy = 0.0;
        for &(n, d) in &s.slices {
            let (a, b) = (self.slice_start(n), self.slice_start(n + 1));
            // The slice straddling the period's start: its busy time taken as even across it.
            let inside = b.saturating_duration_since(from.max(a)).as_secs_f64() / SLICE.as_secs_f64();
            busy += d.as_secs_f64() * inside.min(1.0);
        }
        if let Some(since) = s.since {
            busy += now.saturating_duration_since(since.max(from)).as_secs_f64();
        }
        (busy / SAMPLE_PERIOD.as_secs_f64() * 100.0).round().clamp(0.0, 100.0) as u32
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.leave_at(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A meter whose clock is read at `t0` and after (as though it started 5 s before).
    fn meter() -> (BusyMeter, Instant) {
        let epoch = Instant::now();
        (BusyMeter::starting(epoch), epoch + ms(5000))
    }

    #[test]
    fn idle_is_zero_and_always_busy_is_a_hundred() {
        let (m, t0) = meter();
        assert_eq!(m.percent_at(t0), 0);
        m.enter_at(t0);
        assert_eq!(m.percent_at(t0 + ms(1500)), 100, "busy the whole period");
        assert_eq!(m.percent_at(t0 + ms(250)), 25, "busy the last quarter of it");
        m.leave_at(t0 + ms(1500));
        assert_eq!(m.percent_at(t0 + ms(1500)), 100);
        assert_eq!(m.percent_at(t0 + ms(2000)), 50, "the busy half slides out");
        assert_eq!(m.percent_at(t0 + ms(2600)), 0, "a period after the work ended");
    }

    #[test]
    fn overlapping_work_counts_once() {
        let (m, t0) = meter();
        m.enter_at(t0);
        m.enter_at(t0 + ms(100));
        m.leave_at(t0 + ms(300));
        m.leave_at(t0 + ms(400));
        // Two spans, busy [0, 400) and [600, 700): 500 ms of the period [0, 1000).
        m.enter_at(t0 + ms(600));
        m.leave_at(t0 + ms(700));
        assert_eq!(m.percent_at(t0 + ms(1000)), 50);
    }

    #[test]
    fn many_tiny_spans_stay_bounded_and_count() {
        let (m, t0) = meter();
        // 10 000 spans of 50 us every 100 us: half the time busy.
        for i in 0..10_000u64 {
            let at = t0 + Duration::from_micros(i * 100);
            m.enter_at(at);
            m.leave_at(at + Duration::from_micros(50));
        }
        assert!(m.state().slices.len() <= 102, "{} slices kept", m.state().slices.len());
        let p = m.percent_at(t0 + ms(1000));
        assert!((49..=52).contains(&p), "{p}% for half the time busy");
    }

    #[test]
    fn a_guard_ends_its_work_when_dropped() {
        let m = BusyMeter::new();
        let b = m.enter();
        assert_eq!(m.state().running, 1);
        drop(b);
        assert_eq!(m.state().running, 0);
        assert!(m.state().since.is_none());
    }
}
