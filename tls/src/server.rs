//! A daemon's side: its certificate chain and key, and the accept that
//! looks at a connection's first byte before anything else. A TLS server
//! answers a plaintext client with [`NEEDS_TLS`] and a plaintext server
//! answers a TLS ClientHello with [`NOT_TLS_ALERT`]; both then close. No
//! connection ever continues in the mode its client did not choose.

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use crate::{TlsError, NEEDS_TLS, NOT_TLS_ALERT};

/// How a daemon serves: TLS with its certificate, or plaintext because it
/// was told so.
#[derive(Debug, Clone)]
pub enum ServerSecurity {
    Tls(Arc<ServerConfig>),
    Plaintext,
}

impl ServerSecurity {
    /// From the settings: `--tls-cert` and `--tls-key` mean TLS,
    /// `--plaintext` plaintext; neither (or a mix) is an error that says
    /// what to set.
    pub fn new(cert: Option<&Path>, key: Option<&Path>, plaintext: bool) -> Result<ServerSecurity, TlsError> {
        match (cert, key, plaintext) {
            (None, None, true) => Ok(ServerSecurity::Plaintext),
            (Some(_), _, true) | (_, Some(_), true) => Err(TlsError::Config(
                "--plaintext and --tls-cert/--tls-key are both set: choose one".into(),
            )),
            (Some(c), Some(k), false) => {
                let read = |what, p: &Path| {
                    std::fs::read(p).map_err(|e| TlsError::File { what, path: p.to_path_buf(), why: e.to_string() })
                };
                ServerSecurity::from_pem(&read("TLS certificate file", c)?, &read("TLS key file", k)?)
                    .map_err(|e| TlsError::Config(format!("--tls-cert {} / --tls-key {}: {e}", c.display(), k.display())))
            }
            (Some(_), None, false) | (None, Some(_), false) => {
                Err(TlsError::Config("--tls-cert and --tls-key go together".into()))
            }
            (None, None, false) => Err(TlsError::Config(
                "no TLS certificate configured: give --tls-cert FILE and --tls-key FILE (PEM; the certificate must name \
                 the host clients dial), or --plaintext to serve in clear on a trusted network"
                    .into(),
            )),
        }
    }

    /// From a PEM certificate chain (leaf first) and a PEM private key.
    pub fn from_pem(cert_pem: &[u8], key_pem: &[u8]) -> Result<ServerSecurity, String> {
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
            .collect::<Result<_, _>>()
            .map_err(|e| format!("certificate not PEM: {e}"))?;
        if chain.is_empty() {
            return Err("the certificate file holds no certificate".into());
        }
        let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| format!("key not PEM: {e}"))?;
        let mut config = ServerConfig::builder_with_provider(crate::provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| format!("certificate and key do not make a usable pair: {e}"))?;
        // No resumption: rgpu clients connect a few times per program, and a
        // ticket written after the handshake would have to be flushed by the
        // data plane's first write.
        config.send_tls13_tickets = 0;
        config.alpn_protocols = vec![crate::DATA_RECORDS_ALPN.to_vec()];
        Ok(ServerSecurity::Tls(Arc::new(config)))
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, ServerSecurity::Tls(_))
    }
}

/// A connection past its first byte: TLS (handshake done) or plaintext.
pub enum Accepted {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

/// Why an accepted connection was closed.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error("a plaintext client on a TLS port (told it needs TLS)")]
    PlaintextClient,
    #[error("a TLS client on a plaintext port (--plaintext; answered with a protocol_version alert)")]
    TlsClient,
    #[error("TLS handshake failed: {0}")]
    Handshake(io::Error),
    #[error("closed before sending anything")]
    Closed,
    #[error("{0}")]
    Io(io::Error),
}

/// Looks at the connection's first byte and sets it up as `security`
/// says. The caller bounds the time it may take.
pub async fn accept(security: &ServerSecurity, mut stream: TcpStream) -> Result<Accepted, Refused> {
    let mut first = [0u8; 1];
    let n = stream.peek(&mut first).await.map_err(Refused::Io)?;
    if n == 0 {
        return Err(Refused::Closed);
    }
    let tls = crate::is_tls_record(first[0]);
    match security {
        ServerSecurity::Tls(config) if tls => {
            let acceptor = tokio_rustls::TlsAcceptor::from(config.clone());
            acceptor.accept(stream).await.map(|s| Accepted::Tls(Box::new(s))).map_err(Refused::Handshake)
        }
        ServerSecurity::Tls(_) => {
            let _ = stream.write_all(NEEDS_TLS).await;
            let _ = stream.shutdown().await;
            Err(Refused::PlaintextClient)
        }
        ServerSecurity::Plaintext if tls => {
            let _ = stream.write_all(&NOT_TLS_ALERT).await;
            let _ = stream.shutdown().await;
            Err(Refused::TlsClient)
        }
        ServerSecurity::Plaintext => Ok(Accepted::Plain(stream)),
    }
}

impl Accepted {
    pub fn is_tls(&self) -> bool {
        matches!(self, Accepted::Tls(_))
    }

    /// The TLS exporter value a client's proof over this connection covers
    /// ([`crate::channel_binding`]); None in plaintext.
    pub fn channel_binding(&self) -> Option<[u8; 32]> {
        match self {
            Accepted::Plain(_) => None,
            Accepted::Tls(t) => crate::channel_binding(t.get_ref().1),
        }
    }

    /// The socket and the TLS state, for a connection served with blocking
    /// I/O from here on (the data plane). Nothing buffered is lost: the
    /// TLS state keeps what it has read and not yet handed out.
    pub fn into_parts(self) -> (TcpStream, Option<rustls::Connection>) {
        match self {
            Accepted::Plain(s) => (s, None),
            Accepted::Tls(t) => {
                let (s, conn) = t.into_inner();
                (s, Some(rustls::Connection::Server(conn)))
            }
        }
    }
}

impl AsyncRead for Accepted {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Accepted::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Accepted::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Accepted {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Accepted::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Accepted::Tls(s) => Pin::new(&mut **s).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Accepted::Plain(s) => Pin::new(s).poll_flush(cx),
            Accepted::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Accepted::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Accepted::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
        }
    }
}
