//! Start and stop: the node allocates and registers its arena, builds its subsystems, each
//! handed only the collaborators it uses, and starts the dispatcher.

use super::{Inner, Node};
use crate::config::NodeConfig;
use crate::directory::{DirClient, Shard};
use crate::fault::FaultHook;
use crate::membership::Membership;
use crate::reduce::{ReduceDeps, Reducer};
use crate::rpc::Rpc;
use crate::store::Store;
use crate::transfer::{TransferDeps, Transfers};
use crate::workers::Workers;
use crate::{Error, Result};
use phalanx_transport::{Arena, EventHandler, NodeId, Transport};
use std::sync::{Arc, Mutex, Weak};

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
        let store = Store::new(arena);
        let (queue_tx, queue_rx) = crossbeam_channel::unbounded();
        let rpc = Arc::new(Rpc::new(
            id,
            transport.clone(),
            queue_tx,
            cfg.spin_wait,
            cfg.op_timeout,
        ));
        // A (re)joining node treats peers it could not reach as down until they link up
        // (with links made on demand, a starting node believes every peer up).
        let unreachable = (0..nodes).filter(|&p| p != id && !transport.is_up(p));
        let members = Arc::new(Membership::new(id, nodes, unreachable));
        let dir = Arc::new(DirClient::new(rpc.clone(), members.clone(), store.clone()));
        let workers = Arc::new(Workers::new(id));
        let inner = Arc::new_cyclic(|me: &Weak<Inner>| {
            // The fault hook's DropLinks closes this node; weak, so it never keeps it alive.
            let me = me.clone();
            let fault = Arc::new(FaultHook::new(id, move || {
                if let Some(i) = me.upgrade() {
                    i.close(true);
                }
            }));
            let transfers = Arc::new(Transfers::new(TransferDeps {
                cfg: cfg.clone(),
                transport: transport.clone(),
                store: store.clone(),
                rpc: rpc.clone(),
                dir: dir.clone(),
                fault: fault.clone(),
                workers: workers.clone(),
            }));
            let reducer = Arc::new(Reducer::new(ReduceDeps {
                cfg: cfg.clone(),
                rpc: rpc.clone(),
                dir: dir.clone(),
                members: members.clone(),
                store: store.clone(),
                transfers: transfers.clone(),
                workers: workers.clone(),
            }));
            Inner {
                id,
                cfg,
                transport,
                store,
                shard: Mutex::new(Shard::for_cluster(nodes)),
                rpc,
                members,
                dir,
                transfers,
                reducer,
                fault,
                workers,
                placed_parts: Default::default(),
                unhinted_parts: Default::default(),
            }
        });
        // Messages to ourselves are handled on the sender's thread. Weak: the messaging must
        // not keep the node alive.
        let weak = Arc::downgrade(&inner);
        inner.rpc.set_loopback(Box::new(move |msg| {
            if let Some(i) = weak.upgrade() {
                i.on_loopback(msg);
            }
        }));
        let weak = Arc::downgrade(&inner);
        inner.rpc.set_loopback_nonblocking(Box::new(move |msg| {
            if let Some(i) = weak.upgrade() {
                i.on_loopback_nonblocking(msg);
            }
        }));
        let d = inner.clone();
        let h = phalanx_transport::threads::spawn(id, "node", move || d.dispatch(queue_rx))
            .map_err(|e| Error::Config(format!("spawn: {e}")))?;
        // Links close when idle only where nothing of this node depends on their peer.
        let weak = Arc::downgrade(&inner);
        inner.transport.set_idle_guard(Arc::new(move || {
            let mut peers = std::collections::HashSet::new();
            if let Some(i) = weak.upgrade() {
                i.shard.lock().unwrap().peers_depended_on(&mut peers);
                i.rpc.peers_awaited(&mut peers);
                i.transfers.peers_streaming(&mut peers);
            }
            peers
        }));
        // Links made on demand: only the ring neighbours' links prove peers alive, and
        // deaths spread from their watchers (see `gossip`).
        if inner.transport.dials_on_use() {
            inner.members.watch_ring();
            let members = inner.members.clone();
            if inner
                .transport
                .set_watch(Arc::new(move |p| members.watches(p)))
            {
                inner.link_ring();
            }
        }
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
            phalanx_transport::threads::spawn(id, "events", move || {
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

    /// Whether the node has been stopped or killed.
    pub fn is_closed(&self) -> bool {
        self.inner.rpc.is_closed()
    }

    /// Stops the node cleanly: peers see a goodbye.
    pub fn shutdown(&self) {
        self.stop(false);
    }

    /// Test hook: the node dies abruptly (links dropped without goodbye).
    pub fn kill(&self) {
        self.stop(true);
    }

    /// Test hook: the node goes silent, as a host that hangs (links stay open, nothing goes
    /// out, nothing received is handled): its peers learn of it only by heartbeats. Returns
    /// false (and kills the node) if its transport cannot go silent.
    pub fn freeze(&self) -> bool {
        let silent = self.inner.transport.freeze();
        if !silent {
            self.kill();
        }
        silent
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
