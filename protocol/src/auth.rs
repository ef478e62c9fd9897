//! What the broker's proofs sign (`broker.capnp`): a tenant credential's
//! secret, a login over the connection's challenge, a GPU server's
//! registration over it. Both ends build these bytes here, so they cannot
//! drift apart. Sans-I/O.
//!
//! A credential is (tenant, role, serial, secret) where serial is its issue
//! time in unix ms and secret = HMAC-SHA256(credential key,
//! [`credential_message`]): the broker keeps no list of credentials, it
//! derives the secret again, and revokes by serial (every credential of a
//! tenant issued before a time).

use crate::broker_capnp::server_info;
use crate::token::{sign_bytes, to_hex};

/// Bytes of the nonce `challenge` hands out.
pub const NONCE_LEN: usize = 32;
/// Longest tenant name.
pub const TENANT_MAX: usize = 64;

/// What a logged-in tenant may do (`Session` in broker.capnp); each role
/// may do what the ones before it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// Its own tenant's leases; the server inventory and status.
    User,
    /// Also: every lease listed, drain, undrain, the audit log.
    Operator,
    /// Also: revoke credentials, release any lease.
    Admin,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "user" => Some(Role::User),
            "operator" => Some(Role::Operator),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }
}

/// Tenant names are 1..=64 of `A-Za-z0-9._-`: no separator of the signed
/// messages can hide in one.
pub fn valid_tenant(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= TENANT_MAX
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// What a credential's secret is the HMAC of, under the broker's credential key.
pub fn credential_message(tenant: &str, role: Role, serial: u64) -> Vec<u8> {
    format!("rgpu-credential:v1:{tenant}:{}:{serial}", role.name()).into_bytes()
}

/// The secret of the credential (tenant, role, serial) under `key`.
pub fn credential_secret(key: &[u8], tenant: &str, role: Role, serial: u64) -> Vec<u8> {
    sign_bytes(key, &credential_message(tenant, role, serial))
}

/// What a login's proof is the HMAC of, under the credential's secret.
pub fn login_message(nonce: &[u8], tenant: &str, role: Role, serial: u64) -> Vec<u8> {
    format!("rgpu-login:v1:{}:{tenant}:{}:{serial}", to_hex(nonce), role.name()).into_bytes()
}

/// Longest snapshot name (`checkpoint`/`restore` in control.capnp).
pub const SNAPSHOT_NAME_MAX: usize = 128;

/// Snapshot names are 1..=128 of `A-Za-z0-9._-`, not starting with a dot:
/// a file name in the server's checkpoint directory, never a path.
pub fn valid_snapshot_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= SNAPSHOT_NAME_MAX
        && !name.starts_with('.')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// A GPU server's operator operation (control.capnp: `checkpoint`, `restore`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerOp {
    Checkpoint,
    Restore,
    /// The operator asks a server to move a session to another (`name`: the target's address).
    Migrate,
    /// A server hands a session to another (the target's nonce; session 0, no name).
    Intake,
    /// The operator lists a server's sessions (session 0, no name).
    ListSessions,
    /// The operator lists the snapshots a suspension of a lease wrote
    /// (session: the lease, no name).
    ListSuspended,
    /// The operator forwards a session that left in a checkpoint to where it
    /// was restored (`name`: that server's address).
    Forward,
    /// The operator marks a device failing (session: the device's ordinal; name: the fault's kind).
    InjectFault,
    /// The operator clears a device's injected fault (session: its ordinal, no name).
    ClearFault,
    /// The operator reads a piece of a snapshot (session: the offset; name:
    /// [`snapshot_read_name`]).
    ReadSnapshot,
    /// The operator writes a piece of a snapshot (session: the offset; name:
    /// [`snapshot_write_name`], which covers the bytes).
    WriteSnapshot,
    /// The operator opens a stream the server sends a snapshot down
    /// ([`crate::snapshot_stream`]; session: 0; name: the snapshot).
    SendSnapshot,
    /// The operator opens a stream that carries a snapshot onto the server
    /// (session: its size in bytes; name: the snapshot).
    ReceiveSnapshot,
}

/// Bytes one `readSnapshot` answer carries at most.
pub const SNAPSHOT_READ_MAX: u32 = 4 << 20;
/// Bytes one `writeSnapshot` carries at most: what fits in the GPU
/// server's largest control-plane message (64 KiB, which bounds what an
/// unauthenticated peer can make it allocate) with the rest of the call.
pub const SNAPSHOT_WRITE_MAX: u32 = 56 << 10;

/// What a `readSnapshot` proof names beside the offset: the snapshot and
/// the most bytes asked.
pub fn snapshot_read_name(name: &str, max_bytes: u32) -> String {
    format!("{name}:{max_bytes}")
}

/// What a `writeSnapshot` proof names beside the offset: the snapshot,
/// whether the piece is the last, and the SHA-256 of its bytes, so a proof
/// admits those bytes only.
pub fn snapshot_write_name(name: &str, last: bool, data: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, data);
    format!("{name}:{}:{}", u8::from(last), to_hex(digest.as_ref()))
}

/// What an operator operation's proof is the HMAC of, under the server's
/// admin key: the connection's nonce, the operation and what it names
/// (session 0 for a restore), so a proof cannot be replayed or redirected.
pub fn server_op_message(nonce: &[u8], op: ServerOp, session: u64, name: &str) -> Vec<u8> {
    let op = match op {
        ServerOp::Checkpoint => "checkpoint",
        ServerOp::Restore => "restore",
        ServerOp::Migrate => "migrate",
        ServerOp::Intake => "intake",
        ServerOp::ListSessions => "list-sessions",
        ServerOp::ListSuspended => "list-suspended",
        ServerOp::Forward => "forward",
        ServerOp::InjectFault => "inject-fault",
        ServerOp::ClearFault => "clear-fault",
        ServerOp::ReadSnapshot => "read-snapshot",
        ServerOp::WriteSnapshot => "write-snapshot",
        ServerOp::SendSnapshot => "send-snapshot",
        ServerOp::ReceiveSnapshot => "receive-snapshot",
    };
    format!("rgpu-server-op:v1:{}:{op}:{session:016x}:{name}", to_hex(nonce)).into_bytes()
}

/// What a registration's proof is the HMAC of, under the token key: the
/// nonce and every field of the server's inventory, each length-prefixed.
pub fn register_message(nonce: &[u8], s: server_info::Reader<'_>) -> capnp::Result<Vec<u8>> {
    let mut m = Canon(b"rgpu-register:v2:".to_vec());
    m.bytes(nonce);
    m.text(s.get_id()?.to_str()?);
    m.text(s.get_node()?.to_str()?);
    m.text(s.get_leaf()?.to_str()?);
    m.text(s.get_spine()?.to_str()?);
    let parts = s.get_partitions()?;
    m.u64(parts.len().into());
    for p in parts.iter() {
        m.text(p?.to_str()?);
    }
    let gpus = s.get_gpus()?;
    m.u64(gpus.len().into());
    for g in gpus.iter() {
        m.bytes(g.get_uuid()?);
        m.u64(g.get_ordinal().into());
        m.text(g.get_model()?.to_str()?);
        m.u64(g.get_memory());
        m.u64(g.get_sms().into());
        m.u64(g.get_healthy().into());
        // Covered when given, as the link bandwidth below.
        let why = g.get_health_reason()?.to_str()?;
        if !why.is_empty() {
            m.text(why);
        }
    }
    let transports = s.get_transports()?;
    m.u64(transports.len().into());
    for t in transports.iter() {
        m.text(t?.to_str()?);
    }
    // Covered when given, so a server that does not say signs the bytes
    // it signed before the field existed.
    if s.get_link_bandwidth() != 0 {
        m.u64(s.get_link_bandwidth());
    }
    Ok(m.0)
}

struct Canon(Vec<u8>);

impl Canon {
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u64(b.len() as u64);
        self.0.extend_from_slice(b);
    }
    fn text(&mut self, t: &str) {
        self.bytes(t.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_names_are_file_names_and_op_proofs_name_what_they_allow() {
        for ok in ["a", "job-1.snap", "A_b.C"] {
            assert!(valid_snapshot_name(ok), "{ok}");
        }
        for bad in ["", ".hidden", "..", "a/b", "../x", "a b", "x\0", &"n".repeat(SNAPSHOT_NAME_MAX + 1)] {
            assert!(!valid_snapshot_name(bad), "{bad:?}");
        }
        let m = |op, s, n: &str| server_op_message(&[1; NONCE_LEN], op, s, n);
        assert_ne!(m(ServerOp::Checkpoint, 1, "x"), m(ServerOp::Restore, 1, "x"));
        assert_ne!(m(ServerOp::Migrate, 1, "x"), m(ServerOp::Intake, 1, "x"));
        assert_ne!(m(ServerOp::Migrate, 1, "x"), m(ServerOp::Checkpoint, 1, "x"));
        assert_ne!(m(ServerOp::Checkpoint, 1, "x"), m(ServerOp::Checkpoint, 2, "x"));
        assert_ne!(m(ServerOp::Checkpoint, 1, "x"), m(ServerOp::Checkpoint, 1, "y"));
        assert_ne!(m(ServerOp::Checkpoint, 1, "x"), server_op_message(&[2; NONCE_LEN], ServerOp::Checkpoint, 1, "x"));
    }

    fn info(gpu_memory: u64, partition: &str) -> Vec<u8> {
        info_with_link(gpu_memory, partition, 0)
    }

    fn info_with_link(gpu_memory: u64, partition: &str, link: u64) -> Vec<u8> {
        let mut b = capnp::message::Builder::new_default();
        let mut s = b.init_root::<server_info::Builder>();
        s.set_id("gpu1:7767");
        s.set_link_bandwidth(link);
        s.reborrow().init_partitions(1).set(0, partition);
        let mut g = s.reborrow().init_gpus(1).get(0);
        g.set_uuid(&[7; 16]);
        g.set_memory(gpu_memory);
        register_message(&[1; NONCE_LEN], s.into_reader()).unwrap()
    }

    #[test]
    fn registration_covers_the_inventory() {
        assert_eq!(info(1 << 30, "a"), info(1 << 30, "a"));
        assert_ne!(info(1 << 30, "a"), info(2 << 30, "a"));
        assert_ne!(info(1 << 30, "a"), info(1 << 30, "b"));
        assert_ne!(info_with_link(1 << 30, "a", 1_250_000_000), info_with_link(1 << 30, "a", 2_500_000_000));
        assert_ne!(info_with_link(1 << 30, "a", 1_250_000_000), info(1 << 30, "a"));
    }

    #[test]
    fn messages_name_every_field_and_tenants_are_plain() {
        let m = login_message(&[0xab; 2], "alice", Role::Operator, 5);
        assert_eq!(m, b"rgpu-login:v1:abab:alice:operator:5");
        assert_ne!(credential_secret(b"k", "a", Role::User, 1), credential_secret(b"k", "a", Role::Admin, 1));
        assert_ne!(credential_secret(b"k", "a", Role::User, 1), credential_secret(b"k", "a", Role::User, 2));
        for bad in ["", "a:b", "a b", "é", &"x".repeat(65)] {
            assert!(!valid_tenant(bad), "{bad:?}");
        }
        assert!(valid_tenant("team-a.prod_1"));
        for r in [Role::User, Role::Operator, Role::Admin] {
            assert_eq!(Role::parse(r.name()), Some(r));
        }
        assert!(Role::User < Role::Operator && Role::Operator < Role::Admin);
    }
}
