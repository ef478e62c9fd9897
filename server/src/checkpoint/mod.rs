//! A session's state as bytes that can leave the server: [`capture`] writes
//! a quiesced session, [`rebuild::Opened::rebuild`] makes another server's
//! (or a restarted one's) session the same, every handle the client minted
//! and every device pointer it holds still valid. The format is described
//! in `docs/migration.md`; its framing is in [`format`].
//!
//! What is captured: the client's allocations at their addresses, with
//! their contents; each loaded module's image and its globals (addresses
//! and current contents); streams (flags, priority); events (flags, and
//! how long before the capture their last record completed, so elapsed
//! times between them survive); the lease the session runs under (its
//! admission: budget, devices, share); the session id and key, the last
//! request executed, the deferred error, the sticky error and the reply
//! window, so the client's resume on the new server works as on the old.
//! Memory pools live in the shim, carved from ordinary allocations, so
//! they travel as allocations. Instantiated graphs travel as their
//! instantiation requests ([`graph`]).
//!
//! Virtual memory management objects travel as physical allocations (with
//! their contents), reservations and maps ([`vmm`]).
//!
//! What is refused (nothing written): a backend that cannot place memory at
//! given addresses (the cuda backend: NOT_SUPPORTED), and a session whose
//! queued work does not finish within the quiesce bound.
//!
//! The snapshot is hostile input when read: every length is bounded before
//! it is used, every handle and address checked as a request's would be
//! (the backend refuses overlapping or out-of-range placements), and no
//! input can panic; a rebuild that fails leaves a state the caller drops,
//! which frees what was rebuilt so far.

pub mod capture;
pub mod format;
pub mod graph;
pub mod precopy;
pub mod rebuild;
pub mod vmm;

#[cfg(test)]
mod tests;


use std::io;
use std::time::Duration;

use rgpu_cuda_types::CuError;

use crate::lease::Admission;
use crate::session::registry::SessionKey;

pub use capture::{capture, check_capturable, Captured};
pub use rebuild::{open, Opened};

/// Why a session could not be written or rebuilt.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("the snapshot ends early (cut short, or not written to its end)")]
    Truncated,
    #[error("not an rgpu session snapshot (bad magic)")]
    BadMagic,
    #[error("snapshot format version {0}; this server reads versions {min} to {max}", min = format::MIN_VERSION, max = format::VERSION)]
    Version(u32),
    #[error("malformed snapshot: {0}")]
    Malformed(String),
    #[error("the snapshot's {what} is {len}, more than this server takes ({max})")]
    TooLarge { what: &'static str, len: u64, max: u64 },
    #[error("the snapshot does not fit this server: {0}")]
    Incompatible(String),
    #[error("this session cannot be captured: {0}")]
    NotCapturable(&'static str),
    #[error("this backend cannot place memory at given addresses, so its sessions cannot move (the cuda backend: not supported)")]
    Unsupported,
    #[error("the session's queued work did not finish within {0:?}")]
    Busy(Duration),
    #[error("device error {0:?} while {1}")]
    Device(CuError, &'static str),
}

impl SnapshotError {
    /// A read that hit the end is a snapshot cut short.
    fn read(e: io::Error) -> SnapshotError {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            SnapshotError::Truncated
        } else {
            SnapshotError::Io(e)
        }
    }

    /// The CUresult a client-facing caller reports this as.
    pub fn code(&self) -> CuError {
        match self {
            SnapshotError::Unsupported | SnapshotError::NotCapturable(_) => CuError::NOT_SUPPORTED,
            SnapshotError::Busy(_) => CuError::NOT_READY,
            SnapshotError::Device(e, _) => *e,
            _ => CuError::INVALID_VALUE,
        }
    }
}

/// What a snapshot holds of the session beyond its [`crate::state::SessionState`]:
/// who it is and where its connection stood.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionMeta {
    pub id: u64,
    pub key: SessionKey,
    pub client_name: String,
    /// The last request executed (the resume handshake says it).
    pub executed: u64,
    /// The deferred error not yet reported.
    pub deferred: Option<CuError>,
    /// The lease the session was admitted by, if any.
    pub admission: Option<Admission>,
}

/// Longest client name kept.
pub const MAX_CLIENT_NAME: usize = 256;
/// Most devices a snapshot may name (the sim's own bound).
pub const MAX_DEVICES: u32 = 64;
/// Most globals one module record may place.
pub const MAX_GLOBALS: u32 = 1 << 16;
