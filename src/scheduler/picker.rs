//! Picker: turns total scores into an ordered list, primary first, then fallbacks.
//!
//! - Ranking: candidates sorted by total score, best first (stable: equal totals keep candidate
//!   order), keeping only the first `max(top_k, 1 + fallbacks)` — an O(n·m) partial selection,
//!   cheaper than a full sort for 1024 endpoints.
//! - Primary, `top_k == 1` (default): the best total; every candidate within `tie_epsilon` of it
//!   is a tie, and one is chosen uniformly with the seeded [`Rng`]. Independent gateways (and
//!   Envoy workers) with the same view would otherwise all send to the same "best" endpoint.
//! - Primary, `top_k > 1`: a weighted-random choice among the best `top_k`, with probability
//!   proportional to the total score (uniform if every total is 0).
//! - Fallbacks: the next best in ranking order, the primary excluded.
//!
//! Inputs must be finite; a NaN total (which a scorer never produces) ranks last.

use crate::base::num;
use crate::base::ports::Rng;

fn key(t: f64) -> f64 {
    if t.is_nan() {
        f64::NEG_INFINITY
    } else {
        t
    }
}

fn total(totals: &[f64], i: usize) -> f64 {
    totals.get(i).copied().map(key).unwrap_or(f64::NEG_INFINITY)
}

/// Indices of the `m` best totals, best first; equal totals keep index order.
pub fn top_m(totals: &[f64], m: usize) -> Vec<usize> {
    let mut best: Vec<usize> = Vec::with_capacity(m + 1);
    if m == 0 {
        return best;
    }
    for (i, &t) in totals.iter().enumerate() {
        let t = key(t);
        if best.len() == m && best.last().is_some_and(|&l| total(totals, l) >= t) {
            continue;
        }
        // First position whose total is strictly lower: equal totals stay in index order.
        let pos = best.iter().position(|&b| total(totals, b) < t).unwrap_or(best.len());
        best.insert(pos, i);
        best.truncate(m);
    }
    best
}

/// Returns candidate indices: the primary, then up to `fallbacks` more. Empty when `totals` is.
pub fn order(
    totals: &[f64],
    tie_epsilon: f64,
    top_k: usize,
    fallbacks: usize,
    rng: &mut dyn Rng,
) -> Vec<usize> {
    let ranked = top_m(totals, top_k.max(1 + fallbacks));
    let Some(&first) = ranked.first() else {
        return Vec::new();
    };
    let primary = if top_k <= 1 {
        let best = total(totals, first);
        let ties: Vec<usize> =
            (0..totals.len()).filter(|&i| total(totals, i) >= best - tie_epsilon).collect();
        ties.get(rng.below(ties.len())).copied().unwrap_or(first)
    } else {
        let pool: Vec<usize> = ranked.iter().copied().take(top_k).collect();
        let sum: f64 = pool.iter().map(|&i| num::max(total(totals, i), 0.0)).sum();
        if sum > 0.0 {
            let mut r = rng.next_f64() * sum;
            let mut chosen = first;
            for &i in &pool {
                chosen = i;
                r -= num::max(total(totals, i), 0.0);
                if r < 0.0 {
                    break;
                }
            }
            chosen
        } else {
            pool.get(rng.below(pool.len())).copied().unwrap_or(first)
        }
    };
    let mut out = Vec::with_capacity(1 + fallbacks);
    out.push(primary);
    out.extend(ranked.into_iter().filter(|&i| i != primary).take(fallbacks));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::ports::SplitMix64;

    #[test]
    fn top_m_is_stable_and_partial() {
        assert_eq!(top_m(&[1.0, 3.0, 2.0, 3.0], 3), vec![1, 3, 2]);
        assert_eq!(top_m(&[1.0, 3.0, 2.0, 3.0], 10), vec![1, 3, 2, 0]);
        assert_eq!(top_m(&[1.0, f64::NAN, 2.0], 3), vec![2, 0, 1]);
        assert_eq!(top_m(&[1.0], 0), Vec::<usize>::new());
    }

    #[test]
    fn clear_winner_and_fallbacks() {
        let mut rng = SplitMix64::new(1);
        // 5.0 is 2.0 above the next: no tie. Fallbacks 4.0 (idx 2) then 3.0 (idx 0).
        assert_eq!(order(&[3.0, 5.0, 4.0, 1.0], 0.001, 1, 2, &mut rng), vec![1, 2, 0]);
        // Fewer candidates than fallbacks asked for.
        assert_eq!(order(&[3.0, 5.0], 0.001, 1, 4, &mut rng), vec![1, 0]);
        assert_eq!(order(&[], 0.001, 1, 2, &mut rng), Vec::<usize>::new());
    }

    #[test]
    fn ties_are_broken_by_seeded_random_and_cover_all_tied() {
        // Indices 0, 2 and 3 are within 0.001 of 7.0; index 1 is not (6.5).
        let totals = [7.0, 6.5, 6.9995, 7.0];
        let mut seen = [0usize; 4];
        let mut rng = SplitMix64::new(42);
        for _ in 0..300 {
            let o = order(&totals, 0.001, 1, 0, &mut rng);
            seen[o[0]] += 1;
        }
        assert_eq!(seen[1], 0);
        // Each tied index wins at least once in 300 seeded draws (deterministic for seed 42).
        assert!(seen[0] > 0 && seen[2] > 0 && seen[3] > 0, "{seen:?}");
        // Same seed, same decision.
        let a = order(&totals, 0.001, 1, 2, &mut SplitMix64::new(9));
        let b = order(&totals, 0.001, 1, 2, &mut SplitMix64::new(9));
        assert_eq!(a, b);
    }

    #[test]
    fn top_k_weighted_random_stays_in_top_k() {
        // top_k 2 over [1, 4, 0, 3]: pool is {1 (4.0), 3 (3.0)}, p = 4/7 and 3/7; 0 and 2 never.
        let totals = [1.0, 4.0, 0.0, 3.0];
        let mut rng = SplitMix64::new(3);
        let mut seen = [0usize; 4];
        for _ in 0..200 {
            seen[order(&totals, 0.001, 2, 0, &mut rng)[0]] += 1;
        }
        assert_eq!((seen[0], seen[2]), (0, 0));
        assert!(seen[1] > 0 && seen[3] > 0, "{seen:?}");
        // All-zero totals: uniform over the pool, still only the top 2 (indices 0 and 1).
        let mut seen = [0usize; 3];
        for _ in 0..100 {
            seen[order(&[0.0, 0.0, 0.0], 0.001, 2, 0, &mut rng)[0]] += 1;
        }
        assert_eq!(seen[2], 0);
    }

    #[test]
    fn primary_is_not_repeated_in_fallbacks() {
        let mut rng = SplitMix64::new(5);
        for _ in 0..50 {
            let o = order(&[1.0, 1.0, 1.0, 1.0], 0.001, 1, 3, &mut rng);
            let mut s = o.clone();
            s.sort();
            s.dedup();
            assert_eq!(s.len(), 4);
        }
    }
}
