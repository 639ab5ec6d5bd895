//! The node's messaging: control messages out (to peers over the transport, to itself through
//! the dispatcher's queue), and the table of outstanding requests that replies complete.
//! Every subsystem is handed the node's `Rpc`; only the dispatcher completes requests.

use crate::hop::hop;
use crate::protocol::{Msg, Reply, Rid};
use crate::{Error, Result};
use crossbeam_channel::{Receiver, Sender};
use phalanx_transport::{NodeId, Transport, TransportError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tracing::debug;

/// Work for the node's dispatcher thread.
pub(crate) enum Work {
    /// A message from a peer (or from this node to itself) to handle.
    Msg(NodeId, Msg),
    /// Work that may block (on the network), handed off by a transport thread.
    Run(Box<dyn FnOnce() + Send>),
    /// A message a transport thread could not send without blocking.
    Send(NodeId, Msg),
    /// A worker has linked the peer (or failed to) by sending the first message the
    /// dispatcher held for it: the dispatcher sends the rest, in order.
    Linked(NodeId),
    Stop,
}

/// No request has this number (`NO_REPLY` of the directory).
const NO_RID: Rid = 0;

/// What becomes of a reply (or of the failure that replaces it). Runs where the reply lands,
/// a transport thread: it must not block.
pub(crate) type OnReply = Box<dyn FnOnce(Result<Reply>) + Send>;

/// A word back to the node that answered, made from its reply where the reply lands (see
/// [`Rpc::call_or_cancel_then_tell`]).
pub(crate) type FollowUp = Box<dyn FnOnce(&Reply) -> Option<Msg> + Send>;

/// An outstanding request: the node it went to, what becomes of its reply, and the word its
/// reply may call for.
type PendingCall = (NodeId, OnReply, Option<FollowUp>);

/// Handles a message this node sends to itself, on the sender's thread.
pub(crate) type Loopback = Box<dyn Fn(Msg) + Send + Sync>;

pub(crate) struct Rpc {
    id: NodeId,
    transport: Arc<dyn Transport>,
    /// The dispatcher's queue: messages to ourselves, and work handed off by transport threads.
    queue: Sender<Work>,
    pending: Mutex<HashMap<Rid, PendingCall>>,
    /// Set once the node is wired up; until then messages to ourselves take the queue.
    loopback: OnceLock<Loopback>,
    /// Handles a message to ourselves on a thread that must not block (as a transport
    /// thread handles a peer's); unset: such messages take the queue.
    loopback_nonblocking: OnceLock<Loopback>,
    next_rid: AtomicU64,
    closed: AtomicBool,
    spin_wait: Duration,
    op_timeout: Duration,
    /// Round trips of recent calls to other nodes.
    rtt: Mutex<RttWindow>,
}

/// The smallest round trip seen in the current and the previous epoch: the link's latency
/// without the queueing of busy moments, kept fresh without probes of its own.
struct RttWindow {
    epoch_start: Instant,
    current: Option<Duration>,
    previous: Option<Duration>,
}

/// How long one epoch of the round-trip window lasts.
const RTT_EPOCH: Duration = Duration::from_secs(2);

impl RttWindow {
    fn record(&mut self, rtt: Duration) {
        let age = self.epoch_start.elapsed();
        if age >= RTT_EPOCH {
            // An epoch with no sample in between forgets the old one.
            self.previous = if age < 2 * RTT_EPOCH {
                self.current
            } else {
                None
            };
            self.current = None;
            self.epoch_start = Instant::now();
        }
        self.current = Some(self.current.map_or(rtt, |c| c.min(rtt)));
    }

    fn estimate(&self) -> Option<Duration> {
        if self.epoch_start.elapsed() >= 2 * RTT_EPOCH {
            return None;
        }
        match (self.current, self.previous) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

impl Rpc {
    pub fn new(
        id: NodeId,
        transport: Arc<dyn Transport>,
        queue: Sender<Work>,
        spin_wait: Duration,
        op_timeout: Duration,
    ) -> Rpc {
        Rpc {
            id,
            transport,
            queue,
            pending: Mutex::new(HashMap::new()),
            loopback: OnceLock::new(),
            loopback_nonblocking: OnceLock::new(),
            next_rid: AtomicU64::new(unpredictable_start()),
            closed: AtomicBool::new(false),
            spin_wait,
            op_timeout,
            rtt: Mutex::new(RttWindow {
                epoch_start: Instant::now(),
                current: None,
                previous: None,
            }),
        }
    }

    pub fn id(&self) -> NodeId {
        self.id
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Marks the node closed: no new requests. True the first time only.
    pub fn mark_closed(&self) -> bool {
        !self.closed.swap(true, Ordering::AcqRel)
    }

    /// Stops the dispatcher and fails every outstanding request (after `mark_closed`).
    pub fn stop(&self) {
        let _ = self.queue.send(Work::Stop);
        let pending: Vec<_> = self.pending.lock().unwrap().drain().collect();
        for (_, (_, on_reply, _)) in pending {
            on_reply(Err(Error::Shutdown));
        }
    }

    /// Messages to ourselves are handled by `f` on the sending thread from now on (no hand-off
    /// to the dispatcher). Only threads that may block send to ourselves: transport threads
    /// use [`Rpc::send_from_transport_thread`], which queues them.
    pub fn set_loopback(&self, f: Loopback) {
        let _ = self.loopback.set(f);
    }

    /// Messages to ourselves sent with [`Rpc::send_without_blocking`] are handled by `f` on
    /// the sending thread, as a transport thread handles a peer's message (nothing in `f`
    /// waits on the network).
    pub fn set_loopback_nonblocking(&self, f: Loopback) {
        let _ = self.loopback_nonblocking.set(f);
    }

    /// Sends from a thread that must not block and holds no lock a handler could need (the
    /// thread an answer landed on): to a peer at once if that cannot block, else through the
    /// dispatcher; to ourselves, handled here as a peer's message would be on a transport
    /// thread.
    pub fn send_without_blocking(&self, to: NodeId, msg: Msg) {
        if to == self.id {
            match self.loopback_nonblocking.get() {
                Some(f) if !self.is_closed() => f(msg),
                _ => {
                    let _ = self.queue.send(Work::Msg(self.id, msg));
                }
            }
            return;
        }
        self.send_from_transport_thread(to, msg)
    }

    /// [`Rpc::call_then`] from a thread that must not block: sent if the link takes it at once
    /// (to ourselves: handled here, as [`Rpc::send_without_blocking`] does). `Ok(false)`: not
    /// sent and forgotten (no link to the peer yet, or one being replaced): a thread that may
    /// block sends it. A peer the transport knows unreachable is an error (`PeerDown`).
    pub fn call_without_blocking(
        &self,
        to: NodeId,
        make: impl FnOnce(Rid) -> Msg,
        on_reply: OnReply,
    ) -> Result<bool> {
        let rid = self.register(to, on_reply, None)?;
        let msg = make(rid);
        let kind = msg.kind();
        if to == self.id {
            self.send_without_blocking(to, msg);
        } else {
            let sent = self.transport.send_nonblocking(to, &msg.encode());
            if !matches!(sent, Ok(true)) {
                self.pending.lock().unwrap().remove(&rid);
            }
            match sent {
                Ok(true) => {}
                Ok(false) => return Ok(false),
                Err(e) => return Err(peer_error(e)),
            }
        }
        hop!(self.id, "request sent", to = to, rid = rid, kind = kind);
        Ok(true)
    }

    /// Enters a request to `to` in the table of outstanding requests: its number.
    fn register(&self, to: NodeId, on_reply: OnReply, follow: Option<FollowUp>) -> Result<Rid> {
        if self.is_closed() {
            return Err(Error::Shutdown);
        }
        let rid = self.next_rid.fetch_add(1, Ordering::Relaxed);
        self.pending
            .lock()
            .unwrap()
            .insert(rid, (to, on_reply, follow));
        if self.is_closed() {
            // Closed meanwhile: `stop` may have drained the table before this entry went in.
            if let Some((_, on_reply, _)) = self.pending.lock().unwrap().remove(&rid) {
                on_reply(Err(Error::Shutdown));
            }
            return Err(Error::Shutdown);
        }
        Ok(rid)
    }

    /// A number no other request or token of this node uses (a pull's token for a claim).
    pub fn fresh_token(&self) -> u64 {
        self.next_rid.fetch_add(1, Ordering::Relaxed)
    }

    /// Hands work to the dispatcher thread.
    pub fn enqueue(&self, w: Work) {
        let _ = self.queue.send(w);
    }

    /// Sends a control message; messages to ourselves take the dispatcher's queue.
    pub fn send(&self, to: NodeId, msg: impl Into<Msg>) -> Result<()> {
        let msg = msg.into();
        if to == self.id {
            match self.loopback.get() {
                Some(f) if !self.is_closed() => {
                    f(msg);
                    Ok(())
                }
                _ => self
                    .queue
                    .send(Work::Msg(self.id, msg))
                    .map_err(|_| Error::Shutdown),
            }
        } else {
            self.transport.send(to, &msg.encode()).map_err(peer_error)
        }
    }

    /// Adds to `peers` the nodes whose answer a request of this node awaits.
    pub fn peers_awaited(&self, peers: &mut std::collections::HashSet<NodeId>) {
        peers.extend(self.pending.lock().unwrap().values().map(|(to, _, _)| *to));
    }

    /// Sends from a transport thread: at once if that cannot block, else through the
    /// dispatcher.
    pub fn send_from_transport_thread(&self, to: NodeId, msg: Msg) {
        // A reply to ourselves (our shard answering our own subscription) completes its
        // request here: the callbacks it runs never block.
        let msg = match msg {
            Msg::Reply { rid, reply } if to == self.id => return self.complete(rid, reply),
            m => m,
        };
        let sent =
            to != self.id && matches!(self.transport.send_nonblocking(to, &msg.encode()), Ok(true));
        if sent {
            hop!(
                self.id,
                "sent from the transport thread",
                to = to,
                kind = msg.kind()
            );
        } else {
            hop!(
                self.id,
                "handed to the dispatcher",
                to = to,
                kind = msg.kind()
            );
            let _ = self.queue.send(Work::Send(to, msg));
        }
    }

    /// Sends a request; its reply will arrive on the returned channel.
    /// `follow`: the word its reply may call for ([`Rpc::call_or_cancel_then_tell`]).
    fn call_async(
        &self,
        to: NodeId,
        make: impl FnOnce(Rid) -> Msg,
        follow: Option<FollowUp>,
    ) -> Result<Receiver<Result<Reply>>> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let on_reply: OnReply = Box::new(move |r| {
            let _ = tx.send(r);
        });
        self.call_then_telling(to, make, on_reply, follow)?;
        Ok(rx)
    }

    /// Sends a request; `on_reply` gets its reply (or the error that ends it) where it lands.
    pub fn call_then(
        &self,
        to: NodeId,
        make: impl FnOnce(Rid) -> Msg,
        on_reply: OnReply,
    ) -> Result<()> {
        self.call_then_telling(to, make, on_reply, None)
    }

    fn call_then_telling(
        &self,
        to: NodeId,
        make: impl FnOnce(Rid) -> Msg,
        on_reply: OnReply,
        follow: Option<FollowUp>,
    ) -> Result<()> {
        let rid = self.register(to, on_reply, follow)?;
        let msg = make(rid);
        let kind = msg.kind();
        if let Err(e) = self.send(to, msg) {
            self.pending.lock().unwrap().remove(&rid);
            return Err(e);
        }
        hop!(self.id, "request sent", to = to, rid = rid, kind = kind);
        Ok(())
    }

    /// The operation timeout that bounds [`Rpc::call`].
    pub fn op_timeout(&self) -> Duration {
        self.op_timeout
    }

    /// A request/reply exchange, bounded by the operation timeout.
    pub fn call(&self, to: NodeId, make: impl FnOnce(Rid) -> Msg) -> Result<Reply> {
        self.call_or_cancel(to, make, |_| None)
    }

    /// [`Rpc::call`]; if it times out, the request is forgotten here and `cancel(rid)`'s
    /// message (if any) goes to the peer, so nothing there waits on a caller that left.
    pub fn call_or_cancel(
        &self,
        to: NodeId,
        make: impl FnOnce(Rid) -> Msg,
        cancel: impl FnOnce(Rid) -> Option<Msg>,
    ) -> Result<Reply> {
        self.call_or_cancel_until(to, make, cancel, Instant::now() + self.op_timeout)
    }

    /// [`Rpc::call_or_cancel`] that gives up at `deadline` instead of after the op timeout.
    pub fn call_or_cancel_until(
        &self,
        to: NodeId,
        make: impl FnOnce(Rid) -> Msg,
        cancel: impl FnOnce(Rid) -> Option<Msg>,
        deadline: Instant,
    ) -> Result<Reply> {
        self.call_or_cancel_then_tell(to, make, cancel, deadline, None)
    }

    /// [`Rpc::call_or_cancel_until`] whose reply may call for a word back to the node that
    /// answered: `follow` makes it from the reply where the reply lands, and it is sent from
    /// there, without blocking, once the caller has the reply; the caller goes on meanwhile.
    /// The word and the caller's later messages to that node leave from different threads,
    /// in either order: only for words whose order does not matter. A reply that comes after
    /// the caller gave up calls for nothing.
    pub fn call_or_cancel_then_tell(
        &self,
        to: NodeId,
        make: impl FnOnce(Rid) -> Msg,
        cancel: impl FnOnce(Rid) -> Option<Msg>,
        deadline: Instant,
        follow: Option<FollowUp>,
    ) -> Result<Reply> {
        let start = Instant::now();
        let mut sent_rid = NO_RID;
        let mut sent_kind = "";
        let make = |rid| {
            sent_rid = rid;
            let msg = make(rid);
            sent_kind = msg.kind();
            msg
        };
        let rx = self.call_async(to, make, follow)?;
        // Replies take tens of microseconds: poll for them before parking, which saves the
        // wake-up of a sleeping thread (25-50 us on these hosts, a third of a 64 KiB get on
        // loopback). The poll yields the core between looks, so that a reader or the
        // serving node that shares it runs at once (a plain spin held it, and made the
        // 64 KiB get slower, not faster: README, "A caller polls for its reply").
        let spin_until = Instant::now() + self.spin_wait;
        let first = loop {
            match rx.try_recv() {
                Ok(r) => break Some(r),
                Err(_) if Instant::now() < spin_until => std::thread::yield_now(),
                Err(_) => break None,
            }
        };
        let spun = first.is_some();
        let got = match first {
            Some(r) => Ok(r),
            None => rx.recv_timeout(deadline.saturating_duration_since(Instant::now())),
        };
        hop!(self.id, "caller has the reply", from = to, spun = spun);
        if to != self.id && matches!(got, Ok(Ok(_))) {
            self.rtt.lock().unwrap().record(start.elapsed());
        }
        match got {
            Ok(Ok(Reply::Error(e))) => Err(Error::Protocol { peer: to, what: e }),
            Ok(r) => r,
            Err(_) => {
                self.pending.lock().unwrap().remove(&sent_rid);
                if let Some(m) = cancel(sent_rid) {
                    let _ = self.send(to, m);
                }
                // The request was made (`call_async` returned): its kind is known.
                let what = format!("a reply from node {to} to {sent_kind}");
                tracing::warn!(node = self.id, rid = sent_rid, "gave up waiting for {what}");
                Err(Error::Timeout(start.elapsed(), what))
            }
        }
    }

    /// The round trip to another node, from recent calls (none in the last few seconds:
    /// `None`).
    pub fn rtt_estimate(&self) -> Option<Duration> {
        self.rtt.lock().unwrap().estimate()
    }

    /// A reply from ourselves arrived: hands it to its caller.
    pub fn complete(&self, rid: Rid, reply: Reply) {
        self.complete_from(self.id, rid, reply);
    }

    /// A reply from `from` arrived: hands it to its caller, if `from` is the node the request
    /// went to (any other peer's reply for that number is ignored).
    pub fn complete_from(&self, from: NodeId, rid: Rid, reply: Reply) {
        hop!(self.id, "reply in", rid = rid);
        let pending = {
            let mut p = self.pending.lock().unwrap();
            match p.get(&rid) {
                Some((to, _, _)) if *to == from => p.remove(&rid),
                Some(_) => {
                    debug!(
                        node = self.id,
                        from, rid, "reply from a node not asked: ignored"
                    );
                    None
                }
                None => None,
            }
        };
        if let Some((_, on_reply, follow)) = pending {
            let word = follow.and_then(|f| f(&reply));
            on_reply(Ok(reply));
            if let Some(m) = word {
                self.send_without_blocking(from, m);
            }
        }
    }

    /// `peer` died: every request waiting on it fails.
    pub fn fail_peer(&self, peer: NodeId) {
        let failed: Vec<_> = {
            let mut p = self.pending.lock().unwrap();
            let rids: Vec<Rid> = p
                .iter()
                .filter(|(_, (to, _, _))| *to == peer)
                .map(|(r, _)| *r)
                .collect();
            rids.into_iter().filter_map(|r| p.remove(&r)).collect()
        };
        for (_, on_reply, _) in failed {
            on_reply(Err(Error::PeerDown(peer)));
        }
    }

    /// The error for a reply of the wrong kind.
    pub fn unexpected(&self, r: Reply) -> Error {
        unexpected_reply(self.id, r)
    }
}

/// A first number for a sequence of request or stream ids that a peer cannot guess: random per
/// process, never 0 (`NO_REPLY`), far from wrapping.
pub(crate) fn unpredictable_start() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id() as u64);
    (h.finish() >> 2) | 1
}

/// The error for a reply of the wrong kind, seen by `node`.
pub(crate) fn unexpected_reply(node: NodeId, r: Reply) -> Error {
    Error::Protocol {
        peer: node,
        what: format!("unexpected reply {r:?}"),
    }
}

/// A transport error towards a peer, as the node reports it.
fn peer_error(e: TransportError) -> Error {
    match e {
        TransportError::PeerUnavailable(p) | TransportError::PeerFailed { peer: p, .. } => {
            Error::PeerDown(p)
        }
        e => Error::Transport(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_start_where_a_peer_cannot_guess() {
        let a = unpredictable_start();
        let b = unpredictable_start();
        assert!(a != 0 && b != 0 && a < u64::MAX / 2);
        assert_ne!(a, b, "two sequences, two starts");
    }

    /// A reply that calls for a word back gets it sent to the node that answered once the
    /// caller has the reply; a reply of another kind, or one that comes after the caller
    /// gave up, calls for nothing.
    #[test]
    fn a_reply_that_calls_for_a_word_back_has_it_sent_after_its_caller_has_the_reply() {
        use crate::protocol::DirMsg;
        use phalanx_transport::{TcpConfig, TcpTransport};
        let t =
            TcpTransport::bind(0, "127.0.0.1:0".parse().unwrap(), TcpConfig::default()).unwrap();
        let (qtx, qrx) = crossbeam_channel::unbounded();
        let timeout = Duration::from_secs(10);
        let rpc = Arc::new(Rpc::new(0, Arc::new(t), qtx, Duration::ZERO, timeout));
        let word = |rid| {
            Msg::Dir(DirMsg::Withdraw {
                id: format!("word-{rid}").into(),
                node: 0,
            })
        };
        // Calls this node (no loopback: the request takes the queue) and waits `wait`.
        let call = |wait: Duration| {
            let rpc = rpc.clone();
            std::thread::spawn(move || {
                let query = |rid| {
                    Msg::Dir(DirMsg::Query {
                        rid,
                        id: "x".into(),
                    })
                };
                let follow: FollowUp = Box::new(move |r: &Reply| match r {
                    Reply::Ack => Some(word(7)),
                    _ => None,
                });
                let until = Instant::now() + wait;
                rpc.call_or_cancel_then_tell(0, query, |_| None, until, Some(follow))
            })
        };
        let request = |qrx: &crossbeam_channel::Receiver<Work>| match qrx.recv().unwrap() {
            Work::Msg(0, Msg::Dir(DirMsg::Query { rid, .. })) => rid,
            _ => panic!("not the request"),
        };
        // The word goes out with the reply that calls for it, after the caller has it.
        let caller = call(timeout);
        let rid = request(&qrx);
        rpc.complete(rid, Reply::Ack);
        assert!(matches!(caller.join().unwrap(), Ok(Reply::Ack)));
        match qrx.try_recv() {
            Ok(Work::Msg(0, m)) => assert_eq!(m, word(7)),
            _ => panic!("no word back"),
        }
        // Another reply: no word.
        let caller = call(timeout);
        let rid = request(&qrx);
        rpc.complete(rid, Reply::Info(None));
        assert!(matches!(caller.join().unwrap(), Ok(Reply::Info(None))));
        assert!(
            qrx.try_recv().is_err(),
            "a word for a reply that calls for none"
        );
        // The caller gave up: its late reply calls for nothing.
        let caller = call(Duration::from_millis(50));
        let rid = request(&qrx);
        assert!(matches!(caller.join().unwrap(), Err(Error::Timeout(..))));
        rpc.complete(rid, Reply::Ack);
        assert!(qrx.try_recv().is_err(), "a word after the caller gave up");
    }

    #[test]
    fn the_rtt_window_keeps_the_recent_minimum() {
        let mut w = RttWindow {
            epoch_start: Instant::now(),
            current: None,
            previous: None,
        };
        assert_eq!(w.estimate(), None);
        w.record(Duration::from_micros(80));
        w.record(Duration::from_micros(30));
        w.record(Duration::from_micros(50));
        assert_eq!(w.estimate(), Some(Duration::from_micros(30)));
        // One epoch later the old minimum still counts; two epochs later it is forgotten.
        w.epoch_start -= RTT_EPOCH;
        w.record(Duration::from_micros(60));
        assert_eq!(w.estimate(), Some(Duration::from_micros(30)));
        w.epoch_start -= RTT_EPOCH;
        w.record(Duration::from_micros(70));
        assert_eq!(w.estimate(), Some(Duration::from_micros(60)));
        w.epoch_start -= 3 * RTT_EPOCH;
        assert_eq!(w.estimate(), None, "stale");
    }
}
