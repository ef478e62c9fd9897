//! Preemption by checkpoint end to end (docs/migration.md "Preemption"): a
//! broker that preempts at once (`--preempt-after-ms 0`) and one sim server
//! with a checkpoint directory, one GPU. A program runs under a lease of
//! priority 0; a lease of priority 5 asks for the GPU and waits. The server
//! writes the program's session to disk and ends it, the urgent lease is
//! granted, the program waits; once the urgent lease is released the
//! program's lease resumes on its GPU and the program finishes with every
//! round right, having seen no error.
//! Needs rgpu-broker built beside rgpu and rgpu-server
//! (`cargo build --release -p rgpu-pool-broker`).

mod pool;

use pool::*;
use rgpu_integration::*;
use std::time::{Duration, Instant};

fn rounds_done(stdout: &str) -> usize {
    stdout.lines().filter(|l| l.starts_with("ok: round ")).count()
}

fn snapshots(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir).unwrap().filter_map(|e| e.ok()?.file_name().into_string().ok()).collect()
}

#[test]
fn a_preempted_program_waits_on_disk_and_resumes_with_every_round_right() {
    let exe = build("rt_checkpoint", Variant::Cudart13Shared);
    let dir = Dir::scratch("preemption");
    let d = &dir.0;
    let snaps = d.join("snapshots");
    std::fs::create_dir_all(&snaps).unwrap();
    let b = broker_with(d, &["--preempt-after-ms", "0"]);
    let flags: Vec<String> = [
        ("--broker", b.addr.clone()),
        ("--broker-key-file", d.join("key").display().to_string()),
        ("--checkpoint-dir", snaps.display().to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_string(), v])
    .collect();
    let seed = format!("rgpu-preemption-{}", std::process::id());
    let s = Server::start_on("127.0.0.1:0", ServerOpts::default(), &seed, &flags);
    let sa = s.addr_string();
    wait_until("the server registered", Duration::from_secs(20), || servers_up(&b, d) == vec![sa.clone()]);

    let baddr = b.addr.clone();
    let key = d.join("admin.key").display().to_string();
    let run_args = ["--broker", &baddr, "--admin-key-file", &key, "--plaintext", "--gpus", "1"];
    let envs = [("RGPU_LOG", Some("warn,cuda::client=info")), ("RGPU_TLS_CA", None)];
    let run = spawn_rgpu_run(&run_args, &exe, &["--rounds", "6", "--wait-ms", "300", "--mib", "16"], &envs);
    if !run.wait_for_line("round 1", run_timeout()) {
        let out = run.wait(Duration::from_secs(5));
        panic!("rt_checkpoint never printed 'round 1'\n{}", out.describe(&[&s]));
    }
    let leases = json(&["leases"], &b, d);
    let low = leases.as_array().unwrap().first().expect("the run's lease")["id"].as_str().unwrap().to_string();

    // The urgent lease waits for the GPU: the broker suspends the run's.
    let started = Instant::now();
    let urgent = json(&["lease", "--gpus", "1", "--priority", "5", "--wait", "60s", "--bearer-token"], &b, d);
    let granted_in = started.elapsed();
    let urgent_id = urgent["id"].as_str().expect("the urgent lease's id").to_string();
    let report = || s.describe();
    let now = json(&["leases"], &b, d);
    let row = now.as_array().unwrap().iter().find(|l| l["id"] == low.as_str()).expect("the run's lease lives on").clone();
    assert_eq!(row["state"], "suspended", "{row}\n{}", report());
    let on_disk = snapshots(&snaps);
    assert!(
        on_disk.len() == 1 && on_disk[0].starts_with(&format!("preempt-{low}-")),
        "the session's snapshot: {on_disk:?}\n{}",
        report()
    );
    assert!(s.log().contains("lease suspended"), "{}", report());
    // The program waits while suspended (a round that had its last reply
    // before the suspension may still print).
    let before = rounds_done(&run.stdout_so_far());
    std::thread::sleep(Duration::from_millis(1500));
    let during = rounds_done(&run.stdout_so_far());
    assert!(during <= before + 1, "the program ran on while suspended: {before} -> {during} rounds");

    let (ok, out, err) = rgpu(&["release", &urgent_id], &b, d);
    assert!(ok, "rgpu release: {out}\n{err}");
    let done = run.wait(run_timeout());
    done.assert_pass("rt_checkpoint", &[&s]);
    let report = done.describe(&[&s]);
    for r in 0..6 {
        assert!(done.stdout.contains(&format!("ok: round {r}: ")), "round {r} missing\n{report}");
    }
    assert!(done.stderr.contains("lease is suspended"), "the shim did not wait for the suspension\n{report}");
    assert!(done.stderr.contains("lease was resumed after"), "{report}");
    assert!(s.log().contains("lease resumed"), "{report}");
    assert!(snapshots(&snaps).is_empty(), "snapshots left after the resume: {:?}", snapshots(&snaps));
    let audit = json(&["audit"], &b, d);
    for op in ["suspend", "resume"] {
        assert!(
            audit.as_array().unwrap().iter().any(|r| r["op"] == op && r["ok"] == true && r["target"] == low.as_str()),
            "{op} is audited: {audit}"
        );
    }
    eprintln!("preemption: the urgent lease was granted {granted_in:?} after it asked");
}
