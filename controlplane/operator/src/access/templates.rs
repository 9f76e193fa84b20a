//! Template controllers: each template's validity and target, in its status (docs/access.md,
//! "Conditions").

use std::sync::Arc;

use k8s_openapi::api::core::v1::PodSpec;
use kube::Resource;
use kube::api::Api;
use kube::runtime::controller::Action;
use spur_api::access::{
    AccessTemplateStatus, ExecAccessTemplate, PodAccessTemplate, TargetRef, TunnelAccessTemplate,
    conditions as cond,
};
use spur_api::conditions::{NewCondition, READY, set_condition};

use super::targets::workload;
use super::{TEMPLATE_RESYNC, namespace_of};
use crate::Error;
use crate::context::{Context, now};

pub(crate) async fn reconcile_exec_template(
    t: Arc<ExecAccessTemplate>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("ExecAccessTemplate");
    let ns = namespace_of(&*t, "ExecAccessTemplate")?;
    let valid = t.spec.validate().map_err(|e| e.to_string());
    let target = check_target(&ctx, &ns, Some(&t.spec.target_ref)).await?;
    let status = template_status(t.status.as_ref(), t.metadata.generation, valid, target);
    let api: Api<ExecAccessTemplate> = Api::namespaced(ctx.client.clone(), &ns);
    ctx.status
        .apply(&api, &*t, &t.status.clone().unwrap_or_default(), &status)
        .await?;
    Ok(Action::requeue(TEMPLATE_RESYNC))
}

pub(crate) async fn reconcile_pod_template(
    t: Arc<PodAccessTemplate>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("PodAccessTemplate");
    let ns = namespace_of(&*t, "PodAccessTemplate")?;
    let mut valid = t.spec.validate().map_err(|e| e.to_string());
    if valid.is_ok()
        && let Some(spec) = &t.spec.pod_spec
        && let Err(e) = serde_json::from_value::<PodSpec>(spec.clone())
    {
        valid = Err(format!("spec.podSpec: {e}"));
    }
    let target = check_target(&ctx, &ns, t.spec.target_ref.as_ref()).await?;
    let status = template_status(t.status.as_ref(), t.metadata.generation, valid, target);
    let api: Api<PodAccessTemplate> = Api::namespaced(ctx.client.clone(), &ns);
    ctx.status
        .apply(&api, &*t, &t.status.clone().unwrap_or_default(), &status)
        .await?;
    Ok(Action::requeue(TEMPLATE_RESYNC))
}

pub(crate) fn template_error_policy<K>(t: Arc<K>, err: &Error, ctx: Arc<Context>) -> Action
where
    K: Resource<DynamicType = ()>,
{
    ctx.retry(&*t, err)
}

/// `Ok(None)`: no target to check (a pod-spec template); `Ok(Some(Err))`: why the target is
/// unusable.
async fn check_target(
    ctx: &Context,
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

fn template_status(
    old: Option<&AccessTemplateStatus>,
    generation: Option<i64>,
    valid: Result<(), String>,
    target: Option<Result<(), String>>,
) -> AccessTemplateStatus {
    let mut status = old.cloned().unwrap_or_default();
    let t = now();
    let mut set = |type_, ok: bool, reason: &str, message: &str| {
        set_condition(
            &mut status.conditions,
            NewCondition {
                type_,
                status: ok.into(),
                reason,
                message,
                observed_generation: generation,
            },
            &t,
        );
    };
    match &valid {
        Ok(()) => set(cond::TEMPLATE_DURATIONS_VALID, true, "Valid", ""),
        Err(e) => set(cond::TEMPLATE_DURATIONS_VALID, false, "Invalid", e),
    }
    match &target {
        None => set(
            cond::TARGET_REF_EXISTS,
            true,
            "NoTarget",
            "the template names no workload",
        ),
        Some(Ok(())) => set(cond::TARGET_REF_EXISTS, true, "Found", ""),
        Some(Err(e)) => set(cond::TARGET_REF_EXISTS, false, "NotFound", e),
    }
    let ready = valid.is_ok() && target.as_ref().is_none_or(Result::is_ok);
    let message = match (&valid, &target) {
        (Err(e), _) | (_, Some(Err(e))) => e.as_str(),
        _ => "",
    };
    set(
        READY,
        ready,
        if ready { "Ready" } else { "NotReady" },
        message,
    );
    status.ready = ready;
    status.observed_generation = generation;
    status
}

pub(crate) async fn reconcile_tunnel_template(
    t: Arc<TunnelAccessTemplate>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("TunnelAccessTemplate");
    let ns = namespace_of(&*t, "TunnelAccessTemplate")?;
    let valid = t.spec.validate().map_err(|e| e.to_string());
    let status = template_status(t.status.as_ref(), t.metadata.generation, valid, None);
    let api: Api<TunnelAccessTemplate> = Api::namespaced(ctx.client.clone(), &ns);
    ctx.status
        .apply(&api, &*t, &t.status.clone().unwrap_or_default(), &status)
        .await?;
    Ok(Action::requeue(TEMPLATE_RESYNC))
}
