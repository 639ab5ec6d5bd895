use serde::{Deserialize, Serialize};
use std::fmt;

/// Names an immutable object; made from any string.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ObjectId(String);

impl ObjectId {
    pub fn new(name: impl Into<String>) -> ObjectId {
        ObjectId(name.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A hash that is the same in every process of the cluster (FNV-1a, 64 bit), used to
    /// place the object's directory entry.
    pub fn stable_hash(&self) -> u64 {
        self.0.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
        })
    }
}

impl From<&str> for ObjectId {
    fn from(s: &str) -> Self {
        ObjectId::new(s)
    }
}

impl From<String> for ObjectId {
    fn from(s: String) -> Self {
        ObjectId(s)
    }
}

impl fmt::Display for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl fmt::Debug for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ObjectId({:?})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stable_hash_is_fnv1a() {
        assert_eq!(ObjectId::new("").stable_hash(), 0xcbf2_9ce4_8422_2325);
        assert_eq!(ObjectId::new("a").stable_hash(), 0xaf63_dc4c_8601_ec8c);
    }
}
