//! Anthropic's token count (`POST /v1/messages/count_tokens`) at the pick. It is no generation:
//! the pod only tokenizes, in milliseconds. So it is never held or shed by flow control (the
//! caller skips admission; only the gateway's first metrics at startup are waited for, as for
//! every request), and it goes to the least-loaded healthy pod serving its model
//! (`crate::request::route_token_count`) while leaving no trace of load: no in-flight count (real
//! requests' predictions and flow control's capacity never see it), no prefill in the ledger and
//! no first-byte rate (ticket 0), no prefix placement (this worker's index, the cross-worker
//! table, the feed to the other workers and the peers), no session token, and no token usage read
//! from its answer (`{"input_tokens": N}`). Passive health hears its failures and 429s, not its
//! successes (`crate::state::health::from_non_generation`, applied in `Filter::record_health`).

use super::super::io;
use super::{set_decision, Exchange, Worker};
use crate::base::errors::Rejection;
use crate::base::telemetry;
use crate::request::protocol::{DESTINATION_HEADER, MAX_RETRIES_HEADER, ORIGINAL_DST_HEADER};
use crate::scheduler::PickState;

/// Picks the pod of a prepared token count and sets the routing headers on the current (or
/// effective) context; the token count's `super::go`.
pub(super) fn go(worker: &Worker, ex: &mut Exchange, inputs: PickState<'_>) -> Result<(), Rejection> {
    let Some(prepared) = ex.prepared.take() else {
        return Err(Rejection::new(500, "internal_error", "internal", "request state lost before routing"));
    };
    let pick = {
        let scheduler = worker.scheduler.borrow();
        let mut rng = worker.rng.borrow_mut();
        crate::request::route_token_count(
            &worker.cfg.request(),
            &scheduler,
            &mut *rng,
            &ex.head,
            &prepared,
            inputs,
        )?
    };
    let destination = pick.destination_header();
    if worker.cfg.filter.decision_state {
        set_decision(&crate::request::decision::routed(
            &pick,
            &destination,
            None,
            &prepared.priority,
            ex.head.session_id.is_some(),
            ex.queue_ms.unwrap_or(0),
        ));
    }
    io::set_request_header(DESTINATION_HEADER, Some(&destination));
    io::set_request_header(MAX_RETRIES_HEADER, Some(&pick.fallbacks.len().to_string()));
    io::set_request_header(ORIGINAL_DST_HEADER, Some(&pick.primary));
    {
        let mut metrics = worker.metrics.borrow_mut();
        let model = ("model", pick.target_model.as_str());
        let outcome = ("outcome", pick.reason.as_str());
        match telemetry::endpoint_tag(worker.cfg.filter.endpoint_metrics, &pick.primary) {
            Some(ep) => metrics.count_tagged(telemetry::REQUESTS, &[model, ep, outcome]),
            None => metrics.count_tagged(telemetry::REQUESTS, &[model, outcome]),
        }
    }
    ex.destinations = std::iter::once(pick.primary.clone()).chain(pick.fallbacks.iter().cloned()).collect();
    ex.model = Some(pick.target_model);
    ex.primary = Some(pick.primary);
    if ex.queue_ms.is_none() {
        ex.queue_ms = Some(0);
    }
    Ok(())
}
