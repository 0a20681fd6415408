//! Request-body extraction: the `model`, whether the client streams, and the canonical prompt
//! text the prefix scorer hashes.
//!
//! Supported bodies (OpenAI and vLLM shapes):
//! - chat completions: `messages` (string content or content parts), `tools`;
//! - completions: `prompt` (string, list of strings, token ids, or lists of token ids);
//! - responses: `input` (string or list of items) and `instructions`;
//! - embeddings: `input` (string, list of strings, or token ids);
//! - Anthropic messages (`/v1/messages`): `system` and `messages` (string content or content
//!   blocks), `tools`, and the required `max_tokens`; read by `request::anthropic`, which
//!   writes the same canonical text as chat bodies;
//! - Anthropic token counts (`/v1/messages/count_tokens`): the same body, read by the same
//!   parser, without `max_tokens` (the API does not take it).
//!
//! Parsing is typed and borrows from the body where it can: unknown fields are skipped without
//! being built, so a large body costs one pass.
//!
//! Canonical prompt text (what the prefix scorer hashes). The goal is that a later turn of a
//! conversation starts with exactly the text of the earlier turn, and that two requests share a
//! prefix exactly when the model server would see the same leading tokens:
//! - `tools` first (as compact JSON with sorted keys), because chat templates put tool
//!   definitions in the system preamble;
//! - then, per message in order: `<role>` (and `:name` when set), a newline, each text part,
//!   each image URL as `[image:<url>]`, each audio/file part as `[<type>]`, each tool call as
//!   `[tool_call:<name>(<arguments>)]`, then a record separator `\u{1e}`;
//! - completions: the prompt string (lists are joined with `\u{1e}`; token ids as decimal text).
use std::borrow::Cow;

use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::base::errors::Rejection;
use crate::request::anthropic::MessagesRequest;
use crate::request::protocol::{route_path, COUNT_TOKENS_PATH, MESSAGES_PATH};

/// Which API the body is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    ChatCompletions,
    Completions,
    Responses,
    Embeddings,
    /// Anthropic's Messages API: the path is exactly `/v1/messages`.
    Messages,
    /// Anthropic's token count: the path is exactly `/v1/messages/count_tokens`. A Messages
    /// body without `max_tokens`; not a generation.
    CountTokens,
    /// A path we do not recognise; only `model` is read.
    Other,
}

impl ApiKind {
    /// Classifies a request path (query string ignored).
    pub fn from_path(path: &str) -> ApiKind {
        let p = path.split('?').next().unwrap_or("").trim_end_matches('/');
        let routed = route_path(path);
        if routed == MESSAGES_PATH {
            ApiKind::Messages
        } else if routed == COUNT_TOKENS_PATH {
            ApiKind::CountTokens
        } else if p.ends_with("/chat/completions") {
            ApiKind::ChatCompletions
        } else if p.ends_with("/completions") {
            ApiKind::Completions
        } else if p.ends_with("/responses") {
            ApiKind::Responses
        } else if p.ends_with("/embeddings") {
            ApiKind::Embeddings
        } else {
            ApiKind::Other
        }
    }
}

/// What the filter needs from a request body.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedRequest {
    pub kind: ApiKind,
    pub model: String,
    pub stream: bool,
    /// vLLM's `cache_salt`: requests with different salts never share prefix-cache blocks.
    pub cache_salt: Option<String>,
    /// Canonical prompt text (see module docs); empty when the body has no prompt.
    pub prompt: String,
}

#[derive(Deserialize)]
struct RawRequest<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    messages: Option<Vec<RawMessage<'a>>>,
    #[serde(default)]
    tools: Option<serde_json::Value>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    instructions: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct RawMessage<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
    #[serde(borrow, default)]
    tool_calls: Option<Vec<ToolCall<'a>>>,
}

/// A message's `content`: a string, a list of parts, or anything else (ignored).
///
/// Deserialized by hand, not as a `#[serde(untagged)]` enum: untagged buffers the whole value
/// before trying each variant, which copied every escaped message string twice (into the buffer,
/// then out of it). Same results as the untagged enum it replaces: a string is `Text` (borrowed
/// when it has no escapes); a list is `Parts` when every element is a [`Part`], else `Other`;
/// any other value is `Other`.
enum Content<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<Part<'a>>),
    Other,
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ContentVisitor(std::marker::PhantomData))
    }
}

struct ContentVisitor<'a>(std::marker::PhantomData<&'a ()>);

impl<'de: 'a, 'a> serde::de::Visitor<'de> for ContentVisitor<'a> {
    type Value = Content<'a>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("message content")
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Content::Text(Cow::Borrowed(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Content::Text(Cow::Owned(v.to_owned())))
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(Content::Text(Cow::Owned(v)))
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut parts = Vec::new();
        let mut all_parts = true;
        while let Some(p) = seq.next_element::<MaybePart<'a>>()? {
            match p {
                MaybePart::Part(p) if all_parts => parts.push(p),
                MaybePart::Part(_) => {}
                MaybePart::Other(_) => {
                    all_parts = false;
                    parts.clear();
                }
            }
        }
        Ok(if all_parts { Content::Parts(parts) } else { Content::Other })
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Content::Other)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Content::Other)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Content::Other)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Content::Other)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Content::Other)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Content::Other)
    }
    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(Content::Other)
    }
    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        Content::deserialize(d)
    }
}

/// One element of a content list: a [`Part`], or anything that is not one (which makes the
/// whole list `Content::Other`, as the untagged `Vec<Part>` variant did).
#[derive(Deserialize)]
#[serde(untagged)]
enum MaybePart<'a> {
    Part(#[serde(borrow)] Part<'a>),
    Other(IgnoredAny),
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    image_url: Option<ImageUrl<'a>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ImageUrl<'a> {
    Object {
        #[serde(borrow)]
        url: Cow<'a, str>,
    },
    Plain(#[serde(borrow)] Cow<'a, str>),
}

#[derive(Deserialize)]
struct ToolCall<'a> {
    #[serde(borrow, default)]
    function: Option<FunctionCall<'a>>,
}

#[derive(Deserialize)]
struct FunctionCall<'a> {
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    arguments: Option<Cow<'a, str>>,
}

/// Responses-API input items and completion prompts share this loose shape.
#[derive(Deserialize)]
#[serde(untagged)]
enum PromptValue<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Tokens(Vec<i64>),
    Many(#[serde(borrow)] Vec<PromptItem<'a>>),
    Other(IgnoredAny),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptItem<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Tokens(Vec<i64>),
    Message(#[serde(borrow)] RawMessage<'a>),
    Other(IgnoredAny),
}

const RS: char = '\u{1e}';

fn bad_request(code: &'static str, message: impl Into<String>) -> Rejection {
    Rejection::new(400, "invalid_request_error", code, message)
}

fn invalid_json(e: serde_json::Error) -> Rejection {
    bad_request("invalid_json", format!("request body is not a valid JSON object: {e}"))
}

/// The top-level `model`: a string that is not blank.
fn model_of(raw: Option<&RawValue>) -> Result<String, Rejection> {
    match raw {
        None => Err(bad_request("missing_model", "request body has no \"model\" field")),
        Some(v) => match serde_json::from_str::<Cow<'_, str>>(v.get()) {
            Ok(m) if !m.trim().is_empty() => Ok(m.into_owned()),
            Ok(_) => Err(bad_request("missing_model", "\"model\" is empty")),
            Err(_) => Err(bad_request("invalid_model", "\"model\" must be a string")),
        },
    }
}

/// Parses a request body. Errors are the 400s the filter answers with.
pub fn parse_request(path: &str, body: &[u8]) -> Result<ParsedRequest, Rejection> {
    let mut kind = ApiKind::from_path(path);
    if matches!(kind, ApiKind::Messages | ApiKind::CountTokens) {
        return parse_messages(body, kind);
    }
    let raw: RawRequest<'_> = serde_json::from_slice(body).map_err(invalid_json)?;
    let model = model_of(raw.model)?;
    if kind == ApiKind::Other {
        kind = if raw.messages.is_some() {
            ApiKind::ChatCompletions
        } else if raw.prompt.is_some() {
            ApiKind::Completions
        } else {
            ApiKind::Other
        };
    }
    // The prompt is built from the body's own text (fewer bytes than the body: keys, quotes and
    // escapes are dropped), so one reservation spares the reallocations and their copies.
    let has_prompt = raw.tools.is_some()
        || raw.instructions.is_some()
        || raw.messages.is_some()
        || raw.prompt.is_some()
        || raw.input.is_some();
    let mut prompt = if has_prompt { String::with_capacity(body.len()) } else { String::new() };
    if let Some(tools) = &raw.tools {
        if !tools.is_null() {
            prompt.push_str("[tools]");
            prompt.push_str(&tools.to_string());
            prompt.push(RS);
        }
    }
    if let Some(instr) = &raw.instructions {
        push_message(&mut prompt, Some("system"), None, Some(&Content::Text(Cow::Borrowed(instr))), None);
    }
    if let Some(messages) = &raw.messages {
        for m in messages {
            push_message(
                &mut prompt,
                m.role.as_deref(),
                m.name.as_deref(),
                m.content.as_ref(),
                m.tool_calls.as_deref(),
            );
        }
    }
    for v in [raw.prompt, raw.input].into_iter().flatten() {
        if let Ok(p) = serde_json::from_str::<PromptValue<'_>>(v.get()) {
            push_prompt_value(&mut prompt, &p);
        }
    }
    Ok(ParsedRequest {
        kind,
        model,
        stream: raw.stream.unwrap_or(false),
        cache_salt: raw.cache_salt.map(Cow::into_owned),
        prompt,
    })
}

/// An Anthropic Messages body (`request::anthropic`), of a message or of a token count (`kind`):
/// the model as on every path, then the fields Anthropic requires there (a token count takes no
/// `max_tokens`), then the prompt text.
fn parse_messages(body: &[u8], kind: ApiKind) -> Result<ParsedRequest, Rejection> {
    let raw: MessagesRequest<'_> = serde_json::from_slice(body).map_err(invalid_json)?;
    let model = model_of(raw.model)?;
    raw.check(kind == ApiKind::Messages)?;
    // As for the other APIs: the prompt is built from the body's own text, in one reservation.
    let mut prompt = String::with_capacity(body.len());
    raw.write_prompt(&mut prompt);
    Ok(ParsedRequest { kind, model, stream: raw.stream.unwrap_or(false), cache_salt: None, prompt })
}

fn push_message(
    out: &mut String,
    role: Option<&str>,
    name: Option<&str>,
    content: Option<&Content<'_>>,
    tool_calls: Option<&[ToolCall<'_>]>,
) {
    out.push_str(role.unwrap_or("user"));
    if let Some(n) = name {
        out.push(':');
        out.push_str(n);
    }
    out.push('\n');
    match content {
        Some(Content::Text(t)) => out.push_str(t),
        Some(Content::Parts(parts)) => {
            for p in parts {
                if let Some(t) = &p.text {
                    out.push_str(t);
                } else if let Some(img) = &p.image_url {
                    let url = match img {
                        ImageUrl::Object { url } => url,
                        ImageUrl::Plain(u) => u,
                    };
                    out.push_str("[image:");
                    out.push_str(url);
                    out.push(']');
                } else if let Some(k) = &p.kind {
                    out.push('[');
                    out.push_str(k);
                    out.push(']');
                }
            }
        }
        Some(Content::Other) | None => {}
    }
    for call in tool_calls.unwrap_or(&[]) {
        if let Some(f) = &call.function {
            out.push_str("[tool_call:");
            out.push_str(f.name.as_deref().unwrap_or(""));
            out.push('(');
            out.push_str(f.arguments.as_deref().unwrap_or(""));
            out.push_str(")]");
        }
    }
    out.push(RS);
}

fn push_tokens(out: &mut String, tokens: &[i64]) {
    use std::fmt::Write;
    for (i, t) in tokens.iter().enumerate() {
        if i > 0 {
            out.push(' ');
        }
        let _ = write!(out, "{t}");
    }
}

fn push_prompt_value(out: &mut String, v: &PromptValue<'_>) {
    match v {
        PromptValue::Text(t) => out.push_str(t),
        PromptValue::Tokens(t) => push_tokens(out, t),
        PromptValue::Many(items) => {
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(RS);
                }
                match item {
                    PromptItem::Text(t) => out.push_str(t),
                    PromptItem::Tokens(t) => push_tokens(out, t),
                    PromptItem::Message(m) => push_message(
                        out,
                        m.role.as_deref(),
                        m.name.as_deref(),
                        m.content.as_ref(),
                        m.tool_calls.as_deref(),
                    ),
                    PromptItem::Other(_) => {}
                }
            }
        }
        PromptValue::Other(_) => {}
    }
}

#[derive(Deserialize)]
struct ModelOnly<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
}

/// Returns `body` with the top-level `model` value replaced by `new_model` (a JSON string) and
/// every other byte unchanged: other fields, their order, whitespace and escapes are kept, and a
/// `"model"` key nested inside messages or tools is not touched. The host must set
/// `content-length` to the new length.
///
/// Errors are the same 400s as [`parse_request`] (the body was parsed by it already, so they
/// only happen if it is called on a different body).
pub fn rewrite_model(body: &[u8], new_model: &str) -> Result<Vec<u8>, Rejection> {
    let m: ModelOnly<'_> = serde_json::from_slice(body).map_err(invalid_json)?;
    let raw = m.model.ok_or_else(|| bad_request("missing_model", "request body has no \"model\" field"))?;
    // `raw` borrows from `body`: its position is the offset of its first byte in `body`.
    let value = raw.get().as_bytes();
    let start = (value.as_ptr() as usize).wrapping_sub(body.as_ptr() as usize);
    let end = start.checked_add(value.len());
    let (Some(before), Some(after)) = (body.get(..start), end.and_then(|e| body.get(e..))) else {
        return Err(Rejection::new(500, "internal_error", "internal", "model value outside the body"));
    };
    let encoded = serde_json::to_string(new_model).map_err(|e| {
        Rejection::new(500, "internal_error", "internal", format!("cannot encode model: {e}"))
    })?;
    let mut out = Vec::with_capacity(before.len() + encoded.len() + after.len());
    out.extend_from_slice(before);
    out.extend_from_slice(encoded.as_bytes());
    out.extend_from_slice(after);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(path: &str, body: &str) -> Result<ParsedRequest, Rejection> {
        parse_request(path, body.as_bytes())
    }

    /// The untagged enum `Content` replaced, kept here as the reference for its results.
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OldContent<'a> {
        Text(#[serde(borrow)] Cow<'a, str>),
        Parts(#[serde(borrow)] Vec<Part<'a>>),
        Other(IgnoredAny),
    }

    /// Comparable form: text, or parts as (type, text, image url), or other.
    #[derive(Debug, PartialEq)]
    enum Seen {
        Text(String),
        Parts(Vec<(Option<String>, Option<String>, Option<String>)>),
        Other,
    }

    fn seen_parts(parts: &[Part<'_>]) -> Seen {
        Seen::Parts(
            parts
                .iter()
                .map(|p| {
                    let url = p.image_url.as_ref().map(|u| match u {
                        ImageUrl::Object { url } => url.to_string(),
                        ImageUrl::Plain(u) => u.to_string(),
                    });
                    (p.kind.as_ref().map(|k| k.to_string()), p.text.as_ref().map(|t| t.to_string()), url)
                })
                .collect(),
        )
    }

    fn seen_new(c: &Content<'_>) -> Seen {
        match c {
            Content::Text(t) => Seen::Text(t.to_string()),
            Content::Parts(p) => seen_parts(p),
            Content::Other => Seen::Other,
        }
    }

    fn seen_old(c: &OldContent<'_>) -> Seen {
        match c {
            OldContent::Text(t) => Seen::Text(t.to_string()),
            OldContent::Parts(p) => seen_parts(p),
            OldContent::Other(_) => Seen::Other,
        }
    }

    /// Inside an untagged enum (as in a Responses `input` item) the value comes buffered.
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Nested<C> {
        Msg { content: Option<C> },
        Other(IgnoredAny),
    }

    #[test]
    fn hand_written_content_matches_the_untagged_enum_it_replaced() {
        let cases = [
            r#""plain""#,
            r#""with \"escapes\"\n and \u00e9""#,
            r#""""#,
            r#"[]"#,
            r#"[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"u"}}]"#,
            r#"[{"type":"image_url","image_url":"plain-url"},{"type":"input_audio"}]"#,
            r#"[{"type":"text","text":"a\nb"}]"#,
            r#"[{"type":"text","text":"a"},5]"#,
            r#"[5,{"type":"text","text":"a"}]"#,
            r#"[{"type":"text","text":7}]"#,
            r#"[["text","positional"]]"#,
            r#"[null]"#,
            r#"{"type":"text","text":"an object"}"#,
            r#"42"#,
            r#"-1.5"#,
            r#"true"#,
            r#"[[1,2],{"a":[{"b":null}]}]"#,
        ];
        for c in cases {
            let new: Content<'_> = serde_json::from_str(c).unwrap();
            let old: OldContent<'_> = serde_json::from_str(c).unwrap();
            assert_eq!(seen_new(&new), seen_old(&old), "{c}");
            let doc = format!(r#"{{"content":{c}}}"#);
            let new: Nested<Content<'_>> = serde_json::from_str(&doc).unwrap();
            let old: Nested<OldContent<'_>> = serde_json::from_str(&doc).unwrap();
            let (Nested::Msg { content: new }, Nested::Msg { content: old }) = (new, old) else {
                panic!("{c}: not read as a message");
            };
            assert_eq!(new.as_ref().map(seen_new), old.as_ref().map(seen_old), "nested {c}");
        }
        // null content is no content either way.
        let new: Nested<Content<'_>> = serde_json::from_str(r#"{"content":null}"#).unwrap();
        assert!(matches!(new, Nested::Msg { content: None }));
    }

    #[test]
    fn chat_model_stream_and_prompt() {
        let r = parse(
            "/v1/chat/completions",
            r#"{"model":"m","stream":true,"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]}"#,
        )
        .unwrap();
        assert_eq!(r.kind, ApiKind::ChatCompletions);
        assert_eq!(r.model, "m");
        assert!(r.stream);
        assert_eq!(r.prompt, "system\nBe brief.\u{1e}user\nHi\u{1e}");
    }

    #[test]
    fn second_turn_extends_first_turn_text() {
        let t1 = parse("/v1/chat/completions", r#"{"model":"m","messages":[{"role":"user","content":"A"}]}"#)
            .unwrap();
        let t2 = parse(
            "/v1/chat/completions",
            r#"{"model":"m","messages":[{"role":"user","content":"A"},{"role":"assistant","content":"B"},{"role":"user","content":"C"}]}"#,
        )
        .unwrap();
        assert!(t2.prompt.starts_with(&t1.prompt));
    }

    #[test]
    fn content_parts_images_tools_and_tool_calls() {
        let r = parse(
            "/v1/chat/completions",
            r#"{"model":"m","tools":[{"type":"function","function":{"name":"f","parameters":{}}}],
               "messages":[{"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"http://x/i.png"}},{"type":"input_audio","input_audio":{}}]},
               {"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]},
               {"role":"tool","tool_call_id":"1","content":"ok"}]}"#,
        )
        .unwrap();
        // tools are serialised with sorted keys by serde_json::Value.
        assert_eq!(
            r.prompt,
            "[tools][{\"function\":{\"name\":\"f\",\"parameters\":{}},\"type\":\"function\"}]\u{1e}\
             user\nlook[image:http://x/i.png][input_audio]\u{1e}\
             assistant\n[tool_call:f({\"a\":1})]\u{1e}\
             tool\nok\u{1e}"
        );
    }

    #[test]
    fn completion_prompt_shapes() {
        let r = parse("/v1/completions", r#"{"model":"m","prompt":"abc"}"#).unwrap();
        assert_eq!((r.kind, r.prompt.as_str()), (ApiKind::Completions, "abc"));
        let r = parse("/v1/completions", r#"{"model":"m","prompt":["a","b"]}"#).unwrap();
        assert_eq!(r.prompt, "a\u{1e}b");
        let r = parse("/v1/completions", r#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(r.prompt, "1 2 3");
        let r = parse("/v1/completions", r#"{"model":"m","prompt":[[1,2],[3]]}"#).unwrap();
        assert_eq!(r.prompt, "1 2\u{1e}3");
    }

    #[test]
    fn responses_and_embeddings() {
        let r = parse(
            "/v1/responses",
            r#"{"model":"m","instructions":"sys","input":[{"role":"user","content":"q"}]}"#,
        )
        .unwrap();
        assert_eq!(r.kind, ApiKind::Responses);
        assert_eq!(r.prompt, "system\nsys\u{1e}user\nq\u{1e}");
        let r = parse("/v1/embeddings", r#"{"model":"e","input":"hello"}"#).unwrap();
        assert_eq!((r.kind, r.prompt.as_str()), (ApiKind::Embeddings, "hello"));
    }

    #[test]
    fn escapes_are_decoded_and_salt_kept() {
        let r =
            parse("/v1/completions", r#"{"model":"m\u0041","prompt":"a\"b\n","cache_salt":"s1"}"#).unwrap();
        assert_eq!(r.model, "mA");
        assert_eq!(r.prompt, "a\"b\n");
        assert_eq!(r.cache_salt.as_deref(), Some("s1"));
    }

    #[test]
    fn errors_are_400_with_codes() {
        for (body, code) in [
            ("not json", "invalid_json"),
            ("[1,2]", "invalid_json"),
            ("{\"model\":\"m\"", "invalid_json"),
            ("{}", "missing_model"),
            ("{\"model\":\"  \"}", "missing_model"),
            ("{\"model\":5}", "invalid_model"),
            ("{\"model\":null}", "missing_model"),
        ] {
            let e = parse("/v1/chat/completions", body).unwrap_err();
            assert_eq!((e.status, e.code), (400, code), "body {body}");
        }
    }

    #[test]
    fn unknown_path_is_classified_by_shape() {
        let r = parse("/custom", r#"{"model":"m","messages":[]}"#).unwrap();
        assert_eq!(r.kind, ApiKind::ChatCompletions);
        let r = parse("/custom", r#"{"model":"m"}"#).unwrap();
        assert_eq!(r.kind, ApiKind::Other);
    }

    #[test]
    fn odd_but_valid_shapes_do_not_fail() {
        // Content of an unexpected type and messages without role still parse.
        let r = parse("/v1/chat/completions", r#"{"model":"m","messages":[{"content":5},{"role":"user"}]}"#)
            .unwrap();
        assert_eq!(r.prompt, "user\n\u{1e}user\n\u{1e}");
    }

    #[test]
    fn rewrite_model_replaces_only_the_top_level_value() {
        let body = br#"{ "messages":[{"role":"user","content":"say \"model\": x","model":"inner"}],
  "model" : "llama\u0041" ,"stream":true,"n":1.50}"#;
        let out = rewrite_model(body, "sql-lora").unwrap();
        let expected = br#"{ "messages":[{"role":"user","content":"say \"model\": x","model":"inner"}],
  "model" : "sql-lora" ,"stream":true,"n":1.50}"#;
        assert_eq!(std::str::from_utf8(&out).unwrap(), std::str::from_utf8(expected).unwrap());
        // The rewritten body parses to the new model with the same prompt.
        let a = parse_request("/v1/chat/completions", body).unwrap();
        let b = parse_request("/v1/chat/completions", &out).unwrap();
        assert_eq!((b.model.as_str(), b.prompt == a.prompt, b.stream), ("sql-lora", true, true));
        // The content length changes by the difference of the two encodings:
        // "llama\u0041" is 13 bytes, "sql-lora" is 10.
        assert_eq!(out.len(), body.len() - 3);
    }

    #[test]
    fn rewrite_model_escapes_and_errors() {
        let out = rewrite_model(br#"{"model":"m"}"#, "a\"b\\c\u{1}").unwrap();
        assert_eq!(out, br#"{"model":"a\"b\\c\u0001"}"#.to_vec());
        assert_eq!(parse_request("/x", &out).unwrap().model, "a\"b\\c\u{1}");
        assert_eq!(rewrite_model(b"{}", "x").unwrap_err().code, "missing_model");
        assert_eq!(rewrite_model(b"{\"model\":", "x").unwrap_err().code, "invalid_json");
        assert_eq!(rewrite_model(br#"{"model":"a","model":"b"}"#, "x").unwrap_err().code, "invalid_json");
    }

    #[test]
    fn rewrite_model_on_real_fixture_keeps_everything_else() {
        let body = include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/requests/chat_lora_priority_vllm_extensions.request.json"
        ));
        let out = rewrite_model(body, "llama").unwrap();
        let mut a: serde_json::Value = serde_json::from_slice(body).unwrap();
        let b: serde_json::Value = serde_json::from_slice(&out).unwrap();
        a["model"] = "llama".into();
        assert_eq!(a, b);
    }

    proptest::proptest! {
        #[test]
        fn never_panics(s in ".{0,200}") {
            let _ = parse("/v1/chat/completions", &s);
            let _ = parse("/v1/messages", &s);
            let _ = parse("/v1/messages/count_tokens", &s);
            let _ = rewrite_model(s.as_bytes(), "m");
        }

        #[test]
        fn rewrite_model_round_trips(old in "\\PC{1,20}", new in "\\PC{1,20}", content in "\\PC{0,40}") {
            let body = serde_json::json!({"messages":[{"role":"user","content":content}],"model":old,"stream":true});
            let bytes = serde_json::to_vec(&body).unwrap();
            let out = rewrite_model(&bytes, &new).unwrap();
            let mut expected = body.clone();
            expected["model"] = new.clone().into();
            let got: serde_json::Value = serde_json::from_slice(&out).unwrap();
            proptest::prop_assert_eq!(got, expected);
        }
    }
}
