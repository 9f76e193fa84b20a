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
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::{Value, json};
use spur_api::carriers::{MatchKind, key_matches};
use spur_api::mesh::{MAX_MATCHED_OBJECTS, MatchedObject, MeshRoute, ServiceRef};
use spur_api::{IstioRoute, MeshRouteStatus};
use tokio_util::sync::CancellationToken;

use crate::context::{Context, FIELD_MANAGER};
use crate::mesh::{MeshConfig, ready_condition, spec_of, virtual_service_resource};
use crate::{Error, FINALIZER};

/// Every route Spur writes into a VirtualService is named `spur.<IstioRoute>.<port>`; the
/// `spur.` prefix is Spur's, and such routes are kept ahead of all others.
const ROUTE_PREFIX: &str = "spur.";
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
}

/// The IstioRoute controller, woken by its IstioRoutes and by every VirtualService that names
/// one's target Service or holds its routes.
pub(crate) async fn run(
    client: Client,
    ctx: Arc<Context>,
    cfg: MeshConfig,
    stop: CancellationToken,
) {
    let resource = virtual_service_resource();
    let writer = Writer::new(resource.clone());
    let virtual_services = writer.as_reader();
    let events = watcher(
        Api::<DynamicObject>::all_with(client.clone(), &resource),
        watcher::Config::default(),
    )
    .modify(|o: &mut DynamicObject| o.managed_fields_mut().clear());
    let changes = reflector(writer, events).touched_objects();
    let controller = crate::triggers::primary(Api::<IstioRoute>::all(client.clone())).with_config(
        kube::runtime::controller::Config::default().debounce(Duration::from_millis(10)),
    );
    let routes = controller.store();
    let domain = cfg.cluster_domain.clone();
    let ictx = Arc::new(IstioContext {
        ctx,
        virtual_services,
        resource: resource.clone(),
        cluster_domain: cfg.cluster_domain,
    });
    let controller = controller.watches_stream_with(
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
    let name = ir.name_any();
    let route = ir.spec.route();
    let invalid = route.validate("IstioRoute").err().map(|e| e.to_string());
    let own = match &invalid {
        None => entries(&name, route, &ictx.cluster_domain),
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
            matched.push(MatchedObject {
                kind: "VirtualService".into(),
                namespace: ns,
                name: vs.name_any(),
                derived: Vec::new(),
                routed: user.is_some(),
                message: match user {
                    Some(n) => format!("{} route(s) ahead of {n} of its own", own.len()),
                    None => "deleted meanwhile".into(),
                },
            });
        }
    }
    let svc = route.target_service;
    let (ready, reason, message) = match (&invalid, matched.is_empty()) {
        (Some(e), _) => (false, "Invalid", e.clone()),
        (None, true) => (
            false,
            "NoVirtualService",
            format!("no VirtualService names {}.{}", svc.name, svc.namespace),
        ),
        (None, false) => (
            true,
            "Routed",
            format!("routes in {} VirtualService(s)", matched.len()),
        ),
    };
    write_status(ir, &ictx.ctx, matched, ready, reason, &message).await?;
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

async fn write_status(
    ir: &IstioRoute,
    ctx: &Context,
    matched: Vec<MatchedObject>,
    ready: bool,
    reason: &str,
    message: &str,
) -> Result<(), Error> {
    let old = ir.status.clone().unwrap_or_default();
    let mut st = MeshRouteStatus {
        observed_generation: ir.meta().generation,
        conditions: old.conditions.clone(),
        matched_objects: matched,
    };
    ready_condition(
        ir.meta().generation,
        &mut st.conditions,
        ready,
        reason,
        message,
    );
    let api: Api<IstioRoute> = Api::all(ctx.client.clone());
    ctx.status.apply(&api, ir, &old, &st).await?;
    Ok(())
}

fn error_policy(ir: Arc<IstioRoute>, err: &Error, ictx: Arc<IstioContext>) -> Action {
    if matches!(err, Error::Pending(_)) {
        return Action::requeue(Duration::from_millis(500));
    }
    ictx.ctx.retry(&*ir, err)
}

// === VirtualService contents ===

fn hosts(vs: &DynamicObject) -> impl Iterator<Item = &str> {
    spec_of(vs)
        .get("hosts")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
}

fn routes_of(vs: &DynamicObject) -> Vec<Value> {
    spec_of(vs)
        .get("http")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

/// Whether a VirtualService host in namespace `vs_ns` names `svc`: `name.ns`, `name.ns.svc`
/// and `name.ns.svc.<domain>` anywhere, the short name only in the Service's own namespace
/// (Istio reads a short name in the VirtualService's namespace). Wildcards are not followed.
fn names_service(host: &str, vs_ns: &str, svc: &ServiceRef, domain: &str) -> bool {
    let host = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    let (name, ns) = (svc.name.as_str(), svc.namespace.as_str());
    (host == name && vs_ns == ns)
        || host == format!("{name}.{ns}")
        || host == format!("{name}.{ns}.svc")
        || host == format!("{name}.{ns}.svc.{domain}")
}

fn route_name(r: &Value) -> &str {
    r.get("name").and_then(Value::as_str).unwrap_or_default()
}

fn is_spur(r: &Value) -> bool {
    route_name(r).starts_with(ROUTE_PREFIX)
}

fn is_own(r: &Value, ir_name: &str) -> bool {
    // IstioRoute names are DNS labels (no dots): `spur.<name>.` is this one's alone.
    route_name(r)
        .strip_prefix(ROUTE_PREFIX)
        .and_then(|rest| rest.strip_prefix(ir_name))
        .is_some_and(|rest| rest.starts_with('.'))
}

/// The HTTP routes of an IstioRoute: one per mapped port, matching the port and any one key
/// carrier, sending to the sandbox Service's fully qualified name.
fn entries(ir_name: &str, route: MeshRoute<'_>, domain: &str) -> Vec<Value> {
    let carriers = key_matches(route.routing_key);
    route
        .mappings
        .iter()
        .map(|m| {
            let matches: Vec<Value> = carriers
                .iter()
                .map(|k| {
                    let value = match k.kind {
                        MatchKind::Regex => json!({"regex": k.value}),
                        MatchKind::Exact => json!({"exact": k.value}),
                    };
                    json!({"port": m.from_port, "headers": {k.header: value}})
                })
                .collect();
            json!({
                "name": format!("{ROUTE_PREFIX}{ir_name}.{}", m.from_port),
                "match": matches,
                "route": [{"destination": {
                    "host": format!("{}.{}.svc.{domain}", m.to_service, route.target_service.namespace),
                    "port": {"number": m.to_port},
                }}],
            })
        })
        .collect()
}

/// `current` with this IstioRoute's routes replaced by `own`: every Spur route first, in name
/// order (so IstioRoutes sharing a VirtualService agree on one order and never undo each
/// other's writes), then every other route exactly as it was, in its order.
fn spliced(current: &[Value], ir_name: &str, own: &[Value]) -> Vec<Value> {
    let mut spur: Vec<Value> = current
        .iter()
        .filter(|r| is_spur(r) && !is_own(r, ir_name))
        .cloned()
        .collect();
    spur.extend(own.iter().cloned());
    spur.sort_by(|a, b| route_name(a).cmp(route_name(b)));
    spur.extend(current.iter().filter(|r| !is_spur(r)).cloned());
    spur
}

#[cfg(test)]
mod tests {
    use super::*;
    use spur_api::mesh::PortMapping;

    fn svc() -> ServiceRef {
        ServiceRef {
            namespace: "shop".into(),
            name: "web".into(),
        }
    }

    #[test]
    fn hosts_name_the_service_as_istio_reads_them() {
        let s = svc();
        for (host, ns, yes) in [
            ("web", "shop", true),
            ("web", "other", false),
            ("web.shop", "other", true),
            ("web.shop.svc", "other", true),
            ("web.shop.svc.cluster.local", "other", true),
            ("WEB.shop.svc.cluster.local.", "other", true),
            ("web.shop.svc.example.org", "other", false),
            ("*.shop.svc.cluster.local", "shop", false),
            ("web2.shop", "shop", false),
        ] {
            assert_eq!(
                names_service(host, ns, &s, "cluster.local"),
                yes,
                "{host} in {ns}"
            );
        }
    }

    #[test]
    fn spur_routes_go_first_in_name_order_and_user_routes_stay_as_they_were() {
        let s = svc();
        let mappings = [
            PortMapping {
                from_port: 80,
                to_service: "sb1-web".into(),
                to_port: 80,
            },
            PortMapping {
                from_port: 9090,
                to_service: "sb1-web".into(),
                to_port: 9090,
            },
        ];
        let route = MeshRoute {
            routing_key: "k1",
            sandbox: "sb1",
            target_service: &s,
            mappings: &mappings,
        };
        let own = entries("b-ir", route, "cluster.local");
        assert_eq!(own.len(), 2);
        assert_eq!(route_name(&own[0]), "spur.b-ir.80");
        assert_eq!(
            own[0]["route"][0]["destination"]["host"],
            "sb1-web.shop.svc.cluster.local"
        );
        assert_eq!(own[0]["match"].as_array().unwrap().len(), 10);
        assert_eq!(own[0]["match"][0]["port"], 80);
        assert!(own[0]["match"][0]["headers"]["baggage"]["regex"].is_string());
        assert_eq!(
            own[0]["match"][2]["headers"]["ot-baggage-sd-routing-key"]["exact"],
            "k1"
        );

        let user = json!({"name": "default", "route": [{"destination": {"host": "web"}}]});
        let unnamed = json!({"route": [{"destination": {"host": "web"}, "weight": 100}]});
        let other_ir = json!({"name": "spur.a-ir.80", "route": []});
        let look_alike = json!({"name": "spur.b-ir2.80", "route": []});
        let current = vec![
            user.clone(),
            other_ir.clone(),
            unnamed.clone(),
            look_alike.clone(),
        ];
        let next = spliced(&current, "b-ir", &own);
        let names: Vec<&str> = next.iter().map(route_name).collect();
        assert_eq!(
            names,
            [
                "spur.a-ir.80",
                "spur.b-ir.80",
                "spur.b-ir.9090",
                "spur.b-ir2.80",
                "default",
                ""
            ]
        );
        assert_eq!(next[4], user);
        assert_eq!(next[5], unnamed);
        // Stable: splicing again changes nothing; removing restores the rest in its order.
        assert_eq!(spliced(&next, "b-ir", &own), next);
        let removed = spliced(&next, "b-ir", &[]);
        assert_eq!(removed, vec![other_ir, look_alike, user, unnamed]);
    }
}
