//! Compute shares on a real GPU: whose kernel the device runs next when
//! fractional leases compete for it.
//!
//! A GPU cannot be told to give a context 30% of its time, and it does not
//! preempt a kernel for a fairer one. What the server does control is when
//! it hands a kernel to the driver. While two or more groups (the sessions
//! of one lease, together) compete for a device, a group's kernel is handed
//! over only when the device has no other kernel of a sharing group running
//! ([`DEPTH`]) and the group is first in line: the waiting group with the
//! smallest virtual time, which advances by each kernel's execution time
//! (measured by events, [`super::watch`]) divided by the group's weight.
//! That is weighted fair queueing on kernel time, as the sim does it on
//! block time (`sim/share.rs`); the granularity is one kernel. A group
//! alone on the device, or idle, costs the others nothing: it launches
//! without waiting and its queued kernels run back to back.
//!
//! Only what one group owes another is kept: a group idle for longer than
//! [`FORGET_AFTER`] rejoins at the smallest virtual time of the groups
//! still live, so idle time is not banked to starve the others later.
//!
//! Pure state: every method takes the time it is called at, so the policy
//! is tested without a GPU or a clock (the tests below).

use std::collections::HashMap;
use std::time::{Duration, Instant};

pub use crate::backend::fair::{Who, FORGET_AFTER, WHOLE};

/// Kernels of sharing groups the device may hold at once while they
/// compete. One: a GPU time-slices the contexts of different processes, so
/// two tenants' kernels never truly overlap, and a second queued kernel
/// would start before the policy had seen the first one's cost.
pub const DEPTH: usize = 1;

/// The longest a kernel waits for its turn before it is launched anyway: a
/// tenant whose kernel never ends may slow the others, never stop them.
pub const MAX_WAIT: Duration = Duration::from_secs(1);

#[derive(Debug)]
struct Group {
    weight: u16,
    /// Device nanoseconds per unit of weight, charged so far.
    vtime: f64,
    running: usize,
    waiting: usize,
    /// When it last had a kernel end or wait (live until FORGET_AFTER
    /// past it); None before its first kernel.
    last: Option<Instant>,
    /// Sessions of the group.
    handles: usize,
}

impl Group {
    fn busy(&self) -> bool {
        self.running + self.waiting > 0
    }

    fn live(&self, now: Instant) -> bool {
        self.busy() || self.last.is_some_and(|t| now.saturating_duration_since(t) < FORGET_AFTER)
    }
}

/// The sharing groups of one device and the kernels they have on it.
#[derive(Debug, Default)]
pub struct Turns {
    groups: HashMap<Who, Group>,
    /// Kernels of sharing groups queued on the device and not yet ended.
    running: usize,
    /// The smallest virtual time of the live groups, as of the last kernel
    /// that ended (never going back): where a group joins or rejoins.
    floor: f64,
}

impl Turns {
    /// A session of `who` joins with `weight` thousandths of a GPU (0 or
    /// more than [`WHOLE`]: a whole one); the last weight given wins.
    pub fn join(&mut self, who: Who, weight: u16) {
        let weight = if weight == 0 { WHOLE } else { weight.min(WHOLE) };
        let g = self.groups.entry(who).or_insert(Group { weight, vtime: 0.0, running: 0, waiting: 0, last: None, handles: 0 });
        g.weight = weight;
        g.handles += 1;
    }

    /// A session of `who` is gone (its kernels already ended or purged).
    pub fn leave(&mut self, who: Who) {
        if let Some(g) = self.groups.get_mut(&who) {
            g.handles = g.handles.saturating_sub(1);
            if g.handles == 0 && !g.busy() {
                self.groups.remove(&who);
            }
        }
    }

    /// A kernel of `who` asks for its turn. A group that was not live
    /// starts no earlier than the floor (see the module doc).
    pub fn wait(&mut self, who: Who, now: Instant) {
        let floor = self.floor;
        let Some(g) = self.groups.get_mut(&who) else { return };
        if !g.live(now) {
            g.vtime = g.vtime.max(floor);
        }
        g.waiting += 1;
        g.last = Some(now);
    }

    /// Whether the waiting kernel of `who` may be launched now.
    pub fn may_start(&self, who: Who, now: Instant) -> bool {
        let Some(me) = self.groups.get(&who) else { return true };
        let others = self.groups.iter().filter(|(id, _)| **id != who);
        if !others.clone().any(|(_, g)| g.live(now)) {
            return true;
        }
        self.running < DEPTH && others.filter(|(_, g)| g.waiting > 0).all(|(id, g)| (me.vtime, who) < (g.vtime, *id))
    }

    /// The waiting kernel of `who` is launched (its turn, or [`MAX_WAIT`]
    /// passed).
    pub fn start(&mut self, who: Who) {
        if let Some(g) = self.groups.get_mut(&who) {
            g.waiting = g.waiting.saturating_sub(1);
            g.running += 1;
            self.running += 1;
        }
    }

    /// A started kernel of `who` ended after `took` of device time (zero
    /// for one whose launch failed or whose time cannot be known).
    pub fn end(&mut self, who: Who, took: Duration, now: Instant) {
        let Some(g) = self.groups.get_mut(&who) else { return };
        if g.running == 0 {
            return;
        }
        g.running -= 1;
        self.running -= 1;
        g.vtime += took.as_nanos() as f64 / g.weight as f64;
        g.last = Some(now);
        if g.handles == 0 && !g.busy() {
            self.groups.remove(&who);
        }
        if let Some(low) = self.groups.values().filter(|g| g.live(now)).map(|g| g.vtime).reduce(f64::min) {
            self.floor = self.floor.max(low);
        }
    }

    /// Kernels of sharing groups on the device now.
    #[cfg(test)]
    pub fn running(&self) -> usize {
        self.running
    }

    /// Whether a kernel of some group is waiting for its turn.
    pub fn anyone_waiting(&self) -> bool {
        self.groups.values().any(|g| g.waiting > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Who = Who::Lease(1);
    const B: Who = Who::Lease(2);
    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_group_alone_never_waits_and_queues_as_deep_as_it_likes() {
        let t0 = Instant::now();
        let mut t = Turns::default();
        t.join(A, 300);
        for _ in 0..5 {
            t.wait(A, t0);
            assert!(t.may_start(A, t0));
            t.start(A);
        }
        assert_eq!(t.running(), 5);
    }

    #[test]
    fn competing_groups_take_turns_one_kernel_at_a_time_lowest_clock_first() {
        let t0 = Instant::now();
        let mut t = Turns::default();
        t.join(A, 500);
        t.join(B, 500);
        t.wait(A, t0);
        t.wait(B, t0);
        // Equal clocks: the lower id goes first, and only one at a time.
        assert!(t.may_start(A, t0));
        assert!(!t.may_start(B, t0));
        t.start(A);
        t.wait(A, t0);
        assert!(!t.may_start(A, t0), "the device holds a sharing kernel already");
        assert!(!t.may_start(B, t0));
        t.end(A, 10 * MS, t0);
        // A has been charged for its kernel: B is behind it now.
        assert!(t.may_start(B, t0));
        assert!(!t.may_start(A, t0));
    }

    /// Two groups keep a kernel waiting at all times; every kernel takes
    /// the same device time. The split of device time follows the weights.
    fn simulate(wa: u16, wb: u16, kernels: usize) -> (f64, f64) {
        let mut now = Instant::now();
        let mut t = Turns::default();
        t.join(A, wa);
        t.join(B, wb);
        t.wait(A, now);
        t.wait(B, now);
        let (mut ta, mut tb) = (0.0, 0.0);
        for _ in 0..kernels {
            let who = [A, B].into_iter().find(|&w| t.may_start(w, now)).expect("someone may start");
            t.start(who);
            now += 2 * MS;
            t.end(who, 2 * MS, now);
            t.wait(who, now);
            if who == A { ta += 2.0 } else { tb += 2.0 }
        }
        (ta, tb)
    }

    #[test]
    fn device_time_splits_by_weight() {
        let (a, b) = simulate(300, 700, 1000);
        let share = a / (a + b);
        assert!((share - 0.3).abs() < 0.01, "A got {share:.3} of the device, not 0.3");
        let (a, b) = simulate(500, 500, 1000);
        assert!((a / (a + b) - 0.5).abs() < 0.01);
    }

    #[test]
    fn an_idle_group_does_not_bank_its_idle_time() {
        let t0 = Instant::now();
        let mut t = Turns::default();
        t.join(A, 500);
        t.join(B, 500);
        // B runs alone for a long time while A is idle.
        let mut now = t0;
        for _ in 0..100 {
            t.wait(B, now);
            t.start(B);
            now += 10 * MS;
            t.end(B, 10 * MS, now);
        }
        now += FORGET_AFTER;
        // A comes back: it starts level with B, not a second ahead of it.
        t.wait(A, now);
        t.wait(B, now);
        let mut a_runs = 0;
        for _ in 0..10 {
            let who = [A, B].into_iter().find(|&w| t.may_start(w, now)).unwrap();
            t.start(who);
            now += MS;
            t.end(who, MS, now);
            t.wait(who, now);
            a_runs += usize::from(who == A);
        }
        assert!((4..=6).contains(&a_runs), "A ran {a_runs} of 10 kernels after rejoining");
    }

    #[test]
    fn a_short_pause_keeps_the_groups_place() {
        let mut now = Instant::now();
        let mut t = Turns::default();
        t.join(A, 500);
        t.join(B, 500);
        let run = |t: &mut Turns, who: Who, now: &mut Instant| {
            t.wait(who, *now);
            assert!(t.may_start(who, *now), "{who:?} should be next");
            t.start(who);
            *now += 10 * MS;
            t.end(who, 10 * MS, *now);
        };
        run(&mut t, A, &mut now);
        run(&mut t, B, &mut now);
        // A synchronises for 30 ms (less than FORGET_AFTER) while B runs on.
        for _ in 0..3 {
            run(&mut t, B, &mut now);
        }
        // A is owed those 30 ms: its next three kernels go before B's.
        t.wait(B, now);
        for _ in 0..3 {
            t.wait(A, now);
            assert!(t.may_start(A, now));
            assert!(!t.may_start(B, now));
            t.start(A);
            now += 10 * MS;
            t.end(A, 10 * MS, now);
        }
    }

    #[test]
    fn groups_leave_when_their_last_session_does() {
        let t0 = Instant::now();
        let mut t = Turns::default();
        t.join(A, 300);
        t.join(A, 300);
        t.join(B, 700);
        t.leave(A);
        t.leave(A);
        assert!(!t.groups.contains_key(&A));
        t.wait(B, t0);
        assert!(t.may_start(B, t0));
    }
}
