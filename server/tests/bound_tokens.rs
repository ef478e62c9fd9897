//! Lease tokens bound to a client key (docs/security.md, "Bound tokens"):
//! over real control connections, a session opens only with the key
//! holder's signature over this connection's one-use challenge; the token
//! alone, another key's signature, a signature made for another connection
//! and a challenge used twice are all refused.

mod common;

use std::time::Duration;

use common::{TestServer, IO_TIMEOUT};
use rgpu_protocol::binding::ClientKey;
use rgpu_protocol::control_capnp::gpu_server;
use rgpu_protocol::token::Claims;
use rgpu_protocol::{CONTROL_PREAMBLE, PROTOCOL_VERSION};
use rgpu_server::config::PoolConfig;
use tokio::io::AsyncWriteExt;

const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

fn token(gpu: [u8; 16], client_key: Option<[u8; 32]>) -> Vec<u8> {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    Claims {
        lease_id: 11,
        generation: 1,
        deadline_ms: now + 60_000,
        memory_limit: 0,
        tenant: "alice".into(),
        gpus: vec![gpu],
        pkey: None,
        compute_milli: 0,
        client_key,
    }
    .sign(KEY)
}

struct Conn {
    server: gpu_server::Client,
    _conn: rgpu_broker_client::rpc::Connection<gpu_server::Client>,
}

impl Conn {
    async fn open(addr: &str) -> Conn {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.write_all(CONTROL_PREAMBLE).await.unwrap();
        let conn = rgpu_broker_client::rpc::bootstrap::<gpu_server::Client, _>(stream);
        let server = conn.client().clone();
        let mut req = server.hello_request();
        req.get().set_client_version(PROTOCOL_VERSION);
        req.get().set_client_name("bound-tokens");
        req.send().promise.await.unwrap();
        Conn { server, _conn: conn }
    }

    async fn challenge(&self) -> Vec<u8> {
        let reply = self.server.challenge_request().send().promise.await.unwrap();
        reply.get().unwrap().get_nonce().unwrap().to_vec()
    }

    /// openSession: Ok(session id) or the refusal's text.
    async fn open_session(&self, token: &[u8], nonce: &[u8], proof: &[u8]) -> Result<u64, String> {
        let mut req = self.server.open_session_request();
        req.get().set_token(token);
        req.get().set_client_name("bound-tokens");
        req.get().set_nonce(nonce);
        req.get().set_proof(proof);
        match req.send().promise.await {
            Ok(r) => Ok(r.get().unwrap().get_session_id()),
            Err(e) => Err(e.to_string()),
        }
    }

    async fn device_status(&self, token: &[u8], nonce: &[u8], proof: &[u8]) -> Result<usize, String> {
        let mut req = self.server.device_status_request();
        req.get().set_token(token);
        req.get().set_nonce(nonce);
        req.get().set_proof(proof);
        match req.send().promise.await {
            Ok(r) => Ok(r.get().unwrap().get_devices().unwrap().len() as usize),
            Err(e) => Err(e.to_string()),
        }
    }
}

fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async { tokio::time::timeout(IO_TIMEOUT * 3, f).await.expect("control plane timed out") })
}

fn gpu_of(addr: &str) -> [u8; 16] {
    common::list_devices(addr)[0].uuid.clone().try_into().unwrap()
}

#[test]
fn a_bound_token_opens_a_session_only_with_a_fresh_proof_on_its_own_connection() {
    let pool = PoolConfig { broker_key: Some(KEY.to_vec()), ..Default::default() };
    let srv = TestServer::start_pool(1, 64 << 20, Duration::from_secs(30), pool);
    let addr = srv.addr.to_string();
    let holder = ClientKey::generate().unwrap();
    let thief = ClientKey::generate().unwrap();
    let gpu = gpu_of(&addr);
    let bound = token(gpu, Some(holder.public()));
    block_on(async {
        let a = Conn::open(&addr).await;
        let b = Conn::open(&addr).await;

        let e = a.open_session(&bound, &[], &[]).await.unwrap_err();
        assert!(e.contains("bound to client key"), "the token alone: {e}");

        let na = a.challenge().await;
        let theirs = thief.prove(&na, None, &bound);
        let e = a.open_session(&bound, &na, &theirs).await.unwrap_err();
        assert!(e.contains("bound to client key"), "another key's signature: {e}");

        // The refusal used the challenge up: the holder's proof over it is
        // refused too, and a new challenge works.
        let late = holder.prove(&na, None, &bound);
        assert!(a.open_session(&bound, &na, &late).await.is_err(), "a challenge is good for one try");

        let na = a.challenge().await;
        let proof_a = holder.prove(&na, None, &bound);
        // Connection B has its own challenge; A's nonce and proof do not
        // open anything there (a proof seen once cannot be relayed).
        let _nb = b.challenge().await;
        let e = b.open_session(&bound, &na, &proof_a).await.unwrap_err();
        assert!(e.contains("bound to client key"), "A's proof on B: {e}");
        assert!(a.open_session(&bound, &na, &proof_a).await.is_ok(), "the holder, on its connection");
        assert!(a.open_session(&bound, &na, &proof_a).await.is_err(), "the same proof twice");

        // deviceStatus (NVML's memory, `rgpu smi`) wants the proof as well.
        assert!(b.device_status(&bound, &[], &[]).await.is_err(), "device status on the token alone");
        let nb = b.challenge().await;
        assert_eq!(b.device_status(&bound, &nb, &holder.prove(&nb, None, &bound)).await, Ok(1));

        // A bearer token still opens sessions on a server that allows them.
        let bearer = token(gpu, None);
        assert!(b.open_session(&bearer, &[], &[]).await.is_ok());
    });
    srv.stop();
}

#[test]
fn a_server_requiring_bound_tokens_refuses_bearer_ones() {
    let pool = PoolConfig { broker_key: Some(KEY.to_vec()), require_bound_tokens: true, ..Default::default() };
    let srv = TestServer::start_pool(1, 64 << 20, Duration::from_secs(30), pool);
    let addr = srv.addr.to_string();
    let holder = ClientKey::generate().unwrap();
    let gpu = gpu_of(&addr);
    block_on(async {
        let a = Conn::open(&addr).await;
        let e = a.open_session(&token(gpu, None), &[], &[]).await.unwrap_err();
        assert!(e.contains("--require-bound-tokens"), "{e}");
        let bound = token(gpu, Some(holder.public()));
        let n = a.challenge().await;
        assert!(a.open_session(&bound, &n, &holder.prove(&n, None, &bound)).await.is_ok());
    });
    srv.stop();
}
