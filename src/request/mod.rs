//! The per-request pipeline, pure: what the HTTP filter does with the request headers and the
//! buffered body. The host gathers inputs through host calls, calls these functions, and maps
//! the returned decision onto host calls (set headers, replace body, local reply).
//!
//! Order for one request:
//! 1. request headers: [`RequestHead`] is read (including the trusted priority headers, see
//!    `crate::flow::priority`), then every header in [`headers_to_remove`] is removed; [`on_head`]
//!    decides whether to read the body;
//! 2. complete body: [`prepare`] parses it, resolves the model (rewrite/split, base model) and
//!    the priority; the host applies the body rewrite at once;
//! 3. admission (`crate::flow::admission`): go on now, hold, or reject;
//! 4. when the request goes on (at once, or when flow control releases it): [`route`] picks the
//!    endpoint with the metrics and in-flight counts of *that* moment.

pub mod body;
pub mod config;
pub mod pd;
pub mod pools;
pub mod protocol;

use crate::base::errors::Rejection;
use crate::base::ports::Rng;
use crate::flow::priority::{self, PriorityDecision, PriorityHeaders};
use crate::request::body::{parse_request, rewrite_model};
use crate::request::config::Settings;
use crate::request::protocol::{
    prefix_matches, CLIENT_ROUTING_HEADERS, CONFORMANCE_SELECTION_HEADER, HEALTH_PATHS, INFERENCE_PATHS,
    MAX_SELECTION_ENTRIES, MODELS_PATH,
};
use crate::scheduler::{ModelRoute, Pick, PickInput, PickRequest, PickScope, PickState, Scheduler};
use crate::state::catalog::Criticality;
use crate::state::snapshot::Snapshot;

/// Every request header the filter removes before the request can go upstream, whatever the
/// path: the client-chosen destination headers, and the priority headers
/// (`priority::headers_to_strip`). The host reads the trusted priority headers first.
pub fn headers_to_remove<'a>(cfg: &Settings<'a>) -> impl Iterator<Item = &'a str> {
    CLIENT_ROUTING_HEADERS.into_iter().chain(priority::headers_to_strip(cfg.priority))
}

/// What the filter learned from the request headers. A header whose value is not UTF-8 reads as
/// absent (the host maps it so).
#[derive(Debug, Clone, Default)]
pub struct RequestHead {
    pub method: String,
    pub path: String,
    pub content_length: Option<u64>,
    pub session_id: Option<String>,
    pub session_token: Option<String>,
    /// The trusted priority headers (`PriorityHeaders::read`), read before they are removed.
    pub priority: PriorityHeaders,
    /// Conformance mode only: the endpoints the conformance suite's test header names
    /// ([`conformance_selection`]); `None` otherwise.
    pub test_selection: Option<Vec<String>>,
}

/// The endpoints `test-epp-endpoint-selection` names, in conformance mode only: its value split
/// on `,`, trimmed, empty entries dropped, at most [`MAX_SELECTION_ENTRIES`]. Outside conformance
/// mode, or with no usable entry, `None`: the header is never trusted for real traffic.
pub fn conformance_selection(cfg: &Settings<'_>, value: Option<&str>) -> Option<Vec<String>> {
    if !cfg.filter.conformance_mode {
        return None;
    }
    let v: Vec<String> = value?
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .take(MAX_SELECTION_ENTRIES)
        .map(str::to_string)
        .collect();
    (!v.is_empty()).then_some(v)
}

/// The snapshot cut down to the endpoints a conformance selection names: an entry `ip:port`
/// matches that endpoint, a bare `ip` every port of that address (data-parallel ranks), as GIE's
/// conformance EPP does. Nothing matching is a 503 (the suite expects the gateway not to fall
/// back to other pods).
pub fn restrict_to_selection(snapshot: &Snapshot, selection: &[String]) -> Result<Snapshot, Rejection> {
    use std::net::{IpAddr, SocketAddr};
    enum Sel {
        Exact(SocketAddr),
        AnyPort(IpAddr),
    }
    let sels: Vec<Sel> = selection
        .iter()
        .filter_map(|s| match s.parse::<SocketAddr>() {
            Ok(a) => Some(Sel::Exact(a)),
            Err(_) => {
                s.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>().ok().map(Sel::AnyPort)
            }
        })
        .collect();
    let matches = |addr: &str| {
        let Ok(a) = addr.parse::<SocketAddr>() else { return false };
        sels.iter().any(|s| match s {
            Sel::Exact(x) => *x == a,
            Sel::AnyPort(ip) => *ip == a.ip(),
        })
    };
    let endpoints: Vec<_> = snapshot.endpoints.iter().filter(|e| matches(&e.address)).cloned().collect();
    if endpoints.is_empty() {
        return Err(Rejection::new(
            503,
            "service_unavailable",
            "no_endpoint",
            format!("{CONFORMANCE_SELECTION_HEADER} names no endpoint of the pool"),
        ));
    }
    Ok(Snapshot { endpoints, ..snapshot.clone() })
}

/// A local answer that is not an error: the model list or one model, a health check, a
/// preflight.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalReply {
    pub status: u32,
    pub headers: Vec<(&'static str, String)>,
    /// JSON (empty for 204).
    pub body: Vec<u8>,
}

impl LocalReply {
    fn json(status: u32, body: Vec<u8>) -> Self {
        LocalReply { status, headers: vec![("content-type", "application/json".into())], body }
    }
}

/// Decision after the request headers.
#[derive(Debug, Clone, PartialEq)]
pub enum HeadDecision {
    /// `GET`/`HEAD /v1/models` (`id: None`) or `/v1/models/{id}`: answer with
    /// [`models_reply`], which needs the snapshot (the models the pods reported).
    Models { id: Option<String> },
    /// An inference request: pause and buffer the body.
    ReadBody,
    /// Answer locally with this error; `allow` is the `allow` header of a 405.
    Reject { rejection: Rejection, allow: Option<&'static str> },
    /// Answer locally with this reply.
    Local(LocalReply),
    /// `filter.passthrough_prefixes`: let the request through untouched.
    PassThrough,
}

impl HeadDecision {
    fn reject(rejection: Rejection) -> Self {
        HeadDecision::Reject { rejection, allow: None }
    }

    fn wrong_method(method: &str, path: &str, allow: &'static str) -> Self {
        HeadDecision::Reject {
            rejection: Rejection::new(
                405,
                "invalid_request_error",
                "method_not_allowed",
                format!("{} is not allowed on {}; allowed: {allow}", clip(method), clip(path)),
            ),
            allow: Some(allow),
        }
    }
}

/// At most 200 characters of client text echoed in an error message.
fn clip(s: &str) -> &str {
    match s.char_indices().nth(200) {
        Some((i, _)) => s.get(..i).unwrap_or(s),
        None => s,
    }
}

/// Called on request headers. `end_of_stream` means the request has no body.
///
/// The path policy, in order (the path is taken without its query; a trailing `/` is ignored):
/// 1. a `filter.passthrough_prefixes` match: [`HeadDecision::PassThrough`];
/// 2. `OPTIONS` (CORS preflight) on any other path: 204 with `allow`, and no
///    `access-control-allow-*` headers, so browsers get no cross-origin access from this filter
///    (put Envoy's CORS filter before it to grant some; that filter answers preflights itself);
/// 3. an inference path ([`INFERENCE_PATHS`]): `POST` reads the body; any other method 405;
/// 4. `GET`/`HEAD /v1/models` (the list) and `/v1/models/{id}` (one model, or 404
///    `model_not_found`), answered locally; other methods 405;
/// 5. `GET`/`HEAD` on a health path ([`HEALTH_PATHS`]): 200 `{"status":"ok"}`; other methods 405;
/// 6. in conformance mode (`filter.conformance_mode`), a `POST` on any other path is an
///    inference request (the GIE suite uses paths of its own);
/// 7. anything else: 404 `not_found` JSON. Nothing reaches a pod unless the filter picked it.
pub fn on_head(cfg: &Settings<'_>, head: &RequestHead, end_of_stream: bool) -> HeadDecision {
    let raw = head.path.split(['?', '#']).next().unwrap_or("");
    let path = match raw.trim_end_matches('/') {
        "" => "/",
        p => p,
    };
    let method = head.method.as_str();
    if cfg.filter.passthrough_prefixes.iter().any(|p| prefix_matches(p, raw) || prefix_matches(p, path)) {
        return HeadDecision::PassThrough;
    }
    if method == "OPTIONS" {
        let allow = if INFERENCE_PATHS.contains(&path) { "POST, OPTIONS" } else { "GET, HEAD, OPTIONS" };
        return HeadDecision::Local(LocalReply {
            status: 204,
            headers: vec![("allow", allow.into())],
            body: Vec::new(),
        });
    }
    if INFERENCE_PATHS.contains(&path) {
        if method != "POST" {
            return HeadDecision::wrong_method(method, path, "POST, OPTIONS");
        }
        return inference_head(cfg, head, end_of_stream);
    }
    let model_id = path.strip_prefix(MODELS_PATH).and_then(|rest| match rest {
        "" => Some(None),
        r => r.strip_prefix('/').map(|id| Some(percent_decode(id))),
    });
    if let Some(id) = model_id {
        if method != "GET" && method != "HEAD" {
            return HeadDecision::wrong_method(method, path, "GET, HEAD, OPTIONS");
        }
        return HeadDecision::Models { id };
    }
    if HEALTH_PATHS.contains(&path) {
        if method != "GET" && method != "HEAD" {
            return HeadDecision::wrong_method(method, path, "GET, HEAD, OPTIONS");
        }
        return HeadDecision::Local(LocalReply::json(200, br#"{"status":"ok"}"#.to_vec()));
    }
    if cfg.filter.conformance_mode && method == "POST" {
        // GIE's conformance suite posts completion bodies to test paths of its own
        // (`/primary-gateway-test`, ...): in conformance mode any POST is an inference request.
        return inference_head(cfg, head, end_of_stream);
    }
    HeadDecision::reject(Rejection::new(
        404,
        "invalid_request_error",
        "not_found",
        format!(
            "No route for {} {}: this gateway serves POST {}, and GET {}.",
            clip(method),
            clip(path),
            INFERENCE_PATHS.join(", "),
            MODELS_PATH
        ),
    ))
}

/// An inference `POST`: read the body, unless the declared length is over the limit or there is
/// no body.
fn inference_head(cfg: &Settings<'_>, head: &RequestHead, end_of_stream: bool) -> HeadDecision {
    if let Some(len) = head.content_length {
        if len > cfg.filter.max_body_bytes as u64 {
            return HeadDecision::reject(too_large(cfg));
        }
    }
    if end_of_stream {
        return HeadDecision::reject(Rejection::new(
            400,
            "invalid_request_error",
            "missing_model",
            "inference requests need a JSON body with a \"model\" field",
        ));
    }
    HeadDecision::ReadBody
}

/// The answer to [`HeadDecision::Models`]: the model list, or one model (404 `model_not_found`
/// when neither the configuration nor, with `pod_models`, a pod has it).
pub fn models_reply(cfg: &Settings<'_>, id: Option<&str>, snapshot: &Snapshot) -> HeadDecision {
    match id {
        None => HeadDecision::Local(LocalReply::json(200, model_list(cfg, snapshot))),
        Some(id) => match model_object(cfg, id, snapshot) {
            Some(body) => HeadDecision::Local(LocalReply::json(200, body)),
            None => HeadDecision::reject(Rejection::new(
                404,
                "invalid_request_error",
                "model_not_found",
                format!("The model `{}` does not exist.", clip(id)),
            )),
        },
    }
}

/// Decodes `%XX` escapes (a model id such as `meta-llama%2FLlama-3.1-8B-Instruct`); an invalid
/// escape is kept as is. Bytes that do not form UTF-8 become U+FFFD (and then match no model).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        let hex = |j: usize| b.get(j).and_then(|h| (*h as char).to_digit(16));
        match (c, hex(i + 1), hex(i + 2)) {
            (b'%', Some(hi), Some(lo)) => {
                out.push((hi * 16 + lo) as u8);
                i += 3;
            }
            _ => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The 413 for a body over the limit.
pub fn too_large(cfg: &Settings<'_>) -> Rejection {
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
    /// The prefill pod of a split P/D request (`pd::PdPick::prefiller`).
    pub prefiller: Option<String>,
    /// The model the client asked for.
    pub requested_model: String,
    /// A replacement body when the model was rewritten (content-length must follow).
    pub new_body: Option<Vec<u8>>,
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
pub fn criticality_of(cfg: &Settings<'_>, requested: &str, base: &str) -> Criticality {
    let by_name = |name: &str| {
        cfg.catalog
            .models
            .iter()
            .find(|m| m.name == name || m.adapters.iter().any(|a| a == name))
            .map(|m| m.criticality)
    };
    by_name(requested).or_else(|| by_name(base)).unwrap_or_default()
}

/// Called with the complete body: parse, resolve the model (rewrite or split, base model),
/// rewrite the body, resolve the priority. No endpoint is chosen here.
pub fn prepare(
    cfg: &Settings<'_>,
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
    prepare_routed(cfg, head, parsed, route, body)
}

/// The rest of [`prepare`] once the body is parsed and its model resolved: body rewrite,
/// priority, the prompt kept for the prefix scorer. Body-based routing between pools
/// (`crate::request::pools`) calls the steps separately, so that a body another pool's filter already
/// parsed is not parsed again; `body` is read again only for a model rewrite.
pub fn prepare_routed(
    cfg: &Settings<'_>,
    head: &RequestHead,
    parsed: crate::request::body::ParsedRequest,
    route: ModelRoute,
    body: &[u8],
) -> Result<Prepared, Rejection> {
    let new_body = if route.model_rewritten { Some(rewrite_model(body, &route.target_model)?) } else { None };
    let criticality = criticality_of(cfg, &parsed.model, &route.base);
    let priority = head.priority.resolve(cfg.priority, criticality);
    // A held request keeps only what the prefix scorer hashes (bounded memory per held request).
    let mut prompt = parsed.prompt;
    let hashed = cfg.prefix.block_chars.saturating_mul(cfg.prefix.max_blocks);
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

/// The request's facts as the scheduler reads them ([`PickRequest`]), and the snapshot narrowed
/// to the conformance test's endpoint selection when it sent one (`None`: use the whole
/// snapshot).
fn pick_request<'a>(
    head: &'a RequestHead,
    prepared: &'a Prepared,
    snapshot: &Snapshot,
) -> Result<(PickRequest<'a>, Option<Snapshot>), Rejection> {
    let req = PickRequest {
        model: &prepared.requested_model,
        prompt: &prepared.prompt,
        cache_salt: prepared.cache_salt.as_deref(),
        session_id: head.session_id.as_deref(),
        session_token: head.session_token.as_deref(),
    };
    let restricted = match &head.test_selection {
        Some(sel) => Some(restrict_to_selection(snapshot, sel)?),
        None => None,
    };
    Ok((req, restricted))
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

/// Picks the endpoint for a prepared request with the state of the moment it goes on (the
/// filter's, and the replay's, one entry point): the request's facts and `state` become one
/// [`PickInput`] for `pd::pick` (the decode pick, and the prefill pick when P/D splits the
/// request; exactly [`Scheduler::pick`] without a `pd` section). Conformance mode: the test's
/// endpoint selection narrows every pick.
pub fn route(
    cfg: &Settings<'_>,
    scheduler: &mut Scheduler,
    rng: &mut dyn Rng,
    head: &RequestHead,
    prepared: &Prepared,
    state: PickState<'_>,
) -> Result<pd::PdPick, Rejection> {
    let (request, restricted) = pick_request(head, prepared, state.snapshot)?;
    let state = PickState { snapshot: restricted.as_ref().unwrap_or(state.snapshot), ..state };
    let input = PickInput { route: &prepared.route, request, state, scope: PickScope::default(), rng };
    pd::pick(cfg, scheduler, input)
}

/// [`prepare`] then [`route`] at once, for a request that is never held.
pub fn on_body(
    cfg: &Settings<'_>,
    scheduler: &mut Scheduler,
    rng: &mut dyn Rng,
    head: &RequestHead,
    body: &[u8],
    state: PickState<'_>,
) -> Result<Routed, Rejection> {
    let prepared = prepare(cfg, scheduler, rng, head, body, state.snapshot)?;
    let routed = route(cfg, scheduler, rng, head, &prepared, state)?;
    Ok(Routed {
        pick: routed.pick,
        prefiller: routed.prefiller,
        requested_model: prepared.requested_model,
        new_body: prepared.new_body,
    })
}

/// One entry of the model list: a base model, or an adapter with its `parent`.
fn model_entry(id: &str, parent: Option<&str>) -> serde_json::Value {
    let mut v = serde_json::json!({"id": id, "object": "model", "owned_by": "inference-picker"});
    if let (Some(p), Some(obj)) = (parent, v.as_object_mut()) {
        obj.insert("parent".into(), p.into());
    }
    v
}

/// The names the pods reported (`pod_models`) that the configuration does not list, filtered by
/// `pod_models.allow_list`, sorted. Empty without `pod_models`.
fn learned_models(cfg: &Settings<'_>, snapshot: &Snapshot) -> Vec<String> {
    if !cfg.catalog.learn_models {
        return Vec::new();
    }
    let configured: hashbrown::HashSet<&str> = cfg
        .catalog
        .models
        .iter()
        .flat_map(|m| std::iter::once(&m.name).chain(&m.adapters))
        .map(String::as_str)
        .collect();
    let allow = cfg.catalog.allow_list();
    crate::state::snapshot::learned_names(snapshot, allow.as_ref(), &configured)
}

/// OpenAI `GET /v1/models` for the whole pool: every base model and adapter in the config, then
/// (with `pod_models`) every other name some pod reports, without `parent` (a pod's list names
/// it, but the pool may not agree on one).
pub fn model_list(cfg: &Settings<'_>, snapshot: &Snapshot) -> Vec<u8> {
    let mut data = Vec::new();
    for m in cfg.catalog.models {
        data.push(model_entry(&m.name, None));
        for a in &m.adapters {
            data.push(model_entry(a, Some(&m.name)));
        }
    }
    for name in learned_models(cfg, snapshot) {
        data.push(model_entry(&name, None));
    }
    serde_json::to_vec(&serde_json::json!({"object": "list", "data": data})).unwrap_or_default()
}

/// OpenAI `GET /v1/models/{id}`: the configured base model or adapter named `id`, else (with
/// `pod_models`) a name some pod reports.
pub fn model_object(cfg: &Settings<'_>, id: &str, snapshot: &Snapshot) -> Option<Vec<u8>> {
    cfg.catalog
        .models
        .iter()
        .find_map(|m| {
            if m.name == id {
                Some(model_entry(&m.name, None))
            } else {
                m.adapters.iter().find(|a| *a == id).map(|a| model_entry(a, Some(&m.name)))
            }
        })
        .or_else(|| learned_models(cfg, snapshot).iter().any(|n| n == id).then(|| model_entry(id, None)))
        .and_then(|v| serde_json::to_vec(&v).ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

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
        let pr = prepare(
            &c.request(),
            &sched,
            &mut rng,
            &head(PriorityHeaders::default()),
            body.as_bytes(),
            &snapshot(),
        )
        .unwrap();
        let cap = c.scheduler.prefix.block_chars * c.scheduler.prefix.max_blocks;
        assert!(pr.prompt.len() <= cap + 3 && pr.prompt.len() >= cap, "{}", pr.prompt.len());
        assert!(pr.prompt.capacity() <= cap + 3);
    }
    use crate::base::ports::{MemStore, SplitMix64};
    use crate::flow::priority::PrioritySource;
    use crate::state::health::HealthView;
    use crate::state::inflight::InflightCounts;
    use crate::state::metrics::EndpointMetrics;
    use crate::state::snapshot::EndpointStatus;

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
            inflight_at_scrape: None,
            role: Default::default(),
            poll_ms: 0,
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
        let names: Vec<&str> = headers_to_remove(&c.request()).collect();
        assert_eq!(
            names,
            vec![
                "x-gateway-destination-endpoint",
                "x-envoy-original-dst-host",
                "test-epp-endpoint-selection",
                "x-prefiller-host-port",
                "x-prefiller-url",
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
        assert_eq!(criticality_of(&c.request(), "base-a", "base-b"), Criticality::Critical);
        assert_eq!(criticality_of(&c.request(), "lora-a", "base-a"), Criticality::Critical);
        // An alias that is only a rewrite source: the criticality of where it is sent.
        assert_eq!(criticality_of(&c.request(), "alias", "base-b"), Criticality::Sheddable);
        // A discovered model nobody configured: Standard.
        assert_eq!(criticality_of(&c.request(), "found", "found"), Criticality::Standard);
    }

    #[test]
    fn prepare_resolves_route_rewrite_and_priority_without_picking() {
        let c = cfg();
        let sched = Scheduler::new(&c);
        let mut rng = SplitMix64::new(1);
        let body = br#"{"model":"base-a","prompt":"hi"}"#;
        // base-a is rewritten to base-b (group base-b), but keeps base-a's Critical priority (10).
        let p = prepare(&c.request(), &sched, &mut rng, &head(PriorityHeaders::default()), body, &snapshot())
            .unwrap();
        assert_eq!((p.route.base.as_str(), p.route.model_rewritten), ("base-b", true));
        assert_eq!(p.new_body.as_deref(), Some(&br#"{"model":"base-b","prompt":"hi"}"#[..]));
        assert_eq!((p.priority.priority, p.priority.source), (10, PrioritySource::Model));
        assert_eq!(p.priority.fairness_id, "default-flow");
        // A trusted objective wins over the model; the untrusted tier value was never read
        // (PriorityHeaders::read would not fill it), and here it is absent anyway.
        let h = PriorityHeaders { objective: Some("batch".into()), tier: None, fairness_id: None };
        let p = prepare(
            &c.request(),
            &sched,
            &mut rng,
            &head(h),
            br#"{"model":"alias","prompt":"x"}"#,
            &snapshot(),
        )
        .unwrap();
        assert_eq!((p.priority.priority, p.priority.source), (-20, PrioritySource::Objective));
        // Unknown model: 404 before any admission.
        let e = prepare(
            &c.request(),
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
        let p =
            prepare(&c.request(), &sched, &mut rng, &h, br#"{"model":"alias","prompt":"x"}"#, &snapshot())
                .unwrap();
        let store = MemStore::new();
        let counts = InflightCounts::default();
        let snap = snapshot();
        let health = HealthView::default();
        let inputs =
            PickState { snapshot: &snap, inflight: &counts, health: &health, store: &store, now_ms: 1100 };
        let pick = route(&c.request(), &mut sched, &mut rng, &h, &p, inputs).unwrap().pick;
        // Only 10.0.0.2 serves base-b; the target model is the rewrite's.
        assert_eq!((pick.primary.as_str(), pick.target_model.as_str()), ("10.0.0.2:8000", "base-b"));
        // on_body (prepare + route at once) agrees.
        let r = on_body(&c.request(), &mut sched, &mut rng, &h, br#"{"model":"alias","prompt":"x"}"#, inputs)
            .unwrap();
        assert_eq!((r.pick.primary.as_str(), r.requested_model.as_str()), ("10.0.0.2:8000", "alias"));
    }

    fn head_of(method: &str, path: &str) -> RequestHead {
        RequestHead { method: method.into(), path: path.into(), ..RequestHead::default() }
    }

    /// `on_head`, with the model list answered from an empty snapshot, as the host does.
    fn answer(c: &Config, h: &RequestHead, eos: bool) -> HeadDecision {
        match on_head(&c.request(), h, eos) {
            HeadDecision::Models { id } => models_reply(&c.request(), id.as_deref(), &Snapshot::default()),
            d => d,
        }
    }

    fn status(d: &HeadDecision) -> u32 {
        match d {
            HeadDecision::ReadBody | HeadDecision::PassThrough | HeadDecision::Models { .. } => 0,
            HeadDecision::Reject { rejection, .. } => rejection.status,
            HeadDecision::Local(r) => r.status,
        }
    }

    #[test]
    fn only_the_inference_paths_are_routed() {
        let c = cfg();
        for p in INFERENCE_PATHS {
            assert_eq!(on_head(&c.request(), &head_of("POST", p), false), HeadDecision::ReadBody, "{p}");
            // Query string and a trailing slash do not change the path.
            assert_eq!(
                on_head(&c.request(), &head_of("POST", &format!("{p}/?x=1")), false),
                HeadDecision::ReadBody
            );
            // A body is required.
            assert_eq!(status(&on_head(&c.request(), &head_of("POST", p), true)), 400);
            // Wrong method: 405 with an allow header.
            match on_head(&c.request(), &head_of("GET", p), true) {
                HeadDecision::Reject { rejection, allow } => {
                    assert_eq!(
                        (rejection.status, rejection.code, allow),
                        (405, "method_not_allowed", Some("POST, OPTIONS"))
                    );
                }
                d => panic!("{d:?}"),
            }
        }
        // Everything else: JSON 404, whatever the body would say (it is never read).
        for (m, p) in [
            ("POST", "/sim/reset-stats"),
            ("POST", "/v1/load_lora_adapter"),
            ("GET", "/metrics"),
            ("POST", "/v1/chat/completions-x"),
            ("POST", "/openai/v1/chat/completions"),
            ("GET", "/"),
            ("POST", ""),
        ] {
            let d = on_head(&c.request(), &head_of(m, p), false);
            match &d {
                HeadDecision::Reject { rejection, allow: None } => {
                    assert_eq!((rejection.status, rejection.code), (404, "not_found"), "{m} {p}")
                }
                d => panic!("{m} {p}: {d:?}"),
            }
        }
        // A content-length over the limit: 413 before the body.
        let mut h = head_of("POST", "/v1/completions");
        h.content_length = Some(c.filter.max_body_bytes as u64 + 1);
        assert_eq!(status(&on_head(&c.request(), &h, false)), 413);
    }

    #[test]
    fn models_health_and_preflight_are_answered_locally() {
        let c = cfg();
        let body = |d: HeadDecision| match d {
            HeadDecision::Local(r) => (r.status, serde_json::from_slice::<serde_json::Value>(&r.body).ok()),
            d => panic!("{d:?}"),
        };
        let (st, v) = body(answer(&c, &head_of("GET", "/v1/models"), true));
        assert_eq!(st, 200);
        let ids: Vec<_> = v.unwrap()["data"].as_array().unwrap().iter().map(|m| m["id"].clone()).collect();
        assert_eq!(ids, ["base-a", "lora-a", "base-b"]);
        // One model by id, percent-encoded or not; an adapter names its parent.
        let (st, v) = body(answer(&c, &head_of("GET", "/v1/models/lora-a"), true));
        assert_eq!((st, v.unwrap()["parent"].as_str()), (200, Some("base-a")));
        let (st, v) = body(answer(&c, &head_of("HEAD", "/v1/models/base%2Db"), true));
        assert_eq!((st, v.unwrap()["id"].as_str()), (200, Some("base-b")));
        match answer(&c, &head_of("GET", "/v1/models/nope"), true) {
            HeadDecision::Reject { rejection, .. } => {
                assert_eq!((rejection.status, rejection.code), (404, "model_not_found"))
            }
            d => panic!("{d:?}"),
        }
        assert_eq!(status(&on_head(&c.request(), &head_of("POST", "/v1/models"), false)), 405);
        for p in HEALTH_PATHS {
            let (st, v) = body(on_head(&c.request(), &head_of("GET", p), true));
            assert_eq!((st, v.unwrap()["status"].as_str()), (200, Some("ok")));
            assert_eq!(status(&on_head(&c.request(), &head_of("DELETE", p), true)), 405);
        }
        // Preflight on any path: 204, no CORS grant.
        for p in ["/v1/chat/completions", "/anything"] {
            match on_head(&c.request(), &head_of("OPTIONS", p), true) {
                HeadDecision::Local(r) => {
                    assert_eq!(r.status, 204);
                    assert!(r.body.is_empty());
                    assert!(r.headers.iter().all(|(k, _)| !k.starts_with("access-control")));
                    assert!(r.headers.iter().any(|(k, _)| *k == "allow"));
                }
                d => panic!("{d:?}"),
            }
        }
    }

    #[test]
    fn passthrough_prefixes_match_whole_segments_and_win_over_local_answers() {
        let mut c = cfg();
        c.filter.passthrough_prefixes = vec!["/admin".into(), "/v1/models".into(), "/static/".into()];
        for p in ["/admin", "/admin/", "/admin/x?y", "/v1/models", "/v1/models/x", "/static/a.js"] {
            assert_eq!(on_head(&c.request(), &head_of("GET", p), true), HeadDecision::PassThrough, "{p}");
        }
        assert_eq!(on_head(&c.request(), &head_of("OPTIONS", "/admin/x"), true), HeadDecision::PassThrough);
        for p in ["/administrator", "/static"] {
            assert_eq!(status(&on_head(&c.request(), &head_of("GET", p), true)), 404, "{p}");
        }
        // Inference paths are still routed.
        assert_eq!(on_head(&c.request(), &head_of("POST", "/v1/completions"), false), HeadDecision::ReadBody);
        assert!(prefix_matches("/v1/", "/v1/completions") && !prefix_matches("/v1/c", "/v1/completions"));
    }

    #[test]
    fn percent_decoding_keeps_bad_escapes() {
        assert_eq!(percent_decode("meta-llama%2FLlama"), "meta-llama/Llama");
        assert_eq!(percent_decode("a%zz%4"), "a%zz%4");
        assert_eq!(percent_decode("%ff"), "\u{fffd}");
        assert_eq!(clip(&"é".repeat(300)).chars().count(), 200);
    }

    #[test]
    fn model_list_adds_what_the_pods_report_only_with_pod_models_and_within_the_allow_list() {
        let snap = Snapshot {
            endpoints: vec![EndpointStatus {
                address: "10.0.0.1:8000".into(),
                models: vec!["base-a".into(), "runtime-lora".into()],
                ..Default::default()
            }],
            ..Default::default()
        };
        let ids = |c: &Config| -> Vec<String> {
            match models_reply(&c.request(), None, &snap) {
                HeadDecision::Local(r) => serde_json::from_slice::<serde_json::Value>(&r.body).unwrap()
                    ["data"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|m| m["id"].as_str().unwrap().to_string())
                    .collect(),
                d => panic!("{d:?}"),
            }
        };
        let mut c = cfg();
        assert_eq!(ids(&c), ["base-a", "lora-a", "base-b"]);
        c.pod_models = Some(crate::config::read_json("{}").unwrap());
        assert_eq!(ids(&c), ["base-a", "lora-a", "base-b", "runtime-lora"]);
        assert_eq!(status(&models_reply(&c.request(), Some("runtime-lora"), &snap)), 200);
        c.pod_models = Some(crate::config::read_json(r#"{"allow_list":true}"#).unwrap());
        assert_eq!(ids(&c), ["base-a", "lora-a", "base-b"]);
        assert_eq!(status(&models_reply(&c.request(), Some("runtime-lora"), &snap)), 404);
    }

    #[test]
    fn conformance_mode_reads_a_post_on_any_path_as_inference() {
        let mut c = cfg();
        assert_eq!(status(&on_head(&c.request(), &head_of("POST", "/primary-gateway-test"), false)), 404);
        c.filter.conformance_mode = true;
        assert_eq!(
            on_head(&c.request(), &head_of("POST", "/primary-gateway-test"), false),
            HeadDecision::ReadBody
        );
        assert_eq!(status(&on_head(&c.request(), &head_of("POST", "/primary-gateway-test"), true)), 400);
        // Other methods, health and the model list keep their answers.
        assert_eq!(status(&on_head(&c.request(), &head_of("GET", "/primary-gateway-test"), true)), 404);
        assert_eq!(status(&answer(&c, &head_of("GET", "/healthz"), true)), 200);
    }

    #[test]
    fn conformance_selection_is_read_only_in_conformance_mode() {
        let mut c = cfg();
        assert_eq!(conformance_selection(&c.request(), Some("10.0.0.1")), None);
        c.filter.conformance_mode = true;
        assert_eq!(conformance_selection(&c.request(), None), None);
        assert_eq!(conformance_selection(&c.request(), Some(" , ")), None);
        assert_eq!(
            conformance_selection(&c.request(), Some("10.0.0.1, 10.0.0.2:8000,")),
            Some(vec!["10.0.0.1".to_string(), "10.0.0.2:8000".to_string()])
        );
        let many = vec!["10.0.0.1"; 500].join(",");
        assert_eq!(
            conformance_selection(&c.request(), Some(&many)).map(|v| v.len()),
            Some(MAX_SELECTION_ENTRIES)
        );
        // The header is removed from every request, whatever the mode.
        assert!(headers_to_remove(&c.request()).any(|h| h == CONFORMANCE_SELECTION_HEADER));
    }

    #[test]
    fn selection_keeps_named_endpoints_a_bare_ip_covers_every_port() {
        let ep = |a: &str| EndpointStatus { address: a.into(), ..Default::default() };
        let snap = Snapshot {
            endpoints: vec![
                ep("10.0.0.1:3000"),
                ep("10.0.0.1:3002"),
                ep("10.0.0.2:3000"),
                ep("[fd00::1]:3000"),
            ],
            ..Default::default()
        };
        let addrs = |sel: &[&str]| -> Result<Vec<String>, u32> {
            let sel: Vec<String> = sel.iter().map(|s| s.to_string()).collect();
            restrict_to_selection(&snap, &sel)
                .map(|s| s.endpoints.into_iter().map(|e| e.address).collect())
                .map_err(|r| r.status)
        };
        assert_eq!(addrs(&["10.0.0.1"]), Ok(vec!["10.0.0.1:3000".into(), "10.0.0.1:3002".into()]));
        assert_eq!(
            addrs(&["10.0.0.1:3002", "10.0.0.2"]),
            Ok(vec!["10.0.0.1:3002".into(), "10.0.0.2:3000".into()])
        );
        assert_eq!(addrs(&["fd00::1"]), Ok(vec!["[fd00::1]:3000".into()]));
        assert_eq!(addrs(&["[fd00::1]:3000"]), Ok(vec!["[fd00::1]:3000".into()]));
        // Nothing matching (or garbage): 503, never a fall back to the whole pool.
        assert_eq!(addrs(&["10.0.0.9"]), Err(503));
        assert_eq!(addrs(&["10.0.0.1:9999", "pod-a"]), Err(503));
    }

    #[test]
    fn routing_honours_the_selection() {
        let c = cfg();
        let mut sched = Scheduler::new(&c);
        let mut rng = SplitMix64::new(3);
        let mut h = head(PriorityHeaders::default());
        // base-b is served only by 10.0.0.2; a selection naming 10.0.0.1 leaves nothing.
        let p =
            prepare(&c.request(), &sched, &mut rng, &h, br#"{"model":"alias","prompt":"x"}"#, &snapshot())
                .unwrap();
        let store = MemStore::new();
        let counts = InflightCounts::default();
        let snap = snapshot();
        let health = HealthView::default();
        let inputs =
            PickState { snapshot: &snap, inflight: &counts, health: &health, store: &store, now_ms: 1100 };
        h.test_selection = Some(vec!["10.0.0.1".into()]);
        assert_eq!(route(&c.request(), &mut sched, &mut rng, &h, &p, inputs).map_err(|r| r.status), Err(503));
        h.test_selection = Some(vec!["10.0.0.2:8000".into()]);
        assert_eq!(
            route(&c.request(), &mut sched, &mut rng, &h, &p, inputs).unwrap().pick.primary,
            "10.0.0.2:8000"
        );
    }
}
