//! A kernel's launch arguments: its dimensions checked against the device and the function,
//! and its parameters packed into the layout the server reported, for a launch and for a
//! graph's kernel node alike.

use std::ffi::c_void;

use rgpu_cuda_types::*;

use super::module;
use crate::runtime::Runtime;

/// CU_LAUNCH_PARAM_* markers of the `extra` array.
const PARAM_END: usize = 0x00;
const PARAM_BUFFER_POINTER: usize = 0x01;
const PARAM_BUFFER_SIZE: usize = 0x02;

pub fn check_dims(rt: &Runtime, f: &module::Function, grid: [u32; 3], block: [u32; 3], shared: u32) -> CuResult<()> {
    if grid.contains(&0) || block.contains(&0) {
        return Err(CuError::INVALID_VALUE);
    }
    let lim = rt.device(f.device)?.limits;
    for i in 0..3 {
        if block[i] > lim.max_block[i] || grid[i] > lim.max_grid[i] {
            return Err(CuError::INVALID_VALUE);
        }
    }
    let threads = block[0] as u64 * block[1] as u64 * block[2] as u64;
    if threads > f.max_threads_per_block.max(0) as u64 {
        return Err(CuError::INVALID_VALUE);
    }
    let dynamic_max = f.max_dynamic_shared.load(std::sync::atomic::Ordering::Relaxed).max(0) as u64;
    if shared as u64 > dynamic_max {
        return Err(CuError::INVALID_VALUE);
    }
    Ok(())
}

/// Packs the kernel's arguments into the layout the device expects.
pub unsafe fn pack(f: &module::Function, params: *mut *mut c_void, extra: *mut *mut c_void, buf: &mut [u8]) -> CuResult<()> {
    let total = buf.len();
    if !params.is_null() {
        for (i, &(off, size)) in f.params.iter().enumerate() {
            let p = *params.add(i);
            if p.is_null() {
                return Err(CuError::INVALID_VALUE);
            }
            std::ptr::copy_nonoverlapping(p as *const u8, buf.as_mut_ptr().add(off as usize), size as usize);
        }
        return Ok(());
    }
    if !extra.is_null() {
        let (mut ptr, mut len) = (std::ptr::null::<u8>(), None::<usize>);
        let mut i = 0;
        loop {
            match *extra.add(i) as usize {
                PARAM_END => break,
                PARAM_BUFFER_POINTER => ptr = *extra.add(i + 1) as *const u8,
                PARAM_BUFFER_SIZE => len = Some(*(*extra.add(i + 1) as *const usize)),
                _ => return Err(CuError::INVALID_VALUE),
            }
            i += 2;
        }
        let len = len.ok_or(CuError::INVALID_VALUE)?;
        if ptr.is_null() || len < total {
            return Err(CuError::INVALID_VALUE);
        }
        std::ptr::copy_nonoverlapping(ptr, buf.as_mut_ptr(), total);
        return Ok(());
    }
    if total == 0 {
        Ok(())
    } else {
        Err(CuError::INVALID_VALUE)
    }
}
