//! RL-style policy broadcast (Hoplite §5.3-style): rank 0 is the trainer, ranks 1..N-1 are
//! rollout workers. A worker fetches the policy version it was assigned (`--size` bytes),
//! runs a rollout for a random time and puts a small result. The trainer waits until at
//! least `--min-batch` workers have finished (taking every other one that has finished by
//! then), gathers their results (Phalanx: `gather`, concurrent; star: one `get` after
//! another), derives policy version p+1 from them, puts it and assigns it to exactly those
//! workers, which start their next rollout. Workers arrive at random times, so every
//! broadcast goes to a different subset.
//!
//! Verified: each worker checks every byte of the policy it fetched against its version;
//! each result carries a reward computed from the policy bytes, which the trainer recomputes
//! for the version it assigned to that worker.
//!
//! ```sh
//! cargo run --release --example rl_broadcast -- --local 8 --size 64M --compare
//! cargo run --release --example rl_broadcast -- --local 8 --kill-worker 2 --kill-after-ms 4000
//! ```

#[path = "common/mod.rs"]
mod common;

use anyhow::{bail, ensure, Result};
use clap::Parser;
use common::*;
use phalanx::ObjectId;
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(about = "RL-style policy broadcast and result gather on Phalanx (and its star baseline)")]
struct Args {
    #[command(flatten)]
    common: Common,
    /// Mean simulated rollout time.
    #[arg(long, default_value_t = 200.0)]
    rollout_ms: f64,
    /// Uniform jitter around the mean (ignored with --exponential).
    #[arg(long, default_value_t = 150.0)]
    jitter_ms: f64,
    /// Draw rollout times from an exponential distribution with the given mean.
    #[arg(long)]
    exponential: bool,
    /// Bytes of a rollout result.
    #[arg(long, default_value_t = 1024)]
    result_size: usize,
    /// Wait for at least this many finished workers per policy update (default W/2).
    #[arg(long)]
    min_batch: Option<usize>,
    /// Stop after this many policy updates.
    #[arg(long, default_value_t = 10000)]
    updates: u64,
}

const STOP: u64 = u64::MAX;

fn policy_tile(seed: u64, p: u64, reward_sum: u64) -> Vec<f32> {
    int_tile(mix3(seed ^ 0x706f_6c69_6379, p, reward_sum))
}

fn reward(seed: u64, w: u32, r: u64, policy_hash: u64) -> u64 {
    mix3(seed, mix3(w as u64, r, 2), policy_hash) % 1000
}

struct Report {
    workers: u32,
    min_batch: usize,
    updates: u64,
    rollouts: u64,
    secs: f64,
    events: Vec<f64>,
    batch_sizes: Vec<usize>,
    traffic: Vec<Option<(u64, u64)>>,
}

fn worker(ctx: &Ctx, a: &Args) -> Result<()> {
    let node = ctx.node;
    let w = ctx.rank();
    let seed = ctx.common.seed;
    let mut r = 0u64;
    loop {
        let assign = ctx.id(format!("assign/{w}/{r}"));
        let m = node.get(assign.clone())?;
        let _ = node.delete(assign);
        let p = u64::from_le_bytes(m[..8].try_into()?);
        if p == STOP {
            return Ok(());
        }
        let tile = bytes_to_tile(&m[8..]);
        let (ok, h) = {
            let view = ctx.fetch(ctx.id(format!("policy/{p}")), 0)?;
            // The "rollout" reads the policy it got: the reward depends on its bytes.
            (
                is_tiled(&view, &tile),
                tile_hash(&bytes_to_tile(&view[..4 * TILE])),
            )
        };
        std::thread::sleep(compute_time(
            a.rollout_ms,
            a.jitter_ms,
            a.exponential,
            mix3(seed, w as u64, r),
        ));
        let mut res = vec![0u8; a.result_size.max(24)];
        res[..8].copy_from_slice(&p.to_le_bytes());
        res[8] = ok as u8;
        res[16..24].copy_from_slice(&reward(seed, w, r, h).to_le_bytes());
        node.put(ctx.id(format!("res/{w}/{r}")), &res)?;
        r += 1;
    }
}

fn trainer(ctx: &Ctx, a: &Args) -> Result<Report> {
    let node = ctx.node;
    let c = ctx.common;
    let seed = c.seed;
    let nw = ctx.n() - 1;
    let min_batch = a.min_batch.unwrap_or((nw as usize / 2).max(1));
    let base = traffic_base(node);
    let workers: Vec<u32> = (1..=nw).collect();
    let mut tile = policy_tile(seed, 0, 0);
    let mut hashes = vec![tile_hash(&tile)];
    node.put(ctx.id("policy/0"), &tiled(&tile, c.size))?;
    let assign = |w: u32, r: u64, p: u64, tile: &[f32]| -> Result<()> {
        let mut m = p.to_le_bytes().to_vec();
        m.extend(tile_to_bytes(tile));
        node.put(ctx.id(format!("assign/{w}/{r}")), &m)?;
        Ok(())
    };
    let mut arrivals = Arrivals::new();
    for &w in &workers {
        assign(w, 0, 0, &tile)?;
        arrivals.watch(node, w, w, ctx.id(format!("res/{w}/0")))?;
    }
    let mut cur: HashMap<u32, u64> = workers.iter().map(|&w| (w, 0)).collect();
    let mut ver_of: HashMap<u32, u64> = workers.iter().map(|&w| (w, 0)).collect();
    let mut holders: HashMap<u64, usize> = HashMap::from([(0, workers.len())]);
    let mut dead: Vec<u32> = Vec::new();
    let (mut events, mut batch_sizes) = (Vec::new(), Vec::new());
    let mut p = 0u64;
    let release = |holders: &mut HashMap<u64, usize>, v: u64, newest: u64| {
        if let Some(h) = holders.get_mut(&v) {
            *h -= 1;
            if *h == 0 && v != newest {
                holders.remove(&v);
                let _ = node.delete(ctx.id(format!("policy/{v}")));
            }
        }
    };
    while p < a.updates && !ctx.out_of_time() {
        for &w in &workers {
            if !dead.contains(&w) && !ctx.alive(w) {
                eprintln!("[trainer] worker {w} is down at t={:.2}s", ctx.elapsed());
                dead.push(w);
                arrivals.forget(w);
                release(&mut holders, ver_of[&w], p);
            }
        }
        let alive = workers.len() - dead.len();
        if alive == 0 {
            bail!("every worker is dead");
        }
        let deadline = Instant::now() + Duration::from_millis(500);
        if arrivals.wait(ctx, min_batch.min(alive), deadline) == 0 {
            continue;
        }
        arrivals.poll();
        let batch: Vec<u32> = std::mem::take(&mut arrivals.ready);
        let ids: Vec<ObjectId> = batch
            .iter()
            .map(|w| ctx.id(format!("res/{w}/{}", cur[w])))
            .collect();
        let results: Vec<Option<Vec<u8>>> = match ctx.algo {
            Algo::Phalanx => match node.gather(&ids) {
                Ok(v) => v.into_iter().map(Some).collect(),
                // A worker died between finishing and the gather: fetch one by one.
                Err(_) => ids.iter().map(|id| node.get(id.clone()).ok()).collect(),
            },
            Algo::Star => ids.iter().map(|id| node.get(id.clone()).ok()).collect(),
        };
        let mut reward_sum = 0u64;
        let mut done = Vec::new();
        for ((&w, id), res) in batch.iter().zip(&ids).zip(results) {
            let _ = node.delete(id.clone());
            let Some(res) = res else { continue };
            let r = cur[&w];
            let got_p = u64::from_le_bytes(res[..8].try_into()?);
            let rew = u64::from_le_bytes(res[16..24].try_into()?);
            ensure!(
                res[8] == 1,
                "worker {w} rollout {r}: policy bytes differed from version {got_p}"
            );
            ensure!(
                got_p == ver_of[&w],
                "worker {w} rollout {r} used policy {got_p}, was given {}",
                ver_of[&w]
            );
            ensure!(
                rew == reward(seed, w, r, hashes[got_p as usize]),
                "worker {w} rollout {r}: wrong reward"
            );
            reward_sum += rew;
            done.push(w);
            events.push(ctx.elapsed());
        }
        if done.is_empty() {
            continue;
        }
        // New policy from the gathered results; broadcast it to exactly those workers.
        p += 1;
        tile = policy_tile(seed, p, reward_sum);
        hashes.push(tile_hash(&tile));
        node.put(ctx.id(format!("policy/{p}")), &tiled(&tile, c.size))?;
        holders.insert(p, done.len());
        for &w in &done {
            release(&mut holders, ver_of[&w], p);
            let r = cur[&w] + 1;
            cur.insert(w, r);
            ver_of.insert(w, p);
            assign(w, r, p, &tile)?;
            arrivals.watch(node, w, w, ctx.id(format!("res/{w}/{r}")))?;
        }
        batch_sizes.push(done.len());
    }
    let secs = ctx.elapsed();
    for &w in &workers {
        if !dead.contains(&w) {
            assign(w, cur[&w] + 1, STOP, &[])?;
        }
    }
    let traffic = collect_traffic(ctx, base);
    for &w in &workers {
        let _ = node.delete(ctx.id(format!("res/{w}/{}", cur[&w])));
    }
    for v in holders.keys() {
        let _ = node.delete(ctx.id(format!("policy/{v}")));
    }
    Ok(Report {
        workers: nw,
        min_batch,
        updates: p,
        rollouts: events.len() as u64,
        secs,
        events,
        batch_sizes,
        traffic,
    })
}

fn main() -> Result<()> {
    let a = Args::parse();
    let c = &a.common;
    let n = c.local.unwrap_or(8) as u64;
    let arena = (n + 4) * c.size + (64 << 20);
    let results = run_roles(
        "rl",
        c,
        arena,
        true,
        |ctx| trainer(ctx, &a),
        |ctx| worker(ctx, &a),
    )?;
    if results.is_empty() {
        return Ok(());
    }
    let r0 = &results[0].1;
    println!(
        "# rl_broadcast: {} workers, policy {} MiB, result {} B, rollout {} ms ± {} ms{}, min batch {}, seed {}",
        r0.workers, c.size >> 20, a.result_size, a.rollout_ms, a.jitter_ms,
        if a.exponential { " (exponential)" } else { "" }, r0.min_batch, c.seed
    );
    println!(
        "# {:>8} {:>9} {:>8} {:>8} {:>11} {:>10} {:>16}",
        "algo", "rollouts", "updates", "secs", "rollouts/s", "mean batch", "trainer sent MiB"
    );
    for (algo, r) in &results {
        let mean_batch =
            r.batch_sizes.iter().sum::<usize>() as f64 / r.batch_sizes.len().max(1) as f64;
        println!(
            "  {:>8} {:>9} {:>8} {:>8.2} {:>11.2} {:>10.2} {:>16.0}",
            format!("{algo:?}"),
            r.rollouts,
            r.updates,
            r.secs,
            r.rollouts as f64 / r.secs,
            mean_batch,
            r.traffic[0].map_or(0.0, |t| mib(t.0))
        );
    }
    for (algo, r) in &results {
        print_timeline(c, &format!("{algo:?} rollouts"), &r.events, r.secs);
    }
    if results.len() == 2 {
        let rate = |r: &Report| r.rollouts as f64 / r.secs;
        println!(
            "# phalanx/star rollouts-per-second ratio: {:.2}",
            rate(&results[0].1) / rate(&results[1].1)
        );
    }
    println!("# verified: every fetched policy matched its version; every reward matched the policy it was assigned");
    if c.json {
        for (algo, r) in &results {
            let own = serde_json::json!({
                "workers": r.workers, "rollouts": r.rollouts, "updates": r.updates,
                "rollouts_per_s": r.rollouts as f64 / r.secs, "traffic": r.traffic,
            });
            print_json(c, "rl_broadcast", *algo, &r.events, r.secs, own);
        }
    }
    Ok(())
}
