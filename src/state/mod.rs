//! The records both roles read and write through shared data: the snapshot of endpoint
//! metrics, in-flight counts, the placement feed, health, rates, the shared prefix table, the
//! live load, and the lookups over them.

pub mod by_address;
pub mod catalog;
pub mod feed;
pub mod health;
pub mod inflight;
pub mod load;
pub mod metrics;
pub mod prefix_shared;
pub mod rates;
pub mod snapshot;
