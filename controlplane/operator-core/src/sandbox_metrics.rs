//! Sandbox readiness, computed at each scrape from the Sandbox controller's store: how many
//! sandboxes are ready, converging, failed or being deleted, and how long the longest-converging
//! one has been at it (what an alert on "a fork is not Ready past a deadline" needs; an age
//! grows between reconciles, so it cannot be a gauge set by them).

use std::sync::{Arc, RwLock};

use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::Store;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use spur_api::Sandbox;
use spur_api::conditions::{READY, find_condition, reasons};

/// The store the collector reads, set when the Sandbox controller starts and cleared when the
/// lease is lost (only the leader runs it: a standby replica exports no sandbox series).
#[derive(Clone, Debug, Default)]
pub struct SandboxStore(Arc<RwLock<Option<Store<Sandbox>>>>);

impl SandboxStore {
    pub fn set(&self, store: Store<Sandbox>) {
        if let Ok(mut s) = self.0.write() {
            *s = Some(store);
        }
    }

    pub(crate) fn clear(&self) {
        if let Ok(mut s) = self.0.write() {
            *s = None;
        }
    }

    fn snapshot(&self) -> Option<Vec<Arc<Sandbox>>> {
        self.0.read().ok()?.as_ref().map(Store::state)
    }
}

/// How the sandboxes stand at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Readiness {
    pub ready: u64,
    /// Not ready for a reason waiting may end (forks starting, resources running, ...).
    pub converging: u64,
    /// Not ready for a reason waiting does not end (an invalid spec, a failed resource, ...).
    pub failed: u64,
    /// Not ready only because a local workload's workstation is not connected (its forks are
    /// ready): a developer's laptop asleep, not something for the platform team.
    pub workstation: u64,
    pub deleting: u64,
    /// Seconds the longest-converging sandbox has been not ready (0 with none converging).
    pub oldest_converging_seconds: i64,
}

/// Counts `sandboxes` at `now`. A converging sandbox's clock starts when its Ready condition
/// last turned not-True, or at its creation while it has no Ready condition yet.
pub fn readiness<'a>(
    sandboxes: impl IntoIterator<Item = &'a Sandbox>,
    now: Timestamp,
) -> Readiness {
    let mut r = Readiness::default();
    for sb in sandboxes {
        if sb.metadata.deletion_timestamp.is_some() {
            r.deleting += 1;
            continue;
        }
        let ready = sb
            .status
            .as_ref()
            .and_then(|s| find_condition(&s.conditions, READY));
        match ready {
            Some(c) if c.status == "True" => r.ready += 1,
            Some(c) if reasons::sandbox_failed(&c.reason) => r.failed += 1,
            _ if waits_on_workstation(sb) => r.workstation += 1,
            _ => {
                r.converging += 1;
                let since = ready
                    .map(|c| c.last_transition_time.0)
                    .or_else(|| sb.metadata.creation_timestamp.as_ref().map(|t| t.0));
                if let Some(since) = since {
                    let age = now.as_second().saturating_sub(since.as_second()).max(0);
                    r.oldest_converging_seconds = r.oldest_converging_seconds.max(age);
                }
            }
        }
    }
    r
}

/// Whether every fork is ready and a local workload is not (its workstation is away).
fn waits_on_workstation(sb: &Sandbox) -> bool {
    sb.status
        .as_ref()
        .is_some_and(|st| st.local.iter().any(|l| !l.ready) && st.forks.iter().all(|f| f.ready))
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct State {
    state: &'static str,
}

/// The collector registered under the operator's prefix.
#[derive(Debug)]
pub(crate) struct SandboxCollector(pub(crate) SandboxStore);

impl Collector for SandboxCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let Some(sandboxes) = self.0.snapshot() else {
            return Ok(());
        };
        let r = readiness(sandboxes.iter().map(|s| &**s), Timestamp::now());
        let counts = ConstGauge::new(0i64);
        let mut family = encoder.encode_descriptor(
            "sandboxes",
            "Sandboxes by state (ready, converging, failed: not ready for a reason waiting does not end, workstation: only a local workload's workstation is away, deleting); the leader's view",
            None,
            counts.metric_type(),
        )?;
        for (state, n) in [
            ("ready", r.ready),
            ("converging", r.converging),
            ("failed", r.failed),
            ("workstation", r.workstation),
            ("deleting", r.deleting),
        ] {
            let g = ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX));
            g.encode(family.encode_family(&State { state })?)?;
        }
        let oldest = ConstGauge::new(r.oldest_converging_seconds);
        oldest.encode(encoder.encode_descriptor(
            "sandbox_oldest_converging_seconds",
            "How long the longest-converging sandbox has been not ready, in seconds (0: none converging)",
            None,
            oldest.metric_type(),
        )?)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

    fn sandbox(created: i64, ready: Option<(&str, &str, i64)>, deleting: bool) -> Sandbox {
        let mut sb: Sandbox = serde_json::from_value(serde_json::json!({
            "apiVersion": "spur.dev/v1alpha1",
            "kind": "Sandbox",
            "metadata": {"name": "s"},
            "spec": {"forks": []},
        }))
        .unwrap();
        let at = |s: i64| Time(Timestamp::from_second(s).unwrap());
        sb.metadata.creation_timestamp = Some(at(created));
        if deleting {
            sb.metadata.deletion_timestamp = Some(at(created + 1));
        }
        if let Some((status, reason, since)) = ready {
            sb.status = Some(spur_api::sandbox::SandboxStatus {
                conditions: vec![Condition {
                    type_: READY.into(),
                    status: status.into(),
                    reason: reason.into(),
                    message: String::new(),
                    last_transition_time: at(since),
                    observed_generation: None,
                }],
                ..Default::default()
            });
        }
        sb
    }

    /// Not ready since long ago only because its workstation is away.
    fn away() -> Sandbox {
        let mut sb = sandbox(10, Some(("False", "NotReady", 20)), false);
        let st = sb.status.as_mut().unwrap();
        st.local = vec![
            serde_json::from_value(
                serde_json::json!({"name": "api", "externalWorkload": "ew", "ready": false}),
            )
            .unwrap(),
        ];
        sb
    }

    #[test]
    fn counts_each_state_and_times_the_oldest_converging() {
        let now = Timestamp::from_second(10_000).unwrap();
        let all = [
            sandbox(100, Some(("True", "Ready", 200)), false),
            // Created at 9 000, no status yet: converging for 1 000 s.
            sandbox(9_000, None, false),
            // Ready went False at 9 500 (a spec change): converging for 500 s, though old.
            sandbox(50, Some(("False", reasons::FORK_NOT_READY, 9_500)), false),
            sandbox(50, Some(("False", reasons::INVALID, 60)), false),
            sandbox(50, Some(("False", reasons::FORK_NOT_READY, 60)), true),
            away(),
        ];
        assert_eq!(
            readiness(&all, now),
            Readiness {
                ready: 1,
                converging: 2,
                failed: 1,
                workstation: 1,
                deleting: 1,
                oldest_converging_seconds: 1_000,
            }
        );
        assert_eq!(readiness([], now), Readiness::default());
    }

    #[test]
    fn exports_nothing_before_the_controller_starts_and_every_state_after() {
        use prometheus_client::registry::Registry;
        let store = SandboxStore::default();
        let mut registry = Registry::with_prefix("spur_operator");
        registry.register_collector(Box::new(SandboxCollector(store.clone())));
        let text = |r: &Registry| {
            let mut s = String::new();
            prometheus_client::encoding::text::encode(&mut s, r).unwrap();
            s
        };
        assert!(!text(&registry).contains("sandboxes"));

        let (reader, mut writer) = kube::runtime::reflector::store::<Sandbox>();
        writer.apply_watcher_event(&kube::runtime::watcher::Event::InitDone);
        store.set(reader);
        let out = text(&registry);
        for line in [
            "spur_operator_sandboxes{state=\"ready\"} 0",
            "spur_operator_sandboxes{state=\"converging\"} 0",
            "spur_operator_sandboxes{state=\"failed\"} 0",
            "spur_operator_sandboxes{state=\"workstation\"} 0",
            "spur_operator_sandboxes{state=\"deleting\"} 0",
            "spur_operator_sandbox_oldest_converging_seconds 0",
        ] {
            assert!(out.contains(line), "{line} missing from\n{out}");
        }
        // The lease lost: nothing until the controller starts again.
        store.clear();
        assert!(!text(&registry).contains("sandboxes"));
    }
}
