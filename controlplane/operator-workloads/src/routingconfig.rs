//! RoutingConfig controller: turns the sandboxed workloads of one routing key into
//! `status.routeServer.routes`, which the route server serves. A workload contributes routes
//! only once it is ready, so keyed traffic never reaches a fork that cannot answer yet. With
//! mesh modes enabled it also keeps one IstioRoute / GatewayAPIRoute per baseline Service of
//! those workloads (`crate::mesh`).

use std::sync::Arc;
use std::time::Duration;

use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Resource, ResourceExt};
use spur_api::RoutingConfig;
use spur_api::routingconfig::SandboxedKind;

use crate::context::{Term, WorkloadsContext};
use crate::{Error, FINALIZER};

mod status;

use status::Read;
pub(crate) use status::{SPAN_GRACE_MS, routes_end_ms};

pub(crate) async fn reconcile(rc: Arc<RoutingConfig>, ctx: Arc<Term>) -> Result<Action, Error> {
    let _pass = ctx.metrics.reconcile("RoutingConfig");
    let api: Api<RoutingConfig> = Api::all(ctx.client.clone());
    let Some(mesh) = ctx.mesh.clone() else {
        // Without mesh modes a RoutingConfig has nothing of its own to clean up. A finalizer
        // left from a run with them goes (what remains of its mesh routes is owned by it, and
        // goes with it through the garbage collector).
        crate::mesh::remove_finalizer(&api, &*rc, FINALIZER).await?;
        if rc.meta().deletion_timestamp.is_some() {
            return Ok(Action::await_change());
        }
        return apply(&rc, &ctx, None).await;
    };
    // With mesh modes the RoutingConfig owns mesh routes, which write into objects of the
    // user's: it keeps a finalizer until they are gone.
    let action = finalizer(&api, FINALIZER, rc, |event| async {
        match event {
            Event::Apply(rc) => apply(&rc, &ctx, Some(&mesh)).await,
            Event::Cleanup(rc) => {
                let action = crate::mesh::cleanup(&rc, &mesh, &ctx).await?;
                Ok(action)
            }
        }
    })
    .await;
    spur_controller::finalized(action)
}

async fn apply(
    rc: &RoutingConfig,
    ctx: &Term,
    mesh: Option<&crate::MeshConfig>,
) -> Result<Action, Error> {
    let invalid = rc.spec.validate().err().map(|e| e.to_string());
    let reads = match invalid {
        Some(_) => Vec::new(),
        None => read_all(rc, ctx).await?,
    };
    let routing = status::routing(rc, &reads);
    let old = rc.status.clone().unwrap_or_default();
    let now_ms = k8s_openapi::jiff::Timestamp::now().as_millisecond();
    // Once the sandbox is being deleted, its spans end where its controller fixed it.
    let end_ms = routes_end_ms(rc.annotations());
    let spans = status::spans(rc.spans(), &routing.routed, now_ms, end_ms);
    let st = status::status(
        rc,
        &old,
        invalid.as_deref(),
        routing.routes,
        spans,
        &routing.waiting,
    );
    // The mesh routes follow the same ready workloads as the route server's routes.
    if let Some(mesh) = mesh {
        let targets: Vec<crate::mesh::Target<'_>> = (routing.targets.iter())
            .map(|(w, services)| crate::mesh::Target {
                namespace: &w.namespace,
                sandbox: &w.sandbox,
                services,
            })
            .collect();
        crate::mesh::sync(rc, &targets, mesh, ctx).await?;
    }
    let api: Api<RoutingConfig> = Api::all(ctx.client.clone());
    ctx.status.apply(&api, rc, &old, &st).await?;
    Ok(Action::requeue(Duration::from_secs(300)))
}

/// Every workload `rc` lists, as read (in the same order).
async fn read_all(rc: &RoutingConfig, ctx: &Term) -> Result<Vec<Read>, Error> {
    let mut reads = Vec::with_capacity(rc.spec.workloads.len());
    for w in &rc.spec.workloads {
        let (ns, name) = (&w.namespace, &w.name);
        reads.push(match w.kind {
            SandboxedKind::ForkedWorkload => {
                let fw = read(ctx, &ctx.stores.rc_forks, ns, name).await?;
                let kafka = match fw.as_ref().and_then(|fw| fw.status.as_ref()?.fork.clone()) {
                    // Only a ready fork is routed, and a ready fork's Deployment exists.
                    Some(fork) if status::is_ready(fw.as_deref()) => {
                        let d = read(ctx, &ctx.stores.deployments, ns, &fork).await?;
                        let template = d.as_ref().and_then(|d| {
                            d.spec
                                .as_ref()?
                                .template
                                .metadata
                                .as_ref()?
                                .annotations
                                .as_ref()
                        });
                        status::relays_kafka(template, ctx.kafka_by_default)
                    }
                    _ => ctx.kafka_by_default,
                };
                Read::Forked(fw, kafka)
            }
            SandboxedKind::ExternalWorkload => {
                Read::External(read(ctx, &ctx.stores.rc_externals, ns, name).await?)
            }
            SandboxedKind::VirtualWorkload => Read::Virtual,
        });
    }
    Ok(reads)
}

/// A workload from the store filled by the watch that wakes this controller, or from the API
/// server when the store does not have it (yet).
async fn read<K>(
    ctx: &WorkloadsContext,
    store: &Store<K>,
    namespace: &str,
    name: &str,
) -> Result<Option<Arc<K>>, Error>
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned,
{
    if let Some(obj) = store.get(&ObjectRef::new(name).within(namespace)) {
        return Ok(Some(obj));
    }
    let api: Api<K> = Api::namespaced(ctx.client.clone(), namespace);
    Ok(api.get_opt(name).await?.map(Arc::new))
}

/// Whether a RoutingConfig lists the workload `obj` of `kind` (for the watches on workloads).
pub(crate) fn lists(rc: &RoutingConfig, kind: SandboxedKind, obj: &impl ResourceExt) -> bool {
    let ns = obj.namespace().unwrap_or_default();
    let name = obj.name_any();
    rc.spec
        .workloads
        .iter()
        .any(|w| w.kind == kind && w.namespace == ns && w.name == name)
}

pub(crate) fn error_policy(rc: Arc<RoutingConfig>, err: &Error, ctx: Arc<Term>) -> Action {
    ctx.retry(&*rc, err)
}
