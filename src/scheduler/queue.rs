//! Queue scorer: prefer endpoints with fewer requests waiting in the engine's queue.
//!
//! Formula (GIE's queue scorer): over the candidates that report a queue length `q`,
//! `score = (q_max − q) / (q_max − q_min)`, and `1.0` for everyone when `q_max == q_min`.
//! The shortest queue scores 1, the longest 0.
//!
//! Input: `Candidate::queue`: the scraped `EndpointMetrics::queue` (vLLM
//! `num_requests_waiting`, SGLang `num_queue_reqs`, trtllm `num_requests_waiting`; already
//! normalised, so the scorer is engine-agnostic), or, with `scheduler.live_queue: true`, the
//! **live queue estimate** of `crate::state::load` (that queue plus the requests this gateway sent there
//! since the scrape and has not seen finish). Without the correction, a snapshot up to a poll
//! interval old makes every worker see the same "shortest" queue and send its requests there
//! until the next scrape (herding); with it, each request sent lengthens the queue it joined at
//! once, for every worker. Off by default: see docs/scheduler.md for the measured trade-off.
//! Saturation always reads the estimate.
//!
//! Missing signal (an engine that does not report it): the neutral score
//! `min(0.5, lowest known score)` (see `super::candidate::neutral_fill`), so an endpoint we know nothing
//! about never beats one we know is good. Stale endpoints never get here: the filter removed
//! them. Min-max is scale-free (a gap of 1 counts as much as a gap of 100); the in-flight scorer
//! and the hot-spot guard supply the absolute view.
//!
//! Default weight 0.5 (GIE: 2; see `inflight.rs` for why).

use super::candidate::{neutral_fill, Candidate};
use crate::base::num;

pub fn scores(cands: &[Candidate<'_>]) -> Vec<f64> {
    let raw: Vec<Option<f64>> = cands.iter().map(|c| c.queue.filter(|q| q.is_finite())).collect();
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for q in raw.iter().flatten() {
        lo = num::min(lo, *q);
        hi = num::max(hi, *q);
    }
    let norm: Vec<Option<f64>> = raw
        .iter()
        .map(|q| q.map(|q| if hi > lo { ((hi - q) / (hi - lo)).clamp(0.0, 1.0) } else { 1.0 }))
        .collect();
    neutral_fill(&norm)
}

#[cfg(test)]
mod tests {
    use super::super::tests_support::cands_with;
    use super::*;

    #[test]
    fn min_max_normalised() {
        // queues 0, 5, 10: (10-0)/10 = 1.0, (10-5)/10 = 0.5, (10-10)/10 = 0.0
        let c = cands_with(&[(Some(0.0), None), (Some(5.0), None), (Some(10.0), None)]);
        assert_eq!(scores(&c.view()), vec![1.0, 0.5, 0.0]);
    }

    #[test]
    fn reads_the_live_estimate_not_the_scraped_queue() {
        // Scraped queues 0 and 2, but 3 requests went to the first since its scrape.
        let c = cands_with(&[(Some(0.0), None), (Some(2.0), None)]);
        assert_eq!(scores(&c.view()), vec![1.0, 0.0]);
        let mut v = c.view();
        v[0].queue = Some(3.0);
        assert_eq!(scores(&v), vec![0.0, 1.0]);
    }

    #[test]
    fn all_equal_is_one() {
        let c = cands_with(&[(Some(3.0), None), (Some(3.0), None)]);
        assert_eq!(scores(&c.view()), vec![1.0, 1.0]);
    }

    #[test]
    fn missing_is_neutral_never_winning() {
        // Known: 2 -> 1.0, 4 -> 0.0; the missing one gets min(0.5, 0.0) = 0.0.
        let c = cands_with(&[(Some(2.0), None), (None, None), (Some(4.0), None)]);
        assert_eq!(scores(&c.view()), vec![1.0, 0.0, 0.0]);
        // Known all equal (1.0): missing gets min(0.5, 1.0) = 0.5, below them.
        let c = cands_with(&[(Some(2.0), None), (None, None)]);
        assert_eq!(scores(&c.view()), vec![1.0, 0.5]);
        // Nobody reports a queue: 0.5 each, so the scorer has no influence.
        let c = cands_with(&[(None, None), (None, None)]);
        assert_eq!(scores(&c.view()), vec![0.5, 0.5]);
        // A NaN from a broken exporter counts as missing.
        let c = cands_with(&[(Some(f64::NAN), None), (Some(1.0), None)]);
        assert_eq!(scores(&c.view()), vec![0.5, 1.0]);
    }
}
