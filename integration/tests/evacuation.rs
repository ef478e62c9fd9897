//! Evacuation of an unhealthy device end to end (docs/migration.md
//! "Evacuation of unhealthy devices"): a broker and two sim servers
//! sharing the admin key; a program runs under a lease on the first; an
//! operator injects an uncorrectable ECC error into that server's GPU
//! (`rgpu fault inject`); the server reports it, the broker shows the GPU
//! unhealthy and moves the lease to the second server by live migration,
//! the program finishes with every round right; cleared, the GPU takes a
//! lease again. Needs rgpu-broker built beside rgpu and rgpu-server
//! (`cargo build --release -p rgpu-pool-broker`).

mod pool;

use pool::*;
use rgpu_integration::*;
use std::time::{Duration, Instant};

fn server<'a>(v: &'a serde_json::Value, id: &str) -> &'a serde_json::Value {
    v.as_array().unwrap().iter().find(|s| s["id"] == id).unwrap_or_else(|| panic!("{id} not listed: {v}"))
}

/// GET /metrics from the server's metrics endpoint (bounded: 10 s).
fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("metrics endpoint");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text
}

/// `rgpu_server_device_healthy` of device 0.
fn healthy_gauge(addr: &str) -> Option<f64> {
    let text = scrape(addr);
    let line = text.lines().find(|l| l.starts_with("rgpu_server_device_healthy{device=\"0\""))?;
    line.rsplit(' ').next()?.parse().ok()
}

#[test]
fn a_fault_on_a_gpu_moves_its_running_lease_and_clearing_it_makes_the_gpu_placeable() {
    let exe = build("rt_checkpoint", Variant::Cudart13Shared);
    let dir = Dir::scratch("evacuation");
    let d = &dir.0;
    let b = broker(d);
    let key = d.join("admin.key").display().to_string();
    let flags: Vec<String> = [
        ("--broker", b.addr.clone()),
        ("--broker-key-file", d.join("key").display().to_string()),
        ("--admin-key-file", key.clone()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_string(), v])
    .collect();
    let seed = format!("rgpu-evacuation-{}", std::process::id());
    let metrics = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let a_flags: Vec<String> = flags.iter().cloned().chain(["--metrics".to_string(), metrics.clone()]).collect();
    let a = Server::start_on("127.0.0.1:0", ServerOpts::default(), &format!("{seed}-a"), &a_flags);
    let aa = a.addr_string();
    wait_until("A registered", Duration::from_secs(20), || servers_up(&b, d) == vec![aa.clone()]);

    // Only A is up: the lease lands there.
    let baddr = b.addr.clone();
    let run_args = ["--broker", &baddr, "--admin-key-file", &key, "--plaintext", "--gpus", "1"];
    let envs = [("RGPU_RECONNECT_TIMEOUT", Some("60")), ("RGPU_LOG", Some("warn,cuda::client=info")), ("RGPU_TLS_CA", None)];
    let run = spawn_rgpu_run(&run_args, &exe, &["--rounds", "10", "--wait-ms", "300", "--mib", "16"], &envs);
    if !run.wait_for_line("round 1", run_timeout()) {
        let out = run.wait(Duration::from_secs(5));
        panic!("rt_checkpoint never printed 'round 1'\n{}", out.describe(&[&a]));
    }
    let lease = json(&["leases"], &b, d).as_array().unwrap().first().expect("the run's lease").clone();
    let lease_id = lease["id"].as_str().unwrap().to_string();
    assert_eq!(lease["gpus"][0]["server"], aa.as_str());

    let bs = Server::start_on("127.0.0.1:0", ServerOpts::default(), &format!("{seed}-b"), &flags);
    let ba = bs.addr_string();
    wait_until("B registered", Duration::from_secs(20), || servers_up(&b, d).len() == 2);

    // A refuses a fault without the admin key's proof, and a kind it does not know.
    let fault = |args: &[&str], key: &str| {
        std::process::Command::new(&binaries().rgpu)
            .arg("fault")
            .args(args)
            .args(["--server", &aa, "--device", "0", "--plaintext", "--key-file", key])
            .output()
            .unwrap()
    };
    std::fs::write(d.join("wrong.key"), [7u8; 32]).unwrap();
    let wrong = fault(&["inject", "--kind", "ecc"], &d.join("wrong.key").display().to_string());
    assert!(!wrong.status.success() && String::from_utf8_lossy(&wrong.stderr).contains("refused"), "a fault with the wrong key: {wrong:?}");
    let odd = fault(&["inject", "--kind", "hot"], &key);
    assert!(!odd.status.success() && String::from_utf8_lossy(&odd.stderr).contains("unknown fault kind"), "{odd:?}");
    assert!(server(&json(&["servers"], &b, d), &aa)["unhealthy"].as_array().unwrap().is_empty());

    let started = Instant::now();
    let out = fault(&["inject", "--kind", "ecc"], &key);
    assert!(out.status.success(), "rgpu fault inject: {}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("unhealthy: uncorrectable ECC error"), "{out:?}");
    wait_until("the broker to show A's GPU unhealthy", Duration::from_secs(10), || {
        let v = json(&["servers"], &b, d);
        let u = &server(&v, &aa)["unhealthy"];
        u.as_array().is_some_and(|u| u.len() == 1 && u[0]["ordinal"] == 0 && u[0]["reason"].as_str().unwrap().contains("ECC"))
    });
    assert!(scrape(&metrics).contains("rgpu_server_device_healthy{device=\"0\""), "A exports its devices' health");
    assert!(healthy_gauge(&metrics) == Some(0.0), "A's metric shows the fault: {}", scrape(&metrics));
    let (ok, table, _) = rgpu(&["servers"], &b, d);
    assert!(ok && table.contains("GPU 0 unhealthy: uncorrectable ECC error"), "{table}");
    wait_until("the lease to move to B", Duration::from_secs(60), || {
        let v = json(&["leases"], &b, d);
        v.as_array().unwrap().iter().any(|l| l["id"] == lease_id.as_str() && l["gpus"][0]["server"] == ba.as_str())
    });
    let took = started.elapsed();
    let moved = json(&["leases"], &b, d);
    let moved = moved.as_array().unwrap().iter().find(|l| l["id"] == lease_id.as_str()).unwrap().clone();
    assert!(moved["generation"].as_u64() > lease["generation"].as_u64(), "{moved}");
    let audit = json(&["audit"], &b, d);
    let audited = |op: &str, target: &str| {
        audit.as_array().unwrap().iter().any(|r| r["op"] == op && r["ok"] == true && r["target"] == target)
    };
    assert!(audited("health", &aa), "the health report is audited: {audit}");
    assert!(audited("evacuate", &lease_id), "the evacuation is audited: {audit}");
    assert!(audited("move", &lease_id), "the move is audited: {audit}");

    let done = run.wait(run_timeout());
    done.assert_pass("rt_checkpoint", &[&a, &bs]);
    let report = done.describe(&[&a, &bs]);
    for r in 0..10 {
        assert!(done.stdout.contains(&format!("ok: round {r}: ")), "round {r} missing\n{report}");
    }
    assert!(done.stderr.contains("the session moved from"), "the shim did not follow the redirect\n{report}");
    assert!(a.log().contains("device unhealthy"), "{report}");
    assert!(a.log().contains("lease moved"), "{report}");

    // Nothing lands on the unhealthy GPU: with B drained there is no room.
    let (ok, _, err) = rgpu(&["drain", &ba], &b, d);
    assert!(ok, "{err}");
    let lease_one = |b: &Broker| rgpu(&["lease", "--gpus", "1", "--ttl", "30s", "--json"], b, d);
    let (ok, out, _) = lease_one(&b);
    assert!(!ok, "a lease was granted on an unhealthy GPU: {out}");
    // Cleared: placeable again.
    let out = fault(&["clear"], &key);
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("healthy"), "{out:?}");
    wait_until("the broker to show A healthy", Duration::from_secs(10), || {
        server(&json(&["servers"], &b, d), &aa)["unhealthy"].as_array().unwrap().is_empty()
    });
    assert_eq!(healthy_gauge(&metrics), Some(1.0));
    let (ok, out, err) = lease_one(&b);
    assert!(ok, "no lease on the healed GPU: {err}");
    let l: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(l["gpus"][0]["server"], aa.as_str(), "{l}");
    eprintln!("evacuation: fault injected to lease {lease_id} placed on {ba} in {took:?}");
}
