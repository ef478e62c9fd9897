//! Which transport the shim's data connections use: `RGPU_TRANSPORT` =
//! `tcp`, `rdma` (fail if RDMA cannot be used) or `auto` (the default: RDMA
//! when the verbs plugin loads, finds a device and the server agrees, else
//! TCP, said once in the log). Decided once per process; see `docs/rdma.md`.

use std::io;
use std::sync::OnceLock;

use rgpu_protocol::DATA_PREAMBLE;
use rgpu_transport::rdma::RdmaConfig;
use rgpu_transport::select::{DataTransport, Mode, Selector};
use rgpu_transport::tcp::TcpTransport;

static SELECTOR: OnceLock<Result<Selector, String>> = OnceLock::new();

fn selector() -> &'static Result<Selector, String> {
    SELECTOR.get_or_init(|| {
        let mode = match std::env::var("RGPU_TRANSPORT") {
            Ok(v) => v.parse::<Mode>().map_err(|e| format!("RGPU_TRANSPORT: {e}"))?,
            Err(_) => Mode::Auto,
        };
        Selector::new(mode, RdmaConfig::default()).map_err(|e| e.to_string())
    })
}

/// The preamble a data connection opens with (asks for RDMA or not).
pub fn preamble() -> &'static [u8; 8] {
    match selector() {
        Ok(s) => s.preamble(DATA_PREAMBLE),
        Err(_) => DATA_PREAMBLE,
    }
}

/// After the attach: RDMA set-up if asked for, else the TCP connection.
pub fn upgrade(t: TcpTransport) -> io::Result<DataTransport> {
    match selector() {
        Ok(s) => s.client_upgrade(t).map_err(io::Error::from),
        Err(why) => Err(io::Error::other(why.clone())),
    }
}
