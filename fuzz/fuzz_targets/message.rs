//! A control message from a peer: decoding never panics nor allocates beyond the frame (the
//! decoder's limit), and a message that decodes encodes and decodes to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use phalanx::protocol::Msg;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Msg::decode(data) {
        let again = Msg::decode(&m.encode()).expect("an encoded message decodes");
        assert_eq!(format!("{m:?}"), format!("{again:?}"));
    }
});
