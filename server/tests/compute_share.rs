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

/// `n` launches of 64 blocks of 64 threads counting to 1500 (enough
/// threads that a launch spreads over the cores, and blocks of about a
/// millisecond), queued together so the session stays busy on the device
/// while it waits for them.
fn launch_busy(c: &mut DataClient, out: u64, n: usize) {
    for _ in 0..n {
        c.launch(false, 1, 0, [64, 1, 1], [64, 1, 1], 0, &params(out, 1500));
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
    let got = compete(&[300, 700], Duration::from_secs(3));
    let ratio = got[1] as f64 / got[0].max(1) as f64;
    eprintln!("kernels done in 3 s with shares 300 and 700: {got:?} (ratio {ratio:.2}; 2.33 expected)");
    assert!((1.86..3.0).contains(&ratio), "700:300 should run about 2.33 times the kernels (the 300 share 30% of the time, ±5 points): {got:?}");

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
    // Timed in turns, best of five each, so a host busy with other work
    // slows both alike.
    let mut sessions = [busy_session(&addr, 1, 0, gpu), busy_session(&addr, 2, 100, gpu)];
    let mut best = [Duration::MAX; 2];
    for _ in 0..6 {
        for (i, (c, out)) in sessions.iter_mut().enumerate() {
            let t = Instant::now();
            launch_busy(c, *out, 1);
            best[i] = best[i].min(t.elapsed());
        }
    }
    let [whole, tenth] = best;
    let ratio = tenth.as_secs_f64() / whole.as_secs_f64();
    eprintln!("one kernel alone: whole GPU {whole:?}, a 100/1000 share {tenth:?} (ratio {ratio:.2})");
    assert!(ratio < 1.6, "an idle device is not held back for others (work-conserving): {ratio:.2}");
}
