//! `replay-bench`: runs the routing replay benchmark and writes the report.
//!
//! `cargo run --profile tools -p replay-bench` runs the default set (see `suite::default_suite`) and
//! writes `target/routing-report/{report.md,results.json}`; `--trace FILE` replays any Mooncake
//! JSONL or Azure CSV file (optionally gzipped) instead. See tools/replay-bench/README.md.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

use replay_bench::stats::RunResult;
use replay_bench::strategy::Policy;
use replay_bench::suite::{self, Common, Workload};
use replay_bench::trace;

#[derive(Parser, Debug)]
#[command(
    about = "Replay traces through simulated model servers, routed by the real scheduler core and baselines"
)]
struct Args {
    /// Replay this Mooncake-JSONL or Azure-CSV file (optionally .gz) instead of the default set.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Output directory for report.md and results.json.
    #[arg(long, default_value = "target/routing-report")]
    out: PathBuf,
    /// Directory holding the default set's traces.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Comma-separated strategies (default: each workload's own list).
    #[arg(long, value_delimiter = ',')]
    strategies: Vec<String>,
    /// Comma-separated load factors (arrival-rate multipliers); default: each workload's own
    /// list, or with --trace a sweep chosen from the trace's arrival rate and the pool's
    /// estimated capacity (0.3× to 1.25× of saturation).
    #[arg(long, value_delimiter = ',')]
    loads: Vec<f64>,
    /// Servers, with --trace (default 8).
    #[arg(long, default_value_t = 8)]
    servers: usize,
    /// Gateway replicas × workers of the main runs (default 1 × 1).
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// KV blocks of 16 tokens per server, overriding the workload's.
    #[arg(long)]
    kv_blocks: Option<u64>,
    /// Server speed factor, overriding the workload's.
    #[arg(long)]
    speed: Option<f64>,
    /// Metrics refresh interval of a strategy, `name=ms`, comma-separated (default: as each
    /// project ships it: GIE 50 ms, ours 200 ms), e.g. `--refresh gie-default=200,ours=100`.
    #[arg(long, value_delimiter = ',')]
    refresh: Vec<String>,
    /// Delay between a scrape and the snapshot being visible to workers, ms.
    #[arg(long, default_value_t = 20)]
    metrics_delay_ms: u64,
    /// Replicas of ours exchange their prefix tables' new records every this many ms, as the
    /// module's `peers` section does (default: its default interval, 1000; only runs with more
    /// than one replica exchange anything).
    #[arg(long)]
    peer_sync_ms: Option<u64>,
    /// Replicas of ours share nothing (no `peers` section).
    #[arg(long, conflicts_with = "peer_sync_ms")]
    no_peer_sync: bool,
    /// A study, not what ships: ours' workers share no placement feed (each knows exactly only
    /// the prefixes it placed, the others' from the cross-worker table alone), as before it.
    #[arg(long)]
    no_feed: bool,
    /// A study, off by default: each request arrives up to this many ms after its recorded
    /// time (uniform, then re-sorted; `trace::spread_arrivals`). Mooncake's timestamps are on a
    /// ~3 s grid, so `3000` turns its same-millisecond bursts of ~10 requests into arrivals
    /// spread over each step. Every strategy replays the same spread trace.
    #[arg(long, default_value_t = 0.0)]
    spread_arrivals_ms: f64,
    /// Only these workloads of the default set (comma-separated keys).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Keep this fraction of each default trace (quick looks; the report says so).
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Skip the extra topology runs (scale-out).
    #[arg(long)]
    no_extras: bool,
    /// Parallel runs.
    #[arg(long, default_value_t = 2)]
    jobs: usize,
    /// First seed; each point runs `--seeds` consecutive seeds from it.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seeds per point (median and min–max are reported; at least 3 for a verdict).
    #[arg(long, default_value_t = suite::DEFAULT_SEEDS)]
    seeds: u64,
    /// JSON object replacing the `scheduler` configuration section of ours and its variants,
    /// to measure a proposed default, e.g. '{"weights":{"inflight":3}}'.
    #[arg(long)]
    ours_scheduler: Option<String>,
    /// Run the burst study instead (`replay_bench::bursts`): premium TTFT p90 of
    /// `ours-tiers` at 1.5× overload on Mooncake's tier mix, with plain, grouped and on/off
    /// arrivals, against the same premium requests alone. Reads --scale, --seeds, --jobs,
    /// --strategies (default ours-tiers), --loads (first value; default 6.75) and --out
    /// (writes bursts.md there).
    #[arg(long)]
    bursts: bool,
    /// Run the robustness grid instead (`replay_bench::grid`, `make bench-robust`): 36 synthetic
    /// cells (prefix reuse × burstiness × lengths × pool size × heterogeneous pods × LoRA), ours
    /// and every baseline from light load to just past saturation, one line per cell and a
    /// `ROBUST` summary line. Reads --seed (the cells' seeds derive from it), --jobs, --scale,
    /// --only (cell keys), --ours-config/--ours-scheduler, --replicas/--workers (ours again on
    /// that topology at every load, against ours on 1 × 1: a `ROBUST_TOPO` line) and --out
    /// (writes robust.md and robust.json there).
    #[arg(long, conflicts_with = "bursts")]
    robust: bool,
    /// Run the tiered-SLO study instead (`replay_bench::slo`): per-tier TTFT attainment,
    /// goodput and shed rate of ours-slo, ours-tiers and the modelled llm-d SLO profile on
    /// Mooncake and Azure conversation with the tier mix, from 0.5× to 1.5× the pool's
    /// capacity, then the prediction-error figure of `ours` on the default set. Reads --scale,
    /// --seed, --seeds, --jobs, --strategies, --loads (as multiples of capacity) and --out
    /// (writes slo.md there).
    #[arg(long, conflicts_with_all = ["bursts", "robust"])]
    slo: bool,
    /// With --slo: skip the prediction-error runs.
    #[arg(long)]
    no_prediction: bool,
    /// JSON object of top-level configuration sections replacing those of ours and its variants,
    /// e.g. '{"saturation":{"kv_threshold":1.5}}'.
    #[arg(long)]
    ours_config: Option<String>,
}

fn main() -> ExitCode {
    match real_main() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("replay-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn real_main() -> Result<(), String> {
    let args = Args::parse();
    #[allow(clippy::disallowed_methods)] // the benchmark's own wall time
    let started = std::time::Instant::now();
    let mut overrides = serde_json::Map::new();
    if let Some(j) = &args.ours_config {
        match serde_json::from_str(j).map_err(|e| format!("--ours-config: {e}"))? {
            serde_json::Value::Object(o) => overrides.extend(o),
            _ => return Err("--ours-config: expected a JSON object".into()),
        }
    }
    if let Some(j) = &args.ours_scheduler {
        let v: serde_json::Value = serde_json::from_str(j).map_err(|e| format!("--ours-scheduler: {e}"))?;
        overrides.insert("scheduler".into(), v);
    }
    let ours_overrides = (!overrides.is_empty()).then_some(serde_json::Value::Object(overrides));
    let mut refresh = std::collections::BTreeMap::new();
    for item in &args.refresh {
        let (name, ms) =
            item.split_once('=').ok_or_else(|| format!("--refresh {item:?}: expected name=ms"))?;
        let ms: u64 = ms.parse().map_err(|e| format!("--refresh {item:?}: {e}"))?;
        refresh.insert(Policy::parse(name)?, ms);
    }
    if args.seeds == 0 {
        return Err("--seeds must be at least 1".into());
    }
    let common = Common {
        refresh,
        metrics_delay_ms: args.metrics_delay_ms,
        seeds: (args.seed..args.seed + args.seeds).collect(),
        ours_overrides,
        peer_sync_ms: if args.no_peer_sync {
            None
        } else {
            Some(args.peer_sync_ms.unwrap_or(inference_picker::poll::peers::DEFAULT_INTERVAL_MS))
        },
        no_feed: args.no_feed,
    };
    if args.bursts {
        return bursts_main(&args, &common, started);
    }
    if args.robust {
        return robust_main(&args, &common, started);
    }
    if args.slo {
        return slo_main(&args, &common, started);
    }
    // The default set (or --trace) is read only here: the two studies build their own workloads.
    let mut workloads: Vec<Workload> = match &args.trace {
        Some(path) => {
            vec![suite::file_workload(path, args.servers, args.loads.clone())?]
        }
        None => {
            let data = args.data.clone().unwrap_or_else(suite::data_dir);
            let mut w = suite::default_suite(&data, args.scale)?;
            if !args.only.is_empty() {
                w.retain(|w| args.only.contains(&w.key));
            }
            if !args.loads.is_empty() {
                for x in &mut w {
                    x.loads = args.loads.clone();
                }
            }
            w
        }
    };
    if !args.strategies.is_empty() {
        let ps: Vec<Policy> = args.strategies.iter().map(|s| Policy::parse(s)).collect::<Result<_, _>>()?;
        for w in &mut workloads {
            w.strategies = ps.clone();
            w.extras.retain(|e| ps.contains(&e.policy));
        }
    }
    for w in &mut workloads {
        if args.spread_arrivals_ms > 0.0 {
            trace::spread_arrivals(&mut w.trace, args.spread_arrivals_ms, 0x5bd1_e995);
            w.about.push_str(&format!(
                " Arrivals spread over {} ms after their recorded time (--spread-arrivals-ms; not the default).",
                args.spread_arrivals_ms
            ));
        }
        w.topology = (args.replicas, args.workers);
        if let Some(k) = args.kv_blocks {
            w.server.num_gpu_blocks = k;
        }
        if let Some(s) = args.speed {
            w.server.speed = s;
        }
        if args.no_extras {
            w.extras.clear();
        }
    }
    let tasks = suite::main_tasks(&workloads, &common);
    eprintln!("replay-bench: {} runs on {} threads", tasks.len(), args.jobs);
    let progress = |r: &RunResult| {
        eprintln!(
            "  {:<14} {:<20} load {:<5} seed {} {}x{}  TTFT p90 {:>8.2} s  hit {:>5.1} %  ({:.1} s)",
            r.trace,
            r.strategy,
            suite::fmt_load(r.load),
            r.seed,
            r.replicas,
            r.workers,
            r.ttft_p90_s,
            100.0 * r.hit_rate,
            r.wall_s
        );
    };
    let mut results = suite::empty_results(&workloads);
    suite::execute(&workloads, &mut results, &tasks, &common, args.jobs, &progress)?;
    // Second phase: ours at 1 × 4 and 4 × 4 at each workload's reference load.
    // and the gap-to-the-limit variants there (issue #16).
    let mut scale_out = suite::scale_out_tasks(&results, &workloads, &common);
    let gap = suite::gap_tasks(&results, &workloads, &common);
    eprintln!("replay-bench: {} scale-out runs, {} gap runs", scale_out.len(), gap.len());
    scale_out.extend(gap);
    suite::execute(&workloads, &mut results, &scale_out, &common, args.jobs, &progress)?;
    let wall = started.elapsed().as_secs_f64();
    let cmd: Vec<String> = std::env::args().collect();
    let report =
        replay_bench::report::markdown(&results, &workloads, &common, &cmd.join(" "), wall, args.scale);
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    let md = args.out.join("report.md");
    std::fs::write(&md, &report).map_err(|e| format!("{}: {e}", md.display()))?;
    let json = args.out.join("results.json");
    let body = serde_json::to_string_pretty(&results).map_err(|e| e.to_string())?;
    std::fs::write(&json, body).map_err(|e| format!("{}: {e}", json.display()))?;
    for w in &results {
        println!("\n## {} ({} requests, {} servers)\n", w.key, w.requests, w.servers);
        println!("{}", suite::table(w));
    }
    for w in &results {
        if workloads.iter().any(|x| x.key == w.key && x.llm_d_check) {
            let (ok, why) = suite::llm_d_order_check(w);
            println!("CHECK llm-d-order {}: {why}", if ok { "PASS" } else { "FAIL" });
        }
    }
    println!("\nwrote {} and {} ({wall:.0} s)", md.display(), json.display());
    let mut failed = Vec::new();
    for w in &results {
        match suite::summary_line(w) {
            Ok(line) => println!("{line}"),
            Err(e) => failed.push(e),
        }
    }
    for w in &results {
        if let Some(line) = suite::gap_line(w) {
            println!("{line}");
        }
    }
    for line in replay_bench::slo::prediction_lines(&results) {
        println!("{line}");
    }
    if !failed.is_empty() {
        return Err(format!("no SUMMARY for: {}", failed.join("; ")));
    }
    Ok(())
}

/// `--bursts`: the burst study (see `replay_bench::bursts`).
fn bursts_main(args: &Args, common: &Common, started: std::time::Instant) -> Result<(), String> {
    use replay_bench::bursts;
    let data = args.data.clone().unwrap_or_else(suite::data_dir);
    let load = args.loads.first().copied().unwrap_or_else(bursts::default_load);
    let strategies: Vec<Policy> = if args.strategies.is_empty() {
        vec![Policy::OursTiers]
    } else {
        args.strategies.iter().map(|s| Policy::parse(s)).collect::<Result<_, _>>()?
    };
    let workloads = bursts::workloads(&data, args.scale, load, &strategies)?;
    let tasks = suite::main_tasks(&workloads, common);
    eprintln!("replay-bench --bursts: {} runs on {} threads", tasks.len(), args.jobs);
    let progress = |r: &RunResult| {
        let p = r.tiers.iter().find(|t| t.tier == "premium").map_or(f64::NAN, |t| t.ttft_p90_s);
        eprintln!(
            "  {:<24} {:<12} seed {}  premium TTFT p90 {:>7.2} s  ({:.1} s)",
            r.trace, r.strategy, r.seed, p, r.wall_s
        );
    };
    let mut results = suite::empty_results(&workloads);
    suite::execute(&workloads, &mut results, &tasks, common, args.jobs, &progress)?;
    let rows = bursts::rows(&results, &strategies);
    let cmd: Vec<String> = std::env::args().collect();
    let md = bursts::section(&rows, load, args.scale, common.seeds.len(), &cmd.join(" "));
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    let path = args.out.join("bursts.md");
    std::fs::write(&path, &md).map_err(|e| format!("{}: {e}", path.display()))?;
    println!("{md}");
    println!("wrote {} ({:.0} s)", path.display(), started.elapsed().as_secs_f64());
    let verdicts = bursts::verdicts(&rows);
    if verdicts.is_empty() {
        return Err("no ours-tiers rows with bursts: pass ours-tiers in --strategies".into());
    }
    Ok(())
}

/// `--robust`: the robustness grid (see `replay_bench::grid`).
fn robust_main(args: &Args, common: &Common, started: std::time::Instant) -> Result<(), String> {
    use replay_bench::grid;
    let mut cells = grid::cells(args.seed);
    if !args.only.is_empty() {
        cells.retain(|c| args.only.contains(&c.key()));
        if cells.is_empty() {
            return Err(format!("--only {:?} names no cell of the grid", args.only));
        }
    }
    // Each cell's trace and knee (its probe runs), one cell per job at a time.
    let next = std::sync::atomic::AtomicUsize::new(0);
    let built: std::sync::Mutex<Vec<(usize, Result<Workload, String>)>> = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..args.jobs.max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let Some(c) = cells.get(i) else { break };
                let w = grid::workload(c, args.scale, common);
                if let Ok(w) = &w {
                    eprintln!("  {:<36} {} requests, loads {:?}", w.key, w.trace.requests.len(), w.loads);
                }
                if let Ok(mut v) = built.lock() {
                    v.push((i, w));
                }
            });
        }
    });
    let mut built = built.into_inner().map_err(|_| "a cell's probe panicked".to_string())?;
    built.sort_by_key(|(i, _)| *i);
    let workloads: Vec<Workload> = built.into_iter().map(|(_, w)| w).collect::<Result<_, _>>()?;
    let topology = (args.replicas, args.workers);
    let tasks = grid::tasks(&cells, &workloads, topology);
    eprintln!("replay-bench --robust: {} cells, {} runs on {} threads", cells.len(), tasks.len(), args.jobs);
    let progress = |r: &RunResult| {
        eprintln!(
            "  {:<36} {:<17} load {:<4} TTFT p90 {:>8.2} s  hit {:>5.1} %  ({:.1} s)",
            r.trace,
            r.strategy,
            suite::fmt_load(r.load),
            r.ttft_p90_s,
            100.0 * r.hit_rate,
            r.wall_s
        );
    };
    let mut results = suite::empty_results(&workloads);
    suite::execute(&workloads, &mut results, &tasks, common, args.jobs, &progress)?;
    let mut rows = Vec::new();
    let mut failed = Vec::new();
    for (c, w) in cells.iter().zip(&results) {
        match grid::cell_result(c, w, topology) {
            Ok(r) => rows.push(r),
            Err(e) => failed.push(e),
        }
    }
    let s = grid::summary(&rows);
    let wall = started.elapsed().as_secs_f64();
    let cmd: Vec<String> = std::env::args().collect();
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    let md = args.out.join("robust.md");
    std::fs::write(&md, grid::markdown(&rows, &failed, &s, &cmd.join(" "), wall))
        .map_err(|e| format!("{}: {e}", md.display()))?;
    let json = args.out.join("robust.json");
    let body = serde_json::json!({ "summary": s, "cells": rows, "failed": failed, "results": results });
    std::fs::write(&json, serde_json::to_string_pretty(&body).map_err(|e| e.to_string())?)
        .map_err(|e| format!("{}: {e}", json.display()))?;
    for r in &rows {
        println!("{}", grid::cell_line(r));
    }
    println!("wrote {} and {} ({wall:.0} s)", md.display(), json.display());
    println!("{}", grid::summary_line(&s));
    if let Some(t) = grid::topo_line(&rows) {
        println!("{t}");
    }
    if !failed.is_empty() {
        return Err(format!("cells without figures: {}", failed.join("; ")));
    }
    Ok(())
}

/// `--slo`: the tiered-SLO study (see `replay_bench::slo`).
fn slo_main(args: &Args, common: &Common, started: std::time::Instant) -> Result<(), String> {
    use replay_bench::slo;
    let data = args.data.clone().unwrap_or_else(suite::data_dir);
    let mut strategies: Vec<Policy> = if args.strategies.is_empty() {
        slo::STRATEGIES.to_vec()
    } else {
        args.strategies.iter().map(|s| Policy::parse(s)).collect::<Result<_, _>>()?
    };
    let mut notes = Vec::new();
    if let Err(e) = slo::core_available() {
        if strategies.contains(&Policy::OursSlo) {
            strategies.retain(|p| *p != Policy::OursSlo);
            let n = format!(
                "ours-slo needs the SLO core in the crate (priority.tier.slo), which this build lacks: {e}; \
                 the verdict lines judge ours-tiers instead"
            );
            eprintln!("replay-bench --slo: {n}");
            notes.push(n);
        }
    }
    let mut bases = slo::bases(&data, args.scale)?;
    if !args.loads.is_empty() {
        notes.push(format!("loads given on the command line, as multiples of capacity: {:?}", args.loads));
    }
    // The probe: unloaded TTFT of each trace, one seed.
    let probes: Vec<Workload> = bases.iter().map(slo::probe_workload).collect();
    let probe_common = Common { seeds: vec![args.seed], ..common.clone() };
    let tasks = suite::main_tasks(&probes, &probe_common);
    let mut probe_results = suite::empty_results(&probes);
    let quiet = |_: &RunResult| {};
    suite::execute(&probes, &mut probe_results, &tasks, &probe_common, args.jobs, &quiet)?;
    let mut targets = Vec::new();
    let mut workloads = Vec::new();
    for (b, r) in bases.iter_mut().zip(&probe_results) {
        let p99 = r.runs.first().map(|x| x.ttft_p99_s).ok_or_else(|| format!("{}: no probe run", b.key))?;
        let t = slo::SloTargets::from_unloaded(p99);
        eprintln!(
            "  {:<16} unloaded TTFT p99 {p99:.2} s: targets premium {} ms, standard {} ms, free {} ms",
            b.key, t.premium_ms, t.standard_ms, t.sheddable_ms
        );
        targets.push((b.key.to_string(), p99, t));
        let mut w = slo::workload(b, t, &strategies);
        if !args.loads.is_empty() {
            w.loads = args.loads.iter().map(|f| slo::load_of(*f, b.capacity)).collect();
        }
        workloads.push(w);
    }
    let tasks = suite::main_tasks(&workloads, common);
    eprintln!("replay-bench --slo: {} runs on {} threads", tasks.len(), args.jobs);
    let progress = |r: &RunResult| {
        eprintln!(
            "  {:<16} {:<11} load {:<6} seed {}  TTFT p90 {:>7.2} s  rejected {:>5}  ({:.1} s)",
            r.trace,
            r.strategy,
            suite::fmt_load(r.load),
            r.seed,
            r.ttft_p90_s,
            r.rejected,
            r.wall_s
        );
    };
    let mut results = suite::empty_results(&workloads);
    suite::execute(&workloads, &mut results, &tasks, common, args.jobs, &progress)?;
    let judged = if strategies.contains(&Policy::OursSlo) { Policy::OursSlo } else { Policy::OursTiers };
    let mut rows = Vec::new();
    let mut verdicts = Vec::new();
    for ((w, r), b) in workloads.iter().zip(&results).zip(&bases) {
        let rs = slo::rows(w, r, b.capacity);
        verdicts.extend(slo::verdicts(w, r, &rs, judged));
        rows.extend(rs);
    }
    let mut predictions = Vec::new();
    if !args.no_prediction {
        let pw = slo::prediction_workloads(&data, args.scale)?;
        let tasks = suite::main_tasks(&pw, common);
        eprintln!("replay-bench --slo: {} prediction runs", tasks.len());
        let mut pr = suite::empty_results(&pw);
        suite::execute(&pw, &mut pr, &tasks, common, args.jobs, &quiet)?;
        predictions = slo::prediction_lines(&pr);
    }
    let cmd: Vec<String> = std::env::args().collect();
    let md = slo::section(
        &rows,
        &verdicts,
        &targets,
        &predictions,
        &notes,
        &cmd.join(" "),
        args.scale,
        common.seeds.len(),
    );
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    let path = args.out.join("slo.md");
    std::fs::write(&path, &md).map_err(|e| format!("{}: {e}", path.display()))?;
    println!("{md}");
    for l in slo::tier_lines(&rows) {
        println!("{l}");
    }
    for v in &verdicts {
        println!("{}", slo::verdict_line(v));
    }
    for p in &predictions {
        println!("{p}");
    }
    println!("wrote {} ({:.0} s)", path.display(), started.elapsed().as_secs_f64());
    Ok(())
}
