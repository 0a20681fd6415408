//! Phase timing for profiling inside Envoy (feature `phase-timing`, never in the release build):
//! `timed!("name", expr)` adds the host clock's time around `expr` to a per-VM table, and every
//! `REPORT_EVERY` requests the table is logged (mean µs per request per phase, and per call).
//! Without the feature `timed!` is `expr`.

#[cfg(feature = "phase-timing")]
mod on {
    use std::cell::RefCell;

    const REPORT_EVERY: u64 = 4000;

    /// Requests since the last report, and per phase: (name, total ns, calls).
    type Table = (u64, Vec<(&'static str, u64, u64)>);

    thread_local! {
        static TABLE: RefCell<Table> = const { RefCell::new((0, Vec::new())) };
    }

    pub fn record(name: &'static str, ns: u64) {
        TABLE.with(|t| {
            let mut t = t.borrow_mut();
            match t.1.iter_mut().find(|e| e.0 == name) {
                Some(e) => {
                    e.1 += ns;
                    e.2 += 1;
                }
                None => t.1.push((name, ns, 1)),
            }
        });
    }

    /// One request ended: every `REPORT_EVERY`, log the table and start again.
    pub fn request_ended() {
        TABLE.with(|t| {
            let mut t = t.borrow_mut();
            t.0 += 1;
            if t.0 < REPORT_EVERY {
                return;
            }
            let n = t.0;
            let mut line = format!("inference-picker phase-timing over {n} requests (us/request, us/call):");
            for (name, ns, calls) in &t.1 {
                line.push_str(&format!(
                    " {name}={:.1}/{:.2}x{}",
                    *ns as f64 / 1000.0 / n as f64,
                    *ns as f64 / 1000.0 / *calls as f64,
                    calls
                ));
            }
            log::warn!("{line}");
            t.0 = 0;
            t.1.clear();
        });
    }
}

#[cfg(feature = "phase-timing")]
pub use on::{record, request_ended};

/// Without the feature: nothing to count.
#[cfg(not(feature = "phase-timing"))]
pub fn request_ended() {}

#[cfg(feature = "phase-timing")]
macro_rules! timed {
    ($name:expr, $e:expr) => {{
        let t0 = crate::host::io::now_nanos();
        let r = $e;
        crate::host::prof::record($name, crate::host::io::now_nanos().saturating_sub(t0));
        r
    }};
}

#[cfg(not(feature = "phase-timing"))]
macro_rules! timed {
    ($name:expr, $e:expr) => {
        $e
    };
}

pub(crate) use timed;
