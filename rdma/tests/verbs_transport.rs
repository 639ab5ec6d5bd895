//! Verbs transport tests. They need an RDMA device (Soft-RoCE in the test VM: see
//! `rdma/README.md`); without one each test prints "no RDMA device: skipped" and passes.

use phalanx_rdma::{verbs, RdmaConfig, RdmaTransport};
use phalanx_transport::{Arena, Event, NodeId, Transport, TransportStats, MAX_CTRL_LEN};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn have_device(test: &str) -> bool {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    if verbs::device_names().is_empty() {
        // Written to the real stderr, not through the test harness's capture, so the skip
        // shows in a plain `cargo test` run.
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "{test}: no RDMA device: skipped");
        false
    } else {
        true
    }
}

fn cfg() -> RdmaConfig {
    RdmaConfig {
        device: std::env::var("PHALANX_RXE_DEV").ok(),
        ..RdmaConfig::default()
    }
}

/// Links without rings of their own: every block through the shared pools.
fn shared_cfg() -> RdmaConfig {
    RdmaConfig {
        ring_pool: 0,
        ..cfg()
    }
}

struct Node {
    t: RdmaTransport,
    arena: Arc<Arena>,
}

fn node(id: NodeId, cfg: RdmaConfig, arena_len: usize) -> Node {
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let t = RdmaTransport::bind(id, any, cfg).expect("bind");
    let arena = Arc::new(Arena::new(arena_len, false).unwrap());
    t.register_arena(arena.clone()).expect("register arena");
    Node { t, arena }
}

/// Two connected nodes 0 and 1.
fn pair(cfg: RdmaConfig, arena_len: usize) -> (Node, Node) {
    let a = node(0, cfg.clone(), arena_len);
    let b = node(1, cfg, arena_len);
    let peers = [(0, a.t.listen_addr()), (1, b.t.listen_addr())];
    let ta = a.t.clone();
    let h = std::thread::spawn(move || ta.connect(&peers, false));
    b.t.connect(&peers, false).expect("connect b");
    h.join().unwrap().expect("connect a");
    // Both saw PeerUp.
    for n in [&a, &b] {
        let e =
            n.t.events()
                .recv_timeout(Duration::from_secs(10))
                .expect("PeerUp");
        assert!(matches!(e, Event::PeerUp { .. }), "{e:?}");
    }
    (a, b)
}

fn next_event(n: &Node, timeout: Duration) -> Event {
    n.t.events()
        .recv_timeout(timeout)
        .unwrap_or_else(|_| panic!("no event within {timeout:?}"))
}

fn delta(after: TransportStats, before: TransportStats) -> TransportStats {
    TransportStats {
        ctrl_sent: after.ctrl_sent - before.ctrl_sent,
        ctrl_received: after.ctrl_received - before.ctrl_received,
        data_bytes_sent: after.data_bytes_sent - before.data_bytes_sent,
        data_bytes_received: after.data_bytes_received - before.data_bytes_received,
        payload_bytes_copied: after.payload_bytes_copied - before.payload_bytes_copied,
        registrations: after.registrations - before.registrations,
        grant_registrations: after.grant_registrations - before.grant_registrations,
        peers_down: after.peers_down - before.peers_down,
        malformed_frames: after.malformed_frames - before.malformed_frames,
        hellos_refused: after.hellos_refused - before.hellos_refused,
    }
}

fn fill(arena: &Arena, off: u64, len: u64, seed: u64) {
    // SAFETY: test-owned range, nobody else touches it.
    let s = unsafe { arena.slice_mut(off, len) };
    let mut x = seed | 1;
    for c in s.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        c.copy_from_slice(&b[..c.len()]);
    }
}

fn same(a: &Arena, aoff: u64, b: &Arena, boff: u64, len: u64) -> bool {
    // SAFETY: test-owned ranges; the transfer into `b` has completed (its events arrived).
    unsafe { a.slice(aoff, len) == b.slice(boff, len) }
}

/// Receives Data events of `stream` until `[0, len)` is covered, checking they arrive in
/// order and contiguous. Returns how many events it took.
fn await_data(n: &Node, stream: u64, len: u64, timeout: Duration) -> usize {
    let deadline = Instant::now() + timeout;
    let mut mark = 0;
    let mut events = 0;
    while mark < len {
        let left = deadline.saturating_duration_since(Instant::now());
        match next_event(n, left) {
            Event::Data {
                stream: s,
                offset,
                len: l,
                ..
            } => {
                assert_eq!(s, stream);
                assert_eq!(offset, mark, "data events in order and contiguous");
                mark += l;
                events += 1;
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
    assert_eq!(mark, len);
    events
}

fn pattern(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i * 31 + j * 7) as u8).collect()
}

fn ctrl_ring_wraps_over_many_laps_with(base: RdmaConfig) {
    // 2 blocks of 128 bytes: 75 payload bytes each, so many messages fragment, and the
    // counter byte (1..=255) wraps several times.
    let c = RdmaConfig {
        block_size: 128,
        ring_blocks: 2,
        ..base.clone()
    };
    let (a, b) = pair(c, 1 << 20);
    let count = 1200;
    let sizes: Vec<usize> = (0..count).map(|i| (i * 37) % 260).collect();
    let blocks: usize = sizes.iter().map(|&s| s.div_ceil(75).max(1)).sum();
    assert!(
        blocks / 2 > 3 * 255,
        "test must wrap the counter byte ({blocks} blocks)"
    );
    let ta = a.t.clone();
    let sizes2 = sizes.clone();
    let sender = std::thread::spawn(move || {
        for (i, &s) in sizes2.iter().enumerate() {
            ta.send(1, &pattern(i, s)).expect("send");
        }
    });
    for (i, &s) in sizes.iter().enumerate() {
        match next_event(&b, Duration::from_secs(30)) {
            Event::Ctrl { peer, msg } => {
                assert_eq!(peer, 0);
                assert_eq!(msg, pattern(i, s), "message {i} intact and in order");
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
    sender.join().unwrap();
    let (sa, sb) = (a.t.stats(), b.t.stats());
    assert_eq!(sa.ctrl_sent, count as u64);
    assert_eq!(sb.ctrl_received, count as u64);
    assert_eq!(sb.malformed_frames, 0);
    println!(
        "{count} messages over {blocks} blocks ({} laps of a 2-block ring)",
        blocks / 2
    );
    a.t.shutdown();
    b.t.shutdown();
}

fn large_ctrl_messages_fragment_in_order_both_ways_with(base: RdmaConfig) {
    let (a, b) = pair(base.clone(), 1 << 20);
    let max = phalanx_rdma::block::max_payload(base.clone().block_size);
    let sizes = [
        0,
        1,
        max - 1,
        max,
        max + 1,
        3 * max + 5,
        1 << 20,
        MAX_CTRL_LEN,
    ];
    let ta = a.t.clone();
    let tb = b.t.clone();
    let s1 = std::thread::spawn(move || {
        for (i, &s) in sizes.iter().enumerate() {
            ta.send(1, &pattern(i, s)).expect("send a->b");
        }
    });
    let s2 = std::thread::spawn(move || {
        for (i, &s) in sizes.iter().enumerate() {
            tb.send(0, &pattern(i + 100, s)).expect("send b->a");
        }
    });
    for (n, base) in [(&b, 0), (&a, 100)] {
        for (i, &s) in sizes.iter().enumerate() {
            match next_event(n, Duration::from_secs(60)) {
                Event::Ctrl { msg, .. } => {
                    assert_eq!(msg.len(), s);
                    assert!(
                        msg == pattern(i + base, s),
                        "message {i} of {s} bytes intact"
                    );
                }
                other => panic!("unexpected event {other:?}"),
            }
        }
    }
    s1.join().unwrap();
    s2.join().unwrap();
    assert!(a.t.send(1, &vec![0u8; MAX_CTRL_LEN + 1]).is_err());
    a.t.shutdown();
    b.t.shutdown();
}

fn small_write_goes_through_blocks_with(base: RdmaConfig) {
    let (a, b) = pair(base.clone(), 4 << 20);
    let len = 4096;
    fill(&a.arena, 8192, len, 42);
    let (a0, b0) = (a.t.stats(), b.t.stats());
    let dst =
        b.t.grant(0, 65536, 1 << 20, std::sync::Arc::new(()))
            .unwrap();
    a.t.write(1, 7, 8192, &dst, 100, len).expect("write");
    // Data events cover [100, 100 + len).
    let mut mark = 100;
    while mark < 100 + len {
        match next_event(&b, Duration::from_secs(10)) {
            Event::Data {
                stream,
                offset,
                len: l,
                ..
            } => {
                assert_eq!((stream, offset), (7, mark));
                mark += l;
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
    assert!(same(&a.arena, 8192, &b.arena, 65536 + 100, len));
    let (da, db) = (delta(a.t.stats(), a0), delta(b.t.stats(), b0));
    println!("4 KiB eager: sender {da:?}\nreceiver {db:?}");
    assert_eq!(
        da.payload_bytes_copied, len,
        "copied into the blocks at the sender"
    );
    assert_eq!(
        db.payload_bytes_copied, len,
        "copied out of the blocks at the receiver"
    );
    assert_eq!(da.registrations + db.registrations, 0);
    assert_eq!(da.data_bytes_sent, len);
    assert_eq!(db.data_bytes_received, len);
    a.t.shutdown();
    b.t.shutdown();
}

fn large_write_is_zero_copy_rendezvous_with(base: RdmaConfig) {
    let len: u64 = 64 << 20;
    let (a, b) = pair(base.clone(), (len + (1 << 20)) as usize);
    fill(&a.arena, 4096, len, 7);
    let (a0, b0) = (a.t.stats(), b.t.stats());
    let dst =
        b.t.grant(0, 0, len + 4096, std::sync::Arc::new(()))
            .unwrap();
    let t0 = Instant::now();
    let ta = a.t.clone();
    let w = std::thread::spawn(move || ta.write(1, 3, 4096, &dst, 4096, len));
    let mut mark = 4096;
    let mut events = 0;
    while mark < 4096 + len {
        match next_event(&b, Duration::from_secs(120)) {
            Event::Data {
                stream,
                offset,
                len: l,
                ..
            } => {
                assert_eq!((stream, offset), (3, mark), "in order, contiguous");
                mark += l;
                events += 1;
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    w.join().unwrap().expect("write");
    assert!(same(&a.arena, 4096, &b.arena, 4096, len), "bytes equal");
    let (da, db) = (delta(a.t.stats(), a0), delta(b.t.stats(), b0));
    println!(
        "64 MiB rendezvous: {:.3} s, {:.1} MB/s, {events} data events\nsender {da:?}\nreceiver {db:?}",
        secs,
        len as f64 / secs / 1e6
    );
    assert_eq!(
        da.payload_bytes_copied + db.payload_bytes_copied,
        0,
        "zero copy"
    );
    assert_eq!(
        da.registrations + db.registrations,
        0,
        "no registration per transfer"
    );
    assert_eq!(db.data_bytes_received, len);
    assert!(events > 1, "chunk pipelining produces several events");
    a.t.shutdown();
    b.t.shutdown();
}

#[test]
fn ctrl_after_write_arrives_after_its_data() {
    if !have_device("ctrl_after_write_arrives_after_its_data") {
        return;
    }
    let (a, b) = pair(cfg(), 8 << 20);
    let dst = b.t.grant(0, 0, 8 << 20, std::sync::Arc::new(())).unwrap();
    for (i, len) in [100u64, 3 << 20, 5000, 1 << 20].into_iter().enumerate() {
        fill(&a.arena, 0, len, i as u64);
        a.t.write(1, i as u64, 0, &dst, 0, len).unwrap();
        a.t.send(1, format!("done {i}").as_bytes()).unwrap();
        await_data(&b, i as u64, len, Duration::from_secs(30));
        match next_event(&b, Duration::from_secs(10)) {
            Event::Ctrl { msg, .. } => assert_eq!(msg, format!("done {i}").as_bytes()),
            other => panic!("unexpected event {other:?}"),
        }
        assert!(same(&a.arena, 0, &b.arena, 0, len));
    }
    a.t.shutdown();
    b.t.shutdown();
}

#[test]
fn killed_peer_is_reported_down_within_timeout() {
    if !have_device("killed_peer_is_reported_down_within_timeout") {
        return;
    }
    let timeout = Duration::from_millis(1000);
    let c = RdmaConfig {
        heartbeat_timeout: timeout,
        ..cfg()
    };
    let (a, b) = pair(c, 1 << 20);
    // Traffic works, and an idle link stays up across several heartbeat periods.
    a.t.send(1, b"ping").unwrap();
    assert!(matches!(
        next_event(&b, Duration::from_secs(5)),
        Event::Ctrl { .. }
    ));
    std::thread::sleep(timeout * 2);
    assert!(
        a.t.is_connected(1) && b.t.is_connected(0),
        "idle link stays up"
    );
    assert!(b.t.events().try_recv().is_err(), "no spurious event");
    let t0 = Instant::now();
    a.t.kill();
    match next_event(&b, timeout * 3) {
        Event::PeerDown { peer, reason } => {
            let dt = t0.elapsed();
            println!("PeerDown after {dt:?}: {reason}");
            assert_eq!(peer, 0);
            assert!(
                dt <= timeout + timeout / 2,
                "detected within the timeout (+ one heartbeat period): {dt:?}"
            );
        }
        other => panic!("unexpected event {other:?}"),
    }
    assert!(!b.t.is_connected(0));
    assert!(b.t.send(0, b"anyone?").is_err());
    assert_eq!(b.t.stats().peers_down, 1);
    b.t.shutdown();
}

#[test]
fn shutdown_says_goodbye() {
    if !have_device("shutdown_says_goodbye") {
        return;
    }
    let (a, b) = pair(cfg(), 1 << 20);
    let t0 = Instant::now();
    a.t.shutdown();
    match next_event(&b, Duration::from_secs(5)) {
        Event::PeerDown { peer, reason } => {
            assert_eq!(peer, 0);
            assert_eq!(reason, phalanx_transport::PEER_LEFT);
        }
        other => panic!("unexpected event {other:?}"),
    }
    println!("goodbye seen after {:?}", t0.elapsed());
    assert!(a.t.send(1, b"x").is_err());
    assert_eq!(b.t.stats().malformed_frames, 0);
    b.t.shutdown();
}

#[test]
fn restarted_peer_rejoins() {
    if !have_device("restarted_peer_rejoins") {
        return;
    }
    let (a, b) = pair(cfg(), 1 << 20);
    a.t.kill();
    assert!(matches!(
        next_event(&b, Duration::from_secs(5)),
        Event::PeerDown { .. }
    ));
    // Node 0 comes back and dials everybody.
    let a2 = node(0, cfg(), 1 << 20);
    a2.t.connect(&[(1, b.t.listen_addr())], true)
        .expect("rejoin");
    assert!(matches!(
        next_event(&b, Duration::from_secs(10)),
        Event::PeerUp { peer: 0 }
    ));
    assert!(matches!(
        next_event(&a2, Duration::from_secs(10)),
        Event::PeerUp { peer: 1 }
    ));
    b.t.send(0, b"welcome back").unwrap();
    match next_event(&a2, Duration::from_secs(10)) {
        Event::Ctrl { msg, .. } => assert_eq!(msg, b"welcome back"),
        other => panic!("unexpected event {other:?}"),
    }
    a2.t.shutdown();
    b.t.shutdown();
}

#[test]
fn busy_poll_mode_and_concurrent_senders() {
    if !have_device("busy_poll_mode_and_concurrent_senders") {
        return;
    }
    let c = RdmaConfig {
        busy_poll: true,
        ring_blocks: 4,
        block_size: 512,
        ..cfg()
    };
    let (a, b) = pair(c.clone(), 4 << 20);
    // NIC-local placement: the plan is the one `phalanx info` shows, and a busy-polling
    // progress thread with a core near the NIC runs pinned to it.
    for (id, x) in [(0u32, &a), (1, &b)] {
        let plan = phalanx_rdma::topology::Placement::plan(x.t.device_name(), id, &c);
        assert_eq!(x.t.placement(), &plan);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let cpus = loop {
            if let Some(v) = x.t.progress_thread_cpus() {
                break v;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "progress thread not started"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        println!(
            "node {id}: {} (progress thread on {cpus:?})",
            plan.describe(true)
        );
        if let Some(core) = plan.progress_core {
            assert_eq!(cpus, vec![core]);
        }
        // The registered arena (faulted in by the registration) is on the NIC's node.
        if let Some(want) = plan.memory_node {
            if let Some(got) = phalanx_rdma::topology::node_of_page(x.arena.as_ptr()) {
                assert_eq!(got, want, "arena page on node {got}, NIC on {want}");
            }
        }
    }
    // Four threads share one link; each thread's messages stay in order.
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let ta = a.t.clone();
            std::thread::spawn(move || {
                for i in 0..200u32 {
                    let mut m = vec![t];
                    m.extend_from_slice(&i.to_le_bytes());
                    m.resize(5 + (i as usize * 13) % 1500, t);
                    ta.send(1, &m).unwrap();
                }
            })
        })
        .collect();
    let mut next = [0u32; 4];
    for _ in 0..800 {
        match next_event(&b, Duration::from_secs(30)) {
            Event::Ctrl { msg, .. } => {
                let t = msg[0] as usize;
                let i = u32::from_le_bytes(msg[1..5].try_into().unwrap());
                assert_eq!(i, next[t], "per-thread order");
                assert_eq!(msg.len(), 5 + (i as usize * 13) % 1500);
                next[t] += 1;
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
    for t in threads {
        t.join().unwrap();
    }
    // A rendezvous write in busy-poll mode too.
    let len = 3 << 20;
    fill(&a.arena, 0, len, 99);
    let dst = b.t.grant(0, 1 << 20, len, std::sync::Arc::new(())).unwrap();
    a.t.write(1, 5, 0, &dst, 0, len).unwrap();
    await_data(&b, 5, len, Duration::from_secs(30));
    assert!(same(&a.arena, 0, &b.arena, 1 << 20, len));
    a.t.shutdown();
    b.t.shutdown();
}

fn event_handler_replies_with_nonblocking_sends_with(base: RdmaConfig) {
    let (a, b) = pair(base.clone(), 1 << 20);
    // b answers every ping from its progress thread; when a reply cannot go out without
    // blocking it is handed to a helper thread that uses the blocking send.
    let (fallback_tx, fallback_rx) = crossbeam_channel::unbounded::<Vec<u8>>();
    let tb = b.t.clone();
    let nonblocking = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let nb = nonblocking.clone();
    let handler: phalanx_transport::EventHandler = Arc::new(move |ev| {
        if let Event::Ctrl { peer, mut msg } = ev {
            msg.insert(0, b'>');
            match tb.send_nonblocking(peer, &msg) {
                Ok(true) => {
                    nb.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                Ok(false) => fallback_tx.send(msg).unwrap(),
                Err(e) => panic!("send_nonblocking: {e}"),
            }
        }
    });
    assert!(b.t.set_event_handler(handler));
    let tb2 = b.t.clone();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let done2 = done.clone();
    let helper = std::thread::spawn(move || {
        while !done2.load(std::sync::atomic::Ordering::Relaxed) {
            if let Ok(m) = fallback_rx.recv_timeout(Duration::from_millis(50)) {
                tb2.send(0, &m).unwrap();
            }
        }
    });
    for i in 0..100u32 {
        a.t.send(1, &i.to_le_bytes()).unwrap();
    }
    let mut got = Vec::new();
    while got.len() < 100 {
        match next_event(&a, Duration::from_secs(10)) {
            Event::Ctrl { msg, .. } => {
                assert_eq!(msg[0], b'>');
                got.push(u32::from_le_bytes(msg[1..5].try_into().unwrap()));
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
    got.sort();
    assert_eq!(got, (0..100).collect::<Vec<_>>());
    assert!(nonblocking.load(std::sync::atomic::Ordering::Relaxed) > 0);
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    helper.join().unwrap();
    a.t.shutdown();
    b.t.shutdown();
}

/// Eager vs rendezvous latency per size, to place the threshold. Run explicitly:
/// `<test binary> --ignored threshold_sweep --nocapture`.
#[test]
#[ignore]
fn threshold_sweep() {
    if !have_device("threshold_sweep") {
        return;
    }
    let (a, b) = pair(cfg(), 8 << 20);
    let dst = b.t.grant(0, 0, 8 << 20, std::sync::Arc::new(())).unwrap();
    let iters: usize = std::env::var("PHALANX_SWEEP_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    println!("size_bytes eager_us rendezvous_us (median of {iters}, write + all data events)");
    let mut stream = 0;
    for size in [
        256u64,
        1 << 10,
        2 << 10,
        4 << 10,
        8 << 10,
        16 << 10,
        32 << 10,
        64 << 10,
        128 << 10,
        256 << 10,
        1 << 20,
    ] {
        let mut res = [0f64; 2];
        for (k, threshold) in [u64::MAX, 0].into_iter().enumerate() {
            a.t.set_rendezvous_threshold(threshold);
            let mut times = Vec::new();
            for _ in 0..iters {
                stream += 1;
                let t0 = Instant::now();
                a.t.write(1, stream, 0, &dst, 0, size).unwrap();
                await_data(&b, stream, size, Duration::from_secs(30));
                times.push(t0.elapsed().as_secs_f64() * 1e6);
            }
            times.sort_by(|x, y| x.partial_cmp(y).unwrap());
            res[k] = times[times.len() / 2];
        }
        println!("{size} {:.0} {:.0}", res[0], res[1]);
    }
    a.t.shutdown();
    b.t.shutdown();
}

/// The out-of-band setup is authenticated: a node with another secret, or none, is refused
/// (counted, no link, no queue pair detail sent), a forged claim of a live id leaves the real
/// link working, and the rightful node links.
#[test]
fn setup_needs_the_cluster_secret() {
    use phalanx_transport::{AuthConfig, ClusterSecret, TransportError};
    if !have_device("setup_needs_the_cluster_secret") {
        return;
    }
    let with = |secret: Option<&str>| RdmaConfig {
        auth: AuthConfig {
            secret: secret.map(|s| ClusterSecret::parse(s).unwrap()),
            members: Some(3),
            ..AuthConfig::default()
        },
        ..cfg()
    };
    let right = "the verbs test cluster's secret";
    let (a, b) = pair(with(Some(right)), 1 << 20);
    let a_addr = a.t.listen_addr();
    // Node 2 with another secret, and with none: refused for good, at once.
    for secret in [Some("another secret, not this one"), None] {
        let stranger = node(2, with(secret), 1 << 20);
        let t0 = Instant::now();
        let err = stranger.t.dial(0, a_addr, Duration::from_secs(5));
        assert!(matches!(err, Err(TransportError::Auth(_))), "{err:?}");
        assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
        assert!(!stranger.t.is_connected(0));
        stranger.t.shutdown();
    }
    // A node claiming live node 1's id with another secret: refused, the real link stays.
    let forger = node(1, with(Some("another secret, not this one")), 1 << 20);
    assert!(forger.t.dial(0, a_addr, Duration::from_secs(5)).is_err());
    forger.t.shutdown();
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.t.stats().hellos_refused < 3 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(a.t.stats().hellos_refused, 3);
    assert!(a.t.is_connected(1) && !a.t.is_connected(2));
    b.t.send(0, b"still here").unwrap();
    match next_event(&a, Duration::from_secs(10)) {
        Event::Ctrl { peer, msg } => assert_eq!((peer, msg.as_slice()), (1, &b"still here"[..])),
        e => panic!("expected the real node's message, got {e:?}"),
    }
    assert_eq!(a.t.stats().peers_down, 0);
    // The rightful node 2 links.
    let c = node(2, with(Some(right)), 1 << 20);
    c.t.dial(0, a_addr, Duration::from_secs(10)).unwrap();
    assert!(c.t.is_connected(0));
    for n in [&a, &b, &c] {
        n.t.shutdown();
    }
}

/// Waits until `n` reports `peer` down (other events in between are skipped).
fn await_down(n: &Node, peer: NodeId, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match n.t.events().recv_timeout(left) {
            Ok(Event::PeerDown { peer: p, .. }) if p == peer => return,
            Ok(_) => continue,
            Err(_) => panic!("node did not see {peer} down within {within:?}"),
        }
    }
}

fn untouched(arena: &Arena, off: u64, len: u64, byte: u8) -> bool {
    // SAFETY: test-owned range; no transfer into it is in progress.
    unsafe { arena.slice(off, len) }.iter().all(|&x| x == byte)
}

/// A grant large enough for the zero-copy path binds a memory window over exactly the granted
/// range on the grantee's connection: an RDMA write inside it lands; one that crosses its end,
/// and any RDMA read, are refused by the NIC, change no byte and take the link down.
#[test]
fn rdma_access_is_limited_to_the_granted_window() {
    if !have_device("rdma_access_is_limited_to_the_granted_window") {
        return;
    }
    const SENTINEL: u8 = 0x5c;
    const AT: u64 = 64 << 10;
    const LEN: u64 = 256 << 10;
    let arena_len: u64 = 4 << 20;
    let (a, b) = pair(cfg(), arena_len as usize);
    fill(&a.arena, 0, arena_len, 11);
    paint(&b.arena, 0, arena_len, SENTINEL);
    let s0 = b.t.stats();
    let region = b.t.grant(0, AT, LEN, Arc::new(())).expect("grant");
    assert!(
        region.rkey != 0 && region.addr != 0,
        "a rendezvous-size grant hands out a key: {region:?}"
    );
    assert_eq!(delta(b.t.stats(), s0).grant_registrations, 1);
    // Inside the window: lands.
    a.t.raw_rdma(1, false, 0, 4096, region.addr, region.rkey)
        .expect("a write inside the window");
    assert!(
        same(&a.arena, 0, &b.arena, AT, 4096),
        "the granted write landed"
    );
    // Crossing the window's end by one page: refused as a whole.
    let r =
        a.t.raw_rdma(1, false, 0, 8192, region.addr + LEN - 4096, region.rkey);
    assert!(r.is_err(), "a write crossing the window's end must fail");
    await_down(&b, 0, Duration::from_secs(20));
    assert!(untouched(&b.arena, 0, AT, SENTINEL), "below the window");
    assert!(
        untouched(&b.arena, AT + 4096, arena_len - AT - 4096, SENTINEL),
        "the rest of the window and above it"
    );
    a.t.shutdown();
    b.t.shutdown();

    // Reads: refused whatever the key, and they change nothing on either side.
    let (a, b) = pair(cfg(), arena_len as usize);
    fill(&b.arena, 0, arena_len, 13);
    paint(&a.arena, 0, arena_len, SENTINEL);
    let region = b.t.grant(0, AT, LEN, Arc::new(())).expect("grant");
    let r = a.t.raw_rdma(1, true, 0, 4096, region.addr, region.rkey);
    assert!(r.is_err(), "an RDMA read must fail");
    await_down(&b, 0, Duration::from_secs(20));
    assert!(
        untouched(&a.arena, 0, arena_len, SENTINEL),
        "nothing was read into the reader's memory"
    );
    let mut reference = vec![0u8; arena_len as usize];
    let scratch = Arena::new(arena_len as usize, false).unwrap();
    fill(&scratch, 0, arena_len, 13);
    // SAFETY: test-owned arenas, no transfer in progress.
    reference.copy_from_slice(unsafe { scratch.slice(0, arena_len) });
    assert!(
        unsafe { b.arena.slice(0, arena_len) } == &reference[..],
        "the read's target is unchanged"
    );
    a.t.shutdown();
    b.t.shutdown();
}

/// What a grant costs on this device: registering the granted range and binding a memory
/// window over it (then deallocating both at revoke), against registering the range alone,
/// the cheaper and weaker alternative (printed, for the README; medians of 50).
#[test]
fn grant_cost_window_against_registration() {
    if !have_device("grant_cost_window_against_registration") {
        return;
    }
    let arena_len: u64 = 80 << 20;
    let (a, b) = pair(cfg(), arena_len as usize);
    let pd = verbs::ProtectionDomain::new(&verbs::Context::open(cfg().device.as_deref()).unwrap())
        .unwrap();
    let median = |mut v: Vec<f64>| {
        v.sort_by(|x, y| x.partial_cmp(y).unwrap());
        v[v.len() / 2]
    };
    for len in [64u64 << 10, 1 << 20, 16 << 20, 64 << 20] {
        let mut grant = Vec::new();
        let mut reg = Vec::new();
        let s0 = b.t.stats();
        for _ in 0..50 {
            let t = Instant::now();
            let r = b.t.grant(0, 4096, len, Arc::new(())).expect("grant");
            b.t.revoke(0, &r);
            grant.push(t.elapsed().as_secs_f64() * 1e6);
            assert!(r.rkey != 0, "a key was handed out");
            let t = Instant::now();
            let mr = verbs::MemoryRegion::register_range(
                &pd,
                b.arena.clone(),
                4096,
                len as usize,
                verbs::Access::RemoteWrite,
            )
            .expect("register");
            drop(mr);
            reg.push(t.elapsed().as_secs_f64() * 1e6);
        }
        assert_eq!(delta(b.t.stats(), s0).grant_registrations, 50);
        println!(
            "grant of {:>6} KiB: registration + window (grant and revoke) median {:.1} us, registration alone median {:.1} us",
            len >> 10,
            median(grant),
            median(reg)
        );
    }
    a.t.shutdown();
    b.t.shutdown();
}

fn paint(arena: &Arena, off: u64, len: u64, byte: u8) {
    // SAFETY: test-owned range, nobody else touches it.
    unsafe { arena.slice_mut(off, len) }.fill(byte);
}

/// A peer that keeps its link alive but consumes nothing (no credit comes back) stalls no
/// one: a sender waits for a credit at most twice the heartbeat timeout, then the link fails
/// and the send returns an error.
fn a_peer_that_stops_consuming_is_dropped_not_waited_on_with(base: RdmaConfig) {
    let c = base.clone();
    let (hb, blocks) = (c.heartbeat_timeout, c.ring_blocks);
    // Node 1 plays the hostile peer: it consumes nothing but keeps the link alive (its
    // heartbeats reach node 0, which consumes them and returns their credits).
    let (a, b) = pair(c, 1 << 20);
    b.t.pause_consuming(0, true).expect("pause");
    let t0 = Instant::now();
    let mut sent = 0;
    let err = loop {
        match a.t.send(1, b"are you reading?") {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
        assert!(
            sent <= blocks + 1,
            "{sent} messages sent into a ring of {blocks} blocks nobody consumes"
        );
    };
    let took = t0.elapsed();
    println!("{sent} sends went out, then the next was refused after {took:?}: {err:?}");
    assert!(
        sent >= blocks - 1,
        "the ring's credits were used first ({sent})"
    );
    assert!(
        took >= hb && took < hb * 2 + Duration::from_secs(5),
        "the stalled send failed after {took:?} (bound: twice {hb:?})"
    );
    assert!(
        !a.t.is_connected(1),
        "the link to the silent consumer is down"
    );
    a.t.shutdown();
    b.t.shutdown();
}

#[test]
fn ctrl_ring_wraps_over_many_laps() {
    if have_device("ctrl_ring_wraps_over_many_laps") {
        ctrl_ring_wraps_over_many_laps_with(cfg());
    }
}

/// The same over links without rings of their own (the shared receive queue and staging pool).
#[test]
fn ctrl_ring_wraps_over_many_laps_shared() {
    if have_device("ctrl_ring_wraps_over_many_laps_shared") {
        ctrl_ring_wraps_over_many_laps_with(shared_cfg());
    }
}

#[test]
fn large_ctrl_messages_fragment_in_order_both_ways() {
    if have_device("large_ctrl_messages_fragment_in_order_both_ways") {
        large_ctrl_messages_fragment_in_order_both_ways_with(cfg());
    }
}

/// The same over links without rings of their own (the shared receive queue and staging pool).
#[test]
fn large_ctrl_messages_fragment_in_order_both_ways_shared() {
    if have_device("large_ctrl_messages_fragment_in_order_both_ways_shared") {
        large_ctrl_messages_fragment_in_order_both_ways_with(shared_cfg());
    }
}

#[test]
fn small_write_goes_through_blocks() {
    if have_device("small_write_goes_through_blocks") {
        small_write_goes_through_blocks_with(cfg());
    }
}

/// The same over links without rings of their own (the shared receive queue and staging pool).
#[test]
fn small_write_goes_through_blocks_shared() {
    if have_device("small_write_goes_through_blocks_shared") {
        small_write_goes_through_blocks_with(shared_cfg());
    }
}

#[test]
fn large_write_is_zero_copy_rendezvous() {
    if have_device("large_write_is_zero_copy_rendezvous") {
        large_write_is_zero_copy_rendezvous_with(cfg());
    }
}

/// The same over links without rings of their own (the shared receive queue and staging pool).
#[test]
fn large_write_is_zero_copy_rendezvous_shared() {
    if have_device("large_write_is_zero_copy_rendezvous_shared") {
        large_write_is_zero_copy_rendezvous_with(shared_cfg());
    }
}

#[test]
fn event_handler_replies_with_nonblocking_sends() {
    if have_device("event_handler_replies_with_nonblocking_sends") {
        event_handler_replies_with_nonblocking_sends_with(cfg());
    }
}

/// The same over links without rings of their own (the shared receive queue and staging pool).
#[test]
fn event_handler_replies_with_nonblocking_sends_shared() {
    if have_device("event_handler_replies_with_nonblocking_sends_shared") {
        event_handler_replies_with_nonblocking_sends_with(shared_cfg());
    }
}

#[test]
fn a_peer_that_stops_consuming_is_dropped_not_waited_on() {
    if have_device("a_peer_that_stops_consuming_is_dropped_not_waited_on") {
        a_peer_that_stops_consuming_is_dropped_not_waited_on_with(cfg());
    }
}

/// The same over links without rings of their own (the shared receive queue and staging pool).
#[test]
fn a_peer_that_stops_consuming_is_dropped_not_waited_on_shared() {
    if have_device("a_peer_that_stops_consuming_is_dropped_not_waited_on_shared") {
        a_peer_that_stops_consuming_is_dropped_not_waited_on_with(shared_cfg());
    }
}

/// Eager memory does not grow with the number of peers: with two places in the ring pool, a
/// node linked to four peers registers the shared pools and two rings, no more, and its links
/// with and without rings (at least two of them without one) carry every message,
/// in order, both ways.
#[test]
fn eager_memory_is_bounded_by_the_pools() {
    if !have_device("eager_memory_is_bounded_by_the_pools") {
        return;
    }
    const N: usize = 5;
    const MSGS: u32 = 150;
    let c = RdmaConfig {
        ring_pool: 2,
        srq_blocks: 64,
        staging_blocks: 32,
        ..cfg()
    };
    let nodes: Vec<Node> = (0..N)
        .map(|i| node(i as NodeId, c.clone(), 1 << 20))
        .collect();
    let peers: Vec<(NodeId, SocketAddr)> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (i as NodeId, n.t.listen_addr()))
        .collect();
    std::thread::scope(|s| {
        for n in &nodes {
            let peers = &peers;
            s.spawn(move || n.t.connect(peers, false).expect("connect"));
        }
    });
    for n in &nodes {
        for _ in 1..N {
            let e = next_event(n, Duration::from_secs(20));
            assert!(matches!(e, Event::PeerUp { .. }), "{e:?}");
        }
    }
    std::thread::scope(|s| {
        for (i, n) in nodes.iter().enumerate() {
            s.spawn(move || {
                for k in 0..MSGS {
                    for j in (0..N).filter(|&j| j != i) {
                        let len = (k as usize * 97) % 20_000;
                        let mut m = pattern(i * 1000 + k as usize, len);
                        m.splice(0..0, k.to_le_bytes());
                        n.t.send(j as NodeId, &m).expect("send");
                    }
                }
            });
        }
        for (j, n) in nodes.iter().enumerate() {
            s.spawn(move || {
                let mut next = [0u32; N];
                for _ in 0..(N - 1) * MSGS as usize {
                    match next_event(n, Duration::from_secs(60)) {
                        Event::Ctrl { peer, msg } => {
                            let k = u32::from_le_bytes(msg[..4].try_into().unwrap());
                            let i = peer as usize;
                            assert_eq!(k, next[i], "node {j}: message from {i} in order");
                            let len = (k as usize * 97) % 20_000;
                            assert!(msg[4..] == pattern(i * 1000 + k as usize, len)[..]);
                            next[i] += 1;
                        }
                        other => panic!("node {j}: unexpected event {other:?}"),
                    }
                }
            });
        }
    });
    let pools = ((c.srq_blocks + c.staging_blocks) * c.block_size) as u64;
    let ring = ((2 * c.ring_blocks * c.block_size + 128) as u64).next_multiple_of(4096);
    let bound = pools + c.ring_pool as u64 * ring;
    let mem: Vec<(u64, u64)> = nodes.iter().map(|n| n.t.eager_memory().unwrap()).collect();
    println!(
        "{N} nodes, {} links each, ring pool {}: eager memory per node (now, peak) {:?} KiB; \
         bound {} KiB (pools {} KiB + {} rings of {} KiB); {} KiB if every link had a ring",
        N - 1,
        c.ring_pool,
        mem.iter()
            .map(|(a, b)| (a >> 10, b >> 10))
            .collect::<Vec<_>>(),
        bound >> 10,
        pools >> 10,
        c.ring_pool,
        ring >> 10,
        (pools + (N as u64 - 1) * ring) >> 10
    );
    for (i, &(now, peak)) in mem.iter().enumerate() {
        assert!(peak <= bound, "node {i}: {peak} bytes of eager memory");
        assert!(now >= pools && now <= peak);
    }
    for n in &nodes {
        assert_eq!(n.t.stats().malformed_frames, 0);
        n.t.shutdown();
    }
}

/// The median round trip of a small control message over one link.
fn ping_pong_us(c: RdmaConfig, rounds: usize) -> (f64, f64) {
    let (a, b) = pair(c, 1 << 20);
    let mut times = Vec::with_capacity(rounds);
    let msg = [7u8; 64];
    for _ in 0..rounds {
        let t0 = Instant::now();
        a.t.send(1, &msg).unwrap();
        assert!(matches!(
            next_event(&b, Duration::from_secs(10)),
            Event::Ctrl { .. }
        ));
        b.t.send(0, &msg).unwrap();
        assert!(matches!(
            next_event(&a, Duration::from_secs(10)),
            Event::Ctrl { .. }
        ));
        times.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    a.t.shutdown();
    b.t.shutdown();
    times.sort_by(f64::total_cmp);
    (times[rounds / 2], times[rounds * 99 / 100])
}

/// What a link without a ring costs in latency: 64-byte round trips over a ring link and a
/// shared-pool link, printed (a correctness VM: figures for comparison, not speed).
#[test]
fn shared_pool_latency_against_rings() {
    if !have_device("shared_pool_latency_against_rings") {
        return;
    }
    let rounds = 300;
    let ring = ping_pong_us(cfg(), rounds);
    let shared = ping_pong_us(shared_cfg(), rounds);
    let ring2 = ping_pong_us(cfg(), rounds);
    println!(
        "64-byte round trip, median (p99) of {rounds}: ring {:.1} us ({:.1}), shared pool \
         {:.1} us ({:.1}), ring again {:.1} us ({:.1}); shared / ring {:.2}",
        ring.0,
        ring.1,
        shared.0,
        shared.1,
        ring2.0,
        ring2.1,
        shared.0 / ring.0.min(ring2.0)
    );
}

/// A peer whose NIC takes nothing (its shared receive queue left empty) cannot hold the
/// staging pool every other link sends from: its link fails once its sends have not completed
/// for the heartbeat timeout, and a send to another peer then goes out.
#[test]
fn a_peer_that_takes_nothing_cannot_hold_the_staging_pool() {
    if !have_device("a_peer_that_takes_nothing_cannot_hold_the_staging_pool") {
        return;
    }
    let base = RdmaConfig {
        ring_pool: 0,
        ..cfg()
    };
    let hb = base.heartbeat_timeout;
    let a = node(
        0,
        RdmaConfig {
            staging_blocks: 8,
            ..base.clone()
        },
        1 << 20,
    );
    // Node 1 reposts nothing it receives: its 4 receive blocks fill, then its NIC refuses.
    let b = node(
        1,
        RdmaConfig {
            srq_blocks: 4,
            ..base.clone()
        },
        1 << 20,
    );
    let c = node(2, base, 1 << 20);
    let peers = [
        (0, a.t.listen_addr()),
        (1, b.t.listen_addr()),
        (2, c.t.listen_addr()),
    ];
    std::thread::scope(|s| {
        for n in [&a, &b, &c] {
            let peers = &peers;
            s.spawn(move || n.t.connect(peers, false).expect("connect"));
        }
    });
    for n in [&a, &b, &c] {
        for _ in 0..2 {
            let e = next_event(n, Duration::from_secs(20));
            assert!(matches!(e, Event::PeerUp { .. }), "{e:?}");
        }
    }
    b.t.pause_consuming(0, true).expect("pause");
    // More than node 1 can take and than node 0 has staging blocks: the sender stalls.
    let ta = a.t.clone();
    let hog = std::thread::spawn(move || {
        let mut sent = 0;
        while sent < 40 && ta.send(1, &[1u8; 100]).is_ok() {
            sent += 1;
        }
        sent
    });
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    a.t.send(2, b"still sending")
        .expect("a send to another peer");
    let took = t0.elapsed();
    match next_event(&c, Duration::from_secs(10)) {
        Event::Ctrl { peer: 0, msg } => assert_eq!(msg, b"still sending"),
        other => panic!("unexpected event {other:?}"),
    }
    let sent = hog.join().unwrap();
    println!(
        "{sent} sends to the peer that takes nothing went out; a send to another peer took \
         {took:?} (heartbeat timeout {hb:?})"
    );
    assert!(sent < 40, "sends to the peer that takes nothing stopped");
    assert!(took < hb * 2 + Duration::from_secs(3), "{took:?}");
    assert!(
        !a.t.is_connected(1),
        "the link to the peer that takes nothing is down"
    );
    for n in [a, b, c] {
        n.t.shutdown();
    }
}

/// Links made on demand close when idle, as over TCP: after each burst of messages both
/// ways and a pause longer than the idle timeout the link is gone on both sides (its ring
/// back in the pool), nobody reported the other down, and the next message makes a new link;
/// every message arrives once and in order.
#[test]
fn idle_links_close_and_the_next_use_links_again() {
    if !have_device("idle_links_close_and_the_next_use_links_again") {
        return;
    }
    let c = RdmaConfig {
        on_demand: true,
        idle_timeout: Duration::from_millis(300),
        ..cfg()
    };
    let a = node(0, c.clone(), 1 << 20);
    let b = node(1, c.clone(), 1 << 20);
    let peers = [(0, a.t.listen_addr()), (1, b.t.listen_addr())];
    a.t.connect(&peers, false).expect("a");
    b.t.connect(&peers, false).expect("b");
    let pools = ((c.srq_blocks + c.staging_blocks) * c.block_size) as u64;
    // Messages of one node to the other, in order; PeerUp may come between, PeerDown never.
    let expect = |n: &Node, from: NodeId, first: u32, count: u32| {
        let mut next = first;
        while next < first + count {
            match next_event(n, Duration::from_secs(20)) {
                Event::Ctrl { peer, msg } => {
                    assert_eq!(peer, from);
                    let k = u32::from_le_bytes(msg[..4].try_into().unwrap());
                    assert_eq!(k, next, "message {next} once and in order");
                    assert!(msg[4..] == pattern(k as usize, msg.len() - 4)[..]);
                    next += 1;
                }
                Event::PeerUp { .. } => {}
                other => panic!("unexpected event {other:?}"),
            }
        }
    };
    let msg = |k: u32| {
        let mut m = k.to_le_bytes().to_vec();
        m.extend(pattern(k as usize, (k as usize * 131) % 9000));
        m
    };
    let rounds = 3;
    for r in 0..rounds {
        let first = r * 40;
        for k in first..first + 40 {
            a.t.send(1, &msg(k)).expect("a sends");
            b.t.send(0, &msg(k)).expect("b sends");
        }
        expect(&b, 0, first, 40);
        expect(&a, 1, first, 40);
        assert!(a.t.is_connected(1) || b.t.is_connected(0) || r > 0);
        // Idle: closed on both sides within the idle timeout, a heartbeat pass and the
        // goodbye.
        let t0 = Instant::now();
        while (a.t.is_connected(1) || b.t.is_connected(0)) && t0.elapsed() < Duration::from_secs(5)
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            !a.t.is_connected(1) && !b.t.is_connected(0),
            "round {r}: the idle link closed on both sides"
        );
        // The ring goes back once the link is dropped (the goodbye completed).
        let t1 = Instant::now();
        while (a.t.eager_memory().unwrap().0 > pools || b.t.eager_memory().unwrap().0 > pools)
            && t1.elapsed() < Duration::from_secs(5)
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(
            a.t.eager_memory().unwrap().0,
            pools,
            "round {r}: ring back in the pool"
        );
        assert_eq!(b.t.eager_memory().unwrap().0, pools);
        println!(
            "round {r}: closed {:?} after the last message",
            t0.elapsed()
        );
    }
    let closed = a.t.link_counts().unwrap().idle_closed + b.t.link_counts().unwrap().idle_closed;
    assert!(closed >= rounds as u64, "{closed} idle closes");
    for n in [&a, &b] {
        assert_eq!(n.t.stats().peers_down, 0, "nobody reported down");
        assert_eq!(n.t.stats().malformed_frames, 0);
        assert!(n
            .t
            .events()
            .try_iter()
            .all(|e| !matches!(e, Event::PeerDown { .. })));
    }
    a.t.shutdown();
    b.t.shutdown();
}
