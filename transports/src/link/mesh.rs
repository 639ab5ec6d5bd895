//! How the transports form the full mesh, shared so they agree on it.

use super::{Link, LinkTable};
use crate::{NodeId, TransportError};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tracing::warn;

impl<C: Link> LinkTable<C> {
    /// Links this node to `peers`. Node k dials every peer with a lower id and waits, up to
    /// `timeout`, until the ones with a higher id have dialled it (they show up in the
    /// table). A rejoining node (`dial_all`) dials every peer it can reach within a couple
    /// of seconds and skips dead ones: they dial it when they come back. With links on
    /// demand (see `demand`) a starting node dials nobody. `dial` links one
    /// peer (the transport's dial and handshake), giving up at the deadline it is passed.
    pub fn connect_mesh(
        &self,
        peers: &[(NodeId, SocketAddr)],
        dial_all: bool,
        timeout: Duration,
        dial: impl Fn(NodeId, SocketAddr, Instant) -> Result<(), TransportError>,
    ) -> Result<(), TransportError> {
        let me = self.node;
        let deadline = Instant::now() + timeout;
        if self.is_on_demand() && !dial_all {
            return Ok(()); // linked on first use
        }
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
        let mut links = self.links.lock().unwrap();
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
            links = self.changed.wait_timeout(links, deadline - now).unwrap().0;
        }
    }
}
