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
//! A request that is not a generation (Anthropic's token count) takes stages 1 and 2 only, then
//! the least-loaded healthy endpoint ([`Scheduler::pick_least_loaded`]): no score, no prediction,
//! nothing recorded.
//!
//! Passive health (`crate::state::health`, [`PickState::health`]): endpoints ejected for
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
pub mod slo;

mod pipeline;

use hashbrown::HashMap;

use crate::base::errors::Rejection;
use crate::base::ports::{Rng, SharedStore};
use crate::scheduler::config::FailureMode;
use crate::state::feed::Placement;
use crate::state::health::{HealthConfig, HealthView};
use crate::state::inflight::InflightCounts;
use crate::state::snapshot::{EndpointStatus, Snapshot};

use self::config::{SchedulerConfig, Weights};
use self::models::ModelTable;
use self::prefix::LocalIndex;
use crate::state::prefix_shared::{endpoint_key, SharedPrefix};

pub use self::candidate::{neutral_fill, neutral_score, Candidate};
pub use self::session::{keys_from_config as session_keys_from_config, parse_session_token, SessionKeys};
pub use self::slo::{SloAsk, SloVerdict};

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
    /// The request's TTFT target, when it has one (`slo`).
    pub slo: Option<SloAsk>,
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
    /// Not a generation (an Anthropic token count, [`Scheduler::pick_least_loaded`]): the
    /// healthy endpoint with the fewest requests in flight, unscored, nothing recorded.
    TokenCount,
}

impl PickReason {
    pub fn as_str(self) -> &'static str {
        match self {
            PickReason::Scored => "scored",
            PickReason::SessionToken => "session_token",
            PickReason::FailOpen => "fail_open",
            PickReason::TokenCount => "count_tokens",
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
    /// What the prediction said of the request's TTFT target (`None` without a target).
    pub slo: Option<SloVerdict>,
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

/// The state one pick is read against: the pool as this worker sees it at one moment.
#[derive(Clone, Copy)]
pub struct PickState<'a> {
    pub snapshot: &'a Snapshot,
    /// In-flight counts of every worker of this gateway (and the prefill they queued).
    pub inflight: &'a InflightCounts,
    /// Passive health (`crate::state::health`): ejected endpoints are left out (within
    /// `health.max_ejection_percent`) and recent failures count as load. An empty view (the
    /// default) ejects nothing.
    pub health: &'a HealthView,
    pub store: &'a dyn SharedStore,
    pub now_ms: u64,
}

/// One pick ([`Scheduler::pick`]): the request's model route and facts, the state it is read
/// against, the scope that narrows it, and the randomness of its tie-breaks.
pub struct PickInput<'a> {
    /// The model as [`Scheduler::route_model`] resolved it.
    pub route: &'a ModelRoute,
    pub request: PickRequest<'a>,
    pub state: PickState<'a>,
    pub scope: PickScope<'a>,
    pub rng: &'a mut dyn Rng,
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

/// The scheduler of one worker VM. Built once per configuration; holds the worker-local state
/// (the local prefix index).
#[derive(Debug, Clone)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    stale_after_ms: u64,
    /// Gateway replicas polling the same pods (`poller.replicas`): the share of the traffic
    /// this gateway does not see is `1 − 1 / gateways` (the rendezvous credit's scale).
    gateways: u32,
    /// `peers` is set: the replicas exchange placements, and the rendezvous credit is off.
    peers: bool,
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
    /// The TTFT prediction's online calibration (`slo::Calibration`).
    calibration: slo::Calibration,
    /// [`Scheduler::set_feed`]: keep each pick's placement for the other workers.
    feed: bool,
    /// The last pick's placement, until [`Scheduler::take_placement`].
    placement: Option<Placement>,
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
            peers: setup.peers,
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
            calibration: slo::Calibration::default(),
            feed: false,
            placement: None,
            cfg: sc,
        }
    }

    /// Whether the next picks keep their placement (the prompt's block hashes and the pod) for
    /// [`Scheduler::take_placement`]: set by the host when other workers of this Envoy are live
    /// (`crate::state::feed`); off, a pick allocates nothing for it.
    pub fn set_feed(&mut self, on: bool) {
        self.feed = on;
        self.placement = None;
    }

    /// The last pick's placement, once (`None` without [`Scheduler::set_feed`], or when the pick
    /// recorded no prefix: a short prompt, fail-open).
    pub fn take_placement(&mut self) -> Option<Placement> {
        self.placement.take()
    }

    /// Another worker's pick (`crate::state::feed`): its pod now holds its prompt's blocks, in
    /// this worker's index as if this worker had sent it, with the writer's capacity for it.
    pub fn observe(&mut self, p: &Placement) {
        let cap = usize::try_from(p.cap).unwrap_or(usize::MAX).max(1);
        self.local.record(&p.address, &p.hashes, cap);
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
            Some(o) => {
                self.calibration.observe(o.predicted_ms, o.ms);
                crate::state::rates::observe(
                    store,
                    endpoint_key(&o.address),
                    o.work,
                    o.ms,
                    self.cfg.predicted.prior_ms_per_token,
                )
            }
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
    /// through ([`Scheduler::pick`]). Unknown model → 404 `model_not_found`.
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
mod feed_tests;
#[cfg(test)]
mod slo_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod token_count_tests;
