//! The jobs component's metrics.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabel {
    pub phase: String,
}

/// Counters and gauges of `spur jobs`.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    /// Attempts started on a runner.
    pub attempts_started: Counter,
    /// Attempts whose runner pod was lost mid-run (each is retried).
    pub attempts_lost: Counter,
    /// Jobs that reached a terminal phase, by phase.
    pub jobs_finished: Family<PhaseLabel, Counter>,
    /// Log bytes received from executors.
    pub log_bytes: Counter,
    /// Artifact bytes kept.
    pub artifact_bytes: Counter,
    /// Writes not made because their namespace's storage quota was used up, by kind (log: the
    /// rest of an attempt's output; artifact: one file).
    pub over_quota: Family<KindLabel, Counter>,
    /// Attempts being driven now.
    pub running: Gauge,
    /// Runner pods created and deleted.
    pub pods_created: Counter,
    pub pods_deleted: Counter,
    /// 1 while this replica leads (runs the controllers and drives attempts), else 0.
    pub leader: Gauge,
    /// Queue depth and age per runner group (encoded at scrape time).
    pub queues: crate::QueueGauges,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Metrics::default();
        let r = registry.sub_registry_with_prefix("spur_jobs");
        r.register(
            "attempts_started",
            "Attempts started on a runner pod",
            m.attempts_started.clone(),
        );
        r.register(
            "attempts_lost",
            "Attempts whose runner pod was lost mid-run (retried)",
            m.attempts_lost.clone(),
        );
        r.register(
            "finished",
            "Jobs that reached a terminal phase",
            m.jobs_finished.clone(),
        );
        r.register(
            "log_bytes",
            "Log bytes received from executors",
            m.log_bytes.clone(),
        );
        r.register(
            "artifact_bytes",
            "Artifact bytes kept",
            m.artifact_bytes.clone(),
        );
        r.register(
            "over_quota",
            "Writes not made because the namespace's storage quota was used up (log: the rest of an attempt's output; artifact: one file)",
            m.over_quota.clone(),
        );
        r.register(
            "running_attempts",
            "Attempts being driven now",
            m.running.clone(),
        );
        r.register(
            "pods_created",
            "Runner pods created",
            m.pods_created.clone(),
        );
        r.register(
            "pods_deleted",
            "Runner pods deleted",
            m.pods_deleted.clone(),
        );
        r.register(
            "leader",
            "1 while this replica holds the jobs lease and runs the controllers, else 0",
            m.leader.clone(),
        );
        r.register_collector(Box::new(crate::queue_metrics::QueueCollector(
            m.queues.clone(),
        )));
        m
    }

    pub(crate) fn over_quota(&self, kind: &str) {
        self.over_quota
            .get_or_create(&KindLabel { kind: kind.into() })
            .inc();
    }

    pub(crate) fn finished(&self, phase: &str) {
        self.jobs_finished
            .get_or_create(&PhaseLabel {
                phase: phase.into(),
            })
            .inc();
    }
}
