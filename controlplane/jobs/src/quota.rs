//! The per-namespace storage quota: how many bytes one namespace's jobs may keep in the store
//! (sealed logs, artifacts, and the spools of running attempts), so that one namespace filling
//! the store never takes room another namespace's logs need (issue 42).
//!
//! Writes ask first ([`Quota::try_charge`]); what a namespace already has when the component
//! starts, and a spool found when an attempt is resumed, is counted without asking
//! ([`Quota::charge`]): it exists, and refusing it would lose nothing but accuracy. Deleting a
//! job's data gives its bytes back. Artifact index files are small and not counted.

use std::collections::HashMap;
use std::sync::Mutex;

/// Bytes stored per namespace, against one limit.
#[derive(Debug)]
pub struct Quota {
    limit: u64,
    used: Mutex<HashMap<String, u64>>,
}

impl Quota {
    pub fn new(limit: u64) -> Self {
        Quota {
            limit,
            used: Mutex::new(HashMap::new()),
        }
    }

    /// The limit per namespace.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    fn with<T>(&self, f: impl FnOnce(&mut HashMap<String, u64>) -> T) -> T {
        // A panic while holding the lock leaves only counters behind: keep using them.
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut used)
    }

    /// Adds `n` bytes to `ns` if that stays within the limit; `false` (nothing added) if not.
    pub fn try_charge(&self, ns: &str, n: u64) -> bool {
        self.with(|used| {
            let u = used.entry(ns.to_string()).or_default();
            match u.checked_add(n) {
                Some(total) if total <= self.limit => {
                    *u = total;
                    true
                }
                _ => false,
            }
        })
    }

    /// Adds `n` bytes that are stored already.
    pub fn charge(&self, ns: &str, n: u64) {
        self.with(|used| {
            let u = used.entry(ns.to_string()).or_default();
            *u = u.saturating_add(n);
        });
    }

    /// Gives back `n` bytes that were deleted.
    pub fn release(&self, ns: &str, n: u64) {
        self.with(|used| {
            if let Some(u) = used.get_mut(ns) {
                *u = u.saturating_sub(n);
                if *u == 0 {
                    used.remove(ns);
                }
            }
        });
    }

    /// Bytes `ns` keeps now.
    pub fn used(&self, ns: &str) -> u64 {
        self.with(|used| used.get(ns).copied().unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_namespace_cannot_take_anothers_room() {
        let q = Quota::new(100);
        assert!(q.try_charge("a", 60));
        assert!(q.try_charge("a", 40));
        // a is full: its next write is refused, b's is not.
        assert!(!q.try_charge("a", 1));
        assert!(q.try_charge("b", 100));
        assert_eq!((q.used("a"), q.used("b")), (100, 100));
        q.release("a", 50);
        assert!(q.try_charge("a", 50));
        assert!(!q.try_charge("a", u64::MAX));
        // Existing data is counted even past the limit; releasing more than is counted stops
        // at zero.
        q.charge("c", 500);
        assert!(!q.try_charge("c", 1));
        q.release("c", 1000);
        assert_eq!(q.used("c"), 0);
    }
}
