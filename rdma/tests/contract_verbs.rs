//! The transport contract suite (`phalanx_transport::contract`) on the verbs transport. It
//! needs an RDMA device (Soft-RoCE in the test VM: `bash .ci/verbs-vm-tests.sh`); without one
//! each case prints "<case>: no RDMA device: skipped" and passes.

use phalanx_rdma::{verbs, RdmaConfig, RdmaTransport};
use phalanx_transport::contract::Harness;
use phalanx_transport::{AuthConfig, ClusterSecret, NodeId, TransportError};
use std::net::SocketAddr;
use std::time::Duration;

struct Verbs;

impl Harness for Verbs {
    type T = RdmaTransport;

    fn unavailable() -> Option<String> {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        verbs::device_names()
            .is_empty()
            .then(|| "no RDMA device".to_string())
    }

    /// One second: the emulated VM's scheduling stalls stay well below it.
    fn heartbeat() -> Duration {
        Duration::from_secs(1)
    }

    fn bind(id: NodeId, heartbeat: Duration) -> Result<RdmaTransport, TransportError> {
        let cfg = RdmaConfig {
            device: std::env::var("PHALANX_RXE_DEV").ok(),
            heartbeat_timeout: heartbeat,
            // Every node of the suite knows the secret: the authenticated setup path.
            auth: AuthConfig {
                secret: Some(ClusterSecret::parse("the verbs contract suite's secret").unwrap()),
                ..AuthConfig::default()
            },
            ..RdmaConfig::default()
        };
        RdmaTransport::bind(id, "127.0.0.1:0".parse().expect("address"), cfg)
    }

    fn connect(
        t: &RdmaTransport,
        peers: &[(NodeId, SocketAddr)],
        dial_all: bool,
    ) -> Result<(), TransportError> {
        t.connect(peers, dial_all)
    }
}

phalanx_transport::transport_contract_tests!(Verbs);
