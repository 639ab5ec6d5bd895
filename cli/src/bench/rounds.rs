//! One iteration of each collective, as every rank runs it: meet at the barrier, do this
//! rank's part, stamp its completion, hand the stamp in; rank 0 cleans up afterwards. Results
//! are checked outside the timed part.

use super::sync::{now_ns, RankSync, Stamp};
use super::{Algo, BenchSpec, Collective, Degree, Inputs, Placement};
use anyhow::{bail, Context, Result};
use phalanx::config::INLINE_LIMIT;
use phalanx::ops::{combine, DType, ReduceOp};
use phalanx::{Node, ObjectId, ObjectView, ObjectWriter, ReduceOptions};
use std::time::Duration;

/// What rank 0 learns from one iteration.
pub(super) struct Measure {
    pub total: f64,
    /// Reduce, allreduce, gather: from the last input's scheduled arrival to the last rank
    /// done: the iteration's time minus (n - 1) arrival intervals, the rule of
    /// `cluster/mpi/collbench.c` (until 2026-11-25 it was rank 0's own completion, which for
    /// an allreduce left out the readers that finish after the coordinator).
    pub after_last_ready: Option<f64>,
    pub degree: Option<usize>,
    /// Allreduce: partitions reduced side by side.
    pub partitions: Option<usize>,
}

pub(super) struct Round<'a> {
    node: &'a Node,
    spec: &'a BenchSpec,
    size: u64,
    sync: &'a dyn RankSync,
    /// This rank's object: the broadcast data at rank 0, every rank's input for the
    /// many-to-one collectives.
    payload: Vec<u8>,
    /// When this rank last left the barrier.
    released: std::sync::atomic::AtomicU64,
    /// `--algo socket`: rank 0's server, rank 1's client.
    socket: Option<super::socket::Socket>,
}

impl<'a> Round<'a> {
    pub fn new(
        node: &'a Node,
        spec: &'a BenchSpec,
        size: u64,
        sync: &'a dyn RankSync,
    ) -> Result<Self> {
        if spec.algo == Algo::Socket && spec.collective != Collective::P2p {
            bail!("--algo socket is the baseline of p2p only");
        }
        let payload = match spec.collective {
            Collective::P2p | Collective::Broadcast if node.id() == 0 => pattern(size),
            Collective::Reduce | Collective::Allreduce | Collective::Gather => {
                input_of(node.id(), size)
            }
            _ => Vec::new(),
        };
        let socket = (spec.algo == Algo::Socket)
            .then(|| super::socket::Socket::new(node.id(), size))
            .transpose()?;
        Ok(Round {
            node,
            spec,
            size,
            sync,
            payload,
            released: std::sync::atomic::AtomicU64::new(0),
            socket,
        })
    }

    fn name(&self, it: usize, kind: &str, rank: u32) -> ObjectId {
        let c = format!("{:?}-{:?}", self.spec.collective, self.spec.algo);
        let name = format!("bench/{c}/{kind}/{}/{it}/{rank}", self.size);
        match self.spec.placement {
            Placement::Root => ObjectId::homed(0, name),
            Placement::Hash => ObjectId::new(name),
        }
    }

    pub fn run(&self, it: usize) -> Result<Option<Measure>> {
        match self.spec.collective {
            Collective::P2p => self.p2p(it),
            Collective::Broadcast => self.broadcast(it),
            _ => self.many_to_one(it),
        }
    }

    fn barrier(&self) -> Result<u64> {
        let t = self.sync.barrier(self.node.id()).context("bench barrier")?;
        bench_hop(self.node.id(), "bench: left the barrier");
        self.released.store(t, std::sync::atomic::Ordering::Relaxed);
        Ok(t)
    }

    /// When this rank last left the barrier (the start of the last iteration).
    pub fn last_release(&self) -> u64 {
        self.released.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn finish(&self, released_ns: u64, done_ns: Option<u64>) -> Result<Option<f64>> {
        if done_ns.is_some() {
            bench_hop(self.node.id(), "bench: this rank is done");
        }
        let stamp = Stamp {
            released_ns,
            done_ns,
        };
        self.sync
            .finish(self.node.id(), stamp)
            .context("bench stamps")
    }

    /// Rank 1 gets an object rank 0 has put completely before the start.
    fn p2p(&self, it: usize) -> Result<Option<Measure>> {
        let node = self.node;
        let data = self.name(it, "data", 0);
        if let Some(s) = &self.socket {
            let released = self.barrier()?;
            let done = s.request()?;
            let total = self.finish(released, done)?;
            return Ok(total.map(only_total));
        }
        if node.id() == 0 {
            node.put(data.clone(), &self.payload)?;
        }
        let released = self.barrier()?;
        let done = match node.id() {
            1 => {
                let v = node.get_view(data.clone())?;
                let done = now_ns();
                check_pattern(&v, self.size)?;
                Some(done)
            }
            _ => None,
        };
        let total = self.finish(released, done)?;
        if node.id() == 0 {
            node.delete(data)?;
        }
        Ok(total.map(only_total))
    }

    /// Rank 0 puts after the start; every other rank gets it.
    fn broadcast(&self, it: usize) -> Result<Option<Measure>> {
        let node = self.node;
        let data = self.name(it, "data", 0);
        let released = self.barrier()?;
        let done = if node.id() == 0 {
            node.put(data.clone(), &self.payload)?;
            now_ns()
        } else {
            let v = match self.spec.algo {
                Algo::Phalanx => node.get_view(data.clone())?,
                Algo::Star | Algo::Socket => node.get_view_from(data.clone(), 0)?,
            };
            let done = now_ns();
            check_pattern(&v, self.size)?;
            done
        };
        let total = self.finish(released, Some(done))?;
        if node.id() == 0 {
            node.delete(data)?;
        }
        Ok(total.map(only_total))
    }

    /// The first rank that holds an input of a many-to-one collective: 1 with `--driver`
    /// (rank 0 coordinates holding none), else 0.
    fn first_rank(&self) -> u32 {
        u32::from(self.spec.driver)
    }

    /// Reduce, allreduce and gather: rank k puts its input k·interval after the start; rank 0
    /// combines them (and, for allreduce, every rank reads the result). With `--driver` rank
    /// 0 holds no input: ranks 1.. do.
    fn many_to_one(&self, it: usize) -> Result<Option<Measure>> {
        let node = self.node;
        let spec = self.spec;
        let n = node.num_nodes();
        let interval = Duration::from_millis(spec.arrival_interval_ms);
        // The ranks that hold an input: `first_rank..n`.
        let first_rank = self.first_rank();
        let holders = n - first_rank;
        if holders == 0 {
            bail!("--driver needs a second rank to hold an input");
        }
        // Reduce and allreduce of the first `num` inputs to be ready.
        let num = spec.first.map_or(holders, |k| k.clamp(1, holders));
        let inputs: Vec<ObjectId> = (first_rank..n).map(|k| self.name(it, "in", k)).collect();
        let own = || inputs[(node.id() - first_rank) as usize].clone();
        let target = self.name(it, "out", 0);
        // Rank k's input is ready k intervals after the start.
        let arrive = || std::thread::sleep(interval * node.id());
        // `--inputs written`: the input is in this rank's store before the barrier, sealed
        // when it is due (small ones, whose bytes travel with their announcement, are put).
        let holds = node.id() >= first_rank;
        let mut writer = match spec.inputs == Inputs::Written && self.size >= INLINE_LIMIT {
            true if holds => {
                let mut w = node.create(own(), self.size)?;
                w.write(&self.payload)?;
                Some(w)
            }
            _ => None,
        };
        let hand_in = |w: Option<ObjectWriter>| -> Result<u64> {
            match w {
                Some(w) => w.seal()?,
                None => node.put(own(), &self.payload)?,
            }
            bench_hop(node.id(), "bench: put returned");
            Ok(now_ns())
        };
        let released = self.barrier()?;
        if node.id() != 0 {
            let done = if spec.collective == Collective::Allreduce {
                arrive();
                // A participant hands in its input and reads the result in one call.
                let v = match writer.take() {
                    Some(w) => {
                        w.seal()?;
                        node.allreduce_read(target, self.size)?
                    }
                    None => node.allreduce_join(target, own(), &self.payload)?,
                };
                let done = now_ns();
                // Of a subset, only rank 0 knows which inputs were used: it checks.
                if num == holders {
                    check_sum(&v, &(first_rank..n).collect::<Vec<_>>(), self.size)?;
                }
                done
            } else {
                arrive();
                hand_in(writer.take())?
            };
            self.finish(released, Some(done))?;
            return Ok(None);
        }
        // Rank 0's input is due at the start (0 intervals late): it puts it, then combines,
        // so the coordinator knows the object's size as it chooses the algorithm. A driver
        // has none: it learns the size from the directory.
        let put_done = match spec.driver {
            true => now_ns(),
            false => hand_in(writer.take())?,
        };
        let (done, (degree, partitions), result, used) =
            self.combine_at_root(&inputs, &target, num)?;
        let done = done.max(put_done);
        let total = self
            .finish(released, Some(done))?
            .expect("rank 0 gets the time");
        // Checked once every rank is done, outside the timing.
        match (spec.collective, result) {
            (Collective::Gather, _) => {}
            (_, Some(v)) => check_sum(&v, &used, self.size)?,
            (_, None) => check_sum(&node.get_view(target.clone())?, &used, self.size)?,
        }
        for id in &inputs {
            node.delete(id.clone())?;
        }
        if spec.collective == Collective::Allreduce {
            node.delete_allreduce(target, self.size, inputs.len(), DType::F32)?;
        } else if spec.collective != Collective::Gather && spec.algo == Algo::Phalanx {
            node.delete(target)?;
        }
        // The num-th input to be ready is rank first_rank + num - 1's.
        let last_ready_at = (interval * (first_rank + num - 1)).as_secs_f64();
        Ok(Some(Measure {
            total,
            after_last_ready: Some((total - last_ready_at).max(0.0)),
            degree,
            partitions,
        }))
    }

    /// Rank 0's part of a many-to-one collective (reduce and allreduce of the first `num`
    /// inputs to be ready): when it was done, the degree of the tree, the result when the
    /// collective hands it back, and the ranks whose inputs it combined.
    fn combine_at_root(
        &self,
        inputs: &[ObjectId],
        target: &ObjectId,
        num: u32,
    ) -> Result<(u64, TreeShape, Option<ObjectView>, Vec<u32>)> {
        let node = self.node;
        let spec = self.spec;
        let n = node.num_nodes();
        // Input k is rank first_rank + k's.
        let first_rank = self.first_rank();
        match (spec.collective, spec.algo) {
            (Collective::Gather, Algo::Phalanx) => {
                let got = node.gather(inputs)?;
                let done = now_ns();
                for (k, v) in got.iter().enumerate() {
                    if *v != input_of(first_rank + k as u32, self.size) {
                        bail!("gathered input {k} differs");
                    }
                }
                Ok((done, (None, None), None, Vec::new()))
            }
            (Collective::Gather | Collective::Reduce, Algo::Star) => {
                // One input after another, combined at rank 0.
                let mut acc: Option<Vec<u8>> = None;
                for id in inputs {
                    let v = node.get(id.clone())?;
                    match &mut acc {
                        None => acc = Some(v),
                        Some(a) if spec.collective == Collective::Reduce => {
                            combine(ReduceOp::Sum, DType::F32, a, &v)
                        }
                        Some(_) => {}
                    }
                }
                let all = (first_rank..n).collect();
                Ok((now_ns(), (None, None), acc.map(ObjectView::Owned), all))
            }
            (Collective::Allreduce, Algo::Star) => {
                bail!("allreduce has no star baseline; use --degree")
            }
            _ => {
                let degree = match spec.degree {
                    Degree::Auto => None,
                    Degree::Fixed(d) => Some(d),
                    Degree::N => Some(n as usize),
                };
                let opts = ReduceOptions {
                    degree,
                    ..ReduceOptions::default()
                };
                let ranks = |used: &[ObjectId]| -> Vec<u32> {
                    used.iter()
                        .filter_map(|id| inputs.iter().position(|i| i == id))
                        .map(|k| first_rank + k as u32)
                        .collect()
                };
                if spec.collective == Collective::Allreduce {
                    // Rank 0 reads the target while it is being reduced, like every rank.
                    // Its own copy, with no copy made, as every rank's `allreduce_read`.
                    let (v, o) = node.allreduce_first(
                        target.clone(),
                        inputs,
                        num as usize,
                        ReduceOp::Sum,
                        DType::F32,
                        &opts,
                    )?;
                    // Trees shaped by arrival have no degree: recorded as 0.
                    let degree = if o.by_arrival { 0 } else { o.degree };
                    let shape = (Some(degree), Some(o.partitions));
                    Ok((now_ns(), shape, Some(v), ranks(&o.used)))
                } else {
                    // Done when the target is complete (on the root's node).
                    let o = node.reduce_with(
                        target.clone(),
                        inputs,
                        num as usize,
                        ReduceOp::Sum,
                        DType::F32,
                        &opts,
                    )?;
                    Ok((now_ns(), (Some(o.degree), None), None, ranks(&o.used)))
                }
            }
        }
    }
}

/// The degree of a reduce's tree and (allreduce) its partition count, for the record.
type TreeShape = (Option<usize>, Option<usize>);

/// A hop event of the benchmark itself (see `phalanx::hop`), for `--trace`.
fn bench_hop(node: u32, what: &'static str) {
    tracing::trace!(target: "phalanx::hop", node = node as u64, "{what}");
}

fn only_total(total: f64) -> Measure {
    Measure {
        total,
        after_last_ready: None,
        degree: None,
        partitions: None,
    }
}

/// The f32 input of `rank`: small integers, so sums are exact and easy to check.
fn input_of(rank: u32, size: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(size as usize);
    for i in 0..size / 4 {
        v.extend_from_slice(&(((i + rank as u64) % 7) as f32).to_le_bytes());
    }
    v
}

fn pattern(size: u64) -> Vec<u8> {
    (0..size).map(|i| (i * 31 % 251) as u8).collect()
}

fn check_pattern(v: &[u8], size: u64) -> Result<()> {
    let ok = v.len() as u64 == size
        && v.iter()
            .enumerate()
            .step_by(4099)
            .all(|(i, &b)| b == (i as u64 * 31 % 251) as u8);
    if !ok {
        bail!("benchmark object corrupted");
    }
    Ok(())
}

/// Whether `v` is the sum of the inputs of ranks `used`.
fn check_sum(v: &[u8], used: &[u32], size: u64) -> Result<()> {
    let ok = v.len() as u64 == size
        && (0..size / 4).step_by(1021).all(|i| {
            let want: u64 = used.iter().map(|&r| (i + r as u64) % 7).sum();
            let got = f32::from_le_bytes(
                v[i as usize * 4..i as usize * 4 + 4]
                    .try_into()
                    .expect("4 bytes"),
            );
            got == want as f32
        });
    if !ok {
        bail!("reduce result is wrong");
    }
    Ok(())
}
