//! A GPU server's operator calls (control.capnp `checkpoint`, `restore`, `migrate`):
//! each takes the connection's challenge and proves it holds the server's
//! admin key over it (`rgpu_protocol::auth::server_op_message`).

use std::time::Duration;

use rgpu_protocol::auth::{server_op_message, ServerOp};
use rgpu_protocol::control_capnp::gpu_server;
use rgpu_protocol::token::sign_bytes;
use rgpu_protocol::PROTOCOL_VERSION;

use crate::{rpc_err, run_for, ClientSecurity, ControlError};

type Driver = tokio::task::JoinHandle<Result<(), capnp::Error>>;

/// Connects to `addr`'s control plane (TLS as `security` says); the returned
/// task drives the connection (abort it when done). Inside a `LocalSet`.
async fn connect(addr: &str, security: &ClientSecurity) -> Result<(gpu_server::Client, Driver), ControlError> {
    let (server, driver, _refusal, _) = crate::connect(addr, security).await?;
    Ok((server, driver))
}

/// What a checkpoint or restore did, as the server measured it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpResult {
    pub session: u64,
    /// Snapshot bytes written or read.
    pub bytes: u64,
    /// Of which device memory.
    pub memory_bytes: u64,
    /// How long the server took (a checkpoint: from the call to the file synced).
    pub took: Duration,
}

fn refused(addr: &str, e: capnp::Error) -> ControlError {
    ControlError::Refused { addr: addr.into(), reason: e.extra.clone() }
}

async fn hello_and_nonce(addr: &str, server: &gpu_server::Client) -> Result<Vec<u8>, ControlError> {
    let mut req = server.hello_request();
    req.get().set_client_version(PROTOCOL_VERSION);
    req.get().set_client_name("rgpu operator");
    let reply = req.send().promise.await.map_err(|e| rpc_err(addr, e))?;
    let theirs = reply.get().map_err(|e| rpc_err(addr, e))?.get_server_version();
    if theirs != PROTOCOL_VERSION {
        return Err(ControlError::VersionMismatch { addr: addr.into(), ours: PROTOCOL_VERSION, theirs });
    }
    let reply = server.challenge_request().send().promise.await.map_err(|e| refused(addr, e))?;
    Ok(reply.get().and_then(|r| r.get_nonce()).map_err(|e| rpc_err(addr, e))?.to_vec())
}

/// Checkpoints session `session` on `addr` as snapshot `name` (in the
/// server's checkpoint directory); `leave`: the session is served there no
/// more. `limit` bounds the whole call.
#[allow(clippy::too_many_arguments)]
pub fn checkpoint(
    addr: &str,
    security: &ClientSecurity,
    admin_key: &[u8],
    session: u64,
    name: &str,
    quiesce: Duration,
    leave: bool,
    limit: Duration,
) -> Result<OpResult, ControlError> {
    run_for(addr, limit, async {
        let (server, driver) = connect(addr, security).await?;
        let r = async {
            let nonce = hello_and_nonce(addr, &server).await?;
            let proof = sign_bytes(admin_key, &server_op_message(&nonce, ServerOp::Checkpoint, session, name));
            let mut req = server.checkpoint_request();
            let mut p = req.get();
            p.set_session_id(session);
            p.set_name(name);
            p.set_quiesce_ms(u32::try_from(quiesce.as_millis()).unwrap_or(u32::MAX));
            p.set_leave(leave);
            p.set_nonce(&nonce);
            p.set_proof(&proof);
            let reply = req.send().promise.await.map_err(|e| refused(addr, e))?;
            let r = reply.get().map_err(|e| rpc_err(addr, e))?;
            Ok(OpResult {
                session,
                bytes: r.get_bytes(),
                memory_bytes: r.get_memory_bytes(),
                took: Duration::from_micros(r.get_micros()),
            })
        }
        .await;
        driver.abort();
        r
    })
}

/// Forwards session `session`, whose state left `addr` in a checkpoint, to
/// `target`, where it was restored: its program's next resume at `addr` is
/// redirected there.
pub fn forward(
    addr: &str,
    security: &ClientSecurity,
    admin_key: &[u8],
    session: u64,
    target: &str,
    limit: Duration,
) -> Result<(), ControlError> {
    run_for(addr, limit, async {
        let (server, driver) = connect(addr, security).await?;
        let r = async {
            let nonce = hello_and_nonce(addr, &server).await?;
            let proof = sign_bytes(admin_key, &server_op_message(&nonce, ServerOp::Forward, session, target));
            let mut req = server.forward_request();
            let mut p = req.get();
            p.set_session_id(session);
            p.set_target(target);
            p.set_nonce(&nonce);
            p.set_proof(&proof);
            req.send().promise.await.map_err(|e| refused(addr, e))?;
            Ok(())
        }
        .await;
        driver.abort();
        r
    })
}

/// Restores snapshot `name` (in the server's checkpoint directory) on `addr`.
pub fn restore(
    addr: &str,
    security: &ClientSecurity,
    admin_key: &[u8],
    name: &str,
    limit: Duration,
) -> Result<OpResult, ControlError> {
    run_for(addr, limit, async {
        let (server, driver) = connect(addr, security).await?;
        let r = async {
            let nonce = hello_and_nonce(addr, &server).await?;
            let proof = sign_bytes(admin_key, &server_op_message(&nonce, ServerOp::Restore, 0, name));
            let mut req = server.restore_request();
            let mut p = req.get();
            p.set_name(name);
            p.set_nonce(&nonce);
            p.set_proof(&proof);
            let reply = req.send().promise.await.map_err(|e| refused(addr, e))?;
            let r = reply.get().map_err(|e| rpc_err(addr, e))?;
            Ok(OpResult {
                session: r.get_session_id(),
                bytes: r.get_bytes(),
                memory_bytes: r.get_memory_bytes(),
                took: Duration::from_micros(r.get_micros()),
            })
        }
        .await;
        driver.abort();
        r
    })
}

/// Copies snapshot `name` off the server at `addr` into `out` in one stream
/// ([`crate::snapshot_copy`]), or, from a server older than the stream, in
/// control-plane calls ([`read_snapshot_in_calls`]); returns its size. Keep
/// `out` only when this returns Ok.
pub fn read_snapshot(
    addr: &str,
    security: &ClientSecurity,
    admin_key: &[u8],
    name: &str,
    out: &mut dyn std::io::Write,
    limit: Duration,
) -> Result<u64, ControlError> {
    use crate::snapshot_copy::{copy_off, CopyError};
    match copy_off(addr, security, admin_key, name, out, limit) {
        Ok(n) => Ok(n),
        Err(CopyError::Unsupported(_)) => {
            tracing::info!(%addr, "the server takes no snapshot streams; copying in control-plane calls");
            read_snapshot_in_calls(addr, security, admin_key, name, out, limit)
        }
        Err(CopyError::Control(e)) => Err(e),
    }
}

/// Writes the snapshot read from `input` (`size` bytes) onto the server at
/// `addr` as `name` in one stream, or, to a server older than the stream,
/// in control-plane calls ([`write_snapshot_in_calls`]).
pub fn write_snapshot(
    addr: &str,
    security: &ClientSecurity,
    admin_key: &[u8],
    name: &str,
    input: &mut dyn std::io::Read,
    size: u64,
    limit: Duration,
) -> Result<(), ControlError> {
    use crate::snapshot_copy::{copy_onto, CopyError};
    match copy_onto(addr, security, admin_key, name, input, size, limit) {
        Ok(()) => Ok(()),
        Err(CopyError::Unsupported(_)) => {
            tracing::info!(%addr, "the server takes no snapshot streams; copying in control-plane calls");
            write_snapshot_in_calls(addr, security, admin_key, name, input, size, limit)
        }
        Err(CopyError::Control(e)) => Err(e),
    }
}

/// Copies snapshot `name` off the server at `addr` into `out`, in pieces of
/// [`SNAPSHOT_READ_MAX`] bytes (each an operator call of its own, proved
/// over the nonce the previous one's answer carried); returns
/// its size. `limit` bounds the whole copy.
///
/// [`SNAPSHOT_READ_MAX`]: rgpu_protocol::auth::SNAPSHOT_READ_MAX
pub fn read_snapshot_in_calls(
    addr: &str,
    security: &ClientSecurity,
    admin_key: &[u8],
    name: &str,
    out: &mut dyn std::io::Write,
    limit: Duration,
) -> Result<u64, ControlError> {
    use rgpu_protocol::auth::{snapshot_read_name, SNAPSHOT_READ_MAX};
    run_for(addr, limit, async {
        let (server, driver) = connect(addr, security).await?;
        let r = async {
            let mut nonce = hello_and_nonce(addr, &server).await?;
            let mut offset = 0u64;
            loop {
                let named = snapshot_read_name(name, SNAPSHOT_READ_MAX);
                let proof = sign_bytes(admin_key, &server_op_message(&nonce, ServerOp::ReadSnapshot, offset, &named));
                let mut req = server.read_snapshot_request();
                let mut p = req.get();
                p.set_name(name);
                p.set_offset(offset);
                p.set_max_bytes(SNAPSHOT_READ_MAX);
                p.set_nonce(&nonce);
                p.set_proof(&proof);
                let reply = req.send().promise.await.map_err(|e| refused(addr, e))?;
                let r = reply.get().map_err(|e| rpc_err(addr, e))?;
                let (data, size) = (r.get_data().map_err(|e| rpc_err(addr, e))?, r.get_size());
                if data.len() > SNAPSHOT_READ_MAX as usize || offset + data.len() as u64 > size {
                    return Err(ControlError::Protocol { addr: addr.into(), reason: "a snapshot piece larger than asked".into() });
                }
                out.write_all(data).map_err(|e| ControlError::Local { reason: format!("writing the snapshot: {e}") })?;
                offset += data.len() as u64;
                if offset == size {
                    return Ok(size);
                }
                if data.is_empty() {
                    return Err(ControlError::Protocol {
                        addr: addr.into(),
                        reason: format!("the snapshot ended at {offset} of its {size} bytes"),
                    });
                }
                nonce = r.get_next_nonce().map_err(|e| rpc_err(addr, e))?.to_vec();
            }
        }
        .await;
        driver.abort();
        r
    })
}

/// Writes the snapshot read from `input` (`size` bytes) to the server at
/// `addr` as `name`, in pieces of [`SNAPSHOT_WRITE_MAX`] bytes (each an
/// operator call whose proof covers its bytes). `limit` bounds the whole copy.
///
/// [`SNAPSHOT_WRITE_MAX`]: rgpu_protocol::auth::SNAPSHOT_WRITE_MAX
pub fn write_snapshot_in_calls(
    addr: &str,
    security: &ClientSecurity,
    admin_key: &[u8],
    name: &str,
    input: &mut dyn std::io::Read,
    size: u64,
    limit: Duration,
) -> Result<(), ControlError> {
    use rgpu_protocol::auth::{snapshot_write_name, SNAPSHOT_WRITE_MAX};
    run_for(addr, limit, async {
        let (server, driver) = connect(addr, security).await?;
        let r = async {
            let mut nonce = hello_and_nonce(addr, &server).await?;
            let mut offset = 0u64;
            let mut piece = vec![0u8; SNAPSHOT_WRITE_MAX as usize];
            loop {
                let n = (size - offset).min(SNAPSHOT_WRITE_MAX as u64) as usize;
                input
                    .read_exact(&mut piece[..n])
                    .map_err(|e| ControlError::Local { reason: format!("reading the snapshot at byte {offset}: {e}") })?;
                let last = offset + n as u64 == size;
                let named = snapshot_write_name(name, last, &piece[..n]);
                let proof = sign_bytes(admin_key, &server_op_message(&nonce, ServerOp::WriteSnapshot, offset, &named));
                let mut req = server.write_snapshot_request();
                let mut p = req.get();
                p.set_name(name);
                p.set_offset(offset);
                p.set_data(&piece[..n]);
                p.set_last(last);
                p.set_nonce(&nonce);
                p.set_proof(&proof);
                let reply = req.send().promise.await.map_err(|e| refused(addr, e))?;
                offset += n as u64;
                if last {
                    return Ok(());
                }
                nonce = reply.get().and_then(|r| r.get_next_nonce()).map_err(|e| rpc_err(addr, e))?.to_vec();
            }
        }
        .await;
        driver.abort();
        r
    })
}

/// What a live migration did, as the source server measured it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migrated {
    pub bytes: u64,
    pub memory_bytes: u64,
    /// From the call to the target's "rebuilt".
    pub took: Duration,
    /// How long the session was held still (no progress for its program).
    pub paused: Duration,
    /// Device memory sent while the program ran, and while it was held.
    pub precopied: u64,
    pub sent_held: u64,
}

/// Moves session `session` from the server at `addr` to the one at
/// `target` while its program runs (both servers hold the same admin key).
#[allow(clippy::too_many_arguments)]
pub fn migrate(
    addr: &str,
    security: &ClientSecurity,
    admin_key: &[u8],
    session: u64,
    target: &str,
    quiesce: Duration,
    limit: Duration,
) -> Result<Migrated, ControlError> {
    run_for(addr, limit, async {
        let (server, driver) = connect(addr, security).await?;
        let r = async {
            let nonce = hello_and_nonce(addr, &server).await?;
            let proof = sign_bytes(admin_key, &server_op_message(&nonce, ServerOp::Migrate, session, target));
            let mut req = server.migrate_request();
            let mut p = req.get();
            p.set_session_id(session);
            p.set_target(target);
            p.set_quiesce_ms(u32::try_from(quiesce.as_millis()).unwrap_or(u32::MAX));
            p.set_nonce(&nonce);
            p.set_proof(&proof);
            let reply = req.send().promise.await.map_err(|e| refused(addr, e))?;
            let r = reply.get().map_err(|e| rpc_err(addr, e))?;
            Ok(Migrated {
                bytes: r.get_bytes(),
                memory_bytes: r.get_memory_bytes(),
                took: Duration::from_micros(r.get_micros()),
                paused: Duration::from_micros(r.get_pause_micros()),
                precopied: r.get_precopy_bytes(),
                sent_held: r.get_held_bytes(),
            })
        }
        .await;
        driver.abort();
        r
    })
}

/// One session a server serves, as `listSessions` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionInfo {
    pub id: u64,
    pub client: String,
    /// 0: not under a broker lease.
    pub lease: u64,
    pub memory: u64,
    pub kernels: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
}

/// The sessions the server at `addr` serves now.
pub fn list_sessions(addr: &str, security: &ClientSecurity, admin_key: &[u8], limit: Duration) -> Result<Vec<SessionInfo>, ControlError> {
    run_for(addr, limit, async {
        let (server, driver) = connect(addr, security).await?;
        let r = async {
            let nonce = hello_and_nonce(addr, &server).await?;
            let proof = sign_bytes(admin_key, &server_op_message(&nonce, ServerOp::ListSessions, 0, ""));
            let mut req = server.list_sessions_request();
            req.get().set_nonce(&nonce);
            req.get().set_proof(&proof);
            let reply = req.send().promise.await.map_err(|e| refused(addr, e))?;
            let list = reply.get().and_then(|r| r.get_sessions()).map_err(|e| rpc_err(addr, e))?;
            let mut out = Vec::with_capacity(list.len() as usize);
            for s in list.iter() {
                let client = s.get_client().ok().and_then(|t| t.to_str().ok()).unwrap_or("").to_string();
                out.push(SessionInfo {
                    id: s.get_id(),
                    client,
                    lease: s.get_lease(),
                    memory: s.get_memory(),
                    kernels: s.get_kernels(),
                    bytes_in: s.get_bytes_in(),
                    bytes_out: s.get_bytes_out(),
                });
            }
            Ok(out)
        }
        .await;
        driver.abort();
        r
    })
}

/// The snapshots a suspension of broker lease `lease` left on the server
/// at `addr`, by name.
pub fn list_suspended(addr: &str, security: &ClientSecurity, admin_key: &[u8], lease: u64, limit: Duration) -> Result<Vec<String>, ControlError> {
    run_for(addr, limit, async {
        let (server, driver) = connect(addr, security).await?;
        let r = async {
            let nonce = hello_and_nonce(addr, &server).await?;
            let proof = sign_bytes(admin_key, &server_op_message(&nonce, ServerOp::ListSuspended, lease, ""));
            let mut req = server.list_suspended_request();
            req.get().set_lease(lease);
            req.get().set_nonce(&nonce);
            req.get().set_proof(&proof);
            let reply = req.send().promise.await.map_err(|e| refused(addr, e))?;
            let list = reply.get().and_then(|r| r.get_names()).map_err(|e| rpc_err(addr, e))?;
            let mut out = Vec::with_capacity(list.len() as usize);
            for n in list.iter() {
                let n = n.ok().and_then(|t| t.to_str().ok()).unwrap_or("").to_string();
                // A server's list is not trusted to name files only.
                if !rgpu_protocol::auth::valid_snapshot_name(&n) {
                    return Err(rpc_err(addr, capnp::Error::failed(format!("the server listed {n:?}, not a snapshot name"))));
                }
                out.push(n);
            }
            Ok(out)
        }
        .await;
        driver.abort();
        r
    })
}

/// A device's health after an operator's `injectFault` or `clearFault`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceHealth {
    pub healthy: bool,
    /// Why it is unhealthy (empty when healthy).
    pub reason: String,
}

/// Marks device `device` of the server at `addr` failing with `kind`
/// ("ecc", "xid:N"), or clears its fault (`kind` None). Only a sim server
/// takes one.
pub fn set_fault(
    addr: &str,
    security: &ClientSecurity,
    admin_key: &[u8],
    device: u32,
    kind: Option<&str>,
    limit: Duration,
) -> Result<DeviceHealth, ControlError> {
    run_for(addr, limit, async {
        let (server, driver) = connect(addr, security).await?;
        let r = async {
            let nonce = hello_and_nonce(addr, &server).await?;
            let read = |healthy: bool, reason: capnp::Result<capnp::text::Reader<'_>>| DeviceHealth {
                healthy,
                reason: reason.ok().and_then(|t| t.to_str().ok()).unwrap_or("").to_string(),
            };
            match kind {
                Some(kind) => {
                    let proof = sign_bytes(admin_key, &server_op_message(&nonce, ServerOp::InjectFault, device.into(), kind));
                    let mut req = server.inject_fault_request();
                    let mut p = req.get();
                    p.set_device(device);
                    p.set_kind(kind);
                    p.set_nonce(&nonce);
                    p.set_proof(&proof);
                    let reply = req.send().promise.await.map_err(|e| refused(addr, e))?;
                    let r = reply.get().map_err(|e| rpc_err(addr, e))?;
                    Ok(read(r.get_healthy(), r.get_reason()))
                }
                None => {
                    let proof = sign_bytes(admin_key, &server_op_message(&nonce, ServerOp::ClearFault, device.into(), ""));
                    let mut req = server.clear_fault_request();
                    let mut p = req.get();
                    p.set_device(device);
                    p.set_nonce(&nonce);
                    p.set_proof(&proof);
                    let reply = req.send().promise.await.map_err(|e| refused(addr, e))?;
                    let r = reply.get().map_err(|e| rpc_err(addr, e))?;
                    Ok(read(r.get_healthy(), r.get_reason()))
                }
            }
        }
        .await;
        driver.abort();
        r
    })
}
