//! inference-picker: a Gateway API Inference Extension style endpoint picker that runs inside
//! Envoy as a proxy-wasm module.
//!
//! Layout (pure core, thin shell):
//! - everything outside `host` is pure: no proxy-wasm host calls, unit-tested natively; time,
//!   randomness and the shared store are passed in through `ports`;
//! - `host` owns every host call: the root contexts (filter root and poller singleton), the HTTP
//!   context, and the adapters that implement `ports` on top of proxy-wasm.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)
)]

pub mod admission;
pub mod body;
pub mod by_address;
pub mod config;
pub mod discovery;
pub mod errors;
pub mod fairshare;
pub mod flow;
#[cfg(not(target_family = "wasm"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod health;
pub mod inflight;
pub mod lease;
pub mod live_config;
pub mod load;
pub mod metrics;
pub mod pd;
pub mod peers;
pub mod pod_models;
pub mod poller;
pub mod pools;
pub mod ports;
pub mod priority;
pub mod rates;
pub mod request;
pub mod saturation;
pub mod scheduler;
pub mod snapshot;
pub mod sorting;
pub mod telemetry;

mod host;
