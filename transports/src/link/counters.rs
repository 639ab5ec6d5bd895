//! The counters behind [`crate::TransportStats`].

use crate::TransportStats;
use std::sync::atomic::{AtomicU64, Ordering};

/// Running counters a transport bumps as it works (relaxed atomics: they are statistics,
/// nothing synchronizes on them).
///
/// Contract: every field only grows, and [`Counters::stats`] reads each field once, so a
/// snapshot taken while traffic flows is a consistent lower bound per field, not across
/// fields.
#[derive(Debug, Default)]
pub struct Counters {
    pub ctrl_sent: AtomicU64,
    pub ctrl_received: AtomicU64,
    pub data_bytes_sent: AtomicU64,
    pub data_bytes_received: AtomicU64,
    /// Payload bytes copied through an intermediate buffer (the eager path of verbs).
    pub payload_bytes_copied: AtomicU64,
    /// Memory registrations done (the arena counts once).
    pub registrations: AtomicU64,
    /// Ranges registered for grants (verbs: one per rendezvous-size grant).
    pub grant_registrations: AtomicU64,
    pub peers_down: AtomicU64,
    pub malformed_frames: AtomicU64,
    pub hellos_refused: AtomicU64,
    /// Links closed for being idle (not in [`crate::TransportStats`]; see
    /// [`crate::LinkCounts`]).
    pub links_idle_closed: AtomicU64,
    /// Heartbeats sent (not in [`crate::TransportStats`]; see [`crate::LinkCounts`]).
    pub heartbeats_sent: AtomicU64,
    /// Sleeping readers woken to poll for an answer (not in [`crate::TransportStats`]; see
    /// [`crate::LinkCounts`]).
    pub readers_woken: AtomicU64,
}

impl Counters {
    /// The counters as the [`crate::Transport::stats`] snapshot.
    pub fn stats(&self) -> TransportStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TransportStats {
            ctrl_sent: get(&self.ctrl_sent),
            ctrl_received: get(&self.ctrl_received),
            data_bytes_sent: get(&self.data_bytes_sent),
            data_bytes_received: get(&self.data_bytes_received),
            payload_bytes_copied: get(&self.payload_bytes_copied),
            registrations: get(&self.registrations),
            grant_registrations: get(&self.grant_registrations),
            peers_down: get(&self.peers_down),
            malformed_frames: get(&self.malformed_frames),
            hellos_refused: get(&self.hellos_refused),
        }
    }
}
