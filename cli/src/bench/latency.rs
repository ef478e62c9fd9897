//! A synchronising call's round trip against a raw ping-pong of the same sizes.

use std::time::Instant;

use anyhow::Result;

use super::baseline::RawPeer;
use super::{median, p99, Table};
use crate::driver::Driver;
use crate::frames;

pub fn run(d: &Driver, n: usize, t: &Table) -> Result<()> {
    let (req, rep) = (frames::stream_query_request(), frames::empty_reply());
    let mut raw = raw_round_trips(n, req, rep)?;
    let mut shim = shim_round_trips(d, n)?;
    t.time("sync round trip, median (cuStreamQuery)", median(&mut shim), median(&mut raw), "us");
    t.time("sync round trip, p99", p99(&mut shim), p99(&mut raw), "us");
    t.note(&format!("baseline: raw TCP ping-pong of {req} + {rep} bytes, rgpu's frame sizes; {n} round trips each"));
    Ok(())
}

fn raw_round_trips(n: usize, req: usize, rep: usize) -> Result<Vec<f64>> {
    let mut p = RawPeer::start()?;
    // The 16-byte command stands in for the frame header's 24 bytes.
    let up = vec![1u8; req.saturating_sub(16)];
    let mut down = vec![0u8; rep];
    let mut lat = Vec::with_capacity(n);
    for i in 0..n + 500 {
        let t = Instant::now();
        p.exchange(&up, &mut down)?;
        if i >= 500 {
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(lat)
}

fn shim_round_trips(d: &Driver, n: usize) -> Result<Vec<f64>> {
    let mut s = std::ptr::null_mut();
    unsafe { d.check("cuStreamCreate", (d.cuStreamCreate)(&mut s, 0))? };
    let mut lat = Vec::with_capacity(n);
    for i in 0..n + 500 {
        let t = Instant::now();
        let r = unsafe { (d.cuStreamQuery)(s) };
        if i >= 500 {
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        d.check("cuStreamQuery", r)?;
    }
    unsafe { d.check("cuStreamDestroy", (d.cuStreamDestroy_v2)(s))? };
    Ok(lat)
}
