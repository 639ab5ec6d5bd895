//! The SPMD benchmark behind `phalanx bench`: every rank runs [`run_rank`]; rank 0 puts,
//! the others get, and rank 0 measures and reports.

use crate::{Node, Result};
use serde::Serialize;
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Collective {
    /// Rank 1 gets an object that rank 0 holds; timed at rank 1.
    P2p,
    /// Rank 0 puts, every other rank gets; timed from the put to the last receiver done.
    Broadcast,
}

/// One line of results (one size).
#[derive(Debug, Clone, Serialize)]
pub struct BenchRecord {
    pub collective: Collective,
    pub algo: String,
    pub transport: String,
    pub nodes: u32,
    pub size_bytes: u64,
    pub iters: usize,
    pub median_s: f64,
    pub min_s: f64,
    pub max_s: f64,
    pub throughput_gbit_s: f64,
}

impl BenchRecord {
    fn new(c: Collective, node: &Node, size: u64, mut times: Vec<f64>) -> BenchRecord {
        times.sort_by(|a, b| a.total_cmp(b));
        let median = times[times.len() / 2];
        BenchRecord {
            collective: c,
            algo: "phalanx".into(),
            transport: node.transport().name().into(),
            nodes: node.num_nodes(),
            size_bytes: size,
            iters: times.len(),
            median_s: median,
            min_s: times[0],
            max_s: times[times.len() - 1],
            throughput_gbit_s: size as f64 * 8.0 / median / 1e9,
        }
    }

    /// An OSU-style table line.
    pub fn table_row(&self) -> String {
        format!(
            "{:>12} {:>14.2} {:>14.2} {:>14.2} {:>12.3}",
            self.size_bytes,
            self.median_s * 1e6,
            self.min_s * 1e6,
            self.max_s * 1e6,
            self.throughput_gbit_s
        )
    }

    pub fn table_header(c: Collective, transport: &str, nodes: u32) -> String {
        format!(
            "# phalanx {c:?} over {transport}, {nodes} nodes\n# {:>10} {:>14} {:>14} {:>14} {:>12}",
            "size (B)", "median (us)", "min (us)", "max (us)", "Gbit/s"
        )
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

fn name(kind: &str, size: u64, it: usize, rank: u32) -> String {
    format!("bench/{kind}/{size}/{it}/{rank}")
}

/// Waits until every rank `!= 0` put its marker for `(kind, size, it)`; rank 0 only.
fn collect(
    node: &Node,
    kind: &str,
    size: u64,
    it: usize,
    ranks: impl Iterator<Item = u32>,
) -> Result<Vec<Vec<u8>>> {
    ranks.map(|r| node.get(name(kind, size, it, r))).collect()
}

/// Runs one rank of the benchmark. Rank 0 returns the records.
pub fn run_rank(
    node: &Node,
    c: Collective,
    sizes: &[u64],
    iters: usize,
    warmup: usize,
) -> Result<Vec<BenchRecord>> {
    let rank = node.id();
    let n = node.num_nodes();
    let receivers: Vec<u32> = match c {
        Collective::P2p => vec![1],
        Collective::Broadcast => (1..n).collect(),
    };
    let mut records = Vec::new();
    for &size in sizes {
        let data: Vec<u8> = if rank == 0 {
            (0..size).map(|i| (i * 31 % 251) as u8).collect()
        } else {
            Vec::new()
        };
        let mut times = Vec::new();
        for it in 0..iters + warmup {
            let data_id = name("data", size, it, 0);
            if rank == 0 {
                collect(node, "ready", size, it, receivers.iter().copied())?;
                let t0 = Instant::now();
                node.put(data_id.as_str(), &data)?;
                if c == Collective::P2p {
                    node.put(name("go", size, it, 0), b"g")?;
                }
                let dones = collect(node, "done", size, it, receivers.iter().copied())?;
                let wall = t0.elapsed().as_secs_f64();
                let t = match c {
                    // Rank 1 timed its own get, from call to last byte.
                    Collective::P2p => {
                        f64::from_le_bytes(dones[0][..8].try_into().expect("8 bytes"))
                    }
                    Collective::Broadcast => wall,
                };
                if it >= warmup {
                    times.push(t);
                }
                node.delete(data_id.as_str())?;
                if c == Collective::P2p {
                    node.delete(name("go", size, it, 0))?;
                }
                for &r in &receivers {
                    node.delete(name("ready", size, it, r))?;
                    node.delete(name("done", size, it, r))?;
                }
            } else if receivers.contains(&rank) {
                if c == Collective::P2p {
                    // Wait until the put is complete so only the transfer is timed.
                    node.put(name("ready", size, it, rank), b"r")?;
                    node.get(name("go", size, it, 0))?;
                    let t0 = Instant::now();
                    let v = node.get_view(data_id.as_str())?;
                    let t = t0.elapsed().as_secs_f64();
                    check(&v, size)?;
                    node.put(name("done", size, it, rank), &t.to_le_bytes())?;
                } else {
                    node.put(name("ready", size, it, rank), b"r")?;
                    let v = node.get_view(data_id.as_str())?;
                    node.put(name("done", size, it, rank), b"d")?;
                    check(&v, size)?;
                }
            }
        }
        if rank == 0 {
            records.push(BenchRecord::new(c, node, size, times));
        }
    }
    Ok(records)
}

fn check(v: &[u8], size: u64) -> Result<()> {
    let ok = v.len() as u64 == size
        && v.iter()
            .enumerate()
            .step_by(4099)
            .all(|(i, &b)| b == (i as u64 * 31 % 251) as u8);
    if ok {
        Ok(())
    } else {
        Err(crate::Error::Protocol {
            peer: 0,
            what: "benchmark object corrupted".into(),
        })
    }
}
