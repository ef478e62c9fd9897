//! Preemption against a real GPU server that cannot suspend (it has no
//! checkpoint directory): it refuses the order and the lease must run on
//! untouched: still active on its GPU, the refusal kept as its
//! `move_error`, and the higher-priority request left waiting instead of
//! getting a GPU that is still in use. (A server that can suspend:
//! integration/tests/preemption.rs.) Needs the workspace's binaries built
//! (rgpu-server beside rgpu-broker).

mod common;

use std::path::Path;
use std::time::Duration;

use common::{free_port, login, start, wait_for, Proc};
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
            "--preempt-after-ms", "0",
        ],
    )
}

#[test]
fn a_server_without_a_checkpoint_dir_refuses_and_the_preempted_lease_runs_on() {
    let root = std::env::temp_dir().join(format!("rgpu-preemption-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let baddr = free_port();
    let b = broker(&root, &baddr);
    let _server = start(
        "rgpu-server",
        &[
            "--listen", "127.0.0.1:0",
            "--backend", "sim",
            "--sim-devices", "1",
            "--sim-memory", "256MiB",
            "--broker", &b.addr,
            "--broker-key-file", root.as_path().join("key").to_str().unwrap(),
        ],
    );
    let bob = login(&b.addr, root.as_path(), "bob", Role::User);
    wait_for("the server registered", || bob.servers().map(|s| s.len() == 1).unwrap_or(false));
    let low = bob.lease(&LeaseSpec { gpus: 1, ttl_ms: 60_000, ..LeaseSpec::default() }).unwrap();

    let addr = b.addr.clone();
    let dir = root.clone();
    let urgent = std::thread::spawn(move || {
        let carol = login(&addr, &dir, "carol", Role::User);
        carol.lease(&LeaseSpec { gpus: 1, priority: 5, ttl_ms: 60_000, wait_ms: 3_000, ..LeaseSpec::default() })
    });
    wait_for("the suspension refused", || {
        bob.leases("bob").unwrap().iter().any(|l| l.id == low.id && l.move_error.contains("no --checkpoint-dir"))
    });
    let r = urgent.join().unwrap();
    assert!(r.is_err(), "the GPU was granted while the lease on it still ran: {r:?}");
    std::thread::sleep(Duration::from_millis(300));
    let now = bob.leases("bob").unwrap().into_iter().find(|l| l.id == low.id).expect("the lease lives on");
    assert_eq!((now.state.as_str(), now.generation), ("active", low.generation), "{now:?}");
}
