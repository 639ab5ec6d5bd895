//! A member that reads at a trickle (300 KB/s) while it asks node 0 for 40 MiB of data and
//! floods it with lookups: node 1's gets from node 0 must not slow down (the figure is
//! printed; the assertion is loose, this machine is noisy), and what node 0 holds for the
//! member stays bounded.

#[path = "common/member.rs"]
#[allow(dead_code)] // the helper's raw frames are for other tests
mod member;

use member::Member;
use phalanx::protocol::{DirMsg, Msg, PullMsg};
use phalanx::transport::RemoteRegion;
use phalanx::Node;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const SIZE: usize = 4 << 20;
const GETS: usize = 15;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Node 1 gets objects node 0 puts, one after another: the seconds each get took.
fn gets(n0: &Node, n1: &Node, tag: &str) -> Vec<f64> {
    let data: Vec<u8> = (0..SIZE).map(|i| (i * 13 + 1) as u8).collect();
    (0..GETS)
        .map(|i| {
            let id = format!("@0/{tag}/{i}");
            n0.put(id.as_str(), &data).unwrap();
            let t = Instant::now();
            let v = n1.get_view(id.as_str()).unwrap();
            let s = t.elapsed().as_secs_f64();
            assert!(*v == data[..], "get {i} ({tag}): wrong bytes");
            drop(v);
            n0.delete(id.as_str()).unwrap();
            s
        })
        .collect()
}

/// Joins a member that reads at 300 KB/s and makes it ask node 0 for 40 MiB (five 8 MiB
/// pulls) and 200 inline lookups (12 MB of replies).
fn trickle_member(cfg: &phalanx::ClusterConfig) -> Member {
    // 300 KB/s: 3000 bytes every 10 ms.
    let mut m = Member::join(cfg.addr_of(0).unwrap(), 2, 0, 3, 3000);
    for k in 0..5u64 {
        m.send(&Msg::Pull(PullMsg::Pull {
            id: format!("@0/big/{k}").as_str().into(),
            stream: 100 + k,
            dst: RemoteRegion {
                node: 2,
                offset: k * (8 << 20),
                len: 8 << 20,
                addr: 0,
                rkey: 0,
                grant: 0,
            },
            from: 0,
        }));
    }
    for rid in 0..200u64 {
        m.send(&Msg::Dir(DirMsg::Locate {
            rid: 1000 + rid,
            id: "@0/small".into(),
            wait: true,
            resume: false,
            exclude: vec![],
            epoch: None,
        }));
    }
    m
}

/// Rounds alternate gets without the member and gets with it (a new member each round,
/// dropped at the end of it), so both sides of the ratio see the same machine.
#[test]
fn a_member_reading_at_a_trickle_does_not_slow_other_gets() {
    const ROUNDS: usize = 4;
    let cfg = member::config(3, "op_timeout_s = 30\nheartbeat_ms = 3000");
    let (n0, n1) = member::start_pair(&cfg);
    let big: Vec<u8> = vec![7u8; 8 << 20];
    for k in 0..5 {
        n0.put(format!("@0/big/{k}").as_str(), &big).unwrap();
    }
    n0.put("@0/small", &[3u8; 60_000]).unwrap();
    let (mut base, mut during, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let b = gets(&n0, &n1, &format!("base{round}"));
        let m = trickle_member(&cfg);
        std::thread::sleep(Duration::from_millis(300));
        let d = gets(&n0, &n1, &format!("trickle{round}"));
        let read = m.read.load(Ordering::Relaxed);
        assert!(read < 40 << 20, "the member read everything: no trickle");
        assert!(
            n0.transport().is_connected(2),
            "the member was dropped although it reads"
        );
        drop(m);
        // Node 0 lets the member go (its socket closed) before the next round.
        let t = Instant::now();
        while n0.transport().is_connected(2) {
            assert!(t.elapsed() < Duration::from_secs(10), "member link kept");
            std::thread::sleep(Duration::from_millis(10));
        }
        ratios.push(median(d.clone()) / median(b.clone()));
        base.extend(b);
        during.extend(d);
    }
    let (b, d) = (median(base), median(during));
    println!(
        "node 1's {} MiB gets from node 0, {ROUNDS} alternating rounds of {GETS}: median {:.2} ms \
         alone, {:.2} ms with the trickle member ({:.2}x; per round {:?})",
        SIZE >> 20,
        b * 1e3,
        d * 1e3,
        d / b,
        ratios.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>()
    );
    assert!(
        d < b * 3.0 + 0.02,
        "gets slowed from {b:.4} s to {d:.4} s by a member reading at a trickle"
    );
    n1.shutdown();
    n0.shutdown();
}
