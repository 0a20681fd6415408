//! The thin shell: every proxy-wasm host call lives in this module (`io` holds the calls
//! themselves). One `.wasm`, two roles, chosen by the plugin's root id:
//! - `inference-picker`: the HTTP filter (one root context per worker, plus one on the main
//!   thread);
//! - `inference-picker-poller`: the companion singleton (an `envoy.bootstrap.wasm` WasmService
//!   with `singleton: true`) that scrapes /metrics and publishes the snapshot.
//!
//! Both must use the same `vm_id` so they see the same shared data.

mod filter;
mod io;
mod poller;
mod prof;

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use hashbrown::HashMap;
use log::{error, info, warn};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

use crate::base::ports::{Rng, SplitMix64};
use crate::base::telemetry;
use crate::config::live::{self, Follow, Follower};
use crate::config::{Config, PollerMode};
use crate::flow;
use crate::flow::admission::{self, claim_worker_id, Gate, MetricUpdate};
use crate::scheduler::Scheduler;
use crate::state::health::Recorder;
use crate::state::inflight;
use crate::state::snapshot::{Snapshot, SnapshotCache};

pub const FILTER_ROOT_ID: &str = "inference-picker";
pub const POLLER_ROOT_ID: &str = "inference-picker-poller";
/// Tick period of the filter's root context, in ms: how often held requests are reconsidered
/// (and flow-control metrics flushed). Well under a third of the smallest
/// `flow_control.worker_ttl_ms` (300), as the heartbeats need; a new snapshot (every
/// `poller.interval_ms`) is seen within one tick.
pub const FILTER_TICK_MS: u64 = 50;

/// How often each worker re-sets the per-endpoint in-flight gauges from the shared counts
/// (`filter.endpoint_metrics`). Sends and finishes set them at once, but two workers can
/// interleave (one reads the count, another sends and sets, the first then sets its older
/// value), so the gauge is re-set from the truth at this pace and never stays wrong.
pub const INFLIGHT_GAUGE_REFRESH_MS: u64 = 250;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> { Box::new(Root::new(context_id)) });
}}

/// Per-VM state shared by the filter root and its HTTP contexts. Built once per configuration.
/// Flow control's inputs of one moment (see [`Worker::flow_inputs`]).
struct FlowInputs {
    snapshot: Rc<Snapshot>,
    counts: inflight::InflightCounts,
    now_ms: u64,
}

pub(crate) struct Worker {
    pub cfg: Rc<Config>,
    pub scheduler: RefCell<Scheduler>,
    pub snapshots: RefCell<SnapshotCache>,
    pub rng: RefCell<SplitMix64>,
    pub metrics: RefCell<io::Metrics>,
    /// Flow control of this VM.
    pub gate: RefCell<Gate>,
    /// Requests held by flow control: context id → their state, for the root's tick.
    pub pending: RefCell<HashMap<u32, filter::Shared>>,
    /// Passive health: this worker's side (records results, keeps its own ejections).
    pub health: RefCell<Recorder>,
    /// This VM's in-flight counts and its slot in shared data (`crate::state::inflight`).
    pub inflight: RefCell<inflight::InflightTable>,
    /// The placement feed between this Envoy's workers (`crate::state::feed`).
    pub feed: RefCell<crate::state::feed::Feed>,
    /// `peers`: the shared token peers must send (resolved once; `None` when unset: the
    /// exchange path then takes nothing).
    pub peer_token: Option<String>,
    /// When this worker last re-set the per-endpoint in-flight gauges (ms; 0 = never).
    pub inflight_gauges_ms: Cell<u64>,
    /// The `tenant` labels of the token counters this VM has named (bounded).
    pub tenants: RefCell<crate::base::telemetry::BoundedLabels>,
}

impl Worker {
    /// The latest snapshot (the cached one if shared data cannot be read).
    pub fn snapshot(&self) -> Rc<Snapshot> {
        let refreshed = self.snapshots.borrow_mut().refresh(&io::HostStore);
        match refreshed {
            Ok(s) => s,
            Err(e) => {
                warn!("inference-picker: reading the snapshot failed: {e:?}");
                self.snapshots.borrow().current()
            }
        }
    }

    /// Every live VM's in-flight counts (this VM's from memory). On a store error, this VM's
    /// own counts only.
    pub fn inflight_counts(&self, now_ms: u64) -> inflight::InflightCounts {
        let mut table = self.inflight.borrow_mut();
        match table.read(&io::HostStore, now_ms) {
            Ok(c) => c,
            Err(e) => {
                warn!("inference-picker: reading in-flight counts failed: {e:?}");
                table.local().clone()
            }
        }
    }

    /// The filter root's tick: keep this VM's in-flight record alive (heartbeat, ownership
    /// check), let flow control release or reject held requests, then flush its metrics.
    /// `root_id` is the root context id (restored after acting on held requests).
    fn on_tick(&self, root_id: u32) {
        if let Err(e) = self.inflight.borrow_mut().tick(&io::HostStore, io::now_ms()) {
            warn!("inference-picker: in-flight heartbeat failed: {e:?}");
        }
        let needs_tick = self.gate.borrow().needs_tick();
        if self.gate.borrow().startup_held() > 0 {
            self.release_startup(root_id);
        }
        if needs_tick {
            self.run_flow(root_id, &self.flow_inputs());
        }
        self.flush_gate_metrics();
        self.refresh_inflight_gauges();
    }

    /// Re-sets `inference_picker_endpoint_inflight` for every endpoint of the snapshot from the
    /// shared counts, every [`INFLIGHT_GAUGE_REFRESH_MS`] (only with `filter.endpoint_metrics`).
    fn refresh_inflight_gauges(&self) {
        if !self.cfg.filter.endpoint_metrics {
            return;
        }
        let now_ms = io::now_ms();
        if now_ms.saturating_sub(self.inflight_gauges_ms.get()) < INFLIGHT_GAUGE_REFRESH_MS {
            return;
        }
        self.inflight_gauges_ms.set(now_ms);
        let snapshot = self.snapshot();
        let counts = self.inflight_counts(now_ms);
        let mut metrics = self.metrics.borrow_mut();
        for e in &snapshot.endpoints {
            let n = counts.get(&e.address);
            metrics.gauge_tagged(telemetry::ENDPOINT_INFLIGHT, &[("endpoint", &e.address)], u64::from(n));
        }
    }

    /// A request to `address` finished (its stream's `on_log`, after the in-flight -1): credit
    /// the freed room to held requests (`Gate::on_finish`) and, if this worker holds any, run
    /// its release check now rather than at the next tick. `own_context` is the calling HTTP
    /// context, restored after acting on held requests.
    pub(crate) fn on_finish(&self, address: &str, own_context: u32) {
        if !self.cfg.flow_control.enabled {
            return;
        }
        let inputs = self.flow_inputs();
        let credited = self.gate.borrow_mut().on_finish(
            &io::HostStore,
            &inputs.snapshot,
            &inputs.counts,
            address,
            inputs.now_ms,
        );
        // The release check reuses what the credit just read: nothing it reads changed since.
        if credited && self.gate.borrow().held() > 0 {
            self.run_flow(own_context, &inputs);
        }
    }

    /// What flow control judges capacity with, read once: the snapshot without the endpoints
    /// passive health ejected (as at admission), and every live VM's in-flight counts.
    fn flow_inputs(&self) -> FlowInputs {
        let store = io::HostStore;
        let snapshot = self.snapshot();
        let now_ms = io::now_ms();
        let counts = self.inflight_counts(now_ms);
        let health = filter::health_view(self, &store, now_ms);
        let snapshot =
            match crate::state::health::without_ejected(&snapshot, &health, now_ms, &self.cfg.health) {
                Some(judged) => Rc::new(judged),
                None => snapshot,
            };
        FlowInputs { snapshot, counts, now_ms }
    }

    /// Flow control's release check for this worker's queues: release or reject held requests.
    /// `own_context` is the calling context, restored after acting on held requests.
    fn run_flow(&self, own_context: u32, inputs: &FlowInputs) {
        let actions =
            self.gate.borrow_mut().tick(&io::HostStore, &inputs.snapshot, &inputs.counts, inputs.now_ms);
        for a in actions {
            match a {
                flow::Action::Release { id, waited_ms, .. } => {
                    filter::release_held(self, id, waited_ms, own_context)
                }
                flow::Action::Reject { id, waited_ms, rejection, .. } => {
                    filter::answer_held(self, id, &rejection, Some(waited_ms), own_context)
                }
            }
        }
    }

    /// Moves flow control's counters and samples into the metrics.
    fn flush_gate_metrics(&self) {
        let updates = self.gate.borrow_mut().take_metrics();
        let mut metrics = self.metrics.borrow_mut();
        metrics.report_vm_memory();
        report_skipped_records(&mut metrics);
        for u in updates {
            match u {
                MetricUpdate::Count { name, delta } => metrics.add(name, delta),
                MetricUpdate::GaugeAdd { name, delta } => metrics.gauge_add(name, delta),
                MetricUpdate::Sample { name, value } => metrics.sample(name, value),
            }
        }
    }
}

/// Adds the records this VM skipped since the last call (another build's versions,
/// `crate::base::codec`) to `inference_picker_records_skipped_total{reason=<record>}`.
pub(crate) fn report_skipped_records(metrics: &mut io::Metrics) {
    for (tag, n) in crate::base::codec::take_skipped() {
        metrics.add(telemetry::name(telemetry::RECORDS_SKIPPED, &[("reason", tag.name())]), n);
    }
}

impl Worker {
    /// Routes the requests held for the first metrics: all once the snapshot is ready, else
    /// those whose `health.startup_wait_ms` ran out (`release_held` then applies
    /// `filter.failure_mode`).
    fn release_startup(&self, root_id: u32) {
        let ready = admission::snapshot_ready(&self.snapshot());
        let now_ms = io::now_ms();
        let go = self.gate.borrow_mut().tick_startup(ready, now_ms);
        if go.is_empty() {
            return;
        }
        let outcome = if ready { "released" } else { "expired" };
        self.metrics
            .borrow_mut()
            .add(telemetry::name(telemetry::STARTUP_REQUESTS, &[("outcome", outcome)]), go.len() as u64);
        for (id, waited_ms) in go {
            filter::release_held(self, id, waited_ms, root_id);
        }
    }
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
    /// The singleton poller: which configuration it runs, and the filter's published one it
    /// follows (`crate::config::live`).
    follower: Option<Follower>,
    /// The singleton's own gauges (its configuration version).
    root_metrics: io::Metrics,
}

impl Root {
    fn new(context_id: u32) -> Self {
        Root {
            context_id,
            role: Role::Unconfigured,
            leased: None,
            follower: None,
            root_metrics: io::Metrics::default(),
        }
    }

    /// The singleton's role for a configuration: the poller, or idle when the configuration
    /// says another mode polls.
    fn poller_role(&mut self, cfg: Rc<Config>, version: u32) -> Role {
        self.root_metrics = io::Metrics::with_suffix(crate::request::pools::metric_suffix(cfg.pool.as_ref()));
        self.root_metrics.gauge(telemetry::name(telemetry::POLLER_CONFIG_VERSION, &[]), u64::from(version));
        if cfg.poller.mode != PollerMode::Singleton {
            warn!("inference-picker-poller: poller.mode is not singleton; this singleton stays idle");
            return Role::Unconfigured;
        }
        info!(
            "inference-picker-poller: configuration version {version:08x} active{}, {} static endpoints",
            pool_label(&cfg),
            cfg.endpoints.len()
        );
        // A quarter interval: the scrapes spread over four slots per interval.
        io::set_tick_period_ms(crate::poll::poller::tick_period_ms(&cfg.poller));
        Role::Poller(Box::new(poller::PollerRole::new(cfg)))
    }

    /// Singleton mode: adopt the configuration the filter's roots published, if it changed.
    fn follow_published_config(&mut self) {
        let Some(f) = &mut self.follower else {
            return;
        };
        match f.check(&io::HostStore) {
            Ok(Follow::Same) => {}
            Ok(Follow::Adopt { config, version }) => {
                info!("inference-picker-poller: following the filter's configuration version {version:08x}");
                self.role = self.poller_role(Rc::new(*config), version);
            }
            Ok(Follow::Refused { version, reason }) => error!(
                "inference-picker-poller: published configuration version {version:08x} refused, keeping \
                 version {:08x}: {reason}",
                f.current()
            ),
            Err(e) => warn!("inference-picker-poller: reading the published configuration failed: {e:?}"),
        }
    }
}

/// ` (pool NAME)`, or nothing without `pool`.
fn pool_label(cfg: &Config) -> String {
    cfg.pool.as_ref().map(|p| format!(" (pool {})", p.name)).unwrap_or_default()
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
        // This VM is going away: its in-flight counts go with it, now rather than after the TTL.
        if let Role::Filter(w) = &self.role {
            if let Err(e) = w.inflight.borrow_mut().release(&io::HostStore) {
                warn!("inference-picker: freeing the in-flight slot failed: {e:?}");
            }
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
        let version = live::digest(&raw);
        self.role = if root_id == POLLER_ROOT_ID {
            // Ticks even while idle, to follow the filter's published configuration.
            // A quarter interval: the scrapes spread over four slots per interval.
            io::set_tick_period_ms(crate::poll::poller::tick_period_ms(&cfg.poller));
            self.follower = Some(Follower::new(&raw));
            self.poller_role(cfg, version)
        } else {
            // Singleton mode: the poller follows this configuration (crate::config::live). Only a
            // valid document gets here; an invalid one was refused above and the previous
            // filter keeps serving.
            if cfg.poller.mode == PollerMode::Singleton {
                if let Err(e) = live::publish(&io::HostStore, &raw) {
                    warn!("inference-picker: publishing the configuration for the poller failed: {e:?}");
                }
            }
            info!(
                "inference-picker: configuration version {version:08x} active{}, {} static endpoints",
                pool_label(&cfg),
                cfg.endpoints.len()
            );
            if cfg.poller.mode == PollerMode::Lease {
                self.leased = Some(Box::new(poller::LeasedPoller::new(cfg.clone(), self.context_id)));
            }
            if root_id != FILTER_ROOT_ID {
                info!("inference-picker: root id {root_id:?} runs as the HTTP filter");
            }
            // Tells this VM's queues apart from the other workers' in shared data. Every VM
            // numbers its contexts alike, and their clocks can agree, so uniqueness comes from a
            // shared counter; a random id only if shared data fails.
            let seed = io::now_nanos() ^ (u64::from(self.context_id) << 32);
            let mut rng = SplitMix64::new(seed);
            let worker_id = match claim_worker_id(&io::HostStore) {
                Ok(id) => id,
                Err(e) => {
                    warn!("inference-picker: no worker id from shared data ({e:?}); using a random one");
                    rng.next_u64() | (1 << 63)
                }
            };
            let rng = SplitMix64::new(seed ^ worker_id.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            // The session-token key: from the VM's environment (host_env_keys) or inline.
            let session_keys =
                match crate::scheduler::session_keys_from_config(&cfg.scheduler.session, &|name| {
                    std::env::var(name).ok()
                }) {
                    Ok(k) => k,
                    Err(e) => {
                        error!("inference-picker: invalid configuration: {e}");
                        return false;
                    }
                };
            if session_keys.is_default() {
                warn!(
                    "inference-picker: no scheduler.session.secret_env (or secret): session tokens use the public \
                     built-in key and can be forged to pin requests to a chosen endpoint"
                );
            }
            let mut scheduler = Scheduler::new(&*cfg);
            scheduler.set_session_keys(session_keys);
            // One tick period per root: flow control's, or the poll interval when that is shorter
            // (lease mode polls from this root too).
            let period = match cfg.poller.mode {
                PollerMode::Lease => FILTER_TICK_MS.min(crate::poll::poller::tick_period_ms(&cfg.poller)),
                _ => FILTER_TICK_MS,
            };
            io::set_tick_period_ms(period);
            let mut metrics =
                io::Metrics::with_suffix(crate::request::pools::metric_suffix(cfg.pool.as_ref()));
            metrics.gauge(telemetry::name(telemetry::CONFIG_VERSION, &[]), u64::from(version));
            Role::Filter(Rc::new(Worker {
                scheduler: RefCell::new(scheduler),
                snapshots: RefCell::new(SnapshotCache::new()),
                rng: RefCell::new(rng),
                metrics: RefCell::new(metrics),
                gate: RefCell::new(Gate::new(&*cfg, worker_id)),
                pending: RefCell::new(HashMap::new()),
                health: RefCell::new(Recorder::new()),
                inflight: RefCell::new(inflight::InflightTable::new(crate::poll::lease::holder_id(
                    io::entropy(),
                    self.context_id,
                ))),
                feed: RefCell::new(crate::state::feed::Feed::default()),
                peer_token: cfg.peers.as_ref().and_then(|p| p.resolve_token(|name| std::env::var(name).ok())),
                inflight_gauges_ms: Cell::new(0),
                tenants: RefCell::new(crate::base::telemetry::BoundedLabels::new(
                    crate::base::telemetry::MAX_TENANT_LABELS,
                    crate::base::telemetry::OTHER_TENANT,
                )),
                cfg,
            }))
        };
        true
    }

    fn on_tick(&mut self) {
        self.follow_published_config();
        let now = io::now_ms();
        match &self.role {
            Role::Poller(_) | Role::Unconfigured => {}
            Role::Filter(w) => w.on_tick(self.context_id),
        }
        if let Role::Poller(p) = &mut self.role {
            p.tick(now);
        }
        if let Some(l) = &mut self.leased {
            // The filter root ticks every FILTER_TICK_MS for flow control; the lease is renewed
            // on every tick and the poller core keeps its own round cadence (poller.interval_ms).
            l.tick(now);
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        match &self.role {
            Role::Filter(w) => Some(Box::new(filter::Filter::new(context_id, w.clone()))),
            // A filter chain pointing at the poller's root id, or a failed configuration:
            // pass requests through untouched rather than half-handling them.
            _ => None,
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
