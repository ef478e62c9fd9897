//! Checkpoint and restore (docs/migration.md): a CUDA program runs through
//! the shim against a server; its session is checkpointed to a snapshot,
//! the server is killed, a new server starts at the same address and the
//! snapshot is restored there. The program's shim resumes the session by
//! itself and the program finishes with every result right. Live
//! migration: the session moved between two running servers, the shim
//! redirected.

use rgpu_integration::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const KEY: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch() -> Dir {
    scratch_named("a")
}

fn scratch_named(which: &str) -> Dir {
    let d = std::env::temp_dir().join(format!("rgpu-checkpoint-{}-{:?}-{which}", std::process::id(), std::thread::current().id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("snapshots")).unwrap();
    std::fs::write(d.join("admin.key"), KEY).unwrap();
    Dir(d)
}

fn server_flags(dir: &Path) -> Vec<String> {
    vec![
        "--admin-key-file".into(),
        dir.join("admin.key").display().to_string(),
        "--checkpoint-dir".into(),
        dir.join("snapshots").display().to_string(),
    ]
}

/// Runs `rgpu ARGS`; returns (success, stderr).
fn rgpu(args: &[&str], key: &Path) -> (bool, String) {
    rgpu_secured(args, key, None)
}

/// As [`rgpu`], under TLS trusting `ca` (plaintext without).
fn rgpu_secured(args: &[&str], key: &Path, ca: Option<&Path>) -> (bool, String) {
    let mut cmd = Command::new(&binaries().rgpu);
    cmd.args(args).arg("--key-file").arg(key).env("NO_COLOR", "1").env_remove("RGPU_TLS_CA").env_remove("RGPU_PLAINTEXT");
    match ca {
        Some(ca) => cmd.arg("--tls-ca").arg(ca),
        None => cmd.arg("--plaintext"),
    };
    let out = cmd.output().expect("running rgpu");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The id of the session the server attached, from its log (`session{id=0x...`).
fn session_id(server: &Server) -> Option<String> {
    let log = server.log();
    let at = log.find("session{id=")? + "session{id=".len();
    Some(log[at..].chars().take_while(|c| c.is_ascii_alphanumeric()).collect())
}

/// A server at the address a killed one had: the port may take a moment to be free.
fn start_again(addr: &str, seed: &str, flags: &[String]) -> Server {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let free = std::net::TcpListener::bind(addr).is_ok();
        if free || Instant::now() > deadline {
            return Server::start_on(addr, ServerOpts::default(), seed, flags);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// What the CLI said about a checkpoint and a restore, and the disk's
/// write rate just before and just after the checkpoint (when measured).
struct Moved {
    checkpoint: String,
    restore: String,
    disk: Option<(String, String)>,
}

/// `dd` writing 1 GiB, synced, into `dir`: its summary line.
fn dd(dir: &Path) -> String {
    let out = Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", dir.join("dd.bin").display()))
        .args(["bs=8M", "count=128", "conv=fdatasync"])
        .output()
        .expect("dd");
    let _ = std::fs::remove_file(dir.join("dd.bin"));
    String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("").to_string()
}

/// Where the checkpointed session is restored.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Then {
    /// The server is killed and a new one started at its address with
    /// `--restore` (the session is back before any client is taken).
    Restart,
    /// `rgpu restore` on the same server, where the session waits, left.
    InPlace,
    /// `rgpu restore --forward-from A` on another server B, reading the same
    /// snapshot folder: A redirects the program's resume to B.
    Elsewhere,
    /// `rgpu checkpoint --save FILE` copies the snapshot off A, A's copy is
    /// deleted, and `rgpu restore --load FILE --forward-from A` puts it on
    /// B, whose snapshot folder is its own. `in_calls`: both copies in
    /// control-plane calls (`--copy-in-calls`) instead of one stream each.
    ElsewhereFromFile { in_calls: bool },
}

/// Runs rt_checkpoint (holding `mib` MiB beyond its small arrays) against a
/// server; after its second round, checkpoints the session, restores it as
/// `then` says, and checks the program finishes right.
fn checkpoint_and_restore(mib: u32, wait_ms: u32, then: Then, measure_disk: bool) -> Moved {
    let exe = build("rt_checkpoint", Variant::Cudart13Shared);
    let dir = scratch();
    let flags = server_flags(&dir.0);
    let seed = format!("rgpu-checkpoint-{}", std::process::id());
    // Snapshot copies are counted on both ends' metrics.
    let metrics_a = metrics_addr();
    let mut flags_a = flags.clone();
    if matches!(then, Then::ElsewhereFromFile { .. }) {
        flags_a.extend(["--metrics".to_string(), metrics_a.clone()]);
    }
    let mut a = Server::start_on("127.0.0.1:0", ServerOpts::default(), &seed, &flags_a);
    let addr = a.addr_string();
    let envs = [("RGPU_RECONNECT_TIMEOUT", "60"), ("RGPU_LOG", "warn,cuda::client::connection=info")];
    let (mib, wait) = (mib.to_string(), wait_ms.to_string());
    let run = spawn_rgpu_env(&addr, &exe, &["--rounds", "6", "--wait-ms", &wait, "--mib", &mib], &envs);
    if !run.wait_for_line("round 1", run_timeout()) {
        let out = run.wait(Duration::from_secs(5));
        panic!("rt_checkpoint never printed 'round 1'\n{}", out.describe(&[&a]));
    }
    let id = session_id(&a).unwrap_or_else(|| panic!("no session id in the server's log\n{}", a.describe()));
    let key = dir.0.join("admin.key");

    // A wrong key is refused, and nothing is written.
    let wrong = dir.0.join("wrong.key");
    std::fs::write(&wrong, KEY.replace('0', "f")).unwrap();
    let (ok, err) = rgpu(&["checkpoint", &id, "--server", &addr, "--to", "job.snap"], &wrong);
    assert!(!ok && err.contains("refused"), "a wrong key was not refused: {err}");
    assert!(!dir.0.join("snapshots/job.snap").exists());

    let before = measure_disk.then(|| dd(&dir.0.join("snapshots")));
    let saved = dir.0.join("saved.snap");
    let saved_arg = saved.display().to_string();
    let mut args = vec!["checkpoint", &id, "--server", &addr, "--to", "job.snap"];
    let in_calls = then == Then::ElsewhereFromFile { in_calls: true };
    if matches!(then, Then::ElsewhereFromFile { .. }) {
        args.extend(["--save", &saved_arg]);
    }
    if in_calls {
        args.push("--copy-in-calls");
    }
    let (ok, checkpoint) = rgpu(&args, &key);
    assert!(ok, "checkpoint failed: {checkpoint}\n{}", a.describe());
    let disk = before.map(|b| (b, dd(&dir.0.join("snapshots"))));
    assert!(dir.0.join("snapshots/job.snap").exists());

    let stopped = Instant::now();
    let (b, restore) = match then {
        Then::Restart => {
            // The server goes away as in a crash; a new one takes its address.
            a.kill();
            let mut flags = flags.clone();
            flags.extend(["--restore".to_string(), "job.snap".to_string()]);
            (start_again(&addr, &seed, &flags), String::new())
        }
        Then::InPlace => {
            let (ok, restore) = rgpu(&["restore", "job.snap", "--server", &addr], &key);
            assert!(ok, "restore failed: {restore}\n{}", a.describe());
            (a, restore)
        }
        Then::Elsewhere => {
            let b = Server::start_on("127.0.0.1:0", ServerOpts::default(), &format!("{seed}-b"), &flags);
            let ba = b.addr_string();
            let (ok, restore) = rgpu(&["restore", "job.snap", "--server", &ba, "--forward-from", &addr], &key);
            assert!(ok, "restore on B failed: {restore}\n{}\n{}", a.describe(), b.describe());
            assert!(a.wait_for_log("session forwarded to where it was restored", Duration::from_secs(10)), "{}", a.describe());
            // Forwarded once: the session is gone from A, so again is refused.
            let (ok, again) = rgpu(&["restore", "job.snap", "--server", &ba, "--forward-from", &addr], &key);
            assert!(!ok, "a second restore of a session served on B succeeded: {again}");
            (b, restore)
        }
        Then::ElsewhereFromFile { .. } => {
            let on_a = dir.0.join("snapshots/job.snap");
            assert_eq!(std::fs::read(&saved).unwrap(), std::fs::read(&on_a).unwrap(), "the saved file is the snapshot");
            assert!(checkpoint.contains("Saved job.snap"), "{checkpoint}");
            // A's disk is gone: only the saved file is left.
            std::fs::remove_file(&on_a).unwrap();
            let dir_b = scratch_named("b");
            let metrics_b = metrics_addr();
            let mut flags_b = server_flags(&dir_b.0);
            flags_b.extend(["--metrics".to_string(), metrics_b.clone()]);
            let b = Server::start_on("127.0.0.1:0", ServerOpts::default(), &format!("{seed}-b"), &flags_b);
            let ba = b.addr_string();
            // Refused without the admin key: nothing lands on B.
            let (ok, err) = rgpu(&["restore", "job.snap", "--server", &ba, "--load", &saved_arg], &wrong);
            assert!(!ok && err.contains("refused"), "an upload with a wrong key was not refused: {err}");
            assert!(!dir_b.0.join("snapshots/job.snap").exists());
            let mut args = vec!["restore", "job.snap", "--server", &ba, "--load", &saved_arg, "--forward-from", &addr];
            if in_calls {
                args.push("--copy-in-calls");
            }
            let (ok, restore) = rgpu(&args, &key);
            let disk = disk.as_ref().map(|_| dd(&dir_b.0.join("snapshots")));
            assert!(ok, "restore from the file on B failed: {restore}\n{}\n{}", a.describe(), b.describe());
            assert!(restore.contains("Copied") && dir_b.0.join("snapshots/job.snap").exists(), "{restore}");
            // The name is taken on B now: a second upload is refused whole.
            let (ok, again) = rgpu(&["restore", "job.snap", "--server", &ba, "--load", &saved_arg], &key);
            assert!(!ok && again.contains("exists"), "a second upload of job.snap was not refused: {again}");
            if !in_calls {
                // A: one copy off; B: one onto, and two refused (the wrong
                // key before its request proved anything, the name taken after).
                let size = std::fs::metadata(&saved).unwrap().len() as f64;
                // The server counts a copy just after its last answer: wait a little.
                let settled = |m: &str, sample: String, want: f64| {
                    let deadline = Instant::now() + Duration::from_secs(5);
                    loop {
                        let got = scrape(m, &sample);
                        if got == Some(want) || Instant::now() > deadline {
                            return got;
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                };
                let copies = |m: &str, way: &str, result: &str| {
                    settled(m, format!(r#"rgpu_server_snapshot_copies_total{{way="{way}",result="{result}"}}"#), 1.0)
                };
                assert_eq!(copies(&metrics_a, "off", "ok"), Some(1.0));
                assert_eq!(settled(&metrics_a, r#"rgpu_server_snapshot_copy_bytes_total{way="off"}"#.into(), size), Some(size));
                assert_eq!(copies(&metrics_b, "onto", "ok"), Some(1.0));
                assert_eq!(copies(&metrics_b, "unproved", "failed"), Some(1.0));
                assert_eq!(copies(&metrics_b, "onto", "failed"), Some(1.0));
                assert_eq!(settled(&metrics_b, r#"rgpu_server_snapshot_copy_bytes_total{way="onto"}"#.into(), size), Some(size));
            }
            let restore = match disk {
                Some(d) => format!("{restore}\ndisk just after the upload: dd if=/dev/zero bs=8M count=128 conv=fdatasync: {d}"),
                None => restore,
            };
            (b, restore)
        }
    };

    let out = run.wait(run_timeout());
    out.assert_pass("rt_checkpoint", &[&b]);
    let restore = match then {
        Then::Restart => b.log().lines().filter(|l| l.contains("session restored")).collect::<Vec<_>>().join("\n"),
        Then::InPlace | Then::Elsewhere | Then::ElsewhereFromFile { .. } => restore,
    };
    let report = out.describe(&[&b]);
    for r in 0..6 {
        assert!(out.stdout.contains(&format!("ok: round {r}: ")), "round {r} missing\n{report}");
    }
    assert!(b.log().contains("session resumed on a new connection"), "the session was not resumed on the new server\n{report}");
    eprintln!("{}\n{}", checkpoint.trim(), restore.trim());
    eprintln!("the program resumed and finished {:?} after the checkpoint", stopped.elapsed());
    Moved { checkpoint, restore, disk }
}

#[test]
fn a_checkpointed_session_restored_on_a_restarted_server_finishes_right() {
    let m = checkpoint_and_restore(64, 300, Then::Restart, false);
    assert!(m.restore.contains("session restored"), "{}", m.restore);
}

/// `rgpu checkpoint` on A, `rgpu restore --forward-from A` on B: the
/// program, still trying A, is redirected to B and finishes right.
#[test]
fn a_checkpointed_session_restored_on_another_server_is_redirected_there() {
    let m = checkpoint_and_restore(16, 300, Then::Elsewhere, false);
    assert!(m.restore.contains("forwarded from"), "{}", m.restore);
}

/// `rgpu checkpoint --save FILE` on A, A's copy deleted, `rgpu restore
/// --load FILE --forward-from A` on B (its own snapshot folder): the
/// program finishes right on B.
#[test]
fn a_checkpoint_saved_to_a_file_is_restored_on_another_server_from_it() {
    let m = checkpoint_and_restore(16, 300, Then::ElsewhereFromFile { in_calls: false }, false);
    assert!(m.restore.contains("forwarded from"), "{}", m.restore);
}

/// The same, with the snapshot copied off and on in control-plane calls,
/// as a server older than the one-stream copy takes it.
#[test]
fn a_checkpoint_saved_to_a_file_in_control_plane_calls_is_restored_from_it() {
    let m = checkpoint_and_restore(16, 300, Then::ElsewhereFromFile { in_calls: true }, false);
    assert!(m.restore.contains("forwarded from"), "{}", m.restore);
}

#[test]
fn a_checkpointed_session_restored_in_place_by_the_cli_finishes_right() {
    checkpoint_and_restore(16, 300, Then::InPlace, false);
}

/// A checkpoint that takes longer than both the server's
/// `--reconnect-grace` and the shim's `RGPU_RECONNECT_TIMEOUT` (as one of
/// many GiB does at a disk's rate) costs the program nothing but time:
/// meanwhile the server answers its resumes "held", and the grace starts
/// when the checkpoint ends. Before, the program lost its session.
#[test]
fn a_checkpoint_longer_than_every_reconnect_bound_costs_the_program_nothing_but_time() {
    let exe = build("rt_checkpoint", Variant::Cudart13Shared);
    let dir = scratch();
    let bound = 0.3;
    let mut flags = server_flags(&dir.0);
    flags.extend(["--reconnect-grace".to_string(), bound.to_string()]);
    let a = Server::start_on("127.0.0.1:0", ServerOpts::default(), &format!("rgpu-held-{}", std::process::id()), &flags);
    let addr = a.addr_string();
    let envs = [("RGPU_RECONNECT_TIMEOUT", bound.to_string()), ("RGPU_LOG", "warn,cuda::client::connection=info".to_string())];
    let envs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (*k, v.as_str())).collect();
    // Cut mid-run, while the program still calls the server every
    // `PACED_MS`: it must meet the checkpoint, not its end (see `PACED`).
    let run = spawn_rgpu_env(&addr, &exe, &strs(&paced(&["--mib", "512"])), &envs);
    if !run.wait_for_line("round 1", run_timeout()) {
        let out = run.wait(Duration::from_secs(5));
        panic!("rt_checkpoint never printed 'round 1'\n{}", out.describe(&[&a]));
    }
    let id = session_id(&a).unwrap_or_else(|| panic!("no session id in the server's log\n{}", a.describe()));
    let key = dir.0.join("admin.key");
    let (ok, report) = rgpu(&["checkpoint", &id, "--server", &addr, "--to", "job.snap", "--continue"], &key);
    assert!(ok, "checkpoint failed: {report}\n{}", a.describe());
    assert!(dir.0.join("snapshots/job.snap").exists());
    // The capture itself (the server's figure) outlasted both bounds,
    // or this test shows nothing.
    let took: f64 = report
        .split(" in ")
        .nth(1)
        .and_then(|t| t.split(" s").next())
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or_else(|| panic!("no time in the checkpoint's report: {report}"));
    assert!(took > 2.0 * bound, "the checkpoint took {took} s: too short to outlast the bounds of {bound} s; hold more memory");
    finished_after_being_held(run, &a);
    assert!(a.log().contains("session resumed on a new connection"), "{}", a.describe());
    eprintln!("{}", report.trim());
}

/// rt_checkpoint's rounds for a test that cuts it after "round 1" and needs
/// the cut to land while the program still runs rounds: one every
/// `PACED_MS` or so, for `PACED_ROUNDS` rounds. Unpaced, the last rounds
/// ran within milliseconds of round 1; a cut that came after them (the
/// control call is a new process, slow on a busy host) found the program in
/// its final copy, or gone, and the test showed nothing.
const PACED_ROUNDS: u32 = 30;
const PACED_MS: u32 = 100;

fn paced(more: &[&str]) -> Vec<String> {
    let mut args = vec!["--rounds".to_string(), PACED_ROUNDS.to_string(), "--wait-ms".to_string(), PACED_MS.to_string()];
    args.extend(more.iter().map(|a| a.to_string()));
    args
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// rt_checkpoint (paced) finished with every round right, having been told
/// by `a` to wait while it held the session.
fn finished_after_being_held(run: Running, a: &Server) {
    let out = run.wait(run_timeout());
    out.assert_pass("rt_checkpoint", &[a]);
    let report = out.describe(&[a]);
    for r in 0..PACED_ROUNDS {
        assert!(out.stdout.contains(&format!("ok: round {r}: ")), "round {r} missing\n{report}");
    }
    assert!(out.stderr.contains("the server holds the session"), "the program was never told to wait\n{report}");
}

/// The program paused between a checkpoint and a restore that comes long
/// after its reconnect time and the server's grace: the server answers its
/// resumes "held" until the restore, and it finishes right. Before, it
/// lost its session once its reconnect time passed.
#[test]
fn a_program_waits_for_a_restore_that_comes_long_after_its_checkpoint() {
    let exe = build("rt_checkpoint", Variant::Cudart13Shared);
    let dir = scratch();
    let bound = "0.3";
    let mut flags = server_flags(&dir.0);
    flags.extend(["--reconnect-grace".to_string(), bound.to_string()]);
    let a = Server::start_on("127.0.0.1:0", ServerOpts::default(), &format!("rgpu-parked-{}", std::process::id()), &flags);
    let addr = a.addr_string();
    let envs = [("RGPU_RECONNECT_TIMEOUT", bound), ("RGPU_LOG", "warn,cuda::client::connection=info")];
    let run = spawn_rgpu_env(&addr, &exe, &strs(&paced(&[])), &envs);
    if !run.wait_for_line("round 1", run_timeout()) {
        let out = run.wait(Duration::from_secs(5));
        panic!("rt_checkpoint never printed 'round 1'\n{}", out.describe(&[&a]));
    }
    let id = session_id(&a).unwrap_or_else(|| panic!("no session id in the server's log\n{}", a.describe()));
    let key = dir.0.join("admin.key");
    let (ok, report) = rgpu(&["checkpoint", &id, "--server", &addr, "--to", "job.snap"], &key);
    assert!(ok, "checkpoint failed: {report}\n{}", a.describe());
    // Ten times the client's reconnect time and the server's grace.
    std::thread::sleep(Duration::from_secs(3));
    let (ok, restore) = rgpu(&["restore", "job.snap", "--server", &addr], &key);
    assert!(ok, "restore failed: {restore}\n{}", a.describe());
    finished_after_being_held(run, &a);
}

/// Checkpoint, copy-off, copy-on and restore throughput of a session
/// holding 1 GiB, with the disk's write rate (the same size, synced, into
/// the same directory) measured just before and just after the checkpoint
/// and just after the copy onto the second server, as a shared disk's rate
/// moves a lot. The snapshot is saved to a file (`--save`), removed from A,
/// and loaded onto B (`--load`), in one stream each, or, with
/// `THROUGHPUT_IN_CALLS=1`, in control-plane calls; the link's rate is a
/// bare loopback TCP copy of 1 GiB after. With `TMPDIR=/dev/shm` the disk
/// is memory, and the copies are measured against the link alone:
/// `cargo test --release -p rgpu-integration --test checkpoint -- --ignored --nocapture throughput`.
#[test]
#[ignore = "a measurement: 1 GiB through the disk"]
fn throughput() {
    // The program sleeps 5 s after each round: the two dd runs and the
    // checkpoint fit in one sleep, so the session is idle throughout.
    let in_calls = std::env::var_os("THROUGHPUT_IN_CALLS").is_some();
    let moved = checkpoint_and_restore(1024, 5000, Then::ElsewhereFromFile { in_calls }, true);
    let (before, after) = moved.disk.expect("measured");
    eprintln!("disk just before: dd if=/dev/zero bs=8M count=128 conv=fdatasync: {before}");
    eprintln!("disk just after:  dd if=/dev/zero bs=8M count=128 conv=fdatasync: {after}");
    let link = loopback_copy(1 << 30);
    eprintln!("1 GiB over loopback TCP, once: {:.3} s, {:.0} MiB/s", link.as_secs_f64(), 1024.0 / link.as_secs_f64());
    assert!(moved.checkpoint.contains("Saved") && moved.restore.contains("Copied") && moved.restore.contains("MiB/s"));
}

#[test]
fn a_restore_is_refused_without_the_admin_key_and_a_snapshot_name_is_never_a_path() {
    let dir = scratch();
    let s = Server::start_on("127.0.0.1:0", ServerOpts::default(), "rgpu-checkpoint-refusals", &server_flags(&dir.0));
    let addr = s.addr_string();
    let key = dir.0.join("admin.key");
    let (ok, err) = rgpu(&["restore", "../admin.key", "--server", &addr], &key);
    assert!(!ok && err.contains("snapshot name"), "{err}");
    let (ok, err) = rgpu(&["restore", "missing.snap", "--server", &addr], &key);
    assert!(!ok && err.contains("No such file"), "{err}");
    // Garbage where a snapshot should be: a typed error, and the server lives on.
    std::fs::write(dir.0.join("snapshots/junk.snap"), b"not a snapshot at all").unwrap();
    let (ok, err) = rgpu(&["restore", "junk.snap", "--server", &addr], &key);
    assert!(!ok && err.contains("not an rgpu session snapshot"), "{err}");
    let (ok, err) = rgpu(&["checkpoint", "0x1234", "--server", &addr, "--to", "x.snap"], &key);
    assert!(!ok && err.contains("no session"), "{err}");
    // A server without the key file refuses every operator call.
    let plain = Server::start_default();
    let (ok, err) = rgpu(&["restore", "junk.snap", "--server", &plain.addr_string()], &key);
    assert!(!ok && err.contains("--admin-key-file"), "{err}");
}

/// `rgpu migrate ID --server FROM --to TO`: (success, stderr).
fn migrate(id: &str, from: &str, to: &str, key: &Path) -> (bool, String) {
    rgpu(&["migrate", id, "--server", from, "--to", to], key)
}

/// "the program was held 12.3 ms" from `rgpu migrate`'s report.
fn held_ms(report: &str) -> f64 {
    report.split("was held ").nth(1).and_then(|t| t.split(' ').next()).and_then(|ms| ms.parse().ok()).unwrap_or(f64::NAN)
}

/// The session ids `rgpu sessions --json` lists on `server`.
fn sessions_on(server: &str, key: &Path) -> Vec<u64> {
    let out = Command::new(&binaries().rgpu)
        .args(["sessions", "--server", server, "--json", "--plaintext", "--key-file"])
        .arg(key)
        .output()
        .expect("running rgpu");
    assert!(out.status.success(), "rgpu sessions: {}", String::from_utf8_lossy(&out.stderr));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).expect("rgpu sessions --json prints JSON");
    rows.as_array()
        .expect("a list")
        .iter()
        .map(|r| u64::from_str_radix(r["id"].as_str().unwrap().trim_start_matches("0x"), 16).unwrap())
        .collect()
}

/// A free loopback address for a server's --metrics.
fn metrics_addr() -> String {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string()
}

/// The value of the sample `name{labels}` on the metrics endpoint at `addr`.
fn scrape(addr: &str, sample: &str) -> Option<f64> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    body.lines().find_map(|l| l.strip_prefix(sample)?.trim().parse().ok())
}

/// Two servers sharing the admin key; the program starts on the first.
fn two_servers(dir: &Path, seed: &str) -> (Server, Server) {
    let flags = server_flags(dir);
    let a = Server::start_on("127.0.0.1:0", ServerOpts::default(), &format!("{seed}-a"), &flags);
    let b = Server::start_on("127.0.0.1:0", ServerOpts::default(), &format!("{seed}-b"), &flags);
    (a, b)
}

/// Live migration (docs/migration.md): a program mid-run (kernels on a
/// stream, events, a module global, a 64 MiB buffer) is moved A -> B -> A -> B
/// between its rounds; every round and the buffer must come out right,
/// and the servers must have redirected the shim each time.
#[test]
fn a_session_migrated_back_and_forth_mid_run_finishes_right() {
    migrated_back_and_forth(&[]);
}

/// As above, the program's rounds one instantiated CUDA graph each: the
/// graph moves with the session (snapshot format version 2), and its
/// copies back to the host keep arriving.
#[test]
fn a_session_with_an_instantiated_graph_migrates_back_and_forth_and_finishes_right() {
    migrated_back_and_forth(&["--graph", "1"]);
}

/// As above, the program's large buffer two physical allocations mapped end
/// to end through the driver's virtual memory management (one released while
/// mapped): they move with the session, at the same addresses, bytes and all.
#[test]
fn a_session_with_mapped_vmm_memory_migrates_back_and_forth_and_finishes_right() {
    migrated_back_and_forth(&["--vmm", "1"]);
}

/// The cuda backend's path (docs/migration.md, "Movable memory"): two
/// servers on the cuda backend with `--cuda-movable-memory`, each over its own
/// sim server through rgpu's shim as their driver (two GPU hosts), and the
/// program's session moved between them mid-run. Its 64 MiB buffer, module
/// global, streams and events are rebuilt through the driver API at the
/// addresses the program holds.
#[test]
fn a_session_on_the_cuda_backend_migrates_back_and_forth_and_finishes_right() {
    migrated_on_the_cuda_backend(&[]);
}

/// As above, the program's rounds one instantiated CUDA graph each.
#[test]
fn a_cuda_session_with_an_instantiated_graph_migrates_back_and_forth_and_finishes_right() {
    migrated_on_the_cuda_backend(&["--graph", "1"]);
}

/// As above, the program's large buffer mapped through the virtual memory
/// management API: on the cuda backend its physical allocations are read
/// and written through a scratch mapping of the driver's.
#[test]
fn a_cuda_session_with_mapped_vmm_memory_migrates_back_and_forth_and_finishes_right() {
    migrated_on_the_cuda_backend(&["--vmm", "1"]);
}

/// Checkpoint and restore on the cuda backend's path: a session checkpointed
/// on one cuda server (movable memory, over its own sim server) is restored
/// on another from the shared snapshot folder, the first forwards the
/// program's resume there, and every round comes out right.
#[test]
fn a_cuda_session_checkpointed_on_one_server_is_restored_on_another() {
    let exe = build("rt_checkpoint", Variant::Cudart13Shared);
    let dir = scratch();
    let (gpu_a, gpu_b) = (Server::start_default(), Server::start_default());
    let mut flags = server_flags(&dir.0);
    flags.push("--cuda-movable-memory".into());
    let (a, b) = (Server::start_chain_with(&gpu_a, &flags), Server::start_chain_with(&gpu_b, &flags));
    let (aa, ba) = (a.addr_string(), b.addr_string());
    let key = dir.0.join("admin.key");
    let envs = [("RGPU_RECONNECT_TIMEOUT", "60"), ("RGPU_LOG", "warn,cuda::client=info")];
    // Rounds enough that the checkpoint (a new CLI process) finds it running.
    let run = spawn_rgpu_env(&aa, &exe, &["--rounds", "8", "--wait-ms", "300", "--mib", "32"], &envs);
    if !run.wait_for_line("round 1", run_timeout()) {
        let out = run.wait(Duration::from_secs(5));
        panic!("rt_checkpoint never printed 'round 1'\n{}", out.describe(&[&a, &b]));
    }
    let id = session_id(&a).unwrap_or_else(|| panic!("no session id\n{}", a.describe()));
    let (ok, report) = rgpu(&["checkpoint", &id, "--server", &aa, "--to", "job.snap"], &key);
    assert!(ok, "checkpoint failed: {report}\n{}", a.describe());
    let (ok, report) = rgpu(&["restore", "job.snap", "--server", &ba, "--forward-from", &aa], &key);
    assert!(ok, "restore failed: {report}\n{}\n{}", a.describe(), b.describe());
    let out = run.wait(run_timeout());
    out.assert_pass("rt_checkpoint", &[&a, &b]);
    let report = out.describe(&[&a, &b]);
    for r in 0..8 {
        assert!(out.stdout.contains(&format!("ok: round {r}: ")), "round {r} missing\n{report}");
    }
    assert!(out.stderr.contains("the session moved from"), "the shim was not redirected\n{report}");
}

fn migrated_on_the_cuda_backend(extra: &[&str]) {
    let dir = scratch();
    let metrics = metrics_addr();
    let (gpu_a, gpu_b) = (Server::start_default(), Server::start_default());
    let mut flags = server_flags(&dir.0);
    flags.push("--cuda-movable-memory".into());
    let b = Server::start_chain_with(&gpu_b, &flags);
    flags.extend(["--metrics".to_string(), metrics.clone()]);
    let a = Server::start_chain_with(&gpu_a, &flags);
    for s in [&a, &b] {
        assert!(s.log().contains("backend cuda") && s.log().contains("movable=true"), "{}", s.describe());
    }
    // Movable memory is pre-copied; VMM memory is not (as on the sim).
    let precopied = if extra.contains(&"--vmm") { 0.0 } else { 2.0 * (64 << 20) as f64 };
    migrate_rounds(&a, &b, &dir.0, &metrics, extra, precopied);
}

/// Without `--cuda-movable-memory` a cuda session cannot be placed again at its
/// addresses: the migration is refused before anything moves, and the
/// program goes on where it was and finishes right.
#[test]
fn a_cuda_session_without_movable_memory_refuses_to_migrate_and_runs_on() {
    let exe = build("rt_checkpoint", Variant::Cudart13Shared);
    let dir = scratch();
    let (gpu_a, gpu_b) = (Server::start_default(), Server::start_default());
    let flags = server_flags(&dir.0);
    let (a, b) = (Server::start_chain_with(&gpu_a, &flags), Server::start_chain_with(&gpu_b, &flags));
    let (aa, ba) = (a.addr_string(), b.addr_string());
    let key = dir.0.join("admin.key");
    let run = spawn_rgpu_env(&aa, &exe, &["--rounds", "3", "--wait-ms", "200", "--mib", "8"], &[("RGPU_LOG", "warn")]);
    assert!(run.wait_for_line("round 0", run_timeout()), "rt_checkpoint never started\n{}", a.describe());
    let id = session_id(&a).unwrap_or_else(|| panic!("no session id\n{}", a.describe()));
    let (ok, report) = migrate(&id, &aa, &ba, &key);
    assert!(!ok, "a cuda session without movable memory migrated: {report}");
    assert!(report.to_lowercase().contains("not supported"), "{report}");
    let out = run.wait(run_timeout());
    out.assert_pass("rt_checkpoint", &[&a, &b]);
    assert!(sessions_on(&ba, &key).is_empty(), "something arrived on the target");
    // Refused before the target was called at all.
    assert!(!b.log().contains("migration"), "the target heard of it:\n{}", b.describe());
}

/// rt_checkpoint with `extra` arguments, migrated A -> B -> A -> B mid-run.
fn migrated_back_and_forth(extra: &[&str]) {
    let dir = scratch();
    let seed = format!("rgpu-migrate-{}", std::process::id());
    let metrics = metrics_addr();
    let mut flags = server_flags(&dir.0);
    flags.extend(["--metrics".to_string(), metrics.clone()]);
    let a = Server::start_on("127.0.0.1:0", ServerOpts::default(), &format!("{seed}-a"), &flags);
    let b = Server::start_on("127.0.0.1:0", ServerOpts::default(), &format!("{seed}-b"), &server_flags(&dir.0));
    // VMM memory is not pre-copied: it goes while the program is held.
    let precopied = if extra.contains(&"--vmm") { 0.0 } else { 2.0 * (64 << 20) as f64 };
    migrate_rounds(&a, &b, &dir.0, &metrics, extra, precopied);
}

/// rt_checkpoint with `extra` arguments against `a` (serving metrics at
/// `metrics`), migrated A -> B -> A -> B mid-run; at least `precopied` bytes
/// must have been pre-copied.
fn migrate_rounds(a: &Server, b: &Server, dir: &Path, metrics: &str, extra: &[&str], precopied: f64) {
    let exe = build("rt_checkpoint", Variant::Cudart13Shared);
    let (aa, ba) = (a.addr_string(), b.addr_string());
    let key = dir.join("admin.key");
    let envs = [("RGPU_RECONNECT_TIMEOUT", "60"), ("RGPU_LOG", "warn,cuda::client=info")];
    // Rounds 6.. run after the last move: the program must still be there
    // to be listed at its target (with 8 rounds, a busy host once saw it
    // finish first).
    let rounds = 12;
    let rounds_arg = rounds.to_string();
    let mut args = vec!["--rounds", &rounds_arg, "--wait-ms", "200", "--mib", "64"];
    args.extend_from_slice(extra);
    let run = spawn_rgpu_env(&aa, &exe, &args, &envs);
    let mut held = Vec::new();
    for (after, from, to) in [("round 1", &aa, &ba), ("round 3", &ba, &aa), ("round 5", &aa, &ba)] {
        if !run.wait_for_line(after, run_timeout()) {
            let out = run.wait(Duration::from_secs(5));
            panic!("rt_checkpoint never printed {after:?}\n{}", out.describe(&[&a, &b]));
        }
        let id = session_id(a).unwrap_or_else(|| panic!("no session id in the first server's log\n{}", a.describe()));
        let n = u64::from_str_radix(id.trim_start_matches("0x"), 16).unwrap();
        assert_eq!(sessions_on(from, &key), vec![n], "rgpu sessions on {from}");
        let (ok, report) = migrate(&id, from, to, &key);
        assert!(ok, "migration {from} -> {to} failed: {report}\n{}\n{}", a.describe(), b.describe());
        // Served where it went, and no longer where it was (the old
        // thread ends once the note is written; give it a moment).
        let gone = Instant::now() + Duration::from_secs(5);
        while sessions_on(from, &key).contains(&n) && Instant::now() < gone {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(!sessions_on(from, &key).contains(&n), "the session is still on {from} after it moved");
        // Listed at the target once its client has resumed it there.
        while sessions_on(to, &key) != vec![n] && Instant::now() < gone {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(sessions_on(to, &key), vec![n], "rgpu sessions on {to}");
        held.push(held_ms(&report));
        eprintln!("{}", report.trim());
    }
    let out = run.wait(run_timeout());
    out.assert_pass("rt_checkpoint", &[a, b]);
    let report = out.describe(&[a, b]);
    for r in 0..rounds {
        assert!(out.stdout.contains(&format!("ok: round {r}: ")), "round {r} missing\n{report}");
    }
    assert_eq!(out.stderr.matches("the session moved from").count(), 3, "the shim did not follow three redirects\n{report}");
    assert_eq!(b.log().matches("session migrated in").count(), 2, "{report}");
    assert_eq!(a.log().matches("session migrated in").count(), 1, "{report}");
    assert!(a.log().contains("the session moved to another server; it ends here"), "{report}");
    // The first server sent it twice and took it back once.
    let sample = |s: &str| scrape(metrics, s);
    assert_eq!(sample(r#"rgpu_server_migrations_total{direction="out",result="ok"}"#), Some(2.0), "{report}");
    assert_eq!(sample(r#"rgpu_server_migrations_total{direction="in",result="ok"}"#), Some(1.0), "{report}");
    assert_eq!(sample("rgpu_server_migration_held_seconds_count"), Some(2.0), "{report}");
    assert!(sample(r#"rgpu_server_migration_memory_bytes_total{phase="precopy"}"#).is_some_and(|b| b >= precopied));
    eprintln!("held {held:?} ms for 64 MiB; the program finished in {:?}", out.elapsed);
}

/// Migrations racing the program's asynchronous work: rt_reconnect's 64 MiB
/// copies and batches of asynchronous launches and copies, with the session
/// moved to the other server shortly after each starts. Nothing may be
/// lost or run twice (the program checks every result).
#[test]
fn migrations_racing_asynchronous_copies_and_launches_lose_nothing() {
    let dir = scratch();
    let (a, b) = two_servers(&dir.0, &format!("rgpu-migrate-race-{}", std::process::id()));
    migrations_race(&a, &b, &dir.0);
}

/// As above, between two cuda servers with movable memory (each over its own
/// sim server): their pre-copy reads the program's memory from other
/// threads while its copies and kernels write it.
#[test]
fn migrations_of_a_cuda_session_racing_its_copies_and_launches_lose_nothing() {
    let dir = scratch();
    let (gpu_a, gpu_b) = (Server::start_default(), Server::start_default());
    let mut flags = server_flags(&dir.0);
    flags.push("--cuda-movable-memory".into());
    let (a, b) = (Server::start_chain_with(&gpu_a, &flags), Server::start_chain_with(&gpu_b, &flags));
    migrations_race(&a, &b, &dir.0);
}

fn migrations_race(a: &Server, b: &Server, dir: &Path) {
    let exe = build("rt_reconnect", Variant::Cudart13Shared);
    let addrs = [a.addr_string(), b.addr_string()];
    let key = dir.join("admin.key");
    let envs = [("RGPU_RECONNECT_TIMEOUT", "60"), ("RGPU_LOG", "warn,cuda::client=info")];
    let run = spawn_rgpu_env(&addrs[0], &exe, &["--rounds", "3", "--copy-mib", "64"], &envs);
    let (mut at, mut moves) = (0usize, 0usize);
    let deadline = Instant::now() + run_timeout();
    while let Ok(line) = run.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        let after = if line.starts_with("copying") {
            Duration::from_millis(40)
        } else if line.starts_with("launching") {
            Duration::from_millis(3)
        } else {
            continue;
        };
        std::thread::sleep(after);
        let Some(id) = session_id(a) else { continue };
        let (ok, report) = migrate(&id, &addrs[at], &addrs[1 - at], &key);
        // The program may have finished its part meanwhile; a migration of a
        // session that ended is refused, anything else must succeed.
        if ok {
            at = 1 - at;
            moves += 1;
        } else {
            let gone = report.contains("no session") || report.contains("ended before it could be checkpointed");
            assert!(gone, "migration failed: {report}\n{}\n{}", a.describe(), b.describe());
        }
    }
    let out = run.wait(Duration::from_secs(30));
    out.assert_pass("rt_reconnect", &[a, b]);
    let report = out.describe(&[a, b]);
    assert!(moves >= 4, "only {moves} of the 6 migrations found the session\n{report}");
    let arrived = a.log().matches("session migrated in").count() + b.log().matches("session migrated in").count();
    assert_eq!(arrived, moves, "{report}");
    // A session moved away and back before its shim came back is found
    // where it was, without a redirect; so at most one redirect a move.
    let redirects = out.stderr.matches("the session moved from").count();
    assert!((1..=moves).contains(&redirects), "{redirects} redirects for {moves} moves\n{report}");
    eprintln!("rt_reconnect --rounds 3 migrated {moves} times in {:?}", out.elapsed);
}

/// A migration that cannot complete leaves the session where it was, and
/// the program finishes right there: a target that is not listening, one
/// with another admin key, and one that takes the stream and dies in the
/// middle of it (a stand-in that reads 1 MiB and closes).
#[test]
fn a_failed_migration_leaves_the_session_running_where_it_was() {
    let exe = build("rt_checkpoint", Variant::Cudart13Shared);
    let dir = scratch();
    let flags = server_flags(&dir.0);
    let a = Server::start_on("127.0.0.1:0", ServerOpts::default(), "rgpu-migrate-fail-a", &flags);
    let other = dir.0.join("other.key");
    std::fs::write(&other, KEY.replace('1', "e")).unwrap();
    let other_flags = vec!["--admin-key-file".to_string(), other.display().to_string()];
    let b = Server::start_on("127.0.0.1:0", ServerOpts::default(), "rgpu-migrate-fail-b", &other_flags);
    let dying = dying_target();
    let aa = a.addr_string();
    let key = dir.0.join("admin.key");
    let envs = [("RGPU_RECONNECT_TIMEOUT", "60"), ("RGPU_LOG", "warn,cuda::client=info")];
    // Rounds enough to outlast five refused migrations and a server start.
    let run = spawn_rgpu_env(&aa, &exe, &["--rounds", "12", "--wait-ms", "300", "--mib", "64"], &envs);
    if !run.wait_for_line("round 1", run_timeout()) {
        let out = run.wait(Duration::from_secs(5));
        panic!("rt_checkpoint never printed 'round 1'\n{}", out.describe(&[&a]));
    }
    let id = session_id(&a).expect("a session id");
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let (ok, err) = migrate(&id, &aa, &closed, &key);
    assert!(!ok && err.contains("cannot reach the target"), "{err}");
    let (ok, err) = migrate(&id, &aa, &b.addr_string(), &key);
    assert!(!ok && err.contains("not this server's admin key"), "{err}");
    let (ok, err) = migrate(&id, &aa, &dying.0, &key);
    assert!(!ok && err.contains("broke during the migration"), "{err}");
    assert!(dying.1.join().unwrap() > 0, "the stand-in target read nothing");
    // A target that cannot rebuild the session (its device is smaller than
    // the program's 64 MiB) says why, rather than closing the connection
    // under a sender with most of the stream still to send.
    let small = ServerOpts { memory: 32 << 20, ..ServerOpts::default() };
    let c = Server::start_on("127.0.0.1:0", small, "rgpu-migrate-fail-c", &flags);
    let (ok, err) = migrate(&id, &aa, &c.addr_string(), &key);
    assert!(!ok && err.contains("refused the session") && err.contains("more than this server takes"), "{err}\n{}", c.describe());
    // Not the operator's key: refused before anything is touched.
    let wrong = dir.0.join("wrong.key");
    std::fs::write(&wrong, KEY.replace('0', "f")).unwrap();
    let (ok, err) = migrate(&id, &aa, &b.addr_string(), &wrong);
    assert!(!ok && err.contains("refused"), "{err}");
    let out = run.wait(run_timeout());
    out.assert_pass("rt_checkpoint", &[&a, &b, &c]);
    assert!(!out.stderr.contains("the session moved from"), "{}", out.describe(&[&a, &b, &c]));
    assert!(!b.log().contains("session migrated in") && !c.log().contains("session migrated in"), "{}", b.describe());
}

/// Between two servers under TLS: the servers speak TLS to each other (the
/// source checks the target against its --tls-ca), the shim's redirected
/// resume is TLS too, and a TLS server cannot push a session into a
/// plaintext one.
#[test]
fn a_session_migrates_between_tls_servers() {
    let exe = build("rt_checkpoint", Variant::Cudart13Shared);
    let dir = scratch();
    let files = rgpu_tls::pki::write_throwaway(&dir.0.join("pki"), &["127.0.0.1"]).unwrap();
    let mut flags = server_flags(&dir.0);
    flags.extend(["--tls-ca".to_string(), files.ca.display().to_string()]);
    let tls = || ServerOpts { tls: Some((files.cert.clone(), files.key.clone())), ..ServerOpts::default() };
    let a = Server::start_on("127.0.0.1:0", tls(), "rgpu-migrate-tls-a", &flags);
    let b = Server::start_on("127.0.0.1:0", tls(), "rgpu-migrate-tls-b", &flags);
    let plain = Server::start_on("127.0.0.1:0", ServerOpts::default(), "rgpu-migrate-tls-p", &server_flags(&dir.0));
    let (aa, ba) = (a.addr_string(), b.addr_string());
    let key = dir.0.join("admin.key");
    let ca = files.ca.to_str().unwrap();
    let envs = [
        ("RGPU_RECONNECT_TIMEOUT", Some("60")),
        ("RGPU_LOG", Some("warn,cuda::client=info")),
        ("RGPU_TLS_CA", Some(ca)),
        ("RGPU_PLAINTEXT", None),
    ];
    let run = spawn_rgpu_with(&aa, &exe, &["--rounds", "5", "--wait-ms", "300", "--mib", "16"], &envs);
    if !run.wait_for_line("round 1", run_timeout()) {
        let out = run.wait(Duration::from_secs(5));
        panic!("rt_checkpoint never printed 'round 1'\n{}", out.describe(&[&a]));
    }
    let id = session_id(&a).expect("a session id");
    let (ok, err) = rgpu_secured(&["migrate", &id, "--server", &aa, "--to", &plain.addr_string()], &key, Some(&files.ca));
    assert!(!ok && err.contains("cannot reach the target"), "a TLS server pushed a session in clear: {err}");
    let (ok, report) = rgpu_secured(&["migrate", &id, "--server", &aa, "--to", &ba], &key, Some(&files.ca));
    assert!(ok, "{report}\n{}\n{}", a.describe(), b.describe());
    let out = run.wait(run_timeout());
    out.assert_pass("rt_checkpoint", &[&a, &b]);
    let report = out.describe(&[&a, &b]);
    assert!(out.stderr.contains("the session moved from"), "{report}");
    assert!(b.log().contains("session migrated in"), "{report}");
    assert!(!plain.log().contains("session migrated in"), "{}", plain.describe());
}

/// A stand-in target: answers the intake handshake as a real one would,
/// reads 1 MiB of the snapshot and closes (a target killed mid-migration).
/// Returns its address and the bytes it read.
fn dying_target() -> (String, std::thread::JoinHandle<usize>) {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let h = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut preamble = [0u8; 8];
        s.read_exact(&mut preamble).unwrap();
        assert_eq!(&preamble, b"RGPUMIG1");
        s.write_all(&[7u8; 32]).unwrap();
        let mut proof = [0u8; 32];
        s.read_exact(&mut proof).unwrap();
        // "ready": status 0, no reason, two zero counts.
        s.write_all(&[0u8; 24]).unwrap();
        let mut got = vec![0u8; 1 << 20];
        let mut read = 0;
        while read < got.len() {
            match s.read(&mut got[read..]) {
                Ok(0) | Err(_) => break,
                Ok(k) => read += k,
            }
        }
        read
    });
    (addr, h)
}

/// The pause and the total time of a live migration of a session holding
/// 1 GiB, with the pre-copy (A to B) and without (B, `--migrate-precopy=false`,
/// to A), against copying 1 GiB once over loopback TCP in the same run:
/// `cargo test --release -p rgpu-integration --test checkpoint -- --ignored --nocapture migration_pause`.
#[test]
#[ignore = "a measurement: 1 GiB moved between two servers"]
fn migration_pause() {
    let exe = build("rt_checkpoint", Variant::Cudart13Shared);
    let dir = scratch();
    let flags = server_flags(&dir.0);
    let a = Server::start_on("127.0.0.1:0", ServerOpts::default(), "rgpu-migrate-pause-a", &flags);
    let mut stop_and_copy = flags.clone();
    stop_and_copy.push("--migrate-precopy=false".to_string());
    let b = Server::start_on("127.0.0.1:0", ServerOpts::default(), "rgpu-migrate-pause-b", &stop_and_copy);
    let key = dir.0.join("admin.key");
    let envs = [("RGPU_RECONNECT_TIMEOUT", "60"), ("RGPU_LOG", "warn")];
    // Eight moves, four each way; after each, while the program sleeps,
    // 1 GiB copied once over loopback TCP: the baseline of that moment.
    const MOVES: usize = 8;
    let source = vec![7u8; 1 << 30];
    let rounds = (MOVES + 1).to_string();
    let run = spawn_rgpu_env(&a.addr_string(), &exe, &["--rounds", &rounds, "--wait-ms", "3000", "--mib", "1024"], &envs);
    let mut rows = Vec::new();
    let mut addrs = [a.addr_string(), b.addr_string()];
    for r in 0..MOVES {
        assert!(run.wait_for_line(&format!("round {r}"), run_timeout()), "no round {r}");
        let id = session_id(&a).expect("a session id");
        let (ok, report) = migrate(&id, &addrs[0], &addrs[1], &key);
        assert!(ok, "{report}");
        let baseline = loopback_copy(1 << 30).as_secs_f64();
        let landed = loopback_copy_landing(&source).as_secs_f64();
        let total: f64 = report
            .split(" in ")
            .nth(1)
            .and_then(|t| t.split(" s;").next())
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("no total in {report:?}"));
        rows.push((r % 2 == 0, total, held_ms(&report), baseline, landed));
        eprintln!("{}", report.trim());
        addrs.swap(0, 1);
    }
    let out = run.wait(run_timeout());
    out.assert_pass("rt_checkpoint", &[&a, &b]);
    for s in [&a, &b] {
        for l in s.log().lines().filter(|l| l.contains("digested again") || l.contains("pre-copied while") || l.contains("migrated in")) {
            eprintln!("{}", l.split("INFO").nth(1).unwrap_or(l).trim());
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    eprintln!("| migration | total s | held ms | 1 GiB over loopback, s | total / that | 1 GiB over loopback into new memory, s | total / that |");
    eprintln!("|---|---|---|---|---|---|---|");
    for &(pre, total, held, base, landed) in &rows {
        let kind = if pre { "pre-copy" } else { "stop and copy" };
        eprintln!("| {kind} | {total:.3} | {held:.1} | {base:.3} | {:.2}x | {landed:.3} | {:.2}x |", total / base, total / landed);
    }
    type Row = (bool, f64, f64, f64, f64);
    for pre in [true, false] {
        let of = |f: &dyn Fn(&Row) -> f64| median(rows.iter().filter(|r| r.0 == pre).map(f).collect());
        eprintln!(
            "median, {}: total {:.3} s, held {:.1} ms, total / loopback {:.2}x, total / loopback into new memory {:.2}x",
            if pre { "pre-copy" } else { "stop and copy" },
            of(&|r| r.1),
            of(&|r| r.2),
            of(&|r| r.1 / r.3),
            of(&|r| r.1 / r.4)
        );
    }
}

/// How long copying `source` once over one loopback TCP connection into
/// memory new to the receiver takes: what a migration's target does with
/// a session's memory (it allocates it afresh), without the migration.
fn loopback_copy_landing(source: &[u8]) -> Duration {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let len = source.len();
    let start = Instant::now();
    let sink = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut landed = vec![0u8; len];
        let mut got = 0usize;
        while got < len {
            match s.read(&mut landed[got..]) {
                Ok(0) | Err(_) => break,
                Ok(n) => got += n,
            }
        }
        (got, landed[len - 1])
    });
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.write_all(source).unwrap();
    drop(c);
    assert_eq!(sink.join().unwrap(), (len, source[len - 1]));
    start.elapsed()
}

/// How long sending `bytes` over one loopback TCP connection takes.
fn loopback_copy(bytes: usize) -> Duration {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let sink = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0usize;
        while got < bytes {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => got += n,
            }
        }
        got
    });
    let chunk = vec![7u8; 1 << 20];
    let start = Instant::now();
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    for _ in 0..bytes / chunk.len() {
        c.write_all(&chunk).unwrap();
    }
    drop(c);
    assert_eq!(sink.join().unwrap(), bytes);
    start.elapsed()
}
