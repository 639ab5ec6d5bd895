//! The `phalanx` command: the local demo, a node of a configured cluster, and benchmarks.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use phalanx::bench::{self, Algo, BenchRecord, BenchSpec, Collective, Degree};
use phalanx::transport::{NodeId, TcpConfig};
use phalanx::{cluster, ClusterConfig, LocalCluster, Node, NodeConfig, TransportKind};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(
    name = "phalanx",
    version,
    about = "Collective-communication object store"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Broadcast one object across a local in-process cluster and show the tree it formed.
    Demo {
        #[arg(long, default_value_t = 8)]
        nodes: u32,
        /// Object size (suffixes K, M, G).
        #[arg(long, default_value = "64M")]
        size: String,
        /// Receiver k starts its get k * stagger milliseconds after the put began.
        #[arg(long, default_value_t = 15)]
        stagger_ms: u64,
        #[arg(long, value_enum, default_value = "tcp")]
        transport: TransportArg,
        #[arg(long, default_value = "4M")]
        chunk_size: String,
    },
    /// Run node K of a cluster described in a TOML file, until killed.
    Node {
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        id: NodeId,
    },
    /// SPMD benchmark: start once per node (or use --local N).
    Bench(BenchArgs),
}

#[derive(clap::Args)]
struct BenchArgs {
    /// One or more of p2p, broadcast, reduce, allreduce, gather (comma-separated; all
    /// run in the same cluster, so they can serve as each other's baselines).
    #[arg(value_enum, value_delimiter = ',', required = true)]
    collective: Vec<Collective>,
    /// phalanx, or star: every transfer to or from rank 0, one after another.
    #[arg(long, value_enum, default_value = "phalanx")]
    algo: Algo,
    /// Reduce tree degree: auto, n, or a number.
    #[arg(long, default_value = "auto")]
    degree: Degree,
    /// Rank k's input becomes ready k * this many milliseconds late (reduce, allreduce,
    /// gather).
    #[arg(long, default_value_t = 0)]
    arrival_interval_ms: u64,
    #[arg(long)]
    config: Option<PathBuf>,
    /// This process's rank; else PHALANX_RANK, else SLURM_PROCID.
    #[arg(long)]
    id: Option<NodeId>,
    /// Run on an in-process cluster of N nodes over loopback instead.
    #[arg(long)]
    local: Option<u32>,
    /// Sizes, e.g. 1K,64K,1M,16M,64M.
    #[arg(long, default_value = "1K,64K,1M,16M,64M")]
    size: String,
    #[arg(long, default_value_t = 10)]
    iters: usize,
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// One JSON object per line and size instead of a table.
    #[arg(long)]
    json: bool,
    #[arg(long, value_enum, default_value = "tcp")]
    transport: TransportArg,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum TransportArg {
    Tcp,
    Rdma,
}

fn one_size(s: &str) -> Result<u64> {
    match bench::parse_sizes(s).map_err(anyhow::Error::msg)?[..] {
        [v] => Ok(v),
        _ => bail!("expected one size, got {s:?}"),
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("phalanx: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Demo {
            nodes,
            size,
            stagger_ms,
            transport,
            chunk_size,
        } => {
            if transport == TransportArg::Rdma {
                bail!("the rdma transport is not built into this binary yet");
            }
            demo(nodes, one_size(&size)?, stagger_ms, one_size(&chunk_size)?)
        }
        Cmd::Node { config, id } => {
            let cfg = ClusterConfig::load(&config)?;
            let node = cluster::start_node(&cfg, id, false)
                .with_context(|| format!("starting node {id}"))?;
            println!(
                "node {} up: {} nodes over {:?}",
                node.id(),
                node.num_nodes(),
                cfg.transport
            );
            loop {
                std::thread::park();
            }
        }
        Cmd::Bench(args) => bench_cmd(args),
    }
}

fn bench_cmd(a: BenchArgs) -> Result<()> {
    let sizes = bench::parse_sizes(&a.size).map_err(anyhow::Error::msg)?;
    if a.iters == 0 {
        bail!("--iters must be at least 1");
    }
    let specs: Vec<BenchSpec> = a
        .collective
        .iter()
        .map(|&c| BenchSpec {
            collective: c,
            algo: a.algo,
            sizes: sizes.clone(),
            iters: a.iters,
            warmup: a.warmup,
            arrival_interval_ms: a.arrival_interval_ms,
            degree: a.degree,
        })
        .collect();
    let run_all = |node: &Node| -> phalanx::Result<Vec<Vec<BenchRecord>>> {
        specs.iter().map(|s| bench::run_rank(node, s)).collect()
    };
    let records = match (a.local, &a.config) {
        (Some(n), _) => {
            if a.transport == TransportArg::Rdma {
                bail!("the rdma transport is not built into this binary yet");
            }
            if n < 2 {
                bail!("--local needs at least 2 nodes");
            }
            let arena = sizes.iter().max().copied().unwrap_or(0) * (n as u64 + 4) + (64 << 20);
            let cfg = NodeConfig {
                arena_size: arena,
                ..NodeConfig::default()
            };
            let c = LocalCluster::start(n, cfg, TcpConfig::default())?;
            let results: Vec<_> = std::thread::scope(|s| {
                let hs: Vec<_> = c
                    .nodes
                    .iter()
                    .map(|node| s.spawn(|| run_all(node)))
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().expect("rank thread"))
                    .collect()
            });
            let mut rank0 = Vec::new();
            for (k, r) in results.into_iter().enumerate() {
                let r = r.with_context(|| format!("rank {k}"))?;
                if k == 0 {
                    rank0 = r;
                }
            }
            rank0
        }
        (None, Some(path)) => {
            let mut cfg = ClusterConfig::load(path)?;
            if a.transport == TransportArg::Rdma {
                cfg.transport = TransportKind::Rdma;
            }
            let rank = match a.id {
                Some(r) => r,
                None => rank_from_env()?,
            };
            let node = cluster::start_node(&cfg, rank, false)
                .with_context(|| format!("starting rank {rank}"))?;
            let r = run_all(&node).with_context(|| format!("rank {rank}"))?;
            // Let the other ranks finish their last deletes before leaving.
            std::thread::sleep(Duration::from_millis(300));
            node.shutdown();
            if rank != 0 {
                return Ok(());
            }
            r
        }
        (None, None) => bail!("give --config FILE (one process per node) or --local N"),
    };
    print_records(&records, a.json);
    Ok(())
}

fn rank_from_env() -> Result<NodeId> {
    for var in ["PHALANX_RANK", "SLURM_PROCID"] {
        if let Ok(v) = std::env::var(var) {
            return v
                .parse()
                .with_context(|| format!("{var}={v:?} is not a rank"));
        }
    }
    bail!("no rank: pass --id, or set PHALANX_RANK or SLURM_PROCID")
}

fn print_records(groups: &[Vec<BenchRecord>], json: bool) {
    for records in groups {
        if json {
            for r in records {
                println!("{}", serde_json::to_string(r).expect("records serialise"));
            }
            continue;
        }
        if let Some(r) = records.first() {
            println!("{}", r.table_header());
        }
        for r in records {
            println!("{}", r.table_row());
        }
    }
}

fn demo(n: u32, size: u64, stagger_ms: u64, chunk: u64) -> Result<()> {
    if n < 2 {
        bail!("the demo needs at least 2 nodes");
    }
    let cfg = NodeConfig {
        arena_size: size * 2 + (64 << 20),
        chunk_size: chunk,
        ..NodeConfig::default()
    };
    println!("starting {n} nodes over TCP on 127.0.0.1, object of {size} bytes, chunks of {chunk}");
    let c = LocalCluster::start(n, cfg, TcpConfig::default())?;
    let data: Vec<u8> = (0..size)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let t0 = Instant::now();
    let results: Vec<Result<(u32, Duration, Duration, bool)>> = std::thread::scope(|s| {
        let hs: Vec<_> = (1..n)
            .map(|k| {
                let node: &Node = &c.nodes[k as usize];
                let data = &data;
                s.spawn(move || -> Result<(u32, Duration, Duration, bool)> {
                    std::thread::sleep(Duration::from_millis(stagger_ms * k as u64));
                    let start = t0.elapsed();
                    let v = node.get_view("demo-object")?;
                    let end = t0.elapsed();
                    Ok((k, start, end, *v == data[..]))
                })
            })
            .collect();
        c.nodes[0].put("demo-object", &data).expect("put");
        hs.into_iter()
            .map(|h| h.join().expect("receiver thread"))
            .collect()
    });
    let put_done = t0.elapsed();
    println!(
        "node 0 put the object in {:.1} ms (receivers may stream it meanwhile)",
        put_done.as_secs_f64() * 1e3
    );
    println!(
        "\n{:>6} {:>8} {:>10} {:>10} {:>10} {:>9}  bytes",
        "node", "source", "start ms", "done ms", "took ms", "Gbit/s"
    );
    let mut all_ok = true;
    let mut parent = vec![None; n as usize];
    for r in &results {
        let (k, start, end, ok) = match r {
            Ok(v) => *v,
            Err(e) => {
                all_ok = false;
                println!("a receiver failed: {e:#}");
                continue;
            }
        };
        all_ok &= ok;
        let log = c.nodes[k as usize].transfer_log();
        let src = log.last().map(|l| l.source);
        parent[k as usize] = src;
        let took = (end - start).as_secs_f64();
        println!(
            "{:>6} {:>8} {:>10.1} {:>10.1} {:>10.1} {:>9.2}  {}",
            k,
            src.map_or("-".into(), |s| s.to_string()),
            start.as_secs_f64() * 1e3,
            end.as_secs_f64() * 1e3,
            took * 1e3,
            size as f64 * 8.0 / took / 1e9,
            if ok { "identical" } else { "DIFFERENT" }
        );
    }
    println!("\nbroadcast tree (who fetched from whom):");
    print_tree(0, &parent, 0);
    let last = results
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .map(|r| r.2)
        .max()
        .unwrap_or_default();
    println!(
        "\nlast receiver done {:.1} ms after the put began",
        last.as_secs_f64() * 1e3
    );
    c.shutdown();
    if !all_ok {
        bail!("verification failed");
    }
    println!("all {} copies verified byte for byte", n - 1);
    Ok(())
}

fn print_tree(node: usize, parent: &[Option<u32>], depth: usize) {
    println!(
        "{}node {node}",
        "  ".repeat(depth) + if depth > 0 { "└─ " } else { "" }
    );
    for (k, p) in parent.iter().enumerate() {
        if *p == Some(node as u32) {
            print_tree(k, parent, depth + 1);
        }
    }
}
