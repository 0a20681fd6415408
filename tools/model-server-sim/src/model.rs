//! The pure server model: a vLLM-V1-like engine (continuous batching, chunked prefill, paged KV
//! cache with prefix caching, LoRA slots, recompute preemption) advanced in virtual time.
//!
//! ## Time
//! All times are **virtual milliseconds as `f64`** (`arrival_ms`, `now_ms`, event `t_ms`). The
//! model never reads a clock; the caller passes time in. The same model runs in real time (the
//! HTTP binary maps wall-clock ms since start onto it) and in a discrete-event replay.
//!
//! ## Driving it
//! - [`Server::submit`] queues a request. Requests must be submitted in non-decreasing
//!   `arrival_ms`; an arrival earlier than the previous one, or earlier than the time the model
//!   was already advanced to, is moved up to that time. A request may be submitted *ahead* of
//!   the model's time: it is not eligible before its arrival.
//! - [`Server::advance_to`]`(t)` runs every engine step that starts at or before `t` and returns
//!   the events of every step that ends at or before `t`, in time order.
//! - [`Server::next_wakeup`] is the next time at which something happens without new input (the
//!   end of the step in flight, or the start of the next step). `None` means idle.
//!
//! A discrete-event loop: `t = min(next arrival, next_wakeup())`; submit every arrival `<= t`;
//! `advance_to(t)`. Submitting everything that arrives at `t` *before* `advance_to(t)` lets
//! requests with the same arrival time share a step.
//!
//! ## One engine step (after vLLM V1's scheduler)
//! At the start of a step, with a token budget of `max_batched_tokens`:
//! 1. Running requests, oldest first, get their pending tokens: a chunk of the prompt (chunked
//!    prefill) or one decode token. A decode token that needs a new KV block and finds none
//!    preempts the newest running request (recompute: its blocks are freed, its computed prefix
//!    stays in the prefix cache, and it goes back to the front of the queue).
//! 2. If nothing was preempted, waiting requests are admitted FIFO while the batch has fewer
//!    than `max_batch` requests and budget is left. Admission looks up the prompt's block hashes
//!    in the prefix cache and needs KV blocks for the whole (uncached) prompt; if they do not fit,
//!    admission stops (strict FIFO). A request whose LoRA adapter cannot get a slot is skipped,
//!    and the next one is tried (as vLLM V1 does).
//! 3. The step lasts `(a + b·P + c·C) / speed` ms, where `P` = prompt tokens computed in the step
//!    (cache hits are not computed) and `C` = the sum of context lengths of the decoding requests.
//!    See [`StepCost`] for the calibration.
//!
//! At the end of the step, a request whose pending tokens are all computed samples one token:
//! the first is a [`Event::FirstToken`], the rest [`Event::Token`]; after `output_tokens` tokens
//! it is [`Event::Finished`] and its blocks go back to the pool (full prompt blocks stay in the
//! prefix cache, evictable LRU).
//!
//! ## Deliberate simplifications
//! - The whole prompt's KV is allocated at admission (vLLM V1 allocates per scheduled chunk), so
//!   "admitted only when its blocks fit" holds and a long prompt cannot be half admitted.
//! - Decode tokens do not add to the linear-layer term `b·P`: Vidur's profiles show the forward
//!   pass is flat up to ~128 tokens per batch.
//! - Prefill attention (quadratic in the prompt) is folded into `b` (see [`StepCost`]).
//! - LoRA loading is instant; there is no CPU adapter cache.
//! - Requests always generate exactly `output_tokens` tokens (finish reason "length").

use std::collections::{BTreeSet, VecDeque};

use inference_picker::base::hash::fnv1a64;
use inference_picker::base::ports::SplitMix64;
use serde::{Deserialize, Serialize};

use crate::kv::{KvCache, U64Map};
use crate::lora::LoraSlots;

/// Step-time model: `step_ms = (a_ms + b_ms_per_prefill_token·P + c_ms_per_context_token·C) /
/// speed`, with `P` the uncached prompt tokens computed in the step and `C` the summed context
/// length of the decoding requests.
///
/// Default: Llama-3-8B, bf16, one H100-80GB (derived; see README "Calibration"):
/// - `a = 8.0 ms`. `vidur_derived_nonattention_forward_ms.csv` (microsoft/vidur, MIT): Llama-2-7B
///   on H100, TP1, 1 token = 5.6 ms; Llama-3-8B / Llama-2-7B on A100 TP1 at 1 token =
///   9.70 / 9.28 = 1.045, so Llama-3-8B on H100 ≈ 5.85 ms. Plus ≈2.15 ms for sampling, LM head
///   and scheduling: the johnmusgrave.com point in `published_latency_points.csv` (vLLM, Llama-3.1-8B
///   bf16, A100-40GB) measured 13.3 ms per token against Vidur's 9.70 ms (3.6 ms overhead);
///   scaled by HBM bandwidth (A100 1.6–2.0 TB/s, H100 3.35 TB/s) that is 1.7–2.15 ms, and the
///   upper end is taken because part of the overhead is CPU-side.
/// - `b = 0.022 ms/token`. Same CSV: Llama-2-7B H100 TP1 4096 tokens = 83.21 ms, × 1.051 (the
///   A100 Llama-3-8B / Llama-2-7B ratio at 4096 tokens: 273.25 / 259.92) = 87.5 ms, so
///   (87.5 − 5.85) / 4095 = 0.0199 ms per token for the linear layers; +10 % for prefill
///   attention, which Vidur's table leaves out, gives 0.022 (≈45k prompt tokens/s).
/// - `c = 0.0000391 ms/token`. `LATENCY_NOTES.md` §4–5: KV = 128 KiB per token for Llama-3-8B;
///   reading it at 3.35 TB/s takes 131072 / 3.35e12 s = 3.91e-8 s per context token.
///
/// Check: one request alone decodes at ≈8 ms per token (≈125 tok/s); a 12k-token prompt takes
/// two chunks (8192 + 3808 tokens) ≈ 188 + 92 = 280 ms to its first token.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepCost {
    /// Fixed cost of one step, ms.
    pub a_ms: f64,
    /// Cost per uncached prompt token computed in the step, ms.
    pub b_ms_per_prefill_token: f64,
    /// Cost per context token of each decoding request, ms.
    pub c_ms_per_context_token: f64,
}

impl StepCost {
    /// Llama-3-8B bf16 on one H100-80GB. Derivation in the type's doc.
    pub const LLAMA3_8B_H100: StepCost =
        StepCost { a_ms: 8.0, b_ms_per_prefill_token: 0.022, c_ms_per_context_token: 0.000_039_1 };

    /// A fixed step time (every step, prefill or decode, takes `ms`): predictable timing for
    /// end-to-end tests.
    pub fn fixed(ms: f64) -> StepCost {
        StepCost { a_ms: ms, b_ms_per_prefill_token: 0.0, c_ms_per_context_token: 0.0 }
    }

    /// Duration of one step at `speed` (larger = faster).
    pub fn step_ms(&self, prefill_tokens: u64, decode_context_tokens: u64, speed: f64) -> f64 {
        let raw = self.a_ms
            + self.b_ms_per_prefill_token * prefill_tokens as f64
            + self.c_ms_per_context_token * decode_context_tokens as f64;
        // A step always takes some time, so a discrete-event loop always makes progress.
        (raw / speed).max(MIN_STEP_MS)
    }
}

impl Default for StepCost {
    fn default() -> Self {
        StepCost::LLAMA3_8B_H100
    }
}

/// [`Server::what_if`] copies the server instead of journaling when the queued requests' cache
/// units times this exceed the units in the cache (a copy costs about a memory copy per unit; a
/// journaled look-ahead two hash-table operations per unit it registers or evicts). Measured on
/// the Azure trace: journaling is 3× faster at load 16, copying 1.4× faster past saturation.
pub const WHAT_IF_COPY_RATIO: usize = 16;

/// Shortest possible step, ms.
pub const MIN_STEP_MS: f64 = 1e-6;

/// Configuration of one simulated server. Serde form for benchmark configs: unknown fields are
/// errors; every field has the default documented on it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Largest number of running requests (vLLM `max_num_seqs`). Default 256.
    #[serde(default = "default_max_batch")]
    pub max_batch: u32,
    /// Token budget of one step; longer prompts are prefilled in chunks (vLLM
    /// `max_num_batched_tokens`). Default 8192.
    #[serde(default = "default_max_batched_tokens")]
    pub max_batched_tokens: u32,
    /// Tokens per KV block. Default 16 (vLLM's default).
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// KV blocks on the GPU. Default 25,000 (= 400k tokens at block size 16: Llama-3-8B on one
    /// 80 GB GPU at gpu_memory_utilization 0.9, `LATENCY_NOTES.md` §4).
    #[serde(default = "default_num_gpu_blocks")]
    pub num_gpu_blocks: u64,
    /// Prompt tokens covered by one entry of [`SimRequest::block_hashes`]; a multiple of
    /// `block_size`. Default (`None`): `block_size`, i.e. one hash per KV block like vLLM.
    /// A replay of a trace with coarser hashes (Mooncake: 512) sets it to that size.
    #[serde(default)]
    pub tokens_per_hash: Option<u32>,
    /// Whether LoRA adapters are served (vLLM `--enable-lora`): gates `vllm:lora_requests_info`.
    /// Default false. Requests naming an adapter are refused when false.
    #[serde(default)]
    pub enable_lora: bool,
    /// Adapters loaded at once (vLLM `--max-loras`). Default 1 (vLLM's default).
    #[serde(default = "default_max_lora")]
    pub max_lora: u32,
    /// Step-time model. Default [`StepCost::LLAMA3_8B_H100`].
    #[serde(default)]
    pub cost: StepCost,
    /// Speed factor: every step takes `cost / speed`. Default 1.0; larger is faster.
    #[serde(default = "default_speed")]
    pub speed: f64,
    /// Emit one [`Event::Token`] per generated token after the first. Default true; a replay
    /// that only needs TTFT and completion times turns it off to save memory.
    #[serde(default = "default_true")]
    pub token_events: bool,
}

fn default_max_batch() -> u32 {
    256
}
fn default_max_batched_tokens() -> u32 {
    8192
}
fn default_block_size() -> u32 {
    16
}
fn default_num_gpu_blocks() -> u64 {
    25_000
}
fn default_max_lora() -> u32 {
    1
}
fn default_speed() -> f64 {
    1.0
}
fn default_true() -> bool {
    true
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_batch: default_max_batch(),
            max_batched_tokens: default_max_batched_tokens(),
            block_size: default_block_size(),
            num_gpu_blocks: default_num_gpu_blocks(),
            tokens_per_hash: None,
            enable_lora: false,
            max_lora: default_max_lora(),
            cost: StepCost::default(),
            speed: default_speed(),
            token_events: true,
        }
    }
}

/// A configuration error: the JSON path of the field and the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub path: String,
    pub reason: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.reason)
    }
}

impl std::error::Error for ConfigError {}

impl ServerConfig {
    /// Tokens per hash actually used (`tokens_per_hash` or `block_size`).
    pub fn hash_tokens(&self) -> u32 {
        self.tokens_per_hash.unwrap_or(self.block_size)
    }

    /// Check every field; the first problem found is returned with its JSON path.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |path: &str, reason: String| Err(ConfigError { path: format!("$.{path}"), reason });
        if self.max_batch == 0 {
            return err("max_batch", "must be at least 1".into());
        }
        if self.max_batched_tokens == 0 {
            return err("max_batched_tokens", "must be at least 1".into());
        }
        if self.block_size == 0 {
            return err("block_size", "must be at least 1".into());
        }
        if self.num_gpu_blocks == 0 {
            return err("num_gpu_blocks", "must be at least 1".into());
        }
        let tph = self.hash_tokens();
        if tph == 0 || !tph.is_multiple_of(self.block_size) {
            return err(
                "tokens_per_hash",
                format!("{tph} is not a positive multiple of block_size {}", self.block_size),
            );
        }
        if u64::from(tph / self.block_size) > self.num_gpu_blocks {
            return err("tokens_per_hash", "one hash unit is larger than the whole KV cache".into());
        }
        if self.enable_lora && self.max_lora == 0 {
            return err("max_lora", "must be at least 1 when enable_lora is true".into());
        }
        let c = &self.cost;
        for (name, v) in [
            ("cost.a_ms", c.a_ms),
            ("cost.b_ms_per_prefill_token", c.b_ms_per_prefill_token),
            ("cost.c_ms_per_context_token", c.c_ms_per_context_token),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return err(name, format!("{v} is not a finite number >= 0"));
            }
        }
        if !(self.speed.is_finite() && self.speed > 0.0) {
            return err("speed", format!("{} is not a finite number > 0", self.speed));
        }
        Ok(())
    }
}

/// One request as the model sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimRequest {
    /// Caller's id; must be unique among live (unfinished) requests.
    pub id: u64,
    /// Prompt length in tokens (0 is treated as 1).
    pub prompt_tokens: u32,
    /// Chained hashes of the prompt, one per `tokens_per_hash` tokens, from the start. Only
    /// hashes of *full* units count: entries beyond `prompt_tokens / tokens_per_hash` are
    /// ignored (vLLM caches full blocks only). Empty = no prefix caching for this request.
    pub block_hashes: Vec<u64>,
    /// Tokens to generate (0 is treated as 1).
    pub output_tokens: u32,
    /// LoRA adapter, or None for the base model. The adapter is mixed into the cache keys, so
    /// the same prompt under different adapters never shares KV (as in vLLM).
    pub adapter: Option<String>,
    /// Arrival time, virtual ms.
    pub arrival_ms: f64,
}

/// Something that happened at virtual time `t_ms` (always the end of an engine step).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Event {
    /// The first output token. TTFT = `t_ms − arrival_ms`.
    FirstToken { id: u64, t_ms: f64 },
    /// Output token number `index` (1-based after the first token, which is index 0). Only
    /// when `token_events` is on.
    Token { id: u64, t_ms: f64, index: u32 },
    /// The last token was produced (its FirstToken/Token event comes just before, same `t_ms`).
    /// `cached_tokens` = prompt tokens served from the prefix cache at first admission.
    Finished { id: u64, t_ms: f64, output_tokens: u32, cached_tokens: u32, preemptions: u32 },
    /// Preempted (KV full); it will be re-queued at the front and recomputed.
    Preempted { id: u64, t_ms: f64 },
    /// Dropped because it could not be scheduled even on an idle engine (defensive; not
    /// expected once `submit` accepted it).
    Rejected { id: u64, t_ms: f64 },
}

impl Event {
    pub fn id(&self) -> u64 {
        match *self {
            Event::FirstToken { id, .. }
            | Event::Token { id, .. }
            | Event::Finished { id, .. }
            | Event::Preempted { id, .. }
            | Event::Rejected { id, .. } => id,
        }
    }
    pub fn t_ms(&self) -> f64 {
        match *self {
            Event::FirstToken { t_ms, .. }
            | Event::Token { t_ms, .. }
            | Event::Finished { t_ms, .. }
            | Event::Preempted { t_ms, .. }
            | Event::Rejected { t_ms, .. } => t_ms,
        }
    }
}

/// Why `submit` refused a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubmitError {
    /// A live request already has this id.
    DuplicateId(u64),
    /// Prompt plus output needs more KV blocks than the GPU has, so it could never finish.
    TooLarge { needed_blocks: u64, num_gpu_blocks: u64 },
    /// The request names an adapter but LoRA is disabled.
    LoraDisabled,
}

impl std::fmt::Display for SubmitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SubmitError::DuplicateId(id) => write!(f, "request id {id} is already live"),
            SubmitError::TooLarge { needed_blocks, num_gpu_blocks } => {
                write!(f, "request needs {needed_blocks} KV blocks but the cache has {num_gpu_blocks}")
            }
            SubmitError::LoraDisabled => write!(f, "LoRA adapters are not enabled"),
        }
    }
}

impl std::error::Error for SubmitError {}

/// The model's state, for /metrics and for benchmarks. Counters are cumulative since creation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricsSnapshot {
    /// Virtual time the model has been advanced to.
    pub now_ms: f64,
    /// Requests queued (arrived, not running), including preempted ones.
    pub waiting: u64,
    /// Requests in the running batch.
    pub running: u64,
    /// KV blocks referenced by live requests ÷ total (vLLM `kv_cache_usage_perc`).
    pub kv_usage: f64,
    pub kv_used_blocks: u64,
    /// Blocks holding an unreferenced cached prefix (evictable; count as free in `kv_usage`).
    pub kv_cached_free_blocks: u64,
    pub num_gpu_blocks: u64,
    pub block_size: u32,
    /// Prefix-cache lookups, in prompt tokens (vLLM `prefix_cache_queries`). Counted on every
    /// admission, so a preempted request is counted again when it is re-admitted.
    pub prefix_cache_queries_tokens: u64,
    /// Prefix-cache hits, in tokens (vLLM `prefix_cache_hits`). Hit rate = hits ÷ queries.
    pub prefix_cache_hits_tokens: u64,
    /// Prompt tokens of requests that produced their first token (vLLM `prompt_tokens`).
    pub prompt_tokens_total: u64,
    /// Prompt tokens actually computed (not served from cache), including recomputation.
    pub prefill_tokens_computed: u64,
    /// Output tokens produced.
    pub generation_tokens_total: u64,
    pub requests_submitted: u64,
    pub requests_finished: u64,
    pub requests_aborted: u64,
    pub requests_rejected: u64,
    pub preemptions: u64,
    pub steps: u64,
    /// Cache units held in the prefix cache (referenced or evictable) and evicted so far.
    pub cached_units: u64,
    pub evicted_units: u64,
    pub lora_enabled: bool,
    pub max_lora: u32,
    /// Adapters with a running request, sorted (an idle loaded adapter is not listed).
    pub running_lora_adapters: Vec<String>,
    /// Adapters with a waiting request, sorted.
    pub waiting_lora_adapters: Vec<String>,
    /// Adapters loaded in a slot, running or idle, sorted.
    pub loaded_lora_adapters: Vec<String>,
    pub lora_loads: u64,
    pub lora_evictions: u64,
}

#[derive(Debug, Clone)]
struct Seq {
    id: u64,
    prompt: u32,
    output: u32,
    /// Adapter-mixed cache keys of the prompt's full hash units.
    /// Shared, never changed after `submit`: copying a server (the replay's what-ifs) copies a
    /// pointer, not the keys.
    keys: std::sync::Arc<[u64]>,
    adapter: Option<String>,
    arrival: f64,
    generated: u32,
    /// Tokens whose KV is computed (or served from cache).
    computed: u64,
    /// Tokens to compute before the first sample after the latest admission.
    prefill_target: u64,
    /// Cache units held, in prompt order.
    units: Vec<u32>,
    /// `keys[..registered_upto]` are held in `units` or were computed as private duplicates.
    registered_upto: usize,
    private_blocks: u64,
    /// Tokens the allocated blocks can hold.
    capacity: u64,
    cached_tokens_first: Option<u32>,
    preemptions: u32,
    done: bool,
}

impl Seq {
    fn num_tokens(&self) -> u64 {
        u64::from(self.prompt) + u64::from(self.generated)
    }
}

#[derive(Debug, Clone, Copy)]
struct PlanEntry {
    /// Index into `running` at the start of the step (stable until completion: admissions
    /// append, preemptions pop from the end before the entry is made, aborts only mark).
    idx: usize,
    tokens: u64,
}

#[derive(Debug, Clone)]
struct Step {
    end: f64,
    entries: Vec<PlanEntry>,
}

/// What admitting a waiting request would take.
struct Admission {
    hit_units: usize,
    private_blocks: u64,
    capacity: u64,
}

/// A simulated model server. See the module doc for the protocol.
#[derive(Debug, Clone)]
pub struct Server {
    cfg: ServerConfig,
    hash_tokens: u64,
    blocks_per_unit: u64,
    kv: KvCache,
    lora: LoraSlots,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    inflight: Option<Step>,
    live: U64Map<()>,
    now: f64,
    engine_free_at: f64,
    last_arrival: f64,
    c: Counters,
}

#[derive(Debug, Clone, Default)]
struct Counters {
    queries: u64,
    hits: u64,
    prompt_tokens: u64,
    prefill_computed: u64,
    generated: u64,
    submitted: u64,
    finished: u64,
    aborted: u64,
    rejected: u64,
    preemptions: u64,
    steps: u64,
}

impl Server {
    /// A new idle server at virtual time 0. Fails if the configuration is invalid.
    pub fn new(cfg: ServerConfig) -> Result<Server, ConfigError> {
        cfg.validate()?;
        let hash_tokens = u64::from(cfg.hash_tokens());
        let blocks_per_unit = hash_tokens / u64::from(cfg.block_size);
        let lora_slots = if cfg.enable_lora { cfg.max_lora as usize } else { 0 };
        Ok(Server {
            kv: KvCache::new(cfg.num_gpu_blocks, blocks_per_unit),
            lora: LoraSlots::new(lora_slots),
            hash_tokens,
            blocks_per_unit,
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            inflight: None,
            live: U64Map::default(),
            now: 0.0,
            engine_free_at: 0.0,
            last_arrival: 0.0,
            c: Counters::default(),
        })
    }

    pub fn config(&self) -> &ServerConfig {
        &self.cfg
    }

    /// Virtual time the model has been advanced to.
    pub fn now_ms(&self) -> f64 {
        self.now
    }

    /// Queue a request (see the module doc for arrival-time rules).
    pub fn submit(&mut self, req: SimRequest) -> Result<(), SubmitError> {
        if self.live.contains_key(&req.id) {
            return Err(SubmitError::DuplicateId(req.id));
        }
        if req.adapter.is_some() && !self.cfg.enable_lora {
            return Err(SubmitError::LoraDisabled);
        }
        let prompt = req.prompt_tokens.max(1);
        let output = req.output_tokens.max(1);
        let bs = u64::from(self.cfg.block_size);
        // The largest context this request ever holds KV for: prompt + output − 1 (the last
        // sampled token is never fed back).
        let needed_blocks = (u64::from(prompt) + u64::from(output) - 1).div_ceil(bs);
        if needed_blocks > self.cfg.num_gpu_blocks {
            return Err(SubmitError::TooLarge { needed_blocks, num_gpu_blocks: self.cfg.num_gpu_blocks });
        }
        let full_units = (u64::from(prompt) / self.hash_tokens) as usize;
        let salt = req.adapter.as_deref().map(adapter_salt);
        let keys = req
            .block_hashes
            .iter()
            .take(full_units)
            .map(|&h| match salt {
                Some(s) => SplitMix64::mix(h ^ s),
                None => h,
            })
            .collect::<Vec<u64>>()
            .into();
        let arrival = if req.arrival_ms.is_finite() { req.arrival_ms } else { self.now };
        let arrival = arrival.max(self.now).max(self.last_arrival);
        self.last_arrival = arrival;
        self.live.insert(req.id, ());
        self.c.submitted += 1;
        self.waiting.push_back(Seq {
            id: req.id,
            prompt,
            output,
            keys,
            adapter: req.adapter,
            arrival,
            generated: 0,
            computed: 0,
            prefill_target: 0,
            units: Vec::new(),
            registered_upto: 0,
            private_blocks: 0,
            capacity: 0,
            cached_tokens_first: None,
            preemptions: 0,
            done: false,
        });
        Ok(())
    }

    /// Receives a prompt's KV from a remote prefill (P/D disaggregation, as vLLM's KV
    /// connector does on a decode pod): every full hash unit of the prompt that is not cached
    /// yet is stored as a cached, unreferenced (evictable) unit, evicting least-recently-used
    /// ones for room, so that the request submitted next finds the prompt cached. Stops at the
    /// first unit that cannot get room. Returns the prompt tokens now held in whole units
    /// (as [`Server::cached_prefix_tokens`]). Takes no engine time: the transfer is not modelled.
    pub fn import_prefix(&mut self, block_hashes: &[u64], prompt_tokens: u32, adapter: Option<&str>) -> u64 {
        let full_units = (u64::from(prompt_tokens.max(1)) / self.hash_tokens) as usize;
        let salt = adapter.map(adapter_salt);
        // Units of this prompt are held (referenced) until the end, so that making room for a
        // later unit never evicts an earlier one.
        let mut held: Vec<u32> = Vec::new();
        for &h in block_hashes.iter().take(full_units) {
            let key = match salt {
                Some(s) => SplitMix64::mix(h ^ s),
                None => h,
            };
            if self.kv.lookup_prefix(&[key]) == 1 {
                if !self.kv.can_admit(&[key], 0) {
                    break;
                }
                held.extend(self.kv.acquire(&[key]));
                continue;
            }
            if !self.kv.allocate(self.blocks_per_unit) {
                break;
            }
            match self.kv.register(key) {
                Some(id) => held.push(id),
                None => {
                    self.kv.release_private(self.blocks_per_unit);
                    break;
                }
            }
        }
        self.kv.release_units(held.into_iter().rev());
        self.cached_prefix_tokens(block_hashes, prompt_tokens, adapter)
    }

    /// Cancel a live request (client went away). Frees its KV and LoRA slot at once; it
    /// produces no further events. Returns false if the id is not live.
    pub fn abort(&mut self, id: u64) -> bool {
        if self.live.remove(&id).is_none() {
            return false;
        }
        self.c.aborted += 1;
        if let Some(pos) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(pos);
            return true;
        }
        if let Some(seq) = self.running.iter_mut().find(|s| s.id == id && !s.done) {
            // Marked, not removed: a step in flight refers to running requests by index.
            release(&mut self.kv, &mut self.lora, seq);
            seq.done = true;
        }
        true
    }

    /// Run the engine up to `now_ms` (see the module doc). Events are in time order.
    pub fn advance_to(&mut self, now_ms: f64) -> Vec<Event> {
        let mut out = Vec::new();
        self.advance_into(now_ms, &mut out);
        out
    }

    /// Like [`Server::advance_to`], appending to `out` (lets a replay reuse one buffer).
    /// `f64::INFINITY` runs every queued request to completion; NaN does nothing.
    pub fn advance_into(&mut self, now_ms: f64, out: &mut Vec<Event>) {
        if now_ms.is_nan() {
            return;
        }
        loop {
            if let Some(step) = &self.inflight {
                if step.end > now_ms {
                    break;
                }
                if let Some(step) = self.inflight.take() {
                    self.complete(step, out);
                }
                continue;
            }
            let Some(start) = self.next_start() else { break };
            if start > now_ms {
                break;
            }
            if !self.start_step(start, out) {
                break;
            }
        }
        // An infinite "now" drains the queue but must not push later arrivals to infinity.
        if now_ms.is_finite() && now_ms > self.now {
            self.now = now_ms;
        }
    }

    /// The next virtual time at which the model changes state on its own: the end of the step
    /// in flight, else the start of the next step if requests are waiting; None when idle.
    pub fn next_wakeup(&self) -> Option<f64> {
        match &self.inflight {
            Some(step) => Some(step.end),
            None => self.next_start(),
        }
    }

    /// True when nothing is running, waiting or in flight.
    pub fn is_idle(&self) -> bool {
        self.inflight.is_none() && self.waiting.is_empty() && self.running.iter().all(|s| s.done)
    }

    /// Prompt tokens of a request (as it would be submitted: `block_hashes`, `prompt_tokens`,
    /// `adapter`) that this server's KV cache holds right now, in whole hash units: the view a
    /// router gets from the engine's KV events (block stored / removed). Changes nothing.
    pub fn cached_prefix_tokens(
        &self,
        block_hashes: &[u64],
        prompt_tokens: u32,
        adapter: Option<&str>,
    ) -> u64 {
        let full_units = (u64::from(prompt_tokens.max(1)) / self.hash_tokens) as usize;
        let salt = adapter.map(adapter_salt);
        let keys: Vec<u64> = block_hashes
            .iter()
            .take(full_units)
            .map(|&h| match salt {
                Some(s) => SplitMix64::mix(h ^ s),
                None => h,
            })
            .collect();
        self.kv.lookup_prefix(&keys) as u64 * self.hash_tokens
    }

    /// Runs `f` on this server, then puts the server back exactly as it was (every field,
    /// including the KV cache's contents and LRU order): the what-if a replay's
    /// perfect-information picker runs for every candidate of every request. Two ways, the same
    /// result, whichever is cheaper: on a copy of the server when the queue is long (the
    /// look-ahead then registers and evicts many cache units, and undoing each costs more than
    /// copying the cache once), else on the server itself with the cache's undo journal
    /// ([`Server::what_if_journaled`]).
    pub fn what_if<R>(&mut self, f: impl FnOnce(&mut Server) -> R) -> R {
        let queued_units: usize = self.waiting.iter().map(|s| s.keys.len()).sum();
        if queued_units.saturating_mul(WHAT_IF_COPY_RATIO) > self.kv.cached_units() {
            let mut copy = self.clone();
            return f(&mut copy);
        }
        self.what_if_journaled(f)
    }

    /// [`Server::what_if`] always through the journal: the KV cache is changed in place and
    /// rolled back, the rest restored from a copy. `f` must not start another what-if on the
    /// same server.
    pub fn what_if_journaled<R>(&mut self, f: impl FnOnce(&mut Server) -> R) -> R {
        let kv = std::mem::replace(&mut self.kv, KvCache::new(0, 1));
        let mut saved = self.clone();
        self.kv = kv;
        self.kv.begin_journal();
        let r = f(self);
        self.kv.rollback();
        std::mem::swap(&mut saved.kv, &mut self.kv);
        *self = saved;
        r
    }

    /// What-if: make this server's prefix cache hold the first `units` full hash units of a
    /// prompt (`block_hashes`, `adapter` as in [`SimRequest`]), as evictable cached blocks,
    /// evicting its least recently freed units for room. Returns how many of those units are
    /// cached afterwards (fewer when the KV is full of running requests). Meant for a copy of a
    /// server that a router simulates (a picker's belief about the cache), not for the server a
    /// replay measures.
    pub fn assume_cached_prefix(
        &mut self,
        block_hashes: &[u64],
        units: usize,
        adapter: Option<&str>,
    ) -> usize {
        let salt = adapter.map(adapter_salt);
        let mut n = 0;
        for &h in block_hashes.iter().take(units) {
            let key = match salt {
                Some(s) => SplitMix64::mix(h ^ s),
                None => h,
            };
            if !self.kv.insert_cached(key) {
                break;
            }
            n += 1;
        }
        n
    }

    /// The current state and counters.
    pub fn metrics_snapshot(&self) -> MetricsSnapshot {
        let waiting_adapters: BTreeSet<&str> = self
            .waiting
            .iter()
            .filter(|s| s.arrival <= self.now)
            .filter_map(|s| s.adapter.as_deref())
            .collect();
        let total = self.kv.total_blocks();
        MetricsSnapshot {
            now_ms: self.now,
            waiting: self.waiting.iter().filter(|s| s.arrival <= self.now).count() as u64,
            running: self.running.iter().filter(|s| !s.done).count() as u64,
            kv_usage: if total == 0 { 0.0 } else { self.kv.used_blocks() as f64 / total as f64 },
            kv_used_blocks: self.kv.used_blocks(),
            kv_cached_free_blocks: self.kv.cached_free_blocks(),
            num_gpu_blocks: total,
            block_size: self.cfg.block_size,
            prefix_cache_queries_tokens: self.c.queries,
            prefix_cache_hits_tokens: self.c.hits,
            prompt_tokens_total: self.c.prompt_tokens,
            prefill_tokens_computed: self.c.prefill_computed,
            generation_tokens_total: self.c.generated,
            requests_submitted: self.c.submitted,
            requests_finished: self.c.finished,
            requests_aborted: self.c.aborted,
            requests_rejected: self.c.rejected,
            preemptions: self.c.preemptions,
            steps: self.c.steps,
            cached_units: self.kv.cached_units() as u64,
            evicted_units: self.kv.evicted_units(),
            lora_enabled: self.cfg.enable_lora,
            max_lora: self.lora.max() as u32,
            running_lora_adapters: self.lora.running_adapters(),
            waiting_lora_adapters: waiting_adapters.into_iter().map(str::to_string).collect(),
            loaded_lora_adapters: self.lora.loaded_adapters(),
            lora_loads: self.lora.loads(),
            lora_evictions: self.lora.evictions(),
        }
    }

    fn next_start(&self) -> Option<f64> {
        // Running requests always have a token pending: the next step starts when the engine
        // is free.
        if self.running.iter().any(|s| !s.done) {
            return Some(self.engine_free_at);
        }
        // Preempted requests at the front arrived long ago; the rest are in arrival order, so the
        // front holds the earliest arrival.
        self.waiting.front().map(|s| s.arrival.max(self.engine_free_at))
    }

    /// Plan and start one step at `start`. False if there was nothing to run.
    fn start_step(&mut self, start: f64, out: &mut Vec<Event>) -> bool {
        let mut empty_plans = 0;
        loop {
            match self.plan_step(start, out) {
                Some(step) => {
                    self.c.steps += 1;
                    self.inflight = Some(step);
                    return true;
                }
                None => {
                    empty_plans += 1;
                    let head_eligible = self.waiting.front().is_some_and(|s| s.arrival <= start);
                    let nothing_running = self.running.iter().all(|s| s.done);
                    // A plan can come out empty once when its only running request preempted
                    // itself (no admissions after a preemption); planning again admits from the
                    // queue.
                    if empty_plans == 1 && nothing_running && head_eligible {
                        continue;
                    }
                    // Defensive: with nothing running, the head of the queue must fit (submit
                    // checked its size; idle adapters can be evicted). If it still cannot be
                    // scheduled, drop it so the engine never stalls.
                    if nothing_running && head_eligible {
                        if let Some(seq) = self.waiting.pop_front() {
                            self.live.remove(&seq.id);
                            self.c.rejected += 1;
                            out.push(Event::Rejected { id: seq.id, t_ms: start });
                            continue;
                        }
                    }
                    self.engine_free_at = self.engine_free_at.max(start);
                    return false;
                }
            }
        }
    }

    fn plan_step(&mut self, start: f64, out: &mut Vec<Event>) -> Option<Step> {
        self.running.retain(|s| !s.done);
        let bs = u64::from(self.cfg.block_size);
        let mut budget = u64::from(self.cfg.max_batched_tokens);
        let mut entries = Vec::new();
        let mut prefill_tokens = 0u64;
        let mut decode_ctx = 0u64;
        let mut preempted = false;

        // 1. Running requests, oldest first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let Some(seq) = self.running.get(i) else { break };
            let pending = seq.num_tokens().saturating_sub(seq.computed);
            let n = pending.min(budget);
            let need = seq.computed + n;
            let mut scheduled = true;
            if need > seq.capacity {
                let blocks = (need - seq.capacity).div_ceil(bs);
                loop {
                    if self.kv.allocate(blocks) {
                        if let Some(seq) = self.running.get_mut(i) {
                            seq.private_blocks += blocks;
                            seq.capacity += blocks * bs;
                        }
                        break;
                    }
                    // KV full: preempt the newest running request (possibly this one).
                    let victim = self.running.len() - 1;
                    self.preempt_last(start, out);
                    preempted = true;
                    if victim == i {
                        scheduled = false;
                        break;
                    }
                }
            }
            if !scheduled {
                break;
            }
            let Some(seq) = self.running.get(i) else { break };
            if seq.computed < seq.prefill_target {
                prefill_tokens += n;
            } else {
                decode_ctx += seq.computed + 1;
            }
            budget -= n;
            entries.push(PlanEntry { idx: i, tokens: n });
            i += 1;
        }

        // 2. Waiting requests, FIFO, unless this step preempted (as vLLM V1).
        if !preempted {
            let mut w = 0;
            while budget > 0 && self.running.len() < self.cfg.max_batch as usize {
                let Some(seq) = self.waiting.get(w) else { break };
                if seq.arrival > start {
                    break;
                }
                if let Some(a) = seq.adapter.as_deref() {
                    if !self.lora.can_schedule(a) {
                        w += 1;
                        continue;
                    }
                }
                let adm = self.admission(seq);
                let hit_keys = seq.keys.get(..adm.hit_units).unwrap_or(&[]);
                if !self.kv.can_admit(hit_keys, adm.private_blocks) {
                    break; // strict FIFO on KV: later requests do not jump the queue
                }
                let Some(mut seq) = self.waiting.remove(w) else { break };
                self.admit(&mut seq, &adm);
                let n = (seq.prefill_target - seq.computed).min(budget);
                prefill_tokens += n;
                budget -= n;
                entries.push(PlanEntry { idx: self.running.len(), tokens: n });
                self.running.push(seq);
            }
        }

        if entries.is_empty() {
            return None;
        }
        self.c.prefill_computed += prefill_tokens;
        let dur = self.cfg.cost.step_ms(prefill_tokens, decode_ctx, self.cfg.speed);
        Some(Step { end: start + dur, entries })
    }

    fn admission(&self, seq: &Seq) -> Admission {
        let ctx = seq.num_tokens();
        // At least one token is always computed, so a fully cached prompt still runs a step
        // (vLLM caps the hit at num_tokens − 1, in whole blocks).
        let max_hit_units = ((ctx - 1) / self.hash_tokens) as usize;
        let hit_units = self.kv.lookup_prefix(&seq.keys).min(max_hit_units);
        let unit_tokens = seq.keys.len() as u64 * self.hash_tokens;
        let tail_blocks = (ctx - unit_tokens).div_ceil(u64::from(self.cfg.block_size));
        let private_blocks = (seq.keys.len() - hit_units) as u64 * self.blocks_per_unit + tail_blocks;
        let capacity = unit_tokens + tail_blocks * u64::from(self.cfg.block_size);
        Admission { hit_units, private_blocks, capacity }
    }

    fn admit(&mut self, seq: &mut Seq, adm: &Admission) {
        let hit_keys = seq.keys.get(..adm.hit_units).unwrap_or(&[]);
        seq.units = self.kv.acquire(hit_keys);
        // can_admit was checked just before, so this succeeds.
        let _ = self.kv.allocate(adm.private_blocks);
        seq.private_blocks = adm.private_blocks;
        seq.capacity = adm.capacity;
        let hit_tokens = adm.hit_units as u64 * self.hash_tokens;
        seq.computed = hit_tokens;
        seq.prefill_target = seq.num_tokens();
        seq.registered_upto = adm.hit_units;
        self.c.queries += seq.num_tokens();
        self.c.hits += hit_tokens;
        if seq.cached_tokens_first.is_none() {
            seq.cached_tokens_first = Some(hit_tokens as u32);
        }
        if let Some(a) = seq.adapter.as_deref() {
            self.lora.start(a);
        }
    }

    fn preempt_last(&mut self, t: f64, out: &mut Vec<Event>) {
        let Some(mut seq) = self.running.pop() else { return };
        release(&mut self.kv, &mut self.lora, &mut seq);
        seq.preemptions += 1;
        self.c.preemptions += 1;
        out.push(Event::Preempted { id: seq.id, t_ms: t });
        self.waiting.push_front(seq);
    }

    fn complete(&mut self, step: Step, out: &mut Vec<Event>) {
        let t = step.end;
        for e in &step.entries {
            let Some(seq) = self.running.get_mut(e.idx) else { continue };
            if seq.done {
                continue; // aborted during the step
            }
            seq.computed += e.tokens;
            // Full hash units whose KV is now computed become shareable prefix-cache entries.
            while let Some(&key) = seq.keys.get(seq.registered_upto) {
                if (seq.registered_upto as u64 + 1) * self.hash_tokens > seq.computed {
                    break;
                }
                if let Some(id) = self.kv.register(key) {
                    seq.units.push(id);
                    seq.private_blocks = seq.private_blocks.saturating_sub(self.blocks_per_unit);
                }
                seq.registered_upto += 1;
            }
            if seq.computed < seq.num_tokens() {
                continue; // mid-prefill chunk: nothing sampled yet
            }
            seq.generated += 1;
            self.c.generated += 1;
            if seq.generated == 1 {
                self.c.prompt_tokens += u64::from(seq.prompt);
                out.push(Event::FirstToken { id: seq.id, t_ms: t });
            } else if self.cfg.token_events {
                out.push(Event::Token { id: seq.id, t_ms: t, index: seq.generated - 1 });
            }
            if seq.generated >= seq.output {
                out.push(Event::Finished {
                    id: seq.id,
                    t_ms: t,
                    output_tokens: seq.generated,
                    cached_tokens: seq.cached_tokens_first.unwrap_or(0),
                    preemptions: seq.preemptions,
                });
                self.c.finished += 1;
                self.live.remove(&seq.id);
                release(&mut self.kv, &mut self.lora, seq);
                seq.done = true;
            }
        }
        self.running.retain(|s| !s.done);
        self.engine_free_at = t;
        if t > self.now {
            self.now = t;
        }
    }
}

/// Give back a request's KV blocks (prefix units tail first) and its LoRA slot, and reset it
/// for recomputation.
fn release(kv: &mut KvCache, lora: &mut LoraSlots, seq: &mut Seq) {
    let units = std::mem::take(&mut seq.units);
    kv.release_units(units.into_iter().rev());
    kv.release_private(seq.private_blocks);
    seq.private_blocks = 0;
    seq.capacity = 0;
    seq.computed = 0;
    seq.registered_upto = 0;
    if let Some(a) = seq.adapter.as_deref() {
        lora.stop(a);
    }
}

/// Stable 64-bit salt for an adapter name (FNV-1a, then mixed).
fn adapter_salt(name: &str) -> u64 {
    SplitMix64::mix(fnv1a64(name.as_bytes()))
}

#[cfg(test)]
#[path = "model_tests.rs"]
mod tests;
