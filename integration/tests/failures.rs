//! Failure handling: a server killed while a program uses it, a server that
//! is not there, and `rgpu run` passing on the program's exit status.

use rgpu_integration::*;
use std::net::TcpListener;
use std::time::{Duration, Instant};

/// The program loops copying; once it says "looping" the server is killed
/// (SIGKILL). The next CUDA call must return an error (rt_killed then exits
/// with status 2) within 30 s.
fn killed_mid_run(variant: Variant) {
    let exe = build("rt_killed", variant);
    let mut server = Server::start_default();
    let run = spawn_rgpu(&server.addr_string(), &exe, &["--max-seconds", "120"]);
    if !run.wait_for_line("looping", run_timeout()) {
        let out = run.wait(Duration::from_secs(5));
        panic!("rt_killed never printed 'looping'\n{}", out.describe(&[&server]));
    }
    std::thread::sleep(Duration::from_millis(300)); // let a few copies go through
    let server_log = server.describe();
    server.kill();
    let killed_at = Instant::now();
    let out = run.wait(Duration::from_secs(45));
    let after_kill = killed_at.elapsed();
    let report = format!("{}{server_log}", out.describe(&[]));
    assert!(!out.timed_out, "program still running 45 s after the server was killed (hang)\n{report}");
    assert!(
        after_kill < Duration::from_secs(30),
        "program took {after_kill:?} after the server was killed to exit (limit 30 s)\n{report}"
    );
    assert_eq!(
        out.code(),
        Some(2),
        "expected exit status 2 (a CUDA call returned an error); 1 = a check failed, \
         3 = no error seen, 4 = wrong data, other = the process was ended by something else\n{report}"
    );
    assert!(out.stdout.contains("error after"), "no error line\n{report}");
}

mod killed_server {
    use super::*;
    #[test]
    fn cudart13_shared() {
        killed_mid_run(Variant::Cudart13Shared)
    }
    #[test]
    fn cudart13_static() {
        killed_mid_run(Variant::Cudart13Static)
    }
    #[test]
    fn cudart12_shared() {
        killed_mid_run(Variant::Cudart12Shared)
    }
}

/// No server listens on the address: the first call fails, the program exits
/// non-zero promptly, and stderr names the address.
#[test]
fn unreachable_server() {
    let exe = build("rt_device", Variant::Cudart13Shared);
    let addr = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    }; // closed again: connections are refused
    let out = spawn_rgpu(&addr.to_string(), &exe, &[]).wait(run_timeout());
    assert!(!out.timed_out, "program hung with an unreachable server\n{}", out.describe(&[]));
    assert!(
        !out.status.map(|s| s.success()).unwrap_or(false),
        "program succeeded with no server\n{}",
        out.describe(&[])
    );
    assert!(
        out.stderr.contains(&addr.to_string()),
        "stderr does not mention the server address {addr}\n{}",
        out.describe(&[])
    );
}

/// `rgpu run` exits with the program's status.
#[test]
fn exit_status_is_the_programs() {
    let server = Server::start_default();
    for code in [0, 1, 7, 42] {
        let out = spawn_rgpu(&server.addr_string(), std::path::Path::new("/bin/sh"), &["-c", &format!("exit {code}")])
            .wait(run_timeout());
        assert_eq!(out.code(), Some(code), "exit {code}\n{}", out.describe(&[&server]));
    }
}
