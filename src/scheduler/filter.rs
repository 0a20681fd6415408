//! Filter stage: which endpoints may take the request at all.
//!
//! - Serving: the endpoint lists the request's base model in `EndpointStatus::models`. A LoRA
//!   adapter is served by every endpoint of its base (any of them can load it), so an adapter
//!   request filters on the base.
//! - Healthy: `failures == 0`, scraped at least once (`scraped_ms > 0`) and
//!   `now_ms − scraped_ms <= poller.stale_after_ms`. A missing *signal* on a healthy endpoint is
//!   left to the scorers (neutral score); a stale or failing endpoint is not a candidate.
//!   A scrape timestamp in the future (clock skew between the poller and this worker) counts as
//!   fresh.
//!
//! When no serving endpoint is healthy the scheduler fails open or answers 503 (see `mod.rs`).

use crate::snapshot::EndpointStatus;

/// Does `ep` serve the base model `base`?
pub fn serves(ep: &EndpointStatus, base: &str) -> bool {
    ep.models.iter().any(|m| m == base)
}

/// Is `ep`'s last scrape successful and fresh at `now_ms`?
pub fn healthy(ep: &EndpointStatus, now_ms: u64, stale_after_ms: u64) -> bool {
    ep.failures == 0 && ep.scraped_ms > 0 && now_ms.saturating_sub(ep.scraped_ms) <= stale_after_ms
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(models: &[&str], scraped_ms: u64, failures: u32) -> EndpointStatus {
        EndpointStatus {
            address: "10.0.0.1:8000".into(),
            models: models.iter().map(|s| s.to_string()).collect(),
            metrics: None,
            scraped_ms,
            failures,
        }
    }

    #[test]
    fn serving_is_exact_base_model_match() {
        let e = ep(&["llama", "qwen"], 1, 0);
        assert!(serves(&e, "llama"));
        assert!(serves(&e, "qwen"));
        assert!(!serves(&e, "llam"));
        assert!(!serves(&e, "Llama"));
    }

    #[test]
    fn health_boundaries() {
        // stale_after 1000: scraped at 9000 is fresh at 10000 (age 1000, inclusive) ...
        assert!(healthy(&ep(&[], 9000, 0), 10_000, 1000));
        // ... and stale at 10001 (age 1001).
        assert!(!healthy(&ep(&[], 9000, 0), 10_001, 1000));
        // One failed scrape since the last success makes it unhealthy even if recent.
        assert!(!healthy(&ep(&[], 9999, 1), 10_000, 1000));
        // Never scraped (0) is unhealthy even at now 0.
        assert!(!healthy(&ep(&[], 0, 0), 0, 1000));
        // Future timestamp (skew) is fresh.
        assert!(healthy(&ep(&[], 10_500, 0), 10_000, 1000));
    }
}
