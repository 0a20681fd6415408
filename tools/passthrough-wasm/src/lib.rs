//! The pass-through wasm filter: the baseline that `make bench-envoy` measures inference-picker
//! against (see `tools/bench-envoy/README.md`).
//!
//! It does what any filter that routes on the body must do in Envoy, and nothing else: it pauses
//! on the request headers, lets Envoy buffer the body until `end_of_stream`, copies the whole body
//! into the VM once, and sets one request header (`x-passthrough-body-bytes: <length>`). So the
//! cost of inference-picker above this filter is the module's own work (parsing, scoring, shared
//! data, metrics), not the price of running a body-reading wasm filter at all.
//!
//! Inputs: none but the request. A request without a body (headers with `end_of_stream`) gets the
//! header with `0`. A host call that fails is ignored (the request continues unchanged): a
//! benchmark baseline must never stop traffic.
//!
//! This crate is its own thin shell (it has no decisions to keep pure), so it calls the host
//! directly through `proxy_wasm::hostcalls`, which return a `Status` where the SDK's wrappers
//! would panic.
#![allow(clippy::disallowed_methods)]

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

/// The one header the filter sets.
const HEADER: &str = "x-passthrough-body-bytes";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(PassRoot) });
}}

struct PassRoot;

impl Context for PassRoot {}

impl RootContext for PassRoot {
    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Pass))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Pass;

impl Pass {
    fn set_length(&self, len: usize) {
        // Ignored on failure: see the module doc.
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, HEADER, Some(&len.to_string()));
    }
}

impl Context for Pass {}

impl HttpContext for Pass {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            self.set_length(0);
            return Action::Continue;
        }
        // Wait for the body (needs `allow_on_headers_stop_iteration: true` in the PluginConfig).
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            // Envoy keeps buffering; `body_size` is the cumulative size.
            return Action::Pause;
        }
        let len = match hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size) {
            Ok(Some(body)) => body.len(),
            Ok(None) | Err(_) => 0,
        };
        self.set_length(len);
        Action::Continue
    }
}
