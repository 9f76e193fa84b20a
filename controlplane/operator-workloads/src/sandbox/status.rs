//! A Sandbox's status from what its children report, as pure functions.

use kube::ResourceExt;
use spur_api::conditions::{ConditionStatus, READY, find_condition, is_condition_true, reasons};
use spur_api::sandbox::{ForkStatus, Local, LocalStatus, ResourceStatusSummary, VirtualStatus};
use spur_api::{ExternalWorkload, ForkedWorkload, Sandbox, SandboxStatus, VirtualWorkload, names};

use super::{BASELINE_SIDECARS, ROUTING_READY, condition};

/// A fork's entry, from its ForkedWorkload as applied. Ready only if its Ready condition
/// describes the spec just applied: after a change, the old spec's readiness is not this one's.
pub(super) fn fork(fw: &ForkedWorkload) -> ForkStatus {
    let st = fw.status.clone().unwrap_or_default();
    let generation = fw.metadata.generation;
    ForkStatus {
        fork_of: fw.spec.baseline.clone(),
        forked_workload: fw.name_any(),
        fork: st.fork.clone(),
        services: st.services.clone(),
        ready: find_condition(&st.conditions, READY)
            .is_some_and(|c| c.status == "True" && c.observed_generation == generation),
        baseline_sidecars: st.baseline_sidecars.clone(),
    }
}

/// A local workload's entry, from its ExternalWorkload as applied.
pub(super) fn local(ew: &ExternalWorkload) -> LocalStatus {
    let st = ew.status.clone().unwrap_or_default();
    LocalStatus {
        name: ew.spec.name.clone(),
        external_workload: ew.name_any(),
        connected: st.tunnel.as_ref().is_some_and(|t| t.connected),
        ready: is_condition_true(&st.conditions, READY),
    }
}

/// A local workload's entry while the Sandbox may not bind its workstation.
pub(super) fn unbound_local(sandbox: &str, local: &Local) -> LocalStatus {
    LocalStatus {
        name: local.name.clone(),
        external_workload: names::external_workload_name(sandbox, &local.name),
        connected: false,
        ready: false,
    }
}

/// A virtual workload's entry, from its VirtualWorkload as applied.
pub(super) fn virtual_workload(vw: &VirtualWorkload) -> VirtualStatus {
    let st = vw.status.clone().unwrap_or_default();
    VirtualStatus {
        name: vw.spec.name.clone(),
        virtual_workload: vw.name_any(),
        ready: is_condition_true(&st.conditions, READY),
        baseline_sidecars: st.baseline_sidecars.clone(),
    }
}

/// Why no fork starts yet: a resource failed, or these are not ready.
pub(super) fn resources_waiting(
    entries: &[ResourceStatusSummary],
    failed: Option<String>,
) -> (&'static str, String) {
    match failed {
        Some(m) => (reasons::RESOURCE_FAILED, format!("{m}; no fork is started")),
        None => (
            "ResourcesPending",
            format!(
                "waiting for resources before starting forks: {}",
                entries
                    .iter()
                    .filter(|e| e.phase != "Ready")
                    .map(|e| format!(
                        "{} ({}{})",
                        e.name,
                        e.phase,
                        e.message
                            .as_deref()
                            .map(|m| format!(": {m}"))
                            .unwrap_or_default()
                    ))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        ),
    }
}

/// The conditions of `st` (its workloads' entries filled in): RoutingReady from the
/// RoutingConfig, BaselineSidecars from the baselines' coverage, Ready from everything, or
/// `binding`'s refusal.
pub(super) fn conditions(
    st: &mut SandboxStatus,
    sb: &Sandbox,
    routing_ready: bool,
    binding: &Result<(), String>,
) {
    let all_ready = st.forks.iter().all(|f| f.ready)
        && st.local.iter().all(|l| l.ready)
        && st.virtual_workloads.iter().all(|v| v.ready);
    let (status, reason, message) = if routing_ready {
        (
            ConditionStatus::True,
            "Routed",
            "the route server serves this sandbox's routes",
        )
    } else {
        (
            ConditionStatus::False,
            "RoutesPending",
            "waiting for the forks to become ready and their routes to be published",
        )
    };
    condition(st, sb, ROUTING_READY, status, reason, message);
    baseline_sidecars(st, sb);
    let (status, reason, message) = match binding {
        Err(refused) => (
            ConditionStatus::False,
            reasons::WORKSTATION_NOT_OWNED,
            refused.clone(),
        ),
        Ok(()) if all_ready && routing_ready => (
            ConditionStatus::True,
            "Ready",
            "every workload is ready and routed".to_string(),
        ),
        Ok(()) => (ConditionStatus::False, "NotReady", waiting_for(st)),
    };
    condition(st, sb, READY, status, reason, &message);
}

/// Baseline pods without a sidecar never see the key: say which, and why.
fn baseline_sidecars(st: &mut SandboxStatus, sb: &Sandbox) {
    if st.forks.is_empty() && st.virtual_workloads.is_empty() {
        return;
    }
    let virtual_baselines: Vec<(&str, Option<&spur_api::SidecarCoverage>)> = sb
        .spec
        .virtual_workloads
        .iter()
        .zip(&st.virtual_workloads)
        .map(|(v, s)| (v.workload.namespace.as_str(), s.baseline_sidecars.as_ref()))
        .collect();
    let without: Vec<String> = st
        .forks
        .iter()
        .map(|f| (f.fork_of.namespace.as_str(), f.baseline_sidecars.as_ref()))
        .chain(virtual_baselines)
        .flat_map(|(ns, c)| {
            c.into_iter()
                .flat_map(|c| c.without_sidecar.iter())
                .map(move |p| format!("{ns}/{} ({})", p.name, p.reason))
        })
        .collect();
    if without.is_empty() {
        condition(
            st,
            sb,
            BASELINE_SIDECARS,
            ConditionStatus::True,
            "AllInjected",
            "every running pod of the forked baselines has a sidecar",
        );
    } else {
        condition(
            st,
            sb,
            BASELINE_SIDECARS,
            ConditionStatus::False,
            "PodsWithoutSidecar",
            &format!(
                "requests with this sandbox's key that reach these baseline pods are not routed (or captured): {}",
                without.join("; ")
            ),
        );
    }
}

/// The Ready message of a sandbox not ready yet: the workloads it waits for.
fn waiting_for(st: &SandboxStatus) -> String {
    let waiting: Vec<&str> = st
        .forks
        .iter()
        .filter(|f| !f.ready)
        .map(|f| f.forked_workload.as_str())
        .chain(
            st.local
                .iter()
                .filter(|l| !l.ready)
                .map(|l| l.external_workload.as_str()),
        )
        .chain(
            st.virtual_workloads
                .iter()
                .filter(|v| !v.ready)
                .map(|v| v.virtual_workload.as_str()),
        )
        .collect();
    if waiting.is_empty() {
        "waiting for routes".to_string()
    } else {
        format!("waiting for {}", waiting.join(", "))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use spur_api::conditions::find_condition;

    use super::*;
    use crate::sandbox::desired::tests::sandbox;

    fn reason(st: &SandboxStatus, type_: &str) -> String {
        find_condition(&st.conditions, type_)
            .unwrap()
            .reason
            .clone()
    }

    fn unready_fork() -> ForkStatus {
        let sb = sandbox();
        let c = super::super::desired::children(&sb, "k1", true);
        fork(&c.forks[0])
    }

    #[test]
    fn a_fork_is_ready_only_for_the_spec_it_was_built_from() {
        let fw = |generation: i64, observed: i64| -> ForkedWorkload {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "spur.dev/v1alpha1", "kind": "ForkedWorkload",
                "metadata": {"name": "fw", "namespace": "hotrod", "generation": generation},
                "spec": {"sandbox": "s", "routingKey": "k",
                         "baseline": {"kind": "Deployment", "namespace": "hotrod", "name": "route"}},
                "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "ForkReady",
                    "message": "", "observedGeneration": observed,
                    "lastTransitionTime": "2026-12-01T00:00:00Z"}]}
            }))
            .unwrap()
        };
        assert!(fork(&fw(2, 2)).ready);
        assert!(
            !fork(&fw(3, 2)).ready,
            "a changed spec is not ready on the old one's state"
        );
    }

    #[test]
    fn ready_only_when_every_workload_is_ready_and_routed() {
        let sb = sandbox();
        let mut st = SandboxStatus {
            forks: vec![unready_fork()],
            ..SandboxStatus::default()
        };
        conditions(&mut st, &sb, true, &Ok(()));
        assert_eq!(reason(&st, READY), "NotReady");
        let msg = find_condition(&st.conditions, READY)
            .unwrap()
            .message
            .clone();
        assert_eq!(msg, format!("waiting for {}", st.forks[0].forked_workload));
        assert_eq!(reason(&st, ROUTING_READY), "Routed");

        st.forks[0].ready = true;
        conditions(&mut st, &sb, true, &Ok(()));
        assert_eq!(reason(&st, READY), "Ready");
        conditions(&mut st, &sb, false, &Ok(()));
        assert_eq!(reason(&st, READY), "NotReady");
        assert_eq!(reason(&st, ROUTING_READY), "RoutesPending");
    }

    #[test]
    fn a_refused_binding_is_the_ready_reason() {
        let sb = sandbox();
        let mut st = SandboxStatus::default();
        conditions(&mut st, &sb, true, &Err("ws1 is owned by bob".into()));
        assert_eq!(reason(&st, READY), "WorkstationNotOwned");
        // No forks and no virtual workloads: no sidecar coverage to report.
        assert!(find_condition(&st.conditions, BASELINE_SIDECARS).is_none());
    }

    #[test]
    fn resources_waiting_names_the_unready_ones_or_the_failure() {
        let entry = |name: &str, phase: &str| {
            serde_json::from_value::<ResourceStatusSummary>(serde_json::json!({
                "name": name, "phase": phase, "message": "slow"
            }))
            .unwrap()
        };
        let entries = [entry("db", "Starting"), entry("cache", "Ready")];
        assert_eq!(
            resources_waiting(&entries, None),
            (
                "ResourcesPending",
                "waiting for resources before starting forks: db (Starting: slow)".into()
            )
        );
        assert_eq!(
            resources_waiting(&entries, Some("db failed".into())).0,
            "ResourceFailed"
        );
    }
}
