//! Work done where a copy's bytes land. Whichever thread moves a copy's watermark (the
//! transport thread that took bytes in, a reduce task that computed them, a put copying them
//! in) tells `Transfers::landed`, which calls the watchers of the object: the serves that
//! forward the copy to their receivers (`serve.rs`), a reduce task combining a medium output
//! as its inputs land (`reduce/task.rs`). Nothing waits for a thread to wake up to move them
//! on; on hosts whose cores are shared by many processes that wake-up is the largest part of
//! a hop (0.1-0.2 ms on average on the 8 emulated hosts of this machine).

use super::Transfers;
use crate::store::CopyRef;
use crate::ObjectId;
use std::sync::Arc;

/// Something to do when bytes land in a copy of an object (or the copy ends).
pub(crate) trait OnLanded: Send + Sync {
    /// Bytes landed in `copy` (or it ended). Runs on the thread that moved the watermark,
    /// which must not block: take no lock that a blocking thread may hold for long, and
    /// leave work that cannot be done at once to its owner.
    fn landed(&self, copy: &CopyRef);
}

impl Transfers {
    /// Bytes landed in `copy` (or it ended): on to the watchers of its object. Never blocks.
    pub(crate) fn landed(&self, copy: &CopyRef) {
        let list: Vec<Arc<dyn OnLanded>> = {
            let w = self.watchers.lock().unwrap();
            if w.is_empty() {
                return;
            }
            match w.get(&copy.id()) {
                Some(v) => v.clone(),
                None => return,
            }
        };
        for w in list {
            w.landed(copy);
        }
    }

    /// Calls `w` whenever bytes land in a copy of `id`, until [`Transfers::unwatch`].
    pub(crate) fn watch(&self, id: &ObjectId, w: Arc<dyn OnLanded>) {
        self.watchers
            .lock()
            .unwrap()
            .entry(id.clone())
            .or_default()
            .push(w);
    }

    /// Stops calling `w` for `id`.
    pub(crate) fn unwatch(&self, id: &ObjectId, w: &Arc<dyn OnLanded>) {
        let mut all = self.watchers.lock().unwrap();
        if let Some(v) = all.get_mut(id) {
            v.retain(|x| !Arc::ptr_eq(x, w));
            if v.is_empty() {
                all.remove(id);
            }
        }
    }
}
