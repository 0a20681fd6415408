//! config-from-crds on the example resources: what it maps, what it refuses, and that what it
//! writes passes the module's own `Config::from_json`.

use std::path::{Path, PathBuf};
use std::process::Command;

use config_from_crds::{convert, objective_priorities, parse_documents, parse_model_arg, Options};
use inference_picker::config::{Config, FailureMode, PollerMode};

fn example(name: &str) -> Vec<serde_yaml::Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples").join(name);
    parse_documents(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn llama_opts() -> Options {
    Options {
        models: vec![parse_model_arg("meta-llama/Llama-3.1-8B-Instruct=food-review-1,food-review-2").unwrap()],
        ..Options::default()
    }
}

#[test]
fn llama_pool_maps_selector_ports_failure_mode_and_rewrites() {
    let out = convert(&example("llama-pool.yaml"), &llama_opts()).unwrap();
    let c = &out.config;
    let k = &c.discovery.as_ref().unwrap().kubernetes;
    assert_eq!(k.namespace, "inference");
    assert_eq!(k.selector.get("app").map(String::as_str), Some("vllm-llama3-8b-instruct"));
    assert_eq!(k.target_ports, [8000]);
    assert_eq!(k.token_env.as_deref(), Some("K8S_TOKEN"));
    assert_eq!(c.filter.failure_mode, FailureMode::FailOpen);
    assert_eq!(c.poller.mode, PollerMode::Lease);
    assert!(c.endpoints.is_empty());
    let rules = &c.scheduler.rewrites;
    assert_eq!(rules.len(), 1);
    assert_eq!(rules[0].matches[0].model.value, "food-review");
    let targets: Vec<(&str, Option<u32>)> =
        rules[0].targets.iter().map(|t| (t.model_rewrite.as_str(), t.weight)).collect();
    assert_eq!(targets, [("food-review-1", Some(90)), ("food-review-2", Some(10))]);
    let objectives: Vec<(&str, i32)> =
        c.priority.objectives.iter().map(|o| (o.name.as_str(), o.priority)).collect();
    assert_eq!(objectives, [("batch-summaries", -5), ("interactive-chat", 10)]);
    // The objectives only matter once the header is trusted, which the resources cannot say.
    assert!(!c.priority.trust_objective_header);
    assert_eq!(out.warnings.len(), 1);
    assert!(out.warnings[0].contains("2 InferenceObjective(s) written"), "{:?}", out.warnings);
    // What it writes reads back through the module's parser unchanged.
    let json = serde_json::to_vec(c).unwrap();
    assert_eq!(&Config::from_json(&json).unwrap(), c);
}

#[test]
fn objectives_map_name_to_priority_with_unset_as_zero() {
    let mut docs = example("llama-pool.yaml");
    docs.extend(
        parse_documents(
            "apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferenceObjective\n\
             metadata: {name: default-class}\nspec: {poolRef: {name: vllm-llama3-8b-instruct}}\n---\n\
             apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferenceObjective\n\
             metadata: {name: other-pool}\nspec: {priority: 99, poolRef: {name: qwen-dp2}}\n",
        )
        .unwrap(),
    );
    let p = objective_priorities(&docs, "vllm-llama3-8b-instruct").unwrap();
    let got: Vec<(&str, i64)> = p.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(got, [("batch-summaries", -5), ("default-class", 0), ("interactive-chat", 10)]);
}

#[test]
fn several_pools_need_a_choice() {
    let docs = example("two-pools.yaml");
    let err = convert(&docs, &Options::default()).unwrap_err();
    assert!(err[0].contains("2 InferencePools") && err[0].contains("qwen-dp2"), "{err:?}");

    let opts = Options {
        pool: Some("qwen-dp2".into()),
        namespace: "serving".into(),
        models: vec![parse_model_arg("Qwen/Qwen2.5-7B-Instruct").unwrap()],
        poller_mode: PollerMode::Singleton,
        ..Options::default()
    };
    let c = convert(&docs, &opts).unwrap().config;
    let k = &c.discovery.as_ref().unwrap().kubernetes;
    // No metadata.namespace: the --namespace value. Two ports, each its own endpoint.
    assert_eq!(k.namespace, "serving");
    assert_eq!(k.target_ports, [30000, 30001]);
    assert_eq!(k.selector.len(), 2);
    // No endpointPickerRef: GIE's default, FailClose.
    assert_eq!(c.filter.failure_mode, FailureMode::FailClose);
    assert_eq!(c.poller.mode, PollerMode::Singleton);
    // The catch-all rule (no matches) of the rewrite that names this pool by group and kind.
    assert_eq!(c.scheduler.rewrites.len(), 1);
    assert!(c.scheduler.rewrites[0].matches.is_empty());

    let missing = Options { pool: Some("nope".into()), ..llama_opts() };
    assert_eq!(convert(&docs, &missing).unwrap_err(), ["no InferencePool named \"nope\""]);
}

#[test]
fn invalid_results_are_refused_with_the_modules_own_errors() {
    // The rewrite targets food-review-2, which --model does not declare.
    let opts = Options {
        models: vec![parse_model_arg("meta-llama/Llama-3.1-8B-Instruct=food-review-1").unwrap()],
        ..Options::default()
    };
    let errs = convert(&example("llama-pool.yaml"), &opts).unwrap_err();
    // targets[1] is food-review-2.
    assert!(errs.iter().any(|e| e.starts_with("scheduler.rewrites[0].targets[1].model_rewrite")), "{errs:?}");
    // No models at all.
    let errs = convert(&example("llama-pool.yaml"), &Options::default()).unwrap_err();
    assert!(errs.iter().any(|e| e.starts_with("models")), "{errs:?}");
    // No pool at all.
    let errs = convert(&[], &llama_opts()).unwrap_err();
    assert!(errs[0].contains("no InferencePool"), "{errs:?}");
    // An unknown failure mode.
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/llama-pool.yaml"))
            .unwrap()
            .replace("failureMode: FailOpen", "failureMode: FailSometimes");
    let errs = convert(&parse_documents(&text).unwrap(), &llama_opts()).unwrap_err();
    assert!(errs[0].contains("unknown failureMode \"FailSometimes\""), "{errs:?}");
}

#[test]
fn base_document_keeps_its_other_settings() {
    let base = serde_json::json!({
        "version": 1,
        "endpoints": [],
        "models": [{"name": "meta-llama/Llama-3.1-8B-Instruct", "adapters": ["food-review-1", "food-review-2"]}],
        "poller": {"interval_ms": 100, "lease_ttl_ms": 2000},
        "filter": {"max_body_bytes": 1048576, "failure_mode": "FailClose"}
    });
    let opts = Options { base: Some(base), ..Options::default() };
    let c = convert(&example("llama-pool.yaml"), &opts).unwrap().config;
    assert_eq!((c.poller.interval_ms, c.poller.lease_ttl_ms), (100, 2000));
    assert_eq!(c.filter.max_body_bytes, 1048576);
    // The pool's failureMode replaces the base's.
    assert_eq!(c.filter.failure_mode, FailureMode::FailOpen);
}

#[test]
fn model_argument_syntax() {
    let m = parse_model_arg("meta-llama/Llama-3.1-8B-Instruct=a, b,").unwrap();
    assert_eq!(
        (m.name.as_str(), m.adapters.as_slice()),
        ("meta-llama/Llama-3.1-8B-Instruct", &["a".to_string(), "b".to_string()][..])
    );
    assert!(parse_model_arg("=a").is_err());
}

#[test]
fn command_line_writes_a_valid_document() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_config-from-crds"));
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/llama-pool.yaml");
    let out = Command::new(&exe)
        .args(["--model", "meta-llama/Llama-3.1-8B-Instruct=food-review-1,food-review-2"])
        .arg(&example)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let c = Config::from_json(&out.stdout).unwrap();
    assert_eq!(c.discovery.unwrap().kubernetes.target_ports, [8000]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("note: 2 InferenceObjective(s) written"));

    let bad = Command::new(&exe).arg(&example).output().unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("error: models"));
}

#[test]
fn route_by_model_names_each_pool_of_a_two_pool_gateway() {
    let docs = example("two-pools.yaml");
    // Without the flag: one unnamed pool, as before.
    assert_eq!(
        convert(&docs, &Options { pool: Some("vllm-llama3-8b-instruct".into()), ..llama_opts() })
            .unwrap()
            .config
            .pool,
        None
    );
    let llama =
        Options { pool: Some("vllm-llama3-8b-instruct".into()), route_by_model: true, ..llama_opts() };
    let qwen = Options {
        pool: Some("qwen-dp2".into()),
        models: vec![parse_model_arg("Qwen/Qwen2.5-7B-Instruct").unwrap()],
        route_by_model: true,
        ..Options::default()
    };
    let a = convert(&docs, &llama).unwrap().config;
    let b = convert(&docs, &qwen).unwrap().config;
    let pa = a.pool.unwrap();
    let pb = b.pool.unwrap();
    assert_eq!((pa.name.as_str(), pa.route_by_model), ("vllm-llama3-8b-instruct", true));
    assert_eq!((pb.name.as_str(), pb.route_by_model), ("qwen-dp2", true));
    assert_eq!(b.discovery.unwrap().kubernetes.target_ports, [30000, 30001]);
}
