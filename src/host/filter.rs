//! The HTTP filter context: gathers inputs, calls `crate::request`, applies the decision.

use std::rc::Rc;

use log::warn;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use super::{io, Worker};
use crate::errors::Rejection;
use crate::inflight;
use crate::request::{
    self, BodyInputs, HeadDecision, RequestHead, CLIENT_ROUTING_HEADERS, DEBUG_SCORES_HEADER,
    DESTINATION_HEADER, ORIGINAL_DST_HEADER, SERVED_HEADER,
};
use crate::telemetry;

pub(crate) struct Filter {
    worker: Rc<Worker>,
    head: RequestHead,
    /// Endpoint whose in-flight count this request holds (released in on_log).
    holding: Option<String>,
    primary: Option<String>,
    session_token: Option<String>,
    debug_scores: Option<String>,
    /// A local reply was sent; ignore later callbacks.
    answered: bool,
}

impl Filter {
    pub fn new(worker: Rc<Worker>) -> Self {
        Filter {
            worker,
            head: RequestHead::default(),
            holding: None,
            primary: None,
            session_token: None,
            debug_scores: None,
            answered: false,
        }
    }

    fn reject(&mut self, rej: &Rejection) -> Action {
        self.answered = true;
        self.worker
            .metrics
            .borrow_mut()
            .count(telemetry::name(telemetry::REJECTIONS, &[("reason", rej.code)]));
        io::send_rejection(rej);
        Action::Pause
    }
}

impl Context for Filter {}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // Never let a client choose the destination, on any path.
        for h in CLIENT_ROUTING_HEADERS {
            io::set_request_header(h, None);
        }
        let cfg = &self.worker.cfg;
        self.head = RequestHead {
            method: io::request_header(":method").unwrap_or_default(),
            path: io::request_header(":path").unwrap_or_default(),
            content_length: io::request_header("content-length").and_then(|v| v.trim().parse().ok()),
            session_id: io::request_header(&cfg.scheduler.session.header),
            session_token: io::request_header(&cfg.scheduler.session.token_header),
        };
        match request::on_head(cfg, &self.head, end_of_stream) {
            HeadDecision::ReadBody => Action::Pause,
            HeadDecision::Reject(rej) => self.reject(&rej),
            HeadDecision::ModelList(json) => {
                self.answered = true;
                io::send_json(200, &json);
                Action::Pause
            }
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.answered {
            return Action::Pause;
        }
        let worker = self.worker.clone();
        let cfg = &worker.cfg;
        if body_size > cfg.filter.max_body_bytes {
            return self.reject(&request::too_large(cfg));
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = io::request_body(body_size).unwrap_or_default();
        let store = io::HostStore;
        let snapshot = match worker.snapshots.borrow_mut().refresh(&store) {
            Ok(s) => s,
            Err(e) => {
                warn!("inference-picker: reading the snapshot failed: {e:?}");
                worker.snapshots.borrow().current()
            }
        };
        let inflight = inflight::read(&store).unwrap_or_default();
        let now_ms = io::now_ms();
        let inputs = BodyInputs { snapshot: &snapshot, inflight: &inflight, store: &store, now_ms };
        let routed = {
            let mut scheduler = worker.scheduler.borrow_mut();
            let mut rng = worker.rng.borrow_mut();
            request::on_body(cfg, &mut scheduler, &mut *rng, &self.head, &body, &inputs)
        };
        let routed = match routed {
            Ok(r) => r,
            Err(rej) => return self.reject(&rej),
        };
        if let Some(new_body) = &routed.new_body {
            if !io::replace_request_body(body_size, new_body) {
                return self.reject(&Rejection::new(
                    500,
                    "internal_error",
                    "body_rewrite_failed",
                    "could not rewrite the request body",
                ));
            }
            io::set_request_header("content-length", Some(&new_body.len().to_string()));
        }
        io::set_request_header(DESTINATION_HEADER, Some(&routed.pick.destination_header()));
        io::set_request_header(ORIGINAL_DST_HEADER, Some(&routed.pick.primary));
        let mut metrics = worker.metrics.borrow_mut();
        match inflight::adjust(&store, &routed.pick.primary, 1) {
            Ok(n) => {
                self.holding = Some(routed.pick.primary.clone());
                metrics.gauge(
                    telemetry::name(telemetry::ENDPOINT_INFLIGHT, &[("endpoint", &routed.pick.primary)]),
                    u64::from(n),
                );
            }
            Err(e) => warn!("inference-picker: in-flight increment failed: {e:?}"),
        }
        metrics.count(telemetry::name(
            telemetry::REQUESTS,
            &[
                ("model", &routed.pick.target_model),
                ("endpoint", &routed.pick.primary),
                ("outcome", routed.pick.reason.as_str()),
            ],
        ));
        metrics.gauge(
            telemetry::name(telemetry::SNAPSHOT_AGE, &[]),
            now_ms.saturating_sub(snapshot.published_ms),
        );
        drop(metrics);
        self.primary = Some(routed.pick.primary);
        self.session_token = Some(routed.pick.session_token);
        self.debug_scores = routed.pick.debug_scores;
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.answered {
            return Action::Continue;
        }
        if let Some(p) = &self.primary {
            io::set_response_header(SERVED_HEADER, p);
        }
        if let Some(t) = &self.session_token {
            io::set_response_header(&self.worker.cfg.scheduler.session.token_header, t);
        }
        if let Some(d) = &self.debug_scores {
            io::set_response_header(DEBUG_SCORES_HEADER, d);
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if let Some(addr) = self.holding.take() {
            match inflight::adjust(&io::HostStore, &addr, -1) {
                Ok(n) => self.worker.metrics.borrow_mut().gauge(
                    telemetry::name(telemetry::ENDPOINT_INFLIGHT, &[("endpoint", &addr)]),
                    u64::from(n),
                ),
                Err(e) => warn!("inference-picker: in-flight release for {addr} failed: {e:?}"),
            }
        }
    }
}
