//! The decision record: what the filter decided for one request, as the stream's filter state
//! (`filter.decision_state`), for Envoy's access log and tracer to show.
//!
//! Each field is one filter-state key, a plain string, set once the request is routed or
//! answered. Envoy names a key the module sets `wasm.<key>`, so an access log reads it as
//! `%FILTER_STATE(wasm.inference_picker_endpoint:PLAIN)%` and a tracer custom tag as
//! `value: "%FILTER_STATE(wasm.inference_picker_endpoint:PLAIN)%"`. A field with no value (no
//! fallbacks, no objective, no prediction) is not set: the access log prints `-`, the tracer
//! leaves the tag out.
//!
//! | key | value |
//! |---|---|
//! | `inference_picker_endpoint` | the chosen pod, `ip:port` |
//! | `inference_picker_fallbacks` | the pods Envoy may retry on, in order, comma-separated |
//! | `inference_picker_prefill_endpoint` | the prefill pod of a split P/D request |
//! | `inference_picker_reason` | why that pod, [`Reason`] |
//! | `inference_picker_model` | the model the request was sent as (after rewrites) |
//! | `inference_picker_priority` | the request's priority (an integer; below 0 sheddable) |
//! | `inference_picker_objective` | the trusted objective header's value, when configured |
//! | `inference_picker_tier` | the trusted tier header's value, when configured |
//! | `inference_picker_predicted_ttft_ms` | the chosen pod's predicted TTFT, one decimal |
//! | `inference_picker_ttft_target_ms` | the request's TTFT target (`crate::flow::slo`), when it has one |
//! | `inference_picker_slo` | what the prediction said of that target: `meets`, `misses`, `unknown` |
//! | `inference_picker_queue_ms` | the time flow control held the request (0: not held) |
//! | `inference_picker_error` | the error code of a request the module answered itself |
//!
//! A request the module answers (a 4xx, a 429 shed, a 503 with no pod) has
//! `inference_picker_reason` `rejected` and its error code, plus its queue time when it was held.

use std::borrow::Cow;

use crate::base::errors::Rejection;
use crate::flow::priority::PriorityDecision;
use crate::scheduler::{Pick, PickReason};

pub const ENDPOINT: &str = "inference_picker_endpoint";
pub const FALLBACKS: &str = "inference_picker_fallbacks";
pub const PREFILL_ENDPOINT: &str = "inference_picker_prefill_endpoint";
pub const REASON: &str = "inference_picker_reason";
pub const MODEL: &str = "inference_picker_model";
pub const PRIORITY: &str = "inference_picker_priority";
pub const OBJECTIVE: &str = "inference_picker_objective";
pub const TIER: &str = "inference_picker_tier";
pub const PREDICTED_TTFT_MS: &str = "inference_picker_predicted_ttft_ms";
pub const TTFT_TARGET_MS: &str = "inference_picker_ttft_target_ms";
pub const SLO: &str = "inference_picker_slo";
pub const QUEUE_MS: &str = "inference_picker_queue_ms";
pub const ERROR: &str = "inference_picker_error";

/// Every key this module may set, for the docs' check and the shipped config's log format.
pub const KEYS: [&str; 13] = [
    ENDPOINT,
    FALLBACKS,
    PREFILL_ENDPOINT,
    REASON,
    MODEL,
    PRIORITY,
    OBJECTIVE,
    TIER,
    PREDICTED_TTFT_MS,
    TTFT_TARGET_MS,
    SLO,
    QUEUE_MS,
    ERROR,
];

/// Why the chosen pod was chosen, from what decided it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The client's session token named a healthy, non-overloaded pod.
    SessionToken,
    /// No pod was healthy: the least-loaded serving pod, unscored (`fail_open`).
    FailOpen,
    /// The chosen pod holds part of the prompt (its prefix score is above 0).
    PrefixHit,
    /// No pod held the prompt; the request named a session, whose rendezvous order broke the
    /// ties among the pods as good as the best.
    Session,
    /// No pod held the prompt and no session applied: the least-cost pod by load (queue, KV
    /// use, in-flight requests, predicted TTFT).
    Load,
    /// Anthropic's token count (`/v1/messages/count_tokens`), not a generation: the healthy pod
    /// serving the model with the fewest requests in flight, unscored.
    CountTokens,
    /// The module answered the request itself.
    Rejected,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::SessionToken => "session_token",
            Reason::FailOpen => "fail_open",
            Reason::PrefixHit => "prefix_hit",
            Reason::Session => "session",
            Reason::Load => "load",
            Reason::CountTokens => "count_tokens",
            Reason::Rejected => "rejected",
        }
    }

    /// The reason of a pick; `session` says the request named a session id.
    pub fn of(pick: &Pick, session: bool) -> Reason {
        match pick.reason {
            PickReason::SessionToken => Reason::SessionToken,
            PickReason::FailOpen => Reason::FailOpen,
            PickReason::TokenCount => Reason::CountTokens,
            PickReason::Scored if pick.prefix_score > 0.0 => Reason::PrefixHit,
            PickReason::Scored if session => Reason::Session,
            PickReason::Scored => Reason::Load,
        }
    }
}

/// A routed request's fields, in [`KEYS`] order, leaving out those without a value. `destination`
/// is the pick's `x-gateway-destination-endpoint` value ([`Pick::destination_header`]: the
/// primary, then the fallbacks), which the filter builds anyway; the fallbacks are its tail.
/// Values borrow from the pick and the priority where they can: no copy per field.
pub fn routed<'a>(
    pick: &'a Pick,
    destination: &'a str,
    prefiller: Option<&'a str>,
    priority: &'a PriorityDecision,
    session: bool,
    queue_ms: u64,
) -> Vec<(&'static str, Cow<'a, str>)> {
    let mut out = Vec::with_capacity(11);
    out.push((ENDPOINT, Cow::Borrowed(pick.primary.as_str())));
    if let Some((_, fallbacks)) = destination.split_once(',') {
        out.push((FALLBACKS, Cow::Borrowed(fallbacks)));
    }
    if let Some(p) = prefiller {
        out.push((PREFILL_ENDPOINT, Cow::Borrowed(p)));
    }
    out.push((REASON, Cow::Borrowed(Reason::of(pick, session).as_str())));
    out.push((MODEL, Cow::Borrowed(pick.target_model.as_str())));
    out.push((PRIORITY, Cow::Owned(priority.priority.to_string())));
    if let Some(o) = &priority.objective {
        out.push((OBJECTIVE, Cow::Borrowed(o.as_str())));
    }
    if let Some(t) = &priority.tier {
        out.push((TIER, Cow::Borrowed(t.as_str())));
    }
    if let Some(ms) = pick.predicted_ms.and_then(tenths) {
        out.push((PREDICTED_TTFT_MS, Cow::Owned(ms)));
    }
    if let Some(t) = priority.targets.ttft_ms {
        out.push((TTFT_TARGET_MS, Cow::Owned(t.to_string())));
    }
    if let Some(v) = pick.slo {
        out.push((SLO, Cow::Borrowed(v.as_str())));
    }
    out.push((QUEUE_MS, Cow::Owned(queue_ms.to_string())));
    out
}

/// An answered request's fields: the reason `rejected`, the error code, and the queue time when
/// flow control held it.
pub fn rejected(rej: &Rejection, queue_ms: Option<u64>) -> Vec<(&'static str, Cow<'static, str>)> {
    let mut out = vec![(REASON, Cow::Borrowed(Reason::Rejected.as_str())), (ERROR, Cow::Borrowed(rej.code))];
    if let Some(q) = queue_ms {
        out.push((QUEUE_MS, Cow::Owned(q.to_string())));
    }
    out
}

/// `ms` with one decimal, without float formatting (`None` for a value that is not a finite,
/// non-negative number of at most about 3 years).
fn tenths(ms: f64) -> Option<String> {
    if !(0.0..=1e11).contains(&ms) {
        return None;
    }
    // In range: the cast cannot saturate.
    let t = (ms * 10.0).round() as u64;
    Some(format!("{}.{}", t / 10, t % 10))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::priority::PrioritySource;

    fn pick(reason: PickReason, prefix: f64) -> Pick {
        Pick {
            primary: "10.0.0.1:8000".into(),
            fallbacks: vec!["10.0.0.2:8000".into(), "10.0.0.3:8000".into()],
            target_model: "m-lora".into(),
            model_rewritten: false,
            session_token: "v2.x".into(),
            fail_open: reason == PickReason::FailOpen,
            debug_scores: None,
            reason,
            serving: 3,
            healthy: 3,
            overloaded: 0,
            prefix_score: prefix,
            prefix_blocks: 4,
            predicted_ms: Some(123.456),
            slo: None,
            ticket: 0,
        }
    }

    fn priority(objective: Option<&str>, tier: Option<&str>) -> PriorityDecision {
        PriorityDecision {
            priority: -1,
            source: PrioritySource::Model,
            objective: objective.map(str::to_string),
            tier: tier.map(str::to_string),
            fairness_id: "t".into(),
            targets: Default::default(),
        }
    }

    fn get<'a>(fields: &'a [(&'static str, Cow<'_, str>)], key: &str) -> Option<&'a str> {
        fields.iter().find(|(k, _)| *k == key).map(|(_, v)| v.as_ref())
    }

    #[test]
    fn reason_follows_what_decided() {
        assert_eq!(Reason::of(&pick(PickReason::SessionToken, 0.5), true), Reason::SessionToken);
        assert_eq!(Reason::of(&pick(PickReason::FailOpen, 0.5), true), Reason::FailOpen);
        assert_eq!(Reason::of(&pick(PickReason::Scored, 0.25), true), Reason::PrefixHit);
        assert_eq!(Reason::of(&pick(PickReason::Scored, 0.0), true), Reason::Session);
        assert_eq!(Reason::of(&pick(PickReason::Scored, 0.0), false), Reason::Load);
        assert_eq!(Reason::of(&pick(PickReason::TokenCount, 0.0), true), Reason::CountTokens);
        assert_eq!(Reason::CountTokens.as_str(), "count_tokens");
    }

    #[test]
    fn routed_fields_carry_the_decision() {
        let p = pick(PickReason::Scored, 0.5);
        let prio = priority(Some("premium"), None);
        let dest = p.destination_header();
        let f = routed(&p, &dest, Some("10.0.0.9:8000"), &prio, false, 42);
        assert_eq!(get(&f, ENDPOINT), Some("10.0.0.1:8000"));
        assert_eq!(get(&f, FALLBACKS), Some("10.0.0.2:8000,10.0.0.3:8000"));
        assert_eq!(get(&f, PREFILL_ENDPOINT), Some("10.0.0.9:8000"));
        assert_eq!(get(&f, REASON), Some("prefix_hit"));
        assert_eq!(get(&f, MODEL), Some("m-lora"));
        assert_eq!(get(&f, PRIORITY), Some("-1"));
        assert_eq!(get(&f, OBJECTIVE), Some("premium"));
        assert_eq!(get(&f, TIER), None);
        assert_eq!(get(&f, PREDICTED_TTFT_MS), Some("123.5"));
        assert_eq!(get(&f, TTFT_TARGET_MS), None);
        assert_eq!(get(&f, QUEUE_MS), Some("42"));
        assert_eq!(get(&f, ERROR), None);
        // With a target, the target and the verdict.
        let mut p = p.clone();
        p.slo = Some(crate::scheduler::SloVerdict::Misses);
        let mut prio = prio.clone();
        prio.targets.ttft_ms = Some(500);
        let f = routed(&p, &dest, Some("10.0.0.9:8000"), &prio, false, 42);
        assert_eq!((get(&f, TTFT_TARGET_MS), get(&f, SLO)), (Some("500"), Some("misses")));
        // Every key is one of KEYS, in KEYS order, once.
        let order: Vec<usize> = f.iter().map(|(k, _)| KEYS.iter().position(|x| x == k).unwrap()).collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}");
    }

    #[test]
    fn absent_values_are_left_out() {
        let mut p = pick(PickReason::Scored, 0.0);
        p.fallbacks.clear();
        p.predicted_ms = None;
        let prio = priority(None, Some("gold"));
        let dest = p.destination_header();
        let f = routed(&p, &dest, None, &prio, false, 0);
        for key in [FALLBACKS, PREFILL_ENDPOINT, OBJECTIVE, PREDICTED_TTFT_MS, TTFT_TARGET_MS, SLO, ERROR] {
            assert_eq!(get(&f, key), None, "{key}");
        }
        assert_eq!(get(&f, TIER), Some("gold"));
        assert_eq!(get(&f, QUEUE_MS), Some("0"));
    }

    #[test]
    fn rejection_fields_name_the_code() {
        let rej = Rejection::new(429, "rate_limit_exceeded", "shed", "saturated");
        let f = rejected(&rej, Some(7));
        assert_eq!(get(&f, REASON), Some("rejected"));
        assert_eq!(get(&f, ERROR), Some("shed"));
        assert_eq!(get(&f, QUEUE_MS), Some("7"));
        assert_eq!(get(&rejected(&rej, None), QUEUE_MS), None);
    }

    #[test]
    fn tenths_rounds_and_refuses_nonsense() {
        assert_eq!(tenths(0.0).as_deref(), Some("0.0"));
        assert_eq!(tenths(0.04).as_deref(), Some("0.0"));
        assert_eq!(tenths(0.05).as_deref(), Some("0.1"));
        assert_eq!(tenths(1999.96).as_deref(), Some("2000.0"));
        for bad in [f64::NAN, f64::INFINITY, -1.0, 1e12] {
            assert_eq!(tenths(bad), None, "{bad}");
        }
    }
}
