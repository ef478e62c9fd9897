//! Copy bandwidth, both directions, pageable and pinned host memory, vs raw
//! TCP moving the same bytes with the same number of round trips.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use anyhow::Result;

use super::baseline::RawPeer;
use super::{median, Table};
use crate::driver::Driver;
use crate::frames;

/// Time spent on one (size, mode) cell at most.
const CELL_BUDGET: Duration = Duration::from_secs(2);

fn reps(size: usize) -> usize {
    ((256usize << 20) / size).clamp(5, 300)
}

/// Median seconds per repetition of `a` and of `b`, their repetitions
/// alternating so that both see the same moments of a noisy machine.
fn time2(size: usize, mut a: impl FnMut() -> Result<()>, mut b: impl FnMut() -> Result<()>) -> Result<(f64, f64)> {
    a()?; // warm-up: first touch of device and host pages
    b()?;
    let (mut va, mut vb) = (Vec::new(), Vec::new());
    let t0 = Instant::now();
    for _ in 0..reps(size) {
        let t = Instant::now();
        a()?;
        va.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        b()?;
        vb.push(t.elapsed().as_secs_f64());
        if t0.elapsed() > CELL_BUDGET && va.len() >= 3 {
            break;
        }
    }
    Ok((median(&mut va), median(&mut vb)))
}

fn mib_s(size: usize, secs: f64) -> f64 {
    size as f64 / (1 << 20) as f64 / secs
}

fn label(size: usize) -> String {
    if size >= 1 << 20 {
        format!("{} MiB", size >> 20)
    } else {
        format!("{} KiB", size >> 10)
    }
}

pub fn run(d: &Driver, max: usize, t: &Table) -> Result<()> {
    let mut dev = 0u64;
    let mut pinned: *mut c_void = std::ptr::null_mut();
    let mut stream = std::ptr::null_mut();
    let mut pageable = vec![1u8; max];
    unsafe {
        d.check("cuMemAlloc", (d.cuMemAlloc_v2)(&mut dev, max))?;
        d.check("cuMemHostAlloc", (d.cuMemHostAlloc)(&mut pinned, max, 0))?;
        d.check("cuStreamCreate", (d.cuStreamCreate)(&mut stream, 0))?;
    }
    let mut raw = RawPeer::start()?;
    let (sync_req, reply, dtoh_req) = (frames::ctx_synchronize_request(), frames::empty_reply(), frames::dtoh_request());
    let mut answer = vec![0u8; max + reply];
    let upload = vec![0u8; max + 4096];

    let mut size = 4 << 10;
    while size <= max {
        // Host to device: the copy frame, then a synchronising call.
        let mut raw_h2d_once = || -> Result<()> {
            raw.exchange(&upload[..frames::htod_request(size) + sync_req - 16], &mut answer[..reply])?;
            Ok(())
        };
        let (h2d, raw_h2d) = time2(
            size,
            || unsafe {
                d.check("cuMemcpyHtoD", (d.cuMemcpyHtoD_v2)(dev, pageable.as_ptr() as *const c_void, size))?;
                d.check("cuCtxSynchronize", (d.cuCtxSynchronize)())
            },
            &mut raw_h2d_once,
        )?;
        let (h2d_pinned, raw_h2d_2) = time2(
            size,
            || unsafe {
                d.check("cuMemcpyHtoDAsync", (d.cuMemcpyHtoDAsync_v2)(dev, pinned, size, stream))?;
                d.check("cuStreamSynchronize", (d.cuStreamSynchronize)(stream))
            },
            &mut raw_h2d_once,
        )?;
        // Device to host: one request, the reply carries the bytes.
        let mut raw_d2h_once = || -> Result<()> {
            raw.exchange(&upload[..dtoh_req - 16], &mut answer[..size + reply])?;
            Ok(())
        };
        let (d2h, raw_d2h) = time2(
            size,
            || unsafe { d.check("cuMemcpyDtoH", (d.cuMemcpyDtoH_v2)(pageable.as_mut_ptr() as *mut c_void, dev, size)) },
            &mut raw_d2h_once,
        )?;
        let (d2h_pinned, raw_d2h_2) = time2(
            size,
            || unsafe {
                d.check("cuMemcpyDtoHAsync", (d.cuMemcpyDtoHAsync_v2)(pinned, dev, size, stream))?;
                d.check("cuStreamSynchronize", (d.cuStreamSynchronize)(stream))
            },
            &mut raw_d2h_once,
        )?;
        let l = label(size);
        t.rate(&format!("host->device {l}, pageable"), mib_s(size, h2d), mib_s(size, raw_h2d), "MiB/s");
        t.rate(&format!("host->device {l}, pinned"), mib_s(size, h2d_pinned), mib_s(size, raw_h2d_2), "MiB/s");
        t.rate(&format!("device->host {l}, pageable"), mib_s(size, d2h), mib_s(size, raw_d2h), "MiB/s");
        t.rate(&format!("device->host {l}, pinned"), mib_s(size, d2h_pinned), mib_s(size, raw_d2h_2), "MiB/s");
        size *= 4;
    }
    t.note("median of repeated copies, rgpu and baseline repetitions alternating; baseline: raw TCP moving the same bytes with the same round trips; target >= 0.90x from 1 MiB up");
    unsafe {
        d.check("cuStreamDestroy", (d.cuStreamDestroy_v2)(stream))?;
        d.check("cuMemFreeHost", (d.cuMemFreeHost)(pinned))?;
        d.check("cuMemFree", (d.cuMemFree_v2)(dev))?;
    }
    Ok(())
}
