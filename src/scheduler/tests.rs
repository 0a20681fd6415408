//! End-to-end tests of `Scheduler::pick` (model → filters → scorers → picker).

use proptest::prelude::*;

use super::*;
use crate::base::ports::{MemStore, Rng, SharedStore, SplitMix64};
use crate::config::Config;
use crate::state::health::HealthView;
use crate::state::inflight::InflightCounts;
use crate::state::metrics::EndpointMetrics;
use crate::state::prefix_shared;

const NOW: u64 = 1_000_000;

/// A configuration with the `weighted` objective (the scorers and weights), which most tests
/// below exercise; [`config_ttft`] keeps the default `predicted_ttft`.
pub(crate) fn config(extra: &str) -> Config {
    let mut c = config_ttft(extra);
    c.scheduler.objective = config::Objective::Weighted;
    c
}

/// A configuration with the default objective (`predicted_ttft`).
pub(crate) fn config_ttft(extra: &str) -> Config {
    let json = format!(
        r#"{{"version":1,
            "endpoints":[{{"address":"10.0.0.1:8000","models":["llama"]}}],
            "models":[{{"name":"llama","adapters":["sql-lora"]}},{{"name":"qwen"}}]{extra}}}"#
    );
    Config::from_json(json.as_bytes()).unwrap()
}

pub(crate) fn ep(addr: &str, models: &[&str], queue: f64, kv: f64) -> EndpointStatus {
    EndpointStatus {
        address: addr.into(),
        models: models.iter().map(|s| s.to_string()).collect(),
        metrics: Some(EndpointMetrics {
            queue: Some(queue),
            running: Some(0.0),
            kv_usage: Some(kv),
            ..Default::default()
        }),
        scraped_ms: NOW - 100,
        failures: 0,
        inflight_at_scrape: None,
        role: Default::default(),
        poll_ms: 0,
    }
}

pub(crate) fn snap(eps: Vec<EndpointStatus>) -> Snapshot {
    Snapshot { version: 1, published_ms: NOW - 50, endpoints: eps }
}

impl Scheduler {
    /// The pick of a request naming its model: [`Scheduler::route_model`], then
    /// [`Scheduler::pick`] with no passive-health data and the default scope.
    pub(crate) fn pick_model(
        &mut self,
        r: &PickRequest<'_>,
        sn: &Snapshot,
        inf: &InflightCounts,
        store: &dyn SharedStore,
        rng: &mut dyn Rng,
        now_ms: u64,
    ) -> Result<Pick, Rejection> {
        let route = self.route_model(r.model, r.session_id, sn, rng)?;
        let health = HealthView::default();
        let state = PickState { snapshot: sn, inflight: inf, health: &health, store, now_ms };
        self.pick(PickInput { route: &route, request: *r, state, scope: PickScope::default(), rng })
    }
}

fn req(model: &str) -> PickRequest<'_> {
    PickRequest { model, ..Default::default() }
}

fn pick(
    s: &mut Scheduler,
    r: &PickRequest<'_>,
    sn: &Snapshot,
    inf: &InflightCounts,
    seed: u64,
) -> Result<Pick, Rejection> {
    s.pick_model(r, sn, inf, &MemStore::new(), &mut SplitMix64::new(seed), NOW)
}

#[test]
fn unknown_model_is_404() {
    let mut s = Scheduler::new(&config(""));
    let e = pick(&mut s, &req("gpt-4"), &snap(vec![ep("a:1", &["llama"], 0.0, 0.0)]), &Default::default(), 1)
        .unwrap_err();
    assert_eq!((e.status, e.code), (404, "model_not_found"));
}

#[test]
fn known_model_without_endpoint_is_503_no_endpoint() {
    let mut s = Scheduler::new(&config(""));
    let e = pick(&mut s, &req("qwen"), &snap(vec![ep("a:1", &["llama"], 0.0, 0.0)]), &Default::default(), 1)
        .unwrap_err();
    assert_eq!((e.status, e.code, e.retry_after_s), (503, "no_endpoint", Some(1)));
}

#[test]
fn picks_least_loaded_with_fallbacks_in_score_order() {
    let mut s = Scheduler::new(&config(""));
    // Weights queue 2, kv 2, inflight 1 (prefix/session/lora contribute 0 here).
    // a: q 10 → 0.0, kv 0.5 → 0.5, inflight 1 → (0+1)/(1+1) = 0.5: total 0 + 1.0 + 0.5 = 1.5
    // b: q 0 → 1.0, kv 0.2 → 0.8, inflight 0 → 1.0:              total 2 + 1.6 + 1.0 = 4.6
    // c: q 5 → 0.5, kv 0.2 → 0.8, inflight 0 → 1.0:              total 1 + 1.6 + 1.0 = 3.6
    // d: serves qwen only: never a candidate.
    let sn = snap(vec![
        ep("a:1", &["llama"], 10.0, 0.5),
        ep("b:1", &["llama"], 0.0, 0.2),
        ep("c:1", &["llama"], 5.0, 0.2),
        ep("d:1", &["qwen"], 0.0, 0.0),
    ]);
    let inf = InflightCounts::from_text(b"a:1=1");
    let p = pick(&mut s, &req("llama"), &sn, &inf, 7).unwrap();
    assert_eq!(p.primary, "b:1");
    assert_eq!(p.fallbacks, vec!["c:1", "a:1"]);
    assert_eq!(p.destination_header(), "b:1,c:1,a:1");
    assert_eq!((p.reason, p.fail_open, p.serving, p.healthy), (PickReason::Scored, false, 3, 3));
    assert_eq!(p.target_model, "llama");
    assert!(!p.model_rewritten);
    assert_eq!(p.session_token, s.session_keys().token_for("b:1"));
    assert_eq!(p.debug_scores, None);
}

#[test]
fn stale_and_failing_endpoints_are_not_candidates() {
    let mut s = Scheduler::new(&config(""));
    let mut stale = ep("stale:1", &["llama"], 0.0, 0.0);
    stale.scraped_ms = NOW - 1001; // stale_after_ms default 1000
    let mut failing = ep("failing:1", &["llama"], 0.0, 0.0);
    failing.failures = 2;
    let sn = snap(vec![stale, failing, ep("busy:1", &["llama"], 50.0, 0.9)]);
    let p = pick(&mut s, &req("llama"), &sn, &Default::default(), 1).unwrap();
    // Only the busy one is healthy; the idle-looking ones are stale or failing.
    assert_eq!((p.primary.as_str(), p.fallbacks.len(), p.healthy, p.serving), ("busy:1", 0, 1, 3));
}

#[test]
fn no_healthy_endpoint_fails_closed_by_default() {
    let mut s = Scheduler::new(&config(""));
    let mut a = ep("a:1", &["llama"], 0.0, 0.0);
    a.failures = 1;
    let e = pick(&mut s, &req("llama"), &snap(vec![a]), &Default::default(), 1).unwrap_err();
    assert_eq!((e.status, e.code), (503, "no_healthy_endpoint"));
}

#[test]
fn fail_open_picks_lowest_inflight_with_seeded_tie_break() {
    let mut s = Scheduler::new(&config(r#","filter":{"failure_mode":"FailOpen"}"#));
    let stale = |a: &str| {
        let mut e = ep(a, &["llama"], 0.0, 0.0);
        e.scraped_ms = 0;
        e
    };
    let sn = snap(vec![stale("a:1"), stale("b:1"), stale("c:1"), ep("q:1", &["qwen"], 0.0, 0.0)]);
    // In flight: a 3, b 1, c 1 → b and c tie at 1; a is the last fallback.
    let inf = InflightCounts::from_text(b"a:1=3;b:1=1;c:1=1;q:1=0");
    let mut seen = hashbrown::HashSet::new();
    for seed in 0..40 {
        let p = pick(&mut s, &req("llama"), &sn, &inf, seed).unwrap();
        assert!(p.fail_open);
        assert_eq!(p.reason, PickReason::FailOpen);
        assert!(p.primary == "b:1" || p.primary == "c:1", "{}", p.primary);
        assert_eq!(p.fallbacks.len(), 2);
        assert_eq!(p.fallbacks.last().map(String::as_str), Some("a:1"));
        seen.insert(p.primary);
    }
    // Both tied endpoints are chosen for some seed.
    assert_eq!(seen.len(), 2);
}

#[test]
fn same_seed_same_decision_and_ties_spread() {
    let mut s = Scheduler::new(&config(""));
    let sn = snap((1..=8).map(|i| ep(&format!("10.0.0.{i}:8000"), &["llama"], 1.0, 0.3)).collect());
    let a = pick(&mut s, &req("llama"), &sn, &Default::default(), 99).unwrap();
    let b = pick(&mut s, &req("llama"), &sn, &Default::default(), 99).unwrap();
    assert_eq!(a, b);
    // All 8 are equal: over 64 seeds the primary is not always the same endpoint.
    let primaries: hashbrown::HashSet<String> = (0..64)
        .map(|seed| pick(&mut s, &req("llama"), &sn, &Default::default(), seed).unwrap().primary)
        .collect();
    assert!(primaries.len() >= 6, "{primaries:?}");
}

#[test]
fn session_token_routes_to_named_endpoint_unless_overloaded() {
    let mut s = Scheduler::new(&config(""));
    let sn = snap(vec![ep("a:1", &["llama"], 0.0, 0.1), ep("b:1", &["llama"], 10.0, 0.5)]);
    let tok = s.session_keys().token_for("b:1");
    let r = PickRequest { model: "llama", session_token: Some(&tok), ..Default::default() };
    let p = pick(&mut s, &r, &sn, &Default::default(), 1).unwrap();
    assert_eq!((p.primary.as_str(), p.reason), ("b:1", PickReason::SessionToken));
    assert_eq!(p.fallbacks, vec!["a:1"]);
    // b overloaded: load 100 vs 0 → gap 100 > 64 and 100 > 0: token ignored, a wins on score.
    let sn = snap(vec![ep("a:1", &["llama"], 0.0, 0.1), ep("b:1", &["llama"], 100.0, 0.5)]);
    let p = pick(&mut s, &r, &sn, &Default::default(), 1).unwrap();
    assert_eq!((p.primary.as_str(), p.reason, p.overloaded), ("a:1", PickReason::Scored, 1));
    // A forged token (an address as text) is ignored.
    let r = PickRequest { model: "llama", session_token: Some("b:1"), ..Default::default() };
    let p = pick(&mut s, &r, &sn, &Default::default(), 1).unwrap();
    assert_eq!(p.reason, PickReason::Scored);
}

#[test]
fn session_id_keeps_a_session_on_one_endpoint() {
    let mut s = Scheduler::new(&config(""));
    let sn = snap((1..=4).map(|i| ep(&format!("10.0.0.{i}:8000"), &["llama"], 0.0, 0.2)).collect());
    let r = PickRequest { model: "llama", session_id: Some("conv-42"), ..Default::default() };
    let first = pick(&mut s, &r, &sn, &Default::default(), 0).unwrap().primary;
    for seed in 1..30 {
        assert_eq!(pick(&mut s, &r, &sn, &Default::default(), seed).unwrap().primary, first);
    }
}

#[test]
fn rewrite_is_reported_and_adapter_goes_to_base_endpoints() {
    let mut s = Scheduler::new(&config(
        r#","scheduler":{"rewrites":[{"matches":[{"model":{"value":"llama"}}],"targets":[{"model_rewrite":"sql-lora"}]}]}"#,
    ));
    let sn = snap(vec![ep("a:1", &["llama"], 0.0, 0.0), ep("q:1", &["qwen"], 0.0, 0.0)]);
    let p = pick(&mut s, &req("llama"), &sn, &Default::default(), 1).unwrap();
    assert_eq!((p.target_model.as_str(), p.model_rewritten, p.primary.as_str()), ("sql-lora", true, "a:1"));
}

#[test]
fn debug_scores_when_enabled() {
    let mut s = Scheduler::new(&config(r#","scheduler":{"debug_scores":true}"#));
    let sn = snap(vec![ep("a:1", &["llama"], 0.0, 0.25)]);
    let p = pick(&mut s, &req("llama"), &sn, &Default::default(), 1).unwrap();
    // q 1.0 ×0.5 + kv 0.75 ×0.5 + inflight 1.0 ×2 = 2.875
    assert_eq!(
        p.debug_scores.as_deref(),
        Some("a:1 t=2.875 p=0.000 q=1.000 kv=0.750 if=1.000 s=0.000 l=0.000")
    );
}

#[test]
fn per_model_weights_override_pool_weights() {
    // For qwen only the queue matters; a has the better queue but 2 in flight.
    let mut s = Scheduler::new(&config(
        r#","scheduler":{"model_weights":{"qwen":{"queue":5,"kv_cache":0,"inflight":0}}}"#,
    ));
    let sn = snap(vec![ep("a:1", &["llama", "qwen"], 0.0, 0.0), ep("b:1", &["llama", "qwen"], 9.0, 0.0)]);
    let inf = InflightCounts::from_text(b"a:1=2");
    // qwen: a: 1.0×5 = 5 vs b: 0.
    assert_eq!(pick(&mut s, &req("qwen"), &sn, &inf, 1).unwrap().primary, "a:1");
    // llama keeps the pool weights (queue 0.5, kv 0.5, inflight 2):
    // a: 0.5 + 0.5 + 2×(1/3) = 1.67 vs b: 0 + 0.5 + 2×1 = 2.5.
    assert_eq!(pick(&mut s, &req("llama"), &sn, &inf, 1).unwrap().primary, "b:1");
}

fn arb_endpoint() -> impl Strategy<Value = EndpointStatus> {
    (
        0u8..16,
        prop::sample::subsequence(vec!["llama", "qwen"], 0..=2),
        prop::option::of(0.0f64..200.0),
        prop::option::of(-0.5f64..1.5),
        prop::option::of(0.0f64..300.0),
        0u64..2000,
        0u32..3,
        prop::bool::ANY,
    )
        .prop_map(|(n, models, q, kv, r, age, failures, has_metrics)| EndpointStatus {
            address: format!("10.0.1.{n}:8000"),
            models: models.into_iter().map(String::from).collect(),
            metrics: has_metrics.then_some(EndpointMetrics {
                queue: q,
                running: r,
                kv_usage: kv,
                ..Default::default()
            }),
            scraped_ms: NOW - age,
            failures,
            inflight_at_scrape: None,
            role: Default::default(),
            poll_ms: 0,
        })
}

proptest! {
    #[test]
    fn prop_scores_in_unit_interval(
        eps in prop::collection::vec(arb_endpoint(), 1..20),
        counts in prop::collection::vec(0u32..500, 20),
    ) {
        let inf = InflightCounts::from_text(
            eps.iter().zip(&counts).map(|(e, n)| format!("{}={n}", e.address)).collect::<Vec<_>>().join(";").as_bytes(),
        );
        let cands: Vec<Candidate<'_>> = eps.iter().map(|e| Candidate {
            address: &e.address, metrics: e.metrics.as_ref(), inflight: inf.get(&e.address),
            queue: e.metrics.as_ref().and_then(|m| m.queue) }).collect();
        let eligible = vec![true; cands.len()];
        for v in [queue::scores(&cands), kv::scores(&cands), inflight::scores(&cands),
                  session::scores(Some("s"), &cands, &eligible), lora::scores(Some("sql-lora"), &cands)] {
            prop_assert_eq!(v.len(), cands.len());
            for x in v {
                prop_assert!((0.0..=1.0).contains(&x), "{}", x);
            }
        }
    }

    #[test]
    fn prop_same_seed_same_decision_and_only_serving_endpoints(
        eps in prop::collection::vec(arb_endpoint(), 0..20),
        seed in any::<u64>(),
        model in prop::sample::select(vec!["llama", "qwen", "sql-lora"]),
        fail_open in prop::bool::ANY,
        session in prop::option::of("[a-z]{1,8}"),
    ) {
        let extra = if fail_open { r#","filter":{"failure_mode":"FailOpen"}"# } else { "" };
        // Addresses are unique in a real snapshot (the poller keys endpoints by address).
        let mut seen = hashbrown::HashSet::new();
        let sn = snap(eps.into_iter().filter(|e| seen.insert(e.address.clone())).collect());
        let r = PickRequest { model, session_id: session.as_deref(), ..Default::default() };
        let mut s1 = Scheduler::new(&config(extra));
        let mut s2 = Scheduler::new(&config(extra));
        let a = pick(&mut s1, &r, &sn, &Default::default(), seed);
        let b = pick(&mut s2, &r, &sn, &Default::default(), seed);
        prop_assert_eq!(&a, &b);
        let base = if model == "sql-lora" { "llama" } else { model };
        if let Ok(p) = a {
            for addr in std::iter::once(&p.primary).chain(&p.fallbacks) {
                prop_assert!(sn.endpoints.iter().any(|e| &e.address == addr && filter::serves(e, base)),
                    "{} does not serve {}", addr, base);
            }
            if !p.fail_open {
                let e = sn.endpoints.iter().find(|e| e.address == p.primary && filter::serves(e, base)).unwrap();
                prop_assert!(filter::healthy(e, NOW, 1000));
            }
            // No duplicates in the destination list.
            let mut all: Vec<&String> = std::iter::once(&p.primary).chain(&p.fallbacks).collect();
            let n = all.len();
            all.sort();
            all.dedup();
            prop_assert_eq!(all.len(), n);
        }
    }
}

/// A long chat prompt: `turns` user/assistant exchanges of ~1 KiB each, deterministic.
fn conversation(id: u32, turns: usize) -> String {
    let mut s = String::from("system\nYou are a helpful assistant.\u{1e}");
    for t in 0..turns {
        s.push_str(&format!("user\nconversation {id} question {t}: "));
        s.push_str(&"lorem ipsum dolor sit amet ".repeat(40));
        s.push_str(&format!("\u{1e}assistant\nanswer {t} for {id}\u{1e}"));
    }
    s
}

fn equal_pool(n: usize) -> Snapshot {
    snap((1..=n).map(|i| ep(&format!("10.0.0.{i}:8000"), &["llama"], 2.0, 0.3)).collect())
}

#[test]
fn conversation_follows_its_prefix_across_workers() {
    // Two workers (two Scheduler instances, two RNG streams) share one store, as Envoy workers
    // share proxy-wasm shared data. Turn 1 lands on worker A; turn 2 on worker B, which has an
    // empty local index. The pool is equally loaded, so only the prefix can decide.
    let store = MemStore::new();
    let sn = equal_pool(8);
    let inf = InflightCounts::default();
    let mut a = Scheduler::new(&config(""));
    let mut b = Scheduler::new(&config(""));
    let mut followed = 0;
    for conv in 0..20 {
        let t1 = conversation(conv, 2);
        let t2 = conversation(conv, 4);
        let r1 = PickRequest { model: "llama", prompt: &t1, ..Default::default() };
        let p1 = a.pick_model(&r1, &sn, &inf, &store, &mut SplitMix64::new(u64::from(conv)), NOW).unwrap();
        assert_eq!(p1.prefix_score, 0.0);
        let r2 = PickRequest { model: "llama", prompt: &t2, ..Default::default() };
        let p2 =
            b.pick_model(&r2, &sn, &inf, &store, &mut SplitMix64::new(1000 + u64::from(conv)), NOW).unwrap();
        if p2.primary == p1.primary {
            followed += 1;
            // t1 has 2312 bytes = 9 blocks of 256 (checkpoints 4, 8); t2 has 4588 bytes
            // = 17 blocks (checkpoints up to 16): worker B sees checkpoint 8 → 8/17.
            assert!((p2.prefix_score - 8.0 / 17.0).abs() < 1e-9, "{}", p2.prefix_score);
        }
    }
    assert_eq!(followed, 20);
}

#[test]
fn without_the_shared_table_other_workers_lose_the_prefix() {
    // The same scenario with shared_shards 0: worker B routes turn 2 by load alone (ties broken
    // at random over 8 endpoints), so most conversations move. This is what the table fixes.
    let store = MemStore::new();
    let sn = equal_pool(8);
    let inf = InflightCounts::default();
    let cfg = config(r#","scheduler":{"prefix":{"shared_shards":0}}"#);
    let (mut a, mut b) = (Scheduler::new(&cfg), Scheduler::new(&cfg));
    let mut followed = 0;
    for conv in 0..20 {
        let (t1, t2) = (conversation(conv, 2), conversation(conv, 4));
        let p1 = a
            .pick_model(
                &PickRequest { model: "llama", prompt: &t1, ..Default::default() },
                &sn,
                &inf,
                &store,
                &mut SplitMix64::new(u64::from(conv)),
                NOW,
            )
            .unwrap();
        let p2 = b
            .pick_model(
                &PickRequest { model: "llama", prompt: &t2, ..Default::default() },
                &sn,
                &inf,
                &store,
                &mut SplitMix64::new(1000 + u64::from(conv)),
                NOW,
            )
            .unwrap();
        followed += usize::from(p1.primary == p2.primary);
        // The same worker still follows (local index, exact).
        let p3 = a
            .pick_model(
                &PickRequest { model: "llama", prompt: &t2, ..Default::default() },
                &sn,
                &inf,
                &store,
                &mut SplitMix64::new(7),
                NOW,
            )
            .unwrap();
        assert_eq!(p3.primary, p1.primary);
    }
    assert!(followed < 10, "{followed}");
    assert_eq!(store.key_count(), 0);
}

#[test]
fn hot_spot_guard_moves_affinity_off_an_overloaded_endpoint() {
    let store = MemStore::new();
    let mut s = Scheduler::new(&config(""));
    let t1 = conversation(1, 2);
    let t2 = conversation(1, 3);
    let sn = equal_pool(4);
    let p1 = s
        .pick_model(
            &PickRequest { model: "llama", prompt: &t1, ..Default::default() },
            &sn,
            &Default::default(),
            &store,
            &mut SplitMix64::new(1),
            NOW,
        )
        .unwrap();
    // At 30 in flight the holder is busier but not overloaded (gap 28 <= 64): affinity wins.
    // t1 is 2312 bytes = 9 full blocks of 256, t2 3450 bytes = 13 blocks, sharing the first 9.
    // Holder: prefix (local, exact) 9/13 = 0.692×3 + queue 1×2 + kv 0.7×2 +
    // inflight (1/31)×1 ≈ 5.51; others: 0 + 2 + 1.4 + 1 = 4.4.
    let inf = InflightCounts::from_text(format!("{}=30", p1.primary).as_bytes());
    let r2 = PickRequest { model: "llama", prompt: &t2, ..Default::default() };
    let mut s2 = s.clone();
    let store2 = MemStore::new();
    let p3 = s2.pick_model(&r2, &sn, &inf, &store2, &mut SplitMix64::new(1), NOW).unwrap();
    assert_eq!(p3.primary, p1.primary);
    assert!((p3.prefix_score - 9.0 / 13.0).abs() < 1e-9, "{}", p3.prefix_score);
    // At 100 in flight (load 100 vs 2 elsewhere: gap 98 > 64 and 100 > 1.5×2) it is
    // overloaded: its prefix score is forced to 0 and the request goes elsewhere.
    let inf = InflightCounts::from_text(format!("{}=100", p1.primary).as_bytes());
    let p2 = s.pick_model(&r2, &sn, &inf, &store, &mut SplitMix64::new(1), NOW).unwrap();
    assert_ne!(p2.primary, p1.primary);
    assert_eq!((p2.overloaded, p2.prefix_score), (1, 0.0));
}

#[test]
fn cache_salt_and_model_separate_prefixes() {
    let store = MemStore::new();
    let mut s = Scheduler::new(&config(""));
    let sn = equal_pool(4);
    let t = conversation(5, 3);
    let r = PickRequest { model: "llama", prompt: &t, cache_salt: Some("tenant-a"), ..Default::default() };
    s.pick_model(&r, &sn, &Default::default(), &store, &mut SplitMix64::new(1), NOW).unwrap();
    let again = s.pick_model(&r, &sn, &Default::default(), &store, &mut SplitMix64::new(2), NOW).unwrap();
    assert_eq!(again.prefix_score, 1.0);
    let other = PickRequest { cache_salt: Some("tenant-b"), ..r };
    assert_eq!(
        s.pick_model(&other, &sn, &Default::default(), &store, &mut SplitMix64::new(3), NOW)
            .unwrap()
            .prefix_score,
        0.0
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]
    #[test]
    fn prop_shared_keys_stay_bounded(
        reqs in prop::collection::vec((0u32..50, 1usize..6, 0u64..4, prop::option::of("[ab]")), 1..120),
        shards in 1usize..8,
    ) {
        let store = MemStore::new();
        let cfg = config(&format!(r#","scheduler":{{"prefix":{{"shared_shards":{shards},"shared_entries_per_shard":8}}}}"#));
        let mut workers: Vec<Scheduler> = (0..4).map(|_| Scheduler::new(&cfg)).collect();
        let sn = equal_pool(6);
        for (i, (conv, turns, w, salt)) in reqs.into_iter().enumerate() {
            let t = conversation(conv, turns);
            let r = PickRequest { model: "llama", prompt: &t, cache_salt: salt.as_deref(), ..Default::default() };
            let Some(s) = workers.get_mut(w as usize) else { continue };
            s.pick_model(&r, &sn, &Default::default(), &store, &mut SplitMix64::new(i as u64), NOW).unwrap();
        }
        prop_assert!(store.key_count() <= shards);
        for k in store.keys() {
            prop_assert!(k.starts_with(prefix_shared::KEY_PREFIX));
            prop_assert!(store.get(&k).unwrap().unwrap().0.len() <= 2 + 8 * prefix_shared::RECORD_BYTES);
        }
    }
}

#[test]
fn example_config_parses_and_routes() {
    let cfg = Config::from_json(include_bytes!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/filter-config/examples/scheduler.json"
    )))
    .unwrap();
    assert_eq!(cfg.scheduler.top_k, 2);
    let mut s = Scheduler::new(&cfg);
    assert_eq!((s.session_header(), s.token_header()), ("x-session-id", "x-session-token"));
    let llama = "meta-llama/Llama-3.1-8B-Instruct";
    let qwen = "Qwen/Qwen2.5-7B-Instruct";
    let sn = snap(vec![
        ep("10.0.0.11:8000", &[llama], 0.0, 0.1),
        ep("10.0.0.12:8000", &[llama], 1.0, 0.2),
        ep("10.0.0.13:8000", &[llama, qwen], 2.0, 0.3),
        ep("10.0.0.21:8000", &[qwen], 0.0, 0.0),
    ]);
    // An alias is rewritten to the full name and served by the llama endpoints only.
    let p = pick(&mut s, &req("llama-3.1-8b"), &sn, &Default::default(), 1).unwrap();
    assert_eq!((p.target_model.as_str(), p.model_rewritten), (llama, true));
    assert_ne!(p.primary, "10.0.0.21:8000");
    // The adapter split: 90/10 between the two versions, both on llama endpoints.
    let mut v2 = 0;
    for seed in 0..200 {
        let p = pick(&mut s, &req("sql-lora"), &sn, &Default::default(), seed).unwrap();
        assert!(p.target_model == "sql-lora" || p.target_model == "sql-lora-v2");
        assert_eq!(p.model_rewritten, p.target_model == "sql-lora-v2");
        v2 += usize::from(p.target_model == "sql-lora-v2");
    }
    // Expected 10 % of 200 = 20; seeded, so stable.
    assert!((5..=40).contains(&v2), "{v2}");
    // Qwen is served by .13 and .21 only.
    let p = pick(&mut s, &req(qwen), &sn, &Default::default(), 1).unwrap();
    assert!(p.primary == "10.0.0.13:8000" || p.primary == "10.0.0.21:8000");
    assert_eq!(pick(&mut s, &req("gpt-4o"), &sn, &Default::default(), 1).unwrap_err().status, 404);
}

#[test]
fn adapter_request_prefers_endpoint_running_it() {
    let mut s = Scheduler::new(&config(""));
    let with = |addr: &str, running: &[&str]| {
        let mut e = ep(addr, &["llama"], 0.0, 0.2);
        if let Some(m) = e.metrics.as_mut() {
            m.max_lora = Some(1);
            m.running_adapters = running.iter().map(|s| s.to_string()).collect();
        }
        e
    };
    // a runs sql-lora (1.0), b's only slot holds another adapter (0.0), c has a free slot (0.8).
    let sn = snap(vec![with("b:1", &["other"]), with("a:1", &["sql-lora"]), with("c:1", &[])]);
    let p = pick(&mut s, &req("sql-lora"), &sn, &Default::default(), 1).unwrap();
    assert_eq!(p.primary, "a:1");
    assert_eq!(p.fallbacks, vec!["c:1", "b:1"]);
    // The base model ignores adapters: all three tie, so the seeded draw decides.
    let primaries: hashbrown::HashSet<String> = (0..30)
        .map(|seed| pick(&mut s, &req("llama"), &sn, &Default::default(), seed).unwrap().primary)
        .collect();
    assert_eq!(primaries.len(), 3);
}

#[test]
fn a_missing_signal_never_wins() {
    // b reports no queue and no KV: it must not beat a, which reports both as idle-ish.
    let mut s = Scheduler::new(&config(""));
    let mut b = ep("b:1", &["llama"], 0.0, 0.0);
    b.metrics = Some(EndpointMetrics::default());
    let sn = snap(vec![ep("a:1", &["llama"], 3.0, 0.4), b]);
    // a: q 1.0 (only known) ×2 + kv 0.6 ×2 + 1 = 4.2; b: q min(0.5, 1.0) ×2 + kv min(0.5, 0.6) ×2 + 1 = 3.0
    for seed in 0..10 {
        assert_eq!(pick(&mut s, &req("llama"), &sn, &Default::default(), seed).unwrap().primary, "a:1");
    }
}

#[test]
fn debug_scores_are_bounded_and_best_first() {
    let mut s = Scheduler::new(&config(r#","scheduler":{"debug_scores":true}"#));
    // Queues 0..40: endpoint i has queue i, so the best is 10.0.0.1 (queue 0).
    let sn = snap((0..40).map(|i| ep(&format!("10.0.1.{i}:8000"), &["llama"], f64::from(i), 0.5)).collect());
    let p = pick(&mut s, &req("llama"), &sn, &Default::default(), 1).unwrap();
    let d = p.debug_scores.unwrap();
    assert_eq!(d.split(", ").count(), DEBUG_MAX_ENDPOINTS);
    assert!(d.starts_with("10.0.1.0:8000 t="), "{d}");
    assert!(d.is_ascii() && !d.contains('\n'));
}

/// Passive health: a black hole with idle metrics (b) is the best pick until it fails; one
/// failure counts as a request in flight, and once ejected it is no candidate at all, not even
/// as a fallback.
#[test]
fn failures_are_load_and_ejected_endpoints_are_never_picked() {
    use crate::state::health::{Outcome, Recorder};
    let cfg = config("");
    let mut s = Scheduler::new(&cfg);
    let sn = snap(vec![ep("a:1", &["llama"], 0.0, 0.2), ep("b:1", &["llama"], 0.0, 0.0)]);
    let store = MemStore::new();
    let mut rec = Recorder::new();
    let inf = InflightCounts::default();
    let pick_with = |s: &mut Scheduler, rec: &mut Recorder, seed| {
        let view = rec.read(&store, NOW).unwrap();
        let route = s.route_model("llama", None, &sn, &mut SplitMix64::new(seed)).unwrap();
        let state = PickState { snapshot: &sn, inflight: &inf, health: &view, store: &store, now_ms: NOW };
        let rng = &mut SplitMix64::new(seed);
        s.pick(PickInput { route: &route, request: req("llama"), state, scope: PickScope::default(), rng })
            .unwrap()
    };
    // b: kv 0 → 1.0 beats a's 0.8, everything else equal.
    assert_eq!(pick_with(&mut s, &mut rec, 1).primary, "b:1");
    // One 500 from b: phantom load 1, so b's in-flight score drops below a's; with the default
    // weights (in-flight 2, KV 0.5) that costs b more than its KV edge (0.5 × 0.2) gains.
    rec.record(&store, &cfg.health, "b:1", Outcome::Failure { gateway: false }, NOW).unwrap();
    assert_eq!(pick_with(&mut s, &mut rec, 1).primary, "a:1");
    // Two more 500s make three in a row (health.consecutive_5xx): b is ejected.
    for _ in 0..2 {
        rec.record(&store, &cfg.health, "b:1", Outcome::Failure { gateway: false }, NOW).unwrap();
    }
    for seed in 0..20 {
        let p = pick_with(&mut s, &mut rec, seed);
        assert_eq!((p.primary.as_str(), p.fallbacks.len()), ("a:1", 0), "seed {seed}");
    }
}

/// The black hole of issue #10 without any retry (an ORIGINAL_DST setup, where the client sees
/// each failure): 60 sequential requests, 150 ms apart, on three idle pods, one of which fails
/// every request at once. It costs at most `consecutive_5xx` (3) failed requests, and none
/// after its ejection.
#[test]
fn a_black_hole_costs_at_most_three_requests_of_sixty() {
    use crate::state::health::{Outcome, Recorder};
    let cfg = config("");
    for seed in 0..20 {
        let mut s = Scheduler::new(&cfg);
        let sn = snap(vec![
            ep("a:1", &["llama"], 0.0, 0.1),
            ep("b:1", &["llama"], 0.0, 0.1),
            ep("hole:1", &["llama"], 0.0, 0.1),
        ]);
        let store = MemStore::new();
        let mut rec = Recorder::new();
        let mut rng = SplitMix64::new(seed);
        let (mut failed, mut ejected_at) = (0, None);
        for i in 0..60u64 {
            // The snapshot stays fresh: the fake clock moves 150 ms per request from NOW - 100.
            let now = NOW + i * 150;
            let mut sn = sn.clone();
            for e in &mut sn.endpoints {
                e.scraped_ms = now - 50;
            }
            let view = rec.read(&store, now).unwrap();
            let route = s.route_model("llama", None, &sn, &mut rng).unwrap();
            let inf = InflightCounts::default();
            let state =
                PickState { snapshot: &sn, inflight: &inf, health: &view, store: &store, now_ms: now };
            let input = PickInput {
                route: &route,
                request: req("llama"),
                state,
                scope: PickScope::default(),
                rng: &mut rng,
            };
            let p = s.pick(input).unwrap();
            let outcome = if p.primary == "hole:1" {
                failed += 1;
                assert!(ejected_at.is_none(), "seed {seed}: picked after its ejection");
                Outcome::Failure { gateway: false }
            } else {
                Outcome::Success
            };
            if rec.record(&store, &cfg.health, &p.primary, outcome, now).unwrap().is_some() {
                ejected_at = Some(i);
            }
        }
        assert!(failed <= 3, "seed {seed}: {failed} failed");
        assert!(ejected_at.is_some(), "seed {seed}: never ejected ({failed} failures)");
    }
}

#[test]
fn live_queue_switch_makes_the_queue_scorer_see_what_was_sent_since_the_scrape() {
    // Only the queue scorer counts: a scraped queue 0 with 3 of ours sent since, vs a scraped
    // queue 1 with nothing sent since (in-flight equal, so the in-flight scorer is neutral).
    let only_queue =
        r#","scheduler":{"weights":{"prefix":0,"queue":1,"kv_cache":0,"inflight":0,"session":0,"lora":0}"#;
    let mut a = ep("a:1", &["llama"], 0.0, 0.0);
    a.inflight_at_scrape = Some(0);
    let mut b = ep("b:1", &["llama"], 1.0, 0.0);
    b.inflight_at_scrape = Some(3);
    let sn = snap(vec![a, b]);
    let inf = InflightCounts::from_text(b"a:1=3;b:1=3");
    // Default (off): the scraped queues decide, a wins.
    let mut off = Scheduler::new(&config(&format!("{only_queue}}}")));
    assert_eq!(pick(&mut off, &req("llama"), &sn, &inf, 1).unwrap().primary, "a:1");
    // On: a's live queue is 0 + (3 − 0) = 3, b's 1 + (3 − 3) = 1: b wins.
    let mut on = Scheduler::new(&config(&format!(r#"{only_queue},"live_queue":true}}"#)));
    assert_eq!(pick(&mut on, &req("llama"), &sn, &inf, 1).unwrap().primary, "b:1");
}

// ---- Objective `predicted_ttft` (the default) ----

/// A long prompt of `kib` KiB, unique to `id` from its first byte.
pub(crate) fn fresh_prompt(id: u32, kib: usize) -> String {
    let mut s = format!("user\nrequest {id}: ");
    while s.len() < kib * 1024 {
        s.push_str(&format!("{id} lorem ipsum dolor sit amet "));
    }
    s
}

#[test]
fn predicted_ttft_goes_where_the_queue_ahead_is_shortest() {
    // No prefix anywhere, equal KV usage; b has the shortest queue, a the longest (the live
    // estimate, no in-flight at scrape), so b's predicted TTFT is lowest and a's highest (last
    // fallback).
    let mut s = Scheduler::new(&config_ttft(r#","scheduler":{"debug_scores":true}"#));
    let sn = snap(vec![
        ep("a:1", &["llama"], 9.0, 0.4),
        ep("b:1", &["llama"], 0.0, 0.4),
        ep("c:1", &["llama"], 3.0, 0.4),
    ]);
    let prompt = fresh_prompt(1, 8);
    let r = PickRequest { model: "llama", prompt: &prompt, ..Default::default() };
    let p = s
        .pick_model(&r, &sn, &InflightCounts::default(), &MemStore::new(), &mut SplitMix64::new(1), NOW)
        .unwrap();
    assert_eq!(p.primary, "b:1");
    assert_eq!(p.fallbacks, vec!["c:1".to_string(), "a:1".to_string()]);
    assert!(p.predicted_ms.is_some_and(|ms| ms > 0.0));
    assert!(p.ticket != 0);
    assert!(p.debug_scores.unwrap().contains("ttft="));
}

/// The primary of a fresh 8 KiB prompt on `a:1` (queue 0, KV usage `kv_a`) and `b:1` (queue
/// `queue_b`, KV 0.1), with `predicted` settings `extra`.
fn fresh_pick_kv(kv_a: Option<f64>, queue_b: f64, extra: &str) -> String {
    let cfg = config_ttft(&format!(r#","scheduler":{{"predicted":{{"affinity_slack":0{extra}}}}}"#));
    let mut s = Scheduler::new(&cfg);
    let mut a = ep("a:1", &["llama"], 0.0, 0.0);
    if let Some(m) = a.metrics.as_mut() {
        m.kv_usage = kv_a;
    }
    let sn = snap(vec![a, ep("b:1", &["llama"], queue_b, 0.1)]);
    let prompt = fresh_prompt(5, 8);
    let r = PickRequest { model: "llama", prompt: &prompt, ..Default::default() };
    s.pick_model(&r, &sn, &InflightCounts::default(), &MemStore::new(), &mut SplitMix64::new(3), NOW)
        .unwrap()
        .primary
}

#[test]
fn a_pod_whose_kv_cache_is_nearly_full_loses_to_a_short_queue_elsewhere() {
    // a: idle queue, KV 95 % (factor 5 at the default kv_full_at 0.8); b: one request queued,
    // KV 10 % (factor 1.11). Each prediction: a 2,304 tokens × 5; b 4,608 × 1.11 → b.
    assert_eq!(fresh_pick_kv(Some(0.95), 1.0, ""), "b:1");
    // Off: the empty queue wins.
    assert_eq!(fresh_pick_kv(Some(0.95), 1.0, r#","kv_full_at":0"#), "a:1");
    // Nothing cached anywhere, so no hit is at stake: the factor is not capped at kv_full_at,
    // and a full cache loses even to five queued requests (factor 100 against 6 × 1.11).
    assert_eq!(fresh_pick_kv(Some(1.0), 5.0, ""), "b:1");
    // An ordinary usage does not outweigh a queue: KV 30 % (factor 1.43) against one request.
    assert_eq!(fresh_pick_kv(Some(0.3), 1.0, ""), "a:1");
}

#[test]
fn a_pod_without_kv_usage_never_looks_emptier_than_one_that_reports_it() {
    // Both idle. Missing on a: the KV scorer's neutral fill (usage max(0.5, highest known) =
    // 0.5, factor 2), so b at 10 % wins (2,304 × 2 against 2,304 × 1.11); had the missing
    // usage counted as 0, a would win, as it does when it reports 0.
    assert_eq!(fresh_pick_kv(None, 0.0, ""), "b:1");
    assert_eq!(fresh_pick_kv(Some(0.0), 0.0, ""), "a:1");
}

/// The primary of a fresh 8 KiB prompt (`id`) on four idle, equal pods, with a given
/// `affinity_slack`, `poller.replicas` and model, and the tie-break seed `seed`.
fn idle_pick(id: u32, slack: f64, replicas: u32, model: &str, seed: u64) -> String {
    idle_pick_with(id, slack, replicas, model, seed, "")
}

/// [`idle_pick`] with more top-level configuration sections (`extra`, starting with a comma).
fn idle_pick_with(id: u32, slack: f64, replicas: u32, model: &str, seed: u64, extra: &str) -> String {
    let cfg = config_ttft(&format!(
        r#","poller":{{"replicas":{replicas}}},"scheduler":{{"predicted":{{"affinity_slack":{slack}}}}}{extra}"#
    ));
    let mut s = Scheduler::new(&cfg);
    let sn = snap((1..=4).map(|i| ep(&format!("10.0.0.{i}:8000"), &["llama"], 0.0, 0.2)).collect());
    let prompt = fresh_prompt(id, 8);
    let r = PickRequest { model, prompt: &prompt, ..Default::default() };
    s.pick_model(&r, &sn, &InflightCounts::default(), &MemStore::new(), &mut SplitMix64::new(seed), NOW)
        .unwrap()
        .primary
}

#[test]
fn with_several_replicas_a_prefix_nobody_told_apart_goes_to_its_rendezvous_winner() {
    for id in 0..12 {
        // The rendezvous winner: the primary among equal pods with the default slack.
        let winner = idle_pick(id, 0.2, 1, "llama", 1);
        // Without slack, one gateway breaks the tie at random: no credit with one replica.
        let one: std::collections::HashSet<String> =
            (0..24).map(|seed| idle_pick(id, 0.0, 1, "llama", seed)).collect();
        assert!(one.len() > 1, "prompt {id}: one replica spreads its ties");
        // Four replicas: the credit makes the winner strictly cheapest, whatever the seed.
        for seed in 0..8 {
            assert_eq!(idle_pick(id, 0.0, 4, "llama", seed), winner, "prompt {id} seed {seed}");
        }
        // An adapter request gets no credit: ties spread again.
        let adapter: std::collections::HashSet<String> =
            (0..24).map(|seed| idle_pick(id, 0.0, 4, "sql-lora", seed)).collect();
        assert!(adapter.len() > 1, "prompt {id}: adapter requests are not credited");
        // Replicas that exchange placements (`peers`) know where the others sent a prefix, so
        // none is credited: ties spread again.
        let peers = r#","peers":{"addresses":["10.1.0.2:8080"],"token":"0123456789abcdef"}"#;
        let exchanged: std::collections::HashSet<String> =
            (0..24).map(|seed| idle_pick_with(id, 0.0, 4, "llama", seed, peers)).collect();
        assert!(exchanged.len() > 1, "prompt {id}: with peers there is no credit");
    }
}

#[test]
fn a_burst_from_one_worker_spreads_before_any_scrape_sees_it() {
    // Eight idle pods, one snapshot for the whole burst: each pick's prefill is pending in the
    // ledger, so eight unrelated 8 KiB prompts go to eight different pods, not to the pod that
    // looked best at the scrape.
    let mut s = Scheduler::new(&config_ttft(""));
    let sn = snap((1..=8).map(|i| ep(&format!("10.0.0.{i}:8000"), &["llama"], 0.0, 0.1)).collect());
    let store = MemStore::new();
    let mut seen = std::collections::HashSet::new();
    for id in 0..8 {
        let prompt = fresh_prompt(id, 8);
        let r = PickRequest { model: "llama", prompt: &prompt, ..Default::default() };
        let p =
            s.pick_model(&r, &sn, &InflightCounts::default(), &store, &mut SplitMix64::new(7), NOW).unwrap();
        seen.insert(p.primary);
    }
    assert_eq!(seen.len(), 8);
    assert_eq!(s.pending_requests(), 8);
}

/// The primary of a fresh 8 KiB prompt on `a:1` (KV 10 %) and `b:1` (KV 30 %), both with an
/// empty scraped queue, on a worker whose own ledger is empty, given the in-flight record.
fn pick_with_peers(inflight: &[u8]) -> String {
    let mut s = Scheduler::new(&config_ttft(r#","scheduler":{"predicted":{"affinity_slack":0}}"#));
    let sn = snap(vec![ep("a:1", &["llama"], 0.0, 0.1), ep("b:1", &["llama"], 0.0, 0.3)]);
    let prompt = fresh_prompt(9, 8);
    let r = PickRequest { model: "llama", prompt: &prompt, ..Default::default() };
    let inf = InflightCounts::from_text(inflight);
    s.pick_model(&r, &sn, &inf, &MemStore::new(), &mut SplitMix64::new(1), NOW).unwrap().primary
}

#[test]
fn the_prefill_other_workers_queued_counts_as_work_ahead() {
    // Other workers of this Envoy published one 20,000-token prefill pending on a and two
    // short ones (2,000 tokens together) on b. Ahead of this prompt (2,048 + 256 tokens): a
    // 20,256 × 1.11 (KV factor) against b 2,512 × 1.43 → b.
    assert_eq!(pick_with_peers(b"a:1=1/1/20000;b:1=2/2/2000"), "b:1");
    // The same counts without their prefill part (an older release's record): nothing queued
    // shows, and the emptier KV cache wins.
    assert_eq!(pick_with_peers(b"a:1=1;b:1=2"), "a:1");
}

/// One predicted-TTFT pick of a fresh prompt (`id`) on two idle pods: the scheduler, its store
/// and the pick, for the ledger tests.
fn one_ttft_pick(id: u32) -> (Scheduler, MemStore, Pick) {
    let mut s = Scheduler::new(&config_ttft(""));
    let sn = snap(vec![ep("a:1", &["llama"], 0.0, 0.1), ep("b:1", &["llama"], 0.0, 0.1)]);
    let store = MemStore::new();
    let prompt = fresh_prompt(id, 16);
    let r = PickRequest { model: "llama", prompt: &prompt, ..Default::default() };
    let p = s.pick_model(&r, &sn, &InflightCounts::default(), &store, &mut SplitMix64::new(1), NOW).unwrap();
    (s, store, p)
}

#[test]
fn prefill_ledger_releases_on_first_byte_and_end() {
    let (mut s, store, p1) = one_ttft_pick(3);
    // The first byte after 400 ms teaches the store a rate for that pod.
    s.first_byte(p1.ticket, Some(&p1.primary), &store, NOW + 400).unwrap();
    let key = crate::state::rates::shard_key(endpoint_key(&p1.primary));
    assert!(store.get(&key).unwrap().is_some(), "an observation was recorded");
    assert_eq!(s.pending_requests(), 1, "active until the end");
    s.request_done(p1.ticket);
    assert_eq!(s.pending_requests(), 0);
    // Ticket 0 and unknown tickets are ignored.
    s.first_byte(0, None, &store, NOW).unwrap();
    s.request_done(12345);
}

#[test]
fn a_split_requests_first_byte_ends_its_prefill_but_teaches_no_rate() {
    let (mut s, store, p) = one_ttft_pick(4);
    assert!(s.ledger.pending(&p.primary).1 == 1, "pending prefill before the first byte");
    s.first_byte_unobserved(p.ticket);
    assert_eq!(s.ledger.pending(&p.primary), (0.0, 0), "its prefill no longer counts as work ahead");
    let key = crate::state::rates::shard_key(endpoint_key(&p.primary));
    assert!(store.get(&key).unwrap().is_none(), "no observation recorded");
    // A later first byte of the same ticket teaches nothing either (already past prefill).
    s.first_byte(p.ticket, Some(&p.primary), &store, NOW + 400).unwrap();
    assert!(store.get(&key).unwrap().is_none());
    s.request_done(p.ticket);
    assert_eq!(s.pending_requests(), 0);
    s.first_byte_unobserved(0);
}

#[test]
fn a_pod_learnt_slow_gets_less_traffic() {
    // Two idle pods; the store has learnt that a:1 takes 4× longer per token than b:1 (beyond
    // the noise band). Fresh prompts of every key then go to b:1 unless a:1 is much emptier.
    let store = MemStore::new();
    for _ in 0..400 {
        crate::state::rates::observe(&store, endpoint_key("a:1"), 10_000.0, 1_200, 0.03).unwrap();
        crate::state::rates::observe(&store, endpoint_key("b:1"), 10_000.0, 300, 0.03).unwrap();
    }
    let sn = snap(vec![ep("a:1", &["llama"], 0.0, 0.1), ep("b:1", &["llama"], 0.0, 0.1)]);
    let mut on_b = 0;
    for id in 0..20 {
        let mut s = Scheduler::new(&config_ttft(""));
        let prompt = fresh_prompt(id, 8);
        let r = PickRequest { model: "llama", prompt: &prompt, ..Default::default() };
        let p = s
            .pick_model(&r, &sn, &InflightCounts::default(), &store, &mut SplitMix64::new(u64::from(id)), NOW)
            .unwrap();
        on_b += usize::from(p.primary == "b:1");
    }
    assert_eq!(on_b, 20);
}

#[test]
fn independent_replicas_send_a_new_prefix_to_the_same_pod() {
    // Four gateway replicas: four Schedulers with four stores (nothing shared). Each sees the
    // same equally loaded pool. A conversation's turn 1 and turn 2 arrive at different replicas;
    // the rendezvous on the leading blocks sends both to the same pod.
    let sn = equal_pool(8);
    let inf = InflightCounts::default();
    let mut met = 0;
    let mut pods = std::collections::HashSet::new();
    for conv in 0..20u32 {
        let t1 = conversation(conv, 9);
        let t2 = conversation(conv, 12);
        let mut r1 = Scheduler::new(&config_ttft(""));
        let mut r2 = Scheduler::new(&config_ttft(""));
        let p1 = r1
            .pick_model(
                &PickRequest { model: "llama", prompt: &t1, ..Default::default() },
                &sn,
                &inf,
                &MemStore::new(),
                &mut SplitMix64::new(u64::from(conv)),
                NOW,
            )
            .unwrap();
        let p2 = r2
            .pick_model(
                &PickRequest { model: "llama", prompt: &t2, ..Default::default() },
                &sn,
                &inf,
                &MemStore::new(),
                &mut SplitMix64::new(99 + u64::from(conv)),
                NOW,
            )
            .unwrap();
        met += usize::from(p1.primary == p2.primary);
        pods.insert(p1.primary);
    }
    assert_eq!(met, 20);
    assert!(pods.len() >= 5, "conversations spread over the pool: {pods:?}");
    // The control: with the rendezvous off, replicas agree only by chance.
    let mut met_off = 0;
    for conv in 0..20u32 {
        let t1 = conversation(conv, 9);
        let t2 = conversation(conv, 12);
        let cfg = config_ttft(r#","scheduler":{"predicted":{"affinity_slack":0}}"#);
        let (mut r1, mut r2) = (Scheduler::new(&cfg), Scheduler::new(&cfg));
        let p1 = r1
            .pick_model(
                &PickRequest { model: "llama", prompt: &t1, ..Default::default() },
                &sn,
                &inf,
                &MemStore::new(),
                &mut SplitMix64::new(u64::from(conv)),
                NOW,
            )
            .unwrap();
        let p2 = r2
            .pick_model(
                &PickRequest { model: "llama", prompt: &t2, ..Default::default() },
                &sn,
                &inf,
                &MemStore::new(),
                &mut SplitMix64::new(99 + u64::from(conv)),
                NOW,
            )
            .unwrap();
        met_off += usize::from(p1.primary == p2.primary);
    }
    assert!(met_off < 12, "{met_off}");
}

#[test]
fn predicted_conversation_follows_its_prefix_across_workers() {
    // The default objective keeps the cross-worker affinity: turn 2 on another worker finds
    // turn 1's pod through the shared table, even when that pod is a little busier.
    let store = MemStore::new();
    let inf = InflightCounts::default();
    let cfg = config_ttft(r#","scheduler":{"predicted":{"affinity_slack":0}}"#);
    let mut a = Scheduler::new(&cfg);
    let mut b = Scheduler::new(&cfg);
    let mut followed = 0;
    for conv in 0..20 {
        let sn = equal_pool(8);
        let t1 = conversation(conv, 12);
        let t2 = conversation(conv, 14);
        let r1 = PickRequest { model: "llama", prompt: &t1, ..Default::default() };
        let p1 = a.pick_model(&r1, &sn, &inf, &store, &mut SplitMix64::new(u64::from(conv)), NOW).unwrap();
        a.request_done(p1.ticket);
        let r2 = PickRequest { model: "llama", prompt: &t2, ..Default::default() };
        let p2 =
            b.pick_model(&r2, &sn, &inf, &store, &mut SplitMix64::new(1000 + u64::from(conv)), NOW).unwrap();
        b.request_done(p2.ticket);
        followed += usize::from(p2.primary == p1.primary);
    }
    assert_eq!(followed, 20);
}

#[test]
fn predicted_adapter_request_prefers_the_pod_running_it_unless_it_is_far_busier() {
    let with = |addr: &str, running: &[&str], queue: f64| {
        let mut e = ep(addr, &["llama"], queue, 0.2);
        if let Some(m) = e.metrics.as_mut() {
            m.max_lora = Some(1);
            m.running_adapters = running.iter().map(|s| s.to_string()).collect();
        }
        e
    };
    let prompt = fresh_prompt(5, 4);
    let r = PickRequest { model: "sql-lora", prompt: &prompt, ..Default::default() };
    let run = |sn: &Snapshot| {
        let mut s = Scheduler::new(&config_ttft(""));
        s.pick_model(&r, sn, &InflightCounts::default(), &MemStore::new(), &mut SplitMix64::new(1), NOW)
            .unwrap()
    };
    // a runs sql-lora (×1), c has a free slot (×1.25), b's only slot holds another adapter (×10).
    let p = run(&snap(vec![
        with("b:1", &["other"], 0.0),
        with("a:1", &["sql-lora"], 0.0),
        with("c:1", &[], 0.0),
    ]));
    assert_eq!(p.primary, "a:1");
    assert_eq!(p.fallbacks, vec!["c:1", "b:1"]);
    // a has 5 requests waiting: the free slot on idle c is the faster start.
    let p = run(&snap(vec![
        with("b:1", &["other"], 0.0),
        with("a:1", &["sql-lora"], 5.0),
        with("c:1", &[], 0.0),
    ]));
    assert_eq!(p.primary, "c:1");
}

/// The second pick of a conversation: turn 1 of a 16 KiB prompt goes to `a:1` (the only pod
/// then), then turn 2 (1 KiB longer; with `fresh`, a prompt nobody holds) is picked with `a:1`
/// and `b:1` at the `(queue, kv)` given, under `cfg`, with the rates already in `store`.
pub(crate) struct TurnTwo {
    pub a: (f64, f64),
    pub b: (f64, f64),
    pub fresh: bool,
    pub slo: Option<SloAsk>,
}

pub(crate) fn turn_two(cfg: &Config, store: &MemStore, t: TurnTwo) -> Result<Pick, Rejection> {
    let mut s = Scheduler::new(cfg);
    let inf = InflightCounts::default();
    let t1 = fresh_prompt(7, 16);
    let mut t2 = t1.clone();
    t2.push_str(&"and one more question ".repeat(48));
    let only_a =
        Snapshot { version: 1, published_ms: NOW - 50, endpoints: vec![ep("a:1", &["llama"], 0.0, 0.3)] };
    let r1 = PickRequest { model: "llama", prompt: &t1, ..Default::default() };
    let p1 = s.pick_model(&r1, &only_a, &inf, store, &mut SplitMix64::new(1), NOW).unwrap();
    assert_eq!(p1.primary, "a:1");
    s.request_done(p1.ticket);
    let both = Snapshot {
        version: 2,
        published_ms: NOW - 50,
        endpoints: vec![ep("a:1", &["llama"], t.a.0, t.a.1), ep("b:1", &["llama"], t.b.0, t.b.1)],
    };
    let other = fresh_prompt(8, 17);
    let prompt = if t.fresh { &other } else { &t2 };
    let r2 = PickRequest { model: "llama", prompt, slo: t.slo, ..Default::default() };
    s.pick_model(&r2, &both, &inf, store, &mut SplitMix64::new(2), NOW)
}

/// [`turn_two`] with `queue_on_a` requests queued on `a:1` and none on `b:1`, both at KV 0.3.
fn turn_two_with_a_busier_cached_pod(queue_on_a: f64, extra: &str) -> Pick {
    let cfg = config_ttft(&format!(r#","scheduler":{{"predicted":{{"affinity_slack":0{extra}}}}}"#));
    let t = TurnTwo { a: (queue_on_a, 0.3), b: (0.0, 0.3), fresh: false, slo: None };
    turn_two(&cfg, &MemStore::new(), t).unwrap()
}

#[test]
fn the_miss_penalty_keeps_a_prefix_on_its_pod_when_the_saving_is_only_a_short_queue() {
    // By predicted TTFT alone the idle pod wins (one queued request on `a` weighs more than
    // prefilling 16 KiB on `b`); the default miss penalty charges `b` the 4k tokens it lacks,
    // scaled by the pool's mean queue, and the conversation stays on its cache.
    let alone = turn_two_with_a_busier_cached_pod(1.0, r#","miss_weight":0"#);
    assert_eq!(alone.primary, "b:1");
    let default = turn_two_with_a_busier_cached_pod(1.0, "");
    assert_eq!(default.primary, "a:1");
    assert_eq!(default.fallbacks, vec!["b:1".to_string()]);
    // The reported prediction is still the TTFT, not the ranking cost: `a`'s is above `b`'s.
    let (ms_a, ms_b) = (default.predicted_ms.unwrap(), alone.predicted_ms.unwrap());
    assert!(ms_a > ms_b, "{ms_a} {ms_b}");
}

/// [`turn_two`] (or, with `fresh`, a prompt nobody holds) with both pods idle, `a:1` (which
/// holds turn 1) at KV usage `kv_a` and `b:1` at `kv_b`.
fn turn_two_on_full_caches(kv_a: f64, kv_b: f64, fresh: bool) -> String {
    let cfg = config_ttft(r#","scheduler":{"predicted":{"affinity_slack":0}}"#);
    let t = TurnTwo { a: (0.0, kv_a), b: (0.0, kv_b), fresh, slo: None };
    turn_two(&cfg, &MemStore::new(), t).unwrap().primary
}

#[test]
fn past_kv_full_at_the_cache_hit_decides_but_with_no_hit_at_stake_the_freer_cache_does() {
    // Both past kv_full_at 0.8: with turn 1 cached on `a`, both count as full and the hit keeps
    // the conversation on `a` even at 97 % against 85 %.
    assert_eq!(turn_two_on_full_caches(0.97, 0.85, false), "a:1");
    // A prompt neither pod holds: nothing to trade, the uncapped factor sends it to the freer
    // cache (factor 33 against 6.7).
    assert_eq!(turn_two_on_full_caches(0.97, 0.85, true), "b:1");
    // Below kv_full_at, the same usages rank alike in both cases: the freer cache.
    assert_eq!(turn_two_on_full_caches(0.2, 0.1, true), "b:1");
}

/// The primary of a fresh prompt (no hit at stake) on `a:1` and `b:1`, each `(queue, kv)`.
fn fresh_pick_queues_kv(a: (f64, f64), b: (f64, f64)) -> String {
    let mut s = Scheduler::new(&config_ttft(r#","scheduler":{"predicted":{"affinity_slack":0}}"#));
    let sn = snap(vec![ep("a:1", &["llama"], a.0, a.1), ep("b:1", &["llama"], b.0, b.1)]);
    let prompt = fresh_prompt(9, 8);
    let r = PickRequest { model: "llama", prompt: &prompt, ..Default::default() };
    s.pick_model(&r, &sn, &InflightCounts::default(), &MemStore::new(), &mut SplitMix64::new(4), NOW)
        .unwrap()
        .primary
}

#[test]
fn with_no_hit_at_stake_only_a_pod_with_no_queue_has_its_kv_factor_uncapped() {
    // Both pods queue: both count as full past kv_full_at (factor 5), so the shorter queue wins
    // however full its cache (97 % against 85 %).
    assert_eq!(fresh_pick_queues_kv((1.0, 0.97), (2.0, 0.85)), "a:1");
    // `a` has no queue: its factor runs to 0.99 (33 at 97 %), and the pod with room wins even
    // with a request queued (factor 5 there).
    assert_eq!(fresh_pick_queues_kv((0.0, 0.97), (1.0, 0.85)), "b:1");
    // Below kv_full_at nothing changes: the empty queue wins.
    assert_eq!(fresh_pick_queues_kv((0.0, 0.5), (1.0, 0.1)), "a:1");
}

#[test]
fn a_much_busier_cached_pod_still_loses_to_an_idle_one_with_the_penalty() {
    // The penalty is bounded: with eight requests queued on the cached pod the idle one wins.
    assert_eq!(turn_two_with_a_busier_cached_pod(8.0, "").primary, "b:1");
}
