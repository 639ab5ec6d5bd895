//! Link authentication seen from outside: a foreign process speaks the setup handshake with
//! raw sockets (the layout of `phalanx_transport::auth`, written out here byte by byte) to a
//! live 3-node TCP cluster on 127.0.0.1. It must not get a link without the cluster secret,
//! it must not disturb the real links by claiming a live node's id, and every refusal is
//! counted.

use phalanx::transport::auth::{Channel, Role, Transcript};
use phalanx::transport::{AuthConfig, ClusterSecret, NodeId, TcpConfig};
use phalanx::{LocalCluster, NodeConfig, TransportSettings};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

const SECRET: &str = "the secret of the test cluster, 46 bytes long.";
const HANDSHAKE: Duration = Duration::from_millis(800);

fn cluster() -> LocalCluster {
    let tcp = TcpConfig {
        heartbeat_timeout: Duration::from_secs(1),
        auth: AuthConfig {
            secret: Some(ClusterSecret::parse(SECRET).unwrap()),
            handshake_timeout: HANDSHAKE,
            ..AuthConfig::default()
        },
        ..TcpConfig::default()
    };
    let cfg = NodeConfig {
        arena_size: 64 << 20,
        op_timeout: Duration::from_secs(30),
        ..NodeConfig::default()
    };
    LocalCluster::start_with(3, cfg, TransportSettings::Tcp(tcp)).unwrap()
}

fn addr(c: &LocalCluster, k: usize) -> SocketAddr {
    c.node(k).listen_addr().expect("tcp node")
}

/// The dialler's first message: magic "PXA1", version 1, channel 1 (TCP), from, to, nonce.
fn challenge(from: NodeId, to: NodeId, nonce: [u8; 32]) -> Vec<u8> {
    let mut c = Vec::with_capacity(48);
    c.extend_from_slice(&0x3141_5850u32.to_le_bytes());
    c.extend_from_slice(&[1, 1, 0, 0]);
    c.extend_from_slice(&from.to_le_bytes());
    c.extend_from_slice(&to.to_le_bytes());
    c.extend_from_slice(&nonce);
    c
}

/// How a foreign dial ended.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// The acceptor refused at once, with this status, in its response.
    RefusedEarly(u8),
    /// The acceptor proved itself (checked with `key`: `proved`), took our proof and gave
    /// this verdict (0 = accepted), then closed (`closed`) or not.
    Verdict {
        proved: bool,
        verdict: u8,
        closed: bool,
    },
    /// The connection closed before a verdict.
    Closed,
}

fn read_or_eof(s: &mut TcpStream, buf: &mut [u8]) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.read_exact(buf).is_ok()
}

fn closed(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

/// Dials node `to` at `addr` claiming to be node `from`, proving with `key` (None: sends 32
/// bytes of garbage as its proof).
fn foreign_dial(addr: SocketAddr, from: NodeId, to: NodeId, key: Option<&[u8]>) -> Outcome {
    let mut s = TcpStream::connect(addr).unwrap();
    let nonce = [0x5a; 32];
    s.write_all(&challenge(from, to, nonce)).unwrap();
    let mut r = [0u8; 80];
    if !read_or_eof(&mut s, &mut r) {
        return Outcome::Closed;
    }
    if r[4] != 0 {
        return Outcome::RefusedEarly(r[4]);
    }
    assert_eq!(u32::from_le_bytes(r[8..12].try_into().unwrap()), to);
    assert_eq!(u32::from_le_bytes(r[12..16].try_into().unwrap()), from);
    let t = Transcript {
        channel: Channel::Tcp,
        dialler: from,
        acceptor: to,
        dialler_nonce: nonce,
        acceptor_nonce: r[16..48].try_into().unwrap(),
    };
    let proved = t.verify(key.unwrap_or(b""), Role::Acceptor, &r[48..80]);
    let proof = match key {
        Some(k) => t.tag(k, Role::Dialler),
        None => [0xee; 32],
    };
    if s.write_all(&proof).is_err() {
        return Outcome::Closed;
    }
    let mut v = [0u8; 1];
    if !read_or_eof(&mut s, &mut v) {
        return Outcome::Closed;
    }
    Outcome::Verdict {
        proved,
        verdict: v[0],
        closed: closed(&mut s),
    }
}

fn wait_for(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The real links are all up and carry traffic both ways between every pair.
fn links_work(c: &LocalCluster, tag: &str) {
    for a in 0..3 {
        for b in 0..3 {
            if a != b {
                assert!(c.node(a).transport().is_connected(b as NodeId), "{a}-{b}");
            }
        }
    }
    for (k, len) in [(0usize, 1000usize), (1, 300_000), (2, 2 << 20)] {
        let id = format!("{tag}-{k}");
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + k) as u8).collect();
        c.node(k).put(id.as_str(), &data).unwrap();
        for other in (0..3).filter(|&o| o != k) {
            assert!(
                c.node(other).get(id.as_str()).unwrap() == data,
                "{id} on {other}"
            );
        }
    }
    for k in 0..3 {
        assert_eq!(c.node(k).transport_stats().peers_down, 0, "node {k}");
    }
}

#[test]
fn a_hello_without_the_secret_is_refused() {
    let c = cluster();
    let a0 = addr(&c, 0);
    // The old hello frame (magic "PHX1", kind 1, claiming node 2): garbage now.
    let mut old = [0u8; 40];
    old[0..4].copy_from_slice(&0x3158_4850u32.to_le_bytes());
    old[4] = 1;
    old[16] = 2;
    let mut s = TcpStream::connect(a0).unwrap();
    s.write_all(&old).unwrap();
    assert!(closed(&mut s), "connection closed");
    wait_for("garbage counted", || {
        let st = c.node(0).transport_stats();
        st.hellos_refused == 1 && st.malformed_frames == 1
    });
    // A well-formed challenge, then garbage where the proof goes.
    let out = foreign_dial(a0, 2, 0, None);
    assert_eq!(
        out,
        Outcome::Verdict {
            proved: false,
            verdict: 1,
            closed: true
        }
    );
    // A challenge, then silence: dropped at the handshake bound.
    let mut s = TcpStream::connect(a0).unwrap();
    s.write_all(&challenge(2, 0, [1; 32])).unwrap();
    let t0 = Instant::now();
    let mut r = [0u8; 80];
    assert!(read_or_eof(&mut s, &mut r), "a response comes");
    assert!(closed(&mut s), "then the connection closes");
    let took = t0.elapsed();
    assert!(took >= HANDSHAKE / 2 && took < HANDSHAKE * 4, "{took:?}");
    wait_for("refusals counted", || {
        c.node(0).transport_stats().hellos_refused == 3
    });
    links_work(&c, "no-secret");
}

#[test]
fn a_hello_with_a_wrong_secret_is_refused() {
    let c = cluster();
    let wrong = b"a wrong secret of the same sort of length......";
    for (k, claim) in [(0usize, 2u32), (2, 0), (1, 2)] {
        let out = foreign_dial(addr(&c, k), claim, k as NodeId, Some(wrong));
        // The acceptor's proof does not check out under our key, and ours is refused.
        assert_eq!(
            out,
            Outcome::Verdict {
                proved: false,
                verdict: 1,
                closed: true
            },
            "node {k}"
        );
        wait_for("refusal counted", || {
            c.node(k).transport_stats().hellos_refused == 1
        });
    }
    // A claim from outside the membership, or addressed to another node: refused at once.
    assert_eq!(
        foreign_dial(addr(&c, 0), 3, 0, Some(wrong)),
        Outcome::RefusedEarly(2)
    );
    assert_eq!(
        foreign_dial(addr(&c, 0), 1, 2, Some(wrong)),
        Outcome::RefusedEarly(3)
    );
    wait_for("refusals counted", || {
        c.node(0).transport_stats().hellos_refused == 3
    });
    links_work(&c, "wrong-secret");
}

#[test]
fn a_forged_hello_for_a_live_id_leaves_the_real_link_up() {
    let c = cluster();
    links_work(&c, "before");
    // Claim to be node 1 to node 0 (and node 0 to node 1): without the secret, and with it.
    let wrong = b"a wrong secret of the same sort of length......";
    for (k, claim) in [(0usize, 1u32), (1, 0)] {
        let out = foreign_dial(addr(&c, k), claim, k as NodeId, Some(wrong));
        assert!(
            matches!(out, Outcome::Verdict { verdict: 1, .. }),
            "{out:?}"
        );
    }
    // An insider that knows the secret still cannot take over a live link: after waiting
    // for the real link to be detected dead (it is not), node 0 refuses it as busy.
    let t0 = Instant::now();
    let out = foreign_dial(addr(&c, 0), 1, 0, Some(SECRET.as_bytes()));
    assert_eq!(
        out,
        Outcome::Verdict {
            proved: true,
            verdict: 4,
            closed: true
        }
    );
    assert!(t0.elapsed() >= Duration::from_secs(2), "{:?}", t0.elapsed());
    wait_for("refusals counted", || {
        c.node(0).transport_stats().hellos_refused == 2
            && c.node(1).transport_stats().hellos_refused == 1
    });
    links_work(&c, "after");
}

#[test]
fn silent_peers_do_not_stall_link_setup() {
    let c = cluster();
    let a0 = addr(&c, 0);
    // Twenty connections that never say anything, and one that trickles.
    let silent: Vec<TcpStream> = (0..20).map(|_| TcpStream::connect(a0).unwrap()).collect();
    let trickler = std::thread::spawn(move || {
        let mut s = TcpStream::connect(a0).unwrap();
        for b in challenge(2, 0, [3; 32]) {
            if s.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    // Meanwhile another dial is answered, while the silent ones are still held open.
    let t0 = Instant::now();
    let mut s = TcpStream::connect(a0).unwrap();
    s.write_all(&challenge(2, 0, [4; 32])).unwrap();
    let mut r = [0u8; 80];
    assert!(read_or_eof(&mut s, &mut r));
    assert!(t0.elapsed() < HANDSHAKE, "{:?}", t0.elapsed());
    silent[0].set_nonblocking(true).unwrap();
    let still_open = silent[0].peek(&mut [0u8; 1]);
    assert!(
        matches!(&still_open, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "answered before the silent connections were dropped: {still_open:?}"
    );
    silent[0].set_nonblocking(false).unwrap();
    drop(s);
    // All of them are dropped at the handshake bound and counted.
    for mut s in silent {
        assert!(closed(&mut s));
    }
    trickler.join().unwrap();
    wait_for("refusals counted", || {
        c.node(0).transport_stats().hellos_refused == 22
    });
    links_work(&c, "silent");
}

/// A restarted node (same secret, from the cluster) rejoins: the old link is dead, so the new
/// one is admitted.
#[test]
fn a_restarted_node_is_admitted_once_its_old_link_is_dead() {
    let mut c = cluster();
    let tcp = TcpConfig {
        heartbeat_timeout: Duration::from_secs(1),
        auth: AuthConfig {
            secret: Some(ClusterSecret::parse(SECRET).unwrap()),
            ..AuthConfig::default()
        },
        ..TcpConfig::default()
    };
    let cfg = NodeConfig {
        arena_size: 64 << 20,
        ..NodeConfig::default()
    };
    c.restart(2, cfg, tcp).unwrap();
    wait_for("relinked", || {
        c.node(0).transport().is_connected(2) && c.node(1).transport().is_connected(2)
    });
    let data = vec![9u8; 100_000];
    c.node(2).put("after-restart", &data).unwrap();
    assert!(c.node(0).get("after-restart").unwrap() == data);
}
