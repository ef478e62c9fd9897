//! The client side of the pool broker's capnp-rpc API
//! (`protocol/schema/broker.capnp`), for everything that talks to a broker
//! without being one: the `rgpu` CLI, GPU servers, the broker's own tests
//! and benchmark. It does not link the broker (no store, no state machine).
//!
//! - [`rpc`]: a capnp-rpc connection over TCP, for any interface
//!   (`connect::<broker::Client>`, `connect::<gpu_server::Client>`): written
//!   once here instead of in every client;
//! - [`BrokerClient`] ([`client`]): the blocking client the CLI uses, and
//!   what it returns ([`LeaseView`], [`ServerView`], [`StatusView`],
//!   [`AuditView`]);
//! - [`credential`]: a tenant's credential, its file, and the login with it;
//! - [`duration`]: durations as people write them (`90s`, `10m`).

pub mod client;
pub mod credential;
pub mod duration;
pub mod rpc;
pub mod views;

pub use client::{BrokerClient, ClientError, Waits};
pub use credential::{Credential, CredentialError};
pub use rgpu_protocol::auth::Role;
pub use rgpu_protocol::scope::Scope;
pub use views::{
    format_lease_id, parse_lease_id, AuditView, GpuHealthView, GpuView, LeaseSpec, LoadView, LeaseView, ServerView, StatusView, UsageRecordView, UsageView,
};

/// Unix time in milliseconds, as the broker's API carries it.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}
