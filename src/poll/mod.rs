//! The poller role: the schedule, a scrape and its result, discovery, the lease, peers, and the
//! models each pod serves.

pub mod config;
pub mod discovery;
pub mod lease;
pub mod peers;
pub mod pod_models;
pub mod poller;
pub mod scrape;
