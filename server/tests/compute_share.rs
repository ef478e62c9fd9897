//! Compute shares on the sim: two leases sharing one GPU get device time in
//! proportion to their tokens' compute shares while both run kernels, and a
//! fractional lease alone gets the whole device.

mod common;

use std::sync::Barrier;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::kernels::{params, BUSY_PTX};
use common::{control_with_token, list_devices, DataClient, TestServer};
use rgpu_protocol::token::Claims;
use rgpu_server::config::PoolConfig;

const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

/// What each busy thread counts to: blocks of about a millisecond on the sim's compiled tier
/// (the scheduler hands cores over between blocks, so much shorter blocks would measure the
/// hand-over more than the shares).
const BUSY_COUNT: u32 = 9000;

/// The tests measure device time on the host's cores: one at a time.
static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn token(lease: u64, compute_milli: u16, gpu: [u8; 16]) -> Vec<u8> {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
    Claims {
        lease_id: lease,
        generation: 1,
        deadline_ms: now + 60_000,
        memory_limit: 0,
        tenant: format!("t{lease}"),
        gpus: vec![gpu],
        pkey: None,
        compute_milli,
        client_key: None,
    }
    .sign(KEY)
}

fn server() -> (TestServer, [u8; 16]) {
    let pool = PoolConfig { broker_key: Some(KEY.to_vec()), ..Default::default() };
    let srv = TestServer::start_pool(1, 64 << 20, Duration::from_secs(30), pool);
    let gpu = list_devices(&srv.addr.to_string())[0].uuid.clone().try_into().unwrap();
    (srv, gpu)
}

/// A session of the lease with `share`, with the busy kernel loaded and a
/// word to store into.
fn busy_session(addr: &str, lease: u64, share: u16, gpu: [u8; 16]) -> (DataClient, u64) {
    let h = control_with_token(addr, &token(lease, share, gpu)).expect("token admitted");
    let mut c = DataClient::attach(addr, h.session_id, &h.key).expect("attach");
    assert_eq!(c.load_module(1, BUSY_PTX.as_bytes()).result, 0);
    let out = c.alloc_ok(4);
    (c, out)
}

/// `n` launches of 64 blocks of 64 threads counting to [`BUSY_COUNT`] (enough
/// threads that a launch spreads over the cores, and blocks of about a
/// millisecond), queued together so the session stays busy on the device
/// while it waits for them.
fn launch_busy(c: &mut DataClient, out: u64, n: usize) {
    for _ in 0..n {
        c.launch(false, 1, 0, [64, 1, 1], [64, 1, 1], 0, &params(out, BUSY_COUNT));
    }
    assert_eq!(c.sync().result, 0);
}

/// Kernels each lease completes in `window` while all of them run.
fn compete(shares: &[u16], window: Duration) -> Vec<u32> {
    let (srv, gpu) = server();
    let addr = srv.addr.to_string();
    let start = Barrier::new(shares.len());
    std::thread::scope(|s| {
        let runs: Vec<_> = shares
            .iter()
            .enumerate()
            .map(|(i, &share)| {
                let (addr, start) = (&addr, &start);
                s.spawn(move || {
                    let (mut c, out) = busy_session(addr, 100 + i as u64, share, gpu);
                    launch_busy(&mut c, out, 1);
                    start.wait();
                    let end = Instant::now() + window;
                    let mut done = 0;
                    while Instant::now() < end {
                        launch_busy(&mut c, out, 4);
                        done += 4;
                    }
                    done
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

#[test]
fn leases_sharing_a_gpu_get_device_time_by_their_compute_shares() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    // Up to three runs: a client thread the host does not run for over
    // 100 ms (seen at load average 10) leaves its lease idle long enough to
    // rejoin at the others' clock and lose its lag, which no scheduler can
    // tell from a lease that stopped. A broken scheduler fails all three.
    let mut runs = Vec::new();
    for _ in 0..3 {
        let got = compete(&[300, 700], Duration::from_secs(3));
        let ratio = got[1] as f64 / got[0].max(1) as f64;
        eprintln!("kernels done in 3 s with shares 300 and 700: {got:?} (ratio {ratio:.2}; 2.33 expected)");
        runs.push(got);
        if (1.86..3.0).contains(&ratio) {
            break;
        }
    }
    let got = runs.last().unwrap();
    let ratio = got[1] as f64 / got[0].max(1) as f64;
    assert!(
        (1.86..3.0).contains(&ratio),
        "700:300 should run about 2.33 times the kernels (the 300 share 30% of the time, ±5 points): {runs:?}"
    );

    // The control: the same two sessions with equal shares run alike, so
    // the ratio above comes from the shares, not from which session came first.
    let even = compete(&[500, 500], Duration::from_secs(2));
    let ratio = even[1] as f64 / even[0].max(1) as f64;
    eprintln!("with shares 500 and 500: {even:?} (ratio {ratio:.2})");
    assert!((0.65..1.5).contains(&ratio), "equal shares, equal time: {even:?}");
}

#[test]
fn a_fractional_lease_alone_gets_the_whole_device() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let (srv, gpu) = server();
    let addr = srv.addr.to_string();
    let mut sessions = [busy_session(&addr, 1, 0, gpu), busy_session(&addr, 2, 100, gpu)];
    // Timed in adjacent pairs, the order alternating, and judged by the
    // median pair: a host busy with other work slows both of a pair alike.
    // Up to three runs: on a shared 2-core VM one core was seen taken from
    // the test for a whole run (the share then ran as on one core, 1.76),
    // which no scheduler here can tell from its own doing. One held back to
    // its share would take ten times as long and fails all three.
    let mut runs = Vec::new();
    for _ in 0..3 {
        let mut ratios = Vec::new();
        for turn in 0..8 {
            let mut took = [Duration::ZERO; 2];
            for k in 0..2 {
                let i = (k + turn) % 2;
                let (c, out) = &mut sessions[i];
                let t = Instant::now();
                launch_busy(c, *out, 1);
                took[i] = t.elapsed();
            }
            ratios.push(took[1].as_secs_f64() / took[0].as_secs_f64());
        }
        ratios.sort_by(f64::total_cmp);
        let median = (ratios[3] + ratios[4]) / 2.0;
        eprintln!("one kernel alone, a 100/1000 share against the whole GPU: median ratio {median:.2} of {ratios:.2?}");
        runs.push(median);
        if median < 1.6 {
            break;
        }
    }
    let median = *runs.last().unwrap();
    assert!(median < 1.6, "an idle device is not held back for others (work-conserving): {runs:.2?}");
}

/// Kernels done by `t` by a session whose launches completed at `done`
/// (`per` kernels each, in order), interpolated between completions, so a
/// window's rate has a finer grain than one batch.
fn done_by(done: &[Instant], per: usize, t: Instant) -> f64 {
    let i = done.partition_point(|&d| d <= t);
    if i == 0 || i == done.len() {
        return (i * per) as f64;
    }
    let (a, b) = (done[i - 1], done[i]);
    let part = (t - a).as_secs_f64() / (b - a).as_secs_f64();
    (i as f64 + part) * per as f64
}

fn rate(done: &[Instant], per: usize, from: Instant, to: Instant) -> f64 {
    (done_by(done, per, to) - done_by(done, per, from)) / (to - from).as_secs_f64()
}

/// `n` launches of `blocks` blocks as [`launch_busy`]'s, then a sync.
fn launch_blocks(c: &mut DataClient, out: u64, blocks: u32, n: usize) {
    for _ in 0..n {
        c.launch(false, 1, 0, [blocks, 1, 1], [64, 1, 1], 0, &params(out, BUSY_COUNT));
    }
    assert_eq!(c.sync().result, 0);
}

/// The target's hand-over through the chain: when the 700 share stops,
/// the 300 share gets at least 95% of the device within 1 s. Its rate
/// alone is read from 1 s to 3 s after the stop (the median of four half
/// seconds, so one slowed by other work on the host does not set it), and
/// within 1 s of the stop some half second must reach 95% of that: windows
/// adjacent in time, so that a host whose other work comes and goes over
/// seconds changes the reference little. While both run, the 300 share's
/// part of the blocks run is its share. (The scheduler's own test,
/// `when_one_group_stops_the_other_gets_every_core_within_a_second` in
/// share.rs, measures the cores each group holds.)
#[test]
fn when_one_share_stops_the_other_gets_the_device_within_a_second() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    // Up to three runs, as in the test above: on a shared 2-core host whose
    // other work comes and goes (builds at load average 5 took it to 92-94%
    // now and then), one run's windows can be slowed unevenly. A hand-over
    // that is slow fails all three.
    let mut runs = Vec::new();
    for _ in 0..3 {
        let (sharing, best) = hand_over();
        runs.push((sharing, best));
        if sharing < 0.4 && best >= 0.95 {
            break;
        }
    }
    let (sharing, best) = *runs.last().unwrap();
    assert!(sharing < 0.4, "while the 700 share runs, the 300 share is held to about 30%: {:.0}% ({runs:?})", 100.0 * sharing);
    assert!(best >= 0.95, "within 1 s of the other's stop, the 300 share reached {:.0}% of its rate alone ({runs:?})", 100.0 * best);
}

/// One run of the hand-over: (the 300 share's part while both run, the
/// best half second within 1 s of the stop against its rate alone).
fn hand_over() -> (f64, f64) {
    let (srv, gpu) = server();
    let addr = srv.addr.to_string();
    // The 300 share's batches are small (a fifth of a second alone or
    // less), so that half a second holds several; the 700 share's as in
    // the test above, so that it always has blocks waiting.
    const PER: usize = 3;
    const BLOCKS: u32 = 24;
    const BIG_PER: usize = 4;
    let (mut small, small_out) = busy_session(&addr, 300, 300, gpu);
    let (mut big, big_out) = busy_session(&addr, 700, 700, gpu);
    let ms = |m: u64| Duration::from_millis(m);
    let start = Instant::now();
    let compete_from = start + ms(500);
    let compete_until = start + ms(3500);
    let (done, (big_done, stopped)) = std::thread::scope(|s| {
        let bigger = s.spawn(move || {
            std::thread::sleep(compete_from.saturating_duration_since(Instant::now()));
            let mut done = Vec::new();
            while Instant::now() < compete_until {
                launch_busy(&mut big, big_out, BIG_PER);
                done.push(Instant::now());
            }
            // Its last kernel has ended: from here the device is free for the other.
            (done, Instant::now())
        });
        let mut done = Vec::new();
        let end = compete_until + ms(3500);
        while Instant::now() < end {
            launch_blocks(&mut small, small_out, BLOCKS, PER);
            done.push(Instant::now());
        }
        (done, bigger.join().unwrap())
    });
    let (from, to) = (compete_from + ms(700), compete_until - ms(100));
    // In blocks run: the two sessions' kernels differ.
    let (mine, theirs) = (rate(&done, PER, from, to) * BLOCKS as f64, rate(&big_done, BIG_PER, from, to) * 64.0);
    let sharing = mine / (mine + theirs);
    let mut tail: Vec<f64> = (0..4).map(|w| rate(&done, PER, stopped + ms(1000 + 500 * w), stopped + ms(1500 + 500 * w))).collect();
    tail.sort_by(f64::total_cmp);
    let alone = (tail[1] + tail[2]) / 2.0;
    let windows: Vec<f64> = (0..6).map(|w| rate(&done, PER, stopped + ms(100 * w), stopped + ms(100 * w + 500)) / alone).collect();
    let best = windows.iter().copied().fold(0.0, f64::max);
    eprintln!(
        "300 share: {:.0}% of the blocks run beside the 700 share; alone {alone:.2} kernels/s (1-3 s after the stop); \
         half seconds from 0, 0.1, .. 0.5 s after the stop: {:?} of that",
        100.0 * sharing,
        windows.iter().map(|w| format!("{:.0}%", 100.0 * w)).collect::<Vec<_>>(),
    );
    (sharing, best)
}
