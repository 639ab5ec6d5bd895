//! Node settings and the TOML cluster description.

use crate::{Error, Result};
use phalanx_transport::auth::SECRET_ENV;
use phalanx_transport::{AuthConfig, ClusterSecret, NodeId, TcpConfig};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
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
    /// How long a caller polls for a reply (yielding its core between looks) before it
    /// sleeps.
    pub spin_wait: Duration,
    /// Fixed round-trip latency for the reduce degree model (default: measured).
    pub latency_override: Option<Duration>,
    /// Fixed bandwidth in bytes/s for the reduce degree model (default: measured).
    pub bandwidth_override: Option<f64>,
    /// Allreduces of objects this large or larger, with every input used and there when the
    /// allreduce starts, are reduced partition by partition (`crate::allreduce`); default
    /// 4 MiB (`crate::allreduce::PARTITION_MIN`), `u64::MAX`: never. Every participant must
    /// have the same value.
    pub allreduce_partition_min: u64,
    /// Allreduces of objects from `INLINE_LIMIT` bytes up to this size, with every input there
    /// as it starts and each on its own node (the coordinator's among them), run by recursive
    /// halving and doubling (`crate::allreduce`); 0: never. Every participant must have the
    /// same value.
    pub allreduce_halving_max: u64,
    /// Reduces of all their inputs, of objects from this many bytes up to
    /// `reduce_halving_max`, with every input there as it starts and each on its own node
    /// (the coordinator's among them, at least `crate::halving::HALVING_REDUCE_RANKS`), run
    /// as a halving reduce: reduce-scatter, then a gather at the coordinator
    /// (`crate::reduce::halving`). Default `crate::halving::HALVING_REDUCE_MIN` to
    /// `HALVING_REDUCE_MAX`; a max of 0: never.
    pub reduce_halving_min: u64,
    pub reduce_halving_max: u64,
    /// How long the coordinator of a halving run (allreduce or reduce) waits for every input
    /// to be there, beyond four round trips, before it reduces with a tree instead (default
    /// `crate::halving::HALVING_GRACE`: inputs that come one by one are reduced sooner by
    /// a tree, which places them as they come).
    pub halving_grace: Duration,
    /// How long an object whose every copy died with its node (no complete copy and no
    /// producer's left) is waited for, by the readers it has and the directory, before they
    /// are told it is lost (`Error::ObjectLost`): long enough for a producer that recomputes
    /// it (a reduce's repair resets it) to learn of the death and say so. Default
    /// [`LOST_AFTER`].
    pub lost_after: Duration,
    /// How long a participant of a partitioned allreduce whose inputs were all there waits
    /// for the hint that says where to fetch a partition from (its place in the partition's
    /// ring) before the directory chooses; it stops waiting sooner once the partition is
    /// listed and no hint came (a reader with no input has no place). Default
    /// [`crate::allreduce::HINT_WAIT`].
    pub allgather_hint_wait: Duration,
}

/// The default [`NodeConfig::lost_after`]: a few heartbeat timeouts of the defaults, so that
/// every node has learned of the death (by its own links or the news of others) and a
/// producer has reset what it recomputes.
pub const LOST_AFTER: Duration = Duration::from_secs(5);

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            chunk_size: 4 << 20,
            arena_size: 2 << 30,
            huge_pages: false,
            op_timeout: Duration::from_secs(300),
            put_step: 1 << 20,
            spin_wait: Duration::from_micros(200),
            latency_override: None,
            bandwidth_override: None,
            allreduce_partition_min: crate::allreduce::PARTITION_MIN,
            allreduce_halving_max: crate::allreduce::HALVING_MAX,
            reduce_halving_min: crate::halving::HALVING_REDUCE_MIN,
            reduce_halving_max: crate::halving::HALVING_REDUCE_MAX,
            halving_grace: crate::halving::HALVING_GRACE,
            lost_after: LOST_AFTER,
            allgather_hint_wait: crate::allreduce::HINT_WAIT,
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

/// How a node links to its peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Connect {
    /// Every node links to every other at start.
    Mesh,
    /// A link is made on its first use: a node keeps links only to the peers it talks to.
    OnDemand,
}

impl Connect {
    /// The default for a cluster of `nodes`: a mesh up to [`MESH_MAX_NODES`], on demand
    /// beyond (a mesh of n nodes is n(n-1)/2 connections, each read and heartbeated).
    pub fn default_for(nodes: u32) -> Connect {
        if nodes > MESH_MAX_NODES {
            Connect::OnDemand
        } else {
            Connect::Mesh
        }
    }
}

/// Largest cluster linked as a full mesh by default (see [`Connect::default_for`]).
pub const MESH_MAX_NODES: u32 = 32;

#[derive(Debug, Clone, Deserialize)]
pub struct NodeEntry {
    pub id: NodeId,
    pub addr: SocketAddr,
}

/// A secret as written in a config file; its `Debug` output does not show it.
#[derive(Clone, Deserialize)]
#[serde(transparent)]
pub struct SecretText(String);

impl std::fmt::Debug for SecretText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<secret>")
    }
}

/// What a node of a configured cluster without any secret is told.
const NO_SECRET: &str = "no cluster secret: set `secret = \"...\"` or `secret_file = \"path\"` \
    in the cluster config, or the environment variable PHALANX_SECRET (`phalanx secret` prints \
    a fresh one); `insecure = true` runs without authenticating peers";

/// A cluster described in TOML:
/// ```toml
/// transport = "tcp"          # or "rdma"
/// chunk_size = 4194304
/// arena_size = 2147483648
/// heartbeat_ms = 1000
/// secret_file = "cluster.secret"   # or secret = "...", or PHALANX_SECRET in the environment
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
    /// TCP: bytes a link's socket holds written and not yet sent (`TCP_NOTSENT_LOWAT`; 0: the
    /// system's). Default [`TcpConfig::NOTSENT_LOWAT`].
    pub tcp_notsent_lowat: Option<usize>,
    pub huge_pages: Option<bool>,
    /// Verbs device name (transport = "rdma").
    pub device: Option<String>,
    /// RoCE GID index (transport = "rdma"); default: the IPv4-mapped GID.
    pub gid_index: Option<u8>,
    /// How long a caller polls for a reply (yielding its core between looks) before it
    /// sleeps, in microseconds (default 200).
    /// Set 0 where nodes share cores (emulated hosts): a polling waiter then takes the CPU
    /// the peer it waits for needs.
    pub spin_wait_us: Option<u64>,
    /// TCP: how long a reader thread keeps polling its links after the last frame before it
    /// sleeps, in microseconds (default 0: it sleeps at once). Polling, the links are all read
    /// by `tcp_readers` epoll threads that yield the core between looks, as MPI ranks wait:
    /// where threads queue for cores (emulated hosts) a message then costs no wake-up.
    pub poll_spin_us: Option<u64>,
    /// TCP: epoll reader threads (default: the cores, 1 to 4).
    pub tcp_readers: Option<usize>,
    /// TCP: the links' congestion control (`TCP_CONGESTION`: "reno", "cubic", ... as the
    /// kernel allows); default: the system's. See `TcpConfig::congestion`.
    pub tcp_congestion: Option<String>,
    /// How long a blocking operation waits, in seconds (default 300).
    pub op_timeout_s: Option<u64>,
    /// Spin on the completion queue instead of sleeping (transport = "rdma"); the progress
    /// thread is then pinned to a core near the NIC. Default false.
    pub busy_poll: Option<bool>,
    /// NIC-local placement of registered memory and of the busy-polling thread (transport =
    /// "rdma"). Default true; off anyway where sysfs does not tell the NIC's NUMA node.
    pub numa_placement: Option<bool>,
    /// The cluster secret: only nodes that know it can set up links (README "Trust").
    pub secret: Option<SecretText>,
    /// A file holding the secret (white space around it ignored); a relative path is taken
    /// from the config file's directory.
    pub secret_file: Option<PathBuf>,
    /// Run without a secret, authenticating no peer (default false: without a secret here
    /// or in `PHALANX_SECRET` a node refuses to start).
    pub insecure: Option<bool>,
    /// Bound on one link setup handshake, in milliseconds (default 3000): a peer that says
    /// nothing, or trickles, is dropped after it.
    pub handshake_timeout_ms: Option<u64>,
    /// Allreduces of objects this large or larger (all inputs used, and there at the start)
    /// are reduced partition by partition (default 8388608; 0: never, one tree then a
    /// broadcast).
    pub allreduce_partition_min: Option<u64>,
    /// Allreduces of objects from 64 KiB up to this size (inputs all there, one per node)
    /// run by recursive halving and doubling (default 196608; 0: never).
    pub allreduce_halving_max: Option<u64>,
    /// Reduces of all their inputs (there at the start, one per node, 4 nodes or more) of
    /// objects from `reduce_halving_min` (default 65536) to `reduce_halving_max` bytes
    /// (default 262144; 0: never) run as a halving reduce: a reduce-scatter, then a gather.
    pub reduce_halving_min: Option<u64>,
    pub reduce_halving_max: Option<u64>,
    /// Microseconds a halving run's coordinator waits for every input, beyond four round
    /// trips, before it takes a tree (default 2000).
    pub halving_grace_us: Option<u64>,
    /// Milliseconds an object whose every copy died is waited for before its readers are
    /// told it is lost (default 5000; see `NodeConfig::lost_after`).
    pub lost_after_ms: Option<u64>,
    /// `"mesh"` or `"on_demand"`; default: a mesh up to 32 nodes, on demand beyond.
    pub connect: Option<Connect>,
    pub nodes: Vec<NodeEntry>,
    /// Directory of the file the config was loaded from (for `secret_file`).
    #[serde(skip)]
    pub base_dir: Option<PathBuf>,
}

impl ClusterConfig {
    pub fn load(path: &Path) -> Result<ClusterConfig> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
        let mut c =
            Self::parse(&text).map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
        c.base_dir = path.parent().map(Path::to_path_buf);
        Ok(c)
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
        if c.lost_after_ms == Some(0) {
            return Err("lost_after_ms must be at least 1".into());
        }
        if c.handshake_timeout_ms == Some(0) {
            return Err("handshake_timeout_ms must be at least 1".into());
        }
        if c.secret.is_some() && c.secret_file.is_some() {
            return Err("give `secret` or `secret_file`, not both".into());
        }
        if let Some(s) = &c.secret {
            ClusterSecret::parse(&s.0).map_err(|e| format!("secret: {e}"))?;
        }
        if c.spin_wait_us.is_some_and(|us| us > 1_000_000) {
            return Err("spin_wait_us above one second makes no sense".into());
        }
        if c.poll_spin_us.is_some_and(|us| us > 1_000_000) {
            return Err("poll_spin_us above one second makes no sense".into());
        }
        if c.tcp_readers.is_some_and(|n| !(1..=64).contains(&n)) {
            return Err("tcp_readers must be 1 to 64".into());
        }
        // The kernel's names: at most 15 bytes (TCP_CA_NAME_MAX, with its NUL).
        let cc_name = |n: &str| {
            (1..16).contains(&n.len())
                && n.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        };
        if c.tcp_congestion.as_deref().is_some_and(|n| !cc_name(n)) {
            return Err("tcp_congestion must be a congestion control's name (1 to 15 letters, digits, _ or -)".into());
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
            allreduce_partition_min: match self.allreduce_partition_min {
                None => d.allreduce_partition_min,
                Some(0) => u64::MAX,
                Some(m) => m,
            },
            allreduce_halving_max: self
                .allreduce_halving_max
                .map_or(d.allreduce_halving_max, |m| {
                    m.min(crate::allreduce::HALVING_LIMIT)
                }),
            reduce_halving_min: self.reduce_halving_min.unwrap_or(d.reduce_halving_min),
            halving_grace: self.halving_grace_us.map_or(d.halving_grace, |us| {
                Duration::from_micros(us.min(10_000_000))
            }),
            reduce_halving_max: self.reduce_halving_max.map_or(d.reduce_halving_max, |m| {
                m.min(crate::allreduce::HALVING_LIMIT)
            }),
            lost_after: self
                .lost_after_ms
                .map_or(d.lost_after, Duration::from_millis),
            ..d
        }
    }

    pub fn tcp_config(&self) -> TcpConfig {
        let d = TcpConfig::default();
        let connect_timeout = self
            .connect_timeout_s
            .map_or(d.connect_timeout, Duration::from_secs);
        let c = TcpConfig {
            heartbeat_timeout: self
                .heartbeat_ms
                .map_or(d.heartbeat_timeout, Duration::from_millis),
            connect_timeout,
            // Its processes start one by one: a peer may not listen yet.
            startup_grace: connect_timeout,
            socket_buffer: self.socket_buffer.unwrap_or(d.socket_buffer),
            notsent_lowat: self.tcp_notsent_lowat.unwrap_or(d.notsent_lowat),
            congestion: self.tcp_congestion.clone(),
            ..d
        };
        let spin = Duration::from_micros(self.poll_spin_us.unwrap_or(0));
        let c = c.polling(spin, self.tcp_readers.unwrap_or(d.readers));
        if self.connect() == Connect::OnDemand {
            c.on_demand()
        } else {
            c
        }
    }

    /// How the nodes link (`connect`, else the default for the cluster's size).
    pub fn connect(&self) -> Connect {
        self.connect
            .unwrap_or_else(|| Connect::default_for(self.nodes.len() as u32))
    }

    /// Who may link to a node of this cluster: the secret (`secret`, else `secret_file`,
    /// else `PHALANX_SECRET`), the members (ids 0..n-1) and the handshake bound. Errors: no
    /// secret anywhere and not `insecure`; an unreadable file; a secret under 16 bytes.
    pub fn auth_config(&self) -> Result<AuthConfig> {
        self.auth_config_with(std::env::var(SECRET_ENV).ok())
    }

    /// [`ClusterConfig::auth_config`] with `env` as the value of `PHALANX_SECRET`.
    pub fn auth_config_with(&self, env: Option<String>) -> Result<AuthConfig> {
        let parse = |text: &str, from: &str| {
            ClusterSecret::parse(text).map_err(|e| Error::Config(format!("{from}: {e}")))
        };
        let secret = if let Some(s) = &self.secret {
            Some(parse(&s.0, "secret")?)
        } else if let Some(f) = &self.secret_file {
            let path = match &self.base_dir {
                Some(dir) if f.is_relative() => dir.join(f),
                _ => f.clone(),
            };
            let text = std::fs::read_to_string(&path)
                .map_err(|e| Error::Config(format!("secret_file {}: {e}", path.display())))?;
            Some(parse(&text, &format!("secret_file {}", path.display()))?)
        } else if let Some(text) = env.filter(|t| !t.trim().is_empty()) {
            Some(parse(&text, SECRET_ENV)?)
        } else if self.insecure == Some(true) {
            tracing::warn!("insecure = true: peers are not authenticated");
            None
        } else {
            return Err(Error::Config(NO_SECRET.into()));
        };
        let d = AuthConfig::default();
        Ok(AuthConfig {
            secret,
            members: Some(self.nodes.len() as u32),
            handshake_timeout: self
                .handshake_timeout_ms
                .map_or(d.handshake_timeout, Duration::from_millis),
        })
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
        // Polling readers: every link on the epoll threads, which spin before they sleep.
        let t = ClusterConfig::parse(&format!("poll_spin_us = 800\ntcp_readers = 1\n{one}"))
            .unwrap()
            .tcp_config();
        assert_eq!(t.poll_spin, Duration::from_micros(800));
        assert_eq!((t.readers, t.dedicated_readers), (1, 0));
        let t = ClusterConfig::parse(one).unwrap().tcp_config();
        assert_eq!(t.poll_spin, Duration::ZERO);
        assert_eq!(t.dedicated_readers, TcpConfig::default().dedicated_readers);
        assert!(ClusterConfig::parse(&format!("poll_spin_us = 2000000\n{one}")).is_err());
        assert!(ClusterConfig::parse(&format!("tcp_readers = 0\n{one}")).is_err());
        // The links' congestion control: the system's unless named; a name the kernel could
        // not know is refused.
        assert_eq!(
            ClusterConfig::parse(one).unwrap().tcp_config().congestion,
            None
        );
        let t = ClusterConfig::parse(&format!("tcp_congestion = \"reno\"\n{one}"))
            .unwrap()
            .tcp_config();
        assert_eq!(t.congestion.as_deref(), Some("reno"));
        for bad in ["", "a very long congestion name", "re no", "reno\\0"] {
            let text = format!("tcp_congestion = {bad:?}\n{one}");
            assert!(ClusterConfig::parse(&text).is_err(), "{bad:?}");
        }
        let node = |extra: &str| {
            ClusterConfig::parse(&format!("{extra}{one}"))
                .unwrap()
                .node_config()
        };
        let part = |extra: &str| node(extra).allreduce_partition_min;
        assert_eq!(
            part(""),
            4 << 20,
            "partitioned allreduce from 4 MiB by default"
        );
        assert_eq!(part("allreduce_partition_min = 0\n"), u64::MAX);
        assert_eq!(part("allreduce_partition_min = 8388608\n"), 8 << 20);
        let halving = |extra: &str| node(extra).allreduce_halving_max;
        assert_eq!(halving(""), crate::allreduce::HALVING_MAX);
        assert_eq!(halving("allreduce_halving_max = 0\n"), 0);
        assert_eq!(
            halving("allreduce_halving_max = 1099511627776\n"),
            crate::allreduce::HALVING_LIMIT,
            "bounded: its blocks travel as messages"
        );
        let reduce = |extra: &str| {
            let c = node(extra);
            (c.reduce_halving_min, c.reduce_halving_max)
        };
        let d = (
            crate::halving::HALVING_REDUCE_MIN,
            crate::halving::HALVING_REDUCE_MAX,
        );
        assert_eq!(reduce(""), d);
        let grace = |extra: &str| node(extra).halving_grace;
        assert_eq!(grace(""), crate::halving::HALVING_GRACE);
        assert_eq!(
            grace("halving_grace_us = 500\n"),
            Duration::from_micros(500)
        );
        assert_eq!(reduce("reduce_halving_max = 0\n"), (d.0, 0));
        assert_eq!(node("").lost_after, LOST_AFTER);
        assert_eq!(
            node("lost_after_ms = 750\n").lost_after,
            Duration::from_millis(750)
        );
        assert!(ClusterConfig::parse(
            "lost_after_ms = 0\n[[nodes]]\nid = 0\naddr = \"127.0.0.1:1\"\n"
        )
        .is_err());
        assert_eq!(
            reduce("reduce_halving_min = 4096\nreduce_halving_max = 1099511627776\n"),
            (4096, crate::allreduce::HALVING_LIMIT)
        );
    }

    #[test]
    fn secret_from_config_file_or_environment() {
        let one = "[[nodes]]\nid = 0\naddr = \"127.0.0.1:1\"\n[[nodes]]\nid = 1\naddr = \"127.0.0.1:2\"\n";
        let secret = "0123456789abcdef0123456789abcdef";
        let env = || Some(format!("{secret}-from-env"));
        // In the config: it wins over the environment; members and the bound follow.
        let c = ClusterConfig::parse(&format!(
            "secret = \"{secret}\"\nhandshake_timeout_ms = 500\n{one}"
        ))
        .unwrap();
        assert!(!format!("{c:?}").contains(secret), "Debug shows no secret");
        let a = c.auth_config_with(env()).unwrap();
        assert_eq!(a.secret, Some(ClusterSecret::parse(secret).unwrap()));
        assert_eq!(a.members, Some(2));
        assert_eq!(a.handshake_timeout, Duration::from_millis(500));
        // From the environment when the config has none.
        let bare = ClusterConfig::parse(one).unwrap();
        let a = bare.auth_config_with(env()).unwrap();
        assert_eq!(
            a.secret,
            Some(ClusterSecret::parse(&env().unwrap()).unwrap())
        );
        // Neither: refused, unless insecure.
        let e = bare.auth_config_with(None).unwrap_err().to_string();
        assert!(
            e.contains("no cluster secret") && e.contains("phalanx secret"),
            "{e}"
        );
        assert!(bare.auth_config_with(Some("  ".into())).is_err());
        let insecure = ClusterConfig::parse(&format!("insecure = true\n{one}")).unwrap();
        assert_eq!(insecure.auth_config_with(None).unwrap().secret, None);
        // From a file, relative to the config's directory.
        let dir = std::env::temp_dir().join(format!("phx-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("s"), format!("{secret}\n")).unwrap();
        std::fs::write(dir.join("c.toml"), format!("secret_file = \"s\"\n{one}")).unwrap();
        let c = ClusterConfig::load(&dir.join("c.toml")).unwrap();
        let a = c.auth_config_with(None).unwrap();
        assert_eq!(a.secret, Some(ClusterSecret::parse(secret).unwrap()));
        std::fs::remove_file(dir.join("s")).unwrap();
        assert!(
            c.auth_config_with(None).is_err(),
            "a missing file is an error"
        );
        std::fs::remove_dir_all(&dir).unwrap();
        // Bad values.
        assert!(ClusterConfig::parse(&format!("secret = \"short\"\n{one}")).is_err());
        assert!(ClusterConfig::parse(&format!(
            "secret = \"{secret}\"\nsecret_file = \"x\"\n{one}"
        ))
        .is_err());
        assert!(ClusterConfig::parse(&format!("handshake_timeout_ms = 0\n{one}")).is_err());
    }
}
