//! The transport contract: one test suite, generic over [`Transport`], that every transport
//! runs: TCP in `transports/tests/contract_tcp.rs` (every `cargo test`), verbs in
//! `rdma/tests/contract_verbs.rs` (in the Soft-RoCE VM). Built only with the `contract`
//! feature, so the plain library carries no test code.
//!
//! A transport plugs in through a [`Harness`] (how to bind a node and link a mesh);
//! [`transport_contract_tests!`](crate::transport_contract_tests) expands to one `#[test]`
//! per case, so `cargo test` counts them. Each case is a public function generic over the
//! harness and asserts what the [`Transport`] documentation promises: control messages in
//! order, data events in order and contiguous with the bytes in place, a control message
//! after a write seen after that write's data, non-blocking writes in order or not at all,
//! the `MAX_CTRL_LEN` boundary, typed errors for
//! invalid operations, exact counters, a killed peer reported down exactly once within the
//! heartbeat bound (and operations towards it failing), rejoin after a restart, and a
//! shutdown that peers see as a leave (`PEER_LEFT`), not a failure.
//!
//! Environment knobs (for the slow emulated VM):
//! - `PHALANX_CONTRACT_MAX_BYTES`: size of the large write (default 64 MiB, at least 2 MiB;
//!   suffixes K, M, G allowed);
//! - `PHALANX_CONTRACT_HEARTBEAT_MS`: heartbeat timeout of the failure cases (default: the
//!   harness's [`Harness::heartbeat`]).

use crate::{Arena, Event, NodeId, RemoteRegion, Transport, TransportError, TransportStats};
use crate::{MAX_CTRL_LEN, PEER_LEFT};
use crossbeam_channel::{Receiver, RecvTimeoutError};
use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the suite builds nodes of one transport kind.
pub trait Harness: 'static {
    type T: Transport + Clone;

    /// Why the transport cannot run on this host (e.g. "no RDMA device"); `None` to run.
    /// A case that cannot run prints `<case>: <reason>: skipped` and passes.
    fn unavailable() -> Option<String> {
        None
    }

    /// Heartbeat timeout of the cases that kill nodes; keep it short (a few hundred ms on a
    /// real host) so the suite takes seconds.
    fn heartbeat() -> Duration;

    /// Binds node `id` on an OS-assigned loopback port with this heartbeat timeout. The
    /// transport must report the bound address through [`Transport::listen_addr`].
    fn bind(id: NodeId, heartbeat: Duration) -> Result<Self::T, TransportError>;

    /// Links `t` to `peers` (the transport's `connect`; `dial_all` for a restarted node).
    fn connect(
        t: &Self::T,
        peers: &[(NodeId, SocketAddr)],
        dial_all: bool,
    ) -> Result<(), TransportError>;
}

/// Heartbeat of the cases that kill nobody: long enough that a loaded machine never sees a
/// spurious failure.
const CALM_HEARTBEAT: Duration = Duration::from_secs(5);
/// Longest wait for an event that must come (setup, small transfers) on a slow VM.
const WAIT: Duration = Duration::from_secs(60);
/// Longest wait for the data of a large write.
const WAIT_LARGE: Duration = Duration::from_secs(300);
/// Scheduling slack on top of a failure detection bound.
const SLACK: Duration = Duration::from_millis(300);
/// Default size of the large write.
const DEFAULT_MAX_BYTES: u64 = 64 << 20;

/// Runs one case unless the harness says the transport is unavailable here.
pub fn run<H: Harness>(case: &str, f: fn()) {
    if let Some(why) = H::unavailable() {
        // To the real stderr, past the test harness's capture, so a plain `cargo test` run
        // shows the skip (and scripts can count it).
        // One write, so parallel tests cannot split the line.
        use std::io::Write;
        let line = format!("{case}: {why}: skipped\n");
        let _ = std::io::stderr().write_all(line.as_bytes());
        return;
    }
    f();
}

/// Size of the large write: `PHALANX_CONTRACT_MAX_BYTES` or 64 MiB, at least 2 MiB.
pub fn max_bytes() -> u64 {
    let Ok(v) = std::env::var("PHALANX_CONTRACT_MAX_BYTES") else {
        return DEFAULT_MAX_BYTES;
    };
    let v = v.trim();
    let (num, mul) = match v.chars().last() {
        Some('K' | 'k') => (&v[..v.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&v[..v.len() - 1], 1 << 20),
        Some('G' | 'g') => (&v[..v.len() - 1], 1 << 30),
        _ => (v, 1),
    };
    let n: u64 = num
        .parse()
        .unwrap_or_else(|_| panic!("PHALANX_CONTRACT_MAX_BYTES={v}: not a size"));
    (n * mul).max(2 << 20)
}

/// Heartbeat timeout of the failure cases.
pub fn heartbeat<H: Harness>() -> Duration {
    match std::env::var("PHALANX_CONTRACT_HEARTBEAT_MS") {
        Ok(v) => Duration::from_millis(
            v.trim()
                .parse()
                .unwrap_or_else(|_| panic!("PHALANX_CONTRACT_HEARTBEAT_MS={v}: not a number")),
        ),
        Err(_) => H::heartbeat(),
    }
}

/// How long after a death every survivor must have reported it: the timeout, plus the half
/// heartbeat period a silence check may lag, plus scheduling slack.
fn detection_bound(hb: Duration) -> Duration {
    hb + hb / 2 + SLACK
}

mod data;
mod links;
mod mesh;
mod util;

pub use data::*;
pub use links::*;
use mesh::*;
use util::*;

/// Expands to one `#[test]` per contract case for the harness type `$h`:
///
/// ```ignore
/// phalanx_transport::transport_contract_tests!(MyHarness);
/// ```
///
/// A transport that is known to break a case (reported, awaiting a fix) names it with the
/// reason; that case is then generated with `#[ignore = reason]`, so `cargo test` shows it as
/// ignored and `--ignored` still runs it:
///
/// ```ignore
/// phalanx_transport::transport_contract_tests!(MyHarness, known_violations: {
///     restarted_peer_rejoins: "issue 42: ...",
/// });
/// ```
#[macro_export]
macro_rules! transport_contract_tests {
    ($h:ty) => {
        $crate::transport_contract_tests!($h, known_violations: {});
    };
    ($h:ty, known_violations: { $($bad:ident: $why:literal),* $(,)? }) => {
        // `$` for the helper macro's own variables.
        $crate::transport_contract_tests!(@helper ($) $h; $($bad: $why),*);
        // A known violation must name a case.
        $(const _: fn() = $crate::contract::$bad::<$h>;)*
        __phalanx_contract_case!(ctrl_messages_keep_their_order);
        __phalanx_contract_case!(ctrl_after_write_follows_its_data);
        __phalanx_contract_case!(data_events_cover_each_stream_exactly);
        __phalanx_contract_case!(small_writes_land_exactly);
        __phalanx_contract_case!(nonblocking_writes_land_in_order_or_not_at_all);
        __phalanx_contract_case!(large_write_lands_exactly);
        __phalanx_contract_case!(max_ctrl_len_is_the_limit);
        __phalanx_contract_case!(invalid_operations_fail_with_typed_errors);
        __phalanx_contract_case!(writes_outside_a_grant_change_nothing_and_drop_the_link);
        __phalanx_contract_case!(large_writes_outside_a_grant_change_nothing_and_drop_the_link);
        __phalanx_contract_case!(nonblocking_sends_keep_order);
        __phalanx_contract_case!(event_handler_sees_events_in_order);
        __phalanx_contract_case!(stats_count_exactly);
        __phalanx_contract_case!(killed_peer_is_reported_down_within_the_bound);
        __phalanx_contract_case!(restarted_peer_rejoins);
        __phalanx_contract_case!(restart_before_detection_reports_down_then_up);
        __phalanx_contract_case!(a_dropped_link_is_dialled_again);
        __phalanx_contract_case!(shutdown_is_a_leave_not_a_failure);
    };
    (@helper ($d:tt) $h:ty; $($bad:ident: $why:literal),*) => {
        macro_rules! __phalanx_contract_case {
            $(($bad) => {
                #[test]
                #[ignore = $why]
                fn $bad() {
                    $crate::contract::run::<$h>(stringify!($bad), $crate::contract::$bad::<$h>);
                }
            };)*
            ($d case:ident) => {
                #[test]
                fn $d case() {
                    $crate::contract::run::<$h>(
                        stringify!($d case),
                        $crate::contract::$d case::<$h>,
                    );
                }
            };
        }
    };
}
