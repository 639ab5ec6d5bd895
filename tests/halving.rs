//! Halving-doubling allreduce (`phalanx::allreduce`, objects from 64 KiB to
//! `allreduce_halving_max`, every input there and one per node) over real TCP on loopback:
//! every op and dtype equals a serial reference on every node, for powers of two and not;
//! inputs that do not fit the algorithm take the tree; a rank that dies mid-run leaves the
//! survivors with the reduce of the inputs still there. The halving reduce (reduce-scatter,
//! then a gather at the coordinator) of the same sizes: the reference at the coordinator
//! alone, the tree where it cannot run, and the tree again after a rank dies mid-run.

#[path = "common/inputs.rs"]
mod inputs;
#[path = "common/log.rs"]
mod log;

use inputs::input;
use phalanx::ops::combine;
use phalanx::reduce::ReduceOptions;
use phalanx::transport::TcpConfig;
use phalanx::{DType, LocalCluster, NodeConfig, ObjectId, ReduceOp};
use phalanx::{FaultAction, FaultPlan};
use std::time::Duration;

const SIZE: u64 = 128 << 10;

fn cfg() -> NodeConfig {
    log::from_env();
    NodeConfig {
        arena_size: 64 << 20,
        op_timeout: Duration::from_secs(60),
        // Inputs put before the run are there at once; a loaded test host may take longer
        // than the default grace to say so. (The late inputs below come 500 ms after.)
        halving_grace: Duration::from_millis(100),
        ..NodeConfig::default()
    }
}

fn tcp() -> TcpConfig {
    TcpConfig {
        heartbeat_timeout: Duration::from_secs(1),
        ..TcpConfig::default()
    }
}

fn reference(inputs: &[&Vec<u8>], op: ReduceOp, dtype: DType) -> Vec<u8> {
    let mut acc = inputs[0].clone();
    for x in &inputs[1..] {
        combine(op, dtype, &mut acc, x);
    }
    acc
}

/// Node 0 coordinates, nodes `readers` read; returns every result (node 0's first) and the
/// coordinator's outcome.
fn run(
    c: &LocalCluster,
    target: &ObjectId,
    sources: &[ObjectId],
    op: ReduceOp,
    dtype: DType,
    readers: &[usize],
) -> (Vec<Vec<u8>>, phalanx::reduce::ReduceOutcome) {
    std::thread::scope(|s| {
        let hs: Vec<_> = readers
            .iter()
            .map(|&k| {
                let n = c.node(k).clone();
                let t = target.clone();
                s.spawn(move || n.allreduce_read(t, SIZE).map(|v| v.to_vec()))
            })
            .collect();
        let (mine, outcome) = c
            .node(0)
            .allreduce(
                target.clone(),
                sources,
                op,
                dtype,
                &ReduceOptions::default(),
            )
            .expect("coordinator");
        let mut all = vec![mine];
        for h in hs {
            all.push(h.join().unwrap().expect("reader"));
        }
        (all, outcome)
    })
}

/// Every op with every dtype, numbered.
fn kinds() -> impl Iterator<Item = (usize, (ReduceOp, DType))> {
    let ops = [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Prod];
    let dtypes = [DType::F32, DType::F64, DType::I32, DType::I64, DType::U8];
    ops.into_iter()
        .flat_map(move |o| dtypes.into_iter().map(move |d| (o, d)))
        .enumerate()
}

#[test]
fn every_op_and_dtype_equals_the_reference_on_every_node() {
    for n in [2usize, 3, 4, 5] {
        let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
        for (i, (op, dtype)) in kinds() {
            let tag = format!("hd{n}/{i}");
            let inputs: Vec<Vec<u8>> = (0..n).map(|k| input(k, SIZE, dtype)).collect();
            let sources: Vec<ObjectId> = (0..n)
                .map(|k| ObjectId::new(format!("{tag}/in{k}")))
                .collect();
            for k in 0..n {
                c.node(k).put(sources[k].clone(), &inputs[k]).unwrap();
            }
            let target = ObjectId::new(format!("{tag}/out"));
            let readers: Vec<usize> = (1..n).collect();
            let (all, outcome) = run(&c, &target, &sources, op, dtype, &readers);
            // Halving and doubling ran: no tree, the main ranks' block count recorded.
            assert!(outcome.tree.is_empty(), "{tag}: a tree ran");
            assert_eq!(
                outcome.partitions,
                1 << (usize::BITS - 1 - n.leading_zeros())
            );
            let want = reference(&inputs.iter().collect::<Vec<_>>(), op, dtype);
            for (k, got) in all.iter().enumerate() {
                assert!(*got == want, "{tag} ({op:?} {dtype:?}): node {k} differs");
            }
            // Every node holds the result: a get anywhere is local.
            for k in 0..n {
                assert!(
                    c.node(k).local_copy(target.as_str()).is_some(),
                    "{tag}: node {k}"
                );
            }
            c.node(0).delete_allreduce(target, SIZE, n, dtype).unwrap();
        }
    }
}

/// Eight ranks, the coordinator not the first: the plan goes down three levels of the
/// plan's tree (ranks handing it on), every node ends with the reference, and each reader
/// returns its own rank's copy (no node pulled the result), several runs in a row.
#[test]
fn eight_ranks_hand_the_plan_on_and_read_their_own_copies() {
    let n = 8;
    let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
    let dtype = DType::F32;
    for round in 0..4 {
        let tag = format!("eight{round}");
        let inputs: Vec<Vec<u8>> = (0..n).map(|k| input(k + round, SIZE, dtype)).collect();
        // Sources in an order that makes node 0 rank 3 (the root of the plan's tree).
        let order = [5usize, 2, 7, 0, 1, 6, 3, 4];
        let sources: Vec<ObjectId> = order
            .iter()
            .map(|k| ObjectId::new(format!("{tag}/in{k}")))
            .collect();
        for (i, &k) in order.iter().enumerate() {
            c.node(k).put(sources[i].clone(), &inputs[k]).unwrap();
        }
        let target = ObjectId::new(format!("{tag}/out"));
        let readers: Vec<usize> = (1..n).collect();
        let (all, outcome) = run(&c, &target, &sources, ReduceOp::Sum, dtype, &readers);
        assert!(outcome.tree.is_empty(), "{tag}: a tree ran");
        assert_eq!(outcome.partitions, 8);
        let want = reference(&inputs.iter().collect::<Vec<_>>(), ReduceOp::Sum, dtype);
        for (k, got) in all.iter().enumerate() {
            assert!(*got == want, "{tag}: node {k} differs");
        }
        for k in 0..n {
            let pulled = c.node(k).transfer_log().iter().any(|r| r.id == target);
            assert!(!pulled, "{tag}: node {k} pulled the result");
        }
        // Every rank's copy is listed: a reader anywhere may be sent to any of them, and a
        // delete reaches every one. The coordinator names the ranks in one message as the run
        // commits (they store theirs with no word to the directory), sent without waiting:
        // it may land after the readers returned (or, with the coordinator's own rank held
        // up, its copy is published as it stores it), so the listing is awaited, bounded.
        let all_ranks: Vec<u32> = (0..n as u32).collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            // No entry yet at the first look, on a loaded host: awaited the same way.
            let info = c.node(3).locate(target.clone()).unwrap();
            let mut holders: Vec<u32> = info
                .iter()
                .flat_map(|i| &i.locations)
                .filter(|l| l.complete)
                .map(|l| l.node)
                .collect();
            holders.sort_unstable();
            if holders == all_ranks {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{tag}: listed {holders:?}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        c.node(0)
            .delete_allreduce(target.clone(), SIZE, n, dtype)
            .unwrap();
        for k in 0..n {
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while c.node(k).local_copy(target.clone()).is_some() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{tag}: node {k} kept it"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
}

/// A rank with no room for its copy of a committed run withdraws the listing its
/// coordinator made for it: the run still commits, every reader gets the result, and the
/// directory soon stops sending readers to that rank (a reader sent there would wait a second
/// for a copy that never comes).
#[test]
fn a_rank_with_no_room_for_the_result_withdraws_its_listing() {
    let n = 4;
    let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
    let dtype = DType::F32;
    let inputs: Vec<Vec<u8>> = (0..n).map(|k| input(k, SIZE, dtype)).collect();
    let sources: Vec<ObjectId> = (0..n)
        .map(|k| ObjectId::new(format!("full/in{k}")))
        .collect();
    for k in 0..n {
        c.node(k).put(sources[k].clone(), &inputs[k]).unwrap();
    }
    // Node 3's arena full of its own objects (pinned: nothing to evict).
    let full = 3;
    let mut i = 0;
    while c.node(full).arena_free() >= SIZE {
        let len = (c.node(full).arena_free() / 2).clamp(4096, 8 << 20);
        c.node(full)
            .put(format!("full/filler{i}"), &vec![7u8; len as usize])
            .unwrap();
        i += 1;
    }
    let target = ObjectId::new("full/out");
    let (all, outcome) = run(&c, &target, &sources, ReduceOp::Sum, dtype, &[1, 2]);
    assert!(outcome.tree.is_empty(), "the halving run committed");
    let want = reference(&inputs.iter().collect::<Vec<_>>(), ReduceOp::Sum, dtype);
    for (k, got) in all.iter().enumerate() {
        assert!(*got == want, "result {k} differs");
    }
    assert!(c.node(full).local_copy(target.clone()).is_none());
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        // The run's listing (the coordinator's own copy too) is sent without waiting and may
        // land after the allreduce returned, on a loaded host after the first look (no entry
        // yet): awaited like the withdraw.
        let info = c.node(1).locate(target.clone()).unwrap();
        let mut listed: Vec<u32> = info
            .iter()
            .flat_map(|i| &i.locations)
            .map(|l| l.node)
            .collect();
        listed.sort_unstable();
        if listed == [0, 1, 2] {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "listed after 5 s: {listed:?} (want [0, 1, 2])"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn inputs_two_to_a_node_or_missing_take_the_tree() {
    let n = 3;
    let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
    let dtype = DType::I32;
    // Four inputs on three nodes: node 0 holds two.
    let inputs: Vec<Vec<u8>> = (0..4).map(|k| input(k, SIZE, dtype)).collect();
    let sources: Vec<ObjectId> = (0..4)
        .map(|k| ObjectId::new(format!("two/in{k}")))
        .collect();
    for (k, holder) in [0usize, 1, 2, 0].into_iter().enumerate() {
        c.node(holder).put(sources[k].clone(), &inputs[k]).unwrap();
    }
    let target = ObjectId::new("two/out");
    let (all, outcome) = run(&c, &target, &sources, ReduceOp::Sum, dtype, &[1, 2]);
    assert!(!outcome.tree.is_empty(), "one tree");
    let want = reference(&inputs.iter().collect::<Vec<_>>(), ReduceOp::Sum, dtype);
    assert!(all.iter().all(|g| *g == want));
    // One input put only after the allreduce began: the tree places it as it comes.
    let late = ObjectId::new("late/in2");
    let sources = vec![
        ObjectId::new("late/in0"),
        ObjectId::new("late/in1"),
        late.clone(),
    ];
    for k in 0..2 {
        c.node(k).put(sources[k].clone(), &inputs[k]).unwrap();
    }
    let target = ObjectId::new("late/out");
    let (all, outcome) = std::thread::scope(|s| {
        let (node, bytes) = (c.node(2).clone(), &inputs[2]);
        s.spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            node.put(late, bytes).unwrap();
        });
        run(&c, &target, &sources, ReduceOp::Sum, dtype, &[1, 2])
    });
    assert!(!outcome.tree.is_empty(), "one tree");
    let want = reference(
        &inputs[..3].iter().collect::<Vec<_>>(),
        ReduceOp::Sum,
        dtype,
    );
    assert!(all.iter().all(|g| *g == want));
}

/// A rank dies mid-run (after sending `after` bytes of its blocks: none, half its first
/// block, more than its first): the run is abandoned before anything was announced and the
/// survivors end, all of them, with the tree's reduce of the inputs still there.
#[test]
fn a_rank_killed_mid_run_leaves_the_survivors_correct() {
    let n = 5;
    for (seed, after) in [(1u64, 0u64), (2, SIZE / 4), (3, SIZE / 2 + 8)] {
        let k = Killed::start(n, &format!("kill{seed}"), seed, after);
        let readers: Vec<usize> = (1..n).filter(|&r| r != k.victim).collect();
        let (all, outcome) = run(
            &k.c,
            &k.target,
            &k.sources,
            ReduceOp::Sum,
            DType::I64,
            &readers,
        );
        let want = k.survivors_reduce(&outcome, seed);
        let victim = k.victim;
        for (i, got) in all.iter().enumerate() {
            assert!(
                *got == want,
                "seed {seed}: survivor {i} (victim {victim}) is wrong"
            );
        }
    }
}

/// A rank stalls mid-run, its input is copied to a node that is no rank, and it is killed:
/// the abandoned run's tree reduces exactly the live ranks' inputs. (It reduced as many
/// inputs as ranks were alive, the first of all inputs to be ready: the dead rank's, from
/// its copy, could take a live rank's place.)
#[test]
fn an_abandoned_run_reduces_the_live_ranks_inputs_not_a_dead_ones_copy() {
    let n = 5;
    for seed in 1..=3u64 {
        let victim = 1 + seed as usize % (n - 1);
        let tag = format!("copied{seed}");
        let k = Killed::with_extra(n, 1, &tag, victim, SIZE / 4, FaultAction::Stall);
        let killer = {
            let (v, spare, id) = (
                k.c.node(victim).clone(),
                k.c.node(n).clone(),
                k.sources[victim].clone(),
            );
            std::thread::spawn(move || {
                let deadline = std::time::Instant::now() + Duration::from_secs(20);
                while !v.fault_fired() && std::time::Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let copied = spare.get(id).is_ok();
                v.kill();
                copied
            })
        };
        let readers: Vec<usize> = (1..n).filter(|&r| r != victim).collect();
        let (all, outcome) = run(
            &k.c,
            &k.target,
            &k.sources,
            ReduceOp::Sum,
            DType::I64,
            &readers,
        );
        assert!(
            killer.join().unwrap(),
            "seed {seed}: the victim's input copied"
        );
        let want = k.survivors_reduce(&outcome, seed);
        for (i, got) in all.iter().enumerate() {
            assert!(*got == want, "seed {seed}: survivor {i} is wrong");
        }
    }
}

/// The coordinator's own rank held up for good after the others have their results: rank
/// 4, its partner in the last step, stalls (links open, heartbeats going) once it has sent
/// every block but that last one. The six ranks that completed say so when no word has come
/// for a while (`HalvingDone`, from their nodes' ticks), which commits the run: they and the
/// coordinator (reading one of their copies) return the reduce of every input within a few
/// ticks, not at the run's step wait (10 s), when the coordinator would abandon it for a
/// tree (12 s before this word existed). Integer sums: any order gives the same bytes.
#[test]
fn a_held_up_coordinator_rank_is_committed_by_the_others_word() {
    let n = 8;
    // Rank k is node k (node 0 coordinates, the inputs in node order). Rank 4 sends S/2,
    // S/4, S/8 in the reduce-scatter, then S/8, S/4 and last S/2 (to rank 0) in the
    // allgather.
    let victim = 4;
    let k = Killed::with(n, "first", victim, 5 * SIZE / 4, FaultAction::Stall);
    let (c, inputs, sources, target) = (&k.c, &k.inputs, &k.sources, &k.target);
    let readers: Vec<usize> = (1..n).filter(|&r| r != victim).collect();
    let started = std::time::Instant::now();
    let (all, outcome) = run(c, target, sources, ReduceOp::Sum, DType::I64, &readers);
    let took = started.elapsed();
    assert!(c.node(victim).fault_fired(), "the victim stalled");
    assert!(outcome.tree.is_empty(), "the halving run committed");
    assert_eq!(outcome.used.len(), n, "every input used");
    let want = reference(
        &inputs.iter().collect::<Vec<_>>(),
        ReduceOp::Sum,
        DType::I64,
    );
    for (i, got) in all.iter().enumerate() {
        assert!(*got == want, "result {i} (0: the coordinator) is wrong");
    }
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

/// A coordinator that dies after the result is made but before it announces the plan: its
/// readers get the result, not a timeout. Here no plan is ever put and the result is
/// complete on one node: readers of a halving size and of a partitioned size both return
/// its bytes within a few plan stalls (the op timeout is 60 s).
#[test]
fn readers_with_no_plan_read_a_result_that_is_complete() {
    let c = LocalCluster::start(3, cfg(), tcp()).unwrap();
    for (tag, size) in [("halving", SIZE), ("parts", 16u64 << 20)] {
        let target = ObjectId::new(format!("noplan-{tag}/out"));
        let bytes = input(7, size, DType::F32);
        let started = std::time::Instant::now();
        let readers: Vec<_> = (1..3)
            .map(|k| {
                let node = c.node(k).clone();
                let target = target.clone();
                std::thread::spawn(move || node.allreduce_read(target, size).map(|v| v.to_vec()))
            })
            .collect();
        // The result appears after the readers began waiting for the plan.
        std::thread::sleep(Duration::from_millis(200));
        c.node(0).put(target.clone(), &bytes).unwrap();
        for (k, r) in readers.into_iter().enumerate() {
            let got = r
                .join()
                .unwrap()
                .unwrap_or_else(|e| panic!("{tag}: reader {k}: {e}"));
            assert!(got == bytes, "{tag}: reader {k} differs");
        }
        let took = started.elapsed();
        assert!(took < Duration::from_secs(20), "{tag}: {took:?}");
    }
}

/// Node 0 reduces all of `sources` into `target` (no reader: the result stays at node 0).
fn reduce(
    c: &LocalCluster,
    target: &ObjectId,
    sources: &[ObjectId],
    num: usize,
    op: ReduceOp,
    dtype: DType,
) -> phalanx::reduce::ReduceOutcome {
    c.node(0)
        .reduce(target.clone(), sources, num, op, dtype)
        .expect("reduce")
}

/// A reduce of every input, one per node, four nodes or more: a halving run (no tree), its
/// result at the coordinator (rank 0 of the run whatever the order of the sources) and at no
/// other node, equal to the reference for every op and dtype; a get elsewhere reads it.
#[test]
fn a_reduce_of_every_input_runs_by_halving_and_ends_at_the_coordinator() {
    for n in [4usize, 5, 6, 8] {
        let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
        for (i, (op, dtype)) in kinds().filter(|(i, _)| n == 5 || i % 4 == n % 4) {
            let tag = format!("hr{n}/{i}");
            let inputs: Vec<Vec<u8>> = (0..n).map(|k| input(k + i, SIZE, dtype)).collect();
            // Node 0's input is not the first source.
            let order: Vec<usize> = (0..n).map(|k| (k + 2) % n).collect();
            let sources: Vec<ObjectId> = order
                .iter()
                .map(|k| ObjectId::new(format!("{tag}/in{k}")))
                .collect();
            for (s, &k) in sources.iter().zip(&order) {
                c.node(k).put(s.clone(), &inputs[k]).unwrap();
            }
            let target = ObjectId::new(format!("{tag}/out"));
            let outcome = reduce(&c, &target, &sources, n, op, dtype);
            assert!(outcome.tree.is_empty(), "{tag}: a tree ran");
            assert_eq!(
                outcome.partitions,
                1 << (usize::BITS - 1 - n.leading_zeros())
            );
            assert_eq!(outcome.used.len(), n);
            let want = reference(&inputs.iter().collect::<Vec<_>>(), op, dtype);
            assert!(c.node(0).local_copy(target.as_str()).is_some(), "{tag}");
            let here = c.node(0).get(target.clone()).unwrap();
            assert!(here == want, "{tag} ({op:?} {dtype:?}) differs");
            for k in 1..n {
                assert!(
                    c.node(k).local_copy(target.as_str()).is_none(),
                    "{tag}: {k}"
                );
            }
            let far = c.node(n - 1).get(target.clone()).unwrap();
            assert!(far == want, "{tag}: read at node {}", n - 1);
        }
    }
}

/// Where the halving reduce cannot run, the tree does, with the same result: fewer than four
/// inputs, the first `n` of `m`, two inputs on one node, an input put after the reduce began.
#[test]
fn reduces_the_halving_run_cannot_take_use_the_tree() {
    let n = 5;
    let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
    let dtype = DType::I32;
    let inputs: Vec<Vec<u8>> = (0..6).map(|k| input(k, SIZE, dtype)).collect();
    let put = |tag: &str, holders: &[usize]| -> Vec<ObjectId> {
        holders
            .iter()
            .enumerate()
            .map(|(k, &h)| {
                let id = ObjectId::new(format!("{tag}/in{k}"));
                c.node(h).put(id.clone(), &inputs[k]).unwrap();
                id
            })
            .collect()
    };
    let check = |tag: &str, sources: &[ObjectId], num: usize| {
        let target = ObjectId::new(format!("{tag}/out"));
        let outcome = reduce(&c, &target, sources, num, ReduceOp::Sum, dtype);
        assert!(!outcome.tree.is_empty(), "{tag}: one tree");
        let used = used_inputs(&outcome, &inputs, sources);
        assert_eq!(used.len(), num, "{tag}");
        let want = reference(&used, ReduceOp::Sum, dtype);
        assert!(c.node(0).get(target).unwrap() == want, "{tag}");
    };
    check("three", &put("three", &[0, 1, 2]), 3);
    check("first4of5", &put("first4of5", &[0, 1, 2, 3, 4]), 4);
    check("shared", &put("shared", &[0, 1, 2, 3, 0]), 5);
    let mut sources = put("late", &[0, 1, 2, 3]);
    let late = ObjectId::new("late/in4");
    sources.push(late.clone());
    std::thread::scope(|s| {
        let (node, bytes) = (c.node(4).clone(), &inputs[4]);
        s.spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            node.put(late, bytes).unwrap();
        });
        check("late", &sources, 5);
    });
}

/// A rank of a halving reduce dies mid-run (after sending none, half, or more than the first
/// block): the run is abandoned and a tree reduces the inputs still there.
#[test]
fn a_reduce_rank_killed_mid_run_leaves_the_tree_correct() {
    let n = 5;
    for (seed, after) in [(1u64, 0u64), (2, SIZE / 4), (3, SIZE / 2 + 8)] {
        let k = Killed::start(n, &format!("rkill{seed}"), seed, after);
        let outcome = reduce(&k.c, &k.target, &k.sources, n, ReduceOp::Sum, DType::I64);
        let want = k.survivors_reduce(&outcome, seed);
        assert!(k.c.node(0).get(k.target).unwrap() == want, "seed {seed}");
    }
}

/// A run of `n` nodes, one I64 input each, whose node `victim` drops its links once it has
/// sent `after` bytes of the run into `target`.
struct Killed {
    c: LocalCluster,
    inputs: Vec<Vec<u8>>,
    sources: Vec<ObjectId>,
    victim: usize,
    target: ObjectId,
}

impl Killed {
    fn start(n: usize, tag: &str, seed: u64, after: u64) -> Killed {
        let victim = 1 + seed as usize % (n - 1);
        Killed::with(n, tag, victim, after, FaultAction::DropLinks)
    }

    /// `n` nodes, input k put on node k; node `victim` does `action` once it has sent
    /// `after` bytes of the target.
    fn with(n: usize, tag: &str, victim: usize, after: u64, action: FaultAction) -> Killed {
        Killed::with_extra(n, 0, tag, victim, after, action)
    }

    /// [`Killed::with`] on a cluster of `n + extra` nodes: the last `extra` hold no input.
    fn with_extra(
        n: usize,
        extra: usize,
        tag: &str,
        victim: usize,
        after: u64,
        action: FaultAction,
    ) -> Killed {
        let c = LocalCluster::start((n + extra) as u32, cfg(), tcp()).unwrap();
        let inputs: Vec<Vec<u8>> = (0..n).map(|k| input(k, SIZE, DType::I64)).collect();
        let sources: Vec<ObjectId> = (0..n)
            .map(|k| ObjectId::new(format!("{tag}/in{k}")))
            .collect();
        for k in 0..n {
            c.node(k).put(sources[k].clone(), &inputs[k]).unwrap();
        }
        let target = ObjectId::new(format!("{tag}/out"));
        c.node(victim).inject_fault(FaultPlan {
            object: target.clone(),
            after_bytes: after,
            action,
        });
        Killed {
            c,
            inputs,
            sources,
            victim,
            target,
        }
    }

    /// Checks that the fault fired and a tree reduced every survivor's input, not the
    /// victim's; the reference of those inputs.
    fn survivors_reduce(&self, outcome: &phalanx::reduce::ReduceOutcome, seed: u64) -> Vec<u8> {
        assert!(
            self.c.node(self.victim).fault_fired(),
            "seed {seed}: the fault fired"
        );
        assert!(!outcome.tree.is_empty(), "seed {seed}: the tree took over");
        assert!(
            !outcome.used.contains(&self.sources[self.victim]),
            "seed {seed}"
        );
        assert_eq!(outcome.used.len(), self.sources.len() - 1, "seed {seed}");
        let used = used_inputs(outcome, &self.inputs, &self.sources);
        reference(&used, ReduceOp::Sum, DType::I64)
    }
}

/// The inputs a reduce used, by its outcome.
fn used_inputs<'a>(
    outcome: &phalanx::reduce::ReduceOutcome,
    inputs: &'a [Vec<u8>],
    sources: &[ObjectId],
) -> Vec<&'a Vec<u8>> {
    outcome
        .used
        .iter()
        .map(|id| &inputs[sources.iter().position(|s| s == id).unwrap()])
        .collect()
}

/// Halving reduces into one target, deleted between rounds, coordinated by one node and then
/// another: each returns once the directory has its result, so a get anywhere right after it
/// reads the new bytes (the delete's tombstone would answer "not found" to a reader that
/// came before the announcement).
#[test]
fn back_to_back_halving_reduces_are_read_anywhere_as_they_return() {
    let n = 6;
    let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
    let dtype = DType::F32;
    for round in 0..12 {
        let tag = format!("bbh{round}");
        let inputs: Vec<Vec<u8>> = (0..n).map(|k| input(k + round, SIZE, dtype)).collect();
        let sources: Vec<ObjectId> = (0..n)
            .map(|k| ObjectId::new(format!("{tag}/in{k}")))
            .collect();
        for k in 0..n {
            c.node(k).put(sources[k].clone(), &inputs[k]).unwrap();
        }
        let coord = round % 2;
        let outcome = c
            .node(coord)
            .reduce("bbh-out", &sources, n, ReduceOp::Sum, dtype)
            .unwrap();
        assert!(outcome.tree.is_empty(), "round {round}: a tree ran");
        let want = reference(&inputs.iter().collect::<Vec<_>>(), ReduceOp::Sum, dtype);
        let reader = 2 + round % (n - 2);
        let got = c
            .node(reader)
            .get("bbh-out")
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert!(got == want, "round {round}");
        c.node(coord).delete("bbh-out").unwrap();
    }
}

/// The coordinator of a halving allreduce dies mid-run: nothing can commit the run, and its
/// readers on the other ranks, and on a node that is no rank, are told the result is lost
/// within a few plan stalls, not after the op timeout (60 s here).
#[test]
fn readers_of_a_run_whose_coordinator_dies_are_told_it_is_lost() {
    use phalanx::Error;
    let n = 4;
    // Node 0 coordinates; it stalls once it has sent its first block, and is killed then.
    // Node 4 holds no input: it reads the result as any reader.
    let k = Killed::with_extra(n, 1, "cdead", 0, SIZE / 2, FaultAction::Stall);
    let (c, sources, target) = (&k.c, &k.sources, &k.target);
    std::thread::scope(|s| {
        let readers: Vec<_> = (1..=n)
            .map(|r| {
                let (node, t) = (c.node(r).clone(), target.clone());
                s.spawn(move || node.allreduce_read(t, SIZE).map(|v| v.len()))
            })
            .collect();
        let coord = c.node(0).clone();
        let (t, srcs) = (target.clone(), sources.clone());
        // Not joined: the dead coordinator's own call ends with its step wait (10 s).
        std::thread::spawn(move || {
            let _ = coord.allreduce(t, &srcs, ReduceOp::Sum, DType::I64, &Default::default());
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !c.node(0).fault_fired() {
            assert!(
                std::time::Instant::now() < deadline,
                "the coordinator never sent"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let killed = std::time::Instant::now();
        c.node(0).kill();
        for (i, h) in readers.into_iter().enumerate() {
            let r = h.join().unwrap();
            let took = killed.elapsed();
            assert!(
                matches!(r, Err(Error::ObjectLost(_))),
                "reader {}: {r:?}",
                i + 1
            );
            assert!(
                took < Duration::from_secs(15),
                "reader {} told after {took:?}",
                i + 1
            );
        }
    });
}
