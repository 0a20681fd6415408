//! The HTTP filter context: gathers inputs, calls `crate::request` and `crate::flow::admission`,
//! applies the decisions.
//!
//! A request flow control holds stays paused in this context while the filter root's tick
//! decides; the root then acts on it through [`release_held`] and [`answer_held`], which set the
//! effective context to the held request's. The per-request state both sides touch lives in an
//! [`Exchange`] shared by `Rc`: the context owns one, and the worker's `pending` map holds
//! another while the request is held.

use std::cell::RefCell;
use std::rc::Rc;

use log::warn;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use super::prof::timed;
use super::{io, Worker};
use crate::base::errors::{ErrorShape, Rejection};
use crate::base::ports::SharedStore;
use crate::base::telemetry;
use crate::flow::admission::{self, Decision};
use crate::flow::priority::PriorityHeaders;
use crate::request::pools::{self, Claim, HeadStep};
use crate::request::protocol::{
    DEBUG_SCORES_HEADER, DESTINATION_HEADER, MAX_RETRIES_HEADER, ORIGINAL_DST_HEADER, QUEUE_MS_HEADER,
    SERVED_HEADER,
};
use crate::request::{self, HeadDecision, Prepared, RequestHead};
use crate::scheduler::PickState;
use crate::state::health::{self, HealthView};

/// What one request has learned and decided so far.
#[derive(Default)]
pub(crate) struct Exchange {
    head: RequestHead,
    /// Set while the request waits for its endpoint pick (held by flow control).
    prepared: Option<Prepared>,
    /// When it was held (ms), for the queue time of an eviction.
    held_at_ms: Option<u64>,
    /// Endpoint whose in-flight count this request holds (released in on_log).
    holding: Option<String>,
    /// Prefill pod (`crate::request::pd`) whose in-flight count this request holds until its response
    /// headers (the remote prefill is over before the decode pod answers) or on_log.
    prefill_holding: Option<String>,
    primary: Option<String>,
    /// Primary then fallbacks, as sent (passive health attributes failed retries to them).
    destinations: Vec<String>,
    session_token: Option<String>,
    debug_scores: Option<String>,
    /// Time held by flow control, once the request went on (0 if never held).
    queue_ms: Option<u64>,
    /// A local reply was sent; ignore later callbacks.
    answered: bool,
    /// `filter.passthrough_prefixes`: the filter leaves this request alone.
    passthrough: bool,
    /// Size of the request body buffered so far (the last `on_http_request_body` size), for the
    /// trailers callback, which must decide on the same body.
    body_size: usize,
    /// `Pick::ticket`: the scheduler hears this request's first response byte and its end
    /// (predicted-TTFT prefill ledger and rate learning). 0: nothing to report.
    ticket: u64,
    /// The first response body chunk was reported.
    first_byte_seen: bool,
    /// Split P/D request (a prefill pod was named): its first byte teaches no rate.
    split: bool,
    /// A peer gateway's prefix records (`crate::poll::peers`): answered here once the body is in.
    peer: bool,
    /// The model sent upstream (the token counters' `model` label).
    model: Option<String>,
    /// The response's token usage being read (`filter.token_usage`, a routed 2xx response).
    usage: Option<crate::request::usage::UsageScan>,
    /// The prediction and TTFT target its first byte is compared with (`slo`).
    slo: Option<slo::Watch>,
}

mod count;
mod feed;
mod peer;
mod slo;
mod usage;

pub(crate) type Shared = Rc<RefCell<Exchange>>;

pub(crate) struct Filter {
    id: u32,
    worker: Rc<Worker>,
    ex: Shared,
}

impl Filter {
    pub fn new(id: u32, worker: Rc<Worker>) -> Self {
        Filter { id, worker, ex: Rc::new(RefCell::new(Exchange::default())) }
    }

    fn reject(&mut self, rej: &Rejection) -> Action {
        let shape = {
            let mut ex = self.ex.borrow_mut();
            ex.answered = true;
            ex.head.error_shape()
        };
        send_rejection(&self.worker, rej, shape, None, &[]);
        Action::Pause
    }

    /// The request is complete: the body has ended, or trailers came (an HTTP/2 request with
    /// trailers never delivers `end_of_stream` to the body callback). One path for both, so a
    /// request with trailers is decided exactly like one without: routed, held or answered,
    /// never passed on unrouted.
    fn on_complete_request(&mut self, body_size: usize) -> Action {
        let worker = self.worker.clone();
        let cfg = &worker.cfg;
        if body_size > cfg.filter.max_body_bytes {
            return self.reject(&request::too_large(&cfg.request()));
        }
        let body = timed!(
            "body_read",
            if body_size == 0 { Vec::new() } else { io::request_body(body_size).unwrap_or_default() }
        );
        let snapshot = timed!("snapshot", worker.snapshot());
        // Before the first metrics, model names resolve against the configured endpoints.
        let ready = admission::snapshot_ready(&snapshot);
        let resolving = if ready {
            snapshot.clone()
        } else {
            Rc::new(admission::startup_snapshot(&cfg.endpoints, &snapshot))
        };
        let prepared = timed!("prepare", {
            let scheduler = worker.scheduler.borrow();
            let mut rng = worker.rng.borrow_mut();
            let ex = self.ex.borrow();
            if cfg.pool.as_ref().is_some_and(|p| p.route_by_model) {
                let (prepared, reused) =
                    prepare_by_model(cfg, &scheduler, &mut *rng, &ex.head, &body, &resolving);
                let mut metrics = worker.metrics.borrow_mut();
                if reused {
                    metrics.count(telemetry::name(telemetry::POOL_PARSE_REUSED, &[]));
                }
                if matches!(prepared, Ok(None)) {
                    metrics.count(telemetry::name(telemetry::POOL_PASSED_ON, &[]));
                }
                prepared
            } else {
                request::prepare(&cfg.request(), &scheduler, &mut *rng, &ex.head, &body, &resolving).map(Some)
            }
        });
        let mut prepared = match prepared {
            Ok(Some(p)) => p,
            // Body-based routing: not this pool's model; the next pool's filter decides.
            Ok(None) => {
                self.ex.borrow_mut().passthrough = true;
                return Action::Continue;
            }
            Err(rej) => return self.reject(&rej),
        };
        if let Claim::Claim { pool, model_header } = pools::claim(cfg.pool.as_ref(), &prepared.route.base) {
            // Later pools' filters leave it alone; the header change makes Envoy re-match the
            // route. Without the claim a later pool's filter would remove the header: fail closed.
            if !io::set_stream_property(pools::CLAIM_PROPERTY, pool.as_bytes()) {
                return self.reject(&Rejection::new(
                    500,
                    "internal_error",
                    "pool_claim_failed",
                    "could not record the pool that serves this request",
                ));
            }
            io::set_request_header(pools::MODEL_HEADER, Some(model_header));
        }
        // The model rewrite does not depend on the endpoint: apply it now, while the body is in
        // hand, whether or not the request is held. Taken, so a held request does not keep it.
        if let Some(new_body) = prepared.new_body.take() {
            if !io::replace_request_body(body_size, &new_body) {
                return self.reject(&Rejection::new(
                    500,
                    "internal_error",
                    "body_rewrite_failed",
                    "could not rewrite the request body",
                ));
            }
            io::set_request_header("content-length", Some(&new_body.len().to_string()));
        }

        let store = io::HostStore;
        let now_ms = io::now_ms();
        let inflight = timed!("inflight_read", worker.inflight_counts(now_ms));
        let group = prepared.route.base.clone();
        let priority = prepared.priority.clone();
        self.ex.borrow_mut().prepared = Some(prepared);
        if !ready {
            return self.before_metrics(&worker, snapshot, &inflight, now_ms);
        }
        // A token count is no generation: flow control neither holds nor sheds it (`count`).
        if self.ex.borrow().head.is_count_tokens() {
            let health = timed!("health_view", health_view(&worker, &store, now_ms));
            let state = PickState {
                snapshot: &snapshot,
                inflight: &inflight,
                health: &health,
                store: &store,
                now_ms,
            };
            let routed = go(&worker, &mut self.ex.borrow_mut(), state);
            return match routed {
                Ok(()) => Action::Continue,
                Err(rej) => self.reject(&rej),
            };
        }
        // Flow control judges capacity without the endpoints passive health ejected.
        let health = timed!("health_view", health_view(&worker, &store, now_ms));
        let judged = timed!(
            "without_ejected",
            health::without_ejected(&snapshot, &health, now_ms, &cfg.health).map(Rc::new)
        );
        let decision = timed!(
            "admit",
            worker.gate.borrow_mut().admit(
                &store,
                judged.as_ref().unwrap_or(&snapshot),
                &inflight,
                self.id,
                &group,
                &priority,
                now_ms,
            )
        );
        match decision {
            Decision::Go => {
                let state = PickState {
                    snapshot: &snapshot,
                    inflight: &inflight,
                    health: &health,
                    store: &store,
                    now_ms,
                };
                let routed = timed!("go", go(&worker, &mut self.ex.borrow_mut(), state));
                match routed {
                    Ok(()) => Action::Continue,
                    Err(rej) => self.reject(&rej),
                }
            }
            Decision::Held { evicted } => {
                self.ex.borrow_mut().held_at_ms = Some(now_ms);
                worker.pending.borrow_mut().insert(self.id, self.ex.clone());
                if let Some((other, rej)) = evicted {
                    answer_held(&worker, other, &rej, None, self.id);
                }
                Action::Pause
            }
            Decision::Reject(rej) => {
                let mut ex = self.ex.borrow_mut();
                ex.answered = true;
                ex.prepared = None;
                let shape = ex.head.error_shape();
                drop(ex);
                send_rejection(&worker, &rej, shape, Some(0), &[]);
                Action::Pause
            }
        }
    }
}

/// Body-based routing (`crate::request::pools`): [`request::prepare`] with the body parsed once across
/// the pools' filters. A body an earlier pool's filter parsed comes from the stream's filter
/// state; a model this pool does not serve is passed on (`Ok(None)`) with the parsed body, for
/// the next pool's filter. Also says whether the body came parsed.
fn prepare_by_model(
    cfg: &crate::config::Config,
    scheduler: &crate::scheduler::Scheduler,
    rng: &mut dyn crate::base::ports::Rng,
    head: &RequestHead,
    body: &[u8],
    snapshot: &crate::state::snapshot::Snapshot,
) -> (Result<Option<Prepared>, Rejection>, bool) {
    let kind = crate::request::body::ApiKind::from_path(&head.path);
    let handed = io::stream_property(pools::PARSED_PROPERTY).and_then(|b| pools::decode_parsed(&b, kind));
    let reused = handed.is_some();
    let parsed = match handed {
        Some(p) => p,
        None => match crate::request::body::parse_request(&head.path, body) {
            Ok(p) => p,
            Err(rej) => return (Err(rej), false),
        },
    };
    let prepared = match scheduler.route_model(&parsed.model, head.session_id.as_deref(), snapshot, rng) {
        Ok(route) => request::prepare_routed(&cfg.request(), head, parsed, route, body).map(Some),
        Err(rej) if pools::passes_on(cfg.pool.as_ref(), &rej) => {
            if !reused {
                // If this fails the next pool's filter parses the body itself.
                io::set_stream_property(pools::PARSED_PROPERTY, &pools::encode_parsed(&parsed));
            }
            Ok(None)
        }
        Err(rej) => Err(rej),
    };
    (prepared, reused)
}

/// Counts a rejection and answers it on the current (or effective) context: in `shape`, the
/// error shape of the request's API (every caller passes `RequestHead::error_shape`, which
/// `request::protocol::error_shape` decides from the path), with the time flow control held the
/// request when it got that far, and `extra` headers.
fn send_rejection(
    worker: &Worker,
    rej: &Rejection,
    shape: ErrorShape,
    queue_ms: Option<u64>,
    extra: &[(&str, &str)],
) {
    worker.metrics.borrow_mut().count(telemetry::name(telemetry::REJECTIONS, &[("reason", rej.code)]));
    if worker.cfg.filter.decision_state {
        set_decision(&crate::request::decision::rejected(rej, queue_ms));
    }
    let queued = queue_ms.map(|q| q.to_string());
    let mut headers = extra.to_vec();
    if let Some(q) = &queued {
        headers.push((QUEUE_MS_HEADER, q));
    }
    io::send_rejection(rej, shape, &headers);
}

/// Sets the decision record's fields (`crate::request::decision`) in the stream's filter state.
fn set_decision(fields: &[(&'static str, std::borrow::Cow<'_, str>)]) {
    for (key, value) in fields {
        io::set_stream_property(key, value.as_bytes());
    }
}

/// Picks the endpoint of a prepared request and sets the routing headers on the current (or
/// effective) context: the last step of every request that goes upstream, whether at once (with
/// the snapshot and counts its admission just read) or after being held (with fresh ones).
/// `inputs`: the state of that moment, the passive-health view included.
fn go(worker: &Worker, ex: &mut Exchange, inputs: PickState<'_>) -> Result<(), Rejection> {
    if ex.head.is_count_tokens() {
        return count::go(worker, ex, inputs);
    }
    let Some(prepared) = ex.prepared.take() else {
        return Err(Rejection::new(500, "internal_error", "internal", "request state lost before routing"));
    };
    timed!("go.feed_read", feed::before_pick(worker, inputs.now_ms));
    let pick = {
        let mut scheduler = worker.scheduler.borrow_mut();
        let mut rng = worker.rng.borrow_mut();
        let routed = timed!(
            "go.route",
            request::route(&worker.cfg.request(), &mut scheduler, &mut *rng, &ex.head, &prepared, inputs)
        );
        routed.inspect_err(|r| slo::on_refused(worker, &prepared.priority, r))?
    };
    timed!("go.feed_write", feed::after_pick(worker));
    slo::on_pick(ex, &prepared.priority, &pick.pick, inputs.now_ms);
    if let Some(prefiller) = &pick.prefiller {
        io::set_request_header(crate::request::protocol::PREFILLER_HEADER, Some(prefiller));
        if let Err(e) = worker.inflight.borrow_mut().adjust(inputs.store, prefiller, 1, inputs.now_ms) {
            warn!("inference-picker: publishing the prefill in-flight increment failed: {e:?}");
        }
        ex.prefill_holding = Some(prefiller.clone());
        ex.split = true;
    }
    if worker.cfg.pd.is_some() {
        worker
            .metrics
            .borrow_mut()
            .count(telemetry::name(telemetry::PD_DECISIONS, &[("decision", pick.decision.as_str())]));
    }
    // Built once: the routing header, and the decision record's fallbacks (its tail).
    let destination = pick.pick.destination_header();
    if worker.cfg.filter.decision_state {
        timed!("go.decision_state", {
            let fields = crate::request::decision::routed(
                &pick.pick,
                &destination,
                pick.prefiller.as_deref(),
                &prepared.priority,
                ex.head.session_id.is_some(),
                ex.queue_ms.unwrap_or(0),
            );
            set_decision(&fields);
        });
    }
    let pick = pick.pick;
    timed!("go.headers", {
        io::set_request_header(DESTINATION_HEADER, Some(&destination));
        io::set_request_header(MAX_RETRIES_HEADER, Some(&pick.fallbacks.len().to_string()));
        io::set_request_header(ORIGINAL_DST_HEADER, Some(&pick.primary));
    });
    // The +1 counts locally even if publishing it fails (the next tick publishes it), so the
    // matching -1 is always due.
    ex.holding = Some(pick.primary.clone());
    // With the count, this worker's prefill queued there (its ledger, which the pick just
    // updated), so the other workers' predictions count it.
    let prefill = worker.scheduler.borrow().ledger_prefill(&pick.primary);
    if let Err(e) = timed!(
        "go.inflight_adjust",
        worker.inflight.borrow_mut().adjust_with_prefill(
            inputs.store,
            &pick.primary,
            1,
            prefill,
            inputs.now_ms
        )
    ) {
        warn!("inference-picker: publishing the in-flight increment failed: {e:?}");
    }
    let mut metrics = worker.metrics.borrow_mut();
    let per_endpoint = worker.cfg.filter.endpoint_metrics;
    // Names built in the metrics' reused buffer: no allocation per request.
    let model = ("model", pick.target_model.as_str());
    let outcome = ("outcome", pick.reason.as_str());
    if per_endpoint {
        // Read again after our own increment: `inputs.inflight` was read before the pick, and
        // another worker may have sent to the same pod since (both would set the old count + 1).
        let now = worker.inflight_counts(inputs.now_ms).get(&pick.primary);
        metrics.gauge_tagged(telemetry::ENDPOINT_INFLIGHT, &[("endpoint", &pick.primary)], u64::from(now));
    }
    match telemetry::endpoint_tag(per_endpoint, &pick.primary) {
        Some(ep) => metrics.count_tagged(telemetry::REQUESTS, &[model, ep, outcome]),
        None => metrics.count_tagged(telemetry::REQUESTS, &[model, outcome]),
    }
    metrics.gauge_tagged(
        telemetry::SNAPSHOT_AGE,
        &[],
        inputs.now_ms.saturating_sub(inputs.snapshot.published_ms),
    );
    ex.destinations = std::iter::once(pick.primary.clone()).chain(pick.fallbacks.iter().cloned()).collect();
    ex.model = Some(pick.target_model.clone());
    ex.primary = Some(pick.primary);
    ex.ticket = pick.ticket;
    ex.session_token = Some(pick.session_token);
    ex.debug_scores = pick.debug_scores;
    if ex.queue_ms.is_none() {
        ex.queue_ms = Some(0);
    }
    Ok(())
}

/// Lets a held request go (from the filter root's tick): pick its endpoint now, set the headers
/// and resume it. `own_context` is the caller's context id, restored afterwards.
pub(crate) fn release_held(worker: &Worker, id: u32, waited_ms: u64, own_context: u32) {
    let Some(shared) = worker.pending.borrow_mut().remove(&id) else {
        warn!("inference-picker: released request {id} is not pending");
        return;
    };
    if !io::set_effective_context(id) {
        return;
    }
    let mut ex = shared.borrow_mut();
    ex.queue_ms = Some(waited_ms);
    // Fresh reads: earlier releases of this tick changed the in-flight counts. A request held
    // for the first metrics may still have none (its wait ran out): failure_mode decides.
    let store = io::HostStore;
    let snapshot = match admission::routing_snapshot(
        worker.cfg.filter.failure_mode,
        &worker.cfg.endpoints,
        worker.snapshot(),
    ) {
        Ok(s) => s,
        Err(rej) => {
            ex.answered = true;
            ex.prepared = None;
            send_rejection(worker, &rej, ex.head.error_shape(), Some(waited_ms), &[]);
            drop(ex);
            io::set_effective_context(own_context);
            return;
        }
    };
    let now_ms = io::now_ms();
    let inflight = worker.inflight_counts(now_ms);
    let health = health_view(worker, &store, now_ms);
    let state =
        PickState { snapshot: &snapshot, inflight: &inflight, health: &health, store: &store, now_ms };
    match go(worker, &mut ex, state) {
        Ok(()) => io::resume_request(),
        Err(rej) => {
            ex.answered = true;
            send_rejection(worker, &rej, ex.head.error_shape(), Some(waited_ms), &[]);
        }
    }
    drop(ex);
    io::set_effective_context(own_context);
}

/// Answers a held request with a flow-control rejection (timeout, or evicted by a
/// higher-priority arrival). `waited_ms` None: work it out from when it was held.
pub(crate) fn answer_held(
    worker: &Worker,
    id: u32,
    rej: &Rejection,
    waited_ms: Option<u64>,
    own_context: u32,
) {
    let Some(shared) = worker.pending.borrow_mut().remove(&id) else {
        warn!("inference-picker: rejected request {id} is not pending");
        return;
    };
    let mut ex = shared.borrow_mut();
    ex.answered = true;
    // A sheddable request whose deadline passed while held counts as shed in its class.
    if let Some(p) = ex.prepared.take() {
        slo::on_refused(worker, &p.priority, rej);
    }
    let waited = waited_ms.unwrap_or_else(|| ex.held_at_ms.map_or(0, |t| io::now_ms().saturating_sub(t)));
    let shape = ex.head.error_shape();
    drop(ex);
    if io::set_effective_context(id) {
        send_rejection(worker, rej, shape, Some(waited), &[]);
        io::set_effective_context(own_context);
    }
}

/// The passive-health view for a pick (empty when `health.enabled` is false or shared data
/// cannot be read).
pub(crate) fn health_view(worker: &Worker, store: &dyn SharedStore, now_ms: u64) -> HealthView {
    if !worker.cfg.health.enabled {
        return HealthView::default();
    }
    match worker.health.borrow_mut().read(store, now_ms) {
        Ok(v) => v,
        Err(e) => {
            warn!("inference-picker: reading passive health failed: {e:?}");
            HealthView::default()
        }
    }
}

impl Filter {
    /// A complete request while the proxy has no metrics yet (startup, hot restart): hold it
    /// for the first snapshot (released by the root's tick through [`release_held`]), or, when
    /// it cannot be held, route it now as `filter.failure_mode` says.
    fn before_metrics(
        &mut self,
        worker: &Rc<Worker>,
        snapshot: Rc<crate::state::snapshot::Snapshot>,
        inflight: &crate::state::inflight::InflightCounts,
        now_ms: u64,
    ) -> Action {
        if worker.gate.borrow_mut().hold_for_snapshot(self.id, now_ms) {
            self.ex.borrow_mut().held_at_ms = Some(now_ms);
            worker.pending.borrow_mut().insert(self.id, self.ex.clone());
            worker
                .metrics
                .borrow_mut()
                .count(telemetry::name(telemetry::STARTUP_REQUESTS, &[("outcome", "held")]));
            return Action::Pause;
        }
        let snapshot = match admission::routing_snapshot(
            worker.cfg.filter.failure_mode,
            &worker.cfg.endpoints,
            snapshot,
        ) {
            Ok(s) => s,
            Err(rej) => {
                self.ex.borrow_mut().prepared = None;
                return self.reject(&rej);
            }
        };
        let store = io::HostStore;
        let health = health_view(worker, &store, now_ms);
        let state = PickState { snapshot: &snapshot, inflight, health: &health, store: &store, now_ms };
        let routed = go(worker, &mut self.ex.borrow_mut(), state);
        match routed {
            Ok(()) => Action::Continue,
            Err(rej) => self.reject(&rej),
        }
    }

    /// Passive health: tells `crate::state::health` what this request's upstream result says about
    /// each endpoint it tried (from `on_log`, once per stream), and counts any ejection.
    fn record_health(&mut self) {
        let worker = self.worker.clone();
        let cfg = &worker.cfg.health;
        let (destinations, generation) = {
            let mut ex = self.ex.borrow_mut();
            if ex.answered || !cfg.enabled {
                return;
            }
            (std::mem::take(&mut ex.destinations), !ex.head.is_count_tokens())
        };
        if destinations.is_empty() {
            return;
        }
        let r = timed!("rh.upstream_result", io::upstream_result(&destinations));
        let outcome = health::classify(r.status, &r.details, r.flags);
        let tried = health::attribute(&destinations, r.address.as_deref(), r.attempts, outcome);
        let now_ms = io::now_ms();
        let store = io::HostStore;
        let mut metrics = worker.metrics.borrow_mut();
        let heard = tried.into_iter().filter_map(|(addr, o)| {
            if generation {
                Some((addr, o))
            } else {
                health::from_non_generation(o).map(|o| (addr, o))
            }
        });
        for (addr, o) in heard {
            let kind = match o {
                health::Outcome::Success => "success",
                health::Outcome::Failure { gateway: false } => "failure",
                health::Outcome::Failure { gateway: true } => "gateway_failure",
                health::Outcome::Load => "load",
            };
            metrics.count_tagged(telemetry::HEALTH_RESULTS, &[("outcome", kind)]);
            match timed!("rh.record", worker.health.borrow_mut().record(&store, cfg, addr, o, now_ms)) {
                Ok(Some(e)) => {
                    warn!(
                        "inference-picker: endpoint {addr} ejected for {} ms ({}, ejection {} in a row)",
                        e.duration_ms,
                        e.reason.as_str(),
                        e.nth
                    );
                    // The endpoint tag only with filter.endpoint_metrics: names stay bounded.
                    let reason = ("reason", e.reason.as_str());
                    let tags = match telemetry::endpoint_tag(self.worker.cfg.filter.endpoint_metrics, addr) {
                        Some(ep) => vec![ep, reason],
                        None => vec![reason],
                    };
                    metrics.count(telemetry::name(telemetry::HEALTH_EJECTIONS, &tags));
                }
                Ok(None) => {}
                Err(e) => warn!("inference-picker: recording passive health for {addr} failed: {e:?}"),
            }
        }
    }
}

impl Context for Filter {
    fn on_done(&mut self) -> bool {
        // The stream is over (client gone, or finished): a held request must leave the queue.
        self.forget();
        true
    }
}

impl Filter {
    /// Gives back the prefill pod's in-flight count, if this request holds one. Idempotent.
    fn release_prefill(&mut self) {
        let held = self.ex.borrow_mut().prefill_holding.take();
        if let Some(addr) = held {
            let published = self.worker.inflight.borrow_mut().adjust(&io::HostStore, &addr, -1, io::now_ms());
            if let Err(e) = published {
                warn!("inference-picker: publishing the prefill in-flight release for {addr} failed: {e:?}");
            }
        }
    }

    /// Takes this request out of flow control if it is held. Idempotent.
    fn forget(&mut self) {
        let worker = &self.worker;
        worker.gate.borrow_mut().cancel(self.id, io::now_ms());
        worker.pending.borrow_mut().remove(&self.id);
    }
}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        timed!("hook.request_headers", self.request_headers(end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        timed!("hook.request_body", self.request_body(body_size, end_of_stream))
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        let body_size = {
            let ex = self.ex.borrow();
            if ex.passthrough {
                return Action::Continue;
            }
            if ex.answered {
                return Action::Pause;
            }
            if ex.peer {
                let size = ex.body_size;
                drop(ex);
                return self.peer_body(size, true);
            }
            ex.body_size
        };
        self.on_complete_request(body_size)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        timed!("hook.response_headers", self.response_headers())
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        timed!("hook.response_body", self.response_body());
        timed!("hook.response_usage", self.read_usage(body_size, end_of_stream));
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.finish_usage();
        Action::Continue
    }

    fn on_log(&mut self) {
        timed!("hook.log", self.on_log_inner());
        super::prof::request_ended();
    }
}

impl Filter {
    fn on_log_inner(&mut self) {
        // A body that ended without end_of_stream (the client left mid-stream) still reports.
        self.finish_usage();
        let ticket = std::mem::take(&mut self.ex.borrow_mut().ticket);
        if ticket != 0 {
            timed!("log.request_done", self.worker.scheduler.borrow_mut().request_done(ticket));
        }
        timed!("log.forget", self.forget());
        self.release_prefill();
        timed!("log.record_health", self.record_health());
        let holding = self.ex.borrow_mut().holding.take();
        if let Some(addr) = holding {
            let now_ms = io::now_ms();
            let prefill = self.worker.scheduler.borrow().ledger_prefill(&addr);
            let published = timed!(
                "log.inflight_adjust",
                self.worker.inflight.borrow_mut().adjust_with_prefill(
                    &io::HostStore,
                    &addr,
                    -1,
                    prefill,
                    now_ms
                )
            );
            if let Err(e) = published {
                warn!("inference-picker: publishing the in-flight release for {addr} failed: {e:?}");
            }
            if self.worker.cfg.filter.endpoint_metrics {
                let n = self.worker.inflight_counts(now_ms).get(&addr);
                let name = telemetry::name(telemetry::ENDPOINT_INFLIGHT, &[("endpoint", &addr)]);
                self.worker.metrics.borrow_mut().gauge(name, u64::from(n));
            }
            // Release as capacity frees: the finish lowered the live estimate at once.
            timed!("log.on_finish", self.worker.on_finish(&addr, self.id));
        }
    }
}

/// The HTTP hooks' bodies (the trait methods above time them with `timed!`).
impl Filter {
    fn request_headers(&mut self, end_of_stream: bool) -> Action {
        let worker = self.worker.clone();
        let cfg = &worker.cfg;
        // The exchange path of `peers` first: it is no inference request, and nothing of it may
        // reach a model server. One extra header read per request, only with `peers` set.
        if let Some(pc) = cfg.peers.as_ref() {
            if io::request_header(":path").as_deref() == Some(pc.path.as_str()) {
                return self.peer_headers(end_of_stream);
            }
        }
        // Several pools, body-based routing: a request another pool claimed is not ours; any
        // client-sent model header goes before anything else (crate::request::pools).
        let routing = cfg.pool.as_ref().is_some_and(|p| p.route_by_model);
        let claimed = if routing { io::stream_property(pools::CLAIM_PROPERTY) } else { None };
        match pools::on_head(cfg.pool.as_ref(), claimed.as_deref()) {
            HeadStep::PassThrough => {
                self.ex.borrow_mut().passthrough = true;
                return Action::Continue;
            }
            HeadStep::Handle { strip_model_header: true } => {
                io::set_request_header(pools::MODEL_HEADER, None)
            }
            HeadStep::Handle { strip_model_header: false } => {}
        }
        // Trusted priority headers are read first; then the priority headers and any
        // client-chosen destination are removed, on every path.
        // One host call reads them all; only the headers present are removed.
        let headers = io::RequestHeaders::read();
        // Test-only build (`crash-test`): the VM dies here, with other requests in flight.
        #[cfg(feature = "crash-test")]
        #[allow(clippy::panic)]
        if headers.contains("x-inference-picker-test-panic") {
            panic!("inference-picker: crash-test build, x-inference-picker-test-panic");
        }
        let get = |h: &str| headers.get(h);
        let session_id = request::session::session_id(&cfg.request(), &get);
        let priority =
            PriorityHeaders::read(&cfg.priority, &get).with_session(&cfg.priority, session_id.as_deref());
        let test_selection = request::conformance_selection(
            &cfg.request(),
            cfg.filter
                .conformance_mode
                .then(|| headers.get(request::protocol::CONFORMANCE_SELECTION_HEADER))
                .flatten()
                .as_deref(),
        );
        for h in request::headers_to_remove(&cfg.request()) {
            if headers.contains(h) {
                io::set_request_header(h, None);
            }
        }
        let head = RequestHead {
            method: headers.get(":method").unwrap_or_default(),
            path: headers.get(":path").unwrap_or_default(),
            content_length: headers.get("content-length").and_then(|v| v.trim().parse().ok()),
            session_id,
            session_token: headers.get(&cfg.scheduler.session.token_header),
            priority,
            test_selection,
        };
        let decision = match request::on_head(&cfg.request(), &head, end_of_stream) {
            HeadDecision::Models { id } => {
                request::models_reply(&cfg.request(), id.as_deref(), &worker.snapshot())
            }
            d => d,
        };
        self.ex.borrow_mut().head = head;
        match decision {
            HeadDecision::ReadBody => Action::Pause,
            HeadDecision::Reject { rejection, allow: None } => self.reject(&rejection),
            HeadDecision::Reject { rejection, allow: Some(allow) } => {
                let shape = {
                    let mut ex = self.ex.borrow_mut();
                    ex.answered = true;
                    ex.head.error_shape()
                };
                send_rejection(&worker, &rejection, shape, None, &[("allow", allow)]);
                Action::Pause
            }
            HeadDecision::Local(reply) => {
                self.ex.borrow_mut().answered = true;
                let headers: Vec<(&str, &str)> =
                    reply.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
                io::send_local_reply(reply.status, &headers, &reply.body);
                Action::Pause
            }
            HeadDecision::PassThrough => {
                self.ex.borrow_mut().passthrough = true;
                Action::Continue
            }
            // Answered by `models_reply` above; never reaches here.
            HeadDecision::Models { .. } => {
                self.reject(&Rejection::new(500, "internal_error", "internal", "model list"))
            }
        }
    }

    fn request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        {
            let mut ex = self.ex.borrow_mut();
            if ex.passthrough {
                return Action::Continue;
            }
            if ex.answered {
                return Action::Pause;
            }
            ex.body_size = body_size;
        }
        if self.ex.borrow().peer {
            return self.peer_body(body_size, end_of_stream);
        }
        if body_size > self.worker.cfg.filter.max_body_bytes {
            return self.reject(&request::too_large(&self.worker.cfg.request()));
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.on_complete_request(body_size)
    }

    fn response_headers(&mut self) -> Action {
        self.release_prefill();
        // Only a streamed response's first body byte is its first token: a non-streamed one
        // arrives whole at the end, so it teaches no prefill rate (its ledger entry ends in
        // `on_log`).
        let routed = {
            let ex = self.ex.borrow();
            ex.primary.is_some() && !ex.answered && !ex.passthrough
        };
        // A token count's answer (`{"input_tokens": N}`) is no usage: nothing was generated.
        let usage = routed && self.worker.cfg.filter.token_usage && !self.ex.borrow().head.is_count_tokens();
        let slo_watch = routed && self.ex.borrow().slo.is_some();
        let content_type = if self.ex.borrow().ticket != 0 || usage || slo_watch {
            timed!("rsp.content_type", io::response_header("content-type"))
        } else {
            None
        };
        if self.ex.borrow().ticket != 0
            && !content_type.as_deref().is_some_and(|c| c.contains("text/event-stream"))
        {
            self.ex.borrow_mut().first_byte_seen = true;
        }
        if slo_watch && !content_type.as_deref().is_some_and(|c| c.contains("text/event-stream")) {
            slo::on_first_byte(&self.worker, &mut self.ex.borrow_mut(), false);
        }
        if usage {
            timed!("rsp.usage", self.start_usage(content_type.as_deref()));
        }
        let ex = self.ex.borrow();
        if ex.answered || ex.passthrough {
            return Action::Continue;
        }
        // Name the pod that really answered: after a retry Envoy's override_host policy sent the
        // request to a fallback. A reply Envoy made itself (every listed pod failed) names none.
        if ex.primary.is_some() {
            if let Some(served) = timed!("rsp.upstream", io::upstream_that_answered()) {
                if self.worker.cfg.filter.expose_served_endpoint {
                    timed!("rsp.served_header", io::set_response_header(SERVED_HEADER, &served));
                }
                if self.worker.cfg.filter.conformance_mode {
                    io::set_response_header(request::protocol::CONFORMANCE_SERVED_HEADER, &served);
                }
                if ex.session_token.is_some() {
                    let token =
                        timed!("rsp.token", self.worker.scheduler.borrow().session_keys().token_for(&served));
                    io::set_response_header(&self.worker.cfg.scheduler.session.token_header, &token);
                }
            }
        }
        if let Some(d) = &ex.debug_scores {
            io::set_response_header(DEBUG_SCORES_HEADER, d);
        }
        if let Some(q) = ex.queue_ms {
            io::set_response_header(QUEUE_MS_HEADER, &q.to_string());
        }
        Action::Continue
    }

    fn response_body(&mut self) {
        // A streamed response's first byte: its TTFT against the prediction and the target.
        if self.ex.borrow().slo.is_some() {
            let mut ex = self.ex.borrow_mut();
            let measured = !ex.split;
            slo::on_first_byte(&self.worker, &mut ex, measured);
        }
        // The first response byte ends the request's prefill: the scheduler learns the endpoint's
        // rate from the time since it was sent (one shared-data CAS write, once per request).
        let (ticket, seen) = {
            let ex = self.ex.borrow();
            (ex.ticket, ex.first_byte_seen)
        };
        if ticket != 0 && !seen {
            let split = {
                let mut ex = self.ex.borrow_mut();
                ex.first_byte_seen = true;
                ex.split
            };
            let mut scheduler = self.worker.scheduler.borrow_mut();
            if split {
                // A prefill pod did the prefill: this time is not the decode pod's rate.
                scheduler.first_byte_unobserved(ticket);
            } else {
                let served = io::upstream_that_answered();
                if let Err(e) = scheduler.first_byte(ticket, served.as_deref(), &io::HostStore, io::now_ms())
                {
                    warn!("inference-picker: recording the first-byte time failed: {e:?}");
                }
            }
            // Its prefill is over: the other workers stop counting it ahead of theirs (one read
            // and one write of this VM's in-flight record).
            let ex = self.ex.borrow();
            if let Some(addr) = ex.holding.as_deref() {
                let prefill = scheduler.ledger_prefill(addr);
                drop(scheduler);
                let published = self.worker.inflight.borrow_mut().set_prefill(
                    &io::HostStore,
                    addr,
                    prefill,
                    io::now_ms(),
                );
                if let Err(e) = published {
                    warn!("inference-picker: publishing the end of a prefill on {addr} failed: {e:?}");
                }
            }
        }
    }
}
