//! Turns a serde_json error into a [`ConfigError`] whose path names the field serde was reading.
//!
//! serde_json reports only a line and column. Rather than track the path while deserializing
//! (which needs a wrapping deserializer), this re-scans the document up to that position with a
//! tiny JSON tokenizer that keeps a stack of "key in object" / "index in array" frames. serde
//! reports an error right after the token it could not accept, so the frames open at that point
//! name the field:
//! - unknown field: the key was just read, so the path ends with the unknown key
//!   (`poller.intervalms`);
//! - wrong type or unknown enum variant: the value was just read, and the key it belongs to is still
//!   current (`filter.failure_mode`, `models[0].adapters[1]`);
//! - missing field: reported after the object's `}`, whose frame is then closed, so the path is the
//!   object itself (`endpoints[0]`);
//! - syntax error: reported after the offending byte, which is therefore not scanned.
//!
//! Runs only on the error path, once per bad configuration; it allocates freely.

use super::ConfigError;

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
    /// `{` or `,`.
    Object(Option<String>),
    /// Inside an array: the index of the element being read.
    Array(usize),
}

/// The JSON path (`endpoints[2].address`) of the value being read at byte `end`; empty at the root.
fn path_at(src: &[u8], end: usize) -> String {
    let mut stack: Vec<Frame> = Vec::new();
    let mut bytes = src.iter().take(end).enumerate();
    while let Some((start, b)) = bytes.next() {
        match b {
            b'{' => stack.push(Frame::Object(None)),
            b'[' => stack.push(Frame::Array(0)),
            b'}' | b']' => {
                stack.pop();
            }
            b',' => match stack.last_mut() {
                Some(Frame::Object(key)) => *key = None,
                Some(Frame::Array(i)) => *i += 1,
                None => {}
            },
            b'"' => {
                // Read to the closing quote, skipping escaped characters.
                let mut close = None;
                while let Some((i, c)) = bytes.next() {
                    match c {
                        b'\\' => {
                            bytes.next();
                        }
                        b'"' => {
                            close = Some(i);
                            break;
                        }
                        _ => {}
                    }
                }
                // A string in key position (an object with no current key) is the key; an unclosed
                // one is the key serde stopped in.
                if let Some(Frame::Object(key @ None)) = stack.last_mut() {
                    *key = Some(key_text(src, start, close, end));
                }
            }
            // Whitespace, ':', numbers and literals do not change the path.
            _ => {}
        }
    }
    render(&stack)
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
            Frame::Object(Some(key)) => {
                let plain = !key.is_empty()
                    && key.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-');
                if plain {
                    if !out.is_empty() {
                        out.push('.');
                    }
                    out.push_str(key);
                } else {
                    out.push_str(&format!("[{key:?}]"));
                }
            }
            // An object with no current key: serde stopped between members, so the path is the
            // object itself and nothing deeper can be open.
            Frame::Object(None) => break,
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
