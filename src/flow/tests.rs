//! Tests of `flow`.

use super::ledger::*;
use super::queue::*;
use super::*;
use crate::base::ports::MemStore;
use crate::base::ports::{SharedStore, StoreError};

fn cfg() -> FlowControlConfig {
    FlowControlConfig { enabled: true, max_wait_ms: 1000, max_queue: 100, ..FlowControlConfig::default() }
}
const SAT: Capacity = Capacity { epoch: 1, slots: 0, saturated: true, reserve: None };
fn room(epoch: u64, slots: u32) -> Capacity {
    Capacity { epoch, slots, saturated: false, reserve: None }
}
fn t(id: u32, priority: i32, flow: &str) -> Ticket<'_> {
    Ticket { id, priority, fairness_id: flow, deadline_ms: None }
}
fn held(a: &Admission) -> bool {
    matches!(a, Admission::Held { evicted: None })
}
fn released(actions: &[Action]) -> Vec<u32> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Release { id, .. } => Some(*id),
            Action::Reject { .. } => None,
        })
        .collect()
}
fn record(store: &MemStore, group: &str) -> Record {
    Record::decode(&store.get(&shared_key(group)).unwrap().unwrap().0)
}

#[test]
fn passes_without_shared_writes_when_nobody_waits() {
    let s = MemStore::new();
    let mut q = FlowQueue::new(&cfg(), "m", 1);
    assert_eq!(q.admit(&s, &t(1, 0, "a"), &room(1, 5), 0), Admission::Pass);
    // A sheddable request also passes while there is room.
    assert_eq!(q.admit(&s, &t(2, -10, "a"), &room(1, 5), 0), Admission::Pass);
    assert_eq!(s.key_count(), 0, "the fast path must not write shared data");
    assert!(!q.needs_tick());
    assert!(q.on_tick(&s, &room(1, 5), 10).is_empty());
    assert_eq!(s.key_count(), 0);
}

#[test]
fn sheddable_rejected_at_once_while_saturated() {
    let s = MemStore::new();
    let mut q = FlowQueue::new(&cfg(), "m", 1);
    let Admission::Reject(r) = q.admit(&s, &t(1, -1, "a"), &SAT, 0) else { panic!("not rejected") };
    assert_eq!((r.status, r.code, r.retry_after_s), (429, "request_shed", Some(1)));
    let body: serde_json::Value = serde_json::from_slice(&r.body()).unwrap();
    assert_eq!(body["error"]["code"], "request_shed");
    // Priority 0 is not sheddable: it is held.
    assert!(held(&q.admit(&s, &t(2, 0, "a"), &SAT, 0)));
    let st = q.take_stats();
    assert_eq!(st.by_priority[&-1].shed, 1);
    assert_eq!(st.by_priority[&0].held, 1);
}

#[test]
fn releases_in_strict_priority_order() {
    let s = MemStore::new();
    let mut q = FlowQueue::new(&cfg(), "m", 1);
    // (No negative priority: a sheddable request is never held.)
    for (id, p) in [(1, 10), (2, 20), (3, 5), (4, 15), (5, 20), (6, 10)] {
        assert!(held(&q.admit(&s, &t(id, p, "a"), &SAT, 0)), "id {id}");
    }
    // Epoch 2 brings 3 tokens: the two 20s (in arrival order) then the 15.
    let a = q.on_tick(&s, &room(2, 3), 10);
    assert_eq!(released(&a), vec![2, 5, 4]);
    // Same epoch again: no tokens left, nothing more.
    assert!(q.on_tick(&s, &room(2, 3), 20).is_empty());
    // Epoch 3 with plenty: the 10s in order, then the 5.
    let a = q.on_tick(&s, &room(3, 10), 30);
    assert_eq!(released(&a), vec![1, 6, 3]);
    assert!(q.is_empty());
    // The worker withdrew its summary.
    assert!(record(&s, "m").workers.is_empty());
    assert!(!q.needs_tick());
}

#[test]
fn round_robin_across_tenants_within_a_priority() {
    let s = MemStore::new();
    let mut q = FlowQueue::new(&cfg(), "m", 1);
    // Tenant a sends 3, then b 1, then c 2, all priority 0; plus one priority 1 from c last.
    for (id, flow) in [(1, "a"), (2, "a"), (3, "a"), (4, "b"), (5, "c"), (6, "c")] {
        assert!(held(&q.admit(&s, &t(id, 0, flow), &SAT, 0)));
    }
    assert!(held(&q.admit(&s, &t(7, 1, "c"), &SAT, 0)));
    // Priority 1 first (7), then one per tenant per round in first-arrival order of the
    // tenants: a1 b4 c5, then a2 c6, then a3.
    let a = q.on_tick(&s, &room(2, 100), 10);
    assert_eq!(released(&a), vec![7, 1, 4, 5, 2, 6, 3]);
}

#[test]
fn round_robin_continues_across_ticks() {
    let s = MemStore::new();
    let mut q = FlowQueue::new(&cfg(), "m", 1);
    for (id, flow) in [(1, "a"), (2, "a"), (3, "b"), (4, "b")] {
        assert!(held(&q.admit(&s, &t(id, 0, flow), &SAT, 0)));
    }
    // One token per epoch: a, b, a, b; a heavy tenant does not get two in a row.
    let mut order = Vec::new();
    for epoch in 2..6 {
        order.extend(released(&q.on_tick(&s, &room(epoch, 1), epoch * 10)));
    }
    assert_eq!(order, vec![1, 3, 2, 4]);
}

#[test]
fn timeouts_reject_with_503_after_max_wait() {
    let s = MemStore::new();
    let mut q = FlowQueue::new(&cfg(), "m", 1);
    assert!(held(&q.admit(&s, &t(1, 0, "a"), &SAT, 0)));
    assert!(held(&q.admit(&s, &t(2, 5, "a"), &SAT, 500)));
    // 999 ms: nobody has waited 1000 ms yet.
    assert!(q.on_tick(&s, &SAT, 999).is_empty());
    // 1000 ms: id 1 (held at 0) times out; priority does not protect from the deadline.
    let a = q.on_tick(&s, &SAT, 1000);
    assert_eq!(a.len(), 1);
    let Action::Reject { id, priority, waited_ms, rejection } = &a[0] else { panic!("{a:?}") };
    assert_eq!((*id, *priority, *waited_ms), (1, 0, 1000));
    assert_eq!((rejection.status, rejection.code, rejection.retry_after_s), (503, "queue_timeout", Some(1)));
    // id 2 held at 500 times out at 1500.
    assert!(q.on_tick(&s, &SAT, 1499).is_empty());
    let a = q.on_tick(&s, &SAT, 1500);
    assert!(matches!(a.as_slice(), [Action::Reject { id: 2, waited_ms: 1000, .. }]));
    let st = q.take_stats();
    assert_eq!(st.by_priority[&0].timed_out, 1);
    assert_eq!(st.by_priority[&5].timed_out, 1);
    assert_eq!(st.by_priority[&5].queued_ms, 1000);
    assert!(record(&s, "m").workers.is_empty());
}

#[test]
fn queue_limit_rejects_with_429_or_evicts_lower_priority() {
    let s = MemStore::new();
    let mut q = FlowQueue::new(&FlowControlConfig { max_queue: 2, ..cfg() }, "m", 1);
    assert!(held(&q.admit(&s, &t(1, 0, "a"), &SAT, 0)));
    assert!(held(&q.admit(&s, &t(2, 0, "a"), &SAT, 1)));
    // Full, and nothing held is below 0: 429.
    let Admission::Reject(r) = q.admit(&s, &t(3, 0, "a"), &SAT, 2) else { panic!() };
    assert_eq!((r.status, r.code, r.retry_after_s), (429, "queue_full", Some(1)));
    // A priority-5 request pushes out the newest priority-0 one (id 2, held at 1 ms).
    let Admission::Held { evicted: Some((2, r)) } = q.admit(&s, &t(4, 5, "a"), &SAT, 3) else { panic!() };
    assert_eq!(r.code, "queue_full");
    assert_eq!(q.len(), 2);
    let a = q.on_tick(&s, &room(2, 10), 4);
    assert_eq!(released(&a), vec![4, 1]);
    let st = q.take_stats();
    assert_eq!(st.by_priority[&0].queue_full, 2); // id 3 refused, id 2 evicted
    assert_eq!(st.by_priority[&0].queued_ms, 2 + 4); // id 2: 1→3, id 1: 0→4
}

#[test]
fn a_finish_credits_one_token_up_to_the_live_headroom() {
    const NOW: u64 = 1_000;
    let store = MemStore::new();
    let mut q = FlowQueue::new(&cfg(), "m", 1);
    // Nobody waits: no write, no key created.
    assert_eq!(credit_finish(&store, "m", &room(1, 3), 2000, NOW), Ok(false));
    assert_eq!(store.key_count(), 0);
    // Hold two requests while saturated (epoch 1, no tokens).
    assert!(held(&q.admit(&store, &t(1, 0, "a"), &SAT, NOW)));
    assert!(held(&q.admit(&store, &t(2, 0, "a"), &SAT, NOW)));
    assert!(released(&q.on_tick(&store, &SAT, NOW + 10)).is_empty());
    // A finish while the group is still saturated (live estimate still full): nothing.
    assert_eq!(credit_finish(&store, "m", &SAT, 2000, NOW + 20), Ok(false));
    // A finish frees one slot in the same epoch: one token, and the next tick releases one.
    let live = Capacity { epoch: 1, slots: 1, saturated: false, reserve: None };
    assert_eq!(credit_finish(&store, "m", &live, 2000, NOW + 30), Ok(true));
    assert_eq!(record(&store, "m").left, 1);
    // A second credit with still one slot of headroom does not exceed it.
    assert_eq!(credit_finish(&store, "m", &live, 2000, NOW + 31), Ok(false));
    assert_eq!(record(&store, "m").left, 1);
    assert_eq!(released(&q.on_tick(&store, &live, NOW + 40)), vec![1]);
    // Nothing left; the next finish gives the last held request its token.
    assert!(released(&q.on_tick(&store, &live, NOW + 50)).is_empty());
    assert_eq!(credit_finish(&store, "m", &live, 2000, NOW + 60), Ok(true));
    assert_eq!(released(&q.on_tick(&store, &live, NOW + 70)), vec![2]);
}

#[test]
fn cancel_frees_the_place() {
    let s = MemStore::new();
    let mut q = FlowQueue::new(&FlowControlConfig { max_queue: 1, ..cfg() }, "m", 1);
    assert!(held(&q.admit(&s, &t(1, 0, "a"), &SAT, 0)));
    assert!(matches!(q.admit(&s, &t(2, 0, "a"), &SAT, 0), Admission::Reject(_)));
    assert!(q.cancel(1, 40));
    assert!(!q.cancel(1, 40), "a second cancel is a no-op");
    // The next tick withdraws the summary; the timeout of id 1 never fires.
    assert!(q.on_tick(&s, &SAT, 50).is_empty());
    assert!(record(&s, "m").workers.is_empty());
    assert!(held(&q.admit(&s, &t(2, 0, "a"), &SAT, 60)));
    assert!(q.on_tick(&s, &SAT, 1000).is_empty(), "id 1 must not time out");
    let st = q.take_stats();
    assert_eq!((st.by_priority[&0].cancelled, st.by_priority[&0].queued_ms), (1, 40));
    // Cancelling a released request is harmless.
    let a = q.on_tick(&s, &room(2, 1), 1001);
    assert_eq!(released(&a), vec![2]);
    assert!(!q.cancel(2, 1002));
}

#[test]
fn arrivals_queue_behind_waiters_of_equal_or_higher_priority() {
    let s = MemStore::new();
    let mut q = FlowQueue::new(&cfg(), "m", 1);
    assert!(held(&q.admit(&s, &t(1, 5, "a"), &SAT, 0)));
    // Room now, but a priority-5 request waits: a priority-5 arrival waits behind it.
    assert!(held(&q.admit(&s, &t(2, 5, "a"), &room(2, 3), 1)));
    // A priority-9 arrival jumps ahead and takes a token (3 → 2) instead of waiting.
    assert_eq!(q.admit(&s, &t(3, 9, "a"), &room(2, 3), 2), Admission::Pass);
    assert_eq!(record(&s, "m").left, 2);
    let a = q.on_tick(&s, &room(2, 3), 3);
    assert_eq!(released(&a), vec![1, 2]);
    assert_eq!(record(&s, "m").left, 0);
    // Out of tokens in this epoch, and something waits: a high arrival is held, not passed.
    assert!(held(&q.admit(&s, &t(4, 0, "a"), &SAT, 4)));
    assert!(held(&q.admit(&s, &t(5, 9, "a"), &room(2, 3), 5)));
}

#[test]
fn a_sheddable_request_is_never_held() {
    let s = MemStore::new();
    let mut w1 = FlowQueue::new(&cfg(), "m", 1);
    let mut w2 = FlowQueue::new(&cfg(), "m", 2);
    // A standard request waits on worker 2.
    assert!(held(&w2.admit(&s, &t(1, 0, "a"), &SAT, 0)));
    // Room now, but a priority-0 request waits: a sheddable arrival on worker 1 is shed at
    // once (before: held behind it, and served later).
    let Admission::Reject(r) = w1.admit(&s, &t(2, -5, "b"), &room(2, 3), 1) else { panic!("not shed") };
    assert_eq!((r.status, r.code), (429, "request_shed"));
    assert_eq!(w1.take_stats().by_priority[&-5].shed, 1);
    assert!(w1.is_empty());
    // A non-sheddable request in the same spot is held behind it.
    assert!(held(&w1.admit(&s, &t(3, 0, "b"), &room(2, 3), 2)));
    // Once nobody waits (both released), a sheddable request with room goes on.
    assert_eq!(released(&w2.on_tick(&s, &room(3, 5), 10)), vec![1]);
    assert_eq!(released(&w1.on_tick(&s, &room(3, 5), 11)), vec![3]);
    assert_eq!(w1.admit(&s, &t(4, -5, "b"), &room(3, 5), 12), Admission::Pass);
}

#[test]
fn deadline_bookkeeping_stays_bounded() {
    let s = MemStore::new();
    let mut q = FlowQueue::new(&FlowControlConfig { max_wait_ms: 1_000_000, ..cfg() }, "m", 1);
    // One request stays held the whole time (its deadline is at the front); 1000 others are
    // held and cancelled behind it.
    assert!(held(&q.admit(&s, &t(1, 0, "a"), &SAT, 0)));
    for id in 2..1002 {
        assert!(held(&q.admit(&s, &t(id, 0, "a"), &SAT, 1)));
        assert!(q.cancel(id, 2));
    }
    // Compaction runs when more than 2 × 2 + 64 = 68 deadlines exist for 2 live entries.
    assert!(q.deadlines.len() <= 2 * 2 + 64 + 1, "{}", q.deadlines.len());
    // The survivor still times out at its own deadline.
    assert!(matches!(q.on_tick(&s, &SAT, 1_000_000).as_slice(), [Action::Reject { id: 1, .. }]));
}

#[test]
fn disabled_never_holds() {
    let s = MemStore::new();
    let mut q = FlowQueue::new(&FlowControlConfig { enabled: false, ..cfg() }, "m", 1);
    assert_eq!(q.admit(&s, &t(1, 0, "a"), &SAT, 0), Admission::Pass);
    assert!(matches!(q.admit(&s, &t(2, -1, "a"), &SAT, 0), Admission::Reject(_)));
    assert_eq!(s.key_count(), 0);
}

// ---- two workers on one store ---------------------------------------------------------

#[test]
fn low_priority_worker_waits_for_higher_priority_elsewhere() {
    let s = MemStore::new();
    let mut w1 = FlowQueue::new(&cfg(), "m", 1);
    let mut w2 = FlowQueue::new(&cfg(), "m", 2);
    assert!(held(&w1.admit(&s, &t(1, 0, "a"), &SAT, 0)));
    assert!(held(&w2.admit(&s, &t(1, 10, "a"), &SAT, 0)));
    // W1 ticks first with 5 tokens, but W2 holds a 10: W1 releases nothing.
    assert!(w1.on_tick(&s, &room(2, 5), 10).is_empty());
    assert_eq!(record(&s, "m").left, 5);
    // W2 releases its 10 (5 → 4) and withdraws its summary.
    assert_eq!(released(&w2.on_tick(&s, &room(2, 5), 11)), vec![1]);
    assert_eq!(record(&s, "m").left, 4);
    // Now W1 may go.
    assert_eq!(released(&w1.on_tick(&s, &room(2, 5), 12)), vec![1]);
    assert_eq!(record(&s, "m").left, 3);
}

#[test]
fn tokens_are_shared_not_multiplied_across_workers() {
    let s = MemStore::new();
    let mut w1 = FlowQueue::new(&cfg(), "m", 1);
    let mut w2 = FlowQueue::new(&cfg(), "m", 2);
    for id in 1..=5 {
        assert!(held(&w1.admit(&s, &t(id, 0, "a"), &SAT, 0)));
        assert!(held(&w2.admit(&s, &t(id, 0, "a"), &SAT, 0)));
    }
    // Epoch 2 has 3 slots. W1 ticks: one peer at its top priority → ceil(3/2) = 2.
    assert_eq!(w1.on_tick(&s, &room(2, 3), 10).len(), 2);
    // W2: 1 left, ceil(1/2) = 1.
    assert_eq!(w2.on_tick(&s, &room(2, 3), 11).len(), 1);
    // Both again in the same epoch: 0 left. 3 released in total, not 3 per worker.
    assert!(w1.on_tick(&s, &room(2, 3), 12).is_empty());
    assert!(w2.on_tick(&s, &room(2, 3), 13).is_empty());
    // A worker with an older snapshot (epoch 1) must not refill the ledger.
    assert!(w1.on_tick(&s, &room(1, 50), 14).is_empty());
    // Epoch 3, 4 slots: W2 ticks first this time and takes ceil(4/2) = 2. The share is of
    // what is left, so W1 takes ceil(2/2) = 1 now and the last one at its next tick.
    assert_eq!(w2.on_tick(&s, &room(3, 4), 20).len(), 2);
    assert_eq!(w1.on_tick(&s, &room(3, 4), 21).len(), 1);
    assert_eq!(w1.on_tick(&s, &room(3, 4), 22).len(), 1);
    assert_eq!(record(&s, "m").left, 0);
    // The summaries track what is left: W1 5 - 2 - 1 - 1 = 1, W2 5 - 1 - 2 = 2.
    let mut w: Vec<(u64, Vec<(i32, u32)>)> =
        record(&s, "m").workers.into_iter().map(|w| (w.id, w.q)).collect();
    w.sort();
    assert_eq!(w, vec![(1, vec![(0, 1)]), (2, vec![(0, 2)])]);
    assert_eq!(w1.global_waiting(), &[(0, 3)]);
}

#[test]
fn queue_limit_counts_every_worker() {
    let s = MemStore::new();
    let c = FlowControlConfig { max_queue: 3, ..cfg() };
    let mut w1 = FlowQueue::new(&c, "m", 1);
    let mut w2 = FlowQueue::new(&c, "m", 2);
    assert!(held(&w1.admit(&s, &t(1, 0, "a"), &SAT, 0)));
    assert!(held(&w1.admit(&s, &t(2, 0, "a"), &SAT, 0)));
    assert!(held(&w2.admit(&s, &t(1, 0, "a"), &SAT, 0)));
    // 3 held over both workers: the fourth is refused on W2, which holds nothing lower.
    assert!(matches!(w2.admit(&s, &t(2, 0, "a"), &SAT, 0), Admission::Reject(r) if r.status == 429));
    // A cancel on W1, published at W1's tick, makes room for W2.
    assert!(w1.cancel(2, 5));
    w1.on_tick(&s, &SAT, 6);
    assert!(held(&w2.admit(&s, &t(2, 0, "a"), &SAT, 7)));
    // A different group has its own queue and limit.
    let mut other = FlowQueue::new(&c, "other-model", 1);
    assert!(held(&other.admit(&s, &t(9, 0, "a"), &SAT, 8)));
    assert_eq!(s.keys(), vec![shared_key("m"), shared_key("other-model")]);
}

#[test]
fn a_silent_worker_stops_blocking_after_its_ttl() {
    let s = MemStore::new();
    let long = FlowControlConfig { max_wait_ms: 10_000, ..cfg() };
    let mut w1 = FlowQueue::new(&long, "m", 1);
    let mut w2 = FlowQueue::new(&long, "m", 2);
    assert!(held(&w2.admit(&s, &t(1, 10, "a"), &SAT, 0)));
    assert!(held(&w1.admit(&s, &t(1, 0, "a"), &SAT, 100)));
    // W2's VM is gone: it never ticks again. Until 2000 ms (worker_ttl_ms) after its last
    // write at 0 ms, it still blocks W1's lower-priority request.
    assert!(w1.on_tick(&s, &room(2, 5), 1999).is_empty());
    // At 2000 ms W2 is pruned and W1 releases.
    assert_eq!(released(&w1.on_tick(&s, &room(2, 5), 2000)), vec![1]);
    assert!(record(&s, "m").workers.is_empty(), "dead worker pruned, W1 withdrawn");
}

#[test]
fn heartbeats_keep_a_live_holder_ahead() {
    let s = MemStore::new();
    let long = FlowControlConfig { max_wait_ms: 10_000, ..cfg() };
    let mut w1 = FlowQueue::new(&long, "m", 1);
    let mut w2 = FlowQueue::new(&long, "m", 2);
    assert!(held(&w2.admit(&s, &t(1, 10, "a"), &SAT, 0)));
    assert!(held(&w1.admit(&s, &t(1, 0, "a"), &SAT, 0)));
    let hb = |s: &MemStore| record(s, "m").workers.iter().find(|w| w.id == 2).map(|w| w.hb);
    // W2 keeps ticking (saturated). Its summary does not change, so it writes only to renew
    // its heartbeat, every ttl/3 = 666 ms: not at 600, then at 700.
    assert!(w2.on_tick(&s, &SAT, 600).is_empty());
    assert_eq!(hb(&s), Some(0));
    assert!(w2.on_tick(&s, &SAT, 700).is_empty());
    assert_eq!(hb(&s), Some(700));
    for now in (800..=3000).step_by(100) {
        assert!(w2.on_tick(&s, &SAT, now).is_empty());
        assert!(w1.on_tick(&s, &SAT, now).is_empty());
    }
    // At 3000 ms W2 is alive (last write within 666 ms), so W1 still may not release.
    assert!(w1.on_tick(&s, &room(2, 5), 3000).is_empty());
    assert_eq!(released(&w2.on_tick(&s, &room(2, 5), 3001)), vec![1]);
    assert_eq!(released(&w1.on_tick(&s, &room(2, 5), 3002)), vec![1]);
}

#[test]
fn an_abandoned_epoch_yields_to_a_restarted_poller() {
    let s = MemStore::new();
    let long = FlowControlConfig { max_wait_ms: 60_000, ..cfg() };
    let mut q = FlowQueue::new(&long, "m", 1);
    assert!(held(&q.admit(&s, &t(1, 0, "a"), &SAT, 0)));
    assert!(held(&q.admit(&s, &t(2, 0, "a"), &SAT, 0)));
    assert_eq!(q.on_tick(&s, &room(50, 1), 10).len(), 1);
    // The poller restarts at version 1. Within worker_ttl_ms of the last reset (at 10 ms)
    // the old epoch stands; from 2010 ms on, the new numbering takes over.
    assert!(q.on_tick(&s, &room(1, 1), 2009).is_empty());
    assert_eq!(q.on_tick(&s, &room(1, 1), 2010).len(), 1);
    assert_eq!(record(&s, "m").epoch, 1);
}

#[test]
fn unreadable_record_is_reset_and_store_errors_release_nothing() {
    let s = MemStore::new();
    s.set(&shared_key("m"), b"not json", 0).unwrap();
    let mut q = FlowQueue::new(&cfg(), "m", 1);
    assert!(held(&q.admit(&s, &t(1, 0, "a"), &SAT, 0)));
    assert_eq!(record(&s, "m").workers.len(), 1);

    struct Broken;
    impl SharedStore for Broken {
        fn get(&self, _: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
            Err(StoreError::Host("down".into()))
        }
        fn set(&self, _: &str, _: &[u8], _: u32) -> Result<(), StoreError> {
            Err(StoreError::Host("down".into()))
        }
    }
    let mut q = FlowQueue::new(&cfg(), "m", 1);
    // Without a shared view, a request with room and nobody waiting locally passes...
    assert_eq!(q.admit(&Broken, &t(1, 0, "a"), &room(1, 5), 0), Admission::Pass);
    // ...one that must wait is held locally...
    assert!(held(&q.admit(&Broken, &t(2, 0, "a"), &SAT, 0)));
    // ...and is never released without the ledger, only timed out.
    assert!(q.on_tick(&Broken, &room(2, 5), 10).is_empty());
    assert!(matches!(q.on_tick(&Broken, &room(2, 5), 1000).as_slice(), [Action::Reject { id: 2, .. }]));
}

#[test]
fn cas_conflicts_are_retried_not_lost() {
    // A store that reports a mismatch on the first write of each key, as if another worker
    // wrote in between; the update must still land.
    struct Racy {
        inner: MemStore,
        failed: std::cell::Cell<bool>,
    }
    impl SharedStore for Racy {
        fn get(&self, k: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
            self.inner.get(k)
        }
        fn set(&self, k: &str, v: &[u8], cas: u32) -> Result<(), StoreError> {
            if !self.failed.replace(true) {
                return Err(StoreError::CasMismatch);
            }
            self.inner.set(k, v, cas)
        }
    }
    let s = Racy { inner: MemStore::new(), failed: std::cell::Cell::new(false) };
    let mut q = FlowQueue::new(&cfg(), "m", 1);
    assert!(held(&q.admit(&s, &t(1, 0, "a"), &SAT, 0)));
    let rec = Record::decode(&s.inner.get(&shared_key("m")).unwrap().unwrap().0);
    assert_eq!(
        rec.workers,
        vec![WorkerEntry { id: 1, hb: 0, q: vec![(0, 1)], t: vec![(0, fairshare::bucket("a"))] }]
    );
}

#[test]
fn two_first_writers_of_a_group_key_both_count() {
    // Worker 1 reads the group key absent; before it writes, worker 2 creates the key and
    // records its own hold. On Envoy's semantics a blind first write by worker 1 would erase
    // worker 2's entry; with create-then-CAS both holds are in the record.
    struct Interleaved<'a> {
        inner: &'a MemStore,
        other: std::cell::RefCell<Option<FlowQueue>>,
    }
    impl SharedStore for Interleaved<'_> {
        fn get(&self, k: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
            let r = self.inner.get(k);
            if let Some(mut w2) = self.other.borrow_mut().take() {
                assert!(held(&w2.admit(self.inner, &t(7, 0, "b"), &SAT, 0)));
            }
            r
        }
        fn set(&self, k: &str, v: &[u8], cas: u32) -> Result<(), StoreError> {
            self.inner.set(k, v, cas)
        }
    }
    let s = MemStore::new();
    let racing =
        Interleaved { inner: &s, other: std::cell::RefCell::new(Some(FlowQueue::new(&cfg(), "m", 2))) };
    let mut w1 = FlowQueue::new(&cfg(), "m", 1);
    assert!(held(&w1.admit(&racing, &t(1, 0, "a"), &SAT, 0)));
    let mut ids: Vec<u64> = record(&s, "m").workers.iter().map(|w| w.id).collect();
    ids.sort_unstable();
    assert_eq!(ids, vec![1, 2]);
}

#[test]
fn release_all_lets_everything_go_and_withdraws() {
    let s = MemStore::new();
    let mut w1 = FlowQueue::new(&cfg(), "m", 1);
    let mut w2 = FlowQueue::new(&cfg(), "m", 2);
    assert!(held(&w1.admit(&s, &t(1, 0, "a"), &SAT, 0)));
    assert!(held(&w1.admit(&s, &t(2, 7, "b"), &SAT, 5)));
    assert!(held(&w1.admit(&s, &t(3, 0, "b"), &SAT, 6)));
    assert!(held(&w2.admit(&s, &t(9, 0, "a"), &SAT, 0)));
    // Priority order, then round-robin: 2 (p7), then 1 (tenant a), 3 (tenant b).
    let a = w1.release_all(&s, 100);
    assert_eq!(released(&a), vec![2, 1, 3]);
    assert_eq!(a[0], Action::Release { id: 2, priority: 7, waited_ms: 95 });
    assert!(w1.is_empty() && !w1.needs_tick());
    // W1's summary is withdrawn; W2's stays.
    assert_eq!(
        record(&s, "m").workers,
        vec![WorkerEntry { id: 2, hb: 0, q: vec![(0, 1)], t: vec![(0, fairshare::bucket("a"))] }]
    );
    assert_eq!(w1.global_waiting(), &[(0, 1)]);
    // The ledger was not touched, and nothing is left to time out.
    assert_eq!(record(&s, "m").left, 0);
    assert!(w1.on_tick(&s, &SAT, 5000).is_empty());
    let st = w1.take_stats();
    assert_eq!((st.by_priority[&0].released, st.by_priority[&0].queued_ms), (2, 100 + 94));
    assert_eq!(st.by_priority[&7].released, 1);
    // Nothing held and nothing published: no write at all.
    let before = s.get(&shared_key("m")).unwrap();
    assert!(w1.release_all(&s, 200).is_empty());
    assert_eq!(s.get(&shared_key("m")).unwrap(), before);
}

#[test]
fn stats_per_priority() {
    let s = MemStore::new();
    let mut q = FlowQueue::new(&cfg(), "m", 1);
    assert_eq!(q.admit(&s, &t(1, 3, "a"), &room(1, 1), 0), Admission::Pass);
    assert!(held(&q.admit(&s, &t(2, 3, "a"), &SAT, 100)));
    assert!(held(&q.admit(&s, &t(3, 3, "a"), &SAT, 100)));
    assert_eq!(released(&q.on_tick(&s, &room(2, 1), 350)), vec![2]);
    let st = q.take_stats();
    assert_eq!(
        st.by_priority[&3],
        PriorityStats { passed: 1, held: 2, released: 1, queued_ms: 250, ..PriorityStats::default() }
    );
    // take_stats resets: the next call only has what happened since.
    assert_eq!(q.take_stats(), FlowStats::default());
    q.cancel(3, 400);
    assert_eq!(q.take_stats().by_priority[&3].cancelled, 1);
}

/// W1 holds six requests of tenant h; W2 holds two of tenant l, held later. Every finish is
/// seen on W1 (h's requests run there), which credits one token and runs its release check
/// at once; W2 runs its check at its next tick, 10 ms later. Returns the release order.
fn heavy_vs_light(w2_ticks: bool) -> Vec<(u8, u32)> {
    let s = MemStore::new();
    let c = FlowControlConfig { max_wait_ms: 60_000, ..cfg() };
    let mut w1 = FlowQueue::new(&c, "m", 1);
    let mut w2 = FlowQueue::new(&c, "m", 2);
    for id in 1..=6 {
        assert!(held(&w1.admit(&s, &t(id, 0, "h"), &SAT, 0)));
    }
    for id in 11..=12 {
        assert!(held(&w2.admit(&s, &t(id, 0, "l"), &SAT, 5)));
    }
    let mut order = Vec::new();
    for round in 1..=12u64 {
        let now = 100 * round;
        credit_finish(&s, "m", &room(1, 1), c.worker_ttl_ms, now).unwrap();
        order.extend(released(&w1.on_tick(&s, &room(1, 1), now)).into_iter().map(|id| (1, id)));
        if w2_ticks {
            order.extend(released(&w2.on_tick(&s, &room(1, 1), now + 10)).into_iter().map(|id| (2, id)));
        }
    }
    order
}

#[test]
fn a_heavy_tenant_on_one_worker_cannot_starve_a_light_one_on_another() {
    // Without the shared counts W1 would spend every token it credits itself (its share of
    // one token is one): h1..h6, then l's two. With them h may run SLACK = 1 release ahead
    // of l, then W1 leaves the token to W2.
    assert_eq!(heavy_vs_light(true), vec![(1, 1), (1, 2), (2, 11), (1, 3), (2, 12), (1, 4), (1, 5), (1, 6)]);
}

#[test]
fn fairness_waits_for_a_silent_worker_only_for_the_grace_period() {
    // W2 never ticks (slow, or its VM is gone but not yet expired). W1 releases h1 and h2,
    // is refused at 300 ms, and the refusal is waived GRACE_MS (200 ms) later: at 500 ms.
    // After each release the grace clock restarts, so h goes every third round (500, 800,
    // 1100 ms) until W2 expires (worker_ttl_ms) or ticks again.
    let order = heavy_vs_light(false);
    assert_eq!(order, vec![(1, 1), (1, 2), (1, 3), (1, 4), (1, 5)]);
    let s = MemStore::new();
    let mut w1 = FlowQueue::new(&cfg(), "m", 1);
    let mut w2 = FlowQueue::new(&cfg(), "m", 2);
    for id in 1..=3 {
        assert!(held(&w1.admit(&s, &t(id, 0, "h"), &SAT, 0)));
    }
    assert!(held(&w2.admit(&s, &t(11, 0, "l"), &SAT, 0)));
    let mut at = Vec::new();
    for now in (100..=700).step_by(50) {
        credit_finish(&s, "m", &room(1, 1), 2000, now).unwrap();
        if !released(&w1.on_tick(&s, &room(1, 1), now)).is_empty() {
            at.push(now);
        }
    }
    assert_eq!(at, vec![100, 150, 400], "h1 and h2 at once, h3 after the 200 ms grace from 200 ms");
    assert_eq!(record(&s, "m").declined_ms, 0, "the grace clock stopped when h3 went");
}

#[test]
fn fairness_counts_are_bounded_and_go_with_the_tenants() {
    let s = MemStore::new();
    let mut w1 = FlowQueue::new(&cfg(), "m", 1);
    for id in 1..=80u32 {
        let flow = format!("tenant-{id}");
        assert!(held(&w1.admit(&s, &t(id, 0, &flow), &SAT, 0)));
    }
    let rec = record(&s, "m");
    assert_eq!(rec.workers[0].t.len(), fairshare::MAX_PUBLISHED);
    assert!(rec.served.0.len() <= fairshare::MAX_PUBLISHED);
    // Everything released: no worker, no counts, no grace clock.
    let mut n = 0;
    for epoch in 2..20 {
        n += w1.on_tick(&s, &room(epoch, 10), 10 * epoch).len();
    }
    assert_eq!(n, 80);
    let rec = record(&s, "m");
    assert!(rec.workers.is_empty() && rec.served.is_empty() && rec.declined_ms == 0, "{rec:?}");
}

#[test]
fn a_reserve_keeps_headroom_for_high_priorities() {
    let s = MemStore::new();
    let mut q = FlowQueue::new(&cfg(), "m", 1);
    // Room for all (2 slots), but below priority 10 the reduced thresholds are reached.
    let low_full =
        Capacity { reserve: Some(Reserve { min_priority: 10, slots: 0, saturated: true }), ..room(1, 2) };
    assert!(held(&q.admit(&s, &t(1, 0, "a"), &low_full, 0)), "standard waits");
    assert_eq!(q.admit(&s, &t(2, 15, "a"), &low_full, 0), Admission::Pass, "premium takes the reserve");
    // A sheddable request below the reserve is shed: every endpoint is full for it.
    assert!(matches!(q.admit(&s, &t(3, -5, "a"), &low_full, 0), Admission::Reject(_)));
    assert!(held(&q.admit(&s, &t(4, 0, "a"), &low_full, 0)));
    // Ticks release nothing below 10 while the reduced thresholds are reached...
    assert!(q.on_tick(&s, &Capacity { epoch: 2, ..low_full }, 10).is_empty());
    // ...and at most the reduced headroom once they are not (3 tokens, 1 low slot).
    let one_low = Capacity {
        epoch: 3,
        reserve: Some(Reserve { min_priority: 10, slots: 1, saturated: false }),
        ..room(3, 3)
    };
    assert_eq!(released(&q.on_tick(&s, &one_low, 20)), vec![1]);
    assert_eq!(record(&s, "m").left, 2, "unused tokens stay for higher priorities");
    // A premium request arriving now passes on one of them (lower ones wait: it takes a token).
    assert_eq!(q.admit(&s, &t(5, 15, "a"), &one_low, 21), Admission::Pass);
    assert_eq!(record(&s, "m").left, 1);
}

#[test]
fn config_defaults_and_validation() {
    let c: FlowControlConfig = crate::config::read_json("{}").unwrap();
    assert_eq!(c, FlowControlConfig::default());
    assert_eq!((c.max_wait_ms, c.max_queue, c.retry_after_s, c.worker_ttl_ms), (30_000, 1024, 1, 2000));
    assert!(crate::config::read_json::<FlowControlConfig>(r#"{"max_wait":1}"#).is_err());
    let bad = FlowControlConfig {
        max_wait_ms: 0,
        max_queue: 0,
        worker_ttl_ms: 100,
        reserve: Some(ReserveConfig { min_priority: 10, fraction: 1.0 }),
        ..c
    };
    let mut errs = Vec::new();
    bad.validate("flow_control", &mut errs);
    let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
    // In the fields' declaration order (`settings!`'s `validate_fields`).
    assert_eq!(
        paths,
        vec![
            "flow_control.max_wait_ms",
            "flow_control.max_queue",
            "flow_control.worker_ttl_ms",
            "flow_control.reserve.fraction"
        ]
    );
    assert!(errs[3].reason.contains("must be > 0 and < 1"), "{}", errs[3].reason);
    let r: FlowControlConfig =
        crate::config::read_json(r#"{"reserve":{"min_priority":10,"fraction":0.4}}"#).unwrap();
    assert_eq!(r.reserve, Some(ReserveConfig { min_priority: 10, fraction: 0.4 }));
    assert!(crate::config::read_json::<FlowControlConfig>(r#"{"reserve":{"min_priority":10}}"#).is_err());
    assert!(crate::config::read_json::<FlowControlConfig>(
        r#"{"reserve":{"min_priority":1,"fraction":0.4,"x":1}}"#
    )
    .is_err());
}

/// The ledger's binary form: round trip; truncations and trailing bytes read as the neutral
/// record (whole). Mixed builds: a ledger of the next release is never overwritten here (the
/// queue decides locally, as on a store error); the next release reads this one's.
#[test]
fn the_ledger_record_and_another_release() {
    let rec = Record {
        epoch: 3,
        reset_ms: 9,
        left: 2,
        workers: vec![WorkerEntry { id: 1, hb: 5, q: vec![(3, 2), (-1, 1)], t: vec![(3, 7)] }],
        served: fairshare::Served(vec![(3, 7, 1)]),
        declined_ms: 11,
    };
    let b = rec.encode();
    assert_eq!(Record::decode(&b), rec);
    for cut in 0..b.len() {
        assert_eq!(Record::decode(&b[..cut]), Record::default(), "cut at {cut}");
    }
    let mut longer = b.clone();
    longer.push(0);
    assert_eq!(Record::decode(&longer), Record::default());
    let theirs = crate::base::codec::as_next(&b, crate::base::codec::Tag::FlowLedger);
    let s = MemStore::new();
    s.set(&shared_key("m"), &theirs, 0).unwrap();
    let mut q = FlowQueue::new(&cfg(), "m", 1);
    assert!(held(&q.admit(&s, &t(1, 0, "a"), &SAT, 0)));
    let stored = s.get(&shared_key("m")).unwrap().unwrap().0;
    if cfg!(feature = "codec-next") {
        assert!(record(&s, "m").workers.iter().any(|w| w.id == 1));
    } else {
        assert_eq!(stored, theirs, "another build's ledger is not overwritten");
        assert_eq!(Record::read(&theirs), None);
    }
}

fn td(id: u32, priority: i32, flow: &str, deadline_ms: Option<u64>) -> Ticket<'_> {
    Ticket { id, priority, fairness_id: flow, deadline_ms }
}

#[test]
fn within_a_level_the_earliest_deadline_goes_first_then_requests_without_one() {
    let s = MemStore::new();
    let mut q = FlowQueue::new(&cfg(), "m", 1);
    // Arrival order 1..=5 at priority 0, one tenant: 1 has no deadline, 2 is due at 900, 3 at
    // 300, 4 none, 5 at 600.
    for (id, d) in [(1, None), (2, Some(900)), (3, Some(300)), (4, None), (5, Some(600))] {
        assert!(held(&q.admit(&s, &td(id, 0, "a", d), &SAT, 0)), "id {id}");
    }
    // One token per epoch: deadlines in order, then the rest in arrival order.
    let mut order = Vec::new();
    for epoch in 2..=6 {
        order.extend(released(&q.on_tick(&s, &room(epoch, 1), epoch * 10)));
    }
    assert_eq!(order, vec![3, 5, 2, 1, 4]);
}

#[test]
fn deadlines_order_tenants_but_never_overrule_priority() {
    let s = MemStore::new();
    let mut q = FlowQueue::new(&cfg(), "m", 1);
    // Tenant a's request is due later than tenant b's, which arrived after it; a priority-5
    // request without a deadline outranks both.
    assert!(held(&q.admit(&s, &td(1, 0, "a", Some(5_000)), &SAT, 0)));
    assert!(held(&q.admit(&s, &td(2, 0, "b", Some(1_000)), &SAT, 0)));
    assert!(held(&q.admit(&s, &td(3, 5, "c", None), &SAT, 0)));
    assert!(held(&q.admit(&s, &td(4, 0, "a", Some(800)), &SAT, 0)));
    let a = q.on_tick(&s, &room(2, 2), 10);
    // Priority first (3), then the earliest front of the level: a's queue is ordered by deadline
    // too, so its front is 4 (800), ahead of b's 2 (1,000).
    assert_eq!(released(&a), vec![3, 4]);
    let a = q.on_tick(&s, &room(3, 5), 20);
    assert_eq!(released(&a), vec![2, 1]);
}

#[test]
fn a_request_past_its_deadline_goes_after_those_still_on_time_and_only_max_wait_rejects() {
    let s = MemStore::new();
    let mut q = FlowQueue::new(&cfg(), "m", 1);
    assert!(held(&q.admit(&s, &td(1, 0, "a", Some(100)), &SAT, 0)));
    assert!(held(&q.admit(&s, &td(2, 0, "a", None), &SAT, 0)));
    assert!(held(&q.admit(&s, &td(3, 0, "b", Some(900)), &SAT, 0)));
    assert!(held(&q.admit(&s, &td(4, 0, "b", Some(200)), &SAT, 0)));
    // At 500 ms, 1 and 4 are past their deadlines: they are not rejected for that (they are not
    // sheddable, and a sheddable request is never held), but they go last: first the one still
    // on time (3), then the one without a deadline (2), then the late ones, earliest first.
    assert!(q.on_tick(&s, &SAT, 500).is_empty());
    let mut order = Vec::new();
    for epoch in 2..=4 {
        order.extend(released(&q.on_tick(&s, &room(epoch, 1), 500 + epoch)));
    }
    assert_eq!(order, vec![3, 2, 1]);
    // max_wait_ms (1,000) still applies to whatever is left.
    let a = q.on_tick(&s, &SAT, 1_000);
    assert!(matches!(a.as_slice(), [Action::Reject { id: 4, .. }]), "{a:?}");
}

#[test]
fn a_sheddable_request_with_a_target_waits_until_its_deadline_instead_of_being_shed() {
    let s = MemStore::new();
    let mut q = FlowQueue::new(&cfg(), "m", 1);
    // Saturated: without a target it is shed at once; with one it is held, behind everything
    // of higher priority.
    assert!(matches!(q.admit(&s, &td(1, -5, "a", None), &SAT, 0), Admission::Reject(_)));
    assert!(held(&q.admit(&s, &td(2, -5, "a", Some(300)), &SAT, 0)));
    assert!(held(&q.admit(&s, &td(3, 0, "a", None), &SAT, 0)));
    assert!(held(&q.admit(&s, &td(4, -5, "a", Some(900)), &SAT, 0)));
    // One token: priority 0 first.
    assert_eq!(released(&q.on_tick(&s, &room(2, 1), 100)), vec![3]);
    // At 300 ms request 2's deadline passed while held: shed with 429 slo_unattainable.
    let a = q.on_tick(&s, &SAT, 300);
    match a.as_slice() {
        [Action::Reject { id: 2, rejection, .. }] => {
            assert_eq!((rejection.status, rejection.code), (429, "slo_unattainable"));
        }
        other => panic!("{other:?}"),
    }
    // Capacity before its deadline: request 4 goes on (the scheduler then judges its target).
    assert_eq!(released(&q.on_tick(&s, &room(3, 1), 400)), vec![4]);
    assert!(q.is_empty());
    assert_eq!(q.take_stats().by_priority[&-5].shed, 2);
}
