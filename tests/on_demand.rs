//! A cluster whose links are made on demand: broadcast, reduce and a source's death work as
//! with a mesh, and a node that takes no part keeps no link but those to the ring neighbours
//! it watches (two on each side).

#[path = "common/log.rs"]
mod log;

use phalanx::transport::TcpConfig;
use phalanx::{DType, LocalCluster, NodeConfig, ObjectId, ReduceOp};
use std::time::Duration;

const N: u32 = 8;
/// Takes part in nothing: the collectives below run on nodes 0..IDLE.
const IDLE: usize = 7;

fn cluster() -> LocalCluster {
    let cfg = NodeConfig {
        arena_size: 256 << 20,
        op_timeout: Duration::from_secs(60),
        ..NodeConfig::default()
    };
    let tcp = TcpConfig {
        heartbeat_timeout: Duration::from_secs(2),
        ..TcpConfig::default()
    }
    .on_demand();
    LocalCluster::start(N, cfg, tcp).unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// The ring neighbours node `k` watches in a cluster of `n` (none dead).
fn ring(k: usize, n: usize) -> Vec<usize> {
    [1, 2, n - 1, n - 2].iter().map(|d| (k + d) % n).collect()
}

/// Whether node `k` has a link to a peer that is not its ring neighbour.
fn linked_off_ring(c: &LocalCluster, k: usize, n: usize) -> Option<usize> {
    let ring = ring(k, n);
    (0..n).find(|&p| p != k && !ring.contains(&p) && c.node(k).transport().is_connected(p as u32))
}

/// A small node and links on demand with a short heartbeat, for the membership tests.
fn watching_config(heartbeat: Duration) -> (NodeConfig, TcpConfig) {
    let cfg = NodeConfig {
        arena_size: 16 << 20,
        op_timeout: Duration::from_secs(30),
        ..NodeConfig::default()
    };
    let tcp = TcpConfig {
        heartbeat_timeout: heartbeat,
        ..TcpConfig::default()
    }
    .on_demand();
    (cfg, tcp)
}

/// Links of node `k`: open now, most at once.
fn links(c: &LocalCluster, k: usize) -> (usize, usize) {
    let l = c.node(k).transport().link_counts().unwrap();
    (l.open, l.peak)
}

#[test]
fn collectives_run_over_links_made_on_demand() {
    let c = cluster();
    for k in 0..N as usize {
        assert_eq!(
            linked_off_ring(&c, k, N as usize),
            None,
            "node {k} before any use"
        );
        assert!(links(&c, k).1 <= 4, "node {k}: {:?}", links(&c, k));
    }
    // Broadcast: every entry lives on node 0 (homed names), every other node but the idle
    // one gets the object, staggered so they form a tree.
    let data = pattern(8 << 20, 7);
    let id = ObjectId::homed(0, "bcast");
    c.node(0).put(id.clone(), &data).unwrap();
    std::thread::scope(|s| {
        for k in 1..IDLE {
            let (c, id, data) = (&c, id.clone(), &data);
            s.spawn(move || {
                std::thread::sleep(Duration::from_millis(5 * k as u64));
                assert!(c.node(k).get(id).unwrap() == *data, "node {k}'s copy");
            });
        }
    });
    // Reduce: inputs on nodes 0..IDLE, coordinated by node 0.
    let elems = 1 << 18;
    let inputs: Vec<ObjectId> = (0..IDLE)
        .map(|k| {
            let id = ObjectId::homed(0, format!("in{k}"));
            let v: Vec<u8> = (0..elems)
                .flat_map(|i| ((i % 97) as f32 + k as f32).to_le_bytes())
                .collect();
            c.node(k).put(id.clone(), &v).unwrap();
            id
        })
        .collect();
    let out = ObjectId::homed(0, "sum");
    let o = c
        .node(0)
        .reduce(out.clone(), &inputs, IDLE, ReduceOp::Sum, DType::F32)
        .unwrap();
    assert_eq!(o.used.len(), IDLE);
    let got = c.node(3).get(out).unwrap();
    for (i, x) in got.chunks_exact(4).enumerate() {
        let want: f32 = (0..IDLE).map(|k| (i % 97) as f32 + k as f32).sum();
        assert_eq!(
            f32::from_le_bytes(x.try_into().unwrap()),
            want,
            "element {i}"
        );
    }
    // The idle node has no link but its ring's; every other node did not need all of its
    // peers either (the directory is on node 0, each source served a few).
    assert_eq!(linked_off_ring(&c, IDLE, N as usize), None);
    assert!(links(&c, IDLE).1 <= 4, "{:?}", links(&c, IDLE));
    let most: Vec<usize> = (0..IDLE).map(|k| links(&c, k).1).collect();
    assert!(most.iter().all(|&l| l >= 1 && l < N as usize), "{most:?}");
    println!(
        "links at most open per node: {most:?} (idle node: {}, its ring)",
        links(&c, IDLE).1
    );
}

#[test]
fn a_source_killed_mid_transfer_is_replaced_over_links_made_on_demand() {
    let c = cluster();
    let data = pattern(48 << 20, 3);
    let id = ObjectId::homed(0, "big");
    c.node(0).put(id.clone(), &data).unwrap();
    // Node 1 takes a complete copy, then node 0 is the one left to fail over to.
    assert!(c.node(1).get(id.clone()).unwrap() == data);
    std::thread::scope(|s| {
        let getter = s.spawn(|| c.node(2).get(id.clone()).unwrap());
        std::thread::sleep(Duration::from_millis(3));
        c.node(1).kill();
        assert!(getter.join().unwrap() == data, "node 2's copy");
    });
    // A node that never talked to node 1 learns of its death on first use, not before.
    assert!(c.node(5).transport().is_up(1));
    assert!(c.node(5).get(id).unwrap() == data);
}

/// Links close when idle except where something depends on their peer: a get waiting at a
/// shard keeps its link, so the shard's death reaches the waiter by heartbeat; a link nobody
/// needs any more closes.
#[test]
fn links_stay_where_something_waits_and_close_elsewhere() {
    let heartbeat = Duration::from_millis(500);
    let cfg = NodeConfig {
        arena_size: 64 << 20,
        op_timeout: Duration::from_secs(30),
        ..NodeConfig::default()
    };
    let tcp = TcpConfig {
        heartbeat_timeout: heartbeat,
        idle_timeout: Duration::from_millis(200),
        ..TcpConfig::default()
    }
    .on_demand();
    // 8 nodes: 0 and 4, and 1 and 5, are not ring neighbours (whose links stay).
    let c = LocalCluster::start(8, cfg, tcp).unwrap();
    // Node 4 fetches an object whose entry is on node 0, then it is deleted: nothing links
    // 4 and 0 any more, and the link closes.
    let x = ObjectId::homed(0, "x");
    c.node(0).put(x.clone(), &pattern(100_000, 1)).unwrap();
    assert_eq!(c.node(4).get(x.clone()).unwrap(), pattern(100_000, 1));
    c.node(4).delete(x).unwrap();
    // Node 5 waits for an object whose entry is on node 1 and that nobody has put yet.
    let later = ObjectId::homed(1, "later");
    std::thread::scope(|s| {
        let waiter = s.spawn(|| c.node(5).get(later.clone()));
        let t = std::time::Instant::now();
        while c.node(4).transport().is_connected(0) {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "an unneeded link stayed"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(t.elapsed() >= Duration::from_millis(100));
        // Long past the idle timeout, the waiting get still has its link to node 1.
        std::thread::sleep(Duration::from_millis(600));
        assert!(
            c.node(5).transport().is_connected(1),
            "the waiter's link closed"
        );
        let killed = std::time::Instant::now();
        c.node(1).kill();
        while c.node(5).transport().is_up(1) {
            assert!(
                killed.elapsed() < Duration::from_secs(5),
                "death never noticed"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let noticed = killed.elapsed();
        println!("the waiter learnt of the shard's death after {noticed:?}");
        assert!(noticed <= heartbeat * 2, "{noticed:?}");
        // The entry moves: a put now reaches the waiter through the new shard.
        c.node(2).put(later.clone(), &pattern(5000, 9)).unwrap();
        assert_eq!(waiter.join().unwrap().unwrap(), pattern(5000, 9));
    });
    let closed = c.node(4).transport().link_counts().unwrap().idle_closed
        + c.node(0).transport().link_counts().unwrap().idle_closed;
    assert!(closed >= 1);
}

/// A shard dies: the holders of the copies it listed were linked to it (it depended on them),
/// so they learn of it and republish at the entry's new node; a node that never talked to the
/// dead shard learns of the death on first use and finds the object at the new node.
#[test]
fn a_dead_shard_moves_its_entries_for_nodes_that_never_linked_it() {
    let c = cluster();
    let data = pattern(3 << 20, 11);
    let id = ObjectId::homed(2, "held");
    c.node(4).put(id.clone(), &data).unwrap();
    assert!(c.node(5).get(id.clone()).unwrap() == data);
    assert!(!c.node(6).transport().is_connected(2));
    c.node(2).kill();
    let t = std::time::Instant::now();
    assert!(c.node(6).get(id).unwrap() == data, "node 6's copy");
    println!("found at the entry's new node after {:?}", t.elapsed());
    assert!(c.node(6).believes_down(2));
}

/// Failure detection that scales: each node watches its four ring neighbours, so a quiet
/// node sends about four heartbeats per period whatever the cluster size, and a node that
/// goes silent (a hung host: its links stay open) is believed dead by every node, including
/// one waiting on it with no link of its own to watch it, within the heartbeat timeout plus
/// a period or two (the watchers' silence check, then the news spread over the ring).
#[test]
fn a_silent_node_is_believed_dead_everywhere_within_the_heartbeat_bound() {
    let n = 16;
    let heartbeat = Duration::from_millis(500);
    let (cfg, tcp) = watching_config(heartbeat);
    let c = LocalCluster::start(n, cfg, tcp).unwrap();
    for k in 0..n as usize {
        let mut w = c.node(k).watched_peers();
        w.sort();
        let mut want = ring(k, n as usize);
        want.sort();
        assert_eq!(w.iter().map(|&p| p as usize).collect::<Vec<_>>(), want);
    }
    // Heartbeats in a quiet second: four watched links per node (each watched both ways).
    std::thread::sleep(heartbeat);
    let sent = |k: usize| c.node(k).transport().link_counts().unwrap().heartbeats_sent;
    let before: Vec<u64> = (0..n as usize).map(sent).collect();
    std::thread::sleep(Duration::from_secs(1));
    let periods = 1.0 / (heartbeat.as_secs_f64() / 4.0);
    for (k, b) in before.iter().enumerate() {
        let per = (sent(k) - b) as f64 / periods;
        assert!(per <= 6.0, "node {k}: {per:.1} heartbeats per period");
        assert!(per >= 2.0, "node {k}: {per:.1} heartbeats per period");
    }
    // Node 12 waits for an object whose entry is on node 5 (not its ring neighbour).
    let victim = 5;
    let id = ObjectId::homed(victim as u32, "never");
    std::thread::scope(|s| {
        let waiter = s.spawn(|| c.node(12).get(id.clone()));
        std::thread::sleep(Duration::from_millis(100));
        let t0 = std::time::Instant::now();
        assert!(c.node(victim).freeze());
        let mut learnt = vec![None; n as usize];
        while t0.elapsed() < heartbeat * 10 {
            for (k, l) in learnt.iter_mut().enumerate() {
                if k != victim && l.is_none() && c.node(k).believes_down(victim as u32) {
                    *l = Some(t0.elapsed());
                }
            }
            if learnt
                .iter()
                .enumerate()
                .all(|(k, l)| k == victim || l.is_some())
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let slowest = learnt
            .iter()
            .enumerate()
            .filter(|&(k, _)| k != victim)
            .map(|(k, l)| l.unwrap_or_else(|| panic!("node {k} never learnt of it")))
            .max()
            .unwrap();
        println!("every node believed the silent node dead within {slowest:?}");
        // Nominally the timeout, a scan (1/4) and the news' hops, plus a probe (200 ms) for
        // nodes still linked to it; the bound leaves room for a loaded machine.
        assert!(slowest <= heartbeat * 3, "{slowest:?}");
        // The waiter's entry moved: a put now reaches it through the new shard.
        c.node(3).put(id.clone(), &pattern(5000, 4)).unwrap();
        assert_eq!(waiter.join().unwrap().unwrap(), pattern(5000, 4));
    });
}

/// A false suspicion is undone: a node announces the death of a live one; nodes linked to
/// it ask it first, the others believe the news, and the live node, told of its own death,
/// refutes it with a higher incarnation, after which every node believes it alive again and
/// its directory entries are back on it.
#[test]
fn a_live_node_refutes_news_of_its_death() {
    let n = 16;
    let (cfg, tcp) = watching_config(Duration::from_millis(500));
    let c = LocalCluster::start(n, cfg, tcp).unwrap();
    let (liar, victim) = (3, 9u32);
    c.node(liar).announce_death(victim);
    let t0 = std::time::Instant::now();
    // Everyone ends up believing it alive (some never stopped).
    loop {
        let down: Vec<usize> = (0..n as usize)
            .filter(|&k| c.node(k).believes_down(victim))
            .collect();
        if down.is_empty() && t0.elapsed() > Duration::from_millis(300) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "still believed dead by {down:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    println!("refuted everywhere within {:?}", t0.elapsed());
    let id = ObjectId::homed(victim, "after");
    assert_eq!(c.node(14).shard_of(id.clone()), victim);
    c.node(0).put(id.clone(), &pattern(70_000, 2)).unwrap();
    assert_eq!(c.node(14).get(id).unwrap(), pattern(70_000, 2));
}

/// A killed node's death reaches every node; restarted, it is alive again for every node
/// (`LocalCluster::restart` links it to every peer, as a rejoining transport does, and it
/// also spreads news of itself alive in a new incarnation for nodes it does not link): its
/// directory entries are home again.
#[test]
fn a_restarted_node_is_believed_alive_again_everywhere() {
    log::from_env();
    let n = 12;
    let (cfg, tcp) = watching_config(Duration::from_millis(500));
    let mut c = LocalCluster::start(n, cfg.clone(), tcp.clone()).unwrap();
    let victim = 6u32;
    let everyone = |c: &LocalCluster, down: bool| {
        (0..n as usize)
            .filter(|&k| k != victim as usize)
            .all(|k| c.node(k).believes_down(victim) == down)
    };
    c.node(victim as usize).kill();
    let t0 = std::time::Instant::now();
    while !everyone(&c, true) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the death did not spread"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let id = ObjectId::homed(victim, "home");
    assert_ne!(c.node(0).shard_of(id.clone()), victim);
    c.restart(victim as usize, cfg, tcp).unwrap();
    let t0 = std::time::Instant::now();
    while !everyone(&c, false) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the rejoin did not spread"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    println!(
        "every node took the restarted node back within {:?}",
        t0.elapsed()
    );
    assert_eq!(c.node(0).shard_of(id.clone()), victim);
    c.node(1).put(id.clone(), &pattern(80_000, 5)).unwrap();
    assert_eq!(c.node(0).get(id).unwrap(), pattern(80_000, 5));
}
