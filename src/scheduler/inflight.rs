//! In-flight scorer: prefer endpoints with fewer requests this gateway has in flight to them.
//!
//! Formula: `score = (c_min + 1) / (c + 1)`, where `c` is the endpoint's router-local in-flight
//! count and `c_min` the lowest among the candidates. The least-loaded scores 1; equal counts all
//! score 1. It is a ratio, not min-max, so 10 vs 11 in flight (0.92) is a small difference while
//! 0 vs 1 (0.5) is a large one — the same intuition as "1.5× more loaded".
//!
//! Input: `crate::state::inflight::InflightCounts`, shared by every Envoy worker through shared data,
//! incremented when a request is sent and decremented when it ends. It reacts at once, whereas
//! polled queue/KV metrics lag by up to one poll interval: a burst that lands between two polls
//! would otherwise all go to the endpoint that looked idle at the last poll.
//!
//! Missing/stale: the count is never missing (no entry means 0 in flight) and never stale. It
//! only sees this gateway's requests, so it complements the engine metrics rather than replacing
//! them. If the shared read fails the host passes empty counts: every endpoint scores 1 and the
//! scorer has no influence (it never makes one endpoint look idle).
//!
//! Default weight 2 (queue and KV 0.5 each): polled metrics lag bursts, this count does not; the
//! replay benchmark measured lower TTFT p90 on every workload with these weights than with GIE's
//! 2/2/1 (tools/replay-bench/FINDINGS.md).

use super::candidate::Candidate;

pub fn scores(cands: &[Candidate<'_>]) -> Vec<f64> {
    let min = cands.iter().map(|c| c.inflight).min().unwrap_or(0);
    cands.iter().map(|c| (f64::from(min) + 1.0) / (f64::from(c.inflight) + 1.0)).collect()
}

#[cfg(test)]
mod tests {
    use super::super::tests_support::cands_inflight;
    use super::*;

    #[test]
    fn ratio_to_least_loaded() {
        // min 0: (0+1)/(0+1) = 1, (0+1)/(1+1) = 0.5, (0+1)/(3+1) = 0.25
        assert_eq!(scores(&cands_inflight(&[0, 1, 3]).view()), vec![1.0, 0.5, 0.25]);
        // min 10: 11/11 = 1, 11/12 = 0.91666..
        let s = scores(&cands_inflight(&[10, 11]).view());
        assert_eq!(s[0], 1.0);
        assert!((s[1] - 11.0 / 12.0).abs() < 1e-12);
    }

    #[test]
    fn equal_counts_are_all_one() {
        assert_eq!(scores(&cands_inflight(&[4, 4, 4]).view()), vec![1.0, 1.0, 1.0]);
        assert_eq!(scores(&[]), Vec::<f64>::new());
    }
}
