//! Positions in the configuration document, for its errors.
//!
//! serde_json reports a syntax error with only a line and column; the reader (`read.rs`) reports
//! a path but no position. Both are completed here by re-scanning the document with a tiny JSON
//! tokenizer that keeps a stack of "key in object" / "index in array" frames:
//! - [`serde_error`]: the path of the value being read where serde_json stopped. serde_json
//!   reports a syntax error just after the offending byte, which is therefore not scanned
//!   (`endpoints[0]` for `"endpoints": [,]`, `models[0].name` for a document cut there).
//! - [`with_position`]: the line and column of a reader error's path.
//! - [`duplicate_key`]: a key written twice in one object, which `serde_json::Value` would
//!   otherwise keep silently (the last one).
//!
//! Runs once per configuration; it allocates freely.

use crate::base::json::ConfigError;

/// The [`ConfigError`] for a document serde could not read. The reason is serde's message, which
/// already carries the line and column and, for an unknown field, the names it expected.
pub(super) fn serde_error(src: &[u8], err: &serde_json::Error) -> ConfigError {
    let mut end = byte_offset(src, err.line(), err.column());
    // A syntax error is reported just after the byte that broke the grammar (the `,` in `[,]`);
    // that byte must not move the path on (to the next array index, or out of an object).
    if err.classify() == serde_json::error::Category::Syntax {
        end = end.saturating_sub(1);
    }
    let path = path_at(src, end);
    ConfigError::new(if path.is_empty() { "$".to_string() } else { path }, err.to_string())
}

/// serde_json's position as a byte offset: `line` is 1-based and `column` counts the bytes
/// consumed on that line, so the offset is the start of the line plus `column`.
fn byte_offset(src: &[u8], line: usize, column: usize) -> usize {
    if line <= 1 {
        return column.min(src.len());
    }
    let mut seen = 1;
    for (i, b) in src.iter().enumerate() {
        if *b == b'\n' {
            seen += 1;
            if seen == line {
                return (i + 1 + column).min(src.len());
            }
        }
    }
    src.len()
}

enum Frame {
    /// Inside an object: the key whose value is being read, if one has been read since the last
    /// `{` or `,`, and the keys read before it (for [`duplicate_key`]).
    Object(Option<String>, Vec<String>),
    /// Inside an array: the index of the element being read.
    Array(usize),
}

/// What one step of a [`Walk`] read.
enum Step {
    /// An object key (its opening quote at this offset); the path now ends with it.
    Key(usize),
    /// The start of an array element (the `[` or `,` before it at this offset).
    Element(usize),
    /// Anything else.
    Other,
}

/// A tiny JSON tokenizer over `src[..end]` that keeps the stack of frames naming the value being
/// read. It does not check the grammar: it is run on documents serde_json has parsed, or up to the
/// place where serde_json stopped.
struct Walk<'a> {
    src: &'a [u8],
    end: usize,
    at: usize,
    stack: Vec<Frame>,
}

impl<'a> Walk<'a> {
    fn new(src: &'a [u8], end: usize) -> Self {
        Self { src, end: end.min(src.len()), at: 0, stack: Vec::new() }
    }

    /// Reads one byte (a whole string for `"`); `None` at the end.
    fn step(&mut self) -> Option<Step> {
        let start = self.at;
        let b = *self.src.get(start).filter(|_| start < self.end)?;
        self.at += 1;
        Some(match b {
            b'{' => {
                self.stack.push(Frame::Object(None, Vec::new()));
                Step::Other
            }
            b'[' => {
                self.stack.push(Frame::Array(0));
                Step::Element(start)
            }
            b'}' | b']' => {
                self.stack.pop();
                Step::Other
            }
            b',' => match self.stack.last_mut() {
                Some(Frame::Object(key, seen)) => {
                    seen.extend(key.take());
                    Step::Other
                }
                Some(Frame::Array(i)) => {
                    *i += 1;
                    Step::Element(start)
                }
                None => Step::Other,
            },
            b'"' => {
                // Read to the closing quote, skipping escaped characters.
                let mut close = None;
                while self.at < self.end {
                    let i = self.at;
                    self.at += 1;
                    match self.src.get(i) {
                        Some(b'\\') => self.at += 1,
                        Some(b'"') => {
                            close = Some(i);
                            break;
                        }
                        _ => {}
                    }
                }
                // A string in key position (an object with no current key) is the key; an unclosed
                // one is the key serde stopped in.
                match self.stack.last_mut() {
                    Some(Frame::Object(key @ None, _)) => {
                        *key = Some(key_text(self.src, start, close, self.end));
                        Step::Key(start)
                    }
                    _ => Step::Other,
                }
            }
            // Whitespace, ':', numbers and literals do not change the path.
            _ => Step::Other,
        })
    }

    fn path(&self) -> String {
        render(&self.stack)
    }
}

/// The JSON path (`endpoints[2].address`) of the value being read at byte `end`; empty at the root.
fn path_at(src: &[u8], end: usize) -> String {
    let mut walk = Walk::new(src, end);
    while walk.step().is_some() {}
    walk.path()
}

/// The byte offset where the value at `path` (as [`render`] writes it; `$` or empty for the root)
/// starts: its key's opening quote, or its first byte in an array.
fn offset_of(src: &[u8], path: &str) -> Option<usize> {
    if path.is_empty() || path == "$" {
        return src.iter().position(|b| !b.is_ascii_whitespace());
    }
    let mut walk = Walk::new(src, src.len());
    while let Some(step) = walk.step() {
        let at = match step {
            Step::Key(at) => at,
            Step::Element(at) => {
                at + 1 + src.iter().skip(at + 1).take_while(|b| b.is_ascii_whitespace()).count()
            }
            Step::Other => continue,
        };
        if walk.path() == path {
            return Some(at);
        }
    }
    None
}

/// `e` with the line and column of its path in `src` added to the reason, as serde_json words
/// them (`... at line 5 column 39`), when the path is found.
pub(super) fn with_position(src: &[u8], mut e: ConfigError) -> ConfigError {
    if let Some(at) = offset_of(src, &e.path) {
        let before = src.get(..at).unwrap_or_default();
        let line = 1 + before.iter().filter(|b| **b == b'\n').count();
        let column = at - before.iter().rposition(|b| *b == b'\n').map_or(0, |nl| nl + 1) + 1;
        e.reason.push_str(&format!(" at line {line} column {column}"));
    }
    e
}

/// The first key that appears twice in one object (`serde_json::Value` would keep the last of
/// them silently), as serde's derive reported it: `duplicate field `models``, at that key's path.
pub(super) fn duplicate_key(src: &[u8]) -> Option<ConfigError> {
    let mut walk = Walk::new(src, src.len());
    while let Some(step) = walk.step() {
        if let (Step::Key(_), Some(Frame::Object(Some(key), seen))) = (step, walk.stack.last()) {
            if seen.contains(key) {
                let reason = format!("duplicate field `{key}`");
                return Some(with_position(src, ConfigError::new(walk.path(), reason)));
            }
        }
    }
    None
}

/// The decoded text of the key whose opening quote is at `start`; the raw bytes when it is not a
/// complete, valid JSON string.
fn key_text(src: &[u8], start: usize, close: Option<usize>, end: usize) -> String {
    if let Some(quoted) = close.and_then(|c| src.get(start..=c)) {
        if let Ok(text) = serde_json::from_slice::<String>(quoted) {
            return text;
        }
    }
    let raw = src.get(start + 1..close.unwrap_or(end)).unwrap_or_default();
    String::from_utf8_lossy(raw).into_owned()
}

fn render(stack: &[Frame]) -> String {
    let mut out = String::new();
    for frame in stack {
        match frame {
            Frame::Object(Some(key), _) => crate::base::json::push_key(&mut out, key),
            // An object with no current key: serde stopped between members, so the path is the
            // object itself and nothing deeper can be open.
            Frame::Object(None, _) => break,
            Frame::Array(i) => out.push_str(&format!("[{i}]")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(doc: &str, marker: &str) -> String {
        // The path just after the first occurrence of `marker`.
        let end = doc.find(marker).unwrap() + marker.len();
        path_at(doc.as_bytes(), end)
    }

    #[test]
    fn paths_through_objects_and_arrays() {
        let doc = r#"{"a": {"b": [10, {"c": 1}]}, "d": "x,y"}"#;
        assert_eq!(at(doc, r#"{"a""#), "a");
        assert_eq!(at(doc, "[10"), "a.b[0]");
        assert_eq!(at(doc, r#"{"c""#), "a.b[1].c");
        // After the inner `}` the element is still a.b[1]; after `]` the value of "b" is complete.
        assert_eq!(at(doc, "1}"), "a.b[1]");
        assert_eq!(at(doc, "]"), "a.b");
        // After the comma that ends "a", no key is current: the root.
        assert_eq!(at(doc, "]},"), "");
        // Commas and brackets inside strings are text, not structure.
        assert_eq!(at(doc, r#""x,y""#), "d");
    }

    #[test]
    fn escaped_quotes_and_odd_keys() {
        let doc = r#"{"k\"ey": {"with space": 1}}"#;
        assert_eq!(at(doc, r#""with space""#), r#"["k\"ey"]["with space"]"#);
    }

    #[test]
    fn offsets_follow_serde_lines_and_columns() {
        // The newline is byte 1, so line 2 starts at byte 2.
        let src = b"{\n  \"a\": 1}";
        assert_eq!(byte_offset(src, 1, 1), 1);
        assert_eq!(byte_offset(src, 2, 0), 2);
        assert_eq!(byte_offset(src, 2, 5), 7);
        // Past the end is clamped.
        assert_eq!(byte_offset(src, 9, 9), src.len());
    }
}
