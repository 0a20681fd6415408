//! Latency targets at the proxy (`crate::flow::slo`): what a routed request's first byte says of
//! its prediction and its target. At the pick the filter notes when the request went, what was
//! predicted and its target; at the first byte of a streamed response it records the measured
//! TTFT, the prediction error (predicted ÷ actual) and, with a target, whether it was met (the
//! time flow control held the request counts: a target runs from arrival). A
//! non-streamed response's first byte comes after the whole generation, so it is counted as
//! `unmeasured` and teaches nothing, as for the rate learning.

use super::super::io;
use super::{Exchange, Worker};
use crate::base::errors::Rejection;
use crate::base::telemetry;
use crate::flow::priority::PriorityDecision;
use crate::flow::slo;
use crate::scheduler::Pick;

/// What the first byte is compared with (the model label is the exchange's own `model`).
#[derive(Debug, Clone)]
pub(crate) struct Watch {
    sent_ms: u64,
    predicted_ms: Option<f64>,
    /// The TTFT target and the class it is counted in, when the request has one.
    target: Option<(u32, String)>,
    /// The time flow control held it: the target counts from arrival.
    queued_ms: u64,
}

/// At the pick: note what the first byte will be compared with (nothing when there is neither
/// a prediction nor a target).
pub(super) fn on_pick(ex: &mut Exchange, priority: &PriorityDecision, pick: &Pick, now_ms: u64) {
    let target = priority
        .targets
        .ttft_ms
        .map(|t| (t, slo::class(priority.objective.as_deref(), priority.tier.as_deref()).to_string()));
    if pick.predicted_ms.is_none() && target.is_none() {
        ex.slo = None;
        return;
    }
    ex.slo = Some(Watch {
        sent_ms: now_ms,
        predicted_ms: pick.predicted_ms,
        target,
        queued_ms: ex.queue_ms.unwrap_or(0),
    });
}

/// The module refused the request: a target no pod can meet counts as `shed` in its class.
pub(super) fn on_refused(worker: &Worker, priority: &PriorityDecision, rej: &Rejection) {
    if priority.targets.ttft_ms.is_some() && rej.code == "slo_unattainable" {
        let class = slo::class(priority.objective.as_deref(), priority.tier.as_deref());
        worker
            .metrics
            .borrow_mut()
            .count_tagged(telemetry::SLO_REQUESTS, &[("class", class), ("outcome", "shed")]);
    }
}

/// The first response byte arrived. `measured`: a streamed, unsplit response, whose first byte
/// is its first token.
pub(super) fn on_first_byte(worker: &Worker, ex: &mut Exchange, measured: bool) {
    let Some(w) = ex.slo.take() else { return };
    let mut metrics = worker.metrics.borrow_mut();
    if !measured {
        if let Some((_, class)) = &w.target {
            metrics.count_tagged(telemetry::SLO_REQUESTS, &[("class", class), ("outcome", "unmeasured")]);
        }
        return;
    }
    let actual = io::now_ms().saturating_sub(w.sent_ms);
    let model = ("model", ex.model.as_deref().unwrap_or_default());
    metrics.sample_tagged(telemetry::TTFT_MS, &[model], actual);
    if let Some(pct) = w.predicted_ms.and_then(|p| slo::prediction_ratio_pct(p, actual)) {
        metrics.sample_tagged(telemetry::TTFT_PREDICTION_RATIO, &[model], pct);
    }
    if let Some((t, class)) = &w.target {
        // From arrival: the time held counts against the target (the deadline flow control
        // orders by is arrival + target too).
        let seen = actual.saturating_add(w.queued_ms);
        metrics
            .count_tagged(telemetry::SLO_REQUESTS, &[("class", class), ("outcome", slo::outcome(*t, seen))]);
    }
}
