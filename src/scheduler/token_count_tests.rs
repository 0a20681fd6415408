//! The pick of a request that is not a generation ([`Scheduler::pick_least_loaded`], Anthropic's
//! token count): the least-loaded healthy pod serving the model, and no trace of the request in
//! the scheduler's state or the shared store.

use super::tests::{config, config_ttft, ep, fresh_prompt};
use super::*;
use crate::base::ports::{MemStore, SplitMix64};
use crate::state::health::{Outcome, Recorder};

const NOW: u64 = 1_000_000;

fn snap(eps: Vec<EndpointStatus>) -> Snapshot {
    Snapshot { version: 1, published_ms: NOW - 50, endpoints: eps }
}

fn at<'a>(
    sn: &'a Snapshot,
    inflight: &'a InflightCounts,
    health: &'a HealthView,
    store: &'a MemStore,
) -> PickState<'a> {
    PickState { snapshot: sn, inflight, health, store, now_ms: NOW }
}

/// [`Scheduler::pick_least_loaded`] of `model` with `prompt`, the default scope.
fn count(
    s: &Scheduler,
    model: &str,
    prompt: &str,
    state: PickState<'_>,
    seed: u64,
) -> Result<Pick, Rejection> {
    let rng = &mut SplitMix64::new(seed);
    let route = s.route_model(model, None, state.snapshot, rng)?;
    let request = PickRequest { model, prompt, ..Default::default() };
    s.pick_least_loaded(PickInput { route: &route, request, state, scope: PickScope::default(), rng })
}

#[test]
fn the_fewest_in_flight_among_the_healthy_serving_pods_with_fallbacks_by_count() {
    let s = Scheduler::new(&config_ttft(""));
    let mut stale = ep("stale:1", &["llama"], 0.0, 0.0);
    stale.scraped_ms = 0;
    // The queue and KV use are not read: only what this gateway has in flight there.
    let sn = snap(vec![
        ep("a:1", &["llama"], 0.0, 0.0),
        ep("b:1", &["llama"], 50.0, 0.99),
        ep("c:1", &["llama"], 0.0, 0.0),
        ep("q:1", &["qwen"], 0.0, 0.0),
        stale,
    ]);
    let inf = InflightCounts::from_text(b"a:1=3;b:1=1;c:1=2;q:1=0;stale:1=0");
    let (health, store) = (HealthView::default(), MemStore::new());
    let p = count(&s, "llama", "", at(&sn, &inf, &health, &store), 1).unwrap();
    assert_eq!((p.primary.as_str(), p.reason, p.fail_open), ("b:1", PickReason::TokenCount, false));
    assert_eq!(p.fallbacks, ["c:1", "a:1"]);
    assert_eq!((p.serving, p.healthy, p.ticket, p.predicted_ms, p.prefix_blocks), (4, 3, 0, None, 0));
    // An adapter goes to its base model's pods; an unknown model is the 404 of every path; a
    // model no pod serves the 503.
    assert_eq!(count(&s, "sql-lora", "", at(&sn, &inf, &health, &store), 1).unwrap().primary, "b:1");
    let e = count(&s, "gpt-4", "", at(&sn, &inf, &health, &store), 1).unwrap_err();
    assert_eq!((e.status, e.code), (404, "model_not_found"));
    let only_qwen = snap(vec![ep("q:1", &["qwen"], 0.0, 0.0)]);
    let e = count(&s, "llama", "", at(&only_qwen, &inf, &health, &store), 1).unwrap_err();
    assert_eq!((e.status, e.code), (503, "no_endpoint"));
}

#[test]
fn equal_counts_spread_over_the_pods() {
    let s = Scheduler::new(&config_ttft(""));
    let sn = snap((1..=4).map(|i| ep(&format!("10.0.0.{i}:8000"), &["llama"], 0.0, 0.1)).collect());
    let (inf, health, store) = (InflightCounts::default(), HealthView::default(), MemStore::new());
    let chosen: hashbrown::HashSet<String> = (0..40)
        .map(|seed| count(&s, "llama", "", at(&sn, &inf, &health, &store), seed).unwrap().primary)
        .collect();
    assert_eq!(chosen.len(), 4, "{chosen:?}");
}

#[test]
fn ejected_pods_are_left_out_and_none_healthy_fails_as_the_failure_mode_says() {
    let cfg = config("");
    let s = Scheduler::new(&cfg);
    let sn = snap(vec![ep("a:1", &["llama"], 0.0, 0.0), ep("b:1", &["llama"], 0.0, 0.0)]);
    let store = MemStore::new();
    let mut rec = Recorder::new();
    // Three 500s in a row from b: ejected. Idle as it is, it is never chosen.
    for _ in 0..3 {
        rec.record(&store, &cfg.health, "b:1", Outcome::Failure { gateway: false }, NOW).unwrap();
    }
    let view = rec.read(&store, NOW).unwrap();
    let inf = InflightCounts::from_text(b"a:1=5");
    for seed in 0..20 {
        let p = count(&s, "llama", "", at(&sn, &inf, &view, &store), seed).unwrap();
        assert_eq!((p.primary.as_str(), p.fallbacks.len()), ("a:1", 0), "seed {seed}");
    }
    // No pod with fresh metrics: 503 by default, the least-loaded serving pod with FailOpen.
    let mut down = ep("a:1", &["llama"], 0.0, 0.0);
    down.failures = 1;
    let sn = snap(vec![down]);
    let (inf, health) = (InflightCounts::default(), HealthView::default());
    let e = count(&s, "llama", "", at(&sn, &inf, &health, &store), 1).unwrap_err();
    assert_eq!((e.status, e.code), (503, "no_healthy_endpoint"));
    let open = Scheduler::new(&config(r#","filter":{"failure_mode":"FailOpen"}"#));
    let p = count(&open, "llama", "", at(&sn, &inf, &health, &store), 1).unwrap();
    assert_eq!((p.primary.as_str(), p.reason, p.fail_open), ("a:1", PickReason::FailOpen, true));
}

#[test]
fn a_token_count_leaves_nothing_behind_where_a_generation_records_its_prefix() {
    let cfg = config_ttft("");
    let mut s = Scheduler::new(&cfg);
    s.set_feed(true);
    let sn = snap(vec![ep("a:1", &["llama"], 0.0, 0.1), ep("b:1", &["llama"], 0.0, 0.1)]);
    let (inf, health, store) = (InflightCounts::default(), HealthView::default(), MemStore::new());
    let prompt = fresh_prompt(11, 8);
    let p = count(&s, "llama", &prompt, at(&sn, &inf, &health, &store), 1).unwrap();
    assert_eq!(p.ticket, 0);
    // No prefill in the ledger, no placement for the feed, nothing in the shared store.
    assert_eq!(s.pending_requests(), 0);
    assert_eq!(s.ledger_prefill(&p.primary), (0.0, 0));
    assert!(s.take_placement().is_none());
    assert_eq!(store.key_count(), 0, "{:?}", store.keys());
    // The generation that follows finds no pod holding its prompt...
    let r = PickRequest { model: "llama", prompt: &prompt, ..Default::default() };
    let first = s.pick_model(&r, &sn, &inf, &store, &mut SplitMix64::new(2), NOW).unwrap();
    assert_eq!(first.prefix_score, 0.0);
    // ...and records it, which the next one sees (what the assertions above would have seen).
    assert!(first.ticket != 0 && s.pending_requests() == 1);
    assert!(s.take_placement().is_some());
    assert!(store.key_count() > 0);
    let second = s.pick_model(&r, &sn, &inf, &store, &mut SplitMix64::new(3), NOW).unwrap();
    assert!(second.prefix_score > 0.0);
}
