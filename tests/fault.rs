//! Fault tolerance over real TCP on loopback: sources dying mid-broadcast, resume from the
//! receiver's watermark, restart and rejoin.

#[path = "common/log.rs"]
mod log;

use phalanx::transport::{NodeId, TcpConfig};
use phalanx::{FaultAction, FaultPlan, LocalCluster, Node, NodeConfig, ObjectId};
use rand::{Rng, SeedableRng};
use std::time::{Duration, Instant};

const SIZE: usize = 64 << 20;

fn cfg() -> NodeConfig {
    log::from_env();
    NodeConfig {
        arena_size: 256 << 20,
        op_timeout: Duration::from_secs(60),
        ..NodeConfig::default()
    }
}

fn tcp() -> TcpConfig {
    TcpConfig {
        heartbeat_timeout: Duration::from_secs(1),
        ..TcpConfig::default()
    }
}

fn pattern(seed: u64) -> Vec<u8> {
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    let mut v = vec![0u8; SIZE];
    r.fill(&mut v[..]);
    v
}

/// An object name whose directory shard is `shard` (so the victims never hold it).
fn name_on(node: &Node, prefix: &str, shard: NodeId) -> ObjectId {
    (0..)
        .map(|i| ObjectId::new(format!("{prefix}-{i}")))
        .find(|n| node.shard_of(n.clone()) == shard)
        .unwrap()
}

/// No two nodes ever pulled from each other at overlapping times.
fn assert_no_mutual_feeding(c: &LocalCluster, id: &ObjectId) {
    let pulls: Vec<_> = c
        .nodes
        .iter()
        .flat_map(|n| n.transfer_log())
        .filter(|t| t.id == *id)
        .collect();
    for a in &pulls {
        for b in &pulls {
            if a.receiver == b.source && a.source == b.receiver {
                let overlap = a.start < b.end && b.start < a.end;
                assert!(
                    !overlap,
                    "{} and {} fed each other: {a:?} {b:?}",
                    a.receiver, b.receiver
                );
            }
        }
    }
}

/// Every byte a live receiver holds arrived once: pulls add up to the size, resumed pulls
/// start where the failed one stopped, and the transport saw at most one extra object.
fn assert_resumed_exactly(n: &Node, id: &ObjectId) -> bool {
    let log: Vec<_> = n
        .transfer_log()
        .into_iter()
        .filter(|t| t.id == *id)
        .collect();
    let total: u64 = log.iter().map(|t| t.bytes).sum();
    assert_eq!(total, SIZE as u64, "node {}: pulls {log:?}", n.id());
    for w in log.windows(2) {
        assert_eq!(
            w[1].from,
            w[0].from + w[0].bytes,
            "node {} resumed at the wrong offset",
            n.id()
        );
    }
    let received = n.transport_stats().data_bytes_received;
    assert!(
        received <= 2 * SIZE as u64,
        "node {} received {received} bytes",
        n.id()
    );
    log.len() > 1
}

fn broadcast_with(
    c: &LocalCluster,
    id: &ObjectId,
    data: &[u8],
    seed: u64,
    during: impl FnOnce() + Send,
) -> (Vec<Option<Instant>>, Instant) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let delays: Vec<u64> = (0..c.nodes.len())
        .map(|k| k as u64 * 12 + rng.gen_range(0..6))
        .collect();
    let t0 = Instant::now();
    let done = std::thread::scope(|s| {
        let hs: Vec<_> = (1..c.nodes.len())
            .map(|k| {
                let node = c.node(k).clone();
                let delay = delays[k];
                let id = id.clone();
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(delay));
                    let got = node.get(id).ok()?;
                    assert!(got == data, "node {k} got different bytes");
                    Some(Instant::now())
                })
            })
            .collect();
        c.node(0).put(id.clone(), data).unwrap();
        during();
        let mut done = vec![Some(Instant::now())];
        done.extend(hs.into_iter().map(|h| h.join().unwrap()));
        done
    });
    (done, t0)
}

#[test]
fn broadcast_survives_an_inner_node_dying_mid_transfer() {
    for seed in 1..=3u64 {
        let data = pattern(seed);
        // The same broadcast without a failure, for the timing comparison.
        let base = {
            let c = LocalCluster::start(8, cfg(), tcp()).unwrap();
            let id = name_on(c.node(0), &format!("ft-base-{seed}"), 7);
            let (done, t0) = broadcast_with(&c, &id, &data, seed, || {});
            done.iter().flatten().max().unwrap().duration_since(t0)
        };
        let c = LocalCluster::start(8, cfg(), tcp()).unwrap();
        let id = name_on(c.node(0), &format!("ft-inner-{seed}"), 7);
        // Node 1 arrives first and pulls from the putter; as the copy preferred right after
        // the putter's, it serves a later receiver whatever the machine's speed.
        let victim = 1;
        c.node(victim).inject_fault(FaultPlan {
            object: id.clone(),
            after_bytes: (8 + 4 * seed) << 20,
            action: FaultAction::DropLinks,
        });
        let (done, t0) = broadcast_with(&c, &id, &data, seed, || {});
        let killed_at = c.node(victim).fault_fired_at();
        assert!(
            killed_at.is_some(),
            "seed {seed}: node {victim} never served"
        );
        let mut resumed = 0;
        for (k, d) in done.iter().enumerate().skip(1) {
            if k == victim {
                continue;
            }
            assert!(d.is_some(), "seed {seed}: live receiver {k} did not finish");
            resumed += assert_resumed_exactly(c.node(k), &id) as usize;
        }
        assert!(resumed >= 1, "seed {seed}: nobody had to resume");
        assert_no_mutual_feeding(&c, &id);
        let last = *done.iter().flatten().max().unwrap();
        println!(
            "seed {seed}: kill at {:.1} ms, last live receiver done {:.1} ms after the kill; whole broadcast {:.1} ms (without a failure {:.1} ms)",
            killed_at.unwrap().duration_since(t0).as_secs_f64() * 1e3,
            last.duration_since(killed_at.unwrap()).as_secs_f64() * 1e3,
            last.duration_since(t0).as_secs_f64() * 1e3,
            base.as_secs_f64() * 1e3
        );
    }
}

#[test]
fn broadcast_survives_the_putter_dying_after_one_complete_copy() {
    for seed in 1..=3u64 {
        let c = LocalCluster::start(8, cfg(), tcp()).unwrap();
        let id = name_on(c.node(0), &format!("ft-root-{seed}"), 5);
        let data = pattern(seed + 10);
        let (done, _) = broadcast_with(&c, &id, &data, seed, || {
            // Once some receiver holds a complete copy, the putter dies.
            let deadline = Instant::now() + Duration::from_secs(30);
            while !(1..8).any(|k| {
                c.node(k)
                    .local_copy(id.clone())
                    .is_some_and(|i| i.watermark == SIZE as u64)
            }) {
                assert!(Instant::now() < deadline);
                std::thread::sleep(Duration::from_millis(1));
            }
            c.node(0).kill();
        });
        for (k, d) in done.iter().enumerate().skip(1) {
            assert!(d.is_some(), "seed {seed}: receiver {k} did not finish");
            assert_resumed_exactly(c.node(k), &id);
        }
        assert_no_mutual_feeding(&c, &id);
    }
}

#[test]
fn a_restarted_node_rejoins_and_its_get_completes() {
    let mut c = LocalCluster::start(6, cfg(), tcp()).unwrap();
    let id = name_on(c.node(0), "ft-rejoin", 4);
    let data = pattern(77);
    c.node(0).put(id.clone(), &data).unwrap();
    // Node 3 is killed while it receives, then restarted as a new process would be.
    c.node(1).inject_fault(FaultPlan {
        object: id.clone(),
        after_bytes: 16 << 20,
        action: FaultAction::DropLinks,
    });
    let n3 = c.node(3).clone();
    let id3 = id.clone();
    let h = std::thread::spawn(move || n3.get(id3));
    let deadline = Instant::now() + Duration::from_secs(30);
    while c
        .node(3)
        .local_copy(id.clone())
        .is_none_or(|i| i.watermark < 8 << 20)
    {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    c.node(3).kill();
    assert!(
        h.join().unwrap().is_err(),
        "the killed incarnation's get cannot succeed"
    );
    c.restart(3, cfg(), tcp()).unwrap();
    let others: Vec<_> = [2usize, 5]
        .iter()
        .map(|&k| {
            let n = c.node(k).clone();
            let id = id.clone();
            std::thread::spawn(move || n.get(id).unwrap())
        })
        .collect();
    assert!(
        c.node(3).get(id.clone()).unwrap() == data,
        "rejoined node got different bytes"
    );
    for h in others {
        assert!(h.join().unwrap() == data);
    }
    // The new incarnation serves others too.
    let info = c.node(0).locate(id.clone()).unwrap().unwrap();
    assert!(
        info.locations.iter().any(|l| l.node == 3 && l.complete),
        "{info:?}"
    );
}

/// A reduce target name whose directory entry is not on `victim`. (The intermediates of a
/// reduce have theirs on the coordinator, node 0 in these tests, never the victim.)
fn target_avoiding(node: &Node, prefix: &str, victim: NodeId) -> String {
    assert_ne!(victim, 0, "node 0 coordinates");
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .find(|t| node.shard_of(t.as_str()) != victim)
        .unwrap()
}

/// Waits (at most 20 s) until `node`'s injected fault has fired.
fn wait_for_fault(node: &Node) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !node.fault_fired() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn i64_input(k: u64, elems: usize) -> Vec<u8> {
    (0..elems as u64)
        .flat_map(|i| ((i * 7 + k * 1000) as i64).to_le_bytes())
        .collect()
}

fn sum_of(inputs: &[&Vec<u8>]) -> Vec<u8> {
    let mut acc = inputs[0].clone();
    for v in &inputs[1..] {
        phalanx::ops::combine(phalanx::ReduceOp::Sum, phalanx::DType::I64, &mut acc, v);
    }
    acc
}

#[test]
fn reduce_replaces_a_dead_input_and_recomputes_only_its_ancestors() {
    // 16 MiB of i64, the victim failing after 4 MiB.
    replaces_a_dead_input(2 << 20, 4 << 20, "rf");
}

/// The same with medium objects, whose outputs are combined where their inputs land (on the
/// transport threads, `reduce/task.rs`): the parent of the dead position hears of its
/// input's failure there, and the tree is repaired as for large objects.
#[test]
fn a_medium_reduce_replaces_a_dead_input_combined_where_it_landed() {
    // 128 KiB of i64, the victim failing after 32 KiB.
    replaces_a_dead_input(16 << 10, 32 << 10, "rm");
}

/// A chain reduce of 7 of 8 inputs of `elems` i64 whose inner position dies after serving
/// `after_bytes` (3 seeds, 3 positions): the spare replaces exactly the dead input, the
/// result is the sum of the inputs used, and only the failed position and its ancestors ran
/// again.
fn replaces_a_dead_input(elems: usize, after_bytes: u64, prefix: &str) {
    use phalanx::{DType, ReduceOp, ReduceOptions};
    for seed in 0..3u64 {
        let c = LocalCluster::start(8, cfg(), tcp()).unwrap();
        // A chain (d = 1) in arrival order 0..7: input k sits at position 6-k; 7 is the spare.
        let victim = 2 + seed as usize; // an inner position
                                        // Directory shards are not replicated: keep every entry this reduce needs off the
                                        // victim (the inputs, the target and the intermediates of every generation).
        let shard_for = |k: usize| {
            if (k + 1) % 8 == victim {
                (victim + 1) % 8
            } else {
                (k + 1) % 8
            }
        };
        let ids: Vec<ObjectId> = (0..8)
            .map(|k| {
                let name = format!("{prefix}-{seed}-{k}");
                name_on(c.node(0), &name, shard_for(k) as NodeId)
            })
            .collect();
        let out = format!("{prefix}-out-{seed}");
        let target = target_avoiding(c.node(0), &out, victim as NodeId);
        let data: Vec<Vec<u8>> = (0..8).map(|k| i64_input(k + seed, elems)).collect();
        c.node(victim).inject_fault(FaultPlan {
            object: ObjectId::new("*"),
            after_bytes,
            action: FaultAction::DropLinks,
        });
        let outcome = std::thread::scope(|s| {
            let coord = c.node(0).clone();
            let ids2 = ids.clone();
            let t = target.clone();
            let h = s.spawn(move || {
                coord.reduce_with(
                    t.as_str(),
                    &ids2,
                    7,
                    ReduceOp::Sum,
                    DType::I64,
                    &ReduceOptions {
                        degree: Some(1),
                        ..Default::default()
                    },
                )
            });
            // One after another, each listed by the directory before the next is put (a put
            // returns once its announcement is sent), so that the coordinator hears of
            // them in this order on a loaded host too; the first once the coordinator has
            // had time to ask for them all (inputs already there when it asks are answered
            // in no set order).
            std::thread::sleep(Duration::from_millis(200));
            for k in 0..8 {
                c.node(k).put(ids[k].clone(), &data[k]).unwrap();
                let deadline = Instant::now() + Duration::from_secs(30);
                while !matches!(c.node(0).locate(ids[k].clone()), Ok(Some(i)) if !i.locations.is_empty())
                {
                    assert!(Instant::now() < deadline, "{} never listed", ids[k]);
                    std::thread::sleep(Duration::from_millis(1));
                }
                std::thread::sleep(Duration::from_millis(15));
            }
            h.join().unwrap().unwrap()
        });
        assert!(
            c.node(victim).fault_fired(),
            "seed {seed}: the victim never served"
        );
        let mut used = outcome.used.clone();
        used.sort();
        let mut want: Vec<ObjectId> = ids
            .iter()
            .enumerate()
            .filter(|(k, _)| *k != victim)
            .map(|(_, i)| i.clone())
            .collect();
        want.sort();
        assert_eq!(
            used, want,
            "seed {seed}: the spare replaced exactly the dead input"
        );
        let got = c.node(1).get(target.as_str()).unwrap();
        let inputs: Vec<&Vec<u8>> = (0..8).filter(|&k| k != victim).map(|k| &data[k]).collect();
        assert!(
            got == sum_of(&inputs),
            "seed {seed}: result is not the sum of the 7 used inputs"
        );
        // The failed position ran again; besides it only ancestors (those already started)
        // did; the subtree below kept its work. In a chain the ancestors of p are 0..p.
        let failed_pos = 6 - victim;
        assert!(
            outcome.recomputed.contains(&failed_pos),
            "seed {seed}: {:?}",
            outcome.recomputed
        );
        assert!(
            outcome.recomputed.iter().all(|&p| p <= failed_pos),
            "seed {seed}: a descendant was recomputed: {:?}",
            outcome.recomputed
        );
    }
}

/// The root of a reduce dies while a reader streams the target from it: the coordinator
/// resets the target (its bytes included the dead input) and recomputes it with the spare;
/// the reader, whose partial copy was dropped, ends with exactly the new result. On a loaded
/// host the root may finish before it has served the reader the bytes that trigger its
/// death (seen once in CI): the reduce is then over when the root dies, the target's only
/// copy goes with it, and the reader is rightly told it is lost. That attempt staged
/// something else: again, on a fresh cluster, up to three times.
#[test]
fn a_reader_of_a_reduce_target_gets_the_recomputed_result_when_the_root_dies() {
    for attempt in 0..3 {
        if root_dies_while_serving_a_reader() {
            return;
        }
        println!("attempt {attempt}: the root finished before it died; again");
    }
    panic!("the root finished before it died in three attempts");
}

/// One attempt of the test above: whether the root died before it finished (checked either
/// way).
fn root_dies_while_serving_a_reader() -> bool {
    use phalanx::{DType, Error, ReduceOp, ReduceOptions};
    let c = LocalCluster::start(6, cfg(), tcp()).unwrap();
    let elems = 2 << 20; // 16 MiB of i64
    let victim: NodeId = 4;
    // Chain in arrival order: inputs 0, 1, 2 on nodes 1, 2, 3, the root input 3 on node 4,
    // the spare 4 on node 5. No directory entry of this reduce lives on the victim.
    let ids: Vec<ObjectId> = (0..5)
        .map(|k| name_on(c.node(0), &format!("rr-in-{k}"), 0))
        .collect();
    let target = target_avoiding(c.node(0), "rr-out", victim);
    let data: Vec<Vec<u8>> = (0..5).map(|k| i64_input(k + 40, elems)).collect();
    c.node(victim as usize).inject_fault(FaultPlan {
        object: ObjectId::new(target.as_str()),
        after_bytes: 4 << 20,
        action: FaultAction::DropLinks,
    });
    let (outcome, read) = std::thread::scope(|s| {
        let h = c
            .node(0)
            .reduce_start(
                target.as_str(),
                ids.clone(),
                4,
                ReduceOp::Sum,
                DType::I64,
                ReduceOptions {
                    degree: Some(1),
                    ..Default::default()
                },
            )
            .unwrap();
        let reader = c.node(1).clone();
        let t = target.clone();
        let r = s.spawn(move || reader.get(t.as_str()));
        for k in 0..4 {
            let put = c.node(k + 1).put(ids[k].clone(), &data[k]);
            // The victim may die while its own put still streams (the root serves at once).
            assert!(put.is_ok() || k + 1 == victim as usize, "{put:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
        // The spare becomes ready only once the root has died serving the reader.
        wait_for_fault(c.node(victim as usize));
        c.node(5).put(ids[4].clone(), &data[4]).unwrap();
        (h.wait().unwrap(), r.join().unwrap())
    });
    assert!(
        c.node(victim as usize).fault_fired(),
        "the root never served the reader"
    );
    if outcome.recomputed.is_empty() {
        // The root had finished: the reduce was over, and its only copy died with it.
        assert!(
            matches!(read, Err(Error::ObjectLost(_))),
            "{:?}",
            read.err()
        );
        return false;
    }
    let read = read.unwrap();
    assert!(outcome.recomputed.contains(&0), "{:?}", outcome.recomputed);
    let mut used = outcome.used.clone();
    used.sort();
    let mut want = vec![
        ids[0].clone(),
        ids[1].clone(),
        ids[2].clone(),
        ids[4].clone(),
    ];
    want.sort();
    assert_eq!(used, want, "the spare replaced the root's input");
    let expect = sum_of(&[&data[0], &data[1], &data[2], &data[4]]);
    assert!(
        read == expect,
        "the reader's bytes are not the recomputed result"
    );
    assert!(c.node(2).get(target.as_str()).unwrap() == expect);
    true
}

/// A composed reduce (the parameter server's `model' = model + gradients`) whose upstream
/// root dies while the downstream reduce reads the partial upstream result: the upstream
/// target is reset and recomputed with a spare, the downstream reduce drops what it read and
/// ends with the sum over the new upstream result.
#[test]
fn a_downstream_reduce_follows_its_recomputed_upstream_target() {
    use phalanx::{DType, ReduceOp, ReduceOptions};
    let c = LocalCluster::start(6, cfg(), tcp()).unwrap();
    let elems = 2 << 20; // 16 MiB of i64
    let victim: NodeId = 3;
    let a: Vec<ObjectId> = (0..4)
        .map(|k| name_on(c.node(0), &format!("ud-a{k}"), 0))
        .collect();
    let b = name_on(c.node(0), "ud-b", 0);
    let up = target_avoiding(c.node(0), "ud-up", victim);
    let down = target_avoiding(c.node(0), "ud-down", victim);
    let data: Vec<Vec<u8>> = (0..5).map(|k| i64_input(k + 70, elems)).collect();
    c.node(victim as usize).inject_fault(FaultPlan {
        object: ObjectId::new(up.as_str()),
        after_bytes: 4 << 20,
        action: FaultAction::DropLinks,
    });
    let chain = |required: Vec<ObjectId>| ReduceOptions {
        degree: Some(1),
        required,
        ..Default::default()
    };
    let coord = c.node(0);
    let upstream = coord
        .reduce_start(
            up.as_str(),
            a.clone(),
            3,
            ReduceOp::Sum,
            DType::I64,
            chain(vec![]),
        )
        .unwrap();
    let down_sources = vec![ObjectId::new(up.as_str()), b.clone()];
    let downstream = coord
        .reduce_start(
            down.as_str(),
            down_sources,
            2,
            ReduceOp::Sum,
            DType::I64,
            chain(vec![ObjectId::new(up.as_str())]),
        )
        .unwrap();
    // b first, so the downstream root (which reads `up`) is b's node 4; then a0..a2 on nodes
    // 1..3 (a2, the upstream root, on the victim); the spare a3 on node 5 comes later.
    c.node(4).put(b.clone(), &data[4]).unwrap();
    for k in 0..3 {
        let put = c.node(k + 1).put(a[k].clone(), &data[k]);
        assert!(put.is_ok() || k + 1 == victim as usize, "{put:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    wait_for_fault(c.node(victim as usize));
    c.node(5).put(a[3].clone(), &data[3]).unwrap();
    let u = upstream.wait().unwrap();
    let d = downstream.wait().unwrap();
    assert!(
        c.node(victim as usize).fault_fired(),
        "the upstream root never served"
    );
    let mut used = u.used.clone();
    used.sort();
    let mut want = vec![a[0].clone(), a[1].clone(), a[3].clone()];
    want.sort();
    assert_eq!(used, want, "the spare replaced the dead root's input");
    assert!(u.recomputed.contains(&0), "{:?}", u.recomputed);
    assert!(
        d.recomputed.contains(&0),
        "the downstream root ran again: {:?}",
        d.recomputed
    );
    let expect = sum_of(&[&data[0], &data[1], &data[3], &data[4]]);
    assert!(
        c.node(2).get(down.as_str()).unwrap() == expect,
        "down != a0 + a1 + a3 + b"
    );
}

#[test]
fn reduce_waits_for_a_rejoin_when_too_few_inputs_remain() {
    use phalanx::{DType, Error, ReduceOp, ReduceOptions};
    let mut c = LocalCluster::start(4, cfg(), tcp()).unwrap();
    let elems = 1 << 20;
    let ids: Vec<ObjectId> = (0..4).map(|k| ObjectId::new(format!("rj-{k}"))).collect();
    let data: Vec<Vec<u8>> = (0..4).map(|k| i64_input(k, elems)).collect();
    for k in 0..4 {
        c.node(k).put(ids[k].clone(), &data[k]).unwrap();
    }
    // Without a rejoin, the timeout turns the wait into an error.
    c.node(3).kill();
    let short = ReduceOptions {
        timeout: Some(Duration::from_secs(2)),
        ..Default::default()
    };
    match c
        .node(0)
        .reduce_with("rj-none", &ids, 4, ReduceOp::Sum, DType::I64, &short)
    {
        Err(Error::Timeout(..)) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
    // With one: node 3 restarts and puts its input again; the reduce completes.
    let coord = c.node(0).clone();
    let ids2 = ids.clone();
    let h = std::thread::spawn(move || {
        coord.reduce_with(
            "rj-out",
            &ids2,
            4,
            ReduceOp::Sum,
            DType::I64,
            &ReduceOptions::default(),
        )
    });
    std::thread::sleep(Duration::from_millis(300));
    c.restart(3, cfg(), tcp()).unwrap();
    c.node(3).put(ids[3].clone(), &data[3]).unwrap();
    let o = h.join().unwrap().unwrap();
    assert_eq!(o.used.len(), 4);
    let all: Vec<&Vec<u8>> = data.iter().collect();
    assert!(c.node(2).get("rj-out").unwrap() == sum_of(&all));
}

/// A small input keeps its bytes in the directory (its entry's shard lives on) when the node
/// that put it dies: a reduce that had placed it places it again with those bytes and
/// completes, where it waited for the input to be put again until the op timeout.
#[test]
fn a_small_input_whose_node_dies_mid_reduce_is_combined_from_the_directory() {
    use phalanx::{DType, ReduceOp, ReduceOptions};
    let c = LocalCluster::start(4, cfg(), tcp()).unwrap();
    let elems = 128; // 1 KiB of i64: inline
    let ids: Vec<ObjectId> = (0..4)
        .map(|k| name_on(c.node(0), &format!("small-{k}"), 2))
        .collect();
    let data: Vec<Vec<u8>> = (0..4).map(|k| i64_input(k, elems)).collect();
    for k in 0..3 {
        c.node(k).put(ids[k].clone(), &data[k]).unwrap();
    }
    let short = ReduceOptions {
        timeout: Some(Duration::from_secs(10)),
        ..Default::default()
    };
    let coord = c.node(0).clone();
    let ids2 = ids.clone();
    let h = std::thread::spawn(move || {
        coord.reduce_with("small-out", &ids2, 4, ReduceOp::Sum, DType::I64, &short)
    });
    // Inputs 0..3 placed (the reduce waits for the fourth); node 1, which put input 1, dies.
    std::thread::sleep(Duration::from_millis(200));
    c.node(1).kill();
    std::thread::sleep(Duration::from_millis(100));
    c.node(3).put(ids[3].clone(), &data[3]).unwrap();
    let o = h.join().unwrap().expect("the reduce completes");
    assert_eq!(o.used.len(), 4, "input 1 is used, from the directory");
    let all: Vec<&Vec<u8>> = data.iter().collect();
    assert!(c.node(2).get("small-out").unwrap() == sum_of(&all));
}

#[test]
fn a_dead_shard_hands_its_entries_to_the_next_node() {
    let c = LocalCluster::start(4, cfg(), tcp()).unwrap();
    let old = name_on(c.node(0), "shard-old", 3);
    let new = name_on(c.node(0), "shard-new", 3);
    let small = name_on(c.node(0), "shard-small", 3);
    let a: Vec<u8> = (0..(8 << 20)).map(|i| (i % 251) as u8).collect();
    c.node(0).put(old.clone(), &a).unwrap();
    assert!(c.node(1).get(old.clone()).unwrap() == a);
    c.node(0).put(small.clone(), b"tiny").unwrap();
    c.node(3).kill();
    let deadline = Instant::now() + Duration::from_secs(10);
    while (0..3).any(|k| c.node(k).shard_of(new.clone()) == 3) {
        assert!(Instant::now() < deadline, "the death was not noticed");
        std::thread::sleep(Duration::from_millis(10));
    }
    // New objects whose shard was the dead node work at once...
    let b: Vec<u8> = (0..(4 << 20)).map(|i| (i % 241) as u8).collect();
    c.node(1).put(new.clone(), &b).unwrap();
    assert!(c.node(2).get(new).unwrap() == b);
    // ...and the holders of older ones republished them to the new owner.
    assert!(c.node(2).get(old).unwrap() == a);
    assert_eq!(c.node(2).get(small).unwrap(), b"tiny");
}

/// A name homed on a node keeps its entry there; when the home dies the entries move to the
/// hashed owner among the living (the holders republish there), and a small and a large object
/// homed on the dead node are still found by a reader.
#[test]
fn a_dead_home_hands_its_entries_to_a_living_node() {
    let c = LocalCluster::start(4, cfg(), tcp()).unwrap();
    let small = ObjectId::homed(3, "homed-small");
    let large = ObjectId::homed(3, "homed-large");
    for k in 0..4 {
        assert_eq!(c.node(k).shard_of(small.clone()), 3);
        assert_eq!(c.node(k).home_shard(large.clone()), 3);
    }
    let a: Vec<u8> = (0..(8 << 20)).map(|i| (i % 251) as u8).collect();
    c.node(0).put(small.clone(), b"tiny").unwrap();
    c.node(1).put(large.clone(), &a).unwrap();
    // The entries live on node 3: it answers the lookups.
    assert_eq!(c.node(2).get(small.clone()).unwrap(), b"tiny");
    assert!(c.node(2).get(large.clone()).unwrap() == a);
    c.node(3).kill();
    let deadline = Instant::now() + Duration::from_secs(10);
    while (0..3).any(|k| c.node(k).shard_of(small.clone()) == 3) {
        assert!(Instant::now() < deadline, "the death was not noticed");
        std::thread::sleep(Duration::from_millis(10));
    }
    let moved = c.node(0).shard_of(small.clone());
    assert!(moved < 3);
    assert!(
        (0..3).all(|k| c.node(k).shard_of(small.clone()) == moved),
        "one new owner"
    );
    // A node that never read them finds both at the new owner.
    let c2 = c.node(0);
    assert_eq!(c2.get(small).unwrap(), b"tiny");
    assert!(c2.get(large).unwrap() == a);
}

/// A delete is remembered by the entry's next owner: when the node that owned the entry of a
/// deleted object dies, a reader of it is told "not found" at the new owner within the
/// failure detection, not left waiting its op timeout as for an object never put; and an
/// object put again after its delete is found there.
#[test]
fn a_delete_outlives_the_death_of_the_entrys_owner() {
    let c = LocalCluster::start(4, cfg(), tcp()).unwrap();
    let gone = ObjectId::homed(3, "deleted-then-home-dies");
    let again = ObjectId::homed(3, "deleted-then-put-again");
    let data: Vec<u8> = pattern(21)[..(1 << 20)].to_vec();
    for id in [&gone, &again] {
        c.node(0).put(id.clone(), &data).unwrap();
        assert!(c.node(1).get(id.clone()).unwrap() == data);
        c.node(2).delete(id.clone()).unwrap();
    }
    c.node(1).put(again.clone(), b"again").unwrap();
    assert_eq!(c.node(2).get(again.clone()).unwrap(), b"again");
    c.node(3).kill();
    let t = Instant::now();
    let got = c.node(2).get(gone.clone());
    assert!(
        matches!(got, Err(phalanx::Error::NotFound(_))),
        "after {:?}: {got:?}",
        t.elapsed()
    );
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert_eq!(c.node(0).get(again).unwrap(), b"again");
}

/// A pull that no thread drives (a get with a deadline, a reduce task's input) whose source
/// stops sending while staying up is noticed by the lack of progress: after the op timeout
/// it gets a driver, which cancels the stream and resumes at the watermark, here from the
/// same source once it serves again. The caller that waited gave up at the same timeout; the
/// copy completes in the background, every byte once and in order, for the next get.
#[test]
fn a_pull_whose_source_stalls_resumes_at_the_watermark_after_the_op_timeout() {
    const LEN: usize = 4 << 20;
    const STALL_AT: u64 = 1 << 20;
    let op_timeout = Duration::from_millis(800);
    let cfg = NodeConfig {
        op_timeout,
        ..cfg()
    };
    let c = LocalCluster::start(2, cfg, tcp()).unwrap();
    let id = name_on(c.node(0), "stalled", 0);
    let data: Vec<u8> = pattern(11)[..LEN].to_vec();
    c.node(0).put(id.clone(), &data).unwrap();
    c.node(0).inject_fault(FaultPlan {
        object: id.clone(),
        after_bytes: STALL_AT,
        action: FaultAction::Stall,
    });
    let t0 = Instant::now();
    match c
        .node(1)
        .get_view_timeout(id.clone(), Duration::from_secs(30))
    {
        Ok(v) => assert!(v[..] == data[..], "the bytes differ"),
        Err(phalanx::Error::Timeout(..)) => {}
        Err(e) => panic!("{e}"),
    }
    assert!(c.node(0).fault_fired(), "the source stalled");
    // The copy left here completes without another request.
    let deadline = Instant::now() + Duration::from_secs(20);
    let log = loop {
        let log: Vec<_> = c
            .node(1)
            .transfer_log()
            .into_iter()
            .filter(|t| t.id == id)
            .collect();
        if log.iter().any(|t| t.ok) || Instant::now() > deadline {
            break log;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = t0.elapsed();
    assert!(
        took >= op_timeout,
        "complete after {took:?}: before a stall could be noticed"
    );
    assert_eq!(log.len(), 2, "one stalled pull, one resumed: {log:?}");
    assert!(
        !log[0].ok && log[0].from == 0 && log[0].bytes == STALL_AT,
        "{log:?}"
    );
    assert!(log[1].ok && log[1].from == STALL_AT, "{log:?}");
    assert_eq!(log[1].bytes, LEN as u64 - STALL_AT);
    let got = c.node(1).get_view(id.clone()).unwrap();
    assert!(got[..] == data[..], "the bytes differ");
    assert_eq!(
        c.node(1)
            .transfer_log()
            .iter()
            .filter(|t| t.id == id)
            .count(),
        2,
        "no new pull"
    );
}

/// A reader chained on a copy that stops filling: node 1 pulls from node 0, which stalls;
/// node 2 is sent to node 1's partial copy, which node 1 forwards as it lands with no worker
/// for that serve. Both pulls stall until the op timeout: node 1 resumes from node 0, node
/// 2 cancels its stream, and the serve without a worker is then ended by one (or its bytes
/// finish arriving first). Both readers end with every byte, whatever the order.
#[test]
fn a_stalled_chain_of_forwarded_readers_recovers() {
    const LEN: usize = 200 << 10;
    let op_timeout = Duration::from_millis(800);
    let cfg = NodeConfig {
        op_timeout,
        ..cfg()
    };
    let c = LocalCluster::start(3, cfg, tcp()).unwrap();
    let id = name_on(c.node(0), "chained-stall", 0);
    let data: Vec<u8> = pattern(12)[..LEN].to_vec();
    c.node(0).put(id.clone(), &data).unwrap();
    c.node(0).inject_fault(FaultPlan {
        object: id.clone(),
        after_bytes: 64 << 10,
        action: FaultAction::Stall,
    });
    let t0 = Instant::now();
    std::thread::scope(|s| {
        let first = {
            let (n, id) = (c.node(1).clone(), id.clone());
            s.spawn(move || n.get(id))
        };
        // Node 1's copy exists and is stuck at 64 KiB: node 2 is sent to it.
        let deadline = Instant::now() + Duration::from_secs(5);
        while c.node(1).local_copy(id.clone()).is_none() {
            assert!(Instant::now() < deadline, "node 1 never started its pull");
            std::thread::sleep(Duration::from_millis(5));
        }
        let second = {
            let (n, id) = (c.node(2).clone(), id.clone());
            s.spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(20);
                loop {
                    match n.get(id.clone()) {
                        Ok(v) => return v,
                        Err(_) if Instant::now() < deadline => {}
                        Err(e) => panic!("node 2: {e}"),
                    }
                }
            })
        };
        let got1 = match first.join().unwrap() {
            Ok(v) => v,
            // The stall outlasted the op timeout: ask again (the copy goes on).
            Err(_) if t0.elapsed() < Duration::from_secs(20) => {
                c.node(1).get(id.clone()).expect("node 1 again")
            }
            Err(e) => panic!("node 1: {e}"),
        };
        assert!(got1 == data, "node 1's bytes differ");
        assert!(second.join().unwrap() == data, "node 2's bytes differ");
    });
    assert!(c.node(0).fault_fired(), "the source stalled");
    assert!(t0.elapsed() < Duration::from_secs(25));
    let log: Vec<_> = c
        .node(2)
        .transfer_log()
        .into_iter()
        .filter(|t| t.id == id)
        .collect();
    assert!(
        log.first().is_some_and(|t| t.source == 1),
        "node 2 chained on node 1's copy: {log:?}"
    );
}

/// A cluster of `n` nodes whose objects left without a copy are lost after 1 s.
fn losing_after_1s(n: u32) -> LocalCluster {
    let cfg = NodeConfig {
        lost_after: Duration::from_secs(1),
        ..cfg()
    };
    LocalCluster::start(n, cfg, tcp()).unwrap()
}

/// A reader's get (its result and when it ended) was told `id` is lost, within 20 s of
/// `killed` (the op timeout is 60 s).
fn expect_lost(
    k: usize,
    h: std::thread::JoinHandle<(phalanx::Result<Vec<u8>>, Instant)>,
    id: &ObjectId,
    killed: Instant,
) {
    let (r, at) = h.join().unwrap();
    match r {
        Err(phalanx::Error::ObjectLost(got)) => assert_eq!(&got, id),
        other => panic!(
            "node {k}: expected ObjectLost, got {:?}",
            other.map(|v| v.len())
        ),
    }
    let took = at.duration_since(killed);
    assert!(
        took < Duration::from_secs(20),
        "node {k} told after {took:?}"
    );
}

/// Waits (at most 20 s) until the shard of node `k` keeps at least `n` words for entries it
/// would own if their owners died (told at the owners' ticks, every 50 ms).
fn wait_words(c: &LocalCluster, k: NodeId, n: usize) {
    let kept = || c.node(k as usize).kept_words();
    wait_for(Duration::from_secs(20), Duration::from_millis(10), || {
        (kept() >= n)
            .then_some(())
            .ok_or_else(|| format!("node {k} keeps {} words, not {n}", kept()))
    });
}

/// Polls `ready` every `every` until it is `Ok`; fails with its last complaint after `within`.
fn wait_for(within: Duration, every: Duration, mut ready: impl FnMut() -> Result<(), String>) {
    let deadline = Instant::now() + within;
    while let Err(why) = ready() {
        assert!(Instant::now() < deadline, "{why}");
        std::thread::sleep(every);
    }
}

/// Reads `id` whole through a stream (`Node::get_stream`), its error as the node's.
fn stream_all(n: &Node, id: &ObjectId) -> phalanx::Result<Vec<u8>> {
    use std::io::Read;
    let mut r = n.get_stream(id.clone())?;
    let mut out = Vec::new();
    match r.read_to_end(&mut out) {
        Ok(_) => Ok(out),
        Err(e) => match e.into_inner().map(|e| e.downcast::<phalanx::Error>()) {
            Some(Ok(e)) => Err(*e),
            other => panic!("a stream error that is not the node's: {other:?}"),
        },
    }
}

/// Every copy of an object dies with its node: a get waiting for it, a stream pulling it when
/// the source dies, and a get and a gather asked after fail as `ObjectLost` once `lost_after`
/// passed, long before the op timeout; a get of an object never put still waits; put again,
/// the object is read as any other.
#[test]
fn a_get_of_an_object_whose_every_copy_died_fails_as_lost() {
    use phalanx::Error;
    let lost_after = Duration::from_secs(1);
    let c = LocalCluster::start(
        5,
        NodeConfig {
            lost_after,
            ..cfg()
        },
        tcp(),
    )
    .unwrap();
    let victim = 1;
    let id = name_on(c.node(0), "lost", 0);
    let data = pattern(91);
    c.node(victim).put(id.clone(), &data).unwrap();
    // Node 3 pulls from the only copy; node 4 waits for a source meanwhile (the one copy
    // serves one receiver at a time, and 3's partial copy is excluded by no one, so 4 may
    // read from 3: either way every byte comes from the victim).
    let reader = |k: usize| {
        let n = c.node(k).clone();
        let id = id.clone();
        std::thread::spawn(move || {
            // Node 3 streams (its reader is told why the copy failed, as a get is).
            let r = match k {
                3 => stream_all(&n, &id),
                _ => n.get(id),
            };
            (r, Instant::now())
        })
    };
    let h3 = reader(3);
    let deadline = Instant::now() + Duration::from_secs(30);
    while c
        .node(3)
        .local_copy(id.clone())
        .is_none_or(|i| i.watermark < 4 << 20)
    {
        assert!(Instant::now() < deadline, "node 3 never started pulling");
        std::thread::sleep(Duration::from_millis(1));
    }
    let h4 = reader(4);
    let killed = Instant::now();
    c.node(victim).kill();
    // (4 may read from 3's copy, which cannot complete either.)
    for (k, h) in [(3, h3), (4, h4)] {
        expect_lost(k, h, &id, killed);
    }
    // Asked after: at once.
    let t = Instant::now();
    assert!(matches!(
        c.node(2).get(id.clone()),
        Err(Error::ObjectLost(_))
    ));
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    // So is a gather of it with an object that is there (its subscription waited for the
    // object to be put again, until the op timeout).
    let there = name_on(c.node(0), "there", 0);
    c.node(2).put(there.clone(), b"here").unwrap();
    let t = Instant::now();
    let r = c.node(3).gather(&[there, id.clone()]);
    assert!(matches!(&r, Err(Error::ObjectLost(x)) if *x == id), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    // An object never put is waited for, not lost.
    let never = name_on(c.node(0), "never-put", 0);
    assert!(matches!(
        c.node(2)
            .get_view_timeout(never, Duration::from_millis(1500)),
        Err(Error::Timeout(..))
    ));
    // Put again, it is read as any object.
    c.node(4).put(id.clone(), &data).unwrap();
    assert!(c.node(3).get(id.clone()).unwrap() == data);
    assert!(c.node(2).get(id.clone()).unwrap() == data);
}

/// An object deleted while its putter still writes it stays deleted: the put does not
/// announce the copy complete (the delete dropped it), and a reader is told "not found" at
/// once. (The put announced it before, the entry came back with a copy that was gone, and a
/// reader was sent to it until its op timeout; broadcast soak seeds 40041, 40106.) A node
/// asked for a copy it dropped also withdraws its location.
#[test]
fn an_object_deleted_while_it_is_put_stays_deleted() {
    use phalanx::Error;
    let c = LocalCluster::start(3, cfg(), tcp()).unwrap();
    let id = name_on(c.node(0), "deleted-while-put", 2);
    let data = pattern(7);
    std::thread::scope(|s| {
        let put = s.spawn(|| c.node(1).put(id.clone(), &data));
        while c.node(2).locate(id.clone()).unwrap().is_none() {
            std::thread::sleep(Duration::from_micros(200));
        }
        c.node(2).delete(id.clone()).unwrap();
        // Deleted before it was complete (an error) or after (Ok): deleted either way.
        let _ = put.join().unwrap();
    });
    let t = Instant::now();
    let r = c
        .node(0)
        .get_view_timeout(id.clone(), Duration::from_secs(20));
    assert!(
        matches!(r, Err(Error::NotFound(_))),
        "{:?}",
        r.map(|v| v.len())
    );
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

/// A hung node (frozen: it sends nothing, delivers nothing) stays down for its peers once
/// its heartbeats are missed: it neither dials them again nor answers their dials, as a hung
/// host would not. (The hook's redial thread brought it back every second before, and the
/// directory entries it owned went back to it each time: a reader of an object whose only
/// copy it held waited out the op timeout instead of being told it is lost.)
#[test]
fn a_hung_node_stays_down_for_its_peers() {
    let c = LocalCluster::start(3, cfg(), tcp()).unwrap();
    assert!(c.node(1).freeze(), "TCP nodes can hang");
    let down = || c.node(0).believes_down(1) && c.node(2).believes_down(1);
    wait_for(Duration::from_secs(10), Duration::from_millis(10), || {
        down().then_some(()).ok_or("node 1 not found dead".into())
    });
    // Three heartbeat timeouts more: never up again.
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        assert!(down(), "node 1 came back up");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A small object's bytes stay in its entry, which sends them inline to its first readers
/// only (`INLINE_FANOUT`) and then points readers at a copy. A reader sent to the putter's
/// copy while the putter hangs reads the entry's bytes once the putter is found dead (it
/// was told "not found" before: its pull was given up when the directory answered with the
/// bytes instead of another copy).
#[test]
fn a_small_objects_reader_whose_source_hangs_reads_the_bytes_its_entry_keeps() {
    let c = LocalCluster::start(4, cfg(), tcp()).unwrap();
    let id = name_on(c.node(0), "small-hung", 0);
    let data: Vec<u8> = (0..60_000u32).map(|i| (i * 7 + 3) as u8).collect();
    c.node(1).put(id.clone(), &data).unwrap();
    assert!(c.node(2).get(id.clone()).unwrap() == data, "inline");
    assert!(c.node(1).freeze(), "TCP nodes can hang");
    let t = Instant::now();
    let got = c.node(3).get(id.clone()).unwrap();
    assert!(got == data, "node 3 read other bytes");
    // Pointed at the hung putter, it waits for its death to be known (1 s of heartbeats).
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    assert!(c
        .node(3)
        .local_copy(id.clone())
        .is_some_and(|i| i.watermark == 60_000));
}

/// A putter that also owns its object's entry tells the entry's next owner of its copy 10
/// ms after the put (it waited for the dispatcher's next tick before, up to 60 ms): killed
/// 40 ms after the put, its object is lost to a reader at once, not waited for until the op
/// timeout as one never put.
#[test]
fn an_object_whose_putter_owned_its_entry_and_died_40_ms_later_is_lost_not_unknown() {
    use phalanx::Error;
    let c = losing_after_1s(4);
    let victim = 1;
    let id = name_on(c.node(0), "owned-by-putter", victim as NodeId);
    c.node(victim).put(id.clone(), &[5u8; 1 << 20]).unwrap();
    std::thread::sleep(Duration::from_millis(40));
    c.node(victim).kill();
    let t = Instant::now();
    let r = c
        .node(2)
        .get_view_timeout(id.clone(), Duration::from_secs(30));
    assert!(
        matches!(r, Err(Error::ObjectLost(_))),
        "{:?}",
        r.map(|v| v.len())
    );
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
}

/// The coordinator of a reduce dies while the tree streams the target: its tasks stop
/// (nothing would repair or finish their reduce), the target's readers are told it is lost
/// within `lost_after` instead of waiting out the op timeout, and a reduce of the same inputs
/// coordinated by a survivor makes it again.
#[test]
fn a_reduce_whose_coordinator_dies_is_lost_to_its_readers_and_can_be_redone() {
    use phalanx::{DType, Error, ReduceOp, ReduceOptions};
    let c = losing_after_1s(6);
    // 32 MiB of i64: the chain streams the target for long enough that the coordinator's
    // death is known before the root could finish it, on a loaded host too.
    let elems = 4 << 20;
    let victim: usize = 0; // the coordinator
    let target = name_on(c.node(1), "cd-out", 5).as_str().to_owned();
    let ids: Vec<ObjectId> = (0..4)
        .map(|k| name_on(c.node(1), &format!("cd-in{k}"), 5))
        .collect();
    let data: Vec<Vec<u8>> = (0..4).map(|k| i64_input(k + 40, elems)).collect();
    let chain = ReduceOptions {
        degree: Some(1),
        ..Default::default()
    };
    let handle = c
        .node(victim)
        .reduce_start(
            target.as_str(),
            ids.clone(),
            4,
            ReduceOp::Sum,
            DType::I64,
            chain.clone(),
        )
        .unwrap();
    for k in 0..4 {
        c.node(k + 1).put(ids[k].clone(), &data[k]).unwrap();
    }
    // The tree is placed and its root streams the target: the coordinator dies.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !matches!(c.node(5).locate(target.as_str()), Ok(Some(i)) if !i.locations.is_empty()) {
        assert!(Instant::now() < deadline, "the target was never listed");
        std::thread::sleep(Duration::from_millis(1));
    }
    let killed = Instant::now();
    c.node(victim).kill();
    drop(handle);
    match c.node(5).get(target.as_str()) {
        Err(Error::ObjectLost(id)) => assert_eq!(id.as_str(), target.as_str()),
        other => panic!("expected ObjectLost, got {:?}", other.map(|v| v.len())),
    }
    let took = killed.elapsed();
    assert!(took < Duration::from_secs(20), "told after {took:?}");
    // The tasks stopped: no node holds a complete target.
    for k in 1..6 {
        let done = c
            .node(k)
            .local_copy(target.as_str())
            .is_some_and(|i| i.watermark == (elems * 8) as u64);
        assert!(!done, "node {k} finished the dead coordinator's target");
    }
    // Redone by a survivor: the same inputs, the same name.
    let o = c
        .node(1)
        .reduce_with(target.as_str(), &ids, 4, ReduceOp::Sum, DType::I64, &chain)
        .unwrap();
    assert_eq!(o.used.len(), 4);
    let all: Vec<&Vec<u8>> = data.iter().collect();
    assert!(c.node(5).get(target.as_str()).unwrap() == sum_of(&all));
}

/// The coordinator of a reduce and of an allreduce dies while they wait for inputs that
/// never come, before any copy of either target exists anywhere: the readers (a `get` of
/// the reduce's target, an `allreduce_read` of the allreduce's) are told the targets are
/// lost within about `lost_after` (the coordinator promised them to their shards as it
/// started) instead of waiting out the op timeout, and the targets are made again by a
/// survivor.
#[test]
fn targets_whose_coordinator_dies_before_any_copy_are_lost_to_their_readers() {
    // The targets' entries on other nodes; killed 5 ms in: before a deferred promise would
    // go out (the promises of operations whose inputs are not on the coordinator's node go
    // out at once).
    coordinator_dies_before_any_copy((1, 2), Duration::from_millis(5));
}

/// A coordinator that owns its targets' directory entries itself keeps its promises at the
/// entries' next owner (at its own shard they would die with it): killed before any copy of
/// a target exists, its readers, who ask the next owner once it is gone, are told the
/// targets are lost within about `lost_after`; without the kept promise they waited for
/// their op timeout.
#[test]
fn a_coordinator_that_owns_its_targets_entries_leaves_its_promises_with_the_next_owner() {
    coordinator_dies_before_any_copy((0, 0), Duration::from_millis(50));
}

/// Node 0 coordinates a reduce and an 8 MiB allreduce whose targets' entries are on
/// `shards`, waiting for inputs never put, and is killed `after` they start; the targets'
/// readers on nodes 2 and 3 are told they are lost within 20 s (the op timeout is 60 s),
/// and a survivor makes the reduce's target again.
fn coordinator_dies_before_any_copy(shards: (NodeId, NodeId), after: Duration) {
    use phalanx::{DType, Error, ReduceOp, ReduceOptions};
    let c = losing_after_1s(4);
    let victim = 0;
    let elems = 1 << 20; // 8 MiB: the allreduce's readers wait for its plan
    let reduced = name_on(c.node(1), "pr-out", shards.0);
    let allreduced = name_on(c.node(1), "pa-out", shards.1);
    let ids: Vec<ObjectId> = (0..2)
        .map(|k| name_on(c.node(1), &format!("pr-in{k}"), 3))
        .collect();
    let handle = c
        .node(victim)
        .reduce_start(
            reduced.clone(),
            ids.clone(),
            2,
            ReduceOp::Sum,
            DType::I64,
            ReduceOptions::default(),
        )
        .unwrap();
    let coordinator = c.node(victim).clone();
    let (a_ids, a_target) = (ids.clone(), allreduced.clone());
    // Not joined: the killed node's own call may have gone on to wait for its op timeout.
    std::thread::spawn(move || {
        coordinator
            .allreduce_view(
                a_target,
                &a_ids,
                ReduceOp::Sum,
                DType::I64,
                &Default::default(),
            )
            .map(|_| ())
    });
    let readers: Vec<_> = [(2, reduced.clone(), false), (3, allreduced.clone(), true)]
        .into_iter()
        .map(|(k, id, all)| {
            let n = c.node(k).clone();
            std::thread::spawn(move || match all {
                true => n.allreduce_read(id, (elems * 8) as u64).map(|v| v.len()),
                false => n.get(id).map(|v| v.len()),
            })
        })
        .collect();
    std::thread::sleep(after);
    let killed = Instant::now();
    c.node(victim).kill();
    drop(handle);
    for (r, id) in readers.into_iter().zip([&reduced, &allreduced]) {
        match r.join().unwrap() {
            Err(Error::ObjectLost(lost)) => assert_eq!(&lost, id),
            other => panic!("{id}: expected ObjectLost, got {other:?}"),
        }
    }
    let took = killed.elapsed();
    assert!(took < Duration::from_secs(20), "told after {took:?}");
    // Made again by a survivor once the inputs are there.
    let data: Vec<Vec<u8>> = (0..2).map(|k| i64_input(k + 7, elems)).collect();
    for k in 0..2 {
        c.node(k + 1).put(ids[k].clone(), &data[k]).unwrap();
    }
    let chain = ReduceOptions::default();
    c.node(1)
        .reduce_with(reduced.clone(), &ids, 2, ReduceOp::Sum, DType::I64, &chain)
        .unwrap();
    let all: Vec<&Vec<u8>> = data.iter().collect();
    assert!(c.node(2).get(reduced).unwrap() == sum_of(&all));
}

/// The only copy of an object dies with the node that was also its directory shard: the
/// entry's next owner never heard of the object, yet a reader pulling it when its source
/// died, and a reader waiting meanwhile, are told it is lost within about `lost_after` (the
/// resumed pull makes it an orphan there), not after the op timeout; put again, it is read.
#[test]
fn an_object_whose_only_copy_died_with_its_shard_is_lost() {
    let c = losing_after_1s(5);
    let victim = 1;
    let id = name_on(c.node(0), "lost-shard", victim as NodeId);
    let data = pattern(92);
    c.node(victim).put(id.clone(), &data).unwrap();
    // The victim stalls once it has served 8 MiB of the object: node 3 cannot finish.
    c.node(victim).inject_fault(FaultPlan {
        object: id.clone(),
        after_bytes: 8 << 20,
        action: FaultAction::Stall,
    });
    let reader = |k: usize| {
        let n = c.node(k).clone();
        let id = id.clone();
        std::thread::spawn(move || (n.get(id), Instant::now()))
    };
    let h3 = reader(3);
    wait_for(Duration::from_secs(30), Duration::from_millis(1), || {
        c.node(victim)
            .fault_fired()
            .then_some(())
            .ok_or_else(|| "node 3 never pulled 8 MiB".into())
    });
    let h4 = reader(4);
    let killed = Instant::now();
    c.node(victim).kill();
    for (k, h) in [(3, h3), (4, h4)] {
        expect_lost(k, h, &id, killed);
    }
    c.node(4).put(id.clone(), &data).unwrap();
    assert!(c.node(2).get(id.clone()).unwrap() == data);
}

/// Objects whose only copies died with the node that also owned their directory entries,
/// while nobody was reading them: the node had told the entries' next owner of its copies,
/// so readers who come afterwards (asking that node) are told they are lost within about
/// `lost_after`, a small (inline) object and a large one alike; a large one that a reader
/// had pulled (and so holds a copy of) is read from that copy. Without the node's word they
/// waited for their op timeout.
#[test]
fn objects_whose_only_copy_died_idle_with_their_shard_are_lost() {
    let c = losing_after_1s(4);
    let victim = 1;
    let small = name_on(c.node(0), "idle-small", victim as NodeId);
    let large = name_on(c.node(0), "idle-large", victim as NodeId);
    let copied = name_on(c.node(0), "idle-copied", victim as NodeId);
    let (s_data, l_data) = (pattern(7)[..1000].to_vec(), pattern(5));
    c.node(victim).put(small.clone(), &s_data).unwrap();
    c.node(victim).put(large.clone(), &l_data).unwrap();
    c.node(victim).put(copied.clone(), &l_data).unwrap();
    assert!(c.node(3).get(copied.clone()).unwrap() == l_data);
    // The next owners are told after 10 ms, by a tick every 50 ms.
    let mut told = std::collections::HashMap::new();
    for id in [&small, &large] {
        *told
            .entry(c.node(victim).next_shard_of(id.clone()).unwrap())
            .or_insert(0) += 1;
    }
    for (&k, &n) in &told {
        wait_words(&c, k, n);
    }
    let killed = Instant::now();
    c.node(victim).kill();
    let readers: Vec<_> = [(0, &small), (2, &large)]
        .into_iter()
        .map(|(k, id)| {
            let (n, id) = (c.node(k).clone(), id.clone());
            std::thread::spawn(move || (n.get(id), Instant::now()))
        })
        .collect();
    for ((k, id), h) in [(0, &small), (2, &large)].into_iter().zip(readers) {
        expect_lost(k, h, id, killed);
    }
    assert!(c.node(2).get(copied).unwrap() == l_data);
    // Put again, read as any object.
    c.node(0).put(large.clone(), &l_data).unwrap();
    assert!(c.node(2).get(large).unwrap() == l_data);
}

/// The node that owns an object's entry pulled a copy of it; the object's producer dies, so
/// that copy is the only one, and the owner tells the entry's next owner of it; then the
/// owner dies too: the object's readers are told it is lost (without the word: their op
/// timeout).
#[test]
fn an_only_copy_the_entry_owner_pulled_is_told_to_the_next_owner() {
    let c = losing_after_1s(4);
    let (owner, producer) = (1, 2);
    let id = name_on(c.node(0), "pulled", owner as NodeId);
    let data = pattern(13);
    c.node(producer).put(id.clone(), &data).unwrap();
    assert!(c.node(owner).get(id.clone()).unwrap() == data);
    c.node(producer).kill();
    wait_for(Duration::from_secs(20), Duration::from_millis(10), || {
        c.node(owner)
            .believes_down(producer as NodeId)
            .then_some(())
            .ok_or_else(|| "the producer's death was never seen".into())
    });
    // The owner's copy is the only one now: told at its next ticks.
    wait_words(&c, c.node(owner).next_shard_of(id.clone()).unwrap(), 1);
    let killed = Instant::now();
    c.node(owner).kill();
    let reader = c.node(3).clone();
    let (r, id2) = (reader, id.clone());
    let h = std::thread::spawn(move || (r.get(id2), Instant::now()));
    expect_lost(3, h, &id, killed);
}

/// The word about an only copy follows the entry's next owner: that node dies (the word
/// moves to the one after it) and comes back (the word moves back to it); when the holder
/// then dies, the object's readers, who ask whoever owns the entry then, are told it is
/// lost. Without the moves, the node that has the word is not the one asked, and the
/// readers wait for their op timeout.
#[test]
fn the_word_about_an_only_copy_follows_the_next_owner_of_its_entry() {
    let mut c = losing_after_1s(5);
    let victim = 1;
    let data = pattern(11);
    let made = |c: &LocalCluster, round: usize| -> (ObjectId, NodeId) {
        let id = name_on(c.node(0), &format!("follow{round}"), victim as NodeId);
        let next = c.node(victim).next_shard_of(id.clone()).unwrap();
        c.node(victim).put(id.clone(), &data).unwrap();
        (id, next)
    };
    let wait_down = |c: &LocalCluster, by: usize, peer: NodeId, down: bool| {
        wait_for(Duration::from_secs(20), Duration::from_millis(10), || {
            (c.node(by).believes_down(peer) == down)
                .then_some(())
                .ok_or_else(|| format!("{by} never saw {peer} down={down}"))
        })
    };
    let (a, next) = made(&c, 1);
    wait_words(&c, next, 1);
    // The next owner dies before the holder: the word moves on to the one after it.
    c.node(next as usize).kill();
    wait_down(&c, victim, next, true);
    let after = c.node(victim).next_shard_of(a.clone()).unwrap();
    assert!(after != next && after != victim as NodeId);
    wait_words(&c, after, 1);
    // It comes back (empty): the word moves back to it.
    c.restart(next as usize, cfg(), tcp()).unwrap();
    wait_down(&c, victim, next, false);
    assert_eq!(c.node(victim).next_shard_of(a.clone()), Some(next));
    wait_words(&c, next, 1);
    // An object made since, told to its next owner.
    let (b, next_b) = made(&c, 2);
    wait_words(&c, next_b, if next_b == next { 2 } else { 1 });
    let killed = Instant::now();
    c.node(victim).kill();
    for (id, owner) in [(&a, next), (&b, next_b)] {
        let reader = (0..5)
            .find(|&k| k != victim && k != owner as usize)
            .unwrap();
        let (n, id2) = (c.node(reader).clone(), id.clone());
        let h = std::thread::spawn(move || (n.get(id2), Instant::now()));
        expect_lost(reader, h, id, killed);
    }
}

/// The coordinator of a small reduce whose inputs are on its own node (its promise is
/// deferred: most such reduces end within a millisecond) waits for one more input and dies
/// 300 ms in: the promise went out meanwhile, so the target's reader is told it is lost;
/// whether the target's entry is on another node or on the coordinator's own (the promise
/// then kept by the entry's next owner).
#[test]
fn a_deferred_promise_makes_a_small_target_lost_when_its_coordinator_dies() {
    for shard in [1, 0] {
        a_deferred_promise_with_the_entry_on(shard);
    }
}

fn a_deferred_promise_with_the_entry_on(shard: NodeId) {
    use phalanx::{DType, Error, ReduceOp};
    let c = losing_after_1s(3);
    let victim = 0;
    let target = name_on(c.node(1), "dp-out", shard);
    let here = name_on(c.node(1), "dp-in0", 2);
    let never = name_on(c.node(1), "dp-in1", 2);
    c.node(victim)
        .put(here.clone(), &i64_input(1, 512))
        .unwrap();
    let coordinator = c.node(victim).clone();
    let (t, ids) = (target.clone(), vec![here, never]);
    let _reduce =
        std::thread::spawn(move || coordinator.reduce(t, &ids, 2, ReduceOp::Sum, DType::I64));
    let n = c.node(2).clone();
    let reader = std::thread::spawn({
        let t = target.clone();
        move || n.get(t).map(|v| v.len())
    });
    std::thread::sleep(Duration::from_millis(300));
    let killed = Instant::now();
    c.node(victim).kill();
    match reader.join().unwrap() {
        Err(Error::ObjectLost(lost)) => assert_eq!(lost, target),
        other => panic!("expected ObjectLost, got {other:?}"),
    }
    assert!(
        killed.elapsed() < Duration::from_secs(20),
        "{:?}",
        killed.elapsed()
    );
}

/// A coordinator's promise follows its target's directory entry: the shard it was made to
/// dies, the entry moves, the coordinator makes the promise again to the new owner, and when
/// the coordinator dies in turn, readers asking the new owner are told the target is lost.
#[test]
fn a_promise_is_made_again_to_the_next_owner_of_its_entry() {
    use phalanx::{DType, ReduceOp};
    let c = losing_after_1s(4);
    let (coordinator, shard, reader) = (0, 1, 3);
    // Targets whose entries live on node 1; after its death each moves to node 0, 2 or 3.
    let targets: Vec<ObjectId> = (0..8)
        .map(|k| name_on(c.node(0), &format!("rp-out{k}"), shard as NodeId))
        .collect();
    for (k, t) in targets.iter().enumerate() {
        // Waits for an input never put, held (as it would be) on another node.
        let never = name_on(c.node(0), &format!("rp-in{k}"), 2);
        let (n, t) = (c.node(coordinator).clone(), t.clone());
        // Not joined: the coordinator is killed while it waits.
        std::thread::spawn(move || n.reduce(t, &[never], 1, ReduceOp::Sum, DType::I64));
    }
    std::thread::sleep(Duration::from_millis(300));
    c.node(shard).kill();
    let deadline = Instant::now() + Duration::from_secs(30);
    let moved = |k: usize| {
        targets
            .iter()
            .all(|t| c.node(k).shard_of(t.clone()) != shard as NodeId)
    };
    while !(moved(coordinator) && moved(reader)) {
        assert!(Instant::now() < deadline, "node 1's death never noticed");
        std::thread::sleep(Duration::from_millis(10));
    }
    // The coordinator has made its promises again (it republishes as it learns of the death).
    std::thread::sleep(Duration::from_millis(500));
    let elsewhere: Vec<ObjectId> = targets
        .iter()
        .filter(|t| c.node(reader).shard_of((*t).clone()) != coordinator as NodeId)
        .cloned()
        .collect();
    assert!(
        !elsewhere.is_empty(),
        "every entry moved to the coordinator"
    );
    let readers: Vec<_> = elsewhere
        .iter()
        .map(|t| {
            let (n, t) = (c.node(reader).clone(), t.clone());
            std::thread::spawn(move || (n.get(t), Instant::now()))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let killed = Instant::now();
    c.node(coordinator).kill();
    for (h, t) in readers.into_iter().zip(&elsewhere) {
        expect_lost(reader, h, t, killed);
    }
}
