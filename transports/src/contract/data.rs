//! Cases about what a live link carries: control messages, data writes and their events,
//! limits, typed errors.

use super::*;
/// Control messages, from every node to every other one concurrently, arrive intact and in
/// the order sent, and the counters count each exactly once.
pub fn ctrl_messages_keep_their_order<H: Harness>() {
    const N: u64 = 400;
    // Sizes around and above an eager block of the verbs transport (8 KiB by default), so
    // fragmented messages are in the mix.
    const SIZES: [usize; 9] = [0, 1, 3, 100, 1000, 8100, 8200, 20_000, 65_536];
    let mesh = Mesh::<H>::new(3, 1 << 20, CALM_HEARTBEAT);
    let before: Vec<TransportStats> = mesh.nodes.iter().map(|n| n.t.stats()).collect();
    let senders: Vec<_> = mesh
        .nodes
        .iter()
        .map(|node| {
            let t = node.t.clone();
            let me = node.id;
            std::thread::spawn(move || {
                for i in 0..N {
                    for to in (0..3).filter(|&p| p != me) {
                        let m = message(me, to, i, SIZES[(i as usize + to as usize) % 9]);
                        t.send(to, &m)
                            .unwrap_or_else(|e| panic!("send {me}->{to} #{i}: {e}"));
                    }
                }
            })
        })
        .collect();
    for node in &mesh.nodes {
        let mut next: HashMap<NodeId, u64> = HashMap::new();
        for _ in 0..2 * N {
            match node.next(WAIT, "control messages") {
                Event::Ctrl { peer, msg } => {
                    assert!(peer < 3 && peer != node.id, "sender {peer}");
                    let i = next.entry(peer).or_insert(0);
                    assert!(*i < N, "more than {N} messages from {peer}");
                    let want = message(
                        peer,
                        node.id,
                        *i,
                        SIZES[(*i as usize + node.id as usize) % 9],
                    );
                    assert_bytes(&msg, &want, &format!("message {i} {peer}->{}", node.id));
                    *i += 1;
                }
                other => panic!("node {}: unexpected event {other:?}", node.id),
            }
        }
        node.nothing_queued("every message arrived once");
    }
    for s in senders {
        s.join().expect("sender");
    }
    for (node, b) in mesh.nodes.iter().zip(before) {
        let d = delta(node.t.stats(), b);
        assert_eq!(d.ctrl_sent, 2 * N, "node {}: ctrl_sent", node.id);
        assert_eq!(d.ctrl_received, 2 * N, "node {}: ctrl_received", node.id);
        assert_eq!(
            d.malformed_frames + d.peers_down,
            0,
            "node {}: {d:?}",
            node.id
        );
    }
}

/// A control message sent after writes (from the same thread) arrives after all their data
/// events, for small, eager-sized, unaligned and multi-chunk writes, with no waiting between
/// the rounds.
pub fn ctrl_after_write_follows_its_data<H: Harness>() {
    // Per round: the streams written before the round's control message, with their sizes.
    let rounds: Vec<Vec<u64>> = vec![
        vec![1],
        vec![4096],
        vec![8191],
        vec![8192],
        vec![100_003],
        vec![(3 << 20) + 7],
        vec![10, 70_000, (1 << 20) + 1],
    ];
    let total: u64 = rounds.iter().flatten().map(|l| l + 8).sum();
    let mesh = Mesh::<H>::new(2, total as usize + 4096, CALM_HEARTBEAT);
    let (a, b) = (mesh.node(0), mesh.node(1));
    // Layout: write k of the whole run goes from `off` in a's arena to `off` in b's.
    let mut plan = Vec::new();
    let mut off = 0u64;
    for (r, lens) in rounds.iter().enumerate() {
        let mut writes = Vec::new();
        for (k, &len) in lens.iter().enumerate() {
            let stream = (r * 10 + k) as u64 + 1;
            fill(&a.arena, off, len, stream);
            writes.push((stream, off, len));
            off += len + 8;
        }
        plan.push(writes);
    }
    let regions: Vec<Vec<RemoteRegion>> = plan
        .iter()
        .map(|ws| {
            ws.iter()
                .map(|&(_, off, len)| b.region(0, off, len).expect("region"))
                .collect()
        })
        .collect();
    let ta = a.t.clone();
    let plan2 = plan.clone();
    let sender = std::thread::spawn(move || {
        for (r, (ws, regs)) in plan2.iter().zip(&regions).enumerate() {
            for (&(stream, off, len), reg) in ws.iter().zip(regs) {
                ta.write(1, stream, off, reg, 0, len)
                    .unwrap_or_else(|e| panic!("write stream {stream}: {e}"));
            }
            ta.send(1, format!("after round {r}").as_bytes())
                .expect("send");
        }
    });
    for (r, ws) in plan.iter().enumerate() {
        let mut cover: Vec<Coverage> = ws
            .iter()
            .map(|&(stream, _, len)| Coverage::new(0, stream, 0, len))
            .collect();
        loop {
            let ev = b.next(WAIT_LARGE, "data or the round's control message");
            if let Event::Ctrl { peer, msg } = &ev {
                assert_eq!(*peer, 0);
                assert_bytes(
                    msg,
                    format!("after round {r}").as_bytes(),
                    "control message",
                );
                for c in &cover {
                    assert!(
                        c.complete(),
                        "round {r}: control message before the end of stream {}'s data ({} of {})",
                        c.stream,
                        c.mark,
                        c.end
                    );
                }
                break;
            }
            assert!(
                cover.iter_mut().any(|c| c.take(&ev)),
                "round {r}: unexpected event {ev:?}"
            );
        }
        for &(stream, off, len) in ws {
            assert_same(
                &a.arena,
                off,
                &b.arena,
                off,
                len,
                &format!("stream {stream}"),
            );
        }
    }
    sender.join().expect("sender");
    b.nothing_queued("no event after the last round");
}

/// Concurrent writes on several streams, in both directions, each a sequence of writes of
/// mixed sizes continuing at an offset inside a region: the receiver sees each stream's data
/// events in order, contiguous and covering exactly the written range, with the bytes in
/// place and the bytes around the range untouched.
pub fn data_events_cover_each_stream_exactly<H: Harness>() {
    const LENS: [u64; 6] = [1, 5000, 70_001, (1 << 20) + 3, 8192, 333];
    const STREAMS: u64 = 2; // per direction
    const LEAD: u64 = 3; // first byte written at this offset of the region
    const GUARD: u64 = 64; // sentinel bytes checked before and after each region's range
    const SENTINEL: u8 = 0xEE;
    let per_stream: u64 = LENS.iter().sum();
    let slot = (per_stream + LEAD + 2 * GUARD).next_multiple_of(4096);
    let arena_len = (STREAMS as usize) * slot as usize * 2;
    let mesh = Mesh::<H>::new(2, arena_len, CALM_HEARTBEAT);
    // Stream s of sender `from` reads `[s * slot, +per_stream)` of its own arena and lands at
    // the receiver in `[base + GUARD + LEAD, +per_stream)`, base = (STREAMS + s) * slot.
    struct Plan {
        from: NodeId,
        to: NodeId,
        stream: u64,
        src: u64,
        region: RemoteRegion,
    }
    let mut plans = Vec::new();
    for from in 0..2 {
        let to = 1 - from;
        let (src_node, dst_node) = (mesh.node(from), mesh.node(to));
        for s in 0..STREAMS {
            let src = s * slot;
            fill(
                &src_node.arena,
                src,
                per_stream,
                1000 + from as u64 * 10 + s,
            );
            let base = (STREAMS + s) * slot;
            paint(&dst_node.arena, base, slot, SENTINEL);
            let region = dst_node
                .region(from, base + GUARD, LEAD + per_stream)
                .expect("region");
            plans.push(Plan {
                from,
                to,
                stream: 50 + from as u64 * 10 + s,
                src,
                region,
            });
        }
    }
    let writers: Vec<_> = plans
        .iter()
        .map(|p| {
            let t = mesh.node(p.from).t.clone();
            let (to, stream, src, region) = (p.to, p.stream, p.src, p.region);
            std::thread::spawn(move || {
                let mut done = 0;
                for len in LENS {
                    t.write(to, stream, src + done, &region, LEAD + done, len)
                        .unwrap_or_else(|e| panic!("write stream {stream}: {e}"));
                    done += len;
                }
            })
        })
        .collect();
    for to in 0..2 {
        let node = mesh.node(to);
        let mut cover: Vec<Coverage> = plans
            .iter()
            .filter(|p| p.to == to)
            .map(|p| Coverage::new(p.from, p.stream, LEAD, per_stream))
            .collect();
        while !cover.iter().all(Coverage::complete) {
            let ev = node.next(WAIT_LARGE, "data events");
            assert!(
                cover.iter_mut().any(|c| c.take(&ev)),
                "node {to}: unexpected event {ev:?}"
            );
        }
    }
    for w in writers {
        w.join().expect("writer");
    }
    for p in &plans {
        let (src, dst) = (mesh.node(p.from), mesh.node(p.to));
        let at = p.region.offset + LEAD;
        let what = format!("stream {}", p.stream);
        assert_same(&src.arena, p.src, &dst.arena, at, per_stream, &what);
        assert_untouched(&dst.arena, at - LEAD - GUARD, GUARD + LEAD, SENTINEL, &what);
        assert_untouched(&dst.arena, at + per_stream, GUARD, SENTINEL, &what);
    }
    for node in &mesh.nodes {
        node.nothing_queued("no data event beyond the written ranges");
    }
}

/// Small writes (1 byte up to 4 KiB, below any eager threshold) at unaligned offsets land
/// exactly: the bytes in place, their neighbours untouched, data events covering the range.
pub fn small_writes_land_exactly<H: Harness>() {
    const SIZES: [u64; 10] = [1, 2, 3, 7, 63, 64, 511, 1000, 4095, 4096];
    const SENTINEL: u8 = 0x5A;
    let mesh = Mesh::<H>::new(2, 1 << 20, CALM_HEARTBEAT);
    let (a, b) = (mesh.node(0), mesh.node(1));
    let s0 = (a.t.stats(), b.t.stats());
    let region = b.region(0, 8192, 512 << 10).expect("region");
    paint(&b.arena, 0, 1 << 20, SENTINEL);
    let mut at = 1; // offset inside the region, odd on purpose
    for (i, &len) in SIZES.iter().enumerate() {
        let src = 4096 * i as u64 + 13;
        fill(&a.arena, src, len, i as u64 + 7);
        a.t.write(1, i as u64, src, &region, at, len)
            .unwrap_or_else(|e| panic!("write of {len} bytes: {e}"));
        b.expect_data(0, i as u64, at, len, WAIT);
        let what = format!("write of {len} bytes");
        let dst = region.offset + at;
        assert_same(&a.arena, src, &b.arena, dst, len, &what);
        assert_untouched(&b.arena, dst - 1, 1, SENTINEL, &what);
        assert_untouched(&b.arena, dst + len, 1, SENTINEL, &what);
        at += len + 2;
    }
    let total: u64 = SIZES.iter().sum();
    let (da, db) = (delta(a.t.stats(), s0.0), delta(b.t.stats(), s0.1));
    assert_eq!(da.data_bytes_sent, total, "sender data_bytes_sent");
    assert_eq!(
        db.data_bytes_received, total,
        "receiver data_bytes_received"
    );
    assert_eq!(
        da.ctrl_sent + db.ctrl_received,
        0,
        "writes are not control messages"
    );
    b.nothing_queued("one set of events per write");
}

/// A write is delivered at once even when nothing follows it: sizes around 1 and 2 MiB (the
/// TCP epoll reader's per-turn budget is 1 MiB, and a frame completed as a turn's budget ran
/// out used to wait for the next bytes on its link), each written alone and awaited for far
/// less than the calm heartbeat's period. Not part of the shared suite (its deadline is for
/// a fast link); `tests/contract_tcp.rs` runs it on both TCP reading paths.
pub fn a_lone_write_is_delivered_without_traffic_behind_it<H: Harness>() {
    const QUICK: Duration = Duration::from_millis(900);
    let mesh = Mesh::<H>::new(2, 8 << 20, CALM_HEARTBEAT);
    let (a, b) = (mesh.node(0), mesh.node(1));
    let region = b.region(0, 0, 4 << 20).expect("region");
    let mut stream = 1000;
    for base in [1u64 << 20, 2 << 20] {
        for k in 0..24u64 {
            let len = base - 384 + k * 32;
            fill(&a.arena, 0, len, stream);
            a.t.write(1, stream, 0, &region, 0, len)
                .unwrap_or_else(|e| panic!("write of {len} bytes: {e}"));
            b.expect_data(0, stream, 0, len, QUICK);
            assert_same(&a.arena, 0, &b.arena, region.offset, len, "a lone write");
            stream += 1;
        }
    }
    b.nothing_queued("one set of events per write");
}

/// `write_nonblocking` either writes the whole range, in order with the writes and control
/// messages before and after it, or declines (Ok(false)) and nothing of it lands; a range
/// larger than the transport's frame may always be declined.
pub fn nonblocking_writes_land_in_order_or_not_at_all<H: Harness>() {
    const SENTINEL: u8 = 0x3C;
    let mesh = Mesh::<H>::new(2, 1 << 20, CALM_HEARTBEAT);
    let (a, b) = (mesh.node(0), mesh.node(1));
    let region = b.region(0, 4096, 512 << 10).expect("region");
    paint(&b.arena, 0, 1 << 20, SENTINEL);
    let mut at = 3;
    for (i, &len) in [1u64, 100, 4096, 16 << 10, 64 << 10].iter().enumerate() {
        let src = (96 << 10) * i as u64 + 5;
        fill(&a.arena, src, len, i as u64 + 31);
        // A blocking write, the non-blocking one, then a control message: in this order.
        a.t.write(1, 100 + i as u64, src, &region, at, 1)
            .expect("blocking write");
        let what = format!("non-blocking write of {len} bytes");
        let took =
            a.t.write_nonblocking(1, 200 + i as u64, src + 1, &region, at + 1, len)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
        a.t.send(1, &[i as u8]).expect("control message");
        b.expect_data(0, 100 + i as u64, at, 1, WAIT);
        if took {
            b.expect_data(0, 200 + i as u64, at + 1, len, WAIT);
            assert_same(
                &a.arena,
                src + 1,
                &b.arena,
                region.offset + at + 1,
                len,
                &what,
            );
        } else {
            assert_untouched(&b.arena, region.offset + at + 1, len, SENTINEL, &what);
        }
        b.expect_ctrl(0, &[i as u8]);
        b.nothing_queued(&what);
        at += len + 8;
    }
}

/// One large write (`PHALANX_CONTRACT_MAX_BYTES`, 64 MiB by default; many chunks) from an
/// unaligned source to an unaligned destination lands exactly, its data events in order and
/// contiguous, and the counters count its bytes once.
pub fn large_write_lands_exactly<H: Harness>() {
    const SENTINEL: u8 = 0xC3;
    let len = max_bytes() - 5;
    let arena_len = (len + (64 << 10)) as usize;
    let mesh = Mesh::<H>::new(2, arena_len, CALM_HEARTBEAT);
    let (a, b) = (mesh.node(0), mesh.node(1));
    let (src, base, at) = (4097u64, 8192u64, 7u64);
    fill(&a.arena, src, len, 99);
    paint(&b.arena, 0, arena_len as u64, SENTINEL);
    let region = b.region(0, base, at + len + 1).expect("region");
    let s0 = (a.t.stats(), b.t.stats());
    let t0 = Instant::now();
    let ta = a.t.clone();
    let w = std::thread::spawn(move || ta.write(1, 77, src, &region, at, len));
    let events = b.expect_data(0, 77, at, len, WAIT_LARGE);
    let secs = t0.elapsed().as_secs_f64();
    w.join().expect("writer").expect("large write");
    let what = format!("write of {len} bytes");
    assert_same(&a.arena, src, &b.arena, base + at, len, &what);
    assert_untouched(&b.arena, 0, base + at, SENTINEL, &what);
    let end = base + at + len;
    assert_untouched(&b.arena, end, arena_len as u64 - end, SENTINEL, &what);
    let (da, db) = (delta(a.t.stats(), s0.0), delta(b.t.stats(), s0.1));
    assert_eq!(da.data_bytes_sent, len, "sender data_bytes_sent");
    assert_eq!(db.data_bytes_received, len, "receiver data_bytes_received");
    b.nothing_queued("nothing after the last data event");
    println!(
        "{} {len} bytes: {events} data events, {:.1} MB/s",
        a.t.name(),
        len as f64 / secs / 1e6
    );
}

/// A control message of exactly `MAX_CTRL_LEN` bytes goes through (both ways); one byte more
/// is refused with `MessageTooLarge`, counts nothing and costs no link.
pub fn max_ctrl_len_is_the_limit<H: Harness>() {
    let mesh = Mesh::<H>::new(2, 1 << 20, CALM_HEARTBEAT);
    let s0: Vec<TransportStats> = mesh.nodes.iter().map(|n| n.t.stats()).collect();
    for from in 0..2 {
        let (src, dst) = (mesh.node(from), mesh.node(1 - from));
        let big = message(from, 1 - from, 1, MAX_CTRL_LEN);
        src.t
            .send(dst.id, &big)
            .expect("a message of MAX_CTRL_LEN bytes");
        dst.expect_ctrl(from, &big);
        let over = vec![7u8; MAX_CTRL_LEN + 1];
        match src.t.send(dst.id, &over) {
            Err(TransportError::MessageTooLarge { len, max }) => {
                assert_eq!((len, max), (MAX_CTRL_LEN + 1, MAX_CTRL_LEN))
            }
            other => panic!("send of MAX_CTRL_LEN + 1 bytes: {other:?}"),
        }
        match src.t.send_nonblocking(dst.id, &over) {
            Err(TransportError::MessageTooLarge { len, max }) => {
                assert_eq!((len, max), (MAX_CTRL_LEN + 1, MAX_CTRL_LEN))
            }
            Ok(false) => {} // the trait's default: nothing sent
            other => panic!("send_nonblocking of MAX_CTRL_LEN + 1 bytes: {other:?}"),
        }
        src.t
            .send(dst.id, b"still linked")
            .expect("send after a refusal");
        dst.expect_ctrl(from, b"still linked");
    }
    for (node, s) in mesh.nodes.iter().zip(s0) {
        let d = delta(node.t.stats(), s);
        assert_eq!(
            (d.ctrl_sent, d.ctrl_received),
            (2, 2),
            "node {}: {d:?}",
            node.id
        );
        assert_eq!(
            d.malformed_frames + d.peers_down,
            0,
            "node {}: {d:?}",
            node.id
        );
        assert!(
            node.t.is_connected(1 - node.id),
            "node {}: link kept",
            node.id
        );
        node.nothing_queued("no failure after a refused message");
    }
}

/// Invalid operations fail with their typed error, send nothing and cost no link: unknown
/// peer, ranges outside the arena or the region, a second arena, no arena at all.
pub fn invalid_operations_fail_with_typed_errors<H: Harness>() {
    let arena_len = 1u64 << 20;
    let mesh = Mesh::<H>::new(2, arena_len as usize, CALM_HEARTBEAT);
    let (a, b) = (mesh.node(0), mesh.node(1));
    let s0 = (a.t.stats(), b.t.stats());
    let region = b.region(0, 4096, 8192).expect("region");
    assert_eq!(
        (region.node, region.offset, region.len),
        (1, 4096, 8192),
        "the region names its node and range"
    );
    assert!(b.region(0, 0, arena_len).is_ok(), "the whole arena");
    let oob = |r: Result<(), TransportError>, what: &str| match r {
        Err(TransportError::OutOfBounds { .. }) => {}
        other => panic!("{what}: expected OutOfBounds, got {other:?}"),
    };
    oob(b.region(0, arena_len, 1).map(drop), "region past the arena");
    oob(
        b.region(0, 1, arena_len).map(drop),
        "region overlapping the end",
    );
    oob(b.region(0, u64::MAX, 2).map(drop), "region overflowing u64");
    oob(
        a.t.write(1, 1, 0, &region, 1, 8192),
        "write past the region's end",
    );
    oob(
        a.t.write(1, 1, 0, &region, 8192, 1),
        "write at the region's end",
    );
    oob(
        a.t.write(1, 1, arena_len - 10, &region, 0, 11),
        "source past the arena",
    );
    oob(
        a.t.write(1, 1, u64::MAX, &region, 0, 2),
        "source overflowing u64",
    );
    assert_gone(a.t.send(42, b"x"), 42, "send to an unknown peer");
    assert_gone(
        a.t.write(42, 1, 0, &region, 0, 1),
        42,
        "write to an unknown peer",
    );
    assert_gone_nonblocking(a.t.send_nonblocking(42, b"x"), 42);
    match a
        .t
        .register_arena(Arc::new(Arena::new(4096, false).expect("arena")))
    {
        Err(TransportError::ArenaAlreadyRegistered) => {}
        other => panic!("second register_arena: {other:?}"),
    }
    // Nothing went out: the next event at b is this message.
    a.t.send(1, b"after the errors").expect("send");
    b.expect_ctrl(0, b"after the errors");
    let (da, db) = (delta(a.t.stats(), s0.0), delta(b.t.stats(), s0.1));
    assert_eq!(
        da.data_bytes_sent + db.data_bytes_received,
        0,
        "no data moved"
    );
    assert_eq!((da.ctrl_sent, db.ctrl_received), (1, 1), "one message");
    assert_eq!(da.registrations + db.registrations, 0, "no registration");
    assert!(a.t.is_connected(1) && b.t.is_connected(0), "links kept");
    a.nothing_queued("failed operations send nothing");
    // A node without an arena has no region to hand out and nothing to write from.
    let lone = H::bind(7, CALM_HEARTBEAT).expect("bind");
    match lone.grant(0, 0, 1, Arc::new(())) {
        Err(TransportError::NoArena) => {}
        other => panic!("grant without an arena: {other:?}"),
    }
    match lone.write(0, 1, 0, &region, 0, 1) {
        Err(TransportError::NoArena) => {}
        other => panic!("write without an arena: {other:?}"),
    }
    lone.shutdown();
}

/// `send_nonblocking` interleaved with `send` from one thread: whatever it reports sent
/// arrives, in order with the blocking sends; what it reports not sent never arrives.
pub fn nonblocking_sends_keep_order<H: Harness>() {
    const N: u64 = 600;
    let mesh = Mesh::<H>::new(2, 1 << 20, CALM_HEARTBEAT);
    let (a, b) = (mesh.node(0), mesh.node(1));
    let s0 = a.t.stats();
    let mut sent = Vec::new();
    let mut nonblocking = 0;
    for i in 0..N {
        let m = message(0, 1, i, 16 + (i as usize * 97) % 3000);
        if i % 2 == 0 {
            a.t.send(1, &m).expect("send");
            sent.push(m);
        } else if a.t.send_nonblocking(1, &m).expect("send_nonblocking") {
            sent.push(m);
            nonblocking += 1;
        }
    }
    for m in &sent {
        b.expect_ctrl(0, m);
    }
    b.nothing_queued("a message reported not sent arrived");
    assert_eq!(
        delta(a.t.stats(), s0).ctrl_sent,
        sent.len() as u64,
        "ctrl_sent counts what was sent"
    );
    println!(
        "{}: {nonblocking} of {} non-blocking sends went out",
        a.t.name(),
        N / 2
    );
}

/// With an event handler installed, events go to it (in the same order a channel would give)
/// and no longer to `events()`; without handler support they keep coming through `events()`.
pub fn event_handler_sees_events_in_order<H: Harness>() {
    let mut mesh = Mesh::<H>::new(2, 4 << 20, CALM_HEARTBEAT);
    let old_channel = mesh.nodes[1].events.clone();
    let taken = mesh.nodes[1].use_handler();
    let (a, b) = (mesh.node(0), mesh.node(1));
    let region = b.region(0, 0, 4 << 20).expect("region");
    for r in 0..20u64 {
        let len = [3u64, 5000, 300_000][r as usize % 3];
        let src = r * 200_000 % (2 << 20);
        let dst = r * (100 << 10);
        fill(&a.arena, src, len, r);
        a.t.write(1, r, src, &region, dst, len).expect("write");
        a.t.send(1, &message(0, 1, r, 40)).expect("send");
        b.expect_data(0, r, dst, len, WAIT);
        b.expect_ctrl(0, &message(0, 1, r, 40));
        assert_same(&a.arena, src, &b.arena, dst, len, &format!("write {r}"));
    }
    if taken {
        assert!(
            old_channel.try_recv().is_err(),
            "events went to the handler, not to events()"
        );
    }
    b.nothing_queued("one event per transfer");
}

/// Every write is checked against the receiver's grants before a byte lands: a write from a
/// peer the range was not granted to, a write outside the granted range (a forged region), and
/// a write after the grant was revoked each change no byte of the arena, are counted as
/// malformed and drop the link that carried them; a granted write still lands. (Small writes:
/// on verbs they ride the eager blocks, which the receiver copies in after the check.)
pub fn writes_outside_a_grant_change_nothing_and_drop_the_link<H: Harness>() {
    outside_a_grant::<H>(1000, 1 << 20);
}

/// The same with writes large enough for the zero-copy path (on verbs, RDMA writes the NIC
/// lands itself: it refuses them unless they fall inside the memory window the grant bound
/// on the grantee's own connection). A write the NIC refuses may fail at its sender and
/// never reaches the receiver's software, so it need not be counted as malformed there.
pub fn large_writes_outside_a_grant_change_nothing_and_drop_the_link<H: Harness>() {
    outside_a_grant::<H>(256 << 10, 4 << 20);
}

fn outside_a_grant<H: Harness>(len: u64, arena_len: u64) {
    const SENTINEL: u8 = 0xA7;
    const AT: u64 = 64 << 10;
    let large = len >= 64 << 10;
    let mesh = Mesh::<H>::new(3, arena_len as usize, CALM_HEARTBEAT);
    let (a, b, c) = (mesh.node(0), mesh.node(1), mesh.node(2));
    fill(&a.arena, 0, len, 41);
    fill(&c.arena, 0, len, 43);
    paint(&b.arena, 0, arena_len, SENTINEL);
    let s0 = b.t.stats();
    let granted = b.region(0, AT, 2 * len).expect("region");
    // The grantee's write lands.
    a.t.write(1, 1, 0, &granted, 0, len).expect("granted write");
    b.expect_data(0, 1, 0, len, WAIT);
    assert_same(&a.arena, 0, &b.arena, AT, len, "granted write");
    // Another peer writing into that range (with the grantee's key): refused, its link
    // dropped. A refusal by the NIC may show at the sender as a failed write.
    let r = c.t.write(1, 2, 0, &granted, len, len);
    assert!(large || r.is_ok(), "a small write leaves node 2: {r:?}");
    b.expect_down_among_ups(2, WAIT);
    // The grantee writing outside its range through a forged region (offset and address
    // moved together, as a peer that wants to land there would).
    let moved = arena_len / 2 - AT;
    let forged = RemoteRegion {
        offset: granted.offset + moved,
        addr: if granted.addr == 0 {
            0
        } else {
            granted.addr + moved
        },
        ..granted
    };
    let r = a.t.write(1, 3, 0, &forged, 0, len);
    assert!(large || r.is_ok(), "a small write leaves node 0: {r:?}");
    b.expect_down_among_ups(0, WAIT);
    let check = |what: &str| {
        assert_same(&a.arena, 0, &b.arena, AT, len, what);
        assert_untouched(&b.arena, 0, AT, SENTINEL, what);
        assert_untouched(&b.arena, AT + len, arena_len - AT - len, SENTINEL, what);
    };
    check("after the refused writes");
    let d = delta(b.t.stats(), s0);
    if large {
        assert!(
            d.malformed_frames <= 2,
            "at most one count per refused write"
        );
    } else {
        assert_eq!(d.malformed_frames, 2, "each refused write counted once");
    }
    assert_eq!(
        d.data_bytes_received, len,
        "only the granted bytes were received"
    );
    drop(mesh);

    // A revoked grant: a later write into it is refused the same way.
    let mesh = Mesh::<H>::new(2, arena_len as usize, CALM_HEARTBEAT);
    let (a, b) = (mesh.node(0), mesh.node(1));
    fill(&a.arena, 0, len, 47);
    paint(&b.arena, 0, arena_len, SENTINEL);
    let region = b.region(0, 2 * AT, len).expect("region");
    b.t.revoke(0, &region);
    let r = a.t.write(1, 4, 0, &region, 0, len);
    assert!(large || r.is_ok(), "a small write leaves node 0: {r:?}");
    b.expect_down_among_ups(0, WAIT);
    assert_untouched(
        &b.arena,
        0,
        arena_len,
        SENTINEL,
        "after a write into a revoked grant",
    );
}
