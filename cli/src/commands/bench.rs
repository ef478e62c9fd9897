//! `rgpu bench`: the data path against the limit measured on the same
//! machine in the same run.

use anyhow::Result;

use crate::bench::{self, Options};
use crate::server_process::ServerProcess;

/// Measure rgpu against raw TCP: round-trip latency, launch rate, copy
/// bandwidth and a mixed workload.
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
    /// Largest copy in the bandwidth test, in MiB (sizes go from 4 KiB by 4x).
    #[arg(long, default_value_t = 256)]
    max_copy_mib: usize,
    /// Only these benchmarks (latency, launch, bandwidth, mixed); default all.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
}

pub fn exec(a: Args) -> Result<i32> {
    let (_server, addr) = match a.server {
        Some(s) => (None, s),
        None => {
            let s = ServerProcess::start("auto")?;
            let addr = s.addr.clone();
            (Some(s), addr)
        }
    };
    bench::run(&Options {
        server: addr,
        round_trips: a.round_trips,
        launches: a.launches,
        max_copy: a.max_copy_mib << 20,
        only: a.only,
    })?;
    Ok(0)
}
