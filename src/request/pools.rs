//! Several inference pools on one gateway, and body-based routing between them (GIE's Body-Based
//! Router, done by this module so the body is parsed once).
//!
//! # Model
//! Each pool is its own instance of the filter in Envoy's HTTP filter chain: its own plugin
//! (`pool.name`), configuration, `vm_id` (hence its own VMs, shared-data namespace and poller)
//! and metrics (every name carries the tag `pool=<name>`). Which instances run on a request is
//! decided by Envoy from the route the request's headers first match (`disabled: true` on the
//! listener, enabled per route or virtual host with `envoy.config.route.v3.FilterConfig`), so
//! routes that do not lead to a pool never reach the module.
//!
//! # Body-based routing (`pool.route_by_model`)
//! Every pool's instance is enabled on the inference routes; they run in chain order. For each
//! request, an instance:
//! 1. on the request headers: if an earlier instance already claimed the request (the stream's
//!    filter state `inference_picker_pool` is set; a client cannot set filter state), lets it
//!    through untouched. Otherwise removes any `x-gateway-model-name` (a client's copy must never
//!    choose a pool) and reads the body as usual;
//! 2. once the body is read: takes the parsed body an earlier instance handed over (filter state
//!    `inference_picker_parsed`, [`encode_parsed`]), else parses it, so the body is parsed once
//!    per request whatever the number of pools. If its pool does not serve the requested model
//!    (the scheduler answers `model_not_found`), lets the request on to the next instance,
//!    untouched, handing over the parsed body. Otherwise it claims the request (sets the filter state), sets
//!    `x-gateway-model-name` to the **base model** the request will be served by (after any
//!    rewrite rule, and an adapter's base: one header-match per base model routes all its
//!    adapters) and picks the endpoint in its own pool. Changing a request header makes Envoy
//!    clear the route cache (proxy-wasm ABI 0.2.1), so the router re-matches on the header and
//!    the route's cluster (the pool) takes the request.
//!
//! A request no pool claims keeps no `x-gateway-model-name`, re-matches the inference catch-all
//! route, and gets that route's direct JSON 404 `model_not_found`.
//!
//! How the module knows which pool the route chose: it does not read the route. Envoy 1.40 gives
//! a wasm filter no per-route configuration, and after a header change its route properties
//! (`xds.route_name`, `xds.route_metadata`, `xds.cluster_name`) still describe the route first
//! matched (checked in Envoy 1.40). So the pool is the one whose instance claimed the model, and
//! the route table must send that base model's header to that pool's cluster (both are generated
//! from the same InferencePools by `tools/config-from-crds`). If the two disagree, the chosen
//! address is not a member of the route's cluster and `override_host` refuses it (503): a request
//! never reaches a pod of another pool.

use crate::base::codec::{self, Tag, Writer};
use crate::base::errors::Rejection;
use crate::base::json::ConfigError;
use crate::base::settings::settings;
use crate::request::body::{ApiKind, ParsedRequest};

/// Request header naming the model routing sees (GIE's BBR header).
pub const MODEL_HEADER: &str = "x-gateway-model-name";
/// Stream filter-state key (`set_property`) naming the pool that claimed the request.
pub const CLAIM_PROPERTY: &str = "inference_picker_pool";
/// Stream filter-state key holding the parsed body a pool's filter passed on
/// ([`encode_parsed`]), so that the next pool's filter does not parse the body again.
pub const PARSED_PROPERTY: &str = "inference_picker_parsed";
/// Longest pool name.
pub const MAX_POOL_NAME: usize = 63;

settings! {
    /// This instance's pool on a gateway with several (see the module doc).
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct PoolConfig {
        /// Name of the pool: 1 to 63 characters from `a-z`, `0-9`, `-`, `.`, `_` (an InferencePool
        /// name). Becomes the tag `pool` on every metric of this instance and the claim value of
        /// body-based routing. Give every pool on a gateway its own name and its own `vm_id`.
        #[schema(length(min = 1, max = MAX_POOL_NAME))]
        pub name: String,
        /// Body-based routing between pools: requests for a model this pool does not serve pass on
        /// untouched to the next pool's filter (no 404 from this pool); a request it serves gets
        /// `x-gateway-model-name` = its base model, so that Envoy re-matches the route on it.
        /// Default false (every request reaching this filter belongs to this pool).
        pub route_by_model: bool = false,
    }
}

impl PoolConfig {
    pub fn validate(&self, at: &str, errs: &mut Vec<ConfigError>) {
        let ok = !self.name.is_empty()
            && self.name.len() <= MAX_POOL_NAME
            && self.name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-._".contains(&b));
        if !ok {
            errs.push(ConfigError::new(
                format!("{at}.name"),
                format!(
                    "{:?} is not a pool name: 1 to {MAX_POOL_NAME} characters from a-z, 0-9, '-', '.', '_'",
                    self.name
                ),
            ));
        }
    }
}

/// What an instance does with a request's headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadStep {
    /// Handle the request as usual (single pool, or unclaimed); with `strip_model_header`, first
    /// remove any `x-gateway-model-name`.
    Handle { strip_model_header: bool },
    /// Another pool's instance claimed it: let it through untouched.
    PassThrough,
}

/// The header step: `claimed_by` is the stream's claim filter state, if set.
pub fn on_head(pool: Option<&PoolConfig>, claimed_by: Option<&[u8]>) -> HeadStep {
    match pool {
        Some(p) if p.route_by_model => match claimed_by {
            Some(c) if !c.is_empty() => HeadStep::PassThrough,
            _ => HeadStep::Handle { strip_model_header: true },
        },
        _ => HeadStep::Handle { strip_model_header: false },
    }
}

/// The body step, after the request was parsed and its model resolved in this pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim<'a> {
    /// Single pool (no body-based routing): nothing to set.
    NotRouting,
    /// This pool serves it: set the claim and `x-gateway-model-name` to this base model.
    Claim { pool: &'a str, model_header: &'a str },
}

/// This pool serves the request (its model resolved to `base`).
pub fn claim<'a>(pool: Option<&'a PoolConfig>, base: &'a str) -> Claim<'a> {
    match pool {
        Some(p) if p.route_by_model => Claim::Claim { pool: &p.name, model_header: base },
        _ => Claim::NotRouting,
    }
}

/// Whether a rejection from resolving the request's model means "not this pool's model" and the
/// request should pass on to the next pool's instance (body-based routing only). Any other
/// rejection (bad body, no model, no capacity) is answered by this instance.
pub fn passes_on(pool: Option<&PoolConfig>, rejection: &Rejection) -> bool {
    matches!(pool, Some(p) if p.route_by_model) && rejection.code == "model_not_found"
}

/// The parsed body a filter passes on with the request, for the next pool's filter: the model,
/// the stream flag, the cache salt and the canonical prompt, length-prefixed (the API kind
/// follows from the path, which the next filter sees too). Filter state is set only by filters,
/// never by the client.
pub fn encode_parsed(p: &ParsedRequest) -> Vec<u8> {
    let mut w = Writer::new(Tag::ParsedRequest, 16 + p.model.len() + p.prompt.len());
    w.bool(p.stream).str(&p.model);
    w.opt(p.cache_salt.as_deref(), |w, salt| {
        w.str(salt);
    });
    w.str(&p.prompt);
    w.finish()
}

/// Reads what [`encode_parsed`] wrote (`crate::base::codec`, tag `ParsedRequest`: `bool stream ·
/// str model · opt str cache_salt · str prompt`); `None` for anything else, a record of a
/// version this build does not read included (then the filter parses the body itself). `kind`
/// comes from the request path.
pub fn decode_parsed(bytes: &[u8], kind: ApiKind) -> Option<ParsedRequest> {
    let mut r = codec::open(bytes, Tag::ParsedRequest).ok()?;
    let stream = r.bool()?;
    let model = r.string(usize::MAX)?;
    let cache_salt = r.opt(|r| r.string(usize::MAX))?;
    let prompt = r.string(usize::MAX)?;
    r.finish()?;
    if model.is_empty() {
        return None;
    }
    Some(ParsedRequest { kind, model, stream, cache_salt, prompt })
}

/// The suffix every metric name of this instance carries (`;pool=<name>`), empty for a single
/// unnamed pool.
pub fn metric_suffix(pool: Option<&PoolConfig>) -> String {
    match pool {
        Some(p) => format!(";pool={}", p.name),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(name: &str, route_by_model: bool) -> PoolConfig {
        PoolConfig { name: name.to_string(), route_by_model }
    }

    #[test]
    fn names_are_checked() {
        for good in ["a", "llama-pool", "pool.v2_b", &"x".repeat(MAX_POOL_NAME)] {
            let mut errs = Vec::new();
            pool(good, false).validate("pool", &mut errs);
            assert!(errs.is_empty(), "{good}: {errs:?}");
        }
        for bad in ["", "Llama", "a b", "a;b", "a=b", &"x".repeat(MAX_POOL_NAME + 1)] {
            let mut errs = Vec::new();
            pool(bad, false).validate("pool", &mut errs);
            assert_eq!(errs.len(), 1, "{bad:?}");
            assert_eq!(errs[0].path, "pool.name");
            assert!(errs[0].reason.contains("not a pool name"), "{}", errs[0].reason);
        }
    }

    #[test]
    fn head_strips_the_client_header_unless_claimed() {
        let p = pool("a", true);
        assert_eq!(on_head(Some(&p), None), HeadStep::Handle { strip_model_header: true });
        // An empty value is "not set" (shared data and filter state have no delete).
        assert_eq!(on_head(Some(&p), Some(b"")), HeadStep::Handle { strip_model_header: true });
        assert_eq!(on_head(Some(&p), Some(b"b")), HeadStep::PassThrough);
        // Without body-based routing a claim means nothing and the header is left alone.
        assert_eq!(
            on_head(Some(&pool("a", false)), Some(b"b")),
            HeadStep::Handle { strip_model_header: false }
        );
        assert_eq!(on_head(None, Some(b"b")), HeadStep::Handle { strip_model_header: false });
    }

    #[test]
    fn unknown_model_passes_on_only_when_routing_by_model() {
        let nf = Rejection::new(404, "invalid_request_error", "model_not_found", "x");
        let bad = Rejection::new(400, "invalid_request_error", "missing_model", "x");
        let full = Rejection::new(429, "rate_limit_exceeded", "saturated", "x");
        assert!(passes_on(Some(&pool("a", true)), &nf));
        assert!(!passes_on(Some(&pool("a", true)), &bad));
        assert!(!passes_on(Some(&pool("a", true)), &full));
        assert!(!passes_on(Some(&pool("a", false)), &nf));
        assert!(!passes_on(None, &nf));
    }

    #[test]
    fn claim_names_the_base_model() {
        let p = pool("llama", true);
        assert_eq!(
            claim(Some(&p), "meta-llama/L"),
            Claim::Claim { pool: "llama", model_header: "meta-llama/L" }
        );
        assert_eq!(claim(Some(&pool("llama", false)), "m"), Claim::NotRouting);
        assert_eq!(claim(None, "m"), Claim::NotRouting);
    }

    #[test]
    fn parsed_body_round_trips_and_garbage_is_refused() {
        let p = ParsedRequest {
            kind: ApiKind::ChatCompletions,
            model: "Qwen/Qwen2.5-7B-Instruct".into(),
            stream: true,
            cache_salt: Some("tenant-1".into()),
            prompt: "system: you are\nuser: héllo".into(),
        };
        let b = encode_parsed(&p);
        assert_eq!(decode_parsed(&b, ApiKind::ChatCompletions), Some(p.clone()));
        let no_salt = ParsedRequest { cache_salt: None, stream: false, prompt: String::new(), ..p.clone() };
        assert_eq!(decode_parsed(&encode_parsed(&no_salt), ApiKind::ChatCompletions), Some(no_salt));
        // Every truncation, a trailing byte, another version, a bad flag: refused, never a panic.
        for n in 0..b.len() {
            assert_eq!(decode_parsed(&b[..n], ApiKind::ChatCompletions), None, "cut at {n}");
        }
        let mut longer = b.clone();
        longer.push(0);
        assert_eq!(decode_parsed(&longer, ApiKind::ChatCompletions), None);
        let mut other = b.clone();
        other[1] = Tag::ParsedRequest.current() + 9;
        assert_eq!(decode_parsed(&other, ApiKind::ChatCompletions), None);
        let mut flag = b.clone();
        flag[2] = 7;
        assert_eq!(decode_parsed(&flag, ApiKind::ChatCompletions), None);
        // A length past the end.
        let v = Tag::ParsedRequest.write_version();
        assert_eq!(
            decode_parsed(&[Tag::ParsedRequest as u8, v, 0, 255, 255, 255, 255, b'a'], ApiKind::Other),
            None
        );
        // The next release's record: read by the next release only (then this one parses the
        // body itself).
        let next = codec::as_next(&b, Tag::ParsedRequest);
        assert_eq!(decode_parsed(&next, ApiKind::ChatCompletions).is_some(), cfg!(feature = "codec-next"));
        // An empty model is not a parsed request (the parser refuses it too).
        let empty = ParsedRequest { model: String::new(), ..p };
        assert_eq!(decode_parsed(&encode_parsed(&empty), ApiKind::ChatCompletions), None);
    }

    #[test]
    fn metric_suffix_names_the_pool() {
        assert_eq!(metric_suffix(Some(&pool("a", false))), ";pool=a");
        assert_eq!(metric_suffix(None), "");
    }
}
