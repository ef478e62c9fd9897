//! TLS for the cli's connections and for the programs it starts: the
//! client settings every connecting command shares ([`TlsArgs`]), and the
//! throwaway CA and server certificate `demo` and `bench` start their own
//! daemons with ([`Pki`]).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rgpu_tls::client::{CA_ENV, PLAINTEXT_ENV, SERVER_NAME_ENV};
use rgpu_tls::ClientSecurity;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// The CA file (PEM) that signed the servers' and the broker's
    /// certificates; with it every connection is TLS, and so are the
    /// shim's in the programs `rgpu run` starts.
    #[arg(long, env = CA_ENV, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// The name to check the certificates against instead of the host part
    /// of each address.
    #[arg(long, env = SERVER_NAME_ENV, value_name = "NAME")]
    pub tls_server_name: Option<String>,
    /// Talk to servers and the broker in clear: only on a trusted network.
    #[arg(long, env = PLAINTEXT_ENV, action = clap::ArgAction::SetTrue,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub plaintext: bool,
}

impl TlsArgs {
    pub fn security(&self) -> Result<ClientSecurity> {
        Ok(ClientSecurity::new(self.tls_ca.as_deref(), self.tls_server_name.clone(), self.plaintext)?)
    }

    /// The same settings as the shim reads them, for a program started
    /// from here (or this process's own shim): every variable is set or
    /// cleared, so nothing inherited contradicts them.
    pub fn env(&self) -> Result<Vec<(String, Option<String>)>> {
        let ca = match &self.tls_ca {
            Some(p) => Some(
                std::path::absolute(p).with_context(|| format!("--tls-ca {}", p.display()))?.display().to_string(),
            ),
            None => None,
        };
        Ok(vec![
            (CA_ENV.into(), ca),
            (SERVER_NAME_ENV.into(), self.tls_server_name.clone()),
            (PLAINTEXT_ENV.into(), self.plaintext.then(|| "1".to_string())),
        ])
    }

    /// Sets [`TlsArgs::env`] in this process, for the shim it loads. Call
    /// before any other thread could read the environment.
    pub fn export(&self) -> Result<()> {
        for (k, v) in self.env()? {
            match v {
                Some(v) => std::env::set_var(k, v),
                None => std::env::remove_var(k),
            }
        }
        Ok(())
    }

    /// Client settings that trust `pki`'s CA.
    pub fn trusting(pki: &Pki) -> TlsArgs {
        TlsArgs { tls_ca: Some(pki.files.ca.clone()), tls_server_name: None, plaintext: false }
    }
}

/// A throwaway CA and one certificate for loopback (127.0.0.1, localhost)
/// in a folder of its own, removed when dropped: the CA's key is never
/// written, so nothing else can be signed with it.
pub struct Pki {
    pub dir: PathBuf,
    pub files: rgpu_tls::pki::Files,
}

impl Pki {
    pub fn throwaway() -> Result<Pki> {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let dir = std::env::temp_dir().join(format!("rgpu-tls-{}-{nanos:08x}", std::process::id()));
        let files = rgpu_tls::pki::write_throwaway(&dir, &["127.0.0.1", "localhost"])
            .with_context(|| format!("cannot write throwaway certificates in {}", dir.display()))?;
        Ok(Pki { dir, files })
    }

    /// The flags of a daemon serving with this certificate.
    pub fn serve_args(&self) -> Vec<String> {
        let p = |p: &Path| p.display().to_string();
        vec!["--tls-cert".into(), p(&self.files.cert), "--tls-key".into(), p(&self.files.key)]
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
