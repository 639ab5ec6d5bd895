//! Ensemble serving (Hoplite §5.4-style): rank 0 is the caller, ranks 1..N-1 hold one model
//! each. For every query the caller puts a batch of `--size` bytes, every model node fetches
//! it (Phalanx: `get_view`, a broadcast tree; star: `get_view_from(.., 0)`), runs its model
//! and puts a small vote; the caller gathers the votes of every live model (Phalanx: `gather`;
//! star: one `get` after another) and takes the majority. One query is in flight at a time;
//! latency is from the caller's `put` to the vote.
//!
//! Verified: every model checks every byte of the query; each vote is a function of the
//! query bytes and the model, which the caller recomputes, as well as the majority.
//!
//! ```sh
//! cargo run --release --example ensemble_serving -- --local 8 --size 64M --compare
//! cargo run --release --example ensemble_serving -- --local 8 --kill-worker 5 --kill-after-ms 3000
//! ```

#[path = "common/mod.rs"]
mod common;

use anyhow::{ensure, Result};
use clap::Parser;
use common::*;
use phalanx::ObjectId;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(about = "Ensemble serving on Phalanx (and its star baseline)")]
struct Args {
    #[command(flatten)]
    common: Common,
    /// Simulated inference time of a model.
    #[arg(long, default_value_t = 5.0)]
    compute_ms: f64,
    /// Stop after this many queries.
    #[arg(long, default_value_t = 200)]
    queries: u64,
    /// Classes to vote on.
    #[arg(long, default_value_t = 10)]
    classes: u64,
    /// Probability that a model votes for a wrong class.
    #[arg(long, default_value_t = 0.3)]
    error_rate: f64,
    /// Give up on a model's vote after this long.
    #[arg(long, default_value_t = 10000)]
    vote_timeout_ms: u64,
}

fn query_tile(seed: u64, q: u64) -> Vec<f32> {
    int_tile(mix3(seed ^ 0x0071_7565_7279, q, 3))
}

/// Model `m`'s vote on a query whose first tile hashes to `h`.
fn vote(a: &Args, m: u32, q: u64, h: u64) -> u64 {
    let truth = h % a.classes;
    let s = mix3(a.common.seed, q, m as u64);
    if unit(s) < a.error_rate {
        (truth + 1 + mix(s) % (a.classes - 1)) % a.classes
    } else {
        truth
    }
}

fn majority(votes: &[u64], classes: u64) -> u64 {
    let mut count = vec![0usize; classes as usize];
    votes.iter().for_each(|&v| count[v as usize] += 1);
    // Ties go to the smallest class.
    (0..classes)
        .max_by_key(|&c| (count[c as usize], std::cmp::Reverse(c)))
        .unwrap_or(0)
}

struct Report {
    models: u32,
    queries: u64,
    secs: f64,
    latencies: Vec<f64>,
    events: Vec<f64>,
    voters: Vec<usize>,
    correct: u64,
}

fn model(ctx: &Ctx, a: &Args) -> Result<()> {
    let node = ctx.node;
    let m = ctx.rank();
    let seed = ctx.common.seed;
    for q in 0.. {
        let (ok, h) = {
            let view = ctx.fetch(ctx.id(format!("q/{q}")), 0)?;
            if view.len() < 4 * TILE {
                return Ok(()); // stop marker
            }
            (
                is_tiled(&view, &query_tile(seed, q)),
                tile_hash(&bytes_to_tile(&view[..4 * TILE])),
            )
        };
        std::thread::sleep(Duration::from_secs_f64(a.compute_ms / 1e3));
        let mut res = vote(a, m, q, h).to_le_bytes().to_vec();
        res.push(ok as u8);
        node.put(ctx.id(format!("vote/{q}/{m}")), &res)?;
    }
    Ok(())
}

fn caller(ctx: &Ctx, a: &Args) -> Result<Report> {
    let node = ctx.node;
    let c = ctx.common;
    let nm = ctx.n() - 1;
    let models: Vec<u32> = (1..=nm).collect();
    let (mut latencies, mut events, mut voters) = (Vec::new(), Vec::new(), Vec::new());
    let mut correct = 0;
    let mut q = 0u64;
    while q < a.queries && !ctx.out_of_time() {
        let tile = query_tile(c.seed, q);
        let batch = tiled(&tile, c.size);
        let qid = ctx.id(format!("q/{q}"));
        let t0 = Instant::now();
        node.put(qid.clone(), &batch)?;
        let mut arrivals = Arrivals::new();
        for &m in models.iter().filter(|&&m| ctx.alive(m)) {
            arrivals.watch(node, m, m, ctx.id(format!("vote/{q}/{m}")))?;
        }
        let live = models.iter().filter(|&&m| ctx.alive(m)).count();
        arrivals.wait(
            ctx,
            live,
            Instant::now() + Duration::from_millis(a.vote_timeout_ms),
        );
        let who: Vec<u32> = std::mem::take(&mut arrivals.ready);
        let ids: Vec<ObjectId> = who
            .iter()
            .map(|m| ctx.id(format!("vote/{q}/{m}")))
            .collect();
        let got: Vec<Option<Vec<u8>>> = match ctx.algo {
            Algo::Phalanx => match node.gather(&ids) {
                Ok(v) => v.into_iter().map(Some).collect(),
                Err(_) => ids.iter().map(|id| node.get(id.clone()).ok()).collect(),
            },
            Algo::Star => ids.iter().map(|id| node.get(id.clone()).ok()).collect(),
        };
        let mut votes = Vec::new();
        let h = tile_hash(&tile);
        let mut expected = Vec::new();
        for (&m, g) in who.iter().zip(&got) {
            let Some(g) = g else { continue };
            ensure!(g[8] == 1, "model {m}: query {q} bytes differed");
            let v = u64::from_le_bytes(g[..8].try_into()?);
            ensure!(v == vote(a, m, q, h), "model {m}: wrong vote on query {q}");
            votes.push(v);
            expected.push(vote(a, m, q, h));
        }
        ensure!(!votes.is_empty(), "query {q}: no model answered");
        let answer = majority(&votes, a.classes);
        ensure!(
            answer == majority(&expected, a.classes),
            "query {q}: wrong majority"
        );
        let lat = t0.elapsed().as_secs_f64();
        correct += (answer == h % a.classes) as u64;
        latencies.push(lat);
        events.push(ctx.elapsed());
        voters.push(votes.len());
        let _ = node.delete(qid);
        for id in ids {
            let _ = node.delete(id);
        }
        q += 1;
    }
    let secs = ctx.elapsed();
    node.put(ctx.id(format!("q/{q}")), b"stop")?;
    // Every live model has seen the stop marker once it stops answering: give it a moment.
    std::thread::sleep(Duration::from_millis(300));
    Ok(Report {
        models: nm,
        queries: q,
        secs,
        latencies,
        events,
        voters,
        correct,
    })
}

fn main() -> Result<()> {
    let a = Args::parse();
    let c = &a.common;
    let arena = 4 * c.size + (64 << 20);
    let results = run_roles(
        "ens",
        c,
        arena,
        false,
        |ctx| caller(ctx, &a),
        |ctx| model(ctx, &a),
    )?;
    if results.is_empty() {
        return Ok(());
    }
    println!(
        "# ensemble_serving: {} models, query {} MiB, inference {} ms, {} classes, error rate {}, seed {}",
        results[0].1.models, c.size >> 20, a.compute_ms, a.classes, a.error_rate, c.seed
    );
    println!(
        "# {:>8} {:>8} {:>8} {:>10} {:>10} {:>10} {:>10} {:>9}",
        "algo", "queries", "secs", "queries/s", "p50 (ms)", "p99 (ms)", "max (ms)", "accuracy"
    );
    let mut p50s = Vec::new();
    for (algo, r) in &results {
        let mut l = r.latencies.clone();
        l.sort_by(f64::total_cmp);
        p50s.push(percentile(&l, 50.0));
        println!(
            "  {:>8} {:>8} {:>8.2} {:>10.2} {:>10.1} {:>10.1} {:>10.1} {:>9.2}",
            format!("{algo:?}"),
            r.queries,
            r.secs,
            r.queries as f64 / r.secs,
            percentile(&l, 50.0) * 1e3,
            percentile(&l, 99.0) * 1e3,
            l.last().copied().unwrap_or(0.0) * 1e3,
            r.correct as f64 / r.queries.max(1) as f64
        );
    }
    for (algo, r) in &results {
        print_timeline(c, &format!("{algo:?} queries"), &r.events, r.secs);
        if c.kill_worker.is_some() {
            let first_short = r.voters.iter().position(|&v| v < r.models as usize);
            println!(
                "#   votes per query: {} before the kill, {} after (first short query #{:?})",
                r.voters.first().copied().unwrap_or(0),
                r.voters.last().copied().unwrap_or(0),
                first_short
            );
        }
    }
    if p50s.len() == 2 {
        println!("# star/phalanx p50 latency ratio: {:.2}", p50s[1] / p50s[0]);
    }
    println!("# verified: every model checked the full query; every vote and majority recomputed by the caller");
    if c.json {
        for (algo, r) in &results {
            let mut l = r.latencies.clone();
            l.sort_by(f64::total_cmp);
            let own = serde_json::json!({
                "models": r.models, "queries": r.queries, "queries_per_s": r.queries as f64 / r.secs,
                "p50_s": percentile(&l, 50.0), "p99_s": percentile(&l, 99.0),
            });
            print_json(c, "ensemble_serving", *algo, &r.events, r.secs, own);
        }
    }
    Ok(())
}
