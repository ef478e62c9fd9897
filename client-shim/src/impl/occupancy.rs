//! Occupancy, computed from the device's limits and the kernel's resource
//! use, with the same arithmetic the CUDA occupancy calculator uses
//! (warp-granular threads, per-SM limits on blocks, registers and shared
//! memory). Register allocation granularity is ignored.

use crate::cuda::types::*;

use crate::objects::library::resolve_function;
use crate::objects::module;
use crate::runtime;

type D = CUdevice_attribute;

/// Shared memory the driver reserves per block on sm_80 and later.
const RESERVED_SHARED_PER_BLOCK: i64 = 1024;

fn device_attribute(dev: CUdevice, attr: CUdevice_attribute) -> CuResult<i32> {
    runtime::get()?.device(dev)?.attribute(attr)
}

pub(crate) fn blocks_per_sm(f: &module::Function, block: i32, dyn_smem: usize) -> CuResult<i32> {
    if block <= 0 {
        return Err(CuError::INVALID_VALUE);
    }
    if block > f.max_threads_per_block {
        return Ok(0);
    }
    let a = |attr: CUdevice_attribute| device_attribute(f.device, attr).map(|v| v as i64);
    let warp = a(D::CU_DEVICE_ATTRIBUTE_WARP_SIZE)?.max(1);
    let threads = (block as i64 + warp - 1) / warp * warp;
    let by_threads = a(D::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)? / threads;
    let by_blocks = a(D::CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR)?;
    let regs = f.num_regs.max(1) as i64 * threads;
    let by_regs = a(D::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR)? / regs;
    let smem = f.shared_size_bytes as i64 + dyn_smem as i64 + RESERVED_SHARED_PER_BLOCK;
    let by_smem = a(D::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)? / smem;
    Ok(by_threads.min(by_blocks).min(by_regs).min(by_smem).max(0) as i32)
}

pub(crate) unsafe fn max_active_blocks_per_multiprocessor(n: &mut i32, f: CUfunction, block: i32, dyn_smem: usize) -> CuResult<()> {
    let func = resolve_function(f)?;
    *n = blocks_per_sm(&func, block, dyn_smem)?;
    Ok(())
}

pub(crate) unsafe fn max_active_blocks_per_multiprocessor_with_flags(
    n: &mut i32,
    f: CUfunction,
    block: i32,
    dyn_smem: usize,
    _flags: u32,
) -> CuResult<()> {
    // The only flag disables caching-related adjustments the real calculator
    // applies to texture-using kernels; the arithmetic here has none.
    max_active_blocks_per_multiprocessor(n, f, block, dyn_smem)
}

pub(crate) unsafe fn max_potential_block_size(
    min_grid: &mut i32,
    block_size: &mut i32,
    f: CUfunction,
    smem_for_block: CUoccupancyB2DSize,
    dyn_smem: usize,
    limit: i32,
) -> CuResult<()> {
    max_potential_block_size_with_flags(min_grid, block_size, f, smem_for_block, dyn_smem, limit, 0)
}

pub(crate) unsafe fn max_potential_block_size_with_flags(
    min_grid: &mut i32,
    block_size: &mut i32,
    f: CUfunction,
    smem_for_block: CUoccupancyB2DSize,
    dyn_smem: usize,
    limit: i32,
    _flags: u32,
) -> CuResult<()> {
    let func = resolve_function(f)?;
    let sms = device_attribute(func.device, D::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    let mut max = func.max_threads_per_block;
    if limit > 0 {
        max = max.min(limit);
    }
    let (mut best_threads, mut best_block, mut best_blocks) = (0i64, 0, 0);
    let mut b = max - max % 32;
    while b >= 32 {
        let smem = match smem_for_block {
            Some(cb) => cb(b),
            None => dyn_smem,
        };
        let n = blocks_per_sm(&func, b, smem)?;
        if (n as i64) * (b as i64) > best_threads {
            best_threads = n as i64 * b as i64;
            best_block = b;
            best_blocks = n;
        }
        b -= 32;
    }
    *block_size = best_block;
    *min_grid = best_blocks * sms;
    Ok(())
}

pub(crate) unsafe fn available_dynamic_s_mem_per_block(out: &mut usize, f: CUfunction, num_blocks: i32, block: i32) -> CuResult<()> {
    let func = resolve_function(f)?;
    if num_blocks <= 0 || block <= 0 {
        return Err(CuError::INVALID_VALUE);
    }
    let per_sm = device_attribute(func.device, D::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)? as i64;
    let optin = device_attribute(func.device, D::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as i64;
    let per_block = per_sm / num_blocks as i64 - RESERVED_SHARED_PER_BLOCK - func.shared_size_bytes as i64;
    *out = per_block.min(optin - func.shared_size_bytes as i64).max(0) as usize;
    Ok(())
}
