//! Dynamic tree reduce. The caller coordinates: it subscribes to every source in the
//! directory, places each source that becomes ready into a d-ary tree in arrival order
//! (generalised in-order: first child, the node itself, then children 2..d), stops at
//! `num_objects`, and tells each inner position to compute `own ⊕ children` into an
//! intermediate object that its parent pulls while it fills. The root writes the target, which
//! is published as a partial copy from its first byte, so readers overlap with the reduce.

mod claims;
mod coordinator;
mod task;
mod tree;

pub use claims::SourceClaims;
pub use tree::{choose_degree, Tree};

use crate::ops::{DType, ReduceOp};
use crate::{Error, Node, ObjectId, Result};
use crossbeam_channel::Receiver;
use phalanx_transport::NodeId;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How to run a reduce.
#[derive(Debug, Clone)]
pub struct ReduceOptions {
    /// Tree degree; `None` picks it from the latency/bandwidth model.
    pub degree: Option<usize>,
    /// Bytes combined per step.
    pub chunk: u64,
    /// Give up after this long (default: the node's op timeout).
    pub timeout: Option<Duration>,
    /// Sources that are always used, whenever they become ready (e.g. the current model in
    /// `model' = model + first k gradients`); the others fill the remaining positions in
    /// arrival order. Each must be one of the sources.
    pub required: Vec<ObjectId>,
    /// A pool shared by concurrent reduces over overlapping sources: a source placed by one
    /// of them is never placed by another, also when a failure makes one pick a spare.
    pub claims: Option<Arc<SourceClaims>>,
}

impl Default for ReduceOptions {
    fn default() -> Self {
        ReduceOptions {
            degree: None,
            chunk: 1 << 20,
            timeout: None,
            required: Vec::new(),
            claims: None,
        }
    }
}

/// A reduce running in the background ([`Node::reduce_start`]).
pub struct ReduceHandle {
    placed: Receiver<Vec<ObjectId>>,
    thread: JoinHandle<Result<ReduceOutcome>>,
}

impl ReduceHandle {
    /// Blocks until every position of the tree has a source and returns them in arrival
    /// order: the inputs this reduce combines unless a failure replaces one (the outcome has
    /// the final list). `None` if the reduce ended before that; [`ReduceHandle::wait`] says why.
    pub fn inputs(&self) -> Option<Vec<ObjectId>> {
        self.placed.recv().ok()
    }

    /// Like [`ReduceHandle::inputs`], giving up after `timeout` (then `None` too).
    pub fn inputs_timeout(&self, timeout: Duration) -> Option<Vec<ObjectId>> {
        self.placed.recv_timeout(timeout).ok()
    }

    pub fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }

    /// Waits for the reduce to finish.
    pub fn wait(self) -> Result<ReduceOutcome> {
        self.thread
            .join()
            .unwrap_or_else(|_| Err(Error::InvalidArgument("reduce thread panicked".into())))
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
    /// Positions computed more than once because a failure touched them.
    pub recomputed: Vec<usize>,
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
            .coordinate_reduce(target.into(), sources, num_objects, (op, dtype), opts, None)
    }

    /// Starts a reduce and returns at once: [`ReduceHandle::inputs`] tells which sources were
    /// placed as soon as the tree is full (long before the result is complete), so a caller
    /// can hand the partial target to its readers and start the next reduce meanwhile.
    pub fn reduce_start(
        &self,
        target: impl Into<ObjectId>,
        sources: Vec<ObjectId>,
        num_objects: usize,
        op: ReduceOp,
        dtype: DType,
        opts: ReduceOptions,
    ) -> Result<ReduceHandle> {
        let target = target.into();
        let inner = self.inner.clone();
        let (tx, rx) = crossbeam_channel::bounded(1);
        let thread = std::thread::Builder::new()
            .name(format!("reduce {target}"))
            .spawn(move || {
                let kind = (op, dtype);
                inner.coordinate_reduce(target, &sources, num_objects, kind, &opts, Some(tx))
            })
            .map_err(|e| Error::Config(format!("spawn a reduce coordinator: {e}")))?;
        Ok(ReduceHandle { placed: rx, thread })
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
