//! Tests of `admission`.

use super::*;
use crate::base::ports::MemStore;
use crate::config::Config;
use crate::flow::priority::PrioritySource;
use crate::state::metrics::EndpointMetrics;

const NOW: u64 = 1_000_000;

fn cfg(extra: &str) -> Config {
    let json = format!(
        r#"{{"version":1,
                "endpoints":[{{"address":"10.0.0.1:8000","models":["m"]}},
                             {{"address":"10.0.0.2:8000","models":["m"]}},
                             {{"address":"10.0.0.3:8000","models":["other"]}}],
                "models":[{{"name":"m"}},{{"name":"other"}}],
                "saturation":{{"max_inflight_per_endpoint":2}},
                "flow_control":{{"enabled":true,"max_wait_ms":1000,"max_queue":3}}{extra}}}"#
    );
    Config::from_json(json.as_bytes()).unwrap()
}

fn ep(addr: &str, model: &str, age_ms: u64) -> EndpointStatus {
    EndpointStatus {
        address: addr.into(),
        models: vec![model.into()],
        metrics: Some(EndpointMetrics {
            queue: Some(0.0),
            kv_usage: Some(0.1),
            ..EndpointMetrics::default()
        }),
        scraped_ms: NOW - age_ms,
        failures: 0,
        inflight_at_scrape: None,
        role: Default::default(),
        poll_ms: 0,
    }
}

fn snap(version: u64, age_ms: u64) -> Snapshot {
    Snapshot {
        version,
        published_ms: NOW,
        endpoints: vec![
            ep("10.0.0.1:8000", "m", age_ms),
            ep("10.0.0.2:8000", "m", age_ms),
            ep("10.0.0.3:8000", "other", 10),
        ],
    }
}

/// `snap(version, 10)` as seen at `now`: every endpoint scraped 10 ms before `now`.
fn fresh_at(version: u64, now: u64) -> Snapshot {
    let mut s = snap(version, 10);
    for e in &mut s.endpoints {
        e.scraped_ms = now - 10;
    }
    s
}

/// In-flight counts from `addr=n;...` text.
fn inflight(text: &str) -> InflightCounts {
    InflightCounts::from_text(text.as_bytes())
}

const FULL: &str = "10.0.0.1:8000=2;10.0.0.2:8000=2";

fn prio(p: i32) -> PriorityDecision {
    PriorityDecision {
        priority: p,
        source: PrioritySource::Model,
        objective: None,
        tier: None,
        fairness_id: "default-flow".into(),
        targets: Default::default(),
    }
}

#[test]
fn a_reserve_judges_lower_priorities_at_reduced_thresholds() {
    let sat = cfg("").saturation.params(1000);
    let r = ReserveConfig { min_priority: 10, fraction: 0.5 };
    // Thresholds halved: queue 5 → 2.5, KV 0.8 → 0.4, in-flight 2 → 1 (never below 1).
    let low = reserved_params(&sat, &r);
    assert_eq!((low.queue_threshold, low.kv_threshold, low.max_inflight_per_endpoint), (2.5, 0.4, 1));
    let one = ReserveConfig { min_priority: 10, fraction: 0.9 };
    assert_eq!(
        reserved_params(&SaturationParams { max_inflight_per_endpoint: 2, ..sat }, &one)
            .max_inflight_per_endpoint,
        1
    );
    assert_eq!(
        reserved_params(&SaturationParams { max_inflight_per_endpoint: 0, ..sat }, &one)
            .max_inflight_per_endpoint,
        0
    );
    // One request in flight on each endpoint: room for everyone (2 slots), none below 10.
    let c =
        capacity_with(&sat, Some(&r), &snap(7, 10), "m", &inflight("10.0.0.1:8000=1;10.0.0.2:8000=1"), NOW)
            .unwrap();
    assert_eq!((c.saturated, c.slots), (false, 2));
    assert_eq!(c.reserve, Some(flow::Reserve { min_priority: 10, slots: 0, saturated: true }));
    assert!(c.saturated_for(0) && c.saturated_for(9) && !c.saturated_for(10) && !c.saturated_for(15));
    // Only .1 busy: one low slot left on .2.
    let c = capacity_with(&sat, Some(&r), &snap(7, 10), "m", &inflight("10.0.0.1:8000=1"), NOW).unwrap();
    assert_eq!(c.reserve, Some(flow::Reserve { min_priority: 10, slots: 1, saturated: false }));
    assert!(!c.saturated_for(0));
    // Without a reserve, capacity_with is capacity.
    let f = inflight("10.0.0.1:8000=1");
    assert_eq!(
        capacity_with(&sat, None, &snap(7, 10), "m", &f, NOW),
        capacity(&sat, &snap(7, 10), "m", &f, NOW)
    );
}

/// Flow control off, priority >= 0: admission takes the short path ([`judgeable`]), which
/// must decide and count exactly as the full saturation report would: fail open exactly when
/// [`capacity`] is `None`, otherwise passed; a sheddable request still gets the full report.
#[test]
fn flow_off_short_path_agrees_with_the_full_capacity() {
    let mut c = cfg("");
    c.flow_control.enabled = false;
    let sat = c.saturation.params(c.poller.stale_after_ms);
    let store = MemStore::new();
    let mut scenarios: Vec<(&str, Snapshot)> = vec![
        ("fresh", snap(3, 10)),
        ("all stale", snap(3, 1001)),
        ("edge of stale", snap(3, 1000)),
        ("empty", Snapshot::default()),
    ];
    let mut one_stale = snap(3, 10);
    one_stale.endpoints[0].scraped_ms = NOW - 5000;
    scenarios.push(("one stale", one_stale));
    let mut failing = snap(3, 10);
    for e in &mut failing.endpoints {
        e.failures = 1;
    }
    scenarios.push(("failing", failing));
    let mut no_metrics = snap(3, 10);
    for e in &mut no_metrics.endpoints {
        e.metrics = None;
    }
    scenarios.push(("no metrics", no_metrics));
    let mut never = snap(3, 10);
    for e in &mut never.endpoints {
        e.scraped_ms = 0;
    }
    scenarios.push(("never scraped", never));
    let mut future = snap(3, 10);
    future.endpoints[1].scraped_ms = NOW + 50;
    future.endpoints[0].failures = 2;
    scenarios.push(("clock skew", future));
    let mut fail_opens = 0;
    for (name, s) in &scenarios {
        for group in ["m", "other", "nobody"] {
            for counts in ["", FULL] {
                let f = inflight(counts);
                let full = capacity(&sat, s, group, &f, NOW);
                assert_eq!(
                    judgeable(&sat, s, group, NOW).is_some(),
                    full.is_some(),
                    "{name} {group} {counts}"
                );
                for p in [-5, 0, 10] {
                    let mut g = Gate::new(&c, 1);
                    let d = g.admit(&store, s, &f, 1, group, &prio(p), NOW);
                    let outcome = match (&full, p < 0) {
                        (None, _) => "fail_open",
                        (Some(cap), true) if cap.saturated => "shed",
                        (Some(_), _) => "passed",
                    };
                    fail_opens += usize::from(outcome == "fail_open");
                    match outcome {
                        "shed" => assert!(matches!(d, Decision::Reject(_)), "{name} {group} {p}: {d:?}"),
                        _ => assert_eq!(d, Decision::Go, "{name} {group} {p}"),
                    }
                    let want = telemetry::name(
                        telemetry::FLOW_REQUESTS,
                        &[("priority", &p.to_string()), ("outcome", outcome)],
                    );
                    let counted: Vec<_> = g
                        .take_metrics()
                        .into_iter()
                        .filter(|m| matches!(m, MetricUpdate::Count { .. }))
                        .collect();
                    assert_eq!(
                        counted,
                        vec![MetricUpdate::Count { name: want, delta: 1 }],
                        "{name} {group} {p}"
                    );
                }
            }
        }
    }
    // Both sides were exercised.
    assert!(fail_opens > 0 && fail_opens < scenarios.len() * 3 * 2 * 3);
}

#[test]
fn capacity_judges_only_the_groups_endpoints() {
    let sat = cfg("").saturation.params(1000);
    // m: both endpoints at 2/2 in flight → saturated; 'other' is untouched.
    let c = capacity(&sat, &snap(7, 10), "m", &inflight(FULL), NOW).unwrap();
    assert_eq!(c, Capacity { epoch: 7, slots: 0, saturated: true, reserve: None });
    // One in flight on .1: room min(ceil(5-0), 2-1) = 1 there, 2 on .2 → 3 slots.
    let c = capacity(&sat, &snap(7, 10), "m", &inflight("10.0.0.1:8000=1"), NOW).unwrap();
    assert_eq!(c, Capacity { epoch: 7, slots: 3, saturated: false, reserve: None });
    let c = capacity(&sat, &snap(7, 10), "other", &inflight(FULL), NOW).unwrap();
    assert!(!c.saturated);
}

#[test]
fn a_finish_releases_a_held_request_before_the_next_snapshot() {
    let store = MemStore::new();
    let mut g = Gate::new(&cfg(""), 1);
    // Same snapshot (version 1) throughout: only the in-flight counts move.
    let s = snap(1, 10);
    for id in [1, 2] {
        let d = g.admit(&store, &s, &inflight(FULL), id, "m", &prio(0), NOW);
        assert_eq!(d, Decision::Held { evicted: None });
    }
    assert!(g.tick(&store, &s, &inflight(FULL), NOW + 10).is_empty());
    // A finish on an endpoint of another model credits nothing to m.
    assert!(!g.on_finish(&store, &s, &inflight(FULL), "10.0.0.3:8000", NOW + 20));
    // One request on .1 finishes: 1 slot there, a token, and the release goes at once.
    let after = inflight("10.0.0.1:8000=1;10.0.0.2:8000=2");
    assert!(g.on_finish(&store, &s, &after, "10.0.0.1:8000", NOW + 30));
    let a = g.tick(&store, &s, &after, NOW + 30);
    assert!(matches!(a.as_slice(), [flow::Action::Release { id: 1, .. }]), "{a:?}");
    // Flow control off: never credits.
    let mut c = cfg("");
    c.flow_control.enabled = false;
    let mut off = Gate::new(&c, 2);
    assert!(!off.on_finish(&store, &s, &after, "10.0.0.1:8000", NOW + 40));
}

#[test]
fn capacity_fails_open_when_nothing_can_be_judged() {
    let sat = cfg("").saturation.params(1000);
    // Every endpoint of m is 1001 ms old (stale after 1000).
    assert_eq!(capacity(&sat, &snap(7, 1001), "m", &inflight(""), NOW), None);
    // No endpoint serves the group (an empty snapshot before the first publish, too).
    assert_eq!(capacity(&sat, &snap(7, 10), "nobody", &inflight(""), NOW), None);
    assert_eq!(capacity(&sat, &Snapshot::default(), "m", &inflight(""), NOW), None);
    // One stale and one full endpoint: judged, and saturated (stale is full).
    let mut s = snap(7, 10);
    s.endpoints[0].scraped_ms = NOW - 5000;
    let c = capacity(&sat, &s, "m", &inflight("10.0.0.2:8000=2"), NOW).unwrap();
    assert!(c.saturated);
}

#[test]
fn holds_when_saturated_and_releases_in_priority_order() {
    let store = MemStore::new();
    let mut g = Gate::new(&cfg(""), 1);
    let full = inflight(FULL);
    // Arrivals 1 (p0), 2 (p10), 3 (p0) while both endpoints are full: all held.
    for (id, p) in [(1, 0), (2, 10), (3, 0)] {
        assert_eq!(
            g.admit(&store, &snap(1, 10), &full, id, "m", &prio(p), NOW),
            Decision::Held { evicted: None }
        );
    }
    assert_eq!(g.held(), 3);
    // Still full at the next tick: nothing moves.
    assert!(g.tick(&store, &snap(1, 10), &full, NOW + 50).is_empty());
    // Snapshot 2 shows one free slot on .1 (1 in flight): the p10 request goes first.
    let a = g.tick(&store, &snap(2, 10), &inflight("10.0.0.1:8000=1;10.0.0.2:8000=2"), NOW + 100);
    assert_eq!(a, vec![flow::Action::Release { id: 2, priority: 10, waited_ms: 100 }]);
    // Snapshot 3, two slots: the two p0 requests in arrival order.
    let a = g.tick(&store, &snap(3, 10), &inflight("10.0.0.2:8000=2"), NOW + 200);
    let ids: Vec<u32> = a
        .iter()
        .map(|x| match x {
            flow::Action::Release { id, .. } | flow::Action::Reject { id, .. } => *id,
        })
        .collect();
    assert_eq!(ids, vec![1, 3]);
    assert_eq!(g.held(), 0);
    assert!(!g.needs_tick());
}

#[test]
fn sheddable_is_rejected_at_once_only_while_saturated() {
    let store = MemStore::new();
    let mut g = Gate::new(&cfg(""), 1);
    let Decision::Reject(r) = g.admit(&store, &snap(1, 10), &inflight(FULL), 1, "m", &prio(-5), NOW) else {
        panic!("expected a rejection")
    };
    assert_eq!((r.status, r.code, r.retry_after_s), (429, "request_shed", Some(1)));
    // With room, a sheddable request goes on like any other.
    assert_eq!(g.admit(&store, &snap(1, 10), &inflight(""), 2, "m", &prio(-5), NOW), Decision::Go);
}

#[test]
fn all_stale_skips_flow_control_and_drains_what_was_held() {
    let store = MemStore::new();
    let mut g = Gate::new(&cfg(""), 1);
    let full = inflight(FULL);
    assert!(matches!(g.admit(&store, &snap(1, 10), &full, 1, "m", &prio(0), NOW), Decision::Held { .. }));
    // Metrics now 1001 ms old: a new request, even sheddable, skips flow control...
    assert_eq!(g.admit(&store, &snap(1, 1001), &full, 2, "m", &prio(-5), NOW), Decision::Go);
    // ...and the held one is let go at the next tick, for the scheduler to decide.
    let a = g.tick(&store, &snap(1, 1001), &full, NOW + 20);
    assert_eq!(a, vec![flow::Action::Release { id: 1, priority: 0, waited_ms: 20 }]);
    assert!(!g.needs_tick(), "summary withdrawn");
    let m = g.take_metrics();
    assert!(m.contains(&MetricUpdate::Count {
        name: "inference_picker_flow_requests_total;priority=-5;outcome=fail_open".into(),
        delta: 1
    }));
}

#[test]
fn timeout_eviction_and_cancel_keep_the_books() {
    let store = MemStore::new();
    let mut g = Gate::new(&cfg(""), 1);
    let full = inflight(FULL);
    let s = snap(1, 10);
    // max_queue 3: ids 1, 2, 3 at p0 fill it.
    for id in 1..=3 {
        assert!(matches!(
            g.admit(&store, &s, &full, id, "m", &prio(0), NOW),
            Decision::Held { evicted: None }
        ));
    }
    // A fourth p0 gets 429 queue_full; a p5 evicts the newest p0 (id 3).
    let Decision::Reject(r) = g.admit(&store, &s, &full, 4, "m", &prio(0), NOW) else { panic!() };
    assert_eq!((r.status, r.code), (429, "queue_full"));
    let Decision::Held { evicted: Some((3, r)) } = g.admit(&store, &s, &full, 5, "m", &prio(5), NOW + 10)
    else {
        panic!()
    };
    assert_eq!(r.code, "queue_full");
    assert!(!g.cancel(3, NOW + 10), "an evicted request is no longer held");
    // Client of id 2 goes away at +30.
    assert!(g.cancel(2, NOW + 30));
    assert!(!g.cancel(2, NOW + 30));
    // At +1000 (max_wait_ms) ids 1 and 5 time out with 503 (5 was held at +10: not yet).
    // (Metrics scraped 10 ms before each tick: saturated, not stale.)
    let a = g.tick(&store, &fresh_at(1, NOW + 1000), &full, NOW + 1000);
    assert_eq!(a.len(), 1, "{a:?}");
    let flow::Action::Reject { id: 1, priority: 0, waited_ms: 1000, rejection } = &a[0] else {
        panic!("{a:?}")
    };
    assert_eq!((rejection.status, rejection.code, rejection.retry_after_s), (503, "queue_timeout", Some(1)));
    let a = g.tick(&store, &fresh_at(1, NOW + 1010), &full, NOW + 1010);
    assert!(matches!(a.as_slice(), [flow::Action::Reject { id: 5, waited_ms: 1000, .. }]));

    let mut m = g.take_metrics();
    m.sort_by(|a, b| format!("{a:?}").cmp(&format!("{b:?}")));
    let count = |name: &str, delta| MetricUpdate::Count { name: name.into(), delta };
    let expected = {
        let mut e = vec![
            count("inference_picker_flow_requests_total;priority=0;outcome=held", 3),
            // id 4 refused + id 3 evicted.
            count("inference_picker_flow_requests_total;priority=0;outcome=queue_full", 2),
            count("inference_picker_flow_requests_total;priority=0;outcome=cancelled", 1),
            count("inference_picker_flow_requests_total;priority=0;outcome=timed_out", 1),
            // id 3: 10 ms (evicted), id 2: 30 ms (cancelled), id 1: 1000 ms.
            count("inference_picker_flow_queued_ms_total;priority=0", 1040),
            count("inference_picker_flow_requests_total;priority=5;outcome=held", 1),
            count("inference_picker_flow_requests_total;priority=5;outcome=timed_out", 1),
            count("inference_picker_flow_queued_ms_total;priority=5", 1000),
            // Every request that was held has left: 3 - (1 + 1 + 1 evicted) = 0 and 1 - 1 = 0,
            // so no gauge change is reported at all.
            MetricUpdate::Sample {
                name: "inference_picker_flow_queue_time_ms;priority=0".into(),
                value: 1000,
            },
            MetricUpdate::Sample {
                name: "inference_picker_flow_queue_time_ms;priority=5".into(),
                value: 1000,
            },
        ];
        e.sort_by(|a, b| format!("{a:?}").cmp(&format!("{b:?}")));
        e
    };
    assert_eq!(m, expected);
    assert!(g.take_metrics().is_empty(), "drained");
}

#[test]
fn waiting_gauge_moves_up_and_down() {
    let store = MemStore::new();
    let mut g = Gate::new(&cfg(""), 1);
    for id in 1..=2 {
        g.admit(&store, &snap(1, 10), &inflight(FULL), id, "m", &prio(3), NOW);
    }
    let gauge = |m: &[MetricUpdate]| {
        m.iter()
            .find_map(|u| match u {
                MetricUpdate::GaugeAdd { name, delta }
                    if name == "inference_picker_flow_waiting;priority=3" =>
                {
                    Some(*delta)
                }
                _ => None,
            })
            .unwrap_or(0)
    };
    assert_eq!(gauge(&g.take_metrics()), 2);
    g.tick(&store, &snap(2, 10), &inflight("10.0.0.2:8000=2"), NOW + 5);
    // Two slots on .1 in epoch 2: both released.
    assert_eq!(gauge(&g.take_metrics()), -2);
}

#[test]
fn two_vms_starting_together_get_different_worker_ids() {
    // Both read the counter absent; B creates and increments it before A writes.
    struct Racing<'a> {
        inner: &'a MemStore,
        other: std::cell::Cell<bool>,
    }
    impl SharedStore for Racing<'_> {
        fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
            let r = self.inner.get(key);
            if self.other.replace(false) {
                assert_eq!(claim_worker_id(self.inner), Ok(1));
            }
            r
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
            self.inner.set(key, value, cas)
        }
    }
    let store = MemStore::new();
    let a = claim_worker_id(&Racing { inner: &store, other: std::cell::Cell::new(true) });
    assert_eq!(a, Ok(2));
    assert_eq!(decode_u64(&store.get(WORKER_SEQ_KEY).unwrap().unwrap().0, Tag::WorkerSeq), Ok(2));
}

#[test]
fn worker_ids_are_unique_and_survive_garbage() {
    let store = MemStore::new();
    assert_eq!(claim_worker_id(&store), Ok(1));
    assert_eq!(claim_worker_id(&store), Ok(2));
    // An unreadable counter restarts at 1 rather than failing configuration.
    store.set(WORKER_SEQ_KEY, b"junk", 0).unwrap();
    assert_eq!(claim_worker_id(&store), Ok(1));
}

#[test]
fn startup_hold_until_metrics_or_wait() {
    let mut g = Gate::new(&cfg(r#","health":{"startup_wait_ms":300}"#), 1);
    assert!(!g.needs_tick());
    assert!(g.hold_for_snapshot(1, NOW));
    assert!(g.hold_for_snapshot(2, NOW + 100));
    assert!(g.hold_for_snapshot(3, NOW + 200));
    assert!(g.needs_tick());
    // Not ready: only the one that waited 300 ms goes.
    assert_eq!(g.tick_startup(false, NOW + 299), vec![]);
    assert_eq!(g.tick_startup(false, NOW + 300), vec![(1, 300)]);
    // The client of 2 leaves.
    assert!(g.cancel(2, NOW + 310));
    // Ready: everything left goes at once, oldest first.
    assert!(g.hold_for_snapshot(4, NOW + 320));
    assert_eq!(g.tick_startup(true, NOW + 350), vec![(3, 150), (4, 30)]);
    assert_eq!(g.startup_held(), 0);
    assert!(!g.needs_tick());
    // Wait 0: never held.
    let mut g0 = Gate::new(&cfg(r#","health":{"startup_wait_ms":0}"#), 1);
    assert!(!g0.hold_for_snapshot(1, NOW));
}

#[test]
fn readiness_and_the_startup_route() {
    let c = cfg("");
    let empty = Snapshot::default();
    assert!(!snapshot_ready(&empty));
    // Published, but no endpoint has a scrape result yet.
    let mut waiting = snap(1, 0);
    for e in &mut waiting.endpoints {
        e.scraped_ms = 0;
    }
    assert!(!snapshot_ready(&waiting));
    // One failed scrape is a result: the pool can be judged (and may be unhealthy).
    waiting.endpoints[0].failures = 1;
    assert!(snapshot_ready(&waiting));
    assert!(snapshot_ready(&snap(1, 10)));
    // A published empty pool (discovery found nothing) is ready: "no endpoint" is true.
    assert!(snapshot_ready(&Snapshot { version: 3, ..Snapshot::default() }));

    // FailClose: an accurate 503.
    let e = routing_snapshot(c.filter.failure_mode, &c.endpoints, Rc::new(empty.clone())).unwrap_err();
    assert_eq!((e.status, e.code, e.retry_after_s), (503, "metrics_not_ready", Some(1)));
    assert!(e.message.contains("metrics"), "{}", e.message);
    // FailOpen: the configured endpoints stand in.
    let open = cfg(r#","filter":{"failure_mode":"FailOpen"}"#);
    let s = routing_snapshot(open.filter.failure_mode, &open.endpoints, Rc::new(empty)).unwrap();
    let addrs: Vec<&str> = s.endpoints.iter().map(|e| e.address.as_str()).collect();
    assert_eq!(addrs, vec!["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]);
    assert!(s.endpoints.iter().all(|e| e.scraped_ms == 0 && e.models.len() == 1));
    // Ready: the snapshot itself.
    let ready = Rc::new(snap(2, 10));
    assert!(Rc::ptr_eq(
        &routing_snapshot(c.filter.failure_mode, &c.endpoints, ready.clone()).unwrap(),
        &ready
    ));
}

#[test]
fn groups_are_independent() {
    let store = MemStore::new();
    let mut g = Gate::new(&cfg(""), 1);
    // m is full, other is not: a request to other goes on while m's are held.
    assert!(matches!(
        g.admit(&store, &snap(1, 10), &inflight(FULL), 1, "m", &prio(0), NOW),
        Decision::Held { .. }
    ));
    assert_eq!(g.admit(&store, &snap(1, 10), &inflight(FULL), 2, "other", &prio(0), NOW), Decision::Go);
    assert_eq!(store.keys(), vec![flow::shared_key("m")]);
}

/// Mixed builds: a worker-id sequence of the next release is never reset by this one (its ids
/// would repeat); the VM then takes a random id (host). The next release counts on from it.
#[test]
fn a_worker_sequence_of_another_release_is_left_alone() {
    let store = MemStore::new();
    let theirs = crate::base::codec::as_next(&encode_u64(Tag::WorkerSeq, 41), Tag::WorkerSeq);
    store.set(WORKER_SEQ_KEY, &theirs, 0).unwrap();
    if cfg!(feature = "codec-next") {
        assert_eq!(claim_worker_id(&store), Ok(42));
    } else {
        assert!(matches!(claim_worker_id(&store), Err(StoreError::Host(_))));
        assert_eq!(store.get(WORKER_SEQ_KEY).unwrap().unwrap().0, theirs);
    }
}
