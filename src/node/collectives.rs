//! The collectives of the public API: reduce (blocking or started in the background),
//! allreduce and gather, on top of the reduce subsystem and `get`.

use super::Node;
use crate::ops::{DType, ReduceOp};
use crate::reduce::{ReduceHandle, ReduceOptions, ReduceOutcome};
use crate::{ObjectId, Result};

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
        let kind = (op, dtype);
        self.inner
            .reducer
            .reduce(target.into(), sources, num_objects, kind, opts)
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
        let kind = (op, dtype);
        self.inner
            .reducer
            .start(target.into(), sources, num_objects, kind, opts)
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
