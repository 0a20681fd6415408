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
mod tests;
