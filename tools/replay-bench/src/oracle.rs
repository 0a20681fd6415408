//! The perfect-information picker: the limit for a picker of our kind, and the variants that
//! measure what the gap to it is made of.
//!
//! For each request, every server's exact time to first token if the request were sent there
//! now: a copy of the server model (`model_server_sim::Server`, with its real queue, running
//! batch and cached blocks at this instant) gets the request and runs until its first token. The
//! request goes to the server with the smallest such TTFT (ties at random). No polling, no
//! staleness, no approximation of prefix state; later arrivals are unknown to it, as to any
//! online picker, so this is the greedy choice with exact state, not an optimum over all
//! schedules.
//!
//! **Gap variants** (issue #16, "what the gap to the limit is made of"; each turns one piece of
//! perfect information off, everything else as above):
//! - `oracle-stale` ([`pick_stale`]): the state is polled every 200 ms and seen 20 ms later, as
//!   ours' snapshot is: copies of the servers taken at the scrape, plus the requests the oracle
//!   routed since, queued as of the scrape (as ours adds its in-flight counts to its snapshot).
//!   It evaluates the request as if it arrived at the scrape time, so what it misses is what the
//!   servers did since. Two other definitions were tried and are not measures of staleness:
//!   without its own decisions it sends a whole 200 ms window to one server (Mooncake, quarter
//!   trace, load 4.5: 3.15 s against the oracle's 0.89 s); and simulating the copies forward to
//!   the present with its own decisions reproduces the servers' state exactly, because the server
//!   model is deterministic and the oracle knows every request's output length (Mooncake, full
//!   trace, load 4.5: identical to the oracle, 0.79 s, in every seed).
//! - `oracle-approx-prefix` ([`pick_approx`]): queues, batches and the step model stay exact, but
//!   how much of this prompt a server caches is what an [`ApproxIndex`] of the oracle's own
//!   routing says (an LRU per server of the hash units of the prompts it sent there, as large as
//!   the server's KV; ours' index is the same kind: what was routed where, bounded, no eviction
//!   events). The copy is made to hold exactly that prefix (`Server::assume_cached_prefix`, the
//!   rest of the prompt made to miss), so a stale belief in both directions, hit or miss, costs
//!   what it would.
//! - The third row, the greedy objective, is ours' scoring fed the exact state
//!   (`ours-perfect-state` in `crate::replay`), not a variant of this file.
//!
//! **Cost.** Candidates are tried in order of their waiting queue, and a candidate's simulation
//! stops as soon as it is slower than the best so far (branch and bound); a simulation also stops
//! after `MAX_STEPS` engine steps and counts as that slow.

use model_server_sim::{Event, Server, SimRequest};

use inference_picker::base::ports::{Rng, SplitMix64};

/// Longest simulated look-ahead per candidate, in engine steps.
pub const MAX_STEPS: usize = 20_000;

/// The exact TTFT (ms) of `req` on a copy of `server`, or `None` if it is at least `bound` ms
/// (or the server would reject it).
pub fn ttft_on(
    server: &mut Server,
    req: &SimRequest,
    now: f64,
    bound: f64,
    scratch: &mut Vec<Event>,
) -> Option<f64> {
    server.what_if(|s| ttft_from(s, req.clone(), now, bound, scratch))
}

/// [`ttft_on`] inside a what-if the caller has started (and possibly altered the server in).
fn ttft_from(s: &mut Server, req: SimRequest, now: f64, bound: f64, scratch: &mut Vec<Event>) -> Option<f64> {
    let id = req.id;
    s.submit(req).ok()?;
    for _ in 0..MAX_STEPS {
        let w = s.next_wakeup()?;
        if w - now >= bound {
            return None;
        }
        scratch.clear();
        s.advance_into(w, scratch);
        for e in scratch.iter() {
            match *e {
                Event::FirstToken { id: i, t_ms } if i == id => return Some(t_ms - now),
                Event::Rejected { id: i, .. } if i == id => return None,
                _ => {}
            }
        }
    }
    None
}

/// The server with the smallest exact TTFT for `req` (random among equals); `waiting[i]` orders
/// the candidates (a good first bound makes the rest cheap).
pub fn pick(servers: &mut [Server], req: &SimRequest, now: f64, rng: &mut dyn Rng) -> usize {
    let mut scratch = Vec::new();
    let order = by_waiting(servers);
    pick_by(&order, rng, |i, bound| {
        servers.get_mut(i).and_then(|s| ttft_on(s, req, now, bound, &mut scratch))
    })
}

/// `oracle-stale`: [`pick`] on `copies` of the servers taken at one scrape (never advanced: a
/// what-if puts them back), for `req` as if it arrived at that scrape.
pub fn pick_stale(copies: &mut [Server], req: &SimRequest, rng: &mut dyn Rng) -> usize {
    let mut scratch = Vec::new();
    let order = by_waiting(copies);
    pick_by(&order, rng, |i, bound| {
        let s = copies.get_mut(i)?;
        let at = s.now_ms();
        let then = SimRequest { arrival_ms: at, ..req.clone() };
        ttft_on(s, &then, at, bound, &mut scratch)
    })
}

/// `oracle-approx-prefix`: [`pick`] where server `i`'s cached prefix of this prompt is what
/// `index` predicts, then records the prompt on the chosen server. `units` are the prompt's full
/// hash units (the server's `block_hashes`, cut to whole units).
pub fn pick_approx(
    servers: &mut [Server],
    req: &SimRequest,
    units: &[u64],
    index: &mut ApproxIndex,
    now: f64,
    rng: &mut dyn Rng,
) -> usize {
    let mut scratch = Vec::new();
    let predicted: Vec<usize> = (0..servers.len()).map(|i| index.matched(i, units)).collect();
    let order = by_waiting(servers);
    let chosen = pick_by(&order, rng, |i, bound| {
        let server = servers.get_mut(i)?;
        let m = predicted.get(i).copied().unwrap_or(0);
        server.what_if(|s| {
            let held = s.assume_cached_prefix(&req.block_hashes, m, req.adapter.as_deref());
            // Past the believed prefix the prompt must miss: the same chain, salted.
            let mut believed = req.clone();
            for h in believed.block_hashes.iter_mut().skip(held) {
                *h = SplitMix64::mix(*h ^ MISS_SALT);
            }
            ttft_from(s, believed, now, bound, &mut scratch)
        })
    });
    index.record(chosen, units);
    chosen
}

/// Salt that turns a prompt's hash units into ones no server holds.
const MISS_SALT: u64 = 0x6d69_7373_6d69_7373;

/// The servers' indexes, shortest waiting queue first (stable).
fn by_waiting(servers: &[Server]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..servers.len()).collect();
    let waiting: Vec<u64> = servers.iter().map(|s| s.metrics_snapshot().waiting).collect();
    order.sort_by_key(|&i| waiting[i]);
    order
}

/// Branch and bound over the candidates in `order`: `ttft(i, bound)` is candidate i's TTFT, or
/// None when it is at least `bound`.
fn pick_by(order: &[usize], rng: &mut dyn Rng, mut ttft: impl FnMut(usize, f64) -> Option<f64>) -> usize {
    let mut best = f64::INFINITY;
    let mut ties: Vec<usize> = Vec::new();
    for &i in order {
        // `bound` slightly above the best so that exact ties are seen.
        if let Some(t) = ttft(i, best + 1e-9) {
            if t < best - 1e-9 {
                best = t;
                ties.clear();
                ties.push(i);
            } else {
                ties.push(i);
            }
        }
    }
    if ties.is_empty() {
        // Every candidate is beyond the look-ahead: the shortest queue.
        return order.first().copied().unwrap_or(0);
    }
    ties[rng.below(ties.len())]
}

/// An approximate prefix index of the picker's own routing: per server, an LRU of the hash units
/// of the prompts sent there, `capacity` units each (the server's KV in units). It never hears of
/// the server's evictions; it forgets only by its own LRU.
#[derive(Debug, Clone)]
pub struct ApproxIndex {
    capacity: usize,
    tick: u64,
    /// Per server: unit → last use, and the use order (lazily cleaned).
    last: Vec<hashbrown::HashMap<u64, u64>>,
    order: Vec<std::collections::VecDeque<(u64, u64)>>,
}

impl ApproxIndex {
    pub fn new(servers: usize, capacity: usize) -> Self {
        ApproxIndex {
            capacity: capacity.max(1),
            tick: 0,
            last: vec![hashbrown::HashMap::new(); servers],
            order: vec![std::collections::VecDeque::new(); servers],
        }
    }

    /// Leading units of `units` the index holds for server `i`.
    pub fn matched(&self, i: usize, units: &[u64]) -> usize {
        self.last.get(i).map_or(0, |m| units.iter().take_while(|u| m.contains_key(*u)).count())
    }

    /// Server `i` now holds `units` (most recently used).
    pub fn record(&mut self, i: usize, units: &[u64]) {
        let (Some(last), Some(order)) = (self.last.get_mut(i), self.order.get_mut(i)) else { return };
        for &u in units {
            self.tick += 1;
            last.insert(u, self.tick);
            order.push_back((u, self.tick));
        }
        while last.len() > self.capacity {
            let Some((u, t)) = order.pop_front() else { break };
            if last.get(&u) == Some(&t) {
                last.remove(&u);
            }
        }
        // Drop superseded entries from the front so the order stays O(capacity).
        while order.front().is_some_and(|(u, t)| last.get(u) != Some(t)) {
            order.pop_front();
        }
        if order.len() > 4 * self.capacity {
            order.retain(|(u, t)| last.get(u) == Some(t));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use inference_picker::base::ports::SplitMix64;
    use model_server_sim::ServerConfig;

    fn req(id: u64, prompt: u32, hashes: Vec<u64>, at: f64) -> SimRequest {
        SimRequest {
            id,
            prompt_tokens: prompt,
            block_hashes: hashes,
            output_tokens: 4,
            adapter: None,
            arrival_ms: at,
        }
    }

    /// Two servers: `a` has computed a 4,096-token prompt (256 units, returned) and is idle
    /// again at the returned time; `b` is empty.
    fn a_cached_b_idle() -> (Vec<Server>, Vec<u64>, f64) {
        let cfg = ServerConfig { tokens_per_hash: Some(16), ..Default::default() };
        let mut a = Server::new(cfg.clone()).unwrap();
        let b = Server::new(cfg).unwrap();
        let h: Vec<u64> = (1..=256).collect();
        a.submit(req(1, 4096, h.clone(), 0.0)).unwrap();
        a.advance_to(f64::INFINITY);
        let now = a.now_ms().max(1_000.0);
        a.advance_to(now);
        (vec![a, b], h, now)
    }

    #[test]
    fn picks_the_server_that_caches_the_prompt_and_the_idle_one_otherwise() {
        // Server a has computed a 4,096-token prompt (256 units) and is idle again.
        let (mut servers, h, now) = a_cached_b_idle();
        let mut rng = SplitMix64::new(1);
        // The same prompt: a only computes the last block, b all 4,096 tokens.
        assert_eq!(pick(&mut servers, &req(2, 4096, h, now), now, &mut rng), 0);
        // A long unrelated prompt queued on b makes a the better choice for a fresh prompt too.

        servers[1].submit(req(3, 8000, (1000..1500).collect(), now)).unwrap();
        assert_eq!(pick(&mut servers, &req(4, 2048, (5000..5128).collect(), now), now, &mut rng), 0);
    }

    #[test]
    fn approx_index_is_an_lru_of_its_own_routing() {
        let mut ix = ApproxIndex::new(2, 3);
        ix.record(0, &[1, 2]);
        assert_eq!((ix.matched(0, &[1, 2, 3]), ix.matched(1, &[1, 2])), (2, 0));
        // 1 is touched again, then 7 and 8 push the least recently used unit (2) out.
        ix.record(0, &[1]);
        ix.record(0, &[7, 8]);
        assert_eq!((ix.matched(0, &[1]), ix.matched(0, &[2]), ix.matched(0, &[7, 8])), (1, 0, 2));
    }

    #[test]
    fn the_approximate_oracle_acts_on_its_belief_not_on_the_real_cache() {
        // Server a really caches the 4,096-token prompt, but the index believes b does.
        let (mut servers, h, now) = a_cached_b_idle();
        let mut rng = SplitMix64::new(3);
        assert_eq!(pick(&mut servers, &req(2, 4096, h.clone(), now), now, &mut rng), 0, "exact: a");
        let mut ix = ApproxIndex::new(2, 1_000);
        ix.record(1, &h);
        let chosen = pick_approx(&mut servers, &req(3, 4096, h.clone(), now), &h, &mut ix, now, &mut rng);
        assert_eq!(chosen, 1, "believed: b");
        // The real servers are untouched by the what-if.
        assert_eq!(servers[1].cached_prefix_tokens(&h, 4096, None), 0);
    }
}

#[cfg(test)]
mod what_if_tests {
    use super::*;
    use inference_picker::base::ports::SplitMix64;
    use model_server_sim::ServerConfig;

    /// The oracle's TTFT as it was computed before `Server::what_if`: on a full copy.
    fn ttft_on_copy(server: &Server, req: &SimRequest, now: f64, bound: f64) -> Option<f64> {
        let mut s = server.clone();
        s.submit(req.clone()).ok()?;
        let mut ev = Vec::new();
        for _ in 0..MAX_STEPS {
            let w = s.next_wakeup()?;
            if w - now >= bound {
                return None;
            }
            ev.clear();
            s.advance_into(w, &mut ev);
            for e in &ev {
                match *e {
                    Event::FirstToken { id, t_ms } if id == req.id => return Some(t_ms - now),
                    Event::Rejected { id, .. } if id == req.id => return None,
                    _ => {}
                }
            }
        }
        None
    }

    /// Same seed, same numbers: on a small, tight pool (evictions, preemptions, queues) every
    /// what-if TTFT equals the copy-based one, and servers that ran thousands of what-ifs
    /// produce exactly the events of twins that never ran one.
    #[test]
    fn what_ifs_change_nothing_and_match_copies() {
        let cfg = ServerConfig {
            tokens_per_hash: Some(16),
            num_gpu_blocks: 300,
            max_batch: 16,
            ..Default::default()
        };
        let mut servers: Vec<Server> = (0..3).map(|_| Server::new(cfg.clone()).unwrap()).collect();
        let mut twins = servers.clone();
        let mut rng = SplitMix64::new(7);
        let (mut t, mut ev_a, mut ev_b) = (0.0, Vec::new(), Vec::new());
        for id in 0..70u64 {
            t += 2.0 + rng.next_f64() * 20.0;
            // Ten shared prefixes of 512 tokens plus a private tail.
            let group = rng.below(10) as u64;
            let prompt = 600 + rng.below(1500) as u32;
            let units = prompt as usize / 16;
            let hashes: Vec<u64> =
                (0..units as u64).map(|u| if u < 32 { group * 1000 + u } else { id * 100_000 + u }).collect();
            let req = SimRequest {
                id,
                prompt_tokens: prompt,
                block_hashes: hashes,
                output_tokens: 1 + rng.below(400) as u32,
                adapter: None,
                arrival_ms: t,
            };
            for (s, w) in servers.iter_mut().zip(twins.iter_mut()) {
                s.advance_into(t, &mut ev_a);
                w.advance_into(t, &mut ev_b);
            }
            let mut scratch = Vec::new();
            for i in 0..servers.len() {
                let reference = ttft_on_copy(&twins[i], &req, t, f64::INFINITY);
                assert_eq!(ttft_on(&mut servers[i], &req, t, f64::INFINITY, &mut scratch), reference);
                // The journal alone, whatever the queue (`what_if` may have copied).
                let journaled = servers[i]
                    .what_if_journaled(|s| ttft_from(s, req.clone(), t, f64::INFINITY, &mut scratch));
                assert_eq!(journaled, reference);
            }
            let chosen = pick(&mut servers, &req, t, &mut rng);
            servers[chosen].submit(req.clone()).unwrap();
            twins[chosen].submit(req).unwrap();
        }
        for (s, w) in servers.iter_mut().zip(twins.iter_mut()) {
            s.advance_into(f64::INFINITY, &mut ev_a);
            w.advance_into(f64::INFINITY, &mut ev_b);
        }
        assert_eq!(ev_a, ev_b);
        assert!(ev_a.iter().any(|e| matches!(e, Event::Preempted { .. })), "the pool was tight");
        let evicted: u64 = servers.iter().map(|s| s.metrics_snapshot().evicted_units).sum();
        assert!(evicted > 0, "the caches evicted");
    }
}
