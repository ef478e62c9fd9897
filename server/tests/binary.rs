//! The `rgpu-server` binary: start-up line, configuration, signals.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_rgpu-server");

/// A running server process, killed if a test fails before it exits.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

impl std::ops::Deref for Proc {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Proc {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

/// Starts the server and waits (bounded) for its `listening on` line;
/// returns the process, the address, and a channel with the rest of stderr.
fn start(args: &[&str], envs: &[(&str, &str)]) -> (Proc, String, mpsc::Receiver<String>) {
    let mut cmd = Command::new(BIN);
    // Plaintext, explicitly: these tests are about the binary, not TLS.
    cmd.args(args).stdout(Stdio::null()).stderr(Stdio::piped()).env_remove("RGPU_LOG").env("RGPU_SERVER_PLAINTEXT", "1");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = Proc(cmd.spawn().expect("spawn rgpu-server"));
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                if let Some(rest) = line.split("listening on ").nth(1) {
                    let addr = rest.split_whitespace().next().unwrap().to_string();
                    return (child, addr, rx);
                }
            }
            Err(_) => panic!("no `listening on` line within 20 s"),
        }
    }
}

fn wait_exit(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if Instant::now() > deadline {
            panic!("rgpu-server did not exit within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: sending a signal to our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
}

#[test]
fn serves_and_exits_cleanly_on_sigterm() {
    let (mut child, addr, _rx) =
        start(&["--listen", "127.0.0.1:0", "--sim-memory", "64MiB", "--sim-devices", "2"], &[]);
    assert!(!addr.ends_with(":0"), "real port in {addr}");
    let h = common::control(&addr);
    assert_eq!(h.backend, "sim");
    assert_eq!(h.devices.len(), 2);
    assert_eq!(h.devices[0].total_mem, 64 << 20);
    let mut c = common::DataClient::attach(&addr, h.session_id, &h.key).unwrap();
    let p = c.alloc_ok(100);
    assert_eq!(c.htod(p, &[4u8; 100]).result, 0);
    signal(&child, libc::SIGTERM);
    let st = wait_exit(&mut child, Duration::from_secs(10));
    assert!(st.success(), "exit status {st:?}");
}

#[test]
fn sigint_also_stops_it() {
    let (mut child, _addr, _rx) = start(&["--listen", "127.0.0.1:0", "--sim-memory", "16MiB"], &[]);
    signal(&child, libc::SIGINT);
    assert!(wait_exit(&mut child, Duration::from_secs(10)).success());
}

#[test]
fn flags_beat_env_beat_file() {
    let dir = std::env::temp_dir().join(format!("rgpu-bin-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("server.toml");
    std::fs::write(
        &file,
        "listen = \"127.0.0.1:0\"\nsim-devices = 3\nsim-memory = \"32MiB\"\nsim-compute-capability = \"8.0\"\n",
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let (mut child, addr, _rx) = start(
        &["--config", f, "--sim-devices", "2"],
        &[("RGPU_SERVER_SIM_DEVICES", "4"), ("RGPU_SERVER_SIM_MEMORY", "48MiB")],
    );
    let h = common::control(&addr);
    assert_eq!(h.devices.len(), 2, "flag wins over env and file");
    assert_eq!(h.devices[0].total_mem, 48 << 20, "env wins over file");
    assert!(h.devices[0].name.contains("8.0"), "file wins over default: {}", h.devices[0].name);
    signal(&child, libc::SIGTERM);
    assert!(wait_exit(&mut child, Duration::from_secs(10)).success());
    let _ = std::fs::remove_dir_all(dir);
}

/// A folder whose `libcuda.so*` are the C library: a driver library that
/// loads but has none of the driver's functions, whatever the host has
/// (LD_LIBRARY_PATH comes before the loader's cache).
fn fake_driver_dir(tag: &str) -> std::path::PathBuf {
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    assert!(unsafe { libc::dladdr(libc::malloc as *const libc::c_void, &mut info) } != 0);
    let libc_path = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) }.to_str().unwrap().to_string();
    let dir = std::env::temp_dir().join(format!("rgpu-fake-driver-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["libcuda.so", "libcuda.so.1", "libcuda.so.12"] {
        std::os::unix::fs::symlink(&libc_path, dir.join(name)).unwrap();
    }
    dir
}

#[test]
fn cuda_backend_without_a_driver_is_refused_with_a_clear_message() {
    let dir = fake_driver_dir("cuda");
    let out = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0", "--backend", "cuda", "--plaintext"])
        .env("LD_LIBRARY_PATH", &dir)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot start the cuda backend"), "{err}");
    assert!(err.contains("lacks cuInit"), "names what is missing: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn auto_backend_without_a_driver_falls_back_to_sim() {
    let dir = fake_driver_dir("auto");
    let d = dir.to_str().unwrap().to_string();
    let (mut child, addr, _rx) = start(
        &["--listen", "127.0.0.1:0", "--backend", "auto", "--sim-memory", "64MiB"],
        &[("LD_LIBRARY_PATH", d.as_str())],
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(common::control(&addr).backend, "sim");
    signal(&child, libc::SIGTERM);
    assert!(wait_exit(&mut child, Duration::from_secs(10)).success());
}

/// Neither a certificate nor --plaintext: the server does not start, and
/// says what to give it.
#[test]
fn without_a_certificate_or_plaintext_the_server_does_not_start() {
    let out = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0", "--backend", "sim"])
        .env_remove("RGPU_SERVER_PLAINTEXT")
        .env_remove("RGPU_SERVER_TLS_CERT")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--tls-cert") && err.contains("--plaintext"), "{err}");
}

#[test]
fn bad_sizes_are_refused() {
    let out = Command::new(BIN).args(["--sim-memory", "12parsecs"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid size"));
}
