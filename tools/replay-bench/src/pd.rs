//! The prefill/decode (P/D) replay: the same GPUs as one aggregated pool or split into prefill
//! and decode pods, routed by the real module core (`inference_picker::request::route`), on a trace.
//!
//! **Servers.** `model_server_sim::Server` (the calibrated Llama-3-8B/H100 model). Aggregated:
//! every server does prefill and decode. P/D: `prefill` servers and `servers − prefill` decode
//! servers.
//!
//! **Routing.** One gateway worker with the module's pure core: the body through
//! `request::prepare`, then `request::route` (decode pick, llm-d's split rule, prefill pick) with a
//! snapshot the module's `Poller` builds from every server's rendered vLLM metrics every
//! `poll_ms` (delivered at once: the P/D comparison is about the pool, not about metric lag) and
//! exact in-flight counts: a decode pod from the pick to the request's last token, a prefill
//! pod from the pick to the decode pod's first token (the module holds it until the response
//! headers; `prefill_inflight: false` measures without it). Each request's first token and end
//! are reported to the scheduler as the filter reports them (`Scheduler::first_byte`,
//! `first_byte_unobserved` for a split request, `request_done`): the predicted-TTFT objective's
//! prefill ledger drains and the pods' rates are learnt, as in Envoy.
//!
//! **A split request** (llm-d's protocol): the prefill pod runs the prompt with one output token;
//! when that finishes, the KV is transferred (`prompt_tokens × kv_bytes_per_token ÷ kv_gbps`;
//! default 128 KiB a token, Llama-3-8B's 32 layers × 8 KV heads × 128 × 2 × fp16, over 25 GB/s,
//! a 200 Gb/s RDMA NIC), imported into the decode pod's prefix cache
//! (`Server::import_prefix`), and the request is submitted there with its whole prompt (now
//! cached but the last partial block) and its output length. TTFT is the decode pod's first
//! token minus the arrival (the prefill pod's token is not sent to the client); TPOT is
//! `(last − first token) ÷ (output − 1)`, for outputs longer than one token.
//!
//! Not modelled: the sidecar's own latency, transfer contention on the NIC, prefill pods'
//! admission by flow control (the P/D run does not hold requests; neither does the aggregated
//! run here), a failed transfer.

use std::collections::BinaryHeap;

use inference_picker::base::ports::{MemStore, SplitMix64};
use inference_picker::config::Config;
use inference_picker::poll::poller::{Poller, ScrapeResult};
use inference_picker::request::pd::Decision;
use inference_picker::request::{prepare, route, RequestHead};
use inference_picker::scheduler::{PickState, Scheduler};
use inference_picker::state::health::HealthView;
use inference_picker::state::inflight::InflightCounts;
use inference_picker::state::snapshot::Snapshot;
use model_server_sim::{Engine, Event, RenderInfo, Server, ServerConfig, SimRequest};
use serde_json::json;

use crate::replay::EPOCH_MS;
use crate::stats::percentile;
use crate::strategy::{self, MODEL};
use crate::text;
use crate::trace::Trace;

/// One P/D replay's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct PdRun {
    pub servers: usize,
    /// Prefill pods (0: the aggregated pool).
    pub prefill: usize,
    /// `pd.pd_threshold_tokens` (ignored when `prefill` is 0).
    pub threshold: u64,
    /// `pd.decode_prefix_factor`.
    pub decode_prefix_factor: f64,
    /// `pd.prefill_busy_factor` (0: llm-d's rule alone).
    pub prefill_busy_factor: f64,
    pub server: ServerConfig,
    pub poll_ms: u64,
    pub load: f64,
    pub seed: u64,
    /// KV bytes per prompt token moved from the prefill to the decode pod.
    pub kv_bytes_per_token: f64,
    /// Transfer bandwidth, GB/s.
    pub kv_gbps: f64,
    /// Count a split request in flight on its prefill pod from the pick until the decode pod's
    /// first token (the module counts it until the response headers). Off: prefill pods get no
    /// in-flight count (only their polled queue).
    pub prefill_inflight: bool,
}

/// What one replay measured.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PdResult {
    pub finished: usize,
    pub rejected: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub tpot_p50_ms: f64,
    pub tpot_p90_ms: f64,
    /// Share of requests given a prefill pod.
    pub split_pct: f64,
    /// Prompt tokens computed (prefill and decode pods) over prompt tokens sent.
    pub computed_share: f64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Live {
    arrival: f64,
    decode: usize,
    /// Set while the request's prefill runs on a prefill pod.
    prefill: Option<usize>,
    /// The prefill pod of a split request (kept after its prefill, for the in-flight count).
    prefilled_by: Option<usize>,
    first: Option<f64>,
    done: bool,
    /// The decode pick's `Pick::ticket`: the scheduler hears its first token and its end, as
    /// the filter reports them (prefill ledger, rate learning).
    ticket: u64,
}

/// A KV transfer that lands at `at` (ordered earliest first in the heap).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Landing {
    at: f64,
    idx: usize,
}

impl Eq for Landing {}
impl PartialOrd for Landing {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Landing {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        o.at.total_cmp(&self.at).then(o.idx.cmp(&self.idx))
    }
}

/// The configuration document: every server with its role, and the `pd` section when split.
pub fn config(run: &PdRun) -> Result<Config, String> {
    let endpoints: Vec<serde_json::Value> = (0..run.servers)
        .map(|i| {
            let role = if i < run.prefill { "prefill" } else { "decode" };
            json!({"address": strategy::address(i), "models": [MODEL], "role": role})
        })
        .collect();
    let mut doc = json!({"version": 1, "endpoints": endpoints, "models": [{"name": MODEL}]});
    if run.poll_ms != 200 {
        doc["poller"] = json!({"interval_ms": run.poll_ms, "stale_after_ms": (5 * run.poll_ms).max(1000)});
    }
    if run.prefill > 0 {
        // The guard's transfer estimate is the replay's own transfer model.
        let transfer_ms_per_1k = 1000.0 * run.kv_bytes_per_token / (run.kv_gbps * 1e9) * 1000.0;
        doc["pd"] = json!({
            "pd_threshold_tokens": run.threshold,
            "decode_prefix_factor": run.decode_prefix_factor,
            "prefill_busy_factor": run.prefill_busy_factor,
            "transfer_ms_per_1k_tokens": transfer_ms_per_1k,
        });
    }
    let bytes = serde_json::to_vec(&doc).map_err(|e| e.to_string())?;
    Config::from_json(&bytes).map_err(|errs| inference_picker::base::json::describe_errors(&errs))
}

/// What every step of one replay reads: the trace, the run's settings and the pods' addresses.
struct Ctx<'a> {
    trace: &'a Trace,
    run: &'a PdRun,
    addresses: &'a [String],
}

impl Ctx<'_> {
    /// The server of an address.
    fn index(&self, a: &str) -> Option<usize> {
        self.addresses.iter().position(|x| x == a)
    }
}

/// The module core as the filter drives it: configuration, scheduler, shared store, randomness
/// and the request head every request is sent with.
struct Router {
    cfg: Config,
    sched: Scheduler,
    store: MemStore,
    rng: SplitMix64,
    health: HealthView,
    head: RequestHead,
}

/// The replay's running state: each request, each pod's in-flight count, the transfers under
/// way, and what was measured.
struct Tally {
    live: Vec<Live>,
    inflight: Vec<u32>,
    ttft: Vec<f64>,
    tpot: Vec<f64>,
    rejected: usize,
    split: usize,
    landings: BinaryHeap<Landing>,
}

impl Tally {
    /// Step 1: one event of server `si`: a first token, a prefill done (its KV travels), a
    /// request finished or rejected.
    fn on_event(&mut self, ev: &Event, si: usize, r: &mut Router, ctx: &Ctx<'_>) -> Result<(), String> {
        let (run, inflight) = (ctx.run, &mut self.inflight);
        let idx = ev.id() as usize;
        let Some(l) = self.live.get_mut(idx) else { return Ok(()) };
        match *ev {
            Event::FirstToken { t_ms, .. } if l.prefill.is_none() && l.first.is_none() => {
                l.first = Some(t_ms);
                self.ttft.push(t_ms - l.arrival);
                // As the filter: a split request's first byte teaches no rate (`prefilled_by`
                // is still set here for a split request).
                if l.prefilled_by.is_some() {
                    r.sched.first_byte_unobserved(l.ticket);
                } else {
                    let served = ctx.addresses.get(l.decode).map(String::as_str);
                    r.sched
                        .first_byte(l.ticket, served, &r.store, EPOCH_MS + t_ms as u64)
                        .map_err(|e| format!("{e:?}"))?;
                }
                if let (Some(p), true) = (l.prefilled_by.take(), run.prefill_inflight) {
                    inflight[p] = inflight[p].saturating_sub(1);
                }
            }
            Event::Finished { t_ms, .. } if l.prefill == Some(si) => {
                // The prefill is done: the KV travels to the decode pod.
                let tokens = f64::from(ctx.trace.requests[idx].prompt_tokens);
                let ms = tokens * run.kv_bytes_per_token / (run.kv_gbps * 1e9) * 1000.0;
                self.landings.push(Landing { at: t_ms + ms, idx });
            }
            Event::Finished { t_ms, output_tokens, .. } if l.prefill.is_none() && !l.done => {
                l.done = true;
                r.sched.request_done(l.ticket);
                if let (Some(f), true) = (l.first, output_tokens > 1) {
                    self.tpot.push((t_ms - f) / f64::from(output_tokens - 1));
                }
                inflight[l.decode] = inflight[l.decode].saturating_sub(1);
            }
            Event::Rejected { .. } if !l.done => {
                l.done = true;
                r.sched.request_done(l.ticket);
                self.rejected += 1;
                inflight[l.decode] = inflight[l.decode].saturating_sub(1);
                if let (Some(p), true) = (l.prefilled_by.take(), run.prefill_inflight) {
                    inflight[p] = inflight[p].saturating_sub(1);
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Step 2: request `idx`'s KV lands on its decode pod at `at`: the decode half starts.
    fn land(&mut self, idx: usize, at: f64, servers: &mut [Server], r: &mut Router, ctx: &Ctx<'_>) {
        let req = &ctx.trace.requests[idx];
        let hashes = text::server_hashes(&text::messages(ctx.trace, idx, req), ctx.trace.tokens_per_hash);
        let l = &mut self.live[idx];
        l.prefill = None;
        let d = l.decode;
        // Servers are never behind `at` here by more than their own idle time: the import and
        // the submission happen at the decode pod's clock, the arrival at `at`.
        servers[d].import_prefix(&hashes, req.prompt_tokens, None);
        let sub = SimRequest {
            id: idx as u64,
            prompt_tokens: req.prompt_tokens,
            block_hashes: hashes,
            output_tokens: req.output_tokens,
            adapter: None,
            arrival_ms: at,
        };
        if servers[d].submit(sub).is_err() {
            l.done = true;
            r.sched.request_done(l.ticket);
            self.rejected += 1;
            self.inflight[d] = self.inflight[d].saturating_sub(1);
            if let (Some(p), true) = (l.prefilled_by.take(), ctx.run.prefill_inflight) {
                self.inflight[p] = self.inflight[p].saturating_sub(1);
            }
        }
    }

    /// Step 4: request `idx` arrives at `ta`: the module routes it (decode pick, split, prefill
    /// pick) and it goes to its prefill pod, or straight to its decode pod.
    fn arrive(
        &mut self,
        idx: usize,
        ta: f64,
        snapshot: &Snapshot,
        servers: &mut [Server],
        r: &mut Router,
        ctx: &Ctx<'_>,
    ) -> Result<(), String> {
        let req = &ctx.trace.requests[idx];
        let msgs = text::messages(ctx.trace, idx, req);
        let body = text::chat_body(MODEL, &msgs, req.output_tokens);
        let now_ms = EPOCH_MS + ta as u64;
        let counts = counts_of(ctx.addresses, &self.inflight);
        let state = PickState { snapshot, inflight: &counts, health: &r.health, store: &r.store, now_ms };
        let routed = prepare(&r.cfg.request(), &r.sched, &mut r.rng, &r.head, &body, snapshot)
            .and_then(|p| route(&r.cfg.request(), &mut r.sched, &mut r.rng, &r.head, &p, state));
        let Ok(pick) = routed else {
            self.rejected += 1;
            self.live[idx].done = true;
            return Ok(());
        };
        let (Some(d), pre) =
            (ctx.index(&pick.pick.primary), pick.prefiller.as_deref().and_then(|a| ctx.index(a)))
        else {
            return Err(format!("unknown address {}", pick.pick.primary));
        };
        let hashes = text::server_hashes(&msgs, ctx.trace.tokens_per_hash);
        let pre = pre.filter(|_| pick.decision == Decision::Split);
        self.live[idx] = Live {
            arrival: ta,
            decode: d,
            prefill: pre,
            prefilled_by: pre,
            first: None,
            done: false,
            ticket: pick.pick.ticket,
        };
        self.inflight[d] += 1;
        let (target, output) = match pre {
            Some(p) => {
                self.split += 1;
                if ctx.run.prefill_inflight {
                    self.inflight[p] += 1;
                }
                (p, 1)
            }
            None => (d, req.output_tokens),
        };
        let sub = SimRequest {
            id: idx as u64,
            prompt_tokens: req.prompt_tokens,
            block_hashes: hashes,
            output_tokens: output,
            adapter: None,
            arrival_ms: ta,
        };
        if servers[target].submit(sub).is_err() {
            self.rejected += 1;
            self.live[idx].done = true;
            r.sched.request_done(pick.pick.ticket);
            self.inflight[d] = self.inflight[d].saturating_sub(1);
            if target != d && ctx.run.prefill_inflight {
                self.inflight[target] = self.inflight[target].saturating_sub(1);
            }
        }
        Ok(())
    }
}

/// Replays `trace` on the pool of `run`.
pub fn run(trace: &Trace, run: &PdRun) -> Result<PdResult, String> {
    if run.prefill >= run.servers {
        return Err(format!("{} prefill pods leave no decode pod of {}", run.prefill, run.servers));
    }
    if !(run.load.is_finite() && run.load > 0.0 && run.kv_gbps > 0.0) {
        return Err("load and kv_gbps must be positive".into());
    }
    let cfg = config(run)?;
    let mut server_cfg = run.server.clone();
    server_cfg.tokens_per_hash = Some(trace.tokens_per_hash);
    server_cfg.token_events = false;
    let mut servers: Vec<Server> = (0..run.servers)
        .map(|_| Server::new(server_cfg.clone()).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let addresses: Vec<String> = (0..run.servers).map(strategy::address).collect();
    let ctx = Ctx { trace, run, addresses: &addresses };
    let mut poller = Poller::new(&cfg);
    let mut r = Router {
        sched: Scheduler::new(&cfg),
        cfg,
        store: MemStore::new(),
        rng: SplitMix64::new(run.seed ^ 0x9d),
        health: HealthView::default(),
        head: RequestHead {
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            content_length: None,
            session_id: None,
            session_token: None,
            priority: Default::default(),
            test_selection: None,
        },
    };
    let n = trace.requests.len();
    let mut tally = Tally {
        live: vec![Live::default(); n],
        inflight: vec![0u32; run.servers],
        ttft: Vec::with_capacity(n),
        tpot: Vec::with_capacity(n),
        rejected: 0,
        split: 0,
        landings: BinaryHeap::new(),
    };
    let mut snapshot = poller.snapshot(EPOCH_MS);
    let mut next_poll = 0.0f64;
    let mut next_req = 0usize;
    let warm_up = run.poll_ms as f64 + 1.0;
    let arrival = |i: usize| trace.requests.get(i).map(|r| warm_up + r.arrival_ms / run.load);
    let mut events = Vec::new();
    loop {
        let ta = arrival(next_req);
        let ts = servers.iter().filter_map(Server::next_wakeup).min_by(f64::total_cmp);
        let tl = tally.landings.peek().map(|l| l.at);
        let Some(t) = [ta, ts, tl].into_iter().flatten().min_by(f64::total_cmp) else { break };
        let t = t.min(next_poll);
        // 1. Servers.
        for (si, server) in servers.iter_mut().enumerate() {
            if server.next_wakeup().is_some_and(|w| w <= t) {
                events.clear();
                server.advance_into(t, &mut events);
                for ev in &events {
                    tally.on_event(ev, si, &mut r, &ctx)?;
                }
            }
        }
        // 2. KV transfers landing by t: the decode half starts.
        while tally.landings.peek().is_some_and(|l| l.at <= t) {
            let Some(Landing { at, idx }) = tally.landings.pop() else { break };
            tally.land(idx, at, &mut servers, &mut r, &ctx);
        }
        // 3. Poll.
        if next_poll <= t {
            let now_ms = EPOCH_MS + next_poll as u64;
            let info = RenderInfo {
                model_name: MODEL,
                unix_now_s: now_ms as f64 / 1000.0,
                created_unix_s: EPOCH_MS as f64 / 1000.0,
                lora_history: None,
            };
            for a in poller.due(now_ms) {
                let Some(si) = ctx.index(&a) else { continue };
                let body = servers[si].render_metrics(Engine::Vllm, &info);
                let res = ScrapeResult::Response { status: 200, body: body.as_bytes() };
                poller
                    .on_result_with_inflight(&a, now_ms, Some(tally.inflight[si]), res)
                    .map_err(|e| format!("{e:?}"))?;
            }
            snapshot = poller.snapshot(now_ms);
            next_poll += run.poll_ms as f64;
        }
        // 4. Arrivals.
        while let Some(ta) = arrival(next_req).filter(|&a| a <= t) {
            let idx = next_req;
            next_req += 1;
            tally.arrive(idx, ta, &snapshot, &mut servers, &mut r, &ctx)?;
        }
        if next_req >= n && tally.landings.is_empty() && servers.iter().all(Server::is_idle) {
            break;
        }
    }
    let Tally { mut ttft, mut tpot, rejected, split, .. } = tally;
    ttft.sort_by(f64::total_cmp);
    tpot.sort_by(f64::total_cmp);
    let computed: u64 = servers.iter().map(|s| s.metrics_snapshot().prefill_tokens_computed).sum();
    let prompt_total: u64 = trace.requests.iter().map(|r| u64::from(r.prompt_tokens)).sum();
    Ok(PdResult {
        finished: ttft.len(),
        rejected,
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p90_ms: percentile(&ttft, 90.0),
        tpot_p50_ms: percentile(&tpot, 50.0),
        tpot_p90_ms: percentile(&tpot, 90.0),
        split_pct: 100.0 * split as f64 / n.max(1) as f64,
        computed_share: computed as f64 / prompt_total.max(1) as f64,
    })
}

fn counts_of(addresses: &[String], inflight: &[u32]) -> InflightCounts {
    let mut s = String::new();
    for (a, &c) in addresses.iter().zip(inflight) {
        if c > 0 {
            if !s.is_empty() {
                s.push(';');
            }
            s.push_str(&format!("{a}={c}"));
        }
    }
    InflightCounts::from_text(s.as_bytes())
}
