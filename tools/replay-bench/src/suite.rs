//! The benchmark set (`make bench-routing`), its parallel execution and the report.
//!
//! A [`Workload`] is a trace plus the pool it runs on (servers, server model), the strategies, the
//! load levels and any extra runs (other topologies). [`default_suite`] is the set the report is
//! built from; `--trace FILE` replaces it with one workload built the same way from any
//! Mooncake-JSONL or Azure-CSV file.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use model_server_sim::{ServerConfig, StepCost};
use serde::Serialize;

use crate::replay::{run, server_config, PodClass, RunConfig};
use crate::slo_policy::SloTargets;
use crate::stats::{hit_rate_bound, hit_rate_bound_lru, hit_rate_bound_opt, RunResult};
use crate::strategy::Policy;
use crate::trace::{self, SharedPrefixShape, Trace};

/// The strategies every trace is run with: ours (shipped default) and its flow-control variant,
/// every shipped baseline, Dynamo both ways and the perfect-information picker.
pub const CORE: [Policy; 10] = [
    Policy::Ours,
    Policy::OursFlow,
    Policy::GieDefault,
    Policy::Sglang,
    Policy::LeastRequest,
    Policy::RoundRobin,
    Policy::Random,
    Policy::Dynamo,
    Policy::DynamoNoEvents,
    Policy::Oracle,
];

/// Seeds per point (the minimum).
pub const DEFAULT_SEEDS: u64 = 3;

/// A best baseline whose TTFT p90 is at or above this is saturated (the reference load is the
/// highest load below it).
pub const SATURATED_P90_S: f64 = 5.0;

/// Settings common to every run of the set.
#[derive(Debug, Clone, PartialEq)]
pub struct Common {
    /// Metrics refresh interval per strategy, ms, overriding `Policy::default_refresh_ms`.
    pub refresh: BTreeMap<Policy, u64>,
    pub metrics_delay_ms: u64,
    /// Seeds of every point (each run's seed; the report gives median and min–max).
    pub seeds: Vec<u64>,
    /// Replaces `ours`' configuration sections (a proposal under test).
    pub ours_overrides: Option<serde_json::Value>,
    /// `RunConfig::peer_sync_ms` of every run: by default `peers.interval_ms`'s default, as
    /// the README deploys several replicas; `None` with `--no-peer-sync`.
    pub peer_sync_ms: Option<u64>,
    /// `RunConfig::no_feed` of every run.
    pub no_feed: bool,
}

impl Default for Common {
    fn default() -> Self {
        // 20 ms: a scrape's round trip plus the wait for the round to complete and the snapshot
        // to be published.
        Common {
            refresh: BTreeMap::new(),
            metrics_delay_ms: 20,
            seeds: (1..=DEFAULT_SEEDS).collect(),
            ours_overrides: None,
            peer_sync_ms: Some(inference_picker::poll::peers::DEFAULT_INTERVAL_MS),
            no_feed: false,
        }
    }
}

impl Common {
    /// The refresh interval `p` runs with.
    pub fn refresh_ms(&self, p: Policy) -> u64 {
        self.refresh.get(&p).copied().unwrap_or_else(|| p.default_refresh_ms())
    }
}

/// One extra run: a strategy at a load with a topology other than 1 × 1.
#[derive(Debug, Clone, PartialEq)]
pub struct Extra {
    pub policy: Policy,
    pub load: f64,
    pub replicas: usize,
    pub workers: usize,
}

#[derive(Debug, Clone)]
pub struct Workload {
    /// Short name used in the report and the SUMMARY line.
    pub key: String,
    /// One-paragraph description for the report.
    pub about: String,
    pub trace: Trace,
    pub servers: usize,
    pub server: ServerConfig,
    pub strategies: Vec<Policy>,
    pub loads: Vec<f64>,
    /// (replicas, workers) of the main runs.
    pub topology: (usize, usize),
    pub extras: Vec<Extra>,
    /// Check llm-d's published order (random and load-only far worse than prefix-aware).
    pub llm_d_check: bool,
    /// Heterogeneous pods (`RunConfig::pod_mix`); empty for a uniform pool.
    pub pod_mix: Vec<PodClass>,
    /// The tiers' latency targets (`RunConfig::slo`); `None` outside the SLO study.
    pub slo: Option<SloTargets>,
}

impl Workload {
    fn runs(&self) -> Vec<(Policy, f64, usize, usize)> {
        let mut v = Vec::new();
        for &l in &self.loads {
            for &p in &self.strategies {
                v.push((p, l, self.topology.0, self.topology.1));
            }
        }
        for e in &self.extras {
            v.push((e.policy, e.load, e.replicas, e.workers));
        }
        v
    }
}

/// Where the repository's trace copies live (`benches/data`, found from this crate's manifest).
pub fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/data")
}

/// Mooncake's sustainable load on the default 8-server pool, measured with this benchmark: at
/// 4.5× every strategy's TTFT p90 is at or past the knee and at 5× all are overloaded (see the
/// report). The tier target's "1.5× overload" is 1.5 × this.
pub const MOONCAKE_CAPACITY_LOAD: f64 = 4.5;

/// The llm-d shape's pool: llm-d's 307,328 KV tokens per pod (19,208 blocks of 16) with the
/// default step model (speed 1: the prefix-aware throughput then lands near the published one)
/// and, in `shared-prefix-slow`, at half speed. Its pods were Qwen3-32B on 2 GPUs, which we do
/// not model.
pub const LLM_D_KV_BLOCKS: u64 = 19_208;

/// The default set. `scale` < 1 keeps only that fraction of each trace's requests (for quick
/// looks; the report says so).
pub fn default_suite(data: &Path, scale: f64) -> Result<Vec<Workload>, String> {
    let mut out = Vec::new();
    let base = ServerConfig::default();

    let mut mooncake = trace::load(&data.join("mooncake_conversation_trace.jsonl.gz"))?;
    mooncake.name = "mooncake".into();
    trace::assign_tiers(&mut mooncake, 0.2, 0.5, 11);
    shrink(&mut mooncake, scale);
    let cap = MOONCAKE_CAPACITY_LOAD;
    out.push(Workload {
        key: "mooncake".into(),
        about: "Mooncake conversation trace (12,031 requests, 1 h, ~12k-token prompts with shared \
                512-token blocks), 8 servers. Every request also carries an SLA tier label \
                (20 % premium, 50 % standard, 30 % sheddable), read only by `ours+flow` and \
                `ours-tiers` (the shipped default trusts no tier header)."
            .into(),
        trace: mooncake,
        servers: 8,
        server: base.clone(),
        strategies: with_tiers(),
        loads: vec![3.0, 4.0, cap, 1.5 * cap],
        topology: (1, 1),
        extras: vec![],
        llm_d_check: false,
        pod_mix: vec![],
        slo: None,
    });

    let mut azure = trace::load(&data.join("azure_llm_inference_2023_conv.csv.gz"))?;
    azure.name = "azure-conv".into();
    shrink(&mut azure, scale);
    out.push(Workload {
        key: "azure-conv".into(),
        about: "Azure LLM inference 2023, conversation (19,366 requests, 1 h, lengths only: every \
                prompt is unique text, so this is pure load balancing), 4 servers."
            .into(),
        trace: azure.clone(),
        servers: 4,
        server: base.clone(),
        strategies: CORE.to_vec(),
        loads: vec![12.0, 16.0, 20.0],
        topology: (1, 1),
        extras: vec![],
        llm_d_check: false,
        pod_mix: vec![],
        slo: None,
    });

    let shape = SharedPrefixShape::llm_d();
    let mut sp = trace::shared_prefix("shared-prefix", &shape, 7);
    shrink(&mut sp, scale);
    let mut strategies = CORE.to_vec();
    strategies.insert(3, Policy::Gie111);
    strategies.insert(4, Policy::LoadOnly);
    let about = |speed: f64| {
        format!(
            "Synthetic shared-prefix workload in the shape of llm-d's published run: {} groups × {} \
             users, system prompt {} tokens, question {} tokens, {} output tokens (see \
             `SharedPrefixShape::llm_d` for why not 1,000), Poisson arrivals ramping from 3/s to \
             60/s after a 15/s warm-up ({} requests). 8 servers with llm-d's KV size ({} tokens \
             each) and the default step model at speed {speed}.",
            shape.groups,
            shape.users,
            shape.system_tokens,
            shape.question_tokens,
            shape.output_tokens,
            sp.requests.len(),
            LLM_D_KV_BLOCKS * 16,
        )
    };
    out.push(Workload {
        key: "shared-prefix".into(),
        about: about(1.0),
        trace: sp.clone(),
        servers: 8,
        server: ServerConfig { num_gpu_blocks: LLM_D_KV_BLOCKS, ..base.clone() },
        strategies: strategies.clone(),
        loads: vec![1.0],
        topology: (1, 1),
        extras: vec![],
        llm_d_check: true,
        pod_mix: vec![],
        slo: None,
    });
    out.push(Workload {
        key: "shared-prefix-slow".into(),
        about: format!(
            "{} Pods at half speed: less headroom at the top of the ladder, as llm-d's 32B pods had.",
            about(0.5)
        ),
        trace: sp,
        servers: 8,
        server: ServerConfig { num_gpu_blocks: LLM_D_KV_BLOCKS, speed: 0.5, ..base.clone() },
        strategies: strategies.clone(),
        loads: vec![1.0],
        topology: (1, 1),
        extras: vec![],
        llm_d_check: true,
        pod_mix: vec![],
        slo: None,
    });

    let mut lora = azure;
    lora.name = "lora-mix".into();
    trace::assign_adapters(&mut lora, 16, 0.2, 13);
    out.push(Workload {
        key: "lora-mix".into(),
        about: "Multi-LoRA mix: the Azure conversation trace with 80 % of requests naming one of \
                16 adapters (Zipf popularity), 4 servers with 4 LoRA slots each."
            .into(),
        trace: lora,
        servers: 4,
        server: ServerConfig { max_lora: 4, enable_lora: true, ..base },
        strategies: {
            let mut v = CORE.to_vec();
            v.insert(3, Policy::GieDefaultLora);
            v
        },
        loads: vec![4.0, 8.0],
        topology: (1, 1),
        extras: vec![],
        llm_d_check: false,
        pod_mix: vec![],
        slo: None,
    });
    Ok(out)
}

/// CORE plus the tier example (for traces with tier labels).
fn with_tiers() -> Vec<Policy> {
    let mut v = CORE.to_vec();
    v.insert(2, Policy::OursTiers);
    v
}

fn shrink(t: &mut Trace, scale: f64) {
    if scale < 1.0 {
        let n = ((t.requests.len() as f64 * scale).ceil() as usize).max(1);
        t.truncate(n);
    }
}

/// The pool's estimated capacity, in requests per second, for `trace`'s mix: each request costs
/// a server its prefill (`b` per uncached prompt token, with the pooled-LRU hit rate as the cached
/// share, plus `a` per 8,192-token chunk) and its decode (per output token, `a` shared by the
/// batch and `c` per context token), the batch being as many requests as the KV cache holds (at
/// most `max_batch`). A first-order estimate: it places the sweep, it does not replace it.
pub fn estimated_capacity_rps(trace: &Trace, servers: usize, server: &ServerConfig) -> f64 {
    estimated_capacity_rps_mix(trace, servers, server, &[])
}

/// [`estimated_capacity_rps`] for a pool of `servers` pods of `server` scaled by `mix`
/// (`RunConfig::pod_mix`): the sum of each pod's own estimate, with the hit rate of one LRU cache
/// the size of the whole pool's KV.
pub fn estimated_capacity_rps_mix(
    trace: &Trace,
    servers: usize,
    server: &ServerConfig,
    mix: &[PodClass],
) -> f64 {
    let n = trace.requests.len().max(1) as f64;
    let prompt = trace.requests.iter().map(|r| f64::from(r.prompt_tokens)).sum::<f64>() / n;
    let output = trace.requests.iter().map(|r| f64::from(r.output_tokens)).sum::<f64>() / n;
    let hit = hit_rate_bound_lru(trace, pool_kv_tokens(servers, server, mix));
    (0..servers)
        .map(|i| {
            let s = server_config(server, mix, i);
            let kv_tokens = (s.num_gpu_blocks * u64::from(s.block_size)) as f64;
            let StepCost { a_ms, b_ms_per_prefill_token: b, c_ms_per_context_token: c } = s.cost;
            let batch = (kv_tokens / (prompt + output / 2.0).max(1.0)).clamp(1.0, f64::from(s.max_batch));
            let chunks = (prompt / f64::from(s.max_batched_tokens.max(1))).ceil();
            let prefill_ms = b * prompt * (1.0 - hit) + a_ms * chunks;
            let decode_ms = output * (a_ms / batch + c * (prompt + output / 2.0));
            let per_request_ms = (prefill_ms + decode_ms) / s.speed.max(1e-9);
            1000.0 / per_request_ms.max(1e-9)
        })
        .sum()
}

/// KV tokens of the whole pool: `servers` pods of `server` scaled by `mix`.
pub fn pool_kv_tokens(servers: usize, server: &ServerConfig, mix: &[PodClass]) -> u64 {
    (0..servers)
        .map(|i| {
            let s = server_config(server, mix, i);
            s.num_gpu_blocks * u64::from(s.block_size)
        })
        .sum()
}

/// The load sweep for a trace: from light load to past saturation, as multiples of the load at
/// which the trace's arrival rate reaches the pool's estimated capacity (0.3, 0.6, 0.8, 1.0 and
/// 1.25 of it), two significant digits.
pub fn auto_loads(trace: &Trace, servers: usize, server: &ServerConfig) -> Vec<f64> {
    let rate = trace.requests.len() as f64 / trace.span_s().max(1e-3);
    let sat = estimated_capacity_rps(trace, servers, server) / rate.max(1e-9);
    let mut v: Vec<f64> = [0.3, 0.6, 0.8, 1.0, 1.25].iter().map(|f| two_digits(f * sat)).collect();
    v.dedup();
    v
}

/// `x` to two significant digits (1.0 for a value that is not a positive number).
pub fn two_digits(x: f64) -> f64 {
    if !(x.is_finite() && x > 0.0) {
        return 1.0;
    }
    // Through the decimal text, so that 1.4 × 1.0 is 1.4 and not 1.4000000000000001.
    format!("{x:.1e}").parse().unwrap_or(x)
}

/// A workload for any trace file: the core strategies (plus the tier example when the trace has
/// tier labels), `loads` or else [`auto_loads`].
pub fn file_workload(path: &Path, servers: usize, loads: Vec<f64>) -> Result<Workload, String> {
    let t = trace::load(path)?;
    let server = ServerConfig::default();
    let (loads, how) = if loads.is_empty() {
        let cap = estimated_capacity_rps(&t, servers, &server);
        (
            auto_loads(&t, servers, &server),
            format!(
                "loads chosen from the trace's arrival rate ({:.2} requests/s) and the pool's \
                 estimated capacity ({cap:.1} requests/s)",
                t.requests.len() as f64 / t.span_s().max(1e-3)
            ),
        )
    } else {
        (loads, "loads given on the command line".to_string())
    };
    Ok(Workload {
        key: t.name.clone(),
        about: format!(
            "{} ({} requests) from {}, {} servers; {how}.",
            t.name,
            t.requests.len(),
            path.display(),
            servers
        ),
        strategies: if t.has_tiers() { with_tiers() } else { CORE.to_vec() },
        trace: t,
        servers,
        server,
        loads,
        topology: (1, 1),
        extras: vec![],
        llm_d_check: false,
        pod_mix: vec![],
        slo: None,
    })
}

/// Median and range of one measure over a point's seeds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Range {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Range {
    /// Median (the lower middle value for an even count), min and max; infinities allowed.
    pub fn of(values: &[f64]) -> Range {
        let mut v: Vec<f64> = values.to_vec();
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            return Range { median: f64::NAN, min: f64::NAN, max: f64::NAN };
        }
        Range { median: v[(v.len() - 1) / 2], min: v[0], max: v[v.len() - 1] }
    }

    /// Whether the two ranges share a value.
    pub fn overlaps(&self, o: &Range) -> bool {
        self.min <= o.max && o.min <= self.max
    }
}

/// One (strategy, load, topology) point over its seeds.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    pub strategy: String,
    pub load: f64,
    pub replicas: usize,
    pub workers: usize,
    pub seeds: usize,
    pub ttft_p50_s: Range,
    pub ttft_p90_s: Range,
    pub ttft_p99_s: Range,
    /// TTFT p90 with rejected requests counted as infinitely late (∞ when > 10 % rejected).
    pub ttft_p90_strict_s: Range,
    pub rejected_pct: Range,
    pub goodput_rps: Range,
    pub hit_rate: Range,
    pub e2e_p90_s: Range,
    /// Median TTFT p90 per tier label (premium, standard, sheddable), when the trace has them.
    pub tier_p90_s: Vec<(String, f64, usize)>,
}

impl Point {
    fn of(runs: &[&RunResult]) -> Option<Point> {
        let r0 = runs.first()?;
        let f = |g: &dyn Fn(&RunResult) -> f64| Range::of(&runs.iter().map(|r| g(r)).collect::<Vec<_>>());
        let tier_p90_s = r0
            .tiers
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let p = Range::of(
                    &runs.iter().filter_map(|r| r.tiers.get(i).map(|t| t.ttft_p90_s)).collect::<Vec<_>>(),
                );
                let rej: usize = runs.iter().filter_map(|r| r.tiers.get(i).map(|t| t.rejected)).sum();
                (t.tier.clone(), p.median, rej / runs.len())
            })
            .collect();
        Some(Point {
            strategy: r0.strategy.clone(),
            load: r0.load,
            replicas: r0.replicas,
            workers: r0.workers,
            seeds: runs.len(),
            ttft_p50_s: f(&|r| r.ttft_p50_s),
            ttft_p90_s: f(&|r| r.ttft_p90_s),
            ttft_p99_s: f(&|r| r.ttft_p99_s),
            ttft_p90_strict_s: f(&|r| r.ttft_p90_strict_s),
            rejected_pct: f(&|r| 100.0 * r.rejected as f64 / r.requests.max(1) as f64),
            goodput_rps: f(&|r| r.goodput_rps),
            hit_rate: f(&|r| r.hit_rate),
            e2e_p90_s: f(&|r| r.e2e_p90_s),
            tier_p90_s,
        })
    }
}

/// Results of one workload, with its bounds.
#[derive(Debug, Clone, Serialize)]
pub struct WorkloadResult {
    pub key: String,
    pub about: String,
    pub requests: usize,
    pub servers: usize,
    /// One server with an unlimited cache.
    pub hit_rate_bound: f64,
    /// One LRU cache the size of the pool's KV.
    pub hit_rate_bound_pooled: f64,
    /// One cache the size of the pool's KV with Belady eviction.
    pub hit_rate_bound_pooled_opt: f64,
    /// Every run (each seed).
    pub runs: Vec<RunResult>,
    /// Runs grouped by (strategy, load, topology), in run order.
    pub points: Vec<Point>,
}

impl WorkloadResult {
    fn regroup(&mut self) {
        let mut keys: Vec<(String, u64, usize, usize)> = Vec::new();
        for r in &self.runs {
            let k = (r.strategy.clone(), r.load.to_bits(), r.replicas, r.workers);
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
        self.points = keys
            .iter()
            .filter_map(|(s, l, rr, w)| {
                let rs: Vec<&RunResult> = self
                    .runs
                    .iter()
                    .filter(|r| {
                        &r.strategy == s && r.load.to_bits() == *l && r.replicas == *rr && r.workers == *w
                    })
                    .collect();
                Point::of(&rs)
            })
            .collect();
    }

    pub fn point(&self, strategy: &str, load: f64, rw: (usize, usize)) -> Option<&Point> {
        self.points.iter().find(|p| p.strategy == strategy && p.load == load && (p.replicas, p.workers) == rw)
    }

    /// Loads of the 1 × 1 runs, ascending.
    pub fn loads(&self) -> Vec<f64> {
        let mut loads: Vec<f64> =
            self.points.iter().filter(|p| (p.replicas, p.workers) == (1, 1)).map(|p| p.load).collect();
        loads.sort_by(f64::total_cmp);
        loads.dedup();
        loads
    }

    /// The baseline with the lowest median strict TTFT p90 at `load` (1 × 1).
    pub fn best_baseline(&self, load: f64) -> Option<&Point> {
        self.points
            .iter()
            .filter(|p| p.load == load && (p.replicas, p.workers) == (1, 1))
            .filter(|p| Policy::parse(&p.strategy).is_ok_and(Policy::is_baseline))
            .min_by(|a, b| a.ttft_p90_strict_s.median.total_cmp(&b.ttft_p90_strict_s.median))
    }
}

/// One run to do.
#[derive(Debug, Clone, Copy)]
pub struct Task {
    pub workload: usize,
    pub policy: Policy,
    pub load: f64,
    pub replicas: usize,
    pub workers: usize,
    pub seed: u64,
}

/// Every seed of every main and extra run of the workloads.
pub fn main_tasks(workloads: &[Workload], common: &Common) -> Vec<Task> {
    let mut v = Vec::new();
    for (wi, w) in workloads.iter().enumerate() {
        for (p, l, r, k) in w.runs() {
            for &seed in &common.seeds {
                v.push(Task { workload: wi, policy: p, load: l, replicas: r, workers: k, seed });
            }
        }
    }
    v
}

/// The scale-out topologies of `ours` at each reference load: one Envoy with 4 workers (Envoy
/// runs a worker per core, so this is how a single gateway ships) and 4 replicas × 4 workers.
pub const SCALE_OUT: [(usize, usize); 2] = [(1, 4), (4, 4)];

/// `ours` at each [`SCALE_OUT`] topology at each workload's reference load (the SUMMARY's 1×4
/// and 4×4 figures), for workloads that ran ours.
pub fn scale_out_tasks(results: &[WorkloadResult], workloads: &[Workload], common: &Common) -> Vec<Task> {
    let mut v = Vec::new();
    for (wi, (r, w)) in results.iter().zip(workloads).enumerate() {
        if !w.strategies.contains(&Policy::Ours) {
            continue;
        }
        let Ok(load) = reference_load(r) else { continue };
        for (replicas, workers) in SCALE_OUT {
            if r.point("ours", load, (replicas, workers)).is_some() {
                continue;
            }
            for &seed in &common.seeds {
                v.push(Task { workload: wi, policy: Policy::Ours, load, replicas, workers, seed });
            }
        }
    }
    v
}

/// The gap to the limit (issue #16): each variant turns one piece of the oracle's perfect
/// information off (see `crate::oracle`), from ours to the limit.
pub const GAP: [Policy; 3] = [Policy::OursPerfectState, Policy::OracleApproxPrefix, Policy::OracleStale];

/// The gap variants at each workload's reference load, 1 × 1, every seed, for workloads that ran
/// both ours and the oracle.
pub fn gap_tasks(results: &[WorkloadResult], workloads: &[Workload], common: &Common) -> Vec<Task> {
    let mut v = Vec::new();
    for (wi, (r, w)) in results.iter().zip(workloads).enumerate() {
        if !(w.strategies.contains(&Policy::Ours) && w.strategies.contains(&Policy::Oracle)) {
            continue;
        }
        let Ok(load) = reference_load(r) else { continue };
        for p in GAP {
            if r.point(p.name(), load, (1, 1)).is_some() {
                continue;
            }
            for &seed in &common.seeds {
                v.push(Task { workload: wi, policy: p, load, replicas: 1, workers: 1, seed });
            }
        }
    }
    v
}

/// One gap row: strategy, TTFT p90 with rejections as ∞ (median and range over seeds), and
/// oracle ÷ that median.
pub type GapRow = (&'static str, Range, f64);

/// The gap rows of a workload at its reference load, from ours to the oracle; None when a row is
/// missing.
pub fn gap_rows(w: &WorkloadResult) -> Option<(f64, Vec<GapRow>)> {
    let load = reference_load(w).ok()?;
    let names = ["ours", "ours-perfect-state", "oracle-approx-prefix", "oracle-stale", "oracle"];
    let oracle = w.point("oracle", load, (1, 1))?.ttft_p90_strict_s.median;
    let mut rows = Vec::new();
    for n in names {
        let r = w.point(n, load, (1, 1))?.ttft_p90_strict_s;
        rows.push((n, r, oracle / r.median));
    }
    Some((load, rows))
}

/// `GAP <trace> ref_load=<L> ours=<s> ours_perfect_state=<s> oracle_approx_prefix=<s>
/// oracle_stale=<s> oracle=<s>`: TTFT p90 medians (rejected = ∞), or None without the rows.
pub fn gap_line(w: &WorkloadResult) -> Option<String> {
    let (load, rows) = gap_rows(w)?;
    let mut s = format!("GAP {} ref_load={}", w.key, fmt_load(load));
    for (n, r, _) in rows {
        let _ = write!(s, " {}={}", n.replace('-', "_"), fmt_secs(r.median));
    }
    Some(s)
}

/// The workloads' results before any run (bounds computed).
pub fn empty_results(workloads: &[Workload]) -> Vec<WorkloadResult> {
    workloads
        .iter()
        .map(|w| {
            let pool_tokens = pool_kv_tokens(w.servers, &w.server, &w.pod_mix);
            WorkloadResult {
                key: w.key.clone(),
                about: w.about.clone(),
                requests: w.trace.requests.len(),
                servers: w.servers,
                hit_rate_bound: hit_rate_bound(&w.trace),
                hit_rate_bound_pooled: hit_rate_bound_lru(&w.trace, pool_tokens),
                hit_rate_bound_pooled_opt: hit_rate_bound_opt(&w.trace, pool_tokens),
                runs: Vec::new(),
                points: Vec::new(),
            }
        })
        .collect()
}

/// Runs `tasks` on `jobs` threads into `results`; `progress` gets one line per finished run.
pub fn execute(
    workloads: &[Workload],
    results: &mut [WorkloadResult],
    tasks: &[Task],
    common: &Common,
    jobs: usize,
    progress: &(dyn Fn(&RunResult) + Sync),
) -> Result<(), String> {
    let next = AtomicUsize::new(0);
    let done: Mutex<Vec<(usize, Result<RunResult, String>)>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..jobs.max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(t) = tasks.get(i) else { break };
                let w = &workloads[t.workload];
                let rc = RunConfig {
                    servers: w.servers,
                    server: w.server.clone(),
                    replicas: t.replicas,
                    workers: t.workers,
                    poll_ms: common.refresh_ms(t.policy),
                    metrics_delay_ms: common.metrics_delay_ms,
                    load: t.load,
                    seed: t.seed,
                    ours_overrides: common.ours_overrides.clone(),
                    peer_sync_ms: common.peer_sync_ms,
                    no_feed: common.no_feed,
                    pod_mix: w.pod_mix.clone(),
                    slo: w.slo,
                };
                let r = run(&w.trace, t.policy, &rc);
                if let Ok(r) = &r {
                    progress(r);
                }
                if let Ok(mut v) = done.lock() {
                    v.push((i, r));
                }
            });
        }
    });
    let mut all = done.into_inner().map_err(|_| "a run panicked".to_string())?;
    all.sort_by_key(|(i, _)| *i);
    for (i, r) in all {
        let wi = tasks[i].workload;
        let r = r.map_err(|e| format!("{}: {e}", workloads[wi].key))?;
        results[wi].runs.push(r);
    }
    for r in results.iter_mut() {
        r.regroup();
    }
    Ok(())
}

/// The load the SUMMARY compares at: the highest load of the sweep at which the best baseline's
/// TTFT p90 (median over seeds, rejected = ∞) is still under 5 s. An error if there is none.
pub fn reference_load(w: &WorkloadResult) -> Result<f64, String> {
    w.loads()
        .into_iter()
        .rfind(|&l| w.best_baseline(l).is_some_and(|b| b.ttft_p90_strict_s.median < SATURATED_P90_S))
        .ok_or_else(|| format!("{}: no load of the sweep has a baseline with TTFT p90 under 5 s", w.key))
}

/// The SUMMARY's values, by name, in order.
pub type SummaryValues = Vec<(&'static str, f64)>;

/// The reference load and every value of the SUMMARY line.
pub fn summary_values(w: &WorkloadResult) -> Result<(f64, SummaryValues), String> {
    let load = reference_load(w)?;
    let need = |s: &str, l: f64, rw: (usize, usize)| {
        w.point(s, l, rw)
            .ok_or_else(|| format!("{}: no {s} run at load {} {}x{}", w.key, fmt_load(l), rw.0, rw.1))
    };
    let ours = need("ours", load, (1, 1))?;
    let o = ours.ttft_p90_strict_s.median;
    let ratio = |b: f64, what: &str| -> Result<f64, String> {
        let x = b / o;
        if x.is_finite() {
            Ok(x)
        } else {
            Err(format!("{}: {what} ratio is not a number ({} / {})", w.key, fmt_secs(b), fmt_secs(o)))
        }
    };
    let best = w.best_baseline(load).ok_or_else(|| format!("{}: no baseline at load {load}", w.key))?;
    let mut worst = f64::INFINITY;
    for l in w.loads().into_iter().filter(|&l| l <= load) {
        let (Some(ol), Some(bl)) = (w.point("ours", l, (1, 1)), w.best_baseline(l)) else { continue };
        worst = worst.min(bl.ttft_p90_strict_s.median / ol.ttft_p90_strict_s.median);
    }
    if !worst.is_finite() {
        return Err(format!("{}: worst_vs_best_baseline is not a number", w.key));
    }
    let four = need("ours", load, (4, 4))?;
    let one_envoy = need("ours", load, (1, 4))?;
    let hit = ours.hit_rate.median;
    let vals = vec![
        (
            "ttft_p90_vs_round_robin",
            ratio(need("round-robin", load, (1, 1))?.ttft_p90_strict_s.median, "round-robin")?,
        ),
        (
            "ttft_p90_vs_gie_default",
            ratio(need("gie-default", load, (1, 1))?.ttft_p90_strict_s.median, "gie-default")?,
        ),
        ("ttft_p90_vs_best_baseline", ratio(best.ttft_p90_strict_s.median, "best baseline")?),
        ("worst_vs_best_baseline", worst),
        ("hit_rate_vs_pooled_lru", hit / w.hit_rate_bound_pooled.max(1e-12)),
        ("hit_rate_vs_pooled_opt", hit / w.hit_rate_bound_pooled_opt.max(1e-12)),
        ("rejected_pct", ours.rejected_pct.median),
        ("replicas_4x4_vs_1x1", o / four.ttft_p90_strict_s.median),
        ("hit_rate_4x4_vs_1x1", four.hit_rate.median / hit.max(1e-12)),
        ("workers_1x4_vs_1x1", o / one_envoy.ttft_p90_strict_s.median),
        ("ttft_p90_vs_dynamo", ratio(need("dynamo", load, (1, 1))?.ttft_p90_strict_s.median, "dynamo")?),
        ("ttft_p90_vs_oracle", ratio(need("oracle", load, (1, 1))?.ttft_p90_strict_s.median, "oracle")?),
    ];
    for (k, v) in &vals {
        if !v.is_finite() {
            return Err(format!("{}: {k} is not a number", w.key));
        }
    }
    Ok((load, vals))
}

/// `SUMMARY <trace> ref_load=<L> ttft_p90_vs_round_robin=<x> … seeds=<n>` (issue #11 + #16), or
/// an error naming what is missing (the benchmark then fails; it never prints `n/a`).
pub fn summary_line(w: &WorkloadResult) -> Result<String, String> {
    let seeds = w.points.iter().map(|p| p.seeds).min().unwrap_or(0);
    let (load, vals) = summary_values(w)?;
    let mut s = format!("SUMMARY {} ref_load={}", w.key, fmt_load(load));
    for (k, v) in vals {
        let _ = write!(s, " {k}={v:.2}");
    }
    let _ = write!(s, " seeds={seeds}");
    Ok(s)
}

/// Seconds with 2 decimals, `∞` for infinity.
pub fn fmt_secs(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.2}")
    } else {
        "∞".into()
    }
}

pub fn fmt_load(l: f64) -> String {
    if (l - l.round()).abs() < 1e-9 {
        format!("{l:.0}")
    } else {
        format!("{l}")
    }
}

/// `median [min–max]` in seconds (just the median when all seeds agree to 2 decimals).
fn fmt_range(r: &Range, unit: &dyn Fn(f64) -> String) -> String {
    let (a, b, c) = (unit(r.median), unit(r.min), unit(r.max));
    if b == c {
        a
    } else {
        format!("{a} [{b}–{c}]")
    }
}

/// The markdown table of one workload (also printed): per strategy and load, median over the
/// seeds with [min–max].
pub fn table(w: &WorkloadResult) -> String {
    let tiers = w.points.iter().any(|p| !p.tier_p90_s.is_empty());
    let mut s = String::new();
    s.push_str(
        "| strategy | load | R×W | TTFT p50 (s) | p90 (s) | p99 (s) | p90, rejected = ∞ (s) | rejected % | goodput (req/s) | hit rate % | vs pooled LRU / OPT |",
    );
    if tiers {
        s.push_str(" TTFT p90 premium / standard / sheddable |");
    }
    s.push_str("\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    if tiers {
        s.push_str("---|");
    }
    s.push('\n');
    let secs = |x: f64| fmt_secs(x);
    let pct = |x: f64| format!("{x:.1}");
    let rps = |x: f64| format!("{x:.2}");
    let hit = |x: f64| format!("{:.1}", 100.0 * x);
    for p in &w.points {
        let _ = write!(
            s,
            "| {} | {} | {}×{} | {} | {} | {} | {} | {} | {} | {} | {:.2} / {:.2} |",
            p.strategy,
            fmt_load(p.load),
            p.replicas,
            p.workers,
            fmt_range(&p.ttft_p50_s, &secs),
            fmt_range(&p.ttft_p90_s, &secs),
            fmt_range(&p.ttft_p99_s, &secs),
            fmt_range(&p.ttft_p90_strict_s, &secs),
            fmt_range(&p.rejected_pct, &pct),
            fmt_range(&p.goodput_rps, &rps),
            fmt_range(&p.hit_rate, &hit),
            p.hit_rate.median / w.hit_rate_bound_pooled.max(1e-12),
            p.hit_rate.median / w.hit_rate_bound_pooled_opt.max(1e-12),
        );
        if tiers {
            let t: Vec<String> = p
                .tier_p90_s
                .iter()
                .map(|(_, x, rej)| if *rej > 0 { format!("{x:.2} ({rej} rej.)") } else { format!("{x:.2}") })
                .collect();
            let _ = write!(s, " {} |", t.join(" / "));
        }
        s.push('\n');
    }
    s
}

/// For each load (1 × 1): ours against the best baseline, by TTFT p90 with rejected requests
/// counted as infinitely late, median and range over the seeds; "tie" when the ranges overlap.
pub fn versus_best(w: &WorkloadResult) -> String {
    let mut s = String::new();
    for l in w.loads() {
        let (Some(ours), Some(b)) = (w.point("ours", l, (1, 1)), w.best_baseline(l)) else { continue };
        let (o, x) = (&ours.ttft_p90_strict_s, &b.ttft_p90_strict_s);
        let verdict = if o.overlaps(x) {
            "tie (ranges overlap)".to_string()
        } else if o.max < x.min {
            format!("ours better ({:.2}×)", x.median / o.median.max(1e-9))
        } else if o.median.is_finite() {
            format!("ours worse ({:.2}×)", o.median / x.median.max(1e-9))
        } else {
            format!("ours worse (rejected {:.1} %)", ours.rejected_pct.median)
        };
        let sat = if x.median >= SATURATED_P90_S { " (saturated)" } else { "" };
        let _ = writeln!(
            s,
            "- load {}{sat}: ours {} s [{}–{}], best baseline {} {} s [{}–{}] → {verdict}",
            fmt_load(l),
            fmt_secs(o.median),
            fmt_secs(o.min),
            fmt_secs(o.max),
            b.strategy,
            fmt_secs(x.median),
            fmt_secs(x.min),
            fmt_secs(x.max),
        );
    }
    s
}

/// llm-d's published TTFT p90 (s) over its whole ladder, 8 pods of Qwen3-32B.
pub const LLM_D_PUBLISHED: [(&str, f64); 4] = [
    ("precise-scheduling", 0.542),
    ("estimated-scheduling", 31.083),
    ("random-scheduling", 92.551),
    ("load-scheduling", 94.865),
];

/// The order check on the shared-prefix workload: random and load-only must both be at least 3×
/// worse (TTFT p90) than the worst of the prefix-aware strategies (ours, gie-default). Returns
/// (passed, explanation).
pub fn llm_d_order_check(w: &WorkloadResult) -> (bool, String) {
    let load = w.loads().first().copied().unwrap_or(1.0);
    let p90 = |s: &str| w.point(s, load, (1, 1)).map(|p| p.ttft_p90_s.median);
    let (Some(ours), Some(gie), Some(random), Some(load_only)) =
        (p90("ours"), p90("gie-default"), p90("random"), p90("load-only"))
    else {
        return (false, "missing runs".into());
    };
    let prefix_aware = ours.max(gie);
    let worst_blind = random.min(load_only);
    let ok = worst_blind >= 3.0 * prefix_aware;
    (
        ok,
        format!(
            "random {random:.2} s and load-only {load_only:.2} s vs prefix-aware ours {ours:.2} s / gie-default {gie:.2} s: \
             blind/aware = {:.1}× (need ≥ 3×)",
            worst_blind / prefix_aware.max(1e-9)
        ),
    )
}
