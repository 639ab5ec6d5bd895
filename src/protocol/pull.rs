//! The pull family: a receiver and the source it pulls from.

use crate::ObjectId;
use phalanx_transport::{RemoteRegion, StreamId};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum PullMsg {
    /// Receiver to source: please write bytes `[from, size)` of `id` into `dst`, tagged
    /// `stream`.
    Pull {
        id: ObjectId,
        stream: StreamId,
        dst: RemoteRegion,
        from: u64,
    },
    /// Receiver to source: the receiver gives up on `stream`; the source stops and answers
    /// `PullEnd`.
    CancelPull { stream: StreamId },
    /// Source to receiver: the source will write no more for `stream` (all sent when `ok`).
    /// A stream whose last byte was written needs none: that byte ends it at the receiver;
    /// it is sent when the source stops early (failure, cancel) or has nothing to write.
    PullEnd { stream: StreamId, ok: bool },
}
