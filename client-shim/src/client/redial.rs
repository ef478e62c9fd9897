//! Coming back to a session on a new connection after the old one broke,
//! and the bounds on how long the shim waits for a silent server.
//!
//! The shim's knobs are environment variables:
//! - `RGPU_SERVER_TIMEOUT` (seconds, default 15): a read or a send on the
//!   data connection that waits this long counts as a broken connection.
//!   The server sends keepalives every 2 s while it runs a long request, so
//!   only a server that stopped answering (stopped, hung, cut off) is silent
//!   that long.
//! - `RGPU_RECONNECT_TIMEOUT` (seconds, default 15; 0: never reconnect) and
//!   `RGPU_RECONNECT_ATTEMPTS` (default 50): how long, and how many times,
//!   the shim tries to resume the session before the call fails with
//!   `CUDA_ERROR_DEVICE_UNAVAILABLE` (and every later call on that server).
//!
//! - `RGPU_SUSPEND_TIMEOUT` (seconds, default 86400; 0: do not wait): how
//!   long the shim waits while the server says the session's lease is
//!   suspended (preempted by a lease of higher priority, its state on the
//!   server's disk). The server answers each try, so this wait spends none
//!   of the reconnect attempts or time; they start again once it ends.
//! - `RGPU_HOLD_TIMEOUT` (seconds, default 3600; 0: do not wait): the same,
//!   while the server says it holds the session: still, for a checkpoint
//!   being written or a migration's last copy (minutes, for a session
//!   holding many GiB), or checkpointed out and waiting for its restore.
//!
//! So a server that stops answering becomes an error within
//! `RGPU_SERVER_TIMEOUT + RGPU_RECONNECT_TIMEOUT` (30 s by default).

use std::io;
use std::time::Duration;

use rgpu_protocol::{MAX_REDIRECT_LEN, PROTOCOL_VERSION, RESUME_HELD, RESUME_MOVED, RESUME_PREAMBLE, RESUME_SUSPENDED};
use rgpu_transport::select::DataTransport;
use rgpu_transport::tcp;
use rgpu_transport::Transport;

pub const DEFAULT_SERVER_TIMEOUT: Duration = Duration::from_secs(15);
pub const DEFAULT_RECONNECT_TIMEOUT: Duration = Duration::from_secs(15);
pub const DEFAULT_RECONNECT_ATTEMPTS: u32 = 50;
/// A preempting lease may run for hours; a day bounds the wait all the same.
pub const DEFAULT_SUSPEND_TIMEOUT: Duration = Duration::from_secs(86_400);
/// A checkpoint writes at the disk's rate: an hour covers a GPU's worth of
/// memory on a slow disk.
pub const DEFAULT_HOLD_TIMEOUT: Duration = Duration::from_secs(3_600);

/// How a connection comes back, and for how long it tries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    pub server_timeout: Duration,
    /// Zero: a broken connection is not resumed.
    pub reconnect_timeout: Duration,
    pub attempts: u32,
    /// How long a suspended lease is waited for; zero: not at all.
    pub suspend_timeout: Duration,
    /// How long a session held by its server (a checkpoint, a move) is
    /// waited for; zero: not at all.
    pub hold_timeout: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            server_timeout: DEFAULT_SERVER_TIMEOUT,
            reconnect_timeout: DEFAULT_RECONNECT_TIMEOUT,
            attempts: DEFAULT_RECONNECT_ATTEMPTS,
            suspend_timeout: DEFAULT_SUSPEND_TIMEOUT,
            hold_timeout: DEFAULT_HOLD_TIMEOUT,
        }
    }
}

impl Policy {
    pub fn from_env() -> Self {
        Self::from_vars(|n| std::env::var(n).ok())
    }

    fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let secs = |n: &str| {
            let v = var(n)?;
            match v.trim().parse::<f64>().ok().and_then(|s| Duration::try_from_secs_f64(s).ok()) {
                Some(d) => Some(d),
                None => {
                    tracing::warn!("{n}={v:?} is not a number of seconds; using the default");
                    None
                }
            }
        };
        let d = Policy::default();
        Policy {
            server_timeout: secs("RGPU_SERVER_TIMEOUT").filter(|d| !d.is_zero()).unwrap_or(d.server_timeout),
            reconnect_timeout: secs("RGPU_RECONNECT_TIMEOUT").unwrap_or(d.reconnect_timeout),
            attempts: var("RGPU_RECONNECT_ATTEMPTS").and_then(|v| v.trim().parse().ok()).unwrap_or(d.attempts),
            suspend_timeout: secs("RGPU_SUSPEND_TIMEOUT").unwrap_or(d.suspend_timeout),
            hold_timeout: secs("RGPU_HOLD_TIMEOUT").unwrap_or(d.hold_timeout),
        }
    }
}

/// Why a new connection did not resume the session.
#[derive(Debug)]
pub enum Redialed {
    /// The server answered: it no longer has the session (or refuses it).
    /// Trying again cannot help.
    Refused(String),
    /// No answer (refused connection, timeout, reset): worth another try.
    Failed(io::Error),
    /// The server has the session on disk: its lease is suspended. Worth
    /// trying again, for as long as the policy's `suspend_timeout`.
    Suspended,
    /// The server holds the session still (a checkpoint being written, a
    /// move's last copy). Worth trying again at once, for as long as the
    /// policy's `hold_timeout`.
    Held,
}

/// Opens a new connection to a session's server.
pub trait Redial<T>: Send {
    /// Connects, says `last_reply` was the last reply received; returns the
    /// connection and the last request the server ran. `timeout` bounds the
    /// whole attempt.
    fn redial(&mut self, last_reply: u64, timeout: Duration) -> Result<(T, u64), Redialed>;
}

/// Over TCP, to the address the session was opened at (or the one it moved
/// to), under TLS when the process uses TLS. A resumed connection is TCP
/// even where the first one was RDMA.
pub struct TcpRedial {
    pub addr: String,
    pub session_id: u64,
    pub key: Vec<u8>,
    pub server_timeout: Duration,
}

/// Most redirects one redial follows (a session moved several times while
/// the client was away is followed; a loop is not).
const MAX_HOPS: u32 = 8;

/// What one dial of a resume got.
enum Dialed {
    Resumed(DataTransport, u64),
    /// The session moved to this address.
    Moved(String),
}

impl TcpRedial {
    fn dial(&mut self, last_reply: u64, timeout: Duration) -> Result<Dialed, Redialed> {
        let t = tcp::connect(&self.addr, timeout).map_err(Redialed::Failed)?;
        // Under TLS as the first connection was (the process's one setting).
        // A failed handshake is worth another try: a cut mid-handshake
        // looks the same as any other cut.
        let mut t = super::security::secure(t, &self.addr, timeout)
            .map_err(|e| Redialed::Failed(io::Error::other(e.to_string())))?;
        t.set_spin(tcp::spin_from_env());
        // The handshake may wait as long as the attempt may: the session
        // answers once the request it is running has finished.
        t.stream().set_read_timeout(Some(timeout)).map_err(Redialed::Failed)?;
        t.stream().set_write_timeout(Some(timeout)).map_err(Redialed::Failed)?;
        t.send(&[RESUME_PREAMBLE, &self.session_id.to_le_bytes(), &self.key, &last_reply.to_le_bytes()])
            .map_err(Redialed::Failed)?;
        let mut answer = [0u8; 8];
        t.recv_exact(&mut answer).map_err(Redialed::Failed)?;
        super::security::check_answer(&self.addr, &answer).map_err(|e| Redialed::Refused(e.to_string()))?;
        let status = u32::from_le_bytes(answer[..4].try_into().unwrap_or_default());
        let version = u32::from_le_bytes(answer[4..].try_into().unwrap_or_default());
        if version != PROTOCOL_VERSION {
            return Err(Redialed::Refused(format!("the server now speaks protocol {version}, not {PROTOCOL_VERSION}")));
        }
        if status == RESUME_SUSPENDED {
            return Err(Redialed::Suspended);
        }
        if status == RESUME_HELD {
            return Err(Redialed::Held);
        }
        if status == RESUME_MOVED {
            let mut len = [0u8; 2];
            t.recv_exact(&mut len).map_err(Redialed::Failed)?;
            let len = u16::from_le_bytes(len) as usize;
            if len == 0 || len > MAX_REDIRECT_LEN {
                return Err(Redialed::Refused(format!("a redirect to an address of {len} bytes")));
            }
            let mut to = vec![0u8; len];
            t.recv_exact(&mut to).map_err(Redialed::Failed)?;
            return match String::from_utf8(to) {
                Ok(to) if to.contains(':') && to.chars().all(|c| c.is_ascii_graphic()) => Ok(Dialed::Moved(to)),
                _ => Err(Redialed::Refused("a redirect to something that is not host:port".into())),
            };
        }
        if status != 0 {
            return Err(Redialed::Refused(format!("status {status}")));
        }
        let mut executed = [0u8; 8];
        t.recv_exact(&mut executed).map_err(Redialed::Failed)?;
        t.stream().set_read_timeout(Some(self.server_timeout)).map_err(Redialed::Failed)?;
        t.stream().set_write_timeout(Some(self.server_timeout)).map_err(Redialed::Failed)?;
        Ok(Dialed::Resumed(DataTransport::Tcp(t), u64::from_le_bytes(executed)))
    }
}

impl Redial<DataTransport> for TcpRedial {
    /// Follows the session where it moved (live migration): the server it
    /// left answers with the new address, which every later redial uses.
    fn redial(&mut self, last_reply: u64, timeout: Duration) -> Result<(DataTransport, u64), Redialed> {
        let start = std::time::Instant::now();
        for _ in 0..=MAX_HOPS {
            let left = timeout.saturating_sub(start.elapsed()).max(Duration::from_millis(1));
            match self.dial(last_reply, left)? {
                Dialed::Resumed(t, executed) => return Ok((t, executed)),
                Dialed::Moved(to) => {
                    tracing::info!("the session moved from {} to {to}; resuming it there", self.addr);
                    self.addr = to;
                }
            }
        }
        Err(Redialed::Refused(format!("the session was redirected more than {MAX_HOPS} times")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(vars: &[(&str, &str)]) -> Policy {
        Policy::from_vars(|n| vars.iter().find(|(k, _)| *k == n).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn bounds_from_the_environment() {
        assert_eq!(policy(&[]), Policy::default());
        let p = policy(&[("RGPU_SERVER_TIMEOUT", "1.5"), ("RGPU_RECONNECT_TIMEOUT", "0"), ("RGPU_RECONNECT_ATTEMPTS", "3")]);
        assert_eq!(p, Policy { server_timeout: Duration::from_millis(1500), reconnect_timeout: Duration::ZERO, attempts: 3, ..Policy::default() });
        assert_eq!(policy(&[("RGPU_SUSPEND_TIMEOUT", "0")]).suspend_timeout, Duration::ZERO);
        assert_eq!(policy(&[("RGPU_SUSPEND_TIMEOUT", "later")]).suspend_timeout, DEFAULT_SUSPEND_TIMEOUT);
        assert_eq!(policy(&[("RGPU_HOLD_TIMEOUT", "90")]).hold_timeout, Duration::from_secs(90));
        assert_eq!(policy(&[("RGPU_HOLD_TIMEOUT", "long")]).hold_timeout, DEFAULT_HOLD_TIMEOUT);
        assert_eq!(policy(&[("RGPU_SERVER_TIMEOUT", "soon")]).server_timeout, DEFAULT_SERVER_TIMEOUT);
        assert_eq!(policy(&[("RGPU_SERVER_TIMEOUT", "0")]).server_timeout, DEFAULT_SERVER_TIMEOUT, "0 would mean no bound");
    }
}
