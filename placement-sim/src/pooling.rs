//! The pooling experiment (issue 18): the same workload placed three ways
//! ([`Pooling`]), so the GPU allocation that pooling GPUs across servers
//! gains is measured, and split into what removing CPU/memory stranding
//! gives (the CPU part anywhere) and what leasing GPUs from several nodes
//! adds. The policy is rgpu's (`fgd-pack`) in all three.

use std::fmt::Write as _;

use crate::report::mean;
use crate::sim::{overlay, peak_demand, run_dynamic_in, run_static_in, workload_of, Cluster, Kind, Pooling};
use crate::trace::{has_times, Node, Pod};

/// One workload's figures, per [`Pooling::ALL`] mode.
#[derive(Debug, Clone)]
pub struct Row {
    pub workload: String,
    /// Mean GPU allocation (%) at `max_pct` arrived demand over the seeds.
    pub static_pct: [f64; 3],
    /// Mean GPU allocation (%) over the dynamic replay; None without times.
    pub dynamic_pct: Option<[f64; 3]>,
    /// GPU pods that gave up waiting in the replay.
    pub gave_up: Option<[usize; 3]>,
}

/// Static runs (seeds, `max_pct`) on `gpu_nodes` + `cpu_nodes`, and the
/// dynamic replay on every `dyn_every`th node of each at `dyn_load`.
#[allow(clippy::too_many_arguments)]
pub fn run(
    name: &str,
    pods: &[Pod],
    gpu_nodes: &[Node],
    cpu_nodes: &[Node],
    seeds: &[u64],
    max_pct: u32,
    dyn_every: usize,
    dyn_load: f64,
) -> Row {
    let w = workload_of(pods);
    let mut static_pct = [0.0; 3];
    for (m, &mode) in Pooling::ALL.iter().enumerate() {
        let finals: Vec<f64> = seeds
            .iter()
            .map(|&s| {
                let pol = Kind::Ours.policy(&w, s);
                let r = run_static_in(Cluster::with(gpu_nodes, cpu_nodes, mode), pods, pol.as_ref(), s, max_pct);
                100.0 * r.ratio_at[max_pct as usize]
            })
            .collect();
        static_pct[m] = mean(&finals);
    }
    let (mut dynamic_pct, mut gave_up) = (None, None);
    if has_times(pods) {
        let g: Vec<Node> = gpu_nodes.iter().step_by(dyn_every).cloned().collect();
        let c: Vec<Node> = cpu_nodes.iter().step_by(dyn_every).cloned().collect();
        let cap: u64 = g.iter().map(|n| n.gpus as u64 * 1000).sum();
        let copies = ((dyn_load * cap as f64) / peak_demand(pods).max(1) as f64).ceil().max(1.0) as usize;
        let replay = overlay(pods, copies, seeds.first().copied().unwrap_or(42));
        let (mut d, mut u) = ([0.0; 3], [0; 3]);
        for (m, &mode) in Pooling::ALL.iter().enumerate() {
            let pol = Kind::Ours.policy(&w, seeds.first().copied().unwrap_or(42));
            let r = run_dynamic_in(Cluster::with(&g, &c, mode), &replay, pol.as_ref(), 50);
            d[m] = 100.0 * r.mean_ratio;
            u[m] = r.abandoned;
            eprintln!(
                "  pooling {name} replay, {}: started {} of {} GPU pods, waited {}, rejected {}, gave up {} ({:.0} GPUs)",
                mode.label(),
                r.started,
                r.gpu_pods,
                r.delayed,
                r.rejected,
                r.abandoned,
                r.abandoned_gpu_milli as f64 / 1000.0
            );
        }
        dynamic_pct = Some(d);
        gave_up = Some(u);
    }
    eprintln!("  pooling {name:<12} static {static_pct:.2?} dynamic {dynamic_pct:.2?} gave up {gave_up:?}");
    Row { workload: name.to_string(), static_pct, dynamic_pct, gave_up }
}

/// The Markdown table of `rows`.
pub fn table(rows: &[Row], max_pct: u32) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "| workload | (a) as the trace ran | (a') CPU part anywhere | (b) rgpu pooled | gain (b - a) | of it from CPU/memory stranding (a' - a) | dynamic replay (a) / (a') / (b) | gave up (a) / (a') / (b) |"
    );
    let _ = writeln!(t, "|---|---|---|---|---|---|---|---|");
    for r in rows {
        let [a, a2, b] = r.static_pct;
        let gain = b - a;
        let share = if gain.abs() > 1e-9 { format!("{:+.2} ({:.0}%)", a2 - a, 100.0 * (a2 - a) / gain) } else { format!("{:+.2}", a2 - a) };
        let dynamic = r.dynamic_pct.map_or("-".into(), |d| format!("{:.2}% / {:.2}% / {:.2}%", d[0], d[1], d[2]));
        let gave = r.gave_up.map_or("-".into(), |g| format!("{} / {} / {}", g[0], g[1], g[2]));
        let _ = writeln!(t, "| {} | {a:.2} | {a2:.2} | {b:.2} | {gain:+.2} | {share} | {dynamic} | {gave} |", r.workload);
    }
    let _ = writeln!(t, "\nStatic columns: GPU allocation ratio (%) at {max_pct}% arrived GPU demand.");
    t
}
