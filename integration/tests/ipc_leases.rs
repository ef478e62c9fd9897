//! CUDA IPC stays inside one lease, end to end: two fractional leases on the
//! same GPU; rt_ipc runs on the first lease's token, its children on the same
//! token open its handle, and a child run on the second lease's token is
//! refused it and its event handle (the server's rule, `rgpu-server`'s `ipc.rs`).
//! Needs rgpu-broker built beside rgpu and rgpu-server.

mod pool;

use pool::*;
use rgpu_integration::*;
use std::time::Duration;

#[test]
fn another_lease_cannot_open_an_ipc_handle() {
    let exe = build("rt_ipc", Variant::Cudart13Shared);
    let dir = Dir::scratch("ipc-leases");
    let d = &dir.0;
    let b = broker(d);
    let flags: Vec<String> =
        ["--broker".to_string(), b.addr.clone(), "--broker-key-file".to_string(), d.join("key").display().to_string()].into();
    let seed = format!("rgpu-ipc-leases-{}", std::process::id());
    let srv = Server::start_on("127.0.0.1:0", ServerOpts { devices: 1, ..ServerOpts::default() }, &seed, &flags);
    let addr = srv.addr_string();
    wait_until("the server registered", Duration::from_secs(20), || servers_up(&b, d) == vec![addr.clone()]);

    let lease = || json(&["lease", "--memory", "1GiB", "--bearer-token"], &b, d);
    let (mine, theirs) = (lease(), lease());
    assert_ne!(mine["id"], theirs["id"]);
    let (t1, t2) = (mine["token"].as_str().unwrap(), theirs["token"].as_str().unwrap());
    let env = [
        ("RGPU_TOKEN", Some(t1)),
        ("RGPU_IPC_FOREIGN_TOKEN", Some(t2)),
        ("RGPU_PLAINTEXT", Some("1")),
        ("RGPU_TLS_CA", None),
    ];
    let out = spawn_rgpu_with(&addr, &exe, &[], &env).wait(run_timeout());
    out.assert_pass("rt_ipc", &[&srv]);
    let lines = out.ok_lines();
    assert!(lines.contains(&"a process of another lease cannot open the handle"), "the foreign child did not run:\n{}", out.describe(&[&srv]));
    assert!(
        lines.contains(&"a process of another lease cannot open the event handle"),
        "the foreign event child did not run:\n{}",
        out.describe(&[&srv])
    );
    // Refused by the server's lease rule (the device was found: both leases are on it).
    assert!(
        lines.iter().filter(|l| l.starts_with("foreign child") && l.contains("cudaErrorInvalidValue")).count() == 2,
        "refused for another reason:\n{}",
        out.describe(&[&srv])
    );
}
