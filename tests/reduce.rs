//! Reduce, allreduce and gather over real TCP on loopback.

use phalanx::ops::combine;
use phalanx::reduce::TreeSlot;
use phalanx::transport::TcpConfig;
use phalanx::{
    DType, Error, LocalCluster, NodeConfig, ObjectId, ReduceOp, ReduceOptions, SourceClaims,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::time::Duration;

fn cluster(n: u32) -> LocalCluster {
    let cfg = NodeConfig {
        arena_size: 512 << 20,
        op_timeout: Duration::from_secs(60),
        ..NodeConfig::default()
    };
    LocalCluster::start(
        n,
        cfg,
        TcpConfig {
            heartbeat_timeout: Duration::from_secs(3),
            ..TcpConfig::default()
        },
    )
    .unwrap()
}

/// Random elements of `dtype`, floats in [0.5, 1.5] so products stay finite.
fn input(dtype: DType, elems: usize, seed: u64) -> Vec<u8> {
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(elems * dtype.size());
    for _ in 0..elems {
        match dtype {
            DType::F32 => out.extend_from_slice(&r.gen_range(0.5f32..1.5).to_le_bytes()),
            DType::F64 => out.extend_from_slice(&r.gen_range(0.5f64..1.5).to_le_bytes()),
            DType::I32 => out.extend_from_slice(&r.gen_range(-1000i32..1000).to_le_bytes()),
            DType::I64 => {
                out.extend_from_slice(&r.gen_range(-1_000_000i64..1_000_000).to_le_bytes())
            }
            DType::U8 => out.push(r.gen()),
        }
    }
    out
}

/// Node k puts input `{prefix}-{k}` (seed `seed + k`), for k < n; returns the ids and bytes.
fn put_inputs(
    c: &LocalCluster,
    n: usize,
    prefix: &str,
    dtype: DType,
    elems: usize,
    seed: u64,
) -> (Vec<ObjectId>, HashMap<ObjectId, Vec<u8>>) {
    let mut data = HashMap::new();
    let ids: Vec<ObjectId> = (0..n)
        .map(|k| ObjectId::new(format!("{prefix}-{k}")))
        .collect();
    for (k, id) in ids.iter().enumerate() {
        let v = input(dtype, elems, seed + k as u64);
        c.node(k).put(id.clone(), &v).unwrap();
        data.insert(id.clone(), v);
    }
    (ids, data)
}

/// The result the tree must produce: out(p) = own(p) ⊕ out(children in order).
fn tree_reference(
    tree: &[TreeSlot],
    data: &HashMap<ObjectId, Vec<u8>>,
    op: ReduceOp,
    dtype: DType,
) -> Vec<u8> {
    fn out(
        p: usize,
        t: &[TreeSlot],
        d: &HashMap<ObjectId, Vec<u8>>,
        op: ReduceOp,
        dt: DType,
    ) -> Vec<u8> {
        let mut acc = d[&t[p].object].clone();
        for &c in &t[p].children {
            combine(op, dt, &mut acc, &out(c, t, d, op, dt));
        }
        acc
    }
    out(0, tree, data, op, dtype)
}

/// Serial left-to-right reduce in f64, for the float error bound.
fn serial_f64(inputs: &[&Vec<u8>], op: ReduceOp, dtype: DType) -> Vec<f64> {
    let get = |v: &Vec<u8>, i: usize| -> f64 {
        match dtype {
            DType::F32 => f32::from_le_bytes(v[i * 4..i * 4 + 4].try_into().unwrap()) as f64,
            DType::F64 => f64::from_le_bytes(v[i * 8..i * 8 + 8].try_into().unwrap()),
            _ => unreachable!(),
        }
    };
    let n = inputs[0].len() / dtype.size();
    (0..n)
        .map(|i| {
            inputs.iter().skip(1).fold(get(inputs[0], i), |a, v| {
                let b = get(v, i);
                match op {
                    ReduceOp::Sum => a + b,
                    ReduceOp::Prod => a * b,
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            })
        })
        .collect()
}

#[test]
fn every_op_and_dtype_matches_the_reference() {
    let c = cluster(4);
    let elems = 300_000; // multi-chunk for every dtype
    let mut run = 0;
    for dtype in [DType::F32, DType::F64, DType::I32, DType::I64, DType::U8] {
        for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Prod] {
            run += 1;
            let (ids, data) = put_inputs(&c, 4, &format!("in-{run}"), dtype, elems, run * 10);
            let mut results = Vec::new();
            for (rep, degree) in [(0, Some(2)), (1, Some(2)), (2, None)] {
                let target = format!("out-{run}-{rep}");
                let o = c
                    .node(rep % 4)
                    .reduce_with(
                        target.as_str(),
                        &ids,
                        4,
                        op,
                        dtype,
                        &ReduceOptions {
                            degree,
                            ..Default::default()
                        },
                    )
                    .unwrap();
                assert_eq!(o.used.len(), 4);
                let got = c.node(3 - rep % 4).get(target.as_str()).unwrap();
                assert!(
                    got == tree_reference(&o.tree, &data, op, dtype),
                    "{op:?} {dtype:?} differs from its tree's reference"
                );
                if matches!(dtype, DType::F32 | DType::F64) {
                    let inputs: Vec<&Vec<u8>> = ids.iter().map(|i| &data[i]).collect();
                    let serial = serial_f64(&inputs, op, dtype);
                    let eps = if dtype == DType::F32 {
                        f32::EPSILON as f64
                    } else {
                        f64::EPSILON
                    };
                    for (i, s) in serial.iter().enumerate().step_by(97) {
                        let g = match dtype {
                            DType::F32 => {
                                f32::from_le_bytes(got[i * 4..i * 4 + 4].try_into().unwrap()) as f64
                            }
                            _ => f64::from_le_bytes(got[i * 8..i * 8 + 8].try_into().unwrap()),
                        };
                        // n-1 roundings of relative size eps/2 each (values are positive).
                        assert!(
                            (g - s).abs() <= 4.0 * eps * s.abs(),
                            "{op:?} {dtype:?} elem {i}: {g} vs {s}"
                        );
                    }
                }
                results.push((
                    o.tree
                        .iter()
                        .map(|s| (s.object.clone(), s.children.clone()))
                        .collect::<Vec<_>>(),
                    got,
                ));
                c.node(0).delete(target.as_str()).unwrap();
            }
            // The same tree gives bit-identical results across runs.
            for w in results.windows(2) {
                if w[0].0 == w[1].0 {
                    assert!(
                        w[0].1 == w[1].1,
                        "{op:?} {dtype:?}: same tree, different bits"
                    );
                }
            }
            for id in &ids {
                c.node(0).delete(id.clone()).unwrap();
            }
        }
    }
}

fn put_in_order(
    c: &LocalCluster,
    ids: &[ObjectId],
    order: &[usize],
    gap_ms: u64,
    elems: usize,
) -> HashMap<ObjectId, Vec<u8>> {
    let mut data = HashMap::new();
    for (k, id) in ids.iter().enumerate() {
        data.insert(id.clone(), input(DType::I64, elems, 1000 + k as u64));
    }
    let data2 = data.clone();
    let ids2 = ids.to_vec();
    let order2 = order.to_vec();
    let nodes: Vec<_> = c.nodes.clone();
    std::thread::spawn(move || {
        for &k in &order2 {
            std::thread::sleep(Duration::from_millis(gap_ms));
            nodes[k % nodes.len()]
                .put(ids2[k].clone(), &data2[&ids2[k]])
                .unwrap();
        }
    });
    data
}

#[test]
fn subset_reduce_uses_exactly_the_first_n_ready() {
    let c = cluster(8);
    let ids: Vec<ObjectId> = (0..8).map(|k| ObjectId::new(format!("sub-{k}"))).collect();
    let order = [5, 2, 7, 0, 3, 6, 1, 4];
    let data = put_in_order(&c, &ids, &order, 60, 100_000);
    let o = c
        .node(1)
        .reduce("sub-out", &ids, 5, ReduceOp::Sum, DType::I64)
        .unwrap();
    let expect: Vec<ObjectId> = order[..5].iter().map(|&k| ids[k].clone()).collect();
    assert_eq!(o.used, expect, "the first five to be put");
    let got = c.node(6).get("sub-out").unwrap();
    let mut want = data[&expect[0]].clone();
    for id in &expect[1..] {
        combine(ReduceOp::Sum, DType::I64, &mut want, &data[id]);
    }
    assert!(
        got == want,
        "result is not the sum of exactly the five used inputs"
    );
}

#[test]
fn inputs_ready_in_reverse_and_random_order() {
    let c = cluster(6);
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for (round, degree) in [(0, Some(1)), (1, Some(2)), (2, None)] {
        let ids: Vec<ObjectId> = (0..6)
            .map(|k| ObjectId::new(format!("ord-{round}-{k}")))
            .collect();
        let mut order: Vec<usize> = (0..6).rev().collect();
        if round > 0 {
            order.shuffle(&mut rng);
        }
        let data = put_in_order(&c, &ids, &order, 25, 200_000);
        let target = format!("ord-out-{round}");
        let o = c
            .node(0)
            .reduce_with(
                target.as_str(),
                &ids,
                6,
                ReduceOp::Max,
                DType::I64,
                &ReduceOptions {
                    degree,
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(
            o.used,
            order.iter().map(|&k| ids[k].clone()).collect::<Vec<_>>()
        );
        let mut want = data[&ids[0]].clone();
        for id in &ids[1..] {
            combine(ReduceOp::Max, DType::I64, &mut want, &data[id]);
        }
        assert!(c.node(2).get(target.as_str()).unwrap() == want);
    }
}

#[test]
fn composed_reduce_starts_on_the_partial_upstream_result() {
    let c = cluster(6);
    let elems = 2_000_000; // 16 MiB of i64
    let ids: Vec<ObjectId> = (0..6).map(|k| ObjectId::new(format!("comp-{k}"))).collect();
    let mut data = HashMap::new();
    for (k, id) in ids.iter().enumerate() {
        let v = input(DType::I64, elems, 50 + k as u64);
        c.node(k).put(id.clone(), &v).unwrap();
        data.insert(id.clone(), v);
    }
    let n0 = c.node(0).clone();
    let n5 = c.node(5).clone();
    let up_ids = ids[..3].to_vec();
    let down_ids = vec![
        ObjectId::new("comp-up"),
        ids[3].clone(),
        ids[4].clone(),
        ids[5].clone(),
    ];
    let (up, down) = std::thread::scope(|s| {
        let down = s.spawn(|| {
            n5.reduce("comp-down", &down_ids, 4, ReduceOp::Sum, DType::I64)
                .unwrap()
        });
        std::thread::sleep(Duration::from_millis(50));
        let up = n0
            .reduce("comp-up", &up_ids, 3, ReduceOp::Sum, DType::I64)
            .unwrap();
        (up, down.join().unwrap())
    });
    assert!(down.used.contains(&ObjectId::new("comp-up")));
    // The downstream reduce placed the upstream target as soon as it was partial: before the
    // upstream reduce had finished.
    assert!(down.last_ready < up.done || down.used.last() != Some(&ObjectId::new("comp-up")));
    let mut want = data[&ids[0]].clone();
    for id in &ids[1..] {
        combine(ReduceOp::Sum, DType::I64, &mut want, &data[id]);
    }
    assert!(c.node(2).get("comp-down").unwrap() == want);
}

/// The asynchronous parameter server's pattern: `model' = model + first k gradients`, where
/// the next update starts (on the partial model') before the first is done, and both draw
/// from one pool of gradients.
#[test]
fn required_sources_and_shared_claims_in_pipelined_reduces() {
    let c = cluster(6);
    let elems = 1_000_000;
    let grads: Vec<ObjectId> = (0..6).map(|k| ObjectId::new(format!("pg-{k}"))).collect();
    let m0 = ObjectId::new("pm-0");
    let m1 = ObjectId::new("pm-1");
    // Three gradients arrive before the model: the model is still used, with exactly two.
    let order = [3, 1, 4, 0, 5, 2];
    let mut data = HashMap::new();
    for (k, id) in grads.iter().enumerate() {
        data.insert(id.clone(), input(DType::I64, elems, 300 + k as u64));
    }
    let model = input(DType::I64, elems, 299);
    let claims = SourceClaims::new();
    let opts = |required: &ObjectId| ReduceOptions {
        degree: Some(1),
        required: vec![required.clone()],
        claims: Some(claims.clone()),
        ..Default::default()
    };
    let with = |m: &ObjectId| -> Vec<ObjectId> {
        std::iter::once(m.clone())
            .chain(grads.iter().cloned())
            .collect()
    };
    let n0 = c.node(0).clone();
    let first = n0
        .reduce_start(
            m1.clone(),
            with(&m0),
            3,
            ReduceOp::Sum,
            DType::I64,
            opts(&m0),
        )
        .unwrap();
    let put = |k: usize| {
        c.node(k).put(grads[k].clone(), &data[&grads[k]]).unwrap();
        std::thread::sleep(Duration::from_millis(40));
    };
    order[..3].iter().for_each(|&k| put(k));
    c.node(5).put(m0.clone(), &model).unwrap();
    let placed = first.inputs().expect("the first reduce placed its inputs");
    assert_eq!(placed.len(), 3);
    assert!(
        placed.contains(&m0),
        "the required model is used: {placed:?}"
    );
    assert!(placed.contains(&grads[3]) && placed.contains(&grads[1]));
    // The next update starts while the first may still run; the pool keeps them disjoint.
    let m2 = ObjectId::new("pm-2");
    let second = n0
        .reduce_start(
            m2.clone(),
            with(&m1),
            3,
            ReduceOp::Sum,
            DType::I64,
            opts(&m1),
        )
        .unwrap();
    std::thread::sleep(Duration::from_millis(40));
    order[3..].iter().for_each(|&k| put(k));
    let second_in = second
        .inputs()
        .expect("the second reduce placed its inputs");
    let o1 = first.wait().unwrap();
    let o2 = second.wait().unwrap();
    assert_eq!(o1.used, placed);
    assert_eq!(o2.used, second_in);
    let g2: Vec<&ObjectId> = o2.used.iter().filter(|id| **id != m1).collect();
    assert_eq!(
        g2,
        vec![&grads[4], &grads[0]],
        "the next two in arrival order"
    );
    // The required input sits at the deepest position (a leaf), not at the root.
    for o in [&o1, &o2] {
        let slot = o.tree.iter().find(|s| s.children.is_empty()).unwrap();
        assert!(slot.object == m0 || slot.object == m1, "{:?}", o.tree);
    }
    assert_eq!(claims.owner_of(&grads[4]), Some(m2.clone()));
    assert_eq!(claims.owner_of(&grads[5]), None);
    let mut want = model.clone();
    for k in [3, 1, 4, 0] {
        combine(ReduceOp::Sum, DType::I64, &mut want, &data[&grads[k]]);
    }
    assert!(
        c.node(4).get(m2).unwrap() == want,
        "m2 = m0 + g3 + g1 + g4 + g0"
    );
}

#[test]
fn a_required_source_outside_the_sources_is_rejected() {
    let c = cluster(2);
    let err = c
        .node(0)
        .reduce_with(
            "req-out",
            &[ObjectId::new("req-a"), ObjectId::new("req-b")],
            1,
            ReduceOp::Sum,
            DType::F32,
            &ReduceOptions {
                required: vec![ObjectId::new("req-c")],
                ..Default::default()
            },
        )
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

#[test]
fn allreduce_and_gather_on_eight_nodes() {
    let c = cluster(8);
    // A tree for 1 MiB inputs (the reference adds in the tree's order; a partitioned
    // allreduce, from 4 MiB, adds each partition in its own); 1 KiB ones are combined at the
    // coordinator (with plain names and with names homed on the coordinator, whose entries
    // then all live there).
    for (round, (len, homed)) in [(1usize << 18, false), (256, false), (256, true)]
        .into_iter()
        .enumerate()
    {
        let name = |what: String| match homed {
            true => ObjectId::homed(0, what),
            false => ObjectId::new(what),
        };
        let ids: Vec<ObjectId> = (0..8).map(|k| name(format!("ar-{round}-{k}"))).collect();
        let out = name(format!("ar-{round}-out"));
        for (k, id) in ids.iter().enumerate() {
            let v = input(DType::F32, len, 70 + k as u64);
            c.node(k).put(id.clone(), &v).unwrap();
        }
        let mut want = Vec::new();
        let results: Vec<Vec<u8>> = std::thread::scope(|s| {
            let hs: Vec<_> = (1..8)
                .map(|k| {
                    let n = c.node(k).clone();
                    let out = out.clone();
                    s.spawn(move || n.get(out).unwrap())
                })
                .collect();
            let (mine, outcome) = c
                .node(0)
                .allreduce(
                    out.clone(),
                    &ids,
                    ReduceOp::Sum,
                    DType::F32,
                    &ReduceOptions::default(),
                )
                .unwrap();
            let data: HashMap<ObjectId, Vec<u8>> = ids
                .iter()
                .map(|i| (i.clone(), c.node(0).get(i.clone()).unwrap()))
                .collect();
            want = tree_reference(&outcome.tree, &data, ReduceOp::Sum, DType::F32);
            let mut all = vec![mine];
            all.extend(hs.into_iter().map(|h| h.join().unwrap()));
            all
        });
        assert_eq!(want.len(), len * 4);
        for (k, r) in results.iter().enumerate() {
            assert!(
                *r == want,
                "{len} x 4 bytes, homed {homed}: participant {k} got a different allreduce result"
            );
        }
        let gathered = c.node(3).gather(&ids).unwrap();
        for (k, g) in gathered.iter().enumerate() {
            assert!(*g == c.node(k).get(ids[k].clone()).unwrap());
        }
    }
}

#[test]
fn lengths_not_a_multiple_of_the_element_size_are_rejected() {
    let c = cluster(2);
    c.node(0).put("odd-0", &[1u8; 4098]).unwrap();
    c.node(1).put("odd-1", &[1u8; 4098]).unwrap();
    let ids = [ObjectId::new("odd-0"), ObjectId::new("odd-1")];
    match c
        .node(0)
        .reduce("odd-out", &ids, 2, ReduceOp::Sum, DType::F32)
    {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("multiple"), "{m}"),
        other => panic!("{other:?}"),
    }
    // u8 accepts any length.
    c.node(0)
        .reduce("odd-out", &ids, 2, ReduceOp::Sum, DType::U8)
        .unwrap();
    assert_eq!(c.node(1).get("odd-out").unwrap(), vec![2u8; 4098]);
    assert!(matches!(
        c.node(0).reduce("x", &ids, 3, ReduceOp::Sum, DType::U8),
        Err(Error::InvalidArgument(_))
    ));
}

/// A reduce that fails at once (an input that is not a whole number of elements): a reader
/// already waiting for the target on another node is told it is lost after `lost_after` (1
/// s here), not left to its op timeout (60 s); whether the target's entry is on the
/// coordinator's node or elsewhere, and whether its promise to produce the target had gone
/// out (inputs of 1 MiB and more: at once; for a target whose entry is the coordinator's
/// own, to the entry's next owner, and the readers at the coordinator's shard must hear of
/// the failure too) or not yet (small inputs: the failure came first).
#[test]
fn a_reader_of_a_reduce_that_failed_at_once_is_told_it_is_lost() {
    let cfg = NodeConfig {
        arena_size: 64 << 20,
        op_timeout: Duration::from_secs(60),
        lost_after: Duration::from_secs(1),
        ..NodeConfig::default()
    };
    let c = LocalCluster::start(3, cfg, TcpConfig::default()).unwrap();
    // Targets whose entries are on the coordinator's node, and on another.
    let mut targets: Vec<(ObjectId, usize)> = Vec::new();
    let mut names = (0..).map(|k| ObjectId::new(format!("bad-out-{k}")));
    for len in [4098, (1 << 20) + 2] {
        for local in [true, false] {
            let t = names
                .by_ref()
                .find(|t| (c.node(0).shard_of(t.clone()) == 0) == local)
                .unwrap();
            targets.push((t, len));
        }
    }
    for (target, len) in targets {
        let ids = [
            ObjectId::new(format!("{target}-in0")),
            ObjectId::new(format!("{target}-in1")),
        ];
        c.node(0).put(ids[0].clone(), &vec![1u8; len]).unwrap();
        c.node(1).put(ids[1].clone(), &vec![1u8; len]).unwrap();
        let reader = {
            let (node, t) = (c.node(2).clone(), target.clone());
            std::thread::spawn(move || {
                let t0 = std::time::Instant::now();
                (node.get(t), t0.elapsed())
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        let err = c
            .node(0)
            .reduce(target.clone(), &ids, 2, ReduceOp::Sum, DType::F32)
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        let (got, took) = reader.join().unwrap();
        assert!(
            matches!(got, Err(Error::ObjectLost(ref t)) if *t == target),
            "{target}: {got:?}"
        );
        assert!(
            took < Duration::from_secs(10),
            "{target}: told after {took:?}"
        );
    }
}

#[test]
fn small_inputs_travel_with_their_news_and_are_combined_in_tree_order() {
    // Inputs under the inline limit come with their subscriptions; the coordinator combines
    // them in the tree's order: the same bits as the tasks would give, and no pull anywhere.
    let c = cluster(6);
    let elems = 500; // 500 to 4000 bytes: inline
    let mut run = 0;
    for dtype in [DType::F32, DType::F64, DType::I32, DType::I64, DType::U8] {
        for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Prod] {
            run += 1;
            let prefix = format!("small-{run}");
            let (ids, data) = put_inputs(&c, 6, &prefix, dtype, elems, 7000 + run * 10);
            let served_before: usize = (0..6).map(|k| c.node(k).serve_log().len()).sum();
            for (rep, degree) in [(0, Some(2)), (1, None)] {
                let target = format!("small-out-{run}-{rep}");
                let o = c
                    .node(rep + 1)
                    .reduce_with(
                        target.as_str(),
                        &ids,
                        5,
                        op,
                        dtype,
                        &ReduceOptions {
                            degree,
                            ..Default::default()
                        },
                    )
                    .unwrap();
                assert_eq!(o.used.len(), 5, "the first 5 of 6");
                assert!(o.recomputed.is_empty());
                let want = tree_reference(&o.tree, &data, op, dtype);
                for k in 0..6 {
                    let got = c.node(k).get(target.as_str()).unwrap();
                    assert!(
                        got == want,
                        "{op:?} {dtype:?} node {k}: not the tree's result"
                    );
                }
                c.node(0).delete(target.as_str()).unwrap();
            }
            let gathered = c.node(5).gather(&ids).unwrap();
            assert!(gathered.iter().zip(&ids).all(|(g, id)| *g == data[id]));
            let served_after: usize = (0..6).map(|k| c.node(k).serve_log().len()).sum();
            assert_eq!(
                served_after, served_before,
                "{op:?} {dtype:?}: no pull was needed"
            );
            for id in &ids {
                c.node(0).delete(id.clone()).unwrap();
            }
        }
    }
}
