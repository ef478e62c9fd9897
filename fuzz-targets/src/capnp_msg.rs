//! The control plane and the broker as capnp-rpc reads them: one message
//! off the stream, read with the limits the server's control plane
//! (`server/src/control.rs`) or the broker (`pool-broker/src/rpc/mod.rs`)
//! gives its `VatNetwork`, as an rpc `Message`; a call's parameters (and a
//! return's results) read as each method's struct of that plane, walked
//! whole (every field, as the generated `Debug` does), and the fields the
//! servers act on before any check passed to the same code they use: the
//! broker's login check and registration message, the lease request's
//! scope, the server's token admission.
//!
//! Input: one byte choosing the plane (even: control, odd: broker), then
//! the message in capnp's stream framing (segment table, segments).

use capnp::message::ReaderOptions;
use capnp::traits::HasTypeId;
use capnp::{any_pointer, serialize};
use capnp_rpc::rpc_capnp::{message, return_};
use rgpu_protocol::broker_capnp::{broker, server_agent, session};
use rgpu_protocol::control_capnp::gpu_server;

use crate::token::{admit, login};

/// `CONTROL_MESSAGE_WORDS` and the nesting limit in `server/src/control.rs`.
const CONTROL_LIMITS: (usize, i32) = (8 << 10, 16);
/// `receive_options` in `pool-broker/src/rpc/mod.rs`.
const BROKER_LIMITS: (usize, i32) = (1 << 17, 32);

pub fn run(data: &[u8]) {
    let Some((&plane, mut bytes)) = data.split_first() else {
        return;
    };
    let broker = plane & 1 == 1;
    let (words, nesting) = if broker {
        BROKER_LIMITS
    } else {
        CONTROL_LIMITS
    };
    let mut opts = ReaderOptions::new();
    opts.traversal_limit_in_words(Some(words))
        .nesting_limit(nesting);
    let Ok(msg) = serialize::read_message(&mut bytes, opts) else {
        return;
    };
    let Ok(m) = msg.get_root::<message::Reader>() else {
        return;
    };
    debug(&m);
    match m.which() {
        Ok(message::Call(Ok(call))) => {
            let Ok(content) = call.get_params().and_then(|p| Ok(p.get_content())) else {
                return;
            };
            let (iface, method) = (call.get_interface_id(), call.get_method_id());
            if broker {
                broker_params(iface, method, content);
            } else if iface == <gpu_server::Client as HasTypeId>::TYPE_ID {
                control_params(method, content);
            }
        }
        Ok(message::Return(Ok(ret))) => {
            if let Ok(return_::Results(Ok(p))) = ret.which() {
                results(broker, p.get_content());
            }
        }
        _ => {}
    }
}

/// Walks `content` as a `T`, every field.
fn walk<'a, T: capnp::traits::FromPointerReader<'a> + std::fmt::Debug>(
    content: any_pointer::Reader<'a>,
) -> Option<T> {
    let r = content.get_as::<T>().ok()?;
    debug(&r);
    Some(r)
}

/// Every field of `r`, as text. capnp's `Debug` reports a field it cannot
/// read (a capability outside an rpc connection, a bad pointer) as a
/// formatting error, which `format!` would turn into a panic.
fn debug(r: &impl std::fmt::Debug) {
    use std::fmt::Write;
    let _ = write!(String::new(), "{r:?}");
}

fn control_params(method: u16, c: any_pointer::Reader<'_>) {
    use gpu_server::{hello_params, list_devices_params, open_session_params, read_snapshot_params, write_snapshot_params};
    match method {
        0 => {
            if let Some(p) = walk::<hello_params::Reader>(c) {
                let _ = p.get_client_name().map(|t| t.to_str().map(str::len));
            }
        }
        1 => {
            walk::<list_devices_params::Reader>(c);
        }
        2 => {
            if let Some(p) = walk::<open_session_params::Reader>(c) {
                admit(p.get_token().unwrap_or_default());
            }
        }
        // What the server computes from a snapshot call before its proof is
        // checked: the name and the piece's digest.
        12 => {
            if let Some(p) = walk::<read_snapshot_params::Reader>(c) {
                let name = p.get_name().ok().and_then(|t| t.to_str().ok()).unwrap_or_default();
                let _ = rgpu_protocol::auth::snapshot_read_name(name, p.get_max_bytes());
            }
        }
        13 => {
            if let Some(p) = walk::<write_snapshot_params::Reader>(c) {
                let name = p.get_name().ok().and_then(|t| t.to_str().ok()).unwrap_or_default();
                let _ = rgpu_protocol::auth::snapshot_write_name(name, p.get_last(), p.get_data().unwrap_or_default());
            }
        }
        _ => {}
    }
}

fn broker_params(iface: u64, method: u16, c: any_pointer::Reader<'_>) {
    if iface == <broker::Client as HasTypeId>::TYPE_ID {
        use broker::{login_params, register_params};
        match method {
            2 => {
                if let Some(p) = walk::<login_params::Reader>(c) {
                    let text = |t: capnp::Result<capnp::text::Reader<'_>>| {
                        t.ok()
                            .and_then(|t| t.to_str().ok())
                            .unwrap_or_default()
                            .to_string()
                    };
                    login(
                        p.get_nonce().unwrap_or_default(),
                        &text(p.get_tenant()),
                        &text(p.get_role()),
                        p.get_serial(),
                        p.get_proof().unwrap_or_default(),
                    );
                }
            }
            3 => {
                if let Some(p) = walk::<register_params::Reader>(c) {
                    if let Ok(s) = p.get_server() {
                        let _ = rgpu_protocol::auth::register_message(
                            p.get_nonce().unwrap_or_default(),
                            s,
                        );
                    }
                }
            }
            _ => {}
        }
    } else if iface == <session::Client as HasTypeId>::TYPE_ID {
        use session::*;
        match method {
            1 => {
                if let Some(p) = walk::<lease_params::Reader>(c) {
                    if let Ok(r) = p.get_request() {
                        let _ = rgpu_protocol::scope::Scope::from_wire(r.get_scope());
                        if let Ok(models) = r.get_models() {
                            for m in models.iter().take(64) {
                                let _ = m.map(|t| t.to_str().map(str::len));
                            }
                        }
                    }
                }
            }
            2 => {
                walk::<renew_params::Reader>(c);
            }
            3 => {
                walk::<release_params::Reader>(c);
            }
            4 => {
                walk::<list_leases_params::Reader>(c);
            }
            7 => {
                walk::<drain_params::Reader>(c);
            }
            8 => {
                walk::<undrain_params::Reader>(c);
            }
            9 => {
                walk::<audit_params::Reader>(c);
            }
            10 => {
                walk::<revoke_credentials_params::Reader>(c);
            }
            11 => {
                walk::<usage_params::Reader>(c);
            }
            _ => {}
        }
    } else if iface == <server_agent::Client as HasTypeId>::TYPE_ID {
        use server_agent::*;
        match method {
            0 => {
                walk::<heartbeat_params::Reader>(c);
            }
            1 => {
                walk::<drain_for_shutdown_params::Reader>(c);
            }
            _ => {}
        }
    }
}

/// A return names only its question: read its results as each struct the
/// peer's answers may be (what the clients decode).
fn results(broker: bool, c: any_pointer::Reader<'_>) {
    if broker {
        walk::<broker::version_results::Reader>(c);
        walk::<broker::challenge_results::Reader>(c);
        walk::<broker::register_results::Reader>(c);
        walk::<session::whoami_results::Reader>(c);
        walk::<session::lease_results::Reader>(c);
        walk::<session::list_leases_results::Reader>(c);
        walk::<session::list_servers_results::Reader>(c);
        walk::<session::status_results::Reader>(c);
        walk::<session::audit_results::Reader>(c);
        walk::<session::usage_results::Reader>(c);
        walk::<server_agent::heartbeat_results::Reader>(c);
    } else {
        walk::<gpu_server::hello_results::Reader>(c);
        walk::<gpu_server::list_devices_results::Reader>(c);
        walk::<gpu_server::open_session_results::Reader>(c);
        walk::<gpu_server::read_snapshot_results::Reader>(c);
        walk::<gpu_server::write_snapshot_results::Reader>(c);
    }
}
