use super::*;
use crate::auth::{AuthError, Status};
use crate::{Event, EventHandler, TransportError, TransportStats, PEER_LEFT};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A link that only records what the table did to it.
struct TestLink {
    state: LinkState,
    stops: AtomicU32,
    wakes: AtomicU32,
}

impl TestLink {
    fn new(peer: NodeId) -> Arc<TestLink> {
        Arc::new(TestLink {
            state: LinkState::new(peer),
            stops: AtomicU32::new(0),
            wakes: AtomicU32::new(0),
        })
    }
}

impl Link for TestLink {
    fn state(&self) -> &LinkState {
        &self.state
    }
    fn stop(&self) {
        self.stops.fetch_add(1, Ordering::Relaxed);
    }
    fn wake(&self) {
        self.wakes.fetch_add(1, Ordering::Relaxed);
    }
}

fn table() -> LinkTable<TestLink> {
    LinkTable::new(0, "127.0.0.1:9".parse().unwrap(), "link")
}

fn events(t: &LinkTable<TestLink>) -> Vec<Event> {
    t.events.receiver().try_iter().collect()
}

#[test]
fn install_then_lookup() {
    let t = table();
    assert!(matches!(t.get(1), Err(TransportError::PeerUnavailable(1))));
    let a = TestLink::new(1);
    assert!(t.install(a.clone()).is_none());
    assert!(Arc::ptr_eq(&t.get(1).unwrap(), &a));
    assert!(t.contains(1) && !t.contains(2));
    assert_eq!(t.snapshot().len(), 1);
    assert!(events(&t).is_empty(), "installing emits nothing by itself");
}

#[test]
fn install_replaces_and_shuts_the_old_link_silently() {
    let t = table();
    let old = TestLink::new(1);
    let new = TestLink::new(1);
    t.install(old.clone());
    let replaced = t.install(new.clone()).expect("old link returned");
    assert!(Arc::ptr_eq(&replaced, &old));
    assert!(old.is_failed());
    assert_eq!(old.stops.load(Ordering::Relaxed), 1);
    assert_eq!(old.wakes.load(Ordering::Relaxed), 1);
    assert!(!new.is_failed());
    assert!(Arc::ptr_eq(&t.get(1).unwrap(), &new));
    // Failing the replaced link later (its reader noticing) reports nothing.
    assert!(!t.fail(&old, "reset".into()));
    assert!(events(&t).is_empty());
    assert_eq!(t.counters.stats().peers_down, 0);
    assert!(t.contains(1));
}

#[test]
fn fail_acts_once_and_reports_peer_down_once() {
    let t = table();
    let a = TestLink::new(3);
    t.install(a.clone());
    assert!(t.fail(&a, "send failed: broken pipe".into()));
    assert!(!t.fail(&a, "heartbeat failed".into()));
    assert!(!t.fail(&a, PEER_LEFT.into()));
    assert_eq!(a.stops.load(Ordering::Relaxed), 1);
    assert_eq!(a.wakes.load(Ordering::Relaxed), 1);
    assert_eq!(
        events(&t),
        vec![Event::PeerDown {
            peer: 3,
            reason: "send failed: broken pipe".into()
        }]
    );
    assert_eq!(t.counters.stats().peers_down, 1);
}

#[test]
fn goodbye_reports_peer_left() {
    let t = table();
    let a = TestLink::new(2);
    t.install(a.clone());
    t.fail(&a, PEER_LEFT.into());
    assert_eq!(
        events(&t),
        vec![Event::PeerDown {
            peer: 2,
            reason: PEER_LEFT.into()
        }]
    );
}

#[test]
fn lookup_of_a_failed_link_errors() {
    let t = table();
    let a = TestLink::new(1);
    t.install(a.clone());
    t.fail(&a, "reset".into());
    assert!(matches!(t.get(1), Err(TransportError::PeerUnavailable(1))));
    assert!(!t.contains(1));
    // A new link (the peer rejoined) is found again.
    let b = TestLink::new(1);
    t.install(b.clone());
    assert!(Arc::ptr_eq(&t.get(1).unwrap(), &b));
}

#[test]
fn no_peer_down_while_leaving_and_lookups_fail_once_closed() {
    let t = table();
    let (a, b) = (TestLink::new(1), TestLink::new(2));
    t.install(a.clone());
    t.install(b.clone());
    assert!(t.leave());
    assert!(!t.leave());
    assert!(t.fail(&a, "reset".into()));
    assert!(events(&t).is_empty());
    assert!(!t.is_closing());
    let rest = t.close().expect("first close returns the links");
    assert_eq!(rest.len(), 1);
    assert!(Arc::ptr_eq(&rest[0], &b));
    assert!(t.close().is_none());
    assert!(t.is_closing());
    assert!(matches!(t.get(2), Err(TransportError::Shutdown)));
}

#[test]
fn close_without_leave_suppresses_reports() {
    let t = table();
    let a = TestLink::new(1);
    t.install(a.clone());
    let links = t.close().unwrap();
    assert!(t.fail(&links[0], "reset".into()));
    assert!(events(&t).is_empty());
    assert_eq!(t.counters.stats(), TransportStats::default());
}

#[test]
fn handler_gets_queued_events_first_then_new_ones() {
    let t = table();
    t.emit(Event::PeerUp { peer: 1 });
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    let h: EventHandler = Arc::new(move |ev| s.lock().unwrap().push(ev));
    assert!(t.events.set_handler(h.clone()));
    assert!(!t.events.set_handler(h), "the first handler stays");
    t.report_down(1, "x".into());
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            Event::PeerUp { peer: 1 },
            Event::PeerDown {
                peer: 1,
                reason: "x".into()
            }
        ]
    );
    assert!(events(&t).is_empty());
}

#[test]
fn counters_convert_to_stats() {
    let t = table();
    let c = &t.counters;
    c.ctrl_sent.fetch_add(1, Ordering::Relaxed);
    c.ctrl_received.fetch_add(2, Ordering::Relaxed);
    c.data_bytes_sent.fetch_add(3, Ordering::Relaxed);
    c.data_bytes_received.fetch_add(4, Ordering::Relaxed);
    c.payload_bytes_copied.fetch_add(5, Ordering::Relaxed);
    c.registrations.fetch_add(6, Ordering::Relaxed);
    c.peers_down.fetch_add(7, Ordering::Relaxed);
    c.malformed_frames.fetch_add(8, Ordering::Relaxed);
    c.hellos_refused.fetch_add(9, Ordering::Relaxed);
    c.grant_registrations.fetch_add(10, Ordering::Relaxed);
    assert_eq!(
        c.stats(),
        TransportStats {
            ctrl_sent: 1,
            ctrl_received: 2,
            data_bytes_sent: 3,
            data_bytes_received: 4,
            payload_bytes_copied: 5,
            registrations: 6,
            peers_down: 7,
            malformed_frames: 8,
            hellos_refused: 9,
            grant_registrations: 10,
        }
    );
}

#[test]
fn mesh_waits_for_higher_peers_and_times_out() {
    let t = Arc::new(table());
    let peers: Vec<(NodeId, SocketAddr)> = vec![
        (0, "127.0.0.1:1".parse().unwrap()),
        (1, "127.0.0.1:2".parse().unwrap()),
    ];
    let late = t.clone();
    let h = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        late.install(TestLink::new(1));
    });
    let never = |_: NodeId, _: SocketAddr, _: Instant| -> Result<(), TransportError> {
        panic!("node 0 dials nobody")
    };
    t.connect_mesh(&peers, false, Duration::from_secs(10), never)
        .unwrap();
    h.join().unwrap();
    let more = [(0, peers[0].1), (2, peers[1].1)];
    let err = t.connect_mesh(&more, false, Duration::from_millis(20), never);
    assert!(matches!(err, Err(TransportError::Setup(_))));
}

#[test]
fn dial_gives_up_at_the_deadline_and_on_shutdown() {
    let t = table();
    // A port nobody listens on: bind one, then free it.
    let addr = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let err = t.dial_stream(1, addr, Instant::now());
    assert!(matches!(err, Err(TransportError::Setup(_))));
    t.close();
    let err = t.dial_stream(1, addr, Instant::now() + Duration::from_secs(5));
    assert!(matches!(err, Err(TransportError::Shutdown)));
}

/// A table of node `node` whose listener is `listener`'s, with a secret and 3 members.
fn listening(node: NodeId, listener: &TcpListener) -> Arc<LinkTable<TestLink>> {
    let auth = AuthConfig {
        secret: Some(crate::ClusterSecret::parse("a secret for the link table tests").unwrap()),
        members: Some(3),
        handshake_timeout: Duration::from_secs(2),
    };
    let addr = listener.local_addr().unwrap();
    Arc::new(LinkTable::new(node, addr, "link").with_auth(
        auth,
        Channel::Tcp,
        Duration::from_millis(100),
    ))
}

/// Runs `t`'s accept loop on `listener`; the handshake reports the admitted peer on the
/// channel returned and answers with `answer`.
fn serve(
    t: &Arc<LinkTable<TestLink>>,
    listener: TcpListener,
    answer: fn(NodeId) -> Result<(), TransportError>,
) -> (
    crossbeam_channel::Receiver<NodeId>,
    std::thread::JoinHandle<()>,
) {
    let (tx, rx) = crossbeam_channel::unbounded();
    let acc = t.clone();
    let h = std::thread::spawn(move || {
        acc.accept_loop(listener, "test-hello", "setup failed", move |_s, peer| {
            tx.send(peer).unwrap();
            answer(peer)
        })
    });
    (rx, h)
}

fn wait_for(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn accept_loop_hands_streams_over_and_ends_when_woken() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let t = listening(0, &listener);
    let (rx, h) = serve(&t, listener, |_| {
        Err(TransportError::Malformed("garbage".into()))
    });
    let dialler = listening(1, &TcpListener::bind("127.0.0.1:0").unwrap());
    let _c = dialler
        .dial_stream(0, addr, Instant::now() + Duration::from_secs(5))
        .unwrap();
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), 1);
    // The failed handshake counts as a malformed frame (on the handshake's thread).
    wait_for("malformed count", || {
        t.counters.stats().malformed_frames == 1
    });
    assert_eq!(t.counters.stats().hellos_refused, 0);
    t.close();
    t.wake_accept_loop();
    h.join().unwrap();
}

#[test]
fn garbage_and_strangers_are_refused_and_counted() {
    use std::io::{Read, Write};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let t = listening(0, &listener);
    let (rx, h) = serve(&t, listener, |_| Ok(()));
    // Garbage: refused, counted as refused and malformed, connection closed.
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(&[0xde; 64]).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    wait_for("garbage refused", || t.counters.stats().hellos_refused == 1);
    assert_eq!(t.counters.stats().malformed_frames, 1);
    // Another secret: the dialler finds the acceptor's proof wrong and hangs up.
    let stranger = Arc::new(LinkTable::<TestLink>::new(1, addr, "link").with_auth(
        AuthConfig {
            secret: Some(crate::ClusterSecret::parse("not the secret of this cluster").unwrap()),
            ..AuthConfig::default()
        },
        Channel::Tcp,
        Duration::from_millis(100),
    ));
    let err = stranger.dial_stream(0, addr, Instant::now() + Duration::from_secs(5));
    assert!(
        matches!(err, Err(TransportError::Auth(AuthError::BadProof))),
        "{err:?}"
    );
    wait_for("stranger refused", || {
        t.counters.stats().hellos_refused == 2
    });
    // Not a member (3 nodes): refused for good, at once.
    let outsider = listening(7, &TcpListener::bind("127.0.0.1:0").unwrap());
    let err = outsider.dial_stream(0, addr, Instant::now() + Duration::from_secs(5));
    assert!(
        matches!(
            err,
            Err(TransportError::Auth(AuthError::Refused(Status::NotMember)))
        ),
        "{err:?}"
    );
    wait_for("outsider refused", || {
        t.counters.stats().hellos_refused == 3
    });
    assert!(rx.try_recv().is_err(), "nobody was handed over");
    t.close();
    t.wake_accept_loop();
    h.join().unwrap();
}

#[test]
fn a_live_link_is_not_replaced_until_it_is_dead() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let t = listening(0, &listener);
    let (rx, h) = serve(&t, listener, |_| Ok(()));
    let live = TestLink::new(1);
    t.install(live.clone());
    // Node 1 dials again while its link is live: refused as busy after the wait (2 x 100 ms
    // heartbeat), retried until the dial's deadline, then given up.
    let dialler = listening(1, &TcpListener::bind("127.0.0.1:0").unwrap());
    let err = dialler.dial_stream(0, addr, Instant::now() + Duration::from_millis(400));
    assert!(matches!(err, Err(TransportError::Setup(_))), "{err:?}");
    assert!(t.counters.stats().hellos_refused >= 1);
    assert!(
        Arc::ptr_eq(&t.get(1).unwrap(), &live),
        "the live link stays"
    );
    assert!(!live.is_failed());
    assert!(rx.try_recv().is_err());
    // Once the old link is detected dead (here: failed while the new dial waits), the
    // newcomer is admitted.
    let failer = t.clone();
    let old = live.clone();
    let f = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        failer.fail(&old, "no heartbeat".into());
    });
    dialler
        .dial_stream(0, addr, Instant::now() + Duration::from_secs(5))
        .unwrap();
    f.join().unwrap();
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), 1);
    t.close();
    t.wake_accept_loop();
    h.join().unwrap();
}
