//! The poller's pure core: when to scrape which endpoint, what a scrape result means, and the
//! snapshot it publishes.
//!
//! The host role (`host::poller`) drives it:
//! 1. every tick, `due(now)` lists the endpoints to scrape; the host sends one
//!    `dispatch_http_call` per endpoint through the ORIGINAL_DST metrics cluster;
//! 2. each response (or failure) goes to `on_result`;
//! 3. when `round_complete()` (or at the next tick, whichever comes first) the host publishes
//!    `snapshot(now)`.
//!
//! Rules:
//! - At most one scrape per endpoint is outstanding. A scrape with no answer after
//!   `timeout_ms` + [`LOST_CALL_GRACE_MS`] counts as failed (Envoy's own timeout normally fires
//!   first; this covers a callback that never comes).
//! - A failed, slow (timed out), non-200 or unparsable scrape increments `failures` and keeps
//!   the old metrics; any `failures > 0` makes the endpoint stale for the scheduler at once.
//!   Metrics that parse but contain no known routing metric count as failed: reading them as
//!   "idle" would send everything to that endpoint.
//! - Publishing once per round (not per response) bounds snapshot writes to one per interval,
//!   and each worker decodes at most one snapshot per interval.

use crate::config::{Config, KubernetesDiscoveryConfig};
use crate::discovery::{parse_pod_list_response, DiscoveryError};
use crate::metrics::parse_metrics;
use crate::pd::Role;
use crate::snapshot::{EndpointStatus, Snapshot};
use hashbrown::HashMap;

/// How early a tick may fire and still start the next round (ms).
pub const ROUND_JITTER_MS: u64 = 20;

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

#[derive(Debug, Clone)]
struct Target {
    status: EndpointStatus,
    /// When the outstanding scrape started, if one is outstanding.
    outstanding_since: Option<u64>,
}

#[derive(Debug)]
pub struct Poller {
    targets: Vec<Target>,
    version: u64,
    timeout_ms: u64,
    interval_ms: u64,
    last_round_ms: Option<u64>,
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
    /// Endpoint roles (`crate::pd`) other than `decode`, from the configuration and the last
    /// pod list (static entries win).
    roles: HashMap<String, Role>,
}

impl Poller {
    pub fn new(cfg: &Config) -> Self {
        let static_endpoints: Vec<(String, Vec<String>)> =
            cfg.endpoints.iter().map(|e| (e.address.clone(), e.models.clone())).collect();
        let k8s = cfg.discovery.as_ref().map(|d| &d.kubernetes);
        let discovered_models = match k8s {
            Some(k) if !k.models.is_empty() => k.models.clone(),
            _ => cfg.models.iter().map(|m| m.name.clone()).collect(),
        };
        let mut p = Poller {
            targets: Vec::new(),
            version: 0,
            timeout_ms: cfg.poller.timeout_ms,
            interval_ms: cfg.poller.interval_ms,
            last_round_ms: None,
            static_endpoints: static_endpoints.clone(),
            discovered_models,
            discovery_refresh_ms: k8s.map(|k| k.refresh_ms),
            last_discovery_ms: None,
            discovery_outstanding_since: None,
            discovery_timeout_ms: k8s.map_or(0, |k| k.timeout_ms),
            lost: 0,
            roles: cfg
                .endpoints
                .iter()
                .filter(|e| !e.role.is_decode())
                .map(|e| (e.address.clone(), e.role))
                .collect(),
        };
        p.set_endpoints(static_endpoints);
        p
    }

    /// The endpoints to scrape if a round is due at `now_ms`, else `None`. A round is due one
    /// interval after the previous one started, less [`ROUND_JITTER_MS`] (at most a quarter
    /// interval) of tolerance for tick jitter: a tick that fires a little early must not skip a
    /// whole round. The tolerance stays below the filter root's 50 ms tick, so that a root ticking
    /// faster than the interval (lease mode) still starts rounds one interval apart.
    pub fn start_round_if_due(&mut self, now_ms: u64) -> Option<Vec<String>> {
        if let Some(last) = self.last_round_ms {
            let tolerance = ROUND_JITTER_MS.min(self.interval_ms / 4);
            if now_ms.saturating_add(tolerance) < last.saturating_add(self.interval_ms) {
                return None;
            }
        }
        self.last_round_ms = Some(now_ms);
        Some(self.due(now_ms))
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
    pub fn abandon_outstanding(&mut self) {
        for t in &mut self.targets {
            t.outstanding_since = None;
        }
        self.discovery_outstanding_since = None;
        self.last_round_ms = None;
    }

    /// Replaces the endpoint list (static config or discovery), keeping the state of endpoints
    /// that stay.
    pub fn set_endpoints(&mut self, endpoints: Vec<(String, Vec<String>)>) {
        let mut next = Vec::with_capacity(endpoints.len());
        for (address, models) in endpoints {
            let kept = self.targets.iter().position(|t| t.status.address == address);
            let target = match kept {
                Some(i) => {
                    let mut t = self.targets.swap_remove(i);
                    t.status.models = models;
                    t.status.role = self.roles.get(&address).copied().unwrap_or_default();
                    t
                }
                None => Target {
                    status: EndpointStatus {
                        role: self.roles.get(&address).copied().unwrap_or_default(),
                        address,
                        models,
                        metrics: None,
                        scraped_ms: 0,
                        failures: 0,
                        inflight_at_scrape: None,
                    },
                    outstanding_since: None,
                },
            };
            next.push(target);
        }
        self.targets = next;
    }

    /// Endpoints to scrape now (ignoring the round cadence). Marks them outstanding; expires
    /// calls that never answered (counted in [`Poller::take_lost`]).
    pub fn due(&mut self, now_ms: u64) -> Vec<String> {
        let mut out = Vec::new();
        for t in &mut self.targets {
            if let Some(since) = t.outstanding_since {
                if now_ms.saturating_sub(since) <= self.timeout_ms + LOST_CALL_GRACE_MS {
                    continue;
                }
                t.status.failures = t.status.failures.saturating_add(1);
                self.lost = self.lost.saturating_add(1);
            }
            t.outstanding_since = Some(now_ms);
            out.push(t.status.address.clone());
        }
        out
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
    pub fn dispatch_failed(&mut self, address: &str) {
        if let Some(t) = self.targets.iter_mut().find(|t| t.status.address == address) {
            t.outstanding_since = None;
            t.status.failures = t.status.failures.saturating_add(1);
        }
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
    /// `EndpointStatus::inflight_at_scrape`, the base of the live load estimate (`crate::load`).
    pub fn on_result_with_inflight(
        &mut self,
        address: &str,
        now_ms: u64,
        inflight_at_scrape: Option<u32>,
        result: ScrapeResult<'_>,
    ) -> Result<(), ScrapeError> {
        let Some(t) = self.targets.iter_mut().find(|t| t.status.address == address) else {
            return Ok(());
        };
        t.outstanding_since = None;
        let parsed = match result {
            ScrapeResult::Failed => Err(ScrapeError::Transport),
            ScrapeResult::TooLarge { size } => Err(ScrapeError::TooLarge(size)),
            ScrapeResult::Response { status, .. } if status != 200 => Err(ScrapeError::Status(status)),
            ScrapeResult::Response { body, .. } => match std::str::from_utf8(body) {
                Err(_) => Err(ScrapeError::NotUtf8),
                Ok(text) => parse_metrics(text).map_err(|e| ScrapeError::Metrics(e.to_string())),
            },
        };
        match parsed {
            Ok(m) => {
                t.status.metrics = Some(m);
                t.status.scraped_ms = now_ms;
                t.status.failures = 0;
                t.status.inflight_at_scrape = inflight_at_scrape;
                Ok(())
            }
            Err(e) => {
                t.status.failures = t.status.failures.saturating_add(1);
                Err(e)
            }
        }
    }

    /// True when no scrape is outstanding.
    pub fn round_complete(&self) -> bool {
        self.targets.iter().all(|t| t.outstanding_since.is_none())
    }

    /// The next snapshot to publish (bumps the version).
    pub fn snapshot(&mut self, now_ms: u64) -> Snapshot {
        self.version += 1;
        Snapshot {
            version: self.version,
            published_ms: now_ms,
            endpoints: self.targets.iter().map(|t| t.status.clone()).collect(),
        }
    }

    /// Continues the version sequence after a VM restart, so readers see a change.
    pub fn resume_version_after(&mut self, version: u64) {
        self.version = self.version.max(version);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        p.dispatch_failed("127.0.0.1:8003");
        assert_eq!(p.snapshot(7).endpoints[1].failures, 1);
    }

    #[test]
    fn rounds_follow_the_interval_with_jitter_tolerance() {
        // interval 200 ms: tolerance 20 ms.
        let mut p = Poller::new(&cfg());
        assert_eq!(p.start_round_if_due(1000).map(|v| v.len()), Some(2));
        p.on_result("127.0.0.1:8001", 1001, ScrapeResult::Failed).unwrap_err();
        p.on_result("127.0.0.1:8002", 1001, ScrapeResult::Failed).unwrap_err();
        assert_eq!(p.start_round_if_due(1100), None);
        // 50 ms ticks (a filter root in lease mode): 1150 is not due, 1200 is.
        assert_eq!(p.start_round_if_due(1150), None);
        assert_eq!(p.start_round_if_due(1179), None);
        // A tick 15 ms early still starts the round.
        assert!(p.start_round_if_due(1185).is_some());
        assert_eq!(p.start_round_if_due(1200), None);
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
    fn abandoning_outstanding_scrapes_allows_a_fresh_round() {
        let mut p = Poller::new(&cfg());
        assert!(p.start_round_if_due(0).is_some());
        p.abandon_outstanding();
        assert_eq!(p.start_round_if_due(1).map(|v| v.len()), Some(2));
    }
}
