//! Several devices: two servers with one device each (server 1's device is
//! device 0), and one server with two devices.

use rgpu_integration::*;
use std::time::Duration;

const MEM_A: u64 = 2 << 30;
const MEM_B: u64 = 3 << 30;

fn check_order(out: &RunOutput, servers: &[&Server], mems: [u64; 2]) {
    for (dev, mem) in mems.iter().enumerate() {
        let want = format!("device {dev} totalGlobalMem {mem}");
        assert!(
            out.ok_lines().iter().any(|l| *l == want),
            "expected '{want}' (devices in server order)\n{}",
            out.describe(servers)
        );
    }
}

fn two_servers(variant: Variant) {
    let exe = build("rt_two_devices", variant);
    let a = Server::start(ServerOpts { devices: 1, memory: MEM_A, ..ServerOpts::default() });
    let b = Server::start(ServerOpts { devices: 1, memory: MEM_B, ..ServerOpts::default() });
    let out = run_on(&[&a, &b], &exe, &[]);
    out.assert_pass("rt_two_devices", &[&a, &b]);
    check_order(&out, &[&a, &b], [MEM_A, MEM_B]);

    // The other order: devices swap.
    let out = run_on(&[&b, &a], &exe, &[]);
    out.assert_pass("rt_two_devices", &[&b, &a]);
    check_order(&out, &[&b, &a], [MEM_B, MEM_A]);
}

fn one_server(variant: Variant) {
    let exe = build("rt_two_devices", variant);
    let s = Server::start(ServerOpts { devices: 2, memory: MEM_A, ..ServerOpts::default() });
    let out = run_on(&[&s], &exe, &[]);
    out.assert_pass("rt_two_devices", &[&s]);
    check_order(&out, &[&s], [MEM_A, MEM_A]);
}

mod two_servers {
    use super::*;
    #[test]
    fn cudart13_shared() {
        two_servers(Variant::Cudart13Shared)
    }
    #[test]
    fn cudart13_static() {
        two_servers(Variant::Cudart13Static)
    }
    #[test]
    fn cudart12_shared() {
        two_servers(Variant::Cudart12Shared)
    }
}

mod one_server_two_devices {
    use super::*;
    #[test]
    fn cudart13_shared() {
        one_server(Variant::Cudart13Shared)
    }
    #[test]
    fn cudart13_static() {
        one_server(Variant::Cudart13Static)
    }
    #[test]
    fn cudart12_shared() {
        one_server(Variant::Cudart12Shared)
    }
}

/// `rgpu smi` lists what a program would see: every device of every server, in CUDA's order,
/// with NVML-style UUIDs and the servers' names for them.
#[test]
fn smi_lists_the_devices_in_cuda_order() {
    let a = Server::start(ServerOpts { devices: 1, memory: MEM_A, ..ServerOpts::default() });
    let b = Server::start(ServerOpts { devices: 2, memory: MEM_B, ..ServerOpts::default() });
    let servers = format!("{},{}", a.addr_string(), b.addr_string());
    let out = std::process::Command::new(&binaries().rgpu)
        .args(["smi", "--json", "--plaintext", "--server", &servers])
        .output()
        .expect("rgpu smi runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let gpus: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let gpus = gpus.as_array().expect("a list");
    assert_eq!(gpus.len(), 3);
    let mem: Vec<u64> = gpus.iter().map(|g| g["memory_total"].as_u64().unwrap()).collect();
    assert_eq!(mem, vec![MEM_A, MEM_B, MEM_B], "server order, then device order");
    let used: Vec<u64> = gpus.iter().map(|g| g["memory_used"].as_u64().expect("memory use known")).collect();
    assert_eq!(used, vec![0, 0, 0], "nothing allocated yet");
    assert!(gpus.iter().all(|g| g["processes"].as_array().is_some_and(|p| p.is_empty())), "no process yet");
    for (i, g) in gpus.iter().enumerate() {
        assert_eq!(g["index"].as_u64(), Some(i as u64));
        let uuid = g["uuid"].as_str().unwrap();
        assert!(uuid.starts_with("GPU-") && uuid.len() == 40, "{uuid}");
    }
    let uuids: std::collections::BTreeSet<&str> = gpus.iter().map(|g| g["uuid"].as_str().unwrap()).collect();
    assert_eq!(uuids.len(), 3, "distinct devices have distinct UUIDs");
    for g in gpus {
        assert_sim_telemetry(g);
        assert_eq!(g["utilization_gpu"]["value"], 0, "no kernel has run: {g}");
    }

    // A program holding 1 MiB on the first server's device is listed there, and only there.
    let holder = spawn_rgpu(&a.addr_string(), &build("rt_killed", Variant::Cudart13Shared), &[]);
    assert!(holder.wait_for_line("looping", Duration::from_secs(60)), "rt_killed did not start");
    let out = std::process::Command::new(&binaries().rgpu)
        .args(["smi", "--json", "--plaintext", "--server", &servers])
        .output()
        .expect("rgpu smi runs");
    let gpus: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let procs: Vec<&Vec<serde_json::Value>> = gpus.as_array().unwrap().iter().map(|g| g["processes"].as_array().unwrap()).collect();
    assert_eq!(procs.iter().map(|p| p.len()).collect::<Vec<_>>(), vec![1, 0, 0], "{gpus}");
    assert!(procs[0][0]["pid"].as_u64().is_some_and(|p| p > 0), "{gpus}");
    assert!(procs[0][0]["memory_used"].as_u64().is_some_and(|m| m >= 1 << 20), "{gpus}");
    holder.wait(Duration::from_millis(1));
}

/// A sim device's readings as `rgpu smi --json` shows them: utilization measured, memory
/// utilization not reported, temperature and power the sim's constants, marked simulated.
fn assert_sim_telemetry(g: &serde_json::Value) {
    assert_eq!(g["utilization_gpu"]["source"], "measured", "{g}");
    assert!(g["utilization_gpu"]["value"].as_u64().is_some_and(|v| v <= 100), "{g}");
    assert!(g["utilization_memory"].is_null(), "the sim does not measure memory utilization: {g}");
    for k in ["temperature_c", "power_mw", "power_limit_mw"] {
        assert_eq!(g[k]["source"], "simulated", "{k}: {g}");
        assert!(g[k]["value"].as_u64().is_some_and(|v| v > 0), "{k}: {g}");
    }
}

/// A server on the cuda backend reads its GPUs' telemetry through NVML: chained to a sim
/// server (its libcuda and libnvidia-ml rgpu's own), it reports the sim's readings with the
/// sources the sim gave, never its constants as measured.
#[test]
fn a_chained_cuda_server_reports_its_upstreams_readings() {
    let sim = Server::start(ServerOpts { devices: 1, ..ServerOpts::default() });
    let a = Server::start_chain(&sim);
    let smi = |s: &Server| -> serde_json::Value {
        let out = std::process::Command::new(&binaries().rgpu)
            .args(["smi", "--json", "--plaintext", "--server", &s.addr_string()])
            .output()
            .expect("rgpu smi runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("JSON on stdout")
    };
    let (upstream, chained) = (smi(&sim), smi(&a));
    let (upstream, chained) = (&upstream[0], &chained[0]);
    assert_eq!(chained["backend"], "cuda", "{chained}");
    assert_sim_telemetry(chained);
    for k in ["temperature_c", "power_mw", "power_limit_mw"] {
        assert_eq!(chained[k], upstream[k], "{k}");
    }
}
