//! `rgpu drain SERVER --migrate` end to end (docs/migration.md "Migration
//! with a broker"): a broker and two sim servers sharing the admin key; a
//! program runs under a lease (`rgpu run --gpus 1`) on the first; the drain
//! moves the lease to the second by live migration, the program finishes
//! with every round right, and the broker then places the lease there.
//! Needs rgpu-broker built beside rgpu and rgpu-server
//! (`cargo build --release -p rgpu-pool-broker`).

mod pool;

use pool::*;
use rgpu_integration::*;
use std::process::Command;
use std::time::{Duration, Instant};

/// Flags for a server of broker `b`: the servers prove themselves to each
/// other with the same admin key the operator holds for the broker.
fn server_flags(b: &Broker, d: &std::path::Path) -> Vec<String> {
    [
        ("--broker", b.addr.clone()),
        ("--broker-key-file", d.join("key").display().to_string()),
        ("--admin-key-file", d.join("admin.key").display().to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_string(), v])
    .collect()
}

/// A broker, its server A, and rt_checkpoint (`rounds` rounds over 16 MiB)
/// running under a one-GPU lease there, past its first round: what each
/// move below starts from.
struct Leased {
    dir: Dir,
    b: Broker,
    flags: Vec<String>,
    seed: String,
    a: Server,
    run: Running,
}

/// Rounds (300 ms apart) of the drained program: enough that the drain,
/// after a server start and its registration, still finds it running on a
/// busy host.
const DRAIN_ROUNDS: u32 = 10;
/// Rounds of the program an operator moves twice: rounds 5.. must outlast
/// the second move.
const MIGRATE_ROUNDS: u32 = 12;

fn leased_program(name: &str, rounds: u32) -> Leased {
    let exe = build("rt_checkpoint", Variant::Cudart13Shared);
    let dir = Dir::scratch(name);
    let d = &dir.0;
    let b = broker(d);
    let flags = server_flags(&b, d);
    let seed = format!("rgpu-{name}-{}", std::process::id());
    let a = Server::start_on("127.0.0.1:0", ServerOpts::default(), &format!("{seed}-a"), &flags);
    let aa = a.addr_string();
    wait_until("A registered", Duration::from_secs(20), || servers_up(&b, d) == vec![aa.clone()]);
    // Only A is up: the lease lands there.
    let key = d.join("admin.key").display().to_string();
    let run_args = ["--broker", &b.addr, "--admin-key-file", &key, "--plaintext", "--gpus", "1"];
    let envs = [("RGPU_RECONNECT_TIMEOUT", Some("60")), ("RGPU_LOG", Some("warn,cuda::client=info")), ("RGPU_TLS_CA", None)];
    let rounds = rounds.to_string();
    let run = spawn_rgpu_run(&run_args, &exe, &["--rounds", &rounds, "--wait-ms", "300", "--mib", "16"], &envs);
    if !run.wait_for_line("round 1", run_timeout()) {
        let out = run.wait(Duration::from_secs(5));
        panic!("rt_checkpoint never printed 'round 1'\n{}", out.describe(&[&a]));
    }
    Leased { dir, b, flags, seed, a, run }
}

#[test]
fn drain_migrate_moves_a_running_leased_program_to_another_server() {
    let Leased { dir, b, flags, seed, a, run } = leased_program("drain-migrate", DRAIN_ROUNDS);
    let d = &dir.0;
    let aa = a.addr_string();
    let key = d.join("admin.key").display().to_string();
    let leases = json(&["leases"], &b, d);
    let lease = leases.as_array().unwrap().first().expect("the run's lease").clone();
    let lease_id = lease["id"].as_str().unwrap().to_string();
    assert_eq!(lease["gpus"][0]["server"], aa.as_str());

    // No other server yet: nothing can take the lease; it stays on A.
    let (ok, out, err) = rgpu(&["drain", &aa, "--migrate", "--wait", "5s"], &b, d);
    assert!(!ok, "a drain that moved nothing succeeded: {out}\n{err}");
    assert!(out.contains(&format!("not moved {lease_id}")) && out.contains("no other server"), "{out}\n{err}");
    let kept = json(&["leases"], &b, d);
    assert_eq!(kept[0]["gpus"][0]["server"], aa.as_str(), "{kept}");

    let bs = Server::start_on("127.0.0.1:0", ServerOpts::default(), &format!("{seed}-b"), &flags);
    let ba = bs.addr_string();
    wait_until("B registered", Duration::from_secs(20), || servers_up(&b, d).len() == 2);

    // A plain migrate of a leased session is still refused.
    let sessions = Command::new(&binaries().rgpu)
        .args(["sessions", "--server", &aa, "--json", "--plaintext", "--key-file", &key])
        .output()
        .unwrap();
    let rows: serde_json::Value = serde_json::from_slice(&sessions.stdout).expect("rgpu sessions --json");
    let sid = rows[0]["id"].as_str().expect("the program's session on A").to_string();
    let refused = Command::new(&binaries().rgpu)
        .args(["migrate", &sid, "--server", &aa, "--to", &ba, "--plaintext", "--key-file", &key])
        .output()
        .unwrap();
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && why.contains("broker lease"), "a plain migrate of a leased session: {why}");

    let started = Instant::now();
    let (ok, out, err) = rgpu(&["drain", &aa, "--migrate", "--wait", "60s"], &b, d);
    let took = started.elapsed();
    assert!(ok, "rgpu drain --migrate failed:\n{out}\n{err}\n{}\n{}", a.describe(), bs.describe());
    assert!(out.contains(&format!("moved {lease_id}  {aa} -> {ba}")), "{out}\n{err}");
    // Placed on B now, at a new generation.
    let moved = json(&["leases"], &b, d);
    let moved = moved.as_array().unwrap().iter().find(|l| l["id"] == lease_id.as_str()).expect("the lease").clone();
    assert!(moved["gpus"].as_array().unwrap().iter().all(|g| g["server"] == ba.as_str()), "{moved}");
    assert!(moved["generation"].as_u64() > lease["generation"].as_u64(), "{moved}");
    let audit = json(&["audit"], &b, d);
    assert!(
        audit.as_array().unwrap().iter().any(|r| r["op"] == "move" && r["ok"] == true && r["target"] == lease_id.as_str()),
        "the move is audited: {audit}"
    );

    let done = run.wait(run_timeout());
    done.assert_pass("rt_checkpoint", &[&a, &bs]);
    let report = done.describe(&[&a, &bs]);
    for r in 0..DRAIN_ROUNDS {
        assert!(done.stdout.contains(&format!("ok: round {r}: ")), "round {r} missing\n{report}");
    }
    assert!(done.stderr.contains("the session moved from"), "the shim did not follow the redirect\n{report}");
    assert!(bs.log().contains("session migrated in"), "{report}");
    assert!(a.log().contains("lease moved"), "{report}");
    // The run kept renewing the lease on B and released it at the end.
    assert!(done.stderr.contains("released"), "{report}");
    let migrated = a.log().lines().find(|l| l.contains("session migrated")).unwrap_or("").to_string();
    // A leased session is pre-copied too: its 16 MiB went while it ran,
    // charged on B to its lease as they arrived.
    let precopied: u64 = migrated
        .split_whitespace()
        .find_map(|f| f.strip_prefix("precopied="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no precopied= in {migrated:?}\n{report}"));
    assert!(precopied >= 16 << 20, "pre-copied {precopied} bytes of the lease's 16 MiB\n{report}");
    eprintln!("rgpu drain --migrate: {} moved in {took:?}\n{}\nsource: {}", lease_id, err.trim(), migrated.trim());
}

/// The same drain between two servers on the cuda backend with movable memory
/// (docs/migration.md, "Movable memory on the cuda backend"), each over its
/// own sim server through rgpu's shim: the GPU servers an operator drains.
#[test]
fn drain_migrate_moves_a_leased_program_between_cuda_servers() {
    let exe = build("rt_checkpoint", Variant::Cudart13Shared);
    let dir = Dir::scratch("drain-migrate-cuda");
    let d = &dir.0;
    let b = broker(d);
    let mut flags = server_flags(&b, d);
    flags.push("--cuda-movable-memory".to_string());
    let (gpu_a, gpu_b) = (Server::start_default(), Server::start_default());
    let a = Server::start_chain_with(&gpu_a, &flags);
    let aa = a.addr_string();
    wait_until("A registered", Duration::from_secs(20), || servers_up(&b, d) == vec![aa.clone()]);
    let baddr = b.addr.clone();
    let key = d.join("admin.key").display().to_string();
    let run_args = ["--broker", &baddr, "--admin-key-file", &key, "--plaintext", "--gpus", "1"];
    let envs = [("RGPU_RECONNECT_TIMEOUT", Some("60")), ("RGPU_LOG", Some("warn,cuda::client=info")), ("RGPU_TLS_CA", None)];
    let rounds = DRAIN_ROUNDS.to_string();
    let run = spawn_rgpu_run(&run_args, &exe, &["--rounds", &rounds, "--wait-ms", "300", "--mib", "16"], &envs);
    if !run.wait_for_line("round 1", run_timeout()) {
        let out = run.wait(Duration::from_secs(5));
        panic!("rt_checkpoint never printed 'round 1'\n{}", out.describe(&[&a, &gpu_a]));
    }
    let leases = json(&["leases"], &b, d);
    let lease_id = leases[0]["id"].as_str().expect("the run's lease").to_string();
    let bs = Server::start_chain_with(&gpu_b, &flags);
    let ba = bs.addr_string();
    wait_until("B registered", Duration::from_secs(20), || servers_up(&b, d).len() == 2);
    let (ok, out, err) = rgpu(&["drain", &aa, "--migrate", "--wait", "60s"], &b, d);
    assert!(ok, "rgpu drain --migrate failed:\n{out}\n{err}\n{}\n{}", a.describe(), bs.describe());
    assert!(out.contains(&format!("moved {lease_id}  {aa} -> {ba}")), "{out}\n{err}");
    let done = run.wait(run_timeout());
    done.assert_pass("rt_checkpoint", &[&a, &bs]);
    let report = done.describe(&[&a, &bs]);
    for r in 0..DRAIN_ROUNDS {
        assert!(done.stdout.contains(&format!("ok: round {r}: ")), "round {r} missing\n{report}");
    }
    assert!(bs.log().contains("session migrated in") && bs.log().contains("backend cuda"), "{report}");
}

/// `rgpu migrate LEASE --to SERVER`: an operator moves one leased program
/// to the server it names, then (no target) back to the first that fits;
/// neither server is drained, the program finishes with every round right.
#[test]
fn migrate_moves_a_leased_program_to_the_server_named_and_back() {
    let Leased { dir, b, flags, seed, a, run } = leased_program("migrate-lease", MIGRATE_ROUNDS);
    let d = &dir.0;
    let aa = a.addr_string();
    let bs = Server::start_on("127.0.0.1:0", ServerOpts::default(), &format!("{seed}-b"), &flags);
    let ba = bs.addr_string();
    wait_until("B registered", Duration::from_secs(20), || servers_up(&b, d).len() == 2);
    let lease = json(&["leases"], &b, d)[0].clone();
    let lease_id = lease["id"].as_str().unwrap().to_string();
    assert_eq!(lease["gpus"][0]["server"], aa.as_str());

    // Refused, saying why, and nothing moves: a server that is not there,
    // the server the lease is on.
    let (ok, _, err) = rgpu(&["migrate", &lease_id, "--to", "127.0.0.1:1"], &b, d);
    assert!(!ok && err.contains("no server 127.0.0.1:1"), "{err}");
    let (ok, _, err) = rgpu(&["migrate", &lease_id, "--to", &aa], &b, d);
    assert!(!ok && err.contains("already"), "{err}");

    let (ok, out, err) = rgpu(&["migrate", &lease_id, "--to", &ba], &b, d);
    assert!(ok, "rgpu migrate LEASE --to B failed:\n{out}\n{err}\n{}\n{}", a.describe(), bs.describe());
    assert!(out.contains(&format!("moved {lease_id}  {aa} -> {ba}")), "{out}\n{err}");
    assert!(run.wait_for_line("round 4", run_timeout()), "no round 4 after the first move");
    let (ok, out, err) = rgpu(&["migrate", &lease_id], &b, d);
    assert!(ok, "rgpu migrate LEASE failed:\n{out}\n{err}\n{}\n{}", a.describe(), bs.describe());
    assert!(out.contains(&format!("moved {lease_id}  {ba} -> {aa}")), "the first server that fits: {out}\n{err}");

    let servers = json(&["servers"], &b, d);
    assert!(servers.as_array().unwrap().iter().all(|s| s["draining"] == false), "an operator's move drains nothing: {servers}");
    let moved = json(&["leases"], &b, d)[0].clone();
    assert!(moved["generation"].as_u64() > lease["generation"].as_u64(), "{moved}");
    let audit = json(&["audit"], &b, d);
    let moves = audit.as_array().unwrap().iter().filter(|r| r["op"] == "move" && r["target"] == lease_id.as_str()).count();
    assert!(moves >= 4, "the refused and the done moves are audited: {audit}");

    let done = run.wait(run_timeout());
    done.assert_pass("rt_checkpoint", &[&a, &bs]);
    let report = done.describe(&[&a, &bs]);
    for r in 0..MIGRATE_ROUNDS {
        assert!(done.stdout.contains(&format!("ok: round {r}: ")), "round {r} missing\n{report}");
    }
    assert!(bs.log().contains("session migrated in") && a.log().contains("session migrated in"), "{report}");
}
