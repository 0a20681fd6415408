//! Ground: no project logic, nothing above it. Ports (time, randomness, the shared store),
//! the rejection type, the JSON configuration reader and its error, sorting, telemetry names.

pub mod codec;
#[cfg(feature = "schema")]
pub mod describe;
pub mod errors;
pub mod hash;
pub mod json;
pub mod labels;
pub mod ports;
pub mod settings;
pub mod sorting;
pub mod telemetry;
