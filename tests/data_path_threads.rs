//! A warm node starts no thread per object on the data path: partitioned allreduces and
//! gathers of large objects run on the nodes' worker pools. Alone in its test binary, since
//! it counts every new thread of the process.

#[path = "common/inputs.rs"]
mod inputs;
#[path = "common/log.rs"]
mod log;
#[path = "common/allreduce_setup.rs"]
mod setup;

use phalanx::allreduce::PARTITION_MIN;
use phalanx::reduce::ReduceOptions;
use phalanx::{DType, LocalCluster, ObjectId, ReduceOp};
use setup::{cfg, put_inputs, reference, tcp};
use std::time::Duration;

/// The ids of the process's threads alive now.
fn thread_ids() -> std::collections::HashSet<u64> {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Threads that start while `f` runs, seen by looking every 200 us (a thread that lives
/// shorter than that may be missed; the per-object fetch threads this guards against lived
/// for a whole transfer). The sampler itself is not counted.
fn threads_started_during(f: impl FnOnce()) -> usize {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (ready_tx, ready) = std::sync::mpsc::channel();
    let sampler = std::thread::spawn({
        let stop = stop.clone();
        move || {
            let before = thread_ids();
            ready_tx.send(()).unwrap();
            let mut seen = std::collections::HashSet::new();
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                seen.extend(thread_ids());
                std::thread::sleep(Duration::from_micros(200));
            }
            seen.difference(&before).count()
        }
    });
    ready.recv().unwrap();
    f();
    stop.store(true, std::sync::atomic::Ordering::Release);
    sampler.join().unwrap()
}

#[test]
fn warm_partitioned_allreduces_and_gathers_start_no_thread_per_object() {
    let n = 4;
    let c = LocalCluster::start(n as u32, cfg(), tcp()).unwrap();
    let (op, dtype) = (ReduceOp::Sum, DType::F32);
    let size = PARTITION_MIN;
    let all_nodes: Vec<usize> = (0..n).collect();
    // The readers' threads, made before anything is counted: each reads the targets sent
    // to it.
    let readers: Vec<_> = (1..n)
        .map(|k| {
            let (tx, rx) = std::sync::mpsc::channel::<ObjectId>();
            let (done_tx, done) = std::sync::mpsc::channel();
            let node = c.node(k).clone();
            std::thread::spawn(move || {
                for t in rx {
                    let r = node.allreduce_read(t, size).map(|v| v.to_vec());
                    done_tx.send(r).unwrap();
                }
            });
            (tx, done)
        })
        .collect();
    let round = |r: usize| {
        let tag = format!("warm/{r}");
        let (inputs, sources) = put_inputs(&c, &tag, &all_nodes, size, dtype);
        let target = ObjectId::new(format!("{tag}/out"));
        for (tx, _) in &readers {
            tx.send(target.clone()).unwrap();
        }
        let opts = ReduceOptions::default();
        let (mine, outcome) = c
            .node(0)
            .allreduce(target.clone(), &sources, op, dtype, &opts)
            .unwrap();
        assert_eq!(outcome.partitions, n, "round {r}: partitioned");
        let want = reference(&inputs, op, dtype);
        assert!(mine == want, "round {r}: the coordinator's sum");
        for (k, (_, done)) in readers.iter().enumerate() {
            let got = done.recv().unwrap().unwrap();
            assert!(got == want, "round {r}: reader {}'s sum", k + 1);
        }
        // A gather of the large inputs at node 0: three fetched from other nodes at once.
        let got = c.node(0).gather(&sources).unwrap();
        assert!(got == inputs, "round {r}: the gather");
        c.node(0).delete_allreduce(target, size, n, dtype).unwrap();
        for s in &sources {
            c.node(0).delete(s.clone()).unwrap();
        }
    };
    // Warm: the worker pools grow to what a round needs at once.
    for r in 0..3 {
        round(r);
    }
    let started = threads_started_during(|| {
        for r in 3..6 {
            round(r);
        }
    });
    // A thread per partition's reduce (4 a round), per partition and reader (16) and per
    // gathered object (3) was 69 here; a round a little busier than the warm ones may add a
    // worker to a pool now and then.
    assert!(
        started <= 12,
        "{started} threads started during three warm rounds"
    );
}
