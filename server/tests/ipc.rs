//! CUDA IPC over the data plane (`ipcExport`, `ipcOpen`, `ipcClose`): two
//! sessions of a sim server share an allocation, a kernel of the opener
//! writes what the exporter reads, malformed opens get errors, and a session
//! that ends with memory open gives it back.

mod common;

use std::time::Duration;

use common::{Body, DataClient, TestServer};

const INVALID_VALUE: u32 = 1;
const INVALID_CONTEXT: u32 = 201;

/// `inc(p)`: adds one to the u32 at `p`.
const INC_PTX: &str = ".version 8.0\n.target sm_90\n.address_size 64\n\
    .visible .entry inc(.param .u64 p)\n{\n.reg .b32 %r<3>;\n.reg .b64 %rd<3>;\n\
    ld.param.u64 %rd1, [p];\ncvta.to.global.u64 %rd2, %rd1;\nld.global.u32 %r1, [%rd2];\n\
    add.u32 %r2, %r1, 1;\nst.global.u32 [%rd2], %r2;\nret;\n}\n";

fn export(c: &mut DataClient, ptr: u64) -> (u32, u64, Vec<u8>) {
    let r = c.call(&[], |r| r.init_ipc_export().set_ptr(ptr));
    match r.body {
        Body::IpcHandle { id, secret } => (r.result, id, secret),
        _ => (r.result, 0, Vec::new()),
    }
}

fn open(c: &mut DataClient, id: u64, secret: &[u8]) -> (u32, u64, u64) {
    let r = c.call(&[], |r| {
        let mut o = r.init_ipc_open();
        o.set_id(id);
        o.set_secret(secret);
    });
    match r.body {
        Body::IpcOpened { ptr, size } => (r.result, ptr, size),
        _ => (r.result, 0, 0),
    }
}

fn close(c: &mut DataClient, ptr: u64) -> u32 {
    c.call(&[], |r| r.init_ipc_close().set_ptr(ptr)).result
}

#[test]
fn a_kernel_of_the_opener_changes_what_the_exporter_reads() {
    let srv = TestServer::start();
    let (mut a, mut b) = (srv.session(), srv.session());
    let p = a.alloc_ok(4096);
    assert_eq!(a.htod(p, &41u32.to_le_bytes()).result, 0);
    let (rc, id, secret) = export(&mut a, p + 8);
    assert_eq!(rc, 0);
    assert_eq!(secret.len(), 16);

    let (rc, q, size) = open(&mut b, id, &secret);
    assert_eq!((rc, size), (0, 4096));
    assert_eq!(b.load_module(1, INC_PTX.as_bytes()).result, 0);
    let r = b.launch(true, 1, 0, [1, 1, 1], [1, 1, 1], 0, &q.to_le_bytes()).expect("reply");
    assert_eq!(r.result, 0);
    assert_eq!(b.sync().result, 0);
    assert_eq!(a.dtoh(p, 4).bulk, 42u32.to_le_bytes(), "the opener's kernel wrote the exporter's memory");
    assert_eq!(close(&mut b, q), 0);
    let r = b.launch(true, 1, 0, [1, 1, 1], [1, 1, 1], 0, &q.to_le_bytes()).expect("reply");
    // The launch is queued; its fault comes back with the launch's reply or, deferred, with
    // the next one (as the error of an asynchronous call does).
    let s = b.sync();
    let errors = [r.result, r.deferred, s.result, s.deferred];
    assert!(errors.iter().any(|&e| e != 0), "a kernel on closed memory fails: {errors:?}");
    assert_eq!(a.dtoh(p, 4).bulk, 42u32.to_le_bytes(), "and writes nothing");
}

#[test]
fn malformed_and_foreign_opens_get_errors() {
    let srv = TestServer::start();
    let (mut a, mut b) = (srv.session(), srv.session());
    let p = a.alloc_ok(512);
    let (_, id, secret) = export(&mut a, p);
    assert_eq!(export(&mut a, p + 512).0, INVALID_VALUE, "past the allocation");
    assert_eq!(export(&mut a, 0).0, INVALID_VALUE, "no allocation");
    assert_eq!(open(&mut b, id, &secret[..15]).0, INVALID_VALUE, "a short secret");
    assert_eq!(open(&mut b, id, &[secret.as_slice(), &[0]].concat()).0, INVALID_VALUE, "a long secret");
    assert_eq!(open(&mut b, id, &[]).0, INVALID_VALUE, "no secret");
    assert_eq!(open(&mut b, u64::MAX, &secret).0, INVALID_VALUE, "an unknown id");
    assert_eq!(open(&mut a, id, &secret).0, INVALID_CONTEXT, "its own export");
    assert_eq!(close(&mut b, p), INVALID_VALUE, "never opened");
    assert_eq!(b.free(p).result, INVALID_VALUE, "another session's memory");
    // The sessions go on.
    assert_eq!(a.ping().result, 0);
    assert_eq!(b.ping().result, 0);
}

#[test]
fn an_opener_that_ends_gives_the_memory_back() {
    let srv = TestServer::start();
    let mut a = srv.session();
    let (free0, _) = a.mem_info();
    let p = a.alloc_ok(1 << 20);
    let (_, id, secret) = export(&mut a, p);
    let mut b = srv.session();
    assert_eq!(open(&mut b, id, &secret).0, 0);
    assert_eq!(a.free(p).result, 0);
    assert!(a.mem_info().0 <= free0 - (1 << 20), "held open: not free yet");
    drop(b);
    let t = std::time::Instant::now();
    while a.mem_info().0 != free0 {
        assert!(t.elapsed() < Duration::from_secs(30), "the opener's end did not give the memory back");
        std::thread::sleep(Duration::from_millis(50));
    }
}
