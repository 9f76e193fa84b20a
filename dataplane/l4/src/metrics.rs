//! L4 metrics, registered once into the caller's registry under the prefix `l4`. Per-listener
//! and per-endpoint handles are resolved when a listener starts or an endpoint appears, so the
//! data path only touches atomics.
//!
//! Directions: `in` is what clients send (datagrams, bytes), `out` is what goes back to them.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerLabels {
    listener: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    listener: String,
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    listener: String,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointLabels {
    cluster: String,
    endpoint: String,
}

/// All families: `l4_datagrams_total{listener,direction}`, `l4_bytes_total{listener,direction}`,
/// `l4_datagrams_dropped_total{listener,reason}`, `l4_sessions_active{listener}`,
/// `l4_sessions_created_total`, `l4_sessions_evicted_total`, `l4_sessions_expired_total`,
/// `l4_sessions_rerouted_total{listener}`, `l4_sessions_refused_total{listener,reason}`,
/// `l4_icmp_errors_total{listener}`, `l4_endpoint_healthy{cluster,endpoint}`,
/// `l4_health_check_failures_total`, `l4_upstream_connect_failures_total`,
/// `l4_endpoint_ejections_total{cluster,endpoint}`.
#[derive(Clone, Debug)]
pub(crate) struct Metrics {
    datagrams: Family<DirectionLabels, Counter>,
    bytes: Family<DirectionLabels, Counter>,
    dropped: Family<ReasonLabels, Counter>,
    active: Family<ListenerLabels, Gauge>,
    created: Family<ListenerLabels, Counter>,
    evicted: Family<ListenerLabels, Counter>,
    expired: Family<ListenerLabels, Counter>,
    rerouted: Family<ListenerLabels, Counter>,
    refused: Family<ReasonLabels, Counter>,
    icmp: Family<ListenerLabels, Counter>,
    healthy: Family<EndpointLabels, Gauge>,
    health_failures: Family<EndpointLabels, Counter>,
    connect_failures: Family<EndpointLabels, Counter>,
    ejections: Family<EndpointLabels, Counter>,
}

/// One listener's handles.
#[derive(Clone, Debug)]
pub(crate) struct ListenerMetrics {
    pub(crate) datagrams_in: Counter,
    pub(crate) datagrams_out: Counter,
    pub(crate) bytes_in: Counter,
    pub(crate) bytes_out: Counter,
    /// Client datagram not forwarded: the upstream socket's buffer was full or it failed.
    pub(crate) dropped_upstream: Counter,
    /// Reply not forwarded: the listener socket's buffer was full or it failed.
    pub(crate) dropped_client: Counter,
    pub(crate) active: Gauge,
    pub(crate) created: Counter,
    pub(crate) evicted: Counter,
    pub(crate) expired: Counter,
    pub(crate) rerouted: Counter,
    pub(crate) refused_full: Counter,
    pub(crate) refused_draining: Counter,
    pub(crate) refused_no_endpoint: Counter,
    /// TCP: every endpoint tried refused or timed out.
    pub(crate) refused_connect: Counter,
    /// UDP: no upstream socket could be opened (file descriptors exhausted…).
    pub(crate) refused_socket: Counter,
    pub(crate) icmp_errors: Counter,
}

/// One endpoint's handles.
#[derive(Clone, Debug, Default)]
pub(crate) struct EndpointMetrics {
    pub(crate) healthy: Gauge,
    pub(crate) health_failures: Counter,
    pub(crate) connect_failures: Counter,
    pub(crate) ejections: Counter,
}

impl Metrics {
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let r = registry.sub_registry_with_prefix("l4");
        let m = Metrics {
            datagrams: Family::default(),
            bytes: Family::default(),
            dropped: Family::default(),
            active: Family::default(),
            created: Family::default(),
            evicted: Family::default(),
            expired: Family::default(),
            rerouted: Family::default(),
            refused: Family::default(),
            icmp: Family::default(),
            healthy: Family::default(),
            health_failures: Family::default(),
            connect_failures: Family::default(),
            ejections: Family::default(),
        };
        r.register(
            "datagrams",
            "UDP datagrams from clients (in) and back to them (out)",
            m.datagrams.clone(),
        );
        r.register(
            "bytes",
            "Payload bytes from clients (in) and back to them (out), TCP and UDP",
            m.bytes.clone(),
        );
        r.register(
            "datagrams_dropped",
            "UDP datagrams not forwarded, by the side whose socket could not take them",
            m.dropped.clone(),
        );
        r.register(
            "sessions_active",
            "Open UDP sessions and TCP streams",
            m.active.clone(),
        );
        r.register(
            "sessions_created",
            "UDP sessions and TCP streams opened",
            m.created.clone(),
        );
        r.register(
            "sessions_evicted",
            "UDP sessions evicted (least recently active first) to make room in a full table",
            m.evicted.clone(),
        );
        r.register(
            "sessions_expired",
            "UDP sessions closed after their idle timeout",
            m.expired.clone(),
        );
        r.register(
            "sessions_rerouted",
            "UDP sessions moved to another endpoint because theirs left rotation",
            m.rerouted.clone(),
        );
        r.register(
            "sessions_refused",
            "New sessions refused: table full, draining, no endpoint, connect failed, no socket",
            m.refused.clone(),
        );
        r.register(
            "icmp_errors",
            "ICMP errors (port or host unreachable) reported on upstream UDP sockets",
            m.icmp.clone(),
        );
        r.register(
            "endpoint_healthy",
            "1 while the endpoint passes its active health checks (or has none)",
            m.healthy.clone(),
        );
        r.register(
            "health_check_failures",
            "Failed active health checks",
            m.health_failures.clone(),
        );
        r.register(
            "upstream_connect_failures",
            "Failed or timed-out TCP connects to the endpoint",
            m.connect_failures.clone(),
        );
        r.register(
            "endpoint_ejections",
            "Times the endpoint was ejected for consecutive connect failures",
            m.ejections.clone(),
        );
        m
    }

    pub(crate) fn listener(&self, name: &str) -> ListenerMetrics {
        let l = || ListenerLabels {
            listener: name.to_string(),
        };
        let dir = |direction| DirectionLabels {
            listener: name.to_string(),
            direction,
        };
        let reason = |reason| ReasonLabels {
            listener: name.to_string(),
            reason,
        };
        // One statement per handle: a `get_or_create` guard lives until the end of its
        // statement, and two on the same family in one expression deadlock.
        let datagrams_in = self.datagrams.get_or_create(&dir("in")).clone();
        let datagrams_out = self.datagrams.get_or_create(&dir("out")).clone();
        let bytes_in = self.bytes.get_or_create(&dir("in")).clone();
        let bytes_out = self.bytes.get_or_create(&dir("out")).clone();
        let dropped_upstream = self.dropped.get_or_create(&reason("upstream")).clone();
        let dropped_client = self.dropped.get_or_create(&reason("client")).clone();
        let refused_full = self.refused.get_or_create(&reason("full")).clone();
        let refused_draining = self.refused.get_or_create(&reason("draining")).clone();
        let refused_no_endpoint = self.refused.get_or_create(&reason("no_endpoint")).clone();
        let refused_connect = self
            .refused
            .get_or_create(&reason("connect_failed"))
            .clone();
        let refused_socket = self.refused.get_or_create(&reason("socket")).clone();
        let active = self.active.get_or_create(&l()).clone();
        let created = self.created.get_or_create(&l()).clone();
        let evicted = self.evicted.get_or_create(&l()).clone();
        let expired = self.expired.get_or_create(&l()).clone();
        let rerouted = self.rerouted.get_or_create(&l()).clone();
        let icmp_errors = self.icmp.get_or_create(&l()).clone();
        ListenerMetrics {
            datagrams_in,
            datagrams_out,
            bytes_in,
            bytes_out,
            dropped_upstream,
            dropped_client,
            active,
            created,
            evicted,
            expired,
            rerouted,
            refused_full,
            refused_draining,
            refused_no_endpoint,
            refused_connect,
            refused_socket,
            icmp_errors,
        }
    }

    pub(crate) fn endpoint(&self, cluster: &str, endpoint: &str) -> EndpointMetrics {
        let labels = EndpointLabels {
            cluster: cluster.to_string(),
            endpoint: endpoint.to_string(),
        };
        let healthy = self.healthy.get_or_create(&labels).clone();
        let health_failures = self.health_failures.get_or_create(&labels).clone();
        let connect_failures = self.connect_failures.get_or_create(&labels).clone();
        let ejections = self.ejections.get_or_create(&labels).clone();
        EndpointMetrics {
            healthy,
            health_failures,
            connect_failures,
            ejections,
        }
    }

    /// Drops an endpoint's series once it left its cluster: pod names churn, and a series per
    /// pod that ever existed would grow without bound.
    pub(crate) fn remove_endpoint(&self, cluster: &str, endpoint: &str) {
        let labels = EndpointLabels {
            cluster: cluster.to_string(),
            endpoint: endpoint.to_string(),
        };
        self.healthy.remove(&labels);
        self.health_failures.remove(&labels);
        self.connect_failures.remove(&labels);
        self.ejections.remove(&labels);
    }
}
