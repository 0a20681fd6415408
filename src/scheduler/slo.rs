//! Routing to meet a request's TTFT target (objective `predicted_ttft` only). Pure.
//!
//! # Formula
//! ```text
//! budget         = ttft_target × (1 − priority.slo.margin)                      (margin 0.2)
//! feasible(e)    = eligible(e) ∧ known(e) ∧ ttft(e) ≤ budget
//! reserved(e)    = feasible(e) ∧ ttft(e) ≤ tightest_budget < budget
//! open           = feasible ∖ reserved, if its best uncached(e) ≤ the best feasible uncached(e)
//! ```
//! `ttft(e)` is the predicted TTFT of the pick (`crate::scheduler::predict`), `known(e)` that
//! the pod's rate has been learnt from at least one first byte (`crate::state::rates`), and
//! `tightest_budget` the budget of the tightest target any objective or tier configures.
//!
//! 1. **Some pod is feasible**: the pick is the usual ranking (`rank`: predicted TTFT plus the
//!    miss penalty, times the KV factor, with the rendezvous among the near-best) restricted to
//!    `open` when it is not empty, else to the feasible pods. So a request keeps its cache
//!    locality (the miss penalty), and a request whose target is looser than the tightest one
//!    leaves the pods that can still meet the tightest target to the requests that need them,
//!    unless that costs it a cache hit (`open` must hold the prompt as well as the feasible
//!    pods do). It does not always take the fastest pod. Fallbacks: the rest of that set, then
//!    the other eligible pods, by rank.
//! 2. **No pod is feasible, and every eligible pod's rate is known**: the prediction says the
//!    target will be missed everywhere. A sheddable request (priority < 0) is answered 429
//!    `slo_unattainable` with Retry-After (`flow_control.retry_after_s`), before anything reaches
//!    a pod; any other goes to the pod with the lowest predicted TTFT (fallbacks by predicted
//!    TTFT).
//! 3. **No pod is feasible and some eligible pod's rate is not known yet** (a cold pod, or a
//!    pool that has not answered a streamed request yet): the prediction cannot tell, so the
//!    pick is made as without a target and nothing is shed.
//!
//! With no target, or under objective `weighted` (no prediction), nothing changes.

use crate::base::errors::Rejection;

/// A request's TTFT target as the scheduler reads it (`crate::flow::slo` builds it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SloAsk {
    /// A pod meets the target when its predicted TTFT is at most this (ms):
    /// `target × (1 − margin)`.
    pub budget_ms: f64,
    /// The budget of the tightest target configured for any objective or tier (ms). A request
    /// with a looser budget leaves the pods that can meet it alone when it can. `None`: no
    /// reservation.
    pub tightest_budget_ms: Option<f64>,
    /// Priority below 0: shed when no pod can meet the target.
    pub sheddable: bool,
    /// Retry-After of that 429, in s.
    pub retry_after_s: u32,
}

/// What the prediction said of the primary, for the decision record and the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SloVerdict {
    /// The primary is predicted to meet the target.
    Meets,
    /// No pod is predicted to meet it; the primary is the best predicted.
    Misses,
    /// Some pod's rate is not learnt, or there is no prediction: picked as without a target.
    Unknown,
}

impl SloVerdict {
    pub fn as_str(self) -> &'static str {
        match self {
            SloVerdict::Meets => "meets",
            SloVerdict::Misses => "misses",
            SloVerdict::Unknown => "unknown",
        }
    }
}

/// What each candidate offers, in candidate order.
pub struct Offer<'a> {
    pub ttft: &'a [f64],
    pub uncached: &'a [f64],
    pub eligible: &'a [bool],
    pub known: &'a [bool],
}

/// How the pick goes.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// Rank among these candidates only (rule 1).
    Among(Vec<bool>),
    /// The lowest predicted TTFT first (rule 2, not sheddable).
    BestPredicted,
    /// Answer with this 429 (rule 2, sheddable).
    Shed(Rejection),
    /// As without a target (rule 3).
    AsToday,
}

/// The 429 of a sheddable request no pod can serve in time.
pub fn unattainable(retry_after_s: u32) -> Rejection {
    Rejection::new(
        429,
        "rate_limit_error",
        "slo_unattainable",
        "no server is predicted to meet this request's latency target and it is sheddable; retry later",
    )
    .with_retry_after(retry_after_s)
}

/// The module doc's rules 1–3.
pub fn plan(ask: &SloAsk, o: &Offer<'_>) -> (Plan, SloVerdict) {
    let n = o.ttft.len();
    let at = |v: &[bool], i: usize| v.get(i).copied().unwrap_or(false);
    let val = |v: &[f64], i: usize| v.get(i).copied().unwrap_or(f64::INFINITY);
    let feasible: Vec<bool> =
        (0..n).map(|i| at(o.eligible, i) && at(o.known, i) && val(o.ttft, i) <= ask.budget_ms).collect();
    if feasible.iter().any(|f| *f) {
        let best_uncached = |set: &[bool]| {
            (0..n).filter(|&i| at(set, i)).map(|i| val(o.uncached, i)).fold(f64::INFINITY, f64::min)
        };
        let set = match ask.tightest_budget_ms.filter(|t| *t < ask.budget_ms) {
            Some(tight) => {
                let open: Vec<bool> = (0..n).map(|i| at(&feasible, i) && val(o.ttft, i) > tight).collect();
                // Half a token: the same prefix held, up to float noise.
                if open.iter().any(|f| *f) && best_uncached(&open) <= best_uncached(&feasible) + 0.5 {
                    open
                } else {
                    feasible
                }
            }
            None => feasible,
        };
        return (Plan::Among(set), SloVerdict::Meets);
    }
    let eligible_any = (0..n).any(|i| at(o.eligible, i));
    let unknown_any = (0..n).any(|i| at(o.eligible, i) && !at(o.known, i));
    if !eligible_any || unknown_any {
        return (Plan::AsToday, SloVerdict::Unknown);
    }
    if ask.sheddable {
        (Plan::Shed(unattainable(ask.retry_after_s)), SloVerdict::Misses)
    } else {
        (Plan::BestPredicted, SloVerdict::Misses)
    }
}

/// The candidates by `key` (lower first, `total_cmp`, index order on ties), eligible only.
pub fn by_key(key: &[f64], eligible: &[bool]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..key.len()).filter(|&i| eligible.get(i).copied().unwrap_or(false)).collect();
    idx.sort_by(|&a, &b| {
        let (x, y) =
            (key.get(a).copied().unwrap_or(f64::INFINITY), key.get(b).copied().unwrap_or(f64::INFINITY));
        x.total_cmp(&y)
    });
    idx
}

/// `first` (an order over a restricted set), then the other eligible candidates by `costs`,
/// without repeats, cut to `1 + fallbacks`.
pub fn then_the_rest(first: Vec<usize>, costs: &[f64], eligible: &[bool], fallbacks: usize) -> Vec<usize> {
    let mut out = first;
    for i in by_key(costs, eligible) {
        if out.len() > fallbacks {
            break;
        }
        if !out.contains(&i) {
            out.push(i);
        }
    }
    out.truncate(1 + fallbacks);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(budget: f64, tight: Option<f64>, sheddable: bool) -> SloAsk {
        SloAsk { budget_ms: budget, tightest_budget_ms: tight, sheddable, retry_after_s: 2 }
    }

    struct O {
        ttft: Vec<f64>,
        uncached: Vec<f64>,
        eligible: Vec<bool>,
        known: Vec<bool>,
    }
    impl O {
        fn new(ttft: &[f64]) -> Self {
            let n = ttft.len();
            O { ttft: ttft.to_vec(), uncached: vec![100.0; n], eligible: vec![true; n], known: vec![true; n] }
        }
        fn offer(&self) -> Offer<'_> {
            Offer { ttft: &self.ttft, uncached: &self.uncached, eligible: &self.eligible, known: &self.known }
        }
    }

    #[test]
    fn only_pods_predicted_within_the_budget_are_candidates() {
        let o = O::new(&[900.0, 300.0, 700.0]);
        let (p, v) = plan(&ask(800.0, None, false), &o.offer());
        assert_eq!((p, v), (Plan::Among(vec![false, true, true]), SloVerdict::Meets));
        // An ineligible (overloaded) or unlearnt pod is never feasible.
        let mut o = O::new(&[100.0, 100.0, 100.0]);
        o.eligible[0] = false;
        o.known[1] = false;
        assert_eq!(plan(&ask(800.0, None, false), &o.offer()).0, Plan::Among(vec![false, false, true]));
    }

    #[test]
    fn a_looser_target_leaves_the_pods_a_tighter_one_needs_unless_it_costs_a_hit() {
        // Budget 1600, tightest 400: pod 0 (200 ms) can serve the tightest tier; 1 and 2 cannot
        // but meet this one: they are the set.
        let o = O::new(&[200.0, 900.0, 1200.0]);
        assert_eq!(
            plan(&ask(1600.0, Some(400.0), false), &o.offer()).0,
            Plan::Among(vec![false, true, true])
        );
        // This request is the tightest: no reservation.
        assert_eq!(
            plan(&ask(400.0, Some(400.0), false), &o.offer()).0,
            Plan::Among(vec![true, false, false])
        );
        // Pod 0 holds the prompt (fewer uncached tokens): locality wins, every feasible pod stays.
        let mut o = O::new(&[200.0, 900.0, 1200.0]);
        o.uncached = vec![10.0, 100.0, 100.0];
        assert_eq!(plan(&ask(1600.0, Some(400.0), false), &o.offer()).0, Plan::Among(vec![true, true, true]));
        // Every feasible pod is reserved: they all stay.
        let o = O::new(&[200.0, 300.0, 5000.0]);
        assert_eq!(
            plan(&ask(1600.0, Some(400.0), false), &o.offer()).0,
            Plan::Among(vec![true, true, false])
        );
    }

    #[test]
    fn when_every_known_pod_misses_a_sheddable_request_is_shed_and_others_take_the_best() {
        let o = O::new(&[900.0, 1300.0]);
        let (p, v) = plan(&ask(800.0, None, true), &o.offer());
        assert_eq!(v, SloVerdict::Misses);
        match p {
            Plan::Shed(r) => {
                assert_eq!((r.status, r.code, r.retry_after_s), (429, "slo_unattainable", Some(2)));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(plan(&ask(800.0, None, false), &o.offer()), (Plan::BestPredicted, SloVerdict::Misses));
    }

    #[test]
    fn an_unlearnt_pod_means_the_prediction_cannot_tell_and_nothing_is_shed() {
        let mut o = O::new(&[900.0, 1300.0]);
        o.known[1] = false;
        assert_eq!(plan(&ask(800.0, None, true), &o.offer()), (Plan::AsToday, SloVerdict::Unknown));
        // No eligible pod at all: as today too (the pipeline's own rules apply).
        let mut o = O::new(&[100.0]);
        o.eligible[0] = false;
        assert_eq!(plan(&ask(800.0, None, true), &o.offer()), (Plan::AsToday, SloVerdict::Unknown));
    }

    #[test]
    fn orders_fill_from_the_rest_without_repeats() {
        let costs = [5.0, 1.0, 3.0, 2.0];
        let eligible = [true, true, false, true];
        assert_eq!(by_key(&costs, &eligible), vec![1, 3, 0]);
        assert_eq!(then_the_rest(vec![0], &costs, &eligible, 2), vec![0, 1, 3]);
        assert_eq!(then_the_rest(vec![3, 0], &costs, &eligible, 1), vec![3, 0]);
        assert_eq!(then_the_rest(vec![1], &[f64::NAN, 1.0], &[true, true], 1), vec![1, 0]);
    }
}
