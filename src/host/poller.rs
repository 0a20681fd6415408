//! The poller role: ticks, scrape callouts, publishing. Decisions live in `crate::poller`.

use std::rc::Rc;

use hashbrown::HashMap;
use log::{debug, warn};

use super::io;
use crate::config::Config;
use crate::poller::{Poller, ScrapeResult};
use crate::ports::SharedStore;
use crate::snapshot::{self, SNAPSHOT_VERSION_KEY};

pub(crate) struct PollerRole {
    cfg: Rc<Config>,
    core: Poller,
    /// Outstanding callouts: token → endpoint address.
    calls: HashMap<u32, String>,
    started: bool,
    /// Publish at the next tick even if the round is not complete.
    dirty: bool,
}

impl PollerRole {
    pub fn new(cfg: Rc<Config>) -> Self {
        let mut core = Poller::new(&cfg);
        // Continue the version sequence of a previous VM, so workers see the next publish.
        if let Ok(Some((v, _))) = io::HostStore.get(SNAPSHOT_VERSION_KEY) {
            if let Some(n) = std::str::from_utf8(&v).ok().and_then(|s| s.parse().ok()) {
                core.resume_version_after(n);
            }
        }
        // Callouts start from on_tick, not here: clusters may not be ready yet.
        io::set_tick_period_ms(cfg.poller.interval_ms);
        PollerRole { cfg, core, calls: HashMap::new(), started: false, dirty: false }
    }

    pub fn on_tick(&mut self) {
        let now = io::now_ms();
        if self.started && (self.dirty || !self.calls.is_empty()) {
            // The previous round did not finish within an interval: publish what we have.
            self.publish(now);
        }
        self.started = true;
        for address in self.core.due(now) {
            match io::dispatch_get(
                &self.cfg.poller.cluster,
                &self.cfg.poller.metrics_path,
                &address,
                self.cfg.poller.timeout_ms,
            ) {
                Ok(token) => {
                    self.calls.insert(token, address);
                }
                Err(e) => {
                    warn!("inference-picker-poller: cannot scrape {address}: {e}");
                    self.core.dispatch_failed(&address);
                    self.dirty = true;
                }
            }
        }
        if self.calls.is_empty() && self.dirty {
            self.publish(now);
        }
    }

    pub fn on_response(&mut self, token: u32, num_headers: usize, body_size: usize) {
        let Some(address) = self.calls.remove(&token) else {
            return;
        };
        let now = io::now_ms();
        // A failed call (reset, connect failure, timeout) arrives with no headers.
        let body;
        let result = if num_headers == 0 {
            ScrapeResult::Failed
        } else {
            body = io::call_response_body(body_size);
            ScrapeResult::Response { status: io::call_response_status().unwrap_or(0), body: &body }
        };
        if let Err(e) = self.core.on_result(&address, now, result) {
            debug!("inference-picker-poller: scrape of {address} failed: {e:?}");
        }
        self.finish_if_round_done(now);
    }

    fn finish_if_round_done(&mut self, now: u64) {
        self.dirty = true;
        if self.calls.is_empty() && self.core.round_complete() {
            self.publish(now);
        }
    }

    fn publish(&mut self, now: u64) {
        let snap = self.core.snapshot(now);
        if let Err(e) = snapshot::publish(&io::HostStore, &snap) {
            warn!("inference-picker-poller: publishing snapshot failed: {e:?}");
        }
        self.dirty = false;
    }
}
