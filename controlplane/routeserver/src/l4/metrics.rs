//! Metrics of the L4 listener API, registered under the route server's prefix
//! (`spur_routeserver_l4_*`).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;

#[derive(Clone, Debug)]
pub(crate) struct L4Metrics {
    /// Open gateway Watch streams.
    pub(crate) streams: Gauge,
    /// Configurations sent on Watch streams.
    pub(crate) updates: Counter,
    /// Listeners left out of a sent configuration because an older set serves their port.
    pub(crate) shadowed: Counter,
    reports: Family<Labels, Counter>,
    writes: Family<Labels, Counter>,
    /// Reports saying the gateway refused its last configuration.
    pub(crate) config_errors: Counter,
    /// ListenerSets (or parts) the model leaves out.
    pub(crate) set_problems: Gauge,
}

impl L4Metrics {
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let m = L4Metrics {
            streams: Gauge::default(),
            updates: Counter::default(),
            shadowed: Counter::default(),
            reports: Family::default(),
            writes: Family::default(),
            config_errors: Counter::default(),
            set_problems: Gauge::default(),
        };
        registry.register(
            "l4_streams",
            "Open L4 listener Watch streams (one per gateway pod connection)",
            m.streams.clone(),
        );
        registry.register(
            "l4_updates",
            "L4 configurations sent to gateways (only on change)",
            m.updates.clone(),
        );
        registry.register(
            "l4_listeners_shadowed",
            "Listeners left out of a gateway's configuration because an older ListenerSet serves their protocol and port",
            m.shadowed.clone(),
        );
        registry.register(
            "l4_reports",
            "Gateway health reports by result (ok, refused, no_watch, invalid, error)",
            m.reports.clone(),
        );
        registry.register(
            "l4_status_writes",
            "ListenerSet status.gateways writes by result (ok, error)",
            m.writes.clone(),
        );
        registry.register(
            "l4_gateway_config_errors",
            "Gateway reports saying the gateway refused the configuration it was sent",
            m.config_errors.clone(),
        );
        registry.register(
            "l4_set_problems",
            "ListenerSets, or parts of them, that are not served (see /healthz and the log)",
            m.set_problems.clone(),
        );
        m
    }

    pub(crate) fn report(&self, result: &str) {
        self.reports
            .get_or_create(&vec![("result".into(), result.into())])
            .inc();
    }

    pub(crate) fn write(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.writes
            .get_or_create(&vec![("result".into(), result.into())])
            .inc();
    }
}
