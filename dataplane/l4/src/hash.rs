//! Consistent hashing: the session-key hash, a Ketama-style ring and a Maglev table, both keyed
//! by endpoint ids.
//!
//! The hash is part of the wire contract between replicas: every proxy given the same endpoint
//! set must map a key to the same endpoint, whatever its version. So it is a fixed function
//! (FNV-1a over the bytes, then the murmur3 64-bit finaliser for avalanche), never a seeded or
//! std hasher, and it must not change.

/// Streaming form of [`hash_bytes`]: hashing parts in sequence equals hashing their
/// concatenation.
#[derive(Clone, Copy)]
pub(crate) struct Hasher(u64);

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

impl Hasher {
    pub(crate) fn new() -> Self {
        Hasher(FNV_OFFSET)
    }

    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(FNV_PRIME);
        }
    }

    pub(crate) fn finish(self) -> u64 {
        fmix64(self.0)
    }
}

pub(crate) fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut h = Hasher::new();
    h.write(bytes);
    h.finish()
}

/// murmur3's finaliser: every input bit affects every output bit.
pub(crate) fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^= k >> 33;
    k
}

/// The `attempt`-th alternative hash of `key`, for probing past unavailable endpoints.
pub(crate) fn rehash(key: u64, attempt: u32) -> u64 {
    fmix64(key ^ u64::from(attempt).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// A hash ring: `virtual_nodes` points per endpoint, each at the hash of (id, point number).
/// A key belongs to the first point at or after its hash, wrapping around.
#[derive(Debug)]
pub(crate) struct Ring {
    /// (point, endpoint index), sorted by point.
    points: Vec<(u64, u32)>,
}

impl Ring {
    /// `ids[i]` is endpoint `i`.
    pub(crate) fn new<'a>(ids: impl ExactSizeIterator<Item = &'a str>, virtual_nodes: u32) -> Ring {
        let mut points = Vec::with_capacity(ids.len() * virtual_nodes as usize);
        for (i, id) in ids.enumerate() {
            let Ok(idx) = u32::try_from(i) else { break };
            for v in 0..virtual_nodes {
                let mut h = Hasher::new();
                h.write(id.as_bytes());
                h.write(b"#");
                h.write(&v.to_le_bytes());
                points.push((h.finish(), idx));
            }
        }
        // Ties (vanishingly rare) are broken by index, and indices follow id order: the ring is
        // the same on every replica.
        points.sort_unstable();
        Ring { points }
    }

    /// Endpoint indices in ring order starting at `key`'s point: the owner first, then who
    /// takes over when it is skipped. Repeats indices (every point is visited once).
    pub(crate) fn walk(&self, key: u64) -> impl Iterator<Item = usize> + '_ {
        let start = self.points.partition_point(|(p, _)| *p < key);
        let n = self.points.len();
        (0..n).map(move |i| self.points[(start + i) % n].1 as usize)
    }
}

/// A Maglev lookup table (Eisenbud et al., NSDI 2016): each endpoint fills the table in the
/// order of its own permutation, taking turns, so every endpoint gets within one entry of
/// `size / n` entries and a change of membership moves few entries besides those of the
/// endpoint that came or went.
#[derive(Debug)]
pub(crate) struct Maglev {
    table: Vec<u32>,
}

impl Maglev {
    /// `size` must be a prime larger than the number of endpoints (validated in config).
    pub(crate) fn new<'a>(ids: impl ExactSizeIterator<Item = &'a str>, size: u32) -> Maglev {
        let m = u64::from(size);
        let perms: Vec<(u64, u64)> = ids
            .map(|id| {
                let mut h = Hasher::new();
                h.write(b"maglev-offset:");
                h.write(id.as_bytes());
                let offset = h.finish() % m;
                let mut h = Hasher::new();
                h.write(b"maglev-skip:");
                h.write(id.as_bytes());
                let skip = h.finish() % (m - 1) + 1;
                (offset, skip)
            })
            .collect();
        let n = perms.len();
        let mut table = vec![u32::MAX; size as usize];
        if n == 0 {
            return Maglev { table };
        }
        // next[i]: how far endpoint i has gone along its permutation.
        let mut next = vec![0u64; n];
        let mut filled = 0usize;
        'fill: loop {
            for (i, (offset, skip)) in perms.iter().enumerate() {
                // Since `size` is prime and 0 < skip < size, the permutation visits every slot:
                // this inner loop ends.
                let slot = loop {
                    let c = ((offset + next[i] * skip) % m) as usize;
                    next[i] += 1;
                    if table[c] == u32::MAX {
                        break c;
                    }
                };
                table[slot] = u32::try_from(i).unwrap_or(u32::MAX);
                filled += 1;
                if filled == table.len() {
                    break 'fill;
                }
            }
        }
        Maglev { table }
    }

    pub(crate) fn get(&self, key: u64) -> usize {
        let len = self.table.len() as u64;
        self.table[(key % len) as usize] as usize
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use proptest::prelude::*;

    use super::*;

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("worker-{i}")).collect()
    }

    fn keys(n: usize) -> Vec<u64> {
        (0..n)
            .map(|i| hash_bytes(format!("10.1.{}.{}:{}", i / 250, i % 250, 40000 + i).as_bytes()))
            .collect()
    }

    /// Owner (by id) of each key.
    fn ring_owners(ids: &[String], keys: &[u64]) -> Vec<String> {
        let ring = Ring::new(ids.iter().map(String::as_str), 1024);
        keys.iter()
            .map(|k| ids[ring.walk(*k).next().unwrap()].clone())
            .collect()
    }

    fn maglev_owners(ids: &[String], keys: &[u64]) -> Vec<String> {
        let m = Maglev::new(ids.iter().map(String::as_str), 65_537);
        keys.iter().map(|k| ids[m.get(*k)].clone()).collect()
    }

    fn moved(a: &[String], b: &[String]) -> usize {
        a.iter().zip(b).filter(|(x, y)| x != y).count()
    }

    fn spread(owners: &[String], ids: &[String]) -> Vec<usize> {
        ids.iter()
            .map(|id| owners.iter().filter(|o| *o == id).count())
            .collect()
    }

    #[test]
    fn the_hash_is_fixed() {
        // A change here changes which endpoint every replica picks for every key: never.
        assert_eq!(hash_bytes(b""), fmix64(FNV_OFFSET));
        // FNV-1a("spur") then fmix64, computed independently.
        assert_eq!(hash_bytes(b"spur"), 0x89bd_ad6d_88ce_b392);
        let mut h = Hasher::new();
        h.write(b"sp");
        h.write(b"ur");
        assert_eq!(h.finish(), hash_bytes(b"spur"));
    }

    #[test]
    fn adding_a_fourth_endpoint_moves_about_a_quarter() {
        let keys = keys(1000);
        for owners in [ring_owners, maglev_owners] {
            let before = owners(&ids(3), &keys);
            let after = owners(&ids(4), &keys);
            let m = moved(&before, &after);
            // Theory: 250. Every moved key moved to the new endpoint.
            assert!(m <= 300, "{m} of 1000 keys moved");
            assert!(m >= 150, "{m} of 1000 keys moved");
            for (b, a) in before.iter().zip(&after) {
                if b != a {
                    assert_eq!(a, "worker-3");
                }
            }
        }
    }

    #[test]
    fn keys_spread_evenly() {
        let keys = keys(1000);
        for owners in [ring_owners, maglev_owners] {
            let ids = ids(3);
            for count in spread(&owners(&ids, &keys), &ids) {
                assert!(
                    (283..=383).contains(&count),
                    "{count} of 1000 keys on one endpoint"
                );
            }
        }
    }

    #[test]
    fn removing_an_endpoint_moves_only_its_keys_on_the_ring() {
        let keys = keys(1000);
        let before = ring_owners(&ids(4), &keys);
        let three: Vec<String> = ids(4).into_iter().filter(|i| i != "worker-1").collect();
        let after = ring_owners(&three, &keys);
        for (b, a) in before.iter().zip(&after) {
            if b != "worker-1" {
                assert_eq!(a, b);
            }
        }
    }

    #[test]
    fn maglev_removal_moves_few_other_keys() {
        let keys = keys(1000);
        let before = maglev_owners(&ids(4), &keys);
        let three: Vec<String> = ids(4).into_iter().filter(|i| i != "worker-1").collect();
        let after = maglev_owners(&three, &keys);
        let others_moved = before
            .iter()
            .zip(&after)
            .filter(|(b, a)| *b != "worker-1" && a != b)
            .count();
        // Maglev trades a little disruption for its even spread (the paper measures a few %).
        // Sessions are unaffected either way: they keep their endpoint while it is available.
        assert!(
            others_moved <= 50,
            "{others_moved} keys of remaining endpoints moved"
        );
    }

    #[test]
    fn maglev_fills_evenly() {
        let ids = ids(7);
        let m = Maglev::new(ids.iter().map(String::as_str), 65_537);
        let mut counts = [0usize; 7];
        for e in &m.table {
            counts[*e as usize] += 1;
        }
        let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
        assert!(hi - lo <= 1, "{counts:?}");
        let small = Maglev::new(["a", "b"].into_iter(), 3);
        assert!(small.table.iter().all(|e| *e < 2));
    }

    /// Adding an endpoint moves keys mostly to it. Maglev promises this on average, not for
    /// every set of ids: its table is filled by the endpoints taking turns, so a newcomer
    /// changes whose turn wins some slots. A CI run found 2 endpoints plus one whose id sorts
    /// first moving 157 of 500 keys between the old two (the property test this replaces
    /// allowed 50 for every case, and failed at random). Measured over 3 000 random cases,
    /// that is the tail: here, 400 fixed cases (a seeded generator, so every run is the same)
    /// must move under 3 % of the keys between old endpoints on average.
    #[test]
    fn maglev_adding_moves_mostly_to_the_newcomer() {
        let keys = keys(500);
        let (mut stray_total, mut cases) = (0usize, 0usize);
        let mut seed: u64 = 0x5eed;
        let mut next = || {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            seed >> 16
        };
        for _ in 0..400 {
            let n = 2 + (next() % 6) as usize;
            let mut names = std::collections::BTreeSet::new();
            while names.len() < n {
                names.insert(format!("{:x}-{}", next() % 0xfff_ffff, names.len()));
            }
            // Upper case sorts before the others: the newcomer takes the first turn.
            let extra = format!("N{:X}", next() % 0xffff);
            let sorted: Vec<String> = names.iter().cloned().collect();
            let m = Maglev::new(sorted.iter().map(String::as_str), 5003);
            let before: Vec<&String> = keys.iter().map(|k| &sorted[m.get(*k)]).collect();
            names.insert(extra.clone());
            let grown: Vec<String> = names.into_iter().collect();
            let m = Maglev::new(grown.iter().map(String::as_str), 5003);
            let mut to_newcomer = 0;
            for (k, b) in keys.iter().zip(&before) {
                let a = &grown[m.get(*k)];
                if *a == extra {
                    to_newcomer += 1;
                } else if a != *b {
                    stray_total += 1;
                }
            }
            // The newcomer gets about its share of the keys.
            let share = keys.len() / (n + 1);
            assert!(
                to_newcomer > share / 2 && to_newcomer < share * 2,
                "{n} endpoints + 1: {to_newcomer} keys to the newcomer, about {share} expected"
            );
            cases += 1;
        }
        let mean = stray_total as f64 / (cases * keys.len()) as f64;
        assert!(
            mean < 0.03,
            "{:.1} % of the keys moved between old endpoints on average",
            mean * 100.0
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        /// Whatever the ids, the ring owner of a key is the same whatever order the endpoints
        /// are listed in, and adding one endpoint only ever moves keys to it.
        #[test]
        fn ring_is_order_independent_and_minimal(
            mut names in proptest::collection::btree_set("[a-z0-9-]{1,12}", 2..8),
            extra in "[A-Z]{1,6}",
        ) {
            let sorted: Vec<String> = names.iter().cloned().collect();
            let keys = keys(200);
            let before = {
                let ring = Ring::new(sorted.iter().map(String::as_str), 64);
                keys.iter().map(|k| sorted[ring.walk(*k).next().unwrap()].clone()).collect::<Vec<_>>()
            };
            names.insert(extra.clone());
            let grown: Vec<String> = names.into_iter().collect();
            let ring = Ring::new(grown.iter().map(String::as_str), 64);
            for (k, b) in keys.iter().zip(&before) {
                let a = &grown[ring.walk(*k).next().unwrap()];
                prop_assert!(a == b || *a == extra);
            }
        }
    }
}
