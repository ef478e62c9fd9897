//! TLS for the shim's connections: decided once per process from
//! `RGPU_TLS_CA` (the CA file that signed the servers' certificates),
//! `RGPU_TLS_SERVER_NAME` (the name to check instead of each address's host
//! part) and `RGPU_PLAINTEXT=1` (talk in clear on a trusted network); one of
//! the first and the last must be set, or no server is used
//! (`rgpu_tls::ClientSecurity::from_env`). Both planes follow it: the
//! control plane in [`super::control`], the data connection in
//! [`secure`].

use std::sync::OnceLock;
use std::time::Duration;

use rgpu_tls::{ClientSecurity, TlsError};
use rgpu_transport::tcp::TcpTransport;

use super::ClientError;

static SECURITY: OnceLock<Result<ClientSecurity, String>> = OnceLock::new();

/// The process's setting, read once.
pub fn security(addr: &str) -> Result<&'static ClientSecurity, ClientError> {
    SECURITY
        .get_or_init(|| ClientSecurity::from_env().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|reason| ClientError::Unreachable { addr: addr.into(), reason: reason.clone() })
}

/// Puts a fresh data connection to `addr` under TLS (handshake done), or
/// leaves it plaintext, as the process is set.
pub fn secure(t: TcpTransport, addr: &str, timeout: Duration) -> Result<TcpTransport, ClientError> {
    let tls = match security(addr)? {
        ClientSecurity::Plaintext => return Ok(t),
        ClientSecurity::Tls(tls) => tls,
    };
    let fail = |e: TlsError| ClientError::Unreachable { addr: addr.into(), reason: e.to_string() };
    let io = |e: std::io::Error| ClientError::Unreachable { addr: addr.into(), reason: e.to_string() };
    let mut stream = t.into_stream().map_err(io)?;
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    let conn = rgpu_tls::client::handshake_blocking(tls, addr, &mut stream).map_err(fail)?;
    stream.set_read_timeout(None).map_err(io)?;
    rgpu_transport::rep_movsb::hint_if_slow();
    TcpTransport::with_tls(stream, conn.into()).map_err(io)
}

/// The attach answer a TLS server gives a plaintext client, as an error
/// that says so.
pub fn check_answer(addr: &str, answer: &[u8; 8]) -> Result<(), ClientError> {
    if answer == rgpu_tls::NEEDS_TLS {
        let reason = TlsError::ServerWantsTls { addr: addr.into() }.to_string();
        return Err(ClientError::Unreachable { addr: addr.into(), reason });
    }
    Ok(())
}
