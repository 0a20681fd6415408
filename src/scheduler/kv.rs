//! KV-cache scorer: prefer endpoints with free KV-cache space.
//!
//! Formula (GIE's KV-cache utilisation scorer): `score = 1 − clamp(usage, 0, 1)`.
//!
//! Input: `EndpointMetrics::kv_usage` in [0, 1] (vLLM `kv_cache_usage_perc` /
//! `gpu_cache_usage_perc`, SGLang `token_usage`, trtllm `kv_cache_utilization`).
//!
//! Missing signal: the neutral score `min(0.5, lowest known score)` (`super::candidate::neutral_fill`).
//! Stale endpoints never reach the scorer (filtered). Not min-max normalised on purpose: KV
//! usage is already on an absolute scale, and 0.40 vs 0.41 should not look like 1 vs 0.
//!
//! Default weight 0.5 (GIE: 2; see `inflight.rs` for why).

use super::candidate::{neutral_fill, Candidate};

pub fn scores(cands: &[Candidate<'_>]) -> Vec<f64> {
    let raw: Vec<Option<f64>> = cands.iter().map(free).collect();
    neutral_fill(&raw)
}

/// One candidate's score before the neutral fill: `1 − clamp(usage, 0, 1)`, `None` when the
/// usage is missing or not finite.
pub fn free(c: &Candidate<'_>) -> Option<f64> {
    c.metrics.and_then(|m| m.kv_usage).filter(|u| u.is_finite()).map(|u| 1.0 - u.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::super::tests_support::cands_with;
    use super::*;

    #[test]
    fn one_minus_usage() {
        // 1 - 0.25 = 0.75; 1 - 0.9 = 0.1 (float: 0.09999999999999998); 1 - 0 = 1.
        let c = cands_with(&[(None, Some(0.25)), (None, Some(0.9)), (None, Some(0.0))]);
        let s = scores(&c.view());
        assert_eq!(s[0], 0.75);
        assert!((s[1] - 0.1).abs() < 1e-12);
        assert_eq!(s[2], 1.0);
    }

    #[test]
    fn out_of_range_is_clamped() {
        // usage 1.7 (a percent reported as a ratio gone wrong) -> clamp 1.0 -> 0; -0.2 -> 0 -> 1.
        let c = cands_with(&[(None, Some(1.7)), (None, Some(-0.2))]);
        assert_eq!(scores(&c.view()), vec![0.0, 1.0]);
    }

    #[test]
    fn missing_is_neutral() {
        // Known 0.8 (usage 0.2) and 0.6 (usage 0.4): missing gets min(0.5, 0.6) = 0.5.
        let c = cands_with(&[(None, Some(0.2)), (None, None), (None, Some(0.4))]);
        let s = scores(&c.view());
        assert_eq!(s[1], 0.5);
        // Known 0.1 (usage 0.9): missing gets min(0.5, 0.1) = 0.1 — it ties, never wins.
        let c = cands_with(&[(None, Some(0.9)), (None, None)]);
        let s = scores(&c.view());
        assert_eq!(s[0], s[1]);
    }
}
