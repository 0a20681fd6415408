//! Passive health: what upstream results say about each endpoint, shared by every worker, and
//! which endpoints are ejected from picking. Pure: the host passes the store, the time and the
//! classified result of each request.
//!
//! # Inputs
//! The host classifies every request it routed, once, in `on_log` ([`classify`]): the final
//! response status (`response.code`), `response.code_details` and `response.flags`, and which
//! endpoint answered (`upstream.address`). [`attribute`] turns that into one [`Outcome`] per
//! endpoint tried: with Envoy's `override_host` retries, every endpoint listed before the one
//! that answered failed once (a retriable failure: connect failure, reset, retriable 5xx; which
//! one is not known, so it counts as a plain `Failure`, not a gateway failure).
//! - `Success`: any response from the pod that is not a 5xx or 429 (a 400 or 404 is the
//!   client's fault and shows the pod alive);
//! - `Failure` (`gateway: false`): 500, 501, 505 ... from the pod;
//! - `Failure` (`gateway: true`): 502, 503, 504, connect failure, reset, upstream timeout;
//! - `Load`: 429 from the pod. The pod is alive but full: it never counts toward ejection and
//!   does not reset the consecutive counters, but it adds phantom load (below);
//! - nothing: the client went away, or the filter answered itself.
//!
//! # Ejection (as Envoy's outlier detection)
//! Per endpoint: consecutive failures (any 5xx), consecutive gateway failures, and the failures
//! and requests in a window of `window_ms` (reset when it ends). An endpoint with nothing but
//! successes is not remembered at all (that keeps the shared value small), so in practice the
//! window counts from the endpoint's first failure. After a failure the endpoint is
//! ejected, with a reason, when
//! - it is on probation (its last ejection has ended and no success came since): `probation`;
//! - consecutive gateway failures ≥ `consecutive_gateway_failure`: `consecutive_gateway_failure`;
//! - consecutive failures ≥ `consecutive_5xx`: `consecutive_5xx`;
//! - requests in the window ≥ `failure_rate_min_requests` and failures ≥ `failure_rate_percent`
//!   % of them: `failure_rate`.
//!
//! (A threshold of 0 disables its rule.) The n-th ejection in a row lasts
//! `min(base_ejection_ms × 2^(n−1), max_ejection_ms)`; the counters restart. When it ends the
//! endpoint is picked again, on probation: its first success ends probation, one failure ejects
//! it again for twice as long. The count of ejections restarts once the endpoint has stayed
//! out of ejection and probation for `max_ejection_ms`.
//!
//! # Readers
//! [`HealthView::excluded`] tells the scheduler which serving endpoints to leave out: the ejected
//! ones, but at most `max_ejection_percent` % of the serving endpoints (at least one when there
//! are two or more; never all). The earliest ejections stay in force. An ejection beyond the
//! limit is still recorded (and counted in the metric) but not applied.
//!
//! # A fast failure is load
//! A black hole answers at once, so it never has anything in flight and would look like the
//! least loaded pod. Every failure and every 429 adds one to the endpoint's *phantom load*,
//! which [`HealthView::phantom_load`] returns while the last of them is younger than
//! `failure_load_ms`; the scheduler adds it to the endpoint's in-flight count (it restarts
//! from 1 after a quiet `failure_load_ms`, and is capped at [`MAX_PHANTOM_LOAD`]).
//!
//! # Shared data, and why races are safe
//! One key, [`HEALTH_KEY`], holding a `crate::base::codec` record (tag `Health`) with one entry
//! per endpoint with anything to remember (clean entries are dropped, at most [`MAX_ENTRIES`]): the number of keys is one whatever the pool
//! and the traffic. Every update is a CAS loop (read, apply, write with the token read) bounded
//! by [`crate::state::inflight::MAX_CAS_ATTEMPTS`], so two workers never overwrite each other once the
//! key exists. The key's *creation* is the only unconditional write (Envoy's CAS cannot say
//! "only if absent"): two workers that both find it missing may both write, and the second
//! overwrites the first's event. That loses at most the events of that one moment, once per
//! process, and it heals itself:
//! - the counters are re-accumulated from the next results (a black hole keeps failing);
//! - each worker keeps the ejections it decided in its own [`Recorder`] and merges them back
//!   into every later write and into what it reads, so an ejection it made is never lost, even
//!   if its write was overwritten;
//! - a value that does not parse reads as empty, and the next write replaces it;
//! - a value of a version this build does not read (another build's, during a rolling upgrade)
//!   reads as empty and is never written by this build: its ejections stay local to the worker.
//!
//! The view read by a request is at most one request old: each pick reads the key (one small
//! copy, usually empty).

use hashbrown::HashMap;

use crate::base::codec::{self, Reader, Refusal, Tag, Writer, MAX_NAME_BYTES};
use crate::base::json::ConfigError;
use crate::base::ports::{SharedStore, StoreError};
use crate::base::settings::settings;
use crate::state::inflight::MAX_CAS_ATTEMPTS;
use crate::state::snapshot::Snapshot;

pub const HEALTH_KEY: &str = "inference-picker/health";
/// Most endpoints remembered; beyond it the least recently active are dropped.
pub const MAX_ENTRIES: usize = 1024;
/// Largest phantom load of one endpoint.
pub const MAX_PHANTOM_LOAD: u32 = 64;
/// Longest `startup_wait_ms` accepted (a minute).
pub const MAX_STARTUP_WAIT_MS: u64 = 60_000;

settings! {
    /// `health` section of the configuration.
    #[derive(Debug, Clone, PartialEq)]
    pub struct HealthConfig {
        /// Learn from upstream results and eject failing endpoints. Default true. When false,
        /// nothing is recorded or ejected (`startup_wait_ms` still applies).
        pub enabled: bool = true,
        /// Consecutive 5xx (any, including gateway failures) that eject an endpoint; 0 disables.
        /// Default 3.
        pub consecutive_5xx: u32 = 3,
        /// Consecutive gateway failures (502, 503, 504, connect failure, reset, upstream timeout)
        /// that eject an endpoint; 0 disables. Default 2.
        pub consecutive_gateway_failure: u32 = 2,
        /// Percentage of failed requests in the window that ejects an endpoint, 0-100; 0 disables.
        /// Default 50.
        #[range(max = 100)]
        #[reason = "must be 0-100, got {v}"]
        pub failure_rate_percent: u32 = 50,
        /// Requests an endpoint needs in the window before its failure rate counts. At least 1.
        /// Default 10.
        #[range(min = 1)]
        #[reason = "must be at least 1"]
        pub failure_rate_min_requests: u32 = 10,
        /// Length of the failure-rate window, in ms. At least 100. Default 10000.
        #[range(min = 100)]
        pub window_ms: u64 = 10_000,
        /// First ejection time, in ms; the n-th in a row lasts `base × 2^(n−1)`. At least 1.
        /// Default 30000 (Envoy's outlier detection default).
        #[range(min = 1)]
        #[reason = "must be at least 1"]
        pub base_ejection_ms: u64 = 30_000,
        /// Longest ejection, in ms; at least `base_ejection_ms`. Default 300000.
        pub max_ejection_ms: u64 = 300_000,
        /// Most endpoints of a model ejected at once, as a percentage of those serving it, 0-100.
        /// At least one may be ejected when two or more serve, never all. Default 50.
        #[range(max = 100)]
        #[reason = "must be 0-100, got {v}"]
        pub max_ejection_percent: u32 = 50,
        /// How long, in ms, a failure (or a 429) counts as one more request in flight on its
        /// endpoint, so that a pod failing fast never looks idle; 0 disables. Default 2000.
        pub failure_load_ms: u64 = 2_000,
        /// Longest a request is held, in ms, while the proxy has no metrics yet (just started or
        /// hot-restarted), before it is routed by `filter.failure_mode` (`FailOpen`: by in-flight
        /// count; `FailClose`: 503 `metrics_not_ready`). 0 holds nothing. At most 60000. Default 1000
        /// (five poll intervals at the default `poller.interval_ms`).
        #[range(max = MAX_STARTUP_WAIT_MS)]
        pub startup_wait_ms: u64 = 1_000,
    }
}

impl HealthConfig {
    /// Appends every problem to `errs`, with paths under `path` (e.g. `health`).
    pub fn validate(&self, path: &str, errs: &mut Vec<ConfigError>) {
        self.validate_fields(path, errs, |errs| {
            if self.max_ejection_ms < self.base_ejection_ms {
                errs.push(ConfigError::new(
                    format!("{path}.max_ejection_ms"),
                    format!(
                        "must be at least base_ejection_ms ({}), got {}",
                        self.base_ejection_ms, self.max_ejection_ms
                    ),
                ));
            }
        });
    }

    /// Length of the `n`-th ejection in a row (n ≥ 1).
    pub fn ejection_ms(&self, n: u32) -> u64 {
        let shift = n.saturating_sub(1).min(32);
        self.base_ejection_ms.saturating_mul(1u64 << shift).min(self.max_ejection_ms)
    }
}

/// What one request said about one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success,
    /// A 5xx, connect failure, reset or timeout. `gateway`: 502/503/504 or no response at all.
    Failure {
        gateway: bool,
    },
    /// 429: busy, not broken.
    Load,
}

/// Why an endpoint was ejected (the metric's `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Consecutive5xx,
    ConsecutiveGatewayFailure,
    FailureRate,
    Probation,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Consecutive5xx => "consecutive_5xx",
            Reason::ConsecutiveGatewayFailure => "consecutive_gateway_failure",
            Reason::FailureRate => "failure_rate",
            Reason::Probation => "probation",
        }
    }
}

/// An ejection decided by [`Recorder::record`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ejection {
    pub reason: Reason,
    /// How long, in ms.
    pub duration_ms: u64,
    /// The n-th ejection in a row.
    pub nth: u32,
}

// Envoy's response flags (StreamInfo::CoreResponseFlag bits) that mean the upstream failed.
const FLAG_UPSTREAM_REQUEST_TIMEOUT: u64 = 0x4;
const FLAG_UPSTREAM_REMOTE_RESET: u64 = 0x10;
const FLAG_UPSTREAM_CONNECTION_FAILURE: u64 = 0x20;
const FLAG_UPSTREAM_CONNECTION_TERMINATION: u64 = 0x40;
const FLAG_UPSTREAM_RETRY_LIMIT_EXCEEDED: u64 = 0x8000;
const FLAG_UPSTREAM_PROTOCOL_ERROR: u64 = 0x80_0000;
const UPSTREAM_FAILURE_FLAGS: u64 = FLAG_UPSTREAM_REQUEST_TIMEOUT
    | FLAG_UPSTREAM_REMOTE_RESET
    | FLAG_UPSTREAM_CONNECTION_FAILURE
    | FLAG_UPSTREAM_CONNECTION_TERMINATION
    | FLAG_UPSTREAM_RETRY_LIMIT_EXCEEDED
    | FLAG_UPSTREAM_PROTOCOL_ERROR;
/// The client went away (DC, DR): says nothing about the pod.
const FLAG_DOWNSTREAM_CONNECTION_TERMINATION: u64 = 0x4000;
const FLAG_DOWNSTREAM_REMOTE_RESET: u64 = 0x1000_0000;

/// Classifies the final result of a routed request from `on_log`'s properties. `None`: it says
/// nothing about the endpoint (the client left first, or nothing reached an upstream).
pub fn classify(status: Option<u32>, code_details: &str, flags: u64) -> Option<Outcome> {
    let upstream_failed = flags & UPSTREAM_FAILURE_FLAGS != 0
        || code_details.starts_with("upstream_reset")
        || code_details.contains("connection_failure")
        || code_details.contains("connection_termination")
        || code_details == "upstream_per_try_timeout"
        || code_details == "upstream_response_timeout"
        || code_details == "response_timeout";
    if upstream_failed {
        return Some(Outcome::Failure { gateway: true });
    }
    if flags & (FLAG_DOWNSTREAM_CONNECTION_TERMINATION | FLAG_DOWNSTREAM_REMOTE_RESET) != 0
        || code_details.starts_with("downstream")
    {
        return None;
    }
    // Anything else that Envoy answered itself (no route, our own local reply ...).
    if !code_details.is_empty() && code_details != "via_upstream" {
        return None;
    }
    match status? {
        429 => Some(Outcome::Load),
        502..=504 => Some(Outcome::Failure { gateway: true }),
        500..=599 => Some(Outcome::Failure { gateway: false }),
        100..=499 => Some(Outcome::Success),
        _ => None,
    }
}

/// Spreads one request's outcome over the endpoints it tried. `destinations`: primary then
/// fallbacks, as sent; `answered_by`: `upstream.address` (the last endpoint tried);
/// `attempts`: `upstream.request_attempt_count` when known. Endpoints before the one that
/// answered failed (a retry only follows a failure); the one that answered gets `outcome`.
pub fn attribute<'a>(
    destinations: &'a [String],
    answered_by: Option<&str>,
    attempts: Option<u64>,
    outcome: Option<Outcome>,
) -> Vec<(&'a str, Outcome)> {
    let tried = match answered_by.and_then(|a| destinations.iter().position(|d| d == a)) {
        Some(i) => i + 1,
        None => attempts.map_or(1, |n| usize::try_from(n).unwrap_or(1).clamp(1, destinations.len().max(1))),
    };
    let mut out = Vec::with_capacity(tried);
    for (i, d) in destinations.iter().take(tried).enumerate() {
        if i + 1 < tried {
            // Envoy retries after a 5xx, a reset or a connect failure alike: which one is not
            // known, so it counts as a plain failure (toward `consecutive_5xx`, not the
            // gateway rule).
            out.push((d.as_str(), Outcome::Failure { gateway: false }));
        } else if let Some(o) = outcome {
            out.push((d.as_str(), o));
        }
    }
    out
}

/// What a request that is no generation (Anthropic's token count: the pod only tokenizes) says
/// about an endpoint: its failures and 429s, as any request's, but not its successes. A pod
/// whose generations fail (a wedged GPU) may still tokenize, and those successes would reset
/// the consecutive failures that eject it, and dilute its failure rate.
pub fn from_non_generation(outcome: Outcome) -> Option<Outcome> {
    match outcome {
        Outcome::Success => None,
        o => Some(o),
    }
}

/// What is remembered about one endpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Entry {
    pub consecutive_5xx: u32,
    pub consecutive_gateway: u32,
    pub window_start_ms: u64,
    pub window_total: u32,
    pub window_failures: u32,
    /// Failures and 429s since the phantom load last restarted, and when the last came.
    pub busy: u32,
    pub last_busy_ms: u64,
    pub ejected_at_ms: u64,
    pub ejected_until_ms: u64,
    /// Ejections in a row (sets the next ejection's length).
    pub ejections: u32,
    /// The last ejection has not been followed by a success yet.
    pub probation: bool,
    /// Last time anything was recorded (for pruning).
    pub touched_ms: u64,
}

impl Entry {
    pub fn ejected(&self, now_ms: u64) -> bool {
        now_ms < self.ejected_until_ms
    }

    /// Nothing worth keeping at `now_ms`.
    fn is_clean(&self, now_ms: u64, cfg: &HealthConfig) -> bool {
        self.consecutive_5xx == 0
            && self.consecutive_gateway == 0
            && self.window_failures == 0
            && !self.probation
            && self.ejections == 0
            && !self.ejected(now_ms)
            && now_ms.saturating_sub(self.last_busy_ms) >= cfg.failure_load_ms
    }

    /// Applies one outcome; returns the ejection it causes, if any.
    fn apply(&mut self, outcome: Outcome, now_ms: u64, cfg: &HealthConfig) -> Option<Ejection> {
        self.touched_ms = now_ms;
        if now_ms.saturating_sub(self.window_start_ms) >= cfg.window_ms {
            self.window_start_ms = now_ms;
            self.window_total = 0;
            self.window_failures = 0;
        }
        let gateway = match outcome {
            Outcome::Success => {
                self.consecutive_5xx = 0;
                self.consecutive_gateway = 0;
                self.window_total = self.window_total.saturating_add(1);
                if !self.ejected(now_ms) {
                    self.probation = false;
                    if now_ms.saturating_sub(self.ejected_until_ms) >= cfg.max_ejection_ms {
                        self.ejections = 0;
                    }
                }
                return None;
            }
            Outcome::Load => {
                self.add_busy(now_ms, cfg);
                return None;
            }
            Outcome::Failure { gateway } => gateway,
        };
        self.add_busy(now_ms, cfg);
        self.window_total = self.window_total.saturating_add(1);
        self.window_failures = self.window_failures.saturating_add(1);
        self.consecutive_5xx = self.consecutive_5xx.saturating_add(1);
        self.consecutive_gateway = if gateway { self.consecutive_gateway.saturating_add(1) } else { 0 };
        if self.ejected(now_ms) {
            // A request that was in flight when the endpoint was ejected: nothing new.
            return None;
        }
        let reached = |n: u32, threshold: u32| threshold > 0 && n >= threshold;
        let reason = if self.probation {
            Reason::Probation
        } else if reached(self.consecutive_gateway, cfg.consecutive_gateway_failure) {
            Reason::ConsecutiveGatewayFailure
        } else if reached(self.consecutive_5xx, cfg.consecutive_5xx) {
            Reason::Consecutive5xx
        } else if cfg.failure_rate_percent > 0
            && self.window_total >= cfg.failure_rate_min_requests
            && u64::from(self.window_failures) * 100
                >= u64::from(cfg.failure_rate_percent) * u64::from(self.window_total)
        {
            Reason::FailureRate
        } else {
            return None;
        };
        self.ejections = self.ejections.saturating_add(1);
        let duration_ms = cfg.ejection_ms(self.ejections);
        self.ejected_at_ms = now_ms;
        self.ejected_until_ms = now_ms.saturating_add(duration_ms);
        self.probation = true;
        self.consecutive_5xx = 0;
        self.consecutive_gateway = 0;
        self.window_start_ms = now_ms;
        self.window_total = 0;
        self.window_failures = 0;
        Some(Ejection { reason, duration_ms, nth: self.ejections })
    }

    fn add_busy(&mut self, now_ms: u64, cfg: &HealthConfig) {
        if now_ms.saturating_sub(self.last_busy_ms) >= cfg.failure_load_ms {
            self.busy = 0;
        }
        self.busy = self.busy.saturating_add(1).min(MAX_PHANTOM_LOAD);
        self.last_busy_ms = now_ms;
    }

    fn write(&self, addr: &str, w: &mut Writer) {
        w.str(addr)
            .u32(self.consecutive_5xx)
            .u32(self.consecutive_gateway)
            .u64(self.window_start_ms)
            .u32(self.window_total)
            .u32(self.window_failures)
            .u32(self.busy)
            .u64(self.last_busy_ms)
            .u64(self.ejected_at_ms)
            .u64(self.ejected_until_ms)
            .u32(self.ejections)
            .bool(self.probation)
            .u64(self.touched_ms);
    }

    fn read(r: &mut Reader<'_>) -> Option<(String, Entry)> {
        let addr = r.str(MAX_NAME_BYTES)?.to_string();
        let e = Entry {
            consecutive_5xx: r.u32()?,
            consecutive_gateway: r.u32()?,
            window_start_ms: r.u64()?,
            window_total: r.u32()?,
            window_failures: r.u32()?,
            busy: r.u32()?,
            last_busy_ms: r.u64()?,
            ejected_at_ms: r.u64()?,
            ejected_until_ms: r.u64()?,
            ejections: r.u32()?,
            probation: r.bool()?,
            touched_ms: r.u64()?,
        };
        Some((addr, e))
    }
}

/// Bytes of an entry without its address: six `u32`, five `u64`, one flag, and the address's
/// length prefix.
const ENTRY_MIN_BYTES: usize = 4 + 6 * 4 + 5 * 8 + 1;

/// Every endpoint's entry, as read from (or written to) the store.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HealthView {
    entries: HashMap<String, Entry>,
}

impl HealthView {
    /// Parses the stored value (`crate::base::codec`, tag `Health`: `u32 n · n × (str address ·
    /// the entry's fields)`). An empty, malformed or truncated value reads as empty (the next
    /// write replaces it), and so does one of a version this build does not read.
    pub fn decode(bytes: &[u8]) -> Self {
        Self::read(bytes).unwrap_or_default()
    }

    /// [`HealthView::decode`], but `None` for a value of a version this build does not read
    /// (another build's: never to be overwritten by this one).
    fn read(bytes: &[u8]) -> Option<Self> {
        let mut r = match codec::open(bytes, Tag::Health) {
            Ok(r) => r,
            Err(Refusal::UnknownVersion(_)) => return None,
            Err(Refusal::Malformed) => return Some(Self::default()),
        };
        let read = |r: &mut Reader<'_>| -> Option<HashMap<String, Entry>> {
            let n = r.count(ENTRY_MIN_BYTES, usize::MAX)?;
            let mut entries = HashMap::with_capacity(n.min(MAX_ENTRIES));
            for _ in 0..n {
                let (a, e) = Entry::read(r)?;
                if !a.is_empty() {
                    entries.insert(a, e);
                }
            }
            Some(entries)
        };
        let entries = read(&mut r).filter(|_| r.finish().is_some()).unwrap_or_default();
        Some(Self { entries })
    }

    /// A view holding these entries (tests).
    #[cfg(test)]
    pub fn from_entries(entries: impl IntoIterator<Item = (String, Entry)>) -> Self {
        Self { entries: entries.into_iter().collect() }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut keys: Vec<&String> = self.entries.keys().collect();
        crate::base::sorting::sort(&mut keys);
        let mut w = Writer::new(Tag::Health, 4 + keys.len() * 96);
        w.len(keys.len());
        for k in keys {
            if let Some(e) = self.entries.get(k) {
                e.write(k, &mut w);
            }
        }
        w.finish()
    }

    pub fn entry(&self, addr: &str) -> Option<&Entry> {
        self.entries.get(addr)
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Is `addr` ejected at `now_ms` (before the max-percent limit)?
    pub fn ejected(&self, addr: &str, now_ms: u64) -> bool {
        self.entries.get(addr).is_some_and(|e| e.ejected(now_ms))
    }

    /// Requests to add to `addr`'s in-flight count for its recent failures and 429s.
    pub fn phantom_load(&self, addr: &str, now_ms: u64, cfg: &HealthConfig) -> u32 {
        match self.entries.get(addr) {
            Some(e)
                if cfg.failure_load_ms > 0 && now_ms.saturating_sub(e.last_busy_ms) < cfg.failure_load_ms =>
            {
                e.busy
            }
            _ => 0,
        }
    }

    /// Which of `serving` to leave out at `now_ms`: the ejected ones, earliest ejection first,
    /// at most `max_ejection_percent` % of them (at least one when two or more serve), never all.
    pub fn excluded(&self, serving: &[&str], now_ms: u64, cfg: &HealthConfig) -> Vec<bool> {
        let mut out = vec![false; serving.len()];
        if self.entries.is_empty() || serving.len() < 2 {
            return out;
        }
        let mut ejected: Vec<(u64, usize)> = serving
            .iter()
            .enumerate()
            .filter_map(|(i, a)| {
                self.entries.get(*a).filter(|e| e.ejected(now_ms)).map(|e| (e.ejected_at_ms, i))
            })
            .collect();
        if ejected.is_empty() {
            return out;
        }
        let n = serving.len();
        let by_percent = n * cfg.max_ejection_percent.min(100) as usize / 100;
        let allowed = by_percent.max(1).min(n - 1);
        crate::base::sorting::sort(&mut ejected);
        for &(_, i) in ejected.iter().take(allowed) {
            if let Some(slot) = out.get_mut(i) {
                *slot = true;
            }
        }
        out
    }

    /// Keeps the value bounded: drops clean entries, then the least recently touched beyond
    /// [`MAX_ENTRIES`].
    fn prune(&mut self, now_ms: u64, cfg: &HealthConfig) {
        self.entries.retain(|_, e| !e.is_clean(now_ms, cfg));
        if self.entries.len() > MAX_ENTRIES {
            let mut by_age: Vec<(u64, String)> =
                self.entries.iter().map(|(k, e)| (e.touched_ms, k.clone())).collect();
            crate::base::sorting::sort(&mut by_age);
            let extra = self.entries.len() - MAX_ENTRIES;
            for (_, k) in by_age.into_iter().take(extra) {
                self.entries.remove(&k);
            }
        }
    }

    /// Folds in ejections a worker made itself (see [`Recorder`]).
    fn merge_local(&mut self, local: &HashMap<String, Entry>, now_ms: u64) {
        for (addr, mine) in local {
            if !mine.ejected(now_ms) {
                continue;
            }
            let e = self.entries.entry(addr.clone()).or_default();
            if e.ejected_until_ms < mine.ejected_until_ms {
                e.ejected_at_ms = mine.ejected_at_ms;
                e.ejected_until_ms = mine.ejected_until_ms;
                e.ejections = e.ejections.max(mine.ejections);
                e.probation = true;
                e.touched_ms = e.touched_ms.max(mine.touched_ms);
            }
        }
    }
}

/// `snapshot` without the endpoints passive health leaves out for every model they serve (as
/// the scheduler does, within `max_ejection_percent` per model), for flow control's capacity:
/// an ejected endpoint offers no room. `None` when nothing is left out (no copy made).
pub fn without_ejected(
    snapshot: &Snapshot,
    view: &HealthView,
    now_ms: u64,
    cfg: &HealthConfig,
) -> Option<Snapshot> {
    if view.is_empty() {
        return None;
    }
    let eps = &snapshot.endpoints;
    let mut keep: Vec<bool> = eps.iter().map(|e| e.models.is_empty()).collect();
    let mut models: Vec<&str> = eps.iter().flat_map(|e| e.models.iter().map(String::as_str)).collect();
    crate::base::sorting::sort(&mut models);
    models.dedup();
    for m in models {
        let idx: Vec<usize> =
            (0..eps.len()).filter(|&i| eps.get(i).is_some_and(|e| e.models.iter().any(|x| x == m))).collect();
        let addrs: Vec<&str> = idx.iter().filter_map(|&i| eps.get(i)).map(|e| e.address.as_str()).collect();
        for (&i, gone) in idx.iter().zip(view.excluded(&addrs, now_ms, cfg)) {
            if let Some(k) = keep.get_mut(i) {
                *k |= !gone;
            }
        }
    }
    if keep.iter().all(|k| *k) {
        return None;
    }
    let endpoints = eps.iter().zip(keep).filter(|(_, k)| *k).map(|(e, _)| e.clone()).collect();
    Some(Snapshot { version: snapshot.version, published_ms: snapshot.published_ms, endpoints })
}

/// One worker's side of passive health: records outcomes into the shared view and remembers
/// the ejections it decided (merged back into every read and write, see the module doc).
#[derive(Debug, Default)]
pub struct Recorder {
    local: HashMap<String, Entry>,
    /// This worker's own view while the shared record is another build's (never written).
    shadow: HealthView,
}

impl Recorder {
    pub fn new() -> Self {
        Self::default()
    }

    /// The shared view at `now_ms`, with this worker's own ejections merged in. A read error or
    /// a garbled value gives the local ejections alone.
    pub fn read(&mut self, store: &dyn SharedStore, now_ms: u64) -> Result<HealthView, StoreError> {
        self.local.retain(|_, e| e.ejected(now_ms));
        let got = store.get(HEALTH_KEY);
        let mut view = match &got {
            Ok(Some((v, _))) => HealthView::decode(v),
            _ => HealthView::default(),
        };
        view.merge_local(&self.local, now_ms);
        got.map(|_| view)
    }

    /// Records one outcome for `addr`; returns the ejection it caused, if any.
    pub fn record(
        &mut self,
        store: &dyn SharedStore,
        cfg: &HealthConfig,
        addr: &str,
        outcome: Outcome,
        now_ms: u64,
    ) -> Result<Option<Ejection>, StoreError> {
        if !cfg.enabled || addr.is_empty() {
            return Ok(None);
        }
        self.local.retain(|_, e| e.ejected(now_ms));
        let mut last = StoreError::CasMismatch;
        for _ in 0..MAX_CAS_ATTEMPTS {
            let (stored, mut view, cas) = match store.get(HEALTH_KEY)? {
                Some((v, cas)) => match HealthView::read(&v) {
                    Some(view) => {
                        self.shadow = HealthView::default();
                        (Some(v), view, cas)
                    }
                    None => {
                        // Another build's record: not ours to overwrite. This worker judges the
                        // outcome on what it saw itself (`shadow`, kept while the record stays
                        // unreadable) and keeps an ejection locally.
                        let view = &mut self.shadow;
                        view.merge_local(&self.local, now_ms);
                        let entry = view.entries.entry(addr.to_string()).or_default();
                        let ejection = entry.apply(outcome, now_ms, cfg);
                        let snapshot = *entry;
                        view.prune(now_ms, cfg);
                        if ejection.is_some() {
                            self.local.insert(addr.to_string(), snapshot);
                        }
                        return Ok(ejection);
                    }
                },
                None => (None, HealthView::default(), 0),
            };
            view.merge_local(&self.local, now_ms);
            let entry = view.entries.entry(addr.to_string()).or_default();
            let ejection = entry.apply(outcome, now_ms, cfg);
            let snapshot = *entry;
            view.prune(now_ms, cfg);
            let encoded = view.encode();
            // Most outcomes change nothing stored (a success on an endpoint with no history is
            // pruned at once): skip the write, the hot path's most common shared-data store.
            if ejection.is_none() && stored.as_deref() == Some(encoded.as_slice()) {
                return Ok(None);
            }
            match store.set(HEALTH_KEY, &encoded, cas) {
                Ok(()) => {
                    if ejection.is_some() {
                        self.local.insert(addr.to_string(), snapshot);
                    }
                    return Ok(ejection);
                }
                Err(StoreError::CasMismatch) => last = StoreError::CasMismatch,
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }
}

#[cfg(test)]
mod tests;
