//! The coordinator of one reduce: an event loop over source subscriptions, task replies and
//! peer deaths that fills the tree in arrival order, dispatches tasks and repairs the tree.

use super::run::{Action, LinkModel, Run};
use super::{Hooks, ReduceOptions, ReduceOutcome, Reducer, TreeSlot};
use crate::directory::DirClient;
use crate::hop::hop;
use crate::membership::Membership;
use crate::ops::{DType, ReduceOp};
use crate::protocol::{ObjectInfo, ReduceMsg, Reply};
use crate::rpc::{unexpected_reply, Rpc};
use crate::{Error, ObjectId, Result};
use crossbeam_channel::{Select, Sender, TryRecvError};
use phalanx_transport::NodeId;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tracing::warn;

/// Failed tasks of one position before the whole reduce gives up.
const MAX_TASK_ERRORS: u32 = 3;

/// How often a waiting coordinator looks whether its node has closed.
const CLOSED_POLL: Duration = Duration::from_millis(250);

impl Reducer {
    /// Round trip to a peer: the smallest of recent calls, else measured now (the min of a few
    /// directory queries).
    fn measure_latency(&self) -> f64 {
        if let Some(l) = self.cfg.latency_override {
            return l.as_secs_f64();
        }
        if let Some(rtt) = self.rpc.rtt_estimate() {
            return rtt.as_secs_f64().min(1.0);
        }
        let peer = (self.id + 1) % self.members.nodes();
        let probe = ObjectId::new("phalanx/latency-probe");
        (0..3)
            .filter_map(|_| {
                let t = Instant::now();
                self.dir.query_at(peer, &probe).ok()?;
                Some(t.elapsed().as_secs_f64())
            })
            .fold(f64::INFINITY, f64::min)
            .min(1.0)
    }

    /// Runs one reduce to the end; `hooks.placed` hears the inputs once the tree is full,
    /// `hooks.on_tree` runs when the first task is dispatched. A reduce that fails gives the
    /// sources it claimed back to the pool.
    pub(super) fn coordinate_reduce(
        &self,
        target: ObjectId,
        sources: &[ObjectId],
        num: usize,
        kind: (ReduceOp, DType),
        opts: &ReduceOptions,
        hooks: Hooks,
    ) -> Result<ReduceOutcome> {
        let r = self.run_coordinator(target.clone(), sources, num, kind, opts, hooks);
        if let (Err(_), Some(c)) = (&r, &opts.claims) {
            c.release(&target);
        }
        r
    }

    fn run_coordinator(
        &self,
        target: ObjectId,
        sources: &[ObjectId],
        num: usize,
        (op, dtype): (ReduceOp, DType),
        opts: &ReduceOptions,
        hooks: Hooks,
    ) -> Result<ReduceOutcome> {
        let Hooks {
            placed: mut placed_tx,
            mut on_placed,
            on_tree,
            hold,
        } = hooks;
        // Whether the caller still wants a finished run's tree repaired (see `Hooks::hold`).
        let mut held = hold.is_some();
        if num == 0 || num > sources.len() {
            return Err(Error::InvalidArgument(format!(
                "num_objects {num} not in 1..={}",
                sources.len()
            )));
        }
        super::distinct(sources)?;
        let num_required = sources.iter().filter(|s| opts.required.contains(s)).count();
        if num_required != opts.required.len() || num_required > num {
            return Err(Error::InvalidArgument(format!(
                "reduce {target}: {} required sources, {num_required} of them among the sources, num_objects {num}",
                opts.required.len()
            )));
        }
        let timeout = opts.timeout.unwrap_or(self.cfg.op_timeout);
        let deadline = Instant::now() + timeout;
        let down = self.members.watch_peer_down();
        let link = LinkModel {
            latency: self.measure_latency(),
            bandwidth: self.transfers.bandwidth_estimate(),
            piece: self.cfg.chunk_size,
        };
        let mut run = Run::new(target.clone(), sources, num, (op, dtype), opts, link);
        run.scratch = (self.rpc.fresh_token(), Some(self.id));
        // Copies on nodes down before `down` was watched are not placed while they stay down
        // (see `Run::members`).
        run.down_at_start = self.members.down_now();
        run.members = Some(self.members.clone());
        let (wake_tx, wake) = crossbeam_channel::bounded(1);
        let landing = Arc::new(Landing {
            id: self.id,
            rpc: self.rpc.clone(),
            dir: self.dir.clone(),
            wake: wake_tx,
            live: Mutex::new(Live {
                id: self.id,
                open: vec![false; sources.len()],
                run,
                answers: Vec::new(),
                later: Vec::new(),
                failed: None,
                down: Vec::new(),
                deferred: false,
                on_tree,
                waits_for_placement: placed_tx.is_some(),
                ended: false,
            }),
        });
        // However the reduce ends, answers that still land find it over.
        let _over = Over(&landing);
        // Sources whose directory shard is unreachable: subscribed again until it rejoins.
        let mut resub: Vec<usize> = (0..sources.len()).collect();
        loop {
            // This node closed (shut down, or killed in a test): its reduce ends with it, at
            // most `CLOSED_POLL` later, rather than at the op timeout, and its caller is told.
            if self.rpc.is_closed() {
                return Err(Error::Shutdown);
            }
            // Subscriptions (again), with no lock held: an answer may land on this thread.
            let now = Instant::now();
            resub.extend(landing.live().due_later(now));
            resub.retain(|&i| landing.subscribe(i, &sources[i]).is_err());
            let wake_at = {
                let g = landing.live();
                let wake_at = if resub.is_empty() {
                    deadline
                } else {
                    deadline.min(Instant::now() + Duration::from_millis(100))
                };
                let wake_at = g.run.reserved_until().map_or(wake_at, |r| r.min(wake_at));
                let wake_at = wake_at.min(Instant::now() + CLOSED_POLL);
                g.later.iter().map(|l| l.1).fold(wake_at, Instant::min)
            };
            // Wait for an answer or a task's reply the landing threads left to this thread,
            // or a peer's death.
            let mut sel = Select::new();
            sel.recv(&down);
            sel.recv(&wake);
            let on_hold = match (&hold, held) {
                (Some(h), true) => Some(sel.recv(h)),
                _ => None,
            };
            match sel.select_timeout(wake_at.saturating_duration_since(Instant::now())) {
                Ok(what) if what.index() == 0 => {
                    let Ok(node) = what.recv(&down) else {
                        return Err(Error::Shutdown);
                    };
                    let (actions, again) = landing.repair_after(node, &self.members);
                    self.apply(actions);
                    resub.extend(again);
                }
                Ok(what) if Some(what.index()) == on_hold => {
                    let _ = what.recv(hold.as_ref().expect("selected"));
                    held = false;
                }
                Ok(what) => {
                    let _ = what.recv(&wake);
                }
                Err(_) if Instant::now() < deadline => {}
                // Finished, and held past the deadline: the result is there.
                Err(_) if landing.live().run.finished() => break,
                Err(_) => {
                    return Err(Error::Timeout(
                        timeout,
                        format!("reduce {target}: {}", landing.live().run.waiting_for()),
                    ))
                }
            }
            // Deaths the landing threads saw, repaired with no lock held (the directory may be
            // asked whether the target outlived its root).
            let downs = std::mem::take(&mut landing.live().down);
            for node in downs {
                let (actions, again) = landing.repair_after(node, &self.members);
                self.apply(actions);
                resub.extend(again);
            }
            let (actions, combined) = {
                let mut g = landing.live();
                if let Some(e) = g.failed.take() {
                    return Err(e);
                }
                let mut actions = Vec::new();
                g.run.release_reserved(Instant::now());
                for (i, answer) in std::mem::take(&mut g.answers) {
                    if let Some(i) = g.answered_here(i, answer)? {
                        resub.push(i);
                    }
                }
                for (p, reply) in g.task_replies() {
                    let (a, again) = g.task_replied(p, reply)?;
                    actions.extend(a);
                    resub.extend(again);
                }
                (actions, g.run.combine_locally())
            };
            self.apply(actions);
            // Small inputs that came with their subscriptions: combined here, no task.
            if let Some(result) = combined {
                self.store_result(&target, &result)?;
            }
            // Dispatch; a node found dead on the way is repaired around and we go again.
            landing.live().deferred = false;
            while let Some(dead) = landing.dispatch(false)? {
                let (actions, again) = landing.repair_after(dead, &self.members);
                self.apply(actions);
                resub.extend(again);
            }
            // A partition's chain is placed: where each of its nodes fetches it from.
            let hints = landing.live().run.gather_hints();
            for (node, from) in hints {
                let part = target.clone();
                let _ = self.rpc.send(node, ReduceMsg::Gather { part, from });
            }
            let mut g = landing.live();
            let placed_now = g.run.placed() == num && placed_tx.is_some();
            if let Some(tx) = placed_tx.take_if(|_| placed_now) {
                g.waits_for_placement = false;
                let _ = tx.send(g.run.used_in_arrival_order());
            }
            // A tree combined here (small inputs) has no root to lose.
            let over = g.run.finished() && (!held || g.run.local);
            drop(g);
            // Told after the hints went out (above), with no lock held.
            if let Some(f) = on_placed.take_if(|_| placed_now) {
                f();
            }
            if over {
                break;
            }
        }
        // Answers that still land (subscriptions to sources never placed) find the run over.
        let mut run = {
            let mut g = landing.live();
            g.ended = true;
            let empty = Run::new(target.clone(), &[], 0, (op, dtype), opts, link);
            std::mem::replace(&mut g.run, empty)
        };
        let done = Instant::now();
        let tree = run.tree.take().expect("at least one source");
        // Intermediate results are not needed any more. Deleted after the reduce returns:
        // their names are this run's own (`Run::scratch`), so nothing waits for them.
        let scratch: Vec<ObjectId> = (1..num)
            .filter(|&p| run.has_task(&tree, p) && !run.local)
            .map(|p| run.out_of(&tree, p))
            .collect();
        if !scratch.is_empty() {
            let dir = self.dir.clone();
            let ids = scratch.clone();
            let delete_all = move || {
                for id in &ids {
                    let _ = dir.delete(id);
                }
            };
            if self.workers.spawn(delete_all).is_err() {
                for id in &scratch {
                    let _ = self.dir.delete(id);
                }
            }
        }
        let used = run.used_in_arrival_order();
        let recomputed = (0..num).filter(|&p| run.dispatches[p] > 1).collect();
        let last_ready = run
            .placed_at
            .iter()
            .flatten()
            .max()
            .copied()
            .unwrap_or(done);
        let slots = (0..num)
            .map(|p| {
                let (idx, node) = run.slots[p].expect("placed");
                TreeSlot {
                    position: p,
                    object: sources[idx].clone(),
                    node,
                    parent: tree.parent[p],
                    children: tree.children[p].clone(),
                }
            })
            .collect();
        Ok(ReduceOutcome {
            target,
            degree: tree.degree,
            used,
            tree: slots,
            recomputed,
            latency_s: run.link.latency,
            bandwidth_bps: run.link.bandwidth,
            last_ready,
            done,
            partitions: 1,
            by_arrival: tree.by_arrival,
        })
    }

    /// The result combined here: this node's copy of the target, announced with its bytes (as
    /// a put does: a delete this node sends after the reduce returns cannot overtake it).
    fn store_result(&self, target: &ObjectId, bytes: &[u8]) -> Result<()> {
        let (copy, evicted) = self.store.create(target, bytes.len() as u64, true)?;
        self.dir.withdraw(&evicted);
        copy.append(bytes)?;
        hop!(self.id, "reduce combined here", len = bytes.len() as u64);
        self.dir.put_inline(target, bytes)
    }

    /// Carries out the run's decisions, in order.
    fn apply(&self, actions: Vec<Action>) {
        for a in actions {
            let _ = match a {
                Action::Cancel { node, out, attempt } => {
                    self.rpc.send(node, ReduceMsg::Cancel { out, attempt })
                }
                Action::Reset(out) => self.dir.reset(&out),
                Action::Delete(out) => self.dir.delete(&out),
            };
        }
    }
}

/// One reduce's state, shared by the coordinator's thread and the threads the answers to its
/// subscriptions land on (transport threads, mostly): an answer that makes a source ready
/// places it and dispatches the tasks it completes right there, so the coordinator's own
/// wake-up (tens to hundreds of microseconds on a busy host) is not on the path. Whatever
/// else happens (a source deleted or unreachable, a task's reply, a peer's death, a timeout,
/// a tree of small inputs to combine and store before the reduce returns, a task whose link
/// is not made yet) is left to the coordinator's thread. No thread holds the lock while it
/// sends or calls: an answer may land on the thread that sends. A task that a landing thread
/// sent as a repair made it stale is cancelled from that thread, after it on the same link.
struct Landing {
    id: NodeId,
    rpc: Arc<Rpc>,
    dir: Arc<DirClient>,
    /// Wakes the coordinator's thread: something is left for it.
    wake: Sender<()>,
    live: Mutex<Live>,
}

/// Marks the reduce over when the coordinator returns, with a result or an error; on an
/// error, the tasks still out are stopped (a tree by arrival's root, started before its later
/// inputs came, would otherwise wait for them until the op timeout).
struct Over<'a>(&'a Landing);

impl Drop for Over<'_> {
    fn drop(&mut self) {
        let unfinished = {
            let mut g = self.0.live();
            g.ended = true;
            g.run.unfinished_tasks()
        };
        for (node, out, attempt) in unfinished {
            let _ = self.0.rpc.send(node, ReduceMsg::Cancel { out, attempt });
        }
    }
}

struct Live {
    /// This node (for the logs).
    id: NodeId,
    run: Run,
    /// Per source: a subscription is out and not answered yet.
    open: Vec<bool>,
    /// Answers left to the coordinator's thread: (source, answer), anything but a source
    /// that became ready.
    answers: Vec<(usize, Result<Reply>)>,
    /// Sources seen only on dead nodes: asked for again at the instant given, once the
    /// directory has dropped the dead copies (a recomputed upstream target comes back
    /// elsewhere).
    later: Vec<(usize, Instant)>,
    /// What a landing thread could not carry out: the reduce fails with it.
    failed: Option<Error>,
    /// Nodes a landing thread found unreachable as it dispatched: repaired by the
    /// coordinator's thread.
    down: Vec<NodeId>,
    /// A task a landing thread could not send without blocking (its link not made yet):
    /// the coordinator's thread sends it.
    deferred: bool,
    /// Runs once, as the first task is dispatched.
    on_tree: Option<Box<dyn FnOnce() + Send>>,
    /// The caller waits to hear the inputs once the tree is full.
    waits_for_placement: bool,
    /// The reduce is over: answers that still land are dropped.
    ended: bool,
}

/// How long a repair waits for the target's shard to say whether the target is complete
/// ([`Landing::repair_after`]); without an answer, the tree is repaired.
const SETTLE_ASK: Duration = Duration::from_millis(500);

impl Landing {
    fn live(&self) -> MutexGuard<'_, Live> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `node` died: the run's repair, unless the target is complete on a live node (its
    /// root finished before the death, and its reply had not come; or the root died after
    /// a reader pulled all of it): then the run is settled (`Run::settle`), and the readers
    /// that have the target keep the bytes every other one reads, where a repair would
    /// compute it again, perhaps from other inputs. The directory is asked with no lock
    /// held.
    fn repair_after(&self, node: NodeId, members: &Membership) -> (Vec<Action>, Vec<usize>) {
        let (asks, target) = {
            let g = self.live();
            (
                g.run.placed_on(node) && !g.run.settled,
                g.run.target.clone(),
            )
        };
        // Bounded: a shard slow to answer only delays the repair a moment.
        let until = Instant::now() + SETTLE_ASK;
        let survives = asks
            && matches!(self.dir.query_until(self.dir.shard_of(&target), &target, until),
            Ok(Some(info)) if info.locations.iter().any(|l| {
                l.complete && l.node != node && !members.is_down(l.node)
            }));
        let mut g = self.live();
        if survives {
            tracing::info!(
                node = self.id,
                dead = node,
                "reduce {target}: a node of its tree died, the target is complete: settled"
            );
            g.run.settle();
        }
        g.repair(node)
    }

    fn wake(&self) {
        let _ = self.wake.try_send(());
    }

    /// Subscribes to source `i`; its answer is handled where it lands.
    fn subscribe(self: &Arc<Self>, i: usize, source: &ObjectId) -> Result<()> {
        self.live().open[i] = true;
        let me = Arc::downgrade(self);
        let on_reply = Box::new(move |r: Result<Reply>| {
            if let Some(l) = me.upgrade() {
                l.answered(i, r);
            }
        });
        let r = self.dir.subscribe_then(source, on_reply);
        if r.is_err() {
            self.live().open[i] = false;
        }
        r
    }

    /// Source `i`'s answer, on the thread it landed on: a source that became ready is placed
    /// and the tasks it completes are dispatched from here; any other answer, and a tree of
    /// small inputs to combine (which stores and announces the result, and must do so before
    /// the reduce returns), is left to the coordinator's thread.
    fn answered(&self, i: usize, r: Result<Reply>) {
        {
            let mut g = self.live();
            if g.ended {
                return;
            }
            g.open[i] = false;
            let ready = match r {
                Ok(Reply::Info(Some(info))) => Ok((info, None)),
                Ok(Reply::InfoInline(info, data)) => Ok((info, Some(data))),
                other => Err(other),
            };
            match ready {
                Ok(_) if g.failed.is_some() => {}
                Ok((info, data)) => {
                    if let Err(e) = g.arrive(i, &info, data) {
                        g.failed = Some(e);
                    }
                }
                Err(other) => g.answers.push((i, other)),
            }
        }
        match self.dispatch(true) {
            Ok(None) => {}
            // Repaired by the coordinator's thread, which then dispatches again.
            Ok(Some(dead)) => self.live().down.push(dead),
            Err(e) => {
                self.live().failed.get_or_insert(e);
            }
        }
        if self.live().needs_coordinator() {
            self.wake();
        }
    }

    /// Sends the tasks of every position whose inputs are all placed and that has none out.
    /// From a landing thread (`where_landed`) nothing blocks: a task whose link cannot take it
    /// at once is left to the coordinator's thread (`Live::deferred`). `Some(node)`: `node`
    /// was found dead on the way (the tasks not sent are left undispatched; repair, then
    /// dispatch again).
    fn dispatch(&self, where_landed: bool) -> Result<Option<NodeId>> {
        let (jobs, on_tree) = {
            let mut g = self.live();
            if g.ended {
                return Ok(None);
            }
            let mut jobs = Vec::new();
            for (p, mut task) in g.run.dispatchable() {
                let node = g.run.slots[p].expect("placed").1;
                task.attempt = self.rpc.fresh_token();
                g.run.attempts[p] = task.attempt;
                let (tx, rx) = crossbeam_channel::bounded(1);
                g.run.tasks[p] = Some(rx);
                g.run.dispatches[p] += 1;
                let mark = (g.run.dispatches[p], g.run.gen[p]);
                jobs.push((p, node, task, tx, mark));
            }
            let on_tree = if jobs.is_empty() {
                None
            } else {
                g.on_tree.take()
            };
            (jobs, on_tree)
        };
        let mut jobs = jobs.into_iter();
        let mut outcome = Ok(None);
        let mut sent_any = false;
        for (p, node, task, tx, (nth, gen)) in jobs.by_ref() {
            let (out, attempt) = (task.out.clone(), task.attempt);
            tracing::debug!(
                node = self.id,
                position = p,
                to = node,
                gen,
                out = out.as_str(),
                own = task.own.as_str(),
                children = ?task.children,
                children_at = ?task.children_at,
                "reduce task dispatched"
            );
            // Held until the outcome is known: a request that fails drops its callback, and
            // the coordinator must not take the closed channel for a shutdown meanwhile.
            let keep = tx.clone();
            let wake = self.wake.clone();
            let on_reply = Box::new(move |r: Result<Reply>| {
                let _ = tx.send(r);
                let _ = wake.try_send(());
            });
            let make = |rid| ReduceMsg::Task { rid, task }.into();
            let sent = if where_landed {
                self.rpc.call_without_blocking(node, make, on_reply)
            } else {
                self.rpc.call_then(node, make, on_reply).map(|()| true)
            };
            match sent {
                Ok(true) => {
                    hop!(self.id, "task dispatched", position = p, to = node);
                    sent_any = true;
                    // Repaired while it went out (a node died), or the reduce ended
                    // meanwhile: the task is stale and stopped from here, after it on the
                    // same link.
                    let stale = where_landed && {
                        let g = self.live();
                        g.ended || g.run.gen.get(p) != Some(&gen)
                    };
                    if stale {
                        let cancel = ReduceMsg::Cancel { out, attempt };
                        self.rpc.send_without_blocking(node, cancel.into());
                    }
                }
                Ok(false) => {
                    let mut g = self.live();
                    g.undispatch(p, nth);
                    g.deferred = true;
                    break;
                }
                Err(e) => {
                    self.live().undispatch(p, nth);
                    outcome = match e {
                        Error::PeerDown(n) => Ok(Some(n)),
                        e => Err(e),
                    };
                    break;
                }
            }
            drop(keep);
        }
        // Not sent after a failure: no task is out for them.
        for (p, _, _, _, (nth, _)) in jobs {
            self.live().undispatch(p, nth);
        }
        if let Some(f) = on_tree {
            if sent_any {
                f();
            } else {
                self.live().on_tree.get_or_insert(f);
            }
        }
        outcome
    }
}

impl Live {
    /// Source `i` became ready (`info`, its bytes if small): placed, or kept as a spare, or
    /// asked for again later if every copy is on a dead node.
    fn arrive(&mut self, i: usize, info: &ObjectInfo, data: Option<Vec<u8>>) -> Result<()> {
        self.run.inline[i] = data.filter(|d| d.len() as u64 == info.size);
        if !self.run.arrived(i, info)? {
            self.later
                .push((i, Instant::now() + Duration::from_millis(50)));
        }
        Ok(())
    }

    /// Whether the coordinator's thread has something to do.
    fn needs_coordinator(&self) -> bool {
        !self.answers.is_empty()
            || self.failed.is_some()
            || !self.down.is_empty()
            || self.deferred
            || self.run.combinable()
            || !self.later.is_empty()
            || (self.waits_for_placement && self.run.placed() == self.run.num)
            || (self.run.range.is_some() && !self.run.hinted)
            || self.run.finished()
    }

    /// The sources due to be asked for again.
    fn due_later(&mut self, now: Instant) -> Vec<usize> {
        let due = self
            .later
            .iter()
            .filter(|l| l.1 <= now)
            .map(|l| l.0)
            .collect();
        self.later.retain(|l| l.1 > now);
        due
    }

    /// Position `p`'s `nth` dispatch did not go out.
    fn undispatch(&mut self, p: usize, nth: u32) {
        if self.run.dispatches.get(p) == Some(&nth) {
            self.run.tasks[p] = None;
            self.run.dispatches[p] -= 1;
        }
    }

    /// An answer left to the coordinator's thread; `Some(i)`: subscribe to source `i` again.
    fn answered_here(&mut self, i: usize, answer: Result<Reply>) -> Result<Option<usize>> {
        match answer {
            Ok(Reply::Info(Some(info))) => self.arrive(i, &info, None).map(|_| None),
            Ok(Reply::InfoInline(info, data)) => self.arrive(i, &info, Some(data)).map(|_| None),
            // Deleted before it became ready: it can never take part.
            Ok(Reply::Info(None)) => {
                let run = &self.run;
                if run.required[i] {
                    return Err(Error::InvalidArgument(format!(
                        "reduce {}: required source {} was deleted before it became ready",
                        run.target, run.sources[i]
                    )));
                }
                if run.placed() + run.spares.len() + self.open_subscriptions() < run.num {
                    return Err(Error::InvalidArgument(format!(
                        "reduce {}: fewer than {} sources can still become ready",
                        run.target, run.num
                    )));
                }
                Ok(None)
            }
            Ok(r) => Err(unexpected_reply(self.id, r)),
            Err(Error::PeerDown(_)) => Ok(Some(i)),
            Err(e) => Err(e),
        }
    }

    /// Subscriptions out and not answered yet.
    fn open_subscriptions(&self) -> usize {
        self.open.iter().filter(|o| **o).count()
    }

    /// The replies of tasks that came in, each task then no longer out; a reply channel
    /// closed without one means the node is shutting down.
    fn task_replies(&mut self) -> Vec<(usize, Result<Reply>)> {
        let mut out = Vec::new();
        for p in 0..self.run.tasks.len() {
            let Some(rx) = &self.run.tasks[p] else {
                continue;
            };
            let r = match rx.try_recv() {
                Ok(r) => r,
                Err(TryRecvError::Empty) => continue,
                Err(TryRecvError::Disconnected) => Err(Error::Shutdown),
            };
            self.run.tasks[p] = None;
            out.push((p, r));
        }
        out
    }

    /// Position `p`'s task replied `r`: the decisions to carry out and the sources to
    /// subscribe to again.
    fn task_replied(&mut self, p: usize, r: Result<Reply>) -> Result<(Vec<Action>, Vec<usize>)> {
        let target = &self.run.target;
        match r {
            Ok(Reply::Ack) => {
                hop!(self.id, "task done", position = p);
                self.run.done[p] = true;
                Ok((Vec::new(), Vec::new()))
            }
            Err(Error::PeerDown(node)) => Ok(self.repair(node)),
            Ok(Reply::Error(e)) if self.run.task_errors[p] < MAX_TASK_ERRORS => {
                // Usually an input that vanished under the task (reset upstream, or a holder
                // that died and is repaired next): compute it again.
                warn!(
                    node = self.id,
                    position = p,
                    "reduce {target}: task failed ({e}); again"
                );
                self.run.task_errors[p] += 1;
                Ok((self.run.recompute(p), Vec::new()))
            }
            Ok(Reply::Error(e)) => Err(Error::Protocol {
                peer: self.run.slots[p].map_or(self.id, |s| s.1),
                what: format!("reduce position {p}: {e}"),
            }),
            Ok(r) => Err(unexpected_reply(self.id, r)),
            Err(e) => Err(e),
        }
    }

    /// A node died: the run repairs its tree. The decisions to carry out, and the sources
    /// to subscribe to again.
    fn repair(&mut self, node: NodeId) -> (Vec<Action>, Vec<usize>) {
        let Some(r) = self.run.repair(node) else {
            return (Vec::new(), Vec::new());
        };
        warn!(
            node = self.id,
            dead = node,
            failed = ?r.failed,
            affected = ?r.affected,
            "reduce {}: repairing the tree",
            self.run.target
        );
        (r.actions, r.resubscribe)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::LocationInfo;

    fn on(node: NodeId) -> ObjectInfo {
        ObjectInfo {
            size: 64,
            inline: false,
            locations: vec![LocationInfo {
                node,
                complete: true,
                serving: None,
                depends_on: None,
            }],
            lost: false,
        }
    }

    /// A reduce of `n` sources, degree 2, the first `required` of them required.
    fn live(n: usize, num: usize, required: usize) -> Live {
        let sources: Vec<ObjectId> = (0..n).map(|i| ObjectId::new(format!("s{i}"))).collect();
        let opts = ReduceOptions {
            degree: Some(2),
            required: sources[..required].to_vec(),
            ..Default::default()
        };
        let kind = (ReduceOp::Sum, DType::F32);
        let link = LinkModel {
            latency: 1e-4,
            bandwidth: 1e8,
            piece: 1 << 20,
        };
        let run = Run::new(ObjectId::new("t"), &sources, num, kind, &opts, link);
        Live {
            id: 0,
            run,
            open: vec![true; n],
            answers: Vec::new(),
            later: Vec::new(),
            failed: None,
            down: Vec::new(),
            deferred: false,
            on_tree: None,
            waits_for_placement: false,
            ended: false,
        }
    }

    #[test]
    fn a_placement_alone_needs_no_coordinator_but_its_end_does() {
        let mut l = live(3, 3, 0);
        l.arrive(0, &on(0), None).unwrap();
        l.arrive(1, &on(1), None).unwrap();
        assert!(
            !l.needs_coordinator(),
            "placing sources is done where they land"
        );
        l.waits_for_placement = true;
        assert!(!l.needs_coordinator());
        l.arrive(2, &on(2), None).unwrap();
        assert!(l.needs_coordinator(), "the caller waits to hear the inputs");
        l.waits_for_placement = false;
        assert!(!l.needs_coordinator());
        let tasks = l.run.dispatchable();
        assert_eq!(tasks.len(), 1, "one inner position over three sources");
        l.run.done[tasks[0].0] = true;
        assert!(l.run.finished());
        assert!(
            l.needs_coordinator(),
            "the reduce is over: the coordinator returns"
        );
    }

    #[test]
    fn small_inputs_are_combined_by_the_coordinator_once() {
        let mut l = live(3, 3, 0);
        let bytes = |v: f32| v.to_le_bytes().repeat(16);
        l.arrive(0, &on(0), Some(bytes(1.0))).unwrap();
        l.arrive(1, &on(1), Some(bytes(2.0))).unwrap();
        assert!(!l.needs_coordinator());
        l.arrive(2, &on(2), Some(bytes(4.0))).unwrap();
        assert!(l.run.dispatchable().is_empty(), "no task for inline inputs");
        assert!(
            l.needs_coordinator(),
            "the coordinator combines and stores the result"
        );
        assert_eq!(l.run.combine_locally(), Some(bytes(7.0)));
        assert!(l.run.combine_locally().is_none(), "once");
        assert!(l.run.finished());
    }

    #[test]
    fn sources_only_on_dead_nodes_are_asked_again_later() {
        let mut l = live(3, 3, 0);
        l.run.dead.insert(4);
        l.arrive(1, &on(4), None).unwrap();
        assert_eq!(l.run.placed(), 0);
        assert_eq!(l.later.len(), 1);
        assert!(l.needs_coordinator(), "its timer is the coordinator's");
        assert!(l.due_later(Instant::now()).is_empty());
        let due = l.due_later(Instant::now() + Duration::from_millis(60));
        assert_eq!(due, vec![1]);
        assert!(l.later.is_empty());
    }

    /// A node that died before the reduce watched for deaths (not in `dead`): its copy is not
    /// placed while it is down, and is once it rejoins.
    #[test]
    fn copies_on_nodes_down_before_the_reduce_wait_for_a_rejoin() {
        let mut l = live(3, 3, 0);
        let members = Arc::new(crate::membership::Membership::new(0, 8, [4]));
        l.run.members = Some(members.clone());
        l.run.down_at_start.insert(4);
        l.arrive(1, &on(4), None).unwrap();
        assert_eq!(l.run.placed(), 0);
        assert_eq!(l.later.len(), 1);
        members.mark_up(4);
        l.arrive(1, &on(4), None).unwrap();
        assert_eq!(l.run.placed(), 1);
    }

    #[test]
    fn an_undone_dispatch_is_only_the_one_that_did_not_go_out() {
        let mut l = live(3, 3, 0);
        for i in 0..3 {
            l.arrive(i, &on(i as NodeId), None).unwrap();
        }
        let (p, _) = l.run.dispatchable().remove(0);
        let (_tx, rx) = crossbeam_channel::bounded(1);
        l.run.tasks[p] = Some(rx);
        l.run.dispatches[p] = 2; // a repair sent it again meanwhile
        l.undispatch(p, 1);
        assert!(l.run.tasks[p].is_some(), "a later dispatch is kept");
        assert_eq!(l.run.dispatches[p], 2);
        l.undispatch(p, 2);
        assert!(l.run.tasks[p].is_none());
        assert_eq!(l.run.dispatches[p], 1);
        assert_eq!(l.run.dispatchable().len(), 1, "dispatchable again");
    }

    #[test]
    fn answers_left_to_the_coordinator_are_judged_as_before() {
        // A required source deleted before it was ready fails the reduce.
        let mut l = live(3, 2, 1);
        l.open[0] = false;
        let e = l.answered_here(0, Ok(Reply::Info(None))).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        // An optional one is dropped while enough others can still come...
        let mut l = live(3, 2, 0);
        l.open[2] = false;
        assert_eq!(l.answered_here(2, Ok(Reply::Info(None))).unwrap(), None);
        // ...and fails the reduce once too few can.
        l.open[1] = false;
        let e = l.answered_here(1, Ok(Reply::Info(None))).unwrap_err();
        assert!(e.to_string().contains("fewer than 2"), "{e}");
        // An unreachable shard: subscribe again. A ready source is placed.
        let mut l = live(3, 3, 0);
        assert_eq!(
            l.answered_here(1, Err(Error::PeerDown(5))).unwrap(),
            Some(1)
        );
        assert_eq!(
            l.answered_here(1, Ok(Reply::Info(Some(on(1))))).unwrap(),
            None
        );
        assert_eq!(l.run.placed(), 1);
        let e = l.answered_here(2, Ok(Reply::Ack)).unwrap_err();
        assert!(matches!(e, Error::Protocol { .. }), "{e}");
    }

    #[test]
    fn task_replies_are_taken_once_and_a_closed_channel_is_a_shutdown() {
        let mut l = live(3, 3, 0);
        for i in 0..3 {
            l.arrive(i, &on(i as NodeId), None).unwrap();
        }
        let (p, _) = l.run.dispatchable().remove(0);
        let (tx, rx) = crossbeam_channel::bounded(1);
        l.run.tasks[p] = Some(rx);
        assert!(l.task_replies().is_empty(), "no reply yet");
        tx.send(Ok(Reply::Ack)).unwrap();
        let got = l.task_replies();
        assert_eq!(got.len(), 1);
        assert!(l.run.tasks[p].is_none());
        let (q, r) = got.into_iter().next().unwrap();
        let (actions, again) = l.task_replied(q, r).unwrap();
        assert!(actions.is_empty() && again.is_empty());
        assert!(l.run.done[p]);
        let (tx, rx) = crossbeam_channel::bounded::<Result<Reply>>(1);
        l.run.tasks[p] = Some(rx);
        drop(tx);
        let got = l.task_replies();
        assert!(matches!(got[0].1, Err(Error::Shutdown)));
    }
}
