//! Phalanx: a collective-communication object store for task-based distributed systems.
//!
//! Tasks `put` immutable objects and `get` them by id on any node. A sharded directory
//! knows where every copy is, partial copies included; receivers pull from one source each,
//! so broadcasts form trees on their own and every byte is forwarded while it still arrives.

mod alloc;
pub mod cluster;
pub mod config;
pub mod directory;
mod error;
mod fault;
pub mod hop;
mod id;
mod membership;
mod node;
pub mod ops;
pub mod protocol;
pub mod reduce;
mod rpc;
pub mod store;
mod transfer;
mod view;
mod workers;

pub use cluster::{LocalCluster, TransportSettings};
pub use config::{
    ClusterConfig, Connect, NodeConfig, TransportKind, INLINE_LIMIT, LOST_AFTER, MESH_MAX_NODES,
};
pub use error::{Error, Result};
pub use fault::{FaultAction, FaultPlan};
pub use id::ObjectId;
pub use node::{allreduce, halving, Node, ObjectWriter, ServeRecord, TransferRecord};
pub use ops::{DType, ReduceOp};
/// The verbs transport, its run-time loaded libibverbs binding and `phalanx info`'s survey.
#[cfg(feature = "rdma")]
pub use phalanx_rdma as rdma;
pub use phalanx_transport as transport;
pub use reduce::{ReduceHandle, ReduceOptions, ReduceOutcome, SourceClaims, Tree};
pub use view::{ObjectReader, ObjectView};
