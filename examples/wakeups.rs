//! What waiting costs on this machine: a 1 KiB request answered over loopback TCP, timed at
//! the caller, with the answer taken in six ways. Its figures decide how Phalanx's threads
//! wait for an answer (see `docs/benchmark-log.md`, eighteenth session):
//!
//! - `read`: the caller waits in a blocking `read` on the socket (the plain socket baseline of
//!   `phalanx bench p2p --algo socket`);
//! - `handoff-poll`: a reader thread waits in `read` and hands the answer over a channel to
//!   the caller, which polls the channel (yielding the core) as Phalanx's callers do;
//! - `handoff-block`: the same, the caller blocking on the channel;
//! - `ppoll-1ms`, `ppoll-20ms`, `ppoll-none`: the caller waits in `ppoll` on the socket with
//!   that timeout, then reads without blocking.
//!
//! ```text
//! cargo run --release --example wakeups [-- ROUNDS]
//! ```
//!
//! Each way runs ROUNDS (default 2000) requests, 200 us apart, after 100 unmeasured ones; the
//! medians are printed in microseconds.

use nix::poll::{ppoll, PollFd, PollFlags};
use nix::sys::socket::{recv, MsgFlags};
use nix::sys::time::TimeSpec;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd};
use std::time::{Duration, Instant};

const ANSWER: usize = 1024;
const REQUEST: [u8; 64] = [1; 64];
const WARMUP: usize = 100;

#[derive(Clone, Copy, Debug)]
enum Way {
    Read,
    HandoffPoll,
    HandoffBlock,
    Ppoll(Option<Duration>),
}

/// Answers every 64-byte request on the first connection with `ANSWER` bytes.
fn serve(l: TcpListener) -> std::io::Result<()> {
    let (mut s, _) = l.accept()?;
    s.set_nodelay(true)?;
    let answer = vec![7u8; ANSWER];
    let mut req = [0u8; REQUEST.len()];
    while s.read_exact(&mut req).is_ok() {
        s.write_all(&answer)?;
    }
    Ok(())
}

/// Reads one answer from `s`, waiting in `ppoll` with `timeout` for each part of it.
fn read_after_ppoll(
    s: &TcpStream,
    buf: &mut [u8],
    timeout: Option<Duration>,
) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let mut fds = [PollFd::new(s.as_fd(), PollFlags::POLLIN)];
        ppoll(&mut fds, timeout.map(TimeSpec::from_duration), None)?;
        match recv(s.as_raw_fd(), &mut buf[got..], MsgFlags::MSG_DONTWAIT) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(nix::errno::Errno::EAGAIN) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// The median time of `rounds` requests answered the `way` given, in microseconds.
fn measure(way: Way, rounds: usize) -> std::io::Result<f64> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let server = std::thread::spawn(move || serve(l));
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    // The reader thread of the hand-off ways.
    let (tx, rx) = crossbeam_channel::bounded::<Vec<u8>>(1);
    let reader = match way {
        Way::HandoffPoll | Way::HandoffBlock => {
            let mut r = c.try_clone()?;
            Some(std::thread::spawn(move || {
                let mut buf = vec![0u8; ANSWER];
                while r.read_exact(&mut buf).is_ok() {
                    if tx.send(buf.clone()).is_err() {
                        return;
                    }
                }
            }))
        }
        _ => None,
    };
    let mut buf = vec![0u8; ANSWER];
    let mut times = Vec::with_capacity(rounds);
    for i in 0..WARMUP + rounds {
        let t = Instant::now();
        c.write_all(&REQUEST)?;
        match way {
            Way::Read => c.read_exact(&mut buf)?,
            Way::HandoffPoll => loop {
                if let Ok(b) = rx.try_recv() {
                    buf = b;
                    break;
                }
                std::thread::yield_now();
            },
            Way::HandoffBlock => buf = rx.recv().map_err(std::io::Error::other)?,
            Way::Ppoll(timeout) => read_after_ppoll(&c, &mut buf, timeout)?,
        }
        if i >= WARMUP {
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
        assert!(buf.iter().all(|&b| b == 7), "a corrupted answer");
        std::thread::sleep(Duration::from_micros(200));
    }
    c.shutdown(std::net::Shutdown::Both)?;
    drop(c);
    if let Some(r) = reader {
        let _ = r.join();
    }
    let _ = server.join();
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn main() -> std::io::Result<()> {
    let rounds = match std::env::args().nth(1) {
        Some(a) => a
            .parse()
            .map_err(|_| std::io::Error::other("ROUNDS must be a number"))?,
        None => 2000,
    };
    let ways = [
        ("read", Way::Read),
        ("handoff-poll", Way::HandoffPoll),
        ("handoff-block", Way::HandoffBlock),
        ("ppoll-1ms", Way::Ppoll(Some(Duration::from_millis(1)))),
        ("ppoll-20ms", Way::Ppoll(Some(Duration::from_millis(20)))),
        ("ppoll-none", Way::Ppoll(None)),
    ];
    println!("# 1 KiB answer to a 64-byte request on loopback, median of {rounds} (us)");
    for (name, way) in ways {
        println!("{name:>14} {:8.1}", measure(way, rounds)?);
    }
    Ok(())
}
