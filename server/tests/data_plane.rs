//! Data-plane commands against the sim backend, over real sockets.

mod common;

use std::time::Duration;

use common::{Body, DataClient, TestServer};
use rgpu_protocol::frame::FrameHeader;
use rgpu_transport::Transport;

const INVALID_VALUE: u32 = 1;
const OUT_OF_MEMORY: u32 = 2;
const INVALID_IMAGE: u32 = 200;
const INVALID_HANDLE: u32 = 400;
const ILLEGAL_ADDRESS: u32 = 700;

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn alloc_write_read_free() {
    let srv = TestServer::start();
    let mut c = srv.session();
    let (free0, total) = c.mem_info();
    assert_eq!(total, 256 << 20);
    let p = c.alloc_ok(1000);
    assert_ne!(p, 0);
    assert_eq!(p % 512, 0);
    let q = c.alloc_ok(3 << 20);
    let data = pattern(1000, 7);
    assert_eq!(c.htod(p, &data).result, 0);
    let r = c.dtoh(p, 1000);
    assert_eq!(r.result, 0);
    assert_eq!(r.bulk, data);
    // A big copy (larger than the transport's read buffer), and an interior range.
    let big = pattern(3 << 20, 3);
    assert_eq!(c.htod(q, &big).result, 0);
    assert_eq!(c.dtoh(q, 3 << 20).bulk, big);
    assert_eq!(c.dtoh(q + 4096, 100).bulk, &big[4096..4196]);
    // Fresh memory is zero.
    let z = c.alloc_ok(4096);
    assert!(c.dtoh(z, 4096).bulk.iter().all(|&b| b == 0));
    let (free1, _) = c.mem_info();
    assert!(free1 < free0);
    for x in [p, q, z] {
        assert_eq!(c.free(x).result, 0);
    }
    assert_eq!(c.mem_info().0, free0);
    // Size 0 and out of memory.
    assert_eq!(c.alloc(0).result, INVALID_VALUE);
    assert_eq!(c.alloc(1 << 40).result, OUT_OF_MEMORY);
    assert_eq!(c.ping().result, 0);
}

#[test]
fn freed_memory_is_zero_when_reused() {
    let srv = TestServer::start();
    let mut c = srv.session();
    let p = c.alloc_ok(3 * 4096 + 700);
    assert_eq!(c.htod(p, &vec![0xee; 3 * 4096 + 700]).result, 0);
    assert_eq!(c.free(p).result, 0);
    let q = c.alloc_ok(3 * 4096 + 700);
    assert_eq!(q, p, "best fit reuses the range");
    assert!(c.dtoh(q, 3 * 4096 + 700).bulk.iter().all(|&b| b == 0));
}

#[test]
fn device_to_device() {
    let srv = TestServer::start();
    let mut c = srv.session();
    let a = c.alloc_ok(8192);
    let b = c.alloc_ok(8192);
    let data = pattern(8192, 1);
    c.htod(a, &data);
    let r = c.call(&[], |r| {
        let mut m = r.init_memcpy_dto_d();
        m.set_dst(b + 100);
        m.set_src(a);
        m.set_size(5000);
    });
    assert_eq!(r.result, 0);
    let got = c.dtoh(b, 8192).bulk;
    assert!(got[..100].iter().all(|&x| x == 0));
    assert_eq!(&got[100..5100], &data[..5000]);
    // Overlapping copy within one allocation behaves like memmove.
    let r = c.call(&[], |r| {
        let mut m = r.init_memcpy_dto_d();
        m.set_dst(a + 1);
        m.set_src(a);
        m.set_size(100);
    });
    assert_eq!(r.result, 0);
    let got = c.dtoh(a, 101).bulk;
    assert_eq!(&got[1..101], &data[..100]);
    // Out of bounds on either side.
    let r = c.call(&[], |r| {
        let mut m = r.init_memcpy_dto_d();
        m.set_dst(b);
        m.set_src(a + 4096);
        m.set_size(8192);
    });
    assert_eq!(r.result, INVALID_VALUE);
}

fn memset(c: &mut DataClient, dst: u64, value: u32, es: u8, count: u64, pitch: u64, rows: u64) -> u32 {
    c.call(&[], |r| {
        let mut m = r.init_memset();
        m.set_dst(dst);
        m.set_value(value);
        m.set_element_size(es);
        m.set_count(count);
        m.set_pitch(pitch);
        m.set_rows(rows);
        m.set_stream(0);
    })
    .result
}

#[test]
fn memsets_1d_and_2d() {
    let srv = TestServer::start();
    let mut c = srv.session();
    let p = c.alloc_ok(1024);
    assert_eq!(memset(&mut c, p, 0xab, 1, 10, 0, 0), 0);
    assert_eq!(memset(&mut c, p + 10, 0x1234, 2, 3, 0, 0), 0);
    assert_eq!(memset(&mut c, p + 16, 0xdeadbeef, 4, 2, 0, 0), 0);
    let got = c.dtoh(p, 32).bulk;
    assert_eq!(&got[..10], &[0xab; 10]);
    assert_eq!(&got[10..16], &[0x34, 0x12, 0x34, 0x12, 0x34, 0x12]);
    assert_eq!(&got[16..24], &[0xef, 0xbe, 0xad, 0xde, 0xef, 0xbe, 0xad, 0xde]);
    assert!(got[24..].iter().all(|&x| x == 0));

    // 2-D: 4 rows of 3 u16 elements, pitch 16.
    let q = c.alloc_ok(64);
    assert_eq!(memset(&mut c, q, 0x0102, 2, 3, 16, 4), 0);
    let got = c.dtoh(q, 64).bulk;
    for row in 0..4 {
        let r = &got[row * 16..row * 16 + 16];
        assert_eq!(&r[..6], &[2, 1, 2, 1, 2, 1], "row {row}");
        assert!(r[6..].iter().all(|&x| x == 0), "row {row}");
    }
    // Out of bounds, bad element size, pitch narrower than a row.
    assert_eq!(memset(&mut c, q, 0, 4, 17, 0, 0), INVALID_VALUE);
    assert_eq!(memset(&mut c, q, 0, 2, 3, 16, 5), INVALID_VALUE);
    assert_eq!(memset(&mut c, q, 0, 3, 1, 0, 0), INVALID_VALUE);
    assert_eq!(memset(&mut c, q, 0, 4, 8, 16, 2), INVALID_VALUE);
}

#[test]
fn out_of_bounds_access_fails_and_session_continues() {
    let srv = TestServer::start();
    let mut c = srv.session();
    let p = c.alloc_ok(1000);
    // Past the end (even within the allocator's 512-byte rounding).
    assert_eq!(c.htod(p + 500, &[1u8; 501]).result, INVALID_VALUE);
    assert_eq!(c.dtoh(p, 1001).result, INVALID_VALUE);
    assert!(c.dtoh(p, 1001).bulk.is_empty());
    assert_eq!(c.dtoh(p - 1, 10).result, INVALID_VALUE);
    assert_eq!(c.dtoh(0, 10).result, INVALID_VALUE);
    assert_eq!(c.dtoh(p + 10, u64::MAX - 5).result, INVALID_VALUE);
    // A refused write's bulk was skipped: the stream is in sync, memory untouched.
    assert!(c.dtoh(p, 1000).bulk.iter().all(|&b| b == 0));
    assert_eq!(c.htod(p, &[9u8; 1000]).result, 0);
    assert_eq!(c.dtoh(p + 999, 1).bulk, vec![9]);
    // Large refused bulk (bigger than one discard chunk) keeps the stream in sync too.
    assert_eq!(c.htod(p, &vec![1u8; 3 << 20]).result, INVALID_VALUE);
    assert_eq!(c.ping().result, 0);
    // Memory freed is no longer accessible.
    assert_eq!(c.free(p).result, 0);
    assert_eq!(c.dtoh(p, 1).result, INVALID_VALUE);
}

#[test]
fn bad_frees() {
    let srv = TestServer::start();
    let mut c = srv.session();
    let p = c.alloc_ok(4096);
    assert_eq!(c.free(p + 512).result, INVALID_VALUE, "interior pointer");
    assert_eq!(c.free(0x1234).result, INVALID_VALUE, "unknown pointer");
    assert_eq!(c.free(p).result, 0);
    assert_eq!(c.free(p).result, INVALID_VALUE, "double free");
    assert_eq!(c.ping().result, 0);
}

#[test]
fn sessions_are_isolated() {
    let srv = TestServer::start();
    let mut a = srv.session();
    let mut b = srv.session();
    let p = a.alloc_ok(4096);
    a.htod(p, &[7u8; 4096]);
    assert_eq!(b.dtoh(p, 16).result, INVALID_VALUE);
    assert_eq!(b.htod(p, &[1u8; 16]).result, INVALID_VALUE);
    assert_eq!(b.free(p).result, INVALID_VALUE);
    let q = b.alloc_ok(4096);
    let r = b.call(&[], |r| {
        let mut m = r.init_memcpy_dto_d();
        m.set_dst(q);
        m.set_src(p);
        m.set_size(16);
    });
    assert_eq!(r.result, INVALID_VALUE);
    assert_eq!(a.dtoh(p, 4096).bulk, vec![7u8; 4096]);
    // Handles are per session too.
    let r = a.call(&[], |r| {
        let mut s = r.init_stream_create();
        s.set_handle(5);
        s.set_device(0);
    });
    assert_eq!(r.result, 0);
    assert_eq!(b.dtoh_on(q, 16, 5).result, INVALID_HANDLE);
    assert_eq!(a.dtoh_on(p, 16, 5).result, 0);
}

#[test]
fn streams_and_unknown_handles() {
    let srv = TestServer::start();
    let mut c = srv.session();
    let p = c.alloc_ok(64);
    let create = |c: &mut DataClient, h: u64| {
        c.call(&[], |r| {
            let mut s = r.init_stream_create();
            s.set_handle(h);
            s.set_device(0);
            s.set_flags(1);
            s.set_priority(-1);
        })
        .result
    };
    assert_eq!(create(&mut c, 77), 0);
    assert_eq!(create(&mut c, 77), INVALID_VALUE, "duplicate handle");
    assert_eq!(create(&mut c, 0), INVALID_VALUE, "0 is the default stream");
    assert_eq!(c.dtoh_on(p, 8, 77).result, 0);
    assert_eq!(c.dtoh_on(p, 8, 0).result, 0);
    assert_eq!(c.dtoh_on(p, 8, 78).result, INVALID_HANDLE);
    assert_eq!(c.call(&[], |r| r.init_stream_synchronize().set_handle(77)).result, 0);
    assert_eq!(c.call(&[], |r| r.init_stream_synchronize().set_handle(0)).result, 0);
    assert_eq!(c.call(&[], |r| r.init_stream_query().set_handle(77)).result, 0);
    assert_eq!(c.call(&[], |r| r.init_stream_query().set_handle(9)).result, INVALID_HANDLE);
    assert_eq!(c.call(&[], |r| r.init_stream_synchronize().set_handle(9)).result, INVALID_HANDLE);
    assert_eq!(c.call(&[], |r| r.init_stream_destroy().set_handle(9)).result, INVALID_HANDLE);
    assert_eq!(c.call(&[], |r| r.init_stream_destroy().set_handle(77)).result, 0);
    assert_eq!(c.call(&[], |r| r.init_stream_destroy().set_handle(77)).result, INVALID_HANDLE);
    assert_eq!(c.dtoh_on(p, 8, 77).result, INVALID_HANDLE);
    // Unknown events.
    assert_eq!(c.call(&[], |r| r.init_event_query().set_handle(3)).result, INVALID_HANDLE);
    assert_eq!(c.call(&[], |r| r.init_event_synchronize().set_handle(3)).result, INVALID_HANDLE);
    assert_eq!(c.call(&[], |r| r.init_event_destroy().set_handle(3)).result, INVALID_HANDLE);
    let r = c.call(&[], |r| {
        let mut e = r.init_event_record();
        e.set_event(3);
        e.set_stream(0);
    });
    assert_eq!(r.result, INVALID_HANDLE);
    let r = c.call(&[], |r| {
        let mut w = r.init_stream_wait_event();
        w.set_stream(0);
        w.set_event(3);
    });
    assert_eq!(r.result, INVALID_HANDLE);
    assert_eq!(c.call(&[], |r| r.init_ctx_synchronize().set_device(0)).result, 0);
    assert_eq!(c.call(&[], |r| r.init_ctx_synchronize().set_device(5)).result, 101);
}

fn event_create(c: &mut DataClient, h: u64, flags: u32) -> u32 {
    c.call(&[], |r| {
        let mut e = r.init_event_create();
        e.set_handle(h);
        e.set_device(0);
        e.set_flags(flags);
    })
    .result
}

fn event_record(c: &mut DataClient, h: u64, stream: u64) -> u32 {
    c.call(&[], |r| {
        let mut e = r.init_event_record();
        e.set_event(h);
        e.set_stream(stream);
    })
    .result
}

fn elapsed(c: &mut DataClient, a: u64, b: u64) -> (u32, Option<f32>) {
    let r = c.call(&[], |r| {
        let mut p = r.init_event_elapsed_time();
        p.set_start(a);
        p.set_end(b);
    });
    match r.body {
        Body::Elapsed(ms) => (r.result, Some(ms)),
        _ => (r.result, None),
    }
}

#[test]
fn events_time_and_order() {
    let srv = TestServer::start();
    let mut c = srv.session();
    assert_eq!(event_create(&mut c, 1, 0), 0);
    assert_eq!(event_create(&mut c, 2, 0), 0);
    assert_eq!(event_create(&mut c, 3, 2), 0, "CU_EVENT_DISABLE_TIMING");
    assert_eq!(event_create(&mut c, 1, 0), INVALID_VALUE, "duplicate");
    // Not recorded yet.
    assert_eq!(elapsed(&mut c, 1, 2).0, INVALID_HANDLE);
    assert_eq!(event_record(&mut c, 1, 0), 0);
    std::thread::sleep(Duration::from_millis(20));
    let p = c.alloc_ok(1 << 20);
    c.htod(p, &vec![1u8; 1 << 20]);
    assert_eq!(event_record(&mut c, 2, 0), 0);
    assert_eq!(event_record(&mut c, 3, 0), 0);
    // The records are queued on the device: the elapsed time is known once
    // the end event has completed (NOT_READY before, as on a GPU).
    assert_eq!(c.call(&[], |r| r.init_event_synchronize().set_handle(2)).result, 0);
    let (r, ms) = elapsed(&mut c, 1, 2);
    assert_eq!(r, 0);
    let ms = ms.unwrap();
    assert!((15.0..10_000.0).contains(&ms), "elapsed {ms} ms");
    assert_eq!(elapsed(&mut c, 1, 3).0, INVALID_HANDLE, "timing disabled");
    assert_eq!(c.call(&[], |r| r.init_event_query().set_handle(2)).result, 0);
    assert_eq!(c.call(&[], |r| r.init_event_synchronize().set_handle(2)).result, 0);
    let r = c.call(&[], |r| {
        let mut w = r.init_stream_wait_event();
        w.set_stream(0);
        w.set_event(2);
    });
    assert_eq!(r.result, 0);
    assert_eq!(c.call(&[], |r| r.init_event_destroy().set_handle(2)).result, 0);
    assert_eq!(elapsed(&mut c, 1, 2).0, INVALID_HANDLE);
}

#[test]
fn deferred_error_surfaces_once() {
    let srv = TestServer::start();
    let mut c = srv.session();
    let p = c.alloc_ok(64);
    // Asynchronous requests: no replies; the first failure is kept.
    c.post(&[1u8; 128], |r| r.init_memcpy_hto_d().set_dst(p));
    c.post(&[], |r| r.init_stream_destroy().set_handle(42));
    c.post(&[2u8; 64], |r| r.init_memcpy_hto_d().set_dst(p));
    let r = c.ping();
    assert_eq!((r.result, r.deferred), (0, INVALID_VALUE));
    let r = c.ping();
    assert_eq!((r.result, r.deferred), (0, 0), "reported exactly once");
    // The successful async write after the failures happened, in order.
    assert_eq!(c.dtoh(p, 64).bulk, vec![2u8; 64]);
    // A replied request's own error is its result, not a deferred one.
    assert_eq!(c.free(p + 1).result, INVALID_VALUE);
    assert_eq!(c.ping().deferred, 0);
}

#[test]
fn replies_to_a_burst_come_back_in_order() {
    let srv = TestServer::start();
    let mut c = srv.session();
    let p = c.alloc_ok(4096);
    // Send many requests before reading any reply: the server may batch them.
    let mut want = Vec::new();
    for i in 0..50u8 {
        c.post(&[i; 16], |r| r.init_memcpy_hto_d().set_dst(p + i as u64 * 16));
    }
    let mut enc = rgpu_protocol::message::Encoder::default();
    let mut frames = Vec::new();
    for i in 0..50u64 {
        let mut msg = Vec::new();
        let n = enc.request(&mut msg, |r| {
            let mut m = r.init_memcpy_dto_h();
            m.set_src(p + i * 16);
            m.set_size(16);
        });
        frames.extend_from_slice(&FrameHeader::request(1000 + i, true, n, 0).encode());
        frames.extend_from_slice(&msg);
        want.push(1000 + i);
    }
    c.t.send(&[&frames]).unwrap();
    for (i, seq) in want.into_iter().enumerate() {
        let r = c.read_reply().unwrap();
        assert_eq!(r.seq, seq);
        assert_eq!(r.bulk, vec![i as u8; 16]);
    }
}

fn fixture(name: &str) -> Vec<u8> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn module_load(c: &mut DataClient, handle: u64, image: &[u8]) -> common::Reply {
    c.call(image, |r| {
        let mut m = r.init_module_load();
        m.set_handle(handle);
        m.set_device(0);
    })
}

fn launch(c: &mut DataClient, module: u64, function: u32, params: &[u8]) -> u32 {
    c.call(params, |r| {
        let mut l = r.init_launch_kernel();
        l.set_module(module);
        l.set_function(function);
        l.set_grid_x(1);
        l.set_grid_y(1);
        l.set_grid_z(1);
        l.set_block_x(32);
        l.set_block_y(1);
        l.set_block_z(1);
    })
    .result
}

/// A hand-written PTX module: one kernel with two parameters, two globals.
const TINY_PTX: &str = r#"
.version 8.0
.target sm_90
.address_size 64

.global .align 4 .u32 answer = 42;
.global .align 8 .b8 table[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
.global .align 4 .b8 zeros[100];

.visible .entry add_one(
	.param .u64 add_one_param_0,
	.param .u32 add_one_param_1
)
{
	.reg .b32 	%r<3>;
	.reg .b64 	%rd<3>;
	ld.param.u64 	%rd1, [add_one_param_0];
	ld.param.u32 	%r1, [add_one_param_1];
	cvta.to.global.u64 	%rd2, %rd1;
	st.global.u32 	[%rd2], %r1;
	ret;
}
"#;

#[test]
fn module_load_globals_and_launch() {
    let srv = TestServer::start();
    let mut c = srv.session();
    let (free0, _) = c.mem_info();
    let r = module_load(&mut c, 10, TINY_PTX.as_bytes());
    assert_eq!(r.result, 0, "module load");
    let Body::Module(m) = r.body else { panic!("expected ModuleLoaded") };
    assert_eq!(m.note, "", "the sim runs this module's kernel");
    assert_eq!(m.functions.len(), 1);
    let (name, params, max_threads, regs) = &m.functions[0];
    assert_eq!(name, "add_one");
    assert_eq!(params, &vec![(0, 8), (8, 4)]);
    assert_eq!((*max_threads, *regs), (1024, 32));
    let g = |n: &str| m.globals.iter().find(|g| g.0 == n).unwrap_or_else(|| panic!("global {n}")).clone();
    let answer = g("answer");
    assert_eq!(answer.2, 4);
    assert_eq!(c.dtoh(answer.1, 4).bulk, 42u32.to_le_bytes());
    assert_eq!(c.dtoh(g("table").1, 16).bulk, (1..=16).collect::<Vec<u8>>());
    assert_eq!(c.dtoh(g("zeros").1, 100).bulk, vec![0u8; 100]);
    // Globals are writable, bounds-checked, and not the client's to free.
    assert_eq!(c.htod(answer.1, &7u32.to_le_bytes()).result, 0);
    assert_eq!(c.dtoh(answer.1, 4).bulk, 7u32.to_le_bytes());
    assert_eq!(c.dtoh(answer.1, 5).result, INVALID_VALUE);
    assert_eq!(c.free(answer.1).result, INVALID_VALUE);
    assert!(c.mem_info().0 < free0);

    // Launch: the kernel stores its second argument through its first.
    let mut params = vec![0u8; 12];
    params[..8].copy_from_slice(&answer.1.to_le_bytes());
    params[8..].copy_from_slice(&1234u32.to_le_bytes());
    assert_eq!(launch(&mut c, 10, 0, &params), 0);
    assert_eq!(c.dtoh(answer.1, 4).bulk, 1234u32.to_le_bytes());
    assert_eq!(launch(&mut c, 10, 0, &params[..8]), INVALID_VALUE, "short parameter buffer");
    assert_eq!(launch(&mut c, 10, 1, &params), INVALID_HANDLE, "no such function");
    assert_eq!(launch(&mut c, 11, 0, &params), INVALID_HANDLE, "no such module");
    assert_eq!(c.ping().result, 0);

    // Duplicate handle, unload, unknown unload.
    assert_eq!(module_load(&mut c, 10, TINY_PTX.as_bytes()).result, INVALID_VALUE);
    assert_eq!(c.call(&[], |r| r.init_module_unload().set_handle(10)).result, 0);
    assert_eq!(c.call(&[], |r| r.init_module_unload().set_handle(10)).result, INVALID_HANDLE);
    assert_eq!(c.dtoh(answer.1, 4).result, INVALID_VALUE, "globals die with the module");
    assert_eq!(c.mem_info().0, free0);

    // A null pointer: CUDA_ERROR_ILLEGAL_ADDRESS at the next synchronisation
    // (the launch itself is queued, as on a GPU). Then, as a GPU's context
    // after a fault, the session is unusable: every later call fails with
    // it, and releasing objects still works.
    assert_eq!(module_load(&mut c, 12, TINY_PTX.as_bytes()).result, 0);
    let spare = c.alloc_ok(64);
    params[..8].copy_from_slice(&0u64.to_le_bytes());
    let r = c.launch(true, 12, 0, [1, 1, 1], [32, 1, 1], 0, &params).expect("reply");
    assert_eq!(r.result, 0);
    // The next reply after the kernel failed carries it: the launch's own if it was that quick.
    assert_eq!(r.deferred.max(c.sync().deferred), ILLEGAL_ADDRESS);
    assert_eq!(c.ping().result, ILLEGAL_ADDRESS);
    assert_eq!(c.alloc(4).result, ILLEGAL_ADDRESS);
    assert_eq!(c.dtoh(spare, 4).result, ILLEGAL_ADDRESS);
    assert_eq!(c.free(spare).result, 0);
    assert_eq!(c.call(&[], |r| r.init_module_unload().set_handle(12)).result, 0);
    // Other sessions are untouched.
    let mut other = srv.session();
    assert_eq!(other.ping().result, 0);
}

/// A kernel whose body only returns can be launched on the sim: running it
/// changes nothing, so honouring the launch is exact.
const EMPTY_PTX: &str = ".version 8.0\n.target sm_90\n.address_size 64\n\
.visible .entry empty(.param .u32 n)\n{\n\t.reg .b32 %r<2>;\n\tret;\n}\n";

#[test]
fn empty_kernels_launch() {
    let srv = TestServer::start();
    let mut c = srv.session();
    let r = module_load(&mut c, 5, EMPTY_PTX.as_bytes());
    assert_eq!(r.result, 0);
    let Body::Module(m) = r.body else { panic!("expected ModuleLoaded") };
    assert_eq!(m.note, "", "a module of empty kernels can run");
    assert_eq!(launch(&mut c, 5, 0, &[0u8; 4]), 0);
    assert_eq!(launch(&mut c, 5, 0, &[0u8; 2]), INVALID_VALUE, "short parameter buffer");
}

#[test]
fn module_fixtures_and_bad_images() {
    let srv = TestServer::start();
    let mut c = srv.session();
    // The fixture built by nvcc (PTX text), with initialised and zero globals.
    let r = module_load(&mut c, 1, &fixture("globals.ptx"));
    assert_eq!(r.result, 0);
    let Body::Module(m) = r.body else { panic!("expected ModuleLoaded") };
    assert_eq!(m.note, "", "the sim runs every kernel of the fixture");
    let g_int = m.globals.iter().find(|g| g.0 == "g_int").expect("g_int");
    assert_eq!(c.dtoh(g_int.1, 4).bulk, 42u32.to_le_bytes());
    let c_one = m.globals.iter().find(|g| g.0 == "c_one").expect("c_one");
    assert_eq!(c.dtoh(c_one.1, 4).bulk, 7u32.to_le_bytes());
    // A fatbin with SASS only loads, but says it cannot run here.
    let r = module_load(&mut c, 2, &fixture("globals.sass-only.fatbin"));
    assert_eq!(r.result, 0);
    let Body::Module(m) = r.body else { panic!("expected ModuleLoaded") };
    assert!(m.note.contains("compute_"), "{}", m.note);
    // Garbage is an invalid image; the session carries on.
    assert_eq!(module_load(&mut c, 3, b"\x00\x01garbage").result, INVALID_IMAGE);
    assert_eq!(module_load(&mut c, 3, b"").result, INVALID_IMAGE);
    assert_eq!(module_load(&mut c, 3, b".version 8.0\n.target sm_90\n.entry broken(").result, INVALID_IMAGE);
    assert_eq!(c.ping().result, 0);
}

#[test]
fn garbage_frame_closes_only_that_connection() {
    let srv = TestServer::start();
    let mut good = srv.session();
    let p = good.alloc_ok(64);
    let (free_before, _) = good.mem_info();
    for garbage in [
        // Bad magic.
        vec![0xffu8; 24],
        // Valid header, capnp garbage.
        {
            let mut v = FrameHeader::request(1, true, 32, 0).encode().to_vec();
            v.extend_from_slice(&[0xff; 32]);
            v
        },
        // A reply frame from a client.
        FrameHeader::reply(1, 0, 0).encode().to_vec(),
    ] {
        let mut bad = srv.session();
        let q = bad.alloc_ok(1 << 20);
        assert_ne!(q, 0);
        bad.t.send(&[&garbage]).unwrap();
        let mut b = [0u8; 1];
        assert!(bad.t.recv_exact(&mut b).is_err(), "connection closed");
    }
    // The other session is untouched, and the bad sessions' memory was freed.
    assert_eq!(good.htod(p, &[5u8; 64]).result, 0);
    assert_eq!(good.dtoh(p, 64).bulk, vec![5u8; 64]);
    wait_for_free(&mut good, free_before);
}

/// Session teardown runs on the session's thread after the socket closes;
/// poll briefly for it.
fn wait_for_free(c: &mut DataClient, want: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let free = c.mem_info().0;
        if free == want {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "free {free}, want {want}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn unknown_request_variant_closes_the_connection() {
    let srv = TestServer::start();
    let mut c = srv.session();
    // A Request whose union discriminant is beyond the schema: build a ping,
    // then patch the discriminant (the struct's data word) to 200.
    let mut enc = rgpu_protocol::message::Encoder::default();
    let mut msg = Vec::new();
    let n = enc.request(&mut msg, |mut r| r.set_ping(()));
    // Segment table (8 bytes), root pointer (8 bytes), then the data word.
    msg[16] = 200;
    let mut check = rgpu_protocol::message::RecvBuf::default();
    check.prepare(n).copy_from_slice(&msg);
    let m = check.reader().unwrap();
    let req = m.get_root::<rgpu_protocol::data_capnp::request::Reader>().unwrap();
    assert!(req.which().is_err(), "the patched request must be an unknown variant");
    let h = FrameHeader::request(1, true, n, 0).encode();
    c.t.send(&[&h, &msg]).unwrap();
    let mut b = [0u8; 1];
    assert!(c.t.recv_exact(&mut b).is_err());
}

#[test]
fn session_end_frees_memory() {
    let srv = TestServer::start();
    let mut observer = srv.session();
    let (free0, _) = observer.mem_info();
    {
        let mut c = srv.session();
        for _ in 0..10 {
            let p = c.alloc_ok(1 << 20);
            c.htod(p, &[1u8; 4096]);
        }
        let r = module_load(&mut c, 1, TINY_PTX.as_bytes());
        assert_eq!(r.result, 0);
        event_create(&mut c, 1, 0);
        assert!(observer.mem_info().0 < free0);
        // Dropped here: the client closes the connection.
    }
    wait_for_free(&mut observer, free0);
}

#[test]
fn eight_sessions_at_once() {
    let srv = TestServer::start();
    let addr = srv.addr.to_string();
    let threads: Vec<_> = (0..8u8)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let h = common::control(&addr);
                let mut c = DataClient::attach(&addr, h.session_id, &h.key).unwrap();
                let mut ptrs = Vec::new();
                for round in 0..20u8 {
                    let p = c.alloc_ok(64 << 10);
                    let data = pattern(64 << 10, i.wrapping_mul(50).wrapping_add(round));
                    assert_eq!(c.htod(p, &data).result, 0);
                    assert_eq!(c.dtoh(p, 64 << 10).bulk, data);
                    ptrs.push(p);
                }
                for p in ptrs {
                    assert_eq!(c.free(p).result, 0);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let mut c = srv.session();
    assert_eq!(c.mem_info().0, 256 << 20);
}

#[test]
fn unexpected_bulk_is_skipped_and_refused() {
    let srv = TestServer::start();
    let mut c = srv.session();
    let r = c.call(&[1, 2, 3], |mut r| r.set_ping(()));
    assert_eq!(r.result, INVALID_VALUE);
    assert_eq!(c.ping().result, 0);
}

#[test]
fn second_device() {
    let srv = TestServer::start_with(2, 16 << 20, Duration::from_secs(30));
    let mut c = srv.session();
    let a = c.alloc_ok(4096);
    let r = c.call(&[], |r| {
        let mut m = r.init_mem_alloc();
        m.set_device(1);
        m.set_size(4096);
    });
    assert_eq!(r.result, 0);
    let b = r.ptr();
    assert_ne!(a >> 40, b >> 40, "devices have separate address windows");
    c.htod(a, &[3u8; 4096]);
    let r = c.call(&[], |r| {
        let mut m = r.init_memcpy_dto_d();
        m.set_dst(b);
        m.set_src(a);
        m.set_size(4096);
    });
    assert_eq!(r.result, 0);
    assert_eq!(c.dtoh(b, 4096).bulk, vec![3u8; 4096]);
    let r = c.call(&[], |r| {
        let mut m = r.init_mem_alloc();
        m.set_device(2);
        m.set_size(4096);
    });
    assert_eq!(r.result, 101, "CUDA_ERROR_INVALID_DEVICE");
}
