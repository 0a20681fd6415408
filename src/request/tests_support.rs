//! Fixtures shared by the unit tests of `head`, `models` and `pipeline`: the configuration they
//! run with, and the status of a [`HeadDecision`].

use crate::config::Config;
use crate::request::head::HeadDecision;

pub(super) fn cfg() -> Config {
    Config::from_json(
        br#"{"version":1,
            "endpoints":[{"address":"10.0.0.1:8000","models":["base-a"]},
                         {"address":"10.0.0.2:8000","models":["base-b"]}],
            "models":[{"name":"base-a","adapters":["lora-a"],"criticality":"Critical"},
                      {"name":"base-b","criticality":"Sheddable"}],
            "scheduler":{"rewrites":[
                {"matches":[{"model":{"value":"alias"}}],"targets":[{"model_rewrite":"base-b"}]},
                {"matches":[{"model":{"value":"base-a"}}],"targets":[{"model_rewrite":"base-b"}]}]},
            "priority":{"objectives":[{"name":"batch","priority":-20}],
                        "trust_objective_header":true,
                        "tier":{"header":"x-llm-tier","values":{"premium":15}}}}"#,
    )
    .unwrap()
}

pub(super) fn status(d: &HeadDecision) -> u32 {
    match d {
        HeadDecision::ReadBody | HeadDecision::PassThrough | HeadDecision::Models { .. } => 0,
        HeadDecision::Reject { rejection, .. } => rejection.status,
        HeadDecision::Local(r) => r.status,
    }
}
