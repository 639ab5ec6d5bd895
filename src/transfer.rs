//! The pull engine: a receiver asks the directory for one source and pulls from it; a
//! source streams whatever it has (its copy may itself be partial) chunk by chunk. A failed
//! or refused source is replaced and the pull resumes at the receiver's watermark.

use crate::node::{Inbound, InboundEnd, Inner, ServeRecord, TransferRecord};
use crate::protocol::{Located, Msg, Reply};
use crate::store::CopyRef;
use crate::view::Fetched;
use crate::{Error, ObjectId, Result};
use phalanx_transport::{NodeId, RemoteRegion, StreamId};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, warn};

impl Inner {
    /// Finds the object: the local copy (maybe partial), inline bytes from the directory, or a
    /// new local copy being pulled by a background driver.
    pub(crate) fn fetch(self: &Arc<Self>, id: &ObjectId) -> Result<Fetched> {
        self.fetch_excluding(id, &[])
    }

    /// [`Inner::fetch`] that never pulls from the nodes in `exclude` (for baselines).
    pub(crate) fn fetch_excluding(
        self: &Arc<Self>,
        id: &ObjectId,
        exclude: &[NodeId],
    ) -> Result<Fetched> {
        let deadline = Instant::now() + self.cfg.op_timeout;
        let (node, size, token) = loop {
            if let Some(c) = self.store.lookup(id) {
                return Ok(Fetched::Copy(c));
            }
            match self.locate(id, false, exclude)? {
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
                    self.withdraw(std::slice::from_ref(id));
                }
                Located::Inline(data) => return Ok(Fetched::Owned(data)),
                Located::NotFound => return Err(Error::NotFound(id.clone())),
                Located::Source { node, size, token } => break (node, size, token),
            }
        };
        let (copy, evicted) = match self.store.create(id, size, false) {
            Ok(c) => c,
            Err(Error::AlreadyExists(_)) => {
                debug!(node = self.id, %id, "a local copy appeared first; waiting for it");
                // A concurrent local get or a local producer got there first.
                self.transfer_done(self.shard_of(id), id, node, token, false);
                return self
                    .store
                    .wait_lookup(id, self.cfg.op_timeout)
                    .map(Fetched::Copy);
            }
            Err(e) => {
                self.transfer_done(self.shard_of(id), id, node, token, false);
                self.withdraw(std::slice::from_ref(id));
                return Err(e);
            }
        };
        self.withdraw(&evicted);
        let me = self.clone();
        let exclude_owned = exclude.to_vec();
        let driver_copy = copy.clone();
        let id2 = id.clone();
        std::thread::Builder::new()
            .name(format!("phx-pull-{}", self.id))
            .spawn(move || me.drive(id2, driver_copy, (node, token), exclude_owned))
            .map_err(|e| Error::Config(format!("spawn: {e}")))?;
        Ok(Fetched::Copy(copy))
    }

    fn locate(&self, id: &ObjectId, resume: bool, exclude: &[NodeId]) -> Result<Located> {
        let deadline = Instant::now() + self.cfg.op_timeout;
        loop {
            // Recomputed each time: a dead shard's entries move to another node.
            let shard = self.shard_of(id);
            let r = self.call(shard, |rid| Msg::Locate {
                rid,
                id: id.clone(),
                wait: true,
                resume,
                exclude: exclude.to_vec(),
            });
            match r {
                Ok(Reply::Located(l)) => return Ok(l),
                Ok(r) => return Err(self.unexpected(r)),
                // The shard died under us: its entries reappear at the next owner once the
                // holders republish them.
                Err(Error::PeerDown(_)) if Instant::now() < deadline && !self.is_closed() => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Pulls the copy to completion, replacing failed sources; runs on its own thread.
    fn drive(
        self: Arc<Self>,
        id: ObjectId,
        copy: CopyRef,
        first: (NodeId, u64),
        mut exclude: Vec<NodeId>,
    ) {
        let (mut source, mut token) = first;
        loop {
            let from = copy.watermark();
            let start = Instant::now();
            let outcome = self.pull_once(&id, &copy, source, from);
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
            let shard = self.shard_of(&id);
            self.transfer_done(shard, &id, source, token, ok);
            let reason = match outcome {
                Ok(()) => return,
                Err(e) => e,
            };
            if copy.is_detached() || self.is_closed() {
                debug!(node = self.id, %id, "pull stopped: copy deleted or node closing");
                self.abandon_pull(shard, &id, &copy);
                return;
            }
            warn!(node = self.id, %id, source, at = copy.watermark(), "pull failed ({reason}); finding another source");
            if self.transport.is_connected(source) {
                // It refused (no copy any more); a dead source leaves the directory by itself.
                exclude.push(source);
            }
            match self.locate(&id, true, &exclude) {
                Ok(Located::Source { node, token: t, .. }) if copy.is_detached() => {
                    // Deleted or reset while we waited: the new source may hold other bytes.
                    self.transfer_done(shard, &id, node, t, false);
                    self.abandon_pull(shard, &id, &copy);
                    return;
                }
                Ok(Located::Source { node, token: t, .. }) => {
                    source = node;
                    token = t;
                }
                Ok(Located::Inline(_) | Located::NotFound | Located::Local) | Err(_) => {
                    self.abandon_pull(shard, &id, &copy);
                    return;
                }
            }
        }
    }

    /// Releases the source of an assignment (and, if `ok`, marks our copy complete).
    fn transfer_done(&self, shard: NodeId, id: &ObjectId, source: NodeId, token: u64, ok: bool) {
        let _ = self.send(
            shard,
            Msg::TransferDone {
                id: id.clone(),
                source,
                receiver: self.id,
                token,
                ok,
            },
        );
    }

    /// Gives up a pull: our location leaves the directory and readers of the copy get an error.
    fn abandon_pull(&self, shard: NodeId, id: &ObjectId, copy: &CopyRef) {
        let _ = self.send(
            shard,
            Msg::Withdraw {
                id: id.clone(),
                node: self.id,
            },
        );
        copy.fail();
    }

    /// One pull from `source` starting at `from`; Ok once the copy is complete.
    fn pull_once(
        &self,
        id: &ObjectId,
        copy: &CopyRef,
        source: NodeId,
        from: u64,
    ) -> Result<(), String> {
        let size = copy.size();
        if from >= size {
            return Ok(());
        }
        let dst: RemoteRegion = self
            .transport
            .remote_region(copy.offset(), size)
            .map_err(|e| e.to_string())?;
        let stream = self.next_stream();
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.inbound.lock().unwrap().insert(
            stream,
            Inbound {
                copy: copy.clone(),
                source,
                done: tx,
            },
        );
        if let Err(e) = self.send(
            source,
            Msg::Pull {
                id: id.clone(),
                stream,
                dst,
                from,
            },
        ) {
            self.inbound.lock().unwrap().remove(&stream);
            return Err(e.to_string());
        }
        // Progress is watched through the watermark; a stall as long as the op timeout
        // cancels the pull.
        let mut last = from;
        loop {
            match rx.recv_timeout(self.cfg.op_timeout) {
                Ok(InboundEnd::Complete) => return Ok(()),
                Ok(InboundEnd::Failed(why)) => return Err(why),
                Err(_) => {
                    let wm = copy.watermark();
                    if wm > last {
                        last = wm;
                        continue;
                    }
                    // Keep the inbound entry (and its memory) until the source confirms it
                    // stopped writing, or dies.
                    let _ = self.send(source, Msg::CancelPull { stream });
                    return match rx.recv_timeout(self.cfg.op_timeout) {
                        Ok(InboundEnd::Complete) => Ok(()),
                        _ => Err(format!(
                            "no progress from {source} for {:?}",
                            self.cfg.op_timeout
                        )),
                    };
                }
            }
        }
    }

    /// Serves one pull: writes `[from, size)` of the local copy into `dst` as it fills.
    pub(crate) fn serve(
        self: Arc<Self>,
        receiver: NodeId,
        id: ObjectId,
        stream: StreamId,
        dst: RemoteRegion,
        from: u64,
    ) {
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
            Ok(bytes) => self.serve_log.lock().unwrap().push(ServeRecord {
                id: id.clone(),
                source: self.id,
                receiver,
                bytes: *bytes,
                start,
                end: Instant::now(),
            }),
            Err(e) => debug!(node = self.id, receiver, %id, "serve ended: {e}"),
        }
        let _ = self.send(receiver, Msg::PullEnd { stream, ok });
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
        // the copy; wait for it briefly rather than refuse.
        let copy = self
            .store
            .wait_lookup(id, self.cfg.op_timeout.min(Duration::from_secs(5)))?;
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
                if cancel.load(Ordering::Acquire) || self.is_closed() {
                    return Err(Error::Shutdown);
                }
                let mut n = (wm - off).min(chunk);
                if let Some(budget) = self.fault_budget(id, off) {
                    if budget == 0 {
                        self.fire_fault();
                        return Err(Error::Shutdown);
                    }
                    n = n.min(budget);
                }
                self.transport
                    .write(receiver, stream, base + off, dst, off, n)?;
                off += n;
            }
            if off >= size {
                return Ok(off - from);
            }
        }
    }
}

/// Bytes a source writes at once for an object of `size`: about a sixteenth of the object, so
/// that even a mid-sized object crosses a chain of forwarding nodes in many pieces, at least
/// 64 KiB (per-frame costs) and at most the configured `chunk_size`.
pub(crate) fn serve_chunk(chunk_size: u64, size: u64) -> u64 {
    (size / 16).clamp(64 << 10, chunk_size.max(64 << 10))
}

#[cfg(test)]
mod tests {
    use super::serve_chunk;

    #[test]
    fn chunks_follow_the_object_size_within_bounds() {
        assert_eq!(serve_chunk(4 << 20, 1 << 20), 64 << 10);
        assert_eq!(serve_chunk(4 << 20, 16 << 20), 1 << 20);
        assert_eq!(serve_chunk(4 << 20, 1 << 30), 4 << 20);
        assert_eq!(serve_chunk(4 << 20, 100), 64 << 10);
        assert_eq!(serve_chunk(4096, 1 << 30), 64 << 10, "never below 64 KiB");
    }
}
