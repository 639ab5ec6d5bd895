//! The `phalanx` command: the local demo, a node of a configured cluster, and benchmarks.

mod bench;
mod info;
mod plot;
mod trace;

use anyhow::{bail, Context, Result};
use bench::sync::{LocalSync, RankSync, TcpSync};
use bench::{Algo, BenchRecord, BenchSpec, Collective, Degree, Placement};
use clap::{Parser, Subcommand};
use phalanx::transport::NodeId;
use phalanx::{
    cluster, ClusterConfig, FaultAction, FaultPlan, LocalCluster, Node, NodeConfig, TransportKind,
    TransportSettings,
};
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
        #[command(flatten)]
        transport: TransportOpts,
        #[arg(long, default_value = "4M")]
        chunk_size: String,
    },
    /// Run node K of a cluster described in a TOML file, until killed or stdin closes.
    Node(NodeArgs),
    /// SPMD benchmark: start once per node (or use --local N).
    Bench(BenchArgs),
    /// What a user checks first on an RDMA node: the verbs library, devices, ports, GIDs,
    /// NUMA placement, and what Phalanx would pick with the current config. Exits 0 even
    /// where there is no verbs library or device (it says so).
    Info(info::InfoArgs),
    /// Print a fresh cluster secret (32 bytes from the OS random number generator, in hex):
    /// put it in the cluster config (`secret = "..."`), in a file it names (`secret_file`), or
    /// in PHALANX_SECRET for every node.
    Secret,
    /// Render `--json` bench records (JSON lines) as SVG plots: latency against size and
    /// against arrival interval, one line per algorithm.
    Plot {
        /// A file of JSON lines appended by `phalanx bench --json` ('#' lines are ignored).
        results: PathBuf,
        /// Directory for the SVG files.
        #[arg(long, default_value = ".")]
        out: PathBuf,
    },
}

#[derive(clap::Args)]
struct BenchArgs {
    /// One or more of p2p, broadcast, reduce, allreduce, gather (comma-separated; all
    /// run in the same cluster, so they can serve as each other's baselines).
    #[arg(value_enum, value_delimiter = ',', required = true)]
    collective: Vec<Collective>,
    /// phalanx, star (every transfer to or from rank 0, one after another) or socket (p2p
    /// with --local: a plain TCP request answered with the bytes); several, comma-separated,
    /// run one after another in the same cluster (e.g. phalanx,socket).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "phalanx")]
    algo: Vec<Algo>,
    /// Reduce tree degree: auto, n, or a number.
    #[arg(long, default_value = "auto")]
    degree: Degree,
    /// Directory entries of the benchmark's objects: on rank 0, the root of every collective
    /// (root), or spread by hashing their names (hash).
    #[arg(long, value_enum, default_value = "root")]
    placement: Placement,
    /// Reduce, allreduce, gather: each rank puts its input when it is due (put), or writes
    /// it into its store in place before the barrier and seals it when it is due (written).
    #[arg(long, value_enum, default_value = "put")]
    inputs: bench::Inputs,
    /// Rank k's input becomes ready k * this many milliseconds late (reduce, allreduce,
    /// gather).
    #[arg(long, default_value_t = 0)]
    arrival_interval_ms: u64,
    /// Reduce and allreduce combine the first K inputs to be ready, of one per rank
    /// (`allreduce_first`); default: all of them.
    #[arg(long)]
    first: Option<u32>,
    /// Reduce and allreduce: rank 0 coordinates them holding no input of its own (a driver,
    /// as in a task system); the inputs are those of ranks 1 to n - 1.
    #[arg(long)]
    driver: bool,
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
    /// With --local: how long a caller polls for a reply (yielding) before it sleeps, in us
    /// (default: the node's default). Across processes, `spin_wait_us` in the config.
    #[arg(long)]
    spin_wait_us: Option<u64>,
    /// With --local: `on-demand` makes links on first use whatever the cluster size (by
    /// default a mesh up to 32 nodes, on demand beyond); across processes, `connect` in the
    /// config.
    #[arg(long, value_enum)]
    connect: Option<ConnectArg>,
    /// With --local: after the runs, node N/2 goes silent (a hung host: links open, nothing
    /// sent) and the time until each other node believes it dead is printed.
    #[arg(long)]
    freeze_one: bool,
    /// One JSON object per line and size instead of a table.
    #[arg(long)]
    json: bool,
    /// Print every hop (thread or node change) of the last iteration of each size to stderr,
    /// with its time: where the microseconds go.
    #[arg(long)]
    trace: bool,
    /// Where rank 0 listens for the other ranks' barrier and timing messages (a side channel
    /// of the benchmark, not Phalanx traffic); default: node 0's address, port + 1000.
    #[arg(long)]
    sync_addr: Option<std::net::SocketAddr>,
    #[command(flatten)]
    transport: TransportOpts,
}

/// How long the ranks of a multi-process bench wait for each other to show up.
const SYNC_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(clap::Args)]
struct NodeArgs {
    #[arg(long)]
    config: PathBuf,
    #[arg(long)]
    id: NodeId,
    /// This is a restarted node: link to whichever peers are alive.
    #[arg(long)]
    rejoin: bool,
    /// Put an object of this many bytes (pattern data) once up: NAME=SIZE; repeatable.
    #[arg(long, value_name = "NAME=SIZE")]
    put: Vec<String>,
    /// Get an object once up and check its pattern; repeatable.
    #[arg(long, value_name = "NAME")]
    get: Vec<String>,
    /// Wait this long before the gets.
    #[arg(long, default_value_t = 0)]
    get_delay_ms: u64,
    /// Fault injection: SIGKILL this process once it has served this many bytes of
    /// --fault-object (or of any object: "*") in one transfer.
    #[arg(long, requires = "fault_after_bytes")]
    fault_object: Option<String>,
    #[arg(long)]
    fault_after_bytes: Option<u64>,
    /// Exit when standard input closes (for test harnesses) instead of running forever.
    #[arg(long)]
    exit_on_stdin_eof: bool,
}

#[derive(clap::Args)]
struct TransportOpts {
    #[arg(long, value_enum, default_value = "tcp")]
    transport: Transport,
    /// Verbs device (transport rdma); default: the first one.
    #[arg(long)]
    device: Option<String>,
    /// RoCE GID index (transport rdma); default: the IPv4-mapped GID.
    #[arg(long)]
    gid_index: Option<u8>,
}

/// The values of `--connect`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ConnectArg {
    OnDemand,
}

/// The values of `--transport`: the library's [`TransportKind`] (which does not depend on clap).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Transport {
    Tcp,
    Rdma,
}

impl From<Transport> for TransportKind {
    fn from(t: Transport) -> TransportKind {
        match t {
            Transport::Tcp => TransportKind::Tcp,
            Transport::Rdma => TransportKind::Rdma,
        }
    }
}

impl TransportOpts {
    fn kind(&self) -> TransportKind {
        self.transport.into()
    }

    fn settings(&self) -> Result<TransportSettings> {
        Ok(TransportSettings::new(
            self.kind(),
            Duration::from_secs(1),
            self.device.clone(),
            self.gid_index,
        )?)
    }
}

fn one_size(s: &str) -> Result<u64> {
    match bench::parse_sizes(s).map_err(anyhow::Error::msg)?[..] {
        [v] => Ok(v),
        _ => bail!("expected one size, got {s:?}"),
    }
}

fn main() {
    let cli = Cli::parse();
    init_logging(matches!(&cli.cmd, Cmd::Bench(b) if b.trace));
    if let Err(e) = run(cli) {
        eprintln!("phalanx: error: {}", error_line(&e));
        std::process::exit(1);
    }
}

/// The error and its causes on one line, like `{:#}`, but without repeating a cause that a
/// wrapper already printed as the end of its own message ("transport: X" caused by "X").
fn error_line(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let s = cause.to_string();
        if !out.is_empty() && out.ends_with(&s) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&s);
    }
    out.replace('\n', " ")
}

/// Logs to stderr as `RUST_LOG` says (default: warnings); with `hops`, the hop events are
/// recorded for `bench --trace` as well.
fn init_logging(hops: bool) {
    use tracing_subscriber::prelude::*;
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(filter);
    let hop_filter = tracing_subscriber::filter::Targets::new()
        .with_target(phalanx::hop::HOP_TARGET, tracing::Level::TRACE);
    let recorder = hops.then(|| trace::HopRecorder.with_filter(hop_filter));
    tracing_subscriber::registry()
        .with(fmt)
        .with(recorder)
        .init();
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Demo {
            nodes,
            size,
            stagger_ms,
            transport,
            chunk_size,
        } => demo(
            nodes,
            one_size(&size)?,
            stagger_ms,
            one_size(&chunk_size)?,
            transport.settings()?,
        ),
        Cmd::Node(args) => node_cmd(args),
        Cmd::Bench(args) => bench_cmd(args),
        Cmd::Info(args) => info::run(args),
        Cmd::Secret => {
            println!("{}", phalanx::transport::auth::generate_secret_text()?);
            Ok(())
        }
        Cmd::Plot { results, out } => {
            for f in plot::plot(&results, &out)? {
                println!("{}", f.display());
            }
            Ok(())
        }
    }
}

fn bench_cmd(a: BenchArgs) -> Result<()> {
    let sizes = bench::parse_sizes(&a.size).map_err(anyhow::Error::msg)?;
    if a.iters == 0 {
        bail!("--iters must be at least 1");
    }
    let many_to_one = [
        bench::Collective::Reduce,
        bench::Collective::Allreduce,
        bench::Collective::Gather,
    ];
    if a.driver && !a.collective.iter().all(|c| many_to_one.contains(c)) {
        bail!("--driver applies to reduce, allreduce and gather only");
    }
    let specs: Vec<BenchSpec> = a
        .collective
        .iter()
        .flat_map(|&c| a.algo.iter().map(move |&algo| (c, algo)))
        .map(|(c, algo)| BenchSpec {
            collective: c,
            algo,
            sizes: sizes.clone(),
            iters: a.iters,
            warmup: a.warmup,
            arrival_interval_ms: a.arrival_interval_ms,
            first: a.first,
            driver: a.driver,
            degree: a.degree,
            placement: a.placement,
            inputs: a.inputs,
            trace: a.trace,
        })
        .collect();
    let run_all = |node: &Node, sync: &dyn RankSync| -> Result<Vec<Vec<BenchRecord>>> {
        specs
            .iter()
            .map(|s| bench::run_rank(node, s, sync))
            .collect()
    };
    let records = match (a.local, &a.config) {
        (Some(n), _) => {
            if n < 2 {
                bail!("--local needs at least 2 nodes");
            }
            raise_open_files_limit();
            // Gather's root holds every rank's object; the other collectives a few per node.
            let gather = a.collective.contains(&Collective::Gather);
            let copies = if gather { n as u64 + 4 } else { 8 };
            let arena = sizes.iter().max().copied().unwrap_or(0) * copies + (64 << 20);
            let d = NodeConfig::default();
            let cfg = NodeConfig {
                arena_size: arena,
                spin_wait: a.spin_wait_us.map_or(d.spin_wait, Duration::from_micros),
                ..d
            };
            let mut settings = a.transport.settings()?;
            if a.connect == Some(ConnectArg::OnDemand) {
                settings.set_on_demand(true);
            }
            let heartbeat = settings.heartbeat_timeout();
            let started = Instant::now();
            let c = LocalCluster::start_with(n, cfg, settings)?;
            let sync = LocalSync::new(n);
            let results: Vec<_> = std::thread::scope(|s| {
                let hs: Vec<_> = c
                    .nodes
                    .iter()
                    .map(|node| {
                        s.spawn(|| {
                            let r = run_all(node, &sync);
                            if r.is_err() {
                                sync.abort();
                            }
                            r
                        })
                    })
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
            print_records(&rank0, a.json);
            let largest = sizes.iter().max().copied().unwrap_or(0);
            print_scale(&c.nodes, started.elapsed(), heartbeat, largest, a.json);
            if a.freeze_one {
                print_silent_death(&c.nodes, heartbeat, a.json);
            }
            return Ok(());
        }
        (None, Some(path)) => {
            let mut cfg = ClusterConfig::load(path)?;
            if a.transport.kind() == TransportKind::Rdma {
                cfg.transport = TransportKind::Rdma;
                cfg.device = a.transport.device.clone().or(cfg.device);
                cfg.gid_index = a.transport.gid_index.or(cfg.gid_index);
            }
            let rank = match a.id {
                Some(r) => r,
                None => phalanx::cluster::rank_from_env()?,
            };
            let node = cluster::start_node(&cfg, rank, false)
                .with_context(|| format!("starting rank {rank}"))?;
            let sync_addr = match a.sync_addr {
                Some(addr) => addr,
                None => {
                    let mut addr = cfg.addr_of(0).context("node 0 is not in the config")?;
                    addr.set_port(addr.port().checked_add(1000).context("node 0's port")?);
                    addr
                }
            };
            let sync = TcpSync::connect(rank, cfg.nodes.len() as u32, sync_addr, SYNC_TIMEOUT)
                .with_context(|| format!("rank {rank}: bench sync with rank 0 at {sync_addr}"))?;
            let r = run_all(&node, &sync).with_context(|| format!("rank {rank}"))?;
            // Final barrier: nobody leaves (taking its directory shard and its copies along)
            // while rank 0 still needs them.
            sync.barrier(rank)
                .with_context(|| format!("rank {rank}: final barrier"))?;
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

/// Raises the limit on open files: an in-process cluster holds both ends of every link (three
/// descriptors each), 256 nodes some 20,000. Up to 2^20 where the process may raise its hard
/// limit (root), else the soft limit to the hard one.
fn raise_open_files_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    const WANT: u64 = 1 << 20;
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return;
    };
    if hard < WANT && setrlimit(Resource::RLIMIT_NOFILE, WANT, WANT).is_ok() {
        return;
    }
    if soft < hard {
        if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            tracing::warn!("cannot raise the open files limit to {hard}: {e}");
        }
    }
}

/// The smallest, the median (the upper one of an even count) and the largest of `v`; None
/// if it is empty.
fn min_median_max(mut v: Vec<f64>) -> Option<(f64, f64, f64)> {
    v.sort_by(f64::total_cmp);
    Some((*v.first()?, v[v.len() / 2], *v.last()?))
}

/// Node N/2 of an in-process cluster goes silent (`Node::freeze`): how long each other node
/// takes to believe it dead, against the bound of the heartbeat timeout plus one heartbeat
/// period (the watchers' silence check); polled every millisecond for ten bounds at most.
fn print_silent_death(nodes: &[Node], heartbeat: Duration, json: bool) {
    let n = nodes.len();
    let victim = n / 2;
    let bound = heartbeat + heartbeat / 4;
    // First the heartbeats of a quiet cluster, over eight periods.
    let sent = |k: usize| {
        nodes[k]
            .transport()
            .link_counts()
            .map_or(0, |l| l.heartbeats_sent)
    };
    let before: Vec<u64> = (0..n).map(sent).collect();
    let quiet = heartbeat * 2;
    std::thread::sleep(quiet);
    let periods = quiet.as_secs_f64() / (heartbeat.as_secs_f64() / 4.0);
    let per: Vec<f64> = (0..n)
        .map(|k| (sent(k) - before[k]) as f64 / periods)
        .collect();
    let (q0, q1, q2) = min_median_max(per).unwrap_or_default();
    if json {
        println!(
            "{}",
            serde_json::json!({"quiet_heartbeats_per_period": {"nodes": n, "min": q0,
                "median": q1, "max": q2}})
        );
    } else {
        println!(
            "# quiet cluster: heartbeats per node per period min/median/max {q0:.1}/{q1:.1}/{q2:.1} \
             (over {periods:.0} periods)"
        );
    }
    let t0 = Instant::now();
    let silent = nodes[victim].freeze();
    let mut learnt: Vec<Option<Duration>> = vec![None; n];
    learnt[victim] = Some(Duration::ZERO);
    while t0.elapsed() < bound * 10 {
        for (k, node) in nodes.iter().enumerate() {
            if learnt[k].is_none() && node.believes_down(victim as u32) {
                learnt[k] = Some(t0.elapsed());
            }
        }
        if learnt.iter().all(Option::is_some) {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let times: Vec<f64> = learnt
        .iter()
        .enumerate()
        .filter(|&(k, _)| k != victim)
        .filter_map(|(_, t)| t.map(|t| t.as_secs_f64() * 1e3))
        .collect();
    let (told, others) = (times.len(), n - 1);
    let spread = min_median_max(times);
    let (lo, med, hi) = (
        spread.map(|s| s.0),
        spread.map(|s| s.1),
        spread.map(|s| s.2),
    );
    let ms = |t: Option<f64>| t.map_or("-".to_string(), |t| format!("{t:.0}"));
    if json {
        println!(
            "{}",
            serde_json::json!({"silent_death": victim, "nodes": n, "silent": silent,
                "learnt_by": told, "of": others, "min_ms": lo, "median_ms": med,
                "max_ms": hi, "bound_ms": bound.as_secs_f64() * 1e3})
        );
    } else {
        println!(
            "# node {victim} went silent{}: {told} of {others} nodes believed it dead after \
             min/median/max {}/{}/{} ms (bound: heartbeat timeout + one period = {} ms)",
            if silent {
                ""
            } else {
                " (killed: the transport cannot go silent)"
            },
            ms(lo),
            ms(med),
            ms(hi),
            bound.as_millis()
        );
    }
}

/// What each node of an in-process cluster used: the most threads it ran at once, its links
/// (open at the end, most at once) and the heartbeats it sent per heartbeat period (a quarter
/// of `heartbeat`) over `elapsed`. The process's thread count is printed beside the sum of the
/// nodes' as a check of the accounting.
/// Per node of an in-process bench: peak threads, links, heartbeats; and the process's peak
/// memory (with `largest`, the largest object size of the run, which it mostly holds).
fn print_scale(nodes: &[Node], elapsed: Duration, heartbeat: Duration, largest: u64, json: bool) {
    struct Row {
        id: u32,
        peak: usize,
        live: usize,
        links: phalanx::transport::LinkCounts,
        hb_per_period: f64,
    }
    let counts = phalanx::transport::threads::counts();
    let periods = (elapsed.as_secs_f64() / (heartbeat / 4).as_secs_f64()).max(1.0);
    let rows: Vec<Row> = nodes
        .iter()
        .map(|n| {
            let t = counts.get(&n.id()).copied().unwrap_or_default();
            let links = n.transport().link_counts().unwrap_or_default();
            Row {
                id: n.id(),
                peak: t.peak,
                live: t.live,
                hb_per_period: links.heartbeats_sent as f64 / periods,
                links,
            }
        })
        .collect();
    let status = |field: &str| {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix(field).map(|v| v.trim().to_string()))
            })
    };
    let process = status("Threads:").unwrap_or_else(|| "?".into());
    // The process's peak resident memory (all nodes of the bench share the process).
    let peak_rss: Option<u64> = status("VmHWM:")
        .and_then(|v| v.trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib << 10);
    let live: usize = rows.iter().map(|r| r.live).sum();
    if json {
        if let Some(rss) = peak_rss {
            println!(
                "{}",
                serde_json::json!({"scale_process": true, "nodes": nodes.len(),
                    "largest_size_bytes": largest, "peak_rss_bytes": rss,
                    "peak_rss_per_node_bytes": rss / nodes.len().max(1) as u64})
            );
        }
        for r in &rows {
            println!(
                "{}",
                serde_json::json!({"scale_node": r.id, "nodes": nodes.len(),
                    "peak_threads": r.peak, "threads_now": r.live, "links_open": r.links.open,
                    "links_peak": r.links.peak, "links_idle_closed": r.links.idle_closed,
                    "heartbeats_per_period": r.hb_per_period})
            );
        }
        return;
    }
    let stat =
        |f: &dyn Fn(&Row) -> f64| min_median_max(rows.iter().map(f).collect()).unwrap_or_default();
    let (t0, t1, t2) = stat(&|r| r.peak as f64);
    let (l0, l1, l2) = stat(&|r| r.links.peak as f64);
    let (h0, h1, h2) = stat(&|r| r.hb_per_period);
    println!(
        "# per node, {} nodes: peak threads min/median/max {t0}/{t1}/{t2}; links at most open \
         {l0}/{l1}/{l2} (of {} peers); heartbeats per period {h0:.1}/{h1:.1}/{h2:.1} (period \
         {:?}, {:.1} s); threads now: nodes {live}, process {process}",
        rows.len(),
        rows.len() - 1,
        heartbeat / 4,
        elapsed.as_secs_f64(),
    );
    if let Some(rss) = peak_rss {
        println!(
            "# process peak RSS {:.0} MiB, {:.1} MiB per node",
            rss as f64 / (1 << 20) as f64,
            rss as f64 / (1 << 20) as f64 / rows.len().max(1) as f64
        );
    }
    if let Some(busiest) = rows.iter().max_by_key(|r| r.peak) {
        let roles: Vec<String> = phalanx::transport::threads::roles(busiest.id)
            .into_iter()
            .map(|(r, c)| format!("{r} {}", c.peak))
            .collect();
        println!(
            "# node {} ran the most threads, peaks by role: {}",
            busiest.id,
            roles.join(", ")
        );
    }
    println!("#   node  peak threads  threads now  links open  links at most  hb/period");
    for r in &rows {
        println!(
            "{:>8} {:>13} {:>12} {:>11} {:>14} {:>10.2}",
            r.id, r.peak, r.live, r.links.open, r.links.peak, r.hb_per_period
        );
    }
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

fn node_cmd(a: NodeArgs) -> Result<()> {
    let cfg = ClusterConfig::load(&a.config)?;
    let node = cluster::start_node(&cfg, a.id, a.rejoin)
        .with_context(|| format!("starting node {}", a.id))?;
    if let (Some(object), Some(after_bytes)) = (&a.fault_object, a.fault_after_bytes) {
        node.inject_fault(FaultPlan {
            object: object.as_str().into(),
            after_bytes,
            action: FaultAction::SigKill,
        });
    }
    println!(
        "{}",
        serde_json::json!({"event": "up", "node": node.id(), "nodes": node.num_nodes()})
    );
    for p in &a.put {
        let (name, size) = p
            .split_once('=')
            .with_context(|| format!("--put {p:?}: expected NAME=SIZE"))?;
        let size = one_size(size)?;
        node.put(name, &pattern(size))?;
        println!(
            "{}",
            serde_json::json!({"event": "put", "object": name, "bytes": size})
        );
    }
    std::thread::sleep(Duration::from_millis(a.get_delay_ms));
    for name in &a.get {
        let t0 = Instant::now();
        let v = node
            .get_view(name.as_str())
            .with_context(|| format!("get {name}"))?;
        let ok = *v == pattern(v.len() as u64)[..];
        let sources: Vec<NodeId> = node
            .transfer_log()
            .iter()
            .filter(|t| t.id.as_str() == name)
            .map(|t| t.source)
            .collect();
        println!(
            "{}",
            serde_json::json!({"event": "got", "object": name, "bytes": v.len(), "ok": ok,
                "seconds": t0.elapsed().as_secs_f64(), "sources": sources})
        );
        if !ok {
            bail!("{name}: bytes differ from the pattern");
        }
    }
    use std::io::Write;
    std::io::stdout().flush()?;
    if a.exit_on_stdin_eof {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
        node.shutdown();
        return Ok(());
    }
    loop {
        std::thread::park();
    }
}

/// Deterministic object content for the node command and the demo.
fn pattern(size: u64) -> Vec<u8> {
    (0..size)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect()
}

fn demo(
    n: u32,
    size: u64,
    stagger_ms: u64,
    chunk: u64,
    transport: TransportSettings,
) -> Result<()> {
    if n < 2 {
        bail!("the demo needs at least 2 nodes");
    }
    let cfg = NodeConfig {
        arena_size: size * 2 + (64 << 20),
        chunk_size: chunk,
        ..NodeConfig::default()
    };
    let kind = match &transport {
        TransportSettings::Tcp(_) => "TCP",
        #[allow(unreachable_patterns)]
        _ => "verbs (RDMA)",
    };
    println!(
        "starting {n} nodes over {kind} on 127.0.0.1, object of {size} bytes, chunks of {chunk}"
    );
    let c = LocalCluster::start_with(n, cfg, transport)?;
    let data = pattern(size);
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
