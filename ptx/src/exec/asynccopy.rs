//! `cp.async`, `cp.async.bulk` and the mbarrier object.
//!
//! The copies are performed when issued: an asynchronous copy may complete at any time
//! before the wait that covers it, so "at once" is one of the schedules a GPU may run,
//! and `commit_group` / `wait_group` / `wait_all` have nothing left to wait for.
//!
//! An mbarrier is 8 bytes of shared memory whose content is the sim's own (opaque to
//! programs, as on a GPU): bits 0..20 the pending arrivals of the current phase, 20..40
//! the expected arrivals, 40..63 the transaction count (signed), bit 63 the phase parity.
//! A phase completes when its pending arrivals and its transaction count are both zero;
//! then the parity flips and the pending count is reset to the expected count. The
//! state token `arrive` returns is the barrier's word before the arrival: its bit 63 is
//! the phase the arrival belonged to.

use super::*;

const COUNT_MASK: u64 = (1 << 20) - 1;
const TX_BITS: u32 = 23;

#[derive(Clone, Copy)]
struct State {
    pending: u64,
    expected: u64,
    tx: i64,
    phase: u64,
}

impl State {
    fn of(v: u64) -> State {
        let tx = ((v >> 40) & ((1 << TX_BITS) - 1)) as i64;
        let tx = (tx << (64 - TX_BITS)) >> (64 - TX_BITS);
        State { pending: v & COUNT_MASK, expected: (v >> 20) & COUNT_MASK, tx, phase: v >> 63 }
    }

    fn word(self) -> u64 {
        (self.pending & COUNT_MASK) | (self.expected & COUNT_MASK) << 20 | ((self.tx as u64) & ((1 << TX_BITS) - 1)) << 40 | (self.phase & 1) << 63
    }

    /// Completes the phase if nothing is pending.
    fn settle(mut self) -> State {
        if self.pending == 0 && self.tx == 0 {
            self.phase ^= 1;
            self.pending = self.expected;
        }
        self
    }
}

impl BlockRunner<'_> {
    /// The shared-memory offset of the mbarrier at `addr` in `sp`.
    fn mbar_at(sp: Space, addr: u64) -> Result<u64, Fault> {
        let (s, a) = Self::classify(sp, addr);
        if s != Space::Shared {
            return Err(Fault::IllegalAddress { addr, space: "shared (an mbarrier object)" });
        }
        if a % 8 != 0 {
            return Err(Fault::Misaligned { addr });
        }
        Ok(a)
    }

    fn mbar_update(&mut self, lane: usize, at: u64, f: impl FnOnce(State) -> State) -> Result<u64, Fault> {
        let old = self.load(&[], lane, Space::Shared, at, 8)?;
        self.store(&mut [], lane, Space::Shared, at, 8, f(State::of(old)).word())?;
        Ok(old)
    }

    // Out of line, as the matrix operations: `exec`'s hot path stays as it was.
    #[inline(never)]
    pub(super) fn mbar(&mut self, w: &mut Warp, m: u32, x: &Mbar) -> Result<(), (usize, Fault)> {
        let (av, bv) = (fetch(&w.regs, x.base), fetch(&w.regs, x.b));
        for lane in 0..LANES {
            if m >> lane & 1 == 0 {
                continue;
            }
            let b = bv[lane];
            let res = if let MbarOp::PendingCount = x.op {
                Some(State::of(b).pending)
            } else {
                let at = Self::mbar_at(x.sp, av[lane].wrapping_add(x.off as u64)).map_err(|f| (lane, f))?;
                let n = b & 0xffff_ffff;
                let upd = |s: &mut Self, f: &dyn Fn(State) -> State| s.mbar_update(lane, at, f).map_err(|f| (lane, f));
                match x.op {
                    MbarOp::Init => {
                        upd(self, &|_| State { pending: n, expected: n, tx: 0, phase: 0 })?;
                        None
                    }
                    MbarOp::Inval => {
                        upd(self, &|_| State::of(0))?;
                        None
                    }
                    MbarOp::Arrive { drop, tx } => {
                        let (count, txc) = if tx { (1, n as u32 as i32 as i64) } else { (n, 0) };
                        let old = upd(self, &|mut s| {
                            s.tx += txc;
                            if drop {
                                s.expected = s.expected.saturating_sub(count);
                            }
                            s.pending = s.pending.saturating_sub(count);
                            s.settle()
                        })?;
                        Some(old)
                    }
                    MbarOp::ExpectTx => {
                        upd(self, &|mut s| {
                            s.tx += n as u32 as i32 as i64;
                            s
                        })?;
                        None
                    }
                    MbarOp::CompleteTx => {
                        upd(self, &|mut s| {
                            s.tx -= n as u32 as i32 as i64;
                            s.settle()
                        })?;
                        None
                    }
                    MbarOp::CpAsyncArrive { noinc } => {
                        if noinc {
                            upd(self, &|mut s| {
                                s.pending = s.pending.saturating_sub(1);
                                s.settle()
                            })?;
                        }
                        None
                    }
                    MbarOp::Wait { .. } | MbarOp::PendingCount => None,
                }
            };
            if let (Some(d), Some(v)) = (x.d, res) {
                w.regs.set(d, lane, v);
            }
        }
        Ok(())
    }

    /// `test_wait` / `try_wait` for the lanes in `m`; whether every one of them saw its
    /// phase complete.
    #[inline(never)]
    pub(super) fn mbar_wait(&mut self, w: &mut Warp, m: u32, x: &Mbar) -> Result<bool, (usize, Fault)> {
        let MbarOp::Wait { parity } = x.op else { return Ok(true) };
        let (av, bv) = (fetch(&w.regs, x.base), fetch(&w.regs, x.b));
        let mut all = true;
        for lane in 0..LANES {
            if m >> lane & 1 == 0 {
                continue;
            }
            let at = Self::mbar_at(x.sp, av[lane].wrapping_add(x.off as u64)).map_err(|f| (lane, f))?;
            let now = State::of(self.load(&[], lane, Space::Shared, at, 8).map_err(|f| (lane, f))?).phase;
            // The phase waited for is done once the barrier's parity differs from it.
            let waited = if parity { bv[lane] & 1 } else { bv[lane] >> 63 };
            let done = now != waited;
            all &= done;
            if let Some(d) = x.d {
                w.regs.set(d, lane, done as u64);
            }
        }
        Ok(all)
    }

    #[inline(never)]
    pub(super) fn cp_async(&mut self, w: &mut Warp, m: u32, x: &CpAsync) -> Result<(), (usize, Fault)> {
        let (dv, sv, nv) = (fetch(&w.regs, x.dst), fetch(&w.regs, x.src), fetch(&w.regs, x.size));
        let srcn = x.src_size.map(|s| fetch(&w.regs, s));
        let ign = x.ignore.map(|(p, neg)| (fetch(&w.regs, p), neg));
        let mb = x.mbar.map(|(b, off)| (fetch(&w.regs, b), off));
        for lane in 0..LANES {
            if m >> lane & 1 == 0 {
                continue;
            }
            let size = nv[lane] & 0xffff_ffff;
            let dst = dv[lane].wrapping_add(x.doff as u64);
            let src = sv[lane].wrapping_add(x.soff as u64);
            let bulk = x.mbar.is_some() || x.dst_sp == Space::Global;
            let align = if bulk { 16 } else { size };
            if bulk && size % 16 != 0 {
                return Err((lane, Fault::Misaligned { addr: dst.wrapping_add(size) }));
            }
            if dst % align != 0 || src % align != 0 {
                return Err((lane, Fault::Misaligned { addr: if dst % align != 0 { dst } else { src } }));
            }
            // One side is shared memory: bounded by it, checked before anything is copied.
            let (sh, _) = if x.dst_sp == Space::Shared { (dst, src) } else { (src, dst) };
            let sh = sh & 0xffff_ffff;
            if sh.checked_add(size).is_none_or(|e| e > self.shared.len() as u64) {
                return Err((lane, Fault::IllegalAddress { addr: SHARED_WINDOW + sh, space: "shared" }));
            }
            let ignored = ign.as_ref().is_some_and(|(p, neg)| (p[lane] != 0) ^ neg);
            let from_src = if ignored { 0 } else { srcn.as_ref().map_or(size, |s| (s[lane] & 0xffff_ffff).min(size)) };
            for k in 0..size {
                let v = if k < from_src { self.load(&w.local, lane, x.src_sp, src + k, 1).map_err(|f| (lane, f))? } else { 0 };
                self.store(&mut w.local, lane, x.dst_sp, dst + k, 1, v).map_err(|f| (lane, f))?;
            }
            if let Some((b, off)) = &mb {
                let at = Self::mbar_at(Space::Shared, b[lane].wrapping_add(*off as u64)).map_err(|f| (lane, f))?;
                self.mbar_update(lane, at, |mut s| {
                    s.tx -= size as i64;
                    s.settle()
                })
                .map_err(|f| (lane, f))?;
            }
        }
        Ok(())
    }
}
