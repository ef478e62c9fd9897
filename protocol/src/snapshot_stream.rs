//! A snapshot copied off or onto a GPU server in one stream
//! ([`crate::SNAPSHOT_PREAMBLE`]), instead of one control-plane call per
//! piece: the bytes move at the link's rate, with one proof for the
//! request and one MAC over all the bytes. Sans-I/O: both ends build and
//! check these bytes here.
//!
//! After the preamble:
//! 1. the server sends a nonce ([`NONCE_LEN`] bytes);
//! 2. the operator sends a [`Request`]: which way, the snapshot's name, its
//!    size (when it is sent to the server) and a proof under the admin key
//!    over the nonce and all of these ([`request_proof`]);
//! 3. the server answers (status, reason, size) and the bytes follow in
//!    records sealed with AES-256-GCM ([`Sealer`], [`Opener`]) under a key
//!    both ends derive from the admin key, the nonce and the request, the
//!    last record empty and covering the total;
//! 4. the receiver keeps the bytes only if every record and the last one
//!    open; a server taking a snapshot answers once more, after it is
//!    synced and in place.
//!
//! The key is this copy's and this way's alone, and each record's nonce is
//! its place, so neither a relay altering, cutting, reordering or splicing
//! the stream nor a replay of another copy yields a snapshot either end
//! accepts, and the bytes (a program's device memory) are not readable on
//! the way even where the server serves no TLS. AES-GCM runs at several
//! GiB/s a core here, where HMAC-SHA256 ran at 1.6 and halved the copy.

use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_256_GCM};
use ring::hkdf;

use crate::auth::{server_op_message, valid_snapshot_name, ServerOp, NONCE_LEN, SNAPSHOT_NAME_MAX};

/// Bytes of a proof and of a tag.
pub const TAG_LEN: usize = 32;
/// Bytes of a request before its name: way, name length.
pub const REQUEST_HEAD: usize = 2;

/// Which way the snapshot goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    /// The server sends a snapshot it holds to the operator.
    Off,
    /// The operator sends a snapshot onto the server.
    Onto,
}

impl Way {
    fn code(self) -> u8 {
        match self {
            Way::Off => 1,
            Way::Onto => 2,
        }
    }

    fn op(self) -> ServerOp {
        match self {
            Way::Off => ServerOp::SendSnapshot,
            Way::Onto => ServerOp::ReceiveSnapshot,
        }
    }
}

/// What the operator asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub way: Way,
    pub name: String,
    /// The snapshot's size when it goes onto the server; 0 otherwise.
    pub size: u64,
    pub proof: [u8; TAG_LEN],
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("unknown direction {0}")]
    Way(u8),
    #[error("snapshot names are 1-128 of A-Za-z0-9._- and do not start with a dot")]
    Name,
    #[error("a request copying a snapshot off a server names no size")]
    Size,
}

impl Request {
    /// A request proved under `admin_key` over the server's `nonce`.
    pub fn new(admin_key: &[u8], nonce: &[u8], way: Way, name: &str, size: u64) -> Request {
        let size = if way == Way::Off { 0 } else { size };
        let mut proof = [0u8; TAG_LEN];
        proof.copy_from_slice(&request_proof(admin_key, nonce, way, name, size));
        Request { way, name: name.to_string(), size, proof }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(REQUEST_HEAD + self.name.len() + 8 + TAG_LEN);
        b.push(self.way.code());
        b.push(self.name.len() as u8);
        b.extend_from_slice(self.name.as_bytes());
        b.extend_from_slice(&self.size.to_le_bytes());
        b.extend_from_slice(&self.proof);
        b
    }

    /// How many bytes follow the [`REQUEST_HEAD`] bytes `head`, or why the
    /// request is refused before they are read.
    pub fn rest_len(head: [u8; REQUEST_HEAD]) -> Result<usize, RequestError> {
        if !matches!(head[0], 1 | 2) {
            return Err(RequestError::Way(head[0]));
        }
        let n = head[1] as usize;
        if n == 0 || n > SNAPSHOT_NAME_MAX {
            return Err(RequestError::Name);
        }
        Ok(n + 8 + TAG_LEN)
    }

    /// The request from its head and the [`Request::rest_len`] bytes after it.
    pub fn decode(head: [u8; REQUEST_HEAD], rest: &[u8]) -> Result<Request, RequestError> {
        if Request::rest_len(head)? != rest.len() {
            return Err(RequestError::Name);
        }
        let way = if head[0] == 1 { Way::Off } else { Way::Onto };
        let n = head[1] as usize;
        let name = std::str::from_utf8(&rest[..n]).map_err(|_| RequestError::Name)?;
        if !valid_snapshot_name(name) {
            return Err(RequestError::Name);
        }
        let size = u64::from_le_bytes(rest[n..n + 8].try_into().map_err(|_| RequestError::Name)?);
        if way == Way::Off && size != 0 {
            return Err(RequestError::Size);
        }
        let mut proof = [0u8; TAG_LEN];
        proof.copy_from_slice(&rest[n + 8..]);
        Ok(Request { way, name: name.to_string(), size, proof })
    }

    /// Whether the proof is `admin_key`'s over `nonce` and this request.
    pub fn verify(&self, admin_key: &[u8], nonce: &[u8]) -> bool {
        let message = server_op_message(nonce, self.way.op(), self.size, &self.name);
        crate::token::verify_bytes(admin_key, &message, &self.proof)
    }
}

/// The proof of a request: HMAC-SHA256 under the admin key of the operator
/// message naming the nonce, the way, the size and the name.
pub fn request_proof(admin_key: &[u8], nonce: &[u8], way: Way, name: &str, size: u64) -> Vec<u8> {
    crate::token::sign_bytes(admin_key, &server_op_message(nonce, way.op(), size, name))
}

/// Largest record's plaintext.
pub const RECORD_MAX: usize = 1 << 20;
/// The records senders make: a record read, sealed and sent stays in a
/// core's L2 cache, where 1 MiB ones fell out of it (measured: the
/// `snapshot_copy` bench of rgpu-server).
pub const SEND_RECORD: usize = 256 << 10;
/// Bytes of a record's header (its length, u32 LE) and of its tag.
pub const RECORD_HEAD: usize = 4;
pub const RECORD_TAG: usize = 16;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    #[error("a record of {0} bytes (at most {RECORD_MAX})")]
    TooLong(usize),
    #[error("a record does not open (altered, cut, reordered, or sealed under another key or for another copy)")]
    Forged,
}

/// The AES-256-GCM key of one copy, one way: HKDF-SHA256 of the admin key,
/// salted with the server's nonce, for the way, the name and the size. So a
/// record of one copy, or of the other way, opens under no other copy's key.
fn copy_key(admin_key: &[u8], nonce: &[u8; NONCE_LEN], way: Way, name: &str, size: u64) -> LessSafeKey {
    let label: &[u8] = match way {
        Way::Off => b"rgpu-snapshot-records:v1:off",
        Way::Onto => b"rgpu-snapshot-records:v1:onto",
    };
    let info = [label, &[name.len() as u8], name.as_bytes(), &size.to_le_bytes()];
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, nonce).extract(admin_key);
    let okm = prk.expand(&info, &AES_256_GCM).expect("AES-256-GCM's key length is within HKDF's bound");
    LessSafeKey::new(UnboundKey::from(okm))
}

fn record_nonce(seq: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&seq.to_be_bytes());
    Nonce::assume_unique_for_key(n)
}

/// What a record's tag covers beside its bytes: its header, whether it
/// ends the stream and, for the end, how many bytes came before it.
fn record_aad(head: [u8; RECORD_HEAD], end: Option<u64>) -> [u8; RECORD_HEAD + 9] {
    let mut a = [0u8; RECORD_HEAD + 9];
    a[..RECORD_HEAD].copy_from_slice(&head);
    if let Some(total) = end {
        a[RECORD_HEAD] = 1;
        a[RECORD_HEAD + 1..].copy_from_slice(&total.to_le_bytes());
    }
    a
}

/// The sender's side of the records a snapshot travels in: each record is
/// its length (u32 LE), its bytes encrypted in place, and a tag; an empty
/// record ends the stream and covers the total, so a cut stream never
/// reads as a whole one. The nonce is the record's place in the stream.
pub struct Sealer {
    key: LessSafeKey,
    seq: u64,
    pub bytes: u64,
}

impl Sealer {
    pub fn new(admin_key: &[u8], nonce: &[u8; NONCE_LEN], way: Way, name: &str, size: u64) -> Sealer {
        Sealer { key: copy_key(admin_key, nonce, way, name, size), seq: 0, bytes: 0 }
    }

    /// Seals `data` (1..=[`RECORD_MAX`] bytes) in place; returns the header
    /// and the tag to send before and after it.
    pub fn seal(&mut self, data: &mut [u8]) -> Result<([u8; RECORD_HEAD], [u8; RECORD_TAG]), SealError> {
        if data.is_empty() || data.len() > RECORD_MAX {
            return Err(SealError::TooLong(data.len()));
        }
        let head = (data.len() as u32).to_le_bytes();
        let tag = self
            .key
            .seal_in_place_separate_tag(record_nonce(self.seq), Aad::from(record_aad(head, None)), data)
            .map_err(|_| SealError::Forged)?;
        self.seq += 1;
        self.bytes += data.len() as u64;
        let mut t = [0u8; RECORD_TAG];
        t.copy_from_slice(tag.as_ref());
        Ok((head, t))
    }

    /// The record that ends the stream: its header and tag.
    pub fn end(self) -> [u8; RECORD_HEAD + RECORD_TAG] {
        let head = [0u8; RECORD_HEAD];
        let mut out = [0u8; RECORD_HEAD + RECORD_TAG];
        if let Ok(tag) =
            self.key.seal_in_place_separate_tag(record_nonce(self.seq), Aad::from(record_aad(head, Some(self.bytes))), &mut [])
        {
            out[RECORD_HEAD..].copy_from_slice(tag.as_ref());
        }
        out
    }
}

/// The receiver's side of [`Sealer`]'s records.
pub struct Opener {
    key: LessSafeKey,
    seq: u64,
    pub bytes: u64,
}

impl Opener {
    pub fn new(admin_key: &[u8], nonce: &[u8; NONCE_LEN], way: Way, name: &str, size: u64) -> Opener {
        Opener { key: copy_key(admin_key, nonce, way, name, size), seq: 0, bytes: 0 }
    }

    /// The length a record's header announces (0: the end), refused over
    /// [`RECORD_MAX`] before anything is read.
    pub fn record_len(head: [u8; RECORD_HEAD]) -> Result<usize, SealError> {
        let n = u32::from_le_bytes(head) as usize;
        if n > RECORD_MAX {
            return Err(SealError::TooLong(n));
        }
        Ok(n)
    }

    /// Opens a record of [`Opener::record_len`] bytes in place.
    pub fn open(&mut self, data: &mut [u8], tag: &[u8; RECORD_TAG]) -> Result<(), SealError> {
        if data.is_empty() || data.len() > RECORD_MAX {
            return Err(SealError::TooLong(data.len()));
        }
        let head = (data.len() as u32).to_le_bytes();
        let tag = Tag::from(*tag);
        self.key
            .open_in_place_separate_tag(record_nonce(self.seq), Aad::from(record_aad(head, None)), tag, data, 0..)
            .map_err(|_| SealError::Forged)?;
        self.seq += 1;
        self.bytes += data.len() as u64;
        Ok(())
    }

    /// Checks the record that ends the stream (its header read, length 0);
    /// returns how many bytes the stream carried.
    pub fn end(self, tag: &[u8; RECORD_TAG]) -> Result<u64, SealError> {
        let aad = record_aad([0u8; RECORD_HEAD], Some(self.bytes));
        self.key
            .open_in_place_separate_tag(record_nonce(self.seq), Aad::from(aad), Tag::from(*tag), &mut [], 0..)
            .map_err(|_| SealError::Forged)?;
        Ok(self.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"an admin key of some thirty-two bytes";
    const NONCE: [u8; NONCE_LEN] = [7; NONCE_LEN];

    fn decode(b: &[u8]) -> Result<Request, RequestError> {
        let head = [b[0], b[1]];
        Request::rest_len(head)?;
        Request::decode(head, &b[REQUEST_HEAD..])
    }

    #[test]
    fn a_request_round_trips_and_its_proof_binds_every_field() {
        let r = Request::new(KEY, &NONCE, Way::Onto, "ckpt-1", 1 << 30);
        let back = decode(&r.encode()).unwrap();
        assert_eq!(back, r);
        assert!(back.verify(KEY, &NONCE));
        assert!(!back.verify(b"another key", &NONCE));
        assert!(!back.verify(KEY, &[8; NONCE_LEN]), "a proof is for one nonce");
        for changed in [
            Request { size: (1 << 30) + 1, ..r.clone() },
            Request { name: "ckpt-2".into(), ..r.clone() },
            Request { way: Way::Off, size: 0, ..r.clone() },
        ] {
            assert!(!changed.verify(KEY, &NONCE), "{changed:?}");
        }
        let off = Request::new(KEY, &NONCE, Way::Off, "ckpt-1", 99);
        assert_eq!(off.size, 0, "a copy off a server names no size");
        assert!(decode(&off.encode()).unwrap().verify(KEY, &NONCE));
    }

    #[test]
    fn hostile_requests_are_refused_before_their_bytes_are_read() {
        assert_eq!(Request::rest_len([0, 5]), Err(RequestError::Way(0)));
        assert_eq!(Request::rest_len([3, 5]), Err(RequestError::Way(3)));
        assert_eq!(Request::rest_len([1, 0]), Err(RequestError::Name));
        assert_eq!(Request::rest_len([1, 129]), Err(RequestError::Name));
        for bad in ["../etc/passwd", ".hidden", "a/b", "nul\0"] {
            let mut r = Request::new(KEY, &NONCE, Way::Off, "x", 0).encode();
            r[1] = bad.len() as u8;
            r.splice(2..3, bad.bytes());
            assert_eq!(decode(&r), Err(RequestError::Name), "{bad:?}");
        }
        let mut sized_off = Request::new(KEY, &NONCE, Way::Onto, "x", 5).encode();
        sized_off[0] = 1;
        assert_eq!(decode(&sized_off), Err(RequestError::Size));
        let r = Request::new(KEY, &NONCE, Way::Off, "x", 0).encode();
        assert_eq!(Request::decode([r[0], r[1]], &r[REQUEST_HEAD..r.len() - 1]), Err(RequestError::Name), "a short rest");
    }

    /// Seals `parts` as records of a copy; returns the wire.
    fn sealed(way: Way, nonce: &[u8; NONCE_LEN], name: &str, size: u64, parts: &[&[u8]]) -> Vec<Vec<u8>> {
        let mut s = Sealer::new(KEY, nonce, way, name, size);
        let mut wire = Vec::new();
        for p in parts {
            let mut b = p.to_vec();
            let (head, tag) = s.seal(&mut b).unwrap();
            wire.push([&head[..], &b, &tag].concat());
        }
        wire.push(s.end().to_vec());
        wire
    }

    /// Opens records as a receiver does: the bytes, or the first failure.
    fn opened(way: Way, nonce: &[u8; NONCE_LEN], name: &str, size: u64, wire: &[Vec<u8>]) -> Result<Vec<u8>, SealError> {
        let mut o = Opener::new(KEY, nonce, way, name, size);
        let mut out = Vec::new();
        for r in wire {
            let n = Opener::record_len(r[..RECORD_HEAD].try_into().unwrap())?;
            let tag: [u8; RECORD_TAG] = r[r.len() - RECORD_TAG..].try_into().unwrap();
            if n == 0 {
                let total = o.end(&tag)?;
                assert_eq!(total, out.len() as u64);
                return Ok(out);
            }
            let mut b = r[RECORD_HEAD..r.len() - RECORD_TAG].to_vec();
            if b.len() != n {
                return Err(SealError::Forged);
            }
            o.open(&mut b, &tag)?;
            out.extend_from_slice(&b);
        }
        Err(SealError::Forged)
    }

    #[test]
    fn records_carry_the_bytes_hidden_and_open_only_whole_in_order_for_this_copy() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 31 % 253) as u8).collect();
        let size = data.len() as u64;
        let parts: Vec<&[u8]> = vec![&data[..1], &data[1..200_000], &data[200_000..]];
        let wire = sealed(Way::Onto, &NONCE, "s", size, &parts);
        assert_eq!(opened(Way::Onto, &NONCE, "s", size, &wire).unwrap(), data);
        assert!(
            !wire[1].windows(64).any(|w| data.windows(64).take(1000).any(|d| d == w)),
            "the bytes travel encrypted"
        );
        let fails = |w: &[Vec<u8>]| opened(Way::Onto, &NONCE, "s", size, w).is_err();
        let mut flipped = wire.clone();
        flipped[1][RECORD_HEAD + 54_321] ^= 1;
        assert!(fails(&flipped), "an altered byte");
        let mut tag = wire.clone();
        let last = tag[2].len() - 1;
        tag[2][last] ^= 1;
        assert!(fails(&tag), "an altered tag");
        assert!(fails(&[wire[0].clone(), wire[2].clone(), wire[1].clone(), wire[3].clone()]), "reordered");
        assert!(fails(&[wire[0].clone(), wire[1].clone(), wire[3].clone()]), "a record left out");
        assert!(fails(&wire[..3]), "cut before the end record");
        let mut early_end = wire[..2].to_vec();
        early_end.push(wire[3].clone());
        assert!(fails(&early_end), "the end record moved up");
        assert!(opened(Way::Off, &NONCE, "s", size, &wire).is_err(), "the other way");
        assert!(opened(Way::Onto, &[1; NONCE_LEN], "s", size, &wire).is_err(), "another copy");
        assert!(opened(Way::Onto, &NONCE, "t", size, &wire).is_err(), "another name");
        assert!(opened(Way::Onto, &NONCE, "s", size + 1, &wire).is_err(), "another size");
        let other = sealed(Way::Onto, &[1; NONCE_LEN], "s", size, &parts);
        assert!(fails(&[wire[0].clone(), other[1].clone(), wire[2].clone(), wire[3].clone()]), "spliced from another copy");
        assert_eq!(Opener::record_len(((RECORD_MAX + 1) as u32).to_le_bytes()), Err(SealError::TooLong(RECORD_MAX + 1)));
        let mut s = Sealer::new(KEY, &NONCE, Way::Off, "s", 0);
        assert!(s.seal(&mut []).is_err() && s.seal(&mut vec![0; RECORD_MAX + 1]).is_err());
        let empty = sealed(Way::Off, &NONCE, "s", 0, &[]);
        assert_eq!(opened(Way::Off, &NONCE, "s", 0, &empty).unwrap(), b"", "an empty snapshot is one end record");
    }
}
