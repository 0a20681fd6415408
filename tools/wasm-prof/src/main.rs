//! The scheduler bench's `decision/pick_only_repeat_32k` case as a plain loop, so the same pick
//! can be timed natively and inside a wasm runtime (V8 under Node, as in Envoy) and the two
//! compared.
//!
//! ```text
//! cargo run --release -p wasm-prof -- 128 20000
//! cargo build --release -p wasm-prof --target wasm32-wasip1
//! node tools/wasm-prof/run.mjs target/wasm32-wasip1/release/pick-loop.wasm 128 20000
//! ```
//!
//! `--profile bench` instead of `--release` keeps the name section, so that
//! `node --cpu-prof` shows Rust function names.
//!
//! Arguments: endpoints (default 128) and picks (default 20,000). It prints one line,
//! `PICK_LOOP endpoints=<n> picks=<k> ns_per_pick=<x> store_gets=<g> store_sets=<s>
//! store_bytes=<b>`, timed after a warm-up of a tenth of the picks; the store figures are per
//! pick (in Envoy each is a host call, the bytes cross the VM boundary). The clock is
//! `std::time::Instant` (WASI's monotonic clock under wasm).

use std::time::Instant;

use std::cell::Cell;

use inference_picker::base::ports::{MemStore, SharedStore, SplitMix64, StoreError};
use inference_picker::request::body::parse_request;
use inference_picker::scheduler::{PickRequest, Scheduler};

#[path = "../../../benches/fixture/mod.rs"]
#[allow(dead_code)]
mod fixture;
use fixture::{body_32k, config, pick, snapshot, PATH};

/// A [`MemStore`] that counts what a pick asks of the shared store: in Envoy each `get` and
/// `set` is a host call that copies the value across the VM boundary.
#[derive(Default)]
struct Counting {
    inner: MemStore,
    gets: Cell<u64>,
    sets: Cell<u64>,
    bytes: Cell<u64>,
}

impl SharedStore for Counting {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        let got = self.inner.get(key)?;
        self.gets.set(self.gets.get() + 1);
        self.bytes.set(self.bytes.get() + got.as_ref().map_or(0, |(v, _)| v.len() as u64));
        Ok(got)
    }
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        self.sets.set(self.sets.get() + 1);
        self.bytes.set(self.bytes.get() + value.len() as u64);
        self.inner.set(key, value, cas)
    }
}

fn arg(i: usize, default: usize) -> usize {
    std::env::args().nth(i).and_then(|a| a.parse().ok()).unwrap_or(default)
}

fn main() {
    let n = arg(1, 128);
    let picks = arg(2, 20_000).max(10);
    let (snap, inflight) = snapshot(n);
    let body = body_32k();
    let p = parse_request(PATH, &body).expect("the fixture body parses");
    let store = Counting { inner: MemStore::new(), ..Default::default() };
    let mut sched = Scheduler::new(&config());
    let mut rng = SplitMix64::new(1);
    let mut run = |k: usize| {
        let mut sum = 0usize;
        for _ in 0..k {
            let r = PickRequest {
                model: &p.model,
                prompt: std::hint::black_box(&p.prompt),
                cache_salt: None,
                session_id: None,
                session_token: None,
                slo: None,
            };
            let got = pick(&mut sched, &r, &snap, &inflight, &store, &mut rng);
            sum = sum.wrapping_add(got.primary.len());
            sched.request_done(got.ticket);
        }
        sum
    };
    std::hint::black_box(run(picks / 10));
    let (g0, s0, b0) = (store.gets.get(), store.sets.get(), store.bytes.get());
    #[allow(clippy::disallowed_methods)] // the benchmark's own clock: the pick takes no time source
    let t = Instant::now();
    std::hint::black_box(run(picks));
    let ns = t.elapsed().as_nanos() as f64 / picks as f64;
    let per = |now: u64, then: u64| (now - then) as f64 / picks as f64;
    println!(
        "PICK_LOOP endpoints={n} picks={picks} ns_per_pick={ns:.0} store_gets={:.1} store_sets={:.1} store_bytes={:.0}",
        per(store.gets.get(), g0),
        per(store.sets.get(), s0),
        per(store.bytes.get(), b0)
    );
}
