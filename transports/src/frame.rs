//! The TCP wire format: a fixed 40-byte little-endian header, then `len` payload bytes.
//!
//! ```text
//! magic u32 | kind u8 | 0 u8 x3 | len u64 | stream u64 | dst u64 | rel u64
//! ```
//! `Hello` is not sent any more (links are set up by the [`crate::auth`] handshake) and is
//! malformed on a link; `Data` carries the absolute arena offset
//! of the destination in `dst` and the offset relative to the receiver's region in `rel`.

use crate::TransportError;

pub const FRAME_MAGIC: u32 = 0x3158_4850; // "PHX1"
pub const FRAME_HEADER_LEN: usize = 40;
/// Largest control message; directory replies carry inline objects below 64 KiB, and
/// location lists, so 16 MiB leaves ample room while bounding what a bad peer can make us
/// allocate.
pub const MAX_CTRL_LEN: usize = 16 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    Hello = 1,
    Ctrl = 2,
    Data = 3,
    Heartbeat = 4,
    Bye = 5,
    /// The sender closes this link for being idle and sends nothing more on it; the receiver
    /// closes it too. Neither reports the peer down; the next use makes a new link.
    Idle = 6,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: FrameKind,
    pub len: u64,
    pub stream: u64,
    pub dst: u64,
    pub rel: u64,
}

impl FrameHeader {
    pub fn control(kind: FrameKind, len: u64) -> FrameHeader {
        FrameHeader {
            kind,
            len,
            stream: 0,
            dst: 0,
            rel: 0,
        }
    }

    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut b = [0u8; FRAME_HEADER_LEN];
        b[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..24].copy_from_slice(&self.stream.to_le_bytes());
        b[24..32].copy_from_slice(&self.dst.to_le_bytes());
        b[32..40].copy_from_slice(&self.rel.to_le_bytes());
        b
    }

    /// Parses and validates a header; every violation is a typed error, never a panic.
    pub fn decode(b: &[u8; FRAME_HEADER_LEN]) -> Result<FrameHeader, TransportError> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let magic = u32::from_le_bytes(b[0..4].try_into().expect("4 bytes"));
        if magic != FRAME_MAGIC {
            return Err(TransportError::Malformed(format!(
                "bad magic {magic:#010x}"
            )));
        }
        if b[5..8] != [0, 0, 0] {
            return Err(TransportError::Malformed("reserved bytes set".into()));
        }
        let kind = match b[4] {
            1 => FrameKind::Hello,
            2 => FrameKind::Ctrl,
            3 => FrameKind::Data,
            4 => FrameKind::Heartbeat,
            5 => FrameKind::Bye,
            6 => FrameKind::Idle,
            k => return Err(TransportError::Malformed(format!("unknown frame kind {k}"))),
        };
        let h = FrameHeader {
            kind,
            len: u64_at(8),
            stream: u64_at(16),
            dst: u64_at(24),
            rel: u64_at(32),
        };
        match kind {
            FrameKind::Ctrl if h.len as usize > MAX_CTRL_LEN => {
                Err(TransportError::MessageTooLarge {
                    len: h.len as usize,
                    max: MAX_CTRL_LEN,
                })
            }
            FrameKind::Hello | FrameKind::Heartbeat | FrameKind::Bye | FrameKind::Idle
                if h.len != 0 =>
            {
                Err(TransportError::Malformed(format!(
                    "{kind:?} frame with payload {}",
                    h.len
                )))
            }
            _ => Ok(h),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip() {
        let h = FrameHeader {
            kind: FrameKind::Data,
            len: 1 << 30,
            stream: 42,
            dst: 4096,
            rel: 8192,
        };
        assert_eq!(FrameHeader::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn rejects_garbage() {
        let mut b = FrameHeader::control(FrameKind::Ctrl, 3).encode();
        b[0] ^= 1;
        assert!(matches!(
            FrameHeader::decode(&b),
            Err(TransportError::Malformed(_))
        ));
        let mut b = FrameHeader::control(FrameKind::Ctrl, 3).encode();
        b[4] = 99;
        assert!(matches!(
            FrameHeader::decode(&b),
            Err(TransportError::Malformed(_))
        ));
        let b = FrameHeader::control(FrameKind::Ctrl, MAX_CTRL_LEN as u64 + 1).encode();
        assert!(matches!(
            FrameHeader::decode(&b),
            Err(TransportError::MessageTooLarge { .. })
        ));
        let b = FrameHeader::control(FrameKind::Heartbeat, 1).encode();
        assert!(FrameHeader::decode(&b).is_err());
    }
}
