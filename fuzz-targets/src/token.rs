//! Tokens, keys, credentials and login proofs, decoded by the code that
//! reads them off the wire or from files: the server's admission of a
//! lease token (`server/src/lease.rs`), `Claims` decoding and verification
//! (`protocol/src/token.rs`), key files, credential files
//! (`broker-client/src/credential.rs`) and the broker's login check
//! (`pool-broker/src/identity.rs`), and a snapshot stream's request and
//! sealed records (`protocol/src/snapshot_stream.rs`).
//!
//! Input: a token, a key file or a credential file; each reader gets it.
//! A decodable token is also signed again with the test key, so the checks
//! past the signature (deadline, GPUs) run too.

use std::collections::HashMap;

use rgpu_broker_client::credential::Credential;
use rgpu_pool_broker::identity::Credentials;
use rgpu_protocol::auth;
use rgpu_protocol::token::{self, Claims};
use rgpu_server::lease::{Leases, Possession};

/// The key the fuzz servers hold (tokens and credentials).
pub const KEY: &[u8] = b"rgpu-fuzz-key-0123456789abcdef";
/// "Now" for deadlines and serials: 2026-01-01.
pub const NOW_MS: u64 = 1_767_225_600_000;
/// The nonce the fuzz broker drew.
pub const NONCE: &[u8] = &[7; 32];
/// The one GPU the fuzz server has.
const GPU: [u8; 16] = [0x42; 16];

pub fn run(data: &[u8]) {
    let claims = Claims::decode_unverified(data);
    let verified = Claims::verify(data, KEY, NOW_MS);
    if let Ok(v) = &verified {
        assert_eq!(
            Ok(v),
            claims.as_ref(),
            "a verified token decodes to the same claims"
        );
    }
    admit(data);
    snapshot_stream(data);
    if let Ok(c) = claims {
        // Past the signature: the claims, signed with the key.
        let signed = c.sign(KEY);
        let back = Claims::verify(&signed, KEY, NOW_MS);
        if c.deadline_ms > NOW_MS {
            assert_eq!(
                back.as_ref(),
                Ok(&c),
                "a signed token verifies to its claims"
            );
        } else {
            assert!(back.is_err(), "an expired token is refused");
        }
        admit(&signed);
    }
    let _ = token::parse_key(data);
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = token::from_hex(text);
        let _ = rgpu_protocol::scope::Scope::parse(text);
        let _ = auth::Role::parse(text);
        let _ = auth::valid_tenant(text);
        if let Ok(cred) = Credential::parse(text) {
            let _ = cred.to_text();
            // The broker accepts the credential's proof exactly when its
            // secret is the one the broker derives.
            let genuine = auth::credential_secret(KEY, &cred.tenant, cred.role, cred.serial);
            let ok = login(
                NONCE,
                &cred.tenant,
                cred.role.name(),
                cred.serial,
                &cred.proof(NONCE),
            );
            let genuine_proof = token::sign_bytes(
                &genuine,
                &auth::login_message(NONCE, &cred.tenant, cred.role, cred.serial),
            );
            if cred.serial <= NOW_MS {
                assert_eq!(
                    ok,
                    cred.proof(NONCE) == genuine_proof,
                    "login accepts exactly the genuine credentials"
                );
            }
        }
    }
}

/// A snapshot stream's request as the server reads it, then the rest as
/// the records that follow: a request that decodes encodes back to the
/// same bytes, and no record opens that the key did not seal.
pub fn snapshot_stream(data: &[u8]) {
    use rgpu_protocol::snapshot_stream::{Opener, Request, Way, RECORD_HEAD, RECORD_TAG, REQUEST_HEAD};
    let mut rest = data;
    if data.len() >= REQUEST_HEAD {
        let head = [data[0], data[1]];
        if let Ok(n) = Request::rest_len(head) {
            if data.len() >= REQUEST_HEAD + n {
                if let Ok(r) = Request::decode(head, &data[REQUEST_HEAD..REQUEST_HEAD + n]) {
                    assert_eq!(r.encode(), &data[..REQUEST_HEAD + n], "a request decodes to what encodes it");
                    let _ = r.verify(KEY, NONCE);
                }
                rest = &data[REQUEST_HEAD + n..];
            }
        }
    }
    let nonce = [7u8; 32];
    for way in [Way::Off, Way::Onto] {
        let mut o = Opener::new(KEY, &nonce, way, "fuzz.snap", 0);
        let mut at = rest;
        while at.len() >= RECORD_HEAD + RECORD_TAG {
            let head: [u8; RECORD_HEAD] = at[..RECORD_HEAD].try_into().unwrap();
            let Ok(n) = Opener::record_len(head) else { break };
            let tag: [u8; RECORD_TAG] = at[RECORD_HEAD..RECORD_HEAD + RECORD_TAG].try_into().unwrap();
            if n == 0 {
                assert!(Opener::new(KEY, &nonce, way, "fuzz.snap", 0).end(&tag).is_err(), "a forged end record opened");
                break;
            }
            let body = &at[RECORD_HEAD + RECORD_TAG..];
            if body.len() < n {
                break;
            }
            let mut b = body[..n].to_vec();
            assert!(o.open(&mut b, &tag).is_err(), "a forged record opened");
            at = &body[n..];
        }
    }
}

/// The server's admission of a lease token (`openSession`).
pub fn admit(token: &[u8]) {
    let leases = Leases::new(Some(KEY.to_vec()), vec![(GPU, 0)]);
    let _ = leases.admit(token, NOW_MS, None);
    // A bound token's proof check runs on whatever the input holds.
    let possession = Possession { nonce: &[7; 32], fresh: true, channel: Some([9; 32]), proof: token };
    let _ = leases.admit(token, NOW_MS, Some(&possession));
}

/// The broker's check of a login; whether it was accepted.
pub fn login(nonce: &[u8], tenant: &str, role: &str, serial: u64, proof: &[u8]) -> bool {
    let creds = Credentials::new(KEY.to_vec(), HashMap::new());
    creds
        .login(nonce, tenant, role, serial, proof, NOW_MS)
        .is_ok()
}
