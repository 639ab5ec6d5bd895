//! Links made on demand on the TCP transport: no link before the first use, crossed dials end
//! in one link, an unreachable peer is reported down once and held off, then linked when it
//! listens.

use phalanx_transport::{
    AuthConfig, ClusterSecret, Event, NodeId, TcpConfig, TcpTransport, Transport, TransportError,
};
use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

fn config(heartbeat: Duration, connect: Duration) -> TcpConfig {
    TcpConfig {
        heartbeat_timeout: heartbeat,
        connect_timeout: connect,
        auth: AuthConfig {
            secret: Some(ClusterSecret::parse("the on-demand tests' secret").unwrap()),
            ..AuthConfig::default()
        },
        ..TcpConfig::default()
    }
    .on_demand()
}

fn bind(id: NodeId, addr: &str, cfg: &TcpConfig) -> TcpTransport {
    TcpTransport::bind(id, addr.parse().unwrap(), cfg.clone()).unwrap()
}

fn cluster(n: u32, cfg: &TcpConfig) -> (Vec<TcpTransport>, Vec<(NodeId, SocketAddr)>) {
    let ts: Vec<TcpTransport> = (0..n).map(|i| bind(i, "127.0.0.1:0", cfg)).collect();
    let peers: Vec<(NodeId, SocketAddr)> = ts
        .iter()
        .enumerate()
        .map(|(i, t)| (i as NodeId, t.listen_addr().unwrap()))
        .collect();
    for t in &ts {
        t.connect(&peers, false).unwrap();
    }
    (ts, peers)
}

/// Control messages `t` received from `peer` within `timeout`, until `n` are in.
fn ctrl_from(t: &TcpTransport, peer: NodeId, n: usize, timeout: Duration) -> Vec<Vec<u8>> {
    let rx = t.events();
    let deadline = Instant::now() + timeout;
    let mut got = Vec::new();
    while got.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(Event::Ctrl { peer: p, msg }) if p == peer => got.push(msg),
            Ok(Event::PeerDown { peer, reason }) => panic!("peer {peer} down: {reason}"),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    got
}

#[test]
fn no_link_before_first_use_then_exactly_the_links_used() {
    let cfg = config(Duration::from_secs(2), Duration::from_secs(10));
    let (ts, _) = cluster(5, &cfg);
    for t in &ts {
        assert_eq!(t.link_counts().unwrap().peak, 0, "a link before any use");
        assert!((0..5).all(|p| t.is_up(p)), "peers are believed up");
    }
    // 1 talks to 3, then 4 talks to 3: those two links and no other.
    ts[1].send(3, b"one to three").unwrap();
    assert_eq!(
        ctrl_from(&ts[3], 1, 1, Duration::from_secs(5)),
        vec![b"one to three".to_vec()]
    );
    ts[4].send(3, b"four to three").unwrap();
    assert_eq!(
        ctrl_from(&ts[3], 4, 1, Duration::from_secs(5)),
        vec![b"four to three".to_vec()]
    );
    // The answer goes over the link the question made.
    ts[3].send(1, b"three to one").unwrap();
    assert_eq!(
        ctrl_from(&ts[1], 3, 1, Duration::from_secs(5)),
        vec![b"three to one".to_vec()]
    );
    let links: Vec<usize> = ts.iter().map(|t| t.link_counts().unwrap().peak).collect();
    assert_eq!(links, vec![0, 1, 0, 2, 1]);
    assert!(ts.iter().all(|t| t.stats().peers_down == 0));
    for t in &ts {
        t.shutdown();
    }
}

#[test]
fn crossed_dials_end_in_one_link() {
    let cfg = config(Duration::from_secs(2), Duration::from_secs(10));
    for round in 0..12 {
        let (ts, _) = cluster(2, &cfg);
        let ts = Arc::new(ts);
        let go = Arc::new(Barrier::new(2));
        let senders: Vec<_> = (0..2u32)
            .map(|me| {
                let (ts, go) = (ts.clone(), go.clone());
                std::thread::spawn(move || {
                    go.wait();
                    let other = 1 - me;
                    for k in 0..3u8 {
                        ts[me as usize].send(other, &[me as u8, k]).unwrap();
                    }
                })
            })
            .collect();
        for s in senders {
            s.join().unwrap();
        }
        for me in 0..2u32 {
            let other = 1 - me;
            let got = ctrl_from(&ts[me as usize], other, 3, Duration::from_secs(5));
            let want: Vec<Vec<u8>> = (0..3u8).map(|k| vec![other as u8, k]).collect();
            assert_eq!(got, want, "round {round}: node {me} received");
            let t = &ts[me as usize];
            let l = t.link_counts().unwrap();
            assert_eq!((l.open, l.peak), (1, 1), "round {round}: node {me}");
            assert_eq!(
                t.stats().peers_down,
                0,
                "round {round}: a link was replaced"
            );
        }
        for t in ts.iter() {
            t.shutdown();
        }
    }
}

#[test]
fn an_unreachable_peer_is_reported_down_once_held_off_then_linked() {
    // A free port where nobody listens yet.
    let free = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr1 = free.local_addr().unwrap();
    drop(free);
    let cfg = config(Duration::from_millis(200), Duration::from_millis(100));
    let t0 = bind(0, "127.0.0.1:0", &cfg);
    let peers = vec![(0, t0.listen_addr().unwrap()), (1, addr1)];
    t0.connect(&peers, false).unwrap();
    let events = t0.events();
    assert!(t0.is_up(1));
    let start = Instant::now();
    let e = t0.send(1, b"anyone?").unwrap_err();
    let took = start.elapsed();
    assert!(matches!(e, TransportError::PeerUnavailable(1)), "{e}");
    // The dial's bound: twice the heartbeat timeout plus a second.
    assert!(took < Duration::from_secs(3), "gave up after {took:?}");
    assert!(!t0.is_up(1));
    let downs: Vec<Event> = events
        .try_iter()
        .filter(|e| matches!(e, Event::PeerDown { .. }))
        .collect();
    assert_eq!(downs.len(), 1, "{downs:?}");
    // Held off: fails at once, reported no more.
    let start = Instant::now();
    assert!(t0.send(1, b"again").is_err());
    assert!(
        start.elapsed() < Duration::from_millis(500),
        "a held-off peer was dialled"
    );
    assert_eq!(t0.stats().peers_down, 1);
    // Node 1 starts listening: after the hold-off the next use links it.
    let t1 = bind(1, &addr1.to_string(), &cfg);
    t1.connect(&peers, false).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match t0.send(1, b"now?") {
            Ok(()) => break,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("never linked: {e}"),
        }
    }
    assert_eq!(
        ctrl_from(&t1, 0, 1, Duration::from_secs(5)),
        vec![b"now?".to_vec()]
    );
    assert!(t0.is_up(1) && t0.is_connected(1));
    assert!(events
        .try_iter()
        .any(|e| matches!(e, Event::PeerUp { peer: 1 })));
    t0.shutdown();
    t1.shutdown();
}

/// Two nodes talk in bursts with pauses around the idle timeout, both ways at once: links are
/// closed between bursts and made again, and every message arrives once, in order, with no
/// peer ever reported down.
#[test]
fn idle_links_close_without_loss_or_failure_and_come_back_on_use() {
    let cfg = TcpConfig {
        idle_timeout: Duration::from_millis(150),
        ..config(Duration::from_millis(400), Duration::from_secs(10))
    };
    let (ts, _) = cluster(2, &cfg);
    let ts = Arc::new(ts);
    const MSGS: u32 = 40;
    let senders: Vec<_> = (0..2u32)
        .map(|me| {
            let ts = ts.clone();
            std::thread::spawn(move || {
                let mut x = 0x9e37_79b9u32.wrapping_mul(me + 1);
                for k in 0..MSGS {
                    ts[me as usize].send(1 - me, &k.to_le_bytes()).unwrap();
                    // A pause of 0 to 300 ms: often past the idle timeout, often not.
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    if k % 3 == 2 {
                        std::thread::sleep(Duration::from_millis((x % 300) as u64));
                    }
                }
            })
        })
        .collect();
    let receivers: Vec<_> = (0..2u32)
        .map(|me| {
            let ts = ts.clone();
            std::thread::spawn(move || {
                let rx = ts[me as usize].events();
                let deadline = Instant::now() + Duration::from_secs(30);
                let mut got = Vec::new();
                while got.len() < MSGS as usize {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match rx.recv_timeout(left) {
                        Ok(Event::Ctrl { msg, .. }) => {
                            got.push(u32::from_le_bytes(msg.try_into().unwrap()))
                        }
                        Ok(Event::PeerDown { peer, reason }) => {
                            panic!("node {me}: peer {peer} down: {reason}")
                        }
                        Ok(_) => {}
                        Err(_) => break,
                    }
                }
                got
            })
        })
        .collect();
    for s in senders {
        s.join().unwrap();
    }
    for (me, r) in receivers.into_iter().enumerate() {
        let got = r.join().unwrap();
        assert_eq!(got, (0..MSGS).collect::<Vec<_>>(), "node {me} received");
    }
    // Quiet now: both sides end with no link, and closes did happen along the way.
    let deadline = Instant::now() + Duration::from_secs(5);
    while ts.iter().any(|t| t.link_counts().unwrap().open > 0) {
        assert!(Instant::now() < deadline, "links still open when idle");
        std::thread::sleep(Duration::from_millis(20));
    }
    let closed: u64 = ts
        .iter()
        .map(|t| t.link_counts().unwrap().idle_closed)
        .sum();
    assert!(closed >= 2, "only {closed} idle closes");
    assert!(ts.iter().all(|t| t.stats().peers_down == 0));
    assert!(ts.iter().all(|t| t.is_up(0) && t.is_up(1)));
    println!("idle closes: {closed}");
    for t in ts.iter() {
        t.shutdown();
    }
}

/// Both sides find the link idle at about the same time (same idle timeout, heartbeat
/// threads ticking alike), round after round: each close ends, on both sides, so the next
/// message links again at once.
#[test]
fn idle_closes_from_both_sides_at_once_end_cleanly() {
    let cfg = TcpConfig {
        idle_timeout: Duration::from_millis(40),
        ..config(Duration::from_millis(160), Duration::from_secs(10))
    };
    let (ts, _) = cluster(2, &cfg);
    for round in 0..25u8 {
        let t0 = Instant::now();
        ts[0].send(1, &[round]).unwrap();
        ts[1].send(0, &[round]).unwrap();
        assert_eq!(
            ctrl_from(&ts[1], 0, 1, Duration::from_secs(5)),
            vec![vec![round]]
        );
        assert_eq!(
            ctrl_from(&ts[0], 1, 1, Duration::from_secs(5)),
            vec![vec![round]]
        );
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "round {round}: {:?} to link and deliver",
            t0.elapsed()
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        while ts.iter().any(|t| t.link_counts().unwrap().open > 0) {
            assert!(Instant::now() < deadline, "round {round}: links stay open");
            std::thread::sleep(Duration::from_millis(2));
        }
        // Sometimes right after the close, sometimes a little later.
        std::thread::sleep(Duration::from_millis((round % 4) as u64 * 15));
    }
    assert!(ts.iter().all(|t| t.stats().peers_down == 0));
    let closed: u64 = ts
        .iter()
        .map(|t| t.link_counts().unwrap().idle_closed)
        .sum();
    println!("idle closes: {closed} in 25 rounds");
    for t in &ts {
        t.shutdown();
    }
}
