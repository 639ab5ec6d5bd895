//! The SPMD benchmark behind `phalanx bench`: every rank runs [`run_rank`]; rank 0 reports.
//! Timing works as in the MPI benchmarks: every iteration starts at a barrier, every rank
//! stamps its own completion, and the iteration takes from the start to the last completion
//! (`sync.rs`: how the ranks meet and share a clock, never through Phalanx objects).

mod rounds;
mod socket;
pub mod sync;

use phalanx::Node;
use serde::Serialize;
use sync::RankSync;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Collective {
    /// Rank 1 gets an object that rank 0 holds; timed at rank 1 from call to last byte.
    P2p,
    /// Rank 0 puts, every other rank gets; timed from the put to the last receiver done.
    Broadcast,
    /// Every rank puts an f32 input (rank k after k·interval); rank 0 reduces them (sum).
    Reduce,
    /// Reduce to rank 0's target, which every rank gets while it is being reduced.
    Allreduce,
    /// Every rank puts an input; rank 0 gets them all concurrently.
    Gather,
}

/// Phalanx's own algorithm, or the baseline of a task system without collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Algo {
    Phalanx,
    /// Every transfer to or from rank 0, one after another.
    Star,
    /// p2p only, one process (`--local`): a plain TCP request on loopback answered with the
    /// object's bytes, the floor a get is measured against.
    Socket,
}

/// Where the directory entries of the benchmark's objects live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// On rank 0, the root of every collective (`ObjectId::homed`), as a task system's
    /// driver owns the entries of the objects it asked for: inputs reach the root in one
    /// message, a reader's lookup goes to the root.
    Root,
    /// Spread over the nodes by hashing the names.
    Hash,
}

/// How the many-to-one collectives' inputs come to be in their ranks' stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Inputs {
    /// Each rank puts its input (`Node::put`, a copy into its store) when it is due, inside
    /// the timing: the input is ready when it is put.
    Put,
    /// Each rank writes its input into its store before the barrier (`Node::create`, in
    /// place, as a task that computes its output there) and seals it when it is due: as
    /// Open MPI's inputs are in their buffers before its barrier. Objects under 64 KiB,
    /// whose bytes travel with their announcement, are put as with `put`.
    Written,
}

/// Reduce tree degree for the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Degree {
    Auto,
    Fixed(usize),
    /// d = n: the root takes every other input.
    N,
}

impl std::str::FromStr for Degree {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Degree::Auto),
            "n" => Ok(Degree::N),
            d => d
                .parse::<usize>()
                .ok()
                .filter(|&d| d >= 1)
                .map(Degree::Fixed)
                .ok_or_else(|| format!("degree must be auto, n or a positive number, got {d:?}")),
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchSpec {
    pub collective: Collective,
    pub algo: Algo,
    pub sizes: Vec<u64>,
    pub iters: usize,
    pub warmup: usize,
    pub arrival_interval_ms: u64,
    /// Reduce and allreduce: the first this many inputs to be ready (None: all).
    pub first: Option<u32>,
    /// Reduce and allreduce: rank 0 holds no input (a driver); ranks 1.. hold them.
    pub driver: bool,
    pub degree: Degree,
    pub placement: Placement,
    pub inputs: Inputs,
    /// Record and print the hops of the last iteration of every size.
    pub trace: bool,
}

/// One line of results (one size).
#[derive(Debug, Clone, Serialize)]
pub struct BenchRecord {
    pub collective: Collective,
    pub algo: Algo,
    pub transport: String,
    pub nodes: u32,
    pub size_bytes: u64,
    pub iters: usize,
    pub median_s: f64,
    pub min_s: f64,
    pub max_s: f64,
    /// 99th percentile (nearest rank).
    pub p99_s: f64,
    pub throughput_gbit_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arrival_interval_ms: Option<u64>,
    /// Reduce and allreduce of the first this many inputs to be ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first: Option<u32>,
    /// Rank 0 coordinated holding no input (`--driver`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub driver: bool,
    pub placement: Placement,
    /// Reduce, allreduce, gather: written in place before the barrier (`--inputs written`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inputs: Option<Inputs>,
    /// Reduce: the degree used (of the median run).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub degree: Option<usize>,
    /// Allreduce: partitions reduced side by side (1: one tree, then a broadcast).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partitions: Option<usize>,
    /// Median spread of the instants the ranks left the barrier (part of every time; ranks
    /// on rank 0's clock, multi-process runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub barrier_skew_s: Option<f64>,
    /// Reduce/allreduce: median time from the last input ready to the end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub after_last_ready_s: Option<f64>,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The nearest-rank percentile `p` (0..=100) of sorted `v`.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl BenchRecord {
    /// An OSU-style table line.
    pub fn table_row(&self) -> String {
        let mut row = format!(
            "{:>12} {:>14.2} {:>14.2} {:>14.2} {:>14.2} {:>12.3}",
            self.size_bytes,
            self.median_s * 1e6,
            self.p99_s * 1e6,
            self.min_s * 1e6,
            self.max_s * 1e6,
            self.throughput_gbit_s
        );
        if let Some(a) = self.after_last_ready_s {
            row += &format!(" {:>16.2}", a * 1e6);
        }
        match self.degree {
            // Trees shaped by the inputs' arrival (an allreduce whose inputs came one after
            // another): no degree.
            Some(0) => row += &format!(" {:>6}", "arr"),
            Some(d) => row += &format!(" {d:>6}"),
            None => {}
        }
        if let Some(p) = self.partitions {
            row += &format!(" {p:>5}");
        }
        if let Some(k) = self.barrier_skew_s {
            row += &format!(" {:>17.2}", k * 1e6);
        }
        row
    }

    pub fn table_header(&self) -> String {
        let mut h = format!(
            "# phalanx bench {:?} ({:?}) over {}, {} nodes{}{}\n# {:>10} {:>14} {:>14} {:>14} {:>14} {:>12}",
            self.collective,
            self.algo,
            self.transport,
            self.nodes,
            self.first
                .map_or(String::new(), |k| format!(", the first {k} inputs"))
                + if self.driver { ", rank 0 a driver" } else { "" }
                + if self.inputs == Some(Inputs::Written) {
                    ", inputs written before the barrier"
                } else {
                    ""
                },
            self.arrival_interval_ms
                .map_or(String::new(), |x| format!(", arrival interval {x} ms")),
            "size (B)",
            "median (us)",
            "p99 (us)",
            "min (us)",
            "max (us)",
            "Gbit/s"
        );
        if self.after_last_ready_s.is_some() {
            h += &format!(" {:>16}", "after last (us)");
        }
        if self.degree.is_some() {
            h += &format!(" {:>6}", "degree");
        }
        if self.partitions.is_some() {
            h += &format!(" {:>5}", "parts");
        }
        if self.barrier_skew_s.is_some() {
            h += &format!(" {:>17}", "barrier skew (us)");
        }
        h
    }
}

/// Parses "4096", "64K", "1M", "1G" and comma-separated lists of them.
pub fn parse_sizes(s: &str) -> std::result::Result<Vec<u64>, String> {
    s.split(',')
        .map(|p| {
            let p = p.trim();
            let (num, mult) = match p.chars().last() {
                Some('K' | 'k') => (&p[..p.len() - 1], 1u64 << 10),
                Some('M' | 'm') => (&p[..p.len() - 1], 1 << 20),
                Some('G' | 'g') => (&p[..p.len() - 1], 1 << 30),
                _ => (p, 1),
            };
            num.parse::<u64>()
                .map(|n| n * mult)
                .map_err(|e| format!("bad size {p:?}: {e}"))
        })
        .collect()
}

/// Runs one rank of the benchmark. Rank 0 returns the records (one per size).
pub fn run_rank(
    node: &Node,
    spec: &BenchSpec,
    sync: &dyn RankSync,
) -> anyhow::Result<Vec<BenchRecord>> {
    let n = node.num_nodes();
    let mut records = Vec::new();
    for &size in &spec.sizes {
        if matches!(
            spec.collective,
            Collective::Reduce | Collective::Allreduce | Collective::Gather
        ) && size % 4 != 0
        {
            anyhow::bail!(
                "{:?} uses f32 inputs: size {size} is not a multiple of 4",
                spec.collective
            );
        }
        let (mut times, mut after, mut degree) = (Vec::new(), Vec::new(), None);
        let mut partitions = None;
        let mut skews = Vec::new();
        let round = rounds::Round::new(node, spec, size, sync)?;
        let last = spec.iters + spec.warmup - 1;
        for it in 0..=last {
            // Every rank records its own hops (rank 0 prints to the terminal, the others to
            // their logs); the absolute stamps let `cluster/trace-merge.sh` interleave them.
            let trace = spec.trace && it == last;
            if trace {
                crate::trace::arm();
            }
            let m = round.run(it)?;
            if trace {
                // Keep recording until every rank is through: a rank done early still serves
                // the others (its shard, its copies).
                sync.barrier(node.id())?;
                let title = format!("{:?} ({:?}) {size} B", spec.collective, spec.algo);
                crate::trace::print(&title, round.last_release(), &crate::trace::take());
            }
            if let (Some(m), true) = (m, it >= spec.warmup) {
                skews.extend(sync.last_skew());
                times.push(m.total);
                after.extend(m.after_last_ready);
                degree = m.degree.or(degree);
                partitions = m.partitions.or(partitions);
            }
        }
        if node.id() == 0 {
            let med = median(&mut times);
            let asynchronous = matches!(
                spec.collective,
                Collective::Reduce | Collective::Allreduce | Collective::Gather
            );
            records.push(BenchRecord {
                collective: spec.collective,
                algo: spec.algo,
                transport: node.transport().name().into(),
                nodes: n,
                size_bytes: size,
                iters: times.len(),
                median_s: med,
                min_s: times[0],
                max_s: times[times.len() - 1],
                p99_s: percentile(&times, 99.0),
                throughput_gbit_s: size as f64 * 8.0 / med / 1e9,
                arrival_interval_ms: asynchronous.then_some(spec.arrival_interval_ms),
                first: spec.first,
                driver: spec.driver,
                placement: spec.placement,
                inputs: (asynchronous && spec.inputs == Inputs::Written).then_some(spec.inputs),
                degree,
                partitions,
                after_last_ready_s: (!after.is_empty()).then(|| median(&mut after)),
                barrier_skew_s: (!skews.is_empty()).then(|| median(&mut skews)),
            });
        }
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v[..5], 99.0), 5.0);
        assert_eq!(percentile(&[3.0], 99.0), 3.0);
    }
}
