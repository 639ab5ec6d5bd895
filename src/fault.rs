//! The deterministic fault-injection hook: a node kills itself at a chosen byte offset of a
//! transfer it serves (test API `Node::inject_fault`, CLI `phalanx node --fault-*`).

use crate::node::Inner;
use crate::ObjectId;
use std::sync::atomic::Ordering;
use std::time::Instant;
use tracing::warn;

/// What the fault-injection hook does when it fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    /// The node drops every link abruptly and stops (in-process tests).
    DropLinks,
    /// The whole process receives SIGKILL.
    SigKill,
}

/// Kill this node once it has sent `after_bytes` bytes of `object` (`"*"`: any object) in
/// one transfer it serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultPlan {
    pub object: ObjectId,
    pub after_bytes: u64,
    pub action: FaultAction,
}

impl Inner {
    /// Fires the injected fault if it applies to serving bytes of `id` up to `end`; returns
    /// how many bytes may still be sent before it fires.
    pub fn fault_budget(&self, id: &ObjectId, sent: u64) -> Option<u64> {
        let f = self.fault.lock().unwrap();
        let plan = f
            .as_ref()
            .filter(|p| p.object == *id || p.object.as_str() == "*")?;
        Some(plan.after_bytes.saturating_sub(sent))
    }

    pub fn fire_fault(&self) {
        let action = match self.fault.lock().unwrap().take() {
            Some(p) => p.action,
            None => return,
        };
        *self.fault_fired_at.lock().unwrap() = Some(Instant::now());
        self.fault_fired.store(true, Ordering::Release);
        warn!(node = self.id, "injected fault fires: {action:?}");
        match action {
            FaultAction::DropLinks => self.close(true),
            FaultAction::SigKill => {
                let _ = nix::sys::signal::kill(
                    nix::unistd::getpid(),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}
