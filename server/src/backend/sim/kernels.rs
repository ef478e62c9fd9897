//! Running kernels on the sim: the glue between the sim's modules and
//! memory and the PTX interpreter (`rgpu-ptx`).
//!
//! At module load every kernel of the module's PTX is decoded once, with the
//! module globals' device addresses resolved; a kernel that cannot be
//! decoded keeps the reason, which the client gets as the kernel's launch
//! note (so its launches fail with `CUDA_ERROR_NOT_SUPPORTED` naming the
//! instruction). A launch runs the grid on one of the session's executor
//! threads (blocks spread over the host's cores); the executor keeps stream
//! order.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use rgpu_ptx::{ExecError, Fault, GlobalMemory, LaunchConfig, Module, Program, Region};
use tracing::{debug, warn};

use super::memory::DeviceMemory;
use super::share::Share;
use crate::backend::{GlobalInfo, LaunchDims};
use rgpu_cuda_types::{CuError, CuResult};
use crate::module::ModuleImage;

/// Wall-clock limit of one launch; past it the launch fails with
/// `CUDA_ERROR_LAUNCH_TIMEOUT`; the server's `--sim-kernel-timeout` sets it
/// ([`super::SimConfig::kernel_time_limit`]).
pub const DEFAULT_TIME_LIMIT: Duration = Duration::from_secs(30);

/// Most printf bytes kept per launch (CUDA's default printf FIFO size).
const PRINTF_LIMIT: usize = 1 << 20;

/// Below this many threads a grid runs on one host thread: starting
/// workers would cost more than the kernel.
const PARALLEL_THRESHOLD: u64 = 4096;

/// Most host memory the interpreter's state of one block may take
/// (registers and local memory of every thread, shared memory): past it a
/// launch is `CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`, as a GPU refuses a block
/// that does not fit an SM.
pub const MAX_BLOCK_STATE: u64 = 256 << 20;

/// Most host memory the block states of one launch take together: a launch
/// whose blocks are large runs on fewer host threads.
pub const MAX_LAUNCH_STATE: u64 = 1 << 30;

/// Host bytes the interpreter holds for one block of `prog` with `dims`.
pub fn block_state_bytes(prog: &Program, dims: &LaunchDims) -> u64 {
    let threads = dims.block.iter().map(|&d| d as u64).product::<u64>();
    let lanes = threads.div_ceil(32) * 32;
    let per_lane = prog.register_bytes().saturating_add(prog.local_size);
    let shared = (prog.dyn_shared_offset.saturating_add(dims.shared_mem_bytes as u64)).max(prog.shared_static);
    lanes.saturating_mul(per_lane).saturating_add(shared)
}

/// Most instructions the kernels of one module decode to together (about
/// 64 bytes each): inlining lets a few kilobytes of PTX ask for billions.
pub const MAX_MODULE_INSTS: usize = 1 << 22;

/// Decodes every kernel of `parsed` (in its order); `Err` says why a kernel
/// cannot run on the sim. PTX past the parser's bounds (nesting) is no
/// module at all: `INVALID_PTX`, as a driver's compiler refuses it.
pub fn decode(parsed: &ModuleImage, globals: &[GlobalInfo]) -> CuResult<Vec<Result<Arc<Program>, String>>> {
    let Some(text) = &parsed.ptx else {
        return Ok(parsed.kernels.iter().map(|_| Err("the image has no PTX".to_string())).collect());
    };
    let module = match Module::parse(text) {
        Ok(m) => m,
        Err(e @ rgpu_ptx::PtxError::TooComplex { .. }) => {
            warn!("module refused: {e}");
            return Err(CuError::INVALID_PTX);
        }
        Err(e) => {
            let why = format!("the rgpu sim cannot read this module's PTX: {e}");
            warn!("{why}");
            return Ok(parsed.kernels.iter().map(|_| Err(why.clone())).collect());
        }
    };
    let by_name: std::collections::HashMap<&str, u64> = globals.iter().map(|g| (g.name.as_str(), g.ptr)).collect();
    let addr = |name: &str| by_name.get(name).copied();
    let mut budget = MAX_MODULE_INSTS;
    Ok(parsed
        .kernels
        .iter()
        .map(|k| {
            if budget == 0 {
                return Err(format!(
                    "the rgpu sim cannot run kernel {}: the module's kernels together decode to more than {MAX_MODULE_INSTS} instructions",
                    k.name
                ));
            }
            match module.lower_within(&k.name, &addr, budget) {
                Ok(p) => {
                    budget -= p.insts.len().min(budget);
                    debug!(kernel = %k.name, instructions = p.insts.len(), registers = p.nregs + p.nwide, "kernel decoded");
                    Ok(Arc::new(p))
                }
                Err(e) => {
                    let why = format!("the rgpu sim cannot run kernel {}: {e}", k.name);
                    warn!("{why}");
                    Err(why)
                }
            }
        })
        .collect())
}

/// The allocations one session can reach from a kernel, frozen for a launch.
pub struct SessionMemory {
    /// Sorted by start.
    regions: Vec<Region>,
}

// SAFETY: the regions point into the devices' mappings, which outlive every
// session. They are the launching session's own allocations, which cannot
// be freed while the launch runs (a free, unmap or unload first waits for the
// session's executor to be idle, and the session's end joins it before
// freeing); the interpreter accesses them atomically only.
unsafe impl Send for SessionMemory {}
unsafe impl Sync for SessionMemory {}

impl SessionMemory {
    /// The allocations `allocs` and the accessible maps `mapped` (virtual memory management).
    pub fn new(devices: &[DeviceMemory], allocs: impl Iterator<Item = u64>, mapped: impl Iterator<Item = Region>) -> Self {
        let mut regions: Vec<Region> = allocs
            .filter_map(|p| {
                let d = devices.iter().find(|d| d.contains(p))?;
                let (start, len, host) = d.region(p)?;
                Some(Region { start, len, host })
            })
            .chain(mapped)
            .collect();
        regions.sort_by_key(|r| r.start);
        SessionMemory { regions }
    }
}

// SAFETY: see the Send/Sync note above: every region is valid for the launch.
unsafe impl GlobalMemory for SessionMemory {
    fn region(&self, addr: u64) -> Option<Region> {
        let i = self.regions.partition_point(|r| r.start <= addr);
        let r = self.regions.get(i.checked_sub(1)?)?;
        (addr - r.start < r.len).then_some(*r)
    }
}

/// Runs one launch, failing it past `time_limit`; device printf output is
/// appended to `output`. Each block waits for a core from `share`, the
/// session's place among the sessions sharing the host's cores.
#[allow(clippy::too_many_arguments)]
pub fn run(
    prog: &Program,
    dims: &LaunchDims,
    params: &[u8],
    mem: &SessionMemory,
    output: &mut Vec<u8>,
    time_limit: Duration,
    compiled: bool,
    cancel: &AtomicBool,
    share: &Share,
) -> CuResult {
    let state = block_state_bytes(prog, dims);
    if state > MAX_BLOCK_STATE {
        warn!(kernel = %prog.name, bytes = state, "launch refused: one block's interpreter state would pass {MAX_BLOCK_STATE} bytes");
        return Err(CuError::LAUNCH_OUT_OF_RESOURCES);
    }
    let threads = dims.grid.iter().chain(&dims.block).map(|&d| d as u64).product::<u64>();
    // As many host threads as cores, whatever else runs: the share decides
    // which launch's blocks run on them, so a launch started while others
    // ran can still take the cores its share gives it.
    let workers = if threads < PARALLEL_THRESHOLD {
        1
    } else {
        let by_memory = (MAX_LAUNCH_STATE / state.max(1)).max(1) as usize;
        share.cores().min(by_memory)
    };
    let cfg = LaunchConfig {
        grid: dims.grid,
        block: dims.block,
        dyn_shared: dims.shared_mem_bytes,
        workers,
        time_limit,
        printf_limit: PRINTF_LIMIT,
        compiled,
    };
    let ran = if dims.cooperative {
        // Every block resident at once, taking turns on the workers (checked against the
        // occupancy and MAX_LAUNCH_STATE at the launch: sim::cooperative).
        rgpu_ptx::launch_cooperative(prog, &cfg, params, mem, cancel, share)
    } else {
        rgpu_ptx::launch_gated(prog, &cfg, params, mem, cancel, share)
    };
    match ran {
        Ok(out) => {
            output.extend_from_slice(&out.printf);
            Ok(())
        }
        Err(e) => Err(launch_error(&e, time_limit)),
    }
}

/// The CUDA error for a failed launch, logged with where it happened.
fn launch_error(e: &ExecError, time_limit: Duration) -> CuError {
    let (b, t) = (e.block, e.thread);
    let at = format!("kernel {} block ({},{},{}) thread ({},{},{}) PTX line {}", e.kernel, b[0], b[1], b[2], t[0], t[1], t[2], e.line);
    match &e.fault {
        Fault::IllegalAddress { addr, space } => {
            warn!("illegal address: {at}: {space} access at {addr:#x} is outside every allocation");
            CuError::ILLEGAL_ADDRESS
        }
        Fault::Misaligned { addr } => {
            warn!("misaligned address: {at}: access at {addr:#x}");
            CuError::MISALIGNED_ADDRESS
        }
        Fault::Timeout => {
            warn!("launch timed out after {time_limit:?}: {at} (--sim-kernel-timeout sets the limit)");
            CuError::LAUNCH_TIMEOUT
        }
        Fault::Trap => {
            warn!("trap: {at}");
            CuError::LAUNCH_FAILED
        }
        Fault::Assert { message, file, line, function } => {
            warn!("device assert: {file}:{line}: {function}: {at}: Assertion `{message}` failed.");
            CuError::ASSERT
        }
        Fault::Unsupported(what) => {
            warn!("not supported by the rgpu sim: {at}: {what}");
            CuError::NOT_SUPPORTED
        }
        Fault::Aborted => CuError::LAUNCH_FAILED,
        Fault::Cancelled => {
            debug!("launch stopped: {at}: its session ended");
            CuError::LAUNCH_FAILED
        }
    }
}
