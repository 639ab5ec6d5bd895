//! The node's worker threads for blocking work (serving a pull, driving one, running a reduce
//! task): a job goes to an idle worker when there is one, and a new worker starts only when
//! all are busy, so steady traffic creates no threads. Jobs block on their peers (a source
//! waits for bytes a partial copy does not have yet), so the pool never queues a job behind
//! another: a bounded pool could deadlock a chain of forwarding nodes. A worker idle for
//! `IDLE_EXIT` ends.

use crossbeam_channel::{Receiver, Sender};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long an idle worker waits for a job before it ends.
const IDLE_EXIT: Duration = Duration::from_secs(10);

type Job = Box<dyn FnOnce() + Send>;

pub(crate) struct Workers {
    node: phalanx_transport::NodeId,
    /// Jobs for idle workers; a job is sent only when a worker is known to be waiting.
    jobs: Sender<Job>,
    job_rx: Receiver<Job>,
    state: Arc<Counts>,
}

#[derive(Default)]
struct Counts {
    /// Workers waiting for a job and not yet promised one.
    idle: AtomicUsize,
    /// Workers alive.
    alive: AtomicUsize,
}

impl Workers {
    pub fn new(node: phalanx_transport::NodeId) -> Workers {
        let (jobs, job_rx) = crossbeam_channel::unbounded();
        Workers {
            node,
            jobs,
            job_rx,
            state: Arc::new(Counts::default()),
        }
    }

    /// Runs `job` on an idle worker, or on a new one if every worker is busy.
    pub fn spawn(&self, job: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
        // Claim an idle worker; it is then bound to take the next job from the channel.
        let claimed = self
            .state
            .idle
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        if claimed {
            self.jobs
                .send(Box::new(job))
                .expect("the pool holds a receiver");
            return Ok(());
        }
        let rx = self.job_rx.clone();
        let state = self.state.clone();
        state.alive.fetch_add(1, Ordering::AcqRel);
        let first: Job = Box::new(job);
        let spawned = phalanx_transport::threads::spawn(self.node, "worker", move || {
            worker(first, rx, state.clone())
        });
        if spawned.is_err() {
            self.state.alive.fetch_sub(1, Ordering::AcqRel);
        }
        spawned.map(|_| ())
    }

    /// Workers alive now (busy or idle).
    #[cfg(test)]
    pub fn alive(&self) -> usize {
        self.state.alive.load(Ordering::Acquire)
    }
}

fn worker(first: Job, rx: Receiver<Job>, state: Arc<Counts>) {
    first();
    'work: loop {
        state.idle.fetch_add(1, Ordering::AcqRel);
        loop {
            match rx.recv_timeout(IDLE_EXIT) {
                Ok(job) => {
                    job();
                    continue 'work;
                }
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break 'work,
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    // Leave only if no job was promised to an idle worker meanwhile; if one
                    // was, some idle worker (maybe this one) must take it: wait again.
                    let left = state
                        .idle
                        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                        .is_ok();
                    if left {
                        break 'work;
                    }
                }
            }
        }
    }
    state.alive.fetch_sub(1, Ordering::AcqRel);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;

    #[test]
    fn idle_workers_are_reused_and_busy_ones_never_block_a_job() {
        let w = Workers::new(4_000_000_000);
        let (tx, rx) = crossbeam_channel::unbounded();
        for i in 0..3 {
            let tx = tx.clone();
            w.spawn(move || tx.send(i).unwrap()).unwrap();
            assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(i));
            // Let the worker go idle before the next job.
            while w.state.idle.load(Ordering::Acquire) == 0 {
                std::thread::yield_now();
            }
        }
        assert_eq!(
            w.alive(),
            1,
            "one worker did all three jobs one after another"
        );
        // Three jobs that wait for each other: each must get a worker of its own.
        let b = Arc::new(Barrier::new(3));
        for i in 0..3 {
            let (b, tx) = (b.clone(), tx.clone());
            w.spawn(move || {
                b.wait();
                tx.send(10 + i).unwrap();
            })
            .unwrap();
        }
        let mut got: Vec<i32> = (0..3)
            .map(|_| rx.recv_timeout(Duration::from_secs(5)).unwrap())
            .collect();
        got.sort();
        assert_eq!(got, vec![10, 11, 12]);
        assert_eq!(w.alive(), 3);
    }
}
