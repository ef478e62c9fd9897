//! A broker and the `rgpu` command for the end-to-end tests of the pool
//! (drain.rs, evacuation.rs, bound_tokens.rs): a throwaway directory, the broker as a child
//! process (plaintext, a 200 ms heartbeat, fresh keys), `rgpu` against it
//! with the admin key, and waiting with a bound.

// Each test file uses its part of this.
#![allow(dead_code)]

use rgpu_integration::binaries;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub struct Dir(pub PathBuf);

impl Dir {
    /// An empty scratch directory for one test, `rgpu-NAME-PID` under the
    /// system's temporary directory, removed when dropped.
    pub fn scratch(name: &str) -> Dir {
        let dir = std::env::temp_dir().join(format!("rgpu-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Dir(dir)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub struct Broker {
    child: Child,
    pub addr: String,
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn broker(dir: &Path) -> Broker {
    broker_with(dir, &[])
}

/// [`broker`] with more flags.
pub fn broker_with(dir: &Path, extra: &[&str]) -> Broker {
    let bin = binaries().dir.join("rgpu-broker");
    assert!(bin.exists(), "{} is not built: cargo build --release -p rgpu-pool-broker", bin.display());
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let mut child = Command::new(&bin)
        .args(["--listen", &port, "--create-key", "--heartbeat-ms", "200"])
        .args(extra)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--key-file")
        .arg(dir.join("key"))
        .arg("--admin-key-file")
        .arg(dir.join("admin.key"))
        .env("RGPU_BROKER_PLAINTEXT", "1")
        .env("RGPU_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting rgpu-broker");
    let err = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if line.contains("listening on") {
                let _ = tx.send(());
            }
            if std::env::var_os("RGPU_TEST_LOG").is_some() {
                eprintln!("[broker] {line}");
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(20)).expect("rgpu-broker did not start listening");
    Broker { child, addr: port }
}

/// `rgpu ARGS --broker B --admin-key-file K --plaintext`: (success, stdout, stderr).
pub fn rgpu(args: &[&str], b: &Broker, dir: &Path) -> (bool, String, String) {
    let out = Command::new(&binaries().rgpu)
        .args(args)
        .args(["--broker", &b.addr, "--plaintext", "--admin-key-file"])
        .arg(dir.join("admin.key"))
        .env("NO_COLOR", "1")
        .env_remove("RGPU_TLS_CA")
        .stdin(Stdio::null())
        .output()
        .expect("running rgpu");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

pub fn json(args: &[&str], b: &Broker, dir: &Path) -> serde_json::Value {
    let mut a = args.to_vec();
    a.push("--json");
    let (ok, out, err) = rgpu(&a, b, dir);
    assert!(ok, "rgpu {args:?}: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("rgpu {args:?} --json: {e}: {out}"))
}

pub fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub fn servers_up(b: &Broker, dir: &Path) -> Vec<String> {
    let v = json(&["servers"], b, dir);
    v.as_array().unwrap().iter().filter(|s| s["state"] == "up").map(|s| s["id"].as_str().unwrap().to_string()).collect()
}
