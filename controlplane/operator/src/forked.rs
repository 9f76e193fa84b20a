//! ForkedWorkload controller: keeps the fork Deployment and the sandbox Services of one
//! ForkedWorkload in line with its baseline and customizations, and reports the Service mapping
//! and readiness in status.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, ListParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource, ResourceExt};
use spur_api::conditions::{ConditionStatus, NewCondition, READY, set_condition};
use spur_api::keys::labels;
use spur_api::{ForkedWorkload, ForkedWorkloadStatus, WorkloadKind};

use crate::context::{Context, Stores, Term, now};
use crate::fork::{ForkId, ForkPlan, deployment_ready, plan};
use crate::{Error, FINALIZER};

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
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), ns);
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), ns);

    let stores = Some(&ctx.stores);
    let built = match build(fw, ns, &name, &deployments, &services, &ctx.fork_policy).await? {
        Ok(built) => conflicts(fw, ns, &name, &built.1, &deployments, &services, stores)
            .await?
            .map_or(Ok(built), Err),
        Err(e) => Err(e),
    };
    let (baseline, plan) = match built {
        Ok(built) => built,
        Err((reason, message)) => {
            // All or nothing: a fork that cannot be built leaves no half of itself behind
            // (only what is its own: see `delete_children`).
            delete_children(fw, ns, ctx).await?;
            let changed = write_status(fw, ns, ctx, |st| {
                st.fork = None;
                st.services.clear();
                set_ready(st, fw, ConditionStatus::False, reason, &message)
            })
            .await?;
            if changed {
                ctx.event(fw, true, reason, "Fork", message).await;
            }
            return Ok(Action::requeue(RESYNC));
        }
    };

    let owner = fw.controller_owner_ref(&()).into_iter().collect::<Vec<_>>();
    let mut deployment = plan.deployment;
    deployment.metadata.owner_references = Some(owner.clone());
    let applied = crate::context::OWNER
        .ensure(&deployments, stores.map(|s| &s.deployments), deployment)
        .await?;

    let mut wanted = BTreeSet::new();
    let mut mappings = Vec::new();
    for (mut svc, mapping) in plan.services {
        svc.metadata.owner_references = Some(owner.clone());
        wanted.insert(svc.name_any());
        crate::context::OWNER
            .ensure(&services, stores.map(|s| &s.services), svc)
            .await?;
        mappings.push(mapping);
    }
    // Our Services of this fork that the plan no longer has: from the store (a Service it
    // misses is pruned on a later pass), or the watch cache before the controllers run.
    let ours: Vec<Service> = match stores {
        Some(s) => s
            .services
            .state()
            .iter()
            .filter(|svc| {
                svc.namespace().as_deref() == Some(ns)
                    && svc.labels().get(labels::FORK) == Some(&name)
            })
            .map(|svc| (**svc).clone())
            .collect(),
        None => {
            let lp = ListParams::default()
                .labels(&format!("{}={name}", labels::FORK))
                .match_any();
            services.list(&lp).await?.items
        }
    };
    for stale in ours {
        let n = stale.name_any();
        if !wanted.contains(&n) && owned_by(&stale.metadata, fw) {
            delete_owned(&services, &stale.metadata).await?;
        }
    }

    let ready = deployment_ready(&applied);
    let sidecars = sidecar_coverage(fw, &baseline, ns, ctx).await?;
    let baseline_obs = Some(spur_api::workloads::BaselineObservation {
        uid: baseline.uid().unwrap_or_default(),
        generation: baseline.meta().generation,
    });
    write_status(fw, ns, ctx, |st| {
        st.fork = Some(name.clone());
        st.services = mappings;
        st.baseline = baseline_obs;
        st.baseline_sidecars = sidecars;
        let (status, reason, message) = if ready {
            (
                ConditionStatus::True,
                "ForkReady",
                "the fork is ready".to_string(),
            )
        } else {
            (
                ConditionStatus::False,
                "ForkNotReady",
                format!("waiting for Deployment {ns}/{name} to become ready"),
            )
        };
        set_ready(st, fw, status, reason, &message);
    })
    .await?;
    Ok(Action::requeue(RESYNC))
}

/// The baseline and the fork's plan, or why there is none (reason, message for the user).
async fn build(
    fw: &ForkedWorkload,
    ns: &str,
    name: &str,
    deployments: &Api<Deployment>,
    services: &Api<Service>,
    policy: &crate::ForkPolicy,
) -> Result<Result<(Deployment, ForkPlan), (&'static str, String)>, Error> {
    let spec = &fw.spec;
    if spec.baseline.kind != WorkloadKind::Deployment {
        return Ok(Err((
            "Unsupported",
            format!(
                "forking a {} is not supported yet; only Deployments are",
                spec.baseline.kind
            ),
        )));
    }
    if spec.baseline.namespace != ns {
        return Ok(Err((
            "InvalidBaseline",
            format!(
                "the baseline must be in the ForkedWorkload's namespace {ns}, not {}",
                spec.baseline.namespace
            ),
        )));
    }
    let Some(baseline) = deployments.get_opt(&spec.baseline.name).await? else {
        return Ok(Err((
            "BaselineNotFound",
            format!("Deployment {ns}/{} not found", spec.baseline.name),
        )));
    };
    let all = services
        .list(&crate::fork::baseline_services())
        .await?
        .items;
    let id = ForkId {
        name,
        sandbox: &spec.sandbox,
        routing_key: &spec.routing_key,
    };
    Ok(
        match plan(id, &baseline, &spec.customizations, &all, policy) {
            Ok(p) => Ok((baseline, p)),
            Err(e) => Err(("InvalidCustomization", e)),
        },
    )
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
    baseline: &Deployment,
    ns: &str,
    ctx: &Context,
) -> Result<Option<spur_api::SidecarCoverage>, Error> {
    let before = fw
        .status
        .as_ref()
        .and_then(|s| s.baseline_sidecars.as_ref());
    coverage_of(&fw.name_any(), &fw.spec.sandbox, before, baseline, ns, ctx).await
}

/// [`sidecar_coverage`] for any sandbox workload `owner` (its name, for the metric) of
/// `sandbox` standing in front of `baseline`, given the coverage it reported before.
pub(crate) async fn coverage_of(
    owner: &str,
    sandbox: &str,
    before: Option<&spur_api::SidecarCoverage>,
    baseline: &Deployment,
    ns: &str,
    ctx: &Context,
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
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let lp = ListParams::default().labels_from(&selector).match_any();
    let (mut total, mut injected, mut ready) = (0u32, 0u32, 0u32);
    let mut missing = Vec::new();
    for pod in pods.list(&lp).await?.items {
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        // Fork pods never match a baseline selector (the fork drops those labels); skip any
        // that would rather than count a fork as a baseline pod.
        if pod.metadata.deletion_timestamp.is_some()
            || matches!(phase, Some("Succeeded" | "Failed"))
            || pod.labels().contains_key(labels::FORK)
        {
            continue;
        }
        total += 1;
        let (has, is_ready) = sidecar_state(&pod);
        injected += u32::from(has);
        ready += u32::from(is_ready);
        if !has {
            missing.push(pod);
        }
    }
    missing.sort_by_key(ResourceExt::name_any);
    ctx.metrics.pods_without_sidecar(ns, owner, missing.len());
    let before: BTreeSet<String> = before
        .map(|c| c.without_sidecar.iter().map(|p| p.name.clone()).collect())
        .unwrap_or_default();
    let mut coverage = spur_api::SidecarCoverage::new(total, injected, ready);
    for pod in missing.iter().take(spur_api::SidecarCoverage::MAX_NAMED) {
        let name = pod.name_any();
        let reason = why_no_sidecar(pod);
        if !before.contains(&name) {
            ctx.event(
                pod,
                true,
                "SidecarMissing",
                "Route",
                format!(
                    "no Spur sidecar, so requests keyed for sandbox {sandbox} that reach this pod are not handled as the sandbox's: {reason}"
                ),
            )
            .await;
        }
        coverage
            .without_sidecar
            .push(spur_api::workloads::PodWithoutSidecar { name, reason });
    }
    Ok(Some(coverage))
}

/// Why a pod has no sidecar, from what the webhook wrote on it (or did not).
fn why_no_sidecar(pod: &Pod) -> String {
    use spur_api::keys::injection as keys;
    let annotations = pod.annotations();
    match (
        annotations.get(keys::STATUS).map(String::as_str),
        annotations.get(keys::INJECT).map(String::as_str),
    ) {
        (Some("skipped"), _) => format!(
            "not injected: {}",
            annotations
                .get(keys::REASON)
                .map_or("no reason recorded", String::as_str)
        ),
        (Some("injected"), _) => "injected, but the sidecar container is gone".into(),
        (_, Some("false")) => format!("opted out ({}=false)", keys::INJECT),
        (_, Some("true")) => "opted in, but created without passing the injection webhook (unreachable or failing then; failurePolicy Ignore): restart it once injection works".into(),
        _ => format!(
            "not opted in (annotation {0}=\"true\" or namespace label {0}=true), or created while the injection webhook was unreachable",
            keys::INJECT
        ),
    }
}

/// Whether the pod has the injected sidecar, and whether the kubelet reports it ready (a native
/// sidecar's status is among the init container statuses).
fn sidecar_state(pod: &Pod) -> (bool, bool) {
    const NAME: &str = spur_api::keys::injection::SIDECAR_CONTAINER;
    let Some(spec) = &pod.spec else {
        return (false, false);
    };
    let has = spec.containers.iter().any(|c| c.name == NAME)
        || spec
            .init_containers
            .as_deref()
            .unwrap_or_default()
            .iter()
            .any(|c| c.name == NAME);
    let ready = pod.status.as_ref().is_some_and(|st| {
        st.init_container_statuses
            .iter()
            .flatten()
            .chain(st.container_statuses.iter().flatten())
            .any(|c| c.name == NAME && c.ready)
    });
    (has, has && ready)
}

fn set_ready(
    st: &mut ForkedWorkloadStatus,
    fw: &ForkedWorkload,
    status: ConditionStatus,
    reason: &str,
    message: &str,
) {
    set_condition(
        &mut st.conditions,
        NewCondition {
            type_: READY,
            status,
            reason,
            message,
            observed_generation: fw.meta().generation,
        },
        &now(),
    );
}

/// Applies the status computed by `update` from the current one; returns whether it changed.
async fn write_status(
    fw: &ForkedWorkload,
    ns: &str,
    ctx: &Context,
    update: impl FnOnce(&mut ForkedWorkloadStatus),
) -> Result<bool, Error> {
    let old = fw.status.clone().unwrap_or_default();
    let mut st = old.clone();
    st.observed_generation = fw.meta().generation;
    update(&mut st);
    let api: Api<ForkedWorkload> = Api::namespaced(ctx.client.clone(), ns);
    Ok(ctx.status.apply(&api, fw, &old, &st).await?)
}

/// Whether `meta` is an object this ForkedWorkload controls (its controller owner reference,
/// by uid). The operator writes and deletes only such objects: a Deployment or Service that
/// merely has the fork's name or label is someone else's.
fn owned_by(meta: &ObjectMeta, fw: &ForkedWorkload) -> bool {
    let Some(uid) = fw.metadata.uid.as_deref() else {
        return false;
    };
    meta.owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && o.uid == uid)
}

/// Objects in the way of `plan` that this ForkedWorkload does not own: the reason and message
/// of the condition that reports them, or `None` when the way is clear.
async fn conflicts(
    fw: &ForkedWorkload,
    ns: &str,
    name: &str,
    plan: &ForkPlan,
    deployments: &Api<Deployment>,
    services: &Api<Service>,
    stores: Option<&Stores>,
) -> Result<Option<(&'static str, String)>, Error> {
    // Ours in the store (of managed objects) needs no GET; anything else may be someone
    // else's object of that name, which only the API server knows.
    let ours = |meta: Option<&ObjectMeta>| meta.is_some_and(|m| owned_by(m, fw));
    let mut taken = Vec::new();
    let key = ObjectRef::<Deployment>::new(name).within(ns);
    if !ours(
        stores
            .and_then(|s| s.deployments.get(&key))
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
            stores
                .and_then(|s| s.services.get(&key))
                .as_deref()
                .map(|s| &s.metadata),
        ) && let Some(existing) = services.get_opt(&svc_name).await?
            && !owned_by(&existing.metadata, fw)
        {
            taken.push(format!("Service {ns}/{svc_name}"));
        }
    }
    Ok((!taken.is_empty()).then(|| {
        (
            "NameConflict",
            format!(
                "{} already exist(s) and belong(s) to something else; the fork leaves them alone (rename the ForkedWorkload or remove them)",
                taken.join(", ")
            ),
        )
    }))
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
/// any of them is still there.
async fn delete_children(fw: &ForkedWorkload, ns: &str, ctx: &Context) -> Result<bool, Error> {
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

async fn cleanup(fw: &ForkedWorkload, ns: &str, ctx: &Context) -> Result<Action, Error> {
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
