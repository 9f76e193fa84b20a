//! A bounded-by-its-owner LRU map: a hash index over a slab of doubly linked slots, so a lookup,
//! a touch (move to the front), an insert and a removal are O(1), and touching allocates
//! nothing (the UDP listener touches its session on every datagram).

use std::collections::HashMap;
use std::hash::Hash;

const NIL: usize = usize::MAX;

#[derive(Debug)]
struct Slot<K, V> {
    prev: usize,
    next: usize,
    /// The owner's activity time: what it last touched the entry with.
    stamp: u64,
    entry: Option<(K, V)>,
}

#[derive(Debug)]
pub(crate) struct Lru<K, V> {
    // std's SipHash: the keys (client addresses) are chosen by clients.
    index: HashMap<K, usize>,
    slots: Vec<Slot<K, V>>,
    free: Vec<usize>,
    /// Most recently touched.
    head: usize,
    /// Least recently touched.
    tail: usize,
}

impl<K: Hash + Eq + Clone, V> Lru<K, V> {
    pub(crate) fn new() -> Self {
        Lru {
            index: HashMap::new(),
            slots: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    pub(crate) fn find(&self, key: &K) -> Option<usize> {
        self.index.get(key).copied()
    }

    pub(crate) fn key(&self, slot: usize) -> Option<&K> {
        self.slots.get(slot)?.entry.as_ref().map(|(k, _)| k)
    }

    pub(crate) fn value(&self, slot: usize) -> Option<&V> {
        self.slots.get(slot)?.entry.as_ref().map(|(_, v)| v)
    }

    pub(crate) fn value_mut(&mut self, slot: usize) -> Option<&mut V> {
        self.slots.get_mut(slot)?.entry.as_mut().map(|(_, v)| v)
    }

    pub(crate) fn stamp(&self, slot: usize) -> u64 {
        self.slots.get(slot).map_or(0, |s| s.stamp)
    }

    /// The least recently touched entry.
    pub(crate) fn oldest(&self) -> Option<usize> {
        (self.tail != NIL).then_some(self.tail)
    }

    /// Moves `slot` to the front with a new stamp.
    pub(crate) fn touch(&mut self, slot: usize, stamp: u64) {
        if slot >= self.slots.len() || self.slots[slot].entry.is_none() {
            return;
        }
        self.slots[slot].stamp = stamp;
        if self.head != slot {
            self.unlink(slot);
            self.push_front(slot);
        }
    }

    /// Inserts a key that is not present (the caller looked it up first) at the front.
    pub(crate) fn insert(&mut self, key: K, value: V, stamp: u64) -> usize {
        let slot = Slot {
            prev: NIL,
            next: NIL,
            stamp,
            entry: Some((key.clone(), value)),
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i] = slot;
                i
            }
            None => {
                self.slots.push(slot);
                self.slots.len() - 1
            }
        };
        self.push_front(i);
        if let Some(old) = self.index.insert(key, i) {
            // Not reached when callers keep the contract; keep the list consistent anyway.
            self.remove_slot(old);
        }
        i
    }

    pub(crate) fn remove(&mut self, slot: usize) -> Option<(K, V)> {
        let (k, v) = self.remove_slot(slot)?;
        self.index.remove(&k);
        Some((k, v))
    }

    fn remove_slot(&mut self, slot: usize) -> Option<(K, V)> {
        let entry = self.slots.get_mut(slot)?.entry.take()?;
        self.unlink(slot);
        self.free.push(slot);
        Some(entry)
    }

    /// Empties the map, returning every entry.
    pub(crate) fn drain(&mut self) -> Vec<(K, V)> {
        self.index.clear();
        self.free.clear();
        self.head = NIL;
        self.tail = NIL;
        self.slots.drain(..).filter_map(|s| s.entry).collect()
    }

    fn unlink(&mut self, i: usize) {
        let (prev, next) = (self.slots[i].prev, self.slots[i].next);
        match prev {
            NIL => self.head = next,
            p => self.slots[p].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.slots[n].prev = prev,
        }
        self.slots[i].prev = NIL;
        self.slots[i].next = NIL;
    }

    fn push_front(&mut self, i: usize) {
        self.slots[i].prev = NIL;
        self.slots[i].next = self.head;
        match self.head {
            NIL => self.tail = i,
            h => self.slots[h].prev = i,
        }
        self.head = i;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn evicts_least_recently_touched() {
        let mut l = Lru::new();
        let a = l.insert("a", 1, 1);
        l.insert("b", 2, 2);
        l.insert("c", 3, 3);
        l.touch(a, 4);
        let oldest = l.oldest().unwrap();
        assert_eq!(l.remove(oldest), Some(("b", 2)));
        assert_eq!(l.len(), 2);
        assert_eq!(l.find(&"b"), None);
        let d = l.insert("d", 4, 5);
        assert_eq!(d, oldest, "the freed slot is reused");
        assert_eq!(l.remove(l.oldest().unwrap()), Some(("c", 3)));
        assert_eq!(l.remove(l.oldest().unwrap()), Some(("a", 1)));
        assert_eq!(l.remove(l.oldest().unwrap()), Some(("d", 4)));
        assert!(l.is_empty() && l.oldest().is_none());
        assert_eq!(l.remove(d), None, "a removed slot stays removed");
    }

    proptest! {
        /// Against a model: a Vec ordered from least to most recently touched.
        #[test]
        fn matches_a_model(ops in proptest::collection::vec((0u8..4, 0u8..16), 1..200)) {
            let mut l: Lru<u8, u8> = Lru::new();
            let mut model: Vec<u8> = Vec::new();
            for (t, (op, key)) in ops.into_iter().enumerate() {
                let t = t as u64;
                match op {
                    0 | 1 => match l.find(&key) {
                        Some(s) => {
                            l.touch(s, t);
                            model.retain(|k| *k != key);
                            model.push(key);
                        }
                        None => {
                            l.insert(key, key, t);
                            model.push(key);
                        }
                    },
                    2 => {
                        if let Some(s) = l.oldest() {
                            let (k, v) = l.remove(s).unwrap();
                            prop_assert_eq!(k, v);
                            prop_assert_eq!(k, model.remove(0));
                        }
                    }
                    _ => {
                        if let Some(s) = l.find(&key) {
                            l.remove(s);
                            model.retain(|k| *k != key);
                        }
                    }
                }
                prop_assert_eq!(l.len(), model.len());
                prop_assert_eq!(l.oldest().and_then(|s| l.value(s)).copied(), model.first().copied());
            }
            let mut rest: Vec<u8> = l.drain().into_iter().map(|(k, _)| k).collect();
            rest.sort_unstable();
            model.sort_unstable();
            prop_assert_eq!(rest, model);
        }
    }
}
