//! Hop events: one `trace`-level event with target `phalanx::hop` at every point where a
//! request, a reply or data changes thread or node, so a latency can be broken down hop by
//! hop (`phalanx bench --trace` records and prints them). Disabled unless a subscriber asks
//! for that target, which costs one cached check per call site.

/// The target of every hop event.
pub const HOP_TARGET: &str = "phalanx::hop";

/// `hop!(node, "what", key = value, ...)`: a hop event of `node`.
macro_rules! hop {
    ($node:expr, $what:literal $(, $k:ident = $v:expr)* $(,)?) => {
        tracing::trace!(target: "phalanx::hop", node = $node, $($k = $v,)* $what)
    };
}
pub(crate) use hop;
