//! An instantiated graph as the server keeps it: its operations in the order the client's
//! instantiation chose (a topological order of the graph), replayed on a stream by every
//! launch. The same list runs on every backend: each operation is the backend call an
//! ordinary request of its kind makes (`crate::command::graph` does the replay), so a graph
//! means on the sim and on a real GPU exactly what the same stream work means.

use std::ops::Range;

use super::{LaunchDims, MemsetOp};

/// One operation. Handles and pointers are the client's; they are looked up in the session
/// again at every launch, so an object freed after instantiation fails the launch rather
/// than reaching a stale backend token.
#[derive(Debug, Clone)]
pub enum GraphOp {
    /// `params`: its range of [`GraphExec::params`].
    Kernel { module: u64, function: u32, dims: LaunchDims, params: Range<usize> },
    /// The bytes are the next `size` of the launch's bulk.
    HtoD { dst: u64, size: u64 },
    /// The bytes go to the next `size` of the exec's staging area, which the launch's reply
    /// carries back.
    DtoH { src: u64, size: u64 },
    DtoD { dst: u64, src: u64, size: u64 },
    Memset(MemsetOp),
    EventRecord(u64),
    EventWait(u64),
}

#[derive(Debug)]
pub struct GraphExec {
    pub device: u32,
    pub ops: Vec<GraphOp>,
    /// Every kernel node's parameter buffer, copied at instantiation.
    pub params: Vec<u8>,
    /// Bytes each launch's bulk must carry (its host-to-device copies).
    pub htod_len: u64,
    /// Bytes each launch's reply carries (its device-to-host copies).
    pub dtoh_len: u64,
    /// Device memory of `dtoh_len` bytes the device-to-host copies land in, in stream order,
    /// so the reply streams them as any device-to-host copy's.
    pub staging: Option<u64>,
}
