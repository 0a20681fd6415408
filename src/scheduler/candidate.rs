//! What every scorer takes: one healthy endpoint as the scorers see it ([`Candidate`]), and the
//! neutral score a scorer gives when its signal is missing ([`neutral_fill`]). Below every
//! scorer; imports nothing of the scheduler.

use crate::base::num;
use crate::state::metrics::EndpointMetrics;

/// One healthy endpoint as the scorers see it.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    pub address: &'a str,
    pub metrics: Option<&'a EndpointMetrics>,
    /// Router-local in-flight count (all workers).
    pub inflight: u32,
    /// The live queue estimate (`crate::state::load`): the scraped queue corrected by what this
    /// gateway sent there since the scrape and has not seen finish. `None` when the engine
    /// reports no queue.
    pub queue: Option<f64>,
}

/// Replaces missing scores by the neutral `min(0.5, lowest known)`; 0.5 when none is known.
pub fn neutral_fill(raw: &[Option<f64>]) -> Vec<f64> {
    let neutral = neutral_score(raw.iter().flatten().copied().fold(f64::INFINITY, num::min));
    raw.iter().map(|s| s.unwrap_or(neutral)).collect()
}

/// The score [`neutral_fill`] gives a missing signal, from the lowest known score
/// (`f64::INFINITY` when none is known).
pub fn neutral_score(lowest: f64) -> f64 {
    if lowest.is_finite() {
        num::min(lowest, 0.5)
    } else {
        0.5
    }
}
