//! An index from addresses to the objects (pods, Services) that hold them, kept current from a
//! watch. It keeps only each object's key, addresses and a small value, never the object: a
//! cluster-wide pod watch would otherwise hold every pod spec in memory.

use std::collections::HashMap;
use std::net::IpAddr;

use kube::runtime::watcher;

/// `key` (`namespace/name`) → (addresses, value), and address → keys.
#[derive(Debug)]
pub(crate) struct IpIndex<T> {
    by_key: HashMap<String, (Vec<IpAddr>, T)>,
    by_ip: HashMap<IpAddr, Vec<String>>,
}

impl<T> Default for IpIndex<T> {
    fn default() -> Self {
        IpIndex {
            by_key: HashMap::new(),
            by_ip: HashMap::new(),
        }
    }
}

impl<T: PartialEq> IpIndex<T> {
    pub(crate) fn remove(&mut self, key: &str) {
        let Some((ips, _)) = self.by_key.remove(key) else {
            return;
        };
        for ip in ips {
            if let Some(keys) = self.by_ip.get_mut(&ip) {
                keys.retain(|k| k != key);
                if keys.is_empty() {
                    self.by_ip.remove(&ip);
                }
            }
        }
    }

    /// Sets what `key` holds; `None` (or no address) drops it.
    pub(crate) fn upsert(&mut self, key: String, entry: Option<(Vec<IpAddr>, T)>) {
        let entry = entry.filter(|(ips, _)| !ips.is_empty());
        if self.by_key.get(&key) == entry.as_ref() {
            return;
        }
        self.remove(&key);
        if let Some(entry) = entry {
            for ip in &entry.0 {
                self.by_ip.entry(*ip).or_default().push(key.clone());
            }
            self.by_key.insert(key, entry);
        }
    }

    /// The objects holding `ip` (its canonical form): their keys and values.
    pub(crate) fn at(&self, ip: IpAddr) -> impl Iterator<Item = (&str, &T)> {
        self.by_ip
            .get(&ip)
            .into_iter()
            .flatten()
            .filter_map(|key| self.by_key.get(key).map(|(_, v)| (key.as_str(), v)))
    }
}

/// Applies one watch event to `index`. A relist is built in `listing` and swapped in whole at
/// its end, so that objects deleted while the watch was down leave the index. `entry` gives an
/// object's key and what to index for it (`None`: nothing). Returns whether the index changed
/// (an event the readers may have waited for).
pub(crate) fn apply_event<K, T: PartialEq>(
    index: &std::sync::RwLock<IpIndex<T>>,
    listing: &mut Option<IpIndex<T>>,
    event: watcher::Event<K>,
    entry: impl Fn(&K) -> (String, Option<(Vec<IpAddr>, T)>),
) -> bool {
    match event {
        watcher::Event::Init => {
            *listing = Some(IpIndex::default());
            false
        }
        watcher::Event::InitApply(obj) => {
            if let Some(l) = listing.as_mut() {
                let (key, e) = entry(&obj);
                l.upsert(key, e);
            }
            false
        }
        watcher::Event::InitDone => {
            if let Some(l) = listing.take()
                && let Ok(mut index) = index.write()
            {
                *index = l;
            }
            true
        }
        watcher::Event::Apply(obj) => {
            let (key, e) = entry(&obj);
            if let Ok(mut index) = index.write() {
                index.upsert(key, e);
            }
            true
        }
        watcher::Event::Delete(obj) => {
            let (key, _) = entry(&obj);
            if let Ok(mut index) = index.write() {
                index.remove(&key);
            }
            true
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn addresses_follow_their_objects() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let mut i = IpIndex::<&str>::default();
        i.upsert(
            "a/x".into(),
            Some((vec![ip("10.0.0.1"), ip("fd00::1")], "a")),
        );
        i.upsert("b/y".into(), Some((vec![ip("10.0.0.1")], "b")));
        let mut at: Vec<_> = i.at(ip("10.0.0.1")).map(|(_, v)| *v).collect();
        at.sort();
        assert_eq!(at, ["a", "b"]);
        // A changed address moves; the old one is forgotten.
        i.upsert("a/x".into(), Some((vec![ip("10.0.0.2")], "a")));
        assert_eq!(i.at(ip("fd00::1")).count(), 0);
        assert_eq!(i.at(ip("10.0.0.2")).count(), 1);
        i.remove("b/y");
        i.upsert("a/x".into(), Some((Vec::new(), "a")));
        assert!(i.by_ip.is_empty() && i.by_key.is_empty());
    }
}
