//! The configuration reference, `docs/configuration.md`: every field of the document (its JSON
//! path, type, default, range and doc), from the same `settings!` declarations as the reader,
//! the defaults and the schema (`inference_picker::base::describe`).
//!
//! `docs/configuration.md` is this output, committed; a test in this crate fails when the two
//! differ. Regenerate with `make config-docs`
//! (`cargo run -q -p config-schema -- --reference > docs/configuration.md`).

use inference_picker::base::describe::{Describe, FieldInfo};
use inference_picker::config::Config;
use serde_json::Value;

/// One field of the reference.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// `poller.interval_ms`, `endpoints[].address`, `scheduler.model_weights.<key>.prefix`.
    pub path: String,
    pub ty: String,
    /// `None`: required.
    pub default: Option<Value>,
    pub min: Option<String>,
    pub max: Option<String>,
    /// The doc comment, wrapped lines joined (as in the schema's descriptions).
    pub doc: String,
    /// The field holds (an option, list or map of) a settings struct, whose fields follow.
    pub is_section: bool,
}

/// Every field, depth first in declaration order.
pub fn rows() -> Vec<Row> {
    let mut out = Vec::new();
    if let Some((_, fields)) = Config::nested() {
        walk(&fields, "", &mut out);
    }
    out
}

fn walk(fields: &[FieldInfo], prefix: &str, out: &mut Vec<Row>) {
    for f in fields {
        let path = format!("{prefix}{}", f.key);
        out.push(Row {
            path: path.clone(),
            ty: f.ty.clone(),
            default: f.default.clone(),
            min: f.min.clone(),
            max: f.max.clone(),
            doc: unwrap_doc(f.doc),
            is_section: f.nested.is_some(),
        });
        if let Some((suffix, children)) = &f.nested {
            walk(children, &format!("{path}{suffix}"), out);
        }
    }
}

/// Doc lines (each with the space after `///`) joined into paragraphs.
fn unwrap_doc(doc: &str) -> String {
    let lines: Vec<&str> = doc.lines().map(str::trim).collect();
    lines
        .split(|l| l.is_empty())
        .map(|p| p.join(" "))
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// The reference as Markdown, exactly as committed.
pub fn markdown() -> String {
    let mut out = String::from(
        "<!-- Generated from the settings! declarations in src/ by `make config-docs`; do not edit.\n     \
         A test (tools/config-schema/tests/schema.rs) fails when it is out of date. -->\n\n\
         # Configuration reference\n\n\
         Every field of the configuration document, generated from the one declaration of each\n\
         setting in the source (`settings!`, `src/base/settings.rs`), which also gives the reader,\n\
         the defaults, the range checks and [`filter-config/schema.json`](../filter-config/schema.json).\n\
         How the document is read, validated and delivered, with examples:\n\
         [`filter-config/README.md`](../filter-config/README.md).\n\n\
         A path `a[].b` is the field `b` of every element of the array `a`; `a.<key>.b` the field `b`\n\
         of every value of the map `a`. A field without a default is required. Ranges are inclusive\n\
         and checked when the document is read; fields have further checks (between fields, on\n\
         names and addresses) that their text describes.\n",
    );
    for row in rows() {
        let top = !row.path.contains(['.', '[']);
        out.push_str(if top { "\n## `" } else { "\n### `" });
        out.push_str(&row.path);
        out.push_str("`\n\n");
        let mut facts = vec![format!("Type: {}", row.ty)];
        facts.push(match &row.default {
            None => "required".to_string(),
            Some(v) if row.is_section && v.is_object() => "default: every field at its default".to_string(),
            Some(v) => format!("default: `{}`", compact(v)),
        });
        match (&row.min, &row.max) {
            (Some(lo), Some(hi)) => facts.push(format!("range: {lo} to {hi}")),
            (Some(lo), None) => facts.push(format!("at least {lo}")),
            (None, Some(hi)) => facts.push(format!("at most {hi}")),
            (None, None) => {}
        }
        out.push_str(&facts.join(" · "));
        out.push('\n');
        if !row.doc.is_empty() {
            out.push('\n');
            out.push_str(&row.doc);
            out.push('\n');
        }
    }
    out
}

/// One-line JSON.
fn compact(v: &Value) -> String {
    serde_json::to_string(v).unwrap_or_default()
}
