//! The data plane's client protocol with no I/O in it: no sockets, no
//! threads, no clock reads (the caller passes the time where it matters).
//!
//! [`SessionCore`] turns calls into request frames in one batch buffer and
//! turns reply bytes back into completed calls. The I/O shell
//! ([`super::connection::Connection`]) moves the bytes: it sends
//! [`SessionCore::batch`] (followed, for a call's large payload, by the
//! caller's own buffer, which is never copied) and fills the slices
//! [`SessionCore::recv_buf`] hands out, which point straight into the host
//! buffers replies must land in. Splitting it so lets every rule below be
//! tested without a network or a thread.
//!
//! The rules:
//! - sequence numbers count up from 1; the replies owed come back in the
//!   order their requests went out, and one that does not match the next
//!   reply owed is a [`ProtocolError`]: the stream is out of step and
//!   nothing after it can be trusted;
//! - a request that wants no reply stays in the batch until a synchronising
//!   call, until the batch reaches [`Tuning::flush_threshold`], or until the
//!   flush deadline passes; one that wants a reply flushes the batch;
//! - before a batch is sent, every reply owed to requests already sent must
//!   be received ([`SessionCore::replies_due`]): the server may be blocked
//!   writing them, and if neither end read both would stall on full buffers
//!   (the server's reply window relies on it too: a request tells it the
//!   client holds every earlier reply);
//! - an asynchronous request's failure (reported by the server with the
//!   next reply, or by the reply to an asynchronous read) is kept and
//!   returned by the next synchronising call that does not fail itself,
//!   once, as CUDA reports asynchronous errors; the first one wins.
//!
//! Resuming after a broken connection: every request sent stays in the
//! resend window, with its bulk, until a reply shows the server ran it (the
//! server runs requests in order, so reply `n` acknowledges every request up
//! to `n`). Asynchronous payloads up to [`Tuning::copy_bulk`] are copied into
//! the window, as the program may reuse its buffer once the call returns;
//! larger ones, and a call's payload, are sent from the caller's memory and
//! their reply waited for, so the caller's buffer is the window. A large
//! copy from page-locked memory, which CUDA forbids changing until the copy
//! completes, is sent from it and not waited for
//! ([`SessionCore::post_borrowed`]): the window points to the buffer until
//! a reply acknowledges it.
//! On a new connection the shell tells the server the last reply received
//! ([`SessionCore::last_reply`]), learns the last request it ran and passes
//! it to [`SessionCore::resume`]: the replies owed up to there come again
//! from the server's reply window, the requests after it are sent again
//! from this one, exactly once. The window is bounded
//! ([`Tuning::window_bytes`], [`Tuning::window_frames`]): before a request
//! would overflow it, [`SessionCore::needs_ack`] says so and the shell sends
//! an acknowledging ping ([`SessionCore::post_ack`]) and waits for its reply.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rgpu_protocol::data_capnp::{reply, request};
use rgpu_protocol::frame::{FrameError, FrameHeader, Kind, HEADER_LEN, MAX_BULK_LEN};
use rgpu_protocol::message::{Encoder, RecvBuf};
use thiserror::Error;

/// Batches are sent when they reach this size even without a sync point.
pub const FLUSH_THRESHOLD: usize = 256 << 10;
/// A call's payload up to this size is copied into the batch; a larger one
/// is sent straight from the caller's memory.
pub const INLINE_BULK: usize = 64 << 10;
/// How long a batch may wait for more calls before it is sent anyway.
pub const FLUSH_DELAY: Duration = Duration::from_micros(200);
/// An asynchronous payload up to this size is copied into the resend
/// window; a larger one is sent from the caller's buffer and its reply
/// waited for (one round trip, less than copying it would cost).
pub const COPY_BULK: usize = 256 << 10;
/// Unacknowledged requests kept for a resume, in bytes and in requests.
pub const WINDOW_BYTES: usize = 64 << 20;
pub const WINDOW_FRAMES: usize = 4096;
/// Bulk that lands nowhere (an error reply's, say) is read through this.
const SCRATCH: usize = 4096;

/// The batching and window knobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    pub flush_threshold: usize,
    pub inline_bulk: usize,
    /// None: a batch leaves only at a synchronising call or when full.
    pub flush_delay: Option<Duration>,
    pub copy_bulk: usize,
    /// The resend window's bounds.
    pub window_bytes: usize,
    pub window_frames: usize,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            flush_threshold: FLUSH_THRESHOLD,
            inline_bulk: INLINE_BULK,
            flush_delay: Some(FLUSH_DELAY),
            copy_bulk: COPY_BULK,
            window_bytes: WINDOW_BYTES,
            window_frames: WINDOW_FRAMES,
        }
    }
}

impl Tuning {
    /// The defaults, with RGPU_FLUSH_DELAY_US (microseconds; 0 turns the
    /// flush deadline off) and RGPU_RESEND_WINDOW (bytes) applied.
    pub fn from_env() -> Self {
        let mut t = Tuning::default();
        if let Some(us) = std::env::var("RGPU_FLUSH_DELAY_US").ok().and_then(|v| v.parse::<u64>().ok()) {
            t.flush_delay = (us != 0).then(|| Duration::from_micros(us));
        }
        if let Some(b) = std::env::var("RGPU_RESEND_WINDOW").ok().and_then(|v| v.parse::<usize>().ok()) {
            t.window_bytes = b.max(1 << 20);
        }
        t
    }
}

/// What the server sent cannot be right; the connection must be given up.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ProtocolError {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("server sent a request frame")]
    RequestFrame,
    #[error("unexpected reply #{0}: no reply is owed")]
    Unexpected(u64),
    #[error("reply #{got} arrived while #{due} was due")]
    OutOfOrder { got: u64, due: u64 },
    #[error("reply #{seq} cannot be decoded: {reason}")]
    BadMessage { seq: u64, reason: String },
    #[error("reply #{seq} carried {got} bulk bytes where {want} were expected")]
    WrongBulk { seq: u64, want: usize, got: usize },
    #[error("the server says it ran requests up to #{executed}, but replies up to #{received} were received and #{sent} is the last sent")]
    BadResume { executed: u64, received: u64, sent: u64 },
}

/// A request the frame format cannot carry; nothing was queued.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("payload of {0} bytes exceeds one frame")]
pub struct TooLarge(pub usize);

/// What the shell must do once a request is queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Then {
    /// Nothing yet. `starts_batch`: the batch was empty before, so this is
    /// the moment to [`SessionCore::arm`] the flush deadline.
    Keep { starts_batch: bool },
    /// Send the batch now (a reply is wanted, or the batch is full).
    Flush,
    /// Send the batch now with the caller's bulk right behind it, in the
    /// same send: the batch ends with a header announcing those bytes. The
    /// request wants a reply (a post's too), and the caller's buffer is
    /// needed until it came: wait for it before returning.
    FlushWithBulk,
    /// Send the batch now with the caller's bulk behind it, as for
    /// [`Then::FlushWithBulk`], but wait for nothing: the caller's buffer
    /// stays unchanged until the request is acknowledged (page-locked
    /// memory under CUDA's rules), and the window keeps a pointer to it.
    FlushBorrowed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Queued {
    pub seq: u64,
    pub then: Then,
}

/// A reply fully received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completed {
    /// An asynchronous read's (or an acknowledgement's): its bytes are in
    /// its host buffer, or it failed and the error waits for the next
    /// synchronising call.
    Read { seq: u64, output: bool },
    /// The synchronising call's: `result` is what the call returns (0, its
    /// own error, or an earlier asynchronous one). Its message stays
    /// readable through [`SessionCore::with_reply`] until the next frame.
    Call { seq: u64, result: u32, output: bool },
}

// `output`: the reply carries kernel printf text for the program's stdout
// (read it with `with_reply`); rare, so nobody decodes a reply twice for it.

struct Owed {
    seq: u64,
    sync: bool,
    /// Where the reply's bulk lands; null (or len 0) for none.
    dst: *mut u8,
    len: usize,
}

/// What a reply said, kept from its message until its bulk is read.
#[derive(Clone, Copy)]
struct Said {
    seq: u64,
    result: u32,
    deferred: u32,
    output: bool,
}

enum Rx {
    Header { got: usize },
    Message { got: usize, len: usize, bulk: usize, seq: u64 },
    Bulk { got: usize, total: usize, land: bool, said: Said },
}

/// A request in the resend window: its bytes are `buf[start..end]`
/// (offsets counted from the window's first byte ever), then `tail` bytes
/// of the caller's buffer at `tail_at`.
struct Framed {
    seq: u64,
    start: usize,
    end: usize,
    tail: usize,
    tail_at: *const u8,
}

pub struct SessionCore {
    tuning: Tuning,
    enc: Encoder,
    /// The resend window, then the batch: whole frames, except that with
    /// `tail_due` the last one's bulk is the caller's buffer, sent behind it.
    buf: Vec<u8>,
    /// Offset of `buf[0]` in the window's bytes ever.
    base: usize,
    /// Where in `buf` the batch (not yet sent) begins.
    batch_at: usize,
    frames: VecDeque<Framed>,
    tail_due: bool,
    /// Bytes of callers' buffers the window points to (borrowed posts).
    borrowed: usize,
    next_seq: u64,
    /// Replies owed, in order; the last `unsent` belong to requests still
    /// in the batch.
    owed: VecDeque<Owed>,
    unsent: usize,
    deferred: u32,
    batch_since: Option<Instant>,
    rx: Rx,
    hdr: [u8; HEADER_LEN],
    recv: RecvBuf,
    last_seq: u64,
    /// The last reply received whole.
    last_reply: u64,
    scratch: Box<[u8]>,
}

// The raw destinations are host buffers the CUDA program handed over and
// promised to keep alive until it synchronises (asynchronous reads), or the
// buffer of a call the shell is still blocked in; the raw sources of
// borrowed posts are page-locked buffers the program may not change until
// the copy completed, which it learns only from a reply that acknowledges
// them; `abandon` forgets them all.
unsafe impl Send for SessionCore {}

impl SessionCore {
    pub fn new(tuning: Tuning) -> Self {
        SessionCore {
            tuning,
            enc: Encoder::default(),
            buf: Vec::with_capacity(tuning.flush_threshold.saturating_mul(2)),
            base: 0,
            batch_at: 0,
            frames: VecDeque::new(),
            tail_due: false,
            borrowed: 0,
            next_seq: 1,
            owed: VecDeque::new(),
            unsent: 0,
            deferred: 0,
            batch_since: None,
            rx: Rx::Header { got: 0 },
            hdr: [0; HEADER_LEN],
            recv: RecvBuf::default(),
            last_seq: 0,
            last_reply: 0,
            scratch: vec![0; SCRATCH].into_boxed_slice(),
        }
    }

    pub fn tuning(&self) -> &Tuning {
        &self.tuning
    }

    // ---- requests ------------------------------------------------------

    /// Queues a request that wants no reply (its error, if any, is deferred).
    /// Its bulk is copied, unless it exceeds [`Tuning::copy_bulk`]: then
    /// [`Then::FlushWithBulk`], and the request waits for its reply.
    pub fn post(&mut self, build: impl FnOnce(request::Builder<'_>), bulk: &[u8]) -> Result<Queued, TooLarge> {
        let was_empty = self.batch().is_empty();
        let behind = bulk.len() > self.tuning.copy_bulk.min(self.tuning.window_bytes);
        let seq = self.encode(behind, build, bulk, behind)?;
        if behind {
            // An acknowledged post: its error is deferred like any post's.
            self.owe(seq, false, std::ptr::null_mut(), 0);
            return Ok(Queued { seq, then: Then::FlushWithBulk });
        }
        let then = if self.batch().len() >= self.tuning.flush_threshold {
            Then::Flush
        } else {
            Then::Keep { starts_batch: was_empty }
        };
        Ok(Queued { seq, then })
    }

    /// Queues a request that wants no reply whose bulk the caller keeps
    /// unchanged until the request is acknowledged: a large one is sent
    /// from the caller's buffer and nobody waits ([`Then::FlushBorrowed`]);
    /// a resume sends it again from there. Smaller ones are copied, and one
    /// larger than the window is waited for, as [`SessionCore::post`] does.
    ///
    /// # Safety
    /// `bulk` must stay valid and unchanged until a reply to this or a later
    /// request has been received, or [`SessionCore::abandon`] is called.
    pub unsafe fn post_borrowed(&mut self, build: impl FnOnce(request::Builder<'_>), bulk: &[u8]) -> Result<Queued, TooLarge> {
        if bulk.len() <= self.tuning.copy_bulk || bulk.len() > self.tuning.window_bytes {
            return self.post(build, bulk);
        }
        let seq = self.encode(false, build, bulk, true)?;
        self.borrowed += bulk.len();
        Ok(Queued { seq, then: Then::FlushBorrowed })
    }

    /// Bytes of callers' buffers the window still points to.
    pub fn borrowed(&self) -> usize {
        self.borrowed
    }

    /// Queues a ping whose reply acknowledges every request before it;
    /// its result, if an error, is deferred. Wait until
    /// [`SessionCore::replies_due`] is zero after sending it.
    pub fn post_ack(&mut self) -> Queued {
        let seq = self.encode(true, |mut r| r.set_ping(()), &[], false).expect("no bulk cannot be too large");
        self.owe(seq, false, std::ptr::null_mut(), 0);
        Queued { seq, then: Then::Flush }
    }

    /// Whether the window must be acknowledged (see [`SessionCore::post_ack`])
    /// before a request with `bulk` bytes of payload is queued.
    pub fn needs_ack(&self, bulk: usize) -> bool {
        self.needs_ack_for(bulk, bulk <= self.tuning.copy_bulk)
    }

    /// As [`SessionCore::needs_ack`], for a [`SessionCore::post_borrowed`].
    pub fn needs_ack_borrowed(&self, bulk: usize) -> bool {
        self.needs_ack_for(bulk, bulk <= self.tuning.window_bytes)
    }

    /// `kept`: the request's bulk would stay in the window (copied or
    /// borrowed) rather than be waited for.
    fn needs_ack_for(&self, bulk: usize, kept: bool) -> bool {
        let held = self.base + self.buf.len() - self.frames.front().map_or(self.base + self.buf.len(), |f| f.start);
        !self.frames.is_empty()
            && (self.frames.len() >= self.tuning.window_frames
                || (kept && held + self.borrowed + bulk + 512 > self.tuning.window_bytes))
    }

    /// Queues an asynchronous read whose reply bulk (exactly `len` bytes on
    /// success) lands at `dst` when the reply is received.
    ///
    /// # Safety
    /// `dst..dst+len` must stay writable until the reply is completed or
    /// [`SessionCore::abandon`] is called.
    pub unsafe fn post_read(&mut self, build: impl FnOnce(request::Builder<'_>), dst: *mut u8, len: usize) -> Queued {
        let seq = self.encode(true, build, &[], false).expect("no bulk cannot be too large");
        self.owe(seq, false, dst, len);
        // Sent at once, so the transfer overlaps with the caller's work.
        Queued { seq, then: Then::Flush }
    }

    /// Queues a synchronising call whose reply bulk (exactly `dst.len()`
    /// bytes on success; none for an empty `dst`) lands in `dst`.
    ///
    /// # Safety
    /// `dst` must stay writable until the reply is completed or
    /// [`SessionCore::abandon`] is called, although the borrow ends here.
    pub unsafe fn call(
        &mut self,
        build: impl FnOnce(request::Builder<'_>),
        bulk: &[u8],
        dst: &mut [u8],
    ) -> Result<Queued, TooLarge> {
        let behind = bulk.len() > self.tuning.inline_bulk;
        let seq = self.encode(true, build, bulk, behind)?;
        self.owe(seq, true, dst.as_mut_ptr(), dst.len());
        Ok(Queued { seq, then: if behind { Then::FlushWithBulk } else { Then::Flush } })
    }

    fn owe(&mut self, seq: u64, sync: bool, dst: *mut u8, len: usize) {
        self.owed.push_back(Owed { seq, sync, dst, len });
        self.unsent += 1;
    }

    /// Encodes a request; its bulk goes into the batch, or with `behind`
    /// is left for the shell to send from the caller's buffer.
    fn encode(
        &mut self,
        wants_reply: bool,
        build: impl FnOnce(request::Builder<'_>),
        bulk: &[u8],
        behind: bool,
    ) -> Result<u64, TooLarge> {
        debug_assert!(!self.tail_due, "a zero-copy payload was never sent behind its batch");
        if bulk.len() as u64 > MAX_BULK_LEN {
            return Err(TooLarge(bulk.len()));
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let at = self.buf.len();
        self.buf.extend_from_slice(&[0u8; HEADER_LEN]);
        let n = self.enc.request(&mut self.buf, build);
        let h = FrameHeader::request(seq, wants_reply, n, bulk.len() as u64).encode();
        self.buf[at..at + HEADER_LEN].copy_from_slice(&h);
        if behind {
            self.tail_due = true;
        } else {
            self.buf.extend_from_slice(bulk);
        }
        let (tail, tail_at) = if behind { (bulk.len(), bulk.as_ptr()) } else { (0, std::ptr::null()) };
        self.frames.push_back(Framed { seq, start: self.base + at, end: self.base + self.buf.len(), tail, tail_at });
        Ok(seq)
    }

    // ---- sending -------------------------------------------------------

    /// The bytes to send (then the caller's bulk, after [`Then::FlushWithBulk`]).
    pub fn batch(&self) -> &[u8] {
        &self.buf[self.batch_at..]
    }

    /// Whether the caller's bulk must be sent behind the batch.
    pub fn tail_due(&self) -> bool {
        self.tail_due
    }

    /// Replies owed to requests already sent: receive them all before
    /// sending the batch.
    pub fn replies_due(&self) -> usize {
        self.owed.len() - self.unsent
    }

    /// The batch (and any bulk behind it) went out in full.
    pub fn sent(&mut self) {
        debug_assert_eq!(self.replies_due(), 0, "a batch was sent while replies were due");
        self.batch_at = self.buf.len();
        self.tail_due = false;
        self.unsent = 0;
        self.batch_since = None;
    }

    /// Requests up to `seq` ran on the server: they leave the window.
    fn acknowledged(&mut self, seq: u64) {
        while self.frames.front().is_some_and(|f| f.seq <= seq) {
            if let Some(f) = self.frames.pop_front() {
                self.borrowed -= self.borrowed.min(f.tail);
            }
        }
        let live = self.frames.front().map_or(self.base + self.buf.len(), |f| f.start) - self.base;
        let dead = live.min(self.batch_at);
        // Amortised: bytes move only once at least as many died.
        if dead > 0 && (dead == self.buf.len() || dead * 2 >= self.buf.len()) {
            self.buf.drain(..dead);
            self.base += dead;
            self.batch_at -= dead;
            // A large asynchronous payload grew the buffer: give it back.
            if self.buf.is_empty() && self.buf.capacity() > 8 << 20 {
                self.buf.shrink_to(self.tuning.flush_threshold.saturating_mul(2));
            }
        }
    }

    /// Requests sent and not yet acknowledged, with the batch.
    #[cfg(test)]
    pub fn window_len(&self) -> usize {
        self.frames.len()
    }

    // ---- resuming ------------------------------------------------------

    /// The last reply received whole: what a new connection tells the server.
    pub fn last_reply(&self) -> u64 {
        self.last_reply
    }

    /// Continues on a new connection whose server ran requests up to
    /// `executed`: what it ran leaves the window, the replies owed up to
    /// there are due (the server sends them again), and every request after
    /// it is in the batch to send again (with the caller's bulk behind it if
    /// the last one's is the caller's: [`SessionCore::tail_due`]).
    pub fn resume(&mut self, executed: u64) -> Result<(), ProtocolError> {
        let sent = self.next_seq - 1;
        if executed < self.last_reply || executed > sent {
            return Err(ProtocolError::BadResume { executed, received: self.last_reply, sent });
        }
        self.rx = Rx::Header { got: 0 };
        self.acknowledged(executed);
        self.materialise_tails();
        self.batch_at = self.frames.front().map_or(self.buf.len(), |f| f.start - self.base);
        self.tail_due = false;
        self.unsent = self.owed.iter().filter(|o| o.seq > executed).count();
        self.batch_since = None;
        debug_assert_eq!(
            self.frames.iter().map(|f| f.end - f.start).sum::<usize>(),
            self.batch().len(),
            "the window's frames are the batch"
        );
        Ok(())
    }

    /// Copies the callers' bytes the window points to into it, each behind
    /// its frame, so the requests to send again are one contiguous batch
    /// (on the wire the same bytes as frame, then bulk). The buffers are
    /// still valid: a borrowed post's until it is acknowledged, a waited-for
    /// request's while its caller waits.
    fn materialise_tails(&mut self) {
        if !self.frames.iter().any(|f| f.tail > 0) {
            return;
        }
        let first = self.frames.front().map_or(self.base + self.buf.len(), |f| f.start);
        let size = self.frames.iter().map(|f| f.end - f.start + f.tail).sum();
        let mut nb = Vec::with_capacity(size);
        for f in self.frames.iter_mut() {
            let at = first + nb.len();
            nb.extend_from_slice(&self.buf[f.start - self.base..f.end - self.base]);
            if f.tail > 0 {
                // SAFETY: see above; the caller promised the bytes stay.
                nb.extend_from_slice(unsafe { std::slice::from_raw_parts(f.tail_at, f.tail) });
            }
            (f.start, f.end, f.tail, f.tail_at) = (at, first + nb.len(), 0, std::ptr::null());
        }
        self.buf = nb;
        self.base = first;
        self.borrowed = 0;
    }

    // ---- the flush deadline -------------------------------------------

    /// Starts the flush deadline of the batch, begun at `now`.
    pub fn arm(&mut self, now: Instant) {
        if !self.batch().is_empty() && self.batch_since.is_none() {
            self.batch_since = Some(now);
        }
    }

    /// When the batch must be sent without waiting for a synchronising call.
    pub fn flush_deadline(&self) -> Option<Instant> {
        Some(self.batch_since? + self.tuning.flush_delay?)
    }

    pub fn flush_due(&self, now: Instant) -> bool {
        self.flush_deadline().is_some_and(|d| now >= d)
    }

    // ---- receiving -----------------------------------------------------

    /// Where the next received bytes go: fill a prefix and report its
    /// length with [`SessionCore::recv_advance`]. Only read while
    /// [`SessionCore::replies_due`] is non-zero. Bulk of a reply owed to a
    /// host buffer is that buffer.
    pub fn recv_buf(&mut self) -> &mut [u8] {
        match self.rx {
            Rx::Header { got } => &mut self.hdr[got..],
            Rx::Message { got, len, .. } => &mut self.recv.prepare(len)[got..],
            Rx::Bulk { got, total, land: true, .. } => {
                let o = &self.owed[0];
                // SAFETY: `o.dst..o.dst+o.len` is writable (the contract of
                // post_read / call) and total == o.len.
                unsafe { std::slice::from_raw_parts_mut(o.dst.add(got), total - got) }
            }
            Rx::Bulk { got, total, land: false, .. } => {
                let k = (total - got).min(self.scratch.len());
                &mut self.scratch[..k]
            }
        }
    }

    /// `n` bytes of the last [`SessionCore::recv_buf`] were filled.
    pub fn recv_advance(&mut self, n: usize) -> Result<Option<Completed>, ProtocolError> {
        match &mut self.rx {
            Rx::Header { got } => {
                *got += n;
                if *got < HEADER_LEN {
                    return Ok(None);
                }
                let h = FrameHeader::decode(&self.hdr)?;
                if h.kind == Kind::Keepalive && h.msg_len == 0 && h.bulk_len == 0 {
                    // The server is alive and still working on a request.
                    self.rx = Rx::Header { got: 0 };
                    return Ok(None);
                }
                if h.kind != Kind::Reply {
                    return Err(ProtocolError::RequestFrame);
                }
                if self.replies_due() == 0 {
                    return Err(ProtocolError::Unexpected(h.seq));
                }
                let due = self.owed[0].seq;
                if h.seq != due {
                    return Err(ProtocolError::OutOfOrder { got: h.seq, due });
                }
                let len = h.msg_len as usize;
                self.rx = Rx::Message { got: 0, len, bulk: h.bulk_len as usize, seq: h.seq };
                if len == 0 {
                    return self.message_done();
                }
                Ok(None)
            }
            Rx::Message { got, len, .. } => {
                *got += n;
                if *got < *len {
                    return Ok(None);
                }
                self.message_done()
            }
            Rx::Bulk { got, total, .. } => {
                *got += n;
                if *got < *total {
                    return Ok(None);
                }
                Ok(Some(self.frame_done()))
            }
        }
    }

    fn message_done(&mut self) -> Result<Option<Completed>, ProtocolError> {
        let Rx::Message { bulk, seq, .. } = self.rx else { unreachable!("message_done outside a message") };
        self.last_seq = seq;
        let (result, deferred, output) = self
            .read_reply(|r| (r.get_result(), r.get_deferred_error(), r.has_output()))?;
        let o = &self.owed[0];
        let want = if o.dst.is_null() { 0 } else { o.len };
        if result == 0 && bulk != want {
            return Err(ProtocolError::WrongBulk { seq, want, got: bulk });
        }
        // An error reply's bulk (there should be none) never lands in the
        // program's memory.
        let land = result == 0 && want != 0;
        let said = Said { seq, result, deferred, output };
        self.rx = Rx::Bulk { got: 0, total: bulk, land, said };
        if bulk == 0 {
            return Ok(Some(self.frame_done()));
        }
        Ok(None)
    }

    fn frame_done(&mut self) -> Completed {
        let Rx::Bulk { said, .. } = std::mem::replace(&mut self.rx, Rx::Header { got: 0 }) else {
            unreachable!("frame_done outside a bulk")
        };
        let o = self.owed.pop_front().expect("a reply was due");
        self.last_reply = said.seq;
        self.acknowledged(said.seq);
        // The server's deferred error is older than this reply's own result.
        self.note(said.deferred);
        if o.sync {
            let result = if said.result != 0 { said.result } else { std::mem::take(&mut self.deferred) };
            Completed::Call { seq: said.seq, result, output: said.output }
        } else {
            self.note(said.result);
            Completed::Read { seq: said.seq, output: said.output }
        }
    }

    fn note(&mut self, code: u32) {
        if self.deferred == 0 {
            self.deferred = code;
        }
    }

    /// Reads the last reply received (a call's, once it completed).
    pub fn with_reply<R>(&self, f: impl FnOnce(reply::Reader<'_>) -> R) -> Result<R, ProtocolError> {
        self.read_reply(f)
    }

    fn read_reply<R>(&self, f: impl FnOnce(reply::Reader<'_>) -> R) -> Result<R, ProtocolError> {
        let bad = |e: capnp::Error| ProtocolError::BadMessage { seq: self.last_seq, reason: e.to_string() };
        let msg = self.recv.reader().map_err(bad)?;
        let r = msg.get_root::<reply::Reader>().map_err(bad)?;
        Ok(f(r))
    }

    /// An asynchronous error not yet returned by a synchronising call.
    #[cfg(test)]
    pub fn deferred(&self) -> u32 {
        self.deferred
    }

    /// Forgets everything owed and queued, and every host buffer named: the
    /// connection is given up.
    pub fn abandon(&mut self) {
        self.owed.clear();
        self.unsent = 0;
        self.buf.clear();
        self.base = 0;
        self.batch_at = 0;
        self.frames.clear();
        self.tail_due = false;
        self.borrowed = 0;
        self.batch_since = None;
        self.rx = Rx::Header { got: 0 };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::testing::reply_frame;

    fn core() -> SessionCore {
        SessionCore::new(Tuning { flush_delay: None, ..Tuning::default() })
    }

    fn ping(r: request::Builder<'_>) {
        let mut r = r;
        r.set_ping(());
    }

    /// Feeds `bytes` in pieces of at most `piece`, as a transport with
    /// short reads would; returns what completed.
    fn feed(c: &mut SessionCore, mut bytes: &[u8], piece: usize) -> Result<Vec<Completed>, ProtocolError> {
        let mut done = Vec::new();
        while !bytes.is_empty() {
            let buf = c.recv_buf();
            let k = buf.len().min(piece).min(bytes.len());
            buf[..k].copy_from_slice(&bytes[..k]);
            bytes = &bytes[k..];
            if let Some(d) = c.recv_advance(k)? {
                done.push(d);
            }
        }
        Ok(done)
    }

    /// The frames in a batch: (seq, wants reply, bulk length carried inline).
    fn frames(mut b: &[u8]) -> Vec<(u64, bool, usize)> {
        let mut v = Vec::new();
        while !b.is_empty() {
            let h = FrameHeader::decode(b[..HEADER_LEN].try_into().unwrap()).unwrap();
            let inline = (b.len() - HEADER_LEN - h.msg_len as usize).min(h.bulk_len as usize);
            v.push((h.seq, h.wants_reply(), inline));
            b = &b[HEADER_LEN + h.msg_len as usize + inline..];
        }
        v
    }

    #[test]
    fn posts_batch_until_a_call_and_sequence_numbers_count_up() {
        let mut c = core();
        assert_eq!(c.post(ping, &[]).unwrap(), Queued { seq: 1, then: Then::Keep { starts_batch: true } });
        assert_eq!(c.post(ping, &[1; 100]).unwrap(), Queued { seq: 2, then: Then::Keep { starts_batch: false } });
        let q = unsafe { c.call(ping, &[], &mut []) }.unwrap();
        assert_eq!(q, Queued { seq: 3, then: Then::Flush });
        assert_eq!(frames(c.batch()), vec![(1, false, 0), (2, false, 100), (3, true, 0)]);
        assert_eq!(c.replies_due(), 0, "the call's reply is not due before its request leaves");
        c.sent();
        assert!(c.batch().is_empty());
        assert_eq!(c.replies_due(), 1);
        assert_eq!(c.post(ping, &[]).unwrap().then, Then::Keep { starts_batch: true });
    }

    #[test]
    fn a_batch_is_flushed_once_it_reaches_the_threshold() {
        let mut c = SessionCore::new(Tuning { flush_threshold: 1000, inline_bulk: 400, flush_delay: None, ..Tuning::default() });
        assert!(matches!(c.post(ping, &[0; 400]).unwrap().then, Then::Keep { .. }));
        assert!(matches!(c.post(ping, &[0; 400]).unwrap().then, Then::Keep { .. }));
        assert_eq!(c.post(ping, &[0; 400]).unwrap().then, Then::Flush);
        assert!(c.batch().len() >= 1000);
    }

    #[test]
    fn a_calls_large_payload_is_left_for_the_shell_to_send_behind_the_batch() {
        let mut c = SessionCore::new(Tuning { inline_bulk: 16, ..Tuning::default() });
        c.post(ping, &[0; 16]).unwrap();
        let before = c.batch().len();
        assert_eq!(unsafe { c.call(ping, &[0; 17], &mut []) }.unwrap().then, Then::FlushWithBulk);
        assert!(c.tail_due());
        let f = frames(c.batch());
        assert_eq!(f.len(), 2);
        assert_eq!(f[1].2, 0, "the 17 bytes are not in the batch");
        let h = FrameHeader::decode(c.batch()[before..before + HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!(h.bulk_len, 17);
        assert_eq!(c.batch().len(), before + HEADER_LEN + h.msg_len as usize);
    }

    #[test]
    fn an_async_payload_is_copied_so_the_program_may_reuse_its_buffer() {
        let mut c = SessionCore::new(Tuning { inline_bulk: 16, flush_delay: None, ..Tuning::default() });
        let mut data = vec![7u8; 1000];
        assert!(matches!(c.post(ping, &data).unwrap().then, Then::Keep { .. }));
        data.fill(0);
        assert_eq!(frames(c.batch()), vec![(1, false, 1000)]);
        assert!(c.batch().ends_with(&[7; 1000]));
        assert!(!c.tail_due());
    }

    // ---- the resend window and resuming ------------------------------------

    fn small_window(bytes: usize, count: usize) -> SessionCore {
        SessionCore::new(Tuning { flush_delay: None, window_bytes: bytes, window_frames: count, ..Tuning::default() })
    }

    /// Requests 1..=3 posted (3 with a payload), call 4 sent; the server
    /// ran up to `executed` before the connection broke.
    fn broken_after_a_batch(executed: u64) -> SessionCore {
        let mut c = core();
        c.post(ping, &[]).unwrap();
        c.post(ping, &[]).unwrap();
        c.post(ping, b"payload").unwrap();
        unsafe { c.call(ping, &[], &mut []) }.unwrap();
        c.sent();
        c.resume(executed).unwrap();
        c
    }

    #[test]
    fn a_resume_sends_again_exactly_the_requests_not_run() {
        let c = broken_after_a_batch(2);
        assert_eq!(frames(c.batch()), vec![(3, false, 7), (4, true, 0)], "1 and 2 ran: never again");
        assert_eq!(c.replies_due(), 0, "no reply is owed to what ran");
        assert!(c.batch().windows(7).any(|w| w == b"payload"), "the payload is sent again from the window");

        let c = broken_after_a_batch(0);
        assert_eq!(frames(c.batch()).iter().map(|f| f.0).collect::<Vec<_>>(), vec![1, 2, 3, 4]);

        let mut c = broken_after_a_batch(4);
        assert!(c.batch().is_empty(), "everything ran");
        assert_eq!(c.replies_due(), 1, "the call's reply comes again from the server's window");
        assert_eq!(feed(&mut c, &reply_frame(4, 0, 0, &[]), 64).unwrap(), vec![Completed::Call { seq: 4, result: 0, output: false }]);
        assert_eq!(c.window_len(), 0);
    }

    #[test]
    fn requests_sent_again_are_sent_once_more_only() {
        let mut c = broken_after_a_batch(2);
        c.sent();
        // Broken again before anything new ran: the same two, once.
        c.resume(2).unwrap();
        assert_eq!(frames(c.batch()).iter().map(|f| f.0).collect::<Vec<_>>(), vec![3, 4]);
        c.sent();
        assert_eq!(feed(&mut c, &reply_frame(4, 0, 0, &[]), 64).unwrap().len(), 1);
        assert_eq!(c.window_len(), 0, "the reply acknowledged the window");
        c.resume(4).unwrap();
        assert!(c.batch().is_empty());
        assert_eq!(unsafe { c.call(ping, &[], &mut []) }.unwrap().seq, 5);
        assert_eq!(frames(c.batch()), vec![(5, true, 0)]);
    }

    #[test]
    fn a_batch_cut_in_its_middle_resumes_after_what_ran() {
        let mut c = core();
        for _ in 0..5 {
            c.post(ping, &[1; 10]).unwrap();
        }
        unsafe { c.call(ping, &[], &mut []) }.unwrap();
        // The send failed part way: the batch was never marked sent.
        c.resume(3).unwrap();
        assert_eq!(frames(c.batch()).iter().map(|f| f.0).collect::<Vec<_>>(), vec![4, 5, 6]);
        assert_eq!(c.replies_due(), 0);
    }

    #[test]
    fn a_call_whose_payload_is_the_callers_resumes_with_it_behind() {
        let mut c = SessionCore::new(Tuning { inline_bulk: 16, flush_delay: None, ..Tuning::default() });
        unsafe { c.call(ping, &[0; 100], &mut []) }.unwrap();
        c.sent();
        c.resume(0).unwrap();
        assert!(!c.tail_due(), "the caller's bytes are in the batch, behind their frame");
        assert_eq!(frames(c.batch()), vec![(1, true, 100)]);
    }

    #[test]
    fn a_borrowed_payload_waits_for_nothing_and_is_sent_again_from_its_buffer() {
        let mut c = SessionCore::new(Tuning { copy_bulk: 16, flush_delay: None, ..Tuning::default() });
        let a = vec![1u8; 100];
        let b = vec![2u8; 200];
        let q = unsafe { c.post_borrowed(ping, &a) }.unwrap();
        assert_eq!(q.then, Then::FlushBorrowed);
        assert!(c.tail_due(), "its bytes go behind the batch");
        assert_eq!(c.replies_due(), 0, "nobody waits for it");
        c.sent();
        let q = unsafe { c.post_borrowed(ping, &b) }.unwrap();
        assert_eq!(q.then, Then::FlushBorrowed);
        c.sent();
        assert_eq!(c.borrowed(), 300);
        // A small one is copied, as any post's.
        assert!(matches!(unsafe { c.post_borrowed(ping, &[3; 8]) }.unwrap().then, Then::Keep { .. }));
        // The connection broke after the first ran: the second goes again,
        // its bytes read from its buffer, then the small one.
        c.resume(1).unwrap();
        assert!(!c.tail_due());
        assert_eq!(frames(c.batch()), vec![(2, false, 200), (3, false, 8)]);
        assert!(c.batch().windows(200).any(|w| w == &b[..]), "the second's bytes, from its buffer");
        assert_eq!(c.borrowed(), 0, "the window holds them now");
        c.sent();
        let mut w = [0u8; 0];
        unsafe { c.call(ping, &[], &mut w) }.unwrap();
        c.sent();
        assert_eq!(feed(&mut c, &reply_frame(4, 0, 0, &[]), 64).unwrap().len(), 1);
        assert_eq!(c.window_len(), 0);
    }

    #[test]
    fn borrowed_bytes_count_against_the_window() {
        let mut c = SessionCore::new(Tuning { copy_bulk: 16, window_bytes: 1000, flush_delay: None, ..Tuning::default() });
        let a = vec![1u8; 600];
        assert!(!c.needs_ack_borrowed(600));
        let _ = unsafe { c.post_borrowed(ping, &a) }.unwrap();
        c.sent();
        assert!(c.needs_ack_borrowed(600), "600 borrowed and 600 more do not fit in 1000");
        assert!(c.needs_ack(10), "nor do copied ones beside them");
        // One larger than the whole window is waited for instead.
        let big = vec![0u8; 2000];
        assert_eq!(unsafe { c.post_borrowed(ping, &big) }.unwrap().then, Then::FlushWithBulk);
        let _ = c.post_ack();
        c.sent();
        assert_eq!(feed(&mut c, &reply_frame(2, 0, 0, &[]), 64).unwrap().len(), 1);
        assert_eq!(feed(&mut c, &reply_frame(3, 0, 0, &[]), 64).unwrap().len(), 1);
        assert_eq!(c.borrowed(), 0, "acknowledged: the window lets go of the buffer");
    }

    #[test]
    fn replies_lost_with_the_connection_come_again_and_land_once() {
        let mut c = core();
        let mut a = [0u8; 4];
        unsafe { c.post_read(ping, a.as_mut_ptr(), 4) };
        c.sent();
        // Half of the reply arrived, then the connection broke.
        let f = reply_frame(1, 0, 0, b"abcd");
        assert!(feed(&mut c, &f[..f.len() - 2], 64).unwrap().is_empty());
        assert_eq!(c.last_reply(), 0, "a reply is received only whole");
        c.resume(1).unwrap();
        assert!(c.batch().is_empty(), "the read ran: not sent again");
        assert_eq!(feed(&mut c, &f, 3).unwrap(), vec![Completed::Read { seq: 1, output: false }]);
        assert_eq!(&a, b"abcd");
        assert_eq!(c.last_reply(), 1);
    }

    #[test]
    fn a_resume_the_server_cannot_mean_is_a_protocol_error() {
        let mut c = core_owing_one();
        assert!(matches!(c.resume(2), Err(ProtocolError::BadResume { executed: 2, .. })));
        feed(&mut c, &reply_frame(1, 0, 0, &[]), 64).unwrap();
        assert!(matches!(c.resume(0), Err(ProtocolError::BadResume { executed: 0, received: 1, .. })));
    }

    #[test]
    fn an_overflowing_window_asks_for_an_acknowledgement_first() {
        let mut c = small_window(1 << 20, 4);
        for _ in 0..3 {
            assert!(!c.needs_ack(0));
            c.post(ping, &[]).unwrap();
        }
        assert!(!c.needs_ack(0));
        c.post(ping, &[]).unwrap();
        assert!(c.needs_ack(0), "four requests fill a window of four");
        let q = c.post_ack();
        assert_eq!((q.seq, q.then), (5, Then::Flush));
        c.sent();
        assert_eq!(c.replies_due(), 1);
        // The acknowledgement's failure is deferred, not lost.
        assert_eq!(feed(&mut c, &reply_frame(5, 0, 700, &[]), 64).unwrap(), vec![Completed::Read { seq: 5, output: false }]);
        assert_eq!(c.window_len(), 0);
        assert!(!c.needs_ack(0));
        assert_eq!(c.deferred(), 700);

        let mut c = small_window(1 << 20, 1000);
        for _ in 0..4 {
            c.post(ping, &vec![0; 200 << 10]).unwrap();
        }
        assert!(!c.needs_ack(100 << 10));
        assert!(c.needs_ack(250 << 10), "the bytes would overflow");
        // A payload over the copy limit is the caller's, acknowledged.
        let mut c = small_window(1 << 20, 1000);
        let q = c.post(ping, &vec![0; COPY_BULK + 1]).unwrap();
        assert_eq!(q.then, Then::FlushWithBulk);
        assert!(c.tail_due());
        c.sent();
        assert_eq!(c.replies_due(), 1, "its reply is waited for");
    }

    #[test]
    fn a_payload_too_large_for_a_frame_queues_nothing() {
        // Never touched: only its length is looked at.
        let huge = unsafe { std::slice::from_raw_parts(std::ptr::NonNull::<u8>::dangling().as_ptr(), (MAX_BULK_LEN + 1) as usize) };
        let mut c = core();
        assert_eq!(c.post(ping, huge), Err(TooLarge(huge.len())));
        assert!(c.batch().is_empty());
        assert_eq!(c.post(ping, &[]).unwrap().seq, 1);
    }

    #[test]
    fn replies_must_answer_the_request_due() {
        let mut c = core();
        unsafe { c.call(ping, &[], &mut []) }.unwrap();
        // Nothing was sent yet, so nothing is owed.
        assert_eq!(feed(&mut c, &reply_frame(1, 0, 0, &[]), 64), Err(ProtocolError::Unexpected(1)));

        let mut c = core();
        c.post(ping, &[]).unwrap();
        unsafe { c.call(ping, &[], &mut []) }.unwrap();
        c.sent();
        assert_eq!(feed(&mut c, &reply_frame(1, 0, 0, &[]), 64), Err(ProtocolError::OutOfOrder { got: 1, due: 2 }));

        let mut c = core();
        unsafe { c.call(ping, &[], &mut []) }.unwrap();
        c.sent();
        let mut f = reply_frame(1, 0, 0, &[]);
        f[2] = Kind::Request as u8;
        assert_eq!(feed(&mut c, &f, 64), Err(ProtocolError::RequestFrame));
        f[0] = 0;
        assert!(matches!(feed(&mut core_owing_one(), &f, 64), Err(ProtocolError::Frame(FrameError::BadMagic(_)))));
    }

    fn core_owing_one() -> SessionCore {
        let mut c = core();
        unsafe { c.call(ping, &[], &mut []) }.unwrap();
        c.sent();
        c
    }

    #[test]
    fn reply_bulk_lands_in_the_buffers_named_even_byte_by_byte() {
        let mut c = core();
        let mut a = [0u8; 10];
        let mut b = [0u8; 5];
        unsafe {
            c.post_read(ping, a.as_mut_ptr(), a.len());
            c.sent();
            c.post_read(ping, b.as_mut_ptr(), b.len());
            c.sent();
            c.call(ping, &[], &mut []).unwrap();
        }
        c.sent();
        assert_eq!(c.replies_due(), 3);
        let mut wire = reply_frame(1, 0, 0, b"0123456789");
        wire.extend(reply_frame(2, 0, 0, b"abcde"));
        wire.extend(reply_frame(3, 0, 0, &[]));
        let done = feed(&mut c, &wire, 1).unwrap();
        assert_eq!(
            done,
            vec![
                Completed::Read { seq: 1, output: false },
                Completed::Read { seq: 2, output: false },
                Completed::Call { seq: 3, result: 0, output: false }
            ]
        );
        assert_eq!(&a, b"0123456789");
        assert_eq!(&b, b"abcde");
        assert_eq!(c.replies_due(), 0);
    }

    #[test]
    fn a_call_reads_its_own_reply_bulk_and_message() {
        let mut c = core();
        let mut out = [0u8; 3];
        unsafe { c.call(ping, &[], &mut out) }.unwrap();
        c.sent();
        let f = crate::client::testing::reply_frame_with(
            &mut Encoder::default(),
            1,
            0,
            0,
            |mut r| r.set_mem_alloc(42),
            b"xyz",
        );
        assert_eq!(feed(&mut c, &f, 7).unwrap(), vec![Completed::Call { seq: 1, result: 0, output: false }]);
        assert_eq!(&out, b"xyz");
        assert!(matches!(c.with_reply(|r| r.which().map(|w| matches!(w, reply::MemAlloc(42)))), Ok(Ok(true))));
    }

    #[test]
    fn an_error_reply_never_writes_the_buffer_and_wrong_lengths_are_refused() {
        let mut c = core();
        let mut a = [9u8; 4];
        unsafe { c.post_read(ping, a.as_mut_ptr(), 4) };
        c.sent();
        // A failed read with bytes after all: read past, not into the buffer.
        assert_eq!(feed(&mut c, &reply_frame(1, 1, 0, b"oops"), 64).unwrap().len(), 1);
        assert_eq!(a, [9; 4]);
        assert_eq!(c.deferred(), 1);

        let mut c = core();
        unsafe { c.post_read(ping, a.as_mut_ptr(), 4) };
        c.sent();
        assert_eq!(
            feed(&mut c, &reply_frame(1, 0, 0, b"toolong"), 64),
            Err(ProtocolError::WrongBulk { seq: 1, want: 4, got: 7 })
        );
        let mut c = core_owing_one();
        assert_eq!(feed(&mut c, &reply_frame(1, 0, 0, b"x"), 64), Err(ProtocolError::WrongBulk { seq: 1, want: 0, got: 1 }));
    }

    #[test]
    fn deferred_errors_surface_once_at_the_next_call_the_first_one_winning() {
        let mut c = core();
        let mut a = [0u8; 4];
        unsafe { c.post_read(ping, a.as_mut_ptr(), 4) };
        c.sent();
        // The read fails; the server also reports an older async failure with it.
        feed(&mut c, &reply_frame(1, 1, 719, &[]), 64).unwrap();
        assert_eq!(c.deferred(), 719);
        unsafe { c.call(ping, &[], &mut []) }.unwrap();
        c.sent();
        // A later failure reported by the server does not replace the first.
        assert_eq!(feed(&mut c, &reply_frame(2, 0, 2, &[]), 64).unwrap(), vec![Completed::Call { seq: 2, result: 719, output: false }]);
        assert_eq!(c.deferred(), 0);
        unsafe { c.call(ping, &[], &mut []) }.unwrap();
        c.sent();
        assert_eq!(feed(&mut c, &reply_frame(3, 0, 0, &[]), 64).unwrap(), vec![Completed::Call { seq: 3, result: 0, output: false }]);

        // A call failing itself returns its own error and keeps the deferred one.
        unsafe { c.call(ping, &[], &mut []) }.unwrap();
        c.sent();
        assert_eq!(feed(&mut c, &reply_frame(4, 1, 700, &[]), 64).unwrap(), vec![Completed::Call { seq: 4, result: 1, output: false }]);
        unsafe { c.call(ping, &[], &mut []) }.unwrap();
        c.sent();
        assert_eq!(feed(&mut c, &reply_frame(5, 0, 0, &[]), 64).unwrap(), vec![Completed::Call { seq: 5, result: 700, output: false }]);
    }

    #[test]
    fn the_flush_deadline_follows_the_time_passed_in() {
        let delay = Duration::from_micros(200);
        let mut c = SessionCore::new(Tuning { flush_delay: Some(delay), ..Tuning::default() });
        let t0 = Instant::now();
        assert_eq!(c.flush_deadline(), None);
        assert_eq!(c.post(ping, &[]).unwrap().then, Then::Keep { starts_batch: true });
        c.arm(t0);
        c.post(ping, &[]).unwrap();
        // Only the batch's start counts.
        c.arm(t0 + delay / 2);
        assert_eq!(c.flush_deadline(), Some(t0 + delay));
        assert!(!c.flush_due(t0 + delay / 2));
        assert!(c.flush_due(t0 + delay));
        c.sent();
        assert_eq!(c.flush_deadline(), None);
        assert!(!c.flush_due(t0 + delay * 10));

        let mut c = core();
        c.post(ping, &[]).unwrap();
        c.arm(t0);
        assert_eq!(c.flush_deadline(), None, "no deadline without a delay");
    }

    #[test]
    fn kernel_output_is_flagged_on_the_reply_that_carries_it() {
        let mut c = core_owing_one();
        let f = crate::client::testing::reply_frame_with(&mut Encoder::default(), 1, 0, 0, |mut r| r.set_output(b"hi\n"), &[]);
        assert_eq!(feed(&mut c, &f, 64).unwrap(), vec![Completed::Call { seq: 1, result: 0, output: true }]);
        assert_eq!(c.with_reply(|r| r.get_output().unwrap().to_vec()).unwrap(), b"hi\n");
    }

    #[test]
    fn abandon_forgets_what_was_owed() {
        let mut c = core();
        let mut a = [0u8; 4];
        unsafe { c.post_read(ping, a.as_mut_ptr(), 4) };
        c.sent();
        c.post(ping, &[]).unwrap();
        c.abandon();
        assert_eq!(c.replies_due(), 0);
        assert!(c.batch().is_empty());
    }
}
