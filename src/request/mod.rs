//! The per-request pipeline, pure: what the HTTP filter does with the request headers and the
//! buffered body. The host gathers inputs through host calls, calls these functions, and maps
//! the returned decision onto host calls (set headers, replace body, local reply).
//!
//! Order for one request:
//! 1. request headers: [`RequestHead`] is read (the session id, see [`session`], and the
//!    trusted priority headers, see `crate::flow::priority`), then every header in [`headers_to_remove`] is removed; [`on_head`]
//!    decides whether to read the body;
//! 2. complete body: [`prepare`] parses it, resolves the model (rewrite/split, base model) and
//!    the priority; the host applies the body rewrite at once;
//! 3. admission (`crate::flow::admission`): go on now, hold, or reject;
//! 4. when the request goes on (at once, or when flow control releases it): [`route`] picks the
//!    endpoint with the metrics and in-flight counts of *that* moment.
//!
//! Anthropic's token count (`POST /v1/messages/count_tokens`) is not a generation: it skips step
//! 3, and [`route_token_count`] picks the least-loaded healthy pod serving its model, recording
//! nothing (no prefix placement, no prefill, no in-flight count: the host adds none).
//!
//! The files: `head` (the request headers: [`RequestHead`], [`on_head`] and its path policy),
//! `pipeline` ([`prepare`], [`route`], [`on_body`]) and `models` (the model list); their items are
//! re-exported here.

pub mod anthropic;
pub mod body;
pub mod config;
pub mod decision;
pub mod head;
pub mod models;
pub mod pd;
pub mod pipeline;
pub mod pools;
pub mod protocol;
pub mod session;
pub mod usage;

#[cfg(test)]
mod tests_support;

pub use self::head::{
    conformance_selection, headers_to_remove, on_head, restrict_to_selection, too_large, HeadDecision,
    LocalReply, RequestHead,
};
pub use self::models::{model_list, model_object, models_reply};
pub use self::pipeline::{
    criticality_of, on_body, prepare, prepare_routed, route, route_token_count, truncate_prompt, Prepared,
    Routed,
};
