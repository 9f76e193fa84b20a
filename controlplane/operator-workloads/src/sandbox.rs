//! Sandbox controller: validates a Sandbox, gives it a routing key, creates one ForkedWorkload
//! per fork (in the baseline's namespace) and one RoutingConfig for its key, reports their
//! state, and deletes the Sandbox when its TTL runs out. Deleting a Sandbox deletes everything
//! it made (explicitly, behind a finalizer, so it does not depend on the garbage collector).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use kube::{Api, Resource, ResourceExt};
use spur_api::conditions::{ConditionStatus, READY, find_condition, is_condition_true, set_now};
use spur_api::keys::labels;
use spur_api::routingconfig::{SandboxedKind, SandboxedWorkloadRef};
use spur_api::sandbox::{ForkStatus, LocalStatus, ResourceStatusSummary, VirtualStatus};
use spur_api::{
    ExternalWorkload, ForkedWorkload, RoutingConfig, Sandbox, SandboxStatus, VirtualWorkload, names,
};

use crate::context::OWNER;
use crate::context::{FIELD_MANAGER, Term, WorkloadsContext, delete_opt, now};
use crate::fork::{ForkId, plan};
use crate::{Error, FINALIZER};

mod desired;
mod lifecycle;
mod status;

// Derived in spur_api::names, since the RouteGroup and Resource controllers derive it too; its
// old path stays.
pub use spur_api::names::routing_key;

/// Condition: the sandbox's RoutingConfig routes every fork.
pub const ROUTING_READY: &str = "RoutingReady";

/// Without changes, a sandbox is looked at again this often (TTL, baselines appearing).
const RESYNC: Duration = Duration::from_secs(300);

/// How long a deleted sandbox's forks keep running past the end of their routes (the `untilMs`
/// of its spans): a fork keeps consuming until its span's end and then gets this long to catch
/// up with the records stamped before it. A fork that lags more loses its tail (docs/async.md).
pub(crate) const DRAIN_MS: i64 = 10_000;

/// How long a deleted sandbox still waits before its children go, given its routes' `end_ms`
/// (`None`: no more): until [`DRAIN_MS`] past the end.
fn drain_left(end_ms: i64, now_ms: i64) -> Option<Duration> {
    let left = end_ms.saturating_add(DRAIN_MS).saturating_sub(now_ms);
    (left > 0).then(|| Duration::from_millis(u64::try_from(left).unwrap_or(u64::MAX)))
}

pub(crate) async fn reconcile(sb: Arc<Sandbox>, ctx: Arc<Term>) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("Sandbox");
    let api: Api<Sandbox> = Api::all(ctx.client.clone());
    let action = finalizer(&api, FINALIZER, sb, |event| async {
        match event {
            Event::Apply(sb) => apply(&sb, &ctx).await,
            Event::Cleanup(sb) => cleanup(&sb, &ctx).await,
        }
    })
    .await;
    spur_controller::finalized(action)
}

async fn apply(sb: &Sandbox, ctx: &Term) -> Result<Action, Error> {
    let name = sb.name_any();
    let Some(uid) = sb.uid() else {
        // Waiting for the API server to give it one: poll quickly instead of backing off.
        return Ok(Action::requeue(Duration::from_millis(500)));
    };
    let key = sb
        .status
        .as_ref()
        .and_then(|s| s.routing_key.clone())
        .unwrap_or_else(|| routing_key(&uid));

    // TTL first: an expired sandbox is deleted whatever else is wrong with it.
    let expires_at = expiry(sb);
    if let Some(at) = expires_at
        && Timestamp::now() >= at
    {
        ctx.event(
            sb,
            false,
            "Expired",
            "Delete",
            format!("TTL expired at {at}"),
        )
        .await;
        let api: Api<Sandbox> = Api::all(ctx.client.clone());
        delete_opt(&api, &name).await?;
        return Ok(Action::await_change());
    }
    let requeue = match expires_at {
        Some(at) => {
            let left = at.duration_since(Timestamp::now());
            Duration::try_from(left).unwrap_or_default().min(RESYNC) + Duration::from_millis(100)
        }
        None => RESYNC,
    };

    let verdict = if checked(sb) {
        Ok(())
    } else {
        check(sb, &name, &key, ctx).await?
    };
    if let Err((reason, message)) = verdict {
        // All or nothing: an invalid sandbox keeps nothing it may have created before.
        delete_children(&name, ctx).await?;
        let changed = write_status(sb, ctx, |st| {
            st.routing_key = Some(key.clone());
            st.forks.clear();
            st.local.clear();
            st.virtual_workloads.clear();
            st.resources.clear();
            condition(st, sb, READY, ConditionStatus::False, reason, &message)
        })
        .await?;
        if changed {
            ctx.event(sb, true, reason, "Validate", message).await;
        }
        return Ok(Action::requeue(requeue.min(Duration::from_secs(30))));
    }

    // Resources first: forks start only once every resource is ready, so that they start
    // with its outputs (a fork without its own database would write to the baseline's).
    let Some(resource_entries) = resources(sb, &key, expires_at, ctx).await? else {
        return Ok(Action::requeue(requeue));
    };
    // Local workloads are served by the workstation's tunnel, and only while the
    // workstation's recorded owner is the Sandbox's creator (docs/local.md, "Workstation
    // owners"): a workstation that changed hands gets none of the old owner's keys.
    let binding = if sb.spec.local.is_empty() {
        Ok(())
    } else {
        let records = kube::Api::namespaced(ctx.client.clone(), &ctx.tunnels.namespace);
        spur_operator_core::workstation_owner::bindable(&records, sb).await?
    };
    let children = desired::children(sb, &key, binding.is_ok());
    let mut observed = apply_children(sb, children, ctx).await?;
    if binding.is_err() {
        observed.locals = (sb.spec.local.iter())
            .map(|l| status::unbound_local(&name, l))
            .collect();
    }
    prune_removed(sb, &observed.workloads, binding.is_err(), ctx).await?;
    let rc = desired::routing_config(sb, &key, observed.workloads);
    let rcs: Api<RoutingConfig> = Api::all(ctx.client.clone());
    let rc = OWNER.ensure(&rcs, Some(&ctx.stores.configs), rc).await?;
    let routing_ready = rc
        .status
        .as_ref()
        .is_some_and(|s| is_condition_true(&s.conditions, READY));
    write_status(sb, ctx, |st| {
        st.routing_key = Some(key.clone());
        st.resources = resource_entries;
        st.forks = observed.forks;
        st.local = observed.locals;
        st.virtual_workloads = observed.virtuals;
        st.expires_at = expires_at.map(Time);
        status::conditions(st, sb, routing_ready, &binding);
    })
    .await?;
    Ok(Action::requeue(requeue))
}

/// The sandbox's resources, ensured: their status entries once every one is ready, `None`
/// (with the reason in status) while one is not.
async fn resources(
    sb: &Sandbox,
    key: &str,
    expires_at: Option<Timestamp>,
    ctx: &Term,
) -> Result<Option<Vec<ResourceStatusSummary>>, Error> {
    if sb.spec.resources.is_empty() {
        return Ok(Some(Vec::new()));
    }
    let res = crate::resources::ensure(sb, key, &desired::owner(sb), &ctx.res).await?;
    if res.ready {
        return Ok(Some(res.entries));
    }
    let (reason, message) = status::resources_waiting(&res.entries, res.failed);
    let changed = write_status(sb, ctx, |st| {
        st.routing_key = Some(key.to_owned());
        st.resources = res.entries;
        st.expires_at = expires_at.map(Time);
        condition(st, sb, READY, ConditionStatus::False, reason, &message);
    })
    .await?;
    if changed && reason == spur_api::conditions::reasons::RESOURCE_FAILED {
        ctx.event(sb, true, reason, "CreateResources", message)
            .await;
    }
    Ok(None)
}

/// What [`apply_children`] saw: each workload's status entry and its RoutingConfig entry.
#[derive(Default)]
struct Observed {
    forks: Vec<ForkStatus>,
    locals: Vec<LocalStatus>,
    virtuals: Vec<VirtualStatus>,
    workloads: Vec<SandboxedWorkloadRef>,
}

/// Applies the sandbox's children (each in its baseline's namespace), in order.
async fn apply_children(
    sb: &Sandbox,
    children: desired::Children,
    ctx: &Term,
) -> Result<Observed, Error> {
    let name = sb.name_any();
    let mut o = Observed::default();
    for fw in children.forks {
        let ns = fw.namespace().unwrap_or_default();
        let api: Api<ForkedWorkload> = Api::namespaced(ctx.client.clone(), &ns);
        let applied = OWNER.ensure(&api, Some(&ctx.stores.forks), fw).await?;
        o.forks.push(status::fork(&applied));
        (o.workloads).push(desired::workload_ref(
            SandboxedKind::ForkedWorkload,
            &*applied,
            &name,
        ));
    }
    for ew in children.locals {
        let ns = ew.namespace().unwrap_or_default();
        let api = Api::<ExternalWorkload>::namespaced(ctx.client.clone(), &ns);
        let applied = OWNER.ensure(&api, Some(&ctx.stores.externals), ew).await?;
        o.locals.push(status::local(&applied));
        (o.workloads).push(desired::workload_ref(
            SandboxedKind::ExternalWorkload,
            &*applied,
            &name,
        ));
    }
    // A VirtualWorkload reports whether the baseline's sidecars can handle the key (nothing
    // is deployed, nothing routed).
    for vw in children.virtuals {
        let ns = vw.namespace().unwrap_or_default();
        let applied = Api::<VirtualWorkload>::namespaced(ctx.client.clone(), &ns)
            .patch(
                &vw.name_any(),
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&vw),
            )
            .await?;
        o.virtuals.push(status::virtual_workload(&applied));
        (o.workloads).push(desired::workload_ref(
            SandboxedKind::VirtualWorkload,
            &applied,
            &name,
        ));
    }
    Ok(o)
}

/// Deletes the objects of workloads removed from the spec (and the local ones of a sandbox
/// that may not bind its workstation).
async fn prune_removed(
    sb: &Sandbox,
    workloads: &[SandboxedWorkloadRef],
    unbound: bool,
    ctx: &Term,
) -> Result<(), Error> {
    let name = sb.name_any();
    let wanted: BTreeSet<(String, String)> = workloads
        .iter()
        .map(|w| (w.namespace.clone(), w.name.clone()))
        .collect();
    // Only a spec change can remove workloads; listing (label selectors are not indexed, so a
    // cluster-wide list reads every object of the kind) happens only then. Generation 1 is
    // the spec the sandbox was created with: nothing was removed from it. A pass that stopped
    // early (resources not ready) records the generation without pruning, so a status that
    // still names a workload no longer wanted means the same.
    let generation = sb.meta().generation;
    let spec_changed = generation.is_some_and(|g| g > 1)
        && sb.status.as_ref().and_then(|s| s.observed_generation) != generation;
    let stale = Stale::of(sb.status.as_ref(), &wanted);
    if spec_changed || stale.forks {
        prune::<ForkedWorkload>(ctx, &name, Some(&wanted), false).await?;
    }
    if spec_changed || stale.virtuals {
        prune::<VirtualWorkload>(ctx, &name, Some(&wanted), false).await?;
    }
    if spec_changed || unbound || stale.locals {
        prune::<ExternalWorkload>(ctx, &name, Some(&wanted), false).await?;
    }
    Ok(())
}

/// Which kinds of workload object the status names one of that is not `wanted` (by name: those
/// names are unique per sandbox and baseline): a pass that stopped early (resources not ready)
/// wrote the new generation without pruning, and its status still lists the old objects.
#[derive(Debug, Default, PartialEq, Eq)]
struct Stale {
    forks: bool,
    locals: bool,
    virtuals: bool,
}

impl Stale {
    fn of(st: Option<&SandboxStatus>, wanted: &BTreeSet<(String, String)>) -> Stale {
        let Some(st) = st else {
            return Stale::default();
        };
        let unwanted = |n: &str| !n.is_empty() && !wanted.iter().any(|(_, w)| w == n);
        Stale {
            forks: st.forks.iter().any(|f| unwanted(&f.forked_workload)),
            locals: st.local.iter().any(|l| unwanted(&l.external_workload)),
            virtuals: st
                .virtual_workloads
                .iter()
                .any(|v| unwanted(&v.virtual_workload)),
        }
    }
}

// The Ready reasons of a failed `check` (shared with `spur sandbox apply --wait`).
use spur_api::conditions::reasons::SANDBOX_CHECK_FAILURES as CHECK_FAILURES;

/// The Ready reason of a sandbox that would write in a namespace that has not opted in.
pub use spur_api::conditions::reasons::NAMESPACE_NOT_ENABLED;

/// Whether this generation of the sandbox passed [`check`] already.
///
/// The check reads every baseline (a GET and a Service LIST per fork, the costliest calls of a
/// pass, and the LIST grows with the namespace); a pass runs several times per sandbox as its
/// children progress. Once a generation passed, what later happens to a baseline is its
/// ForkedWorkload's to report (it runs the same planning on every pass), and that readiness is
/// in this status.
fn checked(sb: &Sandbox) -> bool {
    let generation = sb.meta().generation;
    sb.status.as_ref().is_some_and(|st| {
        st.observed_generation == generation
            && find_condition(&st.conditions, READY).is_some_and(|c| {
                c.observed_generation == generation && !CHECK_FAILURES.contains(&c.reason.as_str())
            })
    })
}

/// Checks what the schema cannot: the Rust validation, and that every fork can be built from
/// its baseline as it is now. `Err` carries a reason and a message for the user.
async fn check(
    sb: &Sandbox,
    name: &str,
    key: &str,
    ctx: &Term,
) -> Result<Result<(), (&'static str, String)>, Error> {
    if let Err(e) = sb.validate() {
        return Ok(Err(("Invalid", e.to_string())));
    }
    if let Err(bad) = crate::resources::check(sb, &ctx.res).await? {
        return Ok(Err(bad));
    }
    if ctx.enrollment.is_some()
        && let Some((ns, terminating)) = not_enabled(sb, ctx).await?
    {
        let message = if terminating {
            format!("namespace {ns} is being deleted: Spur makes nothing in it")
        } else {
            format!(
                "namespace {ns} has not opted in to Spur, which makes forks and local workloads only in namespaces labelled {}={} (docs/install.md, \"Namespaces Spur may write in\"): ask an administrator to label it",
                crate::enroll::ENABLED_LABEL,
                crate::enroll::ENABLED_VALUE
            )
        };
        return Ok(Err((NAMESPACE_NOT_ENABLED, message)));
    }
    for (i, fork) in sb.spec.forks.iter().enumerate() {
        let b = &fork.fork_of;
        let baseline = match ctx.baseline(b.kind, &b.namespace, &b.name).await? {
            Ok(baseline) => baseline,
            Err((reason, message)) => {
                return Ok(Err((reason, format!("forks[{i}]: {message}"))));
            }
        };
        let services = ctx.baseline_services(&b.namespace).await?;
        let fw_name = names::fork_name(name, b);
        let id = ForkId {
            name: &fw_name,
            sandbox: name,
            routing_key: key,
        };
        let planned = match crate::fork_refs::rendered(
            ctx,
            name,
            &fork.customizations,
            &b.namespace,
            &services,
        )
        .await?
        {
            Ok(c) => plan(id, &baseline, &c, &services, &ctx.fork_policy),
            Err(e) => Err(e),
        };
        if let Err(e) = planned {
            return Ok(Err((
                "InvalidCustomization",
                format!("forks[{i}] ({}/{}): {e}", b.namespace, b.name),
            )));
        }
    }
    Ok(Ok(()))
}

/// The first namespace the sandbox would write in (its forks' and local workloads') that exists
/// and has not opted in, and whether it is being deleted. Without this the operator's writes
/// there are refused by RBAC and the sandbox only ever says it is waiting. Virtual workloads
/// write nothing in their namespace (a VirtualWorkload is a custom resource the operator may
/// write anywhere), so they are not held to it. A namespace that does not exist is left to the
/// checks that name the missing workload.
async fn not_enabled(
    sb: &Sandbox,
    ctx: &WorkloadsContext,
) -> Result<Option<(String, bool)>, Error> {
    let spec = &sb.spec;
    let namespaces: BTreeSet<&str> = spec
        .forks
        .iter()
        .map(|f| f.fork_of.namespace.as_str())
        .chain(spec.local.iter().map(|l| l.from.namespace.as_str()))
        .collect();
    let api: Api<Namespace> = Api::all(ctx.client.clone());
    for ns in namespaces {
        if let Some(n) = api.get_opt(ns).await?
            && !crate::enroll::enrolled(&n)
        {
            return Ok(Some((
                ns.to_owned(),
                n.metadata.deletion_timestamp.is_some(),
            )));
        }
    }
    Ok(None)
}

fn expiry(sb: &Sandbox) -> Option<Timestamp> {
    let ttl = sb.spec.ttl.as_ref()?;
    let created = sb.meta().creation_timestamp.as_ref()?.0;
    let updated = sb
        .status
        .as_ref()
        .and_then(|s| s.updated_at.as_ref())
        .map_or(created, |t| t.0);
    ttl.expires_at(created, updated)
}

/// Condition type: every running pod of the forked baselines has a sidecar.
pub(super) const BASELINE_SIDECARS: &str = "BaselineSidecars";

pub(super) fn condition(
    st: &mut SandboxStatus,
    sb: &Sandbox,
    type_: &str,
    status: ConditionStatus,
    reason: &str,
    message: &str,
) {
    set_now(
        &mut st.conditions,
        sb.meta().generation,
        type_,
        status,
        reason,
        message,
    );
}

async fn write_status(
    sb: &Sandbox,
    ctx: &WorkloadsContext,
    update: impl FnOnce(&mut SandboxStatus),
) -> Result<bool, Error> {
    let mut old = sb.status.clone().unwrap_or_default();
    // The Tests condition is the smart-test controller's (its own field manager): this apply
    // neither carries it (so a cached, older copy never overwrites a newer result) nor counts
    // it as a change.
    old.conditions
        .retain(|c| c.type_ != spur_api::smarttest::TESTS_CONDITION);
    let mut st = old.clone();
    if st.observed_generation != sb.meta().generation {
        // `ttl.offsetFrom: updatedAt` counts from the last spec change the controller saw.
        st.updated_at = Some(now());
        st.observed_generation = sb.meta().generation;
    }
    update(&mut st);
    // Preview URLs follow from the spec alone: published whatever state the sandbox is in.
    st.endpoints = match (&ctx.previews, &sb.spec.default_route_group) {
        (Some(p), Some(g)) => p.urls(&sb.name_any(), &g.endpoints),
        _ => Vec::new(),
    };
    let api: Api<Sandbox> = Api::all(ctx.client.clone());
    let changed = ctx.status.apply(&api, sb, &old, &st).await?;
    if changed {
        for step in lifecycle::steps(&old, &st) {
            ctx.event(sb, step.warning, step.reason, step.action, step.note)
                .await;
        }
    }
    Ok(changed)
}

/// Deletes the sandbox's objects of kind `K` (by label) except those in `keep`; returns whether
/// any still exist (deletion pending behind their own finalizers).
async fn prune<K>(
    ctx: &WorkloadsContext,
    sandbox: &str,
    keep: Option<&BTreeSet<(String, String)>>,
    consistent: bool,
) -> Result<bool, Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned,
{
    let mut lp = ListParams::default().labels(&format!("{}={sandbox}", labels::SANDBOX));
    if !consistent {
        // From the watch cache: cheap, and what it may miss is pruned on a later pass.
        lp = lp.match_any();
    }
    let mut remaining = false;
    for obj in Api::<K>::all(ctx.client.clone()).list(&lp).await?.items {
        let ns = obj.namespace().unwrap_or_default();
        if keep.is_some_and(|k| k.contains(&(ns.clone(), obj.name_any()))) {
            continue;
        }
        remaining = true;
        if obj.meta().deletion_timestamp.is_none() {
            delete_opt(
                &Api::<K>::namespaced(ctx.client.clone(), &ns),
                &obj.name_any(),
            )
            .await?;
        }
    }
    Ok(remaining)
}

/// Deletes everything the sandbox made; `true` while some of it still exists. Resources go
/// last: their delete workflows run once no fork uses them any more.
async fn delete_children(name: &str, ctx: &WorkloadsContext) -> Result<bool, Error> {
    let mut remaining = prune::<ForkedWorkload>(ctx, name, None, true).await?;
    remaining |= prune::<ExternalWorkload>(ctx, name, None, true).await?;
    remaining |= prune::<VirtualWorkload>(ctx, name, None, true).await?;
    let rcs: Api<RoutingConfig> = Api::all(ctx.client.clone());
    delete_opt(&rcs, &names::sandbox_routing_config_name(name)).await?;
    if !remaining {
        remaining |= crate::resources::delete_all(name, &ctx.res).await?;
    }
    Ok(remaining)
}

/// The end of a deleted sandbox's routes, fixed once: the one already written on its
/// RoutingConfig (annotation `spur.dev/routes-end-ms`), else, if the config has any span, now
/// plus the span grace, written there (only if still absent: a patch conditional on the
/// resourceVersion read) so that every operator replica and restart uses the same. `None`:
/// nothing is routed by record, so nothing to drain.
async fn routes_end(name: &str, ctx: &WorkloadsContext) -> Result<Option<i64>, Error> {
    let rcs: Api<RoutingConfig> = Api::all(ctx.client.clone());
    let Some(rc) = rcs
        .get_opt(&names::sandbox_routing_config_name(name))
        .await?
    else {
        return Ok(None);
    };
    if let Some(end) = crate::routingconfig::routes_end_ms(rc.annotations()) {
        return Ok(Some(end));
    }
    if rc.spans().is_empty() || rc.meta().deletion_timestamp.is_some() {
        return Ok(None);
    }
    let end = Timestamp::now()
        .as_millisecond()
        .saturating_add(crate::routingconfig::SPAN_GRACE_MS);
    let patch = serde_json::json!({"metadata": {
        "resourceVersion": rc.resource_version(),
        "annotations": {(spur_api::keys::annotations::ROUTES_END_MS): end.to_string()},
    }});
    match (rcs.patch(
        &rc.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    ))
    .await
    {
        Ok(_) => Ok(Some(end)),
        // Changed since read (maybe another replica wrote the end): read it again.
        Err(kube::Error::Api(e)) if e.code == 409 => Err(Error::Pending(format!(
            "the end of Sandbox {name}'s routes to be written"
        ))),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(None),
        Err(e) => Err(e.into()),
    }
}

async fn cleanup(sb: &Sandbox, ctx: &WorkloadsContext) -> Result<Action, Error> {
    let name = sb.name_any();
    // Records stamped before the routes' end belong to the forks: they keep running until
    // the drain is over.
    if let Some(end) = routes_end(&name, ctx).await?
        && let Some(left) = drain_left(end, Timestamp::now().as_millisecond())
    {
        let end_at = Timestamp::from_millisecond(end).unwrap_or_default();
        let message = format!(
            "Deleting: keyed records stamped before {end_at} still go to the forks, which are deleted {}s later",
            DRAIN_MS / 1_000
        );
        write_status(sb, ctx, |st| {
            condition(
                st,
                sb,
                READY,
                ConditionStatus::False,
                lifecycle::DRAINING,
                &message,
            )
        })
        .await?;
        return Err(Error::Requeue {
            what: format!("the forks of Sandbox {name} to drain their records"),
            after: left,
        });
    }
    write_status(sb, ctx, |st| {
        let message = "deleting its forks, routes and resources";
        condition(
            st,
            sb,
            READY,
            ConditionStatus::False,
            lifecycle::DELETING,
            message,
        )
    })
    .await?;
    if delete_children(&name, ctx).await? {
        // Each ForkedWorkload's own finalizer removes its Deployment and Services first; each
        // Resource's runs its delete workflow (retried until it succeeds, shown here).
        if !sb.spec.resources.is_empty() {
            let entries = crate::resources::summaries(sb, &ctx.res).await?;
            let deleting = entries.iter().any(|e| e.phase == "Deleting");
            write_status(sb, ctx, |st| st.resources = entries).await?;
            if deleting {
                // Only the resources' delete workflows are left (resources are deleted once
                // the forks are gone), which may take minutes of retries: their changes wake
                // this pass, the requeue is a safety net.
                return Err(Error::Requeue {
                    what: format!("the Resources of Sandbox {name} to be deleted"),
                    after: Duration::from_secs(30),
                });
            }
        }
        return Err(Error::Pending(format!(
            "the ForkedWorkloads and Resources of Sandbox {name} to be deleted"
        )));
    }
    ctx.event(
        sb,
        false,
        "Deleted",
        "Delete",
        "its forks, routes and resources are gone".into(),
    )
    .await;
    Ok(Action::await_change())
}

pub(crate) fn error_policy(sb: Arc<Sandbox>, err: &Error, ctx: Arc<Term>) -> Action {
    // Waiting for children is expected: poll quickly instead of backing off.
    match err {
        Error::Pending(_) => return Action::requeue(Duration::from_millis(500)),
        Error::Requeue { after, .. } => return Action::requeue(*after),
        _ => {}
    }
    ctx.retry(&*sb, err)
}

#[cfg(test)]
mod drain_tests {
    use super::*;

    #[test]
    fn the_children_wait_until_the_drain_past_the_end() {
        assert_eq!(
            drain_left(10_000, 10_000),
            Some(Duration::from_millis(DRAIN_MS as u64))
        );
        assert_eq!(drain_left(10_000, 19_999), Some(Duration::from_millis(1)));
        assert_eq!(drain_left(10_000, 10_000 + DRAIN_MS), None);
        assert_eq!(drain_left(10_000, i64::MAX), None);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn failed_with(reason: &str) -> Sandbox {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "sb", "generation": 3},
            "spec": {"forks": [{"forkOf": {"kind": "Rollout", "namespace": "shop", "name": "web"}}]},
            "status": {"observedGeneration": 3, "conditions": [{
                "type": "Ready", "status": "False", "reason": reason, "message": "m",
                "observedGeneration": 3, "lastTransitionTime": "2026-11-30T00:00:00Z"}]}
        }))
        .unwrap()
    }

    #[test]
    fn a_generation_that_failed_its_check_is_checked_again() {
        // Every reason `check` and the resources' check give (resources.rs: `Unsupported` when
        // the chart turns resources off) makes the next pass check again.
        for reason in CHECK_FAILURES {
            assert!(!checked(&failed_with(reason)), "{reason}");
        }
        for reason in ["Unsupported", "InvalidBaseline", "BaselineNotFound"] {
            assert!(CHECK_FAILURES.contains(&reason), "{reason}");
        }
        // A generation waiting for its forks passed its check.
        assert!(checked(&failed_with("ForksNotReady")));
    }

    /// A pass that waited for resources wrote the new generation without pruning: the next
    /// pass still prunes, because the status names objects the spec no longer wants.
    #[test]
    fn a_status_naming_unwanted_objects_is_pruned_after_all() {
        let st: SandboxStatus = serde_json::from_value(json!({
            "observedGeneration": 2,
            "forks": [
                {"forkOf": {"kind": "Deployment", "namespace": "shop", "name": "a"}, "forkedWorkload": "sb-a-1"},
                {"forkOf": {"kind": "Deployment", "namespace": "shop", "name": "b"}, "forkedWorkload": "sb-b-2"}
            ],
            "local": [{"name": "l", "externalWorkload": "sb-l-3", "connected": false, "ready": false}],
            "virtual": [{"name": "v", "virtualWorkload": "sb-v-4", "ready": false}]
        }))
        .unwrap();
        let wanted = |names: &[&str]| -> BTreeSet<(String, String)> {
            names
                .iter()
                .map(|n| ("shop".to_owned(), (*n).to_owned()))
                .collect()
        };
        let all = wanted(&["sb-a-1", "sb-b-2", "sb-l-3", "sb-v-4"]);
        assert_eq!(Stale::of(Some(&st), &all), Stale::default());
        assert_eq!(Stale::of(None, &all), Stale::default());
        assert_eq!(
            Stale::of(Some(&st), &wanted(&["sb-a-1", "sb-l-3", "sb-v-4"])),
            Stale {
                forks: true,
                ..Stale::default()
            }
        );
        assert_eq!(
            Stale::of(Some(&st), &wanted(&["sb-a-1", "sb-b-2"])),
            Stale {
                forks: false,
                locals: true,
                virtuals: true
            }
        );
    }
}
