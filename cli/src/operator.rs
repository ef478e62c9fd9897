//! What the GPU server's operator commands share (`rgpu checkpoint`,
//! `restore`, `migrate`, `sessions`): the admin key that proves them, the
//! connection's TLS, and session ids as the server prints them.

use std::path::PathBuf;

use anyhow::{Context, Result};
use rgpu_tls::ClientSecurity;

#[derive(clap::Args)]
pub struct OperatorArgs {
    /// The server's admin key file (its --admin-key-file).
    #[arg(long, env = "RGPU_ADMIN_KEY_FILE")]
    key_file: PathBuf,
    #[command(flatten)]
    tls: crate::tls::TlsArgs,
}

impl OperatorArgs {
    /// The admin key, and how to reach the server.
    pub fn open(&self) -> Result<(Vec<u8>, ClientSecurity)> {
        let bytes = std::fs::read(&self.key_file).with_context(|| format!("cannot read {}", self.key_file.display()))?;
        let key = rgpu_protocol::token::parse_key(&bytes).with_context(|| format!("key file {}", self.key_file.display()))?;
        Ok((key, self.tls.security()?))
    }
}

/// The admin key of a command that speaks to GPU servers and to the
/// broker (`rgpu migrate`, `checkpoint`, `restore`): `--key-file`, else the
/// broker's `--admin-key-file` (one key for both, as a pool is usually run).
pub fn server_key(key_file: Option<&std::path::Path>, broker: &crate::pool::BrokerArgs) -> Result<Vec<u8>> {
    let Some(f) = key_file.or(broker.admin_key_file.as_deref()) else {
        anyhow::bail!("this needs the servers' admin key: --key-file FILE (or --admin-key-file)");
    };
    crate::pool::read_key(f)
}

/// A session id as the server prints it: hex with 0x, or decimal.
pub fn parse_session(s: &str) -> Result<u64> {
    let t = s.trim();
    let v = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => t.parse(),
    };
    v.with_context(|| format!("{s:?} is not a session id (0x-prefixed hex or decimal)"))
}
