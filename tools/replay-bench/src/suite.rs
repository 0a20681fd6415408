//! The benchmark set (`make bench-routing`), its parallel execution and the report.
//!
//! A [`Workload`] is a trace plus the pool it runs on (servers, server model), the strategies, the
//! load levels and any extra runs (other topologies). [`default_suite`] is the set the report is
//! built from; `--trace FILE` replaces it with one workload built the same way from any
//! Mooncake-JSONL or Azure-CSV file.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use model_server_sim::ServerConfig;

use crate::replay::{run, RunConfig};
use crate::stats::{hit_rate_bound, hit_rate_bound_lru, RunResult};
use crate::strategy::Policy;
use crate::trace::{self, SharedPrefixShape, Trace};

/// The strategies every trace is run with.
pub const CORE: [Policy; 7] = [
    Policy::Ours,
    Policy::OursNoFlow,
    Policy::GieDefault,
    Policy::Sglang,
    Policy::LeastRequest,
    Policy::RoundRobin,
    Policy::Random,
];

/// Settings common to every run of the set.
#[derive(Debug, Clone, PartialEq)]
pub struct Common {
    pub poll_ms: u64,
    pub metrics_delay_ms: u64,
    pub seed: u64,
    /// Replaces `ours`' scheduler section (a proposal under test).
    pub ours_overrides: Option<serde_json::Value>,
}

impl Default for Common {
    fn default() -> Self {
        // 200 ms: our poller's default interval (`poller.interval_ms`). 20 ms: a scrape's round
        // trip plus the wait for the round to complete and the snapshot to be published.
        Common { poll_ms: 200, metrics_delay_ms: 20, seed: 1, ours_overrides: None }
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
                (20 % premium, 50 % standard, 30 % sheddable): the last-but-one column gives the \
                TTFT p90 per tier (labels only, no priority handling on main)."
            .into(),
        trace: mooncake,
        servers: 8,
        server: base.clone(),
        strategies: CORE.to_vec(),
        loads: vec![3.0, 4.0, cap, 5.0, 1.5 * cap],
        topology: (1, 1),
        extras: vec![
            // The unloaded reference of the tier target (load 1 replays a whole hour of virtual
            // time, mostly polls, so only ours runs it).
            Extra { policy: Policy::Ours, load: 1.0, replicas: 1, workers: 1 },
            Extra { policy: Policy::Ours, load: 4.0, replicas: 4, workers: 4 },
            Extra { policy: Policy::Ours, load: 3.0, replicas: 4, workers: 4 },
            Extra { policy: Policy::OursNoFlow, load: 4.0, replicas: 4, workers: 4 },
            Extra { policy: Policy::GieDefault, load: 4.0, replicas: 4, workers: 4 },
            Extra { policy: Policy::Sglang, load: 4.0, replicas: 4, workers: 4 },
        ],
        llm_d_check: false,
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
    });

    let shape = SharedPrefixShape::llm_d();
    let mut sp = trace::shared_prefix("shared-prefix", &shape, 7);
    shrink(&mut sp, scale);
    let mut strategies = CORE.to_vec();
    strategies.insert(2, Policy::Gie111);
    strategies.insert(3, Policy::LoadOnly);
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
        strategies,
        loads: vec![1.0],
        topology: (1, 1),
        extras: vec![],
        llm_d_check: true,
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
        strategies: vec![
            Policy::Ours,
            Policy::OursNoFlow,
            Policy::GieDefault,
            Policy::Gie111,
            Policy::LoadOnly,
            Policy::Random,
        ],
        loads: vec![1.0],
        topology: (1, 1),
        extras: vec![],
        llm_d_check: true,
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
        strategies: vec![
            Policy::Ours,
            Policy::OursNoFlow,
            Policy::GieDefault,
            Policy::GieDefaultLora,
            Policy::Sglang,
            Policy::LeastRequest,
            Policy::RoundRobin,
            Policy::Random,
        ],
        loads: vec![4.0, 8.0],
        topology: (1, 1),
        extras: vec![],
        llm_d_check: false,
    });
    Ok(out)
}

fn shrink(t: &mut Trace, scale: f64) {
    if scale < 1.0 {
        let n = ((t.requests.len() as f64 * scale).ceil() as usize).max(1);
        t.truncate(n);
    }
}

/// A workload for any trace file: the core strategies (or `strategies`), the given loads.
pub fn file_workload(path: &Path, servers: usize, loads: Vec<f64>) -> Result<Workload, String> {
    let t = trace::load(path)?;
    Ok(Workload {
        key: t.name.clone(),
        about: format!(
            "{} ({} requests) from {}, {} servers.",
            t.name,
            t.requests.len(),
            path.display(),
            servers
        ),
        trace: t,
        servers,
        server: ServerConfig::default(),
        strategies: CORE.to_vec(),
        loads,
        topology: (1, 1),
        extras: vec![],
        llm_d_check: false,
    })
}

/// Results of one workload, with its bounds.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WorkloadResult {
    pub key: String,
    pub about: String,
    pub requests: usize,
    pub servers: usize,
    pub hit_rate_bound: f64,
    pub hit_rate_bound_pooled: f64,
    pub runs: Vec<RunResult>,
}

/// (workload index, task index, result).
type Finished = (usize, usize, Result<RunResult, String>);

/// Runs every workload's runs on `jobs` threads; `progress` gets one line per finished run.
pub fn execute(
    workloads: &[Workload],
    common: &Common,
    jobs: usize,
    progress: &(dyn Fn(&RunResult) + Sync),
) -> Result<Vec<WorkloadResult>, String> {
    let tasks: Vec<(usize, Policy, f64, usize, usize)> = workloads
        .iter()
        .enumerate()
        .flat_map(|(wi, w)| w.runs().into_iter().map(move |(p, l, r, k)| (wi, p, l, r, k)))
        .collect();
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Finished>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..jobs.max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(&(wi, p, load, replicas, workers)) = tasks.get(i) else { break };
                let w = &workloads[wi];
                let rc = RunConfig {
                    servers: w.servers,
                    server: w.server.clone(),
                    replicas,
                    workers,
                    poll_ms: common.poll_ms,
                    metrics_delay_ms: common.metrics_delay_ms,
                    load,
                    seed: common.seed,
                    ours_overrides: common.ours_overrides.clone(),
                };
                let r = run(&w.trace, p, &rc);
                if let Ok(r) = &r {
                    progress(r);
                }
                if let Ok(mut v) = results.lock() {
                    v.push((wi, i, r));
                }
            });
        }
    });
    let mut all = results.into_inner().map_err(|_| "a run panicked".to_string())?;
    all.sort_by_key(|(wi, i, _)| (*wi, *i));
    let mut out: Vec<WorkloadResult> = workloads
        .iter()
        .map(|w| WorkloadResult {
            key: w.key.clone(),
            about: w.about.clone(),
            requests: w.trace.requests.len(),
            servers: w.servers,
            hit_rate_bound: hit_rate_bound(&w.trace),
            hit_rate_bound_pooled: hit_rate_bound_lru(
                &w.trace,
                w.servers as u64 * w.server.num_gpu_blocks * u64::from(w.server.block_size),
            ),
            runs: Vec::new(),
        })
        .collect();
    for (wi, _, r) in all {
        let r = r.map_err(|e| format!("{}: {e}", workloads[wi].key))?;
        out[wi].runs.push(r);
    }
    Ok(out)
}

fn find<'a>(runs: &'a [RunResult], strategy: &str, load: f64, rw: (usize, usize)) -> Option<&'a RunResult> {
    runs.iter().find(|r| r.strategy == strategy && r.load == load && (r.replicas, r.workers) == rw)
}

/// The load the SUMMARY compares at: the lowest load where round-robin's TTFT p90 is at least
/// 5 s (the definition), else the highest load run.
pub fn reference_load(w: &WorkloadResult) -> Option<f64> {
    let mut loads: Vec<f64> =
        w.runs.iter().filter(|r| (r.replicas, r.workers) == (1, 1)).map(|r| r.load).collect();
    loads.sort_by(f64::total_cmp);
    loads.dedup();
    loads
        .iter()
        .copied()
        .find(|&l| find(&w.runs, "round-robin", l, (1, 1)).is_some_and(|r| r.ttft_p90_s >= 5.0))
        .or(loads.last().copied())
}

/// `SUMMARY <trace> ttft_p90_vs_round_robin=<x> ttft_p90_vs_gie_default=<y> hit_rate_vs_bound=<z>`.
pub fn summary_line(w: &WorkloadResult) -> String {
    let load = reference_load(w).unwrap_or(1.0);
    let ours = find(&w.runs, "ours", load, (1, 1));
    let ratio = |other: &str| match (ours, find(&w.runs, other, load, (1, 1))) {
        (Some(o), Some(b)) if o.ttft_p90_strict_s.is_finite() && o.ttft_p90_strict_s > 0.0 => {
            format!("{:.2}", b.ttft_p90_strict_s / o.ttft_p90_strict_s)
        }
        _ => "n/a".into(),
    };
    let hit = match ours {
        Some(o) if w.hit_rate_bound > 0.0 => format!("{:.2}", o.hit_rate / w.hit_rate_bound),
        _ => "n/a".into(),
    };
    format!(
        "SUMMARY {} ttft_p90_vs_round_robin={} ttft_p90_vs_gie_default={} hit_rate_vs_bound={} (load {}, 1x1)",
        w.key,
        ratio("round-robin"),
        ratio("gie-default"),
        hit,
        fmt_load(load)
    )
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

/// The markdown table of one workload (also printed).
pub fn table(w: &WorkloadResult) -> String {
    let tiers = w.runs.iter().any(|r| !r.tiers.is_empty());
    let strict = w.runs.iter().any(|r| r.rejected > 0);
    let mut s = String::new();
    let _ = write!(s, "| strategy | load | R×W | TTFT mean | p50 | p90 | p99 |");
    if strict {
        s.push_str(" p90, rejected = ∞ |");
    }
    s.push_str(" E2E p90 | out tok/s | hit rate | bound | pooled bound |");
    if tiers {
        s.push_str(" TTFT p90 premium / standard / sheddable |");
    }
    s.push_str(" rejected |\n|---|---:|---|---:|---:|---:|---:|");
    if strict {
        s.push_str("---:|");
    }
    s.push_str("---:|---:|---:|---:|---:|");
    if tiers {
        s.push_str("---|");
    }
    s.push_str("---:|\n");
    for r in &w.runs {
        let _ = write!(
            s,
            "| {} | {} | {}×{} | {:.2} | {:.2} | {:.2} | {:.2} |",
            r.strategy,
            fmt_load(r.load),
            r.replicas,
            r.workers,
            r.ttft_mean_s,
            r.ttft_p50_s,
            r.ttft_p90_s,
            r.ttft_p99_s,
        );
        if strict {
            let _ = write!(s, " {} |", fmt_secs(r.ttft_p90_strict_s));
        }
        let _ = write!(
            s,
            " {:.1} | {:.0} | {:.1} % | {:.1} % | {:.1} % |",
            r.e2e_p90_s,
            r.output_tokens_per_s,
            100.0 * r.hit_rate,
            100.0 * w.hit_rate_bound,
            100.0 * w.hit_rate_bound_pooled,
        );
        if tiers {
            let t: Vec<String> = r
                .tiers
                .iter()
                .map(|t| {
                    if t.rejected > 0 {
                        format!("{:.2} ({} rej.)", t.ttft_p90_s, t.rejected)
                    } else {
                        format!("{:.2}", t.ttft_p90_s)
                    }
                })
                .collect();
            let _ = write!(s, " {} |", t.join(" / "));
        }
        let rej = if r.rejected == 0 {
            "0".to_string()
        } else {
            let why: Vec<String> = r.rejections.iter().map(|(k, v)| format!("{k} {v}")).collect();
            format!("{} ({})", r.rejected, why.join(", "))
        };
        let _ = writeln!(s, " {rej} |");
    }
    s
}

/// For each load (1 × 1 runs): ours against the best other strategy, by TTFT p90 with rejected
/// requests counted as infinitely late (so that shedding never counts as speed).
pub fn versus_best(w: &WorkloadResult) -> String {
    let mut loads: Vec<f64> =
        w.runs.iter().filter(|r| (r.replicas, r.workers) == (1, 1)).map(|r| r.load).collect();
    loads.sort_by(f64::total_cmp);
    loads.dedup();
    let mut s = String::new();
    for l in loads {
        let Some(ours) = find(&w.runs, "ours", l, (1, 1)) else { continue };
        let best = w
            .runs
            .iter()
            .filter(|r| r.strategy != "ours" && r.load == l && (r.replicas, r.workers) == (1, 1))
            .min_by(|a, b| a.ttft_p90_strict_s.total_cmp(&b.ttft_p90_strict_s));
        if let Some(b) = best {
            let (o, x) = (ours.ttft_p90_strict_s, b.ttft_p90_strict_s);
            let verdict = if o <= x {
                format!("ours best ({:.2}× better)", x / o.max(1e-9))
            } else if o.is_finite() {
                format!("ours {:.2}× worse", o / x.max(1e-9))
            } else {
                format!("ours worse (rejected {} of {})", ours.rejected, ours.requests)
            };
            let _ = writeln!(
                s,
                "- load {}: ours {} s, best other {} {} s → {verdict}",
                fmt_load(l),
                fmt_secs(o),
                b.strategy,
                fmt_secs(x),
            );
        }
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
    let load = w.runs.first().map_or(1.0, |r| r.load);
    let p90 = |s: &str| find(&w.runs, s, load, (1, 1)).map(|r| r.ttft_p90_s);
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
