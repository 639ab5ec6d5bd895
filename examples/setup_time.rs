//! Connection setup cost: the median time to link a full mesh of 8 TCP transports on
//! 127.0.0.1 (bind + connect), and to start a `LocalCluster` of 8 nodes, over a few runs; and
//! the cost of one authentication handshake (`phalanx_transport::auth`) on a loopback socket
//! against a bare connect + one-byte round trip.
//!
//! `cargo run --release --example setup_time [-- RUNS]`

use phalanx::transport::auth::{self, Channel};
use phalanx::transport::{AuthConfig, ClusterSecret, NodeId, TcpConfig, TcpTransport, Transport};
use phalanx::{LocalCluster, NodeConfig};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

const N: u32 = 8;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn mesh_once() -> Duration {
    let any: SocketAddr = "127.0.0.1:0".parse().expect("address");
    let t0 = Instant::now();
    let ts: Vec<TcpTransport> = (0..N)
        .map(|i| TcpTransport::bind(i, any, TcpConfig::default()).expect("bind"))
        .collect();
    let peers: Vec<(NodeId, SocketAddr)> = ts
        .iter()
        .enumerate()
        .map(|(i, t)| (i as NodeId, t.listen_addr().expect("listens")))
        .collect();
    std::thread::scope(|s| {
        for t in &ts {
            let peers = &peers;
            s.spawn(move || t.connect(peers, false).expect("connect"));
        }
    });
    let took = t0.elapsed();
    for t in &ts {
        t.shutdown();
    }
    took
}

fn cluster_once() -> Duration {
    let cfg = NodeConfig {
        arena_size: 64 << 20,
        latency_override: Some(Duration::from_micros(50)),
        bandwidth_override: Some(1e9),
        ..NodeConfig::default()
    };
    let t0 = Instant::now();
    let c = LocalCluster::start(N, cfg, TcpConfig::default()).expect("cluster");
    let took = t0.elapsed();
    drop(c);
    took
}

/// Median time of `f` on a fresh loopback connection (dialler side timed), over `n` runs.
fn per_connection(
    n: usize,
    dial: impl Fn(&mut TcpStream) + Send + Sync + Copy + 'static,
    accept: impl Fn(&mut TcpStream) + Send + Sync + Copy + 'static,
) -> Duration {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("address");
    let acc = std::thread::spawn(move || {
        for _ in 0..n {
            let (mut s, _) = l.accept().expect("accept");
            accept(&mut s);
        }
    });
    let took = (0..n)
        .map(|_| {
            let t0 = Instant::now();
            let mut s = TcpStream::connect(addr).expect("connect");
            s.set_nodelay(true).expect("nodelay");
            dial(&mut s);
            t0.elapsed()
        })
        .collect();
    acc.join().expect("acceptor");
    median(took)
}

fn handshakes(n: usize) -> (Duration, Duration) {
    fn cfg() -> AuthConfig {
        AuthConfig {
            secret: Some(ClusterSecret::parse("a secret for the setup measurement").unwrap()),
            ..AuthConfig::default()
        }
    }
    let bare = per_connection(
        n,
        |s| {
            s.write_all(&[1]).unwrap();
            s.read_exact(&mut [0]).unwrap();
        },
        |s| {
            s.read_exact(&mut [0]).unwrap();
            s.write_all(&[1]).unwrap();
        },
    );
    let authed = per_connection(
        n,
        |s| auth::dial(s, &cfg(), Channel::Tcp, 1, 0, Duration::ZERO).expect("dial"),
        |s| {
            s.set_nodelay(true).unwrap();
            let a = auth::accept(s, &cfg(), Channel::Tcp, 0).expect("accept");
            a.accept(s).expect("verdict");
        },
    );
    (bare, authed)
}

fn main() {
    let runs: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(11);
    let mesh: Vec<Duration> = (0..runs).map(|_| mesh_once()).collect();
    let cluster: Vec<Duration> = (0..runs).map(|_| cluster_once()).collect();
    let (bare, authed) = handshakes(1000);
    println!(
        "one loopback connection: connect + 1-byte round trip {bare:?}, connect + \
         authentication handshake {authed:?} (medians of 1000)"
    );
    println!(
        "mesh of {N} TCP transports (bind + connect, {} links): median {:?} over {runs} runs",
        N * (N - 1) / 2,
        median(mesh)
    );
    println!(
        "LocalCluster of {N} over TCP: median {:?} over {runs} runs",
        median(cluster)
    );
}
