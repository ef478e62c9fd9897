//! Who is calling: tenant credentials checked against the broker's
//! credential key, and their revocations. A credential is (tenant, role,
//! serial, secret), its secret derived from the key (see
//! `rgpu_protocol::auth`), so the broker keeps no list of credentials;
//! rotating one is issuing a newer serial and revoking the older ones,
//! which is persisted (the store's `revoked` table).

use std::collections::HashMap;
use std::sync::Mutex;

use rgpu_protocol::auth::{self, Role};
use rgpu_protocol::token::verify_bytes;

use crate::inventory::Millis;
use crate::state::BrokerError;

/// How far a credential's serial (its issue time) may be ahead of the
/// broker's clock.
pub const SKEW_MS: u64 = 5 * 60_000;

/// A logged-in tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub tenant: String,
    pub role: Role,
    pub serial: u64,
}

impl Identity {
    /// How the audit log names it.
    pub fn actor(&self) -> String {
        format!("{}/{}", self.tenant, self.role.name())
    }
}

pub struct Credentials {
    key: Vec<u8>,
    /// Tenant -> the lowest serial still accepted.
    revoked: Mutex<HashMap<String, u64>>,
}

impl Credentials {
    pub fn new(key: Vec<u8>, revoked: HashMap<String, u64>) -> Credentials {
        Credentials { key, revoked: Mutex::new(revoked) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, u64>> {
        self.revoked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks a login: `proof` over this connection's `nonce` under the
    /// secret of (tenant, role, serial), not revoked.
    pub fn login(&self, nonce: &[u8], tenant: &str, role: &str, serial: u64, proof: &[u8], now: Millis) -> Result<Identity, BrokerError> {
        if !auth::valid_tenant(tenant) {
            return Err(BrokerError::Auth("a tenant name is 1 to 64 of A-Z a-z 0-9 . _ -".into()));
        }
        let role = Role::parse(role).ok_or_else(|| BrokerError::Auth(format!("unknown role {role:?}")))?;
        if serial > now.saturating_add(SKEW_MS) {
            return Err(BrokerError::Auth("the credential's serial (its issue time) is in the future".into()));
        }
        let secret = auth::credential_secret(&self.key, tenant, role, serial);
        if !verify_bytes(&secret, &auth::login_message(nonce, tenant, role, serial), proof) {
            return Err(BrokerError::Auth(format!(
                "login as {tenant}/{} refused: the credential was not issued with this broker's key",
                role.name()
            )));
        }
        let id = Identity { tenant: tenant.to_string(), role, serial };
        self.check(&id)?;
        Ok(id)
    }

    /// Refuses an identity whose credential was revoked since it logged in.
    pub fn check(&self, id: &Identity) -> Result<(), BrokerError> {
        match self.lock().get(&id.tenant) {
            Some(&before) if id.serial < before => Err(BrokerError::Auth(format!(
                "the credential of {} (serial {}) was revoked; ask the operator for a new one",
                id.actor(),
                id.serial
            ))),
            _ => Ok(()),
        }
    }

    /// Takes the revocations a newly elected broker read from the store
    /// (every broker of a pool revokes through the same store).
    pub fn replace(&self, revoked: HashMap<String, u64>) {
        *self.lock() = revoked;
    }

    /// Revokes the credentials of `tenant` issued before `before` (never
    /// lowering an earlier revocation); returns the serial now required.
    pub fn revoke(&self, tenant: &str, before: u64) -> u64 {
        let mut r = self.lock();
        let v = r.entry(tenant.to_string()).or_insert(0);
        *v = (*v).max(before);
        *v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rgpu_protocol::token::sign_bytes;

    fn proof(key: &[u8], nonce: &[u8], tenant: &str, role: Role, serial: u64) -> Vec<u8> {
        let secret = auth::credential_secret(key, tenant, role, serial);
        sign_bytes(&secret, &auth::login_message(nonce, tenant, role, serial))
    }

    #[test]
    fn a_login_proves_the_credential_over_the_nonce() {
        let c = Credentials::new(b"credential key..".to_vec(), HashMap::new());
        let (n, now) = ([9u8; 32], 1_000_000);
        let p = proof(b"credential key..", &n, "alice", Role::User, 500);
        let id = c.login(&n, "alice", "user", 500, &p, now).unwrap();
        assert_eq!((id.tenant.as_str(), id.role), ("alice", Role::User));
        assert!(c.login(&[8u8; 32], "alice", "user", 500, &p, now).is_err(), "another nonce");
        assert!(c.login(&n, "bob", "user", 500, &p, now).is_err(), "another tenant");
        assert!(c.login(&n, "alice", "admin", 500, &p, now).is_err(), "another role");
        assert!(c.login(&n, "alice", "user", 501, &p, now).is_err(), "another serial");
        let forged = proof(b"another key.....", &n, "alice", Role::User, 500);
        assert!(c.login(&n, "alice", "user", 500, &forged, now).is_err());
        let future = now + SKEW_MS + 1;
        let p2 = proof(b"credential key..", &n, "alice", Role::User, future);
        assert!(c.login(&n, "alice", "user", future, &p2, now).is_err(), "issued in the future");
        // Revocation: older serials are refused, also for a session open already.
        assert_eq!(c.revoke("alice", 600), 600);
        assert_eq!(c.revoke("alice", 100), 600, "never lowered");
        assert!(c.check(&id).is_err());
        assert!(c.login(&n, "alice", "user", 500, &p, now).is_err());
        let p3 = proof(b"credential key..", &n, "alice", Role::User, 600);
        assert!(c.login(&n, "alice", "user", 600, &p3, now).is_ok());
    }
}
