//! Dynamic tree reduce. The caller coordinates: it subscribes to every source in the
//! directory, places each source that becomes ready into a d-ary tree in arrival order
//! (generalised in-order: first child, the node itself, then children 2..d), stops at
//! `num_objects`, and tells each inner position to compute `own ⊕ children` into an
//! intermediate object that its parent pulls while it fills. The root writes the target, which
//! is published as a partial copy from its first byte, so readers overlap with the reduce.

//!
//! `Reducer` is the reduce subsystem of one node: it coordinates the reduces started here and
//! runs the tasks coordinators send here. It is handed the messaging, the directory client,
//! membership, the store and the transfer engine (tasks pull their inputs).

mod claims;
mod coordinator;
mod halving;
mod halving_run;
mod mailbox;
mod run;
mod task;
mod tree;

pub use claims::SourceClaims;
pub(crate) use halving_run::{Ran as HalvingRan, MAX_RANKS as MAX_HALVING_RANKS};
pub(crate) use mailbox::Outcome as HalvingOutcome;
pub use tree::{choose_degree, Tree};

use crate::config::NodeConfig;
use crate::directory::DirClient;
use crate::membership::Membership;
use crate::ops::{DType, ReduceOp};
use crate::protocol::{GatherFrom, ReduceMsg};
use crate::rpc::Rpc;
use crate::store::Store;
use crate::transfer::Transfers;
use crate::workers::Workers;
use crate::{Error, ObjectId, Result};
use crossbeam_channel::{Receiver, Sender};
use phalanx_transport::NodeId;
use std::sync::Arc;
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
    /// Reduce only bytes `[lo, hi)` of every source (one partition of a partitioned
    /// allreduce): the target has `hi - lo` bytes. Every position then runs a task, leaves
    /// included (a leaf's output is its slice, not its whole source).
    pub range: Option<(u64, u64)>,
    /// Rotates the in-order placement by this many positions: the k-th source to arrive takes
    /// position `inorder[(k + rotate) % n]`. Partitions reduced side by side with rotations
    /// 0, 1, ... have their roots, and their leaves, on different nodes.
    pub rotate: usize,
    /// The tree is a [`Tree::by_arrival`] rooted at the `rotate`-th arrival (`degree`
    /// unused): for a partition of an allreduce whose inputs come one after another.
    pub by_arrival: bool,
}

impl Default for ReduceOptions {
    fn default() -> Self {
        ReduceOptions {
            degree: None,
            chunk: 1 << 20,
            timeout: None,
            required: Vec::new(),
            claims: None,
            range: None,
            rotate: 0,
            by_arrival: false,
        }
    }
}

/// A reduce running in the background ([`Node::reduce_start`]).
pub struct ReduceHandle {
    placed: Receiver<Vec<ObjectId>>,
    /// The coordinator's result, sent once as it returns.
    done: Receiver<Result<ReduceOutcome>>,
    /// Set by the coordinator's thread once its result is sent.
    finished: Arc<std::sync::atomic::AtomicBool>,
}

/// The error of a reduce input of `has` bytes where the others have `others`.
pub(crate) fn other_size(input: &ObjectId, has: u64, others: u64) -> Error {
    Error::InvalidArgument(format!(
        "reduce input {input} has {has} bytes, others {others}"
    ))
}

/// `InvalidArgument` if a source is named twice.
pub(crate) fn distinct(sources: &[ObjectId]) -> Result<()> {
    let mut uniq: Vec<&ObjectId> = sources.iter().collect();
    uniq.sort();
    uniq.dedup();
    match uniq.len() == sources.len() {
        true => Ok(()),
        false => Err(Error::InvalidArgument("duplicate reduce sources".into())),
    }
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

    /// Whether the result is ready (or was already taken by [`ReduceHandle::wait_timeout`]).
    pub fn is_finished(&self) -> bool {
        self.finished.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Waits for the reduce to finish.
    pub fn wait(self) -> Result<ReduceOutcome> {
        self.done.recv().unwrap_or_else(|_| Err(Self::gone()))
    }

    /// Waits up to `timeout` for the reduce to finish: `None` if it is still running. The
    /// result is handed out once; a later call returns an error saying so.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<ReduceOutcome>> {
        match self.done.recv_timeout(timeout) {
            Ok(r) => Some(r),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => None,
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Some(Err(Self::gone())),
        }
    }

    fn gone() -> Error {
        Error::InvalidArgument(
            "the reduce's result was already taken, or its thread panicked".into(),
        )
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
    /// Partitions reduced side by side (a partitioned allreduce; 1 otherwise), each by a tree
    /// of this degree; `tree` is the first partition's.
    pub partitions: usize,
    /// The trees were shaped by the inputs' arrival ([`Tree::by_arrival`]; `degree` is then
    /// the first partition's root's children).
    pub by_arrival: bool,
}

/// What a caller of a reduce hears while it runs.
#[derive(Default)]
pub(crate) struct Hooks {
    /// The inputs, once every position of the tree has a source.
    pub placed: Option<Sender<Vec<ObjectId>>>,
    /// Runs once at that moment too, after the allgather hints of a partition's tree went
    /// out (`Run::gather_hints`).
    pub on_placed: Option<Box<dyn FnOnce() + Send>>,
    /// Runs once when the first task is dispatched: the result is computed by a tree
    /// (remote nodes), not combined at the coordinator from small inputs.
    pub on_tree: Option<Box<dyn FnOnce() + Send>>,
    /// A finished reduce keeps repairing its tree until this says so (a message, or its
    /// sender dropped): its result's only complete copy may be its root's for a while, and
    /// a root that dies then is computed again, the same inputs in the same positions (the
    /// same bytes), its readers starting over. `None`: the reduce ends as it finishes.
    pub hold: Option<Receiver<()>>,
}

/// How a reduce started in the background ([`Reducer::start`]) ends.
#[derive(Default)]
pub(crate) struct Background {
    /// Told on the reduce's thread whether it made its target.
    pub ended: Option<Box<dyn FnOnce(bool) + Send>>,
    /// See [`Hooks::on_placed`].
    pub placed: Option<Box<dyn FnOnce() + Send>>,
    /// See [`Hooks::hold`].
    pub hold: Option<Receiver<()>>,
}

/// What the reduce subsystem is handed by its node.
pub(crate) struct ReduceDeps {
    pub cfg: NodeConfig,
    pub rpc: Arc<Rpc>,
    pub dir: Arc<DirClient>,
    pub members: Arc<Membership>,
    pub store: Arc<Store>,
    pub transfers: Arc<Transfers>,
    pub workers: Arc<Workers>,
}

/// The reduce subsystem of one node.
pub(crate) struct Reducer {
    id: NodeId,
    cfg: NodeConfig,
    rpc: Arc<Rpc>,
    dir: Arc<DirClient>,
    members: Arc<Membership>,
    store: Arc<Store>,
    transfers: Arc<Transfers>,
    /// Where tasks run.
    workers: Arc<Workers>,
    tasks: task::Tasks,
    /// Blocks and words of halving-doubling allreduces (`halving_run`).
    halving: Arc<mailbox::Mailbox>,
}

impl Reducer {
    /// Where to fetch partition `part` of a partitioned allreduce from, as its coordinator
    /// said; waits up to `wait` for the word.
    pub fn gather_hint(&self, part: &ObjectId, wait: Duration) -> Option<GatherFrom> {
        self.transfers.hints().take(part, wait)
    }

    pub fn new(d: ReduceDeps) -> Reducer {
        Reducer {
            id: d.rpc.id(),
            cfg: d.cfg,
            rpc: d.rpc,
            dir: d.dir,
            members: d.members,
            store: d.store,
            transfers: d.transfers,
            workers: d.workers,
            tasks: task::Tasks::default(),
            halving: Arc::new(mailbox::Mailbox::default()),
        }
    }

    /// A message of the reduce family from `from`.
    pub fn handle(self: &Arc<Self>, from: NodeId, msg: ReduceMsg) {
        match msg {
            ReduceMsg::Task { rid, task } => self.start_task(from, rid, task),
            ReduceMsg::Cancel { out, attempt } => self.cancel_task(from, &out, attempt),
            ReduceMsg::Gather { part, from } => self.transfers.hints().record(&part, from),
            ReduceMsg::HalvingTask { plan } => self.start_halving(from, plan),
            ReduceMsg::HalvingBlock {
                target,
                run,
                step,
                data,
            } => self.halving_block(from, target, run, step, data),
            ReduceMsg::HalvingEnd {
                target,
                run,
                commit,
                plan,
            } => self.halving_end(from, target, run, commit, plan),
            ReduceMsg::HalvingFailed { target, run } => self.halving.put_failed(target, run, from),
            ReduceMsg::HalvingDone { target, run, plan } => {
                self.halving_done(from, target, run, plan)
            }
        }
    }

    /// Runs one reduce, coordinated from this node, to the end; `hooks` hear of its progress.
    pub(crate) fn reduce(
        &self,
        target: ObjectId,
        sources: &[ObjectId],
        num: usize,
        kind: (ReduceOp, DType),
        opts: &ReduceOptions,
        hooks: Hooks,
    ) -> Result<ReduceOutcome> {
        self.coordinate_reduce(target, sources, num, kind, opts, hooks)
    }

    /// Starts a reduce coordinated from this node on a worker of the node's pool; `how` says
    /// who is told as it ends, and how long its tree is repaired.
    pub fn start(
        self: &Arc<Self>,
        target: ObjectId,
        sources: Vec<ObjectId>,
        num: usize,
        kind: (ReduceOp, DType),
        opts: ReduceOptions,
        how: Background,
    ) -> Result<ReduceHandle> {
        let Background {
            ended,
            placed,
            hold,
        } = how;
        let me = self.clone();
        let (tx, rx): (Sender<Vec<ObjectId>>, _) = crossbeam_channel::bounded(1);
        let (done_tx, done) = crossbeam_channel::bounded(1);
        let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = finished.clone();
        // On the node's workers: steady traffic starts no thread per reduce.
        self.workers
            .spawn(move || {
                let hooks = Hooks {
                    placed: Some(tx),
                    on_placed: placed,
                    on_tree: None,
                    hold,
                };
                let r = me.coordinate_reduce(target, &sources, num, kind, &opts, hooks);
                if let Some(ended) = ended {
                    ended(r.is_ok());
                }
                // The handle may be gone: nobody waits for the result then.
                let _ = done_tx.send(r);
                flag.store(true, std::sync::atomic::Ordering::Release);
            })
            .map_err(|e| Error::Config(format!("spawn a reduce coordinator: {e}")))?;
        Ok(ReduceHandle {
            placed: rx,
            done,
            finished,
        })
    }
}
