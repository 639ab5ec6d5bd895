//! The transport contract suite (`phalanx_transport::contract`) on the TCP transport, over
//! loopback with OS-assigned ports.

use phalanx_transport::contract::Harness;
use phalanx_transport::{
    AuthConfig, ClusterSecret, NodeId, TcpConfig, TcpTransport, TransportError,
};
use std::net::SocketAddr;
use std::time::Duration;

/// The heartbeat timeout of the suite's nodes.
const HEARTBEAT: Duration = Duration::from_millis(300);

/// The suite's settings: every node knows the secret (the authenticated setup path).
fn config(heartbeat: Duration) -> TcpConfig {
    TcpConfig {
        heartbeat_timeout: heartbeat,
        auth: AuthConfig {
            secret: Some(ClusterSecret::parse("the TCP contract suite's secret").unwrap()),
            ..AuthConfig::default()
        },
        ..TcpConfig::default()
    }
}

fn bind_with(id: NodeId, cfg: TcpConfig) -> Result<TcpTransport, TransportError> {
    TcpTransport::bind(id, "127.0.0.1:0".parse().expect("address"), cfg)
}

/// Defines harness `$harness`, TCP nodes made with the settings `$cfg` (a function of the
/// heartbeat timeout), and runs the whole suite on it.
macro_rules! suite_with {
    ($harness:ident, $cfg:expr) => {
        struct $harness;

        impl Harness for $harness {
            type T = TcpTransport;

            fn heartbeat() -> Duration {
                HEARTBEAT
            }

            fn bind(id: NodeId, heartbeat: Duration) -> Result<TcpTransport, TransportError> {
                let make: fn(Duration) -> TcpConfig = $cfg;
                bind_with(id, make(heartbeat))
            }

            fn connect(
                t: &TcpTransport,
                peers: &[(NodeId, SocketAddr)],
                dial_all: bool,
            ) -> Result<(), TransportError> {
                t.connect(peers, dial_all)
            }
        }

        phalanx_transport::transport_contract_tests!($harness);

        #[test]
        fn a_lone_write_is_delivered_without_traffic_behind_it() {
            phalanx_transport::contract::a_lone_write_is_delivered_without_traffic_behind_it::<
                $harness,
            >();
        }
    };
}

/// Links read by threads of their own (the default for up to
/// `TcpConfig::dedicated_readers` links).
mod own_readers {
    use super::*;

    suite_with!(Tcp, config);
}

/// The same suite with every link read by the shared epoll threads (no link has a thread of
/// its own), two of them: the reading path of a node with more links than
/// `TcpConfig::dedicated_readers`.
mod shared_readers {
    use super::*;

    suite_with!(TcpShared, |heartbeat| TcpConfig {
        dedicated_readers: 0,
        readers: 2,
        ..config(heartbeat)
    });
}

/// The suite with readers that poll (`TcpConfig::polling`): one epoll thread per node that
/// keeps looking for frames for a while after each one. Every case must hold as with
/// sleeping readers; and a polling reader must go to sleep once its links are quiet.
mod polling_readers {
    use super::*;
    use phalanx_transport::{Event, Transport};
    use std::time::Instant;

    const SPIN: Duration = Duration::from_micros(500);

    suite_with!(TcpPolling, |heartbeat| config(heartbeat).polling(SPIN, 1));

    /// CPU time (clock ticks) of this process's threads named `name`.
    fn ticks_of(name: &str) -> u64 {
        let mut total = 0;
        for task in std::fs::read_dir("/proc/self/task").expect("/proc/self/task") {
            let dir = task.expect("task").path();
            let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
            if comm.trim() != name {
                continue;
            }
            let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
            // Fields after the command's closing parenthesis: state is the 3rd field of the
            // line, utime and stime the 14th and 15th.
            let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
            let f: Vec<u64> = rest
                .split_whitespace()
                .skip(11)
                .take(2)
                .filter_map(|v| v.parse().ok())
                .collect();
            total += f.iter().sum::<u64>();
        }
        total
    }

    fn thread_named(name: &str) -> bool {
        std::fs::read_dir("/proc/self/task")
            .expect("/proc/self/task")
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .any(|c| c.trim() == name)
    }

    /// Node ids no other test of this binary uses: the reader threads are told apart by name.
    const A: NodeId = 7301;
    const B: NodeId = 7302;

    /// A polling reader reads a burst of messages, each one answered, then sleeps: over half
    /// a second of quiet its thread takes (nearly) no CPU, where one that never stopped
    /// polling would take a core's worth (or whatever share of it it gets).
    #[test]
    fn a_polling_reader_sleeps_once_its_links_are_quiet() {
        let cfg = config(Duration::from_secs(5)).polling(SPIN, 1);
        let a = bind_with(A, cfg.clone()).expect("bind a");
        let b = bind_with(B, cfg).expect("bind b");
        let peers = vec![
            (A, a.listen_addr().expect("address")),
            (B, b.listen_addr().expect("address")),
        ];
        let (ea, eb) = (a.events(), b.events());
        let (a2, p2) = (a.clone(), peers.clone());
        let linking = std::thread::spawn(move || a2.connect(&p2, false));
        b.connect(&peers, false).expect("connect b");
        linking.join().expect("thread").expect("connect a");
        let next_ctrl = |events: &crossbeam_channel::Receiver<Event>| loop {
            match events.recv_timeout(Duration::from_secs(30)).expect("event") {
                Event::Ctrl { msg, .. } => return msg,
                Event::PeerUp { .. } => continue,
                other => panic!("unexpected event {other:?}"),
            }
        };
        for i in 0..200u32 {
            a.send(B, &i.to_le_bytes()).expect("send to b");
            assert_eq!(next_ctrl(&eb), i.to_le_bytes());
            b.send(A, &(i + 1).to_le_bytes()).expect("send to a");
            assert_eq!(next_ctrl(&ea), (i + 1).to_le_bytes());
        }
        // Past the spin, then measured over half a second of quiet.
        std::thread::sleep(Duration::from_millis(100));
        let names = [format!("phx-rx0-{A}"), format!("phx-rx0-{B}")];
        for n in &names {
            assert!(thread_named(n), "no reader thread {n}");
        }
        let before: u64 = names.iter().map(|n| ticks_of(n)).sum();
        let t0 = Instant::now();
        std::thread::sleep(Duration::from_millis(500));
        let after: u64 = names.iter().map(|n| ticks_of(n)).sum();
        let tick_hz = 100.0; // USER_HZ on Linux
        let busy = (after - before) as f64 / tick_hz;
        // A tenth of the time, for the two of them: a reader still polling takes it all
        // (yielding, but to nobody on an idle core).
        assert!(
            busy < 0.1 * t0.elapsed().as_secs_f64(),
            "the two quiet readers took {busy:.3} s of CPU in {:?}",
            t0.elapsed()
        );
        a.shutdown();
        b.shutdown();
    }

    const E: NodeId = 7305;
    const F: NodeId = 7306;

    /// With `poll_spin` set, a link never gets a reader of its own (its blocking `recv` could
    /// not poll), whatever `dedicated_readers` says: the node's one epoll reader reads it.
    #[test]
    fn polling_nodes_read_every_link_on_their_epoll_readers() {
        let cfg = TcpConfig {
            poll_spin: SPIN,
            dedicated_readers: 8,
            readers: 1,
            ..config(Duration::from_secs(5))
        };
        let e = bind_with(E, cfg.clone()).expect("bind e");
        let f = bind_with(F, cfg).expect("bind f");
        let ef = f.events();
        let peers = vec![
            (E, e.listen_addr().expect("address")),
            (F, f.listen_addr().expect("address")),
        ];
        let (e2, p2) = (e.clone(), peers.clone());
        let linking = std::thread::spawn(move || e2.connect(&p2, false));
        f.connect(&peers, false).expect("connect f");
        linking.join().expect("thread").expect("connect e");
        e.send(F, b"over the epoll reader").expect("send");
        let got = loop {
            match ef.recv_timeout(Duration::from_secs(30)).expect("event") {
                Event::Ctrl { msg, .. } => break msg,
                Event::PeerUp { .. } => continue,
                other => panic!("unexpected event {other:?}"),
            }
        };
        assert_eq!(got, b"over the epoll reader");
        for node in [E, F] {
            let rx = phalanx_transport::threads::roles(node)
                .into_iter()
                .find(|(role, _)| role == "rx")
                .map(|(_, c)| c.live);
            assert_eq!(rx, Some(1), "node {node}: reader threads");
        }
        e.shutdown();
        f.shutdown();
    }

    const C: NodeId = 7303;
    const D: NodeId = 7304;

    fn woken(t: &TcpTransport) -> u64 {
        t.link_counts().expect("TCP counts its links").readers_woken
    }

    /// A frame sent to a peer while the reader of that peer's link sleeps wakes the reader
    /// (once), so that the answer finds it polling; while it polls, sends wake nobody.
    #[test]
    fn a_send_wakes_the_sleeping_reader_of_its_peer_once() {
        // A long spin: a test thread held up between two sends still finds the reader polling.
        let spin = Duration::from_millis(300);
        let cfg = config(Duration::from_secs(5)).polling(spin, 1);
        let c = bind_with(C, cfg.clone()).expect("bind c");
        let d = bind_with(D, cfg).expect("bind d");
        let peers = vec![
            (C, c.listen_addr().expect("address")),
            (D, d.listen_addr().expect("address")),
        ];
        let ed = d.events();
        let (c2, p2) = (c.clone(), peers.clone());
        let linking = std::thread::spawn(move || c2.connect(&p2, false));
        d.connect(&peers, false).expect("connect d");
        linking.join().expect("thread").expect("connect c");
        let delivered = |i: u8| loop {
            match ed.recv_timeout(Duration::from_secs(30)).expect("event") {
                Event::Ctrl { msg, .. } => return assert_eq!(msg, [i]),
                Event::PeerUp { .. } => continue,
                other => panic!("unexpected event {other:?}"),
            }
        };
        for round in 0..3u8 {
            // Quiet for longer than the spin: c's reader sleeps.
            std::thread::sleep(spin * 2);
            let before = woken(&c);
            c.send(D, &[2 * round]).expect("send");
            assert_eq!(
                woken(&c),
                before + 1,
                "round {round}: the sleeping reader woken"
            );
            // Polling now (for the spin): the next send wakes nobody.
            c.send(D, &[2 * round + 1]).expect("send");
            assert_eq!(woken(&c), before + 1, "round {round}: woken twice");
            delivered(2 * round);
            delivered(2 * round + 1);
        }
        c.shutdown();
        d.shutdown();
    }
}
