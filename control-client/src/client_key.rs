//! The client key file: the Ed25519 key a host's lease tokens are bound to
//! (`rgpu_protocol::binding`). `rgpu lease` and `rgpu run` make it on first
//! use; the shim signs with it when it opens a session on a bound token.
//!
//! Where: `RGPU_CLIENT_KEY`, else `$XDG_CONFIG_HOME/rgpu/client.key`, else
//! `~/.config/rgpu/client.key`. The file holds the key pair's PKCS#8 in hex
//! and must be readable by its owner alone, as ssh insists for its keys:
//! whoever reads it can use the host's leases.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rgpu_protocol::binding::ClientKey;
use thiserror::Error;

pub const ENV: &str = "RGPU_CLIENT_KEY";

#[derive(Debug, Error)]
pub enum KeyFileError {
    #[error("no client key file: set {ENV}, or HOME for ~/.config/rgpu/client.key")]
    NoPath,
    #[error("client key file {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("client key file {path} is readable by others (mode {mode:o}): `chmod 600 {path}`, and take new leases if others may have read it")]
    Exposed { path: PathBuf, mode: u32 },
    #[error("client key file {path} is not an rgpu client key: {reason}")]
    Bad { path: PathBuf, reason: String },
}

/// The key file's path as the environment says.
pub fn path() -> Result<PathBuf, KeyFileError> {
    if let Some(p) = std::env::var_os(ENV).filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let config = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").filter(|p| !p.is_empty()).map(|h| PathBuf::from(h).join(".config")))
        .ok_or(KeyFileError::NoPath)?;
    Ok(config.join("rgpu").join("client.key"))
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> KeyFileError + '_ {
    move |source| KeyFileError::Io { path: path.to_path_buf(), source }
}

/// Reads the key at `path`.
pub fn load(path: &Path) -> Result<ClientKey, KeyFileError> {
    let meta = std::fs::metadata(path).map_err(io(path))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(KeyFileError::Exposed { path: path.to_path_buf(), mode });
    }
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    let der = rgpu_protocol::token::from_hex(&text)
        .ok_or_else(|| KeyFileError::Bad { path: path.to_path_buf(), reason: "not hex".into() })?;
    ClientKey::from_pkcs8(&der).map_err(|e| KeyFileError::Bad { path: path.to_path_buf(), reason: e.to_string() })
}

/// Reads the key at `path`, making one first if there is none. Two
/// processes making it at once end up with the same key: each writes its
/// own under a private name and links it into place, and the one that
/// loses reads the winner's.
pub fn load_or_create(path: &Path) -> Result<ClientKey, KeyFileError> {
    match load(path) {
        Err(KeyFileError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
        r => return r,
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(io(dir))?;
    }
    let key = ClientKey::generate().map_err(|e| KeyFileError::Bad { path: path.to_path_buf(), reason: e.to_string() })?;
    // A name no other maker uses, threads of this process included.
    static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.{}.tmp", std::process::id(), MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
    let tmp = PathBuf::from(tmp);
    let written = (|| {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
        writeln!(f, "{}", rgpu_protocol::token::to_hex(key.pkcs8()))?;
        f.sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(KeyFileError::Io { path: tmp, source: e });
    }
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => {
            tracing::info!(path = %path.display(), "made a client key; lease tokens of this host are bound to it");
            Ok(key)
        }
        // Another maker linked its key first: use that one.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => load(path),
        Err(e) => Err(KeyFileError::Io { path: path.to_path_buf(), source: e }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rgpu-client-key-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_key_is_made_once_and_read_back() {
        let d = dir("once");
        let p = d.join("rgpu").join("client.key");
        let a = load_or_create(&p).unwrap();
        let b = load_or_create(&p).unwrap();
        assert_eq!(a.public(), b.public(), "the second call reads the first's key");
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::metadata(p.parent().unwrap()).unwrap().permissions().mode() & 0o777, 0o700);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn racing_makers_agree_on_one_key() {
        let d = dir("race");
        let p = d.join("client.key");
        let keys: Vec<[u8; 32]> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8).map(|_| s.spawn(|| load_or_create(&p).unwrap().public())).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(keys.iter().all(|k| *k == keys[0]), "one key for all: {keys:?}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_key_others_can_read_or_garbage_is_refused() {
        let d = dir("refused");
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("client.key");
        load_or_create(&p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(load(&p), Err(KeyFileError::Exposed { mode: 0o644, .. })));
        assert!(matches!(load_or_create(&p), Err(KeyFileError::Exposed { .. })), "never silently replaced");
        std::fs::write(&p, "zz").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(matches!(load(&p), Err(KeyFileError::Bad { .. })));
        let _ = std::fs::remove_dir_all(&d);
    }
}
