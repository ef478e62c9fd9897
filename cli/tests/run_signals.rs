//! `rgpu run` passes SIGINT, SIGTERM and SIGHUP on to its program, and a
//! killed `rgpu run` (SIGKILL: nothing of it runs) takes its program with
//! it. The program is a shell script: no CUDA is needed for either.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The program itself, killed when the test ends (should rgpu run have
/// left it behind, it must not outlive the test).
struct Program(i32);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: a pid this test's child started.
        unsafe { libc::kill(self.0, libc::SIGKILL) };
    }
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rgpu-run-signals-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `rgpu run` of `script` (sh), against a server address nothing needs.
fn rgpu_run(script: &str) -> Proc {
    let child = Command::new(env!("CARGO_BIN_EXE_rgpu"))
        .args(["run", "--server", "127.0.0.1:9", "--", "sh", "-c", script])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    Proc(child)
}

fn wait_for_file(p: &Path, limit: Duration) -> Option<String> {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if let Ok(s) = std::fs::read_to_string(p) {
            if s.ends_with('\n') {
                return Some(s);
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

/// Whether `pid` is gone (or a zombie nobody reaped yet: it runs no more).
fn gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

#[test]
fn signals_sent_to_rgpu_run_reach_the_program() {
    for (sig, name) in [(libc::SIGTERM, "TERM"), (libc::SIGHUP, "HUP"), (libc::SIGINT, "INT")] {
        let d = scratch(name);
        let (ready, got) = (d.join("ready"), d.join("got"));
        let script = format!(
            "trap 'echo {name} > {got}; exit 0' {name}; echo $$ > {ready}; while :; do sleep 0.05; done",
            got = got.display(),
            ready = ready.display()
        );
        let mut run = rgpu_run(&script);
        let pid = wait_for_file(&ready, Duration::from_secs(20)).expect("the program started");
        let _program = Program(pid.trim().parse().unwrap());
        // SAFETY: signals our own child.
        unsafe { libc::kill(run.0.id() as i32, sig) };
        let said = wait_for_file(&got, Duration::from_secs(5));
        assert_eq!(said.as_deref(), Some(&*format!("{name}\n")), "the program never got SIG{name}");
        let status = run.0.wait().unwrap();
        assert_eq!(status.code(), Some(0), "rgpu run exits with the program's status after SIG{name}");
    }
}

#[test]
fn killing_rgpu_run_ends_the_program() {
    let d = scratch("kill");
    let ready = d.join("ready");
    let script = format!("echo $$ > {}; exec sleep 60", ready.display());
    let mut run = rgpu_run(&script);
    let pid: i32 = wait_for_file(&ready, Duration::from_secs(20)).expect("the program started").trim().parse().unwrap();
    let _program = Program(pid);
    assert!(!gone(pid));
    run.0.kill().unwrap(); // SIGKILL: rgpu run can do nothing about it
    run.0.wait().unwrap();
    let t0 = Instant::now();
    while !gone(pid) {
        assert!(t0.elapsed() < Duration::from_secs(2), "the program (pid {pid}) still runs after rgpu run was killed");
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!("program gone {:?} after rgpu run was killed", t0.elapsed());
}
