//! The data plane as a session reads it (`server/src/session/mod.rs`): a
//! frame header, then its capnp message, received into the session's
//! `RecvBuf` and read with its limits, decoded by `Command::decode`.
//!
//! Input: 24 header bytes, then the message bytes (as many as the input
//! has, up to the header's length; a shorter message is what a peer that
//! stops mid-frame leaves).

use rgpu_protocol::data_capnp::request;
use rgpu_protocol::frame::{FrameHeader, HEADER_LEN};
use rgpu_protocol::message::RecvBuf;
use rgpu_server::command::Command;

pub fn run(data: &[u8]) {
    let Some((head, rest)) = data.split_first_chunk::<HEADER_LEN>() else {
        return;
    };
    let Ok(h) = FrameHeader::decode(head) else {
        return;
    };
    let len = (h.msg_len as usize).min(rest.len()) & !7;
    let mut recv = RecvBuf::default();
    let mut at = 0;
    let got = recv.receive(len, |buf| {
        buf.copy_from_slice(&rest[at..at + buf.len()]);
        at += buf.len();
        Ok(())
    });
    assert!(got.is_ok(), "receive from a slice of the announced length");
    assert!(
        recv.capacity() <= len.max(64 << 10) * 2 + 64,
        "the buffer follows the bytes received"
    );
    let Ok(msg) = recv.reader() else {
        return;
    };
    let Ok(req) = msg.get_root::<request::Reader>() else {
        return;
    };
    if let Ok(cmd) = Command::decode(req) {
        let name = cmd.name();
        assert!(Command::NAMES.contains(&name), "{name} is a wire name");
        let _ = cmd.takes_bulk();
        // What a request decodes to is bounded by its bytes: a list the
        // message does not really hold (empty elements) is refused.
        if let Command::GraphExecCreate(g) = &cmd {
            if let Ok(ops) = &g.ops {
                assert!(ops.len() <= len / 8, "{} graph ops from a {len}-byte message", ops.len());
            }
        }
        let _ = format!("{cmd:?}");
    }
}
