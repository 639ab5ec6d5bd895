//! Grants on verbs. The arena is registered for local access only: no peer can reach it
//! through its key. A grant large enough for the rendezvous path registers exactly the
//! granted range ([`MemoryRegion::register_range`]) and binds a type 2 memory window over
//! that registration on the QP of the connection to the grantee. The NIC then refuses an
//! RDMA write outside the range (the registration's bounds), through any other QP (the
//! window is bound to one), after the grant is revoked (window and registration are gone),
//! and any RDMA read (neither allows it). Both are needed: Soft-RoCE checks a write against
//! the bounds of the window's registration, not of the window; a registration alone is not
//! tied to a QP. On a device without memory windows the registration alone, with remote
//! write, is the grant (bounds and revocation, not the QP). Smaller grants hand out no key:
//! their writes take the eager path, checked in software before a byte is copied in.

use super::conn::Conn;
use super::Inner;
use crate::verbs::{Access, MemoryRegion, MemoryWindow};
use phalanx_transport::{KeepAlive, NodeId, TransportError};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tracing::warn;

/// What a grant bound, and what it exposes. Field order matters: the window goes first (the
/// NIC stops accepting writes through it), then the connection whose QP it was bound on (a
/// QP is destroyed only once no window is bound on it: Soft-RoCE stalls destroying one that
/// still has), then the registration, then the range's keep-alive.
pub(super) struct GrantWindow {
    _mw: Option<MemoryWindow>,
    _conn: Option<Arc<Conn>>,
    _mr: Arc<MemoryRegion>,
    pub(super) peer: NodeId,
    _keep: KeepAlive,
    /// The key the grantee writes with (the window's, or the registration's without one).
    pub(super) rkey: u32,
}

impl GrantWindow {
    /// The address of the granted range's first byte.
    pub(super) fn addr(&self) -> u64 {
        self._mr.addr()
    }
}

impl Inner {
    /// Registers `[offset, offset + len)` of the arena and binds a window over it for
    /// `peer`'s connection, waiting until the bind has completed (so the key works before
    /// anyone learns it). `Ok(None)`: no key (the grant goes eager), when this runs on the
    /// progress thread or the registration fails.
    pub(super) fn bind_window(
        &self,
        peer: NodeId,
        arena: &Arc<MemoryRegion>,
        offset: u64,
        len: u64,
        keep: &KeepAlive,
    ) -> Result<Option<GrantWindow>, TransportError> {
        // The progress thread completes binds: if it asked for one itself it would wait for
        // ever (nothing of Phalanx grants there today; eager is the safe answer if it did).
        if super::progress::on_progress_thread() {
            return Ok(None);
        }
        let conn = self.links.link(peer)?;
        let windows = self.windows_ok.load(Ordering::Relaxed);
        let access = if windows {
            Access::WindowsOnly
        } else {
            Access::RemoteWrite
        };
        let mem = arena.arena().clone();
        let mr = match MemoryRegion::register_range(&self.pd, mem, offset, len as usize, access) {
            Ok(mr) => Arc::new(mr),
            Err(e) => {
                warn!(
                    node = self.id,
                    peer, offset, len, "cannot register a granted range ({e}): eager writes"
                );
                return Ok(None);
            }
        };
        self.links
            .counters
            .grant_registrations
            .fetch_add(1, Ordering::Relaxed);
        if !windows {
            return Ok(Some(GrantWindow {
                _mw: None,
                _conn: None,
                rkey: mr.rkey(),
                _mr: mr,
                peer,
                _keep: keep.clone(),
            }));
        }
        let mut mw = MemoryWindow::alloc(&self.pd)?;
        let rkey = mw.next_rkey();
        let mut tx = self.lock_tx(&conn)?;
        let op = self.post_app(&conn, &mut tx, |wr_id| {
            conn.qp.post_bind(wr_id, &mut mw, rkey, &mr, 0, len)
        })?;
        drop(tx);
        self.wait_for(&conn, None, || conn.ops_done.load(Ordering::Acquire) > op)?;
        Ok(Some(GrantWindow {
            _mw: Some(mw),
            _conn: Some(conn),
            _mr: mr,
            peer,
            _keep: keep.clone(),
            rkey,
        }))
    }
}
