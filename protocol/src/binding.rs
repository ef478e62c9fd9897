//! Lease tokens bound to a client key: the proof of possession.
//!
//! A lease request may carry the public half of an Ed25519 key the client
//! keeps on its host; the broker then writes that key into the token it
//! signs ([`crate::token::Claims::client_key`]). A GPU server admits a
//! session on such a token only with a signature, under that key, over a
//! nonce the server handed out on this connection (one use) and the
//! connection's TLS exporter value. So a token copied off a host (its
//! environment, a log, `rgpu lease` output) opens nothing elsewhere, a
//! signature seen once cannot be used again, and one made for a connection
//! to one server cannot be relayed to another.
//!
//! Sans-I/O: keys are bytes in (PKCS#8 v2, as ring writes them); files are
//! the caller's.

use ring::rand::SystemRandom;
use ring::signature::{self, Ed25519KeyPair, KeyPair};
use sha2::{Digest, Sha256};
use thiserror::Error;

pub const PUBLIC_KEY_LEN: usize = 32;
pub const PROOF_LEN: usize = 64;
/// Bytes of TLS exporter output bound into a proof.
pub const CHANNEL_BINDING_LEN: usize = 32;

const DOMAIN: &[u8] = b"rgpu token binding v1\0";

#[derive(Debug, Error, PartialEq, Eq)]
pub enum BindingError {
    #[error("the client key is not an Ed25519 PKCS#8 key: {0}")]
    BadKey(String),
    #[error("no randomness to make a key")]
    NoRandomness,
}

/// A client's key pair.
pub struct ClientKey {
    pair: Ed25519KeyPair,
    pkcs8: Vec<u8>,
}

impl std::fmt::Debug for ClientKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the private half, not even in a debug log.
        write!(f, "ClientKey({})", fingerprint(&self.public()))
    }
}

impl ClientKey {
    pub fn generate() -> Result<ClientKey, BindingError> {
        let doc = Ed25519KeyPair::generate_pkcs8(&SystemRandom::new()).map_err(|_| BindingError::NoRandomness)?;
        ClientKey::from_pkcs8(doc.as_ref())
    }

    pub fn from_pkcs8(der: &[u8]) -> Result<ClientKey, BindingError> {
        let pair = Ed25519KeyPair::from_pkcs8_maybe_unchecked(der).map_err(|e| BindingError::BadKey(e.to_string()))?;
        Ok(ClientKey { pair, pkcs8: der.to_vec() })
    }

    /// The encoded key pair, for the client's key file.
    pub fn pkcs8(&self) -> &[u8] {
        &self.pkcs8
    }

    pub fn public(&self) -> [u8; PUBLIC_KEY_LEN] {
        let mut k = [0u8; PUBLIC_KEY_LEN];
        k.copy_from_slice(self.pair.public_key().as_ref());
        k
    }

    /// The proof for `token` over a server's `nonce` on a connection whose
    /// TLS exporter value is `channel` (None: plaintext).
    pub fn prove(&self, nonce: &[u8], channel: Option<&[u8; CHANNEL_BINDING_LEN]>, token: &[u8]) -> Vec<u8> {
        self.pair.sign(&message(nonce, channel, token)).as_ref().to_vec()
    }
}

/// Checks a proof made by [`ClientKey::prove`].
pub fn verify(
    public: &[u8; PUBLIC_KEY_LEN],
    nonce: &[u8],
    channel: Option<&[u8; CHANNEL_BINDING_LEN]>,
    token: &[u8],
    proof: &[u8],
) -> bool {
    proof.len() == PROOF_LEN
        && signature::UnparsedPublicKey::new(&signature::ED25519, public)
            .verify(&message(nonce, channel, token), proof)
            .is_ok()
}

/// A short name for a public key, for messages and listings: the first 8
/// bytes of its SHA-256, in hex.
pub fn fingerprint(public: &[u8; PUBLIC_KEY_LEN]) -> String {
    crate::token::to_hex(&Sha256::digest(public)[..8])
}

fn message(nonce: &[u8], channel: Option<&[u8; CHANNEL_BINDING_LEN]>, token: &[u8]) -> Vec<u8> {
    let nonce = &nonce[..nonce.len().min(255)];
    let mut m = Vec::with_capacity(DOMAIN.len() + 1 + nonce.len() + 1 + CHANNEL_BINDING_LEN + 32);
    m.extend_from_slice(DOMAIN);
    m.push(nonce.len() as u8);
    m.extend_from_slice(nonce);
    match channel {
        Some(c) => {
            m.push(1);
            m.extend_from_slice(c);
        }
        None => m.push(0),
    }
    m.extend_from_slice(&Sha256::digest(token));
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_verifies_only_for_its_key_nonce_channel_and_token() {
        let k = ClientKey::generate().unwrap();
        let other = ClientKey::generate().unwrap();
        let (nonce, chan, token) = ([7u8; 32], [9u8; 32], b"token bytes".to_vec());
        let p = k.prove(&nonce, Some(&chan), &token);
        assert_eq!(p.len(), PROOF_LEN);
        assert!(verify(&k.public(), &nonce, Some(&chan), &token, &p));
        assert!(!verify(&other.public(), &nonce, Some(&chan), &token, &p), "another key");
        assert!(!verify(&k.public(), &[8u8; 32], Some(&chan), &token, &p), "another nonce");
        assert!(!verify(&k.public(), &nonce, Some(&[1u8; 32]), &token, &p), "another connection");
        assert!(!verify(&k.public(), &nonce, None, &token, &p), "the channel dropped");
        assert!(!verify(&k.public(), &nonce, Some(&chan), b"token bytez", &p), "another token");
        assert!(!verify(&k.public(), &nonce, Some(&chan), &token, &p[..63]), "cut short");
        assert!(!verify(&k.public(), &nonce, Some(&chan), &token, &[]), "none");
        // Plaintext: no channel on either side.
        let q = k.prove(&nonce, None, &token);
        assert!(verify(&k.public(), &nonce, None, &token, &q));
    }

    #[test]
    fn a_key_survives_its_encoding_and_garbage_is_refused() {
        let k = ClientKey::generate().unwrap();
        let back = ClientKey::from_pkcs8(k.pkcs8()).unwrap();
        assert_eq!(back.public(), k.public());
        assert!(matches!(ClientKey::from_pkcs8(b"not a key"), Err(BindingError::BadKey(_))));
        assert!(!format!("{k:?}").contains(&crate::token::to_hex(k.pkcs8())));
        assert_eq!(fingerprint(&k.public()).len(), 16);
    }
}
