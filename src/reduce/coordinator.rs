//! The coordinator of one reduce: an event loop over source subscriptions, task replies and
//! peer deaths that fills the tree in arrival order, dispatches tasks and repairs the tree.

use super::{choose_degree, ReduceOptions, ReduceOutcome, SourceClaims, Tree, TreeSlot};
use crate::node::Inner;
use crate::ops::{DType, ReduceOp};
use crate::protocol::{Msg, ObjectInfo, ReduceTask, Reply};
use crate::{Error, ObjectId, Result};
use crossbeam_channel::{Receiver, Select, Sender};
use phalanx_transport::NodeId;
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::warn;

/// Failed tasks of one position before the whole reduce gives up.
const MAX_TASK_ERRORS: u32 = 3;

impl Inner {
    /// Round trip to a peer, measured now (min of a few directory queries).
    fn measure_latency(&self) -> f64 {
        if let Some(l) = self.cfg.latency_override {
            return l.as_secs_f64();
        }
        let peer = (self.id + 1) % self.nodes;
        let probe = ObjectId::new("phalanx/latency-probe");
        (0..3)
            .filter_map(|_| {
                let t = Instant::now();
                self.call(peer, |rid| Msg::Query {
                    rid,
                    id: probe.clone(),
                })
                .ok()?;
                Some(t.elapsed().as_secs_f64())
            })
            .fold(f64::INFINITY, f64::min)
            .min(1.0)
    }

    /// Runs one reduce to the end; `placed_tx` hears the inputs once the tree is full. A
    /// reduce that fails gives the sources it claimed back to the pool.
    pub(super) fn coordinate_reduce(
        self: &Arc<Self>,
        target: ObjectId,
        sources: &[ObjectId],
        num: usize,
        kind: (ReduceOp, DType),
        opts: &ReduceOptions,
        placed_tx: Option<Sender<Vec<ObjectId>>>,
    ) -> Result<ReduceOutcome> {
        let r = self.run_coordinator(target.clone(), sources, num, kind, opts, placed_tx);
        if let (Err(_), Some(c)) = (&r, &opts.claims) {
            c.release(&target);
        }
        r
    }

    fn run_coordinator(
        self: &Arc<Self>,
        target: ObjectId,
        sources: &[ObjectId],
        num: usize,
        (op, dtype): (ReduceOp, DType),
        opts: &ReduceOptions,
        mut placed_tx: Option<Sender<Vec<ObjectId>>>,
    ) -> Result<ReduceOutcome> {
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
        let down = self.watch_peer_down();
        // Asynchronous location queries: one subscription per source.
        let mut subs: Vec<Option<Receiver<Result<Reply>>>> = vec![None; sources.len()];
        // Sources whose directory shard is unreachable: subscribed again until it rejoins.
        let mut resub: Vec<usize> = (0..sources.len()).collect();
        // Sources seen only on dead nodes: asked again a little later, once the directory has
        // dropped the dead copies (a recomputed upstream target comes back elsewhere).
        let mut later: Vec<(usize, Instant)> = Vec::new();
        let link = (self.measure_latency(), self.bandwidth_estimate());
        let mut run = Run::new(target.clone(), sources, num, (op, dtype), opts, link);
        loop {
            if run.finished() {
                break;
            }
            let now = Instant::now();
            resub.extend(later.iter().filter(|l| l.1 <= now).map(|l| l.0));
            later.retain(|l| l.1 > now);
            resub.retain(|&i| match self.subscribe_rx(&sources[i]) {
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
                let info = match what.recv(subs[i].as_ref().expect("listed")) {
                    Ok(Ok(Reply::Info(info))) => info,
                    Ok(Ok(r)) => return Err(self.unexpected(r)),
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
                if !run.arrived(i, &info)? {
                    later.push((i, Instant::now() + Duration::from_millis(50)));
                }
            } else {
                let p = task_ix[k - 1 - sub_ix.len()];
                let r = what.recv(run.tasks[p].as_ref().expect("listed"));
                run.tasks[p] = None;
                match r {
                    Ok(Ok(Reply::Ack)) => run.done[p] = true,
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
                        self.recompute(&mut run, p);
                    }
                    Ok(Ok(Reply::Error(e))) => {
                        return Err(Error::Protocol {
                            peer: run.slots[p].map_or(self.id, |s| s.1),
                            what: format!("reduce position {p}: {e}"),
                        })
                    }
                    Ok(Ok(r)) => return Err(self.unexpected(r)),
                    Ok(Err(e)) => return Err(e),
                    Err(_) => return Err(Error::Shutdown),
                }
            }
            // Dispatch; a node found dead on the way is repaired around and we go again.
            let mut again = true;
            while again {
                again = false;
                for (p, task) in run.dispatchable() {
                    let node = run.slots[p].expect("placed").1;
                    match self.call_async(node, |rid| Msg::ReduceTask { rid, task }) {
                        Ok(rx) => {
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
            if run.placed() == num {
                if let Some(tx) = placed_tx.take() {
                    let _ = tx.send(run.used_in_arrival_order());
                }
            }
        }
        let done = Instant::now();
        let tree = run.tree.take().expect("at least one source");
        // Intermediate results are not needed any more.
        for p in 1..num {
            if !tree.is_leaf(p) {
                let _ = self.delete(&run.out_of(&tree, p));
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
        })
    }

    fn subscribe_rx(&self, id: &ObjectId) -> Result<Receiver<Result<Reply>>> {
        self.call_async(self.shard_of(id), |rid| Msg::Subscribe {
            rid,
            id: id.clone(),
        })
    }

    /// A node died: positions it held leave the tree and, with every ancestor that had not
    /// finished, are recomputed; finished subtrees keep their results. Returns the sources
    /// to subscribe to again (they come back if the node rejoins and puts them again).
    fn repair(&self, run: &mut Run, node: NodeId) -> Vec<usize> {
        if !run.dead.insert(node) {
            return Vec::new();
        }
        let Some(tree) = run.tree.clone() else {
            return Vec::new();
        };
        let failed: Vec<usize> = (0..run.num)
            .filter(|&p| run.slots[p].is_some_and(|s| s.1 == node))
            .collect();
        let mut affected: Vec<usize> = Vec::new();
        for &p in &failed {
            // A position whose parent already finished (on a live node) contributed already.
            let mut cur = Some(p);
            while let Some(a) = cur {
                let a_dead = run.slots[a].is_some_and(|s| run.dead.contains(&s.1));
                if a != p && run.done[a] && !a_dead {
                    break;
                }
                if !affected.contains(&a) {
                    affected.push(a);
                }
                cur = tree.parent[a];
            }
            if let Some(parent) = tree.parent[p] {
                let pd = run.slots[parent].is_some_and(|s| run.dead.contains(&s.1));
                if run.done[parent] && !pd {
                    affected.retain(|&a| a != p);
                }
            }
        }
        let mut resubscribe = Vec::new();
        for &a in &affected {
            // Also when its task's reply is already gone (a PeerDown reply clears it before
            // the repair): copies of its output may live on, e.g. the partial copy its parent
            // pulled, and must never be read again under the same name.
            if run.tasks[a].is_some() || run.done[a] || run.dispatches[a] > 0 {
                self.discard(run, &tree, a);
            }
            run.tasks[a] = None;
            run.done[a] = false;
            if failed.contains(&a) {
                let (idx, _) = run.slots[a].take().expect("failed positions are placed");
                run.placed_at[a] = None;
                resubscribe.push(idx);
            }
        }
        warn!(
            node = self.id,
            dead = node,
            ?failed,
            ?affected,
            "reduce {}: repairing the tree",
            run.target
        );
        run.fill_from_spares();
        resubscribe
    }

    /// Stops position `a`'s task and drops its (partial) output, which is computed again
    /// under a new generation. The target keeps its name: its readers wait for the new bytes.
    fn discard(&self, run: &mut Run, tree: &Tree, a: usize) {
        if a != 0 && tree.is_leaf(a) {
            return; // a leaf's output is its source, not ours to drop
        }
        let out = run.out_of(tree, a);
        if let Some((_, n)) = run.slots[a].filter(|s| !run.dead.contains(&s.1)) {
            let _ = self.send(n, Msg::CancelReduce { out: out.clone() });
        }
        let _ = if a == 0 {
            self.reset(&out)
        } else {
            self.delete(&out)
        };
        run.gen[a] += 1;
        run.tasks[a] = None;
        run.done[a] = false;
    }

    /// Position `p`'s task failed: it and every ancestor (all of them read its output) are
    /// computed again.
    fn recompute(&self, run: &mut Run, p: usize) {
        let tree = run.tree.clone().expect("a task runs only in a tree");
        let mut cur = Some(p);
        while let Some(a) = cur {
            self.discard(run, &tree, a);
            cur = tree.parent[a];
        }
    }

    /// A channel that receives the id of every peer that goes down from now on.
    fn watch_peer_down(&self) -> Receiver<NodeId> {
        let (tx, rx) = crossbeam_channel::unbounded();
        self.down_watchers.lock().unwrap().push(tx);
        rx
    }
}

/// The coordinator's state of one reduce.
struct Run {
    target: ObjectId,
    sources: Vec<ObjectId>,
    num: usize,
    op: ReduceOp,
    dtype: DType,
    chunk: u64,
    degree: Option<usize>,
    latency: f64,
    bandwidth: f64,
    tree: Option<Tree>,
    size: u64,
    /// Per position: (source index, node holding it).
    slots: Vec<Option<(usize, NodeId)>>,
    /// Per position: generation of its output (bumped on recompute).
    gen: Vec<u32>,
    tasks: Vec<Option<Receiver<Result<Reply>>>>,
    done: Vec<bool>,
    dispatches: Vec<u32>,
    /// Ready sources not placed (yet), in arrival order.
    spares: VecDeque<(usize, NodeId)>,
    dead: HashSet<NodeId>,
    placed_at: Vec<Option<Instant>>,
    /// Per source: always used.
    required: Vec<bool>,
    num_required: usize,
    claims: Option<Arc<SourceClaims>>,
    /// Per position: failed tasks so far.
    task_errors: Vec<u32>,
}

impl Run {
    /// A reduce with nothing placed yet; `link` is the (latency s, bandwidth B/s) estimate.
    fn new(
        target: ObjectId,
        sources: &[ObjectId],
        num: usize,
        (op, dtype): (ReduceOp, DType),
        opts: &ReduceOptions,
        (latency, bandwidth): (f64, f64),
    ) -> Run {
        let required: Vec<bool> = sources.iter().map(|s| opts.required.contains(s)).collect();
        Run {
            target,
            sources: sources.to_vec(),
            num,
            op,
            dtype,
            chunk: opts.chunk,
            degree: opts.degree,
            latency,
            bandwidth,
            tree: None,
            size: 0,
            slots: Vec::new(),
            gen: Vec::new(),
            tasks: Vec::new(),
            done: Vec::new(),
            dispatches: Vec::new(),
            spares: VecDeque::new(),
            dead: HashSet::new(),
            placed_at: Vec::new(),
            num_required: required.iter().filter(|r| **r).count(),
            required,
            claims: opts.claims.clone(),
            task_errors: Vec::new(),
        }
    }

    fn placed(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    /// The placed sources, in the order they were placed.
    fn used_in_arrival_order(&self) -> Vec<ObjectId> {
        let mut order: Vec<usize> = (0..self.slots.len())
            .filter(|&p| self.slots[p].is_some())
            .collect();
        order.sort_by_key(|&p| self.placed_at[p]);
        order
            .iter()
            .map(|&p| self.sources[self.slots[p].expect("placed").0].clone())
            .collect()
    }

    fn finished(&self) -> bool {
        let Some(tree) = &self.tree else { return false };
        (0..self.num)
            .all(|p| self.slots[p].is_some() && (self.done[p] || (p != 0 && tree.is_leaf(p))))
    }

    fn waiting_for(&self) -> String {
        format!(
            "{} of {} sources placed, {} positions done",
            self.placed(),
            self.num,
            self.done.iter().filter(|d| **d).count()
        )
    }

    fn out_of(&self, tree: &Tree, p: usize) -> ObjectId {
        if p == 0 {
            self.target.clone()
        } else if tree.is_leaf(p) {
            self.sources[self.slots[p].expect("placed").0].clone()
        } else {
            ObjectId::new(format!(
                "{}#reduce-{p}.{}",
                self.target.as_str(),
                self.gen[p]
            ))
        }
    }

    /// A source became ready: place it, or keep it as a spare. False if every copy it has
    /// is on a dead node (ask again later).
    fn arrived(&mut self, i: usize, info: &ObjectInfo) -> Result<bool> {
        let esz = self.dtype.size() as u64;
        if !info.size.is_multiple_of(esz) {
            return Err(Error::InvalidArgument(format!(
                "reduce input {} has {} bytes, not a multiple of the {:?} element size {esz}",
                self.sources[i], info.size, self.dtype
            )));
        }
        if self.tree.is_none() {
            self.size = info.size;
            let d = self.degree.unwrap_or_else(|| {
                choose_degree(self.num, self.size, self.latency, self.bandwidth)
            });
            self.tree = Some(Tree::new(self.num, d));
            self.slots = vec![None; self.num];
            self.gen = vec![0; self.num];
            self.tasks = (0..self.num).map(|_| None).collect();
            self.done = vec![false; self.num];
            self.dispatches = vec![0; self.num];
            self.placed_at = vec![None; self.num];
            self.task_errors = vec![0; self.num];
        } else if info.size != self.size {
            return Err(Error::InvalidArgument(format!(
                "reduce input {} has {} bytes, others {}",
                self.sources[i], info.size, self.size
            )));
        }
        // Spread positions over nodes: a complete copy on a node not in the tree yet, else
        // any live copy.
        let placed = |n: NodeId| self.slots.iter().flatten().any(|(_, m)| *m == n);
        let Some(node) = info
            .locations
            .iter()
            .filter(|l| !self.dead.contains(&l.node))
            .min_by_key(|l| (placed(l.node), !l.complete))
            .map(|l| l.node)
        else {
            return Ok(false);
        };
        self.spares.push_back((i, node));
        self.fill_from_spares();
        Ok(true)
    }

    /// Empty positions take spares in generalised in-order. The first in-order positions
    /// (the deepest) are kept for the required sources, so a long-lived required input (a
    /// model) is a leaf and the target lands on the node of the last optional arrival rather
    /// than on the same node every time; the other positions take optional sources in
    /// arrival order, only those no other reduce sharing the claims took.
    fn fill_from_spares(&mut self) {
        let Some(tree) = &self.tree else { return };
        let inorder = tree.inorder.clone();
        for (k, p) in inorder.into_iter().enumerate() {
            if self.slots[p].is_some() {
                continue;
            }
            let for_required = k < self.num_required;
            let pick = self.spares.iter().position(|&(i, _)| {
                if for_required || self.required[i] {
                    return for_required && self.required[i];
                }
                self.claims
                    .as_ref()
                    .is_none_or(|c| c.try_claim(&self.sources[i], &self.target))
            });
            if let Some(s) = pick.and_then(|ix| self.spares.remove(ix)) {
                self.slots[p] = Some(s);
                self.placed_at[p] = Some(Instant::now());
            }
        }
    }

    /// Positions whose inputs are all placed and that have no task yet, with their tasks.
    fn dispatchable(&mut self) -> Vec<(usize, ReduceTask)> {
        let Some(tree) = self.tree.clone() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for p in 0..self.num {
            let needs_task = p == 0 || !tree.is_leaf(p);
            let ready = self.slots[p].is_some()
                && tree.children[p].iter().all(|&c| self.slots[c].is_some());
            if !needs_task || !ready || self.tasks[p].is_some() || self.done[p] {
                continue;
            }
            out.push((
                p,
                ReduceTask {
                    out: self.out_of(&tree, p),
                    own: self.sources[self.slots[p].expect("placed").0].clone(),
                    children: tree.children[p]
                        .iter()
                        .map(|&c| self.out_of(&tree, c))
                        .collect(),
                    size: self.size,
                    op: self.op,
                    dtype: self.dtype,
                    chunk: self.chunk,
                },
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn required_sources_take_the_deepest_positions() {
        let sources = ["m", "g0", "g1", "g2"].map(ObjectId::new);
        let opts = ReduceOptions {
            degree: Some(1),
            required: vec![sources[0].clone()],
            ..Default::default()
        };
        let kind = (ReduceOp::Sum, DType::F32);
        let mut run = Run::new(ObjectId::new("t"), &sources, 3, kind, &opts, (1e-4, 1e9));
        let info = |node| ObjectInfo {
            size: 64,
            inline: false,
            locations: vec![crate::protocol::LocationInfo {
                node,
                complete: true,
                serving: None,
                depends_on: None,
            }],
        };
        // Two gradients arrive first: they leave the leaf (position 2) to the model.
        assert!(run.arrived(1, &info(1)).unwrap());
        assert!(run.arrived(2, &info(2)).unwrap());
        assert_eq!(run.slots[2], None);
        assert_eq!(run.placed(), 2);
        // A third gradient finds no room; the model still does.
        assert!(run.arrived(3, &info(3)).unwrap());
        assert_eq!(run.placed(), 2);
        assert!(run.arrived(0, &info(4)).unwrap());
        assert_eq!(run.slots[2], Some((0, 4)));
        assert_eq!(run.used_in_arrival_order()[2], ObjectId::new("m"));
        assert_eq!(run.spares.len(), 1, "the third gradient stays a spare");
        // Every copy on dead nodes: asked again later.
        run.dead.insert(5);
        assert!(!run.arrived(3, &info(5)).unwrap());
    }
}
