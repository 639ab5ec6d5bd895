//! The coordinator's state of one reduce: which source holds which tree position, what each
//! position's task is doing, and the spares. Placement, repair and recompute are decisions on
//! this state; the effects they need elsewhere (cancel a task, drop an output) come back as
//! [`Action`]s for the coordinator to carry out.

use super::{choose_degree, ReduceOptions, SourceClaims, Tree};
use crate::membership::Membership;
use crate::ops::{combine, combine_into, DType, ReduceOp};
use crate::protocol::{GatherFrom, ObjectInfo, ReduceTask, Reply};
use crate::{Error, ObjectId, Result};
use crossbeam_channel::Receiver;
use phalanx_transport::NodeId;
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

/// An effect of a decision on the run, carried out by the coordinator in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Action {
    /// Stop the task producing `out` on `node`, dispatched as `attempt`.
    Cancel {
        node: NodeId,
        out: ObjectId,
        attempt: u64,
    },
    /// Drop every copy of the target, which is computed again: its readers wait.
    Reset(ObjectId),
    /// Drop an intermediate output, which is computed again under a new name.
    Delete(ObjectId),
}

/// What a repair after a node's death decided.
#[derive(Debug, Default)]
pub(super) struct Repair {
    /// Positions the dead node held.
    pub failed: Vec<usize>,
    /// Positions computed again: the failed ones and their unfinished ancestors.
    pub affected: Vec<usize>,
    pub actions: Vec<Action>,
    /// Sources to subscribe to again (they come back if the node rejoins and puts them again).
    pub resubscribe: Vec<usize>,
}

/// What a reduce's degree is chosen from (see [`choose_degree`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct LinkModel {
    /// One hop's latency, in seconds.
    pub latency: f64,
    /// A link's bandwidth, in bytes per second.
    pub bandwidth: f64,
    /// The bytes a source writes at once (`chunk_size`): what a node forwards as a piece.
    pub piece: u64,
}

/// How long a position a repair emptied is kept for its input's other copy (a replica's
/// answer to the subscription made again) before a spare may take it.
pub(super) const RETURN_GRACE: std::time::Duration = std::time::Duration::from_millis(200);

/// The coordinator's state of one reduce.
pub(super) struct Run {
    pub(super) target: ObjectId,
    pub(super) sources: Vec<ObjectId>,
    pub(super) num: usize,
    pub(super) op: ReduceOp,
    pub(super) dtype: DType,
    pub(super) chunk: u64,
    pub(super) degree: Option<usize>,
    pub(super) link: LinkModel,
    pub(super) tree: Option<Tree>,
    /// Bytes reduced (a partition's with `range`).
    pub(super) size: u64,
    /// Bytes of every source.
    pub(super) full_size: u64,
    pub(super) range: Option<(u64, u64)>,
    pub(super) rotate: usize,
    /// The tree is [`Tree::by_arrival`], rooted at the `rotate`-th arrival.
    pub(super) by_arrival: bool,
    /// Per position: (source index, node holding it).
    pub(super) slots: Vec<Option<(usize, NodeId)>>,
    /// Per position: generation of its output (bumped on recompute).
    pub(super) gen: Vec<u32>,
    /// What names this run's intermediate outputs apart from every other run's (a number
    /// the coordinator does not reuse), and the node that keeps their directory entries
    /// (the coordinator: it deletes them when the run is over). Unique names let that
    /// delete go on after the reduce returns: a later run to the same target cannot lose
    /// its outputs to it.
    pub(super) scratch: (u64, Option<NodeId>),
    pub(super) tasks: Vec<Option<Receiver<Result<Reply>>>>,
    pub(super) done: Vec<bool>,
    pub(super) dispatches: Vec<u32>,
    /// The attempt token of each position's last dispatch (what its `Cancel` names).
    pub(super) attempts: Vec<u64>,
    /// Ready sources not placed (yet), in arrival order.
    pub(super) spares: VecDeque<(usize, NodeId)>,
    /// Per position: the input a repair took out of it (its node died), and until when the
    /// position is kept for that input's other copy, which no spare may take meanwhile
    /// ([`RETURN_GRACE`]).
    pub(super) reserved: Vec<Option<(usize, Instant)>>,
    pub(super) dead: HashSet<NodeId>,
    /// The target is complete on a live node although a node of the tree died: every
    /// position counts as done, and no death is repaired any more ([`Run::settle`]).
    pub(super) settled: bool,
    /// Who is down now, and the nodes that were down when the reduce began to watch for
    /// deaths. Those are not in `dead` (their deaths came before), and the directory may still
    /// list their copies (a shard learns of a death in its own time): placed, the task
    /// pulling from one would wait for a copy that never comes. So a copy on such a node is
    /// not placed while it is down; once it rejoins, a copy it puts anew can be. A node that
    /// dies during the reduce is repaired around (`dead`), as before.
    pub(super) members: Option<Arc<Membership>>,
    pub(super) down_at_start: HashSet<NodeId>,
    pub(super) placed_at: Vec<Option<Instant>>,
    /// Per source: always used.
    pub(super) required: Vec<bool>,
    pub(super) num_required: usize,
    pub(super) claims: Option<Arc<SourceClaims>>,
    /// Per source: its bytes, when it is small and they came with its subscription.
    pub(super) inline: Vec<Option<Vec<u8>>>,
    /// The result was combined here from inline inputs, without tasks.
    pub(super) local: bool,
    /// Per position: failed tasks so far.
    pub(super) task_errors: Vec<u32>,
    /// The allgather hints went out (`gather_hints`): at most once per run.
    pub(super) hinted: bool,
}

impl Run {
    /// A reduce with nothing placed yet; `link` models its links, for the tree's degree.
    pub(super) fn new(
        target: ObjectId,
        sources: &[ObjectId],
        num: usize,
        (op, dtype): (ReduceOp, DType),
        opts: &ReduceOptions,
        link: LinkModel,
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
            link,
            tree: None,
            size: 0,
            full_size: 0,
            range: opts.range,
            rotate: opts.rotate,
            by_arrival: opts.by_arrival,
            slots: Vec::new(),
            gen: Vec::new(),
            scratch: (0, None),
            tasks: Vec::new(),
            done: Vec::new(),
            dispatches: Vec::new(),
            attempts: Vec::new(),
            spares: VecDeque::new(),
            reserved: Vec::new(),
            dead: HashSet::new(),
            settled: false,
            members: None,
            down_at_start: HashSet::new(),
            placed_at: Vec::new(),
            num_required: required.iter().filter(|r| **r).count(),
            required,
            claims: opts.claims.clone(),
            inline: vec![None; sources.len()],
            local: false,
            task_errors: Vec::new(),
            hinted: false,
        }
    }

    pub(super) fn placed(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    /// The placed sources, in the order they were placed.
    pub(super) fn used_in_arrival_order(&self) -> Vec<ObjectId> {
        let mut order: Vec<usize> = (0..self.slots.len())
            .filter(|&p| self.slots[p].is_some())
            .collect();
        order.sort_by_key(|&p| self.placed_at[p]);
        order
            .iter()
            .map(|&p| self.sources[self.slots[p].expect("placed").0].clone())
            .collect()
    }

    /// Whether a position of the tree is placed on `node`.
    pub(super) fn placed_on(&self, node: NodeId) -> bool {
        self.slots.iter().flatten().any(|s| s.1 == node)
    }

    /// The target is complete on a live node although a node of the tree died (the root
    /// finished before the death and its reply had not come, or a reader pulled all of it
    /// before the root died): the run is over, with the inputs placed. Computing the root
    /// again could place another input (a spare, for the first n of m) and give bytes other
    /// than those readers already have.
    pub(super) fn settle(&mut self) {
        if self.tree.is_none() || self.slots.iter().any(Option::is_none) {
            return; // never fully placed: no target can be complete
        }
        self.settled = true;
        for p in 0..self.num {
            self.done[p] = true;
            self.tasks[p] = None;
        }
    }

    pub(super) fn finished(&self) -> bool {
        let Some(tree) = &self.tree else { return false };
        (0..self.num).all(|p| self.slots[p].is_some() && (self.done[p] || !self.has_task(tree, p)))
    }

    /// Whether position `p` computes an output: the root and inner positions always, leaves
    /// only when a partition is reduced (otherwise a leaf's output is its source).
    pub(super) fn has_task(&self, tree: &Tree, p: usize) -> bool {
        p == 0 || !tree.is_leaf(p) || self.range.is_some()
    }

    pub(super) fn waiting_for(&self) -> String {
        format!(
            "{} of {} sources placed, {} positions done",
            self.placed(),
            self.num,
            self.done.iter().filter(|d| **d).count()
        )
    }

    pub(super) fn out_of(&self, tree: &Tree, p: usize) -> ObjectId {
        if p == 0 {
            self.target.clone()
        } else if !self.has_task(tree, p) {
            self.sources[self.slots[p].expect("placed").0].clone()
        } else {
            let (run, home) = self.scratch;
            let name = format!(
                "{}#reduce-{run:x}.{p}.{}",
                self.target.as_str(),
                self.gen[p]
            );
            match home {
                Some(h) => ObjectId::homed(h, name),
                None => ObjectId::new(name),
            }
        }
    }

    /// A source became ready: place it, or keep it as a spare. False if every copy it has
    /// is on a dead node (ask again later).
    pub(super) fn arrived(&mut self, i: usize, info: &ObjectInfo) -> Result<bool> {
        let esz = self.dtype.size() as u64;
        if !info.size.is_multiple_of(esz) {
            return Err(Error::InvalidArgument(format!(
                "reduce input {} has {} bytes, not a multiple of the {:?} element size {esz}",
                self.sources[i], info.size, self.dtype
            )));
        }
        if self.tree.is_none() {
            self.full_size = info.size;
            self.size = match self.range {
                None => info.size,
                Some((lo, hi)) => {
                    if lo > hi
                        || hi > info.size
                        || !lo.is_multiple_of(esz)
                        || !hi.is_multiple_of(esz)
                    {
                        return Err(Error::InvalidArgument(format!(
                            "reduce range {lo}..{hi} of {} ({} bytes) is not whole elements \
                             inside it",
                            self.sources[i], info.size
                        )));
                    }
                    hi - lo
                }
            };
            let d = self.degree.unwrap_or_else(|| {
                let l = &self.link;
                choose_degree(self.num, self.size, l.piece, l.latency, l.bandwidth)
            });
            self.tree = Some(match self.by_arrival {
                true => Tree::by_arrival(self.num, self.rotate),
                false => Tree::new(self.num, d),
            });
            self.slots = vec![None; self.num];
            self.gen = vec![0; self.num];
            self.tasks = (0..self.num).map(|_| None).collect();
            self.done = vec![false; self.num];
            self.dispatches = vec![0; self.num];
            self.attempts = vec![0; self.num];
            self.placed_at = vec![None; self.num];
            self.reserved = vec![None; self.num];
            self.task_errors = vec![0; self.num];
        } else if info.size != self.full_size {
            return Err(super::other_size(
                &self.sources[i],
                info.size,
                self.full_size,
            ));
        }
        // An input takes part once: another answer for one placed or waiting as a spare (a
        // subscription made again around a shard's failure while the first one was still
        // answered) changes nothing. Placed twice, it would be counted twice.
        let known = |s: &(usize, NodeId)| s.0 == i;
        if self.slots.iter().flatten().any(known) || self.spares.iter().any(known) {
            return Ok(true);
        }
        // Spread positions over nodes: a complete copy on a node not in the tree yet, else
        // any live copy.
        let placed = |n: NodeId| self.slots.iter().flatten().any(|(_, m)| *m == n);
        let live = info
            .locations
            .iter()
            .filter(|l| !self.gone(l.node))
            .min_by_key(|l| (placed(l.node), !l.complete))
            .map(|l| l.node);
        let node = match (live, &self.inline[i], self.scratch.1) {
            (Some(node), _, _) => node,
            // Every copy died, but the directory keeps a small object's bytes and they came
            // with the answer: the coordinator holds them (a tree of small inputs is combined
            // there, and a task would read them from the directory).
            (None, Some(_), Some(coordinator)) => coordinator,
            _ => return Ok(false),
        };
        // Back to the position a repair took it out of, if it is still kept for it.
        let kept = (0..self.num)
            .find(|&p| self.slots[p].is_none() && self.reserved[p].is_some_and(|r| r.0 == i));
        if let Some(p) = kept {
            self.reserved[p] = None;
            self.place(p, (i, node));
            return Ok(true);
        }
        self.spares.push_back((i, node));
        self.fill_from_spares();
        Ok(true)
    }

    /// When the first position kept for an input ([`Run::reserved`]) is given up.
    pub(super) fn reserved_until(&self) -> Option<Instant> {
        self.reserved.iter().flatten().map(|r| r.1).min()
    }

    /// Gives up the positions kept for inputs that did not come back by `now`: spares take
    /// them.
    pub(super) fn release_reserved(&mut self, now: Instant) {
        let mut released = false;
        for r in self.reserved.iter_mut() {
            if r.is_some_and(|r| r.1 <= now) {
                *r = None;
                released = true;
            }
        }
        if released {
            self.fill_from_spares();
        }
    }

    /// Whether copies on `node` cannot be placed: it died during the reduce, or was down
    /// when the reduce began and still is (see `Run::members`).
    fn gone(&self, node: NodeId) -> bool {
        self.dead.contains(&node)
            || (self.down_at_start.contains(&node)
                && self.members.as_ref().is_some_and(|m| m.is_down(node)))
    }

    /// Empty positions take spares in generalised in-order. The first in-order positions
    /// (the deepest) are kept for the required sources, so a long-lived required input (a
    /// model) is a leaf and the target lands on the node of the last optional arrival rather
    /// than on the same node every time; the other positions take optional sources in
    /// arrival order, only those no other reduce sharing the claims took.
    pub(super) fn fill_from_spares(&mut self) {
        let Some(tree) = &self.tree else { return };
        let mut inorder = tree.inorder.clone();
        // A by-arrival tree's rotation is its root's place in the arrival order already.
        let turn = match tree.by_arrival {
            true => 0,
            false => self.rotate % inorder.len().max(1),
        };
        inorder.rotate_left(turn);
        for (k, p) in inorder.into_iter().enumerate() {
            if self.slots[p].is_some() || self.reserved[p].is_some() {
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
                self.place(p, s);
            }
        }
    }

    /// Places input `s.0` (on node `s.1`) at position `p`.
    fn place(&mut self, p: usize, s: (usize, NodeId)) {
        tracing::debug!(
            target_id = self.target.as_str(),
            position = p,
            input = s.0,
            on = s.1,
            gen = self.gen[p],
            "reduce input placed"
        );
        self.slots[p] = Some(s);
        self.placed_at[p] = Some(Instant::now());
    }

    /// Whether every placed source is small and its bytes are here: then the reduce waits for
    /// the whole tree and combines it here (no task, no pull).
    fn all_inline(&self) -> bool {
        self.range.is_none()
            && self.size < crate::config::INLINE_LIMIT
            && self.dispatches.iter().all(|&d| d == 0)
            && self
                .slots
                .iter()
                .flatten()
                .all(|&(i, _)| self.inline[i].is_some())
    }

    /// Whether [`Run::combine_locally`] has a result to give.
    pub(super) fn combinable(&self) -> bool {
        !self.local && self.tree.is_some() && self.placed() == self.num && self.all_inline()
    }

    /// With every position placed and every input inline, the result, combined in the tree's
    /// order (bit for bit what the tasks would compute), once; every position is then done.
    pub(super) fn combine_locally(&mut self) -> Option<Vec<u8>> {
        let tree = self.tree.clone()?;
        if self.local || self.placed() != self.num || !self.all_inline() {
            return None;
        }
        let out = self.value_of(&tree, 0);
        self.done.iter_mut().for_each(|d| *d = true);
        self.local = true;
        Some(out)
    }

    /// Position `p`'s output: `own ⊕ children...`, from inline inputs.
    fn value_of(&self, tree: &Tree, p: usize) -> Vec<u8> {
        let own = self.inline[self.slots[p].expect("placed").0]
            .as_deref()
            .expect("inline");
        let Some((first, rest)) = tree.children[p].split_first() else {
            return own.to_vec();
        };
        let mut out = vec![0u8; own.len()];
        combine_into(
            self.op,
            self.dtype,
            &mut out,
            own,
            &self.value_of(tree, *first),
        );
        for &c in rest {
            combine(self.op, self.dtype, &mut out, &self.value_of(tree, c));
        }
        out
    }

    /// Positions whose inputs are all placed and that have no task yet, with their tasks.
    pub(super) fn dispatchable(&mut self) -> Vec<(usize, ReduceTask)> {
        let Some(tree) = self.tree.clone() else {
            return Vec::new();
        };
        if self.all_inline() {
            return Vec::new(); // combined here once the tree is full
        }
        // A tree by arrival's root starts as soon as it is placed (its chain came before
        // it): it pulls what is there meanwhile, and each later input once the directory has
        // it (named by its position, it needs no node: `ReduceTask::children_at`). Only for
        // a partition (`range`), where every position, leaves included, has a task and so
        // an output of its own name.
        let later_ok = tree.by_arrival && self.range.is_some();
        let mut out = Vec::new();
        for p in 0..self.num {
            let needs_task = self.has_task(&tree, p);
            let ready = self.slots[p].is_some()
                && tree.children[p]
                    .iter()
                    .all(|&c| self.slots[c].is_some() || later_ok);
            // Never to a node known dead (a repair moves or finishes such positions).
            let on_dead = self.slots[p].is_some_and(|s| self.dead.contains(&s.1));
            if !needs_task || !ready || on_dead || self.tasks[p].is_some() || self.done[p] {
                continue;
            }
            out.push((
                p,
                ReduceTask {
                    out: self.out_of(&tree, p),
                    attempt: 0, // set as it is dispatched
                    own: self.sources[self.slots[p].expect("placed").0].clone(),
                    own_offset: self.range.map_or(0, |r| r.0),
                    children: tree.children[p]
                        .iter()
                        .map(|&c| self.out_of(&tree, c))
                        .collect(),
                    children_at: tree.children[p]
                        .iter()
                        .map(|&c| self.slots[c].or(self.slots[p]).expect("placed").1)
                        .collect(),
                    size: self.size,
                    op: self.op,
                    dtype: self.dtype,
                    chunk: self.chunk,
                    result: p == 0,
                },
            ));
        }
        out
    }

    /// Where each node of a partition's tree fetches the partition from in the allgather of
    /// a partitioned allreduce, once: when the tree is first fully placed, before any
    /// repair, and only for a partition (`range`). A tree with no allgather order
    /// ([`Tree::gather_order`]: degree 2 or more, small partitions) has every node fetch from
    /// the root's node. A chain's partition travels the chain's links once more, root -> leaf
    /// -> ... -> the root's child (with the partitions' chains rotated, a ring); a by-arrival
    /// tree's goes down its chain and ends at the last arrival. In that order a node takes the place of its
    /// first position, and fetches from the node of the place before it; the root produces
    /// it. Every node thus fetches from a node strictly earlier in the order, so the hints
    /// cannot name each other in a circle, even when one node holds several positions (an
    /// input's replicas). After a repair no hints are made: the directory chooses.
    pub(super) fn gather_hints(&mut self) -> Vec<(NodeId, GatherFrom)> {
        let Some(tree) = &self.tree else {
            return Vec::new();
        };
        let repaired = !self.dead.is_empty() || self.gen.iter().any(|&g| g > 0);
        let placed = self.slots.iter().all(Option::is_some);
        if self.hinted || self.range.is_none() || repaired || !placed {
            return Vec::new();
        }
        self.hinted = true;
        let node_at = |p: usize| self.slots[p].expect("placed").1;
        let root = node_at(0);
        let mut hints: Vec<(NodeId, GatherFrom)> = vec![(root, GatherFrom::Here)];
        match tree.gather_order() {
            // Not a chain (a small partition, or a degree asked for): every node fetches it
            // from the root's node, as the directory would send it; told so at once, so no
            // node waits for a hint that a chain alone would give.
            None => {
                for node in self.slots.iter().flatten().map(|s| s.1) {
                    if !hints.iter().any(|(m, _)| *m == node) {
                        hints.push((node, GatherFrom::Node(root)));
                    }
                }
            }
            Some(order) => {
                for (p, from) in order {
                    let node = node_at(p);
                    if hints.iter().any(|(m, _)| *m == node) {
                        continue; // placed earlier in the order: that place's hint stands
                    }
                    // The order starts at the root (`None`), whose hint is in already.
                    let Some(f) = from else { continue };
                    hints.push((node, GatherFrom::Node(node_at(f))));
                }
            }
        }
        // The coordinator's node, when it holds no place in the tree (a driver), reads the
        // partition too: from the root, which has it first and, in a chain, sends it once
        // (every node but the root and its child twice: up the chain, then on in the ring).
        // Not after trees by arrival: it asks the directory.
        if let (Some(home), false) = (self.scratch.1, tree.by_arrival) {
            if !hints.iter().any(|(m, _)| *m == home) {
                hints.push((home, GatherFrom::Node(root)));
            }
        }
        hints
    }

    /// A node died: positions it held leave the tree and, with every ancestor that had not
    /// finished, are recomputed; finished subtrees keep their results. `None` if the node was
    /// known dead already or nothing is placed yet.
    pub(super) fn repair(&mut self, node: NodeId) -> Option<Repair> {
        if !self.dead.insert(node) || self.settled {
            return None;
        }
        let tree = self.tree.clone()?;
        let failed: Vec<usize> = (0..self.num)
            .filter(|&p| self.slots[p].is_some_and(|s| s.1 == node))
            .collect();
        let mut affected: Vec<usize> = Vec::new();
        for &p in &failed {
            // A position whose parent already finished (on a live node) contributed already.
            let mut cur = Some(p);
            while let Some(a) = cur {
                let a_dead = self.slots[a].is_some_and(|s| self.dead.contains(&s.1));
                if a != p && self.done[a] && !a_dead {
                    break;
                }
                if !affected.contains(&a) {
                    affected.push(a);
                }
                cur = tree.parent[a];
            }
            if let Some(parent) = tree.parent[p] {
                let pd = self.slots[parent].is_some_and(|s| self.dead.contains(&s.1));
                if self.done[parent] && !pd {
                    affected.retain(|&a| a != p);
                    // Its output is in its parent's: it is done, even if its own reply died
                    // with its node (else it would be dispatched to the dead node again and
                    // again, each send failing).
                    self.done[p] = true;
                    self.tasks[p] = None;
                }
            }
        }
        let mut r = Repair {
            failed,
            ..Default::default()
        };
        for &a in &affected {
            // Also when its task's reply is already gone (a PeerDown reply clears it before
            // the repair): copies of its output may live on, e.g. the partial copy its parent
            // pulled, and must never be read again under the same name.
            if self.tasks[a].is_some() || self.done[a] || self.dispatches[a] > 0 {
                r.actions.extend(self.discard(&tree, a));
            }
            self.tasks[a] = None;
            self.done[a] = false;
            if r.failed.contains(&a) {
                let (idx, _) = self.slots[a].take().expect("failed positions are placed");
                self.placed_at[a] = None;
                // Kept for the same input's other copy a while: computed again from the
                // same inputs in the same places, the target has the same bytes, which a
                // reader may have had before the death.
                self.reserved[a] = Some((idx, Instant::now() + RETURN_GRACE));
                r.resubscribe.push(idx);
            }
        }
        r.affected = affected;
        // Spares on the dead node cannot take a position: asked for again (a copy may live on
        // elsewhere, or the node may rejoin).
        let dead = &self.dead;
        let (gone, kept): (Vec<_>, Vec<_>) =
            self.spares.drain(..).partition(|s| dead.contains(&s.1));
        self.spares = kept.into();
        r.resubscribe.extend(gone.into_iter().map(|s| s.0));
        self.fill_from_spares();
        Some(r)
    }

    /// Stops position `a`'s task and drops its (partial) output, which is computed again
    /// under a new generation. The target keeps its name: its readers wait for the new bytes.
    fn discard(&mut self, tree: &Tree, a: usize) -> Vec<Action> {
        if !self.has_task(tree, a) {
            return Vec::new(); // a leaf's output is its source, not ours to drop
        }
        let out = self.out_of(tree, a);
        let mut actions = Vec::new();
        if let Some((_, n)) = self.slots[a].filter(|s| !self.dead.contains(&s.1)) {
            actions.push(Action::Cancel {
                node: n,
                out: out.clone(),
                attempt: self.attempts[a],
            });
        }
        actions.push(if a == 0 {
            Action::Reset(out)
        } else {
            Action::Delete(out)
        });
        self.gen[a] += 1;
        self.tasks[a] = None;
        self.done[a] = false;
        actions
    }

    /// The tasks dispatched and not done, on live nodes: (node, output, attempt). A finished
    /// run has none.
    pub(super) fn unfinished_tasks(&self) -> Vec<(NodeId, ObjectId, u64)> {
        let Some(tree) = &self.tree else {
            return Vec::new();
        };
        (0..self.num)
            .filter(|&p| self.tasks[p].is_some() && !self.done[p])
            .filter_map(|p| {
                let (_, node) = self.slots[p]?;
                let live = !self.dead.contains(&node);
                live.then(|| (node, self.out_of(tree, p), self.attempts[p]))
            })
            .collect()
    }

    /// Position `p`'s task failed: it and every ancestor (all of them read its output) are
    /// computed again.
    pub(super) fn recompute(&mut self, p: usize) -> Vec<Action> {
        let tree = self.tree.clone().expect("a task runs only in a tree");
        let mut actions = Vec::new();
        let mut cur = Some(p);
        while let Some(a) = cur {
            actions.extend(self.discard(&tree, a));
            cur = tree.parent[a];
        }
        actions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A link for the tests' runs: 100 us, 1 GB/s, 1 MiB pieces.
    const LINK: LinkModel = LinkModel {
        latency: 1e-4,
        bandwidth: 1e9,
        piece: 1 << 20,
    };

    #[test]
    fn required_sources_take_the_deepest_positions() {
        let sources = ["m", "g0", "g1", "g2"].map(ObjectId::new);
        let opts = ReduceOptions {
            degree: Some(1),
            required: vec![sources[0].clone()],
            ..Default::default()
        };
        let kind = (ReduceOp::Sum, DType::F32);
        let mut run = Run::new(ObjectId::new("t"), &sources, 3, kind, &opts, LINK);
        let info = complete_on;
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
        // Known already (a spare): another answer changes nothing.
        assert!(run.arrived(3, &info(6)).unwrap());
        assert_eq!(run.spares.len(), 1);
        // Every copy on dead nodes: asked again later.
        let mut run = Run::new(ObjectId::new("t"), &sources, 3, kind, &opts, LINK);
        run.dead.insert(5);
        assert!(!run.arrived(3, &info(5)).unwrap());
        assert!(run.spares.is_empty());
    }

    /// Follows a node's hint to the producer; None if the hints lead round in a circle.
    fn steps_to_producer(hints: &[(NodeId, GatherFrom)], from: NodeId) -> Option<usize> {
        let mut at = from;
        for steps in 0..=hints.len() {
            match hints.iter().find(|(n, _)| *n == at).map(|h| h.1) {
                Some(GatherFrom::Here) => return Some(steps),
                Some(GatherFrom::Node(next)) => at = next,
                None => return None,
            }
        }
        None
    }

    #[test]
    fn a_tree_that_is_no_chain_hints_its_root_to_every_node() {
        let kind = (ReduceOp::Sum, DType::F32);
        let opts = ReduceOptions {
            degree: Some(2),
            range: Some((0, 32)),
            ..Default::default()
        };
        let sources: Vec<ObjectId> = (0..5).map(|i| ObjectId::new(format!("s{i}"))).collect();
        let mut run = Run::new(ObjectId::new("p"), &sources, 5, kind, &opts, LINK);
        for i in 0..5 {
            assert!(
                run.gather_hints().is_empty(),
                "not before the tree is placed"
            );
            assert!(run.arrived(i, &complete_on(10 + i as NodeId)).unwrap());
        }
        let hints = run.gather_hints();
        let root = run.slots[0].unwrap().1;
        assert_eq!(hints.len(), 5, "{hints:?}");
        assert!(hints.contains(&(root, GatherFrom::Here)));
        for n in (10..15).filter(|&n| n != root) {
            assert!(hints.contains(&(n, GatherFrom::Node(root))), "{hints:?}");
        }
        assert!(run.gather_hints().is_empty(), "made once");
    }

    #[test]
    fn gather_hints_follow_the_chain_once_and_never_in_a_circle() {
        let kind = (ReduceOp::Sum, DType::F32);
        let part = |rotate| ReduceOptions {
            degree: Some(1),
            range: Some((0, 32)),
            rotate,
            ..Default::default()
        };
        // Five inputs on five nodes: a ring, root -> leaf -> ... -> the root's child.
        let sources: Vec<ObjectId> = (0..5).map(|i| ObjectId::new(format!("s{i}"))).collect();
        let mut run = Run::new(ObjectId::new("p"), &sources, 5, kind, &part(0), LINK);
        for i in 0..4 {
            assert!(run.arrived(i, &complete_on(10 + i as NodeId)).unwrap());
            assert!(
                run.gather_hints().is_empty(),
                "not before the chain is placed"
            );
        }
        assert!(run.arrived(4, &complete_on(14)).unwrap());
        let hints = run.gather_hints();
        let node_at = |p: usize| run.slots[p].unwrap().1;
        assert_eq!(hints.len(), 5, "{hints:?}");
        assert!(hints.contains(&(node_at(0), GatherFrom::Here)));
        assert!(hints.contains(&(node_at(4), GatherFrom::Node(node_at(0)))));
        for p in 1..4 {
            assert!(hints.contains(&(node_at(p), GatherFrom::Node(node_at(p + 1)))));
        }
        assert!(run.gather_hints().is_empty(), "made once");

        // Six positions on four nodes (replicas: nodes 21 and 22 hold two inputs each, in
        // every arrival order): every node gets one hint, and every hint leads to the root.
        let sources: Vec<ObjectId> = (0..6).map(|i| ObjectId::new(format!("r{i}"))).collect();
        let holders: [NodeId; 6] = [21, 22, 21, 23, 22, 24];
        for rotate in 0..6 {
            for shift in 0..6 {
                let mut run = Run::new(ObjectId::new("p"), &sources, 6, kind, &part(rotate), LINK);
                for k in 0..6 {
                    let i = (k + shift) % 6;
                    // Only the replica's node: a node holds two positions.
                    let info = complete_on(holders[i]);
                    assert!(run.arrived(i, &info).unwrap());
                }
                let hints = run.gather_hints();
                let mut nodes: Vec<NodeId> = hints.iter().map(|h| h.0).collect();
                nodes.sort();
                nodes.dedup();
                assert_eq!(nodes.len(), hints.len(), "one hint per node: {hints:?}");
                assert_eq!(nodes, vec![21, 22, 23, 24], "{hints:?}");
                for &n in &nodes {
                    assert!(
                        steps_to_producer(&hints, n).is_some(),
                        "rotate {rotate} shift {shift}: node {n} is in a circle: {hints:?}"
                    );
                }
            }
        }

        // A coordinator whose node holds no place (a driver) is told to read the partition
        // from the root; one that holds a place gets its place's hint only; after trees by
        // arrival the driver gets none (the directory chooses).
        let sources: Vec<ObjectId> = (0..3).map(|i| ObjectId::new(format!("h{i}"))).collect();
        for (home, by_arrival) in [(9, false), (51, false), (9, true)] {
            let opts = ReduceOptions {
                by_arrival,
                ..part(0)
            };
            let mut run = Run::new(ObjectId::new("p"), &sources, 3, kind, &opts, LINK);
            run.scratch = (1, Some(home));
            for i in 0..3 {
                assert!(run.arrived(i, &complete_on(50 + i as NodeId)).unwrap());
            }
            let hints = run.gather_hints();
            let root = run.slots[0].unwrap().1;
            let mine: Vec<_> = hints.iter().filter(|h| h.0 == home).collect();
            match (home, by_arrival) {
                (9, false) => assert_eq!(mine, [&(9, GatherFrom::Node(root))], "{hints:?}"),
                (9, true) => assert!(mine.is_empty(), "{hints:?}"),
                _ => assert_eq!(mine.len(), 1, "{hints:?}"),
            }
            assert_eq!(hints.len(), if home == 9 && !by_arrival { 4 } else { 3 });
        }
        // Not a chain (a degree asked for): every node, the driver's too, from the root.
        let opts = ReduceOptions {
            degree: Some(2),
            ..part(0)
        };
        let mut run = Run::new(ObjectId::new("p"), &sources, 3, kind, &opts, LINK);
        run.scratch = (1, Some(9));
        for i in 0..3 {
            assert!(run.arrived(i, &complete_on(60 + i as NodeId)).unwrap());
        }
        let hints = run.gather_hints();
        let root = run.slots[0].unwrap().1;
        assert!(hints.contains(&(9, GatherFrom::Node(root))), "{hints:?}");
        assert_eq!(hints.len(), 4, "{hints:?}");

        // After a repair no hints: the directory chooses.
        let sources: Vec<ObjectId> = (0..3).map(|i| ObjectId::new(format!("d{i}"))).collect();
        let mut run = Run::new(ObjectId::new("p"), &sources, 3, kind, &part(0), LINK);
        for i in 0..3 {
            assert!(run.arrived(i, &complete_on(30 + i as NodeId)).unwrap());
        }
        run.dead.insert(31);
        assert!(run.gather_hints().is_empty());
        // A plain reduce (no range) gets none either.
        let opts = ReduceOptions {
            degree: Some(1),
            ..Default::default()
        };
        let mut run = Run::new(ObjectId::new("t"), &sources, 3, kind, &opts, LINK);
        for i in 0..3 {
            assert!(run.arrived(i, &complete_on(40 + i as NodeId)).unwrap());
        }
        assert!(run.gather_hints().is_empty());
    }

    /// A chain (degree 1) reduce of `num` of `n` sources `s0..` into `t`, of the partition
    /// `range` if any.
    fn chain(n: usize, num: usize, range: Option<(u64, u64)>) -> Run {
        let sources: Vec<ObjectId> = (0..n).map(|i| ObjectId::new(format!("s{i}"))).collect();
        let opts = ReduceOptions {
            degree: Some(1),
            range,
            ..Default::default()
        };
        let kind = (ReduceOp::Sum, DType::F32);
        Run::new(ObjectId::new("t"), &sources, num, kind, &opts, LINK)
    }

    /// A tree by arrival rooted at the second arrival of four: with a range (a partition)
    /// its root's task goes out as soon as the root is placed, its later child named but
    /// not placed (asked of the directory, `children_at` the root's own node); without one
    /// (leaves have no task, nor an output of their own name) only once every child is
    /// placed. A run that ends unfinished names its tasks still out, to be cancelled.
    #[test]
    fn a_tree_by_arrival_starts_its_root_before_its_later_inputs_only_for_a_partition() {
        let sources: Vec<ObjectId> = (0..4).map(|i| ObjectId::new(format!("s{i}"))).collect();
        let kind = (ReduceOp::Sum, DType::F32);
        for range in [Some((0, 64)), None] {
            let opts = ReduceOptions {
                range,
                rotate: 1,
                by_arrival: true,
                ..Default::default()
            };
            let mut run = Run::new(ObjectId::new("t"), &sources, 4, kind, &opts, LINK);
            run.arrived(0, &complete_on(10)).unwrap();
            run.arrived(1, &complete_on(11)).unwrap();
            let tree = run.tree.clone().unwrap();
            assert!(tree.by_arrival && tree.inorder == vec![1, 0, 2, 3]);
            let mut roots: Vec<ReduceTask> = run
                .dispatchable()
                .into_iter()
                .filter(|(p, _)| *p == 0)
                .map(|(_, t)| t)
                .collect();
            match range {
                Some(_) => {
                    let root = roots.pop().expect("the root goes out at once");
                    assert_eq!(root.children_at, vec![10, 11, 11]);
                    assert_eq!(root.children[1], run.out_of(&tree, 2));
                }
                None => assert!(roots.is_empty(), "no root before its children"),
            }
            run.arrived(2, &complete_on(12)).unwrap();
            run.arrived(3, &complete_on(13)).unwrap();
            if range.is_none() {
                let root = run.dispatchable().into_iter().find(|(p, _)| *p == 0);
                assert_eq!(root.expect("placed").1.children_at, vec![10, 12, 13]);
            }
            // Dispatched (as the coordinator does) and not done: named to be cancelled.
            run.tasks[0] = Some(crossbeam_channel::bounded(1).1);
            run.attempts[0] = 7;
            assert_eq!(run.unfinished_tasks(), vec![(11, ObjectId::new("t"), 7)]);
            run.done[0] = true;
            assert!(run.unfinished_tasks().is_empty());
        }
    }

    fn complete_on(node: NodeId) -> ObjectInfo {
        ObjectInfo {
            size: 64,
            inline: false,
            locations: vec![crate::protocol::LocationInfo {
                node,
                complete: true,
                serving: None,
                depends_on: None,
            }],
            lost: false,
        }
    }

    #[test]
    fn a_dead_leaf_is_replaced_and_only_its_unfinished_ancestors_recompute() {
        let sources: Vec<ObjectId> = (0..5).map(|i| ObjectId::new(format!("s{i}"))).collect();
        let opts = ReduceOptions {
            degree: Some(2),
            ..Default::default()
        };
        let kind = (ReduceOp::Sum, DType::F32);
        let mut run = Run::new(ObjectId::new("t"), &sources, 4, kind, &opts, LINK);
        for i in 0..4 {
            assert!(run.arrived(i, &complete_on(i as NodeId)).unwrap());
        }
        assert_eq!(run.placed(), 4);
        let tree = run.tree.clone().unwrap();
        // Pretend every inner position was dispatched and none finished.
        for p in 0..4 {
            if p == 0 || !tree.is_leaf(p) {
                run.dispatches[p] = 1;
            }
        }
        let leaf = (1..4).find(|&p| tree.is_leaf(p)).expect("a leaf");
        let leaf_node = run.slots[leaf].unwrap().1;
        let r = run.repair(leaf_node).expect("a repair");
        assert_eq!(r.failed, vec![leaf]);
        assert_eq!(r.resubscribe, vec![leaf_node as usize]);
        // Every ancestor of the leaf recomputes; the target is reset, never deleted.
        let mut ancestors = vec![leaf];
        while let Some(p) = tree.parent[*ancestors.last().unwrap()] {
            ancestors.push(p);
        }
        assert_eq!(r.affected, ancestors);
        assert!(r.actions.contains(&Action::Reset(ObjectId::new("t"))));
        assert!(!r.actions.contains(&Action::Delete(ObjectId::new("t"))));
        assert!(
            r.actions
                .iter()
                .all(|a| !matches!(a, Action::Cancel { node, .. } if *node == leaf_node)),
            "no cancel goes to the dead node"
        );
        assert!(run.gen[0] == 1, "the root's output gets a new generation");
        assert_eq!(run.placed(), 3, "no spare yet");
        // A spare arrives: the free position is kept for the dead leaf's input a while,
        // then the spare takes it.
        assert!(run.arrived(4, &complete_on(9)).unwrap());
        assert_eq!(run.slots[leaf], None, "kept for the input that was there");
        let over = run.reserved_until().expect("a position kept");
        run.release_reserved(over);
        assert_eq!(run.slots[leaf], Some((4, 9)));
        assert!(run.repair(leaf_node).is_none(), "a death is repaired once");
    }

    /// A first n of m whose placed input's node dies: the input's other copy (a replica)
    /// takes its position back before a spare can, so the root computed again has the same
    /// inputs in the same places (the same bytes a reader may have read before the death).
    #[test]
    fn a_dead_inputs_replica_takes_its_position_back_before_a_spare() {
        let sources: Vec<ObjectId> = (0..4).map(|i| ObjectId::new(format!("s{i}"))).collect();
        let kind = (ReduceOp::Sum, DType::F32);
        let opts = ReduceOptions::default();
        let mut run = Run::new(ObjectId::new("t"), &sources, 3, kind, &opts, LINK);
        for i in 0..3 {
            assert!(run.arrived(i, &complete_on(i as NodeId)).unwrap());
        }
        let p = run
            .slots
            .iter()
            .position(|s| s.is_some_and(|s| s.0 == 1))
            .unwrap();
        // A spare waits; input 1's node dies.
        assert!(run.arrived(3, &complete_on(3)).unwrap());
        let r = run.repair(1).expect("a repair");
        assert_eq!(r.resubscribe, vec![1]);
        assert_eq!(run.slots[p], None, "no spare takes it at once");
        // The replica of input 1 answers: the same position again.
        assert!(run.arrived(1, &complete_on(5)).unwrap());
        assert_eq!(run.slots[p], Some((1, 5)));
        assert_eq!(run.spares.len(), 1, "the spare stays one");
        assert_eq!(run.reserved_until(), None);
    }

    /// A source answered twice (subscribed again around a shard's failure while the first
    /// subscription was still answered) takes one position: placed twice it was counted
    /// twice, and another input was left out (seen in `tests/allreduce.rs`'s partition-root
    /// kill). Freed by a repair, its next answer places it again.
    #[test]
    fn an_input_answered_twice_is_placed_once() {
        let mut run = chain(3, 3, None);
        assert!(run.arrived(0, &complete_on(10)).unwrap());
        assert!(run.arrived(1, &complete_on(11)).unwrap());
        // Input 1 again, from another copy: nothing changes.
        assert!(run.arrived(1, &complete_on(12)).unwrap());
        assert_eq!(run.placed(), 2);
        assert!(run.spares.is_empty());
        assert!(run.arrived(2, &complete_on(12)).unwrap());
        let used = |run: &Run| {
            let mut v: Vec<usize> = run.slots.iter().flatten().map(|s| s.0).collect();
            v.sort();
            v
        };
        assert_eq!(used(&run), vec![0, 1, 2]);
        // Input 1's node dies: its position is freed and the input asked for again.
        let r = run.repair(11).expect("a repair");
        assert_eq!(r.resubscribe, vec![1]);
        assert!(run.arrived(1, &complete_on(13)).unwrap());
        assert_eq!(used(&run), vec![0, 1, 2]);
        assert!(run.slots.iter().flatten().any(|&s| s == (1, 13)));
    }

    /// A position whose node died after its parent had finished (its output consumed), with
    /// its own reply lost with the node: done, never dispatched to the dead node again (it
    /// was, in a loop, each send failing at once).
    #[test]
    fn a_dead_position_whose_parent_finished_is_done() {
        let mut run = chain(2, 2, Some((0, 32)));
        assert!(run.arrived(0, &complete_on(1)).unwrap());
        assert!(run.arrived(1, &complete_on(2)).unwrap());
        let tree = run.tree.clone().unwrap();
        assert!(
            run.has_task(&tree, 1),
            "a partition's leaf computes its slice"
        );
        let leaf_node = run.slots[1].unwrap().1;
        let (_keep, rx) = crossbeam_channel::bounded(1);
        run.tasks[1] = Some(rx);
        run.dispatches = vec![1, 1];
        run.done[0] = true;
        let r = run.repair(leaf_node).expect("a repair");
        assert_eq!(r.failed, vec![1]);
        assert!(r.affected.is_empty() && r.actions.is_empty() && r.resubscribe.is_empty());
        assert!(run.dispatchable().is_empty());
        assert!(run.finished());
    }

    /// A repair's cancel names the attempt that was dispatched, so it cannot stop a later
    /// dispatch of the same position under the same name (the root's output is the target
    /// in every generation).
    #[test]
    fn a_repair_cancels_the_attempt_it_discards() {
        let mut run = chain(2, 2, None);
        assert!(run.arrived(0, &complete_on(1)).unwrap());
        assert!(run.arrived(1, &complete_on(2)).unwrap());
        let root_node = run.slots[0].unwrap().1;
        let leaf_node = run.slots[1].unwrap().1;
        run.dispatches[0] = 1;
        run.attempts[0] = 77;
        let r = run.repair(leaf_node).expect("a repair");
        assert!(r.actions.contains(&Action::Cancel {
            node: root_node,
            out: ObjectId::new("t"),
            attempt: 77,
        }));
    }

    /// A small input whose every copy died is still in the directory, its bytes with the
    /// answer: placed at the coordinator, which combines the tree (it was asked for again
    /// every 50 ms until the op timeout, never placed).
    #[test]
    fn a_small_input_whose_copies_died_is_placed_with_its_bytes() {
        let mut run = chain(3, 3, None);
        run.scratch = (1, Some(5));
        let mut inputs = Vec::new();
        for i in 0..3u8 {
            let bytes: Vec<u8> = (0..16)
                .flat_map(|k| (f32::from(i + k)).to_le_bytes())
                .collect();
            inputs.push(bytes);
        }
        let small = |nodes: &[NodeId]| ObjectInfo {
            size: 64,
            inline: true,
            locations: nodes
                .iter()
                .map(|&node| crate::protocol::LocationInfo {
                    node,
                    complete: true,
                    serving: None,
                    depends_on: None,
                })
                .collect(),
            lost: false,
        };
        for (i, bytes) in inputs.iter().enumerate().take(2) {
            run.inline[i] = Some(bytes.clone());
            assert!(run.arrived(i, &small(&[10 + i as NodeId])).unwrap());
        }
        // Input 2's holder died: no location left, the bytes with the answer.
        assert!(
            !run.arrived(2, &small(&[])).unwrap(),
            "no bytes: asked again"
        );
        run.inline[2] = Some(inputs[2].clone());
        assert!(run.arrived(2, &small(&[])).unwrap());
        assert!(run.slots.iter().flatten().any(|&s| s == (2, 5)));
        let got = run.combine_locally().expect("every input inline");
        let mut want = inputs[0].clone();
        for x in &inputs[1..] {
            combine(ReduceOp::Sum, DType::F32, &mut want, x);
        }
        assert_eq!(got, want);
        assert!(run.finished());
    }

    #[test]
    fn a_spare_on_the_dead_node_is_never_placed() {
        let mut run = chain(4, 2, None);
        // Node 7 holds a placed source and a spare; node 8 a spare that arrived later.
        assert!(run.arrived(0, &complete_on(7)).unwrap());
        assert!(run.arrived(1, &complete_on(1)).unwrap());
        assert!(run.arrived(2, &complete_on(7)).unwrap());
        assert!(run.arrived(3, &complete_on(8)).unwrap());
        assert_eq!(run.placed(), 2);
        let r = run.repair(7).expect("a repair");
        assert!(r.resubscribe.contains(&0) && r.resubscribe.contains(&2));
        assert_eq!(
            run.placed(),
            1,
            "the freed position kept for input 0 a while"
        );
        run.release_reserved(run.reserved_until().expect("kept"));
        assert!(
            run.slots.iter().flatten().all(|&(_, n)| n != 7),
            "no position on the dead node: {:?}",
            run.slots
        );
        assert_eq!(run.placed(), 2, "the live spare took the freed position");
    }
}
