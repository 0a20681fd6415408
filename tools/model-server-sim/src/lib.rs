//! A simulated model server for end-to-end tests and replay benchmarks of inference-picker.
//!
//! - [`model`]: the pure server model (continuous batching, chunked prefill, paged KV cache with
//!   prefix caching, LoRA slots, recompute preemption) in virtual time. No clock, no I/O, no
//!   async: a discrete-event benchmark drives it directly.
//! - [`render`]: Prometheus text in vLLM V1, SGLang or trtllm-serve names.
//! - [`prompt`]: token estimate and chained block hashes from prompt text.
//! - `http` (feature `server`, on by default): the HTTP shell used by the `model-server-sim`
//!   binary, which runs the same model in real time behind an OpenAI-compatible API.
//!
//! Driving the model by hand (default calibration: a = 8 ms, b = 0.022 ms per prompt token):
//!
//! ```
//! use model_server_sim::{Event, Server, ServerConfig, SimRequest};
//!
//! let mut s = Server::new(ServerConfig::default()).unwrap();
//! let req = SimRequest {
//!     id: 1,
//!     prompt_tokens: 1000,
//!     block_hashes: vec![],
//!     output_tokens: 2,
//!     adapter: None,
//!     arrival_ms: 0.0,
//! };
//! s.submit(req).unwrap();
//! let mut events = Vec::new();
//! while let Some(t) = s.next_wakeup() {
//!     events.extend(s.advance_to(t));
//! }
//! // Prefill of 1000 tokens: 8 + 0.022 × 1000 = 30 ms to the first token.
//! assert!(matches!(events[0], Event::FirstToken { id: 1, t_ms } if (t_ms - 30.0).abs() < 1e-9));
//! assert!(matches!(events.last(), Some(Event::Finished { id: 1, output_tokens: 2, .. })));
//! ```
//!
//! No panics on any path a request reaches: non-test code denies unwrap, expect, panic and
//! unchecked indexing.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)
)]

mod kv;
mod lora;
pub mod model;
pub mod prompt;
pub mod render;

#[cfg(feature = "server")]
pub mod http;

pub use model::{
    ConfigError, Event, MetricsSnapshot, Server, ServerConfig, SimRequest, StepCost, SubmitError, MIN_STEP_MS,
};
pub use render::{render_metrics, Engine, LoraInfoHistory, RenderInfo};

impl Server {
    /// This server's metrics as `engine` would expose them (current snapshot, no LoRA history).
    pub fn render_metrics(&self, engine: Engine, info: &RenderInfo<'_>) -> String {
        render_metrics(engine, &self.metrics_snapshot(), info)
    }
}
