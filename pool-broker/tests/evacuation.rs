//! Evacuation of unhealthy GPUs in the broker's state machine
//! (docs/migration.md "Evacuation of unhealthy devices"): a GPU reported
//! unhealthy takes no new lease and shows why; exactly the leases on it,
//! whole or fractional, are ordered to move, with the target choice and
//! fencing of a drain with migrate; one with no target stays, says why,
//! and is tried again when a server registers, a bounded number of times;
//! the health survives a restore; evacuation can be turned off.

mod fixtures;

use std::collections::HashMap;

use fixtures::{granted as grant, G16};
use rgpu_pool_broker::evacuation::{MAX_TRIES, RETRY_MS};
use rgpu_pool_broker::inventory::ServerSpec;
use rgpu_pool_broker::placement::{Demand, FragmentationAware};
use rgpu_pool_broker::state::{Lease, LeaseRequest, Limits, State};

const ECC: &str = "uncorrectable ECC error (injected)";

fn spec(id: &str, gpus: u32) -> ServerSpec {
    fixtures::server(id, gpus, "sim", G16)
}

fn request(gpus: u32, memory: u64, milli: u32) -> LeaseRequest {
    LeaseRequest {
        tenant: "t".into(),
        demand: Demand { gpus, memory, compute_milli: milli, ..Demand::default() },
        ttl_ms: 3_600_000,
        ..LeaseRequest::default()
    }
}


/// Server a:1 with two GPUs: a whole lease on one, two fractions on the
/// other. Returns the state, the whole lease, the fractions, and the
/// ordinal the fractions share.
fn pool(limits: Limits) -> (State, Lease, [Lease; 2], u32) {
    let mut s = State::new(limits, HashMap::new(), Box::new(FragmentationAware));
    s.register(spec("a:1", 2), 0);
    let whole = grant(&mut s, request(1, 0, 0), 11, 0);
    let f1 = grant(&mut s, request(0, G16 / 4, 250), 12, 0);
    let f2 = grant(&mut s, request(0, G16 / 4, 250), 13, 0);
    let shared = f1.gpus[0].ordinal;
    assert_eq!(f2.gpus[0].ordinal, shared, "the fractions share the GPU the whole lease left");
    assert_ne!(whole.gpus[0].ordinal, shared);
    (s, whole, [f1, f2], shared)
}

fn ordered(s: &mut State, server: &str, now: u64) -> Vec<u64> {
    let mut o: Vec<u64> = s.heartbeat(server, now).unwrap().orders.iter().map(|o| o.lease).collect();
    o.sort_unstable();
    o
}

#[test]
fn an_unhealthy_gpu_takes_no_lease_and_exactly_its_leases_move() {
    let (mut s, whole, [f1, f2], bad) = pool(Limits::default());
    let (changed, started) = s.report_health("a:1", &[(bad, false, ECC.into())], 10);
    assert_eq!(changed, vec![(bad, false, ECC.to_string())]);
    // No other server: nothing moves yet, and each lease says why.
    assert_eq!(started.len(), 2, "{started:?}");
    assert!(started.iter().all(|(_, r)| r.is_err()), "{started:?}");
    assert!(ordered(&mut s, "a:1", 11).is_empty());
    for f in [&f1, &f2] {
        let why = &s.lease(f.id).unwrap().move_error;
        assert!(why.contains("unhealthy GPU") && why.contains(ECC) && why.contains("no other server"), "{why}");
    }
    assert!(s.lease(whole.id).unwrap().move_error.is_empty(), "the whole lease is on a healthy GPU");
    // The reason is kept, and nothing new lands on the GPU though it has room.
    let gpu = s.server("a:1").unwrap().gpus.iter().find(|g| g.spec.ordinal == bad).unwrap().clone();
    assert!(!gpu.spec.healthy && gpu.spec.health_reason == ECC);
    assert!(s.request(request(0, G16 / 4, 250), 14, 12).is_err(), "a fraction landed on an unhealthy GPU");
    // Reported again unchanged: no change, no new try.
    assert!(s.report_health("a:1", &[(bad, false, ECC.into())], 13).0.is_empty());

    // A server registers: the fractions are ordered to it at once, the
    // whole lease is not.
    s.register(spec("b:1", 2), 20);
    assert_eq!(ordered(&mut s, "a:1", 21), vec![f1.id, f2.id]);
    for f in [&f1, &f2] {
        let m = s.lease(f.id).unwrap().moving.clone().expect("moving");
        assert_eq!(m.to, "b:1");
        assert_eq!(m.gpus[0].ordinal, bad, "a snapshot keeps the ordinal");
        assert!(m.generation > f.generation);
    }
    assert!(s.lease(whole.id).unwrap().moving.is_none());
    // Done: placed on b:1, fenced on a:1.
    s.move_reported("a:1", f1.id, Ok(()), 30).unwrap();
    s.move_reported("a:1", f2.id, Err("the target refused".into()), 30).unwrap();
    assert!(s.lease(f1.id).unwrap().gpus.iter().all(|g| g.server == "b:1"));
    assert!(s.lease(f2.id).unwrap().gpus.iter().all(|g| g.server == "a:1"), "a failed move leaves it");
    // The failed one is tried again after the retry interval.
    s.tick(30 + RETRY_MS + 1);
    assert_eq!(ordered(&mut s, "a:1", 30 + RETRY_MS + 2), vec![f2.id]);
    s.move_reported("a:1", f2.id, Ok(()), 30 + RETRY_MS + 3).unwrap();
    let hb = s.heartbeat("a:1", 40 + RETRY_MS).unwrap();
    assert_eq!(hb.live.iter().map(|l| l.0).collect::<Vec<_>>(), vec![whole.id], "only the whole lease stays on a:1");
    assert!(f1.generation <= hb.floor && f2.generation <= hb.floor);

    // Its other GPU fails: the whole lease moves too.
    let other = whole.gpus[0].ordinal;
    let (_, started) = s.report_health("a:1", &[(other, false, "Xid 79".into())], 50 + RETRY_MS);
    assert_eq!(started, vec![(whole.id, Ok("b:1".to_string()))]);
    assert_eq!(ordered(&mut s, "a:1", 51 + RETRY_MS), vec![whole.id]);

    // Healthy again: placeable again.
    let (changed, _) = s.report_health("a:1", &[(bad, true, String::new())], 60 + RETRY_MS);
    assert_eq!(changed, vec![(bad, true, String::new())]);
    let a = s.server("a:1").unwrap();
    assert!(a.gpus.iter().find(|g| g.spec.ordinal == bad).unwrap().spec.health_reason.is_empty());
    assert_eq!(a.healthy, 1);
    s.drain("b:1", None, false, 61 + RETRY_MS).unwrap();
    let l = grant(&mut s, request(0, G16 / 4, 250), 15, 62 + RETRY_MS);
    assert_eq!((l.gpus[0].server.as_str(), l.gpus[0].ordinal), ("a:1", bad));
}

#[test]
fn a_lease_with_no_target_is_tried_a_bounded_number_of_times() {
    let (mut s, _, [f1, _], bad) = pool(Limits::default());
    s.report_health("a:1", &[(bad, false, ECC.into())], 10);
    let mut now = 10;
    for _ in 0..MAX_TRIES + 5 {
        now += RETRY_MS;
        s.heartbeat("a:1", now);
        s.tick(now);
    }
    let why = s.lease(f1.id).unwrap().move_error.clone();
    assert!(why.contains("given up after"), "{why}");
    // Given up: a server that comes later is not tried any more (the
    // operator can drain with --migrate).
    s.register(spec("b:1", 2), now + 1);
    assert!(s.lease(f1.id).unwrap().moving.is_none());
    // Healthy, then failing again: tries start over.
    s.report_health("a:1", &[(bad, true, String::new())], now + 2);
    let (_, started) = s.report_health("a:1", &[(bad, false, ECC.into())], now + 3);
    assert!(started.iter().any(|(l, r)| *l == f1.id && r.as_deref() == Ok("b:1")), "{started:?}");
}

#[test]
fn health_survives_a_restore_and_registration_carries_it() {
    let (mut s, _, [f1, _], bad) = pool(Limits::default());
    s.report_health("a:1", &[(bad, false, ECC.into())], 10);
    let servers: Vec<_> = s.servers.iter().map(|x| (x.spec.clone(), x.drain)).collect();
    let leases: Vec<Lease> = s.leases().cloned().collect();
    let mut t = State::new(Limits::default(), HashMap::new(), Box::new(FragmentationAware));
    t.restore(servers, leases, s.generation(), 20);
    let g = t.server("a:1").unwrap().gpus.iter().find(|g| g.spec.ordinal == bad).unwrap().clone();
    assert!(!g.spec.healthy && g.spec.health_reason == ECC, "restored: {g:?}");
    // The server registers again with its GPUs' health as it sees it.
    let mut again = spec("a:1", 2);
    again.gpus[bad as usize].healthy = false;
    again.gpus[bad as usize].health_reason = ECC.into();
    t.register(again, 30);
    assert!(!t.server("a:1").unwrap().gpus[bad as usize].spec.healthy);
    t.register(spec("b:1", 2), 31);
    assert!(t.lease(f1.id).unwrap().moving.is_some(), "the restored broker evacuates");
    // Registered healthy (the fault cleared while the broker was away).
    let mut u = State::new(Limits::default(), HashMap::new(), Box::new(FragmentationAware));
    u.restore(s.servers.iter().map(|x| (x.spec.clone(), x.drain)).collect(), s.leases().cloned().collect(), s.generation(), 40);
    u.register(spec("a:1", 2), 41);
    assert!(u.server("a:1").unwrap().gpus.iter().all(|g| g.spec.healthy && g.spec.health_reason.is_empty()));
}

#[test]
fn with_evacuation_off_an_unhealthy_gpu_takes_nothing_new_and_keeps_its_leases() {
    let (mut s, _, [f1, f2], bad) = pool(Limits { evacuate_unhealthy: false, ..Limits::default() });
    s.register(spec("b:1", 2), 5);
    let (changed, started) = s.report_health("a:1", &[(bad, false, ECC.into())], 10);
    assert_eq!(changed.len(), 1);
    assert!(started.is_empty());
    for i in 1..=10 {
        s.heartbeat("a:1", 10 + i * RETRY_MS);
        s.heartbeat("b:1", 10 + i * RETRY_MS);
        s.tick(10 + i * RETRY_MS);
    }
    assert!(ordered(&mut s, "a:1", 11 + 10 * RETRY_MS).is_empty());
    assert!(s.lease(f1.id).unwrap().moving.is_none() && s.lease(f2.id).unwrap().moving.is_none());
    let l = grant(&mut s, request(0, G16 / 4, 250), 16, 12 + 10 * RETRY_MS);
    assert_eq!(l.gpus[0].server, "b:1", "not on the unhealthy GPU");
}

#[test]
fn the_metrics_count_unhealthy_gpus_and_stranded_leases() {
    let (mut s, _, _, bad) = pool(Limits::default());
    let m = rgpu_pool_broker::metrics::BrokerMetrics::new();
    let scrape = |s: &State| {
        m.refresh(s);
        m.render()
    };
    let text = scrape(&s);
    assert!(text.contains("rgpu_broker_gpus_unhealthy 0") && text.contains("rgpu_broker_leases_stranded 0"), "{text}");
    s.report_health("a:1", &[(bad, false, ECC.into())], 10);
    let text = scrape(&s);
    assert!(text.contains("rgpu_broker_gpus_unhealthy 1"), "{text}");
    assert!(text.contains("rgpu_broker_leases_stranded 2"), "both fractions wait for a target: {text}");
    s.register(spec("b:1", 2), 20);
    assert!(scrape(&s).contains("rgpu_broker_leases_stranded 0"), "moving: not stranded");
}
