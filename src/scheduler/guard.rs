//! Hot-spot guard: affinity gives way when its endpoint is overloaded compared with the others.
//!
//! Pure affinity (prefix or session) piles a popular prefix or a heavy session onto one
//! endpoint; every peer (SGLang, AIBrix, llm-d) learned this. Rule, after SGLang's cache-aware
//! policy:
//!
//! - `load(e) = max(queue(e) + running(e), inflight(e))` — the engine's view of its own load
//!   (all gateways), or this gateway's in-flight count when that is higher (a burst since the
//!   last poll). Either metric missing counts as 0 in the engine sum; the in-flight count is
//!   never missing.
//! - `e` is overloaded when `load(e) − min_load > abs_gap` AND `load(e) > ratio × min_load`,
//!   with `min_load` the lowest load among the healthy candidates. Defaults 64 and 1.5.
//!
//! Effect: an overloaded endpoint gets prefix and session scores of 0, is not eligible for
//! session rendezvous, and a session token naming it is ignored. It can still win on load
//! scores (it will not when it is overloaded, since queue/in-flight then score it low).
//! Both conditions are needed: the absolute gap ignores noise at low load, the ratio ignores a
//! constant gap at high load.

use super::candidate::Candidate;
use crate::base::num;
use crate::scheduler::config::GuardConfig;

pub fn load(c: &Candidate<'_>) -> f64 {
    let engine = c
        .metrics
        .map(|m| {
            num::max(m.queue.filter(|v| v.is_finite()).unwrap_or(0.0), 0.0)
                + num::max(m.running.filter(|v| v.is_finite()).unwrap_or(0.0), 0.0)
        })
        .unwrap_or(0.0);
    num::max(engine, f64::from(c.inflight))
}

/// `true` for each overloaded candidate.
pub fn overloaded(cands: &[Candidate<'_>], g: &GuardConfig) -> Vec<bool> {
    let loads: Vec<f64> = cands.iter().map(load).collect();
    let min = loads.iter().copied().fold(f64::INFINITY, num::min);
    loads.iter().map(|&l| l - min > g.abs_gap && l > g.ratio * min).collect()
}

#[cfg(test)]
mod tests {
    use super::super::tests_support::Owned;
    use super::*;

    fn g() -> GuardConfig {
        GuardConfig { abs_gap: 64.0, ratio: 1.5 }
    }

    #[test]
    fn needs_both_gap_and_ratio() {
        // (queue, running, inflight) → loads 10, 80, 200, 300.
        let c = Owned::new(&[
            (Some(5.0), Some(5.0), 0),
            (Some(30.0), Some(50.0), 0),
            (None, None, 200),
            (Some(300.0), None, 0),
        ]);
        // min 10: 80-10 = 70 > 64 and 80 > 15 → overloaded; 200, 300 too.
        assert_eq!(overloaded(&c.view(), &g()), vec![false, true, true, true]);
        // loads 200 vs 300: gap 100 > 64 but 300 < 1.5×200 = 300 (not >) → not overloaded.
        let c = Owned::new(&[(Some(200.0), None, 0), (Some(300.0), None, 0)]);
        assert_eq!(overloaded(&c.view(), &g()), vec![false, false]);
        // loads 0 vs 60: ratio holds (60 > 0) but gap 60 <= 64 → not overloaded.
        let c = Owned::new(&[(Some(0.0), None, 0), (Some(60.0), None, 0)]);
        assert_eq!(overloaded(&c.view(), &g()), vec![false, false]);
    }

    #[test]
    fn inflight_counts_when_higher_than_metrics() {
        // Metrics say 0+0, but 100 in flight from this gateway since the last poll: load 100.
        let c = Owned::new(&[(Some(0.0), Some(0.0), 100), (Some(0.0), Some(0.0), 0)]);
        assert_eq!(load(&c.view()[0]), 100.0);
        assert_eq!(overloaded(&c.view(), &g()), vec![true, false]);
    }
}
