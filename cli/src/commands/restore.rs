//! `rgpu restore NAME --server ADDR [--load FILE] --key-file FILE`

use std::time::Duration;

use anyhow::{bail, Result};


/// Rebuild a session from a snapshot in the server's --checkpoint-dir; its
/// program resumes it by itself (docs/migration.md).
#[derive(clap::Args)]
pub struct Args {
    /// The snapshot's name in the server's --checkpoint-dir.
    name: String,
    /// The server to rebuild it on (host:port): the address its program
    /// reconnects to, the one the session was served at.
    #[arg(long)]
    server: String,
    /// The server the session was checkpointed on, when that is not
    /// --server: once restored, the session is forwarded from there, and
    /// its program's next resume there is redirected here.
    #[arg(long, value_name = "ADDR")]
    forward_from: Option<String>,
    /// First copy the snapshot from FILE (one `rgpu checkpoint --save`
    /// wrote) onto the server as NAME: a checkpoint restored on a server
    /// other than the one that wrote it, or after that server's disk is gone.
    #[arg(long, value_name = "FILE")]
    load: Option<std::path::PathBuf>,
    /// Copy with --load in control-plane calls, one piece each, as servers
    /// before the one-stream copy took it (slower; chosen by itself for
    /// such a server).
    #[arg(long, requires = "load")]
    copy_in_calls: bool,
    /// How long the whole call may take, in seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    #[command(flatten)]
    operator: crate::operator::OperatorArgs,
}

pub fn exec(a: Args) -> Result<i32> {
    if !rgpu_protocol::auth::valid_snapshot_name(&a.name) {
        bail!("{:?}: a snapshot name is 1-128 of A-Za-z0-9._- not starting with a dot", a.name);
    }
    let (key, security) = a.operator.open()?;
    if let Some(file) = &a.load {
        use anyhow::Context as _;
        let started = std::time::Instant::now();
        let mut f = std::fs::File::open(file).with_context(|| format!("cannot open {}", file.display()))?;
        let size = f.metadata().with_context(|| format!("cannot read {}", file.display()))?.len();
        let write = if a.copy_in_calls {
            rgpu_control_client::operator::write_snapshot_in_calls
        } else {
            rgpu_control_client::operator::write_snapshot
        };
        write(&a.server, &security, &key, &a.name, &mut f, size, Duration::from_secs(a.timeout))?;
        let secs = started.elapsed().as_secs_f64();
        eprintln!(
            "Copied {} onto {} as {}: {size} bytes in {secs:.3} s, {:.0} MiB/s",
            file.display(),
            a.server,
            a.name,
            size as f64 / (1 << 20) as f64 / secs.max(1e-9)
        );
    }
    let r = rgpu_control_client::operator::restore(&a.server, &security, &key, &a.name, Duration::from_secs(a.timeout))?;
    let secs = r.took.as_secs_f64();
    eprintln!(
        "Restored session {:#x} on {} from {}: {} bytes ({} of device memory) in {:.3} s, {:.0} MiB/s; waiting for its program to resume",
        r.session,
        a.server,
        a.name,
        r.bytes,
        r.memory_bytes,
        secs,
        r.bytes as f64 / (1 << 20) as f64 / secs.max(1e-9)
    );
    if let Some(from) = a.forward_from.as_deref().filter(|f| *f != a.server) {
        let limit = Duration::from_secs(a.timeout);
        if let Err(e) = rgpu_control_client::operator::forward(from, &security, &key, r.session, &a.server, limit) {
            bail!(
                "the session is restored on {}, but {from} did not forward it: {e}
                   its program keeps trying {from} until its RGPU_RECONNECT_TIMEOUT; retry with                  `rgpu restore` of a new checkpoint, or restart its program",
                a.server
            );
        }
        eprintln!("Session {:#x} forwarded from {from}: its program's next resume there is sent here", r.session);
    }
    Ok(0)
}
