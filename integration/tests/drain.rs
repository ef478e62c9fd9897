//! `rgpu drain SERVER --migrate` end to end (docs/migration.md "Migration
//! with a broker"): a broker and two sim servers sharing the admin key; a
//! program runs under a lease (`rgpu run --gpus 1`) on the first; the drain
//! moves the lease to the second by live migration, the program finishes
//! with every round right, and the broker then places the lease there.
//! Needs rgpu-broker built beside rgpu and rgpu-server
//! (`cargo build --release -p rgpu-pool-broker`).

use rgpu_integration::*;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Broker {
    child: Child,
    addr: String,
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn broker(dir: &Path) -> Broker {
    let bin = binaries().dir.join("rgpu-broker");
    assert!(bin.exists(), "{} is not built: cargo build --release -p rgpu-pool-broker", bin.display());
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let mut child = Command::new(&bin)
        .args(["--listen", &port, "--create-key", "--heartbeat-ms", "200", "--data-dir"])
        .arg(dir.join("data"))
        .arg("--key-file")
        .arg(dir.join("key"))
        .arg("--admin-key-file")
        .arg(dir.join("admin.key"))
        .env("RGPU_BROKER_PLAINTEXT", "1")
        .env("RGPU_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting rgpu-broker");
    let err = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if line.contains("listening on") {
                let _ = tx.send(());
            }
            if std::env::var_os("RGPU_TEST_LOG").is_some() {
                eprintln!("[broker] {line}");
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(20)).expect("rgpu-broker did not start listening");
    Broker { child, addr: port }
}

/// `rgpu ARGS --broker B --admin-key-file K --plaintext`: (success, stdout, stderr).
fn rgpu(args: &[&str], b: &Broker, dir: &Path) -> (bool, String, String) {
    let out = Command::new(&binaries().rgpu)
        .args(args)
        .args(["--broker", &b.addr, "--plaintext", "--admin-key-file"])
        .arg(dir.join("admin.key"))
        .env("NO_COLOR", "1")
        .env_remove("RGPU_TLS_CA")
        .stdin(Stdio::null())
        .output()
        .expect("running rgpu");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

fn json(args: &[&str], b: &Broker, dir: &Path) -> serde_json::Value {
    let mut a = args.to_vec();
    a.push("--json");
    let (ok, out, err) = rgpu(&a, b, dir);
    assert!(ok, "rgpu {args:?}: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("rgpu {args:?} --json: {e}: {out}"))
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn servers_up(b: &Broker, dir: &Path) -> Vec<String> {
    let v = json(&["servers"], b, dir);
    v.as_array().unwrap().iter().filter(|s| s["state"] == "up").map(|s| s["id"].as_str().unwrap().to_string()).collect()
}

#[test]
fn drain_migrate_moves_a_running_leased_program_to_another_server() {
    let exe = build("rt_checkpoint", Variant::Cudart13Shared);
    let dir = std::env::temp_dir().join(format!("rgpu-drain-migrate-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let dir = Dir(dir);
    let d = &dir.0;
    let b = broker(d);
    // The servers prove themselves to each other with the same admin key
    // the operator holds for the broker.
    let flags: Vec<String> = [
        ("--broker", b.addr.clone()),
        ("--broker-key-file", d.join("key").display().to_string()),
        ("--admin-key-file", d.join("admin.key").display().to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_string(), v])
    .collect();
    let seed = format!("rgpu-drain-migrate-{}", std::process::id());
    let a = Server::start_on("127.0.0.1:0", ServerOpts::default(), &format!("{seed}-a"), &flags);
    let aa = a.addr_string();
    wait_until("A registered", Duration::from_secs(20), || servers_up(&b, d) == vec![aa.clone()]);

    // Only A is up: the lease lands there.
    let baddr = b.addr.clone();
    let key = d.join("admin.key").display().to_string();
    let run_args = ["--broker", &baddr, "--admin-key-file", &key, "--plaintext", "--gpus", "1"];
    let envs = [("RGPU_RECONNECT_TIMEOUT", Some("60")), ("RGPU_LOG", Some("warn,cuda::client=info")), ("RGPU_TLS_CA", None)];
    let run = spawn_rgpu_run(&run_args, &exe, &["--rounds", "6", "--wait-ms", "300", "--mib", "16"], &envs);
    if !run.wait_for_line("round 1", run_timeout()) {
        let out = run.wait(Duration::from_secs(5));
        panic!("rt_checkpoint never printed 'round 1'\n{}", out.describe(&[&a]));
    }
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
    for r in 0..6 {
        assert!(done.stdout.contains(&format!("ok: round {r}: ")), "round {r} missing\n{report}");
    }
    assert!(done.stderr.contains("the session moved from"), "the shim did not follow the redirect\n{report}");
    assert!(bs.log().contains("session migrated in"), "{report}");
    assert!(a.log().contains("lease moved"), "{report}");
    // The run kept renewing the lease on B and released it at the end.
    assert!(done.stderr.contains("released"), "{report}");
    let migrated = a.log().lines().find(|l| l.contains("session migrated")).unwrap_or("").to_string();
    eprintln!("rgpu drain --migrate: {} moved in {took:?}\n{}\nsource: {}", lease_id, err.trim(), migrated.trim());
}
