use super::*;
use envoy_types::pb::envoy::config::core::v3::HeaderMap;
use envoy_types::pb::envoy::service::ext_proc::v3::HttpBody;

const LLAMA: &str = "meta-llama/Llama-3.1-8B-Instruct";
const NOW: u64 = 1_700_000_000_000;
const METRICS: &str = include_str!("../../../tests/fixtures/metrics/vllm_v1_0.33_dp2_lora_constructed.prom");

fn eps(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("127.88.0.{}:9000", i + 2)).collect()
}

fn chat(model: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": model, "messages": [{"role": "user", "content": "hello there, a prompt of some length"}]
    }))
    .unwrap()
}

/// The destination header a body response sets, or None.
fn destination(r: &ProcessingResponse) -> Option<String> {
    let Some(processing_response::Response::RequestBody(b)) = &r.response else { return None };
    let c = b.response.as_ref()?;
    assert_eq!(c.status, common_response::ResponseStatus::Continue as i32);
    let m = c.header_mutation.as_ref()?;
    assert_eq!(m.set_headers.len(), 1);
    let h = m.set_headers[0].header.as_ref()?;
    assert_eq!(h.key, DESTINATION_HEADER);
    Some(String::from_utf8(h.raw_value.clone()).unwrap())
}

/// (status, parsed JSON body) of an immediate response, or None.
fn immediate(r: &ProcessingResponse) -> Option<(i32, serde_json::Value)> {
    let Some(processing_response::Response::ImmediateResponse(i)) = &r.response else { return None };
    Some((i.status.as_ref()?.code, serde_json::from_slice(&i.body).unwrap()))
}

#[test]
fn extract_model_reads_the_model_and_refuses_the_rest() {
    assert_eq!(extract_model(&chat(LLAMA)).unwrap(), LLAMA);
    // Escapes are decoded; other fields, nested or not, are skipped.
    assert_eq!(extract_model(br#"{"x":{"model":"no"},"model":"a\/b\u0041"}"#).unwrap(), "a/bA");
    for (body, code) in [
        (&b"not json"[..], "invalid_json"),
        (b"", "invalid_json"),
        (b"[1,2]", "invalid_json"),
        (br#"{"model": 7}"#, "invalid_json"),
        (br#"{"model": "x""#, "invalid_json"),
        (br#"{"messages": []}"#, "missing_model"),
        (br#"{"model": "  "}"#, "missing_model"),
    ] {
        let e = extract_model(body).unwrap_err();
        assert_eq!((e.status, e.code), (400, code), "{:?}", String::from_utf8_lossy(body));
    }
    // Invalid UTF-8 inside a string is an error, not a panic.
    assert_eq!(extract_model(b"{\"model\": \"\xff\"}").unwrap_err().status, 400);
}

#[test]
fn round_robin_cycles_through_every_endpoint_in_order() {
    assert!(RoundRobin::new(vec![]).is_none());
    let mut rr = RoundRobin::new(eps(3)).unwrap();
    let got: Vec<String> = (0..7).map(|_| rr.pick().to_string()).collect();
    let e = eps(3);
    assert_eq!(got, [&e[0], &e[1], &e[2], &e[0], &e[1], &e[2], &e[0]].map(|s| s.clone()));
    let mut one = RoundRobin::new(eps(1)).unwrap();
    assert_eq!((one.pick().to_string(), one.pick().to_string()), (e[0].clone(), e[0].clone()));
}

#[test]
fn destination_mutation_overwrites_one_header() {
    let m = destination_mutation("127.88.0.2:9000,127.88.0.3:9000");
    assert!(m.remove_headers.is_empty());
    assert_eq!(m.set_headers.len(), 1);
    let o = &m.set_headers[0];
    assert_eq!(o.append_action, header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd as i32);
    let h = o.header.as_ref().unwrap();
    assert_eq!(h.key, "x-gateway-destination-endpoint");
    assert_eq!(h.raw_value, b"127.88.0.2:9000,127.88.0.3:9000");
    assert!(h.value.is_empty(), "Envoy takes raw_value; value must stay empty");
}

fn headers_msg(path: &str) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    HeaderValue { key: ":method".into(), value: String::new(), raw_value: b"POST".to_vec() },
                    HeaderValue {
                        key: ":path".into(),
                        value: String::new(),
                        raw_value: path.as_bytes().to_vec(),
                    },
                ],
            }),
            end_of_stream: false,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn body_msg(body: &[u8], end: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: body.to_vec(),
            end_of_stream: end,
            ..Default::default()
        })),
        ..Default::default()
    }
}

#[test]
fn a_stream_gets_continue_on_headers_then_the_destination_on_the_body() {
    let mut p = Picker::Rr(RoundRobin::new(eps(2)).unwrap());
    for expect in [eps(2)[0].clone(), eps(2)[1].clone(), eps(2)[0].clone()] {
        let mut st = StreamState::default();
        let h = handle(&mut p, &mut st, headers_msg("/v1/chat/completions"), NOW).unwrap();
        let Some(processing_response::Response::RequestHeaders(hr)) = &h.response else { panic!("{h:?}") };
        let c = hr.response.as_ref().unwrap();
        assert_eq!(c.status, common_response::ResponseStatus::Continue as i32);
        assert!(c.header_mutation.is_none());
        assert_eq!(st.path.as_deref(), Some("/v1/chat/completions"));
        let b = handle(&mut p, &mut st, body_msg(&chat(LLAMA), true), NOW).unwrap();
        assert_eq!(destination(&b), Some(expect));
    }
    // An empty message takes no answer.
    assert!(handle(&mut p, &mut StreamState::default(), ProcessingRequest::default(), NOW).is_none());
}

#[test]
fn a_body_in_chunks_is_decided_on_the_whole() {
    let mut p = Picker::Rr(RoundRobin::new(eps(1)).unwrap());
    let mut st = StreamState::default();
    let body = chat(LLAMA);
    let (a, b) = body.split_at(10);
    let first = handle(&mut p, &mut st, body_msg(a, false), NOW).unwrap();
    assert_eq!(destination(&first), None);
    assert!(matches!(first.response, Some(processing_response::Response::RequestBody(_))));
    let last = handle(&mut p, &mut st, body_msg(b, true), NOW).unwrap();
    assert_eq!(destination(&last), Some(eps(1)[0].clone()));
}

#[test]
fn a_bad_body_is_answered_400_with_an_openai_error() {
    let mut p = Picker::Rr(RoundRobin::new(eps(2)).unwrap());
    let r = handle(&mut p, &mut StreamState::default(), body_msg(b"{nope", true), NOW).unwrap();
    let (status, body) = immediate(&r).unwrap();
    assert_eq!(status, 400);
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(body["error"]["code"], "invalid_json");
    // The round robin did not advance on the refused request.
    let ok = handle(&mut p, &mut StreamState::default(), body_msg(&chat(LLAMA), true), NOW).unwrap();
    assert_eq!(destination(&ok), Some(eps(2)[0].clone()));
}

#[test]
fn header_reads_raw_value_then_value() {
    let h = HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![
                HeaderValue { key: "A".into(), value: "old".into(), raw_value: vec![] },
                HeaderValue { key: "b".into(), value: String::new(), raw_value: b"\xffx".to_vec() },
            ],
        }),
        ..Default::default()
    };
    assert_eq!(header(&h, "a").as_deref(), Some("old"));
    assert_eq!(header(&h, "b").as_deref(), Some("\u{fffd}x"));
    assert_eq!(header(&h, "c"), None);
    assert_eq!(header(&HttpHeaders::default(), "a"), None);
}

#[test]
fn the_scheduler_picks_a_listed_endpoint_with_fallbacks() {
    let list = eps(8);
    let mut s = SchedPicker::new(&list, LLAMA, METRICS, NOW).unwrap();
    for i in 0..20u64 {
        let body = serde_json::to_vec(&serde_json::json!({
            "model": LLAMA, "messages": [{"role": "user", "content": format!("{i} a prompt")}]
        }))
        .unwrap();
        let dest = s.pick("/v1/chat/completions", &body, NOW + i * 60).unwrap();
        let parts: Vec<&str> = dest.split(',').collect();
        // Primary plus the shipped default of 2 fallbacks, all distinct and listed.
        assert_eq!(parts.len(), 3, "{dest}");
        assert!(parts.iter().all(|p| list.iter().any(|e| e == p)), "{dest}");
        assert_ne!(parts[0], parts[1]);
    }
    // The snapshot was republished as time went on.
    assert!(s.snap.version > 1 && s.snap.published_ms > NOW);
    assert!(s.snap.endpoints.iter().all(|e| e.scraped_ms == s.snap.published_ms));
    // The fixture's metrics reached the snapshot (KV usage is in it).
    assert!(s.snap.endpoints[0].metrics.as_ref().unwrap().kv_usage.is_some());
}

#[test]
fn the_scheduler_refuses_an_unknown_model_and_bad_json() {
    let mut p = Picker::Sched(Box::new(SchedPicker::new(&eps(4), LLAMA, METRICS, NOW).unwrap()));
    let (status, body) = immediate(&p.decide("/v1/chat/completions", &chat("no-such-model"), NOW)).unwrap();
    assert_eq!((status, body["error"]["code"].as_str()), (404, Some("model_not_found")));
    let (status, _) = immediate(&p.decide("/v1/chat/completions", b"\x00\x01", NOW)).unwrap();
    assert_eq!(status, 400);
    assert!(destination(&p.decide("/v1/chat/completions", &chat(LLAMA), NOW)).is_some());
}

#[test]
fn the_scheduler_needs_endpoints_and_parsable_metrics() {
    assert!(SchedPicker::new(&[], LLAMA, METRICS, NOW).is_err());
    assert!(SchedPicker::new(&eps(2), LLAMA, METRICS, NOW).is_ok());
}
