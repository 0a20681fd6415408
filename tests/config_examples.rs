//! Every file in filter-config/examples parses and validates. The directory is listed, not named
//! file by file, so a new example is covered as soon as it is added. (tools/config-schema also
//! checks each one against filter-config/schema.json.)

use std::path::{Path, PathBuf};

use inference_picker::config::{Config, FailureMode};

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("filter-config/examples")
}

fn load(name: &str) -> Config {
    let bytes = std::fs::read(examples_dir().join(name)).unwrap();
    Config::from_json(&bytes).unwrap_or_else(|e| panic!("{name}: {e:#?}"))
}

#[test]
fn every_example_parses_and_validates() {
    let mut checked = 0;
    for entry in std::fs::read_dir(examples_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|x| x != "json") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        if let Err(errs) = Config::from_json(&bytes) {
            panic!("{}: {errs:#?}", path.display());
        }
        checked += 1;
    }
    // minimal, three-sims, fail-open at least: an empty or renamed directory must not pass.
    assert!(checked >= 3, "only {checked} examples found");
}

#[test]
fn three_sims_routes_as_make_run_expects() {
    let cfg = load("three-sims.json");
    let serving = |model: &str| -> Vec<&str> {
        cfg.endpoints
            .iter()
            .filter(|e| e.models.iter().any(|m| m == model))
            .map(|e| e.address.as_str())
            .collect()
    };
    assert_eq!(
        serving("meta-llama/Llama-3.1-8B-Instruct"),
        ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"]
    );
    assert_eq!(serving("qwen"), ["127.0.0.1:8003"]);
    let table = inference_picker::scheduler::models::ModelTable::new(&cfg.catalog(), &cfg.scheduler.rewrites);
    let lora = table.resolve("sql-lora", &Default::default()).unwrap();
    assert_eq!((lora.base, lora.adapter), ("meta-llama/Llama-3.1-8B-Instruct", Some("sql-lora")));
}

#[test]
fn fail_open_example_is_fail_open() {
    assert_eq!(load("fail-open.json").filter.failure_mode, FailureMode::FailOpen);
    assert_eq!(load("minimal.json").filter.failure_mode, FailureMode::FailClose);
}
