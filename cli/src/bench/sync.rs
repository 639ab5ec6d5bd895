//! How the benchmark's ranks meet and time themselves, outside the object store (as the MPI
//! benchmarks do): a barrier starts every iteration, every rank stamps when it left the barrier
//! and when its part was done, and rank 0 takes the last completion minus the start.
//!
//! Clocks: every stamp is `CLOCK_MONOTONIC`. Ranks on one host (threads of one process, or
//! processes in network namespaces of one kernel) share that clock, detected by equal
//! `/proc/sys/kernel/random/boot_id`: then the start is the first instant any of them left the
//! barrier (a rank leaves when it has done its part of the barrier: rank 0 after sending the
//! last release, the others when they read theirs), so the barrier's skew counts. Ranks on
//! other hosts do not share it: their time is their completion minus the instant they left
//! the barrier. `cluster/mpi/collbench.c` times Open MPI by the same rule.
//!
//! In one process the ranks meet at a `std::sync::Barrier`; across processes over a small TCP
//! side channel to rank 0 (`TcpSync`), never through Phalanx objects.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Nanoseconds on the host's monotonic clock.
pub fn now_ns() -> u64 {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .expect("CLOCK_MONOTONIC is always readable");
    t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
}

/// This host's boot id (equal for every process of one kernel), if readable.
fn boot_id() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    // FNV-1a of the id: only equality matters.
    Some(s.trim().bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    }))
}

/// When one rank saw an iteration start and when it finished, on its own clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// When this rank left the barrier.
    pub released_ns: u64,
    /// When its part of the collective was done; `None`: it took no part.
    pub done_ns: Option<u64>,
}

/// The meeting point of the ranks.
pub trait RankSync: Send + Sync {
    /// Waits until every rank has arrived. Returns when this rank left it (its `released_ns`).
    fn barrier(&self, rank: u32) -> std::io::Result<u64>;

    /// Every rank hands in its stamp; rank 0 gets the time of the iteration: the latest
    /// completion minus the start (see the module doc for the clock), in seconds.
    fn finish(&self, rank: u32, stamp: Stamp) -> std::io::Result<Option<f64>>;

    /// Rank 0, after `finish`: how far apart the ranks on its clock left the last barrier
    /// (the barrier's exit skew, part of the time), if known.
    fn last_skew(&self) -> Option<f64> {
        None
    }
}

/// The spread of the instants the ranks on rank 0's clock left the barrier, in seconds.
fn exit_skew(stamps: &[Stamp], shared: &[bool]) -> Option<f64> {
    let rel = || {
        stamps
            .iter()
            .zip(shared)
            .filter(|(_, &sh)| sh)
            .map(|(s, _)| s.released_ns)
    };
    Some((rel().max()? - rel().min()?) as f64 / 1e9)
}

/// The iteration's time from every rank's stamp; `shared[k]`: rank k's clock is rank 0's.
/// Ranks on rank 0's clock count from the first of them to leave the barrier, the others from
/// their own release.
fn iteration_time(stamps: &[Stamp], shared: &[bool]) -> f64 {
    let start = stamps
        .iter()
        .zip(shared)
        .filter(|(_, &shared)| shared)
        .map(|(s, _)| s.released_ns)
        .min();
    stamps
        .iter()
        .zip(shared)
        .filter_map(|(s, &shared)| {
            let done = s.done_ns?;
            let start = match start {
                Some(t) if shared => t,
                _ => s.released_ns,
            };
            Some(done.saturating_sub(start))
        })
        .max()
        .unwrap_or(0) as f64
        / 1e9
}

/// Ranks that are threads of one process. The start of an iteration is the first instant any
/// rank left the barrier. A rank that fails calls [`LocalSync::abort`], so the others stop
/// waiting for it.
pub struct LocalSync {
    ranks: u32,
    state: Mutex<LocalState>,
    changed: Condvar,
    /// The barrier's generation, also readable without the lock: waiting ranks poll it
    /// (see [`LocalSync::barrier`]).
    generation: AtomicU64,
}

#[derive(Default)]
struct LocalState {
    /// Barrier generation and how many ranks have arrived at the current one.
    generation: u64,
    arrived: u32,
    /// The stamps handed in for the current iteration.
    stamps: Vec<Option<Stamp>>,
    aborted: bool,
}

impl LocalSync {
    pub fn new(ranks: u32) -> LocalSync {
        LocalSync {
            ranks,
            state: Mutex::new(LocalState {
                stamps: vec![None; ranks as usize],
                ..Default::default()
            }),
            changed: Condvar::new(),
            generation: AtomicU64::new(0),
        }
    }

    /// A rank failed: every rank waiting now or later gets an error.
    pub fn abort(&self) {
        self.state.lock().unwrap().aborted = true;
        self.changed.notify_all();
    }

    fn wait_until<'a>(
        &'a self,
        mut st: std::sync::MutexGuard<'a, LocalState>,
        done: impl Fn(&LocalState) -> bool,
    ) -> std::io::Result<std::sync::MutexGuard<'a, LocalState>> {
        while !done(&st) {
            if st.aborted {
                return Err(std::io::Error::other("another rank failed"));
            }
            st = self.changed.wait(st).unwrap();
        }
        Ok(st)
    }
}

impl RankSync for LocalSync {
    /// The last rank to arrive releases the others, which poll for the release (yielding the
    /// core between looks) for up to [`GO_POLL`] before they sleep, as the ranks of
    /// [`TcpSync`] and MPI's do: a rank woken from a sleep leaves tens of microseconds after
    /// the one that released it (a scheduler wake-up on these virtual CPUs), and that skew
    /// would count in the iteration's time, for the socket baseline as for Phalanx.
    fn barrier(&self, _rank: u32) -> std::io::Result<u64> {
        let mut st = self.state.lock().unwrap();
        let gen = st.generation;
        st.arrived += 1;
        if st.arrived == self.ranks {
            st.arrived = 0;
            st.generation += 1;
            self.generation.store(st.generation, Ordering::Release);
            self.changed.notify_all();
            return Ok(now_ns());
        }
        drop(st);
        let until = Instant::now() + GO_POLL;
        while Instant::now() < until {
            if self.generation.load(Ordering::Acquire) != gen {
                return Ok(now_ns());
            }
            std::thread::yield_now();
        }
        let st = self.state.lock().unwrap();
        drop(self.wait_until(st, |s| s.generation != gen)?);
        Ok(now_ns())
    }

    fn finish(&self, rank: u32, stamp: Stamp) -> std::io::Result<Option<f64>> {
        let mut st = self.state.lock().unwrap();
        st.stamps[rank as usize] = Some(stamp);
        self.changed.notify_all();
        if rank != 0 {
            // The next barrier keeps this rank from handing in its next stamp before rank 0
            // took this one.
            return Ok(None);
        }
        let mut st = self.wait_until(st, |s| s.stamps.iter().all(Option::is_some))?;
        let stamps: Vec<Stamp> = st
            .stamps
            .iter_mut()
            .map(|s| s.take().expect("all in"))
            .collect();
        let shared = vec![true; stamps.len()];
        Ok(Some(iteration_time(&stamps, &shared)))
    }
}

/// How long a rank polls for the release of a barrier before it sleeps.
const GO_POLL: Duration = Duration::from_millis(2);

const ARRIVE: u8 = 1;
const GO: u8 = 2;
const STAMP: u8 = 3;
const HELLO: u8 = 4;
const NONE: u64 = u64::MAX;

fn send(s: &mut TcpStream, tag: u8, a: u64, b: u64) -> std::io::Result<()> {
    let mut f = [0u8; 17];
    f[0] = tag;
    f[1..9].copy_from_slice(&a.to_le_bytes());
    f[9..].copy_from_slice(&b.to_le_bytes());
    s.write_all(&f)
}

fn recv(s: &mut TcpStream, want: u8) -> std::io::Result<(u64, u64)> {
    let mut f = [0u8; 17];
    s.read_exact(&mut f)?;
    parse(&f, want)
}

/// A message of the side channel: its tag must be `want`; its two numbers.
fn parse(f: &[u8; 17], want: u8) -> std::io::Result<(u64, u64)> {
    if f[0] != want {
        return Err(std::io::Error::other(format!(
            "bench sync: expected message {want}, got {}",
            f[0]
        )));
    }
    let a = u64::from_le_bytes(f[1..9].try_into().expect("8 bytes"));
    let b = u64::from_le_bytes(f[9..].try_into().expect("8 bytes"));
    Ok((a, b))
}

/// Like [`recv`], but first polling with `sched_yield` between attempts for up to `poll`,
/// as an MPI rank waits in a barrier: ranks that share cores leave a short barrier as soon as
/// they are scheduled, without a wake-up each. A longer wait (the other ranks still move a
/// large object) sleeps in the kernel, so it takes no CPU from them.
fn recv_polling(s: &mut TcpStream, want: u8, poll: Duration) -> std::io::Result<(u64, u64)> {
    use nix::sys::socket::{recv as recv_flags, MsgFlags};
    use std::os::fd::AsRawFd;
    let until = Instant::now() + poll;
    let mut f = [0u8; 17];
    let mut got = 0;
    while got < f.len() {
        match recv_flags(s.as_raw_fd(), &mut f[got..], MsgFlags::MSG_DONTWAIT) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(nix::errno::Errno::EAGAIN) | Err(nix::errno::Errno::EINTR) => {
                if Instant::now() >= until {
                    s.read_exact(&mut f[got..])?;
                    break;
                }
                std::thread::yield_now();
            }
            Err(e) => return Err(e.into()),
        }
    }
    parse(&f, want)
}

/// Ranks in separate processes: rank 0 listens, every other rank connects to it.
pub struct TcpSync {
    /// Rank 0: the link to rank k at index k - 1; others: the link to rank 0.
    links: Vec<Mutex<TcpStream>>,
    /// Rank 0: per rank, whether its clock is rank 0's.
    shared: Vec<bool>,
    /// Rank 0: the exit skew of the last finished iteration's barrier.
    skew: Mutex<Option<f64>>,
}

impl TcpSync {
    /// Rank 0 accepts `ranks - 1` links on `addr`; the others connect to it, retrying until
    /// `timeout`.
    pub fn connect(
        rank: u32,
        ranks: u32,
        addr: SocketAddr,
        timeout: Duration,
    ) -> std::io::Result<TcpSync> {
        let deadline = Instant::now() + timeout;
        let me = boot_id().unwrap_or(NONE);
        if rank == 0 {
            let l = TcpListener::bind(addr)?;
            l.set_nonblocking(true)?;
            let mut links: Vec<Option<TcpStream>> = (1..ranks).map(|_| None).collect();
            let mut shared = vec![true; ranks as usize];
            while links.iter().any(Option::is_none) {
                match l.accept() {
                    Ok((mut s, _)) => {
                        s.set_nonblocking(false)?;
                        s.set_nodelay(true)?;
                        s.set_read_timeout(Some(timeout))?;
                        let (r, boot) = recv(&mut s, HELLO)?;
                        let slot = (r as usize)
                            .checked_sub(1)
                            .and_then(|i| links.get_mut(i))
                            .filter(|l| l.is_none())
                            .ok_or_else(|| std::io::Error::other(format!("bad rank {r}")))?;
                        *slot = Some(s);
                        shared[r as usize] = boot == me && me != NONE;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if Instant::now() >= deadline {
                            return Err(std::io::Error::new(
                                std::io::ErrorKind::TimedOut,
                                "bench sync: not every rank connected",
                            ));
                        }
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => return Err(e),
                }
            }
            let links = links
                .into_iter()
                .map(|l| Mutex::new(l.expect("all")))
                .collect();
            return Ok(TcpSync {
                links,
                shared,
                skew: Mutex::new(None),
            });
        }
        let mut s = loop {
            match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => return Err(e),
            }
        };
        s.set_nodelay(true)?;
        send(&mut s, HELLO, rank as u64, me)?;
        Ok(TcpSync {
            links: vec![Mutex::new(s)],
            shared: Vec::new(),
            skew: Mutex::new(None),
        })
    }
}

impl RankSync for TcpSync {
    fn barrier(&self, rank: u32) -> std::io::Result<u64> {
        if rank != 0 {
            let mut s = self.links[0].lock().unwrap();
            send(&mut s, ARRIVE, rank as u64, 0)?;
            recv_polling(&mut s, GO, GO_POLL)?;
            return Ok(now_ns());
        }
        for l in &self.links {
            recv(&mut l.lock().unwrap(), ARRIVE)?;
        }
        for l in &self.links {
            send(&mut l.lock().unwrap(), GO, 0, 0)?;
        }
        // Rank 0 leaves once its part of the barrier is done, like every rank.
        Ok(now_ns())
    }

    fn finish(&self, rank: u32, stamp: Stamp) -> std::io::Result<Option<f64>> {
        if rank != 0 {
            let mut s = self.links[0].lock().unwrap();
            send(
                &mut s,
                STAMP,
                stamp.released_ns,
                stamp.done_ns.unwrap_or(NONE),
            )?;
            return Ok(None);
        }
        let mut stamps = vec![stamp];
        for l in &self.links {
            let (released_ns, done) = recv(&mut l.lock().unwrap(), STAMP)?;
            stamps.push(Stamp {
                released_ns,
                done_ns: (done != NONE).then_some(done),
            });
        }
        *self.skew.lock().unwrap() = exit_skew(&stamps, &self.shared);
        Ok(Some(iteration_time(&stamps, &self.shared)))
    }

    fn last_skew(&self) -> Option<f64> {
        *self.skew.lock().unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_time_is_the_last_completion_after_the_start() {
        let s = |rel, done| Stamp {
            released_ns: rel,
            done_ns: done,
        };
        // Shared clock: measured from the first rank to leave the barrier (rank 2 here).
        let st = [s(100, Some(300)), s(150, Some(900)), s(90, None)];
        assert_eq!(iteration_time(&st, &[true; 3]), 810e-9);
        // Rank 1 on another host: from its own release.
        assert_eq!(iteration_time(&st, &[true, false, true]), 750e-9);
        assert_eq!(exit_skew(&st, &[true; 3]), Some(60e-9));
        assert_eq!(exit_skew(&st, &[true, false, true]), Some(10e-9));
        // Rank 0 alone on its clock.
        assert_eq!(iteration_time(&st, &[true, false, false]), 750e-9);
    }

    #[test]
    fn tcp_ranks_meet_and_report() {
        let addr: SocketAddr = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let t = Duration::from_secs(10);
        let others: Vec<_> = (1..3u32)
            .map(|r| {
                std::thread::spawn(move || {
                    let s = TcpSync::connect(r, 3, addr, t).unwrap();
                    for _ in 0..3 {
                        let rel = s.barrier(r).unwrap();
                        std::thread::sleep(Duration::from_millis(10 * r as u64));
                        let st = Stamp {
                            released_ns: rel,
                            done_ns: Some(now_ns()),
                        };
                        assert_eq!(s.finish(r, st).unwrap(), None);
                    }
                })
            })
            .collect();
        let s = TcpSync::connect(0, 3, addr, t).unwrap();
        assert!(s.shared.iter().all(|&x| x), "one host: one clock");
        for _ in 0..3 {
            let rel = s.barrier(0).unwrap();
            let st = Stamp {
                released_ns: rel,
                done_ns: Some(rel),
            };
            let time = s.finish(0, st).unwrap().unwrap();
            assert!((0.020..1.0).contains(&time), "the slowest rank: {time}");
        }
        for h in others {
            h.join().unwrap();
        }
    }
}
