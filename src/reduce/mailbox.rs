//! Where the messages of halving-doubling allreduces wait for the rank that takes them: the
//! blocks partners pushed, the coordinator's last word, ranks' failure reports, the rank of
//! this node while it waits for a block (parked, so that the thread the block lands on
//! carries it on), its result, and how each run ended here (for the node's readers).
//! Bounded: a peer that floods it with blocks of runs nobody takes pushes out the oldest
//! runs (whose ranks then give up and the allreduce falls back to a tree), never the node's
//! memory.

use super::halving::RankState;
use crate::protocol::HalvingPlan;
use crate::ObjectId;
use crossbeam_channel::{Receiver, Sender};
use phalanx_transport::NodeId;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Bytes of blocks held for all runs together.
const MAX_BYTES: usize = 64 << 20;
/// Runs with something waiting here.
const MAX_RUNS: usize = 1024;
/// Ends remembered for readers.
const MAX_OUTCOMES: usize = 4096;
/// How often a wait looks again at whether the peers it depends on are alive.
const RECHECK: Duration = Duration::from_millis(20);

/// How a run ended on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The result is stored here under the target's name.
    Committed,
    /// Abandoned, or this node's rank failed: the target comes from elsewhere.
    Abandoned,
}

/// Why a wait ended without what it waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gave {
    /// The run was abandoned (the coordinator said so, or a rank reported failure).
    Abandoned,
    /// A peer it depends on is down.
    PeerDown,
    /// Nothing came for the whole wait.
    Timeout,
}

pub(crate) type RunKey = (ObjectId, u64);

/// This node's rank of a run, between two blocks.
pub(crate) struct Parked {
    pub plan: Arc<HalvingPlan>,
    pub state: Box<RankState>,
    /// Bytes of blocks this rank has sent (for the fault-injection hook).
    pub sent: u64,
    /// When the rank began, and when (us after) each step's block was taken: reported for a
    /// slow run.
    pub began: Instant,
    pub taken: Vec<(u32, u32)>,
}

impl Parked {
    /// The node and step of the block it waits for.
    fn waits_for(&self) -> Option<(NodeId, u32)> {
        let (rank, step) = self.state.waits_for()?;
        Some((self.plan.ranks.get(rank)?.0, step))
    }
}

/// What the coordinator's word asks of this node's rank.
pub(crate) enum End {
    /// Store and announce this result.
    Commit(Vec<u8>),
    /// Nothing yet (the rank is still running, or this is no rank of ours).
    Wait,
    /// Done here: the run was abandoned, or this rank had failed.
    Over,
}

struct RunBox {
    blocks: HashMap<(NodeId, u32), Vec<u8>>,
    bytes: usize,
    /// The coordinator's word (`commit`), with the node that said it.
    end: Option<(NodeId, bool)>,
    /// Ranks that reported failure.
    failed: Vec<NodeId>,
    /// The coordinator, once this node's rank is registered, and the digest of the plan it
    /// runs (a commit must name it).
    coordinator: Option<NodeId>,
    digest: Option<[u8; 16]>,
    /// This node's rank while it waits for a block.
    parked: Option<Parked>,
    /// This node's rank's result (or why it failed), once it has one, since when, and
    /// whether the coordinator was told (`HalvingDone`) that it is here with no word.
    result: Option<Result<Vec<u8>, String>>,
    result_at: Option<Instant>,
    said_done: bool,
    /// The coordinator's decision (on the coordinator's node): commit, or abandon.
    decided: Option<bool>,
    /// On the coordinator's node: the run's other ranks (whose `HalvingDone` may commit it),
    /// and when one of them did.
    others: Vec<NodeId>,
    committed_by_rank: Option<Instant>,
    /// On the coordinator's node: the size of the run's result.
    size: u64,
    /// When something last happened to the run here.
    touched: Instant,
}

impl Default for RunBox {
    fn default() -> Self {
        RunBox {
            blocks: HashMap::new(),
            bytes: 0,
            end: None,
            failed: Vec::new(),
            coordinator: None,
            digest: None,
            parked: None,
            result: None,
            result_at: None,
            said_done: false,
            decided: None,
            others: Vec::new(),
            committed_by_rank: None,
            size: 0,
            touched: Instant::now(),
        }
    }
}

#[derive(Default)]
struct State {
    runs: HashMap<RunKey, RunBox>,
    /// Runs in the order they appeared (the oldest is pushed out first).
    order: VecDeque<RunKey>,
    bytes: usize,
    /// How runs ended here (the newest `MAX_OUTCOMES`), with their coordinator when known:
    /// an abandoned run's readers get no plan once that node is down.
    outcomes: HashMap<RunKey, (Outcome, Option<NodeId>)>,
    outcome_order: VecDeque<RunKey>,
    /// Readers of a target told when a run into it commits here (`watch_commit`).
    watchers: HashMap<ObjectId, Vec<(u64, Sender<()>)>>,
    next_watch: u64,
}

impl State {
    fn run(&mut self, key: &RunKey) -> &mut RunBox {
        if !self.runs.contains_key(key) {
            self.runs.insert(key.clone(), RunBox::default());
            self.order.push_back(key.clone());
        }
        let b = self.runs.get_mut(key).expect("just made");
        b.touched = Instant::now();
        b
    }

    fn drop_run(&mut self, key: &RunKey) {
        if let Some(b) = self.runs.remove(key) {
            self.bytes -= b.bytes;
            self.order.retain(|k| k != key);
        }
    }

    /// Pushes out the oldest runs until the bounds hold.
    fn bound(&mut self) {
        while self.bytes > MAX_BYTES || self.runs.len() > MAX_RUNS {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some(b) = self.runs.remove(&old) {
                self.bytes -= b.bytes;
            }
        }
    }
}

#[derive(Default)]
pub(crate) struct Mailbox {
    state: Mutex<State>,
    changed: Condvar,
}

impl Mailbox {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap()
    }

    /// A block pushed by `from` for step `step` of run `run` into `target`. A second block
    /// for the same step from the same node replaces the first. Returns this node's rank if
    /// it was parked waiting for this very block: the caller carries it on.
    pub fn put_block(
        &self,
        target: ObjectId,
        run: u64,
        from: NodeId,
        step: u32,
        data: Vec<u8>,
    ) -> Option<Parked> {
        let mut st = self.lock();
        if data.len() > MAX_BYTES {
            return None;
        }
        let key = (target, run);
        let len = data.len();
        let b = st.run(&key);
        let old = b.blocks.insert((from, step), data).map_or(0, |d| d.len());
        b.bytes = b.bytes + len - old;
        let wakes = b
            .parked
            .as_ref()
            .is_some_and(|p| p.waits_for() == Some((from, step)));
        let parked = if wakes { b.parked.take() } else { None };
        st.bytes = st.bytes + len - old;
        st.bound();
        // No waiter needs a block (a parked rank is handed back instead; the coordinator's
        // wait looks at the run's time again within `RECHECK`): waking them for each block
        // cost the coordinator's node a thread switch per block.
        parked
    }

    /// The block `from` sent for `step`, if it is here (taken).
    pub fn try_take(&self, key: &RunKey, from: NodeId, step: u32) -> Option<Vec<u8>> {
        let mut st = self.lock();
        let b = st.runs.get_mut(key)?;
        let d = b.blocks.remove(&(from, step))?;
        b.bytes -= d.len();
        st.bytes -= d.len();
        Some(d)
    }

    /// Registers this node's rank of a run coordinated by `coordinator`, running the plan
    /// of digest `digest`. False if the coordinator abandoned the run already (its word
    /// came before the plan, which travels down the plan's tree): the rank is not to start.
    pub fn register(&self, key: &RunKey, coordinator: NodeId, digest: [u8; 16]) -> bool {
        let mut st = self.lock();
        let b = st.run(key);
        b.coordinator = Some(coordinator);
        b.digest = Some(digest);
        let abandoned = b.end == Some((coordinator, false));
        st.bound();
        if abandoned {
            drop(st);
            self.finish(key, Outcome::Abandoned);
        }
        !abandoned
    }

    /// Parks the rank until the block it waits for comes; hands it back at once if that
    /// block is here already (or the run is gone: it was pushed out or ended).
    pub fn park(&self, key: &RunKey, p: Parked) -> Option<Parked> {
        let mut st = self.lock();
        let Some(b) = st.runs.get_mut(key) else {
            return None; // ended, or pushed out: the rank stops here
        };
        if p.waits_for().is_some_and(|w| b.blocks.contains_key(&w)) {
            return Some(p);
        }
        b.parked = Some(p);
        None
    }

    /// This node's rank is done (`Err`: it failed). For a rank that does not coordinate,
    /// what the coordinator's word, if already here, asks of it.
    pub fn rank_finished(&self, key: &RunKey, result: Result<Vec<u8>, String>) -> End {
        let mut st = self.lock();
        let b = st.run(key);
        let word = b.end.filter(|e| Some(e.0) == b.coordinator).map(|e| e.1);
        let end = match (&result, word) {
            (Ok(v), Some(true)) => End::Commit(v.clone()),
            (_, Some(_)) | (Err(_), None) => End::Over,
            (Ok(_), None) => End::Wait,
        };
        b.result = Some(result);
        b.result_at = Some(Instant::now());
        self.changed.notify_all();
        end
    }

    /// Runs whose rank here has had its whole result for `late` with no word from its
    /// coordinator (a node other than `me`; once per run): (run, coordinator, plan digest),
    /// for a `HalvingDone`.
    pub fn waiting_for_word(&self, me: NodeId, late: Duration) -> Vec<(RunKey, NodeId, [u8; 16])> {
        let mut st = self.lock();
        let mut due = Vec::new();
        for (k, b) in st.runs.iter_mut() {
            let (Some(c), Some(d), Some(Ok(_)), Some(at)) =
                (b.coordinator, b.digest, &b.result, b.result_at)
            else {
                continue;
            };
            if c != me && b.end.is_none() && !b.said_done && at.elapsed() >= late {
                b.said_done = true;
                due.push((k.clone(), c, d));
            }
        }
        due
    }

    /// The coordinator decides how the run ends (`commit`, or abandon): true if this call
    /// decided it, false if it was decided already (the first decision stands).
    /// A run that ended here (its entry gone) stays decided; one pushed out before it was
    /// decided may still be abandoned, never committed.
    pub fn decide(&self, key: &RunKey, commit: bool) -> bool {
        let mut st = self.lock();
        if st.outcomes.contains_key(key) {
            return false;
        }
        let Some(b) = st.runs.get_mut(key) else {
            return !commit;
        };
        if b.decided.is_some() {
            return false;
        }
        b.decided = Some(commit);
        true
    }

    /// On the coordinator's node: whether the run was committed by this node's own rank
    /// (its thread lists this node's copy with the others'), not by another rank's word.
    pub fn committed_by_own_rank(&self, key: &RunKey) -> bool {
        let st = self.lock();
        st.runs
            .get(key)
            .is_some_and(|b| b.decided == Some(true) && b.committed_by_rank.is_none())
    }

    /// On the coordinator's node: the run's other ranks, any of which may commit the run by
    /// saying it has the whole result ([`Mailbox::rank_done`]).
    pub fn coordinate(&self, key: &RunKey, others: Vec<NodeId>, size: u64) {
        let mut st = self.lock();
        let b = st.run(key);
        b.others = others;
        b.size = size;
        st.bound();
    }

    /// On the coordinator's node: rank `from` has the whole result of the plan of digest
    /// `plan`. Commits the run if it is one this node coordinates, `from` is one of its
    /// ranks, the plan is the coordinator's and nothing was decided yet: then the ranks to
    /// tell, `from` first (it waits for the word), and the result's size. `None`: ignored
    /// (forged, late, or decided already).
    pub fn rank_done(
        &self,
        key: &RunKey,
        from: NodeId,
        plan: [u8; 16],
    ) -> Option<(Vec<NodeId>, u64)> {
        let mut st = self.lock();
        if st.outcomes.contains_key(key) {
            return None;
        }
        let b = st.runs.get_mut(key)?;
        if !b.others.contains(&from) || b.digest != Some(plan) || b.decided.is_some() {
            return None;
        }
        b.decided = Some(true);
        b.committed_by_rank = Some(Instant::now());
        let mut tell = vec![from];
        tell.extend(b.others.iter().copied().filter(|&n| n != from));
        let size = b.size;
        self.changed.notify_all();
        Some((tell, size))
    }

    /// The coordinator's last word on a run (kept with the node that said it), and what it
    /// asks of this node's rank. A commit counts only for the plan of digest `plan` (the one
    /// the coordinator made), and only once this node's rank runs it.
    pub fn put_end(
        &self,
        target: ObjectId,
        run: u64,
        from: NodeId,
        commit: bool,
        plan: [u8; 16],
    ) -> End {
        let mut st = self.lock();
        let key = (target, run);
        let b = st.run(&key);
        if b.coordinator.is_some_and(|c| c != from) {
            return End::Wait; // not its coordinator's word: ignored
        }
        if commit && b.digest != Some(plan) {
            return End::Wait; // not the plan this rank runs (or none yet): ignored
        }
        b.end = Some((from, commit));
        let end = match (&b.result, b.coordinator) {
            (Some(Ok(v)), Some(_)) if commit => End::Commit(v.clone()),
            (Some(_), Some(_)) => End::Over,
            (None, Some(_)) if !commit => End::Over,
            _ => End::Wait,
        };
        st.bound();
        self.changed.notify_all();
        end
    }

    /// Waits up to `wait` (from the last thing that happened to the run) for this node's
    /// rank's result, giving up as soon as `watch` says why.
    pub fn wait_result(
        &self,
        key: &RunKey,
        wait: Duration,
        watch: &dyn Fn(&RunView) -> Option<Gave>,
    ) -> Result<Result<Vec<u8>, String>, Gave> {
        let mut st = self.lock();
        loop {
            // Gone: swept (nothing happened for the wait) or pushed out.
            let b = st.runs.get_mut(key).ok_or(Gave::Abandoned)?;
            if let Some(r) = b.result.clone() {
                return Ok(r);
            }
            let since = b.touched;
            st = self.wait_once(st, key, since + wait, watch)?;
        }
    }

    /// Runs whose coordinator `is_down` says is gone, or where nothing happened for `idle`:
    /// ended here (abandoned), with their coordinators.
    pub fn sweep(&self, idle: Duration, is_down: &dyn Fn(NodeId) -> bool) -> Vec<(RunKey, NodeId)> {
        let mut st = self.lock();
        // Blocks of runs no rank here took up, for that long: dropped.
        let orphans: Vec<RunKey> = st
            .runs
            .iter()
            .filter(|(_, b)| b.coordinator.is_none() && b.touched.elapsed() > idle)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &orphans {
            st.drop_run(k);
        }
        let stale: Vec<(RunKey, NodeId)> = st
            .runs
            .iter()
            .filter_map(|(k, b)| {
                let c = b.coordinator?;
                (b.touched.elapsed() > idle || is_down(c)).then(|| (k.clone(), c))
            })
            .collect();
        drop(st);
        for (k, _) in &stale {
            self.finish(k, Outcome::Abandoned);
        }
        stale
    }

    /// Whether a run into `target` was abandoned here and its coordinator is down now.
    pub fn coordinator_died(&self, target: &ObjectId, is_down: &dyn Fn(NodeId) -> bool) -> bool {
        self.lock().outcomes.iter().any(|((t, _), (o, c))| {
            t == target && *o == Outcome::Abandoned && c.is_some_and(is_down)
        })
    }

    /// Whether any run waits here (for the dispatcher's tick).
    pub fn has_runs(&self) -> bool {
        !self.lock().runs.is_empty()
    }

    /// A rank reported that its part failed.
    pub fn put_failed(&self, target: ObjectId, run: u64, from: NodeId) {
        let mut st = self.lock();
        let key = (target, run);
        let b = st.run(&key);
        if !b.failed.contains(&from) {
            b.failed.push(from);
        }
        st.bound();
        self.changed.notify_all();
    }

    fn wait_once<'a>(
        &'a self,
        st: MutexGuard<'a, State>,
        key: &RunKey,
        deadline: Instant,
        watch: &dyn Fn(&RunView) -> Option<Gave>,
    ) -> Result<MutexGuard<'a, State>, Gave> {
        let view = RunView::of(st.runs.get(key));
        if let Some(g) = watch(&view) {
            return Err(g);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Gave::Timeout);
        }
        let slice = (deadline - now).min(RECHECK);
        Ok(self.changed.wait_timeout(st, slice).unwrap().0)
    }

    /// The run is over on this node: what it left here goes, its outcome stays for readers.
    pub fn finish(&self, key: &RunKey, outcome: Outcome) {
        let mut st = self.lock();
        let coordinator = st.runs.get(key).and_then(|b| b.coordinator);
        st.drop_run(key);
        if st
            .outcomes
            .get(key)
            .is_some_and(|o| o.0 == Outcome::Committed)
        {
            return; // a late word changes nothing
        }
        if outcome == Outcome::Committed {
            for (_, tx) in st.watchers.remove(&key.0).unwrap_or_default() {
                let _ = tx.try_send(());
            }
        }
        let known = st.outcomes.get(key).and_then(|o| o.1);
        if st
            .outcomes
            .insert(key.clone(), (outcome, coordinator.or(known)))
            .is_none()
        {
            st.outcome_order.push_back(key.clone());
            while st.outcome_order.len() > MAX_OUTCOMES {
                if let Some(old) = st.outcome_order.pop_front() {
                    st.outcomes.remove(&old);
                }
            }
        }
        self.changed.notify_all();
    }

    /// How the run ended here, waiting up to `wait`: its recorded outcome, or the
    /// coordinator `from`'s word that it was abandoned.
    pub fn wait_outcome(&self, key: &RunKey, from: NodeId, wait: Duration) -> Option<Outcome> {
        let deadline = Instant::now() + wait;
        let mut st = self.lock();
        loop {
            if let Some(o) = st.outcomes.get(key) {
                return Some(o.0);
            }
            if st.runs.get(key).and_then(|b| b.end) == Some((from, false)) {
                return Some(Outcome::Abandoned);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            st = self.changed.wait_timeout(st, deadline - now).unwrap().0;
        }
    }

    /// A reader's watch on `target`: its channel gets a word when a run into `target`
    /// commits on this node from now on (a run that committed before is found through its
    /// plan; an earlier run under the same name, deleted since, is no answer). Dropping the
    /// watch ends it.
    pub fn watch_commit(self: &Arc<Self>, target: &ObjectId) -> CommitWatch {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let mut st = self.lock();
        let id = st.next_watch;
        st.next_watch += 1;
        st.watchers
            .entry(target.clone())
            .or_default()
            .push((id, tx));
        CommitWatch {
            rx,
            mailbox: self.clone(),
            target: target.clone(),
            id,
        }
    }

    /// Bytes held, for tests.
    #[cfg(test)]
    fn held(&self) -> (usize, usize) {
        let st = self.lock();
        (st.bytes, st.runs.len())
    }
}

/// A reader's watch for a run into its target to commit here (see
/// [`Mailbox::watch_commit`]).
pub(crate) struct CommitWatch {
    pub rx: Receiver<()>,
    mailbox: Arc<Mailbox>,
    target: ObjectId,
    id: u64,
}

impl Drop for CommitWatch {
    fn drop(&mut self) {
        let mut st = self.mailbox.lock();
        if let Some(ws) = st.watchers.get_mut(&self.target) {
            ws.retain(|(id, _)| *id != self.id);
            if ws.is_empty() {
                st.watchers.remove(&self.target);
            }
        }
    }
}

/// What a waiter may look at while it waits: the failure reports of its run, and whether
/// another rank's word committed it.
pub(crate) struct RunView {
    pub failed: Vec<NodeId>,
    /// How long ago another rank's word committed the run (on its coordinator's node).
    pub committed_by_rank: Option<Duration>,
}

impl RunView {
    fn of(b: Option<&RunBox>) -> RunView {
        RunView {
            failed: b.map(|b| b.failed.clone()).unwrap_or_default(),
            committed_by_rank: b.and_then(|b| b.committed_by_rank).map(|t| t.elapsed()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{DType, ReduceOp};

    const D: [u8; 16] = [7; 16];

    fn key(t: &str, run: u64) -> RunKey {
        (ObjectId::new(t), run)
    }

    fn parked(coordinator: NodeId) -> Parked {
        let plan = HalvingPlan {
            target: "t".into(),
            run: 1,
            coordinator,
            ranks: vec![(0, "a".into()), (3, "b".into())],
            size: 8,
            op: ReduceOp::Sum,
            dtype: DType::I32,
            reduce: false,
        };
        let state = RankState::new(0, 2, vec![0; 8], (ReduceOp::Sum, DType::I32), None).unwrap();
        Parked {
            plan: Arc::new(plan),
            state: Box::new(state),
            sent: 0,
            began: Instant::now(),
            taken: Vec::new(),
        }
    }

    #[test]
    fn a_parked_rank_is_handed_to_the_block_it_waits_for() {
        let m = Mailbox::default();
        let k = key("t", 1);
        m.register(&k, 0, D);
        // Rank 0 of 2 waits for rank 1 (node 3), step 1, once its own send is done.
        let mut p = parked(0);
        p.state
            .advance(&mut |_, _, _| Ok(()), &mut |_, _| Ok(None))
            .unwrap();
        assert!(m.park(&k, p).is_none());
        // Another node's block, or another step, does not wake it.
        assert!(m.put_block("t".into(), 1, 4, 1, vec![0; 4]).is_none());
        assert!(m.put_block("t".into(), 1, 3, 2, vec![0; 4]).is_none());
        let mut p = m.put_block("t".into(), 1, 3, 1, vec![0; 4]).expect("woken");
        assert_eq!(m.try_take(&k, 3, 1), Some(vec![0; 4]));
        assert_eq!(m.try_take(&k, 3, 1), None);
        // A block already here: parking hands the rank straight back.
        p.state
            .advance(&mut |_, _, _| Ok(()), &mut |_, s| {
                Ok((s == 1).then(|| vec![0; 4]))
            })
            .unwrap();
        assert!(!p.state.is_done(), "waits for the allgather's block");
        assert!(m.put_block("t".into(), 1, 3, 2, vec![0; 4]).is_none());
        assert!(m.park(&k, p).is_some());
        m.finish(&k, Outcome::Committed);
        assert_eq!(m.held(), (0, 0));
        // A run gone (ended, pushed out): the rank is dropped, not parked.
        assert!(m.park(&k, parked(0)).is_none());
        assert_eq!(m.held(), (0, 0));
    }

    #[test]
    fn the_coordinators_word_decides_and_only_its() {
        let m = Mailbox::default();
        let k = key("t", 2);
        m.register(&k, 0, D);
        // A word from another node is kept but asks nothing.
        assert!(matches!(m.put_end("t".into(), 2, 7, true, D), End::Wait));
        assert!(matches!(m.rank_finished(&k, Ok(vec![1])), End::Wait));
        assert!(matches!(m.put_end("t".into(), 2, 0, true, D), End::Commit(v) if v == vec![1]));
        // The word before the result.
        let k3 = key("t", 3);
        m.register(&k3, 0, D);
        assert!(matches!(m.put_end("t".into(), 3, 0, true, D), End::Wait));
        assert!(matches!(m.rank_finished(&k3, Ok(vec![2])), End::Commit(_)));
        // Abandoned, or failed here: over.
        let k4 = key("t", 4);
        m.register(&k4, 0, D);
        assert!(matches!(m.put_end("t".into(), 4, 0, false, D), End::Over));
        assert_eq!(
            m.wait_outcome(&k4, 0, Duration::ZERO),
            Some(Outcome::Abandoned)
        );
        let k5 = key("t", 5);
        m.register(&k5, 0, D);
        assert!(matches!(m.rank_finished(&k5, Err("x".into())), End::Over));
        assert_eq!(m.wait_outcome(&key("t", 6), 0, Duration::ZERO), None);
    }

    #[test]
    fn the_coordinator_waits_for_its_result_or_gives_up() {
        let m = std::sync::Arc::new(Mailbox::default());
        let k = key("t", 1);
        m.register(&k, 0, D);
        let m2 = m.clone();
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            m2.rank_finished(&key("t", 1), Ok(vec![5]));
        });
        let r = m.wait_result(&k, Duration::from_secs(5), &|_| None);
        assert_eq!(r, Ok(Ok(vec![5])));
        h.join().unwrap();
        let k2 = key("t", 2);
        m.register(&k2, 0, D);
        m.put_failed("t".into(), 2, 5);
        let watch = |v: &RunView| (!v.failed.is_empty()).then_some(Gave::Abandoned);
        assert_eq!(
            m.wait_result(&k2, Duration::from_secs(5), &watch),
            Err(Gave::Abandoned)
        );
        let k3 = key("t", 3);
        m.register(&k3, 0, D);
        assert_eq!(
            m.wait_result(&k3, Duration::from_millis(10), &|_| None),
            Err(Gave::Timeout)
        );
        // Swept: idle, or its coordinator down.
        let swept = m.sweep(Duration::from_secs(60), &|n| n == 0);
        assert_eq!(swept.len(), 3);
        assert!(!m.has_runs());
    }

    #[test]
    fn the_first_decision_stands() {
        let m = Mailbox::default();
        let k = key("t", 7);
        m.register(&k, 0, D);
        assert!(m.decide(&k, true));
        assert!(!m.decide(&k, false));
        assert!(!m.decide(&k, true));
        let other = key("t", 8);
        m.register(&other, 0, D);
        assert!(m.decide(&other, false));
        assert!(!m.decide(&other, true));
        // Ended here (abandoned): a late commit is refused, the entry gone or not.
        m.finish(&other, Outcome::Abandoned);
        assert!(!m.decide(&other, true));
        // Never registered or pushed out: abandoned, never committed.
        assert!(!m.decide(&key("t", 9), true));
        assert!(m.decide(&key("t", 10), false));
    }

    #[test]
    fn a_rank_with_the_result_commits_once_and_only_a_rank_of_the_plan() {
        let m = Mailbox::default();
        let k = key("t", 1);
        m.register(&k, 0, D);
        m.coordinate(&k, vec![1, 2, 3], 8);
        // Not a rank, another plan, another run: ignored, nothing decided.
        assert_eq!(m.rank_done(&k, 9, D), None);
        assert_eq!(m.rank_done(&k, 2, [9; 16]), None);
        assert_eq!(m.rank_done(&key("t", 2), 2, D), None);
        // A rank of the plan: committed, that rank told first.
        assert_eq!(m.rank_done(&k, 2, D), Some((vec![2, 1, 3], 8)));
        // The first decision stands: a second word, the coordinator's own rank, an abandon.
        assert_eq!(m.rank_done(&k, 3, D), None);
        assert!(!m.decide(&k, true));
        assert!(!m.decide(&k, false));
        // Committed by a rank's word: the coordinator's copy was not listed with the others.
        assert!(!m.committed_by_own_rank(&k));
        // Committed by the coordinator's own rank: it was.
        let own = key("t", 5);
        m.register(&own, 0, D);
        m.coordinate(&own, vec![1, 2], 8);
        assert!(!m.committed_by_own_rank(&own));
        assert!(m.decide(&own, true));
        assert!(m.committed_by_own_rank(&own));
        assert_eq!(m.rank_done(&own, 1, D), None);
        assert!(m.committed_by_own_rank(&own));
        // Abandoned first: a late word commits nothing.
        let a = key("t", 3);
        m.register(&a, 0, D);
        m.coordinate(&a, vec![1, 2], 8);
        assert!(m.decide(&a, false));
        assert!(!m.committed_by_own_rank(&a));
        assert_eq!(m.rank_done(&a, 1, D), None);
        // A node that does not coordinate the run (no ranks given) commits nothing.
        let r = key("t", 4);
        m.register(&r, 5, D);
        assert_eq!(m.rank_done(&r, 1, D), None);
        assert!(m.decide(&r, false));
    }

    #[test]
    fn a_rank_long_done_without_a_word_says_so_once() {
        let m = Mailbox::default();
        let (k, failed, told, coord) = (key("t", 1), key("t", 2), key("t", 3), key("t", 4));
        for x in [&k, &failed, &told] {
            m.register(x, 5, D);
        }
        m.register(&coord, 0, D);
        m.coordinate(&coord, vec![1, 2], 8);
        assert!(
            m.waiting_for_word(0, Duration::ZERO).is_empty(),
            "no result yet"
        );
        assert!(matches!(m.rank_finished(&k, Ok(vec![1])), End::Wait));
        m.rank_finished(&failed, Err("partner gone".into()));
        m.rank_finished(&coord, Ok(vec![1]));
        assert!(matches!(m.put_end("t".into(), 3, 5, true, D), End::Wait));
        assert!(matches!(
            m.rank_finished(&told, Ok(vec![1])),
            End::Commit(_)
        ));
        // Not late yet.
        assert!(m.waiting_for_word(0, Duration::from_secs(60)).is_empty());
        // Late: only the rank with a result and no word, on a node that does not
        // coordinate the run (node 0 here); once.
        assert_eq!(
            m.waiting_for_word(0, Duration::ZERO),
            vec![(k.clone(), 5, D)]
        );
        assert!(m.waiting_for_word(0, Duration::ZERO).is_empty());
    }

    #[test]
    fn a_commit_counts_only_for_the_plan_the_rank_runs() {
        let m = Mailbox::default();
        let k = key("t", 11);
        // A commit before the plan is here: ignored (the coordinator could not have one).
        assert!(matches!(m.put_end("t".into(), 11, 0, true, D), End::Wait));
        assert!(m.register(&k, 0, D));
        assert!(matches!(m.rank_finished(&k, Ok(vec![4])), End::Wait));
        // The coordinator's commit of another plan (a forged one ran here): ignored.
        assert!(matches!(
            m.put_end("t".into(), 11, 0, true, [9; 16]),
            End::Wait
        ));
        assert!(matches!(m.put_end("t".into(), 11, 0, true, D), End::Commit(v) if v == vec![4]));
        // An abandon that came before the plan: the rank does not start.
        let k2 = key("t", 12);
        assert!(matches!(m.put_end("t".into(), 12, 0, false, D), End::Wait));
        assert!(!m.register(&k2, 0, D));
        assert_eq!(
            m.wait_outcome(&k2, 0, Duration::ZERO),
            Some(Outcome::Abandoned)
        );
    }

    #[test]
    fn a_commit_watch_hears_commits_of_its_target_only() {
        let m = std::sync::Arc::new(Mailbox::default());
        let w = m.watch_commit(&ObjectId::new("t"));
        // Another target's commit, or its own run abandoned: no word.
        m.finish(&key("u", 1), Outcome::Committed);
        m.finish(&key("t", 1), Outcome::Abandoned);
        assert!(w.rx.try_recv().is_err());
        m.finish(&key("t", 2), Outcome::Committed);
        assert!(w.rx.try_recv().is_ok());
        // A watch begun after the commit does not hear of it (the plan says).
        let late = m.watch_commit(&ObjectId::new("t"));
        assert!(late.rx.try_recv().is_err());
        // Dropped watches leave nothing behind.
        let w2 = m.watch_commit(&ObjectId::new("v"));
        let w3 = m.watch_commit(&ObjectId::new("v"));
        assert_eq!(
            m.lock().watchers.get(&ObjectId::new("v")).map(Vec::len),
            Some(2)
        );
        drop(w2);
        assert_eq!(
            m.lock().watchers.get(&ObjectId::new("v")).map(Vec::len),
            Some(1)
        );
        drop(w3);
        assert!(!m.lock().watchers.contains_key(&ObjectId::new("v")));
        drop(late);
        assert!(m.lock().watchers.is_empty());
    }

    #[test]
    fn a_flood_pushes_out_the_oldest_runs_within_the_bounds() {
        let m = Mailbox::default();
        for run in 0..(MAX_RUNS as u64 + 10) {
            m.put_block(ObjectId::new("flood"), run, 1, 0, vec![0; 1024]);
        }
        let (bytes, runs) = m.held();
        assert_eq!(runs, MAX_RUNS);
        assert_eq!(bytes, MAX_RUNS * 1024);
        // The oldest went, the newest stayed.
        assert!(m.try_take(&key("flood", 0), 1, 0).is_none());
        let last = MAX_RUNS as u64 + 9;
        assert!(m.try_take(&key("flood", last), 1, 0).is_some());
        // One huge block is refused outright.
        m.put_block(ObjectId::new("big"), 1, 1, 0, vec![0; MAX_BYTES + 1]);
        assert_eq!(m.held().1, MAX_RUNS);
    }

    /// A run abandoned here is remembered with its coordinator: once that node is down, its
    /// readers are to expect no plan; a committed run, or one whose coordinator lives, is
    /// no such news.
    #[test]
    fn an_abandoned_run_tells_whether_its_coordinator_died() {
        let m = Mailbox::default();
        m.register(&key("t", 1), 7, D);
        m.register(&key("u", 1), 8, D);
        assert!(!m.coordinator_died(&"t".into(), &|_| true), "not over yet");
        m.finish(&key("t", 1), Outcome::Abandoned);
        m.finish(&key("u", 1), Outcome::Committed);
        assert!(m.coordinator_died(&"t".into(), &|n| n == 7));
        assert!(!m.coordinator_died(&"t".into(), &|_| false), "7 is alive");
        assert!(!m.coordinator_died(&"u".into(), &|_| true), "committed");
        assert!(!m.coordinator_died(&"v".into(), &|_| true), "no run");
    }
}
