//! The pick ([`Scheduler::pick`]), one named step a function, in the order of the stages of the
//! `scheduler` module doc: model → filter → fail open → candidates → guard → prefix → score →
//! predict → choose → record. Each step reads what the ones before it produced (the structs
//! below) and nothing else; the decisions are those of the single function it was split from.

use std::fmt::Write as _;

use crate::base::errors::Rejection;
use crate::base::num;
use crate::base::ports::Rng;
use crate::scheduler::config::FailureMode;
use crate::state::by_address::address_hash;
use crate::state::feed::Placement;
use crate::state::inflight::EndpointLoad;
use crate::state::prefix_shared::{endpoint_key, endpoint_key_of_hash, Lookup};
use crate::state::snapshot::EndpointStatus;

use super::config::{Objective, Weights};
use super::{
    filter, guard, inflight, kv, lora, models, neutral_score, picker, predict, prefix, queue, session, slo,
    SloAsk, SloVerdict,
};
use super::{
    Breakdown, Candidate, ModelRoute, Pick, PickInput, PickReason, PickRequest, PickScope, PickState,
    Scheduler, DEBUG_MAX_ENDPOINTS,
};

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
    /// The requests waiting there (`predict::waiting`), for the miss penalty's `busy`.
    waiting: f64,
}

/// What one pick reads and does not change: the request, the state, the scope, and step 1's
/// result (the model the endpoints must serve and the weights of this pick).
struct Ask<'a> {
    route: &'a ModelRoute,
    req: PickRequest<'a>,
    st: PickState<'a>,
    scope: PickScope<'a>,
    resolved: models::Resolved<'a>,
    weights: Weights,
    /// Objective `predicted_ttft`.
    predicted: bool,
    /// The prompt's length in tokens (`prefix.chars_per_token` bytes a token).
    prompt_tokens: f64,
}

/// Step 2's result: the endpoints serving the model (their count, and the list itself when it
/// was needed), and the healthy ones among them.
struct Filtered<'s> {
    n_serving: usize,
    serving: Vec<&'s EndpointStatus>,
    healthy: Vec<&'s EndpointStatus>,
}

/// Steps 4 and 5: the candidates (the healthy endpoints), what is read once for each, the
/// hot-spot guard's verdict and the LoRA scores.
struct Pool<'s> {
    cands: Vec<Candidate<'s>>,
    /// Address hash (`crate::state::by_address`): its entry in every table keyed by address,
    /// its key in the cross-worker ones, its rendezvous seed.
    addr_hash: Vec<u64>,
    /// This gateway's in-flight count and the prefill the workers queued there.
    loads: Vec<EndpointLoad>,
    /// The live queue estimate (`live_queue` or objective `predicted_ttft`; empty otherwise).
    live: Vec<Option<f64>>,
    overloaded: Vec<bool>,
    eligible: Vec<bool>,
    /// Adapter affinity (empty for a request without an adapter).
    lora: Vec<f64>,
}

/// Step 6: the prompt's block hashes, the cross-worker lookup (kept for the write) and the
/// blocks each candidate is believed to hold.
struct Prefix {
    hashes: Vec<u64>,
    lookup: Lookup,
    matched: Vec<usize>,
}

impl Prefix {
    /// The prefix score of candidate `i` (0 when overloaded).
    fn score_of(&self, pool: &Pool<'_>, i: usize) -> f64 {
        if pool.eligible.get(i).copied().unwrap_or(false) {
            prefix::score(self.matched.get(i).copied().unwrap_or(0), self.hashes.len())
        } else {
            0.0
        }
    }
}

/// What step 8 reads for every candidate alike: the learnt rates, the mean prompt, and the
/// rendezvous winner with its credit.
struct Basis {
    rates: Vec<f64>,
    /// Mean uncached tokens of this worker's pending requests (the prompt's when none).
    mean: f64,
    winner: Option<usize>,
    /// The factor on the winner's uncached tokens (`1 − credit share`).
    credit: f64,
}

/// Step 8: each candidate's prediction and ranking cost (empty under objective `weighted`).
#[derive(Default)]
struct Predicted {
    pred: Vec<Prediction>,
    costs: Vec<f64>,
}

/// Step 9: the candidates in order (primary first), why the primary, and what the prediction
/// said of the request's TTFT target.
struct Choice {
    order: Vec<usize>,
    reason: PickReason,
    slo: Option<SloVerdict>,
}

/// Endpoint `e` serves `base` and the scope allows it.
fn serves(e: &EndpointStatus, base: &str, scope: &PickScope<'_>) -> bool {
    filter::serves(e, base) && scope.allows(e)
}

impl Scheduler {
    /// Picks the endpoint (and fallbacks) of one request whose model [`Scheduler::route_model`]
    /// resolved: filters, passive health, guard, scores, picker, prefix record (the stages of
    /// the module doc). `input.request.model` is not read (the route has the target); an empty
    /// health view ejects nothing; the default scope narrows nothing.
    pub fn pick(&mut self, input: PickInput<'_>) -> Result<Pick, Rejection> {
        let PickInput { route, request, state, scope, rng } = input;
        let ask = self.model_step(route, request, state, scope);
        let filtered = self.filter_step(&ask)?;
        if filtered.healthy.is_empty() {
            return self.fail_open_step(&ask, filtered, rng);
        }
        let mut pool = self.candidates_step(&ask, &filtered.healthy);
        self.guard_step(&ask, &mut pool);
        let mut px = self.prefix_step(&ask, &pool);
        let mut rows = self.score_step(&ask, &pool, &px);
        let pr =
            if ask.predicted { self.predict_step(&ask, &pool, &px, &mut rows) } else { Predicted::default() };
        let choice = self.choose_step(&ask, &pool, &px, &rows, &pr, rng)?;
        let Some(&p) = choice.order.first() else {
            // Unreachable: the pool is not empty, so the picker returns at least one index.
            return Err(Rejection::new(500, "internal_error", "internal", "scheduler picked nothing"));
        };
        let primary_cand = pool.cands.get(p).copied();
        let primary = primary_cand.map(|c| c.address.to_string()).unwrap_or_default();
        let fallbacks = choice
            .order
            .iter()
            .skip(1)
            .filter_map(|&i| pool.cands.get(i))
            .map(|c| c.address.to_string())
            .collect();
        let prefix_score = px.score_of(&pool, p);
        let debug_scores =
            self.cfg.debug_scores.then(|| debug_string(&pool.cands, &rows, &pool.overloaded, ask.predicted));
        let (predicted_ms, ticket) = match (ask.predicted, primary_cand) {
            (true, Some(c)) => {
                let pp = pr.pred.get(p);
                let u = pp.map_or(ask.prompt_tokens, |x| x.uncached);
                let w = pp.map_or(u, |x| x.work);
                let ticket = self.ledger.sent(c.address, u, w, ask.st.now_ms);
                if let Some(x) = pp {
                    self.ledger.note_prediction(ticket, x.ttft);
                }
                // Reported calibrated (`slo::Calibration`), as the target compares it.
                (pp.map(|x| self.calibration.correct(x.ttft)), ticket)
            }
            _ => (None, 0),
        };
        self.record_step(&ask, &pool, &mut px, p);
        let prefix_blocks = px.hashes.len();
        self.hashes = px.hashes;
        Ok(Pick {
            session_token: self.session_keys.token_for(&primary),
            primary,
            fallbacks,
            target_model: route.target_model.clone(),
            model_rewritten: route.model_rewritten,
            fail_open: false,
            debug_scores,
            reason: choice.reason,
            serving: filtered.n_serving,
            healthy: filtered.healthy.len(),
            overloaded: pool.overloaded.iter().filter(|o| **o).count(),
            prefix_score,
            prefix_blocks,
            predicted_ms,
            slo: choice.slo,
            ticket,
        })
    }

    /// The pick of a request that is not a generation (Anthropic's token count: the pod only
    /// tokenizes): steps 1 to 3 as [`Scheduler::pick`] takes them (the model's serving endpoints
    /// allowed by the scope, passive health's ejections left out, the healthy ones; none healthy:
    /// fail open as `filter.failure_mode` says), then the healthy endpoint with the fewest
    /// requests in flight (passive health's phantom load counted), equal counts chosen at random
    /// so that such calls spread over the pods, and fallbacks by count. No score, no prediction,
    /// no prefix hashed; `&self`: nothing is recorded (no ledger entry, ticket 0; no prefix
    /// placement in this worker's index, the cross-worker table or the feed). The request's
    /// prompt, session and target are not read.
    pub fn pick_least_loaded(&self, input: PickInput<'_>) -> Result<Pick, Rejection> {
        let PickInput { route, request, state, scope, rng } = input;
        let ask = self.model_step(route, request, state, scope);
        let filtered = self.filter_step(&ask)?;
        if filtered.healthy.is_empty() {
            return self.fail_open_step(&ask, filtered, rng);
        }
        let (inflight, health, now_ms) = (state.inflight, state.health, state.now_ms);
        let load =
            |addr: &str| inflight.get(addr).saturating_add(health.phantom_load(addr, now_ms, &self.health));
        // As in `fail_open`: fewer in flight is better, a tie epsilon of 0.5 groups equal counts.
        let totals: Vec<f64> = filtered.healthy.iter().map(|e| -f64::from(load(&e.address))).collect();
        let order = picker::order(&totals, 0.5, 1, self.cfg.fallbacks, rng);
        let mut addrs = order.iter().filter_map(|&i| filtered.healthy.get(i)).map(|e| e.address.clone());
        let primary = addrs.next().unwrap_or_default();
        Ok(Pick {
            session_token: self.session_keys.token_for(&primary),
            primary,
            fallbacks: addrs.collect(),
            target_model: route.target_model.clone(),
            model_rewritten: route.model_rewritten,
            fail_open: false,
            debug_scores: None,
            reason: PickReason::TokenCount,
            serving: filtered.n_serving,
            healthy: filtered.healthy.len(),
            overloaded: 0,
            prefix_score: 0.0,
            prefix_blocks: 0,
            predicted_ms: None,
            slo: None,
            ticket: 0,
        })
    }

    /// Step 1, Model (resolved by `route_model`): the base model and adapter, and the weights of the
    /// target model as the scope maps them.
    fn model_step<'a>(
        &self,
        route: &'a ModelRoute,
        req: PickRequest<'a>,
        st: PickState<'a>,
        scope: PickScope<'a>,
    ) -> Ask<'a> {
        let resolved = models::Resolved { base: &route.base, adapter: route.adapter.as_deref() };
        let mut weights = self.weights_for(&route.target_model, resolved.base);
        if let Some(map) = scope.weights {
            weights = map(weights);
        }
        let cpt = self.cfg.prefix.chars_per_token.max(1) as f64;
        Ask {
            route,
            req,
            st,
            scope,
            resolved,
            weights,
            predicted: self.cfg.objective == Objective::PredictedTtft,
            prompt_tokens: req.prompt.len() as f64 / cpt,
        }
    }

    /// Step 2, Filters: the endpoints serving the model (none → 503 `no_endpoint`), then passive
    /// health's ejections, then the healthy ones. Without passive-health data nothing is
    /// ejected: one pass counts the serving endpoints and keeps the healthy ones (the serving
    /// list itself is only needed to fail open).
    fn filter_step<'a>(&self, ask: &Ask<'a>) -> Result<Filtered<'a>, Rejection> {
        let (st, base, scope) = (&ask.st, ask.resolved.base, &ask.scope);
        let (health, now_ms) = (st.health, st.now_ms);
        let healthy_now = |e: &EndpointStatus| filter::healthy(e, now_ms, self.stale_after_ms);
        let mut f = Filtered { n_serving: 0, serving: Vec::new(), healthy: Vec::new() };
        if health.is_empty() {
            f.healthy.reserve(st.snapshot.endpoints.len());
            for e in &st.snapshot.endpoints {
                if serves(e, base, scope) {
                    f.n_serving += 1;
                    if healthy_now(e) {
                        f.healthy.push(e);
                    }
                }
            }
        } else {
            f.serving = st.snapshot.endpoints.iter().filter(|e| serves(e, base, scope)).collect();
            f.n_serving = f.serving.len();
        }
        if f.n_serving == 0 {
            return Err(Rejection::new(
                503,
                "service_unavailable",
                "no_endpoint",
                format!("No endpoint serves the model `{}`.", ask.route.target_model),
            )
            .with_retry_after(1));
        }
        if !health.is_empty() {
            // Passive health: ejected endpoints are not candidates, even to fail open.
            f.serving = filter::not_ejected(&f.serving, health, now_ms, &self.health);
            f.n_serving = f.serving.len();
            f.healthy = f.serving.iter().copied().filter(|e| healthy_now(e)).collect();
        }
        Ok(f)
    }

    /// Step 3, No healthy endpoint: 503 `no_healthy_endpoint` when the scope forbids failing open,
    /// else [`Scheduler::fail_open`] among the serving endpoints.
    fn fail_open_step<'a>(
        &self,
        ask: &Ask<'a>,
        mut f: Filtered<'a>,
        rng: &mut dyn Rng,
    ) -> Result<Pick, Rejection> {
        let route = ask.route;
        if ask.scope.no_fail_open {
            return Err(no_healthy_endpoint(&route.target_model));
        }
        let (inflight, health, now_ms) = (ask.st.inflight, ask.st.health, ask.st.now_ms);
        let load =
            |addr: &str| inflight.get(addr).saturating_add(health.phantom_load(addr, now_ms, &self.health));
        if health.is_empty() {
            let (base, scope) = (ask.resolved.base, &ask.scope);
            f.serving = ask.st.snapshot.endpoints.iter().filter(|e| serves(e, base, scope)).collect();
        }
        let mut pick =
            self.fail_open(&f.serving, &load, rng, route.target_model.clone(), route.model_rewritten)?;
        // No prediction for a pod that is not healthy: the target cannot be judged.
        pick.slo = ask.req.slo.map(|_| SloVerdict::Unknown);
        Ok(pick)
    }

    /// Step 4, Candidates: per healthy endpoint, once, its address hash, this gateway's in-flight
    /// count (plus passive health's phantom load), and the live queue estimate (read by the
    /// queue scorer with `live_queue`, and by the prediction).
    fn candidates_step<'a>(&self, ask: &Ask<'_>, healthy: &[&'a EndpointStatus]) -> Pool<'a> {
        let (health, now_ms) = (ask.st.health, ask.st.now_ms);
        let need_live = self.cfg.live_queue || ask.predicted;
        let addr_hash: Vec<u64> = healthy.iter().map(|e| address_hash(&e.address)).collect();
        // One probe per candidate for its count and the prefill the workers queued there.
        let loads: Vec<EndpointLoad> = healthy
            .iter()
            .zip(&addr_hash)
            .map(|(e, &h)| ask.st.inflight.load_hashed(h, &e.address))
            .collect();
        let live: Vec<Option<f64>> = if need_live {
            healthy
                .iter()
                .zip(&loads)
                .map(|(e, l)| crate::state::load::live_queue(e, l.n, now_ms, self.stale_after_ms))
                .collect()
        } else {
            Vec::new()
        };
        let cands: Vec<Candidate<'a>> = healthy
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
        Pool { cands, addr_hash, loads, live, overloaded: Vec::new(), eligible: Vec::new(), lora: Vec::new() }
    }

    /// Step 5, Guard: the candidates overloaded compared with the least loaded; and the adapter
    /// affinity of a LoRA request.
    fn guard_step(&self, ask: &Ask<'_>, pool: &mut Pool<'_>) {
        pool.overloaded = guard::overloaded(&pool.cands, &self.cfg.guard);
        pool.eligible = pool.overloaded.iter().map(|o| !o).collect();
        let adapter = ask.resolved.adapter;
        if adapter.is_some() {
            pool.lora = lora::scores(adapter, &pool.cands);
        }
    }

    /// Step 6, Prefix: hash the prompt's blocks, then each candidate's local and cross-worker match.
    fn prefix_step(&mut self, ask: &Ask<'_>, pool: &Pool<'_>) -> Prefix {
        let mut hashes = std::mem::take(&mut self.hashes);
        let pc = &self.cfg.prefix;
        prefix::block_hashes(
            ask.req.prompt,
            prefix::seed(&ask.route.target_model, ask.req.cache_salt),
            pc.block_chars,
            pc.max_blocks,
            &mut hashes,
        );
        let snapshot = ask.st.snapshot;
        self.local.sync(snapshot.version, &mut snapshot.endpoints.iter().map(|e| e.address.as_str()));
        let lookup =
            if hashes.is_empty() { Default::default() } else { self.shared.lookup(ask.st.store, &hashes) };
        let hit_filter = lookup.key_filter();
        let matched: Vec<usize> = if hashes.is_empty() {
            vec![0; pool.cands.len()]
        } else {
            pool.cands
                .iter()
                .zip(&pool.addr_hash)
                .map(|(c, &h)| {
                    let local = self.local.matched_hashed(h, c.address, &hashes);
                    let shared = lookup.matched_filtered(endpoint_key_of_hash(h), hit_filter);
                    local.max(shared)
                })
                .collect()
        };
        Prefix { hashes, lookup, matched }
    }

    /// Step 7, Scores: each candidate's breakdown and weighted total. Under `predicted_ttft` the
    /// queue, KV, in-flight and session scores and the total decide nothing (they are shown in
    /// the debug scores): computed only when read (else no rows).
    fn score_step(&self, ask: &Ask<'_>, pool: &Pool<'_>, px: &Prefix) -> Vec<Breakdown> {
        let mut rows: Vec<Breakdown> = Vec::new();
        if ask.predicted && !self.cfg.debug_scores {
            return rows;
        }
        let cands = &pool.cands;
        let q = queue::scores(cands);
        let kv = kv::scores(cands);
        let inf = inflight::scores(cands);
        let sess = session::scores(ask.req.session_id, cands, &pool.eligible);
        rows.reserve(cands.len());
        for i in 0..cands.len() {
            let get = |v: &[f64]| v.get(i).copied().unwrap_or(0.0);
            let ok = pool.eligible.get(i).copied().unwrap_or(false);
            let mut b = Breakdown {
                prefix: px.score_of(pool, i),
                queue: get(&q),
                kv_cache: get(&kv),
                inflight: get(&inf),
                session: if ok { get(&sess) } else { 0.0 },
                lora: get(&pool.lora),
                total: 0.0,
                predicted_ms: 0.0,
                work: 0.0,
                rate: 0.0,
            };
            b.total = b.weighted(&ask.weights);
            rows.push(b);
        }
        rows
    }

    /// Step 8, Objective `predicted_ttft`: each candidate's predicted TTFT (`predict`), its work,
    /// uncached tokens and rate, and the cost that ranks it (copied into the score rows).
    fn predict_step(
        &mut self,
        ask: &Ask<'_>,
        pool: &Pool<'_>,
        px: &Prefix,
        rows: &mut [Breakdown],
    ) -> Predicted {
        let keys: Vec<u32> = pool.addr_hash.iter().map(|&h| endpoint_key_of_hash(h)).collect();
        let rates =
            self.rates.rates(ask.st.store, &keys, self.cfg.predicted.prior_ms_per_token, ask.st.now_ms);
        let pr = &self.cfg.predicted;
        let mean = self.ledger.mean_tokens().unwrap_or(ask.prompt_tokens);
        // Nothing distinguishes the pods for this prefix (no eligible one holds more of it than
        // every other, e.g. only a system prompt all share): the rendezvous winner is where
        // another gateway most likely sent its earlier turns. Credit scaled by the share of the
        // traffic other gateways see (`predict`, "Rendezvous credit"). Not for an adapter
        // request: where its adapter is loaded is a signal every gateway scrapes alike, and the
        // LoRA factor already follows it.
        let credit_share = if ask.resolved.adapter.is_some() || self.peers {
            0.0
        } else {
            predict::rendezvous_credit_share(pr.rendezvous_credit, self.gateways)
        };
        let winner = if credit_share > 0.0 && predict::nothing_distinguishes(&px.matched, &pool.eligible) {
            predict::rendezvous_key(ask.req.session_id, &px.hashes, pr.rendezvous_blocks)
                .and_then(|k| predict::rendezvous_winner(k, &pool.addr_hash, &pool.eligible))
        } else {
            None
        };
        let basis = Basis { rates, mean, winner, credit: 1.0 - credit_share };
        let pred = self.predictions(ask, pool, px, &basis);
        let at_stake = !predict::nothing_distinguishes(&px.matched, &pool.eligible);
        let costs = self.costs(&pred, &pool.eligible, at_stake);
        for (r, p) in rows.iter_mut().zip(&pred) {
            // Shown calibrated, as the target compares it (`slo::Calibration`).
            r.predicted_ms = self.calibration.correct(p.ttft);
            r.work = p.work;
            r.rate = p.rate;
        }
        Predicted { pred, costs }
    }

    /// Step 8 per candidate: its uncached tokens (the rendezvous winner's scaled by the
    /// credit), the prefill queued there, its wait, work and predicted TTFT.
    fn predictions(&self, ask: &Ask<'_>, pool: &Pool<'_>, px: &Prefix, basis: &Basis) -> Vec<Prediction> {
        let pc = &self.cfg.prefix;
        let pr = &self.cfg.predicted;
        let cpt = pc.chars_per_token.max(1) as f64;
        let mut pred = Vec::with_capacity(pool.cands.len());
        let inputs = pool.cands.iter().zip(&pool.addr_hash).zip(&pool.eligible).zip(&px.matched);
        let inputs = inputs.zip(&pool.live).zip(&basis.rates);
        for (i, (((((c, &h), &ok), &m), &waiting), &rate)) in inputs.enumerate() {
            let m = if ok { m } else { 0 };
            // No block cached (most candidates): 0 without a division.
            let cached = if m == 0 { 0.0 } else { (m * pc.block_chars) as f64 / cpt };
            let mut own = num::max(ask.prompt_tokens - cached, 0.0);
            if basis.winner == Some(i) {
                own *= basis.credit;
            }
            // The prefill queued there by every worker of this gateway (their ledgers, published
            // with the in-flight counts), or this worker's own when that is more (its latest pick
            // may not be published yet).
            let (mine, active) = self.ledger.pending_and_active(h, c.address);
            let shared = pool.loads.get(i).map_or((0.0, 0), |l| l.prefill());
            let pending = if shared.1 > mine.1 { shared } else { mine };
            let inp = predict::Inputs {
                uncached: own,
                pending,
                waiting,
                inflight: c.inflight,
                rate,
                lora: ask.resolved.adapter.map(|_| pool.lora.get(i).copied().unwrap_or(0.0)),
                active: pr.active_weight * active,
            };
            let waiting = predict::waiting(&inp);
            let work = predict::work_given_waiting(&inp, basis.mean, waiting);
            pred.push(Prediction {
                ttft: predict::ttft_of_work(&inp, work),
                work,
                rate: inp.rate,
                usable_rate: predict::usable_rate(inp.rate),
                uncached: inp.uncached,
                kv_free: kv::free(c),
                waiting,
            });
        }
        pred
    }

    /// Step 8's ranking: predicted TTFT plus the miss penalty (`predict`, "Cost"), times the KV
    /// congestion factor (`predict`, "KV congestion"; a missing usage takes the KV scorer's
    /// neutral fill, so a pod without the metric never looks emptier than the others). The
    /// factor stops at `kv_full_at` except for a pod with nothing waiting when no hit is at
    /// stake (`hits_at_stake`: some eligible pod holds more of the prompt than another) and this
    /// is the only gateway replica (`poller.replicas` 1): several replicas agree on a new
    /// prompt's pod through the rendezvous among pods that rank alike, and an uncapped factor
    /// would split them.
    fn costs(&self, pred: &[Prediction], eligible: &[bool], hits_at_stake: bool) -> Vec<f64> {
        let pr = &self.cfg.predicted;
        // Sum and count of the eligible candidates' queues: the miss penalty's `busy`.
        let (mut queue_sum, mut queue_n) = (0.0, 0.0);
        // The lowest known KV score: the neutral fill of a missing one.
        let mut lowest_free = f64::INFINITY;
        for (p, &ok) in pred.iter().zip(eligible) {
            if ok {
                queue_sum += p.waiting;
                queue_n += 1.0;
            }
            if let Some(f) = p.kv_free {
                lowest_free = num::min(lowest_free, f);
            }
        }
        let least = predict::least_uncached_of(pred.iter().map(|p| p.uncached), eligible);
        let busy = if queue_n > 0.0 { queue_sum / queue_n } else { 0.0 };
        let penalty = predict::MissPenalty::new(least, busy, pr.miss_weight);
        let neutral_free = neutral_score(lowest_free);
        let capped = predict::kv_full_at(pr.kv_full_at, true);
        pred.iter()
            .map(|p| {
                let cost = p.ttft + penalty.of_usable_rate(p.usable_rate, p.uncached);
                let full_at = if !hits_at_stake && p.waiting < 1.0 && self.gateways == 1 {
                    predict::kv_full_at(pr.kv_full_at, false)
                } else {
                    capped
                };
                if full_at > 0.0 {
                    cost * predict::kv_congestion(1.0 - p.kv_free.unwrap_or(neutral_free), full_at)
                } else {
                    cost
                }
            })
            .collect()
    }

    /// Step 9, Choose: the session token's endpoint when it names a healthy, non-overloaded
    /// candidate (and, for a request with a TTFT target, one predicted to meet it when some pod
    /// is), else the picker's order (predicted TTFT with rendezvous affinity, among the pods
    /// that meet the target (`slo`), or the weighted totals); then the fallbacks. A sheddable
    /// request no pod can serve in time is refused here (`slo`, rule 2).
    fn choose_step(
        &self,
        ask: &Ask<'_>,
        pool: &Pool<'_>,
        px: &Prefix,
        rows: &[Breakdown],
        pr: &Predicted,
        rng: &mut dyn Rng,
    ) -> Result<Choice, Rejection> {
        let (cands, eligible) = (&pool.cands, &pool.eligible);
        let mut token_pick =
            ask.req.session_token.and_then(|t| self.session_keys.resolve(t, cands, eligible));
        let (plan, verdict) = match (ask.req.slo, ask.predicted) {
            (Some(s), true) => {
                let (plan, v) = self.slo_plan(&s, pool, pr);
                (plan, Some(v))
            }
            (Some(_), false) => (slo::Plan::AsToday, Some(SloVerdict::Unknown)),
            (None, _) => (slo::Plan::AsToday, None),
        };
        let mut order = if ask.predicted {
            let p = &self.cfg.predicted;
            let key = predict::rendezvous_key(ask.req.session_id, &px.hashes, p.rendezvous_blocks);
            let key = if p.affinity_slack > 0.0 || ask.req.session_id.is_some() { key } else { None };
            let fb = self.cfg.fallbacks;
            match plan {
                slo::Plan::Shed(r) => return Err(r),
                slo::Plan::Among(set) => {
                    if token_pick.is_some_and(|t| !set.get(t).copied().unwrap_or(false)) {
                        // The session's pod is predicted to miss the target while another meets
                        // it: the target wins.
                        token_pick = None;
                    }
                    let masked: Vec<f64> = pr
                        .costs
                        .iter()
                        .zip(&set)
                        .map(|(c, &in_set)| if in_set { *c } else { f64::INFINITY })
                        .collect();
                    let first =
                        predict::order(&masked, &pool.addr_hash, &set, key, p.affinity_slack, fb, rng);
                    let first = first.into_iter().filter(|&i| set.get(i).copied().unwrap_or(false)).collect();
                    slo::then_the_rest(first, &pr.costs, eligible, fb)
                }
                slo::Plan::BestPredicted => {
                    let ttft: Vec<f64> = pr.pred.iter().map(|x| x.ttft).collect();
                    let mut o = slo::by_key(&ttft, eligible);
                    o.truncate(1 + fb);
                    o
                }
                slo::Plan::AsToday => {
                    predict::order(&pr.costs, &pool.addr_hash, eligible, key, p.affinity_slack, fb, rng)
                }
            }
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
        Ok(Choice { order, reason, slo: verdict })
    }

    /// `slo::plan` with this pick's predictions and whether each candidate's rate is learnt.
    fn slo_plan(&self, ask: &SloAsk, pool: &Pool<'_>, pr: &Predicted) -> (slo::Plan, SloVerdict) {
        let ttft: Vec<f64> = pr.pred.iter().map(|x| self.calibration.correct(x.ttft)).collect();
        let uncached: Vec<f64> = pr.pred.iter().map(|x| x.uncached).collect();
        let known: Vec<bool> =
            pool.addr_hash.iter().map(|&h| self.rates.has(endpoint_key_of_hash(h))).collect();
        let offer = slo::Offer { ttft: &ttft, uncached: &uncached, eligible: &pool.eligible, known: &known };
        slo::plan(ask, &offer)
    }

    /// Step 10, Record: the primary (candidate `p`) now holds this prompt's blocks, in this
    /// worker's index and (unless the scope says not) the cross-worker table.
    fn record_step(&mut self, ask: &Ask<'_>, pool: &Pool<'_>, px: &mut Prefix, p: usize) {
        let Some(c) = pool.cands.get(p) else { return };
        let cap = prefix::capacity(&self.cfg.prefix, c.metrics, ask.st.snapshot.endpoints.len());
        self.local.record(c.address, &px.hashes, cap);
        if self.feed && !px.hashes.is_empty() {
            self.placement = Some(Placement {
                address: c.address.to_string(),
                cap: u32::try_from(cap).unwrap_or(u32::MAX),
                hashes: px.hashes.clone(),
                foreign: false,
            });
        }
        if !ask.scope.skip_shared_record {
            let key = match pool.addr_hash.get(p) {
                Some(&h) => endpoint_key_of_hash(h),
                None => endpoint_key(c.address),
            };
            self.shared.record(ask.st.store, &px.hashes, key, &mut px.lookup);
        }
    }

    /// No healthy endpoint: the lowest in-flight count (with passive health's phantom load)
    /// among the serving endpoints, seeded tie-break, when `filter.failure_mode` is `FailOpen`;
    /// else 503 `no_healthy_endpoint`.
    fn fail_open(
        &self,
        serving: &[&EndpointStatus],
        load: &dyn Fn(&str) -> u32,
        rng: &mut dyn Rng,
        target_model: String,
        model_rewritten: bool,
    ) -> Result<Pick, Rejection> {
        if self.failure_mode != FailureMode::FailOpen {
            return Err(no_healthy_endpoint(&target_model));
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
            slo: None,
            ticket: 0,
        })
    }
}

/// Step 3's answer when failing open is not allowed.
fn no_healthy_endpoint(target_model: &str) -> Rejection {
    Rejection::new(
        503,
        "service_unavailable",
        "no_healthy_endpoint",
        format!("No healthy endpoint for the model `{target_model}`."),
    )
    .with_retry_after(1)
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
