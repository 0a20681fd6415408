//! Bursty arrivals (issue #15): the same requests, re-timed so that they come in bursts.
//!
//! A trace's arrival times are at load 1 (`Trace::requests[].arrival_ms`); the replay divides
//! them by the load factor. Both shapes here take their periods in *replay* time (what a server
//! sees) and the load, so that a 2 s window is 2 s at any load.
//!
//! - [`Arrivals::Grouped`]: every request of a window of `window_ms` is released at the window's
//!   start (a batch job or a retry storm, aligned to a clock). The order of requests and the mean
//!   rate are unchanged; each window's requests arrive at once.
//! - [`Arrivals::OnOff`]: an on/off source with the trace's mean rate: Poisson arrivals at
//!   `(on + off) / on` × the mean rate during on periods of `on_ms`, nothing during off periods
//!   of `off_ms`. The requests keep their order (and content, lengths, tiers); only their times
//!   are drawn. Seeded, so every strategy sees the same times.
//! - [`Arrivals::Plain`]: the trace's own times.
//!
//! The mean rate over the trace is kept by both shapes (up to the last window or cycle), so a
//! load factor means the same offered load with and without bursts.

use inference_picker::base::ports::{Rng, SplitMix64};

use crate::trace::Trace;

/// How a trace's requests arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrivals {
    Plain,
    Grouped { window_ms: f64 },
    OnOff { on_ms: f64, off_ms: f64, seed: u64 },
}

impl Arrivals {
    /// A short name for tables: `plain`, `grouped 2 s`, `on/off 2 s / 4 s`.
    pub fn label(&self) -> String {
        match self {
            Arrivals::Plain => "plain".into(),
            Arrivals::Grouped { window_ms } => format!("grouped {} s", window_ms / 1000.0),
            Arrivals::OnOff { on_ms, off_ms, .. } => {
                format!("on/off {} s / {} s", on_ms / 1000.0, off_ms / 1000.0)
            }
        }
    }

    /// A key for workload names: `plain`, `grouped`, `onoff`.
    pub fn key(&self) -> &'static str {
        match self {
            Arrivals::Plain => "plain",
            Arrivals::Grouped { .. } => "grouped",
            Arrivals::OnOff { .. } => "onoff",
        }
    }

    /// Re-times `trace` for replay at `load` (see the module doc).
    pub fn apply(&self, trace: &mut Trace, load: f64) {
        match *self {
            Arrivals::Plain => {}
            Arrivals::Grouped { window_ms } => group(trace, window_ms * load),
            Arrivals::OnOff { on_ms, off_ms, seed } => on_off(trace, on_ms * load, off_ms * load, seed),
        }
    }
}

/// Every arrival moved back to the start of its window of `window_ms` (load-1 time).
pub fn group(trace: &mut Trace, window_ms: f64) {
    if !(window_ms.is_finite() && window_ms > 0.0) {
        return;
    }
    for r in &mut trace.requests {
        r.arrival_ms = (r.arrival_ms / window_ms).floor() * window_ms;
    }
}

/// On/off Poisson arrivals with the trace's mean rate (load-1 time), in the trace's order.
pub fn on_off(trace: &mut Trace, on_ms: f64, off_ms: f64, seed: u64) {
    let n = trace.requests.len();
    let span = trace.span_s() * 1000.0;
    if n < 2 || !(on_ms > 0.0 && off_ms >= 0.0 && span > 0.0) {
        return;
    }
    let start = trace.requests.first().map_or(0.0, |r| r.arrival_ms);
    let mean_gap = span / (n - 1) as f64;
    // Gaps while on: the mean gap shrunk by the duty cycle.
    let on_gap = mean_gap * on_ms / (on_ms + off_ms);
    let mut rng = SplitMix64::new(seed);
    // `on_clock` counts time spent in on periods only; real time adds the off periods passed.
    let mut on_clock = 0.0;
    for r in &mut trace.requests {
        let cycles = (on_clock / on_ms).floor();
        r.arrival_ms = start + on_clock + cycles * off_ms;
        on_clock += -on_gap * (1.0 - rng.next_f64()).ln();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{Content, Request, Tier};

    fn trace(times: &[f64]) -> Trace {
        Trace {
            name: "t".into(),
            requests: times
                .iter()
                .map(|&t| Request {
                    arrival_ms: t,
                    prompt_tokens: 10,
                    output_tokens: 5,
                    content: Content::Unique,
                    adapter: None,
                    tier: Tier::Standard,
                })
                .collect(),
            tokens_per_hash: 16,
            shared_shape: None,
            adapters: 0,
        }
    }

    #[test]
    fn grouped_releases_each_window_at_its_start() {
        let mut t = trace(&[0.0, 900.0, 1000.0, 1500.0, 2999.0, 3000.0]);
        // A 500 ms window at load 2 is 1000 ms of load-1 time.
        Arrivals::Grouped { window_ms: 500.0 }.apply(&mut t, 2.0);
        let got: Vec<f64> = t.requests.iter().map(|r| r.arrival_ms).collect();
        assert_eq!(got, vec![0.0, 0.0, 1000.0, 1000.0, 2000.0, 3000.0]);
    }

    #[test]
    fn on_off_keeps_the_mean_rate_and_stays_off_when_off() {
        let n = 20_000;
        let times: Vec<f64> = (0..n).map(|i| i as f64 * 100.0).collect();
        let mut t = trace(&times);
        // On 1 s, off 3 s (replay time) at load 1: arrivals at 4 × the mean rate while on.
        Arrivals::OnOff { on_ms: 1000.0, off_ms: 3000.0, seed: 7 }.apply(&mut t, 1.0);
        let got: Vec<f64> = t.requests.iter().map(|r| r.arrival_ms).collect();
        assert!(got.windows(2).all(|w| w[0] <= w[1]), "in order");
        // Nothing arrives in an off period: phase within each 4 s cycle is under 1 s.
        assert!(got.iter().all(|&x| x % 4000.0 < 1000.0), "an arrival while off");
        // Same mean rate: the span is the original's within a few percent (20,000 draws).
        let span = got[n - 1] - got[0];
        let want = times[n - 1] - times[0];
        assert!((span / want - 1.0).abs() < 0.05, "span {span} vs {want}");
        // Seeded: the same times again.
        let mut t2 = trace(&times);
        Arrivals::OnOff { on_ms: 1000.0, off_ms: 3000.0, seed: 7 }.apply(&mut t2, 1.0);
        assert_eq!(t.requests, t2.requests);
    }

    #[test]
    fn plain_changes_nothing_and_labels_read_well() {
        let mut t = trace(&[0.0, 5.0]);
        let before = t.clone();
        Arrivals::Plain.apply(&mut t, 3.0);
        assert_eq!(t, before);
        assert_eq!(Arrivals::Grouped { window_ms: 2000.0 }.label(), "grouped 2 s");
        assert_eq!(Arrivals::OnOff { on_ms: 2000.0, off_ms: 4000.0, seed: 1 }.label(), "on/off 2 s / 4 s");
    }
}
