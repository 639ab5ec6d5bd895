//! How the transports form the full mesh, shared so they agree on it.

use crate::{NodeId, TransportError};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};
use tracing::warn;

/// Links node `me` to `peers`. Node k dials every peer with a lower id and waits, up to
/// `timeout`, until the ones with a higher id have dialled it (they show up in `links`,
/// whose changes `changed` signals). A rejoining node (`dial_all`) dials every peer it can
/// reach within a couple of seconds and skips dead ones: they dial it when they come back.
pub fn connect_mesh<L>(
    me: NodeId,
    peers: &[(NodeId, SocketAddr)],
    dial_all: bool,
    timeout: Duration,
    dial: impl Fn(NodeId, SocketAddr, Instant) -> Result<(), TransportError>,
    links: &Mutex<HashMap<NodeId, L>>,
    changed: &Condvar,
) -> Result<(), TransportError> {
    let deadline = Instant::now() + timeout;
    if dial_all {
        let short = Instant::now() + Duration::from_secs(2).min(timeout);
        for &(peer, addr) in peers.iter().filter(|p| p.0 != me) {
            if let Err(e) = dial(peer, addr, short) {
                warn!(node = me, peer, "not rejoined: {e}");
            }
        }
        return Ok(());
    }
    for &(peer, addr) in peers.iter().filter(|p| p.0 < me) {
        dial(peer, addr, deadline)?;
    }
    let mut links = links.lock().unwrap();
    loop {
        let missing: Vec<NodeId> = peers
            .iter()
            .map(|p| p.0)
            .filter(|p| *p != me && !links.contains_key(p))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(TransportError::Setup(format!(
                "node {me}: peers {missing:?} did not connect within {timeout:?}"
            )));
        }
        links = changed.wait_timeout(links, deadline - now).unwrap().0;
    }
}
