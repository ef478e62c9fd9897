//! `rgpu bench`: the data path against the limit measured on the same
//! machine in the same run; `--compare-tls`: the same benchmarks through a
//! TLS server and a plaintext one.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::bench::{self, Options, Row};
use crate::server_process::ServerProcess;
use crate::tls::{Pki, TlsArgs};

/// Measure rgpu against raw TCP: round-trip latency, launch rate, copy
/// bandwidth and a mixed workload.
#[derive(clap::Args)]
pub struct Args {
    /// Use this running server instead of starting one (reached as --tls-ca
    /// or --plaintext say; a server started here runs under TLS with a
    /// throwaway certificate unless --plaintext).
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
    /// Start a TLS server and a plaintext one and run the benchmarks through
    /// each, alternating, --rounds times; print TLS's figures against
    /// plaintext's (medians of the rounds).
    #[arg(long, conflicts_with = "server")]
    compare_tls: bool,
    /// Rounds of --compare-tls.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Write the rows measured, as JSON, to this file (what --compare-tls
    /// reads from its runs).
    #[arg(long, value_name = "FILE")]
    rows_out: Option<PathBuf>,
    #[command(flatten)]
    tls: TlsArgs,
}

pub fn exec(a: Args) -> Result<i32> {
    if a.compare_tls {
        return compare_tls(&a);
    }
    let mut pki = None;
    let (_server, addr, tls) = match &a.server {
        Some(s) => (None, s.clone(), a.tls.clone()),
        None => {
            let p = (!a.tls.plaintext).then(Pki::throwaway).transpose()?;
            let s = ServerProcess::start("auto", p.as_ref())?;
            let tls = p.as_ref().map_or_else(|| a.tls.clone(), TlsArgs::trusting);
            let addr = s.addr.clone();
            pki = p;
            (Some(s), addr, tls)
        }
    };
    // The shim reads these at cuInit, before any other thread of ours runs.
    tls.export()?;
    println!("rgpu bench: TLS {}", if tls.tls_ca.is_some() { "on" } else { "off (--plaintext)" });
    let rows = bench::run(&Options {
        server: addr,
        round_trips: a.round_trips,
        launches: a.launches,
        max_copy: a.max_copy_mib << 20,
        only: a.only.clone(),
    })?;
    if let Some(p) = &a.rows_out {
        std::fs::write(p, serde_json::to_vec(&rows)?).with_context(|| format!("cannot write {}", p.display()))?;
    }
    drop(pki);
    Ok(0)
}

/// Runs this command as a child against `server` with `tls`; its rows.
fn child_run(a: &Args, server: &str, tls: &TlsArgs, out: &std::path::Path) -> Result<Vec<Row>> {
    let exe = std::env::current_exe().context("cannot find the rgpu executable")?;
    let mut c = Command::new(exe);
    c.args(["bench", "--server", server, "--rows-out"])
        .arg(out)
        .args(["--round-trips", &a.round_trips.to_string(), "--launches", &a.launches.to_string()])
        .args(["--max-copy-mib", &a.max_copy_mib.to_string()]);
    if !a.only.is_empty() {
        c.args(["--only", &a.only.join(",")]);
    }
    for (k, v) in tls.env()? {
        match v {
            Some(v) => c.env(k, v),
            None => c.env_remove(k),
        };
    }
    let verbose = std::env::var_os("RGPU_BENCH_VERBOSE").is_some();
    c.stdin(Stdio::null()).stdout(if verbose { Stdio::inherit() } else { Stdio::null() });
    let status = c.status().context("cannot run the benchmark")?;
    if !status.success() {
        bail!("the benchmark against {server} failed ({status}); RGPU_BENCH_VERBOSE=1 shows its output");
    }
    Ok(serde_json::from_slice(&std::fs::read(out)?)?)
}

fn compare_tls(a: &Args) -> Result<i32> {
    let pki = Pki::throwaway()?;
    let tls_server = ServerProcess::start("auto", Some(&pki))?;
    let plain_server = ServerProcess::start("auto", None)?;
    let plain = TlsArgs { plaintext: true, ..TlsArgs::default() };
    let tls = TlsArgs::trusting(&pki);
    let out = pki.dir.join("rows.json");
    let (mut plain_rows, mut tls_rows): (Vec<Vec<Row>>, Vec<Vec<Row>>) = (Vec::new(), Vec::new());
    for round in 1..=a.rounds.max(1) {
        eprintln!("rgpu bench --compare-tls: round {round} of {}: plaintext, then TLS", a.rounds.max(1));
        plain_rows.push(child_run(a, &plain_server.addr, &plain, &out)?);
        tls_rows.push(child_run(a, &tls_server.addr, &tls, &out)?);
    }
    println!(
        "rgpu bench --compare-tls: the same benchmarks through a plaintext server ({}) and a TLS one ({}), {} round(s) each, alternating; medians of the rounds",
        plain_server.addr, tls_server.addr, a.rounds.max(1)
    );
    println!("{:<48} {:>15} {:>15} {:>10}", "benchmark", "plaintext", "TLS", "TLS/plain");
    let Some(first) = plain_rows.first() else { return Ok(0) };
    for (i, row) in first.iter().enumerate() {
        let pick = |runs: &[Vec<Row>]| {
            let mut v: Vec<f64> = runs.iter().filter_map(|r| r.get(i)).filter(|r| r.name == row.name).map(|r| r.rgpu).collect();
            if v.is_empty() {
                f64::NAN
            } else {
                bench::median(&mut v)
            }
        };
        let (p, t) = (pick(&plain_rows), pick(&tls_rows));
        println!("{:<48} {:>15} {:>15} {:>9.3}x", row.name, bench::fmt(p, &row.unit), bench::fmt(t, &row.unit), t / p);
    }
    println!("  (rates: TLS/plain below 1 is TLS's loss; times: above 1 is TLS's cost)");
    Ok(0)
}
