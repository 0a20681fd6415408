//! Tests of the two picks and the split decision.

use super::*;
use crate::base::ports::{MemStore, SplitMix64};
use crate::config::Config;
use crate::scheduler::PickState;
use crate::state::catalog::Role;
use crate::state::health::HealthView;
use crate::state::metrics::EndpointMetrics;
use crate::state::snapshot::Snapshot;

const NOW: u64 = 1_000_000;

fn config(pd: &str, endpoints: &str) -> Config {
    let json = format!(r#"{{"version":1,"endpoints":[{endpoints}],"models":[{{"name":"llama"}}]{pd}}}"#);
    Config::from_json(json.as_bytes()).unwrap()
}

fn pd_config(threshold: u64) -> Config {
    config(
        &format!(r#","pd":{{"pd_threshold_tokens":{threshold}}}"#),
        r#"{"address":"10.0.0.1:8000","models":["llama"]}"#,
    )
}

fn ep(addr: &str, role: Role, queue: f64) -> EndpointStatus {
    EndpointStatus {
        address: addr.into(),
        models: vec!["llama".into()],
        metrics: Some(EndpointMetrics {
            queue: Some(queue),
            running: Some(0.0),
            kv_usage: Some(0.1),
            ..Default::default()
        }),
        scraped_ms: NOW - 100,
        failures: 0,
        inflight_at_scrape: None,
        role,
        poll_ms: 0,
    }
}

fn snap(eps: Vec<EndpointStatus>) -> Snapshot {
    Snapshot { version: 1, published_ms: NOW - 50, endpoints: eps }
}

/// Two decode pods, two prefill pods, one `both`.
fn pool() -> Snapshot {
    snap(vec![
        ep("10.0.0.1:8000", Role::Decode, 0.0),
        ep("10.0.0.2:8000", Role::Decode, 0.0),
        ep("10.0.0.3:8000", Role::Prefill, 0.0),
        ep("10.0.0.4:8000", Role::Prefill, 0.0),
    ])
}

/// A prompt of `n` bytes, distinct per `tag`.
fn prompt(tag: &str, n: usize) -> String {
    let mut s = String::with_capacity(n + 16);
    let mut i = 0u64;
    while s.len() < n {
        s.push_str(&format!("{tag}-{i} "));
        i += 1;
    }
    s.truncate(n);
    s
}

struct Run {
    cfg: Config,
    sched: Scheduler,
    store: MemStore,
}

impl Run {
    fn new(cfg: Config) -> Run {
        Run { sched: Scheduler::new(&cfg), cfg, store: MemStore::new() }
    }

    fn go(&mut self, sn: &Snapshot, text: &str, health: &HealthView, seed: u64) -> Result<PdPick, Rejection> {
        let req = PickRequest { model: "llama", prompt: text, ..Default::default() };
        let route = self.sched.route_model("llama", None, sn, &mut SplitMix64::new(seed)).unwrap();
        let inflight = Default::default();
        let state = PickState { snapshot: sn, inflight: &inflight, health, store: &self.store, now_ms: NOW };
        let rng = &mut SplitMix64::new(seed);
        let input = PickInput { route: &route, request: req, state, scope: Default::default(), rng };
        pick(&self.cfg.request(), &mut self.sched, input)
    }
}

fn role_of(sn: &Snapshot, addr: &str) -> Role {
    sn.endpoints.iter().find(|e| e.address == addr).unwrap().role
}

#[test]
fn uncached_tokens_follow_the_matched_blocks() {
    // 4000 bytes at 4 bytes a token = 1000 tokens; nothing cached.
    assert_eq!(uncached_tokens(4000, 0.0, 15, 256, 4), 1000);
    // All 15 blocks (3840 bytes = 960 tokens) cached: the 160-byte tail is left, 40 tokens.
    assert_eq!(uncached_tokens(4000, 1.0, 15, 256, 4), 40);
    // 5 of 15 blocks: 1000 - 320 = 680.
    assert_eq!(uncached_tokens(4000, 5.0 / 15.0, 15, 256, 4), 680);
    // Out-of-range inputs neither panic nor go negative.
    assert_eq!(uncached_tokens(0, 1.0, 15, 256, 0), 0);
    assert_eq!(uncached_tokens(100, f64::NAN, 15, 256, 4), 25);
}

#[test]
fn llm_d_rule_splits_at_or_above_the_threshold_and_always_at_zero() {
    assert!(should_split(0, 0));
    assert!(should_split(100, 100));
    assert!(!should_split(100, 99));
}

#[test]
fn without_the_pd_section_roles_are_ignored_and_nothing_is_split() {
    let mut r = Run::new(config("", r#"{"address":"10.0.0.1:8000","models":["llama"]}"#));
    // Only a "prefill" pod: without `pd` it is an ordinary endpoint.
    let sn = snap(vec![ep("10.0.0.3:8000", Role::Prefill, 0.0)]);
    let p = r.go(&sn, &prompt("a", 8000), &HealthView::default(), 1).unwrap();
    assert_eq!((p.pick.primary.as_str(), p.prefiller, p.decision), ("10.0.0.3:8000", None, Decision::Off));
}

#[test]
fn a_long_prompt_gets_a_prefill_pod_and_a_decode_destination() {
    let sn = pool();
    for seed in 0..40 {
        let mut r = Run::new(pd_config(256));
        let p = r.go(&sn, &prompt("long", 8000), &HealthView::default(), seed).unwrap();
        assert_eq!(p.decision, Decision::Split, "seed {seed}");
        assert_eq!(role_of(&sn, &p.pick.primary), Role::Decode);
        // The fallbacks are decode pods too: a retry keeps the protocol.
        assert!(p.pick.fallbacks.iter().all(|f| role_of(&sn, f) == Role::Decode), "{:?}", p.pick.fallbacks);
        let pre = p.prefiller.unwrap();
        assert_eq!(role_of(&sn, &pre), Role::Prefill);
        assert_eq!(p.uncached_tokens, 2000);
    }
}

#[test]
fn a_short_prompt_or_a_cached_one_is_not_split() {
    let sn = pool();
    let mut r = Run::new(pd_config(256));
    // 800 bytes = 200 tokens < 256.
    let p = r.go(&sn, &prompt("short", 800), &HealthView::default(), 1).unwrap();
    assert_eq!((p.decision, p.prefiller), (Decision::BelowThreshold, None));
    // A long prompt is split once; sent again, its decode pod holds all but the partial last
    // block (8000 bytes = 31 blocks of 256 + 64 bytes = 16 tokens), so it is not split again.
    let text = prompt("conv", 8000);
    let first = r.go(&sn, &text, &HealthView::default(), 2).unwrap();
    assert_eq!(first.decision, Decision::Split);
    // The next turn comes after the first one finished.
    r.sched.request_done(first.pick.ticket);
    let again = r.go(&sn, &text, &HealthView::default(), 3).unwrap();
    assert_eq!(again.pick.primary, first.pick.primary, "prefix affinity keeps the decode pod");
    assert_eq!(
        (again.decision, again.uncached_tokens, again.prefiller),
        (Decision::BelowThreshold, 16, None)
    );
}

#[test]
fn threshold_zero_splits_everything_and_the_prefill_pod_follows_the_prefix() {
    let sn = pool();
    let mut r = Run::new(pd_config(0));
    let text = prompt("shared", 8000);
    let first = r.go(&sn, &text, &HealthView::default(), 7).unwrap();
    let pre = first.prefiller.clone().unwrap();
    // Every later copy of the prompt goes to the same prefill pod (it holds the blocks), whatever
    // the tie-break seed.
    for seed in 8..40 {
        let p = r.go(&sn, &text, &HealthView::default(), seed).unwrap();
        assert_eq!(p.decision, Decision::Split);
        assert_eq!(p.prefiller.as_deref(), Some(pre.as_str()), "seed {seed}");
    }
    // Only the 33 decode picks wait for a first byte; a prefill pick leaves no ledger entry
    // (nothing would ever end it).
    assert_eq!(r.sched.pending_requests(), 33);
    // Even a prompt shorter than one block is split at threshold 0 (llm-d's default).
    let p = r.go(&sn, "hi", &HealthView::default(), 1).unwrap();
    assert_eq!(p.decision, Decision::Split);
}

#[test]
fn the_prefill_queue_steers_the_prefill_pick() {
    let mut sn = pool();
    sn.endpoints[2].metrics.as_mut().unwrap().queue = Some(20.0);
    for seed in 0..20 {
        let mut r = Run::new(pd_config(0));
        let p = r.go(&sn, &prompt("q", 4000), &HealthView::default(), seed).unwrap();
        assert_eq!(p.prefiller.as_deref(), Some("10.0.0.4:8000"), "seed {seed}");
    }
}

#[test]
fn a_prefill_pod_is_never_the_destination_and_a_pool_without_one_never_splits() {
    // The prefill pod is idle and the decode pod busy: the destination is still the decode pod.
    let sn = snap(vec![ep("10.0.0.1:8000", Role::Decode, 30.0), ep("10.0.0.3:8000", Role::Prefill, 0.0)]);
    for seed in 0..20 {
        let mut r = Run::new(pd_config(0));
        let p = r.go(&sn, &prompt("x", 4000), &HealthView::default(), seed).unwrap();
        assert_eq!(p.pick.primary, "10.0.0.1:8000");
        assert!(p.pick.fallbacks.is_empty());
    }
    let decode_only =
        snap(vec![ep("10.0.0.1:8000", Role::Decode, 0.0), ep("10.0.0.2:8000", Role::Decode, 0.0)]);
    let mut r = Run::new(pd_config(0));
    let p = r.go(&decode_only, &prompt("x", 8000), &HealthView::default(), 1).unwrap();
    assert_eq!((p.decision, p.prefiller), (Decision::NoPrefillPods, None));
    // Only prefill pods: no destination at all.
    let prefill_only = snap(vec![ep("10.0.0.3:8000", Role::Prefill, 0.0)]);
    let e = r.go(&prefill_only, &prompt("x", 8000), &HealthView::default(), 1).unwrap_err();
    assert_eq!((e.status, e.code), (503, "no_endpoint"));
}

#[test]
fn a_both_pod_is_not_its_own_prefiller() {
    let sn = snap(vec![ep("10.0.0.5:8000", Role::Both, 0.0)]);
    let mut r = Run::new(pd_config(0));
    let p = r.go(&sn, &prompt("b", 4000), &HealthView::default(), 1).unwrap();
    assert_eq!((p.pick.primary.as_str(), p.decision), ("10.0.0.5:8000", Decision::NoPrefillPods));
    // With a second `both` pod, each can prefill for the other (a fresh worker: in `r` the
    // first request is still prefilling on 10.0.0.5, which the prefill-busy guard would see).
    let sn = snap(vec![ep("10.0.0.5:8000", Role::Both, 0.0), ep("10.0.0.6:8000", Role::Both, 0.0)]);
    let mut r = Run::new(pd_config(0));
    let p = r.go(&sn, &prompt("c", 4000), &HealthView::default(), 2).unwrap();
    let pre = p.prefiller.unwrap();
    assert_ne!(pre, p.pick.primary);
}

#[test]
fn stale_or_ejected_prefill_pods_are_never_named() {
    let mut sn = pool();
    // 10.0.0.3 failed its last scrape: stale.
    sn.endpoints[2].failures = 1;
    for seed in 0..20 {
        let mut r = Run::new(pd_config(0));
        let p = r.go(&sn, &prompt("s", 4000), &HealthView::default(), seed).unwrap();
        assert_eq!(p.prefiller.as_deref(), Some("10.0.0.4:8000"), "seed {seed}");
    }
    // 10.0.0.4 is ejected by passive health too: no prefill pod left, the decode pod prefills.
    let entry = crate::state::health::Entry {
        consecutive_5xx: 5,
        ejected_at_ms: NOW - 10,
        ejected_until_ms: NOW + 10_000,
        ejections: 1,
        probation: true,
        touched_ms: NOW - 10,
        ..Default::default()
    };
    let health = HealthView::from_entries([("10.0.0.4:8000".to_string(), entry)]);
    assert!(health.ejected("10.0.0.4:8000", NOW));
    let mut r = Run::new(pd_config(0));
    let p = r.go(&sn, &prompt("s", 4000), &health, 1).unwrap();
    assert_eq!((p.decision, p.prefiller), (Decision::NoHealthyPrefill, None));
    assert_eq!(role_of(&sn, &p.pick.primary), Role::Decode);
    // Ejected while it is the only prefill pod (passive health never ejects the last endpoint of
    // a pool, but the prefill pick leaves it out anyway).
    let sn = snap(vec![ep("10.0.0.1:8000", Role::Decode, 0.0), ep("10.0.0.4:8000", Role::Prefill, 0.0)]);
    let p = r.go(&sn, &prompt("s", 4000), &health, 2).unwrap();
    assert_eq!((p.decision, p.prefiller), (Decision::NoHealthyPrefill, None));
}

#[test]
fn a_decode_pick_that_fails_open_is_not_split() {
    let cfg = config(
        r#","pd":{"pd_threshold_tokens":0},"filter":{"failure_mode":"FailOpen"}"#,
        r#"{"address":"10.0.0.1:8000","models":["llama"]}"#,
    );
    let mut sn = pool();
    sn.endpoints[0].failures = 1;
    sn.endpoints[1].failures = 1;
    let mut r = Run::new(cfg);
    let p = r.go(&sn, &prompt("f", 4000), &HealthView::default(), 1).unwrap();
    assert!(p.pick.fail_open);
    assert_eq!(role_of(&sn, &p.pick.primary), Role::Decode);
    assert_eq!((p.decision, p.prefiller), (Decision::FailOpen, None));
}

#[test]
fn config_reads_roles_and_reports_bad_pd_fields_with_their_paths() {
    let cfg = config(
        r#","pd":{"pd_threshold_tokens":512,"decode_prefix_factor":0.25}"#,
        r#"{"address":"10.0.0.1:8000","models":["llama"],"role":"prefill"},
           {"address":"10.0.0.2:8000","models":["llama"],"role":"prefill-decode"},
           {"address":"10.0.0.3:8000","models":["llama"]}"#,
    );
    let roles: Vec<Role> = cfg.endpoints.iter().map(|e| e.role).collect();
    assert_eq!(roles, [Role::Prefill, Role::Both, Role::Decode]);
    let pd = cfg.pd.unwrap();
    assert_eq!((pd.pd_threshold_tokens, pd.decode_prefix_factor), (512, 0.25));
    // Defaults.
    assert_eq!(
        config(r#","pd":{}"#, r#"{"address":"10.0.0.1:8000","models":["llama"]}"#).pd,
        Some(PdConfig::default())
    );

    let bad = |pd: &str, eps: &str| {
        let json = format!(r#"{{"version":1,"endpoints":[{eps}],"models":[{{"name":"llama"}}]{pd}}}"#);
        Config::from_json(json.as_bytes()).unwrap_err()
    };
    let one = r#"{"address":"10.0.0.1:8000","models":["llama"]}"#;
    let e = bad(r#","pd":{"decode_prefix_factor":1.5,"pd_threshold_tokens":20000000}"#, one);
    let paths: Vec<&str> = e.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(paths, ["pd.pd_threshold_tokens", "pd.decode_prefix_factor"], "{e:?}");
    let e = bad(r#","pd":{"prefill_busy_factor":0.5,"transfer_ms_per_1k_tokens":-1}"#, one);
    let paths: Vec<&str> = e.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(paths, ["pd.prefill_busy_factor", "pd.transfer_ms_per_1k_tokens"], "{e:?}");
    let e = bad(r#","pd":{"threshold":5}"#, one);
    assert!(e[0].path.starts_with("pd") && e[0].reason.contains("threshold"), "{e:?}");
    let e = bad("", r#"{"address":"10.0.0.1:8000","models":["llama"],"role":"encode"}"#);
    assert!(e[0].path.starts_with("endpoints[0].role"), "{e:?}");
}

fn k8s_config(roles: &str) -> Config {
    let json = format!(
        r#"{{"version":1,"endpoints":[{{"address":"10.0.0.9:8000","models":["llama"],"role":"both"}}],
            "models":[{{"name":"llama"}}],"pd":{{}},
            "discovery":{{"kubernetes":{{"namespace":"inference","selector":{{"app":"vllm"}},
                "target_ports":[8000]{roles}}}}}}}"#
    );
    Config::from_json(json.as_bytes()).unwrap()
}

fn pod(name: &str, ip: &str, labels: &str) -> String {
    format!(
        r#"{{"metadata":{{"name":"{name}","namespace":"inference","labels":{{"app":"vllm"{labels}}}}},
            "status":{{"podIP":"{ip}","conditions":[{{"type":"Ready","status":"True"}}]}}}}"#
    )
}

fn pod_list(pods: &[String]) -> Vec<u8> {
    format!(r#"{{"kind":"PodList","apiVersion":"v1","metadata":{{}},"items":[{}]}}"#, pods.join(","))
        .into_bytes()
}

#[test]
fn discovered_roles_come_from_llm_d_labels_and_reach_the_snapshot() {
    let cfg = k8s_config("");
    let k = &cfg.discovery.as_ref().unwrap().kubernetes;
    let body = pod_list(&[
        pod("p", "10.1.0.1", r#","llm-d.ai/role":"prefill""#),
        pod("d", "10.1.0.2", r#","llm-d.ai/role":"decode""#),
        pod("b", "10.1.0.3", r#","llm-d.ai/role":"prefill-decode""#),
        pod("u", "10.1.0.4", ""),
        // A static endpoint wins over a discovered pod with the same address.
        pod("s", "10.0.0.9", r#","llm-d.ai/role":"prefill""#),
    ]);
    let d = crate::poll::discovery::parse_pod_list(&body, k).unwrap();
    let roles: Vec<(&str, Role)> = d.endpoints.iter().map(|e| (e.address.as_str(), e.role)).collect();
    assert_eq!(
        roles,
        [
            ("10.0.0.9:8000", Role::Prefill),
            ("10.1.0.1:8000", Role::Prefill),
            ("10.1.0.2:8000", Role::Decode),
            ("10.1.0.3:8000", Role::Both),
            ("10.1.0.4:8000", Role::Decode)
        ]
    );
    let mut p = crate::poll::poller::Poller::new(&cfg);
    p.on_discovery(k, Some(200), &body).unwrap();
    let sn = p.snapshot(NOW);
    let mut roles: Vec<(String, Role)> = sn.endpoints.iter().map(|e| (e.address.clone(), e.role)).collect();
    roles.sort();
    assert_eq!(
        roles,
        [
            ("10.0.0.9:8000".to_string(), Role::Both),
            ("10.1.0.1:8000".to_string(), Role::Prefill),
            ("10.1.0.2:8000".to_string(), Role::Decode),
            ("10.1.0.3:8000".to_string(), Role::Both),
            ("10.1.0.4:8000".to_string(), Role::Decode)
        ]
    );
    // A pod relabelled prefill → decode loses its role at the next list.
    let body = pod_list(&[pod("p", "10.1.0.1", r#","llm-d.ai/role":"decode""#)]);
    p.on_discovery(k, Some(200), &body).unwrap();
    let sn = p.snapshot(NOW);
    let r: Vec<Role> = sn.endpoints.iter().filter(|e| e.address == "10.1.0.1:8000").map(|e| e.role).collect();
    assert_eq!(r, [Role::Decode]);
    // The snapshot carries the role through its JSON (the filter reads it from shared data).
    let back: Snapshot = serde_json::from_slice(&serde_json::to_vec(&sn).unwrap()).unwrap();
    assert_eq!(back, sn);
}

#[test]
fn custom_role_selectors_are_read() {
    let cfg =
        k8s_config(r#","roles":{"label":"example.com/stage","prefill":["ctx"],"decode":["gen"],"both":[]}"#);
    let k = &cfg.discovery.as_ref().unwrap().kubernetes;
    let body = pod_list(&[
        pod("p", "10.1.0.1", r#","example.com/stage":"ctx""#),
        pod("q", "10.1.0.2", r#","llm-d.ai/role":"prefill""#),
    ]);
    let d = crate::poll::discovery::parse_pod_list(&body, k).unwrap();
    let roles: Vec<Role> = d.endpoints.iter().map(|e| e.role).collect();
    assert_eq!(roles, [Role::Prefill, Role::Decode]);
}

#[test]
fn prefill_busy_compares_the_two_paths_with_the_transfer() {
    let pd = PdConfig { prefill_busy_factor: 2.0, ..PdConfig::default() };
    // 1,000 tokens: 5 ms of transfer. 150 + 5 ≤ 2 × 100: split; 196 + 5 > 200: busy.
    assert!(!prefill_busy(&pd, Some(100.0), Some(150.0), 1000));
    assert!(prefill_busy(&pd, Some(100.0), Some(196.0), 1000));
    // Off, or a prediction missing (objective `weighted`): llm-d's rule alone.
    assert!(!prefill_busy(&PdConfig::default(), Some(1.0), Some(1e9), 1000), "off by default");
    assert!(!prefill_busy(&pd, None, Some(1e9), 1000));
    assert!(!prefill_busy(&pd, Some(1.0), None, 1000));
    assert!(!prefill_busy(&pd, Some(f64::NAN), Some(1e9), 1000));
}

#[test]
fn backed_up_prefill_pods_are_not_named_and_idle_ones_are() {
    let guarded = || {
        config(
            r#","pd":{"pd_threshold_tokens":0,"prefill_busy_factor":2}"#,
            r#"{"address":"10.0.0.1:8000","models":["llama"]}"#,
        )
    };
    // Idle pool: the prefill path costs about the same as the decode pod prefilling itself
    // (plus the transfer), well within 2×: split.
    let mut r = Run::new(guarded());
    let p = r.go(&pool(), &prompt("idle", 8000), &HealthView::default(), 1).unwrap();
    assert_eq!(p.decision, Decision::Split);
    // Both prefill pods have 30 requests queued, the decode pods none: the decode pod prefills.
    let mut sn = pool();
    for e in sn.endpoints.iter_mut().filter(|e| e.role == Role::Prefill) {
        e.metrics.as_mut().unwrap().queue = Some(30.0);
    }
    let mut r = Run::new(guarded());
    let p = r.go(&sn, &prompt("busy", 8000), &HealthView::default(), 1).unwrap();
    assert_eq!((p.decision, p.prefiller.as_deref()), (Decision::PrefillBusy, None));
    assert_eq!(role_of(&sn, &p.pick.primary), Role::Decode);
    // The guard off (the default): llm-d's rule splits anyway.
    let mut r = Run::new(pd_config(0));
    let p = r.go(&sn, &prompt("busy", 8000), &HealthView::default(), 1).unwrap();
    assert_eq!(p.decision, Decision::Split);
}
