//! The membership family: news of deaths spread over the cluster, and the probes that
//! check them (see `crate::node::gossip`).

use crate::protocol::Rid;
use phalanx_transport::NodeId;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemberMsg {
    /// `node`, in its incarnation `inc` (the highest its watcher had heard of), is dead (its
    /// watcher saw it, or the news was passed on): the receiver passes it on to the nodes
    /// that follow it on the ring of ids, up to `until` (excluded).
    Down {
        node: NodeId,
        inc: u64,
        until: NodeId,
    },
    /// `node` is alive in incarnation `inc` (it refutes news of its death): passed on like
    /// `Down`; it outranks every `Down` of a lower incarnation.
    Up {
        node: NodeId,
        inc: u64,
        until: NodeId,
    },
    /// Are you there? Answered `Reply::Ack` (a node told of the death of a peer it still
    /// has a link to asks the peer before it believes it).
    Ping { rid: Rid },
    /// Nothing but the link it makes: a node watching its ring neighbours links to them.
    Watch,
}
