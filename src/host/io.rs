//! Host adapters: the only functions that call proxy-wasm. Everything returns our own types;
//! host statuses are mapped here so the rest of the module never sees them.
//!
//! No panics on host data or host statuses. The SDK's `hostcalls` wrappers panic on any status
//! they consider impossible, and `get_map_value` unwraps `String::from_utf8` on a header value
//! (a single obs-text byte such as `\xff` would kill the VM). So every call made here goes
//! through our own imports of the proxy-wasm ABI (module [`abi`]), reads header values and
//! buffers as bytes, and maps every status. A header value that is not UTF-8 is treated as
//! absent. The panicking SDK helpers are banned in `clippy.toml`, here too; the one exception is
//! `hostcalls::dispatch_http_call`, which must register the callout's token with the SDK's
//! dispatcher (a private function), and whose panicking statuses Envoy does not return (an
//! unknown cluster is `BadArgument`).

use std::time::Duration;

use log::warn;
use proxy_wasm::types::{BufferType, MapType, MetricType, Status};

use crate::base::errors::{ErrorShape, Rejection};
use crate::base::ports::{SharedStore, StoreError};

/// Own imports of the proxy-wasm 0.2.1 ABI, each returning the host's `Status` as is, and safe
/// wrappers that take ownership of what the host returns. Nothing here panics.
mod abi {
    use std::ptr::null_mut;

    use proxy_wasm::types::{BufferType, MapType, MetricType, Status, StreamType};

    #[link(wasm_import_module = "env")]
    extern "C" {
        fn proxy_get_header_map_value(
            map_type: MapType,
            key_data: *const u8,
            key_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
        ) -> Status;
        fn proxy_get_header_map_pairs(
            map_type: MapType,
            return_map_data: *mut *mut u8,
            return_map_size: *mut usize,
        ) -> Status;
        fn proxy_replace_header_map_value(
            map_type: MapType,
            key_data: *const u8,
            key_size: usize,
            value_data: *const u8,
            value_size: usize,
        ) -> Status;
        fn proxy_remove_header_map_value(map_type: MapType, key_data: *const u8, key_size: usize) -> Status;
        fn proxy_get_buffer_bytes(
            buffer_type: BufferType,
            start: usize,
            max_size: usize,
            return_buffer_data: *mut *mut u8,
            return_buffer_size: *mut usize,
        ) -> Status;
        fn proxy_set_buffer_bytes(
            buffer_type: BufferType,
            start: usize,
            size: usize,
            buffer_data: *const u8,
            buffer_size: usize,
        ) -> Status;
        fn proxy_get_property(
            path_data: *const u8,
            path_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
        ) -> Status;
        fn proxy_set_property(
            path_data: *const u8,
            path_size: usize,
            value_data: *const u8,
            value_size: usize,
        ) -> Status;
        fn proxy_get_shared_data(
            key_data: *const u8,
            key_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
            return_cas: *mut u32,
        ) -> Status;
        fn proxy_set_shared_data(
            key_data: *const u8,
            key_size: usize,
            value_data: *const u8,
            value_size: usize,
            cas: u32,
        ) -> Status;
        fn proxy_define_metric(
            metric_type: MetricType,
            name_data: *const u8,
            name_size: usize,
            return_id: *mut u32,
        ) -> Status;
        fn proxy_increment_metric(metric_id: u32, offset: i64) -> Status;
        fn proxy_record_metric(metric_id: u32, value: u64) -> Status;
        fn proxy_set_tick_period_milliseconds(period: u32) -> Status;
        fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> Status;
        fn proxy_set_effective_context(context_id: u32) -> Status;
        pub(super) fn proxy_continue_stream(stream_type: StreamType) -> Status;
        #[allow(clippy::too_many_arguments)]
        pub(super) fn proxy_send_local_response(
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

    /// Takes ownership of a value the host allocated through the SDK's exported
    /// `proxy_on_memory_allocate` (a `Vec<u8>` with capacity == size, as the SDK itself does).
    ///
    /// # Safety
    /// `data` must be null or a host-returned pointer to `size` bytes allocated that way.
    unsafe fn owned(data: *mut u8, size: usize) -> Vec<u8> {
        if data.is_null() {
            Vec::new()
        } else {
            // SAFETY: per the function's contract.
            unsafe { Vec::from_raw_parts(data, size, size) }
        }
    }

    /// A header (or trailer) value as bytes: `Ok(None)` when absent.
    pub fn map_value(map: MapType, key: &str) -> Result<Option<Vec<u8>>, Status> {
        let (mut data, mut size) = (null_mut(), 0usize);
        // SAFETY: the pointers are valid for the call; the host writes a value it allocated.
        match unsafe { proxy_get_header_map_value(map, key.as_ptr(), key.len(), &mut data, &mut size) } {
            Status::Ok => Ok(Some(unsafe { owned(data, size) })),
            Status::NotFound => Ok(None),
            s => Err(s),
        }
    }

    /// A whole header map, serialised (see `super::parse_header_map`).
    pub fn map_pairs(map: MapType) -> Result<Vec<u8>, Status> {
        let (mut data, mut size) = (null_mut(), 0usize);
        // SAFETY: as in `map_value`.
        match unsafe { proxy_get_header_map_pairs(map, &mut data, &mut size) } {
            Status::Ok => Ok(unsafe { owned(data, size) }),
            s => Err(s),
        }
    }

    /// Replaces (`Some`) or removes (`None`) a header. Removing an absent header is no error.
    pub fn set_map_value(map: MapType, key: &str, value: Option<&[u8]>) -> Result<(), Status> {
        // SAFETY: the pointers are valid for the call.
        let s = unsafe {
            match value {
                Some(v) => proxy_replace_header_map_value(map, key.as_ptr(), key.len(), v.as_ptr(), v.len()),
                None => proxy_remove_header_map_value(map, key.as_ptr(), key.len()),
            }
        };
        match s {
            Status::Ok => Ok(()),
            Status::NotFound if value.is_none() => Ok(()),
            s => Err(s),
        }
    }

    /// Up to `max` bytes of a buffer from `start`: `Ok(None)` when there is no such buffer.
    pub fn buffer(kind: BufferType, start: usize, max: usize) -> Result<Option<Vec<u8>>, Status> {
        let (mut data, mut size) = (null_mut(), 0usize);
        // SAFETY: as in `map_value`.
        match unsafe { proxy_get_buffer_bytes(kind, start, max, &mut data, &mut size) } {
            Status::Ok if data.is_null() => Ok(None),
            Status::Ok => Ok(Some(unsafe { owned(data, size) })),
            Status::NotFound => Ok(None),
            s => Err(s),
        }
    }

    pub fn set_buffer(kind: BufferType, start: usize, size: usize, value: &[u8]) -> Result<(), Status> {
        // SAFETY: the pointer is valid for the call.
        match unsafe { proxy_set_buffer_bytes(kind, start, size, value.as_ptr(), value.len()) } {
            Status::Ok => Ok(()),
            s => Err(s),
        }
    }

    pub fn property(path: &[&str]) -> Result<Option<Vec<u8>>, Status> {
        // The ABI's property path: segments, each followed by a NUL.
        let mut serialized = Vec::new();
        for p in path {
            serialized.extend_from_slice(p.as_bytes());
            serialized.push(0);
        }
        let (mut data, mut size) = (null_mut(), 0usize);
        // SAFETY: as in `map_value`.
        match unsafe { proxy_get_property(serialized.as_ptr(), serialized.len(), &mut data, &mut size) } {
            Status::Ok if data.is_null() => Ok(None),
            Status::Ok => Ok(Some(unsafe { owned(data, size) })),
            Status::NotFound => Ok(None),
            s => Err(s),
        }
    }

    /// Sets a stream property (Envoy keeps it in the stream's filter state as `wasm.<path>`,
    /// readable by every later filter of the stream, never by the client).
    pub fn set_property(path: &str, value: &[u8]) -> Status {
        // SAFETY: both pointers are valid for their lengths for the duration of the call.
        unsafe { proxy_set_property(path.as_ptr(), path.len(), value.as_ptr(), value.len()) }
    }

    /// A shared-data value and its CAS: `Ok(None)` when the key is absent.
    pub fn shared_data(key: &str) -> Result<Option<(Vec<u8>, u32)>, Status> {
        let (mut data, mut size, mut cas) = (null_mut(), 0usize, 0u32);
        // SAFETY: as in `map_value`.
        match unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas) } {
            // An EMPTY stored value comes back as a null pointer, but with the key's CAS token:
            // the key exists (the shared-data "removed" convention), and callers need the token.
            Status::Ok if data.is_null() && cas != 0 => Ok(Some((Vec::new(), cas))),
            Status::Ok if data.is_null() => Ok(None),
            Status::Ok => Ok(Some((unsafe { owned(data, size) }, cas))),
            Status::NotFound => Ok(None),
            s => Err(s),
        }
    }

    pub fn set_shared_data(key: &str, value: &[u8], cas: u32) -> Status {
        // SAFETY: the pointers are valid for the call.
        unsafe { proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas) }
    }

    pub fn define_metric(kind: MetricType, name: &str) -> Result<u32, Status> {
        let mut id = 0u32;
        // SAFETY: the pointers are valid for the call.
        match unsafe { proxy_define_metric(kind, name.as_ptr(), name.len(), &mut id) } {
            Status::Ok => Ok(id),
            s => Err(s),
        }
    }

    pub fn increment_metric(id: u32, offset: i64) -> Status {
        // SAFETY: plain values.
        unsafe { proxy_increment_metric(id, offset) }
    }

    pub fn record_metric(id: u32, value: u64) -> Status {
        // SAFETY: plain values.
        unsafe { proxy_record_metric(id, value) }
    }

    pub fn set_tick_period_ms(ms: u32) -> Status {
        // SAFETY: plain values.
        unsafe { proxy_set_tick_period_milliseconds(ms) }
    }

    pub fn now_nanos() -> Option<u64> {
        let mut t = 0u64;
        // SAFETY: the pointer is valid for the call.
        match unsafe { proxy_get_current_time_nanoseconds(&mut t) } {
            Status::Ok => Some(t),
            _ => None,
        }
    }

    pub fn set_effective_context(id: u32) -> Status {
        // SAFETY: plain values.
        unsafe { proxy_set_effective_context(id) }
    }
}

/// proxy-wasm shared data.
pub struct HostStore;

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        abi::shared_data(key).map_err(|s| StoreError::Host(format!("{s:?}")))
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        match abi::set_shared_data(key, value, cas) {
            Status::Ok => Ok(()),
            Status::CasMismatch => Err(StoreError::CasMismatch),
            s => Err(StoreError::Host(format!("{s:?}"))),
        }
    }
}

/// Milliseconds since the Unix epoch from the host clock (0 if the host cannot tell).
pub fn now_ms() -> u64 {
    abi::now_nanos().map_or(0, |n| n / 1_000_000)
}

/// Nanoseconds of the host clock, for seeding.
pub fn now_nanos() -> u64 {
    abi::now_nanos().unwrap_or(0)
}

pub fn set_tick_period_ms(ms: u64) {
    let s = abi::set_tick_period_ms(u32::try_from(ms).unwrap_or(u32::MAX));
    if s != Status::Ok {
        warn!("set_tick_period failed: {s:?}");
    }
}

/// A stream property as bytes (`None` when absent or unreadable).
pub fn stream_property(name: &str) -> Option<Vec<u8>> {
    abi::property(&[name]).ok().flatten()
}

/// Sets a stream property (filter state) for the later filters of this stream; a host refusal
/// is logged and reported.
pub fn set_stream_property(name: &str, value: &[u8]) -> bool {
    let s = abi::set_property(name, value);
    if s != Status::Ok {
        warn!("setting property {name} failed: {s:?}");
    }
    s == Status::Ok
}

/// A string property such as `plugin_root_id` (`None` if absent or not UTF-8).
pub fn property_string(path: &[&str]) -> Option<String> {
    abi::property(path).ok().flatten().and_then(|b| String::from_utf8(b).ok())
}

/// An integer property (`response.code`, `response.flags` ...): Envoy passes 64-bit integers
/// as 8 little-endian bytes. `None` when absent, unreadable or of another size.
pub fn property_u64(path: &[&str]) -> Option<u64> {
    property_bytes(path).and_then(|b| <[u8; 8]>::try_from(b.as_slice()).ok()).map(u64::from_le_bytes)
}

/// A UTF-8 property through the status-checked reader (`None` when absent or not UTF-8).
fn property_text(path: &[&str]) -> Option<String> {
    property_bytes(path).and_then(|b| String::from_utf8(b).ok())
}

/// What `on_log` needs to judge the upstream result of this stream (see `crate::state::health`).
pub struct UpstreamResult {
    /// `response.code` (the final status, Envoy's own reply included).
    pub status: Option<u32>,
    /// `response.code_details` (e.g. `via_upstream`, `upstream_reset_before_response_started{...}`).
    pub details: String,
    /// `response.flags` (Envoy's response-flag bits).
    pub flags: u64,
    /// `upstream.address`: the endpoint that answered last.
    pub address: Option<String>,
    /// `upstream.request_attempt_count`, when this Envoy has it. Read only when `address` is
    /// not one of the request's destinations: otherwise `health::attribute` does not use it, and
    /// each property read is a host call (~1.5 µs under V8).
    pub attempts: Option<u64>,
}

/// Reads [`UpstreamResult`] from the stream's properties, every call status-checked (a missing
/// property is `None` or empty).
pub fn upstream_result(destinations: &[String]) -> UpstreamResult {
    let address = property_text(&["upstream", "address"]).filter(|a| !a.is_empty());
    let known = address.as_deref().is_some_and(|a| destinations.iter().any(|d| d == a));
    UpstreamResult {
        status: property_u64(&["response", "code"]).and_then(|c| u32::try_from(c).ok()),
        details: property_text(&["response", "code_details"]).unwrap_or_default(),
        flags: property_u64(&["response", "flags"]).unwrap_or(0),
        address,
        attempts: if known { None } else { property_u64(&["upstream", "request_attempt_count"]) },
    }
}

pub fn plugin_configuration() -> Option<Vec<u8>> {
    abi::buffer(BufferType::PluginConfiguration, 0, usize::MAX).ok().flatten()
}

/// A request header as bytes (`None` when absent or unreadable).
pub fn request_header_bytes(name: &str) -> Option<Vec<u8>> {
    match abi::map_value(MapType::HttpRequestHeaders, name) {
        Ok(v) => v,
        Err(s) => {
            warn!("reading request header {name} failed: {s:?}");
            None
        }
    }
}

/// The request headers, read in one host call instead of one per header (the request-headers
/// callback needs about ten: the trusted priority headers, the method, path, length and session
/// headers, and which client routing headers to strip). If the host cannot give the map, every
/// lookup falls back to its own host call and every header counts as present (so the strip
/// still removes them all).
pub struct RequestHeaders {
    map: Option<HeaderMap>,
}

impl RequestHeaders {
    pub fn read() -> Self {
        let map = match abi::map_pairs(MapType::HttpRequestHeaders) {
            Ok(bytes) => parse_header_map(&bytes),
            Err(s) => {
                warn!("reading the request headers failed: {s:?}");
                None
            }
        };
        RequestHeaders { map }
    }

    /// The first value of `name` as text (`None` when absent or not UTF-8, as [`request_header`]).
    pub fn get(&self, name: &str) -> Option<String> {
        match &self.map {
            Some(m) => m.get(name).map(str::to_string),
            None => request_header(name),
        }
    }

    /// Is `name` present (with any value, UTF-8 or not)? True when the map could not be read.
    pub fn contains(&self, name: &str) -> bool {
        self.map.as_ref().is_none_or(|m| m.contains(name))
    }
}

/// A parsed header map: (name, value) pairs in host order; a value that is not UTF-8 is kept
/// as `None` (present, but read as absent).
pub struct HeaderMap {
    pairs: Vec<(String, Option<String>)>,
}

impl HeaderMap {
    /// First value of `name` (names compared ASCII case-insensitively; Envoy stores them lower
    /// case).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.pairs.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).and_then(|(_, v)| v.as_deref())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.pairs.iter().any(|(k, _)| k.eq_ignore_ascii_case(name))
    }
}

/// Parses the proxy-wasm map format (count, then (key len, value len) pairs, then each key and
/// value NUL-terminated). `None` on anything malformed (bounds-checked; never panics).
pub fn parse_header_map(bytes: &[u8]) -> Option<HeaderMap> {
    let word = |at: usize| -> Option<usize> {
        let b: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
        usize::try_from(u32::from_le_bytes(b)).ok()
    };
    if bytes.is_empty() {
        return Some(HeaderMap { pairs: Vec::new() });
    }
    let n = word(0)?;
    // Each pair takes at least 8 bytes of sizes and 2 NULs: a count beyond that is garbage.
    if n > bytes.len() / 10 {
        return None;
    }
    let mut pos = 4usize.checked_add(n.checked_mul(8)?)?;
    let mut pairs = Vec::with_capacity(n);
    for i in 0..n {
        let klen = word(4 + i * 8)?;
        let vlen = word(8 + i * 8)?;
        let mut field = |len: usize| -> Option<&[u8]> {
            let end = pos.checked_add(len)?;
            // Each key and value is followed by a NUL.
            if bytes.get(end) != Some(&0) {
                return None;
            }
            let f = bytes.get(pos..end)?;
            pos = end.checked_add(1)?;
            Some(f)
        };
        let key = field(klen)?;
        let value = field(vlen)?;
        let key = std::str::from_utf8(key).ok()?.to_string();
        let value = std::str::from_utf8(value).ok().map(str::to_string);
        pairs.push((key, value));
    }
    Some(HeaderMap { pairs })
}

/// A request header as text. A value that is not UTF-8 (obs-text, legal in HTTP/1.1 and carried
/// by HTTP/2) is treated as absent.
pub fn request_header(name: &str) -> Option<String> {
    request_header_bytes(name).and_then(|b| String::from_utf8(b).ok())
}

/// A response header as text (`None` when absent, unreadable or not UTF-8).
pub fn response_header(name: &str) -> Option<String> {
    match abi::map_value(MapType::HttpResponseHeaders, name) {
        Ok(v) => v.and_then(|b| String::from_utf8(b).ok()),
        Err(s) => {
            warn!("reading response header {name} failed: {s:?}");
            None
        }
    }
}

/// Sets (`Some`) or removes (`None`) a request header; a host refusal is logged.
pub fn set_request_header(name: &str, value: Option<&str>) {
    if let Err(s) = abi::set_map_value(MapType::HttpRequestHeaders, name, value.map(str::as_bytes)) {
        warn!("setting request header {name} failed: {s:?}");
    }
}

pub fn set_response_header(name: &str, value: &str) {
    if let Err(s) = abi::set_map_value(MapType::HttpResponseHeaders, name, Some(value.as_bytes())) {
        warn!("setting response header {name} failed: {s:?}");
    }
}

/// The buffered request body, up to `size` bytes (`None` if the host has none to give).
pub fn request_body(size: usize) -> Option<Vec<u8>> {
    match abi::buffer(BufferType::HttpRequestBody, 0, size) {
        Ok(b) => b,
        Err(s) => {
            warn!("reading the request body failed: {s:?}");
            None
        }
    }
}

/// The response body chunk in the buffer, up to `size` bytes (`None` if the host has none).
pub fn response_body(size: usize) -> Option<Vec<u8>> {
    match abi::buffer(BufferType::HttpResponseBody, 0, size) {
        Ok(b) => b,
        Err(s) => {
            warn!("reading the response body failed: {s:?}");
            None
        }
    }
}

/// Replaces the whole buffered request body.
pub fn replace_request_body(current_size: usize, body: &[u8]) -> bool {
    abi::set_buffer(BufferType::HttpRequestBody, 0, current_size, body).is_ok()
}

/// Makes `context_id` the target of the following host calls in this callback (the root
/// context acting on a paused HTTP context). False if the host no longer knows the context.
pub fn set_effective_context(context_id: u32) -> bool {
    match abi::set_effective_context(context_id) {
        Status::Ok => true,
        s => {
            warn!("set_effective_context({context_id}) failed: {s:?}");
            false
        }
    }
}

/// Resumes the paused request of the current (or effective) context. Envoy defers it to the
/// end of the callback.
pub fn resume_request() {
    // SAFETY: a plain value.
    let status = unsafe { abi::proxy_continue_stream(proxy_wasm::types::StreamType::HttpRequest) };
    if status != Status::Ok {
        warn!("resuming a held request failed: {status:?}");
    }
}

/// Reads one host property through the status-checked import. Any status but Ok, and an absent
/// value, are `None`.
fn property_bytes(path: &[&str]) -> Option<Vec<u8>> {
    abi::property(path).ok().flatten()
}

/// The upstream pod that produced the response now being processed (`ip:port`), read in the
/// response callbacks: after a retry on a fallback it is that fallback, not the primary. `None`
/// when the response did not come from upstream (`response.code_details` is not `via_upstream`:
/// Envoy or a filter answered locally, e.g. after every listed pod failed) or the host cannot say.
pub fn upstream_that_answered() -> Option<String> {
    if property_bytes(&["response", "code_details"]).as_deref() != Some(b"via_upstream".as_slice()) {
        return None;
    }
    property_bytes(&["upstream", "address"]).and_then(|b| String::from_utf8(b).ok()).filter(|a| !a.is_empty())
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
    // SAFETY: the pointers are valid for the call.
    let result = unsafe {
        abi::proxy_send_local_response(
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

/// Answers the request locally with a JSON error in `shape` (OpenAI's or Anthropic's), plus
/// `extra` headers.
pub fn send_rejection(rej: &Rejection, shape: ErrorShape, extra: &[(&str, &str)]) -> bool {
    let retry = rej.retry_after_s.map(|s| s.to_string());
    let mut headers: Vec<(&str, &str)> =
        vec![("content-type", "application/json"), ("x-inference-picker-reject", rej.code)];
    if let Some(r) = &retry {
        headers.push(("retry-after", r.as_str()));
    }
    headers.extend_from_slice(extra);
    send_local(rej.status, &headers, &rej.body_in(shape), "inference_picker_reject")
}

/// Answers locally with the given status, headers and body (not an error).
pub fn send_local_reply(status: u32, headers: &[(&str, &str)], body: &[u8]) -> bool {
    send_local(status, headers, body, "inference_picker_local")
}

/// Starts an HTTP callout with the given headers (pseudo-headers included); returns its token.
pub fn dispatch(cluster: &str, headers: &[(&'static str, String)], timeout_ms: u64) -> Result<u32, String> {
    let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    dispatch_http_call(cluster, headers, timeout_ms)
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
    dispatch_http_call(cluster, headers, timeout_ms)
}

/// POSTs `body` to `address` (`ip:port`) through an ORIGINAL_DST cluster, with `:authority`
/// `authority` and `extra` headers; returns the callout's token.
pub fn dispatch_post(
    cluster: &str,
    path: &str,
    address: &str,
    authority: &str,
    extra: &[(&str, &str)],
    body: &[u8],
    timeout_ms: u64,
) -> Result<u32, String> {
    let mut headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", authority),
        (":scheme", "http"),
        ("content-type", "application/octet-stream"),
        ("x-envoy-original-dst-host", address),
    ];
    headers.extend_from_slice(extra);
    #[allow(clippy::disallowed_methods)]
    proxy_wasm::hostcalls::dispatch_http_call(
        cluster,
        headers,
        Some(body),
        vec![],
        Duration::from_millis(timeout_ms),
    )
    .map_err(|s| format!("{s:?}"))
}

/// The SDK's wrapper, the one allowed: it registers the callout's token with the SDK's
/// dispatcher, which routes the response back to this context. It panics only on statuses
/// Envoy does not return for `proxy_http_call` (Ok, BadArgument, InternalFailure).
#[allow(clippy::disallowed_methods)]
fn dispatch_http_call(cluster: &str, headers: Vec<(&str, &str)>, timeout_ms: u64) -> Result<u32, String> {
    proxy_wasm::hostcalls::dispatch_http_call(
        cluster,
        headers,
        None,
        vec![],
        Duration::from_millis(timeout_ms),
    )
    .map_err(|s| format!("{s:?}"))
}

/// The `:status` of a callout's response (`None` when absent, not a number or not UTF-8).
pub fn call_response_status() -> Option<u32> {
    abi::map_value(MapType::HttpCallResponseHeaders, ":status")
        .ok()
        .flatten()
        .and_then(|b| std::str::from_utf8(&b).ok().and_then(|s| s.trim().parse().ok()))
}

pub fn call_response_body(size: usize) -> Vec<u8> {
    abi::buffer(BufferType::HttpCallResponseBody, 0, size).ok().flatten().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_serialisation_matches_the_abi() {
        let b = serialize_headers(&[("a", "bc")]);
        assert_eq!(b, [1, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, b'a', 0, b'b', b'c', 0]);
    }

    #[test]
    fn a_header_map_parses_back_and_reads_first_values() {
        let b =
            serialize_headers(&[(":path", "/v1/chat/completions"), ("x-a", "1"), ("x-a", "2"), ("e", "")]);
        let m = parse_header_map(&b).unwrap();
        assert_eq!(m.get(":path"), Some("/v1/chat/completions"));
        assert_eq!(m.get("X-A"), Some("1"));
        assert_eq!(m.get("e"), Some(""));
        assert!(m.contains("x-a") && !m.contains("x-b"));
        assert_eq!(m.get("x-b"), None);
        assert!(parse_header_map(&[]).unwrap().pairs.is_empty());
    }

    #[test]
    fn a_non_utf8_value_is_present_but_reads_as_absent() {
        let mut b = serialize_headers(&[("x-v", "ab")]);
        let at = b.len() - 3;
        b[at] = 0xff;
        let m = parse_header_map(&b).unwrap();
        assert!(m.contains("x-v"));
        assert_eq!(m.get("x-v"), None);
    }

    #[test]
    fn a_malformed_header_map_is_rejected_without_panicking() {
        let good = serialize_headers(&[("key", "value"), ("k2", "v2")]);
        for cut in 1..good.len() {
            assert!(parse_header_map(&good[..cut]).is_none(), "cut at {cut}");
        }
        // Sizes that point past the end, and an absurd count.
        let mut long = good.clone();
        long[4] = 200;
        assert!(parse_header_map(&long).is_none());
        assert!(parse_header_map(&[0xff, 0xff, 0xff, 0xff]).is_none());
    }
}

/// The filter's own Prometheus metrics. Each distinct name is defined once per VM and its id
/// cached; Envoy merges same-named metrics of all workers into one stat.
#[derive(Default)]
pub struct Metrics {
    ids: hashbrown::HashMap<String, u32>,
    /// Appended to every name defined (`;pool=<name>` with `pool.name`, else empty).
    suffix: String,
    /// The name limit was hit and logged.
    full_logged: bool,
    /// This VM's linear memory last added to the memory gauge, in bytes.
    memory_reported: u64,
    /// Reused buffer for tagged names.
    name_buf: String,
}

/// This VM's linear memory in bytes (wasm memory only grows; it is never given back).
fn vm_memory_bytes() -> u64 {
    #[cfg(target_arch = "wasm32")]
    {
        (core::arch::wasm32::memory_size(0) as u64) * 65_536
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        0
    }
}

impl Metrics {
    /// Metrics whose every name ends with `suffix` (`crate::request::pools::metric_suffix`).
    pub fn with_suffix(suffix: String) -> Self {
        Metrics { suffix, ..Metrics::default() }
    }

    /// Keeps `inference_picker_vm_memory_bytes` equal to the sum of every filter VM's linear
    /// memory: each VM adds the growth since its last report (a gauge set by several VMs would
    /// only show the last writer's value).
    pub fn report_vm_memory(&mut self) {
        let now = vm_memory_bytes();
        let delta = now.saturating_sub(self.memory_reported);
        if delta > 0 {
            self.memory_reported = now;
            self.gauge_add(
                crate::base::telemetry::name(crate::base::telemetry::VM_MEMORY, &[]),
                i64::try_from(delta).unwrap_or(i64::MAX),
            );
        }
    }

    /// The id of `name`, defined on first use. Allocates only when a name is new.
    fn id(&mut self, kind: MetricType, name: &str) -> Option<u32> {
        if let Some(id) = self.ids.get(name) {
            return Some(*id);
        }
        // Bounded: a VM never defines more than MAX_METRIC_NAMES names (logged once).
        if self.ids.len() >= crate::base::telemetry::MAX_METRIC_NAMES {
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
        let defined =
            if self.suffix.is_empty() { name.to_string() } else { format!("{name}{}", self.suffix) };
        match abi::define_metric(kind, &defined) {
            Ok(id) => {
                self.ids.insert(name.to_string(), id);
                Some(id)
            }
            Err(s) => {
                warn!("define_metric {name} failed: {s:?}");
                None
            }
        }
    }

    /// The id of `base` with `tags` (`crate::base::telemetry::name`), the name built in a reused
    /// buffer: the per-request counters cost no allocation once their names are defined.
    fn tagged_id(&mut self, kind: MetricType, base: &str, tags: &[(&str, &str)]) -> Option<u32> {
        let mut buf = std::mem::take(&mut self.name_buf);
        crate::base::telemetry::name_into(&mut buf, base, tags);
        let id = self.id(kind, &buf);
        self.name_buf = buf;
        id
    }

    /// Adds 1 to the counter `base` with `tags`, without building a `String` per call.
    pub fn count_tagged(&mut self, base: &str, tags: &[(&str, &str)]) {
        if let Some(id) = self.tagged_id(MetricType::Counter, base, tags) {
            let _ = abi::increment_metric(id, 1);
        }
    }

    /// Adds `delta` to the counter `base` with `tags`, without building a `String` per call.
    pub fn add_tagged(&mut self, base: &str, tags: &[(&str, &str)], delta: u64) {
        if delta == 0 {
            return;
        }
        if let Some(id) = self.tagged_id(MetricType::Counter, base, tags) {
            let _ = abi::increment_metric(id, i64::try_from(delta).unwrap_or(i64::MAX));
        }
    }

    /// Sets the gauge `base` with `tags`, without building a `String` per call.
    pub fn gauge_tagged(&mut self, base: &str, tags: &[(&str, &str)], value: u64) {
        if let Some(id) = self.tagged_id(MetricType::Gauge, base, tags) {
            let _ = abi::record_metric(id, value);
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
        if let Some(id) = self.id(MetricType::Counter, &name) {
            let _ = abi::increment_metric(id, i64::try_from(delta).unwrap_or(i64::MAX));
        }
    }

    /// Adds `delta` (negative: subtracts) to a gauge. Envoy keeps one gauge per name for all
    /// workers, so each worker's additions and subtractions sum up.
    pub fn gauge_add(&mut self, name: String, delta: i64) {
        if delta == 0 {
            return;
        }
        if let Some(id) = self.id(MetricType::Gauge, &name) {
            let _ = abi::increment_metric(id, delta);
        }
    }

    /// Records one histogram sample of `base` with `tags`, without building a `String` per call.
    pub fn sample_tagged(&mut self, base: &str, tags: &[(&str, &str)], value: u64) {
        if let Some(id) = self.tagged_id(MetricType::Histogram, base, tags) {
            let _ = abi::record_metric(id, value);
        }
    }

    /// Records one histogram sample.
    pub fn sample(&mut self, name: String, value: u64) {
        if let Some(id) = self.id(MetricType::Histogram, &name) {
            let _ = abi::record_metric(id, value);
        }
    }

    pub fn gauge(&mut self, name: String, value: u64) {
        if let Some(id) = self.id(MetricType::Gauge, &name) {
            let _ = abi::record_metric(id, value);
        }
    }
}
