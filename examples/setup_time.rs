//! Connection setup cost: the median time to link a full mesh of 8 TCP transports on
//! 127.0.0.1 (bind + connect), and to start a `LocalCluster` of 8 nodes, over a few runs.
//!
//! `cargo run --release --example setup_time [-- RUNS]`

use phalanx::transport::{NodeId, TcpConfig, TcpTransport, Transport};
use phalanx::{LocalCluster, NodeConfig};
use std::net::SocketAddr;
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

fn main() {
    let runs: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(11);
    let mesh: Vec<Duration> = (0..runs).map(|_| mesh_once()).collect();
    let cluster: Vec<Duration> = (0..runs).map(|_| cluster_once()).collect();
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
