//! Keeps `filter-config/` and `docs/configuration.md` honest: the committed schema and reference
//! equal the ones generated from the `settings!` declarations, the two agree field by field
//! (defaults, bounds, docs, required fields) and every default a doc states is the declared one,
//! every example is accepted by both the schema and `Config::from_json`, and documents the Rust
//! side rejects at parse time are rejected by the schema too.

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
        ("/scheduler", json!({"fallbacks": 17})),
        ("/scheduler", json!({"top_k": 0})),
        ("/scheduler", json!({"prefix": {"block_chars": 15}})),
        ("/scheduler", json!({"guard": {"ratio": 0.5}})),
        ("/health", json!({"failure_rate_percent": 101})),
        ("/pd", json!({"pd_threshold_tokens": 10_000_001})),
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

/// Every property in the schema with its path, as [`field_paths`] walks them, and whether it is
/// required.
fn field_props(schema: &Value, node: &Value, prefix: &str, out: &mut Vec<(String, Value, bool)>) {
    let node = match node.get("$ref").and_then(Value::as_str) {
        Some(r) => &schema["$defs"][r.trim_start_matches("#/$defs/")],
        None => node,
    };
    if let Some(props) = node.get("properties").and_then(Value::as_object) {
        let required = node.get("required").and_then(Value::as_array);
        for (name, prop) in props {
            let path = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
            let is_required = required.is_some_and(|r| r.iter().any(|x| x == name));
            out.push((path.clone(), prop.clone(), is_required));
            field_props(schema, prop, &path, out);
        }
    }
    if let Some(items) = node.get("items") {
        field_props(schema, items, &format!("{prefix}[]"), out);
    }
    for alternative in node.get("anyOf").and_then(Value::as_array).into_iter().flatten() {
        field_props(schema, alternative, prefix, out);
    }
}

/// `docs/configuration.md`, the generated reference.
fn committed_reference() -> String {
    std::fs::read_to_string(filter_config_dir().join("../docs/configuration.md")).unwrap()
}

#[test]
fn committed_reference_matches_the_declarations() {
    assert!(
        committed_reference() == config_schema::reference::markdown(),
        "docs/configuration.md is out of date; regenerate it with\n  make config-docs"
    );
}

#[test]
fn reference_documents_every_field() {
    let schema = committed_schema();
    let mut paths = Vec::new();
    field_paths(&schema, &schema, "", &mut paths);
    // version, endpoints (+2), models (+2), poller (+5), filter (+2).
    assert!(paths.len() >= 16, "{paths:?}");
    let reference = committed_reference();
    let missing: Vec<&String> =
        paths.iter().filter(|p| !reference.contains(&format!("## `{p}`\n"))).collect();
    assert!(missing.is_empty(), "docs/configuration.md does not document {missing:?}");
}

/// Every difference between the schema's fields and the reference's rows: a field only in one,
/// a default or a bound that differs, a doc that is not the schema's description.
fn schema_vs_reference(schema: &Value, rows: &[config_schema::reference::Row]) -> Vec<String> {
    let mut props = Vec::new();
    field_props(schema, schema, "", &mut props);
    let mut bad = Vec::new();
    for (path, prop, required) in &props {
        let Some(row) = rows.iter().find(|r| &r.path == path) else {
            bad.push(format!("{path}: in the schema, not in the reference"));
            continue;
        };
        // A field whose default is skipped when serialised (`pd`, `endpoints[].role`) has no
        // default in the schema, but is not required there either.
        if let Some(d) = prop.get("default") {
            if row.default.as_ref() != Some(d) {
                bad.push(format!("{path}: schema default {d}, reference {:?}", row.default));
            }
        }
        if *required != row.default.is_none() {
            bad.push(format!("{path}: required in the schema: {required}, default {:?}", row.default));
        }
        for (bound, text) in [("minimum", &row.min), ("maximum", &row.max)] {
            if let Some(text) = text {
                let declared: f64 = text.parse().unwrap_or(f64::NAN);
                if prop.get(bound).and_then(Value::as_f64) != Some(declared) {
                    bad.push(format!("{path}: declared {bound} {text}, schema {:?}", prop.get(bound)));
                }
            }
        }
        let description = prop.get("description").and_then(Value::as_str).unwrap_or("");
        if description != row.doc {
            bad.push(format!("{path}: schema description {description:?}, reference doc {:?}", row.doc));
        }
    }
    for row in rows.iter().filter(|r| !r.path.contains("<key>")) {
        if !props.iter().any(|(p, _, _)| p == &row.path) {
            bad.push(format!("{}: in the reference, not in the schema", row.path));
        }
    }
    bad
}

#[test]
fn every_schema_field_is_in_the_reference_with_the_same_default_bounds_and_doc() {
    let schema = committed_schema();
    let rows = config_schema::reference::rows();
    assert!(rows.len() >= 100, "{}", rows.len());
    let bad = schema_vs_reference(&schema, &rows);
    assert!(bad.is_empty(), "schema and reference differ:\n{}", bad.join("\n"));

    // A planted drift is caught: a default, a bound, a doc.
    let mut drifted = rows.clone();
    let row = drifted.iter_mut().find(|r| r.path == "flow_control.max_wait_ms").unwrap();
    row.default = Some(json!(1));
    row.min = Some("2".into());
    row.doc.push('!');
    let bad = schema_vs_reference(&schema, &drifted);
    assert_eq!(bad.len(), 3, "{bad:#?}");
    assert!(bad.iter().all(|b| b.starts_with("flow_control.max_wait_ms: ")), "{bad:#?}");
}

/// The value a doc states after "Default " (capital D, then a space), if it states one simply:
/// a number, `true`/`false`/`null`, or a `code` span (a string, or JSON).
fn stated_default(doc: &str) -> Option<String> {
    let at = doc.find("Default ")?;
    let rest = &doc[at + "Default ".len()..];
    if let Some(code) = rest.strip_prefix('`') {
        return code.split('`').next().map(str::to_string);
    }
    let token = rest.split_whitespace().next()?;
    let token = token.trim_end_matches(['.', ',', ';', ':', ')']).replace('\u{2212}', "-");
    // A word is prose ("Default priority of ..."), except these.
    let word = token.chars().all(|c| c.is_alphabetic());
    (!word || ["true", "false", "null", "none"].contains(&token.as_str())).then_some(token)
}

/// Does `stated` (from the doc) say `declared`?
fn says(stated: &str, declared: &Value) -> bool {
    match declared {
        _ if stated == "none" => declared.is_null() || declared.as_array().is_some_and(Vec::is_empty),
        Value::Number(n) => stated.parse::<f64>().ok() == n.as_f64(),
        Value::String(s) => stated == s,
        _ => serde_json::from_str::<Value>(stated).ok().as_ref() == Some(declared),
    }
}

#[test]
fn every_default_a_doc_states_is_the_declared_one() {
    let mut checked = 0;
    let mut bad = Vec::new();
    for row in config_schema::reference::rows() {
        let (Some(stated), Some(declared)) = (stated_default(&row.doc), &row.default) else { continue };
        // Sections and objects ("Default: every field ...", "Default `{Critical: 10, ...}`") are
        // described, not stated.
        if declared.is_object() {
            continue;
        }
        checked += 1;
        if !says(&stated, declared) {
            bad.push(format!("{}: the doc says {stated:?}, the declaration {declared}", row.path));
        }
    }
    assert!(checked >= 50, "{checked}");
    assert!(bad.is_empty(), "docs that state another default:\n{}", bad.join("\n"));
    assert!(!says("3", &json!(30_000)) && says("30000", &json!(30_000)) && says("-10", &json!(-10)));
}
