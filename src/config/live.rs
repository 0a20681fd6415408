//! Live reconfiguration in singleton mode: the HTTP filter's roots publish their configuration
//! in shared data, and the bootstrap singleton poller follows it.
//!
//! Why: the singleton is configured once, from Envoy's bootstrap; a new filter configuration
//! (ECDS, LDS, a new listener) reaches only the filter's roots. Without this, the poller kept
//! scraping and publishing the bootstrap's endpoints until Envoy restarted (issue 13).
//!
//! Protocol (one `vm_id`, so one shared-data namespace per pool):
//! - A filter root whose configuration is valid writes the document to [`CONFIG_KEY`], then its
//!   [`digest`] to [`CONFIG_VERSION_KEY`]. An invalid document is refused by `on_configure`
//!   (Envoy keeps the previous filter, which keeps serving) and is never published.
//! - The singleton reads the small version key on every tick; when it differs from the version it
//!   runs, it reads the document, and adopts it if it parses and validates (its poller is rebuilt:
//!   new endpoints, discovery, timing), else logs once per version and keeps the old one.
//! - The document's own digest is the truth (two roots publishing at once can leave a version key
//!   that names the other document: the digest of what was read decides).
//!
//! Both keys are fixed: two keys per pool, whatever the number of changes. The version is the
//! FNV-1a 32-bit hash of the document's bytes: the same text gives the same version on every
//! root, and it fits a gauge exactly (`inference_picker_config_version`).

use crate::base::json::describe_errors;
use crate::base::ports::{SharedStore, StoreError};
use crate::config::Config;

/// The filter's configuration document, as it arrived.
pub const CONFIG_KEY: &str = "inference-picker/config";
/// Its version ([`digest`], a `ConfigVersion` record: [`encode_digest`]), read on every poller
/// tick.
pub const CONFIG_VERSION_KEY: &str = "inference-picker/config-version";

/// FNV-1a (32-bit) of the document: its version.
pub fn digest(raw: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in raw {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// Publishes a valid configuration document (from a filter root's `on_configure`).
pub fn publish(store: &dyn SharedStore, raw: &[u8]) -> Result<(), StoreError> {
    store.set(CONFIG_KEY, raw, 0)?;
    store.set(CONFIG_VERSION_KEY, &encode_digest(digest(raw)), 0)
}

/// What the poller should do after [`Follower::check`].
#[derive(Debug)]
pub enum Follow {
    /// Nothing new (or nothing published yet).
    Same,
    /// A new valid configuration: run it. `version` is its digest.
    Adopt { config: Box<Config>, version: u32 },
    /// A new document that does not validate: keep the running one. Reported once per version.
    Refused { version: u32, reason: String },
}

/// The value of [`CONFIG_VERSION_KEY`]: a `ConfigVersion` record (`crate::base::codec`).
pub fn encode_digest(d: u32) -> Vec<u8> {
    crate::base::codec::encode_u64(crate::base::codec::Tag::ConfigVersion, u64::from(d))
}

/// The digest in [`CONFIG_VERSION_KEY`]; `None` when malformed or of a version this build does
/// not read (no hint: the follower reads the document and compares its digest).
pub fn decode_digest(bytes: &[u8]) -> Option<u32> {
    crate::base::codec::decode_u64(bytes, crate::base::codec::Tag::ConfigVersion)
        .ok()
        .and_then(|d| u32::try_from(d).ok())
}

/// The singleton's side: which version it runs and which it already refused.
#[derive(Debug, Clone)]
pub struct Follower {
    current: u32,
    refused: Option<u32>,
}

impl Follower {
    /// Runs the document `raw` (the bootstrap's).
    pub fn new(raw: &[u8]) -> Self {
        Follower { current: digest(raw), refused: None }
    }

    pub fn current(&self) -> u32 {
        self.current
    }

    /// Looks for a newer published configuration.
    pub fn check(&mut self, store: &dyn SharedStore) -> Result<Follow, StoreError> {
        let Some((hint, _)) = store.get(CONFIG_VERSION_KEY)? else {
            return Ok(Follow::Same);
        };
        let hinted = decode_digest(&hint);
        if hinted == Some(self.current) || (hinted.is_some() && hinted == self.refused) {
            return Ok(Follow::Same);
        }
        let Some((raw, _)) = store.get(CONFIG_KEY)? else {
            return Ok(Follow::Same);
        };
        let version = digest(&raw);
        if version == self.current || Some(version) == self.refused {
            return Ok(Follow::Same);
        }
        match Config::from_json(&raw) {
            Ok(config) => {
                self.current = version;
                self.refused = None;
                Ok(Follow::Adopt { config: Box::new(config), version })
            }
            Err(errors) => {
                self.refused = Some(version);
                Ok(Follow::Refused { version, reason: describe_errors(&errors) })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::ports::MemStore;

    fn doc(endpoints: &[&str]) -> Vec<u8> {
        let eps: Vec<String> =
            endpoints.iter().map(|a| format!(r#"{{"address":"{a}","models":["llama"]}}"#)).collect();
        format!(r#"{{"version":1,"endpoints":[{}],"models":[{{"name":"llama"}}]}}"#, eps.join(","))
            .into_bytes()
    }

    #[test]
    fn digest_is_fnv1a() {
        // Reference values of FNV-1a 32.
        assert_eq!(digest(b""), 0x811c_9dc5);
        assert_eq!(digest(b"a"), 0xe40c_292c);
        assert_ne!(digest(&doc(&["10.0.0.1:8000"])), digest(&doc(&["10.0.0.2:8000"])));
    }

    #[test]
    fn follows_a_published_change_once() {
        let store = MemStore::new();
        let boot = doc(&["10.0.0.1:8000", "10.0.0.2:8000"]);
        let mut f = Follower::new(&boot);
        // Nothing published yet.
        assert!(matches!(f.check(&store).unwrap(), Follow::Same));
        // The filter publishes the bootstrap's own document: nothing to do.
        publish(&store, &boot).unwrap();
        assert!(matches!(f.check(&store).unwrap(), Follow::Same));
        // A change: adopted once, with its endpoints.
        let next = doc(&["10.0.0.2:8000", "10.0.0.3:8000"]);
        publish(&store, &next).unwrap();
        match f.check(&store).unwrap() {
            Follow::Adopt { config, version } => {
                assert_eq!(version, digest(&next));
                let addrs: Vec<&str> = config.endpoints.iter().map(|e| e.address.as_str()).collect();
                assert_eq!(addrs, ["10.0.0.2:8000", "10.0.0.3:8000"]);
            }
            other => panic!("expected Adopt, got {other:?}"),
        }
        assert_eq!(f.current(), digest(&next));
        assert!(matches!(f.check(&store).unwrap(), Follow::Same));
    }

    #[test]
    fn an_invalid_document_is_refused_once_and_the_old_one_kept() {
        let store = MemStore::new();
        let boot = doc(&["10.0.0.1:8000"]);
        let mut f = Follower::new(&boot);
        // Filter roots never publish an invalid document; this guards against any other writer.
        let bad = br#"{"version":1,"endpoints":[{"address":"nope","models":["llama"]}],"models":[{"name":"llama"}]}"#;
        publish(&store, bad).unwrap();
        match f.check(&store).unwrap() {
            Follow::Refused { version, reason } => {
                assert_eq!(version, digest(bad));
                assert!(reason.contains("endpoints[0].address"), "{reason}");
            }
            other => panic!("expected Refused, got {other:?}"),
        }
        assert_eq!(f.current(), digest(&boot));
        // Reported once, not on every tick.
        assert!(matches!(f.check(&store).unwrap(), Follow::Same));
        // A later valid document is adopted.
        let good = doc(&["10.0.0.9:8000"]);
        publish(&store, &good).unwrap();
        assert!(matches!(f.check(&store).unwrap(), Follow::Adopt { .. }));
    }

    /// Mixed builds: a digest record of the next release is no hint to this one, which then
    /// reads the document itself and adopts it by its own digest.
    #[test]
    fn a_digest_of_another_release_is_no_hint() {
        use crate::base::codec::{as_next, Tag};
        let store = MemStore::new();
        let boot = doc(&["10.0.0.1:8000"]);
        let other = doc(&["10.0.0.5:8000"]);
        let theirs = as_next(&encode_digest(digest(&other)), Tag::ConfigVersion);
        assert_eq!(decode_digest(&theirs).is_some(), cfg!(feature = "codec-next"));
        store.set(CONFIG_KEY, &other, 0).unwrap();
        store.set(CONFIG_VERSION_KEY, &theirs, 0).unwrap();
        let mut f = Follower::new(&boot);
        assert!(matches!(f.check(&store).unwrap(), Follow::Adopt { .. }));
        assert_eq!(f.current(), digest(&other));
    }

    #[test]
    fn the_document_read_decides_not_the_version_hint() {
        let store = MemStore::new();
        let boot = doc(&["10.0.0.1:8000"]);
        let mut f = Follower::new(&boot);
        // Two roots raced: the version key names a document that is not the one stored.
        let other = doc(&["10.0.0.5:8000"]);
        store.set(CONFIG_KEY, &boot, 0).unwrap();
        store.set(CONFIG_VERSION_KEY, &encode_digest(digest(&other)), 0).unwrap();
        // The stored document is the one running: nothing to do.
        assert!(matches!(f.check(&store).unwrap(), Follow::Same));
        store.set(CONFIG_KEY, &other, 0).unwrap();
        assert!(
            matches!(f.check(&store).unwrap(), Follow::Adopt { version, .. } if version == digest(&other))
        );
    }
}
