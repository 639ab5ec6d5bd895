//! The coordinator of one reduce: an event loop over source subscriptions, task replies and
//! peer deaths that fills the tree in arrival order, dispatches tasks and repairs the tree.

use super::run::{Action, Run};
use super::{Hooks, ReduceOptions, ReduceOutcome, Reducer, TreeSlot};
use crate::hop::hop;
use crate::ops::{DType, ReduceOp};
use crate::protocol::{ReduceMsg, Reply};
use crate::{Error, ObjectId, Result};
use crossbeam_channel::{Receiver, Select};
use phalanx_transport::NodeId;
use std::time::{Duration, Instant};
use tracing::warn;

/// Failed tasks of one position before the whole reduce gives up.
const MAX_TASK_ERRORS: u32 = 3;

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
            mut on_tree,
        } = hooks;
        if num == 0 || num > sources.len() {
            return Err(Error::InvalidArgument(format!(
                "num_objects {num} not in 1..={}",
                sources.len()
            )));
        }
        let mut uniq = sources.to_vec();
        uniq.sort();
        uniq.dedup();
        if uniq.len() != sources.len() {
            return Err(Error::InvalidArgument("duplicate reduce sources".into()));
        }
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
        // Asynchronous location queries: one subscription per source.
        let mut subs: Vec<Option<Receiver<Result<Reply>>>> = vec![None; sources.len()];
        // Sources whose directory shard is unreachable: subscribed again until it rejoins.
        let mut resub: Vec<usize> = (0..sources.len()).collect();
        // Sources seen only on dead nodes: asked again a little later, once the directory has
        // dropped the dead copies (a recomputed upstream target comes back elsewhere).
        let mut later: Vec<(usize, Instant)> = Vec::new();
        let link = (self.measure_latency(), self.transfers.bandwidth_estimate());
        let mut run = Run::new(target.clone(), sources, num, (op, dtype), opts, link);
        run.scratch = (self.rpc.fresh_token(), Some(self.id));
        loop {
            if run.finished() {
                break;
            }
            let now = Instant::now();
            resub.extend(later.iter().filter(|l| l.1 <= now).map(|l| l.0));
            later.retain(|l| l.1 > now);
            resub.retain(|&i| match self.dir.subscribe(&sources[i]) {
                Ok(rx) => {
                    subs[i] = Some(rx);
                    false
                }
                Err(_) => true,
            });
            let wake = if resub.is_empty() {
                deadline
            } else {
                deadline.min(Instant::now() + Duration::from_millis(100))
            };
            let wake = later.iter().map(|l| l.1).fold(wake, Instant::min);
            // Wait for the next source to become ready, a task to finish, or a peer to die.
            let mut sel = Select::new();
            sel.recv(&down);
            let sub_ix: Vec<usize> = (0..subs.len()).filter(|&i| subs[i].is_some()).collect();
            for &i in &sub_ix {
                sel.recv(subs[i].as_ref().expect("listed"));
            }
            let task_ix: Vec<usize> = (0..run.tasks.len())
                .filter(|&p| run.tasks[p].is_some())
                .collect();
            for &p in &task_ix {
                sel.recv(run.tasks[p].as_ref().expect("listed"));
            }
            let what = match sel.select_timeout(wake.saturating_duration_since(Instant::now())) {
                Ok(w) => w,
                Err(_) if Instant::now() < deadline => continue,
                Err(_) => {
                    return Err(Error::Timeout(
                        timeout,
                        format!("reduce {target}: {}", run.waiting_for()),
                    ))
                }
            };
            let k = what.index();
            if k == 0 {
                let Ok(node) = what.recv(&down) else {
                    return Err(Error::Shutdown);
                };
                resub.extend(self.repair(&mut run, node));
            } else if k <= sub_ix.len() {
                let i = sub_ix[k - 1];
                let (info, data) = match what.recv(subs[i].as_ref().expect("listed")) {
                    Ok(Ok(Reply::Info(info))) => (info, None),
                    Ok(Ok(Reply::InfoInline(info, data))) => (Some(info), Some(data)),
                    Ok(Ok(r)) => return Err(self.rpc.unexpected(r)),
                    Ok(Err(Error::PeerDown(_))) => {
                        subs[i] = None;
                        resub.push(i);
                        continue;
                    }
                    Ok(Err(e)) => return Err(e),
                    Err(_) => return Err(Error::Shutdown),
                };
                subs[i] = None;
                let Some(info) = info else {
                    // Deleted before it became ready: it can never take part.
                    if run.required[i] {
                        return Err(Error::InvalidArgument(format!(
                            "reduce {target}: required source {} was deleted before it became ready",
                            sources[i]
                        )));
                    }
                    if run.placed() + run.spares.len() + subs.iter().flatten().count() < num {
                        return Err(Error::InvalidArgument(format!(
                            "reduce {target}: fewer than {num} sources can still become ready"
                        )));
                    }
                    continue;
                };
                run.inline[i] = data.filter(|d| d.len() as u64 == info.size);
                if !run.arrived(i, &info)? {
                    later.push((i, Instant::now() + Duration::from_millis(50)));
                }
            } else {
                let p = task_ix[k - 1 - sub_ix.len()];
                let r = what.recv(run.tasks[p].as_ref().expect("listed"));
                run.tasks[p] = None;
                match r {
                    Ok(Ok(Reply::Ack)) => {
                        hop!(self.id, "task done", position = p);
                        run.done[p] = true
                    }
                    Ok(Err(Error::PeerDown(node))) => resub.extend(self.repair(&mut run, node)),
                    Ok(Ok(Reply::Error(e))) if run.task_errors[p] < MAX_TASK_ERRORS => {
                        // Usually an input that vanished under the task (reset upstream, or
                        // a holder that died and is repaired next): compute it again.
                        warn!(
                            node = self.id,
                            position = p,
                            "reduce {target}: task failed ({e}); again"
                        );
                        run.task_errors[p] += 1;
                        let actions = run.recompute(p);
                        self.apply(actions);
                    }
                    Ok(Ok(Reply::Error(e))) => {
                        return Err(Error::Protocol {
                            peer: run.slots[p].map_or(self.id, |s| s.1),
                            what: format!("reduce position {p}: {e}"),
                        })
                    }
                    Ok(Ok(r)) => return Err(self.rpc.unexpected(r)),
                    Ok(Err(e)) => return Err(e),
                    Err(_) => return Err(Error::Shutdown),
                }
            }
            // Small inputs that came with their subscriptions: combined here, no task.
            if let Some(result) = run.combine_locally() {
                self.store_result(&target, &result)?;
            }
            // Dispatch; a node found dead on the way is repaired around and we go again.
            let mut again = true;
            while again {
                again = false;
                for (p, task) in run.dispatchable() {
                    let node = run.slots[p].expect("placed").1;
                    match self
                        .rpc
                        .call_async(node, |rid| ReduceMsg::Task { rid, task }.into())
                    {
                        Ok(rx) => {
                            hop!(self.id, "task dispatched", position = p, to = node);
                            if let Some(f) = on_tree.take() {
                                f();
                            }
                            run.tasks[p] = Some(rx);
                            run.dispatches[p] += 1;
                        }
                        Err(Error::PeerDown(n)) => {
                            resub.extend(self.repair(&mut run, n));
                            again = true;
                            break;
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
            // A partition's chain is placed: where each of its nodes fetches it from.
            for (node, from) in run.gather_hints() {
                let part = run.target.clone();
                let _ = self.rpc.send(node, ReduceMsg::Gather { part, from });
            }
            if run.placed() == num {
                if let Some(tx) = placed_tx.take() {
                    let _ = tx.send(run.used_in_arrival_order());
                }
            }
        }
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
            latency_s: run.latency,
            bandwidth_bps: run.bandwidth,
            last_ready,
            done,
            partitions: 1,
        })
    }

    /// A node died: the run repairs its tree, and its decisions are carried out here.
    /// Returns the sources to subscribe to again.
    fn repair(&self, run: &mut Run, node: NodeId) -> Vec<usize> {
        let Some(r) = run.repair(node) else {
            return Vec::new();
        };
        warn!(
            node = self.id,
            dead = node,
            failed = ?r.failed,
            affected = ?r.affected,
            "reduce {}: repairing the tree",
            run.target
        );
        self.apply(r.actions);
        r.resubscribe
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
                Action::Cancel { node, out } => self.rpc.send(node, ReduceMsg::Cancel { out }),
                Action::Reset(out) => self.dir.reset(&out),
                Action::Delete(out) => self.dir.delete(&out),
            };
        }
    }
}
