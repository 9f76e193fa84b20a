//! VirtualWorkload controller: a virtual workload stands for its baseline inside a sandbox
//! without a workload of its own. Nothing is deployed and no route is published: requests with
//! the sandbox's key keep reaching the baseline, whose sidecars handle them as the sandbox's
//! (traffic capture, docs/traffic.md). Status reports whether the baseline exists and which of
//! its pods carry a sidecar, with `Ready` as a fork's.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};
use spur_api::conditions::{ConditionStatus, NewCondition, READY, set_condition};
use spur_api::{VirtualWorkload, VirtualWorkloadStatus, WorkloadKind};

use crate::Error;
use crate::context::{Context, now};

/// A safety net: baseline Deployments and pods wake the controller (see `run`).
const RESYNC: Duration = Duration::from_secs(300);

pub(crate) async fn reconcile(
    vw: Arc<VirtualWorkload>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("VirtualWorkload");
    let ns = vw.namespace().ok_or_else(|| Error::NoNamespace {
        kind: "VirtualWorkload",
        name: vw.name_any(),
    })?;
    let spec = &vw.spec;
    let baseline = if spec.baseline.kind != WorkloadKind::Deployment {
        Err((
            "Unsupported",
            format!(
                "a virtual workload of a {} is not supported yet; only Deployments are",
                spec.baseline.kind
            ),
        ))
    } else if spec.baseline.namespace != ns {
        Err((
            "InvalidBaseline",
            format!(
                "the baseline must be in the VirtualWorkload's namespace {ns}, not {}",
                spec.baseline.namespace
            ),
        ))
    } else {
        Api::<Deployment>::namespaced(ctx.client.clone(), &ns)
            .get_opt(&spec.baseline.name)
            .await?
            .ok_or_else(|| {
                (
                    "BaselineNotFound",
                    format!("Deployment {ns}/{} not found", spec.baseline.name),
                )
            })
    };
    let (observed, coverage, status, reason, message) = match baseline {
        Err((reason, message)) => (None, None, ConditionStatus::False, reason, message),
        Ok(baseline) => {
            let before = vw
                .status
                .as_ref()
                .and_then(|s| s.baseline_sidecars.as_ref());
            let coverage = crate::forked::coverage_of(
                &vw.name_any(),
                &spec.sandbox,
                before,
                &baseline,
                &ns,
                ctx.as_ref(),
            )
            .await?;
            let ready = coverage.as_ref().map_or(0, |c| c.ready);
            let (status, reason, message) = if ready > 0 {
                (
                    ConditionStatus::True,
                    "SidecarsReady",
                    format!(
                        "{ready} baseline pod(s) of {ns}/{} handle this sandbox's key",
                        spec.baseline.name
                    ),
                )
            } else {
                (
                    ConditionStatus::False,
                    "NoSidecar",
                    format!(
                        "no running pod of {ns}/{} has a ready Spur sidecar, so nothing handles this sandbox's key there",
                        spec.baseline.name
                    ),
                )
            };
            let observed = spur_api::workloads::BaselineObservation {
                uid: baseline.uid().unwrap_or_default(),
                generation: baseline.meta().generation,
            };
            (Some(observed), coverage, status, reason, message)
        }
    };
    let old = vw.status.clone().unwrap_or_default();
    let mut st = old.clone();
    st.observed_generation = vw.meta().generation;
    st.baseline = observed;
    st.baseline_sidecars = coverage;
    set_condition(
        &mut st.conditions,
        NewCondition {
            type_: READY,
            status,
            reason,
            message: &message,
            observed_generation: vw.meta().generation,
        },
        &now(),
    );
    let api: Api<VirtualWorkload> = Api::namespaced(ctx.client.clone(), &ns);
    let changed = ctx.status.apply(&api, vw.as_ref(), &old, &st).await?;
    if changed && status == ConditionStatus::False && !ready_before(&old) {
        ctx.event(vw.as_ref(), true, reason, "Reconcile", message)
            .await;
    }
    Ok(Action::requeue(RESYNC))
}

fn ready_before(st: &VirtualWorkloadStatus) -> bool {
    spur_api::conditions::is_condition_true(&st.conditions, READY)
}

pub(crate) fn error_policy(vw: Arc<VirtualWorkload>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.retry(&*vw, err)
}
