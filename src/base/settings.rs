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

use std::fmt::Display;

use crate::base::json::ConfigError;

/// Appends the error of a value outside `min..=max` (either bound may be absent) to `errs`, at
/// `path.key`. `reason` replaces the standard wording.
pub fn check_range<T: PartialOrd + Display + Copy>(
    errs: &mut Vec<ConfigError>,
    path: &str,
    key: &str,
    v: T,
    min: Option<T>,
    max: Option<T>,
    reason: Option<&str>,
) {
    // Written so that a NaN is out of range too.
    let low = min.is_some_and(|m| !(v >= m));
    let high = max.is_some_and(|m| !(v <= m));
    if low || high {
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
    errs.sort_by_key(|e| {
        let rest = if path.is_empty() {
            Some(e.path.as_str())
        } else {
            e.path.strip_prefix(path).and_then(|r| r.strip_prefix('.'))
        };
        let key = rest.map(|r| r.split(['.', '[']).next().unwrap_or(r));
        key.and_then(|k| keys.iter().position(|x| *x == k)).unwrap_or(keys.len())
    });
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
            #[allow(unused_variables)]
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
