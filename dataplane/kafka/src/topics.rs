//! Topic names by topic id, learnt from the Metadata responses of every connection of a relay:
//! Fetch v13 and later name topics by id only, and a relay's decisions and metrics are per
//! topic name. Clones share one map (a relay's connections), bounded in size.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

/// Most topic ids remembered; ids past it are named by nobody (their records count under an
/// unknown topic), which a cluster with that many topics in one pod's view will not reach.
const MAX_TOPICS: usize = 100_000;

/// Shared map of topic id (the 16 bytes of its UUID) to name.
#[derive(Debug, Clone, Default)]
pub struct TopicNames(Arc<RwLock<HashMap<[u8; 16], Arc<str>>>>);

impl TopicNames {
    /// Remembers `name` for `id`; the nil id (what Metadata before v10 carries) names nothing.
    pub fn learn(&self, id: &[u8; 16], name: &str) {
        if *id == [0; 16] {
            return;
        }
        let mut map = self.0.write().unwrap_or_else(|p| p.into_inner());
        if map.get(id).is_some_and(|n| **n == *name) {
            return;
        }
        if map.len() >= MAX_TOPICS && !map.contains_key(id) {
            return;
        }
        map.insert(*id, Arc::from(name));
    }

    /// The name learnt for `id`, if any.
    pub fn name(&self, id: &[u8; 16]) -> Option<Arc<str>> {
        self.0
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_name_topics_across_clones() {
        let a = TopicNames::default();
        let b = a.clone();
        a.learn(&[1; 16], "orders");
        assert_eq!(b.name(&[1; 16]).as_deref(), Some("orders"));
        a.learn(&[0; 16], "nil");
        assert_eq!(b.name(&[0; 16]), None, "the nil id names nothing");
        b.learn(&[1; 16], "renamed");
        assert_eq!(a.name(&[1; 16]).as_deref(), Some("renamed"));
        assert_eq!(a.name(&[2; 16]), None);
    }
}
