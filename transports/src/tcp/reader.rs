//! The reading side of every connection, payloads straight into the arena. The first
//! [`TcpConfig::dedicated_readers`](super::TcpConfig) links each get a thread of their own that
//! waits in a blocking `recv` (one system call per wake-up: the lowest latency); every further
//! link is read by one of a fixed set of [`TcpConfig::readers`](super::TcpConfig) threads,
//! each waiting on an epoll set of connections. So a node's reading threads are bounded
//! whatever the number of its peers, and a peer's frames are always read by one thread, in
//! order.
//!
//! With [`TcpConfig::poll_spin`](super::TcpConfig) an epoll reader that has just read keeps
//! looking (`epoll_wait` with no timeout, yielding the core between looks) for that long
//! before it sleeps: a frame that follows soon is read without a wake-up. A frame sent to a
//! peer while the thread that reads it sleeps wakes that thread (its set's eventfd), off the
//! critical path: the answer then finds it polling.
//!
//! Epoll reads are non-blocking (`MSG_DONTWAIT` on each call: the socket itself stays blocking
//! for its writers). A connection that has more to read from its socket after [`READ_BUDGET`]
//! bytes waits for the next turn (epoll is level-triggered), so one busy peer does not starve
//! the others of its thread; what it has already read (a whole frame, frames in its buffer)
//! is handled before the turn ends. A connection silent for the heartbeat timeout is failed:
//! by its epoll thread's periodic scan, or by the receive timeout of its own thread's socket.
//! Each data frame, and each large control frame, is acknowledged at once (`ack_now`).

use super::conn::Conn;
use super::heartbeat::HB_WATCHING;
use super::Inner;
use crate::frame::{FrameHeader, FrameKind, FRAME_HEADER_LEN};
use crate::grant::Admitted;
use crate::{Event, Link, NodeId, TransportError, PEER_LEFT};
use nix::errno::Errno;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::socket::{recv, MsgFlags};
use std::collections::HashMap;
use std::io::ErrorKind;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::error;

/// Bytes read from one connection before the thread turns to the others.
const READ_BUDGET: usize = 1 << 20;

/// The read-ahead buffer of a connection: small frames come out of it (one `recv` for many);
/// the rest of a payload at least this large is read straight into its destination.
const BUFFER: usize = 64 << 10;

/// Longest wait for events: how often a thread looks for silent connections and for the
/// transport's closing.
const TICK: Duration = Duration::from_millis(50);

/// The reader threads of one transport and the connections each one reads.
pub(super) struct Readers {
    sets: Vec<Arc<PollSet>>,
    /// Links with a thread of their own now, and the most there may be.
    dedicated: Arc<std::sync::atomic::AtomicUsize>,
    max_dedicated: usize,
}

/// The epoll token of a set's eventfd (connection tokens count up from 0).
const WAKE: u64 = u64::MAX;

/// The connections of one reader thread.
pub(super) struct PollSet {
    epoll: Epoll,
    /// By token (the epoll event's data).
    conns: Mutex<HashMap<u64, Reading>>,
    next_token: AtomicU64,
    /// Written when a frame goes to one of the set's peers while its thread sleeps (with
    /// `poll_spin` only): the thread wakes and polls for the answer.
    wake: EventFd,
    /// The thread sleeps in `epoll_wait` (set with `poll_spin` only).
    asleep: AtomicBool,
}

/// One connection as its reader thread sees it.
struct Reading {
    conn: Arc<Conn>,
    input: Input,
    frame: Frame,
    last_rx: Instant,
    /// The last frame was a large data frame: the next header is read alone, so that a data
    /// payload behind it goes straight into the arena rather than through the buffer. After
    /// anything else the buffer is filled, for the small frames that tend to follow.
    bulk: bool,
}

/// A connection's socket and read-ahead buffer.
struct Input {
    /// The connection's socket.
    stream: Arc<TcpStream>,
    buf: Box<[u8]>,
    /// Unread bytes are `buf[start..end]`.
    start: usize,
    end: usize,
    /// A read this turn got less than it asked for: the socket is empty, so the turn ends
    /// when the buffer is, without a `recv` that would find nothing.
    drained: bool,
    /// Read by a thread of its own: `recv` waits (up to the socket's receive timeout).
    blocking: bool,
}

/// Where a connection is in its current frame.
enum Frame {
    Header,
    Ctrl {
        msg: Vec<u8>,
        got: usize,
    },
    /// The peer closes the link for being idle.
    Idle,
    /// `held` keeps the granted range allocated until the payload is in.
    Data {
        h: FrameHeader,
        _held: Admitted,
        got: u64,
    },
}

/// How a turn at a connection ended.
enum Turn {
    /// Nothing more to read now (or the budget is spent).
    Later,
    /// The peer said goodbye.
    Bye,
    /// The peer closed the link for being idle: reading ends, the flusher closes it.
    Retired,
    Failed(TransportError),
}

impl Readers {
    /// `n` epoll reader threads for `inner`'s connections, and up to `dedicated` links with a
    /// thread of their own.
    pub(super) fn start(
        inner: &Arc<Inner>,
        n: usize,
        dedicated: usize,
    ) -> Result<Readers, TransportError> {
        let mut sets = Vec::new();
        for k in 0..n.max(1) {
            let io = std::io::Error::from;
            let set = Arc::new(PollSet {
                epoll: Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(io)?,
                conns: Mutex::new(HashMap::new()),
                next_token: AtomicU64::new(0),
                wake: EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
                    .map_err(io)?,
                asleep: AtomicBool::new(false),
            });
            set.epoll
                .add(&set.wake, EpollEvent::new(EpollFlags::EPOLLIN, WAKE))
                .map_err(io)?;
            let (me, s) = (inner.clone(), set.clone());
            let h = crate::threads::spawn(inner.id, &format!("rx{k}"), move || me.poll_loop(&s))?;
            inner.threads.lock().unwrap().push(h);
            sets.push(set);
        }
        Ok(Readers {
            sets,
            dedicated: Default::default(),
            max_dedicated: dedicated,
        })
    }

    /// The epoll set that reads `peer`'s links (every link of a peer goes to the same one).
    fn set_of(&self, peer: NodeId) -> &Arc<PollSet> {
        &self.sets[peer as usize % self.sets.len()]
    }

    /// A frame went to `peer`: if the thread that reads it sleeps, it is woken to poll for
    /// the answer (with `poll_spin` only; a frame sent meanwhile does not wake it twice).
    /// Returns whether it woke the thread.
    pub(super) fn sent_to(&self, peer: NodeId) -> bool {
        let set = self.set_of(peer);
        set.asleep.swap(false, Ordering::AcqRel) && set.wake.write(1).is_ok()
    }

    /// Starts reading `conn` from `stream` (its reader's handle of the socket).
    pub(super) fn add(
        &self,
        inner: &Arc<Inner>,
        conn: Arc<Conn>,
        stream: Arc<TcpStream>,
    ) -> Result<(), TransportError> {
        let peer = conn.peer();
        let mut r = Reading {
            conn,
            input: Input {
                stream,
                buf: vec![0u8; BUFFER].into_boxed_slice(),
                start: 0,
                end: 0,
                drained: false,
                blocking: false,
            },
            frame: Frame::Header,
            last_rx: Instant::now(),
            bulk: false,
        };
        let own = self
            .dedicated
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_dedicated).then_some(n + 1)
            })
            .is_ok();
        if own {
            r.input.blocking = true;
            r.input
                .stream
                .set_read_timeout(Some(inner.cfg.heartbeat_timeout))?;
            let (me, count) = (inner.clone(), self.dedicated.clone());
            let spawned = crate::threads::spawn(inner.id, &format!("rx{peer}"), move || {
                me.read_alone(r);
                count.fetch_sub(1, Ordering::AcqRel);
            });
            return match spawned {
                Ok(h) => {
                    let mut threads = inner.threads.lock().unwrap();
                    threads.retain(|t| !t.is_finished());
                    threads.push(h);
                    Ok(())
                }
                Err(e) => {
                    self.dedicated.fetch_sub(1, Ordering::AcqRel);
                    Err(e.into())
                }
            };
        }
        let set = self.set_of(peer);
        let token = set.next_token.fetch_add(1, Ordering::Relaxed);
        set.conns.lock().unwrap().insert(token, r);
        // The socket stays open while its `Reading` (which owns this handle) lives; it leaves
        // the epoll set before that is dropped.
        let ev = EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP, token);
        let added = {
            let map = set.conns.lock().unwrap();
            let r = map.get(&token).expect("just inserted");
            set.epoll.add(&r.input.stream, ev)
        };
        if let Err(e) = added {
            set.conns.lock().unwrap().remove(&token);
            return Err(std::io::Error::from(e).into());
        }
        Ok(())
    }
}

impl Inner {
    /// The thread of a link of its own: reads until the link ends.
    fn read_alone(&self, mut r: Reading) {
        let reason = loop {
            match self.read_some(&mut r) {
                Turn::Later => continue,
                // Silent, but not watched (long enough): its peer's death reaches us
                // another way, or later.
                Turn::Failed(TransportError::Io(e))
                    if e.kind() == ErrorKind::TimedOut
                        && !self.silent_too_long(&r.conn, r.last_rx.elapsed()) =>
                {
                    continue
                }
                Turn::Bye => break None,
                Turn::Retired => return,
                Turn::Failed(e) => break Some(e),
            }
        };
        self.end_reading(r, reason);
    }

    /// One epoll reader thread: waits for readable connections and reads their frames, until
    /// the transport closes.
    fn poll_loop(self: Arc<Self>, set: &PollSet) {
        let mut events = vec![EpollEvent::empty(); 64];
        let mut last_scan = Instant::now();
        let period = (self.cfg.heartbeat_timeout / 4).min(TICK);
        let spin = self.cfg.poll_spin;
        // When a frame was last read here (`poll_spin` ago at the start: asleep at once).
        let mut last_frame = Instant::now()
            .checked_sub(spin)
            .unwrap_or_else(Instant::now);
        while !self.links.is_closing() {
            let polling = !spin.is_zero() && last_frame.elapsed() < spin;
            let wait = if polling { 0 } else { TICK.as_millis() as u16 };
            if !polling && !spin.is_zero() {
                set.asleep.store(true, Ordering::Release);
            }
            let n = match set.epoll.wait(&mut events, wait) {
                Ok(n) => n,
                Err(Errno::EINTR) => 0,
                Err(e) => {
                    error!(node = self.id, "epoll_wait failed: {e}");
                    std::thread::sleep(TICK);
                    0
                }
            };
            if n > 0 {
                // Awake (a wait that timed out leaves the flag: the thread goes back to sleep).
                set.asleep.store(false, Ordering::Release);
                last_frame = Instant::now();
            } else if polling {
                // Nothing yet: the core goes to whoever else wants it, and we look again.
                std::thread::yield_now();
            }
            for ev in &events[..n] {
                let token = ev.data();
                if token == WAKE {
                    let _ = set.wake.read(); // the count back to zero: not readable again
                    continue;
                }
                // Taken out while it is read: the handlers of its events run on this thread
                // and may install connections (into this set) meanwhile.
                let Some(mut r) = set.conns.lock().unwrap().remove(&token) else {
                    continue;
                };
                match self.read_some(&mut r) {
                    Turn::Later => {
                        set.conns.lock().unwrap().insert(token, r);
                    }
                    Turn::Bye => self.end(set, r, None),
                    Turn::Retired => {
                        let _ = set.epoll.delete(&r.input.stream);
                    }
                    Turn::Failed(e) => self.end(set, r, Some(e)),
                }
            }
            if last_scan.elapsed() >= period {
                last_scan = Instant::now();
                self.fail_silent(set);
            }
        }
        // Closing: every connection was shut down; drop them.
        let all: Vec<Reading> = set.conns.lock().unwrap().drain().map(|(_, r)| r).collect();
        for r in all {
            let _ = set.epoll.delete(&r.input.stream);
        }
    }

    /// Fails the connections of `set` that sent nothing for the heartbeat timeout.
    fn fail_silent(&self, set: &PollSet) {
        let silent: Vec<Reading> = {
            let mut map = set.conns.lock().unwrap();
            let tokens: Vec<u64> = map
                .iter()
                .filter(|(_, r)| self.silent_too_long(&r.conn, r.last_rx.elapsed()))
                .map(|(&t, _)| t)
                .collect();
            tokens.iter().filter_map(|t| map.remove(t)).collect()
        };
        for r in silent {
            let e = std::io::Error::new(ErrorKind::TimedOut, "silent");
            self.end(set, r, Some(e.into()));
        }
    }

    /// A connection's reading is over: out of the epoll set, and its link failed with the
    /// reason (`None`: a goodbye).
    fn end(&self, set: &PollSet, r: Reading, reason: Option<TransportError>) {
        let _ = set.epoll.delete(&r.input.stream);
        self.end_reading(r, reason);
    }

    /// A connection's reading is over: its link fails with the reason (`None`: a goodbye).
    fn end_reading(&self, r: Reading, reason: Option<TransportError>) {
        let peer = r.conn.peer();
        let reason = match reason {
            None => PEER_LEFT.to_string(),
            Some(TransportError::Io(e))
                if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
            {
                format!("no heartbeat for {:?}", self.cfg.heartbeat_timeout)
            }
            Some(TransportError::Io(e)) if e.kind() == ErrorKind::UnexpectedEof => {
                "connection closed without goodbye".to_string()
            }
            Some(
                e @ (TransportError::Malformed(_)
                | TransportError::MessageTooLarge { .. }
                | TransportError::OutOfBounds { .. }
                | TransportError::Forbidden(_)),
            ) => {
                self.links
                    .counters
                    .malformed_frames
                    .fetch_add(1, Ordering::Relaxed);
                error!(
                    node = self.id,
                    peer, "dropping link after malformed frame: {e}"
                );
                format!("malformed frame: {e}")
            }
            Some(e) => e.to_string(),
        };
        self.links.fail(&r.conn, reason);
    }

    /// Reads what `r`'s socket has (up to the budget) and handles the frames it completes.
    fn read_some(&self, r: &mut Reading) -> Turn {
        let mut read = 0usize;
        r.input.drained = false;
        let turn = self.read_frames(r, &mut read);
        if read > 0 {
            r.last_rx = Instant::now();
        }
        turn
    }

    /// [`Inner::read_some`]'s loop; `read` counts the bytes taken from the socket.
    fn read_frames(&self, r: &mut Reading, read: &mut usize) -> Turn {
        let peer = r.conn.peer();
        loop {
            // The budget ends a turn only where the next step would read the socket: a frame
            // already read whole, or frames already in the buffer, are handled first. Epoll
            // (level-triggered) calls again only for bytes still in the socket, so a turn that
            // stopped before them would leave them unseen until the peer sent more (a stream's
            // last data frame waited for a heartbeat, or for ever).
            let buffer_empty = r.input.start == r.input.end;
            let needs_socket = match &r.frame {
                Frame::Header => r.input.end - r.input.start < FRAME_HEADER_LEN,
                Frame::Ctrl { msg, got } => *got < msg.len() && buffer_empty,
                Frame::Data { h, got, .. } => *got < h.len && buffer_empty,
                Frame::Idle => false,
            };
            if *read >= READ_BUDGET && needs_socket {
                return Turn::Later;
            }
            let step = match &mut r.frame {
                Frame::Header => {
                    let buffered = r.input.end - r.input.start;
                    if buffered < FRAME_HEADER_LEN {
                        let want = match r.bulk {
                            true => FRAME_HEADER_LEN - buffered,
                            false => BUFFER,
                        };
                        match r.input.fill(want) {
                            Ok(0) => return Turn::Later,
                            Ok(n) => {
                                *read += n;
                                continue;
                            }
                            Err(e) => return Turn::Failed(e),
                        }
                    }
                    let mut b = [0u8; FRAME_HEADER_LEN];
                    let at = r.input.start;
                    b.copy_from_slice(&r.input.buf[at..at + FRAME_HEADER_LEN]);
                    r.input.start += FRAME_HEADER_LEN;
                    match self.start_frame(&r.conn, &b) {
                        Ok(Some(f)) => {
                            r.frame = f;
                            None
                        }
                        Ok(None) => None, // a heartbeat
                        Err(Some(e)) => return Turn::Failed(e),
                        Err(None) => return Turn::Bye,
                    }
                }
                Frame::Idle => {
                    // Nothing follows on this link: it ends without a failure.
                    self.closed_by_peer_for_idle(&r.conn);
                    return Turn::Retired;
                }
                Frame::Ctrl { msg, got } if *got < msg.len() => {
                    match r.input.read_into(&mut msg[*got..], read) {
                        Ok(0) => return Turn::Later,
                        Ok(n) => *got += n,
                        Err(e) => return Turn::Failed(e),
                    }
                    continue;
                }
                Frame::Ctrl { msg, .. } => {
                    r.bulk = false;
                    let msg = std::mem::take(msg);
                    self.links
                        .counters
                        .ctrl_received
                        .fetch_add(1, Ordering::Relaxed);
                    Some(Event::Ctrl { peer, msg })
                }
                Frame::Data { h, got, .. } if *got < h.len => {
                    let Some(arena) = self.arena.get() else {
                        return Turn::Failed(TransportError::NoArena);
                    };
                    // SAFETY: inside the arena (checked when the frame started) and inside a
                    // range granted to `peer` for one pull, whose copy the frame's `Admitted`
                    // keeps allocated; nothing else writes a range while it is granted, and
                    // readers only look below the watermark, which moves past these bytes
                    // after the Data event below.
                    let dst = unsafe { arena.slice_mut(h.dst + *got, h.len - *got) };
                    match r.input.read_into(dst, read) {
                        Ok(0) => return Turn::Later,
                        Ok(n) => *got += n as u64,
                        Err(e) => return Turn::Failed(e),
                    }
                    continue;
                }
                Frame::Data { h, .. } => {
                    r.bulk = h.len >= BUFFER as u64;
                    self.links
                        .counters
                        .data_bytes_received
                        .fetch_add(h.len, Ordering::Relaxed);
                    Some(Event::Data {
                        peer,
                        stream: h.stream,
                        offset: h.rel,
                        len: h.len,
                    })
                }
            };
            if let Some(ev) = step {
                r.conn
                    .last_used
                    .store(self.links.now_ns(), Ordering::Relaxed);
                // The frame is whole: its grant hold (if any) is released before the event.
                r.frame = Frame::Header;
                let data = match &ev {
                    Event::Data { .. } => true,
                    Event::Ctrl { msg, .. } => msg.len() >= ACK_CTRL_FROM,
                    _ => false,
                };
                self.links.emit(ev);
                if data {
                    // Its last segment is acknowledged now, not by a timer (after the event:
                    // the bytes are handed on first).
                    ack_now(&r.conn.socket);
                }
            }
        }
    }

    /// A frame header from `peer`: what to read next (`None`: nothing, a heartbeat), or the
    /// end of the connection (`Err(None)`: a goodbye).
    fn start_frame(
        &self,
        conn: &Conn,
        b: &[u8; FRAME_HEADER_LEN],
    ) -> Result<Option<Frame>, Option<TransportError>> {
        let peer = conn.peer();
        let h = FrameHeader::decode(b).map_err(Some)?;
        match h.kind {
            FrameKind::Heartbeat => {
                if h.stream == HB_WATCHING {
                    let now = self.links.now_ns();
                    conn.peer_watches.store(now, Ordering::Relaxed);
                }
                Ok(None)
            }
            FrameKind::Bye => Err(None),
            FrameKind::Idle if self.links.is_on_demand() => Ok(Some(Frame::Idle)),
            FrameKind::Idle => Err(Some(TransportError::Malformed(
                "idle close on a link of a mesh".into(),
            ))),
            FrameKind::Hello => Err(Some(TransportError::Malformed(
                "hello on a live link".into(),
            ))),
            FrameKind::Ctrl => Ok(Some(Frame::Ctrl {
                msg: vec![0u8; h.len as usize],
                got: 0,
            })),
            FrameKind::Data => {
                let arena = self.arena.get().ok_or(Some(TransportError::NoArena))?;
                arena.check(h.dst, h.len).map_err(Some)?;
                // Nothing lands outside a range this node granted to this peer; the hold keeps
                // the range allocated until the bytes are in, even if the grant is revoked.
                let held = self.grants.admit(peer, h.dst, h.rel, h.len).map_err(Some)?;
                Ok(Some(Frame::Data {
                    h,
                    _held: held,
                    got: 0,
                }))
            }
        }
    }
}

impl Input {
    /// Reads up to `most` more bytes into the buffer (moving the unread rest to its front
    /// first): the bytes read, 0 when the socket has none now.
    fn fill(&mut self, most: usize) -> Result<usize, TransportError> {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let (end, to) = (self.end, (self.end + most).min(self.buf.len()));
        let sock = Sock {
            stream: &self.stream,
            drained: &mut self.drained,
            blocking: self.blocking,
        };
        let n = recv_now(sock, &mut self.buf[end..to])?;
        self.end += n;
        Ok(n)
    }

    /// Reads into `dst` (the rest of a frame's payload): what is buffered; with nothing
    /// buffered, a rest as large as the buffer straight from the socket, a smaller one
    /// through the buffer (with the frames behind it). Returns the bytes put into `dst`, 0
    /// when the socket has none now; `read` counts the bytes taken from the socket.
    fn read_into(&mut self, dst: &mut [u8], read: &mut usize) -> Result<usize, TransportError> {
        if self.start == self.end {
            if dst.len() >= BUFFER {
                let sock = Sock {
                    stream: &self.stream,
                    drained: &mut self.drained,
                    blocking: self.blocking,
                };
                let n = recv_now(sock, dst)?;
                *read += n;
                return Ok(n);
            }
            let n = self.fill(BUFFER)?;
            *read += n;
            if n == 0 {
                return Ok(0);
            }
        }
        let n = (self.end - self.start).min(dst.len());
        dst[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        Ok(n)
    }
}

/// A connection's socket as its reader reads it.
struct Sock<'a> {
    stream: &'a TcpStream,
    /// See `Reading::drained`.
    drained: &'a mut bool,
    /// See `Reading::blocking`.
    blocking: bool,
}

/// Control frames at least this large are acknowledged at once like data frames: their
/// sender may have filled its congestion window with them, and no reply may come soon enough
/// to carry the ACK (blocks of a halving-doubling allreduce: 40-60 ms stalls, the delayed-ACK
/// timer, in about one run in sixty at 128 KiB before this).
const ACK_CTRL_FROM: usize = 16 << 10;

/// Acknowledges what was read at once instead of by the delayed-ACK timer, after each data
/// frame (and each large control frame, [`ACK_CTRL_FROM`]). A link carries requests and replies both ways, so Linux takes it for interactive
/// ("pingpong") and holds ACKs back, up to 200 ms, hoping to piggyback them on a reply; a
/// source whose last segments wait for those ACKs (its congestion window full, its tail-loss
/// probe armed) then stalls. On the 8 emulated hosts a few iterations in every sixty of a
/// 1 MiB broadcast took 60-150 ms instead of 9 (the p99 of reduce and allreduce of 64 KiB and
/// 1 MiB likewise); with this the p99 is within 2-3x of the median. Small control frames
/// keep the delayed ACK, which their replies carry. The cost is one system call per frame.
fn ack_now(stream: &TcpStream) {
    let one: nix::libc::c_int = 1;
    // SAFETY: the descriptor is the live socket `stream` borrows; the option value is a valid
    // `c_int` for the duration of the call and its length is passed with it.
    let _ = unsafe {
        nix::libc::setsockopt(
            stream.as_raw_fd(),
            nix::libc::IPPROTO_TCP,
            nix::libc::TCP_QUICKACK,
            (&one as *const nix::libc::c_int).cast(),
            std::mem::size_of::<nix::libc::c_int>() as nix::libc::socklen_t,
        )
    };
}

/// One `recv`: the bytes read. Non-blocking (`MSG_DONTWAIT`): 0 when the socket has none now
/// (or had less than asked for earlier in this turn: `drained`). Blocking: waits, and the
/// socket's receive timeout (the heartbeat timeout) is an error. The end of the stream is an
/// error (a peer leaves with a goodbye frame).
fn recv_now(sock: Sock<'_>, dst: &mut [u8]) -> Result<usize, TransportError> {
    if *sock.drained {
        return Ok(0);
    }
    let flags = match sock.blocking {
        true => MsgFlags::empty(),
        false => MsgFlags::MSG_DONTWAIT,
    };
    loop {
        match recv(sock.stream.as_raw_fd(), dst, flags) {
            Ok(0) if !dst.is_empty() => {
                return Err(std::io::Error::from(ErrorKind::UnexpectedEof).into())
            }
            Ok(n) => {
                *sock.drained = !sock.blocking && n < dst.len();
                return Ok(n);
            }
            Err(Errno::EAGAIN) if sock.blocking => {
                return Err(std::io::Error::from(ErrorKind::TimedOut).into())
            }
            Err(Errno::EAGAIN) => {
                *sock.drained = true;
                return Ok(0);
            }
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(std::io::Error::from(e).into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ack_now;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;

    /// Whether the socket is in quick-ACK mode (Linux: not delaying ACKs).
    fn quickack(s: &TcpStream) -> i32 {
        let mut v: nix::libc::c_int = -1;
        let mut len = std::mem::size_of::<nix::libc::c_int>() as nix::libc::socklen_t;
        // SAFETY: the descriptor is the live socket `s`; `v` and `len` outlive the call and
        // `len` is `v`'s size.
        let rc = unsafe {
            nix::libc::getsockopt(
                s.as_raw_fd(),
                nix::libc::IPPROTO_TCP,
                nix::libc::TCP_QUICKACK,
                (&mut v as *mut nix::libc::c_int).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0, "getsockopt TCP_QUICKACK");
        v
    }

    /// A link that went back and forth is in delayed-ACK ("pingpong") mode; after a data
    /// frame the reader puts it back in quick-ACK mode.
    #[test]
    fn a_data_frame_is_acknowledged_at_once() {
        use std::io::{Read, Write};
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        let mut buf = [0u8; 4];
        // Request and reply, a few times: Linux takes the link for interactive.
        for _ in 0..4 {
            a.write_all(b"ping").unwrap();
            b.read_exact(&mut buf).unwrap();
            b.write_all(b"pong").unwrap();
            a.read_exact(&mut buf).unwrap();
        }
        ack_now(&b);
        assert_eq!(quickack(&b), 1);
    }
}
