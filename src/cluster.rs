//! Starting nodes: an in-process cluster on loopback, or one node of a configured cluster.

use crate::{ClusterConfig, Error, Node, NodeConfig, Result, TransportKind};
use phalanx_transport::TransportError;
use phalanx_transport::{AuthConfig, ClusterSecret, NodeId, TcpConfig, TcpTransport, Transport};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Which transport a cluster runs on, with its settings.
#[derive(Debug, Clone)]
pub enum TransportSettings {
    Tcp(TcpConfig),
    #[cfg(feature = "rdma")]
    Rdma(phalanx_rdma::RdmaConfig),
}

impl TransportSettings {
    /// Settings for `kind` with defaults, a heartbeat timeout, and (verbs) device and GID.
    pub fn new(
        kind: TransportKind,
        heartbeat: Duration,
        device: Option<String>,
        gid_index: Option<u8>,
    ) -> Result<Self> {
        match kind {
            TransportKind::Tcp => Ok(TransportSettings::Tcp(TcpConfig {
                heartbeat_timeout: heartbeat,
                ..TcpConfig::default()
            })),
            #[cfg(feature = "rdma")]
            TransportKind::Rdma => Ok(TransportSettings::Rdma(phalanx_rdma::RdmaConfig {
                device,
                gid_index,
                heartbeat_timeout: heartbeat,
                ..Default::default()
            })),
            #[cfg(not(feature = "rdma"))]
            TransportKind::Rdma => {
                let _ = (device, gid_index);
                Err(Error::Config(
                    "this binary was built without the `rdma` feature".into(),
                ))
            }
        }
    }
}

impl TransportSettings {
    /// Makes links on first use (`true`) or as a full mesh at start.
    pub fn set_on_demand(&mut self, on: bool) {
        match self {
            TransportSettings::Tcp(c) if on => *c = c.clone().on_demand(),
            TransportSettings::Tcp(c) => c.on_demand = false,
            #[cfg(feature = "rdma")]
            TransportSettings::Rdma(c) => {
                c.on_demand = on;
                if on && c.idle_timeout.is_zero() {
                    c.idle_timeout = phalanx_rdma::ON_DEMAND_IDLE_TIMEOUT;
                }
            }
        }
    }

    /// A peer silent this long is reported down.
    pub fn heartbeat_timeout(&self) -> Duration {
        match self {
            TransportSettings::Tcp(c) => c.heartbeat_timeout,
            #[cfg(feature = "rdma")]
            TransportSettings::Rdma(c) => c.heartbeat_timeout,
        }
    }

    /// Whether links are made on first use.
    pub fn on_demand(&self) -> bool {
        match self {
            TransportSettings::Tcp(c) => c.on_demand,
            #[cfg(feature = "rdma")]
            TransportSettings::Rdma(c) => c.on_demand,
        }
    }

    /// Who may link, and the handshake bound (see `phalanx_transport::auth`).
    pub fn auth_mut(&mut self) -> &mut AuthConfig {
        match self {
            TransportSettings::Tcp(c) => &mut c.auth,
            #[cfg(feature = "rdma")]
            TransportSettings::Rdma(c) => &mut c.auth,
        }
    }

    /// The transport settings of a configured cluster (what [`start_node`] binds), without
    /// the cluster secret ([`start_node`] adds [`ClusterConfig::auth_config`]).
    pub fn from_cluster_config(cfg: &ClusterConfig) -> Result<Self> {
        #[allow(unused_mut)]
        let mut settings = match cfg.transport {
            TransportKind::Tcp => TransportSettings::Tcp(cfg.tcp_config()),
            kind => TransportSettings::new(
                kind,
                cfg.tcp_config().heartbeat_timeout,
                cfg.device.clone(),
                cfg.gid_index,
            )?,
        };
        #[cfg(feature = "rdma")]
        if let TransportSettings::Rdma(r) = &mut settings {
            r.busy_poll = cfg.busy_poll.unwrap_or(r.busy_poll);
            r.numa_placement = cfg.numa_placement.unwrap_or(r.numa_placement);
            r.on_demand = cfg.connect() == crate::Connect::OnDemand;
            r.startup_grace = r.connect_timeout;
        }
        Ok(settings)
    }
}

/// A transport that is bound but not yet connected.
enum Bound {
    Tcp(TcpTransport),
    #[cfg(feature = "rdma")]
    Rdma(phalanx_rdma::RdmaTransport),
}

impl Bound {
    fn bind(id: NodeId, addr: SocketAddr, t: &TransportSettings) -> Result<Bound> {
        Ok(match t {
            TransportSettings::Tcp(c) => Bound::Tcp(TcpTransport::bind(id, addr, c.clone())?),
            #[cfg(feature = "rdma")]
            TransportSettings::Rdma(c) => {
                Bound::Rdma(phalanx_rdma::RdmaTransport::bind(id, addr, c.clone())?)
            }
        })
    }

    fn listen_addr(&self) -> SocketAddr {
        match self {
            Bound::Tcp(t) => Transport::listen_addr(t).expect("tcp listens"),
            #[cfg(feature = "rdma")]
            Bound::Rdma(t) => t.listen_addr(),
        }
    }

    fn connect(&self, peers: &[(NodeId, SocketAddr)], dial_all: bool) -> Result<()> {
        match self {
            Bound::Tcp(t) => t.connect(peers, dial_all)?,
            #[cfg(feature = "rdma")]
            Bound::Rdma(t) => t.connect(peers, dial_all)?,
        }
        Ok(())
    }

    fn into_transport(self) -> Arc<dyn Transport> {
        match self {
            Bound::Tcp(t) => Arc::new(t),
            #[cfg(feature = "rdma")]
            Bound::Rdma(t) => Arc::new(t),
        }
    }
}

/// N nodes in one process, linked over TCP on 127.0.0.1. Unless the settings carry a
/// cluster secret, the cluster makes its own (random, per cluster), so its links are
/// authenticated like those of a configured cluster.
pub struct LocalCluster {
    pub nodes: Vec<Node>,
    /// The members and secret every node (and a restarted one) links with.
    auth: AuthConfig,
    /// Whether links are made on first use (a restarted node links the same way).
    on_demand: bool,
}

impl LocalCluster {
    /// N nodes over TCP on 127.0.0.1.
    pub fn start(n: u32, cfg: NodeConfig, tcp: TcpConfig) -> Result<LocalCluster> {
        Self::start_with(n, cfg, TransportSettings::Tcp(tcp))
    }

    /// N nodes on the given transport; out-of-band and TCP links use 127.0.0.1 (verbs traffic
    /// goes through the chosen device). Links are made on demand when the settings say so or
    /// the cluster is larger than [`crate::MESH_MAX_NODES`].
    pub fn start_with(n: u32, cfg: NodeConfig, t: TransportSettings) -> Result<LocalCluster> {
        let mut t = t;
        if crate::Connect::default_for(n) == crate::Connect::OnDemand {
            t.set_on_demand(true);
        }
        let on_demand = t.on_demand();
        let auth = t.auth_mut();
        if auth.secret.is_none() {
            auth.secret = Some(ClusterSecret::random().map_err(TransportError::from)?);
        }
        auth.members = Some(n);
        let auth = auth.clone();
        let any: SocketAddr = "127.0.0.1:0".parse().expect("valid");
        let bound = (0..n)
            .map(|i| Bound::bind(i, any, &t))
            .collect::<Result<Vec<_>>>()?;
        let peers: Vec<(NodeId, SocketAddr)> = bound
            .iter()
            .enumerate()
            .map(|(i, b)| (i as NodeId, b.listen_addr()))
            .collect();
        std::thread::scope(|s| {
            let hs: Vec<_> = bound
                .iter()
                .map(|b| s.spawn(|| b.connect(&peers, false)))
                .collect();
            hs.into_iter()
                .try_for_each(|h| h.join().expect("connect thread"))
        })?;
        let nodes = bound
            .into_iter()
            .enumerate()
            .map(|(i, b)| Node::start(i as NodeId, n, b.into_transport(), cfg.clone()))
            .collect::<Result<Vec<_>>>()?;
        Ok(LocalCluster {
            nodes,
            auth,
            on_demand,
        })
    }

    /// Restarts node `k` (after it was killed) as a new incarnation on the same address; it
    /// rejoins the cluster with an empty store (and the cluster's secret unless `tcp` has
    /// one).
    pub fn restart(&mut self, k: usize, cfg: NodeConfig, tcp: TcpConfig) -> Result<()> {
        let mut tcp = tcp;
        if tcp.auth.secret.is_none() {
            tcp.auth.secret = self.auth.secret.clone();
        }
        tcp.auth.members = self.auth.members;
        tcp.on_demand |= self.on_demand;
        let addr = self.nodes[k]
            .listen_addr()
            .ok_or_else(|| Error::Config("no address".into()))?;
        self.nodes[k].kill();
        let peers: Vec<(NodeId, SocketAddr)> = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| Some((i as NodeId, n.listen_addr()?)))
            .collect();
        // The old listener may take a moment to close.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let t = loop {
            match TcpTransport::bind(k as NodeId, addr, tcp.clone()) {
                Ok(t) => break t,
                Err(e) if std::time::Instant::now() < deadline => {
                    tracing::debug!("rebind {addr}: {e}");
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err(e) => return Err(e.into()),
            }
        };
        t.connect(&peers, true)?;
        self.nodes[k] = Node::start(k as NodeId, self.nodes.len() as u32, Arc::new(t), cfg)?;
        self.nodes[k].announce_alive();
        Ok(())
    }

    /// The cluster's secret, members and handshake bound (for tests that speak the wire).
    pub fn auth(&self) -> &AuthConfig {
        &self.auth
    }

    pub fn node(&self, i: usize) -> &Node {
        &self.nodes[i]
    }

    pub fn shutdown(&self) {
        for n in &self.nodes {
            n.shutdown();
        }
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Starts node `id` of a configured cluster and waits for the whole mesh; with `rejoin`, a
/// restarted node links to whichever peers are alive and does not wait for the rest.
pub fn start_node(cfg: &ClusterConfig, id: NodeId, rejoin: bool) -> Result<Node> {
    let addr = cfg
        .addr_of(id)
        .ok_or_else(|| Error::Config(format!("node {id} is not in the cluster config")))?;
    let mut settings = TransportSettings::from_cluster_config(cfg)?;
    *settings.auth_mut() = cfg.auth_config()?;
    let b = Bound::bind(id, addr, &settings)?;
    b.connect(&cfg.peers(), rejoin)?;
    let node = Node::start(
        id,
        cfg.nodes.len() as u32,
        b.into_transport(),
        cfg.node_config(),
    )?;
    if rejoin {
        node.announce_alive();
    }
    Ok(node)
}

/// The rank of this process in an SPMD launch: `PHALANX_RANK`, else `SLURM_PROCID`.
pub fn rank_from_env() -> Result<NodeId> {
    for var in ["PHALANX_RANK", "SLURM_PROCID"] {
        if let Ok(v) = std::env::var(var) {
            return v
                .parse()
                .map_err(|_| Error::Config(format!("{var}={v:?} is not a rank")));
        }
    }
    Err(Error::Config(
        "no rank: pass --id, or set PHALANX_RANK or SLURM_PROCID".into(),
    ))
}
