//! Running halving-doubling allreduces (`halving`) on nodes: the coordinator's part, the
//! other ranks' tasks, blocks pushed between partners as messages, and the commit.
//!
//! A run has `m` ranks, one per node holding one of the inputs, the coordinator among them.
//! The coordinator sends the plan to every rank itself in a run of up to `FLAT_PLAN` ranks
//! (one hop); a larger run's plan goes down a binomial tree rooted at the coordinator (each
//! rank hands it on to the ranks below it before it starts: `ceil(log2 m)` hops, no node
//! sending more than that many). Every rank pushes its blocks to its partners and waits for
//! theirs (`Mailbox`). Nothing is announced until some rank has the whole result (every
//! block was then reduced from every input): the run commits at that moment, decided at the
//! coordinator. Its own rank's thread decides when that rank is done; a rank that has had
//! its result for `WORD_LATE` with no word says so (`HalvingDone`: the coordinator's rank
//! is held up), and the thread that word lands on decides. Either tells every rank
//! (`HalvingEnd { commit: true }`), after listing every rank's copy with the directory in one
//! message (`DirMsg::PublishRun`: a message to the shard from each rank, as each finished,
//! cost the nodes still running 1-5 % of a 64 KiB allreduce on the 8 emulated hosts); the
//! coordinator's own copy is in that listing when its own rank decided (else, held up, it
//! announces its copy as it stores it). Each
//! rank stores its copy where that word (or its own result) lands, without a word to the
//! directory (one that cannot withdraws its listing), and its node's reader, which watches
//! for the commit, returns that copy. All ranks end with the same bytes, so any of them may
//! serve readers. A rank whose partner
//! dies, whose block does not come, or whose input is gone reports failure; the coordinator
//! then abandons the run (`commit: false`) before anything was announced, and the caller
//! reduces the inputs still there with a tree instead. The first of the two decisions stands
//! (`Mailbox::decide`).
//!
//! A reduce (`HalvingPlan::reduce`) runs the same way up to the reduce-scatter; then every
//! rank sends its block to the coordinator and is done, and only the coordinator stores the
//! result: the run commits when the coordinator has it, with no word to the ranks.

use super::halving::{can_root, plan_children, plan_parent, RankState};
use super::mailbox::{CommitWatch, End, Gave, Outcome, Parked, RunKey, RunView};
use super::Reducer;
use crate::hop::hop;
use crate::protocol::{HalvingPlan, Msg, ReduceMsg};
use crate::store::{CopyRef, CopyStatus, Store};
use crate::{Error, ObjectId, Result};
use phalanx_transport::NodeId;
use std::sync::Arc;
use std::time::Duration;
use tracing::{debug, warn};

/// Most ranks one run takes.
pub const MAX_RANKS: usize = 1024;

/// How long a run may go without news (a block, a word) before its ranks give up (at most
/// the node's op timeout).
const STEP_WAIT: Duration = Duration::from_secs(10);

/// How long a rank with the whole result waits for the coordinator's word before it says
/// it has the result (`HalvingDone`, from the node's tick): the word normally comes one hop
/// after the last ranks are done, so a prompt run costs no message more.
const WORD_LATE: Duration = Duration::from_millis(20);

/// How long the coordinator waits for its own rank once another rank's word committed the
/// run: its rank is normally a step behind at most; one held up longer (a partner that
/// stalls after the others had their blocks) has it read a rank's copy instead.
const OWN_RANK_AFTER_COMMIT: Duration = Duration::from_millis(100);

/// A run slower than this says where its time went (at debug level).
const SLOW_RUN: Duration = Duration::from_millis(20);

/// Checks a plan a rank was sent: well formed, this node a rank once, `from` the rank that
/// hands it this plan in the plan's tree (`plan_parent`: the coordinator or a rank below it).
fn check_plan(plan: &HalvingPlan, me: NodeId, from: NodeId, max_size: u64) -> Result<usize> {
    let bad = |why: &str| {
        Err(Error::InvalidArgument(format!(
            "halving plan refused: {why}"
        )))
    };
    let m = plan.ranks.len();
    if !(2..=MAX_RANKS).contains(&m) {
        return bad("rank count");
    }
    if plan.size > max_size || !plan.size.is_multiple_of(plan.dtype.size() as u64) {
        return bad("size");
    }
    let mut nodes: Vec<NodeId> = plan.ranks.iter().map(|r| r.0).collect();
    nodes.sort_unstable();
    nodes.dedup();
    if nodes.len() != m || !nodes.contains(&plan.coordinator) {
        return bad("nodes");
    }
    let Some(rank) = plan.ranks.iter().position(|r| r.0 == me) else {
        return bad("this node is no rank of it");
    };
    let root = coordinator_rank(plan)?;
    if plan.reduce && !can_root(root, m) {
        return bad("a reduce's coordinator must be a main rank");
    }
    match plan_parent(rank, m, root).map(|q| plan.ranks[q].0) {
        Some(parent) if parent == from => Ok(rank),
        _ => bad("not handed on by its parent in the plan's tree"),
    }
}

/// The coordinator's rank in its plan.
fn coordinator_rank(plan: &HalvingPlan) -> Result<usize> {
    plan.ranks
        .iter()
        .position(|r| r.0 == plan.coordinator)
        .ok_or_else(|| Error::InvalidArgument("the coordinator is no rank".into()))
}

/// The nodes `rank` hands the plan on to.
fn plan_children_of(plan: &HalvingPlan, rank: usize) -> Result<Vec<NodeId>> {
    let root = coordinator_rank(plan)?;
    Ok(plan_children(rank, plan.ranks.len(), root)
        .into_iter()
        .map(|k| plan.ranks[k].0)
        .collect())
}

impl Reducer {
    fn step_wait(&self) -> Duration {
        STEP_WAIT.min(self.cfg.op_timeout)
    }

    /// A plan from `from`: starts this node's rank where the plan landed if its input is
    /// complete here, else on a worker once it is.
    pub(super) fn start_halving(self: &Arc<Self>, from: NodeId, plan: HalvingPlan) {
        let max = match plan.reduce {
            true => self.cfg.reduce_halving_max,
            false => self.cfg.allreduce_halving_max,
        };
        let rank = match check_plan(&plan, self.id, from, max) {
            Ok(r) => r,
            Err(e) => {
                warn!(node = self.id, from, "{e}");
                let msg = ReduceMsg::HalvingFailed {
                    target: plan.target,
                    run: plan.run,
                };
                self.rpc
                    .send_from_transport_thread(plan.coordinator, Msg::Reduce(msg));
                return;
            }
        };
        let plan = Arc::new(plan);
        if !self
            .halving
            .register(&key_of(&plan), plan.coordinator, plan.digest())
        {
            return; // abandoned before the plan came down the tree
        }
        // The ranks below this one in the plan's tree first: they start while this one
        // works. One that cannot be told is found by the coordinator (its node is down, or
        // its partners' blocks wait for it and the run is abandoned at the step wait).
        for child in plan_children_of(&plan, rank).unwrap_or_default() {
            let task = ReduceMsg::HalvingTask {
                plan: (*plan).clone(),
            };
            self.rpc.send_without_blocking(child, Msg::Reduce(task));
        }
        let ready = self
            .store
            .lookup(&plan.ranks[rank].1)
            .is_some_and(|c| c.status() == CopyStatus::Complete);
        if ready {
            return self.begin_rank(plan, rank, Duration::ZERO);
        }
        let me = self.clone();
        let wait = self.step_wait();
        if let Err(e) = self.workers.spawn(move || me.begin_rank(plan, rank, wait)) {
            warn!(node = self.id, "halving rank not started: {e}");
        }
    }

    /// Starts rank `rank` of `plan` on this thread: its input (waiting up to `wait` for it to
    /// complete), then every step it can.
    fn begin_rank(&self, plan: Arc<HalvingPlan>, rank: usize, wait: Duration) {
        hop!(self.id, "halving rank running", rank = rank as u64);
        let root = match plan.reduce {
            true => coordinator_rank(&plan).ok(),
            false => None,
        };
        let state = self.halving_input(&plan, rank, wait).and_then(|input| {
            RankState::new(rank, plan.ranks.len(), input, (plan.op, plan.dtype), root)
        });
        match state {
            Ok(state) => self.drive(Parked {
                plan,
                state: Box::new(state),
                sent: 0,
                began: std::time::Instant::now(),
                taken: Vec::new(),
            }),
            Err(e) => self.rank_failed(&plan, e),
        }
    }

    /// A block landed here (on a transport thread): carries this node's rank on if it waited
    /// for it.
    pub(super) fn halving_block(
        &self,
        from: NodeId,
        target: ObjectId,
        run: u64,
        step: u32,
        data: Vec<u8>,
    ) {
        if let Some(p) = self.halving.put_block(target, run, from, step, data) {
            self.drive(p);
        }
    }

    /// Does every step the rank can, sending without blocking; parks it at the first block
    /// that is not here yet. Runs on whichever thread has the rank: the one its last block
    /// landed on, mostly.
    fn drive(&self, mut p: Parked) {
        let key = key_of(&p.plan);
        let fault = self.transfers.fault_hook();
        loop {
            let plan = p.plan.clone();
            let (mut sent, mut tripped) = (p.sent, false);
            let r = p.state.advance(
                &mut |to, step, data| {
                    // The fault hook: the node dies once it has sent the planned bytes of the
                    // run (on a worker: a transport thread does not close its own links).
                    if let Some(budget) = fault.budget(&plan.target, sent) {
                        if data.len() as u64 > budget {
                            tripped = true;
                            return Err(Error::InvalidArgument("injected fault".into()));
                        }
                    }
                    sent += data.len() as u64;
                    let msg = ReduceMsg::HalvingBlock {
                        target: plan.target.clone(),
                        run: plan.run,
                        step,
                        data,
                    };
                    self.rpc
                        .send_without_blocking(plan.ranks[to].0, Msg::Reduce(msg));
                    Ok(())
                },
                &mut |from, step| {
                    let got = self.halving.try_take(&key, plan.ranks[from].0, step);
                    if got.is_some() {
                        p.taken.push((step, p.began.elapsed().as_micros() as u32));
                    }
                    Ok(got)
                },
            );
            p.sent = sent;
            if tripped {
                let fault = fault.clone();
                if self
                    .workers
                    .spawn(move || {
                        let _ = fault.fire();
                    })
                    .is_err()
                {
                    warn!(node = self.id, "injected fault not fired");
                }
                return;
            }
            if let Err(e) = r {
                return self.rank_failed(&plan, e);
            }
            if p.state.is_done() {
                if p.began.elapsed() > SLOW_RUN {
                    debug!(
                        node = self.id,
                        "slow halving rank of {}: blocks taken at (step, us) {:?}",
                        plan.target,
                        p.taken
                    );
                }
                if plan.reduce && plan.coordinator != self.id {
                    // A reduce's rank has sent its block to the coordinator: nothing is
                    // stored here (the target is read from the coordinator's node).
                    hop!(self.id, "halving rank done");
                    return self.halving.finish(&key, Outcome::Abandoned);
                }
                let v = p.state.into_result().expect("done");
                hop!(self.id, "halving rank has the result");
                if plan.coordinator == self.id && self.halving.decide(&key, true) && !plan.reduce {
                    // Every block was reduced from every input: the run's result is final.
                    // Every rank's copy is listed, this node's too (its caller's thread
                    // stores it in a moment, `coordinate_halving`), and the other ranks
                    // commit now.
                    let others = self.other_ranks(&plan);
                    let mut copies = others.clone();
                    copies.push(self.id);
                    self.dir
                        .publish_run_without_blocking(&key.0, plan.size, copies);
                    self.send_end_to(&key, plan.digest(), &others, true);
                }
                return match self.halving.rank_finished(&key, Ok(v)) {
                    End::Commit(v) => self.commit(key.0, key.1, v),
                    End::Over => self.halving.finish(&key, Outcome::Abandoned),
                    // No word yet: it comes one hop after the coordinator's own rank is
                    // done; if it does not come soon, the tick says this rank is done.
                    End::Wait => {}
                };
            }
            match self.halving.park(&key, p) {
                Some(again) => p = again,
                None => return,
            }
        }
    }

    /// This node's rank failed: the coordinator is told (it abandons the run), unless it is
    /// the coordinator, whose thread hears of it.
    fn rank_failed(&self, plan: &HalvingPlan, e: Error) {
        debug!(node = self.id, "halving rank of {}: {e}", plan.target);
        let key = key_of(plan);
        self.halving.rank_finished(&key, Err(e.to_string()));
        if plan.coordinator != self.id {
            let msg = ReduceMsg::HalvingFailed {
                target: plan.target.clone(),
                run: plan.run,
            };
            self.rpc
                .send_without_blocking(plan.coordinator, Msg::Reduce(msg));
            self.halving.finish(&key, Outcome::Abandoned);
        }
    }

    /// The coordinator's last word landed here.
    pub(super) fn halving_end(
        &self,
        from: NodeId,
        target: ObjectId,
        run: u64,
        commit: bool,
        plan: [u8; 16],
    ) {
        match self
            .halving
            .put_end(target.clone(), run, from, commit, plan)
        {
            End::Commit(v) => self.commit(target, run, v),
            End::Over => self.halving.finish(&(target, run), Outcome::Abandoned),
            End::Wait => {}
        }
    }

    /// A rank's word that it has the whole result of a run coordinated here landed: the
    /// first such word, if nothing was decided yet, commits the run (every block was
    /// reduced from every input) and every rank is told, that one first.
    pub(super) fn halving_done(&self, from: NodeId, target: ObjectId, run: u64, plan: [u8; 16]) {
        let key = (target, run);
        if let Some((ranks, size)) = self.halving.rank_done(&key, from, plan) {
            hop!(
                self.id,
                "halving run committed by a rank's word",
                from = from as u64
            );
            self.dir
                .publish_run_without_blocking(&key.0, size, ranks.clone());
            self.send_end_to(&key, plan, &ranks, true);
        }
    }

    /// Stores a committed result (its coordinator listed it with the directory): here if the
    /// store has room at once (the node's reader is then woken one thread hand-off sooner),
    /// else on a worker, which also reports any failure and withdraws the listing (an
    /// allocation may wait for room; a transport thread must not).
    fn commit(&self, target: ObjectId, run: u64, v: Vec<u8>) {
        if store_result(&self.store, &self.dir, &target, &v, Announce::ListedNow).is_ok() {
            hop!(self.id, "halving rank done");
            return self.halving.finish(&(target, run), Outcome::Committed);
        }
        let (store, dir, halving, me) = (
            self.store.clone(),
            self.dir.clone(),
            self.halving.clone(),
            self.id,
        );
        let key = (target.clone(), run);
        let job = move || {
            let outcome = match store_result(&store, &dir, &target, &v, Announce::Listed) {
                Ok(_) => Outcome::Committed,
                Err(e) => {
                    warn!(node = me, "allreduce result {target} not stored: {e}");
                    // Listed by the coordinator: readers are not to come here.
                    dir.withdraw(std::slice::from_ref(&target));
                    Outcome::Abandoned
                }
            };
            hop!(me, "halving rank done");
            halving.finish(&(target, run), outcome);
        };
        if let Err(e) = self.workers.spawn(job) {
            warn!(node = self.id, "allreduce result not stored: {e}");
            self.dir.withdraw_without_blocking(&key.0);
            self.halving.finish(&key, Outcome::Abandoned);
        }
    }

    /// This rank's input: the local copy, once complete (waiting up to `wait`).
    fn halving_input(&self, plan: &HalvingPlan, rank: usize, wait: Duration) -> Result<Vec<u8>> {
        let id = &plan.ranks[rank].1;
        let copy = self.store.wait_lookup(id, wait)?;
        copy.wait_complete(wait, None)?;
        if copy.size() != plan.size {
            return Err(Error::InvalidArgument(format!(
                "allreduce input {id} has {} bytes, the plan {}",
                copy.size(),
                plan.size
            )));
        }
        Ok(copy.filled(0, copy.size()).to_vec())
    }

    /// Runs whose coordinator died, or that heard nothing for too long, end here (the
    /// dispatcher's tick): their ranks stop, readers read elsewhere, the coordinator (if
    /// alive) is told.
    pub(crate) fn halving_tick(&self) {
        if !self.halving.has_runs() {
            return;
        }
        // Ranks that have had the whole result for a while with no word: the coordinator's
        // own rank is held up (its last partner stalled, say). Their word commits the run.
        for ((target, run), coordinator, plan) in self.halving.waiting_for_word(self.id, WORD_LATE)
        {
            hop!(
                self.id,
                "halving rank says it has the result",
                to = coordinator as u64
            );
            let msg = ReduceMsg::HalvingDone { target, run, plan };
            self.rpc
                .send_without_blocking(coordinator, Msg::Reduce(msg));
        }
        let members = &self.members;
        for ((target, run), coordinator) in self
            .halving
            .sweep(self.step_wait(), &|n| members.is_down(n))
        {
            if coordinator == self.id {
                continue;
            }
            // Its coordinator may have listed this rank's copy as it committed, and the word
            // never came: no copy is coming here.
            if self.store.lookup(&target).is_none() {
                self.dir.withdraw_without_blocking(&target);
            }
            if !members.is_down(coordinator) {
                let msg = ReduceMsg::HalvingFailed { target, run };
                let _ = self.rpc.send(coordinator, Msg::Reduce(msg));
            } else {
                // Nothing will make the target now: its readers that are no rank (they
                // know no coordinator: the plan comes after the run) are told it is lost.
                self.dir.give_up(&target, coordinator);
            }
        }
    }

    /// Tells every other rank of `plan` how the run ends (never blocks: queued to the
    /// dispatcher when a link is busy; a rank that does not hear it gives up on its own, at
    /// the tick's sweep).
    fn send_end(&self, plan: &HalvingPlan, commit: bool) {
        let others = self.other_ranks(plan);
        self.send_end_to(&key_of(plan), plan.digest(), &others, commit);
    }

    /// The nodes of `plan`'s ranks but this one.
    fn other_ranks(&self, plan: &HalvingPlan) -> Vec<NodeId> {
        plan.ranks
            .iter()
            .map(|r| r.0)
            .filter(|&n| n != self.id)
            .collect()
    }

    /// Tells `ranks` how run `key` of the plan of digest `digest` ends (see `send_end`).
    fn send_end_to(&self, key: &RunKey, digest: [u8; 16], ranks: &[NodeId], commit: bool) {
        for &n in ranks {
            let end = ReduceMsg::HalvingEnd {
                target: key.0.clone(),
                run: key.1,
                commit,
                plan: digest,
            };
            self.rpc.send_without_blocking(n, Msg::Reduce(end));
        }
    }

    /// Coordinates run `plan` (this node is one of its ranks): hands the plan to the ranks
    /// below it in the plan's tree (each hands it on), runs its own rank, and decides. The
    /// run commits the moment the coordinator's rank has the whole result (every block was
    /// then reduced from every input), or when another rank says it has (`HalvingDone`, when
    /// the coordinator's rank is held up): the thread that learns it tells the ranks at once,
    /// and this one stores the result here once its own rank has it (if that rank is held up
    /// or fails after the commit, it reads a rank's copy). It is abandoned, before anything
    /// was announced, if a rank fails, dies or stalls first (the caller then uses a tree).
    /// `announce` tells readers the plan, once the run is decided (readers on the ranks'
    /// nodes mostly learn of the commit from their own run first).
    pub(crate) fn coordinate_halving(
        &self,
        plan: &HalvingPlan,
        announce: &dyn Fn() -> Result<()>,
    ) -> Result<Ran> {
        let key = key_of(plan);
        let rank = coordinator_rank(plan)?;
        if plan.ranks[rank].0 != self.id {
            return Err(Error::InvalidArgument(
                "the coordinator is not this node".into(),
            ));
        }
        let others = self.other_ranks(plan);
        self.halving.register(&key, self.id, plan.digest());
        if !plan.reduce {
            self.halving.coordinate(&key, others.clone(), plan.size);
        }
        let t0 = std::time::Instant::now();
        let plan = Arc::new(plan.clone());
        let mut sent = true;
        for n in plan_children_of(&plan, rank)? {
            let task = ReduceMsg::HalvingTask {
                plan: (*plan).clone(),
            };
            if let Err(e) = self.rpc.send(n, Msg::Reduce(task)) {
                debug!(node = self.id, "halving task to {n}: {e}");
                sent = false;
                break;
            }
        }
        let tasks_sent = t0.elapsed();
        let members = &self.members;
        let behind = |v: &RunView| {
            v.committed_by_rank
                .is_some_and(|d| d > OWN_RANK_AFTER_COMMIT)
                .then_some(Gave::Timeout)
        };
        let watch = |v: &RunView| {
            if let Some(g) = behind(v) {
                return Some(g);
            }
            // Failure reports count from the run's ranks only.
            if v.failed.iter().any(|n| others.contains(n)) {
                return Some(Gave::Abandoned);
            }
            others
                .iter()
                .any(|&n| members.is_down(n))
                .then_some(Gave::PeerDown)
        };
        let result = if sent {
            self.begin_rank(plan.clone(), rank, self.step_wait());
            match self.halving.wait_result(&key, self.step_wait(), &watch) {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(e),
                Err(g) => Err(format!("{g:?}")),
            }
        } else {
            Err("a rank of the allreduce could not be told its task".into())
        };
        let result = match result {
            // Decided (commit) by the thread that completed this rank.
            Ok(v) => Some(v),
            Err(e) if self.halving.decide(&key, false) => {
                debug!(
                    node = self.id,
                    "allreduce into {} abandoned: {e}", plan.target
                );
                self.send_end(&plan, false);
                None
            }
            // Committed meanwhile: the result is here, or about to be (if another rank's
            // word committed it and this rank is held up, a rank's copy is read instead).
            Err(_) => match self.halving.wait_result(&key, self.step_wait(), &behind) {
                Ok(Ok(v)) => Some(v),
                _ => {
                    if !plan.reduce && self.halving.committed_by_own_rank(&key) {
                        // Listed with the ranks' copies, and none will be stored here.
                        self.dir.withdraw(std::slice::from_ref(&plan.target));
                    }
                    announce()?;
                    self.halving.finish(&key, Outcome::Abandoned);
                    return Ok(Ran::Elsewhere);
                }
            },
        };
        let had_result = t0.elapsed();
        let Some(v) = result else {
            announce()?;
            self.halving.finish(&key, Outcome::Abandoned);
            return Ok(Ran::Abandoned);
        };
        // Announced first: the ranks are committing already.
        let announced = announce();
        // A reduce's caller may have the result read anywhere once it returns: the
        // directory has it by then (an allreduce's readers read their own copies). An
        // allreduce's copy here was listed with the ranks' when this node's rank committed
        // the run; committed by another rank's word, it is announced as it is stored.
        let how = match plan.reduce {
            true => Announce::Confirmed,
            false if self.halving.committed_by_own_rank(&key) => Announce::Listed,
            false => Announce::Sent,
        };
        let stored = store_result(&self.store, &self.dir, &plan.target, &v, how);
        if how == Announce::Listed && stored.is_err() {
            // Listed: readers are not to come here.
            self.dir.withdraw(std::slice::from_ref(&plan.target));
        }
        if t0.elapsed() > SLOW_RUN {
            debug!(
                node = self.id,
                "slow halving run of {}: tasks sent after {tasks_sent:?}, result after \
                 {had_result:?}, stored after {:?}",
                plan.target,
                t0.elapsed()
            );
        }
        match stored {
            Ok(copy) => {
                self.halving.finish(&key, Outcome::Committed);
                announced?;
                Ok(Ran::Here(copy))
            }
            Err(e) => {
                // The ranks have committed: readers (this one too) read one of their copies.
                warn!(
                    node = self.id,
                    "allreduce result {} not stored here: {e}", plan.target
                );
                self.halving.finish(&key, Outcome::Abandoned);
                announced?;
                Ok(Ran::Elsewhere)
            }
        }
    }

    /// A watch that hears when a run into `target` commits on this node.
    pub(crate) fn watch_halving_commit(&self, target: &ObjectId) -> CommitWatch {
        self.halving.watch_commit(target)
    }

    /// Whether a halving run into `target` was abandoned on this node because its coordinator
    /// died (no plan will come for the target's readers here).
    pub(crate) fn halving_coordinator_died(&self, target: &ObjectId) -> bool {
        self.halving
            .coordinator_died(target, &|n| self.members.is_down(n))
    }

    /// How run `run` into `target`, coordinated by `coordinator`, ended on this node, waiting
    /// up to `wait` for it.
    pub(crate) fn halving_outcome(
        &self,
        target: &ObjectId,
        run: u64,
        coordinator: NodeId,
        wait: Duration,
    ) -> Option<Outcome> {
        self.halving
            .wait_outcome(&(target.clone(), run), coordinator, wait)
    }
}

/// How a coordinated run ended.
pub(crate) enum Ran {
    /// Committed, with the result stored here.
    Here(CopyRef),
    /// Committed, but the result could not be stored here: the ranks' copies are read.
    Elsewhere,
    /// Abandoned before anything was announced: the caller reduces with a tree.
    Abandoned,
}

fn key_of(plan: &HalvingPlan) -> RunKey {
    (plan.target.clone(), plan.run)
}

/// How [`store_result`] announces a result to the directory.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Announce {
    /// Sent, waiting for room and for the link.
    Sent,
    /// Sent, and returns once the directory has it.
    Confirmed,
    /// Not announced: the run's coordinator listed it (`DirMsg::PublishRun`). On a thread
    /// that must not block (no wait for room), or (`Listed`) one that may.
    ListedNow,
    Listed,
}

/// Stores a result under the target's name (pinned, as a reduce's output) and announces it
/// complete, as `how` says.
fn store_result(
    store: &Arc<Store>,
    dir: &crate::directory::DirClient,
    target: &ObjectId,
    bytes: &[u8],
    how: Announce,
) -> Result<CopyRef> {
    let size = bytes.len() as u64;
    let now = how == Announce::ListedNow;
    let made = match now {
        true => store.create_output_now(target, size),
        false => store.create_output(target, size),
    };
    let copy = match made {
        Ok((copy, evicted)) => {
            if now {
                for id in &evicted {
                    dir.withdraw_without_blocking(id);
                }
            } else {
                dir.withdraw(&evicted);
            }
            copy.append(bytes)?;
            copy
        }
        // A complete copy is here already (the same bytes: every rank has them).
        Err(Error::AlreadyExists(_)) => match store.lookup(target) {
            Some(c) if c.status() == CopyStatus::Complete => return Ok(c),
            _ => return Err(Error::AlreadyExists(target.clone())),
        },
        Err(e) => return Err(e),
    };
    match how {
        Announce::Sent => dir.publish(target, size, true)?,
        Announce::Confirmed => dir.publish_confirmed(target, size, true)?,
        Announce::ListedNow | Announce::Listed => dir.listed(target),
    }
    Ok(copy)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{DType, ReduceOp};

    fn plan(ranks: &[NodeId], coordinator: NodeId, size: u64) -> HalvingPlan {
        HalvingPlan {
            target: "t".into(),
            run: 1,
            coordinator,
            ranks: ranks
                .iter()
                .map(|&n| (n, ObjectId::new(format!("in{n}"))))
                .collect(),
            size,
            op: ReduceOp::Sum,
            dtype: DType::F32,
            reduce: false,
        }
    }

    #[test]
    fn forged_or_malformed_plans_are_refused() {
        let max = 1 << 20;
        assert_eq!(check_plan(&plan(&[0, 3, 5], 0, 64), 3, 0, max).unwrap(), 1);
        // Not from its coordinator, this node no rank, a node twice, one rank, too large,
        // not whole elements, a coordinator that is no rank.
        assert!(check_plan(&plan(&[0, 3, 5], 0, 64), 3, 5, max).is_err());
        assert!(check_plan(&plan(&[0, 3, 5], 0, 64), 4, 0, max).is_err());
        assert!(check_plan(&plan(&[0, 3, 3], 0, 64), 3, 0, max).is_err());
        assert!(check_plan(&plan(&[0], 0, 64), 0, 0, max).is_err());
        assert!(check_plan(&plan(&[0, 3], 0, max + 4), 3, 0, max).is_err());
        assert!(check_plan(&plan(&[0, 3], 0, 66), 3, 0, max).is_err());
        assert!(check_plan(&plan(&[1, 3], 0, 64), 3, 0, max).is_err());
        // A small run: every rank hears it from the coordinator, and from nobody else.
        let four = plan(&[0, 3, 5, 6], 0, 64);
        assert_eq!(check_plan(&four, 6, 0, max).unwrap(), 3);
        assert!(check_plan(&four, 6, 5, max).is_err());
        assert!(check_plan(&four, 6, 3, max).is_err());
        assert_eq!(plan_children_of(&four, 0).unwrap(), vec![5, 3, 6]);
        assert!(plan_children_of(&four, 2).unwrap().is_empty());
        // A large one, handed on down the plan's tree: node 22 (rank 20) hears it from node
        // 18 (rank 16), the coordinator's child, and from nobody else, the coordinator
        // included.
        let nodes: Vec<NodeId> = (2..26).collect();
        let big = plan(&nodes, 2, 64);
        assert_eq!(check_plan(&big, 22, 18, max).unwrap(), 20);
        assert!(check_plan(&big, 22, 2, max).is_err());
        assert!(check_plan(&big, 22, 6, max).is_err());
        assert_eq!(plan_children_of(&big, 0).unwrap(), vec![18, 10, 6, 4, 3]);
        assert_eq!(plan_children_of(&big, 16).unwrap(), vec![22, 20, 19]);
        // A reduce ends at its coordinator, which must be a main rank: of 6 ranks (4 main),
        // a coordinator at rank 3 is taken, one at rank 4 (an extra rank) refused.
        let mut six = plan(&[0, 3, 5, 6, 8, 9], 6, 64);
        six.reduce = true;
        assert_eq!(check_plan(&six, 9, 6, max).unwrap(), 5);
        six.coordinator = 8;
        assert!(check_plan(&six, 9, 8, max).is_err());
        six.reduce = false;
        assert_eq!(check_plan(&six, 9, 8, max).unwrap(), 5);
    }
}
