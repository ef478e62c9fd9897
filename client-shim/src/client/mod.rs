//! The shim's side of the wire: one [`connection::Connection`] per server.
//!
//! Start-up (hello, device inventory, session) goes over capnp-rpc in
//! [`control`], on a short-lived single-threaded tokio runtime; everything
//! after that is plain blocking I/O on the caller's own thread, because CUDA
//! calls arrive on any application thread and must not wait for a runtime.

pub mod connection;
pub mod control;
pub mod output;
pub mod redial;
pub mod security;
pub mod session_core;
pub mod transport_select;

#[cfg(test)]
mod testing;
#[cfg(test)]
mod connection_tests;

use thiserror::Error;

/// What can go wrong talking to a server; the driver API layer maps each to
/// a CUresult.
#[derive(Debug, Error, Clone)]
pub enum ClientError {
    #[error("cannot reach rgpu-server at {addr}: {reason}")]
    Unreachable { addr: String, reason: String },
    #[error("rgpu-server at {addr} speaks protocol {theirs}, this shim speaks {ours}")]
    VersionMismatch { addr: String, ours: u32, theirs: u32 },
    #[error("connection to rgpu-server at {addr} lost: {reason}")]
    Lost { addr: String, reason: String },
    #[error("rgpu-server at {addr} sent a malformed reply: {reason}")]
    Protocol { addr: String, reason: String },
    /// The server ran the call and answered with this CUresult.
    #[error("CUresult {0}")]
    Cuda(u32),
    /// This process may not use what it was given (a lease token bound to
    /// a client key it cannot use).
    #[error("{reason}")]
    NotPermitted { reason: String },
}

impl From<rgpu_control_client::ControlError> for ClientError {
    fn from(e: rgpu_control_client::ControlError) -> Self {
        use rgpu_control_client::ControlError as C;
        match e {
            C::Unreachable { addr, reason } => ClientError::Unreachable { addr, reason },
            C::VersionMismatch { addr, ours, theirs } => ClientError::VersionMismatch { addr, ours, theirs },
            C::Protocol { addr, reason } => ClientError::Protocol { addr, reason },
            C::Tls { addr, reason } => ClientError::Unreachable { addr, reason },
            // Only operator calls are refused this way; the shim makes none.
            C::Refused { addr, reason } => ClientError::Protocol { addr, reason },
            C::ClientKey { reason } => ClientError::NotPermitted { reason },
            // Local files are read and written by operator calls only.
            C::Local { reason } => ClientError::Protocol { addr: String::new(), reason },
        }
    }
}
