//! The scheduler: picks the endpoint (and fallbacks) for one request. Pure: no host calls; time,
//! randomness and shared data come in as parameters.
//!
//! Stages, in order (each in its own file, each with its formula in its `//!` doc):
//! 1. Model (`models`): rewrite/split the model name, then resolve it to a base model (and LoRA
//!    adapter). Unknown → 404 `model_not_found`.
//! 2. Filters (`filter`): endpoints serving the base model (none → 503 `no_endpoint`), then the
//!    healthy ones. None healthy → fail open (lowest in-flight count among the serving endpoints,
//!    seeded tie-break) when `filter.failure_mode` is `FailOpen`, else 503 `no_healthy_endpoint`.
//! 3. Guard (`guard`): flags candidates overloaded compared with the least loaded.
//! 4. Scorers, each in [0, 1]: `queue`, `kv`, `inflight` (load), `prefix` (prefix-cache
//!    affinity), `session` (session-id rendezvous), `lora` (adapter affinity). Prefix and
//!    session scores of overloaded candidates are forced to 0. The total is `Σ weight × score`
//!    with per-model weights.
//! 5. Session token: if the request carries a token naming a healthy, non-overloaded candidate,
//!    that candidate is the primary.
//! 6. Picker. Default objective `predicted_ttft` (`predict`): each candidate's predicted time to
//!    first token (work queued ahead + this prompt's uncached tokens, at the endpoint's rate
//!    learnt in `crate::state::rates`); among those within `predicted.affinity_slack` of the best, the
//!    rendezvous winner of the session id or the prompt's leading blocks (replicas agree without
//!    talking); fallbacks by predicted TTFT. Objective `weighted` (`picker`): max total with a
//!    seeded random tie-break (or weighted-random among the top k), then fallbacks in score
//!    order.
//! 7. The primary records the request's prefix blocks (local index and cross-worker table).
//!
//! Passive health (`crate::state::health`, [`Scheduler::pick_for_with`]): endpoints ejected for
//! failing requests are removed before stage 2's health filter (never more than
//! `health.max_ejection_percent` of the serving ones), and recent failures and 429s count as
//! requests in flight for `health.failure_load_ms`, in scoring and when failing open.
//!
//! Missing and stale signals: a stale endpoint is not a candidate at all. A healthy endpoint
//! that does not report a signal gets that scorer's neutral score, `min(0.5, lowest known score
//! among the candidates)` ([`neutral_fill`]): it never wins on a signal it does not have, and
//! when no candidate reports the signal everyone gets 0.5 and the scorer has no influence. The
//! in-flight count is never missing, so between polls and with partial metrics the load view
//! is still live. See `docs/scheduler.md` for the full description and measurements.

pub mod candidate;
pub mod config;
pub mod filter;
pub mod guard;
pub mod inflight;
pub mod kv;
pub mod lora;
pub mod models;
pub mod picker;
pub mod predict;
pub mod prefix;

pub mod queue;
pub mod session;

use std::fmt::Write as _;

use hashbrown::HashMap;

use crate::base::errors::Rejection;
use crate::base::ports::{Rng, SharedStore};
use crate::scheduler::config::FailureMode;
use crate::state::health::{HealthConfig, HealthView};
use crate::state::inflight::InflightCounts;
use crate::state::snapshot::{EndpointStatus, Snapshot};

use self::config::{Objective, SchedulerConfig, Weights};
use self::models::ModelTable;
use self::prefix::LocalIndex;
use crate::state::by_address::address_hash;
use crate::state::prefix_shared::{endpoint_key, endpoint_key_of_hash, SharedPrefix};

pub use self::candidate::{neutral_fill, neutral_score, Candidate};
pub use self::session::{keys_from_config as session_keys_from_config, parse_session_token, SessionKeys};

/// Most endpoints listed in the debug score header, best first (bounds the header size).
pub const DEBUG_MAX_ENDPOINTS: usize = 16;

/// What the scheduler needs from one request.
#[derive(Debug, Clone, Copy, Default)]
pub struct PickRequest<'a> {
    /// The body's `model`.
    pub model: &'a str,
    /// Canonical prompt text (`ParsedRequest::prompt`).
    pub prompt: &'a str,
    pub cache_salt: Option<&'a str>,
    /// Value of the session header (`scheduler.session.header`), if sent.
    pub session_id: Option<&'a str>,
    /// Value of the session-token header (`scheduler.session.token_header`), if sent.
    pub session_token: Option<&'a str>,
}

/// The model a request is sent as, chosen before any endpoint ([`Scheduler::route_model`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelRoute {
    /// The model the request is sent as (after rewrites).
    pub target_model: String,
    /// The body's `model` must be rewritten to `target_model`.
    pub model_rewritten: bool,
    /// The base model the endpoints must serve.
    pub base: String,
    /// The LoRA adapter, when `target_model` is one.
    pub adapter: Option<String>,
}

/// Why the primary was chosen (for the host's metrics and logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PickReason {
    /// Highest total score.
    Scored,
    /// The client's session token named a healthy, non-overloaded endpoint.
    SessionToken,
    /// No healthy endpoint: lowest in-flight count among the serving ones.
    FailOpen,
}

impl PickReason {
    pub fn as_str(self) -> &'static str {
        match self {
            PickReason::Scored => "scored",
            PickReason::SessionToken => "session_token",
            PickReason::FailOpen => "fail_open",
        }
    }
}

/// The decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Pick {
    /// `ip:port` of the endpoint to send to.
    pub primary: String,
    /// Further endpoints to try, best first (`x-gateway-destination-endpoint: primary,fb1,...`).
    pub fallbacks: Vec<String>,
    /// The model the request is sent as (after rewrites).
    pub target_model: String,
    /// The body's `model` must be rewritten to `target_model`.
    pub model_rewritten: bool,
    /// Opaque token naming `primary`, for the `x-session-token` response header.
    pub session_token: String,
    pub fail_open: bool,
    /// Per-endpoint score breakdown, when `scheduler.debug_scores` is on.
    pub debug_scores: Option<String>,
    pub reason: PickReason,
    /// Endpoints serving the model, and how many of them were healthy.
    pub serving: usize,
    pub healthy: usize,
    /// Healthy candidates the hot-spot guard found overloaded.
    pub overloaded: usize,
    /// Prefix score of the primary (fraction of the prompt's blocks it is believed to hold).
    pub prefix_score: f64,
    /// Blocks hashed from the prompt (0 for a prompt shorter than one block).
    pub prefix_blocks: usize,
    /// The primary's predicted TTFT in ms (objective `predicted_ttft`; `None` otherwise).
    pub predicted_ms: Option<f64>,
    /// Names this request in the worker's prefill ledger: the host reports its first response
    /// byte ([`Scheduler::first_byte`]) and its end ([`Scheduler::request_done`]). 0: not tracked.
    pub ticket: u64,
}

impl Pick {
    /// The `x-gateway-destination-endpoint` value: primary first, then fallbacks.
    pub fn destination_header(&self) -> String {
        let mut s = self.primary.clone();
        for f in &self.fallbacks {
            s.push(',');
            s.push_str(f);
        }
        s
    }
}

/// Narrows one pick: the hook through which `crate::request::pd` makes its decode and prefill picks with
/// the scheduler's own pipeline. The default scope changes nothing.
#[derive(Clone, Copy, Default)]
pub struct PickScope<'a> {
    /// Only endpoints for which this returns true are candidates (`None`: every endpoint).
    pub allow: Option<&'a dyn Fn(&EndpointStatus) -> bool>,
    /// Maps the model's weights to the weights of this pick (`None`: unchanged).
    pub weights: Option<&'a dyn Fn(Weights) -> Weights>,
    /// When no allowed endpoint is healthy, answer 503 `no_healthy_endpoint` even under
    /// `filter.failure_mode: FailOpen`.
    pub no_fail_open: bool,
    /// Record the primary's prefix blocks in this worker's index only, not in the cross-worker
    /// table (whose entries name one endpoint per block, which should stay the decode pod).
    pub skip_shared_record: bool,
}

impl PickScope<'_> {
    fn allows(&self, e: &EndpointStatus) -> bool {
        self.allow.is_none_or(|f| f(e))
    }
}

/// Per-candidate scores, each in [0, 1], and the weighted total.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Breakdown {
    pub prefix: f64,
    pub queue: f64,
    pub kv_cache: f64,
    pub inflight: f64,
    pub session: f64,
    pub lora: f64,
    pub total: f64,
    /// Predicted TTFT in ms (objective `predicted_ttft`; 0 otherwise).
    pub predicted_ms: f64,
    /// The work (tokens) and learnt rate (ms per token) behind `predicted_ms`.
    pub work: f64,
    pub rate: f64,
}

impl Breakdown {
    fn weighted(&self, w: &Weights) -> f64 {
        w.prefix * self.prefix
            + w.queue * self.queue
            + w.kv_cache * self.kv_cache
            + w.inflight * self.inflight
            + w.session * self.session
            + w.lora * self.lora
    }
}

/// The prediction of objective `predicted_ttft` for one candidate (`predict`).
#[derive(Debug, Clone, Copy)]
struct Prediction {
    /// Predicted TTFT (ms).
    ttft: f64,
    /// Work (tokens) and learnt rate (ms per token) behind `ttft`.
    work: f64,
    rate: f64,
    /// `predict::usable_rate(rate)`, for the miss penalty.
    usable_rate: f64,
    /// This request's uncached prompt tokens there.
    uncached: f64,
    /// The KV scorer's score before the neutral fill (`kv::free`), for the KV congestion factor.
    kv_free: Option<f64>,
}

/// The scheduler of one worker VM. Built once per configuration; holds the worker-local state
/// (the local prefix index).
#[derive(Debug, Clone)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    stale_after_ms: u64,
    /// Gateway replicas polling the same pods (`poller.replicas`): the share of the traffic
    /// this gateway does not see is `1 − 1 / gateways` (the rendezvous credit's scale).
    gateways: u32,
    failure_mode: FailureMode,
    /// Passive-health settings (max ejection percent, phantom load).
    health: HealthConfig,
    models: ModelTable,
    model_weights: HashMap<String, Weights>,
    /// This worker's per-endpoint prefix indexes.
    local: LocalIndex,
    /// Shape of the cross-worker prefix table (the data lives in the shared store).
    shared: SharedPrefix,
    /// Reused buffer for the request's block hashes.
    hashes: Vec<u64>,
    /// Keys of the session token (`scheduler.session`); the host sets them from the secrets.
    session_keys: SessionKeys,
    /// This worker's requests still in prefill (objective `predicted_ttft`).
    ledger: predict::Ledger,
    /// This worker's view of the learnt per-endpoint rates (`crate::state::rates`).
    rates: crate::state::rates::RateCache,
}

impl Scheduler {
    pub fn new<'a>(setup: impl Into<config::Setup<'a>>) -> Scheduler {
        let setup = setup.into();
        let sc = setup.scheduler.clone();
        let model_weights =
            sc.model_weights.iter().map(|(k, o)| (k.clone(), sc.weights.overridden(o))).collect();
        Scheduler {
            stale_after_ms: setup.stale_after_ms,
            gateways: setup.replicas.max(1),
            failure_mode: setup.failure_mode,
            health: setup.health.clone(),
            models: ModelTable::new(&setup.catalog, &sc.rewrites),
            model_weights,
            local: LocalIndex::default(),
            shared: SharedPrefix::new(sc.prefix.shared_shards, sc.prefix.shared_entries_per_shard),
            hashes: Vec::new(),
            session_keys: SessionKeys::default(),
            ledger: predict::Ledger::default(),
            rates: crate::state::rates::RateCache::default(),
            cfg: sc,
        }
    }

    /// Sets the session-token keys (resolved by the host from `scheduler.session`, whose secret
    /// may come from the environment).
    pub fn set_session_keys(&mut self, keys: SessionKeys) {
        self.session_keys = keys;
    }

    /// The session-token keys in use.
    /// The cross-worker prefix table's shape (`crate::poll::peers` applies peers' records to it).
    pub fn shared_prefix(&self) -> &SharedPrefix {
        &self.shared
    }

    pub fn session_keys(&self) -> &SessionKeys {
        &self.session_keys
    }

    /// This worker's requests still in prefill on `address` and their uncached prompt tokens,
    /// `(tokens, count)`: what the host publishes with its in-flight count there
    /// (`crate::state::inflight::InflightTable::adjust_with_prefill`), so the other workers' predictions
    /// count it.
    pub fn ledger_prefill(&self, address: &str) -> (f64, u32) {
        self.ledger.pending(address)
    }

    /// The first response byte of the request `ticket` ([`Pick::ticket`]) arrived from `served`
    /// (the endpoint that answered, when the host knows it): its prefill no longer counts as
    /// work ahead, and the time since it was sent teaches the endpoint's rate to every worker
    /// (`crate::state::rates::observe`, one CAS write). A ticket of 0, unknown or already reported does
    /// nothing.
    pub fn first_byte(
        &mut self,
        ticket: u64,
        served: Option<&str>,
        store: &dyn SharedStore,
        now_ms: u64,
    ) -> Result<(), crate::base::ports::StoreError> {
        if ticket == 0 {
            return Ok(());
        }
        match self.ledger.first_byte(ticket, served, now_ms) {
            Some(o) => crate::state::rates::observe(
                store,
                endpoint_key(&o.address),
                o.work,
                o.ms,
                self.cfg.predicted.prior_ms_per_token,
            ),
            None => Ok(()),
        }
    }

    /// The first response byte of the request `ticket` arrived, but it teaches no rate: a split
    /// P/D request, whose time to first byte is the prefill pod's queue and prefill plus the KV
    /// transfer, not the decode pod's prefill (learning from it would make a decode pod look as
    /// fast or slow as the prefill pods). Its prefill no longer counts as work ahead.
    pub fn first_byte_unobserved(&mut self, ticket: u64) {
        if ticket != 0 {
            self.ledger.first_byte_unobserved(ticket);
        }
    }

    /// The request `ticket` ended (with or without a first byte): the ledger forgets it.
    pub fn request_done(&mut self, ticket: u64) {
        if ticket != 0 {
            self.ledger.done(ticket);
        }
    }

    /// Requests this worker sent that are still in prefill (for tests and metrics).
    pub fn pending_requests(&self) -> usize {
        self.ledger.len()
    }

    /// The session header name the host should read (`scheduler.session.header`).
    pub fn session_header(&self) -> &str {
        &self.cfg.session.header
    }

    /// The session-token header name (`scheduler.session.token_header`).
    pub fn token_header(&self) -> &str {
        &self.cfg.session.token_header
    }

    /// Weights for a target model: its own override, else its base's, else the pool's.
    fn weights_for(&self, target: &str, base: &str) -> Weights {
        self.model_weights
            .get(target)
            .or_else(|| self.model_weights.get(base))
            .copied()
            .unwrap_or(self.cfg.weights)
    }

    /// Stage 1 alone: the rewrite/split choice and the base model, before any endpoint is
    /// chosen. Flow control needs the base model (whose endpoints the request will use) and the
    /// body rewrite at arrival, while the endpoint is picked only when the request is let
    /// through ([`Scheduler::pick_for`]). Unknown model → 404 `model_not_found`.
    pub fn route_model(
        &self,
        model: &str,
        session_id: Option<&str>,
        snapshot: &Snapshot,
        rng: &mut dyn Rng,
    ) -> Result<ModelRoute, Rejection> {
        let rewritten = self.models.rewrite(model, session_id, rng);
        let target = rewritten.unwrap_or(model);
        let Some(resolved) = self.models.resolve(target, snapshot) else {
            return Err(Rejection::new(
                404,
                "invalid_request_error",
                "model_not_found",
                format!("The model `{target}` does not exist."),
            ));
        };
        Ok(ModelRoute {
            target_model: target.to_string(),
            model_rewritten: target != model,
            base: resolved.base.to_string(),
            adapter: resolved.adapter.map(str::to_string),
        })
    }

    /// Resolves rewrites/splits first, then filters, scores, picks, records prefix blocks.
    /// The same as [`Scheduler::route_model`] followed by [`Scheduler::pick_for`].
    #[allow(clippy::too_many_arguments)]
    pub fn pick(
        &mut self,
        req: &PickRequest<'_>,
        snapshot: &Snapshot,
        inflight: &InflightCounts,
        store: &dyn SharedStore,
        rng: &mut dyn Rng,
        now_ms: u64,
    ) -> Result<Pick, Rejection> {
        let route = self.route_model(req.model, req.session_id, snapshot, rng)?;
        self.pick_for(&route, req, snapshot, inflight, store, rng, now_ms)
    }

    /// Stages 2-7 for a model already resolved by [`Scheduler::route_model`]. `req.model` is not
    /// read again (the route has the target). No passive-health data: nothing is ejected.
    #[allow(clippy::too_many_arguments)]
    pub fn pick_for(
        &mut self,
        route: &ModelRoute,
        req: &PickRequest<'_>,
        snapshot: &Snapshot,
        inflight: &InflightCounts,
        store: &dyn SharedStore,
        rng: &mut dyn Rng,
        now_ms: u64,
    ) -> Result<Pick, Rejection> {
        self.pick_for_with(route, req, snapshot, inflight, &HealthView::default(), store, rng, now_ms)
    }

    /// [`Scheduler::pick_for`] with the passive-health view (`crate::state::health`): ejected endpoints
    /// are left out (within `health.max_ejection_percent`), and each endpoint's phantom load is
    /// added to its in-flight count.
    #[allow(clippy::too_many_arguments)]
    pub fn pick_for_with(
        &mut self,
        route: &ModelRoute,
        req: &PickRequest<'_>,
        snapshot: &Snapshot,
        inflight: &InflightCounts,
        health: &HealthView,
        store: &dyn SharedStore,
        rng: &mut dyn Rng,
        now_ms: u64,
    ) -> Result<Pick, Rejection> {
        let scope = PickScope::default();
        self.pick_scoped(route, req, snapshot, inflight, health, store, rng, now_ms, &scope)
    }

    /// [`Scheduler::pick_for_with`] narrowed by a [`PickScope`] (the hook of `crate::request::pd`, which
    /// makes one decode pick and one prefill pick per request).
    #[allow(clippy::too_many_arguments)]
    pub fn pick_scoped(
        &mut self,
        route: &ModelRoute,
        req: &PickRequest<'_>,
        snapshot: &Snapshot,
        inflight: &InflightCounts,
        health: &HealthView,
        store: &dyn SharedStore,
        rng: &mut dyn Rng,
        now_ms: u64,
        scope: &PickScope<'_>,
    ) -> Result<Pick, Rejection> {
        // 1. Model (resolved by `route_model`).
        let target = route.target_model.as_str();
        let resolved = models::Resolved { base: &route.base, adapter: route.adapter.as_deref() };
        let target_model = route.target_model.clone();
        let model_rewritten = route.model_rewritten;
        let mut weights = self.weights_for(target, resolved.base);
        if let Some(map) = scope.weights {
            weights = map(weights);
        }

        // 2. Filters. Without passive-health data nothing is ejected: one pass counts the
        // serving endpoints and keeps the healthy ones (the serving list itself is only needed
        // to fail open).
        let serves = |e: &EndpointStatus| filter::serves(e, resolved.base) && scope.allows(e);
        let healthy_now = |e: &EndpointStatus| filter::healthy(e, now_ms, self.stale_after_ms);
        let mut n_serving = 0;
        let mut serving: Vec<&EndpointStatus> = Vec::new();
        let mut healthy: Vec<&EndpointStatus> = Vec::new();
        if health.is_empty() {
            healthy.reserve(snapshot.endpoints.len());
            for e in &snapshot.endpoints {
                if serves(e) {
                    n_serving += 1;
                    if healthy_now(e) {
                        healthy.push(e);
                    }
                }
            }
        } else {
            serving = snapshot.endpoints.iter().filter(|e| serves(e)).collect();
            n_serving = serving.len();
        }
        if n_serving == 0 {
            return Err(Rejection::new(
                503,
                "service_unavailable",
                "no_endpoint",
                format!("No endpoint serves the model `{target}`."),
            )
            .with_retry_after(1));
        }
        if !health.is_empty() {
            // Passive health: ejected endpoints are not candidates, even to fail open.
            serving = filter::not_ejected(&serving, health, now_ms, &self.health);
            n_serving = serving.len();
            healthy = serving.iter().copied().filter(|e| healthy_now(e)).collect();
        }
        let load =
            |addr: &str| inflight.get(addr).saturating_add(health.phantom_load(addr, now_ms, &self.health));
        if healthy.is_empty() {
            if scope.no_fail_open {
                return Err(Rejection::new(
                    503,
                    "service_unavailable",
                    "no_healthy_endpoint",
                    format!("No healthy endpoint for the model `{target_model}`."),
                )
                .with_retry_after(1));
            }
            if health.is_empty() {
                serving = snapshot.endpoints.iter().filter(|e| serves(e)).collect();
            }
            return self.fail_open(&serving, &load, rng, target_model, model_rewritten);
        }
        let predicted = self.cfg.objective == Objective::PredictedTtft;
        // Per candidate, once: its address hash (`crate::state::by_address`: its entry in every table
        // keyed by address, its key in the cross-worker ones, its rendezvous seed), this
        // gateway's in-flight count, and the live queue estimate (read by the queue scorer with
        // `live_queue`, and by the prediction).
        let need_live = self.cfg.live_queue || predicted;
        let addr_hash: Vec<u64> = healthy.iter().map(|e| address_hash(&e.address)).collect();
        // One probe per candidate for its count and the prefill the workers queued there.
        let loads: Vec<crate::state::inflight::EndpointLoad> =
            healthy.iter().zip(&addr_hash).map(|(e, &h)| inflight.load_hashed(h, &e.address)).collect();
        let live: Vec<Option<f64>> = if need_live {
            healthy
                .iter()
                .zip(&loads)
                .map(|(e, l)| crate::state::load::live_queue(e, l.n, now_ms, self.stale_after_ms))
                .collect()
        } else {
            Vec::new()
        };
        let cands: Vec<Candidate<'_>> = healthy
            .iter()
            .zip(loads.iter().map(|l| l.n))
            .enumerate()
            .map(|(i, (e, n))| Candidate {
                address: &e.address,
                metrics: e.metrics.as_ref(),
                inflight: if health.is_empty() {
                    n
                } else {
                    n.saturating_add(health.phantom_load(&e.address, now_ms, &self.health))
                },
                queue: if self.cfg.live_queue {
                    live.get(i).copied().flatten()
                } else {
                    e.metrics.as_ref().and_then(|m| m.queue)
                },
            })
            .collect();

        // 3. Guard.
        let overloaded = guard::overloaded(&cands, &self.cfg.guard);
        let eligible: Vec<bool> = overloaded.iter().map(|o| !o).collect();

        // 4. Scorers. Prefix first: hash, then local and cross-worker matches.
        let mut hashes = std::mem::take(&mut self.hashes);
        let pc = &self.cfg.prefix;
        prefix::block_hashes(
            req.prompt,
            prefix::seed(target, req.cache_salt),
            pc.block_chars,
            pc.max_blocks,
            &mut hashes,
        );
        self.local.sync(snapshot.version, &mut snapshot.endpoints.iter().map(|e| e.address.as_str()));
        let mut lookup =
            if hashes.is_empty() { Default::default() } else { self.shared.lookup(store, &hashes) };
        let hit_filter = lookup.key_filter();
        let matched: Vec<usize> = if hashes.is_empty() {
            vec![0; cands.len()]
        } else {
            cands
                .iter()
                .zip(&addr_hash)
                .map(|(c, &h)| {
                    let local = self.local.matched_hashed(h, c.address, &hashes);
                    let shared = lookup.matched_filtered(endpoint_key_of_hash(h), hit_filter);
                    local.max(shared)
                })
                .collect()
        };
        // The prefix score of candidate `i` (0 when overloaded).
        let n_blocks = hashes.len();
        let prefix_score_of = |i: usize| {
            if eligible.get(i).copied().unwrap_or(false) {
                prefix::score(matched.get(i).copied().unwrap_or(0), n_blocks)
            } else {
                0.0
            }
        };
        let lo = if resolved.adapter.is_some() { lora::scores(resolved.adapter, &cands) } else { Vec::new() };
        // Under `predicted_ttft` the queue, KV, in-flight and session scores and the weighted
        // total decide nothing (they are shown in the debug scores): computed only when read.
        let weighted_scores = !predicted || self.cfg.debug_scores;
        let mut rows: Vec<Breakdown> = Vec::new();
        if weighted_scores {
            let q = queue::scores(&cands);
            let kv = kv::scores(&cands);
            let inf = inflight::scores(&cands);
            let sess = session::scores(req.session_id, &cands, &eligible);
            rows.reserve(cands.len());
            for i in 0..cands.len() {
                let get = |v: &[f64]| v.get(i).copied().unwrap_or(0.0);
                let ok = eligible.get(i).copied().unwrap_or(false);
                let mut b = Breakdown {
                    prefix: prefix_score_of(i),
                    queue: get(&q),
                    kv_cache: get(&kv),
                    inflight: get(&inf),
                    session: if ok { get(&sess) } else { 0.0 },
                    lora: get(&lo),
                    total: 0.0,
                    predicted_ms: 0.0,
                    work: 0.0,
                    rate: 0.0,
                };
                b.total = b.weighted(&weights);
                rows.push(b);
            }
        }

        // Objective `predicted_ttft`: each candidate's predicted TTFT (`predict`), its work,
        // uncached tokens and rate, and the cost that ranks it.
        let cpt = pc.chars_per_token.max(1) as f64;
        let prompt_tokens = req.prompt.len() as f64 / cpt;
        let mut pred: Vec<Prediction> = Vec::new();
        let mut costs: Vec<f64> = Vec::new();
        if predicted {
            let keys: Vec<u32> = addr_hash.iter().map(|&h| endpoint_key_of_hash(h)).collect();
            let rates = self.rates.rates(store, &keys, self.cfg.predicted.prior_ms_per_token, now_ms);
            let mean = self.ledger.mean_tokens().unwrap_or(prompt_tokens);
            // Nothing distinguishes the pods for this prefix (no eligible one holds more of it
            // than every other, e.g. only a system prompt all share): the rendezvous winner is
            // where another gateway most likely sent its earlier turns. Credit scaled by the
            // share of the traffic other gateways see (`predict`, "Rendezvous credit"). Not for
            // an adapter request: where its adapter is loaded is a signal every gateway scrapes
            // alike, and the LoRA factor already follows it.
            let pr = &self.cfg.predicted;
            let credit_share = if resolved.adapter.is_some() {
                0.0
            } else {
                predict::rendezvous_credit_share(pr.rendezvous_credit, self.gateways)
            };
            let winner = if credit_share > 0.0 && predict::nothing_distinguishes(&matched, &eligible) {
                predict::rendezvous_key(req.session_id, &hashes, pr.rendezvous_blocks)
                    .and_then(|k| predict::rendezvous_winner(k, &addr_hash, &eligible))
            } else {
                None
            };
            // Sum and count of the eligible candidates' queues: the miss penalty's `busy`.
            let (mut queue_sum, mut queue_n) = (0.0, 0.0);
            // The lowest known KV score: the neutral fill of a missing one.
            let mut lowest_free = f64::INFINITY;
            let credit = 1.0 - credit_share;
            pred.reserve(cands.len());
            let inputs = cands.iter().zip(&addr_hash).zip(&eligible).zip(&matched).zip(&live).zip(&rates);
            for (i, (((((c, &h), &ok), &m), &waiting), &rate)) in inputs.enumerate() {
                let m = if ok { m } else { 0 };
                // No block cached (most candidates): 0 without a division.
                let cached = if m == 0 { 0.0 } else { (m * pc.block_chars) as f64 / cpt };
                let mut own = (prompt_tokens - cached).max(0.0);
                if winner == Some(i) {
                    own *= credit;
                }
                // The prefill queued there by every worker of this gateway (their ledgers,
                // published with the in-flight counts), or this worker's own when that is more
                // (its latest pick may not be published yet).
                let (mine, active) = self.ledger.pending_and_active(h, c.address);
                let shared = loads.get(i).map_or((0.0, 0), |l| l.prefill());
                let pending = if shared.1 > mine.1 { shared } else { mine };
                let inp = predict::Inputs {
                    uncached: own,
                    pending,
                    waiting,
                    inflight: c.inflight,
                    rate,
                    lora: resolved.adapter.map(|_| lo.get(i).copied().unwrap_or(0.0)),
                    active: pr.active_weight * active,
                };
                let waiting = predict::waiting(&inp);
                let work = predict::work_given_waiting(&inp, mean, waiting);
                if ok {
                    queue_sum += waiting;
                    queue_n += 1.0;
                }
                let kv_free = kv::free(c);
                if let Some(f) = kv_free {
                    lowest_free = lowest_free.min(f);
                }
                pred.push(Prediction {
                    ttft: predict::ttft_of_work(&inp, work),
                    work,
                    rate: inp.rate,
                    usable_rate: predict::usable_rate(inp.rate),
                    uncached: inp.uncached,
                    kv_free,
                });
            }
            // Rank by predicted TTFT plus the miss penalty (`predict`, "Cost").
            let least = predict::least_uncached_of(pred.iter().map(|p| p.uncached), &eligible);
            let busy = if queue_n > 0.0 { queue_sum / queue_n } else { 0.0 };
            let penalty = predict::MissPenalty::new(least, busy, pr.miss_weight);
            // KV congestion (`predict`, "KV congestion"): a missing usage takes the KV scorer's
            // neutral fill, so a pod without the metric never looks emptier than the others.
            let neutral_free = neutral_score(lowest_free);
            costs = pred
                .iter()
                .map(|p| {
                    let cost = p.ttft + penalty.of_usable_rate(p.usable_rate, p.uncached);
                    if pr.kv_full_at > 0.0 {
                        cost * predict::kv_congestion(1.0 - p.kv_free.unwrap_or(neutral_free), pr.kv_full_at)
                    } else {
                        cost
                    }
                })
                .collect();
            for (r, p) in rows.iter_mut().zip(&pred) {
                r.predicted_ms = p.ttft;
                r.work = p.work;
                r.rate = p.rate;
            }
        }

        // 5 + 6. Session token, then the picker.
        let token_pick = req.session_token.and_then(|t| self.session_keys.resolve(t, &cands, &eligible));
        let mut order = if predicted {
            let key = predict::rendezvous_key(req.session_id, &hashes, self.cfg.predicted.rendezvous_blocks);
            let slack = self.cfg.predicted.affinity_slack;
            let key = if slack > 0.0 || req.session_id.is_some() { key } else { None };
            predict::order(&costs, &addr_hash, &eligible, key, slack, self.cfg.fallbacks, rng)
        } else {
            let totals: Vec<f64> = rows.iter().map(|b| b.total).collect();
            picker::order(&totals, self.cfg.tie_epsilon, self.cfg.top_k, self.cfg.fallbacks, rng)
        };
        let reason = match token_pick {
            Some(t) => {
                order.retain(|&i| i != t);
                order.insert(0, t);
                order.truncate(1 + self.cfg.fallbacks);
                PickReason::SessionToken
            }
            None => PickReason::Scored,
        };
        let Some((&p, fb)) = order.split_first() else {
            // Unreachable: `cands` is not empty, so the picker returns at least one index.
            return Err(Rejection::new(500, "internal_error", "internal", "scheduler picked nothing"));
        };
        let primary_cand = cands.get(p).copied();
        let primary = primary_cand.map(|c| c.address.to_string()).unwrap_or_default();
        let fallbacks = fb.iter().filter_map(|&i| cands.get(i)).map(|c| c.address.to_string()).collect();
        let prefix_score = prefix_score_of(p);
        let debug_scores = self.cfg.debug_scores.then(|| debug_string(&cands, &rows, &overloaded, predicted));
        let (predicted_ms, ticket) = match (predicted, primary_cand) {
            (true, Some(c)) => {
                let pp = pred.get(p);
                let u = pp.map_or(prompt_tokens, |x| x.uncached);
                let w = pp.map_or(u, |x| x.work);
                (pp.map(|x| x.ttft), self.ledger.sent(c.address, u, w, now_ms))
            }
            _ => (None, 0),
        };

        // 7. The primary now holds this prompt's blocks.
        if let Some(c) = primary_cand {
            let cap = prefix::capacity(&self.cfg.prefix, c.metrics, snapshot.endpoints.len());
            self.local.record(c.address, &hashes, cap);
            if !scope.skip_shared_record {
                let key = match addr_hash.get(p) {
                    Some(&h) => endpoint_key_of_hash(h),
                    None => endpoint_key(c.address),
                };
                self.shared.record(store, &hashes, key, &mut lookup);
            }
        }
        let prefix_blocks = hashes.len();
        self.hashes = hashes;

        Ok(Pick {
            session_token: self.session_keys.token_for(&primary),
            primary,
            fallbacks,
            target_model,
            model_rewritten,
            fail_open: false,
            debug_scores,
            reason,
            serving: n_serving,
            healthy: healthy.len(),
            overloaded: overloaded.iter().filter(|o| **o).count(),
            prefix_score,
            prefix_blocks,
            predicted_ms,
            ticket,
        })
    }

    fn fail_open(
        &self,
        serving: &[&EndpointStatus],
        load: &dyn Fn(&str) -> u32,
        rng: &mut dyn Rng,
        target_model: String,
        model_rewritten: bool,
    ) -> Result<Pick, Rejection> {
        if self.failure_mode != FailureMode::FailOpen {
            return Err(Rejection::new(
                503,
                "service_unavailable",
                "no_healthy_endpoint",
                format!("No healthy endpoint for the model `{target_model}`."),
            )
            .with_retry_after(1));
        }
        // Fewer in flight is better; counts are integers, so a tie epsilon of 0.5 groups exactly
        // the equal counts.
        let totals: Vec<f64> = serving.iter().map(|e| -f64::from(load(&e.address))).collect();
        let order = picker::order(&totals, 0.5, 1, self.cfg.fallbacks, rng);
        let mut addrs = order.iter().filter_map(|&i| serving.get(i)).map(|e| e.address.clone());
        let primary = addrs.next().unwrap_or_default();
        Ok(Pick {
            session_token: self.session_keys.token_for(&primary),
            primary,
            fallbacks: addrs.collect(),
            target_model,
            model_rewritten,
            fail_open: true,
            debug_scores: None,
            reason: PickReason::FailOpen,
            serving: serving.len(),
            healthy: 0,
            overloaded: 0,
            prefix_score: 0.0,
            prefix_blocks: 0,
            predicted_ms: None,
            ticket: 0,
        })
    }
}

/// `addr t=.. p=.. q=.. kv=.. if=.. s=.. l=..[ overloaded]` for the best
/// [`DEBUG_MAX_ENDPOINTS`] candidates, separated by `, ` (header-safe: addresses are ASCII).
fn debug_string(cands: &[Candidate<'_>], rows: &[Breakdown], overloaded: &[bool], predicted: bool) -> String {
    // Best first: the highest total, or the lowest predicted TTFT.
    let totals: Vec<f64> = rows.iter().map(|b| if predicted { -b.predicted_ms } else { b.total }).collect();
    let mut s = String::new();
    for (n, i) in picker::top_m(&totals, DEBUG_MAX_ENDPOINTS).into_iter().enumerate() {
        let (Some(c), Some(b)) = (cands.get(i), rows.get(i)) else { continue };
        if n > 0 {
            s.push_str(", ");
        }
        let _ = write!(
            s,
            "{} t={:.3} p={:.3} q={:.3} kv={:.3} if={:.3} s={:.3} l={:.3}",
            c.address, b.total, b.prefix, b.queue, b.kv_cache, b.inflight, b.session, b.lora
        );
        if predicted {
            let _ = write!(s, " ttft={:.1}ms work={:.0} rate={:.4}", b.predicted_ms, b.work, b.rate);
        }
        if overloaded.get(i).copied().unwrap_or(false) {
            s.push_str(" overloaded");
        }
    }
    s
}

#[cfg(test)]
pub(crate) mod tests_support {
    use super::Candidate;
    use crate::state::metrics::EndpointMetrics;

    /// Owns what [`Candidate`]s borrow; addresses are `10.0.0.<i+1>:8000`.
    pub struct Owned {
        eps: Vec<(String, Option<EndpointMetrics>, u32)>,
    }

    impl Owned {
        /// (queue, running, inflight) per endpoint.
        pub fn new(rows: &[(Option<f64>, Option<f64>, u32)]) -> Owned {
            Owned {
                eps: rows
                    .iter()
                    .enumerate()
                    .map(|(i, &(q, r, n))| {
                        let m = EndpointMetrics { queue: q, running: r, ..Default::default() };
                        (format!("10.0.0.{}:8000", i + 1), Some(m), n)
                    })
                    .collect(),
            }
        }
        pub fn from_metrics(ms: Vec<Option<EndpointMetrics>>) -> Owned {
            Owned {
                eps: ms
                    .into_iter()
                    .enumerate()
                    .map(|(i, m)| (format!("10.0.0.{}:8000", i + 1), m, 0))
                    .collect(),
            }
        }
        pub fn view(&self) -> Vec<Candidate<'_>> {
            self.eps
                .iter()
                .map(|(a, m, n)| Candidate {
                    address: a,
                    metrics: m.as_ref(),
                    inflight: *n,
                    queue: m.as_ref().and_then(|m| m.queue),
                })
                .collect()
        }
    }

    /// (queue, kv_usage) per endpoint.
    pub fn cands_with(rows: &[(Option<f64>, Option<f64>)]) -> Owned {
        Owned::from_metrics(
            rows.iter()
                .map(|&(q, kv)| Some(EndpointMetrics { queue: q, kv_usage: kv, ..Default::default() }))
                .collect(),
        )
    }

    pub fn cands_inflight(counts: &[u32]) -> Owned {
        Owned::new(&counts.iter().map(|&n| (None, None, n)).collect::<Vec<_>>())
    }
}

#[cfg(test)]
mod tests;
