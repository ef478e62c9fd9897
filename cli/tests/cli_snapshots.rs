//! Snapshot tests of what `rgpu` says to people: `--help` of the command and
//! of every subcommand, and the errors of common mistakes. Each case runs the
//! built binary and compares its exit status, stdout and stderr with
//! `tests/snapshots/NAME.txt`.
//!
//! After an intended change, rewrite the snapshots and review the diff:
//! `RGPU_UPDATE_SNAPSHOTS=1 cargo test -p rgpu-cli --test cli_snapshots`.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const UPDATE_VAR: &str = "RGPU_UPDATE_SNAPSHOTS";
/// No case should take more than this (an unreachable broker is refused at
/// once on loopback).
const CASE_TIMEOUT: Duration = Duration::from_secs(30);

fn snapshot_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots").join(format!("{name}.txt"))
}

/// Runs `rgpu ARGS` with no RGPU_* settings from the caller's environment
/// (clap shows set `env` values in help) and renders what it did.
fn run(args: &[&str]) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rgpu"));
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    for (k, _) in std::env::vars_os() {
        if k.to_str().is_some_and(|k| k.starts_with("RGPU_")) {
            cmd.env_remove(k);
        }
    }
    cmd.env("COLUMNS", "100").env("NO_COLOR", "1");
    let mut child = cmd.spawn().expect("run rgpu");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for rgpu") {
            break s;
        }
        if start.elapsed() > CASE_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("rgpu {args:?} did not finish in {CASE_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let out = child.wait_with_output().expect("collect rgpu output");
    let code = status.code().map_or_else(|| "killed by a signal".to_string(), |c| c.to_string());
    format!(
        "$ rgpu{}\nexit status: {code}\n--- stdout\n{}--- stderr\n{}",
        args.iter().map(|a| format!(" {a}")).collect::<String>(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    )
}

/// Compares (or, with RGPU_UPDATE_SNAPSHOTS=1, rewrites) one snapshot;
/// returns a description of the mismatch.
fn check(name: &str, args: &[&str]) -> Option<String> {
    let actual = run(args);
    let path = snapshot_path(name);
    if std::env::var_os(UPDATE_VAR).is_some_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().unwrap()).expect("create snapshot folder");
        std::fs::write(&path, &actual).expect("write snapshot");
        return None;
    }
    let expected = match std::fs::read_to_string(&path) {
        Ok(s) => s,
        Err(e) => return Some(format!("{name}: no snapshot at {} ({e}); got:\n{actual}", path.display())),
    };
    if expected == actual {
        return None;
    }
    let mut diff = String::new();
    let (e, a): (Vec<&str>, Vec<&str>) = (expected.lines().collect(), actual.lines().collect());
    for i in 0..e.len().max(a.len()) {
        match (e.get(i), a.get(i)) {
            (Some(x), Some(y)) if x == y => {}
            (x, y) => {
                diff.push_str(&format!("  line {}:\n    expected: {:?}\n    actual:   {:?}\n", i + 1, x, y));
            }
        }
    }
    Some(format!("{name} ({}) differs:\n{diff}", path.display()))
}

fn check_all(cases: &[(&str, &[&str])]) {
    let failures: Vec<String> = cases.iter().filter_map(|(name, args)| check(name, args)).collect();
    assert!(
        failures.is_empty(),
        "{} snapshot(s) differ; if the change is intended, rerun with {UPDATE_VAR}=1 and review the diff\n\n{}",
        failures.len(),
        failures.join("\n")
    );
}

const SUBCOMMANDS: &[&str] =
    &["run", "demo", "bench", "lease", "renew", "release", "suspend", "resume", "leases", "servers", "smi", "drain", "undrain", "status", "credential", "audit", "usage", "top", "checkpoint", "restore", "migrate", "sessions", "fault"];

#[test]
fn help_of_every_command() {
    let mut cases: Vec<(String, Vec<&str>)> = vec![("help".into(), vec!["--help"])];
    for s in SUBCOMMANDS {
        cases.push((format!("help-{s}"), vec![s, "--help"]));
    }
    for s in ["issue", "rotate", "revoke"] {
        cases.push((format!("help-credential-{s}"), vec!["credential", s, "--help"]));
    }
    for s in ["inject", "clear"] {
        cases.push((format!("help-fault-{s}"), vec!["fault", s, "--help"]));
    }
    let cases: Vec<(&str, &[&str])> = cases.iter().map(|(n, a)| (n.as_str(), a.as_slice())).collect();
    check_all(&cases);
}

#[test]
fn every_subcommand_has_a_help_snapshot() {
    // The top-level help's command list: a subcommand added to rgpu must be
    // added to SUBCOMMANDS (and so get its help snapshot).
    let help = run(&["--help"]);
    let listed: Vec<&str> = help
        .lines()
        .skip_while(|l| *l != "Commands:")
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .collect();
    assert_eq!(listed, SUBCOMMANDS, "rgpu --help lists other subcommands than this test knows");
}

#[test]
fn errors_of_common_mistakes() {
    check_all(&[
        ("error-no-command", &[]),
        ("error-unknown-command", &["lese"]),
        ("error-run-no-server", &["run", "--", "true"]),
        ("error-run-no-program", &["run", "--server", "127.0.0.1:1"]),
        ("error-leases-no-credential", &["leases", "--broker", "127.0.0.1:1"]),
        ("error-leases-unreachable-broker", &["leases", "--broker", "127.0.0.1:1", "--admin-key-file", "tests/fixtures/admin.key", "--plaintext"]),
        ("error-leases-no-tls-setting", &["leases", "--broker", "127.0.0.1:1", "--admin-key-file", "tests/fixtures/admin.key"]),
        (
            "error-run-unreachable-broker",
            &["run", "--gpus", "1", "--broker", "127.0.0.1:1", "--admin-key-file", "tests/fixtures/admin.key", "--plaintext", "--", "true"],
        ),
        ("error-credential-bad-tenant", &["credential", "issue", "--tenant", "a:b", "--out", "/nonexistent/x", "--admin-key-file", "tests/fixtures/admin.key"]),
        ("error-memory-unknown-unit", &["run", "--memory", "20XB", "--", "true"]),
        ("error-memory-not-a-size", &["lease", "--memory", "lots"]),
        ("error-memory-zero", &["lease", "--memory", "0GiB"]),
        ("error-bandwidth-not-a-rate", &["lease", "--bandwidth", "10Gb"]),
        ("error-bandwidth-zero", &["lease", "--bandwidth", "0Gb/s"]),
        ("error-same-bad-scope", &["lease", "--gpus", "2", "--same", "rack"]),
        ("error-strict-without-same", &["lease", "--gpus", "2", "--strict"]),
        ("error-release-no-lease", &["release"]),
    ]);
}
