//! The interpreter: a grid's blocks run in parallel on host threads; in a
//! block, each warp runs its 32 lanes together, one pre-decoded
//! instruction at a time over all active lanes (SIMT).
//!
//! Divergence and reconvergence follow the minimum-PC rule: a warp always
//! executes the group of live lanes whose program counter is smallest.
//! Lanes that branch forward wait until the others catch up, which makes
//! them reconverge at the first common instruction of structured code
//! (nvcc's layout puts a branch's join point after both sides), so
//! warp-collective instructions (`shfl`, `vote`, `match`) see the lanes the
//! program expects. `bar.sync` counts threads: lanes that reach it wait
//! while the warp's other live lanes run on (a lane on a path laid out
//! after the barrier, as LLVM places loops out of line, may be on its way to
//! the same barrier), and a warp waits once all its live lanes do; the block
//! goes on when every live warp waits. Warps of a block take turns on one host
//! thread, so shared memory needs no locking. Global memory is shared by
//! all host threads: plain accesses are relaxed atomic loads/stores of the
//! access size, atomics are compare-and-swap loops.

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use crate::fault::{ExecError, Fault};
use crate::float::{self, ftz32};
use crate::ir::*;
use crate::printf;

mod asynccopy;
mod compiled;
#[cfg(test)]
pub(crate) use compiled::testing as compiled_testing;
mod matrix;

pub use compiled::Compiled;

/// A live allocation of device memory, as the host sees it.
#[derive(Debug, Clone, Copy)]
pub struct Region {
    /// Device address of its first byte.
    pub start: u64,
    pub len: u64,
    /// Host address of its first byte.
    pub host: *mut u8,
}

/// The device memory a kernel can reach.
///
/// # Safety
/// A returned region's `host` must be valid for reads and writes of `len`
/// bytes for as long as the launch runs, possibly from several threads at
/// once (the interpreter only uses atomic accesses on it).
pub unsafe trait GlobalMemory: Sync {
    /// The allocation containing device address `addr`, if any.
    fn region(&self, addr: u64) -> Option<Region>;
}

/// Bits 48..55 of a device pointer carry the client's server tag
/// (see the shim's pointer translation); the device address is the rest.
pub const TAG_MASK: u64 = 0x00ff_0000_0000_0000;

#[derive(Debug, Clone)]
pub struct LaunchConfig {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub dyn_shared: u32,
    /// Host threads to run blocks on (at least 1).
    pub workers: usize,
    /// Wall-clock limit for the whole launch.
    pub time_limit: Duration,
    /// Most bytes of printf output kept (CUDA's default FIFO is 1 MiB).
    pub printf_limit: usize,
    /// Run straight-line code on the compiled tier ([`Compiled`]); false: every instruction
    /// on the interpreter, the reference the tier is tested against.
    pub compiled: bool,
}

#[derive(Debug, Default)]
pub struct LaunchOutput {
    /// Device printf output, blocks in order.
    pub printf: Vec<u8>,
    /// Instructions executed, counted per thread.
    pub thread_instructions: u64,
}

const LANES: usize = 32;

struct Warp {
    regs: Regs,
    local: Vec<u8>,
    pcs: [u32; LANES],
    alive: u32,
    at_bar: bool,
    /// Lanes that reached a barrier while other lanes of the warp, on another path, had not:
    /// they wait there while the others run on to a barrier (or exit), because `bar.sync`
    /// counts threads, not warps (a diverged lane may be on its way to the same barrier).
    bar_wait: u32,
    /// Lanes parked at a `.sync` warp operation (`Op::WarpSync`) until the other lanes of its
    /// member mask arrive at the same pc.
    sync_wait: u32,
    /// Lanes released from such a wait because nothing else in the warp could run (the missing
    /// members wait at a block barrier): they run the operation with the lanes that came.
    sync_force: u32,
    /// Divisions not yet healed, innermost last: (pc where the lanes meet again, the lanes the
    /// branch divided). A lane's innermost entry is the last one holding it.
    conv: Vec<(u32, u32)>,
    /// Lanes waiting at their innermost entry's meeting pc for the rest of its lanes.
    conv_wait: u32,
    /// bar.red in flight: (op, dst, lanes waiting, lanes whose predicate held).
    bar_red: Option<(BarRed, u32, u32, u32)>,
    first_thread: u32,
    /// Polling accesses (strong loads, atomics) since the warp last let others run, counted in
    /// cooperative launches only.
    polls: u32,
}

struct Shared<'a> {
    prog: &'a Program,
    cfg: &'a LaunchConfig,
    params: &'a [u8],
    mem: &'a dyn GlobalMemory,
    deadline: Instant,
    abort: AtomicBool,
    /// Raised by the caller to stop the launch (its session ended).
    cancel: &'a AtomicBool,
    start: Instant,
    /// A cooperative launch: every block is resident at once and a warp that keeps polling
    /// memory, or runs long, lets the others run (see [`launch_cooperative`]).
    coop: bool,
    /// `%envreg1`, `%envreg2`.
    env: [u64; 2],
}

impl Shared<'_> {
    /// Why the launch must stop now, if it must: checked between blocks and
    /// at every barrier round, so neither many short blocks nor a block
    /// looping over barriers outlives the time limit or a cancel.
    fn stop_now(&self) -> Option<Fault> {
        if self.cancel.load(Ordering::Relaxed) {
            Some(Fault::Cancelled)
        } else if self.abort.load(Ordering::Relaxed) {
            Some(Fault::Aborted)
        } else if Instant::now() > self.deadline {
            Some(Fault::Timeout)
        } else {
            None
        }
    }
}

/// Runs `prog` over the grid. `params` is the packed parameter buffer.
pub fn launch(prog: &Program, cfg: &LaunchConfig, params: &[u8], mem: &dyn GlobalMemory) -> Result<LaunchOutput, ExecError> {
    launch_cancellable(prog, cfg, params, mem, &AtomicBool::new(false))
}

/// As [`launch`], stopping with [`Fault::Cancelled`] soon after `cancel`
/// is raised (between blocks, at barriers, and every few thousand
/// instructions of a warp).
pub fn launch_cancellable(
    prog: &Program,
    cfg: &LaunchConfig,
    params: &[u8],
    mem: &dyn GlobalMemory,
    cancel: &AtomicBool,
) -> Result<LaunchOutput, ExecError> {
    launch_gated(prog, cfg, params, mem, cancel, &Ungated)
}

/// Who lets each block of a launch run: the caller's scheduler of the
/// host's cores among launches (compute shares).
pub trait BlockGate: Sync {
    /// Waits until a block may run; false if `stopped` turned true first.
    fn enter(&self, stopped: &dyn Fn() -> bool) -> bool;
    /// The block that entered on this thread has ended (the gate times it
    /// as it likes); with `another`, the same worker enters again at once
    /// (the launch has blocks left), so it keeps its launch's place in line
    /// across the handover.
    fn leave(&self, another: bool);
}

struct Ungated;

impl BlockGate for Ungated {
    fn enter(&self, _: &dyn Fn() -> bool) -> bool {
        true
    }
    fn leave(&self, _: bool) {}
}

/// As [`launch_cancellable`], each block running only once `gate` lets it.
pub fn launch_gated(
    prog: &Program,
    cfg: &LaunchConfig,
    params: &[u8],
    mem: &dyn GlobalMemory,
    cancel: &AtomicBool,
    gate: &dyn BlockGate,
) -> Result<LaunchOutput, ExecError> {
    run_grid(prog, cfg, params, mem, cancel, gate, false)
}

/// Polling accesses after which a warp of a cooperative launch lets the other warps and blocks
/// run: a spin loop (`grid.sync()` polls with `ld.acquire`) costs the others a few hundred
/// instructions per turn.
const POLLS_PER_TURN: u32 = 32;

/// Steps a warp of a cooperative launch runs before it lets the others run anyway (a spin loop
/// on plain loads, or long work between two polls).
const STEPS_PER_TURN: u32 = 0x4000;

/// Runs a cooperative grid (`cuLaunchCooperativeKernel`): as [`launch_gated`], with every block
/// resident at once, as a GPU guarantees for a grid that fits its occupancy (the caller bounds
/// the grid: every block's state is held for the whole launch). Each worker owns a fixed set of
/// blocks and takes them in turns: a block runs until one of its warps has polled memory
/// [`POLLS_PER_TURN`] times or run [`STEPS_PER_TURN`] steps, then the next block gets the
/// worker, so blocks waiting for each other (a grid-wide barrier, a flag) all make progress.
/// `%envreg1:%envreg2` hold the address of a zeroed grid-sync workspace
/// ([`GRID_SYNC_ADDR`]), where cooperative groups' `grid.sync()` keeps its barrier word. Each
/// turn enters `gate`, so compute shares hold; the time limit and `cancel` stop it as any launch.
pub fn launch_cooperative(
    prog: &Program,
    cfg: &LaunchConfig,
    params: &[u8],
    mem: &dyn GlobalMemory,
    cancel: &AtomicBool,
    gate: &dyn BlockGate,
) -> Result<LaunchOutput, ExecError> {
    let ws = GridSync { inner: mem, words: (0..GRID_SYNC_BYTES / 8).map(|_| AtomicU64::new(0)).collect() };
    run_grid(prog, cfg, params, &ws, cancel, gate, true)
}

/// A cooperative launch's memory: the session's, and the grid-sync workspace.
struct GridSync<'a> {
    inner: &'a dyn GlobalMemory,
    words: Box<[AtomicU64]>,
}

// SAFETY: the workspace lives as long as the launch (the value outlives `run_grid`'s workers)
// and is only accessed atomically; other regions are the inner memory's.
unsafe impl GlobalMemory for GridSync<'_> {
    fn region(&self, addr: u64) -> Option<Region> {
        if addr.wrapping_sub(GRID_SYNC_ADDR) < GRID_SYNC_BYTES {
            return Some(Region { start: GRID_SYNC_ADDR, len: GRID_SYNC_BYTES, host: self.words.as_ptr() as *mut u8 });
        }
        self.inner.region(addr)
    }
}

fn run_grid(
    prog: &Program,
    cfg: &LaunchConfig,
    params: &[u8],
    mem: &dyn GlobalMemory,
    cancel: &AtomicBool,
    gate: &dyn BlockGate,
    coop: bool,
) -> Result<LaunchOutput, ExecError> {
    let nblocks = cfg.grid.iter().map(|&g| g as u64).product::<u64>();
    let start = Instant::now();
    let env = if coop { [GRID_SYNC_ADDR >> 32, GRID_SYNC_ADDR & 0xffff_ffff] } else { [0, 0] };
    let sh = Shared { prog, cfg, params, mem, deadline: start + cfg.time_limit, abort: AtomicBool::new(false), cancel, start, coop, env };
    let next = AtomicUsize::new(0);
    let outputs: Mutex<Vec<(u64, Vec<u8>)>> = Mutex::new(Vec::new());
    let first_err: Mutex<Option<ExecError>> = Mutex::new(None);
    let count = AtomicU64::new(0);
    let workers = cfg.workers.max(1).min(nblocks.max(1) as usize);
    let fail = |e: ExecError| {
        sh.abort.store(true, Ordering::Relaxed);
        let mut f = first_err.lock().unwrap_or_else(|p| p.into_inner());
        // A real fault wins over the blocks it stopped.
        if f.as_ref().is_none_or(|x| x.fault == Fault::Aborted) {
            *f = Some(e);
        }
    };
    let ctaid_of = |b: u64| {
        let g = cfg.grid;
        [(b % g[0] as u64) as u32, (b / g[0] as u64 % g[1] as u64) as u32, (b / (g[0] as u64 * g[1] as u64)) as u32]
    };
    // Cooperative: worker `wi` owns blocks wi, wi + workers, ... and runs them in turns.
    let coop_work = |wi: usize| {
        let mut blocks: Vec<(u64, BlockRunner, Vec<u8>)> = (wi as u64..nblocks)
            .step_by(workers)
            .map(|b| {
                let mut r = BlockRunner::new(&sh);
                r.start(ctaid_of(b));
                (b, r, Vec::new())
            })
            .collect();
        let (mut k, mut n, mut promised) = (0usize, 0u64, false);
        while !blocks.is_empty() && (promised || !sh.abort.load(Ordering::Relaxed)) {
            k %= blocks.len();
            let ctaid = ctaid_of(blocks[k].0);
            let entered = gate.enter(&|| sh.stop_now().is_some());
            let stop = sh.stop_now().or((!entered).then_some(Fault::Aborted));
            let ran = match stop {
                Some(fault) => Err(ExecError { kernel: prog.name.clone(), block: ctaid, thread: [0; 3], line: 0, fault }),
                None => {
                    let (_, r, out) = &mut blocks[k];
                    r.resume(ctaid, out, &mut n)
                }
            };
            let finished = matches!(ran, Ok(true));
            let another = entered && ran.is_ok() && blocks.len() > finished as usize && !sh.abort.load(Ordering::Relaxed);
            if entered {
                gate.leave(another);
            }
            promised = another;
            match ran {
                Ok(true) => {
                    let (b, _, out) = blocks.remove(k);
                    if !out.is_empty() {
                        outputs.lock().unwrap_or_else(|p| p.into_inner()).push((b, out));
                    }
                }
                Ok(false) => k += 1,
                Err(e) => {
                    fail(e);
                    break;
                }
            }
        }
        count.fetch_add(n, Ordering::Relaxed);
    };
    let work = || {
        let mut blk = BlockRunner::new(&sh);
        let mut b = next.fetch_add(1, Ordering::Relaxed) as u64;
        // A worker that told the gate it comes back for another block must
        // (the gate holds its place in line for it).
        let mut promised = false;
        loop {
            if b >= nblocks || (!promised && sh.abort.load(Ordering::Relaxed)) {
                break;
            }
            let ctaid = ctaid_of(b);
            let mut out = Vec::new();
            let entered = gate.enter(&|| sh.stop_now().is_some());
            let stop = sh.stop_now().or((!entered).then_some(Fault::Aborted));
            let ran = match stop {
                // Given a core too late to use it: it goes back unused.
                Some(fault) => Err(ExecError { kernel: prog.name.clone(), block: ctaid, thread: [0; 3], line: 0, fault }),
                None => blk.run(ctaid, &mut out),
            };
            let following = next.fetch_add(1, Ordering::Relaxed) as u64;
            let another = entered && ran.is_ok() && following < nblocks && !sh.abort.load(Ordering::Relaxed);
            if entered {
                gate.leave(another);
            }
            promised = another;
            match ran {
                Ok(n) => {
                    count.fetch_add(n, Ordering::Relaxed);
                    if !out.is_empty() {
                        outputs.lock().unwrap_or_else(|p| p.into_inner()).push((b, out));
                    }
                }
                Err(e) => {
                    fail(e);
                    break;
                }
            }
            b = following;
        }
    };
    if workers == 1 {
        if coop {
            coop_work(0);
        } else {
            work();
        }
    } else {
        std::thread::scope(|s| {
            for wi in 0..workers {
                if coop {
                    let coop_work = &coop_work;
                    s.spawn(move || coop_work(wi));
                } else {
                    s.spawn(work);
                }
            }
        });
    }
    if let Some(e) = first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    let mut outs = outputs.into_inner().unwrap_or_else(|p| p.into_inner());
    outs.sort_by_key(|o| o.0);
    let mut printf = Vec::new();
    for (_, o) in outs {
        let room = cfg.printf_limit.saturating_sub(printf.len());
        printf.extend_from_slice(&o[..o.len().min(room)]);
    }
    Ok(LaunchOutput { printf, thread_instructions: count.into_inner() })
}

struct BlockRunner<'a> {
    sh: &'a Shared<'a>,
    warps: Vec<Warp>,
    shared: Vec<u8>,
    cache: Option<Region>,
}

enum Stop {
    Exited,
    Barrier,
    /// The warp waits on an mbarrier phase: the other warps get a turn before it goes on.
    Yield,
    /// A cooperative launch's warp has had its turn (it kept polling memory, or ran long):
    /// the other blocks get theirs before it goes on.
    Poll,
}

impl<'a> BlockRunner<'a> {
    fn new(sh: &'a Shared<'a>) -> Self {
        let p = sh.prog;
        let nthreads = sh.cfg.block.iter().product::<u32>() as usize;
        let nwarps = nthreads.div_ceil(LANES);
        let warps = (0..nwarps)
            .map(|w| Warp {
                regs: Regs::new(p),
                local: vec![0; p.local_size as usize * LANES],
                pcs: [0; LANES],
                alive: 0,
                at_bar: false,
                bar_wait: 0,
                sync_wait: 0,
                sync_force: 0,
                conv: Vec::new(),
                conv_wait: 0,
                bar_red: None,
                first_thread: (w * LANES) as u32,
                polls: 0,
            })
            .collect();
        let shared = vec![0; (p.dyn_shared_offset + sh.cfg.dyn_shared as u64).max(p.shared_static) as usize];
        BlockRunner { sh, warps, shared, cache: None }
    }

    fn run(&mut self, ctaid: [u32; 3], out: &mut Vec<u8>) -> Result<u64, ExecError> {
        self.start(ctaid);
        let mut count = 0u64;
        // Only a cooperative launch's warps stop for a turn; this one runs to the end.
        while !self.resume(ctaid, out, &mut count)? {}
        Ok(count)
    }

    /// Sets the block up to run block `ctaid` from its first instruction.
    fn start(&mut self, ctaid: [u32; 3]) {
        let cfg = self.sh.cfg;
        let nthreads = cfg.block.iter().product::<u32>();
        let nwarps = self.warps.len() as u32;
        self.shared.fill(0);
        for w in self.warps.iter_mut() {
            w.pcs = [0; LANES];
            let live = nthreads - w.first_thread;
            w.alive = if live >= 32 { u32::MAX } else { (1u32 << live) - 1 };
            w.at_bar = false;
            w.bar_wait = 0;
            w.sync_wait = 0;
            w.sync_force = 0;
            w.conv.clear();
            w.conv_wait = 0;
            w.bar_red = None;
            w.polls = 0;
            w.local.fill(0);
            let r = &mut w.regs;
            for l in 0..LANES {
                let t = w.first_thread + l as u32;
                let set = |r: &mut Regs, s: u32, v: u64| r.set(s, l, v);
                set(r, special::TID_X, (t % cfg.block[0]) as u64);
                set(r, special::TID_Y, (t / cfg.block[0] % cfg.block[1]) as u64);
                set(r, special::TID_Z, (t / (cfg.block[0] * cfg.block[1])) as u64);
                set(r, special::LANEID, l as u64);
                set(r, special::WARPID, (w.first_thread / 32) as u64);
                set(r, special::NWARPID, nwarps as u64);
                for k in 0..3 {
                    set(r, special::NTID_X + k, cfg.block[k as usize] as u64);
                    set(r, special::CTAID_X + k, ctaid[k as usize] as u64);
                    set(r, special::NCTAID_X + k, cfg.grid[k as usize] as u64);
                }
                let bit = 1u64 << l;
                set(r, special::LANEMASK_EQ, bit);
                set(r, special::LANEMASK_LT, bit - 1);
                set(r, special::LANEMASK_LE, (bit << 1).wrapping_sub(1) & 0xffff_ffff);
                set(r, special::LANEMASK_GT, !((bit << 1).wrapping_sub(1)) & 0xffff_ffff);
                set(r, special::LANEMASK_GE, !(bit - 1) & 0xffff_ffff);
                set(r, special::SMID, 0);
                set(r, special::NSMID, 132);
                set(r, special::GRIDID, 1);
                set(r, special::DYN_SMEM, cfg.dyn_shared as u64);
                set(r, special::TOTAL_SMEM, self.shared.len() as u64);
                set(r, special::ENVREG1, self.sh.env[0]);
                set(r, special::ENVREG2, self.sh.env[1]);
            }
        }
    }

    /// Runs the block until it ends (true) or, in a cooperative launch, until a round of its
    /// warps in which one had its turn (false: call again to go on); instructions are added
    /// to `count`.
    fn resume(&mut self, ctaid: [u32; 3], out: &mut Vec<u8>, count: &mut u64) -> Result<bool, ExecError> {
        loop {
            let mut live = false;
            let mut yielded = false;
            let mut turn_over = false;
            for wi in 0..self.warps.len() {
                if self.warps[wi].alive == 0 || self.warps[wi].at_bar {
                    live |= self.warps[wi].alive != 0;
                    continue;
                }
                live = true;
                let mut w = std::mem::replace(&mut self.warps[wi], empty_warp());
                let r = self.run_warp(&mut w, ctaid, out, count);
                self.warps[wi] = w;
                match r? {
                    Stop::Yield => yielded = true,
                    Stop::Poll => turn_over = true,
                    Stop::Exited | Stop::Barrier => {}
                }
            }
            if !live {
                return Ok(true);
            }
            if let Some(fault) = self.sh.stop_now() {
                let w = self.warps.iter().find(|w| w.alive != 0).unwrap_or(&self.warps[0]);
                let lane = w.alive.trailing_zeros() as usize % LANES;
                let line = self.sh.prog.insts.get(w.pcs[lane] as usize).map_or(0, |i| i.line);
                return Err(self.err(w, lane, line, ctaid, fault));
            }
            if turn_over {
                return Ok(false);
            }
            if yielded {
                // A warp is spinning on an mbarrier, not at the block barrier: another round.
                continue;
            }
            // Every live warp waits at a barrier: release them all.
            let (mut pop, mut all, mut any) = (0u32, true, false);
            for w in &self.warps {
                if let Some((_, _, waiting, yes)) = w.bar_red {
                    pop += yes.count_ones();
                    all &= yes == waiting;
                    any |= yes != 0;
                }
            }
            for w in self.warps.iter_mut() {
                if let Some((op, d, waiting, _)) = w.bar_red.take() {
                    let v = match op {
                        BarRed::Popc => pop as u64,
                        BarRed::And => all as u64,
                        BarRed::Or => any as u64,
                    };
                    for l in 0..LANES {
                        if waiting >> l & 1 != 0 {
                            w.regs.set(d, l, v);
                        }
                    }
                }
                w.at_bar = false;
                w.bar_wait = 0;
            }
        }
    }

    fn err(&self, w: &Warp, lane: usize, line: u32, ctaid: [u32; 3], fault: Fault) -> ExecError {
        let b = self.sh.cfg.block;
        let t = w.first_thread + lane as u32;
        ExecError { kernel: self.sh.prog.name.clone(), block: ctaid, thread: [t % b[0], t / b[0] % b[1], t / (b[0] * b[1])], line, fault }
    }

    fn run_warp(&mut self, w: &mut Warp, ctaid: [u32; 3], out: &mut Vec<u8>, count: &mut u64) -> Result<Stop, ExecError> {
        let insts = &self.sh.prog.insts;
        let (mut pc, mut mask, mut other) = next_group(w);
        let mut steps: u32 = 0;
        loop {
            steps = steps.wrapping_add(1);
            if steps & (STEPS_PER_TURN - 1) == 0 {
                if let Some(f) = self.sh.stop_now() {
                    return Err(self.err(w, mask.trailing_zeros() as usize, insts.get(pc as usize).map_or(0, |i| i.line), ctaid, f));
                }
                if self.sh.coop {
                    w.polls = POLLS_PER_TURN;
                }
            }
            if w.polls >= POLLS_PER_TURN {
                w.polls = 0;
                set_pcs(&mut w.pcs, mask, pc);
                return Ok(Stop::Poll);
            }
            if !w.conv.is_empty() && self.sh.prog.joins.get(pc as usize).copied().unwrap_or(false) {
                mask = arrive(w, pc, mask);
                if mask == 0 {
                    (pc, mask, other) = next_group(w);
                    continue;
                }
            }
            let Some(inst) = insts.get(pc as usize) else {
                // Ran off the end: only possible for malformed programs; exit.
                w.alive &= !mask;
                if w.alive == 0 {
                    return Ok(Stop::Exited);
                }
                if ready(w) == 0 {
                    w.at_bar = true;
                    return Ok(Stop::Barrier);
                }
                set_pcs(&mut w.pcs, mask, pc);
                (pc, mask, other) = next_group(w);
                continue;
            };
            if self.sh.cfg.compiled && self.sh.prog.compiled.run_end.get(pc as usize).is_some_and(|&e| e > pc) {
                let at = compiled::At { pc: &mut pc, steps: &mut steps, mask, other };
                if let Err((at, lane, f)) = self.run_compiled(w, at, out, count) {
                    return Err(self.err(w, lane, insts.get(at as usize).map_or(0, |i| i.line), ctaid, f));
                }
                if pc >= other {
                    set_pcs(&mut w.pcs, mask, pc);
                    (pc, mask, other) = next_group(w);
                }
                continue;
            }
            let mut active = mask;
            if let Some((g, neg)) = inst.guard {
                let p = pred_mask(&w.regs, g);
                active &= if neg { !p } else { p };
            }
            *count += active.count_ones() as u64;
            match &inst.op {
                Op::Bra { target } => {
                    let t = *target;
                    let stay = mask & !active;
                    if stay == 0 && t < other {
                        pc = t;
                        continue;
                    }
                    if active == 0 {
                        pc += 1;
                        if pc >= other {
                            set_pcs(&mut w.pcs, mask, pc);
                            (pc, mask, other) = next_group(w);
                        }
                        continue;
                    }
                    let meet = self.sh.prog.reconv.get(pc as usize).copied().unwrap_or(u32::MAX);
                    if meet != u32::MAX && w.conv.len() < MAX_DIVISIONS {
                        w.conv.push((meet, mask));
                    }
                    set_pcs(&mut w.pcs, active, t);
                    set_pcs(&mut w.pcs, stay, pc + 1);
                    (pc, mask, other) = next_group(w);
                    continue;
                }
                Op::Exit => {
                    w.alive &= !active;
                    if w.alive == 0 {
                        return Ok(Stop::Exited);
                    }
                    if ready(w) == 0 {
                        w.at_bar = true;
                        return Ok(Stop::Barrier);
                    }
                    mask &= !active;
                    if mask == 0 {
                        (pc, mask, other) = next_group(w);
                        continue;
                    }
                }
                Op::Bar { red } => {
                    if active != 0 {
                        set_pcs(&mut w.pcs, mask, pc + 1);
                        if let Some((op, d, p, neg)) = red {
                            let v = fetch(&w.regs, *p);
                            let mut yes = 0u32;
                            for (l, x) in v.iter().enumerate() {
                                if ((*x != 0) ^ neg) && active >> l & 1 != 0 {
                                    yes |= 1 << l;
                                }
                            }
                            let (waiting, held) = w.bar_red.map_or((0, 0), |(_, _, wt, y)| (wt, y));
                            w.bar_red = Some((*op, *d, waiting | active, held | yes));
                        }
                        w.bar_wait |= active;
                        if ready(w) == 0 {
                            w.at_bar = true;
                            return Ok(Stop::Barrier);
                        }
                        (pc, mask, other) = next_group(w);
                        continue;
                    }
                }
                Op::WarpSync { member } => {
                    // Not an instruction of the program: uncounted.
                    *count -= active.count_ones() as u64;
                    if active != 0 {
                        let member = first_lane(&w.regs, *member, active);
                        let here = w.sync_wait & lanes_at(&w.pcs, pc);
                        let arrived = active | here;
                        if member & w.alive & !arrived != 0 && w.sync_force & active == 0 {
                            w.sync_wait |= active;
                            set_pcs(&mut w.pcs, active, pc);
                            set_pcs(&mut w.pcs, mask & !active, pc + 1);
                            (pc, mask, other) = next_group(w);
                            continue;
                        }
                        // Everyone came (or no one else can): the lanes go on as one group.
                        w.sync_wait &= !here;
                        w.sync_force &= !arrived;
                        mask |= here;
                    }
                }
                Op::MbarWait(x) => {
                    if active != 0 {
                        match self.mbar_wait(w, active, x) {
                            Err((lane, f)) => return Err(self.err(w, lane, inst.line, ctaid, f)),
                            Ok(true) => {}
                            Ok(false) => {
                                set_pcs(&mut w.pcs, mask, pc + 1);
                                return Ok(Stop::Yield);
                            }
                        }
                    }
                }
                op => {
                    if active != 0 {
                        if let Err((lane, f)) = self.exec(w, op, active, out) {
                            return Err(self.err(w, lane, inst.line, ctaid, f));
                        }
                        if self.sh.coop && polls(op) {
                            w.polls += 1;
                        }
                    }
                }
            }
            pc += 1;
            if pc >= other {
                set_pcs(&mut w.pcs, mask, pc);
                (pc, mask, other) = next_group(w);
            }
        }
    }

    /// Executes a non-control instruction for the lanes in `m`.
    fn exec(&mut self, w: &mut Warp, op: &Op, m: u32, out: &mut Vec<u8>) -> Result<(), (usize, Fault)> {
        let regs = &mut w.regs;
        match *op {
            Op::Nop | Op::Bra { .. } | Op::Exit | Op::Bar { .. } | Op::WarpSync { .. } => {}
            Op::Mov { bits, d, a } => {
                let mk = width_mask(bits);
                map1(regs, m, d, a, |x| x & mk)
            }
            Op::Pack { d, ref parts, pbits } => {
                let mk = width_mask(pbits);
                let mut acc = [0u64; LANES];
                for (k, p) in parts.iter().enumerate() {
                    let v = fetch(regs, *p);
                    for l in 0..LANES {
                        acc[l] |= (v[l] & mk) << (k as u32 * pbits as u32);
                    }
                }
                store(regs, m, d, &acc);
            }
            Op::Unpack { ref ds, a, pbits } => {
                let v = fetch(regs, a);
                let mk = width_mask(pbits);
                for (k, d) in ds.iter().enumerate() {
                    if let Some(d) = d {
                        let part: [u64; LANES] = std::array::from_fn(|l| (v[l] >> (k as u32 * pbits as u32)) & mk);
                        store(regs, m, *d, &part);
                    }
                }
            }
            Op::I2 { f, bits, signed, d, a, b } => int2(regs, m, f, bits, signed, d, a, b),
            Op::I1 { f, bits, signed, d, a } => int1(regs, m, f, bits, signed, d, a),
            Op::I3 { f, bits, signed, d, a, b, c } => int3(regs, m, f, bits, signed, d, a, b, c),
            Op::Bfi { bits, d, a, b, c, e } => {
                let (av, bv, cv, ev) = (fetch(regs, a), fetch(regs, b), fetch(regs, c), fetch(regs, e));
                let r: [u64; LANES] = std::array::from_fn(|l| {
                    let pos = cv[l] & 0xff;
                    let len = ev[l] & 0xff;
                    let mut x = bv[l];
                    for i in 0..len {
                        let p = pos + i;
                        if p >= bits as u64 {
                            break;
                        }
                        x = (x & !(1 << p)) | ((av[l] >> i & 1) << p);
                    }
                    x & width_mask(bits)
                });
                store(regs, m, d, &r);
            }
            Op::F2 { f, t, m: fm, d, a, b } => float2(regs, m, f, t, fm, d, a, b),
            Op::F1 { f, t, m: fm, d, a } => float1(regs, m, f, t, fm, d, a),
            Op::Fma { t, m: fm, d, a, b, c } => {
                let (av, bv, cv) = (fetch(regs, a), fetch(regs, b), fetch(regs, c));
                let r: [u64; LANES] = std::array::from_fn(|l| match t {
                    FT::F32 => {
                        let ft = |x: u64| if fm.ftz { ftz32(f32::from_bits(x as u32)) } else { f32::from_bits(x as u32) };
                        fin32(ft(av[l]).mul_add(ft(bv[l]), ft(cv[l])), fm)
                    }
                    FT::F64 => canon64(f64::from_bits(av[l]).mul_add(f64::from_bits(bv[l]), f64::from_bits(cv[l]))),
                    _ => small_op(t, fm, av[l], bv[l], cv[l], |x, y, z| x.mul_add(y, z)),
                });
                store(regs, m, d, &r);
            }
            Op::Carry { f, bits, signed, cc_in, cc_out, d, a, b, c } => {
                let (av, bv, cv) = (fetch(regs, a), fetch(regs, b), fetch(regs, c));
                let mk = width_mask(bits) as u128;
                let mut r = [0u64; LANES];
                let mut cf = [0u64; LANES];
                for l in 0..LANES {
                    let cin = if cc_in { (regs.get(special::CC, l) & 1) as u128 } else { 0 };
                    let (x, y, z) = (av[l] as u128 & mk, bv[l] as u128 & mk, cv[l] as u128 & mk);
                    let (v, out) = match f {
                        CarryOp::Sub => (x.wrapping_sub(y + cin), x < y + cin),
                        _ => {
                            let addend = match f {
                                CarryOp::Add => y,
                                CarryOp::MadLo => (x * y) & mk,
                                _ if signed => {
                                    let sx = |v: u128| sign_extend(v as u64, bits as u32) as i64 as i128;
                                    ((sx(x) * sx(y)) >> bits) as u128 & mk
                                }
                                _ => (x * y) >> bits,
                            };
                            let base = if f == CarryOp::Add { x } else { z };
                            let t = base + addend + cin;
                            (t, t >> bits != 0)
                        }
                    };
                    r[l] = (v & mk) as u64;
                    cf[l] = out as u64;
                }
                store(regs, m, d, &r);
                if cc_out {
                    store(regs, m, special::CC, &cf);
                }
            }
            Op::FDirected { f, t, mode, m: fm, d, a, b, c } => {
                let (av, bv, cv) = (fetch(regs, a), fetch(regs, b), fetch(regs, c));
                let r: [u64; LANES] = std::array::from_fn(|l| match t {
                    FT::F64 => {
                        let (x, y) = (f64::from_bits(av[l]), f64::from_bits(bv[l]));
                        canon64(match f {
                            FDir::Add => float::add64(x, y, mode),
                            FDir::Sub => float::add64(x, -y, mode),
                            _ => float::mul64(x, y, mode),
                        })
                    }
                    _ => {
                        let g = |v: u64| if fm.ftz { ftz32(f32::from_bits(v as u32)) } else { f32::from_bits(v as u32) };
                        let (x, y, z) = (g(av[l]), g(bv[l]), g(cv[l]));
                        fin32(match f {
                            FDir::Add => float::add32(x, y, mode),
                            FDir::Sub => float::add32(x, -y, mode),
                            FDir::Mul => float::mul32(x, y, mode),
                            FDir::Div => float::div32(x, y, mode),
                            FDir::Fma => float::fma32(x, y, z, mode),
                            FDir::Sqrt => float::sqrt32(x, mode),
                        }, fm)
                    }
                });
                store(regs, m, d, &r);
            }
            Op::Setp { cmp, t, d, d2, a, b, comb } => {
                let (av, bv) = (fetch(regs, a), fetch(regs, b));
                let cv = comb.map(|(_, p, _)| fetch(regs, p));
                let mut r = [0u64; LANES];
                let mut r2 = [0u64; LANES];
                let pairs = matches!(t, CmpTy::Float(FT::F16x2 | FT::BF16x2));
                for l in 0..LANES {
                    let mut x = compare(cmp, t, av[l], bv[l]);
                    // The packed forms compare each half: p gets the low one, q the high one.
                    let mut y = if pairs { compare(cmp, t, av[l] >> 16, bv[l] >> 16) } else { !x };
                    if let (Some((bop, _, neg)), Some(cv)) = (comb, &cv) {
                        let c = (cv[l] != 0) ^ neg;
                        x = boolop(bop, x, c);
                        y = boolop(bop, y, c);
                    }
                    r[l] = x as u64;
                    r2[l] = y as u64;
                }
                if let Some(d) = d {
                    store(regs, m, d, &r);
                }
                if let Some(d2) = d2 {
                    store(regs, m, d2, &r2);
                }
            }
            Op::Set { cmp, t, yes, d, a, b, comb } => {
                let (av, bv) = (fetch(regs, a), fetch(regs, b));
                let cv = comb.map(|(_, p, _)| fetch(regs, p));
                let pairs = matches!(t, CmpTy::Float(FT::F16x2 | FT::BF16x2));
                let r: [u64; LANES] = std::array::from_fn(|l| {
                    let one = |a: u64, b: u64| {
                        let mut x = compare(cmp, t, a, b);
                        if let (Some((bop, _, neg)), Some(cv)) = (comb, &cv) {
                            x = boolop(bop, x, (cv[l] != 0) ^ neg);
                        }
                        if x { yes } else { 0 }
                    };
                    if pairs {
                        one(av[l], bv[l]) | one(av[l] >> 16, bv[l] >> 16) << 16
                    } else {
                        one(av[l], bv[l])
                    }
                });
                store(regs, m, d, &r);
            }
            Op::Selp { d, a, b, p } => {
                let (av, bv, pv) = (fetch(regs, a), fetch(regs, b), fetch(regs, p));
                let r: [u64; LANES] = std::array::from_fn(|l| if pv[l] != 0 { av[l] } else { bv[l] });
                store(regs, m, d, &r);
            }
            Op::Cvt { to, from, rnd, sat, ftz, d, a } => {
                let av = fetch(regs, a);
                let mut r = [0u64; LANES];
                for l in 0..LANES {
                    if m >> l & 1 != 0 {
                        r[l] = convert(to, from, rnd, sat, ftz, av[l]).map_err(|f| (l, f))?;
                    }
                }
                store(regs, m, d, &r);
            }
            Op::CvtX2 { to, from, relu, satfinite, d, a, b } => map2(regs, m, d, a, b, |x, y| cvt_packed(to, from, relu, satfinite, x, y)),
            Op::IsSpace { sp, d, a } => map1(regs, m, d, a, |x| (Self::classify(Space::Generic, x).0 == sp) as u64),
            Op::Cvta { to_generic, sp, d, a } => {
                let win = match sp {
                    Space::Shared => SHARED_WINDOW,
                    Space::Local => LOCAL_WINDOW,
                    Space::KParam => KPARAM_WINDOW,
                    _ => 0,
                };
                if to_generic {
                    map1(regs, m, d, a, |x| if win == 0 { x } else { x.wrapping_add(win) })
                } else {
                    map1(regs, m, d, a, |x| if win == 0 { x } else { x.wrapping_sub(win) })
                }
            }
            Op::Ld { sp, size, sext, strong, ref ds, base, off } => {
                let bv = fetch(regs, base);
                let n = ds.len() as u64;
                for l in 0..LANES {
                    if m >> l & 1 == 0 {
                        continue;
                    }
                    let addr = bv[l].wrapping_add(off as u64);
                    if addr % (size as u64 * n) != 0 && n > 1 {
                        return Err((l, Fault::Misaligned { addr }));
                    }
                    for (k, dd) in ds.iter().enumerate() {
                        let v = self.load(&w.local, l, sp, addr + k as u64 * size as u64, size).map_err(|f| (l, f))?;
                        if let Some(dd) = dd {
                            let v = if sext { sign_extend(v, size as u32 * 8) } else { v };
                            w.regs.set(*dd, l, v);
                        }
                    }
                }
                if strong {
                    // What the thread reads next is not read before this (`ld.acquire`; the
                    // host's loads are relaxed atomics).
                    std::sync::atomic::fence(Ordering::Acquire);
                }
            }
            Op::St { sp, size, ref vals, base, off } => {
                let bv = fetch(regs, base);
                let n = vals.len() as u64;
                for l in 0..LANES {
                    if m >> l & 1 == 0 {
                        continue;
                    }
                    let addr = bv[l].wrapping_add(off as u64);
                    if addr % (size as u64 * n) != 0 && n > 1 {
                        return Err((l, Fault::Misaligned { addr }));
                    }
                    for (k, v) in vals.iter().enumerate() {
                        let x = match v {
                            Src::R(r) => w.regs.get(*r, l),
                            Src::C(c) => *c,
                        };
                        self.store(&mut w.local, l, sp, addr + k as u64 * size as u64, size, x).map_err(|f| (l, f))?;
                    }
                }
            }
            Op::Atom { sp, op, t, d, base, off, b, c } => {
                let (bv, xv) = (fetch(regs, base), fetch(regs, b));
                let cv = c.map(|c| fetch(regs, c));
                for l in 0..LANES {
                    if m >> l & 1 == 0 {
                        continue;
                    }
                    let addr = bv[l].wrapping_add(off as u64);
                    let (x, y) = (xv[l], cv.as_ref().map_or(0, |c| c[l]));
                    let old = self.atomic(&mut w.local, l, sp, addr, t, |old| atom_apply(op, t, old, x, y)).map_err(|f| (l, f))?;
                    if let Some(d) = d {
                        w.regs.set(d, l, old);
                    }
                }
            }
            Op::Shfl { mode, d, dp, a, b, c } => {
                let (av, bv, cv) = (fetch(regs, a), fetch(regs, b), fetch(regs, c));
                let mut r = [0u64; LANES];
                let mut p = [0u64; LANES];
                for l in 0..LANES {
                    let lane = l as i32;
                    let bval = (bv[l] & 31) as i32;
                    let cval = (cv[l] & 31) as i32;
                    let seg = ((cv[l] >> 8) & 31) as i32;
                    let max_lane = (lane & seg) | (cval & !seg);
                    let min_lane = lane & seg;
                    let (j, ok) = match mode {
                        ShflMode::Up => (lane - bval, lane - bval >= max_lane),
                        ShflMode::Down => (lane + bval, lane + bval <= max_lane),
                        ShflMode::Bfly => (lane ^ bval, (lane ^ bval) <= max_lane),
                        ShflMode::Idx => {
                            let j = min_lane | (bval & !seg);
                            (j, j <= max_lane)
                        }
                    };
                    let j = if ok && (0..32).contains(&j) { j as usize } else { l };
                    r[l] = av[j] & 0xffff_ffff;
                    p[l] = ok as u64;
                }
                store(regs, m, d, &r);
                if let Some(dp) = dp {
                    store(regs, m, dp, &p);
                }
            }
            Op::Vote { mode, d, p, neg, member } => {
                let out_lanes = m;
                let m = m & first_lane(regs, member, m);
                let pv = fetch(regs, p);
                let mut ballot = 0u32;
                for l in 0..LANES {
                    if m >> l & 1 != 0 && ((pv[l] != 0) ^ neg) {
                        ballot |= 1 << l;
                    }
                }
                let v = match mode {
                    VoteMode::Ballot => ballot as u64,
                    VoteMode::All => (ballot == m) as u64,
                    VoteMode::Any => (ballot != 0) as u64,
                    VoteMode::Uni => (ballot == m || ballot == 0) as u64,
                };
                store(regs, out_lanes, d, &[v; LANES]);
            }
            Op::Match { all, bits, d, dp, a, member } => {
                let m = m & first_lane(regs, member, m);
                let av = fetch(regs, a);
                let mk = width_mask(bits);
                let mut r = [0u64; LANES];
                let mut same_all = true;
                let first = av[m.trailing_zeros() as usize] & mk;
                for l in 0..LANES {
                    if m >> l & 1 == 0 {
                        continue;
                    }
                    same_all &= av[l] & mk == first;
                    let mut s = 0u32;
                    for k in 0..LANES {
                        if m >> k & 1 != 0 && av[k] & mk == av[l] & mk {
                            s |= 1 << k;
                        }
                    }
                    r[l] = s as u64;
                }
                if all {
                    let v = if same_all { m as u64 } else { 0 };
                    store(regs, m, d, &[v; LANES]);
                } else {
                    store(regs, m, d, &r);
                }
                if let Some(dp) = dp {
                    store(regs, m, dp, &[same_all as u64; LANES]);
                }
            }
            Op::Activemask { d } => store(regs, m, d, &[m as u64; LANES]),
            Op::Elect { d, p, member } => {
                // The members that are here (all of them: the convergence point before waited).
                let lanes = m & first_lane(regs, member, m);
                let leader = lanes.trailing_zeros() as u64;
                if let Some(d) = d {
                    store(regs, m, d, &[leader; LANES]);
                }
                let is: [u64; LANES] = std::array::from_fn(|l| (l as u64 == leader) as u64);
                store(regs, m, p, &is);
            }
            Op::Redux { op, signed, d, a, member } => {
                let lanes = m & first_lane(regs, member, m);
                let av = fetch(regs, a);
                let vals = (0..LANES).filter(|l| lanes >> l & 1 != 0).map(|l| av[l] as u32);
                let r = match op {
                    ReduxOp::Add => vals.fold(0u32, u32::wrapping_add),
                    ReduxOp::Min if signed => vals.map(|v| v as i32).min().unwrap_or(0) as u32,
                    ReduxOp::Max if signed => vals.map(|v| v as i32).max().unwrap_or(0) as u32,
                    ReduxOp::Min => vals.min().unwrap_or(0),
                    ReduxOp::Max => vals.max().unwrap_or(0),
                    ReduxOp::And => vals.fold(u32::MAX, |x, y| x & y),
                    ReduxOp::Or => vals.fold(0, |x, y| x | y),
                    ReduxOp::Xor => vals.fold(0, |x, y| x ^ y),
                };
                store(regs, m, d, &[r as u64; LANES]);
            }
            Op::Clock { d, kind } => {
                let v = match kind {
                    // A 1 GHz clock: nanoseconds since the launch began.
                    ClockKind::Clock64 => self.sh.start.elapsed().as_nanos() as u64,
                    ClockKind::Clock => self.sh.start.elapsed().as_nanos() as u64 & 0xffff_ffff,
                    ClockKind::GlobalTimer => std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64),
                };
                store(regs, m, d, &[v; LANES]);
            }
            Op::AssertFail { msg, file, line, func } => {
                let (mv, fv, lv, nv) = (fetch(regs, msg), fetch(regs, file), fetch(regs, line), fetch(regs, func));
                let l = m.trailing_zeros() as usize;
                let local = &w.local;
                let mut rd = |addr: u64, n: usize| -> Result<Vec<u8>, Fault> {
                    (0..n as u64).map(|k| self.load(local, l, Space::Generic, addr + k, 1).map(|b| b as u8)).collect()
                };
                let mut text = |addr: u64| -> Result<String, (usize, Fault)> {
                    if addr == 0 {
                        return Ok(String::new());
                    }
                    printf::cstr(addr, &mut rd).map(|b| String::from_utf8_lossy(&b).into_owned()).map_err(|f| (l, f))
                };
                let fault = Fault::Assert { message: text(mv[l])?, file: text(fv[l])?, line: lv[l] as u32, function: text(nv[l])? };
                return Err((l, fault));
            }
            Op::Printf { fmt, args, ret } => {
                let (fv, av) = (fetch(regs, fmt), fetch(regs, args));
                for l in 0..LANES {
                    if m >> l & 1 == 0 {
                        continue;
                    }
                    let text = {
                        let local = &w.local;
                        let mut rd = |addr: u64, n: usize| -> Result<Vec<u8>, Fault> {
                            let mut v = Vec::with_capacity(n);
                            for k in 0..n as u64 {
                                v.push(self.load(local, l, Space::Generic, addr + k, 1)? as u8);
                            }
                            Ok(v)
                        };
                        printf::format(fv[l], av[l], &mut rd).map_err(|f| (l, f))?
                    };
                    let nargs = text.1;
                    if out.len() < self.sh.cfg.printf_limit {
                        out.extend_from_slice(&text.0);
                    }
                    if let Some((sp, o)) = ret {
                        self.store(&mut w.local, l, sp, o, 4, nargs as u64).map_err(|f| (l, f))?;
                    }
                }
            }
            Op::Trap => return Err((m.trailing_zeros() as usize, Fault::Trap)),
            Op::Mma(ref x) => matrix::mma(regs, m, x),
            Op::WmmaMem(ref x) => self.wmma_mem(w, m, x)?,
            Op::Matrix(ref x) => self.matrix_mem(w, m, x)?,
            Op::Movmatrix { d, a } => matrix::movmatrix(regs, m, d, a),
            Op::Tf32 { d, a, rnd, relu, satfinite } => map1(regs, m, d, a, |x| matrix::tf32(x as u32, rnd, relu, satfinite) as u64),
            Op::CpAsync(ref x) => self.cp_async(w, m, x)?,
            Op::Mbar(ref x) => self.mbar(w, m, x)?,
            Op::MbarWait(ref x) => {
                self.mbar_wait(w, m, x)?;
            }
        }
        Ok(())
    }

    /// Host pointer for `[addr, addr+size)` of global memory.
    fn global_ptr(&mut self, addr: u64, size: u64) -> Result<*mut u8, Fault> {
        let a = addr & !TAG_MASK;
        let hit = |r: &Region| a >= r.start && a - r.start < r.len && r.len - (a - r.start) >= size;
        let r = match self.cache {
            Some(r) if hit(&r) => r,
            _ => {
                let r = self.sh.mem.region(a).filter(hit).ok_or(Fault::IllegalAddress { addr, space: "global" })?;
                self.cache = Some(r);
                r
            }
        };
        if a % size != 0 {
            return Err(Fault::Misaligned { addr });
        }
        // SAFETY: inside the region (checked above), which the GlobalMemory
        // implementation guarantees is valid for the launch.
        Ok(unsafe { r.host.add((a - r.start) as usize) })
    }

    /// Resolves a generic address to its space and the address within it.
    fn classify(sp: Space, addr: u64) -> (Space, u64) {
        if sp == Space::Shared {
            // Shared-space addresses are 32 bits: `[%r+off]` wraps, and compilers rely on it
            // (cuBLAS's transpose kernels add a positive offset to a negative base).
            return (sp, addr & 0xffff_ffff);
        }
        if sp != Space::Generic {
            return (sp, addr);
        }
        let a = addr & !TAG_MASK;
        if (SHARED_WINDOW..SHARED_WINDOW + WINDOW_SIZE).contains(&a) {
            (Space::Shared, a - SHARED_WINDOW)
        } else if (LOCAL_WINDOW..LOCAL_WINDOW + WINDOW_SIZE).contains(&a) {
            (Space::Local, a - LOCAL_WINDOW)
        } else if (KPARAM_WINDOW..KPARAM_WINDOW + WINDOW_SIZE).contains(&a) {
            (Space::KParam, a - KPARAM_WINDOW)
        } else {
            (Space::Global, addr)
        }
    }

    fn local_range(&self, lane: usize, addr: u64, size: u64) -> Result<usize, Fault> {
        let ls = self.sh.prog.local_size;
        if addr.checked_add(size).is_none_or(|e| e > ls) {
            return Err(Fault::IllegalAddress { addr: LOCAL_WINDOW + addr, space: "local" });
        }
        Ok(lane * ls as usize + addr as usize)
    }

    fn load(&mut self, local: &[u8], lane: usize, sp: Space, addr: u64, size: u8) -> Result<u64, Fault> {
        let (sp, a) = Self::classify(sp, addr);
        let n = size as usize;
        let bytes = |s: &[u8], at: usize| -> u64 {
            let mut b = [0u8; 8];
            b[..n].copy_from_slice(&s[at..at + n]);
            u64::from_le_bytes(b)
        };
        match sp {
            Space::Global | Space::Generic => {
                let p = self.global_ptr(a, size as u64)?;
                // SAFETY: aligned (checked) and in bounds; atomics because
                // other blocks may write the same memory concurrently.
                Ok(unsafe {
                    match size {
                        1 => (*(p as *const AtomicU8)).load(Ordering::Relaxed) as u64,
                        2 => (*(p as *const AtomicU16)).load(Ordering::Relaxed) as u64,
                        4 => (*(p as *const AtomicU32)).load(Ordering::Relaxed) as u64,
                        8 => (*(p as *const AtomicU64)).load(Ordering::Relaxed),
                        _ => return Err(Fault::Unsupported(format!("{size}-byte access"))),
                    }
                })
            }
            Space::Shared => {
                if a.checked_add(size as u64).is_none_or(|e| e > self.shared.len() as u64) {
                    return Err(Fault::IllegalAddress { addr: SHARED_WINDOW + a, space: "shared" });
                }
                Ok(bytes(&self.shared, a as usize))
            }
            Space::Local => {
                let at = self.local_range(lane, a, size as u64)?;
                Ok(bytes(local, at))
            }
            Space::KParam => {
                if a.checked_add(size as u64).is_none_or(|e| e > self.sh.params.len() as u64) {
                    return Err(Fault::IllegalAddress { addr: KPARAM_WINDOW + a, space: "param" });
                }
                Ok(bytes(self.sh.params, a as usize))
            }
        }
    }

    fn store(&mut self, local: &mut [u8], lane: usize, sp: Space, addr: u64, size: u8, v: u64) -> Result<(), Fault> {
        let (sp, a) = Self::classify(sp, addr);
        let n = size as usize;
        match sp {
            Space::Global | Space::Generic => {
                let p = self.global_ptr(a, size as u64)?;
                // SAFETY: as in `load`.
                unsafe {
                    match size {
                        1 => (*(p as *const AtomicU8)).store(v as u8, Ordering::Relaxed),
                        2 => (*(p as *const AtomicU16)).store(v as u16, Ordering::Relaxed),
                        4 => (*(p as *const AtomicU32)).store(v as u32, Ordering::Relaxed),
                        8 => (*(p as *const AtomicU64)).store(v, Ordering::Relaxed),
                        _ => return Err(Fault::Unsupported(format!("{size}-byte access"))),
                    }
                }
                Ok(())
            }
            Space::Shared => {
                if a.checked_add(size as u64).is_none_or(|e| e > self.shared.len() as u64) {
                    return Err(Fault::IllegalAddress { addr: SHARED_WINDOW + a, space: "shared" });
                }
                self.shared[a as usize..a as usize + n].copy_from_slice(&v.to_le_bytes()[..n]);
                Ok(())
            }
            Space::Local => {
                let at = self.local_range(lane, a, size as u64)?;
                local[at..at + n].copy_from_slice(&v.to_le_bytes()[..n]);
                Ok(())
            }
            Space::KParam => Err(Fault::IllegalAddress { addr: KPARAM_WINDOW + a, space: "param (read-only)" }),
        }
    }

    fn atomic(&mut self, local: &mut [u8], lane: usize, sp: Space, addr: u64, t: AtomTy, f: impl Fn(u64) -> u64) -> Result<u64, Fault> {
        let (sp, a) = Self::classify(sp, addr);
        let size = t.size();
        if a % size as u64 != 0 {
            return Err(Fault::Misaligned { addr });
        }
        if sp == Space::Global {
            let p = self.global_ptr(a, size as u64)?;
            // SAFETY: as in `load`; compare-and-swap makes the update atomic
            // with respect to every other block.
            unsafe {
                if size == 4 {
                    let at = &*(p as *const AtomicU32);
                    let mut old = at.load(Ordering::Relaxed);
                    loop {
                        match at.compare_exchange_weak(old, f(old as u64) as u32, Ordering::SeqCst, Ordering::Relaxed) {
                            Ok(_) => return Ok(old as u64),
                            Err(x) => old = x,
                        }
                    }
                } else {
                    let at = &*(p as *const AtomicU64);
                    let mut old = at.load(Ordering::Relaxed);
                    loop {
                        match at.compare_exchange_weak(old, f(old), Ordering::SeqCst, Ordering::Relaxed) {
                            Ok(_) => return Ok(old),
                            Err(x) => old = x,
                        }
                    }
                }
            }
        }
        // Shared and local memory belong to this block, run by this thread.
        let old = self.load(local, lane, sp, a, size)?;
        self.store(local, lane, sp, a, size, f(old))?;
        Ok(old)
    }
}

fn empty_warp() -> Warp {
    Warp { regs: Regs { narrow: Vec::new(), wide: Vec::new() }, local: Vec::new(), pcs: [0; LANES], alive: 0, at_bar: false, bar_wait: 0, sync_wait: 0, sync_force: 0, conv: Vec::new(), conv_wait: 0, bar_red: None, first_thread: 0, polls: 0 }
}

/// Whether `op` is how a thread watches memory another block writes: a strong load or an
/// atomic outside shared memory.
fn polls(op: &Op) -> bool {
    match *op {
        Op::Ld { sp, strong, .. } => strong && !matches!(sp, Space::Shared | Space::Local | Space::KParam),
        Op::Atom { sp, .. } => !matches!(sp, Space::Shared | Space::Local),
        _ => false,
    }
}

/// (smallest pc among live lanes, lanes at it, smallest pc among the others).
#[inline]
fn regroup(pcs: &[u32; LANES], alive: u32) -> (u32, u32, u32) {
    let mut min = u32::MAX;
    for l in 0..LANES {
        if alive >> l & 1 != 0 && pcs[l] < min {
            min = pcs[l];
        }
    }
    let mut mask = 0u32;
    let mut other = u32::MAX;
    for l in 0..LANES {
        if alive >> l & 1 != 0 {
            if pcs[l] == min {
                mask |= 1 << l;
            } else if pcs[l] < other {
                other = pcs[l];
            }
        }
    }
    (min, mask, other)
}

/// Lanes whose pc is `pc`.
#[inline]
fn lanes_at(pcs: &[u32; LANES], pc: u32) -> u32 {
    let mut m = 0u32;
    for (l, p) in pcs.iter().enumerate() {
        if *p == pc {
            m |= 1 << l;
        }
    }
    m
}

/// The lanes that may run now: live, not at a block barrier, not parked at a warp operation.
/// When none is left but lanes are parked, the lowest-pc parked group is released (with
/// `sync_force`) so that a warp whose missing members wait at `bar.sync` (or never come) cannot
/// deadlock; they run the operation with the lanes that arrived, as before this wait existed.
#[inline]
fn ready(w: &mut Warp) -> u32 {
    let runnable = |w: &Warp| w.alive & !w.bar_wait & !w.sync_wait & !w.conv_wait;
    let r = runnable(w);
    if r != 0 || (w.sync_wait == 0 && w.conv_wait == 0) {
        return r;
    }
    // Lanes the waiting ones waited for may have exited: those meetings are complete.
    if w.conv_wait != 0 {
        settle(w);
        if runnable(w) != 0 {
            return runnable(w);
        }
    }
    if w.sync_wait & w.alive != 0 {
        let (_, g, _) = regroup(&w.pcs, w.sync_wait & w.alive);
        w.sync_wait &= !g;
        w.sync_force |= g;
    } else if w.conv_wait != 0 {
        // The missing lanes wait at a block barrier or a warp operation: the lowest-pc
        // waiting group goes on without them (its meeting is dropped).
        let (pc, g, _) = regroup(&w.pcs, w.conv_wait & w.alive);
        w.conv.retain(|e| !(e.0 == pc && e.1 & g != 0));
        w.conv_wait &= !g;
    }
    runnable(w)
}

/// Most divisions a warp keeps track of; past it, divided lanes meet again only where the
/// lowest-pc-first order happens to bring them together (as with no tracking).
const MAX_DIVISIONS: usize = 64;

/// The lanes of `mask` reach `pc`: those for which it is their innermost meeting point wait
/// there; a meeting all of whose live lanes are waiting is complete and its lanes go on (and
/// may meet an outer division at the same pc). Returns the lanes that go on from `pc` now.
fn arrive(w: &mut Warp, pc: u32, mut mask: u32) -> u32 {
    loop {
        let mut seen = 0u32;
        let mut here = 0u32;
        for &(meet, lanes) in w.conv.iter().rev() {
            let fresh = lanes & mask & !seen;
            if meet == pc {
                here |= fresh;
            }
            seen |= fresh;
            if seen == mask {
                break;
            }
        }
        if here == 0 {
            return mask;
        }
        set_pcs(&mut w.pcs, here, pc);
        w.conv_wait |= here;
        mask &= !here;
        let released = settle(w);
        if released == 0 {
            return mask;
        }
        mask |= released;
    }
}

/// Removes the meetings whose live lanes all wait at them (or are gone) and releases their
/// lanes; returns the lanes released.
fn settle(w: &mut Warp) -> u32 {
    let waiting_at = |w: &Warp, pc: u32| w.conv_wait & lanes_at(&w.pcs, pc);
    let mut released = 0u32;
    let mut k = w.conv.len();
    while k > 0 {
        k -= 1;
        let (meet, lanes) = w.conv[k];
        let live = lanes & w.alive;
        if live & !waiting_at(w, meet) == 0 {
            // Only lanes for which this is the innermost meeting are released; an outer one
            // holding the same lanes is checked on the next pass.
            let inner = w.conv[k + 1..].iter().fold(0u32, |a, e| a | e.1);
            let go = live & !inner;
            w.conv.remove(k);
            w.conv_wait &= !go;
            released |= go;
        }
    }
    released
}

/// The group to run next: [`regroup`] over the [`ready`] lanes.
#[inline]
fn next_group(w: &mut Warp) -> (u32, u32, u32) {
    let r = ready(w);
    regroup(&w.pcs, r)
}

/// A warp-uniform operand's value in the first lane of `m`, as a 32-bit lane mask.
#[inline]
fn first_lane(regs: &Regs, s: Src, m: u32) -> u32 {
    match s {
        Src::R(r) => regs.get(r, m.trailing_zeros() as usize % LANES) as u32,
        Src::C(c) => c as u32,
    }
}

#[inline]
fn set_pcs(pcs: &mut [u32; LANES], mask: u32, pc: u32) {
    for (l, p) in pcs.iter_mut().enumerate() {
        if mask >> l & 1 != 0 {
            *p = pc;
        }
    }
}

/// A warp's registers, [`LANES`] values each: a register declared with a type of at most 32
/// bits in a row of `u32` (`narrow`), one of a wider type (id with [`WIDE`]) in a row of
/// `u64` (`wide`). A value written to a narrow row keeps its low 32 bits: what a register of
/// that type holds on a GPU.
pub(crate) struct Regs {
    pub(crate) narrow: Vec<u32>,
    pub(crate) wide: Vec<u64>,
}

impl Regs {
    fn new(p: &Program) -> Regs {
        Regs { narrow: vec![0; p.nregs as usize * LANES], wide: vec![0; p.nwide as usize * LANES] }
    }

    #[inline(always)]
    pub(crate) fn get(&self, r: u32, lane: usize) -> u64 {
        if r & WIDE != 0 {
            self.wide[(r & !WIDE) as usize * LANES + lane]
        } else {
            self.narrow[r as usize * LANES + lane] as u64
        }
    }

    #[inline(always)]
    pub(crate) fn set(&mut self, r: u32, lane: usize, v: u64) {
        if r & WIDE != 0 {
            self.wide[(r & !WIDE) as usize * LANES + lane] = v;
        } else {
            self.narrow[r as usize * LANES + lane] = v as u32;
        }
    }
}

/// Always inlined, so that the compiled tier's vector executor has it as vector code.
#[inline(always)]
fn pred_mask(regs: &Regs, r: u32) -> u32 {
    let mut m = 0u32;
    if r & WIDE != 0 {
        let at = (r & !WIDE) as usize * LANES;
        for (l, v) in regs.wide[at..at + LANES].iter().enumerate() {
            m |= ((*v != 0) as u32) << l;
        }
    } else {
        let at = r as usize * LANES;
        for (l, v) in regs.narrow[at..at + LANES].iter().enumerate() {
            m |= ((*v != 0) as u32) << l;
        }
    }
    m
}

#[inline(always)]
fn fetch(regs: &Regs, s: Src) -> [u64; LANES] {
    let mut out = [0u64; LANES];
    match s {
        Src::R(r) if r & WIDE != 0 => {
            let at = (r & !WIDE) as usize * LANES;
            out.copy_from_slice(&regs.wide[at..at + LANES]);
        }
        Src::R(r) => {
            let at = r as usize * LANES;
            for (o, v) in out.iter_mut().zip(&regs.narrow[at..at + LANES]) {
                *o = *v as u64;
            }
        }
        Src::C(c) => out = [c; LANES],
    }
    out
}

#[inline(always)]
fn store(regs: &mut Regs, m: u32, d: u32, v: &[u64; LANES]) {
    if d & WIDE != 0 {
        let at = (d & !WIDE) as usize * LANES;
        let dst = &mut regs.wide[at..at + LANES];
        if m == u32::MAX {
            dst.copy_from_slice(v);
        } else {
            for l in 0..LANES {
                if m >> l & 1 != 0 {
                    dst[l] = v[l];
                }
            }
        }
    } else {
        let at = d as usize * LANES;
        let dst = &mut regs.narrow[at..at + LANES];
        for l in 0..LANES {
            if m >> l & 1 != 0 {
                dst[l] = v[l] as u32;
            }
        }
    }
}

#[inline(always)]
fn map1(regs: &mut Regs, m: u32, d: u32, a: Src, f: impl Fn(u64) -> u64) {
    let av = fetch(regs, a);
    let r: [u64; LANES] = std::array::from_fn(|l| f(av[l]));
    store(regs, m, d, &r);
}

#[inline(always)]
fn map2(regs: &mut Regs, m: u32, d: u32, a: Src, b: Src, f: impl Fn(u64, u64) -> u64) {
    let av = fetch(regs, a);
    let bv = fetch(regs, b);
    let r: [u64; LANES] = std::array::from_fn(|l| f(av[l], bv[l]));
    store(regs, m, d, &r);
}

#[inline(always)]
fn map3(regs: &mut Regs, m: u32, d: u32, a: Src, b: Src, c: Src, f: impl Fn(u64, u64, u64) -> u64) {
    let av = fetch(regs, a);
    let bv = fetch(regs, b);
    let cv = fetch(regs, c);
    let r: [u64; LANES] = std::array::from_fn(|l| f(av[l], bv[l], cv[l]));
    store(regs, m, d, &r);
}

#[inline(always)]
pub fn width_mask(bits: u8) -> u64 {
    if bits >= 64 {
        u64::MAX
    } else {
        (1u64 << bits) - 1
    }
}

#[inline(always)]
pub fn sign_extend(v: u64, bits: u32) -> u64 {
    if bits >= 64 {
        v
    } else {
        (((v << (64 - bits)) as i64) >> (64 - bits)) as u64
    }
}

#[allow(clippy::too_many_arguments)]
fn int2(regs: &mut Regs, m: u32, f: I2, bits: u8, signed: bool, d: u32, a: Src, b: Src) {
    let mk = width_mask(bits);
    let sx = move |x: u64| sign_extend(x & mk, bits as u32) as i64;
    let bu = bits as u64;
    match f {
        I2::Add => map2(regs, m, d, a, b, |x, y| x.wrapping_add(y) & mk),
        I2::Sub => map2(regs, m, d, a, b, |x, y| x.wrapping_sub(y) & mk),
        I2::AddSat => map2(regs, m, d, a, b, |x, y| (sx(x) as i32).saturating_add(sx(y) as i32) as u32 as u64),
        I2::SubSat => map2(regs, m, d, a, b, |x, y| (sx(x) as i32).saturating_sub(sx(y) as i32) as u32 as u64),
        I2::MulLo => map2(regs, m, d, a, b, |x, y| x.wrapping_mul(y) & mk),
        I2::MulHi if signed => map2(regs, m, d, a, b, |x, y| (((sx(x) as i128 * sx(y) as i128) >> bu) as u64) & mk),
        I2::MulHi => map2(regs, m, d, a, b, |x, y| ((((x & mk) as u128 * (y & mk) as u128) >> bu) as u64) & mk),
        I2::MulWide if signed => map2(regs, m, d, a, b, |x, y| (sx(x).wrapping_mul(sx(y)) as u64) & width_mask(bits * 2)),
        I2::MulWide => map2(regs, m, d, a, b, |x, y| (x & mk).wrapping_mul(y & mk) & width_mask(bits * 2)),
        I2::Mul24Lo if signed => map2(regs, m, d, a, b, |x, y| (sign_extend(x & 0xff_ffff, 24) as i64).wrapping_mul(sign_extend(y & 0xff_ffff, 24) as i64) as u64 & mk),
        I2::Mul24Lo => map2(regs, m, d, a, b, |x, y| (x & 0xff_ffff).wrapping_mul(y & 0xff_ffff) & mk),
        // Division by zero has no defined result in PTX; all ones, like the hardware.
        I2::Div if signed => map2(regs, m, d, a, b, |x, y| if sx(y) == 0 { mk } else { (sx(x).wrapping_div(sx(y)) as u64) & mk }),
        I2::Div => map2(regs, m, d, a, b, |x, y| if y & mk == 0 { mk } else { (x & mk) / (y & mk) }),
        I2::Rem if signed => map2(regs, m, d, a, b, |x, y| if sx(y) == 0 { x & mk } else { (sx(x).wrapping_rem(sx(y)) as u64) & mk }),
        I2::Rem => map2(regs, m, d, a, b, |x, y| if y & mk == 0 { x & mk } else { (x & mk) % (y & mk) }),
        I2::Min if signed => map2(regs, m, d, a, b, |x, y| (sx(x).min(sx(y)) as u64) & mk),
        I2::Min => map2(regs, m, d, a, b, |x, y| (x & mk).min(y & mk)),
        I2::Max if signed => map2(regs, m, d, a, b, |x, y| (sx(x).max(sx(y)) as u64) & mk),
        I2::Max => map2(regs, m, d, a, b, |x, y| (x & mk).max(y & mk)),
        I2::MinX2 | I2::MaxX2 => map2(regs, m, d, a, b, |x, y| {
            let half = |s: u32| {
                let (p, q) = ((x >> s) & 0xffff, (y >> s) & 0xffff);
                let lt = if signed { (p as u16 as i16) < (q as u16 as i16) } else { p < q };
                if lt == (f == I2::MinX2) { p } else { q }
            };
            half(0) | half(16) << 16
        }),
        I2::And => map2(regs, m, d, a, b, |x, y| x & y & mk),
        I2::Or => map2(regs, m, d, a, b, |x, y| (x | y) & mk),
        I2::Xor => map2(regs, m, d, a, b, |x, y| (x ^ y) & mk),
        // Shift amounts are unsigned 32-bit and clamp at the width.
        I2::Shl => map2(regs, m, d, a, b, |x, y| {
            let s = y & 0xffff_ffff;
            if s >= bu { 0 } else { (x << s) & mk }
        }),
        I2::Shr if signed => map2(regs, m, d, a, b, |x, y| {
            let s = (y & 0xffff_ffff).min(bu - 1);
            ((sx(x) >> s) as u64) & mk
        }),
        I2::Shr => map2(regs, m, d, a, b, |x, y| {
            let s = y & 0xffff_ffff;
            if s >= bu { 0 } else { (x & mk) >> s }
        }),
    }
}

fn int1(regs: &mut Regs, m: u32, f: I1, bits: u8, signed: bool, d: u32, a: Src) {
    let mk = width_mask(bits);
    let b = bits as u32;
    let sx = move |x: u64| sign_extend(x & mk, b) as i64;
    match f {
        I1::Neg => map1(regs, m, d, a, |x| (x as i64).wrapping_neg() as u64 & mk),
        I1::Abs => map1(regs, m, d, a, |x| sx(x).wrapping_abs() as u64 & mk),
        I1::Not => map1(regs, m, d, a, |x| !x & mk),
        I1::CNot => map1(regs, m, d, a, |x| (x & mk == 0) as u64),
        I1::Popc => map1(regs, m, d, a, |x| (x & mk).count_ones() as u64),
        I1::Clz => map1(regs, m, d, a, |x| ((x & mk).leading_zeros() - (64 - b)) as u64),
        I1::Brev => map1(regs, m, d, a, |x| (x & mk).reverse_bits() >> (64 - b)),
        I1::Bfind | I1::BfindShift => {
            let shift = f == I1::BfindShift;
            map1(regs, m, d, a, move |x| {
                let v = if signed && sx(x) < 0 { !x & mk } else { x & mk };
                if v == 0 {
                    return 0xffff_ffff;
                }
                let pos = 63 - v.leading_zeros() as u64;
                if shift { b as u64 - 1 - pos } else { pos }
            })
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn int3(regs: &mut Regs, m: u32, f: I3, bits: u8, signed: bool, d: u32, a: Src, b: Src, c: Src) {
    let mk = width_mask(bits);
    let bu = bits as u32;
    let sx = move |x: u64| sign_extend(x & mk, bu) as i64;
    match f {
        I3::MadLo => map3(regs, m, d, a, b, c, |x, y, z| x.wrapping_mul(y).wrapping_add(z) & mk),
        I3::MadHi if signed => map3(regs, m, d, a, b, c, |x, y, z| ((((sx(x) as i128 * sx(y) as i128) >> bu) as u64).wrapping_add(z)) & mk),
        I3::MadHi => map3(regs, m, d, a, b, c, |x, y, z| (((((x & mk) as u128 * (y & mk) as u128) >> bu) as u64).wrapping_add(z)) & mk),
        I3::MadWide if signed => map3(regs, m, d, a, b, c, |x, y, z| (sx(x).wrapping_mul(sx(y)) as u64).wrapping_add(z) & width_mask(bits * 2)),
        I3::MadWide => map3(regs, m, d, a, b, c, |x, y, z| (x & mk).wrapping_mul(y & mk).wrapping_add(z) & width_mask(bits * 2)),
        I3::Mad24Lo => map3(regs, m, d, a, b, c, |x, y, z| (x & 0xff_ffff).wrapping_mul(y & 0xff_ffff).wrapping_add(z) & mk),
        I3::Bfe => map3(regs, m, d, a, b, c, move |x, pos, len| {
            let (pos, len) = ((pos & 0xff) as u32, (len & 0xff) as u32);
            let msb = if pos + len == 0 { 0 } else { (pos + len - 1).min(bu - 1) };
            let sbit = if signed && len != 0 { (x & mk) >> msb & 1 } else { 0 };
            let mut r = 0u64;
            for i in 0..bu {
                let bit = if i < len && pos + i <= bu - 1 { (x >> (pos + i)) & 1 } else { sbit };
                r |= bit << i;
            }
            r & mk
        }),
        I3::ShfLWrap | I3::ShfLClamp | I3::ShfRWrap | I3::ShfRClamp => map3(regs, m, d, a, b, c, |x, y, n| {
            let v = (y & 0xffff_ffff) << 32 | (x & 0xffff_ffff);
            let n = if matches!(f, I3::ShfLWrap | I3::ShfRWrap) { n & 31 } else { (n & 0xffff_ffff).min(32) };
            if matches!(f, I3::ShfLWrap | I3::ShfLClamp) {
                (v << n) >> 32 & 0xffff_ffff
            } else {
                (v >> n) & 0xffff_ffff
            }
        }),
        I3::Prmt => map3(regs, m, d, a, b, c, |x, y, s| {
            let bytes = ((y & 0xffff_ffff) << 32) | (x & 0xffff_ffff);
            let mut r = 0u64;
            for k in 0..4 {
                let sel = (s >> (4 * k)) & 0xf;
                let byte = (bytes >> ((sel & 7) * 8)) & 0xff;
                let byte = if sel & 8 != 0 { if byte & 0x80 != 0 { 0xff } else { 0 } } else { byte };
                r |= byte << (8 * k);
            }
            r
        }),
        I3::Sad if signed => map3(regs, m, d, a, b, c, |x, y, z| (sx(x).abs_diff(sx(y))).wrapping_add(z) & mk),
        I3::Sad => map3(regs, m, d, a, b, c, |x, y, z| (x & mk).abs_diff(y & mk).wrapping_add(z) & mk),
    }
}

/// PTX's canonical f32 NaN.
#[inline(always)]
fn canon32(x: f32) -> u64 {
    if x.is_nan() {
        0x7fff_ffff
    } else {
        x.to_bits() as u64
    }
}

#[inline(always)]
fn canon64(x: f64) -> u64 {
    if x.is_nan() {
        0x7fff_ffff_ffff_ffff
    } else {
        x.to_bits()
    }
}

/// An f32 result with `.ftz`/`.sat` applied.
#[inline(always)]
fn fin32(x: f32, fm: FMod) -> u64 {
    let x = if fm.ftz { ftz32(x) } else { x };
    let x = if fm.sat { if x.is_nan() { 0.0 } else { x.clamp(0.0, 1.0) } } else { x };
    canon32(x)
}

fn fmin(a: f64, b: f64) -> f64 {
    if a.is_nan() {
        b
    } else if b.is_nan() || a < b || (a == b && a.is_sign_negative()) {
        a
    } else {
        b
    }
}

fn fmax(a: f64, b: f64) -> f64 {
    if a.is_nan() {
        b
    } else if b.is_nan() || a > b || (a == b && b.is_sign_negative()) {
        a
    } else {
        b
    }
}

/// One packed conversion (see [`Op::CvtX2`]).
fn cvt_packed(to: Packed, from: Option<Packed>, relu: bool, satfinite: bool, a: u64, b: u64) -> u64 {
    let (hi, lo) = match from {
        None => (f32::from_bits(a as u32) as f64, f32::from_bits(b as u32) as f64),
        Some(Packed::F16x2) => (float::small_to_f64((a >> 16) as u32 & 0xffff, float::F16), float::small_to_f64(a as u32 & 0xffff, float::F16)),
        Some(f) => {
            let e5 = f == Packed::E5m2x2;
            (float::fp8_to_f64((a >> 8) as u8, e5), float::fp8_to_f64(a as u8, e5))
        }
    };
    let one = |x: f64| -> u64 {
        let x = if relu && !x.is_nan() && x < 0.0 { 0.0 } else { x };
        match to {
            Packed::F16x2 | Packed::BF16x2 => {
                let fmt = if to == Packed::F16x2 { float::F16 } else { float::BF16 };
                let mut v = float::f64_to_small(x, fmt);
                let inf = ((1u32 << fmt.0) - 1) << fmt.1;
                // Both formats keep their sign in bit 15; the largest finite value is inf - 1.
                if satfinite && v & 0x7fff == inf {
                    v = (v & 0x8000) | (inf - 1);
                }
                v as u64
            }
            Packed::E4m3x2 | Packed::E5m2x2 => float::f64_to_fp8_satfinite(x, to == Packed::E5m2x2) as u64,
        }
    };
    let shift = if matches!(to, Packed::E4m3x2 | Packed::E5m2x2) { 8 } else { 16 };
    one(hi) << shift | one(lo)
}

/// `min.NaN`/`max.NaN`: NaN when either operand is, else `f`.
fn nan_or(f: fn(f64, f64) -> f64, a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        f(a, b)
    }
}

fn small_fmt(t: FT) -> (u32, u32) {
    if matches!(t, FT::BF16 | FT::BF16x2) {
        float::BF16
    } else {
        float::F16
    }
}

/// An operation on f16/bf16 (scalar or both halves of x2), done in f64.
fn small_op(t: FT, fm: FMod, a: u64, b: u64, c: u64, f: impl Fn(f64, f64, f64) -> f64) -> u64 {
    let fmt = small_fmt(t);
    let one = |a: u64, b: u64, c: u64| -> u64 {
        let g = |x: u64| float::small_to_f64(x as u32 & 0xffff, fmt);
        let mut r = f(g(a), g(b), g(c));
        if fm.sat {
            r = if r.is_nan() { 0.0 } else { r.clamp(0.0, 1.0) };
        }
        if fm.relu && !r.is_nan() && r <= 0.0 {
            r = 0.0;
        }
        float::f64_to_small(r, fmt) as u64
    };
    match t {
        FT::F16x2 | FT::BF16x2 => one(a, b, c) | one(a >> 16, b >> 16, c >> 16) << 16,
        _ => one(a, b, c),
    }
}

#[allow(clippy::too_many_arguments)]
fn float2(regs: &mut Regs, m: u32, f: F2, t: FT, fm: FMod, d: u32, a: Src, b: Src) {
    match t {
        FT::F32 => {
            let g = move |x: u64| if fm.ftz { ftz32(f32::from_bits(x as u32)) } else { f32::from_bits(x as u32) };
            match f {
                F2::Add => map2(regs, m, d, a, b, |x, y| fin32(g(x) + g(y), fm)),
                F2::Sub => map2(regs, m, d, a, b, |x, y| fin32(g(x) - g(y), fm)),
                F2::Mul => map2(regs, m, d, a, b, |x, y| fin32(g(x) * g(y), fm)),
                F2::Div => map2(regs, m, d, a, b, |x, y| fin32(g(x) / g(y), fm)),
                F2::Min => map2(regs, m, d, a, b, |x, y| fin32(fmin(g(x) as f64, g(y) as f64) as f32, fm)),
                F2::Max => map2(regs, m, d, a, b, |x, y| fin32(fmax(g(x) as f64, g(y) as f64) as f32, fm)),
                F2::MinNaN => map2(regs, m, d, a, b, |x, y| fin32(nan_or(fmin, g(x) as f64, g(y) as f64) as f32, fm)),
                F2::MaxNaN => map2(regs, m, d, a, b, |x, y| fin32(nan_or(fmax, g(x) as f64, g(y) as f64) as f32, fm)),
                F2::Copysign => map2(regs, m, d, a, b, |x, y| (y as u32 & 0x7fff_ffff | x as u32 & 0x8000_0000) as u64),
            }
        }
        FT::F64 => {
            let g = f64::from_bits;
            match f {
                F2::Add => map2(regs, m, d, a, b, |x, y| canon64(g(x) + g(y))),
                F2::Sub => map2(regs, m, d, a, b, |x, y| canon64(g(x) - g(y))),
                F2::Mul => map2(regs, m, d, a, b, |x, y| canon64(g(x) * g(y))),
                F2::Div => map2(regs, m, d, a, b, |x, y| canon64(g(x) / g(y))),
                F2::Min => map2(regs, m, d, a, b, |x, y| canon64(fmin(g(x), g(y)))),
                F2::Max => map2(regs, m, d, a, b, |x, y| canon64(fmax(g(x), g(y)))),
                F2::MinNaN => map2(regs, m, d, a, b, |x, y| canon64(nan_or(fmin, g(x), g(y)))),
                F2::MaxNaN => map2(regs, m, d, a, b, |x, y| canon64(nan_or(fmax, g(x), g(y)))),
                F2::Copysign => map2(regs, m, d, a, b, |x, y| y & !(1 << 63) | x & (1 << 63)),
            }
        }
        _ => {
            let op: fn(f64, f64, f64) -> f64 = match f {
                F2::Add => |x, y, _| x + y,
                F2::Sub => |x, y, _| x - y,
                F2::Mul => |x, y, _| x * y,
                F2::Div => |x, y, _| x / y,
                F2::Min => |x, y, _| fmin(x, y),
                F2::Max => |x, y, _| fmax(x, y),
                F2::MinNaN => |x, y, _| nan_or(fmin, x, y),
                F2::MaxNaN => |x, y, _| nan_or(fmax, x, y),
                F2::Copysign => |x, y, _| y.abs().copysign(x),
            };
            map2(regs, m, d, a, b, |x, y| small_op(t, fm, x, y, 0, op))
        }
    }
}

fn unary64(f: F1, x: f64) -> f64 {
    match f {
        F1::Neg => -x,
        F1::Abs => x.abs(),
        F1::Sqrt => x.sqrt(),
        F1::Rsqrt => 1.0 / x.sqrt(),
        F1::Rcp => 1.0 / x,
        F1::Ex2 => x.exp2(),
        F1::Lg2 => x.log2(),
        F1::Sin => x.sin(),
        F1::Cos => x.cos(),
        F1::Tanh => x.tanh(),
        F1::RoundEven => x.round_ties_even(),
        F1::Trunc => x.trunc(),
        F1::Floor => x.floor(),
        F1::Ceil => x.ceil(),
    }
}

fn unary32(f: F1, x: f32) -> f32 {
    match f {
        F1::Neg => -x,
        F1::Abs => x.abs(),
        F1::Sqrt => x.sqrt(),
        F1::Rsqrt => 1.0 / x.sqrt(),
        F1::Rcp => 1.0 / x,
        F1::Ex2 => x.exp2(),
        F1::Lg2 => x.log2(),
        F1::Sin => x.sin(),
        F1::Cos => x.cos(),
        F1::Tanh => x.tanh(),
        F1::RoundEven => x.round_ties_even(),
        F1::Trunc => x.trunc(),
        F1::Floor => x.floor(),
        F1::Ceil => x.ceil(),
    }
}

#[allow(clippy::too_many_arguments)]
fn float1(regs: &mut Regs, m: u32, f: F1, t: FT, fm: FMod, d: u32, a: Src) {
    match t {
        FT::F32 => match f {
            // neg and abs are bit operations (NaN payloads kept, no ftz of the sign).
            F1::Neg => map1(regs, m, d, a, |x| {
                let v = f32::from_bits(x as u32);
                let v = if fm.ftz { ftz32(v) } else { v };
                (v.to_bits() ^ 0x8000_0000) as u64
            }),
            F1::Abs => map1(regs, m, d, a, |x| {
                let v = f32::from_bits(x as u32);
                let v = if fm.ftz { ftz32(v) } else { v };
                (v.to_bits() & 0x7fff_ffff) as u64
            }),
            _ => map1(regs, m, d, a, |x| {
                let v = f32::from_bits(x as u32);
                let v = if fm.ftz { ftz32(v) } else { v };
                fin32(unary32(f, v), fm)
            }),
        },
        FT::F64 => match f {
            F1::Neg => map1(regs, m, d, a, |x| x ^ (1 << 63)),
            F1::Abs => map1(regs, m, d, a, |x| x & !(1 << 63)),
            _ => map1(regs, m, d, a, |x| canon64(unary64(f, f64::from_bits(x)))),
        },
        _ => match f {
            F1::Neg => map1(regs, m, d, a, move |x| x ^ if matches!(t, FT::F16x2 | FT::BF16x2) { 0x8000_8000 } else { 0x8000 }),
            F1::Abs => map1(regs, m, d, a, move |x| x & if matches!(t, FT::F16x2 | FT::BF16x2) { 0x7fff_7fff } else { 0x7fff }),
            _ => map1(regs, m, d, a, |x| small_op(t, fm, x, 0, 0, |v, _, _| unary64(f, v))),
        },
    }
}

fn compare(cmp: Cmp, t: CmpTy, a: u64, b: u64) -> bool {
    match t {
        CmpTy::Int { bits, signed } => {
            let mk = width_mask(bits);
            let (x, y) = if signed {
                (sign_extend(a & mk, bits as u32) as i64 as i128, sign_extend(b & mk, bits as u32) as i64 as i128)
            } else {
                ((a & mk) as i128, (b & mk) as i128)
            };
            match cmp {
                Cmp::Eq | Cmp::Equ => x == y,
                Cmp::Ne | Cmp::Neu => x != y,
                Cmp::Lt | Cmp::Ltu => x < y,
                Cmp::Le | Cmp::Leu => x <= y,
                Cmp::Gt | Cmp::Gtu => x > y,
                Cmp::Ge | Cmp::Geu => x >= y,
                Cmp::Num => true,
                Cmp::Nan => false,
            }
        }
        CmpTy::Float(ft) => {
            let (x, y) = match ft {
                FT::F32 => (f32::from_bits(a as u32) as f64, f32::from_bits(b as u32) as f64),
                FT::F64 => (f64::from_bits(a), f64::from_bits(b)),
                _ => (float::small_to_f64(a as u32 & 0xffff, small_fmt(ft)), float::small_to_f64(b as u32 & 0xffff, small_fmt(ft))),
            };
            let nan = x.is_nan() || y.is_nan();
            match cmp {
                Cmp::Eq => x == y,
                Cmp::Ne => !nan && x != y,
                Cmp::Lt => x < y,
                Cmp::Le => x <= y,
                Cmp::Gt => x > y,
                Cmp::Ge => x >= y,
                Cmp::Equ => nan || x == y,
                Cmp::Neu => nan || x != y,
                Cmp::Ltu => nan || x < y,
                Cmp::Leu => nan || x <= y,
                Cmp::Gtu => nan || x > y,
                Cmp::Geu => nan || x >= y,
                Cmp::Num => !nan,
                Cmp::Nan => nan,
            }
        }
    }
}

fn boolop(op: BoolOp, a: bool, b: bool) -> bool {
    match op {
        BoolOp::And => a && b,
        BoolOp::Or => a || b,
        BoolOp::Xor => a ^ b,
    }
}

fn atom_apply(op: AtomOp, t: AtomTy, old: u64, x: u64, y: u64) -> u64 {
    let wide = t.size() == 8;
    let mk = if wide { u64::MAX } else { 0xffff_ffff };
    let (o, v) = (old & mk, x & mk);
    let signed = matches!(t, AtomTy::S32 | AtomTy::S64);
    let sx = |z: u64| if wide { z as i64 } else { z as u32 as i32 as i64 };
    match op {
        AtomOp::Add => match t {
            AtomTy::F32 => (f32::from_bits(o as u32) + f32::from_bits(v as u32)).to_bits() as u64,
            AtomTy::F64 => (f64::from_bits(o) + f64::from_bits(v)).to_bits(),
            _ => o.wrapping_add(v) & mk,
        },
        AtomOp::Min if signed => (sx(o).min(sx(v)) as u64) & mk,
        AtomOp::Min => o.min(v),
        AtomOp::Max if signed => (sx(o).max(sx(v)) as u64) & mk,
        AtomOp::Max => o.max(v),
        AtomOp::Inc => if o >= v { 0 } else { o + 1 },
        AtomOp::Dec => if o == 0 || o > v { v } else { o - 1 },
        AtomOp::And => o & v,
        AtomOp::Or => o | v,
        AtomOp::Xor => o ^ v,
        AtomOp::Exch => v,
        AtomOp::Cas => if o == v { y & mk } else { o },
    }
}

fn int_value(t: CvtTy, v: u64) -> i128 {
    match t {
        CvtTy::Int { bits, signed: true } => sign_extend(v & width_mask(bits), bits as u32) as i64 as i128,
        CvtTy::Int { bits, signed: false } => (v & width_mask(bits)) as i128,
        CvtTy::Float(_) => 0,
    }
}

fn float_value(t: FT, v: u64) -> f64 {
    match t {
        FT::F32 => f32::from_bits(v as u32) as f64,
        FT::F64 => f64::from_bits(v),
        _ => float::small_to_f64(v as u32 & 0xffff, small_fmt(t)),
    }
}

/// `cvt`: every integer and float combination PTX allows.
fn convert(to: CvtTy, from: CvtTy, rnd: Rnd, sat: bool, ftz: bool, v: u64) -> Result<u64, Fault> {
    let unsupported = || Fault::Unsupported(format!("cvt rounding {rnd:?} from {from:?} to {to:?}"));
    Ok(match (to, from) {
        (CvtTy::Int { bits, signed }, CvtTy::Int { .. }) => {
            let x = int_value(from, v);
            if sat {
                let (lo, hi) = if signed { (-(1i128 << (bits - 1)), (1i128 << (bits - 1)) - 1) } else { (0, (1i128 << bits) - 1) };
                (x.clamp(lo, hi) as u64) & width_mask(bits)
            } else {
                (x as u64) & width_mask(bits)
            }
        }
        (CvtTy::Int { bits, signed }, CvtTy::Float(ft)) => {
            let mut x = float_value(ft, v);
            if ftz && ft == FT::F32 && x != 0.0 && (x as f32).is_subnormal() {
                x = 0.0;
            }
            let r = match rnd {
                Rnd::Rni | Rnd::Rn => x.round_ties_even(),
                Rnd::Rzi | Rnd::Rz | Rnd::None => x.trunc(),
                Rnd::Rmi | Rnd::Rm => x.floor(),
                Rnd::Rpi | Rnd::Rp => x.ceil(),
                Rnd::Rna => x.round(),
            };
            if r.is_nan() {
                0
            } else {
                let (lo, hi) = if signed { (-(2f64.powi(bits as i32 - 1)), 2f64.powi(bits as i32 - 1) - 1.0) } else { (0.0, 2f64.powi(bits as i32) - 1.0) };
                // Saturating: out-of-range values clamp (f64 math, then exact casts).
                let c = if r < lo { lo } else if r > hi { hi } else { r };
                let i = if signed { c as i64 as u64 } else { c as u64 };
                i & width_mask(bits)
            }
        }
        (CvtTy::Float(ft), CvtTy::Int { bits, signed }) => {
            let x = int_value(from, v);
            let _ = (bits, signed);
            let res = match ft {
                FT::F32 => {
                    let r = x as f32;
                    let r = match rnd {
                        Rnd::None | Rnd::Rn => r,
                        Rnd::Rz if (r as f64 as i128).abs() > x.abs() => float::next_down_f32(r.abs()).copysign(r),
                        Rnd::Rm if (r as f64 as i128) > x => float::next_down_f32(r),
                        Rnd::Rp if (r as f64 as i128) < x => float::next_up_f32(r),
                        Rnd::Rz | Rnd::Rm | Rnd::Rp => r,
                        _ => return Err(unsupported()),
                    };
                    r.to_bits() as u64
                }
                FT::F64 => {
                    let r = x as f64;
                    let r = match rnd {
                        Rnd::None | Rnd::Rn => r,
                        Rnd::Rz if (r as i128).abs() > x.abs() => float::next_down_f64(r.abs()).copysign(r),
                        Rnd::Rm if (r as i128) > x => float::next_down_f64(r),
                        Rnd::Rp if (r as i128) < x => float::next_up_f64(r),
                        Rnd::Rz | Rnd::Rm | Rnd::Rp => r,
                        _ => return Err(unsupported()),
                    };
                    r.to_bits()
                }
                _ => {
                    if !matches!(rnd, Rnd::None | Rnd::Rn) {
                        return Err(unsupported());
                    }
                    float::f64_to_small(x as f64, small_fmt(ft)) as u64
                }
            };
            res
        }
        (CvtTy::Float(tt), CvtTy::Float(ft)) => {
            let mut x = float_value(ft, v);
            if ftz && ft == FT::F32 {
                x = ftz32(x as f32) as f64;
            }
            x = match rnd {
                Rnd::Rni => x.round_ties_even(),
                Rnd::Rzi => x.trunc(),
                Rnd::Rmi => x.floor(),
                Rnd::Rpi => x.ceil(),
                _ => x,
            };
            if sat {
                x = if x.is_nan() { 0.0 } else { x.clamp(0.0, 1.0) };
            }
            match tt {
                FT::F64 => canon64(x),
                FT::F32 => {
                    let r = x as f32;
                    let r = match rnd {
                        Rnd::Rz if (r as f64).abs() > x.abs() => float::next_down_f32(r.abs()).copysign(r),
                        Rnd::Rm if (r as f64) > x => float::next_down_f32(r),
                        Rnd::Rp if (r as f64) < x => float::next_up_f32(r),
                        _ => r,
                    };
                    let r = if ftz { ftz32(r) } else { r };
                    canon32(r)
                }
                _ => {
                    if matches!(rnd, Rnd::Rz | Rnd::Rm | Rnd::Rp) {
                        return Err(unsupported());
                    }
                    float::f64_to_small(x, small_fmt(tt)) as u64
                }
            }
        }
    })
}
