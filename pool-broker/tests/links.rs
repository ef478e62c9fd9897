//! The fabric end to end: rgpu-servers register their link capacity
//! (`--link-bandwidth`) and report their data-plane traffic on heartbeats;
//! leases ask for bandwidth, which is granted up to each link's capacity,
//! shown by `rgpu servers` and `rgpu leases`, given back on release and
//! kept across a broker restart. Needs the workspace's binaries built
//! (rgpu-server, rgpu and libcuda.so beside rgpu-broker).

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{bin_dir, free_port, login, start, wait_for, Proc};
use rgpu_broker_client::{BrokerClient, LeaseSpec, Role, ServerView};

/// 10Gb/s and 8Gb/s, in bytes/s.
const LINK: u64 = 1_250_000_000;
const EIGHT: u64 = 1_000_000_000;

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

fn server(dir: &Path, broker: &str, leaf: &str) -> Proc {
    start(
        "rgpu-server",
        &[
            "--listen", "127.0.0.1:0",
            "--backend", "sim",
            "--sim-devices", "2",
            "--sim-memory", "1GiB",
            "--broker", broker,
            "--broker-key-file", dir.join("key").to_str().unwrap(),
            "--leaf", leaf,
            "--link-bandwidth", "10Gb/s",
        ],
    )
}

fn rgpu(args: &[&str]) -> Output {
    // The daemons serve in clear (common::start): the cli says so too.
    let out = Command::new(bin_dir().join("rgpu"))
        .args(args)
        .env("RGPU_PLAINTEXT", "1")
        .env_remove("RGPU_TLS_CA")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "rgpu {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

fn by_id(c: &BrokerClient, id: &str) -> ServerView {
    c.servers().unwrap().into_iter().find(|s| s.id == id).unwrap()
}

#[test]
fn links_are_registered_loads_reported_and_bandwidth_granted_up_to_capacity() {
    let dir = std::env::temp_dir().join(format!("rgpu-links-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let baddr = free_port();
    let b = broker(&dir, &baddr);
    let (sa, sb) = (server(&dir, &baddr, "la"), server(&dir, &baddr, "lb"));
    let c = login(&baddr, &dir, "bob", Role::User);
    wait_for("both servers registered with their links and reported traffic", || {
        c.servers().is_ok_and(|v| v.len() == 2 && v.iter().all(|s| s.link_bandwidth == Some(LINK) && s.load.is_some()))
    });

    let spec = LeaseSpec { gpus: 1, ttl_ms: 60_000, bandwidth: EIGHT, ..LeaseSpec::default() };
    let l1 = c.lease(&spec).unwrap();
    assert_eq!(l1.bandwidth, EIGHT);
    // Its server's link has 2Gb/s left: the next goes to the other, though
    // the first server still has a free GPU.
    let l2 = c.lease(&spec).unwrap();
    assert_ne!(l1.servers(), l2.servers(), "{l1:?} {l2:?}");
    let e = c.lease(&spec).unwrap_err().to_string();
    assert!(e.contains("[unavailable]"), "both links hold 8 of 10Gb/s: {e}");
    let e = c.lease(&LeaseSpec { bandwidth: 2 * LINK, ..spec.clone() }).unwrap_err().to_string();
    assert!(e.contains("[invalid]") && e.contains("20Gb/s"), "more than any link carries: {e}");
    for s in [&sa, &sb] {
        assert_eq!(by_id(&c, &s.addr).bandwidth_granted, EIGHT);
    }
    let admin = ["--broker", baddr.as_str(), "--admin-key-file"];
    let key = dir.join("admin.key");
    let key = key.to_str().unwrap();
    let table = String::from_utf8(rgpu(&["servers", admin[0], admin[1], admin[2], key]).stdout).unwrap();
    assert!(table.contains("LINK GRANTED") && table.matches("8Gb/s of 10Gb/s").count() == 2, "{table}");
    let table = String::from_utf8(rgpu(&["leases", admin[0], admin[1], admin[2], key]).stdout).unwrap();
    assert!(table.contains("BANDWIDTH") && table.matches("8Gb/s").count() == 2, "{table}");

    // A session's traffic shows in its server's load.
    let on = l1.servers()[0].clone();
    let running = AtomicBool::new(true);
    let peak = std::thread::scope(|s| {
        let (running, on, token) = (&running, &on, &l1.token);
        let demo = s.spawn(move || {
            let out = Command::new(bin_dir().join("rgpu"))
                .args(["demo", "--server", on, "--size-mib", "16", "--plaintext"])
                .env_remove("RGPU_TLS_CA")
                .env("RGPU_SHIM", bin_dir().join("libcuda.so"))
                .env("RGPU_TOKEN", token)
                .stdin(Stdio::null())
                .output()
                .unwrap();
            running.store(false, Ordering::Relaxed);
            out
        });
        let mut peak = 0;
        while running.load(Ordering::Relaxed) {
            if let Some(l) = by_id(&c, on).load {
                peak = peak.max(l.bytes_in);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = demo.join().unwrap();
        assert!(out.status.success(), "demo: {}", String::from_utf8_lossy(&out.stderr));
        // The heartbeat after the session's last bytes.
        std::thread::sleep(Duration::from_millis(300));
        peak.max(by_id(&c, on).load.map_or(0, |l| l.bytes_in))
    });
    assert!(peak > 0, "the server reported the demo's traffic");
    eprintln!("{on} reported up to {peak} bytes/s in while the demo ran");

    // Released: its bandwidth is back.
    assert!(c.release(l1.id_u64()).unwrap());
    assert_eq!(by_id(&c, &on).bandwidth_granted, 0);

    // Durable: after a restart the other lease still holds its bandwidth.
    drop((c, b));
    let _b = broker(&dir, &baddr);
    let c = login(&baddr, &dir, "bob", Role::User);
    let kept = c.leases("").unwrap().into_iter().find(|l| l.id == l2.id).expect("the lease after a restart");
    assert_eq!(kept.bandwidth, EIGHT);
    wait_for("the servers registered again", || {
        c.servers().is_ok_and(|v| v.iter().filter(|s| s.link_bandwidth == Some(LINK)).count() == 2)
    });
    assert_eq!(by_id(&c, &l2.servers()[0]).bandwidth_granted, EIGHT);
    let l3 = c.lease(&spec).unwrap();
    assert_eq!(l3.servers(), l1.servers(), "only the released link has room");
    drop((sa, sb));
    let _ = std::fs::remove_dir_all(&dir);
}
