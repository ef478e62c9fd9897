//! rgpu's record layer on a data connection whose TLS handshake both ends
//! completed with [`ALPN`] negotiated: TLS authenticated the server (and
//! the proofs above it the client), and its exporter gives both ends one
//! secret no other connection has. From it each direction derives its own
//! AEAD keys (the negotiated suite's cipher), and records are sealed and
//! opened in place: no allocation and no copy per record, where rustls
//! costs about 0.5 µs to seal and open a 64-byte record and copies every
//! record's plaintext out of its buffer (see `benches/tls_bulk.rs`).
//!
//! A record on the wire: its plaintext length (u32, little-endian, 1 to
//! [`MAX_RECORD`]), the ciphertext, the 16-byte tag. The length is the
//! associated data; the nonce is the direction's IV XOR the record's
//! sequence number, so a record replayed, dropped, reordered or moved to
//! the other direction fails to open, and the connection fails with it.
//! Keys change every 2^20 records (derived, never sent): no key seals more
//! than 128 GiB, far inside AES-GCM's limits.
//!
//! Sans-I/O: [`Half`] seals into and opens from byte slices; `tls.rs`
//! moves the bytes.

pub use ring::aead::{AES_128_GCM, AES_256_GCM, CHACHA20_POLY1305};
use ring::aead::{self, Aad, LessSafeKey, Nonce, Tag, UnboundKey, NONCE_LEN};
use ring::hkdf;

/// Must equal `rgpu_tls::DATA_RECORDS_ALPN` (a test checks).
pub const ALPN: &[u8] = b"rgpu-records/1";
const EXPORTER_LABEL: &[u8] = b"EXPORTER-rgpu-data-records";
pub const HEADER: usize = 4;
pub const TAG: usize = 16;
/// Plaintext per record at most: large enough that a bulk copy pays per
/// record rarely, small enough that a whole record fits the transport's
/// read buffer (a record is opened only once all of it has arrived).
pub const MAX_RECORD: usize = 128 << 10;
const EPOCH_LOG2: u32 = 20;

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("the TLS handshake negotiated {0:?}, which rgpu's records do not implement")]
    Suite(String),
    #[error("the TLS exporter gave no secret: {0}")]
    Exporter(String),
    #[error("a record announces {0} bytes (1 to {MAX_RECORD} allowed)")]
    Length(usize),
    #[error("a record failed authentication: altered, replayed, out of order, or not rgpu's")]
    Forged,
    #[error("key derivation failed")]
    Derive,
}

/// Which way a half's records go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    ClientToServer,
    ServerToClient,
}

/// The secret both ends of one connection share, and the cipher.
#[derive(Clone)]
pub struct Keys {
    prk: hkdf::Prk,
    alg: &'static aead::Algorithm,
}

impl Keys {
    /// From a completed handshake: the exporter's value under rgpu's label
    /// and the negotiated suite's AEAD.
    pub(crate) fn from_connection(conn: &rustls::Connection) -> Result<Keys, RecordError> {
        use rustls::CipherSuite as S;
        let suite = conn.negotiated_cipher_suite().ok_or_else(|| RecordError::Suite("no suite".into()))?.suite();
        let alg = match suite {
            S::TLS13_AES_128_GCM_SHA256
            | S::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
            | S::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256 => &aead::AES_128_GCM,
            S::TLS13_AES_256_GCM_SHA384
            | S::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384
            | S::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384 => &aead::AES_256_GCM,
            S::TLS13_CHACHA20_POLY1305_SHA256
            | S::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256
            | S::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256 => &aead::CHACHA20_POLY1305,
            other => return Err(RecordError::Suite(format!("{other:?}"))),
        };
        let secret = conn
            .export_keying_material([0u8; 32], EXPORTER_LABEL, None)
            .map_err(|e| RecordError::Exporter(e.to_string()))?;
        Ok(Keys::from_secret(&secret, alg))
    }

    /// From a secret both ends hold (tests and benches; connections use
    /// [`Keys::from_connection`]).
    pub fn from_secret(secret: &[u8; 32], alg: &'static aead::Algorithm) -> Keys {
        Keys { prk: hkdf::Salt::new(hkdf::HKDF_SHA256, b"rgpu records v1").extract(secret), alg }
    }

    /// One direction's state, at record 0.
    pub fn half(&self, dir: Dir) -> Result<Half, RecordError> {
        let (key, iv) = self.epoch(dir, 0)?;
        Ok(Half { keys: self.clone(), dir, seq: 0, key, iv })
    }

    fn epoch(&self, dir: Dir, epoch: u64) -> Result<(LessSafeKey, [u8; NONCE_LEN]), RecordError> {
        let d: &[u8] = match dir {
            Dir::ClientToServer => b"c2s",
            Dir::ServerToClient => b"s2c",
        };
        let e = epoch.to_be_bytes();
        let key_info: [&[u8]; 3] = [b"key", d, &e];
        let okm = self.prk.expand(&key_info, self.alg).map_err(|_| RecordError::Derive)?;
        let key = LessSafeKey::new(UnboundKey::from(okm));
        let mut iv = [0u8; NONCE_LEN];
        let iv_info: [&[u8]; 3] = [b"iv", d, &e];
        self.prk
            .expand(&iv_info, IvLen)
            .and_then(|okm| okm.fill(&mut iv))
            .map_err(|_| RecordError::Derive)?;
        Ok((key, iv))
    }
}

struct IvLen;

impl hkdf::KeyType for IvLen {
    fn len(&self) -> usize {
        NONCE_LEN
    }
}

/// One direction of a connection: its key, IV and next sequence number.
pub struct Half {
    keys: Keys,
    dir: Dir,
    seq: u64,
    key: LessSafeKey,
    iv: [u8; NONCE_LEN],
}

impl Half {
    fn next_nonce(&mut self) -> Result<Nonce, RecordError> {
        let seq = self.seq;
        if seq != 0 && seq.trailing_zeros() >= EPOCH_LOG2 {
            (self.key, self.iv) = self.keys.epoch(self.dir, seq >> EPOCH_LOG2)?;
        }
        self.seq = seq.checked_add(1).ok_or(RecordError::Derive)?;
        let mut n = self.iv;
        for (b, s) in n[NONCE_LEN - 8..].iter_mut().zip(seq.to_be_bytes()) {
            *b ^= s;
        }
        Ok(Nonce::assume_unique_for_key(n))
    }

    /// Appends one record holding `plain` (1 to [`MAX_RECORD`] bytes,
    /// gathered from the slices) to `out`.
    pub fn seal(&mut self, out: &mut Vec<u8>, plain: &[&[u8]]) -> Result<(), RecordError> {
        let len: usize = plain.iter().map(|p| p.len()).sum();
        if len == 0 || len > MAX_RECORD {
            return Err(RecordError::Length(len));
        }
        let header = (len as u32).to_le_bytes();
        out.extend_from_slice(&header);
        let start = out.len();
        for p in plain {
            out.extend_from_slice(p);
        }
        let nonce = self.next_nonce()?;
        let tag = self
            .key
            .seal_in_place_separate_tag(nonce, Aad::from(header), &mut out[start..])
            .map_err(|_| RecordError::Derive)?;
        out.extend_from_slice(tag.as_ref());
        Ok(())
    }

    /// Opens the record with `header` in place: `body` is its ciphertext,
    /// plaintext after. On an error `body` holds no plaintext and the
    /// connection must end.
    pub fn open(&mut self, header: [u8; HEADER], body: &mut [u8], tag: [u8; TAG]) -> Result<(), RecordError> {
        if body.len() != record_len(header)? {
            return Err(RecordError::Length(body.len()));
        }
        let nonce = self.next_nonce()?;
        self.key
            .open_in_place_separate_tag(nonce, Aad::from(header), Tag::from(tag), body, 0..)
            .map(|_| ())
            .map_err(|_| RecordError::Forged)
    }
}

/// The plaintext length a record header announces, checked.
pub fn record_len(header: [u8; HEADER]) -> Result<usize, RecordError> {
    let len = u32::from_le_bytes(header) as usize;
    if len == 0 || len > MAX_RECORD {
        return Err(RecordError::Length(len));
    }
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn halves(alg: &'static aead::Algorithm) -> (Half, Half) {
        let k = Keys::from_secret(&[7u8; 32], alg);
        (k.half(Dir::ClientToServer).unwrap(), k.half(Dir::ClientToServer).unwrap())
    }

    fn split(rec: &[u8]) -> ([u8; HEADER], Vec<u8>, [u8; TAG]) {
        let h: [u8; HEADER] = rec[..HEADER].try_into().unwrap();
        let body = rec[HEADER..rec.len() - TAG].to_vec();
        (h, body, rec[rec.len() - TAG..].try_into().unwrap())
    }

    #[test]
    fn records_open_in_order_under_every_cipher() {
        for alg in [&aead::AES_128_GCM, &aead::AES_256_GCM, &aead::CHACHA20_POLY1305] {
            let (mut tx, mut rx) = halves(alg);
            for n in [1usize, 64, 4096, MAX_RECORD] {
                let data: Vec<u8> = (0..n).map(|i| (i * 13) as u8).collect();
                let mut out = Vec::new();
                tx.seal(&mut out, &[&data[..n / 2], &data[n / 2..]]).unwrap();
                assert_eq!(out.len(), HEADER + n + TAG);
                assert_ne!(&out[HEADER..HEADER + n], &data[..], "sealed bytes are not the plaintext");
                let (h, mut body, tag) = split(&out);
                rx.open(h, &mut body, tag).unwrap();
                assert_eq!(body, data);
            }
        }
    }

    #[test]
    fn altered_replayed_reordered_or_reflected_records_fail() {
        let k = Keys::from_secret(&[9u8; 32], &aead::AES_128_GCM);
        let mut tx = k.half(Dir::ClientToServer).unwrap();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        tx.seal(&mut a, &[b"first record"]).unwrap();
        tx.seal(&mut b, &[b"second record"]).unwrap();
        // Reordered: the second first.
        let mut rx = k.half(Dir::ClientToServer).unwrap();
        let (h, mut body, tag) = split(&b);
        assert!(matches!(rx.open(h, &mut body, tag), Err(RecordError::Forged)));
        // A flipped bit anywhere: body, tag, header.
        for at in [HEADER + 3, a.len() - 1] {
            let mut rx = k.half(Dir::ClientToServer).unwrap();
            let mut bad = a.clone();
            bad[at] ^= 1;
            let (h, mut body, tag) = split(&bad);
            assert!(matches!(rx.open(h, &mut body, tag), Err(RecordError::Forged)), "flip at {at}");
        }
        // The header is authenticated too: a length that still matches the
        // body (the body cut short) fails as forged.
        let mut rx = k.half(Dir::ClientToServer).unwrap();
        let (_, body, tag) = split(&a);
        let mut short = body[..body.len() - 1].to_vec();
        let h = (short.len() as u32).to_le_bytes();
        assert!(matches!(rx.open(h, &mut short, tag), Err(RecordError::Forged)));
        // Replayed: the first twice.
        let mut rx = k.half(Dir::ClientToServer).unwrap();
        let (h, mut body, tag) = split(&a);
        rx.open(h, &mut body.clone(), tag).unwrap();
        assert!(rx.open(h, &mut body, tag).is_err());
        // Reflected: sent back on the other direction.
        let mut back = k.half(Dir::ServerToClient).unwrap();
        let (h, mut body, tag) = split(&a);
        assert!(back.open(h, &mut body, tag).is_err());
        // Another connection's secret.
        let mut other = Keys::from_secret(&[10u8; 32], &aead::AES_128_GCM).half(Dir::ClientToServer).unwrap();
        let (h, mut body, tag) = split(&a);
        assert!(other.open(h, &mut body, tag).is_err());
    }

    #[test]
    fn bad_lengths_are_refused_before_any_work() {
        assert!(matches!(record_len(0u32.to_le_bytes()), Err(RecordError::Length(0))));
        assert!(record_len((MAX_RECORD as u32 + 1).to_le_bytes()).is_err());
        assert!(record_len(u32::MAX.to_le_bytes()).is_err());
        assert_eq!(record_len((MAX_RECORD as u32).to_le_bytes()).unwrap(), MAX_RECORD);
        let (mut tx, _) = halves(&aead::AES_128_GCM);
        assert!(tx.seal(&mut Vec::new(), &[]).is_err());
        assert!(tx.seal(&mut Vec::new(), &[&vec![0u8; MAX_RECORD + 1]]).is_err());
    }

    #[test]
    fn keys_change_at_each_epoch_and_both_ends_follow() {
        let (mut tx, mut rx) = halves(&aead::AES_128_GCM);
        let first_key_iv = tx.iv;
        // Jump both ends to just before the epoch boundary.
        tx.seq = (1 << EPOCH_LOG2) - 1;
        rx.seq = tx.seq;
        for i in 0..3u8 {
            let mut out = Vec::new();
            tx.seal(&mut out, &[&[i; 100]]).unwrap();
            let (h, mut body, tag) = split(&out);
            rx.open(h, &mut body, tag).unwrap();
            assert_eq!(body, vec![i; 100]);
        }
        assert_ne!(tx.iv, first_key_iv, "the epoch's key and IV are new");
        // A record of the new epoch does not open under the old key.
        let (_, mut old) = halves(&aead::AES_128_GCM);
        old.seq = tx.seq;
        let mut out = Vec::new();
        tx.seal(&mut out, &[b"x"]).unwrap();
        let (h, mut body, tag) = split(&out);
        assert!(old.open(h, &mut body, tag).is_err());
    }
}
