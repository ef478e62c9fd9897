//! The client side of an rgpu-server's control plane (capnp-rpc): hello, the device inventory
//! (as the process's lease token lets it see it), and opening a session. Used by the shim
//! (`libcuda.so.1`, which then attaches the session's data plane) and by rgpu's
//! `libnvidia-ml.so.1`, which only reads the inventory.

pub mod client_key;
pub mod operator;
pub mod snapshot_copy;

use std::time::Duration;

use capnp_rpc::{rpc_twoparty_capnp, twoparty, RpcSystem};
use futures::AsyncReadExt;
use rgpu_protocol::control_capnp::gpu_server;
use rgpu_protocol::token::Claims;
use rgpu_protocol::{CONTROL_PREAMBLE, PROTOCOL_VERSION};
pub use rgpu_tls::ClientSecurity;
use tokio::io::AsyncWriteExt;

/// Why the control plane could not be used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ControlError {
    #[error("cannot reach rgpu-server at {addr}: {reason}")]
    Unreachable { addr: String, reason: String },
    #[error("rgpu-server at {addr} speaks protocol {theirs}, this client speaks {ours}")]
    VersionMismatch { addr: String, ours: u32, theirs: u32 },
    #[error("rgpu-server at {addr} sent a malformed reply: {reason}")]
    Protocol { addr: String, reason: String },
    /// TLS could not be set up, or this client and the server disagree on
    /// whether to use it; `reason` names the address.
    #[error("{reason}")]
    Tls { addr: String, reason: String },
    #[error("rgpu-server at {addr}: {reason}")]
    Refused { addr: String, reason: String },
    /// The lease token is bound to a client key this process cannot use.
    #[error("{reason}")]
    ClientKey { reason: String },
    /// A local file a call reads or writes (a snapshot copied off or onto a server).
    #[error("{reason}")]
    Local { reason: String },
}

type ClientError = ControlError;

/// One device as the server described it.
#[derive(Debug, Clone)]
pub struct RemoteDevice {
    pub ordinal: u32,
    pub name: String,
    pub uuid: [u8; 16],
    pub total_mem: u64,
    pub pci: (i32, i32, i32),
    pub attributes: Vec<(u32, i32)>,
}

/// A device UUID as NVML and nvidia-smi write it: `GPU-` and the 16 bytes as 8-4-4-4-12 hex
/// digits.
pub fn uuid_text(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

/// A PCI bus id as CUDA and NVML accept it: `domain:bus:device[.function]` or
/// `bus:device[.function]`, hexadecimal; (domain, bus, device).
pub fn parse_pci_bus_id(s: &str) -> Option<(i32, i32, i32)> {
    let s = s.split('.').next()?;
    let parts: Vec<&str> = s.split(':').collect();
    let hex = |p: &str| i32::from_str_radix(p, 16).ok();
    match parts.as_slice() {
        [d, b, v] => Some((hex(d)?, hex(b)?, hex(v)?)),
        [b, v] => Some((0, hex(b)?, hex(v)?)),
        _ => None,
    }
}

/// A server's devices as this process may use them.
#[derive(Debug)]
pub struct Inventory {
    pub server_name: String,
    pub backend: String,
    /// The lease's GPUs when the process holds a token for some of them, else all; a lease's
    /// memory limit caps `total_mem`.
    pub devices: Vec<RemoteDevice>,
    /// The lease token that admits this process on the server, with its claims.
    pub token: Option<(Vec<u8>, Claims)>,
}

#[derive(Debug)]
pub struct Hello {
    pub server_name: String,
    pub backend: String,
    pub devices: Vec<RemoteDevice>,
    pub session_id: u64,
    pub key: Vec<u8>,
    /// The lease's InfiniBand partition, for the data connection's RDMA set-up.
    pub pkey: Option<u16>,
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const CONTROL_TIMEOUT: Duration = Duration::from_secs(15);

/// Says hello, lists the devices and opens a session on `addr`, over TLS
/// or plaintext as `security` says.
pub fn open(addr: &str, client_name: &str, security: &ClientSecurity) -> Result<Hello, ClientError> {
    run(addr, open_async(addr, client_name, security, true)).and_then(|(_, hello)| {
        hello.ok_or_else(|| ClientError::Protocol { addr: addr.into(), reason: "no session was opened".into() })
    })
}

/// Says hello and lists the devices on `addr`, opening no session.
pub fn inventory(addr: &str, client_name: &str, security: &ClientSecurity) -> Result<Inventory, ClientError> {
    run(addr, open_async(addr, client_name, security, false)).map(|(inventory, _)| inventory)
}

/// Runs one control-plane exchange on a runtime of its own, bounded in time: the callers are
/// synchronous C entry points.
fn run<T>(addr: &str, f: impl std::future::Future<Output = Result<T, ClientError>>) -> Result<T, ClientError> {
    run_for(addr, CONTROL_TIMEOUT, f)
}

fn run_for<T>(
    addr: &str,
    limit: Duration,
    f: impl std::future::Future<Output = Result<T, ClientError>>,
) -> Result<T, ClientError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| unreachable_err(addr, e))?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        match tokio::time::timeout(limit, f).await {
            Ok(r) => r,
            Err(_) => Err(ClientError::Unreachable {
                addr: addr.into(),
                reason: format!("no answer within {}s", limit.as_secs()),
            }),
        }
    })
}

fn unreachable_err(addr: &str, e: impl std::fmt::Display) -> ClientError {
    ClientError::Unreachable { addr: addr.into(), reason: e.to_string() }
}

fn rpc_err(addr: &str, e: capnp::Error) -> ClientError {
    ClientError::Protocol { addr: addr.into(), reason: e.to_string() }
}

/// A device's memory now, as [`device_status`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceStatus {
    pub ordinal: u32,
    /// The lease's memory limit where it has one, else the device's memory.
    pub total_mem: u64,
    /// Bytes the lease's sessions (without a lease: all sessions) hold.
    pub used_mem: u64,
    /// Those sessions' client processes holding memory on the device: (pid, bytes).
    pub processes: Vec<(u32, u64)>,
    /// The whole device's sensors and activity (not the lease's share).
    pub telemetry: Telemetry,
}

/// One sensor reading of a device, and where it came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reading {
    /// The server does not report it (its backend has no such reading, the GPU does not
    /// support it, or the server predates telemetry).
    #[default]
    NotReported,
    /// Observed: NVML on the server's GPU, or the sim timing its own work.
    Measured(u32),
    /// A constant the sim reports in place of a sensor it does not have.
    Simulated(u32),
}

impl Reading {
    /// The value, whichever its source; None when not reported.
    pub fn value(self) -> Option<u32> {
        match self {
            Reading::NotReported => None,
            Reading::Measured(v) | Reading::Simulated(v) => Some(v),
        }
    }

    fn read(r: capnp::Result<rgpu_protocol::control_capnp::reading::Reader<'_>>) -> Reading {
        use rgpu_protocol::control_capnp::ReadingSource as S;
        let Ok(r) = r else { return Reading::NotReported };
        match r.get_source() {
            Ok(S::Measured) => Reading::Measured(r.get_value()),
            Ok(S::Simulated) => Reading::Simulated(r.get_value()),
            // A source this client does not know is not a value it can vouch for.
            Ok(S::None) | Err(_) => Reading::NotReported,
        }
    }
}

/// What a device's server reports of its sensors and activity now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Telemetry {
    /// Percent of the last sample period (about 1 s) during which a kernel ran.
    pub gpu_utilization: Reading,
    /// Percent of the last sample period during which device memory was read or written.
    pub memory_utilization: Reading,
    /// Degrees Celsius, the GPU die.
    pub temperature: Reading,
    /// Milliwatts the board draws.
    pub power_usage: Reading,
    /// Milliwatts, the enforced power limit.
    pub power_limit: Reading,
}

/// The memory of each device on `addr` as this process may see it: with a
/// lease token (`RGPU_TOKEN`) for the server, its lease's devices and use.
pub fn device_status(addr: &str, client_name: &str, security: &ClientSecurity) -> Result<Vec<DeviceStatus>, ClientError> {
    run(addr, async {
        let inventory = open_async(addr, client_name, security, false).await?.0;
        let (server, driver, _, channel) = connect(addr, security).await?;
        let result = async {
            let (nonce, proof) = possession(&server, addr, inventory.token.as_ref(), channel).await?;
            let mut req = server.device_status_request();
            req.get().set_token(inventory.token.as_ref().map_or(&[][..], |(t, _)| t.as_slice()));
            req.get().set_nonce(&nonce);
            req.get().set_proof(&proof);
            let reply = req.send().promise.await.map_err(|e| rpc_err(addr, e))?;
            let list = reply.get().and_then(|r| r.get_devices()).map_err(|e| rpc_err(addr, e))?;
            Ok(list
                .iter()
                .map(|d| DeviceStatus {
                    ordinal: d.get_ordinal(),
                    total_mem: d.get_total_mem(),
                    used_mem: d.get_used_mem(),
                    processes: d
                        .get_processes()
                        .map(|l| l.iter().map(|p| (p.get_pid(), p.get_used_mem())).collect())
                        .unwrap_or_default(),
                    telemetry: Telemetry {
                        gpu_utilization: Reading::read(d.get_gpu_utilization()),
                        memory_utilization: Reading::read(d.get_memory_utilization()),
                        temperature: Reading::read(d.get_temperature()),
                        power_usage: Reading::read(d.get_power_usage()),
                        power_limit: Reading::read(d.get_power_limit()),
                    },
                })
                .collect())
        }
        .await;
        driver.abort();
        result
    })
}

/// The proof that this process holds the key `token` is bound to, for a
/// request on the connection to `addr` whose TLS exporter value is
/// `channel`: (nonce, proof), both empty for a bearer token.
async fn possession(
    server: &gpu_server::Client,
    addr: &str,
    token: Option<&(Vec<u8>, Claims)>,
    channel: Option<[u8; 32]>,
) -> Result<(Vec<u8>, Vec<u8>), ClientError> {
    let Some((token, Claims { client_key: Some(bound), .. })) = token else { return Ok((Vec::new(), Vec::new())) };
    let unusable = |reason: String| ClientError::ClientKey { reason };
    let path = client_key::path().map_err(|e| unusable(e.to_string()))?;
    let fp = rgpu_protocol::binding::fingerprint(bound);
    let key = client_key::load(&path).map_err(|e| {
        unusable(format!("the lease token is bound to client key {fp}, and this host cannot use one: {e}"))
    })?;
    if key.public() != *bound {
        return Err(unusable(format!(
            "the lease token is bound to client key {fp}, not to this host's ({}, {}): run where the lease was taken,              or point {} at its key file",
            rgpu_protocol::binding::fingerprint(&key.public()),
            path.display(),
            client_key::ENV
        )));
    }
    let reply = server.challenge_request().send().promise.await.map_err(|e| rpc_err(addr, e))?;
    let nonce = reply.get().and_then(|r| r.get_nonce()).map_err(|e| rpc_err(addr, e))?.to_vec();
    let proof = key.prove(&nonce, channel.as_ref(), token);
    Ok((nonce, proof))
}

/// A control connection to `addr` (TLS first as `security` says, then the
/// preamble), the task driving its RPC system, what the TLS layer saw, and
/// the connection's channel binding (None in plaintext).
#[allow(clippy::type_complexity)]
async fn connect(
    addr: &str,
    security: &ClientSecurity,
) -> Result<
    (gpu_server::Client, tokio::task::JoinHandle<Result<(), capnp::Error>>, rgpu_tls::guard::Refusal, Option<[u8; 32]>),
    ClientError,
> {
    let tcp = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr))
        .await
        .map_err(|_| unreachable_err(addr, "connection timed out"))?
        .map_err(|e| unreachable_err(addr, e))?;
    tcp.set_nodelay(true).map_err(|e| unreachable_err(addr, e))?;
    // TLS first, the preamble inside it (the server reads it after the
    // handshake): an observer sees neither the plane nor anything after.
    let (mut stream, refusal, channel) = rgpu_tls::client::connect_bound(security, addr, tcp)
        .await
        .map_err(|e| ClientError::Tls { addr: addr.into(), reason: e.to_string() })?;
    stream.write_all(CONTROL_PREAMBLE).await.map_err(|e| unreachable_err(addr, e))?;
    stream.flush().await.map_err(|e| unreachable_err(addr, e))?;
    let (reader, writer) = tokio_util::compat::TokioAsyncReadCompatExt::compat(stream).split();
    let network = twoparty::VatNetwork::new(
        futures::io::BufReader::new(reader),
        futures::io::BufWriter::new(writer),
        rpc_twoparty_capnp::Side::Client,
        Default::default(),
    );
    let mut rpc = RpcSystem::new(Box::new(network), None);
    let server: gpu_server::Client = rpc.bootstrap(rpc_twoparty_capnp::Side::Server);
    let driver = tokio::task::spawn_local(rpc);
    Ok((server, driver, refusal, channel))
}

async fn open_async(
    addr: &str,
    client_name: &str,
    security: &ClientSecurity,
    session: bool,
) -> Result<(Inventory, Option<Hello>), ClientError> {
    let (server, driver, refusal, channel) = connect(addr, security).await?;
    let result = async {
        let mut req = server.hello_request();
        req.get().set_client_version(PROTOCOL_VERSION);
        req.get().set_client_name(client_name);
        let reply = req.send().promise.await.map_err(|e| rpc_err(addr, e))?;
        let hello = reply.get().map_err(|e| rpc_err(addr, e))?;
        let theirs = hello.get_server_version();
        if theirs != PROTOCOL_VERSION {
            return Err(ClientError::VersionMismatch { addr: addr.into(), ours: PROTOCOL_VERSION, theirs });
        }
        let text = |t: capnp::Result<capnp::text::Reader<'_>>| -> String {
            t.ok().and_then(|t| t.to_str().ok()).unwrap_or("").to_string()
        };
        let server_name = text(hello.get_server_name());
        let backend = text(hello.get_backend());

        let reply = server.list_devices_request().send().promise.await.map_err(|e| rpc_err(addr, e))?;
        let list = reply.get().and_then(|r| r.get_devices()).map_err(|e| rpc_err(addr, e))?;
        let mut devices: Vec<RemoteDevice> = Vec::with_capacity(list.len() as usize);
        for d in list.iter() {
            let uuid_bytes = d.get_uuid().map_err(|e| rpc_err(addr, e))?;
            let mut uuid = [0u8; 16];
            if uuid_bytes.len() != 16 {
                return Err(ClientError::Protocol { addr: addr.into(), reason: "device uuid is not 16 bytes".into() });
            }
            uuid.copy_from_slice(uuid_bytes);
            let attrs = d.get_attributes().map_err(|e| rpc_err(addr, e))?;
            devices.push(RemoteDevice {
                ordinal: d.get_ordinal(),
                name: text(d.get_name()),
                uuid,
                total_mem: d.get_total_mem(),
                pci: (d.get_pci_domain(), d.get_pci_bus(), d.get_pci_device()),
                attributes: attrs.iter().map(|a| (a.get_id(), a.get_value())).collect(),
            });
        }

        // A lease token (RGPU_TOKEN) admits this process on a pooled server
        // and says which of its GPUs are ours: only those become devices.
        let token = pick_token(&lease_tokens(), &devices);
        if let Some((_, claims)) = &token {
            let ours: Vec<RemoteDevice> =
                devices.iter().filter(|d| claims.gpus.contains(&d.uuid)).cloned().collect();
            if !ours.is_empty() {
                devices = ours;
            }
            if claims.memory_limit > 0 {
                for d in &mut devices {
                    d.total_mem = d.total_mem.min(claims.memory_limit);
                }
            }
        }
        if !session {
            return Ok((Inventory { server_name, backend, devices, token }, None));
        }
        let (nonce, proof) = possession(&server, addr, token.as_ref(), channel).await?;
        let mut req = server.open_session_request();
        req.get().set_token(token.as_ref().map_or(&[][..], |(t, _)| t.as_slice()));
        req.get().set_nonce(&nonce);
        req.get().set_proof(&proof);
        req.get().set_client_name(client_name);
        let reply = req.send().promise.await.map_err(|e| rpc_err(addr, e))?;
        let s = reply.get().map_err(|e| rpc_err(addr, e))?;
        let key = s.get_key().map_err(|e| rpc_err(addr, e))?.to_vec();
        let pkey = token.as_ref().and_then(|(_, c)| c.pkey);
        let hello = Hello {
            server_name: server_name.clone(),
            backend: backend.clone(),
            devices: devices.clone(),
            session_id: s.get_session_id(),
            key,
            pkey,
        };
        Ok((Inventory { server_name, backend, devices, token }, Some(hello)))
    }
    .await;
    driver.abort();
    if result.is_err() && refusal.needs_tls() {
        let reason = rgpu_tls::TlsError::ServerWantsTls { addr: addr.into() }.to_string();
        return Err(ClientError::Tls { addr: addr.into(), reason });
    }
    result
}

/// Tokens from `RGPU_TOKEN`: hex, several separated by commas (one per
/// lease, as `rgpu run` sets it).
fn lease_tokens() -> Vec<Vec<u8>> {
    let v = std::env::var("RGPU_TOKEN").unwrap_or_default();
    v.split(',').filter(|s| !s.trim().is_empty()).filter_map(rgpu_protocol::token::from_hex).collect()
}

/// The token for this server: the first whose GPUs it has; else, if there
/// is exactly one token, that one (the server will say why it refuses it).
fn pick_token(tokens: &[Vec<u8>], devices: &[RemoteDevice]) -> Option<(Vec<u8>, Claims)> {
    let decoded: Vec<(Vec<u8>, Claims)> = tokens
        .iter()
        .filter_map(|t| Claims::decode_unverified(t).ok().map(|c| (t.clone(), c)))
        .collect();
    if let Some(hit) = decoded.iter().find(|(_, c)| devices.iter().any(|d| c.gpus.contains(&d.uuid))) {
        return Some(hit.clone());
    }
    if tokens.len() == 1 {
        let t = tokens[0].clone();
        let c = Claims::decode_unverified(&t).unwrap_or(Claims {
            lease_id: 0,
            generation: 0,
            deadline_ms: 0,
            memory_limit: 0,
            tenant: String::new(),
            gpus: Vec::new(),
            pkey: None,
            compute_milli: 0,
            client_key: None,
        });
        return Some((t, c));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_ids_parse_like_cuda() {
        assert_eq!(parse_pci_bus_id("00000000:10:00.0"), Some((0, 0x10, 0)));
        assert_eq!(parse_pci_bus_id("0000:1A:03.0"), Some((0, 0x1a, 3)));
        assert_eq!(parse_pci_bus_id("1a:03.0"), Some((0, 0x1a, 3)));
        assert_eq!(parse_pci_bus_id("zz"), None);
    }

    #[test]
    fn uuids_look_like_nvidias() {
        let u = [0x2d, 0xd4, 0x93, 0xf4, 0x12, 0xb4, 0x89, 0x08, 0xa8, 0x43, 0x67, 0, 0x4c, 0xab, 0xc8, 0x53];
        assert_eq!(uuid_text(&u), "GPU-2dd493f4-12b4-8908-a843-67004cabc853");
    }
}
