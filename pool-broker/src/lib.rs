//! The GPU pool broker: GPU servers register and heartbeat; users lease
//! whole GPUs or fractions of one and get a signed, fenced token; operators
//! drain servers. Layers (neon storage controller shape):
//!
//! - [`inventory`], [`placement`], [`state`]: pure; the state machine and
//!   placement take `now` and return decisions, changes and events;
//! - [`store`]: durability in redb, group-committed by one writer thread;
//! - [`service`]: orchestration: lock the state, apply, persist, answer;
//! - [`rpc`]: the capnp-rpc `Broker` (decode, one service call, encode);
//! - [`client`]: the client library the `rgpu` CLI uses.
pub mod inventory;
pub mod placement;
pub mod state;
