//! A node reads its links on a bounded set of threads (`TcpConfig::dedicated_readers` links
//! with a thread of their own, the rest on `TcpConfig::readers` epoll threads): the threads of
//! a cluster grow with the number of nodes, not with the number of links (a full mesh of n
//! nodes has n(n - 1) connection ends), and every link, read either way, carries its traffic.

use phalanx::transport::TcpConfig;
use phalanx::{LocalCluster, NodeConfig, TransportSettings};
use std::time::Duration;

fn threads() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with("Threads:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Threads of the process with a cluster of `n` nodes up and every link used once.
fn threads_with(n: u32) -> u64 {
    let tcp = TcpConfig {
        heartbeat_timeout: Duration::from_secs(5),
        dedicated_readers: 4,
        readers: 2,
        ..TcpConfig::default()
    };
    let cfg = NodeConfig {
        arena_size: 16 << 20,
        op_timeout: Duration::from_secs(30),
        ..NodeConfig::default()
    };
    let c = LocalCluster::start_with(n, cfg, TransportSettings::Tcp(tcp)).unwrap();
    // Every node gets an object from every other: traffic on every link, both ways.
    for k in 0..n {
        c.node(k as usize)
            .put(format!("obj-{k}").as_str(), &vec![k as u8; 100_000])
            .unwrap();
    }
    for k in 0..n as usize {
        for j in 0..n as usize {
            let got = c.node(k).get(format!("obj-{j}").as_str()).unwrap();
            assert!(got == vec![j as u8; 100_000], "node {k} got obj-{j} wrong");
        }
    }
    threads()
}

#[test]
fn reader_threads_do_not_grow_with_the_links() {
    let base = threads();
    let t8 = threads_with(8) - base;
    let t24 = threads_with(24) - base;
    let per_node = (t24 as f64 - t8 as f64) / 16.0;
    println!(
        "threads: 8 nodes +{t8} ({:.1} per node), 24 nodes +{t24}; per added node {per_node:.1} \
         (a full mesh of 24 has 552 connection ends)",
        t8 as f64 / 8.0
    );
    // A reader per connection would add 23 or more per node at 24 nodes.
    assert!(
        per_node <= 16.0,
        "{per_node:.1} threads per added node: reading grows with the links"
    );
}
