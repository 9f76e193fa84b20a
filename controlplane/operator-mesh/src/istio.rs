//! IstioRoute controller: keeps, in every Istio VirtualService whose hosts name the target
//! Service, one HTTP route per mapped port that sends requests carrying the routing key to the
//! sandbox Service, ahead of the VirtualService's own routes; takes them out again when the
//! IstioRoute goes (finalizer) or a VirtualService stops naming the Service.
//!
//! Why not server-side apply: `spec.http` is an atomic list in Istio's CRD (no list-map
//! keys), so an apply by a second field manager either conflicts with the VirtualService's
//! owner or, forced, takes the whole list from them: their next apply would then conflict, or
//! (forced) drop Spur's routes, and a forced apply of ours could drop a route they had just
//! added. Instead each write reads the list, splices Spur's routes in front of everything else
//! (keeping the user's entries exactly as read), and writes it back with a merge patch that
//! carries the `resourceVersion` read: a concurrent edit makes the write fail with a conflict,
//! and it is redone on the edited object. Only `spec.http` is written, under Spur's field
//! manager.

use std::sync::Arc;
use std::time::Duration;

use kube::api::{ListParams, Patch, PatchParams};
use kube::core::{ApiResource, DynamicObject};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use kube::runtime::reflector::{ObjectRef, Store, reflector, store::Writer};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use spur_api::IstioRoute;
use spur_api::mesh::MAX_MATCHED_OBJECTS;
use tokio_util::sync::CancellationToken;

use spur_operator_core::{Context, Error, FIELD_MANAGER, FINALIZER};

use crate::{Carriers, MeshConfig, routes_in_namespace, virtual_service_resource};

mod desired;
mod status;

use desired::{entries, hosts, is_own, is_spur, names_service, routes_of, spliced};

/// Conflicting writes to one VirtualService retried before the pass fails (and backs off).
const MAX_CONFLICTS: u32 = 10;

impl spur_controller::HasBackoff for IstioContext {
    fn backoff(&self) -> &spur_controller::Backoff {
        spur_controller::HasBackoff::backoff(&*self.ctx)
    }
}

pub(crate) struct IstioContext {
    ctx: Arc<Context>,
    virtual_services: Store<DynamicObject>,
    resource: ApiResource,
    cluster_domain: String,
    carriers: Carriers,
}

/// The IstioRoute controller, woken by its IstioRoutes and by every VirtualService that names
/// one's target Service or holds its routes.
pub async fn run(client: Client, ctx: Arc<Context>, cfg: MeshConfig, stop: CancellationToken) {
    let resource = virtual_service_resource();
    let writer = Writer::new(resource.clone());
    let virtual_services = writer.as_reader();
    let events = watcher(
        Api::<DynamicObject>::all_with(client.clone(), &resource),
        watcher::Config::default(),
    )
    .modify(|o: &mut DynamicObject| o.managed_fields_mut().clear());
    let changes = reflector(writer, events).touched_objects();
    let controller = spur_controller::changes::primary(Api::<IstioRoute>::all(client.clone()))
        .with_config(spur_operator_core::controller_config());
    let routes = controller.store();
    let domain = cfg.cluster_domain.clone();
    let (carriers, namespaces) = match Carriers::watch(&client, &cfg.routing_keys, "istioroute") {
        Ok(c) => c,
        Err(e) => {
            // MeshConfig::validate refused this already at start.
            tracing::error!(error = %e, "IstioRoute controller not started");
            return;
        }
    };
    let ictx = Arc::new(IstioContext {
        ctx,
        virtual_services,
        resource: resource.clone(),
        cluster_domain: cfg.cluster_domain,
        carriers,
    });
    let by_namespace = routes.clone();
    let controller = controller
        .watches_stream_with(
            changes,
            move |vs: DynamicObject| {
                routes
                    .state()
                    .into_iter()
                    .filter(|ir| concerns(&vs, ir, &domain))
                    .map(|ir| ObjectRef::from_obj(&*ir))
                    .collect::<Vec<_>>()
            },
            resource,
        )
        // A namespace's carrier annotations decide the matches of the routes to its Services.
        .watches_stream_with(
            namespaces,
            routes_in_namespace(by_namespace, |ir: &IstioRoute| {
                ir.spec.target_service.namespace.as_str()
            }),
            (),
        );
    spur_controller::run(
        "istioroute",
        controller,
        reconcile,
        error_policy,
        ictx,
        stop,
    )
    .await;
}

/// Whether a change of `vs` may matter to `ir`: it names the target, or holds its routes.
fn concerns(vs: &DynamicObject, ir: &IstioRoute, domain: &str) -> bool {
    let ns = vs.namespace().unwrap_or_default();
    hosts(vs).any(|h| names_service(h, &ns, &ir.spec.target_service, domain))
        || routes_of(vs).iter().any(|r| is_own(r, &ir.name_any()))
}

async fn reconcile(ir: Arc<IstioRoute>, ictx: Arc<IstioContext>) -> Result<Action, Error> {
    let _pass = ictx.ctx.metrics.reconcile("IstioRoute");
    let api: Api<IstioRoute> = Api::all(ictx.ctx.client.clone());
    let action = finalizer(&api, FINALIZER, ir, |event| async {
        match event {
            Event::Apply(ir) => apply(&ir, &ictx).await,
            Event::Cleanup(ir) => cleanup(&ir, &ictx).await,
        }
    })
    .await;
    spur_controller::finalized(action)
}

async fn apply(ir: &IstioRoute, ictx: &IstioContext) -> Result<Action, Error> {
    // An unsynced store would look like a cluster without VirtualServices.
    if tokio::time::timeout(
        Duration::from_secs(1),
        ictx.virtual_services.wait_until_ready(),
    )
    .await
    .is_err()
    {
        return Err(Error::Pending("the VirtualService watch to sync".into()));
    }
    ictx.carriers.ready().await?;
    let name = ir.name_any();
    let route = ir.spec.route();
    let invalid = route.validate("IstioRoute").err().map(|e| e.to_string());
    let own = match &invalid {
        None => entries(
            &name,
            route,
            &ictx.cluster_domain,
            &ictx.carriers.of(&route.target_service.namespace),
        ),
        Some(_) => Vec::new(),
    };
    let mut vss: Vec<Arc<DynamicObject>> = ictx.virtual_services.state();
    vss.sort_by_key(|vs| (vs.namespace(), vs.name_any()));
    let mut matched = Vec::new();
    for vs in vss {
        let ns = vs.namespace().unwrap_or_default();
        let named = invalid.is_none()
            && hosts(&vs)
                .any(|h| names_service(h, &ns, route.target_service, &ictx.cluster_domain));
        if !named && !routes_of(&vs).iter().any(|r| is_own(r, &name)) {
            continue;
        }
        let want = if named { own.clone() } else { Vec::new() };
        let user = write(ictx, &vs, &name, &want).await?;
        if named && matched.len() < MAX_MATCHED_OBJECTS {
            matched.push(status::matched(&vs, own.len(), user));
        }
    }
    let old = ir.status.clone().unwrap_or_default();
    let st = status::status(ir, invalid.as_deref(), matched);
    let api: Api<IstioRoute> = Api::all(ictx.ctx.client.clone());
    ictx.ctx.status.apply(&api, ir, &old, &st).await?;
    Ok(Action::requeue(Duration::from_secs(300)))
}

/// Takes this IstioRoute's routes out of every VirtualService, read from the API server (not
/// the store, which may not have our latest write yet), before the finalizer goes.
async fn cleanup(ir: &IstioRoute, ictx: &IstioContext) -> Result<Action, Error> {
    let name = ir.name_any();
    let api = Api::<DynamicObject>::all_with(ictx.ctx.client.clone(), &ictx.resource);
    let mut continue_token = None;
    loop {
        let mut lp = ListParams::default().limit(500);
        lp.continue_token = continue_token.take();
        let page = api.list(&lp).await?;
        for vs in &page.items {
            if routes_of(vs).iter().any(|r| is_own(r, &name)) {
                write(ictx, vs, &name, &[]).await?;
            }
        }
        match page.metadata.continue_ {
            Some(t) if !t.is_empty() => continue_token = Some(t),
            _ => break,
        }
    }
    Ok(Action::await_change())
}

/// Makes `own` this IstioRoute's routes in `vs` (none: removes them), starting from `vs` as
/// given and re-reading it after each conflict. Returns how many routes of other origin the
/// VirtualService has, or `None` when it is gone.
async fn write(
    ictx: &IstioContext,
    vs: &DynamicObject,
    ir_name: &str,
    own: &[Value],
) -> Result<Option<usize>, Error> {
    let ns = vs.namespace().unwrap_or_default();
    let name = vs.name_any();
    let api = Api::<DynamicObject>::namespaced_with(ictx.ctx.client.clone(), &ns, &ictx.resource);
    let mut current = vs.clone();
    let mut conflicts = 0;
    loop {
        let routes = routes_of(&current);
        let next = spliced(&routes, ir_name, own);
        let others = next.iter().filter(|r| !is_spur(r)).count();
        if next == routes {
            return Ok(Some(others));
        }
        // An empty list is written as no list: a VirtualService that had no `http` gets none.
        let http = if next.is_empty() {
            Value::Null
        } else {
            Value::Array(next)
        };
        let patch = json!({
            "metadata": {"resourceVersion": current.resource_version()},
            "spec": {"http": http},
        });
        let pp = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        match api.patch(&name, &pp, &Patch::Merge(&patch)).await {
            Ok(_) => return Ok(Some(others)),
            Err(kube::Error::Api(s)) if s.code == 409 => {
                conflicts += 1;
                if conflicts > MAX_CONFLICTS {
                    return Err(Error::Mesh(format!(
                        "VirtualService {ns}/{name} changed under {MAX_CONFLICTS} writes in a row"
                    )));
                }
                tracing::debug!(
                    virtual_service = %format!("{ns}/{name}"),
                    conflicts,
                    "changed meanwhile: splicing again"
                );
                match api.get_opt(&name).await? {
                    Some(fresh) => current = fresh,
                    None => return Ok(None),
                }
            }
            Err(kube::Error::Api(s)) if s.is_not_found() => return Ok(None),
            Err(e) => return Err(e.into()),
        }
    }
}

fn error_policy(ir: Arc<IstioRoute>, err: &Error, ictx: Arc<IstioContext>) -> Action {
    if matches!(err, Error::Pending(_)) {
        return Action::requeue(Duration::from_millis(500));
    }
    ictx.ctx.retry(&*ir, err)
}
