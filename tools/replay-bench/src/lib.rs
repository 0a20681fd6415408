//! replay-bench: the routing replay benchmark (`make bench-routing`).
//!
//! A discrete-event replay in virtual time: a trace's requests go through N simulated model
//! servers (`model_server_sim::Server`, the same pure model as the HTTP simulator) and are routed
//! by the real scheduler core (`inference_picker::scheduler`, compiled natively) or by a baseline
//! policy, every router seeing only what it would see inside Envoy: polled, parsed, delayed
//! metrics snapshots and its own in-flight counts.
//!
//! - [`trace`]: Mooncake / Azure loaders, the llm-d shared-prefix generator, LoRA and tier mixes;
//! - [`text`]: pseudo-text, chat bodies and server-side block hashes;
//! - [`strategy`]: the strategies and their configurations; [`sglang`]: SGLang's cache-aware
//!   policy; [`dynamo`]: Dynamo's KV router; [`oracle`]: the perfect-information picker;
//! - [`arrivals`]: bursty re-timings of a trace; [`bursts`]: the burst study (`--bursts`);
//! - [`slo`]: the tiered-SLO study (`--slo`) and the modelled llm-d SLO admitter and scorer;
//! - [`grid`]: the robustness grid of synthetic workloads (`--robust`, `make bench-robust`);
//! - [`replay`]: the event loop; [`stats`]: measurements; [`suite`]: the default benchmark set
//!   and the report.

pub mod arrivals;
pub mod bursts;
pub mod dynamo;
pub mod grid;
pub mod oracle;
pub mod pd;
pub mod replay;
pub mod report;
pub mod sglang;
pub mod slo;
pub mod slo_policy;
pub mod stats;
pub mod strategy;
pub mod suite;
pub mod text;
pub mod trace;
