//! The scheduler with TTFT targets (`slo`): whole picks through `Scheduler::pick_model`.

use super::tests::{config_ttft, ep, fresh_prompt, snap, turn_two, TurnTwo};
use super::*;
use crate::base::ports::{MemStore, SplitMix64};
use crate::state::inflight::InflightCounts;
use crate::state::prefix_shared::endpoint_key;
use crate::state::rates;

const NOW: u64 = 1_000_000;

fn ask(budget_ms: f64, sheddable: bool) -> SloAsk {
    SloAsk { budget_ms, tightest_budget_ms: None, sheddable, retry_after_s: 3 }
}

/// Both pods' rates learnt (one first byte each at the prior's rate).
fn learnt(store: &MemStore, addrs: &[&str]) {
    for a in addrs {
        rates::observe(store, endpoint_key(a), 4096.0, 123, 0.03).unwrap();
    }
}

/// [`turn_two`]'s conversation with `a:1` at queue `queue_a` and `b:1` idle, both at KV 0.3;
/// `known` pods have learnt rates. Returns the pick (debug scores on).
fn turn_two_with(slo: Option<SloAsk>, queue_a: f64, known: &[&str]) -> Result<Pick, Rejection> {
    let cfg = config_ttft(r#","scheduler":{"debug_scores":true,"predicted":{"affinity_slack":0}}"#);
    let store = MemStore::new();
    learnt(&store, known);
    turn_two(&cfg, &store, TurnTwo { a: (queue_a, 0.3), b: (0.0, 0.3), fresh: false, slo })
}

// With `a:1` at queue 1 the predictions are a 146.6 ms (it holds turn one) and b 138.7 ms
// (idle, but all of the prompt to prefill); the ranking (miss penalty) prefers a.
const BOTH: &[&str] = &["a:1", "b:1"];

#[test]
fn among_pods_that_meet_the_target_locality_wins_not_the_fastest() {
    let p = turn_two_with(None, 1.0, BOTH).unwrap();
    assert_eq!((p.primary.as_str(), p.slo), ("a:1", None));
    // Budget 150: both meet it; the cached pod keeps the conversation although b is faster.
    let p = turn_two_with(Some(ask(150.0, false)), 1.0, BOTH).unwrap();
    assert_eq!((p.primary.as_str(), p.slo), ("a:1", Some(SloVerdict::Meets)));
}

#[test]
fn a_tight_target_avoids_the_pod_predicted_to_miss_it() {
    let p = turn_two_with(Some(ask(142.0, false)), 1.0, BOTH).unwrap();
    assert_eq!((p.primary.as_str(), p.slo), ("b:1", Some(SloVerdict::Meets)));
    assert!(p.predicted_ms.is_some_and(|ms| ms <= 142.0));
    // The pod that misses stays a fallback.
    assert_eq!(p.fallbacks, vec!["a:1".to_string()]);
}

#[test]
fn when_no_pod_can_meet_it_a_sheddable_request_is_refused_and_others_get_the_best_predicted() {
    let r = turn_two_with(Some(ask(100.0, true)), 1.0, BOTH).unwrap_err();
    assert_eq!((r.status, r.code, r.retry_after_s), (429, "slo_unattainable", Some(3)));
    let p = turn_two_with(Some(ask(100.0, false)), 1.0, BOTH).unwrap();
    assert_eq!((p.primary.as_str(), p.slo), ("b:1", Some(SloVerdict::Misses)));
}

#[test]
fn with_a_pod_whose_rate_is_not_learnt_nothing_is_shed_and_the_pick_is_as_without_a_target() {
    let p = turn_two_with(Some(ask(100.0, true)), 1.0, &["a:1"]).unwrap();
    assert_eq!((p.primary.as_str(), p.slo), ("a:1", Some(SloVerdict::Unknown)));
    // No rate learnt anywhere (a cold pool): the same.
    let p = turn_two_with(Some(ask(100.0, true)), 1.0, &[]).unwrap();
    assert_eq!((p.primary.as_str(), p.slo), ("a:1", Some(SloVerdict::Unknown)));
}

#[test]
fn a_loose_target_leaves_the_pod_a_tighter_target_needs() {
    // This request's budget is 1,000 ms; the tightest configured is 142, which only b meets.
    // Both meet this one, and a holds the prompt: a, leaving b for the tight requests.
    let loose = SloAsk { tightest_budget_ms: Some(142.0), ..ask(1000.0, false) };
    let p = turn_two_with(Some(loose), 1.0, BOTH).unwrap();
    assert_eq!(p.primary, "a:1");
}

#[test]
fn the_objective_weighted_has_no_prediction_and_routes_as_without_a_target() {
    let mut s = Scheduler::new(&config_ttft(r#","scheduler":{"objective":"weighted"}"#));
    let store = MemStore::new();
    learnt(&store, BOTH);
    let sn = snap(vec![ep("a:1", &["llama"], 0.0, 0.3), ep("b:1", &["llama"], 5.0, 0.3)]);
    let pr = fresh_prompt(9, 4);
    let r = PickRequest { model: "llama", prompt: &pr, slo: Some(ask(1.0, true)), ..Default::default() };
    let p = s.pick_model(&r, &sn, &InflightCounts::default(), &store, &mut SplitMix64::new(3), NOW).unwrap();
    assert_eq!((p.primary.as_str(), p.slo), ("a:1", Some(SloVerdict::Unknown)));
}
