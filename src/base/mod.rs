//! Ground: no project logic, nothing above it. Ports (time, randomness, the shared store),
//! the rejection type, the JSON configuration reader and its error, sorting, `f64` max/min
//! without a libm call, telemetry names.

pub mod codec;
#[cfg(feature = "schema")]
pub mod describe;
pub mod errors;
pub mod hash;
pub mod json;
pub mod labels;
pub mod num;
pub mod ports;
pub mod settings;
pub mod sorting;
pub mod telemetry;
