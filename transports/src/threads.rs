//! Every thread a node starts goes through [`spawn`], which names it `phx-{role}-{node}` and
//! counts it for its node: how many run now and the most that ran at once, so the scale
//! figures (threads per node whatever the cluster size) are measured, not assumed. The counts
//! are per process and keyed by node id (a process that runs two clusters adds them up).

use crate::NodeId;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::thread::JoinHandle;

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ThreadCount {
    /// Threads of the node running now.
    pub live: usize,
    /// The most that ran at once since the last [`reset_peaks`].
    pub peak: usize,
}

#[derive(Default)]
struct Table {
    nodes: HashMap<NodeId, ThreadCount>,
    /// The same per node and role (the name without the node, digits dropped: `rx3` and
    /// `rx5` are both `rx`).
    roles: HashMap<(NodeId, String), ThreadCount>,
}

fn table() -> &'static Mutex<Table> {
    static T: OnceLock<Mutex<Table>> = OnceLock::new();
    T.get_or_init(|| Mutex::new(Table::default()))
}

fn up(c: &mut ThreadCount) {
    c.live += 1;
    c.peak = c.peak.max(c.live);
}

/// Takes the thread off its node's count when it ends, however it ends.
struct Counted(NodeId, String);

impl Drop for Counted {
    fn drop(&mut self) {
        let mut t = table().lock().unwrap();
        if let Some(c) = t.nodes.get_mut(&self.0) {
            c.live = c.live.saturating_sub(1);
        }
        if let Some(c) = t.roles.get_mut(&(self.0, std::mem::take(&mut self.1))) {
            c.live = c.live.saturating_sub(1);
        }
    }
}

/// Starts a thread of node `node` named `phx-{role}-{node}` (Linux keeps 15 bytes of it).
pub fn spawn<F, T>(node: NodeId, role: &str, f: F) -> std::io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let kind: String = role.chars().filter(|c| !c.is_ascii_digit()).collect();
    {
        let mut t = table().lock().unwrap();
        up(t.nodes.entry(node).or_default());
        up(t.roles.entry((node, kind.clone())).or_default());
    }
    let guard = Counted(node, kind);
    std::thread::Builder::new()
        .name(format!("phx-{role}-{node}"))
        .spawn(move || {
            let _counted = guard;
            f()
        })
    // On a failed spawn the closure, and with it the guard, is dropped: the count goes back.
}

/// The counts of every node of this process.
pub fn counts() -> HashMap<NodeId, ThreadCount> {
    table().lock().unwrap().nodes.clone()
}

/// The counts of node `node` by role (`worker`, `rx`, `hello`, ...).
pub fn roles(node: NodeId) -> Vec<(String, ThreadCount)> {
    let t = table().lock().unwrap();
    let mut v: Vec<(String, ThreadCount)> = t
        .roles
        .iter()
        .filter(|((n, _), _)| *n == node)
        .map(|((_, r), c)| (r.clone(), *c))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Starts the peaks again from the threads running now.
pub fn reset_peaks() {
    let mut t = table().lock().unwrap();
    let Table { nodes, roles } = &mut *t;
    for c in nodes.values_mut().chain(roles.values_mut()) {
        c.peak = c.live;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_are_counted_while_they_run_and_the_peak_is_kept() {
        let node = 4_000_000_001;
        let (tx, rx) = crossbeam_channel::bounded::<()>(0);
        let hs: Vec<_> = (0..3)
            .map(|_| {
                let rx = rx.clone();
                spawn(node, "t", move || {
                    let _ = rx.recv();
                })
                .unwrap()
            })
            .collect();
        assert_eq!(counts()[&node], ThreadCount { live: 3, peak: 3 });
        drop(tx);
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(counts()[&node], ThreadCount { live: 0, peak: 3 });
        reset_peaks();
        assert_eq!(counts()[&node].peak, 0);
        let name = spawn(node, "named", || {
            std::thread::current().name().map(String::from)
        })
        .unwrap()
        .join()
        .unwrap();
        assert_eq!(name.as_deref(), Some("phx-named-4000000001"));
        let roles = roles(node);
        assert_eq!(roles.len(), 2);
        assert_eq!(
            roles[1],
            ("t".to_string(), ThreadCount { live: 0, peak: 0 })
        );
    }
}
