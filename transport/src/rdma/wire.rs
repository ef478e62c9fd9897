//! What the two ends say to each other: the set-up exchange over TCP, and
//! the 16-byte header of every message sent into a receive slot.

use thiserror::Error;

use super::verbs::EndpointInfo;

/// First bytes of a connection-set-up message.
pub const SETUP_MAGIC: &[u8; 8] = b"RGPURDMA";
pub const SETUP_VERSION: u16 = 1;
pub const CONN_INFO_LEN: usize = 72;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum WireError {
    #[error("set-up message has the wrong magic")]
    BadMagic,
    #[error("set-up version {0} is not ours ({SETUP_VERSION})")]
    Version(u16),
    #[error("set-up message is short ({0} bytes)")]
    Short(usize),
    #[error("peer's ring parameters are unusable: {0}")]
    BadRing(&'static str),
    #[error("message header kind {0} is unknown")]
    BadKind(u8),
    #[error("P_Key {0:#06x} is not a valid partition key")]
    BadPkey(u16),
}

/// Everything one end tells the other to connect: its queue pair, its
/// receive ring (so the sender knows how many credits it starts with and
/// how large a message may be) and its bulk staging ring (address and rkey,
/// for RDMA WRITE-with-immediate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnInfo {
    pub ep: EndpointInfo,
    pub recv_slots: u16,
    pub slot_size: u32,
    pub chunks: u16,
    pub chunk_size: u32,
    pub staging_addr: u64,
    pub staging_rkey: u32,
    /// Bit 0: this end may advertise its own buffers for the peer to READ.
    pub flags: u32,
    /// The InfiniBand partition this end's queue pair is in, from the
    /// session's lease; 0: none named (the port's default partition). Both
    /// ends must name the same one. (Bytes 68..70, zero in set-up messages
    /// from before P_Keys, which therefore read as "none".)
    pub pkey: u16,
}

impl ConnInfo {
    pub const ZERO_COPY: u32 = 1;

    pub fn encode(&self) -> [u8; CONN_INFO_LEN] {
        let mut b = [0u8; CONN_INFO_LEN];
        b[0..8].copy_from_slice(SETUP_MAGIC);
        b[8..10].copy_from_slice(&SETUP_VERSION.to_le_bytes());
        b[10..12].copy_from_slice(&self.ep.lid.to_le_bytes());
        b[12..16].copy_from_slice(&self.ep.qpn.to_le_bytes());
        b[16..20].copy_from_slice(&self.ep.psn.to_le_bytes());
        b[20..24].copy_from_slice(&self.ep.mtu.to_le_bytes());
        b[24..40].copy_from_slice(&self.ep.gid);
        b[40..42].copy_from_slice(&self.recv_slots.to_le_bytes());
        b[42..44].copy_from_slice(&self.chunks.to_le_bytes());
        b[44..48].copy_from_slice(&self.slot_size.to_le_bytes());
        b[48..52].copy_from_slice(&self.chunk_size.to_le_bytes());
        b[52..60].copy_from_slice(&self.staging_addr.to_le_bytes());
        b[60..64].copy_from_slice(&self.staging_rkey.to_le_bytes());
        b[64..68].copy_from_slice(&self.flags.to_le_bytes());
        b[68..70].copy_from_slice(&self.pkey.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<ConnInfo, WireError> {
        if b.len() < CONN_INFO_LEN {
            return Err(WireError::Short(b.len()));
        }
        if &b[0..8] != SETUP_MAGIC {
            return Err(WireError::BadMagic);
        }
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let version = u16_at(8);
        if version != SETUP_VERSION {
            return Err(WireError::Version(version));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[24..40]);
        let info = ConnInfo {
            ep: EndpointInfo { lid: u16_at(10), qpn: u32_at(12), psn: u32_at(16), mtu: u32_at(20), gid },
            recv_slots: u16_at(40),
            chunks: u16_at(42),
            slot_size: u32_at(44),
            chunk_size: u32_at(48),
            staging_addr: u64::from_le_bytes(b[52..60].try_into().unwrap_or([0; 8])),
            staging_rkey: u32_at(60),
            flags: u32_at(64),
            pkey: u16_at(68),
        };
        info.validate()?;
        Ok(info)
    }

    /// Bounds every number a peer sends before we size anything by it.
    pub fn validate(&self) -> Result<(), WireError> {
        if self.recv_slots < 4 {
            return Err(WireError::BadRing("fewer than 4 receive slots"));
        }
        if !(256..=(1 << 20)).contains(&self.slot_size) || (self.slot_size as usize) <= HEADER_LEN {
            return Err(WireError::BadRing("slot size outside 256 B..1 MiB"));
        }
        if self.chunks == 0 || !(4096..=(64 << 20)).contains(&self.chunk_size) {
            return Err(WireError::BadRing("staging chunks outside 4 KiB..64 MiB"));
        }
        if !(256..=4096).contains(&self.ep.mtu) {
            return Err(WireError::BadRing("MTU outside 256..4096"));
        }
        if self.pkey != 0 && !super::verbs::pkey_is_valid(self.pkey) {
            return Err(WireError::BadPkey(self.pkey));
        }
        Ok(())
    }
}

/// Reply to a set-up request: accepted (the server's [`ConnInfo`] follows)
/// or refused (a length-prefixed reason follows, and both ends carry on over
/// TCP on the same socket).
pub const SETUP_ACCEPT: u8 = 0;
pub const SETUP_REFUSE: u8 = 1;
/// Sent by each end once its queue pair is ready and its receives posted;
/// nothing travels over RDMA before both have seen the other's.
pub const SETUP_READY: u8 = 0x52;

pub const HEADER_LEN: usize = 16;

/// Kinds of slot messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Stream bytes follow the header.
    Data = 1,
    /// Only the credits in the header.
    Credit = 2,
    /// "Read my buffer": [`ReadReq`] follows.
    ReadReq = 3,
    /// "I have read your buffer `aux`".
    ReadDone = 4,
    /// Clean close.
    Bye = 5,
}

/// The header of every slot message. Every message returns credits: the
/// receive slots and staging chunks its sender has freed since its last
/// message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub slot_returns: u16,
    pub chunk_returns: u16,
    pub len: u32,
    pub aux: u32,
}

impl Header {
    pub fn encode(&self, b: &mut [u8]) {
        b[0] = self.kind as u8;
        b[1] = 0;
        b[2..4].copy_from_slice(&self.slot_returns.to_le_bytes());
        b[4..6].copy_from_slice(&self.chunk_returns.to_le_bytes());
        b[6..8].copy_from_slice(&[0, 0]);
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..16].copy_from_slice(&self.aux.to_le_bytes());
    }

    pub fn decode(b: &[u8]) -> Result<Header, WireError> {
        if b.len() < HEADER_LEN {
            return Err(WireError::Short(b.len()));
        }
        let kind = match b[0] {
            1 => Kind::Data,
            2 => Kind::Credit,
            3 => Kind::ReadReq,
            4 => Kind::ReadDone,
            5 => Kind::Bye,
            k => return Err(WireError::BadKind(k)),
        };
        Ok(Header {
            kind,
            slot_returns: u16::from_le_bytes([b[2], b[3]]),
            chunk_returns: u16::from_le_bytes([b[4], b[5]]),
            len: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            aux: u32::from_le_bytes([b[12], b[13], b[14], b[15]]),
        })
    }
}

/// The body of a [`Kind::ReadReq`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadReq {
    pub id: u32,
    pub rkey: u32,
    pub addr: u64,
    pub len: u64,
}

pub const READ_REQ_LEN: usize = 24;

impl ReadReq {
    pub fn encode(&self, b: &mut [u8]) {
        b[0..4].copy_from_slice(&self.id.to_le_bytes());
        b[4..8].copy_from_slice(&self.rkey.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
    }
    pub fn decode(b: &[u8]) -> Result<ReadReq, WireError> {
        if b.len() < READ_REQ_LEN {
            return Err(WireError::Short(b.len()));
        }
        Ok(ReadReq {
            id: u32::from_le_bytes(b[0..4].try_into().unwrap_or([0; 4])),
            rkey: u32::from_le_bytes(b[4..8].try_into().unwrap_or([0; 4])),
            addr: u64::from_le_bytes(b[8..16].try_into().unwrap_or([0; 8])),
            len: u64::from_le_bytes(b[16..24].try_into().unwrap_or([0; 8])),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> ConnInfo {
        ConnInfo {
            ep: EndpointInfo { qpn: 0x1234, psn: 77, lid: 3, gid: [9; 16], mtu: 4096 },
            recv_slots: 64,
            slot_size: 8192,
            chunks: 8,
            chunk_size: 512 << 10,
            staging_addr: 0x7f00_dead_0000,
            staging_rkey: 0xabcd,
            flags: ConnInfo::ZERO_COPY,
            pkey: 0x8001,
        }
    }

    #[test]
    fn conn_info_round_trips_and_rejects_garbage() {
        let i = info();
        assert_eq!(ConnInfo::decode(&i.encode()), Ok(i));
        let mut b = i.encode();
        b[0] = b'X';
        assert_eq!(ConnInfo::decode(&b), Err(WireError::BadMagic));
        let mut b = i.encode();
        b[8] = 9;
        assert_eq!(ConnInfo::decode(&b), Err(WireError::Version(9)));
        assert_eq!(ConnInfo::decode(&b[..10]), Err(WireError::Short(10)));
        let bad = ConnInfo { recv_slots: 1, ..i };
        assert!(matches!(ConnInfo::decode(&bad.encode()), Err(WireError::BadRing(_))));
        let bad = ConnInfo { chunk_size: 1 << 30, ..i };
        assert!(matches!(ConnInfo::decode(&bad.encode()), Err(WireError::BadRing(_))));
        let bad = ConnInfo { pkey: 0x8000, ..i };
        assert_eq!(ConnInfo::decode(&bad.encode()), Err(WireError::BadPkey(0x8000)));
        // Messages from before P_Keys had zeros there: no partition named.
        let mut b = i.encode();
        b[68..70].copy_from_slice(&[0, 0]);
        assert_eq!(ConnInfo::decode(&b).map(|c| c.pkey), Ok(0));
    }

    #[test]
    fn header_round_trips() {
        let h = Header { kind: Kind::ReadDone, slot_returns: 5, chunk_returns: 2, len: 9, aux: 42 };
        let mut b = [0u8; HEADER_LEN];
        h.encode(&mut b);
        assert_eq!(Header::decode(&b), Ok(h));
        b[0] = 99;
        assert_eq!(Header::decode(&b), Err(WireError::BadKind(99)));
        let r = ReadReq { id: 1, rkey: 2, addr: 3, len: 4 };
        let mut b = [0u8; READ_REQ_LEN];
        r.encode(&mut b);
        assert_eq!(ReadReq::decode(&b), Ok(r));
    }
}
