//! An eager block as a peer's RDMA write leaves it in the receive ring: decoding whatever
//! bytes are there never panics, for any ring size and sequence number.
#![no_main]

use libfuzzer_sys::fuzz_target;
use phalanx_rdma::block::{decode, BlockState, MIN_BLOCK};

fuzz_target!(|data: &[u8]| {
    if data.len() < 9 {
        return;
    }
    let n = (u16::from_le_bytes([data[0], data[1]]) as usize).max(1);
    let seq = u64::from_le_bytes(data[1..9].try_into().unwrap());
    let block = &data[9..];
    if block.len() < MIN_BLOCK {
        return;
    }
    if let BlockState::Ready(_, payload) = decode(block, n, seq) {
        assert!(payload.len() <= block.len());
    }
});
