//! The data-path benchmarks behind `rgpu bench`. Each one runs the same
//! pattern twice in one process: through the shim against a server, and as a
//! raw TCP exchange of the same bytes on the same machine (the limit any
//! remoting over this network could reach), and prints the ratio.
//!
//! - `latency`: a synchronising call (cuStreamQuery on an idle stream) vs a
//!   raw ping-pong of the same frame sizes;
//! - `launch`: back-to-back asynchronous launches of an empty kernel:
//!   sustained rate end to end and client CPU time per launch;
//! - `bandwidth`: host->device and device->host copies, pageable and pinned,
//!   4 KiB up, vs raw TCP moving the same sizes with the same round trips;
//! - `mixed`: launches interleaved with small copies and a sync every N
//!   launches, vs raw TCP carrying the same frames with the same waits.

mod bandwidth;
mod baseline;
mod latency;
mod launch;
mod mixed;

use anyhow::Result;

use crate::driver::Driver;

pub struct Options {
    pub server: String,
    pub round_trips: usize,
    pub launches: usize,
    pub max_copy: usize,
    pub only: Vec<String>,
}

impl Options {
    fn wants(&self, name: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|o| o == name)
    }
}

/// One measured row: rgpu's figure and the baseline's.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Row {
    pub name: String,
    pub rgpu: f64,
    pub baseline: f64,
    pub unit: String,
    /// A rate (more is better) rather than a time.
    pub rate: bool,
}

pub fn run(o: &Options) -> Result<Vec<Row>> {
    // The shim reads its servers at cuInit, before any thread of ours that
    // could read the environment exists.
    std::env::set_var("RGPU_SERVERS", &o.server);
    let d = Driver::load(&crate::paths::shim()?)?;
    d.open_device(0)?;
    println!("rgpu bench: server {}, device 0 = {}", o.server, d.device_name(0));
    let t = Table::header();
    if o.wants("latency") {
        latency::run(&d, o.round_trips, &t)?;
    }
    if o.wants("launch") {
        launch::run(&d, o.launches, &t)?;
    }
    if o.wants("bandwidth") {
        bandwidth::run(&d, o.max_copy, &t)?;
    }
    if o.wants("mixed") {
        mixed::run(&d, &t)?;
    }
    Ok(t.rows.take())
}

/// Prints result rows: name, rgpu, baseline, ratio; keeps them for the
/// caller (`--compare-tls` compares two runs' rows).
pub struct Table {
    rows: std::cell::RefCell<Vec<Row>>,
}

impl Table {
    fn header() -> Table {
        println!("{:<48} {:>15} {:>15} {:>8}", "benchmark", "rgpu", "baseline", "ratio");
        Table { rows: Default::default() }
    }

    fn keep(&self, name: &str, rgpu: f64, baseline: f64, unit: &str, rate: bool) {
        self.rows.borrow_mut().push(Row { name: name.into(), rgpu, baseline, unit: unit.into(), rate });
    }

    /// A row where bigger is better (rates): ratio = rgpu / baseline.
    fn rate(&self, name: &str, rgpu: f64, base: f64, unit: &str) {
        println!("{name:<48} {:>15} {:>15} {:>7.2}x", fmt(rgpu, unit), fmt(base, unit), rgpu / base);
        self.keep(name, rgpu, base, unit, true);
    }

    /// A row where smaller is better (times): ratio = rgpu / baseline.
    fn time(&self, name: &str, rgpu: f64, base: f64, unit: &str) {
        println!("{name:<48} {:>15} {:>15} {:>7.2}x", fmt(rgpu, unit), fmt(base, unit), rgpu / base);
        self.keep(name, rgpu, base, unit, false);
    }

    fn note(&self, text: &str) {
        println!("  ({text})");
    }
}

pub fn fmt(v: f64, unit: &str) -> String {
    match unit {
        "us" => format!("{v:.2} us"),
        "/s" if v >= 1e6 => format!("{:.2} M/s", v / 1e6),
        "/s" => format!("{:.0} /s", v),
        "MiB/s" => format!("{v:.0} MiB/s"),
        u => format!("{v:.2} {u}"),
    }
}

/// Median of a sample (sorted in place).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn p99(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[(v.len() * 99) / 100]
}
