//! The per-request pipeline, pure: what the HTTP filter does with the request headers and the
//! buffered body. The host gathers inputs through host calls, calls these functions, and maps
//! the returned decision onto host calls (set headers, replace body, local reply).

use crate::body::{parse_request, rewrite_model};
use crate::config::Config;
use crate::errors::Rejection;
use crate::inflight::InflightCounts;
use crate::ports::{Rng, SharedStore};
use crate::scheduler::{Pick, PickRequest, Scheduler};
use crate::snapshot::Snapshot;

/// Request headers a client could use to choose the destination itself. Removed from every
/// request before anything else happens; only the filter sets them.
pub const CLIENT_ROUTING_HEADERS: [&str; 2] = ["x-gateway-destination-endpoint", "x-envoy-original-dst-host"];

/// GIE destination header: primary first, then fallbacks.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The header the ORIGINAL_DST cluster reads (the primary only).
pub const ORIGINAL_DST_HEADER: &str = "x-envoy-original-dst-host";
/// Response header naming the endpoint that served.
pub const SERVED_HEADER: &str = "x-gateway-destination-endpoint-served";
/// Opt-in response header with the per-endpoint scores of the decision
/// (`scheduler.debug_scores`).
pub const DEBUG_SCORES_HEADER: &str = "x-inference-picker-scores";

/// What the filter learned from the request headers.
#[derive(Debug, Clone, Default)]
pub struct RequestHead {
    pub method: String,
    pub path: String,
    pub content_length: Option<u64>,
    pub session_id: Option<String>,
    pub session_token: Option<String>,
}

/// Decision after the request headers.
#[derive(Debug, Clone, PartialEq)]
pub enum HeadDecision {
    /// Pause and buffer the body.
    ReadBody,
    /// Answer locally with this error.
    Reject(Rejection),
    /// Answer locally with 200 and this JSON (the pool's model list).
    ModelList(Vec<u8>),
}

/// Called on request headers. `end_of_stream` means the request has no body.
pub fn on_head(cfg: &Config, head: &RequestHead, end_of_stream: bool) -> HeadDecision {
    let path = head.path.split('?').next().unwrap_or("");
    if head.method == "GET" && path.trim_end_matches('/').ends_with("/v1/models") {
        return HeadDecision::ModelList(model_list(cfg));
    }
    if let Some(len) = head.content_length {
        if len > cfg.filter.max_body_bytes as u64 {
            return HeadDecision::Reject(too_large(cfg));
        }
    }
    if end_of_stream {
        return HeadDecision::Reject(Rejection::new(
            400,
            "invalid_request_error",
            "missing_model",
            "inference requests need a JSON body with a \"model\" field",
        ));
    }
    HeadDecision::ReadBody
}

/// The 413 for a body over the limit.
pub fn too_large(cfg: &Config) -> Rejection {
    Rejection::new(
        413,
        "invalid_request_error",
        "request_too_large",
        format!("request body is larger than the limit of {} bytes", cfg.filter.max_body_bytes),
    )
}

/// What to do with a routed request.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    pub pick: Pick,
    /// The model the client asked for.
    pub requested_model: String,
    /// A replacement body when the model was rewritten (content-length must follow).
    pub new_body: Option<Vec<u8>>,
}

/// Everything the body decision reads, passed in by the host.
pub struct BodyInputs<'a> {
    pub snapshot: &'a Snapshot,
    pub inflight: &'a InflightCounts,
    pub store: &'a dyn SharedStore,
    pub now_ms: u64,
}

/// Called with the complete body: parse, pick, rewrite.
pub fn on_body(
    cfg: &Config,
    scheduler: &mut Scheduler,
    rng: &mut dyn Rng,
    head: &RequestHead,
    body: &[u8],
    inputs: &BodyInputs<'_>,
) -> Result<Routed, Rejection> {
    if body.len() > cfg.filter.max_body_bytes {
        return Err(too_large(cfg));
    }
    let parsed = parse_request(&head.path, body)?;
    let req = PickRequest {
        model: &parsed.model,
        prompt: &parsed.prompt,
        cache_salt: parsed.cache_salt.as_deref(),
        session_id: head.session_id.as_deref(),
        session_token: head.session_token.as_deref(),
    };
    let pick = scheduler.pick(&req, inputs.snapshot, inputs.inflight, inputs.store, rng, inputs.now_ms)?;
    let new_body = if pick.model_rewritten { Some(rewrite_model(body, &pick.target_model)?) } else { None };
    Ok(Routed { pick, requested_model: parsed.model, new_body })
}

/// OpenAI `GET /v1/models` for the whole pool: every base model and adapter in the config.
pub fn model_list(cfg: &Config) -> Vec<u8> {
    let mut data = Vec::new();
    for m in &cfg.models {
        data.push(serde_json::json!({"id": m.name, "object": "model", "owned_by": "inference-picker"}));
        for a in &m.adapters {
            data.push(
                serde_json::json!({"id": a, "object": "model", "owned_by": "inference-picker", "parent": m.name}),
            );
        }
    }
    serde_json::to_vec(&serde_json::json!({"object": "list", "data": data})).unwrap_or_default()
}
