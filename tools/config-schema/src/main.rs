//! Prints the configuration's JSON Schema to stdout:
//! `cargo run -q -p config-schema > filter-config/schema.json`; with `--reference`, the
//! configuration reference: `cargo run -q -p config-schema -- --reference > docs/configuration.md`.

fn main() {
    match std::env::args().nth(1).as_deref() {
        None => print!("{}", config_schema::schema_json()),
        Some("--reference") => print!("{}", config_schema::reference::markdown()),
        Some(other) => {
            eprintln!("config-schema: unknown argument {other:?}; usage: config-schema [--reference]");
            std::process::exit(2);
        }
    }
}
