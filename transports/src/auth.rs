//! Link authentication: the cluster secret and the challenge-response every link setup runs
//! before anything else, over the out-of-band TCP stream (the TCP transport's own socket, or
//! the verbs transport's setup socket).
//!
//! The dialler D and the acceptor A each prove knowledge of the secret `k`; each proof binds
//! both node ids, both fresh 32-byte nonces (from the OS RNG), the role and the channel:
//!
//! ```text
//! D -> A  challenge  magic u32 | version u8 | channel u8 | 0 u16 | D u32 | A u32 | nD [32]
//! A -> D  response   magic u32 | status u8  | channel u8 | 0 u16 | A u32 | D u32 | nA [32]
//!                    | HMAC(k, "acceptor", channel, D, A, nD, nA) [32]
//! D -> A  proof      HMAC(k, "dialler", channel, D, A, nD, nA) [32]
//! A -> D  verdict    status u8 (0: accepted)
//! ```
//! HMAC is HMAC-SHA256 (RustCrypto `hmac` + `sha2`); tags are compared in constant time
//! (`Mac::verify_slice`). A replayed or reflected message fails: the other side's nonce is
//! fresh and the role is part of the MAC. The acceptor checks that the challenge is addressed
//! to it and that the dialler's id is a member (below the cluster size, not its own) before it
//! answers; a refusal carries a status so the dialler can tell "wrong secret" from "busy".
//! Every read and write is bounded by one deadline per handshake, so a peer that sends nothing
//! or trickles bytes is dropped when it passes.
//!
//! What this does not do: encrypt. Anyone on the path can read the traffic (and, on verbs,
//! the keys of the registered memory); the secret only decides who may set up a link.
//!
//! Without a secret ([`AuthConfig::secret`] `None`) the same exchange runs with an empty key:
//! such nodes link with each other, never with a node that has a secret, and authenticate
//! nothing.

use crate::NodeId;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

type HmacSha256 = Hmac<Sha256>;

const AUTH_MAGIC: u32 = 0x3141_5850; // "PXA1"
const VERSION: u8 = 1;
const LABEL: &[u8] = b"phalanx link auth v1";
pub const NONCE_LEN: usize = 32;
pub const MAC_LEN: usize = 32;
pub const CHALLENGE_LEN: usize = 16 + NONCE_LEN;
pub const RESPONSE_LEN: usize = 16 + NONCE_LEN + MAC_LEN;
pub const PROOF_LEN: usize = MAC_LEN;
/// Shortest secret accepted, in bytes.
pub const MIN_SECRET_LEN: usize = 16;
/// Default bound on one handshake, from the accepted connection to the verdict.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);
/// Name of the environment variable that may carry the secret (read by the `phalanx`
/// library's cluster config, not by the transports).
pub const SECRET_ENV: &str = "PHALANX_SECRET";

/// Errors of link authentication.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("cluster secret too short: {len} bytes, at least {MIN_SECRET_LEN} needed")]
    WeakSecret { len: usize },
    #[error("OS random number generator failed: {0}")]
    Rng(String),
    #[error("malformed handshake: {0}")]
    Malformed(String),
    #[error("node {id} is not a member of this cluster")]
    NotMember { id: NodeId },
    #[error("expected node {expected}, got node {got}")]
    WrongNode { expected: NodeId, got: NodeId },
    #[error("peer did not prove knowledge of the cluster secret")]
    BadProof,
    #[error("node {0} already has a live link")]
    Busy(NodeId),
    #[error("too many handshakes in progress")]
    Overloaded,
    #[error("refused by the peer: {0}")]
    Refused(Status),
    #[error("handshake not finished within the timeout")]
    Timeout,
    #[error("peer closed the connection during the handshake")]
    Closed,
    #[error("i/o error during the handshake: {0}")]
    Io(#[from] std::io::Error),
}

impl AuthError {
    /// Whether dialling again may succeed (the peer was busy, overloaded or the connection
    /// broke), as opposed to a refusal that will not change (wrong secret, not a member).
    pub fn is_transient(&self) -> bool {
        match self {
            AuthError::Refused(s) => matches!(s, Status::Busy | Status::Overloaded),
            AuthError::Timeout | AuthError::Closed | AuthError::Io(_) => true,
            _ => false,
        }
    }

    /// The status an acceptor sends back for this failure.
    fn status(&self) -> Status {
        match self {
            AuthError::NotMember { .. } => Status::NotMember,
            AuthError::WrongNode { .. } => Status::WrongNode,
            AuthError::BadProof => Status::BadProof,
            AuthError::Busy(_) => Status::Busy,
            AuthError::Overloaded => Status::Overloaded,
            _ => Status::Malformed,
        }
    }
}

/// The outcome an acceptor reports in its response and its verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    Accepted = 0,
    BadProof = 1,
    NotMember = 2,
    WrongNode = 3,
    Busy = 4,
    Overloaded = 5,
    Malformed = 6,
}

impl Status {
    fn from_u8(b: u8) -> Result<Status, AuthError> {
        Ok(match b {
            0 => Status::Accepted,
            1 => Status::BadProof,
            2 => Status::NotMember,
            3 => Status::WrongNode,
            4 => Status::Busy,
            5 => Status::Overloaded,
            6 => Status::Malformed,
            b => return Err(AuthError::Malformed(format!("unknown status {b}"))),
        })
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Status::Accepted => "accepted",
            Status::BadProof => "wrong cluster secret",
            Status::NotMember => "not a member of the cluster",
            Status::WrongNode => "addressed to another node",
            Status::Busy => "a live link to this node exists",
            Status::Overloaded => "too many handshakes in progress",
            Status::Malformed => "malformed handshake",
        })
    }
}

/// Which link setup a handshake belongs to (bound into the MACs, so a proof made for one
/// cannot be used for the other).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Channel {
    Tcp = 1,
    Verbs = 2,
}

/// The shared secret of a cluster. Its `Debug` output does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(Arc<[u8]>);

impl ClusterSecret {
    /// A secret of these bytes (at least [`MIN_SECRET_LEN`]).
    pub fn new(bytes: impl AsRef<[u8]>) -> Result<ClusterSecret, AuthError> {
        let b = bytes.as_ref();
        if b.len() < MIN_SECRET_LEN {
            return Err(AuthError::WeakSecret { len: b.len() });
        }
        Ok(ClusterSecret(b.into()))
    }

    /// A secret written as text (a config value, a file, an environment variable): the text
    /// itself, surrounding white space removed.
    pub fn parse(text: &str) -> Result<ClusterSecret, AuthError> {
        ClusterSecret::new(text.trim().as_bytes())
    }

    /// A fresh secret: 32 bytes from the OS RNG.
    pub fn random() -> Result<ClusterSecret, AuthError> {
        let mut b = [0u8; 32];
        fill_random(&mut b)?;
        ClusterSecret::new(b)
    }

    fn key(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClusterSecret(<{} bytes>)", self.0.len())
    }
}

/// A fresh secret as text, for a config file or `PHALANX_SECRET`: 32 bytes from the OS RNG
/// in hex (64 characters).
pub fn generate_secret_text() -> Result<String, AuthError> {
    let mut b = [0u8; 32];
    fill_random(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

fn fill_random(b: &mut [u8]) -> Result<(), AuthError> {
    getrandom::getrandom(b).map_err(|e| AuthError::Rng(e.to_string()))
}

/// Who may link to a node, and how long a handshake may take.
#[derive(Debug, Clone)]
pub struct AuthConfig {
    /// The cluster secret; `None` runs the handshake with an empty key (no authentication:
    /// see the module documentation).
    pub secret: Option<ClusterSecret>,
    /// Number of nodes of the cluster: only ids below it are members. `None` admits any id
    /// (but never the node's own).
    pub members: Option<u32>,
    /// Bound on one handshake (a peer that sends nothing or trickles is dropped after it).
    pub handshake_timeout: Duration,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            secret: None,
            members: None,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
        }
    }
}

impl AuthConfig {
    fn key(&self) -> &[u8] {
        self.secret.as_ref().map_or(&[], |s| s.key())
    }

    /// Whether `id` may link to node `me`.
    pub fn is_member(&self, me: NodeId, id: NodeId) -> bool {
        id != me && self.members.is_none_or(|n| id < n)
    }
}

/// Which side a MAC speaks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    Dialler = b'D',
    Acceptor = b'A',
}

/// What one MAC binds: the link's two ends, both nonces, the channel and the speaking role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transcript {
    pub channel: Channel,
    pub dialler: NodeId,
    pub acceptor: NodeId,
    pub dialler_nonce: [u8; NONCE_LEN],
    pub acceptor_nonce: [u8; NONCE_LEN],
}

impl Transcript {
    /// The exchange between `dialler` and `acceptor` on `channel`, nonces not known yet.
    fn new(channel: Channel, dialler: NodeId, acceptor: NodeId) -> Transcript {
        Transcript {
            channel,
            dialler,
            acceptor,
            dialler_nonce: [0; NONCE_LEN],
            acceptor_nonce: [0; NONCE_LEN],
        }
    }

    fn mac(&self, key: &[u8], role: Role) -> HmacSha256 {
        // HMAC takes keys of any length (the empty key included), so this cannot fail.
        let mut m = <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC accepts any key");
        // Fixed-length fields only: no two transcripts encode alike.
        m.update(LABEL);
        m.update(&[role as u8, self.channel as u8]);
        m.update(&self.dialler.to_le_bytes());
        m.update(&self.acceptor.to_le_bytes());
        m.update(&self.dialler_nonce);
        m.update(&self.acceptor_nonce);
        m
    }

    /// The MAC `role` sends.
    pub fn tag(&self, key: &[u8], role: Role) -> [u8; MAC_LEN] {
        self.mac(key, role).finalize().into_bytes().into()
    }

    /// Whether `tag` is the MAC of `role` (compared in constant time).
    pub fn verify(&self, key: &[u8], role: Role, tag: &[u8]) -> bool {
        self.mac(key, role).verify_slice(tag).is_ok()
    }
}

/// Reads exactly `buf.len()` bytes before `deadline`, however the peer splits them.
fn read_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> Result<(), AuthError> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(AuthError::Timeout);
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(AuthError::Closed),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(AuthError::Timeout)
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Writes all of `buf` before `deadline`.
fn write_by(s: &mut TcpStream, buf: &[u8], deadline: Instant) -> Result<(), AuthError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(AuthError::Timeout);
    }
    s.set_write_timeout(Some(left))?;
    s.write_all(buf).map_err(|e| match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => AuthError::Timeout,
        _ => e.into(),
    })
}

fn header(b: &mut [u8], status: u8, channel: Channel, from: NodeId, to: NodeId) {
    b[0..4].copy_from_slice(&AUTH_MAGIC.to_le_bytes());
    b[4] = status;
    b[5] = channel as u8;
    b[8..12].copy_from_slice(&from.to_le_bytes());
    b[12..16].copy_from_slice(&to.to_le_bytes());
}

/// The parsed first 16 bytes of a challenge or response: (status or version, from, to).
fn parse_header(b: &[u8], channel: Channel) -> Result<(u8, NodeId, NodeId), AuthError> {
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    if u32_at(0) != AUTH_MAGIC {
        return Err(AuthError::Malformed(format!(
            "bad magic {:#010x}",
            u32_at(0)
        )));
    }
    if b[5] != channel as u8 || b[6..8] != [0, 0] {
        return Err(AuthError::Malformed(format!(
            "channel {} where {} was expected",
            b[5], channel as u8
        )));
    }
    Ok((b[4], u32_at(8), u32_at(12)))
}

/// The dialler's side: proves the secret to node `peer` and checks its proof. `extra_wait`
/// is how long, beyond the handshake timeout, the acceptor may take to decide (it may wait
/// for an old link of ours to be detected dead). Ok means the acceptor accepted the link.
pub fn dial(
    s: &mut TcpStream,
    cfg: &AuthConfig,
    channel: Channel,
    me: NodeId,
    peer: NodeId,
    extra_wait: Duration,
) -> Result<(), AuthError> {
    let deadline = Instant::now() + cfg.handshake_timeout;
    let mut t = Transcript::new(channel, me, peer);
    fill_random(&mut t.dialler_nonce)?;
    let mut c = [0u8; CHALLENGE_LEN];
    header(&mut c, VERSION, channel, me, peer);
    c[16..].copy_from_slice(&t.dialler_nonce);
    write_by(s, &c, deadline)?;

    // The header first, so a stranger's answer is refused before more is read.
    let mut r = [0u8; RESPONSE_LEN];
    read_by(s, &mut r[..16], deadline)?;
    let (status, from, to) = parse_header(&r, channel)?;
    match Status::from_u8(status)? {
        Status::Accepted => {}
        refused => return Err(AuthError::Refused(refused)),
    }
    if from != peer {
        return Err(AuthError::WrongNode {
            expected: peer,
            got: from,
        });
    }
    if to != me {
        return Err(AuthError::WrongNode {
            expected: me,
            got: to,
        });
    }
    read_by(s, &mut r[16..], deadline)?;
    t.acceptor_nonce.copy_from_slice(&r[16..16 + NONCE_LEN]);
    if !t.verify(cfg.key(), Role::Acceptor, &r[16 + NONCE_LEN..]) {
        return Err(AuthError::BadProof);
    }
    write_by(s, &t.tag(cfg.key(), Role::Dialler), deadline)?;

    let mut v = [0u8; 1];
    read_by(s, &mut v, deadline + extra_wait)?;
    match Status::from_u8(v[0])? {
        Status::Accepted => Ok(()),
        refused => Err(AuthError::Refused(refused)),
    }
}

/// A dialler that has proved the secret, waiting for the acceptor's verdict
/// ([`Admitted::accept`] or [`Admitted::refuse`]).
#[derive(Debug)]
pub struct Admitted {
    /// The dialler's node id, authenticated.
    pub peer: NodeId,
    deadline: Instant,
}

impl Admitted {
    /// Tells the dialler it is accepted.
    pub fn accept(self, s: &mut TcpStream) -> Result<(), AuthError> {
        write_by(s, &[Status::Accepted as u8], self.verdict_deadline())
    }

    /// Tells the dialler why it is refused after all (best effort) and returns `why`.
    pub fn refuse(self, s: &mut TcpStream, why: AuthError) -> AuthError {
        let _ = write_by(s, &[why.status() as u8], self.verdict_deadline());
        why
    }

    /// The verdict may come after the handshake's deadline (the acceptor may have waited for
    /// an old link); its one byte still gets a bound.
    fn verdict_deadline(&self) -> Instant {
        self.deadline.max(Instant::now() + Duration::from_secs(1))
    }
}

/// The acceptor's side, up to the verdict, on a blocking stream: reads the challenge,
/// checks it is addressed to node `me` from a member, answers with its proof, reads and
/// checks the dialler's proof. On failure a refusal status is sent back (best effort) and the
/// error returned. [`Acceptor`] is the same exchange for a non-blocking stream.
pub fn accept(
    s: &mut TcpStream,
    cfg: &AuthConfig,
    channel: Channel,
    me: NodeId,
) -> Result<Admitted, AuthError> {
    let mut a = Acceptor::new(cfg, channel, me);
    loop {
        let mut buf = [0u8; CHALLENGE_LEN];
        let want = a.wanted();
        read_by(s, &mut buf[..want], a.deadline)?;
        if let Some(admitted) = a.take(s, &buf[..want])? {
            return Ok(admitted);
        }
    }
}

/// The acceptor's side of the handshake as a state machine fed with bytes as they arrive,
/// so that one thread can hold many handshakes (silent or trickling peers cost it nothing
/// but a slot until the deadline). [`Acceptor::advance`] reads what a non-blocking stream
/// has; the outcome is that of [`accept`].
pub struct Acceptor {
    cfg: AuthConfig,
    channel: Channel,
    me: NodeId,
    /// The handshake's bound, from the accepted connection.
    pub deadline: Instant,
    /// The challenge, then the dialler's proof, as far as received.
    buf: [u8; CHALLENGE_LEN],
    got: usize,
    /// Set once the challenge is answered: the exchange to check the proof against.
    transcript: Option<Transcript>,
}

impl Acceptor {
    pub fn new(cfg: &AuthConfig, channel: Channel, me: NodeId) -> Acceptor {
        Acceptor {
            cfg: cfg.clone(),
            channel,
            me,
            deadline: Instant::now() + cfg.handshake_timeout,
            buf: [0; CHALLENGE_LEN],
            got: 0,
            transcript: None,
        }
    }

    /// Bytes needed to complete the current step (the challenge's header, its nonce, or the
    /// proof); reading no more than this never swallows the dialler's next message.
    fn wanted(&self) -> usize {
        match (&self.transcript, self.got < 16) {
            (Some(_), _) => PROOF_LEN - self.got,
            (None, true) => 16 - self.got,
            (None, false) => CHALLENGE_LEN - self.got,
        }
    }

    /// Reads what the non-blocking stream `s` has for this handshake and moves it on. Ok(None):
    /// more is needed (wait until `s` is readable again, or the deadline); Ok(Some): the
    /// dialler proved the secret. Errors as [`accept`]'s (a refusal is sent back first).
    pub fn advance(&mut self, s: &mut TcpStream) -> Result<Option<Admitted>, AuthError> {
        loop {
            if Instant::now() >= self.deadline {
                return Err(AuthError::Timeout);
            }
            let mut buf = [0u8; CHALLENGE_LEN];
            let want = self.wanted();
            let n = match s.read(&mut buf[..want]) {
                Ok(0) => return Err(AuthError::Closed),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(AuthError::Io(e)),
            };
            if let Some(admitted) = self.take(s, &buf[..n])? {
                return Ok(Some(admitted));
            }
        }
    }

    /// Takes `bytes` (at most [`Acceptor::wanted`]) and acts on every completed step: parses
    /// the header, answers the challenge (or refuses it), checks the proof.
    fn take(&mut self, s: &mut TcpStream, bytes: &[u8]) -> Result<Option<Admitted>, AuthError> {
        self.buf[self.got..self.got + bytes.len()].copy_from_slice(bytes);
        self.got += bytes.len();
        let channel = self.channel;
        if let Some(t) = &self.transcript {
            if self.got < PROOF_LEN {
                return Ok(None);
            }
            let admitted = Admitted {
                peer: t.dialler,
                deadline: self.deadline,
            };
            if !t.verify(self.cfg.key(), Role::Dialler, &self.buf[..PROOF_LEN]) {
                return Err(admitted.refuse(s, AuthError::BadProof));
            }
            return Ok(Some(admitted));
        }
        // The header first: garbage is refused as soon as its first 16 bytes are in.
        if self.got < 16 {
            return Ok(None);
        }
        let (version, from, to) = parse_header(&self.buf, channel)?;
        if version != VERSION {
            return Err(AuthError::Malformed(format!("version {version}")));
        }
        if self.got < CHALLENGE_LEN {
            return Ok(None);
        }
        let (me, deadline) = (self.me, self.deadline);
        let refuse = |s: &mut TcpStream, why: AuthError| {
            let mut r = [0u8; RESPONSE_LEN];
            header(&mut r, why.status() as u8, channel, me, from);
            let _ = write_by(s, &r, deadline);
            why
        };
        if to != me {
            return Err(refuse(
                s,
                AuthError::WrongNode {
                    expected: me,
                    got: to,
                },
            ));
        }
        if !self.cfg.is_member(me, from) {
            return Err(refuse(s, AuthError::NotMember { id: from }));
        }
        let mut t = Transcript::new(channel, from, me);
        t.dialler_nonce
            .copy_from_slice(&self.buf[16..CHALLENGE_LEN]);
        fill_random(&mut t.acceptor_nonce)?;
        let mut r = [0u8; RESPONSE_LEN];
        header(&mut r, Status::Accepted as u8, channel, me, from);
        r[16..16 + NONCE_LEN].copy_from_slice(&t.acceptor_nonce);
        r[16 + NONCE_LEN..].copy_from_slice(&t.tag(self.cfg.key(), Role::Acceptor));
        // 80 bytes on a connection that has sent nothing yet: the socket takes them at once.
        write_by(s, &r, deadline)?;
        self.transcript = Some(t);
        self.got = 0;
        Ok(None)
    }
}

#[cfg(test)]
mod tests;
