//! Which transport the data plane uses (`--transport tcp|rdma|auto`).
//!
//! Decided once at start-up ([`init`], from [`crate::config::TransportConfig`]):
//! `rdma` fails the start if the verbs plugin or a device is missing; `auto` (the default) loads the plugin if
//! it can and otherwise serves over TCP, saying so once in the log. Each
//! data connection whose client asked for RDMA (its preamble) is then
//! upgraded or, when this server cannot, refused back to TCP on the same
//! socket ([`upgrade`]). See `docs/rdma.md`.
//!
//! The choice is process-wide, not per [`crate::config::Config`]: the verbs
//! plugin is loaded once, and the broker agent reports what is offered.

use std::sync::OnceLock;
use std::time::Duration;

use rgpu_transport::rdma::RdmaConfig;
use rgpu_transport::select::{DataTransport, Mode, Selector};
use rgpu_transport::tcp::{TcpTransport, DEFAULT_SPIN};

use crate::config::TransportConfig;

struct DataPlane {
    selector: Selector,
    tcp_spin: Duration,
}

static DATA_PLANE: OnceLock<DataPlane> = OnceLock::new();

/// Decides the transport for this process from `cfg` (`--transport`, the
/// RDMA knobs, `--spin-us`). Without a call (the library in tests), clients
/// asking for RDMA are answered over TCP, which polls [`DEFAULT_SPIN`].
pub fn init(cfg: &TransportConfig) -> anyhow::Result<()> {
    let selector = Selector::new(cfg.mode, cfg.rdma)?;
    let _ = DATA_PLANE.set(DataPlane { selector, tcp_spin: cfg.tcp_spin });
    Ok(())
}

fn data_plane() -> &'static DataPlane {
    DATA_PLANE.get_or_init(|| DataPlane {
        selector: Selector::with_provider(Mode::Tcp, None, RdmaConfig::default()),
        tcp_spin: DEFAULT_SPIN,
    })
}

/// The data-plane transports this server offers, as registered with the
/// broker: "tcp" always, "rdma" when it can upgrade connections.
pub fn offered() -> Vec<&'static str> {
    let mut v = vec!["tcp"];
    if data_plane().selector.wants_rdma() {
        v.push("rdma");
    }
    v
}

/// Runs on the session's thread after the attach: answers an RDMA request
/// (`asked`) and returns the data plane's transport, or None if the
/// connection failed during the set-up. `pkey`: the InfiniBand partition
/// the session's lease names; a client in another partition (or none) is
/// refused RDMA and served over TCP, a warning in the log saying why.
pub fn upgrade(mut t: TcpTransport, asked: bool, pkey: Option<u16>) -> Option<DataTransport> {
    let peer = rgpu_transport::Transport::peer(&t).to_string();
    let plane = data_plane();
    t.set_spin(plane.tcp_spin);
    match plane.selector.server_upgrade_in(t, asked, pkey) {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!(%peer, "data connection lost during RDMA set-up: {e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn without_rdma_only_tcp_is_offered() {
        // No `init` in unit tests: the TCP-only selector.
        assert_eq!(super::offered(), vec!["tcp"]);
    }
}
