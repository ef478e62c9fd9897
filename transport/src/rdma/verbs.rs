//! The verbs operations the RDMA transport uses, as a trait.
//!
//! One [`Verbs`] value is one connection's endpoint: a protection domain,
//! one completion queue, one reliable-connected queue pair. Two
//! implementations: the in-process model ([`super::model`]) that the test
//! suite runs on, and the real verbs plugin (`rdma-plugin/`, reached through
//! [`super::plugin`]), loaded at run time.
//!
//! The types mirror libibverbs closely enough that the plugin is a thin
//! translation, and no more: only the operations the transport uses.

use std::time::Duration;

use thiserror::Error;

/// Memory access rights of a registration (values as `ibv_access_flags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access(pub u32);

impl Access {
    pub const LOCAL_WRITE: Access = Access(1);
    pub const REMOTE_WRITE: Access = Access(2);
    pub const REMOTE_READ: Access = Access(4);

    pub const fn union(self, o: Access) -> Access {
        Access(self.0 | o.0)
    }
    pub const fn contains(self, o: Access) -> bool {
        self.0 & o.0 == o.0
    }
}

/// A registered memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryRegion {
    pub addr: u64,
    pub len: usize,
    pub lkey: u32,
    pub rkey: u32,
    /// Opaque to the transport; the implementation's own handle.
    pub handle: u64,
}

impl MemoryRegion {
    pub fn contains(&self, addr: u64, len: usize) -> bool {
        addr >= self.addr && addr.saturating_add(len as u64) <= self.addr + self.len as u64
    }
    pub fn sge(&self, addr: u64, len: u32) -> Sge {
        Sge { addr, len, lkey: self.lkey }
    }
}

/// A scatter/gather element: local memory inside a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// A send-queue work request. Every one is signalled (completes with a
/// [`Completion`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkRequest {
    /// Two-sided: consumes a receive the peer posted.
    Send { local: Sge },
    /// One-sided write into the peer's memory; the immediate value also
    /// consumes one of the peer's posted receives, which completes with it.
    WriteImm { local: Sge, remote_addr: u64, rkey: u32, imm: u32 },
    /// One-sided read of the peer's memory into `local`.
    Read { local: Sge, remote_addr: u64, rkey: u32 },
}

/// What a completion completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcOpcode {
    Send,
    Write,
    Read,
    /// A posted receive took a SEND.
    Recv,
    /// A posted receive took the immediate of a WRITE-with-immediate.
    RecvImm,
}

/// Completion status (the `ibv_wc_status` values the transport tells apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    Success,
    /// A local buffer was not inside a registration with the needed rights.
    LocalProtection,
    /// A message was longer than the receive buffer.
    LocalLength,
    /// The peer refused an RDMA access: bad rkey, bounds or rights.
    RemoteAccess,
    /// The peer saw an invalid request.
    RemoteInvalidRequest,
    /// The peer did not answer (gone, or the fabric path is down).
    RetryExceeded,
    /// The peer had no receive posted, for longer than the retry budget.
    RnrRetryExceeded,
    /// The queue pair went to the error state; outstanding requests flushed.
    Flushed,
    /// Anything else, with the provider's code.
    Other(u32),
}

impl WcStatus {
    pub fn is_ok(self) -> bool {
        self == WcStatus::Success
    }
}

/// One completion-queue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    pub byte_len: u32,
    pub imm: Option<u32>,
}

impl Completion {
    pub const EMPTY: Completion =
        Completion { wr_id: 0, status: WcStatus::Success, opcode: WcOpcode::Send, byte_len: 0, imm: None };
}

/// What the peer needs to connect its queue pair to ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointInfo {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
    /// Path MTU in bytes (256..4096).
    pub mtu: u32,
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum VerbsError {
    #[error("no RDMA device found")]
    NoDevice,
    #[error("RDMA library not available: {0}")]
    NotAvailable(String),
    #[error("{op} failed: {msg}")]
    Op { op: &'static str, msg: String },
    #[error("invalid argument to {op}: {msg}")]
    Invalid { op: &'static str, msg: String },
    #[error("queue pair is in the error state")]
    QpError,
    #[error("P_Key {pkey:#06x} is not in the P_Key table of port {port}")]
    NoPkey { pkey: u16, port: u8 },
}

impl VerbsError {
    pub fn op(op: &'static str, msg: impl Into<String>) -> VerbsError {
        VerbsError::Op { op, msg: msg.into() }
    }
}

/// One RC endpoint's verbs.
///
/// Posting never blocks. Completions are collected with [`Verbs::poll_cq`];
/// to sleep until the next one, call [`Verbs::arm_cq`], poll once more (a
/// completion may have arrived before arming), then [`Verbs::wait_cq`].
pub trait Verbs: Send {
    /// Our side of the connection, to send to the peer.
    fn local_info(&self) -> EndpointInfo;

    /// The index of the partition key `pkey` in this endpoint's port's
    /// P_Key table ([`find_pkey_index`] over the table); a key the port
    /// does not have is [`VerbsError::NoPkey`].
    fn pkey_index(&self, pkey: u16) -> Result<u16, VerbsError>;

    /// Puts the queue pair (still in INIT, before [`Verbs::connect`]) in the
    /// partition at `index` of the port's P_Key table. Without a call it
    /// uses index 0, the port's default partition.
    fn set_pkey_index(&mut self, index: u16) -> Result<(), VerbsError>;

    /// Moves the queue pair to ready-to-send against `remote`.
    fn connect(&mut self, remote: &EndpointInfo) -> Result<(), VerbsError>;

    /// Registers `len` bytes at `addr`.
    ///
    /// # Safety
    /// The memory must stay allocated until [`Verbs::dereg_mr`] returns (or
    /// the endpoint is dropped); with remote rights, the peer may write or
    /// read it at any time until then.
    unsafe fn reg_mr(&mut self, addr: *mut u8, len: usize, access: Access) -> Result<MemoryRegion, VerbsError>;

    fn dereg_mr(&mut self, mr: &MemoryRegion) -> Result<(), VerbsError>;

    fn post_recv(&mut self, wr_id: u64, local: Sge) -> Result<(), VerbsError>;

    fn post_send(&mut self, wr_id: u64, wr: &WorkRequest) -> Result<(), VerbsError>;

    /// Fills `out` from the front with ready completions; returns how many.
    fn poll_cq(&mut self, out: &mut [Completion]) -> Result<usize, VerbsError>;

    /// Requests an event for the next completion.
    fn arm_cq(&mut self) -> Result<(), VerbsError>;

    /// Sleeps until an armed completion event arrives (true) or `timeout`
    /// passes (false).
    fn wait_cq(&mut self, timeout: Duration) -> Result<bool, VerbsError>;

    /// Moves the queue pair to the error state: outstanding work completes
    /// as flushed and the peer's next operation fails. Idempotent.
    fn disconnect(&mut self);
}

/// The low 15 bits of a P_Key: the partition. The top bit is membership
/// (1: full, 0: limited).
pub const PKEY_PARTITION: u16 = 0x7fff;

/// Whether `pkey` names a partition (0x0000 and 0x8000 are invalid keys).
pub fn pkey_is_valid(pkey: u16) -> bool {
    pkey & PKEY_PARTITION != 0
}

/// The index in a port's P_Key `table` (host byte order) to use for
/// `pkey`: an entry of the same partition, an exact match (membership
/// included) first, else the first of that partition. None: the port is not
/// in that partition, or `pkey` is invalid.
pub fn find_pkey_index(table: &[u16], pkey: u16) -> Option<u16> {
    if !pkey_is_valid(pkey) {
        return None;
    }
    let same = |k: &u16| k & PKEY_PARTITION == pkey & PKEY_PARTITION;
    let at = table.iter().position(|&k| k == pkey).or_else(|| table.iter().position(same))?;
    u16::try_from(at).ok()
}

/// Opens endpoints: one per connection.
pub trait VerbsProvider: Send + Sync {
    /// A short description for logs ("mlx5_0 port 1", "model").
    fn describe(&self) -> String;
    fn open(&self) -> Result<Box<dyn Verbs>, VerbsError>;
}
