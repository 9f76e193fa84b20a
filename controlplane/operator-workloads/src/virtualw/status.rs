//! A VirtualWorkload's status from its baseline and the baseline's sidecars, as pure functions.

use k8s_openapi::api::apps::v1::Deployment;
use kube::{Resource, ResourceExt};
use spur_api::conditions::{ConditionStatus, READY, set_now};
use spur_api::{SidecarCoverage, VirtualWorkload, VirtualWorkloadStatus};

/// The Ready condition of a VirtualWorkload: its status, reason and message.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Verdict {
    pub(super) status: ConditionStatus,
    pub(super) reason: &'static str,
    pub(super) message: String,
}

impl Verdict {
    pub(super) fn not_ready(reason: &'static str, message: String) -> Self {
        Verdict {
            status: ConditionStatus::False,
            reason,
            message,
        }
    }
}

/// Refuses a baseline that cannot stand in a sandbox virtually: one outside the
/// VirtualWorkload's namespace `ns`.
pub(super) fn check(vw: &VirtualWorkload, ns: &str) -> Result<(), Verdict> {
    let spec = &vw.spec;
    if spec.baseline.namespace != ns {
        return Err(Verdict::not_ready(
            "InvalidBaseline",
            format!(
                "the baseline must be in the VirtualWorkload's namespace {ns}, not {}",
                spec.baseline.namespace
            ),
        ));
    }
    Ok(())
}

/// The status of `vw` in `ns` (its current one `old`) given its `baseline` with the sidecar
/// `coverage` of its pods, or the verdict that there is none: Ready while some baseline pod has
/// a ready sidecar to handle the sandbox's key.
pub(super) fn status(
    vw: &VirtualWorkload,
    ns: &str,
    old: &VirtualWorkloadStatus,
    baseline: Result<(&Deployment, Option<SidecarCoverage>), Verdict>,
) -> (VirtualWorkloadStatus, Verdict) {
    let name = &vw.spec.baseline.name;
    let (observed, coverage, verdict) = match baseline {
        Err(verdict) => (None, None, verdict),
        Ok((baseline, coverage)) => {
            let ready = coverage.as_ref().map_or(0, |c| c.ready);
            let verdict = if ready > 0 {
                Verdict {
                    status: ConditionStatus::True,
                    reason: "SidecarsReady",
                    message: format!(
                        "{ready} baseline pod(s) of {ns}/{name} handle this sandbox's key"
                    ),
                }
            } else {
                Verdict::not_ready(
                    "NoSidecar",
                    format!(
                        "no running pod of {ns}/{name} has a ready Spur sidecar, so nothing handles this sandbox's key there"
                    ),
                )
            };
            let observed = spur_api::workloads::BaselineObservation {
                uid: baseline.uid().unwrap_or_default(),
                generation: baseline.meta().generation,
            };
            (Some(observed), coverage, verdict)
        }
    };
    let mut st = old.clone();
    st.observed_generation = vw.meta().generation;
    st.baseline = observed;
    st.baseline_sidecars = coverage;
    set_now(
        &mut st.conditions,
        vw.meta().generation,
        READY,
        verdict.status,
        verdict.reason,
        &verdict.message,
    );
    (st, verdict)
}

/// Whether a status write (`changed`) warrants a Warning event: a VirtualWorkload that is not
/// ready and was not ready before (one that was ready reports its loss in status only).
pub(super) fn warns(changed: bool, verdict: &Verdict, old: &VirtualWorkloadStatus) -> bool {
    changed
        && verdict.status == ConditionStatus::False
        && !spur_api::conditions::is_condition_true(&old.conditions, READY)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;
    use spur_api::WorkloadKind;
    use spur_api::conditions::find_condition;

    use super::*;

    fn vw() -> VirtualWorkload {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "VirtualWorkload",
            "metadata": {"name": "sb-api", "namespace": "shop", "generation": 3},
            "spec": {"sandbox": "sb", "routingKey": "k1", "name": "api",
                     "baseline": {"kind": "Deployment", "namespace": "shop", "name": "api"}}
        }))
        .unwrap()
    }

    fn baseline() -> Deployment {
        serde_json::from_value(json!({
            "metadata": {"name": "api", "namespace": "shop", "uid": "base-uid", "generation": 4}
        }))
        .unwrap()
    }

    fn ready_condition(st: &VirtualWorkloadStatus) -> (&str, &str) {
        let c = find_condition(&st.conditions, READY).unwrap();
        (&c.status, &c.reason)
    }

    #[test]
    fn ready_while_some_baseline_pod_has_a_ready_sidecar() {
        let (vw, base) = (vw(), baseline());
        let old = VirtualWorkloadStatus::default();
        let coverage = SidecarCoverage::new(3, 2, 1);
        let (st, verdict) = status(&vw, "shop", &old, Ok((&base, Some(coverage.clone()))));
        assert_eq!(ready_condition(&st), ("True", "SidecarsReady"));
        assert_eq!(
            verdict.message,
            "1 baseline pod(s) of shop/api handle this sandbox's key"
        );
        assert_eq!(st.baseline_sidecars, Some(coverage));
        assert_eq!(st.observed_generation, Some(3));
        let seen = st.baseline.unwrap();
        assert_eq!((seen.uid.as_str(), seen.generation), ("base-uid", Some(4)));
        assert!(!warns(true, &verdict, &old));
    }

    #[test]
    fn no_ready_sidecar_or_no_selector_is_not_ready() {
        let (vw, base) = (vw(), baseline());
        let old = VirtualWorkloadStatus::default();
        for coverage in [Some(SidecarCoverage::new(2, 2, 0)), None] {
            let (st, verdict) = status(&vw, "shop", &old, Ok((&base, coverage)));
            assert_eq!(ready_condition(&st), ("False", "NoSidecar"));
            assert!(st.baseline.is_some());
            assert!(warns(true, &verdict, &old));
            assert!(!warns(false, &verdict, &old), "no change, no event");
        }
    }

    #[test]
    fn a_refused_or_missing_baseline_clears_what_was_observed() {
        let (vw, base) = (vw(), baseline());
        let (ready, _) = status(
            &vw,
            "shop",
            &VirtualWorkloadStatus::default(),
            Ok((&base, Some(SidecarCoverage::new(1, 1, 1)))),
        );
        let (st, verdict) = status(&vw, "shop", &ready, Err(not_found(&vw)));
        assert_eq!(ready_condition(&st), ("False", "BaselineNotFound"));
        assert_eq!(verdict.message, "Deployment shop/api not found");
        assert!(st.baseline.is_none() && st.baseline_sidecars.is_none());
        // It was ready: losing it is reported in status only.
        assert!(!warns(true, &verdict, &ready));
    }

    fn not_found(vw: &VirtualWorkload) -> Verdict {
        let (reason, message) = crate::baseline::not_found(vw.spec.baseline.kind, "shop", "api");
        Verdict::not_ready(reason, message)
    }

    #[test]
    fn only_baselines_in_the_own_namespace_stand_in_virtually() {
        assert_eq!(check(&vw(), "shop"), Ok(()));
        assert_eq!(check(&vw(), "other").unwrap_err().reason, "InvalidBaseline");
        let mut rollout = vw();
        rollout.spec.baseline.kind = WorkloadKind::Rollout;
        assert_eq!(check(&rollout, "shop"), Ok(()));
    }
}
