//! The RDMA verbs transport.
//!
//! Layers, bottom up (design and status: `docs/rdma.md`):
//!
//! * [`verbs`]: the [`Verbs`] trait, the few verbs operations used (register
//!   memory, post send/receive, RDMA WRITE-with-immediate, RDMA READ, poll
//!   and wait on the completion queue), with completion and error statuses.
//! * Two implementations: [`model`], in this process, which the test suite
//!   runs on; and the verbs plugin (`rdma-plugin/`, libibverbs through
//!   `rdma-sys`), a library loaded at run time through [`plugin`], so one
//!   build of the server and the shim runs on hosts with and without
//!   rdma-core.
//! * [`wire`]: the set-up exchange (sent over the TCP data connection) and
//!   the header of every ring message.
//! * [`conn`]: [`RdmaTransport`], the crate's [`crate::Transport`] over
//!   them: receive rings with credits, chunked pipelined bulk by WRITE-with-
//!   immediate or READ, a [registration cache](regcache), the adaptive
//!   [poll-then-sleep policy](poll), error and disconnect handling.

pub mod conn;
pub mod model;
pub mod plugin;
pub mod poll;
pub mod regcache;
pub mod verbs;
pub mod wire;

#[cfg(test)]
mod tests;

pub use conn::{RdmaConfig, RdmaError, RdmaStats, RdmaTransport, ShutdownHandle};
pub use verbs::{Verbs, VerbsError, VerbsProvider};
