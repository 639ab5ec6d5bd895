//! Blocking calls without holding the GIL and with Ctrl-C honoured.
//!
//! A Phalanx call that waits on peers (get, reduce, gather) cannot be interrupted from inside,
//! so it runs on a pooled thread while the calling thread waits for its result with the GIL
//! released, waking every `SLICE` to let Python run its signal handlers (`KeyboardInterrupt`)
//! and to honour the caller's timeout. An abandoned call finishes on its pooled thread (at the
//! latest after the node's `op_timeout`) and its result is dropped.
//!
//! Every job gets a thread of its own (an idle one, or a new one up to `MAX_THREADS`), so a
//! call that waits long never delays another; beyond the bound jobs queue.

use crate::errors;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use pyo3::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How often a waiting caller looks at signals and at its timeout.
const SLICE: Duration = Duration::from_millis(50);
/// How long a caller polls for a result, and a pooled thread for its next job, before
/// sleeping: `PHALANX_PY_SPIN_US` (caller) and `PHALANX_PY_WORKER_SPIN_US` (pooled thread),
/// default 200 us each; 0 sleeps at once (the right choice when every core is busy).
fn spin(var: &str) -> Duration {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_micros(200), Duration::from_micros)
}

fn caller_spin() -> Duration {
    static S: OnceLock<Duration> = OnceLock::new();
    *S.get_or_init(|| spin("PHALANX_PY_SPIN_US"))
}

fn worker_spin() -> Duration {
    static S: OnceLock<Duration> = OnceLock::new();
    *S.get_or_init(|| spin("PHALANX_PY_WORKER_SPIN_US"))
}
/// Upper bound of pooled threads per process.
const MAX_THREADS: usize = 256;

type Job = Box<dyn FnOnce() + Send>;

struct Pool {
    tx: Sender<Job>,
    rx: Receiver<Job>,
    /// Threads waiting for a job that no submitted job has claimed yet.
    idle: AtomicUsize,
    threads: AtomicUsize,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let (tx, rx) = crossbeam_channel::unbounded();
        Pool {
            tx,
            rx,
            idle: AtomicUsize::new(0),
            threads: AtomicUsize::new(0),
        }
    })
}

impl Pool {
    fn submit(&'static self, job: Job) {
        // Claim an idle thread, or start one while under the bound.
        let claimed = self
            .idle
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |i| i.checked_sub(1))
            .is_ok();
        if !claimed && self.threads.fetch_add(1, Ordering::AcqRel) < MAX_THREADS {
            let rx = self.rx.clone();
            let started = std::thread::Builder::new()
                .name("phalanx-py".into())
                .spawn(move || loop {
                    let Some(job) = next_job(&rx) else { return };
                    job();
                    self.idle.fetch_add(1, Ordering::AcqRel);
                });
            if started.is_err() {
                self.threads.fetch_sub(1, Ordering::AcqRel);
            }
        } else if !claimed {
            self.threads.fetch_sub(1, Ordering::AcqRel);
        }
        // The channel is never closed: the pool lives as long as the process.
        let _ = self.tx.send(job);
    }
}

/// The next job: looked for while yielding for `worker_spin()` (calls tend to come in runs: a
/// thread that just finished one is usually handed the next within that time, without a
/// wake-up), then waited for.
fn next_job(rx: &Receiver<Job>) -> Option<Job> {
    let until = Instant::now() + worker_spin();
    while Instant::now() < until {
        if let Ok(job) = rx.try_recv() {
            return Some(job);
        }
        std::thread::yield_now();
    }
    rx.recv().ok()
}

/// Runs `f` on a pooled thread and waits for it without the GIL; `timeout` (seconds, `None`
/// for no limit of the caller's own) raises `phalanx.Timeout`, Ctrl-C `KeyboardInterrupt`.
pub fn run<T, F>(py: Python<'_>, timeout: Option<f64>, what: &str, f: F) -> PyResult<T>
where
    T: Send + 'static,
    F: FnOnce() -> phalanx::Result<T> + Send + 'static,
{
    let deadline = deadline(timeout)?;
    let (tx, rx) = crossbeam_channel::bounded(1);
    pool().submit(Box::new(move || {
        // The caller may have left (timeout, Ctrl-C): then nobody wants the result.
        let _ = tx.send(f());
    }));
    // A short call's result usually comes within tens of microseconds: look for it while
    // yielding the core (the node's threads need it) before sleeping in slices.
    let early = py.detach(|| {
        let until = Instant::now() + caller_spin();
        loop {
            if let Ok(r) = rx.try_recv() {
                return Some(r);
            }
            if Instant::now() >= until {
                return None;
            }
            std::thread::yield_now();
        }
    });
    if let Some(r) = early {
        return r.map_err(errors::to_py);
    }
    // Disconnected (Err) means the job's thread dropped the sender without sending.
    let waited = wait_sliced(py, deadline, |slice| match rx.recv_timeout(slice) {
        Ok(r) => Some(Ok(r)),
        Err(RecvTimeoutError::Timeout) => None,
        Err(RecvTimeoutError::Disconnected) => Some(Err(())),
    })?;
    match waited {
        Some(Ok(r)) => r.map_err(errors::to_py),
        Some(Err(())) => Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
            "the thread running {what} panicked"
        ))),
        None => Err(errors::Timeout::new_err(format!(
            "timed out after {} s waiting for {what}",
            timeout.unwrap_or_default()
        ))),
    }
}

/// Calls `step` without the GIL with slices of at most `SLICE` until it yields a value,
/// running Python's signal handlers between slices (Ctrl-C raises `KeyboardInterrupt`);
/// `None` once `deadline` has passed.
pub fn wait_sliced<T: Send>(
    py: Python<'_>,
    deadline: Option<Instant>,
    mut step: impl FnMut(Duration) -> Option<T> + Send,
) -> PyResult<Option<T>> {
    loop {
        let slice = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()).min(SLICE),
            None => SLICE,
        };
        if let Some(v) = py.detach(|| step(slice)) {
            return Ok(Some(v));
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
    }
}

/// The instant a timeout in seconds ends at; rejects negative and non-finite values.
pub fn deadline(timeout: Option<f64>) -> PyResult<Option<Instant>> {
    match timeout {
        None => Ok(None),
        // A timeout too long to represent is no timeout.
        Some(t) if t.is_finite() && t >= 0.0 => Ok(Duration::try_from_secs_f64(t)
            .ok()
            .and_then(|d| Instant::now().checked_add(d))),
        Some(t) => Err(errors::InvalidArgument::new_err(format!(
            "timeout must be a non-negative number of seconds, got {t}"
        ))),
    }
}

/// A duration in seconds from Python, checked.
pub fn duration(secs: f64, what: &str) -> PyResult<Duration> {
    if secs.is_finite() && secs > 0.0 {
        Duration::try_from_secs_f64(secs)
            .map_err(|e| errors::InvalidArgument::new_err(format!("{what}: {e}")))
    } else {
        Err(errors::InvalidArgument::new_err(format!(
            "{what} must be a positive number of seconds, got {secs}"
        )))
    }
}
