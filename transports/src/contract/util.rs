//! Small helpers of the cases: patterns, byte checks, counter deltas, failed operations.

use super::*;
/// Deterministic bytes for `[offset, offset + len)` of `arena`.
pub(super) fn fill(arena: &Arena, offset: u64, len: u64, seed: u64) {
    // SAFETY: the cases own their source ranges; nothing writes them concurrently.
    let s = unsafe { arena.slice_mut(offset, len) };
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in s.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

/// Sets `[offset, offset + len)` of `arena` to `byte`.
pub(super) fn paint(arena: &Arena, offset: u64, len: u64, byte: u8) {
    // SAFETY: the cases own the receiving arena before a transfer starts.
    unsafe { arena.slice_mut(offset, len) }.fill(byte);
}

/// Asserts that `len` bytes at `src` in `a` equal those at `dst` in `b`.
pub(super) fn assert_same(a: &Arena, src: u64, b: &Arena, dst: u64, len: u64, what: &str) {
    // SAFETY: the transfer into `b` completed (all its data events arrived) and nothing
    // writes either range any more.
    let (x, y) = unsafe { (a.slice(src, len), b.slice(dst, len)) };
    assert_bytes(y, x, what);
}

/// Asserts `[offset, offset + len)` of `arena` still holds `byte` (bytes next to a write).
pub(super) fn assert_untouched(arena: &Arena, offset: u64, len: u64, byte: u8, what: &str) {
    // SAFETY: no transfer targets this range.
    let s = unsafe { arena.slice(offset, len) };
    if let Some(i) = s.iter().position(|&b| b != byte) {
        panic!(
            "{what}: byte {} changed to {:#04x} (outside the written range)",
            offset + i as u64,
            s[i]
        );
    }
}

pub(super) fn assert_bytes(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(g, w)| g != w) {
        panic!(
            "{what}: byte {i} of {} differs: {:#04x} instead of {:#04x}",
            want.len(),
            got[i],
            want[i]
        );
    }
}

/// Message `i` from `from` to `to`: `len` bytes that differ between messages.
pub(super) fn message(from: NodeId, to: NodeId, i: u64, len: usize) -> Vec<u8> {
    let mut m: Vec<u8> = (0..len)
        .map(|j| (j as u64 * 251 + i * 17 + from as u64 * 5 + to as u64 * 3) as u8)
        .collect();
    let tag = (i as u32).to_le_bytes();
    let n = len.min(4);
    m[..n].copy_from_slice(&tag[..n]);
    m
}

/// Counters of `after` minus `before`; counters never go down.
pub(super) fn delta(after: TransportStats, before: TransportStats) -> TransportStats {
    let d = |a: u64, b: u64, name: &str| {
        a.checked_sub(b)
            .unwrap_or_else(|| panic!("counter {name} went down from {b} to {a}"))
    };
    TransportStats {
        ctrl_sent: d(after.ctrl_sent, before.ctrl_sent, "ctrl_sent"),
        ctrl_received: d(after.ctrl_received, before.ctrl_received, "ctrl_received"),
        data_bytes_sent: d(
            after.data_bytes_sent,
            before.data_bytes_sent,
            "data_bytes_sent",
        ),
        data_bytes_received: d(
            after.data_bytes_received,
            before.data_bytes_received,
            "data_bytes_received",
        ),
        payload_bytes_copied: d(
            after.payload_bytes_copied,
            before.payload_bytes_copied,
            "payload_bytes_copied",
        ),
        registrations: d(after.registrations, before.registrations, "registrations"),
        grant_registrations: d(
            after.grant_registrations,
            before.grant_registrations,
            "grant_registrations",
        ),
        peers_down: d(after.peers_down, before.peers_down, "peers_down"),
        malformed_frames: d(
            after.malformed_frames,
            before.malformed_frames,
            "malformed_frames",
        ),
        hellos_refused: d(
            after.hellos_refused,
            before.hellos_refused,
            "hellos_refused",
        ),
    }
}

/// An operation towards `peer`, which is gone, must fail naming it.
pub(super) fn assert_gone<X: std::fmt::Debug>(
    r: Result<X, TransportError>,
    peer: NodeId,
    op: &str,
) {
    match r {
        Err(TransportError::PeerUnavailable(p)) => assert_eq!(p, peer, "{op}: error names"),
        Err(TransportError::PeerFailed { peer: p, .. }) => {
            assert_eq!(p, peer, "{op}: error names")
        }
        other => panic!(
            "{op} towards gone peer {peer}: expected PeerUnavailable or PeerFailed, got {other:?}"
        ),
    }
}

/// `send_nonblocking` towards a peer that is gone: not sent, and an error names the peer
/// (`Ok(false)` is the trait's default for transports without a non-blocking path).
pub(super) fn assert_gone_nonblocking(r: Result<bool, TransportError>, peer: NodeId) {
    match r {
        Ok(false) => {}
        other => assert_gone(other, peer, "send_nonblocking"),
    }
}
