//! The accept loop (mini-redis `server.rs`): takes a bound listener and a
//! shutdown token, caps concurrent connections with a semaphore, sets up
//! TLS (or, with `--plaintext`, checks that the client did not ask for it;
//! `rgpu_tls::server::accept`), and dispatches each connection by the
//! 8-byte preamble it sends next (inside TLS, so an observer cannot tell
//! the planes apart):
//!
//! - `RGPUCTL1`: capnp-rpc control plane, served on this (local) task set;
//! - `RGPUDAT1` + session id + key: a session's data connection, handed to a
//!   dedicated thread with blocking I/O;
//! - `RGPURES1`: a data connection coming back to its session;
//! - `RGPUMIG1`: another server handing over a session (`migration`);
//! - `RGPUSNP1`: an operator copying a snapshot off or onto this server
//!   (`snapshot_copy`).
//!
//! Shutdown: stop accepting, close every session's socket, then wait until
//! every handler has dropped its guard (a clone of one mpsc sender).

use std::sync::Arc;
use std::time::{Duration, Instant};

use rgpu_protocol::{
    CONTROL_PREAMBLE, DATA_PREAMBLE, MIGRATE_PREAMBLE, PROTOCOL_VERSION, RESUME_HELD, RESUME_MOVED, RESUME_PREAMBLE, RESUME_SUSPENDED, SESSION_KEY_LEN,
    SNAPSHOT_PREAMBLE,
};
use rgpu_transport::select::RDMA_DATA_PREAMBLE;
use rgpu_transport::tcp::TcpTransport;
use rgpu_transport::Transport;
use rgpu_tls::server::{Accepted, Refused};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, info_span, warn};

use crate::limits::AddressSlot;
use crate::service::Service;
use crate::session::registry::{AttachError, Resume, ResumeError};
use crate::state::SessionState;
use rgpu_cuda_types::CuError;

/// Marker held by every connection handler; shutdown waits for all to drop.
type Guard = mpsc::Sender<()>;

/// What a connection holds while it is served: a slot of the server's
/// connection limit and one of its address's.
struct Held {
    _permit: OwnedSemaphorePermit,
    _slot: AddressSlot,
}

/// Serves connections from `listener` until `shutdown` fires, then closes
/// every session and returns once all handlers are done. The future is not
/// `Send` (capnp-rpc is single-threaded): drive it with `block_on`.
pub async fn run(
    listener: TcpListener,
    service: Arc<Service>,
    max_connections: usize,
    shutdown: CancellationToken,
) {
    let local = tokio::task::LocalSet::new();
    local
        .run_until(async move {
            let limit = Arc::new(Semaphore::new(max_connections.max(1)));
            let (guard, mut all_done) = mpsc::channel::<()>(1);
            loop {
                let permit = tokio::select! {
                    _ = shutdown.cancelled() => break,
                    p = limit.clone().acquire_owned() => match p {
                        Ok(p) => p,
                        Err(_) => break,
                    },
                };
                let (sock, peer) = tokio::select! {
                    _ = shutdown.cancelled() => break,
                    r = accept(&listener) => r,
                };
                // One address may not hold every slot (idle connections from
                // one host would shut everyone else out).
                let Some(slot) = service.per_address.admit(peer.ip()) else {
                    debug!(%peer, limit = service.limits.max_connections_per_address,
                        "connection refused: its address has as many open as --max-connections-per-address allows");
                    drop(sock);
                    continue;
                };
                let deadline = Instant::now() + service.limits.handshake_timeout;
                let held = Held { _permit: permit, _slot: slot };
                let (service, shutdown, guard) = (service.clone(), shutdown.clone(), guard.clone());
                tokio::task::spawn_local(async move {
                    handle(sock, peer.to_string(), service, shutdown, held, guard, deadline).await;
                });
            }
            info!("shutting down: closing sessions");
            drop(listener);
            service.sessions.close_all();
            drop(guard);
            // Every handler holds a guard clone; recv yields None once all are gone.
            let _ = all_done.recv().await;
            info!("shut down");
        })
        .await
}

/// Accepts one connection; errors (out of file descriptors, ...) are logged
/// and retried with exponential backoff instead of ending the server.
async fn accept(listener: &TcpListener) -> (TcpStream, std::net::SocketAddr) {
    let mut backoff = Duration::from_millis(10);
    loop {
        match listener.accept().await {
            Ok(c) => return c,
            Err(e) => {
                warn!("accept failed: {e}; retrying in {} ms", backoff.as_millis());
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// `deadline`: when the connection must have said what it is (its
/// preamble, and on the data plane its credentials; the control plane
/// checks its hello against it).
async fn handle(
    sock: TcpStream,
    peer: String,
    service: Arc<Service>,
    shutdown: CancellationToken,
    held: Held,
    guard: Guard,
    deadline: Instant,
) {
    let _ = sock.set_nodelay(true);
    let secs = service.limits.handshake_timeout.as_secs_f64();
    let accepted = tokio::select! {
        r = tokio::time::timeout_at(deadline.into(), rgpu_tls::server::accept(&service.security, sock)) => r,
        _ = shutdown.cancelled() => return,
    };
    let mut sock = match accepted {
        Ok(Ok(s)) => s,
        Ok(Err(e @ (Refused::PlaintextClient | Refused::TlsClient))) => return warn!(%peer, "connection refused: {e}"),
        Ok(Err(e)) => return debug!(%peer, "connection closed: {e}"),
        Err(_) => return debug!(%peer, "no TLS handshake within {secs} s (--handshake-timeout); closing"),
    };
    let mut preamble = [0u8; 8];
    let got = tokio::select! {
        r = tokio::time::timeout_at(deadline.into(), sock.read_exact(&mut preamble)) => r,
        _ = shutdown.cancelled() => return,
    };
    match got {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return debug!(%peer, "connection closed before its preamble: {e}"),
        Err(_) => return debug!(%peer, "no preamble within {secs} s (--handshake-timeout); closing"),
    }
    if &preamble == CONTROL_PREAMBLE {
        let channel = sock.channel_binding();
        crate::control::serve(sock, channel, peer, service, shutdown, deadline).await;
        drop((held, guard));
    } else if &preamble == DATA_PREAMBLE || &preamble == RDMA_DATA_PREAMBLE {
        let rdma = &preamble == RDMA_DATA_PREAMBLE;
        attach(sock, peer, service, shutdown, held, guard, rdma, deadline).await;
    } else if &preamble == RESUME_PREAMBLE {
        resume(sock, peer, service, shutdown, held, deadline).await;
    } else if &preamble == MIGRATE_PREAMBLE {
        crate::migration::intake(sock, peer, service, Box::new((held, guard)));
    } else if &preamble == SNAPSHOT_PREAMBLE {
        crate::snapshot_copy::serve(sock, peer, service, Box::new((held, guard)));
    } else {
        warn!(%peer, preamble = ?String::from_utf8_lossy(&preamble), "unknown preamble; closing");
    }
}

/// Attach status sent to the client: 0 = ok, else a CUresult.
fn status_bytes(status: u32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&status.to_le_bytes());
    b[4..].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    b
}

/// A client coming back to its session: handed to the session's thread,
/// which answers it (see `session::Session::resume`).
/// How long a resume waits for its session's visit to end before its
/// client is told "held, try again": well under any reconnect time a
/// client would set, so the answer comes before the client gives up.
const HELD_WAIT: Duration = Duration::from_millis(200);
/// How often a waiting resume looks whether the visit ended.
const HELD_POLL: Duration = Duration::from_millis(2);

async fn resume(mut sock: Accepted, peer: String, service: Arc<Service>, shutdown: CancellationToken, held: Held, deadline: Instant) {
    let mut creds = [0u8; 8 + SESSION_KEY_LEN + 8];
    let got = tokio::select! {
        r = tokio::time::timeout_at(deadline.into(), sock.read_exact(&mut creds)) => r,
        _ = shutdown.cancelled() => return,
    };
    if !matches!(got, Ok(Ok(_))) {
        return warn!(%peer, "resumed data connection sent no session credentials; closing");
    }
    let id = u64::from_le_bytes(creds[..8].try_into().unwrap_or([0; 8]));
    let last_reply = u64::from_le_bytes(creds[8 + SESSION_KEY_LEN..].try_into().unwrap_or([0; 8]));
    // The resumed connection is encrypted as the first one was: the
    // session continues on this transport, TLS state and all.
    let transport = match blocking(sock) {
        Ok(t) => t,
        Err(e) => return warn!(%peer, "cannot set up resumed data connection: {e}"),
    };
    let _ = client_timeouts(transport.stream(), &service);
    let key = &creds[8..8 + SESSION_KEY_LEN];
    let mut r = Resume { transport, last_reply, hold: Box::new(held) };
    // A session held for a visit is waited for a little before the client
    // is told to try again: most visits (a pre-copy's plan, a migration's
    // last copy) end sooner, and the resume then goes straight on.
    let held_until = Instant::now() + HELD_WAIT;
    let answered = loop {
        let registered = match r.transport.stream().try_clone() {
            Ok(c) => c,
            Err(e) => return warn!(%peer, "cannot clone socket: {e}"),
        };
        match service.sessions.resume(id, key, registered, r) {
            Err((ResumeError::Held, back)) if Instant::now() < held_until => {
                r = back;
                tokio::select! {
                    _ = tokio::time::sleep(HELD_POLL) => {}
                    _ = shutdown.cancelled() => return,
                }
            }
            answered => break answered,
        }
    };
    match answered {
        Ok(()) => info!(%peer, session = format_args!("{id:#x}"), last_reply, "data connection resumed"),
        Err((ResumeError::Held, mut r)) => {
            debug!(%peer, session = format_args!("{id:#x}"), "resume deferred: the session is held for a checkpoint or a move");
            let _ = r.transport.send(&[&status_bytes(RESUME_HELD)]);
            r.transport.shutdown();
        }
        Err((ResumeError::Moved(to), mut r)) => {
            info!(%peer, session = format_args!("{id:#x}"), %to, "resume redirected: the session moved");
            let len = (to.len() as u16).to_le_bytes();
            let _ = r.transport.send(&[&status_bytes(RESUME_MOVED), &len, to.as_bytes()]);
            r.transport.shutdown();
        }
        Err((ResumeError::Suspended, mut r)) => {
            debug!(%peer, session = format_args!("{id:#x}"), "resume deferred: the session's lease is suspended");
            let _ = r.transport.send(&[&status_bytes(RESUME_SUSPENDED)]);
            r.transport.shutdown();
        }
        Err((ResumeError::Refused(e), mut r)) => {
            warn!(%peer, session = format_args!("{id:#x}"), "resume refused: {e:?} (unknown session or wrong key)");
            let _ = r.transport.send(&[&status_bytes(CuError::INVALID_HANDLE.code())]);
            r.transport.shutdown();
        }
    }
}

/// Takes an accepted connection over as blocking std I/O, its TLS state
/// (if any) carried over with what it has read.
pub(crate) fn blocking(sock: Accepted) -> std::io::Result<TcpTransport> {
    let (sock, tls) = sock.into_parts();
    let std = sock.into_std()?;
    std.set_nonblocking(false)?;
    match tls {
        Some(tls) => TcpTransport::with_tls(std, tls),
        None => TcpTransport::new(std),
    }
}

/// A data connection whose client sends nothing, or takes nothing, for
/// --client-timeout counts as broken.
fn client_timeouts(s: &std::net::TcpStream, service: &Service) -> std::io::Result<()> {
    s.set_read_timeout(Some(service.limits.client_timeout))?;
    s.set_write_timeout(Some(service.limits.client_timeout))
}

#[allow(clippy::too_many_arguments)]
async fn attach(
    mut sock: Accepted,
    peer: String,
    service: Arc<Service>,
    shutdown: CancellationToken,
    held: Held,
    guard: Guard,
    rdma: bool,
    deadline: Instant,
) {
    let mut creds = [0u8; 8 + SESSION_KEY_LEN];
    let got = tokio::select! {
        r = tokio::time::timeout_at(deadline.into(), sock.read_exact(&mut creds)) => r,
        _ = shutdown.cancelled() => return,
    };
    if !matches!(got, Ok(Ok(_))) {
        return warn!(%peer, "data connection sent no session credentials; closing");
    }
    let id = u64::from_le_bytes(creds[..8].try_into().unwrap_or([0; 8]));
    let key = &creds[8..];
    // From here on the connection is blocking std I/O, its TLS state (if
    // any) carried over with what it has read.
    let mut transport = match blocking(sock) {
        Ok(t) => t,
        Err(e) => return warn!(%peer, "cannot set up data connection: {e}"),
    };
    let refuse = |mut t: TcpTransport, code: CuError, why: &str| {
        warn!(%peer, session = format_args!("{id:#x}"), "data connection refused: {why}");
        let _ = t.send(&[&status_bytes(code.code())]);
        t.shutdown();
    };
    let registered = match transport.stream().try_clone() {
        Ok(c) => c,
        Err(e) => return refuse(transport, CuError::UNKNOWN, &format!("cannot clone socket: {e}")),
    };
    let _ = client_timeouts(transport.stream(), &service);
    let (client, resumed) = match service.sessions.attach(id, key, registered) {
        Ok(c) => c,
        Err(AttachError::Unknown) => {
            return refuse(transport, CuError::INVALID_HANDLE, "unknown session or wrong key")
        }
        Err(AttachError::ShuttingDown) => {
            return refuse(transport, CuError::NOT_INITIALIZED, "server is shutting down")
        }
    };
    // A lease's token may cap the memory of all the lease's sessions
    // together (one budget per lease on this server), and restricts the
    // session to the token's GPUs.
    let admission = service.leases.admission(id);
    let pkey = admission.as_ref().and_then(|a| a.pkey);
    let budget = admission.as_ref().and_then(|a| service.leases.budget(a));
    let backend = match service.backend.open_session(budget) {
        Ok(b) => b,
        Err(e) => {
            service.sessions.detach(id);
            return refuse(transport, e, "backend cannot open a session");
        }
    };
    let input = service.session_input(admission.as_ref());
    let meter = service.meter(id, admission.as_ref().map(|a| a.lease));
    let mut state = SessionState::new(backend, service.backend.devices().len() as u32)
        .with_devices(service.backend.devices())
        .with_input(input)
        .with_meter(meter)
        .with_ipc(service.ipc.clone(), admission.as_ref().map(|a| a.lease));
    if let Some(a) = admission {
        state = state.with_compute_share(a.lease, a.compute_milli).restrict(a.devices);
    }
    let watched = match transport.stream().try_clone() {
        Ok(c) => c,
        Err(e) => {
            service.sessions.detach(id);
            return refuse(transport, CuError::UNKNOWN, &format!("cannot clone socket: {e}"));
        }
    };
    let ended = state.ended.clone();
    service.sessions.bind_ended(id, ended.clone());
    if let Err(e) = transport.send(&[&status_bytes(0)]) {
        service.sessions.detach(id);
        service.meters.remove(id);
        return debug!(%peer, "data connection lost during attach: {e}");
    }
    // Every event of the session, down to each forwarded call, is logged in
    // this span, so none of them needs to name the session itself. Info
    // level: the default filter keeps it, and it costs once per session.
    let span = info_span!(
        "session",
        id = %format_args!("{id:#x}"),
        %client,
        transport = tracing::field::Empty,
    );
    span.in_scope(|| info!(%peer, "session attached"));
    let svc = service.clone();
    let thread_span = span.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("rgpu-session-{id:x}"))
        .spawn(move || {
            let span = thread_span;
            let _in_session = span.enter();
            let _held = (held, guard);
            // Taken before an upgrade to RDMA, which sends no keepalives.
            let sealer = transport.sealer();
            if let Some(transport) = svc.data_plane.upgrade(transport, rdma, pkey) {
                span.record("transport", transport.kind());
                // The session's work stops soon after its connection ends for
                // good (the reconnect grace passed), even mid-kernel.
                let keepalive = transport.kind() == "tcp";
                let grace = svc.limits.reconnect_grace;
                let watch = match crate::session::hangup::Watch::start(watched, ended, grace, keepalive, sealer) {
                    Ok(w) => Some(w),
                    Err(e) => {
                        warn!("cannot watch the connection for its end: {e}; running work finishes before the session ends");
                        None
                    }
                };
                let spin = svc.data_plane.tcp_spin();
                let resumer = watch.as_ref().filter(|_| !grace.is_zero()).map(|w| crate::session::Resumer {
                    rx: resumed,
                    link: w.link(),
                    spin,
                });
                // A bug reachable from input must cost this session, never the
                // server: a panic ends the session and its cleanup still runs.
                let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    crate::session::serve(transport, state, resumer)
                }));
                drop(watch);
                if served.is_err() {
                    error!("session thread panicked; the session is closed and its resources freed");
                }
            }
            svc.session_ended(id);
        });
    if let Err(e) = spawned {
        // The closure (and with it the state, permit and guard) is dropped.
        span.in_scope(|| error!("cannot start session thread: {e}"));
        service.sessions.detach(id);
        service.meters.remove(id);
    }
}
