//! Dynamic tree reduce. The caller coordinates: it subscribes to every source in the
//! directory, places each source that becomes ready into a d-ary tree in arrival order
//! (generalised in-order: first child, the node itself, then children 2..d), stops at
//! `num_objects`, and tells each inner position to compute `own ⊕ children` into an
//! intermediate object that its parent pulls while it fills. The root writes the target, which
//! is published as a partial copy from its first byte, so readers overlap with the reduce.

use crate::node::{Fetched, Inner};
use crate::ops::{combine, DType, ReduceOp};
use crate::protocol::{Msg, ObjectInfo, ReduceTask, Reply};
use crate::{Error, Node, ObjectId, Result};
use crossbeam_channel::{Receiver, Select};
use phalanx_transport::NodeId;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Shape of a d-ary tree over `n` positions, numbered breadth-first (root 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tree {
    pub degree: usize,
    pub parent: Vec<Option<usize>>,
    pub children: Vec<Vec<usize>>,
    /// Positions in generalised in-order; the k-th source to arrive takes `inorder[k]`.
    pub inorder: Vec<usize>,
}

impl Tree {
    pub fn new(n: usize, degree: usize) -> Tree {
        let d = degree.clamp(1, n.saturating_sub(1).max(1));
        let parent: Vec<Option<usize>> = (0..n)
            .map(|i| if i == 0 { None } else { Some((i - 1) / d) })
            .collect();
        let mut children = vec![Vec::new(); n];
        for (i, p) in parent.iter().enumerate() {
            if let Some(p) = p {
                children[*p].push(i);
            }
        }
        let mut inorder = Vec::with_capacity(n);
        fn visit(i: usize, ch: &[Vec<usize>], out: &mut Vec<usize>) {
            if let Some((first, rest)) = ch[i].split_first() {
                visit(*first, ch, out);
                out.push(i);
                for c in rest {
                    visit(*c, ch, out);
                }
            } else {
                out.push(i);
            }
        }
        if n > 0 {
            visit(0, &children, &mut inorder);
        }
        Tree {
            degree: d,
            parent,
            children,
            inorder,
        }
    }

    pub fn is_leaf(&self, p: usize) -> bool {
        self.children[p].is_empty()
    }
}

/// Picks d in 1..=n (d = n: the root takes everyone else) minimising T(1) = nL + S/B and T(d) = L·⌈log_d n⌉ + d·S/B.
pub fn choose_degree(n: usize, size: u64, latency_s: f64, bandwidth_bps: f64) -> usize {
    let s_over_b = size as f64 / bandwidth_bps;
    let cost = |d: usize| -> f64 {
        if d == 1 {
            n as f64 * latency_s + s_over_b
        } else {
            let mut depth = 0;
            let mut reach = 1usize;
            while reach < n {
                reach = reach.saturating_mul(d);
                depth += 1;
            }
            latency_s * depth as f64 + d as f64 * s_over_b
        }
    };
    (1..=n.max(1))
        .min_by(|&a, &b| cost(a).total_cmp(&cost(b)))
        .unwrap_or(1)
}

/// How to run a reduce.
#[derive(Debug, Clone)]
pub struct ReduceOptions {
    /// Tree degree; `None` picks it from the latency/bandwidth model.
    pub degree: Option<usize>,
    /// Bytes combined per step.
    pub chunk: u64,
    /// Give up after this long (default: the node's op timeout).
    pub timeout: Option<Duration>,
}

impl Default for ReduceOptions {
    fn default() -> Self {
        ReduceOptions {
            degree: None,
            chunk: 1 << 20,
            timeout: None,
        }
    }
}

/// One position of the tree as it was filled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeSlot {
    pub position: usize,
    pub object: ObjectId,
    pub node: NodeId,
    pub parent: Option<usize>,
    pub children: Vec<usize>,
}

/// What a reduce did: the degree, which sources it used (in arrival order) and the tree.
#[derive(Debug, Clone)]
pub struct ReduceOutcome {
    pub target: ObjectId,
    pub degree: usize,
    pub used: Vec<ObjectId>,
    pub tree: Vec<TreeSlot>,
    pub latency_s: f64,
    pub bandwidth_bps: f64,
    /// When the last used source became ready, and when the reduce finished.
    pub last_ready: Instant,
    pub done: Instant,
}

impl Node {
    /// Reduces the first `num_objects` of `sources` to become ready into `target`.
    pub fn reduce(
        &self,
        target: impl Into<ObjectId>,
        sources: &[ObjectId],
        num_objects: usize,
        op: ReduceOp,
        dtype: DType,
    ) -> Result<ReduceOutcome> {
        self.reduce_with(
            target,
            sources,
            num_objects,
            op,
            dtype,
            &ReduceOptions::default(),
        )
    }

    /// [`Node::reduce`] with explicit options.
    pub fn reduce_with(
        &self,
        target: impl Into<ObjectId>,
        sources: &[ObjectId],
        num_objects: usize,
        op: ReduceOp,
        dtype: DType,
        opts: &ReduceOptions,
    ) -> Result<ReduceOutcome> {
        self.inner
            .coordinate_reduce(target.into(), sources, num_objects, op, dtype, opts)
    }

    /// Allreduce from the coordinator's side: reduces all `sources` into `target` and returns
    /// the result; the other participants call `get(target)`, which streams the target while
    /// it is still being reduced.
    pub fn allreduce(
        &self,
        target: impl Into<ObjectId>,
        sources: &[ObjectId],
        op: ReduceOp,
        dtype: DType,
        opts: &ReduceOptions,
    ) -> Result<(Vec<u8>, ReduceOutcome)> {
        let target = target.into();
        std::thread::scope(|s| {
            let h = s.spawn(|| {
                self.reduce_with(target.clone(), sources, sources.len(), op, dtype, opts)
            });
            let got = self.get(target.clone());
            let outcome = h.join().expect("reduce thread")?;
            Ok((got?, outcome))
        })
    }

    /// Gets several objects concurrently (a gather at this node).
    pub fn gather(&self, ids: &[ObjectId]) -> Result<Vec<Vec<u8>>> {
        std::thread::scope(|s| {
            let hs: Vec<_> = ids
                .iter()
                .map(|id| s.spawn(move || self.get(id.clone())))
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("gather thread"))
                .collect()
        })
    }
}

enum Input {
    Copy(crate::store::CopyRef),
    Owned(Vec<u8>),
}

impl Input {
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

impl Inner {
    fn input(self: &Arc<Self>, id: &ObjectId) -> Result<Input> {
        Ok(match self.fetch(id)? {
            Fetched::Copy(c) => Input::Copy(c),
            Fetched::Owned(v) => Input::Owned(v),
        })
    }

    /// Runs one tree position; called on the node that holds `task.own`.
    pub(crate) fn run_reduce_task(self: &Arc<Self>, t: &ReduceTask) -> Result<()> {
        let esz = t.dtype.size() as u64;
        let own = self.input(&t.own)?;
        let children = t
            .children
            .iter()
            .map(|c| self.input(c))
            .collect::<Result<Vec<_>>>()?;
        for (id, i) in std::iter::once(&t.own)
            .zip(std::iter::once(&own))
            .chain(t.children.iter().zip(&children))
        {
            if i.size() != t.size {
                return Err(Error::InvalidArgument(format!(
                    "reduce input {id} has {} bytes, expected {}",
                    i.size(),
                    t.size
                )));
            }
        }
        let (out, evicted) = self.store.create(&t.out, t.size, true)?;
        self.withdraw(&evicted);
        let shard = self.shard_of(&t.out);
        self.send(
            shard,
            Msg::Publish {
                id: t.out.clone(),
                size: t.size,
                node: self.id,
                complete: false,
            },
        )?;
        let chunk = (t.chunk / esz).max(1) * esz;
        let timeout = self.cfg.op_timeout;
        let mut off = 0;
        while off < t.size {
            let need = (off + esz).min(t.size);
            let mut avail = t.size;
            for i in std::iter::once(&own).chain(&children) {
                avail = avail.min(i.wait_for(need, timeout)?);
            }
            let end = (off + chunk).min(off + (avail - off) / esz * esz);
            out.fill_with(end - off, |dst| {
                dst.copy_from_slice(own.bytes(off, end));
                for c in &children {
                    combine(t.op, t.dtype, dst, c.bytes(off, end));
                }
            })?;
            off = end;
        }
        self.send(
            shard,
            Msg::Publish {
                id: t.out.clone(),
                size: t.size,
                node: self.id,
                complete: true,
            },
        )?;
        Ok(())
    }

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

    fn coordinate_reduce(
        self: &Arc<Self>,
        target: ObjectId,
        sources: &[ObjectId],
        num: usize,
        op: ReduceOp,
        dtype: DType,
        opts: &ReduceOptions,
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
        let timeout = opts.timeout.unwrap_or(self.cfg.op_timeout);
        let deadline = Instant::now() + timeout;
        let esz = dtype.size() as u64;
        // Asynchronous location queries: one subscription per source.
        let subs: Vec<Receiver<Result<Reply>>> = sources
            .iter()
            .map(|id| {
                self.call_async(self.shard_of(id), |rid| Msg::Subscribe {
                    rid,
                    id: id.clone(),
                })
            })
            .collect::<Result<_>>()?;
        let latency = self.measure_latency();
        let bandwidth = self.bandwidth_estimate();
        let mut pending: Vec<usize> = (0..sources.len()).collect();
        let mut tree: Option<Tree> = None;
        let mut size = 0;
        let mut slots: Vec<Option<(ObjectId, NodeId)>> = Vec::new();
        let mut dispatched: Vec<bool> = Vec::new();
        let mut used = Vec::new();
        let mut tasks: Vec<(usize, Receiver<Result<Reply>>)> = Vec::new();
        let mut last_ready = Instant::now();
        let out_id = |tree: &Tree, p: usize, slots: &[Option<(ObjectId, NodeId)>]| -> ObjectId {
            if p == 0 {
                target.clone()
            } else if tree.is_leaf(p) {
                slots[p].as_ref().expect("assigned").0.clone()
            } else {
                ObjectId::new(format!("{}#reduce-{p}", target.as_str()))
            }
        };
        while used.len() < num {
            if pending.len() < num - used.len() {
                return Err(Error::InvalidArgument(format!(
                    "only {} of {num} sources can still become ready",
                    used.len() + pending.len()
                )));
            }
            let mut sel = Select::new();
            for &i in &pending {
                sel.recv(&subs[i]);
            }
            let now = Instant::now();
            let op_ = sel
                .select_timeout(deadline.saturating_duration_since(now))
                .map_err(|_| Error::Timeout(timeout, format!("reduce sources of {target}")))?;
            let k = op_.index();
            let i = pending.remove(k);
            let info: Option<ObjectInfo> = match op_.recv(&subs[i]) {
                Ok(Ok(Reply::Info(info))) => info,
                Ok(Ok(r)) => return Err(self.unexpected(r)),
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(Error::Shutdown),
            };
            let Some(info) = info else {
                continue; // deleted before it became ready: it can never take part
            };
            if info.size % esz != 0 {
                return Err(Error::InvalidArgument(format!(
                    "reduce input {} has {} bytes, not a multiple of the {dtype:?} element size {esz}",
                    sources[i], info.size
                )));
            }
            let tree = match &tree {
                Some(t) => {
                    if info.size != size {
                        return Err(Error::InvalidArgument(format!(
                            "reduce input {} has {} bytes, others {size}",
                            sources[i], info.size
                        )));
                    }
                    t
                }
                None => {
                    size = info.size;
                    let d = opts
                        .degree
                        .unwrap_or_else(|| choose_degree(num, size, latency, bandwidth));
                    let t = Tree::new(num, d);
                    slots = vec![None; num];
                    dispatched = vec![false; num];
                    tree.insert(t)
                }
            };
            // Spread positions over nodes: a complete copy on a node not in the tree yet, else
            // any copy.
            let placed = |n: NodeId| slots.iter().flatten().any(|(_, m)| *m == n);
            let node = info
                .locations
                .iter()
                .min_by_key(|l| (placed(l.node), !l.complete))
                .map(|l| l.node)
                .ok_or_else(|| Error::Protocol {
                    peer: self.id,
                    what: format!("{} ready without a location", sources[i]),
                })?;
            let pos = tree.inorder[used.len()];
            slots[pos] = Some((sources[i].clone(), node));
            used.push(sources[i].clone());
            last_ready = Instant::now();
            // Start every position whose inputs are all placed.
            for p in 0..num {
                let ready = !dispatched[p]
                    && slots[p].is_some()
                    && tree.children[p].iter().all(|&c| slots[c].is_some());
                if !ready || (tree.is_leaf(p) && p != 0) {
                    continue;
                }
                dispatched[p] = true;
                let (own, node) = slots[p].clone().expect("assigned");
                let task = ReduceTask {
                    out: out_id(tree, p, &slots),
                    own,
                    children: tree.children[p]
                        .iter()
                        .map(|&c| out_id(tree, c, &slots))
                        .collect(),
                    size,
                    op,
                    dtype,
                    chunk: opts.chunk,
                };
                tasks.push((
                    p,
                    self.call_async(node, |rid| Msg::ReduceTask { rid, task })?,
                ));
            }
        }
        let tree = tree.expect("at least one source");
        for (p, rx) in &tasks {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(Ok(Reply::Ack)) => {}
                Ok(Ok(Reply::Error(e))) => {
                    return Err(Error::Protocol {
                        peer: slots[*p].as_ref().expect("assigned").1,
                        what: format!("reduce position {p}: {e}"),
                    })
                }
                Ok(Ok(r)) => return Err(self.unexpected(r)),
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    return Err(Error::Timeout(
                        timeout,
                        format!("reduce position {p} of {target}"),
                    ))
                }
            }
        }
        let done = Instant::now();
        // Intermediate results are not needed any more.
        for p in 1..num {
            if !tree.is_leaf(p) {
                let _ = self.delete(&out_id(&tree, p, &slots));
            }
        }
        let slots: Vec<TreeSlot> = (0..num)
            .map(|p| {
                let (object, node) = slots[p].clone().expect("assigned");
                TreeSlot {
                    position: p,
                    object,
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
            latency_s: latency,
            bandwidth_bps: bandwidth,
            last_ready,
            done,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_inorder_starts_at_the_deepest() {
        let t = Tree::new(4, 1);
        assert_eq!(t.parent, vec![None, Some(0), Some(1), Some(2)]);
        assert_eq!(t.inorder, vec![3, 2, 1, 0]);
    }

    #[test]
    fn binary_inorder() {
        let t = Tree::new(7, 2);
        assert_eq!(t.children[0], vec![1, 2]);
        assert_eq!(t.inorder, vec![3, 1, 4, 0, 5, 2, 6]);
        let star = Tree::new(5, 99);
        assert_eq!(star.degree, 4);
        assert_eq!(star.inorder, vec![1, 0, 2, 3, 4]);
    }

    #[test]
    fn degree_model() {
        // Large objects: bandwidth dominates, a chain wins.
        assert_eq!(choose_degree(8, 64 << 20, 50e-6, 1.25e9), 1);
        // Tiny objects: latency dominates, a wide tree wins.
        assert!(choose_degree(8, 1024, 50e-6, 1.25e9) >= 4);
    }
}
