//! The perfect-information picker: the limit for a picker of our kind.
//!
//! For each request, every server's exact time to first token if the request were sent there
//! now: a copy of the server model (`model_server_sim::Server`, with its real queue, running
//! batch and cached blocks at this instant) gets the request and runs until its first token. The
//! request goes to the server with the smallest such TTFT (ties at random). No polling, no
//! staleness, no approximation of prefix state; later arrivals are unknown to it, as to any
//! online picker, so this is the greedy choice with exact state, not an optimum over all
//! schedules.
//!
//! **Cost.** Candidates are tried in order of their waiting queue, and a candidate's simulation
//! stops as soon as it is slower than the best so far (branch and bound); a simulation also stops
//! after `MAX_STEPS` engine steps and counts as that slow.

use model_server_sim::{Event, Server, SimRequest};

use inference_picker::ports::Rng;

/// Longest simulated look-ahead per candidate, in engine steps.
pub const MAX_STEPS: usize = 20_000;

/// The exact TTFT (ms) of `req` on a copy of `server`, or `None` if it is at least `bound` ms
/// (or the server would reject it).
pub fn ttft_on(
    server: &Server,
    req: &SimRequest,
    now: f64,
    bound: f64,
    scratch: &mut Vec<Event>,
) -> Option<f64> {
    let mut s = server.clone();
    s.submit(req.clone()).ok()?;
    for _ in 0..MAX_STEPS {
        let w = s.next_wakeup()?;
        if w - now >= bound {
            return None;
        }
        scratch.clear();
        s.advance_into(w, scratch);
        for e in scratch.iter() {
            match *e {
                Event::FirstToken { id, t_ms } if id == req.id => return Some(t_ms - now),
                Event::Rejected { id, .. } if id == req.id => return None,
                _ => {}
            }
        }
    }
    None
}

/// The server with the smallest exact TTFT for `req` (random among equals); `waiting[i]` orders
/// the candidates (a good first bound makes the rest cheap).
pub fn pick(servers: &[Server], req: &SimRequest, now: f64, rng: &mut dyn Rng) -> usize {
    let mut order: Vec<usize> = (0..servers.len()).collect();
    let waiting: Vec<u64> = servers.iter().map(|s| s.metrics_snapshot().waiting).collect();
    order.sort_by_key(|&i| waiting[i]);
    let mut scratch = Vec::new();
    let mut best = f64::INFINITY;
    let mut ties: Vec<usize> = Vec::new();
    for &i in &order {
        // `bound` slightly above the best so that exact ties are seen.
        if let Some(t) = ttft_on(&servers[i], req, now, best + 1e-9, &mut scratch) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use inference_picker::ports::SplitMix64;
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

    #[test]
    fn picks_the_server_that_caches_the_prompt_and_the_idle_one_otherwise() {
        let cfg = ServerConfig { tokens_per_hash: Some(16), ..Default::default() };
        let mut a = Server::new(cfg.clone()).unwrap();
        let b = Server::new(cfg).unwrap();
        // Server a has computed a 4,096-token prompt (256 units) and is idle again.
        let h: Vec<u64> = (1..=256).collect();
        a.submit(req(1, 4096, h.clone(), 0.0)).unwrap();
        a.advance_to(f64::INFINITY);
        let now = a.now_ms().max(1_000.0);
        a.advance_to(now);
        let servers = vec![a, b];
        let mut rng = SplitMix64::new(1);
        // The same prompt: a only computes the last block, b all 4,096 tokens.
        assert_eq!(pick(&servers, &req(2, 4096, h, now), now, &mut rng), 0);
        // A long unrelated prompt queued on b makes a the better choice for a fresh prompt too.
        let mut servers = servers;
        servers[1].submit(req(3, 8000, (1000..1500).collect(), now)).unwrap();
        assert_eq!(pick(&servers, &req(4, 2048, (5000..5128).collect(), now), now, &mut rng), 0);
    }
}
