//! The HTTP shell: runs the pure [`Server`] model in real time behind an OpenAI-compatible API,
//! and Anthropic's Messages API (`POST /v1/messages`, [`Api::Messages`]) with its token count
//! (`POST /v1/messages/count_tokens`, [`count_tokens`]).
//!
//! Model time is wall-clock milliseconds since the shell started. A background task (see
//! [`engine_loop`]) advances the model to "now", hands every event to the request that owns it,
//! and sleeps until the model's next wakeup or until a new request arrives. Handlers only submit
//! requests and wait on a per-request channel, so every response is paced by the model.
//!
//! Endpoints are listed in the crate README. Every response carries `x-sim-server: <name>`, and
//! every inference JSON body (and every OpenAI stream chunk, and the message of an Anthropic
//! stream's `message_start`) carries `"served_by": "<name>"`. Errors on `/v1/messages` are
//! Anthropic-shaped (`{"type":"error","error":{"type","message"}}`), elsewhere OpenAI-shaped.
//!
//! Fault injection (`POST /sim/chaos`, [`ChaosMode`]) acts on inference requests only, so a pod can
//! look healthy on `/metrics` while it fails, resets, hangs or cuts its streams. `reset` needs the
//! request's TCP connection: serve the router with
//! `into_make_service_with_connect_info::<ConnHandle>()` (the binary does).
//!
//! Ordering control (`POST /sim/hold`, `POST /sim/release`, [`HoldSetting`]): inference requests
//! can be parked at arrival, before the engine sees them, and let go later, one at a time or all
//! at once, in arrival order, so that an end-to-end test decides when a pod serves instead of
//! guessing how long it takes. /metrics shows parked requests as the engine would schedule them
//! (running while its batch has room, then waiting). `/sim/stats` lists the parked requests and
//! the last arrivals (their prompt text and `x-request-id`).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::connect_info::{ConnectInfo, Connected};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, Extensions, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::IncomingStream;
use axum::Router;
use futures_util::stream::{self, Stream};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, oneshot, Notify};
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
    /// Role in a disaggregated prefill/decode pool ([`SimRole`]).
    pub role: SimRole,
}

/// Request header naming the prefill pod (`ip:port`), set by the gateway (llm-d's protocol).
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";
/// Response header of a decode-side request whose prompt was prefilled remotely: the prefill
/// pod's `ip:port`.
pub const PREFILLED_BY_HEADER: &str = "x-sim-prefilled-by";
/// Largest answer read from a prefill pod.
const PREFILL_RESPONSE_LIMIT: usize = 1024 * 1024;
/// Longest wait for a prefill pod's answer.
const PREFILL_TIMEOUT: Duration = Duration::from_secs(60);

/// What a simulated pod does in a disaggregated prefill/decode pool (`--role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SimRole {
    /// A prefill pod: serves every request itself (the gateway sends it only the decode
    /// sidecar's `max_tokens: 1` prefill calls); ignores `x-prefiller-host-port`.
    Prefill,
    /// A decode pod with llm-d's routing sidecar in front: a request carrying
    /// `x-prefiller-host-port` is first sent to that pod with `max_tokens: 1`, its KV is taken
    /// as transferred (the prompt counts as cached here), then decoded locally.
    Decode,
    /// Both (the default): a plain server that also honours `x-prefiller-host-port`.
    #[default]
    Both,
}

impl std::str::FromStr for SimRole {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "prefill" => Ok(SimRole::Prefill),
            "decode" => Ok(SimRole::Decode),
            "both" => Ok(SimRole::Both),
            other => Err(format!("unknown role {other:?} (prefill, decode or both)")),
        }
    }
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
    /// The load moves at every scrape: every other /metrics answer adds one more waiting
    /// request (`queue + 1`, `queue`, `queue + 1`, ..., starting with the first answer after the
    /// change), so a poller never sees two equal scrapes in a row (a pod whose load keeps
    /// changing).
    #[serde(default)]
    pub vary: bool,
}

/// Which inference requests are parked at arrival (POST /sim/hold), until POST /sim/release.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct HoldSetting {
    /// New inference requests are parked.
    pub active: bool,
    /// Requests still to be parked before holding stops by itself; `None` = until released.
    pub remaining: Option<u64>,
}

/// The JSON body of POST /sim/hold.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HoldRequest {
    #[serde(default)]
    count: Option<u64>,
}

/// The JSON body of POST /sim/release.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReleaseRequest {
    #[serde(default)]
    n: Option<u64>,
}

impl HoldSetting {
    /// Validates a POST /sim/hold body. Errors are messages for a 400.
    fn parse(body: &[u8]) -> Result<HoldSetting, String> {
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(HoldSetting { active: true, remaining: None });
        }
        let r: HoldRequest = serde_json::from_slice(body).map_err(|e| format!("invalid hold JSON: {e}"))?;
        if r.count == Some(0) {
            return Err("count must be >= 1 (omit it to hold every request until released)".into());
        }
        Ok(HoldSetting { active: true, remaining: r.count })
    }

    /// Whether the request arriving now is parked; counts the setting down.
    fn take(&mut self) -> bool {
        if !self.active {
            return false;
        }
        match self.remaining {
            Some(n) if n <= 1 => *self = HoldSetting::default(),
            Some(n) => self.remaining = Some(n - 1),
            None => {}
        }
        true
    }
}

/// One inference request as it arrived, for /sim/stats (`arrivals`, `held_requests`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Arrival {
    /// Arrival number, from 1, never reset (not even by /sim/reset-stats).
    pub seq: u64,
    /// The prompt text: a chat request's last message content (text parts joined), or a
    /// completion's string prompt; `None` when the body has neither.
    pub content: Option<String>,
    /// The `x-request-id` header (Envoy sets one on every request it forwards).
    pub request_id: Option<String>,
    /// The request was parked by /sim/hold on arrival.
    pub held: bool,
}

/// Most arrivals kept in /sim/stats `arrivals`.
const ARRIVALS_KEPT: usize = 256;

/// A parked request: its arrival and the channel that lets it go.
struct Parked {
    arrival: Arrival,
    go: oneshot::Sender<()>,
}

/// The hold setting and the requests parked now, oldest first.
#[derive(Default)]
struct Hold {
    setting: HoldSetting,
    parked: VecDeque<Parked>,
}

/// Removes a parked request whose handler was dropped (the client went away) before release.
struct ParkGuard {
    state: Arc<AppState>,
    seq: u64,
}

impl Drop for ParkGuard {
    fn drop(&mut self) {
        lock(&self.state.hold).parked.retain(|p| p.arrival.seq != self.seq);
    }
}

/// What the simulator does with the next inference requests (POST /sim/chaos).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum ChaosMode {
    /// Serve normally.
    #[default]
    Ok,
    /// Answer at once with this status and an OpenAI-style error body.
    Status { status: u16 },
    /// Close the connection without any response.
    Reset,
    /// Accept the request and never answer (until the client or proxy gives up).
    Hang,
    /// Streaming requests: send the response head and `after_chunks` SSE events, then cut the
    /// connection. Non-streaming requests are served normally.
    StreamCut { after_chunks: u32 },
}

/// The chaos setting: a mode, for every request or for the next `remaining` ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Chaos {
    #[serde(flatten)]
    pub mode: ChaosMode,
    /// Requests still to be affected; `None` = until changed.
    pub remaining: Option<u64>,
}

/// The JSON body of POST /sim/chaos.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChaosRequest {
    mode: String,
    #[serde(default)]
    status: Option<u16>,
    #[serde(default)]
    after_chunks: Option<u32>,
    #[serde(default)]
    count: Option<u64>,
}

impl Chaos {
    /// Validates a POST /sim/chaos body. Errors are messages for a 400.
    fn parse(body: &[u8]) -> Result<Chaos, String> {
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(Chaos::default());
        }
        let r: ChaosRequest = serde_json::from_slice(body).map_err(|e| format!("invalid chaos JSON: {e}"))?;
        let only = |allowed: &[&str]| -> Result<(), String> {
            let given = [("status", r.status.is_some()), ("after_chunks", r.after_chunks.is_some())];
            match given.iter().find(|(name, set)| *set && !allowed.contains(name)) {
                Some((name, _)) => Err(format!("`{name}` does not apply to mode `{}`", r.mode)),
                None => Ok(()),
            }
        };
        let mode = match r.mode.as_str() {
            "ok" => {
                only(&[])?;
                if r.count.is_some() {
                    return Err("`count` does not apply to mode `ok`".into());
                }
                ChaosMode::Ok
            }
            "status" => {
                only(&["status"])?;
                let status = r.status.ok_or("mode `status` needs `status` (200-599)")?;
                if !(200..=599).contains(&status) {
                    return Err(format!("status must be in 200-599, got {status}"));
                }
                ChaosMode::Status { status }
            }
            "reset" => {
                only(&[])?;
                ChaosMode::Reset
            }
            "hang" => {
                only(&[])?;
                ChaosMode::Hang
            }
            "stream_cut" => {
                only(&["after_chunks"])?;
                ChaosMode::StreamCut { after_chunks: r.after_chunks.unwrap_or(1) }
            }
            other => {
                return Err(format!("unknown mode `{other}` (ok, status, reset, hang, stream_cut)"));
            }
        };
        if r.count == Some(0) {
            return Err("count must be >= 1 (omit it for every request)".into());
        }
        Ok(Chaos { mode, remaining: r.count })
    }

    /// The mode for one inference request; counts it down.
    fn take(&mut self) -> ChaosMode {
        let mode = self.mode;
        match self.remaining {
            Some(n) if n <= 1 => *self = Chaos::default(),
            Some(n) => self.remaining = Some(n - 1),
            None => {}
        }
        mode
    }
}

/// Connection info for chaos mode `reset`: a duplicate of the connection's socket descriptor, so
/// a handler can shut the connection down. Serve with
/// `router.into_make_service_with_connect_info::<ConnHandle>()`.
#[derive(Debug, Clone, Default)]
pub struct ConnHandle {
    #[cfg(unix)]
    fd: Option<Arc<std::os::fd::OwnedFd>>,
}

impl Connected<IncomingStream<'_, tokio::net::TcpListener>> for ConnHandle {
    fn connect_info(stream: IncomingStream<'_, tokio::net::TcpListener>) -> Self {
        #[cfg(unix)]
        {
            use std::os::fd::AsFd as _;
            ConnHandle { fd: stream.io().as_fd().try_clone_to_owned().ok().map(Arc::new) }
        }
        #[cfg(not(unix))]
        {
            let _ = stream;
            ConnHandle::default()
        }
    }
}

impl ConnHandle {
    /// Shuts the connection down (with SO_LINGER 0, so its final close sends a RST). Returns
    /// false when the connection is unknown (an in-process call).
    fn reset(&self) -> bool {
        #[cfg(unix)]
        if let Some(fd) = &self.fd {
            let sock = socket2::SockRef::from(fd.as_ref());
            let _ = sock.set_linger(Some(Duration::ZERO));
            return sock.shutdown(std::net::Shutdown::Both).is_ok();
        }
        false
    }
}

#[derive(Debug, Clone, Default, Serialize)]
struct Stats {
    requests_total: u64,
    chaos_total: u64,
    requests_by_model: BTreeMap<String, u64>,
    metrics_scrapes_total: u64,
    last_request_headers: BTreeMap<String, String>,
    last_request_model: Option<String>,
    /// Decode side: prompts prefilled by the named prefill pod, and calls to one that failed
    /// (the prompt was then prefilled here).
    remote_prefills_total: u64,
    remote_prefill_failures_total: u64,
    last_prefiller: Option<String>,
    /// Inference requests parked by /sim/hold.
    held_total: u64,
    /// `POST /v1/messages/count_tokens` calls (not inference requests: not in `requests_total`).
    count_tokens_total: u64,
    /// The last [`ARRIVALS_KEPT`] inference requests, oldest first.
    arrivals: VecDeque<Arrival>,
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
    chaos: Mutex<Chaos>,
    hold: Mutex<Hold>,
    /// Arrival numbers of inference requests ([`Arrival::seq`]).
    next_arrival: AtomicU64,
    /// Scrapes answered while `fake.vary` is on (its parity picks the extra waiting request).
    vary_scrapes: AtomicU64,
    /// Served LoRA adapter names: `--lora` at start, then `POST /v1/load_lora_adapter` and
    /// `/v1/unload_lora_adapter` (vLLM's runtime LoRA API).
    loras: Mutex<Vec<String>>,
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
        let cfg_loras = cfg.loras.clone();
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
            chaos: Mutex::new(Chaos::default()),
            hold: Mutex::new(Hold::default()),
            next_arrival: AtomicU64::new(1),
            vary_scrapes: AtomicU64::new(0),
            loras: Mutex::new(cfg_loras),
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
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/models", get(list_models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/load_lora_adapter", post(load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(unload_lora_adapter))
        .route("/sim/stats", get(sim_stats))
        .route("/sim/fake-load", post(sim_fake_load))
        .route("/sim/reset-stats", post(sim_reset_stats))
        .route("/sim/chaos", post(sim_chaos))
        .route("/sim/hold", post(sim_hold))
        .route("/sim/release", post(sim_release))
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
    data.extend(lock(&st.loras).iter().map(|l| {
        json!({
            "id": l, "object": "model", "created": created, "owned_by": "vllm",
            "root": l, "parent": base, "max_model_len": null, "permission": [],
        })
    }));
    axum::Json(json!({ "object": "list", "data": data })).into_response()
}

/// The `lora_name` of a vLLM load/unload body (`{"lora_name": …, "lora_path": …}`). Errors are
/// messages for a 400.
fn lora_name(body: &[u8]) -> Result<String, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("invalid JSON body: {e}"))?;
    match v.get("lora_name").and_then(Value::as_str) {
        Some(n) if !n.is_empty() => Ok(n.to_string()),
        _ => Err("missing or empty field `lora_name`".to_string()),
    }
}

/// vLLM's `POST /v1/load_lora_adapter`: the adapter is served from now on (listed in
/// `/v1/models`, accepted as `model`). Needs LoRA enabled (any `--lora` at start), as vLLM needs
/// `--enable-lora`. The path is ignored.
async fn load_lora_adapter(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    if st.cfg.loras.is_empty() {
        return bad_request("LoRA is not enabled: start the simulator with at least one --lora");
    }
    let name = match lora_name(&body) {
        Ok(n) => n,
        Err(m) => return bad_request(m),
    };
    if st.cfg.models.contains(&name) {
        return bad_request(format!("`{name}` is a base model"));
    }
    let mut loras = lock(&st.loras);
    if loras.contains(&name) {
        return bad_request(format!("The lora adapter '{name}' has already been loaded."));
    }
    loras.push(name.clone());
    (StatusCode::OK, format!("Success: LoRA adapter '{name}' added successfully.")).into_response()
}

/// vLLM's `POST /v1/unload_lora_adapter`: the adapter is no longer served.
async fn unload_lora_adapter(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let name = match lora_name(&body) {
        Ok(n) => n,
        Err(m) => return bad_request(m),
    };
    let mut loras = lock(&st.loras);
    let Some(i) = loras.iter().position(|l| *l == name) else {
        return error_response(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("The lora adapter '{name}' cannot be found."),
        );
    };
    loras.remove(i);
    (StatusCode::OK, format!("Success: LoRA adapter '{name}' removed successfully.")).into_response()
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let mut snap = st.snapshot();
    let fake = *lock(&st.fake);
    // Parked requests are shown as the engine would schedule them: running while its batch has
    // room, then waiting (a gateway in front fills the pod as it would fill a real one).
    let parked = lock(&st.hold).parked.len() as u64;
    let max_batch = u64::from(lock(&st.core).server.config().max_batch);
    let run = parked.min(max_batch.saturating_sub(snap.running + snap.waiting));
    snap.running += run;
    snap.waiting += parked - run;
    snap.waiting += fake.queue;
    if fake.vary && st.vary_scrapes.fetch_add(1, Ordering::Relaxed) % 2 == 0 {
        snap.waiting += 1;
    }
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
    body.insert("role".into(), json!(st.cfg.role));
    body.insert("fake_load".into(), json!(fake));
    body.insert("chaos".into(), json!(*lock(&st.chaos)));
    {
        let hold = lock(&st.hold);
        body.insert("hold".into(), json!(hold.setting));
        body.insert("held".into(), json!(hold.parked.len()));
        let parked: Vec<&Arrival> = hold.parked.iter().map(|p| &p.arrival).collect();
        body.insert("held_requests".into(), json!(parked));
    }
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
    st.vary_scrapes.store(0, Ordering::Relaxed);
    axum::Json(json!({ "fake_load": load })).into_response()
}

async fn sim_hold(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    match HoldSetting::parse(&body) {
        Ok(setting) => {
            let mut hold = lock(&st.hold);
            hold.setting = setting;
            axum::Json(json!({ "hold": setting, "held": hold.parked.len() })).into_response()
        }
        Err(m) => bad_request(m),
    }
}

/// POST /sim/release: `{"n": k}` lets the k oldest parked requests go (409 when fewer are
/// parked; the hold setting stays); an empty body or `{}` stops holding and lets every parked
/// request go.
async fn sim_release(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let n = if body.iter().all(u8::is_ascii_whitespace) {
        None
    } else {
        match serde_json::from_slice::<ReleaseRequest>(&body) {
            Ok(ReleaseRequest { n: Some(0) }) => {
                return bad_request("n must be >= 1 (omit it to release every request)")
            }
            Ok(r) => r.n,
            Err(e) => return bad_request(format!("invalid release JSON: {e}")),
        }
    };
    let mut hold = lock(&st.hold);
    let parked = hold.parked.len() as u64;
    let k = match n {
        Some(k) if k > parked => {
            return error_response(
                StatusCode::CONFLICT,
                "ConflictError",
                format!("cannot release {k}: {parked} request(s) held"),
            );
        }
        Some(k) => k,
        None => {
            hold.setting = HoldSetting::default();
            parked
        }
    };
    let mut released = Vec::new();
    for _ in 0..k {
        if let Some(p) = hold.parked.pop_front() {
            // A handler that is gone (its client left) removes its own entry; a send that fails
            // here only means it is being dropped right now.
            let _ = p.go.send(());
            released.push(p.arrival);
        }
    }
    axum::Json(json!({ "released": released, "held": hold.parked.len(), "hold": hold.setting }))
        .into_response()
}

async fn sim_chaos(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    match Chaos::parse(&body) {
        Ok(chaos) => {
            *lock(&st.chaos) = chaos;
            axum::Json(json!({ "chaos": chaos })).into_response()
        }
        Err(m) => bad_request(m),
    }
}

async fn sim_reset_stats(State(st): State<Arc<AppState>>) -> Response {
    *lock(&st.stats) = Stats::default();
    axum::Json(json!({ "reset": true })).into_response()
}

/// Which API an inference request came in on: it sets the body read, the answer's shape, and
/// the shape of its errors.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Api {
    Chat,
    Completion,
    /// Anthropic's Messages API.
    Messages,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completion => "/v1/completions",
            Api::Messages => "/v1/messages",
        }
    }

    /// An error answer in this API's shape: OpenAI's as vLLM sends it, or Anthropic's.
    fn error(self, status: StatusCode, message: impl Into<String>) -> Response {
        match self {
            Api::Chat | Api::Completion => error_response(status, error_kind(status), message),
            Api::Messages => {
                let body = json!({"type": "error", "error": {"type": anthropic_error_type(status), "message": message.into()}});
                (status, axum::Json(body)).into_response()
            }
        }
    }
}

/// Anthropic's error `type` for a status (its API's documented table).
fn anthropic_error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    ext: Extensions,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    inference(st, Api::Chat, &ext, headers, body).await
}

async fn completions(
    State(st): State<Arc<AppState>>,
    ext: Extensions,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    inference(st, Api::Completion, &ext, headers, body).await
}

async fn messages(
    State(st): State<Arc<AppState>>,
    ext: Extensions,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    inference(st, Api::Messages, &ext, headers, body).await
}

/// Anthropic's token count (`POST /v1/messages/count_tokens`, which vLLM serves too):
/// `{"input_tokens": N}`, N the prompt tokens a `POST /v1/messages` with the same `model`,
/// `system` and `messages` has (its `usage.input_tokens` when none of the prompt is cached,
/// `input_tokens + cache_read_input_tokens` otherwise). No `max_tokens`; the same 400s on
/// `system` and `messages`, and the 404 of an unknown model, in Anthropic's shape. It only
/// tokenizes: no engine time, no KV cache, never held (`/sim/hold`) or failed (`/sim/chaos`), no
/// arrival; counted in `count_tokens_total`.
async fn count_tokens(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let api = Api::Messages;
    lock(&st.stats).count_tokens_total += 1;
    let value: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return api.error(StatusCode::BAD_REQUEST, format!("invalid JSON body: {e}")),
    };
    let Some(obj) = value.as_object() else {
        return api.error(StatusCode::BAD_REQUEST, "request body must be a JSON object");
    };
    let Some(model) = obj.get("model").and_then(Value::as_str) else {
        return api.error(StatusCode::BAD_REQUEST, "model: Field required (a string)");
    };
    let served = st.cfg.models.iter().any(|m| m == model) || lock(&st.loras).iter().any(|l| l == model);
    if !served {
        return api.error(StatusCode::NOT_FOUND, format!("The model `{model}` does not exist."));
    }
    match messages_prompt_text(obj.get("system"), obj.get("messages")) {
        Ok(text) => axum::Json(json!({ "input_tokens": prompt::estimate_tokens(&text) })).into_response(),
        Err(m) => api.error(StatusCode::BAD_REQUEST, m),
    }
}

/// The OpenAI error type vLLM's clients expect for a status.
fn error_kind(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => "BadRequestError",
        401 => "AuthenticationError",
        403 => "PermissionDeniedError",
        404 => "NotFoundError",
        429 => "RateLimitError",
        _ => "InternalServerError",
    }
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
        Api::Messages => {
            let text = messages_prompt_text(obj.get("system"), obj.get("messages"))?;
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
        // Anthropic's API requires it.
        None | Some(Value::Null) if api == Api::Messages => {
            return Err("max_tokens: Field required".to_string())
        }
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
    // An Anthropic stream always ends with its usage (`message_delta`).
    let include_usage = api == Api::Messages
        || obj
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
    Ok(Parsed { model, prompt_tokens, hashes, max_tokens, stream, include_usage })
}

/// The prompt text an arrival is recorded with (`Arrival::content`): a chat or Anthropic
/// request's last message content (its text parts joined), or a completion's string prompt.
fn request_content(api: Api, v: &Value) -> Option<String> {
    match api {
        Api::Chat | Api::Messages => {
            let content = v.get("messages")?.as_array()?.last()?.get("content")?;
            match content {
                Value::String(s) => Some(s.clone()),
                Value::Array(parts) => {
                    Some(parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect())
                }
                _ => None,
            }
        }
        Api::Completion => match v.get("prompt")? {
            Value::String(s) => Some(s.clone()),
            Value::Array(items) if items.len() == 1 => items.first()?.as_str().map(str::to_string),
            _ => None,
        },
    }
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

/// The text an Anthropic request's chat template would produce, roughly: the system prompt, then
/// "role: content" per message, where a content block gives its text (a `text` block's text, a
/// `tool_result`'s content, a `tool_use`'s input JSON, a `thinking` block's thinking).
fn messages_prompt_text(system: Option<&Value>, messages: Option<&Value>) -> Result<String, String> {
    let Some(Value::Array(msgs)) = messages else {
        return Err("messages: Field required (a list of messages)".to_string());
    };
    if msgs.is_empty() {
        return Err("messages: at least one message is required".to_string());
    }
    let mut text = String::new();
    match system {
        None | Some(Value::Null) => {}
        Some(s @ (Value::String(_) | Value::Array(_))) => {
            text.push_str("system: ");
            block_text(s, &mut text);
            text.push('\n');
        }
        Some(_) => return Err("system: must be a string or a list of text blocks".to_string()),
    }
    for (i, m) in msgs.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("messages.{i}.role: Field required"))?;
        text.push_str(role);
        text.push_str(": ");
        match m.get("content") {
            Some(c @ (Value::String(_) | Value::Array(_))) => block_text(c, &mut text),
            _ => return Err(format!("messages.{i}.content: must be a string or a list of content blocks")),
        }
        text.push('\n');
    }
    Ok(text)
}

/// Appends the text of an Anthropic content (a string, a list of blocks, or one block).
fn block_text(content: &Value, out: &mut String) {
    match content {
        Value::String(s) => out.push_str(s),
        Value::Array(blocks) => blocks.iter().for_each(|b| block_text(b, out)),
        Value::Object(b) => match b.get("type").and_then(Value::as_str) {
            Some("tool_use") => out.push_str(&b.get("input").map(Value::to_string).unwrap_or_default()),
            Some("tool_result") => b.get("content").into_iter().for_each(|c| block_text(c, out)),
            Some("thinking") => out.push_str(b.get("thinking").and_then(Value::as_str).unwrap_or("")),
            _ => out.push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
        },
        _ => {}
    }
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

/// Records an arrival (its number, the stats, the arrivals kept) and parks it when /sim/hold
/// asked for that: its number, and what to wait for when parked. Under the hold lock, so that
/// arrival numbers, `arrivals` and the parked queue all have one order. (No code takes these
/// two locks the other way round.)
fn record_arrival(
    st: &AppState,
    content: Option<String>,
    headers: &HeaderMap,
) -> (u64, Option<oneshot::Receiver<()>>) {
    let request_id = headers.get("x-request-id").and_then(|v| v.to_str().ok()).map(str::to_string);
    let mut hold = lock(&st.hold);
    let seq = st.next_arrival.fetch_add(1, Ordering::Relaxed);
    let held = hold.setting.take();
    let arrival = Arrival { seq, content, request_id, held };
    let mut s = lock(&st.stats);
    s.requests_total += 1;
    s.last_request_headers = headers_map(headers);
    s.last_request_model = None;
    if s.arrivals.len() >= ARRIVALS_KEPT {
        s.arrivals.pop_front();
    }
    s.arrivals.push_back(arrival.clone());
    let parked = held.then(|| {
        s.held_total += 1;
        let (go, wait) = oneshot::channel();
        hold.parked.push_back(Parked { arrival, go });
        wait
    });
    (seq, parked)
}

/// A decode pod named a prefiller (llm-d's sidecar header): the remote prefill, then the
/// prompt's blocks imported here. The prefiller when it prefilled; `None` without one, or when
/// it failed (this pod prefills then).
async fn prefill_remotely(
    st: &AppState,
    api: Api,
    headers: &HeaderMap,
    value: &Value,
    p: &Parsed,
    adapter: Option<&str>,
) -> Option<String> {
    let prefiller = match st.cfg.role {
        SimRole::Prefill => None,
        SimRole::Decode | SimRole::Both => headers
            .get(PREFILLER_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(str::to_string),
    };
    let pre = prefiller?;
    let ok = match remote_prefill(&pre, api.path(), value).await {
        Ok(()) => {
            let mut core = lock(&st.core);
            core.server.import_prefix(&p.hashes, p.prompt_tokens, adapter);
            true
        }
        Err(e) => {
            eprintln!("model-server-sim: remote prefill on {pre} failed, prefilling here: {e}");
            false
        }
    };
    let mut s = lock(&st.stats);
    let mut prefilled_by = None;
    if ok {
        s.remote_prefills_total += 1;
        prefilled_by = Some(pre.clone());
    } else {
        s.remote_prefill_failures_total += 1;
    }
    s.last_prefiller = Some(pre);
    prefilled_by
}

async fn inference(
    st: Arc<AppState>,
    api: Api,
    ext: &Extensions,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let parsed_body = serde_json::from_slice::<Value>(&body);
    let content = parsed_body.as_ref().ok().and_then(|v| request_content(api, v));
    let (seq, parked) = record_arrival(&st, content, &headers);
    if let Some(wait) = parked {
        let _guard = ParkGuard { state: st.clone(), seq };
        // Err only when the sender was dropped without a release, which does not happen while
        // the entry is parked; either way the request goes on.
        let _ = wait.await;
    }
    let chaos = lock(&st.chaos).take();
    if chaos != ChaosMode::Ok {
        lock(&st.stats).chaos_total += 1;
    }
    let mut cut_after = None;
    match chaos {
        ChaosMode::Ok => {}
        ChaosMode::Status { status } => {
            let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return api.error(code, format!("chaos: simulated {status}"));
        }
        ChaosMode::Reset => {
            let reset = ext.get::<ConnectInfo<ConnHandle>>().is_some_and(|c| c.0.reset());
            // After a reset the response below cannot be written; without a connection (an
            // in-process call) it says why nothing was reset.
            let why = if reset { "chaos: reset" } else { "chaos: reset needs a TCP connection" };
            return api.error(StatusCode::INTERNAL_SERVER_ERROR, why);
        }
        ChaosMode::Hang => return std::future::pending::<Response>().await,
        ChaosMode::StreamCut { after_chunks } => cut_after = Some(after_chunks),
    }
    let value: Value = match parsed_body {
        Ok(v) => v,
        Err(e) => return api.error(StatusCode::BAD_REQUEST, format!("invalid JSON body: {e}")),
    };
    if let Some(m) = value.get("model").and_then(Value::as_str) {
        let mut s = lock(&st.stats);
        s.last_request_model = Some(m.to_string());
        *s.requests_by_model.entry(m.to_string()).or_insert(0) += 1;
    }
    let p = match parse_request(&st, api, &value) {
        Ok(p) => p,
        Err(m) => return api.error(StatusCode::BAD_REQUEST, m),
    };
    let adapter = if st.cfg.models.contains(&p.model) {
        None
    } else if lock(&st.loras).contains(&p.model) {
        Some(p.model.clone())
    } else {
        return api.error(StatusCode::NOT_FOUND, format!("The model `{}` does not exist.", p.model));
    };
    let total = u64::from(p.prompt_tokens) + u64::from(p.max_tokens);
    if total > u64::from(st.cfg.max_model_len) {
        return api.error(
            StatusCode::BAD_REQUEST,
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens \
             ({} in the messages, {} in the completion). Please reduce the length of the messages \
             or completion.",
                st.cfg.max_model_len, total, p.prompt_tokens, p.max_tokens
            ),
        );
    }
    let prefilled_by = prefill_remotely(&st, api, &headers, &value, &p, adapter.as_deref()).await;

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
            SubmitError::TooLarge { .. } => {
                api.error(StatusCode::BAD_REQUEST, format!("request cannot fit in the KV cache: {e}"))
            }
            _ => api.error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        };
    }
    st.wake.notify_one();

    let prefix = match api {
        Api::Chat => "chatcmpl-",
        Api::Completion => "cmpl-",
        Api::Messages => "msg_",
    };
    let reply = Reply {
        api,
        id: format!("{prefix}sim{id:016x}"),
        created: unix_now_s() as u64,
        model: p.model,
        served_by: st.cfg.name.clone(),
        prompt_tokens: p.prompt_tokens,
        output_tokens: p.max_tokens,
        include_usage: p.include_usage,
    };
    let guard = AbortGuard { state: st.clone(), id, armed: true };
    let mut resp = if p.stream {
        Sse::new(sse_stream(reply, rx, guard, cut_after)).into_response()
    } else {
        wait_for_completion(reply, rx, guard).await
    };
    if let Some(v) = prefilled_by.and_then(|p| HeaderValue::from_str(&p).ok()) {
        resp.headers_mut().insert(HeaderName::from_static(PREFILLED_BY_HEADER), v);
    }
    resp
}

/// The decode sidecar's remote prefill: the same request to `host_port` with one output token,
/// no streaming, and llm-d's `kv_transfer_params` asking the prefill pod to keep the KV for a
/// remote decode. Plain HTTP/1.1 over a fresh connection; any answer but 200 is a failure.
async fn remote_prefill(host_port: &str, path: &str, body: &Value) -> Result<(), String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut req = body.clone();
    if let Some(o) = req.as_object_mut() {
        o.remove("max_completion_tokens");
        o.remove("stream_options");
        o.insert("max_tokens".into(), json!(1));
        o.insert("stream".into(), json!(false));
        o.insert("kv_transfer_params".into(), json!({"do_remote_decode": true, "do_remote_prefill": false}));
    }
    let payload = serde_json::to_vec(&req).map_err(|e| e.to_string())?;
    let call = async {
        let mut conn =
            tokio::net::TcpStream::connect(host_port).await.map_err(|e| format!("connect: {e}"))?;
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: {host_port}\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n",
            payload.len()
        );
        conn.write_all(head.as_bytes()).await.map_err(|e| format!("write: {e}"))?;
        conn.write_all(&payload).await.map_err(|e| format!("write: {e}"))?;
        let mut answer = Vec::new();
        let mut limited = conn.take(PREFILL_RESPONSE_LIMIT as u64);
        limited.read_to_end(&mut answer).await.map_err(|e| format!("read: {e}"))?;
        let status_line = answer.split(|&b| b == b'\n').next().unwrap_or(&[]);
        let status = String::from_utf8_lossy(status_line);
        match status.split_whitespace().nth(1) {
            Some("200") => Ok(()),
            Some(code) => Err(format!("status {code}")),
            None => Err("no HTTP answer".to_string()),
        }
    };
    tokio::time::timeout(PREFILL_TIMEOUT, call).await.map_err(|_| "timed out".to_string())?
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
                return reply.api.error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the simulated engine could not schedule the request",
                );
            }
            _ => {}
        }
    }
    guard.armed = false;
    reply.api.error(StatusCode::INTERNAL_SERVER_ERROR, "engine stopped")
}

/// One SSE event: its `event:` name (Anthropic's streams name every event; OpenAI's name none)
/// and its `data:`.
type Sent = (Option<&'static str>, String);

struct StreamState {
    reply: Reply,
    rx: mpsc::UnboundedReceiver<Event>,
    guard: AbortGuard,
    queued: std::collections::VecDeque<Sent>,
    done: bool,
    /// Chaos `stream_cut`: events still to send before the body fails.
    cut_after: Option<u32>,
}

fn sse_stream(
    reply: Reply,
    rx: mpsc::UnboundedReceiver<Event>,
    guard: AbortGuard,
    cut_after: Option<u32>,
) -> impl Stream<Item = Result<SseEvent, std::io::Error>> {
    let init = StreamState { reply, rx, guard, queued: Default::default(), done: false, cut_after };
    stream::unfold(init, |mut s| async move {
        loop {
            if s.cut_after == Some(0) {
                // Wait for the engine's next event first: while this stream is pending, the server
                // flushes the events already yielded, so the peer receives them before the cut.
                let _ = s.rx.recv().await;
                // A failing body makes the server abort the connection mid-response.
                s.done = true;
                s.queued.clear();
                s.cut_after = None;
                return Some((Err(std::io::Error::other("chaos: stream cut")), s));
            }
            if let Some((name, data)) = s.queued.pop_front() {
                s.cut_after = s.cut_after.map(|n| n.saturating_sub(1));
                let event = SseEvent::default().data(data);
                return Some((
                    Ok(match name {
                        Some(n) => event.event(n),
                        None => event,
                    }),
                    s,
                ));
            }
            if s.done {
                return None;
            }
            match s.rx.recv().await {
                Some(Event::FirstToken { .. }) => {
                    let first = s.reply.first_events();
                    s.queued.extend(first);
                    s.queued.push_back(s.reply.token_chunk(0));
                }
                Some(Event::Token { index, .. }) => s.queued.push_back(s.reply.token_chunk(index)),
                Some(Event::Finished { cached_tokens, .. }) => {
                    s.guard.armed = false;
                    let last = s.reply.last_events(cached_tokens);
                    s.queued.extend(last);
                    s.done = true;
                }
                Some(Event::Rejected { .. }) | None => {
                    s.guard.armed = false;
                    let last = s.reply.error_events("the simulated engine could not schedule the request");
                    s.queued.extend(last);
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
            (Api::Messages, _) => "message",
        }
    }

    /// Anthropic's `usage`: the prompt's tokens (those read from the prefix cache apart) and the
    /// output's.
    fn anthropic_usage(&self, cached_tokens: u32) -> Value {
        json!({
            "input_tokens": self.prompt_tokens.saturating_sub(cached_tokens),
            "cache_read_input_tokens": cached_tokens,
            "cache_creation_input_tokens": 0,
            "output_tokens": self.output_tokens,
        })
    }

    /// An Anthropic `message` object; `content` and `usage` as given.
    fn message(&self, content: Value, stop_reason: Option<&str>, usage: Value) -> Value {
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": null,
            "usage": usage,
            "served_by": self.served_by,
        })
    }

    /// The events of a stream before its first token: a chat stream's role chunk, or Anthropic's
    /// `message_start` (usage so far: the prompt, no output) and `content_block_start`.
    fn first_events(&self) -> Vec<Sent> {
        match self.api {
            Api::Chat => vec![(None, self.chunk(json!({"role": "assistant", "content": ""}), None))],
            Api::Completion => Vec::new(),
            Api::Messages => {
                let usage = json!({"input_tokens": self.prompt_tokens, "output_tokens": 0});
                let start = json!({"type": "message_start", "message": self.message(json!([]), None, usage)});
                let block = json!({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}});
                vec![
                    (Some("message_start"), start.to_string()),
                    (Some("content_block_start"), block.to_string()),
                ]
            }
        }
    }

    /// The events after the last token: the usage chunk (when asked) and `[DONE]`, or Anthropic's
    /// `content_block_stop`, `message_delta` (the stop reason and the usage) and `message_stop`.
    fn last_events(&self, cached_tokens: u32) -> Vec<Sent> {
        match self.api {
            Api::Chat | Api::Completion => {
                let usage = self.include_usage.then(|| (None, self.usage_chunk(cached_tokens)));
                usage.into_iter().chain([(None, "[DONE]".to_string())]).collect()
            }
            Api::Messages => {
                let stop = json!({"type": "content_block_stop", "index": 0});
                let delta = json!({"type": "message_delta",
                    "delta": {"stop_reason": "max_tokens", "stop_sequence": null},
                    "usage": self.anthropic_usage(cached_tokens)});
                vec![
                    (Some("content_block_stop"), stop.to_string()),
                    (Some("message_delta"), delta.to_string()),
                    (Some("message_stop"), json!({"type": "message_stop"}).to_string()),
                ]
            }
        }
    }

    /// A stream's end on an engine failure: an error chunk and `[DONE]`, or Anthropic's `error`
    /// event.
    fn error_events(&self, message: &str) -> Vec<Sent> {
        match self.api {
            Api::Chat | Api::Completion => {
                let err = json!({"error": {"message": message, "type": "InternalServerError", "param": null, "code": 500}});
                vec![(None, err.to_string()), (None, "[DONE]".to_string())]
            }
            Api::Messages => {
                let err = json!({"type": "error", "error": {"type": "api_error", "message": message}});
                vec![(Some("error"), err.to_string())]
            }
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
        if self.api == Api::Messages {
            let content = json!([{"type": "text", "text": text}]);
            return self.message(content, Some("max_tokens"), self.anthropic_usage(cached_tokens));
        }
        let choice = match self.api {
            Api::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": null,
                "finish_reason": "length",
            }),
            Api::Completion | Api::Messages => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length"})
            }
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
            Api::Completion | Api::Messages => json!({
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

    /// Output token `index` as a chunk, or as Anthropic's `content_block_delta`.
    fn token_chunk(&self, index: u32) -> Sent {
        if self.api == Api::Messages {
            let delta = json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": word(index)}});
            return (Some("content_block_delta"), delta.to_string());
        }
        let last = index + 1 >= self.output_tokens;
        (None, self.chunk(json!({"content": word(index)}), last.then_some("length")))
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
