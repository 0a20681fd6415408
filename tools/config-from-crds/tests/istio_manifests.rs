//! Every module configuration embedded in the Istio manifests (envoy/istio/) parses and validates
//! with the module's own parser: the filters' (EXTENSION_CONFIG), the bootstrap singleton's
//! (custom_bootstrap.json), and the WasmPlugin's pluginConfig. `envoy --mode validate` checks the
//! filters' too, but not the singleton's (validate mode does not start bootstrap extensions).

use std::path::{Path, PathBuf};

use config_from_crds::parse_documents;
use inference_picker::config::Config;

fn manifests() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../envoy/istio");
    let mut out = Vec::new();
    for dir in std::fs::read_dir(&root).unwrap() {
        let dir = dir.unwrap().path();
        if dir.is_dir() {
            for f in std::fs::read_dir(&dir).unwrap() {
                let f = f.unwrap().path();
                if f.extension().is_some_and(|e| e == "yaml") {
                    out.push(f);
                }
            }
        }
    }
    out.sort();
    out
}

/// Every `configuration.value` string under a wasm `config`, anywhere in `v`.
fn wasm_configurations(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            if let (Some(root_id), Some(value)) = (
                m.get("root_id").and_then(|r| r.as_str()),
                m.get("configuration").and_then(|c| c.get("value")).and_then(|v| v.as_str()),
            ) {
                if root_id.starts_with("inference-picker") {
                    out.push(value.to_string());
                }
            }
            m.values().for_each(|x| wasm_configurations(x, out));
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| wasm_configurations(x, out)),
        _ => {}
    }
}

#[test]
fn every_embedded_configuration_is_valid() {
    let mut checked = 0;
    for path in manifests() {
        for doc in parse_documents(&std::fs::read_to_string(&path).unwrap()).unwrap() {
            let doc: serde_json::Value = serde_json::to_value(&doc).unwrap();
            let mut configs = Vec::new();
            wasm_configurations(&doc, &mut configs);
            if let Some(boot) = doc.pointer("/data/custom_bootstrap.json").and_then(|b| b.as_str()) {
                wasm_configurations(&serde_json::from_str(boot).unwrap(), &mut configs);
            }
            if doc["kind"] == "WasmPlugin" {
                configs.push(doc["spec"]["pluginConfig"].to_string());
            }
            for c in configs {
                if let Err(errs) = Config::from_json(c.as_bytes()) {
                    panic!("{}: {errs:?}", path.display());
                }
                checked += 1;
            }
        }
    }
    // gateway-api, gateway-api-pools (two pools), ingress, sidecar, sidecar-singleton (filter +
    // singleton), wasmplugin.
    assert_eq!(checked, 8);
}
