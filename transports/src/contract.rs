//! The transport contract: one test suite, generic over [`Transport`], that every transport
//! runs: TCP in `transports/tests/contract_tcp.rs` (every `cargo test`), verbs in
//! `rdma/tests/contract_verbs.rs` (in the Soft-RoCE VM). Built only with the `contract`
//! feature, so the plain library carries no test code.
//!
//! A transport plugs in through a [`Harness`] (how to bind a node and link a mesh);
//! [`transport_contract_tests!`](crate::transport_contract_tests) expands to one `#[test]`
//! per case, so `cargo test` counts them. Each case is a public function generic over the
//! harness and asserts what the [`Transport`] documentation promises: control messages in
//! order, data events in order and contiguous with the bytes in place, a control message
//! after a write seen after that write's data, the `MAX_CTRL_LEN` boundary, typed errors for
//! invalid operations, exact counters, a killed peer reported down exactly once within the
//! heartbeat bound (and operations towards it failing), rejoin after a restart, and a
//! shutdown that peers see as a leave (`PEER_LEFT`), not a failure.
//!
//! Environment knobs (for the slow emulated VM):
//! - `PHALANX_CONTRACT_MAX_BYTES`: size of the large write (default 64 MiB, at least 2 MiB;
//!   suffixes K, M, G allowed);
//! - `PHALANX_CONTRACT_HEARTBEAT_MS`: heartbeat timeout of the failure cases (default: the
//!   harness's [`Harness::heartbeat`]).

use crate::{Arena, Event, NodeId, RemoteRegion, Transport, TransportError, TransportStats};
use crate::{MAX_CTRL_LEN, PEER_LEFT};
use crossbeam_channel::{Receiver, RecvTimeoutError};
use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the suite builds nodes of one transport kind.
pub trait Harness: 'static {
    type T: Transport + Clone;

    /// Why the transport cannot run on this host (e.g. "no RDMA device"); `None` to run.
    /// A case that cannot run prints `<case>: <reason>: skipped` and passes.
    fn unavailable() -> Option<String> {
        None
    }

    /// Heartbeat timeout of the cases that kill nodes; keep it short (a few hundred ms on a
    /// real host) so the suite takes seconds.
    fn heartbeat() -> Duration;

    /// Binds node `id` on an OS-assigned loopback port with this heartbeat timeout. The
    /// transport must report the bound address through [`Transport::listen_addr`].
    fn bind(id: NodeId, heartbeat: Duration) -> Result<Self::T, TransportError>;

    /// Links `t` to `peers` (the transport's `connect`; `dial_all` for a restarted node).
    fn connect(
        t: &Self::T,
        peers: &[(NodeId, SocketAddr)],
        dial_all: bool,
    ) -> Result<(), TransportError>;
}

/// Heartbeat of the cases that kill nobody: long enough that a loaded machine never sees a
/// spurious failure.
const CALM_HEARTBEAT: Duration = Duration::from_secs(5);
/// Longest wait for an event that must come (setup, small transfers) on a slow VM.
const WAIT: Duration = Duration::from_secs(60);
/// Longest wait for the data of a large write.
const WAIT_LARGE: Duration = Duration::from_secs(300);
/// Scheduling slack on top of a failure detection bound.
const SLACK: Duration = Duration::from_millis(300);
/// Default size of the large write.
const DEFAULT_MAX_BYTES: u64 = 64 << 20;

/// Runs one case unless the harness says the transport is unavailable here.
pub fn run<H: Harness>(case: &str, f: fn()) {
    if let Some(why) = H::unavailable() {
        // To the real stderr, past the test harness's capture, so a plain `cargo test` run
        // shows the skip (and scripts can count it).
        // One write, so parallel tests cannot split the line.
        use std::io::Write;
        let line = format!("{case}: {why}: skipped\n");
        let _ = std::io::stderr().write_all(line.as_bytes());
        return;
    }
    f();
}

/// Size of the large write: `PHALANX_CONTRACT_MAX_BYTES` or 64 MiB, at least 2 MiB.
pub fn max_bytes() -> u64 {
    let Ok(v) = std::env::var("PHALANX_CONTRACT_MAX_BYTES") else {
        return DEFAULT_MAX_BYTES;
    };
    let v = v.trim();
    let (num, mul) = match v.chars().last() {
        Some('K' | 'k') => (&v[..v.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&v[..v.len() - 1], 1 << 20),
        Some('G' | 'g') => (&v[..v.len() - 1], 1 << 30),
        _ => (v, 1),
    };
    let n: u64 = num
        .parse()
        .unwrap_or_else(|_| panic!("PHALANX_CONTRACT_MAX_BYTES={v}: not a size"));
    (n * mul).max(2 << 20)
}

/// Heartbeat timeout of the failure cases.
pub fn heartbeat<H: Harness>() -> Duration {
    match std::env::var("PHALANX_CONTRACT_HEARTBEAT_MS") {
        Ok(v) => Duration::from_millis(
            v.trim()
                .parse()
                .unwrap_or_else(|_| panic!("PHALANX_CONTRACT_HEARTBEAT_MS={v}: not a number")),
        ),
        Err(_) => H::heartbeat(),
    }
}

/// How long after a death every survivor must have reported it: the timeout, plus the half
/// heartbeat period a silence check may lag, plus scheduling slack.
fn detection_bound(hb: Duration) -> Duration {
    hb + hb / 2 + SLACK
}

// ------------------------------------------------------------------------------- the mesh

struct Node<T> {
    id: NodeId,
    t: T,
    arena: Arc<Arena>,
    events: Receiver<Event>,
}

impl<T: Transport> Node<T> {
    /// The next event, which must come within `within`.
    fn next(&self, within: Duration, waiting_for: &str) -> Event {
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
    fn quiet(&self, dur: Duration, why: &str) {
        if let Ok(ev) = self.events.recv_timeout(dur) {
            panic!("node {}: unexpected event {ev:?} ({why})", self.id);
        }
    }

    /// Asserts that no event is queued right now.
    fn nothing_queued(&self, why: &str) {
        if let Ok(ev) = self.events.try_recv() {
            panic!("node {}: unexpected event {ev:?} ({why})", self.id);
        }
    }

    /// The next event must be this control message.
    fn expect_ctrl(&self, from: NodeId, msg: &[u8]) {
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

    /// The next event must be `PeerDown { peer }`; returns its reason.
    fn expect_down(&self, peer: NodeId, within: Duration) -> String {
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
    fn expect_data(
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
    fn use_handler(&mut self) -> bool {
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
struct Coverage {
    from: NodeId,
    stream: u64,
    mark: u64,
    end: u64,
}

impl Coverage {
    fn new(from: NodeId, stream: u64, start: u64, len: u64) -> Coverage {
        Coverage {
            from,
            stream,
            mark: start,
            end: start + len,
        }
    }

    fn complete(&self) -> bool {
        self.mark == self.end
    }

    /// Takes a data event of this stream (checking it continues the range exactly); false for
    /// any other event.
    fn take(&mut self, ev: &Event) -> bool {
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
struct Mesh<H: Harness> {
    nodes: Vec<Node<H::T>>,
    addrs: Vec<SocketAddr>,
    heartbeat: Duration,
    arena_len: usize,
}

impl<H: Harness> Mesh<H> {
    /// Binds `n` nodes, links them, and checks every node saw `PeerUp` for each other one.
    fn new(n: usize, arena_len: usize, heartbeat: Duration) -> Mesh<H> {
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

    fn peers(&self) -> Vec<(NodeId, SocketAddr)> {
        self.addrs
            .iter()
            .enumerate()
            .map(|(i, a)| (i as NodeId, *a))
            .collect()
    }

    /// Takes `count` events from `node`, which must all be `PeerUp`; returns their peers.
    fn peers_up(&self, node: &Node<H::T>, count: usize) -> BTreeSet<NodeId> {
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

    fn node(&self, id: NodeId) -> &Node<H::T> {
        &self.nodes[id as usize]
    }

    fn ids(&self) -> std::ops::Range<NodeId> {
        0..self.nodes.len() as NodeId
    }

    /// Restarts node `id` (after its `kill`): a new transport on a new port dials everybody.
    /// Returns once its links are up (it saw `PeerUp` for every other node).
    fn restart(&mut self, id: NodeId) {
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

fn bind_node<H: Harness>(id: NodeId, heartbeat: Duration, arena_len: usize) -> Node<H::T> {
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

// ------------------------------------------------------------------------------ helpers

/// Deterministic bytes for `[offset, offset + len)` of `arena`.
fn fill(arena: &Arena, offset: u64, len: u64, seed: u64) {
    // SAFETY: the cases own their source ranges; nothing writes them concurrently.
    let s = unsafe { arena.slice_mut(offset, len) };
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in s.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

/// Sets `[offset, offset + len)` of `arena` to `byte`.
fn paint(arena: &Arena, offset: u64, len: u64, byte: u8) {
    // SAFETY: the cases own the receiving arena before a transfer starts.
    unsafe { arena.slice_mut(offset, len) }.fill(byte);
}

/// Asserts that `len` bytes at `src` in `a` equal those at `dst` in `b`.
fn assert_same(a: &Arena, src: u64, b: &Arena, dst: u64, len: u64, what: &str) {
    // SAFETY: the transfer into `b` completed (all its data events arrived) and nothing
    // writes either range any more.
    let (x, y) = unsafe { (a.slice(src, len), b.slice(dst, len)) };
    assert_bytes(y, x, what);
}

/// Asserts `[offset, offset + len)` of `arena` still holds `byte` (bytes next to a write).
fn assert_untouched(arena: &Arena, offset: u64, len: u64, byte: u8, what: &str) {
    // SAFETY: no transfer targets this range.
    let s = unsafe { arena.slice(offset, len) };
    if let Some(i) = s.iter().position(|&b| b != byte) {
        panic!(
            "{what}: byte {} changed to {:#04x} (outside the written range)",
            offset + i as u64,
            s[i]
        );
    }
}

fn assert_bytes(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(g, w)| g != w) {
        panic!(
            "{what}: byte {i} of {} differs: {:#04x} instead of {:#04x}",
            want.len(),
            got[i],
            want[i]
        );
    }
}

/// Message `i` from `from` to `to`: `len` bytes that differ between messages.
fn message(from: NodeId, to: NodeId, i: u64, len: usize) -> Vec<u8> {
    let mut m: Vec<u8> = (0..len)
        .map(|j| (j as u64 * 251 + i * 17 + from as u64 * 5 + to as u64 * 3) as u8)
        .collect();
    let tag = (i as u32).to_le_bytes();
    let n = len.min(4);
    m[..n].copy_from_slice(&tag[..n]);
    m
}

/// Counters of `after` minus `before`; counters never go down.
fn delta(after: TransportStats, before: TransportStats) -> TransportStats {
    let d = |a: u64, b: u64, name: &str| {
        a.checked_sub(b)
            .unwrap_or_else(|| panic!("counter {name} went down from {b} to {a}"))
    };
    TransportStats {
        ctrl_sent: d(after.ctrl_sent, before.ctrl_sent, "ctrl_sent"),
        ctrl_received: d(after.ctrl_received, before.ctrl_received, "ctrl_received"),
        data_bytes_sent: d(
            after.data_bytes_sent,
            before.data_bytes_sent,
            "data_bytes_sent",
        ),
        data_bytes_received: d(
            after.data_bytes_received,
            before.data_bytes_received,
            "data_bytes_received",
        ),
        payload_bytes_copied: d(
            after.payload_bytes_copied,
            before.payload_bytes_copied,
            "payload_bytes_copied",
        ),
        registrations: d(after.registrations, before.registrations, "registrations"),
        peers_down: d(after.peers_down, before.peers_down, "peers_down"),
        malformed_frames: d(
            after.malformed_frames,
            before.malformed_frames,
            "malformed_frames",
        ),
    }
}

/// An operation towards `peer`, which is gone, must fail naming it.
fn assert_gone<X: std::fmt::Debug>(r: Result<X, TransportError>, peer: NodeId, op: &str) {
    match r {
        Err(TransportError::PeerUnavailable(p)) => assert_eq!(p, peer, "{op}: error names"),
        Err(TransportError::PeerFailed { peer: p, .. }) => {
            assert_eq!(p, peer, "{op}: error names")
        }
        other => panic!(
            "{op} towards gone peer {peer}: expected PeerUnavailable or PeerFailed, got {other:?}"
        ),
    }
}

/// `send_nonblocking` towards a peer that is gone: not sent, and an error names the peer
/// (`Ok(false)` is the trait's default for transports without a non-blocking path).
fn assert_gone_nonblocking(r: Result<bool, TransportError>, peer: NodeId) {
    match r {
        Ok(false) => {}
        other => assert_gone(other, peer, "send_nonblocking"),
    }
}

// ------------------------------------------------------------------------------ the cases

/// Control messages, from every node to every other one concurrently, arrive intact and in
/// the order sent, and the counters count each exactly once.
pub fn ctrl_messages_keep_their_order<H: Harness>() {
    const N: u64 = 400;
    // Sizes around and above an eager block of the verbs transport (8 KiB by default), so
    // fragmented messages are in the mix.
    const SIZES: [usize; 9] = [0, 1, 3, 100, 1000, 8100, 8200, 20_000, 65_536];
    let mesh = Mesh::<H>::new(3, 1 << 20, CALM_HEARTBEAT);
    let before: Vec<TransportStats> = mesh.nodes.iter().map(|n| n.t.stats()).collect();
    let senders: Vec<_> = mesh
        .nodes
        .iter()
        .map(|node| {
            let t = node.t.clone();
            let me = node.id;
            std::thread::spawn(move || {
                for i in 0..N {
                    for to in (0..3).filter(|&p| p != me) {
                        let m = message(me, to, i, SIZES[(i as usize + to as usize) % 9]);
                        t.send(to, &m)
                            .unwrap_or_else(|e| panic!("send {me}->{to} #{i}: {e}"));
                    }
                }
            })
        })
        .collect();
    for node in &mesh.nodes {
        let mut next: HashMap<NodeId, u64> = HashMap::new();
        for _ in 0..2 * N {
            match node.next(WAIT, "control messages") {
                Event::Ctrl { peer, msg } => {
                    assert!(peer < 3 && peer != node.id, "sender {peer}");
                    let i = next.entry(peer).or_insert(0);
                    assert!(*i < N, "more than {N} messages from {peer}");
                    let want = message(
                        peer,
                        node.id,
                        *i,
                        SIZES[(*i as usize + node.id as usize) % 9],
                    );
                    assert_bytes(&msg, &want, &format!("message {i} {peer}->{}", node.id));
                    *i += 1;
                }
                other => panic!("node {}: unexpected event {other:?}", node.id),
            }
        }
        node.nothing_queued("every message arrived once");
    }
    for s in senders {
        s.join().expect("sender");
    }
    for (node, b) in mesh.nodes.iter().zip(before) {
        let d = delta(node.t.stats(), b);
        assert_eq!(d.ctrl_sent, 2 * N, "node {}: ctrl_sent", node.id);
        assert_eq!(d.ctrl_received, 2 * N, "node {}: ctrl_received", node.id);
        assert_eq!(
            d.malformed_frames + d.peers_down,
            0,
            "node {}: {d:?}",
            node.id
        );
    }
}

/// A control message sent after writes (from the same thread) arrives after all their data
/// events, for small, eager-sized, unaligned and multi-chunk writes, with no waiting between
/// the rounds.
pub fn ctrl_after_write_follows_its_data<H: Harness>() {
    // Per round: the streams written before the round's control message, with their sizes.
    let rounds: Vec<Vec<u64>> = vec![
        vec![1],
        vec![4096],
        vec![8191],
        vec![8192],
        vec![100_003],
        vec![(3 << 20) + 7],
        vec![10, 70_000, (1 << 20) + 1],
    ];
    let total: u64 = rounds.iter().flatten().map(|l| l + 8).sum();
    let mesh = Mesh::<H>::new(2, total as usize + 4096, CALM_HEARTBEAT);
    let (a, b) = (mesh.node(0), mesh.node(1));
    // Layout: write k of the whole run goes from `off` in a's arena to `off` in b's.
    let mut plan = Vec::new();
    let mut off = 0u64;
    for (r, lens) in rounds.iter().enumerate() {
        let mut writes = Vec::new();
        for (k, &len) in lens.iter().enumerate() {
            let stream = (r * 10 + k) as u64 + 1;
            fill(&a.arena, off, len, stream);
            writes.push((stream, off, len));
            off += len + 8;
        }
        plan.push(writes);
    }
    let regions: Vec<Vec<RemoteRegion>> = plan
        .iter()
        .map(|ws| {
            ws.iter()
                .map(|&(_, off, len)| b.t.remote_region(off, len).expect("region"))
                .collect()
        })
        .collect();
    let ta = a.t.clone();
    let plan2 = plan.clone();
    let sender = std::thread::spawn(move || {
        for (r, (ws, regs)) in plan2.iter().zip(&regions).enumerate() {
            for (&(stream, off, len), reg) in ws.iter().zip(regs) {
                ta.write(1, stream, off, reg, 0, len)
                    .unwrap_or_else(|e| panic!("write stream {stream}: {e}"));
            }
            ta.send(1, format!("after round {r}").as_bytes())
                .expect("send");
        }
    });
    for (r, ws) in plan.iter().enumerate() {
        let mut cover: Vec<Coverage> = ws
            .iter()
            .map(|&(stream, _, len)| Coverage::new(0, stream, 0, len))
            .collect();
        loop {
            let ev = b.next(WAIT_LARGE, "data or the round's control message");
            if let Event::Ctrl { peer, msg } = &ev {
                assert_eq!(*peer, 0);
                assert_bytes(
                    msg,
                    format!("after round {r}").as_bytes(),
                    "control message",
                );
                for c in &cover {
                    assert!(
                        c.complete(),
                        "round {r}: control message before the end of stream {}'s data ({} of {})",
                        c.stream,
                        c.mark,
                        c.end
                    );
                }
                break;
            }
            assert!(
                cover.iter_mut().any(|c| c.take(&ev)),
                "round {r}: unexpected event {ev:?}"
            );
        }
        for &(stream, off, len) in ws {
            assert_same(
                &a.arena,
                off,
                &b.arena,
                off,
                len,
                &format!("stream {stream}"),
            );
        }
    }
    sender.join().expect("sender");
    b.nothing_queued("no event after the last round");
}

/// Concurrent writes on several streams, in both directions, each a sequence of writes of
/// mixed sizes continuing at an offset inside a region: the receiver sees each stream's data
/// events in order, contiguous and covering exactly the written range, with the bytes in
/// place and the bytes around the range untouched.
pub fn data_events_cover_each_stream_exactly<H: Harness>() {
    const LENS: [u64; 6] = [1, 5000, 70_001, (1 << 20) + 3, 8192, 333];
    const STREAMS: u64 = 2; // per direction
    const LEAD: u64 = 3; // first byte written at this offset of the region
    const GUARD: u64 = 64; // sentinel bytes checked before and after each region's range
    const SENTINEL: u8 = 0xEE;
    let per_stream: u64 = LENS.iter().sum();
    let slot = (per_stream + LEAD + 2 * GUARD).next_multiple_of(4096);
    let arena_len = (STREAMS as usize) * slot as usize * 2;
    let mesh = Mesh::<H>::new(2, arena_len, CALM_HEARTBEAT);
    // Stream s of sender `from` reads `[s * slot, +per_stream)` of its own arena and lands at
    // the receiver in `[base + GUARD + LEAD, +per_stream)`, base = (STREAMS + s) * slot.
    struct Plan {
        from: NodeId,
        to: NodeId,
        stream: u64,
        src: u64,
        region: RemoteRegion,
    }
    let mut plans = Vec::new();
    for from in 0..2 {
        let to = 1 - from;
        let (src_node, dst_node) = (mesh.node(from), mesh.node(to));
        for s in 0..STREAMS {
            let src = s * slot;
            fill(
                &src_node.arena,
                src,
                per_stream,
                1000 + from as u64 * 10 + s,
            );
            let base = (STREAMS + s) * slot;
            paint(&dst_node.arena, base, slot, SENTINEL);
            let region = dst_node
                .t
                .remote_region(base + GUARD, LEAD + per_stream)
                .expect("region");
            plans.push(Plan {
                from,
                to,
                stream: 50 + from as u64 * 10 + s,
                src,
                region,
            });
        }
    }
    let writers: Vec<_> = plans
        .iter()
        .map(|p| {
            let t = mesh.node(p.from).t.clone();
            let (to, stream, src, region) = (p.to, p.stream, p.src, p.region);
            std::thread::spawn(move || {
                let mut done = 0;
                for len in LENS {
                    t.write(to, stream, src + done, &region, LEAD + done, len)
                        .unwrap_or_else(|e| panic!("write stream {stream}: {e}"));
                    done += len;
                }
            })
        })
        .collect();
    for to in 0..2 {
        let node = mesh.node(to);
        let mut cover: Vec<Coverage> = plans
            .iter()
            .filter(|p| p.to == to)
            .map(|p| Coverage::new(p.from, p.stream, LEAD, per_stream))
            .collect();
        while !cover.iter().all(Coverage::complete) {
            let ev = node.next(WAIT_LARGE, "data events");
            assert!(
                cover.iter_mut().any(|c| c.take(&ev)),
                "node {to}: unexpected event {ev:?}"
            );
        }
    }
    for w in writers {
        w.join().expect("writer");
    }
    for p in &plans {
        let (src, dst) = (mesh.node(p.from), mesh.node(p.to));
        let at = p.region.offset + LEAD;
        let what = format!("stream {}", p.stream);
        assert_same(&src.arena, p.src, &dst.arena, at, per_stream, &what);
        assert_untouched(&dst.arena, at - LEAD - GUARD, GUARD + LEAD, SENTINEL, &what);
        assert_untouched(&dst.arena, at + per_stream, GUARD, SENTINEL, &what);
    }
    for node in &mesh.nodes {
        node.nothing_queued("no data event beyond the written ranges");
    }
}

/// Small writes (1 byte up to 4 KiB, below any eager threshold) at unaligned offsets land
/// exactly: the bytes in place, their neighbours untouched, data events covering the range.
pub fn small_writes_land_exactly<H: Harness>() {
    const SIZES: [u64; 10] = [1, 2, 3, 7, 63, 64, 511, 1000, 4095, 4096];
    const SENTINEL: u8 = 0x5A;
    let mesh = Mesh::<H>::new(2, 1 << 20, CALM_HEARTBEAT);
    let (a, b) = (mesh.node(0), mesh.node(1));
    let s0 = (a.t.stats(), b.t.stats());
    let region = b.t.remote_region(8192, 512 << 10).expect("region");
    paint(&b.arena, 0, 1 << 20, SENTINEL);
    let mut at = 1; // offset inside the region, odd on purpose
    for (i, &len) in SIZES.iter().enumerate() {
        let src = 4096 * i as u64 + 13;
        fill(&a.arena, src, len, i as u64 + 7);
        a.t.write(1, i as u64, src, &region, at, len)
            .unwrap_or_else(|e| panic!("write of {len} bytes: {e}"));
        b.expect_data(0, i as u64, at, len, WAIT);
        let what = format!("write of {len} bytes");
        let dst = region.offset + at;
        assert_same(&a.arena, src, &b.arena, dst, len, &what);
        assert_untouched(&b.arena, dst - 1, 1, SENTINEL, &what);
        assert_untouched(&b.arena, dst + len, 1, SENTINEL, &what);
        at += len + 2;
    }
    let total: u64 = SIZES.iter().sum();
    let (da, db) = (delta(a.t.stats(), s0.0), delta(b.t.stats(), s0.1));
    assert_eq!(da.data_bytes_sent, total, "sender data_bytes_sent");
    assert_eq!(
        db.data_bytes_received, total,
        "receiver data_bytes_received"
    );
    assert_eq!(
        da.ctrl_sent + db.ctrl_received,
        0,
        "writes are not control messages"
    );
    b.nothing_queued("one set of events per write");
}

/// One large write (`PHALANX_CONTRACT_MAX_BYTES`, 64 MiB by default; many chunks) from an
/// unaligned source to an unaligned destination lands exactly, its data events in order and
/// contiguous, and the counters count its bytes once.
pub fn large_write_lands_exactly<H: Harness>() {
    const SENTINEL: u8 = 0xC3;
    let len = max_bytes() - 5;
    let arena_len = (len + (64 << 10)) as usize;
    let mesh = Mesh::<H>::new(2, arena_len, CALM_HEARTBEAT);
    let (a, b) = (mesh.node(0), mesh.node(1));
    let (src, base, at) = (4097u64, 8192u64, 7u64);
    fill(&a.arena, src, len, 99);
    paint(&b.arena, 0, arena_len as u64, SENTINEL);
    let region = b.t.remote_region(base, at + len + 1).expect("region");
    let s0 = (a.t.stats(), b.t.stats());
    let t0 = Instant::now();
    let ta = a.t.clone();
    let w = std::thread::spawn(move || ta.write(1, 77, src, &region, at, len));
    let events = b.expect_data(0, 77, at, len, WAIT_LARGE);
    let secs = t0.elapsed().as_secs_f64();
    w.join().expect("writer").expect("large write");
    let what = format!("write of {len} bytes");
    assert_same(&a.arena, src, &b.arena, base + at, len, &what);
    assert_untouched(&b.arena, 0, base + at, SENTINEL, &what);
    let end = base + at + len;
    assert_untouched(&b.arena, end, arena_len as u64 - end, SENTINEL, &what);
    let (da, db) = (delta(a.t.stats(), s0.0), delta(b.t.stats(), s0.1));
    assert_eq!(da.data_bytes_sent, len, "sender data_bytes_sent");
    assert_eq!(db.data_bytes_received, len, "receiver data_bytes_received");
    b.nothing_queued("nothing after the last data event");
    println!(
        "{} {len} bytes: {events} data events, {:.1} MB/s",
        a.t.name(),
        len as f64 / secs / 1e6
    );
}

/// A control message of exactly `MAX_CTRL_LEN` bytes goes through (both ways); one byte more
/// is refused with `MessageTooLarge`, counts nothing and costs no link.
pub fn max_ctrl_len_is_the_limit<H: Harness>() {
    let mesh = Mesh::<H>::new(2, 1 << 20, CALM_HEARTBEAT);
    let s0: Vec<TransportStats> = mesh.nodes.iter().map(|n| n.t.stats()).collect();
    for from in 0..2 {
        let (src, dst) = (mesh.node(from), mesh.node(1 - from));
        let big = message(from, 1 - from, 1, MAX_CTRL_LEN);
        src.t
            .send(dst.id, &big)
            .expect("a message of MAX_CTRL_LEN bytes");
        dst.expect_ctrl(from, &big);
        let over = vec![7u8; MAX_CTRL_LEN + 1];
        match src.t.send(dst.id, &over) {
            Err(TransportError::MessageTooLarge { len, max }) => {
                assert_eq!((len, max), (MAX_CTRL_LEN + 1, MAX_CTRL_LEN))
            }
            other => panic!("send of MAX_CTRL_LEN + 1 bytes: {other:?}"),
        }
        match src.t.send_nonblocking(dst.id, &over) {
            Err(TransportError::MessageTooLarge { len, max }) => {
                assert_eq!((len, max), (MAX_CTRL_LEN + 1, MAX_CTRL_LEN))
            }
            Ok(false) => {} // the trait's default: nothing sent
            other => panic!("send_nonblocking of MAX_CTRL_LEN + 1 bytes: {other:?}"),
        }
        src.t
            .send(dst.id, b"still linked")
            .expect("send after a refusal");
        dst.expect_ctrl(from, b"still linked");
    }
    for (node, s) in mesh.nodes.iter().zip(s0) {
        let d = delta(node.t.stats(), s);
        assert_eq!(
            (d.ctrl_sent, d.ctrl_received),
            (2, 2),
            "node {}: {d:?}",
            node.id
        );
        assert_eq!(
            d.malformed_frames + d.peers_down,
            0,
            "node {}: {d:?}",
            node.id
        );
        assert!(
            node.t.is_connected(1 - node.id),
            "node {}: link kept",
            node.id
        );
        node.nothing_queued("no failure after a refused message");
    }
}

/// Invalid operations fail with their typed error, send nothing and cost no link: unknown
/// peer, ranges outside the arena or the region, a second arena, no arena at all.
pub fn invalid_operations_fail_with_typed_errors<H: Harness>() {
    let arena_len = 1u64 << 20;
    let mesh = Mesh::<H>::new(2, arena_len as usize, CALM_HEARTBEAT);
    let (a, b) = (mesh.node(0), mesh.node(1));
    let s0 = (a.t.stats(), b.t.stats());
    let region = b.t.remote_region(4096, 8192).expect("region");
    assert_eq!(
        (region.node, region.offset, region.len),
        (1, 4096, 8192),
        "the region names its node and range"
    );
    assert!(b.t.remote_region(0, arena_len).is_ok(), "the whole arena");
    let oob = |r: Result<(), TransportError>, what: &str| match r {
        Err(TransportError::OutOfBounds { .. }) => {}
        other => panic!("{what}: expected OutOfBounds, got {other:?}"),
    };
    oob(
        b.t.remote_region(arena_len, 1).map(drop),
        "region past the arena",
    );
    oob(
        b.t.remote_region(1, arena_len).map(drop),
        "region overlapping the end",
    );
    oob(
        b.t.remote_region(u64::MAX, 2).map(drop),
        "region overflowing u64",
    );
    oob(
        a.t.write(1, 1, 0, &region, 1, 8192),
        "write past the region's end",
    );
    oob(
        a.t.write(1, 1, 0, &region, 8192, 1),
        "write at the region's end",
    );
    oob(
        a.t.write(1, 1, arena_len - 10, &region, 0, 11),
        "source past the arena",
    );
    oob(
        a.t.write(1, 1, u64::MAX, &region, 0, 2),
        "source overflowing u64",
    );
    assert_gone(a.t.send(42, b"x"), 42, "send to an unknown peer");
    assert_gone(
        a.t.write(42, 1, 0, &region, 0, 1),
        42,
        "write to an unknown peer",
    );
    assert_gone_nonblocking(a.t.send_nonblocking(42, b"x"), 42);
    match a
        .t
        .register_arena(Arc::new(Arena::new(4096, false).expect("arena")))
    {
        Err(TransportError::ArenaAlreadyRegistered) => {}
        other => panic!("second register_arena: {other:?}"),
    }
    // Nothing went out: the next event at b is this message.
    a.t.send(1, b"after the errors").expect("send");
    b.expect_ctrl(0, b"after the errors");
    let (da, db) = (delta(a.t.stats(), s0.0), delta(b.t.stats(), s0.1));
    assert_eq!(
        da.data_bytes_sent + db.data_bytes_received,
        0,
        "no data moved"
    );
    assert_eq!((da.ctrl_sent, db.ctrl_received), (1, 1), "one message");
    assert_eq!(da.registrations + db.registrations, 0, "no registration");
    assert!(a.t.is_connected(1) && b.t.is_connected(0), "links kept");
    a.nothing_queued("failed operations send nothing");
    // A node without an arena has no region to hand out and nothing to write from.
    let lone = H::bind(7, CALM_HEARTBEAT).expect("bind");
    match lone.remote_region(0, 1) {
        Err(TransportError::NoArena) => {}
        other => panic!("remote_region without an arena: {other:?}"),
    }
    match lone.write(0, 1, 0, &region, 0, 1) {
        Err(TransportError::NoArena) => {}
        other => panic!("write without an arena: {other:?}"),
    }
    lone.shutdown();
}

/// `send_nonblocking` interleaved with `send` from one thread: whatever it reports sent
/// arrives, in order with the blocking sends; what it reports not sent never arrives.
pub fn nonblocking_sends_keep_order<H: Harness>() {
    const N: u64 = 600;
    let mesh = Mesh::<H>::new(2, 1 << 20, CALM_HEARTBEAT);
    let (a, b) = (mesh.node(0), mesh.node(1));
    let s0 = a.t.stats();
    let mut sent = Vec::new();
    let mut nonblocking = 0;
    for i in 0..N {
        let m = message(0, 1, i, 16 + (i as usize * 97) % 3000);
        if i % 2 == 0 {
            a.t.send(1, &m).expect("send");
            sent.push(m);
        } else if a.t.send_nonblocking(1, &m).expect("send_nonblocking") {
            sent.push(m);
            nonblocking += 1;
        }
    }
    for m in &sent {
        b.expect_ctrl(0, m);
    }
    b.nothing_queued("a message reported not sent arrived");
    assert_eq!(
        delta(a.t.stats(), s0).ctrl_sent,
        sent.len() as u64,
        "ctrl_sent counts what was sent"
    );
    println!(
        "{}: {nonblocking} of {} non-blocking sends went out",
        a.t.name(),
        N / 2
    );
}

/// With an event handler installed, events go to it (in the same order a channel would give)
/// and no longer to `events()`; without handler support they keep coming through `events()`.
pub fn event_handler_sees_events_in_order<H: Harness>() {
    let mut mesh = Mesh::<H>::new(2, 4 << 20, CALM_HEARTBEAT);
    let old_channel = mesh.nodes[1].events.clone();
    let taken = mesh.nodes[1].use_handler();
    let (a, b) = (mesh.node(0), mesh.node(1));
    let region = b.t.remote_region(0, 4 << 20).expect("region");
    for r in 0..20u64 {
        let len = [3u64, 5000, 300_000][r as usize % 3];
        let src = r * 200_000 % (2 << 20);
        let dst = r * (100 << 10);
        fill(&a.arena, src, len, r);
        a.t.write(1, r, src, &region, dst, len).expect("write");
        a.t.send(1, &message(0, 1, r, 40)).expect("send");
        b.expect_data(0, r, dst, len, WAIT);
        b.expect_ctrl(0, &message(0, 1, r, 40));
        assert_same(&a.arena, src, &b.arena, dst, len, &format!("write {r}"));
    }
    if taken {
        assert!(
            old_channel.try_recv().is_err(),
            "events went to the handler, not to events()"
        );
    }
    b.nothing_queued("one event per transfer");
}

/// The counters: control messages and data bytes counted exactly once on each side (in both
/// directions at once), no registration per transfer, and heartbeats on an idle link neither
/// count as control messages nor produce events.
pub fn stats_count_exactly<H: Harness>() {
    let hb = heartbeat::<H>();
    let mesh = Mesh::<H>::new(2, 8 << 20, hb);
    let s0: Vec<TransportStats> = mesh.nodes.iter().map(|n| n.t.stats()).collect();
    for s in &s0 {
        assert!(
            s.registrations >= 1,
            "the arena counts as a registration: {s:?}"
        );
        assert_eq!(s.data_bytes_sent + s.data_bytes_received, 0, "{s:?}");
    }
    // Node k sends 10 + k messages and writes `lens[k]`.
    let lens: [&[u64]; 2] = [&[1, 4096, 3 << 20], &[100, (1 << 20) + 1]];
    let threads: Vec<_> = (0..2u32)
        .map(|k| {
            let (src, dst) = (mesh.node(k), mesh.node(1 - k));
            let t = src.t.clone();
            let region = dst.t.remote_region(4 << 20, 4 << 20).expect("region");
            let mine = lens[k as usize];
            std::thread::spawn(move || {
                for i in 0..10 + k as u64 {
                    t.send(1 - k, &message(k, 1 - k, i, 64)).expect("send");
                }
                let mut at = 0;
                for (i, &len) in mine.iter().enumerate() {
                    t.write(1 - k, i as u64, 0, &region, at, len)
                        .expect("write");
                    at += len;
                }
            })
        })
        .collect();
    for k in 0..2u32 {
        let node = mesh.node(1 - k);
        for i in 0..10 + k as u64 {
            node.expect_ctrl(k, &message(k, 1 - k, i, 64));
        }
        let mut at = 0;
        for (i, &len) in lens[k as usize].iter().enumerate() {
            node.expect_data(k, i as u64, at, len, WAIT);
            at += len;
        }
    }
    for t in threads {
        t.join().expect("traffic");
    }
    let s1: Vec<TransportStats> = mesh.nodes.iter().map(|n| n.t.stats()).collect();
    for k in 0..2usize {
        let (me, other) = (delta(s1[k], s0[k]), 1 - k);
        let bytes = |j: usize| lens[j].iter().sum::<u64>();
        assert_eq!(me.ctrl_sent, 10 + k as u64, "node {k}: ctrl_sent");
        assert_eq!(
            me.ctrl_received,
            10 + other as u64,
            "node {k}: ctrl_received"
        );
        assert_eq!(me.data_bytes_sent, bytes(k), "node {k}: data_bytes_sent");
        assert_eq!(
            me.data_bytes_received,
            bytes(other),
            "node {k}: data_bytes_received"
        );
        assert_eq!(
            me.registrations, 0,
            "node {k}: no registration per transfer"
        );
        assert_eq!(me.peers_down + me.malformed_frames, 0, "node {k}: {me:?}");
    }
    // Idle for two heartbeat timeouts: the link stays up and nothing is counted.
    mesh.node(0).quiet(2 * hb, "an idle link has no events");
    mesh.node(1).nothing_queued("an idle link has no events");
    for (k, node) in mesh.nodes.iter().enumerate() {
        let d = delta(node.t.stats(), s1[k]);
        assert_eq!(d, TransportStats::default(), "node {k}: idle counters");
        assert!(
            node.t.is_connected(1 - k as NodeId),
            "node {k}: idle link up"
        );
    }
}

/// A killed node (no goodbye) is reported down by every survivor exactly once, within the
/// heartbeat bound, and not as a leave; a write streaming towards it at that moment fails
/// rather than hangs; every later operation towards it fails; the survivors' own link is
/// unaffected; the killed transport refuses work with `Shutdown`.
pub fn killed_peer_is_reported_down_within_the_bound<H: Harness>() {
    let hb = heartbeat::<H>();
    let bound = detection_bound(hb);
    let mesh = Mesh::<H>::new(3, 4 << 20, hb);
    let victim = 2;
    for from in 0..3 {
        for to in (0..3).filter(|&p| p != from) {
            mesh.node(from).t.send(to, b"hello").expect("send");
        }
    }
    for node in &mesh.nodes {
        // One from each peer, in any order across peers.
        let mut from = BTreeSet::new();
        for _ in 0..2 {
            match node.next(WAIT, "hello") {
                Event::Ctrl { peer, msg } if msg == b"hello" => assert!(from.insert(peer)),
                other => panic!("node {}: expected a hello, got {other:?}", node.id),
            }
        }
        assert_eq!(from, (0..3).filter(|&p| p != node.id).collect());
    }
    let s0: Vec<TransportStats> = mesh.nodes.iter().map(|n| n.t.stats()).collect();
    // Node 0 streams writes into the victim until a write fails.
    let region = mesh
        .node(victim)
        .t
        .remote_region(0, 4 << 20)
        .expect("region");
    let t0 = mesh.node(0).t.clone();
    let writes = Arc::new(AtomicU64::new(0));
    let w = writes.clone();
    let streamer = std::thread::spawn(move || loop {
        let r = t0.write(victim, 9, 0, &region, 0, 256 << 10);
        match r {
            Ok(()) => {
                w.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => return (e, Instant::now()),
        }
    });
    let deadline = Instant::now() + WAIT;
    while writes.load(Ordering::Relaxed) < 2 {
        assert!(
            Instant::now() < deadline,
            "the streaming writes make no progress"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let killed_at = Instant::now();
    mesh.node(victim).t.kill();
    for id in 0..2 {
        let node = mesh.node(id);
        let reason = node.expect_down(victim, bound + WAIT);
        let after = killed_at.elapsed();
        assert!(
            after <= bound,
            "node {id}: PeerDown {after:?} after the kill, bound {bound:?} (heartbeat {hb:?})"
        );
        assert_ne!(
            reason, PEER_LEFT,
            "node {id}: a kill is a failure, not a leave"
        );
        println!(
            "{}: node {id} saw the kill after {after:?}: {reason}",
            node.t.name()
        );
    }
    let (err, failed_at) = streamer.join().expect("streamer");
    assert_gone::<()>(Err(err), victim, "a write in flight to a killed peer");
    let after = failed_at.saturating_duration_since(killed_at);
    assert!(
        after <= bound,
        "the streaming write failed {after:?} after the kill"
    );
    match mesh.node(victim).t.send(0, b"x") {
        Err(TransportError::Shutdown) => {}
        other => panic!("send on a killed transport: expected Shutdown, got {other:?}"),
    }
    for id in 0..2 {
        let t = &mesh.node(id).t;
        assert!(
            !t.is_connected(victim),
            "node {id}: link to the dead peer gone"
        );
        assert_gone(t.send(victim, b"x"), victim, "send");
        assert_gone_nonblocking(t.send_nonblocking(victim, b"x"), victim);
        assert_gone(t.write(victim, 1, 0, &region, 0, 1), victim, "write");
    }
    // Exactly once: nothing more for two heartbeat timeouts, and the survivors still talk.
    mesh.node(0).quiet(2 * hb, "PeerDown exactly once");
    mesh.node(1).nothing_queued("PeerDown exactly once");
    mesh.node(0)
        .t
        .send(1, b"still here")
        .expect("survivors linked");
    mesh.node(1).expect_ctrl(0, b"still here");
    mesh.node(1).t.send(0, b"me too").expect("survivors linked");
    mesh.node(0).expect_ctrl(1, b"me too");
    for id in 0..2 {
        let d = delta(mesh.node(id).t.stats(), s0[id as usize]);
        assert_eq!(d.peers_down, 1, "node {id}: one peer down");
        assert_eq!(d.malformed_frames, 0, "node {id}");
    }
}

/// A killed node that restarts (new transport, new port) and dials everybody after its death
/// was reported: every survivor sees `PeerUp` once, the new incarnation links to all, and
/// control messages and data flow both ways again.
pub fn restarted_peer_rejoins<H: Harness>() {
    let hb = heartbeat::<H>();
    let mut mesh = Mesh::<H>::new(3, 1 << 20, hb);
    let victim = 1;
    mesh.node(victim).t.kill();
    for id in [0, 2] {
        let reason = mesh
            .node(id)
            .expect_down(victim, detection_bound(hb) + WAIT);
        assert_ne!(reason, PEER_LEFT);
    }
    mesh.restart(victim);
    for id in [0, 2] {
        match mesh.node(id).next(WAIT, "PeerUp of the restarted node") {
            Event::PeerUp { peer } => assert_eq!(peer, victim),
            other => panic!("node {id}: expected PeerUp of {victim}, got {other:?}"),
        }
        assert!(mesh.node(id).t.is_connected(victim), "node {id}: relinked");
    }
    assert_eq!(
        mesh.node(victim).t.stats().ctrl_received,
        0,
        "a fresh incarnation"
    );
    check_traffic_with(&mesh, victim);
    for node in &mesh.nodes {
        node.quiet(hb / 2, "no stray event after the rejoin");
    }
}

/// A killed node that restarts at once, before anyone may have noticed its death: every
/// survivor still reports the old incarnation down (a failure, once) and then the new one up
/// (once), in that order, and the new links work. (The old incarnation's state is gone, which
/// is what `PeerDown` tells the layer above.)
pub fn restart_before_detection_reports_down_then_up<H: Harness>() {
    let hb = heartbeat::<H>();
    let mut mesh = Mesh::<H>::new(3, 1 << 20, hb);
    let victim = 1;
    mesh.node(victim).t.kill();
    mesh.restart(victim);
    for id in [0, 2] {
        let node = mesh.node(id);
        let reason = node.expect_down(victim, detection_bound(hb) + WAIT);
        assert_ne!(
            reason, PEER_LEFT,
            "node {id}: a kill is a failure, not a leave"
        );
        match node.next(WAIT, "PeerUp of the restarted node") {
            Event::PeerUp { peer } => assert_eq!(peer, victim, "node {id}"),
            other => panic!("node {id}: expected PeerUp of {victim}, got {other:?}"),
        }
    }
    // The old incarnation's late failure detection must not touch the new link.
    for node in &mesh.nodes {
        node.quiet(2 * hb, "nothing after down/up");
    }
    for id in [0, 2] {
        assert!(mesh.node(id).t.is_connected(victim), "node {id}: relinked");
        assert_eq!(
            mesh.node(id).t.stats().peers_down,
            1,
            "node {id}: one death"
        );
    }
    check_traffic_with(&mesh, victim);
}

/// Control messages and a write each way between `id` and every other node.
fn check_traffic_with<H: Harness>(mesh: &Mesh<H>, id: NodeId) {
    let len = 100_000;
    for other in mesh.ids().filter(|&p| p != id) {
        for (from, to) in [(id, other), (other, id)] {
            let (src, dst) = (mesh.node(from), mesh.node(to));
            let m = message(from, to, 0, 33);
            src.t.send(to, &m).expect("send");
            dst.expect_ctrl(from, &m);
            fill(&src.arena, 0, len, from as u64 * 7 + to as u64);
            let region = dst.t.remote_region(4096, len).expect("region");
            src.t.write(to, 5, 0, &region, 0, len).expect("write");
            dst.expect_data(from, 5, 0, len, WAIT);
            assert_same(
                &src.arena,
                0,
                &dst.arena,
                4096,
                len,
                "write after the rejoin",
            );
        }
    }
}

/// `shutdown` says goodbye: each peer first gets everything the node sent before it (in
/// order), then one `PeerDown` with reason `PEER_LEFT`, promptly (no heartbeat wait) and
/// exactly once; no node reports a failure; operations towards the departed node fail, its
/// own operations fail with `Shutdown`, and the remaining nodes stay linked.
pub fn shutdown_is_a_leave_not_a_failure<H: Harness>() {
    const N: u64 = 50;
    let hb = heartbeat::<H>();
    let mesh = Mesh::<H>::new(3, 1 << 20, hb);
    let leaver = 2;
    let s0: Vec<TransportStats> = mesh.nodes.iter().map(|n| n.t.stats()).collect();
    let l = mesh.node(leaver);
    fill(&l.arena, 0, 20_000, 5);
    for to in 0..2 {
        for i in 0..N {
            l.t.send(to, &message(leaver, to, i, 200)).expect("send");
        }
        let region = mesh.node(to).t.remote_region(0, 20_000).expect("region");
        l.t.write(to, 3, 0, &region, 0, 20_000).expect("write");
        l.t.send(to, b"last words").expect("send");
    }
    let leaver_region = l.t.remote_region(0, 4096).expect("region");
    let left_at = Instant::now();
    l.t.shutdown();
    for id in 0..2 {
        let node = mesh.node(id);
        for i in 0..N {
            node.expect_ctrl(leaver, &message(leaver, id, i, 200));
        }
        node.expect_data(leaver, 3, 0, 20_000, WAIT);
        node.expect_ctrl(leaver, b"last words");
        let reason = node.expect_down(leaver, WAIT);
        assert_eq!(reason, PEER_LEFT, "node {id}: a goodbye is a leave");
        let after = left_at.elapsed();
        assert!(
            after < hb + SLACK,
            "node {id}: the leave took {after:?}, more than a heartbeat timeout ({hb:?})"
        );
        assert_same(
            &l.arena,
            0,
            &node.arena,
            0,
            20_000,
            "data before the goodbye",
        );
    }
    for id in 0..2 {
        let t = &mesh.node(id).t;
        assert!(
            !t.is_connected(leaver),
            "node {id}: link to the leaver closed"
        );
        assert_gone(t.send(leaver, b"x"), leaver, "send");
        assert_gone(t.write(leaver, 1, 0, &leaver_region, 0, 1), leaver, "write");
    }
    match l.t.send(0, b"x") {
        Err(TransportError::Shutdown) => {}
        other => panic!("send on a shut down transport: expected Shutdown, got {other:?}"),
    }
    l.t.shutdown(); // a second shutdown is harmless
                    // Exactly once, and nobody (the leaver included) reports a failure.
    mesh.node(0).quiet(2 * hb, "one PeerDown per leave");
    for node in &mesh.nodes {
        while let Ok(ev) = node.events.try_recv() {
            match ev {
                Event::PeerDown { reason, .. } if reason != PEER_LEFT => {
                    panic!(
                        "node {}: failure reported on a clean shutdown: {reason}",
                        node.id
                    )
                }
                Event::PeerDown { .. } if node.id != leaver => {
                    panic!("node {}: a second PeerDown for one leave", node.id)
                }
                Event::PeerDown { .. } => {}
                other => panic!("node {}: unexpected event {other:?}", node.id),
            }
        }
    }
    mesh.node(0)
        .t
        .send(1, b"carry on")
        .expect("0 and 1 still linked");
    mesh.node(1).expect_ctrl(0, b"carry on");
    for id in 0..2 {
        let d = delta(mesh.node(id).t.stats(), s0[id as usize]);
        assert_eq!(
            d.ctrl_received,
            N + 1 + id as u64,
            "node {id}: ctrl_received"
        );
        assert_eq!(
            d.data_bytes_received, 20_000,
            "node {id}: data_bytes_received"
        );
        assert_eq!(
            d.peers_down, 1,
            "node {id}: the leave counts once in peers_down"
        );
        assert_eq!(d.malformed_frames, 0, "node {id}");
    }
}

/// Expands to one `#[test]` per contract case for the harness type `$h`:
///
/// ```ignore
/// phalanx_transport::transport_contract_tests!(MyHarness);
/// ```
///
/// A transport that is known to break a case (reported, awaiting a fix) names it with the
/// reason; that case is then generated with `#[ignore = reason]`, so `cargo test` shows it as
/// ignored and `--ignored` still runs it:
///
/// ```ignore
/// phalanx_transport::transport_contract_tests!(MyHarness, known_violations: {
///     restarted_peer_rejoins: "issue 42: ...",
/// });
/// ```
#[macro_export]
macro_rules! transport_contract_tests {
    ($h:ty) => {
        $crate::transport_contract_tests!($h, known_violations: {});
    };
    ($h:ty, known_violations: { $($bad:ident: $why:literal),* $(,)? }) => {
        // `$` for the helper macro's own variables.
        $crate::transport_contract_tests!(@helper ($) $h; $($bad: $why),*);
        // A known violation must name a case.
        $(const _: fn() = $crate::contract::$bad::<$h>;)*
        __phalanx_contract_case!(ctrl_messages_keep_their_order);
        __phalanx_contract_case!(ctrl_after_write_follows_its_data);
        __phalanx_contract_case!(data_events_cover_each_stream_exactly);
        __phalanx_contract_case!(small_writes_land_exactly);
        __phalanx_contract_case!(large_write_lands_exactly);
        __phalanx_contract_case!(max_ctrl_len_is_the_limit);
        __phalanx_contract_case!(invalid_operations_fail_with_typed_errors);
        __phalanx_contract_case!(nonblocking_sends_keep_order);
        __phalanx_contract_case!(event_handler_sees_events_in_order);
        __phalanx_contract_case!(stats_count_exactly);
        __phalanx_contract_case!(killed_peer_is_reported_down_within_the_bound);
        __phalanx_contract_case!(restarted_peer_rejoins);
        __phalanx_contract_case!(restart_before_detection_reports_down_then_up);
        __phalanx_contract_case!(shutdown_is_a_leave_not_a_failure);
    };
    (@helper ($d:tt) $h:ty; $($bad:ident: $why:literal),*) => {
        macro_rules! __phalanx_contract_case {
            $(($bad) => {
                #[test]
                #[ignore = $why]
                fn $bad() {
                    $crate::contract::run::<$h>(stringify!($bad), $crate::contract::$bad::<$h>);
                }
            };)*
            ($d case:ident) => {
                #[test]
                fn $d case() {
                    $crate::contract::run::<$h>(
                        stringify!($d case),
                        $crate::contract::$d case::<$h>,
                    );
                }
            };
        }
    };
}
