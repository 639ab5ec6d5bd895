//! One tree position at work: `own ⊕ children` streamed into its output as the inputs fill.
//! Tasks run here on request of a coordinator (any node); the registry lets a later
//! `Cancel` find the task that produces a given output.

use super::Reducer;
use crate::hop::hop;
use crate::ops::{combine, combine_into, DType, ReduceOp};
use crate::protocol::{Msg, ReduceTask, Reply, Rid};
use crate::store::{CopyRef, CopyStatus};
use crate::transfer::{Driver, OnLanded, Transfers};
use crate::view::Fetched;
use crate::{Error, ObjectId, Result};
use phalanx_transport::NodeId;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The reduce tasks running on this node: by output object and attempt, the coordinator that
/// dispatched each and its cancel flag.
#[derive(Default)]
pub(super) struct Tasks {
    cancels: Mutex<HashMap<TaskKey, (NodeId, Arc<AtomicBool>)>>,
}

/// A task's output and attempt.
type TaskKey = (ObjectId, u64);

impl Tasks {
    /// A task dispatched by `coordinator` starts: its cancel flag.
    fn register(&self, out: &ObjectId, attempt: u64, coordinator: NodeId) -> Arc<AtomicBool> {
        let flag = Arc::new(AtomicBool::new(false));
        let key = (out.clone(), attempt);
        let entry = (coordinator, flag.clone());
        self.cancels.lock().unwrap().insert(key, entry);
        flag
    }

    /// The task holding `flag` is over: its entry goes (unless a second `Task` message with
    /// the same output and attempt, a duplicate or a forgery, replaced it meanwhile).
    fn finish(&self, out: &ObjectId, attempt: u64, flag: &Arc<AtomicBool>) {
        let key = (out.clone(), attempt);
        let mut c = self.cancels.lock().unwrap();
        if c.get(&key).is_some_and(|(_, f)| Arc::ptr_eq(f, flag)) {
            c.remove(&key);
        }
    }

    /// Stops every task `coordinator` dispatched: it died, and nothing will collect, repair or
    /// finish their reduce. Their outputs.
    fn cancel_all_of(&self, coordinator: NodeId) -> Vec<ObjectId> {
        let c = self.cancels.lock().unwrap();
        c.iter()
            .filter(|(_, (from, _))| *from == coordinator)
            .map(|((out, _), (_, f))| {
                f.store(true, Ordering::Release);
                out.clone()
            })
            .collect()
    }

    /// Whether an attempt of the task producing `out` other than `attempt`, and cancelled,
    /// still runs here (it holds the output until it notices).
    fn cancelled_other(&self, out: &ObjectId, attempt: u64) -> bool {
        let c = self.cancels.lock().unwrap();
        c.iter()
            .any(|((o, a), (_, f))| o == out && *a != attempt && f.load(Ordering::Acquire))
    }

    /// `from` stops attempt `attempt` of the task producing `out`: only the coordinator that
    /// dispatched it may (another member's forged `Cancel` stops nothing). Whether it did.
    fn cancel(&self, from: NodeId, out: &ObjectId, attempt: u64) -> bool {
        let key = (out.clone(), attempt);
        match self.cancels.lock().unwrap().get(&key) {
            Some((coordinator, f)) if *coordinator == from => {
                f.store(true, Ordering::Release);
                true
            }
            _ => false,
        }
    }
}

enum Input {
    Copy(crate::store::CopyRef),
    Owned(Vec<u8>),
}

/// A task's inputs: its own object (a slice of it at `own_offset`) and its children's
/// outputs.
struct Inputs {
    own: Input,
    children: Vec<Input>,
}

/// One task's output being filled: the task, its output, its cancel flag.
struct Job<'a> {
    t: &'a ReduceTask,
    out: &'a CopyRef,
    cancel: &'a AtomicBool,
}

impl From<Fetched> for Input {
    fn from(f: Fetched) -> Input {
        match f {
            Fetched::Copy(c) => Input::Copy(c),
            Fetched::Owned(v) => Input::Owned(v),
        }
    }
}

impl Input {
    /// Bytes valid now; an error if the copy failed or was deleted unfinished.
    fn available(&self) -> Result<u64> {
        match self {
            Input::Copy(c) => match c.status() {
                CopyStatus::Failed => Err(Error::NotFound(c.id())),
                CopyStatus::Filling if c.is_detached() => Err(Error::NotFound(c.id())),
                _ => Ok(c.watermark()),
            },
            Input::Owned(v) => Ok(v.len() as u64),
        }
    }

    fn size(&self) -> u64 {
        match self {
            Input::Copy(c) => c.size(),
            Input::Owned(v) => v.len() as u64,
        }
    }

    fn wait_for(&self, n: u64, timeout: Duration) -> Result<u64> {
        match self {
            Input::Copy(c) => c.wait_for(n, timeout),
            Input::Owned(v) => Ok(v.len() as u64),
        }
    }

    fn bytes(&self, from: u64, to: u64) -> &[u8] {
        match self {
            Input::Copy(c) => c.filled(from, to - from),
            Input::Owned(v) => &v[from as usize..to as usize],
        }
    }
}

impl Reducer {
    /// A coordinator asks for one position: computed by a worker, answered with `Ack` or the
    /// error when done (nothing if cancelled). Runs on a transport thread: never blocks.
    pub(super) fn start_task(self: &Arc<Self>, from: NodeId, rid: Rid, task: ReduceTask) {
        // Registered before the thread starts, so a Cancel that follows on the same link
        // always finds it.
        let cancel = self.tasks.register(&task.out, task.attempt, from);
        let (out, attempt, flag) = (task.out.clone(), task.attempt, cancel.clone());
        let me = self.clone();
        let spawned = self.workers.spawn(move || {
            hop!(me.id, "task running");
            let reply = match me.run_task(&task, &cancel, from) {
                Ok(()) => Reply::Ack,
                Err(e) => Reply::Error(e.to_string()),
            };
            tracing::debug!(
                node = me.id,
                out = task.out.as_str(),
                ?reply,
                "reduce task ended"
            );
            me.tasks.finish(&task.out, task.attempt, &cancel);
            if !cancel.load(Ordering::Acquire) {
                let _ = me.rpc.send(from, Msg::Reply { rid, reply });
            } else if matches!(reply, Reply::Error(_)) && me.members.is_down(from) {
                // Stopped because its coordinator died: no reset or repair will follow, so the
                // unfinished output leaves the directory (its readers are told it is lost,
                // `Shard::tick`, rather than wait for bytes that will not come).
                me.dir.withdraw(std::slice::from_ref(&task.out));
            }
        });
        if let Err(e) = spawned {
            self.tasks.finish(&out, attempt, &flag);
            let reply = Reply::Error(format!("spawn: {e}"));
            self.rpc
                .send_from_transport_thread(from, Msg::Reply { rid, reply });
        }
    }

    /// `coordinator` died: the reduce tasks it dispatched here stop (see `start_task`), and
    /// their unfinished outputs fail at once, before this node republishes its copies to the
    /// new owners of the dead node's entries (`after_death`): republished, a dead task's
    /// output would pass for a producer's copy there.
    pub(crate) fn coordinator_down(&self, coordinator: NodeId) {
        let outs = self.tasks.cancel_all_of(coordinator);
        for out in &outs {
            if let Some(c) = self.store.lookup(out) {
                if c.status() != CopyStatus::Complete {
                    c.fail();
                }
            }
        }
        if !outs.is_empty() {
            tracing::debug!(
                node = self.id,
                coordinator,
                tasks = outs.len(),
                "reduce tasks of a dead coordinator stopped"
            );
        }
    }

    /// `from` stops the task producing `out` dispatched as `attempt`, if it runs here and
    /// `from` dispatched it (a later dispatch under the same name is another attempt and runs
    /// on).
    pub(super) fn cancel_task(&self, from: NodeId, out: &ObjectId, attempt: u64) {
        if !self.tasks.cancel(from, out, attempt) {
            tracing::debug!(
                node = self.id,
                from,
                out = out.as_str(),
                attempt,
                "cancel of no task here"
            );
        }
    }

    /// Waits (at most [`SUPERSEDED_WAIT`]) until no cancelled attempt of `t` runs here.
    fn wait_cancelled_others(&self, t: &ReduceTask, cancel: &AtomicBool) -> Result<()> {
        let deadline = Instant::now() + SUPERSEDED_WAIT.min(self.cfg.op_timeout);
        while self.tasks.cancelled_other(&t.out, t.attempt) {
            if cancel.load(Ordering::Acquire) {
                let why = format!("reduce task for {} cancelled", t.out);
                return Err(Error::InvalidArgument(why));
            }
            if Instant::now() >= deadline {
                return Err(Error::AlreadyExists(t.out.clone()));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    fn input(&self, id: &ObjectId) -> Result<Input> {
        Ok(self.transfers.fetch(id)?.into())
    }

    /// The children's outputs, each pulled at once from the node that produces it (no
    /// directory round trip; see `Transfers::fetch_from`): the pulls overlap. A child said
    /// to be on this node is here or not placed yet ([`ReduceTask::children_at`]): asked of
    /// the directory, after the others' pulls have started.
    fn inputs(&self, t: &ReduceTask, cancel: &AtomicBool) -> Result<Vec<Input>> {
        let mut inputs: Vec<Option<Input>> = Vec::with_capacity(t.children.len());
        for (id, &at) in t.children.iter().zip(&t.children_at) {
            inputs.push(match at == self.id {
                true => None,
                false => Some(self.transfers.fetch_from(id, at, t.size, None)?.into()),
            });
        }
        inputs
            .into_iter()
            .zip(&t.children)
            .map(|(i, id)| match i {
                Some(i) => Ok(i),
                None => self.located_input(id, cancel),
            })
            .collect()
    }

    /// A child through the directory, as soon as it is there (here or anywhere): asked again
    /// every [`LOCATE_SLICE`], so that a cancel is seen while it is not, and given up after
    /// the op timeout.
    fn located_input(&self, id: &ObjectId, cancel: &AtomicBool) -> Result<Input> {
        let deadline = Instant::now() + self.cfg.op_timeout;
        loop {
            let slice = (Instant::now() + LOCATE_SLICE).min(deadline);
            match self.transfers.fetch_until(id, &[], Driver::Worker, slice) {
                Err(Error::Timeout(..))
                    if Instant::now() < deadline && !cancel.load(Ordering::Acquire) =>
                {
                    continue
                }
                r => return Ok(r?.into()),
            }
        }
    }

    /// Runs one tree position; called on the node that holds `task.own`.
    fn run_task(&self, t: &ReduceTask, cancel: &AtomicBool, coordinator: NodeId) -> Result<()> {
        let cancelled = || Error::InvalidArgument(format!("reduce task for {} cancelled", t.out));
        // The coordinator checks these; a task from elsewhere is checked again (a size that is
        // not a whole number of elements would never finish combining).
        let esz = t.dtype.size() as u64;
        if !t.size.is_multiple_of(esz) || t.chunk == 0 || t.children_at.len() != t.children.len() {
            return Err(Error::InvalidArgument(format!(
                "reduce task for {}: {} bytes of {}-byte elements, chunk {}, {} children at {} nodes",
                t.out,
                t.size,
                esz,
                t.chunk,
                t.children.len(),
                t.children_at.len()
            )));
        }
        let own = self.input(&t.own)?;
        let children = self.inputs(t, cancel)?;
        let slice_ok = t
            .own_offset
            .checked_add(t.size)
            .is_some_and(|end| end <= own.size() && t.own_offset.is_multiple_of(esz));
        if !slice_ok {
            return Err(Error::InvalidArgument(format!(
                "reduce input {} has {} bytes: no {}-byte slice at {}",
                t.own,
                own.size(),
                t.size,
                t.own_offset
            )));
        }
        for (id, i) in t.children.iter().zip(&children) {
            if i.size() != t.size {
                return Err(Error::InvalidArgument(format!(
                    "reduce input {id} has {} bytes, expected {}",
                    i.size(),
                    t.size
                )));
            }
        }
        if cancel.load(Ordering::Acquire) {
            return Err(cancelled());
        }
        let (out, evicted) = match self.store.create_output(&t.out, t.size) {
            // A repair sent this attempt here while the one it replaced, cancelled (its
            // Cancel came first on the same link), still fills the output: it stops at its
            // next step; then the output is this attempt's.
            Err(Error::AlreadyExists(_)) if self.tasks.cancelled_other(&t.out, t.attempt) => {
                self.wait_cancelled_others(t, cancel)?;
                self.store.create_output(&t.out, t.size)?
            }
            made => made?,
        };
        self.dir.withdraw(&evicted);
        let job = Job {
            t,
            out: &out,
            cancel,
        };
        let r = self.fill_reduce_output(&job, Inputs { own, children });
        if r.is_err() {
            // Readers of the partial output (local ones and the pulls it serves) get an error
            // now instead of waiting for bytes that will not come.
            out.fail();
            return r;
        }
        // The result's completion went to its shard without a reply. A shard on this node,
        // or on the coordinator (our answer follows the same link), has it before the
        // reduce returns; a shard elsewhere is asked once, which it answers after it.
        let shard = self.dir.shard_of(&t.out);
        if t.result && shard != self.id && shard != coordinator {
            self.dir.query_at(shard, &t.out)?;
        }
        Ok(())
    }

    /// Streams `own ⊕ children` into `out` chunk by chunk as the inputs fill: a medium
    /// output where its inputs land ([`Combiner`]), a large one on this task's thread.
    fn fill_reduce_output(&self, job: &Job, inputs: Inputs) -> Result<()> {
        let t = job.t;
        // Published partial from the start: readers stream it, and a reset or delete of the
        // output always finds this copy.
        self.dir.publish(&t.out, t.size, false)?;
        if t.size <= COMBINE_WHERE_LANDED_MAX {
            self.combine_where_landed(job, inputs)?;
        } else {
            self.combine_here(job, &inputs)?;
        }
        job.stopped()?;
        self.dir.publish(&t.out, t.size, true)?;
        Ok(())
    }

    /// A medium output computed by whichever thread lands its inputs' bytes (see
    /// [`Combiner`]); this thread only watches: it combines what landed when woken (the
    /// output's end, an input's failure) or every `CANCEL_POLL`, and gives up on a cancel or
    /// on `op_timeout` without progress.
    fn combine_where_landed(&self, job: &Job, inputs: Inputs) -> Result<()> {
        let (t, out) = (job.t, job.out);
        let watched: Vec<ObjectId> = std::iter::once(&inputs.own)
            .chain(&inputs.children)
            .filter_map(|i| match i {
                Input::Copy(c) if c.status() != CopyStatus::Complete => Some(c.id()),
                _ => None,
            })
            .collect();
        let comb = Arc::new(Combiner {
            node: self.id,
            op: t.op,
            dtype: t.dtype,
            base: t.own_offset,
            chunk: (t.chunk / t.dtype.size() as u64).max(1) * t.dtype.size() as u64,
            inputs,
            out: out.clone(),
            transfers: self.transfers.clone(),
            at: Mutex::new(0),
        });
        let hook: Arc<dyn OnLanded> = comb.clone();
        for id in &watched {
            self.transfers.watch(id, hook.clone());
        }
        let r = (|| {
            let mut last = 0;
            let mut progressed = Instant::now();
            loop {
                let seen = out.kicks();
                if comb.step(true)? {
                    return Ok(());
                }
                job.stopped()?;
                let at = out.watermark();
                if at > last {
                    (last, progressed) = (at, Instant::now());
                } else if progressed.elapsed() >= self.cfg.op_timeout {
                    return Err(Error::Timeout(
                        self.cfg.op_timeout,
                        format!("the inputs of {}", t.out),
                    ));
                }
                out.wait_kick(seen, COMBINE_POLL);
            }
        })();
        for id in &watched {
            self.transfers.unwatch(id, &hook);
        }
        r
    }

    /// A large output computed on this task's thread, woken as its inputs fill.
    fn combine_here(&self, job: &Job, inputs: &Inputs) -> Result<()> {
        let (t, out) = (job.t, job.out);
        let esz = t.dtype.size() as u64;
        let base = t.own_offset;
        let chunk = (t.chunk / esz).max(1) * esz;
        let timeout = self.cfg.op_timeout;
        let mut off = 0;
        while off < t.size {
            let need = (off + esz).min(t.size);
            let mut avail = t.size;
            for (k, i) in std::iter::once(&inputs.own)
                .chain(&inputs.children)
                .enumerate()
            {
                // Own bytes are read at `base` (a slice of the source); children's from 0.
                let shift = if k == 0 { base } else { 0 };
                // Wait in slices so a cancel is seen while an input stalls.
                let deadline = Instant::now() + timeout;
                let got = loop {
                    job.stopped()?;
                    match i.wait_for(need + shift, Duration::from_millis(100)) {
                        Err(Error::Timeout(..)) if Instant::now() < deadline => continue,
                        r => break r?,
                    }
                };
                avail = avail.min(got.saturating_sub(shift));
            }
            let end = (off + chunk).min(off + (avail - off) / esz * esz);
            hop!(self.id, "reduce inputs ready", off = off, end = end);
            fill_combined(out, (t.op, t.dtype), base, inputs, (off, end))?;
            // On to the parent's pull at once, if it is waiting (see `transfer/serve.rs`).
            self.transfers.landed(out);
            off = end;
        }
        Ok(())
    }
}

/// How long a task asks the directory for a child not placed when it started, before it
/// looks for a cancel and asks again.
const LOCATE_SLICE: Duration = Duration::from_millis(200);

/// How long a task waits for the cancelled attempt it replaces to let go of its output (it
/// notices its cancel within a combining step or a [`COMBINE_POLL`]).
const SUPERSEDED_WAIT: Duration = Duration::from_secs(1);

/// Outputs up to this size are combined where their inputs land ([`Combiner`]): a combine
/// of 256 KiB takes tens of microseconds, which a transport thread can spare; a larger one
/// would hold up the other streams it reads.
const COMBINE_WHERE_LANDED_MAX: u64 = 256 << 10;

/// How often a task whose output is combined where its inputs land looks for a cancel, a
/// stall or bytes nobody combined.
const COMBINE_POLL: Duration = Duration::from_millis(50);

impl Job<'_> {
    /// An error if the task was cancelled or its output deleted.
    fn stopped(&self) -> Result<()> {
        if self.cancel.load(Ordering::Acquire) || self.out.is_detached() {
            let t = &self.t.out;
            return Err(Error::InvalidArgument(format!(
                "reduce task for {t} cancelled"
            )));
        }
        Ok(())
    }
}

/// Appends `own[base + off, base + end) ⊕ children[off, end)` to `out`.
fn fill_combined(
    out: &CopyRef,
    (op, dtype): (ReduceOp, DType),
    base: u64,
    inputs: &Inputs,
    (off, end): (u64, u64),
) -> Result<()> {
    let own = &inputs.own;
    out.fill_with(end - off, |dst| match inputs.children.split_first() {
        Some((first, rest)) => {
            combine_into(
                op,
                dtype,
                dst,
                own.bytes(base + off, base + end),
                first.bytes(off, end),
            );
            for c in rest {
                combine(op, dtype, dst, c.bytes(off, end));
            }
        }
        None => dst.copy_from_slice(own.bytes(base + off, base + end)),
    })
}

/// A medium reduce output computed by whichever thread lands the bytes that complete a piece
/// of its inputs (`Transfers::landed`): a transport thread taking in a child's last bytes
/// combines the piece and writes it on to the parent at once, without waking the task's
/// thread; on 8 hosts sharing 2 cores that wake-up was 0.1-0.2 ms per level of the tree.
/// One thread combines at a time (`at`), so the output has a single filler.
struct Combiner {
    node: NodeId,
    op: ReduceOp,
    dtype: DType,
    /// Where the own input's slice starts.
    base: u64,
    chunk: u64,
    inputs: Inputs,
    out: CopyRef,
    transfers: Arc<Transfers>,
    /// How far the output is combined; held while combining.
    at: Mutex<u64>,
}

impl Combiner {
    /// Combines every piece all inputs hold; true once the output is complete. With `wait`
    /// it waits for a combine under way elsewhere, else it leaves it to that thread. An
    /// input that failed is an error.
    fn step(&self, wait: bool) -> Result<bool> {
        let mut at = match self.at.try_lock() {
            Ok(g) => g,
            Err(_) if wait => self.at.lock().unwrap(),
            Err(_) => return Ok(false),
        };
        let size = self.out.size();
        let esz = self.dtype.size() as u64;
        while *at < size {
            if self.out.is_detached() {
                // Failed or deleted (the task gave up): nothing more goes into it.
                return Err(Error::NotFound(self.out.id()));
            }
            let own = self.inputs.own.available()?;
            let mut avail = own.saturating_sub(self.base).min(size);
            for c in &self.inputs.children {
                avail = avail.min(c.available()?);
            }
            let end = (*at + self.chunk).min(*at + avail.saturating_sub(*at) / esz * esz);
            if end <= *at {
                return Ok(false);
            }
            hop!(self.node, "reduce inputs ready", off = *at, end = end);
            let kind = (self.op, self.dtype);
            fill_combined(&self.out, kind, self.base, &self.inputs, (*at, end))?;
            *at = end;
            // On to the parent's pull at once, if it is waiting (see `transfer/serve.rs`).
            self.transfers.landed(&self.out);
        }
        Ok(true)
    }
}

impl OnLanded for Combiner {
    fn landed(&self, _copy: &CopyRef) {
        // The task's thread hears of an input's failure (and the output's end) through a
        // kick; the output's completion kicks by itself.
        if self.step(false).is_err() {
            self.out.kick();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A repair's new attempt waits for an older attempt of the same output only once that
    /// one is cancelled, and no longer than it runs.
    #[test]
    fn a_new_attempt_waits_only_for_a_cancelled_older_one() {
        let t = Tasks::default();
        let out = ObjectId::new("t");
        let old = t.register(&out, 1, 7);
        let _new = t.register(&out, 2, 7);
        assert!(
            !t.cancelled_other(&out, 2),
            "the older attempt is not cancelled"
        );
        assert!(t.cancel(7, &out, 1));
        assert!(t.cancelled_other(&out, 2));
        assert!(!t.cancelled_other(&ObjectId::new("u"), 2), "another output");
        t.finish(&out, 1, &old);
        assert!(!t.cancelled_other(&out, 2), "the older attempt ended");
    }

    /// A cancel stops only the attempt it names, and only when it comes from the coordinator
    /// that dispatched it; a finished task's entry goes, a later dispatch's stays.
    #[test]
    fn only_the_dispatching_coordinator_cancels_and_only_its_attempt() {
        let t = Tasks::default();
        let out = ObjectId::new("t");
        let first = t.register(&out, 1, 7);
        let second = t.register(&out, 2, 7);
        assert!(
            !t.cancel(3, &out, 2),
            "another member's cancel stops nothing"
        );
        assert!(!second.load(Ordering::Acquire));
        assert!(t.cancel(7, &out, 1));
        assert!(first.load(Ordering::Acquire));
        assert!(!second.load(Ordering::Acquire), "the later attempt runs on");
        t.finish(&out, 1, &first);
        assert!(!t.cancel(7, &out, 1), "a finished task is gone");
        assert!(t.cancel(7, &out, 2));
        assert!(second.load(Ordering::Acquire));
    }
}
