//! Host adapters: the only functions that call proxy-wasm. Everything returns our own types;
//! host statuses are mapped here so the rest of the module never sees them.
//!
//! Note on panics: the SDK's `hostcalls` functions panic on statuses they consider impossible
//! (for example `get_shared_data` on anything but Ok/NotFound). Envoy does not return those for
//! the calls made here; the one call whose failure is plausible in practice, sending a local
//! reply on a stream that is already closing, goes through our own import with its status
//! handled.

use std::time::{Duration, UNIX_EPOCH};

use log::warn;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, Status};

use crate::errors::Rejection;
use crate::ports::{SharedStore, StoreError};

/// proxy-wasm shared data.
pub struct HostStore;

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(v), cas)) => Ok(Some((v, cas.unwrap_or(0)))),
            // The SDK reports an EMPTY stored value as no value, but with the key's CAS token:
            // the key exists (the shared-data "removed" convention), and callers need the token.
            Ok((None, Some(cas))) if cas != 0 => Ok(Some((Vec::new(), cas))),
            Ok((None, _)) => Ok(None),
            Err(s) => Err(StoreError::Host(format!("{s:?}"))),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        let cas = if cas == 0 { None } else { Some(cas) };
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(StoreError::CasMismatch),
            Err(s) => Err(StoreError::Host(format!("{s:?}"))),
        }
    }
}

/// Milliseconds since the Unix epoch from the host clock (0 if the host cannot tell).
pub fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Nanoseconds of the host clock, for seeding.
pub fn now_nanos() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

pub fn set_tick_period_ms(ms: u64) {
    if let Err(s) = hostcalls::set_tick_period(Duration::from_millis(ms)) {
        warn!("set_tick_period failed: {s:?}");
    }
}

/// A string property such as `plugin_root_id`.
pub fn property_string(path: &[&str]) -> Option<String> {
    match hostcalls::get_property(path.to_vec()) {
        Ok(Some(bytes)) => String::from_utf8(bytes).ok(),
        _ => None,
    }
}

pub fn plugin_configuration() -> Option<Vec<u8>> {
    hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX).ok().flatten()
}

pub fn request_header(name: &str) -> Option<String> {
    hostcalls::get_map_value(MapType::HttpRequestHeaders, name).ok().flatten()
}

pub fn set_request_header(name: &str, value: Option<&str>) {
    if let Err(s) = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, value) {
        warn!("setting request header {name} failed: {s:?}");
    }
}

pub fn set_response_header(name: &str, value: &str) {
    if let Err(s) = hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value)) {
        warn!("setting response header {name} failed: {s:?}");
    }
}

pub fn request_body(size: usize) -> Option<Vec<u8>> {
    hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size).ok().flatten()
}

/// Replaces the whole buffered request body.
pub fn replace_request_body(current_size: usize, body: &[u8]) -> bool {
    hostcalls::set_buffer(BufferType::HttpRequestBody, 0, current_size, body).is_ok()
}

/// Makes `context_id` the target of the following host calls in this callback (the root
/// context acting on a paused HTTP context). False if the host no longer knows the context.
pub fn set_effective_context(context_id: u32) -> bool {
    match hostcalls::set_effective_context(context_id) {
        Ok(()) => true,
        Err(s) => {
            warn!("set_effective_context({context_id}) failed: {s:?}");
            false
        }
    }
}

/// Resumes the paused request of the current (or effective) context. Envoy defers it to the
/// end of the callback. Our own import: the SDK wrapper panics on any status but Ok.
pub fn resume_request() {
    let status = unsafe { proxy_continue_stream(proxy_wasm::types::StreamType::HttpRequest) };
    if status != Status::Ok {
        warn!("resuming a held request failed: {status:?}");
    }
}

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_continue_stream(stream_type: proxy_wasm::types::StreamType) -> Status;
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> Status;
}

/// Serialises headers in the proxy-wasm map format: count, then (key len, value len) pairs,
/// then each key and value NUL-terminated.
fn serialize_headers(headers: &[(&str, &str)]) -> Vec<u8> {
    let mut size = 4;
    for (k, v) in headers {
        size += 8 + k.len() + v.len() + 2;
    }
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(headers.len() as u32).to_le_bytes());
    for (k, v) in headers {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in headers {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

/// Sends a local reply. Returns false if the host refused (the stream is already gone), which
/// callers only log.
fn send_local(status: u32, headers: &[(&str, &str)], body: &[u8], details: &str) -> bool {
    let serialized = serialize_headers(headers);
    let result = unsafe {
        proxy_send_local_response(
            status,
            details.as_ptr(),
            details.len(),
            body.as_ptr(),
            body.len(),
            serialized.as_ptr(),
            serialized.len(),
            -1,
        )
    };
    if result != Status::Ok {
        warn!("local reply {status} failed: {result:?}");
        return false;
    }
    true
}

/// Answers the request locally with an OpenAI-style JSON error, plus `extra` headers.
pub fn send_rejection(rej: &Rejection, extra: &[(&str, &str)]) -> bool {
    let retry = rej.retry_after_s.map(|s| s.to_string());
    let mut headers: Vec<(&str, &str)> =
        vec![("content-type", "application/json"), ("x-inference-picker-reject", rej.code)];
    if let Some(r) = &retry {
        headers.push(("retry-after", r.as_str()));
    }
    headers.extend_from_slice(extra);
    send_local(rej.status, &headers, &rej.body(), "inference_picker_reject")
}

/// Answers locally with a JSON body.
pub fn send_json(status: u32, body: &[u8]) -> bool {
    send_local(status, &[("content-type", "application/json")], body, "inference_picker_local")
}

/// Starts an HTTP callout with the given headers (pseudo-headers included); returns its token.
pub fn dispatch(cluster: &str, headers: &[(&'static str, String)], timeout_ms: u64) -> Result<u32, String> {
    let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    hostcalls::dispatch_http_call(cluster, headers, None, vec![], Duration::from_millis(timeout_ms))
        .map_err(|s| format!("{s:?}"))
}

/// 64 bits from the host's random source (WASI `random_get`, through std's hasher seeding),
/// mixed with the clock in case the host gives none.
pub fn entropy() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(now_nanos());
    h.finish()
}

/// Starts an HTTP GET callout to one pod; returns its token.
pub fn dispatch_get(cluster: &str, path: &str, authority: &str, timeout_ms: u64) -> Result<u32, String> {
    let headers = vec![
        (":method", "GET"),
        (":path", path),
        (":authority", authority),
        (":scheme", "http"),
        ("accept", "text/plain"),
        ("x-envoy-original-dst-host", authority),
    ];
    hostcalls::dispatch_http_call(cluster, headers, None, vec![], Duration::from_millis(timeout_ms))
        .map_err(|s| format!("{s:?}"))
}

pub fn call_response_status() -> Option<u32> {
    hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
        .ok()
        .flatten()
        .and_then(|s| s.parse().ok())
}

pub fn call_response_body(size: usize) -> Vec<u8> {
    hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, size).ok().flatten().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_serialisation_matches_the_abi() {
        let b = serialize_headers(&[("a", "bc")]);
        assert_eq!(b, [1, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, b'a', 0, b'b', b'c', 0]);
    }
}

/// The filter's own Prometheus metrics. Each distinct name is defined once per VM and its id
/// cached; Envoy merges same-named metrics of all workers into one stat.
#[derive(Default)]
pub struct Metrics {
    ids: hashbrown::HashMap<String, u32>,
    /// The name limit was hit and logged.
    full_logged: bool,
}

impl Metrics {
    fn id(&mut self, kind: proxy_wasm::types::MetricType, name: String) -> Option<u32> {
        if let Some(id) = self.ids.get(&name) {
            return Some(*id);
        }
        // Bounded: a VM never defines more than MAX_METRIC_NAMES names (logged once).
        if self.ids.len() >= crate::telemetry::MAX_METRIC_NAMES {
            if !self.full_logged {
                self.full_logged = true;
                log::error!(
                    "inference-picker: {} metric names defined in this VM; not defining {name} or any \
                     new one (is filter.endpoint_metrics on while pods churn?)",
                    self.ids.len()
                );
            }
            return None;
        }
        match hostcalls::define_metric(kind, &name) {
            Ok(id) => {
                self.ids.insert(name, id);
                Some(id)
            }
            Err(s) => {
                warn!("define_metric {name} failed: {s:?}");
                None
            }
        }
    }

    pub fn count(&mut self, name: String) {
        self.add(name, 1);
    }

    /// Adds `delta` to a counter.
    pub fn add(&mut self, name: String, delta: u64) {
        if delta == 0 {
            return;
        }
        if let Some(id) = self.id(proxy_wasm::types::MetricType::Counter, name) {
            let _ = hostcalls::increment_metric(id, i64::try_from(delta).unwrap_or(i64::MAX));
        }
    }

    /// Adds `delta` (negative: subtracts) to a gauge. Envoy keeps one gauge per name for all
    /// workers, so each worker's additions and subtractions sum up.
    pub fn gauge_add(&mut self, name: String, delta: i64) {
        if delta == 0 {
            return;
        }
        if let Some(id) = self.id(proxy_wasm::types::MetricType::Gauge, name) {
            let _ = hostcalls::increment_metric(id, delta);
        }
    }

    /// Records one histogram sample.
    pub fn sample(&mut self, name: String, value: u64) {
        if let Some(id) = self.id(proxy_wasm::types::MetricType::Histogram, name) {
            let _ = hostcalls::record_metric(id, value);
        }
    }

    pub fn gauge(&mut self, name: String, value: u64) {
        if let Some(id) = self.id(proxy_wasm::types::MetricType::Gauge, name) {
            let _ = hostcalls::record_metric(id, value);
        }
    }
}
