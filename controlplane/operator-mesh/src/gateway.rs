//! GatewayAPIRoute controller: for every Gateway API HTTPRoute with a backendRef to the target
//! Service, keeps one derived HTTPRoute per mapped port beside it, owned by the
//! GatewayAPIRoute: the same parents and hostnames, each rule that sends to the Service on that
//! port with its matches AND-ed with a match on one key carrier (one derived match per original
//! match and carrier), sending to the sandbox Service instead.
//!
//! The user's HTTPRoutes are never written: a derived route of Spur's own is the one way to add
//! routes without touching the user's `rules` (an atomic list, like Istio's `http`). Gateway
//! API's precedence makes the derived match win: for the same hostname and path, the match with
//! more header matches is chosen, and every derived match has one more than the one it came
//! from.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{ListParams, Patch, PatchParams};
use kube::core::{ApiResource, DynamicObject};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use kube::runtime::reflector::{ObjectRef, Store, reflector, store::Writer};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use spur_api::GatewayAPIRoute;
use spur_api::keys::{annotations, labels};
use tokio_util::sync::CancellationToken;

use spur_operator_core::{Context, Error, FIELD_MANAGER, FINALIZER};

use crate::{Carriers, MeshConfig, http_route_resource, routes_in_namespace};

mod desired;
mod status;

use desired::{is_managed, references};

impl spur_controller::HasBackoff for GatewayContext {
    fn backoff(&self) -> &spur_controller::Backoff {
        spur_controller::HasBackoff::backoff(&*self.ctx)
    }
}

pub(crate) struct GatewayContext {
    ctx: Arc<Context>,
    http_routes: Store<DynamicObject>,
    resource: ApiResource,
    carriers: Carriers,
}

/// The GatewayAPIRoute controller, woken by its GatewayAPIRoutes, by every HTTPRoute with a
/// backendRef to one's target Service, and by the routes it derived.
pub async fn run(client: Client, ctx: Arc<Context>, cfg: MeshConfig, stop: CancellationToken) {
    let resource = http_route_resource();
    let writer = Writer::new(resource.clone());
    let http_routes = writer.as_reader();
    let events = watcher(
        Api::<DynamicObject>::all_with(client.clone(), &resource),
        watcher::Config::default(),
    )
    .modify(|o: &mut DynamicObject| o.managed_fields_mut().clear());
    let changes = reflector(writer, events).touched_objects();
    let controller = spur_controller::changes::primary(Api::<GatewayAPIRoute>::all(client.clone()))
        .with_config(spur_operator_core::controller_config());
    let gars = controller.store();
    let by_namespace = gars.clone();
    let (carriers, namespaces) =
        match Carriers::watch(&client, &cfg.routing_keys, "gatewayapiroute") {
            Ok(c) => c,
            Err(e) => {
                // MeshConfig::validate refused this already at start.
                tracing::error!(error = %e, "GatewayAPIRoute controller not started");
                return;
            }
        };
    let gctx = Arc::new(GatewayContext {
        ctx,
        http_routes,
        resource: resource.clone(),
        carriers,
    });
    let controller = controller
        .watches_stream_with(
            changes,
            move |route: DynamicObject| {
                let mut refs = spur_controller::cluster_owners::<GatewayAPIRoute>(&route);
                if !is_managed(&route) {
                    refs.extend(
                        gars.state()
                            .into_iter()
                            .filter(|g| references(&route, &g.spec.target_service))
                            .map(|g| ObjectRef::from_obj(&*g)),
                    );
                }
                refs
            },
            resource,
        )
        // A namespace's carrier annotations decide the matches of the routes to its Services.
        .watches_stream_with(
            namespaces,
            routes_in_namespace(by_namespace, |g: &GatewayAPIRoute| {
                g.spec.target_service.namespace.as_str()
            }),
            (),
        );
    spur_controller::run(
        "gatewayapiroute",
        controller,
        reconcile,
        error_policy,
        gctx,
        stop,
    )
    .await;
}

async fn reconcile(gr: Arc<GatewayAPIRoute>, gctx: Arc<GatewayContext>) -> Result<Action, Error> {
    let _pass = gctx.ctx.metrics.reconcile("GatewayAPIRoute");
    let api: Api<GatewayAPIRoute> = Api::all(gctx.ctx.client.clone());
    let action = finalizer(&api, FINALIZER, gr, |event| async {
        match event {
            Event::Apply(gr) => apply(&gr, &gctx).await,
            Event::Cleanup(gr) => cleanup(&gr, &gctx).await,
        }
    })
    .await;
    spur_controller::finalized(action)
}

async fn apply(gr: &GatewayAPIRoute, gctx: &GatewayContext) -> Result<Action, Error> {
    // An unsynced store would look like a cluster without HTTPRoutes.
    if tokio::time::timeout(Duration::from_secs(1), gctx.http_routes.wait_until_ready())
        .await
        .is_err()
    {
        return Err(Error::Pending("the HTTPRoute watch to sync".into()));
    }
    gctx.carriers.ready().await?;
    let name = gr.name_any();
    let invalid = gr
        .spec
        .route()
        .validate("GatewayAPIRoute")
        .err()
        .map(|e| e.to_string());
    let mut all: Vec<Arc<DynamicObject>> = gctx.http_routes.state();
    all.sort_by_key(|r| (r.namespace(), r.name_any()));
    let derived = match invalid {
        None => desired::plan(
            gr,
            &all,
            &gctx.carriers.of(&gr.spec.target_service.namespace),
        ),
        Some(_) => Vec::new(),
    };
    let mut keep = BTreeSet::new();
    for d in &derived {
        for obj in &d.routes {
            keep.insert((d.namespace.clone(), obj.name_any()));
            ensure(gctx, obj.clone()).await?;
        }
    }
    // Derived routes no longer wanted: their user route changed or went, or a port did.
    for old in desired::unwanted(&all, &name, &keep) {
        let ns = old.namespace().unwrap_or_default();
        let api =
            Api::<DynamicObject>::namespaced_with(gctx.ctx.client.clone(), &ns, &gctx.resource);
        spur_operator_core::delete_opt(&api, &old.name_any()).await?;
    }
    let old = gr.status.clone().unwrap_or_default();
    let st = status::status(gr, invalid.as_deref(), &derived);
    let api: Api<GatewayAPIRoute> = Api::all(gctx.ctx.client.clone());
    gctx.ctx.status.apply(&api, gr, &old, &st).await?;
    Ok(Action::requeue(Duration::from_secs(300)))
}

/// Deletes every route this GatewayAPIRoute derived, found through its label on the API
/// server (the store may not hold one just made).
async fn cleanup(gr: &GatewayAPIRoute, gctx: &GatewayContext) -> Result<Action, Error> {
    let api = Api::<DynamicObject>::all_with(gctx.ctx.client.clone(), &gctx.resource);
    let lp =
        ListParams::default().labels(&format!("{}={}", labels::GATEWAY_API_ROUTE, gr.name_any()));
    for r in api.list_metadata(&lp).await?.items {
        let ns = r.namespace().unwrap_or_default();
        let api =
            Api::<DynamicObject>::namespaced_with(gctx.ctx.client.clone(), &ns, &gctx.resource);
        spur_operator_core::delete_opt(&api, &r.name_any()).await?;
    }
    Ok(Action::await_change())
}

fn error_policy(gr: Arc<GatewayAPIRoute>, err: &Error, gctx: Arc<GatewayContext>) -> Action {
    if matches!(err, Error::Pending(_)) {
        return Action::requeue(Duration::from_millis(500));
    }
    gctx.ctx.retry(&*gr, err)
}

/// Applies a derived route (server-side apply: it is all ours), unless the store holds it as
/// wanted already (same digest stamp), so a pass that changes nothing writes nothing.
async fn ensure(gctx: &GatewayContext, mut obj: DynamicObject) -> Result<(), Error> {
    obj.annotations_mut().remove(annotations::DESIRED);
    let digest = format!("{:016x}", spur_controller::hash_of(&obj));
    obj.annotations_mut()
        .insert(annotations::DESIRED.into(), digest.clone());
    let ns = obj.namespace().unwrap_or_default();
    let name = obj.name_any();
    let current = gctx
        .http_routes
        .get(&ObjectRef::new_with(&name, gctx.resource.clone()).within(&ns));
    if let Some(cur) = current
        && cur.meta().deletion_timestamp.is_none()
        && cur.annotations().get(annotations::DESIRED) == Some(&digest)
    {
        return Ok(());
    }
    let api = Api::<DynamicObject>::namespaced_with(gctx.ctx.client.clone(), &ns, &gctx.resource);
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&obj),
    )
    .await?;
    Ok(())
}
