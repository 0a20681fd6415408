//! Gateway-to-gateway exchange of the cross-worker prefix table: the pure core.
//!
//! **Why.** Gateway replicas share nothing, so a conversation whose turns reach different
//! replicas is placed by each one's own view, and its KV cache is lost. In the replay benchmark
//! (Mooncake, 4 replicas × 4 workers, load 4.5) replicas that replayed each other's table writes
//! every 1 s got the hit rate of one gateway back (13.7 % against 10.2 %; one gateway 13.6 %) and
//! TTFT p90 from 1.85 to 1.58 s; every 5 s did as well (`tools/replay-bench/FINDINGS.md`,
//! "Replicas that exchange their prefix tables").
//!
//! **How.** Each gateway's poller (the singleton) reads its table every `interval_ms`
//! ([`Exporter::collect`]: the records that changed since its last read, at most
//! [`MAX_RECORDS`]) and POSTs them ([`encode`]) to every peer gateway. A peer's filter takes a
//! request to the exchange path only with the shared token ([`classify`]: anything else is
//! answered locally and never reaches a model server), decodes the body ([`decode`]) and applies
//! the records to its own table (`SharedPrefix::apply`: the newest write of a hash wins).
//! Records a gateway received look new to its own next read, so it passes them on once more;
//! the replay measured that echo and it cost nothing (FINDINGS.md), so records carry no origin.
//!
//! **Wire format.** A `crate::base::codec` record, tag `PeerPrefixBatch`: a `u32` count, then
//! 18-byte records exactly as the table stores them (`prefix_shared::RECORD_BYTES`:
//! `le64 hash ‖ le32 endpoint key ‖ 3 × le16 step tag`). A body that is not such a record,
//! whose length does not match its count, or that holds more than [`MAX_RECORDS`] is refused
//! whole (400): nothing of it is applied. A body of a version this build does not read (a
//! replica of another build, during a rolling upgrade) is answered 204 and ignored, so the
//! sender sees no error; its records are sent again once both run one build.
//!
//! **Failure behaviour.** A peer that does not answer loses that batch (the table is a hint; the
//! next turn's own write repairs it). A store error on read counts the shard as empty (its
//! records are sent again later); on apply the shard is skipped.
//!
//! **Placements.** With the prefix records the poller also sends its workers' newest picks
//! ([`encode_placements`]: tag `PeerPlacementBatch`, the gateway's sender nonce
//! ([`gateway_sender`]), then the placements), which the receiver replays into its workers'
//! prefix indexes; its own batch (a gateway that lists itself) is recognised by the nonce
//! ([`is_own_report`]) and ignored.
//!
//! **No load exchange.** Replicas do not send each other their in-flight counts: with the
//! placements exchanged, adding them every 200 ms made 4 replicas × 4 workers slower or equal on
//! every trace of the replay benchmark (docs/peers.md). A load report (tag `PeerLoadReport`) from
//! a replica of an older build is answered 204 and ignored ([`is_retired_load_report`]); the tag
//! stays reserved (`crate::base::codec`).
//!
//! **Where.** `peers` in the configuration ([`PeersConfig`]); the poller's side is
//! `host::poller` (`PeerSender`), the filter's `host::filter` (the exchange path).

use crate::base::codec::{self, Refusal, Tag, Writer};
use crate::base::json::ConfigError;
use crate::base::ports::SharedStore;
use crate::base::settings::settings;
use crate::state::feed::{FeedReader, Placement};
use crate::state::prefix_shared::{decode_raw, delta, put_raw, Record, SharedPrefix, RECORD_BYTES};

/// The header that carries the shared token.
pub const TOKEN_HEADER: &str = "x-inference-picker-peer-token";
/// Shortest shared token accepted, in bytes.
pub const MIN_TOKEN_BYTES: usize = 16;
/// Bounds of `peers.interval_ms`.
pub const MIN_INTERVAL_MS: u64 = 100;
pub const MAX_INTERVAL_MS: u64 = 60_000;
/// Most peers (a gateway's other replicas).
pub const MAX_PEERS: usize = 64;

/// `peers.interval_ms` by default.
pub const DEFAULT_INTERVAL_MS: u64 = 1_000;

settings! {
    /// `peers` section of the configuration: the other replicas of this gateway, to which the
    /// poller sends its prefix table's new records, and the path on which the filter takes theirs.
    #[derive(Debug, Clone, PartialEq)]
    pub struct PeersConfig {
        /// The other replicas' listener addresses (`ip:port`, IPv6 bracketed), reached through the
        /// poller's ORIGINAL_DST cluster (`poller.cluster`). At most 64; with `kubernetes`, may be
        /// empty. This gateway's own address may be listed too (it applies its own records: no
        /// change), so every replica can share one list. Default: none.
        #[schema(length(max = MAX_PEERS))]
        pub addresses: Vec<String> = Vec::new(),
        /// Find the replicas as `discovery.kubernetes` finds model servers: the gateway's own pods
        /// (its namespace and labels), `target_ports` = the listener port the exchange path is
        /// served on, `models` empty. Every `refresh_ms`; the first 64 Ready pods. Default: none.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub kubernetes: Option<crate::poll::config::KubernetesDiscoveryConfig> = None,
        /// The exchange path. Requests to it are answered by the filter and never reach a model
        /// server. Default `/.inference-picker/v1/prefixes`.
        pub path: String = String::from("/.inference-picker/v1/prefixes"),
        /// The shared token, inline (at least 16 bytes). Prefer `token_env`. Exactly one of the two.
        pub token: Option<String> = None,
        /// Name of a VM environment variable holding the shared token (Envoy
        /// `vm_config.environment_variables`, Istio `vmConfig.env`).
        pub token_env: Option<String> = None,
        /// The `:authority` (Host) of the sends, so that they match the peer's virtual host (e.g.
        /// `llm.example.com`). Default: none (the peer's `ip:port`, which a `*` domain matches).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub authority: Option<String> = None,
        /// How often the poller sends what changed, in ms: 100 to 60000. Default 1000.
        #[range(min = MIN_INTERVAL_MS, max = MAX_INTERVAL_MS)]
        #[reason = "must be {min} to {max}, got {v}"]
        pub interval_ms: u64 = DEFAULT_INTERVAL_MS,
        /// Timeout of one send, in ms: 1 to `interval_ms`. Default 1000.
        #[schema(range(min = 1))]
        pub timeout_ms: u64 = 1_000,
    }
}

impl PeersConfig {
    pub fn validate(&self, at: &str, errs: &mut Vec<ConfigError>) {
        if let Some(k) = &self.kubernetes {
            // Its own rules, but `models`: peers serve none (said once, below).
            let without_models =
                crate::poll::config::KubernetesDiscoveryConfig { models: Vec::new(), ..k.clone() };
            without_models.validate_into(&format!("{at}.kubernetes"), &[], errs);
            if !k.models.is_empty() {
                errs.push(ConfigError::new(
                    format!("{at}.kubernetes.models"),
                    "must be empty: peers serve no model",
                ));
            }
        }
        let mut push = |f: &str, reason: String| errs.push(ConfigError::new(format!("{at}.{f}"), reason));
        if self.addresses.len() > MAX_PEERS {
            push("addresses", format!("must list at most {MAX_PEERS} peers, got {}", self.addresses.len()));
        }
        if self.addresses.is_empty() && self.kubernetes.is_none() {
            push("addresses", "list the peers, or find them with `kubernetes`".into());
        }
        for (i, a) in self.addresses.iter().enumerate() {
            if let Err(e) = crate::state::catalog::parse_endpoint_address(a) {
                push(&format!("addresses[{i}]"), e);
            }
        }
        let p = &self.path;
        if !p.starts_with('/')
            || p.contains(['?', '#'])
            || p.len() > 256
            || p.bytes().any(|b| !b.is_ascii_graphic())
        {
            push("path", format!("must be an absolute path of printable ASCII without a query, got {p:?}"));
        } else if crate::request::protocol::ROUTED_PATHS
            .iter()
            .any(|i| crate::request::protocol::prefix_matches(p, i))
            || [crate::request::protocol::MODELS_PATH]
                .iter()
                .chain(crate::request::protocol::HEALTH_PATHS.iter())
                .any(|x| x == p)
        {
            push("path", format!("{p:?} is a path the filter serves itself"));
        }
        match (&self.token, &self.token_env) {
            (Some(_), Some(_)) => push("token", "set `token` or `token_env`, not both".into()),
            (None, None) => {
                push("token", "set `token` or `token_env`: the exchange needs a shared token".into())
            }
            (Some(t), None) if t.len() < MIN_TOKEN_BYTES => {
                push("token", format!("must be at least {MIN_TOKEN_BYTES} bytes"))
            }
            (None, Some(e)) if e.is_empty() || !e.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') => {
                push("token_env", format!("{e:?} is not an environment variable name"))
            }
            _ => {}
        }
        if let Some(a) = &self.authority {
            if a.is_empty()
                || a.len() > 253
                || !a.bytes().all(|b| b.is_ascii_graphic())
                || a.contains(['/', '@'])
            {
                push("authority", format!("must be a host name (optionally with a port), got {a:?}"));
            }
        }
        self.validate_ranges(at, errs);
        let mut push = |f: &str, reason: String| errs.push(ConfigError::new(format!("{at}.{f}"), reason));
        if self.timeout_ms == 0 || self.timeout_ms > self.interval_ms {
            push(
                "timeout_ms",
                format!("must be 1 to interval_ms ({}), got {}", self.interval_ms, self.timeout_ms),
            );
        }
    }

    /// The token: inline, or read from the VM environment (`None` when the variable is unset or
    /// shorter than [`MIN_TOKEN_BYTES`]: the exchange then stays off, logged by the host).
    pub fn resolve_token(&self, env: impl Fn(&str) -> Option<String>) -> Option<String> {
        let t = match (&self.token, &self.token_env) {
            (Some(t), _) => Some(t.clone()),
            (None, Some(name)) => env(name),
            (None, None) => None,
        };
        t.filter(|t| t.len() >= MIN_TOKEN_BYTES)
    }
}

/// Most records in one batch (73,734 bytes): the default table holds 16,384 (256 shards × 64).
pub const MAX_RECORDS: usize = 4096;
/// The largest valid body: the codec header, the count, the records.
pub const MAX_BODY_BYTES: usize = 2 + 4 + MAX_RECORDS * RECORD_BYTES;

/// Why a body was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireError {
    /// Not a message of this kind (wrong tag, or no header).
    BadMagic,
    Truncated {
        len: usize,
    },
    TooMany {
        records: usize,
    },
    /// A placement batch without a well-formed sender nonce.
    BadSender,
    /// A message of a version this build does not read (a replica of another build during a
    /// rolling upgrade): ignored, answered 204 (`crate::base::codec`).
    UnknownVersion(u8),
}

impl From<Refusal> for WireError {
    fn from(r: Refusal) -> Self {
        match r {
            Refusal::Malformed => WireError::BadMagic,
            Refusal::UnknownVersion(v) => WireError::UnknownVersion(v),
        }
    }
}

/// Whether a body is a load report (tag `PeerLoadReport`, any version): the load exchange
/// between replicas was removed, so such a body comes only from a replica of an older build
/// during a rolling upgrade. The filter answers it 204 and applies nothing (counted in
/// `inference_picker_records_skipped_total{reason="peer_load"}`), so that replica logs no send
/// failure.
pub fn is_retired_load_report(body: &[u8]) -> bool {
    codec::tag_byte(body) == Some(Tag::PeerLoadReport as u8)
}

/// Shared-data key of this gateway's sender nonce (a `LoadSender` record, named after the load
/// exchange that introduced it; the key is kept so builds agree on it): one per Envoy process,
/// created by the first poller that sends ([`gateway_sender`]) and kept when the poller moves
/// (lease mode) or restarts. The filter reads it to ignore this gateway's own placement batch:
/// `addresses` may list this gateway itself.
pub const SENDER_KEY: &str = "inference-picker/peers/load-sender";

/// This gateway's sender nonce: the one in [`SENDER_KEY`], or `candidate` (non-zero)
/// written there when there is none (or it is garbled). Of two pollers racing, the first write
/// wins and both return it. A nonce of a version this build does not read (a poller of another
/// build wrote it) is an error: overwriting it would break that build's own-batch guard, so
/// this poller sends no placement batch until it reads one.
pub fn gateway_sender(
    store: &dyn SharedStore,
    candidate: u64,
) -> Result<u64, crate::base::ports::StoreError> {
    for _ in 0..4 {
        let cas = match store.get(SENDER_KEY)? {
            Some((v, cas)) => match codec::decode_u64(&v, Tag::LoadSender) {
                Ok(n) if n != 0 => return Ok(n),
                Err(Refusal::UnknownVersion(v)) => {
                    return Err(crate::base::ports::StoreError::Host(format!(
                        "the sender nonce is another build's (version {v})"
                    )))
                }
                _ => cas,
            },
            None => crate::base::ports::CREATE_CAS,
        };
        match store.set(SENDER_KEY, &codec::encode_u64(Tag::LoadSender, candidate.max(1)), cas) {
            Ok(()) | Err(crate::base::ports::StoreError::CasMismatch) => {}
            Err(e) => return Err(e),
        }
    }
    Err(crate::base::ports::StoreError::CasMismatch)
}

/// Whether a placement batch from `sender` may be this gateway's own (`stored`: the value of
/// [`SENDER_KEY`], if any). A nonce of a version this build does not read may be this
/// gateway's own: it fails closed (true, the batch is not applied).
pub fn is_own_report(stored: Option<&[u8]>, sender: u64) -> bool {
    match stored.map(|v| codec::decode_u64(v, Tag::LoadSender)) {
        Some(Ok(own)) => own == sender,
        Some(Err(Refusal::UnknownVersion(_))) => true,
        Some(Err(Refusal::Malformed)) | None => false,
    }
}

/// A prefix batch (tag `PeerPrefixBatch`): `u32 count · count × 18-byte records`. Callers keep
/// batches within [`MAX_RECORDS`] ([`Exporter::collect`] does).
pub fn encode(records: &[Record]) -> Vec<u8> {
    let mut w = Writer::new(Tag::PeerPrefixBatch, 4 + records.len() * RECORD_BYTES);
    w.len(records.len());
    for r in records {
        put_raw(&mut w, r);
    }
    w.finish()
}

/// The records of a body, or why it is refused (whole).
pub fn decode(body: &[u8]) -> Result<Vec<Record>, WireError> {
    let mut r = codec::open(body, Tag::PeerPrefixBatch)?;
    let n = usize::try_from(r.u32().ok_or(WireError::Truncated { len: body.len() })?).unwrap_or(usize::MAX);
    if n > MAX_RECORDS {
        return Err(WireError::TooMany { records: n });
    }
    let rest = r.remaining();
    if rest.len() != n.saturating_mul(RECORD_BYTES) {
        return Err(WireError::Truncated { len: body.len() });
    }
    Ok(decode_raw(rest))
}

/// What the poller read of its table at its last exchange, to send only what changed since.
#[derive(Debug, Default)]
pub struct Exporter {
    last: Vec<Vec<u8>>,
}

impl Exporter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads every shard and returns the records written since the previous call (all of them
    /// on the first), at most [`MAX_RECORDS`]: past that, the newest of each shard go first and
    /// the shards not sent are not marked read, so their records go with the next call.
    pub fn collect(&mut self, store: &dyn SharedStore, table: &SharedPrefix) -> Vec<Record> {
        let now = table.read_all(store);
        if self.last.len() != now.len() {
            self.last = vec![Vec::new(); now.len()];
        }
        let mut out = Vec::new();
        for (last, value) in self.last.iter_mut().zip(now) {
            let d = delta(last, &value);
            if out.len() + d.len() > MAX_RECORDS {
                continue;
            }
            out.extend(d);
            *last = value;
        }
        out
    }
}

/// Most placements in one batch ([`encode_placements`]): at most this many of a gateway's
/// picks reach its peers' indexes per `interval_ms` (the newest; the others only through the
/// prefix records).
pub const MAX_PLACEMENTS: usize = 64;
/// Most block hashes of one placement in a batch (`prefix.max_blocks`' default): a longer
/// prompt's first ones.
pub const MAX_PLACEMENT_HASHES: usize = 256;
/// Longest address in a batch.
const MAX_PLACEMENT_ADDRESS: usize = 256;
/// The largest valid placement batch.
pub const MAX_PLACEMENT_BODY_BYTES: usize =
    2 + 8 + 4 + MAX_PLACEMENTS * (4 + MAX_PLACEMENT_ADDRESS + 4 + 4 + 8 * MAX_PLACEMENT_HASHES);

/// Whether a body is a placement batch (tag `PeerPlacementBatch`).
pub fn is_placement_batch(body: &[u8]) -> bool {
    codec::tag_byte(body) == Some(Tag::PeerPlacementBatch as u8)
}

/// A placement batch (tag `PeerPlacementBatch`): `u64 sender nonce ([`gateway_sender`]) · u32
/// count · count × (str address · u32 cap · u32 n · n × u64 block hash)`: picks of the sending
/// gateway, which the receiver replays into its workers' prefix indexes
/// (`crate::state::feed`). At most [`MAX_PLACEMENTS`], each cut to [`MAX_PLACEMENT_HASHES`];
/// a placement with a longer address is left out.
pub fn encode_placements(sender: u64, placements: &[Placement]) -> Vec<u8> {
    let kept: Vec<&Placement> =
        placements.iter().filter(|p| p.address.len() <= MAX_PLACEMENT_ADDRESS).take(MAX_PLACEMENTS).collect();
    let mut w = Writer::new(Tag::PeerPlacementBatch, 16 + kept.len() * 64);
    w.u64(sender.max(1)).len(kept.len());
    for p in kept {
        let n = p.hashes.len().min(MAX_PLACEMENT_HASHES);
        w.str(&p.address).u32(p.cap).len(n);
        for &h in p.hashes.iter().take(n) {
            w.u64(h);
        }
    }
    w.finish()
}

/// The sender and placements of a batch (each marked `foreign`), or why it is refused (whole).
pub fn decode_placements(body: &[u8]) -> Result<(u64, Vec<Placement>), WireError> {
    let bad = WireError::Truncated { len: body.len() };
    if body.len() > MAX_PLACEMENT_BODY_BYTES {
        return Err(bad);
    }
    let mut r = codec::open(body, Tag::PeerPlacementBatch)?;
    let sender = r.u64().filter(|&n| n != 0).ok_or(WireError::BadSender)?;
    let count = usize::try_from(r.u32().ok_or(bad.clone())?).unwrap_or(usize::MAX);
    if count > MAX_PLACEMENTS {
        return Err(WireError::TooMany { records: count });
    }
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let address = r.string(MAX_PLACEMENT_ADDRESS).ok_or(bad.clone())?;
        let cap = r.u32().ok_or(bad.clone())?;
        let n = r.count(8, MAX_PLACEMENT_HASHES).ok_or(bad.clone())?;
        let mut hashes = Vec::with_capacity(n);
        for _ in 0..n {
            hashes.push(r.u64().ok_or(bad.clone())?);
        }
        out.push(Placement { address, cap, hashes, foreign: true });
    }
    r.finish().ok_or(bad)?;
    Ok((sender, out))
}

/// The poller's side of the placements exchange: what this gateway's workers picked since the
/// last send, read from their rings (`crate::state::feed`) at every poller tick so that a busy
/// worker's ring does not lap it between sends; the placements received from peers
/// (`foreign`) are not sent on.
#[derive(Debug, Default)]
pub struct PlacementExporter {
    reader: FeedReader,
    pending: std::collections::VecDeque<Placement>,
    buf: Vec<Placement>,
}

impl PlacementExporter {
    /// Reads the new entries of the VMs `vms` (`crate::state::inflight::live_vms`), keeping at
    /// most [`MAX_PLACEMENTS`], the newest.
    pub fn collect(&mut self, store: &dyn SharedStore, vms: &[(usize, u64)]) {
        self.buf.clear();
        self.reader.poll(store, vms, crate::state::feed::RING as usize, &mut self.buf);
        for p in self.buf.drain(..).filter(|p| !p.foreign) {
            if self.pending.len() == MAX_PLACEMENTS {
                self.pending.pop_front();
            }
            self.pending.push_back(p);
        }
    }

    /// The placements to send now (then forgotten).
    pub fn take(&mut self) -> Vec<Placement> {
        self.pending.drain(..).collect()
    }
}

/// What the filter does with a request, decided from its head alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerRequest {
    /// Not the exchange path (or the exchange is off): an inference request like any other.
    NotPeer,
    /// Answer locally with this status; nothing reaches a model server.
    Reject { status: u32, code: &'static str, message: &'static str },
    /// Read the body (at most [`MAX_BODY_BYTES`]) and apply it.
    Accept,
}

/// The exchange's settings as the filter sees them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint<'a> {
    /// The exchange path, e.g. `/.inference-picker/v1/prefixes`.
    pub path: &'a str,
    /// The shared token peers send in the token header.
    pub token: &'a str,
}

/// Classifies a request head. `path` is `:path` (a query string makes it another path: peers
/// never send one); `token` is the token header's value, if sent. With the exchange off
/// (`endpoint` `None`) every request is [`PeerRequest::NotPeer`].
pub fn classify(
    endpoint: Option<&Endpoint<'_>>,
    method: &str,
    path: &str,
    token: Option<&[u8]>,
) -> PeerRequest {
    let Some(ep) = endpoint else { return PeerRequest::NotPeer };
    if path != ep.path {
        return PeerRequest::NotPeer;
    }
    // The token first: without it, the path's existence is not confirmed beyond a 404-like 403.
    if !token.is_some_and(|t| ct_eq(t, ep.token.as_bytes())) || ep.token.is_empty() {
        return PeerRequest::Reject {
            status: 403,
            code: "forbidden",
            message: "This path is for gateway peers only.",
        };
    }
    if method != "POST" {
        return PeerRequest::Reject {
            status: 405,
            code: "method_not_allowed",
            message: "Peers send their prefix records with POST.",
        };
    }
    PeerRequest::Accept
}

/// Equality whose time does not depend on where the first difference is (it still reveals the
/// length, which a token's configured minimum makes worthless).
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Applies a received body to this gateway's table. Returns how many records it held, or why
/// it was refused (then nothing was applied).
pub fn receive(store: &dyn SharedStore, table: &SharedPrefix, body: &[u8]) -> Result<usize, WireError> {
    let records = decode(body)?;
    table.apply(store, &records);
    Ok(records.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::ports::MemStore;
    use crate::state::prefix_shared::{find, STEPS};

    const T: [u16; STEPS - 1] = [0; STEPS - 1];

    fn table() -> SharedPrefix {
        SharedPrefix::new(16, 8)
    }

    fn placement(address: &str, hashes: &[u64]) -> Placement {
        Placement { address: address.into(), cap: 1000, hashes: hashes.to_vec(), foreign: false }
    }

    #[test]
    fn a_placement_batch_round_trips_and_a_bad_sender_is_refused() {
        let sent = vec![placement("10.0.0.1:8000", &[1, 2, 3]), placement("[fd00::1]:8000", &[])];
        let body = encode_placements(0xF00, &sent);
        assert!(is_placement_batch(&body) && !is_retired_load_report(&body));
        let (sender, got) = decode_placements(&body).unwrap();
        assert_eq!(sender, 0xF00);
        assert_eq!(got, sent.iter().map(|p| Placement { foreign: true, ..p.clone() }).collect::<Vec<_>>());
        assert_eq!(decode_placements(&encode(&[])), Err(WireError::BadMagic));
        // A zero sender; a body too short for one.
        let mut zero = body.clone();
        zero[2..10].copy_from_slice(&[0; 8]);
        assert_eq!(decode_placements(&zero), Err(WireError::BadSender));
        assert_eq!(decode_placements(&body[..5]), Err(WireError::BadSender));
        // Every other truncation, and a trailing byte: refused whole.
        for cut in 10..body.len() {
            assert!(matches!(decode_placements(&body[..cut]), Err(WireError::Truncated { .. })), "cut {cut}");
        }
        let mut longer = body.clone();
        longer.push(0);
        assert!(matches!(decode_placements(&longer), Err(WireError::Truncated { .. })));
        // One sender nonce per gateway: the first poller's, whoever sends later.
        let store = MemStore::new();
        assert_eq!(gateway_sender(&store, 0xAAA), Ok(0xAAA));
        assert_eq!(gateway_sender(&store, 0xBBB), Ok(0xAAA));
        store.set(SENDER_KEY, b"garbage", 0).unwrap();
        assert_eq!(gateway_sender(&store, 0xCCC), Ok(0xCCC));
        let nonce = |n| codec::encode_u64(Tag::LoadSender, n);
        assert!(is_own_report(Some(&nonce(0xF00)), 0xF00));
        assert!(!is_own_report(Some(&nonce(0xF01)), 0xF00));
        assert!(!is_own_report(None, 0xF00));
        assert!(!is_own_report(Some(b"garbage"), 0xF00));
    }

    /// A load report as an older build sent it (`u64 sender · u32 n · n × (str address · u32 n ·
    /// u32 prefill_n · u64 prefill_tokens)`), of its version or the next: recognised as retired
    /// (the filter answers it 204 and applies nothing); no other message is.
    #[test]
    fn an_older_replicas_load_report_is_recognised_as_retired() {
        let mut w = Writer::new(Tag::PeerLoadReport, 64);
        w.u64(0xF00).len(1).str("10.0.0.1:8000").u32(3).u32(2).u64(9000);
        let old = w.finish();
        assert_eq!(old[0], 0x06, "the retired tag keeps its wire value");
        assert!(is_retired_load_report(&old));
        assert!(is_retired_load_report(&codec::as_next(&old, Tag::PeerLoadReport)));
        assert!(is_retired_load_report(&old[..2]));
        for other in [
            encode(&[(1, 2, T)]),
            encode_placements(7, &[placement("a:1", &[1])]),
            Vec::new(),
            b"garbage".to_vec(),
        ] {
            assert!(!is_retired_load_report(&other), "{other:?}");
        }
        // Nothing that decodes peer messages reads it as one of theirs.
        assert_eq!(decode(&old), Err(WireError::BadMagic));
        assert_eq!(decode_placements(&old), Err(WireError::BadMagic));
    }

    /// Mixed builds: a batch, placements and a sender nonce of the next release. This one ignores
    /// the messages (the filter answers 204), keeps the other build's nonce, sends no placements
    /// meanwhile, and counts a batch as possibly its own (not applied).
    #[test]
    fn messages_and_nonces_of_another_release_are_skipped() {
        let next = cfg!(feature = "codec-next");
        let batch = codec::as_next(&encode(&[(1, 2, T)]), Tag::PeerPrefixBatch);
        let placements =
            codec::as_next(&encode_placements(7, &[placement("a:1", &[1])]), Tag::PeerPlacementBatch);
        let store = MemStore::new();
        let theirs = codec::as_next(&codec::encode_u64(Tag::LoadSender, 0xAAA), Tag::LoadSender);
        store.set(SENDER_KEY, &theirs, 0).unwrap();
        if next {
            assert_eq!(decode(&batch), Ok(vec![(1, 2, T)]));
            assert!(decode_placements(&placements).is_ok());
            assert_eq!(gateway_sender(&store, 0xBBB), Ok(0xAAA));
            assert!(!is_own_report(Some(&theirs), 0xF00));
        } else {
            let v = Tag::PeerPrefixBatch.current() + 1;
            assert_eq!(decode(&batch), Err(WireError::UnknownVersion(v)));
            assert_eq!(decode_placements(&placements), Err(WireError::UnknownVersion(v)));
            assert!(receive(&store, &table(), &batch).is_err());
            assert!(gateway_sender(&store, 0xBBB).is_err());
            assert_eq!(store.get(SENDER_KEY).unwrap().unwrap().0, theirs, "the nonce is kept");
            assert!(is_own_report(Some(&theirs), 0xF00));
        }
    }

    #[test]
    fn a_batch_round_trips_and_bad_bodies_are_refused_whole() {
        let recs = vec![(1u64, 10u32, [1, 2, 3]), (u64::MAX, u32::MAX, T)];
        let body = encode(&recs);
        assert_eq!(body.len(), 2 + 4 + 2 * RECORD_BYTES);
        assert_eq!(decode(&body), Ok(recs));
        assert_eq!(decode(&encode(&[])), Ok(vec![]));
        assert_eq!(decode(b"IPX1"), Err(WireError::BadMagic));
        assert_eq!(decode(b""), Err(WireError::BadMagic));
        assert_eq!(decode(&body[..body.len() - 1]), Err(WireError::Truncated { len: body.len() - 1 }));
        let mut longer = body.clone();
        longer.push(0);
        assert_eq!(decode(&longer), Err(WireError::Truncated { len: body.len() + 1 }));
        let big = encode(&vec![(7, 7, T); MAX_RECORDS + 1]);
        assert_eq!(decode(&big), Err(WireError::TooMany { records: MAX_RECORDS + 1 }));
        assert_eq!(encode(&vec![(7, 7, T); MAX_RECORDS]).len(), MAX_BODY_BYTES);
        // A refused body applies nothing.
        let store = MemStore::new();
        assert!(receive(&store, &table(), &body[..body.len() - 1]).is_err());
        assert!(table().read_all(&store).iter().all(Vec::is_empty));
    }

    #[test]
    fn what_one_gateway_wrote_reaches_the_other_and_only_once() {
        let (a, b) = (MemStore::new(), MemStore::new());
        let t = table();
        let mut ex = Exporter::new();
        assert!(ex.collect(&a, &t).is_empty());
        t.apply(&a, &[(100, 1, T), (101, 2, T)]);
        let batch = ex.collect(&a, &t);
        assert_eq!(batch.len(), 2);
        assert_eq!(receive(&b, &t, &encode(&batch)), Ok(2));
        let shard_of = |h: u64| t.read_all(&b)[(h % 16) as usize].clone();
        assert_eq!(find(&shard_of(100), 100), Some(1));
        assert_eq!(find(&shard_of(101), 101), Some(2));
        // A hash given twice in one batch: the later record wins.
        t.apply(&b, &[(5, 1, T), (5, 2, T)]);
        assert_eq!(find(&t.read_all(&b)[5], 5), Some(2));
        // Nothing new: nothing sent. A rewrite is sent, and wins on the peer.
        assert!(ex.collect(&a, &t).is_empty());
        t.apply(&a, &[(100, 3, T)]);
        assert_eq!(ex.collect(&a, &t), vec![(100, 3, T)]);
        receive(&b, &t, &encode(&[(100, 3, T)])).unwrap();
        assert_eq!(find(&shard_of(100), 100), Some(3));
    }

    #[test]
    fn a_batch_is_capped_and_the_rest_follows() {
        let store = MemStore::new();
        let t = SharedPrefix::new(256, 64);
        let recs: Vec<Record> = (0..(MAX_RECORDS as u64 + 500)).map(|h| (h, 1, T)).collect();
        t.apply(&store, &recs);
        let mut ex = Exporter::new();
        let first = ex.collect(&store, &t);
        assert!(!first.is_empty() && first.len() <= MAX_RECORDS, "{}", first.len());
        let second = ex.collect(&store, &t);
        assert_eq!(first.len() + second.len(), recs.len());
        assert!(ex.collect(&store, &t).is_empty());
    }

    #[test]
    fn only_a_post_with_the_token_to_the_path_is_accepted() {
        let ep = Endpoint { path: "/.inference-picker/v1/prefixes", token: "s3cret-token-0123456789" };
        let tok = Some("s3cret-token-0123456789".as_bytes());
        assert_eq!(classify(Some(&ep), "POST", ep.path, tok), PeerRequest::Accept);
        assert_eq!(classify(None, "POST", ep.path, tok), PeerRequest::NotPeer);
        assert_eq!(classify(Some(&ep), "POST", "/v1/chat/completions", tok), PeerRequest::NotPeer);
        assert_eq!(
            classify(Some(&ep), "POST", "/.inference-picker/v1/prefixes?x=1", tok),
            PeerRequest::NotPeer
        );
        for bad in [
            None,
            Some(&b""[..]),
            Some(&b"s3cret-token-012345678"[..]),
            Some(&b"S3cret-token-0123456789"[..]),
        ] {
            assert!(matches!(
                classify(Some(&ep), "POST", ep.path, bad),
                PeerRequest::Reject { status: 403, .. }
            ));
        }
        assert!(matches!(classify(Some(&ep), "GET", ep.path, tok), PeerRequest::Reject { status: 405, .. }));
        // An empty configured token never accepts anything.
        let open = Endpoint { path: ep.path, token: "" };
        assert!(matches!(
            classify(Some(&open), "POST", ep.path, Some(b"")),
            PeerRequest::Reject { status: 403, .. }
        ));
    }
}
