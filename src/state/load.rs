//! The live load estimate of one endpoint: what its last scrape saw, corrected by what this
//! gateway sent there (and saw finish) since that scrape. Saturation (`crate::flow::saturation`, hence
//! flow control) and routing (`crate::scheduler::queue`) read the same estimate.
//!
//! # Formula
//! ```text
//! delta      = inflight_now − inflight_at_scrape            (may be negative)
//! w          = 1                                      if age ≤ stale_after_ms / 2
//!            = (stale_after_ms − age) / (stale_after_ms / 2)   otherwise, clamped to [0, 1]
//! live_queue = clamp(queue_at_scrape + w · delta, 0, queue_at_scrape + inflight_now)
//! ```
//! - `queue_at_scrape`: the engine's waiting requests in the last successful scrape
//!   (`EndpointMetrics::queue`).
//! - `inflight_now`: this gateway's in-flight requests to the endpoint, summed over every live
//!   Envoy worker through shared data (`crate::state::inflight`).
//! - `inflight_at_scrape`: the same sum, read by the poller when that scrape's response arrived
//!   ([`crate::state::snapshot::EndpointStatus::inflight_at_scrape`]).
//! - `age = now − scraped_ms`.
//!
//! Every request sent since the scrape counts as waiting, and every finish as one request that
//! left the engine (letting one waiting request in). So a burst fills the estimate as it is sent,
//! not one poll later, and a completion frees room at once.
//!
//! # Caps and decay
//! - Never below 0 (more finishes than the queue held means the queue is empty, not negative),
//!   and never above the scraped queue plus everything this gateway has in flight there.
//! - The correction fades linearly from full weight at half the staleness limit to nothing at
//!   `stale_after_ms`, where the endpoint becomes stale anyway (full for saturation, filtered out
//!   by the scheduler). A late snapshot makes the delta an ever longer extrapolation: requests
//!   sent long ago have mostly moved from the queue into the batch, and in-flight records of a VM
//!   that died expire (`crate::state::inflight::TTL_MS`) and make the delta drop without any finish.
//!   The estimate then falls back to what was actually measured.
//!
//! # Known bias
//! A request sent to an endpoint with a free batch slot runs at once instead of waiting, but the
//! estimate counts it as waiting until the next scrape (at most one poll interval). This errs on
//! the side of "busier": with `queue_threshold` 1 an idle endpoint looks full after one request
//! until the next scrape shows it running. Requests sent by other gateway replicas are only seen
//! at the next scrape.
//!
//! # Missing signals
//! - No queue in the scrape (an engine that does not report it, or NaN/inf): `None`; callers
//!   leave the queue term out, as before. The correction never invents a queue.
//! - No `inflight_at_scrape` (an older poller, or it could not read the counts): the scraped
//!   queue unchanged (snapshot only).
//! - No metrics at all: `None`.

use crate::base::num;
use crate::state::snapshot::EndpointStatus;

/// The live queue estimate of `ep` (see the module doc). `inflight_now` is this gateway's
/// in-flight count to it now; `stale_after_ms` the staleness limit of the caller, extended for an
/// endpoint the poller scrapes slowly (`EndpointStatus::stale_limit_ms`): the fade below runs
/// over that endpoint's own limit.
pub fn live_queue(ep: &EndpointStatus, inflight_now: u32, now_ms: u64, stale_after_ms: u64) -> Option<f64> {
    let q = ep.metrics.as_ref()?.queue.filter(|q| q.is_finite())?;
    let q = num::max(q, 0.0);
    let Some(at_scrape) = ep.inflight_at_scrape else {
        return Some(q);
    };
    let w = correction_weight(now_ms.saturating_sub(ep.scraped_ms), ep.stale_limit_ms(stale_after_ms));
    let delta = f64::from(inflight_now) - f64::from(at_scrape);
    let hi = q + f64::from(inflight_now);
    Some((q + w * delta).clamp(0.0, hi))
}

/// Weight of the since-scrape correction for a scrape `age_ms` old: 1 up to half of
/// `stale_after_ms`, then linearly down to 0 at `stale_after_ms`.
pub fn correction_weight(age_ms: u64, stale_after_ms: u64) -> f64 {
    let full = stale_after_ms / 2;
    if age_ms <= full {
        return 1.0;
    }
    if age_ms >= stale_after_ms {
        return 0.0;
    }
    let span = stale_after_ms.saturating_sub(full).max(1);
    // Both values fit f64 exactly for any realistic time span.
    (stale_after_ms.saturating_sub(age_ms)) as f64 / span as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::metrics::EndpointMetrics;

    const NOW: u64 = 1_000_000;

    fn ep(queue: Option<f64>, at_scrape: Option<u32>, age_ms: u64) -> EndpointStatus {
        EndpointStatus {
            address: "10.0.0.1:8000".into(),
            models: vec!["m".into()],
            metrics: Some(EndpointMetrics { queue, ..EndpointMetrics::default() }),
            scraped_ms: NOW - age_ms,
            failures: 0,
            inflight_at_scrape: at_scrape,
            role: Default::default(),
            poll_ms: 0,
        }
    }

    #[test]
    fn burst_sent_since_the_scrape_counts_as_waiting() {
        // Scrape: idle, 0 of ours in flight. 12 sent since: the estimate is 12, not 0.
        assert_eq!(live_queue(&ep(Some(0.0), Some(0), 50), 12, NOW, 1000), Some(12.0));
        // Scrape saw 3 waiting with 4 of ours in flight; 2 more sent: 5.
        assert_eq!(live_queue(&ep(Some(3.0), Some(4), 50), 6, NOW, 1000), Some(5.0));
    }

    #[test]
    fn finishes_free_room_at_once_and_never_go_negative() {
        // 3 waiting at the scrape with 6 of ours in flight; 2 finished since: 1 waiting.
        assert_eq!(live_queue(&ep(Some(3.0), Some(6), 50), 4, NOW, 1000), Some(1.0));
        // 5 finished: clamp at 0.
        assert_eq!(live_queue(&ep(Some(3.0), Some(6), 50), 1, NOW, 1000), Some(0.0));
    }

    #[test]
    fn capped_by_queue_plus_our_inflight() {
        // Even at full weight the estimate is at most queue + inflight_now (delta ≤ inflight_now
        // already guarantees it; the clamp keeps it so for any input).
        let e = ep(Some(2.0), Some(0), 0);
        assert_eq!(live_queue(&e, 7, NOW, 1000), Some(9.0));
        assert!(live_queue(&e, u32::MAX, NOW, 1000).is_some_and(|q| q.is_finite()));
    }

    #[test]
    fn correction_decays_toward_the_snapshot_when_late() {
        assert_eq!(correction_weight(0, 1000), 1.0);
        assert_eq!(correction_weight(500, 1000), 1.0);
        assert_eq!(correction_weight(750, 1000), 0.5);
        assert_eq!(correction_weight(1000, 1000), 0.0);
        assert_eq!(correction_weight(5000, 1000), 0.0);
        // Degenerate limits never divide by zero.
        assert_eq!(correction_weight(1, 1), 0.0);
        assert_eq!(correction_weight(0, 0), 1.0);
        // 10 sent since a scrape 750 ms old: half the correction.
        assert_eq!(live_queue(&ep(Some(1.0), Some(0), 750), 10, NOW, 1000), Some(6.0));
        // Stale: the scraped queue alone.
        assert_eq!(live_queue(&ep(Some(1.0), Some(0), 1200), 10, NOW, 1000), Some(1.0));
    }

    #[test]
    fn missing_signals() {
        // No queue reported: no estimate (never invented from the in-flight delta).
        assert_eq!(live_queue(&ep(None, Some(0), 10), 5, NOW, 1000), None);
        assert_eq!(live_queue(&ep(Some(f64::NAN), Some(0), 10), 5, NOW, 1000), None);
        // No in-flight count at scrape: the snapshot's queue unchanged.
        assert_eq!(live_queue(&ep(Some(2.0), None, 10), 5, NOW, 1000), Some(2.0));
        // Negative queue from a broken exporter reads as 0.
        assert_eq!(live_queue(&ep(Some(-3.0), None, 10), 0, NOW, 1000), Some(0.0));
        let mut none = ep(Some(1.0), Some(0), 10);
        none.metrics = None;
        assert_eq!(live_queue(&none, 5, NOW, 1000), None);
    }
}
