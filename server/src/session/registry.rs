//! Sessions known to the server: opened on the control plane and waiting
//! for their data connection (pending), or attached and being served
//! (active). Cold path: touched once per open, attach and close.

use std::collections::HashMap;
use std::net::{Shutdown, TcpStream};
use std::sync::Mutex;

use rgpu_protocol::SESSION_KEY_LEN;

pub type SessionKey = [u8; SESSION_KEY_LEN];

#[derive(Default)]
pub struct Registry {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    pending: HashMap<u64, Pending>,
    /// A handle on each active session's socket, to unblock its thread at shutdown.
    active: HashMap<u64, TcpStream>,
    closing: bool,
}

struct Pending {
    key: SessionKey,
    client_name: String,
}

/// Why a data connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachError {
    /// No pending session has this id, or the key is wrong.
    Unknown,
    ShuttingDown,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a new pending session with a fresh random id and key.
    pub fn open(&self, client_name: &str) -> std::io::Result<(u64, SessionKey)> {
        let mut key = [0u8; SESSION_KEY_LEN];
        getrandom::fill(&mut key).map_err(std::io::Error::other)?;
        let mut inner = self.lock();
        if inner.closing {
            return Err(std::io::Error::other("server is shutting down"));
        }
        loop {
            let mut idb = [0u8; 8];
            getrandom::fill(&mut idb).map_err(std::io::Error::other)?;
            let id = u64::from_le_bytes(idb);
            if id != 0 && !inner.pending.contains_key(&id) && !inner.active.contains_key(&id) {
                inner.pending.insert(id, Pending { key, client_name: client_name.to_string() });
                return Ok((id, key));
            }
        }
    }

    /// Drops a session still pending (its attach time ran out); `true` if it was.
    pub fn expire(&self, id: u64) -> bool {
        self.lock().pending.remove(&id).is_some()
    }

    /// Claims pending session `id` with `key`: at most one data connection
    /// per session ever gets it. Returns the client's name. `socket` is kept
    /// so that shutdown can close the connection.
    pub fn attach(&self, id: u64, key: &[u8], socket: TcpStream) -> Result<String, AttachError> {
        let mut inner = self.lock();
        if inner.closing {
            return Err(AttachError::ShuttingDown);
        }
        let ok = inner.pending.get(&id).is_some_and(|p| constant_time_eq(&p.key, key));
        if !ok {
            return Err(AttachError::Unknown);
        }
        let p = inner.pending.remove(&id).ok_or(AttachError::Unknown)?;
        inner.active.insert(id, socket);
        Ok(p.client_name)
    }

    /// Forgets an active session (its thread is ending).
    pub fn detach(&self, id: u64) {
        self.lock().active.remove(&id);
    }

    /// Closes one session (its lease ended): a pending one is dropped, an
    /// active one's connection is shut, which ends its thread. `true` if
    /// there was such a session.
    pub fn close(&self, id: u64) -> bool {
        let mut inner = self.lock();
        if inner.pending.remove(&id).is_some() {
            return true;
        }
        match inner.active.get(&id) {
            Some(s) => {
                let _ = s.shutdown(Shutdown::Both);
                true
            }
            None => false,
        }
    }

    /// Refuses new sessions and closes every active connection, which makes
    /// each session thread end and free what it held.
    pub fn close_all(&self) {
        let mut inner = self.lock();
        inner.closing = true;
        inner.pending.clear();
        for s in inner.active.values() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    pub fn counts(&self) -> (usize, usize) {
        let inner = self.lock();
        (inner.pending.len(), inner.active.len())
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
