//! Operator metrics, registered into the caller's registry.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Kind {
    kind: &'static str,
}

#[derive(Clone, Debug, Default)]
pub struct Metrics {
    reconciles: Family<Kind, Counter>,
    failures: Counter,
    leader: Gauge,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Metrics::default();
        registry.register(
            "reconciles",
            "Reconcile passes, by resource kind",
            m.reconciles.clone(),
        );
        registry.register(
            "reconcile_failures",
            "Reconcile passes that failed and were retried with backoff",
            m.failures.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica holds the lease and runs the controllers",
            m.leader.clone(),
        );
        m
    }

    pub(crate) fn set_leader(&self, leading: bool) {
        self.leader.set(i64::from(leading));
    }

    pub(crate) fn reconciled(&self, kind: &'static str) {
        self.reconciles.get_or_create(&Kind { kind }).inc();
    }

    pub(crate) fn failure(&self) {
        self.failures.inc();
    }
}
