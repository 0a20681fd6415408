//! `pd-replay`: the prefill/decode replay (see `replay_bench::pd`). The same GPUs aggregated or
//! split into prefill and decode pods, on the Mooncake conversation trace (or `--trace FILE`),
//! one line per pool, load and seed, then the medians over the seeds as a Markdown table.
//!
//! ```sh
//! nice -n 10 cargo run --profile tools -p replay-bench --bin pd-replay -- --scale 0.25 --seeds 3
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

use model_server_sim::ServerConfig;
use replay_bench::pd::{self, PdResult, PdRun};
use replay_bench::suite::data_dir;
use replay_bench::trace;

#[derive(Parser, Debug)]
#[command(about = "P/D replay: aggregated vs prefill/decode pools, routed by the module's pure core")]
struct Args {
    /// A Mooncake-JSONL or Azure-CSV trace; default the Mooncake conversation trace.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Keep only this fraction of the trace's requests (from the start).
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Comma-separated arrival-rate multipliers.
    #[arg(long, value_delimiter = ',', default_values_t = [3.0, 4.0, 4.5])]
    loads: Vec<f64>,
    #[arg(long, default_value_t = 3)]
    seeds: u64,
    /// GPUs (servers) in every pool.
    #[arg(long, default_value_t = 8)]
    servers: usize,
    /// Comma-separated prefill-pod counts: one P/D pool per count and threshold.
    #[arg(long, value_delimiter = ',', default_values_t = [2])]
    prefill: Vec<usize>,
    /// `pd.pd_threshold_tokens` of each P/D pool (0 is llm-d's default: always split).
    #[arg(long, value_delimiter = ',', default_values_t = [0, 2048])]
    thresholds: Vec<u64>,
    /// `pd.decode_prefix_factor`.
    #[arg(long, default_value_t = 0.5)]
    decode_prefix_factor: f64,
    /// `pd.prefill_busy_factor` (0, the module's default: llm-d's rule alone).
    #[arg(long, default_value_t = 0.0)]
    prefill_busy_factor: f64,
    /// KV transfer bandwidth, GB/s.
    #[arg(long, default_value_t = 25.0)]
    kv_gbps: f64,
    /// Count split requests in flight on their prefill pod until the decode pod's first token,
    /// as the module does (see `PdRun::prefill_inflight`); `false` to measure without it.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    prefill_inflight: bool,
    /// KV bytes per token (Llama-3-8B fp16: 131072).
    #[arg(long, default_value_t = 131_072.0)]
    kv_bytes_per_token: f64,
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pd-replay: {e}");
            ExitCode::FAILURE
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn run(args: Args) -> Result<(), String> {
    let path = args.trace.clone().unwrap_or_else(|| data_dir().join("mooncake_conversation_trace.jsonl.gz"));
    let mut t = trace::load(&path)?;
    if args.scale < 1.0 {
        let n = ((t.requests.len() as f64 * args.scale).ceil() as usize).max(1);
        t.truncate(n);
    }
    let mut pools: Vec<(String, usize, u64)> = vec![(format!("aggregated {}", args.servers), 0, 0)];
    for &p in &args.prefill {
        for &th in &args.thresholds {
            let who = if th == 0 { " (llm-d default)" } else { "" };
            let decode = args.servers.saturating_sub(p);
            pools.push((format!("P/D {p}+{decode} threshold {th}{who}"), p, th));
        }
    }
    println!(
        "trace {} ({} requests), {} servers, seeds {}",
        t.name,
        t.requests.len(),
        args.servers,
        args.seeds
    );
    println!("| load | pool | TTFT p50 s | TTFT p90 s | TPOT p50 ms | TPOT p90 ms | split % | computed prompt share | rejected |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for &load in &args.loads {
        for (name, prefill, threshold) in &pools {
            let mut runs: Vec<PdResult> = Vec::new();
            for seed in 1..=args.seeds {
                let r = PdRun {
                    servers: args.servers,
                    prefill: *prefill,
                    threshold: *threshold,
                    decode_prefix_factor: args.decode_prefix_factor,
                    prefill_busy_factor: args.prefill_busy_factor,
                    server: ServerConfig::default(),
                    poll_ms: 200,
                    load,
                    seed,
                    kv_bytes_per_token: args.kv_bytes_per_token,
                    kv_gbps: args.kv_gbps,
                    prefill_inflight: args.prefill_inflight,
                };
                let res = pd::run(&t, &r)?;
                eprintln!(
                    "load {load} {name} seed {seed}: {}",
                    serde_json::to_string(&res).unwrap_or_default()
                );
                runs.push(res);
            }
            let m = |f: fn(&PdResult) -> f64| median(runs.iter().map(f).collect());
            println!(
                "| {load} | {name} | {:.2} | {:.2} | {:.1} | {:.1} | {:.0} | {:.2} | {:.0} |",
                m(|r| r.ttft_p50_ms) / 1000.0,
                m(|r| r.ttft_p90_ms) / 1000.0,
                m(|r| r.tpot_p50_ms),
                m(|r| r.tpot_p90_ms),
                m(|r| r.split_pct),
                m(|r| r.computed_share),
                m(|r| r.rejected as f64),
            );
        }
    }
    Ok(())
}
