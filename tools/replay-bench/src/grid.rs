//! The robustness grid (`make bench-robust`): synthetic workloads over the space a real pool
//! sees, ours against every baseline in each cell.
//!
//! # Axes
//! - **Prefix reuse** ([`Reuse`]): none (every prompt unique); a shared system prompt (8 of them,
//!   Zipf popularity, each followed by a unique question); long shared documents (6 per pod,
//!   Zipf popularity, each followed by a unique question); multi-turn chats (each turn's prompt
//!   is the whole conversation so far, the next turn after a think time).
//! - **Burstiness** ([`Burst`]): Poisson; on/off (2 s on, 4 s off, the same mean rate);
//!   batches aligned to a 0.5 s grid, as Mooncake's trace is to its ~3 s grid.
//! - **Lengths** ([`Lengths`]): short chat (1.5k-token shared part, 300 unique, 200 out); long
//!   context (12k shared, 800 unique, 200 out); long generation (1.5k shared, 300 unique,
//!   1,200 out). Each draw is log-normal around its mean (σ 0.6; shared parts σ 0.3 per group
//!   or document); with no reuse the "shared" part is unique text too, so the lengths match.
//! - **Pool size**: 4 to 64 pods.
//! - **Heterogeneous pods**: every other pod at 0.6 × the speed with half the KV cache (a pool of
//!   two GPU generations), or a uniform pool.
//! - **LoRA**: 8 adapters (Zipf), 70 % of requests name one; 4 adapter slots per pod.
//!
//! The full product is 720 cells; the grid runs 36 ([`cells`]): every (reuse, burst) pair three
//! times, with lengths, pool size, heterogeneity and LoRA rotated over the three so that each
//! level of each axis appears in many cells and with many partners (a fractional design). Every
//! cell draws its trace and its replay from its own seed, derived from `--seed` and the cell.
//!
//! # Load
//! A cell's trace arrives at the pool's estimated capacity (`suite::estimated_capacity_rps_mix`,
//! from a 2,000-request pilot of the same cell) at load 1; it holds 300 s of arrivals at that
//! rate, at least 2,000 and at most 8,000 requests. The estimate is first-order (it leaves out
//! chunked-prefill overlap, and batches below the KV limit), so the knee is found by measuring:
//! least-request (the simplest load balancer) is replayed at 1, 1.4, 1.4², … × the estimate
//! until its TTFT p90 passes twice its p90 at a light load (0.3) plus 0.5 s, or the load reaches
//! 12. That load is the cell's knee; its sweep is 0.3, 0.6, 0.8, 1.0 and 1.2 × the knee, two
//! significant digits: light load to just past saturation.
//!
//! # Figures
//! Per cell, at its reference load (the highest load at which the best baseline's TTFT p90 is
//! under 5 s, as for the default set's SUMMARY): `vs_best` = best baseline's TTFT p90 ÷ ours
//! (rejections count as infinitely late), `vs_gie` = the better of GIE's default and GIE's default
//! with its LoRA scorer ÷ ours, and `worst` = the smallest best ÷ ours over the loads up to the
//! reference. The summary gives the median and 10th percentile of `vs_best` over the cells, the
//! smallest `worst`, and the median `vs_gie`.

use std::fmt::Write as _;

use inference_picker::base::ports::{Rng, SplitMix64};
use model_server_sim::ServerConfig;
use serde::Serialize;

use crate::arrivals;
use crate::replay::{run, PodClass, RunConfig};
use crate::strategy::Policy;
use crate::suite::{self, reference_load, Task, Workload, WorkloadResult};
use crate::text::MOONCAKE_BLOCK_TOKENS;
use crate::trace::{self, Content, Request, Tier, Trace};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Reuse {
    None,
    SystemPrompt,
    Documents,
    MultiTurn,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Burst {
    Poisson,
    OnOff,
    Batches,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Lengths {
    Chat,
    LongContext,
    LongGeneration,
}

impl Reuse {
    pub const ALL: [Reuse; 4] = [Reuse::None, Reuse::SystemPrompt, Reuse::Documents, Reuse::MultiTurn];
    fn key(self) -> &'static str {
        match self {
            Reuse::None => "unique",
            Reuse::SystemPrompt => "sysprompt",
            Reuse::Documents => "docs",
            Reuse::MultiTurn => "multiturn",
        }
    }
}

impl Burst {
    pub const ALL: [Burst; 3] = [Burst::Poisson, Burst::OnOff, Burst::Batches];
    fn key(self) -> &'static str {
        match self {
            Burst::Poisson => "poisson",
            Burst::OnOff => "onoff",
            Burst::Batches => "batches",
        }
    }
}

impl Lengths {
    pub const ALL: [Lengths; 3] = [Lengths::Chat, Lengths::LongContext, Lengths::LongGeneration];
    fn key(self) -> &'static str {
        match self {
            Lengths::Chat => "chat",
            Lengths::LongContext => "longctx",
            Lengths::LongGeneration => "longgen",
        }
    }

    /// Mean (shared, unique, output) tokens.
    fn means(self) -> (f64, f64, f64) {
        match self {
            Lengths::Chat => (1536.0, 300.0, 200.0),
            Lengths::LongContext => (12_288.0, 800.0, 200.0),
            Lengths::LongGeneration => (1536.0, 300.0, 1200.0),
        }
    }
}

/// Pool sizes of the grid.
pub const PODS: [usize; 5] = [4, 8, 16, 32, 64];

/// The slower class of a heterogeneous pool (the other is the default server).
pub const SLOW_POD: PodClass = PodClass { speed: 0.6, kv_factor: 0.5 };

/// Adapters of a LoRA cell, the share of requests on the base model and slots per pod.
pub const LORA_ADAPTERS: u16 = 8;
pub const LORA_BASE_SHARE: f64 = 0.3;
pub const LORA_SLOTS: u32 = 4;

/// Loads of each cell's sweep, as multiples of the pool's estimated capacity.
pub const LOADS: [f64; 5] = [0.3, 0.6, 0.8, 1.0, 1.2];

/// Longest prompt a generator makes, in tokens (a multi-turn chat ends there).
pub const MAX_PROMPT_TOKENS: u32 = 32_768;

/// One cell of the grid.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Cell {
    pub reuse: Reuse,
    pub burst: Burst,
    pub lengths: Lengths,
    pub pods: usize,
    pub hetero: bool,
    pub lora: bool,
    /// The cell's own seed (trace and replay).
    pub seed: u64,
}

impl Cell {
    /// `docs-onoff-longctx-16p-het-lora`.
    pub fn key(&self) -> String {
        let mut s =
            format!("{}-{}-{}-{}p", self.reuse.key(), self.burst.key(), self.lengths.key(), self.pods);
        if self.hetero {
            s.push_str("-het");
        }
        if self.lora {
            s.push_str("-lora");
        }
        s
    }

    pub fn pod_mix(&self) -> Vec<PodClass> {
        if self.hetero {
            vec![PodClass { speed: 1.0, kv_factor: 1.0 }, SLOW_POD]
        } else {
            vec![]
        }
    }

    pub fn server(&self) -> ServerConfig {
        if self.lora {
            ServerConfig { enable_lora: true, max_lora: LORA_SLOTS, ..ServerConfig::default() }
        } else {
            ServerConfig::default()
        }
    }

    /// The baselines this cell runs (GIE's LoRA profile too when requests name adapters).
    pub fn strategies(&self) -> Vec<Policy> {
        let mut v = vec![Policy::Ours, Policy::GieDefault];
        if self.lora {
            v.push(Policy::GieDefaultLora);
        }
        v.extend([Policy::Sglang, Policy::LeastRequest, Policy::RoundRobin, Policy::Random]);
        v
    }
}

fn mix(seed: u64, i: u64) -> u64 {
    SplitMix64::new(seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).next_u64()
}

/// The grid's 36 cells (see the module doc), seeds derived from `seed`.
pub fn cells(seed: u64) -> Vec<Cell> {
    let mut out = Vec::new();
    for (r, &reuse) in Reuse::ALL.iter().enumerate() {
        for (b, &burst) in Burst::ALL.iter().enumerate() {
            for v in 0..3 {
                let i = out.len() as u64;
                out.push(Cell {
                    reuse,
                    burst,
                    lengths: Lengths::ALL[(r + b + v) % 3],
                    pods: PODS[(2 * r + b + 3 * v) % PODS.len()],
                    hetero: (r + b + v) % 2 == 1,
                    lora: (r + 2 * b + v) % 3 == 2,
                    seed: mix(seed, i + 1),
                });
            }
        }
    }
    out
}

/// A standard normal draw (Box–Muller).
fn normal(g: &mut impl Rng) -> f64 {
    let u1 = (1.0 - g.next_f64()).max(1e-300);
    let u2 = g.next_f64();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// A log-normal draw with the given mean and σ, at least 1.
fn lognormal(g: &mut impl Rng, mean: f64, sigma: f64) -> f64 {
    (mean * (sigma * normal(g) - sigma * sigma / 2.0).exp()).max(1.0)
}

fn exp(g: &mut impl Rng, mean: f64) -> f64 {
    -mean * (1.0 - g.next_f64()).ln()
}

/// Zipf(1) over `n` ranks: rank i with weight 1 / (i + 1).
fn zipf(g: &mut impl Rng, n: usize) -> usize {
    let total: f64 = (1..=n).map(|i| 1.0 / i as f64).sum();
    let mut x = g.next_f64() * total;
    for i in 0..n {
        x -= 1.0 / (i + 1) as f64;
        if x < 0.0 {
            return i;
        }
    }
    n.saturating_sub(1)
}

/// Fresh block ids (one 512-token block of text each, see `text::messages`).
struct Ids(u32);

impl Ids {
    fn take(&mut self, blocks: usize) -> Vec<u32> {
        let v: Vec<u32> = (0..blocks as u32).map(|k| self.0.wrapping_add(k)).collect();
        self.0 = self.0.wrapping_add(blocks as u32);
        v
    }
}

fn blocks_for(tokens: f64) -> usize {
    ((tokens / MOONCAKE_BLOCK_TOKENS as f64).round() as usize).max(1)
}

const SIGMA: f64 = 0.6;
const SIGMA_SHARED: f64 = 0.3;
/// Shared system prompts of a `SystemPrompt` cell.
pub const SYSTEM_PROMPTS: usize = 8;
/// Documents per pod of a `Documents` cell.
pub const DOCS_PER_POD: usize = 6;
/// Mean turns of a conversation and mean think time between turns (s).
pub const MEAN_TURNS: f64 = 4.0;
pub const THINK_S: f64 = 10.0;

/// The cell's trace: `n` requests arriving at `rate_rps` on average.
pub fn generate(cell: &Cell, rate_rps: f64, n: usize) -> Trace {
    let mut g = SplitMix64::new(cell.seed);
    let (shared, unique, output) = cell.lengths.means();
    let gap_ms = 1000.0 / rate_rps.max(1e-6);
    let mut ids = Ids(1);
    let mut requests = Vec::with_capacity(n);
    let out_tokens = |g: &mut SplitMix64| lognormal(g, output, SIGMA).min(8192.0) as u32;
    match cell.reuse {
        Reuse::None | Reuse::SystemPrompt | Reuse::Documents => {
            let prefixes: Vec<Vec<u32>> = match cell.reuse {
                Reuse::SystemPrompt => (0..SYSTEM_PROMPTS)
                    .map(|_| ids.take(blocks_for(lognormal(&mut g, shared, SIGMA_SHARED))))
                    .collect(),
                Reuse::Documents => (0..DOCS_PER_POD * cell.pods)
                    .map(|_| ids.take(blocks_for(lognormal(&mut g, shared, SIGMA_SHARED))))
                    .collect(),
                _ => vec![],
            };
            let mut t = 0.0;
            for _ in 0..n {
                t += exp(&mut g, gap_ms);
                let q = lognormal(&mut g, unique, SIGMA);
                let (content, prompt) = if prefixes.is_empty() {
                    let p = lognormal(&mut g, shared, SIGMA_SHARED) + q;
                    (Content::Unique, p)
                } else {
                    let p = &prefixes[zipf(&mut g, prefixes.len())];
                    (Content::Blocks(p.clone()), (p.len() * MOONCAKE_BLOCK_TOKENS) as f64 + q)
                };
                requests.push(Request {
                    arrival_ms: t,
                    prompt_tokens: (prompt as u32).clamp(1, MAX_PROMPT_TOKENS),
                    output_tokens: out_tokens(&mut g),
                    content,
                    adapter: None,
                    tier: Tier::Standard,
                });
            }
        }
        Reuse::MultiTurn => {
            // Conversations start as a Poisson process at rate / MEAN_TURNS; each has a
            // geometric number of turns (mean MEAN_TURNS); a turn's prompt is the whole
            // conversation so far plus the new user message, all in whole blocks, so that the
            // next turn's prompt starts with this one's.
            struct Conv {
                next_ms: f64,
                history: Vec<u32>,
                left: u32,
            }
            let mut convs: Vec<Conv> = Vec::new();
            let mut next_start = exp(&mut g, gap_ms * MEAN_TURNS);
            let p_end = 1.0 / MEAN_TURNS;
            while requests.len() < n {
                // The earliest pending turn, or a new conversation.
                let next_turn = convs
                    .iter()
                    .enumerate()
                    .min_by(|a, b| a.1.next_ms.total_cmp(&b.1.next_ms))
                    .map(|(i, c)| (i, c.next_ms));
                let i = match next_turn {
                    Some((i, t)) if t <= next_start => i,
                    _ => {
                        let mut turns = 1;
                        while g.next_f64() >= p_end && turns < 16 {
                            turns += 1;
                        }
                        // The first message carries the conversation's starting context.
                        let first = lognormal(&mut g, shared, SIGMA);
                        convs.push(Conv {
                            next_ms: next_start,
                            history: ids.take(blocks_for(first)),
                            left: turns,
                        });
                        next_start += exp(&mut g, gap_ms * MEAN_TURNS);
                        convs.len() - 1
                    }
                };
                let c = &mut convs[i];
                let user = ids.take(blocks_for(lognormal(&mut g, unique, SIGMA)));
                c.history.extend(user);
                let out = out_tokens(&mut g);
                let prompt = (c.history.len() * MOONCAKE_BLOCK_TOKENS) as u32;
                requests.push(Request {
                    arrival_ms: c.next_ms,
                    prompt_tokens: prompt.min(MAX_PROMPT_TOKENS),
                    output_tokens: out,
                    content: Content::Blocks(c.history.clone()),
                    adapter: None,
                    tier: Tier::Standard,
                });
                c.left -= 1;
                let answer = ids.take(blocks_for(f64::from(out)));
                c.history.extend(answer);
                let room = (c.history.len() * MOONCAKE_BLOCK_TOKENS) as u32 + unique as u32;
                if c.left == 0 || room > MAX_PROMPT_TOKENS {
                    convs.swap_remove(i);
                } else {
                    c.next_ms += exp(&mut g, THINK_S * 1000.0);
                }
            }
            requests.sort_by(|a, b| a.arrival_ms.total_cmp(&b.arrival_ms));
        }
    }
    let mut t = Trace { name: cell.key(), requests, tokens_per_hash: 16, shared_shape: None, adapters: 0 };
    match cell.burst {
        Burst::Poisson => {}
        Burst::OnOff => arrivals::on_off(&mut t, 2000.0, 4000.0, cell.seed ^ 0x0f0f),
        Burst::Batches => arrivals::group(&mut t, 500.0),
    }
    if cell.lora {
        trace::assign_adapters(&mut t, LORA_ADAPTERS, LORA_BASE_SHARE, cell.seed ^ 0x1a1a);
    }
    t
}

/// Requests of a pilot trace (for the capacity estimate) and the bounds of a cell's trace.
pub const PILOT_REQUESTS: usize = 2000;
pub const SECONDS_AT_CAPACITY: f64 = 300.0;
pub const MIN_REQUESTS: usize = 2000;
pub const MAX_REQUESTS: usize = 8000;

/// Probe steps of the knee search and its bounds (see the module doc).
pub const PROBE_STEP: f64 = 1.4;
pub const PROBE_MAX_LOAD: f64 = 12.0;
pub const PROBE_LIGHT_LOAD: f64 = 0.3;

/// The run settings of a knee probe of `policy` at `load` (the grid runs themselves go through
/// `suite::execute`, with `Common`'s overrides).
pub fn run_config(cell: &Cell, policy: Policy, load: f64, common: &suite::Common) -> RunConfig {
    RunConfig {
        servers: cell.pods,
        server: cell.server(),
        replicas: 1,
        workers: 1,
        poll_ms: common.refresh_ms(policy),
        metrics_delay_ms: common.metrics_delay_ms,
        load,
        seed: cell.seed,
        ours_overrides: None,
        peer_sync_ms: None,
        no_feed: common.no_feed,
        pod_mix: cell.pod_mix(),
        slo: None,
    }
}

/// The knee of `trace` on the cell's pool (see the module doc): the first probe load at which
/// least-request's TTFT p90 passes 2 × its light-load p90 + 0.5 s.
pub fn knee(cell: &Cell, trace: &Trace, common: &suite::Common) -> Result<f64, String> {
    let p90 = |load: f64| -> Result<f64, String> {
        let r = run(trace, Policy::LeastRequest, &run_config(cell, Policy::LeastRequest, load, common))?;
        Ok(r.ttft_p90_strict_s)
    };
    let limit = 2.0 * p90(PROBE_LIGHT_LOAD)? + 0.5;
    let mut load = 1.0;
    while load < PROBE_MAX_LOAD {
        if p90(load)? > limit {
            return Ok(load);
        }
        load *= PROBE_STEP;
    }
    Ok(PROBE_MAX_LOAD)
}

/// The cell's workload: its trace at the pool's estimated capacity and the load sweep around its
/// knee. `scale` < 1 keeps that fraction of the requests (a quick look).
pub fn workload(cell: &Cell, scale: f64, common: &suite::Common) -> Result<Workload, String> {
    let server = cell.server();
    let mix = cell.pod_mix();
    let pilot = generate(cell, 1.0, PILOT_REQUESTS);
    let cap = suite::estimated_capacity_rps_mix(&pilot, cell.pods, &server, &mix).max(0.01);
    let n = ((cap * SECONDS_AT_CAPACITY) as usize).clamp(MIN_REQUESTS, MAX_REQUESTS);
    let n = ((n as f64 * scale.clamp(0.0, 1.0)).ceil() as usize).max(50);
    let trace = generate(cell, cap, n);
    let knee = knee(cell, &trace, common)?;
    let about = format!(
        "{} ({} requests, {} pods{}{}), arriving at the estimated capacity of {cap:.1} requests/s at load 1; knee at load {knee:.2}",
        cell.key(),
        trace.requests.len(),
        cell.pods,
        if cell.hetero { ", half of them at 0.6× speed with half the KV" } else { "" },
        if cell.lora { ", 8 LoRA adapters" } else { "" },
    );
    Ok(Workload {
        key: cell.key(),
        about,
        trace,
        servers: cell.pods,
        server,
        strategies: cell.strategies(),
        loads: LOADS.iter().map(|f| suite::two_digits(f * knee)).collect(),
        topology: (1, 1),
        extras: vec![],
        llm_d_check: false,
        pod_mix: mix,
        slo: None,
    })
}

/// Every run of the grid: each strategy at each load, one seed per cell (its own); with
/// `topology` (replicas, workers) other than 1 × 1, ours again at each load on that topology.
pub fn tasks(cells: &[Cell], workloads: &[Workload], topology: (usize, usize)) -> Vec<Task> {
    let mut v = Vec::new();
    for (wi, (c, w)) in cells.iter().zip(workloads).enumerate() {
        for &load in &w.loads {
            for &policy in &w.strategies {
                v.push(Task { workload: wi, policy, load, replicas: 1, workers: 1, seed: c.seed });
            }
            if topology != (1, 1) {
                let (replicas, workers) = topology;
                v.push(Task { workload: wi, policy: Policy::Ours, load, replicas, workers, seed: c.seed });
            }
        }
    }
    v
}

/// One cell's figures.
#[derive(Debug, Clone, Serialize)]
pub struct CellResult {
    pub key: String,
    pub cell: Cell,
    pub requests: usize,
    pub ref_load: f64,
    pub ours_p90_s: f64,
    pub best: String,
    pub best_p90_s: f64,
    pub vs_best: f64,
    pub vs_gie: f64,
    /// Smallest best ÷ ours over the loads up to the reference, and where.
    pub worst: f64,
    pub worst_load: f64,
    pub ours_hit_rate: f64,
    pub best_hit_rate: f64,
    /// With a topology other than 1 × 1 (`tasks`): ours 1 × 1's TTFT p90 ÷ ours on that
    /// topology at the reference load, and the smallest such ratio over the loads up to it.
    pub topo: Option<Topo>,
}

/// Ours on several workers or replicas against ours on one (`CellResult::topo`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Topo {
    pub replicas: usize,
    pub workers: usize,
    pub p90_s: f64,
    pub vs_1x1: f64,
    pub worst: f64,
    pub worst_load: f64,
}

/// Ours on `rw` against ours on 1 × 1 in `w` up to `load` (`None` when `rw` was not run).
fn topo(w: &WorkloadResult, load: f64, rw: (usize, usize)) -> Option<Topo> {
    let at = |l: f64| -> Option<(f64, f64)> {
        Some((
            w.point("ours", l, (1, 1))?.ttft_p90_strict_s.median,
            w.point("ours", l, rw)?.ttft_p90_strict_s.median,
        ))
    };
    let (one, many) = at(load)?;
    let (mut worst, mut worst_load) = (f64::INFINITY, load);
    for l in w.loads().into_iter().filter(|&l| l <= load) {
        if let Some((a, b)) = at(l) {
            if a / b < worst {
                (worst, worst_load) = (a / b, l);
            }
        }
    }
    Some(Topo { replicas: rw.0, workers: rw.1, p90_s: many, vs_1x1: one / many, worst, worst_load })
}

/// The cell's figures, or why there are none.
pub fn cell_result(cell: &Cell, w: &WorkloadResult, topology: (usize, usize)) -> Result<CellResult, String> {
    let load = reference_load(w)?;
    let p90 = |s: &str, l: f64| w.point(s, l, (1, 1)).map(|p| p.ttft_p90_strict_s.median);
    let ours = w.point("ours", load, (1, 1)).ok_or_else(|| format!("{}: no ours run", w.key))?;
    let best = w.best_baseline(load).ok_or_else(|| format!("{}: no baseline run", w.key))?;
    let o = ours.ttft_p90_strict_s.median;
    let gie = [p90("gie-default", load), p90("gie-default+lora", load)]
        .into_iter()
        .flatten()
        .fold(f64::INFINITY, f64::min);
    let (mut worst, mut worst_load) = (f64::INFINITY, load);
    for l in w.loads().into_iter().filter(|&l| l <= load) {
        let (Some(ol), Some(bl)) = (p90("ours", l), w.best_baseline(l)) else { continue };
        let r = bl.ttft_p90_strict_s.median / ol;
        if r < worst {
            (worst, worst_load) = (r, l);
        }
    }
    let finite = |x: f64, what: &str| {
        if x.is_finite() {
            Ok(x)
        } else {
            Err(format!("{}: {what} is not a number", w.key))
        }
    };
    Ok(CellResult {
        key: w.key.clone(),
        cell: *cell,
        requests: w.requests,
        ref_load: load,
        ours_p90_s: o,
        best: best.strategy.clone(),
        best_p90_s: best.ttft_p90_strict_s.median,
        vs_best: finite(best.ttft_p90_strict_s.median / o, "vs_best")?,
        vs_gie: finite(gie / o, "vs_gie")?,
        worst: finite(worst, "worst")?,
        worst_load,
        ours_hit_rate: ours.hit_rate.median,
        best_hit_rate: best.hit_rate.median,
        topo: if topology == (1, 1) { None } else { topo(w, load, topology) },
    })
}

/// The summary over cells.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    pub cells: usize,
    pub median_vs_best: f64,
    pub p10_vs_best: f64,
    pub worst_vs_best: f64,
    pub median_vs_gie: f64,
}

/// The `q`-quantile of `v` by the nearest rank below (q = 0.5 of an even count: the lower middle).
pub fn quantile(v: &[f64], q: f64) -> f64 {
    let mut s: Vec<f64> = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    s[((s.len() - 1) as f64 * q.clamp(0.0, 1.0)).floor() as usize]
}

pub fn summary(cells: &[CellResult]) -> Summary {
    let vs_best: Vec<f64> = cells.iter().map(|c| c.vs_best).collect();
    let vs_gie: Vec<f64> = cells.iter().map(|c| c.vs_gie).collect();
    Summary {
        cells: cells.len(),
        median_vs_best: quantile(&vs_best, 0.5),
        p10_vs_best: quantile(&vs_best, 0.1),
        worst_vs_best: cells.iter().map(|c| c.worst).fold(f64::INFINITY, f64::min),
        median_vs_gie: quantile(&vs_gie, 0.5),
    }
}

/// `CELL <key> pods=… ref_load=… ours_p90=… best=<name> best_p90=… vs_best=… vs_gie=… worst=…@load hit=…`.
pub fn cell_line(c: &CellResult) -> String {
    let mut line = format!(
        "CELL {} requests={} ref_load={} ours_p90={:.3} best={} best_p90={:.3} vs_best={:.2} vs_gie={:.2} worst={:.2}@{} hit={:.3} best_hit={:.3}",
        c.key,
        c.requests,
        suite::fmt_load(c.ref_load),
        c.ours_p90_s,
        c.best,
        c.best_p90_s,
        c.vs_best,
        c.vs_gie,
        c.worst,
        suite::fmt_load(c.worst_load),
        c.ours_hit_rate,
        c.best_hit_rate,
    );
    if let Some(t) = c.topo {
        let _ = write!(
            line,
            " {}x{}_p90={:.3} {}x{}_vs_1x1={:.2} {}x{}_worst={:.2}@{}",
            t.replicas,
            t.workers,
            t.p90_s,
            t.replicas,
            t.workers,
            t.vs_1x1,
            t.replicas,
            t.workers,
            t.worst,
            suite::fmt_load(t.worst_load)
        );
    }
    line
}

/// `ROBUST_TOPO <r>x<w> cells=… median_vs_1x1=… p10_vs_1x1=… worst_vs_1x1=…` over the cells that
/// ran the topology (`None` when none did).
pub fn topo_line(cells: &[CellResult]) -> Option<String> {
    let t: Vec<Topo> = cells.iter().filter_map(|c| c.topo).collect();
    let first = t.first()?;
    let v: Vec<f64> = t.iter().map(|x| x.vs_1x1).collect();
    Some(format!(
        "ROBUST_TOPO {}x{} cells={} median_vs_1x1={:.2} p10_vs_1x1={:.2} worst_vs_1x1={:.2}",
        first.replicas,
        first.workers,
        t.len(),
        quantile(&v, 0.5),
        quantile(&v, 0.1),
        t.iter().map(|x| x.worst).fold(f64::INFINITY, f64::min)
    ))
}

pub fn summary_line(s: &Summary) -> String {
    format!(
        "ROBUST cells={} median_vs_best={:.2} p10_vs_best={:.2} worst_vs_best={:.2} median_vs_gie={:.2}",
        s.cells, s.median_vs_best, s.p10_vs_best, s.worst_vs_best, s.median_vs_gie
    )
}

/// The report: method, the summary against its goals, the cells where ours loses, every cell.
pub fn markdown(cells: &[CellResult], failed: &[String], s: &Summary, cmd: &str, wall_s: f64) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# Robustness grid\n");
    let _ = writeln!(md, "`{cmd}`, {} cells, {wall_s:.0} s of wall time.\n", cells.len() + failed.len());
    let _ = writeln!(md, "```\n{}\n```\n", summary_line(s));
    if let Some(t) = topo_line(cells) {
        let _ = writeln!(md, "Ours on several workers or replicas against ours on one:\n\n```\n{t}\n```\n");
    }
    let goal = |x: f64, g: f64| if x >= g { "met" } else { "**not met**" };
    let _ = writeln!(md, "| figure | goal | measured | verdict |\n|---|---:|---:|---|");
    let _ =
        writeln!(md, "| worst_vs_best | ≥ 0.95 | {:.2} | {} |", s.worst_vs_best, goal(s.worst_vs_best, 0.95));
    let _ = writeln!(md, "| p10_vs_best | ≥ 1.0 | {:.2} | {} |", s.p10_vs_best, goal(s.p10_vs_best, 1.0));
    let _ = writeln!(
        md,
        "| median_vs_gie | ≥ 1.25 | {:.2} | {} |\n",
        s.median_vs_gie,
        goal(s.median_vs_gie, 1.25)
    );
    let losing: Vec<&CellResult> = cells.iter().filter(|c| c.vs_best < 1.0 || c.worst < 0.95).collect();
    let _ = writeln!(md, "## Cells where ours loses ({})\n", losing.len());
    for c in &losing {
        let _ = writeln!(md, "- `{}`", cell_line(c));
    }
    for f in failed {
        let _ = writeln!(md, "- no figures: {f}");
    }
    let _ = writeln!(
        md,
        "\n## Every cell\n\n| cell | requests | ref load | ours p90 (s) | best | best p90 (s) | vs best | vs GIE | worst (at load) | hit ours / best |\n|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"
    );
    for c in cells {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.3} | {} | {:.3} | {:.2} | {:.2} | {:.2} ({}) | {:.2} / {:.2} |",
            c.key,
            c.requests,
            suite::fmt_load(c.ref_load),
            c.ours_p90_s,
            c.best,
            c.best_p90_s,
            c.vs_best,
            c.vs_gie,
            c.worst,
            suite::fmt_load(c.worst_load),
            c.ours_hit_rate,
            c.best_hit_rate
        );
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_covers_every_level_of_every_axis_with_its_own_seeds() {
        let c = cells(1);
        assert_eq!(c.len(), 36);
        for r in Reuse::ALL {
            for b in Burst::ALL {
                assert_eq!(c.iter().filter(|x| x.reuse == r && x.burst == b).count(), 3);
            }
        }
        for l in Lengths::ALL {
            assert!(c.iter().filter(|x| x.lengths == l).count() >= 10, "{l:?}");
        }
        for p in PODS {
            assert!(c.iter().filter(|x| x.pods == p).count() >= 5, "{p} pods");
        }
        let het = c.iter().filter(|x| x.hetero).count();
        let lora = c.iter().filter(|x| x.lora).count();
        assert!((12..=24).contains(&het), "{het} heterogeneous cells");
        assert!((8..=16).contains(&lora), "{lora} LoRA cells");
        let mut seeds: Vec<u64> = c.iter().map(|x| x.seed).collect();
        seeds.sort_unstable();
        seeds.dedup();
        assert_eq!(seeds.len(), 36, "every cell has its own seed");
        assert_ne!(cells(2)[0].seed, c[0].seed, "another --seed, other seeds");
        let keys: std::collections::HashSet<String> = c.iter().map(Cell::key).collect();
        assert_eq!(keys.len(), 36, "keys are unique");
    }

    fn cell(reuse: Reuse, burst: Burst, lengths: Lengths) -> Cell {
        Cell { reuse, burst, lengths, pods: 8, hetero: false, lora: false, seed: 42 }
    }

    fn shared_leading_blocks(t: &Trace) -> f64 {
        // Share of requests whose first block id appeared in an earlier request.
        let mut seen = std::collections::HashSet::new();
        let mut hits = 0;
        for r in &t.requests {
            if let Content::Blocks(ids) = &r.content {
                if ids.first().is_some_and(|f| !seen.insert(*f)) {
                    hits += 1;
                }
            }
        }
        hits as f64 / t.requests.len() as f64
    }

    #[test]
    fn each_reuse_level_has_the_reuse_it_names() {
        let n = 3000;
        let none = generate(&cell(Reuse::None, Burst::Poisson, Lengths::Chat), 10.0, n);
        assert!(none.requests.iter().all(|r| r.content == Content::Unique));
        let sys = generate(&cell(Reuse::SystemPrompt, Burst::Poisson, Lengths::Chat), 10.0, n);
        let firsts: std::collections::HashSet<u32> = sys
            .requests
            .iter()
            .filter_map(|r| match &r.content {
                Content::Blocks(ids) => ids.first().copied(),
                _ => None,
            })
            .collect();
        assert_eq!(firsts.len(), SYSTEM_PROMPTS, "every system prompt used, no other");
        let docs = generate(&cell(Reuse::Documents, Burst::Poisson, Lengths::LongContext), 10.0, n);
        let share = shared_leading_blocks(&docs);
        assert!(share > 0.9 && share < 1.0, "docs: {share}");
        let mean_prompt = docs.requests.iter().map(|r| f64::from(r.prompt_tokens)).sum::<f64>() / n as f64;
        assert!((9000.0..18_000.0).contains(&mean_prompt), "long context: {mean_prompt}");
        // Multi-turn: a later turn's prompt starts with an earlier turn's whole prompt.
        let mt = generate(&cell(Reuse::MultiTurn, Burst::Poisson, Lengths::Chat), 10.0, n);
        assert_eq!(mt.requests.len(), n);
        assert!(mt.requests.windows(2).all(|w| w[0].arrival_ms <= w[1].arrival_ms));
        let prompts: Vec<&Vec<u32>> = mt
            .requests
            .iter()
            .filter_map(|r| match &r.content {
                Content::Blocks(ids) => Some(ids),
                _ => None,
            })
            .collect();
        let continued = prompts
            .iter()
            .enumerate()
            .filter(|(i, p)| prompts[..*i].iter().any(|q| q.len() < p.len() && p.starts_with(q)))
            .count();
        let share = continued as f64 / n as f64;
        assert!((0.5..0.9).contains(&share), "share of later turns {share}");
        assert!(mt.requests.iter().all(|r| r.prompt_tokens <= MAX_PROMPT_TOKENS));
    }

    #[test]
    fn lengths_and_rate_follow_the_cell() {
        let n = 4000;
        let gen = generate(&cell(Reuse::None, Burst::Poisson, Lengths::LongGeneration), 20.0, n);
        let chat = generate(&cell(Reuse::None, Burst::Poisson, Lengths::Chat), 20.0, n);
        let mean_out =
            |t: &Trace| t.requests.iter().map(|r| f64::from(r.output_tokens)).sum::<f64>() / n as f64;
        assert!((1000.0..1400.0).contains(&mean_out(&gen)), "{}", mean_out(&gen));
        assert!((160.0..240.0).contains(&mean_out(&chat)), "{}", mean_out(&chat));
        // 20 requests/s: 4,000 requests over about 200 s.
        let span = gen.span_s();
        assert!((180.0..220.0).contains(&span), "{span}");
        // The same cell, the same trace; another seed, another.
        let again = generate(&cell(Reuse::None, Burst::Poisson, Lengths::LongGeneration), 20.0, n);
        assert_eq!(gen.requests, again.requests);
        let other = generate(
            &Cell { seed: 43, ..cell(Reuse::None, Burst::Poisson, Lengths::LongGeneration) },
            20.0,
            n,
        );
        assert_ne!(gen.requests, other.requests);
    }

    #[test]
    fn bursts_keep_the_rate_and_batches_sit_on_the_grid() {
        let n = 4000;
        let on = generate(&cell(Reuse::None, Burst::OnOff, Lengths::Chat), 20.0, n);
        // Nothing arrives during the 4 s off periods of each 6 s cycle.
        assert!(on
            .requests
            .iter()
            .all(|r| (r.arrival_ms - on.requests[0].arrival_ms) % 6000.0 < 2000.0 + 1e-6));
        assert!((180.0..220.0).contains(&on.span_s()), "{}", on.span_s());
        let b = generate(&cell(Reuse::None, Burst::Batches, Lengths::Chat), 20.0, n);
        assert!(b.requests.iter().all(|r| r.arrival_ms % 500.0 == 0.0));
        let distinct: std::collections::HashSet<u64> =
            b.requests.iter().map(|r| r.arrival_ms.to_bits()).collect();
        assert!(distinct.len() < n / 5, "batches of about 10: {} distinct times", distinct.len());
    }

    #[test]
    fn lora_and_heterogeneous_cells_configure_the_pool() {
        let c = Cell { lora: true, hetero: true, ..cell(Reuse::None, Burst::Poisson, Lengths::Chat) };
        let t = generate(&c, 10.0, 2000);
        assert_eq!(t.adapters, LORA_ADAPTERS);
        let on_adapter = t.requests.iter().filter(|r| r.adapter.is_some()).count() as f64 / 2000.0;
        assert!((0.6..0.8).contains(&on_adapter), "{on_adapter}");
        assert!(c.strategies().contains(&Policy::GieDefaultLora));
        assert!(c.server().enable_lora);
        assert_eq!(c.pod_mix().len(), 2);
        // The slow half lowers the estimated capacity.
        let uniform = Cell { hetero: false, ..c };
        let cap = |x: &Cell| suite::estimated_capacity_rps_mix(&t, x.pods, &x.server(), &x.pod_mix());
        assert!(cap(&c) < 0.9 * cap(&uniform), "{} vs {}", cap(&c), cap(&uniform));
    }

    #[test]
    fn summary_takes_quantiles_over_cells_and_the_worst_of_any_load() {
        let mk = |vs_best: f64, vs_gie: f64, worst: f64| CellResult {
            key: "k".into(),
            cell: cell(Reuse::None, Burst::Poisson, Lengths::Chat),
            requests: 1,
            ref_load: 1.0,
            ours_p90_s: 1.0,
            best: "b".into(),
            best_p90_s: vs_best,
            vs_best,
            vs_gie,
            worst,
            worst_load: 0.3,
            ours_hit_rate: 0.0,
            best_hit_rate: 0.0,
            topo: None,
        };
        let cells: Vec<CellResult> =
            (0..11).map(|i| mk(1.0 + i as f64 / 10.0, 2.0 - i as f64 / 10.0, 1.0)).collect();
        let mut cells = cells;
        cells[5].worst = 0.9;
        let s = summary(&cells);
        assert_eq!(s.cells, 11);
        assert!((s.median_vs_best - 1.5).abs() < 1e-9);
        assert!((s.p10_vs_best - 1.1).abs() < 1e-9);
        assert!((s.median_vs_gie - 1.5).abs() < 1e-9);
        assert_eq!(s.worst_vs_best, 0.9);
        assert_eq!(
            summary_line(&s),
            "ROBUST cells=11 median_vs_best=1.50 p10_vs_best=1.10 worst_vs_best=0.90 median_vs_gie=1.50"
        );
        assert_eq!(topo_line(&cells), None, "no topology run");
        // With 1 × 4 runs: quantiles of ours 1 × 1 ÷ ours 1 × 4, and the worst at any load.
        for (i, c) in cells.iter_mut().enumerate() {
            let vs = 0.5 + i as f64 / 10.0;
            c.topo = Some(Topo {
                replicas: 1,
                workers: 4,
                p90_s: 1.0 / vs,
                vs_1x1: vs,
                worst: vs,
                worst_load: 1.0,
            });
        }
        if let Some(t) = cells[3].topo.as_mut() {
            t.worst = 0.2;
        }
        assert_eq!(
            topo_line(&cells).as_deref(),
            Some("ROBUST_TOPO 1x4 cells=11 median_vs_1x1=1.00 p10_vs_1x1=0.60 worst_vs_1x1=0.20")
        );
        assert!(
            cell_line(&cells[0]).ends_with("1x4_p90=2.000 1x4_vs_1x1=0.50 1x4_worst=0.50@1"),
            "{}",
            cell_line(&cells[0])
        );
    }
}
