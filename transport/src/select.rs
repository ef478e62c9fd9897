//! Choosing the data plane's transport: TCP, or RDMA when both ends can.
//!
//! The data connection always starts over TCP. A client that wants RDMA
//! opens it with [`RDMA_DATA_PREAMBLE`] instead of the plain data preamble;
//! after the session is attached it sends its [`ConnInfo`], and the server
//! answers with its own (accept) or with a reason (refuse). On accept both
//! connect their queue pairs and the client confirms with a READY byte (or
//! an ABORT byte if its side failed); from then on frames travel over RDMA
//! and the TCP connection is only the liveness side channel. On refuse or
//! abort both ends carry on over TCP on the same socket: the session works
//! either way.
//!
//! `tcp` never loads the plugin; `rdma` requires it (and a device, and a
//! server that accepts); `auto` uses RDMA when the plugin loads and finds a
//! device, and otherwise says once in the log that the data plane runs over
//! TCP, and why.

use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use thiserror::Error;
use tracing::{info, warn};

use crate::rdma::conn::{describe, pkey_mismatch, RdmaConfig, RdmaError, RdmaTransport};
use crate::rdma::verbs::{VerbsError, VerbsProvider};
use crate::rdma::wire::{ConnInfo, CONN_INFO_LEN, SETUP_ACCEPT, SETUP_REFUSE, SETUP_READY};
use crate::tcp::TcpTransport;
use crate::Transport;

/// First 8 bytes of a data connection that asks for RDMA.
pub const RDMA_DATA_PREAMBLE: &[u8; 8] = b"RGPUDRD1";
const SETUP_ABORT: u8 = 0x41;
/// How long either end waits for the other during set-up.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    Tcp,
    Rdma,
    #[default]
    Auto,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "tcp" => Ok(Mode::Tcp),
            "rdma" | "ib" | "verbs" => Ok(Mode::Rdma),
            "auto" | "" => Ok(Mode::Auto),
            o => Err(format!("unknown transport {o:?} (tcp, rdma or auto)")),
        }
    }
}

#[derive(Debug, Error)]
pub enum SelectError {
    #[error("RDMA transport requested but not available: {0}")]
    Unavailable(VerbsError),
    #[error("RDMA transport requested but the server refused it: {0}")]
    Refused(String),
    #[error(transparent)]
    Rdma(#[from] RdmaError),
    #[error("RDMA set-up over TCP failed: {0}")]
    Io(#[from] io::Error),
}

impl From<SelectError> for io::Error {
    fn from(e: SelectError) -> io::Error {
        match e {
            SelectError::Io(e) => e,
            o => io::Error::other(o),
        }
    }
}

/// The data plane's transport, whichever was chosen.
pub enum DataTransport {
    Tcp(TcpTransport),
    Rdma(Box<RdmaTransport>),
}

impl DataTransport {
    /// Bytes received and buffered, readable without waiting.
    pub fn buffered(&self) -> usize {
        match self {
            DataTransport::Tcp(t) => t.buffered(),
            DataTransport::Rdma(t) => t.buffered(),
        }
    }
    pub fn kind(&self) -> &'static str {
        match self {
            DataTransport::Tcp(_) => "tcp",
            DataTransport::Rdma(_) => "rdma",
        }
    }
}

impl Transport for DataTransport {
    fn send(&mut self, bufs: &[&[u8]]) -> io::Result<()> {
        match self {
            DataTransport::Tcp(t) => t.send(bufs),
            DataTransport::Rdma(t) => t.send(bufs),
        }
    }
    fn recv_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        match self {
            DataTransport::Tcp(t) => t.recv_exact(buf),
            DataTransport::Rdma(t) => t.recv_exact(buf),
        }
    }
    fn peer(&self) -> &str {
        match self {
            DataTransport::Tcp(t) => t.peer(),
            DataTransport::Rdma(t) => t.peer(),
        }
    }
    fn shutdown(&self) {
        match self {
            DataTransport::Tcp(t) => t.shutdown(),
            DataTransport::Rdma(t) => t.shutdown(),
        }
    }
}

/// What this process can do, decided once.
pub struct Selector {
    mode: Mode,
    provider: Option<Arc<dyn VerbsProvider>>,
    cfg: RdmaConfig,
    /// Why the data plane is on TCP, until said once.
    unsaid: Mutex<Option<String>>,
}

impl Selector {
    /// Decides from `mode`, loading the plugin unless `mode` is `tcp`.
    /// `rdma` without a usable plugin and device is an error; `auto` then
    /// falls back to TCP.
    pub fn new(mode: Mode, cfg: RdmaConfig) -> Result<Selector, SelectError> {
        if mode == Mode::Tcp {
            return Ok(Selector::with_provider(mode, None, cfg));
        }
        match crate::rdma::plugin::discover() {
            Ok(p) => {
                info!("RDMA available: {}", p.describe());
                Ok(Selector::with_provider(mode, Some(p), cfg))
            }
            Err(e) if mode == Mode::Rdma => Err(SelectError::Unavailable(e)),
            Err(e) => {
                let s = Selector::with_provider(mode, None, cfg);
                s.fallback(&format!("RDMA not available ({e})"));
                Ok(s)
            }
        }
    }

    /// A selector over a given provider (the model, in tests).
    pub fn with_provider(mode: Mode, provider: Option<Arc<dyn VerbsProvider>>, cfg: RdmaConfig) -> Selector {
        Selector { mode, provider, cfg, unsaid: Mutex::new(None) }
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Whether a client should ask the server for RDMA.
    pub fn wants_rdma(&self) -> bool {
        self.mode != Mode::Tcp && self.provider.is_some()
    }

    /// The preamble a client opens its data connection with.
    pub fn preamble<'a>(&self, plain: &'a [u8; 8]) -> &'a [u8; 8] {
        if self.wants_rdma() {
            RDMA_DATA_PREAMBLE
        } else {
            plain
        }
    }

    /// Says once, per process, that the data plane runs over TCP.
    fn fallback(&self, why: &str) {
        let mut said = self.unsaid.lock().unwrap_or_else(|p| p.into_inner());
        if said.is_none() {
            info!("data plane over TCP: {why}");
            *said = Some(why.to_string());
        }
    }

    /// Client side, after the session is attached on a connection opened
    /// with [`Selector::preamble`]: sets up RDMA or stays on TCP.
    pub fn client_upgrade(&self, tcp: TcpTransport) -> Result<DataTransport, SelectError> {
        self.client_upgrade_in(tcp, None)
    }

    /// [`Selector::client_upgrade`] for a session whose lease names the
    /// InfiniBand partition `pkey`: the queue pair goes in that partition,
    /// and a server in another one (or none) is not used over RDMA.
    pub fn client_upgrade_in(&self, mut tcp: TcpTransport, pkey: Option<u16>) -> Result<DataTransport, SelectError> {
        let Some(provider) = self.provider.as_ref().filter(|_| self.wants_rdma()) else {
            return Ok(DataTransport::Tcp(tcp));
        };
        let timeouts = set_timeouts(&tcp, Some(SETUP_TIMEOUT));
        let prepared =
            provider.open().map_err(RdmaError::from).and_then(|v| RdmaTransport::prepare_in(v, self.cfg, pkey));
        let mut t = match prepared {
            Ok(t) => t,
            Err(e) => {
                // The server is waiting for our info: tell it we are not
                // coming (an invalid message makes it refuse), then use TCP.
                tcp.send(&[&[0u8; CONN_INFO_LEN]])?;
                let _ = read_reply(&mut tcp)?;
                return self.client_fallback(tcp, format!("cannot set up an RDMA endpoint ({e})"));
            }
        };
        tcp.send(&[&t.local_info().encode()])?;
        let remote = match read_reply(&mut tcp)? {
            Ok(info) => info,
            Err(why) => return self.client_fallback(tcp, format!("server refused RDMA: {why}")),
        };
        let peer = tcp.peer().to_string();
        let ours = t.local_info().pkey;
        if remote.pkey != ours {
            tcp.send(&[&[SETUP_ABORT]])?;
            warn!(%peer, "RDMA refused: {}", pkey_mismatch(ours, remote.pkey));
            return self.client_fallback(tcp, format!("RDMA refused: {}", pkey_mismatch(ours, remote.pkey)));
        }
        if let Err(e) = t.connect(remote, peer.clone()) {
            tcp.send(&[&[SETUP_ABORT]])?;
            return self.client_fallback(tcp, format!("cannot connect the queue pair ({e})"));
        }
        tcp.send(&[&[SETUP_READY]])?;
        drop(timeouts);
        t.attach_side(tcp.into_stream()?)?;
        info!(%peer, "data plane over RDMA: {}", describe(&remote));
        Ok(DataTransport::Rdma(Box::new(t)))
    }

    fn client_fallback(&self, tcp: TcpTransport, why: String) -> Result<DataTransport, SelectError> {
        if self.mode == Mode::Rdma {
            return Err(SelectError::Refused(why));
        }
        self.fallback(&why);
        Ok(DataTransport::Tcp(tcp))
    }

    /// Server side, after attaching a session whose connection opened with
    /// [`RDMA_DATA_PREAMBLE`] (`asked`): answers the client's request.
    pub fn server_upgrade(&self, tcp: TcpTransport, asked: bool) -> Result<DataTransport, SelectError> {
        self.server_upgrade_in(tcp, asked, None)
    }

    /// [`Selector::server_upgrade`] for a session admitted with a lease
    /// that names the InfiniBand partition `pkey`: a client that names
    /// another partition (or none) is refused back to TCP, and our queue
    /// pair goes in that partition.
    pub fn server_upgrade_in(
        &self,
        mut tcp: TcpTransport,
        asked: bool,
        pkey: Option<u16>,
    ) -> Result<DataTransport, SelectError> {
        if !asked {
            return Ok(DataTransport::Tcp(tcp));
        }
        let _timeouts = set_timeouts(&tcp, Some(SETUP_TIMEOUT));
        let mut b = [0u8; CONN_INFO_LEN];
        tcp.recv_exact(&mut b)?;
        let remote = match ConnInfo::decode(&b) {
            Ok(i) => i,
            Err(e) => {
                refuse(&mut tcp, &format!("bad set-up message: {e}"))?;
                return Ok(DataTransport::Tcp(tcp));
            }
        };
        let Some(provider) = self.provider.as_ref().filter(|_| self.mode != Mode::Tcp) else {
            refuse(&mut tcp, "this server runs its data plane over TCP")?;
            return Ok(DataTransport::Tcp(tcp));
        };
        let peer = tcp.peer().to_string();
        let ours = pkey.unwrap_or(0);
        if remote.pkey != ours {
            let why = pkey_mismatch(ours, remote.pkey);
            warn!(%peer, "RDMA refused: {why}; serving over TCP");
            refuse(&mut tcp, &why)?;
            return Ok(DataTransport::Tcp(tcp));
        }
        let setup =
            provider.open().map_err(RdmaError::from).and_then(|v| RdmaTransport::prepare_in(v, self.cfg, pkey));
        let mut t = match setup {
            Ok(t) => t,
            Err(e) => {
                warn!(%peer, "cannot open an RDMA endpoint: {e}; serving over TCP");
                refuse(&mut tcp, &e.to_string())?;
                return Ok(DataTransport::Tcp(tcp));
            }
        };
        if let Err(e) = t.connect(remote, peer.clone()) {
            warn!(%peer, "cannot connect the queue pair: {e}; serving over TCP");
            refuse(&mut tcp, &e.to_string())?;
            return Ok(DataTransport::Tcp(tcp));
        }
        let info = t.local_info().encode();
        tcp.send(&[&[SETUP_ACCEPT], &info])?;
        let mut ready = [0u8; 1];
        tcp.recv_exact(&mut ready)?;
        if ready[0] != SETUP_READY {
            // Dropping `t` tears its queue pair down; the client uses TCP.
            drop(t);
            info!(%peer, "client could not finish RDMA set-up; serving over TCP");
            return Ok(DataTransport::Tcp(tcp));
        }
        drop(_timeouts);
        t.attach_side(tcp.into_stream()?)?;
        info!(%peer, "data plane over RDMA: {}", describe(&remote));
        Ok(DataTransport::Rdma(Box::new(t)))
    }
}

fn refuse(tcp: &mut TcpTransport, why: &str) -> io::Result<()> {
    let why = &why.as_bytes()[..why.len().min(1024)];
    tcp.send(&[&[SETUP_REFUSE], &(why.len() as u16).to_le_bytes(), why])
}

/// The server's answer: its info, or the reason it refused.
fn read_reply(tcp: &mut TcpTransport) -> io::Result<Result<ConnInfo, String>> {
    let mut k = [0u8; 1];
    tcp.recv_exact(&mut k)?;
    match k[0] {
        SETUP_ACCEPT => {
            let mut b = [0u8; CONN_INFO_LEN];
            tcp.recv_exact(&mut b)?;
            Ok(ConnInfo::decode(&b).map_err(|e| format!("bad set-up reply: {e}")))
        }
        SETUP_REFUSE => {
            let mut n = [0u8; 2];
            tcp.recv_exact(&mut n)?;
            let mut why = vec![0u8; u16::from_le_bytes(n) as usize];
            tcp.recv_exact(&mut why)?;
            Ok(Err(String::from_utf8_lossy(&why).into_owned()))
        }
        o => Err(io::Error::new(io::ErrorKind::InvalidData, format!("bad set-up reply kind {o}"))),
    }
}

/// Sets read/write timeouts for the set-up; clears them on drop.
struct Timeouts(Option<std::net::TcpStream>);

fn set_timeouts(tcp: &TcpTransport, t: Option<Duration>) -> Timeouts {
    let s = tcp.stream().try_clone().ok();
    if let Some(s) = &s {
        let _ = s.set_read_timeout(t);
        let _ = s.set_write_timeout(t);
    }
    Timeouts(s)
}

impl Drop for Timeouts {
    fn drop(&mut self) {
        if let Some(s) = &self.0 {
            let _ = s.set_read_timeout(None);
            let _ = s.set_write_timeout(None);
        }
    }
}
