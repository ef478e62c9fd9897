//! Throwaway certificates: a CA and server certificates it signs, made with
//! rcgen. `rgpu demo` makes a fresh set in its state directory at each run,
//! tests make them in memory. Operators issue theirs with their own PKI
//! (docs/security.md, "Certificates").

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};

use crate::TlsError;

/// A CA that can sign server certificates.
pub struct Authority {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
}

/// A certificate and its key, PEM.
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

fn err(e: rcgen::Error) -> TlsError {
    TlsError::Config(format!("cannot make a certificate: {e}"))
}

impl Authority {
    /// A new CA named `name`, with a fresh key.
    pub fn new(name: &str) -> Result<Authority, TlsError> {
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().map_err(err)?;
        let cert = params.self_signed(&key).map_err(err)?;
        Ok(Authority { issuer: Issuer::new(params, key), cert_pem: cert.pem() })
    }

    /// The CA's certificate: what clients are given to trust.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A server certificate for `names` (host names, or IP addresses,
    /// which become IP subject alternative names).
    pub fn issue(&self, names: &[&str]) -> Result<Issued, TlsError> {
        let mut params = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).map_err(err)?;
        params.distinguished_name.push(DnType::CommonName, names.first().copied().unwrap_or("rgpu"));
        let key = KeyPair::generate().map_err(err)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(err)?;
        Ok(Issued { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
    }
}

/// The files [`write_throwaway`] writes.
#[derive(Debug, Clone)]
pub struct Files {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Writes a fresh CA (`ca.pem`) and one certificate for `names`
/// (`server.pem`, `server.key`, the key readable by its owner only) into
/// `dir`. The CA's own key is not kept: nothing else can be signed with it.
pub fn write_throwaway(dir: &Path, names: &[&str]) -> Result<Files, TlsError> {
    let ca = Authority::new("rgpu throwaway CA")?;
    let issued = ca.issue(names)?;
    let files = Files { ca: dir.join("ca.pem"), cert: dir.join("server.pem"), key: dir.join("server.key") };
    let write = |p: &Path, text: &str, private: bool| -> Result<(), TlsError> {
        let fail = |e: std::io::Error| TlsError::File { what: "certificate file", path: p.to_path_buf(), why: e.to_string() };
        std::fs::create_dir_all(dir).map_err(fail)?;
        let _ = std::fs::remove_file(p);
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create_new(true);
        #[cfg(unix)]
        if private {
            use std::os::unix::fs::OpenOptionsExt;
            o.mode(0o600);
        }
        let _ = private;
        use std::io::Write;
        o.open(p).and_then(|mut f| f.write_all(text.as_bytes())).map_err(fail)
    };
    write(&files.ca, ca.cert_pem(), false)?;
    write(&files.cert, &issued.cert_pem, false)?;
    write(&files.key, &issued.key_pem, true)?;
    Ok(files)
}
