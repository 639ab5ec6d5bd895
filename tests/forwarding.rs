//! Medium objects forwarded as they land: readers chained on copies that are still filling
//! get every byte once, the hops write on from the thread that took the bytes in, and a
//! reader dying in the middle of such a chain leaves the others whole.

#[path = "common/log.rs"]
mod log;

use phalanx::transport::{NodeId, TcpConfig};
use phalanx::{DType, LocalCluster, NodeConfig, ObjectId, ReduceOp, ReduceOptions};
use std::time::Duration;

/// 192 KiB of i64: a medium object (forwarded as it lands).
const ELEMS: usize = 24 << 10;
const SIZE: u64 = (ELEMS * 8) as u64;

fn cfg() -> NodeConfig {
    log::from_env();
    NodeConfig {
        arena_size: 64 << 20,
        op_timeout: Duration::from_secs(30),
        ..NodeConfig::default()
    }
}

fn tcp() -> TcpConfig {
    TcpConfig {
        heartbeat_timeout: Duration::from_secs(1),
        ..TcpConfig::default()
    }
}

fn input(k: u64) -> Vec<u8> {
    (0..ELEMS as u64)
        .flat_map(|i| ((i * 7 + k * 1_000_003) as i64).to_le_bytes())
        .collect()
}

fn sum(inputs: &[Vec<u8>]) -> Vec<u8> {
    (0..ELEMS)
        .flat_map(|i| {
            let s: i64 = inputs
                .iter()
                .map(|v| i64::from_le_bytes(v[i * 8..i * 8 + 8].try_into().unwrap()))
                .sum();
            s.to_le_bytes()
        })
        .collect()
}

/// A reduce of four inputs on nodes 0 to 3 (a position each), the one on node 3 required and
/// put last: it takes the deepest position, so the root's task runs and makes the (empty)
/// target while that input is missing. Readers `readers` chain on the target meanwhile, `before_last` runs once
/// they wait, then the last input comes. Returns what each reader got (None: its get failed)
/// and the expected bytes.
fn chained_readers(
    c: &LocalCluster,
    name: &str,
    readers: &[usize],
    before_last: impl FnOnce(),
) -> (Vec<Option<Vec<u8>>>, Vec<u8>) {
    const N: usize = 4;
    let ids: Vec<ObjectId> = (0..N)
        .map(|k| ObjectId::homed(0, format!("{name}-in-{k}")))
        .collect();
    let target = ObjectId::homed(0, format!("{name}-out"));
    let data: Vec<Vec<u8>> = (0..N).map(|k| input(k as u64 + 1)).collect();
    let expect = sum(&data);
    let late = N - 1;
    let got = std::thread::scope(|s| {
        let h = c
            .node(0)
            .reduce_start(
                target.clone(),
                ids.clone(),
                N,
                ReduceOp::Sum,
                DType::I64,
                ReduceOptions {
                    degree: Some(2),
                    required: vec![ids[late].clone()],
                    ..Default::default()
                },
            )
            .unwrap();
        for k in 0..late {
            c.node(k).put(ids[k].clone(), &data[k]).unwrap();
        }
        // The root's task has made the (empty) target; readers line up on it.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while c.node(readers[0]).locate(target.clone()).unwrap().is_none() {
            assert!(std::time::Instant::now() < deadline, "no target");
            std::thread::sleep(Duration::from_millis(5));
        }
        let hs: Vec<_> = readers
            .iter()
            .map(|&k| {
                let node = c.node(k).clone();
                let t = target.clone();
                s.spawn(move || node.get(t).ok())
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        before_last();
        c.node(late).put(ids[late].clone(), &data[late]).unwrap();
        let got: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        h.wait().unwrap();
        got
    });
    (got, expect)
}

#[test]
fn readers_chained_on_a_filling_copy_forward_it_as_it_lands() {
    let c = LocalCluster::start(8, cfg(), tcp()).unwrap();
    let readers = [4, 5, 6, 7];
    let (got, expect) = chained_readers(&c, "fw", &readers, || {});
    for (k, g) in readers.iter().zip(&got) {
        assert!(g.as_ref() == Some(&expect), "reader {k} got other bytes");
    }
    let target = ObjectId::homed(0, "fw-out");
    // Every reader pulled the object once, whole, from one source (the pull's record is
    // written as its driver ends, which may be a moment after the reader saw its copy
    // complete).
    for &k in &readers {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let log = loop {
            let log: Vec<_> = c
                .node(k)
                .transfer_log()
                .into_iter()
                .filter(|t| t.id == target)
                .collect();
            if !log.is_empty() || std::time::Instant::now() >= deadline {
                break log;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        assert_eq!(log.len(), 1, "node {k}: {log:?}");
        assert!(log[0].ok && log[0].bytes == SIZE, "node {k}: {log:?}");
    }
    // Every serve of the target wrote it whole, once; the readers' copies, which were
    // still filling when the next reader asked, wrote it on as it landed. (A serve's record
    // is written as its worker ends, which may be a moment after its receiver is done.)
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let serves = loop {
        let serves: Vec<_> = c
            .nodes
            .iter()
            .flat_map(|n| n.serve_log())
            .filter(|s| s.id == target)
            .collect();
        if serves.len() >= readers.len() || std::time::Instant::now() >= deadline {
            break serves;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(serves.len(), readers.len(), "{serves:?}");
    for s in &serves {
        assert_eq!(s.bytes, SIZE, "{s:?}");
        assert!(s.forwarded <= s.bytes, "{s:?}");
    }
    let by_readers: Vec<_> = serves
        .iter()
        .filter(|s| readers.contains(&(s.source as usize)))
        .collect();
    assert!(
        !by_readers.is_empty(),
        "no reader served another: {serves:?}"
    );
    let forwarded: u64 = by_readers.iter().map(|s| s.forwarded).sum();
    assert!(
        forwarded > 0,
        "no reader forwarded a byte as it landed: {by_readers:?}"
    );
    // No assignment is left open.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let info = c.node(0).locate(target.clone()).unwrap().unwrap();
        if info.locations.iter().all(|l| l.serving.is_none()) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "an assignment stayed open: {info:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_reader_dying_in_a_forwarding_chain_leaves_the_others_whole() {
    let c = LocalCluster::start(8, cfg(), tcp()).unwrap();
    let readers = [4, 5, 6, 7];
    let victim: NodeId = 5;
    let (got, expect) = chained_readers(&c, "fk", &readers, || {
        c.node(victim as usize).kill();
    });
    for (k, g) in readers.iter().zip(&got) {
        if *k == victim as usize {
            continue;
        }
        assert!(g.as_ref() == Some(&expect), "reader {k} got other bytes");
    }
    // The survivors hold complete, correct copies that serve further readers.
    assert!(c.node(6).get(ObjectId::homed(0, "fk-out")).unwrap() == expect);
}
