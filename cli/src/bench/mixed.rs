//! A mixed trace: kernel launches interleaved with small host-to-device
//! copies, a synchronisation every N launches; against raw TCP carrying the
//! same frames with the same waits.

use std::ffi::c_void;
use std::time::Instant;

use anyhow::Result;

use super::baseline::RawPeer;
use super::launch::{empty_kernel, launch};
use super::Table;
use crate::driver::Driver;
use crate::frames;

const ITERATIONS: usize = 100_000;
const COPY: usize = 4 << 10;
const SYNC_EVERY: usize = 100;

pub fn run(d: &Driver, t: &Table) -> Result<()> {
    let f = empty_kernel(d)?;
    let mut dev = 0u64;
    let host = vec![3u8; COPY];
    unsafe { d.check("cuMemAlloc", (d.cuMemAlloc_v2)(&mut dev, COPY))? };

    let t0 = Instant::now();
    for i in 1..=ITERATIONS {
        d.check("cuLaunchKernel", launch(d, f))?;
        unsafe { d.check("cuMemcpyHtoD", (d.cuMemcpyHtoD_v2)(dev, host.as_ptr() as *const c_void, COPY))? };
        if i % SYNC_EVERY == 0 {
            unsafe { d.check("cuCtxSynchronize", (d.cuCtxSynchronize)())? };
        }
    }
    let rgpu = t0.elapsed();
    unsafe { d.check("cuMemFree", (d.cuMemFree_v2)(dev))? };

    // The same bytes: each sync interval's frames in one write, then a
    // synchronising request and its reply.
    let per = frames::launch_request(0) + frames::htod_request(COPY);
    let interval = vec![0u8; per * SYNC_EVERY + frames::ctx_synchronize_request() - 16];
    let mut reply = vec![0u8; frames::empty_reply()];
    let mut p = RawPeer::start()?;
    let r0 = Instant::now();
    for _ in 0..ITERATIONS / SYNC_EVERY {
        p.exchange(&interval, &mut reply)?;
    }
    let raw = r0.elapsed();
    t.rate(
        "mixed: launch + 4 KiB copy, sync every 100",
        ITERATIONS as f64 / rgpu.as_secs_f64(),
        ITERATIONS as f64 / raw.as_secs_f64(),
        "/s",
    );
    t.note(&format!("{ITERATIONS} (launch, copy) pairs; baseline: the same frames over raw TCP, one write and one wait per sync"));
    Ok(())
}
