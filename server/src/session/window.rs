//! The replies a resumed connection may have to send again.
//!
//! A client sends a batch only once it received every reply owed to the
//! requests it sent before (the shim's rule, see the client's
//! `session_core`). So when request `s` arrives, the client holds every
//! reply numbered below `s`, and those can be forgotten; what stays is the
//! reply to the last request that wanted one, if no request came after it:
//! normally one reply. On resume the client names the last reply it
//! received, and the replies after it are sent again, in order, instead of
//! running their requests twice.
//!
//! Device-to-host bulk is not kept: the reply's device range is read again
//! when it is replayed. That gives the same bytes, because no request after
//! it has run (the client sent none before it had the reply) and the
//! stream it was read in order of is the same.
//!
//! The window is bounded ([`MAX_REPLIES`], [`MAX_BYTES`]) against clients
//! that do not follow the rule; a reply pushed out by the bound is
//! remembered, and a resume that would need it is refused.

use std::collections::VecDeque;

use crate::command::DeviceBytes;

pub const MAX_REPLIES: usize = 64;
pub const MAX_BYTES: usize = 16 << 20;

pub struct Kept {
    pub seq: u64,
    /// Header and message, as sent.
    pub frame: Vec<u8>,
    /// The reply's bulk, read again from the device when replayed.
    pub device: Option<DeviceBytes>,
}

#[derive(Default)]
pub struct ReplyWindow {
    kept: VecDeque<Kept>,
    bytes: usize,
    /// The newest reply the bound pushed out before the client had it.
    lost: u64,
}

/// A resume the window cannot serve: a reply the client lacks was not kept.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("reply #{0} the client did not receive is no longer kept")]
pub struct Gone(pub u64);

impl ReplyWindow {
    pub fn keep(&mut self, seq: u64, frame: &[u8], device: Option<DeviceBytes>) {
        self.bytes += frame.len();
        self.kept.push_back(Kept { seq, frame: frame.to_vec(), device });
        while self.kept.len() > MAX_REPLIES || (self.bytes > MAX_BYTES && self.kept.len() > 1) {
            let k = self.kept.pop_front().expect("not empty");
            self.bytes -= k.frame.len();
            self.lost = self.lost.max(k.seq);
        }
    }

    /// The client has every reply numbered below `seq`.
    pub fn received_below(&mut self, seq: u64) {
        while self.kept.front().is_some_and(|k| k.seq < seq) {
            let k = self.kept.pop_front().expect("not empty");
            self.bytes -= k.frame.len();
        }
    }

    /// The replies after `last_reply`, the last one the client received.
    pub fn after(&mut self, last_reply: u64) -> Result<impl Iterator<Item = &Kept>, Gone> {
        if self.lost > last_reply {
            return Err(Gone(self.lost));
        }
        self.received_below(last_reply + 1);
        Ok(self.kept.iter())
    }

    /// The replies kept, and the newest one the bound pushed out: what a
    /// checkpoint carries so that a resume on another server works.
    pub fn export(&self) -> (impl Iterator<Item = &Kept>, u64) {
        (self.kept.iter(), self.lost)
    }

    /// A window as [`ReplyWindow::export`] gave it (the bounds applied again).
    pub fn import(kept: Vec<Kept>, lost: u64) -> Self {
        let mut w = ReplyWindow { lost, ..ReplyWindow::default() };
        for k in kept {
            w.keep(k.seq, &k.frame, k.device);
        }
        w
    }

    #[cfg(test)]
    fn seqs(&self) -> Vec<u64> {
        self.kept.iter().map(|k| k.seq).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_the_client_has_are_forgotten() {
        let mut w = ReplyWindow::default();
        w.keep(3, b"three", None);
        w.keep(5, b"five", None);
        w.received_below(5);
        assert_eq!(w.seqs(), vec![5]);
        assert_eq!(w.after(4).unwrap().map(|k| k.seq).collect::<Vec<_>>(), vec![5]);
        assert_eq!(w.after(5).unwrap().count(), 0);
    }

    #[test]
    fn a_reply_pushed_out_by_the_bound_refuses_the_resume_that_needs_it() {
        let mut w = ReplyWindow::default();
        for s in 1..=(MAX_REPLIES as u64 + 2) {
            w.keep(s, b"r", None);
        }
        assert_eq!(w.after(0).err(), Some(Gone(2)));
        assert_eq!(w.after(2).unwrap().count(), MAX_REPLIES);
        let mut w = ReplyWindow::default();
        w.keep(1, &vec![0; MAX_BYTES], None);
        w.keep(2, b"x", None);
        assert_eq!(w.seqs(), vec![2]);
        assert_eq!(w.after(0).err(), Some(Gone(1)));
    }
}
