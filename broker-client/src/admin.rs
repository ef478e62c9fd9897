//! The credential of an operator's request (drain, undrain): an HMAC under
//! the broker's admin key, or its token key, which GPU servers hold, of the
//! operation, the server, the deadline and the time it was issued
//! (`AdminAuth` in broker.capnp). The broker refuses one issued more than a
//! few minutes from its clock, or seen before, so a proof is made fresh for
//! each request.

use rgpu_protocol::broker_capnp::admin_auth;
use rgpu_protocol::token::{admin_message, sign_bytes};

/// The requests that need an [`AdminAuth`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminOp {
    Drain,
    Undrain,
}

impl AdminOp {
    /// The name the proof signs.
    pub fn name(self) -> &'static str {
        match self {
            AdminOp::Drain => "drain",
            AdminOp::Undrain => "undrain",
        }
    }
}

/// `issuedMs` and `proof` of one request; [`AdminAuth::default`] (0, empty)
/// is what a client without a key sends, which only a broker with no keys
/// accepts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdminAuth {
    pub issued_ms: u64,
    pub proof: Vec<u8>,
}

impl AdminAuth {
    /// Signs `op` on `server` with `deadline_ms` (unix ms, 0 for none;
    /// always 0 for undrain), issued at `now_ms`.
    pub fn sign(key: &[u8], op: AdminOp, server: &str, deadline_ms: u64, now_ms: u64) -> AdminAuth {
        let proof = sign_bytes(key, &admin_message(op.name(), server, deadline_ms, now_ms));
        AdminAuth { issued_ms: now_ms, proof }
    }

    /// [`AdminAuth::sign`] when there is a key, else the empty credential.
    pub fn with_key(key: Option<&[u8]>, op: AdminOp, server: &str, deadline_ms: u64, now_ms: u64) -> AdminAuth {
        key.map_or_else(AdminAuth::default, |k| AdminAuth::sign(k, op, server, deadline_ms, now_ms))
    }

    pub fn write(&self, mut b: admin_auth::Builder<'_>) {
        b.set_issued_ms(self.issued_ms);
        b.set_proof(&self.proof);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rgpu_protocol::token::verify_bytes;

    #[test]
    fn the_proof_covers_op_server_deadline_and_issue_time() {
        let key = b"admin key";
        let a = AdminAuth::sign(key, AdminOp::Drain, "gpu1:7767", 5000, 1234);
        assert_eq!(a.issued_ms, 1234);
        assert!(verify_bytes(key, &admin_message("drain", "gpu1:7767", 5000, 1234), &a.proof));
        for other in [
            admin_message("undrain", "gpu1:7767", 5000, 1234),
            admin_message("drain", "gpu2:7767", 5000, 1234),
            admin_message("drain", "gpu1:7767", 5001, 1234),
            admin_message("drain", "gpu1:7767", 5000, 1235),
        ] {
            assert!(!verify_bytes(key, &other, &a.proof));
        }
        assert!(!verify_bytes(b"another key", &admin_message("drain", "gpu1:7767", 5000, 1234), &a.proof));
    }

    #[test]
    fn without_a_key_the_credential_is_empty() {
        assert_eq!(AdminAuth::with_key(None, AdminOp::Undrain, "s", 0, 99), AdminAuth::default());
        let signed = AdminAuth::with_key(Some(b"k"), AdminOp::Undrain, "s", 0, 99);
        assert_eq!(signed, AdminAuth::sign(b"k", AdminOp::Undrain, "s", 0, 99));
    }

    #[test]
    fn written_into_the_request() {
        let mut m = capnp::message::Builder::new_default();
        let a = AdminAuth::sign(b"k", AdminOp::Drain, "s", 1, 2);
        a.write(m.init_root::<admin_auth::Builder>());
        let r = m.get_root_as_reader::<admin_auth::Reader>().unwrap();
        assert_eq!((r.get_issued_ms(), r.get_proof().unwrap()), (2, &a.proof[..]));
    }
}
