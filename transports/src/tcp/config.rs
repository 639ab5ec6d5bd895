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
    /// Reader threads (each waits on its share of the connections with epoll): the node's
    /// reading threads whatever the number of peers.
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
            readers: std::thread::available_parallelism()
                .map_or(2, |n| n.get())
                .clamp(1, 4),
            auth: AuthConfig::default(),
        }
    }
}
