//! A pool of sources shared by concurrent reduces.

use crate::ObjectId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Which reduce (by target) has taken which source. A source stays taken when its reduce
/// succeeds; a reduce that fails gives its sources back.
#[derive(Debug, Default)]
pub struct SourceClaims {
    owner: Mutex<HashMap<ObjectId, ObjectId>>,
}

impl SourceClaims {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// Takes `source` for `target`; true if it was free or already `target`'s.
    pub fn try_claim(&self, source: &ObjectId, target: &ObjectId) -> bool {
        let mut owner = self.owner.lock().unwrap();
        match owner.get(source) {
            Some(t) => t == target,
            None => {
                owner.insert(source.clone(), target.clone());
                true
            }
        }
    }

    /// The reduce that took `source`, if any.
    pub fn owner_of(&self, source: &ObjectId) -> Option<ObjectId> {
        self.owner.lock().unwrap().get(source).cloned()
    }

    /// Gives back every source `target` took.
    pub fn release(&self, target: &ObjectId) {
        self.owner.lock().unwrap().retain(|_, t| t != target);
    }

    /// Forgets `source` (e.g. once it is deleted) so the pool does not grow without bound.
    pub fn forget(&self, source: &ObjectId) {
        self.owner.lock().unwrap().remove(source);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_keep_concurrent_reduces_apart() {
        let c = SourceClaims::new();
        let (g, a, b) = (ObjectId::new("g"), ObjectId::new("a"), ObjectId::new("b"));
        assert!(c.try_claim(&g, &a));
        assert!(
            c.try_claim(&g, &a),
            "taking again for the same reduce is fine"
        );
        assert!(!c.try_claim(&g, &b), "another reduce cannot take it");
        c.release(&a); // a failed: its sources go back to the pool
        assert!(c.try_claim(&g, &b));
        assert_eq!(c.owner_of(&g), Some(b.clone()));
        c.forget(&g);
        assert_eq!(c.owner_of(&g), None);
    }
}
