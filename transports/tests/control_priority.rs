//! A control message sent while another thread streams data to the same peer goes out behind
//! the frame being written, not behind the whole stream (`Inner::queue_behind_writer`): a
//! request or an answer never waits for megabytes of someone else's bulk transfer.

use phalanx_transport::{
    Arena, AuthConfig, ClusterSecret, Event, TcpConfig, TcpTransport, Transport,
};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes each of the stream's writes carries, and how many writes there are.
const WRITE: u64 = 16 << 20;
const WRITES: u64 = 16;

fn node(id: u32) -> TcpTransport {
    let cfg = TcpConfig {
        auth: AuthConfig {
            secret: Some(ClusterSecret::parse("the control priority test's secret").unwrap()),
            ..AuthConfig::default()
        },
        ..TcpConfig::default()
    };
    let t = TcpTransport::bind(id, "127.0.0.1:0".parse().unwrap(), cfg).unwrap();
    t.register_arena(Arc::new(Arena::new(WRITE as usize, false).unwrap()))
        .unwrap();
    t
}

#[test]
fn a_control_message_overtakes_a_stream_to_the_same_peer() {
    let (a, b) = (node(0), node(1));
    let peers: Vec<(u32, SocketAddr)> =
        vec![(0, a.listen_addr().unwrap()), (1, b.listen_addr().unwrap())];
    std::thread::scope(|s| {
        let p = &peers;
        let ha = s.spawn(|| a.connect(p, false));
        let hb = s.spawn(|| b.connect(p, false));
        ha.join().unwrap().unwrap();
        hb.join().unwrap().unwrap();
    });
    let region = b.grant(0, 0, WRITE, Arc::new(())).unwrap();
    let events = b.events();
    let total = WRITE * WRITES;
    // Pings sent every 32 MiB landed: what had landed when each was sent, and how much
    // landed between its sending and its arrival.
    let mut sent: Vec<u64> = Vec::new();
    let mut behind: Vec<u64> = Vec::new();
    let mut landed = 0u64;
    let mut slowest = Duration::ZERO;
    std::thread::scope(|s| {
        // Node 0 streams 256 MiB into node 1's arena, 1 MiB frame after frame.
        let writer = s.spawn(|| {
            for _ in 0..WRITES {
                a.write(1, 7, 0, &region, 0, WRITE).unwrap();
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        while landed < total || behind.len() < sent.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            match events.recv_timeout(left).expect("the stream stalled") {
                Event::Data { len, .. } => {
                    landed += len;
                    let due = (landed / (32 << 20)) as usize;
                    if landed < total - (32 << 20) && due > sent.len() {
                        // A control message from another thread than the stream's.
                        let t = Instant::now();
                        a.send(1, &[sent.len() as u8]).unwrap();
                        slowest = slowest.max(t.elapsed());
                        sent.push(landed);
                    }
                }
                Event::Ctrl { msg, .. } => {
                    assert_eq!(msg, [behind.len() as u8], "pings in order");
                    behind.push(landed - sent[behind.len()]);
                }
                Event::PeerUp { .. } => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        writer.join().unwrap();
    });
    println!("pings sent after {sent:?} bytes had landed came behind {behind:?} more");
    assert!(sent.len() >= 5, "{} pings", sent.len());
    // Each came behind what was in the sockets and the frame being written, a few MiB, not
    // behind the stream (without the queue: up to 200 MiB of these 256, for one in two).
    for (k, b) in behind.iter().enumerate() {
        assert!(
            *b <= 16 << 20,
            "ping {k}, sent after {} bytes had landed, came behind {b} more",
            sent[k]
        );
    }
    assert!(slowest < Duration::from_secs(1), "a send took {slowest:?}");
}
