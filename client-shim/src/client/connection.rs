//! The data plane, client side: one session's framed stream to one server.
//!
//! This is the I/O shell around [`SessionCore`], which holds all of the
//! protocol (sequence numbers, owed replies, deferred errors, batching, where
//! reply bulk lands) and does no I/O. The shell moves bytes between the core
//! and a [`Transport`] with blocking calls on the caller's own thread, and
//! runs the flusher.
//!
//! Asynchronous calls are appended to the batch and leave with the next
//! batch (a synchronising call, a read, or a full buffer): they never wait
//! for the network. Synchronising calls flush the batch and read replies
//! until their own arrives; replies to earlier asynchronous device-to-host
//! reads found on the way are written to their host buffers then.
//!
//! So that asynchronous work never waits long for a synchronising call, a
//! flusher thread per connection sends a batch that has sat for the flush
//! delay (200 µs; RGPU_FLUSH_DELAY_US, 0 turns the flusher off): the first
//! call of a batch wakes it, the rest only append.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rgpu_protocol::data_capnp::{reply, request};
use rgpu_protocol::PROTOCOL_VERSION;
use rgpu_transport::select::DataTransport;
use rgpu_transport::tcp;
use rgpu_transport::Transport;

use super::session_core::{Completed, ProtocolError, Queued, SessionCore, Then, TooLarge, Tuning};
use super::ClientError;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// CUDA_ERROR_INVALID_VALUE, for a request the frame format cannot carry.
const INVALID_VALUE: u32 = 1;

pub struct Connection<T: Transport = DataTransport> {
    addr: String,
    inner: Arc<Shared<T>>,
    /// The session this connection carries: every event of its calls and of
    /// its flusher is logged in it (debug level; a disabled span costs one
    /// check to enter).
    span: tracing::Span,
}

struct Shared<T> {
    state: Mutex<Inner<T>>,
    /// Signalled when a batch starts (and when the connection is dropped).
    batch_started: Condvar,
}

struct Inner<T> {
    transport: T,
    core: SessionCore,
    broken: Option<ClientError>,
    /// The Connection was dropped: the flusher sends what is left and ends.
    closed: bool,
}

/// Where a synchronous call's reply bulk goes.
pub enum Sink<'a> {
    None,
    Host(&'a mut [u8]),
}

impl Connection<DataTransport> {
    /// Attaches the data plane of session `session_id` on `addr`.
    pub fn attach(addr: &str, session_id: u64, key: &[u8]) -> Result<Connection, ClientError> {
        let lost = |e: std::io::Error| ClientError::Unreachable { addr: addr.into(), reason: e.to_string() };
        let t = tcp::connect(addr, CONNECT_TIMEOUT).map_err(lost)?;
        let mut t = super::security::secure(t, addr, CONNECT_TIMEOUT)?;
        // The shim has no flags or files: its knobs are environment variables.
        t.set_spin(tcp::spin_from_env());
        let mut hello = Vec::with_capacity(8 + 8 + key.len());
        hello.extend_from_slice(super::transport_select::preamble());
        hello.extend_from_slice(&session_id.to_le_bytes());
        hello.extend_from_slice(key);
        t.send(&[&hello]).map_err(lost)?;
        let mut answer = [0u8; 8];
        t.recv_exact(&mut answer).map_err(lost)?;
        super::security::check_answer(addr, &answer)?;
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
        let conn = Connection::over(t, addr)?;
        conn.span.record("id", tracing::field::display(format_args!("{session_id:#x}")));
        Ok(conn)
    }
}

impl<T: Transport + 'static> Connection<T> {
    /// Runs the data plane over an attached `transport`, with the batching
    /// knobs from the environment.
    pub fn over(transport: T, addr: &str) -> Result<Self, ClientError> {
        Self::with_tuning(transport, addr, Tuning::from_env())
    }

    pub fn with_tuning(transport: T, addr: &str, tuning: Tuning) -> Result<Self, ClientError> {
        let shared = Arc::new(Shared {
            batch_started: Condvar::new(),
            state: Mutex::new(Inner { transport, core: SessionCore::new(tuning), broken: None, closed: false }),
        });
        let span = tracing::debug_span!("session", server = %addr, id = tracing::field::Empty);
        if tuning.flush_delay.is_some() {
            let flusher = shared.clone();
            let name = addr.to_string();
            let flusher_span = span.clone();
            std::thread::Builder::new()
                .name("rgpu-flush".into())
                .spawn(move || flusher_span.in_scope(|| flush_loop(&flusher, &name)))
                .map_err(|e| ClientError::Unreachable { addr: addr.into(), reason: format!("cannot start a thread: {e}") })?;
        }
        Ok(Connection { addr: addr.into(), inner: shared, span })
    }
}

impl<T: Transport> Connection<T> {
    // Kept for the driver API layer even while no call site needs it.
    #[allow(dead_code)]
    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn lock(&self) -> Result<MutexGuard<'_, Inner<T>>, ClientError> {
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
        let _in_session = self.span.enter();
        let mut g = self.lock()?;
        let q = g.core.post(build, bulk).map_err(too_large)?;
        let mut wake = false;
        let r = match q.then {
            Then::Keep { starts_batch } => {
                if starts_batch && g.core.tuning().flush_delay.is_some() {
                    g.core.arm(Instant::now());
                    wake = true;
                }
                Ok(())
            }
            _ => g.dispatch(q, bulk),
        };
        let r = g.check(&self.addr, r);
        drop(g);
        if wake {
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
        let _in_session = self.span.enter();
        let mut g = self.lock()?;
        // SAFETY: the caller keeps dst valid until a synchronising call has
        // collected the reply; if the connection breaks first, check()
        // makes the core forget it.
        let q = unsafe { g.core.post_read(build, dst, len) };
        let r = g.dispatch(q, &[]);
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
        let _in_session = self.span.enter();
        let mut g = self.lock()?;
        let dst: &mut [u8] = match sink {
            Sink::None => &mut [],
            Sink::Host(d) => d,
        };
        // SAFETY: the lock is held until the reply completed, or until
        // check() made the core forget `dst` after a failure.
        let q = unsafe { g.core.call(build, bulk, dst) }.map_err(too_large)?;
        let r = g.dispatch(q, bulk).and_then(|_| g.wait_for(q.seq));
        let result = g.check(&self.addr, r)?;
        if result != 0 {
            return Err(ClientError::Cuda(result));
        }
        g.core.with_reply(read).map_err(|e| protocol(&self.addr, e))?
    }

    /// Sends whatever is batched.
    #[allow(dead_code)]
    pub fn flush(&self) -> Result<(), ClientError> {
        let _in_session = self.span.enter();
        let mut g = self.lock()?;
        let r = g.flush_with(&[]);
        g.check(&self.addr, r)
    }
}

impl<T: Transport> Drop for Connection<T> {
    fn drop(&mut self) {
        if let Ok(mut g) = self.inner.state.lock() {
            g.closed = true;
        }
        self.inner.batch_started.notify_one();
    }
}

/// The flusher: waits for a batch to start, lets it grow until its flush
/// deadline, then sends what has accumulated, unless a synchronising call
/// did first.
fn flush_loop<T: Transport>(shared: &Shared<T>, addr: &str) {
    let Ok(mut g) = shared.state.lock() else { return };
    loop {
        if g.broken.is_some() {
            return;
        }
        match g.core.flush_deadline() {
            None if g.closed => return,
            None => {
                g = match shared.batch_started.wait(g) {
                    Ok(g) => g,
                    Err(_) => return,
                };
            }
            Some(deadline) => {
                let now = Instant::now();
                if g.core.flush_due(now) {
                    let r = g.flush_with(&[]);
                    let _ = g.check(addr, r);
                    continue;
                }
                drop(g);
                std::thread::sleep(deadline - now);
                g = match shared.state.lock() {
                    Ok(g) => g,
                    Err(_) => return,
                };
            }
        }
    }
}

fn protocol(addr: &str, e: impl std::fmt::Display) -> ClientError {
    ClientError::Protocol { addr: addr.into(), reason: e.to_string() }
}

/// Nothing was queued, so the connection stays usable: the call is invalid.
fn too_large(e: TooLarge) -> ClientError {
    tracing::warn!("{e}");
    ClientError::Cuda(INVALID_VALUE)
}

enum IoFail {
    Io(std::io::Error),
    Protocol(ProtocolError),
}

impl From<std::io::Error> for IoFail {
    fn from(e: std::io::Error) -> Self {
        IoFail::Io(e)
    }
}

impl From<ProtocolError> for IoFail {
    fn from(e: ProtocolError) -> Self {
        IoFail::Protocol(e)
    }
}

impl<T: Transport> Inner<T> {
    /// Turns an I/O failure into a permanent "connection lost": after a
    /// partial frame the stream cannot be trusted, and every later call
    /// must fail at once instead of hanging.
    fn check<V>(&mut self, addr: &str, r: Result<V, IoFail>) -> Result<V, ClientError> {
        match r {
            Ok(v) => Ok(v),
            Err(f) => {
                let err = match f {
                    IoFail::Io(e) => ClientError::Lost { addr: addr.into(), reason: e.to_string() },
                    IoFail::Protocol(e) => protocol(addr, e),
                };
                tracing::error!("{err}; every later call to this device fails");
                eprintln!("rgpu: {err}");
                self.transport.shutdown();
                // Host buffers named by owed replies may be freed once the
                // failed call returns: nothing may write to them later.
                self.core.abandon();
                self.broken = Some(err.clone());
                Err(err)
            }
        }
    }

    /// Does what the core asked for after queueing `q`.
    fn dispatch(&mut self, q: Queued, bulk: &[u8]) -> Result<(), IoFail> {
        match q.then {
            Then::Keep { .. } => Ok(()),
            Then::Flush => self.flush_with(&[]),
            Then::FlushWithBulk => self.flush_with(bulk),
        }
    }

    /// Sends the batch, then `tail` (a large payload, from the caller's
    /// memory) in the same send. Replies owed to requests already sent are
    /// received first (the core's rule: see session_core).
    fn flush_with(&mut self, tail: &[u8]) -> Result<(), IoFail> {
        if self.core.batch().is_empty() {
            return Ok(());
        }
        while self.core.replies_due() > 0 {
            self.receive()?;
        }
        if tail.is_empty() {
            self.transport.send(&[self.core.batch()])?;
        } else {
            self.transport.send(&[self.core.batch(), tail])?;
        }
        self.core.sent();
        Ok(())
    }

    /// Reads replies until the call `seq`'s; returns its result.
    fn wait_for(&mut self, seq: u64) -> Result<u32, IoFail> {
        loop {
            if let Completed::Call { seq: s, result, .. } = self.receive()? {
                debug_assert_eq!(s, seq);
                return Ok(result);
            }
        }
    }

    /// Reads one whole reply.
    fn receive(&mut self) -> Result<Completed, IoFail> {
        loop {
            let buf = self.core.recv_buf();
            let n = buf.len();
            self.transport.recv_exact(buf)?;
            if let Some(done) = self.core.recv_advance(n)? {
                if let Completed::Read { output: true, .. } | Completed::Call { output: true, .. } = done {
                    let _ = self.core.with_reply(|r| super::output::write_reply_output(&r));
                }
                return Ok(done);
            }
        }
    }
}
