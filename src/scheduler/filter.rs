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
//! - Not ejected: passive health (`crate::state::health`) ejects endpoints whose requests fail; they
//!   are removed from the serving list before the health check, within
//!   `health.max_ejection_percent` of the serving endpoints ([`not_ejected`]). With no health
//!   data nothing is removed.
//!
//! When no serving endpoint is healthy the scheduler fails open or answers 503 (see `mod.rs`).

use crate::state::health::{HealthConfig, HealthView};
use crate::state::snapshot::EndpointStatus;

/// Does `ep` serve the base model `base`?
pub fn serves(ep: &EndpointStatus, base: &str) -> bool {
    ep.models.iter().any(|m| m == base)
}

/// Is `ep`'s last scrape successful and fresh at `now_ms`? The limit is `stale_after_ms`, longer
/// for an endpoint the poller scrapes slowly (`EndpointStatus::stale_limit_ms`).
pub fn healthy(ep: &EndpointStatus, now_ms: u64, stale_after_ms: u64) -> bool {
    ep.failures == 0
        && ep.scraped_ms > 0
        && now_ms.saturating_sub(ep.scraped_ms) <= ep.stale_limit_ms(stale_after_ms)
}

/// The serving endpoints that passive health has not ejected at `now_ms` (see
/// [`HealthView::excluded`] for the limit that keeps the pool from emptying).
pub fn not_ejected<'a>(
    serving: &[&'a EndpointStatus],
    health: &HealthView,
    now_ms: u64,
    cfg: &HealthConfig,
) -> Vec<&'a EndpointStatus> {
    if health.is_empty() {
        return serving.to_vec();
    }
    let addrs: Vec<&str> = serving.iter().map(|e| e.address.as_str()).collect();
    let out = health.excluded(&addrs, now_ms, cfg);
    serving.iter().zip(out).filter(|(_, gone)| !gone).map(|(e, _)| *e).collect()
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
            inflight_at_scrape: None,
            role: Default::default(),
            poll_ms: 0,
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
    fn ejected_endpoints_are_left_out_within_the_limit() {
        use crate::base::ports::MemStore;
        use crate::state::health::{Outcome, Recorder};
        let mut a = ep(&["m"], 1, 0);
        a.address = "10.0.0.1:8000".into();
        let mut b = ep(&["m"], 1, 0);
        b.address = "10.0.0.2:8000".into();
        let cfg = HealthConfig::default();
        let store = MemStore::new();
        let mut rec = Recorder::new();
        // No data: nothing removed.
        let none = HealthView::default();
        assert_eq!(not_ejected(&[&a, &b], &none, 1000, &cfg).len(), 2);
        // Two gateway failures eject .2.
        for _ in 0..2 {
            rec.record(&store, &cfg, "10.0.0.2:8000", Outcome::Failure { gateway: true }, 1000).unwrap();
        }
        let view = rec.read(&store, 1000).unwrap();
        let left = not_ejected(&[&a, &b], &view, 1001, &cfg);
        assert_eq!(left.iter().map(|e| e.address.as_str()).collect::<Vec<_>>(), vec!["10.0.0.1:8000"]);
        // Alone, it is kept: the pool never empties.
        assert_eq!(not_ejected(&[&b], &view, 1001, &cfg).len(), 1);
        // The ejection ends after base_ejection_ms.
        assert_eq!(not_ejected(&[&a, &b], &view, 1000 + cfg.base_ejection_ms, &cfg).len(), 2);
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
