//! Kernel launches: the parameters are packed here, by the layout the
//! server reported, and sent without waiting. Launch errors that only the
//! device can see surface at the next synchronising call.

use std::ffi::c_void;

use crate::cuda::types::*;
use crate::objects::capture;
use crate::objects::graph::{KernelNode, Node};
use crate::objects::kernel_args::{check_dims, pack};
use crate::objects::library::resolve_function;
use crate::objects::module::{self, check_launchable};
use crate::objects::stream;
use crate::runtime::{self, cu_err, Runtime};

#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn kernel(
    f: CUfunction,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    shared: u32,
    s: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CuResult<()> {
    launch(f, [gx, gy, gz], [bx, by, bz], shared, s, params, extra, false)
}

/// cuLaunchCooperativeKernel: every block resident at once, so the kernel may synchronise the
/// whole grid (cooperative groups' `grid.sync()`).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn cooperative_kernel(
    f: CUfunction,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    shared: u32,
    s: CUstream,
    params: *mut *mut c_void,
) -> CuResult<()> {
    launch(f, [gx, gy, gz], [bx, by, bz], shared, s, params, std::ptr::null_mut(), true)
}

/// A cooperative grid must fit the device at once: what a real driver checks at the call,
/// with the occupancy the program was told (`cuOccupancyMaxActiveBlocksPerMultiprocessor` x
/// the SM count). The server checks again (it is not told the client's numbers).
fn check_cooperative(rt: &Runtime, func: &module::Function, grid: [u32; 3], block: [u32; 3], shared: u32) -> CuResult<()> {
    let dev = rt.device(func.device)?;
    if dev.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH)? == 0 {
        tracing::warn!("cooperative launch of {}: the device does not support cooperative launches", func.name.to_string_lossy());
        return Err(CuError::NOT_SUPPORTED);
    }
    let threads = block.iter().map(|&b| b as u64).product::<u64>();
    let per_sm = crate::r#impl::occupancy::blocks_per_sm(func, i32::try_from(threads).unwrap_or(i32::MAX), shared as usize)?;
    let sms = dev.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    let blocks = grid.iter().map(|&g| g as u64).product::<u64>();
    if blocks > per_sm.max(0) as u64 * sms.max(0) as u64 {
        return Err(CuError::COOPERATIVE_LAUNCH_TOO_LARGE);
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
unsafe fn launch(
    f: CUfunction,
    [gx, gy, gz]: [u32; 3],
    [bx, by, bz]: [u32; 3],
    shared: u32,
    s: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    cooperative: bool,
) -> CuResult<()> {
    let rt = runtime::get()?;
    // A function handle lives exactly as long as its module.
    let func = resolve_function(f)?;
    let (sh, dev) = stream::device_of(s)?;
    if dev != func.device {
        return Err(CuError::INVALID_HANDLE);
    }
    check_dims(rt, &func, [gx, gy, gz], [bx, by, bz], shared)?;
    if cooperative {
        check_cooperative(rt, &func, [gx, gy, gz], [bx, by, bz], shared)?;
    }
    // A kernel its server cannot run is refused here, where the program sees it, and is still
    // sent: the server refuses it too, and that failure surfaces at the next synchronising
    // call, as a kernel that failed on the device would. So a library that drops launch errors
    // (CuPy's CUB calls do) gets an error at its next copy instead of unwritten memory.
    let refused = check_launchable(&func);
    // Packed on the stack: CUDA caps a kernel's parameters at 32 KiB, and
    // most are a few dozen bytes.
    let mut stack = [0u8; 4096];
    let mut heap;
    let total = func.param_bytes();
    let buf: &mut [u8] = if total <= stack.len() {
        &mut stack[..total]
    } else {
        heap = vec![0u8; total];
        &mut heap
    };
    pack(&func, params, extra, buf)?;
    let node = || {
        refused?;
        if cooperative {
            // A graph's kernel node carries no cooperative flag here: replayed as an ordinary
            // launch, its grid.sync() would trap.
            tracing::warn!("capturing a cooperative launch into a graph is not supported by rgpu");
            return Err(CuError::NOT_SUPPORTED);
        }
        let (grid, block) = ([gx, gy, gz], [bx, by, bz]);
        Ok(Node::Kernel(KernelNode { func: f as usize as u64, function: func.clone(), grid, block, shared, params: buf.to_vec() }))
    };
    if capture::record(sh, node)? {
        return Ok(());
    }
    send(rt, &func, [gx, gy, gz], [bx, by, bz], shared, sh, buf, cooperative)?;
    refused
}

#[allow(clippy::too_many_arguments)]
fn send(
    rt: &Runtime,
    f: &module::Function,
    grid: [u32; 3],
    block: [u32; 3],
    shared: u32,
    stream: u64,
    params: &[u8],
    cooperative: bool,
) -> CuResult<()> {
    crate::objects::managed::to_device(rt, stream)?;
    rt.conn(f.device)?
        .post(
            |r| {
                let mut l = r.init_launch_kernel();
                l.set_module(f.module);
                l.set_function(f.index);
                l.set_grid_x(grid[0]);
                l.set_grid_y(grid[1]);
                l.set_grid_z(grid[2]);
                l.set_block_x(block[0]);
                l.set_block_y(block[1]);
                l.set_block_z(block[2]);
                l.set_shared_mem_bytes(shared);
                l.set_stream(stream);
                l.set_cooperative(cooperative);
            },
            params,
        )
        .map_err(cu_err)
}

pub(crate) unsafe fn kernel_ex(c: &CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) -> CuResult<()> {
    let mut cooperative = false;
    if c.numAttrs != 0 {
        if c.attrs.is_null() {
            return Err(CuError::INVALID_VALUE);
        }
        for a in std::slice::from_raw_parts(c.attrs, c.numAttrs as usize) {
            check_launch_attribute(a)?;
            if a.id == CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE {
                cooperative = a.value.cooperative != 0;
            }
        }
    }
    let (grid, block) = ([c.gridDimX, c.gridDimY, c.gridDimZ], [c.blockDimX, c.blockDimY, c.blockDimZ]);
    launch(f, grid, block, c.sharedMemBytes, c.hStream, params, extra, cooperative)
}

/// Launch attributes that only tune how a launch is scheduled leave its result as it is: they
/// are accepted and not forwarded (the kernel then runs as without them: serialised, default
/// priority and cache policy, which CUDA allows). The cooperative one is a cooperative launch
/// (the caller reads it). Those that change what a launch means otherwise (clusters bigger
/// than one block, events triggered from inside a kernel) are refused with
/// CUDA_ERROR_NOT_SUPPORTED, as rgpu does not offer them yet.
unsafe fn check_launch_attribute(a: &CUlaunchAttribute) -> CuResult<()> {
    type L = CUlaunchAttributeID;
    let v = &a.value;
    let fine = match a.id {
        L::CU_LAUNCH_ATTRIBUTE_IGNORE
        | L::CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW
        | L::CU_LAUNCH_ATTRIBUTE_SYNCHRONIZATION_POLICY
        | L::CU_LAUNCH_ATTRIBUTE_PRIORITY
        | L::CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN
        | L::CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN_MAP
        | L::CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
        | L::CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE
        // Allowing the next kernel to start early: running it after this one is stricter.
        | L::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION => true,
        L::CU_LAUNCH_ATTRIBUTE_COOPERATIVE => true,
        L::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION => {
            let d = v.clusterDim;
            (d.x, d.y, d.z) == (1, 1, 1) || (d.x, d.y, d.z) == (0, 0, 0)
        }
        _ => false,
    };
    if fine {
        Ok(())
    } else {
        tracing::warn!("cuLaunchKernelEx: launch attribute {} is not supported by rgpu", a.id.0);
        Err(CuError::NOT_SUPPORTED)
    }
}

// ---- host functions --------------------------------------------------------------------------
// A host function runs on this host once the work queued before it on its stream is done, and
// work queued after it waits for it. rgpu runs it on the calling thread after synchronising the
// stream: the order is CUDA's (later work is only queued once it returned); the cost is that
// the call waits, where CUDA's returns at once.

pub(crate) unsafe fn host_func(s: CUstream, f: CUhostFn, user_data: *mut c_void) -> CuResult<()> {
    let f = f.ok_or(CuError::INVALID_VALUE)?;
    if capture::record(stream::remote(s)?, || Ok(Node::Host { f: f as usize, data: user_data as usize }))? {
        return Ok(());
    }
    // As in CUDA, a host function is not run after an error in the work before it.
    stream::synchronize(s)?;
    f(user_data);
    Ok(())
}

pub(crate) unsafe fn host_func_v2(s: CUstream, f: CUhostFn, user_data: *mut c_void, _sync_mode: u32) -> CuResult<()> {
    // Every synchronisation mode is met: the function has returned before anything after it
    // is queued.
    host_func(s, f, user_data)
}
