//! Which transport the shim's data connections use: `RGPU_TRANSPORT` =
//! `tcp`, `rdma` (fail if RDMA cannot be used) or `auto` (the default: RDMA
//! when the verbs plugin loads, finds a device and the server agrees, else
//! TCP, said once in the log). Decided once per process; see `docs/rdma.md`.
//!
//! A session opened with a lease token whose tenant has an InfiniBand
//! partition key sets its queue pair up in that partition ([`note_pkey`]);
//! the server must name the same one, or RDMA is refused.

use std::collections::HashMap;
use std::io;
use std::sync::{Mutex, OnceLock};

use rgpu_protocol::DATA_PREAMBLE;
use rgpu_transport::rdma::RdmaConfig;
use rgpu_transport::select::{DataTransport, Mode, Selector};
use rgpu_transport::tcp::TcpTransport;

static SELECTOR: OnceLock<Result<Selector, String>> = OnceLock::new();
/// Session id -> the P_Key its lease token names, from the control
/// connection's openSession until the data connection's set-up.
static PKEYS: Mutex<Option<HashMap<u64, u16>>> = Mutex::new(None);

/// Records the P_Key of session `session`'s lease (None: no partition).
pub fn note_pkey(session: u64, pkey: Option<u16>) {
    let mut m = PKEYS.lock().unwrap_or_else(|p| p.into_inner());
    let m = m.get_or_insert_with(HashMap::new);
    match pkey {
        Some(k) => m.insert(session, k),
        None => m.remove(&session),
    };
}

fn take_pkey(session: u64) -> Option<u16> {
    PKEYS.lock().unwrap_or_else(|p| p.into_inner()).as_mut().and_then(|m| m.remove(&session))
}

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

/// After the attach of session `session`: RDMA set-up (in its lease's
/// partition) if asked for, else the TCP connection.
pub fn upgrade(t: TcpTransport, session: u64) -> io::Result<DataTransport> {
    let pkey = take_pkey(session);
    match selector() {
        Ok(s) => s.client_upgrade_in(t, pkey).map_err(io::Error::from),
        Err(why) => Err(io::Error::other(why.clone())),
    }
}
