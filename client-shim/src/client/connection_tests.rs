//! The I/O shell over an in-memory transport, against a fake server that
//! decodes requests with the protocol crate and answers (or misbehaves) as
//! each test scripts. Every test is bounded: a hang fails it.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rgpu_protocol::data_capnp::reply;
use rgpu_transport::Transport;

use super::connection::{Connection, Sink};
use super::session_core::{Tuning, FLUSH_THRESHOLD, INLINE_BULK};
use super::testing::{pair, within, Ask, FakeServer, MemTransport, Req, SendLog};
use super::ClientError;

const LIMIT: Duration = Duration::from_secs(20);
/// A host-to-device copy to this address fails on the fake server.
const FAIL_DST: u64 = 0xdead;
/// A device-to-host copy from this address fails on the fake server.
const FAIL_SRC: u64 = 0xbad;
const LAUNCH_FAILED: u32 = 719;
const INVALID_VALUE: u32 = 1;

fn no_flusher() -> Tuning {
    Tuning { flush_delay: None, ..Tuning::default() }
}

fn connect(tuning: Tuning) -> (Connection<MemTransport>, std::sync::Arc<SendLog>, MemTransport) {
    let (client, server) = pair();
    let log = client.log();
    (Connection::with_tuning(client, "mem-server", tuning).unwrap(), log, server)
}

fn pattern(src: u64, size: u64) -> Vec<u8> {
    (0..size).map(|i| (src as u8).wrapping_add(i as u8)).collect()
}

/// Answers like rgpu-server: requests in order, failed asynchronous ones
/// remembered (the first) and reported with the next reply. Returns every
/// request seen once the client hangs up.
fn well_behaved(t: MemTransport) -> JoinHandle<Vec<Req>> {
    std::thread::spawn(move || {
        let mut s = FakeServer::new(t);
        let mut seen = Vec::new();
        let mut deferred = 0u32;
        while let Some(req) = s.next() {
            if !req.wants_reply {
                if req.ask == (Ask::HtoD { dst: FAIL_DST }) && deferred == 0 {
                    deferred = LAUNCH_FAILED;
                }
            } else {
                let d = std::mem::take(&mut deferred);
                match req.ask {
                    Ask::MemAlloc { size: 0 } => s.reply(req.seq, INVALID_VALUE, d, &[]),
                    Ask::MemAlloc { size } => s.reply_with(req.seq, 0, d, |mut r| r.set_mem_alloc(0x1000_0000 + size), &[]),
                    Ask::DtoH { src: FAIL_SRC, .. } => s.reply(req.seq, INVALID_VALUE, d, &[]),
                    Ask::DtoH { src, size } => s.reply(req.seq, 0, d, &pattern(src, size)),
                    _ => s.reply(req.seq, 0, d, &[]),
                }
            }
            seen.push(req);
        }
        seen
    })
}

fn ping(c: &Connection<MemTransport>) -> Result<(), ClientError> {
    c.call(|mut r| r.set_ping(()), &[], Sink::None, |_| Ok(()))
}

fn alloc(c: &Connection<MemTransport>, size: u64) -> Result<u64, ClientError> {
    c.call(
        |r| r.init_mem_alloc().set_size(size),
        &[],
        Sink::None,
        |rep| match rep.which() {
            Ok(reply::MemAlloc(p)) => Ok(p),
            _ => Err(ClientError::Cuda(999)),
        },
    )
}

fn htod(c: &Connection<MemTransport>, dst: u64, bytes: &[u8]) -> Result<(), ClientError> {
    c.post(|r| r.init_memcpy_hto_d().set_dst(dst), bytes)
}

/// A synchronous host-to-device copy (the caller's buffer is held until the reply).
fn htod_sync(c: &Connection<MemTransport>, dst: u64, bytes: &[u8]) -> Result<(), ClientError> {
    c.call(|r| r.init_memcpy_hto_d().set_dst(dst), bytes, Sink::None, |_| Ok(()))
}

fn dtoh(c: &Connection<MemTransport>, src: u64, out: &mut [u8]) -> Result<(), ClientError> {
    let size = out.len() as u64;
    c.call(
        |r| {
            let mut m = r.init_memcpy_dto_h();
            m.set_src(src);
            m.set_size(size);
        },
        &[],
        Sink::Host(out),
        |_| Ok(()),
    )
}

/// # Safety
/// `out` must outlive the next synchronising call.
unsafe fn dtoh_async(c: &Connection<MemTransport>, src: u64, out: &mut [u8]) -> Result<(), ClientError> {
    let size = out.len() as u64;
    c.post_read(
        |r| {
            let mut m = r.init_memcpy_dto_h();
            m.set_src(src);
            m.set_size(size);
        },
        out.as_mut_ptr(),
        out.len(),
    )
}

// ---- sequence matching ----------------------------------------------------

#[test]
fn calls_get_their_own_replies() {
    within(LIMIT, || {
        let (c, _log, server) = connect(no_flusher());
        let srv = well_behaved(server);
        for size in 1..=20u64 {
            htod(&c, 0x100, &[size as u8; 8]).unwrap();
            assert_eq!(alloc(&c, size).unwrap(), 0x1000_0000 + size);
        }
        let mut buf = vec![0u8; 300];
        dtoh(&c, 7, &mut buf).unwrap();
        assert_eq!(buf, pattern(7, 300));
        drop(c);
        let seen = srv.join().unwrap();
        let seqs: Vec<u64> = seen.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, (1..=41).collect::<Vec<_>>(), "sequence numbers count up from 1 across posts and calls");
    });
}

#[test]
fn a_reply_with_the_wrong_sequence_number_breaks_the_connection() {
    within(LIMIT, || {
        let (c, log, server) = connect(no_flusher());
        let srv = std::thread::spawn(move || {
            let mut s = FakeServer::new(server);
            let r = s.next().unwrap();
            s.reply(r.seq, 0, 0, &[]);
            let r = s.next().unwrap();
            // Answers as if an older request were due.
            s.reply(r.seq + 5, 0, 0, &[]);
            // The client gives up on the connection: nothing more arrives.
            assert!(s.next().is_none());
        });
        ping(&c).unwrap();
        let e = ping(&c).unwrap_err();
        assert!(matches!(&e, ClientError::Protocol { reason, .. } if reason.contains("#7") && reason.contains("#2")), "{e}");
        srv.join().unwrap();
        // Fails fast, with the same error, sending nothing.
        let sends = log.count();
        let t = Instant::now();
        assert!(matches!(ping(&c), Err(ClientError::Protocol { .. })));
        assert!(matches!(htod(&c, 1, &[0; 4]), Err(ClientError::Protocol { .. })));
        assert!(matches!(c.flush(), Err(ClientError::Protocol { .. })));
        assert!(t.elapsed() < Duration::from_secs(1));
        assert_eq!(log.count(), sends);
    });
}

#[test]
fn a_reply_to_a_request_that_wanted_none_is_a_protocol_error() {
    within(LIMIT, || {
        let (c, _log, server) = connect(no_flusher());
        let srv = std::thread::spawn(move || {
            let mut s = FakeServer::new(server);
            let post = s.next().unwrap();
            assert!(!post.wants_reply);
            let call = s.next().unwrap();
            s.reply(post.seq, 0, 0, &[]);
            s.reply(call.seq, 0, 0, &[]);
        });
        htod(&c, 1, &[1, 2, 3]).unwrap();
        let e = ping(&c).unwrap_err();
        assert!(matches!(&e, ClientError::Protocol { reason, .. } if reason.contains("reply #1 arrived while #2 was due")), "{e}");
        srv.join().unwrap();
    });
}

// ---- deferred errors --------------------------------------------------------

#[test]
fn an_async_error_surfaces_at_the_next_sync_call_exactly_once() {
    within(LIMIT, || {
        let (c, _log, server) = connect(no_flusher());
        let srv = well_behaved(server);
        htod(&c, FAIL_DST, &[0; 16]).unwrap();
        htod(&c, 0x100, &[0; 16]).unwrap();
        assert!(matches!(ping(&c), Err(ClientError::Cuda(LAUNCH_FAILED))));
        ping(&c).unwrap();
        assert_eq!(alloc(&c, 5).unwrap(), 0x1000_0005);
        drop(c);
        srv.join().unwrap();
    });
}

/// A release the server did comes back done even when an older asynchronous error rides on
/// its reply (the caller forgets what was released, then returns the error); one the server
/// refused is an error. Before, both were the same error, and the shim kept a mapping the
/// server had unmapped, so its reservation could never be freed.
#[test]
fn a_release_done_under_an_older_error_is_told_apart_from_one_refused() {
    within(LIMIT, || {
        let (c, _log, server) = connect(no_flusher());
        let srv = well_behaved(server);
        htod(&c, FAIL_DST, &[0; 16]).unwrap();
        assert_eq!(c.call_releasing(|mut r| r.set_ping(())).unwrap(), LAUNCH_FAILED, "done, with the older error");
        assert_eq!(c.call_releasing(|mut r| r.set_ping(())).unwrap(), 0, "the older error comes once");
        assert!(matches!(c.call_releasing(|r| r.init_mem_alloc().set_size(0)), Err(ClientError::Cuda(INVALID_VALUE))));
        htod(&c, FAIL_DST, &[0; 16]).unwrap();
        assert!(
            matches!(c.call_releasing(|r| r.init_mem_alloc().set_size(0)), Err(ClientError::Cuda(INVALID_VALUE))),
            "a refusal is its own error"
        );
        assert!(matches!(ping(&c), Err(ClientError::Cuda(LAUNCH_FAILED))), "and the older one stays for the next call");
        drop(c);
        srv.join().unwrap();
    });
}

#[test]
fn a_call_that_fails_itself_leaves_the_async_error_for_the_next_one() {
    within(LIMIT, || {
        let (c, _log, server) = connect(no_flusher());
        let srv = well_behaved(server);
        htod(&c, FAIL_DST, &[0; 16]).unwrap();
        assert!(matches!(alloc(&c, 0), Err(ClientError::Cuda(INVALID_VALUE))));
        assert!(matches!(ping(&c), Err(ClientError::Cuda(LAUNCH_FAILED))));
        ping(&c).unwrap();
        drop(c);
        srv.join().unwrap();
    });
}

#[test]
fn a_failed_async_read_defers_its_error_and_leaves_its_buffer_alone() {
    within(LIMIT, || {
        let (c, _log, server) = connect(no_flusher());
        let srv = well_behaved(server);
        let mut buf = vec![0xaau8; 64];
        unsafe { dtoh_async(&c, FAIL_SRC, &mut buf).unwrap() };
        assert!(matches!(ping(&c), Err(ClientError::Cuda(INVALID_VALUE))));
        assert!(buf.iter().all(|&b| b == 0xaa));
        ping(&c).unwrap();
        drop(c);
        srv.join().unwrap();
    });
}

// ---- asynchronous device-to-host -----------------------------------------

#[test]
fn async_reads_land_in_their_buffers_when_a_later_call_reads_past_them() {
    within(LIMIT, || {
        let (c, _log, server) = connect(no_flusher());
        // Replies trickle in: header, message and bulk in separate pieces.
        let srv = std::thread::spawn(move || {
            let mut s = FakeServer::new(server);
            while let Some(req) = s.next() {
                if !req.wants_reply {
                    continue;
                }
                let bulk = match req.ask {
                    Ask::DtoH { src, size } => pattern(src, size),
                    _ => Vec::new(),
                };
                let frame = super::testing::reply_frame(req.seq, 0, 0, &bulk);
                for piece in frame.chunks(frame.len() / 4 + 1) {
                    std::thread::sleep(Duration::from_millis(1));
                    s.send_raw(piece);
                }
            }
        });
        let mut a = vec![0u8; 5000];
        let mut b = vec![0u8; 100];
        let mut d = vec![0u8; INLINE_BULK * 2];
        unsafe {
            dtoh_async(&c, 1, &mut a).unwrap();
            dtoh_async(&c, 2, &mut b).unwrap();
            dtoh_async(&c, 3, &mut d).unwrap();
        }
        htod(&c, 0x100, &[9; 32]).unwrap();
        ping(&c).unwrap();
        assert_eq!(a, pattern(1, 5000));
        assert_eq!(b, pattern(2, 100));
        assert_eq!(d, pattern(3, d.len() as u64));
        drop(c);
        srv.join().unwrap();
    });
}

#[test]
fn a_read_answered_with_the_wrong_length_breaks_the_connection() {
    within(LIMIT, || {
        let (c, _log, server) = connect(no_flusher());
        let srv = std::thread::spawn(move || {
            let mut s = FakeServer::new(server);
            let r = s.next().unwrap();
            s.reply(r.seq, 0, 0, &[1; 10]);
            let _ = s.next();
        });
        let mut buf = vec![0u8; 64];
        unsafe { dtoh_async(&c, 1, &mut buf).unwrap() };
        let e = ping(&c).unwrap_err();
        assert!(matches!(&e, ClientError::Protocol { reason, .. } if reason.contains("10 bulk bytes where 64")), "{e}");
        assert!(buf.iter().all(|&b| b == 0));
        assert!(matches!(ping(&c), Err(ClientError::Protocol { .. })));
        srv.join().unwrap();
    });
}

// ---- batching ---------------------------------------------------------------

#[test]
fn posts_leave_in_one_send_with_the_next_call() {
    within(LIMIT, || {
        let (c, log, server) = connect(no_flusher());
        let srv = well_behaved(server);
        for i in 0..10u64 {
            htod(&c, 0x100 + i, &[i as u8; 1024]).unwrap();
        }
        assert_eq!(log.count(), 0, "posts wait for a sync call");
        ping(&c).unwrap();
        assert_eq!(log.count(), 1, "ten posts and the call in one send");
        drop(c);
        let seen = srv.join().unwrap();
        assert_eq!(seen.len(), 11);
        assert!(seen[..10].iter().all(|r| !r.wants_reply));
        assert!(seen[10].wants_reply);
    });
}

#[test]
fn a_full_batch_leaves_without_a_sync_call() {
    within(LIMIT, || {
        let (c, log, server) = connect(no_flusher());
        let srv = well_behaved(server);
        let chunk = vec![5u8; INLINE_BULK];
        let fit = FLUSH_THRESHOLD / INLINE_BULK - 1;
        for _ in 0..fit {
            htod(&c, 0x100, &chunk).unwrap();
        }
        assert_eq!(log.count(), 0);
        htod(&c, 0x100, &chunk).unwrap();
        assert_eq!(log.count(), 1, "the post that filled the batch sent it");
        let r = &log.records()[0];
        assert_eq!(r.lens.len(), 1);
        assert!(r.lens[0] >= FLUSH_THRESHOLD);
        drop(c);
        assert_eq!(srv.join().unwrap().len(), fit + 1);
    });
}

#[test]
fn a_calls_large_payload_goes_out_from_the_callers_buffer() {
    within(LIMIT, || {
        let (c, log, server) = connect(no_flusher());
        let srv = well_behaved(server);
        let big: Vec<u8> = (0..(1u32 << 20)).map(|i| i as u8).collect();
        htod(&c, 0x100, &[1; 100]).unwrap();
        htod_sync(&c, 0x200, &big).unwrap();
        assert_eq!(log.count(), 1, "the batch leaves with the large payload");
        let r = &log.records()[0];
        assert_eq!(r.lens.len(), 2, "batch, then the payload itself");
        assert_eq!(r.lens[1], big.len());
        assert_eq!(r.ptrs[1], big.as_ptr() as usize, "sent from the caller's memory, not a copy");
        drop(c);
        let got = srv.join().unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].ask, Ask::HtoD { dst: 0x200 });
        assert!(got[1].bulk == big);
    });
}

#[test]
fn an_async_large_payload_is_copied_so_the_program_may_reuse_its_buffer() {
    within(LIMIT, || {
        let (c, _log, server) = connect(no_flusher());
        let srv = well_behaved(server);
        let mut big: Vec<u8> = (0..(200u32 << 10)).map(|i| i as u8).collect();
        let want = big.clone();
        htod(&c, 0x200, &big).unwrap();
        big.fill(0); // the program reuses its buffer once the call returned
        ping(&c).unwrap();
        drop(c);
        let got = srv.join().unwrap();
        assert!(got[0].bulk == want, "the bytes of the call's time were sent");
    });
}

// ---- the flusher --------------------------------------------------------------

#[test]
fn the_flusher_sends_a_lone_post_within_the_delay() {
    within(LIMIT, || {
        let delay = Duration::from_millis(100);
        let (c, log, server) = connect(Tuning { flush_delay: Some(delay), ..Tuning::default() });
        let srv = well_behaved(server);
        let t0 = Instant::now();
        htod(&c, 0x100, &[1; 64]).unwrap();
        htod(&c, 0x100, &[2; 64]).unwrap();
        assert!(log.wait_for(1, Duration::from_secs(10)), "the batch never left");
        let r = &log.records()[0];
        assert!(r.at >= t0 + delay, "left after {:?}, before the delay", r.at - t0);
        assert_eq!(log.count(), 1, "both posts in one send");
        // A second batch gets a deadline of its own.
        let t1 = Instant::now();
        htod(&c, 0x100, &[3; 64]).unwrap();
        assert!(log.wait_for(2, Duration::from_secs(10)));
        assert!(log.records()[1].at >= t1 + delay);
        drop(c);
        assert_eq!(srv.join().unwrap().len(), 3);
    });
}

#[test]
fn without_a_flusher_a_post_waits_for_a_sync_call() {
    within(LIMIT, || {
        let (c, log, server) = connect(no_flusher());
        let srv = well_behaved(server);
        htod(&c, 0x100, &[1; 64]).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(log.count(), 0);
        c.flush().unwrap();
        assert_eq!(log.count(), 1);
        htod(&c, 0x100, &[1; 64]).unwrap();
        ping(&c).unwrap();
        assert_eq!(log.count(), 2);
        drop(c);
        srv.join().unwrap();
    });
}

#[test]
fn dropping_the_connection_ends_the_flusher_and_closes_the_stream() {
    within(LIMIT, || {
        let (c, _log, server) = connect(Tuning { flush_delay: Some(Duration::from_millis(1)), ..Tuning::default() });
        let srv = well_behaved(server);
        ping(&c).unwrap();
        drop(c);
        // The server sees the end of the stream only if nothing holds it open.
        assert_eq!(srv.join().unwrap().len(), 1);
    });
}

/// Found as a flaky integration test: a call made after the exit-time
/// close (the CUDA runtime's own exit handlers run after ours) flushed into
/// the closed stream and reported "connection lost".
#[test]
fn a_call_after_close_is_refused_quietly_and_sends_nothing() {
    let log = within(LIMIT, || {
        crate::log_capture::captured(|| {
            let (c, sent, server) = connect(no_flusher());
            let srv = well_behaved(server);
            ping(&c).unwrap();
            c.close();
            let frames = sent.count();
            assert!(matches!(htod(&c, 1, &[0; 4]), Err(ClientError::Cuda(4))));
            assert!(matches!(ping(&c), Err(ClientError::Cuda(4))));
            assert!(matches!(c.flush(), Err(ClientError::Cuda(4))));
            assert_eq!(sent.count(), frames, "nothing is sent after the close");
            drop(c);
            srv.join().unwrap();
        })
        .1
    });
    assert!(!log.contains("lost"), "{log}");
}

// ---- a dead peer ------------------------------------------------------------

#[test]
fn a_peer_that_dies_mid_reply_fails_the_call_and_every_later_one() {
    within(LIMIT, || {
        let (c, log, server) = connect(Tuning { flush_delay: Some(Duration::from_millis(1)), ..Tuning::default() });
        let srv = std::thread::spawn(move || {
            let mut s = FakeServer::new(server);
            let r = s.next().unwrap();
            let frame = super::testing::reply_frame(r.seq, 0, 0, &[7; 4096]);
            s.send_raw(&frame[..frame.len() - 1000]);
            // Dropping `s` closes the stream mid-bulk.
        });
        let mut buf = vec![0u8; 4096];
        let e = dtoh(&c, 1, &mut buf).unwrap_err();
        assert!(matches!(&e, ClientError::Lost { .. }), "{e}");
        srv.join().unwrap();
        let sends = log.count();
        let t = Instant::now();
        assert!(matches!(ping(&c), Err(ClientError::Lost { .. })));
        assert!(matches!(htod(&c, 1, &[0; 4]), Err(ClientError::Lost { .. })));
        assert!(matches!(unsafe { dtoh_async(&c, 1, &mut buf) }, Err(ClientError::Lost { .. })));
        assert!(t.elapsed() < Duration::from_secs(1), "later calls must fail fast");
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(log.count(), sends, "nothing is sent on a broken connection");
    });
}

#[test]
fn a_peer_that_dies_while_async_reads_are_owed_fails_the_next_call() {
    within(LIMIT, || {
        let (c, _log, server) = connect(no_flusher());
        let srv = std::thread::spawn(move || {
            let mut s = FakeServer::new(server);
            let _ = s.next().unwrap();
            // Never answers; hangs up.
        });
        let mut buf = vec![0u8; 64];
        unsafe { dtoh_async(&c, 1, &mut buf).unwrap() };
        srv.join().unwrap();
        assert!(matches!(ping(&c), Err(ClientError::Lost { .. })));
        assert!(matches!(ping(&c), Err(ClientError::Lost { .. })));
        assert!(buf.iter().all(|&b| b == 0));
    });
}

#[test]
fn a_peer_gone_before_a_post_leaves_fails_the_flush() {
    within(LIMIT, || {
        let (c, _log, server) = connect(no_flusher());
        drop(server);
        htod(&c, 1, &[0; 4]).unwrap();
        assert!(matches!(c.flush(), Err(ClientError::Lost { .. })));
        assert!(matches!(htod(&c, 1, &[0; 4]), Err(ClientError::Lost { .. })));
    });
}

/// The session span: what a connection logs (here, that its peer died) is logged inside
/// `session{server=...}`, so the shim's log says which server each line is about.
#[test]
fn a_connections_events_are_logged_in_its_session_span() {
    let log = within(LIMIT, || {
        crate::log_capture::captured(|| {
            let (c, _log, server) = connect(no_flusher());
            drop(server);
            assert!(matches!(ping(&c), Err(ClientError::Lost { .. })));
        })
        .1
    });
    assert!(log.contains("session{server=mem-server}"), "{log}");
    assert!(log.contains("every later call to this device fails"), "{log}");
}

// ---- resuming a broken connection -------------------------------------------

struct Scripted(Vec<(MemTransport, u64)>);

impl super::redial::Redial<MemTransport> for Scripted {
    fn redial(&mut self, _last_reply: u64, _timeout: Duration) -> Result<(MemTransport, u64), super::redial::Redialed> {
        match self.0.pop() {
            Some(x) => Ok(x),
            None => Err(super::redial::Redialed::Failed(std::io::Error::other("nobody listens"))),
        }
    }
}

fn resumable(t: MemTransport, redials: Vec<(MemTransport, u64)>, reconnect: Duration) -> Connection<MemTransport> {
    let policy = super::redial::Policy { reconnect_timeout: reconnect, ..Default::default() };
    Connection::resumable(t, "mem", no_flusher(), Box::new(Scripted(redials)), policy).unwrap()
}

#[test]
fn a_call_cut_off_resumes_and_only_what_did_not_run_is_sent_again() {
    within(LIMIT, || {
        let (t1, s1) = pair();
        let (t2, s2) = pair();
        // The first server ran the two posts, then the connection broke
        // before it answered the call.
        let first = std::thread::spawn(move || {
            let mut s = FakeServer::new(s1);
            let got: Vec<u64> = (0..3).map(|_| s.next().unwrap().seq).collect();
            drop(s);
            got
        });
        let second = well_behaved(s2);
        let c = resumable(t1, vec![(t2, 2)], Duration::from_secs(5));
        htod(&c, 0x100, &[1; 100]).unwrap();
        htod(&c, 0x200, &[2; 100]).unwrap();
        let mut out = [0u8; 8];
        dtoh(&c, 0x300, &mut out).unwrap();
        assert_eq!(out.to_vec(), pattern(0x300, 8), "the call returned its reply, from the second server");
        assert_eq!(first.join().unwrap(), vec![1, 2, 3]);
        ping(&c).unwrap();
        drop(c);
        let again: Vec<u64> = second.join().unwrap().iter().map(|r| r.seq).collect();
        assert_eq!(again, vec![3, 4], "only the call is sent again, once; then the next request");
    });
}

#[test]
fn unacknowledged_posts_are_sent_again_with_their_bytes_exactly_once() {
    within(LIMIT, || {
        let (t1, s1) = pair();
        let (t2, s2) = pair();
        let first = std::thread::spawn(move || {
            let mut s = FakeServer::new(s1);
            let got: Vec<u64> = (0..4).map(|_| s.next().unwrap().seq).collect();
            drop(s);
            got
        });
        let second = well_behaved(s2);
        let c = resumable(t1, vec![(t2, 1)], Duration::from_secs(5));
        let mut buf = vec![0u8; 100 << 10];
        for v in 1..=3u8 {
            buf.fill(v);
            htod(&c, 0x100 * v as u64, &buf).unwrap();
        }
        buf.fill(0);
        ping(&c).unwrap();
        assert_eq!(first.join().unwrap(), vec![1, 2, 3, 4]);
        drop(c);
        let again = second.join().unwrap();
        assert_eq!(again.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![2, 3, 4], "the server had run #1");
        assert!(again[0].bulk == vec![2u8; 100 << 10] && again[1].bulk == vec![3u8; 100 << 10], "sent with their own bytes");
    });
}

#[test]
fn a_server_that_never_comes_back_fails_the_call_within_the_bound() {
    within(LIMIT, || {
        let (t1, s1) = pair();
        drop(s1);
        let bound = Duration::from_millis(300);
        let c = resumable(t1, Vec::new(), bound);
        let t0 = Instant::now();
        assert!(matches!(ping(&c), Err(ClientError::Lost { .. })));
        let took = t0.elapsed();
        assert!(took >= bound && took < bound + Duration::from_millis(500), "gave up after {took:?}");
        assert!(matches!(ping(&c), Err(ClientError::Lost { .. })), "and every later call fails at once");
    });
}

/// A redial that hears "suspended" for a while, then resumes.
struct SuspendedFor {
    answers: u32,
    then: Option<(MemTransport, u64)>,
}

impl super::redial::Redial<MemTransport> for SuspendedFor {
    fn redial(&mut self, _last_reply: u64, _timeout: Duration) -> Result<(MemTransport, u64), super::redial::Redialed> {
        if self.answers > 0 {
            self.answers -= 1;
            return Err(super::redial::Redialed::Suspended);
        }
        self.then.take().ok_or_else(|| super::redial::Redialed::Failed(std::io::Error::other("nobody listens")))
    }
}

/// A redial whose server holds the session (a checkpoint being written)
/// until `until`: each try is answered "held" after the server's short wait.
struct HeldUntil {
    until: Instant,
    then: Option<(MemTransport, u64)>,
    tries: u32,
}

impl super::redial::Redial<MemTransport> for HeldUntil {
    fn redial(&mut self, _last_reply: u64, timeout: Duration) -> Result<(MemTransport, u64), super::redial::Redialed> {
        self.tries += 1;
        let now = Instant::now();
        if now < self.until {
            // The server waits up to 200 ms for the hold to end, never
            // past the client's own bound on the try.
            let wait = (self.until - now).min(Duration::from_millis(200));
            if wait >= timeout {
                std::thread::sleep(timeout);
                return Err(super::redial::Redialed::Failed(std::io::Error::other("no answer in time")));
            }
            std::thread::sleep(wait);
            if Instant::now() < self.until {
                return Err(super::redial::Redialed::Held);
            }
        }
        self.then.take().ok_or_else(|| super::redial::Redialed::Failed(std::io::Error::other("nobody listens")))
    }
}

#[test]
fn a_session_held_for_a_long_checkpoint_is_waited_for_beyond_the_reconnect_bounds() {
    within(LIMIT, || {
        let (t1, s1) = pair();
        let (t2, s2) = pair();
        drop(s1);
        let second = well_behaved(s2);
        // Held for 1.5 s: five times the reconnect time, and more tries
        // than its attempts; a server that answers is not a silent one.
        let policy = super::redial::Policy { reconnect_timeout: Duration::from_millis(300), attempts: 2, ..Default::default() };
        let held = Duration::from_millis(1500);
        let redial = HeldUntil { until: Instant::now() + held, then: Some((t2, 0)), tries: 0 };
        let c = Connection::resumable(t1, "mem", no_flusher(), Box::new(redial), policy).unwrap();
        let t0 = Instant::now();
        ping(&c).unwrap();
        let took = t0.elapsed();
        // Resumed as the hold ended, not a poll interval later.
        assert!(took >= held - Duration::from_millis(50) && took < held + Duration::from_millis(300), "resumed after {took:?}");
        drop(c);
        assert_eq!(second.join().unwrap().iter().map(|r| r.seq).collect::<Vec<_>>(), vec![1], "the ping, once");
    });
}

/// A call on a connection that `redial` never resumes fails once `bound`
/// (of `policy`) has passed, naming `setting`.
fn gives_up_after(redial: Box<dyn super::redial::Redial<MemTransport>>, policy: super::redial::Policy, bound: Duration, setting: &'static str) {
    within(LIMIT, move || {
        let (t1, s1) = pair();
        drop(s1);
        let c = Connection::resumable(t1, "mem", no_flusher(), redial, policy).unwrap();
        let t0 = Instant::now();
        match ping(&c) {
            Err(e @ ClientError::Lost { .. }) => assert!(e.to_string().contains(setting), "{e}"),
            other => panic!("{other:?}"),
        }
        let took = t0.elapsed();
        assert!(took >= bound && took < bound + Duration::from_millis(800), "gave up after {took:?}");
    });
}

#[test]
fn a_session_held_past_its_bound_fails_the_call() {
    let bound = Duration::from_millis(700);
    let policy = super::redial::Policy { hold_timeout: bound, ..Default::default() };
    let redial = HeldUntil { until: Instant::now() + Duration::from_secs(3600), then: None, tries: 0 };
    gives_up_after(Box::new(redial), policy, bound, "RGPU_HOLD_TIMEOUT");
}

#[test]
fn a_suspended_lease_is_waited_for_beyond_the_reconnect_bounds_and_the_call_then_resumes() {
    within(LIMIT, || {
        let (t1, s1) = pair();
        let (t2, s2) = pair();
        drop(s1);
        let second = well_behaved(s2);
        // Four "suspended" answers take about 2 s: more than the reconnect
        // time and attempts, which are for a server that does not answer.
        let policy = super::redial::Policy { reconnect_timeout: Duration::from_millis(300), attempts: 2, ..Default::default() };
        let redial = SuspendedFor { answers: 4, then: Some((t2, 0)) };
        let c = Connection::resumable(t1, "mem", no_flusher(), Box::new(redial), policy).unwrap();
        let t0 = Instant::now();
        ping(&c).unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(1500), "resumed after {:?}", t0.elapsed());
        drop(c);
        assert_eq!(second.join().unwrap().iter().map(|r| r.seq).collect::<Vec<_>>(), vec![1], "the ping, once");
    });
}

#[test]
fn a_lease_suspended_past_its_bound_fails_the_call() {
    let bound = Duration::from_millis(700);
    let policy = super::redial::Policy { suspend_timeout: bound, ..Default::default() };
    gives_up_after(Box::new(SuspendedFor { answers: u32::MAX, then: None }), policy, bound, "RGPU_SUSPEND_TIMEOUT");
}

#[test]
fn keepalives_while_the_server_works_are_skipped() {
    within(LIMIT, || {
        let (c, _log, server) = connect(no_flusher());
        let srv = std::thread::spawn(move || {
            let mut s = FakeServer::new(server);
            let r = s.next().unwrap();
            let ka = rgpu_protocol::frame::FrameHeader::bare(rgpu_protocol::frame::Kind::Keepalive).encode();
            s.send_raw(&ka);
            s.send_raw(&ka);
            s.reply(r.seq, 0, 0, &[]);
            while s.next().is_some() {}
        });
        ping(&c).unwrap();
        drop(c);
        srv.join().unwrap();
    });
}

#[test]
fn dropping_the_connection_sends_the_orderly_close() {
    within(LIMIT, || {
        let (c, _log, mut server) = connect(no_flusher());
        drop(c);
        let mut hb = [0u8; rgpu_protocol::frame::HEADER_LEN];
        server.recv_exact(&mut hb).unwrap();
        assert_eq!(rgpu_protocol::frame::FrameHeader::decode(&hb).unwrap().kind, rgpu_protocol::frame::Kind::Close);
    });
}

#[test]
fn an_async_payload_over_the_copy_limit_is_sent_from_the_callers_buffer_and_acknowledged() {
    within(LIMIT, || {
        let (c, log, server) = connect(no_flusher());
        let srv = well_behaved(server);
        let big: Vec<u8> = (0..(1u32 << 20)).map(|i| (i * 3) as u8).collect();
        htod(&c, 0x200, &big).unwrap();
        // Returned: the server had the bytes and answered, so the program may reuse them.
        let r = &log.records()[0];
        assert_eq!(r.ptrs[1], big.as_ptr() as usize, "not copied");
        drop(c);
        let got = srv.join().unwrap();
        assert!(got[0].wants_reply, "the post asked for an acknowledgement");
        assert!(got[0].bulk == big);
    });
}
