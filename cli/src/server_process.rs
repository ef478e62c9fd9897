//! Child processes on loopback ports, for `demo` and `bench`: an
//! rgpu-server, and for the demo's pool an rgpu-broker with a temporary
//! data folder and fresh keys (all removed when it is dropped).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::tls::Pki;

pub struct ServerProcess {
    child: Child,
    pub addr: String,
    /// The backend the server says it chose ("sim", "cuda").
    pub backend: String,
}

/// Starts `bin args` and waits (20 s at most) for its "listening on ADDR
/// ..." line; returns the child, ADDR and the rest of that line. The
/// child's stderr is read to the end (shown when `log_env` is set).
fn spawn_listening(bin: &Path, args: &[&str], log_env: &'static str) -> Result<(Child, String, String)> {
    let mut child = Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {}", bin.display()))?;
    let stderr = child.stderr.take().context("no stderr pipe")?;
    let (tx, rx) = mpsc::channel();
    let name = bin.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if !sent {
                if let Some(rest) = line.split("listening on ").nth(1) {
                    let mut parts = rest.splitn(2, char::is_whitespace);
                    let addr = parts.next().unwrap_or("").to_string();
                    let _ = tx.send((addr, parts.next().unwrap_or("").to_string()));
                    sent = true;
                    continue;
                }
            }
            // Keep draining so the child never blocks on a full pipe; show
            // what it says when asked to.
            if std::env::var_os(log_env).is_some() {
                eprintln!("[{name}] {line}");
            }
        }
    });
    match rx.recv_timeout(Duration::from_secs(20)) {
        Ok((addr, rest)) if !addr.is_empty() => Ok((child, addr, rest)),
        _ => {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{} did not report a listening address within 20 s", bin.display())
        }
    }
}

impl ServerProcess {
    /// Starts `rgpu-server --listen 127.0.0.1:0 --backend <backend>`, under
    /// TLS with `pki`'s certificate (else `--plaintext`), and waits for it
    /// to say where it listens.
    pub fn start(backend: &str, pki: Option<&Pki>) -> Result<Self> {
        Self::start_with(backend, pki, &[])
    }

    /// As [`ServerProcess::start`], with more flags.
    pub fn start_with(backend: &str, pki: Option<&Pki>, extra: &[&str]) -> Result<Self> {
        let bin = crate::paths::server_binary()?;
        let tls = tls_args(pki, true);
        let mut args = vec!["--listen", "127.0.0.1:0", "--backend", backend];
        args.extend(tls.iter().map(String::as_str));
        args.extend_from_slice(extra);
        let (child, addr, rest) = spawn_listening(&bin, &args, "RGPU_DEMO_SERVER_LOG")?;
        // "(backend sim, 1 device)"
        let backend =
            rest.split("(backend ").nth(1).and_then(|b| b.split([',', ')']).next()).unwrap_or("?").to_string();
        Ok(ServerProcess { child, addr, backend })
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An rgpu-broker on a loopback port with its own data folder and key.
pub struct BrokerProcess {
    child: Child,
    pub addr: String,
    /// The temporary folder: `data/` and the key file.
    pub dir: PathBuf,
}

/// A daemon's TLS flags: `pki`'s certificate (and, for a server, its CA
/// to check the broker with), or `--plaintext`.
fn tls_args(pki: Option<&Pki>, server: bool) -> Vec<String> {
    match pki {
        Some(p) => {
            let mut a = p.serve_args();
            if server {
                a.extend(["--tls-ca".to_string(), p.files.ca.display().to_string()]);
            }
            a
        }
        None => vec!["--plaintext".to_string()],
    }
}

impl BrokerProcess {
    /// Under TLS with `pki`'s certificate, else `--plaintext`.
    pub fn start(pki: Option<&Pki>) -> Result<Self> {
        let bin = crate::paths::broker_binary()?;
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let dir = std::env::temp_dir().join(format!("rgpu-demo-{}-{nanos:08x}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let (data, key, admin) = (dir.join("data"), dir.join("broker.key"), dir.join("admin.key"));
        let args = [
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            data.to_str().context("temporary folder name is not UTF-8")?,
            "--key-file",
            key.to_str().context("temporary folder name is not UTF-8")?,
            "--admin-key-file",
            admin.to_str().context("temporary folder name is not UTF-8")?,
            "--create-key",
        ];
        let tls = tls_args(pki, false);
        let args: Vec<&str> = args.into_iter().chain(tls.iter().map(String::as_str)).collect();
        match spawn_listening(&bin, &args, "RGPU_DEMO_BROKER_LOG") {
            Ok((child, addr, _)) => Ok(BrokerProcess { child, addr, dir }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                Err(e)
            }
        }
    }

    /// The key file servers are started with.
    pub fn key_file(&self) -> PathBuf {
        self.dir.join("broker.key")
    }

    /// The key file credentials are issued with.
    pub fn admin_key_file(&self) -> PathBuf {
        self.dir.join("admin.key")
    }
}

impl Drop for BrokerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
