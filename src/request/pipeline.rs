//! Prepare, then route: with the complete body, [`prepare`] parses it and resolves the model and
//! the priority ([`Prepared`], kept while flow control holds the request); when the request goes
//! on, [`route`] picks the endpoint with the state of that moment. [`on_body`] does both at once
//! for a request that is never held.

use crate::base::errors::Rejection;
use crate::base::ports::Rng;
use crate::flow::priority::PriorityDecision;
use crate::flow::slo;
use crate::request::body::{parse_request, rewrite_model};
use crate::request::config::Settings;
use crate::request::head::{restrict_to_selection, too_large, RequestHead};
use crate::request::pd;
use crate::scheduler::{ModelRoute, Pick, PickInput, PickRequest, PickScope, PickState, Scheduler, SloAsk};
use crate::state::catalog::Criticality;
use crate::state::snapshot::Snapshot;

/// What to do with a routed request.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    pub pick: Pick,
    /// The prefill pod of a split P/D request (`pd::PdPick::prefiller`).
    pub prefiller: Option<String>,
    /// The model the client asked for.
    pub requested_model: String,
    /// A replacement body when the model was rewritten (content-length must follow).
    pub new_body: Option<Vec<u8>>,
}

/// A request whose body is parsed and whose model and priority are known; the endpoint is not
/// chosen yet. Kept while the request is held (the prompt is needed by the prefix scorer).
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    /// The model the client asked for.
    pub requested_model: String,
    /// The model it is sent as, and the base model whose endpoints serve it (the flow-control
    /// group).
    pub route: ModelRoute,
    pub prompt: String,
    pub cache_salt: Option<String>,
    /// A replacement body when the model was rewritten (content-length must follow).
    pub new_body: Option<Vec<u8>>,
    pub priority: PriorityDecision,
}

/// The criticality that sets a request's default priority: that of the configured base model
/// the client named (directly or through one of its adapters), else that of the base model the
/// request is sent to after rewrites, else `Standard` (a discovered model has none configured).
/// The client's name comes first because criticality describes the traffic clients send under
/// that name (GIE's InferenceModel put it on the client-facing name, next to its rewrites).
pub fn criticality_of(cfg: &Settings<'_>, requested: &str, base: &str) -> Criticality {
    let by_name = |name: &str| {
        cfg.catalog
            .models
            .iter()
            .find(|m| m.name == name || m.adapters.iter().any(|a| a == name))
            .map(|m| m.criticality)
    };
    by_name(requested).or_else(|| by_name(base)).unwrap_or_default()
}

/// Called with the complete body: parse, resolve the model (rewrite or split, base model),
/// rewrite the body, resolve the priority. No endpoint is chosen here.
pub fn prepare(
    cfg: &Settings<'_>,
    scheduler: &Scheduler,
    rng: &mut dyn Rng,
    head: &RequestHead,
    body: &[u8],
    snapshot: &Snapshot,
) -> Result<Prepared, Rejection> {
    if body.len() > cfg.filter.max_body_bytes {
        return Err(too_large(cfg));
    }
    let parsed = parse_request(&head.path, body)?;
    let route = scheduler.route_model(&parsed.model, head.session_id.as_deref(), snapshot, rng)?;
    prepare_routed(cfg, head, parsed, route, body)
}

/// The rest of [`prepare`] once the body is parsed and its model resolved: body rewrite,
/// priority, the prompt kept for the prefix scorer. Body-based routing between pools
/// (`crate::request::pools`) calls the steps separately, so that a body another pool's filter already
/// parsed is not parsed again; `body` is read again only for a model rewrite.
pub fn prepare_routed(
    cfg: &Settings<'_>,
    head: &RequestHead,
    parsed: crate::request::body::ParsedRequest,
    route: ModelRoute,
    body: &[u8],
) -> Result<Prepared, Rejection> {
    let new_body = if route.model_rewritten { Some(rewrite_model(body, &route.target_model)?) } else { None };
    let criticality = criticality_of(cfg, &parsed.model, &route.base);
    let priority = head.priority.resolve(cfg.priority, criticality);
    // A held request keeps only what the prefix scorer hashes (bounded memory per held request).
    let mut prompt = parsed.prompt;
    let hashed = cfg.prefix.block_chars.saturating_mul(cfg.prefix.max_blocks);
    truncate_prompt(&mut prompt, hashed);
    Ok(Prepared {
        requested_model: parsed.model,
        route,
        prompt,
        cache_salt: parsed.cache_salt,
        new_body,
        priority,
    })
}

/// The request's facts as the scheduler reads them ([`PickRequest`]), and the snapshot narrowed
/// to the conformance test's endpoint selection when it sent one (`None`: use the whole
/// snapshot).
fn pick_request<'a>(
    cfg: &Settings<'_>,
    head: &'a RequestHead,
    prepared: &'a Prepared,
    snapshot: &Snapshot,
) -> Result<(PickRequest<'a>, Option<Snapshot>), Rejection> {
    let req = PickRequest {
        model: &prepared.requested_model,
        prompt: &prepared.prompt,
        cache_salt: prepared.cache_salt.as_deref(),
        session_id: head.session_id.as_deref(),
        session_token: head.session_token.as_deref(),
        slo: slo_ask(cfg, &prepared.priority),
    };
    let restricted = match &head.test_selection {
        Some(sel) => Some(restrict_to_selection(snapshot, sel)?),
        None => None,
    };
    Ok((req, restricted))
}

/// The scheduler's view of a request's TTFT target (`crate::flow::slo`): the budget below the
/// target by `priority.slo.margin`, the tightest configured budget, whether it may be shed.
/// `None` without a target.
pub fn slo_ask(cfg: &Settings<'_>, priority: &PriorityDecision) -> Option<SloAsk> {
    let margin = cfg.priority.slo.margin;
    priority.targets.ttft_ms.map(|t| SloAsk {
        budget_ms: slo::budget_ms(t, margin),
        tightest_budget_ms: cfg.priority.tightest_ttft_ms().map(|x| slo::budget_ms(x, margin)),
        sheddable: priority.sheddable(),
        retry_after_s: cfg.retry_after_s,
    })
}

/// Cuts `prompt` to the first `max_bytes` bytes, or just past them to the next character
/// boundary (at most 3 bytes more), so that every full block the prefix scorer hashes
/// (`block_chars × max_blocks` bytes) is kept byte for byte and the hashes are unchanged.
pub fn truncate_prompt(prompt: &mut String, max_bytes: usize) {
    if prompt.len() <= max_bytes {
        return;
    }
    let cut = (max_bytes..=prompt.len()).find(|&i| prompt.is_char_boundary(i)).unwrap_or(prompt.len());
    prompt.truncate(cut);
    prompt.shrink_to_fit();
}

/// Picks the endpoint for a prepared request with the state of the moment it goes on (the
/// filter's, and the replay's, one entry point): the request's facts and `state` become one
/// [`PickInput`] for `pd::pick` (the decode pick, and the prefill pick when P/D splits the
/// request; exactly [`Scheduler::pick`] without a `pd` section). Conformance mode: the test's
/// endpoint selection narrows every pick.
pub fn route(
    cfg: &Settings<'_>,
    scheduler: &mut Scheduler,
    rng: &mut dyn Rng,
    head: &RequestHead,
    prepared: &Prepared,
    state: PickState<'_>,
) -> Result<pd::PdPick, Rejection> {
    let (request, restricted) = pick_request(cfg, head, prepared, state.snapshot)?;
    let state = PickState { snapshot: restricted.as_ref().unwrap_or(state.snapshot), ..state };
    let input = PickInput { route: &prepared.route, request, state, scope: PickScope::default(), rng };
    pd::pick(cfg, scheduler, input)
}

/// Picks the pod of a prepared token count (`POST /v1/messages/count_tokens`), which is not a
/// generation: the pod only tokenizes, in milliseconds, with no GPU work and no KV cache. So the
/// scheduler's least-loaded pick ([`Scheduler::pick_least_loaded`]: the healthy, non-ejected
/// pods serving the model, fewest in flight, equal counts at random), not the predicted-TTFT
/// one: no prefix placement, no prefill in the ledger, no score. With a `pd` section only the
/// pods that decode are candidates (where every request of the model enters). Conformance
/// mode: the test's endpoint selection narrows the pick. Flow control is the caller's to skip.
pub fn route_token_count(
    cfg: &Settings<'_>,
    scheduler: &Scheduler,
    rng: &mut dyn Rng,
    head: &RequestHead,
    prepared: &Prepared,
    state: PickState<'_>,
) -> Result<Pick, Rejection> {
    let (request, restricted) = pick_request(cfg, head, prepared, state.snapshot)?;
    // A token count has no latency target to meet.
    let request = PickRequest { slo: None, ..request };
    let state = PickState { snapshot: restricted.as_ref().unwrap_or(state.snapshot), ..state };
    let decodes = |e: &crate::state::snapshot::EndpointStatus| e.role.decodes();
    let scope = PickScope { allow: cfg.pd.map(|_| &decodes as &dyn Fn(&_) -> bool), ..PickScope::default() };
    scheduler.pick_least_loaded(PickInput { route: &prepared.route, request, state, scope, rng })
}

/// [`prepare`] then [`route`] at once, for a request that is never held.
pub fn on_body(
    cfg: &Settings<'_>,
    scheduler: &mut Scheduler,
    rng: &mut dyn Rng,
    head: &RequestHead,
    body: &[u8],
    state: PickState<'_>,
) -> Result<Routed, Rejection> {
    let prepared = prepare(cfg, scheduler, rng, head, body, state.snapshot)?;
    let routed = route(cfg, scheduler, rng, head, &prepared, state)?;
    Ok(Routed {
        pick: routed.pick,
        prefiller: routed.prefiller,
        requested_model: prepared.requested_model,
        new_body: prepared.new_body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::ports::{MemStore, SplitMix64};
    use crate::flow::priority::PriorityHeaders;
    use crate::flow::priority::PrioritySource;
    use crate::request::tests_support::cfg;
    use crate::state::health::HealthView;
    use crate::state::inflight::InflightCounts;
    use crate::state::metrics::EndpointMetrics;
    use crate::state::snapshot::EndpointStatus;

    #[test]
    fn held_prompt_is_cut_to_what_the_prefix_scorer_hashes_with_the_same_hashes() {
        use crate::scheduler::prefix::{block_hashes, seed};
        // 'é' is 2 bytes: the cut at 10 falls inside a character and moves just past it.
        let full: String = "ab".repeat(4) + &"é".repeat(100);
        let mut p = full.clone();
        truncate_prompt(&mut p, 9);
        assert_eq!(p.len(), 10);
        assert!(full.starts_with(&p));
        let (mut a, mut b) = (Vec::new(), Vec::new());
        block_hashes(&full, seed("m", None), 3, 3, &mut a);
        block_hashes(&p, seed("m", None), 3, 3, &mut b);
        assert_eq!(a, b);
        let mut short = "hi".to_string();
        truncate_prompt(&mut short, 9);
        assert_eq!(short, "hi");
        // prepare() keeps at most block_chars × max_blocks (+3) bytes of a huge prompt.
        let c = cfg();
        let sched = Scheduler::new(&c);
        let mut rng = SplitMix64::new(1);
        let big = "x".repeat(1 << 20);
        let body = format!(r#"{{"model":"base-a","prompt":"{big}"}}"#);
        let pr = prepare(
            &c.request(),
            &sched,
            &mut rng,
            &head(PriorityHeaders::default()),
            body.as_bytes(),
            &snapshot(),
        )
        .unwrap();
        let cap = c.scheduler.prefix.block_chars * c.scheduler.prefix.max_blocks;
        assert!(pr.prompt.len() <= cap + 3 && pr.prompt.len() >= cap, "{}", pr.prompt.len());
        assert!(pr.prompt.capacity() <= cap + 3);
    }

    fn snapshot() -> Snapshot {
        let ep = |a: &str, m: &str| EndpointStatus {
            address: a.into(),
            models: vec![m.into()],
            metrics: Some(EndpointMetrics {
                queue: Some(0.0),
                kv_usage: Some(0.0),
                ..EndpointMetrics::default()
            }),
            scraped_ms: 1000,
            failures: 0,
            inflight_at_scrape: None,
            role: Default::default(),
            poll_ms: 0,
        };
        Snapshot {
            version: 1,
            published_ms: 1000,
            endpoints: vec![ep("10.0.0.1:8000", "base-a"), ep("10.0.0.2:8000", "base-b")],
        }
    }

    fn head(priority: PriorityHeaders) -> RequestHead {
        RequestHead {
            method: "POST".into(),
            path: "/v1/completions".into(),
            priority,
            ..RequestHead::default()
        }
    }

    #[test]
    fn criticality_follows_the_name_the_client_used() {
        let c = cfg();
        // A configured base, and an adapter of it: that base's criticality.
        assert_eq!(criticality_of(&c.request(), "base-a", "base-b"), Criticality::Critical);
        assert_eq!(criticality_of(&c.request(), "lora-a", "base-a"), Criticality::Critical);
        // An alias that is only a rewrite source: the criticality of where it is sent.
        assert_eq!(criticality_of(&c.request(), "alias", "base-b"), Criticality::Sheddable);
        // A discovered model nobody configured: Standard.
        assert_eq!(criticality_of(&c.request(), "found", "found"), Criticality::Standard);
    }

    #[test]
    fn prepare_resolves_route_rewrite_and_priority_without_picking() {
        let c = cfg();
        let sched = Scheduler::new(&c);
        let mut rng = SplitMix64::new(1);
        let body = br#"{"model":"base-a","prompt":"hi"}"#;
        // base-a is rewritten to base-b (group base-b), but keeps base-a's Critical priority (10).
        let p = prepare(&c.request(), &sched, &mut rng, &head(PriorityHeaders::default()), body, &snapshot())
            .unwrap();
        assert_eq!((p.route.base.as_str(), p.route.model_rewritten), ("base-b", true));
        assert_eq!(p.new_body.as_deref(), Some(&br#"{"model":"base-b","prompt":"hi"}"#[..]));
        assert_eq!((p.priority.priority, p.priority.source), (10, PrioritySource::Model));
        assert_eq!(p.priority.fairness_id, "default-flow");
        // A trusted objective wins over the model; the untrusted tier value was never read
        // (PriorityHeaders::read would not fill it), and here it is absent anyway.
        let h = PriorityHeaders { objective: Some("batch".into()), ..PriorityHeaders::default() };
        let p = prepare(
            &c.request(),
            &sched,
            &mut rng,
            &head(h),
            br#"{"model":"alias","prompt":"x"}"#,
            &snapshot(),
        )
        .unwrap();
        assert_eq!((p.priority.priority, p.priority.source), (-20, PrioritySource::Objective));
        // Unknown model: 404 before any admission.
        let e = prepare(
            &c.request(),
            &sched,
            &mut rng,
            &head(PriorityHeaders::default()),
            br#"{"model":"nope"}"#,
            &snapshot(),
        );
        assert_eq!(e.unwrap_err().status, 404);
    }

    #[test]
    fn route_later_picks_among_the_groups_endpoints() {
        let c = cfg();
        let mut sched = Scheduler::new(&c);
        let mut rng = SplitMix64::new(7);
        let h = head(PriorityHeaders::default());
        let p =
            prepare(&c.request(), &sched, &mut rng, &h, br#"{"model":"alias","prompt":"x"}"#, &snapshot())
                .unwrap();
        let store = MemStore::new();
        let counts = InflightCounts::default();
        let snap = snapshot();
        let health = HealthView::default();
        let inputs =
            PickState { snapshot: &snap, inflight: &counts, health: &health, store: &store, now_ms: 1100 };
        let pick = route(&c.request(), &mut sched, &mut rng, &h, &p, inputs).unwrap().pick;
        // Only 10.0.0.2 serves base-b; the target model is the rewrite's.
        assert_eq!((pick.primary.as_str(), pick.target_model.as_str()), ("10.0.0.2:8000", "base-b"));
        // on_body (prepare + route at once) agrees.
        let r = on_body(&c.request(), &mut sched, &mut rng, &h, br#"{"model":"alias","prompt":"x"}"#, inputs)
            .unwrap();
        assert_eq!((r.pick.primary.as_str(), r.requested_model.as_str()), ("10.0.0.2:8000", "alias"));
    }

    #[test]
    fn a_token_count_goes_to_the_least_loaded_pod_of_its_model_and_records_nothing() {
        use crate::scheduler::PickReason;
        let c = cfg();
        let sched = Scheduler::new(&c);
        let mut rng = SplitMix64::new(5);
        let mut h = RequestHead {
            method: "POST".into(),
            path: "/v1/messages/count_tokens?beta=true".into(),
            ..RequestHead::default()
        };
        assert!(h.is_count_tokens() && !head(PriorityHeaders::default()).is_count_tokens());
        // No max_tokens; the model is resolved and rewritten as for a message (alias → base-b).
        let body = br#"{"model":"alias","messages":[{"role":"user","content":"how many?"}]}"#;
        let p = prepare(&c.request(), &sched, &mut rng, &h, body, &snapshot()).unwrap();
        assert_eq!((p.route.base.as_str(), p.route.model_rewritten), ("base-b", true));
        let store = MemStore::new();
        let counts = InflightCounts::default();
        let snap = snapshot();
        let health = HealthView::default();
        let inputs =
            PickState { snapshot: &snap, inflight: &counts, health: &health, store: &store, now_ms: 1100 };
        let pick = route_token_count(&c.request(), &sched, &mut rng, &h, &p, inputs).unwrap();
        assert_eq!(
            (pick.primary.as_str(), pick.reason, pick.ticket, pick.target_model.as_str()),
            ("10.0.0.2:8000", PickReason::TokenCount, 0, "base-b")
        );
        assert_eq!(store.key_count(), 0);
        // An unknown model is the 404 of /v1/messages, before any pick.
        let e = prepare(&c.request(), &sched, &mut rng, &h, br#"{"model":"nope","messages":[]}"#, &snap);
        assert_eq!(e.map_err(|r| (r.status, r.code)).unwrap_err(), (404, "model_not_found"));
        // The conformance test's selection narrows it too.
        h.test_selection = Some(vec!["10.0.0.1".into()]);
        let e = route_token_count(&c.request(), &sched, &mut rng, &h, &p, inputs).unwrap_err();
        assert_eq!((e.status, e.code), (503, "no_endpoint"));
    }

    #[test]
    fn with_a_pd_section_a_token_count_goes_to_a_pod_that_decodes() {
        use crate::state::catalog::Role;
        let c = crate::config::Config::from_json(
            br#"{"version":1,"endpoints":[{"address":"10.0.0.1:8000","models":["m"],"role":"prefill"},
                {"address":"10.0.0.2:8000","models":["m"],"role":"decode"}],
                "models":[{"name":"m"}],"pd":{}}"#,
        )
        .unwrap();
        let sched = Scheduler::new(&c);
        let h = RequestHead {
            method: "POST".into(),
            path: "/v1/messages/count_tokens".into(),
            ..RequestHead::default()
        };
        let mut snap = snapshot();
        for (e, role) in snap.endpoints.iter_mut().zip([Role::Prefill, Role::Decode]) {
            e.models = vec!["m".into()];
            e.role = role;
        }
        let body = br#"{"model":"m","messages":[]}"#;
        let (store, counts, health) = (MemStore::new(), InflightCounts::default(), HealthView::default());
        let inputs =
            PickState { snapshot: &snap, inflight: &counts, health: &health, store: &store, now_ms: 1100 };
        for seed in 0..10 {
            let mut rng = SplitMix64::new(seed);
            let p = prepare(&c.request(), &sched, &mut rng, &h, body, &snap).unwrap();
            let pick = route_token_count(&c.request(), &sched, &mut rng, &h, &p, inputs).unwrap();
            assert_eq!((pick.primary.as_str(), pick.fallbacks.len()), ("10.0.0.2:8000", 0));
        }
    }

    #[test]
    fn routing_honours_the_selection() {
        let c = cfg();
        let mut sched = Scheduler::new(&c);
        let mut rng = SplitMix64::new(3);
        let mut h = head(PriorityHeaders::default());
        // base-b is served only by 10.0.0.2; a selection naming 10.0.0.1 leaves nothing.
        let p =
            prepare(&c.request(), &sched, &mut rng, &h, br#"{"model":"alias","prompt":"x"}"#, &snapshot())
                .unwrap();
        let store = MemStore::new();
        let counts = InflightCounts::default();
        let snap = snapshot();
        let health = HealthView::default();
        let inputs =
            PickState { snapshot: &snap, inflight: &counts, health: &health, store: &store, now_ms: 1100 };
        h.test_selection = Some(vec!["10.0.0.1".into()]);
        assert_eq!(route(&c.request(), &mut sched, &mut rng, &h, &p, inputs).map_err(|r| r.status), Err(503));
        h.test_selection = Some(vec!["10.0.0.2:8000".into()]);
        assert_eq!(
            route(&c.request(), &mut sched, &mut rng, &h, &p, inputs).unwrap().pick.primary,
            "10.0.0.2:8000"
        );
    }
}
