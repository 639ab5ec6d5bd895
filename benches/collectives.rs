//! Collectives on an in-process cluster of 4 nodes over TCP loopback: Phalanx's own
//! algorithms next to the star baseline (every transfer to or from node 0, one at a time) in
//! the same run.
//!
//! - broadcast: node 0 puts, nodes 1..3 get (phalanx: any source; star: from node 0);
//! - reduce: every node puts an f32 input, node 0 sums them (phalanx: dynamic tree; star:
//!   node 0 gets the inputs one after another and adds them up);
//! - allreduce: the reduce, and every node gets the result (phalanx only: it has no star).
//!
//! `cargo bench --bench collectives` (add `-- broadcast` etc. to pick a group). Loopback has
//! no per-host link, so this measures software overhead and CPU cost, not the network effect
//! of the algorithms; for that, see `cluster/` and the README.

use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use phalanx::transport::TcpConfig;
use phalanx::{DType, LocalCluster, Node, NodeConfig, ObjectId, ReduceOp, ReduceOptions};
use std::sync::Barrier;
use std::time::{Duration, Instant};

const NODES: u32 = 4;
const SIZES: [u64; 2] = [1 << 20, 16 << 20];

fn cluster() -> LocalCluster {
    let max = *SIZES.last().unwrap();
    LocalCluster::start(
        NODES,
        NodeConfig {
            // inputs, partial results and targets of a 16 MiB reduce, with room to spare
            arena_size: max * (NODES as u64 + 6) + (64 << 20),
            ..NodeConfig::default()
        },
        TcpConfig::default(),
    )
    .unwrap()
}

fn input(rank: u32, size: u64) -> Vec<u8> {
    (0..size / 4)
        .flat_map(|i| (((i + rank as u64) % 7) as f32).to_le_bytes())
        .collect()
}

/// Runs `f(node)` on nodes 1..n in threads and `root()` on this thread, all released together;
/// returns the time from the release until everyone is done.
fn timed(c: &LocalCluster, others: impl Fn(&Node) + Sync, root: impl FnOnce(&Node)) -> Duration {
    let go = Barrier::new(c.nodes.len());
    std::thread::scope(|s| {
        let hs: Vec<_> = c.nodes[1..]
            .iter()
            .map(|n| {
                let (go, others) = (&go, &others);
                s.spawn(move || {
                    go.wait();
                    others(n)
                })
            })
            .collect();
        go.wait();
        let t0 = Instant::now();
        root(&c.nodes[0]);
        for h in hs {
            h.join().unwrap();
        }
        t0.elapsed()
    })
}

fn broadcast(cr: &mut Criterion) {
    let c = cluster();
    let mut g = cr.benchmark_group("broadcast");
    g.sampling_mode(SamplingMode::Flat).sample_size(10);
    let mut round = 0u64;
    for &size in &SIZES {
        g.throughput(Throughput::Bytes(size));
        g.measurement_time(Duration::from_secs(if size > 1 << 20 { 8 } else { 4 }));
        let data: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
        for algo in ["phalanx", "star"] {
            g.bench_with_input(BenchmarkId::new(algo, size), &size, |b, &size| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        round += 1;
                        let id = ObjectId::new(format!("bc/{algo}/{size}/{round}"));
                        total += timed(
                            &c,
                            |n| {
                                let v = if algo == "star" {
                                    n.get_view_from(id.clone(), 0).unwrap()
                                } else {
                                    n.get_view(id.clone()).unwrap()
                                };
                                assert_eq!(v.len() as u64, size);
                            },
                            |n| n.put(id.clone(), &data).unwrap(),
                        );
                        c.nodes[0].delete(id).unwrap();
                    }
                    total
                })
            });
        }
    }
    g.finish();
}

/// One reduce (or allreduce): inputs are put while the clock runs, as in the SPMD bench.
fn reduce_round(c: &LocalCluster, algo: &str, data: &[Vec<u8>], round: u64, all: bool) -> Duration {
    let size = data[0].len() as u64;
    let name = |k: u32| ObjectId::new(format!("rd/{algo}/{all}/{size}/{round}/{k}"));
    let inputs: Vec<ObjectId> = (0..NODES).map(name).collect();
    let target = ObjectId::new(format!("rd/{algo}/{all}/{size}/{round}/out"));
    let t = timed(
        c,
        |n| {
            n.put(inputs[n.id() as usize].clone(), &data[n.id() as usize])
                .unwrap();
            if all {
                assert_eq!(n.get_view(target.clone()).unwrap().len() as u64, size);
            }
        },
        |n| {
            std::thread::scope(|s| {
                s.spawn(|| n.put(inputs[0].clone(), &data[0]).unwrap());
                if algo == "star" {
                    let mut acc = n.get(inputs[0].clone()).unwrap();
                    for id in &inputs[1..] {
                        let v = n.get(id.clone()).unwrap();
                        phalanx::ops::combine(ReduceOp::Sum, DType::F32, &mut acc, &v);
                    }
                    assert_eq!(acc.len() as u64, size);
                } else {
                    n.reduce_with(
                        target.clone(),
                        &inputs,
                        inputs.len(),
                        ReduceOp::Sum,
                        DType::F32,
                        &ReduceOptions::default(),
                    )
                    .unwrap();
                    assert_eq!(n.get_view(target.clone()).unwrap().len() as u64, size);
                }
            });
        },
    );
    for id in inputs {
        c.nodes[0].delete(id).unwrap();
    }
    if algo != "star" {
        c.nodes[0].delete(target).unwrap();
    }
    t
}

fn reduce_group(cr: &mut Criterion, group: &str, all: bool, algos: &[&str]) {
    let c = cluster();
    let mut g = cr.benchmark_group(group);
    g.sampling_mode(SamplingMode::Flat).sample_size(10);
    let mut round = 0u64;
    for &size in &SIZES {
        g.throughput(Throughput::Bytes(size));
        g.measurement_time(Duration::from_secs(if size > 1 << 20 { 8 } else { 4 }));
        let data: Vec<Vec<u8>> = (0..NODES).map(|k| input(k, size)).collect();
        for &algo in algos {
            g.bench_with_input(BenchmarkId::new(algo, size), &size, |b, _| {
                b.iter_custom(|iters| {
                    (0..iters)
                        .map(|_| {
                            round += 1;
                            reduce_round(&c, algo, &data, round, all)
                        })
                        .sum()
                })
            });
        }
    }
    g.finish();
}

fn reduce(cr: &mut Criterion) {
    reduce_group(cr, "reduce", false, &["phalanx", "star"]);
}

fn allreduce(cr: &mut Criterion) {
    reduce_group(cr, "allreduce", true, &["phalanx"]);
}

criterion_group!(benches, broadcast, reduce, allreduce);
criterion_main!(benches);
