//! LoRA affinity: prefer endpoints where the requested adapter is already loaded.
//!
//! Formula (GIE's LoRA affinity scorer), for a request naming adapter `a`:
//! - `1.0` if `a` is in `running_adapters` (loaded and busy: no load cost at all);
//! - `0.8` if there is a free adapter slot: `|running ∪ waiting| < max_lora`;
//! - `0.6` if `a` is in `waiting_adapters` (queued to load);
//! - `0.0` otherwise (every slot holds another adapter).
//!
//! Input: `EndpointMetrics::{max_lora, running_adapters, waiting_adapters}` from vLLM's
//! `lora_requests_info`. An idle loaded adapter is NOT listed there, so "not listed" does not
//! mean "not loaded"; the free-slot case covers it loosely, and the prefix scorer (which
//! remembers where this adapter's prompts went) covers it better.
//!
//! Missing signal: an endpoint with no LoRA info at all (no `max_lora` and nothing listed, e.g.
//! an engine that does not export it) gets the neutral `min(0.5, lowest known score)`.
//! Base-model requests: every endpoint scores 0, so the scorer has no influence.
//!
//! Default weight 2.

use super::candidate::{neutral_fill, Candidate};

pub fn scores(adapter: Option<&str>, cands: &[Candidate<'_>]) -> Vec<f64> {
    let Some(a) = adapter else {
        return vec![0.0; cands.len()];
    };
    let raw: Vec<Option<f64>> = cands
        .iter()
        .map(|c| {
            let m = c.metrics?;
            if m.max_lora.is_none() && m.running_adapters.is_empty() && m.waiting_adapters.is_empty() {
                return None;
            }
            let running = m.running_adapters.iter().any(|x| x == a);
            let waiting = m.waiting_adapters.iter().any(|x| x == a);
            let mut used: Vec<&str> =
                m.running_adapters.iter().chain(&m.waiting_adapters).map(String::as_str).collect();
            used.sort_unstable();
            used.dedup();
            let free = m.max_lora.is_some_and(|max| used.len() < max as usize);
            Some(if running {
                1.0
            } else if free {
                0.8
            } else if waiting {
                0.6
            } else {
                0.0
            })
        })
        .collect();
    neutral_fill(&raw)
}

#[cfg(test)]
mod tests {
    use super::super::tests_support::Owned;
    use super::*;
    use crate::state::metrics::EndpointMetrics;

    fn m(max: Option<u32>, running: &[&str], waiting: &[&str]) -> Option<EndpointMetrics> {
        Some(EndpointMetrics {
            max_lora: max,
            running_adapters: running.iter().map(|s| s.to_string()).collect(),
            waiting_adapters: waiting.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        })
    }

    #[test]
    fn four_levels() {
        let c = Owned::from_metrics(vec![
            m(Some(2), &["a", "b"], &[]),    // a running → 1.0
            m(Some(2), &["b"], &[]),         // 1 of 2 slots used → 0.8
            m(Some(2), &["b", "c"], &["a"]), // 3 used ≥ 2, a waiting → 0.6
            m(Some(2), &["b", "c"], &[]),    // full with others → 0.0
        ]);
        assert_eq!(scores(Some("a"), &c.view()), vec![1.0, 0.8, 0.6, 0.0]);
    }

    #[test]
    fn waiting_with_free_slot_counts_as_free_slot() {
        // used = {a} (1) < 4: free slot 0.8 is checked before waiting 0.6.
        let c = Owned::from_metrics(vec![m(Some(4), &[], &["a"])]);
        assert_eq!(scores(Some("a"), &c.view()), vec![0.8]);
    }

    #[test]
    fn missing_info_is_neutral_and_base_requests_inert() {
        // Known scores 1.0 and 0.0; no info → min(0.5, 0.0) = 0.0; no metrics at all → same.
        let c = Owned::from_metrics(vec![
            m(Some(1), &["a"], &[]),
            m(Some(1), &["b"], &[]),
            m(None, &[], &[]),
            None,
        ]);
        assert_eq!(scores(Some("a"), &c.view()), vec![1.0, 0.0, 0.0, 0.0]);
        // Only info is a running "a" (1.0): unknown gets min(0.5, 1.0) = 0.5.
        let c = Owned::from_metrics(vec![m(Some(1), &["a"], &[]), None]);
        assert_eq!(scores(Some("a"), &c.view()), vec![1.0, 0.5]);
        assert_eq!(scores(None, &c.view()), vec![0.0, 0.0]);
    }
}
