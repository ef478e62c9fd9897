//! The server under hostile input: what one client sends must not take the
//! server, or another client's session, down, nor make the server hold
//! memory or connection slots without bound. Each test measures the thing
//! the limit protects; docs/security.md says what each shows.

mod common;

use common::TestServer;

const INVALID_PTX: u32 = 218;

/// A 10 KB PTX module nesting `{}` blocks (or vector operands) thousands
/// deep: the sim's PTX parser recursed once per level on the session's
/// thread, overflowed its stack and aborted the whole server. Now the load
/// fails with CUDA_ERROR_INVALID_PTX and every session goes on.
#[test]
fn deeply_nested_ptx_is_invalid_ptx_and_the_server_lives() {
    let srv = TestServer::start();
    let mut bystander = srv.session();
    let p = bystander.alloc_ok(4096);
    assert_eq!(bystander.htod(p, &[7u8; 16]).result, 0);

    let head = ".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k()\n{\n";
    let blocks = format!("{head}{}{}}}\n", "{".repeat(5000), "}".repeat(5000));
    let vectors = format!("{head}mov.b32 {}%r1{};\n}}\n", "{".repeat(5000), "}".repeat(5000));
    for (i, text) in [blocks, vectors].iter().enumerate() {
        assert!(text.len() < 12_000);
        let mut attacker = srv.session();
        assert_eq!(attacker.load_module(1 + i as u64, text.as_bytes()).result, INVALID_PTX);
        assert_eq!(attacker.ping().result, 0, "the sender's own session goes on");
    }
    assert_eq!(bystander.dtoh(p, 16).bulk, [7u8; 16], "another session's memory is intact");
    assert_eq!(srv.session().ping().result, 0, "new sessions are served");
    srv.stop();
}
