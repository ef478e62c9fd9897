//! The rgpu wire protocol, with no I/O of its own.
//!
//! - `control_capnp`: the control plane (capnp-rpc): hello, device inventory,
//!   sessions. Cold path only.
//! - `data_capnp`: the data plane's messages, one `Request` or `Reply` per frame.
//! - `broker_capnp`: the GPU pool broker (capnp-rpc): registration,
//!   heartbeats, leases, drain; [`token`]: the lease tokens it signs;
//!   [`scope`]: the topology unit a lease request names; [`auth`]: what
//!   the broker's logins and registrations prove; [`binding`]: the proof
//!   that a client holds the key a lease token is bound to.
//! - [`bundle`]: the image the shim's JIT linker hands back for several inputs.
//! - [`frame`]: the data plane's framing: a fixed header, one capnp message,
//!   then raw bulk bytes.
//!
//! The split follows the costs measured on our machines: a capnp-rpc round
//! trip costs more CPU than a framed message, and an asynchronous CUDA call
//! must not wait for any round trip at all.

#[allow(clippy::all, unused_parens, dead_code)]
#[rustfmt::skip]
pub mod control_capnp {
    include!("generated/control_capnp.rs");
}
#[allow(clippy::all, unused_parens, dead_code)]
#[rustfmt::skip]
pub mod broker_capnp {
    include!("generated/broker_capnp.rs");
}
#[allow(clippy::all, unused_parens, dead_code)]
#[rustfmt::skip]
pub mod data_capnp {
    include!("generated/data_capnp.rs");
}

pub mod auth;
pub mod binding;
pub mod bundle;
pub mod frame;
pub mod message;
pub mod scope;
pub mod snapshot_stream;
pub mod token;

/// Bumped on any incompatible change of the schemas or the framing; client
/// and server refuse each other in `hello` when it differs.
pub const PROTOCOL_VERSION: u32 = 1;

/// The first bytes a client sends on a new connection say which plane it is.
pub const CONTROL_PREAMBLE: &[u8; 8] = b"RGPUCTL1";
pub const DATA_PREAMBLE: &[u8; 8] = b"RGPUDAT1";
/// A data connection coming back to a session whose connection broke:
/// followed by the session id, its key and the last reply sequence number
/// the client received (u64 LE); the server answers status and version as
/// for an attach, then the last request sequence number it executed (u64
/// LE), then the replies the client missed. Always TCP.
pub const RESUME_PREAMBLE: &[u8; 8] = b"RGPURES1";
/// A server handing a live session to another (docs/migration.md, live
/// migration): the receiver sends a nonce, the sender proves the shared
/// admin key over it, then the session's snapshot follows in chunks. Always TCP.
pub const MIGRATE_PREAMBLE: &[u8; 8] = b"RGPUMIG1";
/// An operator copying a snapshot off or onto a server in one stream
/// ([`snapshot_stream`], docs/migration.md). Always TCP.
pub const SNAPSHOT_PREAMBLE: &[u8; 8] = b"RGPUSNP1";

/// A resume's status when the session moved to another server: the answer's
/// 8 bytes (this status, the version) are followed by the new address
/// (u16 LE length, at most [`MAX_REDIRECT_LEN`] bytes of UTF-8 `host:port`),
/// and the client resumes there. Not a CUresult: a client that does not
/// know it reads it as a refusal.
pub const RESUME_MOVED: u32 = 0x4d4f_5645;
/// A resume's status when the session's lease is suspended (preempted by a
/// higher-priority lease, its state on the server's disk): the answer is
/// these 8 bytes alone; the client waits and tries again, within its
/// `RGPU_SUSPEND_TIMEOUT`, until the broker resumes the lease. Not a
/// CUresult: a client that does not know it reads it as a refusal.
pub const RESUME_SUSPENDED: u32 = 0x5355_5350;
/// A resume's status while the server holds the session: still, for work
/// of its own (a checkpoint being written, a migration's last copy; the
/// answer comes after the server has waited a short while for that work to
/// end), or checkpointed out and not yet restored (the answer comes at
/// once). The answer is these 8 bytes alone; the client tries again,
/// within its `RGPU_HOLD_TIMEOUT`, and its reconnect bounds start again
/// from each such answer. Not a CUresult: a client that does not know it
/// reads it as a refusal.
pub const RESUME_HELD: u32 = 0x484f_4c44;
/// Longest address a redirect may carry.
pub const MAX_REDIRECT_LEN: usize = 255;

/// Length of the data-plane session key handed out by `openSession`.
pub const SESSION_KEY_LEN: usize = 16;
