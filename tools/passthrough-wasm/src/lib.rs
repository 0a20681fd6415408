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
//! **Parse floor** (issue #12). With the plugin configuration `parse`, the filter also checks that
//! the body is well-formed JSON (`serde_json` into `IgnoredAny`: no value is built, no string
//! kept) before setting the header (`0` when it is not JSON). Any filter that routes on an OpenAI
//! body must at least do this, so `bench-envoy` measures it as the floor under the module's cost
//! per request.
//!
//! **Poll floor** (issue #19). With a plugin configuration of the form
//! `poll <scrapes_per_s> <headers|body> <cluster> <path> <host:port> [<host:port> ...]`, the root
//! context also sends `GET <path>` to the listed addresses round robin through `<cluster>` (an
//! `ORIGINAL_DST` cluster reading `x-envoy-original-dst-host`, as the module's poller does) at the
//! given rate, from a 20 ms tick, and on each response either does nothing more (`headers`) or
//! also copies the whole body into the VM (`body`). It parses nothing and publishes nothing: it
//! is the floor of what any proxy-wasm poller pays per scrape in Envoy, so `bench-envoy` can say
//! how much of the module's cost per scrape is Envoy's callout and how much is the module's own.
//! A configuration it cannot read turns polling off (the filter still works).
//!
//! This crate is its own thin shell (it has no decisions to keep pure), so it calls the host
//! directly through `proxy_wasm::hostcalls`, which return a `Status` where the SDK's wrappers
//! would panic.
#![allow(clippy::disallowed_methods)]

use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

/// The one header the filter sets.
const HEADER: &str = "x-passthrough-body-bytes";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(PassRoot::default()) });
}}

/// Tick of the poll floor.
const TICK_MS: u64 = 20;

#[derive(Default)]
struct PassRoot {
    poll: Option<PollFloor>,
    parse: bool,
}

/// What `poll ...` configures (see the module doc).
struct PollFloor {
    per_tick: f64,
    read_body: bool,
    cluster: String,
    path: String,
    addresses: Vec<String>,
    /// Fractional scrapes carried to the next tick, so any rate is kept on average.
    owed: f64,
    next: usize,
}

impl PollFloor {
    fn parse(text: &str) -> Option<PollFloor> {
        let mut it = text.split_whitespace();
        if it.next()? != "poll" {
            return None;
        }
        let rate: f64 = it.next()?.parse().ok().filter(|r: &f64| r.is_finite() && *r > 0.0)?;
        let read_body = match it.next()? {
            "body" => true,
            "headers" => false,
            _ => return None,
        };
        let cluster = it.next()?.to_string();
        let path = it.next()?.to_string();
        let addresses: Vec<String> = it.map(str::to_string).collect();
        if addresses.is_empty() {
            return None;
        }
        Some(PollFloor {
            per_tick: rate * TICK_MS as f64 / 1000.0,
            read_body,
            cluster,
            path,
            addresses,
            owed: 0.0,
            next: 0,
        })
    }
}

impl Context for PassRoot {
    fn on_http_call_response(
        &mut self,
        _token_id: u32,
        _num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if self.poll.as_ref().is_some_and(|p| p.read_body) {
            let _ = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size);
        }
    }
}

impl RootContext for PassRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let text = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(Some(b)) => String::from_utf8(b).unwrap_or_default(),
            _ => String::new(),
        };
        self.poll = PollFloor::parse(&text);
        self.parse = text.trim() == "parse";
        if self.poll.is_some() {
            let _ = hostcalls::set_tick_period(Duration::from_millis(TICK_MS));
        }
        true
    }

    fn on_tick(&mut self) {
        let Some(p) = self.poll.as_mut() else { return };
        p.owed += p.per_tick;
        let mut due = Vec::new();
        while p.owed >= 1.0 {
            p.owed -= 1.0;
            due.push(p.addresses[p.next % p.addresses.len()].clone());
            p.next = p.next.wrapping_add(1);
        }
        let (cluster, path) = (p.cluster.clone(), p.path.clone());
        for address in &due {
            let headers = vec![
                (":method", "GET"),
                (":path", path.as_str()),
                (":authority", address.as_str()),
                (":scheme", "http"),
                ("accept", "text/plain"),
                ("x-envoy-original-dst-host", address.as_str()),
            ];
            // The trait's call registers the token with the SDK's dispatcher, which routes the
            // response back here. Ignored on failure: see the module doc.
            let _ = self.dispatch_http_call(&cluster, headers, None, vec![], Duration::from_secs(1));
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Pass { parse: self.parse }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Pass {
    /// Check the body is JSON (the parse floor).
    parse: bool,
}

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
            Ok(Some(body)) if self.parse => match serde_json::from_slice::<serde::de::IgnoredAny>(&body) {
                Ok(_) => body.len(),
                Err(_) => 0,
            },
            Ok(Some(body)) => body.len(),
            Ok(None) | Err(_) => 0,
        };
        self.set_length(len);
        Action::Continue
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_configuration_is_read_word_by_word() {
        let p = PollFloor::parse("poll 200 body metrics /metrics 127.0.0.2:8000 127.0.0.3:8000").unwrap();
        assert!(p.read_body);
        assert_eq!((p.cluster.as_str(), p.path.as_str()), ("metrics", "/metrics"));
        assert_eq!(p.addresses, ["127.0.0.2:8000", "127.0.0.3:8000"]);
        // 200 per second is 4 per 20 ms tick.
        assert!((p.per_tick - 4.0).abs() < 1e-9);
        assert!(!PollFloor::parse("poll 0.5 headers c /m a:1").unwrap().read_body);
    }

    #[test]
    fn a_poll_configuration_it_cannot_read_turns_polling_off() {
        for text in [
            "",
            "parse",
            "poll",
            "poll 200 body c /m",           // no address
            "poll 0 body c /m a:1",         // no rate
            "poll -5 body c /m a:1",        // negative rate
            "poll NaN body c /m a:1",       // not a rate
            "poll 200 everything c /m a:1", // neither headers nor body
            "pull 200 body c /m a:1",
        ] {
            assert!(PollFloor::parse(text).is_none(), "{text:?}");
        }
    }
}
