//! Settings of the TCP transport.

use crate::auth::AuthConfig;
use std::time::Duration;

/// Settings of the TCP transport.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// A peer silent for this long is reported down. Heartbeats go out at a quarter of it.
    pub heartbeat_timeout: Duration,
    /// How long `connect` waits for the whole mesh to come up (with `on_demand`: how long
    /// after `connect` a dial keeps trying, while the cluster starts).
    pub connect_timeout: Duration,
    /// Links made on first use instead of a full mesh at start (see
    /// [`crate::LinkTable::link`]).
    pub on_demand: bool,
    /// With `on_demand`: for this long after `connect` a dial keeps trying (peers started
    /// one by one may not listen yet); zero for a cluster whose nodes all listen before any
    /// connects (an in-process cluster).
    pub startup_grace: Duration,
    /// With `on_demand`: a link that carried no control or data frame for this long (and
    /// through which the peer holds no grant) is closed; zero never closes one.
    pub idle_timeout: Duration,
    /// SO_SNDBUF / SO_RCVBUF in bytes; 0 keeps the kernel's autotuning.
    pub socket_buffer: usize,
    /// `TCP_NOTSENT_LOWAT` of every link, in bytes (0: the system's,
    /// `net.ipv4.tcp_notsent_lowat`, unlimited by default): a write waits while this much is
    /// written and not yet sent. With the system's, a stream into a link shared by several
    /// peers' flows fills the socket with megabytes that take 100 ms and more to leave, and a
    /// control message written after them waits as long (measured: a request behind a node's
    /// slices in an allreduce whose inputs came one after another, README "Allreduce of
    /// inputs that come one after another").
    pub notsent_lowat: usize,
    /// The congestion control of every link (`TCP_CONGESTION`, e.g. "reno" or "cubic");
    /// `None` keeps the system's (`net.ipv4.tcp_congestion_control`). One the kernel does not
    /// allow this process is reported at the link's setup, which goes on with the system's.
    /// Where the system's is BBR, bursts of a few hundred KiB on an otherwise quiet link (the
    /// blocks of a halving allreduce) now and then wait 20-60 ms for BBR's pacing (README,
    /// "Congestion control").
    pub congestion: Option<String>,
    /// Largest data frame; larger writes are split so control messages can interleave.
    pub max_frame: usize,
    /// Links read by a thread of their own (a blocking `recv`: one system call per wake-up,
    /// the lowest latency). Links beyond these share the `readers` threads.
    pub dedicated_readers: usize,
    /// Threads that read the links beyond `dedicated_readers`, each waiting on its share of
    /// them with epoll. With the dedicated ones, a node's reading threads whatever the number
    /// of its peers.
    pub readers: usize,
    /// How long an epoll reader keeps looking for frames after its last one before it sleeps
    /// (a non-blocking `epoll_wait`, the core yielded between looks), as an MPI rank polls
    /// its sockets: a frame that comes meanwhile is read without a thread wake-up, which is
    /// most of a small message's latency where threads wait for a core. Zero: it sleeps at
    /// once. Non-zero, no link has a reader of its own (`dedicated_readers` is ignored). See
    /// [`TcpConfig::polling`].
    pub poll_spin: Duration,
    /// Who may link (cluster secret, members) and the handshake's time bound; see
    /// [`crate::auth`].
    pub auth: AuthConfig,
}

impl TcpConfig {
    /// These settings with links made on demand, for a large cluster: a node then has
    /// [`TcpConfig::ON_DEMAND_DEDICATED_READERS`] links with a reader of their own (none: the
    /// epoll readers serve them all), so its threads stay few whatever the number of its
    /// links.
    pub fn on_demand(self) -> TcpConfig {
        TcpConfig {
            on_demand: true,
            idle_timeout: if self.idle_timeout.is_zero() {
                Self::ON_DEMAND_IDLE_TIMEOUT
            } else {
                self.idle_timeout
            },
            dedicated_readers: Self::ON_DEMAND_DEDICATED_READERS,
            ..self
        }
    }

    /// These settings with readers that poll for `spin` after each frame (see
    /// [`TcpConfig::poll_spin`]) and `readers` of them (at least one). Every link is then read
    /// by those readers: a thread of a link's own waits in a blocking `recv`, which cannot
    /// poll.
    pub fn polling(self, spin: Duration, readers: usize) -> TcpConfig {
        TcpConfig {
            poll_spin: spin,
            dedicated_readers: if spin.is_zero() {
                self.dedicated_readers
            } else {
                0
            },
            readers: readers.max(1),
            ..self
        }
    }

    /// Default idle timeout of links made on demand.
    pub const ON_DEMAND_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

    /// Links read by a thread of their own when links are made on demand: none. The first
    /// links such a node makes are to the ring neighbours it watches (heartbeats only), so
    /// readers of their own would go to them; the epoll readers serve every link.
    pub const ON_DEMAND_DEDICATED_READERS: usize = 0;

    /// The default [`TcpConfig::notsent_lowat`]: two 64 KiB chunks, so a stream's next
    /// write is in the socket before its last one has left, and what a control message can
    /// find ahead of it is a few milliseconds of a link's share.
    pub const NOTSENT_LOWAT: usize = 128 << 10;
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            heartbeat_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(30),
            on_demand: false,
            startup_grace: Duration::ZERO,
            idle_timeout: Duration::ZERO,
            socket_buffer: 0,
            notsent_lowat: Self::NOTSENT_LOWAT,
            congestion: None,
            max_frame: 1 << 20,
            dedicated_readers: 8,
            readers: std::thread::available_parallelism()
                .map_or(2, |n| n.get())
                .clamp(1, 4),
            poll_spin: Duration::ZERO,
            auth: AuthConfig::default(),
        }
    }
}
