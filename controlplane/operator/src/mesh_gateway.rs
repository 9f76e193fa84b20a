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
use serde_json::{Value, json};
use spur_api::carriers::{MatchKind, key_matches};
use spur_api::keys::{annotations, labels};
use spur_api::mesh::{MAX_MATCHED_OBJECTS, MatchedObject, MeshRoute, PortMapping, ServiceRef};
use spur_api::{GatewayAPIRoute, MeshRouteStatus, names};
use tokio_util::sync::CancellationToken;

use crate::context::{Context, FIELD_MANAGER};
use crate::mesh::{http_route_resource, ready_condition, spec_of};
use crate::{Error, FINALIZER};

/// Gateway API's bounds on an HTTPRoute (standard channel CRD, v1.6): matches per rule, matches
/// per route, header matches per match.
const MAX_MATCHES_PER_RULE: usize = 64;
const MAX_MATCHES_PER_ROUTE: usize = 128;
const MAX_HEADERS_PER_MATCH: usize = 16;

impl spur_controller::HasBackoff for GatewayContext {
    fn backoff(&self) -> &spur_controller::Backoff {
        spur_controller::HasBackoff::backoff(&*self.ctx)
    }
}

pub(crate) struct GatewayContext {
    ctx: Arc<Context>,
    http_routes: Store<DynamicObject>,
    resource: ApiResource,
}

/// The GatewayAPIRoute controller, woken by its GatewayAPIRoutes, by every HTTPRoute with a
/// backendRef to one's target Service, and by the routes it derived.
pub(crate) async fn run(client: Client, ctx: Arc<Context>, stop: CancellationToken) {
    let resource = http_route_resource();
    let writer = Writer::new(resource.clone());
    let http_routes = writer.as_reader();
    let events = watcher(
        Api::<DynamicObject>::all_with(client.clone(), &resource),
        watcher::Config::default(),
    )
    .modify(|o: &mut DynamicObject| o.managed_fields_mut().clear());
    let changes = reflector(writer, events).touched_objects();
    let controller = crate::triggers::primary(Api::<GatewayAPIRoute>::all(client.clone()))
        .with_config(
            kube::runtime::controller::Config::default().debounce(Duration::from_millis(10)),
        );
    let gars = controller.store();
    let gctx = Arc::new(GatewayContext {
        ctx,
        http_routes,
        resource: resource.clone(),
    });
    let controller = controller.watches_stream_with(
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
    let name = gr.name_any();
    let route = gr.spec.route();
    let invalid = route
        .validate("GatewayAPIRoute")
        .err()
        .map(|e| e.to_string());
    let mut all: Vec<Arc<DynamicObject>> = gctx.http_routes.state();
    all.sort_by_key(|r| (r.namespace(), r.name_any()));
    let mut keep = BTreeSet::new();
    let mut matched = Vec::new();
    let mut failed = 0;
    if invalid.is_none() {
        for user in all.iter().filter(|r| !is_managed(r)) {
            if !references(user, route.target_service) {
                continue;
            }
            let ns = user.namespace().unwrap_or_default();
            let mut derived = Vec::new();
            let mut problems = Vec::new();
            for m in route.mappings {
                match derive(gr, user, route, m) {
                    Ok(None) => {}
                    Ok(Some(obj)) => {
                        let dname = obj.name_any();
                        keep.insert((ns.clone(), dname.clone()));
                        ensure(gctx, obj).await?;
                        derived.push(dname);
                    }
                    Err(why) => problems.push(format!("port {}: {why}", m.from_port)),
                }
            }
            if !problems.is_empty() {
                failed += 1;
            }
            if matched.len() < MAX_MATCHED_OBJECTS {
                let mut message = format!("{} route(s) derived", derived.len());
                for p in &problems {
                    message.push_str("; ");
                    message.push_str(p);
                }
                matched.push(MatchedObject {
                    kind: "HTTPRoute".into(),
                    namespace: ns,
                    name: user.name_any(),
                    routed: !derived.is_empty() && problems.is_empty(),
                    derived,
                    message,
                });
            }
        }
    }
    // Derived routes no longer wanted: their user route changed or went, or a port did.
    for old in all.iter().filter(|r| derived_by(r, &name)) {
        let ns = old.namespace().unwrap_or_default();
        if !keep.contains(&(ns.clone(), old.name_any())) {
            let api =
                Api::<DynamicObject>::namespaced_with(gctx.ctx.client.clone(), &ns, &gctx.resource);
            crate::context::delete_opt(&api, &old.name_any()).await?;
        }
    }
    let svc = route.target_service;
    let (ready, reason, message) = match (&invalid, matched.is_empty(), failed) {
        (Some(e), _, _) => (false, "Invalid", e.clone()),
        (None, true, _) => (
            false,
            "NoHTTPRoute",
            format!(
                "no HTTPRoute has a backendRef to Service {}/{}",
                svc.namespace, svc.name
            ),
        ),
        (None, false, 0) => (
            true,
            "Routed",
            format!("routes derived from {} HTTPRoute(s)", matched.len()),
        ),
        (None, false, n) => (
            false,
            "NotDerivable",
            format!("{n} HTTPRoute(s) could not be derived from: see matchedObjects"),
        ),
    };
    let old = gr.status.clone().unwrap_or_default();
    let mut st = MeshRouteStatus {
        observed_generation: gr.meta().generation,
        conditions: old.conditions.clone(),
        matched_objects: matched,
    };
    ready_condition(
        gr.meta().generation,
        &mut st.conditions,
        ready,
        reason,
        &message,
    );
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
        crate::context::delete_opt(&api, &r.name_any()).await?;
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

fn is_managed(route: &DynamicObject) -> bool {
    route.labels().get(labels::MANAGED_BY).map(String::as_str) == Some(labels::MANAGED_BY_VALUE)
}

fn derived_by(route: &DynamicObject, gar: &str) -> bool {
    is_managed(route)
        && route
            .labels()
            .get(labels::GATEWAY_API_ROUTE)
            .map(String::as_str)
            == Some(gar)
}

fn rules(route: &DynamicObject) -> impl Iterator<Item = &Value> {
    spec_of(route)
        .get("rules")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

fn backend_refs(rule: &Value) -> impl Iterator<Item = &Value> {
    rule.get("backendRefs")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

/// Whether a backendRef of an HTTPRoute in `route_ns` is the Service `svc` (on `port`, if
/// given). A backendRef's group defaults to the core group, its kind to Service and its
/// namespace to the route's.
fn is_service_ref(b: &Value, route_ns: &str, svc: &ServiceRef, port: Option<i32>) -> bool {
    let s = |k: &str| b.get(k).and_then(Value::as_str);
    s("group").unwrap_or_default().is_empty()
        && s("kind").unwrap_or("Service") == "Service"
        && s("name") == Some(svc.name.as_str())
        && s("namespace").unwrap_or(route_ns) == svc.namespace
        && port.is_none_or(|p| b.get("port").and_then(Value::as_i64) == Some(i64::from(p)))
}

/// Whether any rule of `route` has a backendRef to `svc` (any port).
fn references(route: &DynamicObject, svc: &ServiceRef) -> bool {
    let ns = route.namespace().unwrap_or_default();
    rules(route).any(|r| backend_refs(r).any(|b| is_service_ref(b, &ns, svc, None)))
}

/// The derived HTTPRoute of `user` for mapping `m`: `None` when no rule of `user` sends to the
/// target Service on that port; an error (for status) when Gateway API's bounds do not leave
/// room for the carriers' matches.
fn derive(
    gr: &GatewayAPIRoute,
    user: &DynamicObject,
    route: MeshRoute<'_>,
    m: &PortMapping,
) -> Result<Option<DynamicObject>, String> {
    let ns = user.namespace().unwrap_or_default();
    let carriers = key_matches(route.routing_key);
    let default_match = [json!({"path": {"type": "PathPrefix", "value": "/"}})];
    let mut out = Vec::new();
    let mut total = 0;
    for (i, rule) in rules(user).enumerate() {
        let Some(backend) = backend_refs(rule)
            .find(|b| is_service_ref(b, &ns, route.target_service, Some(m.from_port)))
        else {
            continue;
        };
        let matches = match rule.get("matches").and_then(Value::as_array) {
            Some(ms) if !ms.is_empty() => &ms[..],
            _ => &default_match[..],
        };
        let mut derived = Vec::new();
        for mt in matches {
            let headers: Vec<Value> = mt
                .get("headers")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            if headers.len() >= MAX_HEADERS_PER_MATCH {
                return Err(format!(
                    "rule {i} has a match with {} header matches, no room for a key carrier",
                    headers.len()
                ));
            }
            for c in &carriers {
                // A match that already tests this header (header names are case-insensitive)
                // cannot test it twice; that carrier is left out for this match.
                if headers.iter().any(|h| {
                    h.get("name")
                        .and_then(Value::as_str)
                        .is_some_and(|n| n.eq_ignore_ascii_case(c.header))
                }) {
                    continue;
                }
                let mut with = headers.clone();
                with.push(json!({
                    "type": match c.kind {
                        MatchKind::Regex => "RegularExpression",
                        MatchKind::Exact => "Exact",
                    },
                    "name": c.header,
                    "value": c.value,
                }));
                let mut d = mt.clone();
                d["headers"] = Value::Array(with);
                derived.push(d);
            }
        }
        if derived.len() > MAX_MATCHES_PER_RULE {
            return Err(format!(
                "rule {i} would need {} matches (Gateway API allows {MAX_MATCHES_PER_RULE} per rule)",
                derived.len()
            ));
        }
        total += derived.len();
        let mut b = backend.clone();
        b["name"] = json!(m.to_service);
        b["port"] = json!(m.to_port);
        // Keyed requests all go to the sandbox: the rule's split among backends is the
        // baseline's.
        if let Some(o) = b.as_object_mut() {
            o.remove("weight");
        }
        let mut r = rule.clone();
        r["matches"] = Value::Array(derived);
        r["backendRefs"] = json!([b]);
        out.push(r);
    }
    if out.is_empty() {
        return Ok(None);
    }
    if total > MAX_MATCHES_PER_ROUTE {
        return Err(format!(
            "would need {total} matches (Gateway API allows {MAX_MATCHES_PER_ROUTE} per route)"
        ));
    }
    let spec = spec_of(user);
    let mut new_spec = json!({"rules": out});
    for field in ["parentRefs", "hostnames"] {
        if let Some(v) = spec.get(field) {
            new_spec[field] = v.clone();
        }
    }
    let name = names::derived_http_route_name(&gr.name_any(), &user.name_any(), m.from_port);
    let obj = json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {
                labels::MANAGED_BY: labels::MANAGED_BY_VALUE,
                labels::GATEWAY_API_ROUTE: gr.name_any(),
                labels::ROUTING_KEY: route.routing_key,
                labels::SANDBOX: route.sandbox,
            },
            "annotations": {
                annotations::BASELINE: format!("HTTPRoute/{ns}/{}", user.name_any()),
            },
            "ownerReferences": gr.controller_owner_ref(&()).into_iter().collect::<Vec<_>>(),
        },
        "spec": new_spec,
    });
    serde_json::from_value(obj).map_err(|e| format!("cannot build the derived route: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use spur_api::GatewayAPIRouteSpec;

    fn gar() -> GatewayAPIRoute {
        let mut g = GatewayAPIRoute::new(
            "sb1-web-0123456789",
            GatewayAPIRouteSpec {
                routing_key: "k1".into(),
                sandbox: "sb1".into(),
                target_service: ServiceRef {
                    namespace: "shop".into(),
                    name: "web".into(),
                },
                mappings: vec![PortMapping {
                    from_port: 80,
                    to_service: "sb1-web".into(),
                    to_port: 80,
                }],
            },
        );
        g.meta_mut().uid = Some("u-1".into());
        g
    }

    fn user(rules: Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": "shop", "namespace": "shop"},
            "spec": {"parentRefs": [{"name": "gw"}], "hostnames": ["shop.example"], "rules": rules}
        }))
        .unwrap()
    }

    #[test]
    fn derived_rules_and_each_match_with_each_carrier_send_to_the_sandbox() {
        let g = gar();
        let u = user(json!([
            {"matches": [{"path": {"type": "PathPrefix", "value": "/api"}},
                         {"path": {"type": "Exact", "value": "/x"},
                          "headers": [{"type": "Exact", "name": "Baggage", "value": "v"}]}],
             "filters": [{"type": "RequestHeaderModifier", "requestHeaderModifier": {"add": [{"name": "a", "value": "b"}]}}],
             "backendRefs": [{"name": "web", "port": 80, "weight": 90}, {"name": "other", "port": 80, "weight": 10}]},
            {"backendRefs": [{"name": "other", "port": 80}]},
            {"backendRefs": [{"name": "web", "port": 8080}]},
        ]));
        assert!(references(&u, &g.spec.target_service));
        let d = derive(&g, &u, g.spec.route(), &g.spec.mappings[0])
            .unwrap()
            .unwrap();
        assert_eq!(d.namespace().as_deref(), Some("shop"));
        assert_eq!(d.labels()[labels::GATEWAY_API_ROUTE], "sb1-web-0123456789");
        assert_eq!(d.owner_references()[0].uid, "u-1");
        let spec = spec_of(&d);
        assert_eq!(spec["parentRefs"], json!([{"name": "gw"}]));
        assert_eq!(spec["hostnames"], json!(["shop.example"]));
        let rules = spec["rules"].as_array().unwrap();
        assert_eq!(rules.len(), 1, "only the rule sending to web:80");
        let r = &rules[0];
        assert_eq!(r["backendRefs"], json!([{"name": "sb1-web", "port": 80}]));
        assert_eq!(r["filters"][0]["type"], "RequestHeaderModifier");
        let ms = r["matches"].as_array().unwrap();
        // 10 carriers for /api; 9 for /x, which tests baggage itself already.
        assert_eq!(ms.len(), 10 + 9);
        assert_eq!(ms[0]["path"]["value"], "/api");
        assert_eq!(ms[0]["headers"][0]["name"], "baggage");
        assert_eq!(ms[0]["headers"][0]["type"], "RegularExpression");
        assert_eq!(ms[2]["headers"][0]["type"], "Exact");
        assert_eq!(ms[2]["headers"][0]["value"], "k1");
        assert_eq!(ms[10]["headers"].as_array().unwrap().len(), 2);
        assert_eq!(ms[10]["headers"][1]["name"], "tracestate");

        // No rule sends to web on port 9090: nothing to derive.
        let other_port = PortMapping {
            from_port: 9090,
            to_service: "sb1-web".into(),
            to_port: 9090,
        };
        assert!(
            derive(&g, &u, g.spec.route(), &other_port)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn rules_without_matches_get_the_default_and_bounds_are_reported() {
        let g = gar();
        let u = user(json!([{"backendRefs": [{"name": "web", "namespace": "shop", "port": 80}]}]));
        let d = derive(&g, &u, g.spec.route(), &g.spec.mappings[0])
            .unwrap()
            .unwrap();
        let ms = spec_of(&d)["rules"][0]["matches"]
            .as_array()
            .unwrap()
            .clone();
        assert_eq!(ms.len(), 10);
        assert_eq!(ms[0]["path"], json!({"type": "PathPrefix", "value": "/"}));

        let many: Vec<Value> = (0..7)
            .map(|i| json!({"path": {"type": "PathPrefix", "value": format!("/{i}")}}))
            .collect();
        let u = user(json!([{"matches": many, "backendRefs": [{"name": "web", "port": 80}]}]));
        let err = derive(&g, &u, g.spec.route(), &g.spec.mappings[0]).unwrap_err();
        assert!(err.contains("70 matches"), "{err}");

        let elsewhere =
            user(json!([{"backendRefs": [{"name": "web", "namespace": "other", "port": 80}]}]));
        assert!(!references(&elsewhere, &g.spec.target_service));
    }
}
