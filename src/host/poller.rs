//! The poller: ticks, scrape and pod-list callouts, publishing. Decisions live in
//! `crate::poll::poller`; this file only moves data between them and the host.
//!
//! It runs in one of two places (`poller.mode`):
//! - `singleton`: in the `inference-picker-poller` WasmService root (one VM on the main thread);
//! - `lease`: in every filter root, but only the root holding the lease in shared data polls
//!   (see `crate::poll::lease`); the others only try to take the lease over on each tick.

use std::rc::Rc;

use hashbrown::HashMap;
use log::{debug, error, info, warn};

use super::io;
use crate::base::ports::SharedStore;
use crate::base::telemetry::{self, LogLimiter};
use crate::config::Config;
use crate::poll::discovery::TokenSource;
use crate::poll::lease::{holder_id, Lease, LeaseState};
use crate::poll::peers::{self, Exporter};
use crate::poll::pod_models::{self, ModelsError, ModelsLearner};
use crate::poll::poller::{response_within_cap, Poller, ScrapeError, ScrapeResult};
use crate::state::inflight::InflightTable;
use crate::state::prefix_shared::SharedPrefix;
use crate::state::snapshot::{self, SNAPSHOT_VERSION_KEY};

pub(crate) struct PollerRole {
    cfg: Rc<Config>,
    core: Poller,
    /// Outstanding scrapes: token → endpoint address.
    calls: HashMap<u32, String>,
    /// Outstanding pod-list call, if any.
    discovery_call: Option<u32>,
    /// Failure counters (`inference_picker_scrape_failures_total`, `…discovery_failures_total`,
    /// `…model_list_failures_total`).
    metrics: io::Metrics,
    /// One error line per cause every `telemetry::ERROR_LOG_EVERY_MS`.
    errors: LogLimiter,
    /// Reads every worker's in-flight counts when a scrape answers (never counts anything
    /// itself): `EndpointStatus::inflight_at_scrape`, for the live load estimate.
    inflight: InflightTable,
    /// `pod_models`: each pod's model list ([`PollerRole::tick_pod_models`]).
    models: Option<ModelsLearner>,
    /// Outstanding model-list fetches: token → endpoint address.
    model_calls: HashMap<u32, String>,
    /// `peers`: sends this gateway's new prefix-table records to the other replicas.
    peers: Option<PeerSender>,
}

/// The poller's side of `crate::poll::peers`.
struct PeerSender {
    table: SharedPrefix,
    exporter: Exporter,
    /// This gateway's workers' picks since the last send (`peers::PlacementExporter`).
    placements: peers::PlacementExporter,
    /// `None` when `token_env` names an unset (or too short) variable: nothing is sent.
    token: Option<String>,
    next_ms: u64,
    /// Outstanding sends: token → peer address.
    calls: HashMap<u32, String>,
    /// `peers.kubernetes`: the replicas found at the last good pod list, its outstanding call,
    /// and when the next list is due.
    found: Vec<String>,
    list_call: Option<u32>,
    next_list_ms: u64,
    /// This poller's candidate for the gateway's sender nonce of its placement batches
    /// (`peers::gateway_sender`: the first poller's wins).
    sender: u64,
}

impl PollerRole {
    pub fn new(cfg: Rc<Config>) -> Self {
        let core = Poller::with_seed(&*cfg, io::entropy());
        let metrics = io::Metrics::with_suffix(crate::request::pools::metric_suffix(cfg.pool.as_ref()));
        let mut p = PollerRole {
            cfg,
            core,
            calls: HashMap::new(),
            discovery_call: None,
            metrics,
            errors: LogLimiter::new(telemetry::ERROR_LOG_EVERY_MS),
            inflight: InflightTable::new(io::entropy()),
            models: None,
            model_calls: HashMap::new(),
            peers: None,
        };
        p.peers = p.cfg.peers.as_ref().map(|pc| {
            let token = pc.resolve_token(|name| std::env::var(name).ok());
            if token.is_none() {
                error!(
                    "inference-picker-poller: peers: the shared token is unset or shorter than {} bytes \
                     (token_env {:?}); this gateway sends no prefix records",
                    peers::MIN_TOKEN_BYTES,
                    pc.token_env
                );
            }
            let prefix = &p.cfg.scheduler.prefix;
            PeerSender {
                table: SharedPrefix::new(prefix.shared_shards, prefix.shared_entries_per_shard),
                exporter: Exporter::new(),
                placements: peers::PlacementExporter::default(),
                token,
                next_ms: 0,
                calls: HashMap::new(),
                found: Vec::new(),
                list_call: None,
                next_list_ms: 0,
                sender: io::entropy().max(1),
            }
        });
        p.models = ModelsLearner::from_config(p.cfg.pod_models.as_ref());
        p.continue_versions();
        p
    }

    /// Continues the version sequence found in shared data (a previous VM or lease holder), so
    /// that workers see our next publish as newer.
    fn continue_versions(&mut self) {
        if let Ok(Some((v, _))) = io::HostStore.get(SNAPSHOT_VERSION_KEY) {
            if let Some(n) = snapshot::decode_version(&v) {
                self.core.resume_version_after(n);
            }
        }
    }

    /// One tick: refresh discovery, start the scrapes that are due, publish if due.
    /// Callouts start from ticks, never from configuration: clusters may not be ready yet.
    /// It may be called at any tick rate: the core decides which scrapes and refreshes are due.
    pub fn tick(&mut self, now: u64) {
        super::report_skipped_records(&mut self.metrics);
        self.tick_pod_models(now);
        self.tick_peers(now);
        if let Some(k) = self.cfg.discovery.as_ref().map(|d| &d.kubernetes) {
            if self.core.discovery_due(now) {
                let token = match k.token_source() {
                    TokenSource::None => None,
                    TokenSource::Inline(t) => Some(t.to_string()),
                    TokenSource::Env(name) => std::env::var(name).ok(),
                };
                let headers = k.pod_list_headers(token.as_deref());
                match io::dispatch(&k.api_cluster, &headers, k.timeout_ms) {
                    Ok(t) => self.discovery_call = Some(t),
                    Err(e) => {
                        let msg = format!(
                            "cannot list pods through cluster {:?}: Envoy refused the call ({e}); is the \
                             cluster defined in Envoy's configuration?",
                            k.api_cluster
                        );
                        self.discovery_failure("dispatch", &msg, now);
                        self.core.discovery_failed();
                    }
                }
            }
        }
        // This gateway's in-flight counts, once per tick: endpoints it sends to are polled fast.
        if let Ok(counts) = self.inflight.read(&io::HostStore, now) {
            self.core.note_inflight(|a| counts.get(a));
        }
        let due = self.core.scrapes_due(now);
        let lost = self.core.take_lost();
        if lost > 0 {
            self.metrics.add(telemetry::name(telemetry::SCRAPE_FAILURES, &[("reason", "lost")]), lost);
            self.scrape_error(&ScrapeError::Lost, &format!("{lost} scrapes"), now);
        }
        for address in due {
            let p = &self.cfg.poller;
            match io::dispatch_get(&p.cluster, &p.metrics_path, &address, p.timeout_ms) {
                Ok(token) => {
                    self.calls.insert(token, address);
                }
                Err(e) => {
                    let err = ScrapeError::Dispatch(e);
                    self.metrics
                        .count(telemetry::name(telemetry::SCRAPE_FAILURES, &[("reason", err.reason())]));
                    self.scrape_error(&err, &format!("{address} through cluster {:?}", p.cluster), now);
                    self.core.dispatch_failed(&address, now);
                }
            }
        }
        // Results that arrived since the last publish (their batch may still be outstanding).
        if self.core.publish_due(now) {
            self.publish(now);
        }
    }

    pub fn on_response(&mut self, token: u32, num_headers: usize, body_size: usize) {
        let now = io::now_ms();
        if let Some(ps) = self.peers.as_mut().filter(|p| p.list_call == Some(token)) {
            ps.list_call = None;
            let Some(k) = self.cfg.peers.as_ref().and_then(|p| p.kubernetes.as_ref()) else { return };
            let status = if num_headers == 0 { None } else { io::call_response_status() };
            let parsed = if response_within_cap(body_size, self.cfg.poller.max_response_bytes) {
                crate::poll::discovery::parse_pod_list_response(
                    status.unwrap_or(0),
                    &io::call_response_body(body_size),
                    k,
                )
                .map_err(|e| format!("{e:?}"))
            } else {
                Err(format!("{body_size} bytes, over poller.max_response_bytes"))
            };
            match parsed {
                Ok(d) => {
                    ps.found = d.endpoints.into_iter().map(|e| e.address).take(peers::MAX_PEERS).collect();
                    debug!("inference-picker-poller: peers: {} found", ps.found.len());
                }
                Err(e) => {
                    self.metrics.count(telemetry::name(telemetry::PEER_SEND_FAILURES, &[]));
                    if self.errors.allow("peer_list", now).is_some() {
                        warn!("inference-picker-poller: peers: pod list unusable, keeping the previous peers: {e}");
                    }
                }
            }
            return;
        }
        if let Some(address) = self.peers.as_mut().and_then(|p| p.calls.remove(&token)) {
            let status = if num_headers == 0 { None } else { io::call_response_status() };
            if status != Some(204) {
                self.metrics.count(telemetry::name(telemetry::PEER_SEND_FAILURES, &[]));
                if self.errors.allow("peer", now).is_some() {
                    warn!("inference-picker-poller: peers: {address} answered {status:?} to a send (204 expected); check its peers.path and token");
                }
            }
            return;
        }
        if let Some(address) = self.model_calls.remove(&token) {
            self.on_models_response(&address, num_headers, body_size, now);
            return;
        }
        if self.discovery_call == Some(token) {
            self.discovery_call = None;
            let Some(k) = self.cfg.discovery.as_ref().map(|d| &d.kubernetes) else {
                return;
            };
            if !response_within_cap(body_size, self.cfg.poller.max_response_bytes) {
                let msg = format!(
                    "pod list of {body_size} bytes is over poller.max_response_bytes ({}); not read, \
                     keeping the previous endpoints",
                    self.cfg.poller.max_response_bytes
                );
                self.discovery_failure("too_large", &msg, now);
                self.core.discovery_failed();
                return;
            }
            let status = if num_headers == 0 { None } else { io::call_response_status() };
            let body = io::call_response_body(body_size);
            match self.core.on_discovery(k, status, &body) {
                Ok(n) => debug!("inference-picker-poller: discovery: {n} endpoints"),
                Err(e) => {
                    let msg = format!("pod list unusable, keeping the previous endpoints: {e}");
                    self.discovery_failure(e.reason(), &msg, now);
                }
            }
            return;
        }
        let Some(address) = self.calls.remove(&token) else {
            return;
        };
        // A failed call (reset, connect failure, timeout) arrives with no headers. A body over the
        // cap is never copied into the VM.
        let body;
        let result = if num_headers == 0 {
            ScrapeResult::Failed
        } else if !response_within_cap(body_size, self.cfg.poller.max_response_bytes) {
            ScrapeResult::TooLarge { size: body_size }
        } else {
            body = io::call_response_body(body_size);
            ScrapeResult::Response { status: io::call_response_status().unwrap_or(0), body: &body }
        };
        // This gateway's in-flight count now, as the scrape saw the engine (`crate::state::load`).
        let at_scrape = match &result {
            ScrapeResult::Response { status: 200, .. } => {
                self.inflight.read(&io::HostStore, now).ok().map(|c| c.get(&address))
            }
            _ => None,
        };
        if let Err(e) = self.core.on_result_with_inflight(&address, now, at_scrape, result) {
            self.metrics.count(telemetry::name(telemetry::SCRAPE_FAILURES, &[("reason", e.reason())]));
            self.scrape_error(&e, &address, now);
        }
        // Publish as soon as this tick's batch is in, if the core says so; else at a later tick.
        if self.calls.is_empty() && self.core.publish_due(now) {
            self.publish(now);
        }
    }

    // ---- pod_models: the low-rate model-list fetches (`crate::poll::pod_models`) ----

    /// Starts the model-list fetches that are due: new pods at once, the others every
    /// `pod_models.refresh_ms`. Through the metrics cluster, like a scrape.
    /// `peers`: every `interval_ms`, the records written since the last send, to every peer.
    fn tick_peers(&mut self, now: u64) {
        let (Some(pc), Some(ps)) = (self.cfg.peers.as_ref(), self.peers.as_mut()) else { return };
        if let Some(k) = pc.kubernetes.as_ref() {
            if now >= ps.next_list_ms {
                // A list still unanswered a whole refresh later is lost (its timeout is shorter).
                ps.list_call = None;
                ps.next_list_ms = now.saturating_add(k.refresh_ms);
                let token = match k.token_source() {
                    TokenSource::None => None,
                    TokenSource::Inline(t) => Some(t.to_string()),
                    TokenSource::Env(name) => std::env::var(name).ok(),
                };
                match io::dispatch(&k.api_cluster, &k.pod_list_headers(token.as_deref()), k.timeout_ms) {
                    Ok(t) => ps.list_call = Some(t),
                    Err(e) => {
                        self.metrics.count(telemetry::name(telemetry::PEER_SEND_FAILURES, &[]));
                        if self.errors.allow("peer_list", now).is_some() {
                            warn!(
                                "inference-picker-poller: peers: cannot list pods through cluster {:?}: {e}",
                                k.api_cluster
                            );
                        }
                    }
                }
            }
        }
        // Every tick, so that a busy worker's ring does not lap the exporter between sends.
        if ps.token.is_some() {
            match crate::state::inflight::live_vms(&io::HostStore, now) {
                Ok(vms) => ps.placements.collect(&io::HostStore, &vms),
                Err(e) => {
                    if self.errors.allow("peer_placements", now).is_some() {
                        warn!(
                            "inference-picker-poller: peers: reading the workers' placements failed: {e:?}"
                        );
                    }
                }
            }
        }
        if now < ps.next_ms {
            return;
        }
        let Some(token) = ps.token.as_deref() else { return };
        let cluster = &self.cfg.poller.cluster;
        let mut targets: Vec<&String> = pc.addresses.iter().collect();
        targets.extend(ps.found.iter().filter(|f| !pc.addresses.contains(f)));
        let mut failed = Vec::new();
        ps.next_ms = now.saturating_add(pc.interval_ms);
        // A send still unanswered after a whole interval is lost (Envoy's timeout is shorter).
        ps.calls.clear();
        let batch = ps.exporter.collect(&io::HostStore, &ps.table);
        if !batch.is_empty() {
            let body = peers::encode(&batch);
            post_to_peers(pc, cluster, token, &targets, &body, pc.timeout_ms, &mut ps.calls, &mut failed);
        }
        let placements = ps.placements.take();
        if !placements.is_empty() {
            match peers::gateway_sender(&io::HostStore, ps.sender) {
                Ok(sender) => {
                    let body = peers::encode_placements(sender, &placements);
                    post_to_peers(
                        pc,
                        cluster,
                        token,
                        &targets,
                        &body,
                        pc.timeout_ms,
                        &mut ps.calls,
                        &mut failed,
                    );
                }
                Err(e) => {
                    if self.errors.allow("peer_sender", now).is_some() {
                        warn!("inference-picker-poller: peers: this gateway's sender nonce cannot be read: {e:?}");
                    }
                }
            }
        }
        for (address, e) in failed {
            self.metrics.count(telemetry::name(telemetry::PEER_SEND_FAILURES, &[]));
            if self.errors.allow("peer", now).is_some() {
                warn!("inference-picker-poller: peers: cannot send to {address} through cluster {cluster:?}: {e}");
            }
        }
    }

    fn tick_pod_models(&mut self, now: u64) {
        let (Some(m), Some(pm)) = (&mut self.models, &self.cfg.pod_models) else {
            return;
        };
        let due = m.due(now, self.core.addresses());
        for address in due {
            match io::dispatch_get(&self.cfg.poller.cluster, &pm.path, &address, pm.timeout_ms) {
                Ok(token) => {
                    self.model_calls.insert(token, address);
                }
                Err(e) => {
                    let _ = m.on_result(&address, Err(ModelsError::Transport));
                    self.metrics
                        .count(telemetry::name(telemetry::MODEL_LIST_FAILURES, &[("reason", "dispatch")]));
                    let cause = "models:dispatch";
                    if let Some(n) = self.errors.allow(cause, now) {
                        error!(
                            "inference-picker-poller: model list of {address}: Envoy refused the call ({e}) ({n} more such failures since the last line)"
                        );
                    }
                }
            }
        }
    }

    fn on_models_response(&mut self, address: &str, num_headers: usize, body_size: usize, now: u64) {
        let Some(m) = &mut self.models else {
            return;
        };
        let result = if num_headers == 0 {
            Err(ModelsError::Transport)
        } else if body_size > pod_models::MAX_RESPONSE_BYTES {
            Err(ModelsError::TooLarge(body_size))
        } else {
            let body = io::call_response_body(body_size);
            pod_models::parse_models(io::call_response_status().unwrap_or(0), &body)
        };
        match m.on_result(address, result) {
            Ok(true) => {
                if let Some(l) = m.learned(address) {
                    info!(
                        "inference-picker-poller: {address} serves base models {:?} and adapters {:?}",
                        l.bases, l.adapters
                    );
                }
                self.core.mark_changed();
            }
            Ok(false) => {}
            Err(e) => {
                self.metrics
                    .count(telemetry::name(telemetry::MODEL_LIST_FAILURES, &[("reason", e.reason())]));
                let cause = format!("models:{}", e.reason());
                if let Some(n) = self.errors.allow(&cause, now) {
                    warn!(
                        "inference-picker-poller: model list of {address} unusable, keeping the last one: {e} ({n} more such failures since the last line)"
                    );
                }
            }
        }
    }

    /// Logs a scrape failure at error level, at most once per reason every
    /// `telemetry::ERROR_LOG_EVERY_MS` (the metric counts every one).
    fn scrape_error(&mut self, e: &ScrapeError, what: &str, now: u64) {
        if let Some(suppressed) = self.errors.allow(e.reason(), now) {
            error!(
                "inference-picker-poller: scrape of {what} failed: {e} \
                 (reason={}; {suppressed} more such failures since the last line)",
                e.reason()
            );
        }
    }

    /// Counts a pod-list failure and logs it (rate-limited per reason).
    fn discovery_failure(&mut self, reason: &'static str, msg: &str, now: u64) {
        self.metrics.count(telemetry::name(telemetry::DISCOVERY_FAILURES, &[("reason", reason)]));
        let cause = format!("discovery:{reason}");
        if let Some(suppressed) = self.errors.allow(&cause, now) {
            error!(
                "inference-picker-poller: {msg} (reason={reason}; {suppressed} more such failures since the last line)"
            );
        }
    }

    /// Stops waiting for outstanding calls (after losing the lease: their answers are ignored).
    fn abandon(&mut self) {
        self.calls.clear();
        self.model_calls.clear();
        if let Some(m) = &mut self.models {
            m.abandon_outstanding();
        }
        self.discovery_call = None;
        self.core.abandon_outstanding();
    }

    fn publish(&mut self, now: u64) {
        let mut snap = self.core.snapshot(now);
        if let Some(m) = &self.models {
            m.apply(&mut snap);
        }
        if let Err(e) = snapshot::publish(&io::HostStore, &snap) {
            warn!("inference-picker-poller: publishing snapshot failed: {e:?}");
        }
        let ready = u64::try_from(snap.ready_endpoints()).unwrap_or(u64::MAX);
        self.metrics.gauge(telemetry::name(telemetry::READY_ENDPOINTS, &[]), ready);
    }
}

/// A filter root's share of lease-mode polling.
pub(crate) struct LeasedPoller {
    lease: Lease,
    poller: PollerRole,
    held: bool,
}

impl LeasedPoller {
    pub fn new(cfg: Rc<Config>, context_id: u32) -> Self {
        let lease = Lease::new(holder_id(io::entropy(), context_id), cfg.poller.lease_ttl_ms);
        LeasedPoller { lease, poller: PollerRole::new(cfg), held: false }
    }

    pub fn tick(&mut self, now: u64) {
        let state = self.lease.try_acquire_or_renew(&io::HostStore, now);
        match (&state, self.held) {
            (LeaseState::Held { .. }, false) => {
                info!("inference-picker: this root now holds the poller lease");
                self.held = true;
                self.poller.continue_versions();
            }
            (s, true) if !s.is_held() => {
                info!("inference-picker: poller lease lost ({s:?})");
                self.held = false;
                self.poller.abandon();
            }
            _ => {}
        }
        if self.held {
            self.poller.tick(now);
        }
    }

    pub fn on_response(&mut self, token: u32, num_headers: usize, body_size: usize) {
        if self.held {
            self.poller.on_response(token, num_headers, body_size);
        }
    }

    pub fn release(&mut self) {
        if self.held {
            let _ = self.lease.release(&io::HostStore);
            self.held = false;
        }
    }
}

/// POSTs `body` on `peers.path`, with the token, to every peer in `targets` through `cluster`;
/// each call goes into `calls` (token → address), each refused dispatch into `failed`.
#[allow(clippy::too_many_arguments)]
fn post_to_peers(
    pc: &peers::PeersConfig,
    cluster: &str,
    token: &str,
    targets: &[&String],
    body: &[u8],
    timeout_ms: u64,
    calls: &mut HashMap<u32, String>,
    failed: &mut Vec<(String, String)>,
) {
    for &address in targets {
        let authority = pc.authority.as_deref().unwrap_or(address);
        match io::dispatch_post(
            cluster,
            &pc.path,
            address,
            authority,
            &[(peers::TOKEN_HEADER, token)],
            body,
            timeout_ms,
        ) {
            Ok(t) => {
                calls.insert(t, address.clone());
            }
            Err(e) => failed.push((address.clone(), e.to_string())),
        }
    }
}
