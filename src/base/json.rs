//! The configuration reader: typed values out of a parsed [`serde_json::Value`].
//!
//! The document is parsed once into a `Value` (whose `Deserialize` the module carries anyway), and
//! every configuration type reads itself from it through [`FromJson`]. One small reader replaces
//! the dozens of derived deserializers the configuration types used to generate, and it knows the
//! JSON path of what it reads, so an error names its field directly (`pools[1].scheduler.weights`).
//!
//! The rules are serde's, with its wording: an unknown field, a missing required field, a value of
//! the wrong type, a negative, fractional or too-large number where an integer is expected, and an
//! unknown enum variant are errors. A struct reads itself with [`from_json_struct!`], which lists
//! each field once with its JSON name and default (configuration structs get that list from their
//! one declaration, `crate::base::settings::settings!`); a unit enum with [`from_json_enum!`].
//!
//! Paths are built in one `String`: a reader appends its segment (`.name`, `["odd key"]`, `[3]`)
//! before reading a child and truncates it after. The root is the empty path, shown as `$`.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

/// A configuration error: the JSON path of the bad field (`endpoints[2].address`, `$` for the
/// whole document) and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub path: String,
    pub reason: String,
}

impl ConfigError {
    pub fn new(path: impl Into<String>, reason: impl Into<String>) -> Self {
        Self { path: path.into(), reason: reason.into() }
    }
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.reason)
    }
}

impl std::error::Error for ConfigError {}

/// One log line for all errors: `invalid configuration (2 errors): a: x; b: y`.
pub fn describe_errors(errors: &[ConfigError]) -> String {
    let mut out =
        format!("invalid configuration ({} error{})", errors.len(), if errors.len() == 1 { "" } else { "s" });
    for (i, e) in errors.iter().enumerate() {
        out.push_str(if i == 0 { ": " } else { "; " });
        out.push_str(&e.to_string());
    }
    out
}

/// A configuration value that reads itself from parsed JSON.
pub trait FromJson: Sized {
    /// Reads `v`, found at `path` (empty at the root). `path` is returned as it was given.
    fn read(v: &Value, path: &mut String) -> Result<Self, ConfigError>;
}

/// The error `reason` at `path`; the root is `$`.
pub fn error(path: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::new(if path.is_empty() { "$" } else { path }, reason)
}

/// serde's wording for a value of the wrong kind: `invalid type: string "200", expected u64`.
pub fn invalid_type(v: &Value, expected: &str, path: &str) -> ConfigError {
    error(path, format!("invalid type: {}, expected {expected}", unexpected(v)))
}

/// How serde names a value it did not expect.
fn unexpected(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("boolean `{b}`"),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                format!("integer `{u}`")
            } else if let Some(i) = n.as_i64() {
                format!("integer `{i}`")
            } else {
                // serde writes a float with a decimal point even when it is whole (`1.0`).
                let f = n.as_f64().unwrap_or(f64::NAN);
                let mut text = f.to_string();
                if f.is_finite() && !text.contains('.') {
                    text.push_str(".0");
                }
                format!("floating point `{text}`")
            }
        }
        Value::String(s) => format!("string {s:?}"),
        Value::Array(_) => "sequence".into(),
        Value::Object(_) => "map".into(),
    }
}

/// serde's list of what was expected: "expected `a`", "expected `a` or `b`", "expected one of
/// `a`, `b`, `c`".
fn expected(names: &[&str]) -> String {
    format!("expected {}", one_of(names))
}

/// "`a`", "`a` or `b`", "one of `a`, `b`, `c`".
fn one_of(names: &[&str]) -> String {
    match names {
        [one] => format!("`{one}`"),
        [a, b] => format!("`{a}` or `{b}`"),
        _ => {
            let quoted: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
            format!("one of {}", quoted.join(", "))
        }
    }
}

/// Appends an object key to `path`: `.name` (no dot at the root), or `["odd key"]` when the key is
/// not plain.
pub fn push_key(path: &mut String, key: &str) {
    let plain = !key.is_empty() && key.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-');
    if !plain {
        path.push_str(&format!("[{key:?}]"));
        return;
    }
    if !path.is_empty() {
        path.push('.');
    }
    path.push_str(key);
}

/// Extends `path` by `[i]` and returns its length before.
#[inline(never)]
fn enter_index(path: &mut String, i: usize) -> usize {
    let len = path.len();
    path.push_str(&format!("[{i}]"));
    len
}

/// Extends `path` by the key (see [`push_key`]) and returns its length before.
#[inline(never)]
fn enter_key(path: &mut String, key: &str) -> usize {
    let len = path.len();
    push_key(path, key);
    len
}

/// Reads a whole document as a `T`, the root at path `$`.
pub fn read_value<T: FromJson>(v: &Value) -> Result<T, ConfigError> {
    T::read(v, &mut String::new())
}

impl FromJson for bool {
    fn read(v: &Value, path: &mut String) -> Result<Self, ConfigError> {
        v.as_bool().ok_or_else(|| invalid_type(v, "a boolean", path))
    }
}

impl FromJson for String {
    fn read(v: &Value, path: &mut String) -> Result<Self, ConfigError> {
        v.as_str().map(str::to_owned).ok_or_else(|| invalid_type(v, "a string", path))
    }
}

impl FromJson for f64 {
    fn read(v: &Value, path: &mut String) -> Result<Self, ConfigError> {
        // An integer is a number too, as serde reads it.
        match v {
            Value::Number(n) => n.as_f64().ok_or_else(|| invalid_type(v, "f64", path)),
            _ => Err(invalid_type(v, "f64", path)),
        }
    }
}

/// An integer of any JSON sign, or the error for a value that is not one (a float, a string).
fn integer(v: &Value, expected: &str, path: &str) -> Result<i128, ConfigError> {
    match v {
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => Ok(i128::from(u)),
            (_, Some(i)) => Ok(i128::from(i)),
            _ => Err(invalid_type(v, expected, path)),
        },
        _ => Err(invalid_type(v, expected, path)),
    }
}

/// `FromJson` for integer types: out of range (negative for an unsigned type, or too large) is
/// serde's "invalid value".
macro_rules! from_json_int {
    ($($t:ty),*) => {$(
        impl FromJson for $t {
            fn read(v: &Value, path: &mut String) -> Result<Self, ConfigError> {
                let n = integer(v, stringify!($t), path)?;
                <$t>::try_from(n).map_err(|_| {
                    error(path, format!("invalid value: integer `{n}`, expected {}", stringify!($t)))
                })
            }
        }
    )*};
}
from_json_int!(u16, u32, u64, usize, i32);

impl<T: FromJson> FromJson for Option<T> {
    /// `null` is `None`, as serde reads it.
    fn read(v: &Value, path: &mut String) -> Result<Self, ConfigError> {
        match v {
            Value::Null => Ok(None),
            _ => T::read(v, path).map(Some),
        }
    }
}

impl<T: FromJson> FromJson for Vec<T> {
    fn read(v: &Value, path: &mut String) -> Result<Self, ConfigError> {
        let Value::Array(items) = v else {
            return Err(invalid_type(v, "a sequence", path));
        };
        let mut out = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let len = enter_index(path, i);
            let item = T::read(item, path);
            path.truncate(len);
            out.push(item?);
        }
        Ok(out)
    }
}

impl<T: FromJson> FromJson for BTreeMap<String, T> {
    fn read(v: &Value, path: &mut String) -> Result<Self, ConfigError> {
        let Value::Object(map) = v else {
            return Err(invalid_type(v, "a map", path));
        };
        let mut out = BTreeMap::new();
        for (key, item) in map {
            let len = enter_key(path, key);
            let item = T::read(item, path);
            path.truncate(len);
            out.insert(key.clone(), item?);
        }
        Ok(out)
    }
}

/// Reads one JSON object field by field; see [`from_json_struct!`]. The first error is kept and
/// the fields after it are not read, so that a struct's reader has one exit on error.
pub struct Obj<'v, 'p> {
    map: &'v Map<String, Value>,
    path: &'p mut String,
    error: Option<ConfigError>,
}

impl<'v, 'p> Obj<'v, 'p> {
    /// The object `v`, whose keys must all be among `fields` (`deny_unknown_fields`).
    pub fn new(v: &'v Value, path: &'p mut String, fields: &[&str]) -> Result<Self, ConfigError> {
        let Value::Object(map) = v else {
            return Err(invalid_type(v, "an object", path));
        };
        if let Some(key) = map.keys().find(|k| !fields.contains(&k.as_str())) {
            let mut at = path.clone();
            push_key(&mut at, key);
            let list = if fields.is_empty() { "there are no fields".into() } else { expected(fields) };
            return Err(error(&at, format!("unknown field `{key}`, {list}")));
        }
        Ok(Self { map, path, error: None })
    }

    /// The field `key`, if present and no error came before; an error reading it is kept.
    pub fn opt<T: FromJson>(&mut self, key: &str) -> Option<T> {
        // Only the call is generic: the rest is shared by every field type.
        let (v, len) = self.enter(key)?;
        let out = T::read(v, self.path);
        self.path.truncate(len);
        match out {
            Ok(v) => Some(v),
            Err(e) => {
                self.error = Some(e);
                None
            }
        }
    }

    /// The value of `key` with `path` extended to it, and the path's length before; `None` when
    /// the key is absent or an error came before.
    #[inline(never)]
    fn enter(&mut self, key: &str) -> Option<(&'v Value, usize)> {
        if self.error.is_some() {
            return None;
        }
        let v = self.map.get(key)?;
        Some((v, enter_key(self.path, key)))
    }

    /// The required field `key`; missing is an error at the object's path.
    pub fn req<T: FromJson>(&mut self, key: &str) -> Option<T> {
        let v = self.opt(key);
        if v.is_none() && self.error.is_none() {
            self.error = Some(error(self.path, format!("missing field `{key}`")));
        }
        v
    }

    /// The first error, if any.
    pub fn finish(self) -> Result<(), ConfigError> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The error for a required field that [`Obj::finish`] found present but that is not (it
    /// cannot happen; there is no panic for it).
    pub fn lost(path: &str) -> ConfigError {
        error(path, "a required field was lost")
    }
}

/// Implements [`FromJson`] for a struct that is a JSON object with exactly these fields. Each
/// field is `name` (required), `name = default` (optional, `default` when absent), with
/// `as "jsonName"` after the name when the JSON key differs:
///
/// ```ignore
/// from_json_struct!(ModelMatch { kind as "type" = MatchType::Exact, value });
/// ```
macro_rules! from_json_struct {
    ($ty:ident { $($field:ident $(as $key:literal)? $(= $default:expr)?),* $(,)? }) => {
        impl $crate::base::json::FromJson for $ty {
            fn read(
                v: &serde_json::Value,
                path: &mut String,
            ) -> Result<Self, $crate::base::json::ConfigError> {
                let mut o = $crate::base::json::Obj::new(
                    v,
                    path,
                    &[$($crate::base::json::from_json_struct!(@key $field $($key)?)),*],
                )?;
                $(let $field = $crate::base::json::from_json_struct!(
                    @get o, $crate::base::json::from_json_struct!(@key $field $($key)?) $(, $default)?
                );)*
                o.finish()?;
                // Every required field is `Some` here (`finish` reported the missing ones).
                #[allow(unreachable_patterns)]
                match ($($field,)*) {
                    ($($crate::base::json::from_json_struct!(@some $field $(, $default)?),)*) => {
                        Ok($ty { $($field,)* })
                    }
                    _ => Err($crate::base::json::Obj::lost(path)),
                }
            }
        }
    };
    (@key $field:ident) => { stringify!($field) };
    (@key $field:ident $key:literal) => { $key };
    (@get $o:ident, $key:expr) => { $o.req($key) };
    (@get $o:ident, $key:expr, $default:expr) => {
        match $o.opt($key) {
            Some(v) => v,
            None => $default,
        }
    };
    (@some $field:ident) => { Some($field) };
    (@some $field:ident, $default:expr) => { $field };
}
pub(crate) use from_json_struct;

/// Implements [`FromJson`] for a unit enum written as one of these strings (several may name the
/// same variant: an alias):
///
/// ```ignore
/// from_json_enum!(Role { "decode" => Decode, "prefill" => Prefill, "both" => Both });
/// ```
macro_rules! from_json_enum {
    ($ty:ident { $($name:literal => $variant:ident),* $(,)? }) => {
        impl $crate::base::json::FromJson for $ty {
            fn read(
                v: &serde_json::Value,
                path: &mut String,
            ) -> Result<Self, $crate::base::json::ConfigError> {
                const NAMES: &[&str] = &[$($name),*];
                match v.as_str() {
                    $(Some($name) => Ok($ty::$variant),)*
                    other => Err($crate::base::json::unknown_variant(v, other, NAMES, path)),
                }
            }
        }

        #[cfg(feature = "schema")]
        impl $crate::base::describe::Describe for $ty {
            fn json_type() -> String {
                let names: &[&str] = &[$($name),*];
                let quoted: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
                format!("string, one of {}", quoted.join(", "))
            }
        }
    };
}
pub(crate) use from_json_enum;

/// The error for an enum value that is not one of `names`: an unknown string (`unknown variant
/// `Lease`, expected ...`), or not a string at all.
pub fn unknown_variant(v: &Value, text: Option<&str>, names: &[&str], path: &str) -> ConfigError {
    match text {
        Some(s) => error(path, format!("unknown variant `{s}`, {}", expected(names))),
        None => invalid_type(v, &one_of(names), path),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[derive(Debug, PartialEq)]
    struct Inner {
        n: u32,
        kind: Kind,
    }
    from_json_struct!(Inner { n, kind as "type" = Kind::A });

    #[derive(Debug, PartialEq)]
    struct Outer {
        name: String,
        items: Vec<Inner>,
        map: BTreeMap<String, i32>,
        ratio: f64,
        limit: Option<u64>,
        flag: bool,
    }
    from_json_struct!(Outer {
        name,
        items = Vec::new(),
        map = BTreeMap::new(),
        ratio = 0.5,
        limit = None,
        flag = false,
    });

    #[derive(Debug, PartialEq, Clone, Copy)]
    enum Kind {
        A,
        B,
    }
    from_json_enum!(Kind { "a" => A, "b" => B, "bee" => B });

    fn read(v: Value) -> Result<Outer, ConfigError> {
        read_value(&v)
    }

    #[track_caller]
    fn fails(v: Value, path: &str, reason: &str) {
        let e = read(v).unwrap_err();
        assert_eq!((e.path.as_str(), e.reason.as_str()), (path, reason));
    }

    #[test]
    fn defaults_renames_and_aliases() {
        let o = read(json!({"name": "x"})).unwrap();
        assert_eq!(
            o,
            Outer {
                name: "x".into(),
                items: vec![],
                map: BTreeMap::new(),
                ratio: 0.5,
                limit: None,
                flag: false
            }
        );
        let o = read(json!({"name": "x", "items": [{"n": 1}, {"n": 2, "type": "bee"}], "map": {"k": -3},
            "ratio": 2, "limit": null, "flag": true}))
        .unwrap();
        assert_eq!(o.items, vec![Inner { n: 1, kind: Kind::A }, Inner { n: 2, kind: Kind::B }]);
        assert_eq!((o.map["k"], o.ratio, o.limit, o.flag), (-3, 2.0, None, true));
        assert_eq!(read(json!({"name": "x", "limit": 7})).unwrap().limit, Some(7));
    }

    #[test]
    fn unknown_field_names_the_expected_ones() {
        fails(
            json!({"name": "x", "nmae": 1}),
            "nmae",
            "unknown field `nmae`, expected one of `name`, `items`, `map`, `ratio`, `limit`, `flag`",
        );
        fails(
            json!({"name": "x", "items": [{"n": 1}, {"n": 1, "kind": "a"}]}),
            "items[1].kind",
            "unknown field `kind`, expected `n` or `type`",
        );
        fails(
            json!({"name": "x", "odd key": 1}),
            "[\"odd key\"]",
            "unknown field `odd key`, expected one of `name`, `items`, `map`, `ratio`, `limit`, `flag`",
        );
    }

    #[test]
    fn missing_required_field_is_at_the_object() {
        fails(json!({}), "$", "missing field `name`");
        fails(json!({"name": "x", "items": [{"n": 1}, {}]}), "items[1]", "missing field `n`");
    }

    #[test]
    fn wrong_types() {
        fails(json!([]), "$", "invalid type: sequence, expected an object");
        fails(json!({"name": 3}), "name", "invalid type: integer `3`, expected a string");
        fails(
            json!({"name": "x", "flag": "yes"}),
            "flag",
            "invalid type: string \"yes\", expected a boolean",
        );
        fails(json!({"name": "x", "ratio": "1"}), "ratio", "invalid type: string \"1\", expected f64");
        fails(json!({"name": "x", "items": {}}), "items", "invalid type: map, expected a sequence");
        fails(json!({"name": "x", "map": []}), "map", "invalid type: sequence, expected a map");
        fails(
            json!({"name": "x", "map": {"a b": "1"}}),
            "map[\"a b\"]",
            "invalid type: string \"1\", expected i32",
        );
        fails(json!({"name": null}), "name", "invalid type: null, expected a string");
    }

    #[test]
    fn integers_are_integers_in_range() {
        let at = |n: Value| json!({"name": "x", "items": [{"n": n}]});
        fails(at(json!(-1)), "items[0].n", "invalid value: integer `-1`, expected u32");
        fails(at(json!(4_294_967_296u64)), "items[0].n", "invalid value: integer `4294967296`, expected u32");
        fails(at(json!(1.5)), "items[0].n", "invalid type: floating point `1.5`, expected u32");
        fails(at(json!(2.0)), "items[0].n", "invalid type: floating point `2.0`, expected u32");
        fails(
            at(json!(1e20)),
            "items[0].n",
            "invalid type: floating point `100000000000000000000.0`, expected u32",
        );
        assert_eq!(read(at(json!(4_294_967_295u64))).unwrap().items[0].n, u32::MAX);
        fails(
            json!({"name": "x", "map": {"k": 2_147_483_648u64}}),
            "map.k",
            "invalid value: integer `2147483648`, expected i32",
        );
        fails(json!({"name": "x", "limit": -5}), "limit", "invalid value: integer `-5`, expected u64");
        assert_eq!(u64::read(&json!(u64::MAX), &mut String::new()).unwrap(), u64::MAX);
        assert_eq!(
            u16::read(&json!(70000), &mut String::new()).unwrap_err().reason,
            "invalid value: integer `70000`, expected u16"
        );
    }

    #[test]
    fn enums() {
        let at = |k: Value| json!({"name": "x", "items": [{"n": 1, "type": k}]});
        fails(at(json!("c")), "items[0].type", "unknown variant `c`, expected one of `a`, `b`, `bee`");
        fails(at(json!(1)), "items[0].type", "invalid type: integer `1`, expected one of `a`, `b`, `bee`");
    }

    #[test]
    fn the_path_is_restored_after_each_field() {
        // An error after a nested read names only its own field.
        fails(
            json!({"name": "x", "items": [{"n": 1}], "map": {"k": 1}, "ratio": false}),
            "ratio",
            "invalid type: boolean `false`, expected f64",
        );
    }
}
