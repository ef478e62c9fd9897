//! Fast checks of the simulator on small crafted traces (CI runs these; the
//! full openb simulation is too heavy for CI).

use std::path::PathBuf;

use rgpu_placement_sim::sim::{overlay, peak_demand, run_dynamic, run_static, sample, workload_of, Kind};
use rgpu_placement_sim::trace::{read_nodes, read_pods, Node, Pod, TraceError};

fn node(name: &str, gpus: u32) -> Node {
    Node { name: name.into(), cpu_milli: 64_000, memory_mib: 262_144, gpus, model: "T4".into() }
}

fn pod(i: usize, num_gpu: u32, milli: u32) -> Pod {
    Pod {
        name: format!("p{i}"),
        cpu_milli: 1000,
        memory_mib: 1024,
        num_gpu,
        gpu_milli: if num_gpu == 1 { milli } else if num_gpu > 1 { 1000 } else { 0 },
        models: Vec::new(),
        creation: i as u64 * 10,
        deletion: Some(i as u64 * 10 + 100),
        scheduled: Some(i as u64 * 10),
    }
}

/// Fractions of 0.6 and whole 8-GPU pods: spreading 0.6s over nodes
/// (random) leaves no node free for the 8-GPU pods; packing keeps some.
fn crafted() -> (Vec<Node>, Vec<Pod>) {
    let nodes: Vec<Node> = (0..16).map(|i| node(&format!("n{i}"), 8)).collect();
    let mut pods = Vec::new();
    for i in 0..400 {
        pods.push(if i % 4 == 3 { pod(i, 8, 1000) } else { pod(i, 1, 600) });
    }
    (nodes, pods)
}

#[test]
fn sampling_is_the_papers_shuffled_trace_then_draws() {
    let (nodes, pods) = crafted();
    // The crafted trace asks for 980 GPUs: a 1,000-GPU cluster needs draws.
    let cap = 1_000_000u64;
    let s = sample(&pods, cap, 1.3, 42);
    // Every pod of the trace once, first, in a shuffled (not trace) order.
    let mut head: Vec<usize> = s[..pods.len()].to_vec();
    assert_ne!(head, (0..pods.len()).collect::<Vec<_>>(), "shuffled");
    head.sort_unstable();
    assert_eq!(head, (0..pods.len()).collect::<Vec<_>>(), "each trace pod once");
    // Then draws up to, not past, 1.3x; the next draw would have passed it.
    let total: u64 = s.iter().map(|&i| pods[i].gpu_demand()).sum();
    assert!(total <= cap * 13 / 10, "{total} <= {}", cap * 13 / 10);
    assert!(total + 1000 * 8 > cap * 13 / 10, "{total} close to the target");
    assert!(s.len() > pods.len());
    assert_eq!(s, sample(&pods, cap, 1.3, 42), "seeded");
    assert_ne!(s, sample(&pods, cap, 1.3, 43));
    // A trace asking for more than the target loses random pods instead.
    let small_cap: u64 = nodes.iter().map(|n| n.gpus as u64 * 1000).sum();
    let small = sample(&pods, small_cap, 1.3, 42);
    let t: u64 = small.iter().map(|&i| pods[i].gpu_demand()).sum();
    assert!(t <= small_cap * 13 / 10 && small.len() < pods.len());
    // Nothing to place: nothing sampled, no endless loop.
    let cpu_only: Vec<_> = pods.iter().cloned().map(|mut p| { p.num_gpu = 0; p.gpu_milli = 0; p }).collect();
    assert!(sample(&cpu_only, cap, 1.3, 42).is_empty());
    assert!(sample(&[], cap, 1.3, 42).is_empty());
}

#[test]
fn policies_rank_as_expected_on_a_crafted_trace() {
    let (nodes, pods) = crafted();
    let w = workload_of(&pods);
    let at = |k: Kind| {
        let runs: Vec<f64> = (42..47).map(|s| run_static(&nodes, &pods, k.policy(&w, s).as_ref(), s, 130).ratio_at[130]).collect();
        runs.iter().sum::<f64>() / runs.len() as f64
    };
    let (random, best, fgd, ours) = (at(Kind::Random), at(Kind::BestFit), at(Kind::Fgd), at(Kind::Ours));
    assert!(best > random, "best-fit {best} > random {random}");
    assert!(fgd > random, "fgd {fgd} > random {random}");
    assert!(ours >= fgd - 1e-9, "ours {ours} >= fgd {fgd}");
    assert!(ours <= 1.0 && random > 0.0);
}

#[test]
fn dynamic_replay_releases_and_queues() {
    let (nodes, pods) = crafted();
    let w = workload_of(&pods);
    let r = run_dynamic(&nodes[..2], &pods, Kind::Ours.policy(&w, 42).as_ref(), 50);
    assert_eq!(r.gpu_pods, pods.len());
    assert!(r.started > 0 && r.started + r.rejected + r.abandoned == r.gpu_pods, "{r:?}");
    assert!(!r.timeline.is_empty() && r.mean_ratio > 0.0);
    // Copies laid over each other: the peak grows, more pods wait or give
    // up, and while overloaded the cluster is busier than on average.
    let many = overlay(&pods, 6, 42);
    assert_eq!(many.len(), 6 * pods.len());
    assert!(peak_demand(&many) > peak_demand(&pods), "{} > {}", peak_demand(&many), peak_demand(&pods));
    let hot = run_dynamic(&nodes[..2], &many, Kind::Ours.policy(&w, 42).as_ref(), 50);
    assert_eq!(hot.started + hot.rejected + hot.abandoned, hot.gpu_pods);
    assert!(hot.delayed + hot.abandoned > r.delayed + r.abandoned, "{hot:?}");
    assert!(hot.overloaded_s > 0 && hot.mean_ratio_overloaded >= hot.mean_ratio, "{hot:?}");
}

fn write(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rgpu-psim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn malformed_lines_are_errors_naming_the_line() {
    let p = write("pods.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n\
        a,1000,1024,1,500,,LS,Running,0,10,0\n\
        b,1000,1024,1,1500,,LS,Running,0,10,0\n");
    match read_pods(&p) {
        Err(TraceError::Line { line: 3, .. }) => {}
        other => panic!("{other:?}"),
    }
    let p = write("nodes.csv", "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,x,T4\n");
    let e = read_nodes(&p).unwrap_err();
    assert!(e.to_string().contains(":2:"), "{e}");
}

#[test]
fn files_without_spec_or_times_read() {
    // multigpuN files carry only the first five columns.
    let p = write("short.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1000,1024,2,1000\nb,0,0,0,0\n");
    let pods = read_pods(&p).unwrap();
    assert_eq!(pods[0].gpu_demand(), 2000);
    assert!(pods[0].models.is_empty() && pods[0].deletion.is_none());
    assert!(!rgpu_placement_sim::trace::has_times(&pods));
}

/// The real trace, when CI has `../shared` beside the clone: parse every
/// file and run a short slice (a few seconds), not the full experiment.
#[test]
fn openb_trace_parses_and_a_slice_runs() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces/openb");
    if !dir.exists() {
        eprintln!("skipped: {} not found", dir.display());
        return;
    }
    let nodes = read_nodes(&dir.join("openb_node_list_gpu_node.csv")).unwrap();
    assert_eq!(nodes.iter().map(|n| n.gpus).sum::<u32>(), 6212);
    let pods = read_pods(&dir.join("openb_pod_list_default.csv")).unwrap();
    assert_eq!(pods.len(), 8152);
    let w = workload_of(&pods);
    let r = run_static(&nodes[..100], &pods, Kind::Ours.policy(&w, 42).as_ref(), 42, 130);
    assert!(r.ratio_at[130] > 0.5);
}

/// GPU nodes whose CPU the pods use up strand GPUs when a pod's GPUs must
/// sit beside its CPU part; with the CPU part on any node (a CPU-only node
/// here) they do not, and an 8-GPU pod that no node can hold alone runs
/// on GPUs leased from two nodes only when GPUs pool across nodes.
#[test]
fn pooling_removes_cpu_stranding_and_lets_gpus_come_from_several_nodes() {
    use rgpu_placement_sim::sim::{run_dynamic_in, run_static_in, Cluster, Pooling};
    // Two 4-GPU nodes with 8 cores each, one CPU-only node with 64.
    let gpu = |n: &str| Node { cpu_milli: 8_000, ..node(n, 4) };
    let nodes = vec![gpu("g0"), gpu("g1")];
    let cpu = vec![Node { gpus: 0, model: String::new(), ..node("c0", 0) }];
    // Whole-GPU pods with 4 cores each: two per node by CPU, so half the
    // GPUs strand when CPU must sit beside them.
    let pods: Vec<Pod> = (0..8).map(|i| Pod { cpu_milli: 4_000, ..pod(i, 1, 1000) }).collect();
    let w = workload_of(&pods);
    let at = |mode: Pooling, pods: &[Pod]| {
        let p = Kind::Ours.policy(&w, 42);
        run_static_in(Cluster::with(&nodes, &cpu, mode), pods, p.as_ref(), 42, 100).ratio_at[100]
    };
    assert!((at(Pooling::Node, &pods) - 0.5).abs() < 1e-9, "{}", at(Pooling::Node, &pods));
    assert!((at(Pooling::HostAnywhere, &pods) - 1.0).abs() < 1e-9);
    assert!((at(Pooling::Pooled, &pods) - 1.0).abs() < 1e-9);
    // One 8-GPU pod (1 core): no 8-GPU node, so only pooled GPUs hold it.
    let big = vec![Pod { cpu_milli: 1_000, ..pod(0, 8, 1000) }];
    assert_eq!(at(Pooling::HostAnywhere, &big), 0.0);
    assert!((at(Pooling::Pooled, &big) - 1.0).abs() < 1e-9);
    // In the dynamic replay the 8-GPU pod is rejected (it can never fit)
    // unless GPUs pool; the CPU-stranded pods wait and start later.
    let p = Kind::Ours.policy(&w, 42);
    let r = run_dynamic_in(Cluster::with(&nodes, &cpu, Pooling::Node), &big, p.as_ref(), 10);
    assert_eq!((r.rejected, r.started), (1, 0));
    let r = run_dynamic_in(Cluster::with(&nodes, &cpu, Pooling::Pooled), &big, p.as_ref(), 10);
    assert_eq!((r.rejected, r.started), (0, 1));
    let burst: Vec<Pod> = pods.iter().cloned().map(|mut q| { q.creation = 0; q.scheduled = Some(0); q.deletion = Some(1000); q }).collect();
    let r = run_dynamic_in(Cluster::with(&nodes, &cpu, Pooling::Node), &burst, p.as_ref(), 10);
    assert_eq!((r.started, r.delayed), (8, 4), "{r:?}");
    assert!((r.mean_ratio - 0.5).abs() < 1e-9);
    let r = run_dynamic_in(Cluster::with(&nodes, &cpu, Pooling::Pooled), &burst, p.as_ref(), 10);
    assert_eq!((r.started, r.delayed), (8, 0), "{r:?}");
    assert!((r.mean_ratio - 1.0).abs() < 1e-9);
}

/// A pod that gives up is told apart by what kept it out on arrival: a
/// GPU with room on a node short of CPU, or no GPU with room at all.
#[test]
fn give_ups_are_counted_by_what_kept_them_out() {
    let nodes = vec![Node { name: "n0".into(), cpu_milli: 8000, memory_mib: 262_144, gpus: 2, model: "T4".into() }];
    let at = |i: usize, num_gpu: u32, milli: u32, cpu: u64, from: u64, to: u64| Pod {
        cpu_milli: cpu,
        creation: from,
        deletion: Some(to),
        scheduled: Some(from),
        ..pod(i, num_gpu, milli)
    };
    let pods = vec![
        // Takes all the CPU and one GPU until t=1000.
        at(0, 1, 1000, 8000, 0, 1000),
        // A GPU has room, the CPU does not: gives up at t=100.
        at(1, 1, 300, 1000, 10, 100),
        // A whole GPU is free, the CPU is not: gives up at t=200.
        at(2, 1, 1000, 1000, 20, 200),
    ];
    let w = workload_of(&pods);
    let r = run_dynamic(&nodes, &pods, Kind::Fgd.policy(&w, 42).as_ref(), 10);
    assert_eq!(r.abandoned, 2, "{r:?}");
    // [size][cpu, memory, fragmented, full]
    assert_eq!(r.why.gave_up[0], [1, 0, 0, 0], "{:?}", r.why);
    assert_eq!(r.why.gave_up[2], [1, 0, 0, 0], "{:?}", r.why);
    assert_eq!(r.why.started[2], 1);
    // Where nothing has GPU room, the pod is counted as full.
    let pods = vec![at(0, 2, 1000, 1000, 0, 1000), at(1, 1, 500, 1000, 10, 100)];
    let r = run_dynamic(&nodes, &pods, Kind::Fgd.policy(&w, 42).as_ref(), 10);
    assert_eq!(r.why.gave_up[1], [0, 0, 0, 1], "{:?}", r.why);
}
