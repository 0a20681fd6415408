//! Prints the configuration's JSON Schema to stdout:
//! `cargo run -q -p config-schema > filter-config/schema.json`.

fn main() {
    print!("{}", config_schema::schema_json());
}
