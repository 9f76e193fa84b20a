//! ForkedWorkload controller: keeps the fork Deployment and the sandbox Services of one
//! ForkedWorkload in line with its baseline and customizations, and reports the Service mapping
//! and readiness in status.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource, ResourceExt};
use spur_api::keys::labels;
use spur_api::{ForkedWorkload, ForkedWorkloadStatus};
use spur_controller::verified::Verified;

use crate::baseline::Baseline;
use crate::context::{OWNER, Term, WorkloadsContext};
use crate::fork::{ForkPlan, deployment_ready, deployment_rolled_out};
use crate::{Error, FINALIZER};

mod desired;
mod status;

use desired::{Failure, owned_by};

/// How often a ForkedWorkload is reconciled without any change to it, its children, its
/// baseline or the Services of its namespace (all watched): a safety net, not the update path.
const RESYNC: Duration = Duration::from_secs(300);

pub(crate) async fn reconcile(fw: Arc<ForkedWorkload>, ctx: Arc<Term>) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("ForkedWorkload");
    let ns = fw.namespace().ok_or_else(|| Error::NoNamespace {
        kind: "ForkedWorkload",
        name: fw.name_any(),
    })?;
    let api: Api<ForkedWorkload> = Api::namespaced(ctx.client.clone(), &ns);
    let action = finalizer(&api, FINALIZER, fw, |event| async {
        match event {
            Event::Apply(fw) => apply(&fw, &ns, &ctx).await,
            Event::Cleanup(fw) => cleanup(&fw, &ns, &ctx).await,
        }
    })
    .await;
    spur_controller::finalized(action)
}

async fn apply(fw: &ForkedWorkload, ns: &str, ctx: &Term) -> Result<Action, Error> {
    let name = fw.name_any();
    let (baseline, plan) = match build(fw, ns, &name, ctx).await? {
        Ok(built) => built,
        Err((reason, message)) => {
            // All or nothing: a fork that cannot be built leaves no half of itself behind
            // (only what is its own: see `delete_children`).
            delete_children(fw, ns, ctx).await?;
            let changed =
                write_status(fw, ns, ctx, |st| status::failed(st, fw, reason, &message)).await?;
            if changed {
                ctx.event(fw, true, reason, "Fork", message).await;
            }
            return Ok(Action::requeue(RESYNC));
        }
    };
    let ForkPlan {
        deployment,
        services: planned,
    } = desired::owned(plan, fw);
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), ns);
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), ns);
    let stores = &ctx.stores;
    if let Some(cur) = stores.deployments.get(&ObjectRef::from_obj(&deployment))
        && owned_by(&cur.metadata, fw)
        && let Some(reset) = desired::strategy_reset(&cur, &deployment)
    {
        deployments
            .patch(&name, &PatchParams::default(), &Patch::Merge(&reset))
            .await?;
    }
    let applied = (OWNER.ensure(&deployments, Some(&stores.deployments), deployment)).await?;
    let mut wanted = BTreeSet::new();
    let mut mappings = Vec::new();
    for (svc, mapping) in planned {
        wanted.insert(svc.name_any());
        OWNER.ensure(&services, Some(&stores.services), svc).await?;
        mappings.push(mapping);
    }
    // Our Services of this fork that the plan no longer has, from the store (a Service it
    // misses is pruned on a later pass).
    let known = stores.services.state();
    for stale in desired::stale(known.iter().map(|s| &**s), fw, ns, &name, &wanted) {
        delete_owned(&services, &stale.metadata).await?;
    }
    let serving = status::Serving {
        ready: deployment_ready(&applied),
        current: deployment_rolled_out(&applied),
    };
    let sidecars = sidecar_coverage(fw, &baseline, ns, ctx).await?;
    write_status(fw, ns, ctx, |st| {
        status::observed(st, fw, ns, mappings, &baseline.workload, sidecars, serving);
    })
    .await?;
    Ok(Action::requeue(RESYNC))
}

/// The baseline and the fork's plan, or why there is none (reason, message for the user): a
/// baseline that cannot be forked, a customization that cannot be applied, or objects of the
/// fork's names that belong to something else.
async fn build(
    fw: &ForkedWorkload,
    ns: &str,
    name: &str,
    ctx: &Term,
) -> Result<Result<(Baseline, ForkPlan), Failure>, Error> {
    if let Err(failure) = desired::check(fw, ns) {
        return Ok(Err(failure));
    }
    let b = &fw.spec.baseline;
    let baseline = match ctx.baseline(b.kind, ns, &b.name).await? {
        Ok(baseline) => baseline,
        Err(failure) => return Ok(Err(failure)),
    };
    let all = ctx.baseline_services(ns).await?;
    // `valueFrom.fork` rendered into literal values first: the plan takes only literals.
    let rendered =
        crate::fork_refs::rendered(ctx, &fw.spec.sandbox, &fw.spec.customizations, ns, &all)
            .await?;
    let customizations = match rendered {
        Ok(c) => c,
        Err(message) => return Ok(Err(("InvalidCustomization", message))),
    };
    let plan =
        match desired::fork_plan(fw, name, &baseline, &customizations, &all, &ctx.fork_policy) {
            Ok(plan) => plan,
            Err(failure) => return Ok(Err(failure)),
        };
    let taken = conflicts(fw, ns, name, &plan, ctx).await?;
    Ok(match desired::name_conflict(&taken) {
        Some(failure) => Err(failure),
        None => Ok((baseline, plan)),
    })
}

/// How many running baseline pods carry a ready sidecar. `None` when the baseline has no
/// usable selector. Pods come from the watch cache; pod changes in the namespace wake the
/// ForkedWorkload (see `run`).
///
/// Pods without a sidecar are named in the coverage (the Sandbox turns them into its
/// `BaselineSidecars` condition), counted in `spur_operator_baseline_pods_without_sidecar`, and
/// each gets a Warning event when it is first seen without one.
async fn sidecar_coverage(
    fw: &ForkedWorkload,
    baseline: &Baseline,
    ns: &str,
    ctx: &Term,
) -> Result<Option<spur_api::SidecarCoverage>, Error> {
    let before = fw
        .status
        .as_ref()
        .and_then(|s| s.baseline_sidecars.as_ref());
    coverage_of(
        &fw.name_any(),
        &fw.spec.sandbox,
        before,
        &baseline.workload,
        ns,
        ctx,
        Some(&ctx.stores.pods),
    )
    .await
}

/// [`sidecar_coverage`] for any sandbox workload `owner` (its name, for the metric) of
/// `sandbox` standing in front of `baseline`, given the coverage it reported before. Pods come
/// through `cache` when there is one (listed again only when one changed): see
/// [`crate::baseline::read`] for when there is none.
pub(crate) async fn coverage_of(
    owner: &str,
    sandbox: &str,
    before: Option<&spur_api::SidecarCoverage>,
    baseline: &Deployment,
    ns: &str,
    ctx: &WorkloadsContext,
    cache: Option<&Verified<Pod>>,
) -> Result<Option<spur_api::SidecarCoverage>, Error> {
    let Some(selector) = baseline.spec.as_ref().map(|s| s.selector.clone()) else {
        return Ok(None);
    };
    let Ok(selector) = kube::core::Selector::try_from(selector) else {
        return Ok(None);
    };
    if selector.selects_all() {
        return Ok(None);
    }
    let pods = match cache {
        Some(cache) => cache.list(&ctx.client, ns, &selector).await?,
        None => {
            let lp = ListParams::default().labels_from(&selector).match_any();
            Arc::new(
                Api::<Pod>::namespaced(ctx.client.clone(), ns)
                    .list(&lp)
                    .await?
                    .items,
            )
        }
    };
    let (coverage, missing) = status::coverage(&pods);
    ctx.metrics.pods_without_sidecar(ns, owner, missing.len());
    let before: BTreeSet<&str> = before
        .map(|c| c.without_sidecar.iter().map(|p| p.name.as_str()).collect())
        .unwrap_or_default();
    for (pod, named) in missing.iter().zip(&coverage.without_sidecar) {
        if !before.contains(named.name.as_str()) {
            ctx.event(
                *pod,
                true,
                "SidecarMissing",
                "Route",
                format!(
                    "no Spur sidecar, so requests keyed for sandbox {sandbox} that reach this pod are not handled as the sandbox's: {}",
                    named.reason
                ),
            )
            .await;
        }
    }
    Ok(Some(coverage))
}

/// Applies the status computed by `update` from the current one; returns whether it changed.
async fn write_status(
    fw: &ForkedWorkload,
    ns: &str,
    ctx: &WorkloadsContext,
    update: impl FnOnce(&mut ForkedWorkloadStatus),
) -> Result<bool, Error> {
    let old = fw.status.clone().unwrap_or_default();
    let mut st = old.clone();
    st.observed_generation = fw.meta().generation;
    update(&mut st);
    let api: Api<ForkedWorkload> = Api::namespaced(ctx.client.clone(), ns);
    Ok(ctx.status.apply(&api, fw, &old, &st).await?)
}

/// The objects in the way of `plan` that this ForkedWorkload does not own ("Kind ns/name").
async fn conflicts(
    fw: &ForkedWorkload,
    ns: &str,
    name: &str,
    plan: &ForkPlan,
    ctx: &Term,
) -> Result<Vec<String>, Error> {
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), ns);
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), ns);
    // Ours in the store (of managed objects) needs no GET; anything else may be someone
    // else's object of that name, which only the API server knows.
    let ours = |meta: Option<&ObjectMeta>| meta.is_some_and(|m| owned_by(m, fw));
    let mut taken = Vec::new();
    let key = ObjectRef::<Deployment>::new(name).within(ns);
    if !ours(
        ctx.stores
            .deployments
            .get(&key)
            .as_deref()
            .map(|d| &d.metadata),
    ) && let Some(d) = deployments.get_opt(name).await?
        && !owned_by(&d.metadata, fw)
    {
        taken.push(format!("Deployment {ns}/{name}"));
    }
    for (svc, _) in &plan.services {
        let svc_name = svc.name_any();
        let key = ObjectRef::<Service>::new(&svc_name).within(ns);
        if !ours(
            ctx.stores
                .services
                .get(&key)
                .as_deref()
                .map(|s| &s.metadata),
        ) && let Some(existing) = services.get_opt(&svc_name).await?
            && !owned_by(&existing.metadata, fw)
        {
            taken.push(format!("Service {ns}/{svc_name}"));
        }
    }
    Ok(taken)
}

/// Deletes `meta`'s object only if it is still the object the check saw (uid precondition).
async fn delete_owned<K>(api: &Api<K>, meta: &ObjectMeta) -> Result<(), Error>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            uid: meta.uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::background()
    };
    match api
        .delete(&meta.name.clone().unwrap_or_default(), &dp)
        .await
    {
        Ok(_) => Ok(()),
        // Gone, or replaced by another object of the same name (the precondition failed).
        Err(kube::Error::Api(s)) if s.is_not_found() || s.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Deletes the fork Deployment and sandbox Services this ForkedWorkload owns; returns whether
/// any of them is still there. Read from the API server, not the stores: the finalizer goes
/// when this says none is left, and the Sandbox's resources are deleted only after that, so
/// a fork the stores have not seen yet must not be missed.
async fn delete_children(
    fw: &ForkedWorkload,
    ns: &str,
    ctx: &WorkloadsContext,
) -> Result<bool, Error> {
    let name = fw.name_any();
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), ns);
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), ns);
    let mut remaining = false;
    // Background propagation: the API server removes the object at once; ReplicaSets and pods
    // follow through the garbage collector.
    if let Some(d) = deployments.get_opt(&name).await?
        && owned_by(&d.metadata, fw)
    {
        delete_owned(&deployments, &d.metadata).await?;
        remaining |= deployments
            .get_opt(&name)
            .await?
            .is_some_and(|d| owned_by(&d.metadata, fw));
    }
    let lp = ListParams::default().labels(&format!("{}={name}", labels::FORK));
    for svc in services.list(&lp).await?.items {
        if owned_by(&svc.metadata, fw) {
            delete_owned(&services, &svc.metadata).await?;
        }
    }
    remaining |= services
        .list(&lp)
        .await?
        .items
        .iter()
        .any(|s| owned_by(&s.metadata, fw));
    Ok(remaining)
}

async fn cleanup(fw: &ForkedWorkload, ns: &str, ctx: &WorkloadsContext) -> Result<Action, Error> {
    ctx.metrics.forget_forked(ns, &fw.name_any());
    let name = fw.name_any();
    if delete_children(fw, ns, ctx).await? {
        return Err(Error::Pending(format!(
            "the children of ForkedWorkload {ns}/{name} to be deleted"
        )));
    }
    Ok(Action::await_change())
}

pub(crate) fn error_policy(fw: Arc<ForkedWorkload>, err: &Error, ctx: Arc<Term>) -> Action {
    // Waiting for children to go is expected: poll quickly instead of backing off.
    if matches!(err, Error::Pending(_)) {
        return Action::requeue(Duration::from_millis(500));
    }
    ctx.retry(&*fw, err)
}
