//! Placement that sees the fabric (`fabric.rs`): servers' link capacities,
//! the bandwidth leases ask for, and the traffic heartbeats report. Heavy
//! leases leave a leaf whose servers are saturated, by reported traffic or
//! by bandwidth granted; granted bandwidth never passes a link's capacity
//! and comes back with the lease; and the tie-break never makes a policy's
//! own score worse.

use std::collections::{HashMap, HashSet};

use rgpu_pool_broker::config::Placement;
use rgpu_pool_broker::fabric::{Fabric, Load};
use rgpu_pool_broker::inventory::{GpuSpec, Server, ServerSpec};
use rgpu_pool_broker::placement::{self, Demand, Policy, Scope, ScoreCache, Unit};
use rgpu_pool_broker::policies::BestFit;
use rgpu_pool_broker::state::{BrokerError, Lease, LeaseRequest, Limits, Outcome, State, TenantPolicy};

/// 100Gb/s, in bytes/s.
const LINK: u64 = 12_500_000_000;
/// 10Gb/s.
const HEAVY: u64 = 1_250_000_000;

fn spec(id: &str, leaf: &str, gpus: u32) -> ServerSpec {
    ServerSpec {
        id: id.into(),
        node: id.into(),
        leaf: leaf.into(),
        spine: "s0".into(),
        partitions: vec!["default".into()],
        gpus: (0..gpus)
            .map(|i| {
                let mut uuid = [0u8; 16];
                uuid[..id.len().min(12)].copy_from_slice(&id.as_bytes()[..id.len().min(12)]);
                uuid[15] = i as u8;
                GpuSpec { uuid, ordinal: i, model: "H100".into(), memory: 80 << 30, sms: 132, healthy: true, health_reason: String::new() }
            })
            .collect(),
        transports: Vec::new(),
    }
}

/// A state whose tenant "t" may hold the whole test pool.
fn fresh(policy: Box<dyn Policy>) -> State {
    let t = TenantPolicy {
        partitions: vec!["default".into()],
        max_gpus: Some(64),
        max_leases: Some(200),
        ..TenantPolicy::default()
    };
    State::new(Limits::default(), HashMap::from([("t".to_string(), t)]), policy)
}

/// Leaf l1 (servers a0..a3) first, then l2 (b0..b3): without the fabric,
/// ties go to l1.
fn pool(policy: Box<dyn Policy>) -> State {
    let mut st = fresh(policy);
    for leaf in ["a", "b"] {
        for i in 0..4 {
            st.register_linked(spec(&format!("{leaf}{i}"), &format!("l-{leaf}"), 2), Some(LINK), 0);
        }
    }
    st
}

/// The broker's policies. (The trace simulator's best-fit baseline folds
/// "the first of equals" into its fraction scores, so it has no ties for
/// the fabric to break there: it is in the score test below.)
fn policies() -> Vec<(&'static str, fn() -> Box<dyn Policy>)> {
    vec![
        ("fgd-pack", || Placement::FgdPack.policy()),
        ("fgd", || Placement::Fgd.policy()),
        ("simple", || Placement::Simple.policy()),
    ]
}

fn ask(demand: Demand, bandwidth: u64) -> LeaseRequest {
    LeaseRequest { tenant: "t".into(), demand, ttl_ms: 60_000, bandwidth, ..LeaseRequest::default() }
}

fn whole(n: u32) -> Demand {
    Demand { gpus: n, ..Demand::default() }
}

fn fraction() -> Demand {
    Demand { memory: 20 << 30, compute_milli: 250, ..Demand::default() }
}

fn granted(o: Result<Outcome, BrokerError>) -> Lease {
    match o {
        Ok(Outcome::Granted(l)) => l,
        Ok(Outcome::Queued(t)) => panic!("queued as {t}"),
        Err(e) => panic!("{e}"),
    }
}

fn leaves(st: &State, l: &Lease) -> HashSet<String> {
    l.gpus.iter().map(|g| st.server(&g.server).unwrap().spec.leaf.clone()).collect()
}

/// No server's granted bandwidth is past its capacity, and each is the sum
/// of its live leases'.
fn check_books(st: &State) {
    let mut sum: HashMap<String, u64> = HashMap::new();
    for l in st.leases() {
        let on: HashSet<&str> = l.gpus.iter().map(|g| g.server.as_str()).collect();
        for s in on {
            *sum.entry(s.to_string()).or_default() += l.bandwidth;
        }
    }
    for s in &st.servers {
        let link = st.link(&s.spec.id).unwrap();
        assert!(link.capacity.is_none_or(|c| link.granted <= c), "{}: {link:?}", s.spec.id);
        assert_eq!(link.granted, sum.get(&s.spec.id).copied().unwrap_or(0), "{}", s.spec.id);
    }
}

#[test]
fn heavy_leases_leave_a_leaf_whose_servers_report_saturated_links() {
    for (name, make) in policies() {
        // The control: with nothing reported, ties go to the first leaf.
        let mut st = pool(make());
        let first = granted(st.request(ask(whole(1), HEAVY), 1, 0));
        assert_eq!(leaves(&st, &first), HashSet::from(["l-a".to_string()]), "{name}: the control");

        // l-a's servers carry 96% of their links (leases that asked
        // nothing), l-b's 10%.
        let mut st = pool(make());
        for s in 0..4 {
            st.report_load(&format!("a{s}"), Load { bytes_in: LINK / 100, bytes_out: LINK / 100 * 96 });
            st.report_load(&format!("b{s}"), Load { bytes_in: LINK / 10, bytes_out: 0 });
        }
        let mut on_b = 0;
        for (i, d) in [fraction(), whole(1), fraction(), whole(2), whole(1), fraction()].into_iter().enumerate() {
            let l = granted(st.request(ask(d.clone(), HEAVY), 10 + i as u64, 0));
            assert_eq!(leaves(&st, &l), HashSet::from(["l-b".to_string()]), "{name}: heavy lease {i} ({d:?}) on {l:?}");
            on_b += 1;
        }
        check_books(&st);
        eprintln!("{name}: {on_b} of 6 heavy leases on the free leaf");
    }
}

#[test]
fn heavy_leases_leave_a_leaf_whose_bandwidth_is_all_granted() {
    for (name, make) in policies() {
        // One lease per l-a server takes its whole link (and one GPU: its
        // other GPU stays free, and packing would prefer it); then l-b
        // joins.
        let mut st = fresh(make());
        for i in 0..4 {
            st.register_linked(spec(&format!("a{i}"), "l-a", 2), Some(LINK), 0);
        }
        for s in 0..4 {
            granted(st.request(ask(whole(1), LINK), 100 + s, 0));
        }
        for i in 0..4 {
            assert_eq!(st.link(&format!("a{i}")).unwrap().granted, LINK, "{name}: a{i}'s link is all granted");
            st.register_linked(spec(&format!("b{i}"), "l-b", 2), Some(LINK), 0);
        }
        check_books(&st);
        // The control: a lease that asks no bandwidth packs beside them
        // (FGD's measure alone does not pack).
        let light = granted(st.request(ask(fraction(), 0), 150, 0));
        if name != "fgd" {
            assert_eq!(leaves(&st, &light), HashSet::from(["l-a".to_string()]), "{name}: the control packs onto l-a");
        }
        assert!(st.release(light.id, 0));
        for i in 0..6u64 {
            let l = granted(st.request(ask(if i % 2 == 0 { fraction() } else { whole(1) }, HEAVY), 200 + i, 0));
            assert_eq!(leaves(&st, &l), HashSet::from(["l-b".to_string()]), "{name}: heavy lease {i} on {l:?}");
        }
        // Leases that ask no bandwidth still take l-a's free GPUs.
        for i in 0..16 {
            if st.request(ask(whole(1), 0), 300 + i, 0).is_err() {
                break;
            }
        }
        for s in 0..4 {
            assert_eq!(st.server(&format!("a{s}")).unwrap().free_whole, 0, "{name}: a{s}'s GPUs are used");
        }
        check_books(&st);
    }
}

#[test]
fn granted_bandwidth_never_passes_capacity_and_comes_back_with_the_lease() {
    let mut st = fresh(Placement::FgdPack.policy());
    st.register_linked(spec("x", "l1", 4), Some(HEAVY), 0);
    st.register_linked(spec("y", "l1", 4), Some(HEAVY), 0);
    let eight = HEAVY / 10 * 8;
    let a = granted(st.request(ask(whole(1), eight), 1, 0));
    // Packing would put the second beside the first; its link has 2Gb/s left.
    let b = granted(st.request(ask(whole(1), eight), 2, 0));
    assert_ne!(a.gpus[0].server, b.gpus[0].server, "{a:?} {b:?}");
    check_books(&st);
    // Both links hold 8 of 10 Gb/s: GPUs are free, bandwidth is not.
    match st.request(ask(whole(1), eight), 3, 0) {
        Err(BrokerError::Unavailable(_)) => {}
        Err(e) => panic!("busy, not {e}"),
        Ok(_) => panic!("granted past a link's capacity"),
    }
    // 2 Gb/s fits beside either.
    let small = granted(st.request(ask(fraction(), HEAVY / 5), 4, 0));
    check_books(&st);
    // More than any link carries: never.
    match st.request(ask(whole(1), HEAVY * 2), 5, 0) {
        Err(BrokerError::Invalid(why)) => assert!(why.contains("20Gb/s") && why.contains("10Gb/s"), "{why}"),
        Err(e) => panic!("refused as impossible, not {e}"),
        Ok(_) => panic!("granted more than a link carries"),
    }
    // Queued until a release gives the bandwidth back.
    let queued = match st.request(LeaseRequest { wait_ms: 10_000, ..ask(whole(1), eight) }, 6, 0) {
        Ok(Outcome::Queued(t)) => t,
        _ => panic!("queued"),
    };
    assert!(st.release(a.id, 10));
    let (_, events) = st.take_output();
    let got = events.iter().find_map(|e| match e {
        rgpu_pool_broker::state::Event::Granted { ticket, lease } if *ticket == queued => Some(lease.clone()),
        _ => None,
    });
    assert_eq!(got.expect("the queued lease granted on the release").gpus[0].server, a.gpus[0].server);
    check_books(&st);
    assert!(st.release(small.id, 20));
    check_books(&st);
    // A lease over several servers holds its bandwidth on each.
    let mut st = fresh(Placement::Simple.policy());
    st.register_linked(spec("x", "l1", 1), Some(HEAVY), 0);
    st.register_linked(spec("y", "l1", 1), Some(HEAVY), 0);
    let gang = granted(st.request(ask(whole(2), HEAVY / 2), 7, 0));
    assert_eq!(gang.gpus.len(), 2);
    assert_eq!((st.link("x").unwrap().granted, st.link("y").unwrap().granted), (HEAVY / 2, HEAVY / 2));
    check_books(&st);
}

#[test]
fn a_lease_s_bandwidth_is_durable_and_capacities_are_learnt_again() {
    let mut st = fresh(Placement::FgdPack.policy());
    st.register_linked(spec("x", "l1", 4), Some(HEAVY), 0);
    let l = granted(st.request(ask(whole(1), HEAVY / 2), 1, 0));
    let (changes, _) = st.take_output();
    // What the store writes (JSON), read back as a restart reads it.
    let stored: Vec<Lease> = changes
        .iter()
        .filter_map(|c| match c {
            rgpu_pool_broker::state::Change::Lease(l) => Some(serde_json::from_slice(&serde_json::to_vec(l).unwrap()).unwrap()),
            _ => None,
        })
        .collect();
    assert_eq!(stored, vec![l.clone()]);
    // A lease stored before the field existed has none.
    let mut old = serde_json::to_value(&l).unwrap();
    old.as_object_mut().unwrap().remove("bandwidth");
    assert_eq!(serde_json::from_value::<Lease>(old).unwrap().bandwidth, 0);

    let mut back = fresh(Placement::FgdPack.policy());
    back.restore(vec![(spec("x", "l1", 4), None)], stored, l.generation, 100);
    assert_eq!(back.link("x").unwrap().granted, HEAVY / 2, "the grant is restored with the lease");
    // Until the server registers again its capacity is unknown: leases
    // asking bandwidth wait; others do not.
    assert!(matches!(back.request(ask(whole(1), 1), 2, 100), Err(BrokerError::Unavailable(_))));
    granted(back.request(ask(whole(1), 0), 3, 100));
    back.register_linked(spec("x", "l1", 4), Some(HEAVY), 200);
    granted(back.request(ask(whole(1), HEAVY / 2), 4, 200));
    assert!(matches!(back.request(ask(whole(1), 1), 5, 200), Err(BrokerError::Unavailable(_))), "the link is full");
    check_books(&back);
}

fn servers(n: usize) -> Vec<Server> {
    (0..n).map(|i| Server::new(spec(&format!("s{i:02}"), &format!("l{}", i / 4), 1 + (i % 3) as u32), 0)).collect()
}

fn rng(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The policy's own score of where a fraction or one whole GPU went.
fn score_of(p: &dyn Policy, servers: &[Server], d: &Demand, slot: (usize, usize)) -> i64 {
    let s = &servers[slot.0];
    if d.is_fraction() {
        p.score_gpu(s, &s.gpus[slot.1], d)
    } else {
        p.score_unit(&Unit { scope: Scope::Node, free_whole: s.free_whole, gpus: s.healthy, servers: 1 }, d)
    }
}

/// Over random traffic reports, grants and releases, the fabric's choice
/// scores exactly what the policy's own choice does, every time; and it
/// does choose differently (the freer of equals) often.
#[test]
fn the_tie_break_never_makes_a_policy_score_worse() {
    let make: [(&str, fn() -> Box<dyn Policy>); 2] =
        [("simple", || Box::new(placement::FragmentationAware)), ("best-fit", || Box::new(BestFit::new()))];
    for (name, mk) in make {
        let policy = mk();
        let mut s = servers(24);
        let mut fabric = Fabric::default();
        for (i, x) in s.iter().enumerate() {
            fabric.place_server(i, &x.spec.leaf, Some(LINK), true);
        }
        let mut cache = ScoreCache::new();
        let mut live: Vec<(Vec<(usize, usize)>, Demand, u64)> = Vec::new();
        let mut seed = 7;
        let (mut moved, mut placed) = (0, 0);
        for step in 0..3000u64 {
            let r = rng(&mut seed);
            if r % 4 == 0 && !live.is_empty() {
                let (slots, d, id) = live.swap_remove((r / 4) as usize % live.len());
                for (si, gi) in slots {
                    let g = &mut s[si].gpus[gi];
                    let (m, c) = d.take_from(g);
                    g.used_memory -= m;
                    g.used_milli -= c;
                    g.holders.retain(|&h| h != id);
                    s[si].recount();
                }
                continue;
            }
            let si = (r >> 8) as usize % s.len();
            fabric.report(si, Load { bytes_in: 0, bytes_out: (r >> 16) % LINK });
            let d = if (r >> 40) % 2 == 0 {
                Demand { memory: [8u64, 20, 40][(r >> 42) as usize % 3] << 30, compute_milli: 100, ..Demand::default() }
            } else {
                whole(1)
            };
            let plain = placement::place(&s, &d, &|_| true, policy.as_ref());
            let seen = placement::place_cached_on(&s, &d, &|_| true, policy.as_ref(), &mut cache, &fabric.view(0));
            match (&plain, &seen) {
                (Ok(p), Ok(f)) => {
                    assert_eq!(
                        score_of(policy.as_ref(), &s, &d, f[0]),
                        score_of(policy.as_ref(), &s, &d, p[0]),
                        "{name} step {step}: {d:?} went to {f:?} instead of {p:?}"
                    );
                    placed += 1;
                    moved += (f[0].0 != p[0].0) as u32;
                }
                _ => assert_eq!(plain.is_ok(), seen.is_ok(), "{name} step {step}: {plain:?} vs {seen:?}"),
            }
            if let Ok(slots) = seen {
                for &(si, gi) in &slots {
                    let g = &mut s[si].gpus[gi];
                    let (m, c) = d.take_from(g);
                    g.used_memory += m;
                    g.used_milli += c;
                    g.holders.push(step + 1);
                    s[si].recount();
                }
                live.push((slots, d, step + 1));
            }
        }
        eprintln!("{name}: {placed} placed, {moved} sent to a freer server of equal score");
        assert!(placed > 500 && moved >= 10, "{name}: {placed} placed, {moved} moved");
    }
}

/// The broker's link metrics say what placement sees: each server's
/// capacity (none for an unbounded link), the bandwidth granted on it, and
/// the traffic it last reported.
#[test]
fn link_metrics_follow_capacity_grants_and_reported_traffic() {
    let mut st = pool(Placement::FgdPack.policy());
    st.register_linked(spec("u0", "l-u", 2), None, 0);
    let l = granted(st.request(LeaseRequest { demand: Demand { scope: Scope::Node, ..whole(1) }, ..ask(whole(1), HEAVY) }, 1, 0));
    let on = l.gpus[0].server.clone();
    st.report_load("a1", Load { bytes_in: 7_000, bytes_out: 9_000 });
    let m = rgpu_pool_broker::metrics::BrokerMetrics::new();
    m.refresh(&st);
    let text = m.render();
    let has = |line: &str| text.lines().any(|l| l == line);
    assert!(has(&format!("rgpu_broker_link_capacity_bytes_per_second{{server=\"a0\"}} {LINK}")), "{text}");
    assert!(!text.contains("rgpu_broker_link_capacity_bytes_per_second{server=\"u0\"}"), "an unbounded link has no capacity series\n{text}");
    assert!(has(&format!("rgpu_broker_link_granted_bytes_per_second{{server=\"{on}\"}} {HEAVY}")), "{text}");
    let other = if on == "b3" { "b2" } else { "b3" };
    assert!(has(&format!("rgpu_broker_link_granted_bytes_per_second{{server=\"{other}\"}} 0")), "{text}");
    assert!(has("rgpu_broker_link_traffic_bytes_per_second{server=\"a1\",direction=\"in\"} 7000"), "{text}");
    assert!(has("rgpu_broker_link_traffic_bytes_per_second{server=\"a1\",direction=\"out\"} 9000"), "{text}");
    assert!(!text.contains("rgpu_broker_link_traffic_bytes_per_second{server=\"a0\""), "nothing reported, no series\n{text}");
}
