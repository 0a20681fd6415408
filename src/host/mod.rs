//! The thin shell: every proxy-wasm host call lives in this module (`io` holds the calls
//! themselves). One `.wasm`, two roles, chosen by the plugin's root id:
//! - `inference-picker`: the HTTP filter (one root context per worker, plus one on the main
//!   thread);
//! - `inference-picker-poller`: the companion singleton (an `envoy.bootstrap.wasm` WasmService
//!   with `singleton: true`) that scrapes /metrics and publishes the snapshot.
//!
//! Both must use the same `vm_id` so they see the same shared data.
#![allow(clippy::disallowed_methods)]

mod filter;
mod io;
mod poller;

use std::cell::RefCell;
use std::rc::Rc;

use log::{error, info, warn};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

use crate::config::{Config, PollerMode};
use crate::ports::SplitMix64;
use crate::scheduler::Scheduler;
use crate::snapshot::SnapshotCache;

pub const FILTER_ROOT_ID: &str = "inference-picker";
pub const POLLER_ROOT_ID: &str = "inference-picker-poller";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> { Box::new(Root::new(context_id)) });
}}

/// Per-VM state shared by the filter root and its HTTP contexts. Built once per configuration.
pub(crate) struct Worker {
    pub cfg: Rc<Config>,
    pub scheduler: RefCell<Scheduler>,
    pub snapshots: RefCell<SnapshotCache>,
    pub rng: RefCell<SplitMix64>,
    pub metrics: RefCell<io::Metrics>,
}

enum Role {
    Unconfigured,
    Filter(Rc<Worker>),
    Poller(Box<poller::PollerRole>),
}

struct Root {
    context_id: u32,
    role: Role,
    /// `poller.mode: lease`: this filter root's part in electing and running the poller.
    leased: Option<Box<poller::LeasedPoller>>,
}

impl Root {
    fn new(context_id: u32) -> Self {
        Root { context_id, role: Role::Unconfigured, leased: None }
    }
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        if let Role::Poller(p) = &mut self.role {
            p.on_response(token_id, num_headers, body_size);
        }
        if let Some(l) = &mut self.leased {
            l.on_response(token_id, num_headers, body_size);
        }
    }

    fn on_done(&mut self) -> bool {
        // Hand the lease over at once instead of letting it expire.
        if let Some(l) = &mut self.leased {
            l.release();
        }
        true
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let root_id = io::property_string(&["plugin_root_id"]).unwrap_or_default();
        let Some(raw) = io::plugin_configuration() else {
            error!("inference-picker: no plugin configuration given (root id {root_id:?})");
            return false;
        };
        let cfg = match Config::from_json(&raw) {
            Ok(cfg) => Rc::new(cfg),
            Err(errors) => {
                for e in &errors {
                    error!("inference-picker: invalid configuration: {e}");
                }
                return false;
            }
        };
        self.role = if root_id == POLLER_ROOT_ID {
            if cfg.poller.mode != PollerMode::Singleton {
                warn!("inference-picker-poller: poller.mode is not singleton; this singleton stays idle");
                return true;
            }
            info!("inference-picker: poller singleton configured, {} static endpoints", cfg.endpoints.len());
            io::set_tick_period_ms(cfg.poller.interval_ms);
            Role::Poller(Box::new(poller::PollerRole::new(cfg)))
        } else {
            if cfg.poller.mode == PollerMode::Lease {
                self.leased = Some(Box::new(poller::LeasedPoller::new(cfg.clone(), self.context_id)));
                io::set_tick_period_ms(cfg.poller.interval_ms);
            }
            if root_id != FILTER_ROOT_ID {
                info!("inference-picker: root id {root_id:?} runs as the HTTP filter");
            }
            let seed = io::now_nanos() ^ (u64::from(self.context_id) << 32);
            Role::Filter(Rc::new(Worker {
                scheduler: RefCell::new(Scheduler::new(&cfg)),
                snapshots: RefCell::new(SnapshotCache::new()),
                rng: RefCell::new(SplitMix64::new(seed)),
                metrics: RefCell::new(io::Metrics::default()),
                cfg,
            }))
        };
        true
    }

    fn on_tick(&mut self) {
        let now = io::now_ms();
        if let Role::Poller(p) = &mut self.role {
            p.tick(now);
        }
        if let Some(l) = &mut self.leased {
            l.tick(now);
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        match &self.role {
            Role::Filter(w) => Some(Box::new(filter::Filter::new(w.clone()))),
            // A filter chain pointing at the poller's root id, or a failed configuration:
            // pass requests through untouched rather than half-handling them.
            _ => None,
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
