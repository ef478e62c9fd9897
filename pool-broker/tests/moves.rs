//! A drain with migrate, in the broker's state machine: which server a
//! lease may move to (same GPU count and model, a free GPU at the same
//! ordinal, large enough), the move's listing at both ends while in flight,
//! its re-placement and fencing when the source reports it done, and a
//! move that failed, timed out, or survived a restore.

mod fixtures;

use std::collections::HashMap;

use fixtures::{server as spec, G16};
use rgpu_pool_broker::inventory::ServerSpec;
use rgpu_pool_broker::moves::MOVE_TIMEOUT_MS;
use rgpu_pool_broker::placement::{Demand, FragmentationAware};
use rgpu_pool_broker::state::{Change, Lease, LeaseRequest, Limits, Order, OrderKind, State};

fn lease(s: &mut State, gpus: u32, id: u64, now: u64) -> Lease {
    let req = LeaseRequest {
        tenant: "t".into(),
        demand: Demand { gpus, ..Demand::default() },
        ttl_ms: 600_000,
        ..LeaseRequest::default()
    };
    fixtures::granted(s, req, id, now)
}

/// A state with one lease on a:7767 holding both its GPUs, then the
/// candidate targets registered.
fn pool(targets: &[ServerSpec]) -> (State, Lease) {
    let mut s = State::new(Limits::default(), HashMap::new(), Box::new(FragmentationAware));
    s.register(spec("a:7767", 2, "sim", G16), 0);
    let l = lease(&mut s, 2, 11, 0);
    for t in targets {
        s.register(t.clone(), 0);
    }
    (s, l)
}

fn target_of(plan: &[(u64, Result<String, String>)], lease: u64) -> Result<String, String> {
    plan.iter().find(|(l, _)| *l == lease).expect("planned").1.clone()
}

#[test]
fn the_target_matches_the_source_gpus_at_their_ordinals() {
    // One GPU too few, another model, smaller GPUs: none fits.
    let (mut s, l) = pool(&[spec("c:1", 1, "sim", G16), spec("d:1", 2, "other", G16), spec("e:1", 2, "sim", G16 / 2)]);
    let plan = s.drain_migrate("a:7767", None, 10).unwrap();
    let why = target_of(&plan, l.id).unwrap_err();
    assert!(why.contains("e:1"), "names the last server it tried: {why}");
    assert!(s.lease(l.id).unwrap().moving.is_none());
    s.undrain("a:7767", 20).unwrap();

    // A matching server whose GPU 1 is leased, then one that is drained,
    // then one that fits.
    let (mut s, l) = pool(&[spec("f:1", 2, "sim", G16)]);
    let other = lease(&mut s, 1, 22, 5);
    assert_eq!(other.gpus[0].server, "f:1");
    let why = target_of(&s.drain_migrate("a:7767", None, 10).unwrap(), l.id).unwrap_err();
    assert!(why.contains("f:1") && why.contains("free"), "{why}");
    s.register(spec("g:1", 2, "SIM", G16), 10);
    s.drain("g:1", None, false, 10).unwrap();
    assert!(target_of(&s.drain_migrate("a:7767", None, 11).unwrap(), l.id).is_err(), "a drained target is no target");
    s.undrain("g:1", 12).unwrap();
    assert_eq!(target_of(&s.drain_migrate("a:7767", None, 13).unwrap(), l.id), Ok("g:1".to_string()));
    let m = s.lease(l.id).unwrap().moving.clone().unwrap();
    assert_eq!(m.gpus.iter().map(|g| g.ordinal).collect::<Vec<_>>(), vec![0, 1], "the same ordinals");
    assert!(m.gpus.iter().all(|g| g.server == "g:1"));
    // Asked again, the drain keeps the move it has.
    assert_eq!(target_of(&s.drain_migrate("a:7767", None, 14).unwrap(), l.id), Ok("g:1".to_string()));
    assert_eq!(s.lease(l.id).unwrap().moving.as_ref().unwrap().generation, m.generation);
}

#[test]
fn a_move_is_listed_at_both_ends_then_placed_on_the_target_and_fenced() {
    let (mut s, l) = pool(&[spec("b:1", 2, "sim", G16)]);
    let _ = s.take_output();
    let plan = s.drain_migrate("a:7767", None, 10).unwrap();
    assert_eq!(target_of(&plan, l.id), Ok("b:1".to_string()));
    let (changes, _) = s.take_output();
    assert!(
        changes.iter().any(|c| matches!(c, Change::Lease(x) if x.id == l.id && x.moving.is_some())),
        "the move is persisted with the lease"
    );
    let g2 = s.lease(l.id).unwrap().moving.as_ref().unwrap().generation;
    assert!(g2 > l.generation);

    let a = s.heartbeat("a:7767", 20).unwrap();
    assert_eq!(a.live, vec![(l.id, l.generation, l.deadline)], "the source keeps its generation");
    assert_eq!(a.orders, vec![Order { lease: l.id, generation: g2, target: "b:1".into(), kind: OrderKind::Migrate }]);
    let b = s.heartbeat("b:1", 20).unwrap();
    assert_eq!(b.live, vec![(l.id, g2, l.deadline)], "the target lists it at the move's generation");
    assert!(b.orders.is_empty());
    assert!(b.floor >= g2);

    // The target's GPUs are held for the move.
    let req = LeaseRequest { tenant: "u".into(), demand: Demand { gpus: 1, ..Demand::default() }, ttl_ms: 1000, ..LeaseRequest::default() };
    assert!(s.request(req.clone(), 33, 25).is_err(), "nothing free: a is drained, b is reserved");

    // Only the source may report, and only a lease that moves.
    assert!(s.move_reported("b:1", l.id, Ok(()), 30).is_err());
    assert!(s.move_reported("a:7767", 999, Ok(()), 30).is_err());
    assert_eq!(s.move_reported("a:7767", l.id, Ok(()), 30), Ok("b:1".to_string()));
    let moved = s.lease(l.id).unwrap().clone();
    assert!(moved.moving.is_none());
    assert_eq!(moved.generation, g2);
    assert!(moved.gpus.iter().all(|g| g.server == "b:1"));
    assert!(s.move_reported("a:7767", l.id, Ok(()), 31).is_err(), "reported once");

    let a = s.heartbeat("a:7767", 40).unwrap();
    assert!(a.live.is_empty() && a.orders.is_empty(), "not listed at the source");
    assert!(l.generation <= a.floor, "the old placement's generation is fenced");
    assert_eq!(s.heartbeat("b:1", 40).unwrap().live, vec![(l.id, g2, l.deadline)]);
    let a_server = s.server("a:7767").unwrap();
    assert_eq!(s.server_use(a_server).4, 0, "the source holds no lease");
    // a is drained and b is full: still no room, and b counts one lease.
    assert!(s.request(req, 34, 45).is_err());
    assert_eq!(s.server_use(s.server("b:1").unwrap()).4, 1);
}

#[test]
fn a_failed_or_silent_move_leaves_the_lease_on_its_source() {
    let (mut s, l) = pool(&[spec("b:1", 2, "sim", G16)]);
    s.drain_migrate("a:7767", None, 10).unwrap();
    s.move_reported("a:7767", l.id, Err("the target refused: no room".into()), 20).unwrap();
    let kept = s.lease(l.id).unwrap().clone();
    assert!(kept.moving.is_none());
    assert_eq!(kept.generation, l.generation);
    assert!(kept.gpus.iter().all(|g| g.server == "a:7767"));
    assert!(kept.move_error.contains("no room"));
    assert!(s.heartbeat("b:1", 30).unwrap().live.is_empty(), "the target lists it no more");
    assert_eq!(s.heartbeat("a:7767", 30).unwrap().live.len(), 1);
    assert_eq!(s.server_use(s.server("b:1").unwrap()).1, 2, "the reservation is given back");
    // An overlong reason is cut.
    s.drain_migrate("a:7767", None, 40).unwrap();
    s.move_reported("a:7767", l.id, Err("x".repeat(100_000)), 41).unwrap();
    assert!(s.lease(l.id).unwrap().move_error.len() <= 1024);

    // A move never reported is abandoned after its timeout.
    s.drain_migrate("a:7767", None, 50).unwrap();
    let mut now = 50;
    while now <= 50 + MOVE_TIMEOUT_MS {
        now += 500;
        s.heartbeat("a:7767", now);
        s.heartbeat("b:1", now);
        s.tick(now);
    }
    let kept = s.lease(l.id).unwrap();
    assert!(kept.moving.is_none(), "abandoned");
    assert!(kept.move_error.contains("abandoned"), "{}", kept.move_error);
    assert!(kept.gpus.iter().all(|g| g.server == "a:7767"));
}

#[test]
fn a_move_in_flight_survives_a_restore_and_ends_with_its_lease() {
    let (mut s, l) = pool(&[spec("b:1", 2, "sim", G16)]);
    s.drain_migrate("a:7767", None, 10).unwrap();
    let servers: Vec<_> = s.servers.iter().map(|x| (x.spec.clone(), x.drain)).collect();
    let leases: Vec<Lease> = s.leases().cloned().collect();
    let mut t = State::new(Limits::default(), HashMap::new(), Box::new(FragmentationAware));
    t.restore(servers, leases, l.generation, 20);
    let m = t.lease(l.id).unwrap().moving.clone().expect("the move is restored");
    assert!(t.generation() >= m.generation, "the floor covers the move's generation");
    assert_eq!(t.heartbeat("a:7767", 30).unwrap().orders, vec![Order { lease: l.id, generation: m.generation, target: "b:1".into(), kind: OrderKind::Migrate }]);
    assert_eq!(t.server_use(t.server("b:1").unwrap()).1, 0, "the reservation is restored");
    assert!(t.release(l.id, 40));
    assert_eq!(t.server_use(t.server("b:1").unwrap()).1, 2, "released: the target's GPUs are free");
    assert!(t.heartbeat("b:1", 50).unwrap().live.is_empty());
}

#[test]
fn an_operator_moves_one_lease_to_the_server_it_names_or_to_any_that_fits() {
    let (mut s, l) = pool(&[spec("b:1", 2, "sim", G16), spec("c:1", 2, "sim", G16), spec("d:1", 1, "sim", G16)]);
    let why = |r: Result<Lease, rgpu_pool_broker::state::BrokerError>| r.unwrap_err().to_string();
    // Refusals say why and change nothing.
    assert!(why(s.move_lease(l.id, Some("a:7767"), 5)).contains("already"));
    assert!(why(s.move_lease(l.id, Some("z:1"), 5)).contains("no server z:1"));
    assert!(why(s.move_lease(l.id, Some("d:1"), 5)).contains("1 GPU(s)"), "a snapshot keeps device ordinals");
    assert!(why(s.move_lease(999, Some("b:1"), 5)).contains("not-found"));
    s.drain("c:1", None, false, 5).unwrap();
    assert!(why(s.move_lease(l.id, Some("c:1"), 6)).contains("takes no new leases"));
    s.undrain("c:1", 6).unwrap();
    assert!(s.lease(l.id).unwrap().moving.is_none());

    // The one named, not the first that fits; the source stays open.
    let moving = s.move_lease(l.id, Some("c:1"), 10).unwrap();
    let m = moving.moving.clone().expect("moving");
    assert_eq!(m.to, "c:1");
    assert!(m.generation > l.generation);
    assert!(s.server("a:7767").unwrap().schedulable(), "an operator's move drains nothing");
    let a = s.heartbeat("a:7767", 20).unwrap();
    assert_eq!(a.orders, vec![Order { lease: l.id, generation: m.generation, target: "c:1".into(), kind: OrderKind::Migrate }]);
    assert!(why(s.move_lease(l.id, Some("b:1"), 21)).contains("already moving to c:1"));
    assert_eq!(s.move_reported("a:7767", l.id, Ok(()), 30), Ok("c:1".to_string()));
    assert!(s.lease(l.id).unwrap().gpus.iter().all(|g| g.server == "c:1"));

    // Without a target: the first server that can take it.
    let back = s.move_lease(l.id, None, 40).unwrap();
    assert_eq!(back.moving.unwrap().to, "a:7767");
}

#[test]
fn a_suspended_lease_is_not_moved() {
    let (mut s, l) = pool(&[spec("b:1", 2, "sim", G16)]);
    s.hold(l.id, 10).unwrap();
    let e = s.move_lease(l.id, Some("b:1"), 11).unwrap_err().to_string();
    assert!(e.contains("suspended"), "{e}");
    assert!(s.lease(l.id).unwrap().moving.is_none());
}
