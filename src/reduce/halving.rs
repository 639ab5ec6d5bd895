//! Recursive halving and doubling (Rabenseifner's allreduce) over the ranks of one run: the
//! schedule and one rank's part of it, independent of how blocks travel ([`Exchange`]).
//!
//! With `m` ranks and `p` the largest power of two not above `m`, the object is cut into `p`
//! blocks of whole elements. The `m - p` extra ranks first hand their input to a partner
//! among the first `m - p` ranks (step 0). The `p` main ranks then reduce-scatter by
//! recursive halving (`log p` steps: each keeps half of its range, sends its partner the
//! other half and adds the partner's half of its own range), so that rank `r` ends with block
//! `r` fully reduced; and allgather by recursive doubling (`log p` steps, ranges doubling).
//! Last, each extra rank receives the result from its partner. Every main rank sends and
//! receives `(p - 1) / p` of the object in each phase: `2 (p - 1) / p · S` in all, a ring's
//! bytes in `2 log p` messages instead of `2 (p - 1)`.
//!
//! Each block is reduced once, at its owner, and copied from there: every rank ends with the
//! same bytes, also for floating-point types.
//!
//! A reduce (the result at one main rank, the root: Rabenseifner's reduce) keeps the
//! reduce-scatter and replaces the allgather by one step: every other main rank sends its
//! block to the root, which copies them in place. The root receives `(p - 1) / p · S` in
//! `p - 1` messages of one hop each, where a tree of degree `d` feeds it `d · S`; the extra
//! ranks get nothing back.

use crate::ops::{combine, DType, ReduceOp};
use crate::{Error, Result};
use std::ops::Range;

/// How a rank's blocks reach the other ranks: `send` hands `data` (the bytes of `step`) to
/// rank `to`; `recv` returns the bytes rank `from` sent for `step`, waiting for them (the
/// blocking form of [`RankState`], for tests).
#[cfg(test)]
pub(crate) trait Exchange {
    fn send(&self, to: usize, step: u32, data: Vec<u8>) -> Result<()>;
    fn recv(&self, from: usize, step: u32) -> Result<Vec<u8>>;
}

/// The largest power of two not above `m` (`m` >= 1).
fn main_ranks(m: usize) -> usize {
    1 << (usize::BITS - 1 - m.leading_zeros())
}

/// Bytes of blocks `[lo, hi)` when `elems` elements of `esz` bytes are cut into `p` blocks.
fn bytes_of(blocks: Range<usize>, p: usize, elems: u64, esz: u64) -> Range<usize> {
    let at = |b: usize| ((b as u64 * elems / p as u64) * esz) as usize;
    at(blocks.start)..at(blocks.end)
}

/// One message of a rank's schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Step {
    pub id: u32,
    pub partner: usize,
    /// The bytes of this rank's vector it sends (`None`: it sends nothing at this step).
    pub send: Option<Range<usize>>,
    /// Where the partner's bytes go (`None`: it receives nothing), and whether they are
    /// combined into what is there (else copied over it).
    pub recv: Option<(Range<usize>, bool)>,
}

/// Whether a run of `m` ranks can end its reduce at rank `root` (a main rank).
pub(crate) fn can_root(root: usize, m: usize) -> bool {
    m >= 1 && root < main_ranks(m)
}

/// Rank `rank`'s steps, in order, for `m` ranks and an object of `size` bytes of `dtype`:
/// an allreduce (`root` `None`), or a reduce whose result ends at main rank `root` alone.
pub(crate) fn schedule(
    rank: usize,
    m: usize,
    size: u64,
    dtype: DType,
    root: Option<usize>,
) -> Vec<Step> {
    assert!(rank < m, "rank {rank} of {m}");
    assert!(root.is_none_or(|r| can_root(r, m)), "root {root:?} of {m}");
    let p = main_ranks(m);
    let esz = dtype.size() as u64;
    let elems = size / esz;
    let whole = 0..size as usize;
    let extras = m - p;
    let log = p.trailing_zeros();
    let mut steps = Vec::new();
    if rank >= p {
        // An extra rank: its input to its partner, the result back.
        let partner = rank - p;
        steps.push(Step {
            id: 0,
            partner,
            send: Some(whole.clone()),
            recv: None,
        });
        if root.is_some() {
            return steps;
        }
        steps.push(Step {
            id: 2 * log + 1,
            partner,
            send: None,
            recv: Some((whole, false)),
        });
        return steps;
    }
    if rank < extras {
        steps.push(Step {
            id: 0,
            partner: rank + p,
            send: None,
            recv: Some((whole.clone(), true)),
        });
    }
    // Reduce-scatter: halving.
    let (mut lo, mut hi) = (0, p);
    for (k, mask) in (0..log).map(|k| (k, p >> (k + 1))) {
        let mid = (lo + hi) / 2;
        let (keep, give) = if rank & mask == 0 {
            (lo..mid, mid..hi)
        } else {
            (mid..hi, lo..mid)
        };
        steps.push(Step {
            id: 1 + k,
            partner: rank ^ mask,
            send: Some(bytes_of(give, p, elems, esz)),
            recv: Some((bytes_of(keep.clone(), p, elems, esz), true)),
        });
        (lo, hi) = (keep.start, keep.end);
    }
    if let Some(root) = root {
        // Gather at the root: block q comes from main rank q.
        let gather = 1 + log;
        if rank == root {
            for q in (0..p).filter(|&q| q != root) {
                steps.push(Step {
                    id: gather,
                    partner: q,
                    send: None,
                    recv: Some((bytes_of(q..q + 1, p, elems, esz), false)),
                });
            }
        } else {
            debug_assert_eq!((lo, hi), (rank, rank + 1));
            steps.push(Step {
                id: gather,
                partner: root,
                send: Some(bytes_of(lo..hi, p, elems, esz)),
                recv: None,
            });
        }
        return steps;
    }
    // Allgather: doubling.
    for k in 0..log {
        let mask = 1 << k;
        let len = hi - lo;
        let theirs = if rank & mask == 0 {
            hi..hi + len
        } else {
            lo - len..lo
        };
        steps.push(Step {
            id: 1 + log + k,
            partner: rank ^ mask,
            send: Some(bytes_of(lo..hi, p, elems, esz)),
            recv: Some((bytes_of(theirs.clone(), p, elems, esz), false)),
        });
        (lo, hi) = (lo.min(theirs.start), hi.max(theirs.end));
    }
    if rank < extras {
        steps.push(Step {
            id: 2 * log + 1,
            partner: rank + p,
            send: Some(whole),
            recv: None,
        });
    }
    steps
}

/// Runs of at most this many ranks get the plan from the coordinator itself: one hop, where
/// the binomial tree takes `ceil(log2 m)`, each a wake-up of the rank that hands it on. Its
/// `m - 1` sends are small and go out back to back (a few microseconds each), so up to here
/// the last rank has the plan sooner; beyond, the tree keeps any one sender's share at
/// `log2 m`.
pub(crate) const FLAT_PLAN: usize = 16;

/// The rank whose block `rank` waits for first: its partner of step 0 (an extra rank and the
/// main rank it hands its input to) or of the first halving step.
fn first_partner(rank: usize, m: usize) -> usize {
    let p = main_ranks(m);
    match rank {
        r if r >= p => r - p,
        r if r < m - p => r + p,
        r if p > 1 => r ^ (p >> 1),
        r => r,
    }
}

/// The ranks `rank` hands the plan on to, in the order they get it, over `m` ranks whose
/// coordinator has rank `root`.
///
/// Up to [`FLAT_PLAN`] ranks the coordinator tells them all: first its own first partner,
/// then the others two by two, each rank next to its first partner, so that the pairs that
/// trade the first blocks start together. Beyond, a binomial tree, largest subtree first: the
/// plan reaches every rank in `ceil(log2 m)` hops, each rank sending at most that many.
pub(crate) fn plan_children(rank: usize, m: usize, root: usize) -> Vec<usize> {
    debug_assert!(rank < m && root < m);
    if m <= FLAT_PLAN {
        if rank != root {
            return Vec::new();
        }
        let first = first_partner(root, m);
        let mut order: Vec<usize> = (0..m).filter(|&q| q != root && q != first).collect();
        order.sort_by_key(|&q| (q.min(first_partner(q, m)), q));
        order.insert(0, first);
        order.retain(|&q| q != root); // a run of one: its own partner
        return order;
    }
    let i = (rank + m - root) % m;
    // Children of relative index i: i + 2^j for every 2^j below i's lowest set bit (every j
    // for the root) that stays inside the run.
    let low = if i == 0 {
        m.next_power_of_two()
    } else {
        1 << i.trailing_zeros()
    };
    let mut kids = Vec::new();
    let mut step = low >> 1;
    while step > 0 {
        if i + step < m {
            kids.push((i + step + root) % m);
        }
        step >>= 1;
    }
    kids
}

/// The rank that hands `rank` the plan in [`plan_children`]'s tree (`None` for the root).
pub(crate) fn plan_parent(rank: usize, m: usize, root: usize) -> Option<usize> {
    if m <= FLAT_PLAN {
        return (rank != root).then_some(root);
    }
    let i = (rank + m - root) % m;
    (i != 0).then(|| (i - (1 << i.trailing_zeros()) + root) % m)
}

/// One rank's part of a run as a state machine: [`RankState::advance`] does every step it
/// can with the blocks at hand and stops at the first block still missing, so whichever
/// thread a block lands on can carry the rank on (no thread waits for it).
pub(crate) struct RankState {
    steps: Vec<Step>,
    /// The next step to do, and whether its send is done.
    next: usize,
    sent: bool,
    v: Vec<u8>,
    op: ReduceOp,
    dtype: DType,
}

impl RankState {
    /// Rank `rank` of `m` over `input` (this rank's bytes); `root`: a reduce whose result
    /// ends at that main rank alone ([`schedule`]).
    pub fn new(
        rank: usize,
        m: usize,
        input: Vec<u8>,
        (op, dtype): (ReduceOp, DType),
        root: Option<usize>,
    ) -> Result<Self> {
        let size = input.len() as u64;
        if rank >= m || root.is_some_and(|r| !can_root(r, m)) {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} (root {root:?}) of a run of {m}"
            )));
        }
        if !size.is_multiple_of(dtype.size() as u64) {
            return Err(Error::InvalidArgument(format!(
                "{size} bytes are not whole {dtype:?} elements"
            )));
        }
        Ok(RankState {
            steps: schedule(rank, m, size, dtype, root),
            next: 0,
            sent: false,
            v: input,
            op,
            dtype,
        })
    }

    /// The (partner rank, step) whose block the rank waits for; `None` once done.
    pub fn waits_for(&self) -> Option<(usize, u32)> {
        self.steps.get(self.next).map(|s| (s.partner, s.id))
    }

    pub fn is_done(&self) -> bool {
        self.next == self.steps.len()
    }

    /// The result, once done.
    pub fn into_result(self) -> Option<Vec<u8>> {
        self.is_done().then_some(self.v)
    }

    /// Does every step it can: sends with `send`, takes blocks with `take` (`None`: not
    /// there yet, the rank stops and waits). A block of the wrong length is an error.
    pub fn advance(
        &mut self,
        send: &mut dyn FnMut(usize, u32, Vec<u8>) -> Result<()>,
        take: &mut dyn FnMut(usize, u32) -> Result<Option<Vec<u8>>>,
    ) -> Result<()> {
        while let Some(step) = self.steps.get(self.next) {
            if !self.sent {
                if let Some(r) = &step.send {
                    send(step.partner, step.id, self.v[r.clone()].to_vec())?;
                }
                self.sent = true;
            }
            if let Some((r, add)) = &step.recv {
                let Some(got) = take(step.partner, step.id)? else {
                    return Ok(());
                };
                if got.len() != r.len() {
                    return Err(Error::InvalidArgument(format!(
                        "allreduce step {} from rank {}: {} bytes, expected {}",
                        step.id,
                        step.partner,
                        got.len(),
                        r.len()
                    )));
                }
                if *add {
                    combine(self.op, self.dtype, &mut self.v[r.clone()], &got);
                } else {
                    self.v[r.clone()].copy_from_slice(&got);
                }
            }
            self.next += 1;
            self.sent = false;
        }
        Ok(())
    }
}

/// Runs rank `rank`'s part of an allreduce (or, with `root`, a reduce) of `m` ranks over
/// `input` (this rank's bytes) to its end on the calling thread, waiting for each block, and
/// returns its vector (the result, at every rank of an allreduce and at a reduce's root).
#[cfg(test)]
pub(crate) fn run_rank(
    rank: usize,
    m: usize,
    input: Vec<u8>,
    kind: (ReduceOp, DType),
    root: Option<usize>,
    ex: &dyn Exchange,
) -> Result<Vec<u8>> {
    let mut st = RankState::new(rank, m, input, kind, root)?;
    st.advance(
        &mut |to, step, data| ex.send(to, step, data),
        &mut |from, step| ex.recv(from, step).map(Some),
    )?;
    Ok(st.into_result().expect("every block was waited for"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crossbeam_channel::{unbounded, Receiver, Sender};
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// Ranks of one process: a channel per rank, blocks kept until asked for.
    struct Local {
        me: usize,
        to: Vec<Sender<(usize, u32, Vec<u8>)>>,
        from: Receiver<(usize, u32, Vec<u8>)>,
        early: Mutex<HashMap<(usize, u32), Vec<u8>>>,
    }

    impl Exchange for Local {
        fn send(&self, to: usize, step: u32, data: Vec<u8>) -> Result<()> {
            self.to[to].send((self.me, step, data)).unwrap();
            Ok(())
        }
        fn recv(&self, from: usize, step: u32) -> Result<Vec<u8>> {
            if let Some(d) = self.early.lock().unwrap().remove(&(from, step)) {
                return Ok(d);
            }
            loop {
                let (f, s, d) = self
                    .from
                    .recv_timeout(std::time::Duration::from_secs(10))
                    .map_err(|_| {
                        Error::Timeout(std::time::Duration::from_secs(10), "test exchange".into())
                    })?;
                if (f, s) == (from, step) {
                    return Ok(d);
                }
                self.early.lock().unwrap().insert((f, s), d);
            }
        }
    }

    fn all_ranks(
        inputs: Vec<Vec<u8>>,
        op: ReduceOp,
        dtype: DType,
        root: Option<usize>,
    ) -> Vec<Vec<u8>> {
        let m = inputs.len();
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..m).map(|_| unbounded()).unzip();
        std::thread::scope(|s| {
            let hs: Vec<_> = inputs
                .into_iter()
                .zip(rxs)
                .enumerate()
                .map(|(r, (input, rx))| {
                    let ex = Local {
                        me: r,
                        to: txs.clone(),
                        from: rx,
                        early: Mutex::new(HashMap::new()),
                    };
                    s.spawn(move || run_rank(r, m, input, (op, dtype), root, &ex).unwrap())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn input(rank: usize, elems: usize, dtype: DType) -> Vec<u8> {
        (0..elems)
            .flat_map(|i| {
                let x = ((rank * 7919 + i * 104729) % 1000) as i64 - 500;
                match dtype {
                    DType::F32 => (x as f32 / 8.0).to_le_bytes().to_vec(),
                    DType::F64 => (x as f64 / 8.0).to_le_bytes().to_vec(),
                    DType::I32 => (x as i32).to_le_bytes().to_vec(),
                    DType::I64 => x.to_le_bytes().to_vec(),
                    DType::U8 => vec![x as u8],
                }
            })
            .collect()
    }

    #[test]
    fn every_rank_ends_with_the_reduce_of_every_input() {
        let ops = [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Prod];
        let dtypes = [DType::F32, DType::F64, DType::I32, DType::I64, DType::U8];
        for m in 1..=9 {
            for (op, dtype) in ops
                .iter()
                .flat_map(|o| dtypes.iter().map(move |d| (*o, *d)))
            {
                // Uneven blocks: an element count no power of two divides.
                let elems = 1000 + m;
                let inputs: Vec<Vec<u8>> = (0..m).map(|r| input(r, elems, dtype)).collect();
                let mut want = inputs[0].clone();
                for x in &inputs[1..] {
                    combine(op, dtype, &mut want, x);
                }
                let got = all_ranks(inputs.clone(), op, dtype, None);
                let what = format!("{m} ranks, {op:?} {dtype:?}");
                // Every rank has the same bytes, whatever the type.
                assert!(got.iter().all(|g| g == &got[0]), "ranks differ: {what}");
                // A reduce to any main rank ends there with the allreduce's very bytes.
                for root in (0..main_ranks(m)).filter(|r| r % 3 == 0 || *r + 1 == m) {
                    let at = all_ranks(inputs.clone(), op, dtype, Some(root));
                    assert!(
                        at[root] == got[0],
                        "{what}: the reduce at rank {root} differs"
                    );
                }
                // Integers, min and max exactly, float sums too (the inputs are multiples of
                // 1/8); float products in another order round differently.
                let float = matches!(dtype, DType::F32 | DType::F64);
                if float && op == ReduceOp::Prod {
                    let f = |b: &[u8]| -> Vec<f64> {
                        match dtype {
                            DType::F32 => b
                                .chunks(4)
                                .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                                .collect(),
                            _ => b
                                .chunks(8)
                                .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                                .collect(),
                        }
                    };
                    for (a, b) in f(&got[0]).iter().zip(f(&want)) {
                        assert!(
                            (a - b).abs() <= 1e-5 * b.abs().max(1e-30),
                            "{what}: {a} {b}"
                        );
                    }
                } else {
                    assert!(got[0] == want, "result differs from the reference: {what}");
                }
            }
        }
    }

    #[test]
    fn main_ranks_send_a_rings_bytes_in_twice_log_p_messages() {
        let size = 64 << 10;
        for (m, p) in [(8usize, 8usize), (6, 4), (5, 4), (2, 2)] {
            for r in 0..m {
                let steps = schedule(r, m, size, DType::F32, None);
                let sent: usize = steps
                    .iter()
                    .filter_map(|s| s.send.clone())
                    .map(|x| x.len())
                    .sum();
                let log = p.trailing_zeros() as usize;
                let extra_pair = r < m - p;
                if r >= p {
                    assert_eq!(steps.len(), 2);
                    assert_eq!(sent, size as usize);
                } else {
                    assert_eq!(steps.len(), 2 * log + 2 * extra_pair as usize);
                    let ring = 2 * (p - 1) * size as usize / p;
                    let own = if extra_pair { size as usize } else { 0 };
                    assert_eq!(sent, ring + own, "rank {r} of {m}");
                }
                // Partners are ranks of the run, never the rank itself.
                assert!(steps.iter().all(|s| s.partner < m && s.partner != r));
            }
        }
    }

    #[test]
    fn a_reduce_root_receives_the_object_once_in_p_minus_one_messages() {
        let size = 64u64 << 10;
        for (m, p) in [(8usize, 8usize), (6, 4), (5, 4), (2, 2)] {
            let log = p.trailing_zeros() as usize;
            for root in [0, p - 1] {
                let all: Vec<Vec<Step>> = (0..m)
                    .map(|r| schedule(r, m, size, DType::F32, Some(root)))
                    .collect();
                let bytes = |s: &Step| s.recv.as_ref().map_or(0, |(r, _)| r.len());
                // The root's gather: one message from every other main rank, each block
                // once, together the rest of the object.
                let gather: Vec<&Step> = all[root]
                    .iter()
                    .filter(|s| s.id == 1 + log as u32)
                    .collect();
                assert_eq!(gather.len(), p - 1, "{m} ranks, root {root}");
                let got: usize = gather.iter().map(|s| bytes(s)).sum();
                let own = bytes_of(root..root + 1, p, size / 4, 4).len();
                assert_eq!(got + own, size as usize);
                for (r, steps) in all.iter().enumerate() {
                    // Extra ranks hand their input on and are done; main ranks send their
                    // block to the root last; nobody but the root gets the result.
                    if r >= p {
                        assert_eq!(steps.len(), 1);
                    } else if r != root {
                        let last = steps.last().unwrap();
                        assert_eq!((last.partner, last.recv.clone()), (root, None));
                        assert_eq!(
                            last.send.as_ref().unwrap().len(),
                            bytes_of(r..r + 1, p, size / 4, 4).len()
                        );
                    }
                    assert!(steps.iter().all(|s| s.id <= 1 + log as u32));
                }
            }
        }
        assert!(can_root(3, 6) && !can_root(4, 6) && !can_root(0, 0));
    }

    #[test]
    fn the_plan_reaches_every_rank_once_in_one_hop_or_log_hops() {
        for m in 2..=40 {
            for root in [0, 1, m / 2, m - 1] {
                let mut got = vec![0usize; m];
                let mut depth = vec![0u32; m];
                let mut todo = vec![root];
                while let Some(r) = todo.pop() {
                    let kids = plan_children(r, m, root);
                    if m > FLAT_PLAN {
                        assert!(kids.len() <= m.next_power_of_two().trailing_zeros() as usize);
                    }
                    for k in kids {
                        got[k] += 1;
                        depth[k] = depth[r] + 1;
                        assert_eq!(plan_parent(k, m, root), Some(r), "m {m} root {root}");
                        todo.push(k);
                    }
                }
                assert_eq!(plan_parent(root, m, root), None);
                for (r, &n) in got.iter().enumerate() {
                    assert_eq!(n, usize::from(r != root), "m {m} root {root} rank {r}");
                }
                let bound = match m <= FLAT_PLAN {
                    true => 1,
                    false => m.next_power_of_two().trailing_zeros(),
                };
                assert!(depth.iter().all(|&d| d <= bound), "m {m}: {depth:?}");
            }
        }
        // Small runs: the coordinator tells every rank, its first partner first, then the
        // pairs of the first step together.
        assert_eq!(plan_children(0, 8, 0), vec![4, 1, 5, 2, 6, 3, 7]);
        assert_eq!(plan_children(2, 8, 2), vec![6, 0, 4, 1, 5, 3, 7]);
        assert!(plan_children(4, 8, 0).is_empty());
        assert_eq!(plan_parent(6, 8, 3), Some(3));
        // 6 ranks: 4 main, 2 extra (4 and 5 hand their inputs to 0 and 1; 2 and 3 trade
        // with 0 and 1 first).
        assert_eq!(plan_children(1, 6, 1), vec![5, 0, 2, 4, 3]);
        // Large runs: a binomial tree, the root's first child its first-step partner.
        assert_eq!(plan_children(0, 32, 0), vec![16, 8, 4, 2, 1]);
        assert_eq!(plan_children(16, 32, 0), vec![24, 20, 18, 17]);
    }

    #[test]
    fn a_short_block_is_an_error_not_a_panic() {
        struct Short;
        impl Exchange for Short {
            fn send(&self, _: usize, _: u32, _: Vec<u8>) -> Result<()> {
                Ok(())
            }
            fn recv(&self, _: usize, _: u32) -> Result<Vec<u8>> {
                Ok(vec![0; 3])
            }
        }
        let kind = (ReduceOp::Sum, DType::F32);
        let r = run_rank(0, 2, vec![0; 64], kind, None, &Short);
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        let odd = run_rank(0, 2, vec![0; 6], kind, None, &Short);
        assert!(matches!(odd, Err(Error::InvalidArgument(_))), "{odd:?}");
        // A reduce rooted at an extra rank, or a rank outside the run: refused, no panic.
        let extra = run_rank(0, 6, vec![0; 64], kind, Some(4), &Short);
        assert!(matches!(extra, Err(Error::InvalidArgument(_))), "{extra:?}");
        let outside = run_rank(7, 6, vec![0; 64], kind, Some(0), &Short);
        assert!(
            matches!(outside, Err(Error::InvalidArgument(_))),
            "{outside:?}"
        );
    }
}
