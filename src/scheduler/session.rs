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
//! 2. Session token (response header, default `x-session-token`). [`SessionKeys::token_for`]
//!    names the endpoint that served as `v2.` + 16 hex digits of SipHash-2-4 (a keyed PRF, 128-bit
//!    key) of its address under the deployment's secret key. When the client sends it back and
//!    it resolves to a candidate that is healthy and not overloaded, that candidate is the
//!    primary (the others remain fallbacks by score). The token is never decoded into an
//!    address: it is checked against the candidates, so it can only select an endpoint already
//!    in the candidate set. Malformed, unknown or forged tokens are ignored.
//!
//!    Key: `scheduler.session.secret_env` (a VM environment variable, passed with
//!    `vm_config.environment_variables.host_env_keys`, so it never shows in `/config_dump`) or
//!    `secret` (inline, visible in `/config_dump`). Rotation: `previous_secret_env` /
//!    `previous_secret` is accepted when a token is checked but never used to issue one; both
//!    keys are tried (no key id in the token, so a token reveals nothing about which key made
//!    it). Every worker and every gateway replica with the same secret issues and accepts the
//!    same tokens.
//!
//!    No secret configured: tokens still work, keyed with a built-in key ([`DEFAULT_SECRET`]),
//!    which is public, so anyone can mint a token that pins a request to a chosen healthy
//!    endpoint (it can still not reach an address outside the pool, nor an unhealthy or
//!    overloaded one). The host logs a warning at configure. A per-process random key is not an
//!    option: tokens must agree across workers and replicas.

use siphasher::sip::SipHasher24;
use std::hash::Hasher;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::candidate::Candidate;
use super::config::MIN_SECRET_BYTES;

const TOKEN_PREFIX: &str = "v2.";
/// The key used when no secret is configured. Public: tokens keyed with it can be forged.
pub const DEFAULT_SECRET: &str = "inference-picker default session key: set scheduler.session.secret_env";

/// A 128-bit SipHash key.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Key(u64, u64);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(..)")
    }
}

impl Key {
    /// Derives the key from a secret of any length: two SipHash outputs of the secret under a
    /// fixed domain key. As secret as the secret itself.
    fn derive(secret: &str) -> Key {
        let half = |label: u8| {
            let mut h = SipHasher24::new_with_keys(0x696e_6665_7265_6e63, 0x652d_7069_636b_6572);
            h.write_u8(label);
            h.write(secret.as_bytes());
            h.finish()
        };
        Key(half(0), half(1))
    }

    fn tag(&self, address: &str) -> u64 {
        let mut h = SipHasher24::new_with_keys(self.0, self.1);
        h.write(address.as_bytes());
        h.finish()
    }
}

/// The keys tokens are issued and checked with. Built once per configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionKeys {
    current: Key,
    previous: Option<Key>,
    /// True when `current` is the public default key.
    is_default: bool,
}

impl Default for SessionKeys {
    fn default() -> Self {
        SessionKeys { current: Key::derive(DEFAULT_SECRET), previous: None, is_default: true }
    }
}

impl SessionKeys {
    /// Keys from the secrets (already read from the environment or the config). `current`
    /// None: the public default key. A secret shorter than [`MIN_SECRET_BYTES`] is an error.
    pub fn from_secrets(current: Option<&str>, previous: Option<&str>) -> Result<SessionKeys, String> {
        for (what, s) in [("current", current), ("previous", previous)] {
            if let Some(s) = s {
                if s.len() < MIN_SECRET_BYTES {
                    return Err(format!(
                        "the {what} session secret is {} bytes; at least {MIN_SECRET_BYTES} are needed",
                        s.len()
                    ));
                }
            }
        }
        Ok(match current {
            None => SessionKeys { previous: previous.map(Key::derive), ..SessionKeys::default() },
            Some(c) => SessionKeys {
                current: Key::derive(c),
                previous: previous.map(Key::derive),
                is_default: false,
            },
        })
    }

    /// True when tokens are keyed with the public default key (forgeable).
    pub fn is_default(&self) -> bool {
        self.is_default
    }

    /// The opaque token naming the endpoint at `address`, under the current key.
    pub fn token_for(&self, address: &str) -> String {
        format!("{TOKEN_PREFIX}{:016x}", self.current.tag(address))
    }

    /// The candidate index a token names, if it is in `cands` and `eligible`, under the current
    /// or the previous key.
    pub fn resolve(&self, token: &str, cands: &[Candidate<'_>], eligible: &[bool]) -> Option<usize> {
        let tag = parse_session_token(token)?;
        let keys = std::iter::once(&self.current).chain(self.previous.as_ref());
        for key in keys {
            let hit = cands.iter().zip(eligible).position(|(c, &ok)| ok && key.tag(c.address) == tag);
            if hit.is_some() {
                return hit;
            }
        }
        None
    }
}

/// Where a secret comes from, for messages.
fn secret_of<'a>(
    inline: &'a Option<String>,
    env_name: &Option<String>,
    env: &dyn Fn(&str) -> Option<String>,
    what: &str,
) -> Result<Option<std::borrow::Cow<'a, str>>, String> {
    match (inline, env_name) {
        (Some(s), _) => Ok(Some(std::borrow::Cow::Borrowed(s.as_str()))),
        (None, Some(name)) => match env(name) {
            Some(v) => Ok(Some(std::borrow::Cow::Owned(v))),
            None => Err(format!(
                "scheduler.session.{what}_env names the environment variable {name:?}, which the VM does not have \
                 (list it in vm_config.environment_variables.host_env_keys)"
            )),
        },
        (None, None) => Ok(None),
    }
}

/// The keys for `scheduler.session`, reading `*_env` secrets through `env` (the host passes the
/// VM's environment). An error names what to fix; the configuration is then refused.
pub fn keys_from_config(
    cfg: &super::config::SessionConfig,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<SessionKeys, String> {
    let current = secret_of(&cfg.secret, &cfg.secret_env, env, "secret")?;
    let previous = secret_of(&cfg.previous_secret, &cfg.previous_secret_env, env, "previous_secret")?;
    SessionKeys::from_secrets(current.as_deref(), previous.as_deref())
}

/// Parses a token into its tag; `None` when malformed.
pub fn parse_session_token(token: &str) -> Option<u64> {
    let hex = token.trim().strip_prefix(TOKEN_PREFIX)?;
    if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
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

    const SECRET: &str = "0123456789abcdef-deployment-a";
    const OTHER: &str = "fedcba9876543210-deployment-b";

    #[test]
    fn token_round_trip_and_rejects_garbage() {
        let k = SessionKeys::from_secrets(Some(SECRET), None).unwrap();
        let t = k.token_for("10.0.0.1:8000");
        assert!(t.starts_with("v2.") && t.len() == 19, "{t}");
        assert_eq!(parse_session_token(&t), Some(Key::derive(SECRET).tag("10.0.0.1:8000")));
        for bad in [
            "",
            "v2.",
            "10.0.0.1:8000",
            "v2.xyz",
            "v1.0000000000000000",
            "v2.00000000000000000",
            "v2.ABCDEF0000000000",
            "v2.\u{ff}\u{ff}",
        ] {
            assert_eq!(parse_session_token(bad), None, "{bad}");
        }
    }

    #[test]
    fn token_resolves_only_to_eligible_candidates() {
        let c = cands_inflight(&[0, 0, 0]);
        let v = c.view();
        let k = SessionKeys::default();
        let t = k.token_for(v[1].address);
        assert_eq!(k.resolve(&t, &v, &[true, true, true]), Some(1));
        // Overloaded or unhealthy: ignored.
        assert_eq!(k.resolve(&t, &v, &[true, false, true]), None);
        // A token for an address outside the candidate set names nothing, even if well formed.
        assert_eq!(k.resolve(&k.token_for("6.6.6.6:80"), &v, &[true; 3]), None);
    }

    #[test]
    fn tokens_are_keyed_by_the_secret_and_survive_one_rotation() {
        let c = cands_inflight(&[0, 0, 0]);
        let v = c.view();
        let all = [true; 3];
        let a = SessionKeys::from_secrets(Some(SECRET), None).unwrap();
        let b = SessionKeys::from_secrets(Some(OTHER), None).unwrap();
        let default = SessionKeys::default();
        assert!(!a.is_default() && default.is_default());
        // Another key, including the public default one, mints tokens this deployment rejects:
        // knowing the algorithm and the address is not enough.
        for forger in [&b, &default] {
            for e in &v {
                assert_eq!(a.resolve(&forger.token_for(e.address), &v, &all), None);
            }
        }
        // Rotation: new current key, old one previous: old tokens still resolve, new ones are
        // issued with the new key; after the grace period (previous dropped) old ones do not.
        let rotated = SessionKeys::from_secrets(Some(OTHER), Some(SECRET)).unwrap();
        let old = a.token_for(v[2].address);
        assert_eq!(rotated.resolve(&old, &v, &all), Some(2));
        assert_eq!(rotated.token_for(v[2].address), b.token_for(v[2].address));
        assert_eq!(b.resolve(&old, &v, &all), None);
        // A previous key alone (announced before the swap) is accepted but not issued.
        let pre = SessionKeys::from_secrets(Some(SECRET), Some(OTHER)).unwrap();
        assert_eq!(pre.resolve(&b.token_for(v[0].address), &v, &all), Some(0));
        assert_eq!(pre.token_for(v[0].address), a.token_for(v[0].address));
        // Too short a secret.
        assert!(SessionKeys::from_secrets(Some("short"), None).unwrap_err().contains("at least 16"));
        assert!(SessionKeys::from_secrets(Some(SECRET), Some("x")).is_err());
        // The key never shows in Debug output.
        assert!(!format!("{a:?}").contains(&format!("{:x}", Key::derive(SECRET).0)));
    }

    #[test]
    fn keys_come_from_the_environment_or_inline() {
        use super::super::config::SessionConfig;
        let env = |n: &str| (n == "SESSION_KEY").then(|| SECRET.to_string());
        let from_env = SessionConfig { secret_env: Some("SESSION_KEY".into()), ..SessionConfig::default() };
        let inline = SessionConfig { secret: Some(SECRET.into()), ..SessionConfig::default() };
        let a = keys_from_config(&from_env, &env).unwrap();
        assert_eq!(a, keys_from_config(&inline, &env).unwrap());
        assert!(!a.is_default());
        assert!(keys_from_config(&SessionConfig::default(), &env).unwrap().is_default());
        let missing = SessionConfig { secret_env: Some("NOPE".into()), ..SessionConfig::default() };
        assert!(keys_from_config(&missing, &env).unwrap_err().contains("host_env_keys"));
        let mut errs = Vec::new();
        let bad = SessionConfig {
            secret: Some("short".into()),
            secret_env: Some("A=B".into()),
            previous_secret_env: Some("X".into()),
            ..SessionConfig::default()
        };
        super::super::config::validate_secrets(&bad, &mut |p, r| errs.push(format!("{p}: {r}")));
        assert_eq!(errs.len(), 3, "{errs:?}");
        assert!(errs[0].starts_with("scheduler.session.secret: set `secret` or `secret_env`"));
        assert!(errs[1].contains("at least 16 bytes"));
        assert!(errs[2].starts_with("scheduler.session.secret_env:"));
        let mut errs = Vec::new();
        let orphan = SessionConfig { previous_secret: Some(OTHER.into()), ..SessionConfig::default() };
        super::super::config::validate_secrets(&orphan, &mut |p, r| errs.push(format!("{p}: {r}")));
        assert_eq!(errs, ["scheduler.session.previous_secret: a previous secret needs a current one (`secret` or `secret_env`)"]);
    }

    #[test]
    fn tokens_are_stable_across_builds() {
        // Fixed values: every worker, replica and release must agree on them (and the e2e tests
        // compute the same in Python).
        let k = SessionKeys::from_secrets(Some(SECRET), None).unwrap();
        assert_eq!(k.token_for("10.0.0.1:8000"), "v2.fcca4ca9296b4ddb");
        assert_eq!(SessionKeys::default().token_for("10.0.0.1:8000"), "v2.d9266fa520658500");
    }

    #[test]
    fn siphash_matches_the_reference_vector() {
        // SipHash-2-4 reference (Aumasson and Bernstein, appendix A): key 00..0f, message 00..0e.
        let mut h = SipHasher24::new_with_keys(0x0706_0504_0302_0100, 0x0f0e_0d0c_0b0a_0908);
        h.write(&(0u8..15).collect::<Vec<_>>());
        assert_eq!(h.finish(), 0xa129_ca61_49be_45e5);
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
