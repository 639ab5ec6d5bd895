//! The out-of-band TCP side of link setup: dialling with backoff and the accept loop.

use super::{Link, LinkTable};
use crate::{NodeId, TransportError};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, error, warn};

impl<C: Link> LinkTable<C> {
    /// Opens a TCP stream to `peer` at `addr` for the transport's handshake, retrying
    /// refused or timed-out attempts (1 s each) with a backoff from 5 ms doubling up to
    /// 200 ms until `deadline`. Errors: [`TransportError::Shutdown`] once the table is
    /// closed, [`TransportError::Setup`] when the deadline passes.
    pub fn dial_stream(
        &self,
        peer: NodeId,
        addr: SocketAddr,
        deadline: Instant,
    ) -> Result<TcpStream, TransportError> {
        let mut backoff = Duration::from_millis(5);
        loop {
            if self.is_closing() {
                return Err(TransportError::Shutdown);
            }
            match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                Ok(s) => return Ok(s),
                Err(e) if Instant::now() < deadline => {
                    debug!(node = self.node, peer, %addr, "dial failed, retrying: {e}");
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(200));
                }
                Err(e) => {
                    return Err(TransportError::Setup(format!(
                        "node {}: cannot reach peer {peer} at {addr}: {e}",
                        self.node
                    )))
                }
            }
        }
    }

    /// Accepts peers on `listener` until the table is closed (then one more connection,
    /// see [`LinkTable::wake_accept_loop`], ends the loop). Each accepted stream goes to
    /// `handshake` on its own thread, named `{hello_thread}-{node}`, so a silent client
    /// cannot stall accepts. A handshake error counts as a malformed frame if the peer
    /// sent garbage, and is logged as `{failed}: {error}` unless the table is closed.
    pub fn accept_loop<F>(
        self: &Arc<Self>,
        listener: TcpListener,
        hello_thread: &str,
        failed: &'static str,
        handshake: F,
    ) where
        F: Fn(TcpStream) -> Result<(), TransportError> + Send + Sync + 'static,
    {
        let handshake = Arc::new(handshake);
        for s in listener.incoming() {
            if self.is_closing() {
                break;
            }
            let s = match s {
                Ok(s) => s,
                Err(e) => {
                    warn!(node = self.node, "accept failed: {e}");
                    continue;
                }
            };
            let (me, handshake) = (self.clone(), handshake.clone());
            let _ = std::thread::Builder::new()
                .name(format!("{hello_thread}-{}", self.node))
                .spawn(move || {
                    let from = s.peer_addr().ok();
                    // Held until the failure is counted, so the peer sees the connection close
                    // only after that.
                    let hold = s.try_clone();
                    if let Err(e) = handshake(s) {
                        me.setup_failed(from, failed, e);
                    }
                    drop(hold);
                });
        }
    }

    fn setup_failed(&self, from: Option<SocketAddr>, failed: &str, e: TransportError) {
        if matches!(
            e,
            TransportError::Malformed(_) | TransportError::MessageTooLarge { .. }
        ) {
            self.counters
                .malformed_frames
                .fetch_add(1, Ordering::Relaxed);
        }
        if !self.is_closing() {
            error!(node = self.node, ?from, "{failed}: {e}");
        }
    }

    /// Wakes the accept loop with a connection to ourselves so it sees the table closed.
    pub fn wake_accept_loop(&self) {
        let _ = TcpStream::connect_timeout(&self.listen_addr, Duration::from_millis(200));
    }
}
