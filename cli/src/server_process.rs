//! A child rgpu-server on a loopback port, for `demo` and `bench`.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{bail, Context, Result};

pub struct ServerProcess {
    child: Child,
    pub addr: String,
    /// The backend the server says it chose ("sim", "cuda").
    pub backend: String,
}

impl ServerProcess {
    /// Starts `rgpu-server --listen 127.0.0.1:0 --backend <backend>` and
    /// waits for it to say where it listens.
    pub fn start(backend: &str) -> Result<Self> {
        let bin = crate::paths::server_binary()?;
        let mut child = Command::new(&bin)
            .args(["--listen", "127.0.0.1:0", "--backend", backend])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {}", bin.display()))?;
        let stderr = child.stderr.take().context("no stderr pipe")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if !sent {
                    if let Some(rest) = line.split("listening on ").nth(1) {
                        let addr = rest.split_whitespace().next().unwrap_or("").to_string();
                        // "... (backend sim, 1 device)"
                        let backend = rest
                            .split("(backend ")
                            .nth(1)
                            .and_then(|b| b.split([',', ')']).next())
                            .unwrap_or("?")
                            .to_string();
                        let _ = tx.send((addr, backend));
                        sent = true;
                        continue;
                    }
                }
                // Keep draining so the server never blocks on a full pipe;
                // show what it says when asked to.
                if std::env::var_os("RGPU_DEMO_SERVER_LOG").is_some() {
                    eprintln!("[rgpu-server] {line}");
                }
            }
        });
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok((addr, backend)) if !addr.is_empty() => Ok(ServerProcess { child, addr, backend }),
            _ => {
                let _ = child.kill();
                bail!("rgpu-server did not report a listening address within 20 s")
            }
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
