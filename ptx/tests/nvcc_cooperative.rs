//! Cooperative groups' grid-wide barrier as nvcc 13 compiles it
//! (tests/data/nvcc13_cooperative.cu: a two-phase reduction with two
//! `grid.sync()`s): a cooperative launch gives every block the sum of all
//! blocks' phase-1 results, on one host thread or several, with more blocks
//! than threads; the same kernel launched ordinarily traps at the barrier.

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use rgpu_ptx::{BlockGate, ExecError, Fault, HostMemory, LaunchConfig, LaunchOutput, Module, Program, launch_cooperative};

/// Every launch here runs on both tiers first and fails where they differ.
fn launch(p: &Program, c: &LaunchConfig, params: &[u8], mem: &HostMemory) -> Result<LaunchOutput, ExecError> {
    rgpu_ptx::testing::check_tiers(p, c, params, mem, &|p, c, params, mem| rgpu_ptx::launch(p, c, params, mem))
}

const PTX: &str = include_str!("data/nvcc13_cooperative.ptx");
const KERNEL: &str = "_Z6reducePKjPjS1_S1_i";
const BASE: u64 = 0x7f00_0000_0000;

struct Free;
impl BlockGate for Free {
    fn enter(&self, _: &dyn Fn() -> bool) -> bool {
        true
    }
    fn leave(&self, _: bool) {}
}

fn cfg(grid: u32, workers: usize) -> LaunchConfig {
    LaunchConfig { grid: [grid, 1, 1], block: [256, 1, 1], dyn_shared: 0, workers, time_limit: Duration::from_secs(60), printf_limit: 1 << 20, compiled: true }
}

/// Runs the reduction over `n` elements; returns (per-block totals, disagreements, expected sum)
/// or the launch's fault.
fn reduce(grid: u32, workers: usize, n: u32, cooperative: bool) -> Result<(Vec<u32>, u32, u32), Fault> {
    let m = Module::parse(PTX).unwrap();
    let p = m.lower(KERNEL, &|_| None).unwrap();
    let mut mem = HostMemory::new(BASE, 1 << 24);
    let input = mem.alloc(n as u64 * 4).unwrap();
    let partial = mem.alloc(grid as u64 * 4).unwrap();
    let totals = mem.alloc(grid as u64 * 4).unwrap();
    let bad = mem.alloc(4).unwrap();
    let vals: Vec<u32> = (0..n).map(|i| i % 1000 + 1).collect();
    mem.write(input, &vals.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>());
    mem.write(totals, &vec![0xff; grid as usize * 4]);
    let mut params = Vec::new();
    for a in [input, partial, totals, bad] {
        params.extend_from_slice(&a.to_le_bytes());
    }
    params.extend_from_slice(&n.to_le_bytes());
    let c = cfg(grid, workers);
    let r = if cooperative { rgpu_ptx::testing::check_tiers(&p, &c, &params, &mem, &|p, c, params, mem| launch_cooperative(p, c, params, mem, &AtomicBool::new(false), &Free)) } else { launch(&p, &c, &params, &mem) };
    r.map_err(|e| e.fault)?;
    let t = mem.read(totals, grid as usize * 4).unwrap();
    let b = mem.read(bad, 4).unwrap();
    Ok((
        t.chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        vals.iter().sum(),
    ))
}

#[test]
fn grid_sync_orders_the_phases_of_every_block() {
    for (grid, workers) in [(1, 1), (5, 1), (24, 1), (24, 4), (40, 3)] {
        let (totals, bad, want) = reduce(grid, workers, 20_000, true).unwrap();
        assert!(totals.iter().all(|&t| t == want), "grid {grid}, {workers} workers: totals {totals:?}, want {want}");
        assert_eq!(bad, 0, "grid {grid}, {workers} workers");
    }
}

#[test]
fn grid_sync_in_an_ordinary_launch_traps() {
    assert_eq!(reduce(4, 2, 1000, false).unwrap_err(), Fault::Trap);
}
