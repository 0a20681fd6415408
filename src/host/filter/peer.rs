//! The peers exchange on the filter's path: a peer gateway's prefix records and placements
//! (`crate::poll::peers`), answered here and never sent to a pod.

use proxy_wasm::types::Action;

use super::super::io;
use super::Filter;
use crate::base::codec::Tag;
use crate::base::errors::Rejection;
use crate::base::ports::SharedStore;
use crate::base::telemetry;
use crate::poll::peers;

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
        if peers::is_retired_load_report(&body) {
            return self.retired_peer_load();
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

    /// A load report (tag `PeerLoadReport`) from a replica of an older build: the load exchange
    /// was removed, so nothing is applied. Answered 204, like a message of a version this build
    /// does not read, so that replica logs no send failure; counted in
    /// `inference_picker_records_skipped_total{reason="peer_load"}`.
    fn retired_peer_load(&mut self) -> Action {
        self.worker
            .metrics
            .borrow_mut()
            .count(telemetry::name(telemetry::RECORDS_SKIPPED, &[("reason", Tag::PeerLoadReport.name())]));
        self.ex.borrow_mut().answered = true;
        io::send_local_reply(204, &[], &[]);
        Action::Pause
    }

    /// A peer's picks (`peers::decode_placements`): into this worker's prefix index, and into
    /// its placement ring (marked foreign, so the poller does not send them on) for the other
    /// workers here. This gateway's own batch (it lists itself among its peers) is ignored.
    fn peer_placements(&mut self, body: &[u8]) -> Action {
        let decoded = peers::decode_placements(body);
        let outcome = match &decoded {
            Err(peers::WireError::UnknownVersion(_)) => "skipped",
            Err(_) => "refused",
            Ok((sender, _)) => match io::HostStore.get(peers::SENDER_KEY) {
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
