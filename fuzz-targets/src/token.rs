//! Tokens, keys, credentials and login proofs, decoded by the code that
//! reads them off the wire or from files: the server's admission of a
//! lease token (`server/src/lease.rs`), `Claims` decoding and verification
//! (`protocol/src/token.rs`), key files, credential files
//! (`broker-client/src/credential.rs`) and the broker's login check
//! (`pool-broker/src/identity.rs`).
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
