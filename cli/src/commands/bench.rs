//! `rgpu bench`: the data path against the limit measured on the same
//! machine in the same run. Prints each result with its baseline and ratio.
//!
//! - round trip: a synchronising call through the shim (cuStreamQuery on an
//!   idle stream) vs a raw TCP ping-pong of the same sizes;
//! - launches: back-to-back asynchronous launches of an empty kernel:
//!   sustained launches/s end to end, and client CPU time per launch.

use std::ffi::{c_void, CString};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::driver::{Driver, DEMO_PTX};
use crate::server_process::ServerProcess;

#[derive(clap::Args)]
pub struct Args {
    /// Use this running server instead of starting one.
    #[arg(long)]
    server: Option<String>,
    /// Round trips measured for each of the shim and raw TCP.
    #[arg(long, default_value_t = 20_000)]
    round_trips: usize,
    /// Launches in the launch-rate test (stops early after 10 s).
    #[arg(long, default_value_t = 1_000_000)]
    launches: usize,
}

/// Bytes of a synchronising request and of its reply on our wire: the 24-byte
/// frame header plus the capnp message (segment table and the struct).
const REQUEST_BYTES: usize = 24 + 8 + 24;
const REPLY_BYTES: usize = 24 + 8 + 24;

pub fn exec(a: Args) -> Result<i32> {
    let (_server, addr) = match a.server {
        Some(s) => (None, s),
        None => {
            let s = ServerProcess::start("auto")?;
            let addr = s.addr.clone();
            (Some(s), addr)
        }
    };
    std::env::set_var("RGPU_SERVERS", &addr);
    let d = Driver::load(&crate::paths::shim()?)?;
    d.open_device(0)?;
    println!("rgpu bench: server {addr}, device 0 = {}", d.device_name(0));
    println!("{:<44} {:>14} {:>14} {:>8}", "benchmark", "rgpu", "baseline", "ratio");

    let raw = raw_tcp_round_trips(a.round_trips)?;
    let shim = shim_round_trips(&d, a.round_trips)?;
    println!(
        "{:<44} {:>11.1} us {:>11.1} us {:>7.2}x",
        "sync round trip, median (cuStreamQuery)",
        shim.0,
        raw.0,
        shim.0 / raw.0
    );
    println!("{:<44} {:>11.1} us {:>11.1} us {:>7.2}x", "sync round trip, p99", shim.1, raw.1, shim.1 / raw.1);

    let l = launch_rate(&d, a.launches)?;
    println!(
        "{:<44} {:>11.0} /s {:>11.0} /s {:>7.2}x",
        "async launches, sustained end to end",
        l.rate,
        1_000_000.0,
        l.rate / 1_000_000.0
    );
    println!(
        "{:<44} {:>11.3} us {:>11.3} us {:>7.2}x",
        "client CPU per launch",
        l.cpu_us,
        1.0,
        l.cpu_us / 1.0
    );
    println!(
        "(round-trip baseline: raw TCP ping-pong of {REQUEST_BYTES}+{REPLY_BYTES} bytes on loopback, same process; \
         launch baselines: the targets 1,000,000/s and 1 us; {} launches)",
        l.count
    );
    Ok(0)
}

fn percentiles(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|x, y| x.total_cmp(y));
    (v[v.len() / 2], v[(v.len() * 99) / 100])
}

fn raw_tcp_round_trips(n: usize) -> Result<(f64, f64)> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = l.accept()?;
        s.set_nodelay(true)?;
        let mut req = [0u8; REQUEST_BYTES];
        let rep = [7u8; REPLY_BYTES];
        loop {
            if s.read_exact(&mut req).is_err() {
                return Ok(());
            }
            s.write_all(&rep)?;
        }
    });
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    let req = [1u8; REQUEST_BYTES];
    let mut rep = [0u8; REPLY_BYTES];
    let mut lat = Vec::with_capacity(n);
    for i in 0..n + 500 {
        let t = Instant::now();
        c.write_all(&req)?;
        c.read_exact(&mut rep)?;
        if i >= 500 {
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    drop(c);
    let _ = echo.join();
    Ok(percentiles(lat))
}

fn shim_round_trips(d: &Driver, n: usize) -> Result<(f64, f64)> {
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
    Ok(percentiles(lat))
}

struct Launches {
    count: usize,
    rate: f64,
    cpu_us: f64,
}

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn launch_rate(d: &Driver, n: usize) -> Result<Launches> {
    let mut m = std::ptr::null_mut();
    let mut f = std::ptr::null_mut();
    let name = CString::new("empty")?;
    unsafe {
        d.check("cuModuleLoadData", (d.cuModuleLoadData)(&mut m, DEMO_PTX.as_ptr() as *const c_void))?;
        d.check("cuModuleGetFunction", (d.cuModuleGetFunction)(&mut f, m, name.as_ptr()))?;
    }
    let launch = || unsafe {
        (d.cuLaunchKernel)(f, 1, 1, 1, 32, 1, 1, 0, std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut())
    };
    d.check("cuLaunchKernel (empty kernel)", launch()).context("the launch-rate test needs a backend that runs an empty kernel")?;
    unsafe { d.check("cuCtxSynchronize", (d.cuCtxSynchronize)())? };
    let deadline = Duration::from_secs(10);
    let (t0, c0) = (Instant::now(), thread_cpu());
    let mut count = 0;
    while count < n {
        for _ in 0..1000 {
            d.check("cuLaunchKernel", launch())?;
        }
        count += 1000;
        if t0.elapsed() > deadline {
            break;
        }
    }
    let cpu = thread_cpu() - c0;
    unsafe { d.check("cuCtxSynchronize", (d.cuCtxSynchronize)())? };
    let wall = t0.elapsed();
    Ok(Launches { count, rate: count as f64 / wall.as_secs_f64(), cpu_us: cpu.as_secs_f64() * 1e6 / count as f64 })
}
