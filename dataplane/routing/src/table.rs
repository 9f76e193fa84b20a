//! The compiled routing table and the lock-free handle the request path reads it through.
//!
//! A [`RuleTable`] is immutable: a writer (a rule source) builds a whole new table off the hot path
//! and publishes it with [`SharedTable::store`]; requests only [`SharedTable::load`]. Lookup is two
//! hash probes and a scan over the handful of ports one key maps, so it does not allocate and its
//! cost does not grow with the number of rules.

use std::collections::hash_map::Entry;
use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::sync::Arc;
use std::time::SystemTime;

use arc_swap::ArcSwap;

use crate::rules::{BaselineWorkload, Location, RoutingRule};

/// The table's maps. Their keys come from validated rules (baselines, and routing keys of at most
/// 64 `[A-Za-z0-9._-]`), written by the route server's authenticated users, never from a request:
/// a request's key only probes. Each map's seed is random and its hashes are never shown, so a
/// fast hasher is safe here. SipHash of the baseline (three strings) and of the key was about 570
/// instructions of a keyed request's 20 000 on the HTTP/1.1 relay (`perf/results/per_request.md`,
/// "Keyed requests").
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Where a keyed request goes: the first destination of the matching port mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    pub sandbox: Arc<str>,
    pub routing_key: Arc<str>,
    /// Shared: the connection pools key their upstreams by it, and a routed request then takes
    /// a reference count rather than a copy of the host name.
    pub location: Arc<Location>,
}

/// The destinations one routing key has, by workload port. A key rarely maps more than a few
/// ports, so a scanned slice beats a second hash map. Shared, so that a table built after a
/// change reuses what an unchanged rule compiled to.
type PortRoutes = Arc<[(u16, Arc<Destination>)]>;

/// One routing key's routes, and the rule they were compiled from, by its index in
/// [`RuleTable::rules`]. None when several rules gave the same baseline and key (which validated
/// rule sets never do), or when the index does not fit a `u32`: the index only says whether the
/// next compile may reuse the routes (it checks the rule there by value), never where a request
/// goes. An index rather than the rule's `Arc`: copying the map for the next table then takes
/// two reference counts per key, not three.
#[derive(Debug, Clone)]
struct KeyRoutes {
    rule: Option<u32>,
    ports: PortRoutes,
}

/// Rules of one baseline workload, by routing key then workload port.
#[derive(Debug, Default)]
pub struct BaselineRules {
    by_key: Map<Arc<str>, KeyRoutes>,
    /// Where this baseline's rules are in [`RuleTable::rules`] when they are all there is of it
    /// and no two share a key (always, for validated rules given grouped by baseline): then
    /// `by_key` has one entry per rule, and the next compile can copy it and patch the entries
    /// whose rule changed instead of building it again.
    run: Option<Range<usize>>,
}

impl BaselineRules {
    /// The destination for `key` on `port`, if a rule says so.
    pub fn lookup(&self, port: u16, key: &str) -> Option<&Arc<Destination>> {
        self.by_key
            .get(key)?
            .ports
            .iter()
            .find(|(p, _)| *p == port)
            .map(|(_, d)| d)
    }

    /// The first candidate key that has a rule for `port` wins (candidates come in precedence order).
    pub fn route<'k>(
        &self,
        port: u16,
        candidates: impl IntoIterator<Item = &'k str>,
    ) -> Option<&Arc<Destination>> {
        candidates.into_iter().find_map(|k| self.lookup(port, k))
    }

    /// The destination `key` has on any port: for traffic that names no workload port (Kafka
    /// records a baseline consumes), a rule for the key on any port routes it. A rule's port
    /// mappings all name the same sandbox, so which port's destination is returned does not
    /// change the sandbox.
    pub fn lookup_any_port(&self, key: &str) -> Option<&Arc<Destination>> {
        self.by_key.get(key)?.ports.first().map(|(_, d)| d)
    }

    /// [`Self::route`] for traffic without a workload port ([`Self::lookup_any_port`]).
    pub fn route_any_port<'k>(
        &self,
        candidates: impl IntoIterator<Item = &'k str>,
    ) -> Option<&Arc<Destination>> {
        candidates.into_iter().find_map(|k| self.lookup_any_port(k))
    }
}

/// An immutable index of validated rules: (baseline, workload port, routing key) → destination.
#[derive(Debug, Default)]
pub struct RuleTable {
    baselines: Map<BaselineWorkload, BaselineRules>,
    rules: Vec<Arc<RoutingRule>>,
}

impl RuleTable {
    /// Compiles validated rules (see [`crate::rules::validate_rules`]).
    pub fn new(rules: Vec<RoutingRule>) -> Self {
        Self::compile(rules.into_iter().map(Arc::new).collect(), None)
    }

    /// Compiles validated rules, reusing what `previous` compiled for every rule that did not
    /// change. A rule source that publishes after each change (one rule of a baseline's ten, say)
    /// then allocates for that rule only, not for the whole table: with thousands of sidecars
    /// swapping tables at once, this is most of a change's cost on each of them.
    ///
    /// Sources publish the same rules in the same order every time, so a baseline whose rules
    /// line up with its rules in `previous` (same keys at the same places) gets a copy of its
    /// previous map with only the changed rules' entries replaced: each table is cold in cache
    /// when a change arrives, and that copy reads no key string and hashes no key.
    pub fn compile(rules: Vec<Arc<RoutingRule>>, previous: Option<&RuleTable>) -> Self {
        let mut baselines: Map<BaselineWorkload, BaselineRules> = Map::default();
        let prev_rules = previous.map_or(&[][..], |p| &p.rules[..]);
        // Rules come grouped by baseline (a sidecar's source has one): each run of one baseline
        // is hashed and looked up once.
        let mut start = 0;
        while let Some(first) = rules.get(start) {
            let before = previous.and_then(|p| p.baselines.get(&first.baseline));
            let b = match baselines.entry(first.baseline.clone()) {
                Entry::Vacant(v) => {
                    if let Some((by_key, end)) =
                        before.and_then(|b| Self::patched(b, prev_rules, &rules, start))
                    {
                        v.insert(BaselineRules {
                            by_key,
                            run: Some(start..end),
                        });
                        start = end;
                        continue;
                    }
                    // Built key by key below: an empty run that the rules extend.
                    v.insert(BaselineRules {
                        by_key: Map::default(),
                        run: Some(start..start),
                    })
                }
                // More rules of a baseline seen before: after a patched run that was longer than
                // in `previous` (they continue it), or in another run.
                Entry::Occupied(o) => o.into_mut(),
            };
            let end = start + Self::run_len(&rules[start..]);
            b.by_key.reserve(end - start);
            let mut merged = false;
            for (i, rule) in rules.iter().enumerate().take(end).skip(start) {
                merged |= Self::add(&mut b.by_key, (i, rule), before, prev_rules);
            }
            // Still one run with one rule per key only if these rules continue it unmerged.
            b.run = b
                .run
                .take()
                .filter(|r| r.end == start && !merged)
                .map(|r| r.start..end);
            start = end;
        }
        RuleTable { baselines, rules }
    }

    /// How many rules at the start of `rules` have the first one's baseline.
    fn run_len(rules: &[Arc<RoutingRule>]) -> usize {
        let Some((first, rest)) = rules.split_first() else {
            return 0;
        };
        1 + rest
            .iter()
            .take_while(|r| r.baseline == first.baseline)
            .count()
    }

    /// `before` is a baseline's rules in `previous`. If they were one run with one rule per key,
    /// and the rules from `rules[start]` on are those rules again in the same order (each the
    /// same rule by pointer, or one with the same baseline and key compared by value), returns
    /// the baseline's map for them and the index in `rules` where they end. The map is a copy of
    /// `before`'s, which copies its buckets as they are (no key is hashed, compared or even
    /// read), with the entries of the changed rules compiled again.
    fn patched(
        before: &BaselineRules,
        previous: &[Arc<RoutingRule>],
        rules: &[Arc<RoutingRule>],
        start: usize,
    ) -> Option<(Map<Arc<str>, KeyRoutes>, usize)> {
        let was_at = before.run.clone()?;
        let was = previous.get(was_at.clone())?;
        let end = start.checked_add(was.len())?;
        let now = rules.get(start..end)?;
        let same = |(p, r): (&Arc<RoutingRule>, &Arc<RoutingRule>)| {
            Arc::ptr_eq(p, r) || (p.routing_key == r.routing_key && p.baseline == r.baseline)
        };
        if !was.iter().zip(now).all(same) {
            return None;
        }
        let mut by_key = before.by_key.clone();
        if start != was_at.start {
            // The run moved (rules of other baselines before it changed): its indices move too.
            // An index that cannot be moved is dropped, which only stops its entry's reuse.
            let moved = |i: u32| {
                let i = usize::try_from(i).ok()?.checked_sub(was_at.start)? + start;
                u32::try_from(i).ok()
            };
            for k in by_key.values_mut() {
                k.rule = k.rule.and_then(moved);
            }
        }
        for (p, r) in was.iter().zip(now) {
            // An equal rule in a new allocation keeps its routes; its entry already has the
            // index it is at.
            if Arc::ptr_eq(p, r) || **p == **r {
                continue;
            }
            // The key is `p`'s: `before` has an entry for it, and only `p` compiled into it.
            let key = by_key.get_key_value(r.routing_key.as_str())?.0.clone();
            let sandbox: Arc<str> = Arc::from(r.destination_sandbox.as_str());
            by_key.get_mut(&*key)?.ports = Self::destinations(r, &sandbox, &key).collect();
        }
        Some((by_key, end))
    }

    /// Adds one rule's routes to its baseline's keys, reusing what `before` compiled for an
    /// equal rule. True when the rule's key had routes already (they are merged).
    fn add(
        by_key: &mut Map<Arc<str>, KeyRoutes>,
        (index, rule): (usize, &Arc<RoutingRule>),
        before: Option<&BaselineRules>,
        previous: &[Arc<RoutingRule>],
    ) -> bool {
        let known = before.and_then(|b| b.by_key.get_key_value(rule.routing_key.as_str()));
        let (key, ports) = match known {
            Some((key, k))
                if k.rule
                    .and_then(|i| previous.get(usize::try_from(i).ok()?))
                    .is_some_and(|r| Arc::ptr_eq(r, rule) || **r == **rule) =>
            {
                (key.clone(), k.ports.clone())
            }
            known => {
                // A known key's string is shared rather than allocated again.
                let key = known.map_or_else(
                    || Arc::from(rule.routing_key.as_str()),
                    |(key, _)| key.clone(),
                );
                let sandbox: Arc<str> = Arc::from(rule.destination_sandbox.as_str());
                let ports = Self::destinations(rule, &sandbox, &key).collect();
                (key, ports)
            }
        };
        match by_key.entry(key) {
            Entry::Vacant(v) => {
                v.insert(KeyRoutes {
                    // A table of more than 4G rules is not reused.
                    rule: u32::try_from(index).ok(),
                    ports,
                });
                false
            }
            // Two rules for one baseline and key: their ports are merged, as they always were,
            // and the merged entry is never reused.
            Entry::Occupied(mut o) => {
                let merged = o.get_mut();
                merged.rule = None;
                merged.ports = merged.ports.iter().chain(ports.iter()).cloned().collect();
                true
            }
        }
    }

    /// A rule's destination by workload port (each mapping's first location).
    fn destinations<'r>(
        rule: &'r RoutingRule,
        sandbox: &'r Arc<str>,
        routing_key: &'r Arc<str>,
    ) -> impl Iterator<Item = (u16, Arc<Destination>)> + 'r {
        rule.mappings.iter().filter_map(move |m| {
            let location = m.destinations.first()?;
            Some((
                m.workload_port,
                Arc::new(Destination {
                    sandbox: sandbox.clone(),
                    routing_key: routing_key.clone(),
                    location: Arc::new(location.clone()),
                }),
            ))
        })
    }

    /// The rules of one baseline, if it has any. Resolve once per request, then [`BaselineRules::route`].
    pub fn baseline(&self, baseline: &BaselineWorkload) -> Option<&BaselineRules> {
        self.baselines.get(baseline)
    }

    /// Shorthand for `baseline(b)?.lookup(port, key)`.
    pub fn lookup(
        &self,
        baseline: &BaselineWorkload,
        port: u16,
        key: &str,
    ) -> Option<&Arc<Destination>> {
        self.baseline(baseline)?.lookup(port, key)
    }

    /// The validated rules this table was built from, in source order.
    pub fn rules(&self) -> &[Arc<RoutingRule>] {
        &self.rules
    }

    pub fn len(&self) -> usize {
        self.rules.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Every location traffic may be sent to under this table. Connection pools drop idle
    /// connections to anything outside this set when a new table is published.
    pub fn locations(&self) -> BTreeSet<Location> {
        self.baselines
            .values()
            .flat_map(|b| b.by_key.values())
            .flat_map(|k| k.ports.iter().map(|(_, d)| Location::clone(&d.location)))
            .collect()
    }
}

/// A published table and its version (1 for the first table a source publishes, then +1 per swap;
/// 0 means nothing was published yet).
#[derive(Debug, Default)]
pub struct Snapshot {
    pub version: u64,
    pub table: RuleTable,
    /// When this version was stored, i.e. from when requests were routed by it (None before the
    /// first). Read by `/config_dump` and by the push benchmark, which measures up to this moment.
    pub published: Option<SystemTime>,
}

/// The lock-free handle every request loads the current table from. Cloning shares it.
#[derive(Debug, Clone, Default)]
pub struct SharedTable {
    inner: Arc<ArcSwap<Snapshot>>,
}

impl SharedTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// The current snapshot. Cheap and wait-free; hold it only for the duration of one decision.
    pub fn load(&self) -> arc_swap::Guard<Arc<Snapshot>> {
        self.inner.load()
    }

    /// The current snapshot as an owned `Arc` (for long-lived readers such as `/config_dump`).
    pub fn load_full(&self) -> Arc<Snapshot> {
        self.inner.load_full()
    }

    /// Publishes `table` as the next version and returns that version. A table has exactly one
    /// writer (its rule source), so reading the current version and storing need no CAS loop.
    pub fn store(&self, table: RuleTable) -> u64 {
        let version = self.inner.load().version + 1;
        self.inner.store(Arc::new(Snapshot {
            version,
            table,
            published: Some(SystemTime::now()),
        }));
        version
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::PortMapping;

    fn rule(key: &str, name: &str, port: u16, host: &str) -> RoutingRule {
        RoutingRule {
            routing_key: key.into(),
            baseline: BaselineWorkload {
                kind: "Deployment".into(),
                namespace: "ns".into(),
                name: name.into(),
            },
            destination_sandbox: format!("sb-{key}"),
            mappings: vec![PortMapping {
                workload_port: port,
                destinations: vec![
                    Location {
                        host: host.into(),
                        port: 9000,
                    },
                    Location {
                        host: "second".into(),
                        port: 1,
                    },
                ],
            }],
        }
    }

    #[test]
    fn lookup_by_baseline_port_and_key() {
        let t = RuleTable::new(vec![
            rule("k1", "a", 80, "fork-a"),
            rule("k2", "a", 81, "fork-a2"),
            rule("k1", "b", 80, "fork-b"),
        ]);
        let a = BaselineWorkload {
            kind: "Deployment".into(),
            namespace: "ns".into(),
            name: "a".into(),
        };
        let d = t.lookup(&a, 80, "k1").unwrap();
        assert_eq!(
            *d.location,
            Location {
                host: "fork-a".into(),
                port: 9000
            }
        );
        assert_eq!(&*d.sandbox, "sb-k1");
        assert!(t.lookup(&a, 81, "k1").is_none(), "port must match");
        assert!(t.lookup(&a, 80, "k3").is_none(), "unknown key");
        let other = BaselineWorkload {
            name: "zzz".into(),
            ..a.clone()
        };
        assert!(t.lookup(&other, 80, "k1").is_none(), "other baseline");
        let routed = t
            .baseline(&a)
            .unwrap()
            .route(81, ["nope", "k1", "k2"])
            .unwrap();
        assert_eq!(
            &*routed.routing_key, "k2",
            "first candidate with a rule wins"
        );
        assert_eq!(t.locations().len(), 3);
        let rules = t.baseline(&a).unwrap();
        assert_eq!(&*rules.lookup_any_port("k2").unwrap().sandbox, "sb-k2");
        assert!(rules.lookup_any_port("k3").is_none());
        assert_eq!(
            &*rules
                .route_any_port(["nope", "k2", "k1"])
                .unwrap()
                .routing_key,
            "k2",
            "any port: still the first candidate with a rule"
        );
    }

    #[test]
    fn a_rebuild_reuses_what_unchanged_rules_compiled_to() {
        let a = BaselineWorkload {
            kind: "Deployment".into(),
            namespace: "ns".into(),
            name: "a".into(),
        };
        let kept = Arc::new(rule("k1", "a", 80, "fork-1"));
        let first = RuleTable::compile(
            vec![
                kept.clone(),
                Arc::new(rule("k2", "a", 80, "fork-2")),
                Arc::new(rule("k3", "a", 80, "fork-3")),
            ],
            None,
        );
        let second = RuleTable::compile(
            vec![
                kept.clone(),
                // Equal by value but a new allocation: reused too.
                Arc::new(rule("k2", "a", 80, "fork-2")),
                // Changed: compiled afresh.
                Arc::new(rule("k3", "a", 80, "fork-3b")),
            ],
            Some(&first),
        );
        let same = |k: &str| {
            Arc::ptr_eq(
                first.lookup(&a, 80, k).unwrap(),
                second.lookup(&a, 80, k).unwrap(),
            )
        };
        assert!(same("k1") && same("k2"));
        assert!(!same("k3"));
        assert_eq!(
            second.lookup(&a, 80, "k3").unwrap().location.host,
            "fork-3b"
        );
        // A rebuild without the previous table routes the same.
        let fresh = RuleTable::compile(second.rules().to_vec(), None);
        for k in ["k1", "k2", "k3"] {
            assert_eq!(fresh.lookup(&a, 80, k), second.lookup(&a, 80, k));
        }
        // A rule removed is gone; one added is found.
        let third = RuleTable::compile(
            vec![kept, Arc::new(rule("k4", "a", 81, "fork-4"))],
            Some(&second),
        );
        assert!(third.lookup(&a, 80, "k2").is_none());
        assert_eq!(third.lookup(&a, 81, "k4").unwrap().location.host, "fork-4");
        assert_eq!(third.len(), 2);
    }

    #[test]
    fn two_rules_for_one_key_merge_their_ports_and_are_not_reused() {
        let a = BaselineWorkload {
            kind: "Deployment".into(),
            namespace: "ns".into(),
            name: "a".into(),
        };
        let rules = vec![
            Arc::new(rule("k", "a", 80, "fork-80")),
            Arc::new(rule("k", "a", 81, "fork-81")),
        ];
        let first = RuleTable::compile(rules.clone(), None);
        assert_eq!(first.lookup(&a, 80, "k").unwrap().location.host, "fork-80");
        assert_eq!(first.lookup(&a, 81, "k").unwrap().location.host, "fork-81");
        // Only the first of the two is left: the merged entry must not be reused.
        let second = RuleTable::compile(rules[..1].to_vec(), Some(&first));
        assert!(second.lookup(&a, 81, "k").is_none());
        assert_eq!(second.lookup(&a, 80, "k").unwrap().location.host, "fork-80");
    }

    fn workload(name: &str) -> BaselineWorkload {
        BaselineWorkload {
            kind: "Deployment".into(),
            namespace: "ns".into(),
            name: name.into(),
        }
    }

    /// A baseline's run of rules, and each of its keys with its rule's index.
    type Run = (Option<Range<usize>>, Vec<(String, Option<u32>)>);

    /// Where `table` has `name`'s rules as one run, and each key's rule index.
    fn run_of(table: &RuleTable, name: &str) -> Run {
        let b = &table.baselines[&workload(name)];
        let mut keys: Vec<_> = b
            .by_key
            .iter()
            .map(|(k, r)| (k.to_string(), r.rule))
            .collect();
        keys.sort();
        (b.run.clone(), keys)
    }

    #[test]
    fn a_replaced_rule_is_patched_into_a_copy_of_the_previous_keys() {
        let a = workload("a");
        let rules: Vec<_> = ["k1", "k2", "k3"]
            .into_iter()
            .map(|k| Arc::new(rule(k, "a", 80, &format!("fork-{k}"))))
            .collect();
        let first = RuleTable::compile(rules.clone(), None);
        assert_eq!(run_of(&first, "a").0, Some(0..3));
        let mut changed = rules.clone();
        changed[1] = Arc::new(rule("k2", "a", 80, "fork-k2b"));
        // Equal by value, another allocation.
        changed[2] = Arc::new(rule("k3", "a", 80, "fork-k3"));
        let second = RuleTable::compile(changed.clone(), Some(&first));
        let same = |t: &RuleTable, k: &str| {
            Arc::ptr_eq(
                first.lookup(&a, 80, k).unwrap(),
                t.lookup(&a, 80, k).unwrap(),
            )
        };
        assert!(same(&second, "k1") && same(&second, "k3"));
        assert!(!same(&second, "k2"));
        assert_eq!(
            second.lookup(&a, 80, "k2").unwrap().location.host,
            "fork-k2b"
        );
        assert_eq!(&*second.lookup(&a, 80, "k2").unwrap().routing_key, "k2");
        // The patched map's indices are those of the new rules.
        let k = |k: &str, i| (k.to_string(), Some(i));
        assert_eq!(
            run_of(&second, "a"),
            (Some(0..3), vec![k("k1", 0), k("k2", 1), k("k3", 2)])
        );
        // Compiled in another order, the rules are found by key: through those indices.
        let mut reversed = changed.clone();
        reversed.reverse();
        let third = RuleTable::compile(reversed, Some(&second));
        assert!(same(&third, "k1") && same(&third, "k3"));
        assert!(Arc::ptr_eq(
            second.lookup(&a, 80, "k2").unwrap(),
            third.lookup(&a, 80, "k2").unwrap()
        ));
        assert_eq!(
            run_of(&third, "a"),
            (Some(0..3), vec![k("k1", 2), k("k2", 1), k("k3", 0)])
        );
    }

    #[test]
    fn a_run_that_moved_takes_its_indices_along() {
        let b = workload("b");
        let a1 = Arc::new(rule("k1", "a", 80, "fork-a"));
        let b1 = Arc::new(rule("k1", "b", 80, "fork-b1"));
        let b2 = Arc::new(rule("k2", "b", 80, "fork-b2"));
        let first = RuleTable::compile(vec![a1, b1.clone(), b2.clone()], None);
        // Baseline a's rule is gone: b's run, unchanged, now starts at 0.
        let second = RuleTable::compile(vec![b1.clone(), b2.clone()], Some(&first));
        let k = |k: &str, i| (k.to_string(), Some(i));
        assert_eq!(
            run_of(&second, "b"),
            (Some(0..2), vec![k("k1", 0), k("k2", 1)])
        );
        assert!(second.baseline(&workload("a")).is_none());
        // In another order and new allocations: reused by key, through the moved indices.
        let third = RuleTable::compile(
            vec![
                Arc::new(RoutingRule::clone(&b2)),
                Arc::new(RoutingRule::clone(&b1)),
            ],
            Some(&second),
        );
        for key in ["k1", "k2"] {
            assert!(Arc::ptr_eq(
                first.lookup(&b, 80, key).unwrap(),
                third.lookup(&b, 80, key).unwrap()
            ));
        }
    }

    #[test]
    fn a_run_longer_than_before_is_still_one_run() {
        let a = workload("a");
        let k1 = Arc::new(rule("k1", "a", 80, "fork-1"));
        let k2 = Arc::new(rule("k2", "a", 80, "fork-2"));
        let first = RuleTable::compile(vec![k1.clone()], None);
        // k1 is patched, k2 added after it.
        let second = RuleTable::compile(vec![k1.clone(), k2.clone()], Some(&first));
        assert_eq!(run_of(&second, "a").0, Some(0..2));
        assert_eq!(second.lookup(&a, 80, "k2").unwrap().location.host, "fork-2");
        let third = RuleTable::compile(
            vec![k1, Arc::new(rule("k2", "a", 80, "fork-2b"))],
            Some(&second),
        );
        assert_eq!(third.lookup(&a, 80, "k1").unwrap().location.host, "fork-1");
        assert_eq!(third.lookup(&a, 80, "k2").unwrap().location.host, "fork-2b");
    }

    #[test]
    fn a_rule_of_another_baseline_in_its_place_is_not_patched_in() {
        let k1 = Arc::new(rule("k1", "a", 80, "fork-1"));
        let first = RuleTable::compile(
            vec![k1.clone(), Arc::new(rule("k2", "a", 80, "fork-a2"))],
            None,
        );
        // Same key, same place, baseline b: a's run is now k1 alone.
        let second = RuleTable::compile(
            vec![k1, Arc::new(rule("k2", "b", 80, "fork-b2"))],
            Some(&first),
        );
        assert!(second.lookup(&workload("a"), 80, "k2").is_none());
        assert_eq!(
            second
                .lookup(&workload("b"), 80, "k2")
                .unwrap()
                .location
                .host,
            "fork-b2"
        );
        assert_eq!(run_of(&second, "a").0, Some(0..1));
    }

    #[test]
    fn merged_keys_and_split_runs_are_never_patched() {
        let a = workload("a");
        let b = workload("b");
        // A second rule for k1 continues a patched run: merged, so no longer one rule per key.
        let k1 = Arc::new(rule("k1", "a", 80, "fork-80"));
        let first = RuleTable::compile(vec![k1.clone()], None);
        let k1_81 = Arc::new(rule("k1", "a", 81, "fork-81"));
        let second = RuleTable::compile(vec![k1.clone(), k1_81], Some(&first));
        assert_eq!(run_of(&second, "a"), (None, vec![("k1".into(), None)]));
        // Replacing the second must keep the first's port.
        let third = RuleTable::compile(
            vec![k1.clone(), Arc::new(rule("k1", "a", 81, "fork-81b"))],
            Some(&second),
        );
        assert_eq!(third.lookup(&a, 80, "k1").unwrap().location.host, "fork-80");
        assert_eq!(
            third.lookup(&a, 81, "k1").unwrap().location.host,
            "fork-81b"
        );
        // The same from rules merged when compiled afresh.
        let fourth = RuleTable::compile(
            vec![k1.clone(), Arc::new(rule("k1", "a", 81, "fork-81c"))],
            Some(&third),
        );
        assert_eq!(run_of(&third, "a"), (None, vec![("k1".into(), None)]));
        assert_eq!(
            fourth.lookup(&a, 80, "k1").unwrap().location.host,
            "fork-80"
        );
        assert_eq!(
            fourth.lookup(&a, 81, "k1").unwrap().location.host,
            "fork-81c"
        );

        // Baseline a in two runs, b between them: a's map is not one run of rules.
        let split = vec![
            k1.clone(),
            Arc::new(rule("k2", "b", 80, "fork-b")),
            Arc::new(rule("k3", "a", 80, "fork-3")),
        ];
        let first = RuleTable::compile(split.clone(), None);
        assert_eq!(run_of(&first, "a").0, None);
        assert_eq!(run_of(&first, "b").0, Some(1..2));
        let second = RuleTable::compile(split, Some(&first));
        assert_eq!(second.lookup(&b, 80, "k2").unwrap().location.host, "fork-b");
        assert_eq!(second.lookup(&a, 80, "k3").unwrap().location.host, "fork-3");
        assert_eq!(
            second.lookup(&a, 80, "k1").unwrap().location.host,
            "fork-80"
        );
    }

    #[test]
    fn shared_table_versions() {
        let s = SharedTable::new();
        assert_eq!(s.load().version, 0);
        assert_eq!(s.load().published, None);
        let before = SystemTime::now();
        assert_eq!(s.store(RuleTable::new(vec![rule("k", "a", 80, "h")])), 1);
        let first = s.load().published.unwrap();
        assert!(first >= before && first <= SystemTime::now());
        assert_eq!(s.store(RuleTable::default()), 2);
        assert!(s.load().table.is_empty());
        assert!(s.load().published.unwrap() >= first);
    }
}
