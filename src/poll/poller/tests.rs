//! Tests of `poller`.

use super::*;
use crate::config::Config;

const VLLM: &[u8] = b"# TYPE vllm:num_requests_waiting gauge\n\
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3\n\
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 5\n\
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n";

fn cfg() -> Config {
    Config::from_json(
            br#"{"version":1,"endpoints":[{"address":"127.0.0.1:8001","models":["m"]},{"address":"127.0.0.1:8002","models":["m"]}],"models":[{"name":"m"}],"poller":{"timeout_ms":100}}"#,
        )
        .unwrap()
}

#[test]
fn a_round_scrapes_everything_once_then_publishes() {
    let mut p = Poller::new(&cfg());
    assert_eq!(p.due(1000), vec!["127.0.0.1:8001", "127.0.0.1:8002"]);
    // Both outstanding: nothing new is due on the next tick.
    assert!(p.due(1200).is_empty());
    assert!(!p.round_complete());
    p.on_result("127.0.0.1:8001", 1010, ScrapeResult::Response { status: 200, body: VLLM }).unwrap();
    p.on_result("127.0.0.1:8002", 1020, ScrapeResult::Failed).unwrap_err();
    assert!(p.round_complete());
    let s = p.snapshot(1020);
    assert_eq!(s.version, 1);
    let a = &s.endpoints[0];
    assert_eq!((a.scraped_ms, a.failures), (1010, 0));
    assert_eq!(a.metrics.as_ref().unwrap().queue, Some(3.0));
    assert!(a.is_fresh(1020, 1000));
    let b = &s.endpoints[1];
    assert_eq!((b.scraped_ms, b.failures, b.metrics.is_none()), (0, 1, true));
    assert_eq!(p.snapshot(1030).version, 2);
}

#[test]
fn an_oversize_response_fails_the_scrape_and_keeps_the_old_metrics() {
    let mut p = Poller::new(&cfg());
    p.due(0);
    p.on_result("127.0.0.1:8001", 10, ScrapeResult::Response { status: 200, body: VLLM }).unwrap();
    p.due(200);
    let e = p.on_result("127.0.0.1:8001", 210, ScrapeResult::TooLarge { size: 5 << 20 }).unwrap_err();
    assert_eq!(e, ScrapeError::TooLarge(5 << 20));
    assert_eq!(e.reason(), "too_large");
    assert!(e.to_string().contains("max_response_bytes"));
    let s = p.snapshot(210);
    assert_eq!((s.endpoints[0].failures, s.endpoints[0].metrics.is_some()), (1, true));
    assert!(response_within_cap(4 << 20, 4 << 20));
    assert!(!response_within_cap((4 << 20) + 1, 4 << 20));
}

#[test]
fn lost_calls_are_counted_once_for_the_metric() {
    let mut p = Poller::new(&cfg());
    p.due(0);
    assert_eq!(p.take_lost(), 0);
    // timeout 100 + grace: written off at the next due() after that.
    p.due(100 + LOST_CALL_GRACE_MS + 1);
    assert_eq!(p.take_lost(), 2);
    assert_eq!(p.take_lost(), 0);
    assert_eq!(ScrapeError::Lost.reason(), "lost");
    assert!(ScrapeError::Dispatch("BadArgument".into()).to_string().contains("cluster"));
}

#[test]
fn failures_keep_old_metrics_but_make_the_endpoint_stale() {
    let mut p = Poller::new(&cfg());
    p.due(0);
    p.on_result("127.0.0.1:8001", 10, ScrapeResult::Response { status: 200, body: VLLM }).unwrap();
    p.due(200);
    assert_eq!(
        p.on_result("127.0.0.1:8001", 210, ScrapeResult::Response { status: 500, body: b"" }),
        Err(ScrapeError::Status(500))
    );
    p.due(400);
    assert!(matches!(
        p.on_result("127.0.0.1:8001", 410, ScrapeResult::Response { status: 200, body: b"garbage\n" }),
        Err(ScrapeError::Metrics(_))
    ));
    p.due(600);
    assert_eq!(
        p.on_result("127.0.0.1:8001", 610, ScrapeResult::Response { status: 200, body: b"\xff\xfe" }),
        Err(ScrapeError::NotUtf8)
    );
    let e = p.snapshot(610).endpoints[0].clone();
    assert_eq!((e.failures, e.scraped_ms), (3, 10));
    assert!(e.metrics.is_some());
    assert!(!e.is_fresh(610, 1000));
    // One good scrape heals it.
    p.due(800);
    p.on_result("127.0.0.1:8001", 810, ScrapeResult::Response { status: 200, body: VLLM }).unwrap();
    assert!(p.snapshot(810).endpoints[0].is_fresh(810, 1000));
}

#[test]
fn inflight_at_scrape_follows_the_successful_scrape_only() {
    let mut p = Poller::new(&cfg());
    p.due(0);
    let ok = ScrapeResult::Response { status: 200, body: VLLM };
    p.on_result_with_inflight("127.0.0.1:8001", 10, Some(4), ok).unwrap();
    assert_eq!(p.snapshot(10).endpoints[0].inflight_at_scrape, Some(4));
    // A failed scrape keeps the metrics and the count they were taken with.
    p.due(200);
    let failed = ScrapeResult::Response { status: 500, body: b"" };
    assert!(p.on_result_with_inflight("127.0.0.1:8001", 210, Some(9), failed).is_err());
    assert_eq!(p.snapshot(210).endpoints[0].inflight_at_scrape, Some(4));
    // A success without a count (the store could not be read) clears it: snapshot only.
    p.due(400);
    p.on_result("127.0.0.1:8001", 410, ScrapeResult::Response { status: 200, body: VLLM }).unwrap();
    assert_eq!(p.snapshot(410).endpoints[0].inflight_at_scrape, None);
}

#[test]
fn lost_callbacks_are_written_off_after_timeout_plus_grace() {
    let mut p = Poller::new(&cfg());
    p.due(0);
    // timeout 100 + grace 1000: still outstanding at 1100, written off after.
    assert!(p.due(1100).is_empty());
    assert_eq!(p.due(1101).len(), 2);
    assert!(p.snapshot(1101).endpoints.iter().all(|e| e.failures == 1));
}

#[test]
fn endpoint_changes_keep_state_and_ignore_late_results() {
    let mut p = Poller::new(&cfg());
    p.due(0);
    p.on_result("127.0.0.1:8001", 5, ScrapeResult::Response { status: 200, body: VLLM }).unwrap();
    p.set_endpoints(vec![
        ("127.0.0.1:8001".into(), vec!["m".into()]),
        ("127.0.0.1:8003".into(), vec!["m".into()]),
    ]);
    // A late answer from a removed endpoint is ignored.
    p.on_result("127.0.0.1:8002", 6, ScrapeResult::Failed).unwrap();
    let s = p.snapshot(6);
    assert_eq!(s.endpoints.len(), 2);
    assert_eq!(s.endpoints[0].scraped_ms, 5);
    assert_eq!(s.endpoints[1].address, "127.0.0.1:8003");
    p.dispatch_failed("127.0.0.1:8003", 7);
    assert_eq!(p.snapshot(7).endpoints[1].failures, 1);
}

fn cfg_with(poller: &str, n: usize) -> Config {
    let eps: Vec<String> = (0..n)
        .map(|i| format!(r#"{{"address":"10.0.{}.{}:8000","models":["m"]}}"#, i / 250, i % 250))
        .collect();
    Config::from_json(
        format!(
            r#"{{"version":1,"endpoints":[{}],"models":[{{"name":"m"}}],"poller":{poller}}}"#,
            eps.join(",")
        )
        .as_bytes(),
    )
    .unwrap()
}

fn ok(p: &mut Poller, a: &str, now: u64, inflight: Option<u32>, body: &[u8]) {
    p.on_result_with_inflight(a, now, inflight, ScrapeResult::Response { status: 200, body }).unwrap();
}

/// The tests below were written for a 2 s idle interval (the shipped default is 5 s).
const IDLE_2S: &str = r#"{"idle_interval_ms":2000}"#;

const IDLE: &[u8] = b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n";
const BUSY: &[u8] =
    b"vllm:num_requests_waiting 2\nvllm:num_requests_running 4\nvllm:kv_cache_usage_perc 0.5\n";

/// Drives one endpoint through ticks of `tick` ms until `until`, answering every scrape at
/// once with `body`; returns the start times of its scrapes.
fn drive(p: &mut Poller, from: u64, until: u64, tick: u64, body: &[u8], inflight: Option<u32>) -> Vec<u64> {
    let mut starts = Vec::new();
    let mut now = from;
    while now < until {
        for a in p.scrapes_due(now) {
            starts.push(now);
            ok(p, &a, now, inflight, body);
        }
        now += tick;
    }
    starts
}

#[test]
fn an_idle_unchanged_endpoint_backs_off_to_the_idle_interval_and_a_change_brings_it_back() {
    // interval 200, idle 2000 (defaults); tick 50.
    let mut p = Poller::new(&cfg_with(IDLE_2S, 1));
    let starts = drive(&mut p, 0, 20_000, 50, IDLE, Some(0));
    let gaps: Vec<u64> = starts.windows(2).map(|w| w[1] - w[0]).collect();
    // Never longer than the chosen interval; the last gaps are near 2000 (jitter ≤ 1/8).
    assert!(gaps.iter().all(|g| *g <= 2000), "{gaps:?}");
    assert!(gaps[gaps.len() - 3..].iter().all(|g| *g >= 1700), "{gaps:?}");
    assert_eq!(p.snapshot(20_000).endpoints[0].poll_ms, 2000);
    // The load moves: the next interval is the fast one again.
    let last = *starts.last().unwrap();
    let next = drive(&mut p, 20_000, 40_000, 50, BUSY, Some(0));
    assert!(next[0] - last <= 2000);
    assert!(next[1] - next[0] <= 200, "{next:?}");
    // Signals that stay the same back off again, busy or not (no request of this gateway there).
    assert_eq!(p.snapshot(40_000).endpoints[0].poll_ms, 2000);
}

#[test]
fn requests_of_this_gateway_pull_an_idle_endpoint_back_to_the_fast_interval() {
    let mut p = Poller::new(&cfg_with(IDLE_2S, 1));
    let starts = drive(&mut p, 0, 20_000, 50, IDLE, Some(0));
    let last = *starts.last().unwrap();
    // This gateway sends a request there right after the last scrape.
    p.note_inflight(|_| 1);
    let due_at = (last..last + 2000).step_by(50).find(|t| !p.scrapes_due(*t).is_empty());
    assert!(due_at.is_some_and(|t| t <= last + 200 + 25), "{due_at:?} after {last}");
    // Without requests in flight nothing changes.
    let mut q = Poller::new(&cfg_with(IDLE_2S, 1));
    let starts = drive(&mut q, 0, 20_000, 50, IDLE, Some(0));
    let last = *starts.last().unwrap();
    q.note_inflight(|_| 0);
    assert!((last + 50..last + 1500).step_by(50).all(|t| q.scrapes_due(t).is_empty()));
    // An endpoint with requests in flight at its scrape stays at the fast interval.
    let mut r = Poller::new(&cfg_with(IDLE_2S, 1));
    let starts = drive(&mut r, 0, 5000, 50, IDLE, Some(3));
    assert!(starts.windows(2).all(|w| w[1] - w[0] <= 200), "{starts:?}");
}

#[test]
fn first_scrapes_spread_over_one_interval_and_the_cap_bounds_each_tick() {
    // 400 endpoints, cap 1000/s: a 50 ms tick may start at most 50 scrapes.
    let mut p = Poller::new(&cfg_with(r#"{"max_scrapes_per_s":1000}"#, 400));
    let mut per_tick = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for k in 0..40 {
        let due = p.scrapes_due(k * 50);
        per_tick.push(due.len());
        for a in due {
            seen.insert(a.clone());
            ok(&mut p, &a, k * 50, Some(0), BUSY);
        }
    }
    assert!(per_tick.iter().all(|n| *n <= 50), "{per_tick:?}");
    assert_eq!(seen.len(), 400);
    // Rates asked: 400 endpoints at 200..400 ms > 1000/s: intervals stretched and published so.
    let s = p.snapshot(2000);
    assert!(s.endpoints.iter().all(|e| e.poll_ms >= 400), "{:?}", s.endpoints[0].poll_ms);
    assert!(p.planned_rate() <= 1000.0 + 1.0, "{}", p.planned_rate());
    // Without a binding cap, 8 endpoints' first scrapes come within one interval, not at once.
    let mut q = Poller::new(&cfg_with("{}", 8));
    let firsts: Vec<usize> = (0..5).map(|k| q.scrapes_due(k * 50).len()).collect();
    assert_eq!(firsts.iter().sum::<usize>(), 8);
    assert!(firsts.iter().all(|n| *n < 8), "{firsts:?}");
}

#[test]
fn replicas_scale_the_intervals_of_endpoints_this_gateway_does_not_load() {
    let mut p = Poller::new(&cfg_with(r#"{"replicas":4,"idle_interval_ms":2000}"#, 1));
    drive(&mut p, 0, 60_000, 50, IDLE, Some(0));
    assert_eq!(p.snapshot(60_000).endpoints[0].poll_ms, 8000);
    // Moving load without this gateway: interval × replicas; with its requests: interval.
    let mut q = Poller::new(&cfg_with(r#"{"replicas":4,"idle_interval_ms":2000}"#, 1));
    ok(&mut q, "10.0.0.0:8000", 10, Some(0), IDLE);
    ok(&mut q, "10.0.0.0:8000", 20, Some(0), BUSY);
    assert_eq!(q.snapshot(20).endpoints[0].poll_ms, 800);
    ok(&mut q, "10.0.0.0:8000", 30, Some(2), BUSY);
    assert_eq!(q.snapshot(30).endpoints[0].poll_ms, 200);
}

#[test]
fn publishes_on_change_at_most_once_per_interval_and_as_a_heartbeat_otherwise() {
    let mut p = Poller::new(&cfg_with(IDLE_2S, 1));
    let a = "10.0.0.0:8000";
    assert!(p.publish_due(0), "the first endpoints are a change");
    p.snapshot(0);
    assert!(!p.publish_due(10));
    ok(&mut p, a, 100, Some(0), IDLE);
    // A change, but less than one interval since the last publish.
    assert!(!p.publish_due(150));
    assert!(p.publish_due(200));
    p.snapshot(200);
    // Unchanged metrics, same interval: only the heartbeat (max(200, 1000/4) = 250 ms).
    ok(&mut p, a, 300, Some(0), IDLE);
    ok(&mut p, a, 420, Some(0), IDLE);
    p.snapshot(420); // the interval grew (a change for readers' staleness)
    ok(&mut p, a, 500, Some(0), IDLE);
    let poll = p.snapshot(500).endpoints[0].poll_ms;
    ok(&mut p, a, 600, Some(0), IDLE);
    let unchanged_interval = p.snapshot(600).endpoints[0].poll_ms == poll;
    if unchanged_interval {
        ok(&mut p, a, 700, Some(0), IDLE);
        assert!(!p.publish_due(849));
        assert!(p.publish_due(850));
    }
    // Nothing scraped since the last publish: nothing to publish.
    p.snapshot(900);
    assert!(!p.publish_due(5000));
    // A failure is a change.
    p.on_result(a, 5000, ScrapeResult::Failed).unwrap_err();
    assert!(p.publish_due(5000));
}

#[test]
fn a_slowly_polled_idle_endpoint_stays_fresh_between_scrapes_and_goes_stale_when_overdue() {
    let mut p = Poller::new(&cfg_with(IDLE_2S, 1));
    let starts = drive(&mut p, 0, 20_000, 50, IDLE, Some(0));
    let last = *starts.last().unwrap();
    let e = p.snapshot(last).endpoints[0].clone();
    assert_eq!(e.poll_ms, 2000);
    // stale_after_ms 1000 alone would call it stale 1 s after the scrape.
    assert!(e.is_fresh(last + 1900, 1000));
    assert!(e.is_fresh(last + 2500, 1000));
    assert!(!e.is_fresh(last + 2501, 1000));
    // The scheduler and saturation read the same limit.
    assert!(crate::scheduler::filter::healthy(&e, last + 2400, 1000));
    assert!(!crate::scheduler::filter::healthy(&e, last + 2600, 1000));
}

#[test]
fn signal_changes() {
    let m = crate::poll::scrape::parse_metrics(std::str::from_utf8(BUSY).unwrap()).unwrap();
    let kv = |v| EndpointMetrics { kv_usage: Some(v), ..m.clone() };
    assert!(!signals_changed(&m, &m));
    assert!(!signals_changed(&m, &kv(0.505)));
    assert!(signals_changed(&m, &kv(0.52)));
    assert!(signals_changed(&m, &EndpointMetrics { queue: Some(3.0), ..m.clone() }));
    assert!(signals_changed(&m, &EndpointMetrics { kv_usage: None, ..m.clone() }));
    assert!(signals_changed(&m, &EndpointMetrics { running_adapters: vec!["a".into()], ..m.clone() }));
    let pc = crate::poll::config::PollerConfig::default();
    assert_eq!(tick_period_ms(&pc), 50);
    assert_eq!(tick_period_ms(&crate::poll::config::PollerConfig { interval_ms: 10, ..pc }), 10);
}

fn k8s_cfg() -> Config {
    Config::from_json(
            br#"{"version":1,"endpoints":[{"address":"127.0.0.1:8001","models":["m"]}],"models":[{"name":"m"}],
                "discovery":{"kubernetes":{"namespace":"llm","selector":{"app":"vllm"},"target_ports":[8000],
                "api_cluster":"kubernetes_api","api_authority":"kubernetes.default.svc","refresh_ms":5000,"timeout_ms":1000}}}"#,
        )
        .unwrap()
}

fn pod_list(ips: &[&str]) -> Vec<u8> {
    let items: Vec<String> = ips
            .iter()
            .enumerate()
            .map(|(i, ip)| {
                format!(
                    r#"{{"metadata":{{"name":"p{i}","namespace":"llm","labels":{{"app":"vllm"}}}},
                       "status":{{"phase":"Running","podIP":"{ip}","conditions":[{{"type":"Ready","status":"True"}}]}}}}"#
                )
            })
            .collect();
    format!(
        r#"{{"kind":"PodList","apiVersion":"v1","metadata":{{"resourceVersion":"7"}},"items":[{}]}}"#,
        items.join(",")
    )
    .into_bytes()
}

#[test]
fn discovery_merges_with_static_endpoints_and_keeps_state() {
    let cfg = k8s_cfg();
    let k = &cfg.discovery.as_ref().unwrap().kubernetes;
    let mut p = Poller::new(&cfg);
    assert!(p.discovery_due(0));
    // Outstanding: not due again until it answers (or times out: 1000 + grace 1000).
    assert!(!p.discovery_due(1500));
    assert_eq!(p.on_discovery(k, Some(200), &pod_list(&["10.1.0.5", "10.1.0.6"])).unwrap(), 3);
    p.due(10);
    p.on_result("10.1.0.5:8000", 20, ScrapeResult::Response { status: 200, body: VLLM }).unwrap();
    // Refresh every 5000 ms; pod 10.1.0.6 went away, 10.1.0.7 joined; 10.1.0.5 keeps its state.
    assert!(!p.discovery_due(4999));
    assert!(p.discovery_due(5000));
    assert_eq!(p.on_discovery(k, Some(200), &pod_list(&["10.1.0.5", "10.1.0.7"])).unwrap(), 3);
    let s = p.snapshot(5001);
    let addrs: Vec<&str> = s.endpoints.iter().map(|e| e.address.as_str()).collect();
    assert_eq!(addrs, ["127.0.0.1:8001", "10.1.0.5:8000", "10.1.0.7:8000"]);
    assert_eq!(s.endpoints[1].scraped_ms, 20);
    assert_eq!(s.endpoints[2].models, ["m"]);
    // Errors keep the previous set.
    assert!(p.discovery_due(10_000));
    assert!(p.on_discovery(k, Some(403), b"{}").is_err());
    assert!(p.discovery_due(15_000));
    assert!(p.on_discovery(k, None, b"").is_err());
    assert_eq!(p.snapshot(15_001).endpoints.len(), 3);
}

#[test]
fn a_discovery_that_could_not_be_used_keeps_the_endpoints_and_retries_at_the_next_refresh() {
    // Envoy refused the call, or the pod list was over poller.max_response_bytes.
    let cfg = k8s_cfg();
    let k = &cfg.discovery.as_ref().unwrap().kubernetes;
    let mut p = Poller::new(&cfg);
    assert!(p.discovery_due(0));
    p.on_discovery(k, Some(200), &pod_list(&["10.1.0.5"])).unwrap();
    assert!(p.discovery_due(5000));
    p.discovery_failed();
    // No longer outstanding, but the refresh cadence still applies.
    assert!(!p.discovery_due(5001));
    assert!(p.discovery_due(10_000));
    assert_eq!(p.snapshot(10_001).endpoints.len(), 2);
    assert_eq!(DiscoveryError::Status(403).reason(), "status");
    assert_eq!(DiscoveryError::WrongKind("Status".into()).reason(), "bad_body");
}

#[test]
fn abandoning_outstanding_scrapes_allows_a_fresh_schedule() {
    let mut p = Poller::new(&cfg());
    assert_eq!((0..5).map(|k| p.scrapes_due(k * 50).len()).sum::<usize>(), 2);
    assert!((5..20).all(|k| p.scrapes_due(k * 50).is_empty()), "outstanding: never twice");
    p.abandon_outstanding();
    assert_eq!((40..45).map(|k| p.scrapes_due(k * 50).len()).sum::<usize>(), 2);
}
