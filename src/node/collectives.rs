//! The collectives of the public API: reduce (blocking or started in the background) and
//! gather, on top of the reduce subsystem and `get` (allreduce: `allreduce.rs`).

use super::Node;
use crate::ops::{DType, ReduceOp};
use crate::protocol::Reply;
use crate::reduce::{Background, Hooks, ReduceHandle, ReduceOptions, ReduceOutcome};
use crate::{Error, ObjectId, Result};
use std::sync::{Arc, Condvar, Mutex};

/// Inputs from this size make a reduce long enough that its promise is sent at once.
const PROMISE_NOW_FROM: u64 = 1 << 20;

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
        let target = target.into();
        self.promised(&target, self.input_size(sources), |_| {
            // A halving reduce when it can run; else (or abandoned) a tree.
            let alive = match self.reduce_by_halving(&target, sources, num_objects, kind, opts)? {
                Ok(outcome) => return Ok(outcome),
                Err(alive) => alive,
            };
            let (sources, num) = match &alive {
                Some(live) => (&live[..], live.len()),
                None => (sources, num_objects),
            };
            self.inner
                .reducer
                .reduce(target.clone(), sources, num, kind, opts, Hooks::default())
        })
    }

    /// Runs `make`, which coordinates the making of `target`, under this node's promise to
    /// produce it ([`DirClient::promise`](crate::directory::DirClient::promise)), taken back
    /// if `make` fails: readers of a target whose coordinator died, or gave up, before any
    /// copy of it could complete are told it is lost instead of waiting out their timeout.
    /// `size`: the inputs' size if one is on this node ([`Node::input_size`]).
    pub(super) fn promised<T>(
        &self,
        target: &ObjectId,
        size: Option<u64>,
        make: impl FnOnce(&dyn Fn()) -> Result<T>,
    ) -> Result<T> {
        // Sent at once for an operation that may take long: large, or its inputs elsewhere
        // (its coordinator may wait for them); else after `PROMISE_AFTER`.
        let long = size.is_none_or(|s| s >= PROMISE_NOW_FROM);
        /// Ends the promise however `make` ends: well, with an error, or a panic (taken back
        /// then too, and never left pending).
        struct Ends<'a> {
            dir: &'a crate::directory::DirClient,
            token: Option<u64>,
            ok: bool,
        }
        impl Drop for Ends<'_> {
            fn drop(&mut self) {
                self.dir.end_promise(self.token, self.ok);
            }
        }
        let mut ends = Ends {
            dir: &self.inner.dir,
            token: self.inner.dir.promise(target, long),
            ok: false,
        };
        // `make` may say the target is made before it returns (a tree that will not be
        // repaired has finished): the promise ends there, as a complete copy ends it at the
        // shard, and is not made again where the entry moves if that copy's node dies.
        let (dir, token) = (&self.inner.dir, ends.token);
        let r = make(&|| dir.end_promise(token, true));
        ends.ok = r.is_ok();
        r
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
        let target = target.into();
        // Promised at once (a reduce started to run beside the caller's work), until the
        // reduce ends; taken back if it fails, or if it cannot start.
        let dir = self.inner.dir.clone();
        let token = dir.promise(&target, true);
        let ended = Box::new(move |ok| dir.end_promise(token, ok));
        let r = self.inner.reducer.start(
            target,
            sources,
            num_objects,
            kind,
            opts,
            Background {
                ended: Some(ended),
                ..Background::default()
            },
        );
        if r.is_err() {
            self.inner.dir.end_promise(token, false);
        }
        r
    }

    /// Gets several objects concurrently (a gather at this node). Every object is asked for
    /// at once with a subscription, whose answer carries a small object's bytes: small objects
    /// cost one concurrent round of messages; large ones (and any whose shard died meanwhile)
    /// are then pulled concurrently.
    pub fn gather(&self, ids: &[ObjectId]) -> Result<Vec<Vec<u8>>> {
        let inner = &self.inner;
        let mut out: Vec<Option<Vec<u8>>> = vec![None; ids.len()];
        // Every answer lands in `answers`; the caller is woken once, by the last one.
        let asked: Vec<usize> = (0..ids.len())
            .filter(|&k| inner.store.lookup(&ids[k]).is_none()) // a local copy is read below
            .collect();
        let answers = Arc::new(Answers::new(ids.len(), asked.len()));
        for &k in &asked {
            let a = answers.clone();
            let on_reply = Box::new(move |r: Result<Reply>| a.answer(k, r));
            if let Err(e) = inner.dir.subscribe_then(&ids[k], on_reply) {
                answers.answer(k, Err(e));
            }
        }
        let deadline = std::time::Instant::now() + inner.cfg.op_timeout;
        // A subscription waits for an object to be put (again): one whose every copy died is
        // found by asking, whenever the answers stall, as a get would be told.
        let slots = loop {
            let slice = (std::time::Instant::now() + GATHER_STALL).min(deadline);
            match answers.wait_until(slice) {
                Ok(slots) => break slots,
                Err(_) if std::time::Instant::now() >= deadline => {
                    let what = format!("{} objects to appear", ids.len());
                    return Err(Error::Timeout(inner.cfg.op_timeout, what));
                }
                Err(missing) => {
                    // Those asked only: a local copy is read below.
                    for k in missing.into_iter().filter(|k| asked.contains(k)) {
                        if self
                            .locate(ids[k].clone())
                            .ok()
                            .flatten()
                            .is_some_and(|i| i.lost)
                        {
                            return Err(Error::ObjectLost(ids[k].clone()));
                        }
                    }
                }
            }
        };
        for (k, r) in slots.into_iter().enumerate() {
            match r {
                None => {}
                Some(Ok(Reply::InfoInline(_, data))) => out[k] = Some(data),
                Some(Ok(Reply::Info(None))) => return Err(Error::NotFound(ids[k].clone())),
                Some(Ok(Reply::Info(Some(_))) | Err(Error::PeerDown(_))) => {}
                Some(Ok(r)) => return Err(inner.rpc.unexpected(r)),
                Some(Err(e)) => return Err(e),
            }
        }
        // Complete copies here (this node's own input) are read on this thread; the others
        // (large objects, or copies still filling) are fetched at once, on the node's workers
        // when there are several.
        for (id, o) in ids.iter().zip(&mut out).filter(|(_, o)| o.is_none()) {
            let here = inner.store.lookup(id);
            if here.is_some_and(|c| c.status() == crate::store::CopyStatus::Complete) {
                *o = Some(self.get(id.clone())?);
            }
        }
        let mut rest: Vec<(&ObjectId, &mut Option<Vec<u8>>)> = ids
            .iter()
            .zip(&mut out)
            .filter(|(_, o)| o.is_none())
            .collect();
        if let [(id, o)] = rest.as_mut_slice() {
            **o = Some(self.get((*id).clone())?);
        } else {
            // On the node's workers (no thread made per object), the last one on this thread.
            let last = rest.pop();
            let jobs = rest.iter().map(|(id, _)| {
                let (node, id) = (self.clone(), (*id).clone());
                Box::new(move || node.get(id)) as Box<dyn FnOnce() -> Result<Vec<u8>> + Send>
            });
            let fetches = self.on_workers(jobs);
            if let Some((id, o)) = last {
                *o = Some(self.get(id.clone())?);
            }
            for ((_, o), f) in rest.into_iter().zip(&fetches) {
                *o = Some(Node::joined(f, "a gather's fetch")?);
            }
        }
        Ok(out.into_iter().map(|o| o.expect("every object")).collect())
    }
}

/// How long a gather waits for its subscriptions' answers before it asks whether a missing
/// object was lost.
const GATHER_STALL: std::time::Duration = std::time::Duration::from_millis(500);

/// Every answer of a gather, by position (`None`: not asked: a local copy is read).
type Answered = Vec<Option<Result<Reply>>>;

/// The subscription answers of one gather, and the wake-up of its caller once all are in.
struct Answers {
    /// The answers by position, and how many are still to come.
    state: Mutex<(Vec<Option<Result<Reply>>>, usize)>,
    all_in: Condvar,
}

impl Answers {
    fn new(len: usize, missing: usize) -> Answers {
        Answers {
            state: Mutex::new(((0..len).map(|_| None).collect(), missing)),
            all_in: Condvar::new(),
        }
    }

    /// Runs where the answer lands (a transport thread): never blocks for long.
    fn answer(&self, k: usize, r: Result<Reply>) {
        let mut st = self.state.lock().unwrap();
        if st.0[k].is_some() {
            return;
        }
        st.0[k] = Some(r);
        st.1 -= 1;
        if st.1 == 0 {
            self.all_in.notify_all();
        }
    }

    /// The answers, once every one came in before `deadline`; else the positions still
    /// missing.
    fn wait_until(&self, deadline: std::time::Instant) -> Result<Answered, Vec<usize>> {
        let mut st = self.state.lock().unwrap();
        while st.1 > 0 {
            let now = std::time::Instant::now();
            if now >= deadline {
                let missing = (0..st.0.len()).filter(|&k| st.0[k].is_none());
                return Err(missing.collect());
            }
            st = self.all_in.wait_timeout(st, deadline - now).unwrap().0;
        }
        Ok(std::mem::take(&mut st.0))
    }
}
