//! Starting nodes: an in-process cluster on loopback, or one node of a configured cluster.

use crate::{ClusterConfig, Error, Node, NodeConfig, Result, TransportKind};
use phalanx_transport::{NodeId, TcpConfig, TcpTransport, Transport};
use std::net::SocketAddr;
use std::sync::Arc;

/// N nodes in one process, linked over TCP on 127.0.0.1.
pub struct LocalCluster {
    pub nodes: Vec<Node>,
}

impl LocalCluster {
    pub fn start(n: u32, cfg: NodeConfig, tcp: TcpConfig) -> Result<LocalCluster> {
        let any: SocketAddr = "127.0.0.1:0".parse().expect("valid");
        let transports = (0..n)
            .map(|i| TcpTransport::bind(i, any, tcp.clone()))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let peers: Vec<(NodeId, SocketAddr)> = transports
            .iter()
            .enumerate()
            .map(|(i, t)| (i as NodeId, t.listen_addr().expect("tcp listens")))
            .collect();
        std::thread::scope(|s| {
            let hs: Vec<_> = transports
                .iter()
                .map(|t| s.spawn(|| t.connect(&peers, false)))
                .collect();
            hs.into_iter()
                .try_for_each(|h| h.join().expect("connect thread"))
        })?;
        let nodes = transports
            .into_iter()
            .enumerate()
            .map(|(i, t)| Node::start(i as NodeId, n, Arc::new(t), cfg.clone()))
            .collect::<Result<Vec<_>>>()?;
        Ok(LocalCluster { nodes })
    }

    /// Restarts node `k` (after it was killed) as a new incarnation on the same address; it
    /// rejoins the cluster with an empty store.
    pub fn restart(&mut self, k: usize, cfg: NodeConfig, tcp: TcpConfig) -> Result<()> {
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
        Ok(())
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
    match cfg.transport {
        TransportKind::Tcp => {
            let t = TcpTransport::bind(id, addr, cfg.tcp_config())?;
            t.connect(&cfg.peers(), rejoin)?;
            Node::start(id, cfg.nodes.len() as u32, Arc::new(t), cfg.node_config())
        }
        TransportKind::Rdma => Err(Error::Config(
            "transport \"rdma\" is not built into this binary yet".into(),
        )),
    }
}
