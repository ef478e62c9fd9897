//! What the tests of real processes on loopback share: starting the
//! built binaries, free ports, bounded waits, credentials.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rgpu_broker_client::{BrokerClient, Credential, Role};

pub fn bin_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_rgpu-broker")).parent().unwrap().to_path_buf()
}

pub struct Proc {
    pub child: Child,
    pub addr: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `bin args` and waits for its "listening on ADDR" line.
pub fn start(bin: &str, args: &[&str]) -> Proc {
    let path = bin_dir().join(bin);
    assert!(path.exists(), "{} is not built: run `cargo build` first", path.display());
    let mut child = Command::new(&path)
        .args(args)
        .env("RGPU_LOG", "info")
        // Plaintext, said explicitly, unless the arguments name a
        // certificate (the TLS tests, tls.rs).
        .env(if bin == "rgpu-broker" { "RGPU_BROKER_PLAINTEXT" } else { "RGPU_SERVER_PLAINTEXT" },
            if args.contains(&"--tls-cert") { "0" } else { "1" })
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    let name = bin.to_string();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if !sent {
                if let Some(rest) = line.split("listening on ").nth(1) {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
                    sent = true;
                }
            }
            if std::env::var_os("RGPU_TEST_LOG").is_some() {
                eprintln!("[{name}] {line}");
            }
        }
    });
    let addr = rx.recv_timeout(Duration::from_secs(20)).expect("process did not start listening");
    Proc { child, addr }
}

pub fn free_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// A credential for `tenant` as `role`, issued with the key file `name` in `dir`.
pub fn credential(dir: &Path, name: &str, tenant: &str, role: Role) -> Credential {
    let key = rgpu_protocol::token::parse_key(&std::fs::read(dir.join(name)).unwrap()).unwrap();
    Credential::issue(&key, tenant, role, rgpu_pool_broker::service::now_ms()).unwrap()
}

/// A client logged in as `tenant` with a credential from the broker's admin key.
pub fn login(addr: &str, dir: &Path, tenant: &str, role: Role) -> BrokerClient {
    BrokerClient::connect(addr, &credential(dir, "admin.key", tenant, role), &rgpu_tls::ClientSecurity::Plaintext).unwrap()
}

pub fn wait_for(what: &str, f: impl FnMut() -> bool) {
    wait_for_within(what, Duration::from_secs(15), f)
}

/// As [`wait_for`], with its own bound.
pub fn wait_for_within(what: &str, bound: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < bound, "timed out waiting for {what} ({bound:?})");
        std::thread::sleep(Duration::from_millis(50));
    }
}

