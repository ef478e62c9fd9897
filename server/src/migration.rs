//! Live migration: a session moved to another GPU server while its program
//! runs (docs/migration.md). The source holds the session still between
//! requests (a visit, as a checkpoint does), streams its snapshot straight
//! to the target over one connection, and once the target says it has
//! rebuilt the session, leaves a forwarding note and ends the session here:
//! the client's next resume is redirected to the target, where the resume
//! handshake, the reply window and the shim's resend window carry the
//! requests in flight across, exactly once.
//!
//! Who decides: the source. The target serves the rebuilt session only to a
//! client that resumes it, and a client only goes there when the source's
//! note sends it, which the source writes only after the target's "rebuilt".
//! So whatever breaks (the target dies mid-stream, refuses, or its answer
//! is lost), the session is served in exactly one place: without the answer
//! the source serves on, and the target's copy, never resumed, ends after
//! its reconnect grace.
//!
//! The intake connection (`RGPUMIG1`) is authenticated: the target sends a
//! nonce, the source answers HMAC-SHA256(admin key, server_op_message(nonce,
//! Intake, 0, "")): servers that share the operator's admin key accept each
//! other's sessions, nobody else can push one in. Under TLS both ends are
//! checked as on every other connection (the source against `--tls-ca`).
//!
//! The snapshot travels in chunks ([`ChunkWriter`], [`ChunkReader`]) so
//! the reader knows where the stream ends without trusting the snapshot's
//! own lengths for framing, and memory goes from the source's device to
//! the socket and from the socket into the target's device chunk by chunk.

use std::io::{self, Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rgpu_protocol::auth::{server_op_message, ServerOp, NONCE_LEN};
use rgpu_protocol::{MAX_REDIRECT_LEN, MIGRATE_PREAMBLE};
use rgpu_tls::server::Accepted;
use rgpu_tls::ClientSecurity;
use rgpu_transport::tcp::{self, TcpTransport};
use rgpu_transport::chunks::{answer, read_answer, ChunkReader, ChunkWriter};
use rgpu_transport::Transport;
use tracing::{info, warn};

use crate::backend::MemoryPeek;
use crate::checkpoint::precopy::{self, Precopied};
use crate::checkpoint::{self, SessionMeta, SnapshotError};
use crate::relocate::OpError;
use crate::service::Service;
use crate::session::{After, Parts};

/// Bounds each read and write on the intake connection: a peer that stops
/// answering for this long has failed the migration.
const PEER_IO_TIMEOUT: Duration = Duration::from_secs(60);
/// Bounds connecting to the target and its handshake.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("{0:?} is not a server address (host:port, at most {MAX_REDIRECT_LEN} bytes)")]
    BadTarget(String),
    #[error("this server has no --admin-key-file: it cannot prove itself to a target")]
    NoKey,
    #[error("this server serves TLS but has no --tls-ca to check a target's certificate by")]
    NoCa,
    #[error("session {session:#x} runs under broker lease {lease}, which the broker places on this server: a target's heartbeat would end it there, and only a move the broker orders (`rgpu migrate LEASE`, `rgpu drain --migrate`) takes a leased session")]
    Leased { session: u64, lease: u64 },
    #[error("cannot reach the target {addr}: {reason}")]
    Unreachable { addr: String, reason: String },
    #[error("the target {addr} refused the session: {reason}")]
    Refused { addr: String, reason: String },
    #[error("the connection to the target {addr} broke during the migration ({reason}); the session goes on here")]
    Lost { addr: String, reason: String },
    #[error(transparent)]
    Op(#[from] OpError),
}

impl From<MigrateError> for capnp::Error {
    fn from(e: MigrateError) -> Self {
        capnp::Error::failed(e.to_string())
    }
}

/// What a migration did.
#[derive(Debug, Clone, Copy)]
pub struct Moved {
    pub bytes: u64,
    pub memory_bytes: u64,
    /// Device memory sent while the program ran (the pre-copy).
    pub precopied: u64,
    /// Device memory sent while it was held (what changed since, or all of
    /// it without a pre-copy).
    pub sent_held: u64,
    /// From the call to the target's "rebuilt".
    pub took: Duration,
    /// From the session held still to the target's "rebuilt": how long
    /// the program could make no progress (its resume follows).
    pub paused: Duration,
}

/// `host:port`, short enough for a redirect.
pub fn valid_target(addr: &str) -> bool {
    addr.len() <= MAX_REDIRECT_LEN
        && addr.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0))
        && addr.chars().all(|c| c.is_ascii_graphic())
}

/// Connects to the target's intake, proves the admin key, and waits for
/// its "ready" (status 0).
fn dial(target: &str, security: &ClientSecurity, admin_key: &[u8]) -> Result<TcpTransport, MigrateError> {
    let unreachable = |e: &dyn std::fmt::Display| MigrateError::Unreachable { addr: target.into(), reason: e.to_string() };
    let mut t = tcp::connect(target, CONNECT_TIMEOUT).map_err(|e| unreachable(&e))?;
    if let ClientSecurity::Tls(tls) = security {
        let mut stream = t.into_stream().map_err(|e| unreachable(&e))?;
        stream.set_read_timeout(Some(CONNECT_TIMEOUT)).map_err(|e| unreachable(&e))?;
        let conn = rgpu_tls::client::handshake_blocking(tls, target, &mut stream).map_err(|e| unreachable(&e))?;
        t = TcpTransport::with_tls(stream, conn.into()).map_err(|e| unreachable(&e))?;
    }
    t.stream().set_read_timeout(Some(CONNECT_TIMEOUT)).map_err(|e| unreachable(&e))?;
    t.stream().set_write_timeout(Some(PEER_IO_TIMEOUT)).map_err(|e| unreachable(&e))?;
    t.send(&[MIGRATE_PREAMBLE]).map_err(|e| unreachable(&e))?;
    let mut nonce = [0u8; NONCE_LEN];
    t.recv_exact(&mut nonce[..8]).map_err(|e| unreachable(&e))?;
    if nonce[..8] == rgpu_tls::NEEDS_TLS[..] {
        return Err(unreachable(&"the target serves TLS: give this server --tls-ca"));
    }
    t.recv_exact(&mut nonce[8..]).map_err(|e| unreachable(&e))?;
    let proof = rgpu_protocol::token::sign_bytes(admin_key, &server_op_message(&nonce, ServerOp::Intake, 0, ""));
    t.send(&[&proof]).map_err(|e| unreachable(&e))?;
    match read_answer(&mut t).map_err(|e| unreachable(&e))? {
        Ok(_) => {}
        Err(reason) => return Err(MigrateError::Refused { addr: target.into(), reason }),
    }
    t.stream().set_read_timeout(Some(PEER_IO_TIMEOUT)).map_err(|e| unreachable(&e))?;
    Ok(t)
}

/// Moves session `id` to the server at `target`. On success the session
/// is served there and ends here; on any failure it goes on here.
pub async fn migrate(service: &Arc<Service>, id: u64, target: &str, quiesce: Duration) -> Result<Moved, MigrateError> {
    let r = migrate_to(service, id, target, quiesce).await;
    match &r {
        Ok(m) => service.metrics.migrated_out(m.paused, m.precopied, m.sent_held),
        Err(_) => service.metrics.migration(true, false),
    }
    r
}

async fn migrate_to(service: &Arc<Service>, id: u64, target: &str, quiesce: Duration) -> Result<Moved, MigrateError> {
    if !valid_target(target) {
        return Err(MigrateError::BadTarget(target.into()));
    }
    let admin_key = service.admin_key.clone().ok_or(MigrateError::NoKey)?;
    let started = Instant::now();
    let (key, client_name) = service.sessions.identity(id).ok_or(OpError::NoSession(id))?;
    let mut admission = service.leases.admission(id);
    if let Some(a) = &mut admission {
        // Only a move the broker ordered, to its target: any other would be
        // ended by the target's next heartbeat. The session arrives at the
        // generation the broker lists it under there.
        match service.leases.ordered_move(a.lease, target) {
            Some(generation) => a.generation = generation,
            None => return Err(MigrateError::Leased { session: id, lease: a.lease }),
        }
    }
    // A session that could never be written out (its backend cannot place
    // memory, CUDA IPC, a stale graph) is refused before a byte is copied
    // or a target is called.
    precheck(service, id).await?;
    // Connected and authenticated before the session is touched: a target
    // that is down or refuses costs the program nothing.
    let security = service.peer_security.clone().ok_or(MigrateError::NoCa)?;
    let to = target.to_string();
    let t = tokio::task::spawn_blocking(move || dial(&to, &security, &admin_key))
        .await
        .map_err(|_| OpError::ShuttingDown)??;
    // Pre-copy while the program runs; a leased session's stream says
    // first whose memory it is, for the target to charge it to that
    // lease's budget as it arrives.
    let plan = if service.precopy { precopy_plan(service, id).await? } else { None };
    let whose = admission.as_ref().map(|a| precopy::Whose { lease: a.lease, memory_limit: a.memory_limit });
    let to = target.to_string();
    let precopy_started = Instant::now();
    let (mut t, precopied) = tokio::task::spawn_blocking(move || {
        let mut t = t;
        let mut w = ChunkWriter::new(&mut t);
        let sent = match plan {
            Some((allocs, peek)) => precopy::send(&*peek, &allocs, whose, &mut w),
            None => w.write_all(&[0]).map(|()| Precopied::new()),
        };
        let sent = sent.and_then(|s| w.flush().map(|()| s));
        sent.map(|s| (t, s)).map_err(|e| MigrateError::Lost { addr: to, reason: e.to_string() })
    })
    .await
    .map_err(|_| OpError::ShuttingDown)??;
    let precopy_bytes: u64 = precopied.values().map(|s| s.size).sum();
    if precopy_bytes > 0 {
        info!(session = format_args!("{id:#x}"), bytes = precopy_bytes, ms = precopy_started.elapsed().as_millis() as u64,
            "pre-copied while the program runs");
    }
    let (tx, rx) = tokio::sync::oneshot::channel::<Result<Moved, MigrateError>>();
    let (svc, to) = (service.clone(), target.to_string());
    let visit = Box::new(move |p: Parts<'_>| -> After {
        if tx.is_closed() {
            return After::Serve;
        }
        let held = Instant::now();
        let meta = SessionMeta { id, key, client_name, executed: p.executed, deferred: p.deferred, admission };
        let lost = |e: &dyn std::fmt::Display| MigrateError::Lost { addr: to.clone(), reason: e.to_string() };
        let r = (|| {
            let mut w = ChunkWriter::new(&mut t);
            precopy::send_stale(&precopy::stale(&precopied, p.state), &mut w).map_err(|e| lost(&e))?;
            let captured = checkpoint::capture(p.state, &meta, p.window, quiesce, &mut w, Some(&precopied));
            let captured = match captured {
                Ok(c) => c,
                // The target sees the stream cut and drops what it read.
                Err(SnapshotError::Io(e)) => return Err(lost(&e)),
                Err(e) => return Err(MigrateError::Op(e.into())),
            };
            w.finish().map_err(|e| lost(&e))?;
            match read_answer(&mut t) {
                Ok(Ok((_, memory))) => Ok(Moved {
                    bytes: captured.bytes,
                    memory_bytes: memory,
                    precopied: precopy_bytes,
                    sent_held: captured.memory_sent,
                    took: started.elapsed(),
                    paused: held.elapsed(),
                }),
                Ok(Err(reason)) => Err(MigrateError::Refused { addr: to.clone(), reason }),
                Err(e) => Err(lost(&e)),
            }
        })();
        let after = match &r {
            Ok(_) => {
                // Written before the session's thread ends here, so that no
                // resume finds it neither here nor forwarded.
                svc.sessions.forward(id, key, &to);
                After::Gone
            }
            Err(_) => After::Serve,
        };
        t.shutdown();
        let _ = tx.send(r);
        after
    });
    if !service.sessions.visit(id, visit) {
        return Err(OpError::NoSession(id).into());
    }
    let moved = rx.await.map_err(|_| OpError::Ended(id))??;
    info!(session = format_args!("{id:#x}"), %target, bytes = moved.bytes, memory = moved.memory_bytes,
        precopied = moved.precopied, sent_held = moved.sent_held,
        pause_ms = moved.paused.as_millis() as u64, ms = moved.took.as_millis() as u64, "session migrated");
    Ok(moved)
}

/// Whether session `id` can be written to a snapshot, asked in a short visit.
pub(crate) async fn precheck(service: &Arc<Service>, id: u64) -> Result<(), MigrateError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let visit = Box::new(move |p: Parts<'_>| -> After {
        let _ = tx.send(checkpoint::check_capturable(p.state));
        After::Serve
    });
    if !service.sessions.visit(id, visit) {
        return Err(OpError::NoSession(id).into());
    }
    rx.await.map_err(|_| OpError::Ended(id))?.map_err(|e| MigrateError::Op(e.into()))
}

/// What a pre-copy takes: the session's client allocations and a reader of
/// them, got in a short visit (the session goes on at once). None: nothing
/// worth pre-copying, or a backend without a reader.
async fn precopy_plan(service: &Arc<Service>, id: u64) -> Result<Option<(Vec<(u64, u32, u64)>, Arc<dyn MemoryPeek>)>, MigrateError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let visit = Box::new(move |p: Parts<'_>| -> After {
        let _ = tx.send((precopy::client_allocs(p.state), p.state.backend.memory_peek()));
        After::Serve
    });
    if !service.sessions.visit(id, visit) {
        return Err(OpError::NoSession(id).into());
    }
    let (allocs, peek) = rx.await.map_err(|_| OpError::Ended(id))?;
    let total: u64 = allocs.iter().map(|a| a.2).sum();
    Ok(peek.filter(|_| total >= precopy::MIN_BYTES).map(|p| (allocs, p)))
}

/// Serves one intake connection (its preamble read): authenticates the
/// sending server, rebuilds the session it streams, and answers. `hold`
/// keeps the connection counted against the server's limits.
pub fn intake(sock: Accepted, peer: String, service: Arc<Service>, hold: Box<dyn std::any::Any + Send>) {
    let t = match crate::listener::blocking(sock) {
        Ok(t) => t,
        Err(e) => return warn!(%peer, "cannot take over a migration connection: {e}"),
    };
    let spawned = std::thread::Builder::new().name("rgpu-intake".into()).spawn(move || {
        let _hold = hold;
        intake_on(t, &peer, &service);
    });
    if let Err(e) = spawned {
        warn!("cannot start a migration intake: {e}");
    }
}

fn intake_on(mut t: TcpTransport, peer: &str, service: &Arc<Service>) {
    let refuse = |t: &mut TcpTransport, why: &str| {
        warn!(%peer, "incoming migration refused: {why}");
        let _ = answer(t, 1, why, 0, 0);
        t.shutdown();
    };
    let _ = t.stream().set_read_timeout(Some(service.limits.handshake_timeout));
    let _ = t.stream().set_write_timeout(Some(PEER_IO_TIMEOUT));
    let Some(admin_key) = service.admin_key.as_deref() else {
        return refuse(&mut t, "the target has no --admin-key-file: it takes no sessions from other servers");
    };
    if service.limits.reconnect_grace.is_zero() {
        return refuse(&mut t, "the target keeps no session across a broken connection (--reconnect-grace 0)");
    }
    let mut nonce = [0u8; NONCE_LEN];
    if getrandom::fill(&mut nonce).is_err() {
        return refuse(&mut t, "no randomness");
    }
    let mut proof = [0u8; 32];
    if t.send(&[&nonce]).and_then(|()| t.recv_exact(&mut proof)).is_err() {
        return warn!(%peer, "migration connection closed during its handshake");
    }
    let message = server_op_message(&nonce, ServerOp::Intake, 0, "");
    if !rgpu_protocol::token::verify_bytes(admin_key, &message, &proof) {
        return refuse(&mut t, "the sender's proof is not this server's admin key");
    }
    if answer(&mut t, 0, "", 0, 0).is_err() {
        return;
    }
    let _ = t.stream().set_read_timeout(Some(PEER_IO_TIMEOUT));
    let started = Instant::now();
    let mut r = ChunkReader::new(&mut t);
    let sizes: Vec<u64> = service.backend.devices().iter().map(|d| d.total_mem).collect();
    let mut open = |whose: Option<precopy::Whose>| {
        // A session that just left here (perhaps this very one, moved away
        // and now coming back) frees its memory as its thread ends: the
        // ranges staged next need the same addresses.
        if !service.sessions.wait_for_leaving(crate::relocate::REPLACE_WAIT) {
            warn!(%peer, "a session leaving this server is still ending; staging the incoming one beside it");
        }
        let budget = whose.and_then(|w| service.leases.budget_of(w.lease, w.memory_limit));
        service.backend.open_session(budget).map_err(|e| SnapshotError::Device(e, "opening a session"))
    };
    let rebuilt = precopy::receive(&mut r, &sizes, &mut open)
        .map_err(OpError::from)
        .and_then(|staged| crate::relocate::serve_rebuilt(service, &mut r, false, staged));
    let received = r.received;
    match rebuilt {
        Ok((_, memory, span)) => {
            drop(r);
            span.in_scope(|| {
                info!(%peer, bytes = received, memory, ms = started.elapsed().as_millis() as u64,
                    "session migrated in; waiting for its client to resume")
            });
            let _ = answer(&mut t, 0, "", received, memory);
            service.metrics.migration(false, true);
        }
        Err(e) => {
            service.metrics.migration(false, false);
            warn!(%peer, "incoming migration failed: {e}");
            // The sender is still streaming: a connection closed under it
            // would tell it only "broken pipe". Read the rest (no more than
            // the devices could hold, each read bounded in time), so that it
            // finishes and reads why.
            let bound = sizes.iter().fold(1u64 << 30, |n, &s| n.saturating_add(s.saturating_mul(2)));
            let _ = io::copy(&mut (&mut r).take(bound), &mut io::sink());
            let _ = answer(&mut t, 2, &e.to_string(), 0, 0);
        }
    }
    t.shutdown();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_host_and_port() {
        assert!(valid_target("gpu2:7767"));
        assert!(valid_target("127.0.0.1:9"));
        assert!(valid_target("[::1]:7767"));
        for bad in ["gpu2", ":7767", "gpu2:0", "gpu2:99999", "gpu 2:1", ""] {
            assert!(!valid_target(bad), "{bad:?}");
        }
        assert!(!valid_target(&format!("{}:1", "a".repeat(MAX_REDIRECT_LEN))));
    }
}
