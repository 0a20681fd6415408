//! Keeps `filter-config/` honest: the committed schema equals the one generated from the Rust
//! types, every example is accepted by both the schema and `Config::from_json`, documents the Rust
//! side rejects at parse time are rejected by the schema too, and the README documents every field.

use std::path::{Path, PathBuf};

use inference_picker::config::Config;
use serde_json::{json, Value};

fn filter_config_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../filter-config")
}

fn committed_schema() -> Value {
    let text = std::fs::read_to_string(filter_config_dir().join("schema.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn validator() -> jsonschema::Validator {
    jsonschema::validator_for(&committed_schema()).unwrap()
}

/// Every `*.json` in filter-config/examples, sorted, so a new example is covered without editing
/// this test.
fn examples() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(filter_config_dir().join("examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    files
}

#[test]
fn committed_schema_matches_the_rust_types() {
    let committed = std::fs::read_to_string(filter_config_dir().join("schema.json")).unwrap();
    assert!(
        committed == config_schema::schema_json(),
        "filter-config/schema.json is out of date; regenerate it with\n  \
         cargo run -q -p config-schema > filter-config/schema.json"
    );
}

#[test]
fn schema_denies_unknown_fields_everywhere() {
    // Every object schema (the root and each $def that is an object) is closed, as serde's
    // deny_unknown_fields is on every struct.
    let schema = committed_schema();
    let mut objects = vec![("$".to_string(), &schema)];
    for (name, def) in schema["$defs"].as_object().unwrap() {
        if def["type"] == "object" {
            objects.push((name.clone(), def));
        }
    }
    assert!(objects.len() >= 5, "{objects:?}");
    for (name, obj) in objects {
        assert_eq!(obj["additionalProperties"], json!(false), "{name} allows unknown properties");
    }
}

#[test]
fn every_example_is_valid_for_rust_and_for_the_schema() {
    let files = examples();
    // minimal, three-sims and fail-open at least; an empty directory must not pass.
    assert!(files.len() >= 3, "{files:?}");
    let validator = validator();
    for path in files {
        let bytes = std::fs::read(&path).unwrap();
        if let Err(errs) = Config::from_json(&bytes) {
            panic!("{}: {errs:#?}", path.display());
        }
        let doc: Value = serde_json::from_slice(&bytes).unwrap();
        let schema_errors: Vec<String> = validator.iter_errors(&doc).map(|e| e.to_string()).collect();
        assert!(schema_errors.is_empty(), "{}: {schema_errors:#?}", path.display());
    }
}

fn minimal() -> Value {
    serde_json::from_slice(&std::fs::read(filter_config_dir().join("examples/minimal.json")).unwrap())
        .unwrap()
}

#[test]
fn schema_and_rust_reject_the_same_parse_level_mistakes() {
    let validator = validator();
    let mut cases: Vec<(&str, Value)> = Vec::new();

    let mut v = minimal();
    v["poller"] = json!({"intervalms": 50});
    cases.push(("nested unknown field", v));

    let mut v = minimal();
    v["endpoints"][0]["adress"] = json!("10.0.0.8:8000");
    cases.push(("unknown field in an array element", v));

    let mut v = minimal();
    v["version"] = json!(2);
    cases.push(("wrong version", v));

    let mut v = minimal();
    v.as_object_mut().unwrap().remove("models");
    cases.push(("missing required field", v));

    let mut v = minimal();
    v["filter"] = json!({"failure_mode": "Failopen"});
    cases.push(("unknown enum variant", v));

    let mut v = minimal();
    v["poller"] = json!({"interval_ms": "200"});
    cases.push(("wrong type", v));

    for (what, doc) in cases {
        assert!(!validator.is_valid(&doc), "schema accepted: {what}");
        assert!(Config::from_json(&serde_json::to_vec(&doc).unwrap()).is_err(), "Rust accepted: {what}");
    }
}

#[test]
fn schema_mirrors_the_simple_bounds() {
    // Bounds both sides check; values just outside each bound, hand-picked from config.rs.
    let validator = validator();
    let cases = [
        ("/poller", json!({"interval_ms": 9})),
        ("/poller", json!({"timeout_ms": 0})),
        ("/poller", json!({"metrics_path": "metrics"})),
        ("/poller", json!({"cluster": ""})),
        ("/filter", json!({"max_body_bytes": 0})),
        ("/filter", json!({"max_body_bytes": 67108865})),
        ("/endpoints", json!([])),
        ("/models", json!([])),
        ("/saturation", json!({"queue_threshold": 0})),
        ("/saturation", json!({"kv_threshold": 0})),
        ("/flow_control", json!({"max_wait_ms": 0})),
        ("/flow_control", json!({"max_queue": 0})),
        ("/flow_control", json!({"worker_ttl_ms": 299})),
        ("/priority", json!({"objectives": [{"name": ""}]})),
        ("/priority", json!({"tier": {"header": "X-Tier", "values": {"gold": 1}}})),
        ("/priority", json!({"tier": {"header": "x-tier", "values": {}}})),
    ];
    for (pointer, value) in cases {
        let mut doc = minimal();
        let key = pointer.trim_start_matches('/');
        doc[key] = value.clone();
        assert!(!validator.is_valid(&doc), "schema accepted {pointer} = {value}");
        assert!(
            Config::from_json(&serde_json::to_vec(&doc).unwrap()).is_err(),
            "Rust accepted {pointer} = {value}"
        );
    }
}

/// Every field path in the schema (`poller.interval_ms`, `endpoints[].address`), depth first.
fn field_paths(schema: &Value, node: &Value, prefix: &str, out: &mut Vec<String>) {
    let node = match node.get("$ref").and_then(Value::as_str) {
        Some(r) => &schema["$defs"][r.trim_start_matches("#/$defs/")],
        None => node,
    };
    if let Some(props) = node.get("properties").and_then(Value::as_object) {
        for (name, prop) in props {
            let path = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
            out.push(path.clone());
            field_paths(schema, prop, &path, out);
        }
    }
    if let Some(items) = node.get("items") {
        field_paths(schema, items, &format!("{prefix}[]"), out);
    }
    // An optional struct (`Option<T>`) is `anyOf: [{$ref: T}, {type: null}]`.
    for alternative in node.get("anyOf").and_then(Value::as_array).into_iter().flatten() {
        field_paths(schema, alternative, prefix, out);
    }
}

#[test]
fn readme_documents_every_field() {
    let schema = committed_schema();
    let mut paths = Vec::new();
    field_paths(&schema, &schema, "", &mut paths);
    // version, endpoints (+2), models (+2), poller (+5), filter (+2).
    assert!(paths.len() >= 16, "{paths:?}");
    let readme = std::fs::read_to_string(filter_config_dir().join("README.md")).unwrap();
    let missing: Vec<&String> = paths.iter().filter(|p| !readme.contains(&format!("`{p}`"))).collect();
    assert!(missing.is_empty(), "filter-config/README.md does not document {missing:?}");
}
