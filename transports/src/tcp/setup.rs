//! Link setup: the hello frame a dialler sends, the acceptor's side of it, and installing
//! the connection with its reader thread.

use super::conn::{Conn, Writer};
use super::Inner;
use crate::frame::{FrameHeader, FrameKind, FRAME_HEADER_LEN};
use crate::{Event, LinkState, NodeId, TransportError};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::{info, warn};

impl Inner {
    fn tune(&self, s: &TcpStream) -> std::io::Result<()> {
        s.set_nodelay(true)?;
        if self.cfg.socket_buffer > 0 {
            use nix::sys::socket::{setsockopt, sockopt};
            let n = self.cfg.socket_buffer;
            setsockopt(&s.as_fd(), sockopt::SndBuf, &n).map_err(std::io::Error::from)?;
            setsockopt(&s.as_fd(), sockopt::RcvBuf, &n).map_err(std::io::Error::from)?;
        }
        Ok(())
    }

    /// Links `peer` at `addr`: connects (retrying until `deadline`), says hello, installs.
    pub(super) fn dial(
        self: &Arc<Self>,
        peer: NodeId,
        addr: SocketAddr,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let s = self.links.dial_stream(peer, addr, deadline)?;
        self.tune(&s)?;
        let hello = FrameHeader {
            kind: FrameKind::Hello,
            len: 0,
            stream: self.id as u64,
            dst: 0,
            rel: 0,
        };
        (&s).write_all(&hello.encode())?;
        self.install(peer, s)
    }

    /// The acceptor's side: reads the dialler's hello and installs the link. Errors before
    /// the hello is understood go to the accept loop; later ones are logged here.
    pub(super) fn handshake(self: &Arc<Self>, s: TcpStream) -> Result<(), TransportError> {
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut b = [0u8; FRAME_HEADER_LEN];
        (&s).read_exact(&mut b)?;
        let h = FrameHeader::decode(&b)?;
        if h.kind != FrameKind::Hello || h.stream > NodeId::MAX as u64 {
            return Err(TransportError::Malformed(format!(
                "expected hello, got {:?}",
                h.kind
            )));
        }
        let peer = h.stream as NodeId;
        if let Err(e) = self
            .tune(&s)
            .map_err(TransportError::from)
            .and_then(|_| self.install(peer, s))
        {
            warn!(node = self.id, peer, "cannot install connection: {e}");
        }
        Ok(())
    }

    /// Makes `s` the link to `peer` (a restarted peer's new link replaces its old one, which
    /// is reported down) and starts its reader thread.
    fn install(self: &Arc<Self>, peer: NodeId, s: TcpStream) -> Result<(), TransportError> {
        s.set_read_timeout(Some(self.cfg.heartbeat_timeout))?;
        s.set_write_timeout(Some(self.cfg.heartbeat_timeout * 2))?;
        let conn = Arc::new(Conn {
            link: LinkState::new(peer),
            writer: Mutex::new(Writer {
                stream: s.try_clone()?,
                tail: Vec::new(),
            }),
            socket: s,
            last_send: AtomicU64::new(self.links.now_ns()),
        });
        let reader = conn.socket.try_clone()?;
        if self.links.install(conn.clone()).is_some() {
            // A restarted peer replaces its old link: the old incarnation is dead even if we
            // had not noticed yet. Its reader exits silently; we report the death here.
            self.links.report_down(peer, "peer restarted".into());
        }
        info!(node = self.id, peer, "link up");
        self.links.emit(Event::PeerUp { peer });
        let me = self.clone();
        let h = std::thread::Builder::new()
            .name(format!("phx-rx-{}-{peer}", self.id))
            .spawn(move || me.read_loop(conn, reader))?;
        let mut threads = self.threads.lock().unwrap();
        threads.retain(|t| !t.is_finished());
        threads.push(h);
        Ok(())
    }
}
