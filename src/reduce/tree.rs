//! The shape of a reduce tree and the choice of its degree.

/// Shape of a d-ary tree over `n` positions, numbered breadth-first (root 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tree {
    pub degree: usize,
    pub parent: Vec<Option<usize>>,
    pub children: Vec<Vec<usize>>,
    /// Positions in generalised in-order; the k-th source to arrive takes `inorder[k]`.
    pub inorder: Vec<usize>,
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
        }
    }

    pub fn is_leaf(&self, p: usize) -> bool {
        self.children[p].is_empty()
    }
}

/// Picks d in 1..=n (d = n: the root takes everyone else) minimising T(1) = nL + S/B and T(d) = L·⌈log_d n⌉ + d·S/B.
pub fn choose_degree(n: usize, size: u64, latency_s: f64, bandwidth_bps: f64) -> usize {
    let s_over_b = size as f64 / bandwidth_bps;
    let cost = |d: usize| -> f64 {
        if d == 1 {
            n as f64 * latency_s + s_over_b
        } else {
            let mut depth = 0;
            let mut reach = 1usize;
            while reach < n {
                reach = reach.saturating_mul(d);
                depth += 1;
            }
            latency_s * depth as f64 + d as f64 * s_over_b
        }
    };
    (1..=n.max(1))
        .min_by(|&a, &b| cost(a).total_cmp(&cost(b)))
        .unwrap_or(1)
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
    fn degree_model() {
        // Large objects: bandwidth dominates, a chain wins.
        assert_eq!(choose_degree(8, 64 << 20, 50e-6, 1.25e9), 1);
        // Tiny objects: latency dominates, a wide tree wins.
        assert!(choose_degree(8, 1024, 50e-6, 1.25e9) >= 4);
    }
}
