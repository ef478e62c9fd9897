//! A capnp-rpc connection from the client's side: TCP, TLS (or plaintext,
//! when the caller's settings say so), the two-party network, and the
//! bootstrap capability of the interface the caller names.
//! Every rgpu client of a capnp interface sets it up the same way (the
//! broker's clients, the GPU server's agent, the shim's control plane), so
//! it is written once, generic over the interface.
//!
//! capnp-rpc is not `Send`: everything here runs on a `LocalSet`.

use std::time::Duration;

use capnp::capability::FromClientHook;
use capnp_rpc::rpc_twoparty_capnp::Side;
use capnp_rpc::{twoparty, RpcSystem};
use futures::AsyncReadExt;
use rgpu_tls::guard::Refusal;
use rgpu_tls::{ClientSecurity, TlsError};
use thiserror::Error;
use tokio_util::compat::TokioAsyncReadCompatExt;

/// How long [`connect`] and [`dial`] wait by default for TCP to connect.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Error)]
pub enum ConnectError {
    #[error("connection timed out")]
    TimedOut,
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Tls(#[from] TlsError),
}

/// A capnp-rpc connection and the capability it bootstrapped. A task on
/// the `LocalSet` it was made on drives the connection; dropping this
/// ends that task and so the connection, which is what every caller wants
/// once it stops making calls (a clone of the client kept longer only
/// sees "disconnected").
pub struct Connection<C> {
    client: C,
    driver: tokio::task::JoinHandle<Result<(), capnp::Error>>,
    refusal: Refusal,
}

impl<C> Connection<C> {
    pub fn client(&self) -> &C {
        &self.client
    }

    /// True when this plaintext connection was turned away by a peer that
    /// requires TLS: a failed call then means that, and says so
    /// ([`TlsError::ServerWantsTls`]).
    pub fn refused_for_tls(&self) -> bool {
        self.refusal.needs_tls()
    }

    /// True once the peer closed the connection or it failed.
    pub fn is_closed(&self) -> bool {
        self.driver.is_finished()
    }
}

impl<C> Drop for Connection<C> {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

/// Connects TCP to `addr` within `timeout`, with Nagle off: every capnp-rpc
/// call is a small message that waits for its answer.
pub async fn dial(addr: &str, timeout: Duration) -> Result<tokio::net::TcpStream, ConnectError> {
    let stream = tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr))
        .await
        .map_err(|_| ConnectError::TimedOut)??;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// Bootstraps interface `C` over `stream` (already connected, and past any
/// preamble the peer expects first). Must be called on a `LocalSet`.
pub fn bootstrap<C, S>(stream: S) -> Connection<C>
where
    C: FromClientHook,
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + 'static,
{
    let (reader, writer) = stream.compat().split();
    let network = twoparty::VatNetwork::new(
        futures::io::BufReader::new(reader),
        futures::io::BufWriter::new(writer),
        Side::Client,
        Default::default(),
    );
    let mut rpc = RpcSystem::new(Box::new(network), None);
    let client: C = rpc.bootstrap(Side::Server);
    let driver = tokio::task::spawn_local(rpc);
    Connection { client, driver, refusal: Refusal::default() }
}

/// [`dial`], TLS as `security` says, then [`bootstrap`]: for servers that
/// speak capnp-rpc from the first byte (the broker). Must be called on a
/// `LocalSet`.
pub async fn connect<C: FromClientHook>(
    addr: &str,
    security: &ClientSecurity,
    timeout: Duration,
) -> Result<Connection<C>, ConnectError> {
    let tcp = dial(addr, timeout).await?;
    let (stream, refusal) = tokio::time::timeout(timeout, rgpu_tls::client::connect(security, addr, tcp))
        .await
        .map_err(|_| ConnectError::TimedOut)??;
    let mut conn = bootstrap(stream);
    conn.refusal = refusal;
    Ok(conn)
}

#[cfg(test)]
mod tests {
    use super::*;
    use capnp::capability::Rc;
    use rgpu_protocol::broker_capnp::broker;

    /// A broker that knows only `version`.
    struct Fake {
        generation: u64,
    }

    impl broker::Server for Fake {
        async fn version(self: Rc<Self>, _: broker::VersionParams, mut r: broker::VersionResults) -> Result<(), capnp::Error> {
            r.get().set_protocol(self.generation as u32);
            Ok(())
        }
    }

    /// Serves one connection with `Fake` on the far end of `stream`;
    /// resolves when the client's side goes away.
    async fn serve_one<S>(stream: S, generation: u64)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + 'static,
    {
        let (reader, writer) = stream.compat().split();
        let network = twoparty::VatNetwork::new(
            futures::io::BufReader::new(reader),
            futures::io::BufWriter::new(writer),
            Side::Server,
            Default::default(),
        );
        let cap: broker::Client = capnp_rpc::new_client(Fake { generation });
        let _ = RpcSystem::new(Box::new(network), Some(cap.client)).await;
    }

    fn local<T>(f: impl std::future::Future<Output = T>) -> T {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        tokio::task::LocalSet::new().block_on(&rt, f)
    }

    #[test]
    fn bootstrap_reaches_the_peers_capability_and_drop_ends_the_connection() {
        local(async {
            let (ours, theirs) = tokio::io::duplex(1 << 16);
            let server = tokio::task::spawn_local(serve_one(theirs, 42));
            let conn = bootstrap::<broker::Client, _>(ours);
            let reply = conn.client().version_request().send().promise.await.unwrap();
            assert_eq!(reply.get().unwrap().get_protocol(), 42);
            assert!(!conn.is_closed());
            drop(conn);
            // The far end sees the connection close once ours is dropped.
            tokio::time::timeout(Duration::from_secs(5), server).await.expect("peer saw no close").unwrap();
        });
    }

    #[test]
    fn connect_over_tcp() {
        local(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            tokio::task::spawn_local(async move {
                let (s, _) = listener.accept().await.unwrap();
                serve_one(s, 7).await;
            });
            let conn = connect::<broker::Client>(&addr, &ClientSecurity::Plaintext, CONNECT_TIMEOUT).await.unwrap();
            let reply = conn.client().version_request().send().promise.await.unwrap();
            assert_eq!(reply.get().unwrap().get_protocol(), 7);
        });
    }

    #[test]
    fn a_closed_port_is_an_io_error() {
        local(async {
            // Bind, learn the port, close it: nothing listens there now.
            let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
            match connect::<broker::Client>(&addr, &ClientSecurity::Plaintext, CONNECT_TIMEOUT).await {
                Err(ConnectError::Io(e)) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused),
                Err(e) => panic!("expected a refused connection, got {e}"),
                Ok(_) => panic!("connected to a closed port"),
            }
        });
    }
}
