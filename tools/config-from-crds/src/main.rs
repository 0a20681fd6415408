//! `config-from-crds`: reads InferencePool, InferenceObjective and InferenceModelRewrite YAML
//! (multi-document files, `-` for stdin) and writes this module's configuration JSON, validated.
//!
//!     cargo run -q -p config-from-crds -- --model 'meta-llama/Llama-3.1-8B-Instruct=food-review-1' \
//!         tools/config-from-crds/examples/llama-pool.yaml > picker-config.json
//!
//! The mapping is documented in the library (`src/lib.rs`) and in docs/istio.md.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use config_from_crds::{convert, parse_documents, parse_model_arg, Options};
use inference_picker::poll::config::PollerMode;

#[derive(Clone, Copy, ValueEnum)]
enum Mode {
    Lease,
    Singleton,
}

#[derive(Parser)]
#[command(
    version,
    about = "Write inference-picker's configuration from Gateway API Inference Extension resources"
)]
struct Args {
    /// YAML files with the resources (`-` reads stdin).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// A base model the pool serves, with its LoRA adapters: `NAME` or `NAME=ADAPTER,ADAPTER`.
    /// Repeat for several. Required unless --base has `models`.
    #[arg(long = "model")]
    models: Vec<String>,
    /// The InferencePool to use when the input has several.
    #[arg(long)]
    pool: Option<String>,
    /// Namespace of resources that have no metadata.namespace.
    #[arg(long, default_value = "default")]
    namespace: String,
    /// Who polls: `lease` (no bootstrap change, Istio gateways) or `singleton` (a bootstrap
    /// WasmService).
    #[arg(long, value_enum, default_value = "lease")]
    poller_mode: Mode,
    /// The VM environment variable holding the Kubernetes API token; empty for none.
    #[arg(long, default_value = "K8S_TOKEN")]
    token_env: String,
    /// A configuration JSON to start from (weights, poller timing...); the mapped sections replace
    /// its own.
    #[arg(long)]
    base: Option<PathBuf>,
    /// Several pools on one gateway, chosen by the request's model (body-based routing): name
    /// the pool after the InferencePool and let requests for other models pass on to the next
    /// pool's filter. Run once per pool (`--pool`).
    #[arg(long)]
    route_by_model: bool,
    /// Write here instead of stdout.
    #[arg(short, long)]
    output: Option<PathBuf>,
}

fn read(path: &PathBuf) -> Result<String, String> {
    if path.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).map_err(|e| format!("stdin: {e}"))?;
        Ok(s)
    } else {
        std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))
    }
}

fn run(args: Args) -> Result<(), Vec<String>> {
    let mut docs = Vec::new();
    for f in &args.files {
        let text = read(f).map_err(|e| vec![e])?;
        docs.extend(parse_documents(&text).map_err(|e| vec![format!("{}: {e}", f.display())])?);
    }
    let models =
        args.models.iter().map(|m| parse_model_arg(m)).collect::<Result<Vec<_>, _>>().map_err(|e| vec![e])?;
    let base = match &args.base {
        Some(p) => Some(
            serde_json::from_str(&read(p).map_err(|e| vec![e])?)
                .map_err(|e| vec![format!("{}: {e}", p.display())])?,
        ),
        None => None,
    };
    let opts = Options {
        pool: args.pool,
        namespace: args.namespace,
        models,
        poller_mode: match args.poller_mode {
            Mode::Lease => PollerMode::Lease,
            Mode::Singleton => PollerMode::Singleton,
        },
        token_env: Some(args.token_env).filter(|t| !t.is_empty()),
        base,
        route_by_model: args.route_by_model,
    };
    let out = convert(&docs, &opts)?;
    for w in &out.warnings {
        eprintln!("note: {w}");
    }
    let mut json = serde_json::to_string_pretty(&out.config).map_err(|e| vec![e.to_string()])?;
    json.push('\n');
    match args.output {
        Some(p) => std::fs::write(&p, json).map_err(|e| vec![format!("{}: {e}", p.display())]),
        None => {
            print!("{json}");
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(errors) => {
            for e in errors {
                eprintln!("error: {e}");
            }
            ExitCode::FAILURE
        }
    }
}
