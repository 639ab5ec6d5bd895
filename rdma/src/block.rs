//! The block codec of the eager ring.
//!
//! Each connection's receiver owns a ring of `n` blocks of `size` bytes. The sender writes
//! message number `seq` into block `seq % n`, *bottom-filled*: the message ends at the
//! block's last byte, so its position is found from the end and only the tail of the block
//! is written. Layout of a block holding a payload of `len` bytes:
//!
//! ```text
//! 0 .. start            untouched (left over from earlier laps)
//! start = size - TRAILER_LEN - len - HEADER_LEN
//! header   (48 bytes)   lap u8 | kind u8 | flags u8 | 0 u8 | len u32 | seq u32 | sum u32
//!                       | a u64 | b u64 | c u64 | d u64
//! payload  (len bytes)
//! trailer  (5 bytes)    len u32 | lap u8      <- the block's last byte
//! ```
//! `lap` is a counter byte that changes every lap around the ring (1..=255, never 0, so a
//! zeroed ring reads as "lap 0": never written). The verbs spec does not order the bytes of
//! one RDMA write, so the receiver checks the trailer's lap, then the header's lap, the
//! length in both, the low 32 bits of the sequence number and a checksum of everything.
//! - trailer lap of the previous lap: **stale** (not written yet this lap);
//! - trailer lap current but header/length/checksum disagree: **torn** (still landing);
//! - anything else that does not fit: **corrupt** (a peer bug: the link is dropped).

pub const HEADER_LEN: usize = 48;
pub const TRAILER_LEN: usize = 5;
/// Smallest block that can carry a useful payload.
pub const MIN_BLOCK: usize = 64;

pub const FLAG_FIRST: u8 = 1;
pub const FLAG_LAST: u8 = 2;

/// What a block carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A fragment of a control message. `a` = total length (on the first fragment).
    Ctrl = 1,
    /// Eager data: `a` = stream, `b` = offset relative to the region, `c` = absolute arena
    /// offset at the receiver; the payload is the data.
    Data = 2,
    /// Rendezvous data landed by the RDMA writes before this block on the same QP:
    /// `a` = stream, `b` = relative offset, `c` = absolute arena offset, `d` = length.
    DataDone = 3,
    Heartbeat = 4,
    Bye = 5,
    /// The sender closes the link for being idle: answer with a `Bye` and close it.
    Idle = 6,
}

impl Kind {
    fn from_u8(k: u8) -> Option<Kind> {
        Some(match k {
            1 => Kind::Ctrl,
            2 => Kind::Data,
            3 => Kind::DataDone,
            4 => Kind::Heartbeat,
            5 => Kind::Bye,
            6 => Kind::Idle,
            _ => return None,
        })
    }
}

/// The header fields of one block message (everything but lap, len, seq, sum).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub flags: u8,
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub d: u64,
}

impl Header {
    pub fn new(kind: Kind) -> Header {
        Header {
            kind,
            flags: 0,
            a: 0,
            b: 0,
            c: 0,
            d: 0,
        }
    }
}

/// Largest payload a block of `block_size` bytes carries.
pub const fn max_payload(block_size: usize) -> usize {
    block_size - HEADER_LEN - TRAILER_LEN
}

/// The lap counter byte of message `seq` in a ring of `n` blocks.
pub fn lap_of(seq: u64, n: usize) -> u8 {
    ((seq / n as u64) % 255) as u8 + 1
}

/// The counter byte a block holds before message `seq` is written into it.
pub fn prev_lap_of(seq: u64, n: usize) -> u8 {
    let lap = seq / n as u64;
    if lap == 0 {
        0
    } else {
        lap_of(seq - n as u64, n)
    }
}

fn checksum(h: &Header, len: u32, seq: u32, payload: &[u8]) -> u32 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut x: u64 = 0xcbf2_9ce4_8422_2325;
    let mut mix = |w: u64| {
        x = (x ^ w).wrapping_mul(K).rotate_left(29);
    };
    mix(h.kind as u64 | (h.flags as u64) << 8 | (len as u64) << 16);
    mix(seq as u64);
    mix(h.a);
    mix(h.b);
    mix(h.c);
    mix(h.d);
    let mut chunks = payload.chunks_exact(8);
    for c in &mut chunks {
        mix(u64::from_le_bytes(c.try_into().expect("8 bytes")));
    }
    let mut tail = [0u8; 8];
    let rest = chunks.remainder();
    tail[..rest.len()].copy_from_slice(rest);
    mix(u64::from_le_bytes(tail) ^ (rest.len() as u64) << 56);
    (x ^ (x >> 32)) as u32
}

/// Encodes message `seq` into `block` (the sender's staging copy of the receiver's block),
/// bottom-filled. Returns the offset of the first written byte: the RDMA write covers
/// `[start, block.len())`. Panics if the payload does not fit (callers split first).
pub fn encode(block: &mut [u8], n: usize, seq: u64, h: &Header, payload: &[u8]) -> usize {
    let size = block.len();
    assert!(
        payload.len() <= max_payload(size),
        "payload too large for block"
    );
    let lap = lap_of(seq, n);
    let len = payload.len() as u32;
    let start = size - TRAILER_LEN - payload.len() - HEADER_LEN;
    let sum = checksum(h, len, seq as u32, payload);
    let hb = &mut block[start..start + HEADER_LEN];
    hb[0] = lap;
    hb[1] = h.kind as u8;
    hb[2] = h.flags;
    hb[3] = 0;
    hb[4..8].copy_from_slice(&len.to_le_bytes());
    hb[8..12].copy_from_slice(&(seq as u32).to_le_bytes());
    hb[12..16].copy_from_slice(&sum.to_le_bytes());
    hb[16..24].copy_from_slice(&h.a.to_le_bytes());
    hb[24..32].copy_from_slice(&h.b.to_le_bytes());
    hb[32..40].copy_from_slice(&h.c.to_le_bytes());
    hb[40..48].copy_from_slice(&h.d.to_le_bytes());
    block[start + HEADER_LEN..size - TRAILER_LEN].copy_from_slice(payload);
    block[size - TRAILER_LEN..size - 1].copy_from_slice(&len.to_le_bytes());
    block[size - 1] = lap;
    start
}

/// What a receiver finds in the block it expects message `seq` in.
#[derive(Debug, PartialEq, Eq)]
pub enum BlockState<'a> {
    /// A complete message: header and payload.
    Ready(Header, &'a [u8]),
    /// Still last lap's content: not written yet.
    Stale,
    /// Trailer says this lap but the rest disagrees: the write is still landing.
    Torn(&'static str),
    /// Impossible content.
    Corrupt(String),
}

/// Reads the block that should hold message `seq` (ring of `n` blocks).
pub fn decode(block: &[u8], n: usize, seq: u64) -> BlockState<'_> {
    let size = block.len();
    let lap = lap_of(seq, n);
    let prev = prev_lap_of(seq, n);
    let trailer_lap = block[size - 1];
    if trailer_lap == prev && trailer_lap != lap {
        return BlockState::Stale;
    }
    if trailer_lap != lap {
        return BlockState::Corrupt(format!(
            "block {} holds counter byte {trailer_lap}, expected {lap} (or {prev} before it lands)",
            seq % n as u64
        ));
    }
    let len = u32::from_le_bytes(block[size - TRAILER_LEN..size - 1].try_into().expect("4"));
    if len as usize > max_payload(size) {
        return BlockState::Torn("length in trailer out of range");
    }
    let start = size - TRAILER_LEN - len as usize - HEADER_LEN;
    let hb = &block[start..start + HEADER_LEN];
    if hb[0] != lap {
        return BlockState::Torn("header counter disagrees with trailer counter");
    }
    let u32_at = |i: usize| u32::from_le_bytes(hb[i..i + 4].try_into().expect("4"));
    let u64_at = |i: usize| u64::from_le_bytes(hb[i..i + 8].try_into().expect("8"));
    if u32_at(4) != len {
        return BlockState::Torn("header length disagrees with trailer length");
    }
    if u32_at(8) != seq as u32 {
        return BlockState::Torn("sequence number disagrees");
    }
    let Some(kind) = Kind::from_u8(hb[1]) else {
        return BlockState::Torn("unknown kind");
    };
    let h = Header {
        kind,
        flags: hb[2],
        a: u64_at(16),
        b: u64_at(24),
        c: u64_at(32),
        d: u64_at(40),
    };
    let payload = &block[start + HEADER_LEN..size - TRAILER_LEN];
    if checksum(&h, len, seq as u32, payload) != u32_at(12) {
        return BlockState::Torn("checksum mismatch");
    }
    if hb[3] != 0 {
        return BlockState::Corrupt("reserved header byte set".into());
    }
    BlockState::Ready(h, payload)
}

/// Extends a 31-bit count carried in an immediate to the 64-bit running count nearest
/// above `known` (counts only grow, by less than 2^31 between two updates).
pub fn extend31(known: u64, low31: u32) -> u64 {
    const M: u64 = (1 << 31) - 1;
    let low = low31 as u64 & M;
    let mut c = (known & !M) | low;
    if c < known {
        c += 1 << 31;
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr() -> Header {
        Header {
            kind: Kind::Data,
            flags: FLAG_FIRST,
            a: 7,
            b: 1 << 40,
            c: 12345,
            d: u64::MAX,
        }
    }

    #[test]
    fn roundtrip_bottom_filled() {
        let n = 4;
        let mut b = vec![0u8; 256];
        let payload: Vec<u8> = (0..100u8).collect();
        let start = encode(&mut b, n, 0, &hdr(), &payload);
        assert_eq!(start, 256 - TRAILER_LEN - 100 - HEADER_LEN);
        assert!(
            b[..start].iter().all(|&x| x == 0),
            "bytes above the message untouched"
        );
        assert_eq!(b[255], 1, "counter byte is the last byte");
        assert_eq!(decode(&b, n, 0), BlockState::Ready(hdr(), &payload[..]));
        // Empty and full payloads.
        let start = encode(&mut b, n, 4, &Header::new(Kind::Heartbeat), &[]);
        assert_eq!(start, 256 - TRAILER_LEN - HEADER_LEN);
        assert!(
            matches!(decode(&b, n, 4), BlockState::Ready(h, p) if h.kind == Kind::Heartbeat && p.is_empty())
        );
        let full = vec![0xAB; max_payload(256)];
        assert_eq!(encode(&mut b, n, 8, &hdr(), &full), 0);
        assert_eq!(decode(&b, n, 8), BlockState::Ready(hdr(), &full[..]));
    }

    #[test]
    fn stale_blocks_are_detected() {
        let n = 2;
        let mut b = vec![0u8; 128];
        // A zeroed ring is "lap 0": stale for the first lap.
        assert_eq!(decode(&b, n, 0), BlockState::Stale);
        assert_eq!(decode(&b, n, 1), BlockState::Stale);
        encode(&mut b, n, 0, &hdr(), b"first lap");
        // Expecting message 2 (second lap) in block 0, which still holds message 0.
        assert_eq!(decode(&b, n, 2), BlockState::Stale);
        encode(&mut b, n, 2, &hdr(), b"second lap");
        assert!(matches!(decode(&b, n, 2), BlockState::Ready(_, p) if p == b"second lap"));
        // Message 2 is not what we expect two laps later either: corrupt, not stale.
        assert!(matches!(decode(&b, n, 6), BlockState::Corrupt(_)));
    }

    #[test]
    fn torn_blocks_are_detected() {
        let n = 2;
        let mut old = vec![0u8; 200];
        encode(&mut old, n, 0, &hdr(), &[1u8; 60]);
        let mut new = old.clone();
        let start = encode(&mut new, n, 2, &hdr(), &[2u8; 30]);
        // Only the trailer landed: header counter (old data there) disagrees.
        let mut t = old.clone();
        t[200 - TRAILER_LEN..].copy_from_slice(&new[200 - TRAILER_LEN..]);
        assert!(
            matches!(decode(&t, n, 2), BlockState::Torn(_)),
            "{:?}",
            decode(&t, n, 2)
        );
        // Header and trailer landed, payload not yet.
        let mut t = old.clone();
        t[start..start + HEADER_LEN].copy_from_slice(&new[start..start + HEADER_LEN]);
        t[200 - TRAILER_LEN..].copy_from_slice(&new[200 - TRAILER_LEN..]);
        assert_eq!(decode(&t, n, 2), BlockState::Torn("checksum mismatch"));
        // Header landed but trailer not: still last lap's counter byte, so stale.
        let mut t = old.clone();
        t[start..200 - TRAILER_LEN].copy_from_slice(&new[start..200 - TRAILER_LEN]);
        assert_eq!(decode(&t, n, 2), BlockState::Stale);
        // Everything but the trailer's length bytes.
        let mut t = new.clone();
        t[200 - TRAILER_LEN..199].copy_from_slice(&old[200 - TRAILER_LEN..199]);
        assert!(matches!(decode(&t, n, 2), BlockState::Torn(_)));
        // All landed.
        assert!(matches!(decode(&new, n, 2), BlockState::Ready(_, p) if p == [2u8; 30]));
    }

    #[test]
    fn counter_byte_wraps_and_never_repeats_adjacent_laps() {
        let n = 3;
        let mut b = vec![0u8; 96];
        // 2000 laps through one block: lap byte goes 1..=255 and wraps, never 0.
        for lap in 0..2000u64 {
            let seq = lap * n as u64 + 1;
            assert_eq!(decode(&b, n, seq), BlockState::Stale, "lap {lap}");
            encode(&mut b, n, seq, &hdr(), &lap.to_le_bytes());
            assert!(
                matches!(decode(&b, n, seq), BlockState::Ready(_, p) if p == lap.to_le_bytes())
            );
            assert_ne!(lap_of(seq, n), 0);
            assert_ne!(lap_of(seq, n), lap_of(seq + n as u64, n));
        }
    }

    #[test]
    fn flipped_bits_are_never_ready() {
        let n = 4;
        let mut b = vec![0u8; 160];
        let start = encode(&mut b, n, 5, &hdr(), b"some payload bytes");
        for i in start..160 {
            for bit in 0..8 {
                let mut t = b.clone();
                t[i] ^= 1 << bit;
                assert!(
                    !matches!(decode(&t, n, 5), BlockState::Ready(..)),
                    "byte {i} bit {bit}"
                );
            }
        }
    }

    #[test]
    fn extend31_wraps() {
        assert_eq!(extend31(0, 5), 5);
        assert_eq!(extend31(10, 10), 10);
        assert_eq!(extend31((1 << 31) - 3, 2), (1 << 31) + 2);
        assert_eq!(extend31((5 << 31) + 7, 9), (5 << 31) + 9);
        assert_eq!(extend31((5 << 31) + 7, 1), (6 << 31) + 1);
    }
}
