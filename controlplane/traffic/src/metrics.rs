//! The traffic store's metrics (prefix `spur_traffic`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::store::Store;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    pub method: &'static str,
    /// The gRPC code's name: `Ok`, `PermissionDenied`, ...
    pub code: String,
}

/// What the service counts; the store's own counters are registered beside them.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    pub calls: Family<CallLabels, Counter>,
    /// Pushes whose exchanges were stored.
    pub pushes: Counter,
    /// Exchanges newly stored (duplicates not counted).
    pub exchanges_stored: Counter,
    /// Exchanges sidecars reported dropping before they could push them.
    pub sidecar_dropped: Counter,
    /// Exchanges Tail readers missed because they fell behind.
    pub tail_lagged: Counter,
    /// Open Tail streams.
    pub tail_subscribers: Gauge,
    /// Open WatchSettings streams.
    pub settings_watchers: Gauge,
    /// Open streams ended because their caller's access lapsed (re-checked while open).
    pub streams_revoked: Counter,
    /// Smart-test runs capturing now.
    pub run_captures: Gauge,
}

impl Metrics {
    /// Registers the service's metrics and `store`'s (retention drops, size).
    pub fn register(registry: &mut Registry, store: &Store) -> Self {
        let m = Metrics::default();
        let r = registry.sub_registry_with_prefix("spur_traffic");
        r.register(
            "calls",
            "Calls by method and gRPC result code",
            m.calls.clone(),
        );
        r.register(
            "pushes",
            "Pushes whose exchanges were stored",
            m.pushes.clone(),
        );
        r.register(
            "exchanges_stored",
            "Exchanges stored (a re-sent one is not counted again)",
            m.exchanges_stored.clone(),
        );
        r.register(
            "sidecar_dropped",
            "Exchanges sidecars dropped before pushing them (ring full, store unreachable)",
            m.sidecar_dropped.clone(),
        );
        r.register(
            "tail_lagged",
            "Exchanges Tail readers skipped because they fell behind",
            m.tail_lagged.clone(),
        );
        r.register(
            "tail_subscribers",
            "Open Tail streams",
            m.tail_subscribers.clone(),
        );
        r.register(
            "settings_watchers",
            "Open WatchSettings streams",
            m.settings_watchers.clone(),
        );
        r.register(
            "streams_revoked",
            "Open WatchSettings and Tail streams ended because a re-check refused their caller",
            m.streams_revoked.clone(),
        );
        r.register(
            "run_captures",
            "Smart-test runs capturing now (StartRunCapture, until ended or expired)",
            m.run_captures.clone(),
        );
        let s = store.shared();
        r.register(
            "retention_dropped",
            "Exchanges removed by retention (age, count or bytes)",
            s.retention_dropped.clone(),
        );
        r.register(
            "evicted",
            "Of the exchanges removed by retention, those removed because their namespace was \
             over its quota (reason namespace_quota) or held more than its share while the store \
             was over its limits (store_limit), by namespace",
            s.evicted.clone(),
        );
        r.register(
            "store_exchanges",
            "Exchanges in the store",
            s.exchanges.clone(),
        );
        r.register(
            "store_bytes",
            "Encoded bytes of the exchanges in the store",
            s.bytes.clone(),
        );
        r.register(
            "store_max_exchanges",
            "The store's limit on exchanges kept: past it, retention removes the oldest early",
            s.max_exchanges.clone(),
        );
        r.register(
            "store_max_bytes",
            "The store's limit on encoded exchange bytes kept: past it, retention removes the oldest early",
            s.max_bytes.clone(),
        );
        m
    }

    pub(crate) fn call(&self, method: &'static str, code: tonic::Code) {
        self.calls
            .get_or_create(&CallLabels {
                method,
                code: format!("{code:?}"),
            })
            .inc();
    }
}
