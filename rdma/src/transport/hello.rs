//! The out-of-band hello: what one side sends the other over TCP to set up a connection.

use crate::verbs::QpEndpoint;
use phalanx_transport::{NodeId, TransportError};

const HELLO_MAGIC: u32 = 0x3152_5850; // "PXR1"
pub(super) const HELLO_LEN: usize = 80;
/// The dialler's last byte of the exchange: it is RTR+RTS, the acceptor may send.
pub(super) const READY_BYTE: u8 = 0xA5;

/// What one side sends the other over TCP to set up a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Hello {
    pub(super) node: NodeId,
    pub(super) ep: QpEndpoint,
    pub(super) ring_addr: u64,
    pub(super) ring_rkey: u32,
    pub(super) ring_blocks: u32,
    pub(super) block_size: u32,
    pub(super) notify_addr: u64,
    pub(super) notify_rkey: u32,
}

impl Hello {
    /// Whether the sender has a private ring for this link (keys 0: it has none, blocks go
    /// to its shared receive queue).
    pub(super) fn offers_ring(&self) -> bool {
        self.ring_rkey != 0 && self.notify_rkey != 0
    }

    pub(super) fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.node.to_le_bytes());
        b[8..12].copy_from_slice(&self.ep.qpn.to_le_bytes());
        b[12..16].copy_from_slice(&self.ep.psn.to_le_bytes());
        b[16..18].copy_from_slice(&self.ep.lid.to_le_bytes());
        b[18] = self.ep.mtu as u8;
        b[20..36].copy_from_slice(&self.ep.gid);
        b[36..44].copy_from_slice(&self.ring_addr.to_le_bytes());
        b[44..48].copy_from_slice(&self.ring_rkey.to_le_bytes());
        b[48..52].copy_from_slice(&self.ring_blocks.to_le_bytes());
        b[52..56].copy_from_slice(&self.block_size.to_le_bytes());
        b[56..64].copy_from_slice(&self.notify_addr.to_le_bytes());
        b[64..68].copy_from_slice(&self.notify_rkey.to_le_bytes());
        b
    }

    pub(super) fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, TransportError> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8"));
        if u32_at(0) != HELLO_MAGIC {
            return Err(TransportError::Malformed("bad hello magic".into()));
        }
        Ok(Hello {
            node: u32_at(4),
            ep: QpEndpoint {
                qpn: u32_at(8),
                psn: u32_at(12),
                lid: u16::from_le_bytes([b[16], b[17]]),
                mtu: b[18] as u32,
                gid: b[20..36].try_into().expect("16"),
            },
            ring_addr: u64_at(36),
            ring_rkey: u32_at(44),
            ring_blocks: u32_at(48),
            block_size: u32_at(52),
            notify_addr: u64_at(56),
            notify_rkey: u32_at(64),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_roundtrip_and_bad_magic() {
        let h = Hello {
            node: 7,
            ep: QpEndpoint {
                qpn: 0x12_3456,
                psn: 0xab_cdef,
                lid: 3,
                mtu: 3,
                gid: [9; 16],
            },
            ring_addr: 0x7f00_0000_1000,
            ring_rkey: 0x1234,
            ring_blocks: 64,
            block_size: 8192,
            notify_addr: 0x7f00_0002_0000,
            notify_rkey: 0x5678,
        };
        let mut b = h.encode();
        assert_eq!(Hello::decode(&b).unwrap(), h);
        b[0] ^= 1;
        assert!(matches!(
            Hello::decode(&b),
            Err(TransportError::Malformed(_))
        ));
    }
}
