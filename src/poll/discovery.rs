//! Pod discovery like an InferencePool: list the pool's pods from the Kubernetes API and turn them
//! into endpoints.
//!
//! The poller sends `GET /api/v1/namespaces/NS/pods?labelSelector=...&resourceVersion=0` with
//! `dispatch_http_call` through `discovery.kubernetes.api_cluster` every `refresh_ms`, and hands
//! the response to [`parse_pod_list_response`]. Everything here is pure: building the request,
//! and parsing the PodList.
//!
//! ## Which pods become endpoints
//! A pod becomes `target_ports.len()` endpoints (`ip:port` each, IPv6 bracketed) when all hold:
//! - its labels contain every `selector` pair, and its namespace is `namespace` (the API server
//!   filters already; checking again costs little and guards against a proxy or fake that does not);
//! - it is not terminating (no `metadata.deletionTimestamp`): a pod being deleted still reports
//!   Ready for its grace period, and new requests to it would be cut off;
//! - its `Ready` condition is `True` (the kubelet's readiness, the same test GIE uses);
//! - it has an IP (`status.podIP`, else the first of `status.podIPs`) that parses as an address.
//!   The address goes into `x-gateway-destination-endpoint` and `x-envoy-original-dst-host`, so
//!   anything that is not a plain IP is dropped rather than passed on.
//!
//! At most [`MAX_DISCOVERED_ENDPOINTS`] endpoints are kept (the snapshot is copied into every
//! worker on each change); the list is sorted by address and deduplicated, so the same pods give
//! the same endpoints in the same order on every refresh. Every pod left out is counted by reason
//! in [`SkipCounts`], for the log.
//!
//! `resourceVersion=0` lets the API server answer from its watch cache instead of a quorum read
//! from etcd: many gateway replicas refresh every few seconds, and a list a second old is fine
//! because readiness itself lags by the probe period.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::Deserialize;

use crate::base::json::ConfigError;
use crate::base::labels::{is_dns_label, is_label_key, is_label_value};
use crate::poll::config::{KubernetesDiscoveryConfig, MAX_TARGET_PORTS};
use crate::state::catalog::{EndpointConfig, ModelConfig};

/// Largest number of endpoints one discovery keeps.
pub const MAX_DISCOVERED_ENDPOINTS: usize = 1024;

/// Where the bearer token comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenSource<'a> {
    /// No `authorization` header.
    None,
    /// The token itself.
    Inline(&'a str),
    /// The name of a VM environment variable that holds it; the host reads it.
    Env(&'a str),
}

impl KubernetesDiscoveryConfig {
    pub fn token_source(&self) -> TokenSource<'_> {
        match (&self.token, &self.token_env) {
            (Some(t), _) => TokenSource::Inline(t),
            (None, Some(env)) => TokenSource::Env(env),
            (None, None) => TokenSource::None,
        }
    }

    /// `:path` of the pod list request.
    pub fn pod_list_path(&self) -> String {
        format!(
            "/api/v1/namespaces/{}/pods?labelSelector={}&resourceVersion=0",
            percent_encode(&self.namespace),
            percent_encode(&label_selector(&self.selector))
        )
    }

    /// Headers of the pod list request, pseudo-headers first. `token` is the resolved bearer
    /// token (see [`TokenSource`]); `None` or an empty token sends no `authorization`.
    pub fn pod_list_headers(&self, token: Option<&str>) -> Vec<(&'static str, String)> {
        let mut headers = vec![
            (":method", "GET".to_string()),
            (":path", self.pod_list_path()),
            (":authority", self.api_authority.clone()),
            ("accept", "application/json".to_string()),
        ];
        if let Some(t) = token.map(str::trim).filter(|t| !t.is_empty()) {
            headers.push(("authorization", format!("Bearer {t}")));
        }
        headers
    }

    /// Checks what the reader cannot; errors carry paths under `path` (e.g. `discovery.kubernetes`).
    pub fn validate_into(&self, path: &str, models: &[ModelConfig], errs: &mut Vec<ConfigError>) {
        let mut err = |field: &str, reason: String| {
            errs.push(ConfigError { path: format!("{path}.{field}"), reason });
        };
        if !is_dns_label(&self.namespace) {
            err("namespace", format!("{:?} is not a namespace name (a DNS label)", self.namespace));
        }
        if self.selector.is_empty() {
            err(
                "selector",
                "needs at least one label: an empty selector would pick every pod in the namespace".into(),
            );
        }
        for (k, v) in &self.selector {
            if !is_label_key(k) {
                err(&format!("selector.{k}"), format!("{k:?} is not a label key"));
            }
            if !is_label_value(v) {
                err(&format!("selector.{k}"), format!("{v:?} is not a label value"));
            }
        }
        if self.target_ports.is_empty() || self.target_ports.len() > MAX_TARGET_PORTS {
            err(
                "target_ports",
                format!("needs 1 to {MAX_TARGET_PORTS} ports, has {}", self.target_ports.len()),
            );
        }
        for (i, p) in self.target_ports.iter().enumerate() {
            if *p == 0 {
                err(&format!("target_ports[{i}]"), "port 0 is not a port".into());
            }
            if self.target_ports.iter().take(i).any(|q| q == p) {
                err(&format!("target_ports[{i}]"), format!("port {p} is listed twice"));
            }
        }
        for (i, m) in self.models.iter().enumerate() {
            if !models.iter().any(|known| &known.name == m) {
                err(&format!("models[{i}]"), format!("{m:?} is not a base model in `models`"));
            }
        }
        if self.api_cluster.is_empty() {
            err("api_cluster", "must name the Envoy cluster that reaches the API server".into());
        }
        if self.api_authority.is_empty()
            || self.api_authority.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            err("api_authority", format!("{:?} is not a host name", self.api_authority));
        }
        if self.token.is_some() && self.token_env.is_some() {
            err("token", "set `token` or `token_env`, not both".into());
        }
        if let Some(t) = &self.token {
            if t.trim().is_empty() || t.chars().any(|c| c.is_control()) {
                err("token", "is empty or has control characters".into());
            }
        }
        if let Some(e) = &self.token_env {
            if e.is_empty() || e.contains('=') || e.contains('\0') {
                err("token_env", format!("{e:?} is not an environment variable name"));
            }
        }
        self.validate_ranges(path, errs);
        if self.timeout_ms == 0 || self.timeout_ms > self.refresh_ms {
            errs.push(ConfigError::new(
                format!("{path}.timeout_ms"),
                format!("must be between 1 and refresh_ms ({}), is {}", self.refresh_ms, self.timeout_ms),
            ));
        }
    }
}

/// `k1=v1,k2=v2`, in key order (the map is sorted, so the same selector gives the same URL).
pub fn label_selector(selector: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    for (i, (k, v)) in selector.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(k);
        out.push('=');
        out.push_str(v);
    }
    out
}

/// Percent-encodes everything but RFC 3986 unreserved characters, so `=`, `,`, `/` and `&` in a
/// selector cannot be read as URL syntax.
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push('%');
            out.push(hex_digit(b >> 4));
            out.push(hex_digit(b & 0x0f));
        }
    }
    out
}

/// Upper-case hex digit of a nibble (0..=15).
fn hex_digit(nibble: u8) -> char {
    char::from_digit(u32::from(nibble & 0x0f), 16).map_or('0', |c| c.to_ascii_uppercase())
}

/// One discovered `ip:port`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct DiscoveredEndpoint {
    /// `ip:port`, IPv6 in brackets, as sent in `x-gateway-destination-endpoint`.
    pub address: String,
    /// The pod's name, for logs.
    pub pod: String,
    /// From the pod's role label (`roles`); `decode` without one. Used only with `pd`.
    pub role: crate::state::catalog::Role,
}

/// How many pods were left out, and why.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SkipCounts {
    /// Labels or namespace do not match the selector.
    pub not_selected: u32,
    /// Being deleted (`deletionTimestamp` set).
    pub terminating: u32,
    /// `Ready` condition missing or not `True`.
    pub not_ready: u32,
    /// No pod IP yet.
    pub no_ip: u32,
    /// The pod IP does not parse as an IP address.
    pub bad_ip: u32,
    /// Endpoints dropped because another pod already had the same `ip:port` (host-network pods).
    pub duplicate: u32,
    /// Endpoints beyond [`MAX_DISCOVERED_ENDPOINTS`].
    pub over_limit: u32,
}

/// The result of one pod list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Discovered {
    /// Sorted by address, unique.
    pub endpoints: Vec<DiscoveredEndpoint>,
    pub skipped: SkipCounts,
    /// The list's `metadata.resourceVersion`, for the log (empty when absent).
    pub resource_version: String,
}

impl Discovered {
    /// The endpoints as configuration entries, each serving `models`.
    pub fn endpoint_configs(&self, models: &[String]) -> Vec<EndpointConfig> {
        self.endpoints
            .iter()
            .map(|e| EndpointConfig { address: e.address.clone(), models: models.to_vec(), role: e.role })
            .collect()
    }
}

/// Why a pod list response could not be used. The previous endpoint list should then be kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoveryError {
    /// The call failed (no response, status 0) or the API server answered with this status
    /// (401/403: token or RBAC; 404: namespace).
    Status(u32),
    /// The body is not JSON of the expected shape.
    BadBody(String),
    /// The body is a Kubernetes object of another kind (e.g. a `Status` error object).
    WrongKind(String),
}

impl DiscoveryError {
    /// The `reason` tag of `inference_picker_discovery_failures_total`: a fixed code.
    pub fn reason(&self) -> &'static str {
        match self {
            DiscoveryError::Status(_) => "status",
            DiscoveryError::BadBody(_) | DiscoveryError::WrongKind(_) => "bad_body",
        }
    }
}

impl std::fmt::Display for DiscoveryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DiscoveryError::Status(0) => write!(f, "pod list call failed (no response)"),
            DiscoveryError::Status(s) => write!(f, "pod list answered HTTP {s}"),
            DiscoveryError::BadBody(e) => write!(f, "pod list body does not parse: {e}"),
            DiscoveryError::WrongKind(k) => write!(f, "expected a PodList, got {k:?}"),
        }
    }
}

// Kubernetes objects carry many fields this module ignores, and gain new ones with every release:
// these structs read only what they need and are deliberately not `deny_unknown_fields`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PodList {
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    metadata: ListMeta,
    /// Go encodes an empty list as `null`.
    #[serde(default)]
    items: Option<Vec<Pod>>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ListMeta {
    #[serde(default)]
    resource_version: Option<String>,
}

#[derive(Deserialize)]
struct Pod {
    #[serde(default)]
    metadata: PodMeta,
    #[serde(default)]
    status: PodStatus,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct PodMeta {
    #[serde(default)]
    name: String,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    deletion_timestamp: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct PodStatus {
    #[serde(default, rename = "podIP")]
    pod_ip: Option<String>,
    #[serde(default, rename = "podIPs")]
    pod_ips: Option<Vec<PodIp>>,
    #[serde(default)]
    conditions: Option<Vec<PodCondition>>,
}

#[derive(Deserialize)]
struct PodIp {
    #[serde(default)]
    ip: String,
}

#[derive(Deserialize)]
struct PodCondition {
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(default)]
    status: String,
}

/// Parses the API server's answer to the pod list request. `status` is the HTTP status (0 when the
/// call failed without a response).
pub fn parse_pod_list_response(
    status: u32,
    body: &[u8],
    cfg: &KubernetesDiscoveryConfig,
) -> Result<Discovered, DiscoveryError> {
    if status != 200 {
        return Err(DiscoveryError::Status(status));
    }
    parse_pod_list(body, cfg)
}

/// Parses a PodList JSON body into endpoints (see the module doc for the rules).
pub fn parse_pod_list(body: &[u8], cfg: &KubernetesDiscoveryConfig) -> Result<Discovered, DiscoveryError> {
    let list: PodList = serde_json::from_slice(body).map_err(|e| DiscoveryError::BadBody(e.to_string()))?;
    // `kind` is required: a body without it (`{}`, `[]`, a proxy's own JSON) would otherwise read
    // as "no pods" and empty the pool.
    if list.kind.as_deref() != Some("PodList") {
        return Err(DiscoveryError::WrongKind(list.kind.unwrap_or_default()));
    }
    let mut skipped = SkipCounts::default();
    let mut endpoints = Vec::new();
    for pod in list.items.unwrap_or_default() {
        let labels = pod.metadata.labels.unwrap_or_default();
        let namespace_ok = pod.metadata.namespace.as_deref().is_none_or(|ns| ns == cfg.namespace);
        if !namespace_ok || !cfg.selector.iter().all(|(k, v)| labels.get(k) == Some(v)) {
            skipped.not_selected += 1;
            continue;
        }
        if pod.metadata.deletion_timestamp.is_some() {
            skipped.terminating += 1;
            continue;
        }
        let ready =
            pod.status.conditions.unwrap_or_default().iter().any(|c| c.kind == "Ready" && c.status == "True");
        if !ready {
            skipped.not_ready += 1;
            continue;
        }
        let ip_text = pod.status.pod_ip.filter(|ip| !ip.is_empty()).or_else(|| {
            pod.status.pod_ips.unwrap_or_default().into_iter().map(|p| p.ip).find(|ip| !ip.is_empty())
        });
        let Some(ip_text) = ip_text else {
            skipped.no_ip += 1;
            continue;
        };
        let Ok(ip) = ip_text.parse::<IpAddr>() else {
            skipped.bad_ip += 1;
            continue;
        };
        let role = cfg.roles.role_of(labels.get(&cfg.roles.label).map(String::as_str));
        for port in &cfg.target_ports {
            let address = match ip {
                IpAddr::V4(v4) => format!("{v4}:{port}"),
                IpAddr::V6(v6) => format!("[{v6}]:{port}"),
            };
            endpoints.push(DiscoveredEndpoint { address, pod: pod.metadata.name.clone(), role });
        }
    }
    crate::base::sorting::sort(&mut endpoints);
    let before = endpoints.len();
    endpoints.dedup_by(|a, b| a.address == b.address);
    skipped.duplicate = saturating_u32(before - endpoints.len());
    if endpoints.len() > MAX_DISCOVERED_ENDPOINTS {
        skipped.over_limit = saturating_u32(endpoints.len() - MAX_DISCOVERED_ENDPOINTS);
        endpoints.truncate(MAX_DISCOVERED_ENDPOINTS);
    }
    Ok(Discovered {
        endpoints,
        skipped,
        resource_version: list.metadata.resource_version.unwrap_or_default(),
    })
}

fn saturating_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::poll::config::RoleSelectors;
    use crate::state::catalog::Role;

    const NAMESPACE_LIST: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/k8s/podlist-inference-namespace.json"
    ));
    const DUALSTACK_LIST: &str =
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/k8s/podlist-dualstack-ipv6.json"));

    fn cfg(ports: &[u16]) -> KubernetesDiscoveryConfig {
        KubernetesDiscoveryConfig {
            namespace: "inference".into(),
            selector: BTreeMap::from([("app".to_string(), "vllm-llama3-8b-instruct".to_string())]),
            target_ports: ports.to_vec(),
            models: vec![],
            api_cluster: "kubernetes_api".into(),
            api_authority: "kubernetes.default.svc".into(),
            token: None,
            token_env: Some("K8S_TOKEN".into()),
            refresh_ms: 5000,
            timeout_ms: 2000,
            roles: Default::default(),
        }
    }

    fn addresses(d: &Discovered) -> Vec<&str> {
        d.endpoints.iter().map(|e| e.address.as_str()).collect()
    }

    #[test]
    fn recorded_namespace_list_keeps_only_ready_selected_pods() {
        let d = parse_pod_list(NAMESPACE_LIST.as_bytes(), &cfg(&[8000])).unwrap();
        // The three Ready llama pods, sorted as strings ("10.244.1" < "10.244.2" < "10.244.3").
        assert_eq!(addresses(&d), ["10.244.1.17:8000", "10.244.2.9:8000", "10.244.3.22:8000"]);
        assert_eq!(d.endpoints[0].pod, "vllm-llama3-8b-instruct-6b9f7c8d4f-x7k2p");
        // qwen pod: not selected; h3j7d: terminating; r9t5z (loading) and p8v1s (Pending, no IP)
        // are both Ready=False, which is checked before the IP.
        assert_eq!(
            d.skipped,
            SkipCounts { not_selected: 1, terminating: 1, not_ready: 2, ..SkipCounts::default() }
        );
        assert_eq!(d.resource_version, "48377");
    }

    #[test]
    fn each_target_port_is_its_own_endpoint() {
        let d = parse_pod_list(NAMESPACE_LIST.as_bytes(), &cfg(&[8000, 8001])).unwrap();
        assert_eq!(
            addresses(&d),
            [
                "10.244.1.17:8000",
                "10.244.1.17:8001",
                "10.244.2.9:8000",
                "10.244.2.9:8001",
                "10.244.3.22:8000",
                "10.244.3.22:8001"
            ]
        );
    }

    #[test]
    fn ipv6_primary_pods_are_bracketed() {
        let mut c = cfg(&[8000]);
        c.namespace = "inference".into();
        let d = parse_pod_list(DUALSTACK_LIST.as_bytes(), &c).unwrap();
        assert_eq!(addresses(&d), ["[fd00:10:244:1::2f]:8000", "[fd00:10:244:2::1a]:8000"]);
        assert_eq!(d.skipped, SkipCounts::default());
    }

    fn pod_json(name: &str, ip: &str, ready: &str, extra_meta: &str) -> String {
        format!(
            r#"{{"metadata":{{"name":"{name}","namespace":"inference","labels":{{"app":"vllm-llama3-8b-instruct"}}{extra_meta}}},
                "status":{{"phase":"Running","podIP":"{ip}","conditions":[{{"type":"Ready","status":"{ready}"}}]}}}}"#
        )
    }

    fn list_of(pods: &[String]) -> Vec<u8> {
        format!(r#"{{"kind":"PodList","apiVersion":"v1","metadata":{{}},"items":[{}]}}"#, pods.join(","))
            .into_bytes()
    }

    #[test]
    fn podips_is_used_when_podip_is_missing_and_bad_ips_are_dropped() {
        let only_pod_ips = r#"{"metadata":{"name":"a","labels":{"app":"vllm-llama3-8b-instruct"}},
            "status":{"podIPs":[{"ip":"10.1.0.5"}],"conditions":[{"type":"Ready","status":"True"}]}}"#;
        let body = list_of(&[
            only_pod_ips.to_string(),
            pod_json("b", "10.1.0.6; rm -rf", "True", ""),
            pod_json("c", "10.1.0.7:9000", "True", ""),
            pod_json("d", "", "True", ""),
        ]);
        let d = parse_pod_list(&body, &cfg(&[8000])).unwrap();
        assert_eq!(addresses(&d), ["10.1.0.5:8000"]);
        // "10.1.0.6; rm -rf" and "10.1.0.7:9000" are not IPs; "" is no IP at all.
        assert_eq!(d.skipped.bad_ip, 2);
        assert_eq!(d.skipped.no_ip, 1);
    }

    #[test]
    fn ready_must_be_exactly_true_and_other_namespaces_are_ignored() {
        let other_ns = r#"{"metadata":{"name":"x","namespace":"default","labels":{"app":"vllm-llama3-8b-instruct"}},
            "status":{"podIP":"10.9.9.9","conditions":[{"type":"Ready","status":"True"}]}}"#;
        let no_conditions = r#"{"metadata":{"name":"y","labels":{"app":"vllm-llama3-8b-instruct"}},"status":{"podIP":"10.9.9.8"}}"#;
        let body = list_of(&[
            pod_json("a", "10.1.0.1", "True", ""),
            pod_json("b", "10.1.0.2", "Unknown", ""),
            pod_json("c", "10.1.0.3", "true", ""),
            other_ns.to_string(),
            no_conditions.to_string(),
        ]);
        let d = parse_pod_list(&body, &cfg(&[8000])).unwrap();
        assert_eq!(addresses(&d), ["10.1.0.1:8000"]);
        // "Unknown", lowercase "true" and no conditions at all are not Ready.
        assert_eq!(d.skipped.not_ready, 3);
        assert_eq!(d.skipped.not_selected, 1);
    }

    #[test]
    fn every_selector_label_must_match() {
        let mut c = cfg(&[8000]);
        c.selector.insert("app.kubernetes.io/component".into(), "model-server".into());
        let d = parse_pod_list(NAMESPACE_LIST.as_bytes(), &c).unwrap();
        // The fixture's llama pods carry that label too: the same three endpoints.
        assert_eq!(d.endpoints.len(), 3);
        c.selector.insert("tier".into(), "gold".into());
        let d = parse_pod_list(NAMESPACE_LIST.as_bytes(), &c).unwrap();
        assert!(d.endpoints.is_empty());
        assert_eq!(d.skipped.not_selected, 7);
    }

    #[test]
    fn duplicates_are_dropped_and_the_list_is_bounded() {
        // Two host-network pods on one node report the node's IP.
        let body = list_of(&[pod_json("b", "10.1.0.1", "True", ""), pod_json("a", "10.1.0.1", "True", "")]);
        let d = parse_pod_list(&body, &cfg(&[8000])).unwrap();
        // Sorted by (address, pod): pod "a" comes first and is kept.
        assert_eq!(
            d.endpoints,
            vec![DiscoveredEndpoint {
                address: "10.1.0.1:8000".into(),
                pod: "a".into(),
                role: crate::state::catalog::Role::Decode
            }]
        );
        assert_eq!(d.skipped.duplicate, 1);

        // 130 pods × 8 ports = 1040 endpoints: 16 over the limit of 1024.
        let pods: Vec<String> = (0..130)
            .map(|i| pod_json(&format!("p{i}"), &format!("10.2.{}.{}", i / 100, i % 100), "True", ""))
            .collect();
        let d = parse_pod_list(&list_of(&pods), &cfg(&[1, 2, 3, 4, 5, 6, 7, 8])).unwrap();
        assert_eq!(d.endpoints.len(), MAX_DISCOVERED_ENDPOINTS);
        assert_eq!(d.skipped.over_limit, 16);
    }

    #[test]
    fn errors_and_odd_bodies() {
        let c = cfg(&[8000]);
        assert_eq!(parse_pod_list_response(401, b"{}", &c), Err(DiscoveryError::Status(401)));
        assert_eq!(parse_pod_list_response(0, b"", &c), Err(DiscoveryError::Status(0)));
        let status_obj =
            br#"{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Forbidden","code":403}"#;
        assert_eq!(
            parse_pod_list_response(200, status_obj, &c),
            Err(DiscoveryError::WrongKind("Status".into()))
        );
        assert!(matches!(parse_pod_list(b"{\"items\":[", &c), Err(DiscoveryError::BadBody(_))));
        // No `kind`: never read as an empty pool.
        assert_eq!(parse_pod_list(b"[]", &c), Err(DiscoveryError::WrongKind(String::new())));
        assert_eq!(parse_pod_list(b"{}", &c), Err(DiscoveryError::WrongKind(String::new())));
        // `items: null` is how Go encodes an empty list.
        let d = parse_pod_list(br#"{"kind":"PodList","items":null}"#, &c).unwrap();
        assert!(d.endpoints.is_empty());
        // A truncated body (the host cut it) is an error, never a partial list.
        let cut = &NAMESPACE_LIST.as_bytes()[..NAMESPACE_LIST.len() / 2];
        assert!(matches!(parse_pod_list(cut, &c), Err(DiscoveryError::BadBody(_))));
    }

    #[test]
    fn request_path_encodes_the_selector() {
        let mut c = cfg(&[8000]);
        c.selector.insert("app.kubernetes.io/name".into(), "vllm".into());
        // Keys in order: "app" < "app.kubernetes.io/name"; '=' → %3D, ',' → %2C, '/' → %2F.
        assert_eq!(
            c.pod_list_path(),
            "/api/v1/namespaces/inference/pods?labelSelector=app%3Dvllm-llama3-8b-instruct%2Capp.kubernetes.io%2Fname%3Dvllm&resourceVersion=0"
        );
        assert_eq!(percent_encode("a b&c~"), "a%20b%26c~");
        assert_eq!(percent_encode("é"), "%C3%A9");
    }

    #[test]
    fn request_headers_carry_the_token_only_when_there_is_one() {
        let c = cfg(&[8000]);
        let h = c.pod_list_headers(Some(" eyJhbGciOi.x.y\n"));
        assert_eq!(h[0], (":method", "GET".to_string()));
        assert_eq!(h[2], (":authority", "kubernetes.default.svc".to_string()));
        assert_eq!(h.last(), Some(&("authorization", "Bearer eyJhbGciOi.x.y".to_string())));
        assert!(c.pod_list_headers(None).iter().all(|(k, _)| *k != "authorization"));
        assert!(c.pod_list_headers(Some("  ")).iter().all(|(k, _)| *k != "authorization"));
        assert_eq!(c.token_source(), TokenSource::Env("K8S_TOKEN"));
    }

    #[test]
    fn endpoint_configs_carry_the_models() {
        let d = parse_pod_list(NAMESPACE_LIST.as_bytes(), &cfg(&[8000])).unwrap();
        let eps = d.endpoint_configs(&["meta-llama/Llama-3.1-8B-Instruct".to_string()]);
        assert_eq!(eps.len(), 3);
        assert_eq!(eps[1].address, "10.244.2.9:8000");
        assert_eq!(eps[1].models, ["meta-llama/Llama-3.1-8B-Instruct"]);
    }

    #[test]
    fn validation_reports_paths() {
        let models: [ModelConfig; 1] = [crate::config::read_json(r#"{"name":"m"}"#).unwrap()];
        let mut ok = cfg(&[8000]);
        ok.models = vec!["m".into()];
        let mut errs = Vec::new();
        ok.validate_into("discovery.kubernetes", &models, &mut errs);
        assert_eq!(errs, vec![]);

        let mut bad = cfg(&[8000, 0, 8000, 1, 2, 3, 4, 5, 6]);
        bad.namespace = "Inference".into();
        bad.selector = BTreeMap::from([("-bad".to_string(), "ok".to_string())]);
        bad.models = vec!["nope".into()];
        bad.token = Some("t".into());
        bad.refresh_ms = 100;
        let mut errs = Vec::new();
        bad.validate_into("discovery.kubernetes", &models, &mut errs);
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "discovery.kubernetes.namespace",
                "discovery.kubernetes.selector.-bad",
                "discovery.kubernetes.target_ports",
                "discovery.kubernetes.target_ports[1]",
                "discovery.kubernetes.target_ports[2]",
                "discovery.kubernetes.models[0]",
                "discovery.kubernetes.token",
                "discovery.kubernetes.refresh_ms",
                "discovery.kubernetes.timeout_ms",
            ]
        );

        let mut empty = cfg(&[8000]);
        empty.selector.clear();
        let mut errs = Vec::new();
        empty.validate_into("d", &models, &mut errs);
        assert_eq!(errs.len(), 1);
        assert_eq!(errs[0].path, "d.selector");
    }

    #[test]
    fn label_syntax() {
        assert!(is_label_key("app"));
        assert!(is_label_key("app.kubernetes.io/name"));
        assert!(!is_label_key("app.kubernetes.io/"));
        assert!(!is_label_key("/name"));
        assert!(!is_label_key("a b"));
        assert!(is_label_value(""));
        assert!(is_label_value("vllm-llama3-8b-instruct"));
        assert!(!is_label_value("x,y"));
        assert!(!is_label_value(&"a".repeat(64)));
    }

    #[test]
    fn config_json_round_trip() {
        let json = r#"{"namespace":"inference","selector":{"app":"vllm"},"target_ports":[8000],"token_env":"K8S_TOKEN"}"#;
        let c: KubernetesDiscoveryConfig = crate::config::read_json(json).unwrap();
        assert_eq!(c.api_cluster, "kubernetes_api");
        assert_eq!(c.refresh_ms, 5000);
        assert_eq!(c.timeout_ms, 2000);
        let typo = r#"{"namespace":"inference","selector":{"app":"vllm"},"target_ports":[8000],"refresh":1}"#;
        assert!(crate::config::read_json::<KubernetesDiscoveryConfig>(typo).is_err());
    }

    #[test]
    fn whole_config_with_discovery_parses() {
        let json = br#"{"version":1,"endpoints":[],"models":[{"name":"meta-llama/Llama-3.1-8B-Instruct"}],
            "discovery":{"kubernetes":{"namespace":"inference","selector":{"app":"vllm-llama3-8b-instruct"},
            "target_ports":[8000],"token_env":"K8S_TOKEN"}}}"#;
        let c = crate::config::Config::from_json(json).unwrap();
        let k = c.discovery.unwrap().kubernetes;
        assert_eq!(k.target_ports, [8000]);
        assert_eq!(k.token_source(), TokenSource::Env("K8S_TOKEN"));
        // Without the section there is no discovery.
        let c = crate::config::Config::from_json(
            br#"{"version":1,"endpoints":[{"address":"10.0.0.1:8000","models":["m"]}],"models":[{"name":"m"}]}"#,
        )
        .unwrap();
        assert_eq!(c.discovery, None);
    }

    #[test]
    fn role_selectors_map_labels_and_are_validated() {
        let r = RoleSelectors::default();
        assert_eq!(r.role_of(Some("prefill")), Role::Prefill);
        assert_eq!(r.role_of(Some("decode")), Role::Decode);
        assert_eq!(r.role_of(Some("both")), Role::Both);
        assert_eq!(r.role_of(Some("prefill-decode")), Role::Both);
        // llm-d's decode filter takes unlabelled pods.
        assert_eq!(r.role_of(None), Role::Decode);
        assert_eq!(r.role_of(Some("encode")), Role::Decode);

        let mut errs = Vec::new();
        let bad = RoleSelectors {
            label: "not a key".into(),
            prefill: vec!["p".into()],
            decode: vec!["p".into(), "".into()],
            both: vec![],
        };
        bad.validate("discovery.kubernetes.roles", &mut errs);
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "discovery.kubernetes.roles.label",
                "discovery.kubernetes.roles.prefill[0]",
                "discovery.kubernetes.roles.decode[1]"
            ],
            "{errs:?}"
        );
        let mut errs = Vec::new();
        RoleSelectors::default().validate("r", &mut errs);
        assert!(errs.is_empty());
    }
}
