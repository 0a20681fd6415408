//! Tests of `health`.

use super::*;
use crate::base::ports::MemStore;

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";
const C: &str = "10.0.0.3:8000";
const T0: u64 = 1_000_000;
const FAIL: Outcome = Outcome::Failure { gateway: false };
const GW: Outcome = Outcome::Failure { gateway: true };

fn cfg() -> HealthConfig {
    HealthConfig { base_ejection_ms: 1000, max_ejection_ms: 8000, ..HealthConfig::default() }
}

#[test]
fn an_outcome_that_changes_nothing_stored_is_not_written() {
    let store = MemStore::new();
    let mut r = Recorder::new();
    let c = cfg();
    // The first record creates the key; successes on endpoints with no history leave it as
    // it is (pruned at once), so its CAS token does not move.
    r.record(&store, &c, A, Outcome::Success, T0).unwrap();
    let (_, cas) = store.get(HEALTH_KEY).unwrap().unwrap();
    for (i, addr) in [A, B, C, A].into_iter().enumerate() {
        assert_eq!(r.record(&store, &c, addr, Outcome::Success, T0 + i as u64).unwrap(), None);
    }
    assert_eq!(store.get(HEALTH_KEY).unwrap().unwrap().1, cas);
    // A failure changes the view: written.
    r.record(&store, &c, B, FAIL, T0 + 10).unwrap();
    let (v, cas2) = store.get(HEALTH_KEY).unwrap().unwrap();
    assert_ne!(cas2, cas);
    assert!(HealthView::decode(&v).entry(B).is_some());
    // A success on B now resets its streak: a change, written.
    r.record(&store, &c, B, Outcome::Success, T0 + 20).unwrap();
    assert_ne!(store.get(HEALTH_KEY).unwrap().unwrap().1, cas2);
}

/// A fake clock: every call moves time on by 10 ms.
struct Clock(u64);
impl Clock {
    fn tick(&mut self) -> u64 {
        self.0 += 10;
        self.0
    }
}

#[test]
fn classify_statuses_details_and_flags() {
    assert_eq!(classify(Some(200), "via_upstream", 0), Some(Outcome::Success));
    // Client errors show a live pod.
    assert_eq!(classify(Some(400), "via_upstream", 0), Some(Outcome::Success));
    assert_eq!(classify(Some(404), "via_upstream", 0), Some(Outcome::Success));
    assert_eq!(classify(Some(429), "via_upstream", 0), Some(Outcome::Load));
    assert_eq!(classify(Some(500), "via_upstream", 0), Some(FAIL));
    assert_eq!(classify(Some(503), "via_upstream", 0), Some(GW));
    // Connect failure and reset: Envoy's own 503 with details and flags.
    assert_eq!(
        classify(Some(503), "upstream_reset_before_response_started{connection_failure}", 0x20),
        Some(GW)
    );
    assert_eq!(classify(Some(503), "", 0x10), Some(GW));
    assert_eq!(classify(Some(504), "upstream_per_try_timeout", 0), Some(GW));
    // The client went away: nothing learned.
    assert_eq!(classify(Some(0), "downstream_remote_disconnect", 0x4000), None);
    // Envoy answered itself for another reason.
    assert_eq!(classify(Some(404), "route_not_found", 0x100), None);
    assert_eq!(classify(None, "", 0), None);
}

#[test]
fn attribution_follows_the_retry_order() {
    let d: Vec<String> = [A, B, C].iter().map(|s| s.to_string()).collect();
    // Answered by the second: the first failed.
    assert_eq!(attribute(&d, Some(B), None, Some(Outcome::Success)), vec![(A, FAIL), (B, Outcome::Success)]);
    // Answered by the primary.
    assert_eq!(attribute(&d, Some(A), Some(1), Some(FAIL)), vec![(A, FAIL)]);
    // Unknown responder (never connected): attempts tell how many were tried.
    assert_eq!(attribute(&d, None, Some(2), Some(GW)), vec![(A, FAIL), (B, GW)]);
    assert_eq!(attribute(&d, None, None, Some(GW)), vec![(A, GW)]);
    // An address outside the list (another cluster type): the primary.
    assert_eq!(attribute(&d, Some("9.9.9.9:1"), None, Some(FAIL)), vec![(A, FAIL)]);
    // Nothing learned about the last one, but the earlier ones still failed.
    assert_eq!(attribute(&d, Some(C), None, None), vec![(A, FAIL), (B, FAIL)]);
    assert!(attribute(&[], None, Some(3), Some(GW)).is_empty());
}

#[test]
fn consecutive_5xx_ejects_on_the_third_and_success_resets() {
    let s = MemStore::new();
    let mut r = Recorder::new();
    let c = cfg();
    let mut t = Clock(T0);
    assert_eq!(r.record(&s, &c, A, FAIL, t.tick()), Ok(None));
    assert_eq!(r.record(&s, &c, A, FAIL, t.tick()), Ok(None));
    // A success in between resets the count.
    assert_eq!(r.record(&s, &c, A, Outcome::Success, t.tick()), Ok(None));
    assert_eq!(r.record(&s, &c, A, FAIL, t.tick()), Ok(None));
    assert_eq!(r.record(&s, &c, A, FAIL, t.tick()), Ok(None));
    let now = t.tick();
    assert_eq!(
        r.record(&s, &c, A, FAIL, now),
        Ok(Some(Ejection { reason: Reason::Consecutive5xx, duration_ms: 1000, nth: 1 }))
    );
    let v = r.read(&s, now).unwrap();
    assert!(v.ejected(A, now) && v.ejected(A, now + 999) && !v.ejected(A, now + 1000));
}

#[test]
fn gateway_failures_eject_sooner_and_429_is_load_only() {
    let s = MemStore::new();
    let mut r = Recorder::new();
    let c = cfg();
    let mut t = Clock(T0);
    // 429s never eject, and do not reset the count either.
    for _ in 0..20 {
        assert_eq!(r.record(&s, &c, B, Outcome::Load, t.tick()), Ok(None));
    }
    assert_eq!(r.record(&s, &c, B, GW, t.tick()), Ok(None));
    assert_eq!(r.record(&s, &c, B, Outcome::Load, t.tick()), Ok(None));
    let e = r.record(&s, &c, B, GW, t.tick()).unwrap().unwrap();
    assert_eq!(e.reason, Reason::ConsecutiveGatewayFailure);
}

#[test]
fn backoff_doubles_through_probation_and_is_capped() {
    let s = MemStore::new();
    let mut r = Recorder::new();
    let c = cfg();
    let mut now = T0;
    for _ in 0..2 {
        r.record(&s, &c, A, GW, now).unwrap();
    }
    // First ejection: 1000 ms. Then each failure on probation doubles it, up to 8000.
    let mut until = now + 1000;
    for (nth, expected) in [(2u32, 2000u64), (3, 4000), (4, 8000), (5, 8000)] {
        now = until; // ejection over: on probation
        let v = r.read(&s, now).unwrap();
        assert!(!v.ejected(A, now));
        let e = r.record(&s, &c, A, FAIL, now).unwrap().unwrap();
        assert_eq!((e.reason, e.nth, e.duration_ms), (Reason::Probation, nth, expected));
        until = now + expected;
    }
    // A success after the ejection ends probation: the next failure alone does not eject.
    now = until;
    assert_eq!(r.record(&s, &c, A, Outcome::Success, now), Ok(None));
    assert_eq!(r.record(&s, &c, A, FAIL, now + 1), Ok(None));
    // ... but the ejection count is remembered until max_ejection_ms passes healthy.
    assert_eq!(r.read(&s, now).unwrap().entry(A).map(|e| e.ejections), Some(5));
    r.record(&s, &c, A, Outcome::Success, now + 8000).unwrap();
    // Clean entries are dropped from the stored value.
    assert_eq!(r.read(&s, now + 10_000).unwrap().entry(A), None);
}

#[test]
fn failure_rate_ejects_an_endpoint_that_mixes_results() {
    let s = MemStore::new();
    let mut r = Recorder::new();
    let c = HealthConfig { failure_rate_min_requests: 10, failure_rate_percent: 50, ..cfg() };
    let mut t = Clock(T0);
    // Alternate failure/success: never 3 in a row, but 6 failures of 11 (10 needed).
    let mut got = None;
    for i in 0..11 {
        let o = if i % 2 == 0 { FAIL } else { Outcome::Success };
        got = r.record(&s, &c, C, o, t.tick()).unwrap();
    }
    assert_eq!(got.map(|e| e.reason), Some(Reason::FailureRate));
    // A window that ends restarts the count.
    let s2 = MemStore::new();
    let mut r2 = Recorder::new();
    let mut now = T0;
    for i in 0..9 {
        r2.record(&s2, &c, C, if i % 2 == 0 { FAIL } else { Outcome::Success }, now).unwrap();
        now += 1;
    }
    now += c.window_ms;
    assert_eq!(r2.record(&s2, &c, C, FAIL, now), Ok(None));
}

#[test]
fn max_ejection_percent_keeps_the_pool_alive() {
    let s = MemStore::new();
    let mut r = Recorder::new();
    let c = cfg();
    // Eject A at T0, B at T0+1, C at T0+2.
    for (i, a) in [A, B, C].iter().enumerate() {
        for _ in 0..2 {
            r.record(&s, &c, a, GW, T0 + i as u64).unwrap();
        }
    }
    let v = r.read(&s, T0 + 10).unwrap();
    // 50 % of 3 = 1: only the earliest ejection (A) applies.
    assert_eq!(v.excluded(&[C, B, A], T0 + 10, &c), vec![false, false, true]);
    // 100 % still leaves one.
    let all = HealthConfig { max_ejection_percent: 100, ..c.clone() };
    assert_eq!(v.excluded(&[A, B, C], T0 + 10, &all), vec![true, true, false]);
    // 0 % still ejects one of two or more; a single endpoint is never left out.
    let none = HealthConfig { max_ejection_percent: 0, ..c.clone() };
    assert_eq!(v.excluded(&[A, B], T0 + 10, &none), vec![true, false]);
    assert_eq!(v.excluded(&[A], T0 + 10, &c), vec![false]);
}

#[test]
fn failures_count_as_load_for_a_while() {
    let s = MemStore::new();
    let mut r = Recorder::new();
    let c = cfg(); // failure_load_ms 2000
    r.record(&s, &c, A, FAIL, T0).unwrap();
    r.record(&s, &c, A, Outcome::Load, T0 + 100).unwrap();
    let v = r.read(&s, T0 + 100).unwrap();
    assert_eq!(v.phantom_load(A, T0 + 100, &c), 2);
    assert_eq!(v.phantom_load(A, T0 + 2099, &c), 2);
    assert_eq!(v.phantom_load(A, T0 + 2100, &c), 0);
    assert_eq!(v.phantom_load(B, T0, &c), 0);
    // After a quiet period it restarts from one.
    r.record(&s, &c, A, Outcome::Load, T0 + 5000).unwrap();
    assert_eq!(r.read(&s, T0 + 5000).unwrap().phantom_load(A, T0 + 5000, &c), 1);
    let off = HealthConfig { failure_load_ms: 0, ..c };
    assert_eq!(v.phantom_load(A, T0 + 100, &off), 0);
}

#[test]
fn first_write_race_heals_and_keeps_ejections() {
    let s = MemStore::new();
    let c = cfg();
    let mut w1 = Recorder::new();
    let mut w2 = Recorder::new();
    // w1 ejects A (gateway failures); then w2, which found the key missing before, writes
    // unconditionally and overwrites it (the creation race).
    w1.record(&s, &c, A, GW, T0).unwrap();
    assert!(w1.record(&s, &c, A, GW, T0).unwrap().is_some());
    let mut lost = HealthView::default();
    lost.entries.insert(B.to_string(), Entry { consecutive_5xx: 1, touched_ms: T0, ..Entry::default() });
    s.set(HEALTH_KEY, &lost.encode(), 0).unwrap();
    assert!(!w2.read(&s, T0 + 1).unwrap().ejected(A, T0 + 1), "the shared value lost it");
    // w1 still sees its ejection, and its next write puts it back for everyone.
    assert!(w1.read(&s, T0 + 1).unwrap().ejected(A, T0 + 1));
    w1.record(&s, &c, B, Outcome::Success, T0 + 2).unwrap();
    assert!(w2.read(&s, T0 + 3).unwrap().ejected(A, T0 + 3));
}

#[test]
fn interleaved_writers_do_not_lose_events() {
    let s = MemStore::new();
    let c = cfg();
    let mut w1 = Recorder::new();
    let mut w2 = Recorder::new();
    w1.record(&s, &c, A, FAIL, T0).unwrap();
    // w2 read, then w1 wrote: w2's stale CAS fails and it retries on fresh data.
    let (_, cas) = s.get(HEALTH_KEY).unwrap().unwrap();
    w1.record(&s, &c, A, FAIL, T0 + 1).unwrap();
    assert_eq!(s.set(HEALTH_KEY, b"", cas), Err(StoreError::CasMismatch));
    let e = w2.record(&s, &c, A, FAIL, T0 + 2).unwrap();
    assert_eq!(e.map(|e| e.reason), Some(Reason::Consecutive5xx), "three failures from two workers");
    assert_eq!(s.key_count(), 1);
}

#[test]
fn garbage_reads_as_empty_and_is_replaced() {
    let s = MemStore::new();
    let c = cfg();
    s.set(HEALTH_KEY, b"\xff\xfe\nnot an entry\n10.0.0.9:1 1 2", 0).unwrap();
    let mut r = Recorder::new();
    assert!(r.read(&s, T0).unwrap().is_empty());
    r.record(&s, &c, A, FAIL, T0).unwrap();
    let v = r.read(&s, T0).unwrap();
    assert_eq!(v.entry(A).map(|e| e.consecutive_5xx), Some(1));
    assert_eq!(HealthView::decode(&v.encode()), v, "round trip");
}

#[test]
fn disabled_records_nothing_and_entries_are_bounded() {
    let s = MemStore::new();
    let mut r = Recorder::new();
    let off = HealthConfig { enabled: false, ..cfg() };
    assert_eq!(r.record(&s, &off, A, GW, T0), Ok(None));
    assert_eq!(s.key_count(), 0);
    let c = cfg();
    for i in 0..(MAX_ENTRIES + 10) {
        let addr = format!("10.{}.{}.{}:80", i / 65536, (i / 256) % 256, i % 256);
        r.record(&s, &c, &addr, FAIL, T0 + i as u64).unwrap();
    }
    let v = r.read(&s, T0 + 5000).unwrap();
    assert_eq!(v.entries.len(), MAX_ENTRIES);
    assert!(v.entry("10.0.0.0:80").is_none(), "the oldest went first");
}

#[test]
fn flow_control_sees_the_pool_without_ejected_endpoints() {
    use crate::state::snapshot::EndpointStatus;
    let ep = |a: &str, m: &[&str]| EndpointStatus {
        address: a.into(),
        models: m.iter().map(|s| s.to_string()).collect(),
        scraped_ms: T0,
        ..EndpointStatus::default()
    };
    let snap = Snapshot {
        version: 7,
        published_ms: T0,
        endpoints: vec![ep(A, &["m"]), ep(B, &["m"]), ep(C, &["x"])],
    };
    let s = MemStore::new();
    let mut r = Recorder::new();
    let c = cfg();
    assert_eq!(without_ejected(&snap, &r.read(&s, T0).unwrap(), T0, &c), None);
    for _ in 0..2 {
        r.record(&s, &c, A, GW, T0).unwrap();
        r.record(&s, &c, C, GW, T0).unwrap();
    }
    let v = r.read(&s, T0).unwrap();
    let out = without_ejected(&snap, &v, T0 + 1, &c).unwrap();
    // A goes (B still serves m); C stays: it alone serves x.
    let addrs: Vec<&str> = out.endpoints.iter().map(|e| e.address.as_str()).collect();
    assert_eq!((out.version, addrs), (7, vec![B, C]));
    assert_eq!(without_ejected(&snap, &v, T0 + 1000, &c), None, "ejection over");
}

#[test]
fn config_validation_names_paths() {
    let bad = HealthConfig {
        failure_rate_percent: 101,
        failure_rate_min_requests: 0,
        window_ms: 5,
        base_ejection_ms: 10,
        max_ejection_ms: 5,
        max_ejection_percent: 200,
        startup_wait_ms: MAX_STARTUP_WAIT_MS + 1,
        ..HealthConfig::default()
    };
    let mut errs = Vec::new();
    bad.validate("health", &mut errs);
    let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(
        paths,
        vec![
            "health.failure_rate_percent",
            "health.failure_rate_min_requests",
            "health.window_ms",
            "health.max_ejection_ms",
            "health.max_ejection_percent",
            "health.startup_wait_ms"
        ]
    );
    let mut errs = Vec::new();
    HealthConfig::default().validate("health", &mut errs);
    assert!(errs.is_empty());
    assert_eq!(HealthConfig::default().ejection_ms(40), 300_000);
}

/// Mixed builds: a health record of the next release reads as empty here and is never
/// overwritten; an ejection decided here is kept by this worker. The next release reads and
/// updates it. Malformed records read as empty, whole.
#[test]
fn a_record_of_another_release_is_skipped_and_left_alone() {
    let c = cfg();
    let mut view = HealthView::default();
    view.entries.insert(A.to_string(), Entry { consecutive_5xx: 2, touched_ms: T0, ..Default::default() });
    let ours = view.encode();
    assert_eq!(HealthView::decode(&ours), view);
    for cut in 0..ours.len() {
        assert!(HealthView::decode(&ours[..cut]).is_empty(), "cut at {cut}");
    }
    let mut longer = ours.clone();
    longer.push(0);
    assert!(HealthView::decode(&longer).is_empty());
    let theirs = crate::base::codec::as_next(&ours, crate::base::codec::Tag::Health);
    let store = MemStore::new();
    store.set(HEALTH_KEY, &theirs, 0).unwrap();
    let mut r = Recorder::new();
    let next = cfg!(feature = "codec-next");
    assert_eq!(r.read(&store, T0).unwrap().entry(A).is_some(), next);
    let mut ejected = false;
    for i in 0..10 {
        ejected |= r.record(&store, &c, B, GW, T0 + i).unwrap().is_some();
    }
    assert!(ejected);
    assert!(r.read(&store, T0 + 20).unwrap().ejected(B, T0 + 20));
    let stored = store.get(HEALTH_KEY).unwrap().unwrap().0;
    if next {
        assert!(HealthView::decode(&stored).entry(A).is_some());
    } else {
        assert_eq!(stored, theirs, "another build's record is not overwritten");
    }
}

#[test]
fn a_token_count_reports_failures_and_load_never_success() {
    assert_eq!(from_non_generation(Outcome::Success), None);
    for o in [Outcome::Failure { gateway: true }, Outcome::Failure { gateway: false }, Outcome::Load] {
        assert_eq!(from_non_generation(o), Some(o));
    }
}
