//! The deterministic fault-injection hook: a node kills itself at a chosen byte offset of a
//! transfer it serves (test API `Node::inject_fault`, CLI `phalanx node --fault-*`). The hook
//! is a value handed to the source side of the transfers; the node gives it the way to die.

use crate::ObjectId;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;
use tracing::warn;

/// What the fault-injection hook does when it fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    /// The node drops every link abruptly and stops (in-process tests).
    DropLinks,
    /// The whole process receives SIGKILL.
    SigKill,
    /// The transfer stops where it is and the node stays up (a hung serve: links open,
    /// heartbeats going, no more bytes); the stream ends only when its receiver cancels it.
    Stall,
}

/// Kill this node once it has sent `after_bytes` bytes of `object` (`"*"`: any object) in
/// one transfer it serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultPlan {
    pub object: ObjectId,
    pub after_bytes: u64,
    pub action: FaultAction,
}

/// The armed plan (if any) and whether it fired.
pub(crate) struct FaultHook {
    node: u32,
    plan: Mutex<Option<FaultPlan>>,
    fired: AtomicBool,
    fired_at: Mutex<Option<Instant>>,
    /// Drops the node's links abruptly (`FaultAction::DropLinks`).
    drop_links: Box<dyn Fn() + Send + Sync>,
}

impl FaultHook {
    pub fn new(node: u32, drop_links: impl Fn() + Send + Sync + 'static) -> FaultHook {
        FaultHook {
            node,
            plan: Mutex::new(None),
            fired: AtomicBool::new(false),
            fired_at: Mutex::new(None),
            drop_links: Box::new(drop_links),
        }
    }

    pub fn arm(&self, plan: FaultPlan) {
        *self.plan.lock().unwrap() = Some(plan);
    }

    pub fn fired(&self) -> bool {
        self.fired.load(Ordering::Acquire)
    }

    pub fn fired_at(&self) -> Option<Instant> {
        *self.fired_at.lock().unwrap()
    }

    /// How many more bytes of `id` may be served in a transfer that has sent `sent`, if a
    /// plan applies to it.
    pub fn budget(&self, id: &ObjectId, sent: u64) -> Option<u64> {
        let f = self.plan.lock().unwrap();
        let plan = f
            .as_ref()
            .filter(|p| p.object == *id || p.object.as_str() == "*")?;
        Some(plan.after_bytes.saturating_sub(sent))
    }

    /// Fires the armed plan (once): what it did, `None` if nothing was armed.
    pub fn fire(&self) -> Option<FaultAction> {
        let action = self.plan.lock().unwrap().take()?.action;
        *self.fired_at.lock().unwrap() = Some(Instant::now());
        self.fired.store(true, Ordering::Release);
        warn!(node = self.node, "injected fault fires: {action:?}");
        match action {
            FaultAction::DropLinks => (self.drop_links)(),
            FaultAction::SigKill => {
                let _ = nix::sys::signal::kill(
                    nix::unistd::getpid(),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            FaultAction::Stall => {}
        }
        Some(action)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;
    use std::sync::Arc;

    #[test]
    fn the_plan_applies_to_its_object_and_fires_once() {
        let drops = Arc::new(AtomicU32::new(0));
        let d = drops.clone();
        let hook = FaultHook::new(1, move || {
            d.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hook.budget(&"x".into(), 0), None, "nothing armed");
        hook.arm(FaultPlan {
            object: "x".into(),
            after_bytes: 100,
            action: FaultAction::DropLinks,
        });
        assert_eq!(hook.budget(&"y".into(), 0), None);
        assert_eq!(hook.budget(&"x".into(), 30), Some(70));
        assert_eq!(hook.budget(&"x".into(), 300), Some(0));
        assert_eq!(hook.fire(), Some(FaultAction::DropLinks));
        assert_eq!(hook.fire(), None);
        assert_eq!(drops.load(Ordering::Relaxed), 1);
        assert!(hook.fired() && hook.fired_at().is_some());
        assert_eq!(hook.budget(&"x".into(), 0), None, "disarmed once fired");
    }
}
