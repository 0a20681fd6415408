//! What the configuration reference (`docs/configuration.md`) knows of each field, from its
//! declaration ([`settings!`](crate::base::settings) and `from_json_enum!`). Feature `schema`
//! only: the module never carries it.

/// One field of the configuration reference, as declared.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldInfo {
    /// The JSON key.
    pub key: &'static str,
    /// The `///` doc, one line per source line.
    pub doc: &'static str,
    /// The JSON type, in words (`integer`, `array of string`, `object`).
    pub ty: String,
    /// The default, as JSON; `None` for a required field.
    pub default: Option<serde_json::Value>,
    /// The `#[range]` bounds, as written.
    pub min: Option<String>,
    pub max: Option<String>,
    /// What follows the key in a nested field's path (`.`, `[].`, `.<key>.`) and the nested
    /// object's fields, when the field is (an option, list or map of) a settings struct.
    pub nested: Option<(String, Vec<FieldInfo>)>,
}

/// What the configuration reference knows of a field's type (feature `schema`).
pub trait Describe {
    /// The JSON type, in words.
    fn json_type() -> String;
    /// The path suffix and fields of the settings struct inside this type, if there is one.
    fn nested() -> Option<(String, Vec<FieldInfo>)> {
        None
    }
}

mod describe_impls {
    use super::{Describe, FieldInfo};
    use std::collections::BTreeMap;

    macro_rules! leaf {
        ($($t:ty => $name:literal),* $(,)?) => {$(
            impl Describe for $t {
                fn json_type() -> String {
                    $name.to_string()
                }
            }
        )*};
    }
    leaf!(bool => "boolean", String => "string", f64 => "number", u16 => "integer (u16)",
        u32 => "integer (u32)", u64 => "integer (u64)", usize => "integer", i32 => "integer (i32)");

    impl<T: Describe> Describe for Option<T> {
        fn json_type() -> String {
            format!("{} or null", T::json_type())
        }
        fn nested() -> Option<(String, Vec<FieldInfo>)> {
            T::nested()
        }
    }

    impl<T: Describe> Describe for Vec<T> {
        fn json_type() -> String {
            format!("array of {}", T::json_type())
        }
        fn nested() -> Option<(String, Vec<FieldInfo>)> {
            T::nested().map(|(suffix, fields)| (format!("[]{suffix}"), fields))
        }
    }

    impl<T: Describe> Describe for BTreeMap<String, T> {
        fn json_type() -> String {
            format!("map of string to {}", T::json_type())
        }
        fn nested() -> Option<(String, Vec<FieldInfo>)> {
            T::nested().map(|(suffix, fields)| (format!(".<key>{suffix}"), fields))
        }
    }
}
