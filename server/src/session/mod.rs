//! One data connection = one session, served by a dedicated thread with
//! blocking I/O (house style 12: no async runtime on the hot path).
//!
//! The loop reads a frame header, the capnp message, decodes a [`Command`],
//! applies it (bulk bytes go straight between the socket and device memory)
//! and queues the reply. Queued replies are sent together when no further
//! request is already buffered, so a burst of requests costs one write.
//! What each message does is the command table's business
//! ([`crate::command`]); this loop only knows frames, replies and the
//! deferred error.
//!
//! Logging: the caller runs the loop inside the session's span (id, client,
//! transport), so every event here carries them; each request gets a
//! trace-level span (`call`: message name and sequence number) and a
//! trace event with its result code, both free when trace is off.
//!
//! Asynchronous requests (no WANTS_REPLY) report failure as the deferred
//! error: the first one since the last reply, returned in the next reply and
//! then cleared. A frame that cannot be decoded ends the session: the stream
//! is out of sync and nothing after it can be trusted. Whatever the reason
//! the session ends, dropping its [`SessionState`] frees everything it held.
//!
//! A connection that breaks without the client's Close frame does not end
//! the session at once: with a [`Resumer`], the loop waits out the
//! reconnect grace for the client to come back ([`registry::Resume`]),
//! tells it the last request it executed, sends again the replies it missed
//! ([`window`]) and goes on serving on the new connection; the requests the
//! client then sends again start right after the last one executed, so
//! nothing runs twice.

pub mod hangup;
pub mod registry;
pub mod window;

use std::io;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use rgpu_protocol::data_capnp::request;
use rgpu_protocol::frame::{FrameHeader, Kind, HEADER_LEN};
use rgpu_protocol::message::{Encoder, RecvBuf};
use rgpu_transport::select::DataTransport;
use rgpu_transport::tcp::TcpTransport;
use rgpu_transport::Transport;
use tracing::{debug, info, trace, trace_span, warn};

use crate::backend::TransferError;
use crate::command::{Bulk, Command, DeviceBytes, EncodeReply, Fail, Reply};
use crate::limits::SMALL_MESSAGE;
use crate::state::{is_sticky, SessionState};
use rgpu_cuda_types::{code_of, CuError};

/// A transport that can tell whether more input is already buffered, so the
/// session knows it may hold its replies back and batch them.
pub trait Pending {
    fn pending_input(&self) -> usize;
}

impl Pending for TcpTransport {
    fn pending_input(&self) -> usize {
        self.buffered()
    }
}

impl Pending for DataTransport {
    fn pending_input(&self) -> usize {
        self.buffered()
    }
}

/// A transport a resumed TCP connection can become.
pub trait FromTcp {
    fn from_tcp(t: TcpTransport) -> Self;
}

impl FromTcp for TcpTransport {
    fn from_tcp(t: TcpTransport) -> Self {
        t
    }
}

impl FromTcp for DataTransport {
    fn from_tcp(t: TcpTransport) -> Self {
        DataTransport::Tcp(t)
    }
}

/// What a session needs to take resumed connections.
pub struct Resumer {
    pub rx: mpsc::Receiver<registry::Wake>,
    pub link: Arc<hangup::Link>,
    /// Read polling of the new connection (the server's --spin-us).
    pub spin: Duration,
}

/// How a session ended.
#[derive(Debug, thiserror::Error)]
pub enum End {
    /// The client closed the connection between frames.
    #[error("closed by the client")]
    Closed,
    /// The connection failed (reset, timeout, or closed mid-frame).
    #[error("connection ended: {0}")]
    Io(io::Error),
    /// The client sent something that is not a valid frame.
    #[error("stream out of sync: {0}")]
    OutOfSync(String),
    /// The connection ended (or the server is stopping) while requests were
    /// still queued: they were dropped and the running one stopped.
    #[error("connection ended; its queued and running work was stopped")]
    Stopped,
    /// The client closed the session in order (its Close frame).
    #[error("closed by the client in order")]
    Goodbye,
}

impl End {
    /// The connection broke under a session the client may come back to.
    fn resumable(&self) -> bool {
        matches!(self, End::Closed | End::Io(_))
    }
}

/// Requests still served once the session's device is in a sticky error:
/// those that only release what the session holds, and the context reset
/// that may follow them.
const RELEASES: &[&str] = &[
    "memFree",
    "streamDestroy",
    "eventDestroy",
    "moduleUnload",
    "memRelease",
    "memUnmap",
    "memAddressFree",
    "graphExecDestroy",
    "ctxReset",
    "ipcClose",
];

pub struct Session<T> {
    /// None while the session has no connection (rebuilt from a snapshot,
    /// waiting for its client to resume).
    transport: Option<T>,
    state: SessionState,
    recv: RecvBuf,
    enc: Encoder,
    /// Replies encoded but not yet sent.
    out: Vec<u8>,
    scratch: Vec<u8>,
    deferred: Option<CuError>,
    /// The last request run (its result known), whatever the result.
    executed: u64,
    window: window::ReplyWindow,
    resumer: Option<Resumer>,
    /// The connection-limit slots of a resumed connection.
    _hold: Option<Box<dyn std::any::Any + Send>>,
    /// The session's state left in a snapshot: it is no longer served here,
    /// resumes are turned away unanswered (the client tries again, and
    /// finds the session where it was rebuilt).
    left: bool,
    /// Why it ends here at once, freeing what it holds: it moved to another
    /// server (live migration; the registry's forwarding note redirects its
    /// client), or its lease was suspended (the suspension note tells its
    /// client to wait).
    gone: Option<&'static str>,
}

/// What a [`registry::Visit`] gets to see of a session held still between
/// requests (its connection cut for the visit).
pub struct Parts<'a> {
    pub state: &'a mut SessionState,
    /// The last request executed.
    pub executed: u64,
    pub deferred: Option<CuError>,
    pub window: &'a window::ReplyWindow,
    /// Its state left in a checkpoint: it is served here no more.
    pub left: bool,
}

/// What the session does after a visit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum After {
    /// Goes on: its client's resume is served here.
    Serve,
    /// Its state left (a checkpoint that moves it): it is served no more.
    Leave,
    /// It moved to another server, which serves it now: it ends here.
    Gone,
    /// Its lease was preempted and its state is on this server's disk: it
    /// ends here, freeing its device memory, until the lease resumes.
    Suspended,
}

fn not_connected() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "the session has no connection")
}

impl<T: Transport + Pending + FromTcp> Session<T> {
    pub fn new(transport: T, state: SessionState) -> Self {
        Session {
            transport: Some(transport),
            state,
            recv: RecvBuf::default(),
            enc: Encoder::default(),
            out: Vec::with_capacity(4096),
            scratch: Vec::new(),
            deferred: None,
            executed: 0,
            window: window::ReplyWindow::default(),
            resumer: None,
            _hold: None,
            left: false,
            gone: None,
        }
    }

    /// A session rebuilt from a snapshot, without a connection until its
    /// client resumes it (through the resumer, which it needs).
    pub fn restored(state: SessionState, executed: u64, deferred: Option<CuError>, window: window::ReplyWindow, r: Resumer) -> Self {
        Session {
            transport: None,
            state,
            recv: RecvBuf::default(),
            enc: Encoder::default(),
            out: Vec::with_capacity(4096),
            scratch: Vec::new(),
            deferred,
            executed,
            window,
            resumer: Some(r),
            _hold: None,
            left: false,
            gone: None,
        }
    }

    /// Takes resumed connections through `r` when the connection breaks.
    pub fn resumable(mut self, r: Resumer) -> Self {
        self.resumer = Some(r);
        self
    }

    /// Serves requests until the session ends; the session's objects are
    /// freed when `self` is dropped.
    pub fn run(mut self) -> End {
        // A restored session starts without a connection.
        let mut end = End::Closed;
        loop {
            if self.transport.is_some() {
                end = loop {
                    match self.step() {
                        Ok(()) => {}
                        Err(e) => break e,
                    }
                };
                // Replies queued before the end still go out if the socket allows.
                let _ = self.flush();
                if let Some(t) = self.transport.as_mut() {
                    t.shutdown();
                }
                if !end.resumable() || self.resumer.is_none() {
                    return end;
                }
                info!("data connection lost ({end}); keeping the session for the client to resume");
            }
            let Some(r) = self.wait_for_resume() else {
                if let Some(why) = self.gone {
                    info!("{why}; it ends here");
                } else if self.left {
                    info!("the session's state left in a snapshot; it ends here");
                } else {
                    info!("no resumed connection within the reconnect grace");
                }
                return end;
            };
            match self.resume(r) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::PermissionDenied => return end,
                // The new connection broke too (cut again mid-handshake):
                // the next step sees it, and the session waits again.
                Err(e) => warn!("resumed connection lost during the resume: {e}"),
            }
        }
    }

    fn wait_for_resume(&mut self) -> Option<registry::Resume> {
        loop {
            let r = self.resumer.as_ref()?;
            if self.state.ended.load(Ordering::Relaxed) {
                return None;
            }
            let deadline = r.link.grace_deadline();
            // Wake now and then to see the ended flag (a close raises it).
            let wait = deadline.saturating_duration_since(Instant::now()).min(Duration::from_millis(200));
            let mut got = match r.rx.recv_timeout(wait) {
                Ok(registry::Wake::Resume(got)) => Some(got),
                Ok(registry::Wake::Visit(v)) => {
                    self.visit(v);
                    if self.gone.is_some() {
                        return None;
                    }
                    None
                }
                Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < deadline => None,
                Err(_) => return None,
            };
            // Only the newest of several connections is served; a visit
            // queued among them is made first, and the connections before
            // it are turned away (their client tries again).
            while let Ok(next) = self.resumer.as_ref()?.rx.try_recv() {
                match next {
                    registry::Wake::Resume(newer) => {
                        if let Some(old) = got.replace(newer) {
                            old.transport.shutdown();
                        }
                    }
                    registry::Wake::Visit(v) => {
                        if let Some(old) = got.take() {
                            old.transport.shutdown();
                        }
                        self.visit(v);
                        if self.gone.is_some() {
                            return None;
                        }
                    }
                }
            }
            match got {
                Some(g) if self.left => {
                    // Unanswered: the client tries again, and finds the
                    // session where its snapshot was rebuilt.
                    g.transport.shutdown();
                }
                Some(g) => return Some(g),
                None => {}
            }
        }
    }

    /// Lets `v` see the session, held still between requests.
    fn visit(&mut self, v: registry::Visit) {
        if let Some(e) = self.state.backend.take_async_error() {
            self.deferred.get_or_insert(e);
        }
        // However long the visit takes (a checkpoint of many GiB), the
        // client's resume is answered "held" meanwhile and the grace for it
        // starts when the visit ends.
        let link = self.resumer.as_ref().map(|r| r.link.clone());
        if let Some(l) = &link {
            l.set_held(true);
        }
        let parts =
            Parts { state: &mut self.state, executed: self.executed, deferred: self.deferred, window: &self.window, left: self.left };
        let after = v(parts);
        if let Some(l) = &link {
            l.set_held(false);
        }
        match after {
            After::Serve => {}
            After::Leave => self.left = true,
            After::Gone => self.gone = Some("the session moved to another server"),
            After::Suspended => self.gone = Some("the session's lease was preempted: its state is on disk here"),
        }
    }

    /// Continues on a resumed connection: says the last request executed,
    /// sends again the replies the client missed, then serves as before.
    fn resume(&mut self, r: registry::Resume) -> io::Result<()> {
        let registry::Resume { transport: mut t, last_reply, hold } = r;
        self._hold = Some(hold);
        let mut answer = [0u8; 16];
        let status = match self.window.after(last_reply) {
            Ok(_) if last_reply <= self.executed => 0,
            Ok(_) => {
                warn!(last_reply, executed = self.executed, "client claims a reply to a request never run");
                CuError::INVALID_VALUE.code()
            }
            Err(e) => {
                warn!("cannot resume: {e}");
                CuError::INVALID_HANDLE.code()
            }
        };
        answer[..4].copy_from_slice(&status.to_le_bytes());
        answer[4..8].copy_from_slice(&rgpu_protocol::PROTOCOL_VERSION.to_le_bytes());
        answer[8..].copy_from_slice(&self.executed.to_le_bytes());
        let watched = t.stream().try_clone()?;
        let sealer = t.sealer();
        if let Err(e) = t.send(&[&answer]) {
            // Continue on the old (broken) connection: its next step ends
            // it, and the session waits for another resume.
            return Err(e);
        }
        if status != 0 {
            t.shutdown();
            return Err(io::Error::new(io::ErrorKind::PermissionDenied, "resume refused"));
        }
        let spin = self.resumer.as_ref().map_or(rgpu_transport::tcp::DEFAULT_SPIN, |r| r.spin);
        t.set_spin(spin);
        self.out.clear();
        self.transport = Some(T::from_tcp(t));
        // Watched (and kept alive) while the replies are replayed: a read
        // again may wait for the stream's work before its first byte.
        let link = self.resumer.as_ref().map(|r| r.link.clone());
        if let Some(l) = &link {
            l.attach(watched, true, sealer);
        }
        let kept: Vec<(Vec<u8>, Option<DeviceBytes>)> =
            self.window.after(last_reply).map_err(io::Error::other)?.map(|k| (k.frame.clone(), k.device)).collect();
        let n = kept.len();
        for (mut frame, device) in kept {
            let Some(DeviceBytes { src, len, stream }) = device else {
                self.transport.as_mut().ok_or_else(not_connected)?.send(&[&frame])?;
                continue;
            };
            let transport = self.transport.as_mut().ok_or_else(not_connected)?;
            let mut sent = 0u64;
            if let Some(l) = &link {
                l.set_busy(true);
            }
            let r = self.state.backend.memcpy_dtoh(stream, src, len, &mut |chunk| {
                if sent == 0 {
                    if let Some(l) = &link {
                        l.set_busy(false);
                    }
                    transport.send(&[&frame, chunk])?;
                    frame.clear();
                } else {
                    transport.send(&[chunk])?;
                }
                sent += chunk.len() as u64;
                Ok(())
            });
            if let Some(l) = &link {
                l.set_busy(false);
            }
            match r {
                Ok(()) if sent == len => {}
                Ok(()) => return Err(io::Error::other("backend produced fewer bytes than asked")),
                Err(TransferError::Io(e)) => return Err(e),
                Err(TransferError::Device(e)) => return Err(io::Error::other(format!("replayed read failed: {e}"))),
            }
        }
        info!(last_reply, executed = self.executed, replayed = n, "session resumed on a new connection");
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        if !self.out.is_empty() {
            self.transport.as_mut().ok_or_else(not_connected)?.send(&[&self.out])?;
            self.state.meter.sent(self.out.len() as u64);
            self.out.clear();
        }
        Ok(())
    }

    fn step(&mut self) -> Result<(), End> {
        if self.state.ended.load(Ordering::Relaxed) {
            return Err(End::Stopped);
        }
        if self.transport.as_ref().map_or(0, |t| t.pending_input()) < HEADER_LEN {
            self.flush().map_err(End::Io)?;
        }
        let mut hb = [0u8; HEADER_LEN];
        match self.transport.as_mut().ok_or_else(not_connected).and_then(|t| t.recv_exact(&mut hb)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(End::Closed),
            Err(e) => return Err(End::Io(e)),
        }
        let h = FrameHeader::decode(&hb).map_err(|e| End::OutOfSync(e.to_string()))?;
        if h.kind == Kind::Close {
            return Err(End::Goodbye);
        }
        if h.kind != Kind::Request {
            return Err(End::OutOfSync(format!("got a {:?} frame; clients send requests", h.kind)));
        }
        let len = h.msg_len as usize;
        // Large messages are rare (requests are small): the bytes of one are
        // charged to the server's input budget as they arrive, so many
        // connections sending large messages cannot make it hold more than
        // the budget (a header alone costs nothing).
        let mut held: Option<crate::quota::Charge> = None;
        let mut over_budget = false;
        let (transport, buffered) = (self.transport.as_mut().ok_or_else(not_connected).map_err(End::Io)?, &self.state.input.buffered);
        let r = self.recv.receive(len, |b| {
            if len > SMALL_MESSAGE {
                let n = b.len() as u64;
                let ok = match &mut held {
                    Some(c) => c.grow(n),
                    None => {
                        held = buffered.charge(n);
                        held.is_some()
                    }
                };
                if !ok {
                    over_budget = true;
                    return Err(io::Error::other("over the input budget"));
                }
            }
            transport.recv_exact(b)
        });
        if over_budget {
            return Err(End::OutOfSync(format!(
                "a {len}-byte message does not fit the server's input budget (--max-buffered-input)"
            )));
        }
        r.map_err(End::Io)?;
        let cmd = {
            let msg = self.recv.reader().map_err(|e| End::OutOfSync(format!("bad message: {e}")))?;
            let req = msg
                .get_root::<request::Reader>()
                .map_err(|e| End::OutOfSync(format!("bad request: {e}")))?;
            Command::decode(req).map_err(|e| End::OutOfSync(format!("bad request: {e}")))?
        };
        if len > SMALL_MESSAGE {
            self.recv.shrink_to(SMALL_MESSAGE);
        }
        let name = cmd.name();
        let call = trace_span!("call", msg = name, seq = h.seq);
        let _in_call = call.enter();
        // Metering: the whole frame counts as received once it is taken
        // (its bulk is read or skipped by the command), and a launch's
        // device is known before the command consumes it.
        self.state.meter.received((HEADER_LEN + len) as u64 + h.bulk_len);
        let launch_on = match &cmd {
            Command::LaunchKernel(l) => self.state.modules.get(&l.module).map(|m| m.device),
            _ => None,
        };
        // The client has every reply to the requests before this one.
        self.window.received_below(h.seq);
        let started = std::time::Instant::now();
        let transport = self.transport.as_mut().ok_or_else(not_connected).map_err(End::Io)?;
        let mut bulk = Bulk::new(transport, h.bulk_len, &mut self.scratch);
        let link = self.resumer.as_ref().map(|r| r.link.clone());
        if let Some(l) = &link {
            l.set_busy(true);
        }
        let result = match self.state.sticky {
            Some(e) if !RELEASES.contains(&name) => bulk.discard().map(|()| Err(e)).map_err(End::Io),
            _ => match cmd.apply(&mut self.state, &mut bulk) {
                Ok(body) => Ok(Ok(body)),
                Err(Fail::Cuda(e)) => Ok(Err(e)),
                Err(Fail::Io(e)) => Err(End::Io(e)),
            },
        };
        if let Some(l) = &link {
            l.set_busy(false);
        }
        let result = result?;
        self.executed = self.executed.max(h.seq);
        let took = started.elapsed();
        self.state.meter.request(name, took, code_of(&result));
        if let (Some(device), Ok(_), false) = (launch_on, &result, self.state.backend_times_kernels) {
            self.state.meter.kernel(device, took);
        }
        // Asynchronous work that failed since the last request: its error is
        // the next reply's deferred error, as a launch's own is.
        let late = self.state.backend.take_async_error();
        for e in result.as_ref().err().into_iter().chain(late.as_ref()) {
            if is_sticky(*e) && self.state.sticky.is_none() {
                let until = if *e == CuError::ASSERT { "until the client resets its context" } else { "from now on" };
                warn!("{name} failed with {e}: the session's device is unusable {until}, as a GPU's context is");
                self.state.sticky = Some(*e);
            }
        }
        // A launch stopped because the session ended is no error of the client's.
        if self.state.ended.load(Ordering::Relaxed) {
            return Err(End::Stopped);
        }
        trace!(result = code_of(&result), "applied");
        if let Err(e) = &result {
            debug!(seq = h.seq, "{name} failed: {e}");
        }
        if let Some(e) = late {
            self.deferred.get_or_insert(e);
        }
        if !h.wants_reply() {
            if let Err(e) = result {
                self.deferred.get_or_insert(e);
            }
            return Ok(());
        }
        self.reply(h.seq, result)
    }

    /// Queues (or, with device bytes, sends) the reply to request `seq`.
    fn reply(&mut self, seq: u64, result: Result<Reply, CuError>) -> Result<(), End> {
        let deferred = self.deferred.take().map_or(0, |e| e.code());
        // Kernel printf output rides on the next reply (CUDA too shows it at
        // synchronisation points).
        let output = self.state.backend.take_output();
        let mark = self.out.len();
        let body = match result {
            Ok(b) => b,
            Err(e) => {
                self.encode(seq, e.code(), deferred, &(), 0, &output);
                self.window.keep(seq, &self.out[mark..], None);
                return Ok(());
            }
        };
        let bytes = body.device_bytes();
        self.encode(seq, 0, deferred, &body, bytes.map_or(0, |b| b.len), &output);
        self.window.keep(seq, &self.out[mark..], bytes);
        let Some(DeviceBytes { src, len, stream }) = bytes else {
            return Ok(());
        };
        // Send everything queued, this reply's header and message, then the
        // bytes as the backend produces them.
        let mut sent = 0u64;
        // The read may first wait for the stream's work (a long kernel):
        // the client hears keepalives until the reply's first bytes go.
        let link = self.resumer.as_ref().map(|r| r.link.clone());
        if let Some(l) = &link {
            l.set_busy(true);
        }
        let transport = self.transport.as_mut().ok_or_else(not_connected).map_err(End::Io)?;
        let (out, meter) = (&mut self.out, &self.state.meter);
        let r = self.state.backend.memcpy_dtoh(stream, src, len, &mut |chunk| {
            if sent == 0 {
                if let Some(l) = &link {
                    l.set_busy(false);
                }
                transport.send(&[out, chunk])?;
                meter.sent(out.len() as u64);
                out.clear();
            } else {
                transport.send(&[chunk])?;
            }
            meter.sent(chunk.len() as u64);
            sent += chunk.len() as u64;
            Ok(())
        });
        if let Some(l) = &link {
            l.set_busy(false);
        }
        match r {
            Ok(()) if sent == len => Ok(()),
            Ok(()) => Err(End::Io(io::Error::other("backend produced fewer bytes than asked"))),
            Err(TransferError::Io(e)) => Err(End::Io(e)),
            Err(TransferError::Device(e)) if sent == 0 => {
                // Nothing of this reply went out yet: answer the error instead.
                self.out.truncate(mark);
                self.encode(seq, e.code(), deferred, &(), 0, &output);
                self.window.keep(seq, &self.out[mark..], None);
                Ok(())
            }
            Err(TransferError::Device(e)) => Err(End::Io(io::Error::other(format!(
                "device read failed after {sent} of {len} bytes were sent: {e}"
            )))),
        }
    }

    fn encode(&mut self, seq: u64, code: u32, deferred: u32, body: &impl EncodeReply, bulk_len: u64, output: &[u8]) {
        let at = self.out.len();
        self.out.extend_from_slice(&[0u8; HEADER_LEN]);
        let n = self.enc.reply(&mut self.out, |mut r| {
            r.set_result(code);
            r.set_deferred_error(deferred);
            if !output.is_empty() {
                r.set_output(output);
            }
            body.encode(r);
        });
        let h = FrameHeader::reply(seq, n, bulk_len).encode();
        self.out[at..at + HEADER_LEN].copy_from_slice(&h);
    }
}

/// Runs a session on the calling thread (inside the session's span, which
/// names it) and logs how it ended.
pub fn serve(transport: DataTransport, state: SessionState, resumer: Option<Resumer>) {
    state.meter.set_transport(transport.kind());
    let mut session = Session::new(transport, state);
    if let Some(r) = resumer {
        session = session.resumable(r);
    }
    match session.run() {
        e @ (End::Closed | End::Io(_) | End::Goodbye) => debug!("session {e}"),
        e @ End::Stopped => info!("session {e}"),
        e @ End::OutOfSync(_) => warn!("closing data connection: {e}"),
    }
}
