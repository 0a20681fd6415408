//! `ext-proc-epp`: the ext_proc gRPC server of `make bench-envoy` (see src/lib.rs).
//!
//! ```text
//! ext-proc-epp --port P --mode rr|scheduler --endpoints ip:port,ip:port,...
//!              [--metrics FILE] [--model NAME]
//! ```
//! Listens on 127.0.0.1:P. One thread (a current-thread Tokio runtime): every stream's messages
//! are handled in turn, so the picker's state needs no lock in practice (a mutex is held only
//! while one message is answered). Stops on SIGTERM or SIGINT.

use std::pin::Pin;
use std::sync::{Arc, Mutex};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use ext_proc_epp::{handle, Picker, RoundRobin, SchedPicker, StreamState};
use futures_util::Stream;
use tonic::{Request, Response, Status, Streaming};

const USAGE: &str = "usage: ext-proc-epp --port P --mode rr|scheduler --endpoints ip:port,... \
                     [--metrics FILE (scheduler)] [--model NAME]";
const DEFAULT_MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

#[allow(clippy::disallowed_methods)] // the server's own clock: the scheduler takes now_ms from it
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

struct Epp {
    picker: Arc<Mutex<Picker>>,
}

type Out = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Epp {
    type ProcessStream = Out;

    async fn process(&self, request: Request<Streaming<ProcessingRequest>>) -> Result<Response<Out>, Status> {
        let inbound = request.into_inner();
        let picker = self.picker.clone();
        let out = futures_util::stream::unfold(
            (inbound, StreamState::default(), picker),
            |(mut inbound, mut st, picker)| async move {
                loop {
                    let msg = match inbound.message().await {
                        Ok(Some(m)) => m,
                        Ok(None) => return None,
                        Err(s) => return Some((Err(s), (inbound, st, picker))),
                    };
                    let answer = match picker.lock() {
                        Ok(mut p) => Ok(handle(&mut p, &mut st, msg, now_ms())),
                        Err(_) => Err(Status::internal("picker poisoned")),
                    };
                    let answer = match answer {
                        Ok(a) => a,
                        Err(s) => return Some((Err(s), (inbound, st, picker))),
                    };
                    if let Some(a) = answer {
                        return Some((Ok(a), (inbound, st, picker)));
                    }
                }
            },
        );
        Ok(Response::new(Box::pin(out)))
    }
}

struct Args {
    port: u16,
    mode: String,
    endpoints: Vec<String>,
    metrics: Option<String>,
    model: String,
}

fn parse_args(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let (mut port, mut mode, mut endpoints, mut metrics, mut model) = (None, None, None, None, None);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--port" => port = Some(value()?.parse::<u16>().map_err(|e| format!("--port: {e}"))?),
            "--mode" => mode = Some(value()?),
            "--endpoints" => {
                endpoints = Some(
                    value()?.split(',').filter(|s| !s.is_empty()).map(str::to_string).collect::<Vec<_>>(),
                )
            }
            "--metrics" => metrics = Some(value()?),
            "--model" => model = Some(value()?),
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    Ok(Args {
        port: port.ok_or("--port is required")?,
        mode: mode.ok_or("--mode is required")?,
        endpoints: endpoints.ok_or("--endpoints is required")?,
        metrics,
        model: model.unwrap_or_else(|| DEFAULT_MODEL.into()),
    })
}

fn build_picker(a: &Args) -> Result<Picker, String> {
    match a.mode.as_str() {
        "rr" => RoundRobin::new(a.endpoints.clone()).map(Picker::Rr).ok_or_else(|| "no endpoints".into()),
        "scheduler" => {
            let path = a.metrics.as_deref().ok_or("--mode scheduler needs --metrics FILE")?;
            let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
            SchedPicker::new(&a.endpoints, &a.model, &text, now_ms()).map(|s| Picker::Sched(Box::new(s)))
        }
        other => Err(format!("--mode {other}: rr or scheduler")),
    }
}

async fn shutdown() {
    use tokio::signal::unix::{signal, SignalKind};
    match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(mut t), Ok(mut i)) => {
            tokio::select! { _ = t.recv() => {}, _ = i.recv() => {} }
        }
        // No signal handler: the default action (exit) still stops the process.
        _ => std::future::pending::<()>().await,
    }
}

fn main() -> std::process::ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("ext-proc-epp: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let picker = match build_picker(&args) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("ext-proc-epp: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ext-proc-epp: runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], args.port));
    let svc = ExternalProcessorServer::new(Epp { picker: Arc::new(Mutex::new(picker)) });
    let served = rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        eprintln!(
            "ext-proc-epp: mode {} with {} endpoints, listening on {addr}",
            args.mode,
            args.endpoints.len()
        );
        let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(incoming, shutdown())
            .await
            .map_err(std::io::Error::other)
    });
    match served {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ext-proc-epp: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
