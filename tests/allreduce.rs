//! Partitioned allreduce (`phalanx::allreduce`) over real TCP on loopback: results equal a
//! serial reference for every op and dtype, every participant ends with the same bytes, and
//! a partition root killed mid-allreduce leaves the survivors correct; the same for inputs
//! that come one after another (trees shaped by their arrival).

#[path = "common/inputs.rs"]
mod inputs;
#[path = "common/log.rs"]
mod log;
#[path = "common/allreduce_setup.rs"]
mod setup;

use inputs::input;
use phalanx::allreduce::{part_id, partitions, plan_id, PARTITION_MIN};
use phalanx::reduce::{ReduceOptions, ReduceOutcome};
use phalanx::{DType, FaultAction, FaultPlan, LocalCluster, NodeConfig, ObjectId, ReduceOp};
use setup::{cfg, named_inputs, put_inputs, reference, tcp, wait_listed};
use std::time::{Duration, Instant};

/// Where `got` differs from `want` (f32 elements), per partition of `bounds`: the first
/// differing element and how many differ, and which inputs the difference matches at the
/// first (an input missing or counted twice), so a rare failure says what went wrong.
fn differences(got: &[u8], want: &[u8], bounds: &[(u64, u64)], inputs: &[Vec<u8>]) -> String {
    if got.len() != want.len() {
        return format!("{} bytes, expected {}", got.len(), want.len());
    }
    let f = |b: &[u8], i: usize| f32::from_le_bytes(b[i * 4..i * 4 + 4].try_into().unwrap());
    let mut out = Vec::new();
    for (p, &(lo, hi)) in bounds.iter().enumerate() {
        let (lo, hi) = (lo as usize / 4, hi as usize / 4);
        let bad: Vec<usize> = (lo..hi).filter(|&i| f(got, i) != f(want, i)).collect();
        if let Some(&i) = bad.first() {
            let d = f(got, i) - f(want, i);
            let like: Vec<usize> = (0..inputs.len())
                .filter(|&k| f(&inputs[k], i) == d.abs())
                .collect();
            let diffs: Vec<f32> = (i..(i + 8).min(hi))
                .map(|j| f(got, j) - f(want, j))
                .collect();
            out.push(format!(
                "partition {p}: {} of {} elements differ, first at {i}: got {} want {} \
                 (difference {d}, the value of inputs {like:?}; the next differences {diffs:?})",
                bad.len(),
                hi - lo,
                f(got, i),
                f(want, i)
            ));
        }
    }
    out.join("; ")
}

/// Every result in `all` (node 0's and the surviving readers') is the sum of `inputs` (each
/// `size` bytes of `dtype`), byte for byte; where one is not, says where per partition.
fn survivors_have_the_sum(
    all: &[Vec<u8>],
    inputs: &[Vec<u8>],
    (size, dtype): (u64, DType),
    what: &str,
) {
    let want = reference(inputs, ReduceOp::Sum, dtype);
    let bounds = partitions(size, inputs.len(), dtype, PARTITION_MIN);
    for (i, got) in all.iter().enumerate() {
        assert!(
            *got == want,
            "{what}: survivor {i} has a wrong result: {}",
            differences(got, &want, &bounds, inputs)
        );
    }
}

/// Node 0 coordinates, every other node reads; each node holds input k. Returns every node's
/// result, node 0's first.
fn run(
    c: &LocalCluster,
    target: &ObjectId,
    sources: &[ObjectId],
    size: u64,
    op: ReduceOp,
    dtype: DType,
    readers: &[usize],
) -> (Vec<Vec<u8>>, usize) {
    let (all, outcome) = run_outcome(c, target, sources, size, (op, dtype), readers);
    (all, outcome.partitions)
}

/// [`run`] with the coordinator's whole outcome.
fn run_outcome(
    c: &LocalCluster,
    target: &ObjectId,
    sources: &[ObjectId],
    size: u64,
    kind: (ReduceOp, DType),
    readers: &[usize],
) -> (Vec<Vec<u8>>, ReduceOutcome) {
    run_readers_after(c, target, sources, size, kind, readers, Duration::ZERO)
}

/// [`run_outcome`] with the readers starting `after` the coordinator.
fn run_readers_after(
    c: &LocalCluster,
    target: &ObjectId,
    sources: &[ObjectId],
    size: u64,
    (op, dtype): (ReduceOp, DType),
    readers: &[usize],
    after: Duration,
) -> (Vec<Vec<u8>>, ReduceOutcome) {
    std::thread::scope(|s| {
        let hs: Vec<_> = readers
            .iter()
            .map(|&k| {
                let n = c.node(k).clone();
                let t = target.clone();
                std::thread::Builder::new()
                    .name("test-reader".into())
                    .spawn_scoped(s, move || {
                        std::thread::sleep(after);
                        n.allreduce_read(t, size).map(|v| v.to_vec())
                    })
                    .unwrap()
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

/// Puts input `k` of `inputs` on node `k` as `sources[k]`, for each `(k, after)` of `order`
/// `after` from now, then (`replicas`) has node `k + 1` (mod the nodes) read it, and says
/// `k` on `done`: the inputs come one after another while an allreduce runs.
fn put_later(
    c: &LocalCluster,
    inputs: &[Vec<u8>],
    sources: &[ObjectId],
    order: &[(usize, Duration)],
    replicas: bool,
    done: Option<crossbeam_channel::Sender<usize>>,
) -> std::thread::JoinHandle<()> {
    let n = inputs.len();
    let nodes: Vec<_> = (0..n).map(|k| c.node(k).clone()).collect();
    let (inputs, sources, order) = (inputs.to_vec(), sources.to_vec(), order.to_vec());
    std::thread::spawn(move || {
        let t0 = Instant::now();
        for (k, after) in order {
            std::thread::sleep(after.saturating_sub(t0.elapsed()));
            nodes[k].put(sources[k].clone(), &inputs[k]).unwrap();
            if replicas {
                let copy = nodes[(k + 1) % n].get(sources[k].clone()).unwrap();
                assert!(copy == inputs[k], "the replica of input {k}");
            }
            if let Some(d) = &done {
                let _ = d.send(k);
            }
        }
    })
}

/// When each of `inputs` is put, from the allreduce's start: the first after 120 ms, the
/// others 40 ms apart. The first comes after the longest window in which the coordinator
/// waits for late inputs (100 ms: the window is a partition's time on a link, which a
/// loaded host's bandwidth estimate stretches), so the trees are shaped by arrival
/// whatever the host's load.
fn one_after_another(inputs: &[usize]) -> Vec<(usize, Duration)> {
    (0u64..)
        .zip(inputs)
        .map(|(j, &k)| (k, Duration::from_millis(120 + 40 * j)))
        .collect()
}

/// With the default configuration an allreduce of 4 MiB is partitioned, whether its inputs
/// are all there (chains, rotated), come soon after the start (chains too: they place the
/// inputs as they come, where one tree was slower), or come one after another (trees by
/// arrival: the partitions' roots start as they are placed and take the late inputs as
/// they come); its readers learn it from the plan. Configured off, it is one tree.
#[test]
fn the_default_allreduce_partitions_whether_or_not_every_input_is_there() {
    let n = 3;
    let size = PARTITION_MIN;
    // Inputs `tag/in0..` on nodes 0, 1, 2, the last `late.len()` of them put `late[j]` ms
    // after the allreduce starts: the partition count, the result checked on every node.
    let partitions_of = |c: &LocalCluster, tag: &str, late: &[u64]| -> usize {
        let first_late = n - late.len();
        let inputs: Vec<Vec<u8>> = (0..n).map(|k| input(k, size, DType::F32)).collect();
        let (_, mut sources) = put_inputs(c, tag, &[0, 1, 2][..first_late], size, DType::F32);
        sources.extend((first_late..n).map(|k| ObjectId::new(format!("{tag}/in{k}"))));
        let target = ObjectId::new(format!("{tag}/out"));
        let (all, parts) = std::thread::scope(|s| {
            for (k, &after) in (first_late..n).zip(late) {
                let (node, id, bytes) = (c.node(k).clone(), sources[k].clone(), &inputs[k]);
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(after));
                    node.put(id, bytes).unwrap();
                });
            }
            run(
                c,
                &target,
                &sources,
                size,
                ReduceOp::Sum,
                DType::F32,
                &[1, 2],
            )
        });
        let want = reference(&inputs, ReduceOp::Sum, DType::F32);
        assert!(all.iter().all(|v| *v == want), "{tag}: a result differs");
        parts
    };
    let c = LocalCluster::start(n as u32, NodeConfig::default(), tcp()).unwrap();
    assert_eq!(
        partitions_of(&c, "ard", &[]),
        3,
        "every input there: partitioned"
    );
    assert_eq!(
        partitions_of(&c, "arl", &[300]),
        3,
        "an input not there yet: partitioned by arrival"
    );
    assert_eq!(
        partitions_of(&c, "arm", &[300, 300]),
        3,
        "two inputs not there yet: partitioned by arrival"
    );
    // One comes within the coordinator's window (on loopback its shortest, 20 ms), one long
    // after: chains (on a host too loaded to put it that soon, trees by arrival; either
    // way partitioned, where this case took one tree before).
    assert_eq!(
        partitions_of(&c, "ars", &[2, 300]),
        3,
        "inputs coming soon after the start: partitioned"
    );
    drop(c);
    let off = NodeConfig {
        allreduce_partition_min: u64::MAX,
        ..NodeConfig::default()
    };
    let c = LocalCluster::start(n as u32, off, tcp()).unwrap();
    assert_eq!(
        partitions_of(&c, "aro", &[]),
        1,
        "partitioning off: one tree"
    );
}

/// Inputs that come one after another, in several orders (the coordinator's first: it sizes
/// the object), are reduced by trees shaped by their arrival, one per partition; every
/// node's result equals a serial reference for every op and dtype (the inputs' values make
/// every order of combination exact).
#[test]
fn inputs_that_come_one_after_another_are_reduced_by_arrival_for_every_op_and_dtype() {
    let n = 4;
    let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
    let orders: [[usize; 3]; 3] = [[1, 2, 3], [3, 1, 2], [2, 3, 1]];
    let mut run_no = 0;
    for dtype in [DType::F32, DType::F64, DType::I32, DType::I64, DType::U8] {
        for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Prod] {
            let size = PARTITION_MIN + 5 * dtype.size() as u64;
            let tag = format!("aa/{dtype:?}-{op:?}");
            let (inputs, sources) = named_inputs(&tag, n, size, dtype);
            c.node(0).put(sources[0].clone(), &inputs[0]).unwrap();
            let order = one_after_another(&orders[run_no % orders.len()]);
            run_no += 1;
            let putter = put_later(&c, &inputs, &sources, &order, false, None);
            let target = ObjectId::new(format!("{tag}/out"));
            let (all, outcome) = run_outcome(&c, &target, &sources, size, (op, dtype), &[1, 2, 3]);
            putter.join().unwrap();
            assert_eq!(outcome.partitions, n, "{tag}: partitioned");
            assert!(outcome.by_arrival, "{tag}: trees by arrival");
            let want = reference(&inputs, op, dtype);
            for (k, got) in all.iter().enumerate() {
                assert!(*got == want, "{tag}: node {k}'s result differs");
            }
            c.node(0)
                .delete_allreduce(target.clone(), size, n, dtype)
                .unwrap();
            for s in &sources {
                c.node(0).delete(s.clone()).unwrap();
            }
        }
    }
}

/// Inputs that come one after another, each read by the next node once it is there (a
/// replica), and a seeded node killed a seeded time after its input, while inputs still
/// come: the partitions' trees by arrival are repaired like any tree, and node 0's result
/// and every surviving reader's are the reduce of all inputs, byte for byte.
#[test]
fn a_node_killed_mid_allreduce_by_arrival_leaves_the_survivors_correct() {
    let n = 5;
    let size: u64 = 8 << 20;
    let dtype = DType::F32;
    for seed in 1..=3u64 {
        let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
        let tag = format!("aak/{seed}");
        let (inputs, sources) = named_inputs(&tag, n, size, dtype);
        c.node(0).put(sources[0].clone(), &inputs[0]).unwrap();
        let _ = c.node(1).get(sources[0].clone()).unwrap();
        let order = one_after_another(&(1..n).collect::<Vec<_>>());
        // The victim, not the last arrival, dies a seeded while after its input and that
        // input's replica are there (each input is needed, and has a copy that survives),
        // and before the last input comes: every partition is still being reduced (none can
        // finish without the last input), the victim's own one rooted on it. Not covered
        // (README "Fault tolerance"): a root that dies after its partition is finished and
        // before another node has all of it.
        let victim = 1 + seed as usize % (n - 2);
        let delay = Duration::from_millis(2 + 5 * seed);
        let readers: Vec<usize> = (1..n).filter(|&k| k != victim).collect();
        let target = ObjectId::new(format!("{tag}/out"));
        let (done_tx, done) = crossbeam_channel::unbounded();
        let putter = put_later(&c, &inputs, &sources, &order, true, Some(done_tx));
        let killer = {
            let v = c.node(victim).clone();
            std::thread::spawn(move || {
                while done.recv().is_ok_and(|k| k != victim) {}
                std::thread::sleep(delay);
                v.kill();
            })
        };
        let t0 = Instant::now();
        let (all, outcome) = run_outcome(
            &c,
            &target,
            &sources,
            size,
            (ReduceOp::Sum, dtype),
            &readers,
        );
        killer.join().unwrap();
        putter.join().unwrap();
        assert_eq!(outcome.partitions, n, "seed {seed}: partitioned");
        assert!(outcome.by_arrival, "seed {seed}: trees by arrival");
        let what = format!("seed {seed}, victim {victim}");
        survivors_have_the_sum(&all, &inputs, (size, dtype), &what);
        println!(
            "seed {seed}: node {victim} killed {} ms after its input; survivors done {:.1} ms in",
            delay.as_millis(),
            t0.elapsed().as_secs_f64() * 1e3
        );
    }
}

/// Arms node `victim` with a fault that stalls its copy out of `id` after `after_bytes`,
/// puts the inputs of `order` as [`put_later`] does (with replicas), and kills `victim` once
/// its input has a replica, the fault has fired and its own copy of `id` is complete, plus
/// 20 ms (its task's answer reaches the coordinator). The putter, and the killer: whether
/// the fault fired and the copy completed (each waited for at most 20 s).
fn stall_then_kill(
    c: &LocalCluster,
    (inputs, sources): (&[Vec<u8>], &[ObjectId]),
    order: &[(usize, Duration)],
    (victim, id, after_bytes): (usize, &ObjectId, u64),
) -> (std::thread::JoinHandle<()>, std::thread::JoinHandle<bool>) {
    c.node(victim).inject_fault(FaultPlan {
        object: id.clone(),
        after_bytes,
        action: FaultAction::Stall,
    });
    let (done_tx, puts) = crossbeam_channel::unbounded();
    let putter = put_later(c, inputs, sources, order, true, Some(done_tx));
    let (node, id) = (c.node(victim).clone(), id.clone());
    let killer = std::thread::spawn(move || {
        while puts.recv().is_ok_and(|k| k != victim) {}
        let deadline = Instant::now() + Duration::from_secs(20);
        let complete = || {
            node.local_copy(id.clone())
                .is_some_and(|c| c.status == phalanx::store::CopyStatus::Complete)
        };
        while !(node.fault_fired() && complete()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(20));
        let ready = node.fault_fired() && complete();
        node.kill();
        ready
    });
    (putter, killer)
}

/// The last arrival roots the last partition of a tree by arrival: its slice combined with
/// the chain's partial, done within a moment of its input. Its one copy out of that
/// partition stalls halfway (an injected fault), and once its input has a replica it is
/// killed: the partition's only complete copy dies with it, every other copy partial. The
/// partition's tree, kept repaired until the coordinator has assembled its copy, computes it
/// again from the input's replica (the same bytes), and every survivor ends with the sum.
/// (Before, the partition was lost: its readers waited for it until the coordinator was
/// told it was lost.)
#[test]
fn a_partition_root_killed_after_its_partition_is_done_leaves_the_survivors_correct() {
    staged(
        "a partition root killed after its partition is done",
        partition_root_killed_after_done,
    );
}

/// Runs `attempt` (its number given) until the scenario it stages arises (it returns true),
/// at most three times: on a loaded host the inputs' timing may shape the trees otherwise
/// (then the attempt checks the survivors all the same, and the next one stages it again).
fn staged(what: &str, mut attempt: impl FnMut(usize) -> bool) {
    for k in 0..3 {
        if attempt(k) {
            return;
        }
        println!("{what}: attempt {k} did not stage it; again");
    }
    panic!("{what}: never staged in three attempts");
}

/// One attempt of the test above: whether the scenario arose (the survivors are checked
/// either way).
fn partition_root_killed_after_done(attempt: usize) -> bool {
    let n = 4;
    let size: u64 = 8 << 20;
    let dtype = DType::F32;
    let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
    let tag = format!("late-root-{attempt}");
    let tag = tag.as_str();
    let (inputs, sources) = named_inputs(tag, n, size, dtype);
    c.node(0).put(sources[0].clone(), &inputs[0]).unwrap();
    let _ = c.node(1).get(sources[0].clone()).unwrap();
    let order = one_after_another(&(1..n).collect::<Vec<_>>());
    let target = ObjectId::new(format!("{tag}/out"));
    let victim = n - 1;
    let part = part_id(&target, n - 1, n);
    let bounds = partitions(size, n, dtype, PARTITION_MIN)[n - 1];
    let half = (bounds.1 - bounds.0) / 2;
    let (putter, killer) = stall_then_kill(&c, (&inputs, &sources), &order, (victim, &part, half));
    let readers: Vec<usize> = (1..n).filter(|&k| k != victim).collect();
    let (all, outcome) = run_outcome(
        &c,
        &target,
        &sources,
        size,
        (ReduceOp::Sum, dtype),
        &readers,
    );
    putter.join().unwrap();
    // Staged: the last root's copy of the partition stalled, its partition done.
    let staged = killer.join().unwrap();
    survivors_have_the_sum(&all, &inputs, (size, dtype), "late root killed");
    if staged {
        assert_eq!(outcome.partitions, n, "partitioned");
        assert!(outcome.by_arrival, "trees by arrival");
    }
    staged
}

/// The same for one tree (1 MiB: not partitioned), a chain whose root is the last arrival:
/// its copy to the coordinator stalls halfway, and it is killed once its input has a
/// replica. The tree, kept repaired until the coordinator has its copy, computes the root
/// again (the same bytes), and every survivor ends with the sum.
#[test]
fn a_tree_root_killed_after_it_is_done_leaves_the_survivors_correct() {
    staged(
        "a tree root killed after it is done",
        tree_root_killed_after_done,
    );
}

/// One attempt of the test above: whether the scenario arose (the survivors are checked
/// either way).
fn tree_root_killed_after_done(attempt: usize) -> bool {
    let n = 4;
    let size: u64 = 1 << 20;
    let dtype = DType::F32;
    let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
    let tag = format!("late-tree-root-{attempt}");
    let tag = tag.as_str();
    let (inputs, sources) = named_inputs(tag, n, size, dtype);
    for k in 0..n - 1 {
        c.node(k).put(sources[k].clone(), &inputs[k]).unwrap();
        let _ = c.node(k + 1).get(sources[k].clone()).unwrap();
    }
    let target = ObjectId::new(format!("{tag}/out"));
    let victim = n - 1;
    let order = [(victim, Duration::from_millis(50))];
    let stall = (victim, &target, size / 2);
    let (putter, killer) = stall_then_kill(&c, (&inputs, &sources), &order, stall);
    let chain = ReduceOptions {
        degree: Some(1),
        ..ReduceOptions::default()
    };
    let (all, outcome) = std::thread::scope(|s| {
        let hs: Vec<_> = (1..n - 1)
            .map(|k| {
                let (node, t) = (c.node(k).clone(), target.clone());
                s.spawn(move || node.allreduce_read(t, size).map(|v| v.to_vec()))
            })
            .collect();
        let (mine, outcome) = c
            .node(0)
            .allreduce(target.clone(), &sources, ReduceOp::Sum, dtype, &chain)
            .expect("coordinator");
        let mut all = vec![mine.to_vec()];
        for h in hs {
            all.push(h.join().unwrap().expect("reader"));
        }
        (all, outcome)
    });
    putter.join().unwrap();
    // Staged: the root's copy to the coordinator stalled, the root done.
    let staged = killer.join().unwrap();
    survivors_have_the_sum(&all, &inputs, (size, dtype), "tree root killed");
    if staged {
        assert_eq!(outcome.partitions, 1, "one tree");
        // Rooted at the last arrival (its copy stalled), the root computed again on the
        // node of its input's replica.
        assert!(outcome.recomputed.contains(&0), "the root computed again");
        assert_eq!(outcome.tree[0].node, 0, "on the replica's node");
    }
    staged
}

/// A coordinator that holds no input (a driver) sizes the object from the directory: the
/// allreduce is partitioned as if it held one, and the coordinator, a reader only, gets the
/// result too; with no input anywhere yet when it starts, once the first comes. With none
/// ever, it fails within the op timeout, and so do its readers.
#[test]
fn a_coordinator_without_an_input_sizes_it_from_the_directory() {
    let c = LocalCluster::start(3, cfg(), tcp()).unwrap();
    let size = PARTITION_MIN;
    // Node 0 coordinates; the inputs are on nodes 1 and 2, put `after` the start (`None`:
    // before it). The partition count, every node's result checked.
    let partitions_of = |tag: &str, after: Option<Duration>| -> usize {
        let inputs: Vec<Vec<u8>> = (1..3).map(|k| input(k, size, DType::I32)).collect();
        let sources: Vec<ObjectId> = (1..3)
            .map(|k| ObjectId::new(format!("{tag}/in{k}")))
            .collect();
        let target = ObjectId::new(format!("{tag}/out"));
        let (all, parts) = std::thread::scope(|s| {
            for (j, k) in (1..3).enumerate() {
                let (node, id, bytes) = (c.node(k).clone(), sources[j].clone(), &inputs[j]);
                match after {
                    None => node.put(id, bytes).unwrap(),
                    Some(after) => {
                        s.spawn(move || {
                            std::thread::sleep(after);
                            node.put(id, bytes).unwrap();
                        });
                    }
                }
            }
            let kind = (ReduceOp::Max, DType::I32);
            run(&c, &target, &sources, size, kind.0, kind.1, &[1, 2])
        });
        let want = reference(&inputs, ReduceOp::Max, DType::I32);
        assert!(all.iter().all(|v| *v == want), "{tag}: a result differs");
        parts
    };
    assert_eq!(partitions_of("arn", None), 2, "sized from the directory");
    let later = Some(Duration::from_millis(300));
    assert_eq!(partitions_of("arl", later), 2, "sized once the first came");
    drop(c);
    // No input ever: the coordinator gives up after its op timeout, and tells its readers.
    let op_timeout = Duration::from_secs(2);
    let config = NodeConfig {
        op_timeout,
        ..cfg()
    };
    let c = LocalCluster::start(3, config, tcp()).unwrap();
    let sources: Vec<ObjectId> = (1..3)
        .map(|k| ObjectId::new(format!("arz/in{k}")))
        .collect();
    let target = ObjectId::new("arz/out");
    let began = Instant::now();
    let (r, read) = std::thread::scope(|s| {
        let (n, t) = (c.node(1).clone(), target.clone());
        let reader = s.spawn(move || n.allreduce_read(t, size).map(|v| v.len()));
        let kind = (ReduceOp::Max, DType::I32);
        let opts = ReduceOptions::default();
        let r = c
            .node(0)
            .allreduce(target.clone(), &sources, kind.0, kind.1, &opts);
        (r.map(|v| v.0.len()), reader.join().unwrap())
    });
    assert!(matches!(r, Err(phalanx::Error::Timeout(..))), "{r:?}");
    assert!(read.is_err(), "the reader: {read:?}");
    assert!(
        began.elapsed() < Duration::from_secs(10),
        "{:?}",
        began.elapsed()
    );
}

#[test]
fn partitioned_allreduce_matches_a_serial_reference_for_every_op_and_dtype() {
    let n = 4;
    let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
    let free: Vec<u64> = (0..n).map(|k| c.node(k).arena_free()).collect();
    for dtype in [DType::F32, DType::F64, DType::I32, DType::I64, DType::U8] {
        for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Prod] {
            // Uneven partitions: a few elements over the threshold.
            let size = PARTITION_MIN + 3 * dtype.size() as u64;
            let tag = format!("{dtype:?}-{op:?}");
            let all_nodes: Vec<usize> = (0..n).collect();
            let (inputs, sources) = put_inputs(&c, &format!("ar/{tag}"), &all_nodes, size, dtype);
            let target = ObjectId::new(format!("ar/{tag}/out"));
            let (all, parts) = run(&c, &target, &sources, size, op, dtype, &[1, 2, 3]);
            assert_eq!(
                parts,
                partitions(size, n, dtype, PARTITION_MIN).len(),
                "{tag}: partitioned"
            );
            assert_eq!(parts, n, "{tag}: one partition per input");
            let want = reference(&inputs, op, dtype);
            for (k, got) in all.iter().enumerate() {
                assert!(
                    *got == want,
                    "{tag}: node {k}'s result differs from the reference"
                );
            }
            // Every node announced a complete copy: a late reader gets it too.
            assert!(
                c.node(2).get(target.clone()).unwrap() == want,
                "{tag}: a later get"
            );
            c.node(0)
                .delete_allreduce(target.clone(), size, n, dtype)
                .unwrap();
            for p in 0..n {
                for k in 0..n {
                    assert!(
                        c.node(k).local_copy(part_id(&target, p, n)).is_none(),
                        "{tag}: partition {p} deleted on node {k}"
                    );
                }
            }
            for s in &sources {
                c.node(0).delete(s.clone()).unwrap();
            }
        }
    }
    // Partitions fetched along their chains land in their place in each node's result (no
    // copy afterwards); 20 allreduces with 3 such partitions per node, so nearly all of them.
    let placed: u64 = (0..n).map(|k| c.node(k).partitions_pulled_in_place()).sum();
    assert!(
        placed >= 20 * 3 * n as u64 / 2,
        "{placed} partitions pulled in place"
    );
    // And all the memory is back: a partition within a result held it only while it lived.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    for (k, &before) in free.iter().enumerate() {
        while c.node(k).arena_free() != before {
            assert!(
                std::time::Instant::now() < deadline,
                "node {k}: {} bytes free of the {before} before",
                c.node(k).arena_free()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Every node holds one input and a replica of its neighbour's; a seeded node (a partition
/// root: with every input used and the placements rotated, each node roots one partition) is
/// killed a seeded few milliseconds into the allreduce. Node 0's result and every surviving
/// reader's are the reduce of all inputs (each still has a live copy), byte for byte.
///
/// This found two bugs (2026-11-24/25): a pull begun before a partition was reset resumed
/// with the old bytes and excluded the node that then produced the new ones (the shard now
/// answers such pulls `Located::Reset`); and a repaired tree rooted on a node that was
/// pulling the partition could not create its output (the pull now gives way).
#[test]
fn a_partition_root_killed_mid_allreduce_leaves_the_survivors_correct() {
    let n = 5;
    let size: u64 = 32 << 20;
    let dtype = DType::F32;
    for seed in 1..=3u64 {
        let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
        let all_nodes: Vec<usize> = (0..n).collect();
        let (inputs, sources) = put_inputs(&c, &format!("arf/{seed}"), &all_nodes, size, dtype);
        for k in 0..n {
            let v = c.node((k + 1) % n).get(sources[k].clone()).unwrap();
            assert!(v == inputs[k]);
        }
        let victim = 1 + (seed as usize * 3) % (n - 1);
        let delay = Duration::from_millis(3 + 7 * seed);
        let target = ObjectId::new(format!("arf/{seed}/out"));
        let readers: Vec<usize> = (1..n).filter(|&k| k != victim).collect();
        let killer = {
            let v = c.node(victim).clone();
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                let at = Instant::now();
                v.kill();
                at
            })
        };
        let t0 = Instant::now();
        let (all, parts) = run(&c, &target, &sources, size, ReduceOp::Sum, dtype, &readers);
        let killed_at = killer.join().unwrap();
        assert_eq!(parts, n, "seed {seed}: partitioned");
        let what = format!("seed {seed}, victim {victim}");
        survivors_have_the_sum(&all, &inputs, (size, dtype), &what);
        println!(
            "seed {seed}: node {victim} killed {:.1} ms in; survivors done {:.1} ms in",
            killed_at.duration_since(t0).as_secs_f64() * 1e3,
            t0.elapsed().as_secs_f64() * 1e3
        );
    }
}

/// The first `num` of `m` inputs: two inputs come late, the allreduce combines the first three
/// to be ready, and every participant (the late ones' nodes too) ends with the same bytes,
/// the reduce of exactly the inputs the outcome names; for a small (inline) object, one of
/// the halving-doubling sizes, and one of a partitioned allreduce's.
#[test]
fn the_first_n_of_m_allreduce_combines_what_it_used_on_every_node() {
    let n = 5;
    let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
    let dtype = DType::I32;
    for (round, size) in [4u64 << 10, 128 << 10, PARTITION_MIN]
        .into_iter()
        .enumerate()
    {
        let tag = format!("first{round}");
        let (inputs, sources) = named_inputs(&tag, n, size, dtype);
        // Inputs 0, 1, 2 now; 3 and 4 well after the allreduce began.
        for k in 0..3 {
            c.node(k).put(sources[k].clone(), &inputs[k]).unwrap();
        }
        let target = ObjectId::new(format!("{tag}/out"));
        let (all, outcome) = std::thread::scope(|s| {
            for k in 3..n {
                let (node, id, bytes) = (c.node(k).clone(), sources[k].clone(), &inputs[k]);
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(400));
                    node.put(id, bytes).unwrap();
                });
            }
            let readers: Vec<_> = (1..n)
                .map(|k| {
                    let (node, t) = (c.node(k).clone(), target.clone());
                    s.spawn(move || node.allreduce_read(t, size).map(|v| v.to_vec()))
                })
                .collect();
            let (mine, outcome) = c
                .node(0)
                .allreduce_first(
                    target.clone(),
                    &sources,
                    3,
                    ReduceOp::Sum,
                    dtype,
                    &ReduceOptions::default(),
                )
                .expect("coordinator");
            let mut all = vec![mine.to_vec()];
            for r in readers {
                all.push(r.join().unwrap().expect("reader"));
            }
            (all, outcome)
        });
        let mut used: Vec<usize> = outcome
            .used
            .iter()
            .map(|id| sources.iter().position(|s| s == id).unwrap())
            .collect();
        used.sort_unstable();
        assert_eq!(used, vec![0, 1, 2], "{tag}: the first three to be ready");
        let want = reference(
            &used.iter().map(|&k| inputs[k].clone()).collect::<Vec<_>>(),
            ReduceOp::Sum,
            dtype,
        );
        for (k, got) in all.iter().enumerate() {
            assert!(*got == want, "{tag}: node {k} differs");
        }
        c.node(0).delete_allreduce(target, size, 3, dtype).unwrap();
    }
    // None of its inputs: refused.
    let err = c.node(0).allreduce_first(
        "none",
        &[],
        0,
        ReduceOp::Sum,
        dtype,
        &ReduceOptions::default(),
    );
    assert!(err.is_err());
}

/// A participant that reads a partitioned allreduce long after the others were done (they
/// dropped their partition copies once assembled) gets the result at once: the nodes its
/// hints name refuse at once, and it fetches what is left where the directory says.
#[test]
fn a_late_reader_of_a_partitioned_allreduce_gets_the_result() {
    let c = LocalCluster::start(4, cfg(), tcp()).unwrap();
    let (size, dtype) = (16u64 << 20, DType::F32);
    let (inputs, sources) = put_inputs(&c, "late", &[0, 1, 2, 3], size, dtype);
    let target = ObjectId::new("late/out");
    // Nodes 0..=2 take part at once; node 3 reads after everyone else is done.
    let (all, parts) = run(&c, &target, &sources, size, ReduceOp::Sum, dtype, &[1, 2]);
    assert!(parts > 1, "partitioned");
    let want = reference(&inputs, ReduceOp::Sum, dtype);
    for (k, got) in all.iter().enumerate() {
        assert!(*got == want, "node {k} differs");
    }
    std::thread::sleep(Duration::from_millis(300));
    let start = Instant::now();
    let late = c
        .node(3)
        .allreduce_read(target.clone(), size)
        .expect("late reader");
    assert!(late.to_vec() == want, "the late reader's copy differs");
    // Its hinted sources dropped their partition copies: they refuse at once (before, each
    // waited a second for a copy that was not coming).
    let took = start.elapsed();
    assert!(took < Duration::from_millis(900), "{took:?}");
}

/// A reader that comes after the others, once a node that rooted a partition (and read the
/// result) died: that partition has no copy left (its readers dropped theirs once
/// assembled), but the whole result is complete on the nodes that read it, and the late
/// reader reads it whole. (It assembled partitions, and was told one was lost.)
#[test]
fn a_late_reader_reads_the_whole_result_when_a_partition_root_died() {
    let c = LocalCluster::start(4, cfg(), tcp()).unwrap();
    let (size, dtype) = (16u64 << 20, DType::F32);
    let (inputs, sources) = put_inputs(&c, "late-dead", &[0, 1, 2, 3], size, dtype);
    for k in 0..4 {
        let copy = c.node((k + 1) % 4).get(sources[k].clone()).unwrap();
        assert!(copy == inputs[k]);
    }
    let target = ObjectId::new("late-dead/out");
    let (all, parts) = run(&c, &target, &sources, size, ReduceOp::Sum, dtype, &[1, 2]);
    assert_eq!(parts, 4, "partitioned, one partition rooted on each node");
    let want = reference(&inputs, ReduceOp::Sum, dtype);
    for (k, got) in all.iter().enumerate() {
        assert!(*got == want, "node {k} differs");
    }
    c.node(2).kill();
    std::thread::sleep(Duration::from_millis(200));
    let late = c
        .node(3)
        .allreduce_read(target.clone(), size)
        .expect("late reader");
    assert!(late.to_vec() == want, "the late reader's copy differs");
}

/// A reader that comes after the coordinator of a partitioned allreduce died, when the
/// directory's answer for the plan no longer names a copy of it (the plan's bytes are kept,
/// the dead node's copies dropped), still knows whose death ends the allreduce (the plan
/// names its coordinator): it is told the result is lost within seconds, not after the op
/// timeout (60 s here). An input that never comes keeps the partitions from completing (trees
/// by arrival, whose readers wait for hints made only once the last input is there).
#[test]
fn a_reader_that_comes_after_the_coordinator_died_is_told_promptly() {
    use phalanx::Error;
    let size = PARTITION_MIN;
    let lost_after = Duration::from_secs(1);
    let config = NodeConfig {
        lost_after,
        ..cfg()
    };
    let c = LocalCluster::start(4, config, tcp()).unwrap();
    let (_, mut sources) = put_inputs(&c, "cdl", &[0, 1, 2], size, DType::F32);
    sources.push(ObjectId::new("cdl/in3")); // never put
    let target = ObjectId::new("cdl/out");
    let coord = c.node(0).clone();
    let (t, srcs) = (target.clone(), sources.clone());
    let coordinator = std::thread::spawn(move || {
        let kind = (ReduceOp::Sum, DType::F32);
        coord.allreduce(t, &srcs, kind.0, kind.1, &ReduceOptions::default())
    });
    wait_listed(&c, &plan_id(&target));
    std::thread::sleep(Duration::from_millis(100)); // its partitions' tasks under way
    c.node(0).kill();
    let _ = coordinator.join();
    // Long enough for every node to hold node 0 dead and the directory to drop its copies.
    std::thread::sleep(lost_after * 3);
    let asked = Instant::now();
    let r = c
        .node(1)
        .allreduce_read(target.clone(), size)
        .map(|v| v.len());
    let took = asked.elapsed();
    assert!(
        matches!(r, Err(Error::ObjectLost(_) | Error::CoordinatorFailed(..))),
        "{r:?}"
    );
    assert!(took < Duration::from_secs(15), "told after {took:?}");
}

/// What [`read_with_and_without_an_input`] returns: the coordinator's result and partition
/// count; the participant's copy and time; the reader without an input's copy and time.
type ThreeReads = ((Vec<u8>, usize), (Vec<u8>, Duration), (Vec<u8>, Duration));

/// Node 0 coordinates the f32 sum of `sources` into `target` (`size` bytes) while node 1, a
/// participant, and node 4, which holds no input, read it; `late` starts as the allreduce
/// does (inputs still to come) and is joined after it. Every copy is checked against
/// `inputs`' reference, and the partition count is more than one.
fn read_with_and_without_an_input(
    c: &LocalCluster,
    (inputs, sources): (&[Vec<u8>], &[ObjectId]),
    (target, size): (&ObjectId, u64),
    late: impl FnOnce() -> Option<std::thread::JoinHandle<()>>,
) -> ThreeReads {
    let started = Instant::now();
    let (mine, read, pure) = std::thread::scope(|s| {
        let read = |k: usize| {
            let (n, t) = (c.node(k).clone(), target.clone());
            s.spawn(move || {
                let copy = n.allreduce_read(t, size).map(|v| v.to_vec());
                (copy, started.elapsed())
            })
        };
        let (participant, pure) = (read(1), read(4));
        let late = late();
        let opts = ReduceOptions::default();
        let mine = c
            .node(0)
            .allreduce(target.clone(), sources, ReduceOp::Sum, DType::F32, &opts);
        if let Some(h) = late {
            h.join().unwrap();
        }
        let mine = mine.map(|(v, o)| (v.to_vec(), o.partitions));
        (mine, participant.join().unwrap(), pure.join().unwrap())
    });
    let want = reference(inputs, ReduceOp::Sum, DType::F32);
    let (result, parts) = mine.expect("coordinator");
    assert!(parts > 1 && result == want, "{parts} partitions");
    let read = (read.0.expect("participant"), read.1);
    assert!(read.0 == want, "the participant's copy differs");
    let pure = (pure.0.expect("reader without an input"), pure.1);
    assert!(pure.0 == want, "its copy differs");
    ((result, parts), read, pure)
}

/// A reader that holds no input has no place in the partitions' trees, and no allgather hint
/// comes for it: it reads each partition where the directory says once the partition is
/// listed and no hint came, not after the whole hint wait (set to 20 s here; 200 ms by
/// default, which it waited out for a 70 ms allreduce before the twenty-second session).
#[test]
fn a_reader_without_an_input_reads_the_partitions_without_waiting_for_hints() {
    let size = 2 * PARTITION_MIN;
    let config = NodeConfig {
        allgather_hint_wait: Duration::from_secs(20),
        ..cfg()
    };
    let c = LocalCluster::start(5, config, tcp()).unwrap();
    let (inputs, sources) = put_inputs(&c, "nin", &[0, 1, 2, 3], size, DType::F32);
    let target = ObjectId::new("nin/out");
    let what = (&inputs[..], &sources[..]);
    let ((_, parts), _, pure) = read_with_and_without_an_input(&c, what, (&target, size), || None);
    assert!(pure.1 < Duration::from_secs(10), "took {:?}", pure.1);
    assert_eq!(c.node(4).partitions_read_unhinted(), parts as u64);
}

/// As above, with an input still to come as the allreduce starts: the partitions' trees are
/// placed, and their hints sent, only once it is there, which may be any time, so the reader
/// without an input cannot tell a late hint from none by waiting. The coordinator says when
/// every tree is placed (`{target}#placed`), and the reader then reads every partition where
/// the directory says. Before the twenty-third session it waited until each partition was
/// complete somewhere, checked every 500 ms (531 ms against the participants' 66-72 on
/// loopback), and read none that way.
#[test]
fn a_reader_without_an_input_is_told_when_late_trees_are_placed() {
    let size = 2 * PARTITION_MIN;
    let c = LocalCluster::start(5, cfg(), tcp()).unwrap();
    let (inputs, sources) = named_inputs("nlate", 4, size, DType::F32);
    // Inputs 0-2 there, input 3 put 60 ms after the allreduce starts.
    for k in 0..3 {
        c.node(k).put(sources[k].clone(), &inputs[k]).unwrap();
    }
    let order = [(3, Duration::from_millis(60))];
    let target = ObjectId::new("nlate/out");
    let late = || Some(put_later(&c, &inputs, &sources, &order, false, None));
    let what = (&inputs[..], &sources[..]);
    let ((_, parts), read, pure) = read_with_and_without_an_input(&c, what, (&target, size), late);
    assert_eq!(
        c.node(4).partitions_read_unhinted(),
        parts as u64,
        "every partition read without a hint once the trees were placed (took {:?}, the \
         participant {:?})",
        pure.1,
        read.1
    );
}

/// Readers wait for the plan at its directory shard, which is the coordinator's node, and the
/// coordinator dies before it made the plan: the plan's entry, and its only copy, go with it.
/// The readers are told the result is lost (its promise died with the coordinator) within
/// seconds; they waited for the plan at the entry's next owner for the op timeout (60 s
/// here) before the twenty-second session (the allreduce soak, seed 22754).
#[test]
fn readers_whose_plan_died_with_its_coordinator_are_told_promptly() {
    use phalanx::Error;
    let size = PARTITION_MIN;
    let config = NodeConfig {
        lost_after: Duration::from_secs(1),
        ..cfg()
    };
    let c = LocalCluster::start(4, config, tcp()).unwrap();
    let on_coordinator = |t: &ObjectId| c.node(1).shard_of(plan_id(t)) == 0;
    let tag = (0..)
        .map(|i| format!("pdc{i}"))
        .find(|tag| on_coordinator(&ObjectId::new(format!("{tag}/out"))))
        .unwrap();
    let (_, mut sources) = put_inputs(&c, &tag, &[0, 1, 2], size, DType::F32);
    // One input missing: the coordinator watches for it a while before it plans.
    sources.push(ObjectId::new(format!("{tag}/in3")));
    let target = ObjectId::new(format!("{tag}/out"));
    let started = Instant::now();
    let results = std::thread::scope(|s| {
        let readers: Vec<_> = (1..4)
            .map(|k| {
                let (n, t) = (c.node(k).clone(), target.clone());
                s.spawn(move || n.allreduce_read(t, size).map(|v| v.len()))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50)); // the readers wait at the shard
        let (coord, t, srcs) = (c.node(0).clone(), target.clone(), sources.clone());
        let coordinator = s.spawn(move || {
            let kind = (ReduceOp::Sum, DType::F32);
            coord.allreduce(t, &srcs, kind.0, kind.1, &ReduceOptions::default())
        });
        std::thread::sleep(Duration::from_millis(5));
        c.node(0).kill();
        assert!(
            coordinator.join().unwrap().is_err(),
            "the killed coordinator"
        );
        readers
            .into_iter()
            .map(|r| r.join().unwrap())
            .collect::<Vec<_>>()
    });
    let took = started.elapsed();
    for r in &results {
        assert!(
            matches!(r, Err(Error::ObjectLost(_) | Error::CoordinatorFailed(..))),
            "{r:?}"
        );
    }
    assert!(took < Duration::from_secs(15), "told after {took:?}");
}

/// The coordinator of an allreduce dies while the result streams (one tree, and the
/// partitioned algorithm): the reduce's tasks stop with it, and every reader is told the
/// result is lost within `lost_after`, long before the op timeout, rather than wait for it.
#[test]
fn an_allreduce_whose_coordinator_dies_fails_its_readers_promptly() {
    use phalanx::Error;
    let size: u64 = 48 << 20;
    for (tag, partition_min) in [("cdt", u64::MAX), ("cdp", PARTITION_MIN)] {
        let c = LocalCluster::start(
            5,
            NodeConfig {
                lost_after: Duration::from_secs(1),
                allreduce_partition_min: partition_min,
                ..cfg()
            },
            tcp(),
        )
        .unwrap();
        let (_, sources) = put_inputs(&c, tag, &[0, 1, 2, 3], size, DType::F32);
        let target = ObjectId::new(format!("{tag}/out"));
        let streamed = |k: usize| {
            let parts = partitions(size, sources.len(), DType::F32, partition_min);
            let of = parts.len();
            let ids: Vec<ObjectId> = match of {
                1 => vec![target.clone()],
                _ => (0..of).map(|p| part_id(&target, p, of)).collect(),
            };
            ids.iter().any(|id| {
                c.node(k)
                    .local_copy(id.clone())
                    .is_some_and(|i| i.watermark > 0)
            })
        };
        std::thread::scope(|s| {
            let readers: Vec<_> = (1..5)
                .map(|k| {
                    let (n, t) = (c.node(k).clone(), target.clone());
                    s.spawn(move || n.allreduce_read(t, size).map(|v| v.len()))
                })
                .collect();
            let coord = c.node(0).clone();
            let (t, srcs) = (target.clone(), sources.clone());
            s.spawn(move || {
                let _ = coord.allreduce(
                    t,
                    &srcs,
                    ReduceOp::Sum,
                    DType::F32,
                    &ReduceOptions::default(),
                );
            });
            let deadline = Instant::now() + Duration::from_secs(30);
            while !(1..5).any(streamed) {
                assert!(Instant::now() < deadline, "{tag}: nothing streamed");
                std::thread::sleep(Duration::from_micros(200));
            }
            let killed = Instant::now();
            c.node(0).kill();
            for (k, h) in readers.into_iter().enumerate() {
                let r = h.join().unwrap();
                let took = killed.elapsed();
                assert!(
                    matches!(r, Err(Error::ObjectLost(_))),
                    "{tag}: reader {}: {r:?}",
                    k + 1
                );
                assert!(
                    took < Duration::from_secs(20),
                    "{tag}: reader {} told after {took:?}",
                    k + 1
                );
            }
        });
    }
}

/// A node that holds an input but does not read the result (no `allreduce_read`) is still
/// named as a partition's source in the allgather: the nodes told to fetch from it are
/// refused at once (its hint stays unclaimed) and fetch elsewhere, rather than wait out its
/// wait for a copy that never comes (1 s). Inputs all there, and inputs that come one after
/// another; every reader's result is the sum.
#[test]
fn a_participant_that_does_not_read_holds_up_no_fetch() {
    let n = 5;
    let size: u64 = 32 << 20;
    let dtype = DType::F32;
    let idle = 2;
    let readers: Vec<usize> = (1..n).filter(|&k| k != idle).collect();
    // Readers that start late ask the idle node for the partitions it roots long after its
    // hints went unclaimed: it must serve them (it holds them), not refuse.
    for (by_arrival, late) in [(false, false), (true, false), (false, true)] {
        let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
        let tag = format!("unread/{by_arrival}/{late}");
        let (inputs, sources) = if by_arrival {
            let (inputs, sources) = named_inputs(&tag, n, size, dtype);
            c.node(0).put(sources[0].clone(), &inputs[0]).unwrap();
            (inputs, sources)
        } else {
            let all_nodes: Vec<usize> = (0..n).collect();
            put_inputs(&c, &tag, &all_nodes, size, dtype)
        };
        let order = one_after_another(&(1..n).collect::<Vec<_>>());
        let putter = by_arrival.then(|| put_later(&c, &inputs, &sources, &order, false, None));
        let target = ObjectId::new(format!("{tag}/out"));
        let t0 = Instant::now();
        let after = Duration::from_millis(if late { 150 } else { 0 });
        let (all, outcome) = run_readers_after(
            &c,
            &target,
            &sources,
            size,
            (ReduceOp::Sum, dtype),
            &readers,
            after,
        );
        let took = t0.elapsed();
        if let Some(p) = putter {
            p.join().unwrap();
        }
        assert_eq!(outcome.partitions, n, "{tag}: partitioned");
        assert_eq!(outcome.by_arrival, by_arrival, "{tag}: the trees");
        survivors_have_the_sum(&all, &inputs, (size, dtype), &tag);
        // The idle node serves the partitions its tasks made. The pulls it was asked for
        // that it never had (none of its own, no assembly to fetch it) ended without a byte,
        // each well before the source's 1 s wait for a copy.
        let mut asked = 0;
        for k in (0..n).filter(|&k| k != idle) {
            for r in c.node(k).transfer_log() {
                if r.source as usize != idle
                    || !r.id.as_str().starts_with(target.as_str())
                    || r.ok
                    || r.bytes > 0
                {
                    continue;
                }
                asked += 1;
                let took = r.end.duration_since(r.start);
                assert!(
                    took < Duration::from_millis(500),
                    "{tag}: node {k}'s pull of {} from the idle node took {took:?}",
                    r.id
                );
            }
        }
        // Nobody waited on the idle node: the whole allreduce took nothing like a
        // reader's op timeout (60 s), late readers too. (How many pulls it refused depends
        // on when the hints came: none, on a loaded host, where every assembly went to the
        // directory first.)
        assert!(took < Duration::from_secs(20), "{tag}: took {took:?}");
        println!(
            "{tag}: {asked} pulls refused by the idle node, each at once; done in {:.1} ms",
            took.as_secs_f64() * 1e3
        );
    }
}

/// An f32 sum allreduce of `sources` into `target` coordinated by node 0 and read by every
/// other node, which may fail: the coordinator's result, and each reader's (the bytes it
/// read, counted).
#[allow(clippy::type_complexity)]
fn try_allreduce(
    c: &LocalCluster,
    target: &ObjectId,
    sources: &[ObjectId],
    size: u64,
) -> (
    phalanx::Result<(Vec<u8>, ReduceOutcome)>,
    Vec<phalanx::Result<usize>>,
) {
    std::thread::scope(|s| {
        let readers: Vec<_> = (1..c.nodes.len())
            .map(|k| {
                let (node, t) = (c.node(k).clone(), target.clone());
                s.spawn(move || node.allreduce_read(t, size).map(|v| v.len()))
            })
            .collect();
        let opts = ReduceOptions::default();
        let mine = c
            .node(0)
            .allreduce(target.clone(), sources, ReduceOp::Sum, DType::F32, &opts);
        let read = readers.into_iter().map(|h| h.join().unwrap()).collect();
        (mine, read)
    })
}

/// The coordinator of the allreduce into `target` failed with `InvalidArgument` saying
/// `what`, and every reader was told so (`CoordinatorFailed` with the same message).
fn all_told<T>(
    target: &ObjectId,
    (mine, read): (phalanx::Result<T>, &[phalanx::Result<usize>]),
    what: &str,
    tag: &str,
) {
    let err = mine
        .err()
        .expect("the coordinator of a bad allreduce succeeded");
    assert!(
        matches!(&err, phalanx::Error::InvalidArgument(m) if m.contains(what)),
        "{tag}: the coordinator: {err}"
    );
    for (k, r) in read.iter().enumerate() {
        let e = r
            .as_ref()
            .expect_err("a reader of a failed allreduce got bytes");
        assert!(
            matches!(e, phalanx::Error::CoordinatorFailed(t, m) if t == target && m.contains(what)),
            "{tag}: reader {}: {e}",
            k + 1
        );
    }
}

/// Bad inputs are refused before anything is announced, whichever algorithm the size
/// would take (one tree, halving and doubling, partitioned), and the readers of a size
/// that waits for a plan are told why by the plan: no one waits out the op timeout (60 s
/// here). A source named twice; an input of another size than the others.
#[test]
fn bad_inputs_are_refused_at_once_and_the_readers_told_why() {
    let n = 4;
    let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
    let soon = Duration::from_secs(10);
    for size in [4u64 << 10, 128 << 10, 8 << 20] {
        // Named twice: refused at the coordinator.
        let tag = format!("twice/{size}");
        let (inputs, sources) = put_inputs(&c, &tag, &[0, 1, 2], size, DType::F32);
        drop(inputs);
        let twice = [sources.clone(), vec![sources[0].clone()]].concat();
        let t0 = Instant::now();
        let err = c
            .node(0)
            .allreduce(
                ObjectId::new(format!("{tag}/out")),
                &twice,
                ReduceOp::Sum,
                DType::F32,
                &ReduceOptions::default(),
            )
            .unwrap_err();
        assert!(
            matches!(&err, phalanx::Error::InvalidArgument(m) if m.contains("duplicate")),
            "{tag}: {err}"
        );
        assert!(
            t0.elapsed() < soon,
            "{tag}: refused after {:?}",
            t0.elapsed()
        );
    }
    for size in [4u64 << 10, 128 << 10, 8 << 20] {
        // Input 1 half the size of the others.
        let tag = format!("sizes/{size}");
        let sources: Vec<ObjectId> = (0..n)
            .map(|k| ObjectId::new(format!("{tag}/in{k}")))
            .collect();
        for (k, s) in sources.iter().enumerate() {
            let len = if k == 1 { size / 2 } else { size };
            c.node(k)
                .put(s.clone(), &input(k, len, DType::F32))
                .unwrap();
            wait_listed(&c, s);
        }
        let target = ObjectId::new(format!("{tag}/out"));
        let t0 = Instant::now();
        let (mine, read) = try_allreduce(&c, &target, &sources, size);
        all_told(&target, (mine, &read), "bytes, others", &tag);
        assert!(t0.elapsed() < soon, "{tag}: told after {:?}", t0.elapsed());
    }
}

/// An input of another size that comes after a partitioned allreduce by arrival started
/// fails its partitions' reduces: the coordinator stops assembling and says why, and every
/// reader is told by the plan, well within the op timeout (60 s here).
#[test]
fn an_input_of_another_size_that_comes_late_fails_the_allreduce_promptly() {
    let n = 4;
    let size: u64 = 8 << 20;
    let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
    let tag = "late-size";
    let (inputs, sources) = named_inputs(tag, n, size, DType::F32);
    c.node(0).put(sources[0].clone(), &inputs[0]).unwrap();
    // Inputs 1 and 2 as they should be, input 3 half as long.
    let wrong = input(3, size / 2, DType::F32);
    let late = [inputs[1].clone(), inputs[2].clone(), wrong];
    let putter = {
        let nodes: Vec<_> = (1..n).map(|k| c.node(k).clone()).collect();
        let (sources, order) = (sources.clone(), one_after_another(&[1, 2, 3]));
        std::thread::spawn(move || {
            let t0 = Instant::now();
            for ((k, after), bytes) in order.into_iter().zip(late) {
                std::thread::sleep(after.saturating_sub(t0.elapsed()));
                nodes[k - 1].put(sources[k].clone(), &bytes).unwrap();
            }
        })
    };
    let target = ObjectId::new(format!("{tag}/out"));
    let t0 = Instant::now();
    let (mine, read) = try_allreduce(&c, &target, &sources, size);
    putter.join().unwrap();
    let soon = Duration::from_secs(10);
    all_told(&target, (mine, &read), "bytes", tag);
    assert!(t0.elapsed() < soon, "told after {:?}", t0.elapsed());
}

/// Allreduces of every regime run at the same time on the same nodes, each coordinated by
/// another node, every node holding an input of each and reading each result: an inline
/// one (1 KiB), two by halving and doubling (64 KiB, 300 KiB), one tree (1 MiB) and a
/// partitioned one (8 MiB). Every node ends with the reference of each, byte for byte: the
/// runs keep to their own plans, blocks, trees and partitions.
#[test]
fn allreduces_of_every_regime_at_once_each_end_correct_on_every_node() {
    let n = 5;
    let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
    let all_nodes: Vec<usize> = (0..n).collect();
    let sizes: [u64; 5] = [1 << 10, 64 << 10, 300 << 10, 1 << 20, 8 << 20];
    for round in 0..2 {
        let runs: Vec<_> = sizes
            .iter()
            .enumerate()
            .map(|(j, &size)| {
                let tag = format!("concurrent/{round}/{j}");
                let (inputs, sources) = put_inputs(&c, &tag, &all_nodes, size, DType::F32);
                (
                    j % n,
                    size,
                    inputs,
                    sources,
                    ObjectId::new(format!("{tag}/out")),
                )
            })
            .collect();
        std::thread::scope(|s| {
            let mut hs = Vec::new();
            for (coordinator, size, _, sources, target) in &runs {
                for k in 0..n {
                    let node = c.node(k).clone();
                    let (t, size) = (target.clone(), *size);
                    let sources = sources.clone();
                    let coordinates = k == *coordinator;
                    hs.push(s.spawn(move || {
                        let got = match coordinates {
                            true => node
                                .allreduce(
                                    t,
                                    &sources,
                                    ReduceOp::Sum,
                                    DType::F32,
                                    &ReduceOptions::default(),
                                )
                                .map(|r| r.0),
                            false => node.allreduce_read(t, size).map(|v| v.to_vec()),
                        };
                        (k, got)
                    }));
                }
            }
            let mut hs = hs.into_iter();
            for (coordinator, size, inputs, _, _) in &runs {
                let want = reference(inputs, ReduceOp::Sum, DType::F32);
                for _ in 0..n {
                    let (k, got) = hs.next().expect("one per node").join().unwrap();
                    let got = got.unwrap_or_else(|e| {
                        panic!("round {round}, {size} B (coordinator {coordinator}), node {k}: {e}")
                    });
                    assert!(
                        got == want,
                        "round {round}, {size} B (coordinator {coordinator}): node {k}'s \
                         result differs from the reference"
                    );
                }
            }
        });
    }
}

/// The first 3 of 4 inputs, one chain: the last of the three to come roots it, and its copy
/// to the others stalls halfway (an injected fault); once its input has a replica it is
/// killed, the target's only complete copy with it. A first-n-of-m tree is not repaired once
/// done (a root computed again could take another input), so nothing makes the target
/// again: the coordinator and the reader are told it is lost, after the grace, instead of
/// waiting out their op timeout (the target's entry was on the dead node too: the
/// coordinator's promise, made again at the entry's new owner, kept it from being lost).
#[test]
fn a_first_n_tree_whose_root_dies_once_done_is_lost_to_its_readers_not_waited_for() {
    staged(
        "a first-n tree root killed once done",
        first_n_root_killed_after_done,
    );
}

/// One attempt of the test above: whether the scenario arose (the coordinator and the
/// reader are checked either way).
fn first_n_root_killed_after_done(attempt: usize) -> bool {
    let n = 4;
    let size: u64 = 1 << 20;
    let dtype = DType::F32;
    let cfg = NodeConfig {
        lost_after: Duration::from_secs(1),
        ..cfg()
    };
    let c = LocalCluster::start(n as u32, cfg, tcp()).unwrap();
    let tag = format!("first-root-{attempt}");
    let (inputs, sources) = named_inputs(&tag, n, size, dtype);
    for k in 0..2 {
        c.node(k).put(sources[k].clone(), &inputs[k]).unwrap();
    }
    let victim = 2;
    // The target's entry on the victim's node too: when it dies, the entry moves and the
    // coordinator makes its standing promises again at the new owner.
    let target = (0..)
        .map(|k| ObjectId::new(format!("{tag}/out{k}")))
        .find(|t| c.node(0).shard_of(t.clone()) == victim as u32)
        .unwrap();
    // Input 3 never comes: a spare the first 3 do not need.
    let order = [(victim, Duration::from_millis(50))];
    let stall = (victim, &target, size / 2);
    let (putter, killer) = stall_then_kill(&c, (&inputs, &sources), &order, stall);
    let chain = ReduceOptions {
        degree: Some(1),
        ..ReduceOptions::default()
    };
    let t0 = Instant::now();
    let (mine, read) = std::thread::scope(|s| {
        let reader = {
            let (node, t) = (c.node(1).clone(), target.clone());
            s.spawn(move || node.allreduce_read(t, size).map(|v| v.to_vec()))
        };
        let mine =
            c.node(0)
                .allreduce_first(target.clone(), &sources, 3, ReduceOp::Sum, dtype, &chain);
        (mine.map(|r| r.0.to_vec()), reader.join().unwrap())
    });
    let took = t0.elapsed();
    putter.join().unwrap();
    let staged = killer.join().unwrap();
    // Either way nobody waits out the op timeout; staged, both are told it is lost (or
    // read it whole, if all of it reached them before the root died).
    assert!(took < Duration::from_secs(20), "{tag}: took {took:?}");
    let want = reference(&inputs[..3], ReduceOp::Sum, dtype);
    for (who, got) in [("coordinator", mine), ("reader", read)] {
        match got {
            Ok(v) => assert!(v == want, "{tag}: the {who}'s result is not the sum"),
            Err(phalanx::Error::ObjectLost(t)) => assert_eq!(t, target, "{tag}: {who}"),
            Err(e) => panic!("{tag}: the {who}: {e}"),
        }
    }
    staged
}

/// Participants that hand in their input and read the result in one call
/// (`Node::allreduce_join`) get the coordinator's result, for every op and dtype: with the
/// inputs' entries on the result's shard (one message each way), on other shards (the plain
/// way), and when they join long before the coordinator starts.
#[test]
fn participants_that_join_with_their_input_read_the_result() {
    let n = 4;
    let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
    let size = 1000u64;
    let mut round = 0;
    for dtype in [DType::F32, DType::F64, DType::I32, DType::I64, DType::U8] {
        for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Prod] {
            for (layout, coordinator_after) in [
                ("homed", Duration::ZERO),
                ("hashed", Duration::ZERO),
                ("homed", Duration::from_millis(300)),
            ] {
                round += 1;
                let size = size / dtype.size() as u64 * dtype.size() as u64;
                let name = |what: &str| match layout {
                    // Every entry on node 2: each input goes with the request for the result.
                    "homed" => ObjectId::homed(2, format!("join/{round}/{what}")),
                    _ => ObjectId::new(format!("join/{round}/{what}")),
                };
                let inputs: Vec<Vec<u8>> = (0..n).map(|k| input(k, size, dtype)).collect();
                let sources: Vec<ObjectId> = (0..n).map(|k| name(&format!("in{k}"))).collect();
                let target = name("out");
                let want = reference(&inputs, op, dtype);
                let got = std::thread::scope(|s| {
                    let joins: Vec<_> = (1..n)
                        .map(|k| {
                            let (node, t, id) = (c.node(k), target.clone(), sources[k].clone());
                            let data = &inputs[k];
                            s.spawn(move || node.allreduce_join(t, id, data).map(|v| v.to_vec()))
                        })
                        .collect();
                    std::thread::sleep(coordinator_after);
                    c.node(0).put(sources[0].clone(), &inputs[0]).unwrap();
                    let opts = ReduceOptions::default();
                    let (mine, _) = c
                        .node(0)
                        .allreduce(target.clone(), &sources, op, dtype, &opts)
                        .expect("coordinator");
                    let mut all = vec![mine];
                    for j in joins {
                        all.push(j.join().unwrap().expect("participant"));
                    }
                    all
                });
                for (k, bytes) in got.iter().enumerate() {
                    assert!(
                        *bytes == want,
                        "{dtype:?} {op:?} {layout} after {coordinator_after:?}: node {k}"
                    );
                }
                // Each participant's input is a listed object like any put.
                for (k, id) in sources.iter().enumerate().skip(1) {
                    let listed = c.node(0).locate(id.clone()).unwrap();
                    assert!(listed.is_some_and(|i| i.locations.iter().any(|l| l.node == k as u32)));
                }
                c.node(0).delete(target).unwrap();
                for s in sources {
                    c.node(0).delete(s).unwrap();
                }
            }
        }
    }
}
