//! Route-server metrics (registered under the caller's prefix, `spur_routeserver` in the binary).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Resource {
    resource: &'static str,
}

#[derive(Clone, Debug)]
pub struct Metrics {
    pub(crate) watchers: Gauge,
    pub(crate) history_watchers: Gauge,
    pub(crate) rules: Gauge,
    pub(crate) version: Gauge,
    pub(crate) pushes: Counter,
    pub(crate) push_latency: Histogram,
    pub(crate) file_errors: Counter,
    files_valid: Gauge,
    files_invalid: Gauge,
    problems: Gauge,
    refused: Counter,
    watch_errors: Family<Resource, Counter>,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Metrics {
            watchers: Gauge::default(),
            history_watchers: Gauge::default(),
            rules: Gauge::default(),
            version: Gauge::default(),
            pushes: Counter::default(),
            push_latency: Histogram::new(exponential_buckets(0.0001, 2.0, 18)),
            file_errors: Counter::default(),
            files_valid: Gauge::default(),
            files_invalid: Gauge::default(),
            problems: Gauge::default(),
            refused: Counter::default(),
            watch_errors: Family::default(),
        };
        registry.register(
            "watchers",
            "Open watch streams (gRPC and REST)",
            m.watchers.clone(),
        );
        registry.register(
            "history_watchers",
            "Open route-history streams (Kafka relays)",
            m.history_watchers.clone(),
        );
        registry.register("rules", "Routing rules in the index", m.rules.clone());
        registry.register(
            "table_version",
            "Version of the index (0: nothing loaded yet)",
            m.version.clone(),
        );
        registry.register(
            "pushes",
            "Index updates delivered to watch streams",
            m.pushes.clone(),
        );
        registry.register(
            "push_latency_seconds",
            "Time from an index update to a watch stream having computed all its operations for it",
            m.push_latency.clone(),
        );
        registry.register(
            "rule_file_errors",
            "Rule files found unreadable or invalid",
            m.file_errors.clone(),
        );
        registry.register(
            "rule_files_valid",
            "Rule files whose current content is valid",
            m.files_valid.clone(),
        );
        registry.register(
            "rule_files_invalid",
            "Rule files ignored because their content is invalid",
            m.files_invalid.clone(),
        );
        registry.register(
            "store_problems",
            "Problems the rule store reports (invalid files or rules, conflicts); listed in /healthz",
            m.problems.clone(),
        );
        registry.register(
            "requests_refused",
            "Requests refused for want of a valid token or of the right to read what they asked",
            m.refused.clone(),
        );
        registry.register(
            "watch_errors",
            "Kubernetes watches that failed and are being retried, by resource (the last view stays in force)",
            m.watch_errors.clone(),
        );
        m
    }

    /// The resource's error series at 0 from the start of its watch: `increase()` over a
    /// series that first appears at 1 sees no increase, so an alert would miss the first error.
    #[cfg(feature = "kubernetes")]
    pub(crate) fn watching(&self, resource: &'static str) {
        drop(self.watch_errors.get_or_create(&Resource { resource }));
    }

    #[cfg(feature = "kubernetes")]
    pub(crate) fn watch_failed(&self, resource: &'static str) {
        self.watch_errors
            .get_or_create(&Resource { resource })
            .inc();
    }

    pub(crate) fn refused(&self) {
        self.refused.inc();
    }

    pub(crate) fn set_problems(&self, n: usize) {
        self.problems.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub(crate) fn set_files(&self, valid: usize, invalid: usize) {
        self.files_valid
            .set(i64::try_from(valid).unwrap_or(i64::MAX));
        self.files_invalid
            .set(i64::try_from(invalid).unwrap_or(i64::MAX));
    }

    pub(crate) fn set_index(&self, version: u64, rules: usize) {
        self.version.set(i64::try_from(version).unwrap_or(i64::MAX));
        self.rules.set(i64::try_from(rules).unwrap_or(i64::MAX));
    }
}
