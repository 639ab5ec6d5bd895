//! A location on a node the getter cannot reach: member 2 links to node 0 only and publishes
//! a copy of an object on itself (it may: the copy is its own). Node 1, which has no link to
//! node 2, asks for the object: it must get an error within its op timeout, having logged a
//! bounded number of lines, and work normally afterwards.

#[path = "common/member.rs"]
#[allow(dead_code)] // the helper's trickle reading is for other tests
mod member;

use member::Member;
use phalanx::protocol::{DirMsg, Msg};
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Default)]
struct Lines(Arc<AtomicUsize>, Arc<std::sync::Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0
            .fetch_add(b.iter().filter(|&&c| c == b'\n').count(), Ordering::Relaxed);
        self.1.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_source_nobody_can_reach_is_an_error_within_the_timeout_with_few_log_lines() {
    let lines = Lines::default();
    let w = lines.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || w.clone())
        .init();
    let op_timeout = Duration::from_secs(3);
    let cfg = member::config(3, "op_timeout_s = 3\nheartbeat_ms = 3000");
    // Nodes 0 and 1 run; node 2 is the hand-run member, linked to node 0 only.
    let (n0, n1) = member::start_pair(&cfg);
    let mut m = Member::join(cfg.addr_of(0).unwrap(), 2, 0, 3, 1 << 20);
    let ghost = "@0/ghost";
    m.send(&Msg::Dir(DirMsg::Publish {
        id: ghost.into(),
        size: 1 << 20,
        node: 2,
        complete: true,
    }));
    std::thread::sleep(Duration::from_millis(200));
    assert!(!n1.transport().is_connected(2));
    let before = lines.0.load(Ordering::Relaxed);
    let t = Instant::now();
    let r = n1.get_view(ghost);
    let took = t.elapsed();
    let logged = lines.0.load(Ordering::Relaxed) - before;
    println!("get of an object only node 2 holds, from node 1 (no link to 2): {:?} after {took:?}, {logged} log lines", r.as_ref().err());
    assert!(r.is_err(), "a copy nobody can reach was read");
    println!("{}", String::from_utf8_lossy(&lines.1.lock().unwrap()));
    assert!(
        took <= op_timeout * 2 + Duration::from_secs(1),
        "took {took:?}"
    );
    assert!(
        logged <= 25,
        "{logged} log lines:\n{}",
        String::from_utf8_lossy(&lines.1.lock().unwrap())
    );
    // Node 1 still works.
    n0.put("@0/real", &[5u8; 200_000]).unwrap();
    assert_eq!(&*n1.get_view("@0/real").unwrap(), &[5u8; 200_000][..]);
    drop(m);
    n1.shutdown();
    n0.shutdown();
}
