//! Metering end to end: a leased session's kernels, bytes and memory reach
//! the broker on heartbeats, show in `leases` and `servers`, become a
//! durable accounting record when the lease ends (kept across a broker
//! restart), and each tenant sees only its own. Needs the workspace's
//! binaries built (rgpu-server, rgpu and libcuda.so beside rgpu-broker).

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::{bin_dir, free_port, login, start, wait_for, Proc};
use rgpu_broker_client::{LeaseSpec, Role};

fn broker(dir: &Path, addr: &str) -> Proc {
    start(
        "rgpu-broker",
        &[
            "--listen", addr,
            "--data-dir", dir.join("data").to_str().unwrap(),
            "--key-file", dir.join("key").to_str().unwrap(),
            "--admin-key-file", dir.join("admin.key").to_str().unwrap(),
            "--create-key",
            "--heartbeat-ms", "100",
        ],
    )
}

fn server(dir: &Path, broker: &str) -> Proc {
    start(
        "rgpu-server",
        &[
            "--listen", "127.0.0.1:0",
            "--backend", "sim",
            "--sim-devices", "1",
            "--sim-memory", "1GiB",
            "--broker", broker,
            "--broker-key-file", dir.join("key").to_str().unwrap(),
        ],
    )
}

/// The built-in workload (copies both ways, kernels) through the shim.
fn demo(server: &str, token: &str) -> Output {
    let child = Command::new(bin_dir().join("rgpu"))
        .args(["demo", "--server", server, "--size-mib", "4"])
        .env("RGPU_PLAINTEXT", "1")
        .env("RGPU_SHIM", bin_dir().join("libcuda.so"))
        .env("RGPU_TOKEN", token)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let pid = child.id();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(o) => o.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("rgpu demo hung");
        }
    }
}

#[test]
fn a_leases_use_is_metered_reported_and_kept() {
    let dir = std::env::temp_dir().join(format!("rgpu-usage-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let baddr = free_port();
    let b = broker(&dir, &baddr);
    let s = server(&dir, &baddr);
    let bob = login(&baddr, &dir, "bob", Role::User);
    let alice = login(&baddr, &dir, "alice", Role::User);
    wait_for("the server registered", || bob.servers().map(|s| s.len() == 1).unwrap_or(false));
    let spec = |t: &str| LeaseSpec { tenant: t.into(), gpus: 0, memory: 256 << 20, ttl_ms: 60_000, ..LeaseSpec::default() };
    let lease = bob.lease(&spec("bob")).unwrap();
    let other = alice.lease(&spec("alice")).unwrap();

    let out = demo(&s.addr, &lease.token);
    assert!(out.status.success(), "demo: {}", String::from_utf8_lossy(&out.stderr));
    // The next heartbeats carry the lease's use; once the server has seen
    // the session end, its memory is back to 0 and the peak remains.
    let mut seen = None;
    wait_for("bob's use reported after his session ended", || {
        seen = bob.leases("").unwrap().into_iter().find(|l| l.id == lease.id).and_then(|l| l.usage);
        seen.is_some_and(|u| u.kernels > 0 && u.memory == 0)
    });
    let u = seen.unwrap();
    assert!(u.kernel_ns.is_some_and(|t| t > 0), "the sim times its kernels: {u:?}");
    assert!(u.bytes_in > 4 << 20 && u.bytes_out > 4 << 20, "4 MiB each way at least: {u:?}");
    assert!(u.memory_peak >= 4 << 20, "{u:?}");
    let srv = bob.servers().unwrap().remove(0);
    assert!(srv.usage.is_some_and(|t| t.kernels >= u.kernels && t.bytes_in >= u.bytes_in), "{srv:?}");
    // Alice's lease did nothing.
    let a = alice.leases("").unwrap();
    assert_eq!(a.len(), 1);
    assert!(a[0].usage.is_none_or(|u| u.kernels == 0), "{a:?}");

    // Ending the lease makes its accounting record, durably.
    assert!(bob.release(lease.id_u64()).unwrap());
    let records = bob.usage("", 0, 0).unwrap();
    assert_eq!(records.len(), 1, "bob's only (alice's live lease is not his): {records:?}");
    let r = &records[0];
    assert_eq!((r.lease.as_str(), r.tenant.as_str(), r.why.as_str()), (lease.id.as_str(), "bob", "released"));
    assert!(r.ended_ms >= r.granted_ms && r.ended_ms > 0);
    assert_eq!(r.usage.map(|x| x.kernels), Some(u.kernels));
    // A user may not ask for another tenant's; alice sees her live lease only.
    assert!(bob.usage("alice", 0, 0).is_err());
    let mine = alice.usage("", 0, 0).unwrap();
    assert_eq!(mine.iter().map(|r| (r.lease.clone(), r.why.clone())).collect::<Vec<_>>(), [(other.id.clone(), "live".into())]);
    // --since after the end leaves the ended record out.
    let later = rgpu_pool_broker::service::now_ms() + 1;
    assert!(bob.usage("", later, 0).unwrap().is_empty());

    // The record survives a broker restart; an admin sees every tenant's.
    drop((s, b, bob, alice));
    let _b = broker(&dir, &baddr);
    let admin = login(&baddr, &dir, "ops", Role::Admin);
    let all = admin.usage("", 0, 0).unwrap();
    let kept = all.iter().find(|x| x.lease == lease.id).expect("bob's record after a restart");
    assert_eq!((kept.why.as_str(), kept.usage.map(|x| x.kernels)), ("released", Some(u.kernels)));
    assert!(all.iter().any(|x| x.tenant == "alice"), "{all:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
