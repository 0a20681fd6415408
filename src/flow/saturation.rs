//! Saturation: does a set of endpoints (the pool, or the endpoints serving one model) have room?
//!
//! # Formula
//! For each endpoint `e`, its *load* is
//!
//! ```text
//! load(e) = min(1, max(queue/queue_threshold, kv/kv_threshold, inflight/max_inflight))
//! ```
//!
//! where `queue` is the **live queue estimate** of `crate::state::load` (the scraped queue plus the
//! requests this gateway sent there since that scrape and has not seen finish, over all Envoy
//! workers), and a term is left out when its signal is missing (`None` in the snapshot) or, for
//! the in-flight term, when `max_inflight_per_endpoint` is 0. So the first request of a burst
//! that would overfill an engine's queue already finds the endpoint full, and is held in the
//! proxy (where priority order applies) instead of in the engine's FIFO; and a request that
//! finishes frees its room at once, not at the next scrape. An endpoint is *full* when
//! `load(e) = 1`. The set is **saturated when every endpoint is full**, which is the same as "the
//! average load reaches 1". An empty set is saturated.
//!
//! # Relation to GIE
//! GIE's reference detector is `mean over pods of max(queue/5, kv/0.8) >= 1`, a stale pod
//! counting as 1, with metrics stale after 200 ms. We keep its thresholds (5 and 0.8) and "stale
//! is full", and change two things:
//! - Each endpoint's load is capped at 1 before averaging. Uncapped, one endpoint with a queue of
//!   15 (load 3) and two idle endpoints average 1.0, and requests would be held while two
//!   endpoints sit idle; the scheduler would have sent them there.
//! - The router-local in-flight count is a third term. Polled metrics lag by up to a poll
//!   interval plus the scrape time; in-flight counts move the moment a request is sent, so a
//!   burst cannot overshoot an endpoint's `max_inflight_per_endpoint` between two polls.
//!
//! # Missing and stale signals
//! - An endpoint with no metrics, never scraped, whose last scrape failed, or scraped more than
//!   `stale_after_ms` ago (default: `poller.stale_after_ms`; longer for an endpoint the poller
//!   scrapes slowly because it is idle, `EndpointStatus::stale_limit_ms`) is *stale* and counts as full
//!   (load 1, no room): we do not send more work where we cannot see. (A failed scrape is the
//!   scheduler's test of health too, so the two agree on which endpoints can take work.)
//! - A missing queue or KV signal on a fresh endpoint is left out of the max, never read as 0.
//!   An endpoint with no usable signal at all (unknown engine and no in-flight limit) has load 0:
//!   it cannot be judged full. Such endpoints are counted in [`SaturationReport::blind`]; set
//!   `max_inflight_per_endpoint` to protect them.
//! - Non-finite values (NaN, ±inf) are treated as missing; negative values as 0.
//!
//! # Headroom
//! [`SaturationReport::headroom`] estimates how many more requests fit before every endpoint is
//! full; flow control releases at most that many held requests per snapshot (see `crate::flow`).
//! For a fresh, non-full endpoint, room is the smallest of
//! `ceil(queue_threshold − live queue)` (queue known) and `max_inflight − inflight` (limit set); when
//! neither is known (KV only, or blind) the room is 1, a deliberately cautious probe per snapshot.
//! Full and stale endpoints have room 0.

use crate::base::json::ConfigError;
use crate::base::settings::settings;
use crate::state::snapshot::EndpointStatus;

settings! {
    /// When the endpoints of a model count as full: per endpoint, the largest of queue /
    /// `queue_threshold`, KV use / `kv_threshold` and in-flight / `max_inflight_per_endpoint`
    /// reaching 1, or stale metrics; the model is saturated when all its endpoints are full.
    // Resolve once with `SaturationConfig::params` and pass the result to `saturated`.
    #[derive(Debug, Clone, PartialEq)]
    pub struct SaturationConfig {
        /// Queue length at which an endpoint is full; > 0. Default 5 (GIE).
        #[schema(extend("exclusiveMinimum" = 0))]
        pub queue_threshold: f64 = 5.0,
        /// KV-cache use (0..1) at which an endpoint is full; > 0. Default 0.8 (GIE). A value above 1
        /// switches the KV term off.
        #[schema(extend("exclusiveMinimum" = 0))]
        pub kv_threshold: f64 = 0.8,
        /// Requests in flight from this proxy at which an endpoint is full. Default 0 = no limit.
        /// A good value is the engine's batch size plus `queue_threshold` (vLLM: `max_num_seqs` + 5).
        pub max_inflight_per_endpoint: u32 = 0,
        /// Metrics older than this, in ms, make the endpoint stale (full). At least
        /// `poller.interval_ms`. Default null: `poller.stale_after_ms` (1000, five polls at the
        /// default 200 ms; GIE uses 200 ms with 50 ms polls, four polls).
        pub stale_after_ms: Option<u64> = None,
    }
}

/// The detector's parameters, resolved once from the configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaturationParams {
    pub queue_threshold: f64,
    pub kv_threshold: f64,
    /// 0 = no in-flight limit.
    pub max_inflight_per_endpoint: u32,
    pub stale_after_ms: u64,
}

impl Default for SaturationParams {
    /// The configuration defaults, with the poller's default staleness (1000 ms).
    fn default() -> Self {
        SaturationConfig::default().params(1000)
    }
}

impl SaturationConfig {
    /// Resolves the defaults that depend on other sections: `poller_stale_after_ms` is
    /// `poller.stale_after_ms`.
    pub fn params(&self, poller_stale_after_ms: u64) -> SaturationParams {
        SaturationParams {
            queue_threshold: self.queue_threshold,
            kv_threshold: self.kv_threshold,
            max_inflight_per_endpoint: self.max_inflight_per_endpoint,
            stale_after_ms: self.stale_after_ms.unwrap_or(poller_stale_after_ms),
        }
    }

    /// Appends every problem to `errs`, with paths under `path` (e.g. `saturation`).
    /// `poll_interval_ms` is `poller.interval_ms`: staleness shorter than a poll would make every
    /// endpoint stale between polls, and the pool would look saturated most of the time.
    pub fn validate(&self, path: &str, poll_interval_ms: u64, errs: &mut Vec<ConfigError>) {
        if !(self.queue_threshold.is_finite() && self.queue_threshold > 0.0) {
            errs.push(ConfigError {
                path: format!("{path}.queue_threshold"),
                reason: format!("must be a finite number > 0, got {}", self.queue_threshold),
            });
        }
        if !(self.kv_threshold.is_finite() && self.kv_threshold > 0.0) {
            errs.push(ConfigError {
                path: format!("{path}.kv_threshold"),
                reason: format!("must be a finite number > 0, got {}", self.kv_threshold),
            });
        }
        if let Some(ms) = self.stale_after_ms.filter(|ms| *ms < poll_interval_ms) {
            errs.push(ConfigError {
                path: format!("{path}.stale_after_ms"),
                reason: format!(
                    "must be at least poller.interval_ms ({poll_interval_ms}), got {ms}: every endpoint \
                     would be stale between polls"
                ),
            });
        }
    }
}

/// One endpoint's state as the detector sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EndpointLoad {
    /// In [0, 1]; 1 = full.
    pub load: f64,
    pub stale: bool,
    /// Fresh, but no signal could judge it (load 0 by default).
    pub blind: bool,
    /// How many more requests fit (see the module doc).
    pub room: u32,
}

impl EndpointLoad {
    pub fn full(&self) -> bool {
        self.load >= 1.0
    }
}

/// A usable value: finite, clamped at 0.
fn signal(v: Option<f64>) -> Option<f64> {
    v.filter(|x| x.is_finite()).map(|x| x.max(0.0))
}

/// Is `ep` stale at `now_ms` (counted as full, see the module doc): no metrics, never scraped,
/// a failed scrape since the last success, or a scrape older than `stale_after_ms`. A failed
/// scrape makes the endpoint stale at once, as it does for the scheduler
/// (`scheduler::filter::healthy`): its old metrics may describe a dead server.
pub fn is_stale(cfg: &SaturationParams, ep: &EndpointStatus, now_ms: u64) -> bool {
    ep.metrics.is_none()
        || ep.failures > 0
        || ep.scraped_ms == 0
        || now_ms.saturating_sub(ep.scraped_ms) > ep.stale_limit_ms(cfg.stale_after_ms)
}

/// The load of one endpoint with `inflight` requests from this proxy in flight.
pub fn endpoint_load(
    cfg: &SaturationParams,
    ep: &EndpointStatus,
    inflight: u32,
    now_ms: u64,
) -> EndpointLoad {
    let stale_load = EndpointLoad { load: 1.0, stale: true, blind: false, room: 0 };
    let Some(m) = ep.metrics.as_ref() else { return stale_load };
    if is_stale(cfg, ep, now_ms) {
        return stale_load;
    }
    // The live estimate: the scraped queue plus what this gateway sent since that scrape and
    // has not seen finish (`crate::state::load`); the scraped queue alone when the poller recorded no
    // in-flight count with it.
    let queue = crate::state::load::live_queue(ep, inflight, now_ms, cfg.stale_after_ms);
    let cap = cfg.max_inflight_per_endpoint;
    let terms = [
        queue.map(|q| q / cfg.queue_threshold),
        signal(m.kv_usage).map(|kv| kv / cfg.kv_threshold),
        (cap > 0).then(|| f64::from(inflight) / f64::from(cap)),
    ];
    let blind = terms.iter().all(Option::is_none);
    let load = terms.iter().flatten().fold(0.0_f64, |a, b| a.max(*b)).min(1.0);
    let room = if load >= 1.0 {
        0
    } else {
        // Request-denominated room; `as u32` saturates, and the values are finite and >= 0 here.
        let by_queue = queue.map(|q| (cfg.queue_threshold - q).ceil().max(0.0) as u32);
        let by_inflight = (cap > 0).then(|| cap.saturating_sub(inflight));
        match (by_queue, by_inflight) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) | (None, Some(a)) => a,
            // KV only, or blind: one probe per snapshot.
            (None, None) => 1,
        }
    };
    EndpointLoad { load, stale: false, blind, room }
}

/// The verdict for a set of endpoints.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaturationReport {
    /// Every endpoint is full (or stale), or there are none.
    pub saturated: bool,
    /// Mean of the capped per-endpoint loads, in [0, 1]; 1.0 for an empty set. For metrics.
    pub load: f64,
    pub endpoints: u32,
    pub stale: u32,
    /// Full, including stale.
    pub full: u32,
    pub blind: u32,
    /// Requests that fit before every endpoint is full; 0 when saturated.
    pub headroom: u32,
}

/// Judges `endpoints` (the caller filters them to the pool or to one model's endpoints).
/// `inflight(address)` is the router-local in-flight count of the endpoint, summed over workers.
pub fn saturated(
    cfg: &SaturationParams,
    endpoints: &[&EndpointStatus],
    inflight: &dyn Fn(&str) -> u32,
    now_ms: u64,
) -> SaturationReport {
    let mut r = SaturationReport {
        saturated: true,
        load: 1.0,
        endpoints: 0,
        stale: 0,
        full: 0,
        blind: 0,
        headroom: 0,
    };
    let mut sum = 0.0;
    for ep in endpoints {
        let l = endpoint_load(cfg, ep, inflight(&ep.address), now_ms);
        r.endpoints = r.endpoints.saturating_add(1);
        sum += l.load;
        r.stale += u32::from(l.stale);
        r.full += u32::from(l.full());
        r.blind += u32::from(l.blind);
        r.headroom = r.headroom.saturating_add(l.room);
    }
    if r.endpoints > 0 {
        r.load = sum / f64::from(r.endpoints);
        r.saturated = r.full == r.endpoints;
    }
    if r.saturated {
        r.headroom = 0;
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::metrics::EndpointMetrics;

    const NOW: u64 = 1_000_000;

    fn ep(addr: &str, queue: Option<f64>, kv: Option<f64>, age_ms: u64) -> EndpointStatus {
        EndpointStatus {
            address: addr.into(),
            models: vec!["m".into()],
            metrics: Some(EndpointMetrics { queue, kv_usage: kv, ..EndpointMetrics::default() }),
            scraped_ms: NOW - age_ms,
            failures: 0,
            inflight_at_scrape: None,
            role: Default::default(),
            poll_ms: 0,
        }
    }

    fn none(_: &str) -> u32 {
        0
    }

    fn params() -> SaturationParams {
        SaturationParams::default()
    }

    #[test]
    fn gie_thresholds_by_default() {
        let cfg = params();
        // queue 4 → 4/5 = 0.8; kv 0.4 → 0.5; load 0.8, room ceil(5-4) = 1.
        let l = endpoint_load(&cfg, &ep("a", Some(4.0), Some(0.4), 10), 0, NOW);
        assert_eq!((l.load, l.room, l.stale), (0.8, 1, false));
        // kv 0.8 → 1.0: full, no room, even with an empty queue.
        let l = endpoint_load(&cfg, &ep("a", Some(0.0), Some(0.8), 10), 0, NOW);
        assert!(l.full());
        assert_eq!(l.room, 0);
        // queue 12 → 2.4, capped at 1.
        let l = endpoint_load(&cfg, &ep("a", Some(12.0), None, 10), 0, NOW);
        assert_eq!(l.load, 1.0);
    }

    #[test]
    fn stale_and_unscraped_count_as_full() {
        let cfg = params();
        // 1001 ms old > 1000 → stale, although its numbers say idle.
        let l = endpoint_load(&cfg, &ep("a", Some(0.0), Some(0.0), 1001), 0, NOW);
        assert!(l.stale && l.full());
        // Exactly 1000 ms is still fresh.
        assert!(!endpoint_load(&cfg, &ep("a", Some(0.0), Some(0.0), 1000), 0, NOW).stale);
        let mut never = ep("a", Some(0.0), None, 0);
        never.scraped_ms = 0;
        assert!(endpoint_load(&cfg, &never, 0, NOW).stale);
        let mut no_metrics = ep("a", None, None, 10);
        no_metrics.metrics = None;
        assert!(endpoint_load(&cfg, &no_metrics, 0, NOW).stale);
        // Scraped 10 ms ago, but the latest scrape failed: stale, like the scheduler sees it.
        let mut failing = ep("a", Some(0.0), Some(0.0), 10);
        failing.failures = 1;
        let l = endpoint_load(&cfg, &failing, 0, NOW);
        assert!(l.stale && l.full() && l.room == 0);
    }

    #[test]
    fn inflight_term_catches_bursts_between_polls() {
        let cfg = SaturationParams { max_inflight_per_endpoint: 8, ..params() };
        // Metrics say idle (queue 0, kv 0.1), but 8 requests went out since the poll: full.
        let l = endpoint_load(&cfg, &ep("a", Some(0.0), Some(0.1), 10), 8, NOW);
        assert!(l.full());
        // 6 in flight: load max(0, 0.125, 0.75) = 0.75; room min(ceil(5-0)=5, 8-6=2) = 2.
        let l = endpoint_load(&cfg, &ep("a", Some(0.0), Some(0.1), 10), 6, NOW);
        assert_eq!((l.load, l.room), (0.75, 2));
    }

    #[test]
    fn live_queue_sees_the_burst_and_the_finishes_before_the_next_scrape() {
        // The tier example: queue_threshold 1. The scrape saw idle engines with none of ours in
        // flight.
        let cfg = SaturationParams { queue_threshold: 1.0, ..params() };
        let mut e = ep("a", Some(0.0), Some(0.1), 50);
        e.inflight_at_scrape = Some(0);
        // No correction recorded: 3 sent since the scrape are invisible to the queue term.
        let mut blind = e.clone();
        blind.inflight_at_scrape = None;
        assert!(!endpoint_load(&cfg, &blind, 3, NOW).full());
        // With it, one request sent since the scrape fills the queue threshold.
        assert_eq!(endpoint_load(&cfg, &e, 0, NOW).room, 1);
        let l = endpoint_load(&cfg, &e, 1, NOW);
        assert!(l.full() && l.room == 0);
        // The scrape saw 2 waiting with 3 of ours in flight; 2 finished since: room again.
        let mut busy = ep("b", Some(2.0), Some(0.1), 50);
        busy.inflight_at_scrape = Some(3);
        assert!(endpoint_load(&cfg, &busy, 2, NOW).full());
        assert_eq!(endpoint_load(&cfg, &busy, 1, NOW).room, 1);
        // A pool of two such endpoints is saturated only when both are.
        let r = saturated(&cfg, &[&e, &busy], &|a| if a == "a" { 1 } else { 2 }, NOW);
        assert!(r.saturated);
    }

    #[test]
    fn missing_signals_are_left_out_not_zero() {
        let cfg = params();
        // KV only, 0.4/0.8 = 0.5; room 1 (no request-denominated signal).
        let l = endpoint_load(&cfg, &ep("a", None, Some(0.4), 10), 0, NOW);
        assert_eq!((l.load, l.room, l.blind), (0.5, 1, false));
        // Nothing at all: blind, load 0, room 1.
        let l = endpoint_load(&cfg, &ep("a", None, None, 10), 0, NOW);
        assert_eq!((l.load, l.room, l.blind), (0.0, 1, true));
        // NaN queue is missing; the KV term alone decides.
        let l = endpoint_load(&cfg, &ep("a", Some(f64::NAN), Some(0.8), 10), 0, NOW);
        assert!(l.full());
        // A blind endpoint with an in-flight limit is no longer blind.
        let capped = SaturationParams { max_inflight_per_endpoint: 4, ..cfg };
        let l = endpoint_load(&capped, &ep("a", None, None, 10), 1, NOW);
        assert_eq!((l.load, l.room, l.blind), (0.25, 3, false));
    }

    #[test]
    fn pool_saturated_only_when_every_endpoint_full() {
        let cfg = params();
        let a = ep("a", Some(15.0), None, 10); // load 3 → capped 1
        let b = ep("b", Some(0.0), Some(0.0), 10); // idle: room 5
        let c = ep("c", Some(0.0), Some(0.0), 5000); // stale: full
        let r = saturated(&cfg, &[&a, &b, &c], &none, NOW);
        // GIE's uncapped mean would be (3 + 0 + 1)/3 = 1.33 → saturated; ours is (1+0+1)/3.
        assert!(!r.saturated);
        assert!((r.load - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!((r.endpoints, r.stale, r.full, r.headroom), (3, 1, 2, 5));

        let b_busy = ep("b", Some(5.0), Some(0.0), 10);
        let r = saturated(&cfg, &[&a, &b_busy, &c], &none, NOW);
        assert!(r.saturated);
        assert_eq!((r.load, r.headroom), (1.0, 0));
    }

    #[test]
    fn inflight_lookup_is_by_address() {
        let cfg = SaturationParams { max_inflight_per_endpoint: 2, ..params() };
        let a = ep("10.0.0.1:8000", Some(0.0), None, 10);
        let b = ep("10.0.0.2:8000", Some(0.0), None, 10);
        let inflight = |addr: &str| if addr == "10.0.0.1:8000" { 2 } else { 1 };
        let r = saturated(&cfg, &[&a, &b], &inflight, NOW);
        // a is full (2/2); b has min(5, 2-1) = 1 room.
        assert_eq!((r.saturated, r.full, r.headroom), (false, 1, 1));
        let r = saturated(&cfg, &[&a, &b], &|_| 2, NOW);
        assert!(r.saturated);
    }

    #[test]
    fn empty_set_is_saturated() {
        let r = saturated(&params(), &[], &none, NOW);
        assert!(r.saturated);
        assert_eq!((r.endpoints, r.headroom, r.load), (0, 0, 1.0));
    }

    #[test]
    fn config_defaults_and_validation() {
        let cfg: SaturationConfig = crate::config::read_json("{}").unwrap();
        assert_eq!(cfg, SaturationConfig::default());
        // Staleness follows the poller's unless set.
        assert_eq!(cfg.params(1500).stale_after_ms, 1500);
        let own = SaturationConfig { stale_after_ms: Some(400), ..cfg.clone() };
        assert_eq!(own.params(1500).stale_after_ms, 400);
        assert!(crate::config::read_json::<SaturationConfig>(r#"{"queue":5}"#).is_err());
        let mut errs = Vec::new();
        cfg.validate("saturation", 200, &mut errs);
        own.validate("saturation", 400, &mut errs);
        assert!(errs.is_empty(), "{errs:?}");
        let bad =
            SaturationConfig { queue_threshold: 0.0, kv_threshold: -1.0, stale_after_ms: Some(199), ..cfg };
        let mut errs = Vec::new();
        bad.validate("saturation", 200, &mut errs);
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            vec!["saturation.queue_threshold", "saturation.kv_threshold", "saturation.stale_after_ms"]
        );
    }
}
