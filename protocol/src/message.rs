//! Encoding and decoding the capnp part of a frame without a heap
//! allocation per message: both sides keep one builder arena and one
//! word-aligned receive buffer per connection and reuse them.

use capnp::message::{self, ReaderOptions, ScratchSpaceHeapAllocator};
use capnp::serialize::{self, BufferSegments};
use capnp::Word;

/// A received message's bytes, kept 8-byte aligned so capnp can read them in place.
#[derive(Default)]
pub struct RecvBuf {
    words: Vec<Word>,
    len: usize,
}

/// How far ahead of the bytes received [`RecvBuf::receive`] grows its
/// buffer: a frame header can announce a message that never comes.
const RECEIVE_STEP: usize = 64 << 10;

impl RecvBuf {
    /// Reads a message of `len` bytes with `read`, which must fill each
    /// slice it is given. The buffer grows with what has arrived (by at
    /// most 64 KiB, or by as much as it holds, at a time), so memory follows
    /// the bytes a peer really sends, not what its header announced.
    pub fn receive(&mut self, len: usize, mut read: impl FnMut(&mut [u8]) -> std::io::Result<()>) -> std::io::Result<()> {
        self.len = 0;
        let mut got = 0;
        while got < len {
            let end = got + (len - got).min(RECEIVE_STEP.max(got));
            let nwords = end.div_ceil(8);
            if self.words.len() < nwords {
                self.words.resize(nwords, capnp::word(0, 0, 0, 0, 0, 0, 0, 0));
            }
            read(&mut Word::words_to_bytes_mut(&mut self.words)[got..end])?;
            got = end;
        }
        self.len = len;
        Ok(())
    }

    /// Bytes of buffer held now.
    pub fn capacity(&self) -> usize {
        self.words.capacity() * 8
    }

    /// Gives back all but `keep` bytes of buffer (after a large message, so
    /// a connection does not keep the largest it ever received).
    pub fn shrink_to(&mut self, keep: usize) {
        let words = keep.div_ceil(8);
        if self.words.capacity() > words {
            self.words.truncate(words);
            self.words.shrink_to(words);
            self.len = self.len.min(words * 8);
        }
    }

    /// A buffer of exactly `len` bytes to read the next message into.
    pub fn prepare(&mut self, len: usize) -> &mut [u8] {
        let nwords = len.div_ceil(8);
        if self.words.len() < nwords {
            self.words = Word::allocate_zeroed_vec(nwords.next_power_of_two());
        }
        self.len = len;
        &mut Word::words_to_bytes_mut(&mut self.words)[..len]
    }

    /// Reads the message last prepared. Nesting and size limits guard the
    /// reader against a hostile peer.
    pub fn reader(&self) -> capnp::Result<message::Reader<BufferSegments<&[u8]>>> {
        let mut bytes = &Word::words_to_bytes(&self.words)[..self.len];
        let mut opts = ReaderOptions::new();
        opts.traversal_limit_in_words(Some(4 << 20)).nesting_limit(16);
        serialize::read_message_from_flat_slice(&mut bytes, opts)
    }
}

/// Builds messages in a reused scratch arena.
pub struct Encoder {
    scratch: Vec<Word>,
}

impl Default for Encoder {
    fn default() -> Self {
        Encoder { scratch: Word::allocate_zeroed_vec(512) }
    }
}

impl Encoder {
    /// Builds one `Request` with `build` and appends its serialisation to
    /// `out`; returns the number of bytes appended (a multiple of 8).
    pub fn request(
        &mut self,
        out: &mut Vec<u8>,
        build: impl FnOnce(crate::data_capnp::request::Builder<'_>),
    ) -> usize {
        self.encode(out, |m| build(m.init_root()))
    }

    /// As [`Encoder::request`], for a `Reply`.
    pub fn reply(
        &mut self,
        out: &mut Vec<u8>,
        build: impl FnOnce(crate::data_capnp::reply::Builder<'_>),
    ) -> usize {
        self.encode(out, |m| build(m.init_root()))
    }

    fn encode(
        &mut self,
        out: &mut Vec<u8>,
        build: impl FnOnce(&mut message::Builder<ScratchSpaceHeapAllocator<'_>>),
    ) -> usize {
        let start = out.len();
        let alloc = ScratchSpaceHeapAllocator::new(Word::words_to_bytes_mut(&mut self.scratch));
        let mut msg = message::Builder::new(alloc);
        build(&mut msg);
        write_to_vec(out, &msg);
        out.len() - start
    }
}

fn write_to_vec<A: message::Allocator>(out: &mut Vec<u8>, msg: &message::Builder<A>) {
    // Writing into a Vec cannot fail; the Result is io's generic signature.
    let _ = serialize::write_message(out, msg);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data_capnp::{reply, request};

    #[test]
    fn request_round_trips_through_reused_buffers() {
        let mut enc = Encoder::default();
        let mut recv = RecvBuf::default();
        for size in [1u64, 1 << 20, u64::MAX] {
            let mut out = Vec::new();
            let n = enc.request(&mut out, |r| {
                let mut m = r.init_mem_alloc();
                m.set_device(3);
                m.set_size(size);
            });
            assert_eq!(n, out.len());
            assert_eq!(n % 8, 0);
            recv.prepare(n).copy_from_slice(&out);
            let msg = recv.reader().unwrap();
            let req = msg.get_root::<request::Reader>().unwrap();
            match req.which().unwrap() {
                request::MemAlloc(m) => {
                    let m = m.unwrap();
                    assert_eq!((m.get_device(), m.get_size()), (3, size));
                }
                _ => panic!("wrong variant"),
            }
        }
    }

    #[test]
    fn reply_round_trips() {
        let mut enc = Encoder::default();
        let mut out = Vec::new();
        enc.reply(&mut out, |mut r| {
            r.set_result(2);
            r.set_deferred_error(700);
            r.set_mem_alloc(0xdead_0000);
        });
        let mut recv = RecvBuf::default();
        recv.prepare(out.len()).copy_from_slice(&out);
        let msg = recv.reader().unwrap();
        let r = msg.get_root::<reply::Reader>().unwrap();
        assert_eq!((r.get_result(), r.get_deferred_error()), (2, 700));
        assert!(matches!(r.which().unwrap(), reply::MemAlloc(0xdead_0000)));
    }

    /// A header may announce 16 MiB and send nothing: the buffer holds
    /// what arrived (plus one step), and shrinks back after a large message.
    #[test]
    fn receive_grows_with_the_bytes_that_arrive() {
        let mut recv = RecvBuf::default();
        let mut fed = 0usize;
        let r = recv.receive(16 << 20, |buf| {
            if fed >= 100 << 10 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            fed += buf.len();
            Ok(())
        });
        assert!(r.is_err());
        assert!(recv.capacity() <= 512 << 10, "{} bytes held for {fed} received", recv.capacity());
        let mut enc = Encoder::default();
        let mut out = Vec::new();
        enc.request(&mut out, |r| r.init_memcpy_hto_d().set_dst(0x1234));
        let mut at = 0;
        recv.receive(out.len(), |buf| {
            buf.copy_from_slice(&out[at..at + buf.len()]);
            at += buf.len();
            Ok(())
        })
        .unwrap();
        let msg = recv.reader().unwrap();
        assert!(matches!(msg.get_root::<request::Reader>().unwrap().which().unwrap(), request::MemcpyHtoD(_)));
        recv.shrink_to(64 << 10);
        assert!(recv.capacity() <= 64 << 10);
        assert!(recv.reader().is_ok(), "a small message survives the shrink");
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let mut recv = RecvBuf::default();
        let buf = recv.prepare(32);
        buf.copy_from_slice(&[0xff; 32]);
        assert!(recv.reader().is_err());
    }
}
