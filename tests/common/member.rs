//! A cluster member run by hand, for tests of what a member that knows the secret can do
//! (or fail to do): a raw socket that runs the real handshake (`auth::dial`), then sends
//! control messages of its choosing and reads what it is sent as slowly as the test wants.
//! Also: a cluster config on 127.0.0.1 in which some nodes are never started.

use phalanx::protocol::Msg;
use phalanx::transport::auth::{self, Channel};
use phalanx::transport::{AuthConfig, ClusterSecret, FrameHeader, FrameKind};
use phalanx::ClusterConfig;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub const SECRET: &str = "a secret of the hostile member tests";

/// A TCP cluster of `n` nodes on free 127.0.0.1 ports, with `extra` TOML lines.
pub fn config(n: usize, extra: &str) -> ClusterConfig {
    let ports: Vec<u16> = {
        let ls: Vec<TcpListener> = (0..n)
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        ls.iter().map(|l| l.local_addr().unwrap().port()).collect()
    };
    let mut t = format!("transport = \"tcp\"\nsecret = \"{SECRET}\"\n{extra}\n");
    for (k, p) in ports.iter().enumerate() {
        t += &format!("[[nodes]]\nid = {k}\naddr = \"127.0.0.1:{p}\"\n");
    }
    ClusterConfig::parse(&t).unwrap()
}

/// Starts nodes 0 and 1 of `cfg` (as rejoining nodes: they do not wait for the others) and
/// waits until they are linked.
pub fn start_pair(cfg: &ClusterConfig) -> (phalanx::Node, phalanx::Node) {
    let n0 = phalanx::cluster::start_node(cfg, 0, true).unwrap();
    let n1 = phalanx::cluster::start_node(cfg, 1, true).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !n1.transport().is_connected(0) {
        assert!(
            std::time::Instant::now() < deadline,
            "nodes 0 and 1 never linked"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    (n0, n1)
}

pub struct Member {
    out: Arc<std::sync::Mutex<TcpStream>>,
    /// Bytes read so far (the reader reads `rate` bytes per 10 ms; 0: not at all).
    pub read: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Member {
    /// Links to the node at `addr` (node `to`) as member `id` of an `n`-node cluster.
    pub fn join(addr: SocketAddr, id: u32, to: u32, n: u32, rate: u64) -> Member {
        let mut s = TcpStream::connect(addr).unwrap();
        let cfg = AuthConfig {
            secret: Some(ClusterSecret::parse(SECRET).unwrap()),
            members: Some(n),
            ..AuthConfig::default()
        };
        auth::dial(&mut s, &cfg, Channel::Tcp, id, to, Duration::from_secs(5)).expect("handshake");
        let (read, rate, stop) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(rate)),
            Arc::new(AtomicBool::new(false)),
        );
        let mut r = s.try_clone().unwrap();
        let (rd, rt, st) = (read.clone(), rate.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 20];
            while !st.load(Ordering::Relaxed) {
                let n = rt.load(Ordering::Relaxed) as usize;
                if n == 0 {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                let n = n.min(buf.len());
                match r.read(&mut buf[..n]) {
                    Ok(0) | Err(_) => {
                        st.store(true, Ordering::Relaxed);
                        return;
                    }
                    Ok(k) => {
                        rd.fetch_add(k as u64, Ordering::Relaxed);
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        // Heartbeats, as a node sends them, so the member stays linked however it reads.
        let out = Arc::new(std::sync::Mutex::new(s));
        let (o, st) = (out.clone(), stop.clone());
        std::thread::spawn(move || {
            let hb = FrameHeader::control(FrameKind::Heartbeat, 0).encode();
            while !st.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                if o.lock().unwrap().write_all(&hb).is_err() {
                    return;
                }
            }
        });
        Member { out, read, stop }
    }

    /// Sends one frame header of `kind` with no payload.
    pub fn send_frame(&mut self, kind: FrameKind) {
        let h = FrameHeader::control(kind, 0).encode();
        self.out.lock().unwrap().write_all(&h).unwrap();
    }

    /// Whether the node closed the connection (the reader saw its end).
    pub fn closed(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Sends one control message, framed as the TCP transport frames it.
    pub fn send(&mut self, m: &Msg) {
        let b = m.encode();
        let h = FrameHeader::control(FrameKind::Ctrl, b.len() as u64).encode();
        let mut o = self.out.lock().unwrap();
        o.write_all(&h).unwrap();
        o.write_all(&b).unwrap();
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.out.lock().unwrap().shutdown(std::net::Shutdown::Both);
    }
}
