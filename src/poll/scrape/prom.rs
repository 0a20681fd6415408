//! A small, allocation-light parser for the Prometheus text exposition format (0.0.4), as model
//! servers serve it on `/metrics`.
//!
//! # What it yields
//! [`Samples`] walks the text line by line and yields one [`Sample`] per sample line: the metric
//! name, the label set, the value and the optional timestamp. Nothing is copied: the name and the
//! label set borrow the input. [`Labels`] keeps the raw, already validated `{...}` text and decodes
//! a label only when asked ([`Labels::get`], [`Labels::iter`]); a value is copied only when it
//! contains an escape. So a caller that wants three metric names out of three thousand lines builds
//! no map and allocates nothing for the lines it ignores. [`Samples::with_filter`] goes further: a
//! line whose name the filter rejects is not parsed past its name.
//!
//! # Grammar accepted
//! ```text
//! line    = blank* ( comment | sample )? blank* ["\r"]        (lines split on "\n")
//! comment = "#" anything                                      (HELP, TYPE, EOF, any other)
//! sample  = name blank* [ "{" labels "}" ] blank* value [ blank+ timestamp ] [ blank+ "#" exemplar ]
//! name    = [a-zA-Z_:][a-zA-Z0-9_:]*
//! labels  = blank* [ pair ( blank* "," blank* pair )* ] blank* [ "," ] blank*
//! pair    = lname blank* "=" blank* '"' ( escape | any char but '"' and '\' )* '"'
//! lname   = [a-zA-Z_][a-zA-Z0-9_]*
//! escape  = '\\' | '\"' | '\n'        (any other '\x' is kept as the two characters '\x')
//! value   = a float as Rust reads it: 1, -1.5, 1.7537953269352946e+09, NaN, +Inf, -Inf, Inf
//! timestamp = an i64 (milliseconds since the epoch)
//! ```
//! - Labels may come in any order; a label value may hold `}`, `,`, `=`, `#` or spaces.
//! - `_total`, `_created`, `_bucket`, `_sum` and `_count` series are ordinary samples with their
//!   full names; nothing is merged into families, because the routing signals are plain gauges.
//! - The trailing ` # {...} v` exemplar of OpenMetrics is ignored, so an OpenMetrics body parses too
//!   (its `# EOF` is a comment). Quoted UTF-8 metric names (`{"a.b"}`) are not supported: no model
//!   server emits them, and such lines are skipped like any other garbled line.
//!
//! # Errors
//! A line that does not fit the grammar is skipped and counted ([`Samples::skipped`],
//! [`Samples::first_error`]); the lines around it still parse. Nothing here panics, recurses, or
//! allocates per line, so a truncated, garbled or huge body costs one linear pass and no more.
//! Duplicate label names are not rejected; [`Labels::get`] returns the first.

use std::borrow::Cow;

/// One sample line: `name{labels} value [timestamp]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample<'a> {
    /// The full series name, suffix included (`vllm:prompt_tokens_total`, `..._bucket`).
    pub name: &'a str,
    pub labels: Labels<'a>,
    /// As written; may be NaN or ±Inf. Callers decide what a non-finite value means.
    pub value: f64,
    /// Milliseconds since the epoch, when the line carries one.
    pub timestamp: Option<i64>,
}

/// Why a line was skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineError {
    /// The metric name is empty or has a character outside `[a-zA-Z0-9_:]`.
    BadName,
    /// The label set is malformed: bad label name, missing `=` or quote, unterminated value or set.
    BadLabels,
    /// Nothing after the name and labels.
    MissingValue,
    /// The value is not a float.
    BadValue,
    /// The token after the value is neither an i64 timestamp nor an exemplar (`# ...`).
    BadTimestamp,
    /// Something follows the timestamp.
    TrailingGarbage,
}

/// The label set of one sample: the validated text between `{` and `}` (empty when the line has
/// no labels), decoded on demand.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Labels<'a> {
    raw: &'a str,
}

impl<'a> Labels<'a> {
    /// The value of label `name` (escapes decoded), or `None` when the sample has no such label.
    pub fn get(&self, name: &str) -> Option<Cow<'a, str>> {
        self.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    /// The labels in the order written.
    pub fn iter(&self) -> LabelIter<'a> {
        LabelIter { cur: Cursor::new(self.raw), done: false }
    }

    /// Number of labels.
    pub fn len(&self) -> usize {
        self.iter().count()
    }

    pub fn is_empty(&self) -> bool {
        self.iter().next().is_none()
    }

    /// The label set exactly as written between the braces.
    pub fn as_raw(&self) -> &'a str {
        self.raw
    }

    /// Each label as `(name, raw value)`, escapes NOT decoded: for callers that only compare or
    /// hash values and so need no copy.
    pub fn iter_raw(&self) -> impl Iterator<Item = (&'a str, &'a str)> {
        let mut cur = Cursor::new(self.raw);
        std::iter::from_fn(move || match next_pair(&mut cur, false) {
            Ok(Some(p)) => Some((p.name, p.raw_value)),
            _ => None,
        })
    }
}

/// Iterator over `(label name, decoded value)`.
#[derive(Debug, Clone)]
pub struct LabelIter<'a> {
    cur: Cursor<'a>,
    done: bool,
}

impl<'a> Iterator for LabelIter<'a> {
    type Item = (&'a str, Cow<'a, str>);

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        match next_pair(&mut self.cur, false) {
            Ok(Some(p)) => {
                Some((p.name, if p.escaped { unescape(p.raw_value) } else { Cow::Borrowed(p.raw_value) }))
            }
            // The set was validated when the line was parsed, so an error cannot happen here; if it
            // did, ending the iteration is the safe answer.
            _ => {
                self.done = true;
                None
            }
        }
    }
}

fn accept_all(_: &str) -> bool {
    true
}

/// Iterator over the samples of a text exposition. Garbled lines are skipped and counted.
pub struct Samples<'a, F = fn(&str) -> bool> {
    rest: Option<&'a str>,
    filter: F,
    line_no: usize,
    skipped: usize,
    first_error: Option<(usize, LineError)>,
}

impl<'a> Samples<'a> {
    /// Every sample of `text`.
    pub fn new(text: &'a str) -> Self {
        Samples::with_filter(text, accept_all as fn(&str) -> bool)
    }
}

impl<'a, F: FnMut(&str) -> bool> Samples<'a, F> {
    /// Only the samples whose name `filter` accepts. A rejected line is not parsed past its name,
    /// so garbage later on that line is neither seen nor counted.
    pub fn with_filter(text: &'a str, filter: F) -> Self {
        Samples { rest: Some(text), filter, line_no: 0, skipped: 0, first_error: None }
    }

    /// Lines skipped as garbled so far.
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    /// The first garbled line so far: its 1-based number and what was wrong with it.
    pub fn first_error(&self) -> Option<(usize, LineError)> {
        self.first_error
    }
}

impl<'a, F: FnMut(&str) -> bool> Iterator for Samples<'a, F> {
    type Item = Sample<'a>;

    fn next(&mut self) -> Option<Sample<'a>> {
        loop {
            let rest = self.rest?;
            let (line, tail) = match rest.split_once('\n') {
                Some((line, tail)) => (line, Some(tail)),
                None => (rest, None),
            };
            self.rest = tail;
            self.line_no += 1;
            match parse_line_filtered(line, &mut self.filter) {
                Ok(Some(sample)) => return Some(sample),
                Ok(None) => {}
                Err(e) => {
                    self.skipped += 1;
                    if self.first_error.is_none() {
                        self.first_error = Some((self.line_no, e));
                    }
                }
            }
        }
    }
}

/// Parses one line (without its `\n`). `Ok(None)` for a blank line or a comment.
pub fn parse_line(line: &str) -> Result<Option<Sample<'_>>, LineError> {
    parse_line_filtered(line, &mut accept_all)
}

fn parse_line_filtered<'a, F: FnMut(&str) -> bool>(
    line: &'a str,
    filter: &mut F,
) -> Result<Option<Sample<'a>>, LineError> {
    let line = line.strip_suffix('\r').unwrap_or(line);
    let mut cur = Cursor::new(line);
    cur.skip_blanks();
    match cur.peek() {
        None | Some(b'#') => return Ok(None),
        Some(_) => {}
    }

    let name = cur.take_while(is_name_char);
    if !name.bytes().next().is_some_and(is_name_start) {
        return Err(LineError::BadName);
    }
    if !matches!(cur.peek(), None | Some(b' ' | b'\t' | b'{')) {
        return Err(LineError::BadName);
    }
    if !filter(name) {
        return Ok(None);
    }

    cur.skip_blanks();
    let labels = if cur.peek() == Some(b'{') {
        cur.bump();
        let start = cur.pos;
        let end = loop {
            // Taken before each step so that, once the closing brace is consumed, it still marks
            // where the set's text stops.
            let here = cur.pos;
            if next_pair(&mut cur, true)?.is_none() {
                break here;
            }
        };
        Labels { raw: cur.slice(start, end) }
    } else {
        Labels::default()
    };

    cur.skip_blanks();
    let value = cur.take_while(|c| !is_blank(c));
    if value.is_empty() {
        return Err(LineError::MissingValue);
    }
    let value: f64 = value.parse().map_err(|_| LineError::BadValue)?;

    cur.skip_blanks();
    let mut timestamp = None;
    if !matches!(cur.peek(), None | Some(b'#')) {
        let ts = cur.take_while(|c| !is_blank(c));
        timestamp = Some(ts.parse::<i64>().map_err(|_| LineError::BadTimestamp)?);
        cur.skip_blanks();
        if !matches!(cur.peek(), None | Some(b'#')) {
            return Err(LineError::TrailingGarbage);
        }
    }
    Ok(Some(Sample { name, labels, value, timestamp }))
}

/// One `name="value"` pair, as written.
struct Pair<'a> {
    name: &'a str,
    raw_value: &'a str,
    escaped: bool,
}

/// Reads the next pair of a label set and the separator after it; `Ok(None)` at the end of the
/// set. `in_line`: the cursor is on a whole line, so the set must end with `}` (which is
/// consumed); otherwise the cursor holds only the text between the braces and ends with it.
fn next_pair<'a>(cur: &mut Cursor<'a>, in_line: bool) -> Result<Option<Pair<'a>>, LineError> {
    cur.skip_blanks();
    match cur.peek() {
        Some(b'}') if in_line => {
            cur.bump();
            return Ok(None);
        }
        None if !in_line => return Ok(None),
        None => return Err(LineError::BadLabels),
        Some(_) => {}
    }
    let name = cur.take_while(|c| c.is_ascii_alphanumeric() || c == b'_');
    if !name.bytes().next().is_some_and(|c| c.is_ascii_alphabetic() || c == b'_') {
        return Err(LineError::BadLabels);
    }
    cur.skip_blanks();
    if cur.peek() != Some(b'=') {
        return Err(LineError::BadLabels);
    }
    cur.bump();
    cur.skip_blanks();
    if cur.peek() != Some(b'"') {
        return Err(LineError::BadLabels);
    }
    cur.bump();
    let start = cur.pos;
    let mut escaped = false;
    loop {
        match cur.peek() {
            None => return Err(LineError::BadLabels),
            Some(b'"') => break,
            Some(b'\\') => {
                escaped = true;
                cur.bump();
                // The escaped byte may be the first of a multi-byte character; its continuation
                // bytes are never `"` or `\`, so scanning on from the next byte is still correct.
                if cur.peek().is_none() {
                    return Err(LineError::BadLabels);
                }
                cur.bump();
            }
            Some(_) => cur.bump(),
        }
    }
    let raw_value = cur.slice(start, cur.pos);
    cur.bump(); // the closing quote
    cur.skip_blanks();
    match cur.peek() {
        Some(b',') => cur.bump(),
        Some(b'}') => {}
        None if !in_line => {}
        _ => return Err(LineError::BadLabels),
    }
    Ok(Some(Pair { name, raw_value, escaped }))
}

/// Decodes `\\`, `\"` and `\n`; any other backslash is kept as written.
fn unescape(raw: &str) -> Cow<'_, str> {
    if !raw.contains('\\') {
        return Cow::Borrowed(raw);
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('\\') => out.push('\\'),
            Some('"') => out.push('"'),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    Cow::Owned(out)
}

fn is_blank(c: u8) -> bool {
    c == b' ' || c == b'\t'
}

fn is_name_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || c == b'_' || c == b':'
}

fn is_name_char(c: u8) -> bool {
    is_name_start(c) || c.is_ascii_digit()
}

/// A byte cursor over a `&str`. Every position it stops at is next to an ASCII delimiter, so
/// slicing between two positions always falls on character boundaries.
#[derive(Debug, Clone)]
struct Cursor<'a> {
    s: &'a str,
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(s: &'a str) -> Self {
        Cursor { s, pos: 0 }
    }

    fn peek(&self) -> Option<u8> {
        self.s.as_bytes().get(self.pos).copied()
    }

    fn bump(&mut self) {
        self.pos += 1;
    }

    fn skip_blanks(&mut self) {
        while self.peek().is_some_and(is_blank) {
            self.pos += 1;
        }
    }

    fn take_while(&mut self, mut keep: impl FnMut(u8) -> bool) -> &'a str {
        let start = self.pos;
        while self.peek().is_some_and(&mut keep) {
            self.pos += 1;
        }
        self.slice(start, self.pos)
    }

    fn slice(&self, start: usize, end: usize) -> &'a str {
        // Never falls back in practice (see the type's doc); "" keeps this path panic-free.
        self.s.get(start..end).unwrap_or("")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn one(line: &str) -> Sample<'_> {
        match parse_line(line) {
            Ok(Some(s)) => s,
            other => panic!("{line:?} gave {other:?}"),
        }
    }

    fn labels_vec<'a>(s: &Sample<'a>) -> Vec<(&'a str, String)> {
        s.labels.iter().map(|(n, v)| (n, v.into_owned())).collect()
    }

    #[test]
    fn plain_sample_with_labels_and_timestamp() {
        let s = one(r#"vllm:num_requests_waiting{model_name="m",engine="0"} 3.0 1700000000123"#);
        assert_eq!(s.name, "vllm:num_requests_waiting");
        assert_eq!(labels_vec(&s), vec![("model_name", "m".to_string()), ("engine", "0".to_string())]);
        assert_eq!(s.value, 3.0);
        assert_eq!(s.timestamp, Some(1_700_000_000_123));
        assert_eq!(s.labels.len(), 2);
        assert_eq!(s.labels.as_raw(), r#"model_name="m",engine="0""#);
    }

    #[test]
    fn sample_without_labels() {
        let s = one("process_open_fds 45.0");
        assert_eq!(s.name, "process_open_fds");
        assert!(s.labels.is_empty());
        assert_eq!(s.labels.len(), 0);
        assert_eq!(s.value, 45.0);
        assert_eq!(s.timestamp, None);
        // Tabs separate tokens too; a negative timestamp is still an i64.
        let s = one("x\t-2.5\t-17");
        assert_eq!((s.value, s.timestamp), (-2.5, Some(-17)));
    }

    #[test]
    fn label_order_does_not_matter_for_get() {
        let a = one(r#"m{a="1",b="2",c="3"} 1"#);
        let b = one(r#"m{c="3",a="1",b="2"} 1"#);
        for name in ["a", "b", "c"] {
            assert_eq!(a.labels.get(name), b.labels.get(name));
        }
        assert_eq!(a.labels.get("b").as_deref(), Some("2"));
        assert_eq!(a.labels.get("d"), None);
    }

    #[test]
    fn escapes_are_decoded_and_only_then_copied() {
        // Raw text: x\\y\"z\nw  ->  x\y"z<newline>w
        let s = one(r#"m{a="x\\y\"z\nw",b="plain"} 1"#);
        let a = s.labels.get("a").unwrap();
        assert_eq!(a, "x\\y\"z\nw");
        assert!(matches!(a, Cow::Owned(_)));
        assert!(matches!(s.labels.get("b").unwrap(), Cow::Borrowed("plain")));
        // iter_raw leaves escapes alone.
        let raw: Vec<_> = s.labels.iter_raw().collect();
        assert_eq!(raw, vec![("a", r#"x\\y\"z\nw"#), ("b", "plain")]);
    }

    #[test]
    fn unknown_escape_is_kept_verbatim() {
        // `\t` is not a Prometheus escape: kept as backslash + 't'. An escaped `}` does not end the set.
        let s = one(r#"m{path="C:\temp\}x"} 1"#);
        assert_eq!(s.labels.get("path").unwrap(), r"C:\temp\}x");
    }

    #[test]
    fn label_values_may_hold_delimiters_and_spaces() {
        let s = one(r#"m{a="}",b=",",c="=",d="x y # z",e="{\"k\": 1}"} 7"#);
        assert_eq!(s.labels.get("a").unwrap(), "}");
        assert_eq!(s.labels.get("b").unwrap(), ",");
        assert_eq!(s.labels.get("c").unwrap(), "=");
        assert_eq!(s.labels.get("d").unwrap(), "x y # z");
        assert_eq!(s.labels.get("e").unwrap(), r#"{"k": 1}"#);
        assert_eq!(s.value, 7.0);
    }

    #[test]
    fn multibyte_label_values() {
        let s = one("m{a=\"模型\\\"é\",b=\"ok\"} 1");
        assert_eq!(s.labels.get("a").unwrap(), "模型\"é");
        assert_eq!(s.labels.get("b").unwrap(), "ok");
    }

    #[test]
    fn trailing_comma_empty_set_and_blanks_inside_braces() {
        let s = one(r#"m{a="1",} 2"#);
        assert_eq!(labels_vec(&s), vec![("a", "1".to_string())]);
        let s = one("m{} 3");
        assert!(s.labels.is_empty());
        assert_eq!(s.value, 3.0);
        let s = one("m { a = \"1\" ,\tb=\"2\" , } 4");
        assert_eq!(labels_vec(&s), vec![("a", "1".to_string()), ("b", "2".to_string())]);
        assert_eq!(s.value, 4.0);
        // No blank needed between `}` and the value.
        assert_eq!(one(r#"m{a="1"}5"#).value, 5.0);
    }

    #[test]
    fn special_and_exponent_values() {
        assert!(one("m NaN").value.is_nan());
        assert_eq!(one("m +Inf").value, f64::INFINITY);
        assert_eq!(one("m -Inf").value, f64::NEG_INFINITY);
        assert_eq!(one("m Inf").value, f64::INFINITY);
        assert_eq!(one("m 1.7537953269352946e+09").value, 1_753_795_326.935_294_6);
        assert_eq!(one("m 9.75010481363281e-06").value, 0.000_009_750_104_813_632_81);
        assert_eq!(one("m 8.128902e+06").value, 8_128_902.0);
        assert_eq!(one("m -0").value.to_bits(), (-0.0f64).to_bits());
        assert_eq!(one("m .5").value, 0.5);
    }

    #[test]
    fn comments_blank_lines_and_crlf() {
        for line in
            ["", "   ", "\t", "\r", "# HELP m help text", "# TYPE m gauge", "#", "# EOF", "  # indented"]
        {
            assert_eq!(parse_line(line), Ok(None), "{line:?}");
        }
        let text = "# HELP a A\r\n# TYPE a gauge\r\na{x=\"1\"} 1.5\r\n\r\nb 2\r\n";
        let got: Vec<_> = Samples::new(text).map(|s| (s.name, s.value, s.labels.get("x"))).collect();
        assert_eq!(got, vec![("a", 1.5, Some(Cow::Borrowed("1"))), ("b", 2.0, None)]);
        // Leading blanks before a sample are allowed.
        assert_eq!(one("   m 1").name, "m");
    }

    #[test]
    fn exemplars_are_ignored() {
        let s = one(r#"m_bucket{le="0.5"} 3 # {trace_id="abc"} 0.42 1700000000.1"#);
        assert_eq!((s.name, s.value, s.timestamp), ("m_bucket", 3.0, None));
        let s = one(r#"m_bucket{le="0.5"} 3 1700 # {trace_id="abc"} 0.42"#);
        assert_eq!((s.value, s.timestamp), (3.0, Some(1700)));
    }

    #[test]
    fn suffixed_series_keep_their_full_names() {
        let text = "\
x_total{engine=\"0\"} 5\n\
x_created{engine=\"0\"} 1.7537949952014163e+09\n\
h_bucket{le=\"+Inf\"} 9\n\
h_sum 4.5\n\
h_count 9\n";
        let names: Vec<_> = Samples::new(text).map(|s| s.name).collect();
        assert_eq!(names, vec!["x_total", "x_created", "h_bucket", "h_sum", "h_count"]);
    }

    #[test]
    fn garbled_lines_give_the_right_error() {
        let cases: &[(&str, LineError)] = &[
            (r#"{a="b"} 1"#, LineError::BadName),
            ("1abc 2", LineError::BadName),
            ("foo.bar 1", LineError::BadName),
            ("foo-bar 1", LineError::BadName),
            (r#"foo{a="b" 1"#, LineError::BadLabels),
            (r#"foo{a=b} 1"#, LineError::BadLabels),
            (r#"foo{1a="b"} 1"#, LineError::BadLabels),
            (r#"foo{a:b="c"} 1"#, LineError::BadLabels),
            (r#"foo{a="b"c="d"} 1"#, LineError::BadLabels),
            (r#"foo{a="unterminated} 1"#, LineError::BadLabels),
            (r#"foo{a="b\"#, LineError::BadLabels),
            (r#"foo{a}"#, LineError::BadLabels),
            (r#"foo{,} 1"#, LineError::BadLabels),
            ("foo{", LineError::BadLabels),
            ("foo", LineError::MissingValue),
            (r#"foo{a="b"}"#, LineError::MissingValue),
            ("foo   \r", LineError::MissingValue),
            ("foo abc", LineError::BadValue),
            ("foo 1,5", LineError::BadValue),
            ("foo 0x10", LineError::BadValue),
            ("foo 1 abc", LineError::BadTimestamp),
            ("foo 1 1.5", LineError::BadTimestamp),
            ("foo 1 2 3", LineError::TrailingGarbage),
        ];
        for (line, want) in cases {
            assert_eq!(parse_line(line), Err(*want), "{line:?}");
        }
    }

    #[test]
    fn garbled_lines_are_counted_and_the_rest_still_parses() {
        let text = "a 1\nthis is not a metric\nb{x=\"1\" 2\nc 3\n\u{0}\u{ff}garbage\nd 4";
        let mut it = Samples::new(text);
        let names: Vec<_> = it.by_ref().map(|s| s.name).collect();
        // Lines 2 ("is" is no value), 3 and 5 are garbled; "d 4" has no final newline and still counts.
        assert_eq!(names, vec!["a", "c", "d"]);
        assert_eq!(it.skipped(), 3);
        assert_eq!(it.first_error(), Some((2, LineError::BadValue)));
    }

    #[test]
    fn filter_skips_rejected_lines_without_parsing_them() {
        let text = "keep 1\ndrop{garbage 2\nkeep{a=\"b\"} 3\n";
        let mut it = Samples::with_filter(text, |n: &str| n == "keep");
        let values: Vec<_> = it.by_ref().map(|s| s.value).collect();
        assert_eq!(values, vec![1.0, 3.0]);
        // The garbled `drop` line was rejected by name, so it was never seen as garbled.
        assert_eq!(it.skipped(), 0);
        // A garbled name is still counted: the filter cannot be asked about it.
        let mut it = Samples::with_filter("1bad 1\nkeep 2\n", |n: &str| n == "keep");
        assert_eq!(it.by_ref().count(), 1);
        assert_eq!(it.skipped(), 1);
    }

    const VLLM: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/metrics/vllm_v1_0.33_dp2_lora_constructed.prom"
    ));
    const SGLANG: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/metrics/sglang_docs_production_metrics_llama31_8b.prom"
    ));

    #[test]
    fn real_and_constructed_fixtures_parse_without_skips() {
        for (text, want_samples) in [(VLLM, 199), (SGLANG, 91)] {
            let mut it = Samples::new(text);
            let n = it.by_ref().count();
            assert_eq!(it.skipped(), 0, "{:?}", it.first_error());
            // Counted with: grep -vc -e '^#' -e '^$' FILE
            assert_eq!(n, want_samples);
        }
    }

    #[test]
    fn cache_config_label_with_escaped_json() {
        let s = Samples::new(VLLM).find(|s| s.name == "vllm:cache_config_info").unwrap();
        assert_eq!(s.labels.get("kv_connector_extra_config").unwrap(), r#"{"mode": "a=b, c}"}"#);
        assert_eq!(s.labels.get("num_gpu_blocks").unwrap(), "27648");
        assert_eq!(s.labels.get("block_size").unwrap(), "16");
        assert_eq!(s.labels.len(), 21);
    }

    /// A prefix of a body that ends on a line boundary yields exactly the full body's first
    /// samples; any other prefix never panics and never yields more samples than the full body.
    /// (A cut inside the last number can still leave a valid, smaller number: only the HTTP framing
    /// can tell a truncated body, so the poller must check it.)
    #[test]
    fn truncated_input() {
        fn check(text: &str, cuts: impl Iterator<Item = usize>) {
            let full: Vec<_> = Samples::new(text).map(|s| (s.name, s.labels, s.value.to_bits())).collect();
            for cut in cuts {
                let prefix = &text[..cut];
                let part: Vec<_> =
                    Samples::new(prefix).map(|s| (s.name, s.labels, s.value.to_bits())).collect();
                assert!(part.len() <= full.len());
                let complete = prefix.rfind('\n').map_or("", |p| &prefix[..=p]);
                let k = Samples::new(complete).count();
                assert_eq!(&part[..k], &full[..k], "cut at {cut}");
            }
        }
        // Every cut in the last ~3 kB (cache_config_info with its escaped JSON label, the LoRA
        // series), and every 101st byte of the whole file. The fixture is ASCII, so every byte
        // offset is a character boundary.
        assert!(VLLM.is_ascii());
        let start = VLLM[VLLM.len() - 3000..].find('\n').map_or(0, |p| VLLM.len() - 3000 + p + 1);
        let tail = &VLLM[start..];
        check(tail, 0..=tail.len());
        check(VLLM, (0..VLLM.len()).step_by(101));
    }

    #[test]
    fn huge_inputs() {
        // 200k lines (~10 MB) in one linear pass.
        let mut text = String::new();
        for i in 0..200_000u32 {
            text.push_str(&format!(
                "vllm:x_bucket{{engine=\"{}\",le=\"{i}\",model_name=\"m\"}} {i}.0\n",
                i % 4
            ));
        }
        let mut sum = 0.0;
        let mut it = Samples::new(&text);
        for s in it.by_ref() {
            sum += s.value;
        }
        assert_eq!(it.skipped(), 0);
        // 0 + 1 + ... + 199_999 = 199_999 * 200_000 / 2
        assert_eq!(sum, 19_999_900_000.0);

        // One 4 MB label value, and one 4 MB line with no newline and no closing quote.
        let big = "y".repeat(4 << 20);
        let line = format!("m{{a=\"{big}\"}} 1");
        assert_eq!(one(&line).labels.get("a").unwrap().len(), 4 << 20);
        let line = format!("m{{a=\"{big}");
        assert_eq!(parse_line(&line), Err(LineError::BadLabels));
    }

    // ---- property tests ----

    /// Characters that make up expositions, so that random strings hit the parser's branches.
    const PROM_CHARS: &str = "[a-z_:{}=\",\\\\ \t\r\n#0-9.eE+\\-NaIf]{0,160}";

    fn render_value(v: f64, exp: bool) -> String {
        if v.is_nan() {
            "NaN".into()
        } else if v == f64::INFINITY {
            "+Inf".into()
        } else if v == f64::NEG_INFINITY {
            "-Inf".into()
        } else if exp {
            format!("{v:e}")
        } else {
            format!("{v}")
        }
    }

    fn escape(v: &str) -> String {
        v.replace('\\', r"\\").replace('"', r#"\""#).replace('\n', r"\n")
    }

    #[derive(Debug, Clone)]
    struct GenSample {
        name: String,
        labels: Vec<(String, String)>,
        value: f64,
        timestamp: Option<i64>,
        exp: bool,
        blank: &'static str,
        trailing_comma: bool,
        crlf: bool,
        comment_before: bool,
    }

    fn gen_sample() -> impl Strategy<Value = GenSample> {
        (
            "[a-zA-Z_:][a-zA-Z0-9_:]{0,20}",
            prop::collection::btree_map("[a-zA-Z_][a-zA-Z0-9_]{0,8}", any::<String>(), 0..5),
            prop::num::f64::ANY,
            prop::option::of(any::<i64>()),
            (any::<bool>(), prop::sample::select(vec![" ", "\t", "  ", " \t "]), any::<bool>()),
            (any::<bool>(), any::<bool>()),
        )
            .prop_map(
                |(name, labels, value, timestamp, (exp, blank, trailing_comma), (crlf, comment_before))| {
                    GenSample {
                        name,
                        labels: labels.into_iter().collect(),
                        value,
                        timestamp,
                        exp,
                        blank,
                        trailing_comma,
                        crlf,
                        comment_before,
                    }
                },
            )
    }

    fn render(samples: &[GenSample]) -> String {
        let mut out = String::new();
        for s in samples {
            if s.comment_before {
                out.push_str(&format!("# HELP {} some help\n# TYPE {} gauge\n\n", s.name, s.name));
            }
            out.push_str(&s.name);
            if !s.labels.is_empty() || s.trailing_comma {
                let pairs: Vec<_> = s.labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
                out.push('{');
                out.push_str(&pairs.join(","));
                if s.trailing_comma && !pairs.is_empty() {
                    out.push(',');
                }
                out.push('}');
            }
            out.push_str(s.blank);
            out.push_str(&render_value(s.value, s.exp));
            if let Some(ts) = s.timestamp {
                out.push_str(s.blank);
                out.push_str(&ts.to_string());
            }
            out.push_str(if s.crlf { "\r\n" } else { "\n" });
        }
        out
    }

    fn exercise(text: &str) -> usize {
        let mut it = Samples::new(text);
        let mut n = 0;
        for s in it.by_ref() {
            n += 1 + s.labels.iter().count() + s.labels.len();
            let _ = s.labels.get("a");
        }
        n + it.skipped()
    }

    proptest! {
        #[test]
        fn arbitrary_strings_never_panic(text in any::<String>()) {
            exercise(&text);
        }

        #[test]
        fn prom_like_strings_never_panic(text in PROM_CHARS) {
            exercise(&text);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
            exercise(&String::from_utf8_lossy(&bytes));
        }

        #[test]
        fn valid_expositions_round_trip(samples in prop::collection::vec(gen_sample(), 0..12)) {
            let text = render(&samples);
            let mut it = Samples::new(&text);
            let got: Vec<_> = it.by_ref().collect();
            prop_assert_eq!(it.skipped(), 0, "{:?}\n{}", it.first_error(), text);
            prop_assert_eq!(got.len(), samples.len());
            for (g, want) in got.iter().zip(&samples) {
                prop_assert_eq!(g.name, want.name.as_str());
                if want.value.is_nan() {
                    prop_assert!(g.value.is_nan());
                } else {
                    prop_assert_eq!(g.value.to_bits(), want.value.to_bits());
                }
                prop_assert_eq!(g.timestamp, want.timestamp);
                let labels: Vec<(String, String)> =
                    g.labels.iter().map(|(k, v)| (k.to_string(), v.into_owned())).collect();
                prop_assert_eq!(&labels, &want.labels);
            }
        }

        #[test]
        fn label_order_does_not_matter(
            labels in prop::collection::btree_map("[a-zA-Z_][a-zA-Z0-9_]{0,8}", any::<String>(), 1..6)
                .prop_flat_map(|m| {
                    let v: Vec<(String, String)> = m.into_iter().collect();
                    (Just(v.clone()), Just(v).prop_shuffle())
                })
        ) {
            let (sorted, shuffled) = labels;
            let line = |ls: &[(String, String)]| {
                let pairs: Vec<_> = ls.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
                format!("m{{{}}} 1", pairs.join(","))
            };
            let (a, b) = (line(&sorted), line(&shuffled));
            let (sa, sb) = (one(&a), one(&b));
            for (k, v) in &sorted {
                prop_assert_eq!(sa.labels.get(k).map(Cow::into_owned), Some(v.clone()));
                prop_assert_eq!(sb.labels.get(k).map(Cow::into_owned), Some(v.clone()));
            }
        }
    }
}
