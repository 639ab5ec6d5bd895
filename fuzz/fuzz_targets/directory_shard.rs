//! The directory shard, a state machine fed with whatever peers send: the input is a
//! sequence of (sender, message) records; every message that decodes is handled, senders
//! die now and then, and time passes (a second a record, so that objects a death left
//! without a copy are declared lost, `Shard::tick`); the shard must never panic, and its
//! answers must decode.
#![no_main]

use libfuzzer_sys::fuzz_target;
use phalanx::directory::{Out, Shard};
use phalanx::protocol::Msg;
use std::time::{Duration, Instant};

fuzz_target!(|data: &[u8]| {
    let mut shard = Shard::new();
    let mut rest = data;
    let mut now = Instant::now();
    // Each record: sender (1 byte, 8 nodes), length (1 byte), that many bytes of message.
    while rest.len() >= 2 {
        let (from, len) = ((rest[0] % 8) as u32, rest[1] as usize);
        rest = &rest[2..];
        let take = len.min(rest.len());
        let (msg, tail) = rest.split_at(take);
        rest = tail;
        let mut out: Out = Vec::new();
        match Msg::decode(msg) {
            Ok(Msg::Dir(m)) => shard.handle(from, m, &mut out),
            // A record that is not a directory message: that sender dies; the entries that
            // move to this shard with it are some (by a bit of the name's hash), not all.
            _ => {
                let moved_here = |id: &phalanx::ObjectId| id.stable_hash() & 1 == 0;
                shard.node_down(from, now, &moved_here, &mut out)
            }
        }
        now += Duration::from_secs(1);
        shard.tick(now, Duration::from_secs(3), &mut out);
        for (_, m) in out {
            Msg::decode(&m.encode()).expect("the shard's answers decode");
        }
    }
    let _ = shard.assignments();
});
