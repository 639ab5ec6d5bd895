//! The store, directory and collectives on the verbs transport. Runs where an RDMA device
//! exists (the Soft-RoCE VM in CI: `soft-roce-setup.sh vm`); elsewhere each test says it is
//! skipped.
#![cfg(feature = "rdma")]

use phalanx::{DType, LocalCluster, NodeConfig, ReduceOp, TransportKind, TransportSettings};
use std::time::Duration;

fn cluster(n: u32) -> Option<LocalCluster> {
    if !phalanx_rdma::rdma_available() {
        eprintln!("no RDMA device: skipped (run inside `soft-roce-setup.sh vm`)");
        return None;
    }
    let t = TransportSettings::new(
        TransportKind::Rdma,
        Duration::from_secs(3),
        std::env::var("PHALANX_RDMA_DEVICE").ok(),
        None,
    )
    .unwrap();
    let cfg = NodeConfig {
        arena_size: 256 << 20,
        op_timeout: Duration::from_secs(120),
        ..NodeConfig::default()
    };
    Some(LocalCluster::start_with(n, cfg, t).unwrap())
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn verbs_put_get_sizes() {
    let Some(c) = cluster(2) else { return };
    for (i, &len) in [0usize, 1, 4096, 65535, 65536, 1 << 20, 64 << 20]
        .iter()
        .enumerate()
    {
        let data = pattern(len, i as u8);
        let id = format!("v-{len}");
        let before = c.node(1).transport_stats();
        c.node(0).put(id.as_str(), &data).unwrap();
        assert!(
            c.node(1).get(id.as_str()).unwrap() == data,
            "{len} bytes differ"
        );
        let after = c.node(1).transport_stats();
        if len < 65536 {
            // A small object travels inline, in control messages (the eager blocks): no
            // data write, no registration.
            assert_eq!(
                after.data_bytes_received, before.data_bytes_received,
                "{len} bytes came by a data write"
            );
            assert!(
                after.ctrl_received > before.ctrl_received,
                "{len}: no message"
            );
            assert_eq!(after.registrations, before.registrations);
        }
    }
    // A 64 MiB pull went by rendezvous: no payload copy, no registration beyond setup.
    let s = c.node(1).transport_stats();
    assert!(s.payload_bytes_copied < 1 << 20, "{s:?}");
}

#[test]
fn verbs_broadcast_and_reduce() {
    let Some(c) = cluster(4) else { return };
    let data = pattern(16 << 20, 9);
    std::thread::scope(|s| {
        let hs: Vec<_> = (1..4)
            .map(|k| {
                let n = c.node(k).clone();
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(10 * k as u64));
                    n.get("v-bcast").unwrap()
                })
            })
            .collect();
        c.node(0).put("v-bcast", &data).unwrap();
        for h in hs {
            assert!(h.join().unwrap() == data);
        }
    });
    let ids: Vec<phalanx::ObjectId> = (0..4)
        .map(|k| phalanx::ObjectId::new(format!("v-in-{k}")))
        .collect();
    for (k, id) in ids.iter().enumerate() {
        let v: Vec<u8> = (0..1u32 << 20)
            .flat_map(|i| ((i % 13 + k as u32) as i32).to_le_bytes())
            .collect();
        c.node(k).put(id.clone(), &v).unwrap();
    }
    c.node(0)
        .reduce("v-sum", &ids, 4, ReduceOp::Sum, DType::I32)
        .unwrap();
    let got = c.node(2).get("v-sum").unwrap();
    for (i, w) in got.chunks_exact(4).enumerate().step_by(1009) {
        let want: i32 = (0..4).map(|k| (i as u32 % 13 + k) as i32).sum();
        assert_eq!(i32::from_le_bytes(w.try_into().unwrap()), want);
    }
}

/// A partitioned allreduce on verbs: every node ends with the sum, and the partitions each
/// node pulls along their chains land by RDMA straight in their place in its copy of the
/// result (`Store::create_within`), none copied afterwards.
#[test]
fn verbs_partitioned_allreduce_pulls_partitions_into_place() {
    let Some(c) = cluster(4) else { return };
    let elems = 2u32 << 20; // 8 MiB of i32: four partitions of 2 MiB
    let ids: Vec<phalanx::ObjectId> = (0..4)
        .map(|k| phalanx::ObjectId::new(format!("v-ar-in-{k}")))
        .collect();
    for (k, id) in ids.iter().enumerate() {
        let v: Vec<u8> = (0..elems)
            .flat_map(|i| ((i % 101) as i32 * (k as i32 + 1)).to_le_bytes())
            .collect();
        c.node(k).put(id.clone(), &v).unwrap();
    }
    let size = elems as u64 * 4;
    let results: Vec<Vec<u8>> = std::thread::scope(|s| {
        let readers: Vec<_> = (1..4)
            .map(|k| {
                let n = c.node(k).clone();
                s.spawn(move || n.allreduce_read("v-ar", size).unwrap().to_vec())
            })
            .collect();
        let (mine, outcome) = c
            .node(0)
            .allreduce("v-ar", &ids, ReduceOp::Sum, DType::I32, &Default::default())
            .unwrap();
        assert_eq!(outcome.partitions, 4, "partitioned");
        let mut all = vec![mine];
        all.extend(readers.into_iter().map(|h| h.join().unwrap()));
        all
    });
    for (k, got) in results.iter().enumerate() {
        assert_eq!(got.len() as u64, size, "node {k}");
        for (i, w) in got.chunks_exact(4).enumerate() {
            let want = (i as u32 % 101) as i32 * (1 + 2 + 3 + 4);
            assert_eq!(
                i32::from_le_bytes(w.try_into().unwrap()),
                want,
                "node {k}, {i}"
            );
        }
    }
    let placed: u64 = (0..4).map(|k| c.node(k).partitions_pulled_in_place()).sum();
    assert!(placed > 0, "no partition was pulled into place");
}

/// Sixteen nodes whose verbs links (queue pairs) are made on first use: a broadcast and a
/// reduce over 15 of them are correct, the sixteenth links only its ring neighbours, and each
/// node's eager memory stays within what its configuration fixes (the shared receive queue,
/// the staging pool and the ring pool), whatever the number of peers it linked.
#[test]
fn verbs_links_made_on_demand() {
    if !phalanx_rdma::rdma_available() {
        eprintln!("no RDMA device: skipped (run inside `soft-roce-setup.sh vm`)");
        return;
    }
    const N: u32 = 16;
    const IDLE: usize = 15;
    let mut t = TransportSettings::new(
        TransportKind::Rdma,
        Duration::from_secs(3),
        std::env::var("PHALANX_RDMA_DEVICE").ok(),
        None,
    )
    .unwrap();
    t.set_on_demand(true);
    let (ring, bound) = match &t {
        TransportSettings::Rdma(r) => {
            let ring = ((2 * r.ring_blocks * r.block_size + 128) as u64).next_multiple_of(4096);
            let pools = ((r.srq_blocks + r.staging_blocks) * r.block_size) as u64;
            (ring, pools + r.ring_pool as u64 * ring)
        }
        _ => unreachable!("verbs settings"),
    };
    let cfg = NodeConfig {
        arena_size: 48 << 20,
        op_timeout: Duration::from_secs(120),
        ..NodeConfig::default()
    };
    let c = LocalCluster::start_with(N, cfg, t).unwrap();
    let data = pattern(4 << 20, 5);
    let id = phalanx::ObjectId::homed(0, "od-bcast");
    c.node(0).put(id.clone(), &data).unwrap();
    std::thread::scope(|s| {
        for k in 1..IDLE {
            let (c, id, data) = (&c, id.clone(), &data);
            s.spawn(move || {
                std::thread::sleep(Duration::from_millis(5 * k as u64));
                assert!(c.node(k).get(id).unwrap() == *data, "node {k}'s copy");
            });
        }
    });
    let ids: Vec<phalanx::ObjectId> = (0..IDLE)
        .map(|k| phalanx::ObjectId::homed(0, format!("od-in-{k}")))
        .collect();
    for (k, id) in ids.iter().enumerate() {
        let v: Vec<u8> = (0..1u32 << 18)
            .flat_map(|i| ((i % 13 + k as u32) as i32).to_le_bytes())
            .collect();
        c.node(k).put(id.clone(), &v).unwrap();
    }
    let sum = phalanx::ObjectId::homed(0, "od-sum");
    c.node(0)
        .reduce(sum.clone(), &ids, IDLE, ReduceOp::Sum, DType::I32)
        .unwrap();
    let got = c.node(7).get(sum).unwrap();
    for (i, w) in got.chunks_exact(4).enumerate() {
        let want: i32 = (0..IDLE as u32).map(|k| (i as u32 % 13 + k) as i32).sum();
        assert_eq!(
            i32::from_le_bytes(w.try_into().unwrap()),
            want,
            "element {i}"
        );
    }
    let links: Vec<usize> = (0..N as usize)
        .map(|k| c.node(k).transport().link_counts().unwrap().peak)
        .collect();
    let eager: Vec<u64> = (0..N as usize)
        .map(|k| c.node(k).transport().eager_memory().unwrap().1)
        .collect();
    println!(
        "verbs on demand, {N} nodes: links at most open per node {links:?}; eager memory per \
         node at most {:?} KiB, bound {} KiB whatever N (shared pools + ring pool); a ring \
         per link would take {:?} KiB",
        eager.iter().map(|e| e >> 10).collect::<Vec<_>>(),
        bound >> 10,
        links
            .iter()
            .map(|&l| (l as u64 * ring) >> 10)
            .collect::<Vec<_>>(),
    );
    for (k, &e) in eager.iter().enumerate() {
        assert!(
            e <= bound,
            "node {k}: {e} bytes of eager memory, bound {bound}"
        );
    }
    // The idle node links only the four ring neighbours it watches.
    assert!(
        links[IDLE] <= 4,
        "the idle node linked {} peers",
        links[IDLE]
    );
    assert!(links.iter().all(|&l| l < N as usize));
}
