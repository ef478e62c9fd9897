//! Which transport the shim's data connections use: `RGPU_TRANSPORT` =
//! `tcp`, `rdma` (fail if RDMA cannot be used) or `auto` (the default: RDMA
//! when the verbs plugin loads, finds a device and the server agrees, else
//! TCP, said once in the log). Decided once per process; see `docs/rdma.md`.
//! RDMA settings: `RGPU_RDMA_ZERO_COPY=1` sends bulk host-to-device data
//! zero-copy (the server RDMA-READs it from the application's buffers,
//! registered once and cached: only for buffers that stay mapped), and
//! `RGPU_RDMA_RING_SLOTS` sizes the receive ring (4..=4096, default 64).
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
        Selector::new(mode, rdma_config()?).map_err(|e| e.to_string())
    })
}

/// `RGPU_RDMA_ZERO_COPY` and `RGPU_RDMA_RING_SLOTS` over the defaults.
fn rdma_config() -> Result<RdmaConfig, String> {
    rdma_config_from(|n| std::env::var(n).ok())
}

fn rdma_config_from(env: impl Fn(&str) -> Option<String>) -> Result<RdmaConfig, String> {
    let var = |n: &str| env(n).map(|v| v.trim().to_ascii_lowercase()).filter(|v| !v.is_empty());
    let zero_copy = match var("RGPU_RDMA_ZERO_COPY").as_deref() {
        None | Some("0" | "false" | "no" | "off") => false,
        Some("1" | "true" | "yes" | "on") => true,
        Some(o) => return Err(format!("RGPU_RDMA_ZERO_COPY: {o:?} is not 0/1, true/false, yes/no or on/off")),
    };
    let slots = match var("RGPU_RDMA_RING_SLOTS") {
        None => None,
        Some(v) => Some(v.parse::<u16>().map_err(|_| format!("RGPU_RDMA_RING_SLOTS: {v:?} is not a number of slots"))?),
    };
    RdmaConfig::with_knobs(zero_copy, slots).map_err(|e| format!("RGPU_RDMA_RING_SLOTS: {e}"))
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

#[cfg(test)]
mod tests {
    use super::rdma_config_from;

    fn cfg(vars: &[(&str, &str)]) -> Result<(bool, u16), String> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        rdma_config_from(|n| vars.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone())).map(|c| (c.zero_copy, c.recv_slots))
    }

    #[test]
    fn rdma_knobs_from_the_environment() {
        assert_eq!(cfg(&[]), Ok((false, 64)));
        assert_eq!(cfg(&[("RGPU_RDMA_ZERO_COPY", "1"), ("RGPU_RDMA_RING_SLOTS", "256")]), Ok((true, 256)));
        assert_eq!(cfg(&[("RGPU_RDMA_ZERO_COPY", " Off ")]), Ok((false, 64)));
        assert!(cfg(&[("RGPU_RDMA_ZERO_COPY", "maybe")]).unwrap_err().contains("RGPU_RDMA_ZERO_COPY"));
        assert!(cfg(&[("RGPU_RDMA_RING_SLOTS", "2")]).unwrap_err().contains("4..=4096"));
        assert!(cfg(&[("RGPU_RDMA_RING_SLOTS", "lots")]).is_err());
    }
}
