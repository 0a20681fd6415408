//! The token usage of a routed response (`crate::request::usage`): the scan starts with the
//! response headers, reads each body chunk as it passes (the filter returns `Continue`, so
//! nothing is held and no byte changes), and ends with the body, its trailers or the stream's
//! log, whichever comes first. Then the counters are added to and the filter state is set.

use super::super::io;
use super::Filter;
use crate::base::telemetry;
use crate::request::usage::{UsageScan, COMPLETION_TOKENS_PROPERTY, PROMPT_TOKENS_PROPERTY};

impl Filter {
    /// At the response headers of a routed request, with `filter.token_usage` on: whether and how
    /// its body is read (`content_type` as already read, `None` when absent).
    pub(super) fn start_usage(&mut self, content_type: Option<&str>) {
        let status = io::response_header(":status");
        let encoding = io::response_header("content-encoding");
        let mut ex = self.ex.borrow_mut();
        ex.usage = UsageScan::start(status.as_deref(), content_type, encoding.as_deref(), &ex.head.path);
    }

    /// One response body chunk (the callback's buffer holds only this chunk: earlier ones were
    /// passed on).
    pub(super) fn read_usage(&mut self, body_size: usize, end_of_stream: bool) {
        if self.ex.borrow().usage.is_none() {
            return;
        }
        if body_size > 0 {
            if let Some(chunk) = io::response_body(body_size) {
                if let Some(scan) = self.ex.borrow_mut().usage.as_mut() {
                    scan.feed(&chunk);
                }
            }
        }
        if end_of_stream {
            self.finish_usage();
        }
    }

    /// The body is over: count what it reported and publish it for access logs. Idempotent.
    pub(super) fn finish_usage(&mut self) {
        let (scan, model, tenant) = {
            let mut ex = self.ex.borrow_mut();
            let Some(scan) = ex.usage.take() else { return };
            (scan, ex.model.take().unwrap_or_default(), ex.head.priority.tenant().map(str::to_string))
        };
        let outcome = scan.finish();
        let worker = &self.worker;
        let mut metrics = worker.metrics.borrow_mut();
        metrics.count_tagged(telemetry::USAGE_RESPONSES, &[("outcome", outcome.as_str())]);
        let Some(usage) = outcome.usage() else { return };
        let mut tenants = worker.tenants.borrow_mut();
        let tenant = tenant.as_deref().map_or(telemetry::NO_TENANT, |t| tenants.label(t));
        let tags = [("model", model.as_str()), ("tenant", tenant)];
        metrics.add_tagged(telemetry::PROMPT_TOKENS, &tags, usage.prompt_tokens);
        metrics.add_tagged(telemetry::COMPLETION_TOKENS, &tags, usage.completion_tokens);
        io::set_stream_property(PROMPT_TOKENS_PROPERTY, usage.prompt_tokens.to_string().as_bytes());
        io::set_stream_property(COMPLETION_TOKENS_PROPERTY, usage.completion_tokens.to_string().as_bytes());
    }
}
