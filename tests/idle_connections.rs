//! A thousand connections that never say anything cost a node no thread and little memory,
//! and the node keeps working meanwhile: handshakes run on the accept thread (epoll), each
//! bounded by the handshake timeout; none gets a link, a thread or a buffer before it proves
//! the cluster secret.

use phalanx::transport::{AuthConfig, ClusterSecret, TcpConfig};
use phalanx::{LocalCluster, NodeConfig, TransportSettings};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const IDLE: usize = 1000;
const HANDSHAKE: Duration = Duration::from_millis(1500);
/// Threads the silent connections may add: none (a margin of 2 for the cluster's own
/// short-lived threads, such as an idle worker's).
const MORE_THREADS: u64 = 2;

fn status(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("{field} in /proc/self/status"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn a_thousand_idle_connections_cost_bounded_threads_and_memory() {
    let tcp = TcpConfig {
        heartbeat_timeout: Duration::from_secs(2),
        auth: AuthConfig {
            secret: Some(ClusterSecret::parse("idle connections test secret").unwrap()),
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
    let c = LocalCluster::start_with(2, cfg, TransportSettings::Tcp(tcp)).unwrap();
    c.node(0).put("before", &[1u8; 100_000]).unwrap();
    assert_eq!(c.node(1).get("before").unwrap(), vec![1u8; 100_000]);
    let (threads0, rss0) = (status("Threads:"), status("VmRSS:"));
    let addr = c.node(0).listen_addr().unwrap();
    let idle: Vec<TcpStream> = (0..IDLE)
        .map(|_| TcpStream::connect(addr).expect("connect"))
        .collect();
    // While they are all open and silent: bounded threads and memory, and the node works.
    std::thread::sleep(Duration::from_millis(300));
    let (threads1, rss1) = (status("Threads:"), status("VmRSS:"));
    let t = Instant::now();
    c.node(0).put("during", &[2u8; 1 << 20]).unwrap();
    assert_eq!(c.node(1).get("during").unwrap(), vec![2u8; 1 << 20]);
    let during = t.elapsed();
    println!(
        "{IDLE} idle connections: threads {threads0} -> {threads1} (bound +{MORE_THREADS}), \
         RSS {rss0} -> {rss1} KiB; a 1 MiB put+get meanwhile took {during:?}"
    );
    assert!(
        threads1 <= threads0 + MORE_THREADS,
        "threads {threads0} -> {threads1}"
    );
    assert!(
        rss1 <= rss0 + 64 * 1024,
        "RSS grew from {rss0} to {rss1} KiB"
    );
    // Every handshake thread ends by the handshake timeout; no link was made.
    std::thread::sleep(HANDSHAKE + Duration::from_millis(700));
    let threads2 = status("Threads:");
    assert!(
        threads2 <= threads0 + 4,
        "threads {threads0} -> {threads2} after the handshake timeout"
    );
    let refused = c.node(0).transport_stats().hellos_refused;
    assert!(
        refused >= IDLE as u64,
        "only {refused} of {IDLE} refusals counted"
    );
    drop(idle);
    c.node(1).put("after", &[3u8; 1000]).unwrap();
    assert_eq!(c.node(0).get("after").unwrap(), vec![3u8; 1000]);
}
