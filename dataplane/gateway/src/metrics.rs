//! The gateway's own metrics (`spur_gateway_*`), next to spur-l4's (`spur_l4_*`).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;

#[derive(Clone, Debug)]
pub(crate) struct Metrics {
    updates: Family<Labels, Counter>,
    pub(crate) version: Gauge,
    pub(crate) connected: Gauge,
    pub(crate) reconnects: Counter,
    lookups: Family<Labels, Counter>,
    reports: Family<Labels, Counter>,
    pub(crate) empty_clusters: Gauge,
}

impl Metrics {
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let m = Metrics {
            updates: Family::default(),
            version: Gauge::default(),
            connected: Gauge::default(),
            reconnects: Counter::default(),
            lookups: Family::default(),
            reports: Family::default(),
            empty_clusters: Gauge::default(),
        };
        registry.register(
            "config_updates",
            "Configurations received from the route server, by result (applied; rejected: invalid or not bindable, the last good one keeps running)",
            m.updates.clone(),
        );
        registry.register(
            "config_version",
            "Version of the configuration running, shifted right by one bit to fit a gauge (0: none yet)",
            m.version.clone(),
        );
        registry.register(
            "routeserver_connected",
            "1 while the Watch stream to the route server is open",
            m.connected.clone(),
        );
        registry.register(
            "routeserver_reconnects",
            "Watch streams to the route server that ended or failed",
            m.reconnects.clone(),
        );
        registry.register(
            "dns_lookups",
            "DNS endpoint lookups by result (ok, error: the last addresses stay)",
            m.lookups.clone(),
        );
        registry.register(
            "reports",
            "Health reports to the route server by result (ok, error)",
            m.reports.clone(),
        );
        registry.register(
            "clusters_empty",
            "Clusters left out of the running configuration for want of an endpoint",
            m.empty_clusters.clone(),
        );
        m
    }

    fn inc(family: &Family<Labels, Counter>, result: &str) {
        family
            .get_or_create(&vec![("result".into(), result.into())])
            .inc();
    }

    pub(crate) fn update(&self, applied: bool) {
        Self::inc(&self.updates, if applied { "applied" } else { "rejected" });
    }

    pub(crate) fn lookup(&self, ok: bool) {
        Self::inc(&self.lookups, if ok { "ok" } else { "error" });
    }

    pub(crate) fn report(&self, ok: bool) {
        Self::inc(&self.reports, if ok { "ok" } else { "error" });
    }
}
