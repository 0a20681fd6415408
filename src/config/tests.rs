//! One test per validation rule, each asserting the exact path and a substring of the reason,
//! plus the serde-level errors (unknown fields, wrong types, wrong version) and collect-all.

use serde_json::{json, Value};

use super::*;

/// A valid document: three endpoints, a base model with two adapters, a second model on one
/// endpoint. Tests change one thing and expect exactly the errors that change causes.
fn base() -> Value {
    json!({
        "version": 1,
        "endpoints": [
            {"address": "10.0.0.1:8000", "models": ["llama"]},
            {"address": "10.0.0.2:8000", "models": ["llama"]},
            {"address": "[fd00::3]:8000", "models": ["llama", "qwen"]}
        ],
        "models": [
            {"name": "llama", "adapters": ["sql-lora", "chat-lora"]},
            {"name": "qwen"}
        ]
    })
}

fn parse(v: &Value) -> Result<Config, Vec<ConfigError>> {
    Config::from_json(&serde_json::to_vec(v).unwrap())
}

fn errors(v: &Value) -> Vec<ConfigError> {
    match parse(v) {
        Ok(_) => panic!("expected errors for {v}"),
        Err(e) => e,
    }
}

fn errors_str(doc: &str) -> Vec<ConfigError> {
    match Config::from_json(doc.as_bytes()) {
        Ok(_) => panic!("expected errors for {doc}"),
        Err(e) => e,
    }
}

/// Exactly one error, at `path`, whose reason contains `reason`.
#[track_caller]
fn assert_only(errs: &[ConfigError], path: &str, reason: &str) {
    assert_eq!(errs.len(), 1, "expected one error, got {errs:#?}");
    assert_eq!(errs[0].path, path, "{errs:#?}");
    assert!(errs[0].reason.contains(reason), "reason {:?} lacks {reason:?}", errs[0].reason);
}

/// Among the errors, one at `path` whose reason contains `reason`.
#[track_caller]
fn assert_has(errs: &[ConfigError], path: &str, reason: &str) {
    assert!(
        errs.iter().any(|e| e.path == path && e.reason.contains(reason)),
        "no error at {path} containing {reason:?} in {errs:#?}"
    );
}

/// `v` with the value at JSON pointer `pointer` set (a missing last key is added).
fn with(mut v: Value, pointer: &str, value: Value) -> Value {
    if let Some(slot) = v.pointer_mut(pointer) {
        *slot = value;
    } else {
        let (parent, key) = pointer.rsplit_once('/').unwrap();
        v.pointer_mut(parent).unwrap().as_object_mut().unwrap().insert(key.to_string(), value);
    }
    v
}

#[test]
fn base_is_valid_and_defaults_apply() {
    let cfg = parse(&base()).unwrap();
    assert_eq!(cfg.poller, PollerConfig::default());
    assert_eq!(cfg.poller.interval_ms, 200);
    assert_eq!(cfg.poller.timeout_ms, 1000);
    assert_eq!(cfg.poller.stale_after_ms, 1000);
    assert_eq!(cfg.poller.cluster, "inference_pool_metrics");
    assert_eq!(cfg.poller.metrics_path, "/metrics");
    assert_eq!(cfg.filter.max_body_bytes, 4 * 1024 * 1024);
    assert_eq!(cfg.filter.failure_mode, FailureMode::FailClose);
    assert!(cfg.models[1].adapters.is_empty());
}

// ---- version ----

#[test]
fn wrong_version_is_reported_before_anything_else() {
    // A version-2 document may have fields this build does not know: the version error must come
    // first, not "unknown field".
    let mut v = with(base(), "/version", json!(2));
    v["scheduler"] = json!({"weights": {}});
    assert_only(&errors(&v), "version", "unsupported version 2; this build reads only version 1");
}

#[test]
fn version_as_string_or_missing() {
    assert_only(&errors(&with(base(), "/version", json!("1"))), "version", "unsupported version \"1\"");
    let mut v = base();
    v.as_object_mut().unwrap().remove("version");
    assert_only(&errors(&v), "version", "missing");
}

#[test]
fn validate_checks_version_of_a_built_config() {
    let mut cfg = parse(&base()).unwrap();
    cfg.version = 0;
    assert_only(&cfg.validate().unwrap_err(), "version", "unsupported version 0");
}

// ---- endpoints ----

#[test]
fn no_endpoints() {
    // Both models are then served by no endpoint; that rule stays quiet when there are no
    // endpoints at all, so the one error is the real cause.
    assert_only(&errors(&with(base(), "/endpoints", json!([]))), "endpoints", "at least one endpoint");
}

#[test]
fn hostname_address() {
    let v = with(base(), "/endpoints/1/address", json!("vllm-0.default.svc:8000"));
    assert_only(&errors(&v), "endpoints[1].address", "hostnames are not allowed");
}

#[test]
fn malformed_addresses() {
    for bad in ["10.0.0.9", "10.0.0.9:", "10.0.0.9:65536", "fd00::9:8000", "10.0.0.09:80", " 10.0.0.9:80", ""]
    {
        let v = with(base(), "/endpoints/2/address", json!(bad));
        assert_only(&errors(&v), "endpoints[2].address", "is not ip:port");
    }
}

#[test]
fn port_zero() {
    let v = with(base(), "/endpoints/0/address", json!("10.0.0.1:0"));
    assert_only(&errors(&v), "endpoints[0].address", "port must be in 1-65535");
}

#[test]
fn unspecified_address() {
    let v = with(base(), "/endpoints/0/address", json!("0.0.0.0:8000"));
    assert_only(&errors(&v), "endpoints[0].address", "unspecified address");
    let v = with(base(), "/endpoints/0/address", json!("[::]:8000"));
    assert_only(&errors(&v), "endpoints[0].address", "unspecified address");
}

#[test]
fn ipv6_zone_id() {
    let v = with(base(), "/endpoints/2/address", json!("[fe80::1%2]:8000"));
    assert_only(&errors(&v), "endpoints[2].address", "zone ids are not supported");
}

#[test]
fn good_addresses() {
    for good in ["127.0.0.1:1", "10.1.2.3:65535", "[::1]:8000", "[2001:db8::7]:443"] {
        assert!(parse(&with(base(), "/endpoints/2/address", json!(good))).is_ok(), "{good}");
    }
}

#[test]
fn duplicate_address() {
    let v = with(base(), "/endpoints/2/address", json!("10.0.0.1:8000"));
    assert_only(
        &errors(&v),
        "endpoints[2].address",
        "duplicate address 10.0.0.1:8000, first at endpoints[0].address",
    );
}

#[test]
fn duplicate_address_in_another_spelling() {
    // [fd00::3] and [fd00:0:0::3] are the same socket address: compared parsed, not as text.
    let mut v = base();
    v["endpoints"].as_array_mut().unwrap().push(json!({"address": "[fd00:0:0::3]:8000", "models": ["qwen"]}));
    assert_only(&errors(&v), "endpoints[3].address", "first at endpoints[2].address");
}

#[test]
fn endpoint_without_models() {
    let v = with(base(), "/endpoints/0/models", json!([]));
    assert_only(&errors(&v), "endpoints[0].models", "at least one model");
}

#[test]
fn endpoint_names_unknown_model() {
    let v = with(base(), "/endpoints/2/models", json!(["llama", "mistral"]));
    assert_only(&errors(&v), "endpoints[2].models[1]", "unknown model \"mistral\"");
}

#[test]
fn endpoint_names_an_adapter() {
    let v = with(base(), "/endpoints/1/models", json!(["sql-lora"]));
    assert_only(&errors(&v), "endpoints[1].models[0]", "\"sql-lora\" is an adapter of \"llama\"");
}

#[test]
fn endpoint_lists_a_model_twice() {
    let v = with(base(), "/endpoints/0/models", json!(["llama", "llama"]));
    assert_only(&errors(&v), "endpoints[0].models[1]", "listed twice");
}

// ---- models ----

#[test]
fn no_models() {
    // Every endpoint's models then name unknown models; the root cause is reported too.
    let errs = errors(&with(base(), "/models", json!([])));
    assert_has(&errs, "models", "at least one model");
    assert_has(&errs, "endpoints[0].models[0]", "unknown model \"llama\"");
}

#[test]
fn empty_model_name() {
    let v = with(base(), "/models/1/name", json!(""));
    // The endpoint that named "qwen" now names an unknown model; the empty name itself is not
    // also reported as unserved.
    let errs = errors(&v);
    assert_has(&errs, "models[1].name", "must not be empty");
    assert_has(&errs, "endpoints[2].models[1]", "unknown model \"qwen\"");
    assert_eq!(errs.len(), 2, "{errs:#?}");
}

#[test]
fn model_name_with_whitespace() {
    let v = with(base(), "/models/1/name", json!("qwen "));
    assert_has(&errors(&v), "models[1].name", "leading or trailing whitespace");
}

#[test]
fn duplicate_model_name() {
    let mut v = base();
    v["models"].as_array_mut().unwrap().push(json!({"name": "qwen"}));
    assert_only(&errors(&v), "models[2].name", "duplicate model name \"qwen\", first at models[1].name");
}

#[test]
fn model_name_collides_with_adapter() {
    // "qwen" is a base model and also an adapter of llama.
    let v = with(base(), "/models/0/adapters", json!(["sql-lora", "qwen"]));
    assert_only(
        &errors(&v),
        "models[1].name",
        "model name \"qwen\" is also an adapter name, at models[0].adapters[1]",
    );
}

#[test]
fn duplicate_adapter_across_models() {
    let v = with(base(), "/models/1/adapters", json!(["chat-lora"]));
    assert_only(
        &errors(&v),
        "models[1].adapters[0]",
        "duplicate adapter name \"chat-lora\", first at models[0].adapters[1]",
    );
}

#[test]
fn duplicate_adapter_within_a_model() {
    let v = with(base(), "/models/0/adapters", json!(["sql-lora", "chat-lora", "sql-lora"]));
    assert_only(&errors(&v), "models[0].adapters[2]", "first at models[0].adapters[0]");
}

#[test]
fn empty_adapter_name() {
    let v = with(base(), "/models/0/adapters", json!(["sql-lora", ""]));
    assert_only(&errors(&v), "models[0].adapters[1]", "must not be empty");
}

#[test]
fn model_served_by_no_endpoint_is_allowed() {
    // Discovery may add its endpoints later; until then its requests get 503 no_endpoint.
    let v = with(base(), "/endpoints/2/models", json!(["llama"]));
    assert!(parse(&v).is_ok());
}

// ---- poller ----

#[test]
fn poller_interval_bounds() {
    let v = with(base(), "/poller", json!({"interval_ms": 9}));
    assert_only(&errors(&v), "poller.interval_ms", "must be at least 10, got 9");
    // 10 is the smallest allowed.
    assert!(parse(&with(base(), "/poller", json!({"interval_ms": 10}))).is_ok());
}

#[test]
fn poller_timeout_zero() {
    let v = with(base(), "/poller", json!({"timeout_ms": 0}));
    assert_only(&errors(&v), "poller.timeout_ms", "must be at least 1");
    assert!(parse(&with(base(), "/poller", json!({"timeout_ms": 1}))).is_ok());
}

#[test]
fn poller_stale_shorter_than_interval() {
    let v = with(base(), "/poller", json!({"interval_ms": 500, "stale_after_ms": 499}));
    assert_only(&errors(&v), "poller.stale_after_ms", "must be at least interval_ms (500), got 499");
    // Equal is allowed.
    assert!(parse(&with(base(), "/poller", json!({"interval_ms": 500, "stale_after_ms": 500}))).is_ok());
}

#[test]
fn poller_interval_above_default_stale_needs_stale_too() {
    // interval 2000 with the default stale_after_ms of 1000: the default does not follow.
    let v = with(base(), "/poller", json!({"interval_ms": 2000}));
    assert_only(&errors(&v), "poller.stale_after_ms", "must be at least interval_ms (2000), got 1000");
}

#[test]
fn poller_empty_cluster() {
    let v = with(base(), "/poller", json!({"cluster": ""}));
    assert_only(&errors(&v), "poller.cluster", "must not be empty");
}

#[test]
fn poller_mode_and_lease_ttl() {
    let c = parse(&base()).unwrap();
    assert_eq!((c.poller.mode, c.poller.lease_ttl_ms), (PollerMode::Singleton, 1000));
    let c = parse(&with(base(), "/poller", json!({"mode": "lease", "lease_ttl_ms": 400}))).unwrap();
    assert_eq!((c.poller.mode, c.poller.lease_ttl_ms), (PollerMode::Lease, 400));
    // The default interval is 200 ms: a ttl below two ticks would expire between renewals.
    let v = with(base(), "/poller", json!({"mode": "lease", "lease_ttl_ms": 399}));
    assert_only(&errors(&v), "poller.lease_ttl_ms", "must be at least twice interval_ms (200), got 399");
    // In singleton mode the ttl is not used, so it is not checked.
    assert!(parse(&with(base(), "/poller", json!({"interval_ms": 900, "stale_after_ms": 2000}))).is_ok());
    let v = with(base(), "/poller", json!({"mode": "Lease"}));
    assert_has(&errors(&v), "poller.mode", "unknown variant `Lease`");
}

fn discovery() -> Value {
    json!({"kubernetes": {"namespace": "inference", "selector": {"app": "vllm"}, "target_ports": [8000]}})
}

#[test]
fn discovery_allows_an_empty_static_pool() {
    let v = with(with(base(), "/endpoints", json!([])), "/discovery", discovery());
    let c = parse(&v).unwrap();
    let k = c.discovery.unwrap().kubernetes;
    assert_eq!((k.api_cluster.as_str(), k.refresh_ms), ("kubernetes_api", 5000));
    // Without discovery, an empty pool is still an error.
    assert_only(&errors(&with(base(), "/endpoints", json!([]))), "endpoints", "at least one endpoint");
}

#[test]
fn discovery_errors_have_paths() {
    let v = with(base(), "/discovery", discovery());
    let v = with(v, "/discovery/kubernetes/target_ports", json!([]));
    assert_only(&errors(&v), "discovery.kubernetes.target_ports", "needs 1 to 8 ports");
    let v =
        with(with(base(), "/discovery", discovery()), "/discovery/kubernetes/models", json!(["sql-lora"]));
    assert_only(&errors(&v), "discovery.kubernetes.models[0]", "not a base model");
    let v = with(with(base(), "/discovery", discovery()), "/discovery/kubernetes/selector", json!({}));
    assert_only(&errors(&v), "discovery.kubernetes.selector", "at least one label");
    let v = with(with(base(), "/discovery", discovery()), "/discovery/kubernetes/token_env", json!("T"));
    let v = with(v, "/discovery/kubernetes/token", json!("x"));
    assert_only(&errors(&v), "discovery.kubernetes.token", "not both");
    let v = with(with(base(), "/discovery", discovery()), "/discovery/kubernetes/port", json!(1));
    assert_has(&errors(&v), "discovery.kubernetes.port", "unknown field `port`");
}

#[test]
fn poller_metrics_path() {
    let v = with(base(), "/poller", json!({"metrics_path": ""}));
    assert_only(&errors(&v), "poller.metrics_path", "must not be empty");
    let v = with(base(), "/poller", json!({"metrics_path": "metrics"}));
    assert_only(&errors(&v), "poller.metrics_path", "must start with '/'");
    let v = with(base(), "/poller", json!({"metrics_path": "/met rics"}));
    assert_only(&errors(&v), "poller.metrics_path", "whitespace");
}

// ---- filter ----

#[test]
fn max_body_bytes_bounds() {
    let v = with(base(), "/filter", json!({"max_body_bytes": 0}));
    assert_only(&errors(&v), "filter.max_body_bytes", "must be in 1..=67108864");
    let v = with(base(), "/filter", json!({"max_body_bytes": 64 * 1024 * 1024 + 1}));
    assert_only(&errors(&v), "filter.max_body_bytes", "got 67108865");
    assert!(parse(&with(base(), "/filter", json!({"max_body_bytes": 64 * 1024 * 1024}))).is_ok());
    assert!(parse(&with(base(), "/filter", json!({"max_body_bytes": 1}))).is_ok());
}

#[test]
fn failure_mode_values() {
    let cfg = parse(&with(base(), "/filter", json!({"failure_mode": "FailOpen"}))).unwrap();
    assert_eq!(cfg.filter.failure_mode, FailureMode::FailOpen);
}

// ---- serde-level errors, with their paths ----

#[test]
fn unknown_top_level_field() {
    let mut v = base();
    v["endpoint"] = json!([]);
    assert_only(&errors(&v), "endpoint", "unknown field `endpoint`, expected one of");
}

#[test]
fn unknown_nested_field() {
    let doc = r#"{
        "version": 1,
        "endpoints": [{"address": "10.0.0.1:8000", "models": ["m"]}],
        "models": [{"name": "m"}],
        "poller": {"interval_ms": 100, "intervalms": 50}
    }"#;
    let errs = errors_str(doc);
    assert_only(&errs, "poller.intervalms", "unknown field `intervalms`, expected one of `interval_ms`");
    // serde's position is kept in the reason.
    assert!(errs[0].reason.contains("line 5"), "{errs:?}");
}

#[test]
fn unknown_field_in_an_array_element() {
    let doc = r#"{"version": 1,
        "endpoints": [{"address": "10.0.0.1:8000", "models": ["m"]},
                      {"adress": "10.0.0.2:8000", "models": ["m"]}],
        "models": [{"name": "m", "adaptors": []}]}"#;
    assert_only(&errors_str(doc), "endpoints[1].adress", "unknown field `adress`");
}

#[test]
fn unknown_field_with_an_odd_name() {
    let doc = r#"{"version": 1, "filter": {"max body": 1}, "endpoints": [], "models": []}"#;
    assert_only(&errors_str(doc), "filter[\"max body\"]", "unknown field `max body`");
}

#[test]
fn wrong_type_names_the_field() {
    let v = with(base(), "/poller", json!({"interval_ms": "200"}));
    assert_only(&errors(&v), "poller.interval_ms", "invalid type: string \"200\", expected u64");
    let v = with(base(), "/models/0/adapters", json!(["sql-lora", 3]));
    assert_only(&errors(&v), "models[0].adapters[1]", "invalid type: integer `3`, expected a string");
    let v = with(base(), "/poller", json!({"interval_ms": -1}));
    assert_only(&errors(&v), "poller.interval_ms", "invalid value: integer `-1`");
}

#[test]
fn unknown_enum_variant() {
    let v = with(base(), "/filter", json!({"failure_mode": "Failopen"}));
    assert_only(
        &errors(&v),
        "filter.failure_mode",
        "unknown variant `Failopen`, expected `FailOpen` or `FailClose`",
    );
}

#[test]
fn missing_required_field_names_the_object() {
    let v = with(base(), "/endpoints/1", json!({"models": ["llama"]}));
    assert_only(&errors(&v), "endpoints[1]", "missing field `address`");
    let mut v = base();
    v.as_object_mut().unwrap().remove("models");
    assert_only(&errors(&v), "$", "missing field `models`");
}

#[test]
fn duplicate_key() {
    let doc = r#"{"version": 1, "endpoints": [], "models": [], "models": []}"#;
    assert_only(&errors_str(doc), "models", "duplicate field `models`");
}

#[test]
fn syntax_error_keeps_line_and_column() {
    let doc = "{\"version\": 1,\n \"endpoints\": [,]}";
    let errs = errors_str(doc);
    assert_eq!(errs.len(), 1);
    assert_eq!(errs[0].path, "endpoints[0]");
    assert!(errs[0].reason.contains("line 2 column"), "{errs:?}");
}

#[test]
fn syntax_errors_point_into_the_document() {
    // A trailing comma inside the second endpoint: the path is that endpoint.
    let doc = r#"{"version": 1, "endpoints": [{"address": "10.0.0.1:80", "models": ["m"]},
        {"address": "10.0.0.2:80", "models": ["m"],}], "models": [{"name": "m"}]}"#;
    assert_only(&errors_str(doc), "endpoints[1]", "trailing comma");
    // A missing value after a key.
    let doc = r#"{"version": 1, "poller": {"interval_ms": }}"#;
    assert_only(&errors_str(doc), "poller.interval_ms", "expected value");
    // Truncated: the path is where the document ended.
    let doc = r#"{"version": 1, "models": [{"name": "m""#;
    assert_only(&errors_str(doc), "models[0].name", "EOF while parsing");
}

#[test]
fn empty_document() {
    assert_only(&errors_str(""), "$", "found nothing: the configuration is empty");
    assert_only(&errors_str(" \n"), "$", "found nothing: the configuration is empty");
}

#[test]
fn not_an_object() {
    // A double-encoded document arrives as one JSON string.
    assert_only(
        &errors_str(r#""{\"version\": 1}""#),
        "$",
        "found a string (is the configuration JSON-encoded twice?)",
    );
    assert_only(&errors_str("[1, [], []]"), "$", "found an array");
}

// ---- collect-all ----

#[test]
fn all_errors_are_reported_at_once() {
    let v = with(base(), "/endpoints/0/address", json!("localhost:8000"));
    let v = with(v, "/poller", json!({"interval_ms": 5, "metrics_path": "metrics"}));
    let v = with(v, "/filter", json!({"max_body_bytes": 0}));
    let errs = errors(&v);
    let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
    // Sections in order: models, endpoints, poller, filter.
    assert_eq!(
        paths,
        ["endpoints[0].address", "poller.interval_ms", "poller.metrics_path", "filter.max_body_bytes"]
    );
}

#[test]
fn describe_errors_is_one_line() {
    let errs = vec![ConfigError::new("a", "x"), ConfigError::new("b[0]", "y")];
    assert_eq!(describe_errors(&errs), "invalid configuration (2 errors): a: x; b[0]: y");
    assert_eq!(describe_errors(&errs[..1]), "invalid configuration (1 error): a: x");
}

// ---- robustness: the error path never panics ----

#[test]
fn every_truncation_of_a_valid_document_is_an_error_with_a_path() {
    let doc = serde_json::to_string_pretty(&with(base(), "/poller", json!({"interval_ms": 100}))).unwrap();
    for cut in 0..doc.len() {
        let errs = errors_str(&doc[..cut]);
        assert_eq!(errs.len(), 1, "cut at {cut}: {errs:?}");
        assert!(!errs[0].path.is_empty(), "cut at {cut}");
    }
}

proptest::proptest! {
    #[test]
    fn arbitrary_input_never_panics(doc in r#"\{[{}\[\]",:\\ a-z0-9.]{0,64}"#) {
        // Starts with `{` so that most inputs get past the object check into serde and the locator.
        // Only the outcome's shape is checked: Ok, or errors that each have a path and a reason.
        if let Err(errs) = Config::from_json(doc.as_bytes()) {
            proptest::prop_assert!(!errs.is_empty());
            for e in errs {
                proptest::prop_assert!(!e.path.is_empty() && !e.reason.is_empty());
            }
        }
    }
}

#[test]
fn passthrough_prefixes_must_be_paths_that_cover_no_inference_path() {
    let v = with(base(), "/filter", json!({"passthrough_prefixes": ["admin"]}));
    assert_only(&errors(&v), "filter.passthrough_prefixes[0]", "must start with '/'");
    let v = with(base(), "/filter", json!({"passthrough_prefixes": ["/ok", "/x?y"]}));
    assert_only(&errors(&v), "filter.passthrough_prefixes[1]", "without query");
    for bad in ["/", "/v1", "/v1/", "/v1/chat/completions"] {
        let v = with(base(), "/filter", json!({"passthrough_prefixes": [bad]}));
        assert_only(&errors(&v), "filter.passthrough_prefixes[0]", "covers the inference path");
    }
    let cfg =
        parse(&with(base(), "/filter", json!({"passthrough_prefixes": ["/v1/models", "/admin"]}))).unwrap();
    assert_eq!(cfg.filter.passthrough_prefixes.len(), 2);
    // The token count is routed, but not a generation: a configuration that sends it to a backend
    // of its own stays valid.
    parse(&with(base(), "/filter", json!({"passthrough_prefixes": ["/v1/messages/count_tokens"]}))).unwrap();
    assert!(!cfg.filter.expose_served_endpoint);
    let cfg = parse(&with(base(), "/filter", json!({"expose_served_endpoint": true}))).unwrap();
    assert!(cfg.filter.expose_served_endpoint);
}

// ---- health ----

#[test]
fn health_defaults_and_bad_fields() {
    let cfg = parse(&base()).unwrap();
    assert_eq!(cfg.health, crate::state::health::HealthConfig::default());
    assert_eq!((cfg.health.consecutive_5xx, cfg.health.startup_wait_ms), (3, 1000));
    let v = with(base(), "/health", serde_json::json!({"base_ejection_ms": 1000, "max_ejection_ms": 10}));
    assert_only(&errors(&v), "health.max_ejection_ms", "at least base_ejection_ms");
    let v = with(base(), "/health", serde_json::json!({"startup_wait_ms": 600000}));
    assert_only(&errors(&v), "health.startup_wait_ms", "at most 60000");
    // A typo is an unknown field, not a silent default.
    let v = with(base(), "/health", serde_json::json!({"consecutive_500": 3}));
    assert!(parse(&v).is_err());
}

#[test]
fn max_response_bytes_bounds_and_default() {
    assert_eq!(parse(&base()).unwrap().poller.max_response_bytes, 4 * 1024 * 1024);
    let v = with(base(), "/poller", json!({"max_response_bytes": 1023}));
    assert_only(&errors(&v), "poller.max_response_bytes", "must be in 1024..=67108864");
    let v = with(base(), "/poller", json!({"max_response_bytes": 64 * 1024 * 1024 + 1}));
    assert_only(&errors(&v), "poller.max_response_bytes", "got 67108865");
    assert!(parse(&with(base(), "/poller", json!({"max_response_bytes": 1024}))).is_ok());
}

#[test]
fn endpoint_metrics_is_off_by_default() {
    assert!(!parse(&base()).unwrap().filter.endpoint_metrics);
    assert!(
        parse(&with(base(), "/filter", json!({"endpoint_metrics": true}))).unwrap().filter.endpoint_metrics
    );
}

#[test]
fn pool_is_optional_named_and_strict() {
    assert_eq!(parse(&base()).unwrap().pool, None);
    let cfg = parse(&with(base(), "/pool", json!({"name": "llama", "route_by_model": true}))).unwrap();
    let p = cfg.pool.unwrap();
    assert_eq!((p.name.as_str(), p.route_by_model), ("llama", true));
    // route_by_model defaults to false.
    assert!(!parse(&with(base(), "/pool", json!({"name": "a"}))).unwrap().pool.unwrap().route_by_model);
    let v = with(base(), "/pool", json!({"name": "Llama Pool"}));
    assert_only(&errors(&v), "pool.name", "not a pool name");
    // A typo is an unknown field, not a silent default.
    assert!(parse(&with(base(), "/pool", json!({"name": "a", "route_by_models": true}))).is_err());
    assert!(parse(&with(base(), "/pool", json!({"route_by_model": true}))).is_err());
}

#[test]
fn predicted_objective_fields_are_checked() {
    let c = parse(&base()).unwrap();
    assert_eq!(c.scheduler.objective, crate::scheduler::config::Objective::PredictedTtft);
    let w = parse(&with(base(), "/scheduler", json!({"objective": "weighted"}))).unwrap();
    assert_eq!(w.scheduler.objective, crate::scheduler::config::Objective::Weighted);
    assert!(parse(&with(base(), "/scheduler", json!({"objective": "fastest"}))).is_err());
    let bad = |field: &str, v: Value| errors(&with(base(), "/scheduler", json!({"predicted": {field: v}})));
    assert_only(&bad("affinity_slack", json!(-0.1)), "scheduler.predicted.affinity_slack", "0..=10");
    assert_only(&bad("rendezvous_blocks", json!(5000)), "scheduler.predicted.rendezvous_blocks", "0..=4096");
    assert_only(&bad("prior_ms_per_token", json!(0.0)), "scheduler.predicted.prior_ms_per_token", "0.000001");
    assert_only(&bad("active_weight", json!(101.0)), "scheduler.predicted.active_weight", "0..=100");
    assert_only(&bad("miss_weight", json!(-1.0)), "scheduler.predicted.miss_weight", "0..=100");
    assert_only(&bad("rendezvous_credit", json!(1.5)), "scheduler.predicted.rendezvous_credit", "0..=1");
    assert_only(&bad("kv_full_at", json!(1.0)), "scheduler.predicted.kv_full_at", "0..=0.99");
    assert_only(&bad("kv_full_at", json!(-0.1)), "scheduler.predicted.kv_full_at", "0..=0.99");
    assert_eq!(c.scheduler.predicted.kv_full_at, 0.8);
    let off = parse(&with(base(), "/scheduler", json!({"predicted": {"kv_full_at": 0}}))).unwrap();
    assert_eq!(off.scheduler.predicted.kv_full_at, 0.0);
    assert!(!errors(&with(base(), "/scheduler", json!({"predicted": {"nope": 1}}))).is_empty());
}

#[test]
fn poller_adaptive_fields() {
    let cfg = parse(&base()).unwrap();
    assert_eq!(
        (cfg.poller.idle_interval_ms, cfg.poller.max_scrapes_per_s, cfg.poller.replicas),
        (5000, 2000, 1)
    );
    let v = with(base(), "/poller", json!({"interval_ms": 500, "idle_interval_ms": 499}));
    assert_only(&errors(&v), "poller.idle_interval_ms", "must be at least interval_ms (500), got 499");
    assert!(parse(&with(base(), "/poller", json!({"interval_ms": 500, "idle_interval_ms": 500}))).is_ok());
    let v = with(base(), "/poller", json!({"max_scrapes_per_s": 0}));
    assert_only(&errors(&v), "poller.max_scrapes_per_s", "must be at least 1");
    let v = with(base(), "/poller", json!({"replicas": 0}));
    assert_only(&errors(&v), "poller.replicas", "must be in 1..=1000, got 0");
    let v = with(base(), "/poller", json!({"replicas": 1001}));
    assert_only(&errors(&v), "poller.replicas", "must be in 1..=1000, got 1001");
    assert!(parse(&with(base(), "/poller", json!({"replicas": 8}))).is_ok());
}

// ---- the reader (`read.rs`) through the whole document ----

#[test]
fn reader_errors_name_nested_paths() {
    let v = with(base(), "/scheduler", json!({"weights": {"queue": "high"}}));
    assert_only(&errors(&v), "scheduler.weights.queue", "invalid type: string \"high\", expected f64");
    let v = with(base(), "/scheduler", json!({"model_weights": {"org/m": {"queue": 1, "qeue": 2}}}));
    assert_only(
        &errors(&v),
        "scheduler.model_weights[\"org/m\"].qeue",
        "unknown field `qeue`, expected one of",
    );
    let v = with(base(), "/scheduler", json!({"rewrites": [{"targets": []}, {"matches": []}]}));
    assert_only(&errors(&v), "scheduler.rewrites[1]", "missing field `targets`");
    let v = with(
        base(),
        "/scheduler",
        json!({"rewrites": [{"matches": [{"model": {"type": "Prefix", "value": "x"}}], "targets": []}]}),
    );
    assert_only(
        &errors(&v),
        "scheduler.rewrites[0].matches[0].model.type",
        "unknown variant `Prefix`, expected `Exact`",
    );
    let v = with(
        with(base(), "/discovery", discovery()),
        "/discovery/kubernetes/target_ports",
        json!([8000, 70000]),
    );
    assert_only(
        &errors(&v),
        "discovery.kubernetes.target_ports[1]",
        "invalid value: integer `70000`, expected u16",
    );
}

#[test]
fn reader_integers_are_whole_and_in_range() {
    let v = with(base(), "/poller", json!({"replicas": 4_294_967_296u64}));
    assert_only(&errors(&v), "poller.replicas", "invalid value: integer `4294967296`, expected u32");
    let v = with(base(), "/poller", json!({"interval_ms": 250.5}));
    assert_only(&errors(&v), "poller.interval_ms", "invalid type: floating point `250.5`, expected u64");
    let v = with(base(), "/poller", json!({"interval_ms": 250.0}));
    assert_only(&errors(&v), "poller.interval_ms", "invalid type: floating point `250.0`, expected u64");
    let v = with(base(), "/priority", json!({"objectives": [{"name": "a", "priority": -2_147_483_649i64}]}));
    assert_only(
        &errors(&v),
        "priority.objectives[0].priority",
        "invalid value: integer `-2147483649`, expected i32",
    );
    // A float field takes an integer.
    let c = parse(&with(base(), "/scheduler", json!({"weights": {"queue": 2}}))).unwrap();
    assert_eq!(c.scheduler.weights.queue, 2.0);
}

#[test]
fn reader_errors_carry_line_and_column() {
    let doc =
        "{\"version\": 1,\n \"endpoints\": [],\n \"models\": [{\"name\": \"m\", \"adapters\": [\"a\", 7]}]}";
    let errs = errors_str(doc);
    assert_only(&errs, "models[0].adapters[1]", "expected a string at line 3 column 45");
    let doc = "{\"version\": 1,\n \"endpoints\": [{\"models\": [\"m\"]}], \"models\": []}";
    assert_only(&errors_str(doc), "endpoints[0]", "missing field `address` at line 2 column 16");
}

#[test]
fn a_struct_must_be_an_object() {
    // serde's derive also took a struct written as an array of its fields (`"filter": []`).
    let v = with(base(), "/filter", json!([]));
    assert_only(&errors(&v), "filter", "invalid type: sequence, expected an object");
    let v = with(base(), "/pd", json!("on"));
    assert_only(&errors(&v), "pd", "invalid type: string \"on\", expected an object");
    // null is "not set" for an optional section, as before.
    assert_eq!(parse(&with(base(), "/pd", json!(null))).unwrap().pd, None);
}

#[test]
fn duplicate_keys_anywhere_are_errors() {
    let doc = r#"{"version": 1, "endpoints": [], "models": [{"name": "m"}],
        "discovery": {"kubernetes": {"namespace": "n", "selector": {"app": "a", "app": "b"}, "target_ports": [80]}}}"#;
    assert_only(&errors_str(doc), "discovery.kubernetes.selector.app", "duplicate field `app` at line 2");
    let doc = r#"{"version": 1, "endpoints": [], "models": [{"name": "m", "name": "n"}]}"#;
    assert_only(&errors_str(doc), "models[0].name", "duplicate field `name`");
    // The same key in two objects is not a duplicate.
    let doc = r#"{"version": 1, "endpoints": [{"address": "10.0.0.1:80", "models": ["m"]},
        {"address": "10.0.0.2:80", "models": ["m"]}], "models": [{"name": "m"}]}"#;
    assert!(Config::from_json(doc.as_bytes()).is_ok());
}

// ---- peers ----

fn with_peers(p: Value) -> Value {
    let mut v = base();
    v["peers"] = p;
    v
}

#[test]
fn peers_defaults_and_token_resolution() {
    let cfg = parse(&with_peers(json!({"addresses": ["10.1.0.2:8080"], "token_env": "PEER_TOKEN"}))).unwrap();
    let p = cfg.peers.unwrap();
    assert_eq!(p.path, "/.inference-picker/v1/prefixes");
    assert_eq!((p.interval_ms, p.timeout_ms), (1000, 1000));
    assert_eq!(p.resolve_token(|n| (n == "PEER_TOKEN").then(|| "x".repeat(16))), Some("x".repeat(16)));
    // Unset or too short: no token, so nothing is sent or accepted.
    assert_eq!(p.resolve_token(|_| None), None);
    assert_eq!(p.resolve_token(|_| Some("short".into())), None);
    assert!(parse(&base()).unwrap().peers.is_none());
}

#[test]
fn peers_rules() {
    let ok_token = "0123456789abcdef";
    assert_only(
        &errors(&with_peers(json!({"addresses": [], "token": ok_token}))),
        "peers.addresses",
        "find them with `kubernetes`",
    );
    let many: Vec<String> = (0..65).map(|i| format!("10.1.0.{i}:8080")).collect();
    assert_only(
        &errors(&with_peers(json!({"addresses": many, "token": ok_token}))),
        "peers.addresses",
        "at most 64",
    );
    assert_only(
        &errors(&with_peers(json!({"addresses": ["peer.local:80"], "token": ok_token}))),
        "peers.addresses[0]",
        "",
    );
    assert_only(
        &errors(&with_peers(json!({"addresses": ["10.1.0.2:8080"]}))),
        "peers.token",
        "needs a shared token",
    );
    assert_only(
        &errors(&with_peers(json!({"addresses": ["10.1.0.2:8080"], "token": "short"}))),
        "peers.token",
        "at least 16 bytes",
    );
    assert_only(
        &errors(&with_peers(json!({"addresses": ["10.1.0.2:8080"], "token": ok_token, "token_env": "T"}))),
        "peers.token",
        "not both",
    );
    assert_only(
        &errors(&with_peers(json!({"addresses": ["10.1.0.2:8080"], "token_env": "NOT-A-NAME"}))),
        "peers.token_env",
        "not an environment variable name",
    );
    for path in ["/v1/chat/completions", "/v1", "/healthz", "/v1/models"] {
        assert_only(
            &errors(&with_peers(json!({"addresses": ["10.1.0.2:8080"], "token": ok_token, "path": path}))),
            "peers.path",
            "filter serves itself",
        );
    }
    assert_only(
        &errors(&with_peers(json!({"addresses": ["10.1.0.2:8080"], "token": ok_token, "path": "/x?y=1"}))),
        "peers.path",
        "without a query",
    );
    assert_only(
        &errors(&with_peers(
            json!({"addresses": ["10.1.0.2:8080"], "token": ok_token, "interval_ms": 50, "timeout_ms": 50}),
        )),
        "peers.interval_ms",
        "100 to 60000",
    );
    assert_only(
        &errors(&with_peers(json!({"addresses": ["10.1.0.2:8080"], "token": ok_token, "timeout_ms": 2000}))),
        "peers.timeout_ms",
        "1 to interval_ms",
    );
    let mut v = with_peers(json!({"addresses": ["10.1.0.2:8080"], "token": ok_token}));
    v["filter"] = json!({"passthrough_prefixes": ["/.inference-picker"]});
    assert_only(&errors(&v), "peers.path", "passthrough_prefixes");
}

#[test]
fn peers_found_through_kubernetes() {
    let k = json!({"namespace": "gw", "selector": {"app": "gateway"}, "target_ports": [8080], "token_env": "K8S_TOKEN"});
    let cfg = parse(&with_peers(json!({"kubernetes": k, "token": "0123456789abcdef"}))).unwrap();
    assert!(cfg.peers.unwrap().addresses.is_empty());
    // A model of `models`, so that the only complaint is that peers serve none.
    let mut bad = k.clone();
    bad["models"] = json!(["llama"]);
    assert_only(
        &errors(&with_peers(json!({"kubernetes": bad, "token": "0123456789abcdef"}))),
        "peers.kubernetes.models",
        "must be empty",
    );
    let mut no_sel = k.clone();
    no_sel["selector"] = json!({});
    assert_only(
        &errors(&with_peers(json!({"kubernetes": no_sel, "token": "0123456789abcdef"}))),
        "peers.kubernetes.selector",
        "at least one label",
    );
    assert_only(
        &errors(&with_peers(json!({"token": "0123456789abcdef"}))),
        "peers.addresses",
        "find them with `kubernetes`",
    );
}

#[test]
fn peers_authority() {
    let ok =
        json!({"addresses": ["10.1.0.2:8080"], "token": "0123456789abcdef", "authority": "llm.example.com"});
    assert_eq!(parse(&with_peers(ok)).unwrap().peers.unwrap().authority.as_deref(), Some("llm.example.com"));
    for bad in ["", "a b", "host/path", "user@host"] {
        let v = json!({"addresses": ["10.1.0.2:8080"], "token": "0123456789abcdef", "authority": bad});
        assert_only(&errors(&with_peers(v)), "peers.authority", "host name");
    }
}

/// `peers.load_interval_ms` was removed (replicas exchange placements, not load): a document
/// that still sets it, to any value, is refused with an error that says so.
#[test]
fn the_removed_load_interval_is_refused_as_removed() {
    for value in [json!(0), json!(100), json!("x")] {
        let v = with_peers(
            json!({"addresses": ["10.1.0.2:8080"], "token": "0123456789abcdef", "load_interval_ms": value}),
        );
        assert_only(&errors(&v), "peers.load_interval_ms", "was removed");
    }
    // The same name elsewhere is an ordinary unknown field.
    let mut v = base();
    v["poller"] = json!({"load_interval_ms": 100});
    assert_has(&errors(&v), "poller.load_interval_ms", "unknown field `load_interval_ms`");
}

/// What [`check_defaults`] found: the defaults it compared (`definition.property`) and those
/// that differ from the code.
#[derive(Default)]
struct Found {
    seen: Vec<String>,
    bad: Vec<String>,
}

/// Walks `schema` (resolving `$ref` and `anyOf` against `defs`) beside the value the code
/// applied (`applied`, the parsed document serialised back) and the document as written
/// (`given`): every property the document left out must hold the schema's `default`. `def` is
/// the name of the definition being walked ("root" at the top).
fn check_defaults(
    schema: &Value,
    def: &str,
    defs: &Value,
    given: Option<&Value>,
    applied: &Value,
    path: &str,
    found: &mut Found,
) {
    let (schema, def) = match schema.get("$ref").and_then(Value::as_str) {
        Some(r) => {
            let name = r.trim_start_matches("#/$defs/");
            (&defs[name], name)
        }
        None => (schema, def),
    };
    // A section the serialiser leaves out when it is its default (`skip_serializing_if`).
    let skipped_default = match def {
        "RoleSelectors" if applied.is_null() => {
            Some(serde_json::to_value(crate::poll::config::RoleSelectors::default()).unwrap())
        }
        _ => None,
    };
    let applied = skipped_default.as_ref().unwrap_or(applied);
    // An optional section left out: nothing applied, so no default to compare.
    if applied.is_null() {
        return;
    }
    if let Some(alts) = schema.get("anyOf").or_else(|| schema.get("oneOf")).and_then(Value::as_array) {
        for alt in alts.iter().filter(|a| a.get("type").and_then(Value::as_str) != Some("null")) {
            check_defaults(alt, def, defs, given, applied, path, found);
        }
        return;
    }
    if let (Some(items), Some(values)) = (schema.get("items"), applied.as_array()) {
        for (i, v) in values.iter().enumerate() {
            let g = given.and_then(|g| g.get(i));
            check_defaults(items, def, defs, g, v, &format!("{path}[{i}]"), found);
        }
        return;
    }
    if let (Some(values), Some(extra)) = (applied.as_object(), schema.get("additionalProperties")) {
        if extra.is_object() && schema.get("properties").is_none() {
            for (k, v) in values {
                let g = given.and_then(|g| g.get(k));
                check_defaults(extra, def, defs, g, v, &format!("{path}.{k}"), found);
            }
            return;
        }
    }
    let Some(props) = schema.get("properties").and_then(Value::as_object) else { return };
    for (name, prop) in props {
        let here = if path.is_empty() { name.clone() } else { format!("{path}.{name}") };
        let g = given.and_then(|g| g.get(name));
        let a = applied.get(name).unwrap_or(&Value::Null);
        if g.is_none() {
            if let Some(d) = prop.get("default") {
                found.seen.push(format!("{def}.{name}"));
                if d != a {
                    found.bad.push(format!("{here}: schema default {d}, code applies {a}"));
                }
            }
        }
        check_defaults(prop, def, defs, g, a, &here, found);
    }
}

/// Every `definition.property` of the schema that states a default.
fn stated_defaults(schema: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let mut add = |def: &str, node: &Value| {
        for (name, prop) in node.get("properties").and_then(Value::as_object).into_iter().flatten() {
            if prop.get("default").is_some() {
                out.push(format!("{def}.{name}"));
            }
        }
    };
    add("root", schema);
    for (def, node) in schema["$defs"].as_object().into_iter().flatten() {
        add(def, node);
    }
    out.sort();
    out
}

#[test]
fn every_default_in_the_schema_is_what_the_code_applies() {
    let schema: Value =
        serde_json::from_str(include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/filter-config/schema.json")))
            .unwrap();
    let defs = &schema["$defs"];
    // The base document, each optional section given with only what it requires, and every
    // shipped example, so that every field one of them leaves out takes its default.
    let mut docs = vec![base()];
    let token = "0123456789abcdef0123";
    for (section, value) in [
        ("flow_control", json!({})),
        ("health", json!({})),
        ("saturation", json!({})),
        ("priority", json!({})),
        ("scheduler", json!({})),
        ("filter", json!({})),
        ("poller", json!({})),
        ("peers", json!({"addresses": ["10.1.0.2:8080"], "token": token})),
        ("pod_models", json!({})),
    ] {
        let mut v = base();
        v[section] = value;
        docs.push(v);
    }
    // Sections whose defaults only show when a required neighbour is given instead.
    let kubernetes = json!({"namespace": "n", "selector": {"app": "a"}, "target_ports": [8000]});
    let mut with_roles = kubernetes.clone();
    with_roles["roles"] = json!({});
    with_roles["token"] = json!("k8s-token");
    for (section, value) in [
        ("discovery", json!({"kubernetes": with_roles})),
        ("peers", json!({"kubernetes": kubernetes, "token_env": "PEER_TOKEN"})),
        ("pd", json!({})),
        ("pool", json!({"name": "llama"})),
        (
            "priority",
            json!({"tier": {"header": "x-llm-tier", "values": {"premium": 10}, "slo": {"premium": {"ttft_ms": 500}}}}),
        ),
        ("scheduler", json!({"rewrites": [{"targets": [{"model_rewrite": "llama", "weight": 1}]}]})),
    ] {
        let mut v = base();
        v[section] = value;
        docs.push(v);
    }
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("filter-config/examples");
    let mut files: Vec<_> = std::fs::read_dir(&examples).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    for f in files.iter().filter(|f| f.extension().is_some_and(|x| x == "json")) {
        docs.push(serde_json::from_slice(&std::fs::read(f).unwrap()).unwrap());
    }
    let mut found = Found::default();
    for doc in &docs {
        let applied = serde_json::to_value(parse(doc).unwrap_or_else(|e| panic!("{doc}: {e:?}"))).unwrap();
        check_defaults(&schema, "root", defs, Some(doc), &applied, "", &mut found);
    }
    let Found { mut seen, mut bad } = found;
    bad.sort();
    bad.dedup();
    assert!(bad.is_empty(), "schema defaults that differ from the code:\n{}", bad.join("\n"));
    // Every default the schema states was compared.
    seen.sort();
    seen.dedup();
    let missed: Vec<_> = stated_defaults(&schema).into_iter().filter(|d| !seen.contains(d)).collect();
    assert!(missed.is_empty(), "defaults no document left out, so never compared: {missed:?}");
    // A planted drift is caught.
    let mut drifted = schema.clone();
    drifted["$defs"]["FlowControlConfig"]["properties"]["enabled"]["default"] = json!(true);
    let mut caught = Found::default();
    let doc = &docs[1];
    let applied = serde_json::to_value(parse(doc).unwrap()).unwrap();
    let drifted_defs = drifted["$defs"].clone();
    check_defaults(&drifted, "root", &drifted_defs, Some(doc), &applied, "", &mut caught);
    assert_eq!(caught.bad, vec!["flow_control.enabled: schema default true, code applies false".to_string()]);
}
