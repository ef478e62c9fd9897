//! What a compute share means to every backend that enforces one: whose
//! device time a kernel counts against, the weight of a whole GPU, and how
//! long an idle group keeps its place. The sim's scheduler
//! (`sim/share.rs`) and the cuda backend's turns (`cuda/share.rs`) apply
//! them to their own unit of work: a block on a host core, a kernel on a GPU.

use std::time::Duration;

/// A whole GPU's share, in thousandths: the weight of sessions without one.
pub const WHOLE: u16 = 1000;

/// How long a group may be idle and keep what the others owe it.
pub const FORGET_AFTER: Duration = Duration::from_millis(100);

/// Whose time a kernel counts against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Who {
    /// Every session of a lease on this server, together.
    Lease(u64),
    /// A session without a lease (no broker), on its own.
    Session(u64),
}
