//! Link setup: dialling (the authenticated stream comes from the link table, see
//! [`crate::auth`]), the acceptor's side once the table has admitted the peer, and installing
//! the connection (read by one of the transport's reader threads).

use super::conn::{Conn, Writer};
use super::Inner;
use crate::{Event, LinkState, NodeId, TransportError};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tracing::{info, warn};

impl Inner {
    fn tune(&self, s: &TcpStream) -> std::io::Result<()> {
        s.set_nodelay(true)?;
        if let Some(cc) = &self.cfg.congestion {
            if let Err(e) = set_congestion(s, cc) {
                // Not fatal: the link works with the system's congestion control. Said once
                // per process, not once per link.
                static SAID: AtomicBool = AtomicBool::new(false);
                if !SAID.swap(true, Ordering::Relaxed) {
                    warn!(
                        node = self.id,
                        "congestion control {cc:?} not set ({e}): the system's is used"
                    );
                }
            }
        }
        if self.cfg.notsent_lowat > 0 {
            if let Err(e) = set_notsent_lowat(s, self.cfg.notsent_lowat) {
                // Not fatal (a kernel without it): the link works with the system's bound.
                static SAID: AtomicBool = AtomicBool::new(false);
                if !SAID.swap(true, Ordering::Relaxed) {
                    warn!(
                        node = self.id,
                        "TCP_NOTSENT_LOWAT not set ({e}): the system's is used"
                    );
                }
            }
        }
        if self.cfg.socket_buffer > 0 {
            use nix::sys::socket::{setsockopt, sockopt};
            let n = self.cfg.socket_buffer;
            setsockopt(&s.as_fd(), sockopt::SndBuf, &n).map_err(std::io::Error::from)?;
            setsockopt(&s.as_fd(), sockopt::RcvBuf, &n).map_err(std::io::Error::from)?;
        }
        Ok(())
    }

    /// Links `peer` at `addr`: connects and authenticates (retrying until `deadline`),
    /// installs.
    pub(super) fn dial(
        self: &Arc<Self>,
        peer: NodeId,
        addr: SocketAddr,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let s = self.links.dial_stream(peer, addr, deadline)?;
        self.tune(&s)?;
        self.install(peer, s)
    }

    /// The acceptor's side, for a stream the link table has admitted from `peer`
    /// (authenticated, a member, no live link): installs the link.
    pub(super) fn handshake(
        self: &Arc<Self>,
        s: TcpStream,
        peer: NodeId,
    ) -> Result<(), TransportError> {
        self.tune(&s)?;
        self.install(peer, s)
    }

    /// Makes `s` the link to `peer` (on the dialling side, a new link replaces an old one,
    /// which is reported down) and hands it to a reader thread.
    fn install(self: &Arc<Self>, peer: NodeId, s: TcpStream) -> Result<(), TransportError> {
        s.set_write_timeout(Some(self.cfg.heartbeat_timeout * 2))?;
        // One descriptor per connection: the writer and the reader share it.
        let s = Arc::new(s);
        let conn = Arc::new(Conn {
            link: LinkState::new(peer),
            writer: Mutex::new(Writer {
                stream: s.clone(),
                tail: Vec::new(),
                written: 0,
            }),
            socket: s.clone(),
            last_send: AtomicU64::new(self.links.now_ns()),
            last_used: AtomicU64::new(self.links.now_ns()),
            peer_watches: AtomicU64::new(0),
            watching_since: AtomicU64::new(0),
            close_when_flushed: Default::default(),
            overflow: Mutex::new(Vec::new()),
            tail_len: Default::default(),
            writing_data: Default::default(),
        });
        let reader = s;
        if self.links.install(conn.clone()).is_some() {
            // A restarted peer replaces its old link: the old incarnation is dead even if we
            // had not noticed yet. Its reader exits silently; we report the death here.
            self.links.report_down(peer, "peer restarted".into());
        }
        info!(node = self.id, peer, "link up");
        self.links.emit(Event::PeerUp { peer });
        self.readers
            .get()
            .expect("readers start with the transport")
            .add(self, conn, reader)
    }
}

/// Sets `s`'s congestion control (`TCP_CONGESTION`) to `name`.
fn set_congestion(s: &TcpStream, name: &str) -> nix::Result<()> {
    use nix::sys::socket::{setsockopt, sockopt};
    setsockopt(
        &s.as_fd(),
        sockopt::TcpCongestion,
        &std::ffi::OsString::from(name),
    )
}

/// Sets `TCP_NOTSENT_LOWAT` (see `TcpConfig::notsent_lowat`); nix has no wrapper for it.
fn set_notsent_lowat(s: &TcpStream, bytes: usize) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let v = nix::libc::c_int::try_from(bytes).unwrap_or(nix::libc::c_int::MAX);
    // SAFETY: the fd is `s`'s open socket, borrowed for the call; the option value is a
    // c_int on this stack, passed with its exact size, which the kernel only reads.
    let r = unsafe {
        nix::libc::setsockopt(
            s.as_raw_fd(),
            nix::libc::IPPROTO_TCP,
            nix::libc::TCP_NOTSENT_LOWAT,
            std::ptr::from_ref(&v).cast(),
            std::mem::size_of_val(&v) as nix::libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Reads `TCP_NOTSENT_LOWAT` back (tests).
#[cfg(test)]
fn notsent_lowat(s: &TcpStream) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    let mut v: nix::libc::c_int = 0;
    let mut len = std::mem::size_of_val(&v) as nix::libc::socklen_t;
    // SAFETY: the fd is `s`'s open socket, borrowed for the call; the kernel writes at most
    // `len` bytes (the size of `v`, on this stack) and the new length into `len`.
    let r = unsafe {
        nix::libc::getsockopt(
            s.as_raw_fd(),
            nix::libc::IPPROTO_TCP,
            nix::libc::TCP_NOTSENT_LOWAT,
            std::ptr::from_mut(&mut v).cast(),
            &mut len,
        )
    };
    if r == 0 {
        Ok(usize::try_from(v).unwrap_or(0))
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::set_congestion;
    use nix::sys::socket::{getsockopt, sockopt};
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsFd;

    /// "reno" is built into every Linux kernel and always allowed: the socket then uses it;
    /// a name the kernel does not know is an error (the link keeps the system's).
    #[test]
    fn a_link_takes_the_congestion_control_it_is_given() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        set_congestion(&s, "reno").unwrap();
        let now = getsockopt(&s.as_fd(), sockopt::TcpCongestion).unwrap();
        assert_eq!(now.to_str().unwrap().trim_end_matches('\0'), "reno");
        assert!(set_congestion(&s, "no-such-cc").is_err());
        let still = getsockopt(&s.as_fd(), sockopt::TcpCongestion).unwrap();
        assert_eq!(still, now);
    }

    /// The links' bound on bytes written and not yet sent is what the config says.
    #[test]
    fn a_link_takes_its_notsent_lowat() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        super::set_notsent_lowat(&s, 128 << 10).unwrap();
        assert_eq!(super::notsent_lowat(&s).unwrap(), 128 << 10);
        super::set_notsent_lowat(&s, 1 << 20).unwrap();
        assert_eq!(super::notsent_lowat(&s).unwrap(), 1 << 20);
    }
}
