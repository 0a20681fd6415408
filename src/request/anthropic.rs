//! The body of Anthropic's Messages API (`POST /v1/messages`, and the token count's,
//! `POST /v1/messages/count_tokens`, which is the same body without `max_tokens`): what the filter
//! checks in it, and the canonical prompt text it gives the prefix scorer.
//! `request::body::parse_request` reads the `model` (the same rules as every other path) and
//! calls this for the rest.
//!
//! Read: `model`, `stream`, `max_tokens`, `system`, `messages`, `tools`. Every other field
//! (`tool_choice`, `thinking`, `metadata`, `temperature`, ...) is skipped without being built.
//!
//! Checked, as Anthropic's API checks them (each a 400 `invalid_request_error`):
//! - `max_tokens` is required and a positive integer (`missing_max_tokens`,
//!   `invalid_max_tokens`), on a message only: a token count does not take it, and the filter
//!   leaves one it sends to the pod;
//! - `messages` is required (`missing_messages`), a list of objects, each with a string `role`
//!   when it has one;
//! - `stream`, when set, is a boolean, and the body is one JSON object (`invalid_json`).
//!
//! Anything else odd (content that is neither a string nor a list, a block that is not an object,
//! a field of an unexpected type inside a block) is left to the model server, which answers it
//! itself: the filter only refuses what it needs to route.
//!
//! Canonical prompt text, the same as a chat-completions body's (`request::body`), so that a
//! system prompt and the turns of one conversation hash the same blocks whichever API carried
//! them, and a later turn starts with exactly the text of the earlier one:
//! - `tools` first, as compact JSON with sorted keys, each tool without its `cache_control`
//!   (clients move that marker from request to request), then a record separator `\u{1e}`;
//! - `system` (a string, or a list of text blocks) as a message of role `system`;
//! - per message: `<role>`, a newline, each content block, then `\u{1e}`. A string content is its
//!   text. Blocks: `text` → its text; `image` and `document` → `[image:<ref>]` /
//!   `[document:<ref>]`, where `<ref>` is the source's `data`, `url` or `file_id` (so two images
//!   differ as their bytes do), or `[image]` without one; `tool_use` (and `server_tool_use`) →
//!   `[tool_use:<name>(<input as sent>)]`; `tool_result` → `[tool_result]` then its content, a
//!   string or blocks written by these same rules; `thinking` → `[thinking]` then its text; any
//!   other type → `[<type>]`, its fields skipped. `cache_control` is never part of the text.
use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;

use crate::base::errors::Rejection;

/// The record separator of the canonical prompt text (the same as `request::body`'s: a test
/// there checks that both write a conversation identically).
const RS: char = '\u{1e}';

/// A Messages API body, as far as the filter reads it. `model` is read by the caller.
#[derive(Deserialize)]
pub struct MessagesRequest<'a> {
    #[serde(borrow, default)]
    pub model: Option<&'a RawValue>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(borrow, default)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    system: Option<Content<'a>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(default)]
    tools: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
}

fn bad_request(code: &'static str, message: impl Into<String>) -> Rejection {
    Rejection::new(400, "invalid_request_error", code, message)
}

impl MessagesRequest<'_> {
    /// The 400s of the fields Anthropic requires (besides `model`): `max_tokens` only with
    /// `max_tokens_required` (a message; a token count takes none), `messages` always.
    pub fn check(&self, max_tokens_required: bool) -> Result<(), Rejection> {
        match self.max_tokens.map(|v| v.get()) {
            _ if !max_tokens_required => {}
            None | Some("null") => {
                return Err(bad_request("missing_max_tokens", "max_tokens: Field required"));
            }
            Some(v) => match serde_json::from_str::<u64>(v) {
                Ok(n) if n >= 1 => {}
                _ => {
                    return Err(bad_request(
                        "invalid_max_tokens",
                        format!("max_tokens: must be a positive integer, got {}", clip(v)),
                    ));
                }
            },
        }
        if self.messages.is_none() {
            return Err(bad_request("missing_messages", "messages: Field required"));
        }
        Ok(())
    }

    /// Appends the canonical prompt text (module docs) to `out`.
    pub fn write_prompt(&self, out: &mut String) {
        if let Some(tools) = &self.tools {
            if !tools.is_null() {
                out.push_str("[tools]");
                out.push_str(&without_cache_control(tools).to_string());
                out.push(RS);
            }
        }
        if let Some(system) = &self.system {
            push_message(out, "system", system);
        }
        for m in self.messages.iter().flatten() {
            // A message without a role is written as a user turn, as chat bodies are.
            let role = m.role.as_deref().unwrap_or("user");
            match &m.content {
                Some(c) => push_message(out, role, c),
                None => push_message(out, role, &Content::Other),
            }
        }
    }
}

/// At most 40 characters of a client's value in an error message.
fn clip(s: &str) -> &str {
    match s.char_indices().nth(40) {
        Some((i, _)) => s.get(..i).unwrap_or(s),
        None => s,
    }
}

/// The tools without the `cache_control` of each (a copy only when one has it).
fn without_cache_control(tools: &serde_json::Value) -> Cow<'_, serde_json::Value> {
    let marked = |t: &serde_json::Value| t.get("cache_control").is_some();
    match tools.as_array() {
        Some(list) if list.iter().any(marked) => {
            let mut list = list.clone();
            for t in &mut list {
                if let Some(obj) = t.as_object_mut() {
                    obj.remove("cache_control");
                }
            }
            Cow::Owned(serde_json::Value::Array(list))
        }
        _ => Cow::Borrowed(tools),
    }
}

fn push_message(out: &mut String, role: &str, content: &Content<'_>) {
    out.push_str(role);
    out.push('\n');
    push_content(out, content);
    out.push(RS);
}

fn push_content(out: &mut String, content: &Content<'_>) {
    match content {
        Content::Text(t) => out.push_str(t),
        Content::Blocks(blocks) => blocks.iter().for_each(|b| push_block(out, b)),
        Content::Other => {}
    }
}

fn push_block(out: &mut String, b: &Block<'_>) {
    let kind = b.kind.as_deref();
    match kind {
        // A block without a type that has text is read as a text block.
        Some("text") | None => out.push_str(b.text.as_deref().unwrap_or("")),
        Some(k @ ("image" | "document")) => {
            out.push('[');
            out.push_str(k);
            if let Some(r) = b.source.and_then(source_ref) {
                out.push(':');
                out.push_str(&r);
            }
            out.push(']');
        }
        Some("tool_use" | "server_tool_use") => {
            out.push_str("[tool_use:");
            out.push_str(b.name.as_deref().unwrap_or(""));
            out.push('(');
            out.push_str(b.input.map_or("", |i| i.get()));
            out.push_str(")]");
        }
        Some("tool_result") => {
            out.push_str("[tool_result]");
            if let Some(c) = &b.content {
                push_content(out, c);
            }
        }
        Some("thinking") => {
            out.push_str("[thinking]");
            out.push_str(b.thinking.as_deref().unwrap_or(""));
        }
        Some(k) => {
            out.push('[');
            out.push_str(k);
            out.push(']');
        }
    }
}

/// What identifies an image's or a document's bytes: its source's `data`, `url` or `file_id`.
fn source_ref(source: &RawValue) -> Option<Cow<'_, str>> {
    #[derive(Deserialize)]
    struct Source<'a> {
        #[serde(borrow, default)]
        data: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        url: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        file_id: Option<Cow<'a, str>>,
    }
    let s: Source<'_> = serde_json::from_str(source.get()).ok()?;
    s.data.or(s.url).or(s.file_id)
}

/// A `content` (of a message, of `system`, of a tool result): a string, a list of blocks, or
/// anything else (ignored). Deserialized by hand so that nothing is buffered (as
/// `request::body`'s chat content is).
enum Content<'a> {
    Text(Cow<'a, str>),
    Blocks(Vec<Block<'a>>),
    Other,
}

/// One content block: the fields the prompt text uses. Any value that is not an object reads as
/// an empty block of no type (written as nothing); a field of an unexpected type reads as absent.
#[derive(Default)]
struct Block<'a> {
    kind: Option<Cow<'a, str>>,
    text: Option<Cow<'a, str>>,
    thinking: Option<Cow<'a, str>>,
    name: Option<Cow<'a, str>>,
    input: Option<&'a RawValue>,
    source: Option<&'a RawValue>,
    content: Option<Content<'a>>,
}

/// Drains whatever a visitor was handed that it does not use.
macro_rules! ignore_scalars {
    ($value:expr) => {
        fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok($value)
        }
    };
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ContentVisitor(PhantomData))
    }
}

struct ContentVisitor<'a>(PhantomData<&'a ()>);

impl<'de: 'a, 'a> Visitor<'de> for ContentVisitor<'a> {
    type Value = Content<'a>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
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
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut blocks = Vec::new();
        while let Some(b) = seq.next_element::<Block<'a>>()? {
            blocks.push(b);
        }
        Ok(Content::Blocks(blocks))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Content::Other)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        Content::deserialize(d)
    }
    ignore_scalars!(Content::Other);
}

impl<'de: 'a, 'a> Deserialize<'de> for Block<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(BlockVisitor(PhantomData))
    }
}

struct BlockVisitor<'a>(PhantomData<&'a ()>);

impl<'de: 'a, 'a> Visitor<'de> for BlockVisitor<'a> {
    type Value = Block<'a>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a content block")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut b = Block::default();
        while let Some(field) = map.next_key::<Field>()? {
            match field {
                Field::Type => b.kind = map.next_value::<LooseStr<'a>>()?.0,
                Field::Text => b.text = map.next_value::<LooseStr<'a>>()?.0,
                Field::Thinking => b.thinking = map.next_value::<LooseStr<'a>>()?.0,
                Field::Name => b.name = map.next_value::<LooseStr<'a>>()?.0,
                Field::Input => b.input = Some(map.next_value::<&'a RawValue>()?),
                Field::Source => b.source = Some(map.next_value::<&'a RawValue>()?),
                Field::Content => b.content = map.next_value::<Option<Content<'a>>>()?,
                Field::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(b)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Block::default())
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(Block::default())
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        Block::deserialize(d)
    }
    ignore_scalars!(Block::default());
}

/// The block fields the prompt text reads; every other key is skipped.
enum Field {
    Type,
    Text,
    Thinking,
    Name,
    Input,
    Source,
    Content,
    Other,
}

impl<'de> Deserialize<'de> for Field {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct FieldVisitor;
        impl Visitor<'_> for FieldVisitor {
            type Value = Field;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Field, E> {
                Ok(match v {
                    "type" => Field::Type,
                    "text" => Field::Text,
                    "thinking" => Field::Thinking,
                    "name" => Field::Name,
                    "input" => Field::Input,
                    "source" => Field::Source,
                    "content" => Field::Content,
                    _ => Field::Other,
                })
            }
        }
        d.deserialize_identifier(FieldVisitor)
    }
}

/// A string, borrowed from the body when it has no escapes; any other value reads as `None`.
struct LooseStr<'a>(Option<Cow<'a, str>>);

impl<'de: 'a, 'a> Deserialize<'de> for LooseStr<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(LooseStrVisitor(PhantomData))
    }
}

struct LooseStrVisitor<'a>(PhantomData<&'a ()>);

impl<'de: 'a, 'a> Visitor<'de> for LooseStrVisitor<'a> {
    type Value = LooseStr<'a>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any value")
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(LooseStr(Some(Cow::Borrowed(v))))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(LooseStr(Some(Cow::Owned(v.to_owned()))))
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(LooseStr(Some(Cow::Owned(v))))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(LooseStr(None))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(LooseStr(None))
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        LooseStr::deserialize(d)
    }
    ignore_scalars!(LooseStr(None));
}

#[cfg(test)]
mod tests;
