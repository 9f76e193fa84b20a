//! VirtualWorkload controller: a virtual workload stands for its baseline inside a sandbox
//! without a workload of its own. Nothing is deployed and no route is published: requests with
//! the sandbox's key keep reaching the baseline, whose sidecars handle them as the sandbox's
//! (traffic capture, docs/traffic.md). Status reports whether the baseline exists and which of
//! its pods carry a sidecar, with `Ready` as a fork's.

use std::sync::Arc;
use std::time::Duration;

use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};
use spur_api::VirtualWorkload;

use crate::Error;
use crate::context::WorkloadsContext;

mod status;

/// A safety net: baseline Deployments and pods wake the controller (see `run`).
const RESYNC: Duration = Duration::from_secs(300);

pub(crate) async fn reconcile(
    vw: Arc<VirtualWorkload>,
    ctx: Arc<WorkloadsContext>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("VirtualWorkload");
    let ns = vw.namespace().ok_or_else(|| Error::NoNamespace {
        kind: "VirtualWorkload",
        name: vw.name_any(),
    })?;
    let spec = &vw.spec;
    let baseline = match status::check(&vw, &ns) {
        Err(verdict) => Err(verdict),
        // Read directly, not through the term's stores: this controller's own watches wake it,
        // and those stores may not have seen yet what woke it.
        Ok(()) => crate::baseline::read(
            &ctx.client,
            None,
            spec.baseline.kind,
            &ns,
            &spec.baseline.name,
        )
        .await?
        .map_err(|(reason, message)| status::Verdict::not_ready(reason, message)),
    };
    let old = vw.status.clone().unwrap_or_default();
    let (st, verdict) = match baseline {
        Err(verdict) => status::status(&vw, &ns, &old, Err(verdict)),
        Ok(baseline) => {
            let before = old.baseline_sidecars.as_ref();
            let coverage = crate::forked::coverage_of(
                &vw.name_any(),
                &spec.sandbox,
                before,
                &baseline.workload,
                &ns,
                ctx.as_ref(),
                None,
            )
            .await?;
            status::status(&vw, &ns, &old, Ok((&baseline.workload, coverage)))
        }
    };
    let api: Api<VirtualWorkload> = Api::namespaced(ctx.client.clone(), &ns);
    let changed = ctx.status.apply(&api, vw.as_ref(), &old, &st).await?;
    if status::warns(changed, &verdict, &old) {
        ctx.event(
            vw.as_ref(),
            true,
            verdict.reason,
            "Reconcile",
            verdict.message,
        )
        .await;
    }
    Ok(Action::requeue(RESYNC))
}

pub(crate) fn error_policy(
    vw: Arc<VirtualWorkload>,
    err: &Error,
    ctx: Arc<WorkloadsContext>,
) -> Action {
    ctx.retry(&*vw, err)
}
