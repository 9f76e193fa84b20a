//! Queue depth and age per runner group, recorded by each group pass and encoded at scrape
//! time: the age grows between passes, so it is computed then, from when the oldest waiting job
//! entered the queue. A group not passed over for [`STALE`] (deleted, or this replica no
//! longer leads) drops out instead of exporting a frozen queue.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;

/// Four group passes: a live group is passed over at least every 30 s.
pub(crate) const STALE: Duration = Duration::from_secs(120);

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
struct Group {
    namespace: String,
    runner_group: String,
}

#[derive(Clone, Copy, Debug)]
struct Queue {
    waiting: usize,
    oldest_since: Option<i64>,
    seen: Instant,
}

/// Shared between the group passes (writers) and the registry's collector (reader).
#[derive(Clone, Debug, Default)]
pub struct QueueGauges(Arc<Mutex<HashMap<Group, Queue>>>);

impl QueueGauges {
    /// Records a pass over `namespace/group`: `waiting` jobs left in its queue, the oldest of
    /// them queued since `oldest_since` (Unix seconds).
    pub fn observe(&self, namespace: &str, group: &str, waiting: usize, oldest_since: Option<i64>) {
        let key = Group {
            namespace: namespace.into(),
            runner_group: group.into(),
        };
        if let Ok(mut m) = self.0.lock() {
            m.insert(
                key,
                Queue {
                    waiting,
                    oldest_since,
                    seen: Instant::now(),
                },
            );
        }
    }

    /// Forgets every group (this replica stopped leading: another one's passes count now).
    pub fn clear(&self) {
        if let Ok(mut m) = self.0.lock() {
            m.clear();
        }
    }

    /// (group, waiting, age in seconds) of every group passed over within [`STALE`] of
    /// `at`, sorted; expired groups are forgotten.
    fn current(&self, at: Instant, now_unix: i64) -> Vec<(Group, usize, i64)> {
        let Ok(mut m) = self.0.lock() else {
            return Vec::new();
        };
        m.retain(|_, q| at.saturating_duration_since(q.seen) < STALE);
        let mut out: Vec<_> = m
            .iter()
            .map(|(g, q)| {
                let age = q
                    .oldest_since
                    .map_or(0, |s| now_unix.saturating_sub(s).max(0));
                (g.clone(), q.waiting, age)
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

#[derive(Debug)]
pub(crate) struct QueueCollector(pub(crate) QueueGauges);

impl Collector for QueueCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let now = k8s_openapi::jiff::Timestamp::now().as_second();
        let groups = self.0.current(Instant::now(), now);
        let kind = ConstGauge::new(0i64).metric_type();
        let mut waiting = encoder.encode_descriptor(
            "queued",
            "Jobs waiting in a runner group's queue for a pod, as of the group's last pass",
            None,
            kind,
        )?;
        for (g, n, _) in &groups {
            ConstGauge::new(i64::try_from(*n).unwrap_or(i64::MAX))
                .encode(waiting.encode_family(g)?)?;
        }
        let mut age = encoder.encode_descriptor(
            "oldest_queued_seconds",
            "How long the longest-waiting job of a runner group has been queued, in seconds (0: none waiting)",
            None,
            kind,
        )?;
        for (g, _, secs) in &groups {
            ConstGauge::new(*secs).encode(age.encode_family(g)?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn ages_are_taken_at_scrape_time_and_gone_groups_expire() {
        let q = QueueGauges::default();
        q.observe("b", "g", 2, Some(1_000));
        q.observe("a", "g", 0, None);
        let at = Instant::now();
        let now = q.current(at, 1_090);
        assert_eq!(now.len(), 2);
        assert_eq!(
            (now[0].0.namespace.as_str(), now[0].1, now[0].2),
            ("a", 0, 0)
        );
        assert_eq!(
            (now[1].0.namespace.as_str(), now[1].1, now[1].2),
            ("b", 2, 90)
        );
        // Later scrapes see the age grow without another pass.
        assert_eq!(q.current(at, 1_100)[1].2, 100);
        // Not passed over for STALE: gone.
        assert!(q.current(at + STALE, 1_200).is_empty());
    }

    #[test]
    fn encodes_under_the_jobs_prefix() {
        let q = QueueGauges::default();
        let mut registry = prometheus_client::registry::Registry::default();
        registry
            .sub_registry_with_prefix("spur_jobs")
            .register_collector(Box::new(QueueCollector(q.clone())));
        q.observe("team-a", "ci", 3, Some(0));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        assert!(
            out.contains("spur_jobs_queued{namespace=\"team-a\",runner_group=\"ci\"} 3"),
            "{out}"
        );
        assert!(
            out.contains("# TYPE spur_jobs_oldest_queued_seconds gauge"),
            "{out}"
        );
    }
}
