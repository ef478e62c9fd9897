//! The control plane: the capnp-rpc `GpuServer` capability every control
//! connection bootstraps. Cold path: hello, device inventory, sessions.

use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use capnp::capability::Rc;
use capnp_rpc::{rpc_twoparty_capnp, twoparty, RpcSystem};
use futures::AsyncReadExt;
use rgpu_protocol::control_capnp::gpu_server;
use rgpu_protocol::PROTOCOL_VERSION;
use tokio_util::compat::TokioAsyncReadCompatExt;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::limits::MAX_SESSIONS_PER_CONTROL_CONNECTION;
use rgpu_protocol::auth::ServerOp;
use crate::service::Service;

/// Largest control-plane message read, in words: requests are a hello, a
/// token of a few hundred bytes and capnp-rpc's bookkeeping. capnp-rpc
/// allocates a message's whole announced size before reading it, and its
/// default limit is 64 MiB per connection.
const CONTROL_MESSAGE_WORDS: usize = 8 << 10;

/// When the connection's client last completed a call, and whether it has
/// said hello: the watchdog in [`serve`] closes connections that idle.
struct Activity {
    hello: Cell<bool>,
    last_call: Cell<Instant>,
    sessions: Cell<u32>,
    /// Wakes the watchdog at each call, so its deadline moves.
    called: tokio::sync::Notify,
}

impl Activity {
    fn call(&self) {
        self.last_call.set(Instant::now());
        self.called.notify_one();
    }
}

struct GpuServer {
    service: Arc<Service>,
    peer: String,
    /// The version the client announced in `hello`, if it did.
    client_version: Cell<Option<u32>>,
    activity: std::rc::Rc<Activity>,
    /// The nonce `challenge` handed out, until an operator call or a bound
    /// token's proof uses it.
    nonce: Cell<Option<[u8; rgpu_protocol::auth::NONCE_LEN]>>,
    /// This connection's TLS exporter value, which a bound token's proof
    /// covers; None in plaintext.
    channel: Option<[u8; 32]>,
    /// Names this connection's snapshot uploads' partial files, so that two
    /// uploads of one name (two operators at once) never write one file.
    upload_tag: u64,
    /// The partial file of an upload this connection started and has not
    /// finished: removed when the connection ends.
    upload_partial: std::cell::RefCell<Option<std::path::PathBuf>>,
}

impl Drop for GpuServer {
    fn drop(&mut self) {
        if let Some(p) = self.upload_partial.get_mut().take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl GpuServer {
    /// A new challenge for this connection, replacing any unused one.
    fn fresh_nonce(&self) -> Result<[u8; rgpu_protocol::auth::NONCE_LEN], capnp::Error> {
        let mut n = [0u8; rgpu_protocol::auth::NONCE_LEN];
        getrandom::fill(&mut n).map_err(|e| capnp::Error::failed(format!("no randomness: {e}")))?;
        self.nonce.set(Some(n));
        Ok(n)
    }

    /// Checks an operator call's proof over this connection's nonce (used up
    /// whatever the outcome) under the server's admin key.
    fn check_operator(&self, nonce: &[u8], proof: &[u8], op: ServerOp, session: u64, name: &str) -> Result<(), capnp::Error> {
        let ours = self.nonce.take();
        let Some(key) = &self.service.admin_key else {
            return Err(capnp::Error::failed(
                "this server has no --admin-key-file: operator calls (checkpoint, restore, migrate, sessions, faults) are off".into(),
            ));
        };
        let fresh = ours.is_some_and(|n| n[..] == *nonce);
        let message = rgpu_protocol::auth::server_op_message(nonce, op, session, name);
        if !fresh || !rgpu_protocol::token::verify_bytes(key, &message, proof) {
            warn!(peer = %self.peer, ?op, session = format_args!("{session:#x}"), "operator call refused: bad or stale proof");
            return Err(capnp::Error::failed("refused: the proof is not the admin key's over this connection's challenge".into()));
        }
        Ok(())
    }
}

impl GpuServer {
    /// Admits `token` as the lease rules say, with the proof of possession
    /// the request carries (`nonce`, `proof`) checked against this
    /// connection's challenge, which it uses up.
    fn admit(&self, token: &[u8], nonce: &[u8], proof: &[u8]) -> Result<Option<crate::lease::Admission>, crate::lease::AdmitError> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let fresh = !nonce.is_empty() && self.nonce.take().is_some_and(|n| n[..] == *nonce);
        let possession = crate::lease::Possession { nonce, fresh, channel: self.channel, proof };
        self.service.leases.admit(token, now, Some(&possession))
    }

    /// An operator's fault on `device` (None: cleared), as the backend takes it.
    fn set_fault(&self, device: u32, fault: Option<crate::health::Fault>) -> Result<crate::health::DeviceHealth, capnp::Error> {
        let r = self.service.backend.set_fault(device, fault);
        match &r {
            Ok(h) if h.healthy => info!(peer = %self.peer, device, "operator cleared the device's fault: healthy"),
            Ok(h) => warn!(peer = %self.peer, device, reason = %h.reason, "operator injected a fault: the device reports unhealthy"),
            Err(e) => warn!(peer = %self.peer, device, "fault refused: {e}"),
        }
        r.map_err(|e| capnp::Error::failed(e.to_string()))
    }
}

fn text(t: capnp::Result<capnp::text::Reader<'_>>) -> String {
    t.ok().and_then(|t| t.to_str().ok()).unwrap_or("").to_string()
}

impl gpu_server::Server for GpuServer {
    async fn hello(
        self: Rc<Self>,
        params: gpu_server::HelloParams,
        mut results: gpu_server::HelloResults,
    ) -> Result<(), capnp::Error> {
        self.activity.call();
        self.activity.hello.set(true);
        let p = params.get()?;
        let theirs = p.get_client_version();
        let name = text(p.get_client_name());
        self.client_version.set(Some(theirs));
        if theirs != PROTOCOL_VERSION {
            // Answer anyway, so the client can explain the mismatch itself;
            // this connection will not get a session.
            warn!(peer = %self.peer, client = %name, theirs, ours = PROTOCOL_VERSION,
                "client speaks another protocol version");
        } else {
            debug!(peer = %self.peer, client = %name, "hello");
        }
        let mut r = results.get();
        r.set_server_version(PROTOCOL_VERSION);
        r.set_server_name(&self.service.server_name);
        r.set_backend(self.service.backend.name());
        Ok(())
    }

    async fn list_devices(
        self: Rc<Self>,
        _params: gpu_server::ListDevicesParams,
        mut results: gpu_server::ListDevicesResults,
    ) -> Result<(), capnp::Error> {
        self.activity.call();
        let devs = self.service.backend.devices();
        let mut list = results.get().init_devices(devs.len() as u32);
        for (i, d) in devs.iter().enumerate() {
            let mut b = list.reborrow().get(i as u32);
            b.set_ordinal(d.ordinal);
            b.set_name(&d.name);
            b.set_uuid(&d.uuid);
            b.set_total_mem(d.total_mem);
            b.set_pci_domain(d.pci_domain);
            b.set_pci_bus(d.pci_bus);
            b.set_pci_device(d.pci_device);
            let mut attrs = b.init_attributes(d.attributes.len() as u32);
            for (j, &(id, value)) in d.attributes.iter().enumerate() {
                let mut a = attrs.reborrow().get(j as u32);
                a.set_id(id);
                a.set_value(value);
            }
        }
        Ok(())
    }

    async fn device_status(
        self: Rc<Self>,
        params: gpu_server::DeviceStatusParams,
        mut results: gpu_server::DeviceStatusResults,
    ) -> Result<(), capnp::Error> {
        self.activity.call();
        let p = params.get()?;
        // What one tenant may see of a pooled server is its own lease: other
        // tenants' use of a shared GPU is theirs.
        let admission = match self.admit(p.get_token()?, p.get_nonce()?, p.get_proof()?) {
            Ok(a) => a,
            Err(e) => {
                debug!(peer = %self.peer, "device status refused: {e}");
                return Err(capnp::Error::failed(format!("device status refused: {e}")));
            }
        };
        let devs = self.service.backend.devices();
        let shown: Vec<(u32, u64, u64)> = match &admission {
            None => devs.iter().map(|d| (d.ordinal, d.total_mem, self.service.meters.memory_on(d.ordinal))).collect(),
            Some(a) => {
                let ours: Vec<_> = self.service.meters.live().into_iter().filter(|m| m.lease == Some(a.lease)).collect();
                devs.iter()
                    .filter(|d| a.devices.contains(&d.ordinal))
                    .map(|d| {
                        let total = a.memory_limit.map_or(d.total_mem, |l| l.min(d.total_mem));
                        (d.ordinal, total, ours.iter().map(|m| m.memory_on(d.ordinal)).sum())
                    })
                    .collect()
            }
        };
        // A device's processes: the sessions holding memory on it (of the lease), by the
        // pid their clients named.
        let lease = admission.as_ref().map(|a| a.lease);
        let pids = self.service.sessions.pids();
        let meters: Vec<_> = self
            .service
            .meters
            .live_by_session()
            .into_iter()
            .filter(|(_, m)| lease.is_none() || m.lease == lease)
            .filter_map(|(id, m)| Some((*pids.get(&id)?, m)))
            .collect();
        // NVML queries may take a while (across the network on a chained server).
        let backend = self.service.backend.clone();
        let telemetry = tokio::task::spawn_blocking(move || backend.telemetry()).await.unwrap_or_else(|e| {
            warn!("device telemetry failed: {e}");
            Vec::new()
        });
        let mut list = results.get().init_devices(shown.len() as u32);
        for (i, (ordinal, total, used)) in shown.into_iter().enumerate() {
            let mut b = list.reborrow().get(i as u32);
            b.set_ordinal(ordinal);
            b.set_total_mem(total);
            b.set_used_mem(used);
            let t = telemetry.get(ordinal as usize).copied().unwrap_or_default();
            set_reading(b.reborrow().init_gpu_utilization(), t.gpu_utilization);
            set_reading(b.reborrow().init_memory_utilization(), t.memory_utilization);
            set_reading(b.reborrow().init_temperature(), t.temperature);
            set_reading(b.reborrow().init_power_usage(), t.power_usage);
            set_reading(b.reborrow().init_power_limit(), t.power_limit);
            let procs: Vec<(u32, u64)> =
                meters.iter().map(|(pid, m)| (*pid, m.memory_on(ordinal))).filter(|&(_, used)| used > 0).collect();
            let mut pl = b.init_processes(procs.len() as u32);
            for (j, (pid, used)) in procs.into_iter().enumerate() {
                let mut p = pl.reborrow().get(j as u32);
                p.set_pid(pid);
                p.set_used_mem(used);
            }
        }
        Ok(())
    }

    async fn open_session(
        self: Rc<Self>,
        params: gpu_server::OpenSessionParams,
        mut results: gpu_server::OpenSessionResults,
    ) -> Result<(), capnp::Error> {
        self.activity.call();
        match self.client_version.get() {
            Some(PROTOCOL_VERSION) => {}
            Some(v) => {
                return Err(capnp::Error::failed(format!(
                    "protocol version mismatch: client speaks {v}, server {PROTOCOL_VERSION}"
                )))
            }
            None => return Err(capnp::Error::failed("call hello before openSession".into())),
        }
        // Each open session waits for its data connection (attach timeout);
        // one connection may not fill the registry with them.
        let opened = self.activity.sessions.get();
        if opened >= MAX_SESSIONS_PER_CONTROL_CONNECTION {
            return Err(capnp::Error::failed(format!(
                "a control connection may open at most {MAX_SESSIONS_PER_CONTROL_CONNECTION} sessions"
            )));
        }
        self.activity.sessions.set(opened + 1);
        let p = params.get()?;
        let client = text(p.get_client_name());
        let admission = match self.admit(p.get_token()?, p.get_nonce()?, p.get_proof()?) {
            Ok(a) => a,
            Err(e) => {
                warn!(peer = %self.peer, client = %client, "session refused: {e}");
                return Err(capnp::Error::failed(format!("session refused: {e}")));
            }
        };
        let (id, key) = self
            .service
            .sessions
            .open(&client)
            .map_err(|e| capnp::Error::failed(format!("cannot open a session: {e}")))?;
        if let Some(a) = admission {
            info!(peer = %self.peer, session = format_args!("{id:#x}"), lease = format_args!("{:016x}", a.lease),
                generation = a.generation, memory_limit = ?a.memory_limit, "session admitted by lease");
            self.service.leases.bind(id, a);
        }
        let timeout = self.service.attach_timeout;
        let service = self.service.clone();
        tokio::task::spawn_local(async move {
            tokio::time::sleep(timeout).await;
            if service.sessions.expire(id) {
                service.leases.unbind(id);
                info!(session = format_args!("{id:#x}"), client = %client,
                    "session dropped: no data connection within {} ms", timeout.as_millis());
            }
        });
        let mut r = results.get();
        r.set_session_id(id);
        r.set_key(&key);
        r.set_attach_timeout_ms(u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX));
        debug!(peer = %self.peer, session = format_args!("{id:#x}"), "session opened");
        Ok(())
    }

    async fn challenge(
        self: Rc<Self>,
        _params: gpu_server::ChallengeParams,
        mut results: gpu_server::ChallengeResults,
    ) -> Result<(), capnp::Error> {
        self.activity.call();
        results.get().set_nonce(&self.fresh_nonce()?);
        Ok(())
    }

    async fn checkpoint(
        self: Rc<Self>,
        params: gpu_server::CheckpointParams,
        mut results: gpu_server::CheckpointResults,
    ) -> Result<(), capnp::Error> {
        self.activity.call();
        let p = params.get()?;
        let (id, name) = (p.get_session_id(), text(p.get_name()));
        self.check_operator(p.get_nonce()?, p.get_proof()?, ServerOp::Checkpoint, id, &name)?;
        let quiesce = Duration::from_millis(p.get_quiesce_ms() as u64);
        let leave = p.get_leave();
        info!(peer = %self.peer, session = format_args!("{id:#x}"), %name, leave, "checkpoint asked");
        let done = crate::relocate::checkpoint(&self.service, id, &name, quiesce, leave).await.map_err(|e| {
            warn!(peer = %self.peer, session = format_args!("{id:#x}"), "checkpoint failed: {e}");
            capnp::Error::from(e)
        })?;
        self.activity.call();
        let mut r = results.get();
        r.set_bytes(done.bytes);
        r.set_memory_bytes(done.memory_bytes);
        r.set_micros(done.took.as_micros() as u64);
        Ok(())
    }

    async fn restore(
        self: Rc<Self>,
        params: gpu_server::RestoreParams,
        mut results: gpu_server::RestoreResults,
    ) -> Result<(), capnp::Error> {
        self.activity.call();
        let p = params.get()?;
        let name = text(p.get_name());
        self.check_operator(p.get_nonce()?, p.get_proof()?, ServerOp::Restore, 0, &name)?;
        info!(peer = %self.peer, %name, "restore asked");
        let done = crate::relocate::restore(&self.service, &name).await.map_err(|e| {
            warn!(peer = %self.peer, %name, "restore failed: {e}");
            capnp::Error::from(e)
        })?;
        self.activity.call();
        let mut r = results.get();
        r.set_session_id(done.session);
        r.set_bytes(done.bytes);
        r.set_memory_bytes(done.memory_bytes);
        r.set_micros(done.took.as_micros() as u64);
        Ok(())
    }

    async fn read_snapshot(
        self: Rc<Self>,
        params: gpu_server::ReadSnapshotParams,
        mut results: gpu_server::ReadSnapshotResults,
    ) -> Result<(), capnp::Error> {
        self.activity.call();
        let p = params.get()?;
        let (name, offset, max) = (text(p.get_name()), p.get_offset(), p.get_max_bytes());
        let named = rgpu_protocol::auth::snapshot_read_name(&name, max);
        self.check_operator(p.get_nonce()?, p.get_proof()?, ServerOp::ReadSnapshot, offset, &named)?;
        let (data, size) = crate::relocate::read_snapshot(&self.service, &name, offset, max).await.map_err(|e| {
            warn!(peer = %self.peer, %name, offset, "snapshot read refused: {e}");
            capnp::Error::from(e)
        })?;
        self.activity.call();
        let next = self.fresh_nonce()?;
        let mut r = results.get();
        r.set_data(&data);
        r.set_size(size);
        r.set_next_nonce(&next);
        Ok(())
    }

    async fn write_snapshot(
        self: Rc<Self>,
        params: gpu_server::WriteSnapshotParams,
        mut results: gpu_server::WriteSnapshotResults,
    ) -> Result<(), capnp::Error> {
        self.activity.call();
        let p = params.get()?;
        let (name, offset, last, data) = (text(p.get_name()), p.get_offset(), p.get_last(), p.get_data()?);
        let named = rgpu_protocol::auth::snapshot_write_name(&name, last, data);
        self.check_operator(p.get_nonce()?, p.get_proof()?, ServerOp::WriteSnapshot, offset, &named)?;
        if offset == 0 {
            info!(peer = %self.peer, %name, "snapshot upload started");
        }
        let pending = crate::relocate::write_snapshot(&self.service, &name, self.upload_tag, offset, data.to_vec(), last)
            .await
            .map_err(|e| {
                warn!(peer = %self.peer, %name, offset, "snapshot write refused: {e}");
                capnp::Error::from(e)
            })?;
        // One upload at a time per connection: a new one's partial file
        // replaces the last one's (removed if it was left unfinished).
        let old = self.upload_partial.replace(pending.clone());
        if let Some(o) = old.filter(|o| Some(o) != pending.as_ref()) {
            let _ = std::fs::remove_file(o);
        }
        self.activity.call();
        results.get().set_next_nonce(&self.fresh_nonce()?);
        Ok(())
    }

    async fn forward(
        self: Rc<Self>,
        params: gpu_server::ForwardParams,
        _results: gpu_server::ForwardResults,
    ) -> Result<(), capnp::Error> {
        self.activity.call();
        let p = params.get()?;
        let (id, target) = (p.get_session_id(), text(p.get_target()));
        self.check_operator(p.get_nonce()?, p.get_proof()?, ServerOp::Forward, id, &target)?;
        crate::relocate::forward(&self.service, id, &target).await.map_err(|e| {
            warn!(peer = %self.peer, session = format_args!("{id:#x}"), %target, "forward refused: {e}");
            capnp::Error::from(e)
        })
    }

    async fn migrate(
        self: Rc<Self>,
        params: gpu_server::MigrateParams,
        mut results: gpu_server::MigrateResults,
    ) -> Result<(), capnp::Error> {
        self.activity.call();
        let p = params.get()?;
        let (id, target) = (p.get_session_id(), text(p.get_target()));
        self.check_operator(p.get_nonce()?, p.get_proof()?, ServerOp::Migrate, id, &target)?;
        let quiesce = Duration::from_millis(p.get_quiesce_ms() as u64);
        info!(peer = %self.peer, session = format_args!("{id:#x}"), %target, "migration asked");
        let moved = crate::migration::migrate(&self.service, id, &target, quiesce).await.map_err(|e| {
            warn!(peer = %self.peer, session = format_args!("{id:#x}"), %target, "migration failed: {e}");
            capnp::Error::from(e)
        })?;
        self.activity.call();
        let mut r = results.get();
        r.set_bytes(moved.bytes);
        r.set_memory_bytes(moved.memory_bytes);
        r.set_micros(moved.took.as_micros() as u64);
        r.set_pause_micros(moved.paused.as_micros() as u64);
        r.set_precopy_bytes(moved.precopied);
        r.set_held_bytes(moved.sent_held);
        Ok(())
    }

    async fn list_sessions(
        self: Rc<Self>,
        params: gpu_server::ListSessionsParams,
        mut results: gpu_server::ListSessionsResults,
    ) -> Result<(), capnp::Error> {
        self.activity.call();
        let p = params.get()?;
        self.check_operator(p.get_nonce()?, p.get_proof()?, ServerOp::ListSessions, 0, "")?;
        let sessions = self.service.sessions.active();
        let mut list = results.get().init_sessions(sessions.len() as u32);
        for (i, (id, client)) in sessions.iter().enumerate() {
            let mut s = list.reborrow().get(i as u32);
            s.set_id(*id);
            s.set_client(client);
            s.set_lease(self.service.leases.admission(*id).map_or(0, |a| a.lease));
            if let Some(u) = self.service.meters.of(*id) {
                s.set_memory(u.memory);
                s.set_kernels(u.kernels);
                s.set_bytes_in(u.bytes_in);
                s.set_bytes_out(u.bytes_out);
            }
        }
        Ok(())
    }

    async fn list_suspended(
        self: Rc<Self>,
        params: gpu_server::ListSuspendedParams,
        mut results: gpu_server::ListSuspendedResults,
    ) -> Result<(), capnp::Error> {
        self.activity.call();
        let p = params.get()?;
        let lease = p.get_lease();
        self.check_operator(p.get_nonce()?, p.get_proof()?, ServerOp::ListSuspended, lease, "")?;
        let names = match crate::preemption::suspended_files(&self.service, lease) {
            None => return Err(capnp::Error::failed("this server has no --checkpoint-dir: it suspends no lease".into())),
            Some(Err(e)) => return Err(capnp::Error::failed(format!("cannot read the checkpoint directory: {e}"))),
            Some(Ok(n)) => n,
        };
        let mut list = results.get().init_names(names.len() as u32);
        for (i, n) in names.iter().enumerate() {
            list.set(i as u32, n);
        }
        Ok(())
    }

    async fn inject_fault(
        self: Rc<Self>,
        params: gpu_server::InjectFaultParams,
        mut results: gpu_server::InjectFaultResults,
    ) -> Result<(), capnp::Error> {
        self.activity.call();
        let p = params.get()?;
        let (device, kind) = (p.get_device(), text(p.get_kind()));
        self.check_operator(p.get_nonce()?, p.get_proof()?, ServerOp::InjectFault, device.into(), &kind)?;
        let fault = crate::health::Fault::parse(&kind).map_err(|e| capnp::Error::failed(e.to_string()))?;
        let h = self.set_fault(device, Some(fault))?;
        results.get().set_healthy(h.healthy);
        results.get().set_reason(&h.reason);
        Ok(())
    }

    async fn clear_fault(
        self: Rc<Self>,
        params: gpu_server::ClearFaultParams,
        mut results: gpu_server::ClearFaultResults,
    ) -> Result<(), capnp::Error> {
        self.activity.call();
        let p = params.get()?;
        let device = p.get_device();
        self.check_operator(p.get_nonce()?, p.get_proof()?, ServerOp::ClearFault, device.into(), "")?;
        let h = self.set_fault(device, None)?;
        results.get().set_healthy(h.healthy);
        results.get().set_reason(&h.reason);
        Ok(())
    }
}

/// Serves one control connection (its preamble already read) until the
/// client leaves, it idles, or the server shuts down: the client must say
/// hello by `hello_by` and then make a call at least every
/// `--control-idle-timeout`. Must run inside a `LocalSet`.
pub async fn serve<S>(
    stream: S,
    channel: Option<[u8; 32]>,
    peer: String,
    service: Arc<Service>,
    shutdown: CancellationToken,
    hello_by: Instant,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + 'static,
{
    let idle = service.limits.control_idle_timeout;
    let (reader, writer) = stream.compat().split();
    let mut opts = capnp::message::ReaderOptions::new();
    opts.traversal_limit_in_words(Some(CONTROL_MESSAGE_WORDS)).nesting_limit(16);
    let network = twoparty::VatNetwork::new(
        futures::io::BufReader::new(reader),
        futures::io::BufWriter::new(writer),
        rpc_twoparty_capnp::Side::Server,
        opts,
    );
    let activity = std::rc::Rc::new(Activity {
        hello: Cell::new(false),
        last_call: Cell::new(Instant::now()),
        sessions: Cell::new(0),
        called: tokio::sync::Notify::new(),
    });
    let server = GpuServer {
        service,
        peer: peer.clone(),
        client_version: Cell::new(None),
        activity: activity.clone(),
        nonce: Cell::new(None),
        channel,
        upload_tag: {
            let mut t = [0u8; 8];
            let _ = getrandom::fill(&mut t);
            u64::from_le_bytes(t)
        },
        upload_partial: std::cell::RefCell::new(None),
    };
    let client: gpu_server::Client = capnp_rpc::new_client(server);
    let rpc = RpcSystem::new(Box::new(network), Some(client.client));
    tokio::select! {
        r = rpc => match r {
            Ok(()) => debug!(%peer, "control connection closed"),
            Err(e) => debug!(%peer, "control connection ended: {e}"),
        },
        why = watchdog(&activity, hello_by, idle) => debug!(%peer, "closing control connection: {why}"),
        _ = shutdown.cancelled() => debug!(%peer, "control connection closed for shutdown"),
    }
}

/// Resolves when the connection has not said hello by `hello_by`, or has
/// made no call for `idle`.
async fn watchdog(a: &Activity, hello_by: Instant, idle: Duration) -> String {
    loop {
        let due = if a.hello.get() { a.last_call.get() + idle } else { hello_by };
        if Instant::now() >= due {
            return if a.hello.get() {
                format!("no call for {} s (--control-idle-timeout)", idle.as_secs_f64())
            } else {
                "no hello in time (--handshake-timeout)".to_string()
            };
        }
        tokio::select! {
            _ = tokio::time::sleep_until(due.into()) => {}
            _ = a.called.notified() => {}
        }
    }
}

fn set_reading(mut b: rgpu_protocol::control_capnp::reading::Builder<'_>, r: crate::telemetry::Reading) {
    use rgpu_protocol::control_capnp::ReadingSource as S;
    use crate::telemetry::Reading;
    let (source, value) = match r {
        Reading::NotReported => (S::None, 0),
        Reading::Measured(v) => (S::Measured, v),
        Reading::Simulated(v) => (S::Simulated, v),
    };
    b.set_source(source);
    b.set_value(value);
}
