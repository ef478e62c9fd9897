//! A pool broker for end-to-end tests: `rgpu-broker` started in a scratch
//! folder (its token key and admin key there, plaintext, heartbeats every
//! 200 ms), and `rgpu` subcommands run against it as the operator.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::binaries;

/// A scratch folder, removed when dropped.
pub struct Dir(pub PathBuf);

impl Dir {
    pub fn new(name: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("rgpu-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running `rgpu-broker`, killed when dropped.
pub struct Broker {
    child: Child,
    pub addr: String,
    dir: PathBuf,
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Broker {
    /// Starts one with its data and keys in `dir` (`key`, `admin.key`).
    pub fn start(dir: &Path) -> Broker {
        let bin = binaries().dir.join("rgpu-broker");
        assert!(bin.exists(), "{} is not built: cargo build --release -p rgpu-pool-broker", bin.display());
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
        let mut child = Command::new(&bin)
            .args(["--listen", &port, "--create-key", "--heartbeat-ms", "200", "--data-dir"])
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
        Broker { child, addr: port, dir: dir.to_path_buf() }
    }

    /// The token key file GPU servers register with (`--broker-key-file`).
    pub fn key_file(&self) -> PathBuf {
        self.dir.join("key")
    }

    /// The admin key file the operator (and servers' migrations) use.
    pub fn admin_key_file(&self) -> PathBuf {
        self.dir.join("admin.key")
    }

    /// `rgpu ARGS --broker B --admin-key-file K --plaintext`: (success,
    /// stdout, stderr).
    pub fn rgpu(&self, args: &[&str]) -> (bool, String, String) {
        let out = Command::new(&binaries().rgpu)
            .args(args)
            .args(["--broker", &self.addr, "--plaintext", "--admin-key-file"])
            .arg(self.admin_key_file())
            .env("NO_COLOR", "1")
            .env_remove("RGPU_TLS_CA")
            .stdin(Stdio::null())
            .output()
            .expect("running rgpu");
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.success(), text(&out.stdout), text(&out.stderr))
    }
}

/// Polls `f` every 100 ms until it holds, failing the test past `limit`.
pub fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}
