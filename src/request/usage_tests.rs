use super::*;

fn scan(content_type: &str, path: &str) -> UsageScan {
    UsageScan::start(Some("200"), Some(content_type), None, path).unwrap()
}

/// The outcome of `body` fed in the given pieces.
fn read(content_type: &str, path: &str, pieces: &[&[u8]]) -> Outcome {
    let mut s = scan(content_type, path);
    for p in pieces {
        s.feed(p);
    }
    s.finish()
}

fn whole(content_type: &str, path: &str, body: &[u8]) -> Outcome {
    read(content_type, path, &[body])
}

const SSE: &str = "text/event-stream; charset=utf-8";
const JSON: &str = "application/json";
const CHAT: &str = "/v1/chat/completions";
const MESSAGES: &str = "/v1/messages";

fn counted(prompt_tokens: u64, completion_tokens: u64) -> Outcome {
    Outcome::Counted(Usage { prompt_tokens, completion_tokens })
}

/// An OpenAI chat stream with `include_usage`: every chunk has `"usage":null`, the last chunk
/// the usage; content with multi-byte characters and an escaped quote.
fn openai_stream() -> Vec<u8> {
    let mut s = String::new();
    for (i, word) in ["Hé", " wörld", " 🦀", " \\\"usage\\\": {", " end"].iter().enumerate() {
        s += &format!(
            "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\
             \"delta\":{{\"content\":\"{word}\"}},\"finish_reason\":null}}],\"usage\":null,\"n\":{i}}}\n\n"
        );
    }
    s += "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":37,\"completion_tokens\":5,\
          \"total_tokens\":42,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\n";
    s += "data: [DONE]\n\n";
    s.into_bytes()
}

/// An Anthropic stream: `message_start` reports the prompt, `message_delta` the final totals.
fn anthropic_stream() -> Vec<u8> {
    concat!(
        "event: message_start\n",
        "data: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"content\":[],\"usage\":",
        "{\"input_tokens\":30,\"output_tokens\":1}}}\n\n",
        "event: ping\ndata: {\"type\": \"ping\"}\n\n",
        ": a comment line\n",
        "event: content_block_delta\n",
        "data: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"usage\"}}\n\n",
        "event: message_delta\n",
        "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":",
        "{\"input_tokens\":10,\"cache_read_input_tokens\":20,\"cache_creation_input_tokens\":4,",
        "\"output_tokens\":12}}\n\n",
        "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
    )
    .as_bytes()
    .to_vec()
}

#[test]
fn non_streamed_openai_and_anthropic_bodies() {
    let chat = br#"{"id":"x","choices":[{"message":{"role":"assistant","content":"a \"usage\": {1}"}}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}}"#;
    assert_eq!(whole(JSON, CHAT, chat), counted(12, 3));
    // Anthropic's input_tokens leaves the cached tokens out; the prompt is all three.
    let msg = br#"{"type":"message","content":[{"type":"text","text":"hi"}],"usage":{"input_tokens":5,
        "cache_creation_input_tokens":7,"cache_read_input_tokens":100,"output_tokens":9,
        "cache_creation":{"ephemeral_5m_input_tokens":7},"service_tier":"standard"}}"#;
    assert_eq!(whole(JSON, MESSAGES, msg), counted(112, 9));
    // The same field names on an OpenAI path (the Responses API): input_tokens as reported.
    let responses = br#"{"object":"response","usage":{"input_tokens":8,"output_tokens":2,
        "input_tokens_details":{"cached_tokens":4}}}"#;
    assert_eq!(whole(JSON, "/v1/responses", responses), counted(8, 2));
    // Embeddings: prompt tokens only.
    let emb = br#"{"data":[{"embedding":[0.1,-2e-3]}],"usage":{"prompt_tokens":4,"total_tokens":4}}"#;
    assert_eq!(whole(JSON, "/v1/embeddings", emb), counted(4, 0));
    // No usage at all, or `"usage"` only as a value or inside a string: missing.
    assert_eq!(whole(JSON, CHAT, br#"{"choices":[]}"#), Outcome::Missing);
    assert_eq!(whole(JSON, CHAT, br#"{"type":"usage","x":{"prompt_tokens":1}}"#), Outcome::Missing);
    assert_eq!(whole(JSON, CHAT, br#"{"t":"say \"usage\":{\"prompt_tokens\":1}"}"#), Outcome::Missing);
    assert_eq!(whole(JSON, CHAT, br#"{"usage":null}"#), Outcome::Missing);
    assert_eq!(whole(JSON, CHAT, b""), Outcome::Missing);
}

#[test]
fn streamed_usage_of_openai_and_anthropic() {
    assert_eq!(whole(SSE, CHAT, &openai_stream()), counted(37, 5));
    // Last value of each field wins: 10 + 20 + 4 from message_delta, output 12.
    assert_eq!(whole(SSE, MESSAGES, &anthropic_stream()), counted(34, 12));
    // A stream without include_usage has nothing to count.
    let plain = b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\ndata: [DONE]\n\n";
    assert_eq!(whole(SSE, CHAT, plain), Outcome::Missing);
    // vLLM's continuous usage stats: running totals on every chunk, the last wins.
    let running = b"data: {\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":1}}\n\n\
                    data: {\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2}}\n\n\
                    data: {\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":3}}\n\n";
    assert_eq!(whole(SSE, CHAT, running), counted(9, 3));
    // The Responses API: `response.completed` carries `response.usage`.
    let responses =
        b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\n\n\
        event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"output\":[],\
        \"usage\":{\"input_tokens\":21,\"output_tokens\":6}}}\n\n";
    assert_eq!(whole(SSE, "/v1/responses", responses), counted(21, 6));
}

#[test]
fn line_endings_optional_space_and_multi_line_events() {
    let body = "data:{\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\r\n\r\n";
    assert_eq!(whole(SSE, CHAT, body.as_bytes()), counted(1, 2));
    let body = "data: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\r\r";
    assert_eq!(whole(SSE, CHAT, body.as_bytes()), counted(3, 4));
    // One event's data over three lines: joined with newlines, still one JSON text.
    let body = "data: {\"usage\":\ndata: {\"prompt_tokens\":5,\ndata: \"completion_tokens\":6}}\n\n";
    assert_eq!(whole(SSE, CHAT, body.as_bytes()), counted(5, 6));
    // The last event without its blank line still counts.
    let body = "data: {\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":8}}";
    assert_eq!(whole(SSE, CHAT, body.as_bytes()), counted(7, 8));
    // Only `data:` lines are read: a usage object in another field is not.
    let body = "event: {\"usage\":{\"prompt_tokens\":1}}\nid: \"usage\":{\"prompt_tokens\":1}\n\n\
                datax: {\"usage\":{\"prompt_tokens\":1}}\n\n";
    assert_eq!(whole(SSE, CHAT, body.as_bytes()), Outcome::Missing);
}

#[test]
fn every_split_point_gives_the_same_result() {
    for (body, path, expected) in [
        (openai_stream(), CHAT, counted(37, 5)),
        (anthropic_stream(), MESSAGES, counted(34, 12)),
        (
            "data: {\"usage\":\r\ndata: {\"prompt_tokens\":5,\"completion_tokens\":6}}\r\n\r\n"
                .as_bytes()
                .to_vec(),
            CHAT,
            counted(5, 6),
        ),
    ] {
        // Two pieces, cut at every byte: inside `data:`, a key, a number, a UTF-8 character,
        // between CR and LF.
        for cut in 0..=body.len() {
            let (a, b) = body.split_at(cut);
            assert_eq!(read(SSE, path, &[a, b]), expected, "cut at {cut}");
        }
        // One byte at a time.
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(read(SSE, path, &bytes), expected);
        // Three pieces.
        for i in (0..body.len()).step_by(7) {
            for j in (i..body.len()).step_by(11) {
                assert_eq!(read(SSE, path, &[&body[..i], &body[i..j], &body[j..]]), expected, "{i} {j}");
            }
        }
    }
}

#[test]
fn oversize_lines_keep_nothing_and_oversize_usage_is_not_counted() {
    // A 1 MiB content line is scanned, never stored.
    let mut s = scan(SSE, CHAT);
    s.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"");
    for _ in 0..1024 {
        s.feed(&[b'a'; 1024]);
    }
    s.feed(b"\"}}]}\n\ndata: {\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":1}}\n\n");
    assert!(s.json.capture.capacity() <= MAX_USAGE_OBJECT_BYTES);
    assert_eq!(s.finish(), counted(2, 1));
    // A usage object over the cap is not parsed; the capture never grows past the cap.
    let big =
        format!("{{\"usage\":{{\"prompt_tokens\":1,\"pad\":\"{}\"}}}}", "x".repeat(MAX_USAGE_OBJECT_BYTES));
    let mut s = scan(JSON, CHAT);
    s.feed(big.as_bytes());
    assert!(s.json.capture.capacity() <= MAX_USAGE_OBJECT_BYTES);
    assert_eq!(s.finish(), Outcome::TooLarge);
    // ... and one cut off at the end of the body too.
    assert_eq!(whole(JSON, CHAT, &big.as_bytes()[..big.len() - 3]), Outcome::TooLarge);
    // A later usable one still counts.
    let both =
        format!("data: {big}\n\ndata: {{\"usage\":{{\"prompt_tokens\":4,\"completion_tokens\":5}}}}\n\n");
    assert_eq!(whole(SSE, CHAT, both.as_bytes()), counted(4, 5));
    // A usage object at exactly the cap is parsed.
    let pad = MAX_USAGE_OBJECT_BYTES - r#"{"prompt_tokens":1,"p":""}"#.len();
    let exact = format!("{{\"usage\":{{\"prompt_tokens\":1,\"p\":\"{}\"}}}}", "y".repeat(pad));
    assert_eq!(whole(JSON, CHAT, exact.as_bytes()), counted(1, 0));
}

#[test]
fn malformed_usage_is_reported_and_never_panics() {
    for bad in [
        r#"{"usage":{"prompt_tokens":-1}}"#,
        r#"{"usage":{"prompt_tokens":"12"}}"#,
        r#"{"usage":{"prompt_tokens":1.5}}"#,
        r#"{"usage":{"prompt_tokens":1,}}"#,
        r#"{"usage":{"prompt_tokens":99999999999999999999999}}"#,
        r#"{"usage":{"prompt_tokens":1"#,
    ] {
        assert_eq!(whole(JSON, CHAT, bad.as_bytes()), Outcome::Malformed, "{bad}");
    }
    // A malformed event does not spoil the next: the blank line resets the scanner.
    let body = "data: {\"usage\":{\"prompt_tokens\":\"unterminated}\n\n\
                data: {\"usage\":{\"prompt_tokens\":6,\"completion_tokens\":1}}\n\n";
    assert_eq!(whole(SSE, CHAT, body.as_bytes()), counted(6, 1));
    // Invalid UTF-8 in a usage field the scanner skips does not matter, nor anywhere else.
    assert_eq!(whole(JSON, CHAT, b"{\"usage\":{\"prompt_tokens\":1,\"x\":\"\xff\"}}"), counted(1, 0));
    assert_eq!(
        whole(JSON, CHAT, b"{\"c\":\"\xff\xfe\",\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}"),
        counted(1, 1)
    );
}

#[test]
fn which_responses_are_read() {
    for st in [None, Some("404"), Some("500"), Some("x"), Some("199"), Some("300")] {
        assert!(UsageScan::start(st, Some(JSON), None, CHAT).is_none(), "{st:?}");
    }
    assert!(UsageScan::start(Some("200"), None, None, CHAT).is_some());
    assert!(UsageScan::start(Some("206"), Some(SSE), Some("identity"), CHAT).is_some_and(|s| !s.encoded));
    // Compressed: not read, reported as encoded.
    let mut s = UsageScan::start(Some("200"), Some(JSON), Some("gzip"), CHAT).unwrap();
    s.feed(br#"{"usage":{"prompt_tokens":1}}"#);
    assert_eq!(s.finish(), Outcome::Encoded);
    // A body without the SSE content type is read as JSON (an SSE body then still counts).
    assert_eq!(whole("text/plain", CHAT, &openai_stream()), counted(37, 5));
    let names: Vec<&str> =
        [counted(0, 0), Outcome::Missing, Outcome::TooLarge, Outcome::Malformed, Outcome::Encoded]
            .iter()
            .map(Outcome::as_str)
            .collect();
    assert_eq!(names, ["counted", "missing", "too_large", "malformed", "encoded"]);
}

proptest::proptest! {
    #[test]
    fn arbitrary_bytes_in_arbitrary_pieces_never_panic(
        body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600),
        cuts in proptest::collection::vec(0usize..600, 0..6),
        sse in proptest::prelude::any::<bool>(),
    ) {
        let mut s = scan(if sse { SSE } else { JSON }, MESSAGES);
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(body.len())).collect();
        cuts.sort_unstable();
        let mut at = 0;
        for c in cuts {
            s.feed(&body[at..c]);
            at = c;
        }
        s.feed(&body[at..]);
        proptest::prop_assert!(s.json.capture.capacity() <= MAX_USAGE_OBJECT_BYTES);
        let _ = s.finish();
    }

    #[test]
    fn a_stream_gives_its_usage_however_it_is_cut_and_whatever_its_text(
        words in proptest::collection::vec("[ -~é🦀\\\\\"]{0,12}", 0..8),
        prompt in 0u64..1_000_000,
        completion in 0u64..100_000,
        cuts in proptest::collection::vec(0usize..2000, 0..8),
        crlf in proptest::prelude::any::<bool>(),
    ) {
        let nl = if crlf { "\r\n" } else { "\n" };
        let mut body = String::new();
        for w in &words {
            let text = serde_json::to_string(w).unwrap();
            body += &format!("data: {{\"choices\":[{{\"delta\":{{\"content\":{text}}}}}],\"usage\":null}}{nl}{nl}");
        }
        body += &format!("data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt},\"completion_tokens\":{completion}}}}}{nl}{nl}data: [DONE]{nl}{nl}");
        let body = body.into_bytes();
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(body.len())).collect();
        cuts.sort_unstable();
        let mut pieces = Vec::new();
        let mut at = 0;
        for c in cuts {
            pieces.push(&body[at..c]);
            at = c;
        }
        pieces.push(&body[at..]);
        proptest::prop_assert_eq!(read(SSE, CHAT, &pieces), counted(prompt, completion));
    }
}
