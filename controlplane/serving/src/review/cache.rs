//! The bounded cache servers keep in front of their reviews, so that thousands of clients
//! reconnecting at once cost the API server one review per token.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Instant;

/// Answers, each until its deadline. Past `max` entries, the expired ones go, then everything:
/// a flood of new tokens costs reviews, never memory.
#[derive(Debug)]
pub struct Cache<K, V> {
    entries: Mutex<HashMap<K, (Instant, V)>>,
    max: usize,
}

impl<K: Eq + Hash, V: Clone> Cache<K, V> {
    /// An empty cache of at most `max` entries.
    pub fn new(max: usize) -> Self {
        Cache {
            entries: Mutex::new(HashMap::new()),
            max,
        }
    }

    /// The answer under `key`, while its deadline has not passed.
    pub fn get(&self, key: &K) -> Option<V> {
        let entries = self.entries.lock().ok()?;
        entries
            .get(key)
            .filter(|(until, _)| *until > Instant::now())
            .map(|(_, v)| v.clone())
    }

    /// Keeps `value` under `key` until the deadline `until` picks, given the deadline of the
    /// answer it replaces while that one lives (a server that adds to an answer keeps its
    /// deadline). Nothing is kept for a deadline already past.
    pub fn insert(&self, key: K, value: V, until: impl FnOnce(Option<Instant>) -> Instant) {
        let now = Instant::now();
        // A poisoned lock only loses the cache: every answer is asked again.
        let Ok(mut entries) = self.entries.lock() else {
            return;
        };
        let live = entries.get(&key).map(|(u, _)| *u).filter(|u| *u > now);
        let until = until(live);
        if until <= now {
            return;
        }
        if entries.len() >= self.max && !entries.contains_key(&key) {
            entries.retain(|_, (u, _)| *u > now);
            if entries.len() >= self.max {
                entries.clear();
            }
        }
        entries.insert(key, (until, value));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn answers_live_until_their_deadline_and_the_cache_stays_bounded() {
        let cache = Cache::new(2);
        let later = Instant::now() + Duration::from_secs(60);
        cache.insert("a", 1, |_| later);
        assert_eq!(cache.get(&"a"), Some(1));
        // An update sees the live deadline.
        cache.insert("a", 2, |live| {
            assert_eq!(live, Some(later));
            later
        });
        assert_eq!(cache.get(&"a"), Some(2));
        // A deadline already past keeps nothing.
        cache.insert("b", 3, |_| Instant::now());
        assert_eq!(cache.get(&"b"), None);
        cache.insert("b", 3, |_| later);
        // Full of live answers: a new key clears them all.
        cache.insert("c", 4, |_| later);
        assert_eq!(cache.get(&"a"), None);
        assert_eq!(cache.get(&"c"), Some(4));
    }
}
