//! [`RdmaTransport`]: the byte stream of [`crate::Transport`] over verbs.
//!
//! ## Small messages: SEND into pre-posted receive slots, with credits
//!
//! Each end registers a ring of receive slots and keeps a receive posted on
//! every one. Bytes up to a slot's payload travel as one SEND from a
//! registered send slot. A sender may only SEND while it holds a *credit*
//! for the peer's ring (one per slot the peer has posted and not yet
//! reported back): without them a SEND could find no receive and the queue
//! pair would fail with RNR. Credits come back in the header of every
//! message the peer sends; a peer with nothing to say sends a CREDIT-only
//! message when it owes half the ring, or before it sleeps whenever it owes
//! anything. Data messages leave one credit in reserve, so a CREDIT-only
//! message can always go; since every CREDIT message returns at least one
//! credit, the two ends can never both sit at zero.
//!
//! ## Bulk: chunked and pipelined
//!
//! Pieces of a send of at least `bulk_min` bytes go by RDMA:
//!
//! * default: copied chunk by chunk into the sender's registered staging
//!   ring and RDMA-WRITTEN with an immediate value (the chunk's index) into
//!   the receiver's staging ring, whose address and rkey the set-up exchange
//!   gave. Chunk credits (one per receiver chunk) bound what is in flight;
//!   copying chunk *i+1* overlaps the NIC's transfer of chunk *i*, and
//!   `send` returns as soon as the last chunk is posted.
//! * zero-copy (`zero_copy`, for callers whose buffers stay mapped): the
//!   sender registers its buffer through the [registration
//!   cache](super::regcache) and SENDs a READ request; the receiver RDMA
//!   READs it, `read_depth` chunks in flight, straight into the memory
//!   `recv_exact` was given, and answers READ-DONE, on which `send` returns.
//!
//! While a sender waits for credits or a READ-DONE, it moves what has
//! arrived for it out of the rings into memory of its own (up to
//! `overflow_max`), returning those credits: two ends that send at the same
//! time do not deadlock, as they could if each waited for the other to read.
//!
//! ## Completions, errors, disconnects
//!
//! One completion queue per connection, polled under the adaptive policy of
//! [`super::poll`]. Any completion with an error status breaks the
//! connection: every later call fails with the reason, nothing panics. The
//! TCP connection the set-up went over stays open as a side channel: a peer
//! whose process ends closes it, which wakes a sleeping waiter within
//! [`WAIT_SLICE`]; [`Transport::shutdown`] closes it and wakes ours.

use std::collections::VecDeque;
use std::io;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tracing::debug;

use super::poll::{PollConfig, PollPolicy};
use super::regcache::{CacheStats, RegCache};
use super::verbs::*;
use super::wire::{self, ConnInfo, Header, Kind, ReadReq, WireError, HEADER_LEN, READ_REQ_LEN};
use crate::Transport;

/// How long one sleep on the completion queue lasts before the side channel
/// and the shutdown flag are checked again.
pub const WAIT_SLICE: Duration = Duration::from_millis(50);

const TAG_RECV: u64 = 1;
const TAG_SEND: u64 = 2;
const TAG_WRITE: u64 = 3;
const TAG_READ: u64 = 4;

fn wr_id(tag: u64, idx: u32) -> u64 {
    (tag << 56) | idx as u64
}

/// Transport settings. Both ends choose their own; each learns the other's
/// ring geometry in the set-up exchange.
#[derive(Debug, Clone, Copy)]
pub struct RdmaConfig {
    /// Receive slots (and the peer's initial credits). At least 4.
    pub recv_slots: u16,
    /// Bytes per receive slot, header included.
    pub slot_size: u32,
    /// Staging chunks for incoming RDMA WRITEs.
    pub chunks: u16,
    pub chunk_size: u32,
    /// Pieces of a send at least this long go by RDMA WRITE/READ.
    pub bulk_min: usize,
    /// Let the peer READ our send buffers in place (see module docs).
    pub zero_copy: bool,
    /// Bytes per RDMA READ, and how many are in flight at once.
    pub read_chunk: u32,
    pub read_depth: u32,
    /// Byte budget of the registration cache.
    pub cache_bytes: usize,
    /// Most bytes moved out of the rings while a send waits.
    pub overflow_max: usize,
    pub poll: PollConfig,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            recv_slots: 64,
            slot_size: 8 << 10,
            chunks: 8,
            chunk_size: 512 << 10,
            bulk_min: 32 << 10,
            zero_copy: false,
            read_chunk: 1 << 20,
            read_depth: 4,
            cache_bytes: 1 << 30,
            overflow_max: 64 << 20,
            poll: PollConfig::default(),
        }
    }
}

impl RdmaConfig {
    /// Fewest and most receive-ring slots [`RdmaConfig::with_knobs`] takes.
    pub const RING_SLOTS: std::ops::RangeInclusive<u16> = 4..=4096;

    /// The defaults with the knobs a deployment sets (server flags, shim
    /// environment): zero-copy bulk sends, and the receive-ring size.
    pub fn with_knobs(zero_copy: bool, ring_slots: Option<u16>) -> Result<RdmaConfig, String> {
        let mut c = RdmaConfig { zero_copy, ..RdmaConfig::default() };
        if let Some(n) = ring_slots {
            if !Self::RING_SLOTS.contains(&n) {
                return Err(format!(
                    "RDMA ring slots {n} outside {}..={}",
                    Self::RING_SLOTS.start(),
                    Self::RING_SLOTS.end()
                ));
            }
            c.recv_slots = n;
        }
        Ok(c)
    }
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum RdmaError {
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    #[error("RDMA {op} completed with {status:?}")]
    Completion { op: &'static str, status: WcStatus },
    #[error("RDMA protocol error: {0}")]
    Protocol(String),
    #[error("RDMA peer {0} disconnected")]
    Disconnected(String),
    #[error("RDMA connection was shut down")]
    Shutdown,
    #[error("RDMA set-up: {0}")]
    Setup(String),
}

impl From<WireError> for RdmaError {
    fn from(e: WireError) -> Self {
        RdmaError::Protocol(e.to_string())
    }
}

impl From<RdmaError> for io::Error {
    fn from(e: RdmaError) -> io::Error {
        let kind = match &e {
            RdmaError::Disconnected(_) => io::ErrorKind::UnexpectedEof,
            RdmaError::Shutdown => io::ErrorKind::NotConnected,
            RdmaError::Completion { status: WcStatus::RetryExceeded | WcStatus::Flushed, .. } => {
                io::ErrorKind::ConnectionReset
            }
            _ => io::ErrorKind::Other,
        };
        io::Error::new(kind, e)
    }
}

/// Counters, for tests, logs and the benchmark.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RdmaStats {
    pub msgs_sent: u64,
    pub credit_msgs: u64,
    pub chunks_written: u64,
    pub reads_served: u64,
    pub read_requests: u64,
    pub credit_waits: u64,
    pub absorbed_bytes: u64,
    pub cache: CacheStats,
    pub spin_hits: u64,
    pub sleeps: u64,
}

/// Received bytes waiting for `recv_exact`, in stream order.
enum Seg {
    /// In receive slot `idx`; the slot is reposted once consumed.
    Slot { idx: u32, pos: usize, end: usize },
    /// In staging chunk `idx`; its credit goes back once consumed.
    Chunk { idx: u32, pos: usize, end: usize },
    /// Moved out of the rings while we were sending.
    Owned { data: Vec<u8>, pos: usize },
    /// The peer's buffer, to be READ; `pos` bytes already read.
    Pull { req: ReadReq, pos: u64 },
}

/// A registered buffer the transport owns.
struct Region {
    buf: Box<[u8]>,
    mr: Option<MemoryRegion>,
}

impl Region {
    fn new(verbs: &mut dyn Verbs, len: usize, access: Access) -> Result<Region, RdmaError> {
        let mut buf = vec![0u8; len.max(1)].into_boxed_slice();
        // SAFETY: the box is kept in this Region, which deregisters before
        // dropping it (RdmaTransport::drop).
        let mr = unsafe { verbs.reg_mr(buf.as_mut_ptr(), buf.len(), access) }?;
        Ok(Region { buf, mr: Some(mr) })
    }
    fn empty() -> Region {
        Region { buf: Box::new([]), mr: None }
    }
    fn addr(&self, off: usize) -> u64 {
        self.buf.as_ptr() as u64 + off as u64
    }
    fn sge(&self, off: usize, len: usize) -> Sge {
        Sge { addr: self.addr(off), len: len as u32, lkey: self.mr.map(|m| m.lkey).unwrap_or(0) }
    }
    fn release(&mut self, verbs: &mut dyn Verbs) {
        if let Some(mr) = self.mr.take() {
            let _ = verbs.dereg_mr(&mr);
        }
    }
}

/// A byte stream over one RC queue pair. See the module documentation.
pub struct RdmaTransport {
    verbs: Box<dyn Verbs>,
    cfg: RdmaConfig,
    peer: String,
    side: Option<TcpStream>,
    shut: Arc<AtomicBool>,
    remote: Option<ConnInfo>,

    recv: Region,
    staging_in: Region,
    send: Region,
    staging_out: Region,
    send_slot_size: usize,

    slot_credits: u32,
    chunk_credits: u32,
    owed_slots: u32,
    owed_chunks: u32,
    free_send: Vec<u32>,
    out_chunks: u32,
    out_free: u32,
    out_next: u64,
    remote_next: u64,

    segs: VecDeque<Seg>,
    overflow: usize,
    reads_outstanding: u32,
    read_done: Vec<u32>,
    next_read_id: u32,
    cache: RegCache,
    policy: PollPolicy,
    broken: Option<RdmaError>,
    /// Our partition key (0: none), as sent in [`ConnInfo::pkey`].
    pkey: u16,
    peer_closed: bool,
    stats: RdmaStats,
}

impl RdmaTransport {
    /// Registers this end's rings on `verbs` and posts every receive; the
    /// result's [`RdmaTransport::local_info`] goes to the peer, whose answer
    /// goes to [`RdmaTransport::connect`].
    pub fn prepare(verbs: Box<dyn Verbs>, cfg: RdmaConfig) -> Result<RdmaTransport, RdmaError> {
        RdmaTransport::prepare_in(verbs, cfg, None)
    }

    /// [`RdmaTransport::prepare`] with the queue pair in partition `pkey`
    /// (the session's lease's P_Key; None: the port's default partition).
    /// A key the port does not have is [`VerbsError::NoPkey`].
    pub fn prepare_in(mut verbs: Box<dyn Verbs>, cfg: RdmaConfig, pkey: Option<u16>) -> Result<RdmaTransport, RdmaError> {
        if let Some(k) = pkey {
            let index = verbs.pkey_index(k)?;
            verbs.set_pkey_index(index)?;
        }
        let v = &mut *verbs;
        let recv = Region::new(v, cfg.recv_slots as usize * cfg.slot_size as usize, Access::LOCAL_WRITE)?;
        let staging_in = Region::new(
            v,
            cfg.chunks as usize * cfg.chunk_size as usize,
            Access::LOCAL_WRITE.union(Access::REMOTE_WRITE),
        )?;
        let mut t = RdmaTransport {
            verbs,
            cfg,
            pkey: pkey.unwrap_or(0),
            peer: String::new(),
            side: None,
            shut: Arc::new(AtomicBool::new(false)),
            remote: None,
            recv,
            staging_in,
            send: Region::empty(),
            staging_out: Region::empty(),
            send_slot_size: 0,
            slot_credits: 0,
            chunk_credits: 0,
            owed_slots: 0,
            owed_chunks: 0,
            free_send: Vec::new(),
            out_chunks: 0,
            out_free: 0,
            out_next: 0,
            remote_next: 0,
            segs: VecDeque::new(),
            overflow: 0,
            reads_outstanding: 0,
            read_done: Vec::new(),
            next_read_id: 1,
            cache: RegCache::new(cfg.cache_bytes),
            policy: PollPolicy::new(cfg.poll),
            broken: None,
            peer_closed: false,
            stats: RdmaStats::default(),
        };
        let info = t.local_info();
        info.validate().map_err(|e| RdmaError::Setup(format!("our own settings: {e}")))?;
        for i in 0..cfg.recv_slots as u32 {
            t.repost(i)?;
        }
        Ok(t)
    }

    /// What the peer needs to connect to us.
    pub fn local_info(&self) -> ConnInfo {
        ConnInfo {
            ep: self.verbs.local_info(),
            recv_slots: self.cfg.recv_slots,
            slot_size: self.cfg.slot_size,
            chunks: self.cfg.chunks,
            chunk_size: self.cfg.chunk_size,
            staging_addr: self.staging_in.addr(0),
            staging_rkey: self.staging_in.mr.map(|m| m.rkey).unwrap_or(0),
            flags: if self.cfg.zero_copy { ConnInfo::ZERO_COPY } else { 0 },
            pkey: self.pkey,
        }
    }

    /// Connects the queue pair to the peer described by `remote` and sizes
    /// the send side by its rings.
    pub fn connect(&mut self, remote: ConnInfo, peer: String) -> Result<(), RdmaError> {
        remote.validate()?;
        if remote.pkey != self.pkey {
            return Err(RdmaError::Setup(pkey_mismatch(self.pkey, remote.pkey)));
        }
        if self.remote.is_some() {
            return Err(RdmaError::Setup("already connected".into()));
        }
        self.verbs.connect(&remote.ep)?;
        let v = &mut *self.verbs;
        let send_slots = remote.recv_slots.min(256) as u32;
        self.send_slot_size = remote.slot_size as usize;
        self.send = Region::new(v, send_slots as usize * self.send_slot_size, Access(0))?;
        self.out_chunks = (remote.chunks as u32).min(self.cfg.chunks.max(1) as u32);
        self.staging_out = Region::new(v, self.out_chunks as usize * remote.chunk_size as usize, Access(0))?;
        self.out_free = self.out_chunks;
        self.free_send = (0..send_slots).rev().collect();
        self.slot_credits = remote.recv_slots as u32;
        self.chunk_credits = remote.chunks as u32;
        self.peer = peer;
        self.remote = Some(remote);
        Ok(())
    }

    /// Keeps `side`, the TCP connection the set-up went over, as the
    /// liveness channel: the peer closing it is a disconnect, and shutting
    /// this transport down closes it.
    pub fn attach_side(&mut self, side: TcpStream) -> Result<(), RdmaError> {
        // Only ever peeked at, never read.
        side.set_nonblocking(true).map_err(|e| RdmaError::Setup(format!("side channel: {e}")))?;
        self.side = Some(side);
        Ok(())
    }

    pub fn stats(&self) -> RdmaStats {
        RdmaStats {
            cache: self.cache.stats,
            spin_hits: self.policy.spin_hits,
            sleeps: self.policy.sleeps,
            ..self.stats
        }
    }

    /// Received bytes ready to be read without waiting.
    pub fn buffered(&self) -> usize {
        self.segs
            .iter()
            .map(|s| match s {
                Seg::Slot { pos, end, .. } | Seg::Chunk { pos, end, .. } => end - pos,
                Seg::Owned { data, pos } => data.len() - pos,
                Seg::Pull { req, pos } => (req.len - pos) as usize,
            })
            .sum()
    }

    /// A handle that shuts this connection down from another thread.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle { shut: self.shut.clone(), side: self.side.as_ref().and_then(|s| s.try_clone().ok()) }
    }

    /// Forgets cached registrations overlapping a range the caller released.
    pub fn invalidate(&mut self, addr: *const u8, len: usize) {
        self.cache.invalidate(&mut *self.verbs, addr, len);
    }

    fn remote(&self) -> Result<ConnInfo, RdmaError> {
        self.remote.ok_or_else(|| RdmaError::Setup("not connected".into()))
    }

    fn check(&self) -> Result<(), RdmaError> {
        if self.shut.load(Ordering::Acquire) {
            return Err(RdmaError::Shutdown);
        }
        match &self.broken {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn fail(&mut self, e: RdmaError) -> RdmaError {
        if self.broken.is_none() {
            debug!(peer = %self.peer, "RDMA connection broken: {e}");
            self.broken = Some(e.clone());
            self.verbs.disconnect();
        }
        self.broken.clone().unwrap_or(e)
    }

    fn repost(&mut self, idx: u32) -> Result<(), RdmaError> {
        let ss = self.cfg.slot_size as usize;
        let sge = self.recv.sge(idx as usize * ss, ss);
        self.verbs.post_recv(wr_id(TAG_RECV, idx), sge).map_err(RdmaError::from)
    }

    // ---- completions -------------------------------------------------

    /// Polls once and handles what it finds; returns how many.
    fn poll_once(&mut self) -> Result<usize, RdmaError> {
        let mut wc = [Completion::EMPTY; 16];
        let n = match self.verbs.poll_cq(&mut wc) {
            Ok(n) => n,
            Err(e) => return Err(self.fail(e.into())),
        };
        for c in &wc[..n] {
            if let Err(e) = self.on_completion(c) {
                return Err(self.fail(e));
            }
        }
        Ok(n)
    }

    fn on_completion(&mut self, c: &Completion) -> Result<(), RdmaError> {
        let tag = c.wr_id >> 56;
        let idx = (c.wr_id & 0xffff_ffff) as u32;
        if !c.status.is_ok() {
            let op = match tag {
                TAG_RECV => "receive",
                TAG_SEND => "send",
                TAG_WRITE => "write",
                _ => "read",
            };
            return Err(match c.status {
                WcStatus::Flushed | WcStatus::RetryExceeded if self.peer_closed || tag == TAG_RECV => {
                    RdmaError::Disconnected(self.peer.clone())
                }
                status => RdmaError::Completion { op, status },
            });
        }
        match tag {
            TAG_RECV => self.on_recv(idx, c),
            TAG_SEND => {
                self.free_send.push(idx);
                Ok(())
            }
            TAG_WRITE => {
                self.out_free += 1;
                Ok(())
            }
            TAG_READ => {
                self.reads_outstanding = self.reads_outstanding.saturating_sub(1);
                Ok(())
            }
            _ => Err(RdmaError::Protocol(format!("completion with unknown id {:#x}", c.wr_id))),
        }
    }

    fn on_recv(&mut self, idx: u32, c: &Completion) -> Result<(), RdmaError> {
        if idx >= self.cfg.recv_slots as u32 {
            return Err(RdmaError::Protocol(format!("receive completion for slot {idx}")));
        }
        if c.opcode == WcOpcode::RecvImm {
            let chunk = c.imm.unwrap_or(u32::MAX);
            if chunk >= self.cfg.chunks as u32 || c.byte_len > self.cfg.chunk_size {
                return Err(RdmaError::Protocol(format!("write into chunk {chunk} of {} bytes", c.byte_len)));
            }
            if c.byte_len > 0 {
                self.segs.push_back(Seg::Chunk { idx: chunk, pos: 0, end: c.byte_len as usize });
            } else {
                self.owed_chunks += 1;
            }
            // The slot's memory was not used: repost at once.
            self.repost(idx)?;
            self.owed_slots += 1;
            return Ok(());
        }
        let ss = self.cfg.slot_size as usize;
        let base = idx as usize * ss;
        let got = (c.byte_len as usize).min(ss);
        let h = Header::decode(&self.recv.buf[base..base + got])?;
        if HEADER_LEN + h.len as usize > got {
            return Err(RdmaError::Protocol(format!("message claims {} bytes, {} arrived", h.len, got)));
        }
        self.slot_credits += h.slot_returns as u32;
        self.chunk_credits += h.chunk_returns as u32;
        let body = base + HEADER_LEN..base + HEADER_LEN + h.len as usize;
        match h.kind {
            Kind::Data if !body.is_empty() => {
                self.segs.push_back(Seg::Slot { idx, pos: body.start, end: body.end });
                return Ok(());
            }
            Kind::Data | Kind::Credit => {}
            Kind::ReadReq => {
                let req = ReadReq::decode(&self.recv.buf[body])?;
                if req.len > 0 {
                    self.segs.push_back(Seg::Pull { req, pos: 0 });
                }
            }
            Kind::ReadDone => self.read_done.push(h.aux),
            Kind::Bye => self.peer_closed = true,
        }
        self.repost(idx)?;
        self.owed_slots += 1;
        Ok(())
    }

    // ---- waiting -----------------------------------------------------

    /// Makes progress: handles completions, sleeping for them if there are
    /// none. With `absorb`, first moves received bytes out of the rings so
    /// their credits can go back (a sender waiting for the peer).
    fn progress(&mut self, absorb: bool) -> Result<(), RdmaError> {
        self.check()?;
        if self.poll_once()? > 0 {
            return Ok(());
        }
        if absorb {
            self.absorb()?;
        }
        self.return_credits(true)?;
        for _ in 0..self.policy.budget() {
            if self.poll_once()? > 0 {
                self.policy.hit();
                return Ok(());
            }
            std::hint::spin_loop();
        }
        self.verbs.arm_cq().map_err(|e| self.fail(e.into()))?;
        if self.poll_once()? > 0 {
            self.policy.hit();
            return Ok(());
        }
        loop {
            match self.verbs.wait_cq(WAIT_SLICE) {
                Ok(true) => {
                    self.policy.slept();
                    self.poll_once()?;
                    return Ok(());
                }
                Ok(false) => {
                    self.check()?;
                    if self.side_closed() {
                        // Whatever the peer sent before it went is in the
                        // queue already or arrives with this poll.
                        if self.poll_once()? > 0 {
                            return Ok(());
                        }
                        self.peer_closed = true;
                        return Err(self.fail(RdmaError::Disconnected(self.peer.clone())));
                    }
                }
                Err(e) => return Err(self.fail(e.into())),
            }
        }
    }

    fn side_closed(&self) -> bool {
        let Some(s) = &self.side else { return false };
        let mut b = [0u8; 1];
        match s.peek(&mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => false,
            Err(_) => true,
        }
    }

    /// Sends a CREDIT message when we owe enough (or, `before_sleep`,
    /// anything) and can.
    fn return_credits(&mut self, before_sleep: bool) -> Result<(), RdmaError> {
        let half = self.cfg.recv_slots as u32 / 2;
        let chunk_min = if before_sleep { 1 } else { (self.cfg.chunks as u32 / 2).max(1) };
        if self.owed_slots < half && self.owed_chunks < chunk_min {
            return Ok(());
        }
        if self.remote.is_none() || self.slot_credits < 1 || self.free_send.is_empty() {
            return Ok(());
        }
        let slot = self.free_send.pop().unwrap_or(0);
        self.stats.credit_msgs += 1;
        self.post_msg(slot, Kind::Credit, 0, 0)
    }

    /// Moves everything queued out of the rings (stream order kept), so its
    /// slots and chunks go back to the peer.
    fn absorb(&mut self) -> Result<(), RdmaError> {
        let n = self.segs.len();
        for i in 0..n {
            if self.overflow >= self.cfg.overflow_max {
                break;
            }
            let owned = match &self.segs[i] {
                Seg::Owned { .. } => continue,
                Seg::Slot { idx, pos, end } => {
                    let (idx, data) = (*idx, self.recv.buf[*pos..*end].to_vec());
                    self.repost(idx)?;
                    self.owed_slots += 1;
                    data
                }
                Seg::Chunk { idx, pos, end } => {
                    let base = *idx as usize * self.cfg.chunk_size as usize;
                    let data = self.staging_in.buf[base + pos..base + end].to_vec();
                    self.owed_chunks += 1;
                    data
                }
                Seg::Pull { req, pos } => {
                    let (req, pos) = (*req, *pos);
                    let mut data = vec![0u8; (req.len - pos) as usize];
                    self.pull(req, pos, &mut data)?;
                    self.send_ctl(Kind::ReadDone, req.id)?;
                    data
                }
            };
            self.overflow += owned.len();
            self.stats.absorbed_bytes += owned.len() as u64;
            self.segs[i] = Seg::Owned { data: owned, pos: 0 };
        }
        Ok(())
    }

    // ---- sending -----------------------------------------------------

    /// A free send slot with at least `need` credits, waiting for both.
    fn acquire(&mut self, need: u32, absorb: bool) -> Result<u32, RdmaError> {
        let mut waited = false;
        loop {
            self.check()?;
            if self.slot_credits >= need {
                if let Some(s) = self.free_send.pop() {
                    return Ok(s);
                }
            }
            if !waited {
                self.stats.credit_waits += 1;
                waited = true;
            }
            self.progress(absorb)?;
        }
    }

    /// Posts the message already in send slot `slot`'s payload.
    fn post_msg(&mut self, slot: u32, kind: Kind, len: usize, aux: u32) -> Result<(), RdmaError> {
        let h = Header {
            kind,
            slot_returns: self.owed_slots.min(u16::MAX as u32) as u16,
            chunk_returns: self.owed_chunks.min(u16::MAX as u32) as u16,
            len: len as u32,
            aux,
        };
        let base = slot as usize * self.send_slot_size;
        h.encode(&mut self.send.buf[base..base + HEADER_LEN]);
        let wr = WorkRequest::Send { local: self.send.sge(base, HEADER_LEN + len) };
        if let Err(e) = self.verbs.post_send(wr_id(TAG_SEND, slot), &wr) {
            self.free_send.push(slot);
            return Err(self.fail(e.into()));
        }
        self.owed_slots -= h.slot_returns as u32;
        self.owed_chunks -= h.chunk_returns as u32;
        self.slot_credits -= 1;
        self.stats.msgs_sent += 1;
        Ok(())
    }

    /// A header-only message other than CREDIT (READ-DONE, BYE).
    fn send_ctl(&mut self, kind: Kind, aux: u32) -> Result<(), RdmaError> {
        let slot = self.acquire(2, false)?;
        self.post_msg(slot, kind, 0, aux)
    }

    fn send_small(&mut self, mut b: &[u8], open: &mut Option<(u32, usize)>) -> Result<(), RdmaError> {
        let room = self.send_slot_size - HEADER_LEN;
        while !b.is_empty() {
            let (slot, fill) = match *open {
                Some(o) => o,
                None => (self.acquire(2, true)?, 0),
            };
            let n = (room - fill).min(b.len());
            let at = slot as usize * self.send_slot_size + HEADER_LEN + fill;
            self.send.buf[at..at + n].copy_from_slice(&b[..n]);
            b = &b[n..];
            if fill + n == room {
                *open = None;
                self.post_msg(slot, Kind::Data, room, 0)?;
            } else {
                *open = Some((slot, fill + n));
            }
        }
        Ok(())
    }

    fn flush_open(&mut self, open: &mut Option<(u32, usize)>) -> Result<(), RdmaError> {
        match open.take() {
            Some((slot, fill)) => self.post_msg(slot, Kind::Data, fill, 0),
            None => Ok(()),
        }
    }

    /// Bulk by WRITE-with-immediate through both staging rings.
    fn send_by_write(&mut self, mut b: &[u8]) -> Result<(), RdmaError> {
        let remote = self.remote()?;
        let cs = remote.chunk_size as usize;
        while !b.is_empty() {
            let mut waited = false;
            while !(self.out_free > 0 && self.chunk_credits > 0 && self.slot_credits >= 2) {
                if !waited {
                    self.stats.credit_waits += 1;
                    waited = true;
                }
                self.progress(true)?;
            }
            let n = cs.min(b.len());
            let li = (self.out_next % self.out_chunks as u64) as usize;
            let ri = (self.remote_next % remote.chunks as u64) as u32;
            self.staging_out.buf[li * cs..li * cs + n].copy_from_slice(&b[..n]);
            let wr = WorkRequest::WriteImm {
                local: self.staging_out.sge(li * cs, n),
                remote_addr: remote.staging_addr + ri as u64 * cs as u64,
                rkey: remote.staging_rkey,
                imm: ri,
            };
            if let Err(e) = self.verbs.post_send(wr_id(TAG_WRITE, li as u32), &wr) {
                return Err(self.fail(e.into()));
            }
            self.out_free -= 1;
            self.out_next += 1;
            self.remote_next += 1;
            self.chunk_credits -= 1;
            self.slot_credits -= 1;
            self.stats.chunks_written += 1;
            b = &b[n..];
        }
        Ok(())
    }

    /// Bulk by the peer's RDMA READ of `b` in place.
    fn send_by_read(&mut self, b: &[u8]) -> Result<(), RdmaError> {
        // SAFETY: zero-copy mode is for callers whose buffers stay mapped
        // (see regcache); the peer only reads `b` before READ-DONE, which we
        // wait for below while `b` is borrowed.
        let mr = unsafe { self.cache.get(&mut *self.verbs, b.as_ptr(), b.len(), Access::REMOTE_READ) }
            .map_err(|e| self.fail(e.into()))?;
        let id = self.next_read_id;
        self.next_read_id = self.next_read_id.wrapping_add(1).max(1);
        let req = ReadReq { id, rkey: mr.rkey, addr: b.as_ptr() as u64, len: b.len() as u64 };
        let slot = self.acquire(2, true)?;
        let at = slot as usize * self.send_slot_size + HEADER_LEN;
        req.encode(&mut self.send.buf[at..at + READ_REQ_LEN]);
        self.post_msg(slot, Kind::ReadReq, READ_REQ_LEN, 0)?;
        self.stats.read_requests += 1;
        loop {
            if let Some(i) = self.read_done.iter().position(|&d| d == id) {
                self.read_done.swap_remove(i);
                return Ok(());
            }
            self.progress(true)?;
        }
    }

    // ---- receiving ---------------------------------------------------

    /// READs `dst.len()` bytes of the peer's buffer from offset `pos`.
    fn pull(&mut self, req: ReadReq, pos: u64, dst: &mut [u8]) -> Result<(), RdmaError> {
        if pos + dst.len() as u64 > req.len {
            return Err(self.fail(RdmaError::Protocol("read beyond the advertised buffer".into())));
        }
        let cached = self.cfg.zero_copy;
        // SAFETY: `dst` is exclusively borrowed for the whole call and every
        // READ into it completes (or the connection breaks, which stops the
        // NIC) before we return. Without zero-copy the registration is
        // dropped at the end of the call.
        let mr = if cached {
            unsafe { self.cache.get(&mut *self.verbs, dst.as_ptr(), dst.len(), Access::LOCAL_WRITE) }
        } else {
            unsafe { self.verbs.reg_mr(dst.as_mut_ptr(), dst.len(), Access::LOCAL_WRITE) }
        }
        .map_err(|e| self.fail(e.into()))?;
        let r = self.pull_with(req, pos, dst, &mr);
        if !cached {
            let _ = self.verbs.dereg_mr(&mr);
        }
        r
    }

    fn pull_with(&mut self, req: ReadReq, pos: u64, dst: &mut [u8], mr: &MemoryRegion) -> Result<(), RdmaError> {
        let step = self.cfg.read_chunk.max(4096) as usize;
        let depth = self.cfg.read_depth.max(1);
        let base = dst.as_mut_ptr() as u64;
        let mut off = 0usize;
        let mut k = 0u32;
        while off < dst.len() || self.reads_outstanding > 0 {
            if off < dst.len() && self.reads_outstanding < depth {
                let n = step.min(dst.len() - off);
                let wr = WorkRequest::Read {
                    local: mr.sge(base + off as u64, n as u32),
                    remote_addr: req.addr.wrapping_add(pos + off as u64),
                    rkey: req.rkey,
                };
                if let Err(e) = self.verbs.post_send(wr_id(TAG_READ, k), &wr) {
                    return Err(self.fail(e.into()));
                }
                self.reads_outstanding += 1;
                off += n;
                k += 1;
                continue;
            }
            self.progress(false)?;
        }
        self.stats.reads_served += 1;
        Ok(())
    }
}

impl Transport for RdmaTransport {
    fn send(&mut self, bufs: &[&[u8]]) -> io::Result<()> {
        self.check()?;
        self.remote()?;
        // Reap what has completed: frees slots and chunks, and surfaces an
        // error from an earlier call now rather than later.
        self.poll_once()?;
        let mut open = None;
        for b in bufs.iter().filter(|b| !b.is_empty()) {
            if b.len() >= self.cfg.bulk_min.max(1) {
                self.flush_open(&mut open)?;
                let peer_reads = self.cfg.zero_copy;
                if peer_reads {
                    self.send_by_read(b)?;
                } else {
                    self.send_by_write(b)?;
                }
            } else {
                self.send_small(b, &mut open)?;
            }
        }
        self.flush_open(&mut open)?;
        Ok(())
    }

    fn recv_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        let mut done = 0;
        while done < buf.len() {
            let Some(front) = self.segs.front_mut() else {
                if self.peer_closed {
                    return Err(RdmaError::Disconnected(self.peer.clone()).into());
                }
                if let Err(e) = self.progress(false) {
                    // Bytes that arrived before the failure are still the
                    // peer's: deliver them first.
                    if self.segs.is_empty() {
                        return Err(e.into());
                    }
                }
                continue;
            };
            let want = buf.len() - done;
            match front {
                Seg::Slot { idx, pos, end } => {
                    let n = want.min(*end - *pos);
                    buf[done..done + n].copy_from_slice(&self.recv.buf[*pos..*pos + n]);
                    *pos += n;
                    done += n;
                    if pos == end {
                        let idx = *idx;
                        self.segs.pop_front();
                        self.repost(idx).map_err(|e| self.fail(e))?;
                        self.owed_slots += 1;
                    }
                }
                Seg::Chunk { idx, pos, end } => {
                    let n = want.min(*end - *pos);
                    let at = *idx as usize * self.cfg.chunk_size as usize + *pos;
                    buf[done..done + n].copy_from_slice(&self.staging_in.buf[at..at + n]);
                    *pos += n;
                    done += n;
                    if pos == end {
                        self.segs.pop_front();
                        self.owed_chunks += 1;
                    }
                }
                Seg::Owned { data, pos } => {
                    let n = want.min(data.len() - *pos);
                    buf[done..done + n].copy_from_slice(&data[*pos..*pos + n]);
                    *pos += n;
                    done += n;
                    if *pos == data.len() {
                        self.overflow -= data.len();
                        self.segs.pop_front();
                    }
                }
                Seg::Pull { req, pos } => {
                    let (req, at) = (*req, *pos);
                    let n = (want as u64).min(req.len - at) as usize;
                    self.pull(req, at, &mut buf[done..done + n])?;
                    done += n;
                    if at + n as u64 == req.len {
                        self.segs.pop_front();
                        self.send_ctl(Kind::ReadDone, req.id)?;
                    } else if let Some(Seg::Pull { pos, .. }) = self.segs.front_mut() {
                        *pos += n as u64;
                    }
                }
            }
            self.return_credits(false)?;
        }
        Ok(())
    }

    fn peer(&self) -> &str {
        &self.peer
    }

    fn shutdown(&self) {
        self.shutdown_handle().shutdown();
    }
}

/// Shuts an [`RdmaTransport`] down from any thread: its waits end within
/// [`WAIT_SLICE`] and the peer sees the side channel close.
#[derive(Debug)]
pub struct ShutdownHandle {
    shut: Arc<AtomicBool>,
    side: Option<TcpStream>,
}

impl ShutdownHandle {
    pub fn shutdown(&self) {
        self.shut.store(true, Ordering::Release);
        if let Some(s) = &self.side {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        // A clean close: BYE if a credit and a slot are at hand, then stop
        // the queue pair before its memory goes.
        if self.broken.is_none() && self.remote.is_some() && !self.shut.load(Ordering::Acquire) {
            if let Some(slot) = (self.slot_credits >= 1).then(|| self.free_send.pop()).flatten() {
                if self.post_msg(slot, Kind::Bye, 0, 0).is_ok() {
                    // Give the NIC a moment to take it before the QP stops.
                    for _ in 0..1000 {
                        if self.free_send.contains(&slot) || self.poll_once().is_err() {
                            break;
                        }
                    }
                }
            }
        }
        self.verbs.disconnect();
        let v = &mut *self.verbs;
        self.cache.clear(v);
        for r in [&mut self.recv, &mut self.staging_in, &mut self.send, &mut self.staging_out] {
            r.release(v);
        }
        if let Some(s) = &self.side {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Why two ends in different partitions do not connect.
pub fn pkey_mismatch(ours: u16, theirs: u16) -> String {
    let name = |k: u16| if k == 0 { "no P_Key".to_string() } else { format!("P_Key {k:#06x}") };
    format!("partition mismatch: this end has {}, the peer {}", name(ours), name(theirs))
}

/// One line about a connection's set-up, for logs.
pub fn describe(info: &ConnInfo) -> String {
    format!(
        "qpn {:#x} lid {} mtu {} pkey {:#06x} ring {}x{} B staging {}x{} KiB",
        info.ep.qpn,
        info.ep.lid,
        info.ep.mtu,
        info.pkey,
        info.recv_slots,
        info.slot_size,
        info.chunks,
        info.chunk_size >> 10
    )
}

pub use wire::CONN_INFO_LEN;
