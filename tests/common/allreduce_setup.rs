//! The cluster and inputs of the allreduce tests, shared by the test files that `#[path]`
//! this module in (beside `inputs.rs` and `log.rs`).

use super::inputs::input;
use super::log;
use phalanx::allreduce::PARTITION_MIN;
use phalanx::ops::combine;
use phalanx::transport::TcpConfig;
use phalanx::{DType, LocalCluster, NodeConfig, ObjectId, ReduceOp};
use std::time::Duration;

pub fn cfg() -> NodeConfig {
    log::from_env();
    NodeConfig {
        arena_size: 512 << 20,
        op_timeout: Duration::from_secs(60),
        allreduce_partition_min: PARTITION_MIN,
        ..NodeConfig::default()
    }
}

pub fn tcp() -> TcpConfig {
    TcpConfig {
        heartbeat_timeout: Duration::from_secs(1),
        ..TcpConfig::default()
    }
}

/// Inputs 0..n of `size` bytes and their names, `{tag}/in{k}`.
pub fn named_inputs(tag: &str, n: usize, size: u64, dtype: DType) -> (Vec<Vec<u8>>, Vec<ObjectId>) {
    let inputs = (0..n).map(|k| input(k, size, dtype)).collect();
    let sources = (0..n)
        .map(|k| ObjectId::new(format!("{tag}/in{k}")))
        .collect();
    (inputs, sources)
}

/// Puts input k (of `size` bytes) on node `holders[k]` as `{tag}/in{k}`.
pub fn put_inputs(
    c: &LocalCluster,
    tag: &str,
    holders: &[usize],
    size: u64,
    dtype: DType,
) -> (Vec<Vec<u8>>, Vec<ObjectId>) {
    let (inputs, sources) = named_inputs(tag, holders.len(), size, dtype);
    for (k, &h) in holders.iter().enumerate() {
        c.node(h).put(sources[k].clone(), &inputs[k]).unwrap();
    }
    // A put returns once its announcement is sent: wait until the directory lists every
    // input, so that they are all there when the allreduce starts, on a loaded host too.
    for id in &sources {
        wait_listed(c, id);
    }
    (inputs, sources)
}

/// Waits (at most 30 s) until the directory lists a copy of `id`.
pub fn wait_listed(c: &LocalCluster, id: &ObjectId) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !matches!(c.node(0).locate(id.clone()), Ok(Some(i)) if !i.locations.is_empty()) {
        assert!(std::time::Instant::now() < deadline, "{id} never listed");
        std::thread::sleep(Duration::from_millis(1));
    }
}

pub fn reference(inputs: &[Vec<u8>], op: ReduceOp, dtype: DType) -> Vec<u8> {
    let mut acc = inputs[0].clone();
    for x in &inputs[1..] {
        combine(op, dtype, &mut acc, x);
    }
    acc
}
