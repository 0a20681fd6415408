//! The peers exchange on the filter's path: a peer gateway's prefix records and load reports
//! (`crate::poll::peers`), answered here and never sent to a pod.

use proxy_wasm::types::Action;

use super::super::io;
use super::Filter;
use crate::base::errors::Rejection;
use crate::base::ports::SharedStore;
use crate::base::telemetry;
use crate::poll::peers;
use crate::state::inflight;

impl Filter {
    /// `peers`: the exchange path's head. Only a POST with the shared token goes on (to its body);
    /// anything else is answered here.
    pub(super) fn peer_headers(&mut self, end_of_stream: bool) -> Action {
        let cfg = self.worker.cfg.clone();
        let Some(pc) = cfg.peers.as_ref() else { return Action::Continue };
        let endpoint =
            self.worker.peer_token.as_deref().map(|t| peers::Endpoint { path: &pc.path, token: t });
        let method = io::request_header(":method").unwrap_or_default();
        let sent = io::request_header_bytes(peers::TOKEN_HEADER);
        let decision = match endpoint.as_ref() {
            Some(ep) => peers::classify(Some(ep), &method, &pc.path, sent.as_deref()),
            // No usable token configured here: the path exists but takes nothing.
            None => peers::PeerRequest::Reject {
                status: 403,
                code: "forbidden",
                message: "This path is for gateway peers only.",
            },
        };
        match decision {
            peers::PeerRequest::Accept => {
                self.ex.borrow_mut().peer = true;
                if end_of_stream {
                    return self.peer_body(0, true);
                }
                Action::Pause
            }
            peers::PeerRequest::Reject { status, code, message } => {
                self.reject(&Rejection::new(status, "invalid_request_error", code, message))
            }
            // `classify` with this path never says so; answer as for any unknown path.
            peers::PeerRequest::NotPeer => {
                self.reject(&Rejection::new(404, "invalid_request_error", "not_found", "No route."))
            }
        }
    }

    /// `peers`: a peer's body, applied to this gateway's prefix table once complete.
    pub(super) fn peer_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let limit = peers::MAX_BODY_BYTES.max(peers::MAX_PLACEMENT_BODY_BYTES);
        if body_size > limit {
            return self.reject(&Rejection::new(
                413,
                "invalid_request_error",
                "request_too_large",
                format!("A peer message is at most {limit} bytes."),
            ));
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = if body_size == 0 { Vec::new() } else { io::request_body(body_size).unwrap_or_default() };
        if peers::is_load_report(&body) {
            return self.peer_load(&body);
        }
        if peers::is_placement_batch(&body) {
            return self.peer_placements(&body);
        }
        if body.len() > peers::MAX_BODY_BYTES {
            return self.reject(&Rejection::new(
                413,
                "invalid_request_error",
                "request_too_large",
                format!("A batch of prefix records is at most {} bytes.", peers::MAX_BODY_BYTES),
            ));
        }
        let received = peers::receive(&io::HostStore, self.worker.scheduler.borrow().shared_prefix(), &body);
        let mut m = self.worker.metrics.borrow_mut();
        match received {
            Ok(n) => {
                m.add(telemetry::name(telemetry::PEER_RECORDS, &[("outcome", "applied")]), n as u64);
                drop(m);
                self.ex.borrow_mut().answered = true;
                io::send_local_reply(204, &[], &[]);
                Action::Pause
            }
            // Another build's batch (a rolling upgrade): ignored without an error for the sender.
            Err(peers::WireError::UnknownVersion(_)) => {
                m.count(telemetry::name(telemetry::PEER_RECORDS, &[("outcome", "skipped")]));
                drop(m);
                self.ex.borrow_mut().answered = true;
                io::send_local_reply(204, &[], &[]);
                Action::Pause
            }
            Err(e) => {
                m.count(telemetry::name(telemetry::PEER_RECORDS, &[("outcome", "refused")]));
                drop(m);
                self.reject(&Rejection::new(
                    400,
                    "invalid_request_error",
                    "bad_peer_records",
                    format!("The prefix records were refused whole: {e:?}."),
                ))
            }
        }
    }

    /// `peers.load_interval_ms`: a peer's in-flight counts, written as its record in the peer
    /// slots of the in-flight table (`inflight::put_peer`), which every worker here then adds to
    /// its own. Fails closed: when this gateway's own sender nonce cannot be read, the report
    /// is not applied (it may be this gateway's own, which would double its counts).
    pub(super) fn peer_load(&mut self, body: &[u8]) -> Action {
        let store = io::HostStore;
        let Some(pc) = self.worker.cfg.peers.as_ref() else { return Action::Continue };
        let outcome = match peers::decode_load(body) {
            Err(peers::WireError::UnknownVersion(_)) => LoadOutcome::Skipped,
            Err(e) => LoadOutcome::Refused(format!("{e:?}")),
            Ok((sender, counts)) => match store.get(peers::LOAD_SENDER_KEY) {
                Err(e) => LoadOutcome::Error(format!("this gateway's sender nonce cannot be read: {e:?}")),
                // This gateway's own report (it lists itself among its peers): nothing to add.
                Ok(own) if peers::is_own_report(own.as_ref().map(|(v, _)| v.as_slice()), sender) => {
                    LoadOutcome::Own
                }
                Ok(_) => {
                    let published = store.get(peers::PEER_COUNT_KEY).ok().flatten();
                    let limit = peers::load_sender_limit(pc, published.as_ref().map(|(v, _)| v.as_slice()));
                    match inflight::put_peer(&store, sender, &counts, io::now_ms(), limit) {
                        Ok(inflight::PeerPut::Applied) => LoadOutcome::Applied,
                        Ok(inflight::PeerPut::Full) => LoadOutcome::Full(limit),
                        Err(e) => LoadOutcome::Error(format!("the in-flight table refused them: {e:?}")),
                    }
                }
            },
        };
        self.worker
            .metrics
            .borrow_mut()
            .count(telemetry::name(telemetry::PEER_LOAD_REPORTS, &[("outcome", outcome.tag())]));
        match outcome {
            LoadOutcome::Applied | LoadOutcome::Own | LoadOutcome::Skipped => {
                self.ex.borrow_mut().answered = true;
                io::send_local_reply(204, &[], &[]);
                Action::Pause
            }
            LoadOutcome::Refused(why) => self.reject(&Rejection::new(
                400,
                "invalid_request_error",
                "bad_peer_load",
                format!("The in-flight report was refused: {why}."),
            )),
            LoadOutcome::Full(limit) => self.reject(
                &Rejection::new(
                    429,
                    "rate_limit_error",
                    "peer_load_full",
                    format!(
                        "The in-flight report was refused: {limit} other senders already report here, \
                     as many as this gateway has peers."
                    ),
                )
                .with_retry_after(1),
            ),
            LoadOutcome::Error(why) => self.reject(&Rejection::new(
                503,
                "server_error",
                "peer_load_unavailable",
                format!("The in-flight report was not applied: {why}."),
            )),
        }
    }
}

impl Filter {
    /// A peer's picks (`peers::decode_placements`): into this worker's prefix index, and into
    /// its placement ring (marked foreign, so the poller does not send them on) for the other
    /// workers here. This gateway's own batch (it lists itself among its peers) is ignored.
    fn peer_placements(&mut self, body: &[u8]) -> Action {
        let decoded = peers::decode_placements(body);
        let outcome = match &decoded {
            Err(peers::WireError::UnknownVersion(_)) => "skipped",
            Err(_) => "refused",
            Ok((sender, _)) => match io::HostStore.get(peers::LOAD_SENDER_KEY) {
                Ok(own) if peers::is_own_report(own.as_ref().map(|(v, _)| v.as_slice()), *sender) => "own",
                // Unreadable: applying our own placements again costs nothing wrong (they name
                // the pods we sent them to), so they are applied.
                _ => "applied",
            },
        };
        if let (Ok((_, placements)), "applied") = (&decoded, outcome) {
            let mut scheduler = self.worker.scheduler.borrow_mut();
            for p in placements {
                scheduler.observe(p);
            }
            drop(scheduler);
            for p in placements {
                super::feed::publish(&self.worker, p);
            }
        }
        let n = decoded.as_ref().map_or(1, |(_, p)| p.len().max(1)) as u64;
        self.worker
            .metrics
            .borrow_mut()
            .add(telemetry::name(telemetry::PEER_PLACEMENTS, &[("outcome", outcome)]), n);
        if outcome == "refused" {
            let why = decoded.err().map(|e| format!("{e:?}")).unwrap_or_default();
            return self.reject(&Rejection::new(
                400,
                "invalid_request_error",
                "bad_peer_placements",
                format!("The placements were refused whole: {why}."),
            ));
        }
        self.ex.borrow_mut().answered = true;
        io::send_local_reply(204, &[], &[]);
        Action::Pause
    }
}

/// What became of a peer's in-flight report (`Filter::peer_load`), as counted in
/// `inference_picker_peer_load_reports_total{outcome}`.
enum LoadOutcome {
    Applied,
    Own,
    /// Another build's report (a version this one does not read): ignored (204).
    Skipped,
    /// Malformed: refused whole (400).
    Refused(String),
    /// More senders than peers (`inflight::PeerPut::Full`, 429).
    Full(usize),
    /// The shared store failed: not applied (503).
    Error(String),
}

impl LoadOutcome {
    fn tag(&self) -> &'static str {
        match self {
            LoadOutcome::Applied => "applied",
            LoadOutcome::Own => "own",
            LoadOutcome::Skipped => "skipped",
            LoadOutcome::Refused(_) => "refused",
            LoadOutcome::Full(_) => "refused_full",
            LoadOutcome::Error(_) => "error",
        }
    }
}
