//! The client's side: which CA it trusts, which name it checks, and the two
//! ways to connect (async for capnp-rpc, blocking for the data plane).
//!
//! The name checked against the server's certificate is the host part of
//! the address the client dials (`gpuhost:7767` → `gpuhost`, `10.0.0.5:7767`
//! → the IP address, `[::1]:7767` → `::1`), so a certificate is issued for
//! the names clients use, as for HTTPS. An override
//! ([`SERVER_NAME_ENV`] / `--tls-server-name`) replaces it for every server
//! a process dials, for fabrics reached by addresses no certificate names
//! (all servers then present a certificate for that one name).

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, RootCertStore};

use crate::TlsError;

/// The CA file a client checks servers' certificates against.
pub const CA_ENV: &str = "RGPU_TLS_CA";
/// Replaces the host part of the address as the name checked.
pub const SERVER_NAME_ENV: &str = "RGPU_TLS_SERVER_NAME";
/// `1`: speak plaintext, on a network that is trusted.
pub const PLAINTEXT_ENV: &str = "RGPU_PLAINTEXT";

/// A client's TLS: its trust roots and, if set, the one server name it checks.
#[derive(Debug)]
pub struct TlsClient {
    config: Arc<ClientConfig>,
    /// The same, offering [`crate::DATA_RECORDS_ALPN`]: the data plane's.
    data_config: Arc<ClientConfig>,
    server_name: Option<String>,
}

/// How a client talks to servers: TLS, or plaintext because it was told so.
#[derive(Debug, Clone)]
pub enum ClientSecurity {
    Tls(Arc<TlsClient>),
    Plaintext,
}

impl ClientSecurity {
    /// From the settings: a CA file means TLS; `plaintext` means plaintext;
    /// neither, or both, is an error that says what to set.
    pub fn new(ca: Option<&Path>, server_name: Option<String>, plaintext: bool) -> Result<ClientSecurity, TlsError> {
        match (ca, plaintext) {
            (Some(_), true) => Err(TlsError::Config(format!(
                "both a TLS CA ({CA_ENV} / --tls-ca) and plaintext ({PLAINTEXT_ENV} / --plaintext) are set: choose one"
            ))),
            (None, true) => Ok(ClientSecurity::Plaintext),
            (Some(ca), false) => {
                let pem = std::fs::read(ca).map_err(|e| TlsError::File {
                    what: "TLS CA file",
                    path: ca.to_path_buf(),
                    why: e.to_string(),
                })?;
                TlsClient::from_ca_pem(&pem, server_name)
                    .map_err(|e| TlsError::Config(format!("TLS CA file {}: {e}", ca.display())))
                    .map(|c| ClientSecurity::Tls(Arc::new(c)))
            }
            (None, false) => Err(TlsError::Config(format!(
                "no TLS CA configured: set {CA_ENV} (or --tls-ca) to the CA file that signed the servers' certificates, \
                 or {PLAINTEXT_ENV}=1 (--plaintext) to talk in clear on a trusted network"
            ))),
        }
    }

    /// From the environment ([`CA_ENV`], [`SERVER_NAME_ENV`],
    /// [`PLAINTEXT_ENV`]): for the shim and the NVML library, which have no
    /// flags.
    pub fn from_env() -> Result<ClientSecurity, TlsError> {
        let var = |n: &str| std::env::var(n).ok().filter(|v| !v.trim().is_empty());
        let ca = var(CA_ENV);
        let plaintext = match var(PLAINTEXT_ENV).as_deref().map(str::trim) {
            None | Some("0" | "false" | "no" | "off") => false,
            Some("1" | "true" | "yes" | "on") => true,
            Some(o) => return Err(TlsError::Config(format!("{PLAINTEXT_ENV}={o:?}: expected 1 or 0"))),
        };
        ClientSecurity::new(ca.as_deref().map(Path::new), var(SERVER_NAME_ENV), plaintext)
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, ClientSecurity::Tls(_))
    }
}

impl TlsClient {
    /// Trusts the certificates in `pem` (one or more CA certificates).
    pub fn from_ca_pem(pem: &[u8], server_name: Option<String>) -> Result<TlsClient, String> {
        let mut roots = RootCertStore::empty();
        let mut n = 0;
        for cert in CertificateDer::pem_slice_iter(pem) {
            let cert = cert.map_err(|e| format!("not PEM: {e}"))?;
            roots.add(cert).map_err(|e| format!("not a usable CA certificate: {e}"))?;
            n += 1;
        }
        if n == 0 {
            return Err("holds no certificate".into());
        }
        let config = ClientConfig::builder_with_provider(crate::provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
        if let Some(n) = &server_name {
            ServerName::try_from(n.clone()).map_err(|_| format!("{SERVER_NAME_ENV}={n:?} is not a host name or address"))?;
        }
        let mut data_config = config.clone();
        data_config.alpn_protocols = vec![crate::DATA_RECORDS_ALPN.to_vec()];
        Ok(TlsClient { config: Arc::new(config), data_config: Arc::new(data_config), server_name })
    }

    /// The name the certificate of the server at `addr` must carry.
    pub fn server_name(&self, addr: &str) -> Result<ServerName<'static>, TlsError> {
        let name = self.server_name.clone().unwrap_or_else(|| host_of(addr).to_string());
        ServerName::try_from(name.clone()).map_err(|_| {
            TlsError::Config(format!("{addr}: {name:?} is no name to check a certificate against; set {SERVER_NAME_ENV}"))
        })
    }

    pub fn config(&self) -> Arc<ClientConfig> {
        self.config.clone()
    }

    /// A fresh data-plane connection to `addr`, handshake not yet done;
    /// `records`: offer rgpu's own records after the handshake
    /// ([`crate::DATA_RECORDS_ALPN`]).
    pub fn connection(&self, addr: &str, records: bool) -> Result<rustls::ClientConnection, TlsError> {
        let config = if records { &self.data_config } else { &self.config };
        rustls::ClientConnection::new(config.clone(), self.server_name(addr)?)
            .map_err(|e| TlsError::Handshake { addr: addr.into(), why: e.to_string() })
    }
}

/// The host part of `host:port`, `[v6]:port`, or a bare host.
pub fn host_of(addr: &str) -> &str {
    let addr = addr.trim();
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match addr.rsplit_once(':') {
        // A bare IPv6 address has more than one colon.
        Some((h, _)) if !h.contains(':') => h,
        _ => addr,
    }
}

/// Turns a handshake failure into the error a user can act on.
pub fn explain(addr: &str, e: &std::io::Error) -> TlsError {
    let inner = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>());
    match inner {
        Some(rustls::Error::AlertReceived(rustls::AlertDescription::ProtocolVersion)) => {
            TlsError::ServerIsPlaintext { addr: addr.into() }
        }
        Some(rustls::Error::InvalidCertificate(c)) => TlsError::Handshake {
            addr: addr.into(),
            why: format!("its certificate is not trusted ({c:?}): is {CA_ENV} / --tls-ca the CA that signed it, and does it name the host dialled (or {SERVER_NAME_ENV})?"),
        },
        Some(r) => TlsError::Handshake { addr: addr.into(), why: r.to_string() },
        None if e.kind() == std::io::ErrorKind::UnexpectedEof => TlsError::Handshake {
            addr: addr.into(),
            why: "the server closed the connection during the handshake".into(),
        },
        None => TlsError::Handshake { addr: addr.into(), why: e.to_string() },
    }
}

/// Connects `stream` (a TCP connection to `addr`) as `security` says. With
/// plaintext, the returned [`crate::guard::Refusal`] tells whether the
/// server turned us away for want of TLS (check it when the first call
/// fails).
pub async fn connect(
    security: &ClientSecurity,
    addr: &str,
    stream: tokio::net::TcpStream,
) -> Result<(Box<dyn crate::AsyncStream>, crate::guard::Refusal), TlsError> {
    connect_bound(security, addr, stream).await.map(|(s, r, _)| (s, r))
}

/// [`connect`], also returning the connection's channel binding
/// ([`crate::channel_binding`]; None in plaintext).
pub async fn connect_bound(
    security: &ClientSecurity,
    addr: &str,
    stream: tokio::net::TcpStream,
) -> Result<(Box<dyn crate::AsyncStream>, crate::guard::Refusal, Option<[u8; 32]>), TlsError> {
    match security {
        ClientSecurity::Plaintext => {
            let (g, refusal) = crate::guard::PlaintextGuard::new(stream);
            Ok((Box::new(g), refusal, None))
        }
        ClientSecurity::Tls(tls) => {
            let connector = tokio_rustls::TlsConnector::from(tls.config());
            let s = connector.connect(tls.server_name(addr)?, stream).await.map_err(|e| explain(addr, &e))?;
            let binding = crate::channel_binding(s.get_ref().1);
            Ok((Box::new(s), crate::guard::Refusal::default(), binding))
        }
    }
}

/// Completes a client handshake over a blocking socket (the data plane).
/// The socket's read timeout, if set, bounds each wait.
pub fn handshake_blocking(
    tls: &TlsClient,
    addr: &str,
    stream: &mut std::net::TcpStream,
) -> Result<rustls::ClientConnection, TlsError> {
    handshake_blocking_with(tls, addr, stream, true)
}

/// [`handshake_blocking`], choosing whether to offer rgpu's records (a
/// client that does not keeps rustls' records; tests of older peers).
pub fn handshake_blocking_with(
    tls: &TlsClient,
    addr: &str,
    stream: &mut std::net::TcpStream,
    records: bool,
) -> Result<rustls::ClientConnection, TlsError> {
    let mut conn = tls.connection(addr, records)?;
    while conn.is_handshaking() {
        if let Err(e) = conn.complete_io(stream) {
            return Err(explain(addr, &e));
        }
    }
    Ok(conn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_part_is_the_name_checked() {
        assert_eq!(host_of("gpuhost:7767"), "gpuhost");
        assert_eq!(host_of("10.0.0.5:7767"), "10.0.0.5");
        assert_eq!(host_of("[::1]:7767"), "::1");
        assert_eq!(host_of("gpuhost"), "gpuhost");
        assert_eq!(host_of("fe80::1"), "fe80::1");
    }

    #[test]
    fn neither_or_both_modes_is_an_error() {
        let e = ClientSecurity::new(None, None, false).unwrap_err().to_string();
        assert!(e.contains(CA_ENV) && e.contains(PLAINTEXT_ENV), "{e}");
        let e = ClientSecurity::new(Some(Path::new("/nonexistent")), None, true).unwrap_err().to_string();
        assert!(e.contains("choose one"), "{e}");
        assert!(matches!(ClientSecurity::new(None, None, true), Ok(ClientSecurity::Plaintext)));
    }
}
