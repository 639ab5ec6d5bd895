//! Node settings and the TOML cluster description.

use crate::{Error, Result};
use phalanx_transport::{NodeId, TcpConfig};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

/// Objects smaller than this live inline in the directory.
pub const INLINE_LIMIT: u64 = 64 * 1024;

/// Settings of one node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Largest piece a source writes at once; a receiver can forward after each frame. A source
    /// writes about a sixteenth of the object at a time, between 64 KiB and this.
    pub chunk_size: u64,
    /// Bytes of the node's registered arena.
    pub arena_size: u64,
    /// Back the arena with 2 MiB pages when the system has them.
    pub huge_pages: bool,
    /// How long a blocking operation waits (for an object to appear, for a reply).
    pub op_timeout: Duration,
    /// Granularity at which `put` copies into the arena (and publishes progress).
    pub put_step: u64,
    /// How long a caller spins for a reply before sleeping.
    pub spin_wait: Duration,
    /// Fixed round-trip latency for the reduce degree model (default: measured).
    pub latency_override: Option<Duration>,
    /// Fixed bandwidth in bytes/s for the reduce degree model (default: measured).
    pub bandwidth_override: Option<f64>,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            chunk_size: 4 << 20,
            arena_size: 2 << 30,
            huge_pages: false,
            op_timeout: Duration::from_secs(300),
            put_step: 1 << 20,
            spin_wait: Duration::from_micros(30),
            latency_override: None,
            bandwidth_override: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    #[default]
    Tcp,
    Rdma,
}

#[derive(Debug, Clone, Deserialize)]
pub struct NodeEntry {
    pub id: NodeId,
    pub addr: SocketAddr,
}

/// A cluster described in TOML:
/// ```toml
/// transport = "tcp"          # or "rdma"
/// chunk_size = 4194304
/// arena_size = 2147483648
/// heartbeat_ms = 1000
/// [[nodes]]
/// id = 0
/// addr = "10.0.0.1:7100"
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    #[serde(default)]
    pub transport: TransportKind,
    pub chunk_size: Option<u64>,
    pub arena_size: Option<u64>,
    pub heartbeat_ms: Option<u64>,
    pub connect_timeout_s: Option<u64>,
    pub socket_buffer: Option<usize>,
    pub huge_pages: Option<bool>,
    /// Verbs device name (transport = "rdma").
    pub device: Option<String>,
    /// RoCE GID index (transport = "rdma"); default: the IPv4-mapped GID.
    pub gid_index: Option<u8>,
    /// How long a caller spins for a reply before it sleeps, in microseconds (default 30).
    /// Set 0 where nodes share cores (emulated hosts): a spinning waiter then takes the CPU
    /// the peer it waits for needs.
    pub spin_wait_us: Option<u64>,
    /// How long a blocking operation waits, in seconds (default 300).
    pub op_timeout_s: Option<u64>,
    /// Spin on the completion queue instead of sleeping (transport = "rdma"); the progress
    /// thread is then pinned to a core near the NIC. Default false.
    pub busy_poll: Option<bool>,
    /// NIC-local placement of registered memory and of the busy-polling thread (transport =
    /// "rdma"). Default true; off anyway where sysfs does not tell the NIC's NUMA node.
    pub numa_placement: Option<bool>,
    pub nodes: Vec<NodeEntry>,
}

impl ClusterConfig {
    pub fn load(path: &Path) -> Result<ClusterConfig> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
        Self::parse(&text).map_err(|e| Error::Config(format!("{}: {e}", path.display())))
    }

    pub fn parse(text: &str) -> std::result::Result<ClusterConfig, String> {
        let c: ClusterConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        let mut ids: Vec<NodeId> = c.nodes.iter().map(|n| n.id).collect();
        ids.sort_unstable();
        if ids.is_empty() || ids.iter().enumerate().any(|(i, &id)| id != i as NodeId) {
            return Err(format!("node ids must be 0..n-1 without gaps, got {ids:?}"));
        }
        if c.heartbeat_ms == Some(0) {
            return Err("heartbeat_ms must be at least 1".into());
        }
        if c.arena_size == Some(0) {
            return Err("arena_size must not be 0".into());
        }
        if c.op_timeout_s == Some(0) {
            return Err("op_timeout_s must be at least 1".into());
        }
        if c.spin_wait_us.is_some_and(|us| us > 1_000_000) {
            return Err("spin_wait_us above one second makes no sense".into());
        }
        Ok(c)
    }

    pub fn node_config(&self) -> NodeConfig {
        let d = NodeConfig::default();
        NodeConfig {
            chunk_size: self.chunk_size.unwrap_or(d.chunk_size),
            arena_size: self.arena_size.unwrap_or(d.arena_size),
            huge_pages: self.huge_pages.unwrap_or(d.huge_pages),
            spin_wait: self.spin_wait_us.map_or(d.spin_wait, Duration::from_micros),
            op_timeout: self.op_timeout_s.map_or(d.op_timeout, Duration::from_secs),
            ..d
        }
    }

    pub fn tcp_config(&self) -> TcpConfig {
        let d = TcpConfig::default();
        TcpConfig {
            heartbeat_timeout: self
                .heartbeat_ms
                .map_or(d.heartbeat_timeout, Duration::from_millis),
            connect_timeout: self
                .connect_timeout_s
                .map_or(d.connect_timeout, Duration::from_secs),
            socket_buffer: self.socket_buffer.unwrap_or(d.socket_buffer),
            ..d
        }
    }

    pub fn addr_of(&self, id: NodeId) -> Option<SocketAddr> {
        self.nodes.iter().find(|n| n.id == id).map(|n| n.addr)
    }

    pub fn peers(&self) -> Vec<(NodeId, SocketAddr)> {
        self.nodes.iter().map(|n| (n.id, n.addr)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_validates() {
        let c = ClusterConfig::parse(
            r#"
            transport = "tcp"
            chunk_size = 1048576
            heartbeat_ms = 500
            [[nodes]]
            id = 1
            addr = "127.0.0.1:7101"
            [[nodes]]
            id = 0
            addr = "127.0.0.1:7100"
            "#,
        )
        .unwrap();
        assert_eq!(c.node_config().chunk_size, 1 << 20);
        assert_eq!(c.tcp_config().heartbeat_timeout, Duration::from_millis(500));
        assert_eq!(c.addr_of(1).unwrap().port(), 7101);
        assert!(ClusterConfig::parse("[[nodes]]\nid = 1\naddr = \"127.0.0.1:1\"").is_err());
        assert!(ClusterConfig::parse("bogus = 1\nnodes = []").is_err());
        let one = "[[nodes]]\nid = 0\naddr = \"127.0.0.1:1\"\n";
        let c =
            ClusterConfig::parse(&format!("spin_wait_us = 0\nop_timeout_s = 5\n{one}")).unwrap();
        assert_eq!(c.node_config().spin_wait, Duration::ZERO);
        assert_eq!(c.node_config().op_timeout, Duration::from_secs(5));
        assert!(ClusterConfig::parse(&format!("op_timeout_s = 0\n{one}")).is_err());
        assert!(ClusterConfig::parse(&format!("heartbeat_ms = 0\n{one}")).is_err());
        assert!(ClusterConfig::parse(&format!("arena_size = 0\n{one}")).is_err());
    }
}
