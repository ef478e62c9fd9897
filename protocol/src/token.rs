//! Lease tokens: what the broker signs and a GPU server checks before it
//! opens a session. Sans-I/O: bytes and `now` in, claims or an error out.
//!
//! Layout (little endian): version byte (1), lease id u64, generation u64,
//! deadline (unix ms) u64, memory limit u64 (0: whole GPUs), tenant
//! (u16 length + UTF-8), GPU count u16 + 16-byte UUIDs, then the
//! HMAC-SHA256 of everything before it under the broker key (32 bytes).
//! Version 2 is version 1 plus the tenant's InfiniBand P_Key (u16) after
//! the GPUs; tokens without a P_Key are still written as version 1, so
//! servers that know only version 1 keep accepting them.
//! Version 3 is for fractional leases: version 1, then the P_Key (u16, 0:
//! none, an invalid P_Key in InfiniBand) and the lease's compute share of
//! each GPU (u16, thousandths); tokens without a share are written as before.
//! Version 4 binds the token to a client key: version 1, then the P_Key
//! (u16, 0: none), the compute share (u16, 0: whole GPUs) and the client's
//! Ed25519 public key (32 bytes); a server admits it only with that key's
//! proof (see [`crate::binding`]). Unbound tokens are written as before.
//! In the environment (`RGPU_TOKEN`) a token is written in lowercase hex.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use thiserror::Error;

const VERSION: u8 = 1;
/// Version 1 plus a P_Key.
const VERSION_PKEY: u8 = 2;
/// Version 1 plus an optional P_Key and a compute share.
const VERSION_SHARE: u8 = 3;
/// Version 3's fields, a share of 0 meaning whole GPUs, and a client key.
const VERSION_BOUND: u8 = 4;
const MAC_LEN: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claims {
    pub lease_id: u64,
    pub generation: u64,
    pub deadline_ms: u64,
    /// Bytes a session may allocate on a GPU of the lease; 0: no limit.
    pub memory_limit: u64,
    pub tenant: String,
    pub gpus: Vec<[u8; 16]>,
    /// The tenant's InfiniBand partition key, when the broker assigns one:
    /// an RDMA data plane for this lease runs in that partition.
    pub pkey: Option<u16>,
    /// The lease's compute share of each of its GPUs, in thousandths; 0:
    /// whole GPUs. A server gives the lease's sessions device time in
    /// proportion to it when they compete.
    pub compute_milli: u16,
    /// The client's public key the token is bound to: a session opens only
    /// with its holder's proof. None: a bearer token.
    pub client_key: Option<[u8; crate::binding::PUBLIC_KEY_LEN]>,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum TokenError {
    #[error("token is malformed: {0}")]
    Malformed(&'static str),
    #[error("token signature does not verify (forged, or signed with another broker key)")]
    BadSignature,
    #[error("token expired {0} ms ago")]
    Expired(u64),
}

type HmacSha256 = Hmac<Sha256>;

fn mac(key: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length.
    <HmacSha256 as KeyInit>::new_from_slice(key).unwrap_or_else(|_| {
        <HmacSha256 as KeyInit>::new_from_slice(&[0u8; 32]).expect("a 32-byte key is always valid")
    })
}

/// HMAC-SHA256 of `data` under `key`.
pub fn sign_bytes(key: &[u8], data: &[u8]) -> Vec<u8> {
    let mut m = mac(key);
    m.update(data);
    m.finalize().into_bytes().to_vec()
}

/// Constant-time check of `sig` against HMAC-SHA256 of `data`.
pub fn verify_bytes(key: &[u8], data: &[u8], sig: &[u8]) -> bool {
    let mut m = mac(key);
    m.update(data);
    m.verify_slice(sig).is_ok()
}

impl Claims {
    /// The signed token.
    pub fn sign(&self, key: &[u8]) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + self.tenant.len() + 16 * self.gpus.len() + MAC_LEN);
        let version = match (self.client_key, self.pkey, self.compute_milli) {
            (Some(_), _, _) => VERSION_BOUND,
            (None, _, 1..) => VERSION_SHARE,
            (None, Some(_), 0) => VERSION_PKEY,
            (None, None, 0) => VERSION,
        };
        b.push(version);
        b.extend_from_slice(&self.lease_id.to_le_bytes());
        b.extend_from_slice(&self.generation.to_le_bytes());
        b.extend_from_slice(&self.deadline_ms.to_le_bytes());
        b.extend_from_slice(&self.memory_limit.to_le_bytes());
        let tenant = &self.tenant.as_bytes()[..self.tenant.len().min(u16::MAX as usize)];
        b.extend_from_slice(&(tenant.len() as u16).to_le_bytes());
        b.extend_from_slice(tenant);
        let n = self.gpus.len().min(u16::MAX as usize);
        b.extend_from_slice(&(n as u16).to_le_bytes());
        for g in &self.gpus[..n] {
            b.extend_from_slice(g);
        }
        if version == VERSION_SHARE || version == VERSION_BOUND {
            b.extend_from_slice(&self.pkey.unwrap_or(0).to_le_bytes());
            b.extend_from_slice(&self.compute_milli.to_le_bytes());
            if let Some(k) = &self.client_key {
                b.extend_from_slice(k);
            }
        } else if let Some(k) = self.pkey {
            b.extend_from_slice(&k.to_le_bytes());
        }
        let sig = sign_bytes(key, &b);
        b.extend_from_slice(&sig);
        b
    }

    /// Reads the claims without checking the signature (a client uses this
    /// to see which GPUs a token is for; servers use [`Claims::verify`]).
    pub fn decode_unverified(token: &[u8]) -> Result<Claims, TokenError> {
        if token.len() < MAC_LEN + 1 {
            return Err(TokenError::Malformed("too short"));
        }
        let body = &token[..token.len() - MAC_LEN];
        let mut r = Reader { b: body };
        let version = r.u8()?;
        if !matches!(version, VERSION | VERSION_PKEY | VERSION_SHARE | VERSION_BOUND) {
            return Err(TokenError::Malformed("unknown version"));
        }
        let lease_id = r.u64()?;
        let generation = r.u64()?;
        let deadline_ms = r.u64()?;
        let memory_limit = r.u64()?;
        let tn = r.u16()? as usize;
        let tenant = std::str::from_utf8(r.take(tn)?)
            .map_err(|_| TokenError::Malformed("tenant is not UTF-8"))?
            .to_string();
        let n = r.u16()? as usize;
        let mut gpus = Vec::with_capacity(n);
        for _ in 0..n {
            let mut u = [0u8; 16];
            u.copy_from_slice(r.take(16)?);
            gpus.push(u);
        }
        let (pkey, compute_milli) = match version {
            VERSION_PKEY => (Some(r.u16()?), 0),
            VERSION_SHARE | VERSION_BOUND => {
                let pkey = Some(r.u16()?).filter(|&k| k != 0);
                let share = r.u16()?;
                if (version == VERSION_SHARE && share == 0) || share > 1000 {
                    return Err(TokenError::Malformed("compute share outside 1..=1000"));
                }
                (pkey, share)
            }
            _ => (None, 0),
        };
        let client_key = if version == VERSION_BOUND {
            let mut k = [0u8; crate::binding::PUBLIC_KEY_LEN];
            k.copy_from_slice(r.take(crate::binding::PUBLIC_KEY_LEN)?);
            Some(k)
        } else {
            None
        };
        if !r.b.is_empty() {
            return Err(TokenError::Malformed("trailing bytes"));
        }
        Ok(Claims { lease_id, generation, deadline_ms, memory_limit, tenant, gpus, pkey, compute_milli, client_key })
    }

    /// Checks the signature and the deadline and returns the claims.
    pub fn verify(token: &[u8], key: &[u8], now_ms: u64) -> Result<Claims, TokenError> {
        let claims = Claims::decode_unverified(token)?;
        let (body, sig) = token.split_at(token.len() - MAC_LEN);
        if !verify_bytes(key, body, sig) {
            return Err(TokenError::BadSignature);
        }
        if claims.deadline_ms <= now_ms {
            return Err(TokenError::Expired(now_ms - claims.deadline_ms));
        }
        Ok(claims)
    }
}

struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], TokenError> {
        if self.b.len() < n {
            return Err(TokenError::Malformed("truncated"));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u8(&mut self) -> Result<u8, TokenError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, TokenError> {
        let mut a = [0u8; 2];
        a.copy_from_slice(self.take(2)?);
        Ok(u16::from_le_bytes(a))
    }
    fn u64(&mut self) -> Result<u64, TokenError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
}

/// Lowercase hex, as tokens travel in the environment.
pub fn to_hex(b: &[u8]) -> String {
    const D: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(D[(x >> 4) as usize] as char);
        s.push(D[(x & 15) as usize] as char);
    }
    s
}

pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    let s = s.trim().as_bytes();
    if s.len() % 2 != 0 {
        return None;
    }
    let nib = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    s.chunks(2).map(|p| Some(nib(p[0])? << 4 | nib(p[1])?)).collect()
}

/// Reads a broker key file: hex if the whole file is hex (as `rgpu-broker
/// --init-key` writes it), else its raw bytes. At least 16 bytes.
pub fn parse_key(file_contents: &[u8]) -> Result<Vec<u8>, TokenError> {
    let key = std::str::from_utf8(file_contents)
        .ok()
        .and_then(from_hex)
        .unwrap_or_else(|| file_contents.to_vec());
    if key.len() < 16 {
        return Err(TokenError::Malformed("broker key shorter than 16 bytes"));
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims() -> Claims {
        Claims {
            lease_id: 7,
            generation: 42,
            deadline_ms: 10_000,
            memory_limit: 1 << 30,
            tenant: "alice".into(),
            gpus: vec![[1; 16], [2; 16]],
            pkey: None,
            compute_milli: 0,
            client_key: None,
        }
    }

    #[test]
    fn round_trip_and_refusals() {
        let key = b"0123456789abcdef0123456789abcdef";
        let t = claims().sign(key);
        assert_eq!(Claims::verify(&t, key, 9_999), Ok(claims()));
        assert_eq!(Claims::verify(&t, key, 10_000), Err(TokenError::Expired(0)));
        assert_eq!(Claims::verify(&t, b"another key, another broker.....", 0), Err(TokenError::BadSignature));
        let mut forged = t.clone();
        forged[9] ^= 1; // generation
        assert_eq!(Claims::verify(&forged, key, 0), Err(TokenError::BadSignature));
        assert!(Claims::verify(&t[..20], key, 0).is_err());
        assert!(Claims::verify(&[], key, 0).is_err());
        assert_eq!(from_hex(&to_hex(&t)), Some(t));
        assert_eq!(parse_key(b"00112233445566778899aabbccddeeff\n").map(|k| k.len()), Ok(16));
        assert!(parse_key(b"short").is_err());
    }

    #[test]
    fn pkey_round_trips_and_is_signed() {
        let key = b"0123456789abcdef0123456789abcdef";
        let c = Claims { pkey: Some(0x8001), ..claims() };
        let t = c.sign(key);
        assert_eq!(t[0], VERSION_PKEY);
        assert_eq!(Claims::verify(&t, key, 0), Ok(c.clone()));
        assert_eq!(Claims::decode_unverified(&t).map(|c| c.pkey), Ok(Some(0x8001)));
        // The key is covered by the MAC.
        let mut forged = t.clone();
        let at = t.len() - MAC_LEN - 2;
        forged[at] ^= 0x02;
        assert_eq!(Claims::verify(&forged, key, 0), Err(TokenError::BadSignature));
        // Without a key: still version 1, byte for byte what older brokers wrote.
        let old = claims().sign(key);
        assert_eq!(old[0], VERSION);
        assert_eq!(Claims::verify(&old, key, 0).map(|c| c.pkey), Ok(None));
        // A version-2 token cut short of its key is malformed, not a panic.
        let mut short = t[..t.len() - MAC_LEN - 1].to_vec();
        short.extend_from_slice(&sign_bytes(key, &short));
        assert!(matches!(Claims::verify(&short, key, 0), Err(TokenError::Malformed(_))));
    }

    #[test]
    fn a_compute_share_round_trips_with_or_without_a_pkey_and_is_signed() {
        let key = b"0123456789abcdef0123456789abcdef";
        for pkey in [None, Some(0x8002)] {
            let c = Claims { pkey, compute_milli: 300, ..claims() };
            let t = c.sign(key);
            assert_eq!(t[0], VERSION_SHARE);
            assert_eq!(Claims::verify(&t, key, 0), Ok(c.clone()));
            let mut forged = t.clone();
            let at = t.len() - MAC_LEN - 2;
            forged[at] ^= 0x01;
            assert_eq!(Claims::verify(&forged, key, 0), Err(TokenError::BadSignature));
        }
        // A share outside one GPU is malformed even when signed.
        let mut body = Claims { compute_milli: 300, ..claims() }.sign(key);
        body.truncate(body.len() - MAC_LEN);
        let n = body.len();
        body[n - 2..].copy_from_slice(&1001u16.to_le_bytes());
        body.extend_from_slice(&sign_bytes(key, &body.clone()));
        assert!(matches!(Claims::verify(&body, key, 0), Err(TokenError::Malformed(_))));
    }

    #[test]
    fn a_client_key_round_trips_with_every_other_field_and_is_signed() {
        let key = b"0123456789abcdef0123456789abcdef";
        for (pkey, share) in [(None, 0), (Some(0x8003), 0), (None, 250), (Some(0x8004), 1000)] {
            let c = Claims { pkey, compute_milli: share, client_key: Some([0x5a; 32]), ..claims() };
            let t = c.sign(key);
            assert_eq!(t[0], VERSION_BOUND);
            assert_eq!(Claims::verify(&t, key, 0), Ok(c.clone()));
            // Swapping in another key breaks the signature.
            let mut forged = t.clone();
            let at = t.len() - MAC_LEN - 1;
            forged[at] ^= 0x01;
            assert_eq!(Claims::verify(&forged, key, 0), Err(TokenError::BadSignature));
            // Cut off the key and re-signed: malformed, not a bearer token.
            let mut short = t[..t.len() - MAC_LEN - 32].to_vec();
            short.extend_from_slice(&sign_bytes(key, &short));
            assert!(matches!(Claims::verify(&short, key, 0), Err(TokenError::Malformed(_))));
        }
        // Unbound claims keep the older versions byte for byte.
        assert_eq!(claims().sign(key)[0], VERSION);
    }
}
