//! When to spin on the completion queue and when to sleep.
//!
//! Polling finds a completion within nanoseconds of its arrival but burns a
//! core; sleeping on a completion event costs an interrupt and a wake-up
//! (several microseconds) but nothing while idle. The policy spins for a
//! budget of polls, then arms the event and sleeps. The budget adapts: a
//! completion found while spinning doubles it (traffic is flowing and the
//! next one is likely close), a sleep halves it (the link went quiet).

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollConfig {
    pub min_spins: u32,
    pub max_spins: u32,
}

impl Default for PollConfig {
    fn default() -> Self {
        PollConfig { min_spins: 16, max_spins: 1 << 14 }
    }
}

#[derive(Debug, Clone)]
pub struct PollPolicy {
    cfg: PollConfig,
    spins: u32,
    pub spin_hits: u64,
    pub sleeps: u64,
}

impl PollPolicy {
    pub fn new(cfg: PollConfig) -> PollPolicy {
        let min = cfg.min_spins.max(1);
        let cfg = PollConfig { min_spins: min, max_spins: cfg.max_spins.max(min) };
        PollPolicy { cfg, spins: cfg.min_spins, spin_hits: 0, sleeps: 0 }
    }

    /// How many polls to try before sleeping.
    pub fn budget(&self) -> u32 {
        self.spins
    }

    /// A completion turned up while spinning.
    pub fn hit(&mut self) {
        self.spin_hits += 1;
        self.spins = self.spins.saturating_mul(2).min(self.cfg.max_spins);
    }

    /// Spinning found nothing; we slept.
    pub fn slept(&mut self) {
        self.sleeps += 1;
        self.spins = (self.spins / 2).max(self.cfg.min_spins);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_grows_on_hits_and_shrinks_on_sleeps() {
        let mut p = PollPolicy::new(PollConfig { min_spins: 4, max_spins: 32 });
        assert_eq!(p.budget(), 4);
        for _ in 0..10 {
            p.hit();
        }
        assert_eq!(p.budget(), 32);
        p.slept();
        assert_eq!(p.budget(), 16);
        for _ in 0..10 {
            p.slept();
        }
        assert_eq!(p.budget(), 4);
        let p = PollPolicy::new(PollConfig { min_spins: 0, max_spins: 0 });
        assert_eq!(p.budget(), 1);
    }
}
