//! xDS metrics, registered under the route server's prefix with an `xds_` stem.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::render::Kind;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct TypeLabel {
    r#type: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RequestLabel {
    r#type: &'static str,
    /// `subscribe`, `ack`, `nack` or `stale`.
    kind: &'static str,
}

#[derive(Clone, Debug)]
pub(crate) struct XdsMetrics {
    pub(crate) streams: Gauge,
    requests: Family<RequestLabel, Counter>,
    responses: Family<TypeLabel, Counter>,
    nacking: Family<TypeLabel, Gauge>,
    versions: Family<TypeLabel, Gauge>,
    pub(crate) unknown_types: Counter,
    pub(crate) configs_withheld: Counter,
    pub(crate) push_latency: Histogram,
}

impl XdsMetrics {
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let m = XdsMetrics {
            streams: Gauge::default(),
            requests: Family::default(),
            responses: Family::default(),
            nacking: Family::default(),
            versions: Family::default(),
            unknown_types: Counter::default(),
            configs_withheld: Counter::default(),
            push_latency: Histogram::new(exponential_buckets(0.0001, 2.0, 18)),
        };
        registry.register("xds_streams", "Open ADS streams", m.streams.clone());
        registry.register(
            "xds_requests",
            "DiscoveryRequests by resource type and kind (subscribe, ack, nack, stale)",
            m.requests.clone(),
        );
        registry.register(
            "xds_responses",
            "DiscoveryResponses sent, by resource type",
            m.responses.clone(),
        );
        registry.register(
            "xds_nacking_streams",
            "Streams whose latest answer for the resource type rejected it",
            m.nacking.clone(),
        );
        registry.register(
            "xds_version",
            "Current version of each resource type",
            m.versions.clone(),
        );
        registry.register(
            "xds_unknown_type_requests",
            "DiscoveryRequests for resource types this server does not serve",
            m.unknown_types.clone(),
        );
        registry.register(
            "xds_envoyconfigs_withheld",
            "Streams whose node id has EnvoyConfigs only in namespaces their client certificate is not of (or that have no certificate namespace): they are served the cluster's resources",
            m.configs_withheld.clone(),
        );
        registry.register(
            "xds_push_latency_seconds",
            "Time from a change of the cluster's state to its response being queued on a stream",
            m.push_latency.clone(),
        );
        m
    }

    pub(crate) fn requests(&self, kind: Kind, what: &'static str) -> Counter {
        self.requests
            .get_or_create(&RequestLabel {
                r#type: kind.label(),
                kind: what,
            })
            .clone()
    }

    pub(crate) fn responses(&self, kind: Kind) -> Counter {
        self.responses.get_or_create(&label(kind)).clone()
    }

    pub(crate) fn nacking(&self, kind: Kind) -> Gauge {
        self.nacking.get_or_create(&label(kind)).clone()
    }

    pub(crate) fn set_version(&self, kind: Kind, version: u64) {
        self.versions
            .get_or_create(&label(kind))
            .set(i64::try_from(version).unwrap_or(i64::MAX));
    }
}

fn label(kind: Kind) -> TypeLabel {
    TypeLabel {
        r#type: kind.label(),
    }
}
