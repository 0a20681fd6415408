//! One declaration per setting: [`settings!`] declares a configuration struct once, and everything
//! else about its fields comes from that declaration.
//!
//! ```ignore
//! settings! {
//!     /// Holding requests inside the proxy while their endpoints are saturated.
//!     #[derive(Debug, Clone, PartialEq, Eq)]
//!     pub struct FlowControlConfig {
//!         /// Hold requests while saturated. Default false.
//!         pub enabled: bool = false,
//!         /// Longest a request is held before 503, in ms; at least 1. Default 30000.
//!         #[range(min = 1)]
//!         #[reason = "must be > 0"]
//!         pub max_wait_ms: u64 = 30_000,
//!         /// A field without `= default` is required.
//!         pub name: String,
//!         /// The JSON key differs from the Rust name.
//!         pub critical as "Critical": i32 = 10,
//!     }
//! }
//! ```
//!
//! From each field (its `///` doc, `= default`, `#[range(...)]` and JSON key) come:
//! - the struct itself, deriving `Serialize` (and `schemars::JsonSchema` with feature `schema`),
//!   with `#[serde(deny_unknown_fields)]`;
//! - when every field has a default, `impl Default` built from those defaults (a struct with a
//!   required field has none);
//! - its reader, [`FromJson`](crate::base::json::FromJson) (unknown fields are errors, a missing
//!   field takes its default, a missing required field is an error);
//! - the JSON Schema's `description` (the doc), `default` and `minimum`/`maximum` (the range);
//! - `validate_ranges`, which reports every value outside its `#[range]` with the field's path:
//!   "must be at least {min}, got {v}", "must be at most {max}, got {v}" or "must be in
//!   {min}..={max}, got {v}", or the field's own `#[reason = "..."]` (where `{v}`, `{min}` and
//!   `{max}` are replaced). The section's hand-written `validate` calls it and adds the
//!   cross-field checks, or calls `validate_fields` with them, which puts all the section's
//!   errors in declaration order;
//! - with feature `schema`, [`Describe`](crate::base::describe::Describe): the field list of the
//!   configuration reference (`docs/configuration.md`, `make config-docs`).
//!
//! A range check is a simple bound, inclusive; anything else (an exclusive bound, a bound that
//! depends on another field, a syntax) stays hand-written in the section's `validate`, with its
//! schema keyword, if any, in `#[schema(...)]`.
//!
//! The schema's `default`s come from the declared ones too: a struct whose fields all have one
//! gets `#[serde(default)]` and the generated `Default`; in a struct with a required field, each
//! optional field's `default` is set from its declaration by a schemars `transform`. The tests in
//! `tools/config-schema` compare the schema with the reference field by field.
//!
//! Field attributes come in this order: `///` docs, `#[range(...)]` (with an optional
//! `#[reason = "..."]` after it), any `#[schema(...)]` (passed to schemars: `length`, `regex`,
//! `extend`), any `#[serde(...)]` (passed to serde, e.g. `skip_serializing_if`).

use std::cmp::Ordering;
use std::fmt::Display;

use crate::base::json::ConfigError;

/// A value a `#[range]` can bound.
pub trait Bounded: PartialOrd + Display + Copy {
    /// False for a float that is not a number or infinite: out of every range.
    fn is_finite_value(self) -> bool {
        true
    }
}

impl Bounded for u16 {}
impl Bounded for u32 {}
impl Bounded for u64 {}
impl Bounded for usize {}
impl Bounded for i32 {}
impl Bounded for f64 {
    fn is_finite_value(self) -> bool {
        self.is_finite()
    }
}

/// Appends the error of a value outside `min..=max` (either bound may be absent) to `errs`, at
/// `path.key`. `reason` replaces the standard wording. A float that is not finite is out of range.
pub fn check_range<T: Bounded>(
    errs: &mut Vec<ConfigError>,
    path: &str,
    key: &str,
    v: T,
    min: Option<T>,
    max: Option<T>,
    reason: Option<&str>,
) {
    // A NaN is out of range too (it compares as `None`).
    let low = min.is_some_and(|m| matches!(v.partial_cmp(&m), Some(Ordering::Less) | None));
    let high = max.is_some_and(|m| matches!(v.partial_cmp(&m), Some(Ordering::Greater) | None));
    if low || high || !v.is_finite_value() {
        errs.push(range_error(
            path,
            key,
            &v.to_string(),
            min.map(|m| m.to_string()),
            max.map(|m| m.to_string()),
            reason,
        ));
    }
}

/// Sorts `errs` (stably) by the field under `path` each names, in the order of `keys`; an error
/// naming no field of `keys` goes last.
pub fn in_field_order(errs: &mut [ConfigError], path: &str, keys: &[&str]) {
    let rank = |e: &ConfigError| {
        let rest = if path.is_empty() {
            Some(e.path.as_str())
        } else {
            e.path.strip_prefix(path).and_then(|r| r.strip_prefix('.'))
        };
        let key = rest.map(|r| r.split(['.', '[']).next().unwrap_or(r));
        key.and_then(|k| keys.iter().position(|x| *x == k)).unwrap_or(keys.len())
    };
    // An insertion sort: a section has few errors, and it keeps the module smaller than
    // `sort_by_key`'s merge sort would.
    let mut ranks: Vec<usize> = errs.iter().map(rank).collect();
    for i in 1..errs.len() {
        let mut j = i;
        while j > 0 && ranks.get(j - 1) > ranks.get(j) {
            ranks.swap(j - 1, j);
            errs.swap(j - 1, j);
            j -= 1;
        }
    }
}

/// The error of [`check_range`], shared by every type.
#[inline(never)]
fn range_error(
    path: &str,
    key: &str,
    v: &str,
    min: Option<String>,
    max: Option<String>,
    reason: Option<&str>,
) -> ConfigError {
    let template = match (reason, &min, &max) {
        (Some(r), _, _) => r,
        (None, Some(_), Some(_)) => "must be in {min}..={max}, got {v}",
        (None, Some(_), None) => "must be at least {min}, got {v}",
        (None, None, _) => "must be at most {max}, got {v}",
    };
    let text = template
        .replace("{v}", v)
        .replace("{min}", min.as_deref().unwrap_or(""))
        .replace("{max}", max.as_deref().unwrap_or(""));
    let at = if path.is_empty() { key.to_string() } else { format!("{path}.{key}") };
    ConfigError::new(at, text)
}

/// Sets the `default` schemars gave the property `key` of `schema` (its type's `Default`) to the
/// declared `value`; a property without one (no default, or skipped when serialised) is left alone.
#[cfg(feature = "schema")]
pub fn set_schema_default<T: serde::Serialize>(schema: &mut schemars::Schema, key: &str, value: T) {
    let slot = schema.get_mut("properties").and_then(|p| p.get_mut(key)).and_then(|p| p.get_mut("default"));
    if let (Some(slot), Ok(v)) = (slot, serde_json::to_value(&value)) {
        *slot = v;
    }
}

/// Declares a configuration struct once; see the [module docs](self).
macro_rules! settings {
    // Every field has a default: the struct gets `Default` from them, and the schema takes each
    // field's default from it.
    (
        $(#[$sattr:meta])*
        $svis:vis struct $name:ident {
            $(
                $(#[doc = $doc:literal])*
                $(#[range($($range:tt)*)] $(#[reason = $reason:literal])?)?
                $(#[schema($($schema:tt)*)])*
                $(#[serde($($serde:tt)*)])*
                $fvis:vis $field:ident $(as $key:literal)? : $ty:ty = $default:expr
            ),* $(,)?
        }
    ) => {
        #[derive(serde::Serialize)]
        #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
        $(#[$sattr])*
        #[serde(deny_unknown_fields, default)]
        $svis struct $name {
            $(
                $(#[doc = $doc])*
                $(#[serde(rename = $key)])?
                $(#[cfg_attr(feature = "schema", schemars(range($($range)*)))])?
                $(#[cfg_attr(feature = "schema", schemars($($schema)*))])*
                $(#[serde($($serde)*)])*
                $fvis $field: $ty,
            )*
        }

        impl Default for $name {
            fn default() -> Self {
                Self { $($field: $default,)* }
            }
        }

        $crate::base::settings::settings!(@common $name {
            $(
                [$($doc)*] [$($($range)*)?] [$($($reason)?)?]
                $field $(as $key)? : $ty = $default
            ),*
        });
    };

    // Some field is required: no `Default`; the schema's default of an optional field is its
    // type's `Default`.
    (
        $(#[$sattr:meta])*
        $svis:vis struct $name:ident {
            $(
                $(#[doc = $doc:literal])*
                $(#[range($($range:tt)*)] $(#[reason = $reason:literal])?)?
                $(#[schema($($schema:tt)*)])*
                $(#[serde($($serde:tt)*)])*
                $fvis:vis $field:ident $(as $key:literal)? : $ty:ty $(= $default:expr)?
            ),* $(,)?
        }
    ) => {
        #[derive(serde::Serialize)]
        #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
        $(#[$sattr])*
        // schemars' default of an optional field here is its type's `Default`: replaced by the
        // declared one.
        #[cfg_attr(feature = "schema", schemars(transform = $name::declared_schema_defaults))]
        #[serde(deny_unknown_fields)]
        $svis struct $name {
            $(
                $(#[doc = $doc])*
                $(#[serde(rename = $key)])?
                // `$default` only drives the repetition: `cfg_attr(any(), ...)` is always dropped.
                $(#[cfg_attr(any(), doc = stringify!($default))] #[serde(default)])?
                $(#[cfg_attr(feature = "schema", schemars(range($($range)*)))])?
                $(#[cfg_attr(feature = "schema", schemars($($schema)*))])*
                $(#[serde($($serde)*)])*
                $fvis $field: $ty,
            )*
        }

        #[cfg(feature = "schema")]
        impl $name {
            /// Sets the schema's default of each optional field to the declared one.
            fn declared_schema_defaults(schema: &mut schemars::Schema) {
                $({
                    let _key = $crate::base::json::from_json_struct!(@key $field $($key)?);
                    $($crate::base::settings::set_schema_default(schema, _key, {
                        let value: $ty = $default;
                        value
                    });)?
                })*
                let _ = schema;
            }
        }

        $crate::base::settings::settings!(@common $name {
            $(
                [$($doc)*] [$($($range)*)?] [$($($reason)?)?]
                $field $(as $key)? : $ty $(= $default)?
            ),*
        });
    };

    // What both forms share: the reader, the range checks and the reference.
    (@common $name:ident {
        $(
            [$($doc:literal)*] [$($range:tt)*] [$($reason:literal)?]
            $field:ident $(as $key:literal)? : $ty:ty $(= $default:expr)?
        ),*
    }) => {
        $crate::base::json::from_json_struct!($name { $($field $(as $key)? $(= $default)?),* });

        impl $name {
            /// Appends an error for every field outside its declared `#[range]`, with paths under
            /// `path` (e.g. `flow_control`).
            // A struct without ranges uses neither argument.
            #[allow(unused_variables, clippy::ptr_arg)]
            pub fn validate_ranges(&self, path: &str, errs: &mut Vec<$crate::base::json::ConfigError>) {
                $($crate::base::settings::settings!(@check self, path, errs, $field $(as $key)?, $ty, [$($range)*] [$($reason)?]);)*
            }
        }

        impl $name {
            /// Runs the `#[range]` checks and `checks` (the section's own), and puts the errors
            /// they add in the order of the fields they name, as declared (a section reports its
            /// problems in document order).
            #[allow(dead_code)]
            pub fn validate_fields(
                &self,
                path: &str,
                errs: &mut Vec<$crate::base::json::ConfigError>,
                checks: impl FnOnce(&mut Vec<$crate::base::json::ConfigError>),
            ) {
                let start = errs.len();
                self.validate_ranges(path, errs);
                checks(errs);
                let keys: &[&str] = &[$($crate::base::json::from_json_struct!(@key $field $($key)?)),*];
                $crate::base::settings::in_field_order(errs.get_mut(start..).unwrap_or_default(), path, keys);
            }
        }

        #[cfg(feature = "schema")]
        impl $crate::base::describe::Describe for $name {
            fn json_type() -> String {
                "object".to_string()
            }
            fn nested() -> Option<(String, Vec<$crate::base::describe::FieldInfo>)> {
                Some((".".to_string(), vec![$(
                    $crate::base::describe::FieldInfo {
                        key: $crate::base::json::from_json_struct!(@key $field $($key)?),
                        doc: concat!($($doc, "\n",)*),
                        ty: <$ty as $crate::base::describe::Describe>::json_type(),
                        default: $crate::base::settings::settings!(@default $ty $(, $default)?),
                        min: $crate::base::settings::settings!(@text min $ty, [$($range)*]),
                        max: $crate::base::settings::settings!(@text max $ty, [$($range)*]),
                        nested: <$ty as $crate::base::describe::Describe>::nested(),
                    },
                )*]))
            }
        }
    };

    (@check $self:ident, $path:ident, $errs:ident, $field:ident $(as $key:literal)?, $ty:ty, [] []) => {};
    (@check $self:ident, $path:ident, $errs:ident, $field:ident $(as $key:literal)?, $ty:ty,
        [$($range:tt)+] [$($reason:literal)?]) => {
        $crate::base::settings::check_range::<$ty>(
            $errs,
            $path,
            $crate::base::json::from_json_struct!(@key $field $($key)?),
            $self.$field,
            $crate::base::settings::settings!(@min [$($range)+]),
            $crate::base::settings::settings!(@max [$($range)+]),
            $crate::base::settings::settings!(@reason [$($reason)?]),
        )
    };

    (@min [min = $v:expr $(, max = $w:expr)?]) => { Some($v) };
    (@min [$($rest:tt)*]) => { None };
    (@max [min = $v:expr, max = $w:expr]) => { Some($w) };
    (@max [max = $w:expr]) => { Some($w) };
    (@max [$($rest:tt)*]) => { None };
    (@text $bound:ident $ty:ty, []) => { None };
    (@text $bound:ident $ty:ty, [$($range:tt)+]) => {
        $crate::base::settings::settings!(@$bound [$($range)+]).map(|v: $ty| v.to_string())
    };
    (@reason [$reason:literal]) => { Some($reason) };
    (@reason []) => { None };

    (@default $ty:ty) => { None };
    (@default $ty:ty, $default:expr) => {{
        let value: $ty = $default;
        Some(serde_json::to_value(&value).unwrap_or(serde_json::Value::Null))
    }};
}
pub(crate) use settings;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::json::read_value;
    use serde_json::json;

    settings! {
        /// A section with every kind of field.
        #[derive(Debug, Clone, PartialEq)]
        pub struct Section {
            /// Default 3.
            #[range(min = 1, max = 10)]
            pub count: u32 = 3,
            /// At least 0.5.
            #[range(min = 0.5)]
            #[reason = "must be {min} or more, not {v}"]
            pub ratio: f64 = 1.0,
            /// Renamed.
            pub label as "Label": String = String::from("x"),
            pub nested: Option<Inner> = None,
        }
    }

    settings! {
        #[derive(Debug, Clone, PartialEq)]
        pub struct Inner {
            pub name: String,
            #[range(max = 5)]
            pub level: u64 = 2,
        }
    }

    fn errors(s: &Section) -> Vec<(String, String)> {
        let mut errs = Vec::new();
        s.validate_ranges("sec", &mut errs);
        errs.into_iter().map(|e| (e.path, e.reason)).collect()
    }

    #[test]
    fn defaults_reader_and_required_fields_come_from_the_declaration() {
        let d = Section::default();
        assert_eq!((d.count, d.ratio, d.label.as_str(), d.nested.is_none()), (3, 1.0, "x", true));
        assert_eq!(read_value::<Section>(&json!({})).unwrap(), d);
        let s: Section = read_value(&json!({"Label": "y", "nested": {"name": "n"}})).unwrap();
        assert_eq!(s.label, "y");
        assert_eq!(s.nested, Some(Inner { name: "n".into(), level: 2 }));
        let e = read_value::<Section>(&json!({"nested": {}})).unwrap_err();
        assert_eq!((e.path.as_str(), e.reason.as_str()), ("nested", "missing field `name`"));
        let e = read_value::<Section>(&json!({"label": "y"})).unwrap_err();
        assert_eq!(e.reason, "unknown field `label`, expected one of `count`, `ratio`, `Label`, `nested`");
    }

    #[test]
    fn ranges_report_paths_and_reasons() {
        assert!(errors(&Section::default()).is_empty());
        let s = Section { count: 0, ratio: 0.25, ..Section::default() };
        assert_eq!(
            errors(&s),
            [
                ("sec.count".to_string(), "must be in 1..=10, got 0".to_string()),
                ("sec.ratio".to_string(), "must be 0.5 or more, not 0.25".to_string()),
            ]
        );
        for ratio in [f64::NAN, f64::INFINITY] {
            assert_eq!(errors(&Section { ratio, ..Section::default() }).len(), 1, "{ratio}");
        }
        let mut errs = Vec::new();
        Inner { name: "n".into(), level: 6 }.validate_ranges("", &mut errs);
        assert_eq!((errs[0].path.as_str(), errs[0].reason.as_str()), ("level", "must be at most 5, got 6"));
    }

    #[test]
    fn validate_fields_puts_a_sections_errors_in_declaration_order() {
        let s = Section { count: 11, ..Section::default() };
        let mut errs = vec![ConfigError::new("before", "kept first")];
        s.validate_fields("sec", &mut errs, |errs| {
            errs.push(ConfigError::new("sec.nested.name", "hand"));
            errs.push(ConfigError::new("sec.Label", "hand"));
            errs.push(ConfigError::new("elsewhere", "last"));
        });
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["before", "sec.count", "sec.Label", "sec.nested.name", "elsewhere"]);
    }
}
