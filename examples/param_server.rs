//! Asynchronous parameter server (Hoplite §5.2-style): rank 0 is the server, ranks 1..N-1 are
//! workers. A worker fetches the model version it was assigned, computes for a random time,
//! and puts an f32 gradient of `--size` bytes. The server reduces the first W/2 gradients to
//! become ready (`reduce_with(.., W/2, Sum, F32, ..)`; star baseline: it pulls them one by one
//! in arrival order and sums locally), applies the sum to the model, puts model version v+1
//! and assigns it to exactly the workers whose gradients it used.
//!
//! Verified: every worker checks the full model bytes it fetched against the version it was
//! assigned; the server checks each used gradient was computed from the version that worker
//! was given; at the end the final model must equal a serial replay of the logged updates,
//! recomputed from the (worker, iteration, version) seeds.
//!
//! ```sh
//! cargo run --release --example param_server -- --local 8 --size 64M --compare
//! cargo run --release --example param_server -- --local 8 --kill-worker 3 --kill-after-ms 4000
//! cluster/run.sh cluster/examples/netns-8.toml -- target/release/examples/param_server \
//!     --config cluster/examples/netns-8.toml --compare
//! ```

#[path = "common/mod.rs"]
mod common;

use anyhow::{bail, ensure, Result};
use clap::Parser;
use common::*;
use phalanx::{DType, ObjectId, ReduceOp, ReduceOptions};
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(about = "Asynchronous parameter server on Phalanx (and its star baseline)")]
struct Args {
    #[command(flatten)]
    common: Common,
    /// Mean simulated compute time of one gradient.
    #[arg(long, default_value_t = 200.0)]
    compute_ms: f64,
    /// Uniform jitter around the mean (ignored with --exponential).
    #[arg(long, default_value_t = 100.0)]
    jitter_ms: f64,
    /// Draw compute times from an exponential distribution with the given mean.
    #[arg(long)]
    exponential: bool,
    /// Stop after this many model updates.
    #[arg(long, default_value_t = 1000)]
    updates: u64,
    /// Gradients per update (default W/2).
    #[arg(long)]
    batch: Option<usize>,
    /// Reduce tree degree (default: Phalanx's latency/bandwidth model).
    #[arg(long)]
    degree: Option<usize>,
    /// Give up on a reduce after this long and retry it (same gradients, new target).
    #[arg(long, default_value_t = 5000)]
    reduce_timeout_ms: u64,
}

const STOP: u64 = u64::MAX;

/// The gradient tile worker `w` computes at iteration `it` from model version `v`.
fn grad_tile(seed: u64, w: u32, it: u64, v: u64) -> Vec<f32> {
    int_tile(mix3(seed ^ 0x6772_6164, mix3(w as u64, it, 1), v))
}

fn model0_tile(seed: u64) -> Vec<f32> {
    int_tile(seed ^ 0x6d6f_64656c)
}

struct Report {
    workers: u32,
    batch: usize,
    updates: u64,
    secs: f64,
    events: Vec<f64>,
    traffic: Vec<Option<(u64, u64)>>,
    used_per_worker: Vec<u64>,
    reduce_retries: u64,
    degrees: Vec<usize>,
}

fn worker(ctx: &Ctx, a: &Args) -> Result<()> {
    let node = ctx.node;
    let w = ctx.rank();
    let size = ctx.common.size;
    let mut it = 0u64;
    loop {
        let assign = ctx.id(format!("assign/{w}/{it}"));
        let m = node.get(assign.clone())?;
        let _ = node.delete(assign);
        let v = u64::from_le_bytes(m[..8].try_into()?);
        if v == STOP {
            return Ok(());
        }
        let tile = bytes_to_tile(&m[8..]);
        let ok = {
            let view = ctx.fetch(ctx.id(format!("model/{v}")), 0)?;
            is_tiled(&view, &tile)
        };
        std::thread::sleep(compute_time(
            a.compute_ms,
            a.jitter_ms,
            a.exponential,
            mix3(ctx.common.seed, w as u64, it),
        ));
        let mut meta = v.to_le_bytes().to_vec();
        meta.push(ok as u8);
        node.put(ctx.id(format!("gmeta/{w}/{it}")), &meta)?;
        let g = tiled(&grad_tile(ctx.common.seed, w, it, v), size);
        node.put(ctx.id(format!("grad/{w}/{it}")), &g)?;
        it += 1;
    }
}

fn server(ctx: &Ctx, a: &Args) -> Result<Report> {
    let node = ctx.node;
    let c = ctx.common;
    let size = c.size;
    let nw = ctx.n() - 1;
    let batch = a.batch.unwrap_or((nw as usize / 2).max(1));
    let seed = c.seed;
    let base = traffic_base(node);
    let workers: Vec<u32> = (1..=nw).collect();

    let mut mtile = model0_tile(seed);
    let mut model: Vec<f32> = bytes_to_tile(&tiled(&mtile, size));
    node.put(ctx.id("model/0"), &tiled(&mtile, size))?;
    let assign = |w: u32, it: u64, v: u64, tile: &[f32]| -> Result<()> {
        let mut m = v.to_le_bytes().to_vec();
        m.extend(tile_to_bytes(tile));
        node.put(ctx.id(format!("assign/{w}/{it}")), &m)?;
        Ok(())
    };
    for &w in &workers {
        assign(w, 0, 0, &mtile)?;
    }
    // Outstanding gradient iteration of each worker, the version it was given, how many
    // workers still hold each live version.
    let mut cur_it: HashMap<u32, u64> = workers.iter().map(|&w| (w, 0)).collect();
    let mut ver_of: HashMap<u32, u64> = workers.iter().map(|&w| (w, 0)).collect();
    let mut holders: HashMap<u64, usize> = HashMap::from([(0, workers.len())]);
    let mut dead: Vec<u32> = Vec::new();
    let mut log: Vec<Vec<(u32, u64, u64)>> = Vec::new();
    let mut events = Vec::new();
    let mut arrivals = Arrivals::new();
    if ctx.algo == Algo::Star {
        for &w in &workers {
            arrivals.watch(node, w, w, ctx.id(format!("grad/{w}/0")))?;
        }
    }
    let mut retries = 0u64;
    let mut degrees = Vec::new();
    let mut u = 0u64;
    let release = |holders: &mut HashMap<u64, usize>, v: u64, newest: u64| {
        if let Some(h) = holders.get_mut(&v) {
            *h -= 1;
            if *h == 0 && v != newest {
                holders.remove(&v);
                let _ = node.delete(ctx.id(format!("model/{v}")));
            }
        }
    };
    while u < a.updates && !ctx.out_of_time() {
        // Forget workers that died.
        for &w in &workers {
            if !dead.contains(&w) && !ctx.alive(w) {
                eprintln!("[server] worker {w} is down at t={:.2}s", ctx.elapsed());
                dead.push(w);
                arrivals.forget(w);
                release(&mut holders, ver_of[&w], u);
            }
        }
        let alive: Vec<u32> = workers
            .iter()
            .copied()
            .filter(|w| !dead.contains(w))
            .collect();
        if alive.is_empty() {
            bail!("every worker is dead");
        }
        let k = batch.min(alive.len());
        let mut sum = vec![0f32; (size / 4) as usize];
        let used: Vec<u32> = match ctx.algo {
            Algo::Phalanx => {
                let ids: Vec<ObjectId> = alive
                    .iter()
                    .map(|w| ctx.id(format!("grad/{w}/{}", cur_it[w])))
                    .collect();
                let target = ctx.id(format!("sum/{u}/{retries}"));
                let opts = ReduceOptions {
                    degree: a.degree,
                    timeout: Some(Duration::from_millis(a.reduce_timeout_ms)),
                    ..ReduceOptions::default()
                };
                match node.reduce_with(target.clone(), &ids, k, ReduceOp::Sum, DType::F32, &opts) {
                    Ok(o) => {
                        degrees.push(o.degree);
                        add_f32(&mut sum, &node.get_view(target.clone())?);
                        let _ = node.delete(target);
                        o.used
                            .iter()
                            .map(|id| alive[ids.iter().position(|x| x == id).expect("a source")])
                            .collect()
                    }
                    Err(e) => {
                        eprintln!("[server] reduce {u} failed ({e}); retrying");
                        let _ = node.delete(target);
                        retries += 1;
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                }
            }
            Algo::Star => {
                let deadline = Instant::now() + Duration::from_secs_f64(c.max_secs.max(10.0));
                let mut used = Vec::new();
                while used.len() < k {
                    if arrivals.wait(ctx, k - used.len(), deadline) == 0 {
                        break;
                    }
                    let w = arrivals.ready.remove(0);
                    match ctx.fetch(ctx.id(format!("grad/{w}/{}", cur_it[&w])), w) {
                        Ok(view) => {
                            add_f32(&mut sum, &view);
                            used.push(w);
                        }
                        Err(e) => eprintln!("[server] gradient of worker {w} lost ({e})"),
                    }
                }
                if used.len() < k {
                    retries += 1;
                    continue;
                }
                used
            }
        };
        // Check and log which gradients this update used.
        let mut entry = Vec::new();
        for &w in &used {
            let it = cur_it[&w];
            let meta = node.get(ctx.id(format!("gmeta/{w}/{it}")))?;
            let seen = u64::from_le_bytes(meta[..8].try_into()?);
            ensure!(
                meta[8] == 1,
                "worker {w} iteration {it}: model bytes differed from version {seen}"
            );
            ensure!(
                seen == ver_of[&w],
                "worker {w} iteration {it} used version {seen}, was given {}",
                ver_of[&w]
            );
            entry.push((w, it, seen));
            mtile
                .iter_mut()
                .zip(grad_tile(seed, w, it, seen))
                .for_each(|(m, g)| *m += g);
        }
        model.iter_mut().zip(&sum).for_each(|(m, s)| *m += s);
        drop(sum);
        let v = u + 1;
        node.put(ctx.id(format!("model/{v}")), bytemuck::cast_slice(&model))?;
        holders.insert(v, used.len());
        for &(w, it, seen) in &entry {
            let _ = node.delete(ctx.id(format!("grad/{w}/{it}")));
            let _ = node.delete(ctx.id(format!("gmeta/{w}/{it}")));
            release(&mut holders, seen, v);
            cur_it.insert(w, it + 1);
            ver_of.insert(w, v);
            assign(w, it + 1, v, &mtile)?;
            if ctx.algo == Algo::Star {
                arrivals.watch(node, w, w, ctx.id(format!("grad/{w}/{}", it + 1)))?;
            }
        }
        log.push(entry);
        events.push(ctx.elapsed());
        u += 1;
    }
    let secs = ctx.elapsed();
    // Stop the workers, collect traffic, clean up.
    for &w in &workers {
        if !dead.contains(&w) {
            assign(w, cur_it[&w] + 1, STOP, &[])?;
        }
    }
    let traffic = collect_traffic(ctx, base);
    for &w in &workers {
        let it = cur_it[&w];
        for kind in ["grad", "gmeta"] {
            let _ = node.delete(ctx.id(format!("{kind}/{w}/{it}")));
        }
    }
    for v in holders.keys() {
        let _ = node.delete(ctx.id(format!("model/{v}")));
    }
    // Serial replay of the log, from seeds only.
    let mut replay = model0_tile(seed);
    for entry in &log {
        for &(w, it, v) in entry {
            replay
                .iter_mut()
                .zip(grad_tile(seed, w, it, v))
                .for_each(|(m, g)| *m += g);
        }
    }
    ensure!(
        is_tiled(bytemuck::cast_slice(&model), &replay),
        "final model differs from the serial replay of {} updates",
        log.len()
    );
    let mut used_per_worker = vec![0u64; nw as usize + 1];
    log.iter()
        .flatten()
        .for_each(|&(w, _, _)| used_per_worker[w as usize] += 1);
    Ok(Report {
        workers: nw,
        batch,
        updates: log.len() as u64,
        secs,
        events,
        traffic,
        used_per_worker,
        reduce_retries: retries,
        degrees,
    })
}

fn main() -> Result<()> {
    let a = Args::parse();
    let c = &a.common;
    let n = c.local.unwrap_or(8) as u64;
    let arena = (n + 4) * c.size + (64 << 20);
    let results = run("ps", c, arena, |ctx| {
        ctx.barrier("start")?;
        if ctx.rank() == 0 {
            server(ctx, &a).map(Some)
        } else {
            let base = traffic_base(ctx.node);
            worker(ctx, &a)?;
            collect_traffic(ctx, base);
            Ok(None)
        }
    })?;
    if results.is_empty() {
        return Ok(());
    }
    let r0 = &results[0].1;
    println!(
        "# param_server: {} workers, batch {} (subset reduce), gradient/model {} MiB f32, compute {} ms ± {} ms{}, seed {}",
        r0.workers, r0.batch, c.size >> 20, a.compute_ms, a.jitter_ms,
        if a.exponential { " (exponential)" } else { "" }, c.seed
    );
    println!(
        "# {:>8} {:>8} {:>8} {:>10} {:>14} {:>14} {:>8}",
        "algo", "updates", "secs", "updates/s", "server MiB/upd", "max wkr MiB/upd", "retries"
    );
    for (algo, r) in &results {
        let per = |b: u64| mib(b) / r.updates.max(1) as f64;
        let srv = r.traffic[0].map_or(0, |(s, rx)| s + rx);
        let wmax = r.traffic[1..]
            .iter()
            .flatten()
            .map(|(s, rx)| s + rx)
            .max()
            .unwrap_or(0);
        println!(
            "  {:>8} {:>8} {:>8.2} {:>10.3} {:>14.1} {:>14.1} {:>8}",
            format!("{algo:?}"),
            r.updates,
            r.secs,
            r.updates as f64 / r.secs,
            per(srv),
            per(wmax),
            r.reduce_retries
        );
    }
    for (algo, r) in &results {
        println!("# {algo:?}: data MiB sent/received per node (rank: sent/recv):");
        let cells: Vec<String> = r
            .traffic
            .iter()
            .enumerate()
            .map(|(k, t)| match t {
                Some((s, rx)) => format!("{k}: {:.0}/{:.0}", mib(*s), mib(*rx)),
                None => format!("{k}: dead"),
            })
            .collect();
        println!("#   {}", cells.join("  "));
        println!(
            "#   gradients used per worker: {:?}",
            &r.used_per_worker[1..]
        );
        if !r.degrees.is_empty() {
            let mut d = r.degrees.clone();
            d.sort();
            println!(
                "#   reduce tree degree: median {}, min {}, max {}",
                d[d.len() / 2],
                d[0],
                d[d.len() - 1]
            );
        }
        let kill_at = c.kill_worker.map(|_| c.kill_after_ms as f64 / 1e3);
        print_timeline(
            &format!("{algo:?} updates"),
            &r.events,
            c.bucket_ms,
            r.secs,
            kill_at,
        );
    }
    if results.len() == 2 {
        let rate = |r: &Report| r.updates as f64 / r.secs;
        println!(
            "# phalanx/star updates-per-second ratio: {:.2}",
            rate(&results[0].1) / rate(&results[1].1)
        );
    }
    println!("# verified: every fetched model matched its version; final model == serial replay of the logged updates");
    if c.json {
        for (algo, r) in &results {
            println!(
                "{}",
                serde_json::json!({
                    "example": "param_server", "algo": algo, "workers": r.workers, "batch": r.batch,
                    "size_bytes": c.size, "updates": r.updates, "secs": r.secs,
                    "updates_per_s": r.updates as f64 / r.secs,
                    "timeline": timeline(&r.events, c.bucket_ms, r.secs).iter().map(|x| x.1).collect::<Vec<_>>(),
                    "traffic": r.traffic, "kill_worker": c.kill_worker, "kill_after_ms": c.kill_after_ms,
                })
            );
        }
    }
    Ok(())
}
