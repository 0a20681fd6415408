//! The thin shell: every proxy-wasm host call lives in this module.
#![allow(clippy::disallowed_methods)]
