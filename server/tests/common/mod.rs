//! A small test client for rgpu-server over real sockets: the control plane
//! through capnp-rpc, the data plane as raw frames on a `TcpTransport`.
#![allow(dead_code)]

pub mod kernels;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rgpu_protocol::control_capnp::gpu_server;
use rgpu_protocol::data_capnp::{reply, request};
use rgpu_protocol::frame::{FrameHeader, Kind, HEADER_LEN};
use rgpu_protocol::message::{Encoder, RecvBuf};
use rgpu_protocol::{CONTROL_PREAMBLE, DATA_PREAMBLE, PROTOCOL_VERSION, RESUME_PREAMBLE};
use rgpu_server::backend::sim::{SimBackend, SimConfig};
use rgpu_server::config::{BackendKind, Config};
use rgpu_tls::ClientSecurity;
use rgpu_transport::tcp::{self, TcpTransport};
use rgpu_transport::Transport;
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

pub const IO_TIMEOUT: Duration = Duration::from_secs(10);

pub struct TestServer {
    pub addr: SocketAddr,
    /// Where it serves Prometheus metrics (`start_with_metrics`).
    pub metrics: Option<SocketAddr>,
    shutdown: CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TestServer {
    pub fn start() -> TestServer {
        Self::start_with(1, 256 << 20, Duration::from_secs(30))
    }

    pub fn start_with(devices: u32, memory: u64, attach_timeout: Duration) -> TestServer {
        Self::start_pool(devices, memory, attach_timeout, Default::default())
    }

    /// As `start`, with these connection and input bounds.
    pub fn start_limited(limits: rgpu_server::limits::Limits) -> TestServer {
        Self::start_full(1, 256 << 20, Duration::from_secs(30), Default::default(), limits)
    }

    /// As `start_with`, with pool settings (a broker key: lease tokens).
    pub fn start_pool(
        devices: u32,
        memory: u64,
        attach_timeout: Duration,
        pool: rgpu_server::config::PoolConfig,
    ) -> TestServer {
        Self::start_full(devices, memory, attach_timeout, pool, Default::default())
    }

    pub fn start_full(
        devices: u32,
        memory: u64,
        attach_timeout: Duration,
        pool: rgpu_server::config::PoolConfig,
        limits: rgpu_server::limits::Limits,
    ) -> TestServer {
        Self::start_configured(devices, memory, attach_timeout, pool, limits, rgpu_server::backend::sim::kernels::DEFAULT_TIME_LIMIT, false)
    }

    /// As `start_with`, serving Prometheus metrics on a loopback port too.
    pub fn start_with_metrics(devices: u32, memory: u64) -> TestServer {
        let limit = rgpu_server::backend::sim::kernels::DEFAULT_TIME_LIMIT;
        Self::start_configured(devices, memory, Duration::from_secs(30), Default::default(), Default::default(), limit, true)
    }

    /// As `start`, serving both planes as `security` says (TLS with a
    /// certificate, for the tests of TLS).
    pub fn start_secured(security: rgpu_tls::ServerSecurity) -> TestServer {
        Self::start_secured_limited(security, Default::default())
    }

    /// As `start_secured`, with these limits.
    pub fn start_secured_limited(security: rgpu_tls::ServerSecurity, limits: rgpu_server::limits::Limits) -> TestServer {
        Self::start_inner(1, 256 << 20, Duration::from_secs(30), Default::default(), limits,
            rgpu_server::backend::sim::kernels::DEFAULT_TIME_LIMIT, false, security, Default::default())
    }

    /// As `start_secured`, with checkpoints (an admin key, a snapshot folder).
    pub fn start_secured_checkpointing(
        security: rgpu_tls::ServerSecurity,
        checkpoint: rgpu_server::config::CheckpointConfig,
    ) -> TestServer {
        Self::start_inner(1, 256 << 20, Duration::from_secs(30), Default::default(), Default::default(),
            rgpu_server::backend::sim::kernels::DEFAULT_TIME_LIMIT, false, security, checkpoint)
    }

    /// As `start`, with this kernel time limit.
    pub fn start_with_kernel_limit(limit: Duration) -> TestServer {
        Self::start_configured(1, 256 << 20, Duration::from_secs(30), Default::default(), Default::default(), limit, false)
    }

    fn start_configured(
        devices: u32,
        memory: u64,
        attach_timeout: Duration,
        pool: rgpu_server::config::PoolConfig,
        limits: rgpu_server::limits::Limits,
        kernel_time_limit: Duration,
        metrics: bool,
    ) -> TestServer {
        // The tests of TLS itself start theirs with `start_secured`.
        let plaintext = rgpu_tls::ServerSecurity::Plaintext;
        Self::start_inner(devices, memory, attach_timeout, pool, limits, kernel_time_limit, metrics, plaintext, Default::default())
    }

    #[allow(clippy::too_many_arguments)]
    fn start_inner(
        devices: u32,
        memory: u64,
        attach_timeout: Duration,
        pool: rgpu_server::config::PoolConfig,
        limits: rgpu_server::limits::Limits,
        kernel_time_limit: Duration,
        metrics: bool,
        security: rgpu_tls::ServerSecurity,
        checkpoint: rgpu_server::config::CheckpointConfig,
    ) -> TestServer {
        let config = Config {
            listen: "127.0.0.1:0".into(),
            backend: BackendKind::Sim,
            cuda_movable_memory: false,
            sim: SimConfig {
                devices,
                memory,
                compute_capability: (9, 0),
                seed: None,
                kernel_time_limit,
                compiled_tier: true,
            },
            attach_timeout,
            max_connections: 64,
            limits,
            transport: Default::default(),
            pool,
            metrics: None,
            security,
            checkpoint,
        };
        let backend: Arc<dyn rgpu_server::backend::Backend> =
            Arc::new(SimBackend::new(&config.sim).expect("sim backend"));
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        std_listener.set_nonblocking(true).unwrap();
        let addr = std_listener.local_addr().unwrap();
        let metrics_listener = metrics.then(|| {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.set_nonblocking(true).unwrap();
            l
        });
        let metrics = metrics_listener.as_ref().map(|l| l.local_addr().unwrap());
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(std_listener).unwrap();
                let metrics = metrics_listener.map(|l| tokio::net::TcpListener::from_std(l).unwrap());
                let data_plane = rgpu_server::transport_select::DataPlane::tcp_only();
                rgpu_server::serve_draining(listener, metrics, backend, data_plane, &config, token.clone(), token)
                    .await;
            });
        });
        TestServer { addr, metrics, shutdown, thread: Some(thread) }
    }

    /// Says hello, lists devices and opens a session.
    pub fn open(&self) -> Hello {
        control(&self.addr.to_string())
    }

    /// Opens a session and attaches its data connection.
    pub fn session(&self) -> DataClient {
        let h = self.open();
        DataClient::attach(&self.addr.to_string(), h.session_id, &h.key).expect("attach")
    }

    /// Stops the server and waits (bounded) for it to finish.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        self.shutdown.cancel();
        if let Some(t) = self.thread.take() {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !t.is_finished() {
                assert!(std::time::Instant::now() < deadline, "server did not shut down in 10 s");
                std::thread::sleep(Duration::from_millis(10));
            }
            t.join().unwrap();
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.stop_inner();
        } else {
            self.shutdown.cancel();
        }
    }
}

#[derive(Debug, Clone)]
pub struct Device {
    pub ordinal: u32,
    pub name: String,
    pub uuid: Vec<u8>,
    pub total_mem: u64,
    pub pci: (i32, i32, i32),
    pub attributes: Vec<(u32, i32)>,
}

#[derive(Debug, Clone)]
pub struct Hello {
    pub server_version: u32,
    pub server_name: String,
    pub backend: String,
    pub devices: Vec<Device>,
    pub session_id: u64,
    pub key: Vec<u8>,
    pub attach_timeout_ms: u32,
}

/// hello + listDevices + openSession on a fresh control connection.
pub fn control(addr: &str) -> Hello {
    control_with_version(addr, PROTOCOL_VERSION).expect("control plane")
}

pub fn control_with_version(addr: &str, version: u32) -> Result<Hello, capnp::Error> {
    control_with(addr, version, Some(&[]), "test")
}

/// hello + listDevices + openSession presenting a lease token.
pub fn control_with_token(addr: &str, token: &[u8]) -> Result<Hello, capnp::Error> {
    control_with(addr, PROTOCOL_VERSION, Some(token), "test")
}

/// hello + listDevices only (no session).
pub fn list_devices(addr: &str) -> Vec<Device> {
    control_with(addr, PROTOCOL_VERSION, None, "test").expect("control plane").devices
}

/// As [`control_with_token`], the session opened under `client_name` (as the shim names
/// itself: `exe (pid N)`).
pub fn control_named(addr: &str, token: &[u8], client_name: &str) -> Result<Hello, capnp::Error> {
    control_with(addr, PROTOCOL_VERSION, Some(token), client_name)
}

fn control_with(addr: &str, version: u32, token: Option<&[u8]>, client_name: &str) -> Result<Hello, capnp::Error> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        tokio::time::timeout(IO_TIMEOUT, control_async(addr, version, token, client_name))
            .await
            .expect("control plane timed out")
    })
}

async fn control_async(addr: &str, version: u32, token: Option<&[u8]>, client_name: &str) -> Result<Hello, capnp::Error> {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(CONTROL_PREAMBLE).await.unwrap();
    let conn = rgpu_broker_client::rpc::bootstrap::<gpu_server::Client, _>(stream);
    let server = conn.client();
    let result = async {
        let text = |t: capnp::Result<capnp::text::Reader<'_>>| t.unwrap().to_string().unwrap();
        let mut req = server.hello_request();
        req.get().set_client_version(version);
        req.get().set_client_name("test");
        let reply = req.send().promise.await?;
        let h = reply.get()?;
        let (server_version, server_name, backend) =
            (h.get_server_version(), text(h.get_server_name()), text(h.get_backend()));
        let reply = server.list_devices_request().send().promise.await?;
        let mut devices = Vec::new();
        for d in reply.get()?.get_devices()?.iter() {
            devices.push(Device {
                ordinal: d.get_ordinal(),
                name: text(d.get_name()),
                uuid: d.get_uuid()?.to_vec(),
                total_mem: d.get_total_mem(),
                pci: (d.get_pci_domain(), d.get_pci_bus(), d.get_pci_device()),
                attributes: d.get_attributes()?.iter().map(|a| (a.get_id(), a.get_value())).collect(),
            });
        }
        let Some(token) = token else {
            let (session_id, key, attach_timeout_ms) = (0, Vec::new(), 0);
            return Ok(Hello { server_version, server_name, backend, devices, session_id, key, attach_timeout_ms });
        };
        let mut req = server.open_session_request();
        req.get().set_token(token);
        req.get().set_client_name(client_name);
        let reply = req.send().promise.await?;
        let s = reply.get()?;
        Ok(Hello {
            server_version,
            server_name,
            backend,
            devices,
            session_id: s.get_session_id(),
            key: s.get_key()?.to_vec(),
            attach_timeout_ms: s.get_attach_timeout_ms(),
        })
    }
    .await;
    drop(conn);
    result
}

/// One device as `deviceStatus` shows it: ordinal, total, used, processes as (pid, bytes).
type StatusRow = (u32, u64, u64, Vec<(u32, u64)>);

/// deviceStatus presenting `token` (empty: none), every field of every device.
fn device_status_rows(addr: &str, token: &[u8]) -> Result<Vec<StatusRow>, capnp::Error> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.write_all(CONTROL_PREAMBLE).await.unwrap();
        let conn = rgpu_broker_client::rpc::bootstrap::<gpu_server::Client, _>(stream);
        let server = conn.client();
        let mut req = server.device_status_request();
        req.get().set_token(token);
        let reply = tokio::time::timeout(IO_TIMEOUT, req.send().promise).await.expect("control plane timed out")?;
        let mut out = Vec::new();
        for d in reply.get()?.get_devices()? {
            let procs = d.get_processes()?.iter().map(|p| (p.get_pid(), p.get_used_mem())).collect();
            out.push((d.get_ordinal(), d.get_total_mem(), d.get_used_mem(), procs));
        }
        drop(conn);
        Ok(out)
    })
}

/// One reading of `deviceStatus`: its source ("none", "measured", "simulated") and value.
pub type Reading = (&'static str, u32);

/// Each device's readings in `deviceStatus` (no token): GPU utilization, memory utilization,
/// temperature, power, power limit.
pub fn device_telemetry(addr: &str) -> Result<Vec<[Reading; 5]>, capnp::Error> {
    use rgpu_protocol::control_capnp::{reading, ReadingSource as S};
    let read = |r: reading::Reader<'_>| -> Result<Reading, capnp::Error> {
        let source = match r.get_source()? {
            S::None => "none",
            S::Measured => "measured",
            S::Simulated => "simulated",
        };
        Ok((source, r.get_value()))
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.write_all(CONTROL_PREAMBLE).await.unwrap();
        let conn = rgpu_broker_client::rpc::bootstrap::<gpu_server::Client, _>(stream);
        let reply = tokio::time::timeout(IO_TIMEOUT, conn.client().device_status_request().send().promise)
            .await
            .expect("control plane timed out")?;
        let mut out = Vec::new();
        for d in reply.get()?.get_devices()? {
            out.push([
                read(d.get_gpu_utilization()?)?,
                read(d.get_memory_utilization()?)?,
                read(d.get_temperature()?)?,
                read(d.get_power_usage()?)?,
                read(d.get_power_limit()?)?,
            ]);
        }
        drop(conn);
        Ok(out)
    })
}

/// deviceStatus presenting `token` (empty: none): (ordinal, total, used) per device.
pub fn device_status(addr: &str, token: &[u8]) -> Result<Vec<(u32, u64, u64)>, capnp::Error> {
    Ok(device_status_rows(addr, token)?.into_iter().map(|(o, t, u, _)| (o, t, u)).collect())
}

/// Each device `deviceStatus` shows with `token`: (ordinal, its processes as (pid, bytes)).
pub fn device_processes(addr: &str, token: &[u8]) -> Result<Vec<(u32, Vec<(u32, u64)>)>, capnp::Error> {
    Ok(device_status_rows(addr, token)?.into_iter().map(|(o, _, _, p)| (o, p)).collect())
}

#[derive(Debug, Clone, PartialEq)]
pub enum Body {
    None,
    MemAlloc(u64),
    MemInfo { free: u64, total: u64 },
    Elapsed(f32),
    Module(Loaded),
    IpcHandle { id: u64, secret: Vec<u8> },
    IpcOpened { ptr: u64, size: u64 },
}

/// (name, params as (offset, size), maxThreadsPerBlock, numRegs)
pub type Function = (String, Vec<(u32, u32)>, i32, i32);

#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    pub functions: Vec<Function>,
    pub globals: Vec<(String, u64, u64)>,
    pub note: String,
}

#[derive(Debug, Clone)]
pub struct Reply {
    pub seq: u64,
    pub result: u32,
    pub deferred: u32,
    pub body: Body,
    pub bulk: Vec<u8>,
}

impl Reply {
    pub fn ptr(&self) -> u64 {
        match self.body {
            Body::MemAlloc(p) => p,
            ref b => panic!("expected a memAlloc reply, got {b:?} (result {})", self.result),
        }
    }
}

/// With `RGPU_FUZZ_RECORD=DIR`, each request frame a test sends (header and
/// message, without bulk) is kept in DIR as a seed of the `frame` fuzz
/// target: at most 3 per request kind, each different
/// (`fuzz/regen-corpus.sh`).
fn record_frame(header: &[u8], msg: &[u8]) {
    let Some(dir) = std::env::var_os("RGPU_FUZZ_RECORD") else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    let Ok(m) = capnp::serialize::read_message_from_flat_slice(&mut &msg[..], Default::default()) else {
        return;
    };
    let Ok(cmd) = m.get_root::<request::Reader>().and_then(rgpu_server::command::Command::decode) else {
        return;
    };
    let name = cmd.name();
    let frame = [header, msg].concat();
    // FNV-1a of the frame, without its seq (bytes 8..16), names the file.
    let hash = frame
        .iter()
        .enumerate()
        .filter(|(i, _)| !(8..16).contains(i))
        .fold(0xcbf29ce484222325u64, |h, (_, &b)| (h ^ b as u64).wrapping_mul(0x100000001b3));
    let _ = std::fs::create_dir_all(&dir);
    let kept = std::fs::read_dir(&dir)
        .map(|d| d.filter(|e| e.as_ref().is_ok_and(|e| e.file_name().to_string_lossy().starts_with(&format!("{name}-")))).count())
        .unwrap_or(0);
    let path = dir.join(format!("{name}-{hash:016x}"));
    if kept < 3 && !path.exists() {
        let _ = std::fs::write(path, frame);
    }
}

pub struct DataClient {
    pub t: TcpTransport,
    /// How resumed connections are dialled.
    security: ClientSecurity,
    enc: Encoder,
    recv: RecvBuf,
    seq: u64,
    addr: String,
    id: u64,
    key: Vec<u8>,
    /// The last reply received.
    pub last_reply: u64,
    /// Keepalive frames read so far.
    pub keepalives: u64,
    /// Dropping sends the orderly Close (as the shim does at exit); `cut`
    /// drops without it, as a killed client or a broken network does.
    close_on_drop: bool,
    /// With `RGPU_FUZZ_RECORD`, everything this client sent (a seed of the
    /// `session` fuzz target, written when it is dropped).
    recorded: Option<Vec<u8>>,
}

impl Drop for DataClient {
    fn drop(&mut self) {
        if self.close_on_drop {
            let _ = self.t.send(&[&FrameHeader::bare(Kind::Close).encode()]);
        }
        let (Some(dir), Some(r)) = (std::env::var_os("RGPU_FUZZ_RECORD"), self.recorded.take()) else {
            return;
        };
        let dir = std::path::PathBuf::from(dir).join("../session");
        let n = std::fs::read_dir(&dir).map(|d| d.count()).unwrap_or(0);
        if !r.is_empty() && r.len() <= 32 << 10 && n < 40 {
            let _ = std::fs::create_dir_all(&dir);
            let _ = std::fs::write(dir.join(format!("session-{}-{n:02}", std::process::id())), r);
        }
    }
}

/// A new connection to `addr`, its TLS handshake done when `security` says
/// TLS (as the shim's attach and redial do).
pub fn dial(addr: &str, security: &ClientSecurity) -> TcpTransport {
    let t = tcp::connect(addr, IO_TIMEOUT).unwrap();
    let t = match security {
        ClientSecurity::Plaintext => t,
        ClientSecurity::Tls(tls) => {
            let mut s = t.into_stream().unwrap();
            s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
            let conn = rgpu_tls::client::handshake_blocking(tls, addr, &mut s).expect("TLS handshake");
            TcpTransport::with_tls(s, conn.into()).unwrap()
        }
    };
    t.stream().set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    t
}

/// Opens a data connection; `Err(status)` when the server refuses it.
pub fn attach_raw(addr: &str, id: u64, key: &[u8]) -> (TcpTransport, u32, u32) {
    let mut t = dial(addr, &ClientSecurity::Plaintext);
    t.send(&[DATA_PREAMBLE, &id.to_le_bytes(), key]).unwrap();
    let mut st = [0u8; 8];
    t.recv_exact(&mut st).unwrap();
    let status = u32::from_le_bytes(st[..4].try_into().unwrap());
    let version = u32::from_le_bytes(st[4..].try_into().unwrap());
    (t, status, version)
}

impl DataClient {
    /// Over a transport whose session (`id`, `key` on `addr`) is already
    /// attached; resumes dial with `security`.
    pub fn over(t: TcpTransport, addr: &str, id: u64, key: &[u8], security: ClientSecurity) -> DataClient {
        let mut c = Self::new(t, addr, id, key);
        c.security = security;
        c
    }

    pub fn attach(addr: &str, id: u64, key: &[u8]) -> Result<DataClient, u32> {
        let (t, status, version) = attach_raw(addr, id, key);
        assert_eq!(version, PROTOCOL_VERSION);
        if status != 0 {
            return Err(status);
        }
        Ok(Self::new(t, addr, id, key))
    }

    fn new(t: TcpTransport, addr: &str, id: u64, key: &[u8]) -> DataClient {
        DataClient {
            t,
            security: ClientSecurity::Plaintext,
            enc: Encoder::default(),
            recv: RecvBuf::default(),
            seq: 0,
            addr: addr.into(),
            id,
            key: key.to_vec(),
            last_reply: 0,
            keepalives: 0,
            close_on_drop: true,
            recorded: std::env::var_os("RGPU_FUZZ_RECORD").map(|_| Vec::new()),
        }
    }

    /// Drops the connection without the orderly Close.
    pub fn cut(mut self) {
        self.close_on_drop = false;
        self.t.shutdown();
    }

    /// Breaks the connection (without Close) and comes back on a new one,
    /// saying `last_reply` was the last reply received. Returns the status
    /// and the last request the server executed.
    pub fn resume_with(&mut self, last_reply: u64, key: Option<&[u8]>) -> (u32, u64) {
        self.t.shutdown();
        let mut t = dial(&self.addr, &self.security);
        let key = key.map(<[u8]>::to_vec).unwrap_or_else(|| self.key.clone());
        t.send(&[RESUME_PREAMBLE, &self.id.to_le_bytes(), &key, &last_reply.to_le_bytes()]).unwrap();
        let mut st = [0u8; 8];
        t.recv_exact(&mut st).unwrap();
        let status = u32::from_le_bytes(st[..4].try_into().unwrap());
        let mut executed = [0u8; 8];
        if status == 0 {
            t.recv_exact(&mut executed).unwrap();
        }
        self.t = t;
        (status, u64::from_le_bytes(executed))
    }

    /// As `resume_with`, from the last reply this client read.
    pub fn resume(&mut self) -> (u32, u64) {
        self.resume_with(self.last_reply, None)
    }

    /// The next request's sequence number; `set_seq` makes it `seq + 1`
    /// (to send a request again after a resume).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    pub fn set_seq(&mut self, seq: u64) {
        self.seq = seq;
    }

    fn frame(&mut self, wants_reply: bool, bulk: &[u8], build: impl FnOnce(request::Builder<'_>)) -> u64 {
        self.seq += 1;
        let mut msg = Vec::new();
        let n = self.enc.request(&mut msg, build);
        let h = FrameHeader::request(self.seq, wants_reply, n, bulk.len() as u64).encode();
        record_frame(&h, &msg);
        if let Some(r) = &mut self.recorded {
            r.extend_from_slice(&[&h[..], &msg, bulk].concat());
        }
        self.t.send(&[&h, &msg, bulk]).unwrap();
        self.seq
    }

    /// Sends a request wanting a reply whose bulk is `bulk_len` bytes, of
    /// which only `prefix` goes now (the rest with `t.send`); returns its seq.
    pub fn start_call(&mut self, bulk_len: u64, prefix: &[u8], build: impl FnOnce(request::Builder<'_>)) -> u64 {
        self.seq += 1;
        let mut msg = Vec::new();
        let n = self.enc.request(&mut msg, build);
        let h = FrameHeader::request(self.seq, true, n, bulk_len).encode();
        record_frame(&h, &msg);
        // The rest of its bulk goes outside this client: not a session to replay.
        self.recorded = None;
        self.t.send(&[&h, &msg, prefix]).unwrap();
        self.seq
    }

    /// Sends a request without WANTS_REPLY.
    pub fn post(&mut self, bulk: &[u8], build: impl FnOnce(request::Builder<'_>)) {
        self.frame(false, bulk, build);
    }

    /// Sends a request with WANTS_REPLY and returns its reply.
    pub fn call(&mut self, bulk: &[u8], build: impl FnOnce(request::Builder<'_>)) -> Reply {
        let seq = self.frame(true, bulk, build);
        let r = self.read_reply().expect("reply");
        assert_eq!(r.seq, seq);
        r
    }

    pub fn read_reply(&mut self) -> std::io::Result<Reply> {
        let mut hb = [0u8; HEADER_LEN];
        let h = loop {
            self.t.recv_exact(&mut hb)?;
            let h = FrameHeader::decode(&hb).expect("reply header");
            // A long request's keepalives carry nothing.
            if h.kind != Kind::Keepalive {
                break h;
            }
            self.keepalives += 1;
        };
        assert_eq!(h.kind, Kind::Reply);
        let buf = self.recv.prepare(h.msg_len as usize);
        self.t.recv_exact(buf)?;
        let msg = self.recv.reader().unwrap();
        let r = msg.get_root::<reply::Reader>().unwrap();
        let body = match r.which().unwrap() {
            reply::None(()) => Body::None,
            reply::MemAlloc(p) => Body::MemAlloc(p),
            reply::MemGetInfo(m) => {
                let m = m.unwrap();
                Body::MemInfo { free: m.get_free(), total: m.get_total() }
            }
            reply::EventElapsedTime(ms) => Body::Elapsed(ms),
            reply::IpcHandle(h) => {
                let h = h.unwrap();
                Body::IpcHandle { id: h.get_id(), secret: h.get_secret().unwrap().to_vec() }
            }
            reply::IpcOpened(m) => {
                let m = m.unwrap();
                Body::IpcOpened { ptr: m.get_ptr(), size: m.get_size() }
            }
            reply::ModuleLoad(m) => {
                let m = m.unwrap();
                Body::Module(Loaded {
                    functions: m
                        .get_functions()
                        .unwrap()
                        .iter()
                        .map(|f| {
                            (
                                f.get_name().unwrap().to_string().unwrap(),
                                f.get_params().unwrap().iter().map(|p| (p.get_offset(), p.get_size())).collect(),
                                f.get_max_threads_per_block(),
                                f.get_num_regs(),
                            )
                        })
                        .collect(),
                    globals: m
                        .get_globals()
                        .unwrap()
                        .iter()
                        .map(|g| (g.get_name().unwrap().to_string().unwrap(), g.get_ptr(), g.get_size()))
                        .collect(),
                    note: m.get_launch_note().unwrap().to_string().unwrap(),
                })
            }
        };
        let (result, deferred) = (r.get_result(), r.get_deferred_error());
        let mut bulk = vec![0u8; h.bulk_len as usize];
        self.t.recv_exact(&mut bulk)?;
        self.last_reply = h.seq;
        Ok(Reply { seq: h.seq, result, deferred, body, bulk })
    }

    // --- conveniences ---------------------------------------------------

    pub fn alloc(&mut self, size: u64) -> Reply {
        self.alloc_on(0, size)
    }

    pub fn alloc_on(&mut self, device: u32, size: u64) -> Reply {
        self.call(&[], |r| {
            let mut m = r.init_mem_alloc();
            m.set_device(device);
            m.set_size(size);
        })
    }

    pub fn alloc_ok(&mut self, size: u64) -> u64 {
        let r = self.alloc(size);
        assert_eq!(r.result, 0, "memAlloc({size})");
        r.ptr()
    }

    pub fn free(&mut self, ptr: u64) -> Reply {
        self.call(&[], |r| r.init_mem_free().set_ptr(ptr))
    }

    pub fn htod(&mut self, dst: u64, bytes: &[u8]) -> Reply {
        self.call(bytes, |r| {
            let mut m = r.init_memcpy_hto_d();
            m.set_dst(dst);
            m.set_stream(0);
        })
    }

    pub fn dtoh(&mut self, src: u64, size: u64) -> Reply {
        self.dtoh_on(src, size, 0)
    }

    pub fn dtoh_on(&mut self, src: u64, size: u64, stream: u64) -> Reply {
        self.call(&[], |r| {
            let mut m = r.init_memcpy_dto_h();
            m.set_src(src);
            m.set_size(size);
            m.set_stream(stream);
        })
    }

    pub fn mem_info(&mut self) -> (u64, u64) {
        let r = self.call(&[], |r| r.init_mem_get_info().set_device(0));
        assert_eq!(r.result, 0);
        match r.body {
            Body::MemInfo { free, total } => (free, total),
            b => panic!("expected memGetInfo, got {b:?}"),
        }
    }

    /// moduleLoad of `image` on device 0 as module `handle`.
    pub fn load_module(&mut self, handle: u64, image: &[u8]) -> Reply {
        self.call(image, |r| {
            let mut m = r.init_module_load();
            m.set_handle(handle);
            m.set_device(0);
        })
    }

    /// launchKernel of `function` of module `module` on the default
    /// stream; `wants_reply` false posts it (its error is deferred).
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &mut self,
        wants_reply: bool,
        module: u64,
        function: u32,
        grid: [u32; 3],
        block: [u32; 3],
        shared: u32,
        params: &[u8],
    ) -> Option<Reply> {
        let build = |r: request::Builder<'_>| {
            let mut l = r.init_launch_kernel();
            l.set_module(module);
            l.set_function(function);
            l.set_grid_x(grid[0]);
            l.set_grid_y(grid[1]);
            l.set_grid_z(grid[2]);
            l.set_block_x(block[0]);
            l.set_block_y(block[1]);
            l.set_block_z(block[2]);
            l.set_shared_mem_bytes(shared);
        };
        if wants_reply {
            Some(self.call(params, build))
        } else {
            self.post(params, build);
            None
        }
    }

    /// ctxSynchronize on device 0.
    pub fn sync(&mut self) -> Reply {
        self.call(&[], |r| r.init_ctx_synchronize().set_device(0))
    }

    pub fn unload_module(&mut self, handle: u64) -> Reply {
        self.call(&[], |r| r.init_module_unload().set_handle(handle))
    }

    pub fn ping(&mut self) -> Reply {
        self.call(&[], |mut r| r.set_ping(()))
    }
}
