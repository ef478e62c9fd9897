//! A tenant's credential for the broker: (tenant, role, serial, secret),
//! issued by whoever holds the broker's credential key (its admin key) and
//! kept in a private file. The broker derives the secret again from the
//! other three (`rgpu_protocol::auth`), so issuing needs no broker; logging
//! in proves the secret over the connection's fresh challenge, so nothing
//! that crosses the network can be replayed to log in again.
//!
//! The file, one `key = value` a line (`#` starts a comment):
//!
//! ```text
//! tenant = alice
//! role = user
//! serial = 1764590000000
//! secret = 64 hex digits
//! ```

use std::path::{Path, PathBuf};

use rgpu_protocol::auth::{self, Role};
use rgpu_protocol::broker_capnp::{broker, session};
use rgpu_protocol::token::{from_hex, sign_bytes, to_hex};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum CredentialError {
    #[error("credential file {path}: {reason}")]
    File { path: String, reason: String },
    #[error("{0:?} is not a tenant name: 1 to 64 of A-Z a-z 0-9 . _ -")]
    Tenant(String),
    #[error("credential: {0}")]
    Malformed(String),
}

#[derive(Clone, PartialEq, Eq)]
pub struct Credential {
    pub tenant: String,
    pub role: Role,
    /// Its issue time, unix ms: revoking refuses the older serials.
    pub serial: u64,
    secret: Vec<u8>,
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret: this ends up in logs.
        write!(f, "Credential({}/{}, serial {})", self.tenant, self.role.name(), self.serial)
    }
}

impl Credential {
    /// The credential of (tenant, role, serial) under the broker's
    /// credential `key`.
    pub fn issue(key: &[u8], tenant: &str, role: Role, serial: u64) -> Result<Credential, CredentialError> {
        if !auth::valid_tenant(tenant) {
            return Err(CredentialError::Tenant(tenant.to_string()));
        }
        Ok(Credential { tenant: tenant.into(), role, serial, secret: auth::credential_secret(key, tenant, role, serial) })
    }

    /// What a login sends as its proof over `nonce`.
    pub fn proof(&self, nonce: &[u8]) -> Vec<u8> {
        sign_bytes(&self.secret, &auth::login_message(nonce, &self.tenant, self.role, self.serial))
    }

    pub fn to_text(&self) -> String {
        format!(
            "# rgpu broker credential: whoever holds this file is tenant {} with role {}. Keep it private.\n\
             tenant = {}\nrole = {}\nserial = {}\nsecret = {}\n",
            self.tenant,
            self.role.name(),
            self.tenant,
            self.role.name(),
            self.serial,
            to_hex(&self.secret)
        )
    }

    pub fn parse(text: &str) -> Result<Credential, CredentialError> {
        let bad = |m: &str| CredentialError::Malformed(m.to_string());
        let (mut tenant, mut role, mut serial, mut secret) = (None, None, None, None);
        for line in text.lines().take(64) {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (k, v) = line.split_once('=').ok_or_else(|| bad("a line is not `key = value`"))?;
            let v = v.trim().trim_matches('"');
            match k.trim() {
                "tenant" => tenant = Some(v.to_string()),
                "role" => role = Some(Role::parse(v).ok_or_else(|| bad("role is user, operator or admin"))?),
                "serial" => serial = Some(v.parse::<u64>().map_err(|_| bad("serial is a number"))?),
                "secret" => secret = Some(from_hex(v).filter(|s| s.len() == 32).ok_or_else(|| bad("secret is 64 hex digits"))?),
                other => return Err(CredentialError::Malformed(format!("unknown key {other:?}"))),
            }
        }
        let tenant = tenant.ok_or_else(|| bad("no tenant"))?;
        if !auth::valid_tenant(&tenant) {
            return Err(CredentialError::Tenant(tenant));
        }
        Ok(Credential {
            tenant,
            role: role.ok_or_else(|| bad("no role"))?,
            serial: serial.ok_or_else(|| bad("no serial"))?,
            secret: secret.ok_or_else(|| bad("no secret"))?,
        })
    }

    /// Reads a credential file; refuses one that others may read.
    pub fn load(path: &Path) -> Result<Credential, CredentialError> {
        use std::os::unix::fs::PermissionsExt;
        let err = |reason: String| CredentialError::File { path: path.display().to_string(), reason };
        let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
        if meta.permissions().mode() & 0o077 != 0 {
            return Err(err(format!("others may read it (mode {:o}): chmod 600 it", meta.permissions().mode() & 0o777)));
        }
        if meta.len() > 4096 {
            return Err(err("longer than a credential".into()));
        }
        let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
        Credential::parse(&text).map_err(|e| err(e.to_string()))
    }

    /// Writes a new file only this user may read (never over an existing one).
    pub fn write_new(&self, path: &Path) -> Result<(), CredentialError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let err = |e: std::io::Error| CredentialError::File { path: path.display().to_string(), reason: e.to_string() };
        if let Some(d) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(d).map_err(err)?;
        }
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path).map_err(err)?;
        f.write_all(self.to_text().as_bytes()).map_err(err)
    }

    /// Asks `broker` for a challenge and logs in over it: the session
    /// capability every call of this tenant goes through.
    pub async fn login(&self, broker: &broker::Client) -> Result<session::Client, capnp::Error> {
        let reply = broker.challenge_request().send().promise.await?;
        let nonce = reply.get()?.get_nonce()?.to_vec();
        let mut req = broker.login_request();
        {
            let mut p = req.get();
            p.set_nonce(&nonce);
            p.set_tenant(&self.tenant);
            p.set_role(self.role.name());
            p.set_serial(self.serial);
            p.set_proof(&self.proof(&nonce));
        }
        let reply = req.send().promise.await?;
        reply.get()?.get_session()
    }
}

/// Where `rgpu` looks for a credential when none is named:
/// `$XDG_CONFIG_HOME/rgpu/credential`, else `~/.config/rgpu/credential`.
pub fn default_path() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").filter(|v| !v.is_empty()).map(|h| PathBuf::from(h).join(".config")))?;
    Some(base.join("rgpu").join("credential"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_round_trips_and_others_may_not_read_it() {
        let c = Credential::issue(b"the admin key...", "alice", Role::Operator, 1234).unwrap();
        assert_eq!(Credential::parse(&c.to_text()).unwrap(), c);
        assert!(!format!("{c:?}").contains(&to_hex(&c.secret)), "Debug shows no secret");
        let dir = std::env::temp_dir().join(format!("rgpu-cred-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let p = dir.join("alice.cred");
        c.write_new(&p).unwrap();
        assert_eq!(Credential::load(&p).unwrap(), c);
        assert!(c.write_new(&p).is_err(), "never overwrites");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(Credential::load(&p).unwrap_err().to_string().contains("chmod 600"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn malformed_files_and_tenants_are_refused() {
        assert!(Credential::issue(b"k", "a:b", Role::User, 1).is_err());
        for bad in ["tenant = a\nrole = user\nserial = 1\n", "tenant = a\nrole = root\nserial = 1\nsecret = 00\n", "nonsense"] {
            assert!(Credential::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_proof_is_bound_to_the_nonce() {
        let c = Credential::issue(b"k", "a", Role::User, 1).unwrap();
        assert_ne!(c.proof(&[1; 32]), c.proof(&[2; 32]));
        let secret = auth::credential_secret(b"k", "a", Role::User, 1);
        assert_eq!(c.proof(&[1; 32]), sign_bytes(&secret, &auth::login_message(&[1; 32], "a", Role::User, 1)));
    }
}
