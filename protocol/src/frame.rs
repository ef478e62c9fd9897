//! Data-plane framing.
//!
//! ```text
//! 0      2     3      4          8               16              24
//! | magic | kind | flags | msg_len | seq            | bulk_len       | msg | bulk
//! ```
//! All integers little-endian. `msg` is one capnp message in the standard
//! stream serialisation (segment table included); `bulk` is raw bytes whose
//! meaning the message gives (copy payload, parameter buffer, module image).
//! Keeping bulk out of capnp lets the server read it straight into device
//! memory and the client send it from the user's buffer with no extra copy.

use thiserror::Error;

pub const HEADER_LEN: usize = 24;
const MAGIC: u16 = 0x4752; // "RG"

/// Largest capnp part of a frame. Requests are small; the largest replies
/// (a module's function list) stay far below this.
pub const MAX_MESSAGE_LEN: u32 = 16 << 20;
/// Largest bulk part of one frame. Larger copies are split by the sender.
pub const MAX_BULK_LEN: u64 = 1 << 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Request = 1,
    Reply = 2,
    /// Client to server, with no message or bulk: the orderly end of the
    /// session. A connection that ends without it may come back (resume).
    Close = 3,
    /// Server to client, with no message or bulk, sent while a request
    /// runs long: the server is alive, so a client's read timeout measures
    /// the server's silence, not the length of a kernel.
    Keepalive = 4,
}

/// The request must be answered by exactly one reply with the same `seq`.
pub const FLAG_WANTS_REPLY: u8 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: Kind,
    pub flags: u8,
    pub msg_len: u32,
    pub seq: u64,
    pub bulk_len: u64,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("bad frame magic {0:#06x}: the peer does not speak the rgpu data plane")]
    BadMagic(u16),
    #[error("unknown frame kind {0}")]
    BadKind(u8),
    #[error("frame message of {0} bytes exceeds the limit of {MAX_MESSAGE_LEN}")]
    MessageTooLong(u32),
    #[error("frame bulk of {0} bytes exceeds the limit of {MAX_BULK_LEN}")]
    BulkTooLong(u64),
    #[error("frame message length {0} is not a whole number of 8-byte words")]
    Unaligned(u32),
}

impl FrameHeader {
    pub fn request(seq: u64, wants_reply: bool, msg_len: usize, bulk_len: u64) -> Self {
        FrameHeader {
            kind: Kind::Request,
            flags: if wants_reply { FLAG_WANTS_REPLY } else { 0 },
            msg_len: msg_len as u32,
            seq,
            bulk_len,
        }
    }

    pub fn reply(seq: u64, msg_len: usize, bulk_len: u64) -> Self {
        FrameHeader { kind: Kind::Reply, flags: 0, msg_len: msg_len as u32, seq, bulk_len }
    }

    /// A frame of `kind` that carries nothing (Close, Keepalive).
    pub fn bare(kind: Kind) -> Self {
        FrameHeader { kind, flags: 0, msg_len: 0, seq: 0, bulk_len: 0 }
    }

    pub fn wants_reply(&self) -> bool {
        self.flags & FLAG_WANTS_REPLY != 0
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        b[2] = self.kind as u8;
        b[3] = self.flags;
        b[4..8].copy_from_slice(&self.msg_len.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.bulk_len.to_le_bytes());
        b
    }

    /// Checks a header before anything it announces is read or allocated.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, FrameError> {
        let magic = u16::from_le_bytes([b[0], b[1]]);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let kind = match b[2] {
            1 => Kind::Request,
            2 => Kind::Reply,
            3 => Kind::Close,
            4 => Kind::Keepalive,
            k => return Err(FrameError::BadKind(k)),
        };
        let msg_len = u32::from_le_bytes(b[4..8].try_into().unwrap());
        if msg_len > MAX_MESSAGE_LEN {
            return Err(FrameError::MessageTooLong(msg_len));
        }
        if msg_len % 8 != 0 {
            return Err(FrameError::Unaligned(msg_len));
        }
        let bulk_len = u64::from_le_bytes(b[16..24].try_into().unwrap());
        if bulk_len > MAX_BULK_LEN {
            return Err(FrameError::BulkTooLong(bulk_len));
        }
        Ok(FrameHeader {
            kind,
            flags: b[3],
            msg_len,
            seq: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            bulk_len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = FrameHeader::request(42, true, 64, 1 << 20);
        let d = FrameHeader::decode(&h.encode()).unwrap();
        assert_eq!(d, h);
        assert!(d.wants_reply());
        for k in [Kind::Close, Kind::Keepalive] {
            assert_eq!(FrameHeader::decode(&FrameHeader::bare(k).encode()).unwrap().kind, k);
        }
        let r = FrameHeader::reply(7, 16, 0);
        assert_eq!(FrameHeader::decode(&r.encode()).unwrap(), r);
        assert!(!r.wants_reply());
    }

    #[test]
    fn rejects_bad_headers() {
        let mut b = FrameHeader::request(1, false, 8, 0).encode();
        b[0] = 0;
        assert!(matches!(FrameHeader::decode(&b), Err(FrameError::BadMagic(_))));
        let mut b = FrameHeader::request(1, false, 8, 0).encode();
        b[2] = 9;
        assert_eq!(FrameHeader::decode(&b), Err(FrameError::BadKind(9)));
        let b = FrameHeader::request(1, false, (MAX_MESSAGE_LEN + 8) as usize, 0).encode();
        assert!(matches!(FrameHeader::decode(&b), Err(FrameError::MessageTooLong(_))));
        let b = FrameHeader::request(1, false, 12, 0).encode();
        assert_eq!(FrameHeader::decode(&b), Err(FrameError::Unaligned(12)));
        let b = FrameHeader::request(1, false, 8, MAX_BULK_LEN + 1).encode();
        assert!(matches!(FrameHeader::decode(&b), Err(FrameError::BulkTooLong(_))));
    }
}
