//! Settings of the TCP transport.

use crate::auth::AuthConfig;
use std::time::Duration;

/// Settings of the TCP transport.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// A peer silent for this long is reported down. Heartbeats go out at a quarter of it.
    pub heartbeat_timeout: Duration,
    /// How long `connect` waits for the whole mesh to come up.
    pub connect_timeout: Duration,
    /// SO_SNDBUF / SO_RCVBUF in bytes; 0 keeps the kernel's autotuning.
    pub socket_buffer: usize,
    /// Largest data frame; larger writes are split so control messages can interleave.
    pub max_frame: usize,
    /// Links read by a thread of their own (a blocking `recv`: one system call per wake-up,
    /// the lowest latency). Links beyond these share the `readers` threads.
    pub dedicated_readers: usize,
    /// Threads that read the links beyond `dedicated_readers`, each waiting on its share of
    /// them with epoll. With the dedicated ones, a node's reading threads whatever the number
    /// of its peers.
    pub readers: usize,
    /// Who may link (cluster secret, members) and the handshake's time bound; see
    /// [`crate::auth`].
    pub auth: AuthConfig,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            heartbeat_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(30),
            socket_buffer: 0,
            max_frame: 1 << 20,
            dedicated_readers: 8,
            readers: std::thread::available_parallelism()
                .map_or(2, |n| n.get())
                .clamp(1, 4),
            auth: AuthConfig::default(),
        }
    }
}
