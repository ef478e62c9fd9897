//! `rgpu fault inject|clear --server ADDR --device N [--kind KIND] --key-file FILE`

use std::time::Duration;

use anyhow::Result;

/// Inject a device fault into a sim GPU server, or clear it.
///
/// The server reports the device unhealthy to its broker (as a real GPU with an
/// uncorrectable ECC error or an Xid), which places no new lease on it and
/// moves the leases on it to other servers (docs/migration.md "Evacuation
/// of unhealthy devices"). Cleared, the device is placeable again. Needs
/// the server's admin key; a cuda server refuses (it reports what its
/// GPUs report).
#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(clap::Subcommand)]
enum What {
    /// Mark the device failing.
    Inject {
        #[command(flatten)]
        device: Device,
        /// `ecc` (an uncorrectable ECC error) or `xid:N` (Xid error N).
        #[arg(long, default_value = "ecc")]
        kind: String,
    },
    /// Clear the device's fault: healthy again.
    Clear {
        #[command(flatten)]
        device: Device,
    },
}

#[derive(clap::Args)]
struct Device {
    /// The GPU server (host:port).
    #[arg(long)]
    server: String,
    /// The device's ordinal on that server.
    #[arg(long, default_value_t = 0)]
    device: u32,
    #[command(flatten)]
    operator: crate::operator::OperatorArgs,
}

pub fn exec(a: Args) -> Result<i32> {
    let (d, kind) = match &a.what {
        What::Inject { device, kind } => (device, Some(kind.as_str())),
        What::Clear { device } => (device, None),
    };
    let (key, security) = d.operator.open()?;
    let h = rgpu_control_client::operator::set_fault(&d.server, &security, &key, d.device, kind, Duration::from_secs(30))?;
    if h.healthy {
        println!("{} device {}: healthy", d.server, d.device);
    } else {
        println!("{} device {}: unhealthy: {}", d.server, d.device, h.reason);
    }
    Ok(0)
}
