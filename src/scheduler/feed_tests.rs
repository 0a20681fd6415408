//! The placement feed at the scheduler (`crate::state::feed`): what another worker's pick
//! teaches this worker's prefix index.

use super::tests::{config_ttft, ep, fresh_prompt};
use super::*;
use crate::base::ports::{MemStore, SplitMix64};
use crate::state::inflight::InflightCounts;

const NOW: u64 = 1_000_000;

fn pool(eps: Vec<EndpointStatus>, version: u64) -> Snapshot {
    Snapshot { version, published_ms: NOW - 50, endpoints: eps }
}

/// Worker `w1` sends two prompts of one group (a 16 KiB shared prefix), the first to `a:1`,
/// the second to `b:1` (each pool narrowed to that pod), so the cross-worker table names `b:1`
/// last. Worker `w2`, which sent neither, then routes a third with `b:1` one request busier:
/// where does it go, with or without `w1`'s placements replayed into its index?
fn third_of_a_group(feed: bool) -> String {
    let cfg = config_ttft(r#","scheduler":{"predicted":{"affinity_slack":0}}"#);
    let store = MemStore::new();
    let inf = InflightCounts::default();
    let (mut w1, mut w2) = (Scheduler::new(&cfg), Scheduler::new(&cfg));
    let group = fresh_prompt(7, 16);
    let prompt = |q: &str| format!("{group}\nquestion: {}", q.repeat(40));
    let mut placements = Vec::new();
    for (i, (addr, q)) in [("a:1", "first "), ("b:1", "second ")].into_iter().enumerate() {
        w1.set_feed(true);
        let p = prompt(q);
        let r = PickRequest { model: "llama", prompt: &p, ..Default::default() };
        let only = pool(vec![ep(addr, &["llama"], 0.0, 0.3)], i as u64 + 1);
        let pick = w1.pick_model(&r, &only, &inf, &store, &mut SplitMix64::new(1), NOW).unwrap();
        assert_eq!(pick.primary, addr);
        w1.request_done(pick.ticket);
        placements.extend(w1.take_placement());
        assert!(w1.take_placement().is_none(), "a placement is taken once");
    }
    assert_eq!(placements.len(), 2);
    assert_eq!(placements[0].address, "a:1");
    if feed {
        for p in &placements {
            w2.observe(p);
        }
    }
    let p = prompt("third ");
    let r = PickRequest { model: "llama", prompt: &p, ..Default::default() };
    let both = pool(vec![ep("a:1", &["llama"], 0.0, 0.3), ep("b:1", &["llama"], 1.0, 0.3)], 3);
    w2.pick_model(&r, &both, &inf, &store, &mut SplitMix64::new(2), NOW).unwrap().primary
}

#[test]
fn another_workers_placements_make_every_holder_of_a_prefix_known() {
    // Without the feed, the shared table names only the last holder: the idle pod that also
    // holds the group looks like a miss, and the request queues behind the other.
    assert_eq!(third_of_a_group(false), "b:1");
    // With both placements replayed, both pods hold the group: the idle one wins.
    assert_eq!(third_of_a_group(true), "a:1");
}

#[test]
fn without_the_feed_switched_on_a_pick_keeps_no_placement() {
    let cfg = config_ttft("");
    let mut s = Scheduler::new(&cfg);
    let p = fresh_prompt(3, 4);
    let r = PickRequest { model: "llama", prompt: &p, ..Default::default() };
    let one = pool(vec![ep("a:1", &["llama"], 0.0, 0.3)], 1);
    let inf = InflightCounts::default();
    let store = MemStore::new();
    s.pick_model(&r, &one, &inf, &store, &mut SplitMix64::new(1), NOW).unwrap();
    assert!(s.take_placement().is_none());
    s.set_feed(true);
    s.pick_model(&r, &one, &inf, &store, &mut SplitMix64::new(1), NOW).unwrap();
    let kept = s.take_placement().expect("kept with the feed on");
    assert_eq!(kept.address, "a:1");
    assert!(!kept.hashes.is_empty() && kept.cap > 0);
    // A prompt shorter than one block records no prefix: nothing to tell.
    let short = PickRequest { model: "llama", prompt: "hi", ..Default::default() };
    s.set_feed(true);
    s.pick_model(&short, &one, &inf, &store, &mut SplitMix64::new(1), NOW).unwrap();
    assert!(s.take_placement().is_none());
}
