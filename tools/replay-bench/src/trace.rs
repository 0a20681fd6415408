//! Workloads: the two trace formats (Mooncake JSONL, Azure CSV, each optionally gzipped) and the
//! synthetic generators (llm-d's shared-prefix shape), plus the LoRA and SLA-tier mixes.
//!
//! A [`Trace`] is a list of [`Request`]s in arrival order with lengths in tokens and a
//! [`Content`] that says how to build the prompt text (see `text`). Load is applied later, by
//! dividing arrival times by the load factor.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use inference_picker::base::ports::{Rng, SplitMix64};
use serde::Deserialize;

/// How a request's prompt text is built (see `text::messages`).
#[derive(Debug, Clone, PartialEq)]
pub enum Content {
    /// Mooncake: 512-token blocks named by chained ids.
    Blocks(Vec<u32>),
    /// Text unique to this request (lengths-only traces).
    Unique,
    /// Synthetic shared prefix: the system prompt of `group`, then the question of `user` in it.
    Shared { group: u32, user: u32 },
}

/// SLA tier label (the `x-gateway-inference-objective` a client would send).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    Premium,
    Standard,
    Sheddable,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Premium, Tier::Standard, Tier::Sheddable];
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Premium => "premium",
            Tier::Standard => "standard",
            Tier::Sheddable => "sheddable",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Arrival at load 1, ms from the start of the trace.
    pub arrival_ms: f64,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    pub content: Content,
    /// LoRA adapter index (`lora-<i>`), None for the base model.
    pub adapter: Option<u16>,
    pub tier: Tier,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    pub name: String,
    pub requests: Vec<Request>,
    /// Tokens per server prefix-cache hash unit (512 for Mooncake, as its ids; 16 otherwise,
    /// one per vLLM KV block).
    pub tokens_per_hash: u32,
    /// (system, question) tokens for `Content::Shared`.
    pub shared_shape: Option<(u32, u32)>,
    /// Number of LoRA adapters requests may name (0: none).
    pub adapters: u16,
}

impl Trace {
    pub fn has_tiers(&self) -> bool {
        self.requests.iter().any(|r| r.tier != Tier::Standard)
    }

    /// Arrival span at load 1, seconds.
    pub fn span_s(&self) -> f64 {
        match (self.requests.first(), self.requests.last()) {
            (Some(a), Some(b)) => (b.arrival_ms - a.arrival_ms) / 1000.0,
            _ => 0.0,
        }
    }

    /// Keeps the first `n` requests.
    pub fn truncate(&mut self, n: usize) {
        self.requests.truncate(n);
    }
}

fn open(path: &Path) -> Result<Box<dyn Read>, String> {
    let f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if path.extension().is_some_and(|e| e == "gz") {
        Ok(Box::new(flate2::read::GzDecoder::new(f)))
    } else {
        Ok(Box::new(f))
    }
}

/// Name of a trace file without directories and `.gz`/`.jsonl`/`.csv` extensions.
pub fn stem(path: &Path) -> String {
    let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let mut s = name.as_str();
    for ext in [".gz", ".jsonl", ".csv"] {
        s = s.strip_suffix(ext).unwrap_or(s);
    }
    s.to_string()
}

/// Loads a Mooncake JSONL or Azure CSV trace, by content: a first line starting with `{` is
/// Mooncake, else a CSV header with `TIMESTAMP,ContextTokens,GeneratedTokens`.
pub fn load(path: &Path) -> Result<Trace, String> {
    let mut r = BufReader::new(open(path)?);
    let mut first = String::new();
    r.read_line(&mut first).map_err(|e| format!("{}: {e}", path.display()))?;
    let name = stem(path);
    if first.trim_start().starts_with('{') {
        parse_mooncake(&name, first, r)
    } else {
        parse_azure(&name, &first, r)
    }
}

#[derive(Deserialize)]
struct MooncakeRow {
    timestamp: f64,
    input_length: u32,
    output_length: u32,
    #[serde(default)]
    hash_ids: Vec<u32>,
}

fn parse_mooncake(name: &str, first: String, r: impl BufRead) -> Result<Trace, String> {
    let mut requests = Vec::new();
    let lines = std::iter::once(Ok(first)).chain(r.lines());
    for (i, line) in lines.enumerate() {
        let line = line.map_err(|e| format!("line {}: {e}", i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let row: MooncakeRow = serde_json::from_str(&line).map_err(|e| format!("line {}: {e}", i + 1))?;
        requests.push(Request {
            arrival_ms: row.timestamp,
            prompt_tokens: row.input_length.max(1),
            output_tokens: row.output_length.max(1),
            content: Content::Blocks(row.hash_ids),
            adapter: None,
            tier: Tier::Standard,
        });
    }
    finish(name, requests, 512)
}

fn parse_azure(name: &str, header: &str, r: impl BufRead) -> Result<Trace, String> {
    let cols: Vec<&str> = header.trim().split(',').map(str::trim).collect();
    let col = |n: &str| cols.iter().position(|c| c.eq_ignore_ascii_case(n));
    let (Some(ts), Some(ctx), Some(gen)) = (col("TIMESTAMP"), col("ContextTokens"), col("GeneratedTokens"))
    else {
        return Err(format!(
            "not a Mooncake JSONL line nor an Azure CSV header (TIMESTAMP,ContextTokens,GeneratedTokens): {:?}",
            header.trim()
        ));
    };
    let mut requests = Vec::new();
    let mut t0: Option<f64> = None;
    for (i, line) in r.lines().enumerate() {
        let line = line.map_err(|e| format!("line {}: {e}", i + 2))?;
        if line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        let get = |c: usize| f.get(c).copied().ok_or_else(|| format!("line {}: missing column {c}", i + 2));
        let t = parse_timestamp_ms(get(ts)?).ok_or_else(|| format!("line {}: bad timestamp", i + 2))?;
        let base = *t0.get_or_insert(t);
        let p: u32 = get(ctx)?.parse().map_err(|e| format!("line {}: ContextTokens: {e}", i + 2))?;
        let o: u32 = get(gen)?.parse().map_err(|e| format!("line {}: GeneratedTokens: {e}", i + 2))?;
        requests.push(Request {
            arrival_ms: t - base,
            prompt_tokens: p.max(1),
            output_tokens: o.max(1),
            content: Content::Unique,
            adapter: None,
            tier: Tier::Standard,
        });
    }
    finish(name, requests, 16)
}

fn finish(name: &str, mut requests: Vec<Request>, tokens_per_hash: u32) -> Result<Trace, String> {
    if requests.is_empty() {
        return Err("trace has no requests".into());
    }
    // Stable: rows with equal timestamps keep file order.
    requests.sort_by(|a, b| a.arrival_ms.total_cmp(&b.arrival_ms));
    let t0 = requests.first().map_or(0.0, |r| r.arrival_ms);
    for r in &mut requests {
        r.arrival_ms -= t0;
    }
    Ok(Trace { name: name.to_string(), requests, tokens_per_hash, shared_shape: None, adapters: 0 })
}

/// `YYYY-MM-DD HH:MM:SS[.fraction]` (or with `T`) → ms since the Unix epoch (UTC, no zone).
pub fn parse_timestamp_ms(s: &str) -> Option<f64> {
    let s = s.trim().trim_matches('"');
    let (date, time) = s.split_once([' ', 'T'])?;
    let mut d = date.split('-');
    let y: i64 = d.next()?.parse().ok()?;
    let m: i64 = d.next()?.parse().ok()?;
    let day: i64 = d.next()?.parse().ok()?;
    let mut t = time.trim_end_matches('Z').split(':');
    let hh: f64 = t.next()?.parse().ok()?;
    let mm: f64 = t.next()?.parse().ok()?;
    let ss: f64 = t.next()?.parse().ok()?;
    // Days from civil (Howard Hinnant's algorithm).
    let y2 = if m <= 2 { y - 1 } else { y };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((days as f64 * 86_400.0 + hh * 3600.0 + mm * 60.0 + ss) * 1000.0)
}

/// An exponential draw with the given mean (the generators' seeded source is SplitMix64).
fn exp(g: &mut impl Rng, mean: f64) -> f64 {
    -mean * (1.0 - g.next_f64()).ln()
}

/// llm-d's shared-prefix workload (inference-perf `shared_prefix`): `groups` × `users`
/// prompts, each a system prompt of `system_tokens` shared by its group plus a question of
/// `question_tokens` fixed per user, `output_tokens` out; Poisson arrivals in stages of
/// (rate per second, duration in seconds); each arrival picks a (group, user) at random.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedPrefixShape {
    pub groups: u32,
    pub users: u32,
    pub system_tokens: u32,
    pub question_tokens: u32,
    pub output_tokens: u32,
    pub stages: Vec<(f64, f64)>,
}

impl SharedPrefixShape {
    /// The published llm-d run: 150 groups × 5 users, 6,000 + 1,200 tokens in, a warm-up of 15/s
    /// for 50 s, then a ladder from 3/s to 60/s. Its configuration asks for 1,000 output tokens,
    /// but its own summary (8,730 output tokens/s at 35.6 requests/s for the precise scheduler,
    /// 4,429 at 35.7 for random) shows about 245 tokens per request were produced, and its
    /// configuration comment says "observed live ≈ 200–230 tokens/running request"; 1,000 would
    /// be 35k tokens/s, which its pods never reached. 250 reproduces the published load.
    pub fn llm_d() -> Self {
        SharedPrefixShape {
            groups: 150,
            users: 5,
            system_tokens: 6000,
            question_tokens: 1200,
            output_tokens: 250,
            stages: vec![
                (15.0, 50.0),
                (3.0, 20.0),
                (10.0, 20.0),
                (15.0, 20.0),
                (20.0, 38.0),
                (22.0, 34.0),
                (25.0, 30.0),
                (30.0, 25.0),
                (35.0, 21.0),
                (40.0, 38.0),
                (43.0, 36.0),
                (46.0, 33.0),
                (49.0, 30.0),
                (52.0, 29.0),
                (55.0, 27.0),
                (57.0, 26.0),
                (60.0, 25.0),
            ],
        }
    }
}

pub fn shared_prefix(name: &str, shape: &SharedPrefixShape, seed: u64) -> Trace {
    let mut g = SplitMix64::new(seed);
    let mut requests = Vec::new();
    let mut stage_start = 0.0;
    for &(rate, dur) in &shape.stages {
        let end = stage_start + dur * 1000.0;
        let mut t = stage_start;
        if rate > 0.0 {
            loop {
                t += exp(&mut g, 1000.0 / rate);
                if t >= end {
                    break;
                }
                requests.push(Request {
                    arrival_ms: t,
                    prompt_tokens: shape.system_tokens + shape.question_tokens,
                    output_tokens: shape.output_tokens,
                    content: Content::Shared {
                        group: g.below(shape.groups as usize) as u32,
                        user: g.below(shape.users as usize) as u32,
                    },
                    adapter: None,
                    tier: Tier::Standard,
                });
            }
        }
        stage_start = end;
    }
    Trace {
        name: name.to_string(),
        requests,
        tokens_per_hash: 16,
        shared_shape: Some((shape.system_tokens, shape.question_tokens)),
        adapters: 0,
    }
}

/// Multi-LoRA mix: `base_share` of requests use the base model; the rest name one of `adapters`
/// adapters with Zipf(1) popularity (adapter i has weight 1/(i+1)).
pub fn assign_adapters(trace: &mut Trace, adapters: u16, base_share: f64, seed: u64) {
    let mut g = SplitMix64::new(seed);
    let weights: Vec<f64> = (0..adapters).map(|i| 1.0 / f64::from(i + 1)).collect();
    let total: f64 = weights.iter().sum();
    for r in &mut trace.requests {
        if adapters == 0 || g.next_f64() < base_share {
            r.adapter = None;
            continue;
        }
        let mut x = g.next_f64() * total;
        let mut pick = adapters - 1;
        for (i, w) in weights.iter().enumerate() {
            x -= w;
            if x < 0.0 {
                pick = i as u16;
                break;
            }
        }
        r.adapter = Some(pick);
    }
    trace.adapters = adapters;
}

/// SLA-tier mix: premium, standard and sheddable in the given shares (the rest sheddable).
pub fn assign_tiers(trace: &mut Trace, premium: f64, standard: f64, seed: u64) {
    let mut g = SplitMix64::new(seed);
    for r in &mut trace.requests {
        let x = g.next_f64();
        r.tier = if x < premium {
            Tier::Premium
        } else if x < premium + standard {
            Tier::Standard
        } else {
            Tier::Sheddable
        };
    }
}

/// Moves each request's arrival later by a uniform `[0, window_ms)` draw, then re-sorts by
/// arrival (stable). For a trace whose timestamps are on a coarse grid (Mooncake's
/// conversation trace: every ~3 s, ~10 requests in the same millisecond), `window_ms` = the grid
/// step spreads each group over its step instead of delivering it as one burst. A study option
/// (`--spread-arrivals-ms`), off by default: the default set replays the trace as recorded.
pub fn spread_arrivals(trace: &mut Trace, window_ms: f64, seed: u64) {
    if window_ms <= 0.0 {
        return;
    }
    let mut g = SplitMix64::new(seed);
    for r in &mut trace.requests {
        r.arrival_ms += g.next_f64() * window_ms;
    }
    trace.requests.sort_by(|a, b| a.arrival_ms.total_cmp(&b.arrival_ms));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_arrivals_spreads_a_burst_within_its_window_and_keeps_order() {
        let req = |t: f64, p: u32| Request {
            arrival_ms: t,
            prompt_tokens: p,
            output_tokens: 1,
            content: Content::Unique,
            adapter: None,
            tier: Tier::Standard,
        };
        let mut t = Trace {
            name: "grid".into(),
            requests: (0..40).map(|i| req(f64::from(i / 10) * 3000.0, i)).collect(),
            tokens_per_hash: 16,
            shared_shape: None,
            adapters: 0,
        };
        spread_arrivals(&mut t, 3000.0, 7);
        let times: Vec<f64> = t.requests.iter().map(|r| r.arrival_ms).collect();
        assert!(times.windows(2).all(|w| w[0] <= w[1]), "sorted by arrival");
        // Every request stays within its own 3 s step, and the bursts are gone.
        for r in &t.requests {
            let step = f64::from(r.prompt_tokens / 10) * 3000.0;
            assert!(r.arrival_ms >= step && r.arrival_ms < step + 3000.0, "{} in step {step}", r.arrival_ms);
        }
        let mut distinct = times.clone();
        distinct.dedup();
        assert_eq!(distinct.len(), 40);
        // A zero window changes nothing.
        let before = t.clone();
        spread_arrivals(&mut t, 0.0, 7);
        assert_eq!(t, before);
    }

    #[test]
    fn timestamps() {
        // 2023-11-16 is 19677 days after 1970-01-01.
        let t = parse_timestamp_ms("2023-11-16 18:15:46.6805900").unwrap();
        let expect = (19_677.0 * 86_400.0 + 18.0 * 3600.0 + 15.0 * 60.0 + 46.68059) * 1000.0;
        assert!((t - expect).abs() < 1e-3, "{t} {expect}");
        // Across midnight: one second apart.
        let a = parse_timestamp_ms("2023-11-16 23:59:59.5").unwrap();
        let b = parse_timestamp_ms("2023-11-17 00:00:00.5").unwrap();
        assert!((b - a - 1000.0).abs() < 1e-6);
        assert_eq!(parse_timestamp_ms("garbage"), None);
    }

    #[test]
    fn parses_both_formats() {
        let dir = std::env::temp_dir().join(format!("replay-bench-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let m = dir.join("m.jsonl");
        std::fs::write(
            &m,
            "{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [0, 1]}\n\
             {\"timestamp\": 2, \"input_length\": 10, \"output_length\": 0, \"hash_ids\": [2]}\n",
        )
        .unwrap();
        let t = load(&m).unwrap();
        // Sorted by time and shifted to start at 0; output 0 becomes 1.
        assert_eq!(t.requests.len(), 2);
        assert_eq!((t.requests[0].arrival_ms, t.requests[1].arrival_ms), (0.0, 3.0));
        assert_eq!(t.requests[0].output_tokens, 1);
        assert_eq!(t.requests[1].content, Content::Blocks(vec![0, 1]));
        assert_eq!(t.tokens_per_hash, 512);
        let a = dir.join("a.csv");
        std::fs::write(&a, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.5,374,44\n2023-11-16 18:15:47.0,396,109\n").unwrap();
        let t = load(&a).unwrap();
        assert_eq!(t.requests.len(), 2);
        assert!((t.requests[1].arrival_ms - 500.0).abs() < 1e-6);
        assert_eq!((t.requests[1].prompt_tokens, t.requests[1].output_tokens), (396, 109));
        let bad = dir.join("b.csv");
        std::fs::write(&bad, "a,b\n1,2\n").unwrap();
        assert!(load(&bad).unwrap_err().contains("Azure CSV header"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn shared_prefix_rates() {
        // One stage of 10/s for 100 s: ~1000 Poisson arrivals (seeded, so exact per seed).
        let shape = SharedPrefixShape {
            groups: 3,
            users: 2,
            system_tokens: 100,
            question_tokens: 10,
            output_tokens: 5,
            stages: vec![(10.0, 100.0)],
        };
        let t = shared_prefix("s", &shape, 1);
        assert!((900..1100).contains(&t.requests.len()), "{}", t.requests.len());
        assert!(t.requests.windows(2).all(|w| w[0].arrival_ms <= w[1].arrival_ms));
        assert!(t
            .requests
            .iter()
            .all(|r| matches!(r.content, Content::Shared { group, user } if group < 3 && user < 2)));
    }

    #[test]
    fn mixes() {
        let mut t = shared_prefix(
            "s",
            &SharedPrefixShape {
                groups: 1,
                users: 1,
                system_tokens: 1,
                question_tokens: 1,
                output_tokens: 1,
                stages: vec![(100.0, 100.0)],
            },
            2,
        );
        assign_adapters(&mut t, 4, 0.25, 3);
        let base = t.requests.iter().filter(|r| r.adapter.is_none()).count() as f64 / t.requests.len() as f64;
        assert!((0.2..0.3).contains(&base), "{base}");
        // Zipf: adapter 0 (weight 1) about 4× adapter 3 (weight 1/4).
        let c = |i| t.requests.iter().filter(|r| r.adapter == Some(i)).count() as f64;
        assert!(c(0) > 2.5 * c(3), "{} {}", c(0), c(3));
        assign_tiers(&mut t, 0.2, 0.5, 4);
        let p =
            t.requests.iter().filter(|r| r.tier == Tier::Premium).count() as f64 / t.requests.len() as f64;
        assert!((0.15..0.25).contains(&p), "{p}");
        assert!(t.has_tiers());
    }
}
