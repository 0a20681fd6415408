//! The per-request model lookup: the name in the body's `model` (a base model or a LoRA adapter)
//! → its base model and the endpoints that serve that base.
//!
//! Built once from a validated [`Config`] and then only read; [`ModelTable::resolve`] does one hash
//! lookup and allocates nothing. Adapters are routed to the endpoints of their base model: any of
//! them can load the adapter, and the LoRA scorer prefers the ones that already have it.

use hashbrown::HashMap;

use super::Config;

/// What a model name resolves to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resolved<'a> {
    /// The base model (`models[].name`).
    pub base: &'a str,
    /// The adapter, when the name was a LoRA adapter of `base`.
    pub adapter: Option<&'a str>,
    /// `ip:port` of every endpoint that serves `base`, in configuration order.
    pub endpoints: &'a [Box<str>],
}

#[derive(Debug)]
struct BaseModel {
    name: Box<str>,
    endpoints: Vec<Box<str>>,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Index into `ModelTable::bases`.
    base: usize,
    is_adapter: bool,
}

/// Model and adapter names → base model → endpoint addresses. See the module docs.
#[derive(Debug)]
pub struct ModelTable {
    by_name: HashMap<Box<str>, Entry>,
    bases: Vec<BaseModel>,
}

impl ModelTable {
    /// Builds the table. Meant for a config that passed [`Config::validate`]; on one that did not,
    /// the first of duplicate names wins and unknown model references are skipped, so it never
    /// panics.
    pub fn build(cfg: &Config) -> Self {
        let mut by_name: HashMap<Box<str>, Entry> = HashMap::new();
        let mut bases = Vec::with_capacity(cfg.models.len());
        for m in &cfg.models {
            if by_name.contains_key(m.name.as_str()) {
                continue;
            }
            let base = bases.len();
            bases.push(BaseModel { name: m.name.as_str().into(), endpoints: Vec::new() });
            by_name.insert(m.name.as_str().into(), Entry { base, is_adapter: false });
        }
        for m in &cfg.models {
            let Some(&Entry { base, is_adapter: false }) = by_name.get(m.name.as_str()) else { continue };
            for a in &m.adapters {
                by_name.entry(a.as_str().into()).or_insert(Entry { base, is_adapter: true });
            }
        }
        for ep in &cfg.endpoints {
            for name in &ep.models {
                if let Some(&Entry { base, is_adapter: false }) = by_name.get(name.as_str()) {
                    if let Some(b) = bases.get_mut(base) {
                        if !b.endpoints.iter().any(|e| **e == *ep.address) {
                            b.endpoints.push(ep.address.as_str().into());
                        }
                    }
                }
            }
        }
        Self { by_name, bases }
    }

    /// Resolves the body's `model`: exact, case-sensitive match against base model and adapter
    /// names. `None` when the pool does not serve that name (the filter answers 404).
    pub fn resolve(&self, name: &str) -> Option<Resolved<'_>> {
        let (key, entry) = self.by_name.get_key_value(name)?;
        let base = self.bases.get(entry.base)?;
        Some(Resolved {
            base: &base.name,
            adapter: if entry.is_adapter { Some(key) } else { None },
            endpoints: &base.endpoints,
        })
    }

    /// The endpoints that serve base model `base`; empty when it is not a base model.
    pub fn endpoints_of(&self, base: &str) -> &[Box<str>] {
        match self.by_name.get(base) {
            Some(Entry { base: i, is_adapter: false }) => self.bases.get(*i).map_or(&[], |b| &b.endpoints),
            _ => &[],
        }
    }

    /// Base model names, in configuration order.
    pub fn base_models(&self) -> impl Iterator<Item = &str> {
        self.bases.iter().map(|b| &*b.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> ModelTable {
        let cfg = Config::from_json(
            br#"{
              "version": 1,
              "endpoints": [
                {"address": "127.0.0.1:8001", "models": ["llama"]},
                {"address": "127.0.0.1:8002", "models": ["llama"]},
                {"address": "127.0.0.1:8003", "models": ["llama", "qwen"]}
              ],
              "models": [
                {"name": "llama", "adapters": ["sql-lora", "chat-lora"]},
                {"name": "qwen"}
              ]
            }"#,
        )
        .unwrap();
        cfg.model_table()
    }

    #[test]
    fn base_model_resolves_to_all_its_endpoints() {
        let t = table();
        let r = t.resolve("llama").unwrap();
        assert_eq!(r.base, "llama");
        assert_eq!(r.adapter, None);
        let eps: Vec<&str> = r.endpoints.iter().map(|e| &**e).collect();
        assert_eq!(eps, ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"]);
    }

    #[test]
    fn adapter_resolves_to_its_base_and_the_base_endpoints() {
        let t = table();
        let r = t.resolve("chat-lora").unwrap();
        assert_eq!(r.base, "llama");
        assert_eq!(r.adapter, Some("chat-lora"));
        assert_eq!(r.endpoints.len(), 3);
    }

    #[test]
    fn second_model_only_on_its_endpoint() {
        let t = table();
        let r = t.resolve("qwen").unwrap();
        assert_eq!((r.base, r.adapter), ("qwen", None));
        let eps: Vec<&str> = r.endpoints.iter().map(|e| &**e).collect();
        assert_eq!(eps, ["127.0.0.1:8003"]);
    }

    #[test]
    fn unknown_and_differently_cased_names_do_not_resolve() {
        let t = table();
        assert_eq!(t.resolve("mistral"), None);
        assert_eq!(t.resolve("LLAMA"), None);
        assert_eq!(t.resolve(""), None);
    }

    #[test]
    fn endpoints_of_bases_only() {
        let t = table();
        assert_eq!(t.endpoints_of("qwen").len(), 1);
        // An adapter is not a base model.
        assert!(t.endpoints_of("sql-lora").is_empty());
        assert!(t.endpoints_of("nope").is_empty());
        assert_eq!(t.base_models().collect::<Vec<_>>(), ["llama", "qwen"]);
    }

    #[test]
    fn build_tolerates_an_invalid_config() {
        // Duplicate base, an adapter named like a base, an endpoint naming an unknown model and an
        // adapter: validate() rejects this, but build() must still not panic.
        let mut cfg = Config::from_json(
            br#"{"version": 1, "endpoints": [{"address": "10.0.0.1:80", "models": ["a"]}],
                 "models": [{"name": "a", "adapters": ["x"]}]}"#,
        )
        .unwrap();
        cfg.models.push(crate::config::ModelConfig {
            name: "a".into(),
            adapters: vec!["a".into()],
            criticality: crate::priority::Criticality::Standard,
        });
        cfg.endpoints.push(crate::config::EndpointConfig {
            address: "10.0.0.1:80".into(),
            models: vec!["zzz".into(), "x".into(), "a".into()],
        });
        assert!(cfg.validate().is_err());
        let t = cfg.model_table();
        let r = t.resolve("a").unwrap();
        // The first "a" wins and the duplicate address is listed once.
        assert_eq!((r.base, r.adapter, r.endpoints.len()), ("a", None, 1));
        assert_eq!(t.resolve("x").unwrap().adapter, Some("x"));
        assert_eq!(t.resolve("zzz"), None);
    }
}
