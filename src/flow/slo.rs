//! Latency targets (SLOs) per request: where a request's TTFT and TPOT targets come from, the
//! header rule, and the deadline flow control orders held requests by. Pure.
//!
//! # Sources, in precedence order (the first that yields a target wins)
//! 1. **Header**: `priority.slo.ttft_header` (default `x-slo-ttft-ms`, the header of GIE's and
//!    llm-d's latency-based routing) and `priority.slo.tpot_header` (`x-slo-tpot-ms`), read only
//!    when `priority.slo.trust_headers` is set (default false), the same rule as the tier header:
//!    trusted means something in front of this filter always sets or removes it. Untrusted, they
//!    are never read; trusted or not, they are removed before the request goes upstream. A
//!    trusted header whose value is not a number of milliseconds in
//!    `1..=`[`MAX_TARGET_MS`] is answered 400 (`invalid_slo_header`) before the body is read.
//! 2. **Objective**: the `ttft_ms` / `tpot_ms` of the InferenceObjective a trusted
//!    `x-gateway-inference-objective` names.
//! 3. **Tier**: `priority.tier.slo[value]` for the tier a trusted tier header names.
//!
//! TTFT and TPOT are resolved separately: a header may set one, the objective the other. No
//! target at all means behaviour exactly as without this module.
//!
//! # What the target does
//! The scheduler reads the TTFT target as a *budget*, `ttft_ms × (1 − priority.slo.margin)`
//! (`crate::scheduler::SloAsk`); flow control reads the *deadline*, arrival + `ttft_ms`
//! ([`deadline_ms`]). The TPOT target is recorded (decision record, attainment) but the module
//! does not predict TPOT, so it does not route on it.

use crate::base::errors::Rejection;
use crate::base::json::ConfigError;
use crate::base::settings::settings;

/// Default header of a request's TTFT target (GIE / llm-d latency-based routing).
pub const TTFT_HEADER: &str = "x-slo-ttft-ms";
/// Default header of a request's TPOT target.
pub const TPOT_HEADER: &str = "x-slo-tpot-ms";
/// The longest target accepted (one hour), in ms.
pub const MAX_TARGET_MS: u32 = 3_600_000;

settings! {
    /// Latency targets from headers, and the margin the scheduler keeps below a target.
    #[derive(Debug, Clone, PartialEq)]
    pub struct SloConfig {
        /// Read the target headers (`ttft_header`, `tpot_header`) from requests. Default false
        /// (they are only stripped): a client that can set its own target can claim the pods
        /// that tighter targets need. Set it only when a filter in front of this one always
        /// sets or removes them.
        pub trust_headers: bool = false,
        /// Header carrying a request's TTFT target in ms (a positive number). Default
        /// `x-slo-ttft-ms` (GIE and llm-d latency-based routing).
        #[schema(regex(pattern = r"^[a-z0-9!#$%&'*+.^_`|~-]+$"))]
        pub ttft_header: String = TTFT_HEADER.to_string(),
        /// Header carrying a request's TPOT target in ms. Default `x-slo-tpot-ms`.
        #[schema(regex(pattern = r"^[a-z0-9!#$%&'*+.^_`|~-]+$"))]
        pub tpot_header: String = TPOT_HEADER.to_string(),
        /// The share of a TTFT target the prediction must leave free for a pod to count as
        /// meeting it: a pod meets target `T` when its predicted TTFT is at most `T × (1 −
        /// margin)`. Default 0.2; in the replay's tiered-SLO study 0.4 raised premium attainment
        /// at 1.5 × overload only from 96.0 % to 97.2 % (Azure) and shed more below capacity
        /// (docs/slo.md).
        #[range(min = 0.0, max = 0.9)]
        pub margin: f64 = 0.2,
    }
}

settings! {
    /// The latency targets of one tier.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct SloTarget {
        /// Time-to-first-token target, ms.
        #[range(min = 1, max = 3600000)]
        pub ttft_ms: u32,
        /// Time-per-output-token target, ms, 1 to 3600000. Default none (recorded, not routed
        /// on).
        pub tpot_ms: Option<u32> = None,
    }
}

/// Where a request's TTFT target came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetSource {
    Header,
    Objective,
    Tier,
}

impl SloTarget {
    /// Appends every problem to `errs` (`ttft_ms`'s range; `tpot_ms`, when set, in the same).
    pub fn validate(&self, path: &str, errs: &mut Vec<ConfigError>) {
        self.validate_ranges(path, errs);
        check_target(self.tpot_ms, &format!("{path}.tpot_ms"), errs);
    }
}

/// An optional target must be in `1..=`[`MAX_TARGET_MS`].
pub fn check_target(ms: Option<u32>, path: &str, errs: &mut Vec<ConfigError>) {
    if let Some(v) = ms {
        if v == 0 || v > MAX_TARGET_MS {
            errs.push(ConfigError {
                path: path.to_string(),
                reason: format!("must be 1 to {MAX_TARGET_MS} ms"),
            });
        }
    }
}

impl SloConfig {
    /// Appends every problem to `errs`: the margin's range, header names.
    pub fn validate(&self, path: &str, errs: &mut Vec<ConfigError>, valid_name: &dyn Fn(&str) -> bool) {
        self.validate_ranges(path, errs);
        for (key, h) in [("ttft_header", &self.ttft_header), ("tpot_header", &self.tpot_header)] {
            if !valid_name(h) {
                errs.push(ConfigError {
                    path: format!("{path}.{key}"),
                    reason: format!("{h:?} is not a lower-case HTTP header name"),
                });
            }
        }
        if self.ttft_header == self.tpot_header {
            errs.push(ConfigError {
                path: format!("{path}.tpot_header"),
                reason: "must differ from ttft_header".into(),
            });
        }
    }
}

impl TargetSource {
    pub fn as_str(self) -> &'static str {
        match self {
            TargetSource::Header => "header",
            TargetSource::Objective => "objective",
            TargetSource::Tier => "tier",
        }
    }
}

/// A request's resolved targets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Targets {
    pub ttft_ms: Option<u32>,
    pub tpot_ms: Option<u32>,
    /// The source of `ttft_ms`.
    pub source: Option<TargetSource>,
}

/// Parses a target header's value: a positive decimal number of milliseconds (`500`, `250.5`),
/// spaces around it allowed, at most [`MAX_TARGET_MS`]; a fraction rounds up. `None` when it is
/// not one.
pub fn parse_ms(value: &str) -> Option<u32> {
    let v = value.trim();
    // Digits with at most one '.', nothing else: no sign, exponent, "inf" or "nan".
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit() || b == b'.') || v.matches('.').count() > 1 {
        return None;
    }
    let x: f64 = v.parse().ok()?;
    let ms = x.ceil();
    (ms >= 1.0 && ms <= f64::from(MAX_TARGET_MS)).then_some(ms as u32)
}

/// The 400 for a trusted target header whose value [`parse_ms`] refuses.
pub fn invalid_header(header: &str) -> Rejection {
    Rejection::new(
        400,
        "invalid_request_error",
        "invalid_slo_header",
        format!("{header} must be a positive number of milliseconds, at most {MAX_TARGET_MS}"),
    )
}

/// The raw values of the trusted target headers, read before they are stripped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TargetHeaders {
    pub ttft: Option<String>,
    pub tpot: Option<String>,
}

impl TargetHeaders {
    /// Reads the headers through `get` when `cfg.trust_headers`; otherwise asks for nothing.
    pub fn read(cfg: &SloConfig, get: &dyn Fn(&str) -> Option<String>) -> Self {
        if !cfg.trust_headers {
            return Self::default();
        }
        let non_empty = |v: Option<String>| v.filter(|s| !s.trim().is_empty());
        Self { ttft: non_empty(get(&cfg.ttft_header)), tpot: non_empty(get(&cfg.tpot_header)) }
    }

    /// The parsed `(ttft_ms, tpot_ms)`, or the 400 naming the first header that is not a
    /// number of milliseconds.
    pub fn parse(&self, cfg: &SloConfig) -> Result<(Option<u32>, Option<u32>), Rejection> {
        let one = |v: &Option<String>, name: &str| match v {
            None => Ok(None),
            Some(s) => parse_ms(s).map(Some).ok_or_else(|| invalid_header(name)),
        };
        Ok((one(&self.ttft, &cfg.ttft_header)?, one(&self.tpot, &cfg.tpot_header)?))
    }
}

/// Resolves the targets by precedence header > objective > tier, each of TTFT and TPOT on its
/// own. `objective` and `tier` are the targets configured for the objective and tier the
/// request's trusted headers name (`None` when none is named or it has none). An invalid header
/// value counts as absent here: the host has answered it 400 before.
pub fn resolve(
    headers: &TargetHeaders,
    cfg: &SloConfig,
    objective: (Option<u32>, Option<u32>),
    tier: Option<SloTarget>,
) -> Targets {
    let (h_ttft, h_tpot) = headers.parse(cfg).unwrap_or((None, None));
    let tier_ttft = tier.map(|t| t.ttft_ms);
    let tier_tpot = tier.and_then(|t| t.tpot_ms);
    let (ttft_ms, source) = match (h_ttft, objective.0, tier_ttft) {
        (Some(t), _, _) => (Some(t), Some(TargetSource::Header)),
        (None, Some(t), _) => (Some(t), Some(TargetSource::Objective)),
        (None, None, Some(t)) => (Some(t), Some(TargetSource::Tier)),
        _ => (None, None),
    };
    Targets { ttft_ms, tpot_ms: h_tpot.or(objective.1).or(tier_tpot), source }
}

/// The deadline flow control orders a held request by: its arrival plus its TTFT target.
/// `None` without a target (held in arrival order, after every request with a deadline).
pub fn deadline_ms(arrived_ms: u64, ttft_ms: Option<u32>) -> Option<u64> {
    ttft_ms.map(|t| arrived_ms.saturating_add(u64::from(t)))
}

/// The budget the scheduler compares predictions with: `ttft_ms × (1 − margin)`.
pub fn budget_ms(ttft_ms: u32, margin: f64) -> f64 {
    let m = if margin.is_finite() { margin.clamp(0.0, 0.9) } else { 0.0 };
    f64::from(ttft_ms) * (1.0 - m)
}

/// The `class` label of a request's SLO counters: its objective, else its tier, else
/// [`DEFAULT_CLASS`] (bounded: objectives and tiers are names of the configuration).
pub fn class<'a>(objective: Option<&'a str>, tier: Option<&'a str>) -> &'a str {
    objective.or(tier).unwrap_or(DEFAULT_CLASS)
}

/// The class of a request with neither objective nor tier (a target from the header alone).
pub const DEFAULT_CLASS: &str = "default";

/// Predicted ÷ actual TTFT in per cent, the prediction-error histogram's sample: 100 is exact,
/// below 100 an underestimate. `None` when either is not a positive, finite number (nothing to
/// learn from), capped at 100,000 %.
pub fn prediction_ratio_pct(predicted_ms: f64, actual_ms: u64) -> Option<u64> {
    if !(predicted_ms.is_finite() && predicted_ms > 0.0) || actual_ms == 0 {
        return None;
    }
    let pct = (predicted_ms / actual_ms as f64 * 100.0).round();
    Some(if pct >= 100_000.0 { 100_000 } else { pct as u64 })
}

/// The outcome of a request with a TTFT target, measured at the proxy (request sent to first
/// response byte of a streamed response).
pub fn outcome(target_ms: u32, actual_ms: u64) -> &'static str {
    if actual_ms <= u64::from(target_ms) {
        "met"
    } else {
        "missed"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_ms_takes_positive_milliseconds_only() {
        assert_eq!(parse_ms("500"), Some(500));
        assert_eq!(parse_ms(" 250 "), Some(250));
        assert_eq!(parse_ms("0.5"), Some(1));
        assert_eq!(parse_ms("250.2"), Some(251));
        assert_eq!(parse_ms("3600000"), Some(MAX_TARGET_MS));
        for bad in ["", " ", "0", "0.0", "-5", "+5", "1e3", "inf", "NaN", "5ms", "1.2.3", "3600001", "."] {
            assert_eq!(parse_ms(bad), None, "{bad:?}");
        }
    }

    fn cfg(trusted: bool) -> SloConfig {
        SloConfig { trust_headers: trusted, ..SloConfig::default() }
    }

    #[test]
    fn untrusted_headers_are_never_read() {
        let asked = std::cell::RefCell::new(Vec::new());
        let get = |n: &str| {
            asked.borrow_mut().push(n.to_string());
            Some("100".to_string())
        };
        assert_eq!(TargetHeaders::read(&cfg(false), &get), TargetHeaders::default());
        assert!(asked.borrow().is_empty());
        let h = TargetHeaders::read(&cfg(true), &get);
        assert_eq!(h.ttft.as_deref(), Some("100"));
        assert_eq!(*asked.borrow(), vec![TTFT_HEADER.to_string(), TPOT_HEADER.to_string()]);
    }

    #[test]
    fn an_invalid_trusted_value_is_a_400_naming_the_header() {
        let h = TargetHeaders { ttft: Some("fast".into()), tpot: None };
        let r = h.parse(&cfg(true)).unwrap_err();
        assert_eq!((r.status, r.code), (400, "invalid_slo_header"));
        assert!(r.message.contains(TTFT_HEADER));
        let h = TargetHeaders { ttft: Some("100".into()), tpot: Some("-1".into()) };
        assert!(h.parse(&cfg(true)).unwrap_err().message.contains(TPOT_HEADER));
    }

    #[test]
    fn precedence_is_header_then_objective_then_tier_for_each_target() {
        let c = cfg(true);
        let tier = Some(SloTarget { ttft_ms: 2000, tpot_ms: Some(80) });
        let none = TargetHeaders::default();
        assert_eq!(resolve(&none, &c, (None, None), None), Targets::default());
        let t = resolve(&none, &c, (None, None), tier);
        assert_eq!((t.ttft_ms, t.tpot_ms, t.source), (Some(2000), Some(80), Some(TargetSource::Tier)));
        let t = resolve(&none, &c, (Some(500), None), tier);
        assert_eq!((t.ttft_ms, t.tpot_ms, t.source), (Some(500), Some(80), Some(TargetSource::Objective)));
        let h = TargetHeaders { ttft: Some("300".into()), tpot: None };
        let t = resolve(&h, &c, (Some(500), Some(40)), tier);
        assert_eq!((t.ttft_ms, t.tpot_ms, t.source), (Some(300), Some(40), Some(TargetSource::Header)));
        // An invalid header (answered 400 by the host) falls through rather than panicking.
        let bad = TargetHeaders { ttft: Some("x".into()), tpot: None };
        assert_eq!(resolve(&bad, &c, (Some(500), None), None).ttft_ms, Some(500));
    }

    #[test]
    fn deadline_and_budget() {
        assert_eq!(deadline_ms(1_000, Some(500)), Some(1_500));
        assert_eq!(deadline_ms(u64::MAX, Some(500)), Some(u64::MAX));
        assert_eq!(deadline_ms(1_000, None), None);
        assert_eq!(budget_ms(1000, 0.2), 800.0);
        assert_eq!(budget_ms(1000, f64::NAN), 1000.0);
        assert!((budget_ms(1000, 5.0) - 100.0).abs() < 1e-9);
    }

    #[test]
    fn class_ratio_and_outcome() {
        assert_eq!(class(Some("batch"), Some("premium")), "batch");
        assert_eq!(class(None, Some("premium")), "premium");
        assert_eq!(class(None, None), DEFAULT_CLASS);
        assert_eq!(prediction_ratio_pct(120.0, 100), Some(120));
        assert_eq!(prediction_ratio_pct(50.0, 200), Some(25));
        assert_eq!(prediction_ratio_pct(1e12, 1), Some(100_000));
        assert_eq!(prediction_ratio_pct(f64::NAN, 100), None);
        assert_eq!(prediction_ratio_pct(0.0, 100), None);
        assert_eq!(prediction_ratio_pct(10.0, 0), None);
        assert_eq!(outcome(500, 500), "met");
        assert_eq!(outcome(500, 501), "missed");
    }

    #[test]
    fn defaults_parse_from_empty_object() {
        let c: SloConfig = crate::config::read_json("{}").unwrap();
        assert_eq!(c, SloConfig::default());
        assert!(!c.trust_headers);
        // ttft_ms is required, and both targets are checked for range.
        assert!(crate::config::read_json::<SloTarget>(r#"{}"#).is_err());
        let t: SloTarget = crate::config::read_json(r#"{"ttft_ms":0,"tpot_ms":0}"#).unwrap();
        let mut errs = Vec::new();
        t.validate("t", &mut errs);
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["t.ttft_ms", "t.tpot_ms"]);
        let t: SloTarget = crate::config::read_json(r#"{"ttft_ms":500}"#).unwrap();
        assert_eq!(t, SloTarget { ttft_ms: 500, tpot_ms: None });
    }
}
