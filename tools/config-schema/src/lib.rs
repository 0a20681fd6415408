//! The JSON Schema of the inference-picker configuration, generated from the Rust types
//! (`inference_picker::config::Config`, feature `schema`): doc comments become `description`s,
//! serde defaults become `default`s, `deny_unknown_fields` becomes `additionalProperties: false`.
//!
//! `filter-config/schema.json` is this output, committed; a test in this crate fails when the two
//! differ. Regenerate with `cargo run -q -p config-schema > filter-config/schema.json`.
//!
//! With `--reference` the tool prints the configuration reference instead ([`reference`],
//! `docs/configuration.md`).

pub mod reference;

use inference_picker::config::Config;
use serde_json::Value;

/// The schema as pretty-printed JSON with a trailing newline, exactly as committed.
pub fn schema_json() -> String {
    let mut schema = schemars::schema_for!(Config);
    // Edited in place rather than through `to_value`, so that schemars' own key order (`$schema`,
    // `title`, `description`, `type`, `properties` ...) is kept when it serialises.
    if let Some(map) = schema.as_object_mut() {
        map.values_mut().for_each(unwrap_descriptions);
        if let Some(Value::String(text)) = map.get_mut("description") {
            *text = unwrap_text(text);
        }
    }
    // A schema is a `serde_json::Value` underneath; serialising one cannot fail.
    let mut text = serde_json::to_string_pretty(&schema).unwrap_or_default();
    text.push('\n');
    text
}

/// Doc comments are wrapped at the source's line width; editors show descriptions as text, so
/// join wrapped lines and keep only paragraph breaks.
fn unwrap_descriptions(v: &mut Value) {
    match v {
        Value::Object(map) => {
            for (key, child) in map.iter_mut() {
                match child {
                    Value::String(text) if key == "description" => *text = unwrap_text(text),
                    _ => unwrap_descriptions(child),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(unwrap_descriptions),
        _ => {}
    }
}

fn unwrap_text(text: &str) -> String {
    text.split("\n\n").map(|p| p.replace('\n', " ")).collect::<Vec<_>>().join("\n\n")
}
