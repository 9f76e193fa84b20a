//! The sidecar's route-server client: one watch stream for its own baseline.
//!
//! - Nothing is published until the stream's SYNCED: a (re)connection builds the complete rule
//!   set off to the side and swaps it in whole, so routes never vanish during a resync.
//! - Every rule is validated on arrival (`TryFrom` via the shared validator); an invalid one is
//!   logged, counted and dropped — for a REPLACE, the previous version of that rule stays.
//! - Ops that arrive together are applied together and published as one table.
//! - When the stream breaks, the last table stays in force and the client reconnects with
//!   jittered exponential backoff.
//! - In a cluster the connection is TLS, verified against the CA bundle the operator publishes
//!   into the pod's namespace, and authenticated with the pod's projected ServiceAccount token.
//!   Both files are re-read for every connection: the kubelet replaces them as they rotate.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use spur_proto::routes::routes_client::RoutesClient;
use spur_proto::routes::{self, WatchOp, WorkloadRoutingRuleOp};
use spur_routing::{BaselineWorkload, RoutingRule};
use tokio_util::sync::CancellationToken;

use crate::connect::Connector;
use crate::{Error, Publisher};

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(10);

/// The route server to watch, and how to reach it safely.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteServerConn {
    /// `host:port` or an `http://` URL; the host is also the name the certificate must carry.
    pub addr: String,
    /// CA bundle (PEM) the route server's certificate must chain to. Set: TLS; unset: plaintext.
    pub ca: Option<PathBuf>,
    /// File holding the bearer token to present (a projected ServiceAccount token).
    pub token: Option<PathBuf>,
}

impl RouteServerConn {
    /// Plaintext and no token: for a route server that serves loopback only.
    pub fn plain(addr: impl Into<String>) -> Self {
        RouteServerConn {
            addr: addr.into(),
            ca: None,
            token: None,
        }
    }
}

/// Watches the route server for one baseline's rules and publishes them.
pub struct RouteServerSource {
    connector: Connector,
    baseline: BaselineWorkload,
    publisher: Publisher,
    connected: Gauge,
    reconnects: Counter,
    rejected: Counter,
}

impl RouteServerSource {
    /// Registers `routeserver_connected`, `routeserver_reconnects_total` and
    /// `routeserver_rules_rejected_total`.
    pub fn new(
        conn: RouteServerConn,
        baseline: BaselineWorkload,
        publisher: Publisher,
        registry: &mut Registry,
    ) -> Result<Self, Error> {
        let connector = Connector::new(conn)?;
        let connected = Gauge::default();
        let reconnects = Counter::default();
        let rejected = Counter::default();
        registry.register(
            "routeserver_connected",
            "1 while a watch stream to the route server is synced",
            connected.clone(),
        );
        registry.register(
            "routeserver_reconnects",
            "Watch streams to the route server that ended or failed",
            reconnects.clone(),
        );
        registry.register(
            "routeserver_rules_rejected",
            "Rules from the route server that failed validation",
            rejected.clone(),
        );
        Ok(RouteServerSource {
            connector,
            baseline,
            publisher,
            connected,
            reconnects,
            rejected,
        })
    }

    /// Watches until `stop` is cancelled, reconnecting as needed.
    pub async fn run(self, stop: CancellationToken) {
        let mut backoff = BACKOFF_MIN;
        loop {
            let res = tokio::select! {
                () = stop.cancelled() => return,
                r = self.session(&mut backoff) => r,
            };
            self.connected.set(0);
            self.reconnects.inc();
            match res {
                Ok(()) => {
                    tracing::info!(addr = %self.connector.addr(), "route server closed the watch stream; reconnecting")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "route server watch failed; keeping the last table")
                }
            }
            let delay = spur_runtime::jitter(backoff);
            backoff = (backoff * 2).min(BACKOFF_MAX);
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
            }
        }
    }

    fn err(&self, reason: impl std::fmt::Display) -> Error {
        self.connector.err(reason)
    }

    async fn session(&self, backoff: &mut Duration) -> Result<(), Error> {
        let authorization = self.connector.authorization()?;
        let channel = self.connector.channel().await?;
        let mut client = RoutesClient::new(channel);
        let request = routes::WorkloadRoutingRulesRequest {
            baseline_workload: Some(routes::BaselineWorkload {
                kind: self.baseline.kind.clone(),
                namespace: self.baseline.namespace.clone(),
                name: self.baseline.name.clone(),
            }),
            ..Default::default()
        };
        let mut request = tonic::Request::new(request);
        if let Some(value) = authorization {
            request.metadata_mut().insert("authorization", value);
        }
        let mut stream = client
            .watch_workload_routing_rules(request)
            .await
            .map_err(|s| self.err(s))?
            .into_inner();

        let mut rules: BTreeMap<String, Arc<RoutingRule>> = BTreeMap::new();
        loop {
            let op = stream.message().await.map_err(|s| self.err(s))?;
            let Some(op) = op else {
                return Err(self.err("stream ended before SYNCED"));
            };
            match op.op() {
                WatchOp::Add => self.apply(&mut rules, op),
                WatchOp::Synced => break,
                other => {
                    return Err(self.err(format!("protocol violation: {other:?} before SYNCED")));
                }
            }
        }
        self.publish(&rules);
        self.connected.set(1);
        *backoff = BACKOFF_MIN;

        loop {
            let Some(op) = stream.message().await.map_err(|s| self.err(s))? else {
                return Ok(());
            };
            self.apply(&mut rules, op);
            // Apply everything already received before publishing once.
            while let Some(next) = stream.message().now_or_never() {
                match next.map_err(|s| self.err(s))? {
                    Some(op) => self.apply(&mut rules, op),
                    None => {
                        self.publish(&rules);
                        return Ok(());
                    }
                }
            }
            self.publish(&rules);
        }
    }

    /// Applies one op to the rule set. The op is taken by value: the decoded message's strings
    /// become the rule's, uncopied.
    fn apply(&self, rules: &mut BTreeMap<String, Arc<RoutingRule>>, op: WorkloadRoutingRuleOp) {
        let kind = op.op();
        let Some(route) = op.route else {
            if kind != WatchOp::Synced {
                self.rejected.inc();
                tracing::warn!(op = ?kind, "route server sent an op without a rule; ignored");
            }
            return;
        };
        match kind {
            WatchOp::Remove => {
                rules.remove(&route.routing_key);
            }
            WatchOp::Add | WatchOp::Replace => {
                match RoutingRule::from_spec(0, spur_routing::wire::rule_from_proto_owned(route)) {
                    Ok(rule) if rule.baseline == self.baseline => {
                        // A known key keeps its map key: no copy of the key for a REPLACE.
                        match rules.get_mut(&rule.routing_key) {
                            Some(slot) => *slot = Arc::new(rule),
                            None => {
                                rules.insert(rule.routing_key.clone(), Arc::new(rule));
                            }
                        }
                    }
                    Ok(rule) => {
                        self.rejected.inc();
                        tracing::warn!(baseline = %rule.baseline, "route server sent a rule for another baseline; ignored");
                    }
                    Err(e) => {
                        self.rejected.inc();
                        tracing::warn!(error = %e, "invalid rule from the route server ignored");
                    }
                }
            }
            WatchOp::Synced => {}
        }
    }

    fn publish(&self, rules: &BTreeMap<String, Arc<RoutingRule>>) {
        let version = self
            .publisher
            .publish_shared(rules.values().cloned().collect());
        tracing::debug!(
            version,
            rules = rules.len(),
            "routing table published from the route server"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spur_proto::routes::{
        DestinationSandbox, Location, WorkloadPortMapping, WorkloadRoutingRule,
    };
    use spur_routing::SharedTable;

    fn baseline() -> BaselineWorkload {
        BaselineWorkload {
            kind: "Deployment".into(),
            namespace: "ns".into(),
            name: "web".into(),
        }
    }

    fn source() -> RouteServerSource {
        let mut registry = Registry::default();
        let publisher = Publisher::new(SharedTable::new(), &mut registry);
        RouteServerSource::new(
            RouteServerConn::plain("127.0.0.1:1"),
            baseline(),
            publisher,
            &mut registry,
        )
        .unwrap()
    }

    fn op(op: WatchOp, key: &str, name: &str, host: &str) -> WorkloadRoutingRuleOp {
        WorkloadRoutingRuleOp {
            op: op.into(),
            route: Some(WorkloadRoutingRule {
                routing_key: key.into(),
                baseline: Some(routes::BaselineWorkload {
                    kind: "Deployment".into(),
                    namespace: "ns".into(),
                    name: name.into(),
                }),
                destination_sandbox: Some(DestinationSandbox { name: "sb".into() }),
                mappings: vec![WorkloadPortMapping {
                    workload_port: 80,
                    destinations: vec![Location {
                        host: host.into(),
                        port: 8080,
                    }],
                }],
            }),
        }
    }

    fn host(rules: &BTreeMap<String, Arc<RoutingRule>>, key: &str) -> Option<String> {
        let rule = rules.get(key)?;
        assert_eq!(rule.routing_key, key, "a rule is filed under its key");
        Some(rule.mappings[0].destinations[0].host.clone())
    }

    #[test]
    fn ops_add_replace_and_remove_rules_of_this_baseline_only() {
        let s = source();
        let mut rules = BTreeMap::new();
        s.apply(&mut rules, op(WatchOp::Add, "k1", "web", "h1"));
        s.apply(&mut rules, op(WatchOp::Add, "k2", "web", "h2"));
        s.apply(&mut rules, op(WatchOp::Replace, "k1", "web", "h1b"));
        assert_eq!(host(&rules, "k1").as_deref(), Some("h1b"));
        assert_eq!(host(&rules, "k2").as_deref(), Some("h2"));
        // A REPLACE of a key not known yet adds it.
        s.apply(&mut rules, op(WatchOp::Replace, "k3", "web", "h3"));
        assert_eq!(host(&rules, "k3").as_deref(), Some("h3"));
        s.apply(&mut rules, op(WatchOp::Remove, "k2", "web", "h2"));
        assert_eq!(host(&rules, "k2"), None);
        assert_eq!(s.rejected.get(), 0);

        // Another baseline's rule, an invalid rule and an op without a rule are dropped: the
        // rule set is as it was.
        s.apply(&mut rules, op(WatchOp::Replace, "k1", "other", "h1c"));
        s.apply(&mut rules, op(WatchOp::Replace, "k1", "web", "bad host"));
        s.apply(
            &mut rules,
            WorkloadRoutingRuleOp {
                op: WatchOp::Replace.into(),
                route: None,
            },
        );
        assert_eq!(s.rejected.get(), 3);
        assert_eq!(rules.len(), 2);
        assert_eq!(host(&rules, "k1").as_deref(), Some("h1b"));
    }
}
