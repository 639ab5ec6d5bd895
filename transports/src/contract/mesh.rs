//! The nodes and meshes the cases run on, and the coverage check of one stream.

use super::*;
pub(super) struct Node<T> {
    pub(super) id: NodeId,
    pub(super) t: T,
    pub(super) arena: Arc<Arena>,
    pub(super) events: Receiver<Event>,
}

impl<T: Transport> Node<T> {
    /// `[offset, offset + len)` of this node's arena, granted to `writer` (as a pull grants
    /// its source the copy it fills).
    pub(super) fn region(
        &self,
        writer: NodeId,
        offset: u64,
        len: u64,
    ) -> Result<RemoteRegion, TransportError> {
        self.t.grant(writer, offset, len, Arc::new(()))
    }

    /// The next event, which must come within `within`.
    pub(super) fn next(&self, within: Duration, waiting_for: &str) -> Event {
        match self.events.recv_timeout(within) {
            Ok(ev) => ev,
            Err(RecvTimeoutError::Timeout) => panic!(
                "node {}: no event within {within:?} (waiting for {waiting_for})",
                self.id
            ),
            Err(RecvTimeoutError::Disconnected) => {
                panic!("node {}: event channel closed", self.id)
            }
        }
    }

    /// Asserts that no event arrives for `dur`.
    pub(super) fn quiet(&self, dur: Duration, why: &str) {
        if let Ok(ev) = self.events.recv_timeout(dur) {
            panic!("node {}: unexpected event {ev:?} ({why})", self.id);
        }
    }

    /// Asserts that no event is queued right now.
    pub(super) fn nothing_queued(&self, why: &str) {
        if let Ok(ev) = self.events.try_recv() {
            panic!("node {}: unexpected event {ev:?} ({why})", self.id);
        }
    }

    /// The next event must be this control message.
    pub(super) fn expect_ctrl(&self, from: NodeId, msg: &[u8]) {
        match self.next(WAIT, "a control message") {
            Event::Ctrl { peer, msg: got } => {
                assert_eq!(peer, from, "node {}: control message from", self.id);
                assert_bytes(&got, msg, "control message");
            }
            other => panic!(
                "node {}: expected a control message from {from}, got {other:?}",
                self.id
            ),
        }
    }

    /// Waits for `PeerDown { peer }`, letting `PeerUp`s through (a peer that dropped a link
    /// dials it again); returns its reason.
    pub(super) fn expect_down_among_ups(&self, peer: NodeId, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next(left, "PeerDown") {
                Event::PeerDown { peer: p, reason } if p == peer => return reason,
                Event::PeerUp { .. } => continue,
                other => panic!(
                    "node {}: expected PeerDown of {peer}, got {other:?}",
                    self.id
                ),
            }
        }
    }

    /// Waits for `PeerUp { peer }`, letting `PeerDown`s of others through.
    pub(super) fn expect_up(&self, peer: NodeId, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next(left, "PeerUp") {
                Event::PeerUp { peer: p } if p == peer => return,
                Event::PeerDown { peer: p, .. } if p != peer => continue,
                other => panic!("node {}: expected PeerUp of {peer}, got {other:?}", self.id),
            }
        }
    }

    /// The next event must be `PeerDown { peer }`; returns its reason.
    pub(super) fn expect_down(&self, peer: NodeId, within: Duration) -> String {
        match self.next(within, "PeerDown") {
            Event::PeerDown { peer: p, reason } => {
                assert_eq!(p, peer, "node {}: PeerDown of the wrong peer", self.id);
                reason
            }
            other => panic!(
                "node {}: expected PeerDown of {peer}, got {other:?}",
                self.id
            ),
        }
    }

    /// Receives the data events of one write of `[start, start + len)` on `stream` from
    /// `from`: in order, contiguous, covering exactly that range. Returns the event count.
    pub(super) fn expect_data(
        &self,
        from: NodeId,
        stream: u64,
        start: u64,
        len: u64,
        within: Duration,
    ) -> u64 {
        let deadline = Instant::now() + within;
        let mut cover = Coverage::new(from, stream, start, len);
        let mut events = 0;
        while !cover.complete() {
            let left = deadline.saturating_duration_since(Instant::now());
            let ev = self.next(left, "data events");
            assert!(
                cover.take(&ev),
                "node {}: unexpected event {ev:?} while {stream} was at {} of [{start}, {})",
                self.id,
                cover.mark,
                start + len
            );
            events += 1;
        }
        events
    }

    /// Sets a handler that forwards events to a fresh channel, which `next` reads from then
    /// on. Returns whether the transport took the handler.
    pub(super) fn use_handler(&mut self) -> bool {
        let (tx, rx) = crossbeam_channel::unbounded();
        let taken = self.t.set_event_handler(Arc::new(move |ev| {
            let _ = tx.send(ev);
        }));
        if taken {
            self.events = rx;
        }
        taken
    }
}

/// Tracks the data events of one stream against the range one write covers.
pub(super) struct Coverage {
    pub(super) from: NodeId,
    pub(super) stream: u64,
    pub(super) mark: u64,
    pub(super) end: u64,
}

impl Coverage {
    pub(super) fn new(from: NodeId, stream: u64, start: u64, len: u64) -> Coverage {
        Coverage {
            from,
            stream,
            mark: start,
            end: start + len,
        }
    }

    pub(super) fn complete(&self) -> bool {
        self.mark == self.end
    }

    /// Takes a data event of this stream (checking it continues the range exactly); false for
    /// any other event.
    pub(super) fn take(&mut self, ev: &Event) -> bool {
        let Event::Data {
            peer,
            stream,
            offset,
            len,
        } = *ev
        else {
            return false;
        };
        if stream != self.stream {
            return false;
        }
        assert_eq!(peer, self.from, "stream {stream}: data from the wrong peer");
        assert_eq!(
            offset, self.mark,
            "stream {stream}: data events in order and contiguous"
        );
        assert!(len > 0, "stream {stream}: empty data event at {offset}");
        assert!(
            offset + len <= self.end,
            "stream {stream}: data event [{offset}, {}) beyond the written end {}",
            offset + len,
            self.end
        );
        self.mark += len;
        true
    }
}

/// `n` linked nodes of one transport kind, each with a registered arena.
pub(super) struct Mesh<H: Harness> {
    pub(super) nodes: Vec<Node<H::T>>,
    pub(super) addrs: Vec<SocketAddr>,
    pub(super) heartbeat: Duration,
    pub(super) arena_len: usize,
}

impl<H: Harness> Mesh<H> {
    /// Binds `n` nodes, links them, and checks every node saw `PeerUp` for each other one.
    pub(super) fn new(n: usize, arena_len: usize, heartbeat: Duration) -> Mesh<H> {
        let mut nodes = Vec::new();
        let mut addrs = Vec::new();
        for id in 0..n as NodeId {
            let node = bind_node::<H>(id, heartbeat, arena_len);
            addrs.push(
                node.t
                    .listen_addr()
                    .expect("the transport reports its address"),
            );
            nodes.push(node);
        }
        let mesh: Mesh<H> = Mesh {
            nodes,
            addrs,
            heartbeat,
            arena_len,
        };
        let peers = mesh.peers();
        let linking: Vec<_> = mesh
            .nodes
            .iter()
            .map(|node: &Node<H::T>| {
                let t = node.t.clone();
                let peers = peers.clone();
                std::thread::spawn(move || H::connect(&t, &peers, false))
            })
            .collect();
        for (id, h) in linking.into_iter().enumerate() {
            h.join()
                .expect("connect thread")
                .unwrap_or_else(|e| panic!("node {id}: connect: {e}"));
        }
        for node in &mesh.nodes {
            let others: BTreeSet<NodeId> = (0..n as NodeId).filter(|&p| p != node.id).collect();
            assert_eq!(
                mesh.peers_up(node, others.len()),
                others,
                "PeerUp once per peer"
            );
            for &p in &others {
                assert!(node.t.is_connected(p), "node {} linked to {p}", node.id);
            }
        }
        mesh
    }

    pub(super) fn peers(&self) -> Vec<(NodeId, SocketAddr)> {
        self.addrs
            .iter()
            .enumerate()
            .map(|(i, a)| (i as NodeId, *a))
            .collect()
    }

    /// Takes `count` events from `node`, which must all be `PeerUp`; returns their peers.
    pub(super) fn peers_up(&self, node: &Node<H::T>, count: usize) -> BTreeSet<NodeId> {
        let mut up = BTreeSet::new();
        for _ in 0..count {
            match node.next(WAIT, "PeerUp") {
                Event::PeerUp { peer } => {
                    assert!(up.insert(peer), "node {}: PeerUp of {peer} twice", node.id)
                }
                other => panic!("node {}: expected PeerUp, got {other:?}", node.id),
            }
        }
        up
    }

    pub(super) fn node(&self, id: NodeId) -> &Node<H::T> {
        &self.nodes[id as usize]
    }

    pub(super) fn ids(&self) -> std::ops::Range<NodeId> {
        0..self.nodes.len() as NodeId
    }

    /// Restarts node `id` (after its `kill`): a new transport on a new port dials everybody.
    /// Returns once its links are up (it saw `PeerUp` for every other node).
    pub(super) fn restart(&mut self, id: NodeId) {
        let node = bind_node::<H>(id, self.heartbeat, self.arena_len);
        self.addrs[id as usize] = node.t.listen_addr().expect("listen address");
        H::connect(&node.t, &self.peers(), true)
            .unwrap_or_else(|e| panic!("node {id}: rejoin: {e}"));
        let others: BTreeSet<NodeId> = self.ids().filter(|&p| p != id).collect();
        assert_eq!(self.peers_up(&node, others.len()), others, "rejoin links");
        self.nodes[id as usize] = node;
    }
}

impl<H: Harness> Drop for Mesh<H> {
    fn drop(&mut self) {
        for node in &self.nodes {
            node.t.shutdown();
        }
    }
}

pub(super) fn bind_node<H: Harness>(
    id: NodeId,
    heartbeat: Duration,
    arena_len: usize,
) -> Node<H::T> {
    let t = H::bind(id, heartbeat).unwrap_or_else(|e| panic!("node {id}: bind: {e}"));
    let arena = Arc::new(Arena::new(arena_len, false).expect("arena"));
    t.register_arena(arena.clone())
        .unwrap_or_else(|e| panic!("node {id}: register arena: {e}"));
    let events = t.events();
    Node {
        id,
        t,
        arena,
        events,
    }
}
