//! The request head: what the filter reads from the request headers ([`RequestHead`]), the
//! headers it removes before the request can go upstream ([`headers_to_remove`]), and what it
//! decides on them ([`on_head`] and its path policy, [`HeadDecision`]): read the body, answer
//! locally, reject, or let the request through. Also the conformance suite's endpoint selection
//! and the 413 for a body over the limit.

use crate::base::errors::{ErrorShape, Rejection};
use crate::flow::priority::{self, PriorityHeaders};
use crate::request::config::Settings;
use crate::request::protocol::{
    error_shape, is_count_tokens, prefix_matches, route_path, CLIENT_ROUTING_HEADERS,
    CONFORMANCE_SELECTION_HEADER, HEALTH_PATHS, MAX_SELECTION_ENTRIES, MODELS_PATH, ROUTED_PATHS,
};
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

impl RequestHead {
    /// The shape of every error the filter answers this request with (`protocol::error_shape`:
    /// Anthropic's on `/v1/messages`, OpenAI's elsewhere).
    pub fn error_shape(&self) -> ErrorShape {
        error_shape(&self.path)
    }

    /// An Anthropic token count (`protocol::COUNT_TOKENS_PATH`): routed, but not a generation
    /// (`crate::request::pipeline::route_token_count`).
    pub fn is_count_tokens(&self) -> bool {
        is_count_tokens(&self.path)
    }
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
    pub(super) fn json(status: u32, body: Vec<u8>) -> Self {
        LocalReply { status, headers: vec![("content-type", "application/json".into())], body }
    }
}

/// Decision after the request headers.
#[derive(Debug, Clone, PartialEq)]
pub enum HeadDecision {
    /// `GET`/`HEAD /v1/models` (`id: None`) or `/v1/models/{id}`: answer with
    /// [`models_reply`](super::models_reply), which needs the snapshot (the models the pods reported).
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
    pub(super) fn reject(rejection: Rejection) -> Self {
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
pub(super) fn clip(s: &str) -> &str {
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
/// 3. a routed path ([`ROUTED_PATHS`]: the inference paths and Anthropic's token count): `POST`
///    reads the body; any other method 405;
/// 4. `GET`/`HEAD /v1/models` (the list) and `/v1/models/{id}` (one model, or 404
///    `model_not_found`), answered locally; other methods 405;
/// 5. `GET`/`HEAD` on a health path ([`HEALTH_PATHS`]): 200 `{"status":"ok"}`; other methods 405;
/// 6. in conformance mode (`filter.conformance_mode`), a `POST` on any other path is an
///    inference request (the GIE suite uses paths of its own);
/// 7. anything else: 404 `not_found` JSON. Nothing reaches a pod unless the filter picked it.
pub fn on_head(cfg: &Settings<'_>, head: &RequestHead, end_of_stream: bool) -> HeadDecision {
    let raw = head.path.split(['?', '#']).next().unwrap_or("");
    let path = route_path(&head.path);
    let method = head.method.as_str();
    if cfg.filter.passthrough_prefixes.iter().any(|p| prefix_matches(p, raw) || prefix_matches(p, path)) {
        return HeadDecision::PassThrough;
    }
    if method == "OPTIONS" {
        let allow = if ROUTED_PATHS.contains(&path) { "POST, OPTIONS" } else { "GET, HEAD, OPTIONS" };
        return HeadDecision::Local(LocalReply {
            status: 204,
            headers: vec![("allow", allow.into())],
            body: Vec::new(),
        });
    }
    if ROUTED_PATHS.contains(&path) {
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
            ROUTED_PATHS.join(", "),
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
    // A trusted latency-target header that is not a number of milliseconds: 400 before the body.
    if let Err(r) = head.priority.slo.parse(&cfg.priority.slo) {
        return HeadDecision::reject(r);
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
#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::request::models::models_reply;
    use crate::request::tests_support::{cfg, status};
    use crate::state::snapshot::EndpointStatus;

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
                // The latency-target headers, untrusted by default: removed.
                "x-slo-ttft-ms",
                "x-slo-tpot-ms",
                // Configured but untrusted: still removed.
                "x-llm-tier",
            ]
        );
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

    #[test]
    fn only_the_routed_paths_are_routed() {
        let c = cfg();
        for p in ROUTED_PATHS {
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
            ("POST", "/v1/messages/batches"),
            ("POST", "/v1/messages/count_tokens/x"),
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
        // The token count is routed unless a prefix names it (configurations that sent it to a
        // backend of their own keep doing so).
        let count = head_of("POST", "/v1/messages/count_tokens");
        assert_eq!(on_head(&c.request(), &count, false), HeadDecision::ReadBody);
        c.filter.passthrough_prefixes.push("/v1/messages/count_tokens".into());
        assert_eq!(on_head(&c.request(), &count, false), HeadDecision::PassThrough);
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
}

#[cfg(test)]
mod slo_header_tests {
    use super::*;
    use crate::config::Config;
    use crate::flow::priority::PriorityHeaders;

    fn cfg(trusted: bool) -> Config {
        let doc = format!(
            r#"{{"version":1,"endpoints":[{{"address":"10.0.0.1:8000","models":["m"]}}],
                "models":[{{"name":"m"}}],"priority":{{"slo":{{"trust_headers":{trusted}}}}}}}"#
        );
        Config::from_json(doc.as_bytes()).unwrap()
    }

    fn post(c: &Config, ttft: &'static str) -> HeadDecision {
        let get = |n: &str| (n == "x-slo-ttft-ms").then(|| ttft.to_string());
        let head = RequestHead {
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            priority: PriorityHeaders::read(&c.priority, &get),
            ..RequestHead::default()
        };
        on_head(&c.request(), &head, false)
    }

    #[test]
    fn a_trusted_target_header_that_is_not_milliseconds_is_a_400_before_the_body() {
        let c = cfg(true);
        assert_eq!(post(&c, "250"), HeadDecision::ReadBody);
        match post(&c, "soon") {
            HeadDecision::Reject { rejection: r, .. } => {
                assert_eq!((r.status, r.code), (400, "invalid_slo_header"))
            }
            other => panic!("{other:?}"),
        }
        // Untrusted, the same value is never read: the request goes on (the header is stripped).
        assert_eq!(post(&cfg(false), "soon"), HeadDecision::ReadBody);
    }
}
