//! The source side of a pull, whole: a pull request starts a serve that writes the local copy
//! (possibly still filling) into the receiver's region chunk by chunk, until done, cancelled by
//! the receiver, or cut by the receiver's death; the fault hook may end it on purpose.
//!
//! A small copy that is still filling, or not here yet, is also *forwarded as its bytes land*
//! ([`Forward`]): the thread that moved its watermark (the transport thread that took the
//! bytes in, the thread combining a reduce output, a put copying in) writes them on to each
//! receiver at once, if the transport takes them without blocking (`Transfers::landed`). In
//! a chain of readers of a medium object every hop then forwards without waking a thread; on
//! 8 hosts sharing 2 cores that wake-up was 50-100 us a hop. A pull that comes before its
//! copy exists (a parent asking for an output its child's task has not made yet) is bound to
//! the copy that appears. The serve's worker stays the stream's owner, woken only when the
//! forwarder asks it to write what it left (a write that would block, a race for the
//! stream's position), at the copy's end, or to look for a cancel: it ends the stream on
//! failure, cancel or timeout.

use super::{OnLanded, ServeRecord, Transfers};
use crate::fault::FaultAction;
use crate::hop::hop;
use crate::protocol::{Located, Msg, PullMsg, Reply};
use crate::store::CopyRef;
use crate::store::CopyStatus;
use crate::{Error, ObjectId, Result};
use phalanx_transport::{NodeId, RemoteRegion, StreamId};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};
use tracing::debug;
use PullMsg::PullEnd;

/// How long a source waits for a copy the shard says it has but that is not here yet (the
/// shard lists a receiver before its pull creates the copy: a moment, normally).
const COPY_WAIT: Duration = Duration::from_secs(1);

/// How often a wait that nothing else wakes looks for a cancel.
pub(super) const CANCEL_POLL: Duration = Duration::from_millis(50);

/// A serve of a small copy still filling, written on by whichever thread moves the copy's
/// watermark (see the module): a watcher of its object (`landed.rs`) while the serve lasts.
pub(super) struct Forward {
    /// The transfers it writes with (weak: they hold it while it is watched).
    owner: Weak<Transfers>,
    id: ObjectId,
    /// The copy being served, once there; this reference keeps its bytes in place. A pull
    /// that comes before its copy exists (a parent asking for a reduce output whose task
    /// has not created it yet, a receiver sent to a copy whose own pull has not begun) is
    /// bound to the copy that appears, by the first thread that fills it or by the serve's
    /// worker, whichever comes first: the bytes then leave with the thread that made them,
    /// not after the worker's wake-up.
    copy: OnceLock<CopyRef>,
    receiver: NodeId,
    stream: StreamId,
    dst: RemoteRegion,
    cancel: Arc<AtomicBool>,
    /// How far the stream is written and whether it is over. Whoever writes holds it, so the
    /// stream's bytes go out in order and once.
    sent: Mutex<Sent>,
    /// The forwarder left bytes to the worker (a write that would block, too many bytes at
    /// once, the fault hook, or the stream's position taken).
    help: AtomicBool,
    /// Where the stream started.
    from: u64,
    /// When the serve began (for its record).
    start: Instant,
    /// Someone owns the end of the stream: a worker, or the forwarder that wrote its last
    /// byte. Until then a forward of a copy that is here runs with no worker at all (see
    /// [`Transfers::serve_lazily`]); whoever sets this first ends the serve.
    owned: AtomicBool,
}

#[derive(Debug)]
struct Sent {
    off: u64,
    ended: bool,
    /// Bytes the forwarder wrote (for the serve's record).
    forwarded: u64,
    /// The position and the copy's watermark when `tick_serves` last looked, and since
    /// when they have not moved.
    seen: (u64, u64, Instant),
}

/// One pull request, as a source serves it: write `[from, size)` of `id` into `dst`, tagged
/// `stream`, for `receiver`.
struct Request {
    receiver: NodeId,
    id: ObjectId,
    stream: StreamId,
    dst: RemoteRegion,
    from: u64,
}

impl Forward {
    /// Leaves the bytes that landed to the serve's worker, and wakes it (starts it, if the
    /// serve has none yet).
    fn ask_help(&self, copy: &CopyRef) {
        self.help.store(true, Ordering::Release);
        copy.kick();
        if let Some(t) = self.owner.upgrade() {
            t.give_a_worker(self.receiver, self.stream);
        }
    }

    /// The pull request this forward serves.
    fn request(&self) -> Request {
        Request {
            receiver: self.receiver,
            id: self.id.clone(),
            stream: self.stream,
            dst: self.dst,
            from: self.from,
        }
    }

    /// Whether this forward writes from `copy`: the copy it is bound to, or, not bound yet,
    /// one of the size its receiver expects (then bound to it).
    fn bind(&self, copy: &CopyRef) -> bool {
        if self.copy.get().is_none() && (copy.size() != self.dst.len || copy.is_detached()) {
            return false;
        }
        self.copy.get_or_init(|| copy.clone()).is_same(copy)
    }
}

impl OnLanded for Forward {
    /// Bytes landed in a copy of the object: written on if they are this forward's copy's.
    fn landed(&self, copy: &CopyRef) {
        if let (true, Some(t)) = (self.bind(copy), self.owner.upgrade()) {
            t.forward_one(self);
        }
    }
}

/// How a serve ended well.
enum Served {
    /// The worker wrote the last bytes (this many in all): it ends the stream.
    Here(u64),
    /// The forwarder wrote the last bytes and ended the stream.
    Forwarded,
}

impl Transfers {
    /// A receiver asks for `[from, size)` of `id`: served by a worker, and forwarded as it
    /// lands when the copy is small and still filling. Runs on a transport thread: never
    /// blocks.
    pub(super) fn on_pull(
        self: &Arc<Self>,
        receiver: NodeId,
        id: ObjectId,
        stream: StreamId,
        dst: RemoteRegion,
        from: u64,
    ) {
        let req = Request {
            receiver,
            id,
            stream,
            dst,
            from,
        };
        if self.serve_here(&req) {
            return;
        }
        let cancel = Arc::new(AtomicBool::new(false));
        self.serving
            .lock()
            .unwrap()
            .insert((receiver, stream), cancel.clone());
        let fwd = self.forward_begin(&req, &cancel);
        if let Some(f) = fwd.as_ref().filter(|f| f.copy.get().is_some()) {
            self.serve_lazily(f);
            return;
        }
        if let Some(f) = &fwd {
            f.owned.store(true, Ordering::Release);
        }
        let me = self.clone();
        let job_fwd = fwd.clone();
        let spawned = self.workers.spawn(move || me.serve(req, cancel, job_fwd));
        if spawned.is_err() {
            self.serving.lock().unwrap().remove(&(receiver, stream));
            // Unless the forwarder already wrote it all, the stream ends refused.
            let over = fwd.as_ref().is_some_and(|f| self.forward_close(f).0);
            if !over {
                let refused = PullEnd { stream, ok: false };
                self.rpc
                    .send_from_transport_thread(receiver, refused.into());
            }
        }
    }

    /// A forward of a copy that is here, served with no worker while its forwarder keeps
    /// up: the thread that lands its bytes writes them on, and the one that writes the last
    /// ends the serve (`end_lazily`). A worker is started when the forwarder asks for help,
    /// or by [`Transfers::tick`] for a cancel or bytes left waiting; it then owns the stream
    /// as any serve's worker does. On a chain of readers of a medium object no thread wakes
    /// at the sources at all.
    fn serve_lazily(&self, f: &Arc<Forward>) {
        self.lazy_serves
            .lock()
            .unwrap()
            .insert((f.receiver, f.stream), f.clone());
        // Help asked before it was listed here (by the forwarder's first write, or a
        // landing in between) found no serve to give a worker to: given now.
        if f.help.load(Ordering::Acquire) {
            self.give_a_worker(f.receiver, f.stream);
        }
        hop!(
            self.id,
            "serve without a worker",
            to = f.receiver,
            stream = f.stream
        );
        let ended = f.sent.lock().unwrap().ended;
        if ended {
            self.end_lazily(f.receiver, f.stream);
        }
    }

    /// The forwarder wrote the last byte of a serve without a worker: its end, here.
    fn end_lazily(&self, receiver: NodeId, stream: StreamId) {
        let Some(f) = self.lazy_serves.lock().unwrap().remove(&(receiver, stream)) else {
            return;
        };
        if f.owned.swap(true, Ordering::AcqRel) {
            return; // a worker took it: it ends the serve
        }
        self.serving.lock().unwrap().remove(&(receiver, stream));
        let (_, forwarded) = self.forward_close(&f);
        let bytes = f.dst.len.saturating_sub(f.from);
        self.record_serve(&f.id, receiver, (bytes, forwarded), f.start);
    }

    /// Starts a worker for the serve without one of `(receiver, stream)`, if it still has
    /// none: it then owns the stream. Never blocks.
    pub(super) fn give_a_worker(&self, receiver: NodeId, stream: StreamId) {
        let Some(f) = self.lazy_serves.lock().unwrap().remove(&(receiver, stream)) else {
            return;
        };
        if f.owned.swap(true, Ordering::AcqRel) {
            return;
        }
        let Some(me) = f.owner.upgrade() else { return };
        let cancel = f.cancel.clone();
        let (req, job_fwd) = (f.request(), f.clone());
        hop!(
            self.id,
            "serve handed to a worker",
            to = receiver,
            stream = stream
        );
        if let Err(e) = self
            .workers
            .spawn(move || me.serve(req, cancel, Some(job_fwd)))
        {
            debug!(
                node = self.id,
                receiver, "no worker for a serve ({e}): refused"
            );
            self.serving.lock().unwrap().remove(&(receiver, stream));
            let (over, _) = self.forward_close(&f);
            if !over {
                let refused = PullEnd { stream, ok: false };
                self.rpc
                    .send_from_transport_thread(receiver, refused.into());
            }
        }
    }

    /// Looks at the serves without a worker (from `Transfers::tick`): one cancelled, or
    /// with bytes its forwarder left for `CANCEL_POLL` (a filler that does not forward), or
    /// that made no progress for the op timeout, gets a worker.
    pub(super) fn tick_serves(&self) {
        let due: Vec<(NodeId, StreamId)> = {
            let lazy = self.lazy_serves.lock().unwrap();
            lazy.iter()
                .filter(|(_, f)| self.serve_needs_a_worker(f))
                .map(|(k, _)| *k)
                .collect()
        };
        for (receiver, stream) in due {
            self.give_a_worker(receiver, stream);
        }
    }

    fn serve_needs_a_worker(&self, f: &Forward) -> bool {
        if f.cancel.load(Ordering::Acquire) || self.rpc.is_closed() {
            return true;
        }
        let Some(copy) = f.copy.get() else {
            return true;
        };
        // A copy that failed, or was dropped here before it was complete: the worker ends
        // the stream at once (refused), as it would have found it.
        if copy.status() == CopyStatus::Failed
            || (copy.is_detached() && copy.status() != CopyStatus::Complete)
        {
            return true;
        }
        let Ok(mut sent) = f.sent.try_lock() else {
            return false; // being written now
        };
        let now = Instant::now();
        let wm = copy.watermark();
        if sent.off != sent.seen.0 || wm != sent.seen.1 {
            sent.seen = (sent.off, wm, now);
            return false;
        }
        let quiet = now.duration_since(sent.seen.2);
        (wm > sent.off && quiet >= CANCEL_POLL) || quiet >= self.cfg.op_timeout
    }

    /// Whether some serve runs without a worker ([`Transfers::tick_serves`] has work).
    pub(super) fn has_lazy_serves(&self) -> bool {
        !self.lazy_serves.lock().unwrap().is_empty()
    }

    /// Starts forwarding `[from, size)` of a small copy still filling to `receiver`, with
    /// what it holds already; `None` when the copy does not qualify (absent, complete, large,
    /// or under the fault hook).
    fn forward_begin(
        self: &Arc<Self>,
        req: &Request,
        cancel: &Arc<AtomicBool>,
    ) -> Option<Arc<Forward>> {
        let (receiver, stream, from) = (req.receiver, req.stream, req.from);
        let (id, dst) = (&req.id, &req.dst);
        let copy = self.store.lookup(id);
        // Without a copy yet, the receiver's region says the size.
        let size = copy.as_ref().map_or(dst.len, |c| c.size());
        if size > FORWARD_MAX
            || copy
                .as_ref()
                .is_some_and(|c| c.status() != CopyStatus::Filling)
            || dst.len != size
            || from >= size
            || self.fault.budget(id, from).is_some()
        {
            return None;
        }
        let bound = copy.is_some();
        let f = Arc::new(Forward {
            owner: Arc::downgrade(self),
            id: id.clone(),
            copy: copy.map_or_else(OnceLock::new, OnceLock::from),
            receiver,
            stream,
            dst: *dst,
            cancel: cancel.clone(),
            sent: Mutex::new(Sent {
                off: from,
                ended: false,
                forwarded: 0,
                seen: (from, 0, Instant::now()),
            }),
            help: AtomicBool::new(false),
            from,
            start: Instant::now(),
            owned: AtomicBool::new(false),
        });
        self.watch(id, f.clone());
        if bound {
            self.forward_one(&f);
        }
        Some(f)
    }

    /// Writes what `f`'s copy holds beyond what was sent, if nobody else is writing it and
    /// the transport takes it at once; ends the stream with the last byte. Never blocks.
    fn forward_one(&self, f: &Forward) {
        let id = &f.id;
        let Some(copy) = f.copy.get() else {
            return; // no copy yet
        };
        let Ok(mut sent) = f.sent.try_lock() else {
            // The worker holds the position (writing, or looking): it takes these bytes.
            f.ask_help(copy);
            return;
        };
        if sent.ended || f.cancel.load(Ordering::Acquire) || self.rpc.is_closed() {
            return;
        }
        // The copy failed (its filler gave up): the stream ends refused, by a worker.
        if copy.status() == CopyStatus::Failed {
            drop(sent);
            f.ask_help(copy);
            return;
        }
        let (wm, size) = (copy.watermark(), copy.size());
        if wm <= sent.off {
            return;
        }
        // Too much at once, or under the fault hook: the worker writes it (and applies the
        // hook).
        if wm - sent.off > SERVE_HERE_MAX || self.fault.budget(id, sent.off).is_some() {
            drop(sent);
            f.ask_help(copy);
            return;
        }
        let n = wm - sent.off;
        let written = self.transport.write_nonblocking(
            f.receiver,
            f.stream,
            copy.offset() + sent.off,
            &f.dst,
            sent.off,
            n,
        );
        if !matches!(written, Ok(true)) {
            // Would block, or the link failed: the worker writes it, or finds out.
            drop(sent);
            f.ask_help(copy);
            return;
        }
        hop!(
            self.id,
            "forwarded as it landed",
            to = f.receiver,
            offset = sent.off,
            len = n
        );
        sent.off = wm;
        sent.forwarded += n;
        if wm == size {
            // The last byte ends the stream at the receiver: no `PullEnd` (see `serve`).
            sent.ended = true;
            drop(sent);
            copy.kick(); // the worker is done: it stops the forward
            if !f.owned.load(Ordering::Acquire) {
                self.end_lazily(f.receiver, f.stream);
            }
        }
    }

    /// Stops forwarding `f`: afterwards only the caller writes or ends its stream. Whether
    /// the forwarder had already ended it, and the bytes it wrote.
    fn forward_close(&self, f: &Arc<Forward>) -> (bool, u64) {
        let (ended, forwarded) = {
            let mut sent = f.sent.lock().unwrap();
            (std::mem::replace(&mut sent.ended, true), sent.forwarded)
        };
        let hook: Arc<dyn OnLanded> = f.clone();
        self.unwatch(&f.id, &hook);
        (ended, forwarded)
    }

    /// Serves a small rest of a complete copy at once, on the transport thread the request
    /// came in on, if the transport can take it without blocking: one hand-off less for the
    /// smallest objects that are pulled. False: nothing was written, a worker serves it.
    fn serve_here(&self, req: &Request) -> bool {
        let (receiver, stream, from) = (req.receiver, req.stream, req.from);
        let (id, dst) = (&req.id, &req.dst);
        let Some(copy) = self.store.lookup(id) else {
            return false;
        };
        let size = copy.size();
        let small = from < size && size - from <= SERVE_HERE_MAX;
        if !small
            || copy.status() != CopyStatus::Complete
            || dst.len != size
            || self.fault.budget(id, from).is_some()
        {
            return false;
        }
        let start = Instant::now();
        let written = self.transport.write_nonblocking(
            receiver,
            stream,
            copy.offset() + from,
            dst,
            from,
            size - from,
        );
        if !matches!(written, Ok(true)) {
            return false;
        }
        hop!(
            self.id,
            "served on the transport thread",
            to = receiver,
            len = size - from
        );
        // The last byte ends the stream at the receiver: no `PullEnd` (see `serve`).
        self.record_serve(id, receiver, (size - from, 0), start);
        true
    }

    /// A location answer of the shard on this node that names this node as the source of a
    /// medium object it holds complete carries the bytes (`Located::SourceData`): the
    /// requester has them one round trip earlier, without a pull. The assignment stands as
    /// the shard made it (the requester reports `TransferDone`), so a copy still serves one
    /// receiver at a time. Any other message is returned as it is.
    pub(crate) fn with_local_bytes(&self, id: &ObjectId, to: NodeId, msg: Msg) -> Msg {
        let Msg::Reply {
            rid,
            reply:
                Reply::Located(Located::Source {
                    node,
                    size,
                    token,
                    epoch,
                }),
        } = msg
        else {
            return msg;
        };
        let plain = |rid| Msg::Reply {
            rid,
            reply: Reply::Located(Located::Source {
                node,
                size,
                token,
                epoch,
            }),
        };
        if node != self.id || to == self.id || size > LOCATE_DATA_MAX {
            return plain(rid);
        }
        let Some(copy) = self.store.lookup(id) else {
            return plain(rid);
        };
        if copy.status() != CopyStatus::Complete
            || copy.size() != size
            || self.fault.budget(id, 0).is_some()
        {
            return plain(rid);
        }
        let start = Instant::now();
        let data = copy.filled(0, size).to_vec();
        hop!(self.id, "bytes with the location", to = to, len = size);
        self.record_serve(id, to, (size, 0), start);
        Msg::Reply {
            rid,
            reply: Reply::Located(Located::SourceData {
                node,
                size,
                token,
                data,
            }),
        }
    }

    /// Logs a finished serve.
    fn record_serve(
        &self,
        id: &ObjectId,
        receiver: NodeId,
        (bytes, forwarded): (u64, u64),
        start: Instant,
    ) {
        self.serve_log.lock().unwrap().push(ServeRecord {
            id: id.clone(),
            source: self.id,
            receiver,
            bytes,
            forwarded,
            start,
            end: Instant::now(),
        });
    }

    /// The receiver gives up on `stream`.
    pub(super) fn on_cancel(&self, receiver: NodeId, stream: StreamId) {
        if let Some(f) = self.serving.lock().unwrap().get(&(receiver, stream)) {
            f.store(true, Ordering::Release);
        }
    }

    /// `peer` died: stop serving it.
    pub(super) fn cancel_serving_to(&self, peer: NodeId) {
        for ((r, _), flag) in self.serving.lock().unwrap().iter() {
            if *r == peer {
                flag.store(true, Ordering::Release);
            }
        }
    }

    /// Serves one pull: writes `[from, size)` of the local copy into `dst` as it fills,
    /// sharing the stream with its forwarder `fwd` if it has one.
    fn serve(
        self: &Arc<Self>,
        req: Request,
        cancel: Arc<AtomicBool>,
        mut fwd: Option<Arc<Forward>>,
    ) {
        let (receiver, stream, from) = (req.receiver, req.stream, req.from);
        let (id, dst) = (&req.id, &req.dst);
        hop!(self.id, "serve running", to = receiver, stream = stream);
        let start = Instant::now();
        let result = self.serve_inner(&req, &cancel, &mut fwd);
        self.serving.lock().unwrap().remove(&(receiver, stream));
        // The forwarder may have ended the stream meanwhile; else this worker ends it.
        // After this the forwarder writes nothing more. `by_forwarder`: it had written the
        // last byte and ended the stream (a worker that ends it well marks it over itself).
        let (by_forwarder, forwarded) = match &fwd {
            Some(f) => self.forward_close(f),
            None => (false, 0),
        };
        let ok = match &result {
            Ok(Served::Forwarded) => {
                let bytes = dst.len.saturating_sub(from);
                self.record_serve(id, receiver, (bytes, forwarded), start);
                return;
            }
            Ok(Served::Here(bytes)) => {
                self.record_serve(id, receiver, (*bytes, forwarded), start);
                // A stream is over at the receiver with its last byte (`Transfers::on_data`),
                // which frees its grant: a `PullEnd` after it would be one more message on
                // every hop for nothing. It is sent when the source stops early (a failure, a
                // cancel, which the receiver waits on before it frees the grant) or had
                // nothing to write.
                if *bytes > 0 {
                    return;
                }
                true
            }
            Err(_) if by_forwarder => return, // it ended well before this worker failed
            Err(e) => {
                debug!(node = self.id, receiver, %id, "serve ended: {e}");
                false
            }
        };
        let _ = self.rpc.send(receiver, PullMsg::PullEnd { stream, ok });
    }

    fn serve_inner(
        self: &Arc<Self>,
        req: &Request,
        cancel: &Arc<AtomicBool>,
        fwd: &mut Option<Arc<Forward>>,
    ) -> Result<Served> {
        let (receiver, stream, from) = (req.receiver, req.stream, req.from);
        let (id, dst) = (&req.id, &req.dst);
        // The directory may send a receiver here a moment before our own pull has created
        // the copy; wait for it briefly rather than refuse, and no longer than the receiver
        // wants it (a receiver whose copy was deleted cancels). A forwarded serve has its
        // copy: the very one its forwarder writes from.
        let deadline = Instant::now() + self.cfg.op_timeout.min(COPY_WAIT);
        let copy = loop {
            if let Some(c) = fwd.as_deref().and_then(|f| f.copy.get()) {
                break c.clone();
            }
            // Here: served, whatever the hints say (a node that does not read an allreduce
            // still serves the partitions its tasks made, however late it is asked).
            if let Some(c) = self.store.lookup(id) {
                break c;
            }
            // Dropped here (deleted, evicted, failed) and not made again: no copy is
            // coming; the receiver asks elsewhere now rather than after the wait, and the
            // location goes if it is still listed (announced as the copy was deleted).
            if self.store.recently_dropped(id) {
                self.dir.withdraw(std::slice::from_ref(id));
                return Err(Error::NotFound(id.clone()));
            }
            // Named as a partition's source by its coordinator, and nothing here takes the
            // hint: this node does not read the allreduce, no copy is coming.
            if self.hints.unclaimed(id) {
                debug!(node = self.id, %id, "asked for a partition this node does not read");
                return Err(Error::NotFound(id.clone()));
            }
            let slice = deadline
                .saturating_duration_since(Instant::now())
                .min(CANCEL_POLL);
            match self.store.wait_lookup(id, slice) {
                Ok(c) => break c,
                Err(e) if Instant::now() >= deadline => {
                    // Listed here with no copy (a pull that ended before it began): the
                    // location goes, so the shard stops sending receivers here.
                    if self.store.lookup(id).is_none() {
                        self.dir.withdraw(std::slice::from_ref(id));
                    }
                    return Err(e);
                }
                Err(_) if cancel.load(Ordering::Acquire) || self.rpc.is_closed() => {
                    return Err(Error::Shutdown)
                }
                Err(_) => {}
            }
        };
        // A copy that was not here when the request came (the shard names a receiver's copy
        // as a source before its pull creates it) is forwarded from now on.
        if fwd.is_none() {
            *fwd = self.forward_begin(req, cancel);
        }
        let fwd = fwd.as_deref();
        if fwd.is_some_and(|f| !f.bind(&copy)) {
            return Err(Error::NotFound(id.clone())); // replaced meanwhile: ask again
        }
        let chunk = serve_chunk(self.cfg.chunk_size, copy.size());
        let mut off = from;
        loop {
            let wm = match fwd {
                None => copy.wait_beyond(off, self.cfg.op_timeout)?,
                Some(f) => match self.await_forwarder(&copy, f, cancel)? {
                    Some(wm) => wm,
                    None => return Ok(Served::Forwarded),
                },
            };
            let size = copy.size();
            if dst.len != size {
                return Err(Error::Protocol {
                    peer: receiver,
                    what: format!("region of {} for an object of {size}", dst.len),
                });
            }
            // With a forwarder, the stream's position is shared: held while writing.
            let mut sent = match fwd {
                Some(f) => {
                    let sent = f.sent.lock().unwrap();
                    if sent.ended {
                        return Ok(Served::Forwarded);
                    }
                    off = sent.off;
                    Some(sent)
                }
                None => None,
            };
            let base = copy.offset();
            while off < wm {
                if cancel.load(Ordering::Acquire) || self.rpc.is_closed() {
                    return Err(Error::Shutdown);
                }
                let mut n = (wm - off).min(chunk);
                if let Some(budget) = self.fault.budget(id, off) {
                    if budget == 0 {
                        if self.fault.fire() == Some(FaultAction::Stall) {
                            // A hung serve: no more bytes until the receiver gives up.
                            while !cancel.load(Ordering::Acquire) && !self.rpc.is_closed() {
                                std::thread::sleep(CANCEL_POLL);
                            }
                        }
                        return Err(Error::Shutdown);
                    }
                    n = n.min(budget);
                }
                self.transport
                    .write(receiver, stream, base + off, dst, off, n)?;
                hop!(self.id, "written", to = receiver, offset = off, len = n);
                off += n;
                if let Some(s) = sent.as_mut() {
                    s.off = off;
                }
            }
            if off >= size {
                if let Some(s) = sent.as_mut() {
                    s.ended = true;
                }
                return Ok(Served::Here(off - from));
            }
        }
    }
}

impl Transfers {
    /// A forwarded serve's worker waits here while the forwarder writes what lands: woken
    /// when the forwarder asks for help (a write that would block), at the copy's end, or to
    /// look for a cancel, not by every piece. Bytes the forwarder leaves for a whole
    /// `CANCEL_POLL` without asking (a filler that does not forward) are written too.
    /// Returns the watermark when bytes are left for the worker to write, `None` when the
    /// forwarder ended the stream.
    fn await_forwarder(
        &self,
        copy: &CopyRef,
        f: &Forward,
        cancel: &AtomicBool,
    ) -> Result<Option<u64>> {
        let mut progressed = Instant::now();
        let mut last = None;
        // Since when bytes wait with nobody asking for help, at which position.
        let mut waiting: Option<(u64, Instant)> = None;
        loop {
            let seen = copy.kicks();
            let off = {
                let sent = f.sent.lock().unwrap();
                if sent.ended {
                    return Ok(None);
                }
                sent.off
            };
            if last != Some(off) {
                (last, progressed) = (Some(off), Instant::now());
            }
            // Read after the stream's position: a forwarder that found it taken asked for
            // help, and its bytes landed before.
            let help = f.help.swap(false, Ordering::AcqRel);
            match copy.wait_beyond(off, Duration::ZERO) {
                Ok(wm) if help => return Ok(Some(wm)),
                Ok(wm) => match waiting {
                    Some((at, since)) if at == off && since.elapsed() >= CANCEL_POLL => {
                        return Ok(Some(wm));
                    }
                    Some((at, _)) if at == off => {}
                    _ => waiting = Some((off, Instant::now())),
                },
                Err(Error::Timeout(..)) => waiting = None,
                Err(e) => return Err(e),
            }
            if cancel.load(Ordering::Acquire) || self.rpc.is_closed() {
                return Err(Error::Shutdown);
            }
            if progressed.elapsed() >= self.cfg.op_timeout {
                return Err(Error::Timeout(
                    self.cfg.op_timeout,
                    format!("bytes of {}", f.id),
                ));
            }
            copy.wait_kick(seen, CANCEL_POLL);
        }
    }
}

/// The largest object whose serves of a copy still filling are forwarded as it lands. A
/// forward that the socket cannot take at once is queued by the transport (copied), not
/// pushed back: for a medium object that is at most the object, for a large one it could be
/// most of it (and a link whose queue passes `MAX_QUEUED` fails), so large objects keep the
/// worker's blocking writes, whose backpressure holds the queue down. Measured with no bound,
/// a 16 MiB allreduce on the emulated hosts gained 7 % and a 64 MiB one 1.5 %.
const FORWARD_MAX: u64 = LOCATE_DATA_MAX;

/// The largest object whose bytes go with a location answer (`Transfers::with_local_bytes`):
/// up to here one message costs less than a pull's extra round trip.
pub(crate) const LOCATE_DATA_MAX: u64 = 256 << 10;

/// The largest rest of a complete copy served on the transport thread (one frame).
const SERVE_HERE_MAX: u64 = 64 << 10;

/// The smallest piece a source writes at once (per-frame costs).
const MIN_SERVE_CHUNK: u64 = 16 << 10;

/// Bytes a source writes at once for an object of `size`: about a sixteenth of the object, so
/// that even a mid-sized object (a 64 KiB one in four pieces) crosses a chain of forwarding
/// nodes and reduce tasks in several pieces, at least 16 KiB and at most the configured
/// `chunk_size`.
fn serve_chunk(chunk_size: u64, size: u64) -> u64 {
    (size / 16).clamp(MIN_SERVE_CHUNK, chunk_size.max(MIN_SERVE_CHUNK))
}

#[cfg(test)]
mod tests {
    use super::serve_chunk;

    #[test]
    fn chunks_follow_the_object_size_within_bounds() {
        assert_eq!(serve_chunk(4 << 20, 1 << 20), 64 << 10);
        assert_eq!(
            serve_chunk(4 << 20, 64 << 10),
            16 << 10,
            "a 64 KiB object in 4 pieces"
        );
        assert_eq!(serve_chunk(4 << 20, 16 << 20), 1 << 20);
        assert_eq!(serve_chunk(4 << 20, 1 << 30), 4 << 20);
        assert_eq!(serve_chunk(4 << 20, 100), 16 << 10);
        assert_eq!(serve_chunk(4096, 1 << 30), 16 << 10, "never below 16 KiB");
    }
}
