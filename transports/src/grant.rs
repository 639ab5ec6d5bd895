//! Grants: which peer may write which range of the local arena. A receiver grants a range to
//! the one peer it asked to write there (a pull's source) and revokes the grant when the
//! stream ends; a transport checks every incoming write against the grants *before* a byte
//! lands, so a forged or stray write changes nothing and is reported as an error (the link
//! that carried it is dropped).
//!
//! A grant holds a keep-alive handed in by its owner (for a pull, the copy being filled): a
//! write that passed the check holds it until its bytes have landed, so the range is never
//! freed or reused under a write in progress, even when the grant is revoked meanwhile.

use crate::{NodeId, TransportError};
use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// What a grant keeps alive while it exists and while a write into it is in progress.
pub type KeepAlive = Arc<dyn Any + Send + Sync>;

struct Grant {
    id: u32,
    offset: u64,
    len: u64,
    keep: KeepAlive,
}

/// The grants of one node's arena, per peer.
pub struct GrantTable {
    by_peer: Mutex<HashMap<NodeId, Vec<Grant>>>,
    next: AtomicU32,
}

/// Proof that a write passed its check; holds the grant's keep-alive until dropped.
pub struct Admitted {
    _keep: KeepAlive,
}

impl Default for GrantTable {
    fn default() -> Self {
        Self::new()
    }
}

impl GrantTable {
    pub fn new() -> GrantTable {
        GrantTable {
            by_peer: Mutex::new(HashMap::new()),
            // Grant ids are not secrets (the check is by peer and range); any start will do.
            next: AtomicU32::new(1),
        }
    }

    /// Lets `peer` write `[offset, offset + len)` (the caller checked it lies in the arena);
    /// returns the grant's id, for [`GrantTable::revoke`].
    pub fn grant(&self, peer: NodeId, offset: u64, len: u64, keep: KeepAlive) -> u32 {
        let id = self.next.fetch_add(1, Ordering::Relaxed).max(1);
        let g = Grant {
            id,
            offset,
            len,
            keep,
        };
        self.by_peer
            .lock()
            .unwrap()
            .entry(peer)
            .or_default()
            .push(g);
        id
    }

    /// Withdraws grant `id` of `peer`; later writes into its range are refused. Returns
    /// whether it existed.
    pub fn revoke(&self, peer: NodeId, id: u32) -> bool {
        let mut map = self.by_peer.lock().unwrap();
        let Some(v) = map.get_mut(&peer) else {
            return false;
        };
        let before = v.len();
        v.retain(|g| g.id != id);
        let found = v.len() != before;
        if v.is_empty() {
            map.remove(&peer);
        }
        found
    }

    /// Withdraws every grant of `peer` (its link is gone).
    pub fn revoke_all(&self, peer: NodeId) {
        self.by_peer.lock().unwrap().remove(&peer);
    }

    /// Checks a write of `len` bytes by `peer` at arena offset `dst`, `rel` bytes into the
    /// region it was granted: it must lie inside one grant of that peer, at the place `rel`
    /// names. On success the returned value keeps the range alive until dropped.
    pub fn admit(
        &self,
        peer: NodeId,
        dst: u64,
        rel: u64,
        len: u64,
    ) -> Result<Admitted, TransportError> {
        let refuse = |why: &str| {
            Err(TransportError::Forbidden(format!(
                "write of {len} bytes at {dst} (offset {rel} of its region) from node {peer}: {why}"
            )))
        };
        let (Some(end), Some(base)) = (dst.checked_add(len), dst.checked_sub(rel)) else {
            return refuse("offsets overflow");
        };
        let map = self.by_peer.lock().unwrap();
        let Some(grants) = map.get(&peer) else {
            return refuse("no grant to that peer");
        };
        // `base` is where the writer says its region starts: it must be the grant's.
        let hit = grants
            .iter()
            .find(|g| g.offset == base && g.offset.checked_add(g.len).is_some_and(|e| end <= e));
        match hit {
            Some(g) => Ok(Admitted {
                _keep: g.keep.clone(),
            }),
            None => refuse("outside every range granted to that peer"),
        }
    }

    /// Whether `peer` holds a grant.
    pub fn has(&self, peer: NodeId) -> bool {
        self.by_peer.lock().unwrap().contains_key(&peer)
    }

    /// Number of live grants (for tests and stats).
    pub fn len(&self) -> usize {
        self.by_peer.lock().unwrap().values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keep() -> KeepAlive {
        Arc::new(())
    }

    #[test]
    fn a_write_lands_only_inside_a_range_granted_to_its_peer() {
        let t = GrantTable::new();
        let id = t.grant(1, 4096, 1000, keep());
        assert!(t.admit(1, 4096, 0, 1000).is_ok());
        assert!(t.admit(1, 4096 + 10, 10, 990).is_ok());
        // Another peer, past the end, before the start, a wrong relative offset.
        for (peer, dst, rel, len) in [
            (2, 4096, 0, 1),
            (1, 4096 + 10, 10, 991),
            (1, 4095, 0, 1),
            (1, 4096 + 10, 0, 1),
            (1, 4096, 0, u64::MAX),
            (1, 0, 5, 1),
        ] {
            assert!(
                matches!(
                    t.admit(peer, dst, rel, len),
                    Err(TransportError::Forbidden(_))
                ),
                "{peer} {dst} {rel} {len}"
            );
        }
        assert!(t.revoke(1, id));
        assert!(!t.revoke(1, id));
        assert!(t.admit(1, 4096, 0, 1).is_err());
        assert!(t.is_empty());
    }

    #[test]
    fn an_admitted_write_keeps_its_range_alive_after_revoke() {
        let t = GrantTable::new();
        let k: Arc<()> = Arc::new(());
        let id = t.grant(3, 0, 64, k.clone());
        let w = t.admit(3, 0, 0, 64).unwrap();
        assert!(t.revoke(3, id));
        assert_eq!(Arc::strong_count(&k), 2, "the write still holds it");
        drop(w);
        assert_eq!(Arc::strong_count(&k), 1);
    }

    #[test]
    fn revoke_all_forgets_a_peer() {
        let t = GrantTable::new();
        t.grant(1, 0, 10, keep());
        t.grant(1, 100, 10, keep());
        t.grant(2, 0, 10, keep());
        t.revoke_all(1);
        assert_eq!(t.len(), 1);
        assert!(t.admit(1, 100, 0, 10).is_err());
        assert!(t.admit(2, 0, 0, 10).is_ok());
    }
}
