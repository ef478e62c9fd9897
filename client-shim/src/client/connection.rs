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
//! call of a batch wakes it, the rest only append. The same thread pings a
//! connection that has been idle for [`IDLE_PING`], so the server can tell a
//! quiet program from a stopped one.
//!
//! A connection that breaks (an I/O error, or a read or send waiting past
//! `RGPU_SERVER_TIMEOUT`) is resumed when it can be: the shell dials again
//! ([`super::redial`]), the core works out what to receive and send again,
//! and the call that saw the break goes on as if nothing happened. Only when
//! the session cannot be resumed within the bounds does that call, and
//! every later one, fail. The orderly end (Drop, or [`Connection::close`]
//! at exit) sends a Close frame, so the server frees the session at once
//! instead of keeping it for a reconnection.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use rgpu_protocol::data_capnp::{reply, request};
use rgpu_protocol::frame::{FrameHeader, Kind};
use rgpu_protocol::PROTOCOL_VERSION;
use rgpu_transport::select::DataTransport;
use rgpu_transport::tcp;
use rgpu_transport::Transport;

use super::redial::{Policy, Redial, Redialed, TcpRedial};
use super::session_core::{Completed, ProtocolError, SessionCore, Then, TooLarge, Tuning};
use super::ClientError;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection with no traffic for this long is pinged (the server counts
/// a client silent for --client-timeout, 60 s by default, as gone).
pub const IDLE_PING: Duration = Duration::from_secs(10);

/// CUDA_ERROR_INVALID_VALUE, for a request the frame format cannot carry.
const INVALID_VALUE: u32 = 1;
/// CUDA_ERROR_DEINITIALIZED, for a call after the session was closed.
const DEINITIALIZED: u32 = 4;
/// How often a suspended session's server is asked again: a resumed lease
/// is back within this.
const SUSPENDED_POLL: Duration = Duration::from_millis(500);
/// How long after a "held" answer the server is asked again when it waited
/// before answering (a checkpoint or a move under way: it may end any
/// moment). A server that answered at once holds a session checkpointed
/// out, waiting for its restore: it is asked less and less often, up to
/// [`SUSPENDED_POLL`].
const HELD_POLL: Duration = Duration::from_millis(10);
/// A "held" answer that came sooner than this came at once.
const HELD_AT_ONCE: Duration = Duration::from_millis(100);

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
    /// How a broken connection comes back; None: it does not.
    redial: Option<Box<dyn Redial<T>>>,
    policy: Policy,
    /// The last time bytes went either way.
    active_at: Instant,
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
        let policy = Policy::from_env();
        t.stream().set_read_timeout(Some(policy.server_timeout)).map_err(lost)?;
        t.stream().set_write_timeout(Some(policy.server_timeout)).map_err(lost)?;
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
        let redial = TcpRedial { addr: addr.into(), session_id, key: key.to_vec(), server_timeout: policy.server_timeout };
        let conn = Connection::resumable(t, addr, Tuning::from_env(), Box::new(redial), policy)?;
        conn.span.record("id", tracing::field::display(format_args!("{session_id:#x}")));
        Ok(conn)
    }
}

impl<T: Transport + 'static> Connection<T> {
    /// Runs the data plane over an attached `transport`, with the batching
    /// knobs from the environment, without resuming.
    #[allow(dead_code)]
    pub fn over(transport: T, addr: &str) -> Result<Self, ClientError> {
        Self::with_tuning(transport, addr, Tuning::from_env())
    }

    #[cfg_attr(not(test), allow(dead_code))]
    pub fn with_tuning(transport: T, addr: &str, tuning: Tuning) -> Result<Self, ClientError> {
        Self::build(transport, addr, tuning, None, Policy::default())
    }

    /// As [`Connection::with_tuning`], resuming through `redial` when the
    /// connection breaks, within `policy`'s bounds.
    pub fn resumable(transport: T, addr: &str, tuning: Tuning, redial: Box<dyn Redial<T>>, policy: Policy) -> Result<Self, ClientError> {
        let redial = (!policy.reconnect_timeout.is_zero() && policy.attempts > 0).then_some(redial);
        Self::build(transport, addr, tuning, redial, policy)
    }

    fn build(transport: T, addr: &str, tuning: Tuning, redial: Option<Box<dyn Redial<T>>>, policy: Policy) -> Result<Self, ClientError> {
        let inner = Inner {
            transport,
            core: SessionCore::new(tuning),
            broken: None,
            closed: false,
            redial,
            policy,
            active_at: Instant::now(),
        };
        let shared = Arc::new(Shared { batch_started: Condvar::new(), state: Mutex::new(inner) });
        let span = tracing::debug_span!("session", server = %addr, id = tracing::field::Empty);
        let pings = shared.state.lock().map(|g| g.redial.is_some()).unwrap_or(false);
        if tuning.flush_delay.is_some() || pings {
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
        if g.closed {
            // The session was closed at exit, and the runtime's own exit
            // handlers (registered before ours, so run after) still call
            // in: answer as a driver shutting down does, and leave the
            // stream the Close frame ended alone, so nothing reports a lost
            // connection.
            return Err(ClientError::Cuda(DEINITIALIZED));
        }
        match &g.broken {
            Some(e) => Err(e.clone()),
            None => Ok(g),
        }
    }

    /// Sends an asynchronous request: no reply, errors come back deferred.
    pub fn post(&self, build: impl FnOnce(request::Builder<'_>), bulk: &[u8]) -> Result<(), ClientError> {
        let _in_session = self.span.enter();
        let mut g = self.lock()?;
        let r = g.ack_if_full(&self.addr, bulk.len());
        g.check(&self.addr, r)?;
        let q = g.core.post(build, bulk).map_err(too_large)?;
        self.follow(g, q.then, bulk)
    }

    /// Does what the core said once a post was queued, and releases the lock.
    fn follow(&self, mut g: MutexGuard<'_, Inner<T>>, then: Then, bulk: &[u8]) -> Result<(), ClientError> {
        let mut wake = false;
        let r = match then {
            Then::Keep { starts_batch } => {
                if starts_batch && g.core.tuning().flush_delay.is_some() {
                    g.core.arm(Instant::now());
                    wake = true;
                }
                Ok(())
            }
            // The caller's bytes are not kept: the post waits for its reply.
            Then::FlushWithBulk => g.retrying(&self.addr, bulk, |g, tail| g.drain(tail)),
            Then::Flush => g.retrying(&self.addr, &[], |g, _| g.flush_with(&[])),
            // The window points to the caller's bytes: nobody waits.
            Then::FlushBorrowed => g.retrying(&self.addr, bulk, |g, tail| g.flush_with(tail)),
        };
        let r = g.check(&self.addr, r);
        drop(g);
        if wake {
            self.inner.batch_started.notify_one();
        }
        r
    }

    /// Sends an asynchronous request whose payload the program keeps
    /// unchanged until the request completed (an asynchronous copy from
    /// page-locked memory): a large one is sent from `bulk` and waits for
    /// nothing; the resend window points to it until a reply acknowledges it.
    ///
    /// # Safety
    /// `bulk` must stay valid and unchanged until a later reply (any
    /// synchronising call's) has been received.
    pub unsafe fn post_borrowed(&self, build: impl FnOnce(request::Builder<'_>), bulk: &[u8]) -> Result<(), ClientError> {
        let _in_session = self.span.enter();
        let mut g = self.lock()?;
        if g.core.needs_ack_borrowed(bulk.len()) {
            let r = g.retrying(&self.addr, &[], |g, _| g.ack());
            g.check(&self.addr, r)?;
        }
        // SAFETY: passed on from the caller.
        let q = unsafe { g.core.post_borrowed(build, bulk) }.map_err(too_large)?;
        self.follow(g, q.then, bulk)
    }

    /// Acknowledges every request sent if the window points to any
    /// program buffer: before page-locked memory is freed or unregistered,
    /// no resend may read it again.
    pub fn release_borrowed(&self) -> Result<(), ClientError> {
        let mut g = self.lock()?;
        if g.core.borrowed() == 0 {
            return Ok(());
        }
        let r = g.retrying(&self.addr, &[], |g, _| g.ack());
        g.check(&self.addr, r)
    }

    /// Sends an asynchronous device-to-host read whose bytes land in `dst`
    /// when a later synchronising call collects the reply.
    ///
    /// # Safety
    /// `dst` must stay valid until the next synchronising call returns.
    pub unsafe fn post_read(&self, build: impl FnOnce(request::Builder<'_>), dst: *mut u8, len: usize) -> Result<(), ClientError> {
        let _in_session = self.span.enter();
        let mut g = self.lock()?;
        let r = g.ack_if_full(&self.addr, 0);
        g.check(&self.addr, r)?;
        // SAFETY: the caller keeps dst valid until a synchronising call has
        // collected the reply; if the connection breaks for good first,
        // check() makes the core forget it.
        let _ = unsafe { g.core.post_read(build, dst, len) };
        let r = g.retrying(&self.addr, &[], |g, _| g.flush_with(&[]));
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
        let r = g.retrying(&self.addr, bulk, |g, tail| {
            g.flush_with(tail)?;
            g.wait_for(q.seq)
        });
        let result = g.check(&self.addr, r)?;
        if result != 0 {
            return Err(ClientError::Cuda(result));
        }
        g.core.with_reply(read).map_err(|e| protocol(&self.addr, e))?
    }

    /// As [`Self::call`] for a request that releases something and answers nothing else:
    /// `Ok(0)` when the server did it, and `Ok(code)` when it did it but an older
    /// asynchronous error came back with the reply (the caller returns `code`, as CUDA
    /// does, after forgetting what the server released: its tables must follow the
    /// server's, not the error).
    pub fn call_releasing(&self, build: impl FnOnce(request::Builder<'_>)) -> Result<u32, ClientError> {
        let _in_session = self.span.enter();
        let mut g = self.lock()?;
        // SAFETY: no host buffer is named.
        let q = unsafe { g.core.call(build, &[], &mut []) }.map_err(too_large)?;
        let r = g.retrying(&self.addr, &[], |g, tail| {
            g.flush_with(tail)?;
            g.wait_for(q.seq)
        });
        let result = g.check(&self.addr, r)?;
        if result == 0 {
            return Ok(0);
        }
        let own = g.core.with_reply(|r| r.get_result()).map_err(|e| protocol(&self.addr, e))?;
        if own == 0 {
            Ok(result)
        } else {
            Err(ClientError::Cuda(result))
        }
    }

    /// Sends whatever is batched.
    #[allow(dead_code)]
    pub fn flush(&self) -> Result<(), ClientError> {
        let _in_session = self.span.enter();
        let mut g = self.lock()?;
        let r = g.retrying(&self.addr, &[], |g, _| g.flush_with(&[]));
        g.check(&self.addr, r)
    }

    /// The orderly end: sends what is batched, then the Close frame, so the
    /// server frees the session at once. Skipped (the server then keeps the
    /// session for its reconnect grace) when another thread is inside a
    /// call, as at a process exit with threads still running.
    pub fn close(&self) {
        let mut g = match self.inner.state.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return,
        };
        if g.closed {
            return;
        }
        g.closed = true;
        if g.broken.is_none() {
            // No reconnection at the end: the server frees what it has.
            g.redial = None;
            if g.flush_with(&[]).is_ok() {
                let _ = g.transport.send(&[&FrameHeader::bare(Kind::Close).encode()]);
            }
            g.transport.shutdown();
        }
        drop(g);
        self.inner.batch_started.notify_one();
    }
}

impl<T: Transport> Drop for Connection<T> {
    fn drop(&mut self) {
        self.close();
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
                let idle = g.active_at.elapsed();
                if idle >= IDLE_PING && g.redial.is_some() {
                    // Nothing owed and nothing batched (no deadline): a ping
                    // shows the server this client is alive.
                    let r = g.retrying(addr, &[], |g, _| g.ack());
                    let _ = g.check(addr, r);
                    continue;
                }
                g = match shared.batch_started.wait_timeout(g, IDLE_PING - idle) {
                    Ok((g, _)) => g,
                    Err(_) => return,
                };
            }
            Some(deadline) => {
                let now = Instant::now();
                if g.core.flush_due(now) {
                    let r = g.retrying(addr, &[], |g, _| g.flush_with(&[]));
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

    /// Runs `op` (which sends and receives through the core, so it can be
    /// run again), resuming the connection and running it again when it
    /// breaks. `tail`: the caller's payload, sent behind the batch when
    /// the core says so.
    fn retrying<V>(&mut self, addr: &str, tail: &[u8], mut op: impl FnMut(&mut Self, &[u8]) -> Result<V, IoFail>) -> Result<V, IoFail> {
        // A server that takes the resume and then breaks again every time
        // must not keep one call going for ever.
        let mut resumes = 0;
        loop {
            match op(self, tail) {
                Err(IoFail::Io(e)) if self.redial.is_some() && resumes < self.policy.attempts => {
                    resumes += 1;
                    self.recover(addr, e)?
                }
                r => return r,
            }
        }
    }

    /// Dials the session again until it resumes, within the policy's time
    /// and attempts; the core then knows what to receive and send again.
    fn recover(&mut self, addr: &str, broke: std::io::Error) -> Result<(), IoFail> {
        self.transport.shutdown();
        let policy = self.policy;
        let Some(redial) = self.redial.as_mut() else { return Err(IoFail::Io(broke)) };
        tracing::warn!("connection to {addr} broke ({broke}); resuming the session");
        let mut start = Instant::now();
        let mut backoff = Duration::from_millis(20);
        let mut last = broke.to_string();
        let mut attempt = 0;
        // Since when the server has said, and what: the lease is
        // suspended, or the session held for a checkpoint or a move.
        let mut waiting: Option<(Instant, Redialed)> = None;
        let mut held_pause = HELD_POLL;
        while attempt < policy.attempts {
            let left = policy.reconnect_timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                break;
            }
            let dialled = Instant::now();
            match redial.redial(self.core.last_reply(), left) {
                Ok((t, executed)) => {
                    self.core.resume(executed)?;
                    self.transport = t;
                    self.active_at = Instant::now();
                    match waiting {
                        Some((since, Redialed::Suspended)) => {
                            tracing::info!("the session's lease was resumed after {:?} suspended", since.elapsed())
                        }
                        Some((since, _)) => tracing::info!("the server let the session go on after holding it {:?}", since.elapsed()),
                        None => {}
                    }
                    tracing::info!(
                        "session resumed on {addr} after {:?} ({} attempt(s)); the server had run requests up to #{executed}",
                        start.elapsed(),
                        attempt + 1
                    );
                    return Ok(());
                }
                Err(Redialed::Refused(why)) => {
                    return Err(IoFail::Io(std::io::Error::other(format!("{last}; the server refused to resume the session: {why}"))));
                }
                Err(said @ (Redialed::Suspended | Redialed::Held)) => {
                    let suspended = matches!(said, Redialed::Suspended);
                    let (bound, what, var) = if suspended {
                        (policy.suspend_timeout, "the session's lease is suspended (preempted by a lease of higher priority)", "RGPU_SUSPEND_TIMEOUT")
                    } else {
                        (policy.hold_timeout, "the server holds the session (checkpointed, or being moved)", "RGPU_HOLD_TIMEOUT")
                    };
                    // A session held, then suspended (a preemption's
                    // checkpoint), starts the longer wait afresh.
                    let fresh = !matches!(&waiting, Some((_, w)) if matches!(w, Redialed::Suspended) == suspended);
                    if fresh {
                        tracing::warn!("{what}; waiting up to {bound:?} for it to go on ({var})");
                        waiting = Some((Instant::now(), said));
                    }
                    let waited = waiting.as_ref().map_or(Duration::ZERO, |(since, _)| since.elapsed());
                    if waited >= bound {
                        let how = if suspended { "the session's lease stayed suspended" } else { "the server held the session" };
                        return Err(IoFail::Io(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!("{last}; {how} for {waited:?} ({var})"),
                        )));
                    }
                    // The server answered: the reconnect bounds are for a
                    // silent one, and start again from here. A held
                    // session's server waited before answering, so the next
                    // try goes at once.
                    let pause = if suspended {
                        SUSPENDED_POLL
                    } else if dialled.elapsed() >= HELD_AT_ONCE {
                        held_pause = HELD_POLL;
                        HELD_POLL
                    } else {
                        held_pause = (held_pause * 2).min(SUSPENDED_POLL);
                        held_pause
                    };
                    std::thread::sleep(pause.min(bound - waited));
                    (start, attempt, backoff) = (Instant::now(), 0, Duration::from_millis(20));
                }
                Err(Redialed::Failed(e)) => {
                    attempt += 1;
                    tracing::debug!("resume attempt {attempt} failed: {e}");
                    last = e.to_string();
                    std::thread::sleep(backoff.min(policy.reconnect_timeout.saturating_sub(start.elapsed())));
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            }
        }
        Err(IoFail::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("{last}; not resumed within {:?} ({} attempts at most)", policy.reconnect_timeout, policy.attempts),
        )))
    }

    /// Acknowledges the resend window first if the next request, with
    /// `bulk` bytes, would overflow it.
    fn ack_if_full(&mut self, addr: &str, bulk: usize) -> Result<(), IoFail> {
        if !self.core.needs_ack(bulk) {
            return Ok(());
        }
        tracing::trace!("resend window full: acknowledging it first");
        self.retrying(addr, &[], |g, _| g.ack())
    }

    /// Sends a ping and waits for every reply owed, its own last.
    fn ack(&mut self) -> Result<(), IoFail> {
        let _ = self.core.post_ack();
        self.drain(&[])
    }

    /// Sends the batch and receives every reply owed.
    fn drain(&mut self, tail: &[u8]) -> Result<(), IoFail> {
        self.flush_with(tail)?;
        while self.core.replies_due() > 0 {
            self.receive()?;
        }
        Ok(())
    }

    /// Sends the batch, then `tail` (a call's large payload, from the
    /// caller's memory) in the same send when the core says it is due.
    /// Replies owed to requests already sent are received first (the core's
    /// rule: see session_core).
    fn flush_with(&mut self, tail: &[u8]) -> Result<(), IoFail> {
        if self.core.batch().is_empty() {
            return Ok(());
        }
        while self.core.replies_due() > 0 {
            self.receive()?;
        }
        if self.core.tail_due() && !tail.is_empty() {
            self.transport.send(&[self.core.batch(), tail])?;
        } else {
            self.transport.send(&[self.core.batch()])?;
        }
        self.core.sent();
        self.active_at = Instant::now();
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
            self.active_at = Instant::now();
            if let Some(done) = self.core.recv_advance(n)? {
                if let Completed::Read { output: true, .. } | Completed::Call { output: true, .. } = done {
                    let _ = self.core.with_reply(|r| super::output::write_reply_output(&r));
                }
                return Ok(done);
            }
        }
    }
}
