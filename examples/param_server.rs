//! Asynchronous parameter server (Hoplite §5.2-style): rank 0 is the server, ranks 1..N-1 are
//! workers. A worker fetches the model version it was assigned, computes for a random time,
//! and puts an f32 gradient of `--size` bytes. The server applies the first W/2 gradients to
//! become ready to the model and hands the new version to exactly the workers whose
//! gradients it used.
//!
//! Phalanx: an update is one subset reduce, `model/v+1 = model/v + first k gradients`
//! (`ReduceOptions::required` keeps the model in; the gradients fill the rest in arrival
//! order). The server learns the chosen gradients as soon as the tree is full
//! (`ReduceHandle::inputs`), assigns `model/v+1` to those workers while it is still being
//! reduced (they stream it from its partial copies) and starts the next update on the
//! partial `model/v+1`; `--pipeline` updates are in flight at once and share one
//! `SourceClaims` pool, so no gradient is used twice. The model bytes never pass through the
//! server. Star baseline: the server pulls the gradients one by one in arrival order, adds
//! them to its model, and sends the new model to one chosen worker after another
//! (`--star-overlap`: the chosen workers pull it concurrently while the server goes on to the
//! next gradients).
//!
//! Verified: every worker checks the full model bytes it fetched against the version's
//! expected tile (published once the version is final) and fetches again if a failure changed
//! them; the server checks each used gradient was computed from the version that worker was
//! given; at the end the final model must equal a serial replay of the logged updates,
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

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use common::*;
use phalanx::{DType, ObjectId, ReduceHandle, ReduceOp, ReduceOptions, SourceClaims};
use std::collections::{BTreeMap, HashMap, VecDeque};
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
    /// Phalanx: updates in flight at once (1 = each update waits for the previous one).
    #[arg(long, default_value_t = 2)]
    pipeline: usize,
    /// Star: the chosen workers pull the new model concurrently, overlapped with the next
    /// gradient pulls, instead of one after another.
    #[arg(long)]
    star_overlap: bool,
    /// A reduce that has not finished after this long stops the run with an error.
    #[arg(long, default_value_t = 30000)]
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
    refetches: u64,
    degrees: Vec<usize>,
}

/// What a worker puts beside each gradient: the model version it computed from, whether the
/// model bytes it fetched were that version's, and how many times it had to fetch again.
fn meta_bytes(v: u64, ok: bool, refetches: u8) -> Vec<u8> {
    let mut m = v.to_le_bytes().to_vec();
    m.extend([ok as u8, refetches]);
    m
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
        let model = ctx.id(format!("model/{v}"));
        let mut refetches = 0u8;
        let ok = loop {
            let matched = match ctx.fetch(model.clone(), 0) {
                Ok(view) => {
                    // Published by the server once version v is final.
                    let tile = bytes_to_tile(&node.get(ctx.id(format!("tile/{v}")))?);
                    is_tiled(&view, &tile)
                }
                Err(e) => {
                    eprintln!("[worker {w}] fetching model {v}: {e}");
                    false
                }
            };
            if matched || refetches >= 3 {
                break matched;
            }
            // A failure during the reduce replaces an input of the model this worker was
            // already reading, which changes its bytes: drop this copy, read the final one.
            node.evict_local(model.clone());
            refetches += 1;
            std::thread::sleep(Duration::from_millis(50));
        };
        if ctx.algo == Algo::Star && !a.star_overlap {
            node.put(ctx.id(format!("have/{w}/{it}")), b"h")?;
        }
        std::thread::sleep(compute_time(
            a.compute_ms,
            a.jitter_ms,
            a.exponential,
            mix3(ctx.common.seed, w as u64, it),
        ));
        node.put(
            ctx.id(format!("gmeta/{w}/{it}")),
            &meta_bytes(v, ok, refetches),
        )?;
        let g = tiled(&grad_tile(ctx.common.seed, w, it, v), size);
        node.put(ctx.id(format!("grad/{w}/{it}")), &g)?;
        it += 1;
    }
}

/// The server's bookkeeping, shared by both algorithms.
struct Book<'a, 'c> {
    ctx: &'a Ctx<'c>,
    workers: Vec<u32>,
    /// The iteration whose gradient each worker computes (or has put) now.
    cur_it: HashMap<u32, u64>,
    /// The model version each (worker, iteration) was given.
    given: HashMap<(u32, u64), u64>,
    /// Workers still needing each live model version.
    holders: BTreeMap<u64, usize>,
    /// Expected tile of each live version.
    tiles: BTreeMap<u64, Vec<f32>>,
    dead: Vec<u32>,
    /// Per update: (worker, iteration, version) of each gradient used.
    log: Vec<Vec<(u32, u64, u64)>>,
    events: Vec<f64>,
    refetches: u64,
}

impl<'a, 'c> Book<'a, 'c> {
    fn new(ctx: &'a Ctx<'c>) -> Result<Self> {
        let workers: Vec<u32> = (1..ctx.n()).collect();
        let tile0 = model0_tile(ctx.common.seed);
        ctx.node
            .put(ctx.id("model/0"), &tiled(&tile0, ctx.common.size))?;
        ctx.node.put(ctx.id("tile/0"), &tile_to_bytes(&tile0))?;
        let mut b = Book {
            ctx,
            cur_it: workers.iter().map(|&w| (w, 0)).collect(),
            given: HashMap::new(),
            holders: BTreeMap::new(),
            tiles: BTreeMap::from([(0, tile0)]),
            workers,
            dead: Vec::new(),
            log: Vec::new(),
            events: Vec::new(),
            refetches: 0,
        };
        for w in b.workers.clone() {
            b.hand(w, 0, 0)?;
        }
        Ok(b)
    }

    fn grad(&self, w: u32, it: u64) -> ObjectId {
        self.ctx.id(format!("grad/{w}/{it}"))
    }

    fn alive(&self) -> Vec<u32> {
        self.workers
            .iter()
            .copied()
            .filter(|w| !self.dead.contains(w))
            .collect()
    }

    fn hand(&mut self, w: u32, it: u64, v: u64) -> Result<()> {
        self.cur_it.insert(w, it);
        self.given.insert((w, it), v);
        *self.holders.entry(v).or_default() += 1;
        self.ctx
            .node
            .put(self.ctx.id(format!("assign/{w}/{it}")), &v.to_le_bytes())?;
        Ok(())
    }

    /// `w`'s current gradient is (being) used: it moves on to its next iteration with `v`.
    fn advance(&mut self, w: u32, v: u64) -> Result<()> {
        let it = self.cur_it[&w] + 1;
        self.hand(w, it, v)
    }

    fn release(&mut self, v: u64) {
        if let Some(h) = self.holders.get_mut(&v) {
            *h = h.saturating_sub(1);
        }
    }

    /// Forgets workers that died; returns how many are alive.
    fn check_dead(&mut self) -> Result<usize> {
        for w in self.workers.clone() {
            if !self.dead.contains(&w) && !self.ctx.alive(w) {
                eprintln!(
                    "[server] worker {w} is down at t={:.2}s",
                    self.ctx.elapsed()
                );
                self.dead.push(w);
                let v = self.given[&(w, self.cur_it[&w])];
                self.release(v);
            }
        }
        let n = self.alive().len();
        if n == 0 {
            bail!("every worker is dead");
        }
        Ok(n)
    }

    /// Update `u` (model/u -> model/u+1) used these gradients: check and log them, publish the
    /// expected tile of the new version, free what is no longer needed.
    fn record(&mut self, u: u64, used: &[(u32, u64)]) -> Result<()> {
        let node = self.ctx.node;
        let seed = self.ctx.common.seed;
        let mut tile = self.tiles[&u].clone();
        let mut entry = Vec::new();
        for &(w, it) in used {
            let meta = self
                .ctx
                .get_small(
                    self.ctx.id(format!("gmeta/{w}/{it}")),
                    w,
                    Duration::from_secs(10),
                )
                .with_context(|| {
                    format!(
                        "update {u}: no metadata for the gradient of worker {w} iteration {it} (dead: {})",
                        self.dead.contains(&w)
                    )
                })?;
            let seen = u64::from_le_bytes(meta[..8].try_into()?);
            ensure!(
                meta[8] == 1,
                "worker {w} iteration {it}: model bytes differed from version {seen}"
            );
            let given = self.given[&(w, it)];
            ensure!(
                seen == given,
                "worker {w} iteration {it} used version {seen}, was given {given}"
            );
            self.refetches += meta[9] as u64;
            tile.iter_mut()
                .zip(grad_tile(seed, w, it, seen))
                .for_each(|(m, g)| *m += g);
            entry.push((w, it, seen));
        }
        node.put(
            self.ctx.id(format!("tile/{}", u + 1)),
            &tile_to_bytes(&tile),
        )?;
        self.tiles.insert(u + 1, tile);
        for &(w, it, seen) in &entry {
            let _ = node.delete(self.grad(w, it));
            let _ = node.delete(self.ctx.id(format!("gmeta/{w}/{it}")));
            self.given.remove(&(w, it));
            self.release(seen);
        }
        self.log.push(entry);
        self.events.push(self.ctx.elapsed());
        Ok(())
    }

    /// Deletes versions no worker needs and no update still reads (versions below `final_v`
    /// are inputs of finished updates only).
    fn collect_garbage(&mut self, final_v: u64) {
        let old: Vec<u64> = self
            .holders
            .iter()
            .filter(|&(&v, &h)| h == 0 && v < final_v)
            .map(|(&v, _)| v)
            .collect();
        for v in old {
            self.holders.remove(&v);
            self.tiles.remove(&v);
            let _ = self.ctx.node.delete(self.ctx.id(format!("model/{v}")));
            let _ = self.ctx.node.delete(self.ctx.id(format!("tile/{v}")));
        }
    }

    /// Stops the workers and checks the final model against a serial replay of the log.
    /// Returns the report and what to delete once the workers are gone.
    fn finish(
        self,
        batch: usize,
        secs: f64,
        degrees: Vec<usize>,
    ) -> Result<(Report, Vec<ObjectId>)> {
        let ctx = self.ctx;
        let node = ctx.node;
        let last = self.log.len() as u64;
        let mut replay = model0_tile(ctx.common.seed);
        for entry in &self.log {
            for &(w, it, v) in entry {
                replay
                    .iter_mut()
                    .zip(grad_tile(ctx.common.seed, w, it, v))
                    .for_each(|(m, g)| *m += g);
            }
        }
        let final_ok = is_tiled(&node.get_view(ctx.id(format!("model/{last}")))?, &replay);
        for &w in &self.workers {
            if !self.dead.contains(&w) {
                let it = self.cur_it[&w] + 1;
                node.put(ctx.id(format!("assign/{w}/{it}")), &STOP.to_le_bytes())?;
            }
        }
        let mut garbage = Vec::new();
        for &w in &self.workers {
            let it = self.cur_it[&w];
            for kind in ["grad", "gmeta"] {
                garbage.push(ctx.id(format!("{kind}/{w}/{it}")));
            }
        }
        for v in self.holders.keys().chain(self.tiles.keys()) {
            garbage.push(ctx.id(format!("model/{v}")));
            garbage.push(ctx.id(format!("tile/{v}")));
        }
        ensure!(
            final_ok,
            "final model differs from the serial replay of {} updates",
            self.log.len()
        );
        let mut used_per_worker = vec![0u64; ctx.n() as usize];
        self.log
            .iter()
            .flatten()
            .for_each(|&(w, _, _)| used_per_worker[w as usize] += 1);
        let report = Report {
            workers: ctx.n() - 1,
            batch,
            updates: last,
            secs,
            events: self.events,
            traffic: Vec::new(),
            used_per_worker,
            refetches: self.refetches,
            degrees,
        };
        Ok((report, garbage))
    }
}

/// One Phalanx update in flight: the reduce `model/u -> model/u+1`.
struct Flight {
    u: u64,
    handle: ReduceHandle,
    /// The gradients offered to it: id -> (worker, iteration).
    offered: HashMap<ObjectId, (u32, u64)>,
    /// Workers whose gradients it placed (handed `model/u+1` already).
    placed: Option<Vec<u32>>,
}

impl Flight {
    /// Hands the new version to the workers whose gradients were placed, once they are.
    fn poll_placed(&mut self, book: &mut Book, wait: Duration) -> Result<()> {
        if self.placed.is_some() {
            return Ok(());
        }
        if let Some(inputs) = self.handle.inputs_timeout(wait) {
            let ws: Vec<u32> = inputs
                .iter()
                .filter_map(|id| self.offered.get(id))
                .map(|&(w, _)| w)
                .collect();
            for &w in &ws {
                book.advance(w, self.u + 1)?;
            }
            self.placed = Some(ws);
        }
        Ok(())
    }
}

fn server_phalanx(ctx: &Ctx, a: &Args, batch: usize) -> Result<(Report, Vec<ObjectId>)> {
    let node = ctx.node;
    let mut book = Book::new(ctx)?;
    let claims = SourceClaims::new();
    let mut flights: VecDeque<Flight> = VecDeque::new();
    let mut degrees = Vec::new();
    let mut consumed: Vec<ObjectId> = Vec::new();
    let (mut started, mut done) = (0u64, 0u64);
    while done < a.updates {
        let alive = book.check_dead()?;
        let starting = started < a.updates && !ctx.out_of_time();
        if !starting && flights.is_empty() {
            break;
        }
        // Start the next update once the previous one has its inputs.
        if starting
            && flights.len() < a.pipeline.max(1)
            && flights.back().is_none_or(|f| f.placed.is_some())
        {
            let u = started;
            let model = ctx.id(format!("model/{u}"));
            let offered: HashMap<ObjectId, (u32, u64)> = book
                .alive()
                .into_iter()
                .map(|w| (book.grad(w, book.cur_it[&w]), (w, book.cur_it[&w])))
                .collect();
            let sources: Vec<ObjectId> = std::iter::once(model.clone())
                .chain(offered.keys().cloned())
                .collect();
            let opts = ReduceOptions {
                degree: a.degree,
                timeout: Some(Duration::from_millis(a.reduce_timeout_ms)),
                required: vec![model],
                claims: Some(claims.clone()),
                ..ReduceOptions::default()
            };
            let k = batch.min(alive);
            let handle = node.reduce_start(
                ctx.id(format!("model/{}", u + 1)),
                sources,
                k + 1,
                ReduceOp::Sum,
                DType::F32,
                opts,
            )?;
            flights.push_back(Flight {
                u,
                handle,
                offered,
                placed: None,
            });
            started += 1;
        }
        // The newest update's inputs; this short wait is also the loop's pacing.
        if let Some(f) = flights.back_mut() {
            f.poll_placed(&mut book, Duration::from_millis(3))?;
        }
        // Finished updates, oldest first (each one's result is the next one's input).
        while flights.front().is_some_and(|f| f.handle.is_finished()) {
            let mut f = flights.pop_front().expect("a flight");
            f.poll_placed(&mut book, Duration::ZERO)?;
            let o = f
                .handle
                .wait()
                .with_context(|| format!("update {} (reduce into model/{})", f.u, f.u + 1))?;
            degrees.push(o.degree);
            let used: Vec<(u32, u64)> = o
                .used
                .iter()
                .filter_map(|id| f.offered.get(id).copied())
                .collect();
            // A failure can replace a placed gradient by a spare: that worker moves on now.
            let placed = f.placed.unwrap_or_default();
            for &(w, _) in &used {
                if !placed.contains(&w) {
                    book.advance(w, f.u + 1)?;
                }
            }
            book.record(f.u, &used)?;
            consumed.extend(used.iter().map(|&(w, it)| book.grad(w, it)));
            // A used gradient stays claimed while a reduce in flight was offered it: released,
            // that reduce could still pick it (as a spare after a failure).
            consumed.retain(|id| {
                let offered = flights.iter().any(|g| g.offered.contains_key(id));
                if !offered {
                    claims.forget(id);
                }
                offered
            });
            done += 1;
            book.collect_garbage(done);
        }
    }
    let secs = ctx.elapsed();
    book.finish(batch, secs, degrees)
}

fn server_star(ctx: &Ctx, a: &Args, batch: usize) -> Result<(Report, Vec<ObjectId>)> {
    let node = ctx.node;
    let size = ctx.common.size;
    let mut book = Book::new(ctx)?;
    let mut model: Vec<f32> = bytes_to_tile(&tiled(&book.tiles[&0], size));
    let mut arrivals = Arrivals::new();
    for w in book.alive() {
        arrivals.watch(node, w, w, book.grad(w, 0))?;
    }
    let mut u = 0u64;
    while u < a.updates && !ctx.out_of_time() {
        let alive = book.check_dead()?;
        for &w in &book.dead {
            arrivals.forget(w);
        }
        let k = batch.min(alive);
        // The gradients, one by one in arrival order.
        let deadline = Instant::now() + Duration::from_millis(a.reduce_timeout_ms);
        let mut used = Vec::new();
        let mut next = model.clone();
        while used.len() < k {
            if arrivals.wait(ctx, k - used.len(), deadline) == 0 {
                break;
            }
            let w = arrivals.ready.remove(0);
            let it = book.cur_it[&w];
            match ctx.fetch(book.grad(w, it), w) {
                Ok(view) => {
                    add_f32(&mut next, &view);
                    used.push((w, it));
                }
                Err(e) => eprintln!("[server] gradient of worker {w} lost ({e})"),
            }
        }
        if used.len() < k {
            eprintln!(
                "[server] update {u}: only {} gradients; waiting",
                used.len()
            );
            // They stay ready for the next attempt.
            for &(w, _) in used.iter().rev() {
                arrivals.ready.insert(0, w);
            }
            continue;
        }
        model = next;
        book.record(u, &used)?;
        let v = u + 1;
        node.put(ctx.id(format!("model/{v}")), bytemuck::cast_slice(&model))?;
        // The new model, to one chosen worker after another (or to all at once).
        for &(w, it) in &used {
            book.advance(w, v)?;
            if !a.star_overlap {
                let have = ctx.id(format!("have/{w}/{}", it + 1));
                let timeout = Duration::from_millis(a.reduce_timeout_ms);
                if ctx.get_small(have.clone(), w, timeout).is_none() {
                    eprintln!("[server] worker {w} did not take model {v}");
                }
                let _ = node.delete(have);
            }
            arrivals.watch(node, w, w, book.grad(w, it + 1))?;
        }
        u += 1;
        book.collect_garbage(u);
    }
    let secs = ctx.elapsed();
    book.finish(batch, secs, Vec::new())
}

fn server(ctx: &Ctx, a: &Args) -> Result<Report> {
    let base = traffic_base(ctx.node);
    let batch = a.batch.unwrap_or((ctx.n() as usize - 1) / 2).max(1);
    let (mut r, garbage) = match ctx.algo {
        Algo::Phalanx => server_phalanx(ctx, a, batch)?,
        Algo::Star => server_star(ctx, a, batch)?,
    };
    r.traffic = collect_traffic(ctx, base);
    for id in garbage {
        let _ = ctx.node.delete(id);
    }
    Ok(r)
}

fn main() -> Result<()> {
    let a = Args::parse();
    let c = &a.common;
    let n = c.local.unwrap_or(8) as u64;
    let arena = (n + 4) * c.size + (64 << 20);
    let results = run_roles(
        "ps",
        c,
        arena,
        true,
        |ctx| server(ctx, &a),
        |ctx| worker(ctx, &a),
    )?;
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
        "algo", "updates", "secs", "updates/s", "server MiB/upd", "max wkr MiB/upd", "refetch"
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
            r.refetches
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
        print_timeline(c, &format!("{algo:?} updates"), &r.events, r.secs);
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
            let own = serde_json::json!({
                "workers": r.workers, "batch": r.batch, "updates": r.updates,
                "updates_per_s": r.updates as f64 / r.secs, "traffic": r.traffic,
            });
            print_json(c, "param_server", *algo, &r.events, r.secs, own);
        }
    }
    Ok(())
}
