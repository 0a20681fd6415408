//! LoRA adapter slots, after vLLM's LRU adapter cache with `--max-loras` GPU slots.
//!
//! At most `max_lora` adapters are loaded at once. A request for adapter X can be scheduled when
//! X is loaded, when a slot is empty, or when some loaded adapter is idle (no running request);
//! the least recently used idle adapter is then evicted. Otherwise the request stays waiting and
//! the scheduler moves on to the next waiting request (vLLM V1 skips, rather than blocks on, a
//! request whose adapter cannot be scheduled). Loading takes no simulated time.

use std::collections::BTreeMap;

#[derive(Debug, Clone, Default)]
pub(crate) struct LoraSlots {
    max: usize,
    /// Loaded adapters with the logical time they were last scheduled.
    loaded: Vec<(String, u64)>,
    /// Running requests per adapter (only adapters with at least one).
    running: BTreeMap<String, u32>,
    tick: u64,
    loads: u64,
    evictions: u64,
}

impl LoraSlots {
    pub(crate) fn new(max: usize) -> Self {
        LoraSlots { max, ..Default::default() }
    }

    pub(crate) fn max(&self) -> usize {
        self.max
    }

    /// Whether a request for `name` could start now.
    pub(crate) fn can_schedule(&self, name: &str) -> bool {
        self.loaded.iter().any(|(n, _)| n == name)
            || self.loaded.len() < self.max
            || self.loaded.iter().any(|(n, _)| !self.running.contains_key(n))
    }

    /// Start a request for `name`: load it (evicting the LRU idle adapter if all slots are
    /// taken) and count it as running. Returns false if `can_schedule` was false.
    pub(crate) fn start(&mut self, name: &str) -> bool {
        self.tick += 1;
        let tick = self.tick;
        if let Some(entry) = self.loaded.iter_mut().find(|(n, _)| n == name) {
            entry.1 = tick;
        } else {
            if self.loaded.len() >= self.max {
                let victim = self
                    .loaded
                    .iter()
                    .enumerate()
                    .filter(|(_, (n, _))| !self.running.contains_key(n))
                    .min_by_key(|(_, (_, used))| *used)
                    .map(|(i, _)| i);
                let Some(victim) = victim else { return false };
                self.loaded.swap_remove(victim);
                self.evictions += 1;
            }
            self.loaded.push((name.to_string(), tick));
            self.loads += 1;
        }
        *self.running.entry(name.to_string()).or_insert(0) += 1;
        true
    }

    /// A request for `name` stopped running (finished, preempted or aborted).
    pub(crate) fn stop(&mut self, name: &str) {
        if let Some(n) = self.running.get_mut(name) {
            *n -= 1;
            if *n == 0 {
                self.running.remove(name);
            }
        }
    }

    /// Adapters with at least one running request, sorted by name.
    pub(crate) fn running_adapters(&self) -> Vec<String> {
        self.running.keys().cloned().collect()
    }

    /// Loaded adapters (running or idle), sorted by name.
    pub(crate) fn loaded_adapters(&self) -> Vec<String> {
        let mut v: Vec<String> = self.loaded.iter().map(|(n, _)| n.clone()).collect();
        v.sort();
        v
    }

    pub(crate) fn loads(&self) -> u64 {
        self.loads
    }
    pub(crate) fn evictions(&self) -> u64 {
        self.evictions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_fill_then_block_while_all_running() {
        let mut l = LoraSlots::new(2);
        assert!(l.start("a"));
        assert!(l.start("b"));
        // Both slots hold running adapters: c must wait.
        assert!(!l.can_schedule("c"));
        assert!(!l.start("c"));
        // A second request for a loaded adapter is fine.
        assert!(l.can_schedule("a"));
        assert_eq!(l.running_adapters(), vec!["a", "b"]);
    }

    #[test]
    fn idle_lru_adapter_is_evicted() {
        let mut l = LoraSlots::new(2);
        assert!(l.start("a")); // tick 1
        assert!(l.start("b")); // tick 2
        l.stop("a");
        l.stop("b");
        // Both idle; a was used least recently, so c replaces a.
        assert!(l.start("c"));
        assert_eq!(l.loaded_adapters(), vec!["b", "c"]);
        assert_eq!(l.evictions(), 1);
        // An idle loaded adapter is not "running".
        assert_eq!(l.running_adapters(), vec!["c"]);
    }
}
