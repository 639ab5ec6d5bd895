use serde::{Deserialize, Serialize};
use std::fmt;

/// Names an immutable object; made from any string.
///
/// A name of the form `@N/rest` (made with [`ObjectId::homed`]) asks for its directory entry
/// to live on node `N` while `N` is alive, the way a task system's owner keeps the entries of
/// the objects it asked for: when the producers and the consumer agree on the home, a small
/// object goes from its producer to the consumer's node in one message, and a reader's
/// lookup is a local call there. If node `N` is down (or not in the cluster) the entry is
/// placed by hashing, like any other name, and it comes back to `N` when `N` rejoins.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ObjectId(String);

impl ObjectId {
    pub fn new(name: impl Into<String>) -> ObjectId {
        ObjectId(name.into())
    }

    /// `name` with its directory entry on node `home` (see the type's documentation).
    pub fn homed(home: u32, name: impl AsRef<str>) -> ObjectId {
        ObjectId(format!("@{home}/{}", name.as_ref()))
    }

    /// The node asked to hold the directory entry, for names made by [`ObjectId::homed`].
    pub fn home(&self) -> Option<u32> {
        let rest = self.0.strip_prefix('@')?;
        let (n, _) = rest.split_once('/')?;
        if n.is_empty() || n.len() > 10 || !n.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        n.parse().ok()
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A hash that is the same in every process of the cluster, used to place the object's
    /// directory entry: FNV-1a over the bytes, then a 64-bit finaliser (FNV's low bits depend
    /// only on the low bits of each byte, which would shard similar names together).
    pub fn stable_hash(&self) -> u64 {
        let h = self.0.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
        });
        let h = (h ^ (h >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
        let h = (h ^ (h >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
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
    fn a_homed_name_carries_its_home() {
        let id = ObjectId::homed(3, "grad/7");
        assert_eq!(id.as_str(), "@3/grad/7");
        assert_eq!(id.home(), Some(3));
        for plain in [
            "grad/7",
            "@/x",
            "@x/y",
            "@3",
            "@-1/x",
            "@99999999999/x",
            "3/x",
        ] {
            assert_eq!(ObjectId::new(plain).home(), None, "{plain}");
        }
    }

    #[test]
    fn stable_hash_spreads_similar_names_over_shards() {
        // Names differing only in characters with equal low bits ("a", "i", "q", "y").
        let mut count = [0usize; 8];
        for i in 0..4000 {
            let id = ObjectId::new(format!("obj-{}-{i}", ["a", "i", "q", "y"][i % 4]));
            count[(id.stable_hash() % 8) as usize] += 1;
        }
        assert!(count.iter().all(|&c| (400..600).contains(&c)), "{count:?}");
        assert_eq!(
            ObjectId::new("x").stable_hash(),
            ObjectId::new("x").stable_hash()
        );
    }
}
