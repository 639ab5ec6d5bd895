//! Point-to-point transfers over TCP loopback: a Phalanx remote `get` (zero-copy view) next to
//! a plain `std::net::TcpStream` doing the same request/response in the same run.
//!
//! `cargo bench --bench transport` (add `-- p2p` or `-- rtt` to pick a group). The verbs
//! group `p2p_verbs` runs where an RDMA device exists (the Soft-RoCE VM).

use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use phalanx::transport::TcpConfig;
use phalanx::{LocalCluster, Node, NodeConfig};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

const SIZES: [u64; 6] = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30];

/// A baseline server: answers each 8-byte request "n" with n bytes.
struct PlainServer {
    client: TcpStream,
}

impl PlainServer {
    fn start(max: usize) -> PlainServer {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.set_nodelay(true).unwrap();
            let data = vec![7u8; max];
            let mut req = [0u8; 8];
            while s.read_exact(&mut req).is_ok() {
                let n = u64::from_le_bytes(req) as usize;
                if s.write_all(&data[..n]).is_err() {
                    break;
                }
            }
        });
        let client = TcpStream::connect(addr).unwrap();
        client.set_nodelay(true).unwrap();
        PlainServer { client }
    }

    fn fetch(&mut self, buf: &mut [u8]) {
        self.client
            .write_all(&(buf.len() as u64).to_le_bytes())
            .unwrap();
        self.client.read_exact(buf).unwrap();
    }
}

/// An object name whose directory entry lives on node 0, so a get from node 1 costs one
/// round trip to the holder, as the plain baseline does.
fn name_on_shard0(node: &Node, prefix: &str) -> String {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .find(|n| node.shard_of(n.as_str()) == 0)
        .unwrap()
}

/// One remote get of `id` by node 1 (zero-copy view), then node 1 drops its copy so the next
/// get pulls again (objects under 64 KiB come inline from the directory and leave no copy).
fn remote_get(cl: &LocalCluster, id: &str, size: u64) {
    let v = cl.node(1).get_view(id).unwrap();
    assert_eq!(v.len() as u64, size);
    drop(v);
    assert_eq!(cl.node(1).evict_local(id), size >= phalanx::INLINE_LIMIT);
}

fn cluster(arena: u64) -> LocalCluster {
    LocalCluster::start(
        2,
        NodeConfig {
            arena_size: arena,
            // PHALANX_SPIN_US overrides how long callers poll for a reply (RTT experiments).
            spin_wait: std::env::var("PHALANX_SPIN_US")
                .ok()
                .and_then(|v| v.parse().ok())
                .map_or(NodeConfig::default().spin_wait, Duration::from_micros),
            ..NodeConfig::default()
        },
        TcpConfig::default(),
    )
    .unwrap()
}

fn p2p(c: &mut Criterion) {
    let max = *SIZES.last().unwrap();
    let cl = cluster(2 * max + (64 << 20));
    let mut plain = PlainServer::start(max as usize);
    let mut buf = vec![0u8; max as usize];
    let mut g = c.benchmark_group("p2p");
    g.sampling_mode(SamplingMode::Flat);
    for &size in &SIZES {
        g.throughput(Throughput::Bytes(size));
        g.sample_size(if size >= 256 << 20 { 10 } else { 30 });
        g.measurement_time(Duration::from_secs(if size >= 256 << 20 { 20 } else { 5 }));
        let id = name_on_shard0(cl.node(0), &format!("p2p-{size}"));
        let data = vec![3u8; size as usize];
        cl.node(0).put(id.as_str(), &data).unwrap();
        g.bench_with_input(BenchmarkId::new("plain_tcp", size), &size, |b, &size| {
            b.iter(|| plain.fetch(&mut buf[..size as usize]))
        });
        g.bench_with_input(
            BenchmarkId::new("phalanx_get_view", size),
            &size,
            |b, &size| b.iter(|| remote_get(&cl, &id, size)),
        );
        cl.node(0).delete(id.as_str()).unwrap();
    }
    g.finish();
}

fn rtt(c: &mut Criterion) {
    let cl = cluster(64 << 20);
    let mut plain = PlainServer::start(1024);
    let mut buf = vec![0u8; 1024];
    let id = name_on_shard0(cl.node(0), "rtt");
    cl.node(0).put(id.as_str(), &[5u8; 1024]).unwrap();
    let mut g = c.benchmark_group("rtt_1KiB");
    g.bench_function("plain_tcp", |b| b.iter(|| plain.fetch(&mut buf)));
    let mut get = || assert_eq!(cl.node(1).get(id.as_str()).unwrap().len(), 1024);
    g.bench_function("phalanx_get_inline", |b| b.iter(&mut get));
    g.finish();
    // The two measured alternately, so that load from elsewhere on a shared machine hits
    // both alike: medians and their ratio.
    let (mut p, mut x) = (Vec::new(), Vec::new());
    for _ in 0..20_000 {
        let t = std::time::Instant::now();
        plain.fetch(&mut buf);
        p.push(t.elapsed().as_secs_f64());
        let t = std::time::Instant::now();
        get();
        x.push(t.elapsed().as_secs_f64());
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (mp, mx) = (median(&mut p), median(&mut x));
    eprintln!(
        "rtt_1KiB interleaved medians: plain_tcp {:.2} us, phalanx_get_inline {:.2} us, ratio {:.2}",
        mp * 1e6,
        mx * 1e6,
        mx / mp
    );
}

/// The same p2p get over the verbs transport (an RDMA device must exist: run it inside
/// `soft-roce-setup.sh vm`; sizes above PHALANX_BENCH_MAX_BYTES, default 1 GiB, are skipped,
/// since Soft-RoCE under emulation moves tens of MB/s).
#[cfg(feature = "rdma")]
fn p2p_verbs(c: &mut Criterion) {
    use phalanx::{TransportKind, TransportSettings};
    if !phalanx_rdma::rdma_available() {
        eprintln!("p2p_verbs: no RDMA device: skipped (run inside `soft-roce-setup.sh vm`)");
        return;
    }
    let max: u64 = std::env::var("PHALANX_BENCH_MAX_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1 << 30);
    let sizes: Vec<u64> = SIZES.iter().copied().filter(|&s| s <= max).collect();
    let biggest = sizes.iter().copied().max().unwrap_or(0);
    let t =
        TransportSettings::new(TransportKind::Rdma, Duration::from_secs(3), None, None).unwrap();
    let cl = LocalCluster::start_with(
        2,
        NodeConfig {
            arena_size: 2 * biggest + (64 << 20),
            ..NodeConfig::default()
        },
        t,
    )
    .unwrap();
    let mut g = c.benchmark_group("p2p_verbs");
    g.sampling_mode(SamplingMode::Flat);
    g.sample_size(10);
    for &size in &sizes {
        g.throughput(Throughput::Bytes(size));
        let id = name_on_shard0(cl.node(0), &format!("p2pv-{size}"));
        cl.node(0)
            .put(id.as_str(), &vec![3u8; size as usize])
            .unwrap();
        g.bench_with_input(
            BenchmarkId::new("phalanx_get_view", size),
            &size,
            |b, &size| b.iter(|| remote_get(&cl, &id, size)),
        );
        cl.node(0).delete(id.as_str()).unwrap();
    }
    g.finish();
}

#[cfg(not(feature = "rdma"))]
fn p2p_verbs(_: &mut Criterion) {}

criterion_group!(benches, rtt, p2p, p2p_verbs);
criterion_main!(benches);
