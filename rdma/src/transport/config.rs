//! Settings of the verbs transport.

use phalanx_transport::AuthConfig;
use std::time::Duration;

/// Settings of the verbs transport.
#[derive(Debug, Clone)]
pub struct RdmaConfig {
    /// RDMA device name (e.g. "rxe0", "mlx5_0"); `None` takes the first device.
    pub device: Option<String>,
    /// Port number on the device (1-based).
    pub port: u8,
    /// GID table index; `None` picks an IPv4-mapped GID (RoCE v2 preferred), or index 0 on
    /// InfiniBand.
    pub gid_index: Option<u8>,
    /// Bytes per eager block (header 48 + trailer 5 included). Both peers must agree.
    pub block_size: usize,
    /// Blocks per ring (per connection and direction), and the blocks a sender may have
    /// unconsumed at its peer on any link. Both peers must agree.
    pub ring_blocks: usize,
    /// Links with a private ring (the fast path: blocks RDMA-written into the peer's ring,
    /// polled by their counter bytes) at most; a link made when the pool is taken, on
    /// either side, sends its blocks into the peer's shared receive queue instead. Eager
    /// memory per node is at most `ring_pool` x 2 x `ring_blocks` x `block_size` plus the two
    /// shared pools below, whatever the number of peers.
    pub ring_pool: usize,
    /// Blocks of the shared receive queue (every link's receives come from it).
    pub srq_blocks: usize,
    /// Blocks of the shared staging pool the links without a ring send from.
    pub staging_blocks: usize,
    /// Data writes of at least this many bytes go by rendezvous (zero copy); smaller ones
    /// ride the eager blocks.
    pub rendezvous_threshold: u64,
    /// Bytes per RDMA write of the rendezvous path.
    pub chunk_size: usize,
    /// Rendezvous chunk writes in flight per `write` call.
    pub write_window: usize,
    /// A peer silent for this long is reported down; heartbeats go out at a quarter of it.
    pub heartbeat_timeout: Duration,
    /// How long `connect` waits for the whole mesh to come up (with `on_demand`: how long
    /// after `connect` a dial keeps trying, while the cluster starts).
    pub connect_timeout: Duration,
    /// Links (queue pairs, rings) made on first use instead of a full mesh at start.
    pub on_demand: bool,
    /// With `on_demand`: for this long after `connect` a dial keeps trying (peers started
    /// one by one may not listen yet).
    pub startup_grace: Duration,
    /// With `on_demand`: a link that carried no control message or data for this long,
    /// through which the peer holds no grant and which no side watches, is closed (its QP
    /// destroyed, its ring given back to the pool); zero never closes one.
    pub idle_timeout: Duration,
    /// Spin on the CQ and the rings instead of sleeping on the completion channel.
    pub busy_poll: bool,
    /// NIC-local placement: bind registered memory to the device's NUMA node and (with
    /// `busy_poll`) pin the progress thread to a core near the device. Off where sysfs does
    /// not tell the device's node.
    pub numa_placement: bool,
    /// Completion queue entries (shared by all connections).
    pub cq_entries: usize,
    /// Local ACK timeout exponent of the QPs (4.096 µs × 2^x).
    pub qp_timeout: u8,
    /// Transport retries before a QP goes to error.
    pub retry_cnt: u8,
    /// Who may link (cluster secret, members) and the handshake's time bound; see
    /// `phalanx_transport::auth`. The out-of-band exchange is authenticated before any
    /// queue pair detail is sent.
    pub auth: AuthConfig,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            device: None,
            port: 1,
            gid_index: None,
            block_size: 8192,
            ring_blocks: 64,
            ring_pool: 8,
            srq_blocks: 512,
            staging_blocks: 128,
            rendezvous_threshold: DEFAULT_RENDEZVOUS_THRESHOLD,
            chunk_size: 1 << 20,
            write_window: 8,
            heartbeat_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(30),
            on_demand: false,
            startup_grace: Duration::ZERO,
            idle_timeout: Duration::ZERO,
            busy_poll: false,
            numa_placement: true,
            cq_entries: 16384,
            qp_timeout: 14,
            retry_cnt: 7,
            auth: AuthConfig::default(),
        }
    }
}

/// Default idle timeout of links made on demand (`TransportSettings::set_on_demand`).
pub const ON_DEMAND_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Default eager/rendezvous boundary (see README: measured on rxe in the test VM).
pub const DEFAULT_RENDEZVOUS_THRESHOLD: u64 = 8 << 10;
