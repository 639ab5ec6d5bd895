//! Cases about counters and the life of links: death within the bound, rejoin, leave.

use super::*;
/// The counters: control messages and data bytes counted exactly once on each side (in both
/// directions at once), no registration per transfer, and heartbeats on an idle link neither
/// count as control messages nor produce events.
pub fn stats_count_exactly<H: Harness>() {
    let hb = heartbeat::<H>();
    let mesh = Mesh::<H>::new(2, 8 << 20, hb);
    let s0: Vec<TransportStats> = mesh.nodes.iter().map(|n| n.t.stats()).collect();
    for s in &s0 {
        assert!(
            s.registrations >= 1,
            "the arena counts as a registration: {s:?}"
        );
        assert_eq!(s.data_bytes_sent + s.data_bytes_received, 0, "{s:?}");
    }
    // Node k sends 10 + k messages and writes `lens[k]`.
    let lens: [&[u64]; 2] = [&[1, 4096, 3 << 20], &[100, (1 << 20) + 1]];
    let threads: Vec<_> = (0..2u32)
        .map(|k| {
            let (src, dst) = (mesh.node(k), mesh.node(1 - k));
            let t = src.t.clone();
            let region = dst.region(k, 4 << 20, 4 << 20).expect("region");
            let mine = lens[k as usize];
            std::thread::spawn(move || {
                for i in 0..10 + k as u64 {
                    t.send(1 - k, &message(k, 1 - k, i, 64)).expect("send");
                }
                let mut at = 0;
                for (i, &len) in mine.iter().enumerate() {
                    t.write(1 - k, i as u64, 0, &region, at, len)
                        .expect("write");
                    at += len;
                }
            })
        })
        .collect();
    for k in 0..2u32 {
        let node = mesh.node(1 - k);
        for i in 0..10 + k as u64 {
            node.expect_ctrl(k, &message(k, 1 - k, i, 64));
        }
        let mut at = 0;
        for (i, &len) in lens[k as usize].iter().enumerate() {
            node.expect_data(k, i as u64, at, len, WAIT);
            at += len;
        }
    }
    for t in threads {
        t.join().expect("traffic");
    }
    let s1: Vec<TransportStats> = mesh.nodes.iter().map(|n| n.t.stats()).collect();
    for k in 0..2usize {
        let (me, other) = (delta(s1[k], s0[k]), 1 - k);
        let bytes = |j: usize| lens[j].iter().sum::<u64>();
        assert_eq!(me.ctrl_sent, 10 + k as u64, "node {k}: ctrl_sent");
        assert_eq!(
            me.ctrl_received,
            10 + other as u64,
            "node {k}: ctrl_received"
        );
        assert_eq!(me.data_bytes_sent, bytes(k), "node {k}: data_bytes_sent");
        assert_eq!(
            me.data_bytes_received,
            bytes(other),
            "node {k}: data_bytes_received"
        );
        assert_eq!(
            me.registrations, 0,
            "node {k}: no registration per transfer"
        );
        assert_eq!(me.peers_down + me.malformed_frames, 0, "node {k}: {me:?}");
    }
    // Idle for two heartbeat timeouts: the link stays up and nothing is counted.
    mesh.node(0).quiet(2 * hb, "an idle link has no events");
    mesh.node(1).nothing_queued("an idle link has no events");
    for (k, node) in mesh.nodes.iter().enumerate() {
        let d = delta(node.t.stats(), s1[k]);
        assert_eq!(d, TransportStats::default(), "node {k}: idle counters");
        assert!(
            node.t.is_connected(1 - k as NodeId),
            "node {k}: idle link up"
        );
    }
}

/// A killed node (no goodbye) is reported down by every survivor exactly once, within the
/// heartbeat bound, and not as a leave; a write streaming towards it at that moment fails
/// rather than hangs; every later operation towards it fails; the survivors' own link is
/// unaffected; the killed transport refuses work with `Shutdown`.
pub fn killed_peer_is_reported_down_within_the_bound<H: Harness>() {
    let hb = heartbeat::<H>();
    let bound = detection_bound(hb);
    let mesh = Mesh::<H>::new(3, 4 << 20, hb);
    let victim = 2;
    for from in 0..3 {
        for to in (0..3).filter(|&p| p != from) {
            mesh.node(from).t.send(to, b"hello").expect("send");
        }
    }
    for node in &mesh.nodes {
        // One from each peer, in any order across peers.
        let mut from = BTreeSet::new();
        for _ in 0..2 {
            match node.next(WAIT, "hello") {
                Event::Ctrl { peer, msg } if msg == b"hello" => assert!(from.insert(peer)),
                other => panic!("node {}: expected a hello, got {other:?}", node.id),
            }
        }
        assert_eq!(from, (0..3).filter(|&p| p != node.id).collect());
    }
    let s0: Vec<TransportStats> = mesh.nodes.iter().map(|n| n.t.stats()).collect();
    // Node 0 streams writes into the victim until a write fails.
    let region = mesh.node(victim).region(0, 0, 4 << 20).expect("region");
    let t0 = mesh.node(0).t.clone();
    let writes = Arc::new(AtomicU64::new(0));
    let w = writes.clone();
    let streamer = std::thread::spawn(move || loop {
        let r = t0.write(victim, 9, 0, &region, 0, 256 << 10);
        match r {
            Ok(()) => {
                w.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => return (e, Instant::now()),
        }
    });
    let deadline = Instant::now() + WAIT;
    while writes.load(Ordering::Relaxed) < 2 {
        assert!(
            Instant::now() < deadline,
            "the streaming writes make no progress"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let killed_at = Instant::now();
    mesh.node(victim).t.kill();
    for id in 0..2 {
        let node = mesh.node(id);
        let reason = node.expect_down(victim, bound + WAIT);
        let after = killed_at.elapsed();
        assert!(
            after <= bound,
            "node {id}: PeerDown {after:?} after the kill, bound {bound:?} (heartbeat {hb:?})"
        );
        assert_ne!(
            reason, PEER_LEFT,
            "node {id}: a kill is a failure, not a leave"
        );
        println!(
            "{}: node {id} saw the kill after {after:?}: {reason}",
            node.t.name()
        );
    }
    let (err, failed_at) = streamer.join().expect("streamer");
    assert_gone::<()>(Err(err), victim, "a write in flight to a killed peer");
    let after = failed_at.saturating_duration_since(killed_at);
    assert!(
        after <= bound,
        "the streaming write failed {after:?} after the kill"
    );
    match mesh.node(victim).t.send(0, b"x") {
        Err(TransportError::Shutdown) => {}
        other => panic!("send on a killed transport: expected Shutdown, got {other:?}"),
    }
    for id in 0..2 {
        let t = &mesh.node(id).t;
        assert!(
            !t.is_connected(victim),
            "node {id}: link to the dead peer gone"
        );
        assert_gone(t.send(victim, b"x"), victim, "send");
        assert_gone_nonblocking(t.send_nonblocking(victim, b"x"), victim);
        assert_gone(t.write(victim, 1, 0, &region, 0, 1), victim, "write");
    }
    // Exactly once: nothing more for two heartbeat timeouts, and the survivors still talk.
    mesh.node(0).quiet(2 * hb, "PeerDown exactly once");
    mesh.node(1).nothing_queued("PeerDown exactly once");
    mesh.node(0)
        .t
        .send(1, b"still here")
        .expect("survivors linked");
    mesh.node(1).expect_ctrl(0, b"still here");
    mesh.node(1).t.send(0, b"me too").expect("survivors linked");
    mesh.node(0).expect_ctrl(1, b"me too");
    for id in 0..2 {
        let d = delta(mesh.node(id).t.stats(), s0[id as usize]);
        assert_eq!(d.peers_down, 1, "node {id}: one peer down");
        assert_eq!(d.malformed_frames, 0, "node {id}");
    }
}

/// A killed node that restarts (new transport, new port) and dials everybody after its death
/// was reported: every survivor sees `PeerUp` once, the new incarnation links to all, and
/// control messages and data flow both ways again.
pub fn restarted_peer_rejoins<H: Harness>() {
    let hb = heartbeat::<H>();
    let mut mesh = Mesh::<H>::new(3, 1 << 20, hb);
    let victim = 1;
    mesh.node(victim).t.kill();
    for id in [0, 2] {
        let reason = mesh
            .node(id)
            .expect_down(victim, detection_bound(hb) + WAIT);
        assert_ne!(reason, PEER_LEFT);
    }
    mesh.restart(victim);
    for id in [0, 2] {
        match mesh.node(id).next(WAIT, "PeerUp of the restarted node") {
            Event::PeerUp { peer } => assert_eq!(peer, victim),
            other => panic!("node {id}: expected PeerUp of {victim}, got {other:?}"),
        }
        assert!(mesh.node(id).t.is_connected(victim), "node {id}: relinked");
    }
    assert_eq!(
        mesh.node(victim).t.stats().ctrl_received,
        0,
        "a fresh incarnation"
    );
    check_traffic_with(&mesh, victim);
    for node in &mesh.nodes {
        node.quiet(hb / 2, "no stray event after the rejoin");
    }
}

/// A killed node that restarts at once, before anyone may have noticed its death: every
/// survivor still reports the old incarnation down (a failure, once) and then the new one up
/// (once), in that order, and the new links work. (The old incarnation's state is gone, which
/// is what `PeerDown` tells the layer above.)
pub fn restart_before_detection_reports_down_then_up<H: Harness>() {
    let hb = heartbeat::<H>();
    let mut mesh = Mesh::<H>::new(3, 1 << 20, hb);
    let victim = 1;
    mesh.node(victim).t.kill();
    mesh.restart(victim);
    for id in [0, 2] {
        let node = mesh.node(id);
        let reason = node.expect_down(victim, detection_bound(hb) + WAIT);
        assert_ne!(
            reason, PEER_LEFT,
            "node {id}: a kill is a failure, not a leave"
        );
        match node.next(WAIT, "PeerUp of the restarted node") {
            Event::PeerUp { peer } => assert_eq!(peer, victim, "node {id}"),
            other => panic!("node {id}: expected PeerUp of {victim}, got {other:?}"),
        }
    }
    // The old incarnation's late failure detection must not touch the new link.
    for node in &mesh.nodes {
        node.quiet(2 * hb, "nothing after down/up");
    }
    for id in [0, 2] {
        assert!(mesh.node(id).t.is_connected(victim), "node {id}: relinked");
        assert_eq!(
            mesh.node(id).t.stats().peers_down,
            1,
            "node {id}: one death"
        );
    }
    check_traffic_with(&mesh, victim);
}

/// Control messages and a write each way between `id` and every other node.
pub(super) fn check_traffic_with<H: Harness>(mesh: &Mesh<H>, id: NodeId) {
    let len = 100_000;
    for other in mesh.ids().filter(|&p| p != id) {
        for (from, to) in [(id, other), (other, id)] {
            let (src, dst) = (mesh.node(from), mesh.node(to));
            let m = message(from, to, 0, 33);
            src.t.send(to, &m).expect("send");
            dst.expect_ctrl(from, &m);
            fill(&src.arena, 0, len, from as u64 * 7 + to as u64);
            let region = dst.region(from, 4096, len).expect("region");
            src.t.write(to, 5, 0, &region, 0, len).expect("write");
            dst.expect_data(from, 5, 0, len, WAIT);
            assert_same(
                &src.arena,
                0,
                &dst.arena,
                4096,
                len,
                "write after the rejoin",
            );
        }
    }
}

/// A link dropped while both nodes stay up is dialled again, whichever side dropped it (here
/// the receiver of a write into a revoked grant): both nodes see `PeerDown`, then `PeerUp`,
/// and messages flow both ways on the new link.
pub fn a_dropped_link_is_dialled_again<H: Harness>() {
    for (writer, owner) in [(0u32, 1u32), (1, 0)] {
        let mesh = Mesh::<H>::new(2, 1 << 20, CALM_HEARTBEAT);
        let (w, o) = (mesh.node(writer), mesh.node(owner));
        let region = o.region(writer, 4096, 1000).expect("region");
        o.t.revoke(writer, &region);
        let t0 = Instant::now();
        w.t.write(owner, 1, 0, &region, 0, 1000)
            .expect("the write leaves");
        o.expect_down(writer, WAIT);
        w.expect_down(owner, WAIT);
        o.expect_up(writer, WAIT);
        w.expect_up(owner, WAIT);
        let took = t0.elapsed();
        w.t.send(owner, b"again").expect("send on the new link");
        o.expect_ctrl(writer, b"again");
        o.t.send(writer, b"both ways").expect("send back");
        w.expect_ctrl(owner, b"both ways");
        assert!(w.t.is_connected(owner) && o.t.is_connected(writer));
        // Detection (the heartbeat bound at worst) plus the backoff of a few attempts.
        assert!(
            took < 4 * CALM_HEARTBEAT,
            "link back after {took:?} (writer {writer})"
        );
        println!("writer {writer}: link dropped and dialled again in {took:?}");
    }
}

/// `shutdown` says goodbye: each peer first gets everything the node sent before it (in
/// order), then one `PeerDown` with reason `PEER_LEFT`, promptly (no heartbeat wait) and
/// exactly once; no node reports a failure; operations towards the departed node fail, its
/// own operations fail with `Shutdown`, and the remaining nodes stay linked.
pub fn shutdown_is_a_leave_not_a_failure<H: Harness>() {
    const N: u64 = 50;
    let hb = heartbeat::<H>();
    let mesh = Mesh::<H>::new(3, 1 << 20, hb);
    let leaver = 2;
    let s0: Vec<TransportStats> = mesh.nodes.iter().map(|n| n.t.stats()).collect();
    let l = mesh.node(leaver);
    fill(&l.arena, 0, 20_000, 5);
    for to in 0..2 {
        for i in 0..N {
            l.t.send(to, &message(leaver, to, i, 200)).expect("send");
        }
        let region = mesh.node(to).region(leaver, 0, 20_000).expect("region");
        l.t.write(to, 3, 0, &region, 0, 20_000).expect("write");
        l.t.send(to, b"last words").expect("send");
    }
    let leaver_region = l.region(0, 0, 4096).expect("region");
    let left_at = Instant::now();
    l.t.shutdown();
    for id in 0..2 {
        let node = mesh.node(id);
        for i in 0..N {
            node.expect_ctrl(leaver, &message(leaver, id, i, 200));
        }
        node.expect_data(leaver, 3, 0, 20_000, WAIT);
        node.expect_ctrl(leaver, b"last words");
        let reason = node.expect_down(leaver, WAIT);
        assert_eq!(reason, PEER_LEFT, "node {id}: a goodbye is a leave");
        let after = left_at.elapsed();
        assert!(
            after < hb + SLACK,
            "node {id}: the leave took {after:?}, more than a heartbeat timeout ({hb:?})"
        );
        assert_same(
            &l.arena,
            0,
            &node.arena,
            0,
            20_000,
            "data before the goodbye",
        );
    }
    for id in 0..2 {
        let t = &mesh.node(id).t;
        assert!(
            !t.is_connected(leaver),
            "node {id}: link to the leaver closed"
        );
        assert_gone(t.send(leaver, b"x"), leaver, "send");
        assert_gone(t.write(leaver, 1, 0, &leaver_region, 0, 1), leaver, "write");
    }
    match l.t.send(0, b"x") {
        Err(TransportError::Shutdown) => {}
        other => panic!("send on a shut down transport: expected Shutdown, got {other:?}"),
    }
    l.t.shutdown(); // a second shutdown is harmless
                    // Exactly once, and nobody (the leaver included) reports a failure.
    mesh.node(0).quiet(2 * hb, "one PeerDown per leave");
    for node in &mesh.nodes {
        while let Ok(ev) = node.events.try_recv() {
            match ev {
                Event::PeerDown { reason, .. } if reason != PEER_LEFT => {
                    panic!(
                        "node {}: failure reported on a clean shutdown: {reason}",
                        node.id
                    )
                }
                Event::PeerDown { .. } if node.id != leaver => {
                    panic!("node {}: a second PeerDown for one leave", node.id)
                }
                Event::PeerDown { .. } => {}
                other => panic!("node {}: unexpected event {other:?}", node.id),
            }
        }
    }
    mesh.node(0)
        .t
        .send(1, b"carry on")
        .expect("0 and 1 still linked");
    mesh.node(1).expect_ctrl(0, b"carry on");
    for id in 0..2 {
        let d = delta(mesh.node(id).t.stats(), s0[id as usize]);
        assert_eq!(
            d.ctrl_received,
            N + 1 + id as u64,
            "node {id}: ctrl_received"
        );
        assert_eq!(
            d.data_bytes_received, 20_000,
            "node {id}: data_bytes_received"
        );
        assert_eq!(
            d.peers_down, 1,
            "node {id}: the leave counts once in peers_down"
        );
        assert_eq!(d.malformed_frames, 0, "node {id}");
    }
}
