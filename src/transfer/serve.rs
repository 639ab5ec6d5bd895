//! The source side of a pull, whole: a pull request starts a serve that writes the local copy
//! (possibly still filling) into the receiver's region chunk by chunk, until done, cancelled by
//! the receiver, or cut by the receiver's death; the fault hook may end it on purpose.

use super::{ServeRecord, Transfers};
use crate::hop::hop;
use crate::protocol::{Located, Msg, PullMsg, Reply};
use crate::store::CopyStatus;
use crate::{Error, ObjectId, Result};
use phalanx_transport::{NodeId, RemoteRegion, StreamId};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::debug;

/// How long a source waits for a copy the shard says it has but that is not here yet (the
/// shard lists a receiver before its pull creates the copy: a moment, normally).
const COPY_WAIT: Duration = Duration::from_secs(1);

/// How often a wait that nothing else wakes looks for a cancel.
pub(super) const CANCEL_POLL: Duration = Duration::from_millis(50);

impl Transfers {
    /// A receiver asks for `[from, size)` of `id`: served by a worker. Runs on a transport
    /// thread: never blocks.
    pub(super) fn on_pull(
        self: &Arc<Self>,
        receiver: NodeId,
        id: ObjectId,
        stream: StreamId,
        dst: RemoteRegion,
        from: u64,
    ) {
        if self.serve_here(receiver, &id, stream, &dst, from) {
            return;
        }
        let me = self.clone();
        let spawned = self
            .workers
            .spawn(move || me.serve(receiver, id, stream, dst, from));
        if spawned.is_err() {
            let refused = PullMsg::PullEnd { stream, ok: false };
            self.rpc
                .send_from_transport_thread(receiver, refused.into());
        }
    }

    /// Serves a small rest of a complete copy at once, on the transport thread the request
    /// came in on, if the transport can take it without blocking: one hand-off less for the
    /// smallest objects that are pulled. False: nothing was written, a worker serves it.
    fn serve_here(
        &self,
        receiver: NodeId,
        id: &ObjectId,
        stream: StreamId,
        dst: &RemoteRegion,
        from: u64,
    ) -> bool {
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
        self.record_serve(id, receiver, size - from, start);
        let done = PullMsg::PullEnd { stream, ok: true };
        self.rpc.send_from_transport_thread(receiver, done.into());
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
        self.record_serve(id, to, size, start);
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
    fn record_serve(&self, id: &ObjectId, receiver: NodeId, bytes: u64, start: Instant) {
        self.serve_log.lock().unwrap().push(ServeRecord {
            id: id.clone(),
            source: self.id,
            receiver,
            bytes,
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

    /// Serves one pull: writes `[from, size)` of the local copy into `dst` as it fills.
    fn serve(
        &self,
        receiver: NodeId,
        id: ObjectId,
        stream: StreamId,
        dst: RemoteRegion,
        from: u64,
    ) {
        hop!(self.id, "serve running", to = receiver, stream = stream);
        let cancel = Arc::new(AtomicBool::new(false));
        self.serving
            .lock()
            .unwrap()
            .insert((receiver, stream), cancel.clone());
        let start = Instant::now();
        let result = self.serve_inner(receiver, &id, stream, &dst, from, &cancel);
        self.serving.lock().unwrap().remove(&(receiver, stream));
        let ok = result.is_ok();
        match &result {
            Ok(bytes) => self.record_serve(&id, receiver, *bytes, start),
            Err(e) => debug!(node = self.id, receiver, %id, "serve ended: {e}"),
        }
        let _ = self.rpc.send(receiver, PullMsg::PullEnd { stream, ok });
    }

    fn serve_inner(
        &self,
        receiver: NodeId,
        id: &ObjectId,
        stream: StreamId,
        dst: &RemoteRegion,
        from: u64,
        cancel: &AtomicBool,
    ) -> Result<u64> {
        // The directory may send a receiver here a moment before our own pull has created
        // the copy; wait for it briefly rather than refuse, and no longer than the receiver
        // wants it (a receiver whose copy was deleted cancels).
        let deadline = Instant::now() + self.cfg.op_timeout.min(COPY_WAIT);
        let copy = loop {
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
        let chunk = serve_chunk(self.cfg.chunk_size, copy.size());
        let mut off = from;
        loop {
            let wm = copy.wait_beyond(off, self.cfg.op_timeout)?;
            let size = copy.size();
            if dst.len != size {
                return Err(Error::Protocol {
                    peer: receiver,
                    what: format!("region of {} for an object of {size}", dst.len),
                });
            }
            let base = copy.offset();
            while off < wm {
                if cancel.load(Ordering::Acquire) || self.rpc.is_closed() {
                    return Err(Error::Shutdown);
                }
                let mut n = (wm - off).min(chunk);
                if let Some(budget) = self.fault.budget(id, off) {
                    if budget == 0 {
                        self.fault.fire();
                        return Err(Error::Shutdown);
                    }
                    n = n.min(budget);
                }
                self.transport
                    .write(receiver, stream, base + off, dst, off, n)?;
                hop!(self.id, "written", to = receiver, offset = off, len = n);
                off += n;
            }
            if off >= size {
                return Ok(off - from);
            }
        }
    }
}

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
