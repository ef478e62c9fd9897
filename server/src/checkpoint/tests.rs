//! A session with allocations, a module with a global, streams and events,
//! captured and rebuilt on another sim backend: the same bytes at the same
//! addresses, and kernels launched by the same handles compute what they
//! compute on the original.

use std::time::Duration;

use super::*;
use crate::backend::sim::{SimBackend, SimConfig};
use crate::backend::{Backend, LaunchDims, StreamRef};
use crate::command::event::{EventCreate, EventRecord};
use crate::command::stream::StreamCreate;
use crate::command::Handler;
use crate::session::window::ReplyWindow;
use crate::state::SessionState;

/// `scale(data, n)`: data[i] = data[i] * 3 + g_count, one thread per element.
/// `tick(out)`: g_count += 1; *out = g_count.
const PTX: &str = ".version 8.0\n.target sm_90\n.address_size 64\n\
.global .align 4 .u32 g_count = 5;\n\
.visible .entry scale(.param .u64 data, .param .u32 n)\n{\n\t.reg .pred %p<2>;\n\t.reg .b32 %r<9>;\n\t.reg .b64 %rd<5>;\n\
\tld.param.u64 %rd1, [data];\n\tld.param.u32 %r1, [n];\n\tmov.u32 %r2, %tid.x;\n\tmov.u32 %r3, %ctaid.x;\n\tmov.u32 %r4, %ntid.x;\n\
\tmad.lo.u32 %r5, %r3, %r4, %r2;\n\tsetp.ge.u32 %p1, %r5, %r1;\n\t@%p1 bra $L__done;\n\tmul.wide.u32 %rd3, %r5, 4;\n\
\tadd.u64 %rd4, %rd1, %rd3;\n\tld.global.u32 %r6, [%rd4];\n\tld.global.u32 %r7, [g_count];\n\tmul.lo.u32 %r8, %r6, 3;\n\
\tadd.u32 %r8, %r8, %r7;\n\tst.global.u32 [%rd4], %r8;\n$L__done:\n\tret;\n}\n\
.visible .entry tick(.param .u64 out)\n{\n\t.reg .b32 %r<3>;\n\t.reg .b64 %rd<2>;\n\tld.param.u64 %rd1, [out];\n\
\tld.global.u32 %r1, [g_count];\n\tadd.u32 %r1, %r1, 1;\n\tst.global.u32 [g_count], %r1;\n\tst.global.u32 [%rd1], %r1;\n\tret;\n}\n";

const MODULE: u64 = 0x4d00_0000_0000_0001;
const STREAM: u64 = 0x5300_0000_0000_0001;
const EV_A: u64 = 0x4500_0000_0000_0001;
const EV_B: u64 = 0x4500_0000_0000_0002;
const N: u32 = 4096;

fn backend(seed: &str) -> SimBackend {
    let cfg = SimConfig {
        devices: 1,
        memory: 64 << 20,
        compute_capability: (9, 0),
        seed: Some(seed.into()),
        kernel_time_limit: Duration::from_secs(20),
        compiled_tier: true,
    };
    SimBackend::new(&cfg).expect("sim backend")
}

fn fresh(sim: &SimBackend) -> SessionState {
    SessionState::new(sim.open_session(None).expect("session"), 1).with_devices(sim.devices())
}

fn write(s: &mut SessionState, ptr: u64, data: &[u8]) {
    let mut at = 0;
    s.backend
        .memcpy_htod(StreamRef::Default { device: 0 }, ptr, data.len() as u64, &mut |b| {
            b.copy_from_slice(&data[at..at + b.len()]);
            at += b.len();
            Ok(())
        })
        .unwrap();
}

fn read(s: &mut SessionState, ptr: u64, len: u64) -> Vec<u8> {
    let mut v = Vec::new();
    s.backend
        .memcpy_dtoh(StreamRef::Default { device: 0 }, ptr, len, &mut |b| {
            v.extend_from_slice(b);
            Ok(())
        })
        .unwrap();
    v
}

fn launch(s: &mut SessionState, function: u32, (grid, block): (u32, u32), params: &[u8], stream: u64) {
    let dims = LaunchDims { grid: [grid, 1, 1], block: [block, 1, 1], shared_mem_bytes: 0, cooperative: false };
    let (token, device) = s.check_launch(MODULE, function, &dims, params.len() as u64).unwrap();
    let st = s.stream(stream, device).unwrap();
    s.backend.launch_kernel(token, function, &dims, st, params).unwrap();
}

fn scale(s: &mut SessionState, data: u64) {
    let mut p = data.to_le_bytes().to_vec();
    p.extend_from_slice(&N.to_le_bytes());
    launch(s, 0, (N.div_ceil(128), 128), &p, STREAM);
}

fn tick(s: &mut SessionState, out: u64) {
    launch(s, 1, (1, 1), &out.to_le_bytes(), STREAM);
}

/// A session in mid-run: two allocations, the module (its global moved on
/// from its initial value), a non-blocking stream with a priority, two
/// recorded events around a kernel. Returns (data, out) pointers.
fn session_in_mid_run(s: &mut SessionState) -> (u64, u64) {
    let data = s.backend.mem_alloc(0, N as u64 * 4).unwrap();
    s.allocs.insert(data, crate::state::Alloc { device: 0, size: N as u64 * 4, owner: crate::state::Owner::Client });
    let out = s.backend.mem_alloc(0, 4).unwrap();
    s.allocs.insert(out, crate::state::Alloc { device: 0, size: 4, owner: crate::state::Owner::Client });
    let init: Vec<u8> = (0..N).flat_map(|i| (i * 7 + 1).to_le_bytes()).collect();
    write(s, data, &init);
    let held = s.input.modules.charge(PTX.len() as u64).unwrap();
    crate::command::module::install(s, MODULE, 0, PTX.as_bytes().to_vec(), held, None).unwrap();
    StreamCreate { handle: STREAM, device: 0, flags: 1, priority: -1 }.apply(s).unwrap();
    EventCreate { handle: EV_A, device: 0, flags: 0 }.apply(s).unwrap();
    EventCreate { handle: EV_B, device: 0, flags: 0 }.apply(s).unwrap();
    EventRecord { event: EV_A, stream: STREAM }.apply(s).unwrap();
    tick(s, out);
    scale(s, data);
    std::thread::sleep(Duration::from_millis(5));
    EventRecord { event: EV_B, stream: STREAM }.apply(s).unwrap();
    (data, out)
}

fn meta() -> SessionMeta {
    SessionMeta {
        id: 0x1234,
        key: [7; rgpu_protocol::SESSION_KEY_LEN],
        client_name: "test".into(),
        executed: 41,
        deferred: None,
        admission: None,
    }
}

fn snapshot(s: &mut SessionState, window: &ReplyWindow) -> (Vec<u8>, Captured) {
    let mut bytes = Vec::new();
    let c = capture(s, &meta(), window, Duration::from_secs(10), &mut bytes, None).unwrap();
    (bytes, c)
}

fn rebuild_on(sim: &SimBackend, bytes: &[u8]) -> Result<(SessionState, SessionMeta, rebuild::Rebuilt), SnapshotError> {
    let mut r = bytes;
    let opened = open(&mut r)?;
    opened.check_fits(sim.devices(), 90)?;
    let m = opened.meta.clone();
    let mut s = fresh(sim);
    let rebuilt = opened.rebuild(&mut s)?;
    Ok((s, m, rebuilt))
}

fn elapsed(s: &mut SessionState) -> f32 {
    let (a, b) = (s.event(EV_A).unwrap().token, s.event(EV_B).unwrap().token);
    s.backend.event_elapsed_time(a, b).unwrap()
}

#[test]
fn a_rebuilt_session_holds_the_same_bytes_at_the_same_addresses_and_computes_the_same() {
    let (a, b) = (backend("a"), backend("b"));
    let mut orig = fresh(&a);
    let (data, out) = session_in_mid_run(&mut orig);
    let mut window = ReplyWindow::default();
    window.keep(41, b"a kept reply frame", None);
    let (bytes, c) = snapshot(&mut orig, &window);
    let global = orig.module(MODULE).unwrap().globals[0];
    assert!(c.memory_bytes >= N as u64 * 4 + 4 + 4, "{c:?}");
    assert_eq!(c.bytes, bytes.len() as u64);

    let (mut copy, m, rebuilt) = rebuild_on(&b, &bytes).unwrap();
    assert_eq!(m, meta());
    assert_eq!(rebuilt.memory_bytes, c.memory_bytes);
    let mut w = rebuilt.window;
    assert_eq!(w.after(40).unwrap().map(|k| (k.seq, k.frame.clone())).collect::<Vec<_>>(), vec![(41, b"a kept reply frame".to_vec())]);

    // The same handles and pointers name the same bytes.
    assert_eq!(copy.module(MODULE).unwrap().globals, vec![global]);
    for (ptr, len) in [(data, N as u64 * 4), (out, 4), (global, 4)] {
        assert_eq!(read(&mut orig, ptr, len), read(&mut copy, ptr, len), "contents at {ptr:#x}");
    }
    assert_eq!(read(&mut copy, global, 4), 6u32.to_le_bytes(), "the global moved on from its initial 5");
    let st = copy.streams[&STREAM];
    assert_eq!((st.flags, st.priority), (1, -1));
    // Events keep their recorded times: elapsed between them is exactly the
    // one measured before (all read against one clock at the capture and
    // one at the rebuild; a clock read per event shifted it, 31 us once
    // under load, past what rt_checkpoint allows).
    let (e0, e1) = (elapsed(&mut orig), elapsed(&mut copy));
    assert!(e0 >= 5.0, "elapsed {e0} ms");
    assert_eq!(e0.to_bits(), e1.to_bits(), "elapsed {e0} ms before, {e1} ms after");
    let ev = copy.event(EV_B).unwrap().token;
    assert_eq!(copy.backend.event_query(ev), Ok(()));

    // Running on: the original and the rebuilt session compute the same.
    for s in [&mut orig, &mut copy] {
        tick(s, out);
        scale(s, data);
        tick(s, out);
        s.backend.ctx_synchronize(0).unwrap();
    }
    let after = read(&mut copy, data, N as u64 * 4);
    assert_eq!(read(&mut orig, data, N as u64 * 4), after);
    assert_eq!(read(&mut copy, out, 4), 8u32.to_le_bytes());
    // data[i] went (7i + 1) * 3 + 6, then * 3 + 7.
    let want: Vec<u8> = (0..N).flat_map(|i| (((i * 7 + 1) * 3 + 6) * 3 + 7).to_le_bytes()).collect();
    assert_eq!(after, want);

    // New allocations never land on the restored ones.
    let fresh_ptr = copy.backend.mem_alloc(0, 1 << 20).unwrap();
    for (ptr, len) in [(data, N as u64 * 4), (out, 4), (global, 4)] {
        assert!(fresh_ptr >= ptr + len || fresh_ptr + (1 << 20) <= ptr, "{fresh_ptr:#x} overlaps {ptr:#x}");
    }
}

#[test]
fn a_rebuild_refuses_a_server_it_does_not_fit() {
    let mut orig = fresh(&backend("a"));
    session_in_mid_run(&mut orig);
    let (bytes, _) = snapshot(&mut orig, &ReplyWindow::default());
    let small = SimBackend::new(&SimConfig {
        devices: 1,
        memory: 1 << 20,
        compute_capability: (9, 0),
        seed: None,
        kernel_time_limit: Duration::from_secs(1),
        compiled_tier: true,
    })
    .unwrap();
    let mut r = &bytes[..];
    let opened = open(&mut r).unwrap();
    assert!(matches!(opened.check_fits(small.devices(), 90), Err(SnapshotError::Incompatible(_))));
    assert!(matches!(opened.check_fits(backend("x").devices(), 80), Err(SnapshotError::Incompatible(_))));
}

/// Virtual memory management objects travel (format version 2): two
/// physical allocations mapped back to back in a reservation, one of them
/// released (alive while mapped), a third unmapped whose bytes were written
/// through an earlier map. The rebuild has the same ranges at the same
/// addresses with the same bytes and access, and the objects behave as
/// before: the unmapped one shows its bytes when mapped again, the
/// released one goes with its last map.
#[test]
fn vmm_objects_are_rebuilt_at_their_addresses_with_their_bytes() {
    use crate::vmm::{ACCESS_READWRITE, GRANULARITY as G};
    let (a, b) = (backend("a"), backend("b"));
    let mut s = fresh(&a);
    session_in_mid_run(&mut s);
    let va = s.vmm.reserve(&mut *s.backend, 4 * G, 0, 0).unwrap();
    for h in [1, 2, 3] {
        s.vmm.create(&mut *s.backend, h, 0, G).unwrap();
    }
    s.vmm.map(&mut *s.backend, va, G, 0, 1).unwrap();
    s.vmm.map(&mut *s.backend, va + G, G, 0, 2).unwrap();
    s.vmm.map(&mut *s.backend, va + 3 * G, G, 0, 3).unwrap();
    s.vmm.set_access(&mut *s.backend, va, 2 * G, 0, ACCESS_READWRITE).unwrap();
    s.vmm.set_access(&mut *s.backend, va + 3 * G, G, 0, ACCESS_READWRITE).unwrap();
    let across: Vec<u8> = (0..64u32).map(|i| (i * 7 + 3) as u8).collect();
    write(&mut s, va + G - 32, &across);
    write(&mut s, va + 3 * G + 100, b"kept while unmapped");
    s.vmm.unmap(&mut *s.backend, va + 3 * G, G).unwrap();
    s.vmm.release(&mut *s.backend, 2).unwrap();
    let (bytes, c) = snapshot(&mut s, &ReplyWindow::default());
    assert_eq!(bytes[8], 2, "a snapshot with VMM objects is version 2");
    assert!(c.memory_bytes >= 3 * G, "{c:?}");

    let (mut copy, _, rebuilt) = rebuild_on(&b, &bytes).unwrap();
    assert_eq!(rebuilt.memory_bytes, c.memory_bytes);
    assert_eq!(copy.check_range(va, 2 * G), Ok(0), "the two maps, one range, accessible");
    assert!(copy.check_range(va + 2 * G, 1).is_err(), "no map where there was none");
    assert_eq!(read(&mut copy, va + G - 32, 64), across);
    assert_eq!(read(&mut copy, va, 2 * G), read(&mut s, va, 2 * G));
    // The unmapped allocation kept its bytes: mapped again, they are there.
    copy.vmm.map(&mut *copy.backend, va + 3 * G, G, 0, 3).unwrap();
    copy.vmm.set_access(&mut *copy.backend, va + 3 * G, G, 0, ACCESS_READWRITE).unwrap();
    assert_eq!(read(&mut copy, va + 3 * G + 100, 19), b"kept while unmapped");
    // Handle 2 was released: it cannot be mapped again, and unmapping it frees it.
    assert!(copy.vmm.map(&mut *copy.backend, va + 2 * G, G, 0, 2).is_err(), "a released allocation mapped again");
    copy.vmm.unmap(&mut *copy.backend, va + G, G).unwrap();
    assert!(copy.vmm.token(2).is_none(), "the released allocation outlived its last map");
    // The reservation is where it was: freeing it takes the same range.
    copy.vmm.unmap(&mut *copy.backend, va, G).unwrap();
    copy.vmm.unmap(&mut *copy.backend, va + 3 * G, G).unwrap();
    copy.vmm.address_free(&mut *copy.backend, va, 4 * G).unwrap();
}

#[test]
fn vmm_records_are_refused_in_a_version_1_snapshot_and_a_taken_range_fails_the_rebuild() {
    use crate::vmm::{ACCESS_READWRITE, GRANULARITY as G};
    let mut s = fresh(&backend("a"));
    let va = s.vmm.reserve(&mut *s.backend, G, 0, 0).unwrap();
    s.vmm.create(&mut *s.backend, 9, 0, G).unwrap();
    s.vmm.map(&mut *s.backend, va, G, 0, 9).unwrap();
    s.vmm.set_access(&mut *s.backend, va, G, 0, ACCESS_READWRITE).unwrap();
    let (mut bytes, _) = snapshot(&mut s, &ReplyWindow::default());
    let b = backend("b");
    // Where the range is taken already, the rebuild fails rather than
    // putting the program's pointers elsewhere.
    let mut r = &bytes[..];
    let opened = open(&mut r).unwrap();
    let mut taken = fresh(&b);
    assert_eq!(taken.vmm.reserve(&mut *taken.backend, G, 0, va).unwrap(), va);
    assert!(opened.rebuild(&mut taken).is_err(), "rebuilt with its reservation elsewhere");
    // Cut anywhere in the VMM records: an error.
    for cut in (12..bytes.len()).step_by(97) {
        assert!(rebuild_on(&b, &bytes[..cut]).is_err(), "cut at {cut}");
    }
    bytes[8] = 1;
    match rebuild_on(&b, &bytes) {
        Err(SnapshotError::Malformed(m)) => assert!(m.contains("version 1"), "{m}"),
        other => panic!("VMM records in a version 1 snapshot: {:?}", other.err()),
    }
}

#[test]
fn queued_work_that_does_not_finish_in_time_refuses_the_capture() {
    let mut s = fresh(&backend("a"));
    let (_, out) = session_in_mid_run(&mut s);
    s.backend.ctx_synchronize(0).unwrap();
    // A kernel that spins far longer than the bound.
    let busy = ".version 8.0\n.target sm_90\n.address_size 64\n\
.visible .entry spin(.param .u64 out)\n{\n\t.reg .pred %p<2>;\n\t.reg .b32 %r<3>;\n\t.reg .b64 %rd<2>;\n\
\tld.param.u64 %rd1, [out];\n\tmov.u32 %r1, 0;\n$L__loop:\n\tadd.u32 %r1, %r1, 1;\n\tsetp.lt.u32 %p1, %r1, 400000000;\n\
\t@%p1 bra $L__loop;\n\tst.global.u32 [%rd1], %r1;\n\tret;\n}\n";
    let held = s.input.modules.charge(busy.len() as u64).unwrap();
    crate::command::module::install(&mut s, 77, 0, busy.as_bytes().to_vec(), held, None).unwrap();
    let dims = LaunchDims { grid: [1, 1, 1], block: [1, 1, 1], shared_mem_bytes: 0, cooperative: false };
    let (token, _) = s.check_launch(77, 0, &dims, 8).unwrap();
    s.backend.launch_kernel(token, 0, &dims, StreamRef::Default { device: 0 }, &out.to_le_bytes()).unwrap();
    let mut bytes = Vec::new();
    let e = capture(&mut s, &meta(), &ReplyWindow::default(), Duration::from_millis(50), &mut bytes, None).unwrap_err();
    assert!(matches!(e, SnapshotError::Busy(_)), "{e}");
    assert!(bytes.is_empty());
    // Stop the spinning kernel so the test ends quickly.
    s.ended.store(true, std::sync::atomic::Ordering::Relaxed);
}

#[test]
fn a_cut_or_corrupted_snapshot_is_an_error_never_a_panic() {
    let mut orig = fresh(&backend("a"));
    session_in_mid_run(&mut orig);
    let mut window = ReplyWindow::default();
    window.keep(40, b"frame", None);
    let (bytes, _) = snapshot(&mut orig, &window);
    let b = backend("b");
    // Every cut: an error (most of them Truncated), never a session.
    let step = (bytes.len() / 300).max(1);
    for cut in (0..bytes.len()).step_by(step).chain([bytes.len() - 1]) {
        assert!(rebuild_on(&b, &bytes[..cut]).is_err(), "cut at {cut} of {}", bytes.len());
    }
    // Flipped bytes in the metadata (outside the large bulk parts): errors or
    // a session, never a panic. A fixed pseudo-random sequence.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..400 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let mut bad = bytes.clone();
        let at = (x as usize) % bad.len().min(4096);
        bad[at] ^= (x >> 32) as u8 | 1;
        let _ = rebuild_on(&b, &bad);
    }
}

const GRAPH: u64 = 0x4700_0000_0000_0001;

/// Launches exec `handle` on the session's stream; the device bytes its
/// reply would stream (its staging), if any.
fn launch_graph(s: &mut SessionState, handle: u64) -> Option<crate::command::DeviceBytes> {
    use crate::command::graph::tests::Wire;
    use crate::command::{Bulk, BulkHandler};
    let (mut scratch, mut w) = (vec![], Wire(vec![], 0));
    let got = crate::command::graph::GraphLaunch { exec: handle, stream: STREAM }.apply(s, &mut Bulk::new(&mut w, 0, &mut scratch));
    let reply = got.unwrap_or_else(|e| panic!("graph launch: {e:?}"));
    s.backend.ctx_synchronize(0).unwrap();
    reply
}

/// A session in mid-run with an instantiated graph (scale, tick, the
/// counter copied to the host through the graph's staging, an event
/// record), launched once, its launch's reply kept for a resume.
fn session_with_a_graph(s: &mut SessionState) -> (u64, u64, ReplyWindow) {
    use crate::command::graph::{check, install, WireOp};
    use crate::command::launch::LaunchKernel;
    let (data, out) = session_in_mid_run(s);
    let kernel = |function, grid, block| {
        let dims = LaunchDims { grid: [grid, 1, 1], block: [block, 1, 1], shared_mem_bytes: 0, cooperative: false };
        WireOp::Kernel(LaunchKernel { module: MODULE, function, dims, stream: 0 })
    };
    let ops = vec![
        kernel(0, N.div_ceil(128), 128),
        kernel(1, 1, 1),
        WireOp::DtoH { src: out, size: 4 },
        WireOp::EventRecord(EV_B),
    ];
    let mut params = data.to_le_bytes().to_vec();
    params.extend_from_slice(&N.to_le_bytes());
    params.extend_from_slice(&out.to_le_bytes());
    let checked = check(s, 0, ops).unwrap();
    install(s, GRAPH, checked, params, None).unwrap();
    let staged = launch_graph(s, GRAPH).expect("the graph copies to the host");
    let mut window = ReplyWindow::default();
    window.keep(41, b"the launch's reply", Some(staged));
    (data, out, window)
}

/// An instantiated graph travels (format version 2): the rebuilt session
/// launches it by the same handle and computes what the original does, and
/// a kept launch reply still reads the graph's staging memory.
#[test]
fn a_graph_is_rebuilt_by_its_handle_and_a_kept_launch_reply_still_reads_its_staging() {
    let (a, b) = (backend("a"), backend("b"));
    let mut orig = fresh(&a);
    let (data, out, window) = session_with_a_graph(&mut orig);
    let (bytes, _) = snapshot(&mut orig, &window);
    assert_eq!(bytes[8], 2, "a snapshot with a graph is version 2");
    let staging = orig.graph_execs[&GRAPH].staging.unwrap();

    let (mut copy, _, mut rebuilt) = rebuild_on(&b, &bytes).unwrap();
    assert_eq!(copy.graph_execs[&GRAPH].staging, Some(staging), "the staging is where the kept reply reads it");
    let kept: Vec<_> = rebuilt.window.after(40).unwrap().map(|k| k.device.map(|d| (d.src, d.len))).collect();
    assert_eq!(kept, vec![Some((staging, 4))]);
    assert_eq!(read(&mut copy, staging, 4), read(&mut orig, staging, 4), "the staged counter a resume sends again");
    assert_eq!(read(&mut copy, staging, 4), 7u32.to_le_bytes());

    for s in [&mut orig, &mut copy] {
        let staged = launch_graph(s, GRAPH).unwrap();
        assert_eq!((staged.src, staged.len), (staging, 4));
    }
    assert_eq!(read(&mut copy, data, N as u64 * 4), read(&mut orig, data, N as u64 * 4));
    assert_eq!(read(&mut copy, staging, 4), 8u32.to_le_bytes(), "the counter, staged by the rebuilt graph's launch");
    assert_eq!(read(&mut copy, out, 4), read(&mut orig, out, 4));
    // data[i] went (7i + 1) * 3 + 6 (mid-run), * 3 + 6 (the first launch; tick comes after
    // scale), * 3 + 7 (the second).
    let want: Vec<u8> = (0..N).flat_map(|i| ((((i * 7 + 1) * 3 + 6) * 3 + 6) * 3 + 7).to_le_bytes()).collect();
    assert_eq!(read(&mut copy, data, N as u64 * 4), want);
    // Destroyed on the rebuilt session, its staging is freed like any exec's.
    crate::command::Handler::apply(crate::command::graph::GraphExecDestroy { handle: GRAPH }, &mut copy).unwrap();
    assert!(copy.graph_execs.is_empty());
}

#[test]
fn a_session_without_graphs_is_written_as_version_1_and_a_graph_there_is_refused() {
    let mut plain = fresh(&backend("a"));
    session_in_mid_run(&mut plain);
    let (bytes, _) = snapshot(&mut plain, &ReplyWindow::default());
    assert_eq!(bytes[8], 1, "servers that know only version 1 read it");
    let mut orig = fresh(&backend("a"));
    let (_, _, window) = session_with_a_graph(&mut orig);
    let (mut bytes, _) = snapshot(&mut orig, &window);
    bytes[8] = 1;
    match rebuild_on(&backend("b"), &bytes) {
        Err(SnapshotError::Malformed(m)) => assert!(m.contains("Graph record in a version 1"), "{m}"),
        other => panic!("a graph in a version 1 snapshot: {:?}", other.err()),
    }
}

/// A graph naming an event destroyed after its instantiation could not be
/// instantiated again: the capture is refused, nothing written, rather than
/// a snapshot that never restores.
#[test]
fn a_graph_naming_what_was_destroyed_since_refuses_the_capture() {
    let mut s = fresh(&backend("a"));
    let (_, _, window) = session_with_a_graph(&mut s);
    crate::command::Handler::apply(crate::command::event::EventDestroy { handle: EV_B }, &mut s).unwrap();
    let mut out = Vec::new();
    let e = capture(&mut s, &meta(), &window, Duration::from_secs(1), &mut out, None).unwrap_err();
    assert!(matches!(e, SnapshotError::NotCapturable(m) if m.contains("graph")), "{e}");
    assert!(out.is_empty());
    // Destroyed too (a request after the launch: its reply is no longer
    // kept), the session captures again.
    crate::command::Handler::apply(crate::command::graph::GraphExecDestroy { handle: GRAPH }, &mut s).unwrap();
    capture(&mut s, &meta(), &ReplyWindow::default(), Duration::from_secs(1), &mut out, None).unwrap();
}

/// Graph records are hostile input too: cuts and flipped bytes anywhere
/// are errors (or a session checked as any other), never a panic; a graph
/// whose operations name what the session lacks is refused.
#[test]
fn a_cut_or_corrupted_graph_record_is_an_error_never_a_panic() {
    let mut orig = fresh(&backend("a"));
    let (_, _, window) = session_with_a_graph(&mut orig);
    let (bytes, _) = snapshot(&mut orig, &window);
    let b = backend("b");
    let graph_at = bytes.len() - 200;
    for cut in graph_at..bytes.len() {
        assert!(rebuild_on(&b, &bytes[..cut]).is_err(), "cut at {cut} of {}", bytes.len());
    }
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..400 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let mut bad = bytes.clone();
        let at = graph_at + (x as usize) % (bytes.len() - graph_at);
        bad[at] ^= (x >> 32) as u8 | 1;
        let _ = rebuild_on(&b, &bad);
    }
    // The graph's kernel names a module the snapshot does not hold.
    let mut other = fresh(&backend("a"));
    let (_, _, window) = session_with_a_graph(&mut other);
    let module = MODULE.to_le_bytes();
    let (mut bytes, _) = snapshot(&mut other, &window);
    let ops_at = bytes.windows(9).rposition(|w| w[0] == 1 && w[1..] == module).expect("a kernel op");
    bytes[ops_at + 1] ^= 0x40;
    assert!(rebuild_on(&b, &bytes).is_err(), "a graph naming an unknown module was rebuilt");
}

/// Live migration's pre-copy: the session's memory sent while it runs, then
/// only what changed since (a kernel's output, one host-written chunk),
/// while it is held; a range freed meanwhile is dropped. The rebuild holds
/// exactly the original's bytes.
#[test]
fn a_precopied_session_sends_only_what_changed_since_and_rebuilds_the_same() {
    use super::precopy::{self, CHUNK};
    let (a, b) = (backend("a"), backend("b"));
    let mut orig = fresh(&a);
    let (data, out) = session_in_mid_run(&mut orig);
    orig.backend.ctx_synchronize(0).unwrap();
    let client = |s: &mut SessionState, size: u64| {
        let p = s.backend.mem_alloc(0, size).unwrap();
        s.allocs.insert(p, crate::state::Alloc { device: 0, size, owner: crate::state::Owner::Client });
        p
    };
    let big = client(&mut orig, 4 * CHUNK);
    let pattern: Vec<u8> = (0..4 * CHUNK).map(|i| (i % 251) as u8).collect();
    write(&mut orig, big, &pattern);
    let gone = client(&mut orig, 64 << 10);

    let peek = orig.backend.memory_peek().expect("the sim can be read while it runs");
    let mut wire = Vec::new();
    let sent = precopy::send(&*peek, &precopy::client_allocs(&orig), None, &mut wire).unwrap();
    assert_eq!(sent.len(), 4);
    // The program goes on meanwhile.
    scale(&mut orig, data);
    orig.backend.ctx_synchronize(0).unwrap();
    write(&mut orig, big + 2 * CHUNK + 100, b"changed");
    orig.backend.mem_free(gone).unwrap();
    orig.allocs.remove(&gone);

    let stale = precopy::stale(&sent, &orig);
    assert_eq!(stale, vec![gone]);
    precopy::send_stale(&stale, &mut wire).unwrap();
    let c = capture(&mut orig, &meta(), &ReplyWindow::default(), Duration::from_secs(10), &mut wire, Some(&sent)).unwrap();
    // `data` (one chunk, rewritten), one chunk of `big`, the module global (sent whole).
    assert_eq!(c.memory_sent, N as u64 * 4 + CHUNK + 4, "{c:?}");

    let mut r = &wire[..];
    let mut open_b = |_| -> Result<Box<dyn crate::backend::BackendSession>, SnapshotError> { Ok(b.open_session(None).unwrap()) };
    let staged = precopy::receive(&mut r, &[64 << 20], &mut open_b).unwrap().expect("ranges were staged");
    assert_eq!(staged.ranges.len(), 3, "the freed range was dropped");
    let opened = open(&mut r).unwrap().with_staged(staged.ranges);
    let mut copy = SessionState::new(staged.backend, 1).with_devices(b.devices());
    opened.rebuild(&mut copy).unwrap();
    for (ptr, len) in [(data, N as u64 * 4), (out, 4), (big, 4 * CHUNK)] {
        assert_eq!(read(&mut orig, ptr, len), read(&mut copy, ptr, len), "contents at {ptr:#x}");
    }
    assert!(!copy.allocs.contains_key(&gone));
    copy.backend.mem_alloc_at(0, gone, 64 << 10).expect("the dropped range is free on the target");

    // The same stream read as a file snapshot (no staging): refused.
    let c = backend("c");
    let mut r = &wire[..];
    let mut open_c = |_| -> Result<Box<dyn crate::backend::BackendSession>, SnapshotError> { Ok(c.open_session(None).unwrap()) };
    let staged = precopy::receive(&mut r, &[64 << 20], &mut open_c).unwrap().unwrap();
    let Err(e) = open(&mut r).unwrap().rebuild(&mut SessionState::new(staged.backend, 1).with_devices(c.devices())) else {
        panic!("a delta record rebuilt without a pre-copy")
    };
    assert!(e.to_string().contains("outside a migration"), "{e}");
}

/// A chunk the pre-copy could not read (its allocation went away and came
/// back) is sent again whatever it holds.
#[test]
fn a_precopy_chunk_it_could_not_read_is_sent_again() {
    use super::precopy::{self, CHUNK};
    let a = backend("a");
    let mut s = fresh(&a);
    let p = s.backend.mem_alloc(0, 2 * CHUNK).unwrap();
    s.allocs.insert(p, crate::state::Alloc { device: 0, size: 2 * CHUNK, owner: crate::state::Owner::Client });
    struct Blind;
    impl crate::backend::MemoryPeek for Blind {
        fn peek(&self, _: u32, _: u64, _: u64, at: u64, _: &mut [u8]) -> bool {
            at % (2 * CHUNK) != 0
        }
        fn with_held(&self, _: u32, _: u64, _: u64, _: &mut dyn FnMut(&[u8])) -> bool {
            false
        }
    }
    let sent = precopy::send(&Blind, &precopy::client_allocs(&s), None, &mut Vec::new()).unwrap();
    let runs = precopy::dirty_runs(&mut s, p, &sent[&p]).unwrap();
    assert_eq!(runs, vec![(0, CHUNK)], "the unread first chunk, and only it");
}

/// A leased session's pre-copy says first whose memory it is: the target
/// stages it against that lease's budget (too little budget refuses the
/// stream, with nothing left charged), and the snapshot that follows must
/// be of the same lease.
#[test]
fn a_leased_precopy_is_charged_to_its_lease_and_must_match_the_snapshot() {
    use super::precopy::{self, Whose, CHUNK};
    use crate::backend::{BackendSession, MemoryBudget};
    use std::sync::Arc;
    let (a, b) = (backend("a"), backend("b"));
    let mut orig = fresh(&a);
    let size = 8 * CHUNK;
    let p = orig.backend.mem_alloc(0, size).unwrap();
    orig.allocs.insert(p, crate::state::Alloc { device: 0, size, owner: crate::state::Owner::Client });
    let peek = orig.backend.memory_peek().unwrap();
    let whose = Whose { lease: 77, memory_limit: Some(4 << 20) };
    let mut wire = Vec::new();
    precopy::send(&*peek, &precopy::client_allocs(&orig), Some(whose), &mut wire).unwrap();
    precopy::send_stale(&[], &mut wire).unwrap();

    // Enough budget: the staged range is charged to it as it arrives.
    let budget = Arc::new(MemoryBudget::new(4 << 20));
    let mut seen = None;
    let mut open = |w: Option<Whose>| -> Result<Box<dyn BackendSession>, SnapshotError> {
        seen = w;
        Ok(b.open_session(Some(budget.clone())).unwrap())
    };
    let staged = precopy::receive(&mut &wire[..], &[64 << 20], &mut open).unwrap().expect("staged");
    assert_eq!(seen, Some(whose), "the target opens the staging session for the announced lease");
    assert_eq!(staged.whose, Some(whose));
    assert_eq!(budget.used(), size, "the staged range counts against the lease's budget");
    let lease = |lease, memory_limit| crate::lease::Admission {
        lease,
        generation: 1,
        memory_limit,
        deadline_ms: 0,
        devices: vec![0],
        pkey: None,
        compute_milli: 0,
    };
    staged.check_lease(Some(&lease(77, Some(4 << 20)))).expect("the same lease");
    for (other, why) in [(Some(lease(78, Some(4 << 20))), "another lease"), (Some(lease(77, None)), "another limit"), (None, "no lease")] {
        let e = staged.check_lease(other.as_ref()).expect_err(why);
        assert!(e.to_string().contains("pre-copy staged memory for lease"), "{why}: {e}");
    }
    drop(staged);
    assert_eq!(budget.used(), 0, "a refused stream leaves nothing charged");

    // Too little budget: refused at the range, nothing charged.
    let small = Arc::new(MemoryBudget::new(size / 2));
    let mut open = |_| -> Result<Box<dyn BackendSession>, SnapshotError> { Ok(b.open_session(Some(small.clone())).unwrap()) };
    let Err(e) = precopy::receive(&mut &wire[..], &[64 << 20], &mut open) else { panic!("staged past the lease's budget") };
    assert!(e.to_string().contains("pre-copied"), "{e}");
    assert_eq!(small.used(), 0);

    // An unleased stream stays as it was; an announcement after a range, or twice, is malformed.
    let mut unleased = Vec::new();
    precopy::send(&*peek, &precopy::client_allocs(&orig), None, &mut unleased).unwrap();
    precopy::send_stale(&[], &mut unleased).unwrap();
    let mut open = |w: Option<Whose>| -> Result<Box<dyn BackendSession>, SnapshotError> {
        assert_eq!(w, None);
        Ok(b.open_session(None).unwrap())
    };
    let staged = precopy::receive(&mut &unleased[..], &[64 << 20], &mut open).unwrap().unwrap();
    staged.check_lease(None).expect("no lease on either side");
    drop(staged);
    let header = &wire[..17];
    for bad in [[&unleased[..unleased.len() - 5], header].concat(), [header, header, &unleased[..]].concat()] {
        let mut open = |_| -> Result<Box<dyn BackendSession>, SnapshotError> { Ok(b.open_session(None).unwrap()) };
        let Err(e) = precopy::receive(&mut &bad[..], &[64 << 20], &mut open) else { panic!("a misplaced announcement was taken") };
        assert!(e.to_string().contains("tag 2"), "{e}");
    }
}
