//! Multi-node tests of the core over real TCP on loopback.

use phalanx::transport::{NodeId, TcpConfig};
use phalanx::{Error, LocalCluster, NodeConfig};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

fn cfg(arena: u64) -> NodeConfig {
    NodeConfig {
        arena_size: arena,
        op_timeout: Duration::from_secs(60),
        ..NodeConfig::default()
    }
}

fn tcp() -> TcpConfig {
    TcpConfig {
        heartbeat_timeout: Duration::from_secs(3),
        ..TcpConfig::default()
    }
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    let mut v = vec![0u8; len];
    r.fill(&mut v[..]);
    v
}

#[test]
fn put_get_sizes_across_nodes() {
    let c = LocalCluster::start(3, cfg(1 << 30), tcp()).unwrap();
    for (i, &len) in [0usize, 1, 65535, 65536, 1 << 20, 256 << 20]
        .iter()
        .enumerate()
    {
        let data = pattern(len, i as u64);
        let id = format!("obj-{len}");
        c.node(0).put(id.as_str(), &data).unwrap();
        for n in 1..3 {
            let got = c.node(n).get(id.as_str()).unwrap();
            assert!(got == data, "{len} bytes differ on node {n}");
        }
        let view = c.node(2).get_view(id.as_str()).unwrap();
        assert!(*view == *data);
        drop(view);
        c.node(1).delete(id.as_str()).unwrap();
    }
}

#[test]
fn broadcast_random_arrivals_forms_a_tree() {
    const N: usize = 8;
    const SIZE: usize = 32 << 20;
    let c = LocalCluster::start(N as u32, cfg(256 << 20), tcp()).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let delays: Vec<u64> = (0..N).map(|_| rng.gen_range(0..40)).collect();
    let data = pattern(SIZE, 99);
    std::thread::scope(|s| {
        let mut hs = Vec::new();
        for (k, &delay) in delays.iter().enumerate().skip(1) {
            let node = c.node(k).clone();
            hs.push(s.spawn(move || {
                std::thread::sleep(Duration::from_millis(delay));
                node.get("bcast").unwrap()
            }));
        }
        c.node(0).put("bcast", &data).unwrap();
        for h in hs {
            assert!(h.join().unwrap() == data, "a receiver got different bytes");
        }
    });
    // Every receiver pulled the whole object, from exactly one source, with no failure.
    let mut parent: HashMap<NodeId, NodeId> = HashMap::new();
    for k in 1..N {
        let log = c.node(k).transfer_log();
        assert_eq!(log.len(), 1, "node {k}: {log:?}");
        assert!(log[0].ok && log[0].bytes == SIZE as u64);
        parent.insert(k as NodeId, log[0].source);
    }
    // The sources form a tree rooted at the putter.
    for k in 1..N as NodeId {
        let mut cur = k;
        for _ in 0..N {
            if cur == 0 {
                break;
            }
            cur = parent[&cur];
        }
        assert_eq!(cur, 0, "node {k} is not connected to the root: {parent:?}");
    }
    // No copy served two receivers at once (from the sources' own records).
    for k in 0..N {
        let mut serves = c.node(k).serve_log();
        serves.sort_by_key(|s| s.start);
        for w in serves.windows(2) {
            assert!(
                w[0].end <= w[1].start,
                "node {k} served two receivers at once: {w:?}"
            );
        }
        for s in &serves {
            assert_eq!(parent[&s.receiver], k as NodeId);
        }
    }
    // The directory's view matches: every assignment corresponds to a pull.
    let assigned: usize = (0..N).map(|k| c.node(k).shard_assignments().len()).sum();
    assert_eq!(assigned, N - 1);
}

#[test]
fn streaming_get_returns_bytes_before_the_put_finished() {
    let c = LocalCluster::start(2, cfg(1 << 30), tcp()).unwrap();
    let data = pattern(512 << 20, 3);
    let writer = c.node(0).clone();
    let reader = c.node(1).clone();
    let first_bytes_at = std::thread::scope(|s| {
        let h = s.spawn(|| {
            let mut r = reader.get_stream("stream").unwrap();
            let mut buf = vec![0u8; 1 << 20];
            r.read_exact(&mut buf).unwrap();
            let t = std::time::Instant::now();
            assert!(buf[..] == data[..1 << 20]);
            let mut rest = Vec::new();
            r.read_to_end(&mut rest).unwrap();
            assert!(rest[..] == data[1 << 20..]);
            t
        });
        std::thread::sleep(Duration::from_millis(50));
        writer.put("stream", &data).unwrap();
        let put_done = std::time::Instant::now();
        (h.join().unwrap(), put_done)
    });
    assert!(
        first_bytes_at.0 < first_bytes_at.1,
        "the reader saw its first MiB only after the put returned"
    );
}

#[test]
fn delete_then_get_is_not_found_everywhere() {
    let c = LocalCluster::start(4, cfg(256 << 20), tcp()).unwrap();
    for (name, len) in [("small", 100usize), ("large", 8 << 20)] {
        let data = pattern(len, 1);
        c.node(0).put(name, &data).unwrap();
        for k in 1..4 {
            assert!(c.node(k).get(name).unwrap() == data);
        }
        c.node(2).delete(name).unwrap();
        for k in 0..4 {
            match c.node(k).get(name) {
                Err(Error::NotFound(id)) => assert_eq!(id.as_str(), name),
                other => panic!("node {k}: {:?}", other.map(|v| v.len())),
            }
            assert!(c.node(k).local_copy(name).is_none());
        }
        assert!(c.node(0).locate(name).unwrap().is_none());
    }
}

#[test]
fn arena_exhaustion_is_an_error_and_harms_nothing() {
    let c = LocalCluster::start(2, cfg(16 << 20), tcp()).unwrap();
    let a = pattern(10 << 20, 1);
    c.node(0).put("a", &a).unwrap();
    match c.node(0).put("b", &pattern(10 << 20, 2)) {
        Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, 10 << 20),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert!(c.node(0).get("a").unwrap() == a);
    assert!(c.node(1).get("a").unwrap() == a);
    // A receiver that cannot fit the object fails cleanly too and leaves others intact.
    c.node(1).put("c", &pattern(8 << 20, 3)).unwrap();
    let before = c.node(1).arena_free();
    // "a" on node 1 is an unpinned fetched copy: evicted to make room for nothing bigger
    // than the arena.
    match c.node(0).put("huge", &pattern(17 << 20, 4)) {
        Err(Error::OutOfMemory { .. }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(c.node(1).arena_free(), before);
    assert!(c.node(0).get("a").unwrap() == a);
}

#[test]
fn eviction_withdraws_the_location() {
    let c = LocalCluster::start(2, cfg(16 << 20), tcp()).unwrap();
    let a = pattern(6 << 20, 1);
    let b = pattern(6 << 20, 2);
    c.node(0).put("a", &a).unwrap();
    assert!(c.node(1).get("a").unwrap() == a);
    c.node(0).put("b", &b).unwrap();
    // Node 1's copy of "a" is unpinned: fetching "b" and then a pinned 6 MiB put evicts it.
    assert!(c.node(1).get("b").unwrap() == b);
    c.node(1).put("c", &pattern(6 << 20, 3)).unwrap();
    let held: Vec<_> = ["a", "b"]
        .iter()
        .filter(|n| c.node(1).local_copy(**n).is_some())
        .collect();
    assert_eq!(held.len(), 1, "exactly one unpinned copy was evicted");
    std::thread::sleep(Duration::from_millis(100));
    let evicted = if held[0] == &"a" { "b" } else { "a" };
    let info = c.node(0).locate(evicted).unwrap().unwrap();
    assert!(info.locations.iter().all(|l| l.node != 1), "{info:?}");
}

#[test]
fn malformed_frame_drops_only_that_connection() {
    let c = LocalCluster::start(2, cfg(64 << 20), tcp()).unwrap();
    let data = pattern(4 << 20, 5);
    c.node(0).put("x", &data).unwrap();
    // Find node 1's port through a fresh cluster-independent path: its transport address.
    let addr = phalanx_test_addr(&c, 1);
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(&[0xde; 64]).unwrap();
    let mut buf = [0u8; 1];
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(s.read(&mut buf).unwrap_or(0), 0, "connection was dropped");
    assert!(c.node(1).transport_stats().malformed_frames >= 1);
    assert!(c.node(1).get("x").unwrap() == data, "node keeps serving");
}

fn phalanx_test_addr(c: &LocalCluster, k: usize) -> std::net::SocketAddr {
    c.node(k).listen_addr().expect("tcp node")
}

/// A get that gives up (its timeout) leaves nothing behind at the shard: the object put later
/// is not assigned to the caller that left, and the next reader gets it from its producer.
#[test]
fn an_abandoned_get_leaves_no_waiter_behind() {
    let cfg = NodeConfig {
        op_timeout: Duration::from_secs(2),
        ..cfg(64 << 20)
    };
    let c = LocalCluster::start(3, cfg, tcp()).unwrap();
    let id = "abandoned";
    let t0 = std::time::Instant::now();
    match c.node(1).get(id) {
        Err(Error::Timeout(..)) => {}
        other => panic!("expected a timeout, got {:?}", other.map(|v| v.len())),
    }
    assert!(t0.elapsed() < Duration::from_secs(10));
    let data = pattern(4 << 20, 5);
    c.node(0).put(id, &data).unwrap();
    // Node 1 left: node 2 is served (by node 0) within its own timeout.
    assert!(c.node(2).get(id).unwrap() == data);
    let info = c.node(0).locate(id).unwrap().unwrap();
    assert!(
        info.locations.iter().all(|l| l.node != 1),
        "the caller that left is not listed: {info:?}"
    );
}

#[test]
fn get_view_timeout_ends_at_its_deadline_and_leaves_nothing_behind() {
    let c = LocalCluster::start(3, cfg(64 << 20), tcp()).unwrap();
    // Nothing to find: the caller's own timeout ends the wait, not the node's op timeout.
    let t = Instant::now();
    let r = c
        .node(1)
        .get_view_timeout("later", Duration::from_millis(300));
    assert!(matches!(r, Err(Error::Timeout(..))), "{:?}", r.err());
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
    // The withdrawn lookup holds nothing: the object, put now, reaches another reader.
    let data = pattern(3 << 20, 5);
    c.node(0).put("later", &data).unwrap();
    let v = c
        .node(2)
        .get_view_timeout("later", Duration::from_secs(10))
        .unwrap();
    assert!(*v == data[..]);
    let v = c
        .node(1)
        .get_view_timeout("later", Duration::from_secs(10))
        .unwrap();
    assert!(*v == data[..]);
}

/// A medium object whose directory entry is on the node that holds it comes with the answer
/// to the lookup (no pull, no data stream); a larger one is pulled. Either way the assignment
/// ends: the reader is listed complete and the source serves nobody. With the bytes, the
/// reader sends two messages: its lookup, and the report that ends the assignment (sent
/// where the answer lands, maybe after the get returned).
#[test]
fn a_medium_object_comes_with_its_location_from_the_node_that_holds_it() {
    use phalanx::ObjectId;
    let c = LocalCluster::start(3, cfg(64 << 20), tcp()).unwrap();
    for (len, with_location) in [(65536usize, true), (100_000, true), (1 << 20, false)] {
        let id = ObjectId::homed(0, format!("medium-{len}"));
        let data = pattern(len, len as u64);
        c.node(0).put(id.clone(), &data).unwrap();
        let before = c.node(1).transport_stats();
        let got = c.node(1).get(id.clone()).unwrap();
        assert!(got == data, "{len} bytes differ");
        let after = c.node(1).transport_stats();
        let streamed = after.data_bytes_received - before.data_bytes_received;
        let expect = if with_location { 0 } else { len as u64 };
        assert_eq!(streamed, expect, "{len} bytes: data-stream bytes");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let info = c.node(2).locate(id.clone()).unwrap().expect("entry");
            let reader = info.locations.iter().find(|l| l.node == 1);
            let source = info.locations.iter().find(|l| l.node == 0).expect("source");
            if reader.is_some_and(|r| r.complete) && source.serving.is_none() {
                if with_location {
                    let sent = c.node(1).transport_stats().ctrl_sent - before.ctrl_sent;
                    assert_eq!(sent, 2, "{len} bytes: messages the reader sent");
                }
                break;
            }
            assert!(Instant::now() < deadline, "assignment not ended: {info:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
        // The reader serves the next one like any copy: node 2 reads it from 0 or 1.
        assert!(c.node(2).get(id.clone()).unwrap() == data);
        c.node(0).delete(id).unwrap();
    }
}

/// Reduces to the same target one after another, the target deleted in between: each run's
/// intermediate results have names of their own, so the deletes of one run (which go on
/// after it returned) never touch the next run's.
#[test]
fn back_to_back_reduces_to_one_target_keep_their_intermediates_apart() {
    use phalanx::{DType, ObjectId, ReduceOp};
    let c = LocalCluster::start(6, cfg(256 << 20), tcp()).unwrap();
    // 320 KiB of f32: pulled, not inline, and above `reduce_halving_max` (a tree).
    let elems = 80 << 10;
    let mut expect = vec![0f32; elems];
    let mut sources = Vec::new();
    for k in 0..6usize {
        let v: Vec<f32> = (0..elems).map(|i| (i % 97) as f32 + k as f32).collect();
        for (e, x) in expect.iter_mut().zip(&v) {
            *e += x;
        }
        let id = ObjectId::new(format!("bb-in-{k}"));
        c.node(k).put(id.clone(), bytemuck::cast_slice(&v)).unwrap();
        sources.push(id);
    }
    for round in 0..8 {
        let coord = round % 2; // both nodes 0 and 1 coordinate
        let outcome = c
            .node(coord)
            .reduce("bb-out", &sources, 6, ReduceOp::Sum, DType::F32)
            .unwrap();
        assert!(!outcome.tree.is_empty(), "a tree, with intermediates");
        let got = c.node(2 + round % 4).get("bb-out").unwrap();
        assert!(got == bytemuck::cast_slice(&expect), "round {round}");
        c.node(coord).delete("bb-out").unwrap();
    }
    // Once the deletes have run, no intermediate result is left anywhere: with the copies
    // of other nodes' inputs that tasks pulled dropped, each arena holds its own input only.
    for k in 0..6 {
        for (j, s) in sources.iter().enumerate() {
            if j != k {
                c.node(k).evict_local(s.clone());
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while (0..6).any(|k| c.node(k).arena_free() != (256 << 20) - (320 << 10)) {
        let free: Vec<u64> = (0..6).map(|k| c.node(k).arena_free()).collect();
        assert!(
            Instant::now() < deadline,
            "intermediate results left behind: free {free:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A small object (inline in the directory) read by seven nodes at once: the shard sends
/// its bytes with the answer to the first readers only (`INLINE_FANOUT` bytes in all), and
/// the others pull from copies, each new one a source, instead of all from the shard's one
/// uplink. Every reader gets the same bytes, and the readers that pulled hold copies.
#[test]
fn a_small_object_read_by_many_is_sent_inline_to_a_few_and_pulled_by_the_rest() {
    use phalanx::directory::INLINE_FANOUT;
    const N: usize = 8;
    let c = LocalCluster::start(N as u32, cfg(64 << 20), tcp()).unwrap();
    for (round, size) in [(0usize, 32usize << 10), (1, 24 << 10), (2, 1 << 10)] {
        let id = format!("small-fanout-{round}");
        let data = pattern(size, round as u64);
        let got: Vec<Vec<u8>> = std::thread::scope(|s| {
            let readers: Vec<_> = (1..N)
                .map(|k| {
                    let (n, id) = (c.node(k).clone(), id.clone());
                    s.spawn(move || n.get(id.as_str()).unwrap())
                })
                .collect();
            std::thread::sleep(Duration::from_millis(50));
            c.node(0).put(id.as_str(), &data).unwrap();
            readers.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (k, g) in got.iter().enumerate() {
            assert!(*g == data, "{size} bytes: reader {} differs", k + 1);
        }
        // Inline answers leave no copy behind; a pull does.
        let inline = (INLINE_FANOUT as usize / size).clamp(1, N - 1);
        let copies = (1..N)
            .filter(|&k| c.node(k).local_copy(id.as_str()).is_some())
            .count();
        assert_eq!(copies, N - 1 - inline, "{size} bytes: readers that pulled");
    }
}
