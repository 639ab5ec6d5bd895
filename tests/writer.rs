//! Objects written in place (`Node::create`, `ObjectWriter`), over TCP on loopback.

use phalanx::transport::TcpConfig;
use phalanx::{Error, LocalCluster, NodeConfig, ObjectId};
use std::time::{Duration, Instant};

fn cluster(n: u32) -> LocalCluster {
    let cfg = NodeConfig {
        arena_size: 256 << 20,
        op_timeout: Duration::from_secs(60),
        put_step: 64 << 10,
        ..NodeConfig::default()
    };
    let tcp = TcpConfig {
        heartbeat_timeout: Duration::from_secs(3),
        ..TcpConfig::default()
    };
    LocalCluster::start(n, cfg, tcp).unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Written in place in pieces (some copied in, some computed in place), sealed, and read on
/// another node with the same bytes; a small object the same way (its bytes go to the
/// directory with the seal, as a small put's).
#[test]
fn an_object_written_in_place_reads_like_a_put_one() {
    let c = cluster(2);
    for (len, seed) in [(3 << 20, 1u8), (1000, 2), (0, 3)] {
        let want = pattern(len, seed);
        let id = format!("w/{len}");
        let mut w = c.node(0).create(id.as_str(), len as u64).unwrap();
        let half = len / 2;
        w.write(&want[..half]).unwrap();
        let rest = &want[half..];
        w.fill_with(rest.len() as u64, |b| b.copy_from_slice(rest))
            .unwrap();
        assert_eq!(w.written(), len as u64);
        w.seal().unwrap();
        assert!(c.node(1).get(id.as_str()).unwrap() == want, "{len} bytes");
        assert!(
            c.node(0).get(id.as_str()).unwrap() == want,
            "{len} bytes here"
        );
    }
}

/// Announced partial, the object streams to a reader while it is written: the reader's pull
/// starts before the seal and ends with every byte.
#[test]
fn an_announced_object_streams_to_its_readers_while_it_is_written() {
    let c = cluster(2);
    let len = 4 << 20;
    let want = pattern(len, 7);
    let mut w = c.node(0).create("w/streamed", len as u64).unwrap();
    w.announce().unwrap();
    let reader = {
        let n = c.node(1).clone();
        std::thread::spawn(move || n.get("w/streamed"))
    };
    // A quarter, then wait until the reader has some of it before writing on.
    w.write(&want[..len / 4]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while c
        .node(1)
        .local_copy("w/streamed")
        .is_none_or(|i| i.watermark == 0)
    {
        assert!(Instant::now() < deadline, "the reader got nothing");
        std::thread::sleep(Duration::from_millis(1));
    }
    for piece in want[len / 4..].chunks(1 << 20) {
        w.write(piece).unwrap();
    }
    let sealed = Instant::now();
    w.seal().unwrap();
    assert!(reader.join().unwrap().unwrap() == want);
    let pulls: Vec<_> = c
        .node(1)
        .transfer_log()
        .into_iter()
        .filter(|t| t.id == ObjectId::new("w/streamed"))
        .collect();
    assert_eq!(pulls.len(), 1, "{pulls:?}");
    assert!(pulls[0].ok && pulls[0].start < sealed, "{pulls:?}");
}

/// Bytes beyond the size are refused; a seal with bytes missing is refused and takes the
/// object back, as does a writer dropped unsealed after its announcement: no copy is left
/// here, and the directory lists none.
#[test]
fn a_writer_refuses_overflow_and_takes_back_an_unfinished_object() {
    let c = cluster(2);
    let len = 1 << 20;
    let mut w = c.node(0).create("w/short", len).unwrap();
    w.write(&vec![1u8; len as usize - 10]).unwrap();
    assert!(matches!(
        w.write(&[0u8; 11]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        w.fill_with(11, |_| panic!("not called")),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(w.written(), len - 10, "nothing of the refused writes");
    assert!(matches!(w.seal(), Err(Error::InvalidArgument(_))));
    assert!(c.node(0).local_copy("w/short").is_none());
    assert!(matches!(
        c.node(1)
            .get_view_timeout("w/short", Duration::from_millis(300)),
        Err(Error::Timeout(..))
    ));

    let mut w = c.node(0).create("w/dropped", len).unwrap();
    w.announce().unwrap();
    w.write(&vec![2u8; 4096]).unwrap();
    drop(w);
    assert!(c.node(0).local_copy("w/dropped").is_none());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let info = c.node(1).locate("w/dropped").unwrap();
        if info.as_ref().is_none_or(|i| i.locations.is_empty()) {
            break;
        }
        assert!(Instant::now() < deadline, "still listed: {info:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The name is free again.
    let mut w = c.node(0).create("w/dropped", 8).unwrap();
    w.write(&[5u8; 8]).unwrap();
    w.seal().unwrap();
    assert_eq!(c.node(1).get("w/dropped").unwrap(), vec![5u8; 8]);
}

/// A writer may be handed to the thread that computes the object.
#[test]
fn a_writer_can_move_to_another_thread() {
    fn sendable<T: Send>(_: &T) {}
    let c = cluster(1);
    let mut w = c.node(0).create("w/moved", 1 << 20).unwrap();
    sendable(&w);
    let w = std::thread::spawn(move || {
        w.fill_with(1 << 20, |b| b.fill(9)).unwrap();
        w
    })
    .join()
    .unwrap();
    w.seal().unwrap();
    assert!(c.node(0).get("w/moved").unwrap().iter().all(|&b| b == 9));
}

/// Written through the address of its unwritten bytes (as the Python binding's writable
/// buffer does), committed in two steps while a reader streams it, and sealed: the reader,
/// and a reader after the seal, get every byte. A small object the same way. Bytes not
/// taken first cannot be committed, nor more than the object has.
#[test]
fn an_object_filled_through_its_unwritten_bytes_reads_like_a_put_one() {
    let c = cluster(2);
    for (len, seed) in [(3 << 20, 11u8), (1000, 12)] {
        let want = pattern(len, seed);
        let id = format!("w/unwritten/{len}");
        let mut w = c.node(0).create(id.as_str(), len as u64).unwrap();
        w.announce().unwrap();
        let streaming = {
            let (n, id) = (c.node(1).clone(), id.clone());
            std::thread::spawn(move || n.get(id.as_str()))
        };
        let (at, rest) = w.unwritten().unwrap();
        assert_eq!(rest, len as u64);
        // SAFETY: `unwritten` gave `rest` bytes at `at`, written only here and read by nobody
        // until committed; the writer (which keeps them allocated) outlives this slice.
        let bytes = unsafe { std::slice::from_raw_parts_mut(at.as_ptr(), rest as usize) };
        let half = len / 2;
        bytes[..half].copy_from_slice(&want[..half]);
        w.commit(half as u64).unwrap();
        assert_eq!(w.written(), half as u64);
        bytes[half..].copy_from_slice(&want[half..]);
        assert!(matches!(
            w.commit(len as u64),
            Err(Error::InvalidArgument(_))
        ));
        w.commit((len - half) as u64).unwrap();
        w.seal().unwrap();
        let got = streaming.join().unwrap().unwrap();
        assert!(got == want, "{len} bytes, read while written");
        assert!(c.node(1).get(id.as_str()).unwrap() == want, "{len} bytes");
    }
    // A copy in the store: bytes not taken with `unwritten` are not committed.
    let mut w = c.node(0).create("w/untaken", 1 << 20).unwrap();
    w.write(&[1; 4096]).unwrap();
    assert!(matches!(w.commit(4096), Err(Error::InvalidArgument(_))));
    assert_eq!(w.written(), 4096);
    // A name this node holds is refused at the start, small or not.
    c.node(0).put("w/held", b"abc").unwrap();
    for size in [3, 1 << 20] {
        let again = c.node(0).create("w/held", size);
        assert!(matches!(again, Err(Error::AlreadyExists(_))), "{size}");
    }
}
