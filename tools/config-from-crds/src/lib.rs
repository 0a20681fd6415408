//! Turns Gateway API Inference Extension resources into this module's configuration document.
//!
//! Mapping (one InferencePool, and the objectives and rewrites that reference it by `poolRef`):
//!
//! | resource | field | configuration |
//! |---|---|---|
//! | InferencePool | `metadata.namespace` (else `--namespace`) | `discovery.kubernetes.namespace` |
//! | InferencePool | `spec.selector.matchLabels` | `discovery.kubernetes.selector` |
//! | InferencePool | `spec.targetPorts[].number` | `discovery.kubernetes.target_ports` |
//! | InferencePool | `spec.endpointPickerRef.failureMode` (default FailClose) | `filter.failure_mode` |
//! | InferenceModelRewrite | `spec.rules[]` (resources by creation time, then name) | `scheduler.rewrites[]` |
//! | InferenceObjective | `metadata.name` → `spec.priority` (unset = 0) | `priority.objectives[]` (by name) |
//! | InferencePool | `metadata.name`, with `--route-by-model` | `pool.name` (and `pool.route_by_model: true`) |
//!
//! Not mapped: `endpointPickerRef` name and port (this module is the picker, inside the proxy),
//! and `appProtocol` (the data cluster's protocol is Envoy configuration; `kubernetes.io/h2c` gets a
//! warning). The base models and their adapters are not in any of these resources; they come from
//! `--model`. Everything else comes from `--base` (a configuration document to start from) or keeps
//! its default.

use std::collections::BTreeMap;

use inference_picker::config::{
    Config, DiscoveryConfig, FailureMode, KubernetesDiscoveryConfig, ModelConfig, PollerMode,
};
use inference_picker::flow::priority::ObjectiveConfig;
use inference_picker::scheduler::config::{MatchType, ModelMatch, RewriteMatch, RewriteRule, RewriteTarget};
use serde::Deserialize;

pub const POOL_API: &str = "inference.networking.k8s.io/v1";
pub const X_API: &str = "inference.networking.x-k8s.io/v1alpha2";

/// What the command line adds to the resources.
#[derive(Debug, Clone)]
pub struct Options {
    /// Which InferencePool, when the input has several.
    pub pool: Option<String>,
    /// Namespace for resources without `metadata.namespace` (as `kubectl apply` would).
    pub namespace: String,
    /// Base models with their adapters.
    pub models: Vec<ModelConfig>,
    pub poller_mode: PollerMode,
    /// `discovery.kubernetes.token_env`.
    pub token_env: Option<String>,
    /// A configuration document to start from; its `discovery`, `filter.failure_mode`,
    /// `poller.mode`, `scheduler.rewrites` and `priority.objectives` (when the input has any), and
    /// `models` (when `models` is not empty) are replaced.
    pub base: Option<serde_json::Value>,
    /// Several pools on one gateway with body-based routing: sets `pool` to
    /// `{"name": <the InferencePool's name>, "route_by_model": true}`.
    pub route_by_model: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            pool: None,
            namespace: "default".into(),
            models: vec![],
            poller_mode: PollerMode::Lease,
            token_env: Some("K8S_TOKEN".into()),
            base: None,
            route_by_model: false,
        }
    }
}

/// The result: the validated configuration, and notes for the user about what was not mapped.
#[derive(Debug)]
pub struct Output {
    pub config: Config,
    pub warnings: Vec<String>,
}

// Only the fields the mapping reads; the CRDs have more, and the input is checked against them
// elsewhere (by kubectl, or tests/deploy for the examples), so these are not deny_unknown_fields.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Meta {
    name: String,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    creation_timestamp: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct InferencePool {
    metadata: Meta,
    spec: PoolSpec,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PoolSpec {
    selector: Selector,
    target_ports: Vec<Port>,
    #[serde(default)]
    app_protocol: Option<String>,
    #[serde(default)]
    endpoint_picker_ref: Option<PickerRef>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Selector {
    match_labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct Port {
    number: u32,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PickerRef {
    #[serde(default)]
    failure_mode: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PoolRef {
    name: String,
    #[serde(default)]
    group: Option<String>,
    #[serde(default)]
    kind: Option<String>,
}

impl PoolRef {
    fn names(&self, pool: &str) -> bool {
        self.name == pool
            && self.group.as_deref().is_none_or(|g| g == "inference.networking.k8s.io")
            && self.kind.as_deref().is_none_or(|k| k == "InferencePool")
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct InferenceObjective {
    metadata: Meta,
    spec: ObjectiveSpec,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ObjectiveSpec {
    pool_ref: PoolRef,
    #[serde(default)]
    priority: Option<i64>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct InferenceModelRewrite {
    metadata: Meta,
    spec: RewriteSpec,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RewriteSpec {
    pool_ref: PoolRef,
    rules: Vec<CrdRule>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct CrdRule {
    #[serde(default)]
    matches: Vec<CrdMatch>,
    #[serde(default)]
    targets: Vec<CrdTarget>,
}

#[derive(Deserialize)]
struct CrdMatch {
    model: CrdModelMatch,
}

#[derive(Deserialize)]
struct CrdModelMatch {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    value: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct CrdTarget {
    model_rewrite: String,
    #[serde(default)]
    weight: Option<u32>,
}

/// Every YAML document of `text` (multi-document, `---` separated), empty documents skipped.
pub fn parse_documents(text: &str) -> Result<Vec<serde_yaml::Value>, String> {
    let mut docs = Vec::new();
    for (i, de) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let v = serde_yaml::Value::deserialize(de).map_err(|e| format!("document {}: {e}", i + 1))?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

fn type_of(doc: &serde_yaml::Value) -> (&str, &str) {
    let s = |k: &str| doc.get(k).and_then(serde_yaml::Value::as_str).unwrap_or("");
    (s("apiVersion"), s("kind"))
}

fn typed<T: for<'de> Deserialize<'de>>(doc: &serde_yaml::Value, what: &str) -> Result<T, String> {
    let name =
        doc.get("metadata").and_then(|m| m.get("name")).and_then(serde_yaml::Value::as_str).unwrap_or("?");
    serde_yaml::from_value(doc.clone()).map_err(|e| format!("{what} {name}: {e}"))
}

/// InferenceObjective name → priority, for the objectives of `pool` (unset priority = 0).
pub fn objective_priorities(docs: &[serde_yaml::Value], pool: &str) -> Result<BTreeMap<String, i64>, String> {
    let mut out = BTreeMap::new();
    for doc in docs {
        if type_of(doc) == (X_API, "InferenceObjective") {
            let o: InferenceObjective = typed(doc, "InferenceObjective")?;
            if o.spec.pool_ref.names(pool) {
                out.insert(o.metadata.name, o.spec.priority.unwrap_or(0));
            }
        }
    }
    Ok(out)
}

/// The rewrite rules of `pool`'s InferenceModelRewrites, oldest resource first (then by name),
/// each resource's rules in order.
pub fn rewrite_rules(docs: &[serde_yaml::Value], pool: &str) -> Result<Vec<RewriteRule>, String> {
    let mut found: Vec<InferenceModelRewrite> = Vec::new();
    for doc in docs {
        if type_of(doc) == (X_API, "InferenceModelRewrite") {
            let r: InferenceModelRewrite = typed(doc, "InferenceModelRewrite")?;
            if r.spec.pool_ref.names(pool) {
                found.push(r);
            }
        }
    }
    // RFC 3339 timestamps in UTC sort as text; a resource not yet created (no timestamp) is newest.
    found.sort_by(|a, b| {
        let key = |r: &InferenceModelRewrite| {
            (r.metadata.creation_timestamp.is_none(), r.metadata.creation_timestamp.clone())
        };
        key(a).cmp(&key(b)).then_with(|| a.metadata.name.cmp(&b.metadata.name))
    });
    let mut rules = Vec::new();
    for r in found {
        for (i, rule) in r.spec.rules.into_iter().enumerate() {
            let mut matches = Vec::new();
            for m in rule.matches {
                if m.model.kind.as_deref().is_some_and(|k| k != "Exact") {
                    return Err(format!(
                        "InferenceModelRewrite {} rules[{i}]: match type {:?} is not supported (only Exact)",
                        r.metadata.name, m.model.kind
                    ));
                }
                matches.push(RewriteMatch {
                    model: ModelMatch { kind: MatchType::Exact, value: m.model.value },
                });
            }
            let targets = rule
                .targets
                .into_iter()
                .map(|t| RewriteTarget { model_rewrite: t.model_rewrite, weight: t.weight })
                .collect();
            rules.push(RewriteRule { matches, targets });
        }
    }
    Ok(rules)
}

/// Builds and validates the configuration for one InferencePool in `docs`.
pub fn convert(docs: &[serde_yaml::Value], opts: &Options) -> Result<Output, Vec<String>> {
    let mut warnings = Vec::new();
    let pools: Vec<InferencePool> = docs
        .iter()
        .filter(|d| type_of(d) == (POOL_API, "InferencePool"))
        .map(|d| typed(d, "InferencePool"))
        .collect::<Result<_, _>>()
        .map_err(|e| vec![e])?;
    let pool = match (&opts.pool, pools.len()) {
        (_, 0) => return Err(vec![format!("no InferencePool ({POOL_API}) in the input")]),
        (None, 1) => pools.into_iter().next(),
        (None, n) => {
            let names: Vec<&str> = pools.iter().map(|p| p.metadata.name.as_str()).collect();
            return Err(vec![format!(
                "{n} InferencePools in the input ({}): choose one with --pool",
                names.join(", ")
            )]);
        }
        (Some(name), _) => pools.into_iter().find(|p| &p.metadata.name == name),
    };
    let Some(pool) = pool else {
        return Err(vec![format!("no InferencePool named {:?}", opts.pool.as_deref().unwrap_or(""))]);
    };

    let mut target_ports = Vec::new();
    for p in &pool.spec.target_ports {
        match u16::try_from(p.number) {
            Ok(port) => target_ports.push(port),
            Err(_) => {
                return Err(vec![format!(
                    "InferencePool {}: target port {} is out of range",
                    pool.metadata.name, p.number
                )])
            }
        }
    }
    let failure_mode = match pool.spec.endpoint_picker_ref.as_ref().and_then(|r| r.failure_mode.as_deref()) {
        None | Some("FailClose") => FailureMode::FailClose,
        Some("FailOpen") => FailureMode::FailOpen,
        Some(other) => {
            return Err(vec![format!("InferencePool {}: unknown failureMode {other:?}", pool.metadata.name)])
        }
    };
    if pool.spec.app_protocol.as_deref() == Some("kubernetes.io/h2c") {
        warnings.push(format!(
            "InferencePool {} uses appProtocol kubernetes.io/h2c: give the inference_pool cluster HTTP/2 (h2c) protocol options",
            pool.metadata.name
        ));
    }
    let objectives = objective_priorities(docs, &pool.metadata.name).map_err(|e| vec![e])?;
    let mut objective_configs = Vec::new();
    for (name, priority) in &objectives {
        let Ok(priority) = i32::try_from(*priority) else {
            return Err(vec![format!(
                "InferenceObjective {name}: priority {priority} does not fit in 32 bits"
            )]);
        };
        objective_configs.push(ObjectiveConfig {
            name: name.clone(),
            priority,
            ttft_ms: None,
            tpot_ms: None,
        });
    }
    if !objective_configs.is_empty() {
        warnings.push(format!(
            "{} InferenceObjective(s) written to priority.objectives; requests select one with \
             x-gateway-inference-objective only when priority.trust_objective_header is true",
            objective_configs.len()
        ));
    }
    let rewrites = rewrite_rules(docs, &pool.metadata.name).map_err(|e| vec![e])?;

    let mut doc =
        opts.base.clone().unwrap_or_else(|| serde_json::json!({"version": 1, "endpoints": [], "models": []}));
    let Some(obj) = doc.as_object_mut() else {
        return Err(vec!["--base is not a JSON object".into()]);
    };
    if !opts.models.is_empty() {
        obj.insert("models".into(), serde_json::to_value(&opts.models).map_err(|e| vec![e.to_string()])?);
    }
    let discovery = DiscoveryConfig {
        kubernetes: KubernetesDiscoveryConfig {
            namespace: pool.metadata.namespace.clone().unwrap_or_else(|| opts.namespace.clone()),
            selector: pool.spec.selector.match_labels.clone(),
            target_ports,
            models: vec![],
            api_cluster: "kubernetes_api".into(),
            api_authority: "kubernetes.default.svc".into(),
            token: None,
            token_env: opts.token_env.clone(),
            refresh_ms: 5000,
            timeout_ms: 2000,
            roles: Default::default(),
        },
    };
    obj.insert("discovery".into(), serde_json::to_value(&discovery).map_err(|e| vec![e.to_string()])?);
    set_path(
        obj,
        &["filter", "failure_mode"],
        serde_json::to_value(failure_mode).map_err(|e| vec![e.to_string()])?,
    );
    set_path(
        obj,
        &["poller", "mode"],
        serde_json::to_value(opts.poller_mode).map_err(|e| vec![e.to_string()])?,
    );
    if !rewrites.is_empty() {
        set_path(
            obj,
            &["scheduler", "rewrites"],
            serde_json::to_value(&rewrites).map_err(|e| vec![e.to_string()])?,
        );
    }
    if opts.route_by_model {
        obj.insert("pool".into(), serde_json::json!({"name": pool.metadata.name, "route_by_model": true}));
    }
    if !objective_configs.is_empty() {
        set_path(
            obj,
            &["priority", "objectives"],
            serde_json::to_value(&objective_configs).map_err(|e| vec![e.to_string()])?,
        );
    }
    let bytes = serde_json::to_vec(&doc).map_err(|e| vec![e.to_string()])?;
    let config =
        Config::from_json(&bytes).map_err(|errs| errs.iter().map(|e| e.to_string()).collect::<Vec<_>>())?;
    Ok(Output { config, warnings })
}

/// Sets `obj[path[0]][path[1]]...` to `value`, creating objects on the way.
fn set_path(obj: &mut serde_json::Map<String, serde_json::Value>, path: &[&str], value: serde_json::Value) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut cur = obj;
    for p in parents {
        let entry = cur.entry((*p).to_string()).or_insert_with(|| serde_json::json!({}));
        if !entry.is_object() {
            *entry = serde_json::json!({});
        }
        let Some(next) = entry.as_object_mut() else {
            return;
        };
        cur = next;
    }
    cur.insert((*last).to_string(), value);
}

/// Parses `--model NAME` or `--model NAME=ADAPTER,ADAPTER`.
pub fn parse_model_arg(arg: &str) -> Result<ModelConfig, String> {
    let (name, adapters) = match arg.split_once('=') {
        Some((n, a)) => {
            (n, a.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect())
        }
        None => (arg, vec![]),
    };
    if name.trim().is_empty() {
        return Err(format!("--model {arg:?}: empty model name"));
    }
    // Through the module's reader, so that fields this tool does not set keep their documented
    // defaults.
    inference_picker::base::json::read_value(&serde_json::json!({"name": name.trim(), "adapters": adapters}))
        .map_err(|e| format!("--model {arg:?}: {e}"))
}
