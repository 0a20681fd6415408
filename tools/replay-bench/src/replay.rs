//! The discrete-event replay: one trace, one strategy, one load level, in virtual time.
//!
//! **Topology.** `servers` simulated model servers (`model_server_sim::Server`, the same pure
//! model as the HTTP simulator), and `replicas` × `workers` gateway workers. Each worker has its
//! own local state (its own `Scheduler`, round-robin counter, random source); each replica has
//! one `MemStore` shared by its workers (proxy-wasm shared data is per Envoy process), holding the
//! published snapshot, the in-flight counts (`inference_picker::inflight`) and our cross-worker
//! prefix table; replicas share nothing. Each request goes to a worker chosen at random.
//!
//! **What the router sees.** Only what it would see in Envoy. Each replica's poller
//! (`inference_picker::poller::Poller`, the real pure core) scrapes every server every
//! `poll_ms`, starting at a random phase: the server's Prometheus text is rendered at the scrape
//! time by `model_server_sim::render_metrics` (vLLM names), delivered `metrics_delay_ms` later,
//! parsed by the poller with `inference_picker::metrics::parse_metrics`, and published with
//! `inference_picker::snapshot::publish`; workers read it through `SnapshotCache`. So the metrics
//! a request is routed on are between `metrics_delay_ms` and `poll_ms + metrics_delay_ms` old.
//! In-flight counts are exact and immediate: incremented when a worker routes a request,
//! decremented when the request's last token is out.
//!
//! **Requests.** Scheduler-based strategies get a chat-completions body and go through
//! `inference_picker::request::on_body` (body parsing, model resolution, scheduling). The server
//! gets the prompt's chained block hashes (`text::server_hashes`), the trace's exact token counts
//! and the adapter. Loads scale arrival times: at load L, a request that arrived at t arrives at
//! t / L. A rejection (by the router, or by the server for a request that can never fit) is
//! counted, never retried.

use std::rc::Rc;

use inference_picker::config::Config;
use inference_picker::inflight;
use inference_picker::poller::{Poller, ScrapeResult};
use inference_picker::ports::{MemStore, Rng, SplitMix64};
use inference_picker::request::{on_body, BodyInputs, RequestHead};
use inference_picker::scheduler::Scheduler;
use inference_picker::snapshot::{publish, Snapshot, SnapshotCache};
use model_server_sim::{Engine, Event, RenderInfo, Server, ServerConfig, SimRequest};

use crate::sglang::CacheAware;
use crate::stats::{Outcome, RunResult};
use crate::strategy::{self, Policy, MODEL};
use crate::text;
use crate::trace::Trace;

/// Virtual epoch: `now_ms` for the router is this plus the virtual time (a real-looking Unix time
/// in ms, so that "scraped at 0 = never" cannot happen).
pub const EPOCH_MS: u64 = 1_750_000_000_000;

/// One run's settings (everything but the trace and the strategy).
#[derive(Debug, Clone, PartialEq)]
pub struct RunConfig {
    pub servers: usize,
    /// The simulated server (KV size, speed, batch limits, LoRA slots).
    pub server: ServerConfig,
    pub replicas: usize,
    pub workers: usize,
    pub poll_ms: u64,
    pub metrics_delay_ms: u64,
    /// Arrival-rate multiplier.
    pub load: f64,
    pub seed: u64,
    /// Replaces `ours`' scheduler section (see `strategy::config`).
    pub ours_scheduler: Option<serde_json::Value>,
}

impl RunConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.servers == 0 || self.servers > 1000 {
            return Err(format!("servers must be in 1..=1000, got {}", self.servers));
        }
        if self.replicas == 0 || self.workers == 0 {
            return Err("replicas and workers must be at least 1".into());
        }
        if self.poll_ms < 10 {
            return Err(format!("poll interval must be at least 10 ms, got {}", self.poll_ms));
        }
        if self.metrics_delay_ms >= self.poll_ms {
            return Err(format!(
                "metrics delay ({} ms) must be shorter than the poll interval ({} ms)",
                self.metrics_delay_ms, self.poll_ms
            ));
        }
        if !(self.load.is_finite() && self.load > 0.0) {
            return Err(format!("load must be a positive number, got {}", self.load));
        }
        self.server.validate().map_err(|e| e.to_string())
    }
}

struct Replica {
    store: MemStore,
    poller: Poller,
    next_poll: f64,
    /// Scrapes in flight: delivered at `.0`, (server index, rendered text) each.
    pending: Option<(f64, Vec<(usize, String)>)>,
    sglang: Option<CacheAware>,
}

struct Worker {
    replica: usize,
    sched: Option<Scheduler>,
    cache: SnapshotCache,
    /// GIE's view of the current snapshot (cache_config_info removed), by version.
    view: Option<(u64, Rc<Snapshot>)>,
    rng: SplitMix64,
    rr_next: usize,
}

/// Per-request bookkeeping.
#[derive(Debug, Clone, Copy, Default)]
struct Live {
    arrival: f64,
    replica: usize,
    first: Option<f64>,
    done: bool,
}

/// Replays `trace` with `policy` under `rc`.
pub fn run(trace: &Trace, policy: Policy, rc: &RunConfig) -> Result<RunResult, String> {
    rc.validate()?;
    #[allow(clippy::disallowed_methods)] // the benchmark's own wall time, not the router's
    let wall = std::time::Instant::now();
    let n = rc.servers;
    let mut server_cfg = rc.server.clone();
    server_cfg.tokens_per_hash = Some(trace.tokens_per_hash);
    server_cfg.token_events = false;
    if trace.adapters > 0 {
        server_cfg.enable_lora = true;
    }
    let mut servers: Vec<Server> = (0..n)
        .map(|_| Server::new(server_cfg.clone()).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let addresses: Vec<String> = (0..n).map(strategy::address).collect();
    let addr_index: hashbrown::HashMap<&str, usize> =
        addresses.iter().enumerate().map(|(i, a)| (a.as_str(), i)).collect();

    // The configuration document is the same for every policy's poller (endpoints, interval);
    // Scheduler-based policies also take their scheduler section from it.
    let cfg: Config = if policy.uses_scheduler() {
        strategy::config(policy, n, trace.adapters, rc.poll_ms, rc.ours_scheduler.as_ref())?
    } else {
        strategy::config(Policy::Ours, n, trace.adapters, rc.poll_ms, None)?
    };
    let mut rng = SplitMix64::new(rc.seed ^ 0x5eed);
    let mut replicas: Vec<Replica> = (0..rc.replicas)
        .map(|_| Replica {
            store: MemStore::new(),
            poller: Poller::new(&cfg),
            next_poll: rng.next_f64() * rc.poll_ms as f64,
            pending: None,
            sglang: (policy == Policy::Sglang).then(|| CacheAware::new(n)),
        })
        .collect();
    let mut workers: Vec<Worker> = (0..rc.replicas * rc.workers)
        .map(|i| Worker {
            replica: i / rc.workers,
            sched: policy.uses_scheduler().then(|| Scheduler::new(&cfg)),
            cache: SnapshotCache::new(),
            view: None,
            rng: SplitMix64::new(rc.seed.wrapping_mul(1_000_003).wrapping_add(i as u64)),
            rr_next: 0,
        })
        .collect();
    for w in &mut workers {
        w.rr_next = w.rng.below(n);
    }

    let reqs = &trace.requests;
    let mut live: Vec<Live> = vec![Live::default(); reqs.len()];
    let mut out = Outcome::new(trace, policy, rc);
    let head = RequestHead {
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        content_length: None,
        session_id: None,
        session_token: None,
    };
    let render_created = EPOCH_MS as f64 / 1000.0;
    let mut events: Vec<Event> = Vec::new();
    let mut next_req = 0usize;
    // Arrivals start once every replica has published a first snapshot, as in a gateway that
    // has been up for a while (before that, every request would get a 503).
    let warm_up = (rc.poll_ms + rc.metrics_delay_ms + 1) as f64;
    let arrival = |i: usize| reqs.get(i).map(|r| warm_up + r.arrival_ms / rc.load);
    out.first_arrival = arrival(0).unwrap_or(0.0);

    loop {
        let ta = arrival(next_req);
        let ts = servers.iter().filter_map(Server::next_wakeup).min_by(f64::total_cmp);
        let t = match (ta, ts) {
            (None, None) => break,
            (Some(a), None) => a,
            (None, Some(s)) => s,
            (Some(a), Some(s)) => a.min(s),
        };
        let tp = replicas
            .iter()
            .map(|r| r.pending.as_ref().map_or(r.next_poll, |(d, _)| d.min(r.next_poll)))
            .min_by(f64::total_cmp)
            .unwrap_or(f64::INFINITY);
        let t = t.min(tp);

        // 1. Servers: steps ending by t.
        for (si, s) in servers.iter_mut().enumerate() {
            if s.next_wakeup().is_some_and(|w| w <= t) {
                events.clear();
                s.advance_into(t, &mut events);
                handle_events(&events, si, &mut live, &replicas, &addresses, &mut out);
            }
        }

        // 2. Polls: deliveries, then new scrapes.
        for ri in 0..replicas.len() {
            let due_delivery = replicas[ri].pending.as_ref().is_some_and(|(d, _)| *d <= t);
            if due_delivery {
                if let Some((d, texts)) = replicas[ri].pending.take() {
                    let now_ms = EPOCH_MS + d as u64;
                    let r = &mut replicas[ri];
                    for (si, body) in &texts {
                        let res = ScrapeResult::Response { status: 200, body: body.as_bytes() };
                        if let Err(e) = r.poller.on_result(&addresses[*si], now_ms, res) {
                            out.scrape_errors.push(format!("{e:?}"));
                        }
                    }
                    let snap = r.poller.snapshot(now_ms);
                    publish(&r.store, &snap).map_err(|e| format!("publish: {e:?}"))?;
                }
            }
            if replicas[ri].next_poll <= t {
                let tp = replicas[ri].next_poll;
                // The servers' state at the scrape time.
                for (si, s) in servers.iter_mut().enumerate() {
                    events.clear();
                    s.advance_into(tp, &mut events);
                    handle_events(&events, si, &mut live, &replicas, &addresses, &mut out);
                }
                let r = &mut replicas[ri];
                let now_ms = EPOCH_MS + tp as u64;
                let due = r.poller.due(now_ms);
                let info = RenderInfo {
                    model_name: MODEL,
                    unix_now_s: now_ms as f64 / 1000.0,
                    created_unix_s: render_created,
                    lora_history: None,
                };
                let texts: Vec<(usize, String)> = due
                    .iter()
                    .filter_map(|a| addr_index.get(a.as_str()).copied())
                    .filter_map(|si| servers.get(si).map(|s| (si, s.render_metrics(Engine::Vllm, &info))))
                    .collect();
                r.pending = Some((tp + rc.metrics_delay_ms as f64, texts));
                r.next_poll = tp + rc.poll_ms as f64;
            }
        }

        // 3. Arrivals at t.
        while let Some(ta) = arrival(next_req).filter(|&a| a <= t) {
            let idx = next_req;
            next_req += 1;
            let req = &reqs[idx];
            let wi = rng.below(workers.len());
            let w = &mut workers[wi];
            let ri = w.replica;
            live[idx].arrival = ta;
            live[idx].replica = ri;
            let msgs = text::messages(trace, idx, req);
            let model = req.adapter.map_or_else(|| MODEL.to_string(), strategy::adapter_name);
            let now_ms = EPOCH_MS + ta as u64;
            let rep = &mut replicas[ri];
            let counts = inflight::read(&rep.store).unwrap_or_default();
            let chosen: Result<usize, String> = match policy {
                Policy::Ours
                | Policy::GieDefault
                | Policy::GieDefaultLora
                | Policy::Gie111
                | Policy::LoadOnly => {
                    let body = text::chat_body(&model, &msgs, req.output_tokens);
                    let snap = w.cache.refresh(&rep.store).map_err(|e| format!("snapshot: {e:?}"))?;
                    let snap = if policy.hides_cache_info() { gie_view(&mut w.view, snap) } else { snap };
                    let inputs = BodyInputs { snapshot: &snap, inflight: &counts, store: &rep.store, now_ms };
                    match w.sched.as_mut() {
                        Some(s) => match on_body(&cfg, s, &mut w.rng, &head, &body, &inputs) {
                            Ok(routed) => addr_index
                                .get(routed.pick.primary.as_str())
                                .copied()
                                .ok_or_else(|| format!("unknown endpoint {}", routed.pick.primary)),
                            Err(rej) => Err(format!("router_{}_{}", rej.status, rej.code)),
                        },
                        None => Err("no scheduler".into()),
                    }
                }
                Policy::Sglang => {
                    let body = text::chat_body(&model, &msgs, req.output_tokens);
                    match inference_picker::body::parse_request(&head.path, &body) {
                        Ok(parsed) => {
                            let loads: Vec<u32> = addresses.iter().map(|a| counts.get(a)).collect();
                            match rep.sglang.as_mut() {
                                Some(p) => Ok(p.select(&parsed.prompt, &loads, ta, &mut w.rng).0),
                                None => Err("no sglang state".into()),
                            }
                        }
                        Err(rej) => Err(format!("router_{}_{}", rej.status, rej.code)),
                    }
                }
                Policy::LeastRequest => {
                    // Envoy LEAST_REQUEST with equal weights: two distinct random hosts, the one
                    // with fewer active requests (the first on a tie).
                    let a = w.rng.below(n);
                    let b = if n > 1 { (a + 1 + w.rng.below(n - 1)) % n } else { a };
                    let (ca, cb) = (counts.get(&addresses[a]), counts.get(&addresses[b]));
                    Ok(if cb < ca { b } else { a })
                }
                Policy::RoundRobin => {
                    let i = w.rr_next % n;
                    w.rr_next = w.rr_next.wrapping_add(1);
                    Ok(i)
                }
                Policy::Random => Ok(w.rng.below(n)),
            };
            let si = match chosen {
                Ok(si) => si,
                Err(reason) => {
                    out.reject(idx, reason);
                    live[idx].done = true;
                    continue;
                }
            };
            let sim = SimRequest {
                id: idx as u64,
                prompt_tokens: req.prompt_tokens,
                block_hashes: text::server_hashes(&msgs, trace.tokens_per_hash),
                output_tokens: req.output_tokens,
                adapter: req.adapter.map(strategy::adapter_name),
                arrival_ms: ta,
            };
            match servers[si].submit(sim) {
                Ok(()) => {
                    let _ = inflight::adjust(&rep.store, &addresses[si], 1);
                    out.routed(idx, si);
                }
                Err(e) => {
                    out.reject(idx, format!("server_{}", submit_error_code(&e)));
                    live[idx].done = true;
                }
            }
        }
    }

    for (si, s) in servers.iter().enumerate() {
        out.server_end(si, &s.metrics_snapshot());
    }
    out.wall_s = wall.elapsed().as_secs_f64();
    let unfinished = live.iter().filter(|l| !l.done).count();
    Ok(out.finish(unfinished))
}

fn submit_error_code(e: &model_server_sim::SubmitError) -> &'static str {
    match e {
        model_server_sim::SubmitError::DuplicateId(_) => "duplicate_id",
        model_server_sim::SubmitError::TooLarge { .. } => "too_large",
        model_server_sim::SubmitError::LoraDisabled => "lora_disabled",
    }
}

/// The snapshot without `cache_config_info` (GIE sizes its prefix index by configuration).
fn gie_view(view: &mut Option<(u64, Rc<Snapshot>)>, snap: Rc<Snapshot>) -> Rc<Snapshot> {
    if let Some((v, s)) = view {
        if *v == snap.version {
            return s.clone();
        }
    }
    let mut s = (*snap).clone();
    for e in &mut s.endpoints {
        if let Some(m) = e.metrics.as_mut() {
            m.num_gpu_blocks = None;
            m.block_size = None;
        }
    }
    let s = Rc::new(s);
    *view = Some((snap.version, s.clone()));
    s
}

fn handle_events(
    events: &[Event],
    si: usize,
    live: &mut [Live],
    replicas: &[Replica],
    addresses: &[String],
    out: &mut Outcome,
) {
    for e in events {
        match *e {
            Event::FirstToken { id, t_ms } => {
                if let Some(l) = live.get_mut(id as usize) {
                    l.first = Some(t_ms);
                }
            }
            Event::Finished { id, t_ms, output_tokens, cached_tokens, preemptions: _ } => {
                if let Some(l) = live.get_mut(id as usize) {
                    if l.done {
                        continue;
                    }
                    l.done = true;
                    let ttft = l.first.unwrap_or(t_ms) - l.arrival;
                    out.finished(id as usize, ttft, t_ms - l.arrival, t_ms, output_tokens, cached_tokens);
                    if let Some(r) = replicas.get(l.replica) {
                        let _ = inflight::adjust(&r.store, &addresses[si], -1);
                    }
                }
            }
            Event::Rejected { id, .. } => {
                if let Some(l) = live.get_mut(id as usize) {
                    if !l.done {
                        l.done = true;
                        out.reject(id as usize, "server_rejected".into());
                        if let Some(r) = replicas.get(l.replica) {
                            let _ = inflight::adjust(&r.store, &addresses[si], -1);
                        }
                    }
                }
            }
            Event::Preempted { .. } => out.preemptions += 1,
            Event::Token { .. } => {}
        }
    }
}
