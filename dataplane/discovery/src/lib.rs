//! Routing-table sources (a rule file, or the route server's watch stream): validate, publish, keep the last good table.
//!
//! A source owns the single write side of a [`SharedTable`]. Every update is parsed and validated
//! as a whole before it is published; an invalid update is reported (log + metric) and the last
//! good table stays in force. Consumers that must react to a swap (connection pools) watch the
//! [`Publisher::subscribe`] channel, which carries the published version.

mod connect;
mod file;
mod history;
mod routeserver;

pub use connect::Connector;
pub use file::{FileSource, parse_rules};
pub use history::{HistorySource, SharedHistory};
pub use routeserver::{RouteServerConn, RouteServerSource};

use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use spur_routing::{RoutingRule, RuleTable, SharedTable};
use tokio::sync::watch;

/// Errors of this crate: a source that cannot be read or does not hold valid rules.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read rules from {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("rules in {path} are not valid YAML/JSON: {reason}")]
    Parse { path: String, reason: String },
    #[error("rules in {path} are invalid: {source}")]
    Invalid {
        path: String,
        source: spur_routing::Error,
    },
    #[error("route server {addr}: {reason}")]
    RouteServer { addr: String, reason: String },
    /// Another Spur server reached with a [`connect::Connector`] (the traffic store).
    #[error("{what} {addr}: {reason}")]
    Server {
        what: &'static str,
        addr: String,
        reason: String,
    },
}

/// The write side of a routing table: publishes validated tables and counts what happened.
pub struct Publisher {
    table: SharedTable,
    changes: watch::Sender<u64>,
    version: Gauge,
    rules: Gauge,
    updates_ok: Counter,
    updates_rejected: Counter,
}

impl Publisher {
    /// Registers `route_table_version`, `route_table_rules` and `route_table_updates_total{result}`.
    pub fn new(table: SharedTable, registry: &mut Registry) -> Self {
        let version = Gauge::default();
        let rules = Gauge::default();
        let updates = Family::<Vec<(String, String)>, Counter>::default();
        registry.register(
            "route_table_version",
            "Version of the routing table in force (0: none yet)",
            version.clone(),
        );
        registry.register(
            "route_table_rules",
            "Routing rules in the table in force",
            rules.clone(),
        );
        registry.register(
            "route_table_updates",
            "Routing table updates by result (ok: published; rejected: invalid, last good table kept)",
            updates.clone(),
        );
        let updates_ok = updates
            .get_or_create(&vec![("result".into(), "ok".into())])
            .clone();
        let updates_rejected = updates
            .get_or_create(&vec![("result".into(), "rejected".into())])
            .clone();
        let (changes, _) = watch::channel(0);
        Publisher {
            table,
            changes,
            version,
            rules,
            updates_ok,
            updates_rejected,
        }
    }

    /// A receiver that sees the version of every published table.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    pub fn table(&self) -> &SharedTable {
        &self.table
    }

    /// Publishes validated rules as the next table version.
    pub fn publish(&self, rules: Vec<RoutingRule>) -> u64 {
        self.publish_shared(rules.into_iter().map(Arc::new).collect())
    }

    /// [`Self::publish`] for rules the source keeps too: what an unchanged rule compiled to in the
    /// table in force is reused ([`RuleTable::compile`]).
    pub fn publish_shared(&self, rules: Vec<Arc<RoutingRule>>) -> u64 {
        let count = rules.len();
        let previous = self.table.load_full();
        let version = self
            .table
            .store(RuleTable::compile(rules, Some(&previous.table)));
        self.version.set(i64::try_from(version).unwrap_or(i64::MAX));
        self.rules.set(i64::try_from(count).unwrap_or(i64::MAX));
        self.updates_ok.inc();
        self.changes.send_replace(version);
        version
    }

    /// Records a rejected update; the table in force does not change.
    pub fn reject(&self, error: &Error) {
        self.updates_rejected.inc();
        tracing::warn!(error = %error, "routing rules rejected; keeping the last good table");
    }
}
