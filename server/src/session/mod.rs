//! One data connection = one session, served by a dedicated thread with
//! blocking I/O (house style 12: no async runtime on the hot path).
//!
//! The loop reads a frame header, the capnp message, decodes a [`Command`],
//! applies it (bulk bytes go straight between the socket and device memory)
//! and queues the reply. Queued replies are sent together when no further
//! request is already buffered, so a burst of requests costs one write.
//!
//! Asynchronous requests (no WANTS_REPLY) report failure as the deferred
//! error: the first one since the last reply, returned in the next reply and
//! then cleared. A frame that cannot be decoded ends the session: the stream
//! is out of sync and nothing after it can be trusted. Whatever the reason
//! the session ends, dropping its [`SessionState`] frees everything it held.

pub mod registry;
pub mod state;

use std::io;

use rgpu_protocol::data_capnp::request;
use rgpu_protocol::frame::{FrameHeader, Kind, HEADER_LEN};
use rgpu_protocol::message::{Encoder, RecvBuf};
use rgpu_transport::select::DataTransport;
use rgpu_transport::tcp::TcpTransport;
use rgpu_transport::Transport;
use tracing::{debug, warn};

use crate::backend::TransferError;
use crate::command::{Bulk, Command, Fail, ReplyBody};
use rgpu_cuda_types::CuError;
use self::state::SessionState;

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

/// How a session ended.
#[derive(Debug)]
pub enum End {
    /// The client closed the connection between frames.
    Closed,
    /// The connection failed (reset, timeout, or closed mid-frame).
    Io(io::Error),
    /// The client sent something that is not a valid frame.
    OutOfSync(String),
}

pub struct Session<T> {
    id: u64,
    transport: T,
    state: SessionState,
    recv: RecvBuf,
    enc: Encoder,
    /// Replies encoded but not yet sent.
    out: Vec<u8>,
    scratch: Vec<u8>,
    deferred: Option<CuError>,
}

impl<T: Transport + Pending> Session<T> {
    pub fn new(id: u64, transport: T, state: SessionState) -> Self {
        Session {
            id,
            transport,
            state,
            recv: RecvBuf::default(),
            enc: Encoder::default(),
            out: Vec::with_capacity(4096),
            scratch: Vec::new(),
            deferred: None,
        }
    }

    /// Serves requests until the connection ends; the session's objects are
    /// freed when `self` is dropped.
    pub fn run(mut self) -> End {
        let end = loop {
            match self.step() {
                Ok(()) => {}
                Err(e) => break e,
            }
        };
        // Replies queued before the end still go out if the socket allows.
        let _ = self.flush();
        self.transport.shutdown();
        end
    }

    fn flush(&mut self) -> io::Result<()> {
        if !self.out.is_empty() {
            self.transport.send(&[&self.out])?;
            self.out.clear();
        }
        Ok(())
    }

    fn step(&mut self) -> Result<(), End> {
        if self.transport.pending_input() < HEADER_LEN {
            self.flush().map_err(End::Io)?;
        }
        let mut hb = [0u8; HEADER_LEN];
        match self.transport.recv_exact(&mut hb) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(End::Closed),
            Err(e) => return Err(End::Io(e)),
        }
        let h = FrameHeader::decode(&hb).map_err(|e| End::OutOfSync(e.to_string()))?;
        if h.kind != Kind::Request {
            return Err(End::OutOfSync(format!("got a {:?} frame; clients send requests", h.kind)));
        }
        let buf = self.recv.prepare(h.msg_len as usize);
        self.transport.recv_exact(buf).map_err(End::Io)?;
        let cmd = {
            let msg = self.recv.reader().map_err(|e| End::OutOfSync(format!("bad message: {e}")))?;
            let req = msg
                .get_root::<request::Reader>()
                .map_err(|e| End::OutOfSync(format!("bad request: {e}")))?;
            Command::decode(req).map_err(|e| End::OutOfSync(format!("bad request: {e}")))?
        };
        let name = cmd.name();
        let mut bulk = Bulk::new(&mut self.transport, h.bulk_len, &mut self.scratch);
        let result = cmd.apply(&mut self.state, &mut bulk);
        let result = match result {
            Ok(body) => Ok(body),
            Err(Fail::Cuda(e)) => Err(e),
            Err(Fail::Io(e)) => return Err(End::Io(e)),
        };
        if let Err(e) = &result {
            debug!(session = self.id, seq = h.seq, "{name} failed: {e}");
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
    fn reply(&mut self, seq: u64, result: Result<ReplyBody, CuError>) -> Result<(), End> {
        let deferred = self.deferred.take().map_or(0, |e| e.code());
        // Kernel printf output rides on the next reply (CUDA too shows it at
        // synchronisation points).
        let output = self.state.backend.take_output();
        let mark = self.out.len();
        let (code, body) = match result {
            Ok(b) => (0, b),
            Err(e) => (e.code(), ReplyBody::None),
        };
        let bulk_len = match &body {
            ReplyBody::DeviceBytes { len, .. } => *len,
            _ => 0,
        };
        self.encode(seq, code, deferred, &body, bulk_len, &output);
        let ReplyBody::DeviceBytes { src, len, stream } = body else {
            return Ok(());
        };
        // Send everything queued, this reply's header and message, then the
        // bytes as the backend produces them.
        let mut sent = 0u64;
        let (out, transport) = (&mut self.out, &mut self.transport);
        let r = self.state.backend.read(stream, src, len, &mut |chunk| {
            if sent == 0 {
                transport.send(&[out, chunk])?;
                out.clear();
            } else {
                transport.send(&[chunk])?;
            }
            sent += chunk.len() as u64;
            Ok(())
        });
        match r {
            Ok(()) if sent == len => Ok(()),
            Ok(()) => Err(End::Io(io::Error::other("backend produced fewer bytes than asked"))),
            Err(TransferError::Io(e)) => Err(End::Io(e)),
            Err(TransferError::Device(e)) if sent == 0 => {
                // Nothing of this reply went out yet: answer the error instead.
                self.out.truncate(mark);
                self.encode(seq, e.code(), deferred, &ReplyBody::None, 0, &output);
                Ok(())
            }
            Err(TransferError::Device(e)) => Err(End::Io(io::Error::other(format!(
                "device read failed after {sent} of {len} bytes were sent: {e}"
            )))),
        }
    }

    fn encode(&mut self, seq: u64, code: u32, deferred: u32, body: &ReplyBody, bulk_len: u64, output: &[u8]) {
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

/// Runs a session on the calling thread and logs how it ended.
pub fn serve(id: u64, transport: DataTransport, state: SessionState) {
    let peer = transport.peer().to_string();
    debug!(session = id, %peer, "session attached");
    match Session::new(id, transport, state).run() {
        End::Closed => debug!(session = id, %peer, "session closed by the client"),
        End::Io(e) => debug!(session = id, %peer, "session connection ended: {e}"),
        End::OutOfSync(why) => {
            warn!(session = id, %peer, "closing data connection, stream out of sync: {why}")
        }
    }
}
