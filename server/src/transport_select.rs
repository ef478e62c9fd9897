//! Which transport the data plane uses (`--transport tcp|rdma|auto`).
//!
//! Decided once at start-up ([`DataPlane::new`], from [`crate::config::TransportConfig`]):
//! `rdma` fails the start if the verbs plugin or a device is missing; `auto` (the default) loads the plugin if
//! it can and otherwise serves over TCP, saying so once in the log. Each
//! data connection whose client asked for RDMA (its preamble) is then
//! upgraded or, when this server cannot, refused back to TCP on the same
//! socket ([`upgrade`]). See `docs/rdma.md`.
//!
//! The choice is a value, [`DataPlane`], built once from the configuration
//! and owned by the server's [`crate::service::Service`]: the session threads
//! upgrade through it and the broker agent reports what it offers.

use std::time::Duration;

use rgpu_transport::rdma::RdmaConfig;
use rgpu_transport::select::{DataTransport, Mode, Selector};
use rgpu_transport::tcp::{TcpTransport, DEFAULT_SPIN};

use crate::config::TransportConfig;

/// How this server carries data connections.
pub struct DataPlane {
    selector: Selector,
    tcp_spin: Duration,
}

impl DataPlane {
    /// The data plane `cfg` asks for (`--transport`, the RDMA knobs,
    /// `--spin-us`); `rdma` fails if the verbs plugin or a device is missing.
    pub fn new(cfg: &TransportConfig) -> anyhow::Result<DataPlane> {
        Ok(DataPlane { selector: Selector::new(cfg.mode, cfg.rdma)?, tcp_spin: cfg.tcp_spin })
    }

    /// TCP only, polling [`DEFAULT_SPIN`]: clients asking for RDMA are
    /// answered over TCP. What a server built as a library (tests) gets
    /// unless it is given another.
    pub fn tcp_only() -> DataPlane {
        DataPlane { selector: Selector::with_provider(Mode::Tcp, None, RdmaConfig::default()), tcp_spin: DEFAULT_SPIN }
    }

    /// How long a read on a TCP data connection polls before it sleeps.
    pub fn tcp_spin(&self) -> Duration {
        self.tcp_spin
    }

    /// The data-plane transports this server offers, as registered with the
    /// broker: "tcp" always, "rdma" when it can upgrade connections.
    pub fn offered(&self) -> Vec<&'static str> {
        let mut v = vec!["tcp"];
        if self.selector.wants_rdma() {
            v.push("rdma");
        }
        v
    }

    /// Runs on the session's thread after the attach: answers an RDMA request
    /// (`asked`) and returns the data plane's transport, or None if the
    /// connection failed during the set-up. `pkey`: the InfiniBand partition
    /// the session's lease names; a client in another partition (or none) is
    /// refused RDMA and served over TCP, a warning in the log saying why.
    pub fn upgrade(&self, mut t: TcpTransport, asked: bool, pkey: Option<u16>) -> Option<DataTransport> {
        let peer = rgpu_transport::Transport::peer(&t).to_string();
        t.set_spin(self.tcp_spin);
        match self.selector.server_upgrade_in(t, asked, pkey) {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!(%peer, "data connection lost during RDMA set-up: {e}");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn without_rdma_only_tcp_is_offered() {
        assert_eq!(super::DataPlane::tcp_only().offered(), vec!["tcp"]);
    }
}
