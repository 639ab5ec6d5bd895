//! `phalanx bench --trace`: records the library's hop events (target `phalanx::hop`, see
//! `phalanx::hop`) during the last timed iteration of every size and prints them in order,
//! each with its time from the start of the iteration and from the previous hop: where each
//! microsecond of a small get, broadcast or reduce goes, hop by hop. With `--local` every
//! node's hops are in this process; with one process per node, rank 0 prints its own.

use crate::bench::sync::now_ns;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer};

/// One recorded hop.
#[derive(Debug, Clone)]
pub struct Hop {
    pub t_ns: u64,
    pub thread: String,
    pub node: Option<u64>,
    pub what: String,
    pub fields: String,
}

static ARMED: AtomicBool = AtomicBool::new(false);
static HOPS: Mutex<Vec<Hop>> = Mutex::new(Vec::new());

/// Starts recording (clearing what was recorded before).
pub fn arm() {
    HOPS.lock().unwrap().clear();
    ARMED.store(true, Ordering::Release);
}

/// Stops recording and returns the hops, in time order.
pub fn take() -> Vec<Hop> {
    ARMED.store(false, Ordering::Release);
    let mut v = std::mem::take(&mut *HOPS.lock().unwrap());
    v.sort_by_key(|h| h.t_ns);
    v
}

/// Prints `hops` to stderr with times relative to `start_ns`.
pub fn print(title: &str, start_ns: u64, hops: &[Hop]) {
    let mut out = format!(
        "# trace: {title} (us from the start, +us from the previous hop, @ns on the host's monotonic clock) start@{start_ns}\n"
    );
    let mut prev = start_ns;
    for h in hops {
        let at = (h.t_ns as i128 - start_ns as i128) as f64 / 1e3;
        let gap = (h.t_ns as i128 - prev as i128) as f64 / 1e3;
        prev = h.t_ns;
        let node = h.node.map_or("-".into(), |n| n.to_string());
        let _ = writeln!(
            out,
            "#  {at:>10.1} {gap:>+9.1}  node {node:>3}  {:<18} {}{} @{}",
            h.thread, h.what, h.fields, h.t_ns
        );
    }
    eprint!("{out}");
}

/// The tracing layer that records hop events while armed.
pub struct HopRecorder;

#[derive(Default)]
struct Fields {
    node: Option<u64>,
    what: String,
    rest: String,
}

impl Visit for Fields {
    fn record_u64(&mut self, f: &Field, v: u64) {
        match f.name() {
            "node" => self.node = Some(v),
            n => {
                let _ = write!(self.rest, " {n}={v}");
            }
        }
    }

    fn record_str(&mut self, f: &Field, v: &str) {
        match f.name() {
            "message" => self.what = v.to_string(),
            n => {
                let _ = write!(self.rest, " {n}={v}");
            }
        }
    }

    fn record_debug(&mut self, f: &Field, v: &dyn std::fmt::Debug) {
        match f.name() {
            "message" => self.what = format!("{v:?}"),
            n => {
                let _ = write!(self.rest, " {n}={v:?}");
            }
        }
    }
}

impl<S: Subscriber> Layer<S> for HopRecorder {
    fn on_event(&self, ev: &Event<'_>, _: Context<'_, S>) {
        if !ARMED.load(Ordering::Acquire) || ev.metadata().target() != phalanx::hop::HOP_TARGET {
            return;
        }
        let t_ns = now_ns();
        let mut f = Fields::default();
        ev.record(&mut f);
        let thread = std::thread::current().name().unwrap_or("?").to_string();
        HOPS.lock().unwrap().push(Hop {
            t_ns,
            thread,
            node: f.node,
            what: f.what,
            fields: f.rest,
        });
    }
}
