//! A TCP frame header from a peer: decoding never panics, and a header that decodes encodes
//! back to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use phalanx_transport::{FrameHeader, FRAME_HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    let Ok(b) = <&[u8; FRAME_HEADER_LEN]>::try_from(data) else {
        return;
    };
    if let Ok(h) = FrameHeader::decode(b) {
        let again = h.encode();
        assert_eq!(FrameHeader::decode(&again).ok(), Some(h));
    }
});
