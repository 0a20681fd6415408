//! Request priority: where it comes from, which headers are trusted, and the fairness id.
//!
//! A priority is an `i32`; higher is more important, 0 is the default, and below 0 is
//! *sheddable* (answered 429 at once while the pool is saturated). This is the
//! InferenceObjective convention of the Gateway API Inference Extension.
//!
//! # Sources, in precedence order (the first that yields a value wins)
//! 1. **Objective**: header `x-gateway-inference-objective` names an objective in
//!    `priority.objectives`; its `priority` (unset = 0, as InferenceObjective) is used.
//! 2. **Tier**: the header named by `priority.tier.header` (e.g. `x-llm-tier`) carries a value
//!    looked up in `priority.tier.values` (e.g. `premium` → 10).
//! 3. **Model**: the criticality of the requested base model (`models[].criticality`, default
//!    Standard), mapped through `priority.criticality` (defaults Critical 10, Standard 0,
//!    Sheddable −10).
//!
//! The most specific source wins: an objective describes this one request, a tier describes the
//! caller, a criticality describes every request to the model. A header that is absent, empty,
//! untrusted or names something not in the config yields nothing, and the next source is tried;
//! the model source always yields, so every request gets a priority.
//!
//! # Trust
//! A header is read only when the config marks it trusted (`trust_objective_header`,
//! `tier.trusted`, `trust_fairness_header`; all default to false). Trusted means something in
//! front of this filter (an auth filter, the gateway route) always sets or removes it, so the
//! client cannot choose it. Untrusted headers are never read, so a client can never raise its
//! own priority or split itself into many fairness flows. Whether trusted or not, every header in
//! [`headers_to_strip`] is removed before the request goes upstream: the model server never sees
//! them. The host reads the trusted ones first ([`PriorityHeaders::read`]), then strips them.
//!
//! # Fairness id
//! `x-gateway-inference-fairness-id` (GIE) names the tenant for round-robin within a priority
//! level. When it is untrusted, absent or empty, and `trust_session_headers` is set, the
//! request's session id names the flow instead ([`PriorityHeaders::with_session`]); otherwise
//! it is `default-flow`. Values are cut to [`MAX_FAIRNESS_ID_BYTES`] so that a hostile value
//! cannot grow the queue's bookkeeping.

use std::collections::BTreeMap;

use crate::base::json::ConfigError;
use crate::base::settings::settings;
use crate::flow::slo::{self, SloConfig, SloTarget, TargetHeaders, Targets};
use crate::state::catalog::Criticality;

/// GIE request header naming an InferenceObjective.
pub const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";
/// GIE request header naming the fairness flow (tenant).
pub const FAIRNESS_HEADER: &str = "x-gateway-inference-fairness-id";
/// The fairness id used when the header is untrusted, absent or empty (GIE's default).
pub const DEFAULT_FAIRNESS_ID: &str = "default-flow";
/// Longer fairness ids are cut (at a character boundary) to this many bytes.
pub const MAX_FAIRNESS_ID_BYTES: usize = 128;

settings! {
    /// Where a request's priority comes from, and which priority headers are trusted.
    #[derive(Debug, Clone, PartialEq)]
    pub struct PriorityConfig {
        /// Priority of each model criticality. Default `{Critical: 10, Standard: 0, Sheddable: -10}`
        /// (the values InferenceObjective's own documentation uses as examples).
        pub criticality: CriticalityPriorities = CriticalityPriorities::default(),
        /// Named objectives selectable with `x-gateway-inference-objective`. Default none.
        pub objectives: Vec<ObjectiveConfig> = Vec::new(),
        /// Read `x-gateway-inference-objective` from requests. Default false: set it only when a
        /// filter in front of this one always sets or removes the header.
        pub trust_objective_header: bool = false,
        /// An SLA-tier header and its values. Default none.
        pub tier: Option<TierConfig> = None,
        /// Read `x-gateway-inference-fairness-id` from requests. Default false (every request is in
        /// `default-flow`): a client that can choose its fairness id can take a larger share by
        /// sending many ids.
        pub trust_fairness_header: bool = false,
        /// Use the request's session id (the first usable value of `scheduler.session.header`,
        /// then `filter.session_headers`) as its fairness id when no trusted
        /// `x-gateway-inference-fairness-id` names one. Default false (the session headers feed
        /// session affinity only): coding agents choose their session ids, so a client that sends
        /// many gets many shares of the round-robin. Turn it on to give each session its own share,
        /// or when something in front of this filter sets or removes those headers.
        pub trust_session_headers: bool = false,
        /// Latency-target headers and the scheduler's margin below a target (`crate::flow::slo`).
        pub slo: SloConfig = SloConfig::default(),
    }
}

settings! {
    /// The priority of each model criticality.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct CriticalityPriorities {
        /// Default 10.
        pub critical as "Critical": i32 = 10,
        /// Default 0.
        pub standard as "Standard": i32 = 0,
        /// Default −10.
        pub sheddable as "Sheddable": i32 = -10,
    }
}

settings! {
    /// One InferenceObjective: a name and its priority.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct ObjectiveConfig {
        /// The value of `x-gateway-inference-objective` that selects it. Unique, non-empty, no
        /// surrounding spaces.
        #[schema(length(min = 1))]
        pub name: String,
        /// Default 0 (InferenceObjective: "an unset value is treated as 0").
        pub priority: i32 = 0,
        /// Time-to-first-token target of this objective's requests, ms (1 to 3600000). Default
        /// none. See docs/slo.md.
        pub ttft_ms: Option<u32> = None,
        /// Time-per-output-token target, ms (1 to 3600000). Default none (recorded, not routed
        /// on).
        pub tpot_ms: Option<u32> = None,
    }
}

settings! {
    /// An SLA-tier header, e.g. `x-llm-tier: premium|standard|free`.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct TierConfig {
        /// Header name, lower case (e.g. `x-llm-tier`); not one of the Inference Extension headers.
        #[schema(regex(pattern = r"^[a-z0-9!#$%&'*+.^_`|~-]+$"))]
        pub header: String,
        /// Read the header from requests. Default false (the header is only stripped).
        pub trusted: bool = false,
        /// Tier value → priority. At least one. Values are matched exactly (case-sensitive) after
        /// trimming spaces.
        #[schema(extend("minProperties" = 1))]
        pub values: BTreeMap<String, i32>,
        /// Tier value → latency targets (`{"ttft_ms": 500, "tpot_ms": 50}`); each key must be a
        /// tier of `values`. Default none. See docs/slo.md.
        pub slo: BTreeMap<String, SloTarget> = BTreeMap::new(),
    }
}

impl CriticalityPriorities {
    pub fn of(&self, c: Criticality) -> i32 {
        match c {
            Criticality::Critical => self.critical,
            Criticality::Standard => self.standard,
            Criticality::Sheddable => self.sheddable,
        }
    }
}

/// True for a header name Envoy will hand to the filter as written: lower case, RFC 9110 token
/// characters, not a pseudo-header.
pub fn valid_header_name(name: &str) -> bool {
    !name.is_empty()
        && name.bytes().all(|b| {
            b.is_ascii_lowercase()
                || b.is_ascii_digit()
                || matches!(b, b'!' | b'#' | b'$' | b'%' | b'&' | b'\'' | b'*' | b'+' | b'-' | b'.')
                || matches!(b, b'^' | b'_' | b'`' | b'|' | b'~')
        })
}

impl PriorityConfig {
    /// Appends every problem to `errs`, each with its JSON path under `path` (e.g. `priority`).
    pub fn validate(&self, path: &str, errs: &mut Vec<ConfigError>) {
        let mut seen: Vec<&str> = Vec::new();
        for (i, o) in self.objectives.iter().enumerate() {
            let p = format!("{path}.objectives[{i}].name");
            if o.name.trim().is_empty() || o.name.trim() != o.name {
                errs.push(ConfigError {
                    path: p,
                    reason: "must be non-empty, without surrounding spaces".into(),
                });
            } else if seen.contains(&o.name.as_str()) {
                errs.push(ConfigError { path: p, reason: format!("duplicate objective {:?}", o.name) });
            } else {
                seen.push(&o.name);
            }
            slo::check_target(o.ttft_ms, &format!("{path}.objectives[{i}].ttft_ms"), errs);
            slo::check_target(o.tpot_ms, &format!("{path}.objectives[{i}].tpot_ms"), errs);
        }
        if let Some(t) = &self.tier {
            if !valid_header_name(&t.header) {
                errs.push(ConfigError {
                    path: format!("{path}.tier.header"),
                    reason: format!("{:?} is not a lower-case HTTP header name", t.header),
                });
            } else if t.header == OBJECTIVE_HEADER || t.header == FAIRNESS_HEADER {
                errs.push(ConfigError {
                    path: format!("{path}.tier.header"),
                    reason: format!("{:?} already has a meaning in the Inference Extension", t.header),
                });
            }
            if t.values.is_empty() {
                errs.push(ConfigError {
                    path: format!("{path}.tier.values"),
                    reason: "must name at least one tier".into(),
                });
            }
            for name in t.values.keys() {
                if name.trim().is_empty() || name.trim() != name {
                    errs.push(ConfigError {
                        path: format!("{path}.tier.values.{name}"),
                        reason: "tier names must be non-empty, without surrounding spaces".into(),
                    });
                }
            }
            for (name, target) in &t.slo {
                let p = format!("{path}.tier.slo.{name}");
                if !t.values.contains_key(name) {
                    errs.push(ConfigError {
                        path: p.clone(),
                        reason: format!("{name:?} is not a tier of values"),
                    });
                }
                target.validate(&p, errs);
            }
        }
        self.slo.validate(&format!("{path}.slo"), errs, &valid_header_name);
        let taken = [OBJECTIVE_HEADER, FAIRNESS_HEADER]
            .into_iter()
            .chain(self.tier.as_ref().map(|t| t.header.as_str()));
        for h in taken {
            for (key, s) in [("ttft_header", &self.slo.ttft_header), ("tpot_header", &self.slo.tpot_header)] {
                if s == h {
                    errs.push(ConfigError {
                        path: format!("{path}.slo.{key}"),
                        reason: format!("{h:?} is already a priority header"),
                    });
                }
            }
        }
    }

    /// The tightest TTFT target any objective or tier names (ms), for the scheduler's headroom
    /// rule; `None` when none does.
    pub fn tightest_ttft_ms(&self) -> Option<u32> {
        let objectives = self.objectives.iter().filter_map(|o| o.ttft_ms);
        let tiers = self.tier.iter().flat_map(|t| t.slo.values().map(|x| x.ttft_ms));
        objectives.chain(tiers).min()
    }

    fn objective_priority(&self, name: &str) -> Option<i32> {
        self.objectives.iter().find(|o| o.name == name).map(|o| o.priority)
    }
}

/// Which source set the priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrioritySource {
    Objective,
    Tier,
    Model,
}

/// The priority of one request and what it was derived from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PriorityDecision {
    pub priority: i32,
    pub source: PrioritySource,
    /// The objective named by a trusted header, when it is in the config (even if it did not win).
    pub objective: Option<String>,
    /// The tier named by a trusted header, when it is in the config (even if it did not win).
    pub tier: Option<String>,
    /// The fairness flow (tenant) within the priority level.
    pub fairness_id: String,
    /// The latency targets (`crate::flow::slo`): none unless configured or sent in a trusted
    /// header.
    pub targets: Targets,
}

impl PriorityDecision {
    /// Below 0: rejected at once while saturated.
    pub fn sheddable(&self) -> bool {
        self.priority < 0
    }
}

/// The values of the trusted priority headers of one request, read before the headers are
/// stripped (request-headers time) and resolved once the model is known (body time).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PriorityHeaders {
    pub objective: Option<String>,
    pub tier: Option<String>,
    pub fairness_id: Option<String>,
    /// `fairness_id` is the session id ([`PriorityHeaders::with_session`]), not a tenant's.
    pub fairness_from_session: bool,
    /// The trusted latency-target headers, raw (`crate::flow::slo::TargetHeaders`).
    pub slo: TargetHeaders,
}

fn non_empty_trimmed(v: Option<String>) -> Option<String> {
    let v = v?;
    let t = v.trim();
    if t.is_empty() {
        None
    } else if t.len() == v.len() {
        Some(v)
    } else {
        Some(t.to_string())
    }
}

/// Cuts `s` to at most `max` bytes without splitting a character.
fn truncate_at_char(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while end > 0 && !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

impl PriorityHeaders {
    /// Reads the trusted headers through `get` (lower-case name → value). Untrusted headers are
    /// never asked for.
    pub fn read(cfg: &PriorityConfig, get: &dyn Fn(&str) -> Option<String>) -> Self {
        let objective =
            if cfg.trust_objective_header { non_empty_trimmed(get(OBJECTIVE_HEADER)) } else { None };
        let tier = match &cfg.tier {
            Some(t) if t.trusted => non_empty_trimmed(get(&t.header)),
            _ => None,
        };
        let fairness_id = if cfg.trust_fairness_header {
            non_empty_trimmed(get(FAIRNESS_HEADER)).map(|f| truncate_at_char(f, MAX_FAIRNESS_ID_BYTES))
        } else {
            None
        };
        let slo = TargetHeaders::read(&cfg.slo, get);
        Self { objective, tier, fairness_id, fairness_from_session: false, slo }
    }

    /// With `priority.trust_session_headers`, the request's session id (already checked by
    /// `request::session`) is the fairness id when no trusted fairness header gave one; cut to
    /// [`MAX_FAIRNESS_ID_BYTES`] like the header's value. Otherwise nothing changes.
    pub fn with_session(mut self, cfg: &PriorityConfig, session_id: Option<&str>) -> Self {
        if cfg.trust_session_headers && self.fairness_id.is_none() {
            self.fairness_id = session_id
                .and_then(|s| non_empty_trimmed(Some(s.to_string())))
                .map(|s| truncate_at_char(s, MAX_FAIRNESS_ID_BYTES));
            self.fairness_from_session = self.fairness_id.is_some();
        }
        self
    }

    /// The tenant a trusted `x-gateway-inference-fairness-id` names, if one does (a fairness id
    /// taken from the session id is no tenant: there is one per conversation).
    pub fn tenant(&self) -> Option<&str> {
        self.fairness_id.as_deref().filter(|_| !self.fairness_from_session)
    }

    /// Applies the precedence objective > tier > model criticality.
    pub fn resolve(&self, cfg: &PriorityConfig, model: Criticality) -> PriorityDecision {
        let objective = self
            .objective
            .as_deref()
            .and_then(|name| cfg.objective_priority(name).map(|p| (name.to_string(), p)));
        let tier = match (&cfg.tier, self.tier.as_deref()) {
            (Some(t), Some(v)) => t.values.get(v).map(|p| (v.to_string(), *p)),
            _ => None,
        };
        let (priority, source) = match (&objective, &tier) {
            (Some((_, p)), _) => (*p, PrioritySource::Objective),
            (None, Some((_, p))) => (*p, PrioritySource::Tier),
            (None, None) => (cfg.criticality.of(model), PrioritySource::Model),
        };
        let objective_targets = objective
            .as_ref()
            .and_then(|(n, _)| cfg.objectives.iter().find(|o| &o.name == n))
            .map_or((None, None), |o| (o.ttft_ms, o.tpot_ms));
        let tier_target = match (&cfg.tier, &tier) {
            (Some(t), Some((n, _))) => t.slo.get(n).copied(),
            _ => None,
        };
        PriorityDecision {
            priority,
            source,
            objective: objective.map(|(n, _)| n),
            tier: tier.map(|(n, _)| n),
            fairness_id: self.fairness_id.clone().unwrap_or_else(|| DEFAULT_FAIRNESS_ID.to_string()),
            targets: slo::resolve(&self.slo, &cfg.slo, objective_targets, tier_target),
        }
    }
}

/// Reads the trusted headers and resolves the priority in one step (when the model is already
/// known while the headers are still readable).
pub fn resolve_priority(
    cfg: &PriorityConfig,
    model: Criticality,
    get: &dyn Fn(&str) -> Option<String>,
) -> PriorityDecision {
    PriorityHeaders::read(cfg, get).resolve(cfg, model)
}

/// Every request header the filter must remove before the request goes upstream, trusted or not.
pub fn headers_to_strip(cfg: &PriorityConfig) -> impl Iterator<Item = &str> {
    [OBJECTIVE_HEADER, FAIRNESS_HEADER, cfg.slo.ttft_header.as_str(), cfg.slo.tpot_header.as_str()]
        .into_iter()
        .chain(cfg.tier.as_ref().map(|t| t.header.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// A header map that records which names were asked for.
    struct Headers {
        pairs: Vec<(&'static str, &'static str)>,
        asked: RefCell<Vec<String>>,
    }
    impl Headers {
        fn new(pairs: &[(&'static str, &'static str)]) -> Self {
            Self { pairs: pairs.to_vec(), asked: RefCell::new(Vec::new()) }
        }
        fn get(&self, name: &str) -> Option<String> {
            self.asked.borrow_mut().push(name.to_string());
            self.pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string())
        }
    }

    fn tiers(trusted: bool) -> TierConfig {
        TierConfig {
            header: "x-llm-tier".into(),
            trusted,
            values: [("premium".to_string(), 10), ("standard".to_string(), 0), ("free".to_string(), -5)]
                .into_iter()
                .collect(),
            slo: BTreeMap::new(),
        }
    }

    fn all_trusted() -> PriorityConfig {
        PriorityConfig {
            objectives: vec![
                ObjectiveConfig { name: "interactive".into(), priority: 20, ttft_ms: None, tpot_ms: None },
                ObjectiveConfig { name: "batch".into(), priority: -1, ttft_ms: None, tpot_ms: None },
                ObjectiveConfig { name: "unset".into(), priority: 0, ttft_ms: None, tpot_ms: None },
            ],
            trust_objective_header: true,
            tier: Some(tiers(true)),
            trust_fairness_header: true,
            ..PriorityConfig::default()
        }
    }

    fn resolve(cfg: &PriorityConfig, crit: Criticality, h: &Headers) -> PriorityDecision {
        resolve_priority(cfg, crit, &|n| h.get(n))
    }

    #[test]
    fn defaults_parse_from_empty_object() {
        let cfg: PriorityConfig = crate::config::read_json("{}").unwrap();
        assert_eq!(cfg, PriorityConfig::default());
        assert_eq!(cfg.criticality.of(Criticality::Critical), 10);
        assert_eq!(cfg.criticality.of(Criticality::Standard), 0);
        assert_eq!(cfg.criticality.of(Criticality::Sheddable), -10);
        // An objective without priority is 0, as InferenceObjective says.
        let o: ObjectiveConfig = crate::config::read_json(r#"{"name":"x"}"#).unwrap();
        assert_eq!(o.priority, 0);
        // A typo is an error, not a silently ignored field.
        assert!(crate::config::read_json::<PriorityConfig>(r#"{"trust_objective_headers":true}"#).is_err());
    }

    #[test]
    fn model_criticality_when_no_header() {
        let cfg = all_trusted();
        let h = Headers::new(&[]);
        let d = resolve(&cfg, Criticality::Critical, &h);
        assert_eq!((d.priority, d.source), (10, PrioritySource::Model));
        assert_eq!(d.fairness_id, "default-flow");
        let d = resolve(&cfg, Criticality::Sheddable, &h);
        assert_eq!(d.priority, -10);
        assert!(d.sheddable());
    }

    #[test]
    fn precedence_objective_then_tier_then_model() {
        let cfg = all_trusted();
        // All three present: objective "batch" (-1) beats tier premium (10) and Critical (10).
        let h = Headers::new(&[(OBJECTIVE_HEADER, "batch"), ("x-llm-tier", "premium")]);
        let d = resolve(&cfg, Criticality::Critical, &h);
        assert_eq!((d.priority, d.source), (-1, PrioritySource::Objective));
        // The losing tier is still recorded for logs.
        assert_eq!(d.objective.as_deref(), Some("batch"));
        assert_eq!(d.tier.as_deref(), Some("premium"));

        // Tier beats the model: free (-5) on a Critical model.
        let h = Headers::new(&[("x-llm-tier", "free")]);
        let d = resolve(&cfg, Criticality::Critical, &h);
        assert_eq!((d.priority, d.source), (-5, PrioritySource::Tier));

        // An objective set to 0 explicitly still wins over tier premium (it is a value, not absence).
        let h = Headers::new(&[(OBJECTIVE_HEADER, "unset"), ("x-llm-tier", "premium")]);
        let d = resolve(&cfg, Criticality::Standard, &h);
        assert_eq!((d.priority, d.source), (0, PrioritySource::Objective));
    }

    #[test]
    fn unknown_values_fall_through_to_next_source() {
        let cfg = all_trusted();
        // Unknown objective → the tier decides (premium 10), not the Sheddable model (-10).
        let h = Headers::new(&[(OBJECTIVE_HEADER, "nope"), ("x-llm-tier", "premium")]);
        let d = resolve(&cfg, Criticality::Sheddable, &h);
        assert_eq!((d.priority, d.source), (10, PrioritySource::Tier));
        assert_eq!(d.objective, None);
        // Unknown tier, and tier matching is case-sensitive → model Sheddable (-10).
        let h = Headers::new(&[(OBJECTIVE_HEADER, ""), ("x-llm-tier", "Premium")]);
        let d = resolve(&cfg, Criticality::Sheddable, &h);
        assert_eq!((d.priority, d.source), (-10, PrioritySource::Model));
        assert_eq!(d.tier, None);
        // Surrounding spaces are trimmed.
        let h = Headers::new(&[(OBJECTIVE_HEADER, "  interactive ")]);
        assert_eq!(resolve(&cfg, Criticality::Standard, &h).priority, 20);
    }

    #[test]
    fn untrusted_headers_are_never_read_and_cannot_raise_priority() {
        // The default config trusts nothing, even with objectives and a tier configured.
        let cfg = PriorityConfig {
            objectives: vec![ObjectiveConfig {
                name: "interactive".into(),
                priority: 20,
                ttft_ms: None,
                tpot_ms: None,
            }],
            tier: Some(tiers(false)),
            ..PriorityConfig::default()
        };
        let h = Headers::new(&[
            (OBJECTIVE_HEADER, "interactive"),
            ("x-llm-tier", "premium"),
            (FAIRNESS_HEADER, "tenant-a"),
        ]);
        let d = resolve(&cfg, Criticality::Sheddable, &h);
        // A client claiming "interactive" and "premium" stays at its model's -10.
        assert_eq!((d.priority, d.source), (-10, PrioritySource::Model));
        assert_eq!(d.fairness_id, "default-flow");
        assert!(h.asked.borrow().is_empty(), "asked for {:?}", h.asked.borrow());
        // But every one of them is stripped.
        let strip: Vec<&str> = headers_to_strip(&cfg).collect();
        assert_eq!(
            strip,
            vec![OBJECTIVE_HEADER, FAIRNESS_HEADER, slo::TTFT_HEADER, slo::TPOT_HEADER, "x-llm-tier"]
        );
    }

    #[test]
    fn trust_is_per_header() {
        // Tier trusted, objective not: the objective header is ignored, the tier is honoured.
        let cfg = PriorityConfig {
            objectives: vec![ObjectiveConfig {
                name: "interactive".into(),
                priority: 20,
                ttft_ms: None,
                tpot_ms: None,
            }],
            tier: Some(tiers(true)),
            ..PriorityConfig::default()
        };
        let h = Headers::new(&[(OBJECTIVE_HEADER, "interactive"), ("x-llm-tier", "free")]);
        let d = resolve(&cfg, Criticality::Standard, &h);
        assert_eq!((d.priority, d.source), (-5, PrioritySource::Tier));
        assert_eq!(*h.asked.borrow(), vec!["x-llm-tier".to_string()]);
    }

    #[test]
    fn fairness_id_trusted_trimmed_and_bounded() {
        let cfg = all_trusted();
        let h = Headers::new(&[(FAIRNESS_HEADER, " tenant-a ")]);
        assert_eq!(resolve(&cfg, Criticality::Standard, &h).fairness_id, "tenant-a");
        let h = Headers::new(&[(FAIRNESS_HEADER, "   ")]);
        assert_eq!(resolve(&cfg, Criticality::Standard, &h).fairness_id, "default-flow");
        // 127 ASCII bytes then a 2-byte 'é' (bytes 127..129): the cut at 128 would split it, so
        // the id ends after the 127 ASCII bytes.
        let long: &'static str =
            Box::leak(format!("{}é{}", "a".repeat(127), "b".repeat(50)).into_boxed_str());
        let h = Headers::new(&[(FAIRNESS_HEADER, long)]);
        let f = resolve(&cfg, Criticality::Standard, &h).fairness_id;
        assert_eq!(f, "a".repeat(127));
    }

    #[test]
    fn session_id_names_the_flow_only_when_trusted_and_no_fairness_header_did() {
        let fair = |cfg: &PriorityConfig, pairs: &[(&'static str, &'static str)], session: Option<&str>| {
            let h = Headers::new(pairs);
            PriorityHeaders::read(cfg, &|n| h.get(n))
                .with_session(cfg, session)
                .resolve(cfg, Criticality::Standard)
                .fairness_id
        };
        // Not trusted (the default): the session id never becomes a fairness id.
        let off = PriorityConfig::default();
        assert_eq!(fair(&off, &[], Some("sess-1")), "default-flow");
        let on = PriorityConfig { trust_session_headers: true, ..PriorityConfig::default() };
        assert_eq!(fair(&on, &[], Some("sess-1")), "sess-1");
        assert_eq!(fair(&on, &[], None), "default-flow");
        // An untrusted fairness header is not read, so the session still names the flow.
        assert_eq!(fair(&on, &[(FAIRNESS_HEADER, "tenant-a")], Some("sess-1")), "sess-1");
        // A trusted fairness header wins over the session.
        let both = PriorityConfig { trust_fairness_header: true, ..on.clone() };
        assert_eq!(fair(&both, &[(FAIRNESS_HEADER, "tenant-a")], Some("sess-1")), "tenant-a");
        assert_eq!(fair(&both, &[(FAIRNESS_HEADER, " ")], Some("sess-1")), "sess-1");
        // Only a fairness id from the trusted header names a tenant.
        let h = Headers::new(&[(FAIRNESS_HEADER, "tenant-a")]);
        let read =
            |cfg: &PriorityConfig| PriorityHeaders::read(cfg, &|n| h.get(n)).with_session(cfg, Some("s"));
        assert_eq!(read(&both).tenant(), Some("tenant-a"));
        assert_eq!((read(&on).tenant(), read(&on).fairness_id.as_deref()), (None, Some("s")));
        assert_eq!(read(&off).tenant(), None);
        // Bounded like the header: 256-byte session ids are cut to 128 bytes.
        let long = "s".repeat(256);
        assert_eq!(fair(&on, &[], Some(&long)), "s".repeat(MAX_FAIRNESS_ID_BYTES));
    }

    #[test]
    fn headers_to_strip_without_tier() {
        let cfg = PriorityConfig::default();
        let strip: Vec<&str> = headers_to_strip(&cfg).collect();
        assert_eq!(strip, vec![OBJECTIVE_HEADER, FAIRNESS_HEADER, slo::TTFT_HEADER, slo::TPOT_HEADER]);
    }

    #[test]
    fn worked_example_config() {
        let cfg = crate::config::Config::from_json(include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/filter-config/examples/priority-tiers.json"
        )))
        .unwrap();
        let crit = |model: &str| cfg.models.iter().find(|m| m.name == model).unwrap().criticality;
        let chat = crit("llama-3.1-8b-instruct");
        let batch = crit("qwen2.5-7b-batch");
        assert_eq!((chat, batch), (Criticality::Critical, Criticality::Sheddable));
        let p = &cfg.priority;
        let case = |model: Criticality, pairs: &[(&'static str, &'static str)]| {
            let h = Headers::new(pairs);
            resolve(p, model, &h)
        };
        // No header: the model decides (Critical 10, Sheddable -10).
        assert_eq!(case(chat, &[]).priority, 10);
        assert_eq!(case(batch, &[]).priority, -10);
        // A free-tier caller on the critical model: -5, sheddable.
        assert!(case(chat, &[("x-llm-tier", "free")]).sheddable());
        // A premium caller on the batch model: 15.
        assert_eq!(case(batch, &[("x-llm-tier", "premium")]).priority, 15);
        // The objective beats the tier: interactive-chat (20) for a free caller.
        let d = case(chat, &[(OBJECTIVE_HEADER, "interactive-chat"), ("x-llm-tier", "free")]);
        assert_eq!((d.priority, d.source), (20, PrioritySource::Objective));
        // An objective without a priority is 0, and still beats the tier.
        assert_eq!(
            case(chat, &[(OBJECTIVE_HEADER, "default-objective"), ("x-llm-tier", "free")]).priority,
            0
        );
        assert_eq!(case(chat, &[(FAIRNESS_HEADER, "team-a")]).fairness_id, "team-a");
        assert_eq!(cfg.saturation.max_inflight_per_endpoint, 261);
        assert_eq!((cfg.flow_control.max_queue, cfg.flow_control.retry_after_s), (512, 2));
    }

    #[test]
    fn config_without_new_sections_gets_defaults() {
        const BASE: &str = r#""version":1,"endpoints":[{"address":"10.0.0.1:8000","models":["m"]}]"#;
        let doc = |rest: &str| format!("{{{BASE},{rest}}}");
        let cfg = crate::config::Config::from_json(doc(r#""models":[{"name":"m"}]"#).as_bytes()).unwrap();
        assert_eq!(cfg.models[0].criticality, Criticality::Standard);
        assert_eq!(cfg.priority, PriorityConfig::default());
        // A misspelt criticality is refused, not read as Standard.
        let bad = doc(r#""models":[{"name":"m","criticality":"critical"}]"#);
        assert!(crate::config::Config::from_json(bad.as_bytes()).is_err());
        // Validation of the new sections runs inside Config::validate, with their paths.
        // poller.interval_ms defaults to 200.
        let bad = doc(
            r#""models":[{"name":"m"}],"saturation":{"stale_after_ms":100},"flow_control":{"max_queue":0}"#,
        );
        let errs = crate::config::Config::from_json(bad.as_bytes()).unwrap_err();
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, vec!["saturation.stale_after_ms", "flow_control.max_queue"]);
    }

    #[test]
    fn validation_reports_paths() {
        let mut cfg = all_trusted();
        cfg.objectives.push(ObjectiveConfig {
            name: "batch".into(),
            priority: 3,
            ttft_ms: None,
            tpot_ms: None,
        });
        cfg.objectives.push(ObjectiveConfig { name: " ".into(), priority: 3, ttft_ms: None, tpot_ms: None });
        cfg.tier = Some(TierConfig {
            header: "X-Tier".into(),
            trusted: true,
            values: BTreeMap::new(),
            slo: BTreeMap::new(),
        });
        let mut errs = Vec::new();
        cfg.validate("priority", &mut errs);
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            vec![
                "priority.objectives[3].name",
                "priority.objectives[4].name",
                "priority.tier.header",
                "priority.tier.values"
            ]
        );

        let mut cfg = all_trusted();
        if let Some(t) = cfg.tier.as_mut() {
            t.header = FAIRNESS_HEADER.into();
        }
        let mut errs = Vec::new();
        cfg.validate("priority", &mut errs);
        assert_eq!(errs.len(), 1);
        assert_eq!(errs[0].path, "priority.tier.header");

        let mut errs = Vec::new();
        all_trusted().validate("priority", &mut errs);
        assert!(errs.is_empty(), "{errs:?}");
    }
}
