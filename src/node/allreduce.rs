//! Allreduce: every participant ends with a complete copy of `target = ⊕ sources`.
//!
//! Two algorithms, chosen by the coordinator per call ([`partitions`]):
//! - **tree** (small objects, subsets, `required`/`claims`): one dynamic reduce into `target`
//!   while every participant streams `target` as it fills (a reduce, then a broadcast: every
//!   inner node receives the object twice, 2 S/B at best);
//! - **partitioned** (objects of `NodeConfig::allreduce_partition_min` bytes or more, all
//!   inputs used): the object
//!   is cut into one partition per input and each partition is reduced by its own dynamic
//!   tree (reduce-scatter), the trees' placements rotated so that each has its root, and its
//!   leaf, on a different node; every participant then fetches the partitions with the
//!   receiver-driven broadcast as they are produced (allgather) and assembles its copy of
//!   `target`: (n-1)/n S in and out per node in each phase, a ring's 2(n-1)/n S/B, with each
//!   partition still placed in arrival order and repaired like any reduce.
//!
//! The choice is by measurement on the 8 emulated hosts of this machine (8 processes sharing
//! 2 cores): from [`PARTITION_MIN`] (4 MiB) the partitioned algorithm, whose allgather is a
//! ring along the partitions' chains, is as fast as the tree or faster (4 MiB 76-78 ms
//! against 76-91, 6 MiB 110-113 against 115-132, with a 99th percentile 10-25 % lower); below
//! it the partitions are small, their trees binary, and the tree is ahead (2 MiB 54-66 ms
//! against 40-43). `allreduce_partition_min` (config) moves the threshold.
//!
//! How the partitions' trees are shaped depends on how the inputs come
//! ([`Node::partitioned_how`]), watched for the time a partition takes on a link (20 to 100
//! ms):
//! - **all there** at once: chains, rotated (above);
//! - **one after another**, none of the missing ones coming within that window: trees by
//!   arrival (`Tree::by_arrival`). Partition `p` is rooted at the `p`-th arrival; the
//!   arrivals before it are chained (combined as they come), and each later one is a leaf
//!   under the root, whose task starts as soon as it is placed and pulls each later slice as
//!   it comes. When the last input comes, what is left is its slices (one to each root) and
//!   the results, which the other nodes forward, not the two latest arrivals. On the 8
//!   emulated hosts, 16 MiB with arrivals 50 ms apart: 208-223 ms from the last arrival
//!   against one tree's 232-235 (Open MPI's best 264-277); at 64 MiB a partition takes 67
//!   ms on a link, more than the arrivals' interval, and the roots' downlinks could not keep
//!   up (1238 against one tree's 1092);
//! - **faster than that, but not all at once**: chains, rotated, as for inputs all there
//!   (each chain places the inputs as they come). Measured against one tree on the 8
//!   emulated hosts (from the last arrival, ms, chains / one tree): 16 MiB 5 ms apart 255 /
//!   286, 10 ms 252 / 273 (both twice), 20 ms 255 / 263; 64 MiB 25 ms apart 999 / 1109, 50
//!   ms 1063 / 1080. (Until the twenty-first session this case took one tree.) Their
//!   allgather hints come once the last input is placed, and the readers wait for them
//!   (the plan says so) rather than ask the directory after 200 ms: 64 MiB 50 ms apart 995,
//!   1001 against 1063, 1067.
//!
//! The coordinator announces its choice in a small object `{target}#plan` (the partitions'
//! bounds, whether their allgather hints come late, and the coordinator's node) when the
//! object is large enough for the partitioned algorithm; participants that
//! know the size ([`Node::allreduce_read`]) wait for it only then, so a small allreduce costs
//! no extra lookup.

use super::halving::halving_outcome;
use super::Node;
use crate::config::INLINE_LIMIT;
use crate::ops::{DType, ReduceOp};
use crate::protocol::{GatherFrom, HalvingPlan};
use crate::reduce::{
    Background, HalvingOutcome, HalvingRan, Hooks, ReduceOptions, ReduceOutcome, MAX_HALVING_RANKS,
};
use crate::store::CopyStatus;
use crate::view::ObjectView;
use crate::{Error, ObjectId, Result};
use phalanx_transport::NodeId;

/// The default `NodeConfig::allreduce_partition_min` (see the module for the measurement).
pub const PARTITION_MIN: u64 = 4 << 20;

/// The default `NodeConfig::allreduce_halving_max`: halving and doubling up to this size.
/// Chosen by measurement on 8 emulated hosts at 1 Gbit/s (README, "Halving and doubling"):
/// against one tree, the same at 64 KiB, 34 % faster at 128 KiB, 23 % at 192 KiB, 20-35 % at
/// 256 KiB (the tree at its best, a chain, 5.6-6.0 ms; halving 4.4-4.7); at 384 KiB the two
/// are level and from 512 KiB the tree is ahead. At 256 KiB one run in 30 to 100 stalls
/// 20-60 ms where the hosts' TCP is BBR (likely its pacing timer; with `tcp_congestion =
/// "reno"` none did): the median, not the 99th percentile, is what this size gains.
pub const HALVING_MAX: u64 = 256 << 10;

/// The largest `NodeConfig::allreduce_halving_max` accepted: the algorithm's blocks travel as
/// messages, the largest as large as the object.
pub const HALVING_LIMIT: u64 = 8 << 20;

/// The first word of a plan that names a halving-doubling run (a partition count never is).
const HALVING_MARK: u64 = u64::MAX;

/// The first word of a plan that says the allreduce failed at its coordinator; its second
/// the length of the coordinator's message, which follows.
const FAILED_MARK: u64 = u64::MAX - 1;

/// The longest coordinator's message a failed plan carries.
const FAILED_MESSAGE_MAX: usize = 1024;

/// The default `NodeConfig::allgather_hint_wait`: how long a participant's assembly waits
/// for a partition's coordinator to say where to fetch it from (said as soon as the
/// partition's chain is placed); then the directory chooses.
pub const HINT_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// How long a participant still waits for a partition's hint once the directory lists the
/// partition: its tree is placed by then, and the hint left the coordinator at that moment,
/// two hops before the listing could reach this node. No hint by then: this node has no
/// place in the trees (it holds no input), and the directory says where to read.
const UNPLACED_GRACE: std::time::Duration = std::time::Duration::from_millis(20);

/// How long a participant waits for a partition's hint before it asks the directory to say
/// when the partition is listed.
const HINT_FIRST: std::time::Duration = std::time::Duration::from_millis(10);

/// How often a wait for a hint looks whether the partition is listed yet.
const HINT_SLICE: std::time::Duration = std::time::Duration::from_millis(5);

/// How long the coordinator waits for every input to be there before it settles for chains
/// that place them as they come (see [`Node::partitioned_how`]).
const PRESENT_GRACE: std::time::Duration = std::time::Duration::from_millis(20);

/// How often the coordinator looks for an input the directory could not be asked to tell it
/// of (see [`Node::inputs_arriving`]).
const ARRIVING_POLL: std::time::Duration = std::time::Duration::from_millis(2);

/// The longest the coordinator watches how inputs come before it chooses how to partition
/// (see [`Node::partitioned_how`]).
const ARRIVAL_WINDOW: std::time::Duration = std::time::Duration::from_millis(100);

/// How many inputs a coordinator that holds none asks the directory for their size (see
/// [`Node::remote_size`]): they all have the same, and the first there answers.
const SIZE_ASKS: usize = 64;

/// A partition fetched along its chain that makes no progress for this long is fetched
/// through the directory instead (a stale hint: a repair moved the partition).
const HINT_STALL: std::time::Duration = std::time::Duration::from_secs(2);

/// How long a partition's root waits for its own task's output to appear.
const HERE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// How long a reader of an allreduce waits for its plan before it asks whether the result is
/// complete somewhere (and again every this long): see [`Node::wait_for_plan`].
const PLAN_STALL: std::time::Duration = std::time::Duration::from_millis(500);

/// What a reader of an allreduce waits for ([`Node::wait_for_plan`]).
enum PlanWait {
    /// The plan's bytes (every plan names its coordinator).
    Plan(ObjectView),
    /// A halving-doubling run into the target committed here: this node's copy.
    Committed(crate::store::CopyRef),
    /// No plan, but the result is complete somewhere: read it.
    Readable,
}

/// Says why an allreduce's assembly is to give up (its coordinator said it failed, or a
/// partition's reduce did), shared by the partitions' fetches.
type Gone = std::sync::Arc<dyn Fn() -> Option<Error> + Send + Sync>;

/// When this node heard that every partition tree of an allreduce whose hints come late is
/// placed ([`placed_id`]); shared by the partitions' fetches.
type Placed = std::sync::Arc<std::sync::OnceLock<std::time::Instant>>;

/// At most this many partitions (each fetched at once by every participant; a plan that
/// names more is refused).
pub const MAX_PARTITIONS: usize = 64;

/// The smallest partition worth its own tree: with 8 inputs, partitions of 256 KiB (2 MiB
/// objects) were slower than one tree (54-66 ms against 40-43), of 512 KiB (4 MiB) as fast
/// or faster; smaller partitions also get binary trees and are fetched from their roots, and
/// every participant fetches every partition at once. So many inputs cut a mid-size object
/// into fewer partitions than inputs, rather than into tiny ones.
pub const PARTITION_BYTES_MIN: u64 = 512 << 10;

/// The partitions (byte ranges, whole elements) of an allreduce of `num_sources` inputs of
/// `size` bytes each, all used: from `min` bytes on, one per input, at most
/// [`MAX_PARTITIONS`] and none smaller than [`PARTITION_BYTES_MIN`] (a `min` below it aside);
/// else a single one (the tree algorithm).
pub fn partitions(size: u64, num_sources: usize, dtype: DType, min: u64) -> Vec<(u64, u64)> {
    let esz = dtype.size() as u64;
    if size < min || num_sources < 2 || !size.is_multiple_of(esz) {
        return vec![(0, size)];
    }
    let by_size = (size / PARTITION_BYTES_MIN.min(min.max(1))).max(2);
    let count = (num_sources.min(MAX_PARTITIONS) as u64).min(by_size);
    let elems = size / esz;
    let per = elems.div_ceil(count) * esz;
    (0..count)
        .map(|p| ((p * per).min(size), ((p + 1) * per).min(size)))
        .filter(|(lo, hi)| hi > lo)
        .collect()
}

/// The object that names the plan of the allreduce into `target`.
pub fn plan_id(target: &ObjectId) -> ObjectId {
    ObjectId::new(format!("{}#plan", target.as_str()))
}

/// The small object a partitioned allreduce's coordinator puts once every partition's tree
/// is placed, when its plan says the allgather hints come late: every hint has gone out by
/// then, and a reader still without one has no place in that tree ([`Node::late_hint`]).
pub fn placed_id(target: &ObjectId) -> ObjectId {
    ObjectId::new(format!("{}#placed", target.as_str()))
}

/// The object that holds partition `p` (of `of`) of `target`.
pub fn part_id(target: &ObjectId, p: usize, of: usize) -> ObjectId {
    ObjectId::new(format!("{}#part{p}of{of}", target.as_str()))
}

/// The plan of a halving-doubling run, for readers: its number, coordinator and rank nodes.
fn encode_halving(plan: &HalvingPlan) -> Vec<u8> {
    let words = [
        HALVING_MARK,
        plan.run,
        plan.coordinator as u64,
        plan.ranks.len() as u64,
    ];
    let nodes = plan.ranks.iter().map(|r| r.0 as u64);
    words
        .into_iter()
        .chain(nodes)
        .flat_map(u64::to_le_bytes)
        .collect()
}

/// The run a plan names, if it names a halving-doubling run: (run, coordinator, rank nodes).
fn decode_halving(b: &[u8]) -> Result<Option<(u64, NodeId, Vec<NodeId>)>> {
    let bad = || Error::InvalidArgument(format!("malformed allreduce plan ({} bytes)", b.len()));
    let word = |i: usize| -> Option<u64> {
        let s = b.get(i * 8..i * 8 + 8)?;
        Some(u64::from_le_bytes(s.try_into().ok()?))
    };
    if word(0) != Some(HALVING_MARK) {
        return Ok(None);
    }
    let (run, coordinator, m) = match (word(1), word(2), word(3)) {
        (Some(r), Some(c), Some(m)) => (r, c, m as usize),
        _ => return Err(bad()),
    };
    if m > MAX_HALVING_RANKS || b.len() != 8 * (4 + m) {
        return Err(bad());
    }
    let node = |w: u64| NodeId::try_from(w).map_err(|_| bad());
    let nodes = (0..m)
        .map(|k| node(word(4 + k).ok_or_else(bad)?))
        .collect::<Result<Vec<_>>>()?;
    Ok(Some((run, node(coordinator)?, nodes)))
}

/// The plan of an allreduce that failed at its coordinator, with its message (cut to
/// [`FAILED_MESSAGE_MAX`] bytes, on a character boundary).
fn encode_failed(why: &str) -> Vec<u8> {
    let mut end = why.len().min(FAILED_MESSAGE_MAX);
    while !why.is_char_boundary(end) {
        end -= 1;
    }
    let msg = &why.as_bytes()[..end];
    let mut b = Vec::with_capacity(16 + msg.len());
    b.extend_from_slice(&FAILED_MARK.to_le_bytes());
    b.extend_from_slice(&(msg.len() as u64).to_le_bytes());
    b.extend_from_slice(msg);
    b
}

/// The coordinator's message, if a plan says the allreduce failed.
fn decode_failed(b: &[u8]) -> Result<Option<String>> {
    let bad = || Error::InvalidArgument(format!("malformed allreduce plan ({} bytes)", b.len()));
    if b.get(..8) != Some(&FAILED_MARK.to_le_bytes()[..]) {
        return Ok(None);
    }
    let len = b
        .get(8..16)
        .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
        .ok_or_else(bad)?;
    if len > FAILED_MESSAGE_MAX as u64 || b.len() as u64 != 16 + len {
        return Err(bad());
    }
    Ok(Some(String::from_utf8_lossy(&b[16..]).into_owned()))
}

/// The flag of a plan's first word that says the partitions' allgather hints come only once
/// the last input is there (the inputs were still coming as the allreduce began: trees by
/// arrival, or chains placed as the inputs come), and the readers wait for them.
const LATE_HINTS: u64 = 1 << 32;

/// A plan: the partitions (none: one tree), whether their allgather hints come late, and its
/// coordinator, last (readers whose answer for the plan names no copy of it, its coordinator
/// having died, still know whose death ends the allreduce).
fn encode_plan(parts: &[(u64, u64)], late_hints: bool, coordinator: NodeId) -> Vec<u8> {
    let mut b = Vec::with_capacity(16 + 16 * parts.len());
    let flags = if late_hints { LATE_HINTS } else { 0 };
    b.extend_from_slice(&(parts.len() as u64 | flags).to_le_bytes());
    for (lo, hi) in parts {
        b.extend_from_slice(&lo.to_le_bytes());
        b.extend_from_slice(&hi.to_le_bytes());
    }
    b.extend_from_slice(&u64::from(coordinator).to_le_bytes());
    b
}

/// What a plan says ([`encode_plan`]): the partitions, whether their allgather hints come
/// late, and the coordinator.
type Plan = (Vec<(u64, u64)>, bool, NodeId);

/// The partitions a plan names, checked (contiguous, from 0 to `size`), whether their
/// allgather hints come late, and its coordinator.
fn decode_plan(b: &[u8], size: u64) -> Result<Plan> {
    let bad = || Error::InvalidArgument(format!("malformed allreduce plan ({} bytes)", b.len()));
    let word = |i: usize| -> Result<u64> {
        let s = b.get(i * 8..i * 8 + 8).ok_or_else(bad)?;
        Ok(u64::from_le_bytes(s.try_into().expect("8 bytes")))
    };
    let first = word(0)?;
    let late_hints = first & LATE_HINTS != 0;
    if first & !(LATE_HINTS | u64::from(u32::MAX)) != 0 {
        return Err(bad());
    }
    let n = (first & u64::from(u32::MAX)) as usize;
    if n > MAX_PARTITIONS || b.len() != 16 + 16 * n {
        return Err(bad());
    }
    let coordinator = NodeId::try_from(word(1 + 2 * n)?).map_err(|_| bad())?;
    if n == 0 {
        return Ok((vec![(0, size)], false, coordinator)); // one tree
    }
    let parts: Vec<(u64, u64)> = (0..n)
        .map(|k| Ok((word(1 + 2 * k)?, word(2 + 2 * k)?)))
        .collect::<Result<_>>()?;
    let mut at = 0;
    for &(lo, hi) in &parts {
        if lo != at || hi <= lo {
            return Err(bad());
        }
        at = hi;
    }
    if at != size {
        return Err(Error::InvalidArgument(format!(
            "the allreduce plan covers {at} bytes, the object has {size}"
        )));
    }
    Ok((parts, late_hints, coordinator))
}

impl Node {
    /// Allreduce from the coordinator's side: reduces all `sources` into `target` and returns
    /// a copy of the result's bytes. [`Node::allreduce_view`] returns the node's copy itself,
    /// with no copy made. The other participants call [`Node::allreduce_read`] (or
    /// `get(target)` for objects under the node's `allreduce_partition_min`).
    pub fn allreduce(
        &self,
        target: impl Into<ObjectId>,
        sources: &[ObjectId],
        op: ReduceOp,
        dtype: DType,
        opts: &ReduceOptions,
    ) -> Result<(Vec<u8>, ReduceOutcome)> {
        let (view, outcome) = self.allreduce_view(target, sources, op, dtype, opts)?;
        let bytes = match view {
            ObjectView::Owned(v) => v,
            view => view.to_vec(),
        };
        Ok((bytes, outcome))
    }

    /// [`Node::allreduce`] returning a zero-copy view of this node's complete copy of the
    /// result (a small result combined here is handed back as the bytes it was combined in).
    pub fn allreduce_view(
        &self,
        target: impl Into<ObjectId>,
        sources: &[ObjectId],
        op: ReduceOp,
        dtype: DType,
        opts: &ReduceOptions,
    ) -> Result<(ObjectView, ReduceOutcome)> {
        let target = target.into();
        crate::reduce::distinct(sources)?;
        let here = self.input_size(sources);
        self.promised(&target.clone(), here, |_| {
            // A coordinator that holds no input (a driver) learns the size from the
            // directory, under its promise (made at once: its inputs are elsewhere).
            let r = match here {
                Some(s) => Ok(Some(s)),
                None => self.remote_size(&target, sources),
            };
            let r = r.and_then(|size| {
                self.allreduce_unpromised(target.clone(), sources, size, op, dtype, opts)
            });
            self.tell_failure(&target, &r);
            r
        })
    }

    /// A failed allreduce's readers are told why by a plan that says so: those that wait
    /// for the plan at once, the others (a small object's; those past a plan announced
    /// before it failed, which this one replaces) within [`PLAN_STALL`]. Not when the target
    /// is complete somewhere (an allreduce into a target made before: its plan stands).
    fn tell_failure<T>(&self, target: &ObjectId, r: &Result<T>) {
        let Err(e) = r else { return };
        let plan = plan_id(target);
        let failed = encode_failed(&e.to_string());
        if let Err(Error::AlreadyExists(_)) = self.put(plan.clone(), &failed) {
            let made = matches!(self.locate(target.clone()), Ok(Some(i))
                if i.locations.iter().any(|l| l.complete));
            if !made && self.delete(plan.clone()).is_ok() {
                let _ = self.put(plan, &failed);
            }
        }
    }

    /// [`Node::allreduce_view`] once the target is promised (`size`: the inputs' size, if
    /// one is here).
    fn allreduce_unpromised(
        &self,
        target: ObjectId,
        sources: &[ObjectId],
        size: Option<u64>,
        op: ReduceOp,
        dtype: DType,
        opts: &ReduceOptions,
    ) -> Result<(ObjectView, ReduceOutcome)> {
        let min = self.inner.cfg.allreduce_partition_min;
        let dynamic_only = !opts.required.is_empty() || opts.claims.is_some();
        if let Some(s) = size.filter(|&s| self.halving_size(s)) {
            // Halving and doubling if every input is there, each on its own node; else one
            // tree. Readers of an object this size wait for the plan either way.
            let ranks = match dynamic_only || opts.range.is_some() || sources.len() < 2 {
                true => None,
                false => self.halving_ranks(sources, s)?,
            };
            let Some(ranks) = ranks else {
                // Inputs of another size refused before the plan is announced (its readers
                // are then told why); for a halving run, `halving_ranks` checked them.
                self.same_size(sources, s)?;
                tracing::debug!(node = self.id(), %target, "allreduce by one tree");
                crate::hop::hop!(self.id(), "allreduce by one tree");
                self.put(plan_id(&target), &encode_plan(&[], false, self.id()))?;
                return self.allreduce_tree(
                    target,
                    sources,
                    sources.len(),
                    (op, dtype),
                    opts,
                    &|| {},
                );
            };
            let plan = HalvingPlan {
                target: target.clone(),
                run: self.inner.rpc.fresh_token(),
                coordinator: self.id(),
                ranks,
                size: s,
                op,
                dtype,
                reduce: false,
            };
            return self.allreduce_halving(plan, opts);
        }
        let parts = match size {
            // Options a partition cannot honour, or the size unknown (no input here, and the
            // directory's answers said the inputs asked are gone): one tree; participants
            // that wait for a plan learn that too.
            None => Vec::new(),
            Some(s) if dynamic_only || opts.range.is_some() => vec![(0, s)],
            Some(s) => partitions(s, sources.len(), dtype, min),
        };
        let (by_arrival, late_hints) = match parts.len() > 1 {
            true => self.partitioned_how(sources, &parts),
            false => (false, false),
        };
        // Partitions of inputs of another size would never be complete: refused before
        // anything is announced, for every input there now (a later one is refused by its
        // partitions' reduces).
        if let (true, Some(s)) = (parts.len() > 1, size) {
            self.same_size(sources, s)?;
        }
        // Readers of an object this large wait for the plan: announce it (no partitions:
        // one tree).
        if self.readers_wait_for_plan(size) {
            let plan = if parts.len() > 1 {
                parts.clone()
            } else {
                Vec::new()
            };
            self.put(plan_id(&target), &encode_plan(&plan, late_hints, self.id()))?;
        }
        if parts.len() <= 1 {
            return self.allreduce_tree(target, sources, sources.len(), (op, dtype), opts, &|| {});
        }
        let how = (&parts[..], by_arrival, late_hints);
        self.allreduce_partitioned(target, sources, (op, dtype), opts, how)
    }

    /// Allreduce of the first `num` of `sources` to be ready (in arrival order, as
    /// [`Node::reduce_with`] places them): always one tree, whose result every participant
    /// reads with [`Node::allreduce_read`] as for a whole allreduce. The outcome's `used`
    /// names the inputs combined. `num` at least `sources.len()` is [`Node::allreduce_view`].
    pub fn allreduce_first(
        &self,
        target: impl Into<ObjectId>,
        sources: &[ObjectId],
        num: usize,
        op: ReduceOp,
        dtype: DType,
        opts: &ReduceOptions,
    ) -> Result<(ObjectView, ReduceOutcome)> {
        let target = target.into();
        if num == 0 {
            return Err(Error::InvalidArgument(
                "an allreduce of none of its inputs".into(),
            ));
        }
        if num >= sources.len() {
            return self.allreduce_view(target, sources, op, dtype, opts);
        }
        crate::reduce::distinct(sources)?;
        let size = self.input_size(sources);
        self.promised(&target.clone(), size, |made| {
            // Readers of an object this size wait for the plan: one tree.
            let r = match self.readers_wait_for_plan(size) {
                true => self.put(plan_id(&target), &encode_plan(&[], false, self.id())),
                false => Ok(()),
            };
            let r = r.and_then(|()| {
                let kind = (op, dtype);
                self.allreduce_tree(target.clone(), sources, num, kind, opts, made)
            });
            self.tell_failure(&target, &r);
            r
        })
    }

    /// Whether an allreduce of objects of `size` bytes runs by halving and doubling when it
    /// can (and so its readers wait for its plan).
    fn halving_size(&self, size: u64) -> bool {
        size >= INLINE_LIMIT && size <= self.inner.cfg.allreduce_halving_max
    }

    /// The size of the inputs, from one held here.
    pub(super) fn input_size(&self, sources: &[ObjectId]) -> Option<u64> {
        sources
            .iter()
            .find_map(|s| self.inner.store.lookup(s).map(|c| c.size()))
    }

    /// The inputs' size for an allreduce coordinated by a node that holds none of them (a
    /// driver), from the directory: the first of up to [`SIZE_ASKS`] inputs, asked at once,
    /// to have a copy somewhere. Waited for up to the op timeout: an allreduce of one tree
    /// could place nothing before an input exists, and one of all its inputs cannot end
    /// without them (`Error::Timeout` if none comes). `None` if none could be asked, or every
    /// answer said the input is gone. Until the twenty-first session such a coordinator could
    /// not size the object and always ran one tree.
    fn remote_size(&self, target: &ObjectId, sources: &[ObjectId]) -> Result<Option<u64>> {
        let (tx, answers) = crossbeam_channel::bounded(SIZE_ASKS);
        let asked = sources
            .iter()
            .take(SIZE_ASKS)
            .filter(|s| self.inner.dir.subscribe_into(s, tx.clone()).is_ok())
            .count();
        drop(tx);
        let deadline = std::time::Instant::now() + self.inner.cfg.op_timeout;
        for _ in 0..asked {
            match answers.recv_deadline(deadline) {
                Ok(Ok(Some(info))) if !info.locations.is_empty() => return Ok(Some(info.size)),
                Ok(_) => continue, // deleted meanwhile, or refused: the next answer
                Err(_) => {
                    let what = format!("an input of allreduce {target} to size it");
                    return Err(Error::Timeout(self.inner.cfg.op_timeout, what));
                }
            }
        }
        Ok(None)
    }

    /// `InvalidArgument` if an input the directory lists has another size than `size`.
    fn same_size(&self, sources: &[ObjectId], size: u64) -> Result<()> {
        for s in sources {
            if self.inner.store.lookup(s).is_some() {
                continue; // here: `size` is one of these
            }
            if let Ok(Some(info)) = self.locate(s.clone()) {
                if !info.locations.is_empty() && info.size != size {
                    return Err(crate::reduce::other_size(s, info.size, size));
                }
            }
        }
        Ok(())
    }

    /// Whether readers of an allreduce of inputs of `size` bytes wait for its plan; without
    /// the size here, whenever partitioning or halving is on.
    fn readers_wait_for_plan(&self, size: Option<u64>) -> bool {
        let cfg = &self.inner.cfg;
        let unknown =
            cfg.allreduce_partition_min != u64::MAX || cfg.allreduce_halving_max >= INLINE_LIMIT;
        size.map_or(unknown, |s| self.reads_plan(s))
    }

    /// Whether readers of an allreduce of `size` bytes wait for its plan.
    fn reads_plan(&self, size: u64) -> bool {
        self.halving_size(size) || size >= self.inner.cfg.allreduce_partition_min
    }

    /// The halving-doubling algorithm (see the module): the plan announced to readers, the
    /// run coordinated from here. A run abandoned before its result was announced (a rank
    /// died or stalled) is done again as one tree over the inputs whose nodes are alive.
    fn allreduce_halving(
        &self,
        plan: HalvingPlan,
        opts: &ReduceOptions,
    ) -> Result<(ObjectView, ReduceOutcome)> {
        let start = std::time::Instant::now();
        // The plan is announced once the run is over here: readers on the ranks' nodes find
        // their copy committed soon after (one wake-up each, none while the run needs the
        // CPUs); if the run was abandoned, they read the tree's result.
        let announce = || self.put(plan_id(&plan.target), &encode_halving(&plan));
        let copy = match self.inner.reducer.coordinate_halving(&plan, &announce)? {
            HalvingRan::Here(copy) => Some(ObjectView::Arena(copy)),
            HalvingRan::Elsewhere => Some(self.get_view(plan.target.clone())?),
            HalvingRan::Abandoned => None,
        };
        if let Some(view) = copy {
            return Ok((view, halving_outcome(&plan, start)));
        }
        let alive = self.halving_survivors(&plan);
        let (op, dtype) = (plan.op, plan.dtype);
        self.allreduce_tree(plan.target, &alive, alive.len(), (op, dtype), opts, &|| {})
    }

    /// A participant's side of an allreduce coordinated elsewhere: waits for `target` (of
    /// `size` bytes) and returns a view of this node's complete copy. For a partitioned
    /// allreduce it fetches the partitions as they are produced and assembles the copy here.
    pub fn allreduce_read(&self, target: impl Into<ObjectId>, size: u64) -> Result<ObjectView> {
        let target = target.into();
        if !self.reads_plan(size) {
            return self.view_while_up(&target, None);
        }
        let plan = match self.wait_for_plan(&target, self.halving_size(size))? {
            PlanWait::Plan(plan) => plan,
            // A run into the target committed here: this node's copy is the result.
            PlanWait::Committed(copy) => return Ok(ObjectView::Arena(copy)),
            PlanWait::Readable => return self.get_view(target),
        };
        if let Some(why) = decode_failed(&plan)? {
            return Err(Error::CoordinatorFailed(target, why));
        }
        if let Some((run, coordinator, nodes)) = decode_halving(&plan)? {
            drop(plan);
            // A rank: its own copy once the run is committed; else (abandoned, failed here,
            // or no rank) wherever the directory says.
            if nodes.contains(&self.id()) {
                let wait = self.inner.cfg.op_timeout;
                let r = self
                    .inner
                    .reducer
                    .halving_outcome(&target, run, coordinator, wait);
                if r == Some(HalvingOutcome::Committed) {
                    if let Some(c) = self.inner.store.lookup(&target) {
                        if c.status() == CopyStatus::Complete {
                            return Ok(ObjectView::Arena(c));
                        }
                    }
                }
            }
            // Not a rank, or its run not committed here: a run whose coordinator died
            // before it committed is over (and too short for the coordinator's promise to
            // have gone out), so this read stops when the coordinator does.
            return self.view_while_up(&target, Some(coordinator));
        }
        let (parts, late_hints, coordinator) = decode_plan(&plan, size)?;
        drop(plan);
        if parts.len() == 1 {
            // One tree: its target is the coordinator's promise, and its tasks withdraw
            // their outputs if it dies (the target is then lost to this read).
            return self.view_while_up(&target, None);
        }
        // Complete elsewhere already (a late reader: the partitions' copies may be gone,
        // their roots' too): read it whole.
        if self.complete_elsewhere(&target) {
            return self.get_view(target);
        }
        let gone: Gone = std::sync::Arc::new({
            let (node, target) = (self.clone(), target.clone());
            move || node.failed_at_coordinator(&target)
        });
        match self.assemble(&target, (&parts, late_hints), Some(coordinator), gone, true) {
            Ok(()) => self.get_view(target),
            // A partition gone while the whole is complete elsewhere: read it whole.
            Err(Error::ObjectLost(_)) if self.complete_elsewhere(&target) => self.get_view(target),
            Err(e) => Err(e),
        }
    }

    /// A participant's side of an allreduce coordinated elsewhere, input included: puts this
    /// node's input `input` (bytes `data`, as [`Node::put`]) and returns a view of this node's
    /// complete copy of the result `target` (as [`Node::allreduce_read`]). A small input whose
    /// directory entry is on the result's shard goes there in one message with the request
    /// for the result, and a small result comes back in the answer: the participant sends
    /// one message instead of two (each a `writev` of 10-20 us on the emulated hosts, where
    /// the participants' messages queue for the same two cores). Otherwise, and whenever that
    /// answer is not the result's bytes within [`PLAN_STALL`] (a result not small, deleted,
    /// or late), the plain way: the read then tells failures as [`Node::allreduce_read`]
    /// does.
    pub fn allreduce_join(
        &self,
        target: impl Into<ObjectId>,
        input: impl Into<ObjectId>,
        data: &[u8],
    ) -> Result<ObjectView> {
        let (target, input) = (target.into(), input.into());
        let size = data.len() as u64;
        let dir = &self.inner.dir;
        let together = size < INLINE_LIMIT
            && !self.reads_plan(size)
            && dir.shard_of(&input) == dir.shard_of(&target);
        if !together {
            self.put(input, data)?;
            return self.allreduce_read(target, size);
        }
        let (tx, answer) = crossbeam_channel::bounded(1);
        let on_reply = Box::new(move |r: Result<crate::protocol::Reply>| {
            let _ = tx.try_send(r);
        });
        // Not sent (or its link failed): put the plain way, which tolerates a shard that is
        // down; a second copy of the same put is harmless.
        let asked = self.put_small(&input, data, || {
            match dir.put_inline_then_subscribe(&input, data, &target, on_reply) {
                Ok(()) => Ok(true),
                Err(_) => dir.put_inline(&input, data).map(|()| false),
            }
        })?;
        if !asked {
            return self.allreduce_read(target, size);
        }
        match answer.recv_timeout(PLAN_STALL) {
            Ok(Ok(crate::protocol::Reply::InfoInline(_, bytes))) if bytes.len() as u64 == size => {
                Ok(ObjectView::Owned(bytes))
            }
            // Refused, not small, deleted, a shard that died, or nothing yet: the plain way.
            _ => self.allreduce_read(target, size),
        }
    }

    /// This node's complete copy of `id`, if it has one.
    fn local_complete(&self, id: &ObjectId) -> Option<crate::store::CopyRef> {
        self.inner
            .store
            .lookup(id)
            .filter(|c| c.status() == CopyStatus::Complete)
    }

    /// What a reader of an allreduce hears first ([`PlanWait`]): the plan; with
    /// `watch_commits` (a size that may run by halving and doubling), this node's complete
    /// copy as soon as a run into `target` commits here (a rank hears its run's outcome from
    /// the run itself, one hop after the coordinator has the result, before the plan comes
    /// through the directory); or, when no plan has come for [`PLAN_STALL`], that `target`
    /// is complete somewhere (asked then, and again every `PLAN_STALL`): a coordinator that
    /// died after the result was made and before it announced the plan leaves its readers
    /// the result itself, not a timeout.
    fn wait_for_plan(&self, target: &ObjectId, watch_commits: bool) -> Result<PlanWait> {
        let watch = watch_commits.then(|| self.inner.reducer.watch_halving_commit(target));
        let plan = plan_id(target);
        // The directory's answer once the plan is there; `None`: not asked (refused, or a
        // shard that died: asked again at the next check).
        let subscribe = || {
            let (tx, answers) = crossbeam_channel::bounded(1);
            let on_reply = Box::new(move |r: Result<crate::protocol::Reply>| {
                let _ = tx.try_send(r);
            });
            let asked = self.inner.dir.subscribe_then(&plan, on_reply).is_ok();
            asked.then_some(answers)
        };
        // The plain way, for a while (then the checks below, and the directory asked again);
        // `None`: no plan yet. Not for the op timeout: a plan whose shard died with its
        // coordinator is gone with both, and its readers learn at the next check that the
        // target is lost (they waited out the op timeout before the twenty-second session:
        // the allreduce soak, seed 22754).
        let plain = || match self.get_view_timeout(plan.clone(), PLAN_STALL) {
            Ok(view) => Some(Ok(PlanWait::Plan(view))),
            Err(e @ Error::NotFound(_)) => Some(Err(e)),
            Err(_) => None,
        };
        let mut answers = subscribe();
        if answers.is_none() {
            if let Some(r) = plain() {
                return r;
            }
        }
        let start = std::time::Instant::now();
        let deadline = start + self.inner.cfg.op_timeout;
        let mut check_at = start + PLAN_STALL;
        let mut local = watch.as_ref().map(|w| &w.rx);
        loop {
            // What woke the wait: `None` the checks' time (or the deadline), else the
            // directory's answer (`Ok`) or a commit here (`Err`).
            let woke = {
                let mut sel = crossbeam_channel::Select::new();
                let on_answer = answers.as_ref().map(|rx| sel.recv(rx));
                let on_local = local.map(|rx| sel.recv(rx));
                match sel.select_deadline(check_at.min(deadline)) {
                    Err(_) => None,
                    Ok(op) if Some(op.index()) == on_local => {
                        let _ = local.map(|rx| op.recv(rx));
                        Some(Err(()))
                    }
                    Ok(op) => {
                        debug_assert_eq!(Some(op.index()), on_answer);
                        Some(Ok(answers.as_ref().map(|rx| op.recv(rx))))
                    }
                }
            };
            let answer = match woke {
                None if std::time::Instant::now() >= deadline => {
                    return Err(Error::Timeout(
                        self.inner.cfg.op_timeout,
                        format!("allreduce plan of {target}"),
                    ))
                }
                None => {
                    // The plan is late: is the result there already, or lost (its
                    // coordinator died and the reduce's tasks with it)?
                    let info = self.locate(target.clone()).ok().flatten();
                    if info.as_ref().is_some_and(|i| i.lost) {
                        return Err(Error::ObjectLost(target.clone()));
                    }
                    let complete = info.is_some_and(|i| i.locations.iter().any(|l| l.complete));
                    if complete {
                        tracing::debug!(node = self.id(), %target, "no plan; reading the result");
                        return Ok(PlanWait::Readable);
                    }
                    // A halving run into it lost its coordinator here: nothing committed it
                    // (no copy is complete anywhere), and no plan will come.
                    if self.inner.reducer.halving_coordinator_died(target) {
                        return Err(Error::ObjectLost(target.clone()));
                    }
                    if answers.is_none() {
                        answers = subscribe();
                    }
                    check_at = std::time::Instant::now() + PLAN_STALL;
                    continue;
                }
                Some(Err(())) => {
                    if let Some(copy) = self.local_complete(target) {
                        return Ok(PlanWait::Committed(copy));
                    }
                    // Dropped here meanwhile (deleted): the plan decides.
                    local = None;
                    continue;
                }
                Some(Ok(answer)) => answer,
            };
            answers = None;
            if let Some(Ok(Ok(crate::protocol::Reply::InfoInline(_, data)))) = answer {
                return Ok(PlanWait::Plan(ObjectView::Owned(data)));
            }
            // Anything else (the plan deleted first, a shard that died, an odd answer).
            if let Some(r) = plain() {
                return r;
            }
        }
    }

    /// The tree algorithm (see the module).
    /// `made` is called once the tree has finished when it is not held (the first `num` of
    /// more inputs): nothing will make the target again, so the coordinator's promise ends
    /// (if the root's node then dies before a reader has all of it, the readers, this one
    /// too, are told it is lost rather than wait for a promise that nothing keeps).
    fn allreduce_tree(
        &self,
        target: ObjectId,
        sources: &[ObjectId],
        num: usize,
        (op, dtype): (ReduceOp, DType),
        opts: &ReduceOptions,
        made: &dyn Fn(),
    ) -> Result<(ObjectView, ReduceOutcome)> {
        // The coordinator reads the target while it is being reduced, on a pooled thread
        // started as the first task goes out (no thread is created per call); a small result
        // combined here is returned as the reduce ends. The tree is repaired until that
        // reader has its copy (`Hooks::hold`): a root that dies after it finished, before
        // another node has all of the target, is computed again.
        let (tx, got) = crossbeam_channel::bounded(1);
        let (hold, held) = crossbeam_channel::bounded::<()>(1);
        let reader = self.clone();
        let id = target.clone();
        let on_tree = Box::new(move || {
            let workers = reader.inner.workers.clone();
            let started = workers.spawn(move || {
                let view = reader.get_view(id);
                drop(hold);
                let _ = tx.send(view);
            });
            if let Err(e) = started {
                tracing::warn!("allreduce reader not started ({e}); read after the reduce");
            }
        });
        // Held only when every input takes part: with spares (the first `num` of more), a
        // root computed again could take another input, and readers that had the first
        // result would disagree with those that read the second.
        let repaired = num == sources.len();
        let hooks = Hooks {
            placed: None,
            on_placed: None,
            on_tree: Some(on_tree),
            hold: repaired.then_some(held),
        };
        let kind = (op, dtype);
        let outcome = self
            .inner
            .reducer
            .reduce(target.clone(), sources, num, kind, opts, hooks)?;
        if !repaired {
            made();
        }
        if let Some(c) = self.inner.store.lookup(&target) {
            if c.status() == CopyStatus::Complete {
                return Ok((ObjectView::Arena(c), outcome));
            }
        }
        let view = match got.recv_timeout(self.inner.cfg.op_timeout) {
            Ok(r) => r?,
            // No reader ran (small result, or the reader could not start): read it now.
            Err(_) => self.get_view(target)?,
        };
        Ok((view, outcome))
    }

    /// The partitioned algorithm (see the module): one reduce per partition, rotated, all
    /// running at once; this node assembles its copy meanwhile. The outcome returned is the
    /// first partition's (every partition uses every source), with the partition count, the
    /// positions any partition recomputed, and the last partition's end.
    fn allreduce_partitioned(
        &self,
        target: ObjectId,
        sources: &[ObjectId],
        (op, dtype): (ReduceOp, DType),
        opts: &ReduceOptions,
        (parts, by_arrival, late_hints): (&[(u64, u64)], bool, bool),
    ) -> Result<(ObjectView, ReduceOutcome)> {
        let n = parts.len();
        // Every partition's tree is repaired until this node has assembled its copy: a root
        // that dies after its partition is done, before another node has all of it, is
        // computed again (the same bytes) rather than leave the partition lost.
        let (hold, held) = crossbeam_channel::bounded::<()>(1);
        // Set when a partition's reduce fails (an input of another size that came late,
        // say): the assembly stops waiting for it.
        let failed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        // Hints that come late: the last tree to be placed says so to every reader.
        let unplaced = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(n));
        let on_placed = |late: bool| {
            let (node, target, unplaced) = (self.clone(), target.clone(), unplaced.clone());
            late.then(|| {
                Box::new(move || {
                    if unplaced.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) != 1 {
                        return;
                    }
                    // Put from a worker: a slow shard does not hold up the partition's
                    // coordinator (its repairs). Readers that miss the word wait for hints
                    // as before (`Node::late_hint`).
                    let workers = node.inner.workers.clone();
                    let told = workers.spawn(move || {
                        if let Err(e) = node.put(placed_id(&target), &[1]) {
                            tracing::debug!(%target, "allreduce trees placed, not told: {e}");
                        }
                    });
                    if let Err(e) = told {
                        tracing::debug!("allreduce trees placed, not told: {e}");
                    }
                }) as Box<dyn FnOnce() + Send>
            })
        };
        let handles = parts
            .iter()
            .enumerate()
            .map(|(p, &range)| {
                // Combined in pieces of about a sixteenth of the partition, so each hop of
                // its chain forwards early (as a source writes a sixteenth at a time).
                let esz = dtype.size() as u64;
                let piece = ((range.1 - range.0) / 16).clamp(64 << 10, opts.chunk.max(64 << 10));
                let o = ReduceOptions {
                    range: Some(range),
                    rotate: p,
                    by_arrival,
                    chunk: (piece / esz).max(1) * esz,
                    ..opts.clone()
                };
                self.inner.reducer.start(
                    part_id(&target, p, n),
                    sources.to_vec(),
                    sources.len(),
                    (op, dtype),
                    o,
                    Background {
                        placed: on_placed(late_hints),
                        ended: Some(Box::new({
                            let failed = failed.clone();
                            move |ok| {
                                if !ok {
                                    failed.store(true, std::sync::atomic::Ordering::Release);
                                }
                            }
                        })),
                        hold: Some(held.clone()),
                    },
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let gone: Gone = std::sync::Arc::new({
            let target = target.clone();
            move || {
                failed
                    .load(std::sync::atomic::Ordering::Acquire)
                    .then(|| Error::CoordinatorFailed(target.clone(), "a partition failed".into()))
            }
        });
        // A coordinator that holds no input (a driver) is no node of any partition's tree:
        // chains hint it a source all the same (`Run::gather_hints`), trees by arrival do
        // not, and it asks the directory at once.
        let hinted = !by_arrival || self.input_size(sources).is_some();
        let assembled = self.assemble(&target, (parts, late_hints), None, gone, hinted);
        drop(hold);
        let mut outcomes = Vec::with_capacity(n);
        for h in handles {
            outcomes.push(h.wait());
        }
        // A partition's own error first: the assembly's only says it gave up.
        if let Err(e) = assembled {
            return Err(outcomes.into_iter().find_map(Result::err).unwrap_or(e));
        }
        let mut outcomes = outcomes.into_iter().collect::<Result<Vec<_>>>()?;
        let mut first = outcomes.remove(0);
        first.partitions = n;
        for o in &outcomes {
            first.recomputed.extend(o.recomputed.iter().copied());
            first.last_ready = first.last_ready.max(o.last_ready);
            first.done = first.done.max(o.done);
        }
        // Assembled (complete) here; deleted meanwhile by someone else: not found.
        match self.inner.store.lookup(&target) {
            Some(c) if c.status() == CopyStatus::Complete => Ok((ObjectView::Arena(c), first)),
            _ => Err(Error::NotFound(target)),
        }
    }

    /// Builds this node's copy of `target` from its partitions: fetches them all at once
    /// (each streams from wherever the directory says, as it is being reduced), a partition
    /// pulled from the node its coordinator names straight into its place in the copy
    /// (`Store::create_within`: no copy afterwards), any other copied in as it completes;
    /// drops the local partition copies, and announces the target complete. Nothing to do if
    /// the copy is here already. `hinted`: this node may be told where to fetch each
    /// partition (`Run::gather_hints`; else the directory says at once).
    fn assemble(
        &self,
        target: &ObjectId,
        (parts, late_hints): (&[(u64, u64)], bool),
        coordinator: Option<NodeId>,
        gone: Gone,
        hinted: bool,
    ) -> Result<()> {
        let inner = &self.inner;
        if inner
            .store
            .lookup(target)
            .is_some_and(|c| c.status() == CopyStatus::Complete)
        {
            return Ok(());
        }
        let n = parts.len();
        let size = parts.last().map_or(0, |p| p.1);
        crate::hop::hop!(self.id(), "assemble: creating the copy");
        let (copy, evicted) = inner.store.create(target, size, true)?;
        inner.dir.withdraw(&evicted);
        let placed = (hinted && late_hints).then(|| self.watch_placed(target));
        crate::hop::hop!(self.id(), "assemble: fetching the partitions");
        // Every partition fetched at once, on the node's workers (no thread made per
        // partition).
        let jobs = (0..n).map(|p| {
            let (node, id, target) = (self.clone(), part_id(target, p, n), target.clone());
            let (lo, hi) = parts[p];
            let (gone, outer, placed) = (gone.clone(), copy.clone(), placed.clone());
            Box::new(move || {
                // A reader (the coordinator named) gives a partition up when it finds no
                // complete copy of it while the whole result is complete elsewhere (see
                // `Node::view_while_up_until`); the coordinator does not (its trees are held).
                let whole = coordinator.is_some().then_some(&target);
                let into = Some((&outer, lo));
                node.fetch_partition(
                    &id,
                    (hi - lo, into),
                    (coordinator, whole),
                    (hinted, placed.as_ref()),
                    &*gone,
                )
            }) as Box<dyn FnOnce() -> Result<ObjectView> + Send>
        });
        let fetches = self.on_workers(jobs);
        let mut copy = copy;
        let result = self.assemble_in_order(target, parts, &fetches, &mut copy);
        if result.is_err() {
            // First (its name goes too): no more partitions are made within it (fetches
            // still running make copies of their own), and those already are dropped below
            // once complete.
            copy.fail();
        }
        for p in 0..n {
            self.evict_local(part_id(target, p, n).as_str());
        }
        result?;
        inner.dir.publish(target, size, true)
    }

    /// [`Node::assemble`]'s partitions, joined in order: the copy fills front to back, so
    /// readers of a partial copy could stream it. A partition pulled into its place is there
    /// already; any other is copied in. Should a place be unusable (a pull into it failed and
    /// may still write there), `copy` is made again in memory of its own, from the
    /// partitions' views, held until the end for that.
    fn assemble_in_order(
        &self,
        target: &ObjectId,
        parts: &[(u64, u64)],
        fetches: &[crossbeam_channel::Receiver<Result<ObjectView>>],
        copy: &mut crate::store::CopyRef,
    ) -> Result<()> {
        let mut views = Vec::with_capacity(parts.len());
        let (mut in_place, mut placed) = (true, 0);
        for (p, f) in fetches.iter().enumerate() {
            let view = Node::joined(f, "an allreduce partition fetch")?;
            let (lo, hi) = parts[p];
            if view.len() as u64 != hi - lo {
                return Err(Error::InvalidArgument(format!(
                    "allreduce partition {p} of {target} has {} bytes, expected {}",
                    view.len(),
                    hi - lo
                )));
            }
            if in_place {
                in_place = match &view {
                    ObjectView::Arena(c) if copy.advance_over(c).is_ok() => {
                        placed += 1;
                        true
                    }
                    _ if !copy.holds_inner(lo, hi) => copy.append(&view).map(|_| true)?,
                    _ => false,
                };
            }
            views.push(view);
        }
        if !in_place {
            crate::hop::hop!(self.id(), "assemble: a partition's place was lost; copying");
            let store = &self.inner.store;
            copy.fail(); // its name too: made again below
            let (again, evicted) = store.create(target, copy.size(), true)?;
            self.inner.dir.withdraw(&evicted);
            *copy = again;
            for v in &views {
                copy.append(v)?;
            }
            return Ok(());
        }
        let counted = &self.inner.placed_parts;
        counted.fetch_add(placed, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// How a partitioned allreduce of `parts` runs, from how its inputs come (see the
    /// module): whether its trees are shaped by the inputs' arrival, and whether its
    /// allgather hints come late (only once the last input is there). Every input there
    /// (partial or complete) within [`PRESENT_GRACE`], or within the window below: chains
    /// (rotated, a ring), their hints at once. None of those missing at the start come
    /// within the window: the inputs come one after another, no faster than a partition
    /// crosses a link, and the partitions' trees are shaped by their arrival
    /// (`Tree::by_arrival`): each root takes the later inputs' slices as they come, which
    /// its downlink keeps up with. Else (they come faster than that, but not all at once)
    /// chains, as for inputs all there, whose hints come once the last is placed: trees by
    /// arrival would have the roots' downlinks take the slices of inputs that come close
    /// together, and one tree is slower than the chains (module). The window is the time a
    /// partition takes on a link (`Transfers::link_bandwidth`), from [`PRESENT_GRACE`] to
    /// [`ARRIVAL_WINDOW`].
    fn partitioned_how(&self, sources: &[ObjectId], parts: &[(u64, u64)]) -> (bool, bool) {
        let widest = parts.iter().map(|p| p.1 - p.0).max().unwrap_or(0);
        let crossing = widest as f64 / self.inner.transfers.link_bandwidth().max(1.0);
        let window = std::time::Duration::from_secs_f64(crossing.min(60.0))
            .clamp(PRESENT_GRACE, ARRIVAL_WINDOW);
        match self.inputs_arriving(sources, PRESENT_GRACE, window) {
            None => (false, false),
            Some(0) => (true, true),
            Some(_) => (false, true),
        }
    }

    /// `None` if every input has a copy somewhere (partial or complete) within `grace`, or
    /// later within `window`; else how many of those missing at the start came within
    /// `window`. The directory says when each missing input is listed (a subscription
    /// each, answered as its first copy is published); one it cannot be asked about is
    /// looked for every [`ARRIVING_POLL`]. Until the twenty-third session every missing
    /// input was looked for every 2 ms (a lookup each; a loaded host stretched the 2 ms to
    /// 6), with no gain measured since at 16 MiB (README, twenty-third session).
    fn inputs_arriving(
        &self,
        sources: &[ObjectId],
        grace: std::time::Duration,
        window: std::time::Duration,
    ) -> Option<usize> {
        let start = std::time::Instant::now();
        let there = |s: &ObjectId| {
            self.inner.store.lookup(s).is_some()
                || matches!(self.locate(s.clone()), Ok(Some(info)) if !info.locations.is_empty())
        };
        let missing: Vec<&ObjectId> = sources.iter().filter(|s| !there(s)).collect();
        if missing.is_empty() {
            return None;
        }
        // Each answer with the index of its input in `missing`.
        let (tx, listed) = crossbeam_channel::unbounded();
        let mut unasked: Vec<&ObjectId> = Vec::new();
        for (k, s) in missing.iter().enumerate() {
            let tx = tx.clone();
            let on_reply = Box::new(move |r: Result<crate::protocol::Reply>| {
                let _ = tx.try_send((k, r));
            });
            if self.inner.dir.subscribe_then(s, on_reply).is_err() {
                unasked.push(s);
            }
        }
        drop(tx);
        let (mut left, mut came) = (missing.len(), 0);
        loop {
            if left == 0 {
                return None;
            }
            let end = start + if came > 0 { grace.min(window) } else { window };
            let now = std::time::Instant::now();
            if now >= end {
                return Some(came);
            }
            let wake = match unasked.is_empty() {
                true => end,
                false => end.min(now + ARRIVING_POLL),
            };
            use crate::protocol::Reply;
            match listed.recv_deadline(wake) {
                Ok((_, Ok(Reply::Info(Some(i)) | Reply::InfoInline(i, _))))
                    if !i.locations.is_empty() =>
                {
                    (left, came) = (left - 1, came + 1);
                }
                // Deleted first: not there (as a look would find).
                Ok((_, Ok(Reply::Info(_)))) | Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                }
                // Refused, or its shard died: looked for instead.
                Ok((k, _)) => unasked.push(missing[k]),
                // Every subscription answered: only the unasked ones are left to look for.
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                    if unasked.is_empty() {
                        return Some(came);
                    }
                    std::thread::sleep(wake.saturating_duration_since(std::time::Instant::now()));
                }
            }
            let before = unasked.len();
            unasked.retain(|s| !there(s));
            (left, came) = (
                left - (before - unasked.len()),
                came + (before - unasked.len()),
            );
        }
    }

    /// One partition for [`Node::assemble`]: from the node its coordinator names (along the
    /// partition's chain, as a ring's allgather: `Run::gather_hints`), else from wherever
    /// the directory says ([`Node::view_while_up`]); from there at once when no hint would
    /// come (`hinted` false).
    fn fetch_partition(
        &self,
        id: &ObjectId,
        (size, into): (u64, Option<(&crate::store::CopyRef, u64)>),
        (coordinator, whole): (Option<NodeId>, Option<&ObjectId>),
        (hinted, late): (bool, Option<&Placed>),
        gone: &dyn Fn() -> Option<Error>,
    ) -> Result<ObjectView> {
        // One op timeout in all, the wait for a hint included.
        let deadline = std::time::Instant::now() + self.inner.cfg.op_timeout;
        let directory = || self.view_while_up_until(id, (coordinator, whole), deadline, gone);
        let hint = match (hinted, late) {
            (false, _) => None,
            (true, Some(placed)) => self.late_hint(id, coordinator, (deadline, placed), gone),
            (true, None) => self.hint_unless_unplaced(id),
        };
        crate::hop::hop!(self.id(), "partition hint", hinted = hint.is_some());
        match hint {
            Some(GatherFrom::Node(source)) => {
                self.get_view_via(id, source, (size, into), HINT_STALL, directory)
            }
            // Produced here: the task's output, once it has made it. A repair may move the
            // partition elsewhere, or the copy fail: then wherever the directory says.
            Some(GatherFrom::Here) => match self.inner.store.wait_lookup(id, HERE_WAIT) {
                Ok(c) => match c.wait_complete(HINT_STALL, None) {
                    Ok(()) => Ok(ObjectView::Arena(c)),
                    Err(_) => {
                        drop(c);
                        directory()
                    }
                },
                Err(_) => directory(),
            },
            None => directory(),
        }
    }

    /// The allgather hint for partition `id` of a plan whose hints come at once (its inputs
    /// were all there): waited for up to `NodeConfig::allgather_hint_wait`, or
    /// [`UNPLACED_GRACE`] after the directory lists the partition (a node with no place in
    /// its tree, a reader without an input, gets none: it waited out the whole wait, 200 ms
    /// of a 16 MiB allreduce's 70 on loopback, before the twenty-second session). `None`:
    /// the directory is to say where to read it.
    fn hint_unless_unplaced(&self, id: &ObjectId) -> Option<GatherFrom> {
        // A node with a place normally has its hint within a moment (it leaves the
        // coordinator as the chains are placed, just after the plan): only then is the
        // directory asked to say when the partition is listed.
        let reducer = &self.inner.reducer;
        let first = HINT_FIRST.min(self.inner.cfg.allgather_hint_wait);
        if let Some(hint) = reducer.gather_hint(id, first) {
            return Some(hint);
        }
        let (tx, listed) = crossbeam_channel::bounded(1);
        let watched = self.inner.dir.subscribe_into(id, tx).is_ok();
        let until = std::time::Instant::now() + self.inner.cfg.allgather_hint_wait;
        let mut end = until;
        loop {
            let now = std::time::Instant::now();
            if now >= end {
                return self.unhinted();
            }
            if let Some(hint) = reducer.gather_hint(id, (end - now).min(HINT_SLICE)) {
                return Some(hint);
            }
            // Any answer (listed, deleted, refused) ends the wait a grace later.
            if watched && end == until && listed.try_recv().is_ok() {
                end = until.min(std::time::Instant::now() + UNPLACED_GRACE);
            }
        }
    }

    /// No hint for a partition whose tree is placed: counted
    /// ([`Node::partitions_read_unhinted`]), and the directory is to say where to read it.
    fn unhinted(&self) -> Option<GatherFrom> {
        let count = &self.inner.unhinted_parts;
        count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        None
    }

    /// Asks the directory to say when every partition tree of the allreduce into `target`
    /// is placed (its coordinator puts [`placed_id`] then); the answer, on the transport
    /// thread it lands on, is noted in the returned cell and cuts every wait for a hint here
    /// short. Not asked (the shard refused, or is down): the cell stays empty, and the hints
    /// are waited for as before the twenty-third session.
    fn watch_placed(&self, target: &ObjectId) -> Placed {
        let at = Placed::default();
        let (noted, transfers) = (at.clone(), self.inner.transfers.clone());
        let on_reply = Box::new(move |r: Result<crate::protocol::Reply>| {
            use crate::protocol::Reply;
            if let Ok(Reply::InfoInline(..) | Reply::Info(Some(_))) = r {
                let _ = noted.set(std::time::Instant::now());
                transfers.hints().kick();
            }
        });
        let _ = self.inner.dir.subscribe_then(&placed_id(target), on_reply);
        at
    }

    /// The allgather hint for partition `id` of a plan whose hints come late (its inputs were
    /// still coming as it began): its tree is placed, and the hint sent, only once the last
    /// input is there, which may be any time. So this waits for it for as long as it can
    /// still come: until every tree is placed (`placed`, [`Node::watch_placed`]: the hints
    /// went out just before, and one not here a moment later is none, as for a reader
    /// without an input), `deadline`, the allreduce's `coordinator` is down, or a copy of
    /// the partition is complete somewhere (its tree was repaired before it was placed, and
    /// no hint is made: checked every [`PLAN_STALL`]), or `gone` says the allreduce failed.
    /// `None`: the directory is to say where to read it (or why not). Until the
    /// twenty-third session a reader without an input learnt it only from a complete copy:
    /// 531 ms against the participants' 66-72 on loopback.
    fn late_hint(
        &self,
        id: &ObjectId,
        coordinator: Option<NodeId>,
        (deadline, placed): (std::time::Instant, &Placed),
        gone: &dyn Fn() -> Option<Error>,
    ) -> Option<GatherFrom> {
        let hints = self.inner.transfers.hints();
        loop {
            // Counted before the look, so a word that comes between them ends the wait.
            let kicks = hints.kicks();
            if let Some(&at) = placed.get() {
                let now = std::time::Instant::now();
                let wait = (at + UNPLACED_GRACE).saturating_duration_since(now);
                return hints.take(id, wait).or_else(|| self.unhinted());
            }
            if let Some(hint) = hints.take_unless_kicked(id, PLAN_STALL, kicks) {
                return Some(hint);
            }
            if placed.get().is_some() {
                continue; // the word came: its hint, if any, within the grace
            }
            let down = coordinator.is_some_and(|c| self.inner.members.is_down(c));
            if down || std::time::Instant::now() >= deadline || gone().is_some() {
                return None;
            }
            let complete = match self.locate(id.clone()) {
                Ok(Some(info)) => info.lost || info.locations.iter().any(|l| l.complete),
                _ => false,
            };
            if complete {
                return None;
            }
        }
    }

    /// A partition, or the result of a halving run or of one tree, wherever the directory
    /// says, given up once the allreduce's `coordinator` is down and no copy of it is
    /// complete anywhere: what its tasks (or ranks) had not produced they never will (they
    /// stop with their coordinator), whether or not the directory had heard of it, so its
    /// readers are told it is lost (`Error::ObjectLost`) rather than wait out the op timeout;
    /// and given up (`Error::CoordinatorFailed`) once the allreduce's plan says it failed.
    fn view_while_up(&self, id: &ObjectId, coordinator: Option<NodeId>) -> Result<ObjectView> {
        let deadline = std::time::Instant::now() + self.inner.cfg.op_timeout;
        let gone = || self.failed_at_coordinator(id);
        self.view_while_up_until(id, (coordinator, None), deadline, &gone)
    }

    /// `Error::CoordinatorFailed` if the plan of the allreduce into `target` says it failed
    /// at its coordinator (asked only of a wait that is already long: a lookup, and a read
    /// of the small plan if there is one).
    fn failed_at_coordinator(&self, target: &ObjectId) -> Option<Error> {
        let plan = plan_id(target);
        match self.locate(plan.clone()) {
            Ok(Some(info)) if !info.locations.is_empty() => {}
            _ => return None,
        }
        let view = self.get_view_timeout(plan, PLAN_STALL).ok()?;
        let why = decode_failed(&view).ok().flatten()?;
        Some(Error::CoordinatorFailed(target.clone(), why))
    }

    /// [`Node::view_while_up`] given up at `deadline`. With `whole` (a partition's whole
    /// result), also given up (`Error::ObjectLost`) when the partition has no complete copy
    /// anywhere while the whole result is complete on another node: this reader is behind,
    /// the partition's copies are gone (its root died after its allreduce's coordinator had
    /// its copy, every other reader its own), and the reader reads the whole result instead.
    /// Given up with `gone`'s error as soon as it has one (checked every [`PLAN_STALL`]).
    fn view_while_up_until(
        &self,
        id: &ObjectId,
        (coordinator, whole): (Option<NodeId>, Option<&ObjectId>),
        deadline: std::time::Instant,
        gone: &dyn Fn() -> Option<Error>,
    ) -> Result<ObjectView> {
        let coordinator = coordinator.filter(|&c| c != self.id());
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.get_view_timeout(id.clone(), PLAN_STALL.min(left)) {
                Err(Error::Timeout(..)) if !left.is_zero() => {
                    // A copy complete somewhere (a halving run committed before its
                    // coordinator died): its readers are still served.
                    // (A shard that cannot answer now says nothing: keep waiting.)
                    let complete = || match self.locate(id.clone()) {
                        Ok(Some(i)) => i.locations.iter().any(|l| l.complete),
                        Ok(None) => false,
                        Err(_) => true,
                    };
                    if coordinator.is_some_and(|c| self.inner.members.is_down(c)) && !complete() {
                        return Err(Error::ObjectLost(id.clone()));
                    }
                    if whole.is_some_and(|w| self.complete_elsewhere(w)) && !complete() {
                        return Err(Error::ObjectLost(id.clone()));
                    }
                    if let Some(e) = gone() {
                        return Err(e);
                    }
                }
                r => return r,
            }
        }
    }

    /// Whether a node other than this one lists a complete copy of `id`.
    fn complete_elsewhere(&self, id: &ObjectId) -> bool {
        let me = self.id();
        matches!(self.locate(id.clone()), Ok(Some(i))
            if i.locations.iter().any(|l| l.complete && l.node != me))
    }

    /// Deletes the result of an allreduce everywhere: `target`, and its plan and partitions
    /// when it was partitioned (`size`: the object's size).
    pub fn delete_allreduce(
        &self,
        target: impl Into<ObjectId>,
        size: u64,
        num_sources: usize,
        dtype: DType,
    ) -> Result<()> {
        let target = target.into();
        let min = self.inner.cfg.allreduce_partition_min;
        let parts = partitions(size, num_sources, dtype, min);
        // A plan may be there whenever an algorithm that writes one is on (the coordinator
        // announces one even when it does not know the size).
        if min != u64::MAX || self.inner.cfg.allreduce_halving_max >= INLINE_LIMIT {
            let _ = self.delete(plan_id(&target));
        }
        if parts.len() > 1 {
            // Put only when its hints came late; deleted either way (its watchers answered).
            let _ = self.delete(placed_id(&target));
            for p in 0..parts.len() {
                let _ = self.delete(part_id(&target, p, parts.len()));
            }
        }
        self.delete(target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The assembly of a result from its partitions: a partition pulled into its place is
    /// taken as it is, the others are copied in; and where a failed pull into a partition's
    /// place is still referenced (its writer may still write there), the result is made again
    /// in memory of its own, from the partitions' views.
    #[test]
    fn assembly_takes_partitions_in_place_copies_the_rest_or_starts_over() {
        let cfg = crate::NodeConfig {
            arena_size: 16 << 20,
            ..Default::default()
        };
        let c = crate::LocalCluster::start(1, cfg, Default::default()).unwrap();
        let node = c.node(0);
        let store = node.inner.store.clone();
        let parts = [(0u64, 100u64), (100, 250), (250, 300)];
        let bytes: Vec<u8> = (0..300u32).map(|i| (i * 7 + 3) as u8).collect();
        let ready = |v: ObjectView| {
            let (tx, rx) = crossbeam_channel::bounded(1);
            tx.send(Ok(v)).unwrap();
            rx
        };
        for broken in [false, true] {
            let tag = |s: &str| ObjectId::new(format!("{s}-{broken}"));
            let target = tag("whole");
            let (mut copy, _) = store.create(&target, 300, true).unwrap();
            let first = copy.offset();
            // Partition 0 pulled into its place; 1 in a copy of its own (a pull into its place
            // failed first, its writer still holding it, when `broken`); 2 as bytes.
            let p0 = store.create_within(&copy, &tag("p0"), 0, 100).unwrap();
            p0.append(&bytes[..100]).unwrap();
            let writer = broken.then(|| {
                let w = store.create_within(&copy, &tag("p1"), 100, 150).unwrap();
                w.append(&bytes[100..110]).unwrap();
                w.fail();
                w
            });
            let (p1, _) = store.create(&tag("p1"), 150, false).unwrap();
            p1.append(&bytes[100..250]).unwrap();
            let fetches = [
                ready(ObjectView::Arena(p0)),
                ready(ObjectView::Arena(p1)),
                ready(ObjectView::Owned(bytes[250..].to_vec())),
            ];
            let placed = node.partitions_pulled_in_place();
            node.assemble_in_order(&target, &parts, &fetches, &mut copy)
                .unwrap();
            let counted = node.partitions_pulled_in_place() - placed;
            assert_eq!(
                counted,
                u64::from(!broken),
                "counted only if kept: {broken}"
            );
            assert_eq!(copy.as_slice().unwrap(), &bytes[..], "broken: {broken}");
            assert!(store.lookup(&target).unwrap().is_same(&copy));
            assert_eq!(copy.offset() == first, !broken, "made again: {broken}");
            drop(writer);
        }
    }

    #[test]
    fn partitions_cover_the_object_in_whole_elements() {
        let m = PARTITION_MIN;
        assert_eq!(partitions(1 << 20, 8, DType::F32, m), vec![(0, 1 << 20)]);
        assert_eq!(partitions(64 << 20, 1, DType::F32, m), vec![(0, 64 << 20)]);
        assert_eq!(partitions(64 << 20, 8, DType::F32, u64::MAX).len(), 1);
        let size = (16 << 20) + 12;
        let p = partitions(size, 8, DType::F32, m);
        assert_eq!(p.len(), 8);
        assert_eq!(p[0].0, 0);
        assert_eq!(p.last().unwrap().1, size);
        for w in p.windows(2) {
            assert_eq!(w[0].1, w[1].0);
        }
        assert!(p
            .iter()
            .all(|(lo, hi)| lo % 4 == 0 && hi % 4 == 0 && hi > lo));
        // Sizes that are not whole elements are left to the tree (which refuses them).
        assert_eq!(partitions(size + 1, 8, DType::F32, m).len(), 1);
        // Many inputs: partitions of at least PARTITION_BYTES_MIN, not one per input.
        assert_eq!(partitions(4 << 20, 32, DType::F32, m).len(), 8);
        assert_eq!(partitions(4 << 20, 6, DType::F32, m).len(), 6);
        assert_eq!(partitions(64 << 20, 100, DType::F32, m).len(), 64);
        // A threshold set below it (tests, small clusters) still cuts into two at least.
        assert_eq!(partitions(64 << 10, 4, DType::F32, 32 << 10).len(), 2);
    }

    #[test]
    fn plans_round_trip_and_garbage_is_refused() {
        let p = partitions(32 << 20, 5, DType::F64, PARTITION_MIN);
        for late in [false, true] {
            let plan = encode_plan(&p, late, 3);
            assert_eq!(decode_plan(&plan, 32 << 20).unwrap(), (p.clone(), late, 3));
            assert!(decode_plan(&plan, 16 << 20).is_err());
        }
        assert!(decode_plan(&[1, 2, 3], 8).is_err());
        assert!(decode_plan(&encode_plan(&[(0, 4), (8, 16)], false, 0), 16).is_err());
        let one = (vec![(0, 77)], false, 9);
        assert_eq!(decode_plan(&encode_plan(&[], false, 9), 77).unwrap(), one);
        let mut b = encode_plan(&p, false, 1);
        b[0] = 200;
        assert!(decode_plan(&b, 32 << 20).is_err());
        // A flag no plan has: refused.
        b[0] = p.len() as u8;
        b[5] = 1;
        assert!(decode_plan(&b, 32 << 20).is_err());
        // No coordinator (a plan cut short), or one no node id can be: refused.
        let b = encode_plan(&p, false, 1);
        assert!(decode_plan(&b[..b.len() - 8], 32 << 20).is_err());
        let mut b = b;
        let at = b.len() - 8;
        b[at..].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode_plan(&b, 32 << 20).is_err());
        // Too many partitions: refused even when well formed.
        let many: Vec<(u64, u64)> = (0..=MAX_PARTITIONS as u64)
            .map(|k| (k * 8, k * 8 + 8))
            .collect();
        let size = many.last().unwrap().1;
        assert!(decode_plan(&encode_plan(&many, false, 0), size).is_err());
        assert_eq!(
            partitions(64 << 20, 1000, DType::F32, 1).len(),
            MAX_PARTITIONS
        );
    }

    #[test]
    fn a_failed_plan_carries_the_coordinators_message() {
        let b = encode_failed("reduce input x has 4 bytes, others 8");
        assert_eq!(
            decode_failed(&b).unwrap().as_deref(),
            Some("reduce input x has 4 bytes, others 8")
        );
        // Not a failure: the other plans.
        assert_eq!(
            decode_failed(&encode_plan(&[(0, 8)], false, 0)).unwrap(),
            None
        );
        // Cut to its bound, on a character boundary.
        let long = "é".repeat(FAILED_MESSAGE_MAX);
        let got = decode_failed(&encode_failed(&long)).unwrap().unwrap();
        assert!(got.len() <= FAILED_MESSAGE_MAX && got.chars().all(|c| c == 'é'));
        // A length that does not match, or beyond the bound: refused.
        let mut bad = b.clone();
        bad.push(0);
        assert!(decode_failed(&bad).is_err());
        let mut huge = FAILED_MARK.to_le_bytes().to_vec();
        huge.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode_failed(&huge).is_err());
        assert!(decode_failed(&FAILED_MARK.to_le_bytes()).is_err());
    }
}
