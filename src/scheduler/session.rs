//! Session affinity: keep a session on one endpoint, statelessly.
//!
//! Two inputs, both soft (the hot-spot guard and health always win):
//!
//! 1. Session id (request header, default `x-session-id`). Rendezvous (highest-random-weight)
//!    hashing: `w(e) = xxh3_64(session_id, seed = xxh3_64(address(e)))`; the eligible candidate
//!    with the highest `w` scores 1.0, every other 0.0. Eligible = healthy and not overloaded
//!    (see `guard`). Every worker, and every gateway replica, computes the same answer from the
//!    same candidate set without sharing any state; when an endpoint leaves, only its sessions
//!    move. No session id: everyone scores 0 (the scorer has no influence).
//!
//! 2. Session token (response header, default `x-session-token`). [`session_token_for`] names
//!    the endpoint that served as `v1.` + 16 hex digits of a keyed hash of its address. When the
//!    client sends it back and it resolves to a candidate that is healthy and not overloaded,
//!    that candidate is the primary (the others remain fallbacks by score). The token is never
//!    decoded into an address: it can only select an endpoint already in the candidate set, so
//!    a forged token can do no more than a normal request. Malformed or unknown tokens are
//!    ignored.
//!
//! Default weight of the session-id scorer: 4.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::Candidate;

/// Keyed so that a token is not simply the well-known hash of an address.
const TOKEN_SEED: u64 = 0x7365_7373_696f_6e31;
const TOKEN_PREFIX: &str = "v1.";

/// The opaque token naming the endpoint at `address`.
pub fn session_token_for(address: &str) -> String {
    format!("{TOKEN_PREFIX}{:016x}", xxh3_64_with_seed(address.as_bytes(), TOKEN_SEED))
}

/// Parses a token into its endpoint key; `None` when malformed.
pub fn parse_session_token(token: &str) -> Option<u64> {
    let hex = token.trim().strip_prefix(TOKEN_PREFIX)?;
    if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// The candidate index a token names, if it is in `cands` and `eligible`.
pub fn resolve_token(token: &str, cands: &[Candidate<'_>], eligible: &[bool]) -> Option<usize> {
    let key = parse_session_token(token)?;
    cands
        .iter()
        .zip(eligible)
        .position(|(c, &ok)| ok && xxh3_64_with_seed(c.address.as_bytes(), TOKEN_SEED) == key)
}

/// The rendezvous winner for `session_id` among the eligible candidates.
pub fn rendezvous(session_id: &str, cands: &[Candidate<'_>], eligible: &[bool]) -> Option<usize> {
    let mut best: Option<(u64, usize)> = None;
    for (i, (c, &ok)) in cands.iter().zip(eligible).enumerate() {
        if !ok {
            continue;
        }
        let w = xxh3_64_with_seed(session_id.as_bytes(), xxh3_64(c.address.as_bytes()));
        if best.is_none_or(|(bw, _)| w > bw) {
            best = Some((w, i));
        }
    }
    best.map(|(_, i)| i)
}

/// Session-id scores: 1.0 for the rendezvous winner, 0.0 elsewhere (all 0 without a session).
pub fn scores(session_id: Option<&str>, cands: &[Candidate<'_>], eligible: &[bool]) -> Vec<f64> {
    let mut out = vec![0.0; cands.len()];
    if let Some(i) = session_id.filter(|s| !s.is_empty()).and_then(|s| rendezvous(s, cands, eligible)) {
        if let Some(v) = out.get_mut(i) {
            *v = 1.0;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::tests_support::cands_inflight;
    use super::*;

    #[test]
    fn token_round_trip_and_rejects_garbage() {
        let t = session_token_for("10.0.0.1:8000");
        assert!(t.starts_with("v1.") && t.len() == 19, "{t}");
        assert_eq!(parse_session_token(&t), Some(xxh3_64_with_seed(b"10.0.0.1:8000", TOKEN_SEED)));
        for bad in [
            "",
            "v1.",
            "10.0.0.1:8000",
            "v1.xyz",
            "v2.0000000000000000",
            "v1.00000000000000000",
            "v1.ABCDEF0000000000",
        ] {
            assert_eq!(parse_session_token(bad), None, "{bad}");
        }
    }

    #[test]
    fn token_resolves_only_to_eligible_candidates() {
        let c = cands_inflight(&[0, 0, 0]);
        let v = c.view();
        let t = session_token_for(v[1].address);
        assert_eq!(resolve_token(&t, &v, &[true, true, true]), Some(1));
        // Overloaded or unhealthy: ignored.
        assert_eq!(resolve_token(&t, &v, &[true, false, true]), None);
        // A token for an address outside the candidate set names nothing, even if well formed.
        assert_eq!(resolve_token(&session_token_for("6.6.6.6:80"), &v, &[true; 3]), None);
    }

    #[test]
    fn rendezvous_is_stable_and_moves_only_lost_sessions() {
        let c = cands_inflight(&[0, 0, 0, 0]);
        let v = c.view();
        let all = [true; 4];
        let mut moved = 0;
        let mut per = [0usize; 4];
        for i in 0..400 {
            let s = format!("session-{i}");
            let w = rendezvous(&s, &v, &all).unwrap();
            per[w] += 1;
            // Same inputs, same answer.
            assert_eq!(rendezvous(&s, &v, &all), Some(w));
            // Remove endpoint 2: sessions that were elsewhere stay put.
            let w2 = rendezvous(&s, &v, &[true, true, false, true]).unwrap();
            if w != 2 {
                assert_eq!(w2, w);
            } else {
                moved += 1;
                assert_ne!(w2, 2);
            }
        }
        assert_eq!(moved, per[2]);
        // Every endpoint gets some sessions (400 sessions over 4; deterministic hashes).
        assert!(per.iter().all(|&n| n > 50), "{per:?}");
        assert_eq!(scores(None, &v, &all), vec![0.0; 4]);
        assert_eq!(scores(Some(""), &v, &all), vec![0.0; 4]);
        assert_eq!(scores(Some("session-0"), &v, &all).iter().sum::<f64>(), 1.0);
    }
}
