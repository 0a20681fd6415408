//! The burst study (issue #15, `replay-bench --bursts`): premium TTFT p90 of the shipped tier
//! example (`ours-tiers`) at 1.5× overload, with and without bursty arrivals, against unloaded.
//!
//! - Trace: Mooncake conversation with the default set's SLA-tier mix (20 % premium, 50 %
//!   standard, 30 % sheddable, seed 11), 8 servers, `--scale` of it.
//! - Load: 1.5 × `suite::MOONCAKE_CAPACITY_LOAD` (the pool's measured capacity on this trace), as
//!   the default set's tier target; `--loads` overrides (first value).
//! - Arrivals (`crate::arrivals`): the trace's own times; grouped (every request of a 2 s window
//!   at the window's start); on/off (Poisson at 3× the mean rate for 2 s, idle for 4 s).
//! - Unloaded: the same premium requests at the same times (same arrival shape) with nothing
//!   else on the pool: what premium would see if the other tiers were not there. The ratio
//!   loaded ÷ unloaded is taken per seed (same seed, same premium requests).
//! - Done when (issue #15): with bursts, premium TTFT p90 stays within 2× of unloaded.

use std::path::Path;

use model_server_sim::ServerConfig;

use crate::arrivals::Arrivals;
use crate::stats::RunResult;
use crate::strategy::Policy;
use crate::suite::{self, Range, Workload, WorkloadResult};
use crate::trace::{self, Tier};

/// The arrival shapes of the study.
pub const SHAPES: [Arrivals; 3] = [
    Arrivals::Plain,
    Arrivals::Grouped { window_ms: 2000.0 },
    Arrivals::OnOff { on_ms: 2000.0, off_ms: 4000.0, seed: 15 },
];

/// Premium TTFT p90 may be at most this many times unloaded (issue #15).
pub const TARGET_RATIO: f64 = 2.0;

/// The study's default load: 1.5 × the pool's capacity on Mooncake.
pub fn default_load() -> f64 {
    1.5 * suite::MOONCAKE_CAPACITY_LOAD
}

fn key(shape: &Arrivals, unloaded: bool) -> String {
    format!("tiers-{}{}", shape.key(), if unloaded { "-unloaded" } else { "" })
}

/// Two workloads per arrival shape: the tier mix, and its premium requests alone.
pub fn workloads(data: &Path, scale: f64, load: f64, strategies: &[Policy]) -> Result<Vec<Workload>, String> {
    let mut base = trace::load(&data.join("mooncake_conversation_trace.jsonl.gz"))?;
    trace::assign_tiers(&mut base, 0.2, 0.5, 11);
    if scale < 1.0 {
        let n = ((base.requests.len() as f64 * scale).ceil() as usize).max(1);
        base.truncate(n);
    }
    let mut out = Vec::new();
    for shape in SHAPES {
        let mut t = base.clone();
        shape.apply(&mut t, load);
        let mut premium = t.clone();
        premium.requests.retain(|r| r.tier == Tier::Premium);
        for (unloaded, tr) in [(false, t), (true, premium)] {
            let mut tr = tr;
            tr.name = key(&shape, unloaded);
            out.push(Workload {
                key: tr.name.clone(),
                about: format!(
                    "Mooncake with the tier mix, arrivals {}{}, {} requests, 8 servers.",
                    shape.label(),
                    if unloaded { ", premium requests only (unloaded reference)" } else { "" },
                    tr.requests.len()
                ),
                trace: tr,
                servers: 8,
                server: ServerConfig::default(),
                strategies: strategies.to_vec(),
                loads: vec![load],
                topology: (1, 1),
                extras: vec![],
                llm_d_check: false,
                pod_mix: vec![],
                slo: None,
            });
        }
    }
    Ok(out)
}

fn tier_p90(r: &RunResult, tier: &str) -> Option<(f64, usize)> {
    r.tiers.iter().find(|t| t.tier == tier).map(|t| (t.ttft_p90_s, t.rejected))
}

fn runs<'a>(results: &'a [WorkloadResult], key: &str, strategy: &str) -> Vec<&'a RunResult> {
    let mut v: Vec<&RunResult> = results
        .iter()
        .filter(|w| w.key == key)
        .flat_map(|w| w.runs.iter())
        .filter(|r| r.strategy == strategy)
        .collect();
    v.sort_by_key(|r| r.seed);
    v
}

/// One row of the table: a strategy under one arrival shape.
#[derive(Debug, Clone)]
pub struct Row {
    pub strategy: String,
    pub arrivals: String,
    pub bursty: bool,
    pub premium_p90_s: Range,
    pub unloaded_p90_s: Range,
    /// Loaded ÷ unloaded, per seed.
    pub ratio: Range,
    pub premium_rejected: usize,
    pub standard_p90_s: Range,
    pub sheddable_rejected_pct: Range,
}

/// The rows, strategy by strategy and shape by shape.
pub fn rows(results: &[WorkloadResult], strategies: &[Policy]) -> Vec<Row> {
    let mut out = Vec::new();
    for p in strategies {
        let name = p.name();
        for shape in SHAPES {
            let loaded = runs(results, &key(&shape, false), name);
            let idle = runs(results, &key(&shape, true), name);
            let mut prem = Vec::new();
            let mut unl = Vec::new();
            let mut ratio = Vec::new();
            let mut rejected = 0;
            let mut std = Vec::new();
            let mut shed = Vec::new();
            for r in &loaded {
                let Some((p90, rej)) = tier_p90(r, "premium") else { continue };
                prem.push(p90);
                rejected += rej;
                if let Some((s, _)) = tier_p90(r, "standard") {
                    std.push(s);
                }
                if let Some(t) = r.tiers.iter().find(|t| t.tier == "sheddable") {
                    shed.push(100.0 * t.rejected as f64 / (t.rejected + t.finished).max(1) as f64);
                }
                if let Some((u, _)) =
                    idle.iter().find(|u| u.seed == r.seed).and_then(|u| tier_p90(u, "premium"))
                {
                    unl.push(u);
                    ratio.push(p90 / u.max(1e-9));
                }
            }
            if prem.is_empty() {
                continue;
            }
            out.push(Row {
                strategy: name.to_string(),
                arrivals: shape.label(),
                bursty: shape != Arrivals::Plain,
                premium_p90_s: Range::of(&prem),
                unloaded_p90_s: Range::of(&unl),
                ratio: Range::of(&ratio),
                premium_rejected: rejected / loaded.len().max(1),
                standard_p90_s: Range::of(&std),
                sheddable_rejected_pct: Range::of(&shed),
            });
        }
    }
    out
}

fn fr(r: &Range, digits: usize) -> String {
    if (r.max - r.min).abs() < 0.5 * 10f64.powi(-(digits as i32)) {
        format!("{:.*}", digits, r.median)
    } else {
        format!("{:.*} [{:.*}–{:.*}]", digits, r.median, digits, r.min, digits, r.max)
    }
}

/// The study's markdown section: the table, then the verdict for `ours-tiers` with bursts.
pub fn section(rows: &[Row], load: f64, scale: f64, seeds: usize, cmd: &str) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "## Premium under bursts\n\nMooncake, tier mix 20 % premium / 50 % standard / \
         30 % sheddable, 8 servers, load {load} (1.5 × the pool's capacity on this trace), first \
         {:.0} % of the trace, {seeds} seeds; median [min–max]. Unloaded: the same premium \
         requests at the same times with nothing else on the pool; ratio per seed.\n\n`{cmd}`\n\n",
        100.0 * scale.min(1.0)
    ));
    s.push_str(
        "| strategy | arrivals | premium TTFT p90 (s) | unloaded (s) | ratio | premium rejected | \
         standard TTFT p90 (s) | sheddable rejected (%) |\n|---|---|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.strategy,
            r.arrivals,
            fr(&r.premium_p90_s, 2),
            fr(&r.unloaded_p90_s, 2),
            fr(&r.ratio, 2),
            r.premium_rejected,
            fr(&r.standard_p90_s, 2),
            fr(&r.sheddable_rejected_pct, 1),
        ));
    }
    s.push('\n');
    for (line, _) in verdicts(rows) {
        s.push_str(&format!("- {line}\n"));
    }
    s
}

/// One line per bursty shape of `ours-tiers`: met when the median ratio is at most 2.
pub fn verdicts(rows: &[Row]) -> Vec<(String, bool)> {
    rows.iter()
        .filter(|r| r.strategy == Policy::OursTiers.name() && r.bursty)
        .map(|r| {
            let ok = r.ratio.median <= TARGET_RATIO;
            (
                format!(
                    "BURSTS {} arrivals {:?}: premium TTFT p90 {:.2} s vs unloaded {:.2} s, ratio {:.2} \
                     (max over seeds {:.2}; target ≤ {TARGET_RATIO}): {}",
                    r.strategy,
                    r.arrivals,
                    r.premium_p90_s.median,
                    r.unloaded_p90_s.median,
                    r.ratio.median,
                    r.ratio.max,
                    if ok { "met" } else { "NOT met" }
                ),
                ok,
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::TierStat;

    fn run(key: &str, seed: u64, premium: f64) -> RunResult {
        RunResult {
            trace: key.into(),
            strategy: "ours-tiers".into(),
            seed,
            tiers: vec![
                TierStat {
                    tier: "premium".into(),
                    finished: 10,
                    rejected: 0,
                    ttft_p90_s: premium,
                    ..Default::default()
                },
                TierStat {
                    tier: "standard".into(),
                    finished: 10,
                    rejected: 0,
                    ttft_p90_s: 3.0,
                    ..Default::default()
                },
                TierStat {
                    tier: "sheddable".into(),
                    finished: 5,
                    rejected: 5,
                    ttft_p90_s: 9.0,
                    ..Default::default()
                },
            ],
            load: 6.75,
            servers: 8,
            replicas: 1,
            workers: 1,
            poll_ms: 200,
            requests: 25,
            finished: 25,
            rejected: 0,
            unfinished: 0,
            rejections: Default::default(),
            ttft_mean_s: 0.0,
            ttft_p50_s: 0.0,
            ttft_p90_s: 0.0,
            ttft_p99_s: 0.0,
            ttft_p90_strict_s: 0.0,
            e2e_p90_s: 0.0,
            output_tokens_per_s: 0.0,
            goodput_rps: 0.0,
            hit_rate: 0.0,
            hit_rate_vllm_counters: 0.0,
            prediction: None,
            ttft_by_request: vec![],
            rejected_by_request: vec![],
            preemptions: 0,
            per_server: vec![],
            scrape_errors: 0,
            wall_s: 0.0,
        }
    }

    fn result(key: &str, runs: Vec<RunResult>) -> WorkloadResult {
        WorkloadResult {
            key: key.into(),
            about: String::new(),
            requests: 0,
            servers: 8,
            hit_rate_bound: 0.0,
            hit_rate_bound_pooled: 0.0,
            hit_rate_bound_pooled_opt: 0.0,
            runs,
            points: vec![],
        }
    }

    #[test]
    fn ratios_are_per_seed_and_the_verdict_uses_the_median() {
        let mut results = Vec::new();
        for shape in SHAPES {
            // Loaded 1.0, 1.5, 3.0 s against unloaded 0.5 s (seeds 1..3): ratios 2, 3, 6 for
            // the bursty shapes; the plain shape is at 1.0 s everywhere.
            let bursty = shape != Arrivals::Plain;
            let loaded = [1.0, 1.5, 3.0];
            results.push(result(
                &key(&shape, false),
                (1..=3)
                    .map(|s| run(&key(&shape, false), s, if bursty { loaded[s as usize - 1] } else { 1.0 }))
                    .collect(),
            ));
            results
                .push(result(&key(&shape, true), (1..=3).map(|s| run(&key(&shape, true), s, 0.5)).collect()));
        }
        let rows = rows(&results, &[Policy::OursTiers]);
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].ratio.median, 2.0);
        assert_eq!((rows[1].ratio.min, rows[1].ratio.median, rows[1].ratio.max), (2.0, 3.0, 6.0));
        assert_eq!(rows[1].sheddable_rejected_pct.median, 50.0);
        let v = verdicts(&rows);
        assert_eq!(v.len(), 2, "one verdict per bursty shape");
        assert!(v.iter().all(|(line, ok)| !ok && line.contains("NOT met")), "{v:?}");
        let md = section(&rows, 6.75, 0.1, 3, "replay-bench --bursts");
        assert!(
            md.contains("| ours-tiers | grouped 2 s | 1.50 [1.00–3.00] | 0.50 | 3.00 [2.00–6.00] |"),
            "{md}"
        );
    }
}
