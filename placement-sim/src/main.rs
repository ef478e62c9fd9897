//! `rgpu-placement-sim`: runs every policy on every workload of a trace
//! folder (the published static experiment, then a dynamic replay) and
//! writes CSV, SVG plots and a Markdown summary. See `docs/placement.md`.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use clap::Parser;

use rgpu_placement_sim::pooling;
use rgpu_placement_sim::report::{mean, published, seeds_table, stddev, svg_plot, Replayed, SeedRuns};
use rgpu_placement_sim::sim::{overlay, peak_demand, run_dynamic, run_static, workload_of, DynamicRun, Kind, NODES_PER_LEAF, SIZES};
use rgpu_placement_sim::trace::{has_times, read_nodes, read_pods, workloads};
use rgpu_pool_broker::policies::TieRules;

#[derive(Parser, Debug)]
#[command(about = "Trace-driven simulation of the broker's placement policies (Alibaba openb trace)")]
struct Args {
    /// Folder with openb_node_list_gpu_node.csv and openb_pod_list_*.csv.
    #[arg(long, default_value = "../shared/traces/openb")]
    traces: PathBuf,
    /// Node list (default: <traces>/openb_node_list_gpu_node.csv).
    #[arg(long)]
    nodes: Option<PathBuf>,
    /// Output folder.
    #[arg(long, default_value = "docs/placement")]
    out: PathBuf,
    /// Seeds, "first..last" (inclusive) or a comma list.
    #[arg(long, default_value = "42..51")]
    seeds: String,
    /// Arrived demand to stop at, percent of the cluster's GPUs.
    #[arg(long, default_value_t = 130)]
    max_pct: u32,
    /// Workloads to run (names after openb_pod_list_); default all.
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<String>,
    /// Policies: random, best-fit, fgd, ours; default all.
    #[arg(long, value_delimiter = ',')]
    policies: Vec<String>,
    /// Parallel runs (threads).
    #[arg(long, default_value_t = 1)]
    jobs: usize,
    /// Skip the dynamic replay.
    #[arg(long)]
    no_dynamic: bool,
    /// Skip the static runs (the dynamic replay only).
    #[arg(long)]
    no_static: bool,
    /// Dynamic replay: every Nth GPU node (a smaller cluster of the same mix).
    #[arg(long, default_value_t = 8)]
    dyn_every: usize,
    /// Dynamic replay: lay copies of the trace over each other (each shifted
    /// by under a day) until their peak demand is this many times the
    /// replay cluster's GPUs.
    #[arg(long, default_value_t = 1.5)]
    dyn_load: f64,
    /// Dynamic replay: more overlay seeds ("first..last" or a comma list)
    /// for a table of means and paired differences against FGD; the
    /// detailed table is the first seed's. Default: the first of --seeds.
    #[arg(long)]
    dyn_seeds: Option<String>,
    /// Leave out some of rgpu's tie rules (keep-whole, model, by-demand,
    /// pack-gpu, pack-host) to measure what each does; the rgpu rows are
    /// then that variant's, and the summary says so.
    #[arg(long, value_delimiter = ',')]
    without: Vec<String>,
    /// Run the pooling experiment instead (GPUs on the pod's node against
    /// GPUs leased from any node; rgpu's policy; writes pooling.md).
    #[arg(long)]
    pooling: bool,
    /// Pooling: the node list with the CPU-only nodes (default:
    /// <traces>/openb_node_list_all_node.csv; nodes with 0 GPUs are used).
    #[arg(long)]
    all_nodes: Option<PathBuf>,
}

fn parse_seeds(s: &str) -> Result<Vec<u64>> {
    if let Some((a, b)) = s.split_once("..") {
        let (a, b): (u64, u64) = (a.trim().parse()?, b.trim().parse()?);
        if b < a {
            bail!("seed range {s} is empty");
        }
        return Ok((a..=b).collect());
    }
    s.split(',').map(|x| x.trim().parse::<u64>().with_context(|| format!("seed {x:?}"))).collect()
}

/// Runs `tasks` on `jobs` threads; results in task order.
fn par<T: Send + Sync, R: Send>(jobs: usize, tasks: Vec<T>, f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let n = tasks.len();
    let next = Mutex::new(0usize);
    let out: Mutex<Vec<Option<R>>> = Mutex::new((0..n).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..jobs.max(1).min(n.max(1)) {
            s.spawn(|| loop {
                let i = {
                    let mut g = next.lock().unwrap_or_else(|e| e.into_inner());
                    let i = *g;
                    *g += 1;
                    i
                };
                if i >= n {
                    break;
                }
                let r = f(&tasks[i]);
                out.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
            });
        }
    });
    out.into_inner().unwrap_or_else(|e| e.into_inner()).into_iter().flatten().collect()
}

fn main() -> Result<()> {
    let a = Args::parse();
    let started = Instant::now();
    let seeds = parse_seeds(&a.seeds)?;
    let kinds: Vec<Kind> = if a.policies.is_empty() {
        Kind::ALL.to_vec()
    } else {
        a.policies.iter().map(|p| Kind::parse(p).with_context(|| format!("unknown policy {p:?}"))).collect::<Result<_>>()?
    };
    let dseeds = match &a.dyn_seeds {
        Some(d) => parse_seeds(d)?,
        None => vec![seeds[0]],
    };
    if dseeds.len() > 1 && !(kinds.contains(&Kind::Fgd) && kinds.contains(&Kind::Ours)) {
        bail!("--dyn-seeds compares rgpu with FGD: --policies must name both fgd and ours");
    }
    let rules = TieRules::without(a.without.iter().map(String::as_str)).map_err(anyhow::Error::msg)?;
    let node_path = a.nodes.clone().unwrap_or_else(|| a.traces.join("openb_node_list_gpu_node.csv"));
    let nodes = read_nodes(&node_path)?;
    let mut wls = workloads(&a.traces)?;
    if !a.workloads.is_empty() {
        wls.retain(|(n, _)| a.workloads.contains(n));
    }
    let loaded: Vec<(String, Vec<_>)> = wls.iter().map(|(n, p)| Ok((n.clone(), read_pods(p)?))).collect::<Result<_>>()?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let gpus: u64 = nodes.iter().map(|n| n.gpus as u64).sum();
    eprintln!("{} nodes, {gpus} GPUs; {} workloads; {} policies; seeds {:?}; {} jobs", nodes.len(), loaded.len(), kinds.len(), seeds, a.jobs);

    if a.pooling {
        if rules != TieRules::ALL {
            bail!("--without measures rgpu's tie rules against FGD; the pooling experiment runs the broker's policy");
        }
        let all = read_nodes(&a.all_nodes.clone().unwrap_or_else(|| a.traces.join("openb_node_list_all_node.csv")))?;
        let cpu_nodes: Vec<_> = all.into_iter().filter(|n| n.gpus == 0).collect();
        if a.dyn_every == 0 {
            bail!("--dyn-every must be positive");
        }
        let rows = par(a.jobs, (0..loaded.len()).collect(), |&w| {
            pooling::run(&loaded[w].0, &loaded[w].1, &nodes, &cpu_nodes, &seeds, a.max_pct, a.dyn_every, a.dyn_load)
        });
        let mut md = String::from("# The pooling benefit (rgpu's policy)\n\n");
        let _ = writeln!(
            md,
            "{} GPU nodes ({gpus} GPUs) and {} CPU-only nodes; static: seeds {:?}, mean; dynamic replay: every {}th node of each, load {:.2}, seed {}. (a) a GPU pod's GPUs and CPU part on one GPU node, CPU-only pods on any node (CPU-only nodes first); (a') the CPU part on any node with room, the GPUs on one GPU node; (b) the CPU part on any node, GPUs from any GPU nodes.\n",
            nodes.len(),
            cpu_nodes.len(),
            seeds,
            a.dyn_every,
            a.dyn_load,
            seeds[0]
        );
        md.push_str(&pooling::table(&rows, a.max_pct));
        let _ = writeln!(md, "\nTook {:.0} s with {} job(s) on {}.", started.elapsed().as_secs_f64(), a.jobs, machine());
        std::fs::write(a.out.join("pooling.md"), &md)?;
        print!("{md}");
        return Ok(());
    }

    // ---- static: the published experiment ----
    let t_static = Instant::now();
    let mut tasks: Vec<(usize, Kind, u64)> = Vec::new();
    for w in (0..loaded.len()).filter(|_| !a.no_static) {
        for &k in &kinds {
            for &s in &seeds {
                tasks.push((w, k, s));
            }
        }
    }
    let dists: Vec<_> = loaded.iter().map(|(_, p)| workload_of(p)).collect();
    let results = par(a.jobs, tasks.clone(), |&(w, k, s)| {
        let t = Instant::now();
        let pol = k.policy_with(&dists[w], s, rules);
        let r = run_static(&nodes, &loaded[w].1, pol.as_ref(), s, a.max_pct);
        eprintln!("  {:<12} {:<16} seed {s}: {:.2}% ({:.1}s)", loaded[w].0, k.label(), 100.0 * r.ratio_at[a.max_pct as usize], t.elapsed().as_secs_f64());
        r
    });
    let static_secs = t_static.elapsed().as_secs_f64();
    let mut csv = String::from("workload,policy,seed,arrived_pct,gpu_alloc_pct\n");
    for ((w, k, s), r) in tasks.iter().zip(&results) {
        for (pct, v) in r.ratio_at.iter().enumerate() {
            let _ = writeln!(csv, "{},{},{s},{pct},{:.4}", loaded[*w].0, k.label(), 100.0 * v);
        }
    }
    std::fs::write(a.out.join("static.csv"), csv)?;

    let mut table = String::new();
    // The rgpu column: the default policy, or the variant when only it runs.
    let ours = if kinds.contains(&Kind::OursCpu) && !kinds.contains(&Kind::Ours) { Kind::OursCpu } else { Kind::Ours };
    let _ = writeln!(table, "| workload | random | best-fit | FGD | **{}** | rgpu - FGD | published random / best-fit / FGD |", ours.label());
    let _ = writeln!(table, "|---|---|---|---|---|---|---|");
    let mut summary = String::from("workload,policy,mean_pct,stddev_pct,seeds,published_pct\n");
    for (w, (name, _)) in loaded.iter().enumerate() {
        let mut cells = Vec::new();
        let mut by_kind = Vec::new();
        let mut series = Vec::new();
        for &k in &kinds {
            let runs: Vec<&_> = tasks.iter().zip(&results).filter(|((tw, tk, _), _)| *tw == w && *tk == k).map(|(_, r)| r).collect();
            let finals: Vec<f64> = runs.iter().map(|r| 100.0 * r.ratio_at[a.max_pct as usize]).collect();
            let (m, sd) = (mean(&finals), stddev(&finals));
            let pubv = published(name).and_then(|p| match k {
                Kind::Random => Some(p[0]),
                Kind::BestFit => Some(p[1]),
                Kind::Fgd => Some(p[2]),
                Kind::Ours | Kind::OursCpu => None,
            });
            let _ = writeln!(summary, "{name},{},{m:.3},{sd:.3},{},{}", k.label(), finals.len(), pubv.map_or(String::new(), |p| format!("{p:.2}")));
            cells.push(format!("{m:.2} ± {sd:.2}"));
            by_kind.push((k, m));
            let pts: Vec<(f64, f64)> = (0..=a.max_pct as usize).map(|p| (p as f64, 100.0 * mean(&runs.iter().map(|r| r.ratio_at[p]).collect::<Vec<_>>()))).collect();
            series.push((format!("{} ({m:.2}%)", k.label()), pts));
        }
        let get = |k: Kind| by_kind.iter().find(|x| x.0 == k).map(|x| x.1);
        let diff = match (get(ours), get(Kind::Fgd)) {
            (Some(o), Some(f)) => format!("{:+.2}", o - f),
            _ => "-".into(),
        };
        let cell = |k: Kind| kinds.iter().position(|&x| x == k).map_or("-".to_string(), |i| cells[i].clone());
        let pubs = published(name).map_or("-".into(), |p| format!("{:.2} / {:.2} / {:.2}", p[0], p[1], p[2]));
        let _ = writeln!(table, "| {name} | {} | {} | {} | **{}** | {diff} | {pubs} |", cell(Kind::Random), cell(Kind::BestFit), cell(Kind::Fgd), cell(ours));
        let svg = svg_plot(
            &format!("openb {name}: GPU allocation vs arrived demand (mean of {} seeds)", seeds.len()),
            "arrived GPU demand (% of cluster GPUs)",
            "GPU allocation ratio (%)",
            &series,
            (0.0, a.max_pct as f64),
            (0.0, 100.0),
            &format!("{} GPU nodes, {gpus} GPUs; synthetic topology: {NODES_PER_LEAF} GPU nodes per leaf in trace order", nodes.len()),
        );
        std::fs::write(a.out.join(format!("static_{name}.svg")), svg)?;
    }
    std::fs::write(a.out.join("static_summary.csv"), summary)?;

    // ---- dynamic replay ----
    let mut dyn_table = String::new();
    let mut dyn_secs = 0.0;
    if !a.no_dynamic {
        let t_dyn = Instant::now();
        // Files without times (multigpuN) have nothing to replay.
        let dtasks: Vec<(usize, Kind)> =
            (0..loaded.len()).filter(|&w| has_times(&loaded[w].1)).flat_map(|w| kinds.iter().map(move |&k| (w, k))).collect();
        if a.dyn_every == 0 || a.dyn_load <= 0.0 {
            bail!("--dyn-every and --dyn-load must be positive");
        }
        let dnodes: Vec<_> = nodes.iter().step_by(a.dyn_every).cloned().collect();
        let dcap: u64 = dnodes.iter().map(|n| n.gpus as u64 * 1000).sum();
        let replays: Vec<(usize, Vec<rgpu_placement_sim::trace::Pod>)> = (0..loaded.len())
            .filter(|&w| has_times(&loaded[w].1))
            .map(|w| {
                let peak = peak_demand(&loaded[w].1).max(1);
                let copies = ((a.dyn_load * dcap as f64) / peak as f64).ceil().max(1.0) as usize;
                (copies, overlay(&loaded[w].1, copies, seeds[0]))
            })
            .collect();
        let replay_of = |w: usize| -> &(usize, Vec<rgpu_placement_sim::trace::Pod>) {
            let i = (0..loaded.len()).filter(|&x| has_times(&loaded[x].1)).position(|x| x == w).expect("a replayed workload");
            &replays[i]
        };
        let dres: Vec<DynamicRun> = par(a.jobs, dtasks.clone(), |&(w, k)| {
            let t = Instant::now();
            let pol = k.policy_with(&dists[w], seeds[0], rules);
            let r = run_dynamic(&dnodes, &replay_of(w).1, pol.as_ref(), 400);
            eprintln!("  dynamic {:<12} {:<16}: mean {:.2}%, served {:.0} GPU-h, overloaded {:.2}%, p99 delay {}s, gave up {} ({:.1}s)", loaded[w].0, k.label(), 100.0 * r.mean_ratio, r.served_gpu_h, 100.0 * r.mean_ratio_overloaded, r.delay_p99, r.abandoned, t.elapsed().as_secs_f64());
            eprintln!("{}", why_lines(&loaded[w].0, k.label(), &r));
            r
        });
        dyn_secs = t_dyn.elapsed().as_secs_f64();
        let mut csv = String::from("workload,policy,time_s,gpu_alloc_pct\n");
        let _ = writeln!(
            dyn_table,
            "Replay cluster: every {}th GPU node, {} nodes, {} GPUs. Each workload's pods laid over each other in copies (each shifted by under a day, seed {}) until their peak demand is {:.2}x those GPUs: {}. Pods start at creation or, FIFO with backfill, when they fit; run their traced duration; give up when their traced deletion time passes. \"Overloaded\": while the demand offered (what would run if nothing waited) is at least the cluster's GPUs.\n",
            a.dyn_every,
            dnodes.len(),
            dcap / 1000,
            seeds[0],
            a.dyn_load,
            (0..loaded.len()).filter(|&w| has_times(&loaded[w].1)).map(|w| format!("{} {} copies", loaded[w].0, replay_of(w).0)).collect::<Vec<_>>().join(", ")
        );
        let _ = writeln!(dyn_table, "| workload | policy | mean GPU allocation | GPU time served (GPU-h) | overloaded: hours, mean allocation | GPU pods | started | waited | delay p50 / p99 | of those that waited: p50 / p99 | rejected (never fit) | gave up waiting: GPU pods (their GPUs) / CPU-only pods |");
        let _ = writeln!(dyn_table, "|---|---|---|---|---|---|---|---|---|---|---|---|");
        for ((w, k), r) in dtasks.iter().zip(&dres) {
            for (t, v) in &r.timeline {
                let _ = writeln!(csv, "{},{},{t},{:.4}", loaded[*w].0, k.label(), 100.0 * v);
            }
            let _ = writeln!(
                dyn_table,
                "| {} | {} | {:.2}% | {:.0} | {:.1} h, {:.2}% | {} | {} | {} | {} / {} s | {} / {} s | {} | {} ({:.0}) / {} |",
                loaded[*w].0, k.label(), 100.0 * r.mean_ratio, r.served_gpu_h, r.overloaded_s as f64 / 3600.0, 100.0 * r.mean_ratio_overloaded, r.gpu_pods, r.started, r.delayed, r.delay_p50, r.delay_p99, r.waited_p50, r.waited_p99, r.rejected, r.abandoned, r.abandoned_gpu_milli as f64 / 1000.0, r.abandoned_cpu_only
            );
        }
        std::fs::write(a.out.join("dynamic.csv"), csv)?;
        if dseeds.len() > 1 {
            let tasks: Vec<(usize, Kind, u64)> = dtasks
                .iter()
                .filter(|t| matches!(t.1, Kind::Fgd | Kind::Ours))
                .flat_map(|&(w, k)| dseeds.iter().map(move |&s| (w, k, s)))
                .collect();
            let got: Vec<Replayed> = par(a.jobs, tasks.clone(), |&(w, k, s)| {
                let t = Instant::now();
                let pods = overlay(&loaded[w].1, replay_of(w).0, s);
                let r = run_dynamic(&dnodes, &pods, k.policy_with(&dists[w], s, rules).as_ref(), 2);
                eprintln!("  dynamic {:<12} {:<16} seed {s}: served {:.0} GPU-h, gave up {} ({:.1}s)", loaded[w].0, k.label(), r.served_gpu_h, r.abandoned, t.elapsed().as_secs_f64());
                Replayed { gpu_h: r.served_gpu_h, gave_up: r.abandoned as f64 }
            });
            let of = |w: usize, k: Kind| -> Vec<Replayed> {
                dseeds.iter().map(|&s| got[tasks.iter().position(|t| *t == (w, k, s)).expect("every task ran")]).collect()
            };
            let mut ws: Vec<usize> = tasks.iter().map(|t| t.0).collect();
            ws.dedup();
            let rows: Vec<SeedRuns> = ws.iter().map(|&w| SeedRuns { workload: loaded[w].0.clone(), fgd: of(w, Kind::Fgd), ours: of(w, Kind::Ours) }).collect();
            dyn_table.push_str(&seeds_table(&dseeds, &rows));
        }
        for (w, (name, _)) in loaded.iter().enumerate().filter(|(w, _)| dtasks.iter().any(|t| t.0 == *w)) {
            let series: Vec<(String, Vec<(f64, f64)>)> = dtasks
                .iter()
                .zip(&dres)
                .filter(|((tw, _), _)| *tw == w)
                .map(|((_, k), r)| (format!("{} (mean {:.2}%)", k.label(), 100.0 * r.mean_ratio), r.timeline.iter().map(|&(t, v)| (t as f64 / 86400.0, 100.0 * v)).collect()))
                .collect();
            let days = series.iter().flat_map(|s| s.1.last()).map(|p| p.0).fold(1.0, f64::max).ceil();
            let svg = svg_plot(
                &format!("openb {name}: dynamic replay, GPU allocation over time"),
                "time since first creation (days)",
                "GPU allocation ratio (%)",
                &series,
                (0.0, days.max(1.0)),
                (0.0, 100.0),
                "pods start at creation or when they fit (FIFO with backfill), run their traced duration",
            );
            std::fs::write(a.out.join(format!("dynamic_{name}.svg")), svg)?;
        }
    }

    let total = started.elapsed().as_secs_f64();
    let machine = machine();
    let mut md = String::new();
    let _ = writeln!(md, "# Placement simulation results\n");
    if rules != TieRules::ALL {
        let _ = writeln!(md, "rgpu's rows are its policy without the tie rules {} (`--without`), not the broker's.\n", rules.left_out());
    }
    // --no-static: no table of zeros that reads as results.
    if !a.no_static {
        let _ = writeln!(md, "GPU allocation ratio (%) at {}% arrived demand, mean ± stddev over seeds {:?}; {} GPU nodes, {gpus} GPUs (`{}`); synthetic topology: {NODES_PER_LEAF} GPU nodes per leaf switch in trace order.\n", a.max_pct, seeds, nodes.len(), node_path.display());
        md.push_str(&table);
    }
    if !a.no_dynamic {
        let _ = writeln!(md, "\n## Dynamic replay (creation and deletion times)\n");
        md.push_str(&dyn_table);
    }
    let _ = writeln!(md, "\nStatic runs took {static_secs:.0} s, the dynamic replay {dyn_secs:.0} s, in all {total:.0} s with {} job(s) on {machine}.", a.jobs);
    std::fs::write(a.out.join("summary.md"), &md)?;
    print!("{md}");
    Ok(())
}

/// Why the GPU pods that gave up were kept out on arrival, by size.
fn why_lines(name: &str, policy: &str, r: &DynamicRun) -> String {
    let mut out = String::new();
    let w = &r.why;
    let n = r.abandoned.max(1) as f64;
    let _ = writeln!(out, "    why {name} {policy}: mean free GPU share at their arrival {:.1} GPUs ({:.1} on nodes with room for their CPU part)", w.free_milli_sum as f64 / n / 1000.0, w.free_on_host_ok_sum as f64 / n / 1000.0);
    for (k, size) in SIZES.iter().enumerate() {
        let g = w.gave_up[k];
        let tot: u64 = g.iter().sum();
        let _ = writeln!(
            out,
            "      {size:<13} started {:>7}, gave up {tot:>6} (mean duration {:>6.0} s): CPU {:>6}, memory {:>6}, fragmented {:>6}, full {:>6}",
            w.started[k],
            w.gave_up_dur_s[k] as f64 / tot.max(1) as f64,
            g[0], g[1], g[2], g[3]
        );
    }
    out
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|s| s.trim().to_string()))
        .unwrap_or_else(|| "an unknown CPU".into());
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{cpu} ({n} hardware threads available)")
}
