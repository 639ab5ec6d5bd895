//! A node: store, directory shard, transfer engine, reduce subsystem and transport tied
//! together, and the public API. `start.rs` wires the subsystems and stops them,
//! `dispatch.rs` routes transport events and messages to them by family, `collectives.rs` is
//! the reduce/allreduce/gather API, `writer.rs` objects written in place. Each subsystem owns
//! its state; the node only holds them.

pub mod allreduce;
mod collectives;
mod dispatch;
mod gossip;
pub mod halving;
mod start;
mod writer;

use crate::config::{NodeConfig, INLINE_LIMIT};
use crate::directory::{Assignment, DirClient, Shard};
use crate::fault::{FaultHook, FaultPlan};
use crate::hop::hop;
use crate::membership::Membership;
use crate::protocol::ObjectInfo;
use crate::reduce::Reducer;
use crate::rpc::Rpc;
use crate::store::{CopyStatus, Store};
use crate::transfer::{Driver, Transfers};
use crate::view::{Fetched, ObjectReader, ObjectView};
use crate::{Error, ObjectId, Result};
use crossbeam_channel::Receiver;
use phalanx_transport::{NodeId, Transport, TransportStats};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

pub use crate::transfer::{ServeRecord, TransferRecord};
pub use writer::ObjectWriter;

/// Extra fetches a `get` makes when the copy it reads is dropped under it.
const FETCH_ATTEMPTS: u32 = 3;

/// Runs a fetch again when the copy it read was dropped under it: deleted (the next try says
/// so at once), or reset because its producer recomputes it (the next try waits for it); not
/// once `deadline` has passed: a get's op timeout bounds all its attempts together.
fn refetching<T>(deadline: Instant, mut fetch: impl FnMut() -> Result<T>) -> Result<T> {
    let mut attempt = 0;
    loop {
        match fetch() {
            Err(Error::NotFound(_)) if attempt < FETCH_ATTEMPTS && Instant::now() < deadline => {
                attempt += 1
            }
            r => return r,
        }
    }
}

/// The subsystems of one node. Each owns its state; this struct only holds them together
/// for the facade and the dispatcher.
pub(crate) struct Inner {
    id: NodeId,
    cfg: NodeConfig,
    transport: Arc<dyn Transport>,
    store: Arc<Store>,
    /// This node's directory shard.
    shard: Mutex<Shard>,
    rpc: Arc<Rpc>,
    members: Arc<Membership>,
    dir: Arc<DirClient>,
    transfers: Arc<Transfers>,
    reducer: Arc<Reducer>,
    fault: Arc<FaultHook>,
    /// The node's pooled threads, for API calls that need a second one (allreduce).
    workers: Arc<crate::workers::Workers>,
    /// Allreduce partitions pulled straight into their place in this node's copy of the
    /// result (no copy afterwards; `Node::assemble`).
    placed_parts: std::sync::atomic::AtomicU64,
    /// Allreduce partitions read where the directory said because no hint came for them.
    unhinted_parts: std::sync::atomic::AtomicU64,
}

/// A Phalanx node. Cheap to clone; every clone is the same node.
#[derive(Clone)]
pub struct Node {
    inner: Arc<Inner>,
    dispatcher: Arc<Mutex<Option<JoinHandle<()>>>>,
}

impl Node {
    pub fn id(&self) -> NodeId {
        self.inner.id
    }

    pub fn num_nodes(&self) -> u32 {
        self.inner.members.nodes()
    }

    pub fn config(&self) -> &NodeConfig {
        &self.inner.cfg
    }

    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.inner.transport
    }

    /// Where the node's transport listens, if it does.
    pub fn listen_addr(&self) -> Option<std::net::SocketAddr> {
        self.inner.transport.listen_addr()
    }

    pub fn transport_stats(&self) -> TransportStats {
        self.inner.transport.stats()
    }

    /// Stores an immutable object. Small objects go inline into the directory; large ones are
    /// published as a partial copy first, so receivers can stream them while they copy in.
    pub fn put(&self, id: impl Into<ObjectId>, data: &[u8]) -> Result<()> {
        let id = id.into();
        let inner = &self.inner;
        let size = data.len() as u64;
        if size < INLINE_LIMIT {
            return self.put_small(&id, data, || inner.dir.put_inline(&id, data));
        }
        // Written in place from `data` (`writer.rs`): copied in a step at a time, each passed
        // on to receivers that pull it already (see `transfer/serve.rs`), then sealed.
        let mut w = self.create(id, size)?;
        // Published partial first only when the copy-in takes more than one step: readers
        // then stream it while it is written. A single step is done before a reader could
        // act on the partial entry, so one message announces it complete.
        if size > self.put_step() {
            w.announce()?;
        }
        w.write(data)?;
        w.seal()
    }

    /// Stores a small object's local copy (pinned, as every put's) and sends its bytes to
    /// the directory with `announce`; the copy is dropped again if that fails.
    pub(crate) fn put_small<T>(
        &self,
        id: &ObjectId,
        data: &[u8],
        announce: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        debug_assert!((data.len() as u64) < INLINE_LIMIT);
        let inner = &self.inner;
        let (copy, evicted) = inner.store.create(id, data.len() as u64, true)?;
        inner.dir.withdraw(&evicted);
        copy.append(data)?;
        drop(copy);
        announce().inspect_err(|_| {
            inner.store.delete(id);
        })
    }

    /// Fetches a copy of the object's bytes, waiting for the object to be put if needed.
    pub fn get(&self, id: impl Into<ObjectId>) -> Result<Vec<u8>> {
        let id = id.into();
        refetching(Instant::now() + self.inner.cfg.op_timeout, || {
            self.get_once(&id)
        })
    }

    fn get_once(&self, id: &ObjectId) -> Result<Vec<u8>> {
        let mut r = self.get_stream(id.clone())?;
        let mut out = vec![0u8; r.size() as usize];
        use std::io::Read;
        r.read_exact(&mut out).map_err(|e| match e.into_inner() {
            Some(inner) => match inner.downcast::<Error>() {
                Ok(e) => *e,
                Err(e) => Error::Protocol {
                    peer: self.id(),
                    what: e.to_string(),
                },
            },
            None => Error::Protocol {
                peer: self.id(),
                what: "short read".into(),
            },
        })?;
        Ok(out)
    }

    /// A zero-copy read-only view of the complete object in the local arena.
    pub fn get_view(&self, id: impl Into<ObjectId>) -> Result<ObjectView> {
        self.get_view_excluding(id, &[], None)
    }

    /// [`Node::get_view`] that gives up after `timeout` (`Error::Timeout`) instead of the
    /// node's op timeout. A pull already under way goes on in the background (its copy stays
    /// here for a later get); a lookup still waiting at the directory is withdrawn.
    pub fn get_view_timeout(
        &self,
        id: impl Into<ObjectId>,
        timeout: std::time::Duration,
    ) -> Result<ObjectView> {
        self.get_view_excluding(id, &[], Some(timeout))
    }

    /// Like [`Node::get_view`], pulling only from `source` (no tree): the star baseline of a
    /// task system without collectives.
    pub fn get_view_from(&self, id: impl Into<ObjectId>, source: NodeId) -> Result<ObjectView> {
        let others: Vec<NodeId> = (0..self.inner.members.nodes())
            .filter(|&n| n != source)
            .collect();
        self.get_view_excluding(id, &others, None)
    }

    /// With a `timeout` the pull runs on a worker and the caller stops waiting at its
    /// deadline; without, the caller drives the pull itself (one hand-off less).
    fn get_view_excluding(
        &self,
        id: impl Into<ObjectId>,
        exclude: &[NodeId],
        timeout: Option<std::time::Duration>,
    ) -> Result<ObjectView> {
        let id = id.into();
        let op_timeout = self.inner.cfg.op_timeout;
        let (deadline, driver) = match timeout {
            Some(t) => (Instant::now() + t.min(op_timeout), Driver::Worker),
            None => (Instant::now() + op_timeout, Driver::Caller),
        };
        refetching(deadline, || {
            match self
                .inner
                .transfers
                .fetch_until(&id, exclude, driver, deadline)?
            {
                Fetched::Owned(v) => Ok(ObjectView::Owned(v)),
                Fetched::Copy(c) => {
                    // Without a timeout: at most the op timeout without progress.
                    c.wait_complete(op_timeout, timeout.map(|_| deadline))?;
                    Ok(ObjectView::Arena(c))
                }
            }
        })
    }

    /// Like [`Node::get_view`], pulling from `source` at once (it holds or fetches `id`, of
    /// `size` bytes, before this node: `Transfers::fetch_from`). A pull that fails, or makes
    /// no progress for `stall` (the hint was stale), is given up: its copy fails (so nothing
    /// waits on it) and the directory chooses a source.
    /// `otherwise` reads it when the hint fails (`Node::get_view`, or a variant). With
    /// `into`, the pull lands within that copy, at that offset (`Transfers::fetch_from`).
    pub(crate) fn get_view_via(
        &self,
        id: &ObjectId,
        source: NodeId,
        (size, into): (u64, Option<(&crate::store::CopyRef, u64)>),
        stall: std::time::Duration,
        otherwise: impl Fn() -> Result<ObjectView>,
    ) -> Result<ObjectView> {
        let c = match self.inner.transfers.fetch_from(id, source, size, into) {
            Ok(Fetched::Owned(v)) => return Ok(ObjectView::Owned(v)),
            Ok(Fetched::Copy(c)) => c,
            Err(_) => return otherwise(),
        };
        match c.wait_complete(stall, None) {
            Ok(()) => Ok(ObjectView::Arena(c)),
            Err(e) => {
                hop!(self.id(), "hinted pull dropped", source = source);
                tracing::debug!(node = self.id(), %id, source, "hinted pull dropped: {e}");
                if c.status() != CopyStatus::Complete {
                    c.fail();
                    self.inner.dir.withdraw(std::slice::from_ref(id));
                }
                drop(c);
                otherwise()
            }
        }
    }

    /// A reader that returns bytes as soon as they have arrived.
    pub fn get_stream(&self, id: impl Into<ObjectId>) -> Result<ObjectReader> {
        let src = self.inner.transfers.fetch(&id.into())?;
        Ok(ObjectReader {
            src,
            pos: 0,
            timeout: self.inner.cfg.op_timeout,
        })
    }

    /// Removes the object from every node and from the directory.
    pub fn delete(&self, id: impl Into<ObjectId>) -> Result<()> {
        self.inner.dir.delete(&id.into())
    }

    /// Drops this node's copy of `id` unless it is a pinned `put` copy, and withdraws it from
    /// the directory; returns whether a copy was dropped. Other copies are untouched.
    pub fn evict_local(&self, id: impl Into<ObjectId>) -> bool {
        let id = id.into();
        match self.inner.store.info(&id) {
            Some(i) if !i.pinned && i.status == CopyStatus::Complete => {
                self.inner.store.delete(&id);
                self.inner.dir.withdraw(std::slice::from_ref(&id));
                true
            }
            _ => false,
        }
    }

    /// Runs each job at once on the node's worker pool (steady traffic creates no thread: an
    /// idle worker takes it) and returns a receiver per job, in order, for its result. A job
    /// that no worker could be started for runs on the caller's thread before this returns;
    /// a job that panicked ends its receiver without a result (see [`Node::joined`]).
    pub(crate) fn on_workers<T: Send + 'static>(
        &self,
        jobs: impl IntoIterator<Item = Box<dyn FnOnce() -> Result<T> + Send>>,
    ) -> Vec<Receiver<Result<T>>> {
        jobs.into_iter()
            .map(|job| {
                let (tx, rx) = crossbeam_channel::bounded(1);
                let slot = Arc::new(Mutex::new(Some(job)));
                let taken = slot.clone();
                let sent = tx.clone();
                let started = self.inner.workers.spawn(move || {
                    if let Some(job) = taken.lock().expect("job slot").take() {
                        let _ = sent.send(job());
                    }
                });
                if let Err(e) = started {
                    tracing::warn!(
                        node = self.id(),
                        "no worker for a job ({e}); run on the caller"
                    );
                    if let Some(job) = slot.lock().expect("job slot").take() {
                        let _ = tx.send(job());
                    }
                }
                rx
            })
            .collect()
    }

    /// The result of a job started by [`Node::on_workers`] (`what` names it in the error of
    /// one that panicked).
    pub(crate) fn joined<T>(rx: &Receiver<Result<T>>, what: &str) -> Result<T> {
        rx.recv()
            .unwrap_or_else(|_| Err(Error::InvalidArgument(format!("{what} panicked"))))
    }

    /// Whether this node believes `peer` dead (its link failed, or, with links made on
    /// demand, its watchers said so).
    pub fn believes_down(&self, peer: NodeId) -> bool {
        self.inner.members.is_down(peer)
    }

    /// After a restart: this node tells every other it is alive again (links made on demand,
    /// where nodes that never link to it would otherwise believe it dead; a mesh relinks
    /// everyone anyway). `cluster::start_node` with `rejoin` and `LocalCluster::restart` call
    /// it.
    pub fn announce_alive(&self) {
        self.inner.announce_alive();
    }

    /// Test hook: this node tells every other that `peer` died, as a watcher that suspects
    /// it would (links made on demand). A live `peer` refutes it.
    pub fn announce_death(&self, peer: NodeId) {
        self.inner.announce_death(peer);
    }

    /// The ring neighbours this node watches (links made on demand; empty otherwise).
    pub fn watched_peers(&self) -> Vec<NodeId> {
        self.inner.members.ring()
    }

    /// The node that holds the directory entry of `id`.
    pub fn shard_of(&self, id: impl Into<ObjectId>) -> NodeId {
        self.inner.members.shard_of(&id.into())
    }

    /// The node that would hold the directory entry of `id` if this node died (`None`: no
    /// other node is up): where this node keeps its word about the objects whose entries it
    /// holds itself (README, "Fault tolerance").
    pub fn next_shard_of(&self, id: impl Into<ObjectId>) -> Option<NodeId> {
        self.inner.members.next_shard_of(&id.into())
    }

    /// The node that holds the directory entry of `id` while every node is alive: its home
    /// ([`ObjectId::homed`]) or, for other names, by highest-random-weight hashing, so that
    /// node keeps the entry for as long as it lives, whoever else dies: unlike
    /// [`Node::shard_of`], this does not change with membership.
    pub fn home_shard(&self, id: impl Into<ObjectId>) -> NodeId {
        self.inner.members.home_shard(&id.into())
    }

    /// Synchronous location query: the directory entry as it stands now.
    pub fn locate(&self, id: impl Into<ObjectId>) -> Result<Option<ObjectInfo>> {
        let id = id.into();
        self.inner
            .dir
            .query_at(self.inner.members.shard_of(&id), &id)
    }

    /// Asynchronous location query: the receiver yields the entry once the object has a
    /// location (`None` if it is deleted first).
    pub fn subscribe(
        &self,
        id: impl Into<ObjectId>,
    ) -> Result<Receiver<Result<Option<ObjectInfo>>>> {
        let (tx, out) = crossbeam_channel::bounded(1);
        self.inner.dir.subscribe_into(&id.into(), tx)?;
        Ok(out)
    }

    /// Local copy state of `id` on this node, if any.
    pub fn local_copy(&self, id: impl Into<ObjectId>) -> Option<crate::store::CopyInfo> {
        self.inner.store.info(&id.into())
    }

    /// Pulls this node received, in order.
    pub fn transfer_log(&self) -> Vec<TransferRecord> {
        self.inner.transfers.transfer_log()
    }

    /// Pulls this node served, in order.
    pub fn serve_log(&self) -> Vec<ServeRecord> {
        self.inner.transfers.serve_log()
    }

    /// Source assignments made by this node's directory shard.
    pub fn shard_assignments(&self) -> Vec<Assignment> {
        self.inner.shard.lock().unwrap().assignments()
    }

    /// Where the node's registered arena lives: its base address and length. A view from
    /// [`Node::get_view`] of a copy in the arena points inside this range (no copy was made).
    pub fn arena_range(&self) -> (usize, usize) {
        let a = self.inner.store.arena();
        (a.as_ptr() as usize, a.len())
    }

    /// Free bytes of the arena.
    pub fn arena_free(&self) -> u64 {
        self.inner.store.free_bytes()
    }

    /// How many allreduce partitions this node pulled straight into their place in its copy
    /// of the result, so far (the others were copied in).
    pub fn partitions_pulled_in_place(&self) -> u64 {
        self.inner
            .placed_parts
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many allreduce partitions this node read where the directory said, so far,
    /// because no allgather hint came for them once their trees were placed (it had no place
    /// in them: it holds no input of the allreduce).
    pub fn partitions_read_unhinted(&self) -> u64 {
        self.inner
            .unhinted_parts
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Test hook: how many words this node's shard keeps for entries it would own if their
    /// owners died (promises and only copies, `DirMsg::Backup`).
    pub fn kept_words(&self) -> usize {
        self.inner.shard.lock().unwrap().backups_kept()
    }

    /// Test hook: arms a fault that kills this node at a chosen byte offset of a transfer it
    /// serves.
    pub fn inject_fault(&self, plan: FaultPlan) {
        self.inner.fault.arm(plan);
    }

    /// Whether the injected fault has fired.
    pub fn fault_fired(&self) -> bool {
        self.inner.fault.fired()
    }

    /// When the injected fault fired.
    pub fn fault_fired_at(&self) -> Option<Instant> {
        self.inner.fault.fired_at()
    }
}
