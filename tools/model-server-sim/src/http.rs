//! The HTTP shell: runs the pure [`Server`] model in real time behind an OpenAI-compatible API.
//!
//! Model time is wall-clock milliseconds since the shell started. A background task (see
//! [`engine_loop`]) advances the model to "now", hands every event to the request that owns it,
//! and sleeps until the model's next wakeup or until a new request arrives. Handlers only submit
//! requests and wait on a per-request channel, so every response is paced by the model.
//!
//! Endpoints are listed in the crate README. Every response carries `x-sim-server: <name>`, and
//! every inference JSON body (and every stream chunk) carries `"served_by": "<name>"`.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::stream::{self, Stream};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

use crate::model::{Event, MetricsSnapshot, Server, ServerConfig, SimRequest, SubmitError};
use crate::prompt;
use crate::render::{render_metrics, Engine, LoraInfoHistory, RenderInfo};

/// Response header naming the server that answered.
pub const SERVER_HEADER: &str = "x-sim-server";

/// Largest request body accepted (the default axum limit of 2 MiB is too small for the longest
/// prompts the trace replays use).
const BODY_LIMIT: usize = 16 * 1024 * 1024;

/// Filler words for generated text: output token i is word i (mod the list).
const WORDS: [&str; 16] = [
    "lorem",
    "ipsum",
    "dolor",
    "sit",
    "amet",
    "consectetur",
    "adipiscing",
    "elit",
    "sed",
    "do",
    "eiusmod",
    "tempor",
    "incididunt",
    "ut",
    "labore",
    "et",
];

/// Everything the shell needs besides the model's own configuration.
#[derive(Debug, Clone)]
pub struct ShellConfig {
    /// Value of `x-sim-server` and `served_by`.
    pub name: String,
    /// Served base model names (the first is the `model_name` metrics label).
    pub models: Vec<String>,
    /// Served LoRA adapter names.
    pub loras: Vec<String>,
    /// Metric names on /metrics.
    pub engine: Engine,
    /// Output tokens when the request sets neither `max_tokens` nor `max_completion_tokens`.
    pub default_max_tokens: u32,
    /// Largest prompt + output, in tokens; longer requests get 400 like vLLM.
    pub max_model_len: u32,
}

/// Artificial load added to /metrics (POST /sim/fake-load): makes a server look busy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FakeLoad {
    /// Added to the waiting-queue gauge.
    #[serde(default)]
    pub queue: u64,
    /// Added to the KV-usage gauge (the sum is capped at 1.0). Must be in [0, 1].
    #[serde(default)]
    pub kv: f64,
    /// Added to the running gauge.
    #[serde(default)]
    pub running: u64,
}

#[derive(Debug, Clone, Default, Serialize)]
struct Stats {
    requests_total: u64,
    requests_by_model: BTreeMap<String, u64>,
    metrics_scrapes_total: u64,
    last_request_headers: BTreeMap<String, String>,
    last_request_model: Option<String>,
}

/// The model plus the channels of the requests it is serving.
struct Core {
    server: Server,
    streams: HashMap<u64, mpsc::UnboundedSender<Event>>,
    lora_history: LoraInfoHistory,
}

/// Shared state of the shell.
pub struct AppState {
    cfg: ShellConfig,
    core: Mutex<Core>,
    wake: Notify,
    t0: Instant,
    started_unix_s: f64,
    next_id: AtomicU64,
    stats: Mutex<Stats>,
    fake: Mutex<FakeLoad>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a lock cannot leave these structures half-updated in a way that
    // matters more than stopping the simulator would, so keep serving.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Wall-clock unix time in seconds. The one place the shell reads the system clock.
#[allow(clippy::disallowed_methods)] // the shell maps wall time onto the pure model
fn unix_now_s() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

impl AppState {
    /// Build the state; the model starts at virtual time 0 = now.
    pub fn new(cfg: ShellConfig, model_cfg: ServerConfig) -> Result<Arc<AppState>, String> {
        let server = Server::new(model_cfg).map_err(|e| e.to_string())?;
        HeaderValue::from_str(&cfg.name)
            .map_err(|_| format!("--name {:?} is not a valid header value", cfg.name))?;
        if cfg.models.is_empty() {
            return Err("at least one --model is required".into());
        }
        Ok(Arc::new(AppState {
            cfg,
            core: Mutex::new(Core {
                server,
                streams: HashMap::new(),
                lora_history: LoraInfoHistory::new(32),
            }),
            wake: Notify::new(),
            t0: Instant::now(),
            started_unix_s: unix_now_s(),
            next_id: AtomicU64::new(1),
            stats: Mutex::new(Stats::default()),
            fake: Mutex::new(FakeLoad::default()),
        }))
    }

    fn now_ms(&self) -> f64 {
        self.t0.elapsed().as_secs_f64() * 1000.0
    }

    /// Advance the model to now and deliver its events. Returns the next wakeup (model ms).
    fn pump(&self) -> Option<f64> {
        let now = self.now_ms();
        let mut core = lock(&self.core);
        let events = core.server.advance_to(now);
        for ev in events {
            let id = ev.id();
            let last = matches!(ev, Event::Finished { .. } | Event::Rejected { .. });
            let delivered = core.streams.get(&id).is_some_and(|tx| tx.send(ev).is_ok());
            if !delivered {
                // Nobody is listening any more (client gone): stop spending the GPU on it.
                core.streams.remove(&id);
                core.server.abort(id);
            } else if last {
                core.streams.remove(&id);
            }
        }
        core.server.next_wakeup()
    }

    fn snapshot(&self) -> MetricsSnapshot {
        self.pump();
        lock(&self.core).server.metrics_snapshot()
    }
}

/// The background task that runs the model in real time. Never returns.
pub async fn engine_loop(state: Arc<AppState>) {
    loop {
        match state.pump() {
            Some(t_ms) => {
                let deadline = state.t0 + Duration::from_secs_f64((t_ms / 1000.0).max(0.0));
                tokio::select! {
                    _ = tokio::time::sleep_until(deadline) => {}
                    _ = state.wake.notified() => {}
                }
            }
            None => state.wake.notified().await,
        }
    }
}

/// The router with every endpoint and the `x-sim-server` header on every response.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(list_models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/sim/stats", get(sim_stats))
        .route("/sim/fake-load", post(sim_fake_load))
        .route("/sim/reset-stats", post(sim_reset_stats))
        .fallback(not_found)
        .layer(axum::middleware::map_response_with_state(state.clone(), add_server_header))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(state)
}

async fn add_server_header(State(st): State<Arc<AppState>>, mut resp: Response) -> Response {
    if let Ok(v) = HeaderValue::from_str(&st.cfg.name) {
        resp.headers_mut().insert(HeaderName::from_static(SERVER_HEADER), v);
    }
    resp
}

/// An OpenAI-style error response, as vLLM sends it.
fn error_response(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body = json!({
        "error": {
            "message": message.into(),
            "type": kind,
            "param": null,
            "code": status.as_u16(),
        }
    });
    (status, axum::Json(body)).into_response()
}

fn bad_request(message: impl Into<String>) -> Response {
    error_response(StatusCode::BAD_REQUEST, "BadRequestError", message)
}

async fn not_found() -> Response {
    error_response(StatusCode::NOT_FOUND, "NotFoundError", "Not Found")
}

async fn health() -> Response {
    StatusCode::OK.into_response()
}

async fn list_models(State(st): State<Arc<AppState>>) -> Response {
    let created = st.started_unix_s as u64;
    let base = st.cfg.models.first().cloned().unwrap_or_default();
    let mut data: Vec<Value> = st
        .cfg
        .models
        .iter()
        .map(|m| {
            json!({
                "id": m, "object": "model", "created": created, "owned_by": "vllm",
                "root": m, "parent": null, "max_model_len": st.cfg.max_model_len, "permission": [],
            })
        })
        .collect();
    data.extend(st.cfg.loras.iter().map(|l| {
        json!({
            "id": l, "object": "model", "created": created, "owned_by": "vllm",
            "root": l, "parent": base, "max_model_len": null, "permission": [],
        })
    }));
    axum::Json(json!({ "object": "list", "data": data })).into_response()
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let mut snap = st.snapshot();
    let fake = *lock(&st.fake);
    snap.waiting += fake.queue;
    snap.running += fake.running;
    snap.kv_usage = (snap.kv_usage + fake.kv).min(1.0);
    lock(&st.stats).metrics_scrapes_total += 1;
    let now = unix_now_s();
    let model_name = st.cfg.models.first().map(String::as_str).unwrap_or("");
    let text = {
        let mut core = lock(&st.core);
        core.lora_history.record(&snap, now);
        let info = RenderInfo {
            model_name,
            unix_now_s: now,
            created_unix_s: st.started_unix_s,
            lora_history: Some(&core.lora_history),
        };
        render_metrics(st.cfg.engine, &snap, &info)
    };
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

async fn sim_stats(State(st): State<Arc<AppState>>) -> Response {
    let snap = st.snapshot();
    let stats = lock(&st.stats).clone();
    let fake = *lock(&st.fake);
    let mut body = match serde_json::to_value(&stats) {
        Ok(Value::Object(m)) => m,
        _ => Map::new(),
    };
    body.insert("name".into(), json!(st.cfg.name));
    body.insert("engine".into(), json!(st.cfg.engine.as_str()));
    body.insert("fake_load".into(), json!(fake));
    body.insert("model".into(), serde_json::to_value(&snap).unwrap_or(Value::Null));
    axum::Json(Value::Object(body)).into_response()
}

async fn sim_fake_load(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let load: FakeLoad = if body.iter().all(u8::is_ascii_whitespace) {
        FakeLoad::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(l) => l,
            Err(e) => return bad_request(format!("invalid fake-load JSON: {e}")),
        }
    };
    if !(load.kv.is_finite() && (0.0..=1.0).contains(&load.kv)) {
        return bad_request(format!("kv must be in [0, 1], got {}", load.kv));
    }
    *lock(&st.fake) = load;
    axum::Json(json!({ "fake_load": load })).into_response()
}

async fn sim_reset_stats(State(st): State<Arc<AppState>>) -> Response {
    *lock(&st.stats) = Stats::default();
    axum::Json(json!({ "reset": true })).into_response()
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Api {
    Chat,
    Completion,
}

async fn chat_completions(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    inference(st, Api::Chat, headers, body).await
}

async fn completions(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    inference(st, Api::Completion, headers, body).await
}

fn headers_map(headers: &HeaderMap) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    for (k, v) in headers {
        let v = String::from_utf8_lossy(v.as_bytes()).into_owned();
        out.entry(k.as_str().to_string())
            .and_modify(|e| {
                e.push_str(", ");
                e.push_str(&v);
            })
            .or_insert(v);
    }
    out
}

/// What a parsed inference request asks for.
#[derive(Debug)]
struct Parsed {
    model: String,
    prompt_tokens: u32,
    hashes: Vec<u64>,
    max_tokens: u32,
    stream: bool,
    include_usage: bool,
}

/// Parse and validate an inference body. Errors are messages for a 400 response.
fn parse_request(st: &AppState, api: Api, v: &Value) -> Result<Parsed, String> {
    let obj = v.as_object().ok_or_else(|| "request body must be a JSON object".to_string())?;
    let model = obj
        .get("model")
        .and_then(Value::as_str)
        .ok_or_else(|| "missing or non-string field `model`".to_string())?
        .to_string();
    let block = st.block_size();
    let (prompt_tokens, hashes) = match api {
        Api::Chat => {
            let text = chat_prompt_text(obj.get("messages"))?;
            (prompt::estimate_tokens(&text), prompt::block_hashes(&text, block))
        }
        Api::Completion => match obj.get("prompt") {
            Some(Value::String(s)) => (prompt::estimate_tokens(s), prompt::block_hashes(s, block)),
            Some(Value::Array(items)) if items.len() == 1 && items.iter().all(Value::is_string) => {
                let s = items.first().and_then(Value::as_str).unwrap_or("");
                (prompt::estimate_tokens(s), prompt::block_hashes(s, block))
            }
            Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_u64) => {
                let ids: Vec<u32> = items.iter().filter_map(Value::as_u64).map(|x| x as u32).collect();
                (u32::try_from(ids.len()).unwrap_or(u32::MAX), prompt::block_hashes_from_ids(&ids, block))
            }
            Some(Value::Array(_)) => {
                return Err("`prompt` must be a string, a list with one string, or a list of token ids \
                     (batched prompts are not simulated)"
                    .to_string())
            }
            _ => return Err("missing or invalid field `prompt`".to_string()),
        },
    };
    let max_tokens = match obj.get("max_completion_tokens").or_else(|| obj.get("max_tokens")) {
        None | Some(Value::Null) => st.cfg.default_max_tokens,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => u32::try_from(n).unwrap_or(u32::MAX),
            _ => return Err(format!("max_tokens must be at least 1, got {v}")),
        },
    };
    match obj.get("n") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_u64() == Some(1) => {}
        Some(v) => return Err(format!("only n = 1 is simulated, got {v}")),
    }
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(format!("`stream` must be a boolean, got {v}")),
    };
    let include_usage = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(Parsed { model, prompt_tokens, hashes, max_tokens, stream, include_usage })
}

/// The text a chat template would produce, roughly: "role: content" per message.
fn chat_prompt_text(messages: Option<&Value>) -> Result<String, String> {
    let Some(Value::Array(msgs)) = messages else {
        return Err("missing or non-array field `messages`".to_string());
    };
    if msgs.is_empty() {
        return Err("`messages` must not be empty".to_string());
    }
    let mut text = String::new();
    for (i, m) in msgs.iter().enumerate() {
        let role =
            m.get("role").and_then(Value::as_str).ok_or_else(|| format!("messages[{i}].role is missing"))?;
        text.push_str(role);
        text.push_str(": ");
        match m.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => text.push_str(s),
            Some(Value::Array(parts)) => {
                for p in parts {
                    if let Some(t) = p.get("text").and_then(Value::as_str) {
                        text.push_str(t);
                    }
                }
            }
            Some(_) => return Err(format!("messages[{i}].content must be a string or a list")),
        }
        text.push('\n');
    }
    Ok(text)
}

impl AppState {
    fn block_size(&self) -> u32 {
        lock(&self.core).server.config().block_size
    }
}

/// Aborts the model request if the response is dropped before it finished (client went away).
struct AbortGuard {
    state: Arc<AppState>,
    id: u64,
    armed: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if self.armed {
            let mut core = lock(&self.state.core);
            core.streams.remove(&self.id);
            core.server.abort(self.id);
        }
    }
}

async fn inference(st: Arc<AppState>, api: Api, headers: HeaderMap, body: Bytes) -> Response {
    {
        let mut s = lock(&st.stats);
        s.requests_total += 1;
        s.last_request_headers = headers_map(&headers);
        s.last_request_model = None;
    }
    let value: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return bad_request(format!("invalid JSON body: {e}")),
    };
    if let Some(m) = value.get("model").and_then(Value::as_str) {
        let mut s = lock(&st.stats);
        s.last_request_model = Some(m.to_string());
        *s.requests_by_model.entry(m.to_string()).or_insert(0) += 1;
    }
    let p = match parse_request(&st, api, &value) {
        Ok(p) => p,
        Err(m) => return bad_request(m),
    };
    let adapter = if st.cfg.models.contains(&p.model) {
        None
    } else if st.cfg.loras.contains(&p.model) {
        Some(p.model.clone())
    } else {
        return error_response(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("The model `{}` does not exist.", p.model),
        );
    };
    let total = u64::from(p.prompt_tokens) + u64::from(p.max_tokens);
    if total > u64::from(st.cfg.max_model_len) {
        return bad_request(format!(
            "This model's maximum context length is {} tokens. However, you requested {} tokens \
             ({} in the messages, {} in the completion). Please reduce the length of the messages \
             or completion.",
            st.cfg.max_model_len, total, p.prompt_tokens, p.max_tokens
        ));
    }

    let id = st.next_id.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = mpsc::unbounded_channel();
    let submitted = {
        let now = st.now_ms();
        let mut core = lock(&st.core);
        let r = core.server.submit(SimRequest {
            id,
            prompt_tokens: p.prompt_tokens,
            block_hashes: p.hashes.clone(),
            output_tokens: p.max_tokens,
            adapter,
            arrival_ms: now,
        });
        if r.is_ok() {
            core.streams.insert(id, tx);
        }
        r
    };
    if let Err(e) = submitted {
        return match e {
            SubmitError::TooLarge { .. } => bad_request(format!("request cannot fit in the KV cache: {e}")),
            _ => error_response(StatusCode::INTERNAL_SERVER_ERROR, "InternalServerError", e.to_string()),
        };
    }
    st.wake.notify_one();

    let reply = Reply {
        api,
        id: format!("{}-sim{id:016x}", if api == Api::Chat { "chatcmpl" } else { "cmpl" }),
        created: unix_now_s() as u64,
        model: p.model,
        served_by: st.cfg.name.clone(),
        prompt_tokens: p.prompt_tokens,
        output_tokens: p.max_tokens,
        include_usage: p.include_usage,
    };
    let guard = AbortGuard { state: st.clone(), id, armed: true };
    if p.stream {
        Sse::new(sse_stream(reply, rx, guard)).into_response()
    } else {
        wait_for_completion(reply, rx, guard).await
    }
}

async fn wait_for_completion(
    reply: Reply,
    mut rx: mpsc::UnboundedReceiver<Event>,
    mut guard: AbortGuard,
) -> Response {
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Finished { cached_tokens, .. } => {
                guard.armed = false;
                return axum::Json(reply.full_response(cached_tokens)).into_response();
            }
            Event::Rejected { .. } => {
                guard.armed = false;
                return error_response(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalServerError",
                    "the simulated engine could not schedule the request",
                );
            }
            _ => {}
        }
    }
    guard.armed = false;
    error_response(StatusCode::INTERNAL_SERVER_ERROR, "InternalServerError", "engine stopped")
}

struct StreamState {
    reply: Reply,
    rx: mpsc::UnboundedReceiver<Event>,
    guard: AbortGuard,
    queued: std::collections::VecDeque<String>,
    done: bool,
}

fn sse_stream(
    reply: Reply,
    rx: mpsc::UnboundedReceiver<Event>,
    guard: AbortGuard,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let init = StreamState { reply, rx, guard, queued: Default::default(), done: false };
    stream::unfold(init, |mut s| async move {
        loop {
            if let Some(data) = s.queued.pop_front() {
                return Some((Ok(SseEvent::default().data(data)), s));
            }
            if s.done {
                return None;
            }
            match s.rx.recv().await {
                Some(Event::FirstToken { .. }) => {
                    if s.reply.api == Api::Chat {
                        s.queued.push_back(s.reply.chunk(json!({"role": "assistant", "content": ""}), None));
                    }
                    s.queued.push_back(s.reply.token_chunk(0));
                }
                Some(Event::Token { index, .. }) => s.queued.push_back(s.reply.token_chunk(index)),
                Some(Event::Finished { cached_tokens, .. }) => {
                    s.guard.armed = false;
                    if s.reply.include_usage {
                        s.queued.push_back(s.reply.usage_chunk(cached_tokens));
                    }
                    s.queued.push_back("[DONE]".into());
                    s.done = true;
                }
                Some(Event::Rejected { .. }) | None => {
                    s.guard.armed = false;
                    let err = json!({"error": {"message": "the simulated engine could not schedule the request",
                        "type": "InternalServerError", "param": null, "code": 500}});
                    s.queued.push_back(err.to_string());
                    s.queued.push_back("[DONE]".into());
                    s.done = true;
                }
                Some(Event::Preempted { .. }) => {}
            }
        }
    })
}

/// Builds the OpenAI JSON for one request.
struct Reply {
    api: Api,
    id: String,
    created: u64,
    model: String,
    served_by: String,
    prompt_tokens: u32,
    output_tokens: u32,
    include_usage: bool,
}

fn word(i: u32) -> String {
    let w = WORDS.get(i as usize % WORDS.len()).copied().unwrap_or("lorem");
    if i == 0 {
        w.to_string()
    } else {
        format!(" {w}")
    }
}

impl Reply {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.api, chunk) {
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Completion, _) => "text_completion",
        }
    }

    fn usage(&self, cached_tokens: u32) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.output_tokens,
            "total_tokens": self.prompt_tokens + self.output_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        })
    }

    fn full_response(&self, cached_tokens: u32) -> Value {
        let text: String = (0..self.output_tokens).map(word).collect();
        let choice = match self.api {
            Api::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": null,
                "finish_reason": "length",
            }),
            Api::Completion => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length"}),
        };
        json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(cached_tokens),
            "served_by": self.served_by,
        })
    }

    /// One streamed chunk with a chat `delta` (or completion `text`).
    fn chunk(&self, delta: Value, finish: Option<&str>) -> String {
        let choice = match self.api {
            Api::Chat => json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}),
            Api::Completion => json!({
                "index": 0,
                "text": delta.get("content").cloned().unwrap_or(json!("")),
                "logprobs": null,
                "finish_reason": finish,
            }),
        };
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "served_by": self.served_by,
        })
        .to_string()
    }

    fn token_chunk(&self, index: u32) -> String {
        let last = index + 1 >= self.output_tokens;
        self.chunk(json!({"content": word(index)}), last.then_some("length"))
    }

    fn usage_chunk(&self, cached_tokens: u32) -> String {
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage(cached_tokens),
            "served_by": self.served_by,
        })
        .to_string()
    }
}
