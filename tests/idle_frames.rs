//! The `Idle` frame (a peer closing a link it made on demand) from a member: on a mesh it is
//! malformed and drops the link; on demand the node closes that link quietly (no peer
//! reported down) and links again on the next use.

#[allow(dead_code)] // the helper's other uses are for other tests
#[path = "common/member.rs"]
mod member;

use member::{config, start_pair, Member};
use phalanx::transport::FrameKind;
use std::time::{Duration, Instant};

fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn an_idle_frame_on_a_mesh_link_is_malformed() {
    let cfg = config(3, "connect = \"mesh\"");
    let (n0, _n1) = start_pair(&cfg);
    let addr = cfg.addr_of(0).unwrap();
    let mut m = Member::join(addr, 2, 0, 3, 1 << 20);
    wait_for("member linked", || n0.transport().is_connected(2));
    let malformed = n0.transport_stats().malformed_frames;
    m.send_frame(FrameKind::Idle);
    wait_for("link dropped", || !n0.transport().is_connected(2));
    wait_for("counted malformed", || {
        n0.transport_stats().malformed_frames == malformed + 1
    });
    wait_for("member sees the end", || m.closed());
}

#[test]
fn an_idle_frame_on_demand_closes_the_link_quietly() {
    // Member 5 of 8: node 0 dials neither it nor any of the absent nodes it might be for a
    // while (its ring, 1, 2, 6 and 7, and the nodes its news of being alive goes to, 4, 2
    // and 1): a hello from a node being dialled would be refused as busy (a crossed dial).
    let cfg = config(8, "connect = \"on_demand\"");
    let (n0, n1) = start_pair(&cfg);
    let addr = cfg.addr_of(0).unwrap();
    let mut m = Member::join(addr, 5, 0, 8, 1 << 20);
    wait_for("member linked", || n0.transport().is_connected(5));
    let before = n0.transport_stats();
    m.send_frame(FrameKind::Idle);
    wait_for("member sees the end", || m.closed());
    assert!(!n0.transport().is_connected(5));
    assert!(
        n0.transport().is_up(5),
        "an idle close reported the peer down"
    );
    let after = n0.transport_stats();
    assert_eq!(after.peers_down, before.peers_down);
    assert_eq!(after.malformed_frames, before.malformed_frames);
    // The node still works with its other peer.
    n0.put("after-idle", &[7u8; 100_000]).unwrap();
    assert_eq!(n1.get("after-idle").unwrap(), vec![7u8; 100_000]);
}
