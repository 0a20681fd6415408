//! A group's capacity for one epoch: free slots, saturation, and the reserve kept for high
//! priorities.

use crate::flow::saturation::SaturationReport;

/// What the group can take right now, as seen by this worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// Changes when the capacity estimate is renewed: the snapshot version.
    pub epoch: u64,
    /// Release tokens for a new epoch: the saturation headroom.
    pub slots: u32,
    /// Every endpoint of the group is full.
    pub saturated: bool,
    /// The capacity left to priorities below a reserve (`flow_control.reserve`), if configured.
    pub reserve: Option<Reserve>,
}

/// What the group can take from requests below `min_priority`: the saturation report at the
/// reduced thresholds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserve {
    pub min_priority: i32,
    pub slots: u32,
    pub saturated: bool,
}

impl Capacity {
    pub fn new(snapshot_version: u64, report: &SaturationReport) -> Self {
        Self { epoch: snapshot_version, slots: report.headroom, saturated: report.saturated, reserve: None }
    }

    /// Adds the reserve: `report` is the saturation report at the reduced thresholds.
    pub fn with_reserve(mut self, min_priority: i32, report: &SaturationReport) -> Self {
        self.reserve = Some(Reserve { min_priority, slots: report.headroom, saturated: report.saturated });
        self
    }

    /// Whether a request of `priority` finds every endpoint full (for it).
    pub fn saturated_for(&self, priority: i32) -> bool {
        match self.reserve {
            Some(r) if priority < r.min_priority => self.saturated || r.saturated,
            _ => self.saturated,
        }
    }
}
