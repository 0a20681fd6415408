//! HTTP shell tests: the router is called in-process (no sockets). The model runs in real time
//! at speed 1000 with a fixed 1 ms step, so each request completes within milliseconds; the
//! assertions are about content, never about timing.

use std::sync::Arc;

use axum::body::{to_bytes, Body};
use axum::http::{Request, StatusCode};
use axum::Router;
use model_server_sim::http::{self, AppState, ShellConfig, SERVER_HEADER};
use model_server_sim::{Engine, ServerConfig, StepCost};
use serde_json::{json, Value};
use tower::ServiceExt;

fn app(engine: Engine) -> Router {
    app_with_batch(engine, ServerConfig::default().max_batch)
}

fn app_with_batch(engine: Engine, max_batch: u32) -> Router {
    let shell = ShellConfig {
        name: "sim-test".into(),
        models: vec!["base".into(), "alias".into()],
        loras: vec!["ad1".into()],
        engine,
        default_max_tokens: 3,
        max_model_len: 1000,
        role: Default::default(),
    };
    let cfg = ServerConfig {
        enable_lora: true,
        cost: StepCost::fixed(1.0),
        speed: 1000.0,
        num_gpu_blocks: 1000,
        max_batch,
        ..Default::default()
    };
    let state: Arc<AppState> = AppState::new(shell, cfg).unwrap();
    tokio::spawn(http::engine_loop(state.clone()));
    http::router(state)
}

async fn call(app: &Router, method: &str, uri: &str, body: &str) -> (StatusCode, String, String) {
    let req = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .header("x-gateway-destination-endpoint", "10.0.0.1:8000")
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let server =
        resp.headers().get(SERVER_HEADER).map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
    let bytes = to_bytes(resp.into_body(), usize::MAX).await.unwrap();
    (status, server, String::from_utf8(bytes.to_vec()).unwrap())
}

fn parse(s: &str) -> Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

#[tokio::test]
async fn chat_completion_is_openai_shaped_and_names_the_server() {
    let app = app(Engine::Vllm);
    let body = json!({"model": "alias", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4});
    let (status, server, text) = call(&app, "POST", "/v1/chat/completions", &body.to_string()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(server, "sim-test");
    let v = parse(&text);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "alias", "the requested name is echoed");
    assert_eq!(v["served_by"], "sim-test");
    assert_eq!(v["choices"][0]["message"]["content"], "lorem ipsum dolor sit");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // "user: hello\n" = 12 chars = 3 tokens.
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0}})
    );
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
}

#[tokio::test]
async fn streaming_sends_one_chunk_per_token_then_done() {
    let app = app(Engine::Vllm);
    let body = json!({"model": "ad1", "prompt": "Once", "stream": true, "max_tokens": 3,
        "stream_options": {"include_usage": true}});
    let (status, server, text) = call(&app, "POST", "/v1/completions", &body.to_string()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(server, "sim-test");
    let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    // 3 token chunks + 1 usage chunk + [DONE].
    assert_eq!(data.len(), 5, "{text}");
    assert_eq!(*data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..4].iter().map(|d| parse(d)).collect();
    let texts: Vec<&str> = chunks[..3].iter().map(|c| c["choices"][0]["text"].as_str().unwrap()).collect();
    assert_eq!(texts, ["lorem", " ipsum", " dolor"]);
    assert_eq!(chunks[2]["choices"][0]["finish_reason"], "length");
    assert!(chunks.iter().all(|c| c["served_by"] == "sim-test" && c["model"] == "ad1"));
    assert_eq!(chunks[3]["usage"]["completion_tokens"], 3);
}

#[tokio::test]
async fn chat_stream_starts_with_the_role() {
    let app = app(Engine::Vllm);
    let body = json!({"model": "base", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "stream": true});
    let (_, _, text) = call(&app, "POST", "/v1/chat/completions", &body.to_string()).await;
    let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    // Role chunk + default 3 tokens + [DONE] (no usage chunk unless asked).
    assert_eq!(data.len(), 5, "{text}");
    let first = parse(data[0]);
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let app = app(Engine::Vllm);
    let cases = [
        ("/v1/chat/completions", "{\"model\": ", StatusCode::BAD_REQUEST),
        ("/v1/chat/completions", "[1,2]", StatusCode::BAD_REQUEST),
        ("/v1/chat/completions", r#"{"messages": []}"#, StatusCode::BAD_REQUEST),
        ("/v1/chat/completions", r#"{"model": "base", "messages": "hi"}"#, StatusCode::BAD_REQUEST),
        (
            "/v1/chat/completions",
            r#"{"model": "base", "messages": [{"content": "x"}]}"#,
            StatusCode::BAD_REQUEST,
        ),
        ("/v1/completions", r#"{"model": "base", "prompt": "x", "max_tokens": 0}"#, StatusCode::BAD_REQUEST),
        ("/v1/completions", r#"{"model": "base", "prompt": "x", "max_tokens": -3}"#, StatusCode::BAD_REQUEST),
        ("/v1/completions", r#"{"model": "base", "prompt": "x", "n": 2}"#, StatusCode::BAD_REQUEST),
        ("/v1/completions", r#"{"model": "base", "prompt": ["a", "b"]}"#, StatusCode::BAD_REQUEST),
        ("/v1/completions", r#"{"model": "base", "prompt": "x", "stream": "yes"}"#, StatusCode::BAD_REQUEST),
        // 4000 chars = 1000 tokens + 3 output > max_model_len 1000.
        (
            "/v1/completions",
            &format!(r#"{{"model": "base", "prompt": "{}"}}"#, "a".repeat(4000)),
            StatusCode::BAD_REQUEST,
        ),
        ("/v1/completions", r#"{"model": "gpt-9", "prompt": "x"}"#, StatusCode::NOT_FOUND),
    ];
    for (path, body, want) in cases {
        let (status, server, text) = call(&app, "POST", path, body).await;
        assert_eq!(status, want, "{body}");
        assert_eq!(server, "sim-test");
        let v = parse(&text);
        assert_eq!(v["error"]["code"], want.as_u16(), "{text}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    let (_, _, text) = call(&app, "POST", "/v1/completions", r#"{"model": "gpt-9", "prompt": "x"}"#).await;
    assert_eq!(parse(&text)["error"]["message"], "The model `gpt-9` does not exist.");
    let (status, server, _) = call(&app, "GET", "/no/such/path", "").await;
    assert_eq!((status, server.as_str()), (StatusCode::NOT_FOUND, "sim-test"));
}

#[tokio::test]
async fn anthropic_message_has_usage_and_names_the_server() {
    let app = app(Engine::Vllm);
    let body = json!({"model": "ad1", "max_tokens": 4, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]});
    let (status, server, text) = call(&app, "POST", "/v1/messages", &body.to_string()).await;
    assert_eq!((status, server.as_str()), (StatusCode::OK, "sim-test"));
    let v = parse(&text);
    assert!(v["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(
        (v["type"].as_str(), v["role"].as_str(), v["model"].as_str()),
        (Some("message"), Some("assistant"), Some("ad1"))
    );
    assert_eq!(v["content"], json!([{"type": "text", "text": "lorem ipsum dolor sit"}]));
    assert_eq!((v["stop_reason"].as_str(), v["served_by"].as_str()), (Some("max_tokens"), Some("sim-test")));
    // "system: Be brief.\nuser: hello\n" = 30 chars = 8 tokens (4 chars a token, rounded up).
    assert_eq!(
        v["usage"],
        json!({"input_tokens": 8, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0, "output_tokens": 4})
    );
    // The arrival records the last message's text.
    let stats = parse(&call(&app, "GET", "/sim/stats", "").await.2);
    assert_eq!(stats["arrivals"][0]["content"], "hello");
}

#[tokio::test]
async fn a_token_count_is_the_input_tokens_of_the_same_message() {
    let app = app(Engine::Vllm);
    let conversation = json!({"model": "ad1", "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]},
                     {"role": "assistant", "content": "hi"},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "42"}]}]});
    let (status, server, text) =
        call(&app, "POST", "/v1/messages/count_tokens", &conversation.to_string()).await;
    assert_eq!((status, server.as_str()), (StatusCode::OK, "sim-test"));
    let counted = parse(&text);
    assert_eq!(counted.as_object().map(|o| o.len()), Some(1), "{text}");
    let mut message = conversation.clone();
    message["max_tokens"] = json!(2);
    let usage = parse(&call(&app, "POST", "/v1/messages", &message.to_string()).await.2)["usage"].clone();
    assert_eq!(usage["cache_read_input_tokens"], 0);
    assert_eq!(counted["input_tokens"], usage["input_tokens"]);
    // "system: Be brief.\nuser: hello\nassistant: hi\nuser: 42\n" = 53 chars = 14 tokens.
    assert_eq!(counted["input_tokens"], 14);
    // Not an inference request: counted apart, no arrival.
    let stats = parse(&call(&app, "GET", "/sim/stats", "").await.2);
    assert_eq!((stats["count_tokens_total"].as_u64(), stats["requests_total"].as_u64()), (Some(1), Some(1)));
    assert_eq!(stats["arrivals"].as_array().map(Vec::len), Some(1));
    // Errors in Anthropic's shape: an unknown model, no messages, not JSON.
    for (body, want, kind) in [
        (
            json!({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}).to_string(),
            404,
            "not_found_error",
        ),
        (json!({"model": "base"}).to_string(), 400, "invalid_request_error"),
        ("{".to_string(), 400, "invalid_request_error"),
    ] {
        let (status, _, text) = call(&app, "POST", "/v1/messages/count_tokens", &body).await;
        let v = parse(&text);
        assert_eq!(
            (status.as_u16(), v["type"].as_str(), v["error"]["type"].as_str()),
            (want, Some("error"), Some(kind))
        );
    }
}

#[tokio::test]
async fn anthropic_stream_sends_the_documented_events_in_order() {
    let app = app(Engine::Vllm);
    let body = json!({"model": "base", "max_tokens": 3, "stream": true,
        "messages": [{"role": "user", "content": "hi"}]});
    let (status, _, text) = call(&app, "POST", "/v1/messages", &body.to_string()).await;
    assert_eq!(status, StatusCode::OK);
    let names: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("event: ")).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ],
        "{text}"
    );
    let data: Vec<Value> = text.lines().filter_map(|l| l.strip_prefix("data: ")).map(parse).collect();
    assert_eq!(data.len(), names.len());
    // Every event's `type` is its name.
    for (d, n) in data.iter().zip(&names) {
        assert_eq!(d["type"].as_str(), Some(*n), "{d}");
    }
    let start = &data[0]["message"];
    assert_eq!((start["model"].as_str(), start["served_by"].as_str()), (Some("base"), Some("sim-test")));
    assert_eq!(start["content"], json!([]));
    let deltas: Vec<&str> = data[2..5].iter().map(|d| d["delta"]["text"].as_str().unwrap()).collect();
    assert_eq!(deltas, ["lorem", " ipsum", " dolor"]);
    assert_eq!(data[6]["delta"]["stop_reason"], "max_tokens");
    assert_eq!(data[6]["usage"]["output_tokens"], 3);
    assert!(data[6]["usage"]["input_tokens"].as_u64().is_some());
}

#[tokio::test]
async fn anthropic_requests_get_anthropic_errors() {
    let app = app(Engine::Vllm);
    let msgs = r#""messages": [{"role": "user", "content": "x"}]"#;
    let cases = [
        ("{\"model\": ".to_string(), StatusCode::BAD_REQUEST),
        (format!(r#"{{"model": "base", {msgs}}}"#), StatusCode::BAD_REQUEST),
        (format!(r#"{{"model": "base", "max_tokens": 0, {msgs}}}"#), StatusCode::BAD_REQUEST),
        (r#"{"model": "base", "max_tokens": 1, "messages": []}"#.to_string(), StatusCode::BAD_REQUEST),
        (
            r#"{"model": "base", "max_tokens": 1, "messages": [{"content": "x"}]}"#.to_string(),
            StatusCode::BAD_REQUEST,
        ),
        (
            r#"{"model": "base", "max_tokens": 1, "messages": [{"role": "user", "content": 5}]}"#.to_string(),
            StatusCode::BAD_REQUEST,
        ),
        (format!(r#"{{"model": "base", "max_tokens": 1, "system": 5, {msgs}}}"#), StatusCode::BAD_REQUEST),
        (format!(r#"{{"model": "gpt-9", "max_tokens": 1, {msgs}}}"#), StatusCode::NOT_FOUND),
    ];
    for (body, want) in cases {
        let (status, _, text) = call(&app, "POST", "/v1/messages", &body).await;
        assert_eq!(status, want, "{body}");
        let v = parse(&text);
        let kind = if want == StatusCode::NOT_FOUND { "not_found_error" } else { "invalid_request_error" };
        assert_eq!((v["type"].as_str(), v["error"]["type"].as_str()), (Some("error"), Some(kind)), "{text}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    let (_, _, text) = call(&app, "POST", "/v1/messages", &format!(r#"{{"model": "base", {msgs}}}"#)).await;
    assert_eq!(parse(&text)["error"]["message"], "max_tokens: Field required");
    // Chaos answers in the path's shape too.
    call(&app, "POST", "/sim/chaos", r#"{"mode": "status", "status": 529, "count": 1}"#).await;
    let body = format!(r#"{{"model": "base", "max_tokens": 1, {msgs}}}"#);
    let (status, _, text) = call(&app, "POST", "/v1/messages", &body).await;
    assert_eq!((status.as_u16(), parse(&text)["error"]["type"].as_str()), (529, Some("overloaded_error")));
}

#[tokio::test]
async fn shared_prefix_hits_the_cache_across_requests() {
    let app = app(Engine::Vllm);
    // 2,000 chars of shared system prompt = 500 tokens ≥ 31 full 16-token blocks.
    let system = "x".repeat(2000);
    let ask = |q: &str| {
        json!({"model": "base", "max_tokens": 1,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]})
        .to_string()
    };
    let (_, _, first) = call(&app, "POST", "/v1/chat/completions", &ask("one")).await;
    let (_, _, second) = call(&app, "POST", "/v1/chat/completions", &ask("two")).await;
    assert_eq!(parse(&first)["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // "system: " + 2000 x's + "\n" = 2009 chars: 31 full blocks of 64 chars (1984) are shared.
    assert_eq!(parse(&second)["usage"]["prompt_tokens_details"]["cached_tokens"], 31 * 16);
    let (_, _, m) = call(&app, "GET", "/metrics", "").await;
    assert!(m.contains("vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"base\"} 496.0"), "{m}");
}

#[tokio::test]
async fn stats_record_requests_and_forwarded_headers() {
    let app = app(Engine::Vllm);
    call(&app, "POST", "/v1/completions", r#"{"model": "ad1", "prompt": "x"}"#).await;
    call(&app, "POST", "/v1/completions", r#"{"model": "base", "prompt": "x"}"#).await;
    call(&app, "GET", "/metrics", "").await;
    let (status, _, text) = call(&app, "GET", "/sim/stats", "").await;
    assert_eq!(status, StatusCode::OK);
    let v = parse(&text);
    assert_eq!(v["name"], "sim-test");
    assert_eq!(v["requests_total"], 2);
    assert_eq!(v["requests_by_model"], json!({"ad1": 1, "base": 1}));
    assert_eq!(v["metrics_scrapes_total"], 1);
    assert_eq!(v["last_request_model"], "base");
    assert_eq!(v["last_request_headers"]["x-gateway-destination-endpoint"], "10.0.0.1:8000");
    assert_eq!(v["model"]["requests_finished"], 2);
    call(&app, "POST", "/sim/reset-stats", "").await;
    let v = parse(&call(&app, "GET", "/sim/stats", "").await.2);
    assert_eq!(v["requests_total"], 0);
    assert_eq!(v["requests_by_model"], json!({}));
}

#[tokio::test]
async fn fake_load_shows_in_metrics_until_cleared() {
    let app = app(Engine::Vllm);
    let (status, _, _) =
        call(&app, "POST", "/sim/fake-load", r#"{"queue": 7, "kv": 0.25, "running": 2}"#).await;
    assert_eq!(status, StatusCode::OK);
    let (_, _, m) = call(&app, "GET", "/metrics", "").await;
    assert!(m.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"base\"} 7.0\n"), "{m}");
    assert!(m.contains("vllm:num_requests_running{engine=\"0\",model_name=\"base\"} 2.0\n"));
    assert!(m.contains("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"base\"} 0.25\n"));
    assert!(m.contains(
        "vllm:lora_requests_info{max_lora=\"1\",waiting_lora_adapters=\"\",running_lora_adapters=\"\"} "
    ));
    assert_eq!(call(&app, "POST", "/sim/fake-load", r#"{"kv": 1.5}"#).await.0, StatusCode::BAD_REQUEST);
    assert_eq!(call(&app, "POST", "/sim/fake-load", r#"{"queu": 1}"#).await.0, StatusCode::BAD_REQUEST);
    assert_eq!(call(&app, "POST", "/sim/fake-load", "{}").await.0, StatusCode::OK);
    let (_, _, m) = call(&app, "GET", "/metrics", "").await;
    assert!(m.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"base\"} 0.0\n"));
}

#[tokio::test]
async fn other_engines_use_their_own_names() {
    let (_, _, m) = call(&app(Engine::Sglang), "GET", "/metrics", "").await;
    assert!(
        m.contains("# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name=\"base\"} 0.0\n"),
        "{m}"
    );
    assert!(m.contains("sglang:token_usage{model_name=\"base\"} 0.0\n"));
    assert!(m.contains("sglang:max_total_num_tokens{model_name=\"base\"} 16000.0\n"));
    assert!(!m.contains("vllm:"));
    let (_, _, m) = call(&app(Engine::Trtllm), "GET", "/metrics", "").await;
    assert!(
        m.contains("trtllm_num_requests_waiting{engine_type=\"trtllm\",model_name=\"base\"} 0.0\n"),
        "{m}"
    );
    assert!(m.contains("trtllm_kv_cache_utilization{engine_type=\"trtllm\",model_name=\"base\"} 0.0\n"));
    assert!(m.contains("trtllm_kv_cache_max_blocks{engine_type=\"trtllm\",model_name=\"base\"} 1000.0\n"));
}

#[tokio::test]
async fn models_and_health() {
    let app = app(Engine::Vllm);
    let (status, server, text) = call(&app, "GET", "/v1/models", "").await;
    assert_eq!((status, server.as_str()), (StatusCode::OK, "sim-test"));
    let v = parse(&text);
    let ids: Vec<&str> = v["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["base", "alias", "ad1"]);
    assert_eq!(v["data"][2]["parent"], "base");
    assert_eq!(call(&app, "GET", "/health", "").await.0, StatusCode::OK);
}

#[tokio::test]
async fn adapters_load_and_unload_at_run_time_as_in_vllm() {
    let app = app(Engine::Vllm);
    let chat = |model: &str| {
        json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).to_string()
    };
    // Not loaded yet: 404, and not listed.
    assert_eq!(call(&app, "POST", "/v1/chat/completions", &chat("ad2")).await.0, StatusCode::NOT_FOUND);
    let load = r#"{"lora_name":"ad2","lora_path":"/adapters/ad2"}"#;
    let (status, _, text) = call(&app, "POST", "/v1/load_lora_adapter", load).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    // Listed with its parent, and served.
    let v = parse(&call(&app, "GET", "/v1/models", "").await.2);
    let ids: Vec<&str> = v["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["base", "alias", "ad1", "ad2"]);
    assert_eq!(v["data"][3]["parent"], "base");
    assert_eq!(call(&app, "POST", "/v1/chat/completions", &chat("ad2")).await.0, StatusCode::OK);
    // Loading twice, a base model's name, or a body without a name: 400.
    assert_eq!(call(&app, "POST", "/v1/load_lora_adapter", load).await.0, StatusCode::BAD_REQUEST);
    assert_eq!(
        call(&app, "POST", "/v1/load_lora_adapter", r#"{"lora_name":"base"}"#).await.0,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        call(&app, "POST", "/v1/load_lora_adapter", r#"{"lora_path":"x"}"#).await.0,
        StatusCode::BAD_REQUEST
    );
    // Unloaded: gone from the list and no longer served; a second unload is 404.
    let unload = r#"{"lora_name":"ad2"}"#;
    assert_eq!(call(&app, "POST", "/v1/unload_lora_adapter", unload).await.0, StatusCode::OK);
    assert_eq!(call(&app, "POST", "/v1/chat/completions", &chat("ad2")).await.0, StatusCode::NOT_FOUND);
    assert_eq!(call(&app, "POST", "/v1/unload_lora_adapter", unload).await.0, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn chaos_status_answers_at_once_for_count_requests_then_serves() {
    let app = app(Engine::Vllm);
    let (status, _, text) =
        call(&app, "POST", "/sim/chaos", r#"{"mode": "status", "status": 503, "count": 2}"#).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let body = json!({"model": "base", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    for _ in 0..2 {
        let (status, server, text) = call(&app, "POST", "/v1/chat/completions", &body).await;
        assert_eq!((status, server.as_str()), (StatusCode::SERVICE_UNAVAILABLE, "sim-test"));
        assert_eq!(parse(&text)["error"]["code"], 503);
    }
    // The count is spent: back to normal.
    assert_eq!(call(&app, "POST", "/v1/chat/completions", &body).await.0, StatusCode::OK);
    let stats = parse(&call(&app, "GET", "/sim/stats", "").await.2);
    assert_eq!((stats["requests_total"].as_u64(), stats["chaos_total"].as_u64()), (Some(3), Some(2)));
    assert_eq!(stats["chaos"], json!({"mode": "ok", "remaining": null}));
    // /metrics is never affected.
    call(&app, "POST", "/sim/chaos", r#"{"mode": "status", "status": 500}"#).await;
    assert_eq!(call(&app, "GET", "/metrics", "").await.0, StatusCode::OK);
}

#[tokio::test]
async fn chaos_rejects_bad_settings() {
    let app = app(Engine::Vllm);
    for bad in [
        r#"{"mode": "status"}"#,
        r#"{"mode": "status", "status": 99}"#,
        r#"{"mode": "reset", "status": 500}"#,
        r#"{"mode": "explode"}"#,
        r#"{"mode": "hang", "count": 0}"#,
        r#"{"mode": "ok", "count": 1}"#,
        r#"{"mode": "hang", "typo": 1}"#,
    ] {
        let (status, _, text) = call(&app, "POST", "/sim/chaos", bad).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {text}");
    }
    // An empty body clears.
    assert_eq!(call(&app, "POST", "/sim/chaos", "").await.0, StatusCode::OK);
}

#[tokio::test]
async fn chaos_hang_never_answers() {
    let app = app(Engine::Vllm);
    call(&app, "POST", "/sim/chaos", r#"{"mode": "hang"}"#).await;
    let body = json!({"model": "base", "prompt": "x"}).to_string();
    // A served request completes in a few ms at this speed; a hung one never does.
    let hung = tokio::time::timeout(
        std::time::Duration::from_millis(300),
        call(&app, "POST", "/v1/completions", &body),
    );
    assert!(hung.await.is_err(), "a hung request was answered");
}

#[tokio::test]
async fn chaos_stream_cut_fails_the_body_after_n_events() {
    let app = app(Engine::Vllm);
    call(&app, "POST", "/sim/chaos", r#"{"mode": "stream_cut", "after_chunks": 2}"#).await;
    let body = json!({"model": "base", "prompt": "x", "stream": true, "max_tokens": 8}).to_string();
    let req = Request::builder()
        .method("POST")
        .uri("/v1/completions")
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK, "the head is sent before the cut");
    let mut stream = resp.into_body().into_data_stream();
    let mut events = 0;
    let mut failed = false;
    while let Some(frame) = futures_util::StreamExt::next(&mut stream).await {
        match frame {
            Ok(bytes) => events += bytes.windows(6).filter(|w| w == b"data: ").count(),
            Err(_) => {
                failed = true;
                break;
            }
        }
    }
    assert!(failed, "the body must fail");
    assert_eq!(events, 2);
}

/// Serves the router on a real loopback socket, as the binary does.
async fn serve_on_loopback() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = app(Engine::Vllm).into_make_service_with_connect_info::<http::ConnHandle>();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

async fn raw_post(addr: std::net::SocketAddr, path: &str, body: &str) -> Vec<u8> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    c.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    // A reset connection may end in an error instead of EOF; both mean "no more bytes".
    let _ = c.read_to_end(&mut out).await;
    out
}

#[tokio::test]
async fn chaos_reset_closes_the_connection_without_a_response() {
    let addr = serve_on_loopback().await;
    let set = raw_post(addr, "/sim/chaos", r#"{"mode": "reset"}"#).await;
    assert!(set.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&set));
    let body = json!({"model": "base", "prompt": "x"}).to_string();
    let got = raw_post(addr, "/v1/completions", &body).await;
    assert!(got.is_empty(), "expected no response bytes, got {}", String::from_utf8_lossy(&got));
    // Non-inference endpoints still answer.
    let stats = raw_post(addr, "/sim/chaos", "").await;
    assert!(stats.starts_with(b"HTTP/1.1 200"));
    let got = raw_post(addr, "/v1/completions", &body).await;
    assert!(got.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&got));
}

fn role_app(name: &str, role: http::SimRole) -> Router {
    let shell = ShellConfig {
        name: name.into(),
        models: vec!["base".into()],
        loras: vec![],
        engine: Engine::Vllm,
        default_max_tokens: 3,
        max_model_len: 100_000,
        role,
    };
    let cfg = ServerConfig {
        cost: StepCost::fixed(1.0),
        speed: 1000.0,
        num_gpu_blocks: 1000,
        ..Default::default()
    };
    let state: Arc<AppState> = AppState::new(shell, cfg).unwrap();
    tokio::spawn(http::engine_loop(state.clone()));
    http::router(state)
}

async fn post_with(
    app: &Router,
    body: &Value,
    headers: &[(&str, &str)],
) -> (StatusCode, Option<String>, Value) {
    let mut req = Request::builder()
        .method("POST")
        .uri("/v1/chat/completions")
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = app.clone().oneshot(req.body(Body::from(body.to_string())).unwrap()).await.unwrap();
    let status = resp.status();
    let by = resp.headers().get(http::PREFILLED_BY_HEADER).map(|v| v.to_str().unwrap().to_string());
    let bytes = to_bytes(resp.into_body(), usize::MAX).await.unwrap();
    (status, by, parse(std::str::from_utf8(&bytes).unwrap()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_pod_prefills_remotely_and_decodes_with_the_prompt_cached() {
    // The prefill pod listens on a real port: the decode pod calls it over TCP.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let prefill_addr = listener.local_addr().unwrap().to_string();
    let prefill = role_app("prefill", http::SimRole::Prefill);
    let server = prefill.clone();
    tokio::spawn(async move { axum::serve(listener, server).await });
    let decode = role_app("decode", http::SimRole::Decode);
    // 64 blocks of 16 tokens and a bit: "user: " + 4100 chars ≈ 1027 tokens.
    let body = json!({"model": "base", "messages": [{"role": "user", "content": "x".repeat(4100)}], "max_tokens": 5});
    let (status, by, v) = post_with(&decode, &body, &[(http::PREFILLER_HEADER, &prefill_addr)]).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(by.as_deref(), Some(prefill_addr.as_str()));
    assert_eq!(v["usage"]["completion_tokens"], 5);
    // The prompt's KV came from the prefill pod: all but the last partial block is cached.
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(cached > 0 && prompt - cached < 32, "cached {cached} of {prompt}");
    // The prefill pod ran it with one output token.
    let (_, _, stats) = call(&prefill, "GET", "/sim/stats", "").await;
    let stats = parse(&stats);
    assert_eq!(stats["requests_total"], 1);
    assert_eq!(stats["model"]["generation_tokens_total"], 1);
    let (_, _, dstats) = call(&decode, "GET", "/sim/stats", "").await;
    let dstats = parse(&dstats);
    assert_eq!(
        (dstats["remote_prefills_total"].as_u64(), dstats["role"].as_str()),
        (Some(1), Some("decode"))
    );

    // A prefill pod that does not answer: the decode pod prefills the prompt itself.
    let closed = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap().to_string()
    };
    let body = json!({"model": "base", "messages": [{"role": "user", "content": "y".repeat(4100)}], "max_tokens": 2});
    let (status, by, v) = post_with(&decode, &body, &[(http::PREFILLER_HEADER, &closed)]).await;
    assert_eq!((status, by), (StatusCode::OK, None), "{v}");
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, _, dstats) = call(&decode, "GET", "/sim/stats", "").await;
    assert_eq!(parse(&dstats)["remote_prefill_failures_total"], 1);

    // A prefill pod ignores the header.
    let (status, by, _) = post_with(&prefill, &body, &[(http::PREFILLER_HEADER, &closed)]).await;
    assert_eq!((status, by), (StatusCode::OK, None));
}

/// Polls /sim/stats until `pred` holds (bounded: a failure, not a hang, if it never does).
async fn wait_stats(app: &Router, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let v = parse(&call(app, "GET", "/sim/stats", "").await.2);
        if pred(&v) {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}: {v}");
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}

fn contents(list: &Value) -> Vec<String> {
    list.as_array().unwrap().iter().map(|a| a["content"].as_str().unwrap_or("").to_string()).collect()
}

fn chat_body(content: &str) -> String {
    json!({"model": "base", "messages": [{"role": "user", "content": content}]}).to_string()
}

#[tokio::test]
async fn hold_parks_requests_until_released_one_by_one_in_arrival_order() {
    let app = app_with_batch(Engine::Vllm, 2);
    let (status, _, text) = call(&app, "POST", "/sim/hold", "").await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(parse(&text)["hold"], json!({"active": true, "remaining": null}));
    let mut tasks = Vec::new();
    for (i, word) in ["one", "two", "three"].into_iter().enumerate() {
        let (a, body) = (app.clone(), chat_body(word));
        tasks.push(tokio::spawn(async move { call(&a, "POST", "/v1/chat/completions", &body).await }));
        // Each one parked before the next is sent: the arrival order is certain.
        wait_stats(&app, "parked", |v| v["held"] == i + 1).await;
    }
    let stats = parse(&call(&app, "GET", "/sim/stats", "").await.2);
    assert_eq!(contents(&stats["held_requests"]), ["one", "two", "three"]);
    assert_eq!((stats["requests_total"].as_u64(), stats["held_total"].as_u64()), (Some(3), Some(3)));
    assert_eq!(stats["model"]["requests_submitted"], 0, "a parked request has not reached the engine");
    // /metrics shows them as the engine would schedule them: running while the batch has room
    // (max_batch 2 here), then waiting.
    let (_, _, m) = call(&app, "GET", "/metrics", "").await;
    assert!(m.contains("vllm:num_requests_running{engine=\"0\",model_name=\"base\"} 2.0\n"), "{m}");
    assert!(m.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"base\"} 1.0\n"), "{m}");

    let (status, _, text) = call(&app, "POST", "/sim/release", r#"{"n": 1}"#).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let released = parse(&text);
    assert_eq!(contents(&released["released"]), ["one"]);
    assert_eq!(released["held"], 2);
    let (status, _, text) = tasks.remove(0).await.unwrap();
    assert_eq!(status, StatusCode::OK, "{text}");
    // The others are still parked: nothing but a release lets them go.
    assert!(tasks.iter().all(|t| !t.is_finished()));
    let stats = parse(&call(&app, "GET", "/sim/stats", "").await.2);
    assert_eq!(contents(&stats["held_requests"]), ["two", "three"]);
    assert_eq!(stats["hold"]["active"], true, "releasing some keeps holding new arrivals");

    // An empty release lets every parked request go and stops holding.
    let released = parse(&call(&app, "POST", "/sim/release", "").await.2);
    assert_eq!(contents(&released["released"]), ["two", "three"]);
    for t in tasks {
        assert_eq!(t.await.unwrap().0, StatusCode::OK);
    }
    let (status, _, _) = call(&app, "POST", "/v1/chat/completions", &chat_body("four")).await;
    assert_eq!(status, StatusCode::OK, "not held any more");
    let stats = parse(&call(&app, "GET", "/sim/stats", "").await.2);
    assert_eq!(stats["held"], 0);
    assert_eq!(stats["hold"], json!({"active": false, "remaining": null}));
    assert_eq!(contents(&stats["arrivals"]), ["one", "two", "three", "four"]);
    let held: Vec<bool> = stats["arrivals"].as_array().unwrap().iter().map(|a| a["held"] == true).collect();
    assert_eq!(held, [true, true, true, false]);
    assert_eq!(stats["model"]["requests_finished"], 4);
}

#[tokio::test]
async fn hold_with_a_count_parks_only_the_next_n_requests() {
    let app = app(Engine::Vllm);
    call(&app, "POST", "/sim/hold", r#"{"count": 1}"#).await;
    let a = app.clone();
    let parked = tokio::spawn(async move {
        call(&a, "POST", "/v1/completions", r#"{"model": "base", "prompt": "first"}"#).await
    });
    let stats = wait_stats(&app, "first parked", |v| v["held"] == 1).await;
    assert_eq!(stats["hold"], json!({"active": false, "remaining": null}), "the count is spent");
    // The next request is served while the first is still parked.
    let (status, _, _) =
        call(&app, "POST", "/v1/completions", r#"{"model": "base", "prompt": "second"}"#).await;
    assert_eq!(status, StatusCode::OK);
    assert!(!parked.is_finished());
    let stats = parse(&call(&app, "GET", "/sim/stats", "").await.2);
    assert_eq!(contents(&stats["arrivals"]), ["first", "second"]);
    assert_eq!(contents(&stats["held_requests"]), ["first"]);
    call(&app, "POST", "/sim/release", "").await;
    assert_eq!(parked.await.unwrap().0, StatusCode::OK);
}

#[tokio::test]
async fn a_client_that_leaves_while_held_leaves_the_queue() {
    let app = app(Engine::Vllm);
    call(&app, "POST", "/sim/hold", "").await;
    let mut tasks = Vec::new();
    for (i, word) in ["leaver", "stayer"].into_iter().enumerate() {
        let (a, body) = (app.clone(), chat_body(word));
        tasks.push(tokio::spawn(async move { call(&a, "POST", "/v1/chat/completions", &body).await }));
        wait_stats(&app, "parked", |v| v["held"] == i + 1).await;
    }
    let stayer = tasks.pop().unwrap();
    tasks.pop().unwrap().abort();
    let stats = wait_stats(&app, "the leaver gone", |v| v["held"] == 1).await;
    assert_eq!(contents(&stats["held_requests"]), ["stayer"]);
    // Releasing one now lets the stayer go, not the request that left.
    let released = parse(&call(&app, "POST", "/sim/release", r#"{"n": 1}"#).await.2);
    assert_eq!(contents(&released["released"]), ["stayer"]);
    assert_eq!(stayer.await.unwrap().0, StatusCode::OK);
    call(&app, "POST", "/sim/release", "").await;
}

#[tokio::test]
async fn hold_and_release_reject_bad_bodies() {
    let app = app(Engine::Vllm);
    for bad in [r#"{"count": 0}"#, r#"{"cnt": 1}"#, "nope"] {
        let (status, _, text) = call(&app, "POST", "/sim/hold", bad).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {text}");
    }
    for bad in [r#"{"n": 0}"#, r#"{"count": 1}"#] {
        let (status, _, text) = call(&app, "POST", "/sim/release", bad).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {text}");
    }
    // Releasing more than is parked is refused (a test that lost count), and releases nothing.
    call(&app, "POST", "/sim/hold", "").await;
    let a = app.clone();
    let parked = tokio::spawn(async move { call(&a, "POST", "/v1/chat/completions", &chat_body("x")).await });
    wait_stats(&app, "parked", |v| v["held"] == 1).await;
    let (status, _, text) = call(&app, "POST", "/sim/release", r#"{"n": 2}"#).await;
    assert_eq!(status, StatusCode::CONFLICT, "{text}");
    assert_eq!(parse(&call(&app, "GET", "/sim/stats", "").await.2)["held"], 1);
    assert!(!parked.is_finished());
    // An empty release with nothing parked is fine.
    call(&app, "POST", "/sim/release", "").await;
    assert_eq!(parked.await.unwrap().0, StatusCode::OK);
    assert_eq!(call(&app, "POST", "/sim/release", "").await.0, StatusCode::OK);
}

#[tokio::test]
async fn a_held_request_meets_chaos_when_released() {
    let app = app(Engine::Vllm);
    call(&app, "POST", "/sim/hold", r#"{"count": 1}"#).await;
    let a = app.clone();
    let parked = tokio::spawn(async move { call(&a, "POST", "/v1/chat/completions", &chat_body("x")).await });
    wait_stats(&app, "parked", |v| v["held"] == 1).await;
    call(&app, "POST", "/sim/chaos", r#"{"mode": "status", "status": 503, "count": 1}"#).await;
    call(&app, "POST", "/sim/release", "").await;
    assert_eq!(parked.await.unwrap().0, StatusCode::SERVICE_UNAVAILABLE);
    let stats = parse(&call(&app, "GET", "/sim/stats", "").await.2);
    assert_eq!((stats["requests_total"].as_u64(), stats["chaos_total"].as_u64()), (Some(1), Some(1)));
}

#[tokio::test]
async fn fake_load_vary_moves_the_queue_at_every_scrape() {
    let app = app(Engine::Vllm);
    let (status, _, text) = call(&app, "POST", "/sim/fake-load", r#"{"queue": 2, "vary": true}"#).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let mut seen = Vec::new();
    for _ in 0..4 {
        let (_, _, m) = call(&app, "GET", "/metrics", "").await;
        let line = m.lines().find(|l| l.starts_with("vllm:num_requests_waiting{")).unwrap().to_string();
        seen.push(line.rsplit(' ').next().unwrap().to_string());
    }
    assert_eq!(seen, ["3.0", "2.0", "3.0", "2.0"]);
    call(&app, "POST", "/sim/fake-load", "{}").await;
    let (_, _, m) = call(&app, "GET", "/metrics", "").await;
    assert!(m.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"base\"} 0.0\n"));
}
