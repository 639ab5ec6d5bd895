//! The transport contract suite (`phalanx_transport::contract`) on the TCP transport, over
//! loopback with OS-assigned ports.

use phalanx_transport::contract::Harness;
use phalanx_transport::{
    AuthConfig, ClusterSecret, NodeId, TcpConfig, TcpTransport, TransportError,
};
use std::net::SocketAddr;
use std::time::Duration;

struct Tcp;

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

impl Harness for Tcp {
    type T = TcpTransport;

    fn heartbeat() -> Duration {
        Duration::from_millis(300)
    }

    fn bind(id: NodeId, heartbeat: Duration) -> Result<TcpTransport, TransportError> {
        bind_with(id, config(heartbeat))
    }

    fn connect(
        t: &TcpTransport,
        peers: &[(NodeId, SocketAddr)],
        dial_all: bool,
    ) -> Result<(), TransportError> {
        t.connect(peers, dial_all)
    }
}

/// Links read by threads of their own (the default for up to
/// `TcpConfig::dedicated_readers` links).
mod own_readers {
    use super::*;

    phalanx_transport::transport_contract_tests!(Tcp);

    #[test]
    fn a_lone_write_is_delivered_without_traffic_behind_it() {
        phalanx_transport::contract::a_lone_write_is_delivered_without_traffic_behind_it::<Tcp>();
    }
}

/// The same suite with every link read by the shared epoll threads (no link has a thread of
/// its own), two of them: the reading path of a node with more links than
/// `TcpConfig::dedicated_readers`.
mod shared_readers {
    use super::*;

    struct TcpShared;

    impl Harness for TcpShared {
        type T = TcpTransport;

        fn heartbeat() -> Duration {
            Tcp::heartbeat()
        }

        fn bind(id: NodeId, heartbeat: Duration) -> Result<TcpTransport, TransportError> {
            let cfg = TcpConfig {
                dedicated_readers: 0,
                readers: 2,
                ..config(heartbeat)
            };
            bind_with(id, cfg)
        }

        fn connect(
            t: &TcpTransport,
            peers: &[(NodeId, SocketAddr)],
            dial_all: bool,
        ) -> Result<(), TransportError> {
            Tcp::connect(t, peers, dial_all)
        }
    }

    phalanx_transport::transport_contract_tests!(TcpShared);

    #[test]
    fn a_lone_write_is_delivered_without_traffic_behind_it() {
        phalanx_transport::contract::a_lone_write_is_delivered_without_traffic_behind_it::<TcpShared>(
        );
    }
}
