//! A node: store, directory shard, transfer engine and transport tied together, and the
//! public API. One dispatcher thread handles every transport event and control message and
//! never blocks on the network; application calls and transfers run on their own threads.

use crate::config::{NodeConfig, INLINE_LIMIT};
use crate::directory::{Assignment, Shard};
use crate::fault::FaultPlan;
use crate::protocol::{Msg, ObjectInfo, Reply, Rid};
use crate::store::{CopyRef, CopyStatus, Store};
use crate::view::{Fetched, ObjectReader, ObjectView};
use crate::{Error, ObjectId, Result};
use crossbeam_channel::{Receiver, Sender};
use phalanx_transport::{Arena, Event, EventHandler, NodeId, StreamId, Transport, TransportStats};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;
use tracing::{debug, error, warn};

/// Extra fetches a `get` makes when the copy it reads is dropped under it.
const FETCH_ATTEMPTS: u32 = 3;

/// Runs a fetch again when the copy it read was dropped under it: deleted (the next try says
/// so at once), or reset because its producer recomputes it (the next try waits for it).
fn refetching<T>(mut fetch: impl FnMut() -> Result<T>) -> Result<T> {
    let mut attempt = 0;
    loop {
        match fetch() {
            Err(Error::NotFound(_)) if attempt < FETCH_ATTEMPTS => attempt += 1,
            r => return r,
        }
    }
}

/// How a receiver's inbound stream ended.
#[derive(Debug)]
pub(crate) enum InboundEnd {
    Complete,
    Failed(String),
}

pub(crate) struct Inbound {
    pub copy: CopyRef,
    pub source: NodeId,
    pub done: Sender<InboundEnd>,
}

/// One pull as the receiver saw it.
#[derive(Debug, Clone)]
pub struct TransferRecord {
    pub id: ObjectId,
    pub source: NodeId,
    pub receiver: NodeId,
    /// Offset the pull started at (non-zero after a resume).
    pub from: u64,
    /// Bytes that arrived in this pull.
    pub bytes: u64,
    pub start: Instant,
    pub end: Instant,
    pub ok: bool,
}

/// One pull as the source served it.
#[derive(Debug, Clone)]
pub struct ServeRecord {
    pub id: ObjectId,
    pub source: NodeId,
    pub receiver: NodeId,
    pub bytes: u64,
    pub start: Instant,
    pub end: Instant,
}

pub(crate) enum Local {
    Msg(NodeId, Msg),
    Event(Event),
    /// A message a transport thread could not send without blocking.
    Send(NodeId, Msg),
    Stop,
}

/// An outstanding request: the node it went to, and where its reply goes.
type PendingCall = (NodeId, Sender<Result<Reply>>);

pub(crate) struct Inner {
    pub id: NodeId,
    pub nodes: u32,
    pub cfg: NodeConfig,
    pub transport: Arc<dyn Transport>,
    pub store: Arc<Store>,
    pub shard: Mutex<Shard>,
    local_tx: Sender<Local>,
    pending: Mutex<HashMap<Rid, PendingCall>>,
    next_rid: AtomicU64,
    pub inbound: Mutex<HashMap<StreamId, Inbound>>,
    next_stream: AtomicU64,
    /// Cancel flags of the pulls this node serves, by (receiver, stream).
    pub serving: Mutex<HashMap<(NodeId, StreamId), Arc<AtomicBool>>>,
    pub recv_log: Mutex<Vec<TransferRecord>>,
    pub serve_log: Mutex<Vec<ServeRecord>>,
    closed: AtomicBool,
    /// EWMA of pull throughput, f64 bits.
    bandwidth_bits: AtomicU64,
    pub fault: Mutex<Option<FaultPlan>>,
    pub fault_fired: AtomicBool,
    pub fault_fired_at: Mutex<Option<Instant>>,
    /// Peers seen down and not back yet.
    down_peers: Mutex<std::collections::HashSet<NodeId>>,
    /// Reduce coordinators watching for dead peers.
    pub down_watchers: Mutex<Vec<Sender<NodeId>>>,
    /// Cancel flags of the reduce tasks running here, by output object.
    pub reduce_cancels: Mutex<HashMap<ObjectId, Arc<AtomicBool>>>,
}

/// A Phalanx node. Cheap to clone; every clone is the same node.
#[derive(Clone)]
pub struct Node {
    pub(crate) inner: Arc<Inner>,
    dispatcher: Arc<Mutex<Option<JoinHandle<()>>>>,
}

impl Node {
    /// Starts a node on a connected transport: allocates and registers the arena, starts the
    /// dispatcher.
    pub fn start(
        id: NodeId,
        nodes: u32,
        transport: Arc<dyn Transport>,
        cfg: NodeConfig,
    ) -> Result<Node> {
        if id >= nodes {
            return Err(Error::InvalidArgument(format!(
                "node id {id} >= {nodes} nodes"
            )));
        }
        let arena = Arc::new(Arena::new(cfg.arena_size as usize, cfg.huge_pages)?);
        transport.register_arena(arena.clone())?;
        let (local_tx, local_rx) = crossbeam_channel::unbounded();
        let inner = Arc::new(Inner {
            id,
            nodes,
            cfg,
            store: Store::new(arena),
            transport,
            shard: Mutex::new(Shard::new()),
            local_tx,
            pending: Mutex::new(HashMap::new()),
            next_rid: AtomicU64::new(1),
            inbound: Mutex::new(HashMap::new()),
            next_stream: AtomicU64::new(1),
            serving: Mutex::new(HashMap::new()),
            recv_log: Mutex::new(Vec::new()),
            serve_log: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
            bandwidth_bits: AtomicU64::new(0),
            fault: Mutex::new(None),
            fault_fired: AtomicBool::new(false),
            fault_fired_at: Mutex::new(None),
            down_peers: Mutex::new(Default::default()),
            down_watchers: Mutex::new(Vec::new()),
            reduce_cancels: Mutex::new(HashMap::new()),
        });
        // A (re)joining node treats peers it could not reach as down until they link up.
        inner
            .down_peers
            .lock()
            .unwrap()
            .extend((0..nodes).filter(|&p| p != id && !inner.transport.is_connected(p)));
        let d = inner.clone();
        let h = std::thread::Builder::new()
            .name(format!("phx-node-{id}"))
            .spawn(move || d.dispatch(local_rx))
            .map_err(|e| Error::Config(format!("spawn: {e}")))?;
        // Replies and data events are handled on the transport's threads (no hand-off);
        // everything that may send goes to the dispatcher. Weak: the transport must not keep
        // the node alive.
        let weak = Arc::downgrade(&inner);
        let handler: EventHandler = Arc::new(move |ev| {
            if let Some(i) = weak.upgrade() {
                i.on_transport_event(ev);
            }
        });
        if !inner.transport.set_event_handler(handler.clone()) {
            let events = inner.transport.events();
            std::thread::Builder::new()
                .name(format!("phx-events-{id}"))
                .spawn(move || {
                    for ev in events {
                        handler(ev);
                    }
                })
                .map_err(|e| Error::Config(format!("spawn: {e}")))?;
        }
        Ok(Node {
            inner,
            dispatcher: Arc::new(Mutex::new(Some(h))),
        })
    }

    pub fn id(&self) -> NodeId {
        self.inner.id
    }

    pub fn num_nodes(&self) -> u32 {
        self.inner.nodes
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
        let (copy, evicted) = inner.store.create(&id, data.len() as u64, true)?;
        inner.withdraw(&evicted);
        let size = data.len() as u64;
        if size < INLINE_LIMIT {
            copy.append(data)?;
            let shard = inner.shard_of(&id);
            let r = inner.call(shard, |rid| Msg::PutInline {
                rid,
                id: id.clone(),
                node: inner.id,
                data: data.to_vec(),
            });
            return inner
                .tolerate_shard_down(&id, r.map(|_| ()))
                .inspect_err(|_| {
                    inner.store.delete(&id);
                });
        }
        inner.publish(&id, size, false)?;
        for piece in data.chunks(inner.cfg.put_step.max(4096) as usize) {
            copy.append(piece)?;
        }
        inner.publish(&id, size, true)
    }

    /// Fetches a copy of the object's bytes, waiting for the object to be put if needed.
    pub fn get(&self, id: impl Into<ObjectId>) -> Result<Vec<u8>> {
        let id = id.into();
        refetching(|| self.get_once(&id))
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
        self.get_view_excluding(id, &[])
    }

    /// Like [`Node::get_view`], pulling only from `source` (no tree): the star baseline of a
    /// task system without collectives.
    pub fn get_view_from(&self, id: impl Into<ObjectId>, source: NodeId) -> Result<ObjectView> {
        let others: Vec<NodeId> = (0..self.inner.nodes).filter(|&n| n != source).collect();
        self.get_view_excluding(id, &others)
    }

    fn get_view_excluding(
        &self,
        id: impl Into<ObjectId>,
        exclude: &[NodeId],
    ) -> Result<ObjectView> {
        let id = id.into();
        refetching(|| match self.inner.fetch_excluding(&id, exclude)? {
            Fetched::Owned(v) => Ok(ObjectView::Owned(v)),
            Fetched::Copy(c) => {
                let size = c.size();
                let mut wm = 0;
                while wm < size || c.status() != CopyStatus::Complete {
                    wm = c.wait_beyond(wm, self.inner.cfg.op_timeout)?;
                }
                Ok(ObjectView::Arena(c))
            }
        })
    }

    /// A reader that returns bytes as soon as they have arrived.
    pub fn get_stream(&self, id: impl Into<ObjectId>) -> Result<ObjectReader> {
        let src = self.inner.fetch(&id.into())?;
        Ok(ObjectReader {
            src,
            pos: 0,
            timeout: self.inner.cfg.op_timeout,
        })
    }

    /// Removes the object from every node and from the directory.
    pub fn delete(&self, id: impl Into<ObjectId>) -> Result<()> {
        self.inner.delete(&id.into())
    }

    /// Drops this node's copy of `id` unless it is a pinned `put` copy, and withdraws it from
    /// the directory; returns whether a copy was dropped. Other copies are untouched.
    pub fn evict_local(&self, id: impl Into<ObjectId>) -> bool {
        let id = id.into();
        match self.inner.store.info(&id) {
            Some(i) if !i.pinned && i.status == CopyStatus::Complete => {
                self.inner.store.delete(&id);
                self.inner.withdraw(std::slice::from_ref(&id));
                true
            }
            _ => false,
        }
    }

    /// The node that holds the directory entry of `id`.
    pub fn shard_of(&self, id: impl Into<ObjectId>) -> NodeId {
        self.inner.shard_of(&id.into())
    }

    /// The node that holds the directory entry of `id` while every node is alive. Placement
    /// is highest-random-weight hashing, so that node keeps the entry for as long as it lives,
    /// whoever else dies: unlike [`Node::shard_of`], this does not change with membership.
    pub fn home_shard(&self, id: impl Into<ObjectId>) -> NodeId {
        Inner::hrw_owner(&id.into(), self.inner.nodes, |_| true)
    }

    /// Synchronous location query: the directory entry as it stands now.
    pub fn locate(&self, id: impl Into<ObjectId>) -> Result<Option<ObjectInfo>> {
        let id = id.into();
        match self
            .inner
            .call(self.inner.shard_of(&id), |rid| Msg::Query {
                rid,
                id: id.clone(),
            })? {
            Reply::Info(i) => Ok(i),
            r => Err(self.inner.unexpected(r)),
        }
    }

    /// Asynchronous location query: the receiver yields the entry once the object has a
    /// location (`None` if it is deleted first).
    pub fn subscribe(
        &self,
        id: impl Into<ObjectId>,
    ) -> Result<Receiver<Result<Option<ObjectInfo>>>> {
        let id = id.into();
        let inner = self.inner.clone();
        let rx = inner.call_async(inner.shard_of(&id), |rid| Msg::Subscribe {
            rid,
            id: id.clone(),
        })?;
        let (tx, out) = crossbeam_channel::bounded(1);
        std::thread::Builder::new()
            .name("phx-subscribe".into())
            .spawn(move || {
                let r = match rx.recv() {
                    Ok(Ok(Reply::Info(i))) => Ok(i),
                    Ok(Ok(r)) => Err(inner.unexpected(r)),
                    Ok(Err(e)) => Err(e),
                    Err(_) => Err(Error::Shutdown),
                };
                let _ = tx.send(r);
            })
            .map_err(|e| Error::Config(format!("spawn: {e}")))?;
        Ok(out)
    }

    /// Local copy state of `id` on this node, if any.
    pub fn local_copy(&self, id: impl Into<ObjectId>) -> Option<crate::store::CopyInfo> {
        self.inner.store.info(&id.into())
    }

    /// Pulls this node received, in order.
    pub fn transfer_log(&self) -> Vec<TransferRecord> {
        self.inner.recv_log.lock().unwrap().clone()
    }

    /// Pulls this node served, in order.
    pub fn serve_log(&self) -> Vec<ServeRecord> {
        self.inner.serve_log.lock().unwrap().clone()
    }

    /// Source assignments made by this node's directory shard.
    pub fn shard_assignments(&self) -> Vec<Assignment> {
        self.inner.shard.lock().unwrap().assignments()
    }

    /// Free bytes of the arena.
    pub fn arena_free(&self) -> u64 {
        self.inner.store.free_bytes()
    }

    /// Test hook: arms a fault that kills this node at a chosen byte offset of a transfer it
    /// serves.
    pub fn inject_fault(&self, plan: FaultPlan) {
        *self.inner.fault.lock().unwrap() = Some(plan);
    }

    /// Whether the injected fault has fired.
    pub fn fault_fired(&self) -> bool {
        self.inner.fault_fired.load(Ordering::Acquire)
    }

    /// When the injected fault fired.
    pub fn fault_fired_at(&self) -> Option<Instant> {
        *self.inner.fault_fired_at.lock().unwrap()
    }

    /// Whether the node has been stopped or killed.
    pub fn is_closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// Stops the node cleanly: peers see a goodbye.
    pub fn shutdown(&self) {
        self.stop(false);
    }

    /// Test hook: the node dies abruptly (links dropped without goodbye).
    pub fn kill(&self) {
        self.stop(true);
    }

    fn stop(&self, abrupt: bool) {
        self.inner.close(abrupt);
        if let Some(h) = self.dispatcher.lock().unwrap().take() {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

impl Inner {
    pub fn delete(&self, id: &ObjectId) -> Result<()> {
        self.remove_copies(id, false)
    }

    /// Drops every copy of `id` but keeps its readers waiting for a new one (see `Msg::Reset`).
    pub fn reset(&self, id: &ObjectId) -> Result<()> {
        self.remove_copies(id, true)
    }

    fn remove_copies(&self, id: &ObjectId, reset: bool) -> Result<()> {
        let nodes = match self.call(self.shard_of(id), |rid| match reset {
            false => Msg::Delete {
                rid,
                id: id.clone(),
            },
            true => Msg::Reset {
                rid,
                id: id.clone(),
            },
        })? {
            Reply::Deleted(n) => n,
            r => return Err(self.unexpected(r)),
        };
        self.store.delete(id);
        for n in nodes.into_iter().filter(|&n| n != self.id) {
            match self.call(n, |rid| Msg::Evict {
                rid,
                id: id.clone(),
            }) {
                Ok(_) | Err(Error::PeerDown(_)) | Err(Error::Transport(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Observed pull throughput in bytes/s (or the configured override).
    pub fn bandwidth_estimate(&self) -> f64 {
        if let Some(b) = self.cfg.bandwidth_override {
            return b;
        }
        match f64::from_bits(self.bandwidth_bits.load(Ordering::Relaxed)) {
            b if b > 0.0 => b,
            _ => 1.25e9, // 10 Gbit/s until a pull has been measured
        }
    }

    /// Folds one finished pull into the throughput estimate (pulls under 1 MiB are latency).
    pub fn record_throughput(&self, bytes: u64, secs: f64) {
        if bytes < (1 << 20) || secs <= 0.0 {
            return;
        }
        let sample = bytes as f64 / secs;
        let old = f64::from_bits(self.bandwidth_bits.load(Ordering::Relaxed));
        let new = if old > 0.0 {
            0.7 * old + 0.3 * sample
        } else {
            sample
        };
        self.bandwidth_bits.store(new.to_bits(), Ordering::Relaxed);
    }

    /// The node holding the directory entry of `id`: highest-random-weight hashing over the
    /// nodes this node believes alive, so that when a shard's node dies its objects move to
    /// one deterministic other node (and move back when it rejoins).
    pub fn shard_of(&self, id: &ObjectId) -> NodeId {
        let down = self.down_peers.lock().unwrap();
        Self::hrw_owner(id, self.nodes, |n| n == self.id || !down.contains(&n))
    }

    fn hrw_owner(id: &ObjectId, nodes: u32, alive: impl Fn(NodeId) -> bool) -> NodeId {
        let h = id.stable_hash();
        let weight = |n: NodeId| {
            let x = (h ^ (n as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15))
                .wrapping_mul(0xff51_afd7_ed55_8ccd);
            x ^ (x >> 29)
        };
        (0..nodes)
            .filter(|&n| alive(n))
            .max_by_key(|&n| weight(n))
            .unwrap_or(0)
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Stops the node: links closed (abruptly: no goodbye, as if the process died), the
    /// dispatcher stopped, and every waiting operation failed.
    pub fn close(&self, abrupt: bool) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        if abrupt {
            self.transport.kill();
        } else {
            self.transport.shutdown();
        }
        let _ = self.local_tx.send(Local::Stop);
        for (_, (_, tx)) in self.pending.lock().unwrap().drain() {
            let _ = tx.send(Err(Error::Shutdown));
        }
        for (_, ib) in self.inbound.lock().unwrap().drain() {
            let _ = ib.done.send(InboundEnd::Failed("node shut down".into()));
        }
    }

    pub fn next_stream(&self) -> StreamId {
        self.next_stream.fetch_add(1, Ordering::Relaxed)
    }

    /// A dead shard is not fatal to a producer: the copy is here, and this node republishes
    /// it to the entry's next owner (or to the shard when it rejoins).
    pub fn tolerate_shard_down(&self, id: &ObjectId, r: Result<()>) -> Result<()> {
        match r {
            Err(Error::PeerDown(p)) => {
                warn!(node = self.id, %id, shard = p, "directory shard down; the entry is republished when ownership settles");
                Ok(())
            }
            r => r,
        }
    }

    /// Announces a local copy (partial or complete) to the object's directory shard.
    pub fn publish(&self, id: &ObjectId, size: u64, complete: bool) -> Result<()> {
        let r = self.send(
            self.shard_of(id),
            Msg::Publish {
                id: id.clone(),
                size,
                node: self.id,
                complete,
            },
        );
        self.tolerate_shard_down(id, r)
    }

    /// Directory ownership changed (a peer died, or rejoined): give the new owner of every
    /// affected entry our copies again. `was_owner(id)` says whether the entry moved.
    fn republish(&self, moved: impl Fn(&ObjectId) -> bool) {
        for (id, size, complete) in self.store.summary() {
            if !moved(&id) {
                continue;
            }
            let small = size < INLINE_LIMIT && complete;
            let msg = match self.store.lookup(&id) {
                Some(c) if small => Msg::PutInline {
                    rid: 0,
                    id: id.clone(),
                    node: self.id,
                    data: c.filled(0, size).to_vec(),
                },
                _ => Msg::Publish {
                    id: id.clone(),
                    size,
                    node: self.id,
                    complete,
                },
            };
            let _ = self.send(self.shard_of(&id), msg);
        }
    }

    /// `peer` died: entries it owned move to the next node by HRW order.
    fn republish_after_death(&self, peer: NodeId) {
        let down = self.down_peers.lock().unwrap().clone();
        let nodes = self.nodes;
        let me = self.id;
        self.republish(|id| {
            Self::hrw_owner(id, nodes, |n| n == me || n == peer || !down.contains(&n)) == peer
        });
    }

    /// Sends a control message; messages to ourselves take the local queue.
    pub fn send(&self, to: NodeId, msg: Msg) -> Result<()> {
        if to == self.id {
            self.local_tx
                .send(Local::Msg(self.id, msg))
                .map_err(|_| Error::Shutdown)
        } else {
            self.transport.send(to, &msg.encode()).map_err(|e| match e {
                phalanx_transport::TransportError::PeerUnavailable(p)
                | phalanx_transport::TransportError::PeerFailed { peer: p, .. } => {
                    Error::PeerDown(p)
                }
                e => Error::Transport(e),
            })
        }
    }

    pub fn call_async(
        &self,
        to: NodeId,
        make: impl FnOnce(Rid) -> Msg,
    ) -> Result<Receiver<Result<Reply>>> {
        if self.is_closed() {
            return Err(Error::Shutdown);
        }
        let rid = self.next_rid.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.pending.lock().unwrap().insert(rid, (to, tx));
        if let Err(e) = self.send(to, make(rid)) {
            self.pending.lock().unwrap().remove(&rid);
            return Err(e);
        }
        Ok(rx)
    }

    /// A request/reply exchange, bounded by the operation timeout.
    pub fn call(&self, to: NodeId, make: impl FnOnce(Rid) -> Msg) -> Result<Reply> {
        let rx = self.call_async(to, make)?;
        // Replies to directory lookups take tens of microseconds: spin briefly before parking,
        // which saves the wake-up latency of a sleeping thread.
        let spin_until = Instant::now() + self.cfg.spin_wait;
        let first = loop {
            match rx.try_recv() {
                Ok(r) => break Some(r),
                Err(_) if Instant::now() < spin_until => std::hint::spin_loop(),
                Err(_) => break None,
            }
        };
        let got = match first {
            Some(r) => Ok(r),
            None => rx.recv_timeout(self.cfg.op_timeout),
        };
        match got {
            Ok(Ok(Reply::Error(e))) => Err(Error::Protocol { peer: to, what: e }),
            Ok(r) => r,
            Err(_) => Err(Error::Timeout(
                self.cfg.op_timeout,
                format!("a reply from node {to}"),
            )),
        }
    }

    pub fn unexpected(&self, r: Reply) -> Error {
        Error::Protocol {
            peer: self.id,
            what: format!("unexpected reply {r:?}"),
        }
    }

    /// Tells the directory that evicted copies are gone.
    pub fn withdraw(&self, ids: &[ObjectId]) {
        for id in ids {
            let _ = self.send(
                self.shard_of(id),
                Msg::Withdraw {
                    id: id.clone(),
                    node: self.id,
                },
            );
        }
    }

    fn dispatch(self: Arc<Self>, local: Receiver<Local>) {
        for m in local {
            match m {
                Local::Msg(from, msg) => self.on_msg(from, msg),
                Local::Event(Event::PeerDown { peer, reason }) => {
                    let newly = self.down_peers.lock().unwrap().insert(peer);
                    self.on_peer_down(peer, &reason);
                    if newly {
                        self.republish_after_death(peer);
                    }
                }
                Local::Event(Event::PeerUp { peer }) => {
                    if self.down_peers.lock().unwrap().remove(&peer) {
                        self.republish(|id| self.shard_of(id) == peer);
                    }
                }
                Local::Event(_) => {}
                Local::Send(to, msg) => {
                    if let Err(e) = self.send(to, msg) {
                        debug!(node = self.id, to, "reply not delivered: {e}");
                    }
                }
                Local::Stop => break,
            }
        }
        debug!(node = self.id, "dispatcher stopped");
    }

    /// Runs on transport threads: must not block on the network.
    fn on_transport_event(&self, ev: Event) {
        match ev {
            Event::Ctrl { peer, msg } => match Msg::decode(&msg) {
                Ok(Msg::Reply { rid, reply }) => self.complete(rid, reply),
                // The directory answers on the transport thread when the reply can go out
                // without blocking: one thread hand-off less per lookup.
                Ok(m) if m.is_directory() => {
                    let mut out = Vec::new();
                    self.shard.lock().unwrap().handle(peer, m, &mut out);
                    for (to, reply) in out {
                        let sent = to != self.id
                            && matches!(
                                self.transport.send_nonblocking(to, &reply.encode()),
                                Ok(true)
                            );
                        if !sent {
                            let _ = self.local_tx.send(Local::Send(to, reply));
                        }
                    }
                }
                Ok(m) => {
                    let _ = self.local_tx.send(Local::Msg(peer, m));
                }
                Err(e) => error!(
                    node = self.id,
                    peer, "undecodable control message dropped: {e}"
                ),
            },
            Event::Data {
                peer,
                stream,
                offset,
                len,
            } => self.on_data(peer, stream, offset, len),
            ev => {
                let _ = self.local_tx.send(Local::Event(ev));
            }
        }
    }

    fn complete(&self, rid: Rid, reply: Reply) {
        if let Some((_, tx)) = self.pending.lock().unwrap().remove(&rid) {
            let _ = tx.send(Ok(reply));
        }
    }

    fn on_data(&self, peer: NodeId, stream: StreamId, offset: u64, len: u64) {
        let mut inbound = self.inbound.lock().unwrap();
        let Some(ib) = inbound.get(&stream) else {
            error!(node = self.id, peer, stream, "data for an unknown stream");
            return;
        };
        let wm = ib.copy.watermark();
        if ib.source != peer || offset != wm {
            error!(
                node = self.id,
                peer, stream, offset, wm, "out-of-order data, stream dropped"
            );
            let ib = inbound.remove(&stream).expect("present");
            let _ = ib.done.send(InboundEnd::Failed("out-of-order data".into()));
            return;
        }
        ib.copy.advance_to(offset + len);
        if offset + len >= ib.copy.size() {
            let ib = inbound.remove(&stream).expect("present");
            let _ = ib.done.send(InboundEnd::Complete);
        }
    }

    fn on_peer_down(self: &Arc<Self>, peer: NodeId, reason: &str) {
        if reason == phalanx_transport::PEER_LEFT {
            debug!(node = self.id, peer, "peer left");
        } else {
            warn!(node = self.id, peer, "peer down: {reason}");
        }
        let mut out = Vec::new();
        self.shard.lock().unwrap().node_down(peer, &mut out);
        self.send_all(out);
        self.down_watchers
            .lock()
            .unwrap()
            .retain(|w| w.send(peer).is_ok());
        let failed: Vec<_> = {
            let mut p = self.pending.lock().unwrap();
            let rids: Vec<Rid> = p
                .iter()
                .filter(|(_, (to, _))| *to == peer)
                .map(|(r, _)| *r)
                .collect();
            rids.into_iter().filter_map(|r| p.remove(&r)).collect()
        };
        for (_, tx) in failed {
            let _ = tx.send(Err(Error::PeerDown(peer)));
        }
        let mut inbound = self.inbound.lock().unwrap();
        let streams: Vec<StreamId> = inbound
            .iter()
            .filter(|(_, ib)| ib.source == peer)
            .map(|(s, _)| *s)
            .collect();
        for s in streams {
            let ib = inbound.remove(&s).expect("listed");
            let _ = ib
                .done
                .send(InboundEnd::Failed(format!("source {peer} down: {reason}")));
        }
        drop(inbound);
        for ((r, _), flag) in self.serving.lock().unwrap().iter() {
            if *r == peer {
                flag.store(true, Ordering::Release);
            }
        }
    }

    fn send_all(&self, out: Vec<(NodeId, Msg)>) {
        for (to, m) in out {
            if let Err(e) = self.send(to, m) {
                debug!(node = self.id, to, "directory reply not delivered: {e}");
            }
        }
    }

    fn on_msg(self: &Arc<Self>, from: NodeId, msg: Msg) {
        match msg {
            Msg::Reply { rid, reply } => self.complete(rid, reply),
            Msg::Pull {
                id,
                stream,
                dst,
                from: offset,
            } => {
                let me = self.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("phx-serve-{}", self.id))
                    .spawn(move || me.serve(from, id, stream, dst, offset));
                if spawned.is_err() {
                    let _ = self.send(from, Msg::PullEnd { stream, ok: false });
                }
            }
            Msg::CancelPull { stream } => {
                if let Some(f) = self.serving.lock().unwrap().get(&(from, stream)) {
                    f.store(true, Ordering::Release);
                }
            }
            Msg::PullEnd { stream, ok } => {
                if let Some(ib) = self.inbound.lock().unwrap().remove(&stream) {
                    let why = if ok {
                        "source ended early"
                    } else {
                        "source refused or aborted"
                    };
                    let _ = ib.done.send(InboundEnd::Failed(why.into()));
                }
            }
            Msg::ReduceTask { rid, task } => {
                // Registered before the thread starts, so a CancelReduce that follows on the
                // same link always finds it.
                let cancel = Arc::new(AtomicBool::new(false));
                self.reduce_cancels
                    .lock()
                    .unwrap()
                    .insert(task.out.clone(), cancel.clone());
                let me = self.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("phx-reduce-{}", self.id))
                    .spawn(move || {
                        let reply = match me.run_reduce_task(&task, &cancel) {
                            Ok(()) => Reply::Ack,
                            Err(e) => Reply::Error(e.to_string()),
                        };
                        let mut c = me.reduce_cancels.lock().unwrap();
                        if c.get(&task.out).is_some_and(|f| Arc::ptr_eq(f, &cancel)) {
                            c.remove(&task.out);
                        }
                        drop(c);
                        if !cancel.load(Ordering::Acquire) {
                            let _ = me.send(from, Msg::Reply { rid, reply });
                        }
                    });
                if let Err(e) = spawned {
                    let _ = self.send(
                        from,
                        Msg::Reply {
                            rid,
                            reply: Reply::Error(format!("spawn: {e}")),
                        },
                    );
                }
            }
            Msg::CancelReduce { out } => {
                if let Some(f) = self.reduce_cancels.lock().unwrap().get(&out) {
                    f.store(true, Ordering::Release);
                }
            }
            Msg::Evict { rid, id } => {
                self.store.delete(&id);
                let _ = self.send(
                    from,
                    Msg::Reply {
                        rid,
                        reply: Reply::Ack,
                    },
                );
            }
            dir => {
                let mut out = Vec::new();
                self.shard.lock().unwrap().handle(from, dir, &mut out);
                self.send_all(out);
            }
        }
    }
}
