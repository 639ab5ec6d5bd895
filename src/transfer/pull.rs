//! The receiver side of a pull, whole: find the object (local copy, inline bytes, or a new
//! local copy), drive the pull from one source at a time, follow the data events of its
//! stream, and replace a failed source, resuming at the watermark.

use super::serve::CANCEL_POLL;
use super::{TransferRecord, Transfers};
use crate::config::INLINE_LIMIT;
use crate::directory::Resume;
use crate::hop::hop;
use crate::protocol::{Located, PullMsg};
use crate::store::CopyRef;
use crate::view::Fetched;
use crate::{Error, ObjectId, Result};
use crossbeam_channel::{Receiver, Sender};
use phalanx_transport::{NodeId, RemoteRegion, StreamId};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tracing::{debug, error, warn};

/// How long a fetch told an object is lost waits before it asks once more (a put of the
/// object racing the fetch: its announcement is one message away from the shard).
const LOST_RECHECK: Duration = Duration::from_millis(100);

/// The pause before the second attempt of a pull that keeps failing; it doubles with every
/// further failure up to `RETRY_PAUSE_MAX`.
const RETRY_PAUSE_MIN: Duration = Duration::from_millis(5);
const RETRY_PAUSE_MAX: Duration = Duration::from_millis(500);

/// How long a pull avoids a source that failed it while waiting for another (see
/// `Transfers::relocate`).
const AVOID_FOR: Duration = Duration::from_millis(250);

/// Who drives a pull that a fetch starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Driver {
    /// The calling thread, to the end, before the fetch returns.
    Caller,
    /// A worker; the fetch returns the copy while it fills.
    Worker,
}

/// The first source of a pull: the node, the assignment's token, and the epoch of the bytes
/// (`Located::Source::epoch`; unknown for a pull started on a claim).
#[derive(Debug, Clone, Copy)]
struct First {
    source: NodeId,
    token: u64,
    epoch: Option<u64>,
}

/// How a receiver's inbound stream ended.
#[derive(Debug)]
pub(super) enum InboundEnd {
    Complete,
    Failed(String),
}

/// A pull request on its way: its stream and where the stream's end is reported.
struct SentPull {
    stream: StreamId,
    /// Where the request starts.
    from: u64,
    done: Receiver<InboundEnd>,
    /// Since when the stream has made no progress (its start, or the last progress a
    /// watchdog saw before it handed the pull to a driver).
    quiet_since: Instant,
}

/// Where an inbound stream's end goes.
pub(super) enum EndTo {
    /// The thread that drives the pull (`await_pull`).
    Driver(Sender<InboundEnd>),
    /// No thread: the pull is driven by the events of its stream ([`LazyPull`]).
    Lazy(Box<LazyPull>),
}

/// A pull that no thread drives while its bytes flow (started by a fetch that returns the
/// copy at once, `Driver::Worker`): its bytes land and move on on the transport's threads as
/// any pull's, and its end is handled where it lands. A complete copy is accounted for there
/// (the record, the transfer report to the shard); a failed stream, a stall as long as the op
/// timeout, or the copy deleted here ([`Transfers::tick`]) hands the pull to a worker, which
/// goes on from the watermark as with any driven pull. So a pull in flight costs no thread
/// and no wake-up: a node with many of them keeps few threads, and a 64 KiB allreduce on the
/// 8 emulated hosts does without about 30 worker wake-ups.
pub(super) struct LazyPull {
    me: Weak<Transfers>,
    id: ObjectId,
    first: First,
    exclude: Vec<NodeId>,
    /// When the stream started.
    start: Instant,
    /// The watermark the watchdog last saw, and since when it has not moved.
    seen: u64,
    quiet_since: Instant,
}

/// Where a driver starts.
enum Begin {
    /// With a request of its own.
    Fresh,
    /// Following a request already sent.
    Sent(SentPull),
    /// After a stream that ended without a driver (from `from`, begun at `start`).
    Ended {
        from: u64,
        start: Instant,
        outcome: Result<(), String>,
    },
}

/// An inbound stream: the copy it fills and the source it must come from.
pub(super) struct Inbound {
    copy: CopyRef,
    source: NodeId,
    /// The range granted to `source` for this stream; revoked when the stream ends.
    region: RemoteRegion,
    end: EndTo,
}

impl Transfers {
    /// Finds the object: the local copy (maybe partial), inline bytes from the directory, or a
    /// new local copy being pulled by a background driver.
    pub(crate) fn fetch(self: &Arc<Self>, id: &ObjectId) -> Result<Fetched> {
        let deadline = Instant::now() + self.cfg.op_timeout;
        self.fetch_until(id, &[], Driver::Worker, deadline)
    }

    /// [`Transfers::fetch`] that never pulls from the nodes in `exclude` (for baselines). With
    /// `Driver::Caller` a pull runs to its end on the calling thread (one hand-off less for a
    /// caller that waits for the whole object anyway) before the copy is returned.
    /// Gives up looking for a source at `deadline`.
    pub(crate) fn fetch_until(
        self: &Arc<Self>,
        id: &ObjectId,
        exclude: &[NodeId],
        driver: Driver,
        deadline: Instant,
    ) -> Result<Fetched> {
        // A lost object is asked about once more after `LOST_RECHECK`: a put of it may be on
        // its way to the shard (a put returns once its announcement is sent).
        let mut rechecked = false;
        let (node, size, token, epoch, data) = loop {
            if let Some(c) = self.store.lookup(id) {
                return Ok(Fetched::Copy(c));
            }
            let located = self.dir.locate_until(id, None, exclude, deadline)?;
            hop!(self.id, "located", how = located_kind(&located));
            match located {
                Located::Local => {
                    // A local put or pull registers its copy before the directory hears of
                    // it, so the copy is here or about to be. If it is not, the directory's
                    // entry is stale (a pull whose copy was just dropped, e.g. by a reset):
                    // withdraw it and ask again.
                    let wait = Duration::from_millis(100);
                    if let Ok(c) = self.store.wait_lookup(id, wait) {
                        return Ok(Fetched::Copy(c));
                    }
                    if Instant::now() >= deadline {
                        return Err(Error::Timeout(
                            self.cfg.op_timeout,
                            format!("the local copy of {id}"),
                        ));
                    }
                    debug!(node = self.id, %id, "stale local location; asking again");
                    self.dir.withdraw(std::slice::from_ref(id));
                }
                Located::Inline(data) => return Ok(Fetched::Owned(data)),
                // Only a resumed pull is told its bytes are stale.
                Located::NotFound | Located::Reset => return Err(Error::NotFound(id.clone())),
                Located::Lost if !rechecked && Instant::now() + LOST_RECHECK < deadline => {
                    rechecked = true;
                    std::thread::sleep(LOST_RECHECK);
                }
                Located::Lost => return Err(Error::ObjectLost(id.clone())),
                Located::Source {
                    node,
                    size,
                    token,
                    epoch,
                } => break (node, size, token, Some(epoch), None),
                Located::SourceData {
                    node,
                    size,
                    token,
                    data,
                } => break (node, size, token, None, Some(data)),
            }
        };
        // Frees the source of an assignment no pull follows (one that came with the bytes
        // was reported done where the answer landed: `DirClient::locate_until`).
        let release = || {
            if data.is_none() {
                self.dir
                    .transfer_done(self.dir.shard_of(id), id, node, token, false);
            }
        };
        let copy = match self.new_copy(id, size, None) {
            Ok(Some(c)) => c,
            Ok(None) => {
                debug!(node = self.id, %id, "a local copy appeared first; waiting for it");
                release();
                return self.wait_for_local(id);
            }
            Err(e) => {
                release();
                self.dir.withdraw(std::slice::from_ref(id));
                return Err(e);
            }
        };
        if let Some(data) = data {
            let shard = self.dir.shard_of(id);
            if let Err(e) = self.fill_sent(id, &copy, node, &data) {
                self.abandon_pull(shard, id, &copy);
                return Err(e);
            }
            return Ok(Fetched::Copy(copy));
        }
        let first = First {
            source: node,
            token,
            epoch,
        };
        self.start_driver(id, copy.clone(), first, exclude, driver);
        Ok(Fetched::Copy(copy))
    }

    /// Fills `copy` from the bytes of its entry (a small object: the directory keeps them) and
    /// announces it complete.
    fn fill_inline(&self, id: &ObjectId, copy: &CopyRef, data: &[u8]) -> Result<()> {
        let from = copy.watermark();
        if data.len() as u64 != copy.size() || from > copy.size() {
            return Err(Error::Protocol {
                peer: self.dir.shard_of(id),
                what: format!(
                    "{} inline bytes of {id}, expected {}",
                    data.len(),
                    copy.size()
                ),
            });
        }
        copy.append(&data[from as usize..])?;
        hop!(self.id, "filled from the entry's bytes");
        self.landed(copy);
        self.dir.publish(id, copy.size(), true)
    }

    /// The bytes came with the location (`Located::SourceData`): the rest of `copy` is filled
    /// from them. Their `TransferDone` went out where the answer landed
    /// (`DirClient::locate_until`); a copy that cannot take them is withdrawn by the caller.
    fn fill_sent(&self, id: &ObjectId, copy: &CopyRef, source: NodeId, data: &[u8]) -> Result<()> {
        let start = Instant::now();
        let from = copy.watermark();
        let fits = data.len() as u64 == copy.size() && from <= copy.size();
        let filled = match fits {
            true => copy.append(&data[from as usize..]),
            false => Err(Error::Protocol {
                peer: source,
                what: format!(
                    "{} bytes of {id} with its location, expected {}",
                    data.len(),
                    copy.size()
                ),
            }),
        };
        let ok = filled.is_ok();
        hop!(self.id, "bytes came with the location", source = source);
        if ok {
            self.landed(copy);
        }
        self.recv_log.lock().unwrap().push(TransferRecord {
            id: id.clone(),
            source,
            receiver: self.id,
            from,
            bytes: copy.watermark() - from,
            start,
            end: Instant::now(),
            ok,
        });
        if ok {
            self.dir.took_bytes_with_location(self.dir.shard_of(id), id);
        }
        filled
    }

    /// A new local copy of `id` to pull into (the copies evicted for it withdrawn), or `None`
    /// when a concurrent local get or a local producer created one first. With `into`, the
    /// copy is made within that copy, at that offset
    /// ([`crate::store::Store::create_within`]); where it cannot be, a copy of its own.
    fn new_copy(
        &self,
        id: &ObjectId,
        size: u64,
        into: Option<(&CopyRef, u64)>,
    ) -> Result<Option<CopyRef>> {
        let within = into.map(|(outer, at)| self.store.create_within(outer, id, at, size));
        let made = match within {
            Some(Ok(c)) => Ok((c, Vec::new())),
            Some(Err(e @ Error::AlreadyExists(_))) => Err(e),
            // No room there (`InvalidArgument`): a copy of its own.
            Some(Err(_)) | None => self.store.create(id, size, false),
        };
        match made {
            Ok((copy, evicted)) => {
                self.dir.withdraw(&evicted);
                Ok(Some(copy))
            }
            Err(Error::AlreadyExists(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The local copy someone else created, once it is there.
    fn wait_for_local(&self, id: &ObjectId) -> Result<Fetched> {
        self.store
            .wait_lookup(id, self.cfg.op_timeout)
            .map(Fetched::Copy)
    }

    /// Fetches `id` (of `size` bytes) from `source`, which the caller already knows holds
    /// or produces it (a reduce task's child), without asking the directory first: the pull
    /// starts at once and the shard is told of it (`DirMsg::Claim`), so the source is
    /// accounted for as if the shard had assigned it. A failed pull falls back to the
    /// directory like any other. Small objects still come from the directory. With `into`,
    /// a new local copy is made within that copy, at that offset (a part pulled into its
    /// place in a larger object; where that cannot be, a copy of its own).
    pub(crate) fn fetch_from(
        self: &Arc<Self>,
        id: &ObjectId,
        source: NodeId,
        size: u64,
        into: Option<(&CopyRef, u64)>,
    ) -> Result<Fetched> {
        if source == self.id || size < INLINE_LIMIT {
            return self.fetch(id);
        }
        if let Some(c) = self.store.lookup(id) {
            return Ok(Fetched::Copy(c));
        }
        let Some(copy) = self.new_copy(id, size, into)? else {
            return self.wait_for_local(id);
        };
        let token = self.rpc.fresh_token();
        self.dir.claim(id, source, token);
        hop!(self.id, "pull without a lookup", source = source);
        let first = First {
            source,
            token,
            epoch: None,
        };
        self.start_driver(id, copy.clone(), first, &[], Driver::Worker);
        Ok(Fetched::Copy(copy))
    }

    /// Runs the pull of `copy` from `first` on the caller or on a worker.
    /// Handed to a worker, the first request is sent from here, so the worker's wake-up is
    /// not on the path of the bytes.
    fn start_driver(
        self: &Arc<Self>,
        id: &ObjectId,
        copy: CopyRef,
        first: First,
        exclude: &[NodeId],
        driver: Driver,
    ) {
        if driver == Driver::Caller {
            return self
                .clone()
                .drive(id.clone(), copy, first, exclude.to_vec(), Begin::Fresh);
        }
        if copy.watermark() == 0 && copy.size() > 0 && self.start_lazy(id, &copy, first, exclude) {
            return;
        }
        let sent = match copy.watermark() {
            0 => self.send_pull(id, &copy, first.source, 0).ok().flatten(),
            _ => None,
        };
        hop!(
            self.id,
            "pull driver handed to a worker",
            source = first.source
        );
        // Shared with the job, so that the pull comes back if no worker takes it.
        let slot = Arc::new(Mutex::new(Some(sent.map_or(Begin::Fresh, Begin::Sent))));
        let (me, job_slot) = (self.clone(), slot.clone());
        let (job_id, job_copy, job_exclude) = (id.clone(), copy.clone(), exclude.to_vec());
        let job = move || {
            let begin = job_slot.lock().unwrap().take();
            if let Some(begin) = begin {
                me.drive(job_id, job_copy, first, job_exclude, begin);
            }
        };
        if let Err(e) = self.workers.spawn(job) {
            // No thread to be had: this caller drives the pull itself.
            warn!(node = self.id, %id, "no worker for a pull ({e}); driving it here");
            let begin = slot.lock().unwrap().take();
            if let Some(begin) = begin {
                self.clone()
                    .drive(id.clone(), copy, first, exclude.to_vec(), begin);
            }
        }
    }

    /// Sends the first request of a pull that no thread drives ([`LazyPull`]). False if it
    /// could not be sent (the caller then hands the pull to a driver).
    fn start_lazy(
        self: &Arc<Self>,
        id: &ObjectId,
        copy: &CopyRef,
        first: First,
        exclude: &[NodeId],
    ) -> bool {
        let lazy = LazyPull {
            me: Arc::downgrade(self),
            id: id.clone(),
            first,
            exclude: exclude.to_vec(),
            start: Instant::now(),
            seen: 0,
            quiet_since: Instant::now(),
        };
        match self.open_stream(id, copy, first.source, 0, EndTo::Lazy(Box::new(lazy))) {
            Ok(Some(_)) => {
                hop!(self.id, "pull without a driver", source = first.source);
                true
            }
            _ => false,
        }
    }

    /// Runs [`Transfers::drive`] on a worker, for a pull whose end or stall was seen on a
    /// thread that must not block; with no worker to be had, on the dispatcher.
    fn drive_on_a_worker(
        self: &Arc<Self>,
        id: ObjectId,
        copy: CopyRef,
        first: First,
        exclude: Vec<NodeId>,
        begin: Begin,
    ) {
        // Shared with the job, so that the pull comes back if no worker takes it.
        let slot = Arc::new(Mutex::new(Some((id, copy, first, exclude, begin))));
        let job = |me: Arc<Self>, slot: Arc<Mutex<Option<_>>>| {
            move || {
                let taken = slot.lock().unwrap().take();
                if let Some((id, copy, first, exclude, begin)) = taken {
                    me.drive(id, copy, first, exclude, begin);
                }
            }
        };
        if let Err(e) = self.workers.spawn(job(self.clone(), slot.clone())) {
            warn!(
                node = self.id,
                "no worker for a pull ({e}); the dispatcher drives it"
            );
            let run = job(self.clone(), slot);
            self.rpc.enqueue(crate::rpc::Work::Run(Box::new(run)));
        }
    }

    /// A pull without a driver ended where its last bytes landed: accounted for as a driver
    /// would, without blocking (this thread holds the inbound table).
    fn lazy_ended(&self, l: LazyPull, copy: CopyRef, end: InboundEnd) {
        self.lazy.fetch_sub(1, Ordering::AcqRel);
        let LazyPull {
            me,
            id,
            first,
            exclude,
            start,
            ..
        } = l;
        match end {
            InboundEnd::Complete => {
                let bytes = copy.watermark();
                self.record_throughput(bytes, start.elapsed().as_secs_f64());
                self.recv_log.lock().unwrap().push(TransferRecord {
                    id: id.clone(),
                    source: first.source,
                    receiver: self.id,
                    from: 0,
                    bytes,
                    start,
                    end: Instant::now(),
                    ok: true,
                });
                hop!(self.id, "pull done where it landed", source = first.source);
                let shard = self.dir.shard_of(&id);
                self.dir.transfer_done_without_blocking(
                    shard,
                    &id,
                    first.source,
                    first.token,
                    true,
                );
            }
            InboundEnd::Failed(why) => {
                let Some(me) = me.upgrade() else { return };
                let begin = Begin::Ended {
                    from: 0,
                    start,
                    outcome: Err(why),
                };
                me.drive_on_a_worker(id, copy, first, exclude, begin);
            }
        }
    }

    /// Looks at the pulls no thread drives and the serves with no worker (the dispatcher
    /// calls it every `CANCEL_POLL` while there are some): a pull whose copy was deleted
    /// here, or whose stream made no progress for the op timeout, is handed to a driver,
    /// which stops the stream and goes on as with any driven pull.
    pub(crate) fn tick(self: &Arc<Self>) {
        self.tick_serves();
        let now = Instant::now();
        let mut handed = Vec::new();
        {
            let mut inbound = self.inbound.lock().unwrap();
            for (&stream, ib) in inbound.iter_mut() {
                let EndTo::Lazy(l) = &mut ib.end else {
                    continue;
                };
                let wm = ib.copy.watermark();
                if wm > l.seen {
                    l.seen = wm;
                    l.quiet_since = now;
                    continue;
                }
                let stalled = now.duration_since(l.quiet_since) >= self.cfg.op_timeout;
                if !stalled && !ib.copy.is_detached() {
                    continue;
                }
                let (tx, rx) = crossbeam_channel::bounded(1);
                if let EndTo::Lazy(l) = std::mem::replace(&mut ib.end, EndTo::Driver(tx)) {
                    let sent = SentPull {
                        stream,
                        from: 0,
                        done: rx,
                        quiet_since: l.quiet_since,
                    };
                    handed.push((l, ib.copy.clone(), sent));
                }
            }
        }
        for (l, copy, sent) in handed {
            self.lazy.fetch_sub(1, Ordering::AcqRel);
            hop!(self.id, "pull handed to a driver", source = l.first.source);
            self.drive_on_a_worker(l.id, copy, l.first, l.exclude, Begin::Sent(sent));
        }
    }

    /// Whether some pull runs without a driver, or some serve without a worker
    /// ([`Transfers::tick`] has work).
    pub(crate) fn has_lazy_work(&self) -> bool {
        self.lazy.load(Ordering::Acquire) > 0 || self.has_lazy_serves()
    }

    /// Pulls the copy to completion, replacing failed sources.
    fn drive(
        self: Arc<Self>,
        id: ObjectId,
        copy: CopyRef,
        first: First,
        exclude: Vec<NodeId>,
        mut begin: Begin,
    ) {
        // The sources that failed this pull, not asked again for a while.
        let mut avoid: Vec<NodeId> = Vec::new();
        let First {
            mut source,
            mut token,
            mut epoch,
        } = first;
        hop!(self.id, "pull driver running", source = source);
        // Failures since the last attempt that moved bytes, and when that was.
        let mut failures: u32 = 0;
        let mut progressed = Instant::now();
        loop {
            // The first request may have gone out before this driver ran, or its stream
            // ended before there was one.
            let (from, start, outcome) = match std::mem::replace(&mut begin, Begin::Fresh) {
                Begin::Ended {
                    from,
                    start,
                    outcome,
                } => (from, start, outcome),
                Begin::Sent(s) => (s.from, Instant::now(), self.await_pull(&copy, source, s)),
                Begin::Fresh => {
                    let from = copy.watermark();
                    (
                        from,
                        Instant::now(),
                        self.pull_once(&id, &copy, source, from),
                    )
                }
            };
            let bytes = copy.watermark() - from;
            let ok = matches!(outcome, Ok(()));
            if ok {
                self.record_throughput(bytes, start.elapsed().as_secs_f64());
            }
            self.recv_log.lock().unwrap().push(TransferRecord {
                id: id.clone(),
                source,
                receiver: self.id,
                from,
                bytes,
                start,
                end: Instant::now(),
                ok,
            });
            let shard = self.dir.shard_of(&id);
            self.dir.transfer_done(shard, &id, source, token, ok);
            let reason = match outcome {
                Ok(()) => return,
                Err(e) => e,
            };
            if copy.is_detached() || self.rpc.is_closed() {
                debug!(node = self.id, %id, "pull stopped: copy deleted or node closing");
                self.abandon_pull(shard, &id, &copy);
                return;
            }
            if bytes > 0 {
                failures = 0;
                progressed = Instant::now();
            }
            failures += 1;
            if progressed.elapsed() >= self.cfg.op_timeout {
                warn!(node = self.id, %id, failures, "pull given up after {failures} failed attempts ({reason})");
                self.abandon_pull(shard, &id, &copy);
                return;
            }
            // Logged on the 1st, 2nd, 4th, 8th, ... failure; retried after a growing pause
            // (a source that cannot be reached may be handed back until its death is known).
            if failures.is_power_of_two() {
                warn!(node = self.id, %id, source, at = copy.watermark(), failures, "pull failed ({reason}); finding another source");
            }
            if failures > 1 {
                let pause = RETRY_PAUSE_MIN * (1 << (failures - 2).min(6));
                std::thread::sleep(pause.min(RETRY_PAUSE_MAX));
            }
            // Not asked again for a while: it refused (no copy any more), or this node cannot
            // reach it (dead, or alive for the directory but not linked to us).
            if !avoid.contains(&source) && !exclude.contains(&source) {
                avoid.push(source);
            }
            // One deadline for the whole stall: the pull gives up `op_timeout` after its last
            // progress, however the time is spent (pauses, waiting for a new source).
            let deadline = progressed + self.cfg.op_timeout;
            match self.relocate(&id, &copy, epoch, &exclude, &mut avoid, deadline) {
                Ok(Located::Source { node, token: t, .. }) if copy.is_detached() => {
                    // Deleted or reset while we waited: the new source may hold other bytes.
                    self.dir.transfer_done(shard, &id, node, t, false);
                    self.abandon_pull(shard, &id, &copy);
                    return;
                }
                Ok(Located::Source {
                    node,
                    token: t,
                    epoch: e,
                    ..
                }) => {
                    source = node;
                    token = t;
                    epoch = Some(e);
                }
                Ok(Located::SourceData { node, data, .. }) => {
                    // Reported done where the answer landed: a copy that cannot take the
                    // bytes is withdrawn.
                    if copy.is_detached() || self.fill_sent(&id, &copy, node, &data).is_err() {
                        if !copy.is_detached() {
                            warn!(node = self.id, %id, source = node, "bytes with the location refused");
                        }
                        self.abandon_pull(shard, &id, &copy);
                    }
                    return;
                }
                Ok(Located::Reset) => {
                    // The object is computed again: these bytes are of the old computation.
                    // Readers of the copy see it fail and fetch the new one.
                    debug!(node = self.id, %id, "pull stopped: the object was reset");
                    self.abandon_pull(shard, &id, &copy);
                    return;
                }
                Ok(Located::Lost) => {
                    // Its readers are told why: every copy it could come from died.
                    self.abandon_pull_as(shard, &id, &copy, true);
                    return;
                }
                Ok(Located::Inline(data)) => {
                    // A small object whose bytes its entry keeps: no copy can serve this one
                    // now (the one assigned died), so it is filled from those bytes.
                    if copy.is_detached() || self.fill_inline(&id, &copy, &data).is_err() {
                        self.abandon_pull(shard, &id, &copy);
                    }
                    return;
                }
                Ok(Located::NotFound | Located::Local) | Err(_) => {
                    self.abandon_pull(shard, &id, &copy);
                    return;
                }
            }
        }
    }

    /// Asks the shard for another source of the partial `copy` (its bytes of `epoch`), never
    /// one in `exclude` (the caller's choice) and none in `avoid` (the sources that failed it)
    /// for `AVOID_FOR`: a node that refused may hold a new copy later (it fetched again, or a
    /// repair made it the producer), so with no other source by then the avoided ones are
    /// asked again. Also stops within `AVOID_FOR` of the copy being deleted here.
    fn relocate(
        &self,
        id: &ObjectId,
        copy: &CopyRef,
        epoch: Option<u64>,
        exclude: &[NodeId],
        avoid: &mut Vec<NodeId>,
        deadline: Instant,
    ) -> Result<Located> {
        loop {
            let slice = (Instant::now() + AVOID_FOR).min(deadline);
            let mut skip = exclude.to_vec();
            skip.extend(avoid.iter().copied());
            let resume = Some(Resume { epoch });
            match self.dir.locate_until(id, resume, &skip, slice) {
                Err(Error::Timeout(..))
                    if Instant::now() < deadline
                        && !copy.is_detached()
                        && !self.rpc.is_closed() =>
                {
                    avoid.clear();
                }
                r => return r,
            }
        }
    }

    /// Gives up a pull: our location leaves the directory and readers of the copy get an error.
    /// A copy that took this one's place (a reduce output produced here, a fetch started
    /// again) keeps its location.
    fn abandon_pull(&self, shard: NodeId, id: &ObjectId, copy: &CopyRef) {
        self.abandon_pull_as(shard, id, copy, false)
    }

    /// [`Transfers::abandon_pull`]; `lost`: because the object is lost (its readers are told
    /// [`crate::Error::ObjectLost`]).
    fn abandon_pull_as(&self, shard: NodeId, id: &ObjectId, copy: &CopyRef, lost: bool) {
        // Withdrawn before the copy fails: a reader that fetches again on the failure asks
        // the shard after it has forgotten this location.
        if self.store.lookup(id).is_none_or(|c| c.is_same(copy)) {
            self.dir.withdraw_at(shard, id);
        }
        match lost {
            true => copy.fail_lost(),
            false => copy.fail(),
        }
        // Its watchers (a reduce task combining as its inputs land) hear of the end now.
        self.landed(copy);
    }

    /// One pull from `source` starting at `from`; Ok once the copy is complete.
    fn pull_once(
        &self,
        id: &ObjectId,
        copy: &CopyRef,
        source: NodeId,
        from: u64,
    ) -> Result<(), String> {
        match self.send_pull(id, copy, source, from)? {
            None => Ok(()),
            Some(sent) => self.await_pull(copy, source, sent),
        }
    }

    /// Registers the inbound stream and sends the pull request (`None`: nothing to pull).
    fn send_pull(
        &self,
        id: &ObjectId,
        copy: &CopyRef,
        source: NodeId,
        from: u64,
    ) -> Result<Option<SentPull>, String> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let quiet_since = Instant::now();
        Ok(self
            .open_stream(id, copy, source, from, EndTo::Driver(tx))?
            .map(|stream| SentPull {
                stream,
                from,
                done: rx,
                quiet_since,
            }))
    }

    /// Registers an inbound stream from `source` into `copy` from `from`, its end going to
    /// `end`, and sends its pull request: the stream, or `None` if there is nothing to pull.
    fn open_stream(
        &self,
        id: &ObjectId,
        copy: &CopyRef,
        source: NodeId,
        from: u64,
        end: EndTo,
    ) -> Result<Option<StreamId>, String> {
        let size = copy.size();
        if from >= size {
            return Ok(None);
        }
        // Only `source` may write, only into this copy; the grant keeps the copy allocated
        // while a write into it is still landing.
        let dst: RemoteRegion = self
            .transport
            .grant(source, copy.offset(), size, Arc::new(copy.clone()))
            .map_err(|e| e.to_string())?;
        let stream = self.next_stream.fetch_add(1, Ordering::Relaxed);
        let lazy = matches!(end, EndTo::Lazy(_));
        // Counted while in the table (`end_inbound` and `tick` take it out).
        if lazy {
            self.lazy.fetch_add(1, Ordering::AcqRel);
        }
        self.inbound.lock().unwrap().insert(
            stream,
            Inbound {
                copy: copy.clone(),
                source,
                region: dst,
                end,
            },
        );
        if let Err(e) = self.rpc.send(
            source,
            PullMsg::Pull {
                id: id.clone(),
                stream,
                dst,
                from,
            },
        ) {
            let taken = self.inbound.lock().unwrap().remove(&stream);
            match taken {
                Some(ib) => self.end_inbound(ib, None),
                // Ended meanwhile (its source died): a pull without a driver was handed to
                // one then, which goes on with it.
                None if lazy => return Ok(Some(stream)),
                None => {}
            }
            return Err(e.to_string());
        }
        hop!(
            self.id,
            "pull request sent",
            source = source,
            stream = stream,
            from = from
        );
        Ok(Some(stream))
    }

    /// Follows a sent pull to its end; Ok once the copy is complete.
    fn await_pull(&self, copy: &CopyRef, source: NodeId, sent: SentPull) -> Result<(), String> {
        let SentPull {
            stream,
            from,
            done: rx,
            quiet_since,
        } = sent;
        // Progress is watched through the watermark; a stall as long as the op timeout
        // cancels the pull.
        let mut last = copy.watermark().max(from);
        let mut progressed = quiet_since;
        loop {
            match rx.recv_timeout(CANCEL_POLL) {
                Ok(InboundEnd::Complete) => return Ok(()),
                Ok(InboundEnd::Failed(why)) => return Err(why),
                Err(_) => {
                    let wm = copy.watermark();
                    if wm > last {
                        last = wm;
                        progressed = Instant::now();
                        continue;
                    }
                    // The copy deleted here (a reset, a delete, a repair renaming the
                    // object): the source is asked to stop at once.
                    let detached = copy.is_detached();
                    if !detached && progressed.elapsed() < self.cfg.op_timeout {
                        continue;
                    }
                    // Keep the inbound entry (and its memory) until the source confirms it
                    // stopped writing, or dies.
                    let _ = self.rpc.send(source, PullMsg::CancelPull { stream });
                    return match rx.recv_timeout(self.cfg.op_timeout) {
                        Ok(InboundEnd::Complete) => Ok(()),
                        _ if detached => Err("copy deleted".into()),
                        _ => Err(format!(
                            "no progress from {source} for {:?}",
                            self.cfg.op_timeout
                        )),
                    };
                }
            }
        }
    }
    /// Data landed for `stream`: advances the copy's watermark (in order, from the stream's
    /// source only) and ends the stream once the copy is full.
    pub fn on_data(&self, peer: NodeId, stream: StreamId, offset: u64, len: u64) {
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
            drop(inbound);
            self.end_inbound(ib, Some(InboundEnd::Failed("out-of-order data".into())));
            return;
        }
        ib.copy.advance_to(offset + len);
        hop!(self.id, "data in", from = peer, offset = offset, len = len);
        let copy = ib.copy.clone();
        let ended = if offset + len >= ib.copy.size() {
            inbound.remove(&stream)
        } else {
            None
        };
        drop(inbound);
        // On to this copy's own receivers, from this thread (see `serve.rs`).
        self.landed(&copy);
        // Its end heard with no lock held: a pull without a driver is accounted for here.
        if let Some(ib) = ended {
            self.end_inbound(ib, Some(InboundEnd::Complete));
        }
    }

    /// The source will write no more for `stream`.
    pub(super) fn on_pull_end(&self, peer: NodeId, stream: StreamId, ok: bool) {
        let mut inbound = self.inbound.lock().unwrap();
        // Only the stream's own source may end it.
        if inbound.get(&stream).is_none_or(|ib| ib.source != peer) {
            debug!(
                node = self.id,
                peer, stream, "end of a stream that is not the peer's: ignored"
            );
            return;
        }
        let ended = inbound.remove(&stream);
        drop(inbound);
        if let Some(ib) = ended {
            let why = if ok {
                "source ended early"
            } else {
                "source refused or aborted"
            };
            self.end_inbound(ib, Some(InboundEnd::Failed(why.into())));
        }
    }

    /// `peer` died: the streams it was writing fail, and their pulls look for another source.
    pub(super) fn inbound_sources(&self, peers: &mut std::collections::HashSet<NodeId>) {
        peers.extend(self.inbound.lock().unwrap().values().map(|ib| ib.source));
    }

    pub(super) fn fail_inbound_from(&self, peer: NodeId, reason: &str) {
        let failed: Vec<Inbound> = {
            let mut inbound = self.inbound.lock().unwrap();
            let streams: Vec<StreamId> = inbound
                .iter()
                .filter(|(_, ib)| ib.source == peer)
                .map(|(s, _)| *s)
                .collect();
            streams
                .into_iter()
                .filter_map(|s| inbound.remove(&s))
                .collect()
        };
        for ib in failed {
            let why = format!("source {peer} down: {reason}");
            self.end_inbound(ib, Some(InboundEnd::Failed(why)));
        }
    }

    /// The node is closing: every stream fails.
    pub(super) fn fail_all_inbound(&self) {
        let all: Vec<Inbound> = self
            .inbound
            .lock()
            .unwrap()
            .drain()
            .map(|(_, ib)| ib)
            .collect();
        for ib in all {
            self.end_inbound(ib, Some(InboundEnd::Failed("node shut down".into())));
        }
    }

    /// A stream is over (taken out of the inbound table, whose lock the caller no longer
    /// holds): its source may no longer write into its copy, and its pull hears how it ended.
    fn end_inbound(&self, ib: Inbound, end: Option<InboundEnd>) {
        self.transport.revoke(ib.source, &ib.region);
        match (ib.end, end) {
            (EndTo::Driver(done), Some(end)) => {
                let _ = done.send(end);
            }
            (EndTo::Lazy(l), Some(end)) => self.lazy_ended(*l, ib.copy, end),
            (EndTo::Lazy(_), None) => {
                self.lazy.fetch_sub(1, Ordering::AcqRel);
            }
            (EndTo::Driver(_), None) => {}
        }
    }
}

/// What a location answer said, for traces (without the inline bytes).
fn located_kind(l: &Located) -> &'static str {
    match l {
        Located::Inline(_) => "inline",
        Located::Source { .. } => "source",
        Located::SourceData { .. } => "source with the bytes",
        Located::Local => "local",
        Located::NotFound => "not found",
        Located::Reset => "reset",
        Located::Lost => "lost",
    }
}
