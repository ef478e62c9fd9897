//! A context reset (`ctxReset`, sent by the shim when a program destroys or
//! resets a context): after a failed device assert, a session that has
//! released everything starts afresh, as a new CUDA context does; the
//! errors after which CUDA says the process must start again stay.

mod common;

use common::{DataClient, TestServer};

const ASSERT: u32 = 710;
const ILLEGAL_ADDRESS: u32 = 700;

/// `bump(p)`: asserts `*p != 0` (thread 0 only), else adds one to it.
const BUMP_PTX: &str = ".version 8.0\n.target sm_90\n.address_size 64\n\
    .extern .func __assertfail(.param .b64 a, .param .b64 b, .param .b32 c, .param .b64 d, .param .b64 e);\n\
    .global .align 1 .b8 msg[8] = {42, 112, 32, 33, 61, 32, 48, 0};\n\
    .global .align 1 .b8 file[5] = {98, 46, 99, 117, 0};\n\
    .global .align 1 .b8 fn_[5] = {98, 117, 109, 112, 0};\n\
    .visible .entry bump(.param .u64 p)\n{\n.reg .pred %p<2>;\n.reg .b32 %r<4>;\n.reg .b64 %rd<9>;\n\
    ld.param.u64 %rd7, [p];\ncvta.to.global.u64 %rd8, %rd7;\nld.global.u32 %r1, [%rd8];\n\
    setp.ne.s32 %p1, %r1, 0;\n@%p1 bra $L_ok;\n\
    mov.u64 %rd1, msg;\ncvta.global.u64 %rd2, %rd1;\nmov.u64 %rd3, file;\ncvta.global.u64 %rd4, %rd3;\nmov.u64 %rd5, fn_;\ncvta.global.u64 %rd6, %rd5;\n\
    { .param .b64 a; st.param.b64 [a], %rd2; .param .b64 b; st.param.b64 [b], %rd4; .param .b32 c; st.param.b32 [c], 7; .param .b64 d; st.param.b64 [d], %rd6; .param .b64 e; st.param.b64 [e], 1;\n\
    call.uni __assertfail, (a, b, c, d, e); }\nret;\n\
    $L_ok:\nadd.u32 %r2, %r1, 1;\nst.global.u32 [%rd8], %r2;\nret;\n}\n";

fn reset(c: &mut DataClient) -> u32 {
    c.call(&[], |r| r.init_ctx_reset().set_device(0)).result
}

/// Launches `bump` of module `module` on `ptr` with one thread; the error
/// it leaves, from its reply or the next synchronisation.
fn bump(c: &mut DataClient, module: u64, ptr: u64) -> u32 {
    let r = c.launch(true, module, 0, [1, 1, 1], [1, 1, 1], 0, &ptr.to_le_bytes()).expect("reply");
    if r.result != 0 {
        return r.result;
    }
    let s = c.sync();
    r.deferred.max(s.deferred).max(s.result)
}

/// Loads `bump` as module `module` and checks it adds one on the device.
fn bumps(c: &mut DataClient, module: u64) {
    assert_eq!(c.load_module(module, BUMP_PTX.as_bytes()).result, 0);
    let p = c.alloc_ok(4);
    assert_eq!(c.htod(p, &5u32.to_le_bytes()).result, 0);
    assert_eq!(bump(c, module, p), 0);
    assert_eq!(c.dtoh(p, 4).bulk, 6u32.to_le_bytes());
    assert_eq!(c.free(p).result, 0);
    assert_eq!(c.unload_module(module).result, 0);
}

#[test]
fn a_reset_after_a_device_assert_starts_a_session_that_released_everything_afresh() {
    let srv = TestServer::start();
    let mut c = srv.session();
    bumps(&mut c, 1);
    assert_eq!(c.load_module(2, BUMP_PTX.as_bytes()).result, 0);
    let zero = c.alloc_ok(4);
    assert_eq!(c.htod(zero, &[0; 4]).result, 0);
    assert_eq!(bump(&mut c, 2, zero), ASSERT);
    assert_eq!(c.ping().result, ASSERT, "the context is unusable");
    assert_eq!(c.alloc(4).result, ASSERT);

    // While the session still holds objects (another context of the
    // client's may use them), a reset changes nothing.
    assert_eq!(reset(&mut c), 0);
    assert_eq!(c.ping().result, ASSERT, "a reset with objects still held leaves the assert");

    assert_eq!(c.free(zero).result, 0);
    assert_eq!(c.unload_module(2).result, 0);
    assert_eq!(reset(&mut c), 0);
    assert_eq!(c.ping().result, 0, "a fresh context");
    assert_eq!(c.ping().deferred, 0, "the old context's errors went with it");
    bumps(&mut c, 3);
    // And asserts again, as a new context would.
    assert_eq!(c.load_module(4, BUMP_PTX.as_bytes()).result, 0);
    let zero = c.alloc_ok(4);
    assert_eq!(c.htod(zero, &[0; 4]).result, 0);
    assert_eq!(bump(&mut c, 4, zero), ASSERT);
    assert_eq!(c.ping().result, ASSERT);
}

#[test]
fn a_reset_leaves_an_illegal_address_sticky() {
    let srv = TestServer::start();
    let mut c = srv.session();
    assert_eq!(c.load_module(1, BUMP_PTX.as_bytes()).result, 0);
    assert_eq!(bump(&mut c, 1, 0), ILLEGAL_ADDRESS);
    assert_eq!(c.unload_module(1).result, 0);
    assert_eq!(reset(&mut c), 0);
    assert_eq!(c.ping().result, ILLEGAL_ADDRESS, "CUDA: the process must start again");
    assert_eq!(srv.session().ping().result, 0, "other sessions are untouched");
}

#[test]
fn a_reset_of_a_healthy_session_that_holds_nothing_changes_nothing() {
    let srv = TestServer::start();
    let mut c = srv.session();
    assert_eq!(reset(&mut c), 0);
    bumps(&mut c, 1);
    assert_eq!(c.call(&[], |r| r.init_ctx_reset().set_device(9)).result, 101, "CUDA_ERROR_INVALID_DEVICE");
    assert_eq!(c.ping().result, 0);
}
