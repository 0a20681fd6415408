//! Token usage read from a response as it passes: the prompt and completion tokens the model
//! server reports, without buffering the body and without changing a byte of it.
//!
//! # What is read
//! Every JSON object that is the value of a `"usage"` key, wherever it sits: the top-level
//! `usage` of a non-streamed OpenAI or Anthropic body, the final usage chunk of an OpenAI stream
//! (sent when the client asked `stream_options.include_usage`, or on every chunk with vLLM's
//! continuous usage stats), the `message.usage` of Anthropic's `message_start` and the `usage` of
//! its `message_delta`, the `response.usage` of an OpenAI Responses stream. Of each field, the
//! last value seen wins (streams report running totals):
//! - prompt tokens: `prompt_tokens`, else `input_tokens`; on the Messages API (`/v1/messages`)
//!   `input_tokens + cache_creation_input_tokens + cache_read_input_tokens`, because Anthropic's
//!   `input_tokens` leaves out the tokens read from or written to the prompt cache;
//! - completion tokens: `completion_tokens`, else `output_tokens` (0 for embeddings).
//!
//! # How, in bounded memory
//! A streamed body (`text/event-stream`) goes through an SSE framer: only the payload of `data:`
//! lines (one optional space after the colon removed; lines end at CR, LF or CRLF) reaches the
//! JSON scanner, the data lines of one event are joined with a newline, and a blank line ends the
//! event and resets the scanner, so a malformed event cannot spoil the next. Any other body is
//! scanned as one JSON text.
//!
//! The JSON scanner keeps a few bytes of state (inside a string or not, after a backslash or not,
//! how much of `usage` the current string has matched). A `"usage"` key followed by `{` starts a
//! capture of that object, which is then parsed; the capture is the only buffer, at most
//! [`MAX_USAGE_OBJECT_BYTES`]. A larger object is not parsed. Nothing else is kept: chunks can
//! split the body anywhere (inside the `data:` prefix, a key, a number, a UTF-8 character) and
//! the result is the same, because every byte of a multi-byte UTF-8 character is above 0x7F and
//! the scanner only acts on ASCII bytes.
//!
//! # Outcome
//! [`Outcome::Counted`] when a usage object gave the prompt or completion tokens (even if another
//! was unusable); otherwise `too_large` (a usage object over the cap), `malformed` (a usage object
//! that was not valid JSON with non-negative integer counts, or was cut off), `missing` (none
//! seen: a stream without `include_usage`, a body without `usage`), or `encoded` (the body is
//! compressed, `content-encoding` other than `identity`, and is not read).

use serde::Deserialize;

use crate::request::body::ApiKind;

/// Largest `usage` object parsed, in bytes; a larger one is not counted (`too_large`). OpenAI's,
/// with its token details, and Anthropic's, with its cache fields, are a few hundred bytes.
pub const MAX_USAGE_OBJECT_BYTES: usize = 2048;
/// The filter-state key (`wasm.` + this) of a response's prompt tokens, in decimal text.
pub const PROMPT_TOKENS_PROPERTY: &str = "inference_picker_prompt_tokens";
/// The filter-state key (`wasm.` + this) of a response's completion tokens, in decimal text.
pub const COMPLETION_TOKENS_PROPERTY: &str = "inference_picker_completion_tokens";

/// The tokens of one response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

/// What reading a response's usage came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Counted(Usage),
    Missing,
    TooLarge,
    Malformed,
    Encoded,
}

impl Outcome {
    /// The `outcome` label of `inference_picker_usage_responses_total`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Outcome::Counted(_) => "counted",
            Outcome::Missing => "missing",
            Outcome::TooLarge => "too_large",
            Outcome::Malformed => "malformed",
            Outcome::Encoded => "encoded",
        }
    }

    pub fn usage(&self) -> Option<Usage> {
        match self {
            Outcome::Counted(u) => Some(*u),
            _ => None,
        }
    }
}

/// One `usage` object; unknown fields (token details, service tier) are skipped.
#[derive(Deserialize)]
struct UsageObject {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
}

/// The last value seen of each field.
#[derive(Debug, Default, Clone, Copy)]
struct Fields {
    prompt: Option<u64>,
    completion: Option<u64>,
    input: Option<u64>,
    output: Option<u64>,
    cache_creation: Option<u64>,
    cache_read: Option<u64>,
}

impl Fields {
    fn merge(&mut self, u: UsageObject) {
        let set = |slot: &mut Option<u64>, v: Option<u64>| {
            if v.is_some() {
                *slot = v;
            }
        };
        set(&mut self.prompt, u.prompt_tokens);
        set(&mut self.completion, u.completion_tokens);
        set(&mut self.input, u.input_tokens);
        set(&mut self.output, u.output_tokens);
        set(&mut self.cache_creation, u.cache_creation_input_tokens);
        set(&mut self.cache_read, u.cache_read_input_tokens);
    }

    fn usage(&self, anthropic: bool) -> Option<Usage> {
        let prompt = if anthropic {
            self.input.map(|i| {
                i.saturating_add(self.cache_creation.unwrap_or(0))
                    .saturating_add(self.cache_read.unwrap_or(0))
            })
        } else {
            self.prompt.or(self.input)
        };
        let completion = self.completion.or(self.output);
        if prompt.is_none() && completion.is_none() {
            return None;
        }
        Some(Usage { prompt_tokens: prompt.unwrap_or(0), completion_tokens: completion.unwrap_or(0) })
    }
}

const KEY: &[u8] = b"usage";

/// Where the JSON scanner is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Outside a capture; `key` is how much of `usage` the open string has matched (`None`: it
    /// does not match).
    Scan { in_string: bool, escape: bool, key: Option<usize> },
    /// A string `"usage"` just closed: a `:` makes it a key.
    AfterKey,
    /// After `"usage":`: a `{` starts the capture.
    BeforeValue,
    /// Inside the usage object: brace depth, and string state.
    Capture { depth: u32, in_string: bool, escape: bool },
}

const SCAN: Phase = Phase::Scan { in_string: false, escape: false, key: None };

/// The JSON scanner: finds `"usage": {...}` and parses what it captures.
#[derive(Debug)]
struct Json {
    phase: Phase,
    capture: Vec<u8>,
    overflow: bool,
    fields: Fields,
    seen: bool,
    too_large: bool,
    malformed: bool,
}

fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

impl Json {
    fn new() -> Self {
        Json {
            phase: SCAN,
            capture: Vec::new(),
            overflow: false,
            fields: Fields::default(),
            seen: false,
            too_large: false,
            malformed: false,
        }
    }

    fn feed(&mut self, mut bytes: &[u8]) {
        while let Some((&b, rest)) = bytes.split_first() {
            match self.phase {
                // Fast paths: outside strings only a quote matters; inside a string that cannot
                // be the key, only a quote or a backslash.
                Phase::Scan { in_string: false, .. } => {
                    let at = bytes.iter().position(|&c| c == b'"').unwrap_or(bytes.len());
                    bytes = bytes.get(at..).unwrap_or_default();
                    if let Some(rest) = bytes.strip_prefix(b"\"") {
                        self.phase = Phase::Scan { in_string: true, escape: false, key: Some(0) };
                        bytes = rest;
                    }
                    continue;
                }
                Phase::Scan { in_string: true, escape: false, key: None } => {
                    let at = bytes.iter().position(|&c| c == b'"' || c == b'\\').unwrap_or(bytes.len());
                    bytes = bytes.get(at..).unwrap_or_default();
                    match bytes.split_first() {
                        Some((b'"', rest)) => {
                            self.phase = SCAN;
                            bytes = rest;
                        }
                        Some((_, rest)) => {
                            self.phase = Phase::Scan { in_string: true, escape: true, key: None };
                            bytes = rest;
                        }
                        None => {}
                    }
                    continue;
                }
                Phase::Scan { in_string: true, escape: true, .. } => {
                    self.phase = Phase::Scan { in_string: true, escape: false, key: None };
                }
                Phase::Scan { in_string: true, escape: false, key: Some(k) } => {
                    self.phase = match b {
                        b'"' if k == KEY.len() => Phase::AfterKey,
                        b'"' => SCAN,
                        b'\\' => Phase::Scan { in_string: true, escape: true, key: None },
                        _ => {
                            let next = (KEY.get(k) == Some(&b)).then_some(k + 1);
                            Phase::Scan { in_string: true, escape: false, key: next }
                        }
                    };
                }
                Phase::AfterKey | Phase::BeforeValue if is_space(b) => {}
                Phase::AfterKey if b == b':' => self.phase = Phase::BeforeValue,
                Phase::BeforeValue if b == b'{' => {
                    self.capture.clear();
                    self.overflow = false;
                    self.push(b);
                    self.phase = Phase::Capture { depth: 1, in_string: false, escape: false };
                }
                // Not a key, or a value that is no object (`null`): scan this byte afresh.
                Phase::AfterKey | Phase::BeforeValue => {
                    self.phase = SCAN;
                    continue;
                }
                Phase::Capture { depth, in_string, escape } => {
                    self.push(b);
                    self.phase = match (in_string, escape, b) {
                        (true, true, _) => Phase::Capture { depth, in_string: true, escape: false },
                        (true, false, b'\\') => Phase::Capture { depth, in_string: true, escape: true },
                        (true, false, b'"') => Phase::Capture { depth, in_string: false, escape: false },
                        (true, false, _) => self.phase,
                        (false, _, b'"') => Phase::Capture { depth, in_string: true, escape: false },
                        (false, _, b'{') => {
                            Phase::Capture { depth: depth.saturating_add(1), in_string, escape }
                        }
                        (false, _, b'}') if depth <= 1 => {
                            self.captured();
                            SCAN
                        }
                        (false, _, b'}') => Phase::Capture { depth: depth - 1, in_string, escape },
                        (false, _, _) => self.phase,
                    };
                }
            }
            bytes = rest;
        }
    }

    fn push(&mut self, b: u8) {
        if self.capture.len() < MAX_USAGE_OBJECT_BYTES {
            self.capture.push(b);
        } else {
            self.overflow = true;
        }
    }

    /// The usage object is complete: parse it, unless it was too large.
    fn captured(&mut self) {
        if self.overflow {
            self.too_large = true;
        } else {
            match serde_json::from_slice::<UsageObject>(&self.capture) {
                Ok(u) => {
                    self.fields.merge(u);
                    self.seen = true;
                }
                Err(_) => self.malformed = true,
            }
        }
        self.capture.clear();
        self.overflow = false;
    }

    /// The text ended (an SSE event, or the body): a usage object still open was cut off.
    fn end(&mut self) {
        if matches!(self.phase, Phase::Capture { .. }) {
            if self.overflow {
                self.too_large = true;
            } else {
                self.malformed = true;
            }
            self.capture.clear();
            self.overflow = false;
        }
        self.phase = SCAN;
    }
}

/// Where the SSE framer is in the current line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// At the start of a line, `n` bytes of `data:` matched.
    Start(usize),
    /// In a `data:` line's value; `first`: the optional space may come next.
    Data { first: bool },
    /// In any other line (`event:`, `id:`, a comment), or a field named otherwise.
    Other,
}

const DATA: &[u8] = b"data:";

/// Reads one response's usage, chunk by chunk.
#[derive(Debug)]
pub struct UsageScan {
    sse: bool,
    anthropic: bool,
    encoded: bool,
    line: Line,
    /// The last byte was a CR (a LF right after it ends no second line).
    after_cr: bool,
    /// The current event had a data line (a blank line then ends it).
    event_data: bool,
    json: Json,
}

impl UsageScan {
    /// A scan of a 2xx response to `path` with the given `content-type` and `content-encoding`.
    /// `None` for any other status: an error carries no usage.
    pub fn start(
        status: Option<&str>,
        content_type: Option<&str>,
        content_encoding: Option<&str>,
        path: &str,
    ) -> Option<UsageScan> {
        let ok = status.and_then(|s| s.trim().parse::<u16>().ok()).is_some_and(|s| (200..300).contains(&s));
        if !ok {
            return None;
        }
        let sse = content_type.is_some_and(|c| c.to_ascii_lowercase().contains("text/event-stream"));
        let encoded = content_encoding.is_some_and(|e| {
            let e = e.trim();
            !e.is_empty() && !e.eq_ignore_ascii_case("identity")
        });
        Some(UsageScan {
            sse,
            anthropic: ApiKind::from_path(path) == ApiKind::Messages,
            encoded,
            line: Line::Start(0),
            after_cr: false,
            event_data: false,
            json: Json::new(),
        })
    }

    /// Reads the next chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.encoded {
            return;
        }
        if !self.sse {
            self.json.feed(chunk);
            return;
        }
        let mut bytes = chunk;
        while let Some((&b, rest)) = bytes.split_first() {
            if b == b'\n' && self.after_cr {
                self.after_cr = false;
                bytes = rest;
                continue;
            }
            self.after_cr = b == b'\r';
            if b == b'\n' || b == b'\r' {
                self.line_end();
                bytes = rest;
                continue;
            }
            match self.line {
                Line::Start(n) => {
                    self.line = match DATA.get(n) {
                        Some(&d) if d == b && n + 1 == DATA.len() => Line::Data { first: true },
                        Some(&d) if d == b => Line::Start(n + 1),
                        _ => Line::Other,
                    };
                    bytes = rest;
                }
                Line::Data { first: true } if b == b' ' => {
                    self.line = Line::Data { first: false };
                    bytes = rest;
                }
                Line::Data { .. } | Line::Other => {
                    let at = bytes.iter().position(|&c| c == b'\n' || c == b'\r').unwrap_or(bytes.len());
                    let (value, more) =
                        (bytes.get(..at).unwrap_or_default(), bytes.get(at..).unwrap_or_default());
                    if let Line::Data { .. } = self.line {
                        self.json.feed(value);
                        self.line = Line::Data { first: false };
                    }
                    bytes = more;
                }
            }
        }
    }

    fn line_end(&mut self) {
        match self.line {
            // A blank line ends the event.
            Line::Start(0) => {
                if self.event_data {
                    self.json.end();
                    self.event_data = false;
                }
            }
            // Data lines of one event are joined with a newline.
            Line::Data { .. } => {
                self.json.feed(b"\n");
                self.event_data = true;
            }
            Line::Start(_) | Line::Other => {}
        }
        self.line = Line::Start(0);
    }

    /// The body has ended: what it reported.
    pub fn finish(mut self) -> Outcome {
        if self.encoded {
            return Outcome::Encoded;
        }
        // A last event without its blank line still counts.
        self.json.end();
        let j = &self.json;
        match j.fields.usage(self.anthropic) {
            Some(u) if j.seen => Outcome::Counted(u),
            _ if j.too_large => Outcome::TooLarge,
            _ if j.malformed => Outcome::Malformed,
            _ => Outcome::Missing,
        }
    }
}

#[cfg(test)]
#[path = "usage_tests.rs"]
mod tests;
