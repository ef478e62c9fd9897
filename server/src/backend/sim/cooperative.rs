//! Cooperative launches on the sim (`cuLaunchCooperativeKernel`): a grid is
//! accepted only if all its blocks can be resident at once, by the same
//! occupancy arithmetic the shim answers `cuOccupancyMaxActiveBlocksPerMultiprocessor`
//! with (from the same attributes and the same per-kernel numbers), so a
//! program that sizes its grid by occupancy gets exactly the largest grid the
//! sim takes; one block more is `CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE`, as
//! from a real driver. The interpreter then holds every block's state for the
//! whole launch (`rgpu_ptx::launch_cooperative`), which the launch's host
//! memory bound also has to allow.

use rgpu_cuda_types::{CuError, CuResult};
use tracing::warn;

use super::attributes::{self, SimDeviceParams, SM_COUNT};
use super::kernels::MAX_LAUNCH_STATE;
use crate::backend::{FunctionInfo, LaunchDims};

/// Shared memory the driver reserves per block on sm_80 and later (the shim's occupancy counts it too).
const RESERVED_SHARED_PER_BLOCK: i64 = 1024;

/// What limits how many blocks of one kernel an SM holds, as reported to the client.
#[derive(Debug, Clone, Copy)]
pub struct Resources {
    num_regs: i32,
    shared_static: i32,
    max_threads_per_block: i32,
}

impl Resources {
    pub fn of(f: &FunctionInfo) -> Self {
        Resources { num_regs: f.num_regs, shared_static: f.shared_size_bytes, max_threads_per_block: f.max_threads_per_block }
    }
}

/// The sim device's value of attribute `id`; the ones used here are the same on every sim device.
fn attr(id: u32) -> i64 {
    let p = SimDeviceParams { ordinal: 0, cc_major: 9, cc_minor: 0, pci_domain: 0, pci_bus: 0, pci_device: 0 };
    attributes::value(id, &p) as i64
}

/// Blocks of `threads` threads with `dyn_smem` bytes of dynamic shared memory one SM holds.
pub fn blocks_per_sm(r: &Resources, threads: u64, dyn_smem: u32) -> i64 {
    if threads == 0 || threads > r.max_threads_per_block.max(0) as u64 {
        return 0;
    }
    let warp = attr(10).max(1); // WARP_SIZE
    let threads = (threads as i64 + warp - 1) / warp * warp;
    let by_threads = attr(39) / threads; // MAX_THREADS_PER_MULTIPROCESSOR
    let by_blocks = attr(106); // MAX_BLOCKS_PER_MULTIPROCESSOR
    let by_regs = attr(82) / (r.num_regs.max(1) as i64 * threads); // MAX_REGISTERS_PER_MULTIPROCESSOR
    let smem = r.shared_static.max(0) as i64 + dyn_smem as i64 + RESERVED_SHARED_PER_BLOCK;
    let by_smem = attr(81) / smem; // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
    by_threads.min(by_blocks).min(by_regs).min(by_smem).max(0)
}

/// Refuses a cooperative grid the device could not hold at once, or whose blocks' interpreter
/// state (`block_state` bytes each) would pass the launch's host memory bound.
pub fn check(kernel: &str, r: &Resources, dims: &LaunchDims, block_state: u64) -> CuResult {
    let blocks = dims.grid.iter().map(|&g| g as u64).product::<u64>();
    let threads = dims.block.iter().map(|&b| b as u64).product::<u64>();
    let resident = blocks_per_sm(r, threads, dims.shared_mem_bytes) as u64 * SM_COUNT as u64;
    if blocks > resident {
        warn!(kernel, blocks, resident, "cooperative launch refused: more blocks than the device holds at once");
        return Err(CuError::COOPERATIVE_LAUNCH_TOO_LARGE);
    }
    if blocks.saturating_mul(block_state) > MAX_LAUNCH_STATE {
        warn!(
            kernel,
            blocks,
            bytes_per_block = block_state,
            "cooperative launch refused: every block's interpreter state would pass {MAX_LAUNCH_STATE} bytes of host memory"
        );
        return Err(CuError::LAUNCH_OUT_OF_RESOURCES);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(regs: i32, shared: i32) -> Resources {
        Resources { num_regs: regs, shared_static: shared, max_threads_per_block: 1024 }
    }

    fn dims(grid: u32, block: u32, dyn_smem: u32) -> LaunchDims {
        LaunchDims { grid: [grid, 1, 1], block: [block, 1, 1], shared_mem_bytes: dyn_smem, cooperative: true }
    }

    #[test]
    fn occupancy_is_the_limit() {
        // 32 registers: 65536 / (32 x 256) = 8 blocks of 256 threads an SM, and 2048 threads.
        let r = res(32, 1024);
        assert_eq!(blocks_per_sm(&r, 256, 0), 8);
        assert_eq!(blocks_per_sm(&r, 1024, 0), 2);
        assert_eq!(blocks_per_sm(&r, 32, 0), 32, "MAX_BLOCKS_PER_MULTIPROCESSOR");
        assert_eq!(blocks_per_sm(&r, 1025, 0), 0);
        assert_eq!(blocks_per_sm(&r, 256, 100 * 1024), 2, "dynamic shared memory");
        let max = 8 * SM_COUNT as u32;
        assert_eq!(check("k", &r, &dims(max, 256, 0), 1000), Ok(()));
        assert_eq!(check("k", &r, &dims(max + 1, 256, 0), 1000), Err(CuError::COOPERATIVE_LAUNCH_TOO_LARGE));
        assert_eq!(check("k", &r, &dims(1, 2048, 0), 1000), Err(CuError::COOPERATIVE_LAUNCH_TOO_LARGE));
        // The 3-D grid counts all its blocks.
        let mut d = dims(max, 256, 0);
        d.grid = [max / 2, 2, 2];
        assert_eq!(check("k", &r, &d, 1000), Err(CuError::COOPERATIVE_LAUNCH_TOO_LARGE));
    }

    #[test]
    fn the_interpreter_state_of_every_block_is_bounded() {
        let r = res(32, 0);
        assert_eq!(check("k", &r, &dims(100, 256, 0), MAX_LAUNCH_STATE / 100), Ok(()));
        assert_eq!(check("k", &r, &dims(101, 256, 0), MAX_LAUNCH_STATE / 100), Err(CuError::LAUNCH_OUT_OF_RESOURCES));
    }
}
