//! Randomized broadcasts over real TCP on loopback, each drawn from a seed: 3 to 7 nodes,
//! sizes from inline (1 KiB, just under 64 KiB) through one chunk and a few to many chunks
//! (12 MiB), readers on a random subset of the other nodes that start before, during or after
//! the put, each reading with `get`, `get_view`, a stream, a view with its own timeout or a
//! `gather` of the object and two others put by nodes that do not die; in some runs a
//! complete replica is made first, and in half of them one node (the putter, a reader, or
//! the replica) is killed or frozen a random while after the object is known to the
//! directory; in some runs a node deletes the object meanwhile (with a death or without).
//! Some readers read from the putter only (`get_view_from`, the star baseline's read), where
//! the putter does not die. Some clusters have one or two nodes more that take no part but
//! own directory entries, some a crowd of three to six more readers (up to 15 nodes in all),
//! and some make their links on demand.
//!
//! Every reader that is not the victim must end with exactly the bytes put, or "not found"
//! if the object was deleted, within seconds.
//! It may instead be told the object is lost only when no complete copy can have survived:
//! the victim held the only complete copy it could read (no live node had a complete copy
//! when it died, and for a small object the directory's inline copy died with it too).
//!
//! Bounded: `PHALANX_SOAK_RUNS` runs (default 16, a few seconds) from seed
//! `PHALANX_SOAK_SEED` (default 1); a failure names its seed, which alone replays it:
//! `PHALANX_SOAK_SEED=7 PHALANX_SOAK_RUNS=1 cargo test --release --test broadcast_soak`.

#[path = "common/log.rs"]
mod log;
#[path = "common/soak.rs"]
mod soak;

use phalanx::{Node, ObjectId};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::io::Read as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How a reader reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Read {
    Get,
    View,
    Stream,
    /// `get_view_timeout` with a timeout longer than the run may take.
    ViewTimeout,
    /// `gather` of the object and the case's companions.
    Gather,
    /// `get_view_from` the putter (no tree): only where the putter does not die.
    FromSource,
}

/// How the victim goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Death {
    /// Its links drop at once.
    Kill,
    /// It goes silent; its peers learn of it by heartbeats.
    Freeze,
}

#[derive(Debug)]
struct Case {
    seed: u64,
    nodes: usize,
    size: usize,
    /// The putter.
    source: usize,
    /// A node that reads a complete copy before the readers start.
    replica: Option<usize>,
    /// (node, how, when it starts after the put began: may be before the put, which is
    /// `put_after` late).
    readers: Vec<(usize, Read, Duration)>,
    put_after: Duration,
    /// A node that dies `after` the directory first knows the object.
    victim: Option<(usize, Death, Duration)>,
    /// Objects other nodes (never the victim) put before the readers start, gathered with
    /// the object by the `Gather` readers: (putter, size).
    companions: Vec<(usize, usize)>,
    /// A node that deletes the object `after` the directory first knows it (its readers then
    /// end with the bytes or "not found"); in a run with a victim, never the victim.
    delete: Option<(usize, Duration)>,
    /// Nodes more that take no part but own directory entries (the object's, the
    /// companions'), and whether links are made on demand (deaths then spread from the
    /// victim's ring watchers).
    spare: usize,
    on_demand: bool,
    /// Readers more, on nodes of their own after the spares, each reading with `get` at a
    /// random instant (never the victim).
    crowd: Vec<Duration>,
}

impl Case {
    fn draw(seed: u64) -> Case {
        let mut g = rand::rngs::StdRng::seed_from_u64(seed);
        let nodes = g.gen_range(3..=7);
        let size = *[
            1 << 10,
            (64 << 10) - 1,
            64 << 10,
            200 << 10,
            (1 << 20) + 13,
            4 << 20,
            12 << 20,
        ]
        .choose(&mut g)
        .unwrap();
        let source = g.gen_range(0..nodes);
        let others: Vec<usize> = (0..nodes).filter(|&k| k != source).collect();
        let replica = g.gen_bool(0.3).then(|| *others.choose(&mut g).unwrap());
        let mut readers: Vec<usize> = others
            .iter()
            .copied()
            .filter(|&k| Some(k) != replica)
            .collect();
        readers.shuffle(&mut g);
        readers.truncate(g.gen_range(1..=readers.len().max(1)));
        let reads = [Read::Get, Read::View, Read::Stream, Read::ViewTimeout];
        let readers = readers
            .into_iter()
            .map(|k| {
                let at = Duration::from_millis(g.gen_range(0..60));
                (k, *reads.choose(&mut g).unwrap(), at)
            })
            .collect();
        let put_after = Duration::from_millis(*[0, 0, 5, 30].choose(&mut g).unwrap());
        let victim = g.gen_bool(0.5).then(|| {
            let who = match g.gen_range(0..3) {
                0 => source,
                1 if replica.is_some() => replica.unwrap(),
                _ => g.gen_range(0..nodes),
            };
            let how = match g.gen_bool(0.25) {
                true => Death::Freeze,
                false => Death::Kill,
            };
            (who, how, Duration::from_millis(g.gen_range(0..40)))
        });
        // Drawn last, so that the seeds drawn before keep their cases: some readers gather
        // the object with two companions put by nodes that do not die.
        let mut readers: Vec<(usize, Read, Duration)> = readers;
        for r in readers.iter_mut() {
            if g.gen_bool(0.2) {
                r.1 = Read::Gather;
            }
        }
        let safe: Vec<usize> = (0..nodes)
            .filter(|&k| Some(k) != victim.map(|v| v.0))
            .collect();
        let companions = (0..2)
            .map(|_| {
                let size = *[1 << 10, 100 << 10, 2 << 20].choose(&mut g).unwrap();
                (*safe.choose(&mut g).unwrap(), size)
            })
            .collect();
        let delete = (victim.is_none() && g.gen_bool(0.3)).then(|| {
            (
                g.gen_range(0..nodes),
                Duration::from_millis(g.gen_range(0..40)),
            )
        });
        // Drawn last too.
        let spare = *[0, 0, 1, 2].choose(&mut g).unwrap();
        let on_demand = g.gen_bool(0.3);
        // Drawn last too: a delete while a node dies, reads from the putter only (which
        // must then live), a crowd of readers more.
        let delete = match victim {
            Some((v, _, _)) if g.gen_bool(0.3) => {
                let d = *safe.choose(&mut g).unwrap_or(&((v + 1) % nodes));
                Some((d, Duration::from_millis(g.gen_range(0..40))))
            }
            _ => delete,
        };
        let putter_lives = victim.is_none_or(|v| v.0 != source);
        for r in readers.iter_mut() {
            if putter_lives && g.gen_bool(0.15) {
                r.1 = Read::FromSource;
            }
        }
        let crowd = match g.gen_bool(0.15) {
            true => (0..g.gen_range(3..=6))
                .map(|_| Duration::from_millis(g.gen_range(0..60)))
                .collect(),
            false => Vec::new(),
        };
        Case {
            seed,
            nodes,
            size,
            source,
            replica,
            readers,
            put_after,
            victim,
            companions,
            delete,
            spare,
            on_demand,
            crowd,
        }
    }

    /// Runs the case on a fresh cluster; what went wrong, if anything.
    fn run(&self) -> Result<Duration, String> {
        let n = self.nodes;
        let crowd_at = n + self.spare;
        let c = soak::cluster(crowd_at + self.crowd.len(), 256 << 20, self.on_demand)?;
        let mut g = rand::rngs::StdRng::seed_from_u64(self.seed ^ 0x5eed);
        let mut data = vec![0u8; self.size];
        g.fill(&mut data[..]);
        let id = ObjectId::new(format!("bsoak{}/obj", self.seed));
        let mut others = Vec::new();
        for (j, &(putter, size)) in self.companions.iter().enumerate() {
            let mut bytes = vec![0u8; size];
            g.fill(&mut bytes[..]);
            let cid = ObjectId::new(format!("bsoak{}/companion{j}", self.seed));
            c.node(putter)
                .put(cid.clone(), &bytes)
                .map_err(|e| format!("companion {j}: {e}"))?;
            others.push((cid, bytes));
        }
        let shard = c.node(0).shard_of(id.clone()) as usize;
        let victim = self.victim.map(|v| v.0);
        let (c, data, id, others) = (&c, &data, &id, &others);
        let mut held_at_death: Option<Vec<usize>> = None;
        let known = &AtomicBool::new(false);
        let start = Instant::now();
        let results = std::thread::scope(|s| {
            // The replica first, complete before the clock starts for the readers.
            let mut put = Some(s.spawn(move || {
                std::thread::sleep(self.put_after);
                c.node(self.source).put(id.clone(), data)
            }));
            if let Some(r) = self.replica {
                let p = put.take().expect("not joined yet").join().unwrap();
                p.map_err(|e| format!("put: {e}"))?;
                let got = c
                    .node(r)
                    .get(id.clone())
                    .map_err(|e| format!("replica: {e}"))?;
                if got != *data {
                    return Err("the replica's bytes differ".to_string());
                }
            }
            let t0 = Instant::now();
            let crowd = self
                .crowd
                .iter()
                .enumerate()
                .map(|(j, &at)| (crowd_at + j, Read::Get, at));
            let readers: Vec<_> = self
                .readers
                .iter()
                .copied()
                .chain(crowd)
                .map(|(k, how, at)| {
                    let h = s.spawn(move || {
                        std::thread::sleep(at.saturating_sub(t0.elapsed()));
                        let r = read(c.node(k), id, how, others, self.source);
                        (r, t0.elapsed())
                    });
                    (k, h)
                })
                .collect();
            let deleter = self.delete.map(|(d, after)| {
                s.spawn(move || -> Result<(), String> {
                    let t = Instant::now();
                    while c.node(d).locate(id.clone()).ok().flatten().is_none() {
                        if t.elapsed() > Duration::from_secs(10) {
                            return Ok(());
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    known.store(true, Ordering::Release);
                    std::thread::sleep(after);
                    let t = Instant::now();
                    let r = c.node(d).delete(id.clone());
                    if t.elapsed() > Duration::from_secs(15) {
                        return Err(format!("the delete took {:?}", t.elapsed()));
                    }
                    // With a death meanwhile the delete may fail (the entry's owner died
                    // under it); it must still return, and readers still end.
                    match (r, victim) {
                        (Err(e), None) => Err(format!("delete: {e}")),
                        _ => Ok(()),
                    }
                })
            });
            if let Some((v, how, mut after)) = self.victim {
                // The putter that owns the object's entry too tells the entry's next owner
                // of its copy 10 ms after the put (README "Not covered": before that, its
                // death leaves the object unknown there, and readers wait as for one never
                // put). It dies later than that here.
                if v == self.source && shard == v {
                    after = after.max(Duration::from_millis(60));
                }
                // Known to the directory first: a put that never began is not a loss. (The
                // deleter may have seen it first and deleted it since.)
                let watcher = (0..n).find(|&k| k != v).unwrap();
                while !known.load(Ordering::Acquire)
                    && c.node(watcher).locate(id.clone()).ok().flatten().is_none()
                {
                    if t0.elapsed() > Duration::from_secs(10) {
                        return Err("the object never reached the directory".into());
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                std::thread::sleep(after);
                let held: Vec<usize> = (0..crowd_at + self.crowd.len())
                    .filter(|&k| k != v)
                    .filter(|&k| holds_complete(c.node(k), id))
                    .collect();
                held_at_death = Some(held);
                match how {
                    Death::Kill => c.node(v).kill(),
                    Death::Freeze => {
                        c.node(v).freeze();
                    }
                }
            }
            let mut out = Vec::new();
            for (k, h) in readers {
                let (r, took) = h.join().map_err(|_| format!("reader {k} panicked"))?;
                out.push((k, r, took));
            }
            if let Some(d) = deleter {
                d.join().map_err(|_| "the deleter panicked".to_string())??;
            }
            if let Some(put) = put {
                match put.join().unwrap() {
                    Err(e) if victim != Some(self.source) && self.delete.is_none() => {
                        return Err(format!("put: {e}"))
                    }
                    _ => {}
                }
            }
            Ok(out)
        })?;
        // Could every complete copy have died? The victim was the only node with one, and
        // a small object's inline copy lived on the victim too (its entry's shard).
        let small = self.size < 64 << 10;
        let may_be_lost = match (victim, &held_at_death) {
            (Some(v), Some(held)) => held.is_empty() && (!small || shard == v),
            _ => false,
        };
        for (k, r, took) in results {
            if Some(k) == victim {
                continue;
            }
            if took > Duration::from_secs(15) {
                return Err(format!(
                    "reader {k} took {took:?} (complete copies on live nodes at the death: \
                     {held_at_death:?}, shard {shard})"
                ));
            }
            match r {
                Ok(bytes) if bytes == *data => {}
                Ok(bytes) => {
                    let at = bytes.iter().zip(data.iter()).position(|(a, b)| a != b);
                    return Err(format!(
                        "reader {k} got different bytes ({} of {}, first difference at {at:?})",
                        bytes.len(),
                        data.len()
                    ));
                }
                Err(e) if may_be_lost && e.contains("lost") => {}
                Err(e) if self.delete.is_some() && e.contains("not found") => {}
                Err(e) => {
                    return Err(format!(
                        "reader {k} ({took:?}): {e} (complete copies on live nodes at the \
                         death: {held_at_death:?}, shard {shard})"
                    ))
                }
            }
        }
        Ok(start.elapsed())
    }
}

/// Whether `node` has a complete copy of `id` in its store.
fn holds_complete(node: &Node, id: &ObjectId) -> bool {
    node.local_copy(id.clone())
        .is_some_and(|c| c.status == phalanx::store::CopyStatus::Complete)
}

/// One reader's read, as bytes (a gather checks the companions' and returns the object's).
fn read(
    node: &Node,
    id: &ObjectId,
    how: Read,
    others: &[(ObjectId, Vec<u8>)],
    source: usize,
) -> Result<Vec<u8>, String> {
    let text = |e: phalanx::Error| e.to_string();
    match how {
        Read::Gather => {
            let ids: Vec<ObjectId> = std::iter::once(id.clone())
                .chain(others.iter().map(|o| o.0.clone()))
                .collect();
            let mut got = node.gather(&ids).map_err(text)?;
            for (k, (cid, bytes)) in others.iter().enumerate() {
                if got[k + 1] != *bytes {
                    return Err(format!("gathered {cid} differs"));
                }
            }
            Ok(got.swap_remove(0))
        }
        Read::Get => node.get(id.clone()).map_err(text),
        Read::View => node.get_view(id.clone()).map(|v| v.to_vec()).map_err(text),
        Read::FromSource => node
            .get_view_from(id.clone(), source as u32)
            .map(|v| v.to_vec())
            .map_err(text),
        Read::ViewTimeout => node
            .get_view_timeout(id.clone(), Duration::from_secs(25))
            .map(|v| v.to_vec())
            .map_err(text),
        Read::Stream => {
            let mut r = node.get_stream(id.clone()).map_err(text)?;
            let mut out = Vec::new();
            r.read_to_end(&mut out).map_err(|e| e.to_string())?;
            Ok(out)
        }
    }
}

#[test]
fn randomized_broadcasts_end_with_the_bytes_put_with_and_without_a_death() {
    log::from_env();
    let (runs, first, deaths) =
        soak::soak(16, Case::draw, |c| c.victim.is_some(), |case| case.run());
    println!("{runs} runs from seed {first}, {deaths} with a node killed or frozen: all correct");
}
