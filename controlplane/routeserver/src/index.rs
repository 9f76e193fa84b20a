//! The index of routing rules: immutable snapshots published on a `watch` channel.
//!
//! Each snapshot carries the keys changed by the last [`CHANGE_LOG`] publications, so a watcher
//! that wakes up (however many versions later) diffs only the rules that changed instead of the
//! whole index; a watcher that fell further behind does one full diff.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ops::Bound;
use std::sync::{Arc, Mutex};

use spur_proto::routes;
use spur_routing::rules::RuleSpec;
use spur_routing::{BaselineWorkload, RoutingRule};
use tokio::sync::watch;
use tokio::time::Instant;

/// Publications remembered for incremental diffs.
const CHANGE_LOG: usize = 64;

pub use crate::key::RuleKey;

/// One rule, pre-rendered for every API that serves it.
#[derive(Debug, PartialEq)]
pub struct Entry {
    /// The rule's identity, kept so that a watch can find what it sent without copying it.
    key: RuleKey,
    pub rule: RoutingRule,
    pub proto: routes::WorkloadRoutingRule,
    /// `proto`, encoded: what every gRPC watcher is sent ([`crate::wire`]).
    pub wire: bytes::Bytes,
    pub spec: RuleSpec,
}

impl Entry {
    pub(crate) fn new(rule: RoutingRule) -> Self {
        let proto = spur_routing::wire::rule_to_proto(&rule);
        Entry {
            key: RuleKey {
                baseline: rule.baseline.clone(),
                routing_key: rule.routing_key.clone(),
            },
            wire: prost::Message::encode_to_vec(&proto).into(),
            proto,
            spec: rule.to_spec(),
            rule,
        }
    }

    pub fn key(&self) -> &RuleKey {
        &self.key
    }
}

/// The routes in force by a rule set, for the route history (the store gives no `since`).
fn in_force(rules: &BTreeMap<RuleKey, Arc<Entry>>) -> crate::history::InForce {
    rules
        .iter()
        .map(|(k, e)| {
            let g = crate::history::Given::stamped(e.rule.destination_sandbox.clone());
            (k.clone(), g)
        })
        .collect()
}

/// Optional filters of the Routes API: an empty field matches anything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    pub kind: String,
    pub namespace: String,
    pub name: String,
    pub routing_key: String,
    pub sandbox: String,
}

impl Filter {
    pub fn from_request(r: &routes::WorkloadRoutingRulesRequest) -> Self {
        let b = r.baseline_workload.clone().unwrap_or_default();
        Filter {
            kind: b.kind,
            namespace: b.namespace,
            name: b.name,
            routing_key: r.routing_key.clone(),
            sandbox: r
                .destination_sandbox
                .as_ref()
                .map(|d| d.name.clone())
                .unwrap_or_default(),
        }
    }

    fn field(want: &str, have: &str) -> bool {
        want.is_empty() || want == have
    }

    pub fn matches(&self, e: &Entry) -> bool {
        let r = &e.rule;
        Self::field(&self.kind, &r.baseline.kind)
            && Self::field(&self.namespace, &r.baseline.namespace)
            && Self::field(&self.name, &r.baseline.name)
            && Self::field(&self.routing_key, &r.routing_key)
            && Self::field(&self.sandbox, &r.destination_sandbox)
    }

    /// The one baseline this filter pins down, if it names all three fields.
    fn baseline(&self) -> Option<BaselineWorkload> {
        (!self.kind.is_empty() && !self.namespace.is_empty() && !self.name.is_empty()).then(|| {
            BaselineWorkload {
                kind: self.kind.clone(),
                namespace: self.namespace.clone(),
                name: self.name.clone(),
            }
        })
    }
}

/// One published state of the index.
#[derive(Debug)]
pub struct Snapshot {
    /// 0 before the store's first publication.
    pub version: u64,
    pub rules: BTreeMap<RuleKey, Arc<Entry>>,
    changes: VecDeque<(u64, Arc<[RuleKey]>)>,
    /// When this snapshot was published (push latency is measured from here).
    pub published: Instant,
}

impl Snapshot {
    /// Matching entries in key order; a filter naming a whole baseline reads only its range.
    pub fn matching<'a>(
        &'a self,
        filter: &'a Filter,
    ) -> Box<dyn Iterator<Item = &'a Arc<Entry>> + Send + 'a> {
        self.matching_after(filter, None)
    }

    /// [`Self::matching`], from the first key after `after` on (a watch sends a large initial
    /// set in parts).
    pub(crate) fn matching_after<'a>(
        &'a self,
        filter: &'a Filter,
        after: Option<&RuleKey>,
    ) -> Box<dyn Iterator<Item = &'a Arc<Entry>> + Send + 'a> {
        let from = |start: Option<RuleKey>| -> (Bound<RuleKey>, Bound<RuleKey>) {
            match (after, start) {
                (Some(a), Some(s)) if *a < s => (Bound::Included(s), Bound::Unbounded),
                (Some(a), _) => (Bound::Excluded(a.clone()), Bound::Unbounded),
                (None, Some(s)) => (Bound::Included(s), Bound::Unbounded),
                (None, None) => (Bound::Unbounded, Bound::Unbounded),
            }
        };
        match filter.baseline() {
            Some(baseline) => {
                let start = RuleKey {
                    baseline: baseline.clone(),
                    routing_key: String::new(),
                };
                Box::new(
                    self.rules
                        .range(from(Some(start)))
                        .take_while(move |(k, _)| k.baseline == baseline)
                        .map(|(_, e)| e)
                        .filter(move |e| filter.matches(e)),
                )
            }
            None => Box::new(
                self.rules
                    .range(from(None))
                    .map(|(_, e)| e)
                    .filter(move |e| filter.matches(e)),
            ),
        }
    }

    /// Keys changed after `version` up to this snapshot, sorted, or `None` if the log no longer
    /// reaches back that far (the caller then diffs everything). A watcher one version behind
    /// (every watcher, after each publication) shares the log's own keys: nothing is copied.
    pub fn changed_since(&self, version: u64) -> Option<Arc<[RuleKey]>> {
        if version >= self.version {
            return Some(Arc::from([]));
        }
        let oldest = self.changes.front().map_or(self.version + 1, |(v, _)| *v);
        if oldest > version + 1 {
            return None;
        }
        let mut newer = self.changes.iter().filter(|(v, _)| *v > version);
        match (newer.next(), newer.next()) {
            (Some((_, keys)), None) => Some(keys.clone()),
            _ => {
                let merged: BTreeSet<&RuleKey> = self
                    .changes
                    .iter()
                    .filter(|(v, _)| *v > version)
                    .flat_map(|(_, keys)| keys.iter())
                    .collect();
                Some(merged.into_iter().cloned().collect())
            }
        }
    }
}

/// The write side and the subscription point of the index. Cheap to clone.
#[derive(Clone)]
pub struct Index {
    tx: Arc<watch::Sender<Arc<Snapshot>>>,
    /// When each route was in force, stamped as the rule set changes.
    history: crate::history::History,
    problems: Arc<Mutex<Arc<Vec<String>>>>,
    services: Arc<Mutex<Arc<Vec<routes::ClusterService>>>>,
    /// None until a store publishes its first model.
    #[cfg(feature = "kubernetes")]
    xds: Arc<watch::Sender<Option<Arc<crate::xds::model::Model>>>>,
    /// None until a store publishes its first L4 model (ListenerSets).
    #[cfg(feature = "kubernetes")]
    l4: Arc<watch::Sender<Option<Arc<crate::l4_model::Model>>>>,
}

impl Default for Index {
    fn default() -> Self {
        Self::new()
    }
}

impl Index {
    pub fn new() -> Self {
        let empty = Snapshot {
            version: 0,
            rules: BTreeMap::new(),
            changes: VecDeque::new(),
            published: Instant::now(),
        };
        let (tx, _) = watch::channel(Arc::new(empty));
        Index {
            tx: Arc::new(tx),
            history: crate::history::History::default(),
            problems: Arc::default(),
            services: Arc::default(),
            #[cfg(feature = "kubernetes")]
            xds: Arc::new(watch::channel(None).0),
            #[cfg(feature = "kubernetes")]
            l4: Arc::new(watch::channel(None).0),
        }
    }

    pub fn current(&self) -> Arc<Snapshot> {
        self.tx.borrow().clone()
    }

    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.tx.subscribe()
    }

    /// The route history the rule changes are stamped into.
    pub fn history(&self) -> &crate::history::History {
        &self.history
    }

    /// Replaces the whole rule set. Publishes a new version only if something changed (or on the
    /// first call, so "synced" can be reported even for an empty set). Returns the version in force.
    /// The route history follows the rules (see [`crate::history`]).
    pub fn replace_all(&self, rules: Vec<RoutingRule>) -> u64 {
        self.publish(rules, None)
    }

    /// [`Self::replace_all`], with the routes in force for the route history given by the store
    /// (with their starts) rather than taken from the rules.
    #[cfg(feature = "kubernetes")]
    pub(crate) fn replace_all_with_history(
        &self,
        rules: Vec<RoutingRule>,
        routes: crate::history::InForce,
    ) -> u64 {
        self.publish(rules, Some(routes))
    }

    fn publish(&self, rules: Vec<RoutingRule>, routes: Option<crate::history::InForce>) -> u64 {
        let current = self.current();
        let mut next: BTreeMap<RuleKey, Arc<Entry>> = BTreeMap::new();
        for rule in rules {
            let key = RuleKey {
                baseline: rule.baseline.clone(),
                routing_key: rule.routing_key.clone(),
            };
            // Unchanged rules keep their `Arc` (watchers compare by pointer first) and skip the
            // conversions, so republishing a large, mostly unchanged set stays cheap.
            let entry = match current.rules.get(&key) {
                Some(old) if old.rule == rule => old.clone(),
                _ => Arc::new(Entry::new(rule)),
            };
            next.insert(key, entry);
        }
        let mut changed: Vec<RuleKey> = Vec::new();
        for (k, e) in &next {
            match current.rules.get(k) {
                Some(old) if Arc::ptr_eq(old, e) => {}
                _ => changed.push(k.clone()),
            }
        }
        changed.extend(
            current
                .rules
                .keys()
                .filter(|k| !next.contains_key(*k))
                .cloned(),
        );
        match &routes {
            Some(routes) => self.history.observe(routes),
            None if !changed.is_empty() || current.version == 0 => {
                self.history.observe(&in_force(&next))
            }
            None => {}
        }
        if changed.is_empty() && current.version > 0 {
            return current.version;
        }
        let version = current.version + 1;
        let mut changes = current.changes.clone();
        // Sorted, as `changed_since` promises.
        changed.sort();
        changed.dedup();
        changes.push_back((version, changed.into()));
        while changes.len() > CHANGE_LOG {
            changes.pop_front();
        }
        self.tx.send_replace(Arc::new(Snapshot {
            version,
            rules: next,
            changes,
            published: Instant::now(),
        }));
        version
    }

    /// Problems the store wants operators to see (invalid files, conflicts), for `/healthz`.
    pub fn set_problems(&self, problems: Vec<String>) {
        *self.problems.lock().unwrap_or_else(|p| p.into_inner()) = Arc::new(problems);
    }

    pub fn problems(&self) -> Arc<Vec<String>> {
        self.problems
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Cluster services for `GetClusterServices`. A directory store has no cluster and sets
    /// none; the Kubernetes store fills them from Services and sandboxes.
    pub fn set_services(&self, services: Vec<routes::ClusterService>) {
        *self.services.lock().unwrap_or_else(|p| p.into_inner()) = Arc::new(services);
    }

    pub fn services(&self) -> Arc<Vec<routes::ClusterService>> {
        self.services
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// The models the Kubernetes store publishes beside the rules (feature `kubernetes`).
#[cfg(feature = "kubernetes")]
impl Index {
    /// Every ListenerSet, rendered for gateways. Only a store that watches ListenerSets (the
    /// Kubernetes store `with_l4`) sets it; published only on change.
    pub fn set_l4(&self, model: crate::l4_model::Model) {
        self.l4.send_if_modified(|m| {
            if m.as_deref() == Some(&model) {
                return false;
            }
            *m = Some(Arc::new(model));
            true
        });
    }

    pub fn subscribe_l4(&self) -> watch::Receiver<Option<Arc<crate::l4_model::Model>>> {
        self.l4.subscribe()
    }

    /// The cluster as the xDS server serves it. Only a store that sees Services and
    /// EndpointSlices (the Kubernetes store, with xDS on) sets it; published only on change.
    pub fn set_xds(&self, model: crate::xds::model::Model) {
        self.xds.send_if_modified(|m| {
            if m.as_deref() == Some(&model) {
                return false;
            }
            *m = Some(Arc::new(model));
            true
        });
    }

    pub fn subscribe_xds(&self) -> watch::Receiver<Option<Arc<crate::xds::model::Model>>> {
        self.xds.subscribe()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use spur_routing::rules::{Location, PortMapping};

    /// A rule of `Deployment/<ns>/<name>` for `key`, port 80 to `h:<port>` (also the watch tests').
    pub(crate) fn rule(ns: &str, name: &str, key: &str, port: u16) -> RoutingRule {
        RoutingRule {
            routing_key: key.into(),
            baseline: BaselineWorkload {
                kind: "Deployment".into(),
                namespace: ns.into(),
                name: name.into(),
            },
            destination_sandbox: format!("sb-{key}"),
            mappings: vec![PortMapping {
                workload_port: 80,
                destinations: vec![Location {
                    host: "h".into(),
                    port,
                }],
            }],
        }
    }

    #[test]
    fn publishes_only_changes_and_logs_changed_keys() {
        let index = Index::new();
        assert_eq!(
            index.replace_all(vec![]),
            1,
            "first publication even when empty"
        );
        assert_eq!(index.replace_all(vec![]), 1, "no change, no new version");
        assert_eq!(
            index.replace_all(vec![rule("a", "web", "k1", 1), rule("a", "web", "k2", 1)]),
            2
        );
        assert_eq!(
            index.replace_all(vec![rule("a", "web", "k1", 2), rule("a", "web", "k2", 1)]),
            3
        );
        let snap = index.current();
        let changed = snap.changed_since(2).unwrap();
        assert_eq!(
            changed
                .iter()
                .map(|k| k.routing_key.as_str())
                .collect::<Vec<_>>(),
            ["k1"]
        );
        assert_eq!(snap.changed_since(1).unwrap().len(), 2);
        assert_eq!(index.replace_all(vec![rule("a", "web", "k2", 1)]), 4);
        assert_eq!(
            index.current().changed_since(3).unwrap().len(),
            1,
            "removal is a change"
        );
    }

    #[test]
    fn change_log_is_bounded_and_falls_back_to_full_diff() {
        let index = Index::new();
        for p in 1..=(CHANGE_LOG as u16 + 10) {
            index.replace_all(vec![rule("a", "web", "k", p)]);
        }
        let snap = index.current();
        assert!(snap.changed_since(1).is_none(), "too far behind");
        assert!(snap.changed_since(snap.version - 1).is_some());
    }

    #[test]
    fn filters_and_baseline_ranges() {
        let index = Index::new();
        index.replace_all(vec![
            rule("a", "web", "k1", 1),
            rule("a", "web2", "k1", 1),
            rule("b", "web", "k2", 1),
        ]);
        let snap = index.current();
        let f = Filter {
            kind: "Deployment".into(),
            namespace: "a".into(),
            name: "web".into(),
            ..Filter::default()
        };
        assert_eq!(snap.matching(&f).count(), 1);
        let f = Filter {
            routing_key: "k1".into(),
            ..Filter::default()
        };
        assert_eq!(snap.matching(&f).count(), 2);
        let f = Filter {
            sandbox: "sb-k2".into(),
            ..Filter::default()
        };
        assert_eq!(snap.matching(&f).count(), 1);
        assert_eq!(snap.matching(&Filter::default()).count(), 3);
    }
}
