//! The discrete-event replay: one trace, one strategy, one load level, in virtual time.
//!
//! **Topology.** `servers` simulated model servers (`model_server_sim::Server`, the same pure
//! model as the HTTP simulator), and `replicas` × `workers` gateway workers. Each worker has its
//! own local state (its own `Scheduler`, round-robin counter, random source); each replica has
//! one `MemStore` shared by its workers (proxy-wasm shared data is per Envoy process), holding the
//! published snapshot, the in-flight counts (`inference_picker::state::inflight`) and our cross-worker
//! prefix table; replicas share nothing but, for ours, the prefix-table exchange of the module's
//! `peers` (`RunConfig::peer_sync_ms`). Each request goes to a worker chosen at random.
//!
//! **What the router sees.** Only what it would see in Envoy. Each replica's poller
//! (`inference_picker::poll::poller::Poller`, the real pure core) scrapes every server every
//! `poll_ms`, starting at a random phase (ours: on the poller's own cadence, as in the module:
//! `scrapes_due` every tick, an idle and unchanged server backed off up to
//! `poller.idle_interval_ms`, the snapshot published when `publish_due`; pass
//! `--ours-config '{"poller":{"idle_interval_ms":200}}'` for a fixed 200 ms): the server's
//! Prometheus text is rendered at the scrape
//! time by `model_server_sim::render_metrics` (vLLM names), delivered `metrics_delay_ms` later,
//! parsed by the poller with `inference_picker::poll::scrape::parse_metrics`, and published with
//! `inference_picker::state::snapshot::publish`; workers read it through `SnapshotCache`. So the metrics
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

use inference_picker::base::ports::{MemStore, Rng, SplitMix64};
use inference_picker::config::Config;
use inference_picker::flow::priority::{resolve_priority, PriorityHeaders};
use inference_picker::flow::saturation::{saturated, SaturationParams};
use inference_picker::flow::{Action, Admission, Capacity, FlowQueue, Ticket};
use inference_picker::poll::peers;
use inference_picker::poll::poller::{Poller, ScrapeResult};
use inference_picker::request::{on_body, RequestHead};
use inference_picker::scheduler::{PickState, Scheduler};
use inference_picker::state::catalog::Criticality;
use inference_picker::state::feed::{self, FeedReader, FeedWriter};
use inference_picker::state::health::HealthView;
use inference_picker::state::inflight;
use inference_picker::state::snapshot::{publish, EndpointStatus, Snapshot, SnapshotCache};
use model_server_sim::{Engine, Event, RenderInfo, Server, ServerConfig, SimRequest};

use crate::dynamo::{self, KvRouter};
use crate::oracle;
use crate::sglang::CacheAware;
use crate::stats::{Outcome, RunLabels, RunResult};
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
    pub ours_overrides: Option<serde_json::Value>,
    /// The module's `peers` exchange (`inference_picker::poll::peers`): every this many ms, each
    /// replica of ours sends the records its prefix table changed since its last send
    /// (`Exporter::collect`'s `delta`), and every other replica applies them (`upsert`). As in
    /// the module, records a replica received count as changed at its next send (sent on once).
    /// `None`: replicas share nothing (no `peers` section).
    pub peer_sync_ms: Option<u64>,
    /// A study: ours' workers share no placement feed (`inference_picker::state::feed`), as before
    /// it: each knows exactly only the prefixes it placed, and the others' through the table.
    pub no_feed: bool,
    /// Heterogeneous pods: server `i` is `server` scaled by `pod_mix[i % len]`. Empty: every
    /// server is `server`.
    pub pod_mix: Vec<PodClass>,
    /// The tiers' TTFT targets (the SLO study, `crate::slo`): `ours-slo` carries them in its
    /// configuration (`priority.tier.slo`), `llm-d-slo` as each request's `x-slo-ttft-ms`.
    /// `None` elsewhere.
    pub slo: Option<crate::slo_policy::SloTargets>,
}

/// One kind of pod in a heterogeneous pool, relative to `RunConfig::server`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PodClass {
    /// Multiplies `ServerConfig::speed`.
    pub speed: f64,
    /// Multiplies `ServerConfig::num_gpu_blocks` (at least one block remains).
    pub kv_factor: f64,
}

impl PodClass {
    /// `base` as this class.
    pub fn apply(&self, base: &ServerConfig) -> ServerConfig {
        ServerConfig {
            speed: base.speed * self.speed,
            num_gpu_blocks: ((base.num_gpu_blocks as f64 * self.kv_factor).round() as u64).max(1),
            ..base.clone()
        }
    }
}

/// Server `i`'s configuration under `mix` (see `RunConfig::pod_mix`).
pub fn server_config(base: &ServerConfig, mix: &[PodClass], i: usize) -> ServerConfig {
    match mix.len() {
        0 => base.clone(),
        n => mix[i % n].apply(base),
    }
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
        if self.peer_sync_ms == Some(0) {
            return Err("the peer exchange interval must be at least 1 ms".into());
        }
        if !(self.load.is_finite() && self.load > 0.0) {
            return Err(format!("load must be a positive number, got {}", self.load));
        }
        if self
            .pod_mix
            .iter()
            .any(|c| !(c.speed.is_finite() && c.speed > 0.0 && c.kv_factor.is_finite() && c.kv_factor > 0.0))
        {
            return Err(format!("pod classes need positive speed and KV factors, got {:?}", self.pod_mix));
        }
        self.server.validate().map_err(|e| e.to_string())
    }

    /// What the run's result records of these settings.
    pub fn labels(&self) -> RunLabels {
        RunLabels {
            load: self.load,
            seed: self.seed,
            servers: self.servers,
            replicas: self.replicas,
            workers: self.workers,
            poll_ms: self.poll_ms,
        }
    }
}

struct Replica {
    store: MemStore,
    /// The replica's in-flight counts (one table per replica: its workers share one count, as
    /// the module's VMs do through their summed records).
    inflight: std::cell::RefCell<inflight::InflightTable>,
    poller: Poller,
    next_poll: f64,
    /// Ours: the poller's own cadence (`Poller::scrapes_due` every tick of `poll_tick_ms`,
    /// publish when `publish_due`), as in the module. Baselines: a full round every `poll_ms`.
    adaptive: bool,
    poll_tick_ms: u64,
    /// Scrapes in flight: delivered at `.0`, (server index, rendered text) each.
    pending: Option<(f64, Vec<(usize, String)>)>,
    sglang: Option<CacheAware>,
    dynamo: Option<KvRouter>,
    /// `oracle-stale`: copies of the servers taken at the scrape in flight, and at the last one
    /// delivered (what it routes on).
    stale_pending: Option<Vec<Server>>,
    stale: Option<Vec<Server>>,
}

struct Worker {
    replica: usize,
    sched: Option<Scheduler>,
    cache: SnapshotCache,
    rng: SplitMix64,
    rr_next: usize,
    /// Flow control (`ours` only): this worker's queue and the requests it holds (id → index).
    flow: Option<FlowQueue>,
    held: hashbrown::HashMap<u32, usize>,
    next_tick: f64,
    /// Ours with several workers: the placement feed (`inference_picker::state::feed`), as the
    /// host runs it: this worker's ring (its slot, its owner nonce) and its cursors in the
    /// others' rings, and those others.
    feed: Option<Feed>,
}

struct Feed {
    slot: usize,
    owner: u64,
    writer: FeedWriter,
    reader: FeedReader,
    others: Vec<(usize, u64)>,
}

/// Per-request bookkeeping.
#[derive(Debug, Clone, Copy, Default)]
struct Live {
    arrival: f64,
    replica: usize,
    /// The worker the request arrived on, which routed it (its `on_log` runs there).
    worker: usize,
    server: usize,
    first: Option<f64>,
    done: bool,
    /// Its `Pick::ticket` on that worker (ours: the prefill ledger and the rate learner hear its
    /// first token and its end, as the host filter reports them).
    ticket: u64,
}

/// Everything one run mutates.
struct Sim<'a> {
    trace: &'a Trace,
    policy: Policy,
    rc: &'a RunConfig,
    cfg: Config,
    sat: SaturationParams,
    servers: Vec<Server>,
    addresses: Vec<String>,
    addr_index: hashbrown::HashMap<String, usize>,
    replicas: Vec<Replica>,
    workers: Vec<Worker>,
    live: Vec<Live>,
    out: Outcome,
    head: RequestHead,
    events: Vec<Event>,
    /// `oracle-approx-prefix`: its index of its own routing.
    approx: Option<oracle::ApproxIndex>,
    /// The trace has tier labels (`Trace::has_tiers`, computed once).
    tiers: bool,
    /// `RunConfig::peer_sync_ms`: the next exchange, the table's shard keys, and each replica's
    /// shard values as of the last exchange (what it has already passed on).
    peer_sync: Option<PeerSync>,
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
    let servers: Vec<Server> = (0..n)
        .map(|i| Server::new(server_config(&server_cfg, &rc.pod_mix, i)).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let addresses: Vec<String> = (0..n).map(strategy::address).collect();
    let addr_index: hashbrown::HashMap<String, usize> =
        addresses.iter().enumerate().map(|(i, a)| (a.clone(), i)).collect();

    // The configuration document is the same for every policy's poller (endpoints, interval);
    // Scheduler-based policies also take their scheduler section from it.
    let mut cfg: Config = if policy.uses_scheduler() {
        strategy::config_with(
            policy,
            n,
            trace.adapters,
            rc.poll_ms,
            rc.ours_overrides.as_ref(),
            rc.slo.as_ref(),
        )?
    } else {
        strategy::config(Policy::Ours, n, trace.adapters, rc.poll_ms, None)?
    };
    // Ours at R replicas is deployed as its docs say: `poller.replicas` = R (unless an override
    // sets the poller section itself). It spreads each replica's scrapes of the pods it does not
    // send to, and scales the rendezvous credit.
    let poller_overridden = rc.ours_overrides.as_ref().is_some_and(|o| o.get("poller").is_some());
    if policy.is_ours() && !policy.central() && !poller_overridden {
        cfg.poller.replicas = u32::try_from(rc.replicas.max(1)).unwrap_or(u32::MAX);
    }
    // Ours' replicas that exchange are deployed with a `peers` section, as the module's would be
    // (its addresses are not used: the replay carries the exchange itself).
    if policy.is_ours()
        && !policy.central()
        && rc.replicas > 1
        && rc.peer_sync_ms.is_some()
        && cfg.peers.is_none()
    {
        cfg.peers = Some(peers::PeersConfig::default());
    }
    let sat = cfg.saturation.params(cfg.poller.stale_after_ms);
    let mut rng = SplitMix64::new(rc.seed ^ 0x5eed);
    // A central picker (GIE's EPP, the oracle) is one state for the whole topology.
    let (n_replicas, n_workers) = if policy.central() { (1, 1) } else { (rc.replicas, rc.workers) };
    let replicas: Vec<Replica> = (0..n_replicas)
        .map(|ri| Replica {
            store: MemStore::new(),
            // One owner nonce per replica: a replica's reader skips its own record by it.
            inflight: std::cell::RefCell::new(inflight::InflightTable::new(1 + ri as u64)),
            poller: Poller::new(&cfg),
            next_poll: rng.next_f64() * rc.poll_ms as f64,
            adaptive: policy.is_ours(),
            // One batch is pending at a time: a tick longer than the metrics delay.
            poll_tick_ms: inference_picker::poll::poller::tick_period_ms(&cfg.poller)
                .max(rc.metrics_delay_ms + 1),
            pending: None,
            sglang: (policy == Policy::Sglang).then(|| CacheAware::new(n)),
            dynamo: matches!(policy, Policy::Dynamo | Policy::DynamoNoEvents)
                .then(|| KvRouter::new(n, policy == Policy::Dynamo, trace.tokens_per_hash)),
            stale_pending: None,
            stale: None,
        })
        .collect();
    // Replicas of ours that exchange (`peers`): their picks also go to the other replicas.
    let exchanging = rc.peer_sync_ms.is_some() && policy.is_ours() && n_replicas > 1;
    let workers: Vec<Worker> = (0..n_replicas * n_workers)
        .map(|i| {
            let mut wrng = SplitMix64::new(rc.seed.wrapping_mul(1_000_003).wrapping_add(i as u64));
            Worker {
                replica: i / n_workers,
                sched: policy.uses_scheduler().then(|| Scheduler::new(&cfg)),
                cache: SnapshotCache::new(),
                rr_next: wrng.below(n),
                next_tick: wrng.next_f64() * rc.poll_ms as f64,
                rng: wrng,
                flow: policy
                    .uses_flow_control()
                    .then(|| FlowQueue::new(&cfg.flow_control, MODEL, i as u64 + 1)),
                held: hashbrown::HashMap::new(),
                feed: (policy.is_ours() && !rc.no_feed && (n_workers > 1 || exchanging)).then(|| {
                    let (base, slot) = (i - i % n_workers, i % n_workers);
                    Feed {
                        slot,
                        owner: i as u64 + 1,
                        writer: FeedWriter::default(),
                        reader: FeedReader::default(),
                        others: (0..n_workers)
                            .filter(|&j| j != slot)
                            .map(|j| (j, (base + j) as u64 + 1))
                            .collect(),
                    }
                }),
            }
        })
        .collect();
    let mut sim = Sim {
        trace,
        policy,
        rc,
        sat,
        servers,
        addresses,
        addr_index,
        replicas,
        workers,
        live: vec![Live::default(); trace.requests.len()],
        out: Outcome::new(trace, policy, rc.labels()),
        head: RequestHead {
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            content_length: None,
            session_id: None,
            session_token: None,
            priority: Default::default(),
            test_selection: None,
        },
        events: Vec::new(),
        tiers: trace.has_tiers(),
        peer_sync: rc.peer_sync_ms.filter(|_| policy.is_ours() && n_replicas > 1).map(|ms| PeerSync {
            every_ms: ms as f64,
            next: 0.0,
            keys: inference_picker::state::prefix_shared::SharedPrefix::new(
                cfg.scheduler.prefix.shared_shards,
                cfg.scheduler.prefix.shared_entries_per_shard,
            )
            .keys()
            .to_vec(),
            entries: cfg.scheduler.prefix.shared_entries_per_shard.max(1),
            sent: vec![Vec::new(); n_replicas],
            placements: (0..n_replicas).map(|_| peers::PlacementExporter::default()).collect(),
            workers_per_replica: n_workers,
        }),
        approx: (policy == Policy::OracleApproxPrefix).then(|| {
            // As many units per server as its KV holds.
            let units = server_cfg.num_gpu_blocks * u64::from(server_cfg.block_size)
                / u64::from(server_cfg.hash_tokens().max(1));
            oracle::ApproxIndex::new(n, units as usize)
        }),
        cfg,
    };
    sim.run_loop(&mut rng)?;
    for (si, s) in sim.servers.iter().enumerate() {
        sim.out.server_end(si, &s.metrics_snapshot());
    }
    sim.out.wall_s = wall.elapsed().as_secs_f64();
    let unfinished = sim.live.iter().filter(|l| !l.done).count();
    Ok(sim.out.finish(unfinished))
}

impl Sim<'_> {
    fn run_loop(&mut self, rng: &mut SplitMix64) -> Result<(), String> {
        let reqs = &self.trace.requests;
        let rc = self.rc;
        // Arrivals start once every replica has published a first snapshot, as in a gateway that
        // has been up for a while (before that, every request would get a 503).
        // Ours schedules each server's first scrape at a random phase within one interval of its
        // first tick (itself within the first interval), and publishes at the next tick after.
        let adaptive_extra = self
            .replicas
            .iter()
            .filter(|r| r.adaptive)
            .map(|r| rc.poll_ms + 2 * r.poll_tick_ms)
            .max()
            .unwrap_or(0);
        let warm_up = (rc.poll_ms + adaptive_extra + rc.metrics_delay_ms + 1) as f64;
        let arrival = |i: usize| reqs.get(i).map(|r| warm_up + r.arrival_ms / rc.load);
        self.out.first_arrival = arrival(0).unwrap_or(0.0);
        let mut next_req = 0usize;
        loop {
            let ta = arrival(next_req);
            let ts = self.servers.iter().filter_map(Server::next_wakeup).min_by(f64::total_cmp);
            // Ticks matter only while some worker holds requests.
            let tt = self
                .workers
                .iter()
                .filter(|w| w.flow.as_ref().is_some_and(|f| f.needs_tick()))
                .map(|w| w.next_tick)
                .min_by(f64::total_cmp);
            // The exchange runs on its own timer, as the module's poller sends every interval.
            let tx = if ta.is_some() { self.peer_sync.as_ref().map(|p| p.next) } else { None };
            let t = match [ta, ts, tt, tx].into_iter().flatten().min_by(f64::total_cmp) {
                Some(t) => t,
                None => break,
            };
            let tp = self
                .replicas
                .iter()
                .map(|r| r.pending.as_ref().map_or(r.next_poll, |(d, _)| d.min(r.next_poll)))
                .min_by(f64::total_cmp)
                .unwrap_or(f64::INFINITY);
            let t = t.min(tp);

            // 1. Servers: steps ending by t.
            for si in 0..self.servers.len() {
                if self.servers[si].next_wakeup().is_some_and(|w| w <= t) {
                    self.advance_server(si, t);
                }
            }
            // 2. Polls: deliveries, then new scrapes.
            for ri in 0..self.replicas.len() {
                self.poll(ri, t)?;
            }
            // 3. Flow-control ticks.
            for wi in 0..self.workers.len() {
                if self.workers[wi].next_tick <= t {
                    while self.workers[wi].next_tick <= t {
                        self.workers[wi].next_tick += rc.poll_ms as f64;
                    }
                    self.tick(wi, t)?;
                }
            }
            // 4. The replicas' exchange, when due.
            self.exchange_prefixes(t);
            // 5. Arrivals at t, each to a random worker.
            while let Some(ta) = arrival(next_req).filter(|&a| a <= t) {
                let idx = next_req;
                next_req += 1;
                // Each request to a random worker (one worker for a central picker; the draw is
                // kept so that every strategy sees the same random sequence).
                let wi = rng.below(rc.replicas * rc.workers) % self.workers.len();
                self.live[idx].arrival = ta;
                self.out.arrived(idx, ta);
                self.live[idx].replica = self.workers[wi].replica;
                self.live[idx].worker = wi;
                self.arrive(wi, idx, ta)?;
            }
        }
        Ok(())
    }

    /// `RunConfig::peer_sync_ms`: when an exchange is due (its own timer in the event loop, every
    /// `peer_sync_ms` while requests remain, as the module's poller sends on its tick, whether or
    /// not requests arrive), every replica's records changed since its last send are applied to
    /// every other replica's table. Unlike the module, a batch is not capped at
    /// `peers::MAX_RECORDS` (a replica writes far fewer in an interval) and arrives at once.
    fn exchange_prefixes(&mut self, t: f64) {
        use inference_picker::base::ports::SharedStore;
        use inference_picker::state::prefix_shared::{delta, upsert};
        let Some(ps) = self.peer_sync.as_mut() else { return };
        if t < ps.next {
            return;
        }
        ps.next = t + ps.every_ms;
        let read = |r: &Replica, k: &str| r.store.get(k).ok().flatten().map(|(v, _)| v).unwrap_or_default();
        // What each replica reads now is what its next send starts from (its exporter's last
        // read): the records it applies below look changed to it then, and go out once more.
        let mut read_now: Vec<Vec<Vec<u8>>> = vec![Vec::with_capacity(ps.keys.len()); self.replicas.len()];
        for (si, key) in ps.keys.iter().enumerate() {
            let now: Vec<Vec<u8>> = self.replicas.iter().map(|r| read(r, key)).collect();
            for (slot, v) in read_now.iter_mut().zip(&now) {
                slot.push(v.clone());
            }
            let deltas: Vec<_> = now
                .iter()
                .zip(&ps.sent)
                .map(|(v, sent)| delta(sent.get(si).map_or(&[][..], |s| s.as_slice()), v))
                .collect();
            if deltas.iter().all(Vec::is_empty) {
                continue;
            }
            for (ri, rep) in self.replicas.iter().enumerate() {
                let mut v = now[ri].clone();
                for (from, d) in deltas.iter().enumerate() {
                    if from != ri && !d.is_empty() {
                        v = upsert(&v, d, ps.entries);
                    }
                }
                let _ = rep.store.set(key, &v, 0);
            }
        }
        ps.sent = read_now;
        // Each replica's picks since the last exchange (read from its workers' rings now; the
        // module's poller reads them every tick), to every other replica, where one worker
        // takes them (as one worker's filter takes a peer's POST) and republishes them for its
        // own workers, marked foreign.
        let n = ps.workers_per_replica;
        let batches: Vec<Vec<_>> = ps
            .placements
            .iter_mut()
            .zip(&self.replicas)
            .enumerate()
            .map(|(ri, (ex, rep))| {
                let vms: Vec<(usize, u64)> = (0..n).map(|j| (j, (ri * n + j) as u64 + 1)).collect();
                ex.collect(&rep.store, &vms);
                let taken = ex.take();
                let body = peers::encode_placements(ri as u64 + 1, &taken);
                peers::decode_placements(&body).map(|(_, p)| p).unwrap_or_default()
            })
            .collect();
        for (ri, rep) in self.replicas.iter().enumerate() {
            let Some(w) = self.workers.get_mut(ri * n) else { continue };
            let (Some(s), Some(f)) = (w.sched.as_mut(), w.feed.as_mut()) else { continue };
            for (from, batch) in batches.iter().enumerate() {
                if from == ri {
                    continue;
                }
                for p in batch {
                    s.observe(p);
                    let _ = f.writer.publish(&rep.store, f.slot, f.owner, p);
                }
            }
        }
    }

    fn advance_server(&mut self, si: usize, t: f64) {
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        self.servers[si].advance_into(t, &mut events);
        handle_events(
            &events,
            si,
            &mut self.live,
            &mut self.replicas,
            &mut self.workers,
            &self.addresses,
            &mut self.out,
        );
        // Release on completion, as the filter's `on_log` does (`Worker::on_finish`): the worker
        // the request arrived on credits the freed room and runs its release check at once.
        for e in &events {
            if let Event::Finished { id, .. } | Event::Rejected { id, .. } = *e {
                if let Some(wi) = self.live.get(id as usize).map(|l| l.worker) {
                    let _ = self.finish(wi, t);
                }
            }
        }
        self.events = events;
    }

    /// A request of worker `wi` finished: `flow::credit_finish`, then that worker's release
    /// check when it holds requests.
    fn finish(&mut self, wi: usize, t: f64) -> Result<(), String> {
        if self.workers.get(wi).and_then(|w| w.flow.as_ref()).is_none() {
            return Ok(());
        }
        let now_ms = EPOCH_MS + t as u64;
        let cap = self.capacity(wi, now_ms)?;
        let store = &self.replicas[self.workers[wi].replica].store;
        let credited = inference_picker::flow::credit_finish(
            store,
            MODEL,
            &cap,
            self.cfg.flow_control.worker_ttl_ms,
            now_ms,
        )
        .unwrap_or(false);
        if credited && self.workers[wi].flow.as_ref().is_some_and(|f| !f.is_empty()) {
            self.tick(wi, t)?;
        }
        Ok(())
    }

    fn poll(&mut self, ri: usize, t: f64) -> Result<(), String> {
        let due_delivery = self.replicas[ri].pending.as_ref().is_some_and(|(d, _)| *d <= t);
        if due_delivery {
            if let Some((d, texts)) = self.replicas[ri].pending.take() {
                let now_ms = EPOCH_MS + d as u64;
                let r = &mut self.replicas[ri];
                // As the module's poller: this replica's in-flight counts when the scrape answers,
                // the base of the live load estimate (`inference_picker::state::load`). Ours only: the
                // baselines that run on our scheduler core do not have it.
                let ours = self.policy.is_ours();
                let counts = if ours { r.inflight.borrow_mut().read(&r.store, now_ms).ok() } else { None };
                for (si, body) in &texts {
                    let res = ScrapeResult::Response { status: 200, body: body.as_bytes() };
                    let addr = &self.addresses[*si];
                    let at_scrape = counts.as_ref().map(|c| c.get(addr));
                    if let Err(e) = r.poller.on_result_with_inflight(addr, now_ms, at_scrape, res) {
                        self.out.scrape_errors.push(format!("{e:?}"));
                    }
                }
                if !r.adaptive || r.poller.publish_due(now_ms) {
                    let snap = r.poller.snapshot(now_ms);
                    publish(&r.store, &snap).map_err(|e| format!("publish: {e:?}"))?;
                }
                if let Some(copies) = r.stale_pending.take() {
                    r.stale = Some(copies);
                }
            }
        }
        if self.replicas[ri].next_poll <= t {
            let tp = self.replicas[ri].next_poll;
            // The servers' state at the scrape time.
            for si in 0..self.servers.len() {
                self.advance_server(si, tp);
            }
            let now_ms = EPOCH_MS + tp as u64;
            let due = if self.replicas[ri].adaptive {
                let r = &mut self.replicas[ri];
                if let Ok(counts) = r.inflight.borrow_mut().read(&r.store, now_ms) {
                    r.poller.note_inflight(|a| counts.get(a));
                }
                // Results already in but not yet due for publishing (heartbeat, change gap).
                if r.poller.publish_due(now_ms) {
                    let snap = r.poller.snapshot(now_ms);
                    publish(&r.store, &snap).map_err(|e| format!("publish: {e:?}"))?;
                }
                r.poller.scrapes_due(now_ms)
            } else {
                self.replicas[ri].poller.due(now_ms)
            };
            let info = RenderInfo {
                model_name: MODEL,
                unix_now_s: now_ms as f64 / 1000.0,
                created_unix_s: EPOCH_MS as f64 / 1000.0,
                lora_history: None,
            };
            let texts: Vec<(usize, String)> = due
                .iter()
                .filter_map(|a| self.addr_index.get(a.as_str()).copied())
                .filter_map(|si| self.servers.get(si).map(|s| (si, s.render_metrics(Engine::Vllm, &info))))
                .collect();
            let copies = (self.policy == Policy::OracleStale).then(|| self.servers.clone());
            let r = &mut self.replicas[ri];
            r.pending = Some((tp + self.rc.metrics_delay_ms as f64, texts));
            r.stale_pending = copies;
            r.next_poll = tp + if r.adaptive { r.poll_tick_ms } else { self.rc.poll_ms } as f64;
        }
        Ok(())
    }

    /// `ours-perfect-state`: scrape every server at `t` and publish at once (no interval, no
    /// delay), so the next decision reads the exact state of this instant.
    fn publish_now(&mut self, ri: usize, t: f64) -> Result<(), String> {
        for si in 0..self.servers.len() {
            self.advance_server(si, t);
        }
        let now_ms = EPOCH_MS + t as u64;
        let info = RenderInfo {
            model_name: MODEL,
            unix_now_s: now_ms as f64 / 1000.0,
            created_unix_s: EPOCH_MS as f64 / 1000.0,
            lora_history: None,
        };
        let r = &mut self.replicas[ri];
        let counts = r.inflight.borrow_mut().read(&r.store, now_ms).ok();
        for (si, s) in self.servers.iter().enumerate() {
            let body = s.render_metrics(Engine::Vllm, &info);
            let addr = &self.addresses[si];
            let res = ScrapeResult::Response { status: 200, body: body.as_bytes() };
            let at_scrape = counts.as_ref().map(|c| c.get(addr));
            if let Err(e) = r.poller.on_result_with_inflight(addr, now_ms, at_scrape, res) {
                self.out.scrape_errors.push(format!("{e:?}"));
            }
        }
        let snap = r.poller.snapshot(now_ms);
        publish(&r.store, &snap).map_err(|e| format!("publish: {e:?}"))
    }

    /// The snapshot worker `wi` sees now.
    fn snapshot(&mut self, wi: usize) -> Result<Rc<Snapshot>, String> {
        let w = &mut self.workers[wi];
        let store = &self.replicas[w.replica].store;
        w.cache.refresh(store).map_err(|e| format!("snapshot: {e:?}"))
    }

    /// Flow control's view of capacity for worker `wi`.
    fn capacity(&mut self, wi: usize, now_ms: u64) -> Result<Capacity, String> {
        let snap = self.snapshot(wi)?;
        let rep = &self.replicas[self.workers[wi].replica];
        let counts = rep.inflight.borrow_mut().read(&rep.store, now_ms).unwrap_or_default();
        let eps: Vec<&EndpointStatus> = snap.endpoints.iter().collect();
        let report = saturated(&self.sat, &eps, &|a| counts.get(a), now_ms);
        let cap = Capacity::new(snap.version, &report);
        // `flow_control.reserve`: the capacity left below it, as `admission::capacity_with`.
        Ok(match &self.cfg.flow_control.reserve {
            Some(r) => {
                let low = saturated(
                    &inference_picker::flow::admission::reserved_params(&self.sat, r),
                    &eps,
                    &|a| counts.get(a),
                    now_ms,
                );
                cap.with_reserve(r.min_priority, &low)
            }
            None => cap,
        })
    }

    fn arrive(&mut self, wi: usize, idx: usize, t: f64) -> Result<(), String> {
        let now_ms = EPOCH_MS + t as u64;
        if self.workers[wi].flow.is_none() {
            return self.dispatch(wi, idx, t);
        }
        let req = &self.trace.requests[idx];
        // The tier label travels in the header the configuration names (an InferenceObjective
        // for `ours+flow`, the example's `x-llm-tier` for `ours-tiers`); the shipped default
        // trusts neither, so for `ours` it changes nothing.
        let tier = self.trace.has_tiers().then(|| strategy::tier_header(self.policy, req.tier.as_str()));
        let decision = resolve_priority(&self.cfg.priority, Criticality::Standard, &|h| match &tier {
            Some((name, v)) if *name == h => Some(v.clone()),
            _ => None,
        });
        let cap = self.capacity(wi, now_ms)?;
        let w = &mut self.workers[wi];
        let store = &self.replicas[w.replica].store;
        let Some(flow) = w.flow.as_mut() else { return Ok(()) };
        let ticket = Ticket {
            id: idx as u32,
            priority: decision.priority,
            fairness_id: &decision.fairness_id,
            deadline_ms: inference_picker::flow::slo::deadline_ms(now_ms, decision.targets.ttft_ms),
        };
        match flow.admit(store, &ticket, &cap, now_ms) {
            Admission::Pass => self.dispatch(wi, idx, t),
            Admission::Held { evicted } => {
                w.held.insert(idx as u32, idx);
                if let Some((id, rej)) = evicted {
                    if let Some(e) = w.held.remove(&id) {
                        self.reject(e, format!("flow_{}_{}", rej.status, rej.code));
                    }
                }
                Ok(())
            }
            Admission::Reject(rej) => {
                self.reject(idx, format!("flow_{}_{}", rej.status, rej.code));
                Ok(())
            }
        }
    }

    fn tick(&mut self, wi: usize, t: f64) -> Result<(), String> {
        if !self.workers[wi].flow.as_ref().is_some_and(|f| f.needs_tick()) {
            return Ok(());
        }
        let now_ms = EPOCH_MS + t as u64;
        let cap = self.capacity(wi, now_ms)?;
        let w = &mut self.workers[wi];
        let store = &self.replicas[w.replica].store;
        let Some(flow) = w.flow.as_mut() else { return Ok(()) };
        let actions = flow.on_tick(store, &cap, now_ms);
        for a in actions {
            match a {
                Action::Release { id, .. } => {
                    if let Some(idx) = self.workers[wi].held.remove(&id) {
                        self.dispatch(wi, idx, t)?;
                    }
                }
                Action::Reject { id, rejection, .. } => {
                    if let Some(idx) = self.workers[wi].held.remove(&id) {
                        self.reject(idx, format!("flow_{}_{}", rejection.status, rejection.code));
                    }
                }
            }
        }
        Ok(())
    }

    fn reject(&mut self, idx: usize, reason: String) {
        self.out.reject(idx, reason);
        self.live[idx].done = true;
    }

    /// Routes request `idx` on worker `wi` at `t` and submits it to the chosen server.
    fn dispatch(&mut self, wi: usize, idx: usize, t: f64) -> Result<(), String> {
        let trace = self.trace;
        let req = &trace.requests[idx];
        let n = self.servers.len();
        let msgs = text::messages(trace, idx, req);
        let model = req.adapter.map_or_else(|| MODEL.to_string(), strategy::adapter_name);
        let now_ms = EPOCH_MS + t as u64;
        let sim = SimRequest {
            id: idx as u64,
            prompt_tokens: req.prompt_tokens,
            block_hashes: text::server_hashes(&msgs, trace.tokens_per_hash),
            output_tokens: req.output_tokens,
            adapter: req.adapter.map(strategy::adapter_name),
            arrival_ms: t,
        };
        if self.policy == Policy::OursPerfectState {
            self.publish_now(self.workers[wi].replica, t)?;
        }
        let snap = if self.policy.uses_scheduler() { Some(self.snapshot(wi)?) } else { None };
        // The trusted priority headers, as the host reads them before the body (the tier label
        // in the header the configuration names; nothing for a configuration that trusts none).
        if self.tiers && self.policy.uses_scheduler() {
            let tier = strategy::tier_header(self.policy, req.tier.as_str());
            self.head.priority =
                PriorityHeaders::read(&self.cfg.priority, &|h| (h == tier.0).then(|| tier.1.clone()));
        }
        let w = &mut self.workers[wi];
        let rep = &mut self.replicas[w.replica];
        let counts = rep.inflight.borrow_mut().read(&rep.store, now_ms).unwrap_or_default();
        let chosen: Result<usize, String> = match self.policy {
            Policy::Ours
            | Policy::OursFlow
            | Policy::OursTiers
            | Policy::OursSlo
            | Policy::OursPerfectState
            | Policy::GieDefault
            | Policy::GieDefaultLora
            | Policy::Gie111
            | Policy::LoadOnly => {
                let body = text::chat_body(&model, &msgs, req.output_tokens);
                match (w.sched.as_mut(), snap) {
                    (Some(s), Some(snap)) => {
                        let health = HealthView::default();
                        let state = PickState {
                            snapshot: &snap,
                            inflight: &counts,
                            health: &health,
                            store: &rep.store,
                            now_ms,
                        };
                        // The other workers' placements first, then this pick's for them, as
                        // the host's `go` does.
                        if let Some(f) = w.feed.as_mut() {
                            let mut seen = Vec::new();
                            if !f.others.is_empty() {
                                f.reader.poll(&rep.store, &f.others, feed::MAX_PER_PICK, &mut seen);
                            }
                            for p in &seen {
                                s.observe(p);
                            }
                            s.set_feed(true);
                        }
                        let routed = on_body(&self.cfg.request(), s, &mut w.rng, &self.head, &body, state);
                        if let (Some(f), Some(p)) = (w.feed.as_mut(), s.take_placement()) {
                            let _ = f.writer.publish(&rep.store, f.slot, f.owner, &p);
                        }
                        match routed {
                            Ok(routed) => {
                                self.live[idx].worker = wi;
                                self.live[idx].ticket = routed.pick.ticket;
                                if let Some(ms) = routed.pick.predicted_ms {
                                    self.out.predicted(idx, ms, t);
                                }
                                self.addr_index
                                    .get(routed.pick.primary.as_str())
                                    .copied()
                                    .ok_or_else(|| format!("unknown endpoint {}", routed.pick.primary))
                            }
                            Err(rej) => Err(format!("router_{}_{}", rej.status, rej.code)),
                        }
                    }
                    _ => Err("no scheduler".into()),
                }
            }
            Policy::LlmDSlo => {
                let body = text::chat_body(&model, &msgs, req.output_tokens);
                match (w.sched.as_mut(), snap) {
                    (Some(s), Some(snap)) => {
                        let health = HealthView::default();
                        let state = PickState {
                            snapshot: &snap,
                            inflight: &counts,
                            health: &health,
                            store: &rep.store,
                            now_ms,
                        };
                        let slo_ms = self.rc.slo.map(|t| t.of(req.tier));
                        let sheddable = req.tier == crate::trace::Tier::Sheddable;
                        let routed = crate::slo_policy::llm_d_route(
                            &self.cfg.request(),
                            s,
                            &mut w.rng,
                            &self.head,
                            &body,
                            state,
                            slo_ms,
                            sheddable,
                            &|a| counts.get(a),
                        );
                        match routed {
                            Ok(pick) => {
                                self.live[idx].worker = wi;
                                self.live[idx].ticket = pick.ticket;
                                if let Some(ms) = pick.predicted_ms {
                                    self.out.predicted(idx, ms, t);
                                }
                                self.addr_index
                                    .get(pick.primary.as_str())
                                    .copied()
                                    .ok_or_else(|| format!("unknown endpoint {}", pick.primary))
                            }
                            Err(reason) => Err(reason),
                        }
                    }
                    _ => Err("no scheduler".into()),
                }
            }
            Policy::Sglang => {
                let body = text::chat_body(&model, &msgs, req.output_tokens);
                match inference_picker::request::body::parse_request(&self.head.path, &body) {
                    Ok(parsed) => {
                        let loads: Vec<u32> = self.addresses.iter().map(|a| counts.get(a)).collect();
                        match rep.sglang.as_mut() {
                            Some(p) => Ok(p.select(&parsed.prompt, &loads, t, &mut w.rng).0),
                            None => Err("no sglang state".into()),
                        }
                    }
                    Err(rej) => Err(format!("router_{}_{}", rej.status, rej.code)),
                }
            }
            Policy::LeastRequest => {
                // Envoy LEAST_REQUEST with equal weights: two distinct random hosts, the one with
                // fewer active requests (the first on a tie).
                let a = w.rng.below(n);
                let b = if n > 1 { (a + 1 + w.rng.below(n - 1)) % n } else { a };
                let (ca, cb) = (counts.get(&self.addresses[a]), counts.get(&self.addresses[b]));
                Ok(if cb < ca { b } else { a })
            }
            Policy::RoundRobin => {
                let i = w.rr_next % n;
                w.rr_next = w.rr_next.wrapping_add(1);
                Ok(i)
            }
            Policy::Random => Ok(w.rng.below(n)),
            Policy::Dynamo | Policy::DynamoNoEvents => match rep.dynamo.as_mut() {
                Some(d) => {
                    let cached: Vec<u64> = if d.uses_events() {
                        self.servers
                            .iter()
                            .map(|s| {
                                s.cached_prefix_tokens(
                                    &sim.block_hashes,
                                    sim.prompt_tokens,
                                    sim.adapter.as_deref(),
                                )
                            })
                            .collect()
                    } else {
                        Vec::new()
                    };
                    let full = (sim.prompt_tokens / trace.tokens_per_hash.max(1)) as usize;
                    let units = &sim.block_hashes[..full.min(sim.block_hashes.len())];
                    let r = dynamo::Request { id: sim.id, prompt_tokens: sim.prompt_tokens, units };
                    Ok(d.select(&r, &cached, t, &mut w.rng))
                }
                None => Err("no dynamo state".into()),
            },
            Policy::Oracle => Ok(oracle::pick(&mut self.servers, &sim, t, &mut w.rng)),
            Policy::OracleStale => match rep.stale.as_mut() {
                Some(copies) => Ok(oracle::pick_stale(copies, &sim, &mut w.rng)),
                None => Err("no stale state".into()),
            },
            Policy::OracleApproxPrefix => match self.approx.as_mut() {
                Some(ix) => {
                    let full = (sim.prompt_tokens / trace.tokens_per_hash.max(1)) as usize;
                    let units = &sim.block_hashes[..full.min(sim.block_hashes.len())];
                    Ok(oracle::pick_approx(&mut self.servers, &sim, units, ix, t, &mut w.rng))
                }
                None => Err("no approximate index".into()),
            },
        };
        let si = match chosen {
            Ok(si) => si,
            Err(reason) => {
                self.reject(idx, reason);
                return Ok(());
            }
        };
        self.submit(wi, idx, si, sim, now_ms);
        Ok(())
    }

    /// Submits request `idx`, routed by worker `wi` to server `si`, and counts it in flight
    /// there (or rejects it when the server refuses it).
    fn submit(&mut self, wi: usize, idx: usize, si: usize, sim: SimRequest, now_ms: u64) {
        self.live[idx].server = si;
        if self.policy == Policy::OracleStale {
            // It knows its own decisions since the scrape, as ours knows its in-flight counts:
            // queued on the copy as of the scrape.
            let rep = &mut self.replicas[self.workers[wi].replica];
            for copies in [rep.stale.as_mut(), rep.stale_pending.as_mut()].into_iter().flatten() {
                if let Some(c) = copies.get_mut(si) {
                    let _ = c.submit(SimRequest { arrival_ms: c.now_ms(), ..sim.clone() });
                }
            }
        }
        let rep = &mut self.replicas[self.workers[wi].replica];
        match self.servers[si].submit(sim) {
            Ok(()) => {
                let _ = rep.inflight.borrow_mut().adjust(&rep.store, &self.addresses[si], 1, now_ms);
                let ri = self.workers[wi].replica;
                publish_prefill(&self.replicas, &self.workers, ri, &self.addresses[si], now_ms);
                self.out.routed(idx, si);
            }
            Err(e) => {
                if let Some(d) = self.replicas[self.live[idx].replica].dynamo.as_mut() {
                    d.finished(idx as u64);
                }
                self.reject(idx, format!("server_{}", submit_error_code(&e)))
            }
        }
    }
}

fn submit_error_code(e: &model_server_sim::SubmitError) -> &'static str {
    match e {
        model_server_sim::SubmitError::DuplicateId(_) => "duplicate_id",
        model_server_sim::SubmitError::TooLarge { .. } => "too_large",
        model_server_sim::SubmitError::LoraDisabled => "lora_disabled",
    }
}

/// Ours: the host filter reports a request's first response byte and its end to the scheduler of
/// the worker that routed it (prefill ledger, learnt rates in the replica's shared store).
fn report(
    l: &Live,
    first_ms: Option<f64>,
    si: usize,
    replicas: &[Replica],
    workers: &mut [Worker],
    addresses: &[String],
) {
    if l.ticket == 0 {
        return;
    }
    let Some(w) = workers.get_mut(l.worker) else { return };
    let Some(s) = w.sched.as_mut() else { return };
    match (first_ms, replicas.get(w.replica)) {
        (Some(t), Some(r)) => {
            let _ =
                s.first_byte(l.ticket, addresses.get(si).map(String::as_str), &r.store, EPOCH_MS + t as u64);
        }
        _ => s.request_done(l.ticket),
    }
}

/// Ours: each worker publishes its ledger's prefill per endpoint with its in-flight record, and
/// readers sum the records (`InflightTable::adjust_with_prefill`, `set_prefill`); the replica's
/// one table holds that sum, as exact and immediate as its counts.
fn publish_prefill(replicas: &[Replica], workers: &[Worker], ri: usize, address: &str, now_ms: u64) {
    let Some(r) = replicas.get(ri) else { return };
    let (mut tokens, mut n) = (0.0, 0u32);
    for s in workers.iter().filter(|w| w.replica == ri).filter_map(|w| w.sched.as_ref()) {
        let (t, k) = s.ledger_prefill(address);
        tokens += t;
        n = n.saturating_add(k);
    }
    let _ = r.inflight.borrow_mut().set_prefill(&r.store, address, (tokens, n), now_ms);
}

fn handle_events(
    events: &[Event],
    si: usize,
    live: &mut [Live],
    replicas: &mut [Replica],
    workers: &mut [Worker],
    addresses: &[String],
    out: &mut Outcome,
) {
    for e in events {
        match *e {
            Event::FirstToken { id, t_ms } => {
                if let Some(l) = live.get_mut(id as usize) {
                    l.first = Some(t_ms);
                    report(l, Some(t_ms), si, replicas, workers, addresses);
                    publish_prefill(replicas, workers, l.replica, &addresses[si], EPOCH_MS + t_ms as u64);
                    if let Some(d) = replicas.get_mut(l.replica).and_then(|r| r.dynamo.as_mut()) {
                        d.first_token(id);
                    }
                }
            }
            Event::Finished { id, t_ms, output_tokens, cached_tokens, preemptions: _ } => {
                if let Some(l) = live.get_mut(id as usize) {
                    if l.done {
                        continue;
                    }
                    l.done = true;
                    report(l, None, si, replicas, workers, addresses);
                    let ttft = l.first.unwrap_or(t_ms) - l.arrival;
                    out.finished(id as usize, ttft, t_ms - l.arrival, t_ms, output_tokens, cached_tokens);
                    if let Some(r) = replicas.get_mut(l.replica) {
                        let _ = r.inflight.borrow_mut().adjust(
                            &r.store,
                            &addresses[si],
                            -1,
                            EPOCH_MS + t_ms as u64,
                        );
                        if let Some(d) = r.dynamo.as_mut() {
                            d.finished(id);
                        }
                    }
                    publish_prefill(replicas, workers, l.replica, &addresses[si], EPOCH_MS + t_ms as u64);
                }
            }
            Event::Rejected { id, t_ms, .. } => {
                if let Some(l) = live.get_mut(id as usize) {
                    if !l.done {
                        l.done = true;
                        report(l, None, si, replicas, workers, addresses);
                        out.reject(id as usize, "server_rejected".into());
                        if let Some(r) = replicas.get_mut(l.replica) {
                            let _ = r.inflight.borrow_mut().adjust(
                                &r.store,
                                &addresses[si],
                                -1,
                                EPOCH_MS + t_ms as u64,
                            );
                            if let Some(d) = r.dynamo.as_mut() {
                                d.finished(id);
                            }
                        }
                        publish_prefill(replicas, workers, l.replica, &addresses[si], EPOCH_MS + t_ms as u64);
                    }
                }
            }
            Event::Preempted { .. } => out.preemptions += 1,
            Event::Token { .. } => {}
        }
    }
}

/// The state of the `RunConfig::peer_sync_ms` study.
struct PeerSync {
    every_ms: f64,
    next: f64,
    keys: Vec<String>,
    entries: usize,
    /// Per replica, per shard: its value at the last exchange.
    sent: Vec<Vec<Vec<u8>>>,
    /// Per replica, its poller's side of the placements exchange (`peers::PlacementExporter`).
    placements: Vec<peers::PlacementExporter>,
    workers_per_replica: usize,
}
