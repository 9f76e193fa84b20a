//! Template controllers: each template's validity and target, in its status (docs/access.md,
//! "Conditions").

use std::sync::Arc;

use kube::Resource;
use kube::api::Api;
use kube::runtime::controller::Action;
use spur_api::access::{ExecAccessTemplate, PodAccessTemplate, TargetRef, TunnelAccessTemplate};

use super::targets::workload;
use super::{TEMPLATE_RESYNC, namespace_of, status};
use crate::AccessContext;
use spur_operator_core::Error;

pub(crate) async fn reconcile_exec_template(
    t: Arc<ExecAccessTemplate>,
    ctx: Arc<AccessContext>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("ExecAccessTemplate");
    let ns = namespace_of(&*t, "ExecAccessTemplate")?;
    let valid = t.spec.validate().map_err(|e| e.to_string());
    let target = check_target(&ctx, &ns, Some(&t.spec.target_ref)).await?;
    let status = status::template(t.status.as_ref(), t.metadata.generation, valid, target);
    let api: Api<ExecAccessTemplate> = Api::namespaced(ctx.client.clone(), &ns);
    ctx.status
        .apply(&api, &*t, &t.status.clone().unwrap_or_default(), &status)
        .await?;
    Ok(Action::requeue(TEMPLATE_RESYNC))
}

pub(crate) async fn reconcile_pod_template(
    t: Arc<PodAccessTemplate>,
    ctx: Arc<AccessContext>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("PodAccessTemplate");
    let ns = namespace_of(&*t, "PodAccessTemplate")?;
    let valid = status::pod_template_valid(&t.spec);
    let target = check_target(&ctx, &ns, t.spec.target_ref.as_ref()).await?;
    let status = status::template(t.status.as_ref(), t.metadata.generation, valid, target);
    let api: Api<PodAccessTemplate> = Api::namespaced(ctx.client.clone(), &ns);
    ctx.status
        .apply(&api, &*t, &t.status.clone().unwrap_or_default(), &status)
        .await?;
    Ok(Action::requeue(TEMPLATE_RESYNC))
}

pub(crate) fn template_error_policy<K>(t: Arc<K>, err: &Error, ctx: Arc<AccessContext>) -> Action
where
    K: Resource<DynamicType = ()>,
{
    ctx.retry(&*t, err)
}

/// `Ok(None)`: no target to check (a pod-spec template); `Ok(Some(Err))`: why the target is
/// unusable.
async fn check_target(
    ctx: &AccessContext,
    ns: &str,
    target: Option<&TargetRef>,
) -> Result<Option<Result<(), String>>, Error> {
    let Some(target) = target else {
        return Ok(None);
    };
    Ok(Some(
        workload(ctx, ns, target.kind, &target.name)
            .await?
            .map(|_| ()),
    ))
}

pub(crate) async fn reconcile_tunnel_template(
    t: Arc<TunnelAccessTemplate>,
    ctx: Arc<AccessContext>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("TunnelAccessTemplate");
    let ns = namespace_of(&*t, "TunnelAccessTemplate")?;
    let valid = t.spec.validate().map_err(|e| e.to_string());
    let status = status::template(t.status.as_ref(), t.metadata.generation, valid, None);
    let api: Api<TunnelAccessTemplate> = Api::namespaced(ctx.client.clone(), &ns);
    ctx.status
        .apply(&api, &*t, &t.status.clone().unwrap_or_default(), &status)
        .await?;
    Ok(Action::requeue(TEMPLATE_RESYNC))
}
