//! Shared harness of the example workloads (`param_server`, `rl_broadcast`,
//! `ensemble_serving`): cluster setup (`--local N` or `--config FILE --id K`), the star
//! baseline switch, fault injection, object naming, arrival tracking and reporting.
#![allow(dead_code)]

use anyhow::{bail, Context, Result};
use crossbeam_channel::{Receiver, Select};
use phalanx::transport::{NodeId, TcpConfig};
use phalanx::{cluster, ClusterConfig, LocalCluster, Node, NodeConfig, ObjectId};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Floats in the repeating tile every large object is made of (a prime, so tiles do not
/// line up with chunk boundaries).
pub const TILE: usize = 1021;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Algo {
    /// Phalanx collectives: broadcast trees, tree reduce, concurrent gather.
    Phalanx,
    /// A task system without collectives: every transfer to or from node 0, one by one.
    Star,
}

/// Flags every example takes.
#[derive(clap::Args, Debug, Clone)]
pub struct Common {
    /// Run N nodes in this process over TCP on 127.0.0.1.
    #[arg(long)]
    pub local: Option<u32>,
    /// Cluster description (one process per node).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// This process's rank (else PHALANX_RANK, else SLURM_PROCID).
    #[arg(long)]
    pub id: Option<u32>,
    /// Run only the baseline (`star`).
    #[arg(long, value_enum)]
    pub baseline: Option<Algo>,
    /// Run Phalanx and then the star baseline in the same invocation and print both.
    #[arg(long)]
    pub compare: bool,
    /// Object size in bytes (K/M/G suffixes), a multiple of 4.
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    pub size: u64,
    /// Stop after this many seconds of workload (per algorithm).
    #[arg(long, default_value_t = 20.0)]
    pub max_secs: f64,
    /// Seed of every random choice.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Kill this worker rank mid-run (local mode: `node.kill()`; config mode: that process
    /// kills its node and exits).
    #[arg(long)]
    pub kill_worker: Option<u32>,
    /// When to kill it, after the workload starts.
    #[arg(long, default_value_t = 3000)]
    pub kill_after_ms: u64,
    /// Width of a throughput-timeline bucket.
    #[arg(long, default_value_t = 1000)]
    pub bucket_ms: u64,
    /// Print one JSON line per algorithm as well as the table.
    #[arg(long)]
    pub json: bool,
}

pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n = num
        .parse::<u64>()
        .map_err(|e| format!("bad size {s:?}: {e}"))?
        * mult;
    if n % 4 != 0 || n < 4 * TILE as u64 {
        return Err(format!(
            "size must be a multiple of 4 and at least {} bytes",
            4 * TILE
        ));
    }
    Ok(n)
}

impl Common {
    pub fn algos(&self) -> Vec<Algo> {
        if self.compare {
            vec![Algo::Phalanx, Algo::Star]
        } else {
            vec![self.baseline.unwrap_or(Algo::Phalanx)]
        }
    }
}

/// What one rank sees of a run.
pub struct Ctx<'a> {
    pub node: &'a Node,
    pub algo: Algo,
    pub common: &'a Common,
    /// Prefix that makes this run's object names unique.
    pub prefix: String,
    /// Deadline of the workload (set after the start barrier).
    pub start: Instant,
}

impl Ctx<'_> {
    /// An object name of this run whose directory entry lives on node 0 (the server, which is
    /// never killed): directory shards are not replicated, so entries on a killed worker would
    /// stall until it rejoins.
    pub fn id(&self, name: impl AsRef<str>) -> ObjectId {
        let base = format!("{}/{}", self.prefix, name.as_ref());
        let mut salt = 0u32;
        loop {
            let id = ObjectId::new(format!("{base}~{salt}"));
            // Not `shard_of`: that follows membership, and every rank must derive the same
            // name whenever it asks, before or after a worker dies.
            if self.node.home_shard(id.clone()) == 0 {
                return id;
            }
            salt += 1;
        }
    }

    pub fn rank(&self) -> u32 {
        self.node.id()
    }

    pub fn n(&self) -> u32 {
        self.node.num_nodes()
    }

    pub fn elapsed(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    pub fn out_of_time(&self) -> bool {
        self.elapsed() >= self.common.max_secs
    }

    pub fn alive(&self, peer: NodeId) -> bool {
        peer == self.node.id() || self.node.transport().is_connected(peer)
    }

    /// Fetches a large object: through Phalanx (any source, broadcast tree) or, for the star
    /// baseline, only from `star_source`.
    pub fn fetch(&self, id: ObjectId, star_source: NodeId) -> phalanx::Result<phalanx::ObjectView> {
        match self.algo {
            Algo::Phalanx => self.node.get_view(id),
            Algo::Star => self.node.get_view_from(id, star_source),
        }
    }

    /// Start barrier: every rank checks in at rank 0, rank 0 releases everyone.
    pub fn barrier(&mut self, name: &str) -> Result<()> {
        let me = self.rank();
        if me == 0 {
            for k in 1..self.n() {
                self.node.get(self.id(format!("bar/{name}/{k}")))?;
            }
            self.node.put(self.id(format!("bar/{name}/go")), b"g")?;
        } else {
            self.node.put(self.id(format!("bar/{name}/{me}")), b"r")?;
            self.node.get(self.id(format!("bar/{name}/go")))?;
        }
        self.start = Instant::now();
        Ok(())
    }

    /// Waits up to `timeout` for a small object; `None` if it does not appear or its owner dies.
    pub fn get_small(&self, id: ObjectId, owner: NodeId, timeout: Duration) -> Option<Vec<u8>> {
        let rx = self.node.subscribe(id.clone()).ok()?;
        let deadline = Instant::now() + timeout;
        loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(Ok(Some(_))) => return self.node.get(id).ok(),
                Ok(_) => return None,
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    if !self.alive(owner) || Instant::now() >= deadline {
                        return None;
                    }
                }
                Err(_) => return None,
            }
        }
    }
}

/// The answer of an asynchronous location query.
type Located = Receiver<phalanx::Result<Option<phalanx::protocol::ObjectInfo>>>;

/// Tracks which of a set of pending objects have appeared, in arrival order.
pub struct Arrivals {
    /// (key, node the object comes from, its subscription)
    subs: Vec<(u32, NodeId, Located)>,
    /// Keys of objects that have appeared, oldest first.
    pub ready: Vec<u32>,
}

impl Arrivals {
    pub fn new() -> Self {
        Arrivals {
            subs: Vec::new(),
            ready: Vec::new(),
        }
    }

    /// Starts watching `id` (put by `owner`) under `key`.
    pub fn watch(&mut self, node: &Node, key: u32, owner: NodeId, id: ObjectId) -> Result<()> {
        let rx = node.subscribe(id)?;
        self.subs.push((key, owner, rx));
        Ok(())
    }

    pub fn forget(&mut self, key: u32) {
        self.subs.retain(|s| s.0 != key);
        self.ready.retain(|&k| k != key);
    }

    /// Moves every object that has appeared by now to `ready`.
    pub fn poll(&mut self) {
        let mut i = 0;
        while i < self.subs.len() {
            match self.subs[i].2.try_recv() {
                Ok(Ok(Some(_))) => {
                    let (k, _, _) = self.subs.remove(i);
                    self.ready.push(k);
                }
                Ok(_) => {
                    self.subs.remove(i);
                }
                Err(_) => i += 1,
            }
        }
    }

    /// Waits until at least `want` keys are ready (or every watched owner is dead, or the
    /// deadline passes); drops watches of dead owners. Returns how many are ready.
    pub fn wait(&mut self, ctx: &Ctx, want: usize, deadline: Instant) -> usize {
        loop {
            self.poll();
            self.subs.retain(|s| ctx.alive(s.1));
            if self.ready.len() >= want || self.subs.is_empty() || Instant::now() >= deadline {
                return self.ready.len();
            }
            let mut sel = Select::new();
            for s in &self.subs {
                sel.recv(&s.2);
            }
            let _ = sel.ready_timeout(Duration::from_millis(50));
        }
    }
}

/// Deterministic 64-bit mixing (splitmix64).
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

pub fn mix3(a: u64, b: u64, c: u64) -> u64 {
    mix(mix(mix(a) ^ b) ^ c)
}

/// A uniform draw in [0, 1) from a seed.
pub fn unit(seed: u64) -> f64 {
    (mix(seed) >> 11) as f64 / (1u64 << 53) as f64
}

/// Simulated compute time: `mean ± jitter` (uniform) or exponential with that mean.
pub fn compute_time(mean_ms: f64, jitter_ms: f64, exponential: bool, seed: u64) -> Duration {
    let u = unit(seed);
    let ms = if exponential {
        -mean_ms * (1.0 - u).ln()
    } else {
        mean_ms + jitter_ms * (2.0 * u - 1.0)
    };
    Duration::from_secs_f64(ms.max(0.0) / 1e3)
}

/// A tile of small integers in [-2, 2] (so f32 sums stay exact) from a seed.
pub fn int_tile(seed: u64) -> Vec<f32> {
    (0..TILE as u64)
        .map(|i| (mix3(seed, i, 7) % 5) as f32 - 2.0)
        .collect()
}

pub fn tile_to_bytes(tile: &[f32]) -> Vec<u8> {
    tile.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn bytes_to_tile(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// `size` bytes made of the tile repeated.
pub fn tiled(tile: &[f32], size: u64) -> Vec<u8> {
    let tb = tile_to_bytes(tile);
    let mut v = Vec::with_capacity(size as usize);
    while (v.len() as u64) < size {
        let n = (size as usize - v.len()).min(tb.len());
        v.extend_from_slice(&tb[..n]);
    }
    v
}

/// Whether `data` is the tile repeated (checks every byte).
pub fn is_tiled(data: &[u8], tile: &[f32]) -> bool {
    let tb = tile_to_bytes(tile);
    data.chunks(tb.len()).all(|c| c == &tb[..c.len()])
}

/// A cheap fingerprint of a tile.
pub fn tile_hash(tile: &[f32]) -> u64 {
    tile.iter().fold(0u64, |h, x| mix(h ^ x.to_bits() as u64))
}

/// Adds the f32 bytes of `x` into `acc`.
pub fn add_f32(acc: &mut [f32], x: &[u8]) {
    match bytemuck::try_cast_slice::<u8, f32>(x) {
        Ok(xs) => acc.iter_mut().zip(xs).for_each(|(a, b)| *a += *b),
        Err(_) => acc
            .iter_mut()
            .zip(x.chunks_exact(4))
            .for_each(|(a, b)| *a += f32::from_le_bytes(b.try_into().unwrap())),
    }
}

/// Per-node data bytes (sent, received) since `base`.
pub fn traffic(node: &Node, base: (u64, u64)) -> (u64, u64) {
    let s = node.transport_stats();
    (s.data_bytes_sent - base.0, s.data_bytes_received - base.1)
}

pub fn traffic_base(node: &Node) -> (u64, u64) {
    let s = node.transport_stats();
    (s.data_bytes_sent, s.data_bytes_received)
}

/// Every rank reports its traffic to rank 0; rank 0 returns the table (None for dead ranks).
pub fn collect_traffic(ctx: &Ctx, base: (u64, u64)) -> Vec<Option<(u64, u64)>> {
    let (s, r) = traffic(ctx.node, base);
    let me = ctx.rank();
    if me != 0 {
        let mut b = s.to_le_bytes().to_vec();
        b.extend_from_slice(&r.to_le_bytes());
        let _ = ctx.node.put(ctx.id(format!("traffic/{me}")), &b);
        return Vec::new();
    }
    let mut out = vec![Some((s, r))];
    for k in 1..ctx.n() {
        let v = ctx.get_small(ctx.id(format!("traffic/{k}")), k, Duration::from_secs(20));
        out.push(v.map(|b| {
            (
                u64::from_le_bytes(b[..8].try_into().unwrap()),
                u64::from_le_bytes(b[8..16].try_into().unwrap()),
            )
        }));
        let _ = ctx.node.delete(ctx.id(format!("traffic/{k}")));
    }
    out
}

/// Events per bucket since the start: "t=0-1s: 3 | ...".
pub fn timeline(events: &[f64], bucket_ms: u64, until: f64) -> Vec<(f64, usize)> {
    let b = bucket_ms as f64 / 1e3;
    let n = (until / b).ceil().max(1.0) as usize;
    let mut counts = vec![0usize; n];
    for &t in events {
        let i = ((t / b) as usize).min(n - 1);
        counts[i] += 1;
    }
    counts
        .into_iter()
        .enumerate()
        .map(|(i, c)| (i as f64 * b, c))
        .collect()
}

/// Prints completions per `--bucket-ms` up to `until`, marking the bucket of the kill.
pub fn print_timeline(c: &Common, label: &str, events: &[f64], until: f64) {
    let bucket_ms = c.bucket_ms;
    let kill_at = c.kill_worker.map(|_| c.kill_after_ms as f64 / 1e3);
    let b = bucket_ms as f64 / 1e3;
    println!(
        "# {label} per {b} s (rate = count / {b} s){}",
        kill_at.map_or(String::new(), |k| format!(", worker killed at t={k:.1} s"))
    );
    let line: Vec<String> = timeline(events, bucket_ms, until)
        .into_iter()
        .map(|(t, c)| {
            let mark = match kill_at {
                Some(k) if k >= t && k < t + b => "*",
                _ => "",
            };
            format!("{t:.0}s:{c}{mark}")
        })
        .collect();
    println!("#   {}", line.join(" "));
}

/// One `--json` line: the fields every example reports, then the example's own `fields`.
pub fn print_json(
    c: &Common,
    example: &str,
    algo: Algo,
    events: &[f64],
    secs: f64,
    fields: serde_json::Value,
) {
    let mut line = serde_json::json!({
        "example": example, "algo": algo, "size_bytes": c.size, "secs": secs,
        "timeline": timeline(events, c.bucket_ms, secs).iter().map(|x| x.1).collect::<Vec<_>>(),
        "kill_worker": c.kill_worker, "kill_after_ms": c.kill_after_ms,
    });
    if let (Some(all), serde_json::Value::Object(own)) = (line.as_object_mut(), fields) {
        all.extend(own);
    }
    println!("{line}");
}

pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// The examples' roles: after a start barrier rank 0 runs `lead` and returns its report, every
/// other rank runs `member` and then, with `report_traffic`, sends rank 0 its data traffic.
pub fn run_roles<R: Send>(
    name: &str,
    common: &Common,
    arena: u64,
    report_traffic: bool,
    lead: impl Fn(&Ctx) -> Result<R> + Sync,
    member: impl Fn(&Ctx) -> Result<()> + Sync,
) -> Result<Vec<(Algo, R)>> {
    run(name, common, arena, |ctx| {
        ctx.barrier("start")?;
        if ctx.rank() == 0 {
            return lead(ctx).map(Some);
        }
        let base = traffic_base(ctx.node);
        member(ctx)?;
        if report_traffic {
            collect_traffic(ctx, base);
        }
        Ok(None)
    })
}

/// Runs `body` on every rank, once per algorithm, and returns rank 0's results (only on the
/// process that holds rank 0). `arena` is the arena size each node needs (local mode; a
/// configured cluster's `arena_size` must be at least that).
pub fn run<R: Send>(
    name: &str,
    common: &Common,
    arena: u64,
    body: impl Fn(&mut Ctx) -> Result<Option<R>> + Sync,
) -> Result<Vec<(Algo, R)>> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let mut out = Vec::new();
    match (common.local, &common.config) {
        (Some(n), _) => {
            if n < 2 {
                bail!("--local needs at least 2 nodes");
            }
            for algo in common.algos() {
                let cfg = NodeConfig {
                    arena_size: arena,
                    op_timeout: Duration::from_secs(60),
                    ..NodeConfig::default()
                };
                let tcp = TcpConfig {
                    heartbeat_timeout: Duration::from_secs(5),
                    ..TcpConfig::default()
                };
                let c = LocalCluster::start(n, cfg, tcp)?;
                let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
                let results: Vec<Result<Option<R>>> = std::thread::scope(|s| {
                    if let Some(k) = common.kill_worker {
                        if k == 0 || k >= n {
                            eprintln!("--kill-worker {k}: not a worker rank, ignored");
                        } else {
                            let node = c.node(k as usize).clone();
                            let after = Duration::from_millis(common.kill_after_ms);
                            let rx = stop_rx.clone();
                            s.spawn(move || {
                                // The workload starts after the start barrier, which takes a
                                // few ms; count from when the threads start.
                                if rx.recv_timeout(after).is_err() {
                                    eprintln!("[fault] killing worker {k} at {after:?}");
                                    node.kill();
                                }
                            });
                        }
                    }
                    let hs: Vec<_> = c
                        .nodes
                        .iter()
                        .map(|node| {
                            let body = &body;
                            s.spawn(move || {
                                let mut ctx = Ctx {
                                    node,
                                    algo,
                                    common,
                                    prefix: format!("{name}/{algo:?}"),
                                    start: Instant::now(),
                                };
                                let r = body(&mut ctx);
                                if let Err(e) = &r {
                                    // Now, not at the join: the other ranks may wait long.
                                    eprintln!("[rank {}] stopped: {e:#}", node.id());
                                }
                                r
                            })
                        })
                        .collect();
                    let r = hs
                        .into_iter()
                        .map(|h| h.join().expect("rank thread"))
                        .collect();
                    drop(stop_tx);
                    r
                });
                let mut rank0 = None;
                for (k, r) in results.into_iter().enumerate() {
                    match r {
                        Ok(v) if k == 0 => rank0 = v,
                        Ok(_) => {}
                        Err(e) if common.kill_worker == Some(k as u32) => {
                            eprintln!("[fault] killed rank {k} stopped: {e:#}")
                        }
                        Err(e) => return Err(e.context(format!("rank {k}"))),
                    }
                }
                out.push((algo, rank0.context("rank 0 returned no result")?));
            }
        }
        (None, Some(path)) => {
            let cfg = ClusterConfig::load(path)?;
            if cfg.node_config().arena_size < arena {
                eprintln!(
                    "warning: the config's arena_size {} is below the {} bytes this run needs",
                    cfg.node_config().arena_size,
                    arena
                );
            }
            let rank = match common.id {
                Some(r) => r,
                None => phalanx::cluster::rank_from_env()?,
            };
            let node = cluster::start_node(&cfg, rank, false)
                .with_context(|| format!("starting rank {rank}"))?;
            if common.kill_worker == Some(rank) && rank != 0 {
                if common.compare {
                    bail!("--kill-worker with --compare is supported in --local mode only");
                }
                let n2 = node.clone();
                let after = Duration::from_millis(common.kill_after_ms);
                std::thread::spawn(move || {
                    std::thread::sleep(after);
                    eprintln!("[fault] rank {} kills itself", n2.id());
                    n2.kill();
                    std::process::exit(0);
                });
            }
            for algo in common.algos() {
                let mut ctx = Ctx {
                    node: &node,
                    algo,
                    common,
                    prefix: format!("{name}/{algo:?}"),
                    start: Instant::now(),
                };
                if let Some(r) = body(&mut ctx)? {
                    out.push((algo, r));
                }
            }
            // Let the other ranks finish their last operations before leaving.
            std::thread::sleep(Duration::from_millis(500));
            node.shutdown();
        }
        (None, None) => bail!("give --local N, or --config FILE (one process per node)"),
    }
    Ok(out)
}
