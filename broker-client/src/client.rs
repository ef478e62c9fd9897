//! [`BrokerClient`]: a blocking connection to a broker, for callers with no
//! runtime of their own (the CLI, tests). It owns a small single-threaded
//! runtime and drives it on the calling thread for each call.

use rgpu_protocol::broker_capnp::broker;
use thiserror::Error;

use crate::admin::{AdminAuth, AdminOp};
use crate::rpc::{self, Connection, CONNECT_TIMEOUT};
use crate::views::{read_lease, read_server, read_status, LeaseSpec, LeaseView, ServerView, StatusView};

#[derive(Debug, Error)]
pub enum ClientError {
    #[error("cannot reach the broker at {addr}: {reason}")]
    Unreachable { addr: String, reason: String },
    /// The broker refused; the text starts with the kind in brackets.
    #[error("{0}")]
    Refused(String),
    #[error("broker connection: {0}")]
    Rpc(String),
}

impl ClientError {
    /// The bracketed kind of a refusal (`quota`, `not-found`, ...).
    pub fn kind(&self) -> Option<&str> {
        match self {
            ClientError::Refused(t) => t.strip_prefix('[').and_then(|r| r.split(']').next()),
            _ => None,
        }
    }
}

/// The broker words each refusal "[kind] why"; anything else is the
/// connection failing.
fn from_capnp(e: capnp::Error) -> ClientError {
    // capnp prefixes remote failures with "remote exception: ".
    let t = e.to_string();
    match t.find('[') {
        Some(i) => ClientError::Refused(t[i..].to_string()),
        None => ClientError::Rpc(t),
    }
}

/// A blocking connection to a broker.
pub struct BrokerClient {
    // Dropped in this order: the connection's task is cancelled before the
    // LocalSet that holds it, and that before the runtime it runs on.
    conn: Connection<broker::Client>,
    local: tokio::task::LocalSet,
    rt: tokio::runtime::Runtime,
    pub addr: String,
    /// Signs drain/undrain (see [`crate::admin`]).
    admin_key: Option<Vec<u8>>,
}

impl BrokerClient {
    pub fn connect(addr: &str) -> Result<BrokerClient, ClientError> {
        let unreachable = |r: String| ClientError::Unreachable { addr: addr.to_string(), reason: r };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| unreachable(e.to_string()))?;
        let local = tokio::task::LocalSet::new();
        let conn = local
            .block_on(&rt, rpc::connect::<broker::Client>(addr, CONNECT_TIMEOUT))
            .map_err(|e| unreachable(e.to_string()))?;
        Ok(BrokerClient { conn, local, rt, addr: addr.to_string(), admin_key: None })
    }

    /// Proves drain and undrain with `key` (the broker's admin key, or its
    /// token key).
    pub fn with_admin_key(mut self, key: Vec<u8>) -> Self {
        self.admin_key = Some(key);
        self
    }

    fn admin_auth(&self, op: AdminOp, server: &str, deadline_ms: u64) -> AdminAuth {
        AdminAuth::with_key(self.admin_key.as_deref(), op, server, deadline_ms, crate::now_ms())
    }

    fn client(&self) -> &broker::Client {
        self.conn.client()
    }

    fn run<T>(&self, f: impl std::future::Future<Output = Result<T, ClientError>>) -> Result<T, ClientError> {
        self.local.block_on(&self.rt, f)
    }

    pub fn lease(&self, s: &LeaseSpec) -> Result<LeaseView, ClientError> {
        let mut req = self.client().lease_request();
        s.write(req.get().init_request());
        self.run(async {
            let reply = req.send().promise.await.map_err(from_capnp)?;
            read_lease(reply.get().and_then(|r| r.get_lease()).map_err(from_capnp)?).map_err(from_capnp)
        })
    }

    pub fn renew(&self, id: u64, ttl_ms: u64) -> Result<LeaseView, ClientError> {
        let mut req = self.client().renew_request();
        req.get().set_lease_id(id);
        req.get().set_ttl_ms(ttl_ms);
        self.run(async {
            let reply = req.send().promise.await.map_err(from_capnp)?;
            read_lease(reply.get().and_then(|r| r.get_lease()).map_err(from_capnp)?).map_err(from_capnp)
        })
    }

    /// True if the lease was live; releasing an ended lease is not an error.
    pub fn release(&self, id: u64) -> Result<bool, ClientError> {
        let mut req = self.client().release_request();
        req.get().set_lease_id(id);
        self.run(async {
            let reply = req.send().promise.await.map_err(from_capnp)?;
            Ok(reply.get().map_err(from_capnp)?.get_released())
        })
    }

    pub fn leases(&self, tenant: &str) -> Result<Vec<LeaseView>, ClientError> {
        let mut req = self.client().list_leases_request();
        req.get().set_tenant(tenant);
        self.run(async {
            let reply = req.send().promise.await.map_err(from_capnp)?;
            let list = reply.get().and_then(|r| r.get_leases()).map_err(from_capnp)?;
            list.iter().map(|l| read_lease(l).map_err(from_capnp)).collect()
        })
    }

    pub fn servers(&self) -> Result<Vec<ServerView>, ClientError> {
        let req = self.client().list_servers_request();
        self.run(async {
            let reply = req.send().promise.await.map_err(from_capnp)?;
            let list = reply.get().and_then(|r| r.get_servers()).map_err(from_capnp)?;
            Ok(list.iter().map(read_server).collect())
        })
    }

    /// `deadline_ms`: unix ms, or 0 for none.
    pub fn drain(&self, server: &str, deadline_ms: u64) -> Result<ServerView, ClientError> {
        let mut req = self.client().drain_request();
        req.get().set_server_id(server);
        req.get().set_deadline_ms(deadline_ms);
        self.admin_auth(AdminOp::Drain, server, deadline_ms).write(req.get().init_auth());
        self.run(async {
            let reply = req.send().promise.await.map_err(from_capnp)?;
            Ok(read_server(reply.get().and_then(|r| r.get_server()).map_err(from_capnp)?))
        })
    }

    pub fn undrain(&self, server: &str) -> Result<ServerView, ClientError> {
        let mut req = self.client().undrain_request();
        req.get().set_server_id(server);
        self.admin_auth(AdminOp::Undrain, server, 0).write(req.get().init_auth());
        self.run(async {
            let reply = req.send().promise.await.map_err(from_capnp)?;
            Ok(read_server(reply.get().and_then(|r| r.get_server()).map_err(from_capnp)?))
        })
    }

    pub fn status(&self) -> Result<StatusView, ClientError> {
        let req = self.client().status_request();
        self.run(async {
            let reply = req.send().promise.await.map_err(from_capnp)?;
            Ok(read_status(reply.get().and_then(|r| r.get_status()).map_err(from_capnp)?))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use capnp::capability::Rc;
    use capnp_rpc::rpc_twoparty_capnp::Side;
    use capnp_rpc::{twoparty, RpcSystem};
    use futures::AsyncReadExt;
    use rgpu_protocol::token::{admin_message, verify_bytes};
    use std::sync::{Arc, Mutex};
    use tokio_util::compat::TokioAsyncReadCompatExt;

    const KEY: &[u8] = b"the admin key";

    /// (server, deadline, proof valid) of each drain the fake broker saw.
    type Drains = Arc<Mutex<Vec<(String, u64, bool)>>>;

    /// A broker that grants one canned lease, refuses renewals as the real
    /// one words refusals, and checks drain proofs against [`KEY`].
    struct Fake {
        seen_drains: Drains,
    }

    impl broker::Server for Fake {
        async fn lease(self: Rc<Self>, p: broker::LeaseParams, mut r: broker::LeaseResults) -> Result<(), capnp::Error> {
            let req = p.get()?.get_request()?;
            let mut l = r.get().init_lease();
            l.set_id(0x2a);
            l.set_tenant(req.get_tenant()?);
            l.set_generation(u64::from(req.get_gpus()));
            let mut g = l.init_gpus(1);
            g.reborrow().get(0).set_server("gpu1:7767");
            g.get(0).set_uuid(&[7; 16]);
            Ok(())
        }

        async fn renew(self: Rc<Self>, _: broker::RenewParams, _: broker::RenewResults) -> Result<(), capnp::Error> {
            Err(capnp::Error::failed("[not-found] lease 000000000000002a is not live".into()))
        }

        async fn drain(self: Rc<Self>, p: broker::DrainParams, mut r: broker::DrainResults) -> Result<(), capnp::Error> {
            let p = p.get()?;
            let (server, deadline) = (p.get_server_id()?.to_string()?, p.get_deadline_ms());
            let auth = p.get_auth()?;
            let msg = admin_message("drain", &server, deadline, auth.get_issued_ms());
            let valid = verify_bytes(KEY, &msg, auth.get_proof()?);
            self.seen_drains.lock().unwrap().push((server.clone(), deadline, valid));
            let mut s = r.get().init_server();
            s.set_id(&server);
            s.set_draining(true);
            Ok(())
        }
    }

    /// Serves `Fake` on a loopback port from its own thread; returns the
    /// address and what drains it saw.
    fn start_fake() -> (String, Drains) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let seen2 = seen.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            tokio::task::LocalSet::new().block_on(&rt, async move {
                listener.set_nonblocking(true).unwrap();
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                loop {
                    let (s, _) = listener.accept().await.unwrap();
                    let cap: broker::Client = capnp_rpc::new_client(Fake { seen_drains: seen2.clone() });
                    let (reader, writer) = s.compat().split();
                    let net = twoparty::VatNetwork::new(
                        futures::io::BufReader::new(reader),
                        futures::io::BufWriter::new(writer),
                        Side::Server,
                        Default::default(),
                    );
                    tokio::task::spawn_local(RpcSystem::new(Box::new(net), Some(cap.client)));
                }
            });
        });
        (addr, seen)
    }

    #[test]
    fn refusals_keep_their_kind_and_connection_failures_have_none() {
        let e = from_capnp(capnp::Error::failed("remote exception: [quota] tenant t is at 4 GPUs".into()));
        assert_eq!(e.kind(), Some("quota"));
        assert_eq!(e.to_string(), "[quota] tenant t is at 4 GPUs");
        let e = from_capnp(capnp::Error::disconnected("connection reset".into()));
        assert!(matches!(e, ClientError::Rpc(_)), "{e:?}");
        assert_eq!(e.kind(), None);
    }

    #[test]
    fn an_absent_broker_is_unreachable() {
        let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
        match BrokerClient::connect(&addr) {
            Err(e @ ClientError::Unreachable { .. }) => assert!(e.to_string().contains(&addr), "{e}"),
            Err(e) => panic!("expected Unreachable, got {e:?}"),
            Ok(_) => panic!("connected to a closed port"),
        }
    }

    #[test]
    fn calls_against_a_broker() {
        let (addr, seen) = start_fake();
        let c = BrokerClient::connect(&addr).unwrap();
        let spec = LeaseSpec { tenant: "ana".into(), gpus: 3, ..LeaseSpec::default() };
        let l = c.lease(&spec).unwrap();
        assert_eq!((l.id.as_str(), l.tenant.as_str(), l.generation), ("000000000000002a", "ana", 3));
        assert_eq!(l.servers(), ["gpu1:7767"]);

        let e = c.renew(0x2a, 1000).unwrap_err();
        assert_eq!(e.kind(), Some("not-found"), "{e}");
        // A method the broker does not serve is no refusal.
        assert_eq!(c.status().unwrap_err().kind(), None);

        // Without a key the drain goes out unsigned; with one, signed.
        assert!(c.drain("gpu1:7767", 0).unwrap().draining);
        let c = c.with_admin_key(KEY.to_vec());
        assert_eq!(c.drain("gpu1:7767", 5000).unwrap().id, "gpu1:7767");
        assert_eq!(*seen.lock().unwrap(), [("gpu1:7767".to_string(), 0, false), ("gpu1:7767".to_string(), 5000, true)]);
    }
}
