//! The bounds that keep hostile clients from taking the server's
//! connection slots or memory (docs/security.md): their values, from the
//! settings, and the per-address connection count the listener keeps.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::quota::ByteQuota;

pub const DEFAULT_MAX_CONNECTIONS_PER_ADDRESS: usize = 64;
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_CONTROL_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
pub const DEFAULT_MAX_MODULE_IMAGE: u64 = 256 << 20;
pub const DEFAULT_MAX_MODULE_BYTES_PER_LEASE: u64 = 1 << 30;
pub const DEFAULT_MAX_BUFFERED_INPUT: u64 = 1 << 30;
pub const DEFAULT_RECONNECT_GRACE: Duration = Duration::from_secs(30);
pub const DEFAULT_CLIENT_TIMEOUT: Duration = Duration::from_secs(60);

/// Sessions one control connection may open (the shim opens one).
pub const MAX_SESSIONS_PER_CONTROL_CONNECTION: u32 = 16;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Connections (both planes, sessions included) from one IP address.
    pub max_connections_per_address: usize,
    /// From accept to the preamble and, on the data plane, the session's
    /// credentials; on the control plane, to the client's `hello`.
    pub handshake_timeout: Duration,
    /// A control connection with no call for this long is closed.
    pub control_idle_timeout: Duration,
    /// Largest module image one load may send.
    pub max_module_image: u64,
    /// Module image bytes a lease's sessions (or one session without a
    /// lease) keep loaded on this server at once.
    pub max_module_bytes_per_lease: u64,
    /// Input the server buffers at once, all connections together: message
    /// bodies above [`SMALL_MESSAGE`] and module images being read.
    pub max_buffered_input: u64,
    /// How long a session whose data connection broke (without the
    /// client's orderly close) keeps its device state and work, waiting
    /// for the client to resume; zero ends it at once.
    pub reconnect_grace: Duration,
    /// A data connection on which the client sends nothing for this long
    /// (the shim pings every 10 s when idle) or that takes nothing the
    /// server sends for this long counts as broken (then the grace runs).
    pub client_timeout: Duration,
}

/// Messages up to this size are read into the connection's own buffer
/// without asking the server-wide input budget.
pub const SMALL_MESSAGE: usize = 64 << 10;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections_per_address: DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            control_idle_timeout: DEFAULT_CONTROL_IDLE_TIMEOUT,
            max_module_image: DEFAULT_MAX_MODULE_IMAGE,
            max_module_bytes_per_lease: DEFAULT_MAX_MODULE_BYTES_PER_LEASE,
            max_buffered_input: DEFAULT_MAX_BUFFERED_INPUT,
            reconnect_grace: DEFAULT_RECONNECT_GRACE,
            client_timeout: DEFAULT_CLIENT_TIMEOUT,
        }
    }
}

/// What one session may make the server buffer and keep.
#[derive(Debug, Clone)]
pub struct SessionInput {
    /// The server's budget for buffered input, shared by every connection.
    pub buffered: Arc<ByteQuota>,
    /// Module image bytes the session's lease (or the session alone) keeps loaded.
    pub modules: Arc<ByteQuota>,
    pub max_module_image: u64,
}

impl Default for SessionInput {
    fn default() -> Self {
        SessionInput {
            buffered: ByteQuota::unlimited(),
            modules: ByteQuota::unlimited(),
            max_module_image: DEFAULT_MAX_MODULE_IMAGE,
        }
    }
}

/// Open connections by source address.
#[derive(Debug)]
pub struct PerAddress {
    limit: usize,
    open: Mutex<HashMap<IpAddr, usize>>,
}

impl PerAddress {
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(PerAddress { limit: limit.max(1), open: Mutex::default() })
    }

    /// Counts a connection from `ip`, or refuses it when `ip` has its limit.
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<AddressSlot> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let n = open.entry(ip).or_insert(0);
        if *n >= self.limit {
            return None;
        }
        *n += 1;
        Some(AddressSlot { of: self.clone(), ip })
    }

    pub fn open_from(&self, ip: IpAddr) -> usize {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).get(&ip).copied().unwrap_or(0)
    }
}

/// One counted connection; dropping it uncounts it.
#[derive(Debug)]
pub struct AddressSlot {
    of: Arc<PerAddress>,
    ip: IpAddr,
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut open = self.of.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_address_cannot_take_every_slot() {
        let p = PerAddress::new(2);
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let s1 = p.admit(a).unwrap();
        let _s2 = p.admit(a).unwrap();
        assert!(p.admit(a).is_none());
        let _other = p.admit(b).expect("another address has its own count");
        drop(s1);
        assert_eq!(p.open_from(a), 1);
        assert!(p.admit(a).is_some());
    }
}
