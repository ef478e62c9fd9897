//! A session that ends stops its work: the kernel running for it and the
//! launches it queued. Measured as this process's CPU time (the server runs
//! in it), so this file holds one test: nothing else may run beside it.
//! A client killed with ~500 launches queued kept the server's cores busy
//! for over 90 s, and a server told to stop waited for them.

mod common;

use std::time::{Duration, Instant};

use common::kernels::{params, BUSY_PTX};
use common::TestServer;


/// CPU time of this whole process (every thread), user and system.
fn cpu() -> Duration {
    // SAFETY: getrusage fills the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// When, after `from`, the process first spent a 25 ms window at under a
/// tenth of `busy` (its CPU time per second while the kernel ran): the work
/// had stopped by then. `None` within `max`.
fn idle_after(from: Instant, busy: f64, max: Duration) -> Option<Duration> {
    let window = Duration::from_millis(25);
    while from.elapsed() < max {
        let (t0, c0) = (Instant::now(), cpu());
        std::thread::sleep(window);
        let rate = (cpu() - c0).as_secs_f64() / t0.elapsed().as_secs_f64();
        if rate < busy / 10.0 {
            return Some(t0 - from);
        }
    }
    None
}

/// A session with 500 launches queued, each of which would run for minutes,
/// the first one running; and the process's CPU seconds per second then.
fn busy_session(srv: &TestServer) -> (common::DataClient, f64) {
    let mut c = srv.session();
    assert_eq!(c.load_module(1, BUSY_PTX.as_bytes()).result, 0);
    let out = c.alloc_ok(4);
    let p = params(out, 1_000_000);
    for _ in 0..500 {
        c.launch(false, 1, 0, [1 << 16, 1, 1], [256, 1, 1], 0, &p);
    }
    std::thread::sleep(Duration::from_millis(100));
    let (t0, c0) = (Instant::now(), cpu());
    std::thread::sleep(Duration::from_millis(500));
    let busy = (cpu() - c0).as_secs_f64() / t0.elapsed().as_secs_f64();
    assert!(busy > 0.1, "the first launch is running ({busy:.2} CPU s/s)");
    (c, busy)
}

#[test]
fn ended_sessions_stop_their_work() {
    let grace = Duration::from_millis(700);
    let srv = TestServer::start_limited(rgpu_server::limits::Limits { reconnect_grace: grace, ..Default::default() });

    // The client goes away (its process killed: the socket closes, no
    // orderly Close) with its launches still queued in the server's socket
    // buffer: the work goes on through the reconnect grace, then stops.
    let (c, busy) = busy_session(&srv);
    let gone = Instant::now();
    c.cut();
    std::thread::sleep(grace / 2);
    let c0 = cpu();
    std::thread::sleep(grace / 4);
    let during = (cpu() - c0).as_secs_f64() / (grace / 4).as_secs_f64();
    assert!(during > busy / 3.0, "the work went on within the grace ({during:.2} CPU s/s, {busy:.2} busy)");
    let stopped = idle_after(gone, busy, Duration::from_secs(5));
    eprintln!("cut connection: work stopped {stopped:?} after the cut (grace {grace:?})");
    let stopped = stopped.expect("the server still works 5 s after the client went away");
    assert!(stopped >= grace && stopped < grace + Duration::from_millis(300), "work stopped {stopped:?} after the cut");

    // The client closes in order (the shim at exit): its work stops at
    // once, launches still queued and all.
    let (c, busy) = busy_session(&srv);
    let gone = Instant::now();
    drop(c);
    let stopped = idle_after(gone, busy, Duration::from_secs(5));
    eprintln!("dropped connection: work stopped {stopped:?} after the close (busy: {busy:.2} CPU s/s)");
    let stopped = stopped.expect("the server still works 5 s after the client went away");
    assert!(stopped < Duration::from_millis(300), "work stopped only {stopped:?} after the close");
    let c0 = cpu();
    std::thread::sleep(Duration::from_millis(500));
    let after = (cpu() - c0).as_secs_f64() / 0.5;
    assert!(after < busy / 10.0, "no queued launch runs after the close ({after:.3} CPU s/s, {busy:.2} busy)");
    assert_eq!(srv.session().ping().result, 0, "the server serves new sessions");

    // The server stops (SIGTERM without a broker, or the second signal):
    // running work stops and the server is done at once.
    let _c = busy_session(&srv);
    let t = Instant::now();
    srv.stop();
    let took = t.elapsed();
    eprintln!("server stop with a kernel running: {took:?}");
    assert!(took < Duration::from_secs(1), "the server took {took:?} to stop");
}
