//! Model resolution: rewrites and traffic splits, then base model and LoRA adapter.
//!
//! Rewrites follow InferenceModelRewrite semantics:
//! - a rule matches when one of its `matches` equals the request's `model` exactly; a rule with
//!   no `matches` is the catch-all;
//! - an exact match (the first such rule in config order) beats the catch-all;
//! - the target is chosen among the rule's `targets` with probability `weight / Σ weights`
//!   (equal split when no weights are set). With an `x-session-id`, the choice is a hash of the
//!   session id instead of a random draw, so a session keeps one model version for all its turns
//!   (a split mid-conversation would also throw away its prefix cache);
//! - the body's `model` is then rewritten to the target (`crate::request::body::rewrite_model`).
//!
//! Resolution of the (possibly rewritten) name: a base model in `models`, else an adapter listed
//! under a base model (the request goes to the base's endpoints), else a name that some
//! endpoint of the snapshot serves (discovery, or `pod_models`: what the pods report, adapters
//! included, see `crate::poll::pod_models`); such a name is its own group and goes only to the
//! endpoints that list it, and it is an adapter for the LoRA scorer when some pod's LoRA metrics
//! run or queue it. With `pod_models.allow_list`, a name the configuration does not mention is
//! unknown even when a pod serves it. Anything else is unknown: 404 `model_not_found`.

use hashbrown::{HashMap, HashSet};

use crate::base::ports::Rng;
use crate::scheduler::config::RewriteRule;
use crate::state::catalog::Catalog;
use crate::state::snapshot::Snapshot;

/// Seed for the session → split-target hash. Any fixed value; it must never change between
/// releases or sessions would switch targets on upgrade.
const SPLIT_SEED: u64 = 0x5eed_0000_0000_0003;

/// What a model name refers to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved<'a> {
    /// The base model endpoints must serve.
    pub base: &'a str,
    /// The adapter, when the name is a LoRA adapter.
    pub adapter: Option<&'a str>,
}

#[derive(Debug, Clone)]
struct Split {
    targets: Vec<(String, u64)>,
    total: u64,
}

/// Built once from the config.
#[derive(Debug, Clone, Default)]
pub struct ModelTable {
    /// name → (base, adapter?)
    known: HashMap<String, (String, Option<String>)>,
    exact: HashMap<String, usize>,
    catch_all: Option<usize>,
    splits: Vec<Split>,
    /// `pod_models.allow_list`: the names the configuration mentions; `None` = no allow-list.
    allow: Option<HashSet<String>>,
    /// `pod_models` is on: a served name that pods run as a LoRA adapter resolves as one.
    learning: bool,
}

impl ModelTable {
    pub fn new(catalog: &Catalog<'_>, rewrites: &[RewriteRule]) -> ModelTable {
        let mut t = ModelTable {
            allow: catalog.allow_list(),
            learning: catalog.learn_models,
            ..ModelTable::default()
        };
        for m in catalog.models {
            for a in &m.adapters {
                t.known.entry(a.clone()).or_insert_with(|| (m.name.clone(), Some(a.clone())));
            }
        }
        // Base names win over an adapter of the same name.
        for m in catalog.models {
            t.known.insert(m.name.clone(), (m.name.clone(), None));
        }
        for (i, rule) in rewrites.iter().enumerate() {
            let targets: Vec<(String, u64)> = rule
                .targets
                .iter()
                .map(|x| (x.model_rewrite.clone(), u64::from(x.weight.unwrap_or(1))))
                .collect();
            let total = targets.iter().map(|(_, w)| *w).sum();
            t.splits.push(Split { targets, total });
            if rule.matches.is_empty() {
                t.catch_all.get_or_insert(i);
            }
            for m in &rule.matches {
                t.exact.entry(m.model.value.clone()).or_insert(i);
            }
        }
        t
    }

    /// The rewrite target for `model`, or `None` when no rule applies.
    pub fn rewrite(&self, model: &str, session_id: Option<&str>, rng: &mut dyn Rng) -> Option<&str> {
        let idx = self.exact.get(model).copied().or(self.catch_all)?;
        let split = self.splits.get(idx)?;
        if split.total == 0 {
            return None;
        }
        let draw = match session_id {
            Some(s) => xxhash_rust::xxh3::xxh3_64_with_seed(s.as_bytes(), SPLIT_SEED),
            None => rng.next_u64(),
        } % split.total;
        let mut acc = 0;
        for (name, w) in &split.targets {
            acc += w;
            if draw < acc {
                return Some(name);
            }
        }
        split.targets.last().map(|(n, _)| n.as_str())
    }

    /// Base model and adapter for `name`, or `None` if nothing serves it.
    pub fn resolve<'a>(&'a self, name: &'a str, snapshot: &Snapshot) -> Option<Resolved<'a>> {
        if let Some((base, adapter)) = self.known.get(name) {
            return Some(Resolved { base, adapter: adapter.as_deref() });
        }
        if self.allow.as_ref().is_some_and(|a| !a.contains(name)) {
            return None;
        }
        let discovered = snapshot.endpoints.iter().any(|e| e.models.iter().any(|m| m == name));
        if !discovered {
            return None;
        }
        let adapter =
            (self.learning && crate::state::snapshot::is_running_adapter(snapshot, name)).then_some(name);
        Some(Resolved { base: name, adapter })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::ports::SplitMix64;
    use crate::config::Config;
    use crate::state::snapshot::EndpointStatus;

    fn cfg(json: &str) -> Config {
        Config::from_json(json.as_bytes()).unwrap()
    }

    fn table(c: &Config) -> ModelTable {
        ModelTable::new(&c.catalog(), &c.scheduler.rewrites)
    }

    const BASE: &str = r#""version":1,"endpoints":[{"address":"10.0.0.1:8000","models":["llama"]}],
        "models":[{"name":"llama","adapters":["sql-lora","chat-lora"]},{"name":"qwen"}]"#;

    #[test]
    fn resolves_base_adapter_discovered_and_unknown() {
        let t = table(&cfg(&format!("{{{BASE}}}")));
        let snap = Snapshot {
            endpoints: vec![EndpointStatus { models: vec!["mistral".into()], ..Default::default() }],
            ..Default::default()
        };
        assert_eq!(t.resolve("llama", &snap), Some(Resolved { base: "llama", adapter: None }));
        assert_eq!(t.resolve("sql-lora", &snap), Some(Resolved { base: "llama", adapter: Some("sql-lora") }));
        assert_eq!(t.resolve("mistral", &snap), Some(Resolved { base: "mistral", adapter: None }));
        assert_eq!(t.resolve("gpt-4", &snap), None);
    }

    #[test]
    fn learned_names_resolve_to_their_pods_unless_the_allow_list_refuses_them() {
        use crate::state::metrics::EndpointMetrics;
        let snap = Snapshot {
            endpoints: vec![EndpointStatus {
                models: vec!["llama".into(), "runtime-lora".into(), "idle-lora".into(), "mistral".into()],
                metrics: Some(EndpointMetrics {
                    running_adapters: vec!["runtime-lora".into()],
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        };
        let t = table(&cfg(&format!(r#"{{{BASE},"pod_models":{{}}}}"#)));
        // A name the pods run as an adapter gets the LoRA scorer; an idle one is just a name.
        assert_eq!(
            t.resolve("runtime-lora", &snap),
            Some(Resolved { base: "runtime-lora", adapter: Some("runtime-lora") })
        );
        assert_eq!(t.resolve("idle-lora", &snap), Some(Resolved { base: "idle-lora", adapter: None }));
        assert_eq!(t.resolve("gpt-4", &snap), None);
        // Configured names resolve as before.
        assert_eq!(t.resolve("sql-lora", &snap), Some(Resolved { base: "llama", adapter: Some("sql-lora") }));
        // Allow-list: only what the configuration mentions.
        let t = table(&cfg(&format!(r#"{{{BASE},"pod_models":{{"allow_list":true}}}}"#)));
        assert_eq!(t.resolve("runtime-lora", &snap), None);
        assert_eq!(t.resolve("mistral", &snap), None);
        assert_eq!(t.resolve("llama", &snap), Some(Resolved { base: "llama", adapter: None }));
        // Without pod_models, discovery keeps its old meaning (no adapter detection).
        let t = table(&cfg(&format!("{{{BASE}}}")));
        assert_eq!(t.resolve("runtime-lora", &snap), Some(Resolved { base: "runtime-lora", adapter: None }));
    }

    #[test]
    fn exact_beats_catch_all_and_weights_are_relative() {
        let t = table(&cfg(&format!(
            r#"{{{BASE},"scheduler":{{"rewrites":[
                {{"targets":[{{"model_rewrite":"qwen"}}]}},
                {{"matches":[{{"model":{{"value":"llama"}}}}],
                  "targets":[{{"model_rewrite":"sql-lora","weight":3}},{{"model_rewrite":"chat-lora","weight":1}}]}}]}}}}"#
        )));
        let mut rng = SplitMix64::new(11);
        let mut n_sql = 0;
        for _ in 0..4000 {
            match t.rewrite("llama", None, &mut rng) {
                Some("sql-lora") => n_sql += 1,
                Some("chat-lora") => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        // Expected 3/4 of 4000 = 3000; seeded, so this is exact for seed 11 — the band only
        // documents what the weights mean.
        assert!((2850..=3150).contains(&n_sql), "{n_sql}");
        // Anything else hits the catch-all.
        assert_eq!(t.rewrite("qwen", None, &mut rng), Some("qwen"));
        assert_eq!(t.rewrite("whatever", None, &mut rng), Some("qwen"));
    }

    #[test]
    fn no_rule_no_rewrite_and_sessions_are_sticky() {
        let t = table(&cfg(&format!(
            r#"{{{BASE},"scheduler":{{"rewrites":[{{"matches":[{{"model":{{"value":"llama"}}}}],
                "targets":[{{"model_rewrite":"sql-lora"}},{{"model_rewrite":"chat-lora"}}]}}]}}}}"#
        )));
        let mut rng = SplitMix64::new(1);
        assert_eq!(t.rewrite("qwen", None, &mut rng), None);
        // The same session id always gets the same target, whatever the rng does.
        let first = t.rewrite("llama", Some("sess-1"), &mut rng);
        for seed in 0..20 {
            assert_eq!(t.rewrite("llama", Some("sess-1"), &mut SplitMix64::new(seed)), first);
        }
        // Different sessions spread over both targets.
        let mut seen = hashbrown::HashSet::new();
        for i in 0..40 {
            seen.insert(t.rewrite("llama", Some(&format!("s{i}")), &mut rng).unwrap().to_string());
        }
        assert_eq!(seen.len(), 2);
    }

    #[test]
    fn with_pod_models_a_split_may_target_a_learned_name() {
        let rule = r#""scheduler":{"rewrites":[{"matches":[{"model":{"value":"llama"}}],
            "targets":[{"model_rewrite":"llama","weight":90},{"model_rewrite":"canary-lora","weight":10}]}]}"#;
        // Without pod_models, or with its allow-list, the target must be configured.
        for extra in ["", r#","pod_models":{"allow_list":true}"#] {
            let e = Config::from_json(format!("{{{BASE},{rule}{extra}}}").as_bytes()).unwrap_err();
            assert!(e.iter().any(|e| e.path == "scheduler.rewrites[0].targets[1].model_rewrite"), "{e:?}");
        }
        let c = cfg(&format!(r#"{{{BASE},{rule},"pod_models":{{}}}}"#));
        let t = table(&c);
        let mut rng = SplitMix64::new(5);
        let canary = (0..1000).filter(|_| t.rewrite("llama", None, &mut rng) == Some("canary-lora")).count();
        // Seeded: 10 % of 1000 expected; the band documents the weight.
        assert!((50..=150).contains(&canary), "{canary}");
        // The target resolves once a pod reports it, and is unknown before.
        let snap = Snapshot {
            endpoints: vec![EndpointStatus { models: vec!["canary-lora".into()], ..Default::default() }],
            ..Default::default()
        };
        assert!(t.resolve("canary-lora", &Snapshot::default()).is_none());
        assert_eq!(t.resolve("canary-lora", &snap).map(|r| r.base), Some("canary-lora"));
    }

    #[test]
    fn validation_rejects_unknown_targets_and_partial_weights() {
        let e = Config::from_json(
            format!(
                r#"{{{BASE},"scheduler":{{"rewrites":[{{"targets":[{{"model_rewrite":"nope","weight":1}},{{"model_rewrite":"qwen"}}]}}]}}}}"#
            )
            .as_bytes(),
        )
        .unwrap_err();
        let paths: Vec<&str> = e.iter().map(|e| e.path.as_str()).collect();
        assert!(paths.contains(&"scheduler.rewrites[0].targets"), "{paths:?}");
        assert!(paths.contains(&"scheduler.rewrites[0].targets[0].model_rewrite"), "{paths:?}");
    }
}
