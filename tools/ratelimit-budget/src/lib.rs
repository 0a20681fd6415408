//! The ledger of `ratelimit-budget`: a token budget per descriptor entry, charged with each
//! descriptor's hits.
//!
//! A budget `KEY=VALUE:N` applies to every descriptor with the entry `KEY` = `VALUE` (the first
//! budget that matches wins). A descriptor is over its limit when the budget is spent: the hits
//! charged so far are `N` or more. Its hits are then added whatever the answer (the way
//! envoyproxy/ratelimit counts): its own `hits_addend` when Envoy set one (0 included: a check
//! that charges nothing), else the request's, else 1. So a request-path descriptor with
//! `hits_addend: 0` asks "is the budget spent?", and a stream-done descriptor with the response's
//! tokens as its `hits_addend` spends them. A descriptor no budget matches is always under limit.

/// One descriptor of a `ShouldRateLimit` call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    pub entries: Vec<(String, String)>,
    /// The descriptor's own `hits_addend`, when Envoy set it.
    pub hits_addend: Option<u64>,
}

/// A token budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    pub key: String,
    pub value: String,
    pub limit: u64,
    pub used: u64,
}

impl Budget {
    /// Parses `KEY=VALUE:N`.
    pub fn parse(spec: &str) -> Result<Budget, String> {
        let bad = || format!("--budget {spec}: expected KEY=VALUE:TOKENS");
        let (entry, limit) = spec.rsplit_once(':').ok_or_else(bad)?;
        let (key, value) = entry.split_once('=').ok_or_else(bad)?;
        let limit = limit.parse::<u64>().map_err(|_| bad())?;
        if key.is_empty() {
            return Err(bad());
        }
        Ok(Budget { key: key.into(), value: value.into(), limit, used: 0 })
    }
}

/// The answer for one descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub over_limit: bool,
    /// The hits charged to this descriptor.
    pub hits: u64,
    /// The budget's limit and its hits charged after this call, when a budget matched.
    pub budget: Option<(u64, u64)>,
}

/// Every budget.
#[derive(Debug, Default)]
pub struct Ledger {
    pub budgets: Vec<Budget>,
}

impl Ledger {
    pub fn new(budgets: Vec<Budget>) -> Ledger {
        Ledger { budgets }
    }

    /// Answers one call: a verdict per descriptor, in order. `request_hits` is the request-level
    /// `hits_addend` (0: not set).
    pub fn apply(&mut self, descriptors: &[Descriptor], request_hits: u32) -> Vec<Verdict> {
        descriptors
            .iter()
            .map(|d| {
                let hits =
                    d.hits_addend.unwrap_or(if request_hits == 0 { 1 } else { u64::from(request_hits) });
                let budget = self
                    .budgets
                    .iter_mut()
                    .find(|b| d.entries.iter().any(|(k, v)| *k == b.key && *v == b.value));
                match budget {
                    None => Verdict { over_limit: false, hits, budget: None },
                    Some(b) => {
                        let over_limit = b.used >= b.limit;
                        b.used = b.used.saturating_add(hits);
                        Verdict { over_limit, hits, budget: Some((b.limit, b.used)) }
                    }
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
