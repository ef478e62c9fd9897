//! A data-plane session against the sim: the input is what a client sends
//! on its data connection after attaching (frames: header, message, bulk),
//! and each request decoded is applied to one session's state on a sim
//! device, as `server/src/session/mod.rs` does, its reply encoded. The
//! bulk a header announces is read from what follows it; a frame that
//! announces more than the input holds ends the session, as a connection
//! that closes mid-frame does, but only after its handler ran (so what a
//! handler allocates for an announced length is measured, not what came).
//!
//! Input: frames back to back.

use std::io;
use std::sync::OnceLock;
use std::time::Duration;

use rgpu_protocol::data_capnp::{reply, request};
use rgpu_protocol::frame::{FrameHeader, HEADER_LEN};
use rgpu_protocol::message::RecvBuf;
use rgpu_server::backend::sim::{SimBackend, SimConfig};
use rgpu_server::backend::Backend;
use rgpu_server::command::{Bulk, Command, EncodeReply, Fail};
use rgpu_server::state::SessionState;
use rgpu_transport::Transport;

/// At most this many requests per input: a session's work is bounded by
/// its client, a fuzz input's by this.
const MAX_REQUESTS: usize = 64;

/// The sim both this target and `snapshot` run on: 2 devices, 64 MiB each.
pub(crate) fn backend() -> &'static SimBackend {
    static SIM: OnceLock<SimBackend> = OnceLock::new();
    SIM.get_or_init(|| {
        SimBackend::new(&SimConfig {
            devices: 2,
            memory: 64 << 20,
            compute_capability: (9, 0),
            seed: None,
            // libFuzzer's -timeout is 10 s; a kernel may run this long.
            kernel_time_limit: Duration::from_millis(500),
            compiled_tier: true,
        })
        .expect("a sim backend")
    })
}

/// The rest of the input, as the connection's bytes.
struct Wire<'a> {
    rest: &'a [u8],
}

impl Transport for Wire<'_> {
    fn send(&mut self, _bufs: &[&[u8]]) -> io::Result<()> {
        Ok(())
    }
    fn recv_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        if self.rest.len() < buf.len() {
            self.rest = &[];
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let (h, t) = self.rest.split_at(buf.len());
        buf.copy_from_slice(h);
        self.rest = t;
        Ok(())
    }
    fn peer(&self) -> &str {
        "fuzz"
    }
    fn shutdown(&self) {}
}

pub fn run(data: &[u8]) {
    crate::on_session_stack(|| session(data));
}

fn session(data: &[u8]) {
    let sim = backend();
    let Ok(b) = sim.open_session(None) else {
        return;
    };
    let mut s = SessionState::new(b, 2);
    let mut wire = Wire { rest: data };
    let mut recv = RecvBuf::default();
    let mut scratch = Vec::new();
    for _ in 0..MAX_REQUESTS {
        let mut head = [0u8; HEADER_LEN];
        if wire.recv_exact(&mut head).is_err() {
            break;
        }
        let Ok(h) = FrameHeader::decode(&head) else {
            break;
        };
        if recv.receive(h.msg_len as usize, |buf| wire.recv_exact(buf)).is_err() {
            break;
        }
        let cmd = {
            let Ok(msg) = recv.reader() else { break };
            let Ok(req) = msg.get_root::<request::Reader>() else { break };
            let Ok(cmd) = Command::decode(req) else { break };
            cmd
        };
        let r = cmd.apply(&mut s, &mut Bulk::new(&mut wire, h.bulk_len, &mut scratch));
        match r {
            Ok(reply) => {
                let mut m = capnp::message::Builder::new_default();
                reply.encode(m.init_root::<reply::Builder>());
                let _ = reply.device_bytes();
            }
            Err(Fail::Cuda(_)) => {}
            Err(Fail::Io(_)) => break,
        }
    }
}
