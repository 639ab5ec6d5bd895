//! The SPMD benchmark behind `phalanx bench`: every rank runs [`run_rank`]; rank 0 measures
//! and reports. Markers (tiny inline objects) synchronise the ranks, so the same code runs
//! in one process, in separate processes, or on separate hosts.

use phalanx::ops::{combine, DType, ReduceOp};
use phalanx::{Error, Node, ObjectId, ReduceOptions, Result};
use serde::Serialize;
use std::time::{Duration, Instant};

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
    pub degree: Degree,
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
    pub throughput_gbit_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arrival_interval_ms: Option<u64>,
    /// Reduce: the degree used (of the median run).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub degree: Option<usize>,
    /// Reduce/allreduce: median time from the last input ready to the end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub after_last_ready_s: Option<f64>,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

impl BenchRecord {
    /// An OSU-style table line.
    pub fn table_row(&self) -> String {
        let mut row = format!(
            "{:>12} {:>14.2} {:>14.2} {:>14.2} {:>12.3}",
            self.size_bytes,
            self.median_s * 1e6,
            self.min_s * 1e6,
            self.max_s * 1e6,
            self.throughput_gbit_s
        );
        if let Some(a) = self.after_last_ready_s {
            row += &format!(" {:>16.2}", a * 1e6);
        }
        if let Some(d) = self.degree {
            row += &format!(" {d:>6}");
        }
        row
    }

    pub fn table_header(&self) -> String {
        let mut h = format!(
            "# phalanx bench {:?} ({:?}) over {}, {} nodes{}\n# {:>10} {:>14} {:>14} {:>14} {:>12}",
            self.collective,
            self.algo,
            self.transport,
            self.nodes,
            self.arrival_interval_ms
                .map_or(String::new(), |x| format!(", arrival interval {x} ms")),
            "size (B)",
            "median (us)",
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

struct Round<'a> {
    node: &'a Node,
    spec: &'a BenchSpec,
    size: u64,
    it: usize,
}

impl Round<'_> {
    fn name(&self, kind: &str, rank: u32) -> ObjectId {
        let c = format!("{:?}-{:?}", self.spec.collective, self.spec.algo);
        ObjectId::new(format!("bench/{c}/{kind}/{}/{}/{rank}", self.size, self.it))
    }

    fn mark(&self, kind: &str, payload: &[u8]) -> Result<()> {
        self.node.put(self.name(kind, self.node.id()), payload)
    }

    fn collect(&self, kind: &str, ranks: &[u32]) -> Result<Vec<Vec<u8>>> {
        ranks
            .iter()
            .map(|&r| self.node.get(self.name(kind, r)))
            .collect()
    }

    fn cleanup(&self, kinds: &[&str], ranks: &[u32]) -> Result<()> {
        for k in kinds {
            for &r in ranks {
                self.node.delete(self.name(k, r))?;
            }
        }
        Ok(())
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
    ok.then_some(()).ok_or_else(|| Error::Protocol {
        peer: 0,
        what: "benchmark object corrupted".into(),
    })
}

fn check_sum(v: &[u8], n: u32, size: u64) -> Result<()> {
    let ok = v.len() as u64 == size
        && (0..size / 4).step_by(1021).all(|i| {
            let want: u64 = (0..n as u64).map(|r| (i + r) % 7).sum();
            let got = f32::from_le_bytes(
                v[i as usize * 4..i as usize * 4 + 4]
                    .try_into()
                    .expect("4 bytes"),
            );
            got == want as f32
        });
    ok.then_some(()).ok_or_else(|| Error::Protocol {
        peer: 0,
        what: "reduce result is wrong".into(),
    })
}

/// The end of a multi-process benchmark: rank 0 says it is done, every other rank confirms
/// it saw that, and only then do the processes leave.
pub fn finish_barrier(node: &Node) -> Result<()> {
    let others = 1..node.num_nodes();
    if node.id() == 0 {
        node.put("bench/end", b"e")?;
        for k in others {
            node.get(format!("bench/left/{k}"))?;
        }
    } else {
        node.get("bench/end")?;
        node.put(format!("bench/left/{}", node.id()), b"l")?;
        // Stay until rank 0 has read the confirmation (rank 0 deletes nothing; the objects
        // are tiny and leave with the cluster).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while node.transport().is_connected(0) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    Ok(())
}

/// Runs one rank of the benchmark. Rank 0 returns the records (one per size).
pub fn run_rank(node: &Node, spec: &BenchSpec) -> Result<Vec<BenchRecord>> {
    let n = node.num_nodes();
    let all: Vec<u32> = (0..n).collect();
    let others: Vec<u32> = (1..n).collect();
    let mut records = Vec::new();
    for &size in &spec.sizes {
        if matches!(
            spec.collective,
            Collective::Reduce | Collective::Allreduce | Collective::Gather
        ) && size % 4 != 0
        {
            return Err(Error::InvalidArgument(format!(
                "{:?} uses f32 inputs: size {size} is not a multiple of 4",
                spec.collective
            )));
        }
        let payload = match spec.collective {
            Collective::P2p | Collective::Broadcast if node.id() == 0 => pattern(size),
            Collective::Reduce | Collective::Allreduce | Collective::Gather => {
                input_of(node.id(), size)
            }
            _ => Vec::new(),
        };
        let (mut times, mut after, mut degree) = (Vec::new(), Vec::new(), None);
        for it in 0..spec.iters + spec.warmup {
            let r = Round {
                node,
                spec,
                size,
                it,
            };
            let m = match spec.collective {
                Collective::P2p => p2p(&r, &payload)?,
                Collective::Broadcast => broadcast(&r, &payload, &others)?,
                Collective::Reduce | Collective::Allreduce | Collective::Gather => {
                    many_to_one(&r, &payload, &all)?
                }
            };
            if let (Some(m), true) = (m, it >= spec.warmup) {
                times.push(m.total);
                after.extend(m.after_last_ready);
                degree = m.degree.or(degree);
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
                throughput_gbit_s: size as f64 * 8.0 / med / 1e9,
                arrival_interval_ms: asynchronous.then_some(spec.arrival_interval_ms),
                degree,
                after_last_ready_s: (!after.is_empty()).then(|| median(&mut after)),
            });
        }
    }
    Ok(records)
}

struct Measure {
    total: f64,
    after_last_ready: Option<f64>,
    degree: Option<usize>,
}

fn p2p(r: &Round, payload: &[u8]) -> Result<Option<Measure>> {
    let node = r.node;
    let data = r.name("data", 0);
    match node.id() {
        0 => {
            r.collect("ready", &[1])?;
            node.put(data.clone(), payload)?;
            r.mark("go", b"g")?;
            let t = r.collect("done", &[1])?;
            node.delete(data)?;
            r.cleanup(&["ready", "done"], &[1])?;
            r.cleanup(&["go"], &[0])?;
            let total = f64::from_le_bytes(t[0][..8].try_into().expect("8 bytes"));
            Ok(Some(Measure {
                total,
                after_last_ready: None,
                degree: None,
            }))
        }
        1 => {
            // Wait until the put is complete so only the transfer is timed.
            r.mark("ready", b"r")?;
            node.get(r.name("go", 0))?;
            let t0 = Instant::now();
            let v = node.get_view(data)?;
            let t = t0.elapsed().as_secs_f64();
            check_pattern(&v, r.size)?;
            r.mark("done", &t.to_le_bytes())?;
            Ok(None)
        }
        _ => Ok(None),
    }
}

fn broadcast(r: &Round, payload: &[u8], receivers: &[u32]) -> Result<Option<Measure>> {
    let node = r.node;
    let data = r.name("data", 0);
    if node.id() == 0 {
        r.collect("ready", receivers)?;
        let t0 = Instant::now();
        node.put(data.clone(), payload)?;
        r.collect("done", receivers)?;
        let total = t0.elapsed().as_secs_f64();
        node.delete(data)?;
        r.cleanup(&["ready", "done"], receivers)?;
        return Ok(Some(Measure {
            total,
            after_last_ready: None,
            degree: None,
        }));
    }
    r.mark("ready", b"r")?;
    let v = match r.spec.algo {
        Algo::Phalanx => node.get_view(data)?,
        Algo::Star => node.get_view_from(data, 0)?,
    };
    r.mark("done", b"d")?;
    check_pattern(&v, r.size)?;
    Ok(None)
}

/// Reduce, allreduce and gather: inputs arrive at rank·interval after a common start.
fn many_to_one(r: &Round, payload: &[u8], all: &[u32]) -> Result<Option<Measure>> {
    let node = r.node;
    let spec = r.spec;
    let n = all.len() as u32;
    let interval = Duration::from_millis(spec.arrival_interval_ms);
    let inputs: Vec<ObjectId> = all.iter().map(|&k| r.name("in", k)).collect();
    let target = r.name("out", 0);
    let put_input = || -> Result<()> {
        std::thread::sleep(interval * node.id());
        node.put(inputs[node.id() as usize].clone(), payload)
    };
    if node.id() != 0 {
        r.mark("ready", b"r")?;
        node.get(r.name("go", 0))?;
        put_input()?;
        if spec.collective == Collective::Allreduce {
            let v = node.get_view(target)?;
            check_sum(&v, n, r.size)?;
            r.mark("done", b"d")?;
        }
        return Ok(None);
    }
    let others = &all[1..];
    r.collect("ready", others)?;
    r.mark("go", b"g")?;
    let t0 = Instant::now();
    let last_ready_at = interval * (n - 1);
    let (total, degree) = std::thread::scope(|s| -> Result<(f64, Option<usize>)> {
        let mine = s.spawn(put_input);
        let out = match (spec.collective, spec.algo) {
            (Collective::Gather, Algo::Phalanx) => {
                for (k, v) in node.gather(&inputs)?.iter().enumerate() {
                    if *v != input_of(k as u32, r.size) {
                        return Err(Error::Protocol {
                            peer: k as u32,
                            what: "gathered input differs".into(),
                        });
                    }
                }
                (t0.elapsed().as_secs_f64(), None)
            }
            (Collective::Gather, Algo::Star) | (Collective::Reduce, Algo::Star) => {
                // One input after another, combined at rank 0.
                let mut acc: Option<Vec<u8>> = None;
                for id in &inputs {
                    let v = node.get(id.clone())?;
                    match &mut acc {
                        None => acc = Some(v),
                        Some(a) if spec.collective == Collective::Reduce => {
                            combine(ReduceOp::Sum, DType::F32, a, &v)
                        }
                        Some(_) => {}
                    }
                }
                if spec.collective == Collective::Reduce {
                    check_sum(acc.as_deref().unwrap_or_default(), n, r.size)?;
                }
                (t0.elapsed().as_secs_f64(), None)
            }
            (_, algo) => {
                let degree = match spec.degree {
                    Degree::Auto => None,
                    Degree::Fixed(d) => Some(d),
                    Degree::N => Some(n as usize),
                };
                let opts = ReduceOptions {
                    degree,
                    ..ReduceOptions::default()
                };
                if algo == Algo::Star && spec.collective == Collective::Allreduce {
                    return Err(Error::InvalidArgument(
                        "allreduce has no star baseline; use --degree".into(),
                    ));
                }
                if spec.collective == Collective::Allreduce {
                    // Rank 0 reads the target while it is being reduced, like every rank.
                    let (v, outcome) =
                        node.allreduce(target.clone(), &inputs, ReduceOp::Sum, DType::F32, &opts)?;
                    r.collect("done", others)?;
                    let t = t0.elapsed().as_secs_f64();
                    check_sum(&v, n, r.size)?;
                    (t, Some(outcome.degree))
                } else {
                    // Done when the target is complete (on the root's node); the check is not
                    // part of the timing.
                    let outcome = node.reduce_with(
                        target.clone(),
                        &inputs,
                        n as usize,
                        ReduceOp::Sum,
                        DType::F32,
                        &opts,
                    )?;
                    let t = t0.elapsed().as_secs_f64();
                    check_sum(&node.get_view(target.clone())?, n, r.size)?;
                    (t, Some(outcome.degree))
                }
            }
        };
        mine.join().expect("input thread")?;
        Ok(out)
    })?;
    // Clean up for the next round.
    for id in &inputs {
        node.delete(id.clone())?;
    }
    if matches!(spec.collective, Collective::Reduce | Collective::Allreduce)
        && spec.algo == Algo::Phalanx
    {
        node.delete(target)?;
    }
    r.cleanup(&["ready"], others)?;
    if spec.collective == Collective::Allreduce {
        r.cleanup(&["done"], others)?;
    }
    r.cleanup(&["go"], &[0])?;
    let after = (total - last_ready_at.as_secs_f64()).max(0.0);
    Ok(Some(Measure {
        total,
        after_last_ready: Some(after),
        degree,
    }))
}
