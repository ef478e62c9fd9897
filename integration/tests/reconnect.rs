//! A dropped connection costs a program nothing but time, and a stopped
//! server becomes an error within the configured bound. The program runs
//! through `rgpu run`; a proxy between the shim and the server cuts the
//! connection in the middle of a large copy and of a batch of asynchronous
//! launches and copies.

use rgpu_integration::proxy::Proxy;
use rgpu_integration::*;
use std::time::{Duration, Instant};

const ROUNDS: &str = "3";

/// Runs rt_reconnect through `proxy`; with `cut`, cuts every connection
/// shortly after each "copying", "launching" and "pinned" line. Returns the output
/// and the number of cuts that cut something.
/// `tls_ca`: the shim talks TLS, trusting this CA.
fn run_through(proxy: &Proxy, exe: &std::path::Path, cut: bool, tls_ca: Option<&str>) -> (RunOutput, usize) {
    // The shim says how long each resume took.
    let log = ("RGPU_LOG", Some("warn,cuda::client::connection=info"));
    let envs = match tls_ca {
        Some(ca) => [log, ("RGPU_TLS_CA", Some(ca)), ("RGPU_PLAINTEXT", None)],
        None => [log, ("RGPU_PLAINTEXT", Some("1")), ("RGPU_TLS_CA", None)],
    };
    let run = spawn_rgpu_with(&proxy.addr_string(), exe, &["--rounds", ROUNDS, "--copy-mib", "64"], &envs);
    let mut cuts = 0;
    let deadline = Instant::now() + run_timeout();
    while let Ok(line) = run.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        if !cut {
            continue;
        }
        // In the middle of the 64 MiB copy; among the asynchronous batch.
        let after = if line.starts_with("copying") {
            Duration::from_millis(40)
        } else if line.starts_with("launching") {
            Duration::from_millis(3)
        } else if line.starts_with("pinned") {
            // Among the page-locked copies nobody waits for.
            Duration::from_millis(2)
        } else {
            continue;
        };
        std::thread::sleep(after);
        if proxy.cut() > 0 {
            cuts += 1;
        }
    }
    (run.wait(Duration::from_secs(10)), cuts)
}

/// A duration as the shim's log writes it (Rust's `Debug`: `812.5µs`,
/// `84.43ms`, `1.135s`), in milliseconds.
fn resume_ms(d: &str) -> Option<f64> {
    let (n, scale) = [("ns", 1e-6), ("µs", 1e-3), ("ms", 1.0), ("s", 1e3)].iter().find_map(|(u, k)| Some((d.strip_suffix(u)?, *k)))?;
    n.parse::<f64>().ok().map(|v| v * scale)
}

#[test]
fn resumes_are_read_in_every_unit_the_log_writes() {
    // A resume over a second under CI's load read as none (the test then
    // counted 8 resumes for 9 cuts).
    let near = |d: &str, ms: f64| resume_ms(d).is_some_and(|v| (v - ms).abs() < 1e-9);
    assert!(near("1.5s", 1500.0));
    assert!(near("84.5ms", 84.5));
    assert!(near("812.5µs", 0.8125));
    assert!(near("500ns", 0.0005));
    assert_eq!(resume_ms("soon"), None);
}

#[test]
fn a_cut_connection_costs_the_program_nothing_but_time() {
    let exe = build("rt_reconnect", Variant::Cudart13Shared);
    let server = Server::start_default();
    let proxy = Proxy::start(server.addr);
    let (quiet, _) = run_through(&proxy, &exe, false, None);
    quiet.assert_pass("rt_reconnect", &[&server]);
    let before = proxy.accepted();
    let (out, cuts) = run_through(&proxy, &exe, true, None);
    out.assert_pass("rt_reconnect", &[&server]);
    let report = out.describe(&[&server]);
    assert!(cuts >= 4, "only {cuts} of the 6 cuts found a connection to cut\n{report}");
    // The control connection and the data connection, then one per resume.
    assert!(proxy.accepted() - before >= 2 + cuts, "the shim did not reconnect after each cut\n{report}");
    assert!(!out.stderr.contains("lost"), "the program saw a lost connection\n{report}");
    let resumed = server.log().matches("session resumed on a new connection").count();
    assert!(resumed >= cuts, "the server resumed {resumed} times for {cuts} cuts\n{report}");
    // "session resumed on ADDR after 1.234ms (1 attempt(s)); ..."
    let took: Vec<f64> = out
        .stderr
        .lines()
        .filter_map(|l| l.split("session resumed on ").nth(1)?.split(" after ").nth(1)?.split(' ').next().map(str::to_string))
        .filter_map(|d| resume_ms(&d))
        .collect();
    assert!(took.len() >= cuts, "the shim logged {} resumes for {cuts} cuts\n{report}", took.len());
    let max = took.iter().cloned().fold(0.0, f64::max);
    eprintln!(
        "rt_reconnect --rounds {ROUNDS}: {:?} without cuts, {:?} with {cuts} cuts; resumes took {:.2} ms on average, {max:.2} ms at most",
        quiet.elapsed,
        out.elapsed,
        took.iter().sum::<f64>() / took.len() as f64
    );
}

/// The same cuts against a server under TLS: every resumed connection
/// makes its own TLS handshake (the session goes on under TLS, never in
/// clear), and the program still sees nothing.
#[test]
fn a_cut_connection_under_tls_costs_the_program_nothing_but_time() {
    let exe = build("rt_reconnect", Variant::Cudart13Shared);
    let dir = std::env::temp_dir().join(format!("rgpu-integration-tls-reconnect-{}", std::process::id()));
    let files = rgpu_tls::pki::write_throwaway(&dir, &["127.0.0.1"]).unwrap();
    let server = Server::start(ServerOpts { tls: Some((files.cert.clone(), files.key.clone())), ..ServerOpts::default() });
    let proxy = Proxy::start(server.addr);
    let (out, cuts) = run_through(&proxy, &exe, true, Some(files.ca.to_str().unwrap()));
    out.assert_pass("rt_reconnect", &[&server]);
    let report = out.describe(&[&server]);
    assert!(cuts >= 4, "only {cuts} of the 6 cuts found a connection to cut\n{report}");
    assert!(!out.stderr.contains("lost"), "the program saw a lost connection\n{report}");
    let resumed = server.log().matches("session resumed on a new connection").count();
    assert!(resumed >= cuts, "the server resumed {resumed} times for {cuts} cuts\n{report}");
    eprintln!("rt_reconnect --rounds {ROUNDS} under TLS: {:?} with {cuts} cuts, {resumed} resumes", out.elapsed);
    let _ = std::fs::remove_dir_all(dir);
}

/// The server is stopped (SIGSTOP: alive, its sockets open, answering
/// nothing) while the program copies in a loop: the program's next CUDA call
/// must fail within RGPU_SERVER_TIMEOUT + RGPU_RECONNECT_TIMEOUT.
#[test]
fn a_stopped_server_becomes_an_error_within_the_bound() {
    let exe = build("rt_killed", Variant::Cudart13Shared);
    let server = Server::start_default();
    let envs = [("RGPU_SERVER_TIMEOUT", "2"), ("RGPU_RECONNECT_TIMEOUT", "2")];
    let run = spawn_rgpu_env(&server.addr_string(), &exe, &["--max-seconds", "60"], &envs);
    if !run.wait_for_line("looping", run_timeout()) {
        let out = run.wait(Duration::from_secs(5));
        panic!("rt_killed never printed 'looping'\n{}", out.describe(&[&server]));
    }
    std::thread::sleep(Duration::from_millis(300));
    let pid = server.pid().expect("the server runs") as i32;
    // SAFETY: signals the server this test started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let stopped_at = Instant::now();
    let out = run.wait(Duration::from_secs(30));
    let took = stopped_at.elapsed();
    unsafe { libc::kill(pid, libc::SIGCONT) };
    let report = out.describe(&[]);
    assert!(!out.timed_out, "the program still waits 30 s after the server stopped\n{report}");
    assert_eq!(out.code(), Some(2), "expected exit 2: a CUDA call returned an error\n{report}");
    assert!(out.stdout.contains("cudaErrorDevicesUnavailable") || out.stdout.contains("error after"), "{report}");
    eprintln!("stopped server: the program's call failed {took:?} after SIGSTOP (bound 2 s + 2 s)");
    assert!(took < Duration::from_secs(7), "took {took:?}, bound 4 s\n{report}");
}
