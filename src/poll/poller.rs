//! The poller's pure core: when to scrape which endpoint, what a scrape result means, and the
//! snapshot it publishes. Time and randomness are passed in.
//!
//! The host role (`host::poller`) drives it, once per tick (a quarter of `interval_ms`,
//! [`tick_period_ms`]):
//! 1. `note_inflight(counts)`: this gateway's in-flight requests per endpoint (all workers);
//! 2. `scrapes_due(now)` lists the endpoints to scrape now; the host sends one
//!    `dispatch_http_call` per endpoint through the ORIGINAL_DST metrics cluster;
//! 3. each response (or failure) goes to `on_result_with_inflight`;
//! 4. when `publish_due(now)` the host publishes `snapshot(now)`.
//!
//! # The cadence of one endpoint
//! Each endpoint has its own interval, chosen after each scrape (`F` = `interval_ms`,
//! `R` = `replicas`, `I` = `idle_interval_ms`):
//! - `F` when this gateway has requests in flight there (now or at the scrape), when the scrape
//!   failed, or before the first success;
//! - `F·R` when a decision signal moved since the previous scrape ([`signals_changed`]: queue,
//!   running, KV use by more than [`KV_CHANGE`], LoRA, cache geometry, or this gateway's in-flight
//!   count at the scrape);
//! - otherwise (idle *and* unchanged) twice the previous interval, up to `I·R`.
//!
//! Between ticks, an endpoint that this gateway starts sending to is pulled back to `F` after
//! its last scrape (`note_inflight`). So an idle pool costs one scrape per endpoint per `I`, a
//! pod this gateway loads is polled every `F`, and the live load estimate (`crate::state::load`) covers
//! this gateway's own requests between scrapes. What nobody sees between two slow scrapes is load
//! sent by *other* gateway replicas (or clients that bypass the gateway) to a pod that was idle:
//! at most `I·R` late. That is the trade-off `idle_interval_ms` sets.
//!
//! # Spreading and the cap
//! - A new endpoint's first scrape comes at a random phase within `F`; every later one one
//!   interval after the previous start, less a random jitter (up to half the interval when the
//!   interval changed, else an eighth), so scrapes spread over the interval instead of bursting,
//!   and never come later than one interval.
//! - `max_scrapes_per_s` caps the rate: when the chosen intervals ask for more, every interval
//!   is stretched by the same factor (and published so), and a token bucket holding one tick's
//!   budget sends the most overdue first.
//!
//! # Staleness
//! Each endpoint's effective interval is published with it (`EndpointStatus::poll_ms`): readers
//! judge it stale after `max(stale_after_ms, poll_ms + stale_after_ms / 2)`
//! (`EndpointStatus::stale_limit_ms`), so an idle, slowly polled endpoint is not stale between
//! two scheduled scrapes, while one whose scrape is overdue or failed still is.
//!
//! # Publishing
//! Only when something a decision reads changed (metrics signals, failures, endpoints, an
//! interval), at most once per `F`; and as a heartbeat at least every
//! `max(F, stale_after_ms / 4)` while scrapes confirm unchanged metrics, so the published
//! `scraped_ms` stays within the staleness margin. Readers decode at most one snapshot per `F`.
//!
//! # Failures
//! - At most one scrape per endpoint is outstanding. A scrape with no answer after
//!   `timeout_ms` + [`LOST_CALL_GRACE_MS`] counts as failed (Envoy's own timeout normally fires
//!   first; this covers a callback that never comes).
//! - A failed, slow (timed out), non-200 or unparsable scrape increments `failures` and keeps
//!   the old metrics; any `failures > 0` makes the endpoint stale for the scheduler at once.
//!   Metrics that parse but contain no known routing metric count as failed: reading them as
//!   "idle" would send everything to that endpoint.

use hashbrown::HashMap;

use crate::base::ports::{Rng, SplitMix64};
use crate::poll::config::{KubernetesDiscoveryConfig, PollerConfig, Setup, MIN_INTERVAL_MS};
use crate::poll::discovery::{parse_pod_list_response, DiscoveryError};
use crate::poll::scrape::parse_metrics;
use crate::state::catalog::Role;
use crate::state::metrics::EndpointMetrics;
use crate::state::snapshot::{EndpointStatus, Snapshot};

/// A change of KV use (fraction of the cache) below this is not a change: the KV scorer's
/// weight times this is far below any other score's resolution.
pub const KV_CHANGE: f64 = 0.01;

/// Extra time after the scrape timeout before a missing callback is written off.
pub const LOST_CALL_GRACE_MS: u64 = 1000;

/// What came back from one scrape.
#[derive(Debug, Clone, PartialEq)]
pub enum ScrapeResult<'a> {
    /// HTTP response with status and body.
    Response { status: u32, body: &'a [u8] },
    /// The call failed: reset, connect failure or timeout (Envoy reports 0 headers).
    Failed,
    /// The response body is larger than `poller.max_response_bytes`; it was not read.
    TooLarge { size: usize },
}

/// Why a scrape failed, for the log.
#[derive(Debug, Clone, PartialEq)]
pub enum ScrapeError {
    Status(u32),
    NotUtf8,
    Metrics(String),
    Transport,
    /// Over `poller.max_response_bytes` (the size, not read).
    TooLarge(usize),
    /// Envoy refused to start the call (unknown cluster: BadArgument).
    Dispatch(String),
    /// No callback came within the timeout and its grace.
    Lost,
}

impl ScrapeError {
    /// The `reason` tag of `inference_picker_scrape_failures_total`: a fixed code.
    pub fn reason(&self) -> &'static str {
        match self {
            ScrapeError::Status(_) => "status",
            ScrapeError::NotUtf8 => "not_utf8",
            ScrapeError::Metrics(_) => "metrics",
            ScrapeError::Transport => "transport",
            ScrapeError::TooLarge(_) => "too_large",
            ScrapeError::Dispatch(_) => "dispatch",
            ScrapeError::Lost => "lost",
        }
    }
}

impl std::fmt::Display for ScrapeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ScrapeError::Status(s) => write!(f, "answered HTTP {s}"),
            ScrapeError::NotUtf8 => write!(f, "body is not UTF-8"),
            ScrapeError::Metrics(e) => write!(f, "no usable metrics: {e}"),
            ScrapeError::Transport => write!(f, "call failed (reset, connect failure or timeout)"),
            ScrapeError::TooLarge(n) => {
                write!(f, "response of {n} bytes is over poller.max_response_bytes; not read")
            }
            ScrapeError::Dispatch(s) => {
                write!(f, "Envoy refused the call ({s}): is the cluster defined in Envoy's configuration?")
            }
            ScrapeError::Lost => write!(f, "no answer within the timeout"),
        }
    }
}

/// True when a callout response of `size` bytes may be read under the cap
/// (`poller.max_response_bytes`). The host checks this before copying the body into the VM.
pub fn response_within_cap(size: usize, cap: usize) -> bool {
    size <= cap
}

/// The scrape schedule of one thing polled on its own cadence: when it is due, how often, and
/// whether a call is outstanding. Metrics scrapes use one per endpoint; another kind of poll
/// (the pod list, a model list) keeps its own and draws on the same per-second budget.
#[derive(Debug, Clone, Default)]
pub struct Cadence {
    /// The interval chosen after the last result, before the rate cap's stretch (ms).
    pub interval_ms: u64,
    /// When the next call is due (ms since the epoch); `None` = never scheduled (due at the
    /// next tick after a random phase).
    pub next_due_ms: Option<u64>,
    /// When the outstanding call started, if one is outstanding.
    pub outstanding_since: Option<u64>,
    /// When the last call started.
    pub last_start_ms: Option<u64>,
}

impl Cadence {
    fn start(&mut self, now_ms: u64) {
        self.outstanding_since = Some(now_ms);
        self.last_start_ms = Some(now_ms);
    }

    /// Schedules the next call `interval` after the last start, less a random jitter: up to
    /// half the interval when the interval changed (re-phases endpoints that changed together, so
    /// that a pool going idle at once does not stay in one burst), else up to an eighth (keeps
    /// phases drifting apart). Never later than one interval after the start.
    fn schedule(&mut self, interval_ms: u64, effective_ms: u64, now_ms: u64, rng: &mut SplitMix64) {
        let changed = interval_ms != self.interval_ms;
        self.interval_ms = interval_ms;
        let base = self.last_start_ms.unwrap_or(now_ms);
        let span = if changed { effective_ms / 2 } else { effective_ms / 8 };
        let jitter = if span == 0 { 0 } else { rng.next_u64() % span };
        self.next_due_ms = Some(base.saturating_add(effective_ms - jitter));
    }
}

#[derive(Debug, Clone)]
struct Target {
    status: EndpointStatus,
    cadence: Cadence,
}

/// The decision signals of two scrapes differ: what makes the poller publish and poll faster.
/// KV use is compared to [`KV_CHANGE`]; everything else exactly.
pub fn signals_changed(a: &EndpointMetrics, b: &EndpointMetrics) -> bool {
    let kv_moved = match (a.kv_usage, b.kv_usage) {
        (Some(x), Some(y)) => (x - y).abs() > KV_CHANGE,
        (x, y) => x.is_some() != y.is_some(),
    };
    kv_moved
        || a.engine != b.engine
        || a.queue != b.queue
        || a.running != b.running
        || a.block_size != b.block_size
        || a.num_gpu_blocks != b.num_gpu_blocks
        || a.max_lora != b.max_lora
        || a.running_adapters != b.running_adapters
        || a.waiting_adapters != b.waiting_adapters
}

/// The tick period of the root that polls: a quarter of `poller.interval_ms` (50 ms at the
/// default 200), so that scrapes spread over the interval in four slots, not one burst.
pub fn tick_period_ms(p: &PollerConfig) -> u64 {
    (p.interval_ms / 4).max(MIN_INTERVAL_MS).min(p.interval_ms)
}

#[derive(Debug)]
pub struct Poller {
    targets: Vec<Target>,
    /// Address → position in `targets`: a response finds its endpoint in O(1) (a linear search
    /// per response was O(pool) per scrape).
    index: HashMap<String, usize>,
    version: u64,
    timeout_ms: u64,
    /// `poller.interval_ms`: the fastest cadence (an endpoint this gateway sends to, or that failed).
    fast_ms: u64,
    /// `poller.interval_ms × poller.replicas`: an endpoint whose load moves without this gateway.
    shared_ms: u64,
    /// `poller.idle_interval_ms × poller.replicas`: the slowest (idle and unchanged).
    idle_ms: u64,
    /// `poller.max_scrapes_per_s`.
    max_per_s: u64,
    tick_ms: u64,
    /// Publish at least this often while scrapes confirm the published metrics (ms).
    heartbeat_ms: u64,
    /// Intervals are multiplied by this (≥ 1) when their sum of rates is over the cap.
    stretch: f64,
    /// Scrape budget left (token bucket, refilled at `max_per_s`).
    tokens: f64,
    last_refill_ms: Option<u64>,
    /// Something a decision reads changed since the last publish.
    changed: bool,
    /// A successful scrape since the last publish (its `scraped_ms` is newer than published).
    confirmed: bool,
    last_publish_ms: Option<u64>,
    rng: SplitMix64,
    /// Static endpoints from the configuration; they win over discovered ones.
    static_endpoints: Vec<(String, Vec<String>)>,
    /// Models that discovered pods serve.
    discovered_models: Vec<String>,
    discovery_refresh_ms: Option<u64>,
    last_discovery_ms: Option<u64>,
    discovery_outstanding_since: Option<u64>,
    discovery_timeout_ms: u64,
    /// Scrapes written off as lost (no callback), not yet reported.
    lost: u64,
    /// Endpoint roles (`crate::request::pd`) other than `decode`, from the configuration and the last
    /// pod list (static entries win).
    roles: HashMap<String, Role>,
}

impl Poller {
    /// A poller whose jitter comes from `seed` (the host passes entropy; tests a constant).
    pub fn new<'a>(setup: impl Into<Setup<'a>>) -> Self {
        Self::with_seed(setup, 0x5EED)
    }

    pub fn with_seed<'a>(setup: impl Into<Setup<'a>>, seed: u64) -> Self {
        let setup = setup.into();
        let static_endpoints: Vec<(String, Vec<String>)> =
            setup.catalog.endpoints.iter().map(|e| (e.address.clone(), e.models.clone())).collect();
        let k8s = setup.discovery;
        let discovered_models = match k8s {
            Some(k) if !k.models.is_empty() => k.models.clone(),
            _ => setup.catalog.models.iter().map(|m| m.name.clone()).collect(),
        };
        let pc = setup.poller;
        let replicas = u64::from(pc.replicas.max(1));
        let fast_ms = pc.interval_ms.max(1);
        let shared_ms = fast_ms.saturating_mul(replicas);
        let idle_ms = pc.idle_interval_ms.max(fast_ms).saturating_mul(replicas);
        let mut p = Poller {
            targets: Vec::new(),
            index: HashMap::new(),
            version: 0,
            timeout_ms: pc.timeout_ms,
            fast_ms,
            shared_ms,
            idle_ms,
            max_per_s: u64::from(pc.max_scrapes_per_s.max(1)),
            tick_ms: tick_period_ms(pc),
            heartbeat_ms: fast_ms.max(pc.stale_after_ms / 4),
            stretch: 1.0,
            tokens: 0.0,
            last_refill_ms: None,
            changed: false,
            confirmed: false,
            last_publish_ms: None,
            rng: SplitMix64::new(seed),
            static_endpoints: static_endpoints.clone(),
            discovered_models,
            discovery_refresh_ms: k8s.map(|k| k.refresh_ms),
            last_discovery_ms: None,
            discovery_outstanding_since: None,
            discovery_timeout_ms: k8s.map_or(0, |k| k.timeout_ms),
            lost: 0,
            roles: setup
                .catalog
                .endpoints
                .iter()
                .filter(|e| !e.role.is_decode())
                .map(|e| (e.address.clone(), e.role))
                .collect(),
        };
        p.set_endpoints(static_endpoints);
        p
    }

    /// The scrapes to start at this tick (see the module doc): every endpoint whose next scrape
    /// is due (within half a tick), not outstanding, most overdue first, at most what the
    /// per-second budget allows. Marks them outstanding; expires lost calls first.
    pub fn scrapes_due(&mut self, now_ms: u64) -> Vec<String> {
        self.expire_lost(now_ms);
        self.update_stretch();
        // Refill the budget; it holds at most one tick's worth (at least one scrape), so a
        // backlog is spread over ticks rather than sent at once.
        let per_tick = (self.max_per_s as f64 * self.tick_ms as f64 / 1000.0).max(1.0);
        let elapsed = self.last_refill_ms.map_or(self.tick_ms, |t| now_ms.saturating_sub(t));
        self.tokens = (self.tokens + self.max_per_s as f64 * elapsed as f64 / 1000.0).min(per_tick);
        self.last_refill_ms = Some(now_ms);
        let horizon = now_ms.saturating_add(self.tick_ms / 2);
        let mut due: Vec<(u64, usize)> = Vec::new();
        for (i, t) in self.targets.iter_mut().enumerate() {
            if t.cadence.outstanding_since.is_some() {
                continue;
            }
            let next = *t.cadence.next_due_ms.get_or_insert_with(|| {
                // First scrape: a random phase within one fast interval.
                now_ms.saturating_add(self.rng.next_u64() % self.fast_ms)
            });
            if next <= horizon {
                due.push((next, i));
            }
        }
        let budget = self.tokens.floor().max(0.0) as usize;
        if due.len() > budget {
            crate::base::sorting::sort(&mut due);
            due.truncate(budget);
        }
        self.tokens -= due.len() as f64;
        let mut out = Vec::with_capacity(due.len());
        for (_, i) in due {
            if let Some(t) = self.targets.get_mut(i) {
                t.cadence.start(now_ms);
                out.push(t.status.address.clone());
            }
        }
        out
    }

    /// The rate cap: when the endpoints' chosen intervals add up to more than
    /// `max_scrapes_per_s`, every interval is stretched by the same factor.
    fn update_stretch(&mut self) {
        let rate: f64 = self.targets.iter().map(|t| 1000.0 / self.interval_of(t) as f64).sum();
        self.stretch = (rate / self.max_per_s as f64).max(1.0);
    }

    fn interval_of(&self, t: &Target) -> u64 {
        if t.cadence.interval_ms == 0 {
            self.fast_ms
        } else {
            t.cadence.interval_ms
        }
    }

    fn effective(&self, interval_ms: u64) -> u64 {
        (interval_ms as f64 * self.stretch).ceil() as u64
    }

    /// This gateway's in-flight counts now (all workers). An endpoint with requests from this
    /// gateway in flight, or whose count moved since its last scrape, is due one fast interval
    /// after its last scrape: its load moves, and the live estimate only covers this gateway.
    pub fn note_inflight(&mut self, count: impl Fn(&str) -> u32) {
        for t in &mut self.targets {
            let now_count = count(&t.status.address);
            if now_count == 0 && t.status.inflight_at_scrape.unwrap_or(0) == 0 {
                continue;
            }
            if t.cadence.interval_ms > self.fast_ms {
                t.cadence.interval_ms = self.fast_ms;
                if let (Some(start), Some(next)) = (t.cadence.last_start_ms, t.cadence.next_due_ms) {
                    t.cadence.next_due_ms = Some(next.min(start.saturating_add(self.fast_ms)));
                }
            }
        }
    }

    /// Something the snapshot carries changed outside the scrapes (e.g. a pod's learned model
    /// list, `crate::poll::pod_models`): publish at the next [`Poller::publish_due`].
    pub fn mark_changed(&mut self) {
        self.changed = true;
    }

    /// True when the snapshot should be published now: something a decision reads changed
    /// and one `interval_ms` has passed since the last publish, or scrapes confirmed the
    /// published metrics and the heartbeat (`max(interval_ms, stale_after_ms / 4)`) has passed
    /// (readers judge staleness by the published `scraped_ms`).
    pub fn publish_due(&self, now_ms: u64) -> bool {
        let since = self.last_publish_ms.map_or(u64::MAX, |t| now_ms.saturating_sub(t));
        (self.changed && since >= self.fast_ms) || (self.confirmed && since >= self.heartbeat_ms)
    }

    /// True when the pod list should be fetched now (marks the fetch outstanding).
    pub fn discovery_due(&mut self, now_ms: u64) -> bool {
        let Some(refresh) = self.discovery_refresh_ms else {
            return false;
        };
        if let Some(since) = self.discovery_outstanding_since {
            if now_ms.saturating_sub(since) <= self.discovery_timeout_ms + LOST_CALL_GRACE_MS {
                return false;
            }
        }
        if let Some(last) = self.last_discovery_ms {
            if now_ms < last.saturating_add(refresh) {
                return false;
            }
        }
        self.last_discovery_ms = Some(now_ms);
        self.discovery_outstanding_since = Some(now_ms);
        true
    }

    /// Applies a pod-list response: on success the endpoint set becomes the static endpoints
    /// plus the discovered ones (static entries win on a duplicate address); on any error the
    /// previous set is kept. Returns the number of endpoints now polled.
    pub fn on_discovery(
        &mut self,
        k8s: &KubernetesDiscoveryConfig,
        status: Option<u32>,
        body: &[u8],
    ) -> Result<usize, DiscoveryError> {
        self.discovery_outstanding_since = None;
        let discovered = parse_pod_list_response(status.unwrap_or(0), body, k8s)?;
        let mut next = self.static_endpoints.clone();
        self.roles.retain(|a, _| next.iter().any(|(s, _)| s == a));
        for e in discovered.endpoint_configs(&self.discovered_models) {
            if !next.iter().any(|(a, _)| *a == e.address) {
                if !e.role.is_decode() {
                    self.roles.insert(e.address.clone(), e.role);
                }
                next.push((e.address, e.models));
            }
        }
        let n = next.len();
        self.set_endpoints(next);
        Ok(n)
    }

    /// The addresses of the endpoints polled now.
    pub fn addresses(&self) -> impl Iterator<Item = &str> {
        self.targets.iter().map(|t| t.status.address.as_str())
    }

    /// Forgets outstanding scrapes (a lease holder that lost its lease ignores their answers).
    /// The next holder starts from a fresh schedule.
    pub fn abandon_outstanding(&mut self) {
        for t in &mut self.targets {
            t.cadence = Cadence::default();
        }
        self.discovery_outstanding_since = None;
        self.last_publish_ms = None;
        self.changed = true;
    }

    /// Replaces the endpoint list (static config or discovery), keeping the state of endpoints
    /// that stay.
    pub fn set_endpoints(&mut self, endpoints: Vec<(String, Vec<String>)>) {
        let mut next = Vec::with_capacity(endpoints.len());
        let before = self.targets.len();
        let mut kept_all = true;
        let mut old: HashMap<String, Target> =
            self.targets.drain(..).map(|t| (t.status.address.clone(), t)).collect();
        for (address, models) in endpoints {
            let role = self.roles.get(&address).copied().unwrap_or_default();
            let target = match old.remove(&address) {
                Some(mut t) => {
                    if t.status.models != models || t.status.role != role {
                        kept_all = false;
                        t.status.models = models;
                        t.status.role = role;
                    }
                    t
                }
                None => {
                    kept_all = false;
                    Target {
                        status: EndpointStatus {
                            role,
                            address,
                            models,
                            metrics: None,
                            scraped_ms: 0,
                            failures: 0,
                            inflight_at_scrape: None,
                            poll_ms: 0,
                        },
                        cadence: Cadence::default(),
                    }
                }
            };
            next.push(target);
        }
        if !kept_all || next.len() != before || !old.is_empty() {
            self.changed = true;
        }
        self.targets = next;
        self.index = self.targets.iter().enumerate().map(|(i, t)| (t.status.address.clone(), i)).collect();
    }

    /// Every endpoint not outstanding, now, ignoring the cadence and the budget (a forced round:
    /// tests and the replay's fixed-interval mode). Marks them outstanding; expires calls that
    /// never answered (counted in [`Poller::take_lost`]).
    pub fn due(&mut self, now_ms: u64) -> Vec<String> {
        self.expire_lost(now_ms);
        let mut out = Vec::new();
        for t in &mut self.targets {
            if t.cadence.outstanding_since.is_none() {
                t.cadence.start(now_ms);
                out.push(t.status.address.clone());
            }
        }
        out
    }

    /// Writes off calls with no answer after the timeout and its grace: a failure, due again.
    fn expire_lost(&mut self, now_ms: u64) {
        for t in &mut self.targets {
            if let Some(since) = t.cadence.outstanding_since {
                if now_ms.saturating_sub(since) > self.timeout_ms + LOST_CALL_GRACE_MS {
                    t.cadence.outstanding_since = None;
                    t.cadence.next_due_ms = Some(now_ms);
                    t.cadence.interval_ms = self.fast_ms;
                    if t.status.failures == 0 {
                        self.changed = true;
                    }
                    t.status.failures = t.status.failures.saturating_add(1);
                    t.status.poll_ms = self.fast_ms;
                    self.lost = self.lost.saturating_add(1);
                }
            }
        }
    }

    /// Scrapes written off as lost since the last call (for the failure metric).
    pub fn take_lost(&mut self) -> u64 {
        std::mem::take(&mut self.lost)
    }

    /// The pod-list call could not be used without reaching [`Poller::on_discovery`] (Envoy
    /// refused to start it, or its answer was over the size cap): keep the previous endpoints,
    /// and try again at the next refresh.
    pub fn discovery_failed(&mut self) {
        self.discovery_outstanding_since = None;
    }

    /// The host could not even start the call (e.g. unknown cluster): count it as failed.
    pub fn dispatch_failed(&mut self, address: &str, now_ms: u64) {
        let _ = self.on_result(address, now_ms, ScrapeResult::Failed);
    }

    /// Records a scrape result. Unknown addresses (removed meanwhile) are ignored.
    pub fn on_result(
        &mut self,
        address: &str,
        now_ms: u64,
        result: ScrapeResult<'_>,
    ) -> Result<(), ScrapeError> {
        self.on_result_with_inflight(address, now_ms, None, result)
    }

    /// [`Poller::on_result`], with this gateway's in-flight count to the endpoint (all workers)
    /// read when the response arrived: kept with a successful scrape's metrics as
    /// `EndpointStatus::inflight_at_scrape`, the base of the live load estimate (`crate::state::load`).
    /// Chooses the endpoint's next interval (see the module doc).
    pub fn on_result_with_inflight(
        &mut self,
        address: &str,
        now_ms: u64,
        inflight_at_scrape: Option<u32>,
        result: ScrapeResult<'_>,
    ) -> Result<(), ScrapeError> {
        let Some(&i) = self.index.get(address) else {
            return Ok(());
        };
        let parsed = match result {
            ScrapeResult::Failed => Err(ScrapeError::Transport),
            ScrapeResult::TooLarge { size } => Err(ScrapeError::TooLarge(size)),
            ScrapeResult::Response { status, .. } if status != 200 => Err(ScrapeError::Status(status)),
            ScrapeResult::Response { body, .. } => match std::str::from_utf8(body) {
                Err(_) => Err(ScrapeError::NotUtf8),
                Ok(text) => parse_metrics(text).map_err(|e| ScrapeError::Metrics(e.to_string())),
            },
        };
        let (fast, shared, idle) = (self.fast_ms, self.shared_ms, self.idle_ms);
        let stretch = self.stretch;
        let Some(t) = self.targets.get_mut(i) else {
            return Ok(());
        };
        t.cadence.outstanding_since = None;
        let (interval, out) = match parsed {
            Ok(m) => {
                let moved = t.status.failures > 0
                    || t.status.metrics.as_ref().is_none_or(|old| signals_changed(old, &m))
                    || t.status.inflight_at_scrape != inflight_at_scrape;
                let ours = inflight_at_scrape.unwrap_or(0) > 0;
                let interval = if ours {
                    fast
                } else if moved {
                    shared
                } else {
                    t.cadence.interval_ms.max(shared).saturating_mul(2).min(idle)
                };
                self.changed |= moved;
                self.confirmed = true;
                t.status.metrics = Some(m);
                t.status.scraped_ms = now_ms;
                t.status.failures = 0;
                t.status.inflight_at_scrape = inflight_at_scrape;
                (interval, Ok(()))
            }
            Err(e) => {
                self.changed |= t.status.failures == 0;
                t.status.failures = t.status.failures.saturating_add(1);
                (fast, Err(e))
            }
        };
        let effective = (interval as f64 * stretch).ceil() as u64;
        if t.status.poll_ms != effective {
            // Readers' staleness limit follows it: publish.
            self.changed = true;
            t.status.poll_ms = effective;
        }
        t.cadence.schedule(interval, effective.max(1), now_ms, &mut self.rng);
        out
    }

    /// True when no scrape is outstanding.
    pub fn round_complete(&self) -> bool {
        self.targets.iter().all(|t| t.cadence.outstanding_since.is_none())
    }

    /// The next snapshot to publish (bumps the version; marks it published at `now_ms`).
    pub fn snapshot(&mut self, now_ms: u64) -> Snapshot {
        self.version += 1;
        self.changed = false;
        self.confirmed = false;
        self.last_publish_ms = Some(now_ms);
        Snapshot {
            version: self.version,
            published_ms: now_ms,
            endpoints: self.targets.iter().map(|t| t.status.clone()).collect(),
        }
    }

    /// Scrapes per second the current schedule asks for (after the cap's stretch), for the log.
    pub fn planned_rate(&self) -> f64 {
        self.targets.iter().map(|t| 1000.0 / self.effective(self.interval_of(t)).max(1) as f64).sum()
    }

    /// Continues the version sequence after a VM restart, so readers see a change.
    pub fn resume_version_after(&mut self, version: u64) {
        self.version = self.version.max(version);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    const VLLM: &[u8] = b"# TYPE vllm:num_requests_waiting gauge\n\
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3\n\
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 5\n\
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n";

    fn cfg() -> Config {
        Config::from_json(
            br#"{"version":1,"endpoints":[{"address":"127.0.0.1:8001","models":["m"]},{"address":"127.0.0.1:8002","models":["m"]}],"models":[{"name":"m"}],"poller":{"timeout_ms":100}}"#,
        )
        .unwrap()
    }

    #[test]
    fn a_round_scrapes_everything_once_then_publishes() {
        let mut p = Poller::new(&cfg());
        assert_eq!(p.due(1000), vec!["127.0.0.1:8001", "127.0.0.1:8002"]);
        // Both outstanding: nothing new is due on the next tick.
        assert!(p.due(1200).is_empty());
        assert!(!p.round_complete());
        p.on_result("127.0.0.1:8001", 1010, ScrapeResult::Response { status: 200, body: VLLM }).unwrap();
        p.on_result("127.0.0.1:8002", 1020, ScrapeResult::Failed).unwrap_err();
        assert!(p.round_complete());
        let s = p.snapshot(1020);
        assert_eq!(s.version, 1);
        let a = &s.endpoints[0];
        assert_eq!((a.scraped_ms, a.failures), (1010, 0));
        assert_eq!(a.metrics.as_ref().unwrap().queue, Some(3.0));
        assert!(a.is_fresh(1020, 1000));
        let b = &s.endpoints[1];
        assert_eq!((b.scraped_ms, b.failures, b.metrics.is_none()), (0, 1, true));
        assert_eq!(p.snapshot(1030).version, 2);
    }

    #[test]
    fn an_oversize_response_fails_the_scrape_and_keeps_the_old_metrics() {
        let mut p = Poller::new(&cfg());
        p.due(0);
        p.on_result("127.0.0.1:8001", 10, ScrapeResult::Response { status: 200, body: VLLM }).unwrap();
        p.due(200);
        let e = p.on_result("127.0.0.1:8001", 210, ScrapeResult::TooLarge { size: 5 << 20 }).unwrap_err();
        assert_eq!(e, ScrapeError::TooLarge(5 << 20));
        assert_eq!(e.reason(), "too_large");
        assert!(e.to_string().contains("max_response_bytes"));
        let s = p.snapshot(210);
        assert_eq!((s.endpoints[0].failures, s.endpoints[0].metrics.is_some()), (1, true));
        assert!(response_within_cap(4 << 20, 4 << 20));
        assert!(!response_within_cap((4 << 20) + 1, 4 << 20));
    }

    #[test]
    fn lost_calls_are_counted_once_for_the_metric() {
        let mut p = Poller::new(&cfg());
        p.due(0);
        assert_eq!(p.take_lost(), 0);
        // timeout 100 + grace: written off at the next due() after that.
        p.due(100 + LOST_CALL_GRACE_MS + 1);
        assert_eq!(p.take_lost(), 2);
        assert_eq!(p.take_lost(), 0);
        assert_eq!(ScrapeError::Lost.reason(), "lost");
        assert!(ScrapeError::Dispatch("BadArgument".into()).to_string().contains("cluster"));
    }

    #[test]
    fn failures_keep_old_metrics_but_make_the_endpoint_stale() {
        let mut p = Poller::new(&cfg());
        p.due(0);
        p.on_result("127.0.0.1:8001", 10, ScrapeResult::Response { status: 200, body: VLLM }).unwrap();
        p.due(200);
        assert_eq!(
            p.on_result("127.0.0.1:8001", 210, ScrapeResult::Response { status: 500, body: b"" }),
            Err(ScrapeError::Status(500))
        );
        p.due(400);
        assert!(matches!(
            p.on_result("127.0.0.1:8001", 410, ScrapeResult::Response { status: 200, body: b"garbage\n" }),
            Err(ScrapeError::Metrics(_))
        ));
        p.due(600);
        assert_eq!(
            p.on_result("127.0.0.1:8001", 610, ScrapeResult::Response { status: 200, body: b"\xff\xfe" }),
            Err(ScrapeError::NotUtf8)
        );
        let e = p.snapshot(610).endpoints[0].clone();
        assert_eq!((e.failures, e.scraped_ms), (3, 10));
        assert!(e.metrics.is_some());
        assert!(!e.is_fresh(610, 1000));
        // One good scrape heals it.
        p.due(800);
        p.on_result("127.0.0.1:8001", 810, ScrapeResult::Response { status: 200, body: VLLM }).unwrap();
        assert!(p.snapshot(810).endpoints[0].is_fresh(810, 1000));
    }

    #[test]
    fn inflight_at_scrape_follows_the_successful_scrape_only() {
        let mut p = Poller::new(&cfg());
        p.due(0);
        let ok = ScrapeResult::Response { status: 200, body: VLLM };
        p.on_result_with_inflight("127.0.0.1:8001", 10, Some(4), ok).unwrap();
        assert_eq!(p.snapshot(10).endpoints[0].inflight_at_scrape, Some(4));
        // A failed scrape keeps the metrics and the count they were taken with.
        p.due(200);
        let failed = ScrapeResult::Response { status: 500, body: b"" };
        assert!(p.on_result_with_inflight("127.0.0.1:8001", 210, Some(9), failed).is_err());
        assert_eq!(p.snapshot(210).endpoints[0].inflight_at_scrape, Some(4));
        // A success without a count (the store could not be read) clears it: snapshot only.
        p.due(400);
        p.on_result("127.0.0.1:8001", 410, ScrapeResult::Response { status: 200, body: VLLM }).unwrap();
        assert_eq!(p.snapshot(410).endpoints[0].inflight_at_scrape, None);
    }

    #[test]
    fn lost_callbacks_are_written_off_after_timeout_plus_grace() {
        let mut p = Poller::new(&cfg());
        p.due(0);
        // timeout 100 + grace 1000: still outstanding at 1100, written off after.
        assert!(p.due(1100).is_empty());
        assert_eq!(p.due(1101).len(), 2);
        assert!(p.snapshot(1101).endpoints.iter().all(|e| e.failures == 1));
    }

    #[test]
    fn endpoint_changes_keep_state_and_ignore_late_results() {
        let mut p = Poller::new(&cfg());
        p.due(0);
        p.on_result("127.0.0.1:8001", 5, ScrapeResult::Response { status: 200, body: VLLM }).unwrap();
        p.set_endpoints(vec![
            ("127.0.0.1:8001".into(), vec!["m".into()]),
            ("127.0.0.1:8003".into(), vec!["m".into()]),
        ]);
        // A late answer from a removed endpoint is ignored.
        p.on_result("127.0.0.1:8002", 6, ScrapeResult::Failed).unwrap();
        let s = p.snapshot(6);
        assert_eq!(s.endpoints.len(), 2);
        assert_eq!(s.endpoints[0].scraped_ms, 5);
        assert_eq!(s.endpoints[1].address, "127.0.0.1:8003");
        p.dispatch_failed("127.0.0.1:8003", 7);
        assert_eq!(p.snapshot(7).endpoints[1].failures, 1);
    }

    fn cfg_with(poller: &str, n: usize) -> Config {
        let eps: Vec<String> = (0..n)
            .map(|i| format!(r#"{{"address":"10.0.{}.{}:8000","models":["m"]}}"#, i / 250, i % 250))
            .collect();
        Config::from_json(
            format!(
                r#"{{"version":1,"endpoints":[{}],"models":[{{"name":"m"}}],"poller":{poller}}}"#,
                eps.join(",")
            )
            .as_bytes(),
        )
        .unwrap()
    }

    fn ok(p: &mut Poller, a: &str, now: u64, inflight: Option<u32>, body: &[u8]) {
        p.on_result_with_inflight(a, now, inflight, ScrapeResult::Response { status: 200, body }).unwrap();
    }

    /// The tests below were written for a 2 s idle interval (the shipped default is 5 s).
    const IDLE_2S: &str = r#"{"idle_interval_ms":2000}"#;

    const IDLE: &[u8] =
        b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n";
    const BUSY: &[u8] =
        b"vllm:num_requests_waiting 2\nvllm:num_requests_running 4\nvllm:kv_cache_usage_perc 0.5\n";

    /// Drives one endpoint through ticks of `tick` ms until `until`, answering every scrape at
    /// once with `body`; returns the start times of its scrapes.
    fn drive(
        p: &mut Poller,
        from: u64,
        until: u64,
        tick: u64,
        body: &[u8],
        inflight: Option<u32>,
    ) -> Vec<u64> {
        let mut starts = Vec::new();
        let mut now = from;
        while now < until {
            for a in p.scrapes_due(now) {
                starts.push(now);
                ok(p, &a, now, inflight, body);
            }
            now += tick;
        }
        starts
    }

    #[test]
    fn an_idle_unchanged_endpoint_backs_off_to_the_idle_interval_and_a_change_brings_it_back() {
        // interval 200, idle 2000 (defaults); tick 50.
        let mut p = Poller::new(&cfg_with(IDLE_2S, 1));
        let starts = drive(&mut p, 0, 20_000, 50, IDLE, Some(0));
        let gaps: Vec<u64> = starts.windows(2).map(|w| w[1] - w[0]).collect();
        // Never longer than the chosen interval; the last gaps are near 2000 (jitter ≤ 1/8).
        assert!(gaps.iter().all(|g| *g <= 2000), "{gaps:?}");
        assert!(gaps[gaps.len() - 3..].iter().all(|g| *g >= 1700), "{gaps:?}");
        assert_eq!(p.snapshot(20_000).endpoints[0].poll_ms, 2000);
        // The load moves: the next interval is the fast one again.
        let last = *starts.last().unwrap();
        let next = drive(&mut p, 20_000, 40_000, 50, BUSY, Some(0));
        assert!(next[0] - last <= 2000);
        assert!(next[1] - next[0] <= 200, "{next:?}");
        // Signals that stay the same back off again, busy or not (no request of this gateway there).
        assert_eq!(p.snapshot(40_000).endpoints[0].poll_ms, 2000);
    }

    #[test]
    fn requests_of_this_gateway_pull_an_idle_endpoint_back_to_the_fast_interval() {
        let mut p = Poller::new(&cfg_with(IDLE_2S, 1));
        let starts = drive(&mut p, 0, 20_000, 50, IDLE, Some(0));
        let last = *starts.last().unwrap();
        // This gateway sends a request there right after the last scrape.
        p.note_inflight(|_| 1);
        let due_at = (last..last + 2000).step_by(50).find(|t| !p.scrapes_due(*t).is_empty());
        assert!(due_at.is_some_and(|t| t <= last + 200 + 25), "{due_at:?} after {last}");
        // Without requests in flight nothing changes.
        let mut q = Poller::new(&cfg_with(IDLE_2S, 1));
        let starts = drive(&mut q, 0, 20_000, 50, IDLE, Some(0));
        let last = *starts.last().unwrap();
        q.note_inflight(|_| 0);
        assert!((last + 50..last + 1500).step_by(50).all(|t| q.scrapes_due(t).is_empty()));
        // An endpoint with requests in flight at its scrape stays at the fast interval.
        let mut r = Poller::new(&cfg_with(IDLE_2S, 1));
        let starts = drive(&mut r, 0, 5000, 50, IDLE, Some(3));
        assert!(starts.windows(2).all(|w| w[1] - w[0] <= 200), "{starts:?}");
    }

    #[test]
    fn first_scrapes_spread_over_one_interval_and_the_cap_bounds_each_tick() {
        // 400 endpoints, cap 1000/s: a 50 ms tick may start at most 50 scrapes.
        let mut p = Poller::new(&cfg_with(r#"{"max_scrapes_per_s":1000}"#, 400));
        let mut per_tick = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for k in 0..40 {
            let due = p.scrapes_due(k * 50);
            per_tick.push(due.len());
            for a in due {
                seen.insert(a.clone());
                ok(&mut p, &a, k * 50, Some(0), BUSY);
            }
        }
        assert!(per_tick.iter().all(|n| *n <= 50), "{per_tick:?}");
        assert_eq!(seen.len(), 400);
        // Rates asked: 400 endpoints at 200..400 ms > 1000/s: intervals stretched and published so.
        let s = p.snapshot(2000);
        assert!(s.endpoints.iter().all(|e| e.poll_ms >= 400), "{:?}", s.endpoints[0].poll_ms);
        assert!(p.planned_rate() <= 1000.0 + 1.0, "{}", p.planned_rate());
        // Without a binding cap, 8 endpoints' first scrapes come within one interval, not at once.
        let mut q = Poller::new(&cfg_with("{}", 8));
        let firsts: Vec<usize> = (0..5).map(|k| q.scrapes_due(k * 50).len()).collect();
        assert_eq!(firsts.iter().sum::<usize>(), 8);
        assert!(firsts.iter().all(|n| *n < 8), "{firsts:?}");
    }

    #[test]
    fn replicas_scale_the_intervals_of_endpoints_this_gateway_does_not_load() {
        let mut p = Poller::new(&cfg_with(r#"{"replicas":4,"idle_interval_ms":2000}"#, 1));
        drive(&mut p, 0, 60_000, 50, IDLE, Some(0));
        assert_eq!(p.snapshot(60_000).endpoints[0].poll_ms, 8000);
        // Moving load without this gateway: interval × replicas; with its requests: interval.
        let mut q = Poller::new(&cfg_with(r#"{"replicas":4,"idle_interval_ms":2000}"#, 1));
        ok(&mut q, "10.0.0.0:8000", 10, Some(0), IDLE);
        ok(&mut q, "10.0.0.0:8000", 20, Some(0), BUSY);
        assert_eq!(q.snapshot(20).endpoints[0].poll_ms, 800);
        ok(&mut q, "10.0.0.0:8000", 30, Some(2), BUSY);
        assert_eq!(q.snapshot(30).endpoints[0].poll_ms, 200);
    }

    #[test]
    fn publishes_on_change_at_most_once_per_interval_and_as_a_heartbeat_otherwise() {
        let mut p = Poller::new(&cfg_with(IDLE_2S, 1));
        let a = "10.0.0.0:8000";
        assert!(p.publish_due(0), "the first endpoints are a change");
        p.snapshot(0);
        assert!(!p.publish_due(10));
        ok(&mut p, a, 100, Some(0), IDLE);
        // A change, but less than one interval since the last publish.
        assert!(!p.publish_due(150));
        assert!(p.publish_due(200));
        p.snapshot(200);
        // Unchanged metrics, same interval: only the heartbeat (max(200, 1000/4) = 250 ms).
        ok(&mut p, a, 300, Some(0), IDLE);
        ok(&mut p, a, 420, Some(0), IDLE);
        p.snapshot(420); // the interval grew (a change for readers' staleness)
        ok(&mut p, a, 500, Some(0), IDLE);
        let poll = p.snapshot(500).endpoints[0].poll_ms;
        ok(&mut p, a, 600, Some(0), IDLE);
        let unchanged_interval = p.snapshot(600).endpoints[0].poll_ms == poll;
        if unchanged_interval {
            ok(&mut p, a, 700, Some(0), IDLE);
            assert!(!p.publish_due(849));
            assert!(p.publish_due(850));
        }
        // Nothing scraped since the last publish: nothing to publish.
        p.snapshot(900);
        assert!(!p.publish_due(5000));
        // A failure is a change.
        p.on_result(a, 5000, ScrapeResult::Failed).unwrap_err();
        assert!(p.publish_due(5000));
    }

    #[test]
    fn a_slowly_polled_idle_endpoint_stays_fresh_between_scrapes_and_goes_stale_when_overdue() {
        let mut p = Poller::new(&cfg_with(IDLE_2S, 1));
        let starts = drive(&mut p, 0, 20_000, 50, IDLE, Some(0));
        let last = *starts.last().unwrap();
        let e = p.snapshot(last).endpoints[0].clone();
        assert_eq!(e.poll_ms, 2000);
        // stale_after_ms 1000 alone would call it stale 1 s after the scrape.
        assert!(e.is_fresh(last + 1900, 1000));
        assert!(e.is_fresh(last + 2500, 1000));
        assert!(!e.is_fresh(last + 2501, 1000));
        // The scheduler and saturation read the same limit.
        assert!(crate::scheduler::filter::healthy(&e, last + 2400, 1000));
        assert!(!crate::scheduler::filter::healthy(&e, last + 2600, 1000));
    }

    #[test]
    fn signal_changes() {
        let m = crate::poll::scrape::parse_metrics(std::str::from_utf8(BUSY).unwrap()).unwrap();
        let kv = |v| EndpointMetrics { kv_usage: Some(v), ..m.clone() };
        assert!(!signals_changed(&m, &m));
        assert!(!signals_changed(&m, &kv(0.505)));
        assert!(signals_changed(&m, &kv(0.52)));
        assert!(signals_changed(&m, &EndpointMetrics { queue: Some(3.0), ..m.clone() }));
        assert!(signals_changed(&m, &EndpointMetrics { kv_usage: None, ..m.clone() }));
        assert!(signals_changed(&m, &EndpointMetrics { running_adapters: vec!["a".into()], ..m.clone() }));
        let pc = crate::poll::config::PollerConfig::default();
        assert_eq!(tick_period_ms(&pc), 50);
        assert_eq!(tick_period_ms(&crate::poll::config::PollerConfig { interval_ms: 10, ..pc }), 10);
    }

    fn k8s_cfg() -> Config {
        Config::from_json(
            br#"{"version":1,"endpoints":[{"address":"127.0.0.1:8001","models":["m"]}],"models":[{"name":"m"}],
                "discovery":{"kubernetes":{"namespace":"llm","selector":{"app":"vllm"},"target_ports":[8000],
                "api_cluster":"kubernetes_api","api_authority":"kubernetes.default.svc","refresh_ms":5000,"timeout_ms":1000}}}"#,
        )
        .unwrap()
    }

    fn pod_list(ips: &[&str]) -> Vec<u8> {
        let items: Vec<String> = ips
            .iter()
            .enumerate()
            .map(|(i, ip)| {
                format!(
                    r#"{{"metadata":{{"name":"p{i}","namespace":"llm","labels":{{"app":"vllm"}}}},
                       "status":{{"phase":"Running","podIP":"{ip}","conditions":[{{"type":"Ready","status":"True"}}]}}}}"#
                )
            })
            .collect();
        format!(
            r#"{{"kind":"PodList","apiVersion":"v1","metadata":{{"resourceVersion":"7"}},"items":[{}]}}"#,
            items.join(",")
        )
        .into_bytes()
    }

    #[test]
    fn discovery_merges_with_static_endpoints_and_keeps_state() {
        let cfg = k8s_cfg();
        let k = &cfg.discovery.as_ref().unwrap().kubernetes;
        let mut p = Poller::new(&cfg);
        assert!(p.discovery_due(0));
        // Outstanding: not due again until it answers (or times out: 1000 + grace 1000).
        assert!(!p.discovery_due(1500));
        assert_eq!(p.on_discovery(k, Some(200), &pod_list(&["10.1.0.5", "10.1.0.6"])).unwrap(), 3);
        p.due(10);
        p.on_result("10.1.0.5:8000", 20, ScrapeResult::Response { status: 200, body: VLLM }).unwrap();
        // Refresh every 5000 ms; pod 10.1.0.6 went away, 10.1.0.7 joined; 10.1.0.5 keeps its state.
        assert!(!p.discovery_due(4999));
        assert!(p.discovery_due(5000));
        assert_eq!(p.on_discovery(k, Some(200), &pod_list(&["10.1.0.5", "10.1.0.7"])).unwrap(), 3);
        let s = p.snapshot(5001);
        let addrs: Vec<&str> = s.endpoints.iter().map(|e| e.address.as_str()).collect();
        assert_eq!(addrs, ["127.0.0.1:8001", "10.1.0.5:8000", "10.1.0.7:8000"]);
        assert_eq!(s.endpoints[1].scraped_ms, 20);
        assert_eq!(s.endpoints[2].models, ["m"]);
        // Errors keep the previous set.
        assert!(p.discovery_due(10_000));
        assert!(p.on_discovery(k, Some(403), b"{}").is_err());
        assert!(p.discovery_due(15_000));
        assert!(p.on_discovery(k, None, b"").is_err());
        assert_eq!(p.snapshot(15_001).endpoints.len(), 3);
    }

    #[test]
    fn a_discovery_that_could_not_be_used_keeps_the_endpoints_and_retries_at_the_next_refresh() {
        // Envoy refused the call, or the pod list was over poller.max_response_bytes.
        let cfg = k8s_cfg();
        let k = &cfg.discovery.as_ref().unwrap().kubernetes;
        let mut p = Poller::new(&cfg);
        assert!(p.discovery_due(0));
        p.on_discovery(k, Some(200), &pod_list(&["10.1.0.5"])).unwrap();
        assert!(p.discovery_due(5000));
        p.discovery_failed();
        // No longer outstanding, but the refresh cadence still applies.
        assert!(!p.discovery_due(5001));
        assert!(p.discovery_due(10_000));
        assert_eq!(p.snapshot(10_001).endpoints.len(), 2);
        assert_eq!(DiscoveryError::Status(403).reason(), "status");
        assert_eq!(DiscoveryError::WrongKind("Status".into()).reason(), "bad_body");
    }

    #[test]
    fn abandoning_outstanding_scrapes_allows_a_fresh_schedule() {
        let mut p = Poller::new(&cfg());
        assert_eq!((0..5).map(|k| p.scrapes_due(k * 50).len()).sum::<usize>(), 2);
        assert!((5..20).all(|k| p.scrapes_due(k * 50).is_empty()), "outstanding: never twice");
        p.abandon_outstanding();
        assert_eq!((40..45).map(|k| p.scrapes_due(k * 50).len()).sum::<usize>(), 2);
    }
}
