//! Models learned from the pods (`pod_models` in the configuration): which base models and LoRA
//! adapters each pod really serves, from what the pod itself reports.
//!
//! Sources, per pod:
//! - its OpenAI model list (`GET pod_models.path`, default `/v1/models`), fetched at once when
//!   the pod is first seen (static list or discovery), then every `pod_models.refresh_ms`
//!   (default 10 s); a pod never learned is retried every [`RETRY_UNLEARNED_MS`]. An entry
//!   whose `parent` names another model is an adapter (vLLM lists a LoRA adapter with
//!   `parent` = its base model), any other entry a base model;
//! - its LoRA metrics, already in the scrape (`vllm:lora_requests_info`
//!   running/waiting adapters): an adapter that runs or waits there is loaded on that pod, even
//!   before the next model-list fetch sees it.
//!
//! Merge ([`ModelsLearner::apply`], at every snapshot publish): a pod whose model list has been
//! read at least once serves exactly what it reported (its base models and adapters), plus the
//! adapters its LoRA metrics name; the configuration's assumption for that pod
//! (`endpoints[].models`, or `discovery.kubernetes.models`) no longer applies. A pod never read
//! keeps the assumed models (plus its metrics' adapters). A failed or unreadable fetch keeps the
//! last good list: a pod does not lose its models for one bad answer.
//!
//! The names go into `EndpointStatus::models`, the list the scheduler's filter reads, so a
//! learned adapter is served by the pods that report it (not by every pod of its base, as a
//! configured adapter is). Resolution and the allow-list (`pod_models.allow_list`) are in
//! `scheduler::models`.
//!
//! Bounds: a response over [`MAX_RESPONSE_BYTES`] is not read; at most [`MAX_MODELS_PER_POD`]
//! names per pod are kept; names longer than [`MAX_NAME_BYTES`] or with control characters
//! are skipped. Nothing here panics on any pod answer.

use hashbrown::{HashMap, HashSet};
use serde::Deserialize;

use crate::base::json::ConfigError;
use crate::base::settings::settings;
use crate::poll::poller::LOST_CALL_GRACE_MS;
use crate::state::snapshot::Snapshot;
#[cfg(test)]
use crate::state::snapshot::{is_running_adapter, learned_names};

/// Largest model-list response read (1 MiB). A larger one counts as a failed fetch.
pub const MAX_RESPONSE_BYTES: usize = 1024 * 1024;
/// Most model names kept per pod (base models and adapters together).
pub const MAX_MODELS_PER_POD: usize = 256;
/// Longest model name kept, in bytes.
pub const MAX_NAME_BYTES: usize = 256;
/// Smallest `pod_models.refresh_ms`.
pub const MIN_REFRESH_MS: u64 = 1000;
/// A pod whose model list was never read is asked again this often (ms), whatever
/// `refresh_ms`: a pod that was not ready at its first fetch is learned soon after.
pub const RETRY_UNLEARNED_MS: u64 = 1000;

settings! {
    /// `pod_models`: learn the models each pod serves from the pod.
    #[derive(Debug, Clone, PartialEq)]
    pub struct PodModelsConfig {
        /// How often each pod's model list is fetched again, in ms. At least 1000. Default 10000.
        /// A new pod is asked at once.
        #[range(min = MIN_REFRESH_MS)]
        #[reason = "{v} is below the minimum of {min} ms"]
        pub refresh_ms: u64 = 10_000,
        /// Timeout of one fetch, in ms: 1 to `refresh_ms`. Default 2000.
        #[schema(range(min = 1))]
        pub timeout_ms: u64 = 2000,
        /// Path of the model list on every pod; starts with `/`. Default `/v1/models`. Fetched through
        /// `poller.cluster`, like `/metrics`.
        #[schema(regex(pattern = r"^/\S*$"))]
        pub path: String = String::from("/v1/models"),
        /// Route only the model names the configuration mentions (`models[].name`, their
        /// `adapters`, `endpoints[].models`, `discovery.kubernetes.models`); the pods' lists then
        /// only say which pods serve them. Default false: any name some pod reports is routed to
        /// the pods that report it.
        pub allow_list: bool = false,
    }
}

impl PodModelsConfig {
    pub fn validate(&self, at: &str, errs: &mut Vec<ConfigError>) {
        self.validate_ranges(at, errs);
        if self.timeout_ms == 0 || self.timeout_ms > self.refresh_ms {
            errs.push(ConfigError::new(
                format!("{at}.timeout_ms"),
                format!("{} must be between 1 and refresh_ms ({})", self.timeout_ms, self.refresh_ms),
            ));
        }
        if !self.path.starts_with('/') || self.path.chars().any(|c| c.is_whitespace() || c.is_control()) {
            errs.push(ConfigError::new(
                format!("{at}.path"),
                format!("{:?} must start with / and contain no spaces", self.path),
            ));
        }
    }
}

/// What one pod reported.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodModels {
    /// Base models, in the pod's order.
    pub bases: Vec<String>,
    /// LoRA adapters (entries whose `parent` is another model), in the pod's order.
    pub adapters: Vec<String>,
}

/// Why a model-list fetch is not usable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelsError {
    /// The call failed (reset, connect failure, timeout).
    Transport,
    /// Not HTTP 200.
    Status(u32),
    /// Over [`MAX_RESPONSE_BYTES`] (the size; not read).
    TooLarge(usize),
    /// Not an OpenAI model list.
    Parse(String),
}

impl ModelsError {
    /// A fixed code for logs and metric tags.
    pub fn reason(&self) -> &'static str {
        match self {
            ModelsError::Transport => "transport",
            ModelsError::Status(_) => "status",
            ModelsError::TooLarge(_) => "too_large",
            ModelsError::Parse(_) => "parse",
        }
    }
}

impl std::fmt::Display for ModelsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelsError::Transport => write!(f, "call failed (reset, connect failure or timeout)"),
            ModelsError::Status(s) => write!(f, "answered HTTP {s}"),
            ModelsError::TooLarge(n) => {
                write!(f, "response of {n} bytes is over {MAX_RESPONSE_BYTES}; not read")
            }
            ModelsError::Parse(e) => write!(f, "not an OpenAI model list: {e}"),
        }
    }
}

#[derive(Deserialize)]
struct ListDoc {
    data: Vec<EntryDoc>,
}

#[derive(Deserialize)]
struct EntryDoc {
    id: String,
    #[serde(default)]
    parent: Option<String>,
}

fn usable_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_NAME_BYTES && !s.chars().any(char::is_control)
}

/// Parses an OpenAI `GET /v1/models` answer (`{"data":[{"id":…,"parent":…},…]}`; other fields
/// ignored). Unusable names are skipped, duplicates dropped, at most [`MAX_MODELS_PER_POD`]
/// names kept.
pub fn parse_models(status: u32, body: &[u8]) -> Result<PodModels, ModelsError> {
    if status != 200 {
        return Err(ModelsError::Status(status));
    }
    if body.len() > MAX_RESPONSE_BYTES {
        return Err(ModelsError::TooLarge(body.len()));
    }
    let doc: ListDoc = serde_json::from_slice(body).map_err(|e| ModelsError::Parse(e.to_string()))?;
    let mut out = PodModels::default();
    let mut seen = HashSet::new();
    for e in doc.data {
        if seen.len() >= MAX_MODELS_PER_POD {
            break;
        }
        if !usable_name(&e.id) || !seen.insert(e.id.clone()) {
            continue;
        }
        match e.parent {
            Some(p) if !p.is_empty() && p != e.id => out.adapters.push(e.id),
            _ => out.bases.push(e.id),
        }
    }
    Ok(out)
}

#[derive(Debug, Clone, Default)]
struct PodState {
    /// When the last fetch started.
    last_start: Option<u64>,
    /// When the outstanding fetch started, if one is outstanding.
    outstanding_since: Option<u64>,
    /// The last list read successfully.
    learned: Option<PodModels>,
}

/// Per-pod model lists and when to fetch them. Owned by the poller; pure.
#[derive(Debug, Clone)]
pub struct ModelsLearner {
    refresh_ms: u64,
    timeout_ms: u64,
    pods: HashMap<String, PodState>,
}

impl ModelsLearner {
    /// `None` when `pod_models` is not configured.
    pub fn from_config(cfg: Option<&PodModelsConfig>) -> Option<Self> {
        cfg.map(|p| ModelsLearner {
            refresh_ms: p.refresh_ms,
            timeout_ms: p.timeout_ms,
            pods: HashMap::new(),
        })
    }

    /// The pods whose model list should be fetched now, marked outstanding. `addresses` is the
    /// current endpoint set: pods that left are forgotten, new ones are due at once. A fetch with
    /// no answer after `timeout_ms` + the poller's grace is written off.
    pub fn due<'a>(&mut self, now_ms: u64, addresses: impl Iterator<Item = &'a str>) -> Vec<String> {
        let current: HashSet<&str> = addresses.collect();
        self.pods.retain(|a, _| current.contains(a.as_str()));
        let mut out = Vec::new();
        for a in current {
            let st = self.pods.entry_ref(a).or_default();
            if let Some(since) = st.outstanding_since {
                if now_ms.saturating_sub(since) <= self.timeout_ms.saturating_add(LOST_CALL_GRACE_MS) {
                    continue;
                }
                st.outstanding_since = None;
            }
            let every =
                if st.learned.is_some() { self.refresh_ms } else { RETRY_UNLEARNED_MS.min(self.refresh_ms) };
            let is_due = st.last_start.is_none_or(|last| now_ms >= last.saturating_add(every));
            if is_due {
                st.last_start = Some(now_ms);
                st.outstanding_since = Some(now_ms);
                out.push(a.to_string());
            }
        }
        crate::base::sorting::sort(&mut out);
        out
    }

    /// Records a fetch's outcome: `Ok` with the list, or the error (the last good list stays).
    /// Returns whether the pod's list changed.
    pub fn on_result(
        &mut self,
        address: &str,
        result: Result<PodModels, ModelsError>,
    ) -> Result<bool, ModelsError> {
        let Some(st) = self.pods.get_mut(address) else {
            // The pod left while the fetch was out.
            return Ok(false);
        };
        st.outstanding_since = None;
        let models = result?;
        let changed = st.learned.as_ref() != Some(&models);
        st.learned = Some(models);
        Ok(changed)
    }

    /// Forgets outstanding fetches (a lease holder that lost its lease).
    pub fn abandon_outstanding(&mut self) {
        for st in self.pods.values_mut() {
            st.outstanding_since = None;
        }
    }

    /// What `address` reported last, if its list was ever read.
    pub fn learned(&self, address: &str) -> Option<&PodModels> {
        self.pods.get(address).and_then(|s| s.learned.as_ref())
    }

    /// Rewrites each endpoint's `models` from what its pod reported (see the module doc).
    pub fn apply(&self, snapshot: &mut Snapshot) {
        for ep in &mut snapshot.endpoints {
            let mut names: Vec<String> = match self.learned(&ep.address) {
                Some(l) => l.bases.iter().chain(&l.adapters).cloned().collect(),
                None => std::mem::take(&mut ep.models),
            };
            if let Some(m) = &ep.metrics {
                for a in m.running_adapters.iter().chain(&m.waiting_adapters) {
                    if usable_name(a) && !names.iter().any(|n| n == a) {
                        names.push(a.clone());
                    }
                }
            }
            names.truncate(MAX_MODELS_PER_POD.saturating_mul(2));
            ep.models = names;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::metrics::EndpointMetrics;
    use crate::state::snapshot::EndpointStatus;

    /// A vLLM answer with one base and one adapter (fields as vLLM 0.6+ sends them).
    const VLLM: &[u8] = br#"{"object":"list","data":[
        {"id":"meta-llama/Llama-3.1-8B-Instruct","object":"model","created":1,"owned_by":"vllm",
         "root":"meta-llama/Llama-3.1-8B-Instruct","parent":null,"max_model_len":8192,"permission":[]},
        {"id":"sql-lora","object":"model","created":1,"owned_by":"vllm","root":"/adapters/sql",
         "parent":"meta-llama/Llama-3.1-8B-Instruct","max_model_len":null,"permission":[]}]}"#;

    fn learner(refresh: u64) -> ModelsLearner {
        ModelsLearner { refresh_ms: refresh, timeout_ms: 500, pods: HashMap::new() }
    }

    #[test]
    fn parses_bases_and_adapters_and_rejects_what_is_not_a_list() {
        let m = parse_models(200, VLLM).unwrap();
        assert_eq!(m.bases, ["meta-llama/Llama-3.1-8B-Instruct"]);
        assert_eq!(m.adapters, ["sql-lora"]);
        // SGLang and others send no parent: every entry is a base; parent == id is a base too.
        let m = parse_models(200, br#"{"data":[{"id":"a"},{"id":"b","parent":"b"},{"id":"a"}]}"#).unwrap();
        assert_eq!((m.bases.as_slice(), m.adapters.len()), (&["a".to_string(), "b".to_string()][..], 0));
        assert_eq!(parse_models(503, VLLM), Err(ModelsError::Status(503)));
        assert!(matches!(parse_models(200, b"{\"data\":3}"), Err(ModelsError::Parse(_))));
        assert!(matches!(parse_models(200, b"<html>"), Err(ModelsError::Parse(_))));
        assert!(matches!(parse_models(200, b""), Err(ModelsError::Parse(_))));
        let big = vec![b' '; MAX_RESPONSE_BYTES + 1];
        assert_eq!(parse_models(200, &big), Err(ModelsError::TooLarge(MAX_RESPONSE_BYTES + 1)));
    }

    #[test]
    fn names_are_bounded_in_length_count_and_content() {
        let long = "x".repeat(MAX_NAME_BYTES + 1);
        let body = format!(r#"{{"data":[{{"id":""}},{{"id":"{long}"}},{{"id":"a\nb"}},{{"id":"ok"}}]}}"#);
        assert_eq!(parse_models(200, body.as_bytes()).unwrap().bases, ["ok"]);
        let many: Vec<String> = (0..MAX_MODELS_PER_POD + 50).map(|i| format!(r#"{{"id":"m{i}"}}"#)).collect();
        let body = format!(r#"{{"data":[{}]}}"#, many.join(","));
        assert_eq!(parse_models(200, body.as_bytes()).unwrap().bases.len(), MAX_MODELS_PER_POD);
    }

    #[test]
    fn new_pods_are_due_at_once_then_at_the_refresh_rate() {
        let mut l = learner(10_000);
        assert_eq!(l.due(0, ["a:1", "b:1"].into_iter()), ["a:1", "b:1"]);
        // Outstanding: not asked again.
        assert!(l.due(100, ["a:1", "b:1"].into_iter()).is_empty());
        l.on_result("a:1", parse_models(200, VLLM)).unwrap();
        // b failed and was never learned: retried after RETRY_UNLEARNED_MS, a only after refresh.
        assert_eq!(l.on_result("b:1", Err(ModelsError::Transport)), Err(ModelsError::Transport));
        assert!(l.due(999, ["a:1", "b:1"].into_iter()).is_empty());
        assert_eq!(l.due(1000, ["a:1", "b:1"].into_iter()), ["b:1"]);
        assert!(l.due(9_999, ["a:1"].into_iter()).is_empty());
        assert_eq!(l.due(10_000, ["a:1", "c:1"].into_iter()), ["a:1", "c:1"]);
        // b left: its late answer changes nothing.
        assert_eq!(l.on_result("b:1", parse_models(200, VLLM)), Ok(false));
        assert!(l.learned("b:1").is_none());
    }

    #[test]
    fn a_lost_fetch_is_written_off_after_timeout_and_grace() {
        let mut l = learner(1000);
        assert_eq!(l.due(0, ["a:1"].into_iter()).len(), 1);
        assert!(l.due(500 + LOST_CALL_GRACE_MS, ["a:1"].into_iter()).is_empty());
        assert_eq!(l.due(501 + LOST_CALL_GRACE_MS, ["a:1"].into_iter()), ["a:1"]);
    }

    fn ep(addr: &str, models: &[&str], running: &[&str]) -> EndpointStatus {
        EndpointStatus {
            address: addr.into(),
            models: models.iter().map(|s| s.to_string()).collect(),
            metrics: Some(EndpointMetrics {
                running_adapters: running.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn apply_replaces_the_assumption_with_the_report_and_adds_metric_adapters() {
        let mut l = learner(10_000);
        l.due(0, ["a:1", "b:1"].into_iter());
        l.on_result("a:1", parse_models(200, VLLM)).unwrap();
        // A failed later fetch keeps the last good list.
        let _ = l.on_result("a:1", Err(ModelsError::Status(500)));
        let mut snap = Snapshot {
            endpoints: vec![ep("a:1", &["assumed"], &["live-lora"]), ep("b:1", &["assumed"], &["x-lora"])],
            ..Default::default()
        };
        l.apply(&mut snap);
        let models = |i: usize| snap.endpoints[i].models.clone();
        assert_eq!(models(0), ["meta-llama/Llama-3.1-8B-Instruct", "sql-lora", "live-lora"]);
        // b was never read: it keeps the assumed model, plus the adapter its metrics name.
        assert_eq!(models(1), ["assumed", "x-lora"]);
        assert!(is_running_adapter(&snap, "x-lora") && !is_running_adapter(&snap, "sql-lora"));
        // An unchanged list reports no change; a new one does.
        assert_eq!(l.on_result("a:1", parse_models(200, VLLM)), Ok(false));
        assert_eq!(l.on_result("a:1", parse_models(200, br#"{"data":[{"id":"q"}]}"#)), Ok(true));
    }

    #[test]
    fn learned_names_follow_the_allow_list() {
        let snap = Snapshot {
            endpoints: vec![ep("a:1", &["llama", "sql-lora"], &[]), ep("b:1", &["qwen", "llama"], &[])],
            ..Default::default()
        };
        let except: HashSet<&str> = ["llama"].into_iter().collect();
        assert_eq!(learned_names(&snap, None, &except), ["qwen", "sql-lora"]);
        let allow: HashSet<String> = ["qwen".to_string()].into_iter().collect();
        assert_eq!(learned_names(&snap, Some(&allow), &except), ["qwen"]);
    }

    proptest::proptest! {
        /// Any bytes: an error or a bounded list, never a panic; every kept name is usable.
        #[test]
        fn parse_never_panics_and_keeps_bounds(body in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            if let Ok(m) = parse_models(200, &body) {
                proptest::prop_assert!(m.bases.len() + m.adapters.len() <= MAX_MODELS_PER_POD);
                proptest::prop_assert!(m.bases.iter().chain(&m.adapters).all(|n| usable_name(n)));
            }
        }

        /// Lists built from arbitrary names: every usable one is kept once, as a base or an
        /// adapter according to its parent.
        #[test]
        fn parse_sorts_entries_by_parent(names in proptest::collection::vec("[a-z]{1,8}", 0..20), with_parent in proptest::collection::vec(proptest::bool::ANY, 20)) {
            let entries: Vec<serde_json::Value> = names.iter().zip(&with_parent).map(|(n, p)| {
                if *p { serde_json::json!({"id": n, "parent": "base-model"}) } else { serde_json::json!({"id": n}) }
            }).collect();
            let body = serde_json::to_vec(&serde_json::json!({"data": entries})).unwrap();
            let m = parse_models(200, &body).unwrap();
            let mut unique = names.clone();
            unique.sort();
            unique.dedup();
            let mut got: Vec<String> = m.bases.iter().chain(&m.adapters).cloned().collect();
            got.sort();
            proptest::prop_assert_eq!(got, unique);
        }
    }

    #[test]
    fn config_validation_names_the_field() {
        let mut errs = Vec::new();
        let c = PodModelsConfig { refresh_ms: 10, timeout_ms: 20, path: "v1".into(), allow_list: false };
        c.validate("pod_models", &mut errs);
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["pod_models.refresh_ms", "pod_models.timeout_ms", "pod_models.path"]);
    }
}
