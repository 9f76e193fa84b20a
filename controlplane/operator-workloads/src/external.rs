//! ExternalWorkload controller: a baseline whose keyed traffic goes to a process on a
//! workstation. For every Service selecting the baseline it keeps a selector-less sandbox
//! Service with the mapped ports, and an EndpointSlice pointing at the tunnel-proxy replica that
//! carries the workstation's reverse tunnel (as its Lease says, `spur_api::tunnel`). Status
//! reports the tunnel's health; the RoutingConfig controller routes the sandbox's key to the
//! sandbox Services only while the tunnel is up.
//!
//! Tunnel Leases that have not been renewed for the configured time are deleted (garbage
//! collection of dead workstation sessions).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Resource, ResourceExt};
use spur_api::keys::labels;
use spur_api::tunnel::{self, Session};
use spur_api::{ExternalWorkload, ExternalWorkloadStatus, ServiceMapping};

use spur_controller::changes::synced;
use spur_controller::objects_where;

use crate::context::{FIELD_MANAGER, Term, WorkloadsContext, delete_opt};
use crate::{Error, FINALIZER};

/// Condition: the workstation's tunnel is up.
pub const TUNNEL_CONNECTED: &str = "TunnelConnected";
const RESYNC: Duration = Duration::from_secs(300);

/// Where tunnel Leases live and when dead ones go.
#[derive(Debug, Clone)]
pub struct TunnelConfig {
    /// The tunnel proxy's namespace (the chart's release namespace).
    pub namespace: String,
    /// A tunnel not renewed for this long is garbage-collected (its Lease deleted).
    pub gc_after: Duration,
}

impl Default for TunnelConfig {
    fn default() -> Self {
        TunnelConfig {
            namespace: "spur-system".into(),
            gc_after: Duration::from_secs(600),
        }
    }
}

mod desired;
mod status;

pub use desired::{Plan, plan};

pub(crate) async fn reconcile(ew: Arc<ExternalWorkload>, ctx: Arc<Term>) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("ExternalWorkload");
    let ns = ew.namespace().ok_or_else(|| Error::NoNamespace {
        kind: "ExternalWorkload",
        name: ew.name_any(),
    })?;
    let api: Api<ExternalWorkload> = Api::namespaced(ctx.client.clone(), &ns);
    let action = finalizer(&api, FINALIZER, ew, |event| async {
        match event {
            Event::Apply(ew) => apply(&ew, &ns, &ctx).await,
            Event::Cleanup(ew) => cleanup(&ew, &ns, &ctx).await,
        }
    })
    .await;
    spur_controller::finalized(action)
}

async fn apply(ew: &ExternalWorkload, ns: &str, ctx: &Term) -> Result<Action, Error> {
    let b = &ew.spec.baseline;
    // Read directly, not through the term's stores: this controller's own watches wake it,
    // and those stores may not have seen yet what woke it.
    let baseline = match crate::baseline::read(&ctx.client, None, b.kind, ns, &b.name).await? {
        Ok(baseline) => baseline,
        Err((reason, message)) => {
            delete_children(&ew.name_any(), ns, ctx).await?;
            write_status(ew, ns, ctx, |st| status::failed(st, ew, reason, &message)).await?;
            return Ok(Action::requeue(RESYNC));
        }
    };
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), ns);
    let lp = ListParams::default()
        .labels_from(&crate::fork::baseline_services())
        .match_any();
    let all = services.list(&lp).await?.items;
    let session = session(ew, ctx).await?;
    let now_s = spur_serving::pki::now_unix();
    let mut plan = plan(ew, &baseline, &all, session.as_ref(), now_s);
    // The objects go to the apply; the status needs only the tunnel's part of the plan.
    let mappings = apply_children(ew, ns, ctx, std::mem::take(&mut plan.services)).await?;
    write_status(ew, ns, ctx, |st| {
        status::observed(
            st,
            ew,
            &baseline.workload,
            mappings,
            session.as_ref(),
            &plan,
        );
    })
    .await?;
    Ok(Action::requeue(status::next_check(
        session.as_ref(),
        plan.connected,
        now_s,
    )))
}

/// The workstation's tunnel session, from its Lease in the store (none when it has no Lease,
/// or one that cannot be read).
async fn session(ew: &ExternalWorkload, ctx: &Term) -> Result<Option<Session>, Error> {
    // A Lease missing from a store still filling would read as a tunnel that went away.
    synced(&ctx.stores.leases, "tunnel Leases").await?;
    let key =
        ObjectRef::new(&tunnel::lease_name(&ew.spec.workstation)).within(&ctx.tunnels.namespace);
    let Some(lease) = ctx.stores.leases.get(&key) else {
        return Ok(None);
    };
    Ok(match Session::from_lease(&lease) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(workstation = %ew.spec.workstation, error = %e, "unreadable tunnel Lease");
            None
        }
    })
}

/// Applies the planned sandbox Services and EndpointSlices (owned by `ew`), prunes the ones no
/// longer planned, and returns the Service mappings.
async fn apply_children(
    ew: &ExternalWorkload,
    ns: &str,
    ctx: &Term,
    planned: Vec<(Service, ServiceMapping, EndpointSlice)>,
) -> Result<Vec<ServiceMapping>, Error> {
    let owner = ew.controller_owner_ref(&()).into_iter().collect::<Vec<_>>();
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), ns);
    let slices: Api<EndpointSlice> = Api::namespaced(ctx.client.clone(), ns);
    let mut wanted = BTreeSet::new();
    let mut mappings = Vec::new();
    for (mut svc, mapping, mut slice) in planned {
        let svc_name = svc.name_any();
        svc.metadata.owner_references = Some(owner.clone());
        slice.metadata.owner_references = Some(owner.clone());
        services.patch(&svc_name, &pp, &Patch::Apply(&svc)).await?;
        let mut body = serde_json::to_value(&slice)?;
        body["apiVersion"] = "discovery.k8s.io/v1".into();
        body["kind"] = "EndpointSlice".into();
        slices.patch(&svc_name, &pp, &Patch::Apply(&body)).await?;
        wanted.insert(svc_name);
        mappings.push(mapping);
    }
    prune(&ew.name_any(), ns, ctx, &wanted).await?;
    Ok(mappings)
}

/// The names of the objects in `store` that belong to ExternalWorkload `ns/name` (by label).
fn children<K>(store: &Store<K>, ns: &str, name: &str) -> Vec<String>
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    let label = |o: &K| {
        o.labels()
            .get(labels::EXTERNAL_WORKLOAD)
            .map(String::as_str)
            == Some(name)
    };
    objects_where(store, |o| o.namespace().as_deref() == Some(ns) && label(o))
        .into_iter()
        .map(|r| r.name)
        .collect()
}

/// Deletes the ExternalWorkload's Services and EndpointSlices (from the stores of the
/// operator's own) that are not `wanted`. One created by a pass the store has not seen yet is
/// pruned by the pass its creation wakes.
async fn prune(name: &str, ns: &str, ctx: &Term, wanted: &BTreeSet<String>) -> Result<(), Error> {
    synced(&ctx.stores.services, "Services").await?;
    synced(&ctx.stores.external_slices, "EndpointSlices").await?;
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), ns);
    for n in children(&ctx.stores.services, ns, name) {
        if !wanted.contains(&n) {
            delete_opt(&services, &n).await?;
        }
    }
    let slices: Api<EndpointSlice> = Api::namespaced(ctx.client.clone(), ns);
    for n in children(&ctx.stores.external_slices, ns, name) {
        if !wanted.contains(&n) {
            delete_opt(&slices, &n).await?;
        }
    }
    Ok(())
}

/// Deletes every Service and EndpointSlice of the ExternalWorkload; returns whether some remain.
/// Read from the API server, not the stores: the finalizer goes when this says none is left.
async fn delete_children(name: &str, ns: &str, ctx: &WorkloadsContext) -> Result<bool, Error> {
    let lp = ListParams::default().labels(&format!("{}={name}", labels::EXTERNAL_WORKLOAD));
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), ns);
    let slices: Api<EndpointSlice> = Api::namespaced(ctx.client.clone(), ns);
    for s in services.list(&lp).await?.items {
        delete_opt(&services, &s.name_any()).await?;
    }
    for s in slices.list(&lp).await?.items {
        delete_opt(&slices, &s.name_any()).await?;
    }
    Ok(!services.list(&lp).await?.items.is_empty() || !slices.list(&lp).await?.items.is_empty())
}

async fn cleanup(ew: &ExternalWorkload, ns: &str, ctx: &Term) -> Result<Action, Error> {
    if delete_children(&ew.name_any(), ns, ctx).await? {
        return Err(Error::Pending(format!(
            "the children of ExternalWorkload {ns}/{} to be deleted",
            ew.name_any()
        )));
    }
    Ok(Action::await_change())
}

async fn write_status(
    ew: &ExternalWorkload,
    ns: &str,
    ctx: &WorkloadsContext,
    update: impl FnOnce(&mut ExternalWorkloadStatus),
) -> Result<bool, Error> {
    let old = ew.status.clone().unwrap_or_default();
    let mut st = old.clone();
    st.observed_generation = ew.meta().generation;
    update(&mut st);
    let api: Api<ExternalWorkload> = Api::namespaced(ctx.client.clone(), ns);
    Ok(ctx.status.apply(&api, ew, &old, &st).await?)
}

pub(crate) fn error_policy(ew: Arc<ExternalWorkload>, err: &Error, ctx: Arc<Term>) -> Action {
    if matches!(err, Error::Pending(_)) {
        return Action::requeue(Duration::from_millis(500));
    }
    ctx.retry(&*ew, err)
}

/// Deletes tunnel Leases not renewed for `gc_after`, every so often, until `stop`.
pub async fn collect_dead_tunnels(
    ctx: Arc<WorkloadsContext>,
    stop: tokio_util::sync::CancellationToken,
) {
    let cfg = ctx.tunnels.clone();
    let leases: Api<Lease> = Api::namespaced(ctx.client.clone(), &cfg.namespace);
    let every = (cfg.gc_after / 4).clamp(Duration::from_secs(1), Duration::from_secs(60));
    let gc_after = i64::try_from(cfg.gc_after.as_secs()).unwrap_or(i64::MAX);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        let lp = ListParams::default().labels(tunnel::WORKSTATION_LABEL);
        let list = match leases.list(&lp).await {
            Ok(l) => l.items,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list tunnel Leases");
                continue;
            }
        };
        let now_s = spur_serving::pki::now_unix();
        for lease in list {
            let dead = match Session::from_lease(&lease) {
                Ok(s) => now_s >= s.expires().saturating_add(gc_after),
                // Unreadable and old: judged by its creation time.
                Err(_) => lease
                    .metadata
                    .creation_timestamp
                    .as_ref()
                    .is_some_and(|t| now_s >= t.0.as_second().saturating_add(gc_after)),
            };
            if dead {
                let n = lease.name_any();
                match leases.delete(&n, &DeleteParams::default()).await {
                    Ok(_) => {
                        tracing::info!(lease = %n, "dead workstation tunnel garbage-collected");
                        ctx.metrics.tunnel_collected();
                    }
                    Err(e) => {
                        tracing::warn!(lease = %n, error = %e, "cannot delete dead tunnel Lease")
                    }
                }
            }
        }
    }
}
