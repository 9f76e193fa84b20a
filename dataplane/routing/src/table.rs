//! The compiled routing table and the lock-free handle the request path reads it through.
//!
//! A [`RuleTable`] is immutable: a writer (a rule source) builds a whole new table off the hot path
//! and publishes it with [`SharedTable::store`]; requests only [`SharedTable::load`]. Lookup is two
//! hash probes and a scan over the handful of ports one key maps, so it does not allocate and its
//! cost does not grow with the number of rules.

use std::collections::hash_map::Entry;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::SystemTime;

use arc_swap::ArcSwap;

use crate::rules::{BaselineWorkload, Location, RoutingRule};

/// Where a keyed request goes: the first destination of the matching port mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    pub sandbox: Arc<str>,
    pub routing_key: Arc<str>,
    pub location: Location,
}

/// The destinations one routing key has, by workload port. A key rarely maps more than a few
/// ports, so a scanned slice beats a second hash map. Shared, so that a table built after a
/// change reuses what an unchanged rule compiled to.
type PortRoutes = Arc<[(u16, Arc<Destination>)]>;

/// One routing key's routes, and the rule they were compiled from (None when several rules gave
/// the same baseline and key, which validated rule sets never do).
#[derive(Debug)]
struct KeyRoutes {
    rule: Option<Arc<RoutingRule>>,
    ports: PortRoutes,
}

/// Rules of one baseline workload, by routing key then workload port.
#[derive(Debug, Default)]
pub struct BaselineRules {
    by_key: HashMap<Arc<str>, KeyRoutes>,
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
    baselines: HashMap<BaselineWorkload, BaselineRules>,
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
    pub fn compile(rules: Vec<Arc<RoutingRule>>, previous: Option<&RuleTable>) -> Self {
        let mut baselines: HashMap<BaselineWorkload, BaselineRules> = HashMap::new();
        // Rules come grouped by baseline (a sidecar's source has one): each run of one baseline
        // is hashed and looked up once.
        let mut rest = rules.as_slice();
        while let Some(first) = rest.first() {
            let baseline = &first.baseline;
            let run = rest.iter().take_while(|r| r.baseline == *baseline).count();
            let (this, next) = rest.split_at(run);
            rest = next;
            let before = previous.and_then(|p| p.baselines.get(baseline));
            let by_key = &mut baselines
                .entry(baseline.clone())
                .or_insert_with(|| BaselineRules {
                    by_key: HashMap::with_capacity(run),
                })
                .by_key;
            for rule in this {
                Self::add(by_key, rule, before);
            }
        }
        RuleTable { baselines, rules }
    }

    /// Adds one rule's routes to its baseline's keys, reusing what `before` compiled for an
    /// equal rule.
    fn add(
        by_key: &mut HashMap<Arc<str>, KeyRoutes>,
        rule: &Arc<RoutingRule>,
        before: Option<&BaselineRules>,
    ) {
        let known = before
            .and_then(|b| b.by_key.get_key_value(rule.routing_key.as_str()))
            .filter(|(_, k)| {
                k.rule
                    .as_ref()
                    .is_some_and(|r| Arc::ptr_eq(r, rule) || **r == **rule)
            });
        let (key, ports) = match known {
            Some((key, k)) => (key.clone(), k.ports.clone()),
            None => {
                let sandbox: Arc<str> = Arc::from(rule.destination_sandbox.as_str());
                let routing_key: Arc<str> = Arc::from(rule.routing_key.as_str());
                let ports = Self::destinations(rule, &sandbox, &routing_key).collect();
                (routing_key, ports)
            }
        };
        match by_key.entry(key) {
            Entry::Vacant(v) => {
                v.insert(KeyRoutes {
                    rule: Some(rule.clone()),
                    ports,
                });
            }
            // Two rules for one baseline and key: their ports are merged, as they always were,
            // and the merged entry is never reused.
            Entry::Occupied(mut o) => {
                let merged = o.get_mut();
                merged.rule = None;
                merged.ports = merged.ports.iter().chain(ports.iter()).cloned().collect();
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
                    location: location.clone(),
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
            .flat_map(|k| k.ports.iter().map(|(_, d)| d.location.clone()))
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
            d.location,
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
