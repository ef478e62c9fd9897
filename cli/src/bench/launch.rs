//! Sustained asynchronous launch rate and client CPU per launch.

use std::ffi::{c_void, CString};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::baseline::RawPeer;
use super::Table;
use crate::driver::{Driver, DEMO_PTX};
use crate::frames;

pub fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The `empty` kernel of the demo module.
pub fn empty_kernel(d: &Driver) -> Result<*mut c_void> {
    let mut m = std::ptr::null_mut();
    let mut f = std::ptr::null_mut();
    let name = CString::new("empty")?;
    unsafe {
        d.check("cuModuleLoadData", (d.cuModuleLoadData)(&mut m, DEMO_PTX.as_ptr() as *const c_void))?;
        d.check("cuModuleGetFunction", (d.cuModuleGetFunction)(&mut f, m, name.as_ptr()))?;
    }
    Ok(f)
}

pub fn launch(d: &Driver, f: *mut c_void) -> crate::driver::CuResult {
    unsafe { (d.cuLaunchKernel)(f, 1, 1, 1, 32, 1, 1, 0, std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut()) }
}

pub fn run(d: &Driver, n: usize, t: &Table) -> Result<()> {
    let f = empty_kernel(d)?;
    d.check("cuLaunchKernel (empty kernel)", launch(d, f)).context("the launch test needs a backend that runs an empty kernel")?;
    unsafe { d.check("cuCtxSynchronize", (d.cuCtxSynchronize)())? };
    let deadline = Duration::from_secs(10);
    let (t0, c0) = (Instant::now(), thread_cpu());
    let mut count = 0;
    while count < n {
        for _ in 0..1000 {
            d.check("cuLaunchKernel", launch(d, f))?;
        }
        count += 1000;
        if t0.elapsed() > deadline {
            break;
        }
    }
    let cpu = thread_cpu() - c0;
    unsafe { d.check("cuCtxSynchronize", (d.cuCtxSynchronize)())? };
    let wall = t0.elapsed();

    // The same frames over raw TCP: batched 64 KiB at a time, one wait at the end.
    let frame = frames::launch_request(0);
    let batch = (64 << 10) / frame * frame;
    let up = vec![0u8; batch - 16];
    let mut ack = vec![0u8; frames::empty_reply()];
    let mut p = RawPeer::start()?;
    let total = count * frame;
    let r0 = Instant::now();
    let mut sent = 0;
    while sent + batch <= total {
        p.exchange(&up, &mut [])?;
        sent += batch;
    }
    p.exchange(&vec![0u8; (total - sent).max(16) - 16], &mut ack)?;
    let raw = r0.elapsed();

    let rate = count as f64 / wall.as_secs_f64();
    t.rate("async launches, sustained end to end", rate, count as f64 / raw.as_secs_f64(), "/s");
    t.time("client CPU per launch", cpu.as_secs_f64() * 1e6 / count as f64, 1.0, "us");
    t.note(&format!(
        "{count} launches; baseline: the same {frame}-byte frames over raw TCP in 64 KiB writes; \
         CPU baseline: the 1 us target; targets: >= 1 M/s, <= 1 us"
    ));
    Ok(())
}
