//! TLS for rgpu's network planes (rustls, ring provider): the GPU server's
//! port (control plane and TCP data plane behind one TLS layer, the plane's
//! preamble inside it) and the pool broker's capnp-rpc port.
//!
//! - [`client`]: what a client trusts (a CA file) and the name it checks the
//!   server's certificate against (the host part of the address it dials,
//!   or an override); the async connect for capnp-rpc and the blocking
//!   handshake for the data plane.
//! - [`server`]: a daemon's certificate and key, and the accept that tells
//!   a TLS client from a plaintext one by its first byte, so that neither
//!   side ever falls back to the other silently.
//! - [`guard`]: the plaintext client's side of that rule.
//! - [`pki`]: a throwaway CA and certificates (`rgpu demo`, tests).
//!
//! Either mode is chosen explicitly: a daemon serves TLS when it has a
//! certificate and plaintext only with `--plaintext`; a client expects TLS
//! when it has a CA and plaintext only with `RGPU_PLAINTEXT=1` /
//! `--plaintext`. With neither, nothing starts and nothing connects.

use std::sync::Arc;

pub mod client;
mod error;
pub mod guard;
pub mod pki;
pub mod server;
pub mod testing;

pub use client::{ClientSecurity, TlsClient};
pub use error::TlsError;
pub use server::ServerSecurity;

pub use rustls;

/// The ALPN protocol a data-plane client offers and a GPU server accepts:
/// both then seal the data plane's records themselves, keyed from the TLS
/// exporter (`rgpu_transport`'s `records` module). A peer that does not
/// offer or accept it keeps rustls' records, so either side may be older.
/// Control-plane clients never offer it.
pub const DATA_RECORDS_ALPN: &[u8] = b"rgpu-records/1";

/// What a TLS endpoint answers a plaintext client with before it closes,
/// so that the client can say why it was refused (see [`guard`]).
pub const NEEDS_TLS: &[u8; 8] = b"RGPUTLS!";

/// What a plaintext endpoint answers a TLS ClientHello with: a fatal TLS
/// alert `protocol_version`, which the client's TLS library reports as
/// such (and rgpu's clients explain, [`client::explain`]).
pub const NOT_TLS_ALERT: [u8; 7] = [0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x46];

/// Whether the first byte a client sent opens a TLS handshake record
/// (content type 22). No rgpu plaintext client starts so: a GPU-server
/// client sends `RGPU...`, a capnp-rpc message starts with its segment
/// count less one, a small number (0 for every message rgpu sends first).
pub fn is_tls_record(first: u8) -> bool {
    first == 0x16
}

/// The crypto provider every rgpu endpoint uses: ring's, AES-128-GCM
/// preferred (TLS 1.3's mandatory suite; a quarter fewer AES rounds than
/// AES-256 on the data plane's bulk).
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    if let Some(i) = p.cipher_suites.iter().position(|s| s.suite() == rustls::CipherSuite::TLS13_AES_128_GCM_SHA256) {
        let first = p.cipher_suites.remove(i);
        p.cipher_suites.insert(0, first);
    }
    Arc::new(p)
}

/// Reads and writes: what capnp-rpc and the preamble reader run over,
/// TLS or not.
/// A connection's TLS exporter value for channel binding (RFC 5705 /
/// RFC 8446 section 7.5): both ends compute the same 32 bytes, and no other
/// connection has them, so a signature over them cannot be relayed.
pub fn channel_binding<D>(conn: &rustls::ConnectionCommon<D>) -> Option<[u8; 32]> {
    conn.export_keying_material([0u8; 32], b"EXPORTER-rgpu-token-binding", None).ok()
}

pub trait AsyncStream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> AsyncStream for T {}
