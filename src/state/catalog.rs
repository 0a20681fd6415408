//! The pool's catalog: what the configuration (or discovery) says exists. The endpoints and
//! their roles, the models with their adapters and criticality. Every wing above reads these;
//! they read nothing but the ground.

use std::net::SocketAddr;

use hashbrown::HashSet;
use serde::{Deserialize, Serialize};

use crate::base::json;
use crate::base::settings::settings;

/// What an endpoint may do in a P/D pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Serves requests (the destination) and prefills them itself when no prefiller is named.
    /// The role of an endpoint without one.
    #[default]
    Decode,
    /// Only prefills for a decode pod; never a destination.
    Prefill,
    /// Either (llm-d's `both` or `prefill-decode`).
    #[serde(alias = "prefill-decode")]
    Both,
}

impl Role {
    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }
    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }
    pub fn is_decode(&self) -> bool {
        *self == Role::Decode
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Decode => "decode",
            Role::Prefill => "prefill",
            Role::Both => "both",
        }
    }
}

/// How important a model's traffic is (the older GIE InferenceModel `criticality`), mapped to a
/// priority by `priority.criticality`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum Criticality {
    Critical,
    #[default]
    Standard,
    Sheddable,
}

settings! {
    /// One model server.
    #[derive(Debug, Clone, PartialEq)]
    pub struct EndpointConfig {
        /// `ip:port` of the model server: an IPv4 address (`10.0.0.7:8000`) or a bracketed IPv6
        /// address (`[fd00::7]:8000`), port 1-65535. No hostnames: the ORIGINAL_DST cluster routes to
        /// the literal address in `x-gateway-destination-endpoint`. Unique across endpoints.
        #[schema(length(min = 1))]
        pub address: String,
        /// Names of the base models (from `models[].name`, not adapters) this endpoint serves. At
        /// least one.
        #[schema(length(min = 1), inner(length(min = 1)))]
        pub models: Vec<String>,
        /// Its role in a disaggregated prefill/decode pool (see `pd`): `decode`, `prefill` (never a
        /// destination, only named in `x-prefiller-host-port`) or `both`. Read only when `pd` is
        /// set. Default `decode`.
        #[serde(skip_serializing_if = "Role::is_decode")]
        pub role: Role = Role::Decode,
    }
}

settings! {
    /// One base model and its LoRA adapters.
    #[derive(Debug, Clone, PartialEq)]
    pub struct ModelConfig {
        /// The name clients put in the body's `model`, e.g. `meta-llama/Llama-3.1-8B-Instruct`.
        /// Unique across models and adapters.
        #[schema(length(min = 1))]
        pub name: String,
        /// LoRA adapters on this base model; a request naming one goes to an endpoint of this base.
        /// Unique across all models. Default: none.
        #[schema(inner(length(min = 1)))]
        pub adapters: Vec<String> = Vec::new(),
        /// Default priority of this model's requests, through `priority.criticality`; a trusted
        /// objective or tier header overrides it. Default `Standard`.
        pub criticality: Criticality = Criticality::Standard,
    }
}

// The readers of the enums (`crate::base::json`). `Role` keeps its serde derive too: snapshots
// carry it.
json::from_json_enum!(Role { "decode" => Decode, "prefill" => Prefill, "both" => Both, "prefill-decode" => Both });
json::from_json_enum!(Criticality { "Critical" => Critical, "Standard" => Standard, "Sheddable" => Sheddable });

/// Parses `ip:port` as the ORIGINAL_DST cluster needs it: a literal IPv4 or bracketed IPv6
/// address, a port in 1-65535, no hostname, no IPv6 zone.
pub fn parse_endpoint_address(s: &str) -> Result<SocketAddr, String> {
    let addr: SocketAddr = s.parse().map_err(|_| {
        format!(
            "{s:?} is not ip:port (IPv4 like 10.0.0.7:8000 or IPv6 like [fd00::7]:8000); hostnames are not \
             allowed because the ORIGINAL_DST cluster routes to the literal address"
        )
    })?;
    if addr.port() == 0 {
        return Err(format!("{s:?}: port must be in 1-65535"));
    }
    if addr.ip().is_unspecified() {
        return Err(format!("{s:?}: the unspecified address cannot be routed to"));
    }
    if let SocketAddr::V6(v6) = addr {
        if v6.scope_id() != 0 {
            return Err(format!("{s:?}: IPv6 zone ids are not supported"));
        }
    }
    Ok(addr)
}

/// The catalog as the wings read it: borrowed from the configuration (`config` builds it), never
/// owned twice.
#[derive(Debug, Clone, Copy)]
pub struct Catalog<'a> {
    pub endpoints: &'a [EndpointConfig],
    pub models: &'a [ModelConfig],
    /// The models discovery says its pods serve (`discovery.kubernetes.models`); empty without it.
    pub discovered_models: &'a [String],
    /// `pod_models` is on: the names pods report are served too, and a name pods run as a LoRA
    /// adapter resolves as one.
    pub learn_models: bool,
    /// `pod_models.allow_list`: only names the configuration mentions are learnt.
    pub allow_listed: bool,
}

impl Catalog<'_> {
    /// With `pod_models.allow_list`: every name the configuration mentions (models, adapters,
    /// the endpoints' and discovery's models). `None`: no allow-list (every reported name is
    /// learnt), or `pod_models` is off.
    pub fn allow_list(&self) -> Option<HashSet<String>> {
        if !(self.learn_models && self.allow_listed) {
            return None;
        }
        let mut s: HashSet<String> = HashSet::new();
        for m in self.models {
            s.insert(m.name.clone());
            s.extend(m.adapters.iter().cloned());
        }
        for e in self.endpoints {
            s.extend(e.models.iter().cloned());
        }
        s.extend(self.discovered_models.iter().cloned());
        Some(s)
    }
}
