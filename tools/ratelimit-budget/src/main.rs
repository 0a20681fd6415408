//! `ratelimit-budget`: a minimal Envoy rate limit service (`envoy.service.ratelimit.v3`) with a
//! token budget per descriptor entry (src/lib.rs), for tests/e2e/test_token_budget.py.
//!
//! ```text
//! ratelimit-budget [--port P] [--budget KEY=VALUE:TOKENS]...
//! ```
//! Listens on 127.0.0.1:P (0, the default: a free port), prints `READY <port>` on stdout, then one
//! JSON line per `ShouldRateLimit` call: the domain, the request's `hits_addend`, each descriptor
//! (its entries, its `hits_addend` or null, the hits charged, the budget's limit and hits used
//! after the call, or null, and its code) and the overall code. Stops on SIGTERM or SIGINT.

use std::io::Write;
use std::sync::{Arc, Mutex};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use ratelimit_budget::{Budget, Descriptor, Ledger, Verdict};
use serde_json::json;
use tonic::{Request, Response, Status};

const USAGE: &str = "usage: ratelimit-budget [--port P] [--budget KEY=VALUE:TOKENS]...";

struct Service {
    ledger: Arc<Mutex<Ledger>>,
}

fn code_name(over_limit: bool) -> &'static str {
    if over_limit {
        "OVER_LIMIT"
    } else {
        "OK"
    }
}

/// The JSON line of one call.
fn record(req: &RateLimitRequest, descriptors: &[Descriptor], verdicts: &[Verdict], over: bool) -> String {
    let ds: Vec<_> = descriptors
        .iter()
        .zip(verdicts)
        .map(|(d, v)| {
            json!({
                "entries": d.entries,
                "hits_addend": d.hits_addend,
                "hits": v.hits,
                "limit": v.budget.map(|b| b.0),
                "used": v.budget.map(|b| b.1),
                "code": code_name(v.over_limit),
            })
        })
        .collect();
    json!({"domain": req.domain, "hits_addend": req.hits_addend, "descriptors": ds, "code": code_name(over)})
        .to_string()
}

#[tonic::async_trait]
impl RateLimitService for Service {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let req = request.into_inner();
        let descriptors: Vec<Descriptor> = req
            .descriptors
            .iter()
            .map(|d| Descriptor {
                entries: d.entries.iter().map(|e| (e.key.clone(), e.value.clone())).collect(),
                hits_addend: d.hits_addend.as_ref().map(|h| h.value),
            })
            .collect();
        let verdicts = match self.ledger.lock() {
            Ok(mut l) => l.apply(&descriptors, req.hits_addend),
            Err(_) => return Err(Status::internal("ledger poisoned")),
        };
        let over = verdicts.iter().any(|v| v.over_limit);
        let line = record(&req, &descriptors, &verdicts, over);
        {
            let mut out = std::io::stdout().lock();
            // A closed stdout only loses the record; the answer still goes back.
            let _ = writeln!(out, "{line}").and_then(|()| out.flush());
        }
        let statuses = verdicts
            .iter()
            .map(|v| DescriptorStatus {
                code: if v.over_limit { Code::OverLimit } else { Code::Ok } as i32,
                limit_remaining: v
                    .budget
                    .map_or(0, |(limit, used)| u32::try_from(limit.saturating_sub(used)).unwrap_or(u32::MAX)),
                ..Default::default()
            })
            .collect();
        Ok(Response::new(RateLimitResponse {
            overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
            statuses,
            ..Default::default()
        }))
    }
}

fn parse_args(mut it: impl Iterator<Item = String>) -> Result<(u16, Vec<Budget>), String> {
    let (mut port, mut budgets) = (0u16, Vec::new());
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--port" => port = value()?.parse::<u16>().map_err(|e| format!("--port: {e}"))?,
            "--budget" => budgets.push(Budget::parse(&value()?)?),
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    Ok((port, budgets))
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
    let (port, budgets) = match parse_args(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("ratelimit-budget: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ratelimit-budget: runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let svc = RateLimitServiceServer::new(Service { ledger: Arc::new(Mutex::new(Ledger::new(budgets))) });
    let served = rt.block_on(async move {
        let listener =
            tokio::net::TcpListener::bind(std::net::SocketAddr::from(([127, 0, 0, 1], port))).await?;
        let bound = listener.local_addr()?.port();
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "READY {bound}")?;
            out.flush()?;
        }
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
            eprintln!("ratelimit-budget: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
