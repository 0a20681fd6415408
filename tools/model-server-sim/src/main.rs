//! `model-server-sim`: a simulated vLLM-compatible model server (see the crate README).
//!
//! Prints `READY <port>` on stdout once it is listening; stops on SIGTERM or SIGINT.

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use model_server_sim::http::{self, AppState, ShellConfig};
use model_server_sim::{Engine, ServerConfig, StepCost};

/// Simulated vLLM/SGLang/trtllm-serve model server for tests and benchmarks.
#[derive(Debug, Parser)]
#[command(name = "model-server-sim", version)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on; 0 picks a free port (printed in the READY line).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Name reported in the x-sim-server header and the served_by field. Default: host:port.
    #[arg(long, env = "SIM_NAME")]
    name: Option<String>,
    /// A served base model name (repeatable). Default: sim-model.
    #[arg(long = "model")]
    models: Vec<String>,
    /// A served LoRA adapter, NAME or NAME=PATH as vLLM's --lora-modules (repeatable).
    /// Giving any enables LoRA.
    #[arg(long = "lora")]
    loras: Vec<String>,
    /// LoRA adapters loaded at once (vLLM --max-loras).
    #[arg(long, default_value_t = 1)]
    max_lora: u32,
    /// Metric names on /metrics.
    #[arg(long, default_value = "vllm", value_parser = ["vllm", "sglang", "trtllm"])]
    engine: String,
    /// Speed factor: every engine step takes cost / speed (larger = faster).
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// Largest number of running requests (vLLM --max-num-seqs).
    #[arg(long, default_value_t = 256)]
    max_batch: u32,
    /// Token budget per step; longer prompts are prefilled in chunks (--max-num-batched-tokens).
    #[arg(long, default_value_t = 8192)]
    max_batched_tokens: u32,
    /// KV-cache blocks on the simulated GPU.
    #[arg(long, default_value_t = 25_000)]
    num_gpu_blocks: u64,
    /// Tokens per KV block (and per prefix-cache hash).
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// Output tokens when a request sets neither max_tokens nor max_completion_tokens.
    #[arg(long, default_value_t = 16)]
    default_max_tokens: u32,
    /// Largest prompt + output in tokens; longer requests get 400.
    #[arg(long, default_value_t = 131_072)]
    max_model_len: u32,
    /// Replace the calibrated step-time model by a fixed time per engine step (one token per
    /// running request per step), for predictable tests.
    #[arg(long)]
    delay_per_token_ms: Option<f64>,
    /// Role in a disaggregated prefill/decode pool: `decode` honours `x-prefiller-host-port`
    /// like llm-d's routing sidecar (remote prefill with max_tokens 1, then local decode with the
    /// prompt cached); `prefill` ignores it; `both` (default) honours it too.
    #[arg(long, default_value = "both", value_parser = ["prefill", "decode", "both"])]
    role: String,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("model-server-sim: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), String> {
    let engine: Engine = args.engine.parse()?;
    if let Some(ms) = args.delay_per_token_ms {
        if !(ms.is_finite() && ms > 0.0) {
            return Err(format!("--delay-per-token-ms must be > 0, got {ms}"));
        }
    }
    let loras: Vec<String> =
        args.loras.iter().map(|l| l.split_once('=').map_or(l.as_str(), |(n, _)| n).to_string()).collect();
    let models = if args.models.is_empty() { vec!["sim-model".to_string()] } else { args.models.clone() };
    let model_cfg = ServerConfig {
        max_batch: args.max_batch,
        max_batched_tokens: args.max_batched_tokens,
        block_size: args.block_size,
        num_gpu_blocks: args.num_gpu_blocks,
        tokens_per_hash: None,
        enable_lora: !loras.is_empty(),
        max_lora: args.max_lora,
        cost: args.delay_per_token_ms.map_or(StepCost::LLAMA3_8B_H100, StepCost::fixed),
        speed: args.speed,
        token_events: true,
    };
    model_cfg.validate().map_err(|e| format!("invalid flags: {e}"))?;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .map_err(|e| format!("cannot listen on {}:{}: {e}", args.host, args.port))?;
        let port = listener.local_addr().map_err(|e| e.to_string())?.port();
        let name = args.name.clone().unwrap_or_else(|| format!("{}:{port}", args.host));
        let shell = ShellConfig {
            name,
            models,
            loras,
            engine,
            default_max_tokens: args.default_max_tokens.max(1),
            max_model_len: args.max_model_len,
            role: args.role.parse()?,
        };
        let state = AppState::new(shell, model_cfg)?;
        tokio::spawn(http::engine_loop(state.clone()));
        let app = http::router(state);

        let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
        let app = app.into_make_service_with_connect_info::<http::ConnHandle>();
        let server = axum::serve(listener, app).with_graceful_shutdown(async move {
            shutdown_signal().await;
            let _ = stop_tx.send(true);
        });
        println!("READY {port}");
        let _ = std::io::stdout().flush();
        // Graceful shutdown waits for open streams; give them 5 s, then stop anyway.
        let deadline = async {
            let _ = stop_rx.changed().await;
            tokio::time::sleep(Duration::from_secs(5)).await;
        };
        tokio::select! {
            r = server => r.map_err(|e| format!("server error: {e}")),
            _ = deadline => {
                eprintln!("model-server-sim: open connections did not finish within 5 s; exiting");
                Ok(())
            }
        }
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
