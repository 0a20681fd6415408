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

pub mod base;
pub mod config;
pub mod flow;
#[cfg(not(target_family = "wasm"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod poll;
pub mod request;
pub mod scheduler;
pub mod state;

mod host;
