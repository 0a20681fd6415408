use serde_json::{json, Value};

use crate::base::errors::{ErrorShape, Rejection};
use crate::base::ports::SplitMix64;
use crate::flow::priority::{PriorityHeaders, PrioritySource};
use crate::request::body::{parse_request, rewrite_model, ApiKind, ParsedRequest};
use crate::request::head::RequestHead;
use crate::request::pipeline::prepare;
use crate::request::tests_support::cfg;
use crate::scheduler::Scheduler;
use crate::state::metrics::EndpointMetrics;
use crate::state::snapshot::{EndpointStatus, Snapshot};

const PATH: &str = "/v1/messages";

fn parse(body: &Value) -> Result<ParsedRequest, Rejection> {
    parse_request(PATH, body.to_string().as_bytes())
}

fn prompt(body: Value) -> String {
    parse(&body).unwrap().prompt
}

fn chat_prompt(body: Value) -> String {
    parse_request("/v1/chat/completions", body.to_string().as_bytes()).unwrap().prompt
}

#[test]
fn model_stream_and_the_same_text_as_the_chat_body_of_the_conversation() {
    let r = parse(&json!({"model": "m", "max_tokens": 16, "stream": true, "system": "Be brief.",
        "messages": [{"role": "user", "content": "Hi"}]}))
    .unwrap();
    assert_eq!((r.kind, r.model.as_str(), r.stream, r.cache_salt), (ApiKind::Messages, "m", true, None));
    assert_eq!(r.prompt, "system\nBe brief.\u{1e}user\nHi\u{1e}");
    // The same conversation as a chat body hashes the same blocks: system blocks and text blocks
    // are written as chat text parts are.
    let anthropic = prompt(json!({"model": "m", "max_tokens": 1,
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                     {"role": "assistant", "content": "Hello"},
                     {"role": "user", "content": "Bye"}]}));
    let chat = chat_prompt(json!({"model": "m", "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]}));
    assert_eq!(anthropic, chat);
    // Not streamed unless asked; a query string or a trailing slash is the same path.
    let r =
        parse_request("/v1/messages/?beta=true", br#"{"model":"m","max_tokens":1,"messages":[]}"#).unwrap();
    assert_eq!((r.kind, r.stream, r.prompt.as_str()), (ApiKind::Messages, false, ""));
}

#[test]
fn every_block_type_is_written_as_documented() {
    let p = prompt(json!({"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
            {"type": "image", "source": {"type": "url", "url": "https://x/i.png"}},
            {"type": "document", "source": {"type": "file", "file_id": "file_1"}},
            {"type": "image", "source": "not an object"},
            {"text": "untyped"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "sig"},
            {"type": "redacted_thinking", "data": "xyz"},
            {"type": "text", "text": "calling"},
            {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a.rs", "n": [1, 2]}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "fn main() {}", "cache_control": {"type": "ephemeral"}},
            {"type": "tool_result", "tool_use_id": "t2", "is_error": true,
             "content": [{"type": "text", "text": "e1"}, {"type": "image", "source": {"type": "url", "url": "u"}}]},
            {"type": "tool_result", "tool_use_id": "t3"},
            {"type": "search_result", "source": "https://s", "title": "t", "content": [{"type": "text", "text": "s"}]}]}]}));
    assert_eq!(
        p,
        "user\nlook[image:iVBOR][image:https://x/i.png][document:file_1][image]untyped\u{1e}\
         assistant\n[thinking]hmm[redacted_thinking]calling[tool_use:read({\"n\":[1,2],\"path\":\"a.rs\"})]\u{1e}\
         user\n[tool_result]fn main() {}[tool_result]e1[image:u][tool_result][search_result]\u{1e}"
    );
}

#[test]
fn tools_come_first_without_their_cache_control() {
    let tools = json!([{"name": "read", "description": "Read a file", "input_schema": {"type": "object"}},
                       {"name": "write", "input_schema": {}, "cache_control": {"type": "ephemeral"}}]);
    let p = prompt(
        json!({"model": "m", "max_tokens": 1, "tools": tools, "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(
        p,
        "[tools][{\"description\":\"Read a file\",\"input_schema\":{\"type\":\"object\"},\"name\":\"read\"},\
         {\"input_schema\":{},\"name\":\"write\"}]\u{1e}user\nx\u{1e}"
    );
    // Moving the marker changes nothing; `tools: null` is no tools.
    let moved = json!([{"name": "read", "description": "Read a file", "input_schema": {"type": "object"},
                        "cache_control": {"type": "ephemeral"}}, {"name": "write", "input_schema": {}}]);
    let q = prompt(
        json!({"model": "m", "max_tokens": 1, "tools": moved, "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(p, q);
    let none = prompt(
        json!({"model": "m", "max_tokens": 1, "tools": null, "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(none, "user\nx\u{1e}");
}

#[test]
fn a_coding_agents_next_turn_starts_with_the_text_of_the_last() {
    // The agent's loop: the cache marker sits on the newest block of each request, and moves.
    let eph = json!({"type": "ephemeral"});
    let system = json!([{"type": "text", "text": "You are a coding agent.", "cache_control": eph}]);
    let t1 = json!({"model": "m", "max_tokens": 64, "system": system, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "fix the bug", "cache_control": eph}]}]});
    let t2 = json!({"model": "m", "max_tokens": 64, "system": system, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "fix the bug"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a.rs"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "fn a() {}",
                                      "cache_control": eph}]}]});
    let (p1, p2) = (prompt(t1), prompt(t2));
    assert!(p2.starts_with(&p1), "{p1:?}\n{p2:?}");
    assert!(p2.len() > p1.len());
}

#[test]
fn what_anthropic_requires_is_a_400_in_its_shape() {
    let cases = [
        (json!({"model": "m", "messages": []}), "missing_max_tokens"),
        (json!({"model": "m", "max_tokens": null, "messages": []}), "missing_max_tokens"),
        (json!({"model": "m", "max_tokens": 0, "messages": []}), "invalid_max_tokens"),
        (json!({"model": "m", "max_tokens": -1, "messages": []}), "invalid_max_tokens"),
        (json!({"model": "m", "max_tokens": 1.5, "messages": []}), "invalid_max_tokens"),
        (json!({"model": "m", "max_tokens": "5", "messages": []}), "invalid_max_tokens"),
        (json!({"model": "m", "max_tokens": 5}), "missing_messages"),
        (json!({"model": "m", "max_tokens": 5, "messages": null}), "missing_messages"),
        (json!({"max_tokens": 5, "messages": []}), "missing_model"),
        (json!({"model": " ", "max_tokens": 5, "messages": []}), "missing_model"),
        (json!({"model": 7, "max_tokens": 5, "messages": []}), "invalid_model"),
        (json!({"model": "m", "max_tokens": 5, "messages": "hi"}), "invalid_json"),
        (json!({"model": "m", "max_tokens": 5, "messages": [5]}), "invalid_json"),
        (json!({"model": "m", "max_tokens": 5, "messages": [{"role": 1}]}), "invalid_json"),
        (json!({"model": "m", "max_tokens": 5, "messages": [], "stream": "yes"}), "invalid_json"),
        (json!("a string"), "invalid_json"),
    ];
    for (body, code) in cases {
        let e = parse(&body).unwrap_err();
        assert_eq!((e.status, e.code), (400, code), "{body}");
        let v: Value = serde_json::from_slice(&e.body_in(ErrorShape::Anthropic)).unwrap();
        assert_eq!(
            (v["type"].as_str(), v["error"]["type"].as_str()),
            (Some("error"), Some("invalid_request_error"))
        );
    }
    for body in [
        &b"not json"[..],
        b"{\"model\":\"m\"",
        b"{\"model\":\"a\",\"model\":\"b\",\"max_tokens\":1,\"messages\":[]}",
    ] {
        assert_eq!(parse_request(PATH, body).unwrap_err().code, "invalid_json");
    }
}

#[test]
fn a_token_count_is_a_messages_body_without_max_tokens() {
    const COUNT: &str = "/v1/messages/count_tokens";
    let count = |body: &Value| parse_request(COUNT, body.to_string().as_bytes());
    let conversation = json!({"model": "m", "system": "Be brief.", "tools": [{"name": "t", "input_schema": {}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]});
    let r = count(&conversation).unwrap();
    assert_eq!((r.kind, r.model.as_str(), r.stream), (ApiKind::CountTokens, "m", false));
    // The same text as the message it counts for.
    let mut message = conversation.clone();
    message["max_tokens"] = json!(8);
    assert_eq!(r.prompt, parse(&message).unwrap().prompt);
    // A max_tokens it sends is left to the pod, whatever it is.
    for m in [json!(8), json!(0), json!("x"), json!(null)] {
        let mut body = conversation.clone();
        body["max_tokens"] = m;
        assert_eq!(count(&body).unwrap().prompt, r.prompt);
    }
    // Everything else is checked as on /v1/messages.
    for (body, code) in [
        (json!({"model": "m"}), "missing_messages"),
        (json!({"messages": []}), "missing_model"),
        (json!({"model": 7, "messages": []}), "invalid_model"),
        (json!({"model": "m", "messages": [5]}), "invalid_json"),
        (json!("a string"), "invalid_json"),
    ] {
        let e = count(&body).unwrap_err();
        assert_eq!((e.status, e.code), (400, code), "{body}");
    }
    // On /v1/messages the same body without max_tokens is still a 400.
    assert_eq!(parse(&conversation).unwrap_err().code, "missing_max_tokens");
}

#[test]
fn odd_content_is_left_to_the_model_server() {
    // Shapes Anthropic would refuse, but that the filter does not need: routed, their text
    // skipped; the pod answers them.
    let p = prompt(json!({"model": "m", "max_tokens": 1, "system": {"not": "text"}, "messages": [
        {"role": "user", "content": {"type": "text", "text": "an object"}},
        {"role": "user", "content": 5},
        {"role": "user", "content": [5, "str", null, [1], {"type": 3, "text": ["x"]}, {"type": "text", "text": {"a": 1}}]},
        {"content": "no role"},
        {"role": "assistant"}]}));
    assert_eq!(p, "system\n\u{1e}user\n\u{1e}user\n\u{1e}user\n\u{1e}user\nno role\u{1e}assistant\n\u{1e}");
}

#[test]
fn the_model_rewrite_keeps_the_rest_of_the_body() {
    let body = json!({"model": "alias", "max_tokens": 8, "system": "s",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "say \"model\": x", "model": "inner"}]}]})
    .to_string();
    let out = rewrite_model(body.as_bytes(), "base-b").unwrap();
    let (a, b) = (parse_request(PATH, body.as_bytes()).unwrap(), parse_request(PATH, &out).unwrap());
    assert_eq!((b.model.as_str(), b.prompt == a.prompt), ("base-b", true));
    let mut expected: Value = serde_json::from_str(&body).unwrap();
    expected["model"] = "base-b".into();
    assert_eq!(serde_json::from_slice::<Value>(&out).unwrap(), expected);
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

#[test]
fn a_messages_request_is_prepared_like_a_chat_request() {
    let c = cfg();
    let sched = Scheduler::new(&c);
    let mut rng = SplitMix64::new(1);
    let head = RequestHead { method: "POST".into(), path: PATH.into(), ..RequestHead::default() };
    assert_eq!(head.error_shape(), ErrorShape::Anthropic);
    // base-a is rewritten to base-b, keeps base-a's Critical priority, and the prompt is kept
    // for the prefix scorer.
    let body = br#"{"model":"base-a","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}"#;
    let p = prepare(&c.request(), &sched, &mut rng, &head, body, &snapshot()).unwrap();
    assert_eq!((p.route.base.as_str(), p.route.model_rewritten), ("base-b", true));
    assert_eq!(
        p.new_body.as_deref(),
        Some(&br#"{"model":"base-b","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}"#[..])
    );
    assert_eq!((p.priority.priority, p.priority.source), (10, PrioritySource::Model));
    assert_eq!(p.prompt, "user\nhi\u{1e}");
    let h = PriorityHeaders { objective: Some("batch".into()), ..PriorityHeaders::default() };
    let held = RequestHead { priority: h, ..head.clone() };
    let p = prepare(&c.request(), &sched, &mut rng, &held, body, &snapshot()).unwrap();
    assert_eq!((p.priority.priority, p.priority.source), (-20, PrioritySource::Objective));
    // An unknown model: the 404 of every path, rendered in Anthropic's shape.
    let e = prepare(
        &c.request(),
        &sched,
        &mut rng,
        &head,
        br#"{"model":"nope","max_tokens":4,"messages":[]}"#,
        &snapshot(),
    )
    .unwrap_err();
    let v: Value = serde_json::from_slice(&e.body_in(head.error_shape())).unwrap();
    assert_eq!(
        (e.status, v["type"].as_str(), v["error"]["type"].as_str()),
        (404, Some("error"), Some("not_found_error"))
    );
}

/// A random content block, of every shape the writer knows and some it does not.
fn block() -> impl proptest::strategy::Strategy<Value = Value> {
    use proptest::prelude::*;
    let text = "\\PC{0,12}";
    prop_oneof![
        text.prop_map(|t| json!({"type": "text", "text": t})),
        text.prop_map(|t| json!({"type": "text", "text": t, "cache_control": {"type": "ephemeral"}})),
        text.prop_map(
            |d| json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": d}})
        ),
        (text, text).prop_map(|(n, a)| json!({"type": "tool_use", "id": "t", "name": n, "input": {"a": a}})),
        text.prop_map(|t| json!({"type": "tool_result", "tool_use_id": "t", "content": t})),
        text.prop_map(
            |t| json!({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": t}]})
        ),
        text.prop_map(|t| json!({"type": "thinking", "thinking": t, "signature": "s"})),
        text.prop_map(|t| json!({"type": t})),
        Just(json!(5)),
        Just(json!(null)),
    ]
}

proptest::proptest! {
    /// Any conversation parses (blocks of any shape are never an error), and every turn's text
    /// starts with the text of the turns before it.
    #[test]
    fn every_turn_extends_the_text_of_the_last(
        turns in proptest::collection::vec(proptest::collection::vec(block(), 0..4), 1..6),
        system in proptest::option::of("\\PC{0,20}"),
    ) {
        let mut messages = Vec::new();
        let mut last = String::new();
        for (i, blocks) in turns.into_iter().enumerate() {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            messages.push(json!({"role": role, "content": blocks}));
            let mut body = json!({"model": "m", "max_tokens": 1, "messages": messages});
            if let Some(s) = &system {
                body["system"] = json!(s);
            }
            let p = parse(&body).unwrap().prompt;
            proptest::prop_assert!(p.starts_with(&last));
            last = p;
        }
    }

    /// Any bytes: never a panic, and a body that parses gives the same answer after the model
    /// rewrite, apart from the model.
    #[test]
    fn never_panics(s in ".{0,200}") {
        if let Ok(a) = parse_request(PATH, s.as_bytes()) {
            let out = rewrite_model(s.as_bytes(), "x").unwrap();
            let b = parse_request(PATH, &out).unwrap();
            proptest::prop_assert_eq!((b.model.as_str(), b.prompt, b.stream), ("x", a.prompt, a.stream));
        }
    }
}
