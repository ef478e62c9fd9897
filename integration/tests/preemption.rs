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

/// A broker that preempts at once, a sim server with a checkpoint
/// directory, and rt_checkpoint running under a lease of priority 0 there,
/// past its first round.
struct Pool {
    dir: Dir,
    b: Broker,
    s: Server,
    flags: Vec<String>,
    seed: String,
    /// The program's lease.
    low: String,
}

impl Pool {
    fn start(name: &str, rounds: u32) -> (Pool, Running) {
        let exe = build("rt_checkpoint", Variant::Cudart13Shared);
        let dir = Dir::scratch(name);
        let d = &dir.0;
        std::fs::create_dir_all(d.join("snapshots")).unwrap();
        let b = broker_with(d, &["--preempt-after-ms", "0"]);
        let flags: Vec<String> = [
            ("--broker", b.addr.clone()),
            ("--broker-key-file", d.join("key").display().to_string()),
            ("--checkpoint-dir", d.join("snapshots").display().to_string()),
            ("--admin-key-file", d.join("admin.key").display().to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect();
        let seed = format!("rgpu-{name}-{}", std::process::id());
        let s = Server::start_on("127.0.0.1:0", ServerOpts::default(), &seed, &flags);
        let sa = s.addr_string();
        wait_until("the server registered", Duration::from_secs(20), || servers_up(&b, d) == vec![sa.clone()]);
        let key = d.join("admin.key").display().to_string();
        let run_args = ["--broker", &b.addr, "--admin-key-file", &key, "--plaintext", "--gpus", "1"];
        let envs = [("RGPU_LOG", Some("warn,cuda::client=info")), ("RGPU_TLS_CA", None)];
        let rounds = rounds.to_string();
        let run = spawn_rgpu_run(&run_args, &exe, &["--rounds", &rounds, "--wait-ms", "300", "--mib", "16"], &envs);
        if !run.wait_for_line("round 1", run_timeout()) {
            let out = run.wait(Duration::from_secs(5));
            panic!("rt_checkpoint never printed 'round 1'\n{}", out.describe(&[&s]));
        }
        let leases = json(&["leases"], &b, d);
        let low = leases.as_array().unwrap().first().expect("the run's lease")["id"].as_str().unwrap().to_string();
        (Pool { dir, b, s, flags, seed, low }, run)
    }

    fn snapshots(&self) -> Vec<String> {
        snapshots(&self.dir.0.join("snapshots"))
    }

    /// Asks for the GPU at priority 5, which suspends the program's lease;
    /// returns the urgent lease's id once granted, and how long that took.
    fn preempt(&self) -> (String, Duration) {
        let started = Instant::now();
        let urgent = json(&["lease", "--gpus", "1", "--priority", "5", "--wait", "60s", "--bearer-token"], &self.b, &self.dir.0);
        let took = started.elapsed();
        let row = self.lease(&self.low).expect("the run's lease lives on");
        assert_eq!(row["state"], "suspended", "{row}\n{}", self.s.describe());
        let on_disk = self.snapshots();
        assert!(
            on_disk.len() == 1 && on_disk[0].starts_with(&format!("preempt-{}-", self.low)),
            "the session's snapshot: {on_disk:?}\n{}",
            self.s.describe()
        );
        (urgent["id"].as_str().expect("the urgent lease's id").to_string(), took)
    }

    fn lease(&self, id: &str) -> Option<serde_json::Value> {
        json(&["leases"], &self.b, &self.dir.0).as_array().unwrap().iter().find(|l| l["id"] == id).cloned()
    }

    fn release(&self, id: &str) {
        let (ok, out, err) = rgpu(&["release", id], &self.b, &self.dir.0);
        assert!(ok, "rgpu release {id}: {out}\n{err}");
    }

    fn audited(&self, op: &str) -> bool {
        let audit = json(&["audit"], &self.b, &self.dir.0);
        audit.as_array().unwrap().iter().any(|r| r["op"] == op && r["ok"] == true && r["target"] == self.low.as_str())
    }
}

#[test]
fn a_preempted_program_waits_on_disk_and_resumes_with_every_round_right() {
    let (p, run) = Pool::start("preemption", 6);
    let (urgent, granted_in) = p.preempt();
    assert!(p.s.log().contains("lease suspended"), "{}", p.s.describe());
    // The program waits while suspended (a round that had its last reply
    // before the suspension may still print).
    let before = rounds_done(&run.stdout_so_far());
    std::thread::sleep(Duration::from_millis(1500));
    let during = rounds_done(&run.stdout_so_far());
    assert!(during <= before + 1, "the program ran on while suspended: {before} -> {during} rounds");

    p.release(&urgent);
    let done = run.wait(run_timeout());
    done.assert_pass("rt_checkpoint", &[&p.s]);
    let report = done.describe(&[&p.s]);
    for r in 0..6 {
        assert!(done.stdout.contains(&format!("ok: round {r}: ")), "round {r} missing\n{report}");
    }
    assert!(done.stderr.contains("lease is suspended"), "the shim did not wait for the suspension\n{report}");
    assert!(done.stderr.contains("lease was resumed after"), "{report}");
    assert!(p.s.log().contains("lease resumed"), "{report}");
    assert!(p.snapshots().is_empty(), "snapshots left after the resume: {:?}", p.snapshots());
    for op in ["suspend", "resume"] {
        assert!(p.audited(op), "{op} is not audited");
    }
    eprintln!("preemption: the urgent lease was granted {granted_in:?} after it asked");
}

/// The snapshots outlive the server: one killed while a lease is suspended
/// and started again at its address still resumes it.
#[test]
fn a_server_restarted_while_a_lease_is_suspended_still_resumes_it() {
    let (mut p, run) = Pool::start("preemption-restart", 4);
    let (urgent, _) = p.preempt();
    let addr = p.s.addr_string();
    p.s.kill();
    p.s = Server::start_on(&addr, ServerOpts::default(), &p.seed, &p.flags);
    wait_until("the suspended session noted again", Duration::from_secs(20), || p.s.log().contains("a suspended session is on disk here"));
    wait_until("the server registered again", Duration::from_secs(20), || servers_up(&p.b, &p.dir.0) == vec![addr.clone()]);
    p.release(&urgent);
    let done = run.wait(run_timeout());
    done.assert_pass("rt_checkpoint", &[&p.s]);
    let report = done.describe(&[&p.s]);
    for r in 0..4 {
        assert!(done.stdout.contains(&format!("ok: round {r}: ")), "round {r} missing\n{report}");
    }
    assert!(p.snapshots().is_empty(), "snapshots left after the resume: {:?}", p.snapshots());
}

/// A lease released while suspended: its snapshot is dropped and its
/// program fails (it does not hang, and nothing of it comes back).
#[test]
fn a_lease_released_while_suspended_drops_its_snapshot_and_fails_its_program() {
    let (p, run) = Pool::start("preemption-ended", 6);
    let (_urgent, _) = p.preempt();
    p.release(&p.low);
    wait_until("the snapshot dropped", Duration::from_secs(20), || p.snapshots().is_empty());
    let done = run.wait(run_timeout());
    let report = done.describe(&[&p.s]);
    assert!(!done.timed_out && done.status.is_some_and(|s| !s.success()), "the program of a released lease did not fail\n{report}");
    assert!(!done.stdout.contains("ok: round 5: "), "{report}");
    assert!(p.s.log().contains("a suspended lease ended"), "{report}");
}

/// `rgpu suspend` and `rgpu resume`: the owner parks its lease on disk,
/// GPUs freed, for as long as it likes, and the program carries on after.
#[test]
fn an_owner_suspends_its_lease_and_resumes_it_with_every_round_right() {
    let (p, run) = Pool::start("preemption-owner", 5);
    let d = &p.dir.0;
    let (ok, _, err) = rgpu(&["resume", &p.low], &p.b, d);
    assert!(!ok && err.contains("not suspended by its owner"), "resuming a running lease: {err}");
    let (ok, out, err) = rgpu(&["suspend", &p.low, "--json"], &p.b, d);
    assert!(ok, "rgpu suspend: {out}\n{err}\n{}", p.s.describe());
    let l: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(l["state"], "suspended", "{l}");
    assert_eq!(p.snapshots().len(), 1, "{:?}", p.snapshots());
    let free = || json(&["servers"], &p.b, d)[0]["gpus_free"].as_u64();
    assert_eq!(free(), Some(1), "the GPU is free while the lease is suspended");
    // Free and nothing waiting: it stays suspended until its owner says.
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(p.lease(&p.low).unwrap()["state"], "suspended");
    // Meanwhile another lease takes the GPU: the resume waits for it.
    let other = json(&["lease", "--gpus", "1", "--bearer-token"], &p.b, d);
    let (ok, out, err) = rgpu(&["resume", &p.low], &p.b, d);
    assert!(ok && err.contains("waits for its GPUs"), "rgpu resume with its GPU taken: {out}\n{err}");
    assert_eq!(p.lease(&p.low).unwrap()["state"], "suspended");
    p.release(other["id"].as_str().unwrap());
    wait_until("the lease running again", Duration::from_secs(20), || p.lease(&p.low).is_some_and(|l| l["state"] == "active"));
    let done = run.wait(run_timeout());
    done.assert_pass("rt_checkpoint", &[&p.s]);
    let report = done.describe(&[&p.s]);
    for r in 0..5 {
        assert!(done.stdout.contains(&format!("ok: round {r}: ")), "round {r} missing\n{report}");
    }
    assert!(p.snapshots().is_empty(), "{:?}", p.snapshots());
    for op in ["suspend-request", "resume-request", "suspend", "resume"] {
        assert!(p.audited(op), "{op} is not audited");
    }
}

/// A snapshot that cannot be restored (damaged on disk): the resume fails,
/// the broker ends the lease, and the program fails at once instead of
/// waiting for a session that cannot come back, or running on wrong state.
#[test]
fn a_damaged_snapshot_ends_the_lease_and_fails_its_program_instead_of_hanging() {
    let (p, run) = Pool::start("preemption-damaged", 6);
    let d = &p.dir.0;
    let (ok, out, err) = rgpu(&["suspend", &p.low], &p.b, d);
    assert!(ok, "rgpu suspend: {out}\n{err}\n{}", p.s.describe());
    let file = d.join("snapshots").join(&p.snapshots()[0]);
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&file).unwrap().set_len(len / 2).unwrap();
    let started = Instant::now();
    let _ = rgpu(&["resume", &p.low, "--wait", "0"], &p.b, d);
    let done = run.wait(run_timeout());
    let report = done.describe(&[&p.s]);
    assert!(!done.timed_out && done.status.is_some_and(|s| !s.success()), "the program did not fail\n{report}");
    assert!(started.elapsed() < Duration::from_secs(30), "failed only after {:?}\n{report}", started.elapsed());
    assert!(!done.stdout.contains("ok: round 5: "), "{report}");
    assert!(p.lease(&p.low).is_none_or(|l| l["state"] != "active"), "the lease runs on without its state");
    wait_until("the snapshot dropped", Duration::from_secs(20), || p.snapshots().is_empty());
    assert!(p.s.log().contains("lease not resumed"), "{report}");
}

/// `rgpu checkpoint LEASE --to FILE` then `rgpu restore FILE`: the lease is
/// suspended into a file of its own; the server's copy is lost (its disk
/// wiped); the file puts it back and the program finishes with every round
/// right. Then `--continue` keeps a copy while the program runs on.
#[test]
fn a_lease_kept_in_a_file_comes_back_after_its_server_lost_its_copy() {
    let (p, run) = Pool::start("lease-file", 6);
    let d = &p.dir.0;
    let file = d.join("lease.rgpu");
    let file_s = file.display().to_string();
    // A key the server refuses: refused before the lease is suspended.
    let wrong = d.join("wrong.key");
    std::fs::write(&wrong, "00".repeat(32)).unwrap();
    let (ok, _, err) = rgpu(&["checkpoint", &p.low, "--to", &file_s, "--key-file", wrong.to_str().unwrap()], &p.b, d);
    assert!(!ok && err.contains("was not suspended"), "a wrong server key: {err}");
    assert_eq!(p.lease(&p.low).unwrap()["state"], "active");
    assert!(!file.exists());
    let (ok, out, err) = rgpu(&["checkpoint", &p.low, "--to", &file_s], &p.b, d);
    assert!(ok, "rgpu checkpoint LEASE: {out}\n{err}\n{}", p.s.describe());
    assert!(err.contains("1 session(s)"), "{err}");
    assert_eq!(p.lease(&p.low).unwrap()["state"], "suspended");
    let (ok, _, err) = rgpu(&["checkpoint", &p.low, "--to", &file_s], &p.b, d);
    assert!(!ok && err.contains("exists"), "a second checkpoint over the file: {err}");

    // The server loses what it wrote; the program waits, it does not fail.
    let lost = p.snapshots();
    assert_eq!(lost.len(), 1, "{lost:?}");
    for n in &lost {
        std::fs::remove_file(d.join("snapshots").join(n)).unwrap();
    }
    std::thread::sleep(Duration::from_millis(500));
    let waiting = run.stdout_so_far();
    assert!(!waiting.contains("FAIL"), "{waiting}");

    let (ok, out, err) = rgpu(&["restore", &file_s], &p.b, d);
    assert!(ok, "rgpu restore FILE: {out}\n{err}\n{}", p.s.describe());
    assert!(err.contains("1 of 1 snapshot(s) copied back"), "{err}");
    wait_until("the lease running again", Duration::from_secs(20), || p.lease(&p.low).is_some_and(|l| l["state"] == "active"));
    let (ok, _, err) = rgpu(&["restore", &file_s], &p.b, d);
    assert!(!ok && err.contains("not suspended"), "restoring a file into a running lease: {err}");

    // A copy kept while the program runs on.
    assert!(run.wait_for_line("round 3", run_timeout()), "no round 3 after the restore");
    let again = d.join("lease-2.rgpu").display().to_string();
    let (ok, out, err) = rgpu(&["checkpoint", &p.low, "--to", &again, "--continue"], &p.b, d);
    assert!(ok && err.contains("Resumed lease"), "rgpu checkpoint LEASE --continue: {out}\n{err}\n{}", p.s.describe());
    assert!(std::fs::metadata(&again).unwrap().len() > 16 << 20, "the copy holds the program's 16 MiB");

    let done = run.wait(run_timeout());
    done.assert_pass("rt_checkpoint", &[&p.s]);
    let report = done.describe(&[&p.s]);
    for r in 0..6 {
        assert!(done.stdout.contains(&format!("ok: round {r}: ")), "round {r} missing\n{report}");
    }
    assert!(p.snapshots().is_empty(), "{:?}", p.snapshots());
}
