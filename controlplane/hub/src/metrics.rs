//! The hub's own metrics (the tunnel library registers the sessions' and streams'): preview
//! requests by outcome, the time to a target's response head, connected clusters, their agent
//! sessions and revocations enforced. Registered into the caller's registry, which picks the prefix.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    /// The HTTP status the hub answered (its own refusal or the target's answer).
    code: u16,
}

/// Cheap to clone; every handle is an atomic.
#[derive(Clone, Debug)]
pub struct Metrics {
    previews: Family<StatusLabels, Counter>,
    upstream_seconds: Histogram,
    pub(crate) clusters_connected: Gauge,
    pub(crate) agent_sessions: Gauge,
    pub(crate) revocations: Counter,
    connections_refused: Counter,
    retries: Counter,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Metrics {
        let m = Metrics {
            previews: Family::default(),
            // 100 µs to about 26 s.
            upstream_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 19)),
            clusters_connected: Gauge::default(),
            agent_sessions: Gauge::default(),
            revocations: Counter::default(),
            connections_refused: Counter::default(),
            retries: Counter::default(),
        };
        registry.register(
            "preview_requests",
            "Preview requests by the status the hub answered",
            m.previews.clone(),
        );
        registry.register(
            "preview_upstream_seconds",
            "Time from forwarding a preview request to the target's response head",
            m.upstream_seconds.clone(),
        );
        registry.register(
            "clusters_connected",
            "Clusters with an agent session",
            m.clusters_connected.clone(),
        );
        registry.register(
            "agent_sessions",
            "Agent sessions of connected clusters (one per agent replica; fewer than the replicas a cluster runs means one is down)",
            m.agent_sessions.clone(),
        );
        registry.register(
            "revocations_enforced",
            "Agent sessions closed because their cluster was revoked or its token rotated",
            m.revocations.clone(),
        );
        registry.register(
            "connections_refused",
            "Preview and web view connections closed at accept: their peer, or the listener, held its limit",
            m.connections_refused.clone(),
        );
        registry.register(
            "preview_retries",
            "Safe, bodiless preview requests sent a second time after their pooled connection failed (an agent replica going away)",
            m.retries.clone(),
        );
        m
    }

    pub(crate) fn retried(&self) {
        self.retries.inc();
    }

    pub(crate) fn connection_refused(&self) {
        self.connections_refused.inc();
    }

    pub(crate) fn preview(&self, code: u16) {
        self.previews.get_or_create(&StatusLabels { code }).inc();
    }

    pub(crate) fn upstream(&self, seconds: f64) {
        self.upstream_seconds.observe(seconds);
    }
}
