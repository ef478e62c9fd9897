use std::path::PathBuf;

/// Why TLS could not be set up or used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {what} {path}: {why}")]
    File { what: &'static str, path: PathBuf, why: String },
    #[error("{0}")]
    Config(String),
    #[error("TLS with {addr} failed: {why}")]
    Handshake { addr: String, why: String },
    #[error("{addr} requires TLS, and this client is set to plaintext: give it the CA that signed the server's certificate (RGPU_TLS_CA / --tls-ca) instead of RGPU_PLAINTEXT / --plaintext")]
    ServerWantsTls { addr: String },
    #[error("{addr} does not speak TLS (it answers in plaintext: a server started with --plaintext); set RGPU_PLAINTEXT=1 / --plaintext only if the network to it is trusted")]
    ServerIsPlaintext { addr: String },
}
