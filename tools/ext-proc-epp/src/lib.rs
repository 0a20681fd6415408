//! A minimal endpoint picker behind Envoy's `ext_proc` filter, for `make bench-envoy`: the
//! architecture of the Gateway API Inference Extension's endpoint picker (EPP), a gRPC process
//! beside Envoy, measured side by side with the in-Envoy module.
//!
//! Envoy opens one `Process` stream per HTTP request and, configured as the benchmark does
//! (request headers SEND, request body BUFFERED, response headers SKIP, response body NONE),
//! sends the request's headers, then its whole body in one message. The picker answers CONTINUE
//! to the headers and, to the body, CONTINUE with a header mutation that sets
//! `x-gateway-destination-endpoint`; Envoy's `override_host` load-balancing policy then sends
//! the request to that address.
//!
//! Two pickers ([`Picker`]):
//! - [`RoundRobin`]: the floor of the architecture: read `model` from the JSON body, take the
//!   next endpoint of a fixed list.
//! - [`SchedPicker`]: inference-picker's own [`Scheduler`] (the module's decision, run natively),
//!   with the crate's own body parsing (`parse_request`) and a snapshot of the same endpoints,
//!   every one carrying the metrics parsed from the benchmark's `/metrics` body by the crate's
//!   own scrape code (`parse_metrics`).
//!
//! A body that is not a JSON object with a string `model` (or that the crate's parser refuses)
//! gets an `immediate_response` with the status and OpenAI-style JSON error of
//! [`Rejection::body`]: the request never reaches a pod. Nothing here panics on input.

use std::borrow::Cow;

use envoy_types::pb::envoy::config::core::v3::{header_value_option, HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    common_response, processing_request, processing_response, BodyResponse, CommonResponse, HeaderMutation,
    HeadersResponse, HttpHeaders, ImmediateResponse, ProcessingRequest, ProcessingResponse, TrailersResponse,
};
use inference_picker::base::errors::Rejection;
use inference_picker::base::ports::{MemStore, SplitMix64};
use inference_picker::config::Config;
use inference_picker::poll::scrape::engine::parse_metrics;
use inference_picker::request::body::parse_request;
use inference_picker::scheduler::{PickInput, PickRequest, PickState, Scheduler};
use inference_picker::state::health::HealthView;
use inference_picker::state::inflight::InflightCounts;
use inference_picker::state::snapshot::{EndpointStatus, Snapshot};

/// The header Envoy's `override_host` policy reads (GIE's destination header).
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The path assumed when the request headers named none.
pub const DEFAULT_PATH: &str = "/v1/chat/completions";
/// How often the scheduler's snapshot is marked freshly scraped (ms): what a poller publishing at
/// the module's default interval (200 ms) would do; the metrics themselves never change.
pub const REFRESH_MS: u64 = 100;

fn bad_request(code: &'static str, message: impl Into<String>) -> Rejection {
    Rejection::new(400, "invalid_request_error", code, message)
}

/// The `model` of an OpenAI-style JSON body (the round-robin picker reads nothing else). The
/// rest of the body is checked to be JSON but not kept.
pub fn extract_model(body: &[u8]) -> Result<String, Rejection> {
    #[derive(serde::Deserialize)]
    struct Only<'a> {
        #[serde(borrow, default)]
        model: Option<Cow<'a, str>>,
    }
    let doc: Only<'_> = serde_json::from_slice(body).map_err(|e| {
        bad_request("invalid_json", format!("request body is not a JSON object with a string \"model\": {e}"))
    })?;
    match doc.model {
        Some(m) if !m.trim().is_empty() => Ok(m.into_owned()),
        Some(_) => Err(bad_request("missing_model", "\"model\" is empty")),
        None => Err(bad_request("missing_model", "request body has no \"model\" field")),
    }
}

/// The endpoints in turn.
#[derive(Debug, Clone)]
pub struct RoundRobin {
    endpoints: Vec<String>,
    next: usize,
}

impl RoundRobin {
    /// `None` for an empty list.
    pub fn new(endpoints: Vec<String>) -> Option<Self> {
        (!endpoints.is_empty()).then_some(Self { endpoints, next: 0 })
    }

    pub fn pick(&mut self) -> &str {
        let i = self.next % self.endpoints.len();
        self.next = (i + 1) % self.endpoints.len();
        &self.endpoints[i]
    }
}

/// The module's decision as an EPP: [`Scheduler::pick`] over a snapshot of the endpoints.
pub struct SchedPicker {
    sched: Scheduler,
    snap: Snapshot,
    inflight: InflightCounts,
    health: HealthView,
    store: MemStore,
    rng: SplitMix64,
}

impl SchedPicker {
    /// A scheduler configured like the module in the benchmark (only `version`, `endpoints`
    /// and `models` set, so the shipped defaults), and a snapshot in which every endpoint serves
    /// `model` and reports the metrics parsed from `metrics_text`.
    pub fn new(endpoints: &[String], model: &str, metrics_text: &str, now_ms: u64) -> Result<Self, String> {
        if endpoints.is_empty() {
            return Err("no endpoints".into());
        }
        let cfg = serde_json::json!({
            "version": 1,
            "endpoints": endpoints.iter().map(|a| serde_json::json!({"address": a, "models": [model]})).collect::<Vec<_>>(),
            "models": [{"name": model}],
        });
        let cfg = Config::from_json(cfg.to_string().as_bytes())
            .map_err(|errs| errs.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))?;
        let metrics = parse_metrics(metrics_text).map_err(|e| format!("metrics: {e:?}"))?;
        let snap = Snapshot {
            version: 1,
            published_ms: now_ms,
            endpoints: endpoints
                .iter()
                .map(|a| EndpointStatus {
                    address: a.clone(),
                    models: vec![model.to_string()],
                    metrics: Some(metrics.clone()),
                    scraped_ms: now_ms,
                    failures: 0,
                    inflight_at_scrape: Some(0),
                    role: Default::default(),
                    poll_ms: 200,
                })
                .collect(),
        };
        Ok(Self {
            sched: Scheduler::new(&cfg),
            snap,
            inflight: InflightCounts::default(),
            health: HealthView::default(),
            store: MemStore::new(),
            rng: SplitMix64::new(1),
        })
    }

    /// The `x-gateway-destination-endpoint` value for one request (primary, then fallbacks),
    /// or the module's rejection. The request ends at once for the scheduler
    /// ([`Scheduler::request_done`]): with response headers skipped, the EPP never sees it end.
    pub fn pick(&mut self, path: &str, body: &[u8], now_ms: u64) -> Result<String, Rejection> {
        if now_ms >= self.snap.published_ms.saturating_add(REFRESH_MS) {
            self.snap.version += 1;
            self.snap.published_ms = now_ms;
            for e in &mut self.snap.endpoints {
                e.scraped_ms = now_ms;
            }
        }
        let p = parse_request(path, body)?;
        let request = PickRequest {
            model: &p.model,
            prompt: &p.prompt,
            cache_salt: p.cache_salt.as_deref(),
            session_id: None,
            session_token: None,
            slo: None,
        };
        let route = self.sched.route_model(request.model, None, &self.snap, &mut self.rng)?;
        let state = PickState {
            snapshot: &self.snap,
            inflight: &self.inflight,
            health: &self.health,
            store: &self.store,
            now_ms,
        };
        let pick = self.sched.pick(PickInput {
            route: &route,
            request,
            state,
            scope: Default::default(),
            rng: &mut self.rng,
        })?;
        self.sched.request_done(pick.ticket);
        Ok(pick.destination_header())
    }
}

/// One of the two pickers.
pub enum Picker {
    Rr(RoundRobin),
    Sched(Box<SchedPicker>),
}

impl Picker {
    /// The answer to the request's (whole) body.
    pub fn decide(&mut self, path: &str, body: &[u8], now_ms: u64) -> ProcessingResponse {
        let dest = match self {
            Picker::Rr(rr) => extract_model(body).map(|_| rr.pick().to_string()),
            Picker::Sched(s) => s.pick(path, body, now_ms),
        };
        match dest {
            Ok(d) => route_to(&d),
            Err(r) => reject(&r),
        }
    }
}

/// Sets (overwrites) `x-gateway-destination-endpoint: value`.
pub fn destination_mutation(value: &str) -> HeaderMutation {
    HeaderMutation {
        set_headers: vec![HeaderValueOption {
            header: Some(HeaderValue {
                key: DESTINATION_HEADER.to_string(),
                value: String::new(),
                raw_value: value.as_bytes().to_vec(),
            }),
            append_action: header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
            ..Default::default()
        }],
        remove_headers: vec![],
    }
}

fn continue_common(header_mutation: Option<HeaderMutation>) -> Option<CommonResponse> {
    Some(CommonResponse {
        status: common_response::ResponseStatus::Continue as i32,
        header_mutation,
        ..Default::default()
    })
}

fn response(r: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse { response: Some(r), ..Default::default() }
}

/// CONTINUE on the request headers.
pub fn continue_request_headers() -> ProcessingResponse {
    response(processing_response::Response::RequestHeaders(HeadersResponse {
        response: continue_common(None),
    }))
}

/// CONTINUE on the request body, with the destination header set.
pub fn route_to(dest: &str) -> ProcessingResponse {
    response(processing_response::Response::RequestBody(BodyResponse {
        response: continue_common(Some(destination_mutation(dest))),
    }))
}

/// The request answered at once with the rejection's status and OpenAI-style JSON error.
pub fn reject(r: &Rejection) -> ProcessingResponse {
    response(processing_response::Response::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus { code: i32::try_from(r.status).unwrap_or(500) }),
        headers: Some(HeaderMutation {
            set_headers: vec![HeaderValueOption {
                header: Some(HeaderValue {
                    key: "content-type".into(),
                    value: String::new(),
                    raw_value: b"application/json".to_vec(),
                }),
                ..Default::default()
            }],
            remove_headers: vec![],
        }),
        body: r.body(),
        details: format!("ext_proc_epp_{}", r.code),
        ..Default::default()
    }))
}

/// A header's value as Envoy sent it (`raw_value`, or `value` from older Envoys).
pub fn header(headers: &HttpHeaders, name: &str) -> Option<String> {
    let map = headers.headers.as_ref()?;
    let h = map.headers.iter().find(|h| h.key.eq_ignore_ascii_case(name))?;
    if h.raw_value.is_empty() {
        Some(h.value.clone())
    } else {
        Some(String::from_utf8_lossy(&h.raw_value).into_owned())
    }
}

/// What one `Process` stream (one HTTP request) has seen so far.
#[derive(Debug, Default)]
pub struct StreamState {
    path: Option<String>,
    body: Vec<u8>,
}

/// The answer to one message of a stream; `None` for a message that takes none (an empty one).
/// Body chunks before the last (not sent in BUFFERED mode) are kept and answered CONTINUE;
/// the last one gets the decision over the whole body.
pub fn handle(
    picker: &mut Picker,
    st: &mut StreamState,
    req: ProcessingRequest,
    now_ms: u64,
) -> Option<ProcessingResponse> {
    use processing_request::Request as Rq;
    use processing_response::Response as Rs;
    match req.request? {
        Rq::RequestHeaders(h) => {
            st.path = header(&h, ":path");
            Some(continue_request_headers())
        }
        Rq::RequestBody(b) => {
            if !b.end_of_stream {
                st.body.extend_from_slice(&b.body);
                return Some(response(Rs::RequestBody(BodyResponse { response: continue_common(None) })));
            }
            let path = st.path.as_deref().unwrap_or(DEFAULT_PATH);
            let path = path.split('?').next().unwrap_or(path).to_string();
            if st.body.is_empty() {
                Some(picker.decide(&path, &b.body, now_ms))
            } else {
                st.body.extend_from_slice(&b.body);
                let body = std::mem::take(&mut st.body);
                Some(picker.decide(&path, &body, now_ms))
            }
        }
        Rq::ResponseHeaders(_) => {
            Some(response(Rs::ResponseHeaders(HeadersResponse { response: continue_common(None) })))
        }
        Rq::ResponseBody(_) => {
            Some(response(Rs::ResponseBody(BodyResponse { response: continue_common(None) })))
        }
        Rq::RequestTrailers(_) => Some(response(Rs::RequestTrailers(TrailersResponse::default()))),
        Rq::ResponseTrailers(_) => Some(response(Rs::ResponseTrailers(TrailersResponse::default()))),
    }
}

#[cfg(test)]
mod tests;
