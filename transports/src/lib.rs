//! Phalanx transports: the [`Transport`] trait, registered memory, the link bookkeeping
//! every transport shares ([`link`]), and the TCP transport.
//!
//! A transport links the nodes of a cluster with three services:
//! - ordered **control messages** ([`Transport::send`]),
//! - **data writes** from the local registered arena into a peer's [`RemoteRegion`]
//!   ([`Transport::write`]); the receiver sees [`Event::Data`] in order per stream, each
//!   saying which bytes have landed, so it can advance a contiguous watermark,
//! - **failure events** ([`Event::PeerDown`]) within a bounded, configurable time.
//!
//! The write shape is that of a one-sided RDMA write: the receiver names the destination
//! (`RemoteRegion`, carrying addr/rkey for verbs) inside its own pre-registered arena, and
//! the sender moves bytes there with no intermediate copy. Every node registers one arena,
//! once, before any transfer.

pub mod auth;
#[cfg(feature = "contract")]
pub mod contract;
mod error;
mod frame;
pub mod grant;
pub mod link;
mod memory;
pub mod tcp;
pub mod threads;

pub use auth::{AuthConfig, ClusterSecret};
pub use error::TransportError;
pub use frame::{FrameHeader, FrameKind, FRAME_HEADER_LEN, MAX_CTRL_LEN};
pub use grant::{GrantTable, KeepAlive};
pub use link::{Counters, EventSink, Link, LinkState, LinkTable};
pub use memory::{Arena, RemoteRegion};
pub use tcp::{TcpConfig, TcpTransport};

use crossbeam_channel::Receiver;
use std::sync::Arc;

/// The `PeerDown` reason of a peer that said goodbye (a clean shutdown, not a failure).
pub const PEER_LEFT: &str = "peer left";

/// Checks that a control message fits [`MAX_CTRL_LEN`] (what every transport's `send` does
/// first).
pub fn check_ctrl_len(msg: &[u8]) -> Result<(), TransportError> {
    if msg.len() > MAX_CTRL_LEN {
        return Err(TransportError::MessageTooLarge {
            len: msg.len(),
            max: MAX_CTRL_LEN,
        });
    }
    Ok(())
}

/// Index of a node in the cluster.
pub type NodeId = u32;

/// Identifies one inbound data stream at its receiver; chosen by the receiver.
pub type StreamId = u64;

/// What a transport reports to the node above it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A control message from `peer`, in the order the peer sent it.
    Ctrl { peer: NodeId, msg: Vec<u8> },
    /// Bytes `[offset, offset + len)` of the region that `stream` writes into (offsets relative
    /// to the `RemoteRegion` the receiver handed out) have landed in the local arena. Events
    /// of one stream arrive in the order of the writes.
    Data {
        peer: NodeId,
        stream: StreamId,
        offset: u64,
        len: u64,
    },
    /// A link to `peer` came up (first connection or a rejoin after a restart).
    PeerUp { peer: NodeId },
    /// `peer` is unreachable: reset, EOF without goodbye, malformed input or heartbeat timeout.
    /// Every operation towards it fails from now on until it rejoins.
    PeerDown { peer: NodeId, reason: String },
}

/// A node's links, for scale figures ([`Transport::link_counts`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LinkCounts {
    /// Links open now.
    pub open: usize,
    /// The most links open at once.
    pub peak: usize,
    /// Links closed for being idle.
    pub idle_closed: u64,
    /// Heartbeats sent (one per live link that sent nothing else for a quarter of the
    /// heartbeat timeout).
    pub heartbeats_sent: u64,
    /// Sleeping reader threads woken because a frame went to one of their peers, to poll
    /// for the answer (TCP with `poll_spin` only).
    pub readers_woken: u64,
}

/// The peers something of the node above depends on (see [`Transport::set_idle_guard`]).
pub type IdleGuard = Arc<dyn Fn() -> std::collections::HashSet<NodeId> + Send + Sync>;

/// Whether this node watches `peer` (see [`Transport::set_watch`]).
pub type Watch = Arc<dyn Fn(NodeId) -> bool + Send + Sync>;

/// A callback for transport events, see [`Transport::set_event_handler`].
pub type EventHandler = Arc<dyn Fn(Event) + Send + Sync>;

/// Counters every transport keeps, for tests and benchmarks.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TransportStats {
    pub ctrl_sent: u64,
    pub ctrl_received: u64,
    pub data_bytes_sent: u64,
    pub data_bytes_received: u64,
    /// Bytes of payload copied through an intermediate buffer (eager path of verbs).
    pub payload_bytes_copied: u64,
    /// Memory registrations done (the arena counts once).
    pub registrations: u64,
    /// Ranges registered for grants: on verbs one per grant large enough for the zero-copy
    /// path (with its memory window), none on TCP.
    pub grant_registrations: u64,
    pub peers_down: u64,
    pub malformed_frames: u64,
    /// Link setups refused: wrong or no proof of the cluster secret, not a member, a live
    /// link for the claimed id, malformed or too slow handshakes.
    pub hellos_refused: u64,
}

/// A reliable, connection-oriented link between the nodes of one cluster.
///
/// Ordering: all operations issued to the same peer from one thread are delivered in the
/// order issued (a control message sent after a write is seen after that write's data event).
pub trait Transport: Send + Sync + 'static {
    /// Short name for tables and JSON records ("tcp", "rdma").
    fn name(&self) -> &'static str;

    /// This node's id.
    fn local_id(&self) -> NodeId;

    /// Registers the node's arena. Called once, before any data write; the arena stays
    /// registered until [`Transport::shutdown`].
    fn register_arena(&self, arena: Arc<Arena>) -> Result<(), TransportError>;

    /// Grants `peer` the right to write `[offset, offset + len)` of the local registered
    /// arena and returns the descriptor to hand it. Every write that arrives is checked
    /// against the grants of its peer before a byte lands (a write outside them is refused and
    /// its link dropped). `keep` (for a pull: the copy being filled) stays alive while the
    /// grant exists and while a write that passed the check is still landing.
    fn grant(
        &self,
        peer: NodeId,
        offset: u64,
        len: u64,
        keep: KeepAlive,
    ) -> Result<RemoteRegion, TransportError>;

    /// Withdraws a grant made by [`Transport::grant`]: later writes into it are refused.
    fn revoke(&self, peer: NodeId, region: &RemoteRegion);

    /// Sends one control message (at most [`MAX_CTRL_LEN`] bytes).
    fn send(&self, peer: NodeId, msg: &[u8]) -> Result<(), TransportError>;

    /// Sends a control message if that can be done without blocking (for handlers running on
    /// the transport's own threads, which must never wait on the network). Ok(false): not
    /// sent, use [`Transport::send`] from another thread.
    fn send_nonblocking(&self, peer: NodeId, msg: &[u8]) -> Result<bool, TransportError> {
        let _ = (peer, msg);
        Ok(false)
    }

    /// Writes `len` bytes from the local arena at `src_offset` into `dst` at `dst_offset`,
    /// tagged with the receiver's `stream`. Returns once the source bytes may be reused.
    /// The caller keeps the source range allocated and unchanged until then.
    fn write(
        &self,
        peer: NodeId,
        stream: StreamId,
        src_offset: u64,
        dst: &RemoteRegion,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), TransportError>;

    /// [`Transport::write`] for handlers running on the transport's own threads: the whole
    /// range is written (or queued, copied, behind the frames already queued) without ever
    /// blocking, or nothing is and Ok(false) says so (write it from another thread). Meant for
    /// small ranges: whatever the socket does not take at once is copied.
    fn write_nonblocking(
        &self,
        peer: NodeId,
        stream: StreamId,
        src_offset: u64,
        dst: &RemoteRegion,
        dst_offset: u64,
        len: u64,
    ) -> Result<bool, TransportError> {
        let _ = (peer, stream, src_offset, dst, dst_offset, len);
        Ok(false)
    }

    /// The event stream. Every call returns a handle to the same channel.
    fn events(&self) -> Receiver<Event>;

    /// Delivers events by calling `handler` on the transport's own threads instead of through
    /// [`Transport::events`], saving a thread hand-off per message. The handler must not block
    /// on the network. Returns false if the transport does not support it (then use `events`).
    fn set_event_handler(&self, handler: EventHandler) -> bool {
        let _ = handler;
        false
    }

    /// Where links close when idle: `guard` names the peers whose links must stay (a request
    /// waits for their answer, a stream runs with them, a directory entry lists their copies),
    /// so that their heartbeats keep proving them alive to whoever depends on them. Asked
    /// once per heartbeat period, only when some link has been idle long enough. Default:
    /// ignored (the transport closes no link for being idle).
    fn set_idle_guard(&self, guard: IdleGuard) {
        let _ = guard;
    }

    /// Which links prove their peer alive (failure detection that scales, for links made
    /// on demand): a link to a peer `watch` names carries a heartbeat every quarter of the
    /// heartbeat timeout, flagged so the peer answers in kind, and fails when silent for
    /// the timeout; a link no side watches carries no heartbeat and never times out (its
    /// peer's death reaches this node from the watchers above). Default: every link watched
    /// (returns false: not supported).
    fn set_watch(&self, watch: Watch) -> bool {
        let _ = watch;
        false
    }

    /// Test hook: the node goes silent, as a host that hangs or is cut off without closing
    /// its sockets: no frame goes out and nothing received is delivered; links stay open,
    /// no link is dialled again and no handshake answered (a peer that dials it back fails).
    /// Returns false if the transport cannot (then use [`Transport::kill`]).
    fn freeze(&self) -> bool {
        false
    }

    /// The address peers connect to (for tools and tests); None if not applicable.
    fn listen_addr(&self) -> Option<std::net::SocketAddr> {
        None
    }

    /// Whether a live link to `peer` exists.
    fn is_connected(&self, peer: NodeId) -> bool;

    /// Whether `peer` is believed reachable: a live link, or, where links are made on first
    /// use, no failure reported since it was last linked. Default: [`Transport::is_connected`].
    fn is_up(&self, peer: NodeId) -> bool {
        self.is_connected(peer)
    }

    /// Whether a send to a peer with no link makes one (links made on demand), and so may
    /// wait for a dial.
    fn dials_on_use(&self) -> bool {
        false
    }

    /// The node's links now and so far (for scale figures); None if not known.
    fn link_counts(&self) -> Option<LinkCounts> {
        None
    }

    /// Bytes of registered memory the transport keeps for small messages (verbs: the eager
    /// rings, staging and shared receive queue), now and at most so far; None if it keeps
    /// none of its own (TCP: kernel socket buffers).
    fn eager_memory(&self) -> Option<(u64, u64)> {
        None
    }

    /// Counters since start.
    fn stats(&self) -> TransportStats;

    /// Closes every link with a goodbye (peers see no failure) and stops the threads.
    fn shutdown(&self);

    /// Test hook: drops every link abruptly, as if the process died (peers see failure).
    fn kill(&self);
}
