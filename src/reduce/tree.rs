//! The shape of a reduce tree and the choice of its degree.

/// Shape of a d-ary tree over `n` positions, numbered breadth-first (root 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tree {
    pub degree: usize,
    pub parent: Vec<Option<usize>>,
    pub children: Vec<Vec<usize>>,
    /// Positions in generalised in-order; the k-th source to arrive takes `inorder[k]`.
    pub inorder: Vec<usize>,
    /// Shaped by the inputs' arrival ([`Tree::by_arrival`]), not a d-ary tree.
    pub by_arrival: bool,
}

impl Tree {
    pub fn new(n: usize, degree: usize) -> Tree {
        let d = degree.clamp(1, n.saturating_sub(1).max(1));
        let parent: Vec<Option<usize>> = (0..n)
            .map(|i| if i == 0 { None } else { Some((i - 1) / d) })
            .collect();
        let mut children = vec![Vec::new(); n];
        for (i, p) in parent.iter().enumerate() {
            if let Some(p) = p {
                children[*p].push(i);
            }
        }
        let mut inorder = Vec::with_capacity(n);
        fn visit(i: usize, ch: &[Vec<usize>], out: &mut Vec<usize>) {
            if let Some((first, rest)) = ch[i].split_first() {
                visit(*first, ch, out);
                out.push(i);
                for c in rest {
                    visit(*c, ch, out);
                }
            } else {
                out.push(i);
            }
        }
        if n > 0 {
            visit(0, &children, &mut inorder);
        }
        Tree {
            degree: d,
            parent,
            children,
            inorder,
            by_arrival: false,
        }
    }

    /// A tree for inputs that come one after another, rooted at the `root`-th arrival: the
    /// arrivals before it form a chain in arrival order (the earliest deepest), the root's
    /// first child, and each arrival after it is a leaf under the root. The chain combines
    /// its inputs as they come, before the root is there; the root's task starts as soon as
    /// it is placed (`Run::dispatchable`) and pulls each later leaf's slice as it comes (it
    /// combines once the last one's bytes land). So the root's downlink takes one partial
    /// and one slice per later arrival, each as it comes, and no arrival's partial waits on
    /// a later one.
    ///
    /// Partitions reduced side by side with roots 0, 1, ... have their roots on different
    /// nodes. Once the last input comes, what is left to carry is its slices, one to each
    /// root, and the results: no node forwards a chain's partial then (a chain through the
    /// late arrivals would have their downlinks take the partials and then the results).
    pub fn by_arrival(n: usize, root: usize) -> Tree {
        let root = root.min(n.saturating_sub(1));
        // Positions: 0 the root, 1 ..= root the chain from its top (arrival root - 1) down
        // to arrival 0, and arrival k > root at position k.
        let position = |k: usize| match k.cmp(&root) {
            std::cmp::Ordering::Less => root - k,
            std::cmp::Ordering::Equal => 0,
            std::cmp::Ordering::Greater => k,
        };
        let inorder: Vec<usize> = (0..n).map(position).collect();
        // A chain position's parent is the one above it; the chain's top's and every later
        // arrival's is the root.
        let parent: Vec<Option<usize>> = (0..n)
            .map(|p| match p {
                0 => None,
                p if p <= root => Some(p - 1),
                _ => Some(0),
            })
            .collect();
        let mut children = vec![Vec::new(); n];
        for (p, up) in parent.iter().enumerate() {
            if let Some(up) = up {
                children[*up].push(p);
            }
        }
        Tree {
            degree: children.first().map_or(1, |c| c.len().max(1)),
            parent,
            children,
            inorder,
            by_arrival: true,
        }
    }

    /// The allgather of a partition reduced by this tree, if it has one (see
    /// `Run::gather_hints`): positions in order, each with the earlier position whose node
    /// it fetches the result from (`None`: the root, which makes it). A chain's is the root,
    /// then from the leaf up to the root's child, each from the one before (with the
    /// partitions' chains rotated, a ring). A tree by arrival's is a binary tree from the
    /// root over the early arrivals (rotated with the root, so that over the partitions, one
    /// rooted at each arrival, every early node takes every place), with the two latest
    /// arrivals its last leaves: their uplinks carry their own slices while the results
    /// stream, so they forward nothing, and a root that is one of them sends one copy. With
    /// 8 inputs every early node sends 9 copies and the two latest 1; the deepest is 4 hops
    /// from its root (a chain of 7 made the last chunk wait at every hop). Other trees have
    /// none (every node fetches from the root).
    pub fn gather_order(&self) -> Option<Vec<(usize, Option<usize>)>> {
        let n = self.parent.len();
        if !self.by_arrival {
            if self.degree != 1 {
                return None;
            }
            let order: Vec<usize> = std::iter::once(0).chain((1..n).rev()).collect();
            let from = std::iter::once(None).chain(order.iter().map(|&p| Some(p)));
            return Some(order.iter().copied().zip(from).collect());
        }
        // Arrivals: the root's, the two latest (their uplinks carry their own slices while
        // the results stream: they forward nothing), and the others, early, which forward
        // the result down a binary tree (a chain of 7 hops made the last chunk wait at each).
        if n == 0 {
            return Some(Vec::new());
        }
        let root = self.inorder.iter().position(|&p| p == 0).unwrap_or(0);
        let late = |k: usize| k + 2 >= n;
        let mut early: Vec<usize> = (0..n).filter(|&k| k != root && !late(k)).collect();
        // Rotated so that each early node takes each place in turn over the partitions (one
        // rooted at each arrival): an early root's list starts just after it; the two late
        // roots' lists start at the first and at the middle.
        let turn = match late(root) {
            false => early.iter().filter(|&&k| k < root).count(),
            true if root + 1 == n => early.len() / 2,
            true => 0,
        };
        let turn = turn.min(early.len());
        early.rotate_left(turn);
        let list: Vec<usize> = std::iter::once(root)
            .chain(early)
            .chain((0..n).filter(|&k| k != root && late(k)))
            .collect();
        // A late root sends one copy (its uplink is busy too), an early one two; every
        // early node forwards to at most two.
        let up = |i: usize| match (late(root), i) {
            (_, 0) => None,
            (false, i) => Some((i - 1) / 2),
            (true, 1) => Some(0),
            (true, i) => Some(1 + (i - 2) / 2),
        };
        let order: Vec<(usize, Option<usize>)> = (0..list.len())
            .map(|i| (self.inorder[list[i]], up(i).map(|j| self.inorder[list[j]])))
            .collect();
        Some(order)
    }

    pub fn is_leaf(&self, p: usize) -> bool {
        self.children[p].is_empty()
    }
}

/// Picks the degree d (1 to n - 1; more is a star anyway) that minimises the time a d-ary
/// tree of `n` inputs of `size` bytes takes when each node forwards its output in
/// `chunk`-byte pieces, with link latency `latency_s` and bandwidth `bandwidth_bps`.
///
/// A node sends its first piece once the first piece of each of its k children is in: the
/// latest child's first piece plus L, then k pieces through the node's downlink (k·c/B, with
/// c = min(chunk, S)); a leaf has its own at once. Once the root has its first piece, the
/// rest of the stream follows at the pace of the busiest downlink: max k·(S - c)/B.
///
/// For a large object in small pieces this is the pipelined n·L + S/B of a chain against
/// h·L + d·S/B of a tree of height h. An object of one piece is stored and forwarded whole
/// at every hop, which no chain makes up for; and a tree's partly filled last level counts
/// for what it holds (8 inputs in a binary tree: 5 pieces on the slowest path, not 6).
pub fn choose_degree(n: usize, size: u64, chunk: u64, latency_s: f64, bandwidth_bps: f64) -> usize {
    /// Candidate degrees beyond this are only tried as the star (d = n - 1).
    const MOST: usize = 64;
    let c = chunk.clamp(1, size.max(1)) as f64;
    let rest = (size as f64 - c).max(0.0);
    let mut ready = vec![0f64; n.max(1)];
    let mut cost = |d: usize| -> f64 {
        // Children of p are d·p + 1 ..= d·p + d: all after p, so one pass from the end.
        let mut widest = 0usize;
        for p in (0..n).rev() {
            let first = (d * p + 1).min(n);
            let last = (d * p + d).min(n - 1);
            let kids = if first > last { 0 } else { last + 1 - first };
            widest = widest.max(kids);
            ready[p] = match kids {
                0 => 0.0,
                k => {
                    let latest = ready[first..=last].iter().copied().fold(0.0, f64::max);
                    latest + latency_s + k as f64 * c / bandwidth_bps
                }
            };
        }
        ready[0] + widest as f64 * rest / bandwidth_bps
    };
    let star = n.saturating_sub(1).max(1);
    (1..=star.min(MOST))
        .chain((star > MOST).then_some(star))
        .map(|d| (d, cost(d)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map_or(1, |(d, _)| d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_inorder_starts_at_the_deepest() {
        let t = Tree::new(4, 1);
        assert_eq!(t.parent, vec![None, Some(0), Some(1), Some(2)]);
        assert_eq!(t.inorder, vec![3, 2, 1, 0]);
    }

    #[test]
    fn binary_inorder() {
        let t = Tree::new(7, 2);
        assert_eq!(t.children[0], vec![1, 2]);
        assert_eq!(t.inorder, vec![3, 1, 4, 0, 5, 2, 6]);
        let star = Tree::new(5, 99);
        assert_eq!(star.degree, 4);
        assert_eq!(star.inorder, vec![1, 0, 2, 3, 4]);
    }

    #[test]
    fn trees_by_arrival_chain_the_arrivals_before_the_root_and_take_the_later_ones_as_leaves() {
        // Rooted at the third arrival of six: arrivals 0 and 1 chained under it (0
        // deepest), arrivals 3, 4 and 5 leaves under it.
        let t = Tree::by_arrival(6, 2);
        assert_eq!(t.inorder, vec![2, 1, 0, 3, 4, 5]);
        assert_eq!(
            t.parent,
            vec![None, Some(0), Some(1), Some(0), Some(0), Some(0)]
        );
        assert_eq!(t.children[0], vec![1, 3, 4, 5]);
        assert!((3..6).all(|p| t.is_leaf(p)) && t.is_leaf(2));
        // The allgather: the root sends to two early arrivals, each of those to two more,
        // the two latest last.
        let order = vec![
            (0, None),
            (3, Some(0)),
            (2, Some(0)),
            (1, Some(3)),
            (4, Some(3)),
            (5, Some(2)),
        ];
        assert_eq!(t.gather_order(), Some(order));
        // Rooted at the last arrival: one chain, and so is the allgather.
        let t = Tree::by_arrival(4, 3);
        assert_eq!(t.inorder, vec![3, 2, 1, 0]);
        assert_eq!(t.children[0], vec![1]);
        // Its allgather: the root (late) sends one copy, to arrival 1 (the middle of the
        // early ones), which sends to arrival 0 and to the other late one.
        let order = vec![(0, None), (2, Some(0)), (3, Some(2)), (1, Some(2))];
        assert_eq!(t.gather_order(), Some(order));
        assert_eq!(Tree::by_arrival(4, 9).inorder, t.inorder);
        // Rooted at the first: a star.
        let t = Tree::by_arrival(4, 0);
        assert_eq!(t.inorder, vec![0, 1, 2, 3]);
        assert_eq!(t.children[0], vec![1, 2, 3]);
        let star = vec![(0, None), (1, Some(0)), (2, Some(0)), (3, Some(1))];
        assert_eq!(t.gather_order(), Some(star));
        for n in 1..9 {
            for r in 0..n {
                let t = Tree::by_arrival(n, r);
                // Every arrival takes its own position, the root-th the root.
                let mut seen = t.inorder.clone();
                seen.sort_unstable();
                assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n {n} root {r}");
                assert_eq!(t.inorder[r], 0);
                assert_eq!(t.parent.iter().filter(|p| p.is_none()).count(), 1);
                // Every position's children came before it or are leaves under the root.
                for (k, &p) in t.inorder.iter().enumerate() {
                    for &c in &t.children[p] {
                        let kc = t.inorder.iter().position(|&q| q == c).unwrap();
                        assert!(kc < k || (p == 0 && t.is_leaf(c)), "n {n} root {r}");
                    }
                }
                // The allgather names every position once, each from an earlier one.
                let order = t.gather_order().expect("trees by arrival have one");
                let mut seen: Vec<usize> = order.iter().map(|o| o.0).collect();
                seen.sort_unstable();
                assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n {n} root {r}");
                for (k, (_, from)) in order.iter().enumerate() {
                    assert_eq!(from.is_none(), k == 0);
                    assert!(from.is_none_or(|f| order[..k].iter().any(|o| o.0 == f)));
                }
            }
        }
        // Partitions rooted at every arrival in turn (an allreduce of 8 inputs): the two
        // latest arrivals send one copy each (of their own partition), every other node 9;
        // none is more than 4 hops from its root.
        let n = 8;
        let mut sent = vec![0; n];
        for r in 0..n {
            let t = Tree::by_arrival(n, r);
            let arrival = |p: usize| t.inorder.iter().position(|&q| q == p).unwrap();
            let order = t.gather_order().unwrap();
            let from = |p: usize| order.iter().find(|o| o.0 == p).unwrap().1;
            for &(p, f) in &order {
                if let Some(f) = f {
                    sent[arrival(f)] += 1;
                }
                let hops = std::iter::successors(Some(p), |&q| from(q)).count() - 1;
                assert!(hops <= 4, "root {r}: position {p} is {hops} hops away");
            }
        }
        assert_eq!(sent, vec![9, 9, 9, 9, 9, 9, 1, 1]);
        let chain = vec![(0, None), (3, Some(0)), (2, Some(3)), (1, Some(2))];
        assert_eq!(Tree::new(4, 1).gather_order(), Some(chain));
        assert_eq!(Tree::new(4, 2).gather_order(), None);
        // Small trees by arrival.
        let t = Tree::by_arrival(2, 0);
        assert_eq!(t.gather_order(), Some(vec![(0, None), (1, Some(0))]));
        let t = Tree::by_arrival(3, 2);
        assert_eq!(
            t.gather_order(),
            Some(vec![(0, None), (2, Some(0)), (1, Some(2))])
        );
    }

    #[test]
    fn degree_model() {
        // Large objects in small pieces: bandwidth dominates, a chain wins.
        assert_eq!(choose_degree(8, 64 << 20, 4 << 20, 50e-6, 1.25e9), 1);
        assert_eq!(choose_degree(8, 1 << 20, 64 << 10, 30e-6, 1.1e8), 1);
        // Tiny objects: latency dominates, a wide tree wins.
        assert!(choose_degree(8, 1024, 64 << 10, 50e-6, 1.25e9) >= 4);
        // An object of one piece is forwarded whole at every hop: never a chain, even on a
        // slow link with little latency (a 64 KiB reduce over 1 Gbit/s).
        assert!(choose_degree(8, 64 << 10, 64 << 10, 30e-6, 1.1e8) > 1);
        assert!(choose_degree(8, 64 << 10, 4 << 20, 30e-6, 1.25e9) > 1);
        // ... and a binary tree of 8 has one node with a single child on its slowest path:
        // 5 pieces through downlinks against a ternary tree's 6 (the best measured on 8
        // emulated hosts at 1 Gbit/s: 0.9-1.2 ms against 1.1-1.4 ms).
        assert_eq!(choose_degree(8, 64 << 10, 64 << 10, 30e-6, 1.1e8), 2);
        assert_eq!(choose_degree(8, 64 << 10, 64 << 10, 30e-6, 1.25e9), 2);
        // Degenerate and large trees.
        assert_eq!(choose_degree(1, 1024, 1024, 1e-4, 1e9), 1);
        assert_eq!(choose_degree(2, 1024, 1024, 1e-4, 1e9), 1);
        let d = choose_degree(1000, 1024, 1024, 1e-4, 1e9);
        assert!((2..=999).contains(&d), "{d}");
    }
}
