//! The per-request pipeline, pure: what the HTTP filter does with the request headers and the
//! buffered body. The host gathers inputs through host calls, calls these functions, and maps
//! the returned decision onto host calls (set headers, replace body, local reply).
//!
//! Order for one request:
//! 1. request headers: [`RequestHead`] is read (including the trusted priority headers, see
//!    `crate::priority`), then every header in [`headers_to_remove`] is removed; [`on_head`]
//!    decides whether to read the body;
//! 2. complete body: [`prepare`] parses it, resolves the model (rewrite/split, base model) and
//!    the priority; the host applies the body rewrite at once;
//! 3. admission (`crate::admission`): go on now, hold, or reject;
//! 4. when the request goes on (at once, or when flow control releases it): [`route`] picks the
//!    endpoint with the metrics and in-flight counts of *that* moment.

use crate::body::{parse_request, rewrite_model};
use crate::config::Config;
use crate::errors::Rejection;
use crate::inflight::InflightCounts;
use crate::ports::{Rng, SharedStore};
use crate::priority::{self, Criticality, PriorityDecision, PriorityHeaders};
use crate::scheduler::{ModelRoute, Pick, PickRequest, Scheduler};
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
/// Response header with the time, in whole milliseconds, the request was held by flow control
/// before it went upstream (0 when it was not held). Also on flow-control rejections.
pub const QUEUE_MS_HEADER: &str = "x-inference-picker-queue-ms";

/// Every request header the filter removes before the request can go upstream, whatever the
/// path: the client-chosen destination headers, and the priority headers
/// (`priority::headers_to_strip`). The host reads the trusted priority headers first.
pub fn headers_to_remove(cfg: &Config) -> impl Iterator<Item = &str> {
    CLIENT_ROUTING_HEADERS.into_iter().chain(priority::headers_to_strip(&cfg.priority))
}

/// What the filter learned from the request headers.
#[derive(Debug, Clone, Default)]
pub struct RequestHead {
    pub method: String,
    pub path: String,
    pub content_length: Option<u64>,
    pub session_id: Option<String>,
    pub session_token: Option<String>,
    /// The trusted priority headers (`PriorityHeaders::read`), read before they are removed.
    pub priority: PriorityHeaders,
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

/// A request whose body is parsed and whose model and priority are known; the endpoint is not
/// chosen yet. Kept while the request is held (the prompt is needed by the prefix scorer).
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    /// The model the client asked for.
    pub requested_model: String,
    /// The model it is sent as, and the base model whose endpoints serve it (the flow-control
    /// group).
    pub route: ModelRoute,
    pub prompt: String,
    pub cache_salt: Option<String>,
    /// A replacement body when the model was rewritten (content-length must follow).
    pub new_body: Option<Vec<u8>>,
    pub priority: PriorityDecision,
}

/// The criticality that sets a request's default priority: that of the configured base model
/// the client named (directly or through one of its adapters), else that of the base model the
/// request is sent to after rewrites, else `Standard` (a discovered model has none configured).
/// The client's name comes first because criticality describes the traffic clients send under
/// that name (GIE's InferenceModel put it on the client-facing name, next to its rewrites).
pub fn criticality_of(cfg: &Config, requested: &str, base: &str) -> Criticality {
    let by_name = |name: &str| {
        cfg.models
            .iter()
            .find(|m| m.name == name || m.adapters.iter().any(|a| a == name))
            .map(|m| m.criticality)
    };
    by_name(requested).or_else(|| by_name(base)).unwrap_or_default()
}

/// Called with the complete body: parse, resolve the model (rewrite or split, base model),
/// rewrite the body, resolve the priority. No endpoint is chosen here.
pub fn prepare(
    cfg: &Config,
    scheduler: &Scheduler,
    rng: &mut dyn Rng,
    head: &RequestHead,
    body: &[u8],
    snapshot: &Snapshot,
) -> Result<Prepared, Rejection> {
    if body.len() > cfg.filter.max_body_bytes {
        return Err(too_large(cfg));
    }
    let parsed = parse_request(&head.path, body)?;
    let route = scheduler.route_model(&parsed.model, head.session_id.as_deref(), snapshot, rng)?;
    let new_body = if route.model_rewritten { Some(rewrite_model(body, &route.target_model)?) } else { None };
    let criticality = criticality_of(cfg, &parsed.model, &route.base);
    let priority = head.priority.resolve(&cfg.priority, criticality);
    // A held request keeps only what the prefix scorer hashes (bounded memory per held request).
    let mut prompt = parsed.prompt;
    let hashed = cfg.scheduler.prefix.block_chars.saturating_mul(cfg.scheduler.prefix.max_blocks);
    truncate_prompt(&mut prompt, hashed);
    Ok(Prepared {
        requested_model: parsed.model,
        route,
        prompt,
        cache_salt: parsed.cache_salt,
        new_body,
        priority,
    })
}

/// Cuts `prompt` to the first `max_bytes` bytes, or just past them to the next character
/// boundary (at most 3 bytes more), so that every full block the prefix scorer hashes
/// (`block_chars × max_blocks` bytes) is kept byte for byte and the hashes are unchanged.
pub fn truncate_prompt(prompt: &mut String, max_bytes: usize) {
    if prompt.len() <= max_bytes {
        return;
    }
    let cut = (max_bytes..=prompt.len()).find(|&i| prompt.is_char_boundary(i)).unwrap_or(prompt.len());
    prompt.truncate(cut);
    prompt.shrink_to_fit();
}

/// Picks the endpoint for a prepared request, with the inputs of the moment it goes on.
pub fn route(
    scheduler: &mut Scheduler,
    rng: &mut dyn Rng,
    head: &RequestHead,
    prepared: &Prepared,
    inputs: &BodyInputs<'_>,
) -> Result<Pick, Rejection> {
    let req = PickRequest {
        model: &prepared.requested_model,
        prompt: &prepared.prompt,
        cache_salt: prepared.cache_salt.as_deref(),
        session_id: head.session_id.as_deref(),
        session_token: head.session_token.as_deref(),
    };
    scheduler.pick_for(
        &prepared.route,
        &req,
        inputs.snapshot,
        inputs.inflight,
        inputs.store,
        rng,
        inputs.now_ms,
    )
}

/// [`prepare`] then [`route`] at once, for a request that is never held.
pub fn on_body(
    cfg: &Config,
    scheduler: &mut Scheduler,
    rng: &mut dyn Rng,
    head: &RequestHead,
    body: &[u8],
    inputs: &BodyInputs<'_>,
) -> Result<Routed, Rejection> {
    let prepared = prepare(cfg, scheduler, rng, head, body, inputs.snapshot)?;
    let pick = route(scheduler, rng, head, &prepared, inputs)?;
    Ok(Routed { pick, requested_model: prepared.requested_model, new_body: prepared.new_body })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_prompt_is_cut_to_what_the_prefix_scorer_hashes_with_the_same_hashes() {
        use crate::scheduler::prefix::{block_hashes, seed};
        // 'é' is 2 bytes: the cut at 10 falls inside a character and moves just past it.
        let full: String = "ab".repeat(4) + &"é".repeat(100);
        let mut p = full.clone();
        truncate_prompt(&mut p, 9);
        assert_eq!(p.len(), 10);
        assert!(full.starts_with(&p));
        let (mut a, mut b) = (Vec::new(), Vec::new());
        block_hashes(&full, seed("m", None), 3, 3, &mut a);
        block_hashes(&p, seed("m", None), 3, 3, &mut b);
        assert_eq!(a, b);
        let mut short = "hi".to_string();
        truncate_prompt(&mut short, 9);
        assert_eq!(short, "hi");
        // prepare() keeps at most block_chars × max_blocks (+3) bytes of a huge prompt.
        let c = cfg();
        let sched = Scheduler::new(&c);
        let mut rng = SplitMix64::new(1);
        let big = "x".repeat(1 << 20);
        let body = format!(r#"{{"model":"base-a","prompt":"{big}"}}"#);
        let pr =
            prepare(&c, &sched, &mut rng, &head(PriorityHeaders::default()), body.as_bytes(), &snapshot())
                .unwrap();
        let cap = c.scheduler.prefix.block_chars * c.scheduler.prefix.max_blocks;
        assert!(pr.prompt.len() <= cap + 3 && pr.prompt.len() >= cap, "{}", pr.prompt.len());
        assert!(pr.prompt.capacity() <= cap + 3);
    }
    use crate::metrics::EndpointMetrics;
    use crate::ports::{MemStore, SplitMix64};
    use crate::priority::PrioritySource;
    use crate::snapshot::EndpointStatus;

    fn cfg() -> Config {
        Config::from_json(
            br#"{"version":1,
                "endpoints":[{"address":"10.0.0.1:8000","models":["base-a"]},
                             {"address":"10.0.0.2:8000","models":["base-b"]}],
                "models":[{"name":"base-a","adapters":["lora-a"],"criticality":"Critical"},
                          {"name":"base-b","criticality":"Sheddable"}],
                "scheduler":{"rewrites":[
                    {"matches":[{"model":{"value":"alias"}}],"targets":[{"model_rewrite":"base-b"}]},
                    {"matches":[{"model":{"value":"base-a"}}],"targets":[{"model_rewrite":"base-b"}]}]},
                "priority":{"objectives":[{"name":"batch","priority":-20}],
                            "trust_objective_header":true,
                            "tier":{"header":"x-llm-tier","values":{"premium":15}}}}"#,
        )
        .unwrap()
    }

    fn snapshot() -> Snapshot {
        let ep = |a: &str, m: &str| EndpointStatus {
            address: a.into(),
            models: vec![m.into()],
            metrics: Some(EndpointMetrics {
                queue: Some(0.0),
                kv_usage: Some(0.0),
                ..EndpointMetrics::default()
            }),
            scraped_ms: 1000,
            failures: 0,
        };
        Snapshot {
            version: 1,
            published_ms: 1000,
            endpoints: vec![ep("10.0.0.1:8000", "base-a"), ep("10.0.0.2:8000", "base-b")],
        }
    }

    fn head(priority: PriorityHeaders) -> RequestHead {
        RequestHead {
            method: "POST".into(),
            path: "/v1/completions".into(),
            priority,
            ..RequestHead::default()
        }
    }

    #[test]
    fn removes_destination_and_every_priority_header() {
        let c = cfg();
        let names: Vec<&str> = headers_to_remove(&c).collect();
        assert_eq!(
            names,
            vec![
                "x-gateway-destination-endpoint",
                "x-envoy-original-dst-host",
                "x-gateway-inference-objective",
                "x-gateway-inference-fairness-id",
                // Configured but untrusted: still removed.
                "x-llm-tier",
            ]
        );
    }

    #[test]
    fn criticality_follows_the_name_the_client_used() {
        let c = cfg();
        // A configured base, and an adapter of it: that base's criticality.
        assert_eq!(criticality_of(&c, "base-a", "base-b"), Criticality::Critical);
        assert_eq!(criticality_of(&c, "lora-a", "base-a"), Criticality::Critical);
        // An alias that is only a rewrite source: the criticality of where it is sent.
        assert_eq!(criticality_of(&c, "alias", "base-b"), Criticality::Sheddable);
        // A discovered model nobody configured: Standard.
        assert_eq!(criticality_of(&c, "found", "found"), Criticality::Standard);
    }

    #[test]
    fn prepare_resolves_route_rewrite_and_priority_without_picking() {
        let c = cfg();
        let sched = Scheduler::new(&c);
        let mut rng = SplitMix64::new(1);
        let body = br#"{"model":"base-a","prompt":"hi"}"#;
        // base-a is rewritten to base-b (group base-b), but keeps base-a's Critical priority (10).
        let p = prepare(&c, &sched, &mut rng, &head(PriorityHeaders::default()), body, &snapshot()).unwrap();
        assert_eq!((p.route.base.as_str(), p.route.model_rewritten), ("base-b", true));
        assert_eq!(p.new_body.as_deref(), Some(&br#"{"model":"base-b","prompt":"hi"}"#[..]));
        assert_eq!((p.priority.priority, p.priority.source), (10, PrioritySource::Model));
        assert_eq!(p.priority.fairness_id, "default-flow");
        // A trusted objective wins over the model; the untrusted tier value was never read
        // (PriorityHeaders::read would not fill it), and here it is absent anyway.
        let h = PriorityHeaders { objective: Some("batch".into()), tier: None, fairness_id: None };
        let p = prepare(&c, &sched, &mut rng, &head(h), br#"{"model":"alias","prompt":"x"}"#, &snapshot())
            .unwrap();
        assert_eq!((p.priority.priority, p.priority.source), (-20, PrioritySource::Objective));
        // Unknown model: 404 before any admission.
        let e = prepare(
            &c,
            &sched,
            &mut rng,
            &head(PriorityHeaders::default()),
            br#"{"model":"nope"}"#,
            &snapshot(),
        );
        assert_eq!(e.unwrap_err().status, 404);
    }

    #[test]
    fn route_later_picks_among_the_groups_endpoints() {
        let c = cfg();
        let mut sched = Scheduler::new(&c);
        let mut rng = SplitMix64::new(7);
        let h = head(PriorityHeaders::default());
        let p = prepare(&c, &sched, &mut rng, &h, br#"{"model":"alias","prompt":"x"}"#, &snapshot()).unwrap();
        let store = MemStore::new();
        let counts = InflightCounts::default();
        let snap = snapshot();
        let inputs = BodyInputs { snapshot: &snap, inflight: &counts, store: &store, now_ms: 1100 };
        let pick = route(&mut sched, &mut rng, &h, &p, &inputs).unwrap();
        // Only 10.0.0.2 serves base-b; the target model is the rewrite's.
        assert_eq!((pick.primary.as_str(), pick.target_model.as_str()), ("10.0.0.2:8000", "base-b"));
        // on_body (prepare + route at once) agrees.
        let r = on_body(&c, &mut sched, &mut rng, &h, br#"{"model":"alias","prompt":"x"}"#, &inputs).unwrap();
        assert_eq!((r.pick.primary.as_str(), r.requested_model.as_str()), ("10.0.0.2:8000", "alias"));
    }
}
