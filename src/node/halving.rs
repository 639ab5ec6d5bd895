//! Halving runs coordinated from a node (`crate::reduce::halving`): who their ranks are, how
//! long the coordinator waits for them, and the halving reduce (a reduce-scatter, then a
//! gather at the coordinator). The halving allreduce's own part is in `allreduce.rs`.

use super::Node;
use crate::ops::{DType, ReduceOp};
use crate::protocol::HalvingPlan;
use crate::reduce::{HalvingRan, ReduceOptions, ReduceOutcome};
use crate::{ObjectId, Result};
use phalanx_transport::NodeId;

/// The default `NodeConfig::reduce_halving_min` and `reduce_halving_max`: a reduce of all
/// its inputs runs as a halving reduce (reduce-scatter, then a gather at the coordinator) in
/// this range. Chosen by measurement on 8 emulated hosts at 1 Gbit/s (README, "Reduce of 64
/// to 256 KiB by a halving reduce").
pub const HALVING_REDUCE_MIN: u64 = 64 << 10;
pub const HALVING_REDUCE_MAX: u64 = 256 << 10;

/// A halving reduce needs this many ranks: with fewer, the root receives as much as from a
/// tree, one hop later.
pub const HALVING_REDUCE_RANKS: usize = 4;

/// The default `NodeConfig::halving_grace`: how long the coordinator of a halving run
/// (allreduce or reduce) waits for every input to be there, beyond four round trips (the
/// answers' own time), before it settles for one tree. A halving run starts once the last
/// input is there; a tree places the inputs as they come and has reduced the early ones by
/// then. Inputs made at once (barrier skew, a put each) are all there well within it; inputs
/// that come 2 ms apart are not, and there the tree finished sooner after the last (8
/// emulated hosts, 64 KiB: 1.3 ms against 2.2-2.7 for an allreduce, 0.75 against 1.1-1.3 for
/// a reduce; README, "A halving run waits 2 ms for its inputs").
pub const HALVING_GRACE: std::time::Duration = std::time::Duration::from_millis(2);

/// How long an abandoned run's coordinator waits for a rank's death to show, when no rank is
/// down yet (see [`Node::halving_survivors`]).
const SETTLE: std::time::Duration = std::time::Duration::from_secs(2);

/// The outcome of a committed halving run begun at `start`: every input used.
pub(super) fn halving_outcome(plan: &HalvingPlan, start: std::time::Instant) -> ReduceOutcome {
    let p = plan.ranks.len();
    ReduceOutcome {
        target: plan.target.clone(),
        degree: 2,
        used: plan.ranks.iter().map(|r| r.1.clone()).collect(),
        tree: Vec::new(),
        recomputed: Vec::new(),
        latency_s: 0.0,
        bandwidth_bps: 0.0,
        last_ready: start,
        done: std::time::Instant::now(),
        partitions: 1 << (usize::BITS - 1 - p.leading_zeros()),
        by_arrival: false,
    }
}

impl Node {
    /// A reduce of all of `sources` by a halving run coordinated here, if it can run as one
    /// (`NodeConfig::reduce_halving_min` to `_max` bytes, every input there within
    /// `NodeConfig::halving_grace`, each on its own node, this one among them, at least
    /// [`HALVING_REDUCE_RANKS`] of them): the result stored here under `target`. `Err(None)`:
    /// a tree is to reduce them; `Err(Some(inputs))`: a run was abandoned (a rank failed,
    /// died or stalled; nothing was announced) and a tree is to reduce `inputs`, those whose
    /// nodes are alive.
    pub(super) fn reduce_by_halving(
        &self,
        target: &ObjectId,
        sources: &[ObjectId],
        num: usize,
        (op, dtype): (ReduceOp, DType),
        opts: &ReduceOptions,
    ) -> Result<std::result::Result<ReduceOutcome, Option<Vec<ObjectId>>>> {
        let cfg = &self.inner.cfg;
        let fits = |s: u64| s >= cfg.reduce_halving_min && s <= cfg.reduce_halving_max;
        let plain = num != sources.len()
            || sources.len() < HALVING_REDUCE_RANKS
            || !opts.required.is_empty()
            || opts.claims.is_some()
            || opts.range.is_some();
        let size = match self.input_size(sources) {
            Some(s) if !plain && fits(s) && s.is_multiple_of(dtype.size() as u64) => s,
            _ => return Ok(Err(None)),
        };
        let Some(mut ranks) = self.halving_ranks(sources, size)? else {
            return Ok(Err(None));
        };
        // The coordinator is rank 0: a main rank, where the result ends.
        let Some(me) = ranks.iter().position(|r| r.0 == self.id()) else {
            return Ok(Err(None));
        };
        ranks.swap(0, me);
        let start = std::time::Instant::now();
        let plan = HalvingPlan {
            target: target.clone(),
            run: self.inner.rpc.fresh_token(),
            coordinator: self.id(),
            ranks,
            size,
            op,
            dtype,
            reduce: true,
        };
        match self.inner.reducer.coordinate_halving(&plan, &|| Ok(()))? {
            HalvingRan::Here(_) => Ok(Ok(halving_outcome(&plan, start))),
            // Not stored here (no room): nothing was announced, a tree does it again.
            HalvingRan::Elsewhere | HalvingRan::Abandoned => {
                Ok(Err(Some(self.halving_survivors(&plan))))
            }
        }
    }

    /// The inputs of an abandoned run's ranks that are alive: those a tree is to reduce
    /// instead (exactly those: a count would let the tree take a dead rank's input from a
    /// replica in place of a live one's). A rank's report (its partner's link failed) can
    /// abandon the run before this node sees that partner down; counted then, the dead
    /// input would be waited for until the op timeout. So when no rank is down yet, this
    /// waits up to [`SETTLE`] for one to be (a run abandoned for a stall, with every rank
    /// alive, costs that much more).
    pub(super) fn halving_survivors(&self, plan: &HalvingPlan) -> Vec<ObjectId> {
        let members = &self.inner.members;
        let alive = || plan.ranks.iter().filter(|r| !members.is_down(r.0)).count();
        if alive() == plan.ranks.len() {
            let down = members.watch_peer_down();
            let deadline = std::time::Instant::now() + SETTLE;
            while alive() == plan.ranks.len() {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if down.recv_timeout(left).is_err() {
                    break;
                }
            }
        }
        let live: Vec<ObjectId> = plan
            .ranks
            .iter()
            .filter(|r| !members.is_down(r.0))
            .map(|r| r.1.clone())
            .collect();
        match live.is_empty() {
            // None alive (this node's own rank counts): the tree waits for a rejoin.
            true => plan.ranks.iter().map(|r| r.1.clone()).collect(),
            false => live,
        }
    }

    /// How long a halving run's coordinator waits for its inputs: the configured grace and
    /// four round trips (a subscription's answer takes one; more on a loaded host).
    fn halving_grace(&self) -> std::time::Duration {
        let rtt = self.inner.rpc.rtt_estimate().unwrap_or_default();
        self.inner.cfg.halving_grace + 4 * rtt.min(std::time::Duration::from_millis(50))
    }

    /// The node of each input, if every input is there (partial or complete) within the
    /// grace ([`Node::halving_grace`]) and each is on its own node, this one among them: the
    /// ranks of a halving run, in the order of `sources`. `InvalidArgument` if an input
    /// found has another size than `size` (the one here).
    pub(super) fn halving_ranks(
        &self,
        sources: &[ObjectId],
        size: u64,
    ) -> Result<Option<Vec<(NodeId, ObjectId)>>> {
        let me = self.id();
        // The coordinator is a rank: one that holds no input (a driver) coordinates no run.
        if self.input_size(sources).is_none() {
            return Ok(None);
        }
        let deadline = std::time::Instant::now() + self.halving_grace();
        // Asked all at once; each answered as soon as its object has a location.
        let mut asks = Vec::with_capacity(sources.len());
        for s in sources {
            match self.inner.store.lookup(s) {
                Some(_) => asks.push(None),
                None => match self.subscribe(s.clone()) {
                    Ok(rx) => asks.push(Some(rx)),
                    Err(_) => return Ok(None),
                },
            }
        }
        let mut ranks: Vec<(NodeId, ObjectId)> = Vec::with_capacity(sources.len());
        for (s, ask) in sources.iter().zip(asks) {
            let node = match ask {
                None => me,
                Some(rx) => {
                    let wait = deadline.saturating_duration_since(std::time::Instant::now());
                    let Some(info) = rx.recv_timeout(wait).ok().and_then(|r| r.ok()).flatten()
                    else {
                        return Ok(None);
                    };
                    if info.size != size {
                        return Err(crate::reduce::other_size(s, info.size, size));
                    }
                    // The copy the input was put in: complete, or filling but from no source.
                    let put = info
                        .locations
                        .iter()
                        .filter(|l| l.complete || l.depends_on.is_none())
                        .min_by_key(|l| !l.complete);
                    match put {
                        Some(l) => l.node,
                        None => return Ok(None),
                    }
                }
            };
            if ranks.iter().any(|r| r.0 == node) {
                return Ok(None);
            }
            ranks.push((node, s.clone()));
        }
        Ok(ranks.iter().any(|r| r.0 == me).then_some(ranks))
    }
}
