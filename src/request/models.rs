//! The model list, answered locally: OpenAI's `GET /v1/models` and `GET /v1/models/{id}`
//! ([`models_reply`], [`model_list`], [`model_object`]), from the configured models and adapters
//! and, with `pod_models`, the names the pods report.

use crate::base::errors::Rejection;
use crate::request::config::Settings;
use crate::request::head::{clip, HeadDecision, LocalReply};
use crate::state::snapshot::Snapshot;

/// The answer to [`HeadDecision::Models`]: the model list, or one model (404 `model_not_found`
/// when neither the configuration nor, with `pod_models`, a pod has it).
pub fn models_reply(cfg: &Settings<'_>, id: Option<&str>, snapshot: &Snapshot) -> HeadDecision {
    match id {
        None => HeadDecision::Local(LocalReply::json(200, model_list(cfg, snapshot))),
        Some(id) => match model_object(cfg, id, snapshot) {
            Some(body) => HeadDecision::Local(LocalReply::json(200, body)),
            None => HeadDecision::reject(Rejection::new(
                404,
                "invalid_request_error",
                "model_not_found",
                format!("The model `{}` does not exist.", clip(id)),
            )),
        },
    }
}

/// One entry of the model list: a base model, or an adapter with its `parent`.
fn model_entry(id: &str, parent: Option<&str>) -> serde_json::Value {
    let mut v = serde_json::json!({"id": id, "object": "model", "owned_by": "inference-picker"});
    if let (Some(p), Some(obj)) = (parent, v.as_object_mut()) {
        obj.insert("parent".into(), p.into());
    }
    v
}

/// The names the pods reported (`pod_models`) that the configuration does not list, filtered by
/// `pod_models.allow_list`, sorted. Empty without `pod_models`.
fn learned_models(cfg: &Settings<'_>, snapshot: &Snapshot) -> Vec<String> {
    if !cfg.catalog.learn_models {
        return Vec::new();
    }
    let configured: hashbrown::HashSet<&str> = cfg
        .catalog
        .models
        .iter()
        .flat_map(|m| std::iter::once(&m.name).chain(&m.adapters))
        .map(String::as_str)
        .collect();
    let allow = cfg.catalog.allow_list();
    crate::state::snapshot::learned_names(snapshot, allow.as_ref(), &configured)
}

/// OpenAI `GET /v1/models` for the whole pool: every base model and adapter in the config, then
/// (with `pod_models`) every other name some pod reports, without `parent` (a pod's list names
/// it, but the pool may not agree on one).
pub fn model_list(cfg: &Settings<'_>, snapshot: &Snapshot) -> Vec<u8> {
    let mut data = Vec::new();
    for m in cfg.catalog.models {
        data.push(model_entry(&m.name, None));
        for a in &m.adapters {
            data.push(model_entry(a, Some(&m.name)));
        }
    }
    for name in learned_models(cfg, snapshot) {
        data.push(model_entry(&name, None));
    }
    serde_json::to_vec(&serde_json::json!({"object": "list", "data": data})).unwrap_or_default()
}

/// OpenAI `GET /v1/models/{id}`: the configured base model or adapter named `id`, else (with
/// `pod_models`) a name some pod reports.
pub fn model_object(cfg: &Settings<'_>, id: &str, snapshot: &Snapshot) -> Option<Vec<u8>> {
    cfg.catalog
        .models
        .iter()
        .find_map(|m| {
            if m.name == id {
                Some(model_entry(&m.name, None))
            } else {
                m.adapters.iter().find(|a| *a == id).map(|a| model_entry(a, Some(&m.name)))
            }
        })
        .or_else(|| learned_models(cfg, snapshot).iter().any(|n| n == id).then(|| model_entry(id, None)))
        .and_then(|v| serde_json::to_vec(&v).ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::request::tests_support::{cfg, status};
    use crate::state::snapshot::EndpointStatus;

    #[test]
    fn model_list_adds_what_the_pods_report_only_with_pod_models_and_within_the_allow_list() {
        let snap = Snapshot {
            endpoints: vec![EndpointStatus {
                address: "10.0.0.1:8000".into(),
                models: vec!["base-a".into(), "runtime-lora".into()],
                ..Default::default()
            }],
            ..Default::default()
        };
        let ids = |c: &Config| -> Vec<String> {
            match models_reply(&c.request(), None, &snap) {
                HeadDecision::Local(r) => serde_json::from_slice::<serde_json::Value>(&r.body).unwrap()
                    ["data"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|m| m["id"].as_str().unwrap().to_string())
                    .collect(),
                d => panic!("{d:?}"),
            }
        };
        let mut c = cfg();
        assert_eq!(ids(&c), ["base-a", "lora-a", "base-b"]);
        c.pod_models = Some(crate::config::read_json("{}").unwrap());
        assert_eq!(ids(&c), ["base-a", "lora-a", "base-b", "runtime-lora"]);
        assert_eq!(status(&models_reply(&c.request(), Some("runtime-lora"), &snap)), 200);
        c.pod_models = Some(crate::config::read_json(r#"{"allow_list":true}"#).unwrap());
        assert_eq!(ids(&c), ["base-a", "lora-a", "base-b"]);
        assert_eq!(status(&models_reply(&c.request(), Some("runtime-lora"), &snap)), 404);
    }
}
