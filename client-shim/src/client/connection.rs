//! The data plane, client side: one session's framed stream to one server.
//!
//! Asynchronous calls are appended to an output buffer and leave with the
//! next batch (a synchronising call, a read, or a full buffer): they never
//! wait for the network. Synchronising calls flush the batch and read replies
//! until their own arrives; replies to earlier asynchronous device-to-host
//! reads found on the way are written to their host buffers then.
//!
//! So that asynchronous work never waits long for a synchronising call, a
//! flusher thread per connection sends a batch that has sat for
//! [`FLUSH_DELAY`]: the first call of a batch wakes it, the rest only append.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use rgpu_protocol::data_capnp::{reply, request};
use rgpu_protocol::frame::{FrameHeader, Kind, HEADER_LEN, MAX_BULK_LEN};
use rgpu_protocol::message::{Encoder, RecvBuf};
use rgpu_protocol::PROTOCOL_VERSION;
use rgpu_transport::select::DataTransport;
use rgpu_transport::tcp;
use rgpu_transport::Transport;

use super::ClientError;

/// Batches are sent when they reach this size even without a sync point.
const FLUSH_THRESHOLD: usize = 256 << 10;
/// Bulk payloads up to this size are copied into the batch; larger ones are
/// sent straight from the caller's memory.
const INLINE_BULK: usize = 64 << 10;
/// How long a batch may wait for more calls before the flusher sends it;
/// RGPU_FLUSH_DELAY_US overrides it, and 0 turns the flusher off (batches
/// then leave only at synchronising calls or when full).
const FLUSH_DELAY: Duration = Duration::from_micros(200);

fn flush_delay() -> Option<Duration> {
    let d = std::env::var("RGPU_FLUSH_DELAY_US")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_micros)
        .unwrap_or(FLUSH_DELAY);
    (!d.is_zero()).then_some(d)
}
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

pub struct Connection {
    addr: String,
    inner: Arc<Shared>,
}

struct Shared {
    state: Mutex<Inner>,
    /// Signalled when a batch starts (the output buffer stops being empty).
    batch_started: Condvar,
}

struct Inner {
    transport: DataTransport,
    broken: Option<ClientError>,
    out: Vec<u8>,
    enc: Encoder,
    recv: RecvBuf,
    next_seq: u64,
    /// Replies the server owes us, in order.
    pending: VecDeque<Pending>,
    /// An error reported for an asynchronous read, kept for the next sync call.
    deferred: u32,
}

struct Pending {
    seq: u64,
    /// For asynchronous device-to-host reads: where the bytes go.
    dst: Option<(*mut u8, usize)>,
}

// The raw destination pointers are host buffers the CUDA program handed us
// and promised to keep alive until it synchronises, as CUDA requires.
unsafe impl Send for Inner {}

/// Where a synchronous call's reply bulk goes.
pub enum Sink<'a> {
    None,
    Host(&'a mut [u8]),
}

impl Connection {
    /// Attaches the data plane of session `session_id` on `addr`.
    pub fn attach(addr: &str, session_id: u64, key: &[u8]) -> Result<Connection, ClientError> {
        let lost = |e: std::io::Error| ClientError::Unreachable { addr: addr.into(), reason: e.to_string() };
        let mut t = tcp::connect(addr, CONNECT_TIMEOUT).map_err(lost)?;
        // The shim has no flags or files: its knobs are environment variables.
        t.set_spin(tcp::spin_from_env());
        let mut hello = Vec::with_capacity(8 + 8 + key.len());
        hello.extend_from_slice(super::transport_select::preamble());
        hello.extend_from_slice(&session_id.to_le_bytes());
        hello.extend_from_slice(key);
        t.send(&[&hello]).map_err(lost)?;
        let mut answer = [0u8; 8];
        t.recv_exact(&mut answer).map_err(lost)?;
        let status = u32::from_le_bytes(answer[..4].try_into().unwrap());
        let version = u32::from_le_bytes(answer[4..].try_into().unwrap());
        if version != PROTOCOL_VERSION {
            return Err(ClientError::VersionMismatch { addr: addr.into(), ours: PROTOCOL_VERSION, theirs: version });
        }
        if status != 0 {
            return Err(ClientError::Unreachable {
                addr: addr.into(),
                reason: format!("server refused the session (status {status})"),
            });
        }
        let t = super::transport_select::upgrade(t, session_id).map_err(lost)?;
        let shared = Arc::new(Shared {
            batch_started: Condvar::new(),
            state: Mutex::new(Inner {
                transport: t,
                broken: None,
                out: Vec::with_capacity(FLUSH_THRESHOLD * 2),
                enc: Encoder::default(),
                recv: RecvBuf::default(),
                next_seq: 1,
                pending: VecDeque::new(),
                deferred: 0,
            }),
        });
        if let Some(delay) = flush_delay() {
            let flusher = shared.clone();
            let name = addr.to_string();
            std::thread::Builder::new()
                .name("rgpu-flush".into())
                .spawn(move || flush_loop(&flusher, &name, delay))
                .map_err(|e| ClientError::Unreachable { addr: addr.into(), reason: format!("cannot start a thread: {e}") })?;
        }
        Ok(Connection { addr: addr.into(), inner: shared })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Inner>, ClientError> {
        // A panic while holding the lock poisons it; the connection state may
        // then be mid-frame, so treat it as lost rather than guess.
        let g = self.inner.state.lock().map_err(|_| ClientError::Lost {
            addr: self.addr.clone(),
            reason: "internal error while sending (lock poisoned)".into(),
        })?;
        match &g.broken {
            Some(e) => Err(e.clone()),
            None => Ok(g),
        }
    }

    /// Sends an asynchronous request: no reply, errors come back deferred.
    pub fn post(&self, build: impl FnOnce(request::Builder<'_>), bulk: &[u8]) -> Result<(), ClientError> {
        let mut g = self.lock()?;
        let was_empty = g.out.is_empty();
        let r = g.queue(false, build, bulk).and_then(|_| {
            if g.out.len() >= FLUSH_THRESHOLD {
                g.flush()
            } else {
                Ok(())
            }
        });
        let starts_batch = was_empty && !g.out.is_empty();
        let r = g.check(&self.addr, r);
        drop(g);
        if starts_batch {
            self.inner.batch_started.notify_one();
        }
        r
    }

    /// Sends an asynchronous device-to-host read whose bytes land in `dst`
    /// when a later synchronising call collects the reply.
    ///
    /// # Safety
    /// `dst` must stay valid until the next synchronising call returns.
    pub unsafe fn post_read(&self, build: impl FnOnce(request::Builder<'_>), dst: *mut u8, len: usize) -> Result<(), ClientError> {
        let mut g = self.lock()?;
        let r = g.queue(true, build, &[]).and_then(|seq| {
            // Start the transfer now so it overlaps with the caller's work.
            g.flush()?;
            g.pending.push_back(Pending { seq, dst: Some((dst, len)) });
            Ok(())
        });
        g.check(&self.addr, r)
    }

    /// Sends a request and waits for its reply; `read` sees the reply once
    /// its result (and any deferred error) was success.
    pub fn call<R>(
        &self,
        build: impl FnOnce(request::Builder<'_>),
        bulk: &[u8],
        sink: Sink<'_>,
        read: impl FnOnce(reply::Reader<'_>) -> Result<R, ClientError>,
    ) -> Result<R, ClientError> {
        let mut g = self.lock()?;
        let r = g
            .queue(true, build, bulk)
            .and_then(|seq| {
                g.flush()?;
                g.pending.push_back(Pending { seq, dst: None });
                g.wait_for(seq, sink)
            });
        g.check(&self.addr, r)?;
        let early = std::mem::take(&mut g.deferred);
        let msg = g.recv.reader().map_err(|e| protocol(&self.addr, e))?;
        let reply = msg.get_root::<reply::Reader>().map_err(|e| protocol(&self.addr, e))?;
        if reply.get_result() != 0 {
            return Err(ClientError::Cuda(reply.get_result()));
        }
        // An asynchronous request failed since the last reply: report it at
        // this synchronising call, as CUDA does.
        let deferred = if early != 0 { early } else { reply.get_deferred_error() };
        if deferred != 0 {
            return Err(ClientError::Cuda(deferred));
        }
        read(reply)
    }

    /// Sends whatever is batched.
    pub fn flush(&self) -> Result<(), ClientError> {
        let mut g = self.lock()?;
        let r = g.flush();
        g.check(&self.addr, r)
    }
}

/// The flusher: waits for a batch to start, lets it grow for FLUSH_DELAY,
/// then sends what has accumulated, unless a synchronising call did first.
fn flush_loop(shared: &Shared, addr: &str, delay: Duration) {
    loop {
        let Ok(mut g) = shared.state.lock() else { return };
        while g.out.is_empty() && g.broken.is_none() {
            g = match shared.batch_started.wait(g) {
                Ok(g) => g,
                Err(_) => return,
            };
        }
        if g.broken.is_some() {
            return;
        }
        drop(g);
        std::thread::sleep(delay);
        let Ok(mut g) = shared.state.lock() else { return };
        if g.broken.is_none() && !g.out.is_empty() {
            let r = g.flush();
            let _ = g.check(addr, r);
        }
    }
}

fn protocol(addr: &str, e: impl std::fmt::Display) -> ClientError {
    ClientError::Protocol { addr: addr.into(), reason: e.to_string() }
}

enum IoFail {
    Io(std::io::Error),
    Protocol(String),
}

impl From<std::io::Error> for IoFail {
    fn from(e: std::io::Error) -> Self {
        IoFail::Io(e)
    }
}

impl Inner {
    /// Turns an I/O failure into a permanent "connection lost": after a
    /// partial frame the stream cannot be trusted, and every later call
    /// must fail at once instead of hanging.
    fn check<T>(&mut self, addr: &str, r: Result<T, IoFail>) -> Result<T, ClientError> {
        match r {
            Ok(v) => Ok(v),
            Err(f) => {
                let err = match f {
                    IoFail::Io(e) => ClientError::Lost { addr: addr.into(), reason: e.to_string() },
                    IoFail::Protocol(reason) => ClientError::Protocol { addr: addr.into(), reason },
                };
                tracing::error!("{err}; every later call to this device fails");
                eprintln!("rgpu: {err}");
                self.transport.shutdown();
                self.broken = Some(err.clone());
                Err(err)
            }
        }
    }

    fn queue(&mut self, wants_reply: bool, build: impl FnOnce(request::Builder<'_>), bulk: &[u8]) -> Result<u64, IoFail> {
        if bulk.len() as u64 > MAX_BULK_LEN {
            return Err(IoFail::Protocol(format!("payload of {} bytes exceeds one frame", bulk.len())));
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let at = self.out.len();
        self.out.extend_from_slice(&[0u8; HEADER_LEN]);
        let n = self.enc.request(&mut self.out, build);
        let h = FrameHeader::request(seq, wants_reply, n, bulk.len() as u64).encode();
        self.out[at..at + HEADER_LEN].copy_from_slice(&h);
        if bulk.len() <= INLINE_BULK {
            self.out.extend_from_slice(bulk);
        } else {
            // Large payloads go out from the caller's buffer, behind the batch
            // (after the replies the server may be blocked writing: see flush).
            self.drain()?;
            self.transport.send(&[&self.out, bulk])?;
            self.out.clear();
        }
        Ok(seq)
    }

    /// Sends the batch. Replies still owed (to asynchronous reads, whose
    /// requests all went out already) are collected first: the server may be
    /// blocked writing them, and if neither side read, both would stall on
    /// full socket buffers.
    fn flush(&mut self) -> Result<(), IoFail> {
        if !self.out.is_empty() {
            self.drain()?;
            self.transport.send(&[&self.out])?;
            self.out.clear();
        }
        Ok(())
    }

    /// Reads replies in order until the one for `seq`, whose message is left
    /// in `self.recv`.
    fn wait_for(&mut self, seq: u64, mut sink: Sink<'_>) -> Result<(), IoFail> {
        while !self.read_one(Some((seq, &mut sink)))? {}
        Ok(())
    }

    /// Reads every reply still owed (asynchronous reads land in their buffers).
    fn drain(&mut self) -> Result<(), IoFail> {
        while !self.pending.is_empty() {
            self.read_one(None)?;
        }
        Ok(())
    }

    /// Reads the next reply; true if it was `target`'s.
    fn read_one(&mut self, target: Option<(u64, &mut Sink<'_>)>) -> Result<bool, IoFail> {
        let mut hb = [0u8; HEADER_LEN];
        self.transport.recv_exact(&mut hb)?;
        let h = FrameHeader::decode(&hb).map_err(|e| IoFail::Protocol(e.to_string()))?;
        if h.kind != Kind::Reply {
            return Err(IoFail::Protocol("server sent a request frame".into()));
        }
        let p = self
            .pending
            .pop_front()
            .ok_or_else(|| IoFail::Protocol(format!("unexpected reply #{}", h.seq)))?;
        if p.seq != h.seq {
            return Err(IoFail::Protocol(format!("reply #{} arrived while #{} was due", h.seq, p.seq)));
        }
        let buf = self.recv.prepare(h.msg_len as usize);
        self.transport.recv_exact(buf)?;
        if let Ok(msg) = self.recv.reader() {
            if let Ok(r) = msg.get_root::<reply::Reader>() {
                super::output::write_reply_output(&r);
            }
        }
        let bulk = h.bulk_len as usize;
        match (p.dst, target) {
            (Some((dst, len)), _) => {
                // An earlier asynchronous read.
                if bulk == len {
                    let d = unsafe { std::slice::from_raw_parts_mut(dst, len) };
                    self.transport.recv_exact(d)?;
                } else {
                    self.discard(bulk)?;
                }
                let code = reply_code(&self.recv).map_err(IoFail::Protocol)?;
                if code != 0 && self.deferred == 0 {
                    self.deferred = code;
                } else if code == 0 && bulk != len {
                    return Err(IoFail::Protocol(format!("read of {len} bytes answered with {bulk}")));
                }
                Ok(false)
            }
            (None, Some((seq, sink))) if p.seq == seq => {
                match sink {
                    Sink::Host(d) if d.len() == bulk => self.transport.recv_exact(d)?,
                    _ => {
                        self.discard(bulk)?;
                        if bulk != 0 && reply_code(&self.recv).map_err(IoFail::Protocol)? == 0 {
                            return Err(IoFail::Protocol(format!("unexpected {bulk} bulk bytes")));
                        }
                    }
                }
                Ok(true)
            }
            (None, _) => {
                self.discard(bulk)?;
                Ok(false)
            }
        }
    }

    fn discard(&mut self, mut n: usize) -> Result<(), IoFail> {
        let mut scratch = [0u8; 4096];
        while n > 0 {
            let k = n.min(scratch.len());
            self.transport.recv_exact(&mut scratch[..k])?;
            n -= k;
        }
        Ok(())
    }
}

fn reply_code(recv: &RecvBuf) -> Result<u32, String> {
    let msg = recv.reader().map_err(|e| e.to_string())?;
    let r = msg.get_root::<reply::Reader>().map_err(|e| e.to_string())?;
    Ok(if r.get_result() != 0 { r.get_result() } else { r.get_deferred_error() })
}
